//! Reductions: `Reduce` (sum, mean, max, min, prod over sorted axes),
//! `ArgReduce`, `CumSum` and `Softmax` / `LogSoftmax`.
//!
//! `Reduce` first moves the reduced axes innermost (a no-op when they
//! already are) and then folds contiguous rows. Float sums, products and
//! means accumulate in `f64`. Empty reductions give the identity: sum 0,
//! prod 1, mean NaN, max the dtype's lowest (-inf), min its highest (+inf);
//! for bool, max is "any" (false when empty) and min is "all" (true).
//!
//! ArgMax/ArgMin treat NaN as the extreme value in both directions, like
//! numpy: the first NaN wins (the last with `select_last`).
//!
//! f32 sums and means over trailing axes and f32 softmax over the last axis
//! have contiguous fast paths (lane-parallel `f64` sums, vectorized `exp`)
//! that split rows over the rayon pool when large.

use crate::elem::{Float, Num};
use crate::layout::{permute, split_axis};
use crate::memory::Memory;
use crate::storage::{each_all, same_float, same_num, CpuData};
use lazuli_executor::BackendError;
use lazuli_ir::{ArgReduceOp, ReduceOp};
use rayon::prelude::*;

/// Reduces `x` (shape `dims`) over sorted `axes`.
pub(crate) fn reduce(
    mem: &Memory,
    op: ReduceOp,
    x: &CpuData,
    dims: &[usize],
    axes: &[usize],
) -> Result<CpuData, BackendError> {
    let kept: Vec<usize> = (0..dims.len()).filter(|d| !axes.contains(d)).collect();
    let outer: usize = kept.iter().map(|&d| dims[d]).product();
    let row: usize = axes.iter().map(|&d| dims[d]).product();
    let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
    if let CpuData::Bool(v) = x {
        let v = permute(mem, v, dims, &perm)?;
        let out = mem.collect(outer, |o| {
            let r = &v[o * row..(o + 1) * row];
            match op {
                ReduceOp::Max => r.iter().any(|&b| b != 0) as u8,
                ReduceOp::Min => r.iter().all(|&b| b != 0) as u8,
                _ => unreachable!("only max and min reduce bool in a verified graph"),
            }
        })?;
        return Ok(CpuData::Bool(out));
    }
    if let (CpuData::F32(v), ReduceOp::Sum | ReduceOp::Mean) = (x, op) {
        let mean = op == ReduceOp::Mean;
        if perm.iter().enumerate().all(|(i, &p)| i == p) && row > 0 {
            return Ok(CpuData::F32(par_rows(mem, v, outer, row, |r| {
                let s = sum_f64(r);
                (if mean { s / r.len() as f64 } else { s }) as f32
            })?));
        }
        // Reduced axes that form one block before kept ones (a bias
        // gradient's sum over the batch): column sums in place, no
        // transposed copy.
        if let (Some(&lo), Some(&last)) = (axes.first(), axes.last()) {
            let hi = last + 1;
            let after: usize = dims[hi.min(dims.len())..].iter().product();
            if row > 0 && after > 0 && hi - lo == axes.len() && hi < dims.len() {
                let before: usize = dims[..lo].iter().product();
                return Ok(CpuData::F32(column_sums(mem, v, [before, row, after], mean)?));
            }
        }
    }
    Ok(match op {
        ReduceOp::Mean => same_float!(x, v => {
            let v = permute(mem, v, dims, &perm)?;
            rows(mem, &v, outer, row, |r| {
                Float::from_f64(r.iter().fold(0.0, |a, &e| a + Float::to_f64(e)) / r.len() as f64)
            })?
        }),
        _ => same_num!(x, v => {
            let v = permute(mem, v, dims, &perm)?;
            rows(mem, &v, outer, row, row_fn(op))?
        }),
    })
}

fn row_fn<T: Num>(op: ReduceOp) -> fn(&[T]) -> T {
    match op {
        ReduceOp::Sum => |r| T::from_acc(r.iter().fold(T::acc_zero(), |a, &e| T::acc_add(a, e))),
        ReduceOp::Prod => |r| T::from_acc(r.iter().fold(T::acc_one(), |a, &e| T::acc_mul(a, e))),
        ReduceOp::Max => |r| r.iter().fold(T::LOWEST, |a, &e| T::maximum(a, e)),
        ReduceOp::Min => |r| r.iter().fold(T::HIGHEST, |a, &e| T::minimum(a, e)),
        ReduceOp::Mean => unreachable!("mean is handled by reduce()"),
    }
}

/// Work (elements) below which row loops stay on one thread.
const PAR_ELEMS: usize = 1 << 15;

