//! Differential tests: every op on the wgpu backend against the CPU
//! reference backend, over several shapes each — scalars, broadcasting both
//! ways, sizes that are not multiples of the workgroup size, zero-size
//! tensors, and one tensor of 2^20 elements.

mod common;
use lazuli::ir::{ArgReduceOp, PadMode, ScalarValue};
use lazuli::prelude::*;

type Build = fn(&[Tensor]) -> lazuli::Result<Tensor>;

struct Case {
    name: &'static str,
    inputs: Vec<(Vec<usize>, DType)>,
    build: Build,
}

fn case(name: &'static str, inputs: &[(&[usize], DType)], build: Build) -> Case {
    Case { name, inputs: inputs.iter().map(|(s, d)| (s.to_vec(), *d)).collect(), build }
}

const F: DType = DType::F32;
const I: DType = DType::I32;
const B: DType = DType::Bool;

/// Input data for a case: deterministic, in a range that suits every op
/// (positive for log/sqrt, small for exp/pow), with some exact ties.
fn input(dev: &Device, k: usize, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let vals = common::rand_vec(n, 17 + k as u64, -3.0, 3.0);
    match dtype {
        DType::F32 => Tensor::from_slice(&vals, shape.to_vec(), dev).unwrap(),
        DType::I32 => {
            let v: Vec<i32> = vals.iter().map(|x| (x * 4.0).round() as i32).collect();
            Tensor::from_slice(&v, shape.to_vec(), dev).unwrap()
        }
        DType::Bool => {
            let v: Vec<bool> = vals.iter().map(|x| *x > 0.0).collect();
            Tensor::from_slice(&v, shape.to_vec(), dev).unwrap()
        }
        other => panic!("no input generator for {other}"),
    }
}

fn pos(t: &Tensor) -> lazuli::Result<Tensor> {
    t.abs()?.add_scalar(0.25)
}

