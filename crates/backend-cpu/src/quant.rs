//! Kernels over block-quantized weights (`Op::Dequantize`,
//! `Op::QuantMatMul`; formats and reference formulas in
//! `lazuli_ir::quant`).
//!
//! The weight stays in its quantized bytes, never widened into a copy of
//! the matrix:
//! - by default, for Q8_0, Q4_0, Q5_0, Q4_K and Q6_K: the rows of `x` are
//!   quantized to 8 bits once per product and each weight row is dotted
//!   with them in integers ([`crate::quant_dot`], AVX2 where the CPU has
//!   it), as llama.cpp does, whatever the number of rows (so a row's
//!   result never depends on the rows beside it: a batch decodes what each
//!   sequence would alone). This rounds the activations (an error of at
//!   most half a step, `max|x| / 254`, per value of each 32-value block,
//!   that llama.cpp's results carry too); `LAZULI_CPU_Q8_ACTIVATIONS=0`
//!   keeps the exact paths below instead.
//! - few rows, exact (F16/BF16 weights, or the switch off): each weight
//!   row is decoded once (fused into the dot product for Q8_0 and Q4_0)
//!   and dotted with every row of `x` in f32 in eight independent lanes.
//! - many rows (prefill): panels of [`PANEL`] weight rows are decoded into
//!   f32 scratch and multiplied with the `gemm` crate's packed kernels.
//!
//! Weight rows (or panels) are split over the backend's pool
//! ([`crate::threads`]). On the exact paths sums are reassociated (lanes,
//! GEMM blocking) but never narrowed: every decoded weight is exactly the
//! reference value and `x` stays f32.

use crate::matmul::{gemm_strided, Dims, Strided};
use crate::memory::Memory;
use crate::quant_dot::{self, Q8Rows};
use crate::storage::CpuData;
use lazuli_executor::config;
use lazuli_executor::BackendError;
use lazuli_ir::QuantFormat;
use rayon::prelude::*;

/// Weight rows decoded together for the matrix-matrix product.
const PANEL: usize = 64;

/// Rows of `x` up to which the product is a matrix-vector loop.
const VECTOR_ROWS: usize = 4;

/// Multiply-adds under which a product runs on the calling thread.
const PAR_WORK: usize = 1 << 16;

/// Decodes every row of `w` (`u8 [.., row_bytes]`) to f32 `[.., cols]`.
pub(crate) fn dequantize(
    mem: &Memory,
    format: QuantFormat,
    w: &CpuData,
    dims: &[usize],
) -> Result<CpuData, BackendError> {
    let CpuData::U8(bytes) = w else { unreachable!("a verified dequantize reads u8") };
    let row_bytes = *dims.last().expect("rank >= 1 in a verified graph");
    let cols = format.row_len(row_bytes).expect("whole blocks in a verified graph");
    let rows = bytes.len().checked_div(row_bytes).unwrap_or(0);
    let CpuData::F32(mut out) = mem.take(lazuli_ir::DType::F32, rows * cols)? else { unreachable!("f32 asked") };
    if cols > 0 {
        let each = |(o, r): (&mut [f32], &[u8])| format.dequantize_row(r, o);
        if rows * cols >= PAR_WORK {
            out.par_chunks_mut(cols).zip(bytes.par_chunks(row_bytes)).for_each(each);
        } else {
            out.chunks_mut(cols).zip(bytes.chunks(row_bytes)).for_each(each);
        }
    }
    Ok(CpuData::F32(out))
}

/// Whether products of the block formats quantize the activations to 8 bits
/// (`LAZULI_CPU_Q8_ACTIVATIONS`, default on), read once per process. A
/// malformed value is logged and leaves the default (a device checks
/// every variable at creation and reports it).
fn q8_activations() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        config::flag(&config::process, "LAZULI_CPU_Q8_ACTIVATIONS")
            .unwrap_or_else(|e| {
                tracing::error!("{e}");
                None
            })
            .unwrap_or(true)
    })
}

/// `x @ dequantize(w)^T` for `x` f32 `[.., m, k]` and `w` u8 `[n, row_bytes]`.
pub(crate) fn matmul(
    mem: &Memory,
    format: QuantFormat,
    x: &CpuData,
    sx: &[usize],
    w: &CpuData,
    sw: &[usize],
) -> Result<CpuData, BackendError> {
    matmul_with(mem, format, x, sx, w, sw, q8_activations())
}

