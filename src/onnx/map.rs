//! Maps one ONNX node (operator type, attributes, opset, inputs) onto
//! Lazuli ops through the public [`Tensor`] API: [`lower`].
//!
//! Most ONNX operators are one Lazuli op; the rest are composites (Elu,
//! Selu, Softplus, Gemm, Einsum, Tile, Trilu, LayerNormalization, ...).
//! Results get the dtype ONNX specifies (e.g. `ArgMax` is `i64` in ONNX and
//! `i32` in Lazuli, so it is cast). Inputs that determine a shape (`axes`,
//! `pads`, `shape`, `repeats`, Slice bounds, Range bounds, ...) are read on
//! the host from the case, as a graph compiler constant-folds them: a lazy
//! engine must know every shape when it records an op.
//!
//! What Lazuli cannot express is a typed [`MapError::Unsupported`] with the
//! reason; a node that breaks the ONNX rules (a missing required input, an
//! axis out of range) is [`MapError::Invalid`]. Neither panics.

use super::case::{Attr, Case, TensorData};
use crate::{Device, ExecError, Tensor};
use lazuli_ir::{
    ArgReduceOp, BinaryOp, ConvAttrs, DType, Op, PadMode, PoolAttrs, PoolKind, ReduceOp, ScalarValue, Shape, UnaryOp,
};
use thiserror::Error;

/// Why a node could not be lowered.
#[derive(Debug, Error)]
pub enum MapError {
    /// Lazuli cannot express this operator, attribute or dtype.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The node breaks the ONNX operator's own rules.
    #[error("invalid node: {0}")]
    Invalid(String),
    /// Lazuli rejected an op it was expected to accept.
    #[error(transparent)]
    Exec(#[from] ExecError),
}

type R<T> = Result<T, MapError>;

fn unsupported<T>(why: impl Into<String>) -> R<T> {
    Err(MapError::Unsupported(why.into()))
}

fn invalid<T>(why: impl Into<String>) -> R<T> {
    Err(MapError::Invalid(why.into()))
}

/// The ONNX operators [`lower`] knows, in alphabetical order.
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "ArgMax",
    "ArgMin",
    "AveragePool",
    "BatchNormalization",
    "Cast",
    "Ceil",
    "Clip",
    "Concat",
    "ConstantOfShape",
    "Conv",
    "Cos",
    "CumSum",
    "Div",
    "Dropout",
    "Einsum",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "Gather",
    "Gelu",
    "Gemm",
    "Greater",
    "GreaterOrEqual",
    "HardSigmoid",
    "Identity",
    "IsInf",
    "IsNaN",
    "LayerNormalization",
    "LeakyRelu",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "MaxPool",
    "Mean",
    "Min",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "Pad",
    "Pow",
    "Range",
    "Reciprocal",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "Round",
    "Selu",
    "Shape",
    "Sigmoid",
    "Sign",
    "Sin",
    "Size",
    "Slice",
    "Softmax",
    "Softplus",
    "Softsign",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "Tile",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "Xor",
];

/// Records the ONNX node `op` of `case` on `device` and returns its outputs
/// in ONNX slot order (at least as many as the case lists). Nothing is
/// synced here.
pub fn lower(op: &str, case: &Case, device: &Device) -> Result<Vec<Tensor>, MapError> {
    let node = Node { op, case, dev: device };
    let outs = node.lower()?;
    if outs.len() < case.outputs.len() {
        return unsupported(format!(
            "{op} produces {} output(s) here, the case checks {}",
            outs.len(),
            case.outputs.len()
        ));
    }
    Ok(outs)
}

/// The ONNX `TensorProto.DataType` code of a dtype Lazuli has, if any.
pub fn dtype_from_onnx(code: i64) -> Result<DType, MapError> {
    Ok(match code {
        1 => DType::F32,
        2 => DType::U8,
        3 => DType::I8,
        4 => DType::U16,
        5 => DType::I16,
        6 => DType::I32,
        7 => DType::I64,
        9 => DType::Bool,
        10 => DType::F16,
        11 => DType::F64,
        12 => DType::U32,
        13 => DType::U64,
        8 => return unsupported("string tensors are outside a numeric tensor engine"),
        14 | 15 => return unsupported("complex dtypes are not Lazuli dtypes"),
        16 => DType::BF16,
        17..=20 | 23 => return unsupported("float8 / float4 dtypes are not Lazuli dtypes"),
        21 | 22 | 25..=27 => return unsupported("4-bit and 2-bit integer dtypes are not Lazuli dtypes"),
        other => return invalid(format!("unknown ONNX dtype code {other}")),
    })
}

struct Node<'a> {
    op: &'a str,
    case: &'a Case,
    dev: &'a Device,
}

fn one(t: Tensor) -> R<Vec<Tensor>> {
    Ok(vec![t])
}

fn isz(v: &[i64]) -> Vec<isize> {
    v.iter().map(|&a| a as isize).collect()
}

impl<'a> Node<'a> {
    // ---- inputs and attributes -------------------------------------------

