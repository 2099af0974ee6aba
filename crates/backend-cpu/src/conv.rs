//! Windowed kernels: 2-d convolution (groups, strides, dilation, padding)
//! and N-d max / average pooling.
//!
//! Convolution is im2col + GEMM. For a chunk of images and one group, the
//! input patches are packed into a column matrix `col[(c, ki, kj), (n, y, x)]`
//! (zeros where a tap falls into the padding), and the group's weight rows
//! `[O/g, C/g * kh * kw]` multiply it with the `gemm` crate's packed SIMD
//! kernel; with several images per chunk the product goes through a scratch
//! matrix and is scattered into `[N, O, oh, ow]`. Putting the images of a
//! chunk side by side in the GEMM's N dimension keeps the product wide even
//! when one image has few output positions, which is the shape of the
//! weight gradient (a convolution whose "kernel" is the output gradient,
//! see the executor's autograd): one wide GEMM instead of many thin ones.
//! Chunks hold at most `COL_BUDGET` column elements. Packing is split over
//! the rayon pool by column-matrix row and large GEMMs split themselves.
//! f32 and f64 accumulate in their own type (reassociated, FMA where the
//! CPU has it, like matmul); f16 is widened to f32 and rounded back.
//!
//! Pooling precomputes, per spatial dim and output position, the valid
//! input positions of the window; padding never wins a max window. A
//! window with no valid element gives the dtype's lowest value (max) or
//! NaN (average without `count_include_pad`, 0 / 0).

use crate::elem::{Float, Num};
use crate::matmul::{GemmFloat, PAR_FLOPS};
use crate::memory::Memory;
use crate::storage::{same_float, same_num, CpuData};
use half::f16;
use lazuli_executor::BackendError;
use lazuli_ir::{ConvAttrs, DType, PoolAttrs, PoolKind};
use rayon::prelude::*;

/// Most elements of one chunk's column matrix (16 MiB of f32).
const COL_BUDGET: usize = 1 << 22;

/// Column matrices with fewer elements than this are packed on one thread.
const PAR_PACK: usize = 1 << 16;

/// Convolves `x` (`[N, C, H, W]`) with `w` (`[O, C/g, kh, kw]`) into `out`.
pub(crate) fn conv2d(
    mem: &Memory,
    x: &CpuData,
    xd: &[usize],
    w: &CpuData,
    wd: &[usize],
    out: &[usize],
    c: &ConvAttrs,
) -> Result<CpuData, BackendError> {
    let n: usize = out.iter().product();
    Ok(match (x, w) {
        (CpuData::F32(a), CpuData::F32(b)) => {
            let CpuData::F32(dst) = mem.take(DType::F32, n)? else {
                unreachable!("the pool returns the dtype asked for")
            };
            CpuData::F32(conv_gemm(mem, a, xd, b, wd, out, c, dst, COL_BUDGET)?)
        }
        (CpuData::F64(a), CpuData::F64(b)) => {
            CpuData::F64(conv_gemm(mem, a, xd, b, wd, out, c, mem.zeroed(n)?, COL_BUDGET)?)
        }
        (CpuData::F16(a), CpuData::F16(b)) => {
            let af = mem.collect(a.len(), |i| a[i].to_f32())?;
            let bf = mem.collect(b.len(), |i| b[i].to_f32())?;
            let r = conv_gemm(mem, &af, xd, &bf, wd, out, c, mem.zeroed(n)?, COL_BUDGET)?;
            CpuData::F16(mem.collect(r.len(), |i| f16::from_f32(r[i]))?)
        }
        _ => unreachable!("conv2d takes two operands of one float dtype in a verified graph"),
    })
}