/// [`matmul`], the 8-bit activation path chosen by `q8`.
fn matmul_with(
    mem: &Memory,
    format: QuantFormat,
    x: &CpuData,
    sx: &[usize],
    w: &CpuData,
    sw: &[usize],
    q8: bool,
) -> Result<CpuData, BackendError> {
    let (CpuData::F32(x), CpuData::U8(w)) = (x, w) else { unreachable!("a verified quant_matmul reads f32 and u8") };
    let k = *sx.last().expect("rank >= 2 in a verified graph");
    let (n, row_bytes) = (sw[0], sw[1]);
    let rows = x.len().checked_div(k).unwrap_or_else(|| sx[..sx.len() - 1].iter().product());
    let CpuData::F32(mut out) = mem.zeros(lazuli_ir::DType::F32, rows * n)? else { unreachable!("f32 asked") };
    if rows == 0 || n == 0 || k == 0 {
        return Ok(CpuData::F32(out));
    }
    let threads = if rows * n * k >= PAR_WORK { crate::threads::available() } else { 1 };
    if threads > 1 {
        crate::threads::note(threads);
    }
    let shape = Shape { rows, k, n, row_bytes };
    if q8 && quant_dot::supported(format) {
        let xq = Q8Rows::quantize(&x[..rows * k], k);
        split_columns(&mut out, shape, threads, |dst, first| quant_dot::columns(format, dst, first, w, row_bytes, &xq));
    } else if rows <= VECTOR_ROWS {
        split_columns(&mut out, shape, threads, |dst, first| kernel(format, dst, first, w, x, shape));
    } else {
        panels(format, x, w, &mut out, Shape { rows, k, n, row_bytes }, threads);
    }
    Ok(CpuData::F32(out))
}

/// Sizes of one product: `x` is `rows x k`, the weight `n` rows of
/// `row_bytes`.
#[derive(Clone, Copy)]
struct Shape {
    rows: usize,
    k: usize,
    n: usize,
    row_bytes: usize,
}

/// The column form (the 8-bit path, and the exact matrix-vector one):
/// `task(dst, first)` writes output columns
/// `first..` (weight rows, `rows` values each) into `dst`; the columns
/// are split over `threads`, then transposed into the row-major `out`
/// (`rows x n`).
fn split_columns(out: &mut [f32], s: Shape, threads: usize, task: impl Fn(&mut [f32], usize) + Sync) {
    // Columns per task: a few tasks per thread so a preempted thread's
    // share is taken by the others, at least 8 columns each.
    let per_task = if threads > 1 { s.n.div_ceil(threads * 8).max(8) } else { s.n };
    let each = |(t, dst): (usize, &mut [f32])| task(dst, t * per_task);
    if s.rows == 1 {
        // One row: the columns are the output.
        if threads > 1 {
            out.par_chunks_mut(per_task).enumerate().for_each(each);
        } else {
            out.chunks_mut(per_task).enumerate().for_each(each);
        }
        return;
    }
    let mut cols: Vec<f32> = vec![0.0; s.n * s.rows];
    if threads > 1 {
        cols.par_chunks_mut(per_task * s.rows).enumerate().for_each(each);
    } else {
        cols.chunks_mut(per_task * s.rows).enumerate().for_each(each);
    }
    for (c, col) in cols.chunks(s.rows).enumerate() {
        for (r, v) in col.iter().enumerate() {
            out[r * s.n + c] = *v;
        }
    }
}

/// The matrix-matrix form: panels of weight rows decoded into scratch and
/// multiplied by the packed GEMM (`x @ panel^T`), panels over the pool.
fn panels(format: QuantFormat, x: &[f32], w: &[u8], out: &mut [f32], s: Shape, threads: usize) {
    let npanels = s.n.div_ceil(PANEL);
    let one = |p: usize| -> Vec<f32> {
        let width = PANEL.min(s.n - p * PANEL);
        let mut scratch = vec![0f32; width * s.k];
        for (j, dst) in scratch.chunks_mut(s.k).enumerate() {
            let c = p * PANEL + j;
            format.dequantize_row(&w[c * s.row_bytes..(c + 1) * s.row_bytes], dst);
        }
        let mut c = vec![0f32; s.rows * width];
        let a = Strided { data: x, rs: s.k, cs: 1 };
        // The panel read transposed in place: element (kk, j) at j * k + kk.
        let b = Strided { data: &scratch, rs: 1, cs: s.k };
        gemm_strided(a, b, &mut c, Dims { m: s.rows, k: s.k, n: width }, false, 1, 1.0);
        c
    };
    let results: Vec<Vec<f32>> =
        if threads > 1 { (0..npanels).into_par_iter().map(one).collect() } else { (0..npanels).map(one).collect() };
    for (p, c) in results.iter().enumerate() {
        let width = PANEL.min(s.n - p * PANEL);
        for r in 0..s.rows {
            out[r * s.n + p * PANEL..r * s.n + p * PANEL + width].copy_from_slice(&c[r * width..(r + 1) * width]);
        }
    }
}

