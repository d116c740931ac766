//! Hand-written CPU kernels for the forward pass: 8-bit quantization of activations, the
//! Q4_1 · Q8_1 and Q8_0 · Q8_0 block dot products, and the quantized matrix product built on
//! them, split over the rayon pool the forward pass runs in.
//!
//! Why not candle's: for a model as small as SmolLM2-135M (576 wide) a decode step is ~200 small
//! products, and candle's per-op cost (tensor allocation, its own process-wide worker pool that
//! spins between products, re-quantizing the same activations for q, k and v) took more time
//! than the arithmetic; and candle has only a scalar Q4_1 dot product. These kernels compute
//! what llama.cpp's x86 kernels compute (`quantize_row_q8_1`, `ggml_vec_dot_q4_1_q8_1`,
//! `ggml_vec_dot_q8_0_q8_0`): the same integer block sums, combined with the same float
//! operations in the same order on AVX2, so our products round as the reference's do. Other
//! weight types still go through candle ([`Mat::Other`]).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rayon::prelude::*;

use crate::error::GgufError;

/// Elements per quantization block (ggml's QK4_1 = QK8_0 = QK8_1).
pub(crate) const QK: usize = 32;

/// A block of 32 weights in Q4_1 (`w = d·q + m`, `q` in 0..16), with the f16 scales widened.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct BlockQ41 {
    d: f32,
    m: f32,
    /// Element `j` in the low nibble of byte `j`, element `j + 16` in its high nibble.
    qs: [u8; 16],
}

/// A block of 32 weights in Q8_0 (`w = d·q`), the scale widened.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct BlockQ80 {
    d: f32,
    qs: [i8; 32],
}

/// A block of 32 activations quantized to 8 bits: ggml's `block_q8_1` (`d`, `s = d·Σq`, both
/// rounded through f16 as ggml stores them); without `s` it is `block_q8_0`.
#[derive(Clone, Copy)]
#[repr(C)]
pub(crate) struct BlockQ8 {
    d: f32,
    s: f32,
    qs: [i8; 32],
}

impl BlockQ8 {
    const ZERO: BlockQ8 = BlockQ8 {
        d: 0.0,
        s: 0.0,
        qs: [0; 32],
    };
}

fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Quantizes rows of `k` floats (`x.len()` a multiple of `k`, `k` of 32) to 8-bit blocks, as
/// ggml's AVX `quantize_row_q8_1` does: `d = amax/127`, `q = round_half_even(x · 127/amax)`.
pub(crate) fn quantize(x: &[f32], out: &mut Vec<BlockQ8>) {
    out.clear();
    out.reserve(x.len() / QK);
    for blk in x.chunks_exact(QK) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut b = BlockQ8::ZERO;
        let mut sum = 0i32;
        for (q, v) in b.qs.iter_mut().zip(blk) {
            // Round half to even (as `_mm256_round_ps`), without a libm call: |v·id| ≤ 127, and
            // adding then subtracting 1.5·2²³ rounds to an integer in the default mode.
            const MAGIC: f32 = 12_582_912.0;
            let r = ((v * id + MAGIC) - MAGIC) as i32;
            sum += r;
            *q = r as i8;
        }
        b.d = f16_round(d);
        b.s = f16_round(d * sum as f32);
        out.push(b);
    }
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `Σ w·x` over one row of Q4_1 blocks and one row of Q8_1 blocks.
fn dot_q41(w: &[BlockQ41], x: &[BlockQ8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked above); the kernel reads only within the
        // slices it is given.
        return unsafe { avx2::dot_q41(w, x) };
    }
    let mut sum = 0f32;
    for (b, y) in w.iter().zip(x) {
        let mut sumi = 0i32;
        for j in 0..16 {
            let lo = i32::from(b.qs[j] & 0xF);
            let hi = i32::from(b.qs[j] >> 4);
            sumi += lo * i32::from(y.qs[j]) + hi * i32::from(y.qs[j + 16]);
        }
        sum += b.d * y.d * sumi as f32 + b.m * y.s;
    }
    sum
}

/// `Σ w·x` over one row of Q8_0 blocks and one row of 8-bit blocks.
fn dot_q80(w: &[BlockQ80], x: &[BlockQ8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as in `dot_q41`.
        return unsafe { avx2::dot_q80(w, x) };
    }
    let mut sum = 0f32;
    for (b, y) in w.iter().zip(x) {
        let sumi: i32 =
            b.qs.iter()
                .zip(&y.qs)
                .map(|(a, c)| i32::from(*a) * i32::from(*c))
                .sum();
        sum += b.d * y.d * sumi as f32;
    }
    sum
}

