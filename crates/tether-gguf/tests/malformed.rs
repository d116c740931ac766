//! A malformed GGUF is a typed error, never a panic: the tiny qwen2 GGUF of tests/data patched
//! to be inconsistent in each way the loader must catch before any kernel runs (the kernels
//! `assert!` their slice lengths), and random byte flips and truncations of it.
//!
//! "Never a panic" is checked with a panic hook that counts every panic in the process, since
//! loading runs under `catch_unwind` (a panic would otherwise surface as an `Inference` error
//! and look handled).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use proptest::prelude::*;
use tether_gguf::{GgufError, GgufModel};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Installs (once) a hook that counts panics and then reports them as the default hook does.
fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// Held by every test here: the panic counter is process-wide, and one test makes candle panic
/// on purpose (caught), so the tests take turns.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static M: std::sync::Mutex<()> = std::sync::Mutex::new(());
    M.lock().unwrap_or_else(|p| p.into_inner())
}

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiny-qwen2.gguf")
}

/// Loads `path`; every outcome must come without a panic anywhere.
fn load(path: &Path) -> Result<GgufModel, GgufError> {
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let r = GgufModel::builder(path).threads(1).context(64).build();
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        before,
        "loading {} panicked (caught as {r:?})",
        path.display()
    );
    r
}

fn load_err(path: &Path) -> GgufError {
    match load(path) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e,
    }
}

/// The tiny GGUF's metadata and tensors, to write back changed.
struct Parts {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, QTensor)>,
}

impl Parts {
    fn read() -> Self {
        let mut f = std::fs::File::open(tiny()).expect("open");
        let ct = gguf_file::Content::read(&mut f).expect("header");
        let mut metadata: Vec<(String, Value)> =
            ct.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        metadata.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tensors: Vec<(String, QTensor)> = ct
            .tensor_infos
            .keys()
            .map(|n| (n.clone(), ct.tensor(&mut f, n, &Device::Cpu).expect("tensor")))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Parts { metadata, tensors }
    }

    fn set(mut self, key: &str, v: Value) -> Self {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_owned(), v));
        self
    }

    fn tensor(mut self, name: &str, t: QTensor) -> Self {
        self.tensors.retain(|(n, _)| n != name);
        self.tensors.push((name.to_owned(), t));
        self
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        let md: Vec<(&str, &Value)> = self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = self.tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut f = std::fs::File::create(&p).expect("create");
        gguf_file::write(&mut f, &md, &ts).expect("write");
        p
    }
}

fn q8(rows: usize, cols: usize) -> QTensor {
    let t = Tensor::ones((rows, cols), candle_core::DType::F32, &Device::Cpu).expect("tensor");
    QTensor::quantize(&t, GgmlDType::Q8_0).expect("quantize")
}

fn corrupt_mentions(e: &GgufError, what: &str) {
    match e {
        GgufError::Corrupt(m) => assert!(m.contains(what), "{m:?} lacks {what:?}"),
        other => panic!("expected Corrupt({what:?}..), got {other:?}"),
    }
}

#[test]
fn the_unpatched_file_loads_and_runs() {
    let _serial = serial();
    let m = load(&tiny()).expect("loads");
    assert_eq!(m.greedy("Hello", 2).expect("runs").len(), 2);
}

