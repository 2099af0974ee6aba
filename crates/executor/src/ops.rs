//! Op methods on [`Tensor`]: each records one or a few IR nodes and returns
//! `Result<Tensor>`; shapes and dtypes are checked at the call. Axes may be
//! negative (counted from the end). Operator sugar (`&a + &b`, `&a * 1.5`)
//! returns `Result<Tensor>` too, so it never panics.
//!
//! Scalars follow type promotion (PyTorch's rule for Python scalars): a
//! float scalar with an integer or bool tensor converts the tensor to f32
//! first (`i32 + 1.5` is f32, never `i32 + 1`); an integer scalar must be
//! representable in an integer or bool tensor's dtype (`u8 + 300` is an
//! error, never a wrapped value); any scalar meets a float tensor in the
//! tensor's dtype. Positions ([`Tensor::slice`], [`Tensor::narrow`]) and
//! reshape sizes take any integer type ([`TensorIndex`], [`ReshapeDims`]).

use crate::{BackendKind, ExecError, Result, Tensor};
use lazuli_ir::{
    ArgReduceOp, AttentionAttrs, AttentionMask, AttentionPart, BinaryOp, ConvAttrs, DType, IrError, Op, PadMode,
    PoolAttrs, ReduceOp, ScalarValue, Shape, UnaryOp,
};

