//! Gradient checks: for every differentiable op, the analytic gradient of
//! `sum(f(x) * w)` (fixed random weights `w`) matches central finite
//! differences computed in f64 on the CPU backend; the autodiff semantics
//! (no_grad, detach, accumulation, zero_grad, leaves across assign); and
//! wgpu-vs-CPU agreement of f32 gradients.

mod common;

use lazuli::ir::{BinaryOp, ConvAttrs, Op, PadMode, PoolAttrs, PoolKind, UnaryOp};
use lazuli::prelude::*;
use lazuli::{nn, no_grad, Result};

/// Deterministic values in `[lo, hi)` as f64 (exact f32 values).
fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f64> {
    common::rand_vec(n, seed, lo, hi).into_iter().map(f64::from).collect()
}

/// Distinct values, well apart (no ties, no kinks between neighbours), shuffled.
fn distinct(n: usize, seed: u64) -> Vec<f64> {
    let r = common::rand_vec(n, seed, 0.0, 1.0);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| r[a].total_cmp(&r[b]));
    let mut v = vec![0.0; n];
    for (rank, &i) in idx.iter().enumerate() {
        v[i] = rank as f64 * 0.25 - n as f64 * 0.125 + 0.05;
    }
    v
}

type Input = (Vec<f64>, Vec<usize>);

fn leaf(dev: &Device, (v, s): &Input, grad: bool) -> Tensor {
    let t = Tensor::from_slice(v, s.clone(), dev).unwrap();
    if grad {
        t.requires_grad_(true).unwrap()
    } else {
        t
    }
}

/// `sum(out * w)` with weights fixed by the output's size.
fn weighted(out: &Tensor) -> Result<Tensor> {
    let out = out.cast(DType::F64)?;
    let w = vals(out.numel(), 99, 0.5, 1.5);
    let wt = Tensor::from_slice(&w, out.shape().clone(), out.device())?;
    out.mul(&wt)?.sum(&[], false)
}

/// Checks `f`'s gradients w.r.t. every input against central differences.
#[track_caller]
fn check(name: &str, inputs: &[Input], f: impl Fn(&Device, &[Tensor]) -> Result<Tensor>) {
    check_tol(name, inputs, f, 1e-6, 1e-7, 1e-5)
}

#[track_caller]
fn check_tol(
    name: &str,
    inputs: &[Input],
    f: impl Fn(&Device, &[Tensor]) -> Result<Tensor>,
    eps: f64,
    atol: f64,
    rtol: f64,
) {
    let dev = Device::cpu();
    let leaves: Vec<Tensor> = inputs.iter().map(|i| leaf(&dev, i, true)).collect();
    dev.manual_seed(7);
    let loss = weighted(&f(&dev, &leaves).unwrap()).unwrap();
    loss.backward().unwrap();
    let eval = |vs: &[Input]| -> f64 {
        no_grad(|| {
            let ts: Vec<Tensor> = vs.iter().map(|i| leaf(&dev, i, false)).collect();
            dev.manual_seed(7);
            weighted(&f(&dev, &ts).unwrap()).unwrap().item::<f64>().unwrap()
        })
    };
    for (i, l) in leaves.iter().enumerate() {
        let analytic: Vec<f64> = match l.grad() {
            Some(g) => {
                assert_eq!(g.shape(), l.shape(), "{name}: gradient shape of input {i}");
                g.to_vec::<f64>().unwrap()
            }
            None => vec![0.0; l.numel()],
        };
        let mut vs: Vec<Input> = inputs.to_vec();
        for (j, &a) in analytic.iter().enumerate() {
            let x0 = inputs[i].0[j];
            vs[i].0[j] = x0 + eps;
            let up = eval(&vs);
            vs[i].0[j] = x0 - eps;
            let down = eval(&vs);
            vs[i].0[j] = x0;
            let numeric = (up - down) / (2.0 * eps);
            assert!(
                (a - numeric).abs() <= atol + rtol * numeric.abs().max(a.abs()),
                "{name}: input {i} element {j}: analytic {a}, numeric {numeric}"
            );
        }
    }
}

fn inp(v: Vec<f64>, shape: &[usize]) -> Input {
    (v, shape.to_vec())
}

// ---- unary elementwise ----

macro_rules! unary_checks {
    ($($test:ident: $method:ident in ($lo:expr, $hi:expr);)*) => {$(
        #[test]
        fn $test() {
            check(stringify!($method), &[inp(vals(12, 1, $lo, $hi), &[3, 4])], |_, x| x[0].$method());
        }
    )*};
}

unary_checks! {
    grad_neg: neg in (-2.0, 2.0);
    grad_exp: exp in (-2.0, 2.0);
    grad_log: log in (0.2, 3.0);
    grad_sqrt: sqrt in (0.2, 3.0);
    grad_rsqrt: rsqrt in (0.2, 3.0);
    grad_reciprocal: reciprocal in (0.3, 3.0);
    grad_sigmoid: sigmoid in (-3.0, 3.0);
    grad_tanh: tanh in (-2.0, 2.0);
    grad_gelu: gelu in (-3.0, 3.0);
    grad_gelu_tanh: gelu_tanh in (-3.0, 3.0);
    grad_erf: erf in (-2.0, 2.0);
    grad_sin: sin in (-3.0, 3.0);
    grad_cos: cos in (-3.0, 3.0);
}

#[test]
fn grad_abs_and_relu_away_from_zero() {
    check("abs", &[inp(distinct(12, 2), &[3, 4])], |_, x| x[0].abs());
    check("relu", &[inp(distinct(12, 3), &[3, 4])], |_, x| x[0].relu());
}

#[test]
fn grad_piecewise_constant_ops_are_zero() {
    let x = inp(vec![-1.3, -0.6, 0.2, 0.7, 1.4, 2.6], &[6]);
    check("floor", std::slice::from_ref(&x), |_, x| x[0].floor());
    check("ceil", std::slice::from_ref(&x), |_, x| x[0].ceil());
    check("round", std::slice::from_ref(&x), |_, x| x[0].round());
    check("sign", std::slice::from_ref(&x), |_, x| x[0].sign());
    // A non-float result ends the graph: the input gets no gradient.
    let dev = Device::cpu();
    let t = leaf(&dev, &x, true);
    assert!(!t.gt_scalar(0.0).unwrap().requires_grad());
    assert!(!t.argmax(0, false).unwrap().requires_grad());
}

