//! Windowed kernels: 2-d convolution (groups, strides, dilation, padding)
//! and N-d max / average pooling.
//!
//! Depthwise convolution (one input and one output channel a group) is computed
//! directly, tap by tap along output rows ([`depthwise`]); every other
//! convolution is im2col + GEMM. For a chunk of images and one group, the
//! input patches are packed as the rows of a matrix
//! `col[(n, y, x), (c, ki, kj)]` (zeros where a tap falls into the
//! padding), multiplied by the transposed weight rows of the group with
//! the `gemm` crate's packed SIMD kernel, `out[(n, y, x), o] = col .
//! w[o]`, and the product is transposed into `[N, O, oh, ow]`. This
//! orientation, output positions as the GEMM's M dimension and output
//! channels as N, is the one the `gemm` crate is fast at (measured on 2
//! cores: 140-180 GFLOP/s for `[7168, 576] x [576, 32]`, 20-55 GFLOP/s for
//! the same product as `[32, 576] x [576, 7168]`); several images per
//! chunk keep M large when one image has few output positions, which is
//! the shape of the weight gradient (a convolution whose "kernel" is the
//! output gradient, see the executor's autograd).
//!
//! Packing reads the input in contiguous runs: along the kernel row when
//! it is at least as long as an output row (the weight gradient's large
//! "kernels"), otherwise along the output row, into a small
//! cache-resident block `[(c, ki, kj), x]` per output row that is then
//! transposed into place. Chunks hold at most `COL_BUDGET` patch elements;
//! packing is split over the rayon pool by output row and large GEMMs split
//! themselves. f32 and f64 accumulate in their own type (reassociated, FMA
//! where the CPU has it, like matmul); f16 and bf16 are widened to f32 and rounded
//! back.
//!
//! Pooling precomputes, per spatial dim and output position, the valid
//! input positions of the window; padding never wins a max window. A
//! window with no valid element gives the dtype's lowest value (max) or
//! NaN (average without `count_include_pad`, 0 / 0). The pooling gradient
//! walks the same windows and hands each window's gradient to its taps
//! (max: to the first maximum in scan order).

use crate::elem::{Float, Num};
use crate::matmul::{Dims, GemmFloat, PAR_FLOPS};
use crate::memory::Memory;
use crate::storage::{same_float, same_num, CpuData};
use half::{bf16, f16};
use lazuli_executor::BackendError;
use lazuli_ir::{ConvAttrs, DType, PoolAttrs, PoolKind};
use rayon::prelude::*;

/// Most elements of one chunk's patch matrix (16 MiB of f32).
const COL_BUDGET: usize = 1 << 22;

/// Patch matrices with fewer elements than this are packed on one thread.
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
        (CpuData::BF16(a), CpuData::BF16(b)) => {
            let af = mem.collect(a.len(), |i| a[i].to_f32())?;
            let bf = mem.collect(b.len(), |i| b[i].to_f32())?;
            let r = conv_gemm(mem, &af, xd, &bf, wd, out, c, mem.zeroed(n)?, COL_BUDGET)?;
            CpuData::BF16(mem.collect(r.len(), |i| bf16::from_f32(r[i]))?)
        }
        _ => unreachable!("conv2d takes two operands of one float dtype in a verified graph"),
    })
}

