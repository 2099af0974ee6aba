//! The closed op set ([`Op`]) with its group predicates and type inference.
//!
//! Each variant's doc line states its semantics and dtype rule. Shapes and
//! dtypes are inferred by [`Op::infer`] from the operand types when a node
//! is made; a mismatch is an [`IrError`] naming the op and the shapes.

use crate::quant::QuantFormat;
use crate::{DType, IrError, ScalarValue, Shape};

/// The shape and dtype of a value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ValueType {
    /// Dimensions.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
}

impl ValueType {
    /// A value type from parts.
    pub fn new(shape: impl Into<Shape>, dtype: DType) -> ValueType {
        ValueType { shape: shape.into(), dtype }
    }
}

/// Declares a closed, field-less enum together with `ALL`, every variant in
/// declaration order, written from the same list so that it cannot miss one:
/// adding a variant adds it to `ALL`, and every list derived from `ALL`
/// (the fuzzer's, gradcheck's, the coverage test's) follows.
macro_rules! closed_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $($(#[$vmeta:meta])* $variant:ident,)*
        }
    ) => {
        $(#[$meta])*
        pub enum $name {
            $($(#[$vmeta])* $variant,)*
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];
        }
    };
}

closed_enum! {
/// Unary elementwise functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`; signed ints and floats.
    Neg,
    /// `|x|`; numeric.
    Abs,
    /// `e^x`; floats.
    Exp,
    /// Natural log; floats.
    Log,
    /// Square root; floats.
    Sqrt,
    /// `1 / sqrt(x)`; floats.
    Rsqrt,
    /// `1 / x`; floats.
    Reciprocal,
    /// `max(x, 0)`; numeric.
    Relu,
    /// `1 / (1 + e^-x)`; floats.
    Sigmoid,
    /// Hyperbolic tangent; floats.
    Tanh,
    /// Exact GELU `x * Phi(x)` (erf form); floats.
    Gelu,
    /// GELU, tanh approximation; floats.
    GeluTanh,
    /// Error function; floats.
    Erf,
    /// Sine; floats.
    Sin,
    /// Cosine; floats.
    Cos,
    /// Round down; floats.
    Floor,
    /// Round up; floats.
    Ceil,
    /// Round half to even; floats.
    Round,
    /// -1, 0 or 1 (0 for 0, NaN stays NaN); numeric.
    Sign,
    /// Logical not; bool only.
    Not,
    /// `x != x`; floats -> bool.
    IsNan,
    /// `|x| == inf`; floats -> bool.
    IsInf,
}
}

impl UnaryOp {
    /// Lowercase name used in dumps and errors.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Reciprocal => "reciprocal",
            UnaryOp::Relu => "relu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Erf => "erf",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Round => "round",
            UnaryOp::Sign => "sign",
            UnaryOp::Not => "logical_not",
            UnaryOp::IsNan => "isnan",
            UnaryOp::IsInf => "isinf",
        }
    }

    fn result_dtype(self, x: DType) -> Result<DType, &'static str> {
        use UnaryOp::*;
        match self {
            Not if x == DType::Bool => Ok(DType::Bool),
            Not => Err("bool"),
            IsNan | IsInf if x.is_float() => Ok(DType::Bool),
            IsNan | IsInf => Err("a float dtype"),
            Neg if x.is_float() || x.is_signed_int() => Ok(x),
            Neg => Err("a signed integer or float dtype"),
            Abs | Relu | Sign if x.is_numeric() => Ok(x),
            Abs | Relu | Sign => Err("a numeric dtype"),
            _ if x.is_float() => Ok(x),
            _ => Err("a float dtype"),
        }
    }
}

closed_enum! {
/// Binary elementwise functions; operands broadcast (numpy rules) and must
/// have the same dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b` (integers wrap); numeric.
    Add,
    /// `a - b` (integers wrap); numeric.
    Sub,
    /// `a * b` (integers wrap); numeric.
    Mul,
    /// `a / b`; integers truncate toward zero (division by zero gives 0).
    Div,
    /// `a ^ b`; numeric.
    Pow,
    /// Elementwise maximum (NaN propagates); numeric.
    Maximum,
    /// Elementwise minimum (NaN propagates); numeric.
    Minimum,
    /// Floored modulo: the result has the sign of `b` (Python `%`).
    Mod,
    /// Truncated remainder: the result has the sign of `a` (C `fmod`).
    Rem,
    /// `a == b` -> bool.
    Eq,
    /// `a != b` -> bool.
    Ne,
    /// `a < b` -> bool.
    Lt,
    /// `a <= b` -> bool.
    Le,
    /// `a > b` -> bool.
    Gt,
    /// `a >= b` -> bool.
    Ge,
    /// Logical and; bool only.
    And,
    /// Logical or; bool only.
    Or,
    /// Logical xor; bool only.
    Xor,
    /// `log(e^a + e^b)`, computed as `max(a, b) + log1p(e^-|a - b|)` (no
    /// overflow); equal infinities give themselves, NaN propagates (as
    /// `torch.logaddexp`); floats.
    LogAddExp,
}
}

impl BinaryOp {
    /// Lowercase name used in dumps and errors.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Mod => "mod",
            BinaryOp::Rem => "rem",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
            BinaryOp::And => "logical_and",
            BinaryOp::Or => "logical_or",
            BinaryOp::Xor => "logical_xor",
            BinaryOp::LogAddExp => "logaddexp",
        }
    }

    /// True for the comparisons, whose result is bool.
    pub fn is_comparison(self) -> bool {
        matches!(self, BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge)
    }

    /// True for the logical ops (bool operands and result).
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }

    fn result_dtype(self, x: DType) -> Result<DType, &'static str> {
        if self == BinaryOp::LogAddExp {
            return if x.is_float() { Ok(x) } else { Err("float operands") };
        }
        if self.is_logical() {
            return if x == DType::Bool { Ok(DType::Bool) } else { Err("bool operands") };
        }
        if self.is_comparison() {
            return Ok(DType::Bool);
        }
        if x == DType::Bool {
            return Err("numeric operands");
        }
        Ok(x)
    }
}

closed_enum! {
/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum; numeric. The empty sum is 0.
    Sum,
    /// Arithmetic mean; floats. The empty mean is NaN.
    Mean,
    /// Maximum (NaN propagates); numeric or bool. Empty: the dtype's lowest.
    Max,
    /// Minimum (NaN propagates); numeric or bool. Empty: the dtype's highest.
    Min,
    /// Product; numeric. The empty product is 1.
    Prod,
}
}

impl ReduceOp {
    /// Lowercase name used in dumps and errors.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }
}

closed_enum! {
/// Index-of-extremum reductions along one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgReduceOp {
    /// Index of the maximum.
    ArgMax,
    /// Index of the minimum.
    ArgMin,
}
}

closed_enum! {
/// The distribution of a random op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RandomDist {
    /// Uniform in [0, 1).
    Uniform,
    /// Standard normal (Box-Muller over two uniforms).
    Normal,
}
}

closed_enum! {
/// The variant of an [`Op`] without its attributes ([`Op::kind`]): what
/// lists of ops (the coverage test, the fuzzer's menu) enumerate through
/// [`OpKind::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`Op::Parameter`].
    Parameter,
    /// [`Op::Constant`].
    Constant,
    /// [`Op::ScalarParam`].
    ScalarParam,
    /// [`Op::Iota`].
    Iota,
    /// [`Op::Random`].
    Random,
    /// [`Op::Unary`].
    Unary,
    /// [`Op::Binary`].
    Binary,
    /// [`Op::Where`].
    Where,
    /// [`Op::Cast`].
    Cast,
    /// [`Op::Reduce`].
    Reduce,
    /// [`Op::ArgReduce`].
    ArgReduce,
    /// [`Op::CumSum`].
    CumSum,
    /// [`Op::Softmax`].
    Softmax,
    /// [`Op::MatMul`].
    MatMul,
    /// [`Op::Reshape`].
    Reshape,
    /// [`Op::Permute`].
    Permute,
    /// [`Op::Expand`].
    Expand,
    /// [`Op::Slice`].
    Slice,
    /// [`Op::Concat`].
    Concat,
    /// [`Op::Pad`].
    Pad,
    /// [`Op::Gather`].
    Gather,
    /// [`Op::ScatterAdd`].
    ScatterAdd,
    /// [`Op::Conv2d`].
    Conv2d,
    /// [`Op::Pool`].
    Pool,
    /// [`Op::PoolGrad`].
    PoolGrad,
    /// [`Op::Attention`].
    Attention,
    /// [`Op::AllReduce`].
    AllReduce,
    /// [`Op::Dequantize`].
    Dequantize,
    /// [`Op::QuantMatMul`].
    QuantMatMul,
    /// [`Op::WriteAt`].
    WriteAt,
    /// [`Op::PrefixAttention`].
    PrefixAttention,
}
}

closed_enum! {
/// How an [`Op::AllReduce`] combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// The elementwise sum over the ranks.
    Sum,
    /// The elementwise mean over the ranks (the sum divided by the world size).
    Mean,
}
}