/// Inputs on which `op`'s gradient is checked, or `None` for the ops
/// autograd declares non-differentiable (`NON_DIFFERENTIABLE_UNARY`). An
/// exhaustive match: a new op does not compile here until it has a domain.
fn unary_domain(op: UnaryOp) -> Option<Input> {
    use UnaryOp::*;
    let smooth = |lo: f32, hi: f32| Some(inp(vals(12, 1, lo, hi), &[3, 4]));
    match op {
        Neg | Exp | Tanh | Erf => smooth(-2.0, 2.0),
        Log | Sqrt | Rsqrt => smooth(0.2, 3.0),
        Reciprocal => smooth(0.3, 3.0),
        Sigmoid | Gelu | GeluTanh | Sin | Cos => smooth(-3.0, 3.0),
        // Kinks at 0 and steps at integers: distinct values away from them.
        Abs | Relu => Some(inp(distinct(12, 2), &[3, 4])),
        Floor | Ceil | Round | Sign => Some(inp(vec![-1.3, -0.6, 0.2, 0.7, 1.4, 2.6], &[6])),
        Not | IsNan | IsInf => None,
    }
}

/// Inputs on which `op`'s gradient is checked (broadcasting), or `None`
/// for the ops autograd declares non-differentiable.
fn binary_domain(op: BinaryOp) -> Option<Vec<Input>> {
    use BinaryOp::*;
    match op {
        Add | Sub | Mul | LogAddExp => Some(bin_inputs(-2.0, 2.0)),
        Div | Pow => Some(bin_inputs(0.5, 2.0)),
        Maximum | Minimum => {
            Some(vec![inp(distinct(12, 11), &[3, 4]), inp(distinct(4, 12).iter().map(|v| v + 0.1).collect(), &[1, 4])])
        }
        Mod | Rem => Some(vec![
            inp(vec![5.3, -5.3, 2.2, -7.9, 3.7, -1.1], &[6]),
            inp(vec![2.1, 2.1, -1.5, 2.5, -1.6, 0.7], &[6]),
        ]),
        Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor => None,
    }
}

/// Every elementwise op of the IR's `ALL` lists is gradient-checked, or is
/// one autograd declares non-differentiable: the list here is derived from
/// `ALL` and checked against autograd's.
#[test]
fn every_differentiable_elementwise_op_is_gradchecked() {
    use lazuli::autograd::{NON_DIFFERENTIABLE_BINARY, NON_DIFFERENTIABLE_UNARY};
    for &op in UnaryOp::ALL {
        let Some(x) = unary_domain(op) else {
            assert!(NON_DIFFERENTIABLE_UNARY.contains(&op), "{op:?}: no domain, yet differentiable");
            continue;
        };
        assert!(!NON_DIFFERENTIABLE_UNARY.contains(&op), "{op:?}: declared non-differentiable, yet checked");
        check(op.name(), &[x], |_, x| Tensor::record(Op::Unary(op), &[&x[0]]));
    }
    for &op in BinaryOp::ALL {
        let Some(ins) = binary_domain(op) else {
            assert!(NON_DIFFERENTIABLE_BINARY.contains(&op), "{op:?}: no domain, yet differentiable");
            continue;
        };
        assert!(!NON_DIFFERENTIABLE_BINARY.contains(&op), "{op:?}: declared non-differentiable, yet checked");
        check(op.name(), &ins, |_, x| Tensor::record(Op::Binary(op), &[&x[0], &x[1]]));
    }
}

#[test]
fn grad_logaddexp_and_softplus() {
    check("logaddexp", &bin_inputs(-2.0, 2.0), |_, x| x[0].logaddexp(&x[1]));
    // Far apart operands: one gradient is ~1, the other ~e^-30.
    let far = [inp(vec![30.0, -30.0, 0.5], &[3]), inp(vec![0.0, 0.0, 0.5], &[3])];
    check("logaddexp far apart", &far, |_, x| x[0].logaddexp(&x[1]));
    // Both sides of the threshold (beta x > threshold is linear).
    let x = inp(vec![-25.0, -3.0, -0.5, 0.25, 2.0, 9.0, 11.0], &[7]);
    check("softplus", std::slice::from_ref(&x), |_, x| x[0].softplus(1.0, 20.0));
    check("softplus beta 2 threshold 10", &[x], |_, x| x[0].softplus(2.0, 10.0));
}

// ---- binary elementwise with broadcasting ----

fn bin_inputs(lo: f32, hi: f32) -> Vec<Input> {
    vec![inp(vals(12, 4, lo, hi), &[3, 4]), inp(vals(4, 5, lo, hi), &[1, 4])]
}

#[test]
fn grad_add_sub_mul_div_broadcast() {
    check("add", &bin_inputs(-2.0, 2.0), |_, x| x[0].add(&x[1]));
    check("sub", &bin_inputs(-2.0, 2.0), |_, x| x[0].sub(&x[1]));
    check("mul", &bin_inputs(-2.0, 2.0), |_, x| x[0].mul(&x[1]));
    check("div", &bin_inputs(0.5, 2.0), |_, x| x[0].div(&x[1]));
    // Rank-extending broadcast on both sides: [2, 1, 3] with [4, 1].
    let ins = [inp(vals(6, 6, -1.0, 1.0), &[2, 1, 3]), inp(vals(4, 7, -1.0, 1.0), &[4, 1])];
    check("mul rank broadcast", &ins, |_, x| x[0].mul(&x[1]));
    // Scalar operand (rank 0).
    check("div by scalar", &[inp(vals(6, 8, -1.0, 1.0), &[2, 3]), inp(vec![1.7], &[])], |_, x| x[0].div(&x[1]));
    // The same tensor on both sides.
    check("x * x", &[inp(vals(6, 9, -1.0, 1.0), &[6])], |_, x| x[0].mul(&x[0]));
}

#[test]
fn grad_pow_both_operands() {
    check("pow", &bin_inputs(0.5, 2.0), |_, x| x[0].pow(&x[1]));
    check("pow scalar exponent", &[inp(vals(6, 10, -2.0, 2.0), &[6])], |_, x| x[0].pow_scalar(3.0));
}

#[test]
fn grad_maximum_minimum() {
    let a = inp(distinct(12, 11), &[3, 4]);
    let b = inp(distinct(4, 12).iter().map(|v| v + 0.1).collect(), &[1, 4]);
    check("maximum", &[a.clone(), b.clone()], |_, x| x[0].maximum(&x[1]));
    check("minimum", &[a, b], |_, x| x[0].minimum(&x[1]));
    // Ties split the gradient evenly (central differences agree: 1/2 each).
    let t = inp(vec![1.0, 2.0, -1.0], &[3]);
    check("maximum ties", &[t.clone(), t.clone()], |_, x| x[0].maximum(&x[1]));
    check("minimum ties", &[t.clone(), t], |_, x| x[0].minimum(&x[1]));
}

