//! Multi-tensor (horizontal) kernels: independent elementwise updates of
//! different shapes run as one kernel launch, split only at the storage
//! binding limit, and compute what the CPU reference computes in both
//! kernel-form profiles (segments with vec4, odd-sized, indexed and empty
//! shapes, broadcasting operands, bool and integer outputs).

mod common;
use lazuli::metrics;
use lazuli::optim::{Adam, Optimizer};
use lazuli::prelude::*;
use lazuli::wgpu::forms::KernelForms;
use lazuli::WgpuDeviceOptions;

/// Shapes of the updated "parameters": vec4-sized, odd, a single element,
/// empty, 3-D and one whose gradient is a broadcast row.
const SHAPES: [&[usize]; 7] = [&[64, 64], &[7], &[1], &[0], &[2, 3, 5], &[33, 10], &[13, 4]];

/// Parameters and gradients (the last gradient is a `[4]` row broadcast
/// over `[13, 4]`).
fn data(dev: &Device, seed: u64) -> Vec<(Tensor, Tensor)> {
    SHAPES
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let n: usize = s.iter().product();
            let p = Tensor::from_slice(&common::rand_vec(n, seed + 2 * k as u64, -1.0, 1.0), s.to_vec(), dev).unwrap();
            let gs: Vec<usize> = if k == SHAPES.len() - 1 { vec![4] } else { s.to_vec() };
            let gn: usize = gs.iter().product();
            let g = Tensor::from_slice(&common::rand_vec(gn, seed + 2 * k as u64 + 1, -1.0, 1.0), gs, dev).unwrap();
            (p, g)
        })
        .collect()
}

/// One SGD-like update per parameter: `p - g * lr`.
fn sgd(params: &[(Tensor, Tensor)], lr: f64) -> Vec<Tensor> {
    params.iter().map(|(p, g)| p.sub(&g.mul_scalar(lr).unwrap()).unwrap()).collect()
}

fn wgpu_with(options: WgpuDeviceOptions) -> Option<Device> {
    common::wgpu()?;
    Some(Device::wgpu_with(options).unwrap())
}

/// Kernel launches of syncing `ys` (and waiting).
fn launches(dev: &Device, ys: &[Tensor]) -> u64 {
    let refs: Vec<&Tensor> = ys.iter().collect();
    let k0 = metrics::counter("KernelLaunches");
    lazuli::sync(&refs).unwrap();
    dev.wait().unwrap();
    metrics::counter("KernelLaunches") - k0
}

#[test]
fn independent_updates_are_one_launch() {
    let _g = common::metrics_lock();
    let Some(dev) = wgpu_with(WgpuDeviceOptions::default()) else { return };
    let params = data(&dev, 1);
    let ys = sgd(&params, 0.1);
    let refs: Vec<&Tensor> = ys.iter().collect();
    let code = lazuli::debug::backend_code(&refs).unwrap();
    assert_eq!(code.len(), 1, "{:?}", code.iter().map(|c| &c.0).collect::<Vec<_>>());
    assert!(code[0].0.contains("MultiTensor"), "{}", code[0].0);
    assert_eq!(launches(&dev, &ys), 1, "seven updates of seven shapes are one launch");
    // Off: one launch per shape with elements (the empty one launches
    // nothing).
    let off = wgpu_with(WgpuDeviceOptions { multi_tensor: Some(false), ..Default::default() }).unwrap();
    let params = data(&off, 1);
    assert_eq!(launches(&off, &sgd(&params, 0.1)), SHAPES.len() as u64 - 1);
}

#[test]
fn splits_only_at_the_binding_limit() {
    let _g = common::metrics_lock();
    // 8 storage buffers per stage: one is kept for generic sizes, so a
    // kernel binds at most 7, and each update binds 3 (p, g, the result).
    let Some(dev) = wgpu_with(WgpuDeviceOptions { max_storage_buffers: Some(8), ..Default::default() }) else {
        return;
    };
    let params = data(&dev, 2);
    let ys = sgd(&params, 0.5);
    let refs: Vec<&Tensor> = ys.iter().collect();
    let code = lazuli::debug::backend_code(&refs).unwrap();
    assert_eq!(code.len(), 4, "7 updates, 2 per kernel: {:?}", code.iter().map(|c| &c.0).collect::<Vec<_>>());
    for (name, src) in &code {
        let bindings = src.matches("var<storage").count();
        assert!(bindings <= 7, "{name} binds {bindings} storage buffers:\n{src}");
    }
    // The empty update shares a kernel, so every kernel launches.
    assert_eq!(launches(&dev, &ys), 4);
    let cpu = Device::cpu();
    let want = sgd(&data(&cpu, 2), 0.5);
    for (k, (y, w)) in ys.iter().zip(&want).enumerate() {
        common::assert_close(&y.to_vec::<f32>().unwrap(), &w.to_vec::<f32>().unwrap(), 1e-6, 1e-6, &format!("{k}"));
    }
}

/// Many independent elementwise results of different shapes, dtypes and
/// forms (straight-line vec4 and scalar, indexed through a transpose and a
/// broadcast, bool and i32 outputs, an empty one).
fn mixed(params: &[(Tensor, Tensor)], scale: f64) -> Vec<Tensor> {
    let mut out = sgd(params, scale);
    let (p0, g0) = &params[0];
    out.push(p0.gt(g0).unwrap());
    out.push(p0.mul_scalar(8.0).unwrap().cast(DType::I32).unwrap());
    let (p5, g5) = &params[5];
    out.push(p5.transpose(0, 1).unwrap().exp().unwrap());
    out.push(p5.mul(g5).unwrap().tanh().unwrap().add_scalar(scale).unwrap());
    let (p4, _) = &params[4];
    out.push(p4.abs().unwrap().sqrt().unwrap());
    out
}

