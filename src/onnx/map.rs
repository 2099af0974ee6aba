//! Maps one ONNX node (operator type, attributes, opset, inputs) onto
//! Lazuli ops through the public [`Tensor`] API: [`lower`]. This is the
//! one mapping from ONNX to Lazuli: models ([`super::Model`]) and the
//! conformance suite both run through it.
//!
//! Most ONNX operators are one Lazuli op; the rest are compositions of
//! public ops (Elu, Selu, Gemm, Einsum, Tile, LayerNormalization, LRN,
//! Resize, LSTM, GRU...). Results get the dtype ONNX specifies (e.g.
//! `ArgMax` is `i64` in ONNX and `i32` in Lazuli, so it is cast), except
//! that on a device without 64-bit integers ([`NodeCtx::narrow`]) ONNX's
//! `int64` is computed as `i32`. Inputs that determine a shape (`axes`,
//! `pads`, `shape`, `repeats`, Slice bounds, Range bounds...: the
//! [`host_slots`]) are read on the host: a lazy engine must know every
//! shape when it records an op, and the model folds them there. `Shape`
//! and `Size` answer on the host without touching the device.
//!
//! What Lazuli cannot express is a typed [`MapError::Unsupported`] with the
//! reason; a node that breaks the ONNX rules (a missing required input, an
//! axis out of range) is [`MapError::Invalid`]. Neither panics.

use super::data::{dtype_of_code, Attr, HostTensor};
use crate::{Device, ExecError, Tensor};
use lazuli_ir::{
    ArgReduceOp, BinaryOp, ConvAttrs, DType, Op, PadMode, PoolAttrs, PoolKind, ReduceOp, ScalarValue, Shape, UnaryOp,
};
use std::cell::OnceCell;
use std::collections::BTreeMap;
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

/// A node's input: known on the host (a constant, a folded shape), a
/// tensor, or both; a host value is uploaded when first read as a tensor.
#[derive(Default)]
pub struct Slot {
    /// The value on the host, when known there.
    pub host: Option<HostTensor>,
    /// The value as a tensor of the node's device, once made.
    pub tensor: OnceCell<Tensor>,
}

impl Slot {
    /// A host value.
    pub fn host(t: HostTensor) -> Slot {
        Slot { host: Some(t), tensor: OnceCell::new() }
    }

    /// A tensor.
    pub fn tensor(t: Tensor) -> Slot {
        let cell = OnceCell::new();
        let _ = cell.set(t);
        Slot { host: None, tensor: cell }
    }

    /// The value's dims.
    pub fn dims(&self) -> &[usize] {
        match (&self.host, self.tensor.get()) {
            (Some(h), _) => &h.dims,
            (None, Some(t)) => t.dims(),
            (None, None) => &[],
        }
    }

    /// The value's dtype as stored (a narrowed upload may differ).
    pub fn dtype(&self) -> DType {
        match (self.tensor.get(), &self.host) {
            (Some(t), _) => t.dtype(),
            (None, Some(h)) => h.dtype,
            (None, None) => DType::F32,
        }
    }
}

/// A lowered output: a host value (`Shape`, `Size`) or a lazy tensor.
#[derive(Clone, Debug)]
pub enum Value {
    /// Known on the host.
    Host(HostTensor),
    /// Recorded on the device.
    Tensor(Tensor),
}

/// Everything [`lower`] needs of one node.
pub struct NodeCtx<'a> {
    /// The operator type.
    pub op: &'a str,
    /// The default domain's opset the model imports.
    pub opset: i64,
    /// Attributes by name (absent ones take their default).
    pub attrs: &'a BTreeMap<String, Attr>,
    /// Inputs in slot order; `None` where an optional input is omitted.
    pub inputs: &'a [Option<&'a Slot>],
    /// How many outputs the node declares.
    pub n_out: usize,
    /// The device the node's ops are recorded on.
    pub dev: &'a Device,
    /// The device has no 64-bit integers: ONNX `int64` is computed as
    /// `i32` (host values are narrowed when uploaded, a value out of the
    /// `i32` range is an error).
    pub narrow: bool,
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
    "Celu",
    "Clip",
    "Concat",
    "ConstantOfShape",
    "Conv",
    "ConvTranspose",
    "Cos",
    "CumSum",
    "DepthToSpace",
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
    "GRU",
    "Gather",
    "GatherElements",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "Greater",
    "GreaterOrEqual",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "InstanceNormalization",
    "IsInf",
    "IsNaN",
    "LRN",
    "LSTM",
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
    "Mish",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "PRelu",
    "Pad",
    "Pow",
    "RNN",
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
    "Resize",
    "Round",
    "ScatterND",
    "Selu",
    "Shape",
    "Shrink",
    "Sigmoid",
    "Sign",
    "Sin",
    "Size",
    "Slice",
    "Softmax",
    "Softplus",
    "Softsign",
    "SpaceToDepth",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tan",
    "Tanh",
    "ThresholdedRelu",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Upsample",
    "Where",
    "Xor",
];

/// The newest default-domain opset Lazuli knows. The versions after 22
/// changed the supported operators only by admitting new dtypes (float8,
/// 4-bit and 2-bit types), which [`dtype_from_onnx`] refuses by name.
pub const MAX_OPSET: i64 = 27;

/// Why a node (operator, opset, attributes) cannot run, checked at load
/// before anything is recorded; `None` when it can.
pub fn check(op: &str, opset: i64, attrs: &BTreeMap<String, Attr>, n_in: usize, n_out: usize) -> Option<String> {
    let _ = (n_in, n_out);
    if matches!(op, "Loop" | "Scan") {
        return Some(format!("{op} is not supported (control flow repeated over tensor data)"));
    }
    if op == "If" {
        return None;
    }
    if !SUPPORTED_OPS.contains(&op) {
        return Some(format!("no mapping for the operator {op}"));
    }
    if opset > MAX_OPSET {
        return Some(format!("opset {opset} is newer than the newest Lazuli knows ({MAX_OPSET})"));
    }
    let s = |name: &str| match attrs.get(name) {
        Some(Attr::String(v)) => Some(v.as_str()),
        _ => None,
    };
    let i = |name: &str| match attrs.get(name) {
        Some(Attr::Int(v)) => Some(*v),
        _ => None,
    };
    match op {
        "BatchNormalization" if i("training_mode") == Some(1) || n_out > 1 => {
            Some("BatchNormalization in training mode (only inference is in scope)".into())
        }
        "BatchNormalization" if i("spatial") == Some(0) => Some("BatchNormalization with spatial = 0".into()),
        "Cast" if i("to") == Some(8) => Some("Cast to string".into()),
        "Pad" if !matches!(s("mode"), None | Some("constant" | "reflect" | "edge" | "wrap")) => {
            Some(format!("Pad mode {:?}", s("mode")))
        }
        "Resize" if i("antialias").is_some_and(|a| a != 0) => Some("Resize with antialias = 1".into()),
        "Resize" | "Upsample" if !matches!(s("mode"), None | Some("nearest" | "linear" | "cubic")) => {
            Some(format!("{op} mode {:?}", s("mode")))
        }
        "Upsample" if s("mode") == Some("cubic") => Some("Upsample mode \"cubic\"".into()),
        "LSTM" | "GRU" | "RNN" => {
            let defaults: &[&str] = match op {
                "LSTM" => &["Sigmoid", "Tanh", "Tanh"],
                "GRU" => &["Sigmoid", "Tanh"],
                _ => &["Tanh"],
            };
            match attrs.get("activations") {
                Some(Attr::Strings(a))
                    if a.chunks(defaults.len()).any(|c| c.iter().map(String::as_str).ne(defaults.iter().copied())) =>
                {
                    Some(format!("{op} activations {a:?} (only the defaults {defaults:?} are supported)"))
                }
                _ if i("input_forget").is_some_and(|f| f != 0) => Some("LSTM with input_forget = 1".into()),
                _ => None,
            }
        }
        _ => None,
    }
}