/// `f` of every contiguous row of `v`, rows split over the pool when large.
fn par_rows<U: Send + bytemuck::Zeroable + 'static>(
    mem: &Memory,
    v: &[f32],
    outer: usize,
    row: usize,
    f: impl Fn(&[f32]) -> U + Sync,
) -> Result<Vec<U>, BackendError> {
    let mut out = mem.zeroed(outer)?;
    if v.len() < PAR_ELEMS || crate::threads::available() < 2 {
        for (o, r) in out.iter_mut().zip(v.chunks_exact(row)) {
            *o = f(r);
        }
    } else {
        crate::threads::note(crate::threads::available());
        let per = (PAR_ELEMS / row).max(1);
        out.par_chunks_mut(per).zip(v.par_chunks(per * row)).for_each(|(o, x)| {
            for (o, r) in o.iter_mut().zip(x.chunks_exact(row)) {
                *o = f(r);
            }
        });
    }
    Ok(out)
}

/// Sums of `v` (`[a, r, b]`, row-major) over its middle axis: `[a, b]`,
/// each accumulated in `f64` in order of `r` (divided by `r` for a mean);
/// the inner loop runs along `b`, contiguous, and vectorizes.
fn column_sums(mem: &Memory, v: &[f32], [a, r, b]: [usize; 3], mean: bool) -> Result<Vec<f32>, BackendError> {
    let mut out = mem.zeroed::<f32>(a * b)?;
    // f64 accumulators for a strip of columns at a time (stays in L1).
    const STRIP: usize = 512;
    let mut acc = [0f64; STRIP];
    for (i, o) in out.chunks_exact_mut(b).enumerate() {
        let block = &v[i * r * b..(i + 1) * r * b];
        for j0 in (0..b).step_by(STRIP) {
            let w = STRIP.min(b - j0);
            let acc = &mut acc[..w];
            acc.fill(0.0);
            for row in block.chunks_exact(b) {
                for (s, &e) in acc.iter_mut().zip(&row[j0..j0 + w]) {
                    *s += e as f64;
                }
            }
            for (o, &s) in o[j0..j0 + w].iter_mut().zip(acc.iter()) {
                *o = (if mean { s / r as f64 } else { s }) as f32;
            }
        }
    }
    Ok(out)
}

/// The `f64` sum of f32 elements in eight interleaved lanes (vectorizes;
/// a reassociation of the sequential sum).
fn sum_f64(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v as f64;
        }
    }
    acc.iter().sum::<f64>() + rest
}

fn rows<T: Copy, U: 'static>(
    mem: &Memory,
    v: &[T],
    outer: usize,
    row: usize,
    f: impl Fn(&[T]) -> U,
) -> Result<Vec<U>, BackendError> {
    mem.collect(outer, |o| f(&v[o * row..(o + 1) * row]))
}

/// Index (i32) of the max or min of `x` along `axis`; the axis is not empty.
pub(crate) fn arg_reduce(
    mem: &Memory,
    op: ArgReduceOp,
    x: &CpuData,
    dims: &[usize],
    axis: usize,
    select_last: bool,
) -> Result<CpuData, BackendError> {
    let (outer, len, inner) = split_axis(dims, axis);
    let max = op == ArgReduceOp::ArgMax;
    Ok(CpuData::I32(each_all!(x, v => arg_typed(mem, v, outer, len, inner, max, select_last)?)))
}

fn arg_typed<T: Copy + PartialOrd>(
    mem: &Memory,
    v: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    max: bool,
    last: bool,
) -> Result<Vec<i32>, BackendError> {
    #[allow(clippy::eq_op)] // `x != x` is the NaN test for any PartialOrd element.
    let nan = |x: T| x != x;
    let mut out = mem.vec(outer * inner)?;
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| v[(o * len + j) * inner + i];
            let mut best = 0usize;
            let mut bv = at(0);
            for j in 1..len {
                let c = at(j);
                let better = if nan(bv) {
                    last && nan(c)
                } else if nan(c) {
                    true
                } else if max {
                    c > bv || (last && c == bv)
                } else {
                    c < bv || (last && c == bv)
                };
                if better {
                    best = j;
                    bv = c;
                }
            }
            out.push(best as i32);
        }
    }
    Ok(out)
}

/// Prefix sums of `x` along `axis`.
pub(crate) fn cumsum(
    mem: &Memory,
    x: &CpuData,
    dims: &[usize],
    axis: usize,
    exclusive: bool,
    reverse: bool,
) -> Result<CpuData, BackendError> {
    let (outer, len, inner) = split_axis(dims, axis);
    Ok(same_num!(x, v => cumsum_typed(mem, v, outer, len, inner, exclusive, reverse)?))
}