/// The kind of a pooling window reduction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Maximum over the window (padding never wins). Its gradient goes to
    /// the first maximum of each window in scan order (PyTorch's rule).
    #[default]
    Max,
    /// Average over the window.
    Avg {
        /// Count padded elements in the divisor.
        count_include_pad: bool,
    },
}

/// Attributes of an N-d pooling op over the trailing spatial dims of an
/// `[N, C, spatial...]` input.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolAttrs {
    /// Max or average.
    pub kind: PoolKind,
    /// Window size per spatial dim.
    pub kernel: Vec<usize>,
    /// Stride per spatial dim.
    pub strides: Vec<usize>,
    /// Padding before each spatial dim.
    pub pads_begin: Vec<usize>,
    /// Padding after each spatial dim.
    pub pads_end: Vec<usize>,
    /// Dilation per spatial dim.
    pub dilations: Vec<usize>,
    /// Use ceil instead of floor when computing the output size.
    pub ceil_mode: bool,
}

impl PoolAttrs {
    /// A pooling window of `kernel` (one size per spatial dim) with
    /// PyTorch's defaults: stride equal to the window, no padding, no
    /// dilation, floor mode.
    pub fn new(kind: PoolKind, kernel: &[usize]) -> PoolAttrs {
        let n = kernel.len();
        PoolAttrs {
            kind,
            kernel: kernel.to_vec(),
            strides: kernel.to_vec(),
            pads_begin: vec![0; n],
            pads_end: vec![0; n],
            dilations: vec![1; n],
            ceil_mode: false,
        }
    }

    /// Sets the stride of every spatial dim.
    pub fn with_strides(mut self, strides: &[usize]) -> PoolAttrs {
        self.strides = strides.to_vec();
        self
    }

    /// Pads every spatial dim by `pads[i]` on both sides.
    pub fn with_padding(mut self, pads: &[usize]) -> PoolAttrs {
        self.pads_begin = pads.to_vec();
        self.pads_end = pads.to_vec();
        self
    }

    /// Uses ceil instead of floor for the output size.
    pub fn with_ceil_mode(mut self, ceil_mode: bool) -> PoolAttrs {
        self.ceil_mode = ceil_mode;
        self
    }
}

impl Default for PoolAttrs {
    /// A 2-d 2x2 max pool with stride 2 (the common downsampling layer).
    fn default() -> PoolAttrs {
        PoolAttrs::new(PoolKind::Max, &[2, 2])
    }
}

/// Attributes of a 2-d convolution (`[N, C, H, W]` input, `[O, C/groups, kh, kw]` weight).
/// The default is stride 1, no padding, no dilation, one group.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvAttrs {
    /// Stride (h, w).
    pub strides: [usize; 2],
    /// Padding (top, left, bottom, right).
    pub pads: [usize; 4],
    /// Dilation (h, w).
    pub dilations: [usize; 2],
    /// Number of groups.
    pub groups: usize,
}

impl Default for ConvAttrs {
    fn default() -> ConvAttrs {
        ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], groups: 1 }
    }
}

closed_enum! {
/// Which value of scaled dot-product attention an [`Op::Attention`] node
/// computes. Attention is several single-output nodes over the same
/// operands rather than one node with a stacked output (see
/// [`Op::Attention`]); the fusion planner groups parts that share their
/// operands into one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AttentionPart {
    /// The output `O = softmax(S) V`, `[.., t_q, d_v]`.
    Out,
    /// The per-query log-sum-exp of the scores, `[.., t_q]` (`-inf` for a
    /// query whose keys are all removed): what the backward recomputes
    /// the probabilities from.
    LogSumExp,
    /// The gradient of the queries, `[.., t_q, d]`.
    GradQ,
    /// The gradient of the keys, `[.., t_k, d]` (batch dims of the output).
    GradK,
    /// The gradient of the values, `[.., t_k, d_v]` (batch dims of the output).
    GradV,
}
}

impl AttentionPart {
    /// True for the three gradients (their nodes take `dO`, the
    /// log-sum-exp and `rowsum(dO * O)` as extra operands).
    pub fn is_grad(self) -> bool {
        matches!(self, AttentionPart::GradQ | AttentionPart::GradK | AttentionPart::GradV)
    }
}

/// How the optional mask operand of [`Op::Attention`] applies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionMask {
    /// No mask operand.
    #[default]
    None,
    /// A float mask of the scores' dtype, added to the scaled scores
    /// (`-inf` removes a key).
    Additive,
    /// A bool mask: true where a query may attend to a key.
    Keep,
}

/// Attributes of [`Op::Attention`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AttentionAttrs {
    /// Query `i` sees only keys `j <= i` (top-left aligned, whatever the
    /// lengths, as PyTorch's `is_causal`).
    pub causal: bool,
    /// The mask operand's kind.
    pub mask: AttentionMask,
}

impl AttentionAttrs {
    /// Operands before the gradient operands: q, k, v, scale and the mask
    /// if there is one.
    pub fn forward_operands(&self) -> usize {
        if self.mask == AttentionMask::None {
            4
        } else {
            5
        }
    }
}