/// Output columns `first..` of `dst` through `format`'s kernel: the fused
/// dot products of Q8_0 and Q4_0, a decoded row and a dot product for the
/// others. Compiled for AVX2 where the CPU has it: the whole loop nest is
/// inlined into a function built with the feature (a closure handed to
/// `elementwise::wide` is too large to be inlined into it, and stays
/// SSE2).
fn kernel(format: QuantFormat, dst: &mut [f32], first: usize, w: &[u8], x: &[f32], s: Shape) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2(format: QuantFormat, dst: &mut [f32], first: usize, w: &[u8], x: &[f32], s: Shape) {
            dispatch(format, dst, first, w, x, s)
        }
        // SAFETY: the CPU supports AVX2 (checked just above), the only
        // precondition of a `target_feature` function.
        #[allow(unsafe_code)]
        return unsafe { avx2(format, dst, first, w, x, s) };
    }
    dispatch(format, dst, first, w, x, s)
}

/// The body of [`kernel`], inlined into each of its builds: output
/// columns `first..` of `dst` (`rows` values each), weight row `c` against
/// every row of `x`. The dot products are direct calls of
/// `#[inline(always)]` functions (a callable passed in would be called
/// through a shim built without the feature).
#[inline(always)]
fn dispatch(format: QuantFormat, dst: &mut [f32], first: usize, w: &[u8], x: &[f32], s: Shape) {
    macro_rules! columns {
        (|$row:ident, $xr:ident| $dot:expr) => {
            for (j, d) in dst.chunks_mut(s.rows).enumerate() {
                let c = first + j;
                let $row = &w[c * s.row_bytes..(c + 1) * s.row_bytes];
                for (r, o) in d.iter_mut().enumerate() {
                    let $xr = &x[r * s.k..(r + 1) * s.k];
                    *o = $dot;
                }
            }
        };
    }
    match format {
        QuantFormat::Q8_0 => columns!(|row, xr| dot_q8_0(row, xr)),
        QuantFormat::Q4_0 => columns!(|row, xr| dot_q4_0(row, xr)),
        _ => {
            let mut scratch = vec![0f32; s.k];
            columns!(|row, xr| {
                format.dequantize_row(row, &mut scratch);
                dot(&scratch, xr)
            })
        }
    }
}

/// Sums eight lanes pairwise.
#[inline(always)]
fn lanes_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// A Q8_0 row (blocks of an f16 scale and 32 `i8`) dotted with `x`,
/// fused: the block's values are never written out, its scale multiplies
/// the block's partial sums (a reassociation of the reference's
/// `(d * q) * x`).
#[inline(always)]
fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let q = &b[2..34];
        let mut s = [0f32; 8];
        for j in 0..4 {
            for l in 0..8 {
                s[l] += f32::from(q[8 * j + l] as i8) * xs[8 * j + l];
            }
        }
        for l in 0..8 {
            acc[l] += d * s[l];
        }
    }
    lanes_sum(acc)
}

