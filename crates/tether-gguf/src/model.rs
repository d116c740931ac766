//! The transformer: llama (SmolLM2, Llama 2/3, Mistral), qwen2 and qwen3 decoder stacks over
//! candle's quantized tensors, with a KV cache that can be cut back to any prefix.
//!
//! Written here rather than taken from `candle-transformers` because the embedded model needs
//! three things those models do not give: logits for every position of a batch (perplexity),
//! truncating the KV cache to the longest common prefix of the next prompt (so a follow-up turn
//! pre-fills only its new tokens), and the token embedding kept quantized (candle's
//! `quantized_llama` dequantizes it to f32: 113 MB for SmolLM2's 49,152 × 576 table, more than the
//! whole GGUF). It also keeps `candle-transformers` and its hundreds of models out of the build.

use std::collections::HashMap;
use std::io::{Read, Seek};

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{Device, Tensor};
use rayon::prelude::*;

use crate::kernels::{self, BlockQ8, Mat};

use crate::error::GgufError;

/// The architectures this crate runs, from `general.architecture`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Arch {
    /// `llama`: Llama 2/3, SmolLM, Mistral-style (interleaved RoPE).
    Llama,
    /// `qwen2`: Qwen 2 / 2.5 (biases on q/k/v, NeoX RoPE).
    Qwen2,
    /// `qwen3`: Qwen 3 (per-head q/k RMS norms, NeoX RoPE).
    Qwen3,
}

impl Arch {
    /// The architecture named in a GGUF, or [`GgufError::UnsupportedArchitecture`].
    pub fn from_name(name: &str) -> Result<Self, GgufError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            other => Err(GgufError::UnsupportedArchitecture(other.to_owned())),
        }
    }

    /// The GGUF name (`llama`, `qwen2`, `qwen3`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// Hyper-parameters read from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The architecture.
    pub arch: Arch,
    /// Number of decoder blocks.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention).
    pub n_kv_head: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// RMS norm epsilon.
    pub eps: f64,
    /// RoPE base frequency.
    pub rope_base: f32,
    /// The context length the model was trained for.
    pub context_length: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
}

struct Layer {
    attn_norm: Vec<f32>,
    /// q, k and v stacked (one product) or, when their types differ, apart.
    qkv: Proj,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: Mat,
    ffn_norm: Vec<f32>,
    /// gate and up, stacked or apart.
    gate_up: Proj,
    down: Mat,
}

/// Products that read the same input: one stacked matrix when their types allow, else each.
enum Proj {
    Stacked(Mat),
    Apart(Vec<Mat>),
}

impl Proj {
    fn new(parts: Vec<Mat>) -> Self {
        match Mat::stack(parts) {
            Ok(m) => Proj::Stacked(m),
            Err(parts) => Proj::Apart(parts),
        }
    }

    /// `out[t, Σn]`: the parts' outputs side by side for each row.
    fn matmul(
        &self,
        x: &[f32],
        xq: &[BlockQ8],
        t: usize,
        out: &mut Vec<f32>,
        part: &mut Vec<f32>,
        tmp: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        match self {
            Proj::Stacked(m) => m.matmul(x, xq, t, out, tmp),
            Proj::Apart(parts) => {
                let total: usize = parts.iter().map(Mat::n).sum();
                out.clear();
                out.resize(t * total, 0.0);
                let mut off = 0;
                for m in parts {
                    let n = m.n();
                    m.matmul(x, xq, t, part, tmp)?;
                    for i in 0..t {
                        out[i * total + off..i * total + off + n].copy_from_slice(&part[i * n..(i + 1) * n]);
                    }
                    off += n;
                }
                Ok(())
            }
        }
    }
}

/// Buffers reused across layers (and, in a cache, across calls).
#[derive(Default)]
struct Scratch {
    h: Vec<f32>,
    hq: Vec<BlockQ8>,
    proj: Vec<f32>,
    part: Vec<f32>,
    tmp: Vec<f32>,
    att: Vec<f32>,
    out: Vec<f32>,
    act: Vec<f32>,
}

