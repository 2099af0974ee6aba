//! Sorting along an axis with PyTorch's names and stable order: `sort`,
//! `argsort` and `topk`. No IR op of its own: each is a composition of
//! public ops, so every backend runs it natively (f32 on wgpu never falls
//! back) and autograd differentiates the values through a gather.
//!
//! The order is computed by counting (rank-by-counting): element `i` of a
//! row of `n` goes to position `rank(i) = #{j : x[j] before x[i]} + #{j <
//! i : x[j] ties x[i]}`, one comparison reduction over an `[n, n]`
//! broadcast that fuses into one kernel per chunk; the position-to-index
//! inverse is a second reduction, `index[r] = sum_i i * (rank(i) == r)`,
//! over `[k, n]` (only the first `k` positions for `topk`). Ranks are a
//! permutation, so both are exact integer sums. That is O(n^2) work per
//! row (O(n k) for the inverse), cheap and fully parallel for the rows a
//! model sorts (a few thousand), and it gives PyTorch's *stable* order:
//! ties keep their input order, ascending and descending, and NaN sorts as
//! the largest value (last ascending, first descending), as in PyTorch.
//!
//! Limits, by design: a row may hold at most [`SORT_MAX_ROW`] elements
//! (a longer one is an error naming the op and shape, never a slow or
//! wrong answer), except for `topk` with `k` up to [`TOPK_SELECT_MAX_K`]
//! (sampling from a vocabulary's logits): there it selects, `k` rounds of
//! "the first remaining element that is the extreme one" (a max or min
//! reduction, an equality test and an argmax of the hits, NaN handled as a
//! class of its own), O(k n) per row and the same stable order. The
//! broadcast comparisons are recorded in chunks of at most 2^24 elements
//! (rows grouped, long rows split), so no backend holds more than one
//! chunk's intermediate at a time; on wgpu a chunk's comparisons are the
//! prologue of its reduction and never reach memory. Rejected
//! alternative: a new IR op with a bitonic sort in workgroup memory, which
//! would be O(n log^2 n) but needs a kernel family, a CPU kernel and
//! coverage in every layer; the counting form reuses the fused reduction
//! kernels and is exact by construction.

use crate::{ExecError, Result, Tensor};
use lazuli_ir::{DType, IrError, ScalarValue};
use std::panic::Location;

/// The longest row [`Tensor::sort`] and [`Tensor::argsort`] accept (and
/// [`Tensor::topk`] with `k` over [`TOPK_SELECT_MAX_K`]): their
/// rank-by-counting form does O(n^2) comparisons per row.
pub const SORT_MAX_ROW: usize = 16384;

/// The largest `k` [`Tensor::topk`] takes for rows longer than
/// [`SORT_MAX_ROW`], which it answers by `k` rounds of selection (O(k n)).
pub const TOPK_SELECT_MAX_K: usize = 128;

/// Elements of one recorded broadcast comparison.
const CHUNK: usize = 1 << 24;

impl Tensor {
    /// The elements along `axis` in ascending (or, with `descending`,
    /// descending) order and the indices (i32, as [`Tensor::argmax`]) they
    /// came from (PyTorch's `sort` with `stable=True`): equal elements keep
    /// their order, NaN is the largest value. Works for float and integer
    /// dtypes (bool sorts as 0 and 1). Rows longer than [`SORT_MAX_ROW`]
    /// are an error. The values are differentiable (the gradient is
    /// scattered back through the indices).
    #[track_caller]
    pub fn sort(&self, axis: isize, descending: bool) -> Result<(Tensor, Tensor)> {
        let at = Location::caller();
        let ax = self.axis("sort", axis)?;
        let idx = self.order("sort", ax, self.dims()[ax], descending, at)?;
        Ok((self.gather_torch(ax as isize, &idx)?, idx))
    }

    /// The indices (i32) that sort `self` along `axis`: the second result of
    /// [`Tensor::sort`] (PyTorch's `argsort` with `stable=True`).
    #[track_caller]
    pub fn argsort(&self, axis: isize, descending: bool) -> Result<Tensor> {
        let at = Location::caller();
        let ax = self.axis("argsort", axis)?;
        self.order("argsort", ax, self.dims()[ax], descending, at)
    }

