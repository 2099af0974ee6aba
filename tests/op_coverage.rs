//! Op coverage: every op of the closed op set, enumerated from the IR's
//! `ALL` constants ([`OpKind::ALL`], [`UnaryOp::ALL`], [`BinaryOp::ALL`],
//! ...), has a WGSL lowering that naga accepts under both kernel-form
//! profiles (or is declared a CPU-fallback op in [`WGPU_FALLBACK`]), a CPU
//! kernel, and a gradient rule (or is declared non-differentiable in
//! `autograd::NON_DIFFERENTIABLE_*`). Adding an op makes [`examples`] fail
//! to compile until the op has an example here, and then this test fails
//! until every layer handles it. The fuzzer's and gradcheck's lists are
//! checked against `ALL` in their own files (`fuzzer_covers_every_elementwise_op`,
//! `every_differentiable_elementwise_op_is_gradchecked`).
//!
//! Needs no adapter: lowering is a pure function, and the CPU backend runs
//! the examples.

mod common;

use lazuli::autograd::{NON_DIFFERENTIABLE_BINARY, NON_DIFFERENTIABLE_UNARY};
use lazuli::ir::fusion::{self, FusionLimits};
use lazuli::ir::{
    ArgReduceOp, AttentionAttrs, AttentionMask, AttentionPart, BinaryOp, CollectiveOp, ConvAttrs, DType, Graph, NodeId,
    Op, OpKind, PadMode, PoolAttrs, PoolKind, RandomDist, ReduceOp, ScalarValue, Shape, UnaryOp, ValueType,
};
use lazuli::prelude::*;
use lazuli::Backend;
use lazuli_wgpu::codegen::{lower, LowerLimits};
use std::sync::Arc;

/// Op kinds the wgpu backend never lowers: they always run on the CPU
/// fallback. None today.
const WGPU_FALLBACK: &[OpKind] = &[];

/// Collectives: no backend runs them (both refuse them in `supports` and
/// in `compile`, never treating them as an identity); the executor runs
/// them through a registered `Collective` (`tests/collective.rs`).
const COLLECTIVES: &[OpKind] = &[OpKind::AllReduce];

/// One example graph of an op, with the values of its scalar slots.
struct Example {
    name: String,
    graph: Graph,
    scalars: Vec<ScalarValue>,
}

/// A graph under construction.
struct G {
    g: Graph,
    scalars: Vec<ScalarValue>,
}

impl G {
    fn new() -> G {
        G { g: Graph::new(), scalars: Vec::new() }
    }
    fn param(&mut self, dims: &[usize], d: DType) -> NodeId {
        self.g.param(ValueType::new(dims, d))
    }
    fn scalar(&mut self, v: ScalarValue, d: DType) -> NodeId {
        self.scalars.push(v.cast(d));
        self.g.scalar(d)
    }
    fn push(&mut self, op: Op, inputs: &[NodeId]) -> NodeId {
        self.g.push(op.clone(), inputs).unwrap_or_else(|e| panic!("{op:?}: {e}"))
    }
    /// The example `name` with outputs `outs`.
    fn done(mut self, name: impl Into<String>, outs: &[NodeId]) -> Example {
        self.g.outputs = outs.to_vec();
        Example { name: name.into(), graph: self.g, scalars: self.scalars }
    }
}

/// The operand dtype an elementwise op is exercised on.
fn unary_dtype(op: UnaryOp) -> DType {
    if op == UnaryOp::Not {
        DType::Bool
    } else {
        DType::F32
    }
}

fn binary_dtype(op: BinaryOp) -> DType {
    if op.is_logical() {
        DType::Bool
    } else {
        DType::F32
    }
}

/// A view `op` of a `[2, 3]` parameter, negated so that it is inlined
/// into a kernel rather than passed through.
fn view(name: &str, op: Op, dims: &[usize]) -> Example {
    let mut g = G::new();
    let x = g.param(dims, DType::F32);
    let v = g.push(op, &[x]);
    let y = g.push(Op::Unary(UnaryOp::Neg), &[v]);
    g.done(name, &[y])
}

