//! Integer dot products of block-quantized weight rows with activations
//! quantized to 8 bits: the matrix-vector form of `Op::QuantMatMul`
//! (decoding), as llama.cpp computes it.
//!
//! Each row of `x` is quantized once per product ([`Q8Rows`]): blocks of
//! 32 values, an f32 scale `d = max|x| / 127` and `q = round(x / d)` (half
//! away from zero, llama.cpp's `quantize_row_q8_0_ref` with the scale kept
//! in f32 rather than f16). A weight row is then dotted block by block in
//! integers: the products of one block's 32 weight and activation values
//! are summed exactly in eight `i32` lanes (lane `l` holds values
//! `4l..4l+3` of the block), the lanes converted to f32 and multiplied by
//! the block's float factor (weight scale times activation scale) into
//! eight f32 accumulators, summed pairwise at the end. Every format
//! (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) uses the same 32-value activation
//! blocks: Q4_K's sub-blocks are 32 values (its minimum term uses the
//! block's sum of `q`), Q6_K's two sub-blocks of 16 per block multiply
//! their lanes by their integer scales. (llama.cpp uses 256-value Q8_K
//! blocks for the K-quants; per-32 scales round the activations no worse.)
//!
//! The same arithmetic has two builds: AVX2 (`vpmaddubsw` + `vpmaddwd`,
//! chosen at run time with `is_x86_feature_detected!`) and a portable
//! scalar one. Both compute the same integer lanes exactly and the same
//! f32 operations in the same order (a multiply then an add, never a fused
//! multiply-add), so their results are bit-identical (a test checks it).
//!
//! The only rounding beyond f32 reassociation is the activations' (the
//! weight values are exact): relative to a product of the decoded weight
//! and `x` it is at most half a step of `x`'s block scale per value.
//! `LAZULI_CPU_Q8_ACTIVATIONS=0` keeps the exact f32 path (`quant`).
//! A non-finite activation makes its block's scale NaN, so the products
//! that read it are NaN (the f32 path gives NaN or an infinity there).

use lazuli_ir::quant::scale_min_k4;
use lazuli_ir::QuantFormat;

/// Values per activation block.
const BLOCK: usize = 32;

/// Whether `format` has an integer dot product here.
pub(crate) fn supported(format: QuantFormat) -> bool {
    matches!(format, QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q4K | QuantFormat::Q6K)
}

/// Rows of activations quantized to 8 bits in blocks of 32.
pub(crate) struct Q8Rows {
    /// Values per row (a multiple of 32).
    k: usize,
    /// The quantized values, row-major.
    q: Vec<i8>,
    /// One scale per block (NaN where the block holds a non-finite value).
    d: Vec<f32>,
    /// The sum of each block's `q` (Q4_K's minimum term).
    sum: Vec<i32>,
}

/// One quantized row of [`Q8Rows`].
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    q: &'a [i8],
    d: &'a [f32],
    sum: &'a [i32],
}

impl Q8Rows {
    /// Quantizes `x` (rows of `k` values, `k` a multiple of 32).
    pub(crate) fn quantize(x: &[f32], k: usize) -> Q8Rows {
        assert!(k.is_multiple_of(BLOCK) && x.len().is_multiple_of(k.max(1)), "whole activation blocks");
        let blocks = x.len() / BLOCK;
        let mut out = Q8Rows { k, q: vec![0; x.len()], d: vec![0.0; blocks], sum: vec![0; blocks] };
        for (b, (xs, qs)) in x.chunks_exact(BLOCK).zip(out.q.chunks_exact_mut(BLOCK)).enumerate() {
            let finite = xs.iter().all(|v| v.is_finite());
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qs.iter_mut().zip(xs) {
                // |v * id| <= 127 up to rounding: the cast saturates.
                *q = if finite { (v * id).round() as i8 } else { 0 };
                sum += i32::from(*q);
            }
            out.d[b] = if finite { d } else { f32::NAN };
            out.sum[b] = sum;
        }
        out
    }

