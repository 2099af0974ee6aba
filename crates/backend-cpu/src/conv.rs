//! Windowed kernels: 2-d convolution (groups, strides, dilation, padding)
//! and N-d max / average pooling.
//!
//! Convolution accumulates in `f64` per output plane, looping over input
//! channel and kernel tap outside the spatial loops so the bounds checks
//! are hoisted. Pooling precomputes, per spatial dim and output position,
//! the valid input positions of the window; padding never wins a max
//! window. A window with no valid element gives the dtype's lowest value
//! (max) or NaN (average without `count_include_pad`, 0 / 0).

use crate::elem::{Float, Num};
use crate::memory::Memory;
use crate::storage::{same_float, same_num, CpuData};
use lazuli_executor::BackendError;
use lazuli_ir::{ConvAttrs, PoolAttrs, PoolKind};

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
    Ok(match (x, w) {
        (CpuData::F16(a), CpuData::F16(b)) => CpuData::F16(conv_typed(mem, a, xd, b, wd, out, c)?),
        (CpuData::F32(a), CpuData::F32(b)) => CpuData::F32(conv_typed(mem, a, xd, b, wd, out, c)?),
        (CpuData::F64(a), CpuData::F64(b)) => CpuData::F64(conv_typed(mem, a, xd, b, wd, out, c)?),
        _ => unreachable!("conv2d takes two operands of one float dtype in a verified graph"),
    })
}

fn conv_typed<T: Float>(
    mem: &Memory,
    x: &[T],
    xd: &[usize],
    w: &[T],
    wd: &[usize],
    out: &[usize],
    c: &ConvAttrs,
) -> Result<Vec<T>, BackendError> {
    let (nb, ci, ih, iw) = (xd[0], xd[1], xd[2], xd[3]);
    let (co, cg, kh, kw) = (wd[0], wd[1], wd[2], wd[3]);
    let (oh, ow) = (out[2], out[3]);
    let opg = co / c.groups;
    let mut res = mem.vec(nb * co * oh * ow)?;
    let mut acc = mem.zeroed::<f64>(oh * ow)?;
    for n in 0..nb {
        for o in 0..co {
            acc.fill(0.0);
            let g = o / opg;
            for cc in 0..cg {
                let ch = g * cg + cc;
                let plane = &x[(n * ci + ch) * ih * iw..(n * ci + ch + 1) * ih * iw];
                for ki in 0..kh {
                    for kj in 0..kw {
                        let wv = w[((o * cg + cc) * kh + ki) * kw + kj].to_f64();
                        for y in 0..oh {
                            let iy = (y * c.strides[0] + ki * c.dilations[0]) as isize - c.pads[0] as isize;
                            if iy < 0 || iy >= ih as isize {
                                continue;
                            }
                            let row = &plane[iy as usize * iw..(iy as usize + 1) * iw];
                            let arow = &mut acc[y * ow..(y + 1) * ow];
                            for (xo, a) in arow.iter_mut().enumerate() {
                                let ix = (xo * c.strides[1] + kj * c.dilations[1]) as isize - c.pads[1] as isize;
                                if ix >= 0 && ix < iw as isize {
                                    *a += wv * row[ix as usize].to_f64();
                                }
                            }
                        }
                    }
                }
            }
            res.extend(acc.iter().map(|&a| T::from_f64(a)));
        }
    }
    Ok(res)
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