fn cases() -> Vec<Case> {
    let mut v = vec![
        // Unary elementwise, over odd sizes, a scalar and a zero-size tensor.
        case("neg", &[(&[7, 37], F)], |x| x[0].neg()),
        case("neg_i32", &[(&[300], I)], |x| x[0].neg()),
        case("abs", &[(&[257], F)], |x| x[0].abs()),
        case("abs_i32", &[(&[5, 3], I)], |x| x[0].abs()),
        case("exp", &[(&[3, 5, 7], F)], |x| x[0].exp()),
        case("log", &[(&[100], F)], |x| pos(&x[0])?.log()),
        case("sqrt", &[(&[100], F)], |x| pos(&x[0])?.sqrt()),
        case("rsqrt", &[(&[100], F)], |x| pos(&x[0])?.rsqrt()),
        case("reciprocal", &[(&[100], F)], |x| pos(&x[0])?.reciprocal()),
        case("relu", &[(&[1000], F)], |x| x[0].relu()),
        case("relu_i32", &[(&[10], I)], |x| x[0].relu()),
        case("sigmoid", &[(&[513], F)], |x| x[0].sigmoid()),
        case("tanh", &[(&[513], F)], |x| x[0].tanh()),
        case("gelu", &[(&[513], F)], |x| x[0].gelu()),
        case("sin", &[(&[129], F)], |x| x[0].sin()),
        case("cos", &[(&[129], F)], |x| x[0].cos()),
        case("floor", &[(&[129], F)], |x| x[0].floor()),
        case("ceil", &[(&[129], F)], |x| x[0].ceil()),
        case("sign", &[(&[129], F)], |x| x[0].sign()),
        case("sign_i32", &[(&[129], I)], |x| x[0].sign()),
        case("logical_not", &[(&[77], B)], |x| x[0].logical_not()),
        case("unary_scalar", &[(&[], F)], |x| x[0].exp()?.tanh()),
        case("unary_zero_size", &[(&[0, 5], F)], |x| x[0].exp()),
        // Binary with broadcasting both ways.
        case("add", &[(&[4, 33], F), (&[4, 33], F)], |x| x[0].add(&x[1])),
        case("add_bcast_right", &[(&[5, 1, 7], F), (&[3, 1], F)], |x| x[0].add(&x[1])),
        case("add_bcast_left", &[(&[7], F), (&[6, 7], F)], |x| x[0].add(&x[1])),
        case("sub", &[(&[3, 1], F), (&[1, 300], F)], |x| x[0].sub(&x[1])),
        case("mul", &[(&[2, 3, 4], F), (&[], F)], |x| x[0].mul(&x[1])),
        case("div", &[(&[65], F), (&[65], F)], |x| x[0].div(&pos(&x[1])?)),
        case("pow", &[(&[65], F), (&[65], F)], |x| pos(&x[0])?.pow(&x[1].mul_scalar(0.5)?)),
        case("maximum", &[(&[9, 9], F), (&[9], F)], |x| x[0].maximum(&x[1])),
        case("minimum", &[(&[9, 9], F), (&[9, 1], F)], |x| x[0].minimum(&x[1])),
        case("add_i32", &[(&[50], I), (&[50], I)], |x| x[0].add(&x[1])),
        case("mul_i32_bcast", &[(&[4, 1], I), (&[1, 6], I)], |x| x[0].mul(&x[1])),
        case("div_i32", &[(&[50], I), (&[50], I)], |x| x[0].div(&x[1])),
        case("rem_i32", &[(&[50], I), (&[50], I)], |x| x[0].rem(&x[1])),
        case("mod_i32", &[(&[50], I), (&[50], I)], |x| x[0].modulo(&x[1])),
        case("mod_f32", &[(&[50], F), (&[50], F)], |x| x[0].modulo(&pos(&x[1])?)),
        case("eq", &[(&[40], I), (&[40], I)], |x| x[0].eq(&x[1])),
        case("ne", &[(&[40], I), (&[1], I)], |x| x[0].ne(&x[1])),
        case("lt", &[(&[8, 5], F), (&[5], F)], |x| x[0].lt(&x[1])),
        case("le", &[(&[8, 5], F), (&[8, 1], F)], |x| x[0].le(&x[1])),
        case("gt", &[(&[300], F), (&[300], F)], |x| x[0].gt(&x[1])),
        case("ge", &[(&[300], I), (&[], I)], |x| x[0].ge(&x[1])),
        case("logical_and", &[(&[31], B), (&[31], B)], |x| x[0].logical_and(&x[1])),
        case("logical_or", &[(&[4, 31], B), (&[31], B)], |x| x[0].logical_or(&x[1])),
        case("binary_zero_size", &[(&[0], F), (&[1], F)], |x| x[0].add(&x[1])),
        // Operands up to 30 apart (e^-30 corrections) and a scalar partner.
        case("logaddexp", &[(&[9, 33], F), (&[33], F)], |x| x[0].mul_scalar(5.0)?.logaddexp(&x[1].mul_scalar(-5.0)?)),
        case("logaddexp_scalar", &[(&[65], F)], |x| x[0].mul_scalar(10.0)?.logaddexp_scalar(1.5)),
        case("logaddexp_specials", &[(&[1], F)], |x| {
            let (inf, nan) = (f32::INFINITY, f32::NAN);
            let a = [inf, -inf, inf, -inf, nan, 1.0, 1000.0, -1000.0, 0.0, 88.0, -100.0];
            let b = [inf, -inf, -inf, 3.0, 1.0, nan, 1000.0, -1000.0, -40.0, 89.0, -100.5];
            let a = Tensor::from_slice(&a, [a.len()], x[0].device())?;
            let b = Tensor::from_slice(&b, [b.len()], x[0].device())?;
            a.logaddexp(&b)
        }),
        case("softplus", &[(&[5, 40], F)], |x| x[0].mul_scalar(8.0)?.softplus(1.0, 20.0)),
        case("softplus_beta", &[(&[5, 40], F)], |x| x[0].mul_scalar(4.0)?.softplus(2.0, 5.0)),
        case("where", &[(&[6, 1], B), (&[6, 5], F), (&[5], F)], |x| x[0].where_(&x[1], &x[2])),
        case("cast_f32_i32", &[(&[100], F)], |x| x[0].mul_scalar(10.0)?.cast(DType::I32)),
        case("cast_i32_f32", &[(&[100], I)], |x| x[0].cast(DType::F32)),
        case("cast_bool_f32", &[(&[100], B)], |x| x[0].cast(DType::F32)),
        case("cast_f32_bool", &[(&[100], F)], |x| x[0].round()?.cast(DType::Bool)),
        case("cast_i32_u32", &[(&[100], I)], |x| x[0].abs()?.cast(DType::U32)?.add_scalar(3u32)?.cast(DType::I32)),
        // Reductions.
        case("sum_all", &[(&[33, 17], F)], |x| x[0].sum(&[], false)),
        case("sum_axis0_keep", &[(&[33, 17], F)], |x| x[0].sum(&[0], true)),
        case("sum_mid_axis", &[(&[3, 300, 5], F)], |x| x[0].sum(&[1], false)),
        case("sum_two_axes", &[(&[4, 5, 6], F)], |x| x[0].sum(&[0, 2], false)),
        case("sum_i32", &[(&[4, 51], I)], |x| x[0].sum(&[1], false)),
        case("mean", &[(&[6, 7], F)], |x| x[0].mean(&[-1], false)),
        case("max", &[(&[6, 7], F)], |x| x[0].max(&[0], false)),
        case("min_i32", &[(&[6, 7], I)], |x| x[0].min(&[1], true)),
        case("prod", &[(&[6, 4], F)], |x| x[0].mul_scalar(0.5)?.prod(&[1], false)),
        case("sum_of_square_prologue", &[(&[1000], F)], |x| x[0].mul(&x[0])?.sum(&[], false)),
        case("sum_zero_size", &[(&[0, 4], F)], |x| x[0].sum(&[0], false)),
        case("argmax", &[(&[7, 9], F)], |x| x[0].argmax(-1, false)),
        case("argmin_axis0", &[(&[7, 9], F)], |x| x[0].argmin(0, true)),
        case("argmax_last_ties", &[(&[5, 8], I)], |x| x[0].arg_reduce(ArgReduceOp::ArgMax, 1, false, true)),
        case("softmax", &[(&[5, 33], F)], |x| x[0].softmax(-1)),
        case("softmax_axis0", &[(&[5, 33], F)], |x| x[0].softmax(0)),
        case("log_softmax", &[(&[5, 33], F)], |x| x[0].log_softmax(1)),
        // Matmul.
        case("matmul", &[(&[17, 9], F), (&[9, 13], F)], |x| x[0].matmul(&x[1])),
        case("matmul_batched", &[(&[3, 5, 4], F), (&[3, 4, 6], F)], |x| x[0].matmul(&x[1])),
        case("matmul_batch_bcast", &[(&[2, 1, 5, 4], F), (&[3, 4, 2], F)], |x| x[0].matmul(&x[1])),
        case("matmul_transposed_operand", &[(&[8, 6], F), (&[7, 6], F)], |x| x[0].matmul(&x[1].t()?)),
        case("matmul_vec", &[(&[5, 4], F), (&[4], F)], |x| x[0].matmul(&x[1])),
        case("matmul_i32", &[(&[3, 4], I), (&[4, 2], I)], |x| x[0].matmul(&x[1])),
        case("matmul_epilogue", &[(&[6, 5], F), (&[5, 4], F), (&[4], F)], |x| x[0].matmul(&x[1])?.add(&x[2])?.relu()),
        // Views and movement.
        case("reshape", &[(&[6, 4], F)], |x| x[0].reshape([3, 8])?.exp()),
        case("permute", &[(&[2, 3, 4], F)], |x| x[0].permute(&[2, 0, 1])?.add_scalar(1.0)),
        case("transpose_add", &[(&[5, 7], F), (&[7, 5], F)], |x| x[0].t()?.add(&x[1])),
        case("expand", &[(&[3, 1], F)], |x| x[0].expand([2, 3, 4])),
        case("slice_step", &[(&[10, 6], F)], |x| x[0].slice(0, 1, 9, 3)),
        case("slice_negative_step", &[(&[10, 6], F)], |x| x[0].slice(1, -1, -7, -2)),
        case("slice_then_math", &[(&[20], F)], |x| x[0].slice(0, 2, 18, 1)?.mul_scalar(3.0)),
        case("concat", &[(&[2, 3], F), (&[4, 3], F)], |x| Tensor::concat(&[&x[0], &x[1]], 0)),
        case("concat_axis1", &[(&[2, 3], F), (&[2, 1], F), (&[2, 5], F)], |x| {
            Tensor::concat(&[&x[0], &x[1], &x[2]], 1)
        }),
        case("pad_constant", &[(&[3, 4], F)], |x| x[0].pad(&[(1, 2), (0, 3)], 1.5f32)),
        case("pad_reflect", &[(&[3, 4], F)], |x| x[0].pad_mode(&[(2, 1), (1, 2)], PadMode::Reflect)),
        case("pad_edge", &[(&[3, 4], F)], |x| x[0].pad_mode(&[(1, 1), (2, 0)], PadMode::Edge)),
        case("gather", &[(&[5, 4], F)], |x| {
            let idx = Tensor::from_slice(&[4i32, 0, 2, 2, -1], [5], x[0].device())?;
            x[0].gather(0, &idx)
        }),
        case("iota_arange", &[(&[1], F)], |x| Tensor::arange(0.5, 20.0, 1.5, DType::F32, x[0].device())),
        case("full_scalar_lifted", &[(&[1], F)], |x| Tensor::full([3, 4], 0.37f32, DType::F32, x[0].device())),
        // A long fused chain mixing views and broadcasts.
        case("fused_chain", &[(&[16, 20], F), (&[20], F), (&[16, 1], F)], |x| {
            let a = x[0].mul(&x[1])?.add(&x[2])?.tanh()?;
            let b = a.t()?.sigmoid()?.t()?;
            a.mul(&b)?.sub_scalar(0.1)?.abs()?.sqrt()
        }),
    ];
    // One tensor of 2^20 elements.
    v.push(case("large_2pow20", &[(&[1 << 20], F)], |x| x[0].mul_scalar(1.5)?.add_scalar(0.5)?.relu()?.tanh()));
    v.push(case("large_sum", &[(&[1024, 1024], F)], |x| x[0].sum(&[1], false)));
    v
}