#[test]
fn grad_mod_and_rem() {
    let a = inp(vec![5.3, -5.3, 2.2, -7.9, 3.7, -1.1], &[6]);
    let b = inp(vec![2.1, 2.1, -1.5, 2.5, -1.6, 0.7], &[6]);
    check("mod", &[a.clone(), b.clone()], |_, x| x[0].modulo(&x[1]));
    check("rem", &[a, b], |_, x| x[0].rem(&x[1]));
}

#[test]
fn grad_where_broadcast() {
    let ins = [inp(vals(12, 13, -1.0, 1.0), &[3, 4]), inp(vals(3, 14, -1.0, 1.0), &[3, 1])];
    check("where", &ins, |dev, x| {
        let c = Tensor::from_slice(&[true, false, false, true], [4], dev)?;
        c.where_(&x[0], &x[1])
    });
}

#[test]
fn grad_cast_float_to_float() {
    check_tol(
        "cast f64 -> f32 -> f64",
        &[inp(vals(6, 15, -1.0, 1.0), &[6])],
        |_, x| x[0].cast(DType::F32)?.mul_scalar(1.5)?.cast(DType::F64),
        1e-3,
        1e-4,
        1e-3,
    );
}

// ---- reductions ----

#[test]
fn grad_sum_mean() {
    let x = [inp(vals(24, 16, -1.0, 1.0), &[2, 3, 4])];
    check("sum all", &x, |_, x| x[0].sum(&[], false));
    check("sum axis 1", &x, |_, x| x[0].sum(&[1], false));
    check("sum axes 0,2 keepdim", &x, |_, x| x[0].sum(&[0, 2], true));
    check("mean axis -1", &x, |_, x| x[0].mean(&[-1], false));
    check("mean axes 0,1 keepdim", &x, |_, x| x[0].mean(&[0, 1], true));
}

#[test]
fn grad_max_min_reductions() {
    let x = [inp(distinct(24, 17), &[2, 3, 4])];
    check("max axis 1", &x, |_, x| x[0].max(&[1], false));
    check("max all", &x, |_, x| x[0].max(&[], false));
    check("min axes 0,2 keepdim", &x, |_, x| x[0].min(&[0, 2], true));
    // Two tied maxima share the gradient (1/2 each, as central differences see it).
    check("max ties", &[inp(vec![1.0, 3.0, 3.0, 0.5, 2.0, -1.0], &[2, 3])], |_, x| x[0].max(&[1], false));
}

#[test]
fn grad_prod_with_and_without_zeros() {
    check("prod", &[inp(vals(12, 18, 0.5, 1.5), &[3, 4])], |_, x| x[0].prod(&[1], false));
    let z = inp(vec![0.0, 2.0, 3.0, 0.5, 0.0, 0.0, 1.5, 2.0, 4.0, -1.0, 0.5, 0.0], &[3, 4]);
    check("prod with zeros", &[z], |_, x| x[0].prod(&[1], true));
}

#[test]
fn grad_cumsum() {
    let x = [inp(vals(12, 19, -1.0, 1.0), &[3, 4])];
    check("cumsum", &x, |_, x| x[0].cumsum(1, false, false));
    check("cumsum exclusive", &x, |_, x| x[0].cumsum(0, true, false));
    check("cumsum reverse", &x, |_, x| x[0].cumsum(1, false, true));
    check("cumsum exclusive reverse", &x, |_, x| x[0].cumsum(-1, true, true));
}

#[test]
fn grad_softmax_log_softmax() {
    let x = [inp(vals(12, 20, -2.0, 2.0), &[3, 4])];
    check("softmax -1", &x, |_, x| x[0].softmax(-1));
    check("softmax 0", &x, |_, x| x[0].softmax(0));
    check("log_softmax -1", &x, |_, x| x[0].log_softmax(-1));
    check("log_softmax 0", &x, |_, x| x[0].log_softmax(0));
}

// ---- matmul ----

#[test]
fn grad_matmul() {
    check("matmul 2d", &[inp(vals(6, 21, -1.0, 1.0), &[2, 3]), inp(vals(12, 22, -1.0, 1.0), &[3, 4])], |_, x| {
        x[0].matmul(&x[1])
    });
    check(
        "matmul batched broadcast",
        &[inp(vals(24, 23, -1.0, 1.0), &[2, 1, 3, 4]), inp(vals(24, 24, -1.0, 1.0), &[3, 4, 2])],
        |_, x| x[0].matmul(&x[1]),
    );
    check("matmul vector", &[inp(vals(3, 25, -1.0, 1.0), &[3]), inp(vals(12, 26, -1.0, 1.0), &[3, 4])], |_, x| {
        x[0].matmul(&x[1])
    });
    check("matmul transposed operand", &[inp(vals(6, 27, -1.0, 1.0), &[3, 2])], |_, x| x[0].t()?.matmul(&x[0]));
}

// ---- views ----

#[test]
fn grad_reshape_permute_expand() {
    let x = [inp(vals(24, 28, -1.0, 1.0), &[2, 3, 4])];
    check("reshape", &x, |_, x| x[0].reshape([4, 6])?.mul(&x[0].reshape([4, 6])?));
    check("permute", &x, |_, x| x[0].permute(&[2, 0, 1]));
    check("transpose", &x, |_, x| x[0].transpose(0, 2));
    check("expand", &[inp(vals(3, 29, -1.0, 1.0), &[3, 1])], |_, x| x[0].expand([2, 3, 4]));
    check("unsqueeze/squeeze", &x, |_, x| x[0].unsqueeze(1)?.squeeze(&[1])?.flatten(0, 1));
}

#[test]
fn grad_slice_with_steps() {
    let x = [inp(vals(35, 30, -1.0, 1.0), &[5, 7])];
    check("slice step 1", &x, |_, x| x[0].slice(1, 1, 5, 1));
    check("slice step 2", &x, |_, x| x[0].slice(1, 0, 7, 2));
    check("slice step 3 offset", &x, |_, x| x[0].slice(1, 1, 7, 3));
    check("slice step -1", &x, |_, x| x[0].slice(0, -1, -6, -1));
    check("slice step -2", &x, |_, x| x[0].slice(1, 5, 0, -2));
    check("slice two dims", &x, |_, x| x[0].slice(0, 4, 0, -3)?.slice(1, 2, 7, 2));
    check("narrow", &x, |_, x| x[0].narrow(0, 1, 3));
}