/// Examples of every op of `kind`: one per sub-op and attribute family.
fn examples(kind: OpKind) -> Vec<Example> {
    let f = DType::F32;
    match kind {
        OpKind::Parameter => {
            let mut g = G::new();
            let x = g.param(&[2, 3], f);
            let y = g.push(Op::Unary(UnaryOp::Exp), &[x]);
            vec![g.done("parameter", &[y])]
        }
        OpKind::Constant => {
            let mut g = G::new();
            let x = g.param(&[2, 3], f);
            let c = g.push(Op::Constant(ScalarValue::Float(1.0), f), &[]);
            let y = g.push(Op::Binary(BinaryOp::Add), &[x, c]);
            vec![g.done("constant", &[y])]
        }
        OpKind::ScalarParam => {
            let mut g = G::new();
            let x = g.param(&[2, 3], f);
            let s = g.scalar(ScalarValue::Float(0.37), f);
            let y = g.push(Op::Binary(BinaryOp::Mul), &[x, s]);
            vec![g.done("scalar", &[y])]
        }
        OpKind::Iota => {
            let mut g = G::new();
            let y = g.push(Op::Iota { shape: Shape::new([3, 4]), axis: 1, dtype: f }, &[]);
            vec![g.done("iota", &[y])]
        }
        OpKind::Random => [RandomDist::Uniform, RandomDist::Normal]
            .into_iter()
            .map(|dist| {
                let mut g = G::new();
                let seed = g.scalar(ScalarValue::UInt(7), DType::U32);
                let step = g.scalar(ScalarValue::UInt(1), DType::U32);
                let y = g.push(Op::Random { shape: Shape::new([10]), dist }, &[seed, step]);
                g.done(format!("random {dist:?}"), &[y])
            })
            .collect(),
        OpKind::Unary => UnaryOp::ALL
            .iter()
            .map(|&op| {
                let mut g = G::new();
                let x = g.param(&[2, 3], unary_dtype(op));
                let y = g.push(Op::Unary(op), &[x]);
                g.done(op.name(), &[y])
            })
            .collect(),
        OpKind::Binary => BinaryOp::ALL
            .iter()
            .map(|&op| {
                let mut g = G::new();
                let a = g.param(&[2, 3], binary_dtype(op));
                let b = g.param(&[3], binary_dtype(op));
                let y = g.push(Op::Binary(op), &[a, b]);
                g.done(op.name(), &[y])
            })
            .collect(),
        OpKind::Where => {
            let mut g = G::new();
            let c = g.param(&[2, 3], DType::Bool);
            let a = g.param(&[2, 3], f);
            let b = g.param(&[3], f);
            let y = g.push(Op::Where, &[c, a, b]);
            vec![g.done("where", &[y])]
        }
        OpKind::Cast => [(f, DType::I32), (DType::I32, f), (DType::Bool, f), (f, DType::Bool)]
            .into_iter()
            .map(|(from, to)| {
                let mut g = G::new();
                let x = g.param(&[2, 3], from);
                let y = g.push(Op::Cast(to), &[x]);
                g.done(format!("cast {from} -> {to}"), &[y])
            })
            .collect(),
        OpKind::Reduce => ReduceOp::ALL
            .iter()
            .map(|&op| {
                let mut g = G::new();
                let x = g.param(&[2, 3], f);
                let y = g.push(Op::Reduce { op, axes: vec![1], keepdim: false }, &[x]);
                g.done(format!("reduce {}", op.name()), &[y])
            })
            .collect(),
        OpKind::ArgReduce => ArgReduceOp::ALL
            .iter()
            .map(|&op| {
                let mut g = G::new();
                let x = g.param(&[2, 3], f);
                let y = g.push(Op::ArgReduce { op, axis: 1, keepdim: false, select_last: false }, &[x]);
                g.done(format!("{op:?}"), &[y])
            })
            .collect(),
        OpKind::CumSum => {
            let mut g = G::new();
            let x = g.param(&[2, 3], f);
            let y = g.push(Op::CumSum { axis: 1, exclusive: false, reverse: false }, &[x]);
            vec![g.done("cumsum", &[y])]
        }
        OpKind::Softmax => [false, true]
            .into_iter()
            .map(|log| {
                let mut g = G::new();
                let x = g.param(&[2, 3], f);
                let y = g.push(Op::Softmax { axis: 1, log }, &[x]);
                g.done(if log { "log_softmax" } else { "softmax" }, &[y])
            })
            .collect(),
        OpKind::MatMul => {
            let mut g = G::new();
            let a = g.param(&[2, 3], f);
            let b = g.param(&[3, 4], f);
            let y = g.push(Op::MatMul, &[a, b]);
            vec![g.done("matmul", &[y])]
        }
        OpKind::Reshape => vec![view("reshape", Op::Reshape(Shape::new([3, 2])), &[2, 3])],
        OpKind::Permute => vec![view("permute", Op::Permute(vec![1, 0]), &[2, 3])],
        OpKind::Expand => vec![view("expand", Op::Expand(Shape::new([2, 3])), &[1, 3])],
        OpKind::Slice => {
            vec![view("slice", Op::Slice { starts: vec![1, 2], steps: vec![1, -1], lens: vec![1, 2] }, &[2, 3])]
        }
        OpKind::Concat => {
            let mut g = G::new();
            let a = g.param(&[2, 3], f);
            let b = g.param(&[1, 3], f);
            let y = g.push(Op::Concat { axis: 0 }, &[a, b]);
            let y = g.push(Op::Unary(UnaryOp::Neg), &[y]);
            vec![g.done("concat", &[y])]
        }
        OpKind::Pad => [PadMode::Constant, PadMode::Reflect, PadMode::Edge]
            .into_iter()
            .map(|mode| {
                let mut g = G::new();
                let x = g.param(&[2, 3], f);
                let mut operands = vec![x];
                if mode == PadMode::Constant {
                    operands.push(g.push(Op::Constant(ScalarValue::Float(0.0), f), &[]));
                }
                let y = g.push(Op::Pad { before: vec![1, 1], after: vec![0, 1], mode }, &operands);
                let y = g.push(Op::Unary(UnaryOp::Neg), &[y]);
                g.done(format!("pad {mode:?}"), &[y])
            })
            .collect(),
        OpKind::Gather => {
            let mut g = G::new();
            let x = g.param(&[4, 3], f);
            let i = g.param(&[2], DType::I32);
            let y = g.push(Op::Gather { axis: 0 }, &[x, i]);
            vec![g.done("gather", &[y])]
        }
        OpKind::ScatterAdd => {
            let mut g = G::new();
            let base = g.param(&[4, 3], f);
            let i = g.param(&[2], DType::I32);
            let src = g.param(&[2, 3], f);
            let y = g.push(Op::ScatterAdd { axis: 0 }, &[base, i, src]);
            vec![g.done("scatter_add", &[y])]
        }
        OpKind::Conv2d => {
            let mut g = G::new();
            let x = g.param(&[1, 2, 5, 5], f);
            let w = g.param(&[3, 2, 3, 3], f);
            let y = g.push(Op::Conv2d(ConvAttrs::default()), &[x, w]);
            vec![g.done("conv2d", &[y])]
        }
        OpKind::Pool | OpKind::PoolGrad => [PoolKind::Max, PoolKind::Avg { count_include_pad: false }]
            .into_iter()
            .map(|pk| {
                let attrs = PoolAttrs::new(pk, &[2, 2]);
                let mut g = G::new();
                let x = g.param(&[1, 2, 4, 4], f);
                let y = if kind == OpKind::Pool {
                    g.push(Op::Pool(attrs), &[x])
                } else {
                    let dy = g.param(&[1, 2, 2, 2], f);
                    g.push(Op::PoolGrad(attrs), &[x, dy])
                };
                g.done(format!("{kind:?} {pk:?}"), &[y])
            })
            .collect(),
        OpKind::Attention => AttentionPart::ALL
            .iter()
            .map(|&part| {
                let attrs = AttentionAttrs { causal: true, mask: AttentionMask::None };
                let mut g = G::new();
                let mut operands = vec![g.param(&[1, 4, 8], f), g.param(&[1, 4, 8], f), g.param(&[1, 4, 8], f)];
                operands.push(g.scalar(ScalarValue::Float(0.35), f));
                if part.is_grad() {
                    operands.push(g.param(&[1, 4, 8], f));
                    operands.push(g.param(&[1, 4], f));
                    operands.push(g.param(&[1, 4], f));
                }
                let y = g.push(Op::Attention { attrs, part }, &operands);
                g.done(format!("attention {part:?}"), &[y])
            })
            .collect(),
        OpKind::Dequantize => {
            let mut g = G::new();
            let w = g.param(&[3, 34], DType::U8);
            let y = g.push(Op::Dequantize(lazuli::ir::QuantFormat::Q8_0), &[w]);
            vec![g.done("dequantize", &[y])]
        }
        OpKind::QuantMatMul => {
            let mut g = G::new();
            let x = g.param(&[2, 32], f);
            let w = g.param(&[3, 18], DType::U8);
            let y = g.push(Op::QuantMatMul(lazuli::ir::QuantFormat::Q4_0), &[x, w]);
            vec![g.done("quant_matmul", &[y])]
        }
        OpKind::WriteAt => {
            let mut g = G::new();
            let base = g.param(&[1, 2, 4, 2], f);
            let update = g.param(&[1, 2, 1, 2], f);
            let pos = g.scalar(ScalarValue::Int(2), DType::I32);
            let y = g.push(Op::WriteAt { axis: 2 }, &[base, update, pos]);
            vec![g.done("write_at", &[y])]
        }
        OpKind::PrefixAttention => {
            let mut g = G::new();
            let q = g.param(&[1, 2, 1, 4], f);
            let k = g.param(&[1, 1, 4, 4], f);
            let v = g.param(&[1, 1, 4, 4], f);
            let scale = g.scalar(ScalarValue::Float(0.5), f);
            let pos = g.scalar(ScalarValue::Int(2), DType::I32);
            let y = g.push(Op::PrefixAttention, &[q, k, v, scale, pos]);
            vec![g.done("prefix_attention", &[y])]
        }
        OpKind::AllReduce => CollectiveOp::ALL
            .iter()
            .map(|&op| {
                let mut g = G::new();
                let x = g.param(&[2, 3], f);
                let e = g.push(Op::Unary(UnaryOp::Exp), &[x]);
                let y = g.push(Op::AllReduce { op, bucket: 0 }, &[e]);
                g.done(Op::AllReduce { op, bucket: 0 }.name(), &[y])
            })
            .collect(),
    }
}