/// The convolution into `res` (`[N, O, oh, ow]`; every element is
/// written), packing at most `budget` patch elements at a time (more when
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
    if cg == 1 && og == 1 {
        // Depthwise (one input and one output channel a group): no product
        // to pack for. With a channel multiplier (L1's first layer, one
        // input channel into 16) the GEMM over the shared patches wins.
        depthwise(x, xd, w, wd, od, c, &mut res);
        return Ok(res);
    }
    let geo = Geometry { ci, ih, iw, cg, kh, kw, oh: od[2], ow: od[3], c: c.clone() };
    // Kernels narrower than the output: pack from a channels-last copy of
    // the images, with the patch columns ordered (ki, kj, c) and the weight
    // permuted to match, so that every tap is a run of `cg` channels.
    let channels_last = kw < od[3];
    let wl: Vec<T> = if channels_last {
        let mut v = mem.zeroed(w.len())?;
        for (o, dst) in v.chunks_exact_mut(k).enumerate() {
            transpose(&w[o * k..(o + 1) * k], cg, kh * kw, dst);
        }
        v
    } else {
        Vec::new()
    };
    let wl: &[T] = if channels_last { &wl } else { w };
    let plane = ih * iw;
    let chunk = (budget / (k * p).max(1)).clamp(1, nb);
    let mut col = mem.zeroed(chunk * p * k)?;
    let mut tmp = mem.zeroed(chunk * p * og)?;
    let mut hwc = if channels_last { mem.zeroed(chunk * plane * cg)? } else { Vec::new() };
    let threads = crate::threads::available();
    for n0 in (0..nb).step_by(chunk) {
        let nc = chunk.min(nb - n0);
        let rows = nc * p;
        let gemm_threads = if threads > 1 && og * k * rows >= PAR_FLOPS { threads } else { 1 };
        for g in 0..c.groups {
            let col = &mut col[..rows * k];
            if channels_last {
                let hwc = &mut hwc[..nc * plane * cg];
                let to_hwc = |(j, dst): (usize, &mut [T])| {
                    let src = &x[((n0 + j) * ci + g * cg) * plane..][..cg * plane];
                    transpose(src, cg, plane, dst);
                };
                if hwc.len() >= PAR_PACK && threads > 1 {
                    crate::threads::note(threads);
                    hwc.par_chunks_mut(plane * cg).enumerate().for_each(to_hwc);
                } else {
                    hwc.chunks_mut(plane * cg).enumerate().for_each(to_hwc);
                }
                geo.pack_channels_last(hwc, col);
            } else {
                geo.pack_kernel_runs(x, n0, g, col);
            }
            // tmp[(j, q), o] = col[(j, q), :] . w[g * og + o, :]
            let tmp = &mut tmp[..rows * og];
            let wg = &wl[g * og * k..(g + 1) * og * k];
            if gemm_threads > 1 && k >= SPLIT_K * rows.max(og) {
                split_k_gemm(mem, col, wg, tmp, Dims { m: rows, k, n: og }, threads)?;
            } else {
                T::gemm_bt(col, k, wg, k, tmp, Dims { m: rows, k, n: og }, gemm_threads);
            }
            // Into [N, O, oh, ow]: each image's [p, og] block transposed.
            let images = &mut res[n0 * co * p..(n0 + nc) * co * p];
            let place = |(j, img): (usize, &mut [T])| {
                transpose(&tmp[j * p * og..(j + 1) * p * og], p, og, &mut img[g * og * p..(g + 1) * og * p]);
            };
            if rows * og >= PAR_PACK && threads > 1 {
                crate::threads::note(threads);
                images.par_chunks_mut(co * p).enumerate().for_each(place);
            } else {
                images.chunks_mut(co * p).enumerate().for_each(place);
            }
        }
    }
    Ok(res)
}

