//! Cross-entropy with 64-bit labels (PyTorch's default dtype) on wgpu: a
//! whole f32 training step (forward, backward, SGD update) with i64 or u64
//! host labels runs with no op on the CPU fallback, and gives the CPU's
//! answer, including for labels outside the i32 range (which must match
//! no class, not the class their low bits name) and ignored ones.

mod common;

use lazuli::metrics;
use lazuli::nn::{self, CrossEntropyOptions};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;

const CLASSES: usize = 5;

/// Labels with ignored (-100), out-of-class (5) and out-of-i32 values:
/// `(1 << 40) | 3` wraps to class 3 and `-(1 << 40) + 1` to class 1 as
/// i32, and `i64::MAX` to -1.
const LABELS: [i64; 8] = [0, 4, -100, 5, (1 << 40) | 3, -(1 << 40) + 1, i64::MAX, 2];

/// The loss, the weight gradient and the weight after one SGD step of a
/// linear classifier with fixed parameters on `dev`, for `labels` made on
/// `dev`.
fn step(dev: &Device, labels: &dyn Fn(&Device) -> Tensor, opts: &CrossEntropyOptions) -> (f32, Vec<f32>, Vec<f32>) {
    let w = Tensor::from_slice(&common::rand_vec(CLASSES * 6, 7, -1.0, 1.0), [CLASSES, 6], dev).unwrap();
    let w = w.requires_grad_(true).unwrap();
    let x = Tensor::from_slice(&common::rand_vec(LABELS.len() * 6, 8, -2.0, 2.0), [LABELS.len(), 6], dev).unwrap();
    let mut opt = Sgd::new(vec![w.clone()], 0.5);
    let loss = nn::cross_entropy_with(&x.matmul(&w.t().unwrap()).unwrap(), &labels(dev), opts).unwrap();
    loss.backward().unwrap();
    let grad = w.grad().unwrap().to_vec::<f32>().unwrap();
    let value = loss.item::<f32>().unwrap();
    opt.step().unwrap();
    dev.mark_step().unwrap();
    (value, grad, w.to_vec::<f32>().unwrap())
}

fn i64_labels(dev: &Device) -> Tensor {
    Tensor::from_slice(&LABELS, [LABELS.len()], dev).unwrap()
}

fn u64_labels(dev: &Device) -> Tensor {
    let v: Vec<u64> = LABELS.iter().map(|&l| l as u64).collect();
    Tensor::from_slice(&v, [LABELS.len()], dev).unwrap()
}

fn assert_same(got: &(f32, Vec<f32>, Vec<f32>), want: &(f32, Vec<f32>, Vec<f32>), what: &str) {
    common::assert_close(&[got.0], &[want.0], 1e-5, 1e-6, &format!("{what}: loss"));
    common::assert_close(&got.1, &want.1, 1e-5, 1e-6, &format!("{what}: weight gradient"));
    common::assert_close(&got.2, &want.2, 1e-5, 1e-6, &format!("{what}: updated weight"));
}

#[test]
fn i64_and_u64_labels_train_on_wgpu_with_no_fallback_and_the_cpus_answer() {
    let Some(gpu) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    let cpu = Device::cpu();
    let options = [
        CrossEntropyOptions::default(),
        CrossEntropyOptions { ignore_index: Some(-100), label_smoothing: 0.1, ..Default::default() },
        // -1 is where a narrowing might put out-of-range labels: they must
        // still not be ignored.
        CrossEntropyOptions { ignore_index: Some(-1), ..Default::default() },
    ];
    for opts in &options {
        for (name, labels) in [("i64", &i64_labels as &dyn Fn(&Device) -> Tensor), ("u64", &u64_labels)] {
            let what = format!("{name} labels, {opts:?}");
            let want = step(&cpu, labels, opts);
            let fallback0 = metrics::counter("FallbackOps");
            let got = step(&gpu, labels, opts);
            assert_eq!(metrics::counter("FallbackOps") - fallback0, 0, "{what}: ops on the CPU fallback");
            assert_same(&got, &want, &what);
            // i32 labels whose out-of-range values wrapped would give
            // another loss: the wrapped classes 3, 1 and -1 count.
            let wrapped = step(
                &gpu,
                &|d: &Device| {
                    let v: Vec<i32> = LABELS.iter().map(|&l| l as i32).collect();
                    Tensor::from_slice(&v, [LABELS.len()], d).unwrap()
                },
                opts,
            );
            assert!((wrapped.0 - want.0).abs() > 1e-3, "{what}: wrapping gives the same loss {}", want.0);
        }
    }
    // Pending 64-bit labels keep the 64-bit path (counted fallback ops)
    // and the same answer.
    let pending = |d: &Device| i64_labels(d).add_scalar(0i64).unwrap();
    let want = step(&cpu, &pending, &options[1]);
    let fallback0 = metrics::counter("FallbackOps");
    let got = step(&gpu, &pending, &options[1]);
    assert!(metrics::counter("FallbackOps") > fallback0, "pending i64 labels ran on the CPU fallback");
    assert_same(&got, &want, "pending i64 labels");
}