/// The weights, shared by every [`Cache`] (read-only once loaded).
pub struct Weights {
    /// The hyper-parameters.
    pub cfg: ModelConfig,
    embed: std::sync::Arc<Mat>,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    output: std::sync::Arc<Mat>,
    /// `[max_context, head_dim/2]` cosines and sines of the RoPE angles.
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_pos: usize,
    /// Bytes of tensor data loaded.
    pub bytes: u64,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("cfg", &self.cfg).finish()
    }
}

/// One sequence's KV cache: per layer, keys and values of every position so far, position by
/// position (`[cap, kv_heads·head_dim]`), so a step appends a row, growing means a larger
/// buffer and a copy of what is held, and cutting back to any length copies nothing.
#[derive(Debug)]
pub struct Cache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    cap: usize,
}

impl Cache {
    /// An empty cache for `w`.
    pub fn new(w: &Weights) -> Self {
        Cache {
            k: vec![Vec::new(); w.cfg.n_layer],
            v: vec![Vec::new(); w.cfg.n_layer],
            len: 0,
            cap: 0,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `n` on (the next batch starts at `n`).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    fn ensure(&mut self, w: &Weights, need: usize) {
        if need <= self.cap {
            return;
        }
        let new_cap = need.max(self.cap * 2).max(256).next_multiple_of(256);
        let kvd = w.cfg.n_kv_head * w.cfg.head_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            // Zeroed by the allocator: pages are touched only when a position is written.
            let mut fresh = vec![0f32; new_cap * kvd];
            fresh[..self.len * kvd].copy_from_slice(&buf[..self.len * kvd]);
            *buf = fresh;
        }
        self.cap = new_cap;
    }
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, GgufError> {
    ct.metadata
        .get(key)
        .ok_or_else(|| GgufError::MissingMetadata(key.to_owned()))
}

/// A count in the metadata: `None` when the key is absent, an error when it is there but not a
/// count in range (a corrupt value is never silently replaced by a default).
fn md_usize_opt(ct: &gguf_file::Content, key: &str) -> Result<Option<usize>, GgufError> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    let n = v
        .to_u64()
        .ok()
        .or_else(|| v.to_u32().ok().map(u64::from))
        .or_else(|| v.to_i32().ok().and_then(|x| u64::try_from(x).ok()))
        .ok_or_else(|| GgufError::Corrupt(format!("metadata `{key}` is not a count: {v:?}")))?;
    usize::try_from(n)
        .ok()
        .filter(|n| *n > 0 && *n <= 1 << 24)
        .map(Some)
        .ok_or_else(|| GgufError::Corrupt(format!("metadata `{key}` = {n} is out of range")))
}

fn md_usize(ct: &gguf_file::Content, key: &str) -> Result<usize, GgufError> {
    md_usize_opt(ct, key)?.ok_or_else(|| GgufError::MissingMetadata(key.to_owned()))
}

/// A float in the metadata: `None` when absent, an error when not a finite number.
fn md_f32(ct: &gguf_file::Content, key: &str) -> Result<Option<f32>, GgufError> {
    let Some(v) = ct.metadata.get(key) else {
        return Ok(None);
    };
    match v.to_f32().ok().or_else(|| v.to_f64().ok().map(|x| x as f32)) {
        Some(x) if x.is_finite() => Ok(Some(x)),
        _ => Err(GgufError::Corrupt(format!(
            "metadata `{key}` is not a finite number: {v:?}"
        ))),
    }
}

/// Reads the hyper-parameters of a GGUF's model, checked against each other and against the
/// token embedding's shape (every tensor's shape is checked against them when it is loaded).
pub fn config_of(ct: &gguf_file::Content) -> Result<ModelConfig, GgufError> {
    let arch_name = md(ct, "general.architecture")?
        .to_string()
        .map_err(|_| GgufError::Corrupt("`general.architecture` is not a string".into()))?
        .clone();
    let arch = Arch::from_name(&arch_name)?;
    let p = |k: &str| format!("{arch_name}.{k}");
    let n_embd = md_usize(ct, &p("embedding_length"))?;
    let n_head = md_usize(ct, &p("attention.head_count"))?;
    let n_kv_head = md_usize_opt(ct, &p("attention.head_count_kv"))?.unwrap_or(n_head);
    let head_dim = match md_usize_opt(ct, &p("attention.key_length"))? {
        Some(n) => n,
        None if n_embd % n_head == 0 => n_embd / n_head,
        None => {
            return Err(GgufError::Corrupt(format!(
                "{n_head} attention heads do not divide the embedding width {n_embd}"
            )));
        }
    };
    if n_kv_head > n_head || n_head % n_kv_head != 0 || head_dim % 2 != 0 {
        return Err(GgufError::Corrupt(format!(
            "inconsistent attention shape: {n_head} heads, {n_kv_head} kv heads, head dim {head_dim}"
        )));
    }
    let eps = md_f32(ct, &p("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6);
    if !(0.0..1.0).contains(&eps) {
        return Err(GgufError::Corrupt(format!(
            "RMS norm epsilon {eps} is out of range"
        )));
    }
    let rope_base = md_f32(ct, &p("rope.freq_base"))?.unwrap_or(10_000.0);
    if rope_base <= 1.0 {
        return Err(GgufError::Corrupt(format!(
            "RoPE base {rope_base} is out of range"
        )));
    }
    let context_length = md_usize_opt(ct, &p("context_length"))?.unwrap_or(4096);
    let n_layer = md_usize(ct, &p("block_count"))?;
    // Each block has at least nine tensors: a count past that is corrupt, not a reason to
    // reserve room for millions of layers.
    if n_layer > ct.tensor_infos.len() / 9 {
        return Err(GgufError::Corrupt(format!(
            "{n_layer} blocks, but the file has {} tensors",
            ct.tensor_infos.len()
        )));
    }
    let embd = ct
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    let vocab = match embd.shape.dims() {
        [v, d] if *d == n_embd && *v > 0 => *v,
        dims => {
            return Err(GgufError::Corrupt(format!(
                "tensor `token_embd.weight` has shape {dims:?}, expected [vocabulary, {n_embd}]"
            )));
        }
    };
    Ok(ModelConfig {
        arch,
        n_layer,
        n_embd,
        n_head,
        n_kv_head,
        head_dim,
        eps: f64::from(eps),
        rope_base,
        context_length,
        vocab,
    })
}

/// Checks every tensor's header against the file before any is read: a type this crate runs,
/// a shape whose size does not overflow, rows a whole number of blocks long (the kernels index
/// by block), and data that lies inside the file (`file_len` bytes).
pub fn check_tensors(ct: &gguf_file::Content, file_len: u64) -> Result<(), GgufError> {
    for (name, t) in &ct.tensor_infos {
        let d = t.ggml_dtype;
        if !dtype_supported(d) {
            return Err(GgufError::Corrupt(format!(
                "tensor `{name}` has type {d:?}, which cannot be run"
            )));
        }
        let dims = t.shape.dims();
        let elems = dims
            .iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x))
            .filter(|n| *n <= 1 << 36)
            .ok_or_else(|| GgufError::Corrupt(format!("tensor `{name}` has shape {dims:?}")))?;
        let row = dims.last().copied().unwrap_or(1);
        if row % d.block_size() != 0 {
            return Err(GgufError::Corrupt(format!(
                "tensor `{name}` of type {d:?} has rows of {row}, not a multiple of its block of {}",
                d.block_size()
            )));
        }
        let bytes = (elems / d.block_size()) as u64 * d.type_size() as u64;
        let start = ct.tensor_data_offset.checked_add(t.offset);
        match start.and_then(|s| s.checked_add(bytes)) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(GgufError::Truncated {
                    message: format!(
                        "tensor `{name}` needs {bytes} bytes at offset {} of the data, past the end of the {file_len}-byte file",
                        t.offset
                    ),
                });
            }
        }
    }
    Ok(())
}