/// Host bytes of a parameter: small values of each dtype (indices 0).
fn input_bytes(ty: &ValueType) -> Vec<u8> {
    let n = ty.shape.numel();
    match ty.dtype {
        DType::F32 => (0..n).flat_map(|k| (0.25 + 0.125 * (k % 5) as f32).to_le_bytes()).collect(),
        DType::I32 => vec![0; 4 * n],
        DType::Bool => (0..n).flat_map(|k| [(k % 2) as u8]).collect(),
        // Quantized blocks: small bytes (f16 scales of 2^-14 scale, finite).
        DType::U8 => (0..n).map(|k| (k % 7) as u8).collect(),
        other => panic!("no example input of {other}"),
    }
}

/// Every kernel of `e` lowers under both profiles to WGSL naga accepts.
fn lowers(e: &Example) -> Result<(), String> {
    let v = e.graph.clone().verify().map_err(|err| format!("verify: {err}"))?;
    let plan = fusion::plan(&v, &FusionLimits::default());
    for limits in [LowerLimits::gpu(), LowerLimits::software()] {
        for k in &plan.kernels {
            let w = lower(k, &v, &limits).map_err(|err| err.to_string())?;
            for src in w.pre.iter().map(|p| &p.source).chain([&w.source]) {
                lazuli_wgpu::validate_wgsl(src).map_err(|err| format!("naga: {err}\n{src}"))?;
            }
        }
    }
    Ok(())
}