/// `out[r·t + i] = w row r · x row i` for the rows of `w` (each `nb` blocks) and `t` rows of
/// `x`: the AVX2 row kernel (dots inlined, weight blocks reused over four activation rows) or
/// the scalar dot per pair.
fn rows_q41(w: &[BlockQ41], nb: usize, x: &[BlockQ8], t: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (and VNNI for the second kernel); the kernels
        // assert the slice lengths they index.
        return unsafe {
            if has_vnni() {
                avx2::rows_q41_vnni(w, nb, x, t, out)
            } else {
                avx2::rows_q41(w, nb, x, t, out)
            }
        };
    }
    for (row, o) in w.chunks_exact(nb).zip(out.chunks_exact_mut(t)) {
        for (i, v) in o.iter_mut().enumerate() {
            *v = dot_q41(row, &x[i * nb..(i + 1) * nb]);
        }
    }
}

/// As [`rows_q41`], for Q8_0 weights.
fn rows_q80(w: &[BlockQ80], nb: usize, x: &[BlockQ8], t: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as in `rows_q41`.
        return unsafe { avx2::rows_q80(w, nb, x, t, out) };
    }
    for (row, o) in w.chunks_exact(nb).zip(out.chunks_exact_mut(t)) {
        for (i, v) in o.iter_mut().enumerate() {
            *v = dot_q80(row, &x[i * nb..(i + 1) * nb]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ8, BlockQ41, BlockQ80};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(x: __m256) -> f32 {
        let mut r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// The body of the Q4_1 row kernels: `out[r·t + i] = dot(w row r, x row i)` for the rows of
    /// `w` (each `nb` blocks) and the `t` rows of `x`, four rows of `x` at a time so each weight
    /// block is unpacked once for four products, accumulators in registers. Each product runs
    /// exactly the operations of [`dot_q41`], in its order; `$idot` is the integer part
    /// (`maddubs` + `madd`, or one VNNI `dpbusd`: the same sums).
    macro_rules! rows_q41_body {
        ($w:ident, $nb:ident, $x:ident, $t:ident, $out:ident, $idot:ident) => {{
            assert!($x.len() >= $t * $nb && $w.len() % $nb.max(1) == 0);
            assert!($out.len() >= $w.len() / $nb.max(1) * $t);
            let low = _mm256_set1_epi8(0xF);
            for (row, o) in $w.chunks_exact($nb).zip($out.chunks_exact_mut($t)) {
                let mut i = 0;
                while i + 4 <= $t {
                    // SAFETY: rows i..i+4 of `x` are in bounds (asserted above).
                    let xp = unsafe { $x.as_ptr().add(i * $nb) };
                    let (mut a0, mut a1, mut a2, mut a3) = (
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                    );
                    let (mut s0, mut s1, mut s2, mut s3) = (0f32, 0f32, 0f32, 0f32);
                    for (bi, b) in row.iter().enumerate() {
                        // SAFETY: 16 bytes inside the block; unaligned load.
                        let tmp = unsafe { _mm_loadu_si128(b.qs.as_ptr().cast()) };
                        let qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp));
                        macro_rules! one {
                            ($j:expr, $acc:ident, $sm:ident) => {{
                                // SAFETY: block `bi` of row i+$j, in bounds (asserted above).
                                let y = unsafe { &*xp.add($j * $nb + bi) };
                                $sm += b.m * y.s;
                                let d = _mm256_set1_ps(b.d * y.d);
                                let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
                                let xy = _mm256_cvtepi32_ps($idot(qx, qy));
                                $acc = _mm256_fmadd_ps(d, xy, $acc);
                            }};
                        }
                        one!(0, a0, s0);
                        one!(1, a1, s1);
                        one!(2, a2, s2);
                        one!(3, a3, s3);
                    }
                    // SAFETY: `hsum` needs AVX, which the caller's target features include.
                    unsafe {
                        o[i] = hsum(a0) + s0;
                        o[i + 1] = hsum(a1) + s1;
                        o[i + 2] = hsum(a2) + s2;
                        o[i + 3] = hsum(a3) + s3;
                    }
                    i += 4;
                }
                while i < $t {
                    // SAFETY: as above.
                    o[i] = unsafe { dot_q41(row, &$x[i * $nb..(i + 1) * $nb]) };
                    i += 1;
                }
            }
        }};
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn idot_avx2(qx: __m256i, qy: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(qx, qy))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    fn idot_vnni(qx: __m256i, qy: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy)
    }

    /// Q4_1 rows against Q8_1 rows on AVX2 (see `rows_q41_body`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_q41(w: &[BlockQ41], nb: usize, x: &[BlockQ8], t: usize, out: &mut [f32]) {
        rows_q41_body!(w, nb, x, t, out, idot_avx2)
    }

    /// The same with AVX-512 VNNI's `dpbusd` for the integer sums (llama.cpp's choice when built
    /// for such a CPU; the sums are equal).
    #[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
    pub(super) unsafe fn rows_q41_vnni(w: &[BlockQ41], nb: usize, x: &[BlockQ8], t: usize, out: &mut [f32]) {
        rows_q41_body!(w, nb, x, t, out, idot_vnni)
    }

    /// As [`rows_q41`], for Q8_0 weights ([`dot_q80`]'s operations).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_q80(w: &[BlockQ80], nb: usize, x: &[BlockQ8], t: usize, out: &mut [f32]) {
        let ones = _mm256_set1_epi16(1);
        for (row, o) in w.chunks_exact(nb).zip(out.chunks_exact_mut(t)) {
            let mut i = 0;
            while i + 4 <= t {
                let xs = [
                    &x[i * nb..],
                    &x[(i + 1) * nb..],
                    &x[(i + 2) * nb..],
                    &x[(i + 3) * nb..],
                ];
                let mut acc = [_mm256_setzero_ps(); 4];
                for (bi, b) in row.iter().enumerate() {
                    // SAFETY: 32 bytes inside the block; unaligned load.
                    let qx = unsafe { _mm256_loadu_si256(b.qs.as_ptr().cast()) };
                    let ax = _mm256_sign_epi8(qx, qx);
                    for j in 0..4 {
                        let y = &xs[j][bi];
                        let d = _mm256_set1_ps(b.d * y.d);
                        let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
                        let sy = _mm256_sign_epi8(qy, qx);
                        let dot = _mm256_maddubs_epi16(ax, sy);
                        let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, dot));
                        acc[j] = _mm256_fmadd_ps(d, q, acc[j]);
                    }
                }
                for j in 0..4 {
                    o[i + j] = unsafe { hsum(acc[j]) };
                }
                i += 4;
            }
            while i < t {
                o[i] = unsafe { dot_q80(row, &x[i * nb..(i + 1) * nb]) };
                i += 1;
            }
        }
    }

    /// llama.cpp's AVX2 `ggml_vec_dot_q4_1_q8_1`, operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q41(w: &[BlockQ41], x: &[BlockQ8]) -> f32 {
        let low = _mm256_set1_epi8(0xF);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        for (b, y) in w.iter().zip(x) {
            summs += b.m * y.s;
            let d0d1 = _mm256_mul_ps(_mm256_set1_ps(b.d), _mm256_set1_ps(y.d));
            // SAFETY: 16 and 32 bytes inside the blocks; unaligned loads.
            let tmp = unsafe { _mm_loadu_si128(b.qs.as_ptr().cast()) };
            let qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp));
            let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            let dot = _mm256_maddubs_epi16(qx, qy);
            let xy = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, dot));
            acc = _mm256_fmadd_ps(d0d1, xy, acc);
        }
        unsafe { hsum(acc) + summs }
    }

    /// llama.cpp's AVX2 `ggml_vec_dot_q8_0_q8_0`, operation for operation.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_q80(w: &[BlockQ80], x: &[BlockQ8]) -> f32 {
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for (b, y) in w.iter().zip(x) {
            let d = _mm256_set1_ps(b.d * y.d);
            // SAFETY: 32 bytes inside the blocks; unaligned loads.
            let qx = unsafe { _mm256_loadu_si256(b.qs.as_ptr().cast()) };
            let qy = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            let ax = _mm256_sign_epi8(qx, qx);
            let sy = _mm256_sign_epi8(qy, qx);
            let dot = _mm256_maddubs_epi16(ax, sy);
            let q = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, dot));
            acc = _mm256_fmadd_ps(d, q, acc);
        }
        unsafe { hsum(acc) }
    }
}