macro_rules! unary_methods {
    ($($(#[$m:meta])* $name:ident => $op:ident),* $(,)?) => {$(
        $(#[$m])*
        #[track_caller]
        pub fn $name(&self) -> Result<Tensor> {
            Tensor::record(Op::Unary(UnaryOp::$op), &[self])
        }
    )*};
}

macro_rules! binary_methods {
    ($($(#[$m:meta])* $name:ident, $scalar:ident => $op:ident),* $(,)?) => {$(
        $(#[$m])*
        #[track_caller]
        pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
            Tensor::record(Op::Binary(BinaryOp::$op), &[self, other])
        }
        /// The same op with a scalar right operand (promoted as the module
        /// documentation says: a float scalar makes an integer tensor f32).
        #[track_caller]
        pub fn $scalar(&self, value: impl Into<ScalarValue>) -> Result<Tensor> {
            let location = std::panic::Location::caller();
            let v = value.into();
            let promoted;
            let x = match self.promote_for_scalar(stringify!($name), v)? {
                Some(t) => {
                    promoted = t;
                    &promoted
                }
                None => self,
            };
            let s = Tensor::scalar_node(v, x.dtype(), location);
            Tensor::record_at(x.device(), Op::Binary(BinaryOp::$op), &[x], Some(s), location)
        }
    )*};
}

/// An integer position or length: `usize`, `isize`, `i32`, `i64`, `u32`
/// or `u64`, so [`Tensor::slice`] and [`Tensor::narrow`] take whatever
/// integer the caller holds.
pub trait TensorIndex: Copy {
    /// The value, exactly.
    fn to_i128(self) -> i128;
}

macro_rules! tensor_index {
    ($($t:ty),*) => {$(
        impl TensorIndex for $t {
            fn to_i128(self) -> i128 {
                self as i128
            }
        }
    )*};
}

tensor_index!(usize, isize, i32, i64, u32, u64);

/// The sizes given to [`Tensor::reshape`]: arrays, slices and vectors of
/// `usize`, `isize`, `i32` or `i64` (one size may be -1, inferred), or a
/// [`Shape`].
pub trait ReshapeDims {
    /// The sizes, exactly.
    fn reshape_dims(&self) -> Vec<i128>;
}

macro_rules! reshape_dims {
    ($($t:ty),*) => {$(
        impl<const N: usize> ReshapeDims for [$t; N] {
            fn reshape_dims(&self) -> Vec<i128> {
                self.iter().map(|&d| d as i128).collect()
            }
        }
        impl<const N: usize> ReshapeDims for &[$t; N] {
            fn reshape_dims(&self) -> Vec<i128> {
                self.iter().map(|&d| d as i128).collect()
            }
        }
        impl ReshapeDims for &[$t] {
            fn reshape_dims(&self) -> Vec<i128> {
                self.iter().map(|&d| d as i128).collect()
            }
        }
        impl ReshapeDims for Vec<$t> {
            fn reshape_dims(&self) -> Vec<i128> {
                self.iter().map(|&d| d as i128).collect()
            }
        }
        impl ReshapeDims for &Vec<$t> {
            fn reshape_dims(&self) -> Vec<i128> {
                self.iter().map(|&d| d as i128).collect()
            }
        }
    )*};
}

reshape_dims!(usize, isize, i32, i64);

impl ReshapeDims for Shape {
    fn reshape_dims(&self) -> Vec<i128> {
        self.dims().iter().map(|&d| d as i128).collect()
    }
}

impl ReshapeDims for &Shape {
    fn reshape_dims(&self) -> Vec<i128> {
        self.dims().iter().map(|&d| d as i128).collect()
    }
}

/// True when `v` is exactly representable in `dtype` (floats take any
/// value; integers and bool only their range).
pub(crate) fn scalar_fits(v: ScalarValue, dtype: DType) -> bool {
    let (lo, hi): (i128, i128) = match dtype {
        d if d.is_float() => return true,
        DType::Bool => (0, 1),
        d if d.is_signed_int() => {
            let b = 8 * d.size_bytes() as u32 - 1;
            (-(1i128 << b), (1i128 << b) - 1)
        }
        d => (0, (1i128 << (8 * d.size_bytes() as u32)) - 1),
    };
    let v = match v {
        ScalarValue::Int(i) => i as i128,
        ScalarValue::UInt(u) => u as i128,
        ScalarValue::Bool(b) => b as i128,
        ScalarValue::Float(_) => return false,
    };
    (lo..=hi).contains(&v)
}

impl Tensor {
    /// `Some(self as f32)` when a float scalar meets an integer or bool
    /// tensor, `None` when the scalar meets this tensor as it is, or the
    /// error when the scalar is not representable in the operand's dtype.
    #[track_caller]
    fn promote_for_scalar(&self, op: &str, v: ScalarValue) -> Result<Option<Tensor>> {
        let promoted = if matches!(v, ScalarValue::Float(_)) && !self.dtype().is_float() {
            Some(self.cast(DType::F32)?)
        } else {
            None
        };
        let x = promoted.as_ref().unwrap_or(self);
        if !scalar_fits(v, x.dtype()) {
            return Err(ExecError::Invalid {
                op: op.into(),
                detail: format!(
                    "scalar {v} is not representable in the tensor's dtype {} (shape {}); cast the tensor first",
                    x.dtype(),
                    x.shape()
                ),
            });
        }
        Ok(promoted)
    }

    unary_methods! {
        /// `-x`.
        neg => Neg,
        /// `|x|`.
        abs => Abs,
        /// `e^x`.
        exp => Exp,
        /// Natural logarithm.
        log => Log,
        /// Square root.
        sqrt => Sqrt,
        /// `1/sqrt(x)`.
        rsqrt => Rsqrt,
        /// `1/x`.
        reciprocal => Reciprocal,
        /// `max(x, 0)`.
        relu => Relu,
        /// Logistic sigmoid.
        sigmoid => Sigmoid,
        /// Hyperbolic tangent.
        tanh => Tanh,
        /// GELU (exact, erf form).
        gelu => Gelu,
        /// GELU (tanh approximation).
        gelu_tanh => GeluTanh,
        /// Error function.
        erf => Erf,
        /// Sine.
        sin => Sin,
        /// Cosine.
        cos => Cos,
        /// Round down.
        floor => Floor,
        /// Round up.
        ceil => Ceil,
        /// Round half to even.
        round => Round,
        /// Sign (-1, 0, 1).
        sign => Sign,
        /// Logical not (bool).
        logical_not => Not,
        /// NaN test (-> bool).
        isnan => IsNan,
        /// Infinity test (-> bool).
        isinf => IsInf,
    }

    binary_methods! {
        /// `a + b` with broadcasting.
        add, add_scalar => Add,
        /// `a - b` with broadcasting.
        sub, sub_scalar => Sub,
        /// `a * b` with broadcasting.
        mul, mul_scalar => Mul,
        /// `a / b` with broadcasting (integers truncate).
        div, div_scalar => Div,
        /// `a ^ b` with broadcasting.
        pow, pow_scalar => Pow,
        /// Elementwise maximum (NaN propagates).
        maximum, maximum_scalar => Maximum,
        /// Elementwise minimum (NaN propagates).
        minimum, minimum_scalar => Minimum,
        /// Floored modulo (sign of the divisor).
        modulo, modulo_scalar => Mod,
        /// Truncated remainder (sign of the dividend).
        rem, rem_scalar => Rem,
        /// `a == b`.
        eq, eq_scalar => Eq,
        /// `a != b`.
        ne, ne_scalar => Ne,
        /// `a < b`.
        lt, lt_scalar => Lt,
        /// `a <= b`.
        le, le_scalar => Le,
        /// `a > b`.
        gt, gt_scalar => Gt,
        /// `a >= b`.
        ge, ge_scalar => Ge,
        /// Logical and.
        logical_and, logical_and_scalar => And,
        /// Logical or.
        logical_or, logical_or_scalar => Or,
        /// Logical xor.
        logical_xor, logical_xor_scalar => Xor,
        /// `log(e^a + e^b)` without overflow, with broadcasting; floats
        /// (`torch.logaddexp`).
        logaddexp, logaddexp_scalar => LogAddExp,
    }

    /// `log(1 + e^(beta x)) / beta`, and `x` itself where `beta x >
    /// threshold` (PyTorch's `softplus`; its defaults are `beta = 1`,
    /// `threshold = 20`); floats. Written with [`Tensor::logaddexp`], so it
    /// neither overflows for large `x` nor loses `e^(beta x)` for very
    /// negative `x`.
    #[track_caller]
    pub fn softplus(&self, beta: f64, threshold: f64) -> Result<Tensor> {
        let z = self.mul_scalar(beta)?;
        let smooth = z.logaddexp_scalar(0.0)?.div_scalar(beta)?;
        z.gt_scalar(threshold)?.where_(self, &smooth)
    }

    /// `cond ? a : b` elementwise with broadcasting (`self` is the condition).
    #[track_caller]
    pub fn where_(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        Tensor::record(Op::Where, &[self, a, b])
    }

    /// Converts to `dtype` (no node if the dtype is already right).
    #[track_caller]
    pub fn cast(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        Tensor::record(Op::Cast(dtype), &[self])
    }

    /// `min(max(x, lo), hi)`; either bound may be absent.
    #[track_caller]
    pub fn clamp(&self, lo: Option<f64>, hi: Option<f64>) -> Result<Tensor> {
        let mut x = self.clone();
        if let Some(lo) = lo {
            x = x.maximum_scalar(lo)?;
        }
        if let Some(hi) = hi {
            x = x.minimum_scalar(hi)?;
        }
        Ok(x)
    }

    #[track_caller]
    pub(crate) fn axis(&self, op: &str, axis: isize) -> Result<usize> {
        let location = std::panic::Location::caller();
        self.shape().axis(axis).ok_or_else(|| {
            ExecError::ir(
                IrError::Axis { op: op.into(), axis, shape: self.shape().clone(), rank: self.rank() },
                location,
            )
        })
    }

    #[track_caller]
    pub(crate) fn axes(&self, op: &str, axes: &[isize]) -> Result<Vec<usize>> {
        let mut v = Vec::with_capacity(axes.len());
        for &a in axes {
            v.push(self.axis(op, a)?);
        }
        v.sort_unstable();
        let before = v.len();
        v.dedup();
        if v.len() != before {
            return Err(ExecError::from(IrError::Shape {
                op: op.into(),
                detail: format!("axes {axes:?} repeat an axis of {}", self.shape()),
            }));
        }
        Ok(v)
    }

    #[track_caller]
    fn reduce(&self, op: ReduceOp, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let name = format!("reduce_{}", op.name());
        let axes = self.axes(&name, axes)?;
        Tensor::record(Op::Reduce { op, axes, keepdim }, &[self])
    }

    /// Sum over `axes` (all axes if empty).
    #[track_caller]
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, &self.all_if_empty(axes), keepdim)
    }

    /// Mean over `axes` (all axes if empty).
    #[track_caller]
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Mean, &self.all_if_empty(axes), keepdim)
    }

    /// Maximum over `axes` (all axes if empty).
    #[track_caller]
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, &self.all_if_empty(axes), keepdim)
    }

    /// Minimum over `axes` (all axes if empty).
    #[track_caller]
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, &self.all_if_empty(axes), keepdim)
    }

    /// Product over `axes` (all axes if empty).
    #[track_caller]
    pub fn prod(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Prod, &self.all_if_empty(axes), keepdim)
    }

    /// Reduction `op` over `axes` (all axes if empty, like [`Tensor::sum`]).
    #[track_caller]
    pub fn reduce_axes(&self, op: ReduceOp, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(op, &self.all_if_empty(axes), keepdim)
    }

    pub(crate) fn all_if_empty(&self, axes: &[isize]) -> Vec<isize> {
        if axes.is_empty() {
            (0..self.rank() as isize).collect()
        } else {
            axes.to_vec()
        }
    }

    /// Index of the maximum along `axis`, as i32 (the first on ties).
    /// PyTorch gives int64; i32 is the widest integer WGSL has, so every
    /// backend computes it natively: read it with `to_vec::<i32>()`, or
    /// ask for int64 with [`Tensor::argmax_as`] (a cast on the CPU
    /// fallback on wgpu devices).
    #[track_caller]
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let axis = self.axis("argmax", axis)?;
        Tensor::record(Op::ArgReduce { op: ArgReduceOp::ArgMax, axis, keepdim, select_last: false }, &[self])
    }

    /// Index of the minimum along `axis`, as i32 (see [`Tensor::argmax`]
    /// and [`Tensor::argmin_as`]).
    #[track_caller]
    pub fn argmin(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let axis = self.axis("argmin", axis)?;
        Tensor::record(Op::ArgReduce { op: ArgReduceOp::ArgMin, axis, keepdim, select_last: false }, &[self])
    }

    /// Arg-reduction with every option.
    #[track_caller]
    pub fn arg_reduce(&self, op: ArgReduceOp, axis: isize, keepdim: bool, select_last: bool) -> Result<Tensor> {
        let axis = self.axis("arg_reduce", axis)?;
        Tensor::record(Op::ArgReduce { op, axis, keepdim, select_last }, &[self])
    }

    /// The elementwise sum or mean of this f32 tensor over every rank of
    /// the process group whose [`crate::Collective`] is registered on the
    /// device; `bucket` tags it within the step (every rank records the
    /// same all-reduces in the same order). It runs when the step syncs,
    /// started as soon as this tensor is computed; a step that records one
    /// fails to compile on a device without a collective.
    #[track_caller]
    pub fn all_reduce(&self, op: lazuli_ir::CollectiveOp, bucket: u32) -> Result<Tensor> {
        Tensor::record(Op::AllReduce { op, bucket }, &[self])
    }

    /// Prefix sum along `axis`.
    #[track_caller]
    pub fn cumsum(&self, axis: isize, exclusive: bool, reverse: bool) -> Result<Tensor> {
        let axis = self.axis("cumsum", axis)?;
        Tensor::record(Op::CumSum { axis, exclusive, reverse }, &[self])
    }

    /// Softmax along `axis`.
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Result<Tensor> {
        let axis = self.axis("softmax", axis)?;
        Tensor::record(Op::Softmax { axis, log: false }, &[self])
    }

    /// Log-softmax along `axis`.
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor> {
        let axis = self.axis("log_softmax", axis)?;
        Tensor::record(Op::Softmax { axis, log: true }, &[self])
    }

    /// Matrix product. 1-D operands are promoted like numpy (a leading or
    /// trailing 1 is added and removed again); batch dims broadcast.
    #[track_caller]
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let a = if self.rank() == 1 { self.unsqueeze(0)? } else { self.clone() };
        let b = if other.rank() == 1 { other.unsqueeze(-1)? } else { other.clone() };
        if self.rank() == 0 || other.rank() == 0 {
            return Err(ExecError::from(IrError::Shape {
                op: "matmul".into(),
                detail: format!("operands must have rank >= 1, got {} and {}", self.shape(), other.shape()),
            }));
        }
        let mut out = Tensor::record(Op::MatMul, &[&a, &b])?;
        if other.rank() == 1 {
            out = out.squeeze(&[-1])?;
        }
        if self.rank() == 1 {
            let ax = out.rank() as isize - if other.rank() == 1 { 1 } else { 2 };
            out = out.squeeze(&[ax])?;
        }
        Ok(out)
    }

    /// Same elements in a new shape; one dim may be `-1` (inferred). Sizes
    /// may be any integer type (`[2, -1]`, `&[rows, cols]` of `usize`, a
    /// `Shape` ...).
    #[track_caller]
    pub fn reshape(&self, dims: impl ReshapeDims) -> Result<Tensor> {
        let location = std::panic::Location::caller();
        let dims = dims.reshape_dims();
        let bad = || {
            ExecError::ir(
                IrError::Shape {
                    op: "reshape".into(),
                    detail: format!("cannot reshape {} ({} elements) to {dims:?}", self.shape(), self.numel()),
                },
                location,
            )
        };
        if dims.iter().any(|&d| d > isize::MAX as i128) {
            return Err(bad());
        }
        let dims: Vec<isize> = dims.iter().map(|&d| d.max(isize::MIN as i128) as isize).collect();
        let known: usize = dims.iter().filter(|&&d| d >= 0).fold(1usize, |n, &d| n.saturating_mul(d as usize));
        let holes = dims.iter().filter(|&&d| d < 0).count();
        let bad = || {
            ExecError::ir(
                IrError::Shape {
                    op: "reshape".into(),
                    detail: format!("cannot reshape {} ({} elements) to {dims:?}", self.shape(), self.numel()),
                },
                location,
            )
        };
        if holes > 1 || dims.iter().any(|&d| d < -1) {
            return Err(bad());
        }
        let shape: Vec<usize> = dims
            .iter()
            .map(|&d| {
                if d >= 0 {
                    Ok(d as usize)
                } else if known > 0 && self.numel().is_multiple_of(known) {
                    Ok(self.numel() / known)
                } else {
                    Err(bad())
                }
            })
            .collect::<Result<_>>()?;
        if Shape::new(shape.clone()) == *self.shape() {
            return Ok(self.clone());
        }
        Tensor::record(Op::Reshape(Shape::new(shape)), &[self])
    }

    /// [`Tensor::reshape`] to a known shape.
    #[track_caller]
    pub fn reshape_to(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape == *self.shape() {
            return Ok(self.clone());
        }
        Tensor::record(Op::Reshape(shape), &[self])
    }

    /// Reorders dims: `out.dims[i] = self.dims[perm[i]]` (negative entries allowed).
    #[track_caller]
    pub fn permute(&self, perm: &[isize]) -> Result<Tensor> {
        let p: Vec<usize> = perm.iter().map(|&a| self.shape().axis(a).unwrap_or(usize::MAX)).collect();
        Tensor::record(Op::Permute(p), &[self])
    }

    /// Swaps two dims.
    #[track_caller]
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let (a, b) = (self.axis("transpose", a)?, self.axis("transpose", b)?);
        let mut p: Vec<usize> = (0..self.rank()).collect();
        p.swap(a, b);
        Tensor::record(Op::Permute(p), &[self])
    }

    /// Transpose of the last two dims.
    #[track_caller]
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Ok(self.clone());
        }
        self.transpose(-2, -1)
    }

    /// Broadcasts to `shape` (numpy rules).
    #[track_caller]
    pub fn expand(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape == *self.shape() {
            return Ok(self.clone());
        }
        Tensor::record(Op::Expand(shape), &[self])
    }

    /// Inserts a size-1 dim at `axis` (in the output's numbering).
    #[track_caller]
    pub fn unsqueeze(&self, axis: isize) -> Result<Tensor> {
        let r = self.rank() as isize + 1;
        let a = if axis < 0 { axis + r } else { axis };
        if !(0..r).contains(&a) {
            return Err(ExecError::from(IrError::Axis {
                op: "unsqueeze".into(),
                axis,
                shape: self.shape().clone(),
                rank: self.rank(),
            }));
        }
        let mut dims = self.dims().to_vec();
        dims.insert(a as usize, 1);
        self.reshape_to(dims)
    }

    /// Removes size-1 dims (`axes` empty: every size-1 dim).
    #[track_caller]
    pub fn squeeze(&self, axes: &[isize]) -> Result<Tensor> {
        let axes = self.axes("squeeze", axes)?;
        for &a in &axes {
            if self.dims()[a] != 1 {
                return Err(ExecError::from(IrError::Shape {
                    op: "squeeze".into(),
                    detail: format!("dim {a} of {} has size {}, not 1", self.shape(), self.dims()[a]),
                }));
            }
        }
        let dims: Vec<usize> = self
            .dims()
            .iter()
            .enumerate()
            .filter(|(i, &d)| if axes.is_empty() { d != 1 } else { !axes.contains(i) })
            .map(|(_, &d)| d)
            .collect();
        self.reshape_to(dims)
    }

    /// Flattens dims `start..=end` into one.
    #[track_caller]
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape_to([1]);
        }
        let (s, e) = (self.axis("flatten", start)?, self.axis("flatten", end)?);
        if s > e {
            return Err(ExecError::from(IrError::Shape {
                op: "flatten".into(),
                detail: format!("start {start} after end {end} for {}", self.shape()),
            }));
        }
        let mut dims = self.dims()[..s].to_vec();
        dims.push(self.dims()[s..=e].iter().product());
        dims.extend_from_slice(&self.dims()[e + 1..]);
        self.reshape_to(dims)
    }

    /// Python-style slice of one axis: `start..end` by `step` (negative
    /// values count from the end, out-of-range bounds clamp like numpy).
    #[track_caller]
    pub fn slice(
        &self,
        axis: isize,
        start: impl TensorIndex,
        end: impl TensorIndex,
        step: impl TensorIndex,
    ) -> Result<Tensor> {
        let ax = self.axis("slice", axis)?;
        let n = self.dims()[ax] as i64;
        // Bounds beyond i64 clamp like any out-of-range bound; a step
        // beyond it selects one element like any step longer than the dim.
        let clamp = |v: i128| v.clamp(i64::MIN as i128, i64::MAX as i128) as i64;
        let (start, end, step) = (clamp(start.to_i128()), clamp(end.to_i128()), clamp(step.to_i128()));
        if step == 0 {
            return Err(ExecError::from(IrError::Shape {
                op: "slice".into(),
                detail: format!("step 0 on axis {axis} of {}", self.shape()),
            }));
        }
        let norm = |v: i64| if v < 0 { v + n } else { v };
        let (s, e) = if step > 0 {
            (norm(start).clamp(0, n), norm(end).clamp(0, n))
        } else {
            (norm(start).clamp(-1, n - 1), norm(end).clamp(-1, n - 1))
        };
        // In i128: `-step` and `+ step` overflow i64 for extreme steps.
        let (s128, e128, st) = (s as i128, e as i128, step as i128);
        let len =
            if st > 0 { ((e128 - s128).max(0) + st - 1) / st } else { ((s128 - e128).max(0) - st - 1) / -st } as i64;
        let mut starts = vec![0i64; self.rank()];
        let mut steps = vec![1i64; self.rank()];
        let mut lens = self.dims().to_vec();
        starts[ax] = if len > 0 { s } else { 0 };
        // A step matters only between two elements: normalizing it keeps
        // extreme steps (i64::MIN) out of the backends' index math.
        steps[ax] = if len > 1 { step } else { 1 };
        lens[ax] = len as usize;
        if len == n && step == 1 {
            return Ok(self.clone());
        }
        Tensor::record(Op::Slice { starts, steps, lens }, &[self])
    }

    /// The axis, start (negative counted from the end) and length of a
    /// `narrow` of `op`, checked: the range lies inside the axis, whose
    /// size is at most `max_size`.
    fn narrow_range(
        &self,
        op: &str,
        axis: isize,
        start: impl TensorIndex,
        len: impl TensorIndex,
        max_size: i128,
    ) -> Result<(usize, i64, usize)> {
        let ax = self.axis(op, axis)?;
        let n = self.dims()[ax] as i128;
        let (s, l) = (start.to_i128(), len.to_i128());
        let s = if s < 0 { s + n } else { s };
        if s < 0 || l < 0 || s + l > n || n > max_size {
            let limit =
                if max_size < i128::MAX { format!(", at most {max_size} for run-time indices") } else { String::new() };
            return Err(ExecError::from(IrError::Shape {
                op: op.into(),
                detail: format!(
                    "a slice of {l} elements from {} is out of range for axis {axis} (size {n}{limit}) of {}",
                    start.to_i128(),
                    self.shape()
                ),
            }));
        }
        Ok((ax, s as i64, l as usize))
    }

    /// `len` elements of `axis` from `start` (negative: counted from the
    /// end, as in [`Tensor::slice`]); no clamping: the range must lie
    /// inside the axis.
    #[track_caller]
    pub fn narrow(&self, axis: isize, start: impl TensorIndex, len: impl TensorIndex) -> Result<Tensor> {
        let (ax, start, len) = self.narrow_range("narrow", axis, start, len, i128::MAX)?;
        let mut starts = vec![0i64; self.rank()];
        let steps = vec![1i64; self.rank()];
        let mut lens = self.dims().to_vec();
        starts[ax] = start;
        lens[ax] = len;
        if len == 0 {
            starts[ax] = 0;
        }
        Tensor::record(Op::Slice { starts, steps, lens }, &[self])
    }

    /// [`Tensor::narrow`] with the start as run-time data: `len` elements
    /// of `axis` from `start` (negative: counted from the end), read by a
    /// gather at `iota(len) + start` where `start` travels as a lifted
    /// scalar. Calls with different starts record the same graph and run
    /// one compiled plan (the position pick of generation, a window moving
    /// over a fixed buffer), where `narrow` bakes the start into the graph
    /// and compiles a plan per start. The range is checked here, as
    /// `narrow` checks it; the gradient is the gather's (a scatter-add).
    #[track_caller]
    pub fn narrow_at(&self, axis: isize, start: impl TensorIndex, len: impl TensorIndex) -> Result<Tensor> {
        let (ax, start, len) = self.narrow_range("narrow_at", axis, start, len, i32::MAX as i128)?;
        let device = self.device();
        let offset = Tensor::lifted_scalar(ScalarValue::Int(start), DType::I32, device);
        let indices = Tensor::iota([len], 0, DType::I32, device)?.add(&offset)?;
        self.gather(ax as isize, &indices)
    }

    /// Joins tensors along `axis`.
    #[track_caller]
    pub fn concat(tensors: &[&Tensor], axis: isize) -> Result<Tensor> {
        let first = tensors.first().ok_or_else(|| IrError::Arity {
            op: "concat".into(),
            expected: "at least 1".into(),
            got: 0,
        })?;
        let axis = first.axis("concat", axis)?;
        if tensors.len() == 1 {
            return Ok((*first).clone());
        }
        Tensor::record(Op::Concat { axis }, tensors)
    }

    /// Stacks same-shape tensors along a new axis.
    #[track_caller]
    pub fn stack(tensors: &[&Tensor], axis: isize) -> Result<Tensor> {
        let us: Vec<Tensor> = tensors.iter().map(|t| t.unsqueeze(axis)).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = us.iter().collect();
        Tensor::concat(&refs, axis)
    }

    /// Pads each dim by `(before, after)` with a constant value.
    #[track_caller]
    pub fn pad(&self, pads: &[(usize, usize)], value: impl Into<ScalarValue>) -> Result<Tensor> {
        let v = Tensor::scalar(value, self.dtype(), self.device());
        Tensor::record(
            Op::Pad {
                before: pads.iter().map(|p| p.0).collect(),
                after: pads.iter().map(|p| p.1).collect(),
                mode: PadMode::Constant,
            },
            &[self, &v],
        )
    }

    /// Pads by reflection or edge repetition.
    #[track_caller]
    pub fn pad_mode(&self, pads: &[(usize, usize)], mode: PadMode) -> Result<Tensor> {
        if mode == PadMode::Constant {
            return self.pad(pads, 0);
        }
        Tensor::record(
            Op::Pad { before: pads.iter().map(|p| p.0).collect(), after: pads.iter().map(|p| p.1).collect(), mode },
            &[self],
        )
    }

    /// `take(indices, axis)`: indices (integer dtype; negative ones count
    /// from the end) replace dim `axis`. An index outside the dim is an
    /// error at the barrier that reads the result
    /// (`BackendError::IndexOutOfRange`), never a clamped value. See
    /// [`Tensor::scatter_add`] for how 64-bit indices reach a GPU.
    #[track_caller]
    pub fn gather(&self, axis: isize, indices: &Tensor) -> Result<Tensor> {
        let axis = self.axis("gather", axis)?;
        let indices = kernel_indices(indices, axis, self.dims()[axis])?;
        Tensor::record(Op::Gather { axis }, &[self, &indices])
    }

    /// `self` with `src`'s slices added at `indices` along `axis`: for
    /// every index position `j`, `src[.., j.., ..]` is added to
    /// `self[.., indices[j], ..]`, in index order, so repeated indices sum
    /// (PyTorch's `index_add`; the transpose of [`Tensor::gather`], whose
    /// gradient it is). `src` has `self`'s dims with dim `axis` replaced by
    /// the indices' dims. Negative indices count from the end; one outside
    /// the dim is an error at the barrier.
    ///
    /// WGSL has 32-bit integers only. On a device whose main backend is not
    /// the CPU, narrower integer indices are widened to i32, and 64-bit
    /// ones are checked and narrowed on the CPU fallback: gathering them
    /// from an i64 iota of the dim's length counts negative ones from the
    /// end and reports an out-of-range one with its full value (as an
    /// error of that gather: its axis and size are the data's, its data
    /// shape shows only that axis), and the result, now in `0..size`,
    /// casts to u32 exactly. Only the indices move to the CPU and back,
    /// never the data; the conversion is counted as the fallback ops
    /// `iota`, `gather` and `cast`.
    #[track_caller]
    pub fn scatter_add(&self, axis: isize, indices: &Tensor, src: &Tensor) -> Result<Tensor> {
        let axis = self.axis("scatter_add", axis)?;
        let indices = kernel_indices(indices, axis, self.dims()[axis])?;
        Tensor::record(Op::ScatterAdd { axis }, &[self, &indices, src])
    }

    /// 2-d convolution (`[N, C, H, W]` by `[O, C/groups, kh, kw]`).
    #[track_caller]
    pub fn conv2d(&self, weight: &Tensor, attrs: ConvAttrs) -> Result<Tensor> {
        Tensor::record(Op::Conv2d(attrs), &[self, weight])
    }

    /// N-d max or average pooling.
    #[track_caller]
    pub fn pool(&self, attrs: PoolAttrs) -> Result<Tensor> {
        Tensor::record(Op::Pool(attrs), &[self])
    }

    /// The input gradient of [`Tensor::pool`] on `self` given the output
    /// gradient `grad` (one op, `Op::PoolGrad`; max pooling gives each
    /// window's gradient to its first maximum).
    #[track_caller]
    pub fn pool_grad(&self, grad: &Tensor, attrs: PoolAttrs) -> Result<Tensor> {
        Tensor::record(Op::PoolGrad(attrs), &[self, grad])
    }

    /// Fused scaled dot-product attention of queries `self` (`[.., t_q,
    /// d]`) over keys `k` (`[.., t_k, d]`) and values `v` (`[.., t_k,
    /// d_v]`): `softmax(self k^T * scale + mask) v`, `[.., t_q, d_v]`,
    /// without materializing the scores (`Op::Attention`, whose doc gives
    /// the exact semantics). `causal` keeps keys `j <= i` for query `i`;
    /// `mask` (bool: true keeps a key; or a float of the scores' dtype,
    /// added) broadcasts to `[.., t_q, t_k]` without changing `t_q` or
    /// `t_k`. Leading dims broadcast. Differentiable in `self`, `k` and
    /// `v` (the backward recomputes the scores blockwise); not in the
    /// mask, and not twice.
    #[track_caller]
    pub fn attention(&self, k: &Tensor, v: &Tensor, scale: f64, causal: bool, mask: Option<&Tensor>) -> Result<Tensor> {
        let s = Tensor::scalar(scale, self.dtype(), self.device());
        let kind = match mask {
            None => AttentionMask::None,
            Some(m) if m.dtype() == DType::Bool => AttentionMask::Keep,
            Some(_) => AttentionMask::Additive,
        };
        let op = Op::Attention { attrs: AttentionAttrs { causal, mask: kind }, part: AttentionPart::Out };
        let mut operands = vec![self, k, v, &s];
        operands.extend(mask);
        Tensor::record(op, &operands)
    }
}

