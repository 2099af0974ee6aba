//! The bad-input catalogue: every misuse returns an `Err` whose message
//! names the op, the shapes or dtypes involved and what was expected;
//! nothing panics. Extends `errors.rs` (which has the first example of
//! each kind on the CPU device) to every op family, to the wgpu device, to
//! tensors too large for the adapter, NaN/Inf semantics and use after a
//! device failure. The README's Reliability section lists the catalogue.

mod common;
use lazuli::ir::{ArgReduceOp, Op, PadMode, ReduceOp};
use lazuli::prelude::*;

#[track_caller]
fn err_contains<T: std::fmt::Debug>(r: lazuli::Result<T>, parts: &[&str]) -> String {
    let e = r.expect_err("expected an error").to_string();
    for p in parts {
        assert!(e.contains(p), "error {e:?} should mention {p:?}");
    }
    e
}

fn f32s(dims: &[usize], d: &Device) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_slice(&common::rand_vec(n, 3, -1.0, 1.0), dims.to_vec(), d).unwrap()
}

#[test]
fn broadcast_mismatch_in_every_broadcasting_op() {
    for d in common::devices() {
        let a = f32s(&[2, 3], &d);
        let b = f32s(&[4, 1, 2], &d);
        err_contains(a.sub(&b), &["sub", "[2, 3]", "[4, 1, 2]"]);
        err_contains(a.lt(&b), &["lt", "[2, 3]", "[4, 1, 2]"]);
        let c = Tensor::from_slice(&[true, false], [2], &d).unwrap();
        err_contains(c.where_(&a, &a), &["where", "[2]", "[2, 3]"]);
        err_contains(a.expand([3, 3]), &["expand", "[2, 3]", "[3, 3]"]);
        err_contains(a.expand([3]), &["expand", "[2, 3]", "[3]"]);
        let m = f32s(&[2, 3, 4], &d);
        let n = f32s(&[3, 4, 5], &d);
        err_contains(m.matmul(&n), &["matmul", "batch", "[2, 3, 4]", "[3, 4, 5]"]);
        err_contains(&a + &b, &["add", "[2, 3]", "[4, 1, 2]"]);
    }
}

#[test]
fn bad_axes() {
    let d = Device::cpu();
    let a = f32s(&[2, 3], &d);
    err_contains(a.argmax(2, false), &["argmax", "axis 2", "[2, 3]"]);
    err_contains(a.arg_reduce(ArgReduceOp::ArgMin, -3, false, false), &["arg_reduce", "-3", "[2, 3]"]);
    err_contains(a.cumsum(5, false, false), &["cumsum", "5", "[2, 3]"]);
    err_contains(a.log_softmax(2), &["log_softmax", "2", "[2, 3]"]);
    err_contains(a.mean(&[0, -2], false), &["reduce_mean", "repeat", "[2, 3]"]);
    err_contains(a.max(&[7], true), &["reduce_max", "axis 7", "[2, 3]"]);
    err_contains(a.transpose(0, 2), &["transpose", "2", "[2, 3]"]);
    err_contains(a.unsqueeze(4), &["unsqueeze", "4", "[2, 3]"]);
    err_contains(a.squeeze(&[0]), &["squeeze", "size 2", "[2, 3]"]);
    err_contains(a.flatten(1, 0), &["flatten", "[2, 3]"]);
    err_contains(Tensor::concat(&[&a, &a], 2), &["concat", "2", "[2, 3]"]);
    err_contains(a.gather(-3, &Tensor::zeros([1], DType::I32, &d).unwrap()), &["gather", "-3", "[2, 3]"]);
    err_contains(a.slice(3, 0, 1, 1), &["slice", "3", "[2, 3]"]);
    let s = Tensor::scalar(1.5f32, DType::F32, &d);
    err_contains(s.softmax(0), &["softmax", "[]"]);
    err_contains(f32s(&[3, 0], &d).argmax(1, false), &["argmax", "empty axis", "[3, 0]"]);
}