#[test]
fn hyper_parameters_that_disagree_are_corrupt() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // 3 heads do not divide 64.
    let p = Parts::read().set("qwen2.attention.head_count", Value::U32(3));
    corrupt_mentions(&load_err(&p.write(dir.path(), "heads.gguf")), "do not divide");
    // More kv heads than heads.
    let p = Parts::read().set("qwen2.attention.head_count_kv", Value::U32(8));
    corrupt_mentions(
        &load_err(&p.write(dir.path(), "kv.gguf")),
        "inconsistent attention",
    );
    // A corrupt kv head count is an error, not the head count by default.
    let p = Parts::read().set("qwen2.attention.head_count_kv", Value::U32(0));
    corrupt_mentions(&load_err(&p.write(dir.path(), "kv0.gguf")), "head_count_kv");
    // Heads that divide the width but do not match the tensors: q is [64, 64], not [64, 40].
    let p = Parts::read()
        .set("qwen2.attention.head_count", Value::U32(4))
        .set("qwen2.attention.key_length", Value::U32(10));
    corrupt_mentions(&load_err(&p.write(dir.path(), "keylen.gguf")), "has shape");
    // Non-finite and out-of-range floats.
    let p = Parts::read().set("qwen2.rope.freq_base", Value::F32(f32::NAN));
    corrupt_mentions(&load_err(&p.write(dir.path(), "rope.gguf")), "freq_base");
    let p = Parts::read().set("qwen2.attention.layer_norm_rms_epsilon", Value::F32(-1.0));
    corrupt_mentions(&load_err(&p.write(dir.path(), "eps.gguf")), "epsilon");
    // A million blocks in a file of 27 tensors.
    let p = Parts::read().set("qwen2.block_count", Value::U32(1_000_000));
    corrupt_mentions(&load_err(&p.write(dir.path(), "blocks.gguf")), "blocks");
    // The embedding width is not the hidden size.
    let p = Parts::read().set("qwen2.embedding_length", Value::U32(96));
    corrupt_mentions(&load_err(&p.write(dir.path(), "width.gguf")), "token_embd.weight");
}

#[test]
fn tensors_that_disagree_with_the_hyper_parameters_are_corrupt() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // k projection [64 out, 64 in] where 2 kv heads of 16 need [32, 64].
    let p = Parts::read().tensor("blk.1.attn_k.weight", q8(64, 64));
    let e = load_err(&p.write(dir.path(), "k.gguf"));
    corrupt_mentions(&e, "blk.1.attn_k.weight");
    // A bias of the wrong length.
    let bias = QTensor::quantize(
        &Tensor::zeros(7, candle_core::DType::F32, &Device::Cpu).expect("t"),
        GgmlDType::F32,
    )
    .expect("q");
    let p = Parts::read().tensor("blk.0.attn_q.bias", bias);
    corrupt_mentions(&load_err(&p.write(dir.path(), "bias.gguf")), "blk.0.attn_q.bias");
    // An untied output with fewer rows than the vocabulary.
    let p = Parts::read().tensor("output.weight", q8(100, 64));
    corrupt_mentions(&load_err(&p.write(dir.path(), "out.gguf")), "output.weight");
}

#[test]
fn a_vocabulary_larger_than_the_embedding_is_corrupt() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let parts = Parts::read();
    let get = |k: &str| match parts.metadata.iter().find(|(n, _)| n == k) {
        Some((_, Value::Array(a))) => a.clone(),
        other => panic!("{k}: {other:?}"),
    };
    let mut tokens = get("tokenizer.ggml.tokens");
    let mut types = get("tokenizer.ggml.token_type");
    for i in 0..10 {
        tokens.push(Value::String(format!("<extra_{i}>")));
        types.push(Value::I32(1));
    }
    let p = parts
        .set("tokenizer.ggml.tokens", Value::Array(tokens))
        .set("tokenizer.ggml.token_type", Value::Array(types));
    corrupt_mentions(&load_err(&p.write(dir.path(), "vocab.gguf")), "rows for");
}

