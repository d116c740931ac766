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

use candle_core::quantized::{GgmlDType, QMatMul, QTensor, gguf_file};
use candle_core::{D, DType, Device, Module, Tensor};

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

struct Attn {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
}

struct Layer {
    attn_norm: Tensor,
    attn: Attn,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// The weights, shared by every [`Cache`] (read-only once loaded).
pub struct Weights {
    /// The hyper-parameters.
    pub cfg: ModelConfig,
    embed: QMatMul,
    layers: Vec<Layer>,
    norm: Tensor,
    output: Linear,
    cos: Tensor,
    sin: Tensor,
    /// Bytes of tensor data loaded.
    pub bytes: u64,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("cfg", &self.cfg).finish()
    }
}

/// One sequence's KV cache: per layer, keys and values of every position so far, in buffers
/// that grow in steps and can be cut back to any length without copying.
#[derive(Debug)]
pub struct Cache {
    k: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    len: usize,
    cap: usize,
}

impl Cache {
    /// An empty cache for `w`.
    pub fn new(w: &Weights) -> Self {
        Cache {
            k: vec![None; w.cfg.n_layer],
            v: vec![None; w.cfg.n_layer],
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

    fn ensure(&mut self, w: &Weights, need: usize) -> candle_core::Result<()> {
        if need <= self.cap {
            return Ok(());
        }
        let new_cap = need.max(self.cap * 2).max(256).next_multiple_of(256);
        let (nkv, hd) = (w.cfg.n_kv_head, w.cfg.head_dim);
        for l in 0..w.cfg.n_layer {
            for buf in [&mut self.k[l], &mut self.v[l]] {
                let fresh = Tensor::zeros((nkv, new_cap, hd), DType::F32, &Device::Cpu)?;
                if let Some(old) = buf.as_ref()
                    && self.len > 0
                {
                    fresh.slice_set(&old.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                }
                *buf = Some(fresh);
            }
        }
        self.cap = new_cap;
        Ok(())
    }
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value, GgufError> {
    ct.metadata
        .get(key)
        .ok_or_else(|| GgufError::MissingMetadata(key.to_owned()))
}

fn md_usize(ct: &gguf_file::Content, key: &str) -> Result<usize, GgufError> {
    let v = md(ct, key)?;
    let n = v
        .to_u64()
        .ok()
        .or_else(|| v.to_u32().ok().map(u64::from))
        .or_else(|| v.to_i32().ok().and_then(|x| u64::try_from(x).ok()))
        .ok_or_else(|| GgufError::Corrupt(format!("metadata `{key}` is not a count: {v:?}")))?;
    usize::try_from(n)
        .ok()
        .filter(|n| *n > 0 && *n <= 1 << 24)
        .ok_or_else(|| GgufError::Corrupt(format!("metadata `{key}` = {n} is out of range")))
}

fn md_f32(ct: &gguf_file::Content, key: &str) -> Option<f32> {
    ct.metadata
        .get(key)
        .and_then(|v| v.to_f32().ok().or_else(|| v.to_f64().ok().map(|x| x as f32)))
}

/// Reads the hyper-parameters of a GGUF's model.
pub fn config_of(ct: &gguf_file::Content) -> Result<ModelConfig, GgufError> {
    let arch_name = md(ct, "general.architecture")?
        .to_string()
        .map_err(|_| GgufError::Corrupt("`general.architecture` is not a string".into()))?
        .clone();
    let arch = Arch::from_name(&arch_name)?;
    let p = |k: &str| format!("{arch_name}.{k}");
    let n_embd = md_usize(ct, &p("embedding_length"))?;
    let n_head = md_usize(ct, &p("attention.head_count"))?;
    let n_kv_head = md_usize(ct, &p("attention.head_count_kv")).unwrap_or(n_head);
    let head_dim = match md_usize(ct, &p("attention.key_length")) {
        Ok(n) => n,
        Err(_) => n_embd / n_head,
    };
    if n_head % n_kv_head != 0 || head_dim % 2 != 0 || head_dim == 0 {
        return Err(GgufError::Corrupt(format!(
            "inconsistent attention shape: {n_head} heads, {n_kv_head} kv heads, head dim {head_dim}"
        )));
    }
    let eps = md_f32(ct, &p("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6) as f64;
    let rope_base = md_f32(ct, &p("rope.freq_base")).unwrap_or(10_000.0);
    let context_length = md_usize(ct, &p("context_length")).unwrap_or(4096);
    let vocab = ct
        .tensor_infos
        .get("token_embd.weight")
        .map(|t| t.shape.dims().first().copied().unwrap_or(0))
        .ok_or_else(|| GgufError::MissingTensor("token_embd.weight".into()))?;
    Ok(ModelConfig {
        arch,
        n_layer: md_usize(ct, &p("block_count"))?,
        n_embd,
        n_head,
        n_kv_head,
        head_dim,
        eps,
        rope_base,
        context_length,
        vocab,
    })
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

    fn mm(&mut self, name: &str, dims: &[usize]) -> Result<Linear, GgufError> {
        let t = self.q(name, dims)?;
        Linear::new(t)
    }

    fn vec(&mut self, name: &str, n: usize) -> Result<Tensor, GgufError> {
        self.q(name, &[n])?
            .dequantize(&Device::Cpu)
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
        let cfg = config_of(ct)?;
        let (d, hd) = (cfg.n_embd, cfg.head_dim);
        let qd = cfg.n_head * hd;
        let kvd = cfg.n_kv_head * hd;
        let mut ld = Loader { ct, r, bytes: 0 };
        let embed_q = ld.q("token_embd.weight", &[cfg.vocab, d])?;
        let embed_q = std::sync::Arc::new(embed_q);
        let embed = QMatMul::from_arc(embed_q.clone()).map_err(GgufError::candle)?;
        let output = if ld.has("output.weight") {
            ld.mm("output.weight", &[cfg.vocab, d])?
        } else {
            // Tied embeddings (SmolLM2, small Qwens): the output projection is the embedding.
            Linear::Q(embed.clone())
        };
        let norm = ld.vec("output_norm.weight", d)?;
        let ff = ct
            .tensor_infos
            .get("blk.0.ffn_up.weight")
            .and_then(|t| t.shape.dims().first().copied())
            .ok_or_else(|| GgufError::MissingTensor("blk.0.ffn_up.weight".into()))?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = |ld: &mut Loader<'_, R>, s: &str, len: usize| -> Result<Option<Tensor>, GgufError> {
                let name = n(s);
                if ld.has(&name) {
                    ld.vec(&name, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let attn = Attn {
                wq: ld.mm(&n("attn_q.weight"), &[qd, d])?,
                wk: ld.mm(&n("attn_k.weight"), &[kvd, d])?,
                wv: ld.mm(&n("attn_v.weight"), &[kvd, d])?,
                wo: ld.mm(&n("attn_output.weight"), &[d, qd])?,
                bq: bias(&mut ld, "attn_q.bias", qd)?,
                bk: bias(&mut ld, "attn_k.bias", kvd)?,
                bv: bias(&mut ld, "attn_v.bias", kvd)?,
                q_norm: bias(&mut ld, "attn_q_norm.weight", hd)?,
                k_norm: bias(&mut ld, "attn_k_norm.weight", hd)?,
            };
            if cfg.arch == Arch::Qwen3 && (attn.q_norm.is_none() || attn.k_norm.is_none()) {
                return Err(GgufError::MissingTensor(n("attn_q_norm.weight")));
            }
            layers.push(Layer {
                attn_norm: ld.vec(&n("attn_norm.weight"), d)?,
                attn,
                ffn_norm: ld.vec(&n("ffn_norm.weight"), d)?,
                gate: ld.mm(&n("ffn_gate.weight"), &[ff, d])?,
                up: ld.mm(&n("ffn_up.weight"), &[ff, d])?,
                down: ld.mm(&n("ffn_down.weight"), &[d, ff])?,
            });
        }
        let bytes = ld.bytes;
        let (cos, sin) = rope_tables(hd, cfg.rope_base, max_context).map_err(GgufError::candle)?;
        Ok(Weights {
            cfg,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            bytes,
        })
    }

    /// Runs `tokens` at positions `cache.len()..`, appending them to the cache, and returns the
    /// logits of the last position (`all == false`, shape `[vocab]`) or of every position
    /// (`[tokens.len(), vocab]`).
    pub fn forward(&self, tokens: &[u32], cache: &mut Cache, all: bool) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        if t == 0 {
            candle_core::bail!("no tokens to run");
        }
        let pos = cache.len;
        let (max_pos, _) = self.cos.dims2()?;
        if pos + t > max_pos {
            candle_core::bail!("position {} is past the context window of {max_pos}", pos + t);
        }
        cache.ensure(self, pos + t)?;
        let cfg = &self.cfg;
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let g = nh / nkv;
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let mut x = self.embed.embedding(&ids)?.to_dtype(DType::F32)?; // [t, d]
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let mask = if t > 1 {
            Some(causal_mask(t, pos, g)?)
        } else {
            None
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let eps = cfg.eps as f32;
        for (li, l) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &l.attn_norm, eps)?;
            let a = &l.attn;
            let mut q = a.wq.forward(&h)?;
            let mut k = a.wk.forward(&h)?;
            let mut v = a.wv.forward(&h)?;
            if let Some(b) = &a.bq {
                q = q.broadcast_add(b)?;
            }
            if let Some(b) = &a.bk {
                k = k.broadcast_add(b)?;
            }
            if let Some(b) = &a.bv {
                v = v.broadcast_add(b)?;
            }
            // [t, heads*hd] -> [1, heads, t, hd]
            let mut q = q.reshape((t, nh, hd))?;
            let mut k = k.reshape((t, nkv, hd))?;
            if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
                q = candle_nn::ops::rms_norm(&q.contiguous()?, qn, eps)?;
                k = candle_nn::ops::rms_norm(&k.contiguous()?, kn, eps)?;
            }
            let q = q.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
            let k = k.transpose(0, 1)?.contiguous()?.unsqueeze(0)?;
            let v = v.reshape((t, nkv, hd))?.transpose(0, 1)?.contiguous()?;
            let (q, k) = match cfg.arch {
                Arch::Llama => (
                    candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?,
                    candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?,
                ),
                Arch::Qwen2 | Arch::Qwen3 => (
                    candle_nn::rotary_emb::rope(&q, &cos, &sin)?,
                    candle_nn::rotary_emb::rope(&k, &cos, &sin)?,
                ),
            };
            let k = k.squeeze(0)?; // [nkv, t, hd]
            let (kb, vb) = match (&cache.k[li], &cache.v[li]) {
                (Some(kb), Some(vb)) => (kb, vb),
                _ => candle_core::bail!("the KV cache was not allocated"),
            };
            kb.slice_set(&k, 1, pos)?;
            vb.slice_set(&v, 1, pos)?;
            let kv_len = pos + t;
            let keys = kb.narrow(1, 0, kv_len)?; // [nkv, kv_len, hd]
            let vals = vb.narrow(1, 0, kv_len)?;
            // Queries grouped by their kv head: [nh, t, hd] -> [nkv, g*t, hd] (heads of one
            // group are adjacent), so no key/value is copied per query head.
            let q = q.squeeze(0)?.reshape((nkv, g * t, hd))?;
            let mut att = (q.matmul(&keys.t()?)? * scale)?; // [nkv, g*t, kv_len]
            if let Some(m) = &mask {
                att = att.broadcast_add(m)?;
            }
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(&vals)?; // [nkv, g*t, hd]
            let y = y.reshape((nh, t, hd))?.transpose(0, 1)?.reshape((t, nh * hd))?;
            let y = a.wo.forward(&y)?;
            x = (x + y)?;
            let h = candle_nn::ops::rms_norm(&x, &l.ffn_norm, eps)?;
            let gt = l.gate.forward(&h)?;
            let up = l.up.forward(&h)?;
            let y = l.down.forward(&(candle_nn::ops::silu(&gt)? * up)?)?;
            x = (x + y)?;
        }
        cache.len = pos + t;
        let x = if all { x } else { x.narrow(0, t - 1, 1)? };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.output.forward(&x)?;
        if all { Ok(logits) } else { logits.squeeze(0) }
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

/// A weight matrix and how its products are computed.
///
/// Q4_1 (`w = d·q + m`) has only a scalar dot product in candle, while Q4_0 (`w = d·(q − 8)`)
/// has an AVX2 one; since `d·q + m = d·(q − 8) + 8d + m`, a Q4_1 matrix runs as the Q4_0 matrix
/// of the same nibbles and scales plus, per row and 32-wide block, `8d` times the block's sum of
/// the 8-bit-quantized activations and `m` times that sum as llama.cpp's q8_1 blocks store it
/// (rounded to f16). The result is llama.cpp's q4_1·q8_1 product up to float rounding. It costs
/// 8 bytes per 32 weights.
pub(crate) enum Linear {
    /// Any other type: candle's product.
    Q(QMatMul),
    /// Q4_1 as Q4_0 plus the block terms `[n, 2·k/32]` (`8d` then `m`).
    Q41 { w0: QMatMul, c: Tensor },
}

impl Linear {
    fn new(t: QTensor) -> Result<Self, GgufError> {
        if t.dtype() != GgmlDType::Q4_1 {
            return QMatMul::from_qtensor(t).map(Linear::Q).map_err(GgufError::candle);
        }
        let (n, k) = t.shape().dims2().map_err(GgufError::candle)?;
        let raw = t.data().map_err(GgufError::candle)?;
        let blocks = raw.len() / 20;
        if raw.len() % 20 != 0 || blocks * 32 != n * k {
            return Err(GgufError::Corrupt(
                "a Q4_1 tensor's data does not match its shape".into(),
            ));
        }
        let nb = k / 32;
        let mut q40 = Vec::with_capacity(blocks * 18);
        let mut c = vec![0f32; n * 2 * nb];
        for (i, b) in raw.chunks_exact(20).enumerate() {
            let d = half::f16::from_le_bytes([b[0], b[1]]);
            let m = half::f16::from_le_bytes([b[2], b[3]]);
            q40.extend_from_slice(&b[0..2]);
            q40.extend_from_slice(&b[4..20]);
            let (row, blk) = (i / nb, i % nb);
            c[row * 2 * nb + blk] = 8.0 * d.to_f32();
            c[row * 2 * nb + nb + blk] = m.to_f32();
        }
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(q40),
            &Device::Cpu,
            GgmlDType::Q4_0,
        )
        .map_err(GgufError::candle)?;
        let w0 = QTensor::new(storage, (n, k)).map_err(GgufError::candle)?;
        Ok(Linear::Q41 {
            w0: QMatMul::from_qtensor(w0).map_err(GgufError::candle)?,
            c: Tensor::from_vec(c, (n, 2 * nb), &Device::Cpu).map_err(GgufError::candle)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Linear::Q(m) => m.forward(x),
            Linear::Q41 { w0, c } => {
                let y0 = w0.forward(x)?;
                let (t, k) = x.dims2()?;
                let xs = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
                let nb = k / 32;
                let mut sums = vec![0f32; t * 2 * nb];
                for (i, blk) in xs.chunks_exact(32).enumerate() {
                    // ggml's quantize_row_q8_1: d = amax / 127, q = round(x / d), s = f16(d·Σq).
                    let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let q: i32 = blk.iter().map(|v| (v * id).round() as i32).sum();
                    let (row, b) = (i / nb, i % nb);
                    sums[row * 2 * nb + b] = half::f16::from_f32(d).to_f32() * q as f32;
                    sums[row * 2 * nb + nb + b] = half::f16::from_f32(d * q as f32).to_f32();
                }
                let s = Tensor::from_vec(sums, (t, 2 * nb), &Device::Cpu)?;
                y0 + s.matmul(&c.t()?)?
            }
        }
    }
}

/// Whether candle can run this tensor type (F32/F16/BF16 and the ggml block formats).
pub fn dtype_supported(d: GgmlDType) -> bool {
    !matches!(d, GgmlDType::Q8_1 | GgmlDType::Q8K)
}

fn rope_tables(hd: usize, base: f32, max: usize) -> candle_core::Result<(Tensor, Tensor)> {
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
    Ok((
        Tensor::from_vec(cos, (max, half), &Device::Cpu)?,
        Tensor::from_vec(sin, (max, half), &Device::Cpu)?,
    ))
}

/// The additive mask for `t` queries at positions `pos..pos+t`, repeated for the `g` query heads
/// of a group: `[g*t, pos+t]`, 0 where a query may look, -inf where it may not.
fn causal_mask(t: usize, pos: usize, g: usize) -> candle_core::Result<Tensor> {
    let n = pos + t;
    let mut m = Vec::with_capacity(g * t * n);
    for _ in 0..g {
        for i in 0..t {
            for j in 0..n {
                m.push(if j > pos + i { f32::NEG_INFINITY } else { 0.0 });
            }
        }
    }
    Tensor::from_vec(m, (g * t, n), &Device::Cpu)
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

#[allow(dead_code)]
fn _assert_dim(_: D) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Q4_1-as-Q4_0 product is the exact product of the dequantized weights up to the
    /// 8-bit quantization of the activations (what llama.cpp's q4_1·q8_1 product computes).
    #[test]
    fn q4_1_as_q4_0_matches_the_exact_product() {
        let (n, k, t) = (64usize, 256usize, 3usize);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.3)
            .collect();
        let w = Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let wd = q.dequantize(&Device::Cpu).unwrap();
        let x: Vec<f32> = (0..t * k)
            .map(|i| (i * 104_729 % 997) as f32 / 498.0 - 1.0)
            .collect();
        let x = Tensor::from_vec(x, (t, k), &Device::Cpu).unwrap();
        let exact = x.matmul(&wd.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        let scale = x
            .abs()
            .unwrap()
            .matmul(&wd.abs().unwrap().t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let ours = Linear::new(q)
            .unwrap()
            .forward(&x)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for ((a, b), s) in exact
            .iter()
            .flatten()
            .zip(ours.iter().flatten())
            .zip(scale.iter().flatten())
        {
            // 8-bit activations: at most half a step (1/254 of the block's max) per element.
            assert!((a - b).abs() <= s / 200.0, "{a} vs {b} (scale {s})");
        }
    }
}
