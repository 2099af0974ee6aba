//! Memory bounds and memory exhaustion.
//!
//! A long training-like loop: linear regression with hand-written
//! gradients (matmul, sub, mul, sum, `Tensor::assign`, one `mark_step` per
//! step). After a warm-up the bytes in use stay exactly flat (the
//! `Device::bytes_in_use` gauge), the buffer pool bytes, the live tensor
//! count and the compile cache size stay bounded (asserted at every
//! checkpoint), and the loop converges. 10,000 steps on a CPU device and on
//! wgpu (50,000 there with `LAZULI_HEAVY=1`). The compile cache is bounded
//! by its configured size when every step has a new shape.
//!
//! Exhaustion, on every backend: live tensors over a device's memory
//! budget fail with a typed out-of-memory error at the barrier, naming
//! their own graph and sync point; values depending on them fail saying so
//! while the rest of the same step runs; dropping them frees the memory
//! and the device recovers. A 1 TiB tensor is a typed error on every
//! backend and the next computation succeeds; on the CPU a request beyond
//! the address space is refused by the host allocator as a typed error
//! too, never an abort.

mod common;
use lazuli::prelude::*;
use lazuli::{BackendError, CpuDeviceOptions, ExecError, WgpuDeviceOptions};

const MIB: usize = 1 << 20;

fn heavy() -> bool {
    std::env::var("LAZULI_HEAVY").is_ok_and(|v| v == "1")
}

/// Fits `y = x @ w_true + b_true` by gradient descent; returns the final
/// loss.
fn train(dev: &Device, steps: usize) -> f32 {
    let (n, f) = (32, 4);
    let xs = common::rand_vec(n * f, 11, -1.0, 1.0);
    let w_true = [0.5f32, -1.0, 2.0, 0.25];
    let ys: Vec<f32> = (0..n).map(|r| (0..f).map(|c| xs[r * f + c] * w_true[c]).sum::<f32>() + 0.5).collect();
    let x = Tensor::from_slice(&xs, [n, f], dev).unwrap();
    let y = Tensor::from_slice(&ys, [n, 1], dev).unwrap();
    let xt = x.t().unwrap();
    let w = Tensor::zeros([f, 1], DType::F32, dev).unwrap();
    let b = Tensor::zeros([1], DType::F32, dev).unwrap();
    let lr = 0.1f32;
    let base_live = dev.live_tensors();
    let mut pool_after_warmup = 0u64;
    let mut in_use_after_warmup = 0u64;
    let mut cache_after_warmup = 0usize;
    let mut loss = f32::NAN;
    for step in 0..steps {
        let pred = x.matmul(&w).unwrap().add(&b).unwrap();
        let err = pred.sub(&y).unwrap();
        // d/dw mean(err^2) = 2/n x^T err; d/db = 2/n sum(err)
        let gw = xt.matmul(&err).unwrap().mul_scalar(2.0 / n as f32).unwrap();
        let gb = err.sum(&[0], false).unwrap().mul_scalar(2.0 / n as f32).unwrap();
        w.sub_(&gw.mul_scalar(lr).unwrap()).unwrap();
        b.sub_(&gb.mul_scalar(lr).unwrap()).unwrap();
        let l = err.mul(&err).unwrap().mean(&[], false).unwrap();
        dev.mark_step().unwrap();
        if step % 1000 == 999 || step + 1 == steps {
            loss = l.item::<f32>().unwrap();
        }
        drop((pred, err, gw, gb, l));
        if step == 50 {
            dev.wait().unwrap();
            pool_after_warmup = dev.pool_bytes();
            in_use_after_warmup = dev.bytes_in_use();
            cache_after_warmup = dev.cached_plans();
            assert!(in_use_after_warmup > 0, "the parameters and data are in use on {}", dev.name());
        }
        if step > 50 && step % 500 == 0 {
            dev.wait().unwrap();
            assert_eq!(
                dev.bytes_in_use(),
                in_use_after_warmup,
                "step {step}: bytes in use moved from {in_use_after_warmup} on {}",
                dev.name()
            );
            assert!(
                dev.live_tensors() <= base_live + 2,
                "step {step}: live tensors grew from {base_live} to {} on {}",
                dev.live_tensors(),
                dev.name()
            );
            assert!(
                dev.pool_bytes() <= pool_after_warmup * 2 + (64 << 10),
                "step {step}: pool grew from {pool_after_warmup} to {} bytes on {}",
                dev.pool_bytes(),
                dev.name()
            );
            assert!(
                dev.cached_plans() <= cache_after_warmup + 1,
                "step {step}: compile cache grew from {cache_after_warmup} to {} plans on {}",
                dev.cached_plans(),
                dev.name()
            );
        }
    }
    dev.wait().unwrap();
    let w_got = w.to_vec::<f32>().unwrap();
    if steps >= 1000 {
        common::assert_close(&w_got, &w_true, 1e-2, 1e-2, "fitted weights");
        assert!((b.item::<f32>().unwrap() - 0.5).abs() < 1e-2);
    }
    loss
}

