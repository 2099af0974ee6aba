//! CPU fallback inside a wgpu sync: forced fallback gives the native
//! results, f64/i64 run on the CPU without narrowing, every fallen-back op
//! is counted (`Fallback::<op>`), and data crosses only at boundaries.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

fn program(dev: &Device) -> (Vec<f32>, Vec<f32>) {
    let a = Tensor::from_slice(&common::rand_vec(6 * 5, 1, -1.0, 1.0), [6, 5], dev).unwrap();
    let b = Tensor::from_slice(&common::rand_vec(5 * 4, 2, -1.0, 1.0), [5, 4], dev).unwrap();
    let h = a.exp().unwrap().matmul(&b).unwrap().tanh().unwrap();
    let s = h.softmax(-1).unwrap().sum(&[0], false).unwrap();
    lazuli::sync(&[&h, &s]).unwrap();
    (h.to_vec().unwrap(), s.to_vec().unwrap())
}

#[test]
fn forced_fallback_equals_native() {
    let _g = common::metrics_lock();
    let Some(gpu) = common::wgpu() else { return };
    let native = program(&gpu);
    let before = (metrics::counter("Fallback::exp"), metrics::counter("Fallback::matmul"));
    gpu.set_force_fallback(&["exp", "matmul"]);
    let forced = program(&gpu);
    gpu.set_force_fallback(&[]);
    assert!(metrics::counter("Fallback::exp") > before.0, "exp ran on the CPU fallback");
    assert!(metrics::counter("Fallback::matmul") > before.1, "matmul ran on the CPU fallback");
    common::assert_close(&forced.0, &native.0, 1e-5, 1e-6, "h");
    common::assert_close(&forced.1, &native.1, 1e-5, 1e-6, "softmax sums");
    let report = metrics::report();
    assert!(report.contains("Fallback::exp") && report.contains("FallbackOps"), "{report}");
}

#[test]
fn f64_and_i64_are_never_narrowed() {
    let Some(gpu) = common::wgpu() else { return };
    // 1 + 1e-12 is not representable in f32: narrowing would give 0.
    let x = Tensor::from_slice(&[1.0f64 + 1e-12, 2.0], [2], &gpu).unwrap();
    let d = x.sub_scalar(1.0).unwrap().to_vec::<f64>().unwrap();
    // f64 rounding of 1 + 1e-12 leaves ~1e-16 of error; f32 would leave 0.
    assert!((d[0] - 1e-12).abs() < 1e-15, "f64 kept its precision: {}", d[0]);
    // 2^40 + 1 overflows i32 and is not exact in f32.
    let big = (1i64 << 40) + 1;
    let y = Tensor::from_slice(&[big, -big], [2], &gpu).unwrap();
    assert_eq!(y.mul_scalar(3i64).unwrap().to_vec::<i64>().unwrap(), vec![3 * big, -3 * big]);
}

#[test]
fn mixed_graph_moves_data_only_at_segment_boundaries() {
    let _g = common::metrics_lock();
    let Some(gpu) = common::wgpu() else { return };
    let data = common::rand_vec(64, 3, -1.0, 1.0);
    let x = Tensor::from_slice(&data, [64], &gpu).unwrap();
    // f32 (native) -> f64 (fallback) -> f32 (native).
    let y =
        x.mul_scalar(2.0).unwrap().cast(DType::F64).unwrap().exp().unwrap().cast(DType::F32).unwrap().sqrt().unwrap();
    let t0 = metrics::counter("FallbackTransfers");
    let got = y.to_vec::<f32>().unwrap();
    let moved = metrics::counter("FallbackTransfers") - t0;
    assert_eq!(moved, 2, "one transfer into the fallback segment, one out of it");
    let want: Vec<f32> = data.iter().map(|v| ((*v as f64 * 2.0).exp() as f32).sqrt()).collect();
    common::assert_close(&got, &want, 1e-6, 1e-7, "mixed graph");
}
