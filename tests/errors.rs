//! Bad input: each returns an `Err` whose message names the op and the
//! shapes or dtypes involved; nothing panics.

mod common;
use lazuli::prelude::*;

fn dev() -> Device {
    Device::cpu()
}

#[track_caller]
fn err_contains(r: lazuli::Result<Tensor>, parts: &[&str]) {
    let e = r.expect_err("expected an error").to_string();
    for p in parts {
        assert!(e.contains(p), "error {e:?} should mention {p:?}");
    }
}

#[test]
fn broadcast_mismatch() {
    let d = dev();
    let a = Tensor::zeros([2, 3], DType::F32, &d).unwrap();
    let b = Tensor::zeros([4], DType::F32, &d).unwrap();
    err_contains(a.add(&b), &["add", "[2, 3]", "[4]"]);
}

#[test]
fn bad_axis() {
    let d = dev();
    let a = Tensor::zeros([2, 3], DType::F32, &d).unwrap();
    err_contains(a.sum(&[2], false), &["reduce_sum", "axis 2", "[2, 3]"]);
    err_contains(a.softmax(-3), &["softmax", "-3", "[2, 3]"]);
}

#[test]
fn dtype_mismatch() {
    let d = dev();
    let a = Tensor::zeros([2], DType::F32, &d).unwrap();
    let b = Tensor::zeros([2], DType::I32, &d).unwrap();
    err_contains(a.mul(&b), &["mul", "f32", "i32"]);
    err_contains(b.exp(), &["exp", "i32"]);
}

#[test]
fn more_bad_input() {
    let d = dev();
    let a = Tensor::zeros([2, 3], DType::F32, &d).unwrap();
    err_contains(a.permute(&[0, 0]), &["permute", "[2, 3]"]);
    err_contains(a.reshape([4, 2]), &["reshape", "[2, 3]"]);
    let b = Tensor::zeros([4, 5], DType::F32, &d).unwrap();
    err_contains(a.matmul(&b), &["matmul", "[2, 3]", "[4, 5]"]);
    err_contains(a.narrow(1, 2, 5), &["slice", "[2, 3]"]);
    let e = Tensor::from_slice(&[1.0f32, 2.0], [3], &d).unwrap_err().to_string();
    assert!(e.contains("from_slice") && e.contains("[3]"), "{e}");
    let i = Tensor::zeros([2], DType::I32, &d).unwrap();
    let e = i.to_vec::<f32>().unwrap_err().to_string();
    assert!(e.contains("to_vec") && e.contains("i32") && e.contains("f32"), "{e}");
}

#[test]
fn mixing_devices_is_an_error() {
    let a = Tensor::zeros([2], DType::F32, &Device::cpu()).unwrap();
    let b = Tensor::zeros([2], DType::F32, &Device::cpu()).unwrap();
    err_contains(a.add(&b), &["add", "different devices"]);
}

#[test]
fn nan_and_inf_propagate() {
    for d in common::devices() {
        let x = Tensor::from_slice(&[f32::NAN, f32::INFINITY, -1.0, 0.0], [4], &d).unwrap();
        let y = x.maximum_scalar(0.0).unwrap().to_vec::<f32>().unwrap();
        assert!(y[0].is_nan(), "maximum keeps NaN on {}", d.name());
        assert_eq!(y[1], f32::INFINITY);
        let z = x.mul_scalar(2.0).unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
        assert!(z.is_nan());
    }
}

#[test]
fn scalar_and_leaf_outputs_can_be_read() {
    for d in common::devices() {
        assert_eq!(Tensor::scalar(1.0f32, DType::F32, &d).item::<f32>().unwrap(), 1.0, "{}", d.name());
        assert_eq!(Tensor::scalar(0.37f32, DType::F32, &d).item::<f32>().unwrap(), 0.37, "{}", d.name());
        assert_eq!(Tensor::full([2], 7i32, DType::I32, &d).unwrap().to_vec::<i32>().unwrap(), vec![7, 7]);
        let x = Tensor::from_slice(&[1.5f32, 2.5], [2], &d).unwrap();
        assert_eq!(x.mul_scalar(1.0).unwrap().to_vec::<f32>().unwrap(), vec![1.5, 2.5], "optimized to a parameter");
        let e = Tensor::zeros([0, 3], DType::F32, &d).unwrap();
        assert_eq!(e.to_vec::<f32>().unwrap(), Vec::<f32>::new());
        let b = Tensor::scalar(true, DType::Bool, &d);
        assert!(b.item::<bool>().unwrap());
    }
}