/// The CPU backend compiles and runs `e`, and its outputs have the types
/// of the graph's outputs.
fn runs_on_cpu(e: &Example) -> Result<(), String> {
    let be = lazuli_cpu::CpuBackend::new();
    let v = e.graph.clone().verify().map_err(|err| format!("verify: {err}"))?;
    let inputs = e
        .graph
        .params
        .iter()
        .map(|ty| be.upload(&input_bytes(ty), ty))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| err.to_string())?;
    let exe = be.compile(&v).map_err(|err| err.to_string())?;
    let outs = be.execute(exe.as_ref(), inputs, &e.scalars).map_err(|err| err.to_string())?;
    for (o, &id) in outs.iter().zip(&e.graph.outputs) {
        let bytes = be.download(o).map_err(|err| err.to_string())?;
        let node = e.graph.node(id);
        let want = node.shape.numel() * node.dtype.size_bytes();
        if bytes.len() != want {
            return Err(format!("{} bytes, want {want}", bytes.len()));
        }
    }
    Ok(())
}

/// A collective: neither backend's `supports` accepts it and both refuse
/// to compile it (an `Unsupported` error naming it).
fn refused_by_every_backend(e: &Example) -> Result<(), String> {
    let v = e.graph.clone().verify().map_err(|err| format!("verify: {err}"))?;
    let node = e.graph.nodes().iter().find(|n| n.op.is_collective()).ok_or("no collective")?;
    let inputs: Vec<_> = node.inputs.iter().map(|x| e.graph.node(*x)).collect();
    let mut backends: Vec<Arc<dyn Backend>> = vec![Arc::new(lazuli_cpu::CpuBackend::new())];
    if let Some(dev) = common::wgpu() {
        backends.push(dev.backend().clone());
    }
    // The WGSL side says so too, adapter or not.
    if lazuli_wgpu::codegen::node_supported(node) {
        return Err("codegen::node_supported accepts it".into());
    }
    for be in backends {
        if be.supports(node, &inputs) {
            return Err(format!("{} supports it", be.name()));
        }
        match be.compile(&v) {
            Err(lazuli::BackendError::Unsupported { op, .. }) if op == node.op.name() => {}
            Err(other) => return Err(format!("{} refuses it with {other}", be.name())),
            Ok(_) => return Err(format!("{} compiles it", be.name())),
        }
    }
    Ok(())
}