/// The convolution of groups with one input and one output channel each
/// (depthwise) into `res` (`[N, O, oh, ow]`), computed directly:
/// per output plane, each kernel tap adds its weight times the input
/// row it reads to every output row inside the input (a unit-stride
/// `axpy` along the row, which the compiler vectorizes). The im2col form
/// would pack a `[positions, kh * kw]` matrix and call a GEMM with one
/// output column per group. Planes split over the rayon pool when the
/// convolution is large. The sum runs over the taps in `(ki, kj)` order.
fn depthwise<T: Num + Send + Sync>(
    x: &[T],
    xd: &[usize],
    w: &[T],
    wd: &[usize],
    od: &[usize],
    c: &ConvAttrs,
    res: &mut [T],
) {
    let (ci, ih, iw) = (xd[1], xd[2], xd[3]);
    let (co, kh, kw) = (wd[0], wd[2], wd[3]);
    let (oh, ow) = (od[2], od[3]);
    let og = co / c.groups;
    let p = oh * ow;
    let rows: Vec<Span> = (0..kh).map(|ki| span(oh, ih, c.strides[0], c.dilations[0], c.pads[0], ki)).collect();
    let cols: Vec<Span> = (0..kw).map(|kj| span(ow, iw, c.strides[1], c.dilations[1], c.pads[1], kj)).collect();
    let plane = |(r, out): (usize, &mut [T])| {
        let (n, o) = (r / co, r % co);
        let src = &x[(n * ci + o / og) * ih * iw..][..ih * iw];
        let taps = &w[o * kh * kw..][..kh * kw];
        out.fill(T::ZERO);
        for (ki, sy) in rows.iter().enumerate() {
            for (kj, sx) in cols.iter().enumerate() {
                let wv = taps[ki * kw + kj];
                let len = sx.hi - sx.lo;
                if len == 0 {
                    continue;
                }
                for y in sy.lo..sy.hi {
                    let iy = sy.start + (y - sy.lo) * c.strides[0];
                    let dst = &mut out[y * ow + sx.lo..y * ow + sx.hi];
                    let row = &src[iy * iw + sx.start..];
                    if c.strides[1] == 1 {
                        for (d, &v) in dst.iter_mut().zip(&row[..len]) {
                            *d = T::add(*d, T::mul(wv, v));
                        }
                    } else {
                        for (j, d) in dst.iter_mut().enumerate() {
                            *d = T::add(*d, T::mul(wv, row[j * c.strides[1]]));
                        }
                    }
                }
            }
        }
    };
    let threads = crate::threads::available();
    if threads > 1 && res.len() * kh * kw >= PAR_FLOPS && res.len() > p {
        crate::threads::note(threads);
        res.par_chunks_mut(p).enumerate().for_each(plane);
    } else {
        res.chunks_mut(p).enumerate().for_each(plane);
    }
}

/// A reduction this many times longer than both sides of the product is
/// split across threads ([`split_k_gemm`]).
const SPLIT_K: usize = 16;

/// `c = a @ b^T` (`a` `m x k`, `b` `n x k`, both rows `k` long) with the
/// reduction split into one slice per thread, each a one-thread GEMM into
/// its own partial product, then summed. For products with a small output
/// and a long reduction (the weight gradient: `[C*kh*kw, O]` summed over
/// every output position of the batch), which a GEMM cannot split by
/// output blocks.
fn split_k_gemm<T: GemmFloat + Send + Sync>(
    mem: &Memory,
    a: &[T],
    b: &[T],
    c: &mut [T],
    d: Dims,
    threads: usize,
) -> Result<(), BackendError> {
    crate::threads::note(threads);
    let part = d.k.div_ceil(threads);
    let partials: Vec<Vec<T>> = (0..threads)
        .into_par_iter()
        .filter_map(|t| {
            let (k0, k1) = (t * part, ((t + 1) * part).min(d.k));
            (k0 < k1).then(|| {
                let mut out = mem.zeroed(d.m * d.n)?;
                T::gemm_bt(&a[k0..], d.k, &b[k0..], d.k, &mut out, Dims { k: k1 - k0, ..d }, 1);
                Ok(out)
            })
        })
        .collect::<Result<_, BackendError>>()?;
    c.fill(T::ZERO);
    for p in &partials {
        for (ci, &pi) in c.iter_mut().zip(p) {
            *ci = T::add(*ci, pi);
        }
    }
    Ok(())
}

/// `dst` (`cols x rows`) = the transpose of `src` (`rows x cols`), in
/// cache-sized tiles.
fn transpose<T: Copy>(src: &[T], rows: usize, cols: usize, dst: &mut [T]) {
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for cc in c0..(c0 + TILE).min(cols) {
                    dst[cc * rows + r] = src[r * cols + cc];
                }
            }
        }
    }
}