fn tolerance(name: &str) -> (f64, f64) {
    if name.contains("sum") || name.contains("matmul") || name.contains("mean") || name.contains("prod") {
        (1e-4, 1e-4)
    } else {
        (2e-5, 2e-6)
    }
}

fn as_f64(v: &[ScalarValue]) -> Vec<f64> {
    v.iter().map(|s| s.as_f64()).collect()
}

#[test]
fn every_op_matches_the_cpu_reference() {
    let Some(gpu) = common::wgpu() else { return };
    let cpu = Device::cpu();
    let mut failures = Vec::new();
    let cases = cases();
    for c in &cases {
        let run = |dev: &Device| -> lazuli::Result<(Vec<f64>, Shape, DType)> {
            let xs: Vec<Tensor> = c.inputs.iter().enumerate().map(|(k, (s, d))| input(dev, k, s, *d)).collect();
            let y = (c.build)(&xs)?;
            Ok((as_f64(&y.to_scalars()?), y.shape().clone(), y.dtype()))
        };
        let want = run(&cpu).unwrap_or_else(|e| panic!("{}: cpu failed: {e}", c.name));
        let got = match run(&gpu) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{}: wgpu failed: {e}", c.name));
                continue;
            }
        };
        if got.1 != want.1 || got.2 != want.2 {
            failures.push(format!("{}: type {}{} vs cpu {}{}", c.name, got.2, got.1, want.2, want.1));
            continue;
        }
        let (rtol, atol) = tolerance(c.name);
        if let Some((i, (g, w))) = got
            .0
            .iter()
            .zip(&want.0)
            .enumerate()
            .find(|(_, (g, w))| !((g.is_nan() && w.is_nan()) || g == w || (*g - *w).abs() <= atol + rtol * w.abs()))
        {
            failures.push(format!("{}: element {i}: wgpu {g} vs cpu {w}", c.name));
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
    eprintln!("differential: {} cases agree", cases.len());
}