    fn data(&self, i: usize) -> Option<&'a TensorData> {
        self.case.inputs.get(i).and_then(Option::as_ref)
    }

    fn upload(&self, d: &TensorData) -> R<Tensor> {
        Ok(Tensor::from_bytes(d.to_bytes(), d.ty(), self.dev)?)
    }

    fn input(&self, i: usize) -> R<Tensor> {
        match self.data(i) {
            Some(d) => self.upload(d),
            None => invalid(format!("{} needs input {i}", self.op)),
        }
    }

    fn opt_input(&self, i: usize) -> R<Option<Tensor>> {
        self.data(i).map(|d| self.upload(d)).transpose()
    }

    /// Every present input (for variadic ops).
    fn all_inputs(&self) -> R<Vec<Tensor>> {
        self.case.inputs.iter().flatten().map(|d| self.upload(d)).collect()
    }

    /// A shape-like input read on the host.
    fn host_ints(&self, i: usize) -> Option<Vec<i64>> {
        self.data(i).map(TensorData::to_i64s)
    }

    fn attr(&self, name: &str) -> Option<&'a Attr> {
        self.case.attrs.get(name)
    }

    fn int(&self, name: &str, default: i64) -> R<i64> {
        match self.attr(name) {
            None => Ok(default),
            Some(Attr::Int(v)) => Ok(*v),
            Some(a) => invalid(format!("attribute {name} is {}, expected INT", a.kind())),
        }
    }

    fn float(&self, name: &str, default: f64) -> R<f64> {
        match self.attr(name) {
            None => Ok(default),
            Some(Attr::Float(v)) => Ok(*v),
            Some(Attr::Int(v)) => Ok(*v as f64),
            Some(a) => invalid(format!("attribute {name} is {}, expected FLOAT", a.kind())),
        }
    }

    fn string(&self, name: &str, default: &str) -> R<String> {
        match self.attr(name) {
            None => Ok(default.to_string()),
            Some(Attr::String(v)) => Ok(v.clone()),
            Some(a) => invalid(format!("attribute {name} is {}, expected STRING", a.kind())),
        }
    }

    fn ints(&self, name: &str) -> R<Option<Vec<i64>>> {
        match self.attr(name) {
            None => Ok(None),
            Some(Attr::Ints(v)) => Ok(Some(v.clone())),
            Some(Attr::Floats(v)) if v.is_empty() => Ok(Some(vec![])),
            Some(a) => invalid(format!("attribute {name} is {}, expected INTS", a.kind())),
        }
    }

    /// `axes` as input `i` from opset `since` on, else as an attribute.
    fn axes(&self, i: usize, since: i64) -> R<Option<Vec<i64>>> {
        if self.case.opset >= since {
            Ok(self.host_ints(i))
        } else {
            self.ints("axes")
        }
    }

    fn scalar(&self, v: impl Into<ScalarValue>, dtype: DType) -> Tensor {
        Tensor::scalar(v, dtype, self.dev)
    }

    fn norm_axis(&self, axis: i64, rank: usize) -> R<usize> {
        let r = rank as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if (0..r).contains(&a) {
            Ok(a as usize)
        } else {
            invalid(format!("{}: axis {axis} out of range for rank {rank}", self.op))
        }
    }

    // ---- dispatch ----------------------------------------------------------

    fn lower(&self) -> R<Vec<Tensor>> {
        use BinaryOp as B;
        use UnaryOp as U;
        match self.op {
            "Abs" => self.unary(U::Abs),
            "Neg" => self.unary(U::Neg),
            "Exp" => self.unary(U::Exp),
            "Log" => self.unary(U::Log),
            "Sqrt" => self.unary(U::Sqrt),
            "Reciprocal" => self.unary(U::Reciprocal),
            "Sigmoid" => self.unary(U::Sigmoid),
            "Tanh" => self.unary(U::Tanh),
            "Relu" => self.unary(U::Relu),
            "Erf" => self.unary(U::Erf),
            "Sin" => self.unary(U::Sin),
            "Cos" => self.unary(U::Cos),
            "Floor" => self.unary(U::Floor),
            "Ceil" => self.unary(U::Ceil),
            "Round" => self.unary(U::Round),
            "Sign" => self.unary(U::Sign),
            "Not" => self.unary(U::Not),
            "IsNaN" => self.unary(U::IsNan),
            "IsInf" => self.is_inf(),
            "Add" => self.binary(B::Add),
            "Sub" => self.binary(B::Sub),
            "Mul" => self.binary(B::Mul),
            "Div" => self.binary(B::Div),
            "Equal" => self.binary(B::Eq),
            "Less" => self.binary(B::Lt),
            "LessOrEqual" => self.binary(B::Le),
            "Greater" => self.binary(B::Gt),
            "GreaterOrEqual" => self.binary(B::Ge),
            "And" => self.binary(B::And),
            "Or" => self.binary(B::Or),
            "Xor" => self.binary(B::Xor),
            "Max" => self.variadic(B::Maximum),
            "Min" => self.variadic(B::Minimum),
            "Sum" => self.variadic(B::Add),
            "Mean" => self.mean(),
            "Mod" => self.modulo(),
            "Pow" => self.pow(),
            "Where" => one(self.input(0)?.where_(&self.input(1)?, &self.input(2)?)?),
            "Cast" => one(self.input(0)?.cast(dtype_from_onnx(self.int("to", 1)?)?)?),
            "Identity" => one(self.input(0)?),
            "Dropout" => self.dropout(),
            "LeakyRelu" => self.leaky_relu(),
            "Elu" => self.elu(),
            "Selu" => self.selu(),
            "Softplus" => self.softplus(),
            "Softsign" => self.softsign(),
            "HardSigmoid" => self.hard_sigmoid(),
            "Gelu" => self.gelu(),
            "Clip" => self.clip(),
            "MatMul" => one(self.input(0)?.matmul(&self.input(1)?)?),
            "Gemm" => self.gemm(),
            "Einsum" => self.einsum(),
            "ReduceSum" => self.reduce(ReduceOp::Sum, 13, Post::None),
            "ReduceMean" => self.reduce(ReduceOp::Mean, 18, Post::None),
            "ReduceMax" => self.reduce(ReduceOp::Max, 18, Post::None),
            "ReduceMin" => self.reduce(ReduceOp::Min, 18, Post::None),
            "ReduceProd" => self.reduce(ReduceOp::Prod, 18, Post::None),
            "ReduceL1" => self.reduce(ReduceOp::Sum, 18, Post::Abs),
            "ReduceL2" => self.reduce(ReduceOp::Sum, 18, Post::Square),
            "ReduceSumSquare" => self.reduce(ReduceOp::Sum, 18, Post::SumSquare),
            "ReduceLogSumExp" => self.reduce(ReduceOp::Sum, 18, Post::LogSumExp),
            "ArgMax" => self.arg_reduce(ArgReduceOp::ArgMax),
            "ArgMin" => self.arg_reduce(ArgReduceOp::ArgMin),
            "Softmax" => self.softmax(false),
            "LogSoftmax" => self.softmax(true),
            "CumSum" => self.cumsum(),
            "Transpose" => self.transpose(),
            "Reshape" => self.reshape(),
            "Flatten" => self.flatten(),
            "Squeeze" => self.squeeze(),
            "Unsqueeze" => self.unsqueeze(),
            "Expand" => self.expand(),
            "Concat" => {
                let xs = self.all_inputs()?;
                let refs: Vec<&Tensor> = xs.iter().collect();
                let axis = self.int("axis", 0)?;
                one(Tensor::concat(&refs, axis as isize)?)
            }
            "Slice" => self.slice(),
            "Gather" => one(self.input(0)?.gather(self.int("axis", 0)? as isize, &self.input(1)?)?),
            "Tile" => self.tile(),
            "Pad" => self.pad(),
            "Trilu" => self.trilu(),
            "Range" => self.range(),
            "ConstantOfShape" => self.constant_of_shape(),
            "Shape" => self.shape_op(),
            "Size" => {
                let d = self.data(0).ok_or_else(|| MapError::Invalid("Size needs input 0".into()))?;
                let n = d.shape.iter().product::<usize>() as i64;
                one(Tensor::from_slice(&[n], Shape::scalar(), self.dev)?)
            }
            "LayerNormalization" => self.layer_norm(),
            "BatchNormalization" => self.batch_norm(),
            "Conv" => self.conv(),
            "MaxPool" => self.pool(true),
            "AveragePool" => self.pool(false),
            other => unsupported(format!("no mapping for ONNX operator {other}")),
        }
    }

    // ---- elementwise -------------------------------------------------------

    fn unary(&self, u: UnaryOp) -> R<Vec<Tensor>> {
        one(Tensor::record(Op::Unary(u), &[&self.input(0)?])?)
    }

    fn binary(&self, b: BinaryOp) -> R<Vec<Tensor>> {
        one(Tensor::record(Op::Binary(b), &[&self.input(0)?, &self.input(1)?])?)
    }

    fn variadic(&self, b: BinaryOp) -> R<Vec<Tensor>> {
        let xs = self.all_inputs()?;
        let Some((first, rest)) = xs.split_first() else { return invalid(format!("{} needs an input", self.op)) };
        let mut acc = first.clone();
        for x in rest {
            acc = Tensor::record(Op::Binary(b), &[&acc, x])?;
        }
        one(acc)
    }

    fn mean(&self) -> R<Vec<Tensor>> {
        let n = self.case.inputs.iter().flatten().count();
        let sum = self.variadic(BinaryOp::Add)?.remove(0);
        let d = sum.dtype();
        one(sum.div(&self.scalar(n as f64, d))?)
    }

    fn is_inf(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let (pos, neg) = (self.int("detect_positive", 1)? != 0, self.int("detect_negative", 1)? != 0);
        let d = x.dtype();
        let out = match (pos, neg) {
            (true, true) => x.isinf()?,
            (true, false) => x.eq(&self.scalar(f64::INFINITY, d))?,
            (false, true) => x.eq(&self.scalar(f64::NEG_INFINITY, d))?,
            (false, false) => Tensor::full(x.shape().clone(), false, DType::Bool, self.dev)?,
        };
        one(out)
    }

    fn modulo(&self) -> R<Vec<Tensor>> {
        let (a, b) = (self.input(0)?, self.input(1)?);
        let fmod = self.int("fmod", 0)? != 0;
        if !fmod && a.dtype().is_float() {
            return invalid("Mod with fmod=0 is not defined for floats");
        }
        one(if fmod { a.rem(&b)? } else { a.modulo(&b)? })
    }

    /// ONNX Pow: the result has the base's dtype; the exponent may have
    /// another dtype.
    fn pow(&self) -> R<Vec<Tensor>> {
        let (x, y) = (self.input(0)?, self.input(1)?);
        let (dx, dy) = (x.dtype(), y.dtype());
        if dx.is_float() || !dy.is_float() {
            return one(x.pow(&y.cast(dx)?)?);
        }
        // An integer base with a float exponent: like numpy, compute in
        // double precision and convert back (truncating).
        one(x.cast(DType::F64)?.pow(&y.cast(DType::F64)?)?.cast(dx)?)
    }

    fn dropout(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let training = if self.case.opset >= 12 {
            self.data(2).map(|d| d.data.first().is_some_and(|v| v.as_bool())).unwrap_or(false)
        } else {
            self.case.opset < 7 && self.int("is_test", 0)? == 0
        };
        if training {
            return unsupported("Dropout in training mode draws a random mask the ONNX data cannot check");
        }
        let mask = Tensor::full(x.shape().clone(), true, DType::Bool, self.dev)?;
        Ok(vec![x, mask])
    }

    fn leaky_relu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let alpha = self.scalar(self.float("alpha", 0.01)?, x.dtype());
        let zero = self.scalar(0, x.dtype());
        one(x.lt(&zero)?.where_(&x.mul(&alpha)?, &x)?)
    }

    fn elu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let alpha = self.scalar(self.float("alpha", 1.0)?, d);
        let neg = x.exp()?.sub(&self.scalar(1, d))?.mul(&alpha)?;
        one(x.lt(&self.scalar(0, d))?.where_(&neg, &x)?)
    }

    fn selu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let alpha = self.scalar(self.float("alpha", 1.673_263_192_176_818_8)?, d);
        let gamma = self.scalar(self.float("gamma", 1.050_701_022_148_132_3)?, d);
        let neg = x.exp()?.mul(&alpha)?.sub(&alpha)?;
        one(x.le(&self.scalar(0, d))?.where_(&neg, &x)?.mul(&gamma)?)
    }

    /// `log(1 + e^x)`, as `relu(x) + log(1 + e^-|x|)` so large `x` does not overflow.
    fn softplus(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let tail = x.abs()?.neg()?.exp()?.add(&self.scalar(1, d))?.log()?;
        one(x.relu()?.add(&tail)?)
    }

    fn softsign(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        one(x.div(&x.abs()?.add(&self.scalar(1, d))?)?)
    }

    fn hard_sigmoid(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let (alpha, beta) = (self.float("alpha", 0.2)?, self.float("beta", 0.5)?);
        let d = x.dtype();
        one(x.mul(&self.scalar(alpha, d))?.add(&self.scalar(beta, d))?.clamp(Some(0.0), Some(1.0))?)
    }

    fn gelu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        match self.string("approximate", "none")?.as_str() {
            "none" => one(x.gelu()?),
            "tanh" => one(x.gelu_tanh()?),
            other => invalid(format!("Gelu approximate={other:?}")),
        }
    }

    fn clip(&self) -> R<Vec<Tensor>> {
        let mut x = self.input(0)?;
        let d = x.dtype();
        let (lo, hi) = if self.case.opset >= 11 {
            (self.opt_input(1)?, self.opt_input(2)?)
        } else {
            let lo = self.attr("min").map(|_| self.float("min", 0.0)).transpose()?;
            let hi = self.attr("max").map(|_| self.float("max", 0.0)).transpose()?;
            (lo.map(|v| self.scalar(v, d)), hi.map(|v| self.scalar(v, d)))
        };
        if let Some(lo) = lo {
            x = x.maximum(&lo.reshape_to(Shape::scalar())?)?;
        }
        if let Some(hi) = hi {
            x = x.minimum(&hi.reshape_to(Shape::scalar())?)?;
        }
        one(x)
    }

    // ---- linear algebra ----------------------------------------------------

    fn gemm(&self) -> R<Vec<Tensor>> {
        let (mut a, mut b) = (self.input(0)?, self.input(1)?);
        if self.int("transA", 0)? != 0 {
            a = a.t()?;
        }
        if self.int("transB", 0)? != 0 {
            b = b.t()?;
        }
        let d = a.dtype();
        let (alpha, beta) = (self.float("alpha", 1.0)?, self.float("beta", 1.0)?);
        let mut y = a.matmul(&b)?;
        if alpha != 1.0 {
            y = y.mul(&self.scalar(alpha, d))?;
        }
        if let Some(mut c) = self.opt_input(2)? {
            if beta != 1.0 {
                c = c.mul(&self.scalar(beta, d))?;
            }
            y = y.add(&c)?;
        }
        one(y)
    }

    fn einsum(&self) -> R<Vec<Tensor>> {
        let eq = self.string("equation", "")?;
        let xs = self.all_inputs()?;
        // The public einsum (batched matmuls, nothing materialized beyond
        // each pair's product) where it applies; the general product below
        // for what it refuses (ellipses, diagonals, broadcast 1s).
        let refs: Vec<&Tensor> = xs.iter().collect();
        match Tensor::einsum(&eq, &refs) {
            Ok(t) => one(t),
            Err(_) => one(einsum(&eq, &xs)?),
        }
    }

    // ---- reductions --------------------------------------------------------

    fn reduce(&self, r: ReduceOp, axes_input_since: i64, post: Post) -> R<Vec<Tensor>> {
        let mut x = self.input(0)?;
        let keep = self.int("keepdims", 1)? != 0;
        let noop = self.int("noop_with_empty_axes", 0)? != 0;
        let axes = match self.axes(1, axes_input_since)? {
            Some(a) if !a.is_empty() => a,
            _ if noop => {
                // ONNX: the input is returned unchanged (after the
                // elementwise prologue of the composite reductions).
                return one(match post {
                    Post::Abs => x.abs()?,
                    Post::SumSquare => x.mul(&x)?,
                    _ => x,
                });
            }
            _ => (0..x.rank() as i64).collect(),
        };
        let axes = isz(&axes);
        let d = x.dtype();
        match post {
            Post::None => {}
            Post::Abs => x = x.abs()?,
            Post::Square | Post::SumSquare => x = x.mul(&x)?,
            Post::LogSumExp => {
                let m = x.reduce_axes(ReduceOp::Max, &axes, true)?;
                let s = x.sub(&m)?.exp()?.reduce_axes(ReduceOp::Sum, &axes, true)?.log()?.add(&m)?;
                return one(if keep { s } else { s.squeeze(&axes)? });
            }
        }
        let out = if r == ReduceOp::Mean && !d.is_float() {
            // Integer mean: like the ONNX reference, a float mean truncated back.
            x.cast(DType::F64)?.reduce_axes(r, &axes, keep)?.cast(d)?
        } else {
            x.reduce_axes(r, &axes, keep)?
        };
        one(if post == Post::Square { out.sqrt()? } else { out })
    }

    fn arg_reduce(&self, op: ArgReduceOp) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let axis = self.int("axis", 0)? as isize;
        let keep = self.int("keepdims", 1)? != 0;
        let last = self.int("select_last_index", 0)? != 0;
        one(x.arg_reduce(op, axis, keep, last)?.cast(DType::I64)?)
    }

    fn softmax(&self, log: bool) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let f = |t: &Tensor, axis: isize| if log { t.log_softmax(axis) } else { t.softmax(axis) };
        if self.case.opset >= 13 {
            return one(f(&x, self.int("axis", -1)? as isize)?);
        }
        // Before opset 13 the input is coerced to 2-D at `axis` (default 1).
        let axis = self.norm_axis(self.int("axis", 1)?, x.rank().max(1))?;
        let (outer, inner): (usize, usize) = (x.dims()[..axis].iter().product(), x.dims()[axis..].iter().product());
        let y = f(&x.reshape_to([outer, inner])?, 1)?;
        one(y.reshape_to(x.shape().clone())?)
    }

    fn cumsum(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let axis = self.host_ints(1).and_then(|v| v.first().copied()).unwrap_or(0);
        let exclusive = self.int("exclusive", 0)? != 0;
        let reverse = self.int("reverse", 0)? != 0;
        one(x.cumsum(axis as isize, exclusive, reverse)?)
    }

    // ---- shapes and views --------------------------------------------------

    fn transpose(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let perm = match self.ints("perm")? {
            Some(p) => isz(&p),
            None => (0..x.rank() as isize).rev().collect(),
        };
        one(x.permute(&perm)?)
    }

    fn reshape(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let shape = if self.case.opset >= 5 { self.host_ints(1) } else { self.ints("shape")? };
        let Some(shape) = shape else { return invalid("Reshape needs a shape") };
        let allowzero = self.int("allowzero", 0)? != 0;
        let mut dims = Vec::with_capacity(shape.len());
        for (i, &s) in shape.iter().enumerate() {
            dims.push(if s == 0 && !allowzero {
                match x.dims().get(i) {
                    Some(&d) => d as isize,
                    None => return invalid(format!("Reshape: 0 at {i} copies a dim {} does not have", x.shape())),
                }
            } else {
                s as isize
            });
        }
        one(x.reshape(dims)?)
    }

    fn flatten(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let r = x.rank() as i64;
        let axis = self.int("axis", 1)?;
        let axis = if axis < 0 { axis + r } else { axis };
        if !(0..=r).contains(&axis) {
            return invalid(format!("Flatten: axis {axis} out of range for rank {r}"));
        }
        let (outer, inner): (usize, usize) =
            (x.dims()[..axis as usize].iter().product(), x.dims()[axis as usize..].iter().product());
        one(x.reshape_to([outer, inner])?)
    }

    fn squeeze(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let axes = self.axes(1, 13)?.unwrap_or_default();
        one(x.squeeze(&isz(&axes))?)
    }

    fn unsqueeze(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let Some(axes) = self.axes(1, 13)? else { return invalid("Unsqueeze needs axes") };
        let out_rank = x.rank() + axes.len();
        let mut norm = axes.iter().map(|&a| self.norm_axis(a, out_rank)).collect::<R<Vec<_>>>()?;
        norm.sort_unstable();
        if norm.windows(2).any(|w| w[0] == w[1]) {
            return invalid(format!("Unsqueeze: repeated axes {axes:?}"));
        }
        let mut src = x.dims().iter();
        let dims: Vec<usize> =
            (0..out_rank).map(|i| if norm.contains(&i) { 1 } else { *src.next().unwrap_or(&1) }).collect();
        one(x.reshape_to(dims)?)
    }

    fn expand(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let Some(shape) = self.host_ints(1) else { return invalid("Expand needs a shape") };
        let target = Shape::new(shape.iter().map(|&d| d.max(0) as usize).collect::<Vec<_>>());
        let Some(out) = x.shape().broadcast(&target) else {
            return invalid(format!("Expand: {} does not broadcast with {target}", x.shape()));
        };
        one(x.expand(out)?)
    }

    fn slice(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let (starts, ends, axes, steps) = if self.case.opset >= 10 {
            (self.host_ints(1), self.host_ints(2), self.host_ints(3), self.host_ints(4))
        } else {
            (self.ints("starts")?, self.ints("ends")?, self.ints("axes")?, None)
        };
        let (Some(starts), Some(ends)) = (starts, ends) else { return invalid("Slice needs starts and ends") };
        let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
        let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
        if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
            return invalid("Slice: starts, ends, axes and steps differ in length");
        }
        let r = x.rank();
        let mut st = vec![0i64; r];
        let mut sp = vec![1i64; r];
        let mut lens = x.dims().to_vec();
        for j in 0..starts.len() {
            let ax = self.norm_axis(axes[j], r)?;
            let n = x.dims()[ax] as i64;
            let step = steps[j];
            if step == 0 {
                return invalid("Slice: step 0");
            }
            let wrap = |v: i64| if v < 0 { v.saturating_add(n) } else { v };
            let (s, e) = (wrap(starts[j]), wrap(ends[j]));
            let (s, len) = if step > 0 {
                let (s, e) = (s.clamp(0, n), e.clamp(0, n));
                (s, if e > s { (e - s + step - 1) / step } else { 0 })
            } else if n == 0 {
                (0, 0)
            } else {
                let (s, e) = (s.clamp(0, n - 1), e.clamp(-1, n - 1));
                (s, if s > e { (s - e + (-step) - 1) / (-step) } else { 0 })
            };
            st[ax] = if len > 0 { s } else { 0 };
            sp[ax] = step;
            lens[ax] = len as usize;
        }
        one(Tensor::record(Op::Slice { starts: st, steps: sp, lens }, &[&x])?)
    }

    fn tile(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let Some(reps) = self.host_ints(1) else { return invalid("Tile needs repeats") };
        if reps.len() != x.rank() || reps.iter().any(|&r| r < 0) {
            return invalid(format!("Tile: repeats {reps:?} for {}", x.shape()));
        }
        // [d0, d1, ..] -> [1, d0, 1, d1, ..] -> expand to [r0, d0, r1, d1, ..] -> merge pairs.
        let mut inter = Vec::new();
        let mut expanded = Vec::new();
        let mut out = Vec::new();
        for (&d, &r) in x.dims().iter().zip(&reps) {
            inter.extend([1, d]);
            expanded.extend([r as usize, d]);
            out.push(r as usize * d);
        }
        one(x.reshape_to(inter)?.expand(expanded)?.reshape_to(out)?)
    }

    fn pad(&self) -> R<Vec<Tensor>> {
        let mut x = self.input(0)?;
        let r = x.rank();
        let (pads, value, axes) = if self.case.opset >= 11 {
            let v = self.data(2).and_then(|d| d.data.first().copied());
            (self.host_ints(1), v, if self.case.opset >= 18 { self.host_ints(3) } else { None })
        } else {
            let pads = self.ints("pads")?.or(self.ints("paddings")?);
            (pads, Some(ScalarValue::Float(self.float("value", 0.0)?)), None)
        };
        let Some(pads) = pads else { return invalid("Pad needs pads") };
        let axes = match axes {
            Some(a) => a.iter().map(|&a| self.norm_axis(a, r)).collect::<R<Vec<_>>>()?,
            None => (0..r).collect(),
        };
        if pads.len() != 2 * axes.len() {
            return invalid(format!("Pad: {} pads for {} axes", pads.len(), axes.len()));
        }
        let mut before = vec![0i64; r];
        let mut after = vec![0i64; r];
        for (j, &ax) in axes.iter().enumerate() {
            before[ax] = pads[j];
            after[ax] = pads[j + axes.len()];
        }
        // Negative pads crop.
        for ax in 0..r {
            let n = x.dims()[ax] as i64;
            let (cb, ca) = ((-before[ax]).max(0), (-after[ax]).max(0));
            if cb + ca > n {
                return invalid(format!("Pad: cropping {cb} + {ca} of a dim of size {n}"));
            }
            if cb > 0 || ca > 0 {
                x = x.narrow(ax as isize, cb as usize, (n - cb - ca) as usize)?;
            }
        }
        let pb: Vec<usize> = before.iter().map(|&p| p.max(0) as usize).collect();
        let pa: Vec<usize> = after.iter().map(|&p| p.max(0) as usize).collect();
        let pairs: Vec<(usize, usize)> = pb.iter().copied().zip(pa.iter().copied()).collect();
        let mode = self.string("mode", "constant")?;
        let out = match mode.as_str() {
            "constant" => {
                let v = Tensor::scalar(value.unwrap_or(ScalarValue::Int(0)), x.dtype(), self.dev);
                Tensor::record(Op::Pad { before: pb, after: pa, mode: PadMode::Constant }, &[&x, &v])?
            }
            "reflect" => x.pad_mode(&pairs, PadMode::Reflect)?,
            "edge" => x.pad_mode(&pairs, PadMode::Edge)?,
            "wrap" => {
                for (ax, &(b, a)) in pairs.iter().enumerate() {
                    let n = x.dims()[ax];
                    if b > n || a > n {
                        return unsupported(format!("wrap padding ({b}, {a}) larger than the dim ({n})"));
                    }
                    if b == 0 && a == 0 {
                        continue;
                    }
                    let head = x.narrow(ax as isize, n - b, b)?;
                    let tail = x.narrow(ax as isize, 0, a)?;
                    x = Tensor::concat(&[&head, &x, &tail], ax as isize)?;
                }
                x
            }
            other => return invalid(format!("Pad mode {other:?}")),
        };
        one(out)
    }

    fn trilu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        if x.rank() < 2 {
            return invalid("Trilu needs rank >= 2");
        }
        let upper = self.int("upper", 1)? != 0;
        let (n, m) = (x.dims()[x.rank() - 2], x.dims()[x.rank() - 1]);
        let bound = (n + m) as i64;
        let k = self.host_ints(1).and_then(|v| v.first().copied()).unwrap_or(0).clamp(-bound, bound);
        let rows = Tensor::iota([n, m], 0, DType::I32, self.dev)?;
        let cols = Tensor::iota([n, m], 1, DType::I32, self.dev)?;
        let diff = cols.sub(&rows)?;
        let k = self.scalar(k, DType::I32);
        let keep = if upper { diff.ge(&k)? } else { diff.le(&k)? };
        let zero = self.scalar(0, x.dtype());
        one(keep.where_(&x, &zero)?)
    }

    fn range(&self) -> R<Vec<Tensor>> {
        let get = |i: usize| self.data(i).and_then(|d| d.data.first().copied().map(|v| (v, d.dtype)));
        let (Some((start, dt)), Some((limit, _)), Some((delta, _))) = (get(0), get(1), get(2)) else {
            return invalid("Range needs start, limit and delta");
        };
        let n = if dt.is_float() {
            let (s, l, d) = (start.as_f64(), limit.as_f64(), delta.as_f64());
            if d == 0.0 || !(s.is_finite() && l.is_finite() && d.is_finite()) {
                return invalid(format!("Range({s}, {l}, {d})"));
            }
            ((l - s) / d).ceil().max(0.0) as usize
        } else {
            let (s, l, d) = (start.as_i64() as i128, limit.as_i64() as i128, delta.as_i64() as i128);
            if d == 0 {
                return invalid("Range with delta 0");
            }
            let span = l - s;
            let q = span / d + i128::from(span % d != 0 && (span < 0) == (d < 0));
            q.max(0) as usize
        };
        let idx = Tensor::iota([n], 0, dt, self.dev)?;
        one(idx.mul(&self.scalar(delta, dt))?.add(&self.scalar(start, dt))?)
    }

    fn constant_of_shape(&self) -> R<Vec<Tensor>> {
        let Some(shape) = self.host_ints(0) else { return invalid("ConstantOfShape needs a shape") };
        let (v, dt) = match self.attr("value") {
            Some(Attr::Tensor(t)) => match t.data.first() {
                Some(&v) => (v, t.dtype),
                None => return invalid("ConstantOfShape value has no element"),
            },
            Some(a) => return invalid(format!("ConstantOfShape value is {}", a.kind())),
            None => (ScalarValue::Float(0.0), DType::F32),
        };
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        one(Tensor::full(dims, v, dt, self.dev)?)
    }

    fn shape_op(&self) -> R<Vec<Tensor>> {
        let Some(d) = self.data(0) else { return invalid("Shape needs input 0") };
        let r = d.shape.len() as i64;
        let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let start = clampi(self.int("start", 0)?);
        let end = clampi(self.int("end", r)?);
        let dims: Vec<i64> = if start < end { d.shape[start..end].iter().map(|&v| v as i64).collect() } else { vec![] };
        let n = dims.len();
        one(Tensor::from_slice(&dims, [n], self.dev)?)
    }

    // ---- normalization -----------------------------------------------------

    fn layer_norm(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let scale = self.input(1)?;
        let bias = self.opt_input(2)?;
        let axis = self.norm_axis(self.int("axis", -1)?, x.rank())?;
        let eps = self.float("epsilon", 1e-5)?;
        let stash = dtype_from_onnx(self.int("stash_type", 1)?)?;
        if !stash.is_float() || !x.dtype().is_float() {
            return invalid("LayerNormalization needs float input and stash type");
        }
        let axes: Vec<isize> = (axis as isize..x.rank() as isize).collect();
        let xf = x.cast(stash)?;
        let mean = xf.mean(&axes, true)?;
        let centered = xf.sub(&mean)?;
        let var = centered.mul(&centered)?.mean(&axes, true)?;
        let inv = var.add(&self.scalar(eps, stash))?.rsqrt()?;
        let mut y = centered.mul(&inv)?.cast(x.dtype())?.mul(&scale)?;
        if let Some(b) = bias {
            y = y.add(&b)?;
        }
        Ok(vec![y, mean, inv])
    }

    fn batch_norm(&self) -> R<Vec<Tensor>> {
        if self.int("training_mode", 0)? != 0 || self.case.outputs.len() > 1 {
            return unsupported("BatchNormalization in training mode (only inference is in scope)");
        }
        let x = self.input(0)?;
        let (scale, bias, mean, var) = (self.input(1)?, self.input(2)?, self.input(3)?, self.input(4)?);
        let eps = self.float("epsilon", 1e-5)?;
        if x.rank() < 2 {
            return invalid("BatchNormalization needs rank >= 2");
        }
        let c = x.dims()[1];
        let mut pshape = vec![c];
        pshape.extend(std::iter::repeat_n(1, x.rank() - 2));
        let col = |t: &Tensor| t.reshape_to(pshape.clone());
        let d = var.dtype();
        let inv = var.add(&self.scalar(eps, d))?.rsqrt()?.mul(&scale)?;
        let y = x.sub(&col(&mean)?)?.mul(&col(&inv)?)?.add(&col(&bias)?)?;
        one(y)
    }

    // ---- convolution and pooling -------------------------------------------

    /// Begin and end padding per spatial dim from `auto_pad` / `pads`.
    fn spatial_pads(
        &self,
        input: &[usize],
        kernel: &[usize],
        strides: &[usize],
        dilations: &[usize],
    ) -> R<(Vec<usize>, Vec<usize>)> {
        let n = input.len();
        match self.string("auto_pad", "NOTSET")?.as_str() {
            "NOTSET" => {
                let pads = self.ints("pads")?.unwrap_or_else(|| vec![0; 2 * n]);
                if pads.len() != 2 * n || pads.iter().any(|&p| p < 0) {
                    return invalid(format!("pads {pads:?} for {n} spatial dims"));
                }
                Ok((pads[..n].iter().map(|&p| p as usize).collect(), pads[n..].iter().map(|&p| p as usize).collect()))
            }
            "VALID" => Ok((vec![0; n], vec![0; n])),
            mode @ ("SAME_UPPER" | "SAME_LOWER") => {
                let (mut b, mut e) = (vec![0; n], vec![0; n]);
                for i in 0..n {
                    let out = input[i].div_ceil(strides[i]);
                    let eff = dilations[i] * (kernel[i] - 1) + 1;
                    let total = ((out - 1) * strides[i] + eff).saturating_sub(input[i]);
                    let small = total / 2;
                    (b[i], e[i]) = if mode == "SAME_UPPER" { (small, total - small) } else { (total - small, small) };
                }
                Ok((b, e))
            }
            other => invalid(format!("auto_pad {other:?}")),
        }
    }

    fn spatial_attr(&self, name: &str, n: usize, default: usize) -> R<Vec<usize>> {
        match self.ints(name)? {
            None => Ok(vec![default; n]),
            Some(v) if v.len() == n && v.iter().all(|&x| x > 0) => Ok(v.iter().map(|&x| x as usize).collect()),
            Some(v) => invalid(format!("{name} {v:?} for {n} spatial dims")),
        }
    }

    fn conv(&self) -> R<Vec<Tensor>> {
        let (mut x, mut w) = (self.input(0)?, self.input(1)?);
        let bias = self.opt_input(2)?;
        let nsp = x.rank().saturating_sub(2);
        if !(1..=2).contains(&nsp) || w.rank() != x.rank() {
            return unsupported(format!(
                "Conv over {nsp} spatial dims (Lazuli's Conv2d covers 1-D and 2-D convolutions)"
            ));
        }
        let kernel: Vec<usize> = w.dims()[2..].to_vec();
        if let Some(k) = self.ints("kernel_shape")? {
            if k.iter().map(|&v| v as usize).ne(kernel.iter().copied()) {
                return invalid(format!("kernel_shape {k:?} differs from the weight {}", w.shape()));
            }
        }
        let strides = self.spatial_attr("strides", nsp, 1)?;
        let dil = self.spatial_attr("dilations", nsp, 1)?;
        let (pb, pe) = self.spatial_pads(&x.dims()[2..], &kernel, &strides, &dil)?;
        let groups = self.int("group", 1)?.max(1) as usize;
        let attrs = if nsp == 2 {
            ConvAttrs {
                strides: [strides[0], strides[1]],
                pads: [pb[0], pb[1], pe[0], pe[1]],
                dilations: [dil[0], dil[1]],
                groups,
            }
        } else {
            // 1-D: a unit height.
            x = x.unsqueeze(2)?;
            w = w.unsqueeze(2)?;
            ConvAttrs { strides: [1, strides[0]], pads: [0, pb[0], 0, pe[0]], dilations: [1, dil[0]], groups }
        };
        let mut y = x.conv2d(&w, attrs)?;
        if nsp == 1 {
            y = y.squeeze(&[2])?;
        }
        if let Some(b) = bias {
            let mut dims = vec![1, b.numel()];
            dims.extend(std::iter::repeat_n(1, nsp));
            y = y.add(&b.reshape_to(dims)?)?;
        }
        one(y)
    }

    fn pool(&self, max: bool) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        if x.rank() < 3 {
            return invalid("pooling needs an [N, C, spatial...] input");
        }
        let nsp = x.rank() - 2;
        let Some(kernel) = self.ints("kernel_shape")? else { return invalid("pooling needs kernel_shape") };
        if kernel.len() != nsp || kernel.iter().any(|&k| k <= 0) {
            return invalid(format!("kernel_shape {kernel:?} for {}", x.shape()));
        }
        let kernel: Vec<usize> = kernel.iter().map(|&k| k as usize).collect();
        let strides = self.spatial_attr("strides", nsp, 1)?;
        let dilations = self.spatial_attr("dilations", nsp, 1)?;
        let (pads_begin, pads_end) = self.spatial_pads(&x.dims()[2..], &kernel, &strides, &dilations)?;
        let kind = if max {
            PoolKind::Max
        } else {
            PoolKind::Avg { count_include_pad: self.int("count_include_pad", 0)? != 0 }
        };
        let attrs = PoolAttrs {
            kind,
            kernel,
            strides,
            pads_begin,
            pads_end,
            dilations,
            ceil_mode: self.int("ceil_mode", 0)? != 0,
        };
        let y = x.pool(attrs.clone())?;
        if max && self.case.outputs.len() > 1 {
            let idx = self.max_pool_indices(&x, &attrs, y.dims())?;
            return Ok(vec![y, idx]);
        }
        one(y)
    }

    /// The `Indices` output of MaxPool: for each window, the flat index
    /// (row-major over the whole input, or column-major over the spatial
    /// dims with `storage_order = 1`) of its first maximum. Built from
    /// strided slices of the padded input, one per window offset.
    fn max_pool_indices(&self, x: &Tensor, p: &PoolAttrs, out: &[usize]) -> R<Tensor> {
        let nsp = p.kernel.len();
        let dims = x.dims().to_vec();
        let col_major = self.int("storage_order", 0)? != 0;
        // Flat index of every input element.
        let mut strides = vec![0usize; dims.len()];
        let mut acc = 1;
        for d in (0..dims.len()).rev() {
            strides[d] = acc;
            acc *= dims[d];
        }
        if col_major {
            let mut acc = 1;
            for d in 2..dims.len() {
                strides[d] = acc;
                acc *= dims[d];
            }
            for d in (0..2).rev() {
                strides[d] = acc;
                acc *= dims[d];
            }
        }
        let mut flat: Option<Tensor> = None;
        for (d, &s) in strides.iter().enumerate() {
            let t = Tensor::iota(dims.clone(), d, DType::I64, self.dev)?.mul(&self.scalar(s as i64, DType::I64))?;
            flat = Some(match flat {
                None => t,
                Some(f) => f.add(&t)?,
            });
        }
        let flat = flat.unwrap_or(Tensor::zeros(Shape::scalar(), DType::I64, self.dev)?);
        // Pad values with the lowest value so padding never wins; pad the
        // end further where ceil mode lets the last window hang over.
        let mut before = vec![0; dims.len()];
        let mut after = vec![0; dims.len()];
        for i in 0..nsp {
            let eff = p.dilations[i] * (p.kernel[i] - 1) + 1;
            let need = (out[2 + i].max(1) - 1) * p.strides[i] + eff;
            let have = dims[2 + i] + p.pads_begin[i] + p.pads_end[i];
            before[2 + i] = p.pads_begin[i];
            after[2 + i] = p.pads_end[i] + need.saturating_sub(have);
        }
        let low = if x.dtype().is_float() {
            ScalarValue::Float(f64::NEG_INFINITY)
        } else if x.dtype().is_unsigned_int() {
            ScalarValue::UInt(0)
        } else {
            ScalarValue::Int(i64::MIN)
        };
        let lowt = Tensor::scalar(low, x.dtype(), self.dev);
        let xp = Tensor::record(
            Op::Pad { before: before.clone(), after: after.clone(), mode: PadMode::Constant },
            &[x, &lowt],
        )?;
        let neg = self.scalar(-1, DType::I64);
        let ip = Tensor::record(Op::Pad { before, after, mode: PadMode::Constant }, &[&flat, &neg])?;
        let total: usize = p.kernel.iter().product();
        let mut best: Option<(Tensor, Tensor)> = None;
        for k in 0..total {
            let mut rem = k;
            let mut starts = vec![0i64; dims.len()];
            let mut steps = vec![1i64; dims.len()];
            let lens = out.to_vec();
            for i in (0..nsp).rev() {
                let off = rem % p.kernel[i];
                rem /= p.kernel[i];
                starts[2 + i] = (off * p.dilations[i]) as i64;
                steps[2 + i] = p.strides[i] as i64;
            }
            let sl = Op::Slice { starts, steps, lens };
            let v = Tensor::record(sl.clone(), &[&xp])?;
            let i = Tensor::record(sl, &[&ip])?;
            best = Some(match best {
                None => (v, i),
                Some((bv, bi)) => {
                    let gt = v.gt(&bv)?;
                    (gt.where_(&v, &bv)?, gt.where_(&i, &bi)?)
                }
            });
        }
        match best {
            Some((_, i)) => Ok(i),
            None => invalid("empty pooling window"),
        }
    }
}