#[test]
fn every_op_lowers_to_wgsl_and_runs_on_the_cpu() {
    let mut failures = Vec::new();
    let mut seen = 0;
    for &kind in OpKind::ALL {
        let all = examples(kind);
        assert!(!all.is_empty(), "{kind:?} has no example");
        for e in &all {
            seen += 1;
            let kinds: Vec<OpKind> = e.graph.nodes().iter().map(|n| n.op.kind()).collect();
            assert!(kinds.contains(&kind), "example {} has no {kind:?} node", e.name);
            if COLLECTIVES.contains(&kind) {
                if let Err(err) = refused_by_every_backend(e) {
                    failures.push(format!("{}: {err}", e.name));
                }
                continue;
            }
            if let Err(err) = runs_on_cpu(e) {
                failures.push(format!("{} on the CPU: {err}", e.name));
            }
            match (lowers(e), WGPU_FALLBACK.contains(&kind)) {
                (Err(err), false) => failures.push(format!("{}: no WGSL lowering: {err}", e.name)),
                (Ok(()), true) => failures.push(format!("{}: lowers, yet is declared a fallback op", e.name)),
                _ => {}
            }
        }
    }
    assert!(failures.is_empty(), "{} of {seen} examples fail:\n{}", failures.len(), failures.join("\n"));
}

/// A leaf of `n` f32 values in (0.3, 0.9), where every float function and
/// its gradient is defined, that requires gradients.
fn leaf(dev: &Device, n: usize, salt: usize) -> Tensor {
    let v: Vec<f32> = (0..n).map(|k| 0.3 + 0.6 * (((k + salt) * 7) % 11) as f32 / 11.0).collect();
    Tensor::from_slice(&v, [n], dev).unwrap().requires_grad_(true).unwrap()
}