#[test]
fn multi_output_sync_is_one_graph() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&common::rand_vec(64, 5, -1.0, 1.0), [8, 8], &dev).unwrap();
        let a = x.exp().unwrap();
        let b = a.sum(&[0], false).unwrap();
        let c = a.t().unwrap().mul(&x).unwrap();
        let h = lazuli::debug::graph_hash(&[&a, &b, &c]);
        lazuli::sync(&[&a, &b, &c]).unwrap();
        assert_eq!(a.state(), TensorState::DeviceData);
        let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        for j in 0..8 {
            let col: f32 = (0..8).map(|i| av[i * 8 + j]).sum();
            assert!((col - bv[j]).abs() < 1e-4);
        }
        assert_ne!(h, 0);
        assert_eq!(c.to_vec::<f32>().unwrap().len(), 64);
    }
}

#[test]
fn lines_longer_than_a_software_loop_cap_are_exact() {
    // llvmpipe silently stops a loop after 65535 iterations per invocation;
    // the wgpu backend must never return the truncated result.
    let Some(gpu) = common::wgpu() else { return };
    let n = 70_000usize;
    let data: Vec<f32> = (0..n).map(|i| ((i * 37) % 1001) as f32 / 1000.0).collect();
    let mut with_peak = data.clone();
    with_peak[n - 3] = 5.0;
    let x = Tensor::from_slice(&with_peak, [n], &gpu).unwrap();
    assert_eq!(x.argmax(0, false).unwrap().item::<i32>().unwrap(), (n - 3) as i32);
    let c = x.cumsum(0, false, false).unwrap().to_vec::<f32>().unwrap();
    let total: f64 = with_peak.iter().map(|&v| v as f64).sum();
    assert!((c[n - 1] as f64 - total).abs() < 1e-3 * total, "cumsum end {} vs {total}", c[n - 1]);
    let s = x.reshape([1, n as isize]).unwrap().softmax(-1).unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
    assert!((s - 1.0).abs() < 1e-3, "softmax row sums to {s}");
}