/// The elementwise prologue / epilogue of a composite reduction.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Post {
    None,
    Abs,
    Square,
    SumSquare,
    LogSumExp,
}

/// A label of an einsum term: a letter, or one dim covered by `...`
/// (numbered from the left of the broadcast ellipsis dims).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Label {
    Ell(usize),
    Char(char),
}

fn parse_term(term: &str, rank: Option<usize>, ell_rank: usize) -> R<Vec<Label>> {
    let letters = term.replace("...", "");
    if !letters.chars().all(|c| c.is_ascii_alphabetic()) {
        return invalid(format!("einsum term {term:?}"));
    }
    let has_ell = term.contains("...");
    if term.matches("...").count() > 1 {
        return invalid(format!("einsum term {term:?} has two ellipses"));
    }
    let n_letters = letters.chars().count();
    let e = match rank {
        Some(r) if has_ell => {
            r.checked_sub(n_letters).ok_or_else(|| MapError::Invalid(format!("term {term:?} for rank {r}")))?
        }
        Some(r) if r != n_letters => return invalid(format!("einsum term {term:?} for an operand of rank {r}")),
        Some(_) => 0,
        None if has_ell => ell_rank,
        None => 0,
    };
    let mut out = Vec::new();
    let mut rest = term;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("...") {
            out.extend((ell_rank - e..ell_rank).map(Label::Ell));
            rest = r;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(Label::Char(c));
            rest = &rest[c.len_utf8()..];
        }
    }
    Ok(out)
}