/// The convolution into `res` (`[N, O, oh, ow]`; every element is
/// written), packing at most `budget` column elements at a time (more when
/// one image needs more).
#[allow(clippy::too_many_arguments)] // Operands, their shapes, the attributes and the output: one op's signature.
fn conv_gemm<T: GemmFloat + Send + Sync>(
    mem: &Memory,
    x: &[T],
    xd: &[usize],
    w: &[T],
    wd: &[usize],
    od: &[usize],
    c: &ConvAttrs,
    mut res: Vec<T>,
    budget: usize,
) -> Result<Vec<T>, BackendError> {
    let (nb, ci, ih, iw) = (xd[0], xd[1], xd[2], xd[3]);
    let (co, cg, kh, kw) = (wd[0], wd[1], wd[2], wd[3]);
    let p = od[2] * od[3];
    let og = co / c.groups;
    let k = cg * kh * kw;
    if res.is_empty() {
        return Ok(res);
    }
    if k == 0 {
        // No input channels: every output is an empty sum.
        res.fill(T::ZERO);
        return Ok(res);
    }
    let geo = Geometry { ci, ih, iw, cg, kh, kw, oh: od[2], ow: od[3], c: c.clone() };
    let chunk = (budget / (k * p).max(1)).clamp(1, nb);
    let mut col = mem.zeroed(k * chunk * p)?;
    let mut tmp = if chunk > 1 { mem.zeroed(og * chunk * p)? } else { Vec::new() };
    let threads = rayon::current_num_threads();
    for n0 in (0..nb).step_by(chunk) {
        let nc = chunk.min(nb - n0);
        let cols = nc * p;
        let gemm_threads = if threads > 1 && og * k * cols >= PAR_FLOPS { threads } else { 1 };
        for g in 0..c.groups {
            let col = &mut col[..k * cols];
            geo.pack(x, n0, nc, g, col);
            let wg = &w[g * og * k..(g + 1) * og * k];
            if nc == 1 {
                // One image: the group's output rows are contiguous.
                let start = (n0 * co + g * og) * p;
                T::gemm(wg, col, &mut res[start..start + og * p], og, k, p, gemm_threads);
            } else {
                let tmp = &mut tmp[..og * cols];
                T::gemm(wg, col, tmp, og, k, cols, gemm_threads);
                for o in 0..og {
                    for j in 0..nc {
                        let dst = ((n0 + j) * co + g * og + o) * p;
                        res[dst..dst + p].copy_from_slice(&tmp[o * cols + j * p..o * cols + (j + 1) * p]);
                    }
                }
            }
        }
    }
    Ok(res)
}

/// Sizes and attributes of one convolution, for packing columns.
struct Geometry {
    ci: usize,
    ih: usize,
    iw: usize,
    cg: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    c: ConvAttrs,
}

impl Geometry {
    /// Fills `col` (`[cg * kh * kw, nc * oh * ow]`) with the patches of
    /// images `n0..n0 + nc`, group `g`.
    fn pack<T: Num + Send + Sync>(&self, x: &[T], n0: usize, nc: usize, g: usize, col: &mut [T]) {
        let row_len = nc * self.oh * self.ow;
        let fill = |(r, row): (usize, &mut [T])| {
            let cc = r / (self.kh * self.kw);
            let (ki, kj) = ((r / self.kw) % self.kh, r % self.kw);
            for j in 0..nc {
                let ch = g * self.cg + cc;
                let plane = &x[((n0 + j) * self.ci + ch) * self.ih * self.iw..][..self.ih * self.iw];
                let out = &mut row[j * self.oh * self.ow..(j + 1) * self.oh * self.ow];
                self.pack_plane(plane, ki, kj, out);
            }
        };
        if col.len() >= PAR_PACK && rayon::current_num_threads() > 1 {
            col.par_chunks_mut(row_len).enumerate().for_each(fill);
        } else {
            col.chunks_mut(row_len).enumerate().for_each(fill);
        }
    }