/// A weight matrix `[n, k]` (`n` outputs of `k` inputs) and how its products are computed.
pub(crate) enum Mat {
    /// Q4_1, multiplied here against Q8_1 activations.
    Q41 { n: usize, k: usize, b: Vec<BlockQ41> },
    /// Q8_0, multiplied here against Q8_0 activations.
    Q80 { n: usize, k: usize, b: Vec<BlockQ80> },
    /// Any other type: candle's product (and its embedding lookup).
    Other { n: usize, k: usize, m: QMatMul },
}

impl Mat {
    /// Takes a GGUF tensor `[n, k]`.
    pub(crate) fn new(t: QTensor) -> Result<Self, GgufError> {
        let (n, k) = t.shape().dims2().map_err(GgufError::candle)?;
        let dtype = t.dtype();
        if k % QK != 0 || !matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q8_0) {
            let m = QMatMul::from_qtensor(t).map_err(GgufError::candle)?;
            return Ok(Mat::Other { n, k, m });
        }
        let raw = t.data().map_err(GgufError::candle)?;
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let bad = || GgufError::Corrupt(format!("a {dtype:?} tensor's data does not match its shape"));
        let blocks = n * k / QK;
        if dtype == GgmlDType::Q4_1 {
            if raw.len() != blocks * 20 {
                return Err(bad());
            }
            let b = raw
                .chunks_exact(20)
                .map(|c| {
                    let mut qs = [0u8; 16];
                    qs.copy_from_slice(&c[4..20]);
                    BlockQ41 {
                        d: f16(&c[0..2]),
                        m: f16(&c[2..4]),
                        qs,
                    }
                })
                .collect();
            Ok(Mat::Q41 { n, k, b })
        } else {
            if raw.len() != blocks * 34 {
                return Err(bad());
            }
            let b = raw
                .chunks_exact(34)
                .map(|c| {
                    let mut qs = [0i8; 32];
                    for (q, &v) in qs.iter_mut().zip(&c[2..34]) {
                        *q = v as i8;
                    }
                    BlockQ80 { d: f16(&c[0..2]), qs }
                })
                .collect();
            Ok(Mat::Q80 { n, k, b })
        }
    }

    /// Output rows.
    pub(crate) fn n(&self) -> usize {
        match self {
            Mat::Q41 { n, .. } | Mat::Q80 { n, .. } | Mat::Other { n, .. } => *n,
        }
    }

    /// Input width.
    pub(crate) fn k(&self) -> usize {
        match self {
            Mat::Q41 { k, .. } | Mat::Q80 { k, .. } | Mat::Other { k, .. } => *k,
        }
    }

    /// The matrices stacked row-wise (`[Σn, k]`), when they are all of one type this module
    /// multiplies and of one width: then q, k and v (or gate and up) are one product, one
    /// parallel region instead of three.
    pub(crate) fn stack(parts: Vec<Mat>) -> Result<Mat, Vec<Mat>> {
        let k = parts.first().map(Mat::k).unwrap_or(0);
        let all41 = parts.iter().all(|m| matches!(m, Mat::Q41 { .. }) && m.k() == k);
        let all80 = parts.iter().all(|m| matches!(m, Mat::Q80 { .. }) && m.k() == k);
        if parts.len() < 2 || !(all41 || all80) {
            return Err(parts);
        }
        let n = parts.iter().map(Mat::n).sum();
        if all41 {
            let mut b = Vec::with_capacity(n * k / QK);
            for p in parts {
                if let Mat::Q41 { b: pb, .. } = p {
                    b.extend(pb);
                }
            }
            Ok(Mat::Q41 { n, k, b })
        } else {
            let mut b = Vec::with_capacity(n * k / QK);
            for p in parts {
                if let Mat::Q80 { b: pb, .. } = p {
                    b.extend(pb);
                }
            }
            Ok(Mat::Q80 { n, k, b })
        }
    }

    /// Writes row `i` of the matrix, dequantized, into `out` (`k` floats): the embedding lookup.
    pub(crate) fn row(&self, i: usize, out: &mut [f32]) -> candle_core::Result<()> {
        if i >= self.n() {
            candle_core::bail!("token {i} is outside the vocabulary of {}", self.n());
        }
        let nb = self.k() / QK;
        match self {
            Mat::Q41 { b, .. } => {
                for (blk, o) in b[i * nb..(i + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    for j in 0..16 {
                        o[j] = blk.d * f32::from(blk.qs[j] & 0xF) + blk.m;
                        o[j + 16] = blk.d * f32::from(blk.qs[j] >> 4) + blk.m;
                    }
                }
            }
            Mat::Q80 { b, .. } => {
                for (blk, o) in b[i * nb..(i + 1) * nb].iter().zip(out.chunks_exact_mut(QK)) {
                    for (v, q) in o.iter_mut().zip(&blk.qs) {
                        *v = blk.d * f32::from(*q);
                    }
                }
            }
            Mat::Other { m, .. } => {
                let ids = Tensor::new(&[i as u32], &Device::Cpu)?;
                let r = m.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&r);
            }
        }
        Ok(())
    }

    /// `out[t, n] = x[t, k] · selfᵀ`, with `xq` the 8-bit blocks of `x` (from [`quantize`]; unused
    /// by [`Mat::Other`]). Runs on the current rayon pool, split by output rows.
    pub(crate) fn matmul(
        &self,
        x: &[f32],
        xq: &[BlockQ8],
        t: usize,
        out: &mut Vec<f32>,
        scratch: &mut Vec<f32>,
    ) -> candle_core::Result<()> {
        let (n, k) = (self.n(), self.k());
        if x.len() != t * k {
            candle_core::bail!("matmul: {} inputs for {t} rows of {k}", x.len());
        }
        out.clear();
        out.resize(t * n, 0.0);
        let nb = k / QK;
        // Rows per task: enough work per task to pay for the hand-off, and a few tasks per
        // thread so a descheduled worker does not hold the product up.
        let rows = (n / (rayon::current_num_threads() * 8)).clamp(8, 256);
        macro_rules! product {
            ($b:expr, $rows:expr) => {{
                let b = $b;
                if xq.len() != t * nb {
                    candle_core::bail!("matmul: {} input blocks for {t} rows of {nb}", xq.len());
                }
                if t == 1 {
                    out.par_chunks_mut(rows).enumerate().for_each(|(c, o)| {
                        let r0 = c * rows;
                        $rows(&b[r0 * nb..(r0 + o.len()) * nb], nb, xq, 1, o);
                    });
                } else {
                    // Row-major by weight row ([n, t]) so each task owns its slice; a weight
                    // row stays in L1 while every token is multiplied by it. Then transposed.
                    scratch.clear();
                    scratch.resize(n * t, 0.0);
                    scratch
                        .par_chunks_mut(rows * t)
                        .enumerate()
                        .for_each(|(c, o)| {
                            let r0 = c * rows;
                            $rows(&b[r0 * nb..(r0 + o.len() / t) * nb], nb, xq, t, o);
                        });
                    for (r, col) in scratch.chunks_exact(t).enumerate() {
                        for (i, v) in col.iter().enumerate() {
                            out[i * n + r] = *v;
                        }
                    }
                }
            }};
        }
        match self {
            Mat::Q41 { b, .. } => product!(b, rows_q41),
            Mat::Q80 { b, .. } => product!(b, rows_q80),
            Mat::Other { m, .. } => {
                let xt = Tensor::from_slice(x, (t, k), &Device::Cpu)?;
                let y = m.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&y);
            }
        }
        Ok(())
    }
}