#[test]
fn grad_concat() {
    let ins = [
        inp(vals(6, 31, -1.0, 1.0), &[2, 3]),
        inp(vals(4, 32, -1.0, 1.0), &[2, 2]),
        inp(vals(2, 33, -1.0, 1.0), &[2, 1]),
    ];
    check("concat axis 1", &ins, |_, x| Tensor::concat(&[&x[0], &x[1], &x[2]], 1));
    check("stack", &[ins[0].clone(), inp(vals(6, 34, -1.0, 1.0), &[2, 3])], |_, x| Tensor::stack(&[&x[0], &x[1]], 0));
}

#[test]
fn grad_pad_modes() {
    let x = inp(vals(12, 35, -1.0, 1.0), &[3, 4]);
    check("pad constant", std::slice::from_ref(&x), |_, x| x[0].pad(&[(1, 2), (0, 3)], 0.5));
    check("pad reflect", std::slice::from_ref(&x), |_, x| x[0].pad_mode(&[(2, 1), (1, 3)], PadMode::Reflect));
    check("pad edge", std::slice::from_ref(&x), |_, x| x[0].pad_mode(&[(2, 1), (3, 0)], PadMode::Edge));
    // The pad value itself as a differentiable input.
    check("pad value", &[x, inp(vec![0.3], &[])], |_, x| {
        Tensor::record(
            lazuli::ir::Op::Pad { before: vec![1, 0], after: vec![0, 2], mode: PadMode::Constant },
            &[&x[0], &x[1]],
        )
    });
}

#[test]
fn grad_gather() {
    let x = inp(vals(20, 36, -1.0, 1.0), &[4, 5]);
    check("gather axis 0 repeated", std::slice::from_ref(&x), |dev, x| {
        x[0].gather(0, &Tensor::from_slice(&[2i32, 0, 2, 3, 2], [5], dev)?)
    });
    check("gather axis 1 negative 2-d", std::slice::from_ref(&x), |dev, x| {
        x[0].gather(1, &Tensor::from_slice(&[-1i64, 0, 1, -1, 3, 3], [2, 3], dev)?)
    });
    check("embedding", &[inp(vals(12, 37, -1.0, 1.0), &[4, 3])], |dev, x| {
        let e = nn::Embedding { weight: x[0].clone() };
        nn::Module::forward(&e, &Tensor::from_slice(&[1u32, 3, 1, 0], [2, 2], dev)?)
    });
}

#[test]
fn grad_scatter_add() {
    let base = inp(vals(20, 70, -1.0, 1.0), &[4, 5]);
    check("scatter_add axis 0 repeated negative", &[base.clone(), inp(vals(25, 71, -1.0, 1.0), &[5, 5])], |dev, x| {
        x[0].scatter_add(0, &Tensor::from_slice(&[2i32, 0, -2, 3, 2], [5], dev)?, &x[1])
    });
    check("scatter_add axis 1 by 2-d indices", &[base, inp(vals(24, 72, -1.0, 1.0), &[4, 2, 3])], |dev, x| {
        x[0].scatter_add(1, &Tensor::from_slice(&[4i64, 0, 4, -1, 1, 1], [2, 3], dev)?, &x[1])
    });
    // Through another op on both sides, so the gradients are not just copies.
    check(
        "scatter_add in a chain",
        &[inp(vals(6, 73, 0.2, 1.0), &[3, 2]), inp(vals(8, 74, -1.0, 1.0), &[4, 2])],
        |dev, x| {
            let s = x[0].exp()?.scatter_add(0, &Tensor::from_slice(&[1u32, 1, 0, 2], [4], dev)?, &x[1].tanh()?)?;
            s.mul(&s)
        },
    );
}

// ---- convolution and pooling ----

fn conv(strides: [usize; 2], pads: [usize; 4], dilations: [usize; 2], groups: usize) -> ConvAttrs {
    ConvAttrs { strides, pads, dilations, groups }
}

#[test]
fn grad_conv2d() {
    let x = inp(vals(50, 38, -1.0, 1.0), &[1, 2, 5, 5]);
    let w = inp(vals(36, 39, -1.0, 1.0), &[2, 2, 3, 3]);
    check("conv2d", &[x.clone(), w.clone()], |_, x| x[0].conv2d(&x[1], conv([1, 1], [0; 4], [1, 1], 1)));
    check("conv2d stride 2 pad", &[x.clone(), w.clone()], |_, x| {
        x[0].conv2d(&x[1], conv([2, 2], [1, 0, 1, 2], [1, 1], 1))
    });
    check("conv2d dilation", &[x.clone(), w.clone()], |_, x| x[0].conv2d(&x[1], conv([1, 2], [1, 1, 1, 1], [2, 1], 1)));
    let x2 = inp(vals(2 * 4 * 4 * 4, 40, -1.0, 1.0), &[2, 4, 4, 4]);
    let w2 = inp(vals(4 * 2 * 2 * 2, 41, -1.0, 1.0), &[4, 2, 2, 2]);
    check("conv2d groups 2", &[x2, w2], |_, x| x[0].conv2d(&x[1], conv([1, 1], [1, 0, 0, 1], [1, 1], 2)));
}

fn pool(kind: PoolKind, k: usize, s: usize, pad: usize, ceil_mode: bool) -> PoolAttrs {
    PoolAttrs {
        kind,
        kernel: vec![k, k],
        strides: vec![s, s],
        pads_begin: vec![pad, pad],
        pads_end: vec![pad, pad],
        dilations: vec![1, 1],
        ceil_mode,
    }
}