    /// The `k` largest (or, without `largest`, smallest) elements along
    /// `axis`, in order, and their indices (i32) (PyTorch's `topk` with
    /// `sorted=True`); ties keep their input order, NaN counts as the
    /// largest value. `k` may not exceed the axis' length; rows longer than
    /// [`SORT_MAX_ROW`] take `k` up to [`TOPK_SELECT_MAX_K`] (selected in
    /// `k` rounds). The values are differentiable.
    #[track_caller]
    pub fn topk(&self, k: usize, axis: isize, largest: bool) -> Result<(Tensor, Tensor)> {
        let at = Location::caller();
        let ax = self.axis("topk", axis)?;
        let idx = self.order("topk", ax, k, largest, at)?;
        Ok((self.gather_torch(ax as isize, &idx)?, idx))
    }

    /// The indices of the first `k` positions of the stable order along
    /// `axis`, shaped as `self` with `k` along `axis`.
    fn order(
        &self,
        op: &str,
        axis: usize,
        k: usize,
        descending: bool,
        at: &'static Location<'static>,
    ) -> Result<Tensor> {
        let n = self.dims()[axis];
        if k > n {
            return Err(ExecError::ir(
                IrError::Shape {
                    op: op.into(),
                    detail: format!("k = {k} exceeds the {n} elements of axis {axis} of shape {}", self.shape()),
                },
                at,
            ));
        }
        let select = n > SORT_MAX_ROW;
        if select && (op != "topk" || k > TOPK_SELECT_MAX_K) {
            return Err(ExecError::Invalid {
                op: op.into(),
                detail: format!(
                    "axis {axis} of shape {} has {n} elements, more than the {SORT_MAX_ROW} a sorted row may hold \
                     (the rank-by-counting sort does n^2 comparisons per row); only topk with k <= \
                     {TOPK_SELECT_MAX_K} takes longer rows (k = {k}) (at {at})",
                    self.shape()
                ),
            });
        }
        let mut out_dims = self.dims().to_vec();
        out_dims[axis] = k;
        let dev = self.device();
        if out_dims.contains(&0) {
            return Tensor::zeros(out_dims, DType::I32, dev);
        }
        let x = self.detach();
        let x = if x.dtype() == DType::Bool { x.cast(DType::U8)? } else { x };
        let last = self.rank() - 1;
        let moved = if axis == last { x } else { x.transpose(axis as isize, last as isize)? };
        let mut lead = moved.dims()[..last].to_vec();
        let rows: usize = lead.iter().product();
        let flat = moved.reshape_to([rows, n])?;
        let float = flat.dtype().is_float();
        let idx = if select {
            select_first(&flat, k, descending)?
        } else {
            let ranks = chunked(&flat, n, |part, i0, len| rank_chunk(part, i0, len, descending, float))?;
            chunked(&ranks, k, position_chunk)?
        };
        lead.push(k);
        let idx = idx.reshape_to(lead)?;
        if axis == last {
            Ok(idx)
        } else {
            idx.transpose(axis as isize, last as isize)
        }
    }
}

/// `f(rows, start, len)` over `[rows, n]` for every chunk of `width`
/// columns, rows grouped and columns split so that each chunk's `[rows,
/// len, n]` broadcast holds at most [`CHUNK`] elements; the `[rows, len]`
/// results joined into `[rows, width]`.
fn chunked(flat: &Tensor, width: usize, f: impl Fn(&Tensor, usize, usize) -> Result<Tensor>) -> Result<Tensor> {
    let (rows, n) = (flat.dims()[0], flat.dims()[1]);
    let cols = (CHUNK / n).clamp(1, width);
    let group = (CHUNK / (n * cols)).clamp(1, rows);
    let mut groups = Vec::new();
    for r0 in (0..rows).step_by(group) {
        let g = group.min(rows - r0);
        let part = if g == rows { flat.clone() } else { flat.narrow(0, r0, g)? };
        let mut pieces = Vec::new();
        for c0 in (0..width).step_by(cols) {
            pieces.push(f(&part, c0, cols.min(width - c0))?);
        }
        groups.push(Tensor::concat(&pieces.iter().collect::<Vec<_>>(), 1)?);
    }
    Tensor::concat(&groups.iter().collect::<Vec<_>>(), 0)
}