/// A Q4_0 row (blocks of an f16 scale and 32 nibbles, value `q - 8`;
/// nibble `j` low is value `j`, high is value `j + 16`) dotted with `x`.
#[inline(always)]
fn dot_q4_0(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (b, xs) in row.chunks_exact(18).zip(x.chunks_exact(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let q = &b[2..18];
        let mut s = [0f32; 8];
        for j in 0..2 {
            for l in 0..8 {
                let v = q[8 * j + l];
                s[l] += f32::from((v & 0x0F) as i8 - 8) * xs[8 * j + l];
                s[l] += f32::from((v >> 4) as i8 - 8) * xs[16 + 8 * j + l];
            }
        }
        for l in 0..8 {
            acc[l] += d * s[l];
        }
    }
    lanes_sum(acc)
}

/// A dot product in eight independent lanes (so it vectorizes).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    let pairs = [lanes[0] + lanes[4], lanes[1] + lanes[5], lanes[2] + lanes[6], lanes[3] + lanes[7]];
    (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A deterministic weight of `n` rows of `k` values in `format`
    /// (random bytes with finite scales; `quant_dot`'s tests use it too).
    pub(crate) fn weight(format: QuantFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let row_bytes = format.row_bytes(k).unwrap();
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u8
        };
        let mut w: Vec<u8> = (0..n * row_bytes).map(|_| next()).collect();
        // Keep f16 scales small and finite: exponent bits limited.
        let fix = |b: &mut [u8], at: usize| b[at + 1] = 0x20 | (b[at + 1] & 0x83);
        for block in w.chunks_mut(format.block_bytes()) {
            match format {
                QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => fix(block, 0),
                QuantFormat::Q4K => {
                    fix(block, 0);
                    fix(block, 2);
                }
                QuantFormat::Q6K => fix(block, 208),
                QuantFormat::F16 => fix(block, 0),
                QuantFormat::BF16 => block[1] &= 0x3f,
            }
        }
        w
    }

    fn reference(format: QuantFormat, x: &[f32], w: &[u8], rows: usize, k: usize, n: usize) -> Vec<f64> {
        let row_bytes = format.row_bytes(k).unwrap();
        let mut deq = vec![0f32; k];
        let mut out = vec![0f64; rows * n];
        for c in 0..n {
            format.dequantize_row(&w[c * row_bytes..(c + 1) * row_bytes], &mut deq);
            for r in 0..rows {
                out[r * n + c] = (0..k).map(|i| f64::from(deq[i]) * f64::from(x[r * k + i])).sum();
            }
        }
        out
    }

    #[test]
    fn exact_forms_match_the_float64_product_of_the_decoded_weight() {
        let mem = Memory::new(None);
        for format in QuantFormat::ALL {
            let k = 512;
            for (rows, n) in [(1, 70), (3, 5), (9, 130)] {
                let w = weight(format, n, k, rows as u64 + 7);
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
                let got = matmul_with(
                    &mem,
                    format,
                    &CpuData::F32(x.clone()),
                    &[rows, k],
                    &CpuData::U8(w.clone()),
                    &[n, format.row_bytes(k).unwrap()],
                    false,
                )
                .unwrap();
                let CpuData::F32(got) = got else { panic!() };
                let want = reference(format, &x, &w, rows, k, n);
                for (g, r) in got.iter().zip(&want) {
                    let tol = 1e-4 * (1.0 + r.abs());
                    assert!((f64::from(*g) - r).abs() <= tol, "{format} rows {rows}: {g} vs {r}");
                }
            }
        }
    }

    /// The 8-bit path is the integer dot of `quant_dot` in the output's
    /// layout, whatever the rows and the split; against the exact product
    /// its error is the activations' rounding: per block at most half a
    /// step (`max|x| / 254`) times the block's `sum |w|`.
    #[test]
    fn the_8_bit_path_is_the_integer_dot_within_the_activation_rounding() {
        let mem = Memory::new(None);
        for format in QuantFormat::ALL.into_iter().filter(|f| quant_dot::supported(*f)) {
            let k = 512;
            for (rows, n) in [(1, 300), (4, 70), (37, 20)] {
                let w = weight(format, n, k, rows as u64 + 3);
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
                let row_bytes = format.row_bytes(k).unwrap();
                let run = |q8| {
                    let got = matmul_with(
                        &mem,
                        format,
                        &CpuData::F32(x.clone()),
                        &[rows, k],
                        &CpuData::U8(w.clone()),
                        &[n, row_bytes],
                        q8,
                    );
                    let Ok(CpuData::F32(got)) = got else { panic!() };
                    got
                };
                let fast = run(true);
                let xq = Q8Rows::quantize(&x, k);
                let mut cols = vec![0f32; n * rows];
                quant_dot::columns_scalar(format, &mut cols, 0, &w, row_bytes, &xq);
                let mut deq = vec![0f32; k];
                for c in 0..n {
                    format.dequantize_row(&w[c * row_bytes..(c + 1) * row_bytes], &mut deq);
                    for r in 0..rows {
                        let got = fast[r * n + c];
                        assert_eq!(got.to_bits(), cols[c * rows + r].to_bits(), "{format} ({r}, {c})");
                        let xr = &x[r * k..(r + 1) * k];
                        let exact: f64 = (0..k).map(|i| f64::from(deq[i]) * f64::from(xr[i])).sum();
                        let bound: f64 = (0..k / 32)
                            .map(|b| {
                                let amax = xr[32 * b..32 * b + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
                                let wsum: f64 = deq[32 * b..32 * b + 32].iter().map(|v| f64::from(v.abs())).sum();
                                f64::from(amax) / 254.0 * wsum
                            })
                            .sum();
                        let tol = bound * (1.0 + 1e-4) + 1e-4 * (1.0 + exact.abs());
                        assert!((f64::from(got) - exact).abs() <= tol, "{format} ({r}, {c}): {got} vs {exact}");
                    }
                }
            }
        }
    }

    #[test]
    fn dequantize_decodes_every_row() {
        let mem = Memory::new(None);
        let format = QuantFormat::Q4_0;
        let w = weight(format, 3, 64, 1);
        let CpuData::F32(got) = dequantize(&mem, format, &CpuData::U8(w.clone()), &[3, 36]).unwrap() else { panic!() };
        let mut want = vec![0f32; 64];
        format.dequantize_row(&w[36..72], &mut want);
        assert_eq!(&got[64..128], &want[..]);
    }
}