#[test]
fn grad_pooling() {
    let x = inp(distinct(50, 42), &[1, 2, 5, 5]);
    check("max_pool", std::slice::from_ref(&x), |_, x| x[0].pool(pool(PoolKind::Max, 2, 2, 0, false)));
    check("max_pool overlapping pad ceil", std::slice::from_ref(&x), |_, x| {
        x[0].pool(pool(PoolKind::Max, 3, 2, 1, true))
    });
    check("avg_pool", std::slice::from_ref(&x), |_, x| {
        x[0].pool(pool(PoolKind::Avg { count_include_pad: false }, 2, 2, 0, false))
    });
    check("avg_pool pad include", std::slice::from_ref(&x), |_, x| {
        x[0].pool(pool(PoolKind::Avg { count_include_pad: true }, 3, 2, 1, true))
    });
    check("avg_pool pad exclude", std::slice::from_ref(&x), |_, x| {
        x[0].pool(pool(PoolKind::Avg { count_include_pad: false }, 3, 2, 1, true))
    });
    // Windows that tile the input exactly.
    let t = inp(distinct(2 * 4 * 6, 89), &[1, 2, 4, 6]);
    check("max_pool tiled", std::slice::from_ref(&t), |_, x| x[0].pool(PoolAttrs::new(PoolKind::Max, &[2, 3])));
    check("avg_pool tiled", std::slice::from_ref(&t), |_, x| {
        x[0].pool(PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[2, 2]))
    });
    let mut dil = pool(PoolKind::Max, 2, 1, 0, false);
    dil.dilations = vec![2, 1];
    check("max_pool dilation", std::slice::from_ref(&x), |_, x| x[0].pool(dil.clone()));
    let mut dil = pool(PoolKind::Avg { count_include_pad: false }, 3, 2, 2, true);
    dil.dilations = vec![2, 1];
    check("avg_pool dilation pad ceil", &[x], |_, x| x[0].pool(dil.clone()));
    // 1-d and 3-d windows.
    let one = inp(distinct(2 * 9, 43), &[1, 2, 9]);
    let p1 = PoolAttrs::new(PoolKind::Max, &[3]).with_strides(&[2]).with_padding(&[1]);
    check("max_pool 1-d", std::slice::from_ref(&one), |_, x| x[0].pool(p1.clone()));
    let a1 = PoolAttrs::new(PoolKind::Avg { count_include_pad: true }, &[4]).with_strides(&[3]).with_ceil_mode(true);
    check("avg_pool 1-d", &[one], |_, x| x[0].pool(a1.clone()));
    let three = inp(distinct(3 * 4 * 5, 44), &[1, 1, 3, 4, 5]);
    let p3 = PoolAttrs::new(PoolKind::Max, &[2, 2, 3]).with_strides(&[1, 2, 2]).with_padding(&[0, 1, 1]);
    check("max_pool 3-d", std::slice::from_ref(&three), |_, x| x[0].pool(p3.clone()));
    let a3 = PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[2, 3, 2]).with_padding(&[1, 1, 0]);
    check("avg_pool 3-d", &[three], |_, x| x[0].pool(a3.clone()));
}

/// The average-pooling gradient is linear in the output gradient (its
/// adjoint is the average pool itself) and constant in the input.
#[test]
fn grad_of_the_avg_pool_gradient() {
    let attrs =
        PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[3, 2]).with_strides(&[2, 1]).with_padding(&[1, 1]);
    let x = inp(vals(2 * 5 * 4, 45, -1.0, 1.0), &[1, 2, 5, 4]);
    let g = inp(vals(2 * 3 * 5, 46, -1.0, 1.0), &[1, 2, 3, 5]);
    check("avg_pool_grad", &[x, g], |_, x| x[0].pool_grad(&x[1], attrs.clone()));
}

/// Max pooling gives a window's whole gradient to its first maximum (scan
/// order), on every backend: ties, a NaN maximum (the first NaN), and a
/// -inf maximum next to padding (never the padding).
#[test]
fn max_pool_gradient_goes_to_the_first_maximum() {
    /// Input, its shape, the pooling, the expected input gradient.
    type Case = (Vec<f32>, [usize; 4], PoolAttrs, Vec<f32>);
    let cases: Vec<Case> = vec![
        // Two 2x2 windows; the first has a tie between positions 1 and 2.
        (
            vec![1.0, 3.0, 5.0, 5.0, 3.0, 0.0, 2.0, 5.0],
            [1, 1, 2, 4],
            PoolAttrs::new(PoolKind::Max, &[2, 2]),
            vec![0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ),
        // Overlapping 1-d windows (stride 1) over a run of ties: each
        // window's gradient goes to its own first element.
        (
            vec![2.0, 2.0, 2.0, 1.0],
            [1, 1, 1, 4],
            PoolAttrs::new(PoolKind::Max, &[1, 2]).with_strides(&[1, 1]),
            vec![1.0, 1.0, 1.0, 0.0],
        ),
        // All -inf with padding: the gradient reaches the input, not the pad.
        (vec![f32::NEG_INFINITY; 4], [1, 1, 2, 2], pool(PoolKind::Max, 2, 2, 1, false), vec![1.0, 1.0, 1.0, 1.0]),
        // A NaN maximum: the first NaN takes the gradient.
        (
            vec![1.0, f32::NAN, 7.0, f32::NAN],
            [1, 1, 2, 2],
            PoolAttrs::new(PoolKind::Max, &[2, 2]),
            vec![0.0, 1.0, 0.0, 0.0],
        ),
    ];
    for dev in common::devices() {
        for (i, (x, dims, attrs, want)) in cases.iter().enumerate() {
            let t = Tensor::from_slice(x, dims.to_vec(), &dev).unwrap().requires_grad_(true).unwrap();
            t.pool(attrs.clone()).unwrap().sum(&[], false).unwrap().backward().unwrap();
            let got = t.grad().unwrap().to_vec::<f32>().unwrap();
            assert_eq!(got, *want, "case {i} on {}", dev.name());
        }
    }
}

// ---- attention and layers ----

#[test]
fn grad_scaled_dot_product_attention() {
    let q = inp(vals(2 * 3 * 4, 70, -1.0, 1.0), &[2, 3, 4]);
    let k = inp(vals(2 * 5 * 4, 71, -1.0, 1.0), &[2, 5, 4]);
    let v = inp(vals(2 * 5 * 3, 72, -1.0, 1.0), &[2, 5, 3]);
    let ins = [q, k, v];
    check("sdpa", &ins, |_, x| nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &nn::AttentionOptions::default()));
    check("sdpa causal", &ins, |_, x| {
        nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &nn::AttentionOptions::causal())
    });
    check("sdpa additive mask and scale", &ins, |dev, x| {
        let m = Tensor::from_slice(&vals(15, 73, -2.0, 0.0), [3, 5], dev)?;
        nn::scaled_dot_product_attention(
            &x[0],
            &x[1],
            &x[2],
            &nn::AttentionOptions::default().with_mask(m).with_scale(0.3),
        )
    });
    check("sdpa bool mask, causal", &ins, |dev, x| {
        let keep: Vec<bool> = (0..15).map(|i| i % 4 != 3).collect();
        let m = Tensor::from_slice(&keep, [3, 5], dev)?;
        nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &nn::AttentionOptions::causal().with_mask(m))
    });
}