/// The ranks (i32) of elements `i0..i0 + len` of each row of `part`
/// (`[g, n]`) in the stable order.
fn rank_chunk(part: &Tensor, i0: usize, len: usize, descending: bool, float: bool) -> Result<Tensor> {
    let n = part.dims()[1];
    let dev = part.device();
    let a = part.narrow(1, i0, len)?.unsqueeze(2)?; // [g, len, 1]: element i
    let b = part.unsqueeze(1)?; // [g, 1, n]: element j
    let mut before = if descending { b.gt(&a)? } else { b.lt(&a)? };
    let mut same = b.eq(&a)?;
    if float {
        // NaN is the largest value and ties with NaN. The comparisons are
        // only trusted between numbers: GPU drivers may compile them
        // assuming no NaN, while `isnan` is a bit test.
        let (na, nb) = (a.isnan()?, b.isnan()?);
        let numbers = na.logical_or(&nb)?.logical_not()?;
        let nan_before =
            if descending { nb.logical_and(&na.logical_not()?)? } else { na.logical_and(&nb.logical_not()?)? };
        before = before.logical_and(&numbers)?.logical_or(&nan_before)?;
        same = same.logical_and(&numbers)?.logical_or(&na.logical_and(&nb)?)?;
    }
    let j = Tensor::iota([len, n], 1, DType::I32, dev)?;
    let i = Tensor::iota([len, n], 0, DType::I32, dev)?.add_scalar(i0 as i64)?;
    let earlier = j.lt(&i)?;
    before.logical_or(&same.logical_and(&earlier)?)?.cast(DType::I32)?.sum(&[2], false)
}

/// The indices (i32) of positions `r0..r0 + len` of each row of `ranks`
/// (`[g, n]`, each row a permutation of `0..n`).
fn position_chunk(ranks: &Tensor, r0: usize, len: usize) -> Result<Tensor> {
    let n = ranks.dims()[1];
    let dev = ranks.device();
    let r = Tensor::iota([len, 1], 0, DType::I32, dev)?.add_scalar(r0 as i64)?;
    let hit = ranks.unsqueeze(1)?.eq(&r)?; // [g, len, n]
    let j = Tensor::iota([n], 0, DType::I32, dev)?;
    let zero = Tensor::scalar(0, DType::I32, dev);
    hit.where_(&j, &zero)?.sum(&[2], false)
}

/// The indices (i32, `[rows, k]`) of the first `k` elements of each row of
/// `flat` in the stable order, by `k` rounds of selection: the remaining
/// extreme value, then the first remaining element equal to it. NaN is a
/// class of its own, before the numbers when descending and after them
/// when ascending, so no fill value can tie with a real one.
fn select_first(flat: &Tensor, k: usize, descending: bool) -> Result<Tensor> {
    let (rows, n) = (flat.dims()[0], flat.dims()[1]);
    let (dev, dt) = (flat.device(), flat.dtype());
    let fill = Tensor::scalar(extreme(dt, !descending), dt, dev);
    let pos = Tensor::iota([n], 0, DType::I32, dev)?;
    let nan = if dt.is_float() { Some(flat.isnan()?) } else { None };
    let mut taken = Tensor::full([rows, n], false, DType::Bool, dev)?;
    let mut picks = Vec::with_capacity(k);
    let any = |t: &Tensor| -> Result<Tensor> { t.cast(DType::I32)?.max(&[1], true)?.gt_scalar(0) };
    for _ in 0..k {
        let free = taken.logical_not()?;
        let (num_left, nan_left) = match &nan {
            Some(m) => (free.logical_and(&m.logical_not()?)?, Some(free.logical_and(m)?)),
            None => (free, None),
        };
        let masked = num_left.where_(flat, &fill)?;
        let m = if descending { masked.max(&[1], true)? } else { masked.min(&[1], true)? };
        let mut hit = num_left.logical_and(&flat.eq(&m)?)?;
        if let Some(nl) = nan_left {
            hit = if descending { any(&nl)?.where_(&nl, &hit)? } else { any(&num_left)?.where_(&hit, &nl)? };
        }
        let idx = hit.cast(DType::I32)?.argmax(1, true)?;
        taken = taken.logical_or(&pos.eq(&idx)?)?;
        picks.push(idx);
    }
    Tensor::concat(&picks.iter().collect::<Vec<_>>(), 1)
}

/// The dtype's highest (`high`) or lowest value: infinities for floats.
fn extreme(dt: DType, high: bool) -> ScalarValue {
    if dt.is_float() {
        return ScalarValue::Float(if high { f64::INFINITY } else { f64::NEG_INFINITY });
    }
    let bits = 8 * dt.size_bytes() as u32;
    match (dt.is_signed_int(), high) {
        (true, true) => ScalarValue::Int(((1i128 << (bits - 1)) - 1) as i64),
        (true, false) => ScalarValue::Int((-(1i128 << (bits - 1))) as i64),
        (false, true) => ScalarValue::UInt(((1u128 << bits) - 1) as u64),
        (false, false) => ScalarValue::UInt(0),
    }
}