/// Sizes and attributes of one convolution, for packing patches.
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

/// Where the taps of one offset land along one spatial dim: positions
/// `lo..hi` read input `start + (i - lo) * stride`; the others fall into
/// the padding.
#[derive(Clone, Copy)]
struct Span {
    lo: usize,
    hi: usize,
    start: usize,
}

/// The span of `len` positions `i` reading input `i * s + k * d - pad`
/// (an input dim of `input` elements).
fn span(len: usize, input: usize, s: usize, d: usize, pad: usize, k: usize) -> Span {
    let off = (k * d) as isize - pad as isize;
    // First position whose tap is >= 0, and first whose tap is >= input.
    let lo = if off >= 0 { 0 } else { ((-off) as usize).div_ceil(s) }.min(len);
    let hi = if off >= input as isize { 0 } else { ((input as isize - off) as usize).div_ceil(s) }.clamp(lo, len);
    let start = if lo < hi { (off + (lo * s) as isize) as usize } else { 0 };
    Span { lo, hi, start }
}

/// `out[i] = src[i * step]` for every `i`, with a plain copy for unit steps.
#[inline]
fn strided_copy<T: Copy>(out: &mut [T], src: &[T], step: usize) {
    if step == 1 {
        out.copy_from_slice(&src[..out.len()]);
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            *o = src[i * step];
        }
    }
}

impl Geometry {
    /// Splits filling `col` (rows `(j, y, x)` of `k` patch columns) by
    /// output row `(j, y)` over the rayon pool when it is large.
    fn fill_rows<T: Send>(&self, col: &mut [T], fill: impl Fn(usize, usize, &mut [T]) + Sync + Send) {
        let k = self.cg * self.kh * self.kw;
        let block = self.ow * k;
        let each = |(r, out): (usize, &mut [T])| fill(r / self.oh, r % self.oh, out);
        if col.len() >= PAR_PACK && crate::threads::available() > 1 {
            crate::threads::note(crate::threads::available());
            col.par_chunks_mut(block).enumerate().for_each(each);
        } else {
            col.chunks_mut(block).enumerate().for_each(each);
        }
    }

    /// Fills `col` (`[nc * oh * ow, cg * kh * kw]`, `nc` from its length)
    /// with the patches of images `n0..`, group `g`: row `(j, y, x)`,
    /// column `(c, ki, kj)`, copying runs along `kj` (for kernels at least
    /// as wide as the output).
    fn pack_kernel_runs<T: Num + Send + Sync>(&self, x: &[T], n0: usize, g: usize, col: &mut [T]) {
        let c = &self.c;
        let k = self.cg * self.kh * self.kw;
        self.fill_rows(col, |j, y, out| {
            let img = &x[(n0 + j) * self.ci * self.ih * self.iw..];
            let sy = span(self.kh, self.ih, c.dilations[0], c.strides[0], c.pads[0], y);
            for (xo, row) in out.chunks_exact_mut(k).enumerate() {
                let sx = span(self.kw, self.iw, c.dilations[1], c.strides[1], c.pads[1], xo);
                for cc in 0..self.cg {
                    let plane = &img[(g * self.cg + cc) * self.ih * self.iw..][..self.ih * self.iw];
                    let taps = &mut row[cc * self.kh * self.kw..][..self.kh * self.kw];
                    taps[..sy.lo * self.kw].fill(T::ZERO);
                    taps[sy.hi * self.kw..].fill(T::ZERO);
                    for ki in sy.lo..sy.hi {
                        let iy = sy.start + (ki - sy.lo) * c.dilations[0];
                        let trow = &mut taps[ki * self.kw..(ki + 1) * self.kw];
                        trow[..sx.lo].fill(T::ZERO);
                        trow[sx.hi..].fill(T::ZERO);
                        strided_copy(&mut trow[sx.lo..sx.hi], &plane[iy * self.iw + sx.start..], c.dilations[1]);
                    }
                }
            }
        });
    }