/// One IR operation. Leaves have no operands; every other op's operand
/// count is fixed except `Concat`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Graph input number `i` (device or host data); type from the graph's parameter table.
    Parameter(u32),
    /// A baked rank-0 constant of the given dtype (only special values are baked).
    Constant(ScalarValue, DType),
    /// Lifted rank-0 scalar: value `i` of the plan's scalar table (dtype from the table).
    ScalarParam(u32),
    /// `out[idx] = idx[axis]` for a tensor of `shape`, cast to `dtype`.
    Iota {
        /// Output shape.
        shape: Shape,
        /// The axis whose index is the value.
        axis: usize,
        /// Output dtype (numeric).
        dtype: DType,
    },
    /// Counter-based random numbers (Philox-4x32-10) of `shape`, f32. Operands:
    /// two rank-0 u32 key words (seed, step). Element `i` uses counter `i`.
    Random {
        /// Output shape.
        shape: Shape,
        /// Distribution.
        dist: RandomDist,
    },
    /// Unary elementwise function.
    Unary(UnaryOp),
    /// Binary elementwise function with broadcasting.
    Binary(BinaryOp),
    /// `cond ? a : b` with three-way broadcasting; `cond` bool, `a` and `b` the same dtype.
    Where,
    /// Convert to `dtype` (float->int truncates toward zero and saturates; nonzero->true).
    Cast(DType),
    /// Reduce over `axes` (sorted, unique); kept as size 1 when `keepdim`.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// Axes to reduce.
        axes: Vec<usize>,
        /// Keep reduced axes as size 1.
        keepdim: bool,
    },
    /// Index (i32) of the max/min along `axis`; ties take the first index, or the last with `select_last`.
    ArgReduce {
        /// ArgMax or ArgMin.
        op: ArgReduceOp,
        /// The axis.
        axis: usize,
        /// Keep the axis as size 1.
        keepdim: bool,
        /// Prefer the last index among ties.
        select_last: bool,
    },
    /// Inclusive (or exclusive) prefix sum along `axis`, optionally from the end.
    CumSum {
        /// The axis.
        axis: usize,
        /// Exclude the current element.
        exclusive: bool,
        /// Accumulate from the end.
        reverse: bool,
    },
    /// Softmax (or log-softmax) along `axis`; floats.
    Softmax {
        /// The axis.
        axis: usize,
        /// Log-softmax instead of softmax.
        log: bool,
    },
    /// `[.., m, k] @ [.., k, n]` with broadcast batch dims; both operands rank >= 2, same numeric dtype.
    MatMul,
    /// Same elements in a new shape (equal element count).
    Reshape(Shape),
    /// Reorder dims: `out.dims[i] = in.dims[perm[i]]`.
    Permute(Vec<usize>),
    /// Broadcast to `shape` (numpy rules).
    Expand(Shape),
    /// Strided slice: output dim `i` takes `starts[i] + j * steps[i]` for `j` in `0..lens[i]`; steps may be negative.
    Slice {
        /// First index per dim (in range when the dim is not empty).
        starts: Vec<i64>,
        /// Step per dim (non-zero).
        steps: Vec<i64>,
        /// Output length per dim.
        lens: Vec<usize>,
    },
    /// Join operands along `axis`; same dtype, other dims equal.
    Concat {
        /// The axis.
        axis: usize,
    },
    /// Pad with a constant (second operand, rank-0, same dtype) or by reflect/edge.
    Pad {
        /// Elements before, per dim.
        before: Vec<usize>,
        /// Elements after, per dim.
        after: Vec<usize>,
        /// Padding mode.
        mode: PadMode,
    },
    /// `out = data.take(indices, axis)`: indices (any int dtype, negative counts from the end) replace dim `axis`.
    Gather {
        /// The axis of `data`.
        axis: usize,
    },
    /// `out = base` plus, for every index position `j`, `src[.., j.., ..]` added at
    /// `out[.., indices[j], ..]` along `axis`, in index order (index_add; the transpose of
    /// `Gather`). Operands `(base, indices, src)`: `base` numeric; indices any int dtype,
    /// negative counts from the end, out of range is an error; `src` of `base`'s dtype with
    /// dim `axis` replaced by the indices' dims. Result of `base`'s type.
    ScatterAdd {
        /// The axis of `base`.
        axis: usize,
    },
    /// 2-d convolution of `[N, C, H, W]` by `[O, C/g, kh, kw]`; floats.
    Conv2d(ConvAttrs),
    /// N-d max/avg pooling over the spatial dims of `[N, C, ...]`; floats (max: any numeric).
    Pool(PoolAttrs),
    /// The input gradient of `Pool(attrs)`: operands `(x, g)`, `g` of the pool's output
    /// type; each element of `x` gets the parts of `g` of the windows covering it (max: a
    /// window's whole gradient goes to its first maximum in scan order, the first NaN when
    /// there is one, never padding; avg: `g / divisor`), summed in window order. Floats;
    /// result of `x`'s type.
    PoolGrad(PoolAttrs),
    /// Fused scaled dot-product attention, one [`AttentionPart`] per node.
    /// Operands: `q [.., t_q, d]`, `k [.., t_k, d]`, `v [.., t_k, d_v]`, a
    /// rank-0 `scale`, then the mask if `attrs.mask` has one (broadcastable
    /// to the scores `[.., t_q, t_k]` without changing `t_q` or `t_k`); the
    /// gradient parts then take `dO [.., t_q, d_v]`, the log-sum-exp
    /// `[.., t_q]` and `delta = rowsum(dO * O)` `[.., t_q]`. Leading
    /// (batch) dims of q, k, v and the mask broadcast; one float dtype
    /// throughout (a `Keep` mask is bool). Scores are `S = q k^T * scale`;
    /// keys `j > i` of query `i` are removed when causal (their weight is
    /// exactly 0); then the mask is added (`Additive`) or removes keys
    /// where false (`Keep`, like `-inf`); `O = softmax(S) V`. A query
    /// whose keys are all removed has a NaN output and a log-sum-exp of
    /// `-inf`, and NaN probabilities for its non-causal keys in the
    /// gradients. Gradients pass to the scores everywhere but at causally
    /// removed keys and keys a `Keep` mask removes (`where`'s rule). Equal
    /// to the composition `softmax(M) v`, `C = where(j <= i, S, -inf)`
    /// when causal, `M = C + mask` (`Additive`) or `where(mask, C, -inf)`
    /// (`Keep`), up to rounding, forward and backward; except that
    /// causally removed keys never turn a non-finite `k` into NaN and pass
    /// nothing to a query whose keys are all removed.
    ///
    /// Rejected alternatives for carrying the backward's values: one node
    /// with a stacked output (`[.., t_q, d_v + 1]` holding `O` and the
    /// log-sum-exp, or `[.., t_k, d + d_v]` holding `dK` and `dV`) makes
    /// every consumer read through a slice with an odd row stride (no
    /// vec4 loads) and gives the gradient of the log-sum-exp column a
    /// meaning it does not have; multi-output nodes would touch every
    /// pass, the tracer and both backends. Single-output parts keep the
    /// IR as it is: a training step records `Out` forward and `LogSumExp`,
    /// `GradQ`, `GradK`, `GradV` in the backward over the same operands,
    /// and the planner groups `Out` with `LogSumExp` and `GradK` with
    /// `GradV` into one kernel each (`GradQ` is its own kernel: it walks
    /// keys per query block, where `dK`/`dV` walk queries per key block;
    /// the FlashAttention-2 split that needs no atomics).
    Attention {
        /// Causal flag and mask kind.
        attrs: AttentionAttrs,
        /// Which value this node is.
        part: AttentionPart,
    },
    /// The elementwise `op` (sum or mean) of this tensor over every rank of
    /// the process group the executing device's collective connects; f32,
    /// result of the operand's type. `bucket` tags the collective (every
    /// rank runs the same buckets in the same order). No backend computes
    /// it: the executor runs it as a collective segment (stage to host,
    /// start the collective, upload where the result is read).
    AllReduce {
        /// Sum or mean.
        op: CollectiveOp,
        /// The tag of this all-reduce within its step.
        bucket: u32,
    },
    /// Decodes rows of a block-quantized weight (see [`crate::quant`]):
    /// operand `u8 [.., row_bytes]` (a whole number of the format's
    /// blocks per row), result f32 `[.., row_len]`, bit-identical to the
    /// GGML reference formulas. An embedding lookup is a `Gather` of rows
    /// of the bytes followed by this.
    Dequantize(QuantFormat),
    /// `x @ dequantize(w)^T`, dequantizing inside the product: operands
    /// `x` f32 `[.., m, k]` and `w` u8 `[n, row_bytes(k)]` (a quantized
    /// `[n, k]` weight, the layout of a GGUF linear layer); result f32
    /// `[.., m, n]`. The weight is read in its quantized size, never
    /// widened in memory.
    QuantMatMul(QuantFormat),
    /// `base` with `update` written at offset `pos` along `axis` (a KV
    /// cache written in place at the current position): operands `base`,
    /// `update` (same dtype and rank; equal dims but `axis`, where it is
    /// at most `base`'s) and `pos`, integer, rank 0 (one offset) or `[b]`
    /// with `b = base.dims[0]` and `axis > 0` (one offset per leading
    /// row: several sequences at their own positions). An offset whose
    /// update does not fit is an error at the barrier, never a clamp.
    /// Result of `base`'s type. `pos` is data (a lifted scalar or a
    /// tensor), so every position runs the same plan; where `base`'s
    /// buffer is donated the backend writes in place.
    WriteAt {
        /// The axis of the offset.
        axis: usize,
    },
    /// Causal attention of queries at positions `pos + i` over the valid
    /// prefix of a key/value cache: operands `q [b, h, t, d]`, `k [b, g,
    /// s, d]`, `v [b, g, s, dv]` (`h` a multiple of `g`: grouped-query
    /// attention, query head `j` reads cache head `j / (h / g)`), a
    /// rank-0 `scale` and `pos`, integer, rank 0 or `[b]` (as
    /// [`Op::WriteAt`]); one float dtype. Query `i` of row `r` sees keys
    /// `0..=pos_r + i`, so the work grows with the prefix, never with `s`;
    /// `pos_r + t > s` is an error at the barrier. Result `[b, h, t, dv]`,
    /// equal to `Attention` over the first `pos + t` keys with the causal
    /// mask aligned bottom-right, up to rounding.
    PrefixAttention,
}

/// How `Op::Pad` fills the border.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PadMode {
    /// The constant operand.
    Constant,
    /// Mirror without repeating the edge.
    Reflect,
    /// Repeat the edge element.
    Edge,
}