fn values(t: &Tensor) -> Vec<f32> {
    match t.dtype() {
        DType::Bool => t.to_vec::<bool>().unwrap().into_iter().map(|b| b as u8 as f32).collect(),
        DType::I32 => t.to_vec::<i32>().unwrap().into_iter().map(|v| v as f32).collect(),
        _ => t.to_vec::<f32>().unwrap(),
    }
}

#[test]
fn multi_tensor_kernels_match_the_cpu_in_both_forms() {
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let want: Vec<Vec<f32>> = mixed(&data(&cpu, 3), 0.3).iter().map(values).collect();
    for forms in [KernelForms::gpu(), KernelForms::software()] {
        for generic in [false, true] {
            let Some(dev) = wgpu_with(WgpuDeviceOptions {
                kernel_forms: Some(forms),
                generic_sizes: Some(generic),
                ..Default::default()
            }) else {
                return;
            };
            let params = data(&dev, 3);
            let ys = mixed(&params, 0.3);
            let refs: Vec<&Tensor> = ys.iter().collect();
            let code = lazuli::debug::backend_code(&refs).unwrap();
            assert!(code.iter().any(|(n, _)| n.contains("MultiTensor")), "{forms:?}");
            assert_eq!(code.len(), 1, "{forms:?}: {:?}", code.iter().map(|c| &c.0).collect::<Vec<_>>());
            // One sync computes them all (reading each alone would sync
            // each alone).
            assert_eq!(launches(&dev, &ys), 1);
            for (k, (y, w)) in ys.iter().zip(&want).enumerate() {
                common::assert_close(&values(y), w, 1e-5, 1e-6, &format!("{forms:?} output {k}"));
            }
        }
    }
}

#[test]
fn sizes_that_vary_share_a_generic_multi_tensor_kernel() {
    let _g = common::metrics_lock();
    let Some(dev) = wgpu_with(WgpuDeviceOptions::default()) else { return };
    let cpu = Device::cpu();
    // The same updates over growing sizes: after the first two sizes the
    // plans are generic over sizes, and every size still matches the CPU.
    let reused = metrics::counter("GenericKernelReuse");
    for n in [5usize, 9, 16, 1, 0, 23] {
        let make = |dev: &Device| {
            let a = Tensor::from_slice(&common::rand_vec(n * 3, n as u64, -1.0, 1.0), [n, 3], dev).unwrap();
            let b = Tensor::from_slice(&common::rand_vec(n, n as u64 + 7, -1.0, 1.0), [n], dev).unwrap();
            vec![a.mul_scalar(2.0).unwrap().exp().unwrap(), b.add_scalar(-0.5).unwrap().abs().unwrap()]
        };
        let got = make(&dev);
        let k0 = metrics::counter("KernelLaunches");
        lazuli::sync(&[&got[0], &got[1]]).unwrap();
        dev.wait().unwrap();
        assert!(metrics::counter("KernelLaunches") - k0 <= 1, "n = {n}: one multi-tensor kernel");
        let want = make(&cpu);
        for (y, w) in got.iter().zip(&want) {
            common::assert_close(&values(y), &values(w), 1e-5, 1e-6, &format!("n = {n}"));
        }
    }
    assert!(metrics::counter("GenericKernelReuse") > reused, "later sizes reuse the generic pipeline");
}

#[test]
fn adam_steps_match_the_cpu_with_fewer_launches() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let run = |dev: &Device| -> (Vec<Vec<f32>>, u64) {
        let mut last = 0;
        let params = data(dev, 4);
        let ps: Vec<Tensor> = params.iter().map(|(p, _)| p.detach().requires_grad_(true).unwrap()).collect();
        let mut opt = Adam::adamw(ps.clone(), 0.01, 0.01);
        for step in 0..3 {
            // A loss touching every parameter, so every one has a gradient.
            let mut loss = Tensor::scalar(0.0, DType::F32, dev);
            for (k, p) in ps.iter().enumerate() {
                let w = 1.0 + k as f64 + step as f64;
                loss = loss.add(&p.mul_scalar(w).unwrap().sin().unwrap().sum(&[], false).unwrap()).unwrap();
            }
            opt.zero_grad();
            loss.backward().unwrap();
            opt.step().unwrap();
            let k0 = metrics::counter("KernelLaunches");
            dev.mark_step().unwrap();
            dev.wait().unwrap();
            last = metrics::counter("KernelLaunches") - k0;
        }
        (ps.iter().map(|p| p.to_vec::<f32>().unwrap()).collect(), last)
    };
    let (got, launches) = run(&dev);
    let off = Device::wgpu_with(WgpuDeviceOptions { multi_tensor: Some(false), ..Default::default() }).unwrap();
    let (_, launches_off) = run(&off);
    // The updates of the step share kernels (how many depends on the
    // adapter's binding limit), so a step launches fewer kernels.
    assert!(launches < launches_off, "{launches} launches per step, {launches_off} without multi-tensor kernels");
    let (want, _) = run(&Device::cpu());
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        common::assert_close(g, w, 1e-4, 1e-5, &format!("parameter {k}"));
    }
}