    /// Row `r`.
    pub(crate) fn row(&self, r: usize) -> Q8Row<'_> {
        let nb = self.k / BLOCK;
        Q8Row {
            q: &self.q[r * self.k..(r + 1) * self.k],
            d: &self.d[r * nb..(r + 1) * nb],
            sum: &self.sum[r * nb..(r + 1) * nb],
        }
    }

    /// Rows held.
    pub(crate) fn rows(&self) -> usize {
        self.q.len().checked_div(self.k).unwrap_or(0)
    }
}

/// Rows of `x` dotted together with each decoded weight block.
const TILE: usize = 4;

/// Rows of `x` that meet every weight row of a task before the next ones
/// (a prefill's rows, 32 of up to a few KB each, stay in L2).
const CACHED_ROWS: usize = 32;

/// Output columns `first..` of `dst` (`x.rows()` values each, column-major
/// by weight row): weight row `c` (`row_bytes` bytes of `w`) dotted with
/// every row of `x`, [`TILE`] rows of `x` at a time (each weight block is
/// decoded once per tile; a row's result does not depend on the tile it
/// is in). `format` must be [`supported`].
pub(crate) fn columns(format: QuantFormat, dst: &mut [f32], first: usize, w: &[u8], row_bytes: usize, x: &Q8Rows) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX2 and F16C (checked just above), the only
        // precondition of the `target_feature` function.
        #[allow(unsafe_code)]
        return unsafe { avx2::columns(format, dst, first, w, row_bytes, x) };
    }
    columns_scalar(format, dst, first, w, row_bytes, x)
}

/// Runs `$tile::<R>(format, weight row, [rows of x; R])` for every column
/// of `$dst` and every tile of rows, writing the results in place.
macro_rules! tiled {
    ($format:expr, $dst:expr, $first:expr, $w:expr, $row_bytes:expr, $x:expr, $tile:ident) => {{
        let rows = $x.rows();
        // Groups of rows small enough to stay in the cache while every
        // weight row of the task passes.
        for r0 in (0..rows).step_by(CACHED_ROWS) {
            let r1 = (r0 + CACHED_ROWS).min(rows);
            for (j, d) in $dst.chunks_mut(rows).enumerate() {
                let c = $first + j;
                let wr = &$w[c * $row_bytes..(c + 1) * $row_bytes];
                for (t, out) in d[r0..r1].chunks_mut(TILE).enumerate() {
                    let at = |i: usize| $x.row(r0 + t * TILE + i);
                    match out.len() {
                        1 => out.copy_from_slice(&$tile::<1>($format, wr, [at(0)])),
                        2 => out.copy_from_slice(&$tile::<2>($format, wr, [at(0), at(1)])),
                        3 => out.copy_from_slice(&$tile::<3>($format, wr, [at(0), at(1), at(2)])),
                        _ => out.copy_from_slice(&$tile::<4>($format, wr, [at(0), at(1), at(2), at(3)])),
                    }
                }
            }
        }
    }};
}

/// [`columns`] through the portable build.
pub(crate) fn columns_scalar(
    format: QuantFormat,
    dst: &mut [f32],
    first: usize,
    w: &[u8],
    row_bytes: usize,
    x: &Q8Rows,
) {
    tiled!(format, dst, first, w, row_bytes, x, dot_scalar)
}

/// Sums eight lanes pairwise (both builds end with it).
#[inline(always)]
fn lanes_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// The little-endian f16 at `at`, widened.
#[inline(always)]
fn half_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight exact lane sums of one block: lane `l` is
/// `sum(w[i] * x[i], i in 4l..4l+4)`.
#[inline(always)]
fn lanes(w: &[i8; 32], x: &[i8]) -> [i32; 8] {
    let mut out = [0i32; 8];
    for (l, o) in out.iter_mut().enumerate() {
        *o = (4 * l..4 * l + 4).map(|i| i32::from(w[i]) * i32::from(x[i])).sum();
    }
    out
}