/// Records the node on `ctx.dev` and returns its outputs in ONNX slot
/// order (at least `ctx.n_out`). Nothing is synced here.
pub fn lower(ctx: &NodeCtx<'_>) -> Result<Vec<Value>, MapError> {
    let node = Node { op: ctx.op, ctx };
    let outs = match ctx.op {
        "Shape" => vec![Value::Host(node.shape_op()?)],
        "Size" => {
            let n = node.slot(0)?.dims().iter().product::<usize>() as i64;
            vec![Value::Host(HostTensor::from_i64s(&[n], vec![]))]
        }
        _ => node.lower()?.into_iter().map(Value::Tensor).collect(),
    };
    if outs.len() < ctx.n_out {
        return unsupported(format!("{} produces {} output(s) here, the node has {}", ctx.op, outs.len(), ctx.n_out));
    }
    Ok(outs)
}

/// The input slots of `op` whose values must be known on the host when
/// the node is recorded (shapes, axes, bounds, pads...).
pub fn host_slots(op: &str, opset: i64) -> &'static [usize] {
    match op {
        "Reshape" if opset >= 5 => &[1],
        "Expand" | "Tile" | "Trilu" | "CumSum" | "TopK" | "OneHot" | "Upsample" => &[1],
        "ConstantOfShape" => &[0],
        "Range" => &[0, 1, 2],
        "Slice" if opset >= 10 => &[1, 2, 3, 4],
        "Pad" if opset >= 11 => &[1, 2, 3],
        "Squeeze" | "Unsqueeze" if opset >= 13 => &[1],
        "ReduceSum" if opset >= 13 => &[1],
        "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1" | "ReduceL2" | "ReduceSumSquare"
        | "ReduceLogSumExp"
            if opset >= 18 =>
        {
            &[1]
        }
        "Split" if opset >= 13 => &[1],
        "Resize" => &[1, 2, 3],
        "Dropout" if opset >= 12 => &[1, 2],
        "If" => &[0],
        _ => &[],
    }
}

/// Operators whose results are random (never folded).
pub fn is_random(op: &str) -> bool {
    matches!(
        op,
        "RandomNormal" | "RandomUniform" | "RandomNormalLike" | "RandomUniformLike" | "Bernoulli" | "Multinomial"
    )
}

/// The Lazuli dtype of an ONNX `TensorProto.DataType` code, if Lazuli has it.
pub fn dtype_from_onnx(code: i64) -> Result<DType, MapError> {
    match dtype_of_code(code as i32) {
        Ok(d) => Ok(d),
        Err(why) if why.starts_with("unknown") => invalid(why),
        Err(why) => unsupported(why),
    }
}

struct Node<'a> {
    op: &'a str,
    ctx: &'a NodeCtx<'a>,
}

fn one(t: Tensor) -> R<Vec<Tensor>> {
    Ok(vec![t])
}

fn isz(v: &[i64]) -> Vec<isize> {
    v.iter().map(|&a| a as isize).collect()
}

impl<'a> Node<'a> {
    // ---- inputs and attributes -------------------------------------------

    fn opset(&self) -> i64 {
        self.ctx.opset
    }