#[test]
fn bad_permutations() {
    let d = Device::cpu();
    let a = f32s(&[2, 3, 4], &d);
    err_contains(a.permute(&[0, 1]), &["permute", "[2, 3, 4]", "not a permutation"]);
    err_contains(a.permute(&[0, 1, 2, 3]), &["permute", "[2, 3, 4]"]);
    err_contains(a.permute(&[0, 1, 5]), &["permute", "[2, 3, 4]"]);
    err_contains(a.permute(&[2, -1, 0]), &["permute", "[2, 3, 4]"]);
}

#[test]
fn reshape_to_a_different_element_count() {
    let d = Device::cpu();
    let a = f32s(&[2, 3], &d);
    err_contains(a.reshape([-1, -1]), &["reshape", "[2, 3]", "6 elements"]);
    err_contains(a.reshape([4, -1]), &["reshape", "[2, 3]", "6 elements"]);
    err_contains(a.reshape([-2, 3]), &["reshape", "[2, 3]"]);
    err_contains(a.reshape([0, -1]), &["reshape", "[2, 3]"]);
    err_contains(a.reshape_to([7]), &["reshape", "[2, 3]", "[7]", "7 elements"]);
    err_contains(a.reshape([isize::MAX, 2]), &["reshape", "[2, 3]"]);
}

#[test]
fn matmul_inner_dimension_mismatch() {
    let d = Device::cpu();
    err_contains(f32s(&[5, 2, 3], &d).matmul(&f32s(&[5, 4, 3], &d)), &["matmul", "inner", "3 != 4"]);
    err_contains(f32s(&[3], &d).matmul(&f32s(&[4], &d)), &["matmul", "3 != 4"]);
    err_contains(f32s(&[2, 3], &d).matmul(&f32s(&[2], &d)), &["matmul", "3 != 2"]);
    let s = Tensor::scalar(2.5f32, DType::F32, &d);
    err_contains(s.matmul(&f32s(&[2, 2], &d)), &["matmul", "rank >= 1", "[]"]);
}

#[test]
fn slices_out_of_range() {
    let d = Device::cpu();
    let a = f32s(&[4, 5], &d);
    err_contains(a.narrow(0, 3, 2), &["slice", "out of range", "[4, 5]"]);
    err_contains(a.narrow(1, 9, 1), &["slice", "[4, 5]"]);
    err_contains(a.slice(0, 0, 4, 0), &["slice", "step 0", "[4, 5]"]);
    let bad = Op::Slice { starts: vec![0, -1], steps: vec![1, 1], lens: vec![4, 2] };
    err_contains(Tensor::record(bad, &[&a]), &["slice", "out of range", "[4, 5]"]);
    let bad = Op::Slice { starts: vec![3, 0], steps: vec![-2, 1], lens: vec![3, 5] };
    err_contains(Tensor::record(bad, &[&a]), &["slice", "step -2", "[4, 5]"]);
    // Clamping (numpy semantics) is not an error: the slice is empty.
    assert_eq!(a.slice(0, 10, 20, 1).unwrap().dims(), &[0, 5]);
    assert_eq!(a.slice(1, -1, -100, -2).unwrap().dims(), &[4, 3]);
    err_contains(a.pad_mode(&[(4, 0), (0, 0)], PadMode::Reflect), &["pad", "Reflect", "[4, 5]"]);
}

