//! WebGPU's default limits, forced natively: a device clamped to 8
//! storage buffers per shader stage and 128 MiB per storage binding
//! (`WgpuDeviceOptions::webgpu_default_limits`, what a browser tab gets
//! without asking for more) runs a representative set of graphs — a
//! training step, attention forward and backward, a big concat, a
//! multi-tensor update, a matmul with its epilogue — with the values of
//! the CPU backend, and no generated kernel binds more storage buffers
//! than the limit.

mod common;

use lazuli::nn::{cross_entropy, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;
use lazuli::WgpuDeviceOptions;
use lazuli_models::digits::Mlp;

/// WebGPU's default `maxStorageBuffersPerShaderStage`.
const STORAGE_BUFFERS: usize = 8;

fn webgpu() -> Option<Device> {
    common::wgpu()?;
    Some(Device::wgpu_with(WgpuDeviceOptions::webgpu_default_limits()).unwrap())
}

/// Runs `program` on the clamped device and on the CPU and compares every
/// output within `tol` (relative to the magnitude); checks the storage
/// bindings of every kernel the outputs compile to.
fn check(name: &str, tol: f32, program: impl Fn(&Device) -> lazuli::Result<Vec<Tensor>>) {
    let Some(dev) = webgpu() else { return };
    let cpu = Device::cpu();
    for d in [&dev, &cpu] {
        d.manual_seed(3);
    }
    let got = program(&dev).unwrap();
    let want = program(&cpu).unwrap();
    let refs: Vec<&Tensor> = got.iter().collect();
    for (kernel, source) in lazuli::debug::backend_code(&refs).unwrap() {
        let bound = source.matches("var<storage").count();
        assert!(bound <= STORAGE_BUFFERS, "{name}: kernel {kernel} binds {bound} storage buffers\n{source}");
    }
    lazuli::sync(&refs).unwrap();
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) = (g.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
        assert_eq!(g.len(), w.len(), "{name}: output {k}");
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{name}: output {k}[{i}]: {a} on wgpu, {b} on the CPU");
        }
    }
}

fn input(dims: &[usize], salt: u64, dev: &Device) -> lazuli::Result<Tensor> {
    Tensor::from_slice(&common::rand_vec(dims.iter().product(), salt, -1.0, 1.0), dims.to_vec(), dev)
}

#[test]
fn a_training_step_runs_under_webgpu_default_limits() {
    check("training step", 1e-4, |dev| {
        let model = Mlp::new(64, 48, 10, dev)?;
        let mut opt = Sgd::new(model.parameters(), 0.1).momentum(0.9).nesterov(true).weight_decay(1e-4);
        let x = input(&[32, 64], 1, dev)?;
        let y = Tensor::from_slice(&(0..32).map(|i| i % 10).collect::<Vec<i32>>(), [32], dev)?;
        for _ in 0..3 {
            let loss = cross_entropy(&model.forward(&x)?, &y)?;
            loss.backward()?;
            opt.step()?;
            opt.zero_grad();
            dev.mark_step()?;
        }
        Ok(model.parameters())
    });
}

#[test]
fn attention_forward_and_backward_run_under_webgpu_default_limits() {
    check("attention", 1e-4, |dev| {
        let q = input(&[2, 3, 40, 16], 2, dev)?.requires_grad_(true)?;
        let k = input(&[2, 3, 56, 16], 3, dev)?.requires_grad_(true)?;
        let v = input(&[2, 3, 56, 16], 4, dev)?.requires_grad_(true)?;
        let o = q.attention(&k, &v, 0.25, false, None)?;
        o.sum(&[0, 1, 2, 3], false)?.backward()?;
        Ok(vec![o, q.grad().expect("dq"), k.grad().expect("dk"), v.grad().expect("dv")])
    });
}

#[test]
fn a_big_concat_runs_under_webgpu_default_limits() {
    check("concat", 0.0, |dev| {
        let parts: Vec<Tensor> =
            (0..24).map(|i| input(&[5 + i % 3, 17], i as u64 + 10, dev)).collect::<Result<_, _>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Ok(vec![Tensor::concat(&refs, 0)?.mul_scalar(2.0)?])
    });
}

#[test]
fn a_multi_tensor_update_runs_under_webgpu_default_limits() {
    check("multi-tensor", 1e-6, |dev| {
        let params: Vec<Tensor> = (0..9).map(|i| input(&[3 + i, 7], 40 + i as u64, dev)).collect::<Result<_, _>>()?;
        let grads: Vec<Tensor> = (0..9).map(|i| input(&[3 + i, 7], 60 + i as u64, dev)).collect::<Result<_, _>>()?;
        params.iter().zip(&grads).map(|(p, g)| p.sub(&g.mul_scalar(0.1)?)).collect()
    });
}

#[test]
fn a_matmul_with_its_epilogue_runs_under_webgpu_default_limits() {
    check("matmul", 1e-4, |dev| {
        let a = input(&[65, 130], 80, dev)?;
        let b = input(&[130, 33], 81, dev)?;
        let bias = input(&[33], 82, dev)?;
        let r = input(&[65, 33], 83, dev)?;
        Ok(vec![a.matmul(&b)?.add(&bias)?.relu()?.add(&r)?.tanh()?])
    });
}