    fn dev(&self) -> &'a Device {
        self.ctx.dev
    }

    fn present(&self, i: usize) -> Option<&'a Slot> {
        self.ctx.inputs.get(i).copied().flatten()
    }

    fn slot(&self, i: usize) -> R<&'a Slot> {
        match self.present(i) {
            Some(s) => Ok(s),
            None => invalid(format!("{} needs input {i}", self.op)),
        }
    }

    fn upload(&self, s: &Slot) -> R<Tensor> {
        if let Some(t) = s.tensor.get() {
            return Ok(t.clone());
        }
        let Some(h) = &s.host else { return invalid("an input without a value") };
        let h = if self.ctx.narrow {
            h.narrowed().ok_or_else(|| {
                MapError::Unsupported(format!(
                    "an {} input holds values outside the 32-bit range this device computes 64-bit integers in",
                    h.dtype
                ))
            })?
        } else {
            h.clone()
        };
        let t = Tensor::from_bytes(h.bytes.to_vec(), h.ty(), self.dev())?;
        let _ = s.tensor.set(t.clone());
        Ok(t)
    }

    fn input(&self, i: usize) -> R<Tensor> {
        self.upload(self.slot(i)?)
    }

    fn opt_input(&self, i: usize) -> R<Option<Tensor>> {
        self.present(i).map(|s| self.upload(s)).transpose()
    }

    /// Every present input (for variadic ops).
    fn all_inputs(&self) -> R<Vec<Tensor>> {
        self.ctx.inputs.iter().flatten().map(|s| self.upload(s)).collect()
    }

    /// A present input's host value; an error when it is only a tensor.
    fn host(&self, i: usize) -> R<Option<&'a HostTensor>> {
        match self.present(i) {
            None => Ok(None),
            Some(Slot { host: Some(h), .. }) => Ok(Some(h)),
            Some(_) => unsupported(format!(
                "input {i} of {} is computed from tensor data, but Lazuli needs its value when it records the node",
                self.op
            )),
        }
    }

    /// A shape-like input read on the host.
    fn host_ints(&self, i: usize) -> R<Option<Vec<i64>>> {
        Ok(self.host(i)?.map(HostTensor::to_i64s))
    }

    /// The dtype ONNX's `int64` results have on this device.
    fn index_dtype(&self) -> DType {
        if self.ctx.narrow {
            DType::I32
        } else {
            DType::I64
        }
    }

    /// [`dtype_from_onnx`] with 64-bit integers narrowed where the device needs it.
    fn onnx_dtype(&self, code: i64) -> R<DType> {
        Ok(self.narrowed(dtype_from_onnx(code)?))
    }

    fn narrowed(&self, d: DType) -> DType {
        match d {
            DType::I64 if self.ctx.narrow => DType::I32,
            DType::U64 if self.ctx.narrow => DType::U32,
            d => d,
        }
    }

    fn attr(&self, name: &str) -> Option<&'a Attr> {
        self.ctx.attrs.get(name)
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
        if self.opset() >= since {
            self.host_ints(i)
        } else {
            self.ints("axes")
        }
    }

    fn scalar(&self, v: impl Into<ScalarValue>, dtype: DType) -> Tensor {
        Tensor::scalar(v, dtype, self.dev())
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
            "Cast" => one(self.input(0)?.cast(self.onnx_dtype(self.int("to", 1)?)?)?),
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
            "LayerNormalization" => self.layer_norm(),
            "BatchNormalization" => self.batch_norm(),
            "Conv" => self.conv(),
            "MaxPool" => self.pool(true),
            "GlobalAveragePool" => self.global_pool(ReduceOp::Mean),
            "GlobalMaxPool" => self.global_pool(ReduceOp::Max),
            "PRelu" => self.prelu(),
            "HardSwish" => self.hard_swish(),
            "Shrink" => self.shrink(),
            "Celu" => self.celu(),
            "ThresholdedRelu" => self.thresholded_relu(),
            "Mish" => self.mish(),
            "LRN" => self.lrn(),
            "InstanceNormalization" => self.instance_norm(),
            "Split" => self.split(),
            "DepthToSpace" => self.depth_to_space(true),
            "SpaceToDepth" => self.depth_to_space(false),
            "GatherElements" => self.gather_elements(),
            "ScatterND" => self.scatter_nd(),
            "TopK" => self.top_k(),
            "ConvTranspose" => self.conv_transpose(),
            "Resize" | "Upsample" => self.resize(),
            "LSTM" | "GRU" | "RNN" => self.recurrent(),
            "Tan" => self.unary_fn(|x| Ok(x.sin()?.div(&x.cos()?)?)),
            "AveragePool" => self.pool(false),
            other => unsupported(format!("no mapping for ONNX operator {other}")),
        }
    }

    // ---- elementwise -------------------------------------------------------

    fn unary(&self, u: UnaryOp) -> R<Vec<Tensor>> {
        one(Tensor::record(Op::Unary(u), &[&self.input(0)?])?)
    }

    fn binary(&self, b: BinaryOp) -> R<Vec<Tensor>> {
        let a = self.input(0)?;
        let rhs = self.legacy_broadcast(&a, self.input(1)?)?;
        one(Tensor::record(Op::Binary(b), &[&a, &rhs])?)
    }

    fn unary_fn(&self, f: impl Fn(&Tensor) -> R<Tensor>) -> R<Vec<Tensor>> {
        one(f(&self.input(0)?)?)
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
        let n = self.ctx.inputs.iter().flatten().count();
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
            (false, false) => Tensor::full(x.shape().clone(), false, DType::Bool, self.dev())?,
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
        let training = if self.opset() >= 12 {
            self.host(2)?.map(|d| d.numel() > 0 && d.scalar(0).as_bool()).unwrap_or(false)
        } else {
            self.opset() < 7 && self.int("is_test", 0)? == 0
        };
        if training {
            return unsupported("Dropout in training mode draws a random mask the ONNX data cannot check");
        }
        let mask = Tensor::full(x.shape().clone(), true, DType::Bool, self.dev())?;
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
        let (lo, hi) = if self.opset() >= 11 {
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
        one(x.arg_reduce(op, axis, keep, last)?.cast(self.index_dtype())?)
    }

    fn softmax(&self, log: bool) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let f = |t: &Tensor, axis: isize| if log { t.log_softmax(axis) } else { t.softmax(axis) };
        if self.opset() >= 13 {
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
        let axis = self.host_ints(1)?.and_then(|v| v.first().copied()).unwrap_or(0);
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
        let shape = if self.opset() >= 5 { self.host_ints(1)? } else { self.ints("shape")? };
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
        let Some(shape) = self.host_ints(1)? else { return invalid("Expand needs a shape") };
        let target = Shape::new(shape.iter().map(|&d| d.max(0) as usize).collect::<Vec<_>>());
        let Some(out) = x.shape().broadcast(&target) else {
            return invalid(format!("Expand: {} does not broadcast with {target}", x.shape()));
        };
        one(x.expand(out)?)
    }

    fn slice(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let (starts, ends, axes, steps) = if self.opset() >= 10 {
            (self.host_ints(1)?, self.host_ints(2)?, self.host_ints(3)?, self.host_ints(4)?)
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
        let Some(reps) = self.host_ints(1)? else { return invalid("Tile needs repeats") };
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
        let (pads, value, axes) = if self.opset() >= 11 {
            let v = self.host(2)?.filter(|d| d.numel() > 0).map(|d| d.scalar(0));
            (self.host_ints(1)?, v, if self.opset() >= 18 { self.host_ints(3)? } else { None })
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
                let v = Tensor::scalar(value.unwrap_or(ScalarValue::Int(0)), x.dtype(), self.dev());
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
        let k = self.host_ints(1)?.and_then(|v| v.first().copied()).unwrap_or(0).clamp(-bound, bound);
        let rows = Tensor::iota([n, m], 0, DType::I32, self.dev())?;
        let cols = Tensor::iota([n, m], 1, DType::I32, self.dev())?;
        let diff = cols.sub(&rows)?;
        let k = self.scalar(k, DType::I32);
        let keep = if upper { diff.ge(&k)? } else { diff.le(&k)? };
        let zero = self.scalar(0, x.dtype());
        one(keep.where_(&x, &zero)?)
    }

    fn range(&self) -> R<Vec<Tensor>> {
        let get = |i: usize| -> R<Option<(ScalarValue, DType)>> {
            Ok(self.host(i)?.filter(|d| d.numel() > 0).map(|d| (d.scalar(0), d.dtype)))
        };
        let (Some((start, dt)), Some((limit, _)), Some((delta, _))) = (get(0)?, get(1)?, get(2)?) else {
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
        let idx = Tensor::iota([n], 0, dt, self.dev())?;
        one(idx.mul(&self.scalar(delta, dt))?.add(&self.scalar(start, dt))?)
    }

    fn constant_of_shape(&self) -> R<Vec<Tensor>> {
        let Some(shape) = self.host_ints(0)? else { return invalid("ConstantOfShape needs a shape") };
        let (v, dt) = match self.attr("value") {
            Some(Attr::Tensor(t)) if t.numel() > 0 => (t.scalar(0), self.narrowed(t.dtype)),
            Some(Attr::Tensor(_)) => return invalid("ConstantOfShape value has no element"),
            Some(a) => return invalid(format!("ConstantOfShape value is {}", a.kind())),
            None => (ScalarValue::Float(0.0), DType::F32),
        };
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        one(Tensor::full(dims, v, dt, self.dev())?)
    }

    fn shape_op(&self) -> R<HostTensor> {
        let shape = self.slot(0)?.dims();
        let r = shape.len() as i64;
        let clampi = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
        let start = clampi(self.int("start", 0)?);
        let end = clampi(self.int("end", r)?);
        let dims: Vec<i64> = if start < end { shape[start..end].iter().map(|&v| v as i64).collect() } else { vec![] };
        let n = dims.len();
        Ok(HostTensor::from_i64s(&dims, vec![n]))
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
        if self.int("training_mode", 0)? != 0 || self.ctx.n_out > 1 {
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

    // ---- operators of real models ------------------------------------------

    /// Binary ops before opset 7 may say `broadcast = 1` with an `axis`
    /// where the second operand's dims start.
    fn legacy_broadcast(&self, a: &Tensor, b: Tensor) -> R<Tensor> {
        if self.opset() >= 7 || self.int("broadcast", 0)? == 0 {
            return Ok(b);
        }
        let Some(Attr::Int(axis)) = self.attr("axis") else { return Ok(b) };
        let axis = self.norm_axis(*axis, a.rank())?;
        let mut dims = vec![1; a.rank()];
        for (i, &d) in b.dims().iter().enumerate() {
            match dims.get_mut(axis + i) {
                Some(x) => *x = d,
                None => return invalid(format!("broadcast of {} at axis {axis} into {}", b.shape(), a.shape())),
            }
        }
        Ok(b.reshape_to(dims)?)
    }

    fn global_pool(&self, r: ReduceOp) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        if x.rank() < 3 {
            return invalid(format!("{} needs an [N, C, spatial...] input, got {}", self.op, x.shape()));
        }
        let axes: Vec<isize> = (2..x.rank() as isize).collect();
        one(x.reduce_axes(r, &axes, true)?)
    }

    fn prelu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let mut slope = self.input(1)?;
        // Per-channel slopes given as [C] (older exporters) broadcast over
        // the channel axis, not the last one.
        if slope.rank() == 1 && x.rank() > 2 && slope.numel() == x.dims()[1] && slope.numel() > 1 {
            let mut dims = vec![slope.numel()];
            dims.extend(std::iter::repeat_n(1, x.rank() - 2));
            slope = slope.reshape_to(dims)?;
        }
        let zero = self.scalar(0, x.dtype());
        one(x.lt(&zero)?.where_(&x.mul(&slope)?, &x)?)
    }

    fn hard_swish(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let hs = x.mul(&self.scalar(1.0 / 6.0, d))?.add(&self.scalar(0.5, d))?.clamp(Some(0.0), Some(1.0))?;
        one(x.mul(&hs)?)
    }

    fn shrink(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let (lambd, bias) = (self.float("lambd", 0.5)?, self.float("bias", 0.0)?);
        let lo = x.lt(&self.scalar(-lambd, d))?;
        let hi = x.gt(&self.scalar(lambd, d))?;
        let zero = self.scalar(0, d);
        let up = x.add(&self.scalar(bias, d))?;
        let down = x.sub(&self.scalar(bias, d))?;
        one(lo.where_(&up, &hi.where_(&down, &zero)?)?)
    }

    fn celu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let alpha = self.float("alpha", 1.0)?;
        let neg = x.div(&self.scalar(alpha, d))?.exp()?.sub(&self.scalar(1, d))?.mul(&self.scalar(alpha, d))?;
        let zero = self.scalar(0, d);
        one(x.maximum(&zero)?.add(&neg.minimum(&zero)?)?)
    }

    fn thresholded_relu(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let d = x.dtype();
        let alpha = self.float("alpha", 1.0)?;
        one(x.gt(&self.scalar(alpha, d))?.where_(&x, &self.scalar(0, d))?)
    }

    fn mish(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let sp = x.softplus(1.0, 20.0)?;
        one(x.mul(&sp.tanh()?)?)
    }

    /// Local response normalization across channels: `x / (bias + alpha /
    /// size * sum of x^2 over the channel window)^beta`, the window sum an
    /// average pool (padding counted) times its size.
    fn lrn(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        if x.rank() < 3 {
            return invalid(format!("LRN needs an [N, C, ...] input, got {}", x.shape()));
        }
        let size = self.int("size", 0)?;
        if size <= 0 {
            return invalid(format!("LRN size {size}"));
        }
        let size = size as usize;
        let d = x.dtype();
        let (alpha, beta, bias) = (self.float("alpha", 1e-4)?, self.float("beta", 0.75)?, self.float("bias", 1.0)?);
        let (n, c) = (x.dims()[0], x.dims()[1]);
        let rest: usize = x.dims()[2..].iter().product();
        let sq = x.mul(&x)?.reshape_to([n, 1, c, rest])?;
        let before = (size - 1) / 2;
        let after = size - 1 - before;
        let attrs = PoolAttrs {
            kind: PoolKind::Avg { count_include_pad: true },
            kernel: vec![size, 1],
            strides: vec![1, 1],
            pads_begin: vec![before, 0],
            pads_end: vec![after, 0],
            dilations: vec![1, 1],
            ceil_mode: false,
        };
        let sum = sq.pool(attrs)?.reshape_to(x.shape().clone())?;
        let denom = sum.mul(&self.scalar(alpha, d))?.add(&self.scalar(bias, d))?.pow(&self.scalar(beta, d))?;
        one(x.div(&denom)?)
    }

    fn instance_norm(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let (scale, bias) = (self.input(1)?, self.input(2)?);
        if x.rank() < 3 {
            return invalid(format!("InstanceNormalization needs an [N, C, ...] input, got {}", x.shape()));
        }
        let eps = self.float("epsilon", 1e-5)?;
        let axes: Vec<isize> = (2..x.rank() as isize).collect();
        let mean = x.mean(&axes, true)?;
        let centered = x.sub(&mean)?;
        let var = centered.mul(&centered)?.mean(&axes, true)?;
        let inv = var.add(&self.scalar(eps, x.dtype()))?.rsqrt()?;
        let mut col = vec![x.dims()[1]];
        col.extend(std::iter::repeat_n(1, x.rank() - 2));
        let y = centered.mul(&inv)?.mul(&scale.reshape_to(col.clone())?)?.add(&bias.reshape_to(col)?)?;
        one(y)
    }

    fn split(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let axis = self.norm_axis(self.int("axis", 0)?, x.rank())?;
        let n = x.dims()[axis];
        let sizes = if self.opset() >= 13 { self.host_ints(1)? } else { self.ints("split")? };
        let sizes: Vec<usize> = match sizes {
            Some(s) if !s.is_empty() => {
                if s.iter().any(|&v| v < 0) || s.iter().sum::<i64>() != n as i64 {
                    return invalid(format!("Split sizes {s:?} for a dim of {n}"));
                }
                s.iter().map(|&v| v as usize).collect()
            }
            _ => {
                let parts = match self.attr("num_outputs") {
                    Some(Attr::Int(k)) if *k > 0 => *k as usize,
                    _ => self.ctx.n_out.max(1),
                };
                // Equal parts; the last one smaller when `n` does not divide (opset 18).
                let each = n.div_ceil(parts);
                (0..parts).map(|i| each.min(n.saturating_sub(i * each))).collect()
            }
        };
        let mut out = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for s in sizes {
            out.push(x.narrow(axis as isize, start, s)?);
            start += s;
        }
        Ok(out)
    }

    fn depth_to_space(&self, to_space: bool) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let b = self.int("blocksize", 0)?;
        if x.rank() != 4 || b <= 0 {
            return invalid(format!("{} of {} with blocksize {b}", self.op, x.shape()));
        }
        let b = b as usize;
        let (n, c, h, w) = (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]);
        if to_space {
            if c % (b * b) != 0 {
                return invalid(format!("DepthToSpace: {c} channels for blocksize {b}"));
            }
            let c2 = c / (b * b);
            let y = if self.string("mode", "DCR")? == "CRD" {
                x.reshape_to([n, c2, b, b, h, w])?.permute(&[0, 1, 4, 2, 5, 3])?
            } else {
                x.reshape_to([n, b, b, c2, h, w])?.permute(&[0, 3, 4, 1, 5, 2])?
            };
            one(y.reshape_to([n, c2, h * b, w * b])?)
        } else {
            if h % b != 0 || w % b != 0 {
                return invalid(format!("SpaceToDepth: {h}x{w} for blocksize {b}"));
            }
            let y = x.reshape_to([n, c, h / b, b, w / b, b])?.permute(&[0, 3, 5, 1, 2, 4])?;
            one(y.reshape_to([n, c * b * b, h / b, w / b])?)
        }
    }

    /// Negative indices count from the end of a dim of `n`.
    fn wrap_indices(&self, idx: &Tensor, n: usize) -> R<Tensor> {
        let d = idx.dtype();
        let zero = self.scalar(0, d);
        Ok(idx.lt(&zero)?.where_(&idx.add(&self.scalar(n as i64, d))?, idx)?)
    }

    fn gather_elements(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let idx = self.input(1)?;
        let axis = self.norm_axis(self.int("axis", 0)?, x.rank())?;
        let idx = self.wrap_indices(&idx, x.dims()[axis])?;
        one(x.gather_torch(axis as isize, &idx)?)
    }

    /// ScatterND: the rows of `data` named by `indices` replaced by (or,
    /// with `reduction = add`, increased by) `updates`, through an index
    /// add over the flattened leading dims.
    fn scatter_nd(&self) -> R<Vec<Tensor>> {
        let data = self.input(0)?;
        let idx = self.input(1)?;
        let upd = self.input(2)?;
        let reduction = self.string("reduction", "none")?;
        let k = *idx.dims().last().unwrap_or(&0);
        if idx.rank() == 0 || k == 0 || k > data.rank() {
            return invalid(format!("ScatterND indices {} for data {}", idx.shape(), data.shape()));
        }
        let lead: usize = data.dims()[..k].iter().product();
        let tail: Vec<usize> = data.dims()[k..].to_vec();
        let rows: usize = idx.dims()[..idx.rank() - 1].iter().product();
        // Linear row index: sum of idx[.., j] * stride_j (negative wrapped).
        let id = idx.dtype();
        let mut lin: Option<Tensor> = None;
        let mut stride = 1usize;
        let idx2 = idx.reshape_to([rows, k])?;
        for j in (0..k).rev() {
            let col = self.wrap_indices(&idx2.narrow(1, j, 1)?.reshape_to([rows])?, data.dims()[j])?;
            let term = col.mul(&self.scalar(stride as i64, id))?;
            lin = Some(match lin {
                None => term,
                Some(l) => l.add(&term)?,
            });
            stride *= data.dims()[j];
        }
        let Some(lin) = lin else { return invalid("ScatterND without index columns") };
        let mut flat_dims = vec![lead];
        flat_dims.extend(&tail);
        let mut upd_dims = vec![rows];
        upd_dims.extend(&tail);
        let flat = data.reshape_to(flat_dims.clone())?;
        let upd = upd.reshape_to(upd_dims)?;
        let zeros = Tensor::zeros(flat_dims, data.dtype(), self.dev())?;
        let added = zeros.scatter_add(0, &lin, &upd)?;
        let out = match reduction.as_str() {
            "add" => flat.add(&added)?,
            "none" => {
                let ones = Tensor::ones(vec![rows], data.dtype(), self.dev())?;
                let hit = Tensor::zeros(vec![lead], data.dtype(), self.dev())?.scatter_add(0, &lin, &ones)?;
                let mut col = vec![lead];
                col.extend(std::iter::repeat_n(1, tail.len()));
                let hit = hit.reshape_to(col)?.gt(&self.scalar(0, data.dtype()))?;
                hit.where_(&added, &flat)?
            }
            other => return unsupported(format!("ScatterND reduction {other:?}")),
        };
        one(out.reshape_to(data.shape().clone())?)
    }

    fn top_k(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let k = if self.opset() >= 10 {
            self.host_ints(1)?.and_then(|v| v.first().copied())
        } else {
            Some(self.int("k", -1)?)
        };
        let Some(k) = k.filter(|&k| k >= 0) else { return invalid("TopK needs a k >= 0") };
        let axis = self.norm_axis(self.int("axis", -1)?, x.rank())?;
        let largest = self.int("largest", 1)? != 0;
        let (v, i) = x.topk(k as usize, axis as isize, largest)?;
        Ok(vec![v, i.cast(self.index_dtype())?])
    }

    /// Convolution over 3 spatial dims as a sum over the depth taps of
    /// 2-d convolutions with the output depths folded into the batch.
    #[allow(clippy::too_many_arguments)] // The attributes of one convolution, as ONNX spells them.
    fn conv3d(
        &self,
        x: &Tensor,
        w: &Tensor,
        strides: &[usize],
        dil: &[usize],
        pb: &[usize],
        pe: &[usize],
        groups: usize,
    ) -> R<Tensor> {
        let (n, c, dpt) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        let (o, kd) = (w.dims()[0], w.dims()[2]);
        let xp = if pb[0] > 0 || pe[0] > 0 {
            let zero = self.scalar(0, x.dtype());
            let mut before = vec![0; 5];
            let mut after = vec![0; 5];
            before[2] = pb[0];
            after[2] = pe[0];
            Tensor::record(Op::Pad { before, after, mode: PadMode::Constant }, &[x, &zero])?
        } else {
            x.clone()
        };
        let dp = dpt + pb[0] + pe[0];
        let eff = dil[0] * (kd - 1) + 1;
        if dp < eff {
            return invalid(format!("Conv: depth {dpt} padded to {dp} is smaller than the kernel's {eff}"));
        }
        let od = (dp - eff) / strides[0] + 1;
        let attrs = ConvAttrs {
            strides: [strides[1], strides[2]],
            pads: [pb[1], pb[2], pe[1], pe[2]],
            dilations: [dil[1], dil[2]],
            groups,
        };
        let (h, wd) = (x.dims()[3], x.dims()[4]);
        let mut acc: Option<Tensor> = None;
        for t in 0..kd {
            let start = (t * dil[0]) as i64;
            let mut starts = vec![0i64; 5];
            let mut steps = vec![1i64; 5];
            let mut lens = xp.dims().to_vec();
            starts[2] = start;
            steps[2] = strides[0] as i64;
            lens[2] = od;
            let xs = Tensor::record(Op::Slice { starts, steps, lens }, &[&xp])?;
            // [N, C, od, H, W] -> [N * od, C, H, W].
            let xs = xs.permute(&[0, 2, 1, 3, 4])?.reshape_to([n * od, c, h, wd])?;
            let wt = w.narrow(2, t, 1)?.squeeze(&[2])?;
            let y = xs.conv2d(&wt, attrs.clone())?;
            acc = Some(match acc {
                None => y,
                Some(a) => a.add(&y)?,
            });
        }
        let Some(y) = acc else { return invalid("Conv with an empty kernel") };
        let (oh, ow) = (y.dims()[2], y.dims()[3]);
        Ok(y.reshape_to([n, od, o, oh, ow])?.permute(&[0, 2, 1, 3, 4])?)
    }

    fn conv_transpose(&self) -> R<Vec<Tensor>> {
        let (mut x, mut w) = (self.input(0)?, self.input(1)?);
        let bias = self.opt_input(2)?;
        let nsp = x.rank().saturating_sub(2);
        if !(1..=2).contains(&nsp) || w.rank() != x.rank() {
            return unsupported(format!("ConvTranspose over {nsp} spatial dims (1-D and 2-D are supported)"));
        }
        let kernel: Vec<usize> = w.dims()[2..].to_vec();
        let strides = self.spatial_attr("strides", nsp, 1)?;
        let dil = self.spatial_attr("dilations", nsp, 1)?;
        let groups = self.int("group", 1)?.max(1) as usize;
        let out_pad: Vec<usize> = match self.ints("output_padding")? {
            Some(v) if v.len() == nsp && v.iter().all(|&p| p >= 0) => v.iter().map(|&p| p as usize).collect(),
            Some(v) => return invalid(format!("output_padding {v:?}")),
            None => vec![0; nsp],
        };
        let input: Vec<usize> = x.dims()[2..].to_vec();
        let full: Vec<usize> =
            (0..nsp).map(|i| strides[i] * (input[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1).collect();
        let auto = self.string("auto_pad", "NOTSET")?;
        let (mut pb, mut pe) = (vec![0usize; nsp], vec![0usize; nsp]);
        if let Some(shape) = self.ints("output_shape")? {
            let shape: Vec<usize> = shape.iter().rev().take(nsp).rev().map(|&s| s.max(0) as usize).collect();
            for i in 0..nsp {
                let total = full[i].checked_sub(shape[i]).ok_or_else(|| {
                    MapError::Invalid(format!("ConvTranspose output_shape {shape:?} larger than {full:?}"))
                })?;
                (pb[i], pe[i]) =
                    if auto == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) };
            }
        } else if auto == "SAME_UPPER" || auto == "SAME_LOWER" {
            for i in 0..nsp {
                let total = full[i].saturating_sub(input[i] * strides[i]);
                (pb[i], pe[i]) =
                    if auto == "SAME_UPPER" { (total / 2, total - total / 2) } else { (total - total / 2, total / 2) };
            }
        } else if auto == "NOTSET" {
            let pads = self.ints("pads")?.unwrap_or_else(|| vec![0; 2 * nsp]);
            if pads.len() != 2 * nsp || pads.iter().any(|&p| p < 0) {
                return invalid(format!("pads {pads:?}"));
            }
            for i in 0..nsp {
                (pb[i], pe[i]) = (pads[i] as usize, pads[nsp + i] as usize);
            }
        }
        // The full transposed convolution (no padding), then the window
        // `[pb, pb + out)` of it, zeros past its end for output padding.
        if nsp == 1 {
            x = x.unsqueeze(2)?;
            w = w.unsqueeze(2)?;
        }
        let two = |v: &[usize], fill: usize| if nsp == 2 { [v[0], v[1]] } else { [fill, v[0]] };
        let attrs = crate::nn::ConvTranspose2dAttrs {
            stride: two(&strides, 1),
            padding: [0, 0],
            output_padding: [0, 0],
            dilation: two(&dil, 1),
            groups,
        };
        let mut y = crate::nn::conv_transpose2d(&x, &w, None, &attrs)?;
        let mut y_dims_sp: Vec<usize> = y.dims()[2..].to_vec();
        if nsp == 1 {
            y_dims_sp.remove(0);
            y = y.squeeze(&[2])?;
        }
        for i in 0..nsp {
            let out_len = full[i] - pb[i] - pe[i];
            let start = pb[i];
            let have = y_dims_sp[i].saturating_sub(start);
            let ax = 2 + i;
            let take = out_len.min(have);
            y = y.narrow(ax as isize, start, take)?;
            if take < out_len {
                let mut before = vec![0; y.rank()];
                let mut after = vec![0; y.rank()];
                before[ax] = 0;
                after[ax] = out_len - take;
                let zero = self.scalar(0, y.dtype());
                y = Tensor::record(Op::Pad { before, after, mode: PadMode::Constant }, &[&y, &zero])?;
            }
        }
        if let Some(b) = bias {
            let mut dims = vec![1, b.numel()];
            dims.extend(std::iter::repeat_n(1, nsp));
            y = y.add(&b.reshape_to(dims)?)?;
        }
        one(y)
    }

    // ---- resizing ----------------------------------------------------------

    /// `Resize` (and `Upsample`, its older form): separable per axis; each
    /// output position reads a few taps of its axis (nearest: one, linear:
    /// two, cubic: four) through a gather of host-computed indices, weighted
    /// by host-computed coefficients.
    fn resize(&self) -> R<Vec<Tensor>> {
        let x = self.input(0)?;
        let r = x.rank();
        let upsample = self.op == "Upsample";
        let mode = self.string("mode", "nearest")?;
        let (ctm, nearest_mode) = if upsample || self.opset() < 11 {
            ("asymmetric".to_string(), if upsample { "floor" } else { "round_prefer_floor" }.to_string())
        } else {
            (
                self.string("coordinate_transformation_mode", "half_pixel")?,
                self.string("nearest_mode", "round_prefer_floor")?,
            )
        };
        if self.int("antialias", 0)? != 0 {
            return unsupported("Resize with antialias = 1");
        }
        let axes: Vec<usize> = match self.ints("axes")? {
            Some(a) => a.iter().map(|&a| self.norm_axis(a, r)).collect::<R<_>>()?,
            None => (0..r).collect(),
        };
        let (scales, sizes, roi) = if upsample {
            let s = if self.opset() >= 9 {
                self.host(1)?.map(HostTensor::to_f64s)
            } else {
                match self.attr("scales") {
                    Some(Attr::Floats(v)) => Some(v.clone()),
                    _ => None,
                }
            };
            (s, None, None)
        } else if self.opset() < 11 {
            (self.host(1)?.map(HostTensor::to_f64s), None, None)
        } else {
            fn nonempty(h: Option<&HostTensor>) -> Option<&HostTensor> {
                h.filter(|t| t.numel() > 0)
            }
            (
                nonempty(self.host(2)?).map(HostTensor::to_f64s),
                nonempty(self.host(3)?).map(HostTensor::to_i64s),
                nonempty(self.host(1)?).map(HostTensor::to_f64s),
            )
        };
        let dims = x.dims().to_vec();
        // Per resized axis: (input length, output length, scale).
        let mut plan: Vec<(usize, usize, f64)> = dims.iter().map(|&n| (n, n, 1.0)).collect();
        match (&scales, &sizes) {
            (Some(s), None) => {
                if s.len() != axes.len() {
                    return invalid(format!("Resize: {} scales for {} axes", s.len(), axes.len()));
                }
                for (&a, &sc) in axes.iter().zip(s) {
                    if !(sc > 0.0 && sc.is_finite()) {
                        return invalid(format!("Resize scale {sc}"));
                    }
                    let m = (dims[a] as f64 * sc).floor();
                    plan[a] = (dims[a], m as usize, sc);
                }
            }
            (None, Some(sz)) => {
                if sz.len() != axes.len() || sz.iter().any(|&v| v < 0) {
                    return invalid(format!("Resize: sizes {sz:?} for {} axes", axes.len()));
                }
                let policy = self.string("keep_aspect_ratio_policy", "stretch")?;
                let ratios: Vec<f64> = axes.iter().zip(sz).map(|(&a, &m)| m as f64 / dims[a].max(1) as f64).collect();
                let fit = match policy.as_str() {
                    "stretch" => None,
                    "not_larger" => ratios.iter().copied().reduce(f64::min),
                    "not_smaller" => ratios.iter().copied().reduce(f64::max),
                    other => return invalid(format!("keep_aspect_ratio_policy {other:?}")),
                };
                for (k, &a) in axes.iter().enumerate() {
                    plan[a] = match fit {
                        None => (dims[a], sz[k] as usize, ratios[k]),
                        Some(sc) => (dims[a], (sc * dims[a] as f64 + 0.5).floor() as usize, sc),
                    };
                }
            }
            (Some(_), Some(_)) => return invalid("Resize with both scales and sizes"),
            (None, None) => return invalid("Resize needs scales or sizes"),
        }
        let cubic_a = self.float("cubic_coeff_a", -0.75)?;
        let exclude = self.int("exclude_outside", 0)? != 0;
        let extrapolation = self.float("extrapolation_value", 0.0)?;
        if mode != "nearest" && !x.dtype().is_float() {
            return unsupported(format!("Resize mode {mode} of {} values", x.dtype()));
        }
        let mut y = x.clone();
        for (a, &(n, m, scale)) in plan.iter().enumerate() {
            let roi_ab = roi.as_ref().and_then(|roi| {
                let k = axes.iter().position(|&x| x == a)?;
                Some((roi.get(k).copied()?, roi.get(k + axes.len()).copied()?))
            });
            let taps = resize_taps(n, m, scale, &ctm, &mode, &nearest_mode, cubic_a, exclude, roi_ab)
                .map_err(MapError::Invalid)?;
            if m == n
                && taps.iter().all(|t| t.len() == 1 && t[0].1 == 1.0)
                && taps.iter().enumerate().all(|(i, t)| t[0].0 == i as i64)
            {
                continue;
            }
            y = self.apply_taps(&y, a, &taps, extrapolation)?;
        }
        one(y)
    }

    /// `sum over t of gather(x, axis, idx_t) * w_t`; a position whose tap
    /// list is empty (outside a crop) takes `extrapolation`.
    fn apply_taps(&self, x: &Tensor, axis: usize, taps: &[Vec<(i64, f64)>], extrapolation: f64) -> R<Tensor> {
        let m = taps.len();
        let width = taps.iter().map(Vec::len).max().unwrap_or(0);
        let mut bcast = vec![1usize; x.rank()];
        bcast[axis] = m;
        let d = x.dtype();
        let outside: Vec<bool> = taps.iter().map(Vec::is_empty).collect();
        let mut acc: Option<Tensor> = None;
        for t in 0..width {
            let idx: Vec<i32> = taps.iter().map(|v| v.get(t).map(|p| p.0 as i32).unwrap_or(0)).collect();
            let w: Vec<f32> = taps.iter().map(|v| v.get(t).map(|p| p.1 as f32).unwrap_or(0.0)).collect();
            let g = x.gather(axis as isize, &Tensor::from_slice(&idx, [m], self.dev())?)?;
            let term = if width == 1 && w.iter().all(|&v| v == 1.0) {
                g
            } else {
                g.mul(&Tensor::from_slice(&w, bcast.clone(), self.dev())?.cast(d)?)?
            };
            acc = Some(match acc {
                None => term,
                Some(a) => a.add(&term)?,
            });
        }
        let Some(mut y) = acc else { return invalid("Resize to an empty axis of taps") };
        if outside.iter().any(|&o| o) {
            let mask = Tensor::from_slice(&outside, bcast, self.dev())?;
            y = mask.where_(&self.scalar(extrapolation, d), &y)?;
        }
        Ok(y)
    }

    // ---- recurrent layers --------------------------------------------------

    /// `LSTM`, `GRU` and `RNN` with ONNX's gate layouts (LSTM `iofc`, GRU
    /// `zrh`), directions, initial states, peepholes, `clip`, sequence
    /// lengths (steps past a sequence's length keep its state and output
    /// zeros) and both layouts. The input projection of every step is one
    /// product; the steps are unrolled (the sequence length is known when
    /// the node is recorded).
    fn recurrent(&self) -> R<Vec<Tensor>> {
        let kind = self.op;
        let gates = match kind {
            "LSTM" => 4,
            "GRU" => 3,
            _ => 1,
        };
        let mut x = self.input(0)?;
        let (w, r) = (self.input(1)?, self.input(2)?);
        let b = self.opt_input(3)?;
        let lens = self.opt_input(4)?;
        let mut h0 = self.opt_input(5)?;
        let mut c0 = if kind == "LSTM" { self.opt_input(6)? } else { None };
        let p = if kind == "LSTM" { self.opt_input(7)? } else { None };
        let batch_major = self.int("layout", 0)? != 0;
        if x.rank() != 3 || w.rank() != 3 || r.rank() != 3 {
            return invalid(format!("{kind}: X {}, W {}, R {}", x.shape(), w.shape(), r.shape()));
        }
        if batch_major {
            x = x.permute(&[1, 0, 2])?;
            h0 = h0.map(|t| t.permute(&[1, 0, 2])).transpose()?;
            c0 = c0.map(|t| t.permute(&[1, 0, 2])).transpose()?;
        }
        let (seq, batch) = (x.dims()[0], x.dims()[1]);
        let dirs = w.dims()[0];
        let hidden = r.dims()[2];
        if w.dims()[1] != gates * hidden || r.dims()[1] != gates * hidden {
            return invalid(format!("{kind}: W {} and R {} for hidden size {hidden}", w.shape(), r.shape()));
        }
        let direction = self.string("direction", "forward")?;
        let order: Vec<bool> = match (direction.as_str(), dirs) {
            ("forward", 1) => vec![false],
            ("reverse", 1) => vec![true],
            ("bidirectional", 2) => vec![false, true],
            (d, n) => return invalid(format!("{kind}: direction {d:?} with {n} weight sets")),
        };
        let clip = match self.attr("clip") {
            Some(Attr::Float(c)) => Some(*c),
            _ => None,
        };
        let linear_before_reset = self.int("linear_before_reset", 0)? != 0;
        let d = x.dtype();
        let zeros = || Tensor::zeros([batch, hidden], d, self.dev());
        // mask[t]: [batch, 1], true where step t is inside the sequence.
        let masks: Option<Vec<Tensor>> = match &lens {
            Some(l) => {
                let l = l.cast(DType::I32)?.reshape_to([batch, 1])?;
                Some((0..seq).map(|t| l.gt(&self.scalar(t as i64, DType::I32))).collect::<Result<_, _>>()?)
            }
            None => None,
        };
        let mut ys = Vec::with_capacity(dirs);
        let mut hs = Vec::with_capacity(dirs);
        let mut cs = Vec::with_capacity(dirs);
        for (di, &reverse) in order.iter().enumerate() {
            let wd = w.narrow(0, di, 1)?.reshape_to([gates * hidden, w.dims()[2]])?;
            let rd = r.narrow(0, di, 1)?.reshape_to([gates * hidden, hidden])?;
            let (wb, rb) = match &b {
                Some(b) => {
                    let bd = b.narrow(0, di, 1)?.reshape_to([2 * gates * hidden])?;
                    (Some(bd.narrow(0, 0, gates * hidden)?), Some(bd.narrow(0, gates * hidden, gates * hidden)?))
                }
                None => (None, None),
            };
            // Every step's input projection at once: [seq, batch, gates * H].
            let mut xw = x.matmul(&wd.t()?)?;
            if let Some(wb) = &wb {
                xw = xw.add(wb)?;
            }
            let rt = rd.t()?;
            let gate = |t: &Tensor, k: usize| t.narrow(1, k * hidden, hidden);
            let clipped = |t: Tensor| -> R<Tensor> {
                Ok(match clip {
                    Some(c) => t.clamp(Some(-c), Some(c))?,
                    None => t,
                })
            };
            let mut h = match &h0 {
                Some(h0) => h0.narrow(0, di, 1)?.reshape_to([batch, hidden])?,
                None => zeros()?,
            };
            let mut c = match &c0 {
                Some(c0) => c0.narrow(0, di, 1)?.reshape_to([batch, hidden])?,
                None => zeros()?,
            };
            let peep = match &p {
                Some(p) => {
                    let pd = p.narrow(0, di, 1)?.reshape_to([3 * hidden])?;
                    Some((pd.narrow(0, 0, hidden)?, pd.narrow(0, hidden, hidden)?, pd.narrow(0, 2 * hidden, hidden)?))
                }
                None => None,
            };
            let mut y_steps: Vec<Option<Tensor>> = vec![None; seq];
            let steps: Vec<usize> = if reverse { (0..seq).rev().collect() } else { (0..seq).collect() };
            for t in steps {
                let xt = xw.narrow(0, t, 1)?.reshape_to([batch, gates * hidden])?;
                let (h_new, c_new) = match kind {
                    "LSTM" => {
                        let mut g = xt.add(&h.matmul(&rt)?)?;
                        if let Some(rb) = &rb {
                            g = g.add(rb)?;
                        }
                        let (mut gi, mut go, mut gf, gc) = (gate(&g, 0)?, gate(&g, 1)?, gate(&g, 2)?, gate(&g, 3)?);
                        if let Some((pi, _, pf)) = &peep {
                            gi = gi.add(&c.mul(pi)?)?;
                            gf = gf.add(&c.mul(pf)?)?;
                        }
                        let i = clipped(gi)?.sigmoid()?;
                        let f = clipped(gf)?.sigmoid()?;
                        let cand = clipped(gc)?.tanh()?;
                        let c_new = f.mul(&c)?.add(&i.mul(&cand)?)?;
                        if let Some((_, po, _)) = &peep {
                            go = go.add(&c_new.mul(po)?)?;
                        }
                        let o = clipped(go)?.sigmoid()?;
                        (o.mul(&c_new.tanh()?)?, Some(c_new))
                    }
                    "GRU" => {
                        let rz = rt.narrow(1, 0, 2 * hidden)?;
                        let rh = rt.narrow(1, 2 * hidden, hidden)?;
                        let mut hr = h.matmul(&rz)?;
                        if let Some(rb) = &rb {
                            hr = hr.add(&rb.narrow(0, 0, 2 * hidden)?)?;
                        }
                        let z = clipped(gate(&xt, 0)?.add(&gate(&hr, 0)?)?)?.sigmoid()?;
                        let rr = clipped(gate(&xt, 1)?.add(&gate(&hr, 1)?)?)?.sigmoid()?;
                        let rbh = match &rb {
                            Some(rb) => Some(rb.narrow(0, 2 * hidden, hidden)?),
                            None => None,
                        };
                        let recur = if linear_before_reset {
                            let mut hh = h.matmul(&rh)?;
                            if let Some(rbh) = &rbh {
                                hh = hh.add(rbh)?;
                            }
                            rr.mul(&hh)?
                        } else {
                            let mut hh = rr.mul(&h)?.matmul(&rh)?;
                            if let Some(rbh) = &rbh {
                                hh = hh.add(rbh)?;
                            }
                            hh
                        };
                        let cand = clipped(gate(&xt, 2)?.add(&recur)?)?.tanh()?;
                        let one_minus = self.scalar(1, d).sub(&z)?;
                        (one_minus.mul(&cand)?.add(&z.mul(&h)?)?, None)
                    }
                    _ => {
                        let mut g = xt.add(&h.matmul(&rt)?)?;
                        if let Some(rb) = &rb {
                            g = g.add(rb)?;
                        }
                        (clipped(g)?.tanh()?, None)
                    }
                };
                match &masks {
                    Some(ms) => {
                        let keep = &ms[t];
                        y_steps[t] = Some(keep.where_(&h_new, &self.scalar(0, d))?);
                        h = keep.where_(&h_new, &h)?;
                        if let Some(cn) = c_new {
                            c = keep.where_(&cn, &c)?;
                        }
                    }
                    None => {
                        y_steps[t] = Some(h_new.clone());
                        h = h_new;
                        if let Some(cn) = c_new {
                            c = cn;
                        }
                    }
                }
            }
            let ys_d: Vec<Tensor> = y_steps.into_iter().flatten().collect();
            let refs: Vec<&Tensor> = ys_d.iter().collect();
            ys.push(if refs.is_empty() {
                Tensor::zeros([0, batch, hidden], d, self.dev())?
            } else {
                Tensor::stack(&refs, 0)?
            });
            hs.push(h);
            cs.push(c);
        }
        let stack = |v: &[Tensor], axis: isize| -> R<Tensor> {
            let refs: Vec<&Tensor> = v.iter().collect();
            Ok(Tensor::stack(&refs, axis)?)
        };
        // Y: [seq, dirs, batch, H]; Y_h, Y_c: [dirs, batch, H].
        let mut y = stack(&ys, 1)?;
        let mut yh = stack(&hs, 0)?;
        let mut yc = stack(&cs, 0)?;
        if batch_major {
            y = y.permute(&[2, 0, 1, 3])?;
            yh = yh.permute(&[1, 0, 2])?;
            yc = yc.permute(&[1, 0, 2])?;
        }
        Ok(if kind == "LSTM" { vec![y, yh, yc] } else { vec![y, yh] })
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
        if !(1..=3).contains(&nsp) || w.rank() != x.rank() {
            return unsupported(format!("Conv over {nsp} spatial dims (1-D, 2-D and 3-D are supported)"));
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
        if nsp == 3 {
            let mut y = self.conv3d(&x, &w, &strides, &dil, &pb, &pe, groups)?;
            if let Some(b) = bias {
                y = y.add(&b.reshape_to([1, b.numel(), 1, 1, 1])?)?;
            }
            return one(y);
        }
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
        if max && self.ctx.n_out > 1 {
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
        let idt = self.index_dtype();
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
            let t = Tensor::iota(dims.clone(), d, idt, self.dev())?.mul(&self.scalar(s as i64, idt))?;
            flat = Some(match flat {
                None => t,
                Some(f) => f.add(&t)?,
            });
        }
        let flat = flat.unwrap_or(Tensor::zeros(Shape::scalar(), idt, self.dev())?);
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
        let lowt = Tensor::scalar(low, x.dtype(), self.dev());
        let xp = Tensor::record(
            Op::Pad { before: before.clone(), after: after.clone(), mode: PadMode::Constant },
            &[x, &lowt],
        )?;
        let neg = self.scalar(-1, idt);
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

/// The taps `(source index, weight)` of each of `m` output positions of an
/// axis of `n` resized by `scale` (ONNX Resize: the coordinate transform,
/// then nearest / linear / cubic). An empty list: outside a
/// `tf_crop_and_resize` box (the extrapolation value).
#[allow(clippy::too_many_arguments)] // Resize's attributes, as ONNX spells them.
fn resize_taps(
    n: usize,
    m: usize,
    scale: f64,
    ctm: &str,
    mode: &str,
    nearest_mode: &str,
    cubic_a: f64,
    exclude_outside: bool,
    roi: Option<(f64, f64)>,
) -> Result<Vec<Vec<(i64, f64)>>, String> {
    let (nf, mf) = (n as f64, m as f64);
    let last = n as i64 - 1;
    let mut out = Vec::with_capacity(m);
    for i in 0..m {
        let fi = i as f64;
        let x = match ctm {
            "half_pixel" => (fi + 0.5) / scale - 0.5,
            "half_pixel_symmetric" => {
                let adj = mf / (scale * nf);
                let center = nf / 2.0;
                center * (1.0 - adj) + (fi + 0.5) / scale - 0.5
            }
            "pytorch_half_pixel" => {
                if m > 1 {
                    (fi + 0.5) / scale - 0.5
                } else {
                    0.0
                }
            }
            "align_corners" => {
                if m == 1 {
                    0.0
                } else {
                    fi * (nf - 1.0) / (mf - 1.0)
                }
            }
            "asymmetric" => fi / scale,
            "tf_half_pixel_for_nn" => (fi + 0.5) / scale,
            "tf_crop_and_resize" => {
                let (s, e) = roi.unwrap_or((0.0, 1.0));
                if m > 1 {
                    s * (nf - 1.0) + fi * (e - s) * (nf - 1.0) / (mf - 1.0)
                } else {
                    0.5 * (s + e) * (nf - 1.0)
                }
            }
            other => return Err(format!("coordinate_transformation_mode {other:?}")),
        };
        if ctm == "tf_crop_and_resize" && (x < 0.0 || x > nf - 1.0) {
            out.push(vec![]);
            continue;
        }
        let clampi = |v: i64| v.clamp(0, last.max(0));
        let taps = match mode {
            "nearest" => {
                let frac = x - x.floor();
                let v = match nearest_mode {
                    "round_prefer_floor" => {
                        if frac == 0.5 {
                            x.floor()
                        } else {
                            x.round()
                        }
                    }
                    "round_prefer_ceil" => {
                        if frac == 0.5 {
                            x.ceil()
                        } else {
                            x.round()
                        }
                    }
                    "floor" => x.floor(),
                    "ceil" => x.ceil(),
                    other => return Err(format!("nearest_mode {other:?}")),
                };
                vec![(clampi(v as i64), 1.0)]
            }
            "linear" => {
                let xc = x.clamp(0.0, (nf - 1.0).max(0.0));
                let x0 = xc.floor();
                let w1 = xc - x0;
                let i0 = x0 as i64;
                if w1 == 0.0 {
                    vec![(clampi(i0), 1.0)]
                } else {
                    vec![(clampi(i0), 1.0 - w1), (clampi(i0 + 1), w1)]
                }
            }
            "cubic" => {
                let x0 = x.floor();
                let t = x - x0;
                let a = cubic_a;
                let c = |d: f64| {
                    let d = d.abs();
                    if d <= 1.0 {
                        ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0
                    } else if d < 2.0 {
                        ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a
                    } else {
                        0.0
                    }
                };
                let mut taps: Vec<(i64, f64)> = (-1..=2).map(|k| (x0 as i64 + k, c(t - k as f64))).collect();
                if exclude_outside {
                    taps.retain(|&(j, _)| (0..=last).contains(&j));
                    let sum: f64 = taps.iter().map(|p| p.1).sum();
                    if sum != 0.0 {
                        taps.iter_mut().for_each(|p| p.1 /= sum);
                    }
                } else {
                    taps.iter_mut().for_each(|p| p.0 = clampi(p.0));
                }
                taps
            }
            other => return Err(format!("Resize mode {other:?}")),
        };
        out.push(taps);
    }
    Ok(out)
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

    fn td(dtype: DType, shape: &[usize], data: &[f64]) -> HostTensor {
        let data: Vec<ScalarValue> = data
            .iter()
            .map(|&v| match dtype {
                d if d.is_float() => ScalarValue::Float(v),
                DType::Bool => ScalarValue::Bool(v != 0.0),
                d if d.is_unsigned_int() => ScalarValue::UInt(v as u64),
                _ => ScalarValue::Int(v as i64),
            })
            .collect();
        HostTensor::from_scalars(&data, dtype, shape.to_vec())
    }

    struct Case {
        opset: i64,
        attrs: BTreeMap<String, Attr>,
        inputs: Vec<Option<HostTensor>>,
        n_out: usize,
    }

    fn case(opset: i64, attrs: &[(&str, Attr)], inputs: Vec<Option<HostTensor>>, n_out: usize) -> Case {
        let attrs: BTreeMap<String, Attr> = attrs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        Case { opset, attrs, inputs, n_out }
    }

    /// Lowers `op` with host inputs (uploaded as the node reads them).
    fn lower(op: &str, c: &Case, dev: &Device) -> R<Vec<Tensor>> {
        let slots: Vec<Option<Slot>> = c.inputs.iter().map(|h| h.clone().map(Slot::host)).collect();
        let refs: Vec<Option<&Slot>> = slots.iter().map(Option::as_ref).collect();
        let ctx = NodeCtx { op, opset: c.opset, attrs: &c.attrs, inputs: &refs, n_out: c.n_out, dev, narrow: false };
        super::lower(&ctx)?
            .into_iter()
            .map(|v| match v {
                Value::Tensor(t) => Ok(t),
                Value::Host(h) => Ok(Tensor::from_bytes(h.bytes.to_vec(), h.ty(), dev)?),
            })
            .collect()
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