struct Loader<'a, R> {
    ct: &'a gguf_file::Content,
    r: &'a mut R,
    bytes: u64,
}

impl<R: Read + Seek> Loader<'_, R> {
    fn q(&mut self, name: &str, dims: &[usize]) -> Result<QTensor, GgufError> {
        let info = self
            .ct
            .tensor_infos
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        if info.shape.dims() != dims {
            return Err(GgufError::Corrupt(format!(
                "tensor `{name}` has shape {:?}, expected {dims:?}",
                info.shape.dims()
            )));
        }
        let t = info
            .read(self.r, self.ct.tensor_data_offset, &Device::Cpu)
            .map_err(|e| GgufError::corrupt_or_truncated(name, e))?;
        self.bytes += t.storage_size_in_bytes() as u64;
        Ok(t)
    }

    fn has(&self, name: &str) -> bool {
        self.ct.tensor_infos.contains_key(name)
    }

    fn mm(&mut self, name: &str, dims: &[usize]) -> Result<Mat, GgufError> {
        let t = self.q(name, dims)?;
        Mat::new(t)
    }

    fn vec(&mut self, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
        self.q(name, &[n])?
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(GgufError::candle)
    }
}

impl Weights {
    /// Loads the weights of `ct` from `r` (the same file).
    pub fn load<R: Read + Seek>(
        ct: &gguf_file::Content,
        r: &mut R,
        max_context: usize,
    ) -> Result<Self, GgufError> {
        let file_len = r
            .seek(std::io::SeekFrom::End(0))
            .map_err(|e| GgufError::Corrupt(format!("cannot seek in the file: {e}")))?;
        check_tensors(ct, file_len)?;
        let cfg = config_of(ct)?;
        let (d, hd) = (cfg.n_embd, cfg.head_dim);
        let qd = cfg.n_head * hd;
        let kvd = cfg.n_kv_head * hd;
        let mut ld = Loader { ct, r, bytes: 0 };
        let embed = Arc::new(ld.mm("token_embd.weight", &[cfg.vocab, d])?);
        let output = if ld.has("output.weight") {
            Arc::new(ld.mm("output.weight", &[cfg.vocab, d])?)
        } else {
            // Tied embeddings (SmolLM2, small Qwens): the output projection is the embedding.
            embed.clone()
        };
        let norm = ld.vec("output_norm.weight", d)?;
        let ff = ct
            .tensor_infos
            .get("blk.0.ffn_up.weight")
            .map(|t| t.shape.dims().first().copied().unwrap_or(0))
            .ok_or_else(|| GgufError::MissingTensor("blk.0.ffn_up.weight".into()))?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let opt = |ld: &mut Loader<'_, R>, s: &str, len: usize| -> Result<Option<Vec<f32>>, GgufError> {
                let name = n(s);
                if ld.has(&name) {
                    ld.vec(&name, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let qkv = Proj::new(vec![
                ld.mm(&n("attn_q.weight"), &[qd, d])?,
                ld.mm(&n("attn_k.weight"), &[kvd, d])?,
                ld.mm(&n("attn_v.weight"), &[kvd, d])?,
            ]);
            let layer = Layer {
                attn_norm: ld.vec(&n("attn_norm.weight"), d)?,
                qkv,
                bq: opt(&mut ld, "attn_q.bias", qd)?,
                bk: opt(&mut ld, "attn_k.bias", kvd)?,
                bv: opt(&mut ld, "attn_v.bias", kvd)?,
                q_norm: opt(&mut ld, "attn_q_norm.weight", hd)?,
                k_norm: opt(&mut ld, "attn_k_norm.weight", hd)?,
                wo: ld.mm(&n("attn_output.weight"), &[d, qd])?,
                ffn_norm: ld.vec(&n("ffn_norm.weight"), d)?,
                gate_up: Proj::new(vec![
                    ld.mm(&n("ffn_gate.weight"), &[ff, d])?,
                    ld.mm(&n("ffn_up.weight"), &[ff, d])?,
                ]),
                down: ld.mm(&n("ffn_down.weight"), &[d, ff])?,
            };
            if cfg.arch == Arch::Qwen3 && (layer.q_norm.is_none() || layer.k_norm.is_none()) {
                return Err(GgufError::MissingTensor(n("attn_q_norm.weight")));
            }
            layers.push(layer);
        }
        let bytes = ld.bytes;
        let (cos, sin) = rope_tables(hd, cfg.rope_base, max_context);
        Ok(Weights {
            cfg,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            max_pos: max_context,
            bytes,
        })
    }

    /// Runs `tokens` at positions `cache.len()..`, appending them to the cache, and returns the
    /// logits of the last position (`all == false`, shape `[vocab]`) or of every position
    /// (`[tokens.len(), vocab]`).
    ///
    /// Hand-written over flat buffers and this crate's own kernels (the private `kernels`
    /// module) rather than as candle ops: at 576 wide, candle's per-op allocation and dispatch
    /// cost more than the arithmetic (see that module).
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache, all: bool) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        if t == 0 {
            candle_core::bail!("no tokens to run");
        }
        let pos = cache.len;
        if pos + t > self.max_pos {
            candle_core::bail!(
                "position {} is past the context window of {}",
                pos + t,
                self.max_pos
            );
        }
        cache.ensure(self, pos + t);
        let cfg = &self.cfg;
        let (d, nh, nkv, hd) = (cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let g = nh / nkv;
        let half = hd / 2;
        let scale = 1.0 / (hd as f32).sqrt();
        let eps = cfg.eps as f32;
        let mut x = vec![0f32; t * d];
        for (row, &tok) in x.chunks_exact_mut(d).zip(tokens) {
            self.embed.row(tok as usize, row)?;
        }
        let mut s = Scratch::default();
        let kv_len = pos + t;
        for (li, l) in self.layers.iter().enumerate() {
            kernels::rms_norm(&x, &l.attn_norm, eps, &mut s.h);
            kernels::quantize(&s.h, &mut s.hq);
            l.qkv
                .matmul(&s.h, &s.hq, t, &mut s.proj, &mut s.part, &mut s.tmp)?;
            let w = qd + 2 * kvd;
            let (kc, vc) = (&mut cache.k[li], &mut cache.v[li]);
            for (i, row) in s.proj.chunks_exact_mut(w).enumerate() {
                let (q, rest) = row.split_at_mut(qd);
                let (k, v) = rest.split_at_mut(kvd);
                for (b, y) in [(&l.bq, &mut *q), (&l.bk, &mut *k), (&l.bv, &mut *v)] {
                    if let Some(b) = b {
                        for (y, b) in y.iter_mut().zip(b) {
                            *y += b;
                        }
                    }
                }
                if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                    kernels::rms_norm_in_place(q, qn, eps);
                    kernels::rms_norm_in_place(k, kn, eps);
                }
                let p = pos + i;
                let (cos, sin) = (
                    &self.cos[p * half..(p + 1) * half],
                    &self.sin[p * half..(p + 1) * half],
                );
                for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                    rope(head, cos, sin, cfg.arch);
                }
                // llama.cpp keeps K and V in f16 and converts Q to f16 for the K product (its
                // default cache type and flash attention): the same rounding here, so our
                // attention scores round as the reference's do.
                for (c, x) in kc[p * kvd..(p + 1) * kvd].iter_mut().zip(k.iter()) {
                    *c = half::f16::from_f32(*x).to_f32();
                }
                for (c, x) in vc[p * kvd..(p + 1) * kvd].iter_mut().zip(v.iter()) {
                    *c = half::f16::from_f32(*x).to_f32();
                }
                for x in q.iter_mut() {
                    *x = half::f16::from_f32(*x).to_f32();
                }
            }
            // Attention, one task per (token, head): scores over the positions it may see,
            // softmax, the weighted sum of values.
            let (kc, vc) = (&cache.k[li][..kv_len * kvd], &cache.v[li][..kv_len * kvd]);
            let proj = &s.proj;
            s.att.clear();
            s.att.resize(t * qd, 0.0);
            s.att
                .par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores: &mut Vec<f32>, (ih, y)| {
                    let (i, h) = (ih / nh, ih % nh);
                    let q = &proj[i * w + h * hd..i * w + (h + 1) * hd];
                    let kvh = h / g;
                    let n = pos + i + 1;
                    scores.clear();
                    scores.extend((0..n).map(|j| {
                        kernels::dot_f32(q, &kc[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd]) * scale
                    }));
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f64;
                    for v in scores.iter_mut() {
                        *v = (*v - max).exp();
                        sum += f64::from(*v);
                    }
                    let inv = (1.0 / sum) as f32;
                    for (j, p) in scores.iter().enumerate() {
                        kernels::axpy(y, p * inv, &vc[j * kvd + kvh * hd..j * kvd + (kvh + 1) * hd]);
                    }
                });
            kernels::quantize(&s.att, &mut s.hq);
            l.wo.matmul(&s.att, &s.hq, t, &mut s.out, &mut s.tmp)?;
            for (x, y) in x.iter_mut().zip(&s.out) {
                *x += y;
            }
            kernels::rms_norm(&x, &l.ffn_norm, eps, &mut s.h);
            kernels::quantize(&s.h, &mut s.hq);
            l.gate_up
                .matmul(&s.h, &s.hq, t, &mut s.proj, &mut s.part, &mut s.tmp)?;
            let ff = s.proj.len() / t / 2;
            s.act.clear();
            for row in s.proj.chunks_exact(2 * ff) {
                let (gate, up) = row.split_at(ff);
                s.act
                    .extend(gate.iter().zip(up).map(|(g, u)| g / (1.0 + (-g).exp()) * u));
            }
            kernels::quantize(&s.act, &mut s.hq);
            l.down.matmul(&s.act, &s.hq, t, &mut s.out, &mut s.tmp)?;
            for (x, y) in x.iter_mut().zip(&s.out) {
                *x += y;
            }
        }
        cache.len = kv_len;
        let rows = if all { t } else { 1 };
        let last = &x[(t - rows) * d..];
        kernels::rms_norm(last, &self.norm, eps, &mut s.h);
        kernels::quantize(&s.h, &mut s.hq);
        let mut logits = Vec::new();
        self.output.matmul(&s.h, &s.hq, rows, &mut logits, &mut s.tmp)?;
        let vocab = self.output.n();
        if all {
            Tensor::from_vec(logits, (t, vocab), &Device::Cpu)
        } else {
            Tensor::from_vec(logits, vocab, &Device::Cpu)
        }
    }

    /// Tensor types in use, for the log line.
    pub fn describe(ct: &gguf_file::Content) -> String {
        let mut counts: HashMap<String, usize> = HashMap::new();
        for t in ct.tensor_infos.values() {
            *counts.entry(format!("{:?}", t.ggml_dtype)).or_default() += 1;
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort();
        v.iter()
            .map(|(k, n)| format!("{n}×{k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Whether candle can run this tensor type (F32/F16/BF16 and the ggml block formats).
pub fn dtype_supported(d: GgmlDType) -> bool {
    !matches!(d, GgmlDType::Q8_1 | GgmlDType::Q8K)
}

fn rope_tables(hd: usize, base: f32, max: usize) -> (Vec<f32>, Vec<f32>) {
    let half = hd / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf(2.0 * i as f32 / hd as f32))
        .collect();
    let mut cos = Vec::with_capacity(max * half);
    let mut sin = Vec::with_capacity(max * half);
    for p in 0..max {
        for f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// Rotates one head in place: adjacent pairs for llama (ggml's normal mode), the two halves for
/// qwen (NeoX mode).
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32], arch: Arch) {
    let half = x.len() / 2;
    for (i, (c, s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = match arch {
            Arch::Llama => (2 * i, 2 * i + 1),
            Arch::Qwen2 | Arch::Qwen3 => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/// Log-softmax of one row of logits at `target`: the log-probability the model gave it.
pub fn log_prob(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| ((x as f64) - max).exp()).sum();
    logits
        .get(target)
        .map(|&x| x as f64 - max - sum.ln())
        .unwrap_or(f64::NEG_INFINITY)
}
