//! API conveniences that must not surprise: scalar operands follow type
//! promotion (never a silent truncation or wrap), reshape sizes and
//! slice/narrow positions take any integer type, `sum(&[])` and
//! `reduce_axes(&[])` agree, defaults of the conv and pooling attributes.

mod common;

use lazuli::ir::{ConvAttrs, PoolAttrs, PoolKind, ReduceOp};
use lazuli::prelude::*;

#[test]
fn scalar_sugar_follows_type_promotion() {
    for dev in common::devices() {
        let i = Tensor::from_slice(&[1i32, 2, -3], [3], &dev).unwrap();
        // An int tensor and a float scalar give f32, never `+ 1`.
        let y = (&i + 1.5).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.5, 3.5, -1.5]);
        let y = (&i * 0.5f64).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![0.5, 1.0, -1.5]);
        // Comparisons promote too: 1 >= 1.5 is false (truncating the scalar
        // to 1 would say true).
        assert_eq!(i.ge_scalar(1.5).unwrap().to_vec::<bool>().unwrap(), vec![false, true, false]);
        // Integer scalars keep the integer dtype.
        let y = (&i + 2).unwrap();
        assert_eq!(y.dtype(), DType::I32);
        assert_eq!(y.to_vec::<i32>().unwrap(), vec![3, 4, -1]);
        let y = (i.clone() - 1i64).unwrap();
        assert_eq!(y.to_vec::<i32>().unwrap(), vec![0, 1, -4]);
        // f64 scalars with f32 tensors stay f32.
        let f = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
        let y = (&f / 4.0f64).unwrap();
        assert_eq!((y.dtype(), y.to_vec::<f32>().unwrap()), (DType::F32, vec![0.25, 0.5]));
        // A value the integer dtype cannot hold is an error, not a wrap.
        let u = Tensor::from_slice(&[1u8, 2], [2], &dev).unwrap();
        let e = (&u + 300).unwrap_err().to_string();
        assert!(e.contains("300") && e.contains("u8"), "{e}");
        assert!(u.sub_scalar(-1).is_err());
        assert!(i.add_scalar(1i64 << 40).is_err());
        // Bool tensors: a float scalar makes them f32, 0/1 integers are fine.
        let b = Tensor::from_slice(&[true, false], [2], &dev).unwrap();
        assert_eq!((&b * 2.5).unwrap().to_vec::<f32>().unwrap(), vec![2.5, 0.0]);
        assert_eq!(b.eq_scalar(1).unwrap().to_vec::<bool>().unwrap(), vec![true, false]);
        assert!(b.eq_scalar(2).is_err());
        // clamp with float bounds on an int tensor promotes as well.
        assert_eq!(i.clamp(Some(1.5), None).unwrap().to_vec::<f32>().unwrap(), vec![1.5, 2.0, 1.5]);
    }
}

#[test]
fn reshape_slice_and_narrow_take_any_integer_type() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&(0..24).map(|v| v as f32).collect::<Vec<_>>(), [2, 3, 4], &dev).unwrap();
    let (rows, cols): (usize, usize) = (6, 4);
    assert_eq!(x.reshape([rows, cols]).unwrap().dims(), &[6, 4]);
    assert_eq!(x.reshape(&[rows, cols][..]).unwrap().dims(), &[6, 4]);
    assert_eq!(x.reshape(vec![4usize, 6]).unwrap().dims(), &[4, 6]);
    assert_eq!(x.reshape([2, -1]).unwrap().dims(), &[2, 12]);
    assert_eq!(x.reshape([-1i64, 3]).unwrap().dims(), &[8, 3]);
    assert_eq!(x.reshape(Shape::new([24])).unwrap().dims(), &[24]);
    assert!(x.reshape([usize::MAX, 1]).is_err());
    // slice and narrow agree on index types: usize, i64, i32 all work.
    let n: usize = 3;
    let a = x.slice(2, 1, n, 1).unwrap();
    let b = x.narrow(2, 1usize, n - 1).unwrap();
    let c = x.slice(2, 1i64, 3i64, 1i64).unwrap();
    let d = x.narrow(-1, 1i32, 2i32).unwrap();
    for t in [&b, &c, &d] {
        assert_eq!(t.to_vec::<f32>().unwrap(), a.to_vec::<f32>().unwrap());
    }
    // narrow counts a negative start from the end, like slice.
    assert_eq!(
        x.narrow(2, -2, 2).unwrap().to_vec::<f32>().unwrap(),
        x.slice(2, -2, 4, 1).unwrap().to_vec::<f32>().unwrap()
    );
    let e = x.narrow(2, 3, 2).unwrap_err().to_string();
    assert!(e.contains("narrow") && e.contains("[2, 3, 4]"), "{e}");
    assert!(x.narrow(2, 0, -1).is_err());
    assert!(x.narrow(2, -5, 1).is_err());
    // Bounds beyond i64 clamp like any out-of-range bound.
    assert_eq!(x.slice(2, 0, u64::MAX, 1).unwrap().dims(), &[2, 3, 4]);
}