/// `acc[l] += factor * lanes[l]`, a multiply then an add per lane.
#[inline(always)]
fn accumulate(acc: &mut [f32; 8], factor: f32, lanes: [i32; 8]) {
    for (a, v) in acc.iter_mut().zip(lanes) {
        *a += factor * v as f32;
    }
}

/// The minimum term of Q4_K sub-block `g` of `x`: `dmin * m * d_x * sum(q_x)`
/// (the same expression in both builds).
#[inline(always)]
fn q4k_min(dmin: f32, m: u8, x: Q8Row<'_>, g: usize) -> f32 {
    (dmin * f32::from(m)) * x.d[g] * x.sum[g] as f32
}

/// One weight row dotted with `R` quantized activation rows, portably.
fn dot_scalar<const R: usize>(format: QuantFormat, row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
    let mut acc = [[0f32; 8]; R];
    let mut mins = [0f32; R];
    let mut v = [0i8; 32];
    // Every row of the tile against the decoded block `v` of group `g`
    // (`factor`: the weight's scale, times each row's block scale).
    let each = |acc: &mut [[f32; 8]; R], v: &[i8; 32], g: usize, factor: f32, scales: Option<[i32; 2]>| {
        for (a, xr) in acc.iter_mut().zip(&x) {
            let mut ints = lanes(v, &xr.q[g * BLOCK..(g + 1) * BLOCK]);
            if let Some(sc) = scales {
                for (l, i) in ints.iter_mut().enumerate() {
                    *i *= sc[l / 4];
                }
            }
            accumulate(a, factor * xr.d[g], ints);
        }
    };
    match format {
        QuantFormat::Q8_0 => {
            for (g, b) in row.chunks_exact(34).enumerate() {
                for (o, &q) in v.iter_mut().zip(&b[2..34]) {
                    *o = q as i8;
                }
                each(&mut acc, &v, g, half_at(b, 0), None);
            }
        }
        QuantFormat::Q4_0 => {
            for (g, b) in row.chunks_exact(18).enumerate() {
                for (j, &q) in b[2..18].iter().enumerate() {
                    v[j] = (q & 0x0F) as i8 - 8;
                    v[j + 16] = (q >> 4) as i8 - 8;
                }
                each(&mut acc, &v, g, half_at(b, 0), None);
            }
        }
        QuantFormat::Q5_0 => {
            for (g, b) in row.chunks_exact(22).enumerate() {
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, &q) in b[6..22].iter().enumerate() {
                    let h0 = ((qh >> j) & 1) as u8;
                    let h1 = ((qh >> (j + 16)) & 1) as u8;
                    v[j] = ((q & 0x0F) | (h0 << 4)) as i8 - 16;
                    v[j + 16] = ((q >> 4) | (h1 << 4)) as i8 - 16;
                }
                each(&mut acc, &v, g, half_at(b, 0), None);
            }
        }
        QuantFormat::Q4K => {
            for (blk, b) in row.chunks_exact(144).enumerate() {
                let (d, dmin, scales, qs) = (half_at(b, 0), half_at(b, 2), &b[4..16], &b[16..144]);
                for (chunk, q) in qs.chunks_exact(32).enumerate() {
                    for (shift, sub) in [(0, 2 * chunk), (4, 2 * chunk + 1)] {
                        let g = blk * 8 + sub;
                        let (sc, m) = scale_min_k4(sub, scales);
                        for (o, &byte) in v.iter_mut().zip(q) {
                            *o = ((byte >> shift) & 0x0F) as i8;
                        }
                        each(&mut acc, &v, g, d * f32::from(sc), None);
                        for (mn, xr) in mins.iter_mut().zip(&x) {
                            *mn += q4k_min(dmin, m, *xr, g);
                        }
                    }
                }
            }
        }
        QuantFormat::Q6K => {
            for (blk, b) in row.chunks_exact(210).enumerate() {
                let (ql, qh, sc, d) = (&b[..128], &b[128..192], &b[192..208], half_at(b, 208));
                for half in 0..2 {
                    let (ql, qh) = (&ql[64 * half..64 * half + 64], &qh[32 * half..32 * half + 32]);
                    for part in 0..4 {
                        let s = 4 * half + part;
                        for l in 0..32 {
                            let low = if part & 1 == 0 { ql[l] } else { ql[l + 32] };
                            let low = if part < 2 { low & 0x0F } else { low >> 4 };
                            let high = (qh[l] >> (2 * part)) & 3;
                            v[l] = (low | (high << 4)) as i8 - 32;
                        }
                        let scales = [i32::from(sc[2 * s] as i8), i32::from(sc[2 * s + 1] as i8)];
                        each(&mut acc, &v, blk * 8 + s, d, Some(scales));
                    }
                }
            }
        }
        QuantFormat::F16 | QuantFormat::BF16 => unreachable!("{format} has no integer dot product"),
    }
    std::array::from_fn(|r| lanes_sum(acc[r]) - mins[r])
}