/// `Σ a·b` in eight lanes (vectorized by the compiler).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len().min(b.len()));
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `y += a·x`, vectorized by the compiler.
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (v, w) in y.iter_mut().zip(x) {
        *v += a * w;
    }
}

/// RMS norm of each `w.len()`-wide row of `x` into `out`, times `w` (sum of squares in f64, as
/// ggml's `rms_norm`).
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut Vec<f32>) {
    out.clear();
    out.reserve(x.len());
    for row in x.chunks_exact(w.len()) {
        let ss: f64 = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
        let mean = (ss / row.len() as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, g)| v * scale * g));
    }
}

/// The same, in place.
pub(crate) fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        let ss: f64 = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
        let mean = (ss / row.len() as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth(n: usize, k: usize, seed: usize) -> Tensor {
        let w: Vec<f32> = (0..n * k)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.3)
            .collect();
        Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap()
    }

    /// Both kernels give the exact product of the dequantized weights up to the 8-bit
    /// quantization of the activations, for one row (decode) and several (pre-fill), and the
    /// scalar fallback agrees with the AVX2 kernel.
    #[test]
    fn quantized_products_match_the_exact_product() {
        let (n, k) = (40usize, 256usize);
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&synth(n, k, 0), dtype).unwrap();
            let wd = q.dequantize(&Device::Cpu).unwrap();
            let m = Mat::new(q).unwrap();
            assert!(!matches!(m, Mat::Other { .. }));
            for t in [1usize, 3, 6] {
                let x: Vec<f32> = (0..t * k)
                    .map(|i| (i * 104_729 % 997) as f32 / 498.0 - 1.0)
                    .collect();
                let xt = Tensor::from_slice(&x, (t, k), &Device::Cpu).unwrap();
                let exact = xt.matmul(&wd.t().unwrap()).unwrap().flatten_all().unwrap();
                let exact = exact.to_vec1::<f32>().unwrap();
                let scale = xt.abs().unwrap().matmul(&wd.abs().unwrap().t().unwrap()).unwrap();
                let scale = scale.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let mut xq = Vec::new();
                quantize(&x, &mut xq);
                let (mut out, mut scratch) = (Vec::new(), Vec::new());
                m.matmul(&x, &xq, t, &mut out, &mut scratch).unwrap();
                for ((a, b), s) in exact.iter().zip(&out).zip(&scale) {
                    assert!((a - b).abs() <= s / 200.0, "{dtype:?}: {a} vs {b} (scale {s})");
                }
                // The scalar fallback: same integer sums, float order may differ slightly.
                let nb = k / QK;
                for r in 0..n {
                    let scalar = match &m {
                        Mat::Q41 { b, .. } => {
                            let mut s = 0f32;
                            for (bb, y) in b[r * nb..(r + 1) * nb].iter().zip(&xq[..nb]) {
                                s += dot_q41_scalar_one(bb, y);
                            }
                            s
                        }
                        _ => continue,
                    };
                    assert!((scalar - out[r]).abs() <= 1e-3 * scale[r].max(1.0));
                }
            }
        }
    }

    /// The plain AVX2 and the VNNI row kernels give bit-identical products (the integer sums
    /// are equal, the float operations the same), and equal the per-pair dot, on every CPU this
    /// runs on (the VNNI one only where the CPU has it).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn row_kernels_agree_bit_for_bit() {
        if !has_avx2() {
            return;
        }
        let (n, k, t) = (24usize, 192usize, 7usize);
        let Mat::Q41 { b, .. } =
            Mat::new(QTensor::quantize(&synth(n, k, 5), GgmlDType::Q4_1).unwrap()).unwrap()
        else {
            panic!("not Q4_1")
        };
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 31 % 211) as f32 - 105.0) / 37.0)
            .collect();
        let mut xq = Vec::new();
        quantize(&x, &mut xq);
        let nb = k / QK;
        let mut plain = vec![0f32; n * t];
        // SAFETY: AVX2 and FMA checked above.
        unsafe { avx2::rows_q41(&b, nb, &xq, t, &mut plain) };
        for r in 0..n {
            for i in 0..t {
                let one = dot_q41(&b[r * nb..(r + 1) * nb], &xq[i * nb..(i + 1) * nb]);
                assert_eq!(plain[r * t + i].to_bits(), one.to_bits(), "row {r} token {i}");
            }
        }
        if has_vnni() {
            let mut vnni = vec![0f32; n * t];
            // SAFETY: VNNI checked.
            unsafe { avx2::rows_q41_vnni(&b, nb, &xq, t, &mut vnni) };
            assert_eq!(plain, vnni);
        }
    }

    fn dot_q41_scalar_one(b: &BlockQ41, y: &BlockQ8) -> f32 {
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += i32::from(b.qs[j] & 0xF) * i32::from(y.qs[j])
                + i32::from(b.qs[j] >> 4) * i32::from(y.qs[j + 16]);
        }
        b.d * y.d * sumi as f32 + b.m * y.s
    }

    /// Activations quantize as ggml's AVX `quantize_row_q8_1`: halves round to even.
    #[test]
    fn quantization_rounds_half_to_even() {
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        let mut q = Vec::new();
        quantize(&x, &mut q);
        assert_eq!(&q[0].qs[..3], &[127, 2, -4]);
        assert_eq!(q[0].d, 1.0);
        assert_eq!(q[0].s, 125.0);
    }
}