/// General einsum by diagonal extraction, permutation, broadcasting
/// multiplication and a final sum over the contracted labels.
pub fn einsum(equation: &str, xs: &[Tensor]) -> Result<Tensor, MapError> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != xs.len() {
        return invalid(format!("einsum {equation:?} has {} terms for {} operands", terms.len(), xs.len()));
    }
    // Ellipsis rank: the largest over operands.
    let mut ell_rank = 0;
    for (t, x) in terms.iter().zip(xs) {
        if t.contains("...") {
            let letters = t.replace("...", "").chars().count();
            ell_rank = ell_rank.max(x.rank().saturating_sub(letters));
        }
    }
    let mut ops: Vec<(Tensor, Vec<Label>)> = Vec::new();
    for (t, x) in terms.iter().zip(xs) {
        ops.push((x.clone(), parse_term(t, Some(x.rank()), ell_rank)?));
    }
    let out_labels: Vec<Label> = match rhs {
        Some(r) => parse_term(r, None, ell_rank)?,
        None => {
            let mut counts = std::collections::BTreeMap::new();
            for (_, ls) in &ops {
                for &l in ls {
                    if let Label::Char(c) = l {
                        *counts.entry(c).or_insert(0) += 1;
                    }
                }
            }
            let mut v: Vec<Label> = (0..ell_rank).map(Label::Ell).collect();
            v.extend(counts.into_iter().filter(|&(_, n)| n == 1).map(|(c, _)| Label::Char(c)));
            v
        }
    };
    // Diagonals of repeated labels within one operand.
    for (x, ls) in ops.iter_mut() {
        while let Some((i, j)) = first_repeat(ls) {
            let r = ls.len();
            let n = x.dims()[i];
            if x.dims()[j] != n {
                return invalid(format!("einsum label {:?} has sizes {n} and {}", ls[i], x.dims()[j]));
            }
            let mut perm: Vec<usize> = (0..r).filter(|&a| a != i && a != j).collect();
            perm.extend([i, j]);
            let moved = x.permute(&perm.iter().map(|&a| a as isize).collect::<Vec<_>>())?;
            let mut dims = moved.dims()[..r - 2].to_vec();
            dims.push(n * n);
            let flat = moved.reshape_to(dims.clone())?;
            let mut starts = vec![0i64; r - 1];
            let mut steps = vec![1i64; r - 1];
            let mut lens = dims;
            steps[r - 2] = n as i64 + 1;
            lens[r - 2] = n;
            if n == 0 {
                steps[r - 2] = 1;
                starts[r - 2] = 0;
            }
            *x = Tensor::record(Op::Slice { starts, steps, lens }, &[&flat])?;
            let label = ls[i];
            let mut nl: Vec<Label> = perm[..r - 2].iter().map(|&a| ls[a]).collect();
            nl.push(label);
            *ls = nl;
        }
    }
    // Sum early the labels only one operand has and the output lacks.
    let count = |l: Label, ops: &[(Tensor, Vec<Label>)]| ops.iter().filter(|(_, ls)| ls.contains(&l)).count();
    for k in 0..ops.len() {
        let own: Vec<usize> = ops[k]
            .1
            .iter()
            .enumerate()
            .filter(|&(_, &l)| !out_labels.contains(&l) && count(l, &ops) == 1)
            .map(|(a, _)| a)
            .collect();
        if !own.is_empty() {
            let (x, ls) = &ops[k];
            let axes: Vec<isize> = own.iter().map(|&a| a as isize).collect();
            let nx = x.reduce_axes(ReduceOp::Sum, &axes, false)?;
            let nl: Vec<Label> = ls.iter().enumerate().filter(|(a, _)| !own.contains(a)).map(|(_, &l)| l).collect();
            ops[k] = (nx, nl);
        }
    }
    let mut all = out_labels.clone();
    for (_, ls) in &ops {
        for &l in ls {
            if !all.contains(&l) {
                all.push(l);
            }
        }
    }
    // Align every operand to `all` (permute, then insert unit dims).
    let mut prod: Option<Tensor> = None;
    for (x, ls) in &ops {
        let order: Vec<usize> = all.iter().filter_map(|l| ls.iter().position(|m| m == l)).collect();
        let px = x.permute(&order.iter().map(|&a| a as isize).collect::<Vec<_>>())?;
        let dims: Vec<usize> =
            all.iter().map(|l| ls.iter().position(|m| m == l).map(|a| x.dims()[a]).unwrap_or(1)).collect();
        let ax = px.reshape_to(dims)?;
        prod = Some(match prod {
            None => ax,
            Some(p) => p.mul(&ax)?,
        });
    }
    let Some(prod) = prod else { return invalid("einsum without operands") };
    for l in &out_labels {
        if !ops.iter().any(|(_, ls)| ls.contains(l)) {
            return invalid(format!("einsum output label {l:?} is in no operand"));
        }
    }
    let contracted: Vec<isize> = (out_labels.len()..all.len()).map(|a| a as isize).collect();
    if contracted.is_empty() {
        Ok(prod)
    } else {
        Ok(prod.reduce_axes(ReduceOp::Sum, &contracted, false)?)
    }
}