impl Op {
    /// The variant without its attributes.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Parameter(_) => OpKind::Parameter,
            Op::Constant(..) => OpKind::Constant,
            Op::ScalarParam(_) => OpKind::ScalarParam,
            Op::Iota { .. } => OpKind::Iota,
            Op::Random { .. } => OpKind::Random,
            Op::Unary(_) => OpKind::Unary,
            Op::Binary(_) => OpKind::Binary,
            Op::Where => OpKind::Where,
            Op::Cast(_) => OpKind::Cast,
            Op::Reduce { .. } => OpKind::Reduce,
            Op::ArgReduce { .. } => OpKind::ArgReduce,
            Op::CumSum { .. } => OpKind::CumSum,
            Op::Softmax { .. } => OpKind::Softmax,
            Op::MatMul => OpKind::MatMul,
            Op::Reshape(_) => OpKind::Reshape,
            Op::Permute(_) => OpKind::Permute,
            Op::Expand(_) => OpKind::Expand,
            Op::Slice { .. } => OpKind::Slice,
            Op::Concat { .. } => OpKind::Concat,
            Op::Pad { .. } => OpKind::Pad,
            Op::Gather { .. } => OpKind::Gather,
            Op::ScatterAdd { .. } => OpKind::ScatterAdd,
            Op::Conv2d(_) => OpKind::Conv2d,
            Op::Pool(_) => OpKind::Pool,
            Op::PoolGrad(_) => OpKind::PoolGrad,
            Op::Attention { .. } => OpKind::Attention,
            Op::AllReduce { .. } => OpKind::AllReduce,
            Op::Dequantize(_) => OpKind::Dequantize,
            Op::QuantMatMul(_) => OpKind::QuantMatMul,
            Op::WriteAt { .. } => OpKind::WriteAt,
            Op::PrefixAttention => OpKind::PrefixAttention,
        }
    }

    /// A short name for dumps and error messages.
    pub fn name(&self) -> String {
        self.label().to_string()
    }

    /// [`Op::name`] without allocating (the hot recording path uses it).
    pub fn label(&self) -> &'static str {
        match self {
            Op::Parameter(_) => "parameter",
            Op::Constant(..) => "constant",
            Op::ScalarParam(_) => "scalar",
            Op::Iota { .. } => "iota",
            Op::Random { dist: RandomDist::Uniform, .. } => "rand",
            Op::Random { dist: RandomDist::Normal, .. } => "randn",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Where => "where",
            Op::Cast(_) => "cast",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "reduce_sum",
                ReduceOp::Mean => "reduce_mean",
                ReduceOp::Max => "reduce_max",
                ReduceOp::Min => "reduce_min",
                ReduceOp::Prod => "reduce_prod",
            },
            Op::ArgReduce { op: ArgReduceOp::ArgMax, .. } => "argmax",
            Op::ArgReduce { op: ArgReduceOp::ArgMin, .. } => "argmin",
            Op::CumSum { .. } => "cumsum",
            Op::Softmax { log: false, .. } => "softmax",
            Op::Softmax { log: true, .. } => "log_softmax",
            Op::MatMul => "matmul",
            Op::Reshape(_) => "reshape",
            Op::Permute(_) => "permute",
            Op::Expand(_) => "expand",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Pad { .. } => "pad",
            Op::Gather { .. } => "gather",
            Op::Conv2d(_) => "conv2d",
            Op::Pool(PoolAttrs { kind: PoolKind::Max, .. }) => "max_pool",
            Op::Pool(PoolAttrs { kind: PoolKind::Avg { .. }, .. }) => "avg_pool",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::PoolGrad(PoolAttrs { kind: PoolKind::Max, .. }) => "max_pool_grad",
            Op::PoolGrad(PoolAttrs { kind: PoolKind::Avg { .. }, .. }) => "avg_pool_grad",
            Op::Attention { part, .. } => match part {
                AttentionPart::Out => "attention",
                AttentionPart::LogSumExp => "attention_lse",
                AttentionPart::GradQ => "attention_grad_q",
                AttentionPart::GradK => "attention_grad_k",
                AttentionPart::GradV => "attention_grad_v",
            },
            Op::AllReduce { op: CollectiveOp::Sum, .. } => "all_reduce_sum",
            Op::AllReduce { op: CollectiveOp::Mean, .. } => "all_reduce_mean",
            Op::Dequantize(_) => "dequantize",
            Op::QuantMatMul(_) => "quant_matmul",
            Op::WriteAt { .. } => "write_at",
            Op::PrefixAttention => "prefix_attention",
        }
    }

    /// Leaves: no operands.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Parameter(_) | Op::Constant(..) | Op::ScalarParam(_) | Op::Iota { .. })
    }

    /// Pure per-element functions of operands at the same (broadcast) index.
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_))
    }

    /// Ops that only move or repeat elements; each output element reads
    /// exactly one operand element (or a pad value) at a computable index.
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } | Op::Concat { .. } | Op::Pad { .. }
        )
    }

    /// Collectives across ranks ([`Op::AllReduce`]): no backend runs them;
    /// the executor's plan gives each one a segment of its own.
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllReduce { .. })
    }

    /// Reductions over axes, including arg-reductions and softmax.
    pub fn is_reduction(&self) -> bool {
        matches!(self, Op::Reduce { .. } | Op::ArgReduce { .. } | Op::Softmax { .. } | Op::CumSum { .. })
    }

    /// Infers the result type from operand types. `params` and `scalars`
    /// give the types of `Parameter` and `ScalarParam` leaves.
    pub fn infer(&self, inputs: &[ValueType], params: &[ValueType], scalars: &[DType]) -> Result<ValueType, IrError> {
        let op = self.label();
        let arity = |n: usize| -> Result<(), IrError> {
            if inputs.len() == n {
                Ok(())
            } else {
                Err(IrError::Arity { op: op.to_string(), expected: n.to_string(), got: inputs.len() })
            }
        };
        // Only error messages need the operand dtypes: no allocation otherwise.
        let dtypes = || inputs.iter().map(|v| v.dtype).collect::<Vec<DType>>();
        let check_axis = |axis: usize, shape: &Shape| -> Result<(), IrError> {
            if axis < shape.rank() {
                Ok(())
            } else {
                Err(IrError::Axis { op: op.to_string(), axis: axis as isize, shape: shape.clone(), rank: shape.rank() })
            }
        };
        match self {
            Op::Parameter(i) => {
                arity(0)?;
                params
                    .get(*i as usize)
                    .cloned()
                    .ok_or_else(|| IrError::shape(op, format!("parameter {i} is not in the parameter table")))
            }
            Op::Constant(_, dtype) => {
                arity(0)?;
                Ok(ValueType::new(Shape::scalar(), *dtype))
            }
            Op::ScalarParam(i) => {
                arity(0)?;
                scalars
                    .get(*i as usize)
                    .map(|d| ValueType::new(Shape::scalar(), *d))
                    .ok_or_else(|| IrError::shape(op, format!("scalar slot {i} is not in the scalar table")))
            }
            Op::Iota { shape, axis, dtype } => {
                arity(0)?;
                check_axis(*axis, shape)?;
                if !dtype.is_numeric() {
                    return Err(IrError::dtype(op, "a numeric dtype", &[*dtype]));
                }
                Ok(ValueType::new(shape.clone(), *dtype))
            }
            Op::Random { shape, .. } => {
                arity(2)?;
                for v in inputs {
                    if v.dtype != DType::U32 || v.shape.rank() != 0 {
                        return Err(IrError::dtype(op, "two rank-0 u32 key operands", &dtypes()));
                    }
                }
                Ok(ValueType::new(shape.clone(), DType::F32))
            }
            Op::Unary(u) => {
                arity(1)?;
                let d = u
                    .result_dtype(inputs[0].dtype)
                    .map_err(|want| IrError::dtype(op, format!("expected {want}"), &dtypes()))?;
                Ok(ValueType::new(inputs[0].shape.clone(), d))
            }
            Op::Binary(b) => {
                arity(2)?;
                if inputs[0].dtype != inputs[1].dtype {
                    return Err(IrError::dtype(op, "operands must have the same dtype", &dtypes()));
                }
                let d = b
                    .result_dtype(inputs[0].dtype)
                    .map_err(|want| IrError::dtype(op, format!("expected {want}"), &dtypes()))?;
                let shape = broadcast(op, &inputs[0].shape, &inputs[1].shape)?;
                Ok(ValueType::new(shape, d))
            }
            Op::Where => {
                arity(3)?;
                if inputs[0].dtype != DType::Bool {
                    return Err(IrError::dtype(op, "condition must be bool", &dtypes()));
                }
                if inputs[1].dtype != inputs[2].dtype {
                    return Err(IrError::dtype(op, "both branches must have the same dtype", &dtypes()));
                }
                let s = broadcast(op, &inputs[0].shape, &inputs[1].shape)?;
                let s = broadcast(op, &s, &inputs[2].shape)?;
                Ok(ValueType::new(s, inputs[1].dtype))
            }
            Op::Cast(d) => {
                arity(1)?;
                Ok(ValueType::new(inputs[0].shape.clone(), *d))
            }
            Op::Reduce { op: r, axes, keepdim } => {
                arity(1)?;
                let x = &inputs[0];
                check_axes(op, axes, &x.shape)?;
                let ok = match r {
                    ReduceOp::Mean => x.dtype.is_float(),
                    ReduceOp::Max | ReduceOp::Min => true,
                    ReduceOp::Sum | ReduceOp::Prod => x.dtype.is_numeric(),
                };
                if !ok {
                    let want = if *r == ReduceOp::Mean { "a float dtype" } else { "a numeric dtype" };
                    return Err(IrError::dtype(op, format!("expected {want}"), &dtypes()));
                }
                Ok(ValueType::new(reduced_shape(&x.shape, axes, *keepdim), x.dtype))
            }
            Op::ArgReduce { axis, keepdim, .. } => {
                arity(1)?;
                let x = &inputs[0];
                check_axis(*axis, &x.shape)?;
                if x.shape.dims()[*axis] == 0 {
                    return Err(IrError::shape(
                        op,
                        format!("cannot take {op} over the empty axis {axis} of {}", x.shape),
                    ));
                }
                Ok(ValueType::new(reduced_shape(&x.shape, &[*axis], *keepdim), DType::I32))
            }
            Op::CumSum { axis, .. } => {
                arity(1)?;
                check_axis(*axis, &inputs[0].shape)?;
                if !inputs[0].dtype.is_numeric() {
                    return Err(IrError::dtype(op, "expected a numeric dtype", &dtypes()));
                }
                Ok(inputs[0].clone())
            }
            Op::Softmax { axis, .. } => {
                arity(1)?;
                check_axis(*axis, &inputs[0].shape)?;
                if !inputs[0].dtype.is_float() {
                    return Err(IrError::dtype(op, "expected a float dtype", &dtypes()));
                }
                Ok(inputs[0].clone())
            }
            Op::MatMul => {
                arity(2)?;
                let (a, b) = (&inputs[0], &inputs[1]);
                if a.dtype != b.dtype || !a.dtype.is_numeric() {
                    return Err(IrError::dtype(op, "operands must have the same numeric dtype", &dtypes()));
                }
                if a.shape.rank() < 2 || b.shape.rank() < 2 {
                    return Err(IrError::shape(
                        op,
                        format!("operands must have rank >= 2, got {} and {}", a.shape, b.shape),
                    ));
                }
                let (ad, bd) = (a.shape.dims(), b.shape.dims());
                let (m, k1) = (ad[ad.len() - 2], ad[ad.len() - 1]);
                let (k2, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
                if k1 != k2 {
                    return Err(IrError::shape(
                        op,
                        format!("inner dimensions differ: {} @ {} ({k1} != {k2})", a.shape, b.shape),
                    ));
                }
                let ab = Shape::new(&ad[..ad.len() - 2]);
                let bb = Shape::new(&bd[..bd.len() - 2]);
                let batch = ab.broadcast(&bb).ok_or_else(|| {
                    IrError::shape(op, format!("batch dimensions of {} and {} do not broadcast", a.shape, b.shape))
                })?;
                let dims: Shape = batch.dims().iter().copied().chain([m, n]).collect();
                Ok(ValueType::new(dims, a.dtype))
            }
            Op::Reshape(shape) => {
                arity(1)?;
                if shape.numel() != inputs[0].shape.numel() {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "cannot reshape {} ({} elements) to {} ({} elements)",
                            inputs[0].shape,
                            inputs[0].shape.numel(),
                            shape,
                            shape.numel()
                        ),
                    ));
                }
                Ok(ValueType::new(shape.clone(), inputs[0].dtype))
            }
            Op::Permute(perm) => {
                arity(1)?;
                let s = &inputs[0].shape;
                let mut seen = vec![false; s.rank()];
                let valid = perm.len() == s.rank()
                    && perm.iter().all(|&p| p < s.rank() && !std::mem::replace(&mut seen[p], true));
                if !valid {
                    return Err(IrError::shape(
                        op,
                        format!("{perm:?} is not a permutation of the {} dims of {s}", s.rank()),
                    ));
                }
                Ok(ValueType::new(perm.iter().map(|&p| s.dims()[p]).collect::<Vec<_>>(), inputs[0].dtype))
            }
            Op::Expand(shape) => {
                arity(1)?;
                if !inputs[0].shape.broadcasts_to(shape) {
                    return Err(IrError::shape(op, format!("cannot broadcast {} to {}", inputs[0].shape, shape)));
                }
                Ok(ValueType::new(shape.clone(), inputs[0].dtype))
            }
            Op::Slice { starts, steps, lens } => {
                arity(1)?;
                let s = &inputs[0].shape;
                if starts.len() != s.rank() || steps.len() != s.rank() || lens.len() != s.rank() {
                    return Err(IrError::shape(
                        op,
                        format!("slice spec has {} dims, operand {s} has {}", starts.len(), s.rank()),
                    ));
                }
                for d in 0..s.rank() {
                    let (start, step, len, dim) = (starts[d], steps[d], lens[d] as i64, s.dims()[d] as i64);
                    if step == 0 {
                        return Err(IrError::shape(op, format!("step of dim {d} is 0")));
                    }
                    if len > 0 {
                        let last = start + (len - 1) * step;
                        if start < 0 || start >= dim || last < 0 || last >= dim {
                            return Err(IrError::shape(
                                op,
                                format!("dim {d}: indices {start}..={last} (step {step}) out of range for size {dim} in {s}"),
                            ));
                        }
                    }
                }
                Ok(ValueType::new(lens.clone(), inputs[0].dtype))
            }
            Op::Concat { axis } => {
                if inputs.is_empty() {
                    return Err(IrError::Arity { op: op.to_string(), expected: "at least 1".into(), got: 0 });
                }
                let first = &inputs[0];
                check_axis(*axis, &first.shape)?;
                let mut dims = first.shape.to_vec();
                dims[*axis] = 0;
                for v in inputs {
                    if v.dtype != first.dtype {
                        return Err(IrError::dtype(op, "operands must have the same dtype", &dtypes()));
                    }
                    let same_rank = v.shape.rank() == first.shape.rank();
                    let same_other =
                        same_rank && (0..dims.len()).all(|d| d == *axis || v.shape.dims()[d] == first.shape.dims()[d]);
                    if !same_other {
                        return Err(IrError::shape(
                            op,
                            format!("shapes {} and {} differ outside axis {axis}", first.shape, v.shape),
                        ));
                    }
                    dims[*axis] = dims[*axis].saturating_add(v.shape.dims()[*axis]);
                }
                Ok(ValueType::new(dims, first.dtype))
            }
            Op::Pad { before, after, mode } => {
                let want = if *mode == PadMode::Constant { 2 } else { 1 };
                arity(want)?;
                let s = &inputs[0].shape;
                if before.len() != s.rank() || after.len() != s.rank() {
                    return Err(IrError::shape(op, format!("pads for {} dims given for operand {s}", before.len())));
                }
                if want == 2 && (inputs[1].dtype != inputs[0].dtype || inputs[1].shape.rank() != 0) {
                    return Err(IrError::dtype(
                        op,
                        "pad value must be a rank-0 tensor of the operand's dtype",
                        &dtypes(),
                    ));
                }
                for d in 0..s.rank() {
                    let n = s.dims()[d];
                    let bad = match mode {
                        PadMode::Reflect => (before[d] > 0 || after[d] > 0) && (before[d] >= n || after[d] >= n),
                        PadMode::Edge => (before[d] > 0 || after[d] > 0) && n == 0,
                        PadMode::Constant => false,
                    };
                    if bad {
                        return Err(IrError::shape(
                            op,
                            format!(
                                "{mode:?} padding of dim {d} by ({}, {}) needs a larger dim than {n} in {s}",
                                before[d], after[d]
                            ),
                        ));
                    }
                }
                // Saturating: a huge pad gives an impossible shape, which
                // the executor refuses, instead of an overflow panic.
                let dims: Vec<usize> =
                    (0..s.rank()).map(|d| s.dims()[d].saturating_add(before[d]).saturating_add(after[d])).collect();
                Ok(ValueType::new(dims, inputs[0].dtype))
            }
            Op::Gather { axis } => {
                arity(2)?;
                let (x, idx) = (&inputs[0], &inputs[1]);
                check_axis(*axis, &x.shape)?;
                if !idx.dtype.is_int() {
                    return Err(IrError::dtype(op, "indices must have an integer dtype", &dtypes()));
                }
                let mut dims = x.shape.dims()[..*axis].to_vec();
                dims.extend_from_slice(idx.shape.dims());
                dims.extend_from_slice(&x.shape.dims()[*axis + 1..]);
                Ok(ValueType::new(dims, x.dtype))
            }
            Op::ScatterAdd { axis } => {
                arity(3)?;
                let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
                check_axis(*axis, &base.shape)?;
                if !idx.dtype.is_int() {
                    return Err(IrError::dtype(op, "indices must have an integer dtype", &dtypes()));
                }
                if base.dtype != src.dtype || !base.dtype.is_numeric() {
                    return Err(IrError::dtype(op, "base and src must have the same numeric dtype", &dtypes()));
                }
                let mut want = base.shape.dims()[..*axis].to_vec();
                want.extend_from_slice(idx.shape.dims());
                want.extend_from_slice(&base.shape.dims()[*axis + 1..]);
                if src.shape.dims() != want.as_slice() {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "src {} must be base {} with dim {axis} replaced by the indices' dims {} (expected {})",
                            src.shape,
                            base.shape,
                            idx.shape,
                            Shape::new(want)
                        ),
                    ));
                }
                Ok(base.clone())
            }
            Op::Conv2d(c) => {
                arity(2)?;
                let (x, w) = (&inputs[0], &inputs[1]);
                if x.dtype != w.dtype || !x.dtype.is_float() {
                    return Err(IrError::dtype(op, "input and weight must have the same float dtype", &dtypes()));
                }
                if x.shape.rank() != 4 || w.shape.rank() != 4 {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "expected [N, C, H, W] input and [O, C/g, kh, kw] weight, got {} and {}",
                            x.shape, w.shape
                        ),
                    ));
                }
                let (xd, wd) = (x.shape.dims(), w.shape.dims());
                if c.groups == 0 || wd[1].checked_mul(c.groups) != Some(xd[1]) || wd[0] % c.groups != 0 {
                    return Err(IrError::shape(
                        op,
                        format!("channels of {} do not match weight {} with {} groups", x.shape, w.shape, c.groups),
                    ));
                }
                let mut dims = vec![xd[0], wd[0]];
                for i in 0..2 {
                    // Attributes come from users: overflow is an error, not a panic.
                    let padded = xd[2 + i].checked_add(c.pads[i]).and_then(|v| v.checked_add(c.pads[i + 2]));
                    let eff = wd[2 + i]
                        .checked_sub(1)
                        .and_then(|k| k.checked_mul(c.dilations[i]))
                        .and_then(|v| v.checked_add(1));
                    let (Some(padded), Some(eff)) = (padded, eff) else {
                        return Err(IrError::shape(
                            op,
                            format!(
                                "kernel {} with dilations {:?} and pads {:?} is empty or too large for input {}",
                                w.shape, c.dilations, c.pads, x.shape
                            ),
                        ));
                    };
                    if c.strides[i] == 0 || padded < eff {
                        return Err(IrError::shape(
                            op,
                            format!("kernel {} does not fit input {} with pads {:?}", w.shape, x.shape, c.pads),
                        ));
                    }
                    dims.push((padded - eff) / c.strides[i] + 1);
                }
                Ok(ValueType::new(dims, x.dtype))
            }
            Op::PoolGrad(p) => {
                arity(2)?;
                let (x, g) = (&inputs[0], &inputs[1]);
                if !x.dtype.is_float() {
                    return Err(IrError::dtype(op, "expected a float dtype", &dtypes()));
                }
                let y = Op::Pool(p.clone()).infer(std::slice::from_ref(x), params, scalars)?;
                if *g != y {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "the gradient {}{} must have the pool's output type {}{} for input {}",
                            g.dtype, g.shape, y.dtype, y.shape, x.shape
                        ),
                    ));
                }
                Ok(x.clone())
            }
            Op::Pool(p) => {
                arity(1)?;
                let x = &inputs[0];
                let nsp = p.kernel.len();
                if x.shape.rank() != nsp + 2
                    || [p.strides.len(), p.pads_begin.len(), p.pads_end.len(), p.dilations.len()]
                        .iter()
                        .any(|&l| l != nsp)
                {
                    return Err(IrError::shape(
                        op,
                        format!("a {nsp}-d window needs an input of rank {}, got {}", nsp + 2, x.shape),
                    ));
                }
                if !x.dtype.is_numeric() || (matches!(p.kind, PoolKind::Avg { .. }) && !x.dtype.is_float()) {
                    return Err(IrError::dtype(op, "expected a float dtype (max pool: numeric)", &dtypes()));
                }
                let mut dims = x.shape.dims()[..2].to_vec();
                for i in 0..nsp {
                    // Attributes come from users: overflow is an error, not a panic.
                    let padded =
                        x.shape.dims()[2 + i].checked_add(p.pads_begin[i]).and_then(|v| v.checked_add(p.pads_end[i]));
                    let eff = (p.kernel[i].max(1) - 1).checked_mul(p.dilations[i]).and_then(|v| v.checked_add(1));
                    let (Some(padded), Some(eff)) = (padded, eff) else {
                        return Err(IrError::shape(
                            op,
                            format!(
                                "window {:?} with dilations {:?} is too large for input {}",
                                p.kernel, p.dilations, x.shape
                            ),
                        ));
                    };
                    if p.strides[i] == 0 || p.kernel[i] == 0 || padded < eff {
                        return Err(IrError::shape(
                            op,
                            format!("window {:?} does not fit input {}", p.kernel, x.shape),
                        ));
                    }
                    let span = padded - eff;
                    let mut out = if p.ceil_mode { span.div_ceil(p.strides[i]) + 1 } else { span / p.strides[i] + 1 };
                    // A window may not start inside the end padding (ONNX / PyTorch rule).
                    if p.ceil_mode && (out - 1) * p.strides[i] >= x.shape.dims()[2 + i] + p.pads_begin[i] {
                        out -= 1;
                    }
                    dims.push(out);
                }
                Ok(ValueType::new(dims, x.dtype))
            }
            Op::Attention { attrs, part } => infer_attention(op, attrs, *part, inputs),
            Op::AllReduce { .. } => {
                arity(1)?;
                if inputs[0].dtype != DType::F32 {
                    return Err(IrError::dtype(op, "f32 (the collective reduces f32 only)", &dtypes()));
                }
                Ok(inputs[0].clone())
            }
            Op::Dequantize(format) => {
                arity(1)?;
                let w = &inputs[0];
                let cols = quant_rows(op, *format, w)?;
                let mut dims = w.shape.to_vec();
                *dims.last_mut().expect("rank checked") = cols;
                Ok(ValueType::new(dims, DType::F32))
            }
            Op::QuantMatMul(format) => {
                arity(2)?;
                let (x, w) = (&inputs[0], &inputs[1]);
                let k = quant_rows(op, *format, w)?;
                if w.shape.rank() != 2 {
                    return Err(IrError::shape(op, format!("the weight must be [n, row_bytes], got {}", w.shape)));
                }
                if x.dtype != DType::F32 || x.shape.rank() < 2 {
                    return Err(IrError::dtype(op, "x must be f32 of rank >= 2 ([.., m, k])", &dtypes()));
                }
                let xd = x.shape.dims();
                if xd[xd.len() - 1] != k {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "x {} has {} columns but the {format} weight {} holds rows of {k}",
                            x.shape,
                            xd[xd.len() - 1],
                            w.shape
                        ),
                    ));
                }
                let mut dims = xd.to_vec();
                *dims.last_mut().expect("rank checked") = w.shape.dims()[0];
                Ok(ValueType::new(dims, DType::F32))
            }
            Op::WriteAt { axis } => {
                arity(3)?;
                let (base, update, pos) = (&inputs[0], &inputs[1], &inputs[2]);
                check_axis(*axis, &base.shape)?;
                if base.dtype != update.dtype {
                    return Err(IrError::dtype(op, "base and update must have the same dtype", &dtypes()));
                }
                let fits = update.shape.rank() == base.shape.rank()
                    && base.shape.dims().iter().zip(update.shape.dims()).enumerate().all(|(d, (b, u))| {
                        if d == *axis {
                            u <= b
                        } else {
                            u == b
                        }
                    });
                if !fits {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "update {} must match base {} but along axis {axis}, where it may be shorter",
                            update.shape, base.shape
                        ),
                    ));
                }
                check_positions(op, pos, base, *axis, &dtypes)?;
                Ok(base.clone())
            }
            Op::PrefixAttention => {
                arity(5)?;
                let (q, k, v, scale, pos) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3], &inputs[4]);
                let dt = q.dtype;
                if !dt.is_float() || k.dtype != dt || v.dtype != dt || scale.dtype != dt {
                    return Err(IrError::dtype(op, "q, k, v and the scale must have one float dtype", &dtypes()));
                }
                let shapes = || format!("q {}, k {}, v {}", q.shape, k.shape, v.shape);
                if q.shape.rank() != 4 || k.shape.rank() != 4 || v.shape.rank() != 4 || scale.shape.rank() != 0 {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "expected q [b, h, t, d], k [b, g, s, d], v [b, g, s, dv], a rank-0 scale; got {}",
                            shapes()
                        ),
                    ));
                }
                let (qd, kd, vd) = (q.shape.dims(), k.shape.dims(), v.shape.dims());
                let grouped = kd[1] > 0 && qd[1].is_multiple_of(kd[1]);
                if qd[0] != kd[0] || kd[0] != vd[0] || kd[1] != vd[1] || kd[2] != vd[2] || qd[3] != kd[3] || !grouped {
                    return Err(IrError::shape(
                        op,
                        format!(
                            "batch, cache heads and lengths must agree, q heads a multiple of the cache's, head dims equal: {}",
                            shapes()
                        ),
                    ));
                }
                check_positions(op, pos, q, 2, &dtypes)?;
                Ok(ValueType::new(vec![qd[0], qd[1], qd[2], vd[3]], dt))
            }
        }
    }
}

