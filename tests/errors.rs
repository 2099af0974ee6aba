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

#[test]
fn record_errors_name_the_callers_line() {
    let d = dev();
    let a = Tensor::zeros([2, 3], DType::F32, &d).unwrap();
    let b = Tensor::zeros([4], DType::F32, &d).unwrap();
    let line = line!() + 1;
    let e = a.add(&b).unwrap_err();
    assert!(matches!(e, lazuli::ExecError::Ir { .. }), "{e:?}");
    assert!(e.to_string().contains(&format!("{}:{line}", file!())), "{e}");
    // Through a composition with closures inside, and a reduction's axis.
    let line = line!() + 1;
    let e = a.reshape([4, 2]).unwrap_err().to_string();
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
    let line = line!() + 1;
    let e = a.var(&[5], 1.0, false).unwrap_err().to_string();
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
}

#[test]
fn layer_errors_name_the_layer_its_shapes_and_the_line() {
    let d = dev();
    let fc = lazuli::nn::Linear::new(4, 2, &d).unwrap();
    let x = Tensor::zeros([8, 3], DType::F32, &d).unwrap();
    let line = line!() + 1;
    let e = fc.forward(&x).unwrap_err().to_string();
    for part in ["Linear(in_features=4, out_features=2, bias=true)", "[8, 3]", "in_features = 4"] {
        assert!(e.contains(part), "{e:?} should mention {part:?}");
    }
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
    // Inside a Sequential, called through `dyn Module`: still this line.
    let seq = lazuli::nn::Sequential::new().add(lazuli::nn::Linear::new(3, 3, &d).unwrap()).add(fc);
    let x = Tensor::zeros([8, 3], DType::F32, &d).unwrap();
    let line = line!() + 1;
    let e = seq.forward(&x).unwrap_err().to_string();
    assert!(e.contains("Linear(in_features=4") && e.contains(&format!("{}:{line}", file!())), "{e}");
    // A convolution's shape error, recorded inside the layer's closures.
    let conv = lazuli::nn::Conv2d::builder(3, 4, 3).build(&d).unwrap();
    let img = Tensor::zeros([1, 2, 8, 8], DType::F32, &d).unwrap();
    let line = line!() + 1;
    let e = conv.forward(&img).unwrap_err().to_string();
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
}

#[test]
fn gradients_are_recorded_at_the_backward_line() {
    let d = dev();
    let w = Tensor::from_slice(&[1.0f32, 2.0], [2], &d).unwrap().requires_grad_(true).unwrap();
    let loss = w.mul(&w).unwrap().sum_all().unwrap();
    let line = line!() + 1;
    loss.backward().unwrap();
    let ir = lazuli::debug::ir_text(&[&w.grad().unwrap()]);
    let at = format!("{}:{line}", file!());
    assert!(ir.contains(&at), "the gradient's nodes name the backward() call:\n{ir}");
    assert!(!ir.contains("autograd.rs"), "{ir}");
}

#[test]
fn debug_prints_the_readable_chain_each_level_once() {
    let d = dev();
    // `?` out of main prints `Debug`: the message, not the struct.
    let i = Tensor::zeros([2], DType::I32, &d).unwrap();
    let line = line!() + 1;
    let e = i.to_vec::<f32>().unwrap_err();
    let debug = format!("{e:?}");
    assert!(!debug.contains("ReadDType {") && !debug.contains("actual:"), "{debug}");
    assert!(debug.contains("to_vec::<i32>()") && debug.contains(".cast(DType::F32)"), "the fix: {debug}");
    assert!(debug.contains(&format!("{}:{line}", file!())), "{debug}");
    assert_eq!(debug, e.to_string(), "one level: Debug is the message");
    // A failed computation: an embedding id out of range, read later.
    let emb = lazuli::nn::Embedding::new(10, 4, &d).unwrap();
    let ids = Tensor::from_slice(&[3i32, 12], [2], &d).unwrap();
    let line = line!() + 1;
    let y = emb.forward(&ids).unwrap();
    let e = y.to_vec::<f32>().unwrap_err();
    let debug = format!("{e:?}");
    assert!(debug.contains("\n\nCaused by:\n    0: "), "{debug}");
    assert_eq!(debug.matches("index 12").count(), 1, "each level once: {debug}");
    assert!(debug.contains(&format!("recorded at {}:{line}", file!())), "the recording line: {debug}");
    assert!(debug.contains("embedding lookup"), "and what recorded it: {debug}");
    assert!(std::error::Error::source(&e).is_none(), "the chain is in the message, not repeated as a source");
    // Display is the same chain on one line.
    let display = e.to_string();
    assert!(!display.contains('\n') && display.contains("index 12") && display.contains("computing the value failed"));
}

#[test]
fn reading_the_wrong_number_of_values_says_what_to_do() {
    let d = dev();
    let t = Tensor::zeros([3], DType::F32, &d).unwrap();
    let e = t.item::<f32>().unwrap_err().to_string();
    assert!(e.contains("to_vec") && e.contains("sum_all"), "{e}");
}