    /// One column-matrix row segment: tap `(ki, kj)` of every output
    /// position of one input plane.
    fn pack_plane<T: Num>(&self, plane: &[T], ki: usize, kj: usize, out: &mut [T]) {
        let c = &self.c;
        let (sw, pw) = (c.strides[1], c.pads[1] as isize);
        let x_off = (kj * c.dilations[1]) as isize - pw;
        // Output columns whose tap lands inside the row: x0 <= xo < x1.
        let first_in = |xo: usize| x_off + (xo * sw) as isize >= 0;
        let x0 = (0..self.ow).find(|&xo| first_in(xo)).unwrap_or(self.ow);
        let x1 = (x0..self.ow).find(|&xo| x_off + (xo * sw) as isize >= self.iw as isize).unwrap_or(self.ow);
        for (y, orow) in out.chunks_exact_mut(self.ow).enumerate() {
            let iy = (y * c.strides[0] + ki * c.dilations[0]) as isize - c.pads[0] as isize;
            if iy < 0 || iy >= self.ih as isize || x0 >= x1 {
                orow.fill(T::ZERO);
                continue;
            }
            let src = &plane[iy as usize * self.iw..(iy as usize + 1) * self.iw];
            orow[..x0].fill(T::ZERO);
            orow[x1..].fill(T::ZERO);
            let base = (x_off + (x0 * sw) as isize) as usize;
            if sw == 1 {
                orow[x0..x1].copy_from_slice(&src[base..base + (x1 - x0)]);
            } else {
                for (i, o) in orow[x0..x1].iter_mut().enumerate() {
                    *o = src[base + i * sw];
                }
            }
        }
    }
}

/// Per spatial dim and output position: the valid input positions of the
/// window and the number of window taps inside the padded extent.
struct Windows {
    valid: Vec<Vec<Vec<usize>>>,
    padded: Vec<Vec<usize>>,
}

fn windows(p: &PoolAttrs, in_sp: &[usize], out_sp: &[usize]) -> Windows {
    let mut valid = Vec::new();
    let mut padded = Vec::new();
    for d in 0..in_sp.len() {
        let (mut vd, mut pd) = (Vec::new(), Vec::new());
        for o in 0..out_sp[d] {
            let mut v = Vec::new();
            let mut count = 0;
            for k in 0..p.kernel[d] {
                let pos = (o * p.strides[d] + k * p.dilations[d]) as isize - p.pads_begin[d] as isize;
                if pos < (in_sp[d] + p.pads_end[d]) as isize {
                    count += 1;
                }
                if pos >= 0 && pos < in_sp[d] as isize {
                    v.push(pos as usize);
                }
            }
            vd.push(v);
            pd.push(count);
        }
        valid.push(vd);
        padded.push(pd);
    }
    Windows { valid, padded }
}

/// Pools `x` (`[N, C, spatial...]`) into shape `out`.
pub(crate) fn pool(
    mem: &Memory,
    x: &CpuData,
    xd: &[usize],
    out: &[usize],
    p: &PoolAttrs,
) -> Result<CpuData, BackendError> {
    let win = windows(p, &xd[2..], &out[2..]);
    Ok(match p.kind {
        PoolKind::Max => {
            same_num!(x, v => pool_typed(mem, v, xd, out, &win, |it, _| it.fold(Num::LOWEST, Num::maximum))?)
        }
        PoolKind::Avg { count_include_pad } => same_float!(x, v => pool_typed(mem, v, xd, out, &win, |it, padded| {
            let mut s = 0.0;
            let mut n = 0usize;
            for e in it {
                s += Float::to_f64(e);
                n += 1;
            }
            let div = if count_include_pad { padded } else { n };
            Float::from_f64(s / div as f64)
        })?),
    })
}