/// The fused attention op (`Tensor::attention`, what
/// `nn::scaled_dot_product_attention` records) at its edges: broadcast
/// batch dims in every operand, more queries than keys under a causal
/// mask, masks broadcast along queries or over the batch, a scale; and a
/// mask that needs a gradient, which takes the unfused composition.
#[test]
fn grad_fused_attention_edges() {
    let opts = nn::AttentionOptions::default;
    let ins = [
        inp(vals(2 * 2 * 3 * 4, 100, -1.0, 1.0), &[2, 2, 3, 4]),
        inp(vals(2 * 5 * 4, 101, -1.0, 1.0), &[1, 2, 5, 4]),
        inp(vals(2 * 5 * 3, 102, -1.0, 1.0), &[2, 1, 5, 3]),
    ];
    check("fused attention, broadcast batch, causal", &ins, |_, x| x[0].attention(&x[1], &x[2], 0.5, true, None));
    check("fused attention, bool mask over the batch", &ins, |dev, x| {
        let keep: Vec<bool> = (0..10).map(|i| i % 5 == 0 || i % 3 != 1).collect();
        let m = Tensor::from_slice(&keep, [2, 1, 1, 5], dev)?;
        nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts().with_mask(m))
    });
    let ins = [
        inp(vals(6 * 4, 103, -1.0, 1.0), &[6, 4]),
        inp(vals(3 * 4, 104, -1.0, 1.0), &[3, 4]),
        inp(vals(3 * 2, 105, -1.0, 1.0), &[3, 2]),
    ];
    check("fused attention, t_q > t_k, causal, additive row mask", &ins, |dev, x| {
        let m = Tensor::from_slice(&vals(3, 106, -1.0, 0.0), [1, 3], dev)?;
        nn::scaled_dot_product_attention(
            &x[0],
            &x[1],
            &x[2],
            &nn::AttentionOptions::causal().with_mask(m).with_scale(0.8),
        )
    });
    let mut with_mask = ins.to_vec();
    with_mask.push(inp(vals(6 * 3, 107, -1.0, 0.5), &[6, 3]));
    check("attention with a mask that needs a gradient (unfused)", &with_mask, |_, x| {
        nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &opts().with_mask(x[3].clone()))
    });
}

#[test]
fn grad_conv_pool_norm_layers() {
    let x = inp(vals(2 * 3 * 5 * 5, 74, -1.0, 1.0), &[2, 3, 5, 5]);
    let w = inp(vals(4 * 3 * 3 * 3, 75, -0.5, 0.5), &[4, 3, 3, 3]);
    let b = inp(vals(4, 76, -0.5, 0.5), &[4]);
    check("Conv2d with bias", &[x.clone(), w, b], |_, x| {
        let c = nn::Conv2d {
            weight: x[1].clone(),
            bias: Some(x[2].clone()),
            attrs: ConvAttrs { pads: [1, 1, 1, 1], strides: [2, 1], ..ConvAttrs::default() },
        };
        nn::Module::forward(&c, &x[0])
    });
    check("AvgPool2d", std::slice::from_ref(&x), |_, x| {
        nn::Module::forward(&nn::AvgPool2d::new(3).stride(2).padding(1), &x[0])
    });
    check("MaxPool2d", &[inp(distinct(2 * 3 * 5 * 5, 77), &[2, 3, 5, 5])], |_, x| {
        nn::Module::forward(&nn::MaxPool2d::new(2).stride(1), &x[0])
    });
    let g = inp(vals(3, 78, 0.5, 1.5), &[3]);
    let h = inp(vals(3, 79, -0.5, 0.5), &[3]);
    check("BatchNorm2d training", &[x.clone(), g.clone(), h.clone()], |dev, x| {
        let mut bn = nn::BatchNorm2d::new(3, dev)?;
        bn.weight = x[1].clone();
        bn.bias = x[2].clone();
        nn::Module::forward(&bn, &x[0])
    });
    check("BatchNorm2d eval", &[x.clone(), g, h], |dev, x| {
        let mut bn = nn::BatchNorm2d::new(3, dev)?;
        bn.weight = x[1].clone();
        bn.bias = x[2].clone();
        bn.running_mean = Tensor::from_slice(&[0.1f32, -0.2, 0.3], [3], dev)?;
        bn.running_var = Tensor::from_slice(&[0.5f32, 1.5, 2.0], [3], dev)?;
        nn::ModuleExt::eval(&bn);
        nn::Module::forward(&bn, &x[0])
    });
    let x6 = inp(vals(2 * 6 * 2 * 3, 80, -1.0, 1.0), &[2, 6, 2, 3]);
    check("group_norm", &[x6, inp(vals(6, 81, 0.5, 1.5), &[6]), inp(vals(6, 82, -0.5, 0.5), &[6])], |_, x| {
        nn::group_norm(&x[0], 3, Some(&x[1]), Some(&x[2]), 1e-5)
    });
}

#[test]
fn grad_multihead_attention_and_losses() {
    let e = 6;
    let ins = [
        inp(vals(2 * 4 * e, 83, -1.0, 1.0), &[2, 4, e]),
        inp(vals(3 * e * e, 84, -0.5, 0.5), &[3 * e, e]),
        inp(vals(3 * e, 85, -0.2, 0.2), &[3 * e]),
        inp(vals(e * e, 86, -0.5, 0.5), &[e, e]),
        inp(vals(e, 87, -0.2, 0.2), &[e]),
    ];
    check("MultiheadAttention causal", &ins, |dev, x| {
        let mut m = nn::MultiheadAttention::new(e, 2, dev)?.causal(true);
        m.in_proj_weight = x[1].clone();
        m.in_proj_bias = Some(x[2].clone());
        m.out_proj = nn::Linear { weight: x[3].clone(), bias: Some(x[4].clone()) };
        nn::Module::forward(&m, &x[0])
    });
    let logits = inp(vals(2 * 3 * 5, 88, -2.0, 2.0), &[2, 3, 5]);
    let opts = nn::CrossEntropyOptions { ignore_index: Some(-100), label_smoothing: 0.1, ..Default::default() };
    check("cross_entropy [b, t, c], ignore_index, smoothing", std::slice::from_ref(&logits), |dev, x| {
        nn::cross_entropy_with(&x[0], &Tensor::from_slice(&[4i64, -100, 0, 2, 2, -100], [2, 3], dev)?, &opts)
    });
    let sum = nn::CrossEntropyOptions { reduction: nn::Reduction::None, ..Default::default() };
    check("cross_entropy per element", &[logits], |dev, x| {
        nn::cross_entropy_with(&x[0], &Tensor::from_slice(&[1u8, 0, 4, 3, 2, 1], [2, 3], dev)?, &sum)
    });
}

