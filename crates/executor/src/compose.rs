//! Tensor ops with PyTorch's names and semantics that compose existing
//! public ops (no IR op of their own): `masked_fill`, `tril`/`triu`,
//! `var`/`std`, `logsumexp`, `repeat`, `linspace`, `gather_torch`,
//! `embedding`, `sum_all`/`mean_all`, `zeros_like`/`ones_like`/`full_like`
//! and `argmax_as`/`argmin_as` (an index dtype of the caller's choice). Each
//! checks its arguments when called and reports an error naming the op,
//! the shapes and the dtypes; autograd differentiates them through the ops
//! they record.

use crate::{BackendKind, Device, ExecError, Result, Tensor};
use lazuli_ir::{ArgReduceOp, DType, IrError, ScalarValue, Shape};
use std::collections::HashMap;
use std::panic::Location;
use std::sync::RwLock;

/// A source location as a key: file, line, column.
type Site = (&'static str, u32, u32);

/// What recorded an op at a source line, where a composition says so
/// (`embedding` does): an index error names it beside the line.
static RECORDED_BY: RwLock<Option<HashMap<Site, &'static str>>> = RwLock::new(None);

/// The composition that recorded ops at `location`, if one said so.
pub(crate) fn recorded_by(location: &'static Location<'static>) -> Option<&'static str> {
    let key: Site = (location.file(), location.line(), location.column());
    RECORDED_BY.read().unwrap_or_else(|e| e.into_inner()).as_ref()?.get(&key).copied()
}

/// Remembers that `what` records ops at `location` (bounded: a program has
/// few such call sites; past 4096 the oldest are forgotten at once).
fn note_recorded_by(location: &'static Location<'static>, what: &'static str) {
    let key = (location.file(), location.line(), location.column());
    if RECORDED_BY.read().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|m| m.get(&key) == Some(&what)) {
        return;
    }
    let mut map = RECORDED_BY.write().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if map.len() >= 4096 {
        map.clear();
    }
    map.insert(key, what);
}

#[track_caller]
fn shape_error(op: &str, detail: String) -> ExecError {
    ExecError::from(IrError::Shape { op: op.into(), detail })
}

#[track_caller]
fn dtype_error(op: &str, detail: &str, got: &[DType]) -> ExecError {
    let got = got.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
    ExecError::from(IrError::DType { op: op.into(), detail: detail.into(), got })
}