#[test]
fn sum_and_reduce_axes_agree_on_empty_axes() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], &dev).unwrap();
    let a = x.sum(&[], false).unwrap();
    let b = x.reduce_axes(ReduceOp::Sum, &[], false).unwrap();
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.item::<f32>().unwrap(), 10.0);
    assert_eq!(b.item::<f32>().unwrap(), 10.0);
    assert_eq!(x.reduce_axes(ReduceOp::Max, &[], true).unwrap().dims(), &[1, 1]);
    // The gradient of an identity reduction recorded as an IR node (no axes).
    let l = x.requires_grad_(true).unwrap();
    let r = Tensor::record(lazuli::ir::Op::Reduce { op: ReduceOp::Max, axes: vec![], keepdim: true }, &[&l]).unwrap();
    r.sum(&[], false).unwrap().backward().unwrap();
    assert_eq!(l.grad().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 4]);
}

#[test]
fn conv_and_pool_attributes_have_defaults() {
    let dev = Device::cpu();
    let x = Tensor::ones([1, 1, 4, 4], DType::F32, &dev).unwrap();
    let w = Tensor::ones([1, 1, 3, 3], DType::F32, &dev).unwrap();
    let y = x.conv2d(&w, ConvAttrs { pads: [1; 4], ..Default::default() }).unwrap();
    assert_eq!(y.dims(), &[1, 1, 4, 4]);
    assert_eq!(y.to_vec::<f32>().unwrap()[5], 9.0);
    let p = x.pool(PoolAttrs::default()).unwrap();
    assert_eq!(p.dims(), &[1, 1, 2, 2]);
    let a = PoolAttrs { kind: PoolKind::Avg { count_include_pad: false }, ..PoolAttrs::new(PoolKind::Max, &[3, 3]) }
        .with_strides(&[1, 1])
        .with_padding(&[1, 1]);
    assert_eq!(x.pool(a).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 16]);
}

#[test]
#[allow(clippy::needless_borrows_for_generic_args)] // The point: `&[2, 2]` is what a PyTorch user writes.
fn pytorch_habits_compile_and_do_what_they_say() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 6.0], &[2, 2], &dev).unwrap(); // a slice as a shape
        assert_eq!(x.sum_all().unwrap().item::<f32>().unwrap(), 12.0);
        assert_eq!(x.mean_all().unwrap().item::<f32>().unwrap(), 3.0);
        assert_eq!(x.zeros_like().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 4]);
        assert_eq!(x.ones_like().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 4]);
        let f = x.full_like(0.5).unwrap();
        assert_eq!((f.dims(), f.dtype(), f.to_vec::<f32>().unwrap()), (&[2usize, 2][..], DType::F32, vec![0.5; 4]));
        assert!(Tensor::zeros(&[3, 1], DType::F32, &dev).unwrap().dims() == [3, 1]);
        // argmax gives i32; argmax_as gives the index dtype asked for.
        let i = x.argmax(-1, false).unwrap();
        assert_eq!((i.dtype(), i.to_vec::<i32>().unwrap()), (DType::I32, vec![1, 1]));
        let l = x.argmax_as(-1, false, DType::I64).unwrap();
        assert_eq!((l.dtype(), l.to_vec::<i64>().unwrap()), (DType::I64, vec![1, 1]));
        assert_eq!(x.argmin_as(0, false, DType::I32).unwrap().to_vec::<i32>().unwrap(), vec![0, 0]);
        assert!(x.argmax_as(0, false, DType::F32).is_err(), "an index dtype is an integer");
        // Reading argmax's i32 as i64 says what to do.
        let e = i.to_vec::<i64>().unwrap_err().to_string();
        assert!(e.contains("to_vec::<i32>()") && e.contains(".cast(DType::I64)"), "{e}");
        if dev.kind() != lazuli::BackendKind::Cpu {
            assert!(
                lazuli::warn::given().iter().any(|w| w.contains("argmax_as") && w.contains("CPU fallback")),
                "an i64 index on wgpu is a fallback, and says so"
            );
        }
    }
    // AdamW under its own name, with PyTorch's default weight decay.
    let dev = Device::cpu();
    let p = Tensor::ones([2], DType::F32, &dev).unwrap().requires_grad_(true).unwrap();
    let opt = lazuli::optim::AdamW::new(vec![p], 1e-3);
    assert!(opt.decoupled && opt.weight_decay == 0.01);
}