/// Every elementwise op has a gradient rule that gives finite gradients to
/// float operands, or is declared non-differentiable (its result then
/// carries no gradient).
#[test]
fn every_elementwise_op_has_a_gradient_rule_or_is_declared_without_one() {
    let dev = Device::cpu();
    let finite = |t: &Tensor, what: &str| {
        let g = t.grad().unwrap_or_else(|| panic!("{what}: no gradient"));
        let v = g.to_vec::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{what}: gradient {v:?}");
    };
    for &op in UnaryOp::ALL {
        if unary_dtype(op) != DType::F32 {
            assert!(NON_DIFFERENTIABLE_UNARY.contains(&op), "{op:?} takes no float operand, so it needs no rule");
            continue;
        }
        let x = leaf(&dev, 5, 0);
        let y = Tensor::record(Op::Unary(op), &[&x]).unwrap();
        if NON_DIFFERENTIABLE_UNARY.contains(&op) {
            assert!(!y.requires_grad(), "{op:?} is declared non-differentiable, yet tracks gradients");
            continue;
        }
        y.sum(&[], false).unwrap().backward().unwrap_or_else(|e| panic!("{op:?}: {e}"));
        finite(&x, op.name());
    }
    for &op in BinaryOp::ALL {
        if binary_dtype(op) != DType::F32 {
            assert!(NON_DIFFERENTIABLE_BINARY.contains(&op), "{op:?} takes no float operand, so it needs no rule");
            continue;
        }
        let (a, b) = (leaf(&dev, 5, 0), leaf(&dev, 5, 3));
        let y = Tensor::record(Op::Binary(op), &[&a, &b]).unwrap();
        if NON_DIFFERENTIABLE_BINARY.contains(&op) {
            assert!(!y.requires_grad(), "{op:?} is declared non-differentiable, yet tracks gradients");
            continue;
        }
        y.sum(&[], false).unwrap().backward().unwrap_or_else(|e| panic!("{op:?}: {e}"));
        finite(&a, op.name());
        finite(&b, op.name());
    }
}

// ---- logaddexp and softplus: the op added by following the checklist ----

fn torch_logaddexp(a: f64, b: f64) -> f64 {
    if a.is_infinite() && a == b {
        a
    } else {
        a.max(b) + (-(a - b).abs()).exp().ln_1p()
    }
}

#[test]
fn logaddexp_matches_torch_on_every_device() {
    let inf = f32::INFINITY;
    let a = [0.0f32, 1.0, 1000.0, -1000.0, 0.0, inf, -inf, inf, -inf, f32::NAN, 2.0, 88.0];
    let b = [0.0f32, 2.0, 1000.0, -1000.0, -40.0, inf, -inf, -inf, 3.0, 1.0, f32::NAN, 89.0];
    for dev in common::devices() {
        let x = Tensor::from_slice(&a, [a.len()], &dev).unwrap();
        let y = Tensor::from_slice(&b, [b.len()], &dev).unwrap();
        let got = x.logaddexp(&y).unwrap().to_vec::<f32>().unwrap();
        for (k, g) in got.iter().enumerate() {
            let want = torch_logaddexp(a[k] as f64, b[k] as f64) as f32;
            let ok = (want.is_nan() && g.is_nan()) || *g == want || (g - want).abs() <= 1e-6 * (1.0 + want.abs());
            assert!(ok, "on {}: logaddexp({}, {}) = {g}, want {want}", dev.name(), a[k], b[k]);
        }
        // A scalar operand and an integer tensor (refused, naming the op).
        let s = x.logaddexp_scalar(0.0).unwrap().to_vec::<f32>().unwrap();
        assert!((s[0] - std::f32::consts::LN_2).abs() < 1e-6, "{s:?}");
        let i = Tensor::from_slice(&[1i32, 2], [2], &dev).unwrap();
        let e = i.logaddexp(&i).unwrap_err();
        assert!(e.to_string().contains("logaddexp"), "{e}");
    }
}

#[test]
fn softplus_matches_torch_semantics() {
    let xs = [-30.0f32, -5.0, -1.0, -0.0, 0.5, 3.0, 9.9, 10.1, 25.0, 80.0];
    let torch = |x: f64, beta: f64, threshold: f64| {
        if beta * x > threshold {
            x
        } else {
            (beta * x).exp().ln_1p() / beta
        }
    };
    for dev in common::devices() {
        let x = Tensor::from_slice(&xs, [xs.len()], &dev).unwrap();
        for (beta, threshold) in [(1.0, 20.0), (2.0, 20.0), (0.5, 5.0)] {
            let got = x.softplus(beta, threshold).unwrap().to_vec::<f32>().unwrap();
            for (k, g) in got.iter().enumerate() {
                let want = torch(xs[k] as f64, beta, threshold) as f32;
                assert!(
                    (g - want).abs() <= 2e-6 * (1.0 + want.abs()) || (want != 0.0 && ((g - want) / want).abs() < 1e-5),
                    "on {}: softplus({}, beta {beta}, threshold {threshold}) = {g}, want {want}",
                    dev.name(),
                    xs[k]
                );
            }
        }
    }
}