#[test]
fn dtype_mismatches() {
    let d = Device::cpu();
    let f = f32s(&[2], &d);
    let i = Tensor::from_slice(&[1i32, 0], [2], &d).unwrap();
    let b = Tensor::from_slice(&[true, false], [2], &d).unwrap();
    err_contains(f.where_(&f, &f), &["where", "condition must be bool", "f32"]);
    err_contains(b.where_(&f, &i), &["where", "same dtype", "f32", "i32"]);
    err_contains(Tensor::concat(&[&f, &i], 0), &["concat", "same dtype", "f32", "i32"]);
    err_contains(f.gather(0, &f), &["gather", "integer", "f32"]);
    err_contains(i.mean(&[0], false), &["reduce_mean", "float", "i32"]);
    err_contains(i.softmax(0), &["softmax", "float", "i32"]);
    err_contains(f.logical_and(&f), &["logical_and", "f32"]);
    err_contains(b.cumsum(0, false, false), &["cumsum", "numeric", "bool"]);
    err_contains(f32s(&[2, 2], &d).matmul(&Tensor::zeros([2, 2], DType::I32, &d).unwrap()), &["matmul", "f32", "i32"]);
    let pad = Op::Pad { before: vec![1], after: vec![0], mode: PadMode::Constant };
    err_contains(Tensor::record(pad, &[&f, &Tensor::scalar(1, DType::I32, &d)]), &["pad", "rank-0", "f32", "i32"]);
    err_contains(f.assign(&i), &["assign", "i32[2]", "f32[2]"]);
}

#[test]
fn reading_with_the_wrong_element_type() {
    for d in common::devices() {
        let i = Tensor::from_slice(&[1i32, 2], [2], &d).unwrap().add_scalar(1).unwrap();
        err_contains(i.to_vec::<f32>(), &["to_vec", "dtype i32", "[2]", "as f32"]);
        err_contains(i.item::<i32>(), &["item", "[2]", "2 elements"]);
        let f = Tensor::scalar(2.5f32, DType::F32, &d);
        err_contains(f.item::<f64>(), &["item", "f32", "f64"]);
        err_contains(f.to_vec::<bool>(), &["to_vec", "f32", "bool"]);
        // The tensor is still readable with the right type.
        assert_eq!(i.to_vec::<i32>().unwrap(), vec![2, 3]);
    }
}

#[test]
fn bad_host_data_and_ranges() {
    let d = Device::cpu();
    err_contains(Tensor::from_slice(&[1.0f32; 5], [2, 3], &d), &["from_slice", "5 values", "[2, 3]", "6 elements"]);
    let ty = lazuli::ir::ValueType::new(Shape::new(vec![2]), DType::F32);
    err_contains(Tensor::from_bytes(vec![0u8; 7], ty, &d), &["from_bytes", "[2]"]);
    err_contains(Tensor::arange(0.0, 1.0, 0.0, DType::F32, &d), &["arange", "step 0"]);
    err_contains(Tensor::arange(f64::NAN, 1.0, 1.0, DType::F32, &d), &["arange", "NaN"]);
    err_contains(Tensor::concat(&[], 0), &["concat", "at least 1"]);
    err_contains(
        Tensor::record(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[]),
        &["reduce_sum", "at least 1"],
    );
}

/// A tensor larger than one storage binding is bound in windows
/// (`tests/big_tensors.rs`); one beyond what kernels can index (u32
/// element indices, 16 GiB of f32) is a clear error, raised at the
/// barrier and naming the op that produced it, its size in bytes and the
/// limit.
#[test]
fn tensor_larger_than_kernels_can_index() {
    let Some(gpu) = common::wgpu() else { return };
    // (2^30 + 1) f32 = 4 GiB + 4 bytes: fused into a reduction it needs no
    // buffer at all, so it just works.
    let n = (1usize << 30) + 1;
    let big = Tensor::iota([n], 0, DType::F32, &gpu).unwrap().mul_scalar(0.0).unwrap().exp().unwrap();
    assert_eq!(big.max(&[], false).unwrap().item::<f32>().unwrap(), 1.0);
    // 2^32 + 1 elements, materialized: refused when compiling, before any
    // allocation.
    let n = (1usize << 32) + 1;
    let big = Tensor::iota([n], 0, DType::F32, &gpu).unwrap().mul_scalar(0.0).unwrap().exp().unwrap();
    let e = err_contains(
        lazuli::sync(&[&big]).and_then(|()| big.to_vec::<f32>()),
        &["17179869188 bytes exceed", "u32 element indices"],
    );
    assert!(e.contains("iota:"), "names the op: {e}");
    // The device is fine afterwards.
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &gpu).unwrap();
    assert_eq!(x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    gpu.wait().unwrap_or(());
}