// ---- nn compositions ----

#[test]
fn grad_nn_losses_and_layers() {
    let logits = inp(vals(12, 43, -2.0, 2.0), &[3, 4]);
    check("cross_entropy", std::slice::from_ref(&logits), |dev, x| {
        nn::cross_entropy(&x[0], &Tensor::from_slice(&[3i32, 0, 2], [3], dev)?)
    });
    check("mse", &[logits.clone(), inp(vals(12, 44, -1.0, 1.0), &[3, 4])], |_, x| nn::mse(&x[0], &x[1]));
    check(
        "layer_norm",
        &[logits.clone(), inp(vals(4, 45, 0.5, 1.5), &[4]), inp(vals(4, 46, -0.5, 0.5), &[4])],
        |_, x| nn::layer_norm(&x[0], 1, Some(&x[1]), Some(&x[2]), 1e-5),
    );
    check("leaky_relu", &[inp(distinct(8, 47), &[8])], |_, x| nn::leaky_relu(&x[0], 0.1));
    check("silu", &[inp(vals(8, 48, -2.0, 2.0), &[8])], |_, x| nn::silu(&x[0]));
    check(
        "linear",
        &[
            inp(vals(6, 49, -1.0, 1.0), &[2, 3]),
            inp(vals(12, 50, -1.0, 1.0), &[4, 3]),
            inp(vals(4, 51, -1.0, 1.0), &[4]),
        ],
        |_, x| {
            let l = nn::Linear { weight: x[1].clone(), bias: Some(x[2].clone()) };
            nn::Module::forward(&l, &x[0])
        },
    );
}

#[test]
fn grad_dropout_and_random() {
    // The check reseeds the device before every evaluation, so the mask is fixed.
    check("dropout", &[inp(vals(64, 52, -1.0, 1.0), &[8, 8])], |_, x| x[0].dropout(0.4, true));
    check("times rand", &[inp(vals(12, 53, -1.0, 1.0), &[3, 4])], |dev, x| {
        x[0].mul(&Tensor::rand([3, 4], DType::F64, dev)?)
    });
    let dev = Device::cpu();
    dev.manual_seed(1);
    let y = Tensor::randn([4], DType::F32, &dev).unwrap();
    assert!(!y.requires_grad());
}

#[test]
fn grad_composite_chain() {
    // A small MLP-like chain touching several ops at once.
    let ins = [
        inp(vals(8, 54, -1.0, 1.0), &[2, 4]),
        inp(vals(12, 55, -1.0, 1.0), &[4, 3]),
        inp(vals(3, 56, -0.5, 0.5), &[3]),
    ];
    check("mlp chain", &ins, |_, x| {
        let h = x[0].matmul(&x[1])?.add(&x[2])?.tanh()?;
        h.log_softmax(-1)?.mul(&h.exp()?)?.sum(&[1], false)
    });
}

// ---- autodiff semantics ----

#[test]
fn backward_needs_a_scalar_and_a_tracked_value() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    let e = x.mul_scalar(2.0).unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("does not require grad"), "{e}");
    let x = x.requires_grad_(true).unwrap();
    let e = x.mul_scalar(2.0).unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("one-element"), "{e}");
    let y = x.mul_scalar(2.0).unwrap();
    y.backward_with(&Tensor::from_slice(&[1.0f32, 10.0], [2], &dev).unwrap()).unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![2.0, 20.0]);
    let i = Tensor::from_slice(&[1i32], [1], &dev).unwrap();
    assert!(i.requires_grad_(true).is_err());
}

#[test]
fn gradients_accumulate_until_zeroed() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    for _ in 0..2 {
        x.mul(&x).unwrap().sum(&[], false).unwrap().backward().unwrap();
    }
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![4.0, 8.0, 12.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    x.sum(&[], false).unwrap().backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 1.0, 1.0]);
    // The same loss twice also accumulates.
    let l = x.mul_scalar(3.0).unwrap().sum(&[], false).unwrap();
    x.zero_grad();
    l.backward().unwrap();
    l.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![6.0, 6.0, 6.0]);
}

#[test]
fn no_grad_and_detach_stop_tracking() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    let y = no_grad(|| x.mul_scalar(2.0).unwrap());
    assert!(!y.requires_grad());
    assert!(lazuli::is_grad_enabled());
    let d = x.detach();
    assert!(!d.requires_grad());
    // z = x * detach(x): the gradient flows through the first factor only.
    let z = x.mul(&d).unwrap().sum(&[], false).unwrap();
    assert!(z.requires_grad() && !z.is_leaf());
    assert_eq!(z.grad_fn_name().as_deref(), Some("reduce_sum"));
    z.backward().unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    {
        let _g = lazuli::NoGradGuard::new();
        assert!(!lazuli::is_grad_enabled());
    }
    assert!(lazuli::is_grad_enabled());
}

#[test]
fn leaves_keep_requires_grad_across_assign() {
    let dev = Device::cpu();
    let w = Tensor::from_slice(&[1.0f32, -1.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    for step in 0..3 {
        w.zero_grad();
        let loss = w.mul(&w).unwrap().sum(&[], false).unwrap();
        loss.backward().unwrap();
        let g = w.grad().unwrap();
        no_grad(|| w.assign(&w.sub(&g.mul_scalar(0.25).unwrap()).unwrap())).unwrap();
        dev.mark_step().unwrap();
        assert!(w.requires_grad() && w.is_leaf(), "step {step}");
    }
    // w <- w - 0.25 * 2w = w / 2, three times.
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.125, -0.125]);
}

#[test]
fn gradients_are_lazy_and_fuse_with_forward() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[0.5f32, 1.5, -2.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    let loss = x.exp().unwrap().sum(&[], false).unwrap();
    loss.backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.state(), TensorState::PendingIr);
    assert_eq!(loss.state(), TensorState::PendingIr);
    assert_eq!(dev.cached_plans(), 0);
    lazuli::sync(&[&loss, &g]).unwrap();
    assert_eq!(dev.cached_plans(), 1, "forward and backward are one graph");
    let want: Vec<f32> = [0.5f32, 1.5, -2.0].iter().map(|v| v.exp()).collect();
    common::assert_close(&g.to_vec::<f32>().unwrap(), &want, 1e-6, 1e-6, "d/dx sum(exp(x))");
}