#[test]
fn ten_thousand_training_steps_on_cpu_stay_bounded() {
    // A backend of its own: the shared CPU backend's gauge would count
    // the tensors of the tests running beside this one.
    let dev = Device::cpu_with(CpuDeviceOptions::default());
    let loss = train(&dev, 10_000);
    assert!(loss < 1e-6, "loss {loss}");
}

#[test]
fn training_steps_on_wgpu_stay_bounded() {
    let Some(dev) = common::wgpu() else { return };
    let steps = if heavy() { 50_000 } else { 10_000 };
    let loss = train(&dev, steps);
    assert!(loss < 1e-4, "loss {loss}");
}

#[test]
fn compile_cache_is_bounded_by_its_size() {
    // Every step has a new shape (a new graph); the cache evicts LRU plans.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "compile_cache_bound_child", "--ignored"])
        .env("LAZULI_COMPILE_CACHE_SIZE", "16")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
#[ignore = "run by compile_cache_is_bounded_by_its_size with LAZULI_COMPILE_CACHE_SIZE=16"]
fn compile_cache_bound_child() {
    for dev in common::devices() {
        for n in 1..200 {
            let x = Tensor::ones([n], DType::F32, &dev).unwrap();
            let s = x.mul_scalar(3.0).unwrap().sum(&[], false).unwrap().item::<f32>().unwrap();
            assert_eq!(s, 3.0 * n as f32);
            assert!(dev.cached_plans() <= 16, "{} plans cached on {}", dev.cached_plans(), dev.name());
        }
        assert_eq!(dev.cached_plans(), 16);
    }
}

/// The backend error inside `e`, through failed and poisoned values.
fn backend_error(e: &ExecError) -> Option<&BackendError> {
    match e {
        ExecError::Backend { source, .. } => Some(source),
        ExecError::Failed { cause, .. } | ExecError::Poisoned { cause, .. } => backend_error(cause),
        _ => None,
    }
}

/// The out-of-memory error inside `e`.
fn out_of_memory(e: &ExecError) -> Option<&BackendError> {
    backend_error(e).filter(|b| matches!(b, BackendError::OutOfMemory { .. }))
}

/// Twelve live 1 MiB tensors on `dev`, whose memory budget is 8 MiB: the
/// last ones fail with a typed error at the barrier, naming their own
/// graph and sync point; a step mixing a value that depends on them with
/// healthy ones runs the healthy ones and reports the dependency once;
/// dropping the tensors frees their memory and the device recovers.
fn live_tensors_over_budget(dev: &Device, budget: u64, device_prefix: &str) {
    let n = MIB / 4;
    let base = dev.bytes_in_use();
    let mut live = Vec::new();
    let mut step_line = 0;
    for i in 0..12 {
        live.push(Tensor::ones([n], DType::F32, dev).unwrap().mul_scalar(i as f32 + 1.0).unwrap());
        step_line = line!() + 1;
        dev.mark_step().expect("mark_step returns before the device runs out");
    }
    let err = live.last().unwrap().to_vec::<f32>().expect_err("the last tensor does not fit the budget");
    match out_of_memory(&err) {
        Some(BackendError::OutOfMemory { bytes, in_use, device }) => {
            assert_eq!(*bytes, MIB as u64, "{err}");
            assert!(*in_use > 0 && *in_use + *bytes > budget, "{err}");
            assert!(device.starts_with(device_prefix) && device.contains("memory budget"), "{err}");
        }
        _ => panic!("expected a typed out-of-memory error, got {err:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("out of memory allocating 1048576 bytes"), "{msg}");
    assert!(msg.contains("computing the value failed: executing graph"), "{msg}");
    assert!(msg.contains(&format!("synced by mark_step at tests/memory.rs:{step_line}")), "{msg}");
    assert!(!msg.contains("depends on"), "its own failure, not a dependency: {msg}");
    assert!(dev.bytes_in_use() <= budget + base, "{} bytes in use", dev.bytes_in_use());
    // The first tensors fitted; the other failed ones were not read yet,
    // so the device reports the first of them.
    assert_eq!(live[0].to_vec::<f32>().unwrap()[n - 1], 1.0);
    let stored = dev.wait().expect_err("unread failures are reported at the barrier");
    assert!(out_of_memory(&stored).is_some() && !stored.to_string().contains("depends on"), "{stored:?}");
    dev.wait().unwrap();
    // Dropped tensors free their memory.
    let (first, failed) = (live[0].clone(), live[11].clone());
    drop(live);
    dev.wait().unwrap();
    assert_eq!(dev.bytes_in_use(), base + MIB as u64, "{}: only the first tensor is left", dev.name());
    // One step with a value that needs a failed one and a healthy one: the
    // healthy one runs, the step reports the dependency in those words.
    let dependent = failed.sum(&[], false).unwrap();
    let healthy = first.sum(&[], false).unwrap();
    let dep_line = line!() + 1;
    let e = dev.mark_step().expect_err("the step reports the failed dependency").to_string();
    assert!(
        e.contains(&format!(
            "mark_step at tests/memory.rs:{dep_line}: depends on a value whose computation failed earlier"
        )),
        "{e}"
    );
    assert!(
        e.contains(&format!("synced by mark_step at tests/memory.rs:{step_line}")),
        "names the earlier failure: {e}"
    );
    assert_eq!(healthy.item::<f32>().unwrap(), n as f32);
    // Reported once: the next step does not blame the old failure again.
    dev.mark_step().unwrap();
    let e = dependent.item::<f32>().unwrap_err().to_string();
    assert!(e.contains("depends on a value whose computation failed earlier"), "{e}");
    dev.wait().unwrap();
    drop((first, failed, dependent, healthy));
    dev.wait().unwrap();
    assert_eq!(dev.bytes_in_use(), base, "{}: the dropped tensors' memory is free", dev.name());
    // With the tensors gone the same budget holds a new computation of
    // several live tensors.
    let xs: Vec<Tensor> =
        (0..4).map(|i| Tensor::ones([n], DType::F32, dev).unwrap().mul_scalar(i as f32).unwrap()).collect();
    dev.mark_step().unwrap();
    let total = xs.iter().map(|x| x.sum(&[], false).unwrap().item::<f32>().unwrap()).sum::<f32>();
    assert_eq!(total, 6.0 * n as f32);
    dev.wait().unwrap();
    assert!(dev.pool_bytes() <= budget, "{} bytes held", dev.pool_bytes());
}

#[test]
fn live_tensors_over_a_cpu_memory_budget_fail_with_a_typed_error_and_the_device_recovers() {
    let budget = 8 * MIB as u64;
    let dev = Device::cpu_with(CpuDeviceOptions { memory_budget: Some(budget), ..CpuDeviceOptions::default() });
    live_tensors_over_budget(&dev, budget, "cpu");
}

#[test]
fn live_tensors_over_a_wgpu_memory_budget_fail_with_a_typed_error_and_the_device_recovers() {
    let budget = 8 * MIB as u64;
    let dev = match Device::wgpu_with(WgpuDeviceOptions { memory_budget: Some(budget), ..Default::default() }) {
        Ok(d) => d,
        Err(e) if !common::adapter_required() => return eprintln!("skipping: no wgpu adapter ({e})"),
        Err(e) => panic!("LAZULI_REQUIRE_ADAPTER=1 but no wgpu adapter: {e}"),
    };
    live_tensors_over_budget(&dev, budget, "wgpu");
}

/// The probe of issue 15: `Tensor::rand([1 << 38], F32)` (1 TiB) aborted
/// the process on the CPU backend.
#[test]
fn a_one_tebibyte_tensor_is_a_typed_error_on_every_backend_and_the_next_computation_succeeds() {
    let mut devs = vec![Device::cpu_with(CpuDeviceOptions::default())];
    devs.extend(common::wgpu());
    for dev in devs {
        let huge = Tensor::rand([1usize << 38], DType::F32, &dev).unwrap();
        let sync_line = line!() + 1;
        let synced = huge.sync();
        let read_line = line!() + 1;
        let err = huge.to_vec::<f32>().expect_err("1 TiB cannot be computed");
        match backend_error(&err) {
            // The CPU: over the host's memory (the default budget).
            Some(BackendError::OutOfMemory { bytes, .. }) => assert_eq!(*bytes, 1 << 40, "{err}"),
            // wgpu: beyond u32 element indexing, refused when compiling.
            Some(BackendError::TooLarge { bytes, .. }) => assert_eq!(*bytes, 1 << 40, "{err}"),
            _ => panic!("{}: expected a typed error, got {err:?}", dev.name()),
        }
        // The error names the graph and sync point that failed for it.
        let msg = err.to_string();
        let site = match synced {
            Ok(()) => format!("synced by sync at tests/memory.rs:{sync_line}"),
            Err(e) => {
                assert!(e.to_string().contains(&format!("for sync at tests/memory.rs:{sync_line}")), "{e}");
                format!("for to_vec at tests/memory.rs:{read_line}")
            }
        };
        assert!(msg.contains("graph ") && msg.contains(&site), "{}: {msg}", dev.name());
        // The next computation succeeds.
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap();
        assert_eq!(x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0], "{}", dev.name());
        // A later computation failing for its own reason names its own
        // sync point, not the earlier one.
        let idx = Tensor::from_slice(&[0i32, 7], [2], &dev).unwrap();
        let line = line!() + 1;
        let e = x.gather(0, &idx).unwrap().to_vec::<f32>().unwrap_err().to_string();
        assert!(e.contains(&format!("to_vec at tests/memory.rs:{line}")) && e.contains("out of range"), "{e}");
        assert!(
            !e.contains(&format!("memory.rs:{sync_line}")) && !e.contains(&format!("memory.rs:{read_line}")),
            "{e}"
        );
        // Both failures were reported by their reads: nothing is left over.
        dev.wait().unwrap();
        assert_eq!(x.sum(&[], false).unwrap().item::<f32>().unwrap(), 6.0);
    }
}

#[test]
fn a_request_the_host_allocator_refuses_is_a_typed_error() {
    // No budget: 2^62 bytes go to the allocator, which cannot map them
    // (beyond the address space, whatever the overcommit policy).
    let dev = Device::cpu_with(CpuDeviceOptions { memory_budget: Some(u64::MAX), ..CpuDeviceOptions::default() });
    let huge = Tensor::rand([1usize << 60], DType::F32, &dev).unwrap();
    let err = huge.to_vec::<f32>().unwrap_err();
    match out_of_memory(&err) {
        Some(BackendError::OutOfMemory { bytes, device, .. }) => {
            assert_eq!(*bytes, 1 << 62, "{err}");
            assert!(device.contains("host allocator refused"), "{err}");
        }
        _ => panic!("expected a typed out-of-memory error, got {err:?}"),
    }
    let x = Tensor::ones([4], DType::F32, &dev).unwrap().mul_scalar(3.0).unwrap();
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![3.0; 4]);
    // The gauge is exact once the worker is done with the job (it holds
    // the output cell until then): read it after `wait`, as above.
    dev.wait().unwrap();
    assert_eq!(dev.bytes_in_use(), 16, "only x is in use");
    drop(x);
    dev.wait().unwrap();
    assert_eq!(dev.bytes_in_use(), 0);
}