#[test]
fn a_zero_alignment_is_corrupt() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // candle's reader divides by it; the loader must not let that panic out.
    let p = dir.path().join("align.gguf");
    let parts = Parts::read();
    // Write with a normal alignment, then patch the value in place (the writer itself aligns by
    // it).
    let parts = parts.set("general.alignment", Value::U32(32));
    let written = parts.write(dir.path(), "a.gguf");
    let mut bytes = std::fs::read(&written).expect("read");
    let key = b"general.alignment";
    let at = bytes.windows(key.len()).position(|w| w == key).expect("key") + key.len();
    // value type (u32 = 4), then the value.
    assert_eq!(&bytes[at..at + 4], &4u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    std::fs::write(&p, &bytes).expect("write");
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let r = GgufModel::builder(&p).threads(1).build();
    // candle panics inside; read_header catches exactly that one and says so.
    assert!(PANICS.load(Ordering::SeqCst) - before <= 1);
    match r {
        Err(GgufError::Corrupt(m)) => assert!(m.contains("alignment"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// Where a tensor's info sits in the file: the byte after its name (n_dims u32, dims u64 ×
/// n_dims, type u32, offset u64 follow).
fn info_at(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .expect("tensor info")
        + key.len()
}

#[test]
fn tensor_infos_patched_in_place_are_typed_errors() {
    let _serial = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes = std::fs::read(tiny()).expect("read");
    let patched = |name: &str, f: &dyn Fn(&mut [u8], usize)| -> PathBuf {
        let mut b = bytes.clone();
        let at = info_at(&b, name);
        f(&mut b, at);
        let p = dir.path().join(format!("{}.gguf", name.replace('.', "_")));
        std::fs::write(&p, &b).expect("write");
        p
    };
    // blk.0.attn_norm.weight: 1 dim (F32). Its data offset far past the end of the file.
    let p = patched("blk.0.attn_norm.weight", &|b, at| {
        let off = at + 4 + 8 + 4;
        b[off..off + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    });
    assert!(matches!(load_err(&p), GgufError::Truncated { .. }));
    // output.weight [64, 509] Q8_0: 100,000 rows, data past the end of the file.
    let p = patched("output.weight", &|b, at| {
        let ne1 = at + 4 + 8;
        b[ne1..ne1 + 8].copy_from_slice(&100_000u64.to_le_bytes());
    });
    let e = load_err(&p);
    assert!(matches!(e, GgufError::Truncated { .. }), "{e:?}");
    // blk.0.attn_q.weight Q8_0 with rows of 48 (not whole blocks of 32); 48 × 64 elements
    // are still a whole number of blocks, so only the row check can refuse it.
    let p = patched("blk.0.attn_q.weight", &|b, at| {
        let ne0 = at + 4;
        b[ne0..ne0 + 8].copy_from_slice(&48u64.to_le_bytes());
    });
    corrupt_mentions(&load_err(&p), "block");
    // A tensor type the kernels cannot run (Q8_1 is an activation type).
    let p = patched("blk.0.ffn_up.weight", &|b, at| {
        let ty = at + 4 + 16;
        b[ty..ty + 4].copy_from_slice(&9u32.to_le_bytes());
    });
    corrupt_mentions(&load_err(&p), "cannot be run");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, failure_persistence: None, ..ProptestConfig::default() })]

    /// Random byte changes anywhere in the header (and a few in the data) and random
    /// truncations: loading gives a model or a typed error, never a panic; a model that loads
    /// runs a few tokens without one.
    #[test]
    fn flips_and_truncations_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), any::<bool>()), 1..6),
        cut in proptest::option::weighted(0.25, any::<prop::sample::Index>()),
    ) {
        let _serial = serial();
        let bytes = std::fs::read(tiny()).expect("read");
        // The header is the first ~14 KB (vocabulary, merges, tensor infos).
        let header = 14_000.min(bytes.len());
        let mut b = bytes.clone();
        for (i, v, in_data) in &flips {
            let at = if *in_data { i.index(b.len()) } else { i.index(header) };
            b[at] ^= v | 1;
        }
        if let Some(c) = cut {
            b.truncate(c.index(b.len()));
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("x.gguf");
        std::fs::write(&p, &b).expect("write");
        if let Ok(m) = load(&p) {
            let before = PANICS.load(Ordering::SeqCst);
            let _ = m.greedy("Hello, world", 3);
            prop_assert_eq!(PANICS.load(Ordering::SeqCst), before, "running the loaded model panicked");
        }
    }
}