#[test]
fn softplus_and_logaddexp_gradients() {
    let dev = Device::cpu();
    let xs = [-30.0f32, -2.0, 0.0, 1.5, 19.0, 25.0];
    let x = Tensor::from_slice(&xs, [xs.len()], &dev).unwrap().requires_grad_(true).unwrap();
    x.softplus(1.0, 20.0).unwrap().sum(&[], false).unwrap().backward().unwrap();
    let g = x.grad().unwrap().to_vec::<f32>().unwrap();
    // sigmoid(x) below the threshold, 1 above it.
    for (k, &v) in xs.iter().enumerate() {
        let want = if v > 20.0 { 1.0 } else { 1.0 / (1.0 + (-v as f64).exp()) as f32 };
        assert!((g[k] - want).abs() < 1e-6, "softplus'({v}) = {}, want {want}", g[k]);
    }
    // d/da logaddexp(a, b) = e^(a - out): the two parts sum to 1.
    let a = Tensor::from_slice(&[0.5f32, -3.0, 40.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    let b = Tensor::from_slice(&[0.5f32, 2.0, -40.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    a.logaddexp(&b).unwrap().sum(&[], false).unwrap().backward().unwrap();
    let (ga, gb) = (a.grad().unwrap().to_vec::<f32>().unwrap(), b.grad().unwrap().to_vec::<f32>().unwrap());
    assert!((ga[0] - 0.5).abs() < 1e-6, "{ga:?}");
    assert!((ga[1] - 1.0 / (1.0 + 5f32.exp())).abs() < 1e-6, "{ga:?}");
    for k in 0..3 {
        assert!((ga[k] + gb[k] - 1.0).abs() < 1e-6, "{ga:?} {gb:?}");
    }
}

/// Whether `op` on operands of dtype `d` passes type inference.
fn infers(op: Op, arity: usize, d: DType) -> bool {
    let mut g = Graph::new();
    let inputs: Vec<NodeId> = (0..arity).map(|_| g.param(ValueType::new([2], d))).collect();
    g.push(op, &inputs).is_ok()
}

/// The dtype rule of every elementwise op agrees with its reference
/// semantics (`ir::semantics`): an op the reference defines on integers
/// is accepted on integer operands, and one it leaves undefined there (a
/// float-only function) is refused by type inference, so no backend is
/// ever asked to compute it. Forgetting the dtype rule of a new op fails
/// here.
#[test]
fn every_elementwise_dtype_rule_agrees_with_the_reference() {
    use lazuli::ir::semantics;
    for op in UnaryOp::ALL.iter().copied() {
        let floats = semantics::float_unary(op).is_some();
        assert_eq!(infers(Op::Unary(op), 1, DType::F32), floats, "{op:?} on f32");
        let ints = semantics::int_unary(op, 3).is_some();
        // `not` is defined on bools only; the integer reference is silent.
        if op != UnaryOp::Not {
            assert_eq!(infers(Op::Unary(op), 1, DType::I32), ints, "{op:?} on i32: reference defines it: {ints}");
        }
    }
    for op in BinaryOp::ALL.iter().copied() {
        if op.is_comparison() || op.is_logical() {
            continue; // Bool results, checked by `compare` and `logical`.
        }
        let floats = semantics::float_binary(op).is_some();
        assert_eq!(infers(Op::Binary(op), 2, DType::F32), floats, "{op:?} on f32");
        let ints = semantics::int_binary(op, 7, 2).is_some();
        assert_eq!(infers(Op::Binary(op), 2, DType::I32), ints, "{op:?} on i32: reference defines it: {ints}");
    }
}