/// Indices of dim `axis` (of length `n`) in a dtype GPU kernels read (see
/// [`Tensor::scatter_add`]); unchanged on CPU devices and for i32 and u32.
#[track_caller]
fn kernel_indices(indices: &Tensor, axis: usize, n: usize) -> Result<Tensor> {
    if indices.device().kind() == BackendKind::Cpu {
        return Ok(indices.clone());
    }
    match indices.dtype() {
        DType::I8 | DType::I16 | DType::U8 | DType::U16 => indices.cast(DType::I32),
        DType::I64 | DType::U64 => {
            let mut dims = vec![1usize; axis + 1];
            dims[axis] = n;
            let positions = Tensor::iota(dims, axis, DType::I64, indices.device())?;
            let checked = Tensor::record(Op::Gather { axis }, &[&positions, indices])?;
            checked.reshape_to(indices.shape().clone())?.cast(DType::U32)
        }
        _ => Ok(indices.clone()),
    }
}

macro_rules! sugar {
    ($tr:ident, $m:ident, $f:ident, $fs:ident) => {
        impl std::ops::$tr<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            #[track_caller]
            fn $m(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$f(self, rhs)
            }
        }
        impl std::ops::$tr<Tensor> for Tensor {
            type Output = Result<Tensor>;
            #[track_caller]
            fn $m(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$f(&self, &rhs)
            }
        }
        // One generic impl for every scalar type (f32, f64, i32, ...): the
        // output type is known before the literal's type is, so
        // `(&x * 1.5)?` needs no annotation.
        impl<S: Into<ScalarValue>> std::ops::$tr<S> for &Tensor {
            type Output = Result<Tensor>;
            #[track_caller]
            fn $m(self, rhs: S) -> Result<Tensor> {
                Tensor::$fs(&self, rhs)
            }
        }
        impl<S: Into<ScalarValue>> std::ops::$tr<S> for Tensor {
            type Output = Result<Tensor>;
            #[track_caller]
            fn $m(self, rhs: S) -> Result<Tensor> {
                Tensor::$fs(&self, rhs)
            }
        }
    };
}

sugar!(Add, add, add, add_scalar);
sugar!(Sub, sub, sub, sub_scalar);
sugar!(Mul, mul, mul, mul_scalar);
sugar!(Div, div, div, div_scalar);

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    #[track_caller]
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