fn first_repeat(ls: &[Label]) -> Option<(usize, usize)> {
    for i in 0..ls.len() {
        for j in i + 1..ls.len() {
            if ls[i] == ls[j] {
                return Some((i, j));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceExt;
    use std::collections::BTreeMap;

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_scalars().unwrap().iter().map(|v| v.as_f64()).collect()
    }

    fn tensor(data: &[f64], shape: &[usize], dev: &Device) -> Tensor {
        Tensor::from_slice(data, shape.to_vec(), dev).unwrap()
    }

    fn td(dtype: DType, shape: &[usize], data: &[f64]) -> TensorData {
        let data = data
            .iter()
            .map(|&v| match dtype {
                d if d.is_float() => ScalarValue::Float(v),
                DType::Bool => ScalarValue::Bool(v != 0.0),
                d if d.is_unsigned_int() => ScalarValue::UInt(v as u64),
                _ => ScalarValue::Int(v as i64),
            })
            .collect();
        TensorData { name: None, dtype, shape: shape.to_vec(), data }
    }

    fn case(opset: i64, attrs: &[(&str, Attr)], inputs: Vec<Option<TensorData>>, n_out: usize) -> Case {
        let attrs: BTreeMap<String, Attr> = attrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        Case { name: "t".into(), opset, attrs, inputs, outputs: vec![None; n_out] }
    }

    #[test]
    fn einsum_common_forms() {
        let dev = Device::cpu();
        let a = tensor(&[1., 2., 3., 4., 5., 6.], &[2, 3], &dev);
        let b = tensor(&[1., 0., 2., 1., 0., 3.], &[3, 2], &dev);
        let sq = tensor(&[1., 2., 3., 4.], &[2, 2], &dev);
        let v = tensor(&[1., 2.], &[2], &dev);
        // Transpose, matmul (explicit and implicit), trace, diagonal, outer, total sum.
        assert_eq!(f64s(&einsum("ij->ji", std::slice::from_ref(&a)).unwrap()), vec![1., 4., 2., 5., 3., 6.]);
        let mm = vec![5., 11., 14., 23.];
        assert_eq!(f64s(&einsum("ij,jk->ik", &[a.clone(), b.clone()]).unwrap()), mm);
        assert_eq!(f64s(&einsum("ij,jk", &[a.clone(), b.clone()]).unwrap()), mm);
        assert_eq!(f64s(&einsum("ii->", std::slice::from_ref(&sq)).unwrap()), vec![5.]);
        assert_eq!(f64s(&einsum("ii->i", std::slice::from_ref(&sq)).unwrap()), vec![1., 4.]);
        assert_eq!(f64s(&einsum("i,j->ij", &[v.clone(), v.clone()]).unwrap()), vec![1., 2., 2., 4.]);
        assert_eq!(f64s(&einsum("ij->", std::slice::from_ref(&a)).unwrap()), vec![21.]);
        // Implicit output with letters out of order: "ba" -> sorted "ab" = transpose.
        assert_eq!(f64s(&einsum("ba", std::slice::from_ref(&sq)).unwrap()), vec![1., 3., 2., 4.]);
        // Broadcast batch matmul through an ellipsis.
        let batch = tensor(&[1., 2., 3., 4., 5., 6., 7., 8.], &[2, 2, 2], &dev);
        let out = einsum("...ij,jk->...ik", &[batch, sq]).unwrap();
        assert_eq!(out.dims(), &[2, 2, 2]);
        assert_eq!(f64s(&out), vec![7., 10., 15., 22., 23., 34., 31., 46.]);
        assert!(matches!(einsum("ij,jk->ik", &[a]), Err(MapError::Invalid(_))));
    }

    #[test]
    fn slice_follows_onnx_clamping() {
        let dev = Device::cpu();
        let x = td(DType::F32, &[5], &[0., 1., 2., 3., 4.]);
        let i = |v: &[f64]| Some(td(DType::I64, &[v.len()], v));
        let run = |starts: &[f64], ends: &[f64], steps: &[f64]| {
            let c = case(13, &[], vec![Some(x.clone()), i(starts), i(ends), i(&[0.]), i(steps)], 1);
            f64s(&lower("Slice", &c, &dev).unwrap()[0])
        };
        assert_eq!(run(&[-1000.], &[1000.], &[2.]), vec![0., 2., 4.]);
        assert_eq!(run(&[1000.], &[-1000.], &[-1.]), vec![4., 3., 2., 1., 0.]);
        // The spec clamps a negative step's start to [0, n - 1] and its end to [-1, n - 1].
        assert_eq!(run(&[-1000.], &[-1000.], &[-1.]), vec![0.]);
        assert_eq!(run(&[-1.], &[-6.], &[-2.]), vec![4., 2., 0.]);
        assert_eq!(run(&[3.], &[1.], &[1.]), Vec::<f64>::new());
    }

    #[test]
    fn range_pad_wrap_and_unsupported() {
        let dev = Device::cpu();
        let s = |v: f64| Some(td(DType::I32, &[], &[v]));
        let c = case(11, &[], vec![s(10.), s(1.), s(-3.)], 1);
        assert_eq!(f64s(&lower("Range", &c, &dev).unwrap()[0]), vec![10., 7., 4.]);
        let x = td(DType::F32, &[3], &[1., 2., 3.]);
        let pads = td(DType::I64, &[2], &[2., 1.]);
        let c = case(18, &[("mode", Attr::String("wrap".into()))], vec![Some(x.clone()), Some(pads)], 1);
        assert_eq!(f64s(&lower("Pad", &c, &dev).unwrap()[0]), vec![2., 3., 1., 2., 3., 1.]);
        let c = case(13, &[], vec![Some(x)], 1);
        assert!(matches!(lower("Acosh", &c, &dev), Err(MapError::Unsupported(_))));
        assert!(matches!(lower("Gemm", &c, &dev), Err(MapError::Invalid(_))));
        let c = case(13, &[("to", Attr::Int(17))], c.inputs.clone(), 1);
        assert!(matches!(lower("Cast", &c, &dev), Err(MapError::Unsupported(_))));
        // bfloat16 (code 16) is a Lazuli dtype: the cast rounds to it.
        let c = case(13, &[("to", Attr::Int(16))], c.inputs.clone(), 1);
        let out = lower("Cast", &c, &dev).unwrap();
        assert_eq!(out[0].dtype(), DType::BF16);
        assert_eq!(f64s(&out[0]), vec![1., 2., 3.]);
    }

    #[test]
    fn max_pool_indices_row_and_column_major() {
        let dev = Device::cpu();
        let x = td(DType::F32, &[1, 1, 2, 3], &[1., 9., 2., 8., 3., 10.]);
        let attrs = |order: i64| vec![("kernel_shape", Attr::Ints(vec![2, 2])), ("storage_order", Attr::Int(order))];
        let c = case(12, &attrs(0), vec![Some(x.clone())], 2);
        let out = lower("MaxPool", &c, &dev).unwrap();
        assert_eq!(f64s(&out[0]), vec![9., 10.]);
        assert_eq!(f64s(&out[1]), vec![1., 5.]);
        assert_eq!(out[1].dtype(), DType::I64);
        let c = case(12, &attrs(1), vec![Some(x)], 2);
        assert_eq!(f64s(&lower("MaxPool", &c, &dev).unwrap()[1]), vec![2., 5.]);
    }
}