/// Runs `f(window elements, padded tap count)` for every output element.
fn pool_typed<T: Copy>(
    mem: &Memory,
    x: &[T],
    xd: &[usize],
    out: &[usize],
    win: &Windows,
    f: impl Fn(&mut dyn Iterator<Item = T>, usize) -> T,
) -> Result<Vec<T>, BackendError> {
    let nsp = xd.len() - 2;
    let in_plane: usize = xd[2..].iter().product();
    let out_sp = &out[2..];
    let out_plane: usize = out_sp.iter().product();
    let in_strides = crate::layout::strides(&xd[2..]);
    let mut res = mem.vec(out[0] * out[1] * out_plane)?;
    let mut opos = vec![0usize; nsp];
    let mut lists: Vec<&[usize]> = Vec::with_capacity(nsp);
    for pi in 0..out[0] * out[1] {
        let plane = &x[pi * in_plane..(pi + 1) * in_plane];
        for flat in 0..out_plane {
            let mut rest = flat;
            for d in (0..nsp).rev() {
                opos[d] = rest % out_sp[d];
                rest /= out_sp[d];
            }
            lists.clear();
            lists.extend((0..nsp).map(|d| win.valid[d][opos[d]].as_slice()));
            let padded: usize = (0..nsp).map(|d| win.padded[d][opos[d]]).product();
            let total: usize = lists.iter().map(|l| l.len()).product();
            let mut it = (0..total).map(|t| {
                let mut rest = t;
                let mut off = 0;
                for d in (0..nsp).rev() {
                    let l = lists[d];
                    off += l[rest % l.len()] * in_strides[d];
                    rest /= l.len();
                }
                plane[off]
            });
            res.push(f(&mut it, padded));
        }
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: a direct loop over every output and tap, in f64.
    fn direct(x: &[f64], xd: &[usize], w: &[f64], wd: &[usize], od: &[usize], c: &ConvAttrs) -> Vec<f64> {
        let opg = wd[0] / c.groups;
        let mut out = Vec::new();
        for n in 0..od[0] {
            for o in 0..od[1] {
                for y in 0..od[2] {
                    for xo in 0..od[3] {
                        let mut s = 0.0;
                        for cc in 0..wd[1] {
                            let ch = (o / opg) * wd[1] + cc;
                            for i in 0..wd[2] {
                                for j in 0..wd[3] {
                                    let iy = (y * c.strides[0] + i * c.dilations[0]) as isize - c.pads[0] as isize;
                                    let ix = (xo * c.strides[1] + j * c.dilations[1]) as isize - c.pads[1] as isize;
                                    if iy >= 0 && ix >= 0 && (iy as usize) < xd[2] && (ix as usize) < xd[3] {
                                        s += x[((n * xd[1] + ch) * xd[2] + iy as usize) * xd[3] + ix as usize]
                                            * w[((o * wd[1] + cc) * wd[2] + i) * wd[3] + j];
                                    }
                                }
                            }
                        }
                        out.push(s);
                    }
                }
            }
        }
        out
    }

    /// Every packing path (one image per chunk, several, a partial last
    /// chunk; unit and larger strides; taps outside the input on both
    /// sides) agrees with the direct loop.
    #[test]
    fn im2col_gemm_matches_the_direct_loop() {
        let cases = [
            (ConvAttrs::default(), [3, 2, 5, 6], [4, 2, 3, 3]),
            (
                ConvAttrs { strides: [2, 3], pads: [1, 2, 2, 1], dilations: [1, 2], groups: 1 },
                [5, 3, 7, 8],
                [2, 3, 2, 3],
            ),
            (
                ConvAttrs { strides: [1, 1], pads: [3, 3, 3, 3], dilations: [2, 2], groups: 2 },
                [2, 4, 4, 5],
                [6, 2, 3, 2],
            ),
            (ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], groups: 1 }, [4, 3, 6, 6], [2, 3, 6, 6]),
            (
                ConvAttrs { strides: [4, 4], pads: [0, 0, 0, 0], dilations: [1, 1], groups: 3 },
                [2, 3, 9, 9],
                [3, 1, 1, 1],
            ),
        ];
        for (c, xd, wd) in cases {
            let od = lazuli_ir::Op::Conv2d(c.clone())
                .infer(
                    &[
                        lazuli_ir::ValueType::new(xd.to_vec(), DType::F64),
                        lazuli_ir::ValueType::new(wd.to_vec(), DType::F64),
                    ],
                    &[],
                    &[],
                )
                .unwrap()
                .shape;
            let od = od.dims();
            let x: Vec<f64> = (0..xd.iter().product()).map(|i| ((i * 7919) % 23) as f64 / 7.0 - 1.5).collect();
            let w: Vec<f64> = (0..wd.iter().product()).map(|i| ((i * 104_729) % 17) as f64 / 5.0 - 1.6).collect();
            let want = direct(&x, &xd, &w, &wd, od, &c);
            let k = wd[1] * wd[2] * wd[3];
            let p = od[2] * od[3];
            // Budgets for one image per chunk, two, and all at once.
            for budget in [1, 2 * k * p, usize::MAX / 2] {
                let got = conv_gemm(&Memory::default(), &x, &xd, &w, &wd, od, &c, vec![f64::NAN; want.len()], budget)
                    .unwrap();
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!((g - e).abs() <= 1e-12 * (1.0 + e.abs()), "{c:?} budget {budget}: element {i}: {g} vs {e}");
                }
            }
        }
    }
}