/// The row length of a quantized weight `w` of `format` (see
/// [`crate::quant`]): `u8`, rank >= 1, whole blocks per row.
fn quant_rows(op: &str, format: QuantFormat, w: &ValueType) -> Result<usize, IrError> {
    if w.dtype != DType::U8 || w.shape.rank() == 0 {
        return Err(IrError::dtype(op, format!("a {format} weight is u8 [.., row_bytes]"), &[w.dtype]));
    }
    let row_bytes = *w.shape.dims().last().expect("rank checked");
    format.row_len(row_bytes).ok_or_else(|| {
        IrError::shape(
            op,
            format!(
                "rows of {row_bytes} bytes in {} are not whole {format} blocks of {} bytes",
                w.shape,
                format.block_bytes()
            ),
        )
    })
}

/// The positions operand of [`Op::WriteAt`] and [`Op::PrefixAttention`]:
/// an integer, rank 0 or one per row of `of`'s leading dim (then `axis`
/// may not be that dim).
fn check_positions(
    op: &str,
    pos: &ValueType,
    of: &ValueType,
    axis: usize,
    dtypes: &dyn Fn() -> Vec<DType>,
) -> Result<(), IrError> {
    if !pos.dtype.is_int() {
        return Err(IrError::dtype(op, "positions must have an integer dtype", &dtypes()));
    }
    let per_row = pos.shape.rank() == 1 && axis > 0 && pos.shape.dims()[0] == of.shape.dims()[0];
    if pos.shape.rank() != 0 && !per_row {
        return Err(IrError::shape(
            op,
            format!("positions {} must be rank 0 or one per row of {} (axis {axis} > 0)", pos.shape, of.shape),
        ));
    }
    Ok(())
}

