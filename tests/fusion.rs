//! Fusion: W1 is one kernel launch; an expression over 12 distinct inputs
//! runs correctly on a device limited to 8 storage buffers per stage.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;
use lazuli::WgpuDeviceOptions;

#[test]
fn w1_is_one_kernel_launch() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let n = 256 * 300 + 7; // not a multiple of the workgroup size
    let data = common::rand_vec(n, 7, -1.0, 1.0);
    let x = Tensor::from_slice(&data, [n], &dev).unwrap();
    let y =
        (((&x * 1.5).unwrap() + 0.5).unwrap().relu().unwrap() - 0.25).unwrap().tanh().unwrap().mul_scalar(2.0).unwrap();
    assert_eq!(lazuli::debug::backend_code(&[&y]).unwrap().len(), 1, "W1 lowers to one kernel");
    y.sync().unwrap();
    dev.wait().unwrap();
    let k0 = metrics::counter("KernelLaunches");
    let got = y.to_vec::<f32>().unwrap();
    assert_eq!(metrics::counter("KernelLaunches") - k0, 0, "reading launches nothing");
    let x2 = Tensor::from_slice(&data, [n], &dev).unwrap();
    let y2 = (((&x2 * 1.5).unwrap() + 0.5).unwrap().relu().unwrap() - 0.25)
        .unwrap()
        .tanh()
        .unwrap()
        .mul_scalar(2.0)
        .unwrap();
    let k1 = metrics::counter("KernelLaunches");
    y2.sync().unwrap();
    dev.wait().unwrap();
    assert_eq!(metrics::counter("KernelLaunches") - k1, 1, "W1 is exactly one launch");
    let want: Vec<f32> = data.iter().map(|v| ((v * 1.5 + 0.5).max(0.0) - 0.25).tanh() * 2.0).collect();
    common::assert_close(&got, &want, 1e-5, 1e-6, "W1 values");
}

#[test]
fn twelve_inputs_with_eight_storage_buffers() {
    let _metrics = common::metrics_lock();
    let Some(_) = common::wgpu() else { return };
    let dev = Device::wgpu_with(WgpuDeviceOptions { max_storage_buffers: Some(8), ..Default::default() }).unwrap();
    let n = 1000;
    let datas: Vec<Vec<f32>> = (0..12).map(|k| common::rand_vec(n, 100 + k, -1.0, 1.0)).collect();
    let ts: Vec<Tensor> = datas.iter().map(|d| Tensor::from_slice(d, [n], &dev).unwrap()).collect();
    // A mix of ops so that every input matters in a different way.
    let mut acc = ts[0].clone();
    for (k, t) in ts.iter().enumerate().skip(1) {
        acc = if k % 3 == 0 { acc.mul(t).unwrap() } else { acc.add(t).unwrap() };
    }
    let y = acc.tanh().unwrap();
    let code = lazuli::debug::backend_code(&[&y]).unwrap();
    assert!(code.len() >= 2, "12 inputs + 1 output cannot fit 8 bindings in one kernel");
    for (name, src) in &code {
        let bindings = src.matches("var<storage").count();
        assert!(bindings <= 8, "{name} binds {bindings} storage buffers:\n{src}");
    }
    let got = y.to_vec::<f32>().unwrap();
    let want: Vec<f32> = (0..n)
        .map(|i| {
            let mut a = datas[0][i];
            for (k, d) in datas.iter().enumerate().skip(1) {
                a = if k % 3 == 0 { a * d[i] } else { a + d[i] };
            }
            a.tanh()
        })
        .collect();
    common::assert_close(&got, &want, 1e-5, 1e-6, "12-input expression");
}

#[test]
fn lowering_is_deterministic() {
    let _metrics = common::metrics_lock();
    let Some(_) = common::wgpu() else { return };
    // Two separate devices (separate backends and caches) lower the same
    // program to byte-identical WGSL.
    let build = |dev: &Device| {
        let x = Tensor::from_slice(&common::rand_vec(60, 11, -1.0, 1.0), [6, 10], dev).unwrap();
        let w = Tensor::from_slice(&common::rand_vec(40, 12, -1.0, 1.0), [10, 4], dev).unwrap();
        let h = x.matmul(&w).unwrap().relu().unwrap();
        let y = h.log_softmax(-1).unwrap().sum(&[0], false).unwrap();
        lazuli::debug::backend_code(&[&h, &y]).unwrap()
    };
    let a = build(&Device::wgpu_with(WgpuDeviceOptions::default()).unwrap());
    let b = build(&Device::wgpu_with(WgpuDeviceOptions::default()).unwrap());
    assert!(!a.is_empty());
    assert_eq!(a, b);
}

/// A program built on a device's own inputs, returning its outputs.
type Program<'a> = &'a dyn Fn(&Device) -> Vec<Tensor>;

/// The kernels `outs` lower to on `dev`, by name.
fn kernel_names(outs: &[&Tensor]) -> Vec<String> {
    lazuli::debug::backend_code(outs).unwrap().into_iter().map(|(name, _)| name).collect()
}

/// Each of `outs` computed on `dev` against the CPU device's values of the
/// same program (`build` on each device's inputs).
fn against_cpu(dev: &Device, build: Program, what: &str) -> Vec<String> {
    let outs = build(dev);
    let names = kernel_names(&outs.iter().collect::<Vec<_>>());
    let want = build(&Device::cpu());
    for (k, (o, w)) in outs.iter().zip(&want).enumerate() {
        let got = o.to_vec::<f32>().unwrap();
        common::assert_close(&got, &w.to_vec::<f32>().unwrap(), 1e-5, 1e-5, &format!("{what}: output {k} ({names:?})"));
    }
    names
}