impl Tensor {
    /// `self` with `value` where `mask` is true (PyTorch's `masked_fill`).
    /// `mask` is bool and broadcasts to `self`'s shape without changing
    /// it; `value` must be representable in `self`'s dtype (a fractional
    /// value for an integer tensor is an error, never truncated).
    /// Differentiable in `self` (the filled positions get no gradient).
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor, value: impl Into<ScalarValue>) -> Result<Tensor> {
        let op = "masked_fill";
        if mask.dtype() != DType::Bool {
            return Err(dtype_error(op, "the mask must be bool", &[self.dtype(), mask.dtype()]));
        }
        let (x, m) = (self.dims(), mask.dims());
        let fits = m.len() <= x.len() && m.iter().rev().zip(x.iter().rev()).all(|(&a, &b)| a == b || a == 1);
        if !fits {
            return Err(shape_error(
                op,
                format!("mask shape {} does not broadcast to the input shape {}", mask.shape(), self.shape()),
            ));
        }
        let v = value.into();
        if !crate::ops::scalar_fits(v, self.dtype()) {
            return Err(dtype_error(
                op,
                &format!("value {v:?} is not representable in the input's dtype"),
                &[self.dtype()],
            ));
        }
        let fill = Tensor::scalar(v, self.dtype(), self.device());
        mask.where_(&fill, self)
    }

    /// The lower triangle of the last two dims (PyTorch's `tril`): element
    /// `[.., i, j]` is kept where `j - i <= diagonal` and zero elsewhere
    /// (`diagonal` 0 is the main diagonal, positive ones lie above it).
    /// Needs rank 2 or more. Differentiable.
    #[track_caller]
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle("tril", diagonal, false)
    }

    /// The upper triangle of the last two dims (PyTorch's `triu`): element
    /// `[.., i, j]` is kept where `j - i >= diagonal` and zero elsewhere.
    /// Needs rank 2 or more. Differentiable.
    #[track_caller]
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        self.triangle("triu", diagonal, true)
    }

    #[track_caller]
    fn triangle(&self, op: &str, diagonal: i64, upper: bool) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(shape_error(op, format!("needs rank 2 or more, got shape {}", self.shape())));
        }
        let (n, m) = (self.dims()[self.rank() - 2], self.dims()[self.rank() - 1]);
        // Any diagonal beyond the matrix keeps all or nothing, so clamping it
        // to the matrix's extent keeps it (and `j - i`) inside i32.
        let bound = (n + m).min(i32::MAX as usize / 2) as i64;
        let k = diagonal.clamp(-bound, bound);
        let dev = self.device();
        let rows = Tensor::iota([n, m], 0, DType::I32, dev)?;
        let cols = Tensor::iota([n, m], 1, DType::I32, dev)?;
        let diff = cols.sub(&rows)?;
        let keep = if upper { diff.ge_scalar(k)? } else { diff.le_scalar(k)? };
        let zero = Tensor::scalar(0, self.dtype(), dev);
        keep.where_(self, &zero)
    }

    /// Variance over `dims` (all dims if empty) with PyTorch's
    /// `correction` (Bessel's is 1, PyTorch's default; 0 is the population
    /// variance): `sum((x - mean)^2) / max(0, N - correction)`, where `N`
    /// is the number of elements reduced, so `N <= correction` gives NaN or
    /// infinity as in PyTorch. Float dtypes only. Differentiable.
    #[track_caller]
    pub fn var(&self, dims: &[isize], correction: f64, keepdim: bool) -> Result<Tensor> {
        self.variance("var", dims, correction, keepdim)
    }

    /// Standard deviation: the square root of [`Tensor::var`] with the same
    /// arguments (PyTorch's `std`). Differentiable where it is not zero.
    #[track_caller]
    pub fn std(&self, dims: &[isize], correction: f64, keepdim: bool) -> Result<Tensor> {
        self.variance("std", dims, correction, keepdim)?.sqrt()
    }

    #[track_caller]
    fn variance(&self, op: &str, dims: &[isize], correction: f64, keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(dtype_error(op, "needs a float input", &[self.dtype()]));
        }
        if !correction.is_finite() {
            return Err(ExecError::Invalid { op: op.into(), detail: format!("correction {correction} is not finite") });
        }
        let axes = self.axes(op, &self.all_if_empty(dims))?;
        let n: usize = axes.iter().map(|&a| self.dims()[a]).product();
        let axes: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
        let mean = self.mean(&axes, true)?;
        let centered = self.sub(&mean)?;
        let squares = centered.mul(&centered)?.sum(&axes, keepdim)?;
        squares.div_scalar((n as f64 - correction).max(0.0))
    }

    /// `log(sum(exp(x)))` over `dims` (all dims if empty), computed stably
    /// as PyTorch does: `m + log(sum(exp(x - m)))` with `m` the maximum,
    /// replaced by 0 where it is infinite, so a row of only `-inf` gives
    /// `-inf` and a row holding `+inf` gives `+inf`. Float dtypes only.
    /// Differentiable (the gradient is the softmax over `dims`).
    #[track_caller]
    pub fn logsumexp(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let op = "logsumexp";
        if !self.dtype().is_float() {
            return Err(dtype_error(op, "needs a float input", &[self.dtype()]));
        }
        let axes = self.axes(op, &self.all_if_empty(dims))?;
        let axes: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
        // The result does not depend on the shift, so it carries no gradient.
        let m = self.detach().max(&axes, true)?;
        let zero = Tensor::scalar(0, self.dtype(), self.device());
        let m = m.abs()?.eq_scalar(f64::INFINITY)?.where_(&zero, &m)?;
        let s = self.sub(&m)?.exp()?.sum(&axes, keepdim)?.log()?;
        let m = if keepdim { m } else { m.squeeze(&axes)? };
        s.add(&m)
    }

    /// `self` tiled `sizes[d]` times along each dim (PyTorch's `repeat`,
    /// numpy's `tile`): `sizes` has at least `self`'s rank, and extra
    /// leading sizes add leading dims. Recorded as a reshape, an expand and
    /// a reshape, so it copies at most once. Differentiable.
    #[track_caller]
    pub fn repeat(&self, sizes: &[usize]) -> Result<Tensor> {
        let op = "repeat";
        if sizes.len() < self.rank() {
            return Err(shape_error(
                op,
                format!("{} repeat sizes {sizes:?} are fewer than the dims of shape {}", sizes.len(), self.shape()),
            ));
        }
        let lead = sizes.len() - self.rank();
        let dims: Vec<usize> = std::iter::repeat_n(1, lead).chain(self.dims().iter().copied()).collect();
        let mut split = Vec::with_capacity(2 * dims.len());
        let mut tiled = Vec::with_capacity(2 * dims.len());
        let mut out = Vec::with_capacity(dims.len());
        for (&d, &r) in dims.iter().zip(sizes) {
            split.extend([1, d]);
            tiled.extend([r, d]);
            let total = d
                .checked_mul(r)
                .ok_or_else(|| shape_error(op, format!("repeating shape {} by {sizes:?} overflows", self.shape())))?;
            out.push(total);
        }
        self.reshape_to(Shape::from(split))?.expand(Shape::from(tiled))?.reshape_to(Shape::from(out))
    }

    /// `steps` values evenly spaced from `start` to `end`, both included
    /// (PyTorch's `linspace`): element `i` is `start + i * step` in the
    /// first half and `end - (steps - 1 - i) * step` in the second, with
    /// `step = (end - start) / (steps - 1)`, so both ends are exact. One
    /// step gives `[start]`, none an empty tensor. Float dtypes only.
    #[track_caller]
    pub fn linspace(start: f64, end: f64, steps: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let op = "linspace";
        if !dtype.is_float() {
            return Err(dtype_error(op, "needs a float dtype", &[dtype]));
        }
        if !start.is_finite() || !end.is_finite() {
            return Err(ExecError::Invalid {
                op: op.into(),
                detail: format!("bounds {start} and {end} must be finite"),
            });
        }
        if steps <= 1 {
            return Tensor::full([steps], start, dtype, device);
        }
        let step = (end - start) / (steps - 1) as f64;
        let i = Tensor::iota([steps], 0, dtype, device)?;
        let head = i.mul_scalar(step)?.add_scalar(start)?;
        let back = Tensor::scalar((steps - 1) as f64, dtype, device).sub(&i)?;
        let tail = Tensor::scalar(end, dtype, device).sub(&back.mul_scalar(step)?)?;
        let first = Tensor::iota([steps], 0, DType::I32, device)?.lt_scalar((steps / 2) as i64)?;
        first.where_(&head, &tail)
    }

    /// PyTorch's `gather` (numpy's `take_along_axis`): `index` (an integer
    /// tensor of `self`'s rank) has the output's shape, and
    /// `out[i][j][k] = self[index[i][j][k]][j][k]` for `dim` 0 (likewise for
    /// other dims); `index`'s other dims may not exceed `self`'s. This
    /// differs from [`Tensor::gather`], numpy's `take`, where the indices
    /// replace dim `axis` and every index selects a whole slice. Negative
    /// indices count from the end; one outside the dim is an error at the
    /// barrier that reads the result, as with [`Tensor::gather`]. Recorded
    /// as one bounds-checking gather of the indices, linear index
    /// arithmetic in i32 (so `self` has fewer than 2^31 elements) and a
    /// gather of the flattened input. Differentiable in `self`.
    #[track_caller]
    pub fn gather_torch(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let op = "gather_torch";
        let axis = self.axis(op, dim)?;
        if !index.dtype().is_int() {
            return Err(dtype_error(op, "the index must be an integer tensor", &[self.dtype(), index.dtype()]));
        }
        let fits = index.rank() == self.rank()
            && index.dims().iter().zip(self.dims()).enumerate().all(|(d, (&i, &s))| d == axis || i <= s);
        if !fits {
            return Err(shape_error(
                op,
                format!(
                    "index shape {} must have the input's rank and no dim but {axis} larger than the input shape {}",
                    index.shape(),
                    self.shape()
                ),
            ));
        }
        if self.numel() > i32::MAX as usize {
            return Err(shape_error(op, format!("input shape {} has 2^31 elements or more", self.shape())));
        }
        let dev = self.device();
        let size = self.dims()[axis];
        // Gathering from an iota of the dim checks each index against the
        // dim (at the barrier) and counts negative ones from the end.
        let positions = Tensor::iota([size], 0, DType::I32, dev)?;
        let flat = index.reshape_to([index.numel()])?;
        let checked = positions.gather(0, &flat)?.reshape_to(index.shape().clone())?;
        let mut stride = 1usize;
        let mut linear: Option<Tensor> = None;
        for d in (0..self.rank()).rev() {
            let coord =
                if d == axis { checked.clone() } else { Tensor::iota(index.shape().clone(), d, DType::I32, dev)? };
            let term = if stride == 1 { coord } else { coord.mul_scalar(stride as i64)? };
            linear = Some(match linear {
                Some(l) => l.add(&term)?,
                None => term,
            });
            stride *= self.dims()[d];
        }
        let linear = match linear {
            Some(l) => l,
            None => checked,
        };
        let data = self.reshape_to([self.numel()])?;
        data.gather(0, &linear.reshape_to([linear.numel()])?)?.reshape_to(index.shape().clone())
    }

    /// Rows of this table (`[num, dim]`) for integer `ids` of any shape,
    /// giving `[..ids, dim]` (PyTorch's `F.embedding`): a gather along
    /// dim 0, whose out-of-range id is an error at the barrier that names
    /// this call's line as an embedding lookup.
    #[track_caller]
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let op = "embedding";
        if self.rank() != 2 {
            return Err(shape_error(op, format!("the table must be [num, dim], got shape {}", self.shape())));
        }
        if !ids.dtype().is_int() {
            return Err(dtype_error(op, "ids must be integers", &[ids.dtype()]));
        }
        let location = crate::CallSite::current().unwrap_or(Location::caller());
        note_recorded_by(location, "an embedding lookup: ids must lie in 0..num_embeddings");
        self.gather(0, ids)
    }

    /// The sum of every element, rank 0 (PyTorch's `x.sum()`).
    #[track_caller]
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// The mean of every element, rank 0 (PyTorch's `x.mean()`).
    #[track_caller]
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    /// Zeros of this tensor's shape, dtype and device.
    #[track_caller]
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    /// Ones of this tensor's shape, dtype and device.
    #[track_caller]
    pub fn ones_like(&self) -> Result<Tensor> {
        Tensor::ones(self.shape().clone(), self.dtype(), self.device())
    }

    /// `value` in this tensor's shape, dtype and device.
    #[track_caller]
    pub fn full_like(&self, value: impl Into<ScalarValue>) -> Result<Tensor> {
        Tensor::full(self.shape().clone(), value, self.dtype(), self.device())
    }

    /// [`Tensor::argmax`] with indices of `dtype` (any integer dtype):
    /// `DType::I64` gives PyTorch's index type. [`Tensor::argmax`]'s i32 is
    /// what every backend computes natively; WGSL has no 64-bit integers,
    /// so on a wgpu device an i64 result is a cast on the CPU fallback (a
    /// host round trip at each sync), which this warns about once per
    /// call site rather than doing silently. Read an i32 result with
    /// `to_vec::<i32>()` to stay on the device.
    #[track_caller]
    pub fn argmax_as(&self, axis: isize, keepdim: bool, dtype: DType) -> Result<Tensor> {
        self.arg_reduce_as(ArgReduceOp::ArgMax, "argmax_as", axis, keepdim, dtype)
    }

    /// [`Tensor::argmin`] with indices of `dtype`, as [`Tensor::argmax_as`].
    #[track_caller]
    pub fn argmin_as(&self, axis: isize, keepdim: bool, dtype: DType) -> Result<Tensor> {
        self.arg_reduce_as(ArgReduceOp::ArgMin, "argmin_as", axis, keepdim, dtype)
    }

    #[track_caller]
    fn arg_reduce_as(&self, op: ArgReduceOp, name: &str, axis: isize, keepdim: bool, dtype: DType) -> Result<Tensor> {
        if !dtype.is_int() {
            return Err(dtype_error(name, "the index dtype must be an integer dtype", &[dtype]));
        }
        let idx = self.arg_reduce(op, axis, keepdim, false)?;
        if dtype == idx.dtype() {
            return Ok(idx);
        }
        if dtype.size_bytes() == 8 && self.device().kind() != BackendKind::Cpu {
            let at = Location::caller();
            crate::warn::once(
                &format!("{name} {dtype} {}:{}", at.file(), at.line()),
                &format!(
                    "{name}(.., DType::{dtype:?}) at {}:{} on {}: WGSL has no 64-bit integers, so the cast to \
                     {dtype} runs on the CPU fallback at every sync; argmax's i32 (to_vec::<i32>()) stays on \
                     the device",
                    at.file(),
                    at.line(),
                    self.device().name()
                ),
            );
        }
        idx.cast(dtype)
    }
}