/// Type inference of [`Op::Attention`] (see its doc for the operands).
fn infer_attention(
    op: &str,
    attrs: &AttentionAttrs,
    part: AttentionPart,
    inputs: &[ValueType],
) -> Result<ValueType, IrError> {
    let nf = attrs.forward_operands();
    let want = if part.is_grad() { nf + 3 } else { nf };
    if inputs.len() != want {
        return Err(IrError::Arity { op: op.to_string(), expected: want.to_string(), got: inputs.len() });
    }
    let dtypes: Vec<DType> = inputs.iter().map(|v| v.dtype).collect();
    let (q, k, v, scale) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
    let shapes = || format!("q {}, k {}, v {}", q.shape, k.shape, v.shape);
    let dt = q.dtype;
    if !dt.is_float() || k.dtype != dt || v.dtype != dt || scale.dtype != dt {
        return Err(IrError::dtype(op, "q, k, v and the scale must have one float dtype", &dtypes));
    }
    if scale.shape.rank() != 0 {
        return Err(IrError::shape(op, format!("the scale must be rank 0, got {}", scale.shape)));
    }
    if q.shape.rank() < 2 || k.shape.rank() < 2 || v.shape.rank() < 2 {
        return Err(IrError::shape(op, format!("q, k and v need rank >= 2 ([.., t, d]), got {}", shapes())));
    }
    let last2 = |s: &Shape| {
        let d = s.dims();
        (d[d.len() - 2], d[d.len() - 1])
    };
    let lead = |s: &Shape| Shape::new(&s.dims()[..s.rank().saturating_sub(2)]);
    let ((tq, d), (tk, dk), (tv, dv)) = (last2(&q.shape), last2(&k.shape), last2(&v.shape));
    if d != dk || tk != tv {
        return Err(IrError::shape(
            op,
            format!("q and k need the same head dim and k and v the same length, got {}", shapes()),
        ));
    }
    let bcast = |a: &Shape, b: &Shape, what: &str| {
        a.broadcast(b).ok_or_else(|| IrError::shape(op, format!("batch dims of {what} do not broadcast: {}", shapes())))
    };
    let mut batch = bcast(&lead(&q.shape), &lead(&k.shape), "q and k")?;
    batch = bcast(&batch, &lead(&v.shape), "q, k and v")?;
    if attrs.mask != AttentionMask::None {
        let m = &inputs[4];
        let ok = match attrs.mask {
            AttentionMask::Keep => m.dtype == DType::Bool,
            _ => m.dtype == dt,
        };
        if !ok {
            let kind = if attrs.mask == AttentionMask::Keep { "bool" } else { "the scores' dtype" };
            return Err(IrError::dtype(op, format!("the mask must be {kind}"), &dtypes));
        }
        // Right-aligned against [.., t_q, t_k]: the last two dims must
        // broadcast to (t_q, t_k) without changing them.
        let md = m.shape.dims();
        let r = md.len();
        let dim = |back: usize| if r >= back { md[r - back] } else { 1 };
        if !(dim(2) == 1 || dim(2) == tq) || !(dim(1) == 1 || dim(1) == tk) {
            return Err(IrError::shape(
                op,
                format!("mask {} does not broadcast to the scores [.., {tq}, {tk}] of {}", m.shape, shapes()),
            ));
        }
        batch = bcast(&batch, &lead(&m.shape), "the mask and q, k, v")?;
    }
    let with = |tail: &[usize]| -> Shape { batch.dims().iter().chain(tail).copied().collect() };
    if part.is_grad() {
        let (go, lse, delta) = (&inputs[nf], &inputs[nf + 1], &inputs[nf + 2]);
        if go.dtype != dt || lse.dtype != dt || delta.dtype != dt {
            return Err(IrError::dtype(op, "dO, the log-sum-exp and delta must have the dtype of q", &dtypes));
        }
        let (want_o, want_row) = (with(&[tq, dv]), with(&[tq]));
        if go.shape != want_o || lse.shape != want_row || delta.shape != want_row {
            return Err(IrError::shape(
                op,
                format!(
                    "expected dO {want_o}, log-sum-exp and delta {want_row}, got {}, {} and {} ({})",
                    go.shape,
                    lse.shape,
                    delta.shape,
                    shapes()
                ),
            ));
        }
    }
    let shape = match part {
        AttentionPart::Out => with(&[tq, dv]),
        AttentionPart::LogSumExp => with(&[tq]),
        AttentionPart::GradQ => with(&[tq, d]),
        AttentionPart::GradK => with(&[tk, d]),
        AttentionPart::GradV => with(&[tk, dv]),
    };
    Ok(ValueType::new(shape, dt))
}