#[test]
fn mixing_tensors_of_two_devices() {
    let mut devs = vec![Device::cpu(), Device::cpu()];
    devs.extend(common::wgpu());
    let (a, b) = (&devs[0], devs.last().unwrap());
    let x = f32s(&[2, 2], a);
    let y = f32s(&[2, 2], b);
    err_contains(x.add(&y), &["add", "different devices"]);
    err_contains(x.matmul(&y), &["matmul", "different devices"]);
    err_contains(Tensor::concat(&[&x, &y], 0), &["concat", "different devices"]);
    let c = Tensor::from_slice(&[true, false], [2], b).unwrap();
    err_contains(c.where_(&x, &x), &["where", "different devices"]);
    let i = Tensor::zeros([1], DType::I32, b).unwrap();
    err_contains(x.gather(0, &i), &["gather", "different devices"]);
    err_contains(x.assign(&y), &["assign", "different devices"]);
    err_contains(lazuli::sync(&[&x, &y]), &["sync", "different devices"]);
    // Both tensors are intact.
    x.to_vec::<f32>().unwrap();
    y.to_vec::<f32>().unwrap();
}

/// NaN and Inf follow IEEE 754 / ONNX on every device: no error, no
/// flush to a finite value.
#[test]
fn nan_and_inf_propagate_like_ieee() {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    type F = fn(&Tensor) -> lazuli::Result<Tensor>;
    let cases: Vec<(&str, Vec<f32>, F, Vec<f32>)> = vec![
        ("exp", vec![inf, -inf, nan], |x| x.exp(), vec![inf, 0.0, nan]),
        ("log", vec![0.0, -1.0, inf], |x| x.log(), vec![-inf, nan, inf]),
        ("sqrt", vec![-1.0, inf, nan], |x| x.sqrt(), vec![nan, inf, nan]),
        ("div", vec![0.0, 1.0, -1.0], |x| x.div_scalar(0.0), vec![nan, inf, -inf]),
        ("sub_inf", vec![inf, -inf, 1.0], |x| x.sub_scalar(f32::INFINITY), vec![nan, -inf, -inf]),
        ("mul_zero", vec![inf, nan, 2.0], |x| x.mul_scalar(0.0), vec![nan, nan, 0.0]),
        ("tanh", vec![inf, -inf, nan], |x| x.tanh(), vec![1.0, -1.0, nan]),
        ("sigmoid", vec![inf, -inf, nan], |x| x.sigmoid(), vec![1.0, 0.0, nan]),
        ("relu", vec![nan, -inf, inf], |x| x.relu(), vec![nan, 0.0, inf]),
        ("minimum", vec![nan, 1.0, -inf], |x| x.minimum_scalar(0.0), vec![nan, 0.0, -inf]),
        ("abs_neg", vec![-inf, nan, -0.0], |x| x.abs()?.neg(), vec![-inf, nan, -0.0]),
        ("max_reduce", vec![1.0, nan, 3.0], |x| x.max(&[0], false), vec![nan]),
        ("sum_reduce", vec![inf, -inf, 1.0], |x| x.sum(&[0], false), vec![nan]),
        ("softmax_inf", vec![-inf, 0.0, 0.0], |x| x.softmax(0), vec![0.0, 0.5, 0.5]),
        ("isnan", vec![nan, inf, 0.0], |x| x.isnan()?.cast(DType::F32), vec![1.0, 0.0, 0.0]),
        ("isinf", vec![nan, -inf, 0.0], |x| x.isinf()?.cast(DType::F32), vec![0.0, 1.0, 0.0]),
        ("eq_nan", vec![nan, 1.0, inf], |x| x.eq(x)?.cast(DType::F32), vec![0.0, 1.0, 1.0]),
        ("ne_nan", vec![nan, 1.0, inf], |x| x.ne(x)?.cast(DType::F32), vec![1.0, 0.0, 0.0]),
        ("argmax_nan", vec![1.0, nan, 3.0], |x| x.argmax(0, false)?.cast(DType::F32), vec![1.0]),
        ("matmul_inf", vec![inf, 0.0, 1.0], |x| x.reshape([1, 3])?.matmul(&x.reshape([3, 1])?), vec![inf]),
    ];
    // WGSL lets drivers assume no NaN (lavapipe folded `x != x` to false,
    // docs/reliability-findings.md finding 3); the wgpu codegen tests NaN
    // by bit pattern, so no deviation is tolerated any more.
    let known_wgpu: [&str; 0] = [];
    let mut failures = Vec::new();
    let mut known = Vec::new();
    for d in common::devices() {
        for (name, input, f, want) in &cases {
            let x = Tensor::from_slice(input, [input.len()], &d).unwrap();
            let got = f(&x).and_then(|y| y.to_vec::<f32>());
            let ok = got.as_ref().is_ok_and(|g| {
                g.len() == want.len()
                    && g.iter().zip(want).all(|(g, w)| {
                        (g.is_nan() && w.is_nan())
                            || g == w && g.is_sign_negative() == w.is_sign_negative()
                            || (g - w).abs() < 1e-6
                    })
            });
            if !ok && d.kind() == lazuli::BackendKind::Wgpu && known_wgpu.contains(name) {
                known.push(format!("{name} on {}: got {got:?}, want {want:?}", d.name()));
            } else if !ok {
                failures.push(format!("{name} on {}: got {got:?}, want {want:?}", d.name()));
            }
        }
    }
    assert!(failures.is_empty(), "IEEE semantics broken:\n{}", failures.join("\n"));
    if !known.is_empty() {
        eprintln!("known deviations (finding 3):\n{}", known.join("\n"));
    }
}

