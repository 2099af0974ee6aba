//! The bind-group cache of compiled plans (`lazuli_wgpu::binds`): a steady
//! training loop creates no bind groups after its first steps (counted),
//! and a cached plan run over changing, freed, reused and destroyed
//! buffers computes what the CPU reference computes every time.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;
use lazuli::WgpuDeviceOptions;
use lazuli_models::gpt::{Gpt, GptSizes};

fn created() -> u64 {
    metrics::counter("WgpuBindGroupsCreated")
}

/// Linear regression by hand-written gradients, updated in place: the
/// bind groups created by each of `steps` steps (after a device wait),
/// and the final weights.
fn regression(dev: &Device, steps: usize) -> (Vec<u64>, Vec<f32>) {
    let (n, f) = (32, 5);
    let xs = common::rand_vec(n * f, 3, -1.0, 1.0);
    let ys: Vec<f32> = (0..n).map(|r| (0..f).map(|c| xs[r * f + c] * (c as f32 - 2.0)).sum::<f32>() + 0.5).collect();
    let x = Tensor::from_slice(&xs, [n, f], dev).unwrap();
    let y = Tensor::from_slice(&ys, [n, 1], dev).unwrap();
    let w = Tensor::zeros([f, 1], DType::F32, dev).unwrap();
    let b = Tensor::zeros([1], DType::F32, dev).unwrap();
    let mut per_step = Vec::new();
    for step in 0..steps {
        let before = created();
        let err = x.matmul(&w).unwrap().add(&b).unwrap().sub(&y).unwrap();
        let gw = x.t().unwrap().matmul(&err).unwrap().mul_scalar(2.0 / n as f64).unwrap();
        let gb = err.sum(&[0], false).unwrap().mul_scalar(2.0 / n as f64).unwrap();
        // A learning rate that changes every step: new scalar values reuse
        // the plan and its bind groups (the uniform is rewritten).
        let lr = 0.1 / (1.0 + step as f64 * 0.01);
        w.sub_(&gw.mul_scalar(lr).unwrap()).unwrap();
        b.sub_(&gb.mul_scalar(lr).unwrap()).unwrap();
        dev.mark_step().unwrap();
        dev.wait().unwrap();
        per_step.push(created() - before);
    }
    (per_step, w.to_vec::<f32>().unwrap())
}

#[test]
fn a_steady_training_loop_creates_no_bind_groups_after_warmup() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let (per_step, w) = regression(&dev, 40);
    assert!(per_step[0] > 0, "the first step binds: {per_step:?}");
    assert!(per_step[5..].iter().all(|&c| c == 0), "bind groups created per step: {per_step:?}");
    let (_, want) = regression(&Device::cpu(), 40);
    common::assert_close(&w, &want, 1e-4, 1e-5, "weights");
}

#[test]
fn the_gpt_training_step_creates_no_bind_groups_after_warmup() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let mut gpt = Gpt::new(&dev, GptSizes::TINY).unwrap();
    let mut per_step = Vec::new();
    for _ in 0..8 {
        let before = created();
        let (loss, _) = gpt.step().unwrap();
        loss.item::<f32>().unwrap();
        dev.wait().unwrap();
        per_step.push(created() - before);
    }
    assert!(per_step[4..].iter().all(|&c| c == 0), "bind groups created per step: {per_step:?}");
}

/// `x * 3 + 1` and `exp(-x)` of every tensor of `xs`, computed one cached
/// plan at a time, checked against the CPU.
fn check_all(dev: &Device, xs: &[(Tensor, Vec<f32>)]) {
    // Each twice: the second run binds the same buffers.
    for (x, data) in xs.iter().flat_map(|x| [x, x]) {
        let y = x.mul_scalar(3.0).unwrap().add_scalar(1.0).unwrap();
        let z = x.neg().unwrap().exp().unwrap();
        lazuli::sync(&[&y, &z]).unwrap();
        let want_y: Vec<f32> = data.iter().map(|v| v * 3.0 + 1.0).collect();
        let want_z: Vec<f32> = data.iter().map(|v| (-v).exp()).collect();
        common::assert_close(&y.to_vec::<f32>().unwrap(), &want_y, 1e-6, 1e-6, "x * 3 + 1");
        common::assert_close(&z.to_vec::<f32>().unwrap(), &want_z, 1e-5, 1e-6, "exp(-x)");
    }
    dev.wait().unwrap();
}

/// One plan over changing buffers: inputs freed and their buffers reused
/// by other tensors (and by this plan's outputs) between runs.
fn changing_buffers(dev: &Device) {
    let n = 1000;
    let mut keep = Vec::new();
    for round in 0..6u64 {
        let xs: Vec<(Tensor, Vec<f32>)> = (0..5)
            .map(|k| {
                let data = common::rand_vec(n, 100 * round + k, -2.0, 2.0);
                (Tensor::from_slice(&data, [n], dev).unwrap(), data)
            })
            .collect();
        check_all(dev, &xs);
        // Keep some tensors alive and free the others, so that the next
        // round's uploads land in other buffers, or in these ones reused.
        keep.push(xs[round as usize % 5].clone());
        if keep.len() > 3 {
            keep.remove(0);
        }
        check_all(dev, &keep);
    }
}

#[test]
fn a_cached_plan_over_changing_reused_buffers_stays_right() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let reused = metrics::counter("WgpuBindGroupsReused");
    changing_buffers(&dev);
    assert!(metrics::counter("WgpuBindGroupsReused") > reused, "the plan's bind groups were reused");
}

#[test]
fn a_cached_plan_over_destroyed_buffers_stays_right() {
    let _g = common::metrics_lock();
    common::wgpu();
    // No idle buffers kept: every buffer freed is destroyed at once, while
    // cached bind groups still name it.
    let Ok(dev) = Device::wgpu_with(WgpuDeviceOptions { pool_max_free_bytes: Some(0), ..Default::default() }) else {
        return;
    };
    let evictions = metrics::counter("WgpuBufferAllocations");
    changing_buffers(&dev);
    assert!(metrics::counter("WgpuBufferAllocations") > evictions + 50, "buffers were made anew");
}
