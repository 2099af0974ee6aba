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

use crate::elem::{Float, Num};
use crate::layout::{permute, split_axis};
use crate::storage::{each_all, same_float, same_num, CpuData};
use lazuli_ir::{ArgReduceOp, ReduceOp};

/// Reduces `x` (shape `dims`) over sorted `axes`.
pub(crate) fn reduce(op: ReduceOp, x: &CpuData, dims: &[usize], axes: &[usize]) -> CpuData {
    let kept: Vec<usize> = (0..dims.len()).filter(|d| !axes.contains(d)).collect();
    let outer: usize = kept.iter().map(|&d| dims[d]).product();
    let row: usize = axes.iter().map(|&d| dims[d]).product();
    let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
    if let CpuData::Bool(v) = x {
        let v = permute(v, dims, &perm);
        let out = (0..outer).map(|o| {
            let r = &v[o * row..(o + 1) * row];
            match op {
                ReduceOp::Max => r.iter().any(|&b| b != 0) as u8,
                ReduceOp::Min => r.iter().all(|&b| b != 0) as u8,
                _ => unreachable!("only max and min reduce bool in a verified graph"),
            }
        });
        return CpuData::Bool(out.collect());
    }
    match op {
        ReduceOp::Mean => same_float!(x, v => {
            let v = permute(v, dims, &perm);
            rows(&v, outer, row, |r| {
                Float::from_f64(r.iter().fold(0.0, |a, &e| a + Float::to_f64(e)) / r.len() as f64)
            })
        }),
        _ => same_num!(x, v => {
            let v = permute(v, dims, &perm);
            rows(&v, outer, row, row_fn(op))
        }),
    }
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

fn rows<T: Copy, U>(v: &[T], outer: usize, row: usize, f: impl Fn(&[T]) -> U) -> Vec<U> {
    (0..outer).map(|o| f(&v[o * row..(o + 1) * row])).collect()
}

/// Index (i32) of the max or min of `x` along `axis`; the axis is not empty.
pub(crate) fn arg_reduce(op: ArgReduceOp, x: &CpuData, dims: &[usize], axis: usize, select_last: bool) -> CpuData {
    let (outer, len, inner) = split_axis(dims, axis);
    let max = op == ArgReduceOp::ArgMax;
    CpuData::I32(each_all!(x, v => arg_typed(v, outer, len, inner, max, select_last)))
}

fn arg_typed<T: Copy + PartialOrd>(v: &[T], outer: usize, len: usize, inner: usize, max: bool, last: bool) -> Vec<i32> {
    #[allow(clippy::eq_op)] // `x != x` is the NaN test for any PartialOrd element.
    let nan = |x: T| x != x;
    let mut out = Vec::with_capacity(outer * inner);
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
    out
}

/// Prefix sums of `x` along `axis`.
pub(crate) fn cumsum(x: &CpuData, dims: &[usize], axis: usize, exclusive: bool, reverse: bool) -> CpuData {
    let (outer, len, inner) = split_axis(dims, axis);
    same_num!(x, v => cumsum_typed(v, outer, len, inner, exclusive, reverse))
}

fn cumsum_typed<T: Num>(v: &[T], outer: usize, len: usize, inner: usize, exclusive: bool, reverse: bool) -> Vec<T> {
    let mut out = vec![T::ZERO; v.len()];
    let mut acc = vec![T::acc_zero(); inner];
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
    out
}

/// Softmax (or log-softmax) of `x` along `axis`, max-subtracted, in `f64`.
pub(crate) fn softmax(x: &CpuData, dims: &[usize], axis: usize, log: bool) -> CpuData {
    let (outer, len, inner) = split_axis(dims, axis);
    same_float!(x, v => softmax_typed(v, outer, len, inner, log))
}

fn softmax_typed<T: Float>(v: &[T], outer: usize, len: usize, inner: usize, log: bool) -> Vec<T> {
    let mut out = vec![T::ZERO; v.len()];
    let mut row = vec![0.0f64; len];
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
    out
}