fn cumsum_typed<T: Num>(
    mem: &Memory,
    v: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    exclusive: bool,
    reverse: bool,
) -> Result<Vec<T>, BackendError> {
    let mut out = mem.zeroed::<T>(v.len())?;
    let mut acc = mem.collect(inner, |_| T::acc_zero())?;
    for o in 0..outer {
        acc.fill(T::acc_zero());
        for step in 0..len {
            let j = if reverse { len - 1 - step } else { step };
            let base = (o * len + j) * inner;
            for (i, a) in acc.iter_mut().enumerate() {
                let e = v[base + i];
                if exclusive {
                    out[base + i] = T::from_acc(*a);
                    *a = T::acc_add(*a, e);
                } else {
                    *a = T::acc_add(*a, e);
                    out[base + i] = T::from_acc(*a);
                }
            }
        }
    }
    Ok(out)
}

/// Softmax (or log-softmax) of `x` along `axis`, max-subtracted, in `f64`.
pub(crate) fn softmax(
    mem: &Memory,
    x: &CpuData,
    dims: &[usize],
    axis: usize,
    log: bool,
) -> Result<CpuData, BackendError> {
    let (outer, len, inner) = split_axis(dims, axis);
    if let (CpuData::F32(v), 1) = (x, inner) {
        if len > 0 {
            // Every element is written: a pooled buffer will do.
            let CpuData::F32(out) = mem.take(lazuli_ir::DType::F32, v.len())? else {
                unreachable!("the pool returns the dtype asked for")
            };
            return Ok(CpuData::F32(softmax_rows_f32(mem, v, len, log, out)?));
        }
    }
    Ok(same_float!(x, v => softmax_typed(mem, v, outer, len, inner, log)?))
}

/// Softmax of contiguous f32 rows: max, `exp` in f32 (vectorized), sum in
/// `f64`, rows split over the pool when large.
fn softmax_rows_f32(
    mem: &Memory,
    v: &[f32],
    len: usize,
    log: bool,
    mut out: Vec<f32>,
) -> Result<Vec<f32>, BackendError> {
    let rows = |x: &[f32], o: &mut [f32]| -> Result<(), BackendError> {
        let mut diff = mem.zeroed::<f32>(len)?;
        for (x, o) in x.chunks_exact(len).zip(o.chunks_exact_mut(len)) {
            // NaN anywhere makes the whole row NaN, as in the reference.
            let nan = x.iter().fold(false, |a, v| a | v.is_nan());
            let m = if nan { f32::NAN } else { x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) };
            for (d, &v) in diff.iter_mut().zip(x) {
                *d = v - m;
            }
            crate::fastmath::exp(&diff, o);
            let sum = sum_f64(o);
            if log {
                let lse = sum.ln() as f32;
                for (o, &d) in o.iter_mut().zip(&diff) {
                    *o = d - lse;
                }
            } else {
                let inv = (1.0 / sum) as f32;
                for o in o.iter_mut() {
                    *o *= inv;
                }
            }
        }
        Ok(())
    };
    if v.len() < PAR_ELEMS || crate::threads::available() < 2 {
        rows(v, &mut out)?;
    } else {
        crate::threads::note(crate::threads::available());
        let per = (PAR_ELEMS / len).max(1) * len;
        out.par_chunks_mut(per).zip(v.par_chunks(per)).try_for_each(|(o, x)| rows(x, o))?;
    }
    Ok(out)
}

fn softmax_typed<T: Float>(
    mem: &Memory,
    v: &[T],
    outer: usize,
    len: usize,
    inner: usize,
    log: bool,
) -> Result<Vec<T>, BackendError> {
    let mut out = mem.zeroed::<T>(v.len())?;
    let mut row = mem.zeroed::<f64>(len)?;
    for o in 0..outer {
        for i in 0..inner {
            let idx = |j: usize| (o * len + j) * inner + i;
            let mut m = f64::NEG_INFINITY;
            for (j, r) in row.iter_mut().enumerate() {
                *r = v[idx(j)].to_f64();
                m = if r.is_nan() || m.is_nan() { f64::NAN } else { m.max(*r) };
            }
            let sum: f64 = row.iter().map(|&r| (r - m).exp()).sum();
            for (j, &r) in row.iter().enumerate() {
                let y = if log { r - m - sum.ln() } else { (r - m).exp() / sum };
                out[idx(j)] = T::from_f64(y);
            }
        }
    }
    Ok(out)
}