/// The AVX2 build of the dot products.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use super::{lanes_sum, q4k_min, scale_min_k4, Q8Row, Q8Rows, BLOCK, CACHED_ROWS, TILE};
    use lazuli_ir::QuantFormat;
    use std::arch::x86_64::*;

    /// [`super::columns`] with every dot product inlined.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn columns(
        format: QuantFormat,
        dst: &mut [f32],
        first: usize,
        w: &[u8],
        row_bytes: usize,
        x: &Q8Rows,
    ) {
        if x.rows() == 1 {
            // Decoding: two weight rows at a time, two independent loads
            // and accumulator chains (each row's arithmetic unchanged).
            let xr = x.row(0);
            let row = |c: usize| &w[c * row_bytes..(c + 1) * row_bytes];
            let mut pairs = dst.chunks_exact_mut(2);
            let mut c = first;
            for out in &mut pairs {
                out.copy_from_slice(&dot_cols::<2>(format, [row(c), row(c + 1)], xr));
                c += 2;
            }
            for out in pairs.into_remainder() {
                *out = dot_cols::<1>(format, [row(c)], xr)[0];
            }
            return;
        }
        tiled!(format, dst, first, w, row_bytes, x, dot)
    }

    /// `C` weight rows dotted with one activation row, their blocks
    /// interleaved (Q8_0, Q4_0, Q5_0; the others one row at a time).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_cols<const C: usize>(format: QuantFormat, rows: [&[u8]; C], x: Q8Row<'_>) -> [f32; C] {
        let xs = [x];
        let mut acc = [[_mm256_setzero_ps(); 1]; C];
        let eight = _mm256_set1_epi8(8);
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        let nb = rows[0].len() / format.block_bytes();
        match format {
            QuantFormat::Q8_0 => {
                for g in 0..nb {
                    for c in 0..C {
                        let b = &rows[c][34 * g..34 * g + 34];
                        signed(&mut acc[c], &xs, load32(&b[2..]), g, half(b));
                    }
                }
            }
            QuantFormat::Q4_0 => {
                for g in 0..nb {
                    for c in 0..C {
                        let b = &rows[c][18 * g..18 * g + 18];
                        signed(&mut acc[c], &xs, _mm256_sub_epi8(nibbles(&b[2..]), eight), g, half(b));
                    }
                }
            }
            QuantFormat::Q5_0 => {
                for g in 0..nb {
                    for c in 0..C {
                        let b = &rows[c][22 * g..22 * g + 22];
                        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                        let w = _mm256_or_si256(nibbles(&b[6..]), _mm256_andnot_si256(bits_to_bytes(qh), high));
                        signed(&mut acc[c], &xs, w, g, half(b));
                    }
                }
            }
            _ => {
                let mut out = [0f32; C];
                for (o, r) in out.iter_mut().zip(rows) {
                    *o = dot::<1>(format, r, xs)[0];
                }
                return out;
            }
        }
        let mut out = [0f32; C];
        for (o, a) in out.iter_mut().zip(acc) {
            *o = finish(a, [0.0])[0];
        }
        out
    }

    /// One weight row dotted with `R` activation rows.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot<const R: usize>(format: QuantFormat, row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        match format {
            QuantFormat::Q8_0 => dot_q8_0(row, x),
            QuantFormat::Q4_0 => dot_q4_0(row, x),
            QuantFormat::Q5_0 => dot_q5_0(row, x),
            QuantFormat::Q4K => dot_q4k(row, x),
            QuantFormat::Q6K => dot_q6k(row, x),
            QuantFormat::F16 | QuantFormat::BF16 => unreachable!("{format} has no integer dot product"),
        }
    }

    /// The f16 at `p`, widened (F16C: exact, as `half`'s conversion).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn half(p: &[u8]) -> f32 {
        let bits = i32::from(u16::from_le_bytes([p[0], p[1]]));
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }

    /// 32 bytes at `p`.
    ///
    /// # Safety
    /// `p` holds at least 32 bytes (callers slice it).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load32(p: &[u8]) -> __m256i {
        // Sliced, so a short `p` panics instead of reading past it.
        let p = &p[..32];
        _mm256_loadu_si256(p.as_ptr().cast())
    }

    /// 32 activation values of block `g`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn xq(x: Q8Row<'_>, g: usize) -> __m256i {
        let q = &x.q[g * BLOCK..(g + 1) * BLOCK];
        _mm256_loadu_si256(q.as_ptr().cast())
    }

    /// The eight exact lane sums of unsigned `w` times signed `x` (lane
    /// `l`: bytes `4l..4l+4`): pairs summed in i16 (at most 2 * 128 * 127,
    /// no saturation), then quads in i32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn lanes_unsigned(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// `acc + factor * lanes` (a multiply then an add, as the scalar build).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn accumulate(acc: __m256, factor: f32, lanes: __m256i) -> __m256 {
        _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(factor), _mm256_cvtepi32_ps(lanes)))
    }

    /// The tile's sums (the scalar build's order).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn finish<const R: usize>(acc: [__m256; R], mins: [f32; R]) -> [f32; R] {
        std::array::from_fn(|r| {
            let mut l = [0f32; 8];
            _mm256_storeu_ps(l.as_mut_ptr(), acc[r]);
            lanes_sum(l) - mins[r]
        })
    }

    /// Every row of the tile against the decoded signed block `w` of
    /// group `g` (`factor`: the weight's scale).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn signed<const R: usize>(acc: &mut [__m256; R], x: &[Q8Row<'_>; R], w: __m256i, g: usize, factor: f32) {
        // |w| (unsigned, 128 for -128) and w's sign moved onto x.
        let aw = _mm256_sign_epi8(w, w);
        for r in 0..R {
            let sx = _mm256_sign_epi8(xq(x[r], g), w);
            acc[r] = accumulate(acc[r], factor * x[r].d[g], lanes_unsigned(aw, sx));
        }
    }

    /// 16 bytes of nibbles to 32 values in order: low nibbles then high.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn nibbles(p: &[u8]) -> __m256i {
        debug_assert!(p.len() >= 16);
        let raw = _mm_loadu_si128(p.as_ptr().cast());
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        _mm256_set_m128i(hi, lo)
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_q8_0<const R: usize>(row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        for (g, b) in row.chunks_exact(34).enumerate() {
            signed(&mut acc, &x, load32(&b[2..]), g, half(b));
        }
        finish(acc, [0.0; R])
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_q4_0<const R: usize>(row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let eight = _mm256_set1_epi8(8);
        for (g, b) in row.chunks_exact(18).enumerate() {
            signed(&mut acc, &x, _mm256_sub_epi8(nibbles(&b[2..]), eight), g, half(b));
        }
        finish(acc, [0.0; R])
    }

    /// 32 bits to 32 bytes, 0xFF where the bit is set (bit `i` to byte `i`).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn bits_to_bytes(bits: u32) -> __m256i {
        let shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuffle);
        let select = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
        _mm256_cmpeq_epi8(_mm256_or_si256(bytes, select), _mm256_set1_epi64x(-1))
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_q5_0<const R: usize>(row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let high = _mm256_set1_epi8(0xF0u8 as i8);
        for (g, b) in row.chunks_exact(22).enumerate() {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            // A clear fifth bit is `nibble - 16`: the nibble with 0xF0 set.
            let w = _mm256_or_si256(nibbles(&b[6..]), _mm256_andnot_si256(bits_to_bytes(qh), high));
            signed(&mut acc, &x, w, g, half(b));
        }
        finish(acc, [0.0; R])
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_q4k<const R: usize>(row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut mins = [0f32; R];
        let mask = _mm256_set1_epi8(0x0F);
        for (blk, b) in row.chunks_exact(144).enumerate() {
            let (d, dmin, scales) = (half(b), half(&b[2..]), &b[4..16]);
            for chunk in 0..4 {
                let q = load32(&b[16 + 32 * chunk..]);
                let parts = [_mm256_and_si256(q, mask), _mm256_and_si256(_mm256_srli_epi16(q, 4), mask)];
                for (i, w) in parts.into_iter().enumerate() {
                    let sub = 2 * chunk + i;
                    let g = blk * 8 + sub;
                    let (sc, m) = scale_min_k4(sub, scales);
                    let factor = d * f32::from(sc);
                    for r in 0..R {
                        acc[r] = accumulate(acc[r], factor * x[r].d[g], lanes_unsigned(w, xq(x[r], g)));
                        mins[r] += q4k_min(dmin, m, x[r], g);
                    }
                }
            }
        }
        finish(acc, mins)
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn dot_q6k<const R: usize>(row: &[u8], x: [Q8Row<'_>; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let (low4, high2, thirty_two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30), _mm256_set1_epi8(32));
        for (blk, b) in row.chunks_exact(210).enumerate() {
            let (sc, d) = (&b[192..208], half(&b[208..]));
            for h in 0..2 {
                let ql0 = load32(&b[64 * h..]);
                let ql1 = load32(&b[64 * h + 32..]);
                let qh = load32(&b[128 + 32 * h..]);
                let parts = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, high2)),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2),
                    ),
                ];
                for (part, q) in parts.into_iter().enumerate() {
                    let s = 4 * h + part;
                    let g = blk * 8 + s;
                    let w = _mm256_sub_epi8(q, thirty_two);
                    let aw = _mm256_sign_epi8(w, w);
                    let (sa, sb) = (i32::from(sc[2 * s] as i8), i32::from(sc[2 * s + 1] as i8));
                    let scales = _mm256_set_epi32(sb, sb, sb, sb, sa, sa, sa, sa);
                    for r in 0..R {
                        let ints = lanes_unsigned(aw, _mm256_sign_epi8(xq(x[r], g), w));
                        acc[r] = accumulate(acc[r], d * x[r].d[g], _mm256_mullo_epi32(ints, scales));
                    }
                }
            }
        }
        finish(acc, [0.0; R])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::tests::weight;

    /// Activations with blocks of very different magnitudes, a zero block
    /// and values on the rounding boundary.
    fn activations(rows: usize, k: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..rows * k)
            .map(|i| {
                let scale = [1.0, 1e-3, 40.0, 0.25][(i / 32) % 4];
                (((i * 37 + 11) % 101) as f32 - 50.0) / 50.0 * scale
            })
            .collect();
        x[32..64].fill(0.0);
        x[64] = 127.0;
        x[65] = 0.5;
        x[66] = -0.5;
        x
    }

    /// The reference: the weight decoded by `lazuli_ir`'s formulas, the
    /// activations dequantized from the same 8-bit blocks, f64 sums.
    fn reference(format: QuantFormat, w: &[u8], x: &Q8Rows, n: usize) -> Vec<f64> {
        let k = x.k;
        let row_bytes = format.row_bytes(k).unwrap();
        let mut deq = vec![0f32; k];
        let mut out = vec![0f64; n * x.rows()];
        for c in 0..n {
            format.dequantize_row(&w[c * row_bytes..(c + 1) * row_bytes], &mut deq);
            for r in 0..x.rows() {
                let xr = x.row(r);
                out[c * x.rows() + r] =
                    (0..k).map(|i| f64::from(deq[i]) * f64::from(xr.q[i]) * f64::from(xr.d[i / BLOCK])).sum();
            }
        }
        out
    }

    #[test]
    fn integer_dots_match_the_float64_product_of_the_decoded_operands() {
        for format in QuantFormat::ALL.into_iter().filter(|f| supported(*f)) {
            for (rows, n, k) in [(1, 7, 512), (3, 5, 256), (2, 3, 1024), (38, 3, 256)] {
                let w = weight(format, n, k, (rows * k) as u64);
                let x = Q8Rows::quantize(&activations(rows, k), k);
                let want = reference(format, &w, &x, n);
                let row_bytes = format.row_bytes(k).unwrap();
                let mut scalar = vec![0f32; n * rows];
                columns_scalar(format, &mut scalar, 0, &w, row_bytes, &x);
                let mut fast = vec![0f32; n * rows];
                columns(format, &mut fast, 0, &w, row_bytes, &x);
                // Sum of |terms|: the f32 rounding of reassociated sums
                // is bounded by a few ulps of it.
                let mut deq = vec![0f32; k];
                for (i, (s, r)) in scalar.iter().zip(&want).enumerate() {
                    let (c, row) = (i / rows, i % rows);
                    format.dequantize_row(&w[c * row_bytes..(c + 1) * row_bytes], &mut deq);
                    let xr = x.row(row);
                    let mag: f64 = (0..k)
                        .map(|j| (f64::from(deq[j]) * f64::from(xr.q[j]) * f64::from(xr.d[j / BLOCK])).abs())
                        .sum();
                    let tol = 1e-5 * mag + 1e-30;
                    assert!((f64::from(*s) - r).abs() <= tol, "{format} {rows}x{k} #{i}: {s} vs {r} (tol {tol:e})");
                }
                assert_eq!(
                    scalar.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{format}: the SIMD build differs from the scalar one"
                );
            }
        }
    }

    #[test]
    fn extreme_weight_bytes_are_exact() {
        // Q8_0 weights of -128 (never written by the quantizer, legal in a
        // file) and activations at +-127.
        let k = 64;
        let mut w = vec![0u8; 2 * 34];
        for b in w.chunks_mut(34) {
            b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            b[2..].fill(0x80);
        }
        let x: Vec<f32> = (0..k).map(|i| if i % 2 == 0 { 1.0 } else { -1.0 }).collect();
        let q = Q8Rows::quantize(&x, k);
        let (mut a, mut b) = ([0f32; 1], [0f32; 1]);
        columns(QuantFormat::Q8_0, &mut a, 0, &w, 68, &q);
        columns_scalar(QuantFormat::Q8_0, &mut b, 0, &w, 68, &q);
        assert_eq!(a, [0.0]);
        let x: Vec<f32> = vec![1.0; k];
        let q = Q8Rows::quantize(&x, k);
        columns(QuantFormat::Q8_0, &mut a, 0, &w, 68, &q);
        columns_scalar(QuantFormat::Q8_0, &mut b, 0, &w, 68, &q);
        assert_eq!(a, [-128.0 * 64.0]);
        assert_eq!(a, b);
    }

    #[test]
    fn activations_round_half_away_from_zero_and_nan_propagates() {
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49;
        let q = Q8Rows::quantize(&x, 32);
        assert_eq!((q.d[0], &q.q[..4]), (1.0, &[127i8, 3, -3, 0][..]));
        assert_eq!(q.sum[0], 127);
        x[5] = f32::NAN;
        let q = Q8Rows::quantize(&x, 32);
        let w = weight(QuantFormat::Q8_0, 1, 32, 3);
        let mut out = [0f32; 1];
        columns(QuantFormat::Q8_0, &mut out, 0, &w, 34, &q);
        assert!(out[0].is_nan());
    }
}
