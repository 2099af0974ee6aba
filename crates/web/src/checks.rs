//! Differential checks inside the page: each program runs on the page's
//! device (the browser's WebGPU) and on the CPU backend (the executable
//! spec), and their values must agree within a tolerance — the
//! elementwise, reduction, matmul, softmax and training-step cases of
//! the native differential suite, small enough for a software adapter.
//!
//! Two more cases check that errors reach the page as errors: an index
//! out of range (found asynchronously on the web) and out of memory.
//! A case's result says which values disagreed, so a failure in the
//! browser is readable from the test log.

use crate::WebError;
use lazuli::nn::{cross_entropy, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;
use lazuli_models::digits::Mlp;
use serde_json::json;

/// One case: builds its outputs on a device.
type Program = fn(&Device) -> lazuli::Result<Vec<Tensor>>;

/// The cases, each with its tolerance (absolute, plus relative to the
/// value's magnitude).
const CASES: &[(&str, Program, f32)] = &[
    ("elementwise_broadcast", elementwise, 1e-5),
    ("reductions", reductions, 1e-4),
    ("matmul", matmul, 1e-4),
    ("softmax", softmax, 1e-5),
    ("training_step", training_step, 1e-4),
];

/// Runs every case on `dev` and on a CPU device; one JSON object per
/// case: `name`, `ok`, `max_error`, `detail`.
pub async fn run(dev: &Device) -> Result<serde_json::Value, WebError> {
    let cpu = Device::cpu();
    let mut results = Vec::new();
    for &(name, program, tol) in CASES {
        let got = values(program, dev).await;
        let want = values(program, &cpu).await?;
        let (ok, max_error, detail) = match got {
            Ok(got) => compare(&got, &want, tol),
            Err(e) => (false, f32::INFINITY, format!("failed on {}: {e}", dev.name())),
        };
        crate::page::set_text("checks", &format!("{name}: {}", if ok { "ok" } else { "FAILED" }));
        results.push(json!({ "name": name, "ok": ok, "max_error": max_error, "detail": detail }));
    }
    for (name, outcome) in [
        ("index_error_reported", index_error(dev).await),
        ("out_of_memory_reported", out_of_memory().await),
        ("blocking_calls_are_errors", blocking().await),
    ] {
        let (ok, detail) = match outcome {
            Ok(message) => (true, message),
            Err(e) => (false, e),
        };
        results.push(json!({ "name": name, "ok": ok, "max_error": 0.0, "detail": detail }));
    }
    Ok(json!({ "device": dev.name(), "cases": results }))
}

/// A gather with an index out of range must fail its read with
/// `IndexOutOfRange` (found when the kernel's error slot is read back,
/// see `lazuli_wgpu::platform`), and the device must work afterwards.
async fn index_error(dev: &Device) -> Result<String, String> {
    let data = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4], dev).map_err(|e| e.to_string())?;
    let idx = Tensor::from_slice(&[0i32, 9, 1], [3], dev).map_err(|e| e.to_string())?;
    let bad = data.gather(0, &idx).map_err(|e| e.to_string())?;
    let message = match bad.to_vec_async::<f32>().await {
        Ok(v) => return Err(format!("the out-of-range gather read {v:?}")),
        Err(e) if e.to_string().contains("out of range") => e.to_string(),
        Err(e) => return Err(format!("an error, but not the index's: {e}")),
    };
    let ok = data.mul_scalar(2.0).map_err(|e| e.to_string())?.to_vec_async::<f32>().await.map_err(|e| e.to_string())?;
    if ok != [2.0, 4.0, 6.0, 8.0] {
        return Err(format!("after the error the device computed {ok:?}"));
    }
    Ok(message)
}

/// In a tab the blocking calls return `WouldBlock` naming their
/// asynchronous forms, and so does a CPU fallback segment, which would
/// have to read GPU data synchronously (`exp` forced onto the CPU
/// between two GPU segments).
async fn blocking() -> Result<String, String> {
    let dev = lazuli::wgpu_async(Default::default()).await.map_err(|e| e.to_string())?;
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4], &dev).map_err(|e| e.to_string())?;
    let y = x.mul_scalar(0.5).map_err(|e| e.to_string())?;
    let mut seen = Vec::new();
    let mut expect = |what: &str, r: Result<(), String>, instead: &str| match r {
        Err(e) if e.contains("would block") && e.contains(instead) => {
            seen.push(e);
            Ok(())
        }
        other => Err(format!("{what}: expected a WouldBlock error naming {instead}, got {other:?}")),
    };
    expect("to_vec", y.to_vec::<f32>().map(drop).map_err(|e| e.to_string()), "to_vec_async")?;
    expect("Device::wait", dev.wait().map_err(|e| e.to_string()), "wait_async")?;
    dev.set_force_fallback(&["exp"]);
    let z = y.exp().and_then(|t| t.add_scalar(1.0)).map_err(|e| e.to_string())?;
    let read = z.to_vec_async::<f32>().await.map(drop).map_err(|e| e.to_string());
    expect("a CPU fallback segment", read, "to_vec_async")?;
    Ok(seen.join(" | "))
}