// ---- wgpu vs CPU ----

/// f32 gradients of `f` on `dev` for fixed inputs.
fn grads_on(dev: &Device, inputs: &[Input], f: &dyn Fn(&Device, &[Tensor]) -> Result<Tensor>) -> Vec<Vec<f32>> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(v, s)| {
            let v32: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            Tensor::from_slice(&v32, s.clone(), dev).unwrap().requires_grad_(true).unwrap()
        })
        .collect();
    dev.manual_seed(3);
    let out = f(dev, &leaves).unwrap();
    let w: Vec<f32> = vals(out.numel(), 99, 0.5, 1.5).into_iter().map(|v| v as f32).collect();
    let loss = out.mul(&Tensor::from_slice(&w, out.shape().clone(), dev).unwrap()).unwrap().sum(&[], false).unwrap();
    loss.backward().unwrap();
    leaves.iter().map(|l| l.grad().unwrap().to_vec::<f32>().unwrap()).collect()
}

#[test]
fn wgpu_gradients_match_cpu() {
    let Some(gpu) = common::wgpu() else { return };
    let cpu = Device::cpu();
    type F = Box<dyn Fn(&Device, &[Tensor]) -> Result<Tensor>>;
    let cases: Vec<(&str, Vec<Input>, F)> = vec![
        (
            "mlp + cross_entropy",
            vec![
                inp(vals(32, 60, 0.0, 1.0), &[4, 8]),
                inp(vals(48, 61, -0.5, 0.5), &[6, 8]),
                inp(vals(6, 62, -0.1, 0.1), &[6]),
            ],
            Box::new(|dev, x| {
                let h = x[0].matmul(&x[1].t()?)?.add(&x[2])?.relu()?;
                nn::cross_entropy(&h, &Tensor::from_slice(&[1i32, 5, 0, 3], [4], dev)?)
            }),
        ),
        ("softmax", vec![inp(vals(24, 63, -2.0, 2.0), &[4, 6])], Box::new(|_, x| x[0].softmax(-1))),
        (
            "layer_norm",
            vec![inp(vals(24, 64, -2.0, 2.0), &[4, 6]), inp(vals(6, 65, 0.5, 1.5), &[6])],
            Box::new(|_, x| nn::layer_norm(&x[0], 1, Some(&x[1]), None, 1e-5)),
        ),
        (
            "broadcast binary + reductions",
            vec![inp(vals(24, 66, 0.5, 2.0), &[2, 3, 4]), inp(vals(4, 67, 0.5, 2.0), &[4])],
            Box::new(|_, x| x[0].div(&x[1])?.sqrt()?.mean(&[1], false)?.max(&[0], false)),
        ),
        (
            "slice/concat/pad",
            vec![inp(vals(20, 68, -1.0, 1.0), &[4, 5])],
            Box::new(|_, x| {
                let a = x[0].slice(1, 4, 0, -2)?;
                Tensor::concat(&[&a, &x[0].narrow(1, 1, 2)?], 1)?.pad(&[(1, 0), (0, 2)], 0.0)?.sigmoid()
            }),
        ),
        (
            "causal attention",
            vec![
                inp(vals(2 * 5 * 8, 90, -1.0, 1.0), &[2, 5, 8]),
                inp(vals(2 * 7 * 8, 91, -1.0, 1.0), &[2, 7, 8]),
                inp(vals(2 * 7 * 4, 92, -1.0, 1.0), &[2, 7, 4]),
            ],
            Box::new(|_, x| nn::scaled_dot_product_attention(&x[0], &x[1], &x[2], &nn::AttentionOptions::causal())),
        ),
        (
            "conv + relu + max pool",
            vec![
                inp(vals(2 * 2 * 6 * 6, 93, -1.0, 1.0), &[2, 2, 6, 6]),
                inp(vals(3 * 2 * 9, 94, -0.5, 0.5), &[3, 2, 3, 3]),
            ],
            Box::new(|_, x| {
                let c = x[0].conv2d(&x[1], ConvAttrs { pads: [1; 4], ..ConvAttrs::default() })?;
                nn::Module::forward(&nn::MaxPool2d::new(2), &c.relu()?)
            }),
        ),
        (
            "embedding + scatter_add",
            vec![inp(vals(40, 75, -1.0, 1.0), &[10, 4]), inp(vals(12, 76, -1.0, 1.0), &[3, 4])],
            Box::new(|dev, x| {
                let ids = Tensor::from_slice(&[3i32, 9, 3, -1, 0, 3], [2, 3], dev)?;
                let e = nn::Module::forward(&nn::Embedding { weight: x[0].clone() }, &ids)?;
                x[0].scatter_add(0, &Tensor::from_slice(&[9i32, 2, 9], [3], dev)?, &x[1])?
                    .sum(&[1], true)?
                    .add(&e.sum(&[0, 1], false)?)
            }),
        ),
        (
            "avg and max pools with padding",
            vec![inp(distinct(2 * 3 * 7 * 6, 77), &[2, 3, 7, 6])],
            Box::new(|_, x| {
                let a = x[0].pool(
                    PoolAttrs::new(PoolKind::Avg { count_include_pad: true }, &[3, 3])
                        .with_strides(&[2, 2])
                        .with_padding(&[1, 1]),
                )?;
                let m = x[0].pool(
                    PoolAttrs::new(PoolKind::Max, &[3, 2])
                        .with_strides(&[2, 2])
                        .with_padding(&[1, 1])
                        .with_ceil_mode(true),
                )?;
                a.add(&m.narrow(3, 0, 3)?)
            }),
        ),
        (
            "gather + dropout",
            vec![inp(vals(20, 69, -1.0, 1.0), &[5, 4])],
            Box::new(|dev, x| x[0].gather(0, &Tensor::from_slice(&[4i32, 1, 1], [3], dev)?)?.dropout(0.3, true)),
        ),
    ];
    for (name, inputs, f) in &cases {
        let want = grads_on(&cpu, inputs, f.as_ref());
        let got = grads_on(&gpu, inputs, f.as_ref());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            common::assert_close(g, w, 1e-4, 1e-5, &format!("{name}: input {i}"));
        }
    }
}