/// Small reductions run inside the kernel that consumes them, under both
/// kernel-form profiles: a bias gradient's column sum inside an SGD
/// update with momentum (straight-line form, one element per
/// invocation; the gradient used twice), a loss's sum over classes inside
/// its mean over the batch (a reduction's prologue), a max over a middle
/// axis read through a permute (the indexed form), and a mean beside an
/// independent update (joined into one multi-tensor kernel under the GPU
/// forms; under the software forms, whose llvmpipe runs every segment's
/// code for every batch of lanes, two kernels). Each matches the CPU, and
/// none leaves a reduction kernel of its own. With
/// `inline_reductions: Some(false)` the bias gradient is a kernel again.
#[test]
fn small_reductions_run_inside_their_consumers() {
    let _g = common::metrics_lock();
    let t = |d: &[f32], shape: &[usize], dev: &Device| Tensor::from_slice(d, shape, dev).unwrap();
    let grad = common::rand_vec(64 * 256, 1, -1.0, 1.0);
    let bias = common::rand_vec(256, 2, -1.0, 1.0);
    let mom = common::rand_vec(256, 3, -1.0, 1.0);
    let logits = common::rand_vec(64 * 10, 4, -3.0, 3.0);
    let target = common::rand_vec(64 * 10, 5, 0.0, 1.0);
    let cube = common::rand_vec(4 * 16 * 32, 6, -2.0, 2.0);
    let update = |dev: &Device| {
        let db = t(&grad, &[64, 256], dev).sum(&[0], false).unwrap();
        let b = t(&bias, &[256], dev);
        let m = t(&mom, &[256], dev).mul_scalar(0.9).unwrap().add(&db).unwrap();
        let step = (&db + &m.mul_scalar(0.9).unwrap()).unwrap().mul_scalar(0.1).unwrap();
        vec![(&b - &step).unwrap(), m]
    };
    let loss = |dev: &Device| {
        let p = (t(&logits, &[64, 10], dev) * t(&target, &[64, 10], dev)).unwrap();
        vec![p.sum(&[1], false).unwrap().neg().unwrap().mean(&[0], false).unwrap()]
    };
    let middle = |dev: &Device| {
        let m = t(&cube, &[4, 16, 32], dev).max(&[1], false).unwrap();
        vec![m.t().unwrap().add_scalar(0.5).unwrap().relu().unwrap()]
    };
    let multi = |dev: &Device| {
        let mean = t(&grad, &[64, 256], dev).mean(&[0], false).unwrap();
        let a = t(&bias, &[256], dev).sub(&mean).unwrap();
        let c = t(&logits, &[64, 10], dev).mul_scalar(0.5).unwrap();
        vec![a, c]
    };
    for (profile, dev) in common::wgpu_profiles() {
        let joined = if profile == "gpu forms" { 1 } else { 2 };
        let cases: [(&str, Program, usize); 4] = [
            ("sgd update", &update, 1),
            ("loss", &loss, 1),
            ("middle axis", &middle, 1),
            ("beside another", &multi, joined),
        ];
        for (what, build, kernels) in cases {
            let names = against_cpu(&dev, build, &format!("{profile}, {what}"));
            assert_eq!(names.len(), kernels, "{profile}, {what}: {names:?}");
            let reductions = names.iter().filter(|n| n.contains("Reduce")).count();
            let expected = usize::from(what == "loss");
            assert_eq!(
                reductions, expected,
                "{profile}, {what}: only the loss's mean is a reduction kernel: {names:?}"
            );
        }
    }
    if common::wgpu().is_some() {
        let opts = WgpuDeviceOptions { inline_reductions: Some(false), ..Default::default() };
        let apart = Device::wgpu_with(opts).unwrap();
        let names = against_cpu(&apart, &update, "inlining off");
        assert_eq!(names.len(), 2, "inlining off: the column sum is a kernel again: {names:?}");
    }
}

/// Reductions stay kernels of their own where inlining would compute
/// them more than once or loop too long: a sum broadcast back over its
/// rows (softmax-like), a column sum over more than 64 rows, and a sum
/// that is itself an output. Values match the CPU either way.
#[test]
fn reductions_that_would_repeat_or_loop_long_stay_apart() {
    let _g = common::metrics_lock();
    let t = |d: &[f32], shape: &[usize], dev: &Device| Tensor::from_slice(d, shape, dev).unwrap();
    let x = common::rand_vec(65 * 48, 7, -1.0, 1.0);
    let broadcast = |dev: &Device| {
        let x = t(&x, &[65, 48], dev);
        vec![(&x - &x.sum(&[1], true).unwrap()).unwrap()]
    };
    let long = |dev: &Device| vec![t(&x, &[65, 48], dev).sum(&[0], false).unwrap().mul_scalar(2.0).unwrap()];
    let output = |dev: &Device| {
        let s = t(&x, &[65, 48], dev).sum(&[1], false).unwrap();
        vec![s.mul_scalar(3.0).unwrap(), s]
    };
    for (profile, dev) in common::wgpu_profiles() {
        for (what, build) in [("broadcast", &broadcast as Program), ("65 rows", &long), ("an output", &output)] {
            let names = against_cpu(&dev, build, &format!("{profile}, {what}"));
            let apart = names.iter().any(|n| n.contains("Reduce") || n.contains("Rows"));
            assert!(apart, "{profile}, {what}: the reduction keeps a kernel: {names:?}");
        }
    }
}