/// A device with a 1 MiB memory budget must refuse a 4 MiB tensor with
/// `OutOfMemory` (an error on the page, not a dead tab).
async fn out_of_memory() -> Result<String, String> {
    let options = lazuli::WgpuDeviceOptions { memory_budget: Some(1 << 20), ..Default::default() };
    let dev = lazuli::wgpu_async(options).await.map_err(|e| e.to_string())?;
    let big = Tensor::zeros([1024, 1024], DType::F32, &dev).map_err(|e| e.to_string())?;
    match big.add_scalar(1.0).map_err(|e| e.to_string())?.to_vec_async::<f32>().await {
        Ok(_) => Err("a 4 MiB tensor fit a 1 MiB budget".into()),
        Err(e) if e.to_string().contains("out of memory") => Ok(e.to_string()),
        Err(e) => Err(format!("an error, but not out of memory: {e}")),
    }
}

/// The outputs of `program` on `dev`, read back without blocking.
async fn values(program: Program, dev: &Device) -> Result<Vec<Vec<f32>>, WebError> {
    dev.manual_seed(7);
    let outs = program(dev)?;
    let refs: Vec<&Tensor> = outs.iter().collect();
    lazuli::sync(&refs)?;
    let mut v = Vec::with_capacity(outs.len());
    for t in &outs {
        v.push(t.to_vec_async::<f32>().await?);
    }
    Ok(v)
}

/// Whether `got` matches `want` within `tol`; the largest error and the
/// first disagreement.
fn compare(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) -> (bool, f32, String) {
    let mut max_error = 0f32;
    let mut detail = String::new();
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        if g.len() != w.len() {
            return (false, f32::INFINITY, format!("output {k}: {} values, expected {}", g.len(), w.len()));
        }
        for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
            let err = (a - b).abs();
            // NaN anywhere is a disagreement.
            let bad = err.is_nan() || err > tol * (1.0 + b.abs());
            max_error = max_error.max(if err.is_nan() { f32::INFINITY } else { err });
            if bad && detail.is_empty() {
                detail = format!("output {k}[{i}]: {a} on the device, {b} on the CPU");
            }
        }
    }
    (detail.is_empty(), max_error, detail)
}

/// Deterministic values in [-1, 1).
fn data(n: usize, salt: usize) -> Vec<f32> {
    (0..n as u64).map(|i| ((i * 7919 + salt as u64 * 104_729) % 2003) as f32 / 1001.5 - 1.0).collect()
}

fn input(dims: &[usize], salt: usize, dev: &Device) -> lazuli::Result<Tensor> {
    Tensor::from_slice(&data(dims.iter().product(), salt), dims.to_vec(), dev)
}

/// A fused elementwise chain with broadcasting and a scalar.
fn elementwise(dev: &Device) -> lazuli::Result<Vec<Tensor>> {
    let x = input(&[37, 53], 1, dev)?;
    let y = input(&[53], 2, dev)?;
    let z = x.mul(&y)?.add_scalar(0.5)?.exp()?.sub(&x.tanh()?)?.relu()?.sqrt()?;
    let w = x.abs()?.add_scalar(1.0)?.log()?.div(&y.abs()?.add_scalar(0.25)?)?;
    Ok(vec![z, w])
}

/// Sums, means and maxima over each axis and all of them.
fn reductions(dev: &Device) -> lazuli::Result<Vec<Tensor>> {
    let x = input(&[19, 301], 3, dev)?;
    Ok(vec![x.sum(&[1], false)?, x.mean(&[0], false)?, x.max(&[1], true)?, x.sum(&[0, 1], false)?])
}

/// A matmul with odd sizes and a batched one.
fn matmul(dev: &Device) -> lazuli::Result<Vec<Tensor>> {
    let a = input(&[33, 47], 4, dev)?;
    let b = input(&[47, 29], 5, dev)?;
    let c = input(&[3, 16, 24], 6, dev)?;
    let d = input(&[3, 24, 8], 7, dev)?;
    Ok(vec![a.matmul(&b)?, c.matmul(&d)?])
}

/// Softmax over the last axis and over the first.
fn softmax(dev: &Device) -> lazuli::Result<Vec<Tensor>> {
    let x = input(&[12, 130], 8, dev)?.mul_scalar(4.0)?;
    Ok(vec![x.softmax(-1)?, x.softmax(0)?])
}

/// Two SGD steps of a small MLP (forward, cross-entropy, backward,
/// update); the parameters afterwards.
fn training_step(dev: &Device) -> lazuli::Result<Vec<Tensor>> {
    let model = Mlp::new(64, 32, 10, dev)?;
    let mut opt = Sgd::new(model.parameters(), 0.1).momentum(0.9);
    let x = input(&[16, 64], 9, dev)?;
    let labels: Vec<i32> = (0..16).map(|i| i * 7 % 10).collect();
    let y = Tensor::from_slice(&labels, [16], dev)?;
    for _ in 0..2 {
        let loss = cross_entropy(&model.forward(&x)?, &y)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        dev.mark_step()?;
    }
    Ok(model.parameters())
}