#[test]
fn using_a_tensor_after_its_device_failed() {
    for d in common::devices() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &d).unwrap();
        let keep = a.mul_scalar(2.0).unwrap();
        keep.to_vec::<f32>().unwrap();
        let w = Tensor::from_slice(&[0.5f32; 3], [3], &d).unwrap();
        let bad = a.exp().unwrap().sum(&[0], true).unwrap();
        d.fail_next_executions(1);
        bad.sync().unwrap();
        // Every use of the failed value is an error naming the cause.
        let e = err_contains(bad.to_vec::<f32>(), &["injected device failure"]);
        assert!(e.contains("to_vec"), "{e}");
        err_contains(bad.to_vec::<f32>(), &["injected device failure"]);
        err_contains(bad.item::<f32>(), &["item", "computing the value failed", "synced by sync at", "injected"]);
        err_contains(
            bad.add_scalar(1.0).unwrap().to_vec::<f32>(),
            &["depends on a value whose computation failed earlier", "synced by sync at", "injected"],
        );
        err_contains(
            bad.expand([2, 3]).unwrap().matmul(&a.reshape([3, 1]).unwrap()).unwrap().to_vec::<f32>(),
            &["injected"],
        );
        // assign makes w hold the failed value: reading w fails, and
        // mark_step with the poisoned tensor live reports it.
        w.assign(&bad.expand([3]).unwrap()).unwrap();
        err_contains(w.to_vec::<f32>(), &["injected"]);
        let _ = d.mark_step();
        let _ = d.wait();
        // Other tensors are intact and the device keeps working.
        assert_eq!(keep.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
        assert_eq!(a.neg().unwrap().to_vec::<f32>().unwrap(), vec![-1.0, -2.0, -3.0]);
        w.assign(&a).unwrap();
        assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        d.wait().unwrap();
    }
}

#[test]
fn out_of_range_gather_index_is_an_error_on_every_device() {
    for d in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &d).unwrap();
        let idx = Tensor::from_slice(&[0i32, 3], [2], &d).unwrap();
        let e = x.gather(0, &idx).unwrap().to_vec::<f32>().unwrap_err().to_string();
        assert!(e.contains("gather") && e.contains("out of range"), "{} gave {e}", d.name());
        let ok = Tensor::from_slice(&[2i32, -3], [2], &d).unwrap();
        assert_eq!(x.gather(0, &ok).unwrap().to_vec::<f32>().unwrap(), vec![3.0, 1.0]);
    }
}