    /// Fills `col` (`[nc * oh * ow, kh * kw * cg]`) from the channels-last
    /// images `hwc` (`[nc, ih, iw, cg]`, one group's channels): row
    /// `(j, y, x)`, column `(ki, kj, c)`; every tap copies `cg` contiguous
    /// channels.
    fn pack_channels_last<T: Num + Send + Sync>(&self, hwc: &[T], col: &mut [T]) {
        let c = &self.c;
        let (cg, k) = (self.cg, self.cg * self.kh * self.kw);
        self.fill_rows(col, |j, y, out| {
            let img = &hwc[j * self.ih * self.iw * cg..][..self.ih * self.iw * cg];
            let sy = span(self.kh, self.ih, c.dilations[0], c.strides[0], c.pads[0], y);
            for (xo, row) in out.chunks_exact_mut(k).enumerate() {
                let sx = span(self.kw, self.iw, c.dilations[1], c.strides[1], c.pads[1], xo);
                row[..sy.lo * self.kw * cg].fill(T::ZERO);
                row[sy.hi * self.kw * cg..].fill(T::ZERO);
                for ki in sy.lo..sy.hi {
                    let iy = sy.start + (ki - sy.lo) * c.dilations[0];
                    let trow = &mut row[ki * self.kw * cg..(ki + 1) * self.kw * cg];
                    trow[..sx.lo * cg].fill(T::ZERO);
                    trow[sx.hi * cg..].fill(T::ZERO);
                    let src = &img[iy * self.iw * cg..(iy + 1) * self.iw * cg];
                    if c.dilations[1] == 1 {
                        // Neighbouring taps are neighbouring pixels: one run.
                        let n = (sx.hi - sx.lo) * cg;
                        trow[sx.lo * cg..sx.lo * cg + n].copy_from_slice(&src[sx.start * cg..sx.start * cg + n]);
                    } else {
                        for kj in sx.lo..sx.hi {
                            let ix = sx.start + (kj - sx.lo) * c.dilations[1];
                            trow[kj * cg..(kj + 1) * cg].copy_from_slice(&src[ix * cg..(ix + 1) * cg]);
                        }
                    }
                }
            }
        });
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
        PoolKind::Max if xd.len() == 4 && xd[2] * xd[3] > 0 => same_num!(x, v => max_pool_2d(mem, v, xd, out, &win)?),
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

/// The input gradient of pooling `x` (`[N, C, spatial...]`) given the
/// output gradient `g` (of shape `gd`): each window's share goes to its
/// valid taps (avg: `g / divisor` to each; max: all of it to the first
/// maximum in scan order, the first NaN when there is one), accumulated in
/// f64 in window order and rounded once.
pub(crate) fn pool_grad(
    mem: &Memory,
    x: &CpuData,
    xd: &[usize],
    g: &CpuData,
    gd: &[usize],
    p: &PoolAttrs,
) -> Result<CpuData, BackendError> {
    if x.is_empty() {
        return Ok(same_float!(x, v => v.clone()));
    }
    let win = windows(p, &xd[2..], &gd[2..]);
    fn typed<T: Float>(
        mem: &Memory,
        x: &[T],
        g: &[T],
        xd: &[usize],
        gd: &[usize],
        win: &Windows,
        kind: PoolKind,
    ) -> Result<Vec<T>, BackendError> {
        let nsp = xd.len() - 2;
        let in_plane: usize = xd[2..].iter().product();
        let out_sp = &gd[2..];
        let out_plane: usize = out_sp.iter().product();
        let in_strides = crate::layout::strides(&xd[2..]);
        let mut acc: Vec<f64> = mem.zeroed(x.len())?;
        // Planes are independent: each writes its own part of `acc`.
        let plane_grad = |pi: usize, out: &mut [f64]| {
            let plane = &x[pi * in_plane..(pi + 1) * in_plane];
            if nsp == 2 && kind == PoolKind::Max {
                // The loop below for two spatial dims, without its index
                // arithmetic: the same windows in the same scan order.
                let (iw, ow) = (xd[3], gd[3]);
                for (oy, ys) in win.valid[0].iter().enumerate() {
                    for (ox, xs) in win.valid[1].iter().enumerate() {
                        let taps = ys.iter().flat_map(|&y| xs.iter().map(move |&xi| y * iw + xi));
                        if let Some(off) = first_max(plane, taps) {
                            out[off] += Float::to_f64(g[pi * out_plane + oy * ow + ox]);
                        }
                    }
                }
                return;
            }
            let mut opos = vec![0usize; nsp];
            let mut lists: Vec<&[usize]> = Vec::with_capacity(nsp);
            for flat in 0..out_plane {
                let mut rest = flat;
                for d in (0..nsp).rev() {
                    opos[d] = rest % out_sp[d];
                    rest /= out_sp[d];
                }
                lists.clear();
                lists.extend((0..nsp).map(|d| win.valid[d][opos[d]].as_slice()));
                let total: usize = lists.iter().map(|l| l.len()).product();
                // The input offset of valid tap `t` of the window, in scan order.
                let tap = |t: usize| {
                    let mut rest = t;
                    let mut off = 0;
                    for d in (0..nsp).rev() {
                        let l = lists[d];
                        off += l[rest % l.len()] * in_strides[d];
                        rest /= l.len();
                    }
                    off
                };
                let share = Float::to_f64(g[pi * out_plane + flat]);
                match kind {
                    PoolKind::Max => {
                        if let Some(off) = first_max(plane, (0..total).map(&tap)) {
                            out[off] += share;
                        }
                    }
                    PoolKind::Avg { count_include_pad } => {
                        let div = if count_include_pad {
                            (0..nsp).map(|d| win.padded[d][opos[d]]).product::<usize>()
                        } else {
                            total
                        };
                        for t in 0..total {
                            out[tap(t)] += share / div as f64;
                        }
                    }
                }
            }
        };
        if x.len() >= PAR_PACK && crate::threads::available() > 1 {
            crate::threads::note(crate::threads::available());
            acc.par_chunks_mut(in_plane).enumerate().for_each(|(pi, out)| plane_grad(pi, out));
        } else {
            acc.chunks_mut(in_plane).enumerate().for_each(|(pi, out)| plane_grad(pi, out));
        }
        mem.collect(acc.len(), |i| T::from_f64(acc[i]))
    }
    Ok(match (x, g) {
        (CpuData::F16(a), CpuData::F16(b)) => CpuData::F16(typed(mem, a, b, xd, gd, &win, p.kind)?),
        (CpuData::BF16(a), CpuData::BF16(b)) => CpuData::BF16(typed(mem, a, b, xd, gd, &win, p.kind)?),
        (CpuData::F32(a), CpuData::F32(b)) => CpuData::F32(typed(mem, a, b, xd, gd, &win, p.kind)?),
        (CpuData::F64(a), CpuData::F64(b)) => CpuData::F64(typed(mem, a, b, xd, gd, &win, p.kind)?),
        _ => unreachable!("pool_grad operands are one float dtype in a verified graph"),
    })
}

/// The offset among `taps` (in scan order) of the first maximum of
/// `plane`, the first NaN where there is one; `None` for no taps.
fn first_max<T: Float>(plane: &[T], taps: impl Iterator<Item = usize>) -> Option<usize> {
    let mut best: Option<(usize, T)> = None;
    for off in taps {
        let v = plane[off];
        let better = match best {
            None => true,
            Some((_, b)) => !b.is_nan() && (v.is_nan() || v > b),
        };
        if better {
            best = Some((off, v));
        }
    }
    best.map(|(off, _)| off)
}

/// Max pooling over two spatial dims: [`pool_typed`]'s fold for
/// `PoolKind::Max` without its per-element index arithmetic (the same
/// windows in the same scan order, so the same result).
fn max_pool_2d<T: Num>(
    mem: &Memory,
    x: &[T],
    xd: &[usize],
    out: &[usize],
    win: &Windows,
) -> Result<Vec<T>, BackendError> {
    let (in_plane, iw) = (xd[2] * xd[3], xd[3]);
    let mut res = mem.vec(out[0] * out[1] * out[2] * out[3])?;
    for plane in x.chunks_exact(in_plane).take(out[0] * out[1]) {
        for ys in &win.valid[0] {
            for xs in &win.valid[1] {
                let mut m = T::LOWEST;
                for &y in ys {
                    let row = &plane[y * iw..(y + 1) * iw];
                    for &xi in xs {
                        m = Num::maximum(m, row[xi]);
                    }
                }
                res.push(m);
            }
        }
    }
    Ok(res)
}

/// Runs `f(window elements, padded tap count)` for every output element.
fn pool_typed<T: Copy + 'static>(
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

    #[test]
    fn split_k_matches_one_gemm() {
        let (m, k, n) = (5, 1003, 3);
        let a: Vec<f64> = (0..m * k).map(|i| ((i * 37) % 19) as f64 / 7.0 - 1.0).collect();
        let b: Vec<f64> = (0..n * k).map(|i| ((i * 53) % 23) as f64 / 9.0 - 1.2).collect();
        let d = Dims { m, k, n };
        let mut want = vec![0.0; m * n];
        f64::gemm_bt(&a, k, &b, k, &mut want, d, 1);
        for threads in [2, 3, 7] {
            let mut got = vec![f64::NAN; m * n];
            split_k_gemm(&Memory::default(), &a, &b, &mut got, d, threads).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{threads} threads: {g} vs {w}");
            }
        }
    }