fn broadcast(op: &str, a: &Shape, b: &Shape) -> Result<Shape, IrError> {
    a.broadcast(b).ok_or_else(|| IrError::Broadcast { op: op.to_string(), lhs: a.clone(), rhs: b.clone() })
}

fn check_axes(op: &str, axes: &[usize], shape: &Shape) -> Result<(), IrError> {
    for (i, &a) in axes.iter().enumerate() {
        if a >= shape.rank() {
            return Err(IrError::Axis {
                op: op.to_string(),
                axis: a as isize,
                shape: shape.clone(),
                rank: shape.rank(),
            });
        }
        if i > 0 && axes[i - 1] >= a {
            return Err(IrError::shape(op, format!("axes {axes:?} must be sorted and unique")));
        }
    }
    Ok(())
}

/// The shape left after reducing `axes` of `shape`.
pub fn reduced_shape(shape: &Shape, axes: &[usize], keepdim: bool) -> Shape {
    let mut dims = Vec::with_capacity(shape.rank());
    for (i, &d) in shape.dims().iter().enumerate() {
        if axes.contains(&i) {
            if keepdim {
                dims.push(1);
            }
        } else {
            dims.push(d);
        }
    }
    Shape::from(dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vt(dims: &[usize], d: DType) -> ValueType {
        ValueType::new(dims, d)
    }

    #[test]
    fn logaddexp_takes_floats_and_broadcasts() {
        let op = Op::Binary(BinaryOp::LogAddExp);
        let t = op.infer(&[vt(&[2, 3], DType::F32), vt(&[3], DType::F32)], &[], &[]).unwrap();
        assert_eq!(t, vt(&[2, 3], DType::F32));
        let e = op.infer(&[vt(&[2], DType::I32), vt(&[2], DType::I32)], &[], &[]).unwrap_err();
        assert!(e.to_string().contains("logaddexp"), "{e}");
    }

    #[test]
    fn binary_broadcast_error_names_op_and_shapes() {
        let e =
            Op::Binary(BinaryOp::Add).infer(&[vt(&[2, 3], DType::F32), vt(&[4], DType::F32)], &[], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("add") && msg.contains("[2, 3]") && msg.contains("[4]"), "{msg}");
    }

    #[test]
    fn dtype_mismatch_names_dtypes() {
        let e = Op::Binary(BinaryOp::Mul).infer(&[vt(&[2], DType::F32), vt(&[2], DType::I32)], &[], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("mul") && msg.contains("f32") && msg.contains("i32"), "{msg}");
    }

    #[test]
    fn matmul_batch_broadcast() {
        let t = Op::MatMul.infer(&[vt(&[2, 1, 3, 4], DType::F32), vt(&[5, 4, 6], DType::F32)], &[], &[]).unwrap();
        assert_eq!(t.shape, Shape::new([2, 5, 3, 6]));
    }

    #[test]
    fn slice_with_negative_step() {
        let op = Op::Slice { starts: vec![4], steps: vec![-2], lens: vec![3] };
        assert_eq!(op.infer(&[vt(&[5], DType::F32)], &[], &[]).unwrap().shape, Shape::new([3]));
        let bad = Op::Slice { starts: vec![4], steps: vec![-2], lens: vec![4] };
        assert!(bad.infer(&[vt(&[5], DType::F32)], &[], &[]).is_err());
    }

    #[test]
    fn conv_and_pool_attributes_never_overflow() {
        let x = vt(&[1, 2, 5, 5], DType::F32);
        let w = vt(&[2, 1, 3, 3], DType::F32);
        let huge = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], groups: usize::MAX };
        assert!(Op::Conv2d(huge).infer(&[x.clone(), w.clone()], &[], &[]).is_err());
        let dil = ConvAttrs { strides: [1, 1], pads: [usize::MAX, 0, 1, 0], dilations: [usize::MAX, 1], groups: 2 };
        assert!(Op::Conv2d(dil).infer(&[x.clone(), w], &[], &[]).is_err());
        let empty_kernel = vt(&[2, 1, 0, 3], DType::F32);
        let c = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], groups: 2 };
        assert!(Op::Conv2d(c).infer(&[x.clone(), empty_kernel], &[], &[]).is_err());
        let p = PoolAttrs {
            kind: PoolKind::Max,
            kernel: vec![usize::MAX, 2],
            strides: vec![1, 1],
            pads_begin: vec![usize::MAX, 0],
            pads_end: vec![1, 0],
            dilations: vec![usize::MAX, 1],
            ceil_mode: false,
        };
        assert!(Op::Pool(p).infer(&[x], &[], &[]).is_err());
    }

    #[test]
    fn conv_and_pool_defaults() {
        let x = vt(&[2, 3, 6, 5], DType::F32);
        let w = vt(&[4, 3, 3, 3], DType::F32);
        let y = Op::Conv2d(ConvAttrs::default()).infer(&[x.clone(), w], &[], &[]).unwrap();
        assert_eq!(y.shape, Shape::new([2, 4, 4, 3]));
        let p = Op::Pool(PoolAttrs::default()).infer(std::slice::from_ref(&x), &[], &[]).unwrap();
        assert_eq!(p.shape, Shape::new([2, 3, 3, 2]));
        let a = PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[3, 3])
            .with_strides(&[1, 1])
            .with_padding(&[1, 1]);
        assert_eq!(Op::Pool(a).infer(&[x], &[], &[]).unwrap().shape, Shape::new([2, 3, 6, 5]));
    }

    #[test]
    fn all_reduce_keeps_its_type_and_takes_f32_only() {
        let op = Op::AllReduce { op: CollectiveOp::Mean, bucket: 3 };
        let x = vt(&[4, 5], DType::F32);
        assert_eq!(op.infer(std::slice::from_ref(&x), &[], &[]).unwrap(), x);
        assert!(op.is_collective() && !op.is_elementwise());
        let err = op.infer(&[vt(&[4], DType::F16)], &[], &[]).unwrap_err();
        assert!(matches!(err, IrError::DType { ref op, .. } if op == "all_reduce_mean"), "{err:?}");
        assert!(matches!(op.infer(&[], &[], &[]), Err(IrError::Arity { .. })));
    }

    fn attn(causal: bool, mask: AttentionMask, part: AttentionPart) -> Op {
        Op::Attention { attrs: AttentionAttrs { causal, mask }, part }
    }

    #[test]
    fn attention_parts_have_the_broadcast_batch_shapes() {
        let f = DType::F32;
        // q [2, 3, 5, 8], k [1, 3, 7, 8], v [2, 1, 7, 4], mask [2, 1, 1, 7].
        let fwd = [vt(&[2, 3, 5, 8], f), vt(&[1, 3, 7, 8], f), vt(&[2, 1, 7, 4], f), vt(&[], f), vt(&[2, 1, 1, 7], f)];
        let shape = |part: AttentionPart, ins: &[ValueType]| {
            attn(true, AttentionMask::Additive, part).infer(ins, &[], &[]).unwrap().shape
        };
        assert_eq!(shape(AttentionPart::Out, &fwd), Shape::new([2, 3, 5, 4]));
        assert_eq!(shape(AttentionPart::LogSumExp, &fwd), Shape::new([2, 3, 5]));
        let mut grad = fwd.to_vec();
        grad.extend([vt(&[2, 3, 5, 4], f), vt(&[2, 3, 5], f), vt(&[2, 3, 5], f)]);
        assert_eq!(shape(AttentionPart::GradQ, &grad), Shape::new([2, 3, 5, 8]));
        assert_eq!(shape(AttentionPart::GradK, &grad), Shape::new([2, 3, 7, 8]));
        assert_eq!(shape(AttentionPart::GradV, &grad), Shape::new([2, 3, 7, 4]));
        // A mask may extend the batch and have fewer dims than two.
        let ins = [vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[], f), vt(&[3, 1, 7], DType::Bool)];
        let t = attn(false, AttentionMask::Keep, AttentionPart::Out).infer(&ins, &[], &[]).unwrap();
        assert_eq!(t.shape, Shape::new([3, 5, 4]));
        let ins = [vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[], f), vt(&[7], f)];
        assert!(attn(false, AttentionMask::Additive, AttentionPart::Out).infer(&ins, &[], &[]).is_ok());
    }

    #[test]
    fn attention_errors_name_the_op_shapes_and_dtypes() {
        let f = DType::F32;
        let err = |op: Op, ins: &[ValueType]| op.infer(ins, &[], &[]).unwrap_err().to_string();
        let out = attn(false, AttentionMask::None, AttentionPart::Out);
        let e = err(out.clone(), &[vt(&[5, 8], f), vt(&[7, 6], f), vt(&[7, 4], f), vt(&[], f)]);
        assert!(e.contains("attention") && e.contains("[5, 8]") && e.contains("[7, 6]"), "{e}");
        let e = err(out.clone(), &[vt(&[5, 8], f), vt(&[7, 8], f), vt(&[6, 4], f), vt(&[], f)]);
        assert!(e.contains("same length") && e.contains("[6, 4]"), "{e}");
        let e = err(out.clone(), &[vt(&[5, 8], f), vt(&[7, 8], DType::F64), vt(&[7, 4], f), vt(&[], f)]);
        assert!(e.contains("f32") && e.contains("f64"), "{e}");
        let e = err(
            out.clone(),
            &[vt(&[5, 8], DType::I32), vt(&[7, 8], DType::I32), vt(&[7, 4], DType::I32), vt(&[], DType::I32)],
        );
        assert!(e.contains("float"), "{e}");
        let e = err(out.clone(), &[vt(&[2, 5, 8], f), vt(&[3, 7, 8], f), vt(&[7, 4], f), vt(&[], f)]);
        assert!(e.contains("broadcast") && e.contains("[2, 5, 8]") && e.contains("[3, 7, 8]"), "{e}");
        let e = err(out.clone(), &[vt(&[8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[], f)]);
        assert!(e.contains("rank"), "{e}");
        let e = err(out.clone(), &[vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[1], f)]);
        assert!(e.contains("scale"), "{e}");
        let e = err(out, &[vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f)]);
        assert!(e.contains("expected 4 operands"), "{e}");
        // Masks: the kind's dtype, and no growth of t_q or t_k.
        let masked = |m: ValueType, kind| {
            err(attn(false, kind, AttentionPart::Out), &[vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[], f), m])
        };
        let e = masked(vt(&[5, 7], DType::I32), AttentionMask::Additive);
        assert!(e.contains("mask") && e.contains("i32"), "{e}");
        let e = masked(vt(&[5, 7], f), AttentionMask::Keep);
        assert!(e.contains("mask") && e.contains("bool"), "{e}");
        let e = masked(vt(&[6, 7], f), AttentionMask::Additive);
        assert!(e.contains("mask [6, 7]") && e.contains("[.., 5, 7]"), "{e}");
        // Gradient operands must have the output's shapes.
        let mut grad = vec![vt(&[5, 8], f), vt(&[7, 8], f), vt(&[7, 4], f), vt(&[], f)];
        grad.extend([vt(&[5, 4], f), vt(&[5], f), vt(&[4], f)]);
        let e = err(attn(false, AttentionMask::None, AttentionPart::GradK), &grad);
        assert!(e.contains("delta") && e.contains("[4]"), "{e}");
    }

    #[test]
    fn scatter_add_types() {
        let op = Op::ScatterAdd { axis: 1 };
        let base = vt(&[2, 5, 3], DType::F32);
        let t = op.infer(&[base.clone(), vt(&[4, 2], DType::I64), vt(&[2, 4, 2, 3], DType::F32)], &[], &[]).unwrap();
        assert_eq!(t, base);
        // src must be base with dim 1 replaced by the indices' dims.
        let e = op.infer(&[base.clone(), vt(&[4], DType::I32), vt(&[2, 3, 3], DType::F32)], &[], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("scatter_add") && msg.contains("[2, 3, 3]") && msg.contains("[2, 4, 3]"), "{msg}");
        assert!(op.infer(&[base.clone(), vt(&[4], DType::F32), vt(&[2, 4, 3], DType::F32)], &[], &[]).is_err());
        assert!(op.infer(&[base.clone(), vt(&[4], DType::I32), vt(&[2, 4, 3], DType::I32)], &[], &[]).is_err());
        let bad_axis = Op::ScatterAdd { axis: 3 };
        assert!(bad_axis.infer(&[base.clone(), vt(&[4], DType::I32), vt(&[2, 4, 3], DType::F32)], &[], &[]).is_err());
        assert!(op
            .infer(&[vt(&[2, 5], DType::Bool), vt(&[1], DType::I32), vt(&[2, 1], DType::Bool)], &[], &[])
            .is_err());
    }

    #[test]
    fn pool_grad_types() {
        let p = PoolAttrs::new(PoolKind::Max, &[2, 2]);
        let x = vt(&[1, 2, 5, 4], DType::F32);
        let g = vt(&[1, 2, 2, 2], DType::F32);
        assert_eq!(Op::PoolGrad(p.clone()).infer(&[x.clone(), g], &[], &[]).unwrap(), x);
        let e = Op::PoolGrad(p.clone()).infer(&[x.clone(), vt(&[1, 2, 3, 2], DType::F32)], &[], &[]).unwrap_err();
        assert!(e.to_string().contains("max_pool_grad") && e.to_string().contains("[1, 2, 2, 2]"), "{e}");
        let xi = vt(&[1, 2, 5, 4], DType::I32);
        assert!(Op::PoolGrad(p).infer(&[xi, vt(&[1, 2, 2, 2], DType::I32)], &[], &[]).is_err());
    }

    #[test]
    fn pool_ceil_mode() {
        let p = PoolAttrs {
            kind: PoolKind::Max,
            kernel: vec![3, 3],
            strides: vec![2, 2],
            pads_begin: vec![0, 0],
            pads_end: vec![0, 0],
            dilations: vec![1, 1],
            ceil_mode: true,
        };
        let t = Op::Pool(p).infer(&[vt(&[1, 1, 4, 4], DType::F32)], &[], &[]).unwrap();
        assert_eq!(t.shape, Shape::new([1, 1, 2, 2]));
    }
}