    /// Every packing path (one image per chunk, several, a partial last
    /// chunk; unit and larger strides and dilations; taps outside the input
    /// on both sides; runs along the output row and, for kernels at least
    /// as wide as the output, along the kernel row) agrees with the direct
    /// loop.
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
            (
                ConvAttrs { strides: [2, 1], pads: [1, 0, 0, 1], dilations: [1, 1], groups: 2 },
                [3, 4, 5, 5],
                [4, 2, 4, 4],
            ),
            (ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [2, 2], groups: 1 }, [2, 2, 6, 6], [3, 2, 3, 3]),
            (
                ConvAttrs { strides: [1, 2], pads: [2, 1, 2, 1], dilations: [1, 3], groups: 1 },
                [3, 2, 4, 5],
                [2, 2, 5, 3],
            ),
            // Depthwise (one input and one output channel a group, the
            // direct form): 3x3 same-padded, strided, dilated with taps
            // wholly in the padding, and a kernel wider than the image;
            // then one input channel a group with a channel multiplier
            // (im2col).
            (ConvAttrs { strides: [1, 1], pads: [1; 4], dilations: [1, 1], groups: 3 }, [2, 3, 7, 5], [3, 1, 3, 3]),
            (
                ConvAttrs { strides: [2, 3], pads: [1, 0, 2, 1], dilations: [1, 1], groups: 2 },
                [3, 2, 9, 8],
                [2, 1, 3, 2],
            ),
            (
                ConvAttrs { strides: [2, 3], pads: [1, 0, 2, 1], dilations: [1, 1], groups: 2 },
                [3, 2, 9, 8],
                [4, 1, 3, 2],
            ),
            (
                ConvAttrs { strides: [1, 1], pads: [4, 4, 4, 4], dilations: [3, 2], groups: 4 },
                [1, 4, 3, 4],
                [4, 1, 3, 3],
            ),
            (ConvAttrs::default(), [5, 1, 6, 6], [3, 1, 2, 3]),
            (
                ConvAttrs { strides: [1, 1], pads: [0, 2, 0, 2], dilations: [1, 1], groups: 2 },
                [2, 2, 4, 3],
                [2, 1, 1, 7],
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
            let (want, naive_dims) = crate::tests::naive_conv(&x, xd, &w, wd, &c);
            assert_eq!(naive_dims, od, "output dims of {c:?}");
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
