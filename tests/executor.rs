//! The lazy tensor core: asynchronous sync, barriers, stored errors, live
//! tensors and leaks, the graph size limit, in-place updates, passes,
//! metrics report, the recompile explainer and IR dumps.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;
use std::time::{Duration, Instant};

#[test]
fn sync_returns_before_the_device_is_done() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap();
        x.exp().unwrap().to_vec::<f32>().unwrap(); // warm the cache
        dev.set_execution_delay(Some(Duration::from_millis(300)));
        let y = x.exp().unwrap();
        let t0 = Instant::now();
        y.sync().unwrap();
        let returned = t0.elapsed();
        assert!(returned < Duration::from_millis(150), "sync waited {returned:?} on {}", dev.name());
        // Host-side tracing of the next step overlaps device execution.
        let z = y.mul_scalar(2.0).unwrap();
        assert_eq!(z.state(), TensorState::PendingIr);
        dev.wait().unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250), "wait returned before the slow plan finished");
        dev.set_execution_delay(None);
        let v = z.to_vec::<f32>().unwrap();
        assert!((v[2] - 2.0 * 3f32.exp()).abs() < 1e-4);
    }
}

#[test]
fn async_error_surfaces_at_the_next_barrier_and_the_device_recovers() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
        let other = x.add_scalar(1.0).unwrap();
        other.sync().unwrap();
        dev.wait().unwrap();
        dev.fail_next_executions(1);
        let y = x.mul_scalar(3.0).unwrap();
        y.sync().expect("sync itself succeeds: the failure is asynchronous");
        let e = y.to_vec::<f32>().unwrap_err().to_string();
        assert!(e.contains("injected device failure") && e.contains("to_vec"), "{e}");
        // The read reported the failure: the device does not report it
        // again (a later error would otherwise name this graph).
        dev.wait().unwrap();
        // A failure no read reported is returned by the next wait, naming
        // its own graph and sync point.
        dev.fail_next_executions(1);
        let z = x.mul_scalar(5.0).unwrap();
        let line = line!() + 1;
        z.sync().unwrap();
        let e = dev.wait().unwrap_err().to_string();
        assert!(e.contains("injected") && e.contains(&format!("synced by sync at tests/executor.rs:{line}")), "{e}");
        dev.wait().unwrap();
        // A sync depending on the failed value says so.
        let dep = y.add_scalar(1.0).unwrap();
        let e = dep.to_vec::<f32>().unwrap_err().to_string();
        assert!(e.contains("depends on a value whose computation failed earlier") && e.contains("injected"), "{e}");
        // Other tensors are intact and the device keeps working.
        assert_eq!(other.to_vec::<f32>().unwrap(), vec![2.0, 3.0]);
        assert_eq!(x.mul_scalar(4.0).unwrap().to_vec::<f32>().unwrap(), vec![4.0, 8.0]);
        dev.wait().unwrap();
    }
}

#[test]
fn no_leak_over_many_create_drop_cycles() {
    for dev in common::devices() {
        let cycles = if dev.kind() == lazuli::BackendKind::Cpu { 10_000 } else { 2_000 };
        let base_live = dev.live_tensors();
        let mut pool_after_warmup = 0;
        for i in 0..cycles {
            let x = Tensor::from_slice(&[i as f32; 64], [64], &dev).unwrap();
            let y = x.mul_scalar(0.5).unwrap().add_scalar(1.0).unwrap();
            if i % 100 == 0 {
                y.to_vec::<f32>().unwrap();
            }
            y.sync().unwrap();
            if i == 100 {
                dev.wait().unwrap();
                pool_after_warmup = dev.pool_bytes();
            }
        }
        dev.wait().unwrap();
        assert_eq!(dev.live_tensors(), base_live, "live tensors leaked on {}", dev.name());
        assert!(
            dev.pool_bytes() <= pool_after_warmup.max(1) * 4 + (1 << 20),
            "pool grew from {pool_after_warmup} to {} bytes on {}",
            dev.pool_bytes(),
            dev.name()
        );
        assert!(dev.cached_plans() <= 4);
    }
}

#[test]
fn graph_size_limit_materializes_automatically() {
    let _g = common::metrics_lock();
    let dev = Device::cpu();
    let hits = metrics::counter("GraphSizeLimitHits");
    let mut x = Tensor::from_slice(&[0.0f32; 4], [4], &dev).unwrap();
    for _ in 0..10_000 {
        x = x.add_scalar(1.0).unwrap();
    }
    assert!(metrics::counter("GraphSizeLimitHits") > hits, "a 10,000-node chain exceeds the default limit");
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![10_000.0; 4]);
}

#[test]
fn graph_size_limit_counts_shared_nodes_once() {
    let _g = common::metrics_lock();
    let dev = Device::cpu();
    let hits = metrics::counter("GraphSizeLimitHits");
    // Each node reads its predecessor twice: the summed bound doubles per
    // step (2^60 operand paths) while the graph has 61 nodes.
    let mut x = Tensor::from_slice(&[1.0f32; 4], [4], &dev).unwrap();
    for _ in 0..60 {
        x = x.add(&x).unwrap().mul_scalar(0.5).unwrap();
    }
    assert_eq!(metrics::counter("GraphSizeLimitHits"), hits, "181 pending nodes are under the limit");
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0; 4]);
}

#[test]
fn in_place_update_loop_compiles_once_after_warmup() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4], &dev).unwrap();
        let g = Tensor::from_slice(&[0.5f32, 0.5, 0.5, 0.5], [4], &dev).unwrap();
        let mut after_warmup = 0;
        for step in 0..20 {
            let lr = 0.1 + step as f32 * 0.01; // a changing learning rate is a lifted scalar
            w.sub_(&g.mul_scalar(lr).unwrap()).unwrap();
            dev.mark_step().unwrap();
            if step == 1 {
                dev.wait().unwrap();
                after_warmup = dev.compile_counts().0;
            }
        }
        assert_eq!(dev.compile_counts().0, after_warmup, "steady loop recompiled on {}", dev.name());
        assert_eq!(w.generation(), 20);
        let total: f32 = (0..20).map(|s| 0.5 * (0.1 + s as f32 * 0.01)).sum();
        common::assert_close(
            &w.to_vec::<f32>().unwrap(),
            &[1.0 - total, 2.0 - total, 3.0 - total, 4.0 - total],
            1e-5,
            1e-5,
            "w",
        );
    }
}

#[test]
fn mark_step_syncs_every_live_pending_tensor() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    let a = x.exp().unwrap();
    let b = x.neg().unwrap();
    assert_eq!(a.state(), TensorState::PendingIr);
    dev.mark_step().unwrap();
    assert_eq!(a.state(), TensorState::DeviceData);
    assert_eq!(b.state(), TensorState::DeviceData);
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![-1.0, -2.0]);
}

#[test]
fn passes_shrink_the_graph_and_keep_results() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let data = common::rand_vec(12, 9, -2.0, 2.0);
        let x = Tensor::from_slice(&data, [3, 4], &dev).unwrap();
        // x*1 + 0*... , neg(neg), transpose of transpose, reshape of reshape, a duplicated subexpression.
        let a = x.mul_scalar(1.0).unwrap().neg().unwrap().neg().unwrap();
        let b = a.t().unwrap().t().unwrap().reshape([12]).unwrap().reshape([4, 3]).unwrap().reshape([3, 4]).unwrap();
        let c = b.exp().unwrap().add(&b.exp().unwrap()).unwrap();
        let removed = metrics::counter("PassNodesRemoved");
        let got = c.to_vec::<f32>().unwrap();
        assert!(metrics::counter("PassNodesRemoved") - removed >= 6, "passes removed too little");
        let want: Vec<f32> = data.iter().map(|v| 2.0 * v.exp()).collect();
        common::assert_close(&got, &want, 1e-5, 1e-6, "optimized graph");
    }
}

#[test]
fn metrics_report_has_counters_values_and_timers() {
    let _g = common::metrics_lock();
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
    x.exp().unwrap().to_vec::<f32>().unwrap();
    let r = metrics::report();
    for key in
        ["Counters:", "UncachedCompile", "SyncedTensors", "Values:", "GraphSize", "Timers (ms):", "Compile", "Trace"]
    {
        assert!(r.contains(key), "report lacks {key}:\n{r}");
    }
}

#[test]
fn recompile_explainer_names_the_shape_change_and_source_line() {
    let dev = Device::cpu();
    let mut lines = Vec::new();
    for step in 0..8 {
        let batch = if step < 5 { 4 } else { 6 };
        let data = vec![1.0f32; batch * 3];
        let x = Tensor::from_slice(&data, [batch, 3], &dev).unwrap();
        lines.push(line!() - 1);
        let y = x.mul_scalar(2.0).unwrap().sum(&[1], false).unwrap();
        y.to_vec::<f32>().unwrap();
    }
    let log = lazuli::debug::compile_log();
    let entry = log
        .iter()
        .rev()
        .find(|e| e.reason.as_deref().is_some_and(|r| r.contains("[6, 3]") && r.contains("[4, 3]")))
        .unwrap_or_else(|| panic!("no explanation of the batch change in {log:#?}"));
    let reason = entry.reason.as_deref().unwrap();
    assert!(reason.contains("shape"), "{reason}");
    assert!(reason.contains(&format!("executor.rs:{}", lines[0])), "{reason}");
    assert!(reason.contains("to_vec at"), "{reason}");
}

#[test]
fn ir_dumps_text_dot_hash_and_dump_dir() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], &dev).unwrap();
    let y = x.exp().unwrap().sum(&[0], false).unwrap();
    let text = lazuli::debug::ir_text(&[&y]);
    assert!(text.contains("exp(%0)") && text.contains("executor.rs:"), "{text}");
    let dot = lazuli::debug::ir_dot(&[&y]);
    assert!(dot.starts_with("digraph") && dot.trim_end().ends_with('}'));
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());
    if std::process::Command::new("dot").arg("-V").output().is_ok() {
        let mut child = std::process::Command::new("dot")
            .arg("-Tsvg")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(dot.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("<svg"));
    }
    assert_eq!(lazuli::debug::graph_hash(&[&y]), lazuli::debug::graph_hash(&[&y]));
}

#[test]
fn a_panicking_backend_is_an_error_not_a_hang() {
    for dev in common::devices() {
        let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap();
        dev.panic_next_execution();
        let y = x.add_scalar(1.0).unwrap();
        let e = y.to_vec::<f32>().unwrap_err().to_string();
        assert!(e.contains("panicked") && e.contains("injected backend panic"), "{e}");
        dev.wait().expect("the read reported the failure");
        assert_eq!(x.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0], "device usable afterwards");
    }
}

/// A loop that reads each step's outputs one or two steps behind (as the
/// demo reads its loss) gets every value right from the copies each
/// execution makes of its outputs at the end of its own submission:
/// scalar-sized outputs of every dtype (f32, bool, f16) from the first
/// step, a larger one from the step after its first read; a second read
/// of a value still works.
#[test]
fn outputs_read_steps_behind_come_from_their_executions_own_copies() {
    let Some(_) = common::wgpu() else { return };
    let data = common::rand_vec(64 * 64, 3, -1.0, 1.0);
    const STEPS: usize = 8;
    let run = |dev: &Device, lag: usize| {
        let mut x = Tensor::from_slice(&data, [64, 64], dev).unwrap();
        let mut got: Vec<f32> = Vec::new();
        let mut behind: std::collections::VecDeque<[Tensor; 4]> = Default::default();
        for i in 0..STEPS {
            x = x.mul_scalar(0.5 + i as f64 * 0.0625).unwrap().tanh().unwrap();
            let loss = x.sum(&[], false).unwrap();
            let row = x.narrow(0, 0, 1).unwrap().narrow(1, 0, 3).unwrap().reshape([3]).unwrap();
            let mask = row.gt_scalar(0.0).unwrap();
            let half = row.cast(DType::F16).unwrap();
            dev.mark_step().unwrap();
            behind.push_back([loss, mask, half, x.clone()]);
            if behind.len() > lag {
                let [l, m, h, big] = behind.pop_front().expect("a step behind");
                got.push(l.item::<f32>().unwrap());
                got.extend(m.to_vec::<bool>().unwrap().iter().map(|&b| b as u8 as f32));
                got.extend(h.to_vec::<half::f16>().unwrap().iter().map(|v| v.to_f32()));
                got.extend(big.to_vec::<f32>().unwrap().iter().step_by(97));
                // Read again: the value is the same.
                got.push(l.item::<f32>().unwrap());
            }
        }
        got
    };
    for lag in [1, 2] {
        // A CPU device of its own: the shared one's pool is measured by
        // `no_leak_over_many_create_drop_cycles`.
        let want = run(&Device::cpu_with(Default::default()), lag);
        let early = metrics::counter("EarlyReadbacks");
        let got = run(&Device::wgpu().expect("a wgpu device"), lag);
        common::assert_close(&got, &want, 1e-3, 1e-5, &format!("read {lag} step(s) behind"));
        // Three scalar-sized outputs per step read behind; the larger one
        // at least from the first execution that started after its first
        // read on.
        let reads = (STEPS - lag) as u64;
        let served = metrics::counter("EarlyReadbacks") - early;
        let big = reads - 1 - lag as u64;
        assert!(served >= 3 * reads + big, "{served} reads served by early copies, {lag} behind");
    }
}

/// Overlapping executions (`LAZULI_OVERLAP_SUBMIT`, on by default): a
/// chain of steps, each reading the previous step's output and a new
/// lifted scalar, run back to back without a read in between (so every
/// step is submitted while the one before may still run, and their
/// uniforms and intermediate buffers recycle through the pool), gives
/// exactly what waiting for each step gives, and what the CPU gives;
/// `Device::wait` returns with the last step finished.
#[test]
fn overlapping_executions_match_waiting_ones() {
    let Some(_) = common::wgpu() else { return };
    let data = common::rand_vec(4096, 7, -1.0, 1.0);
    let run = |dev: &Device| {
        let mut x = Tensor::from_slice(&data, [64, 64], dev).unwrap();
        let mut sums = Vec::new();
        for i in 0..60 {
            let s = 0.5 + (i % 7) as f64 * 0.125;
            let y = x.mul_scalar(s).unwrap().add_scalar(0.25).unwrap().tanh().unwrap();
            // A product too, so that intermediates of several sizes recycle.
            x = y.matmul(&y.transpose(0, 1).unwrap()).unwrap().mul_scalar(1.0 / 64.0).unwrap();
            sums.push(x.sum(&[], false).unwrap());
            dev.mark_step().unwrap();
        }
        dev.wait().unwrap();
        let mut out: Vec<f32> = sums.iter().map(|t| t.item::<f32>().unwrap()).collect();
        out.extend(x.to_vec::<f32>().unwrap());
        out
    };
    let want = run(&Device::cpu());
    for overlap in [true, false] {
        let opts = lazuli::WgpuDeviceOptions { overlap_submit: Some(overlap), ..Default::default() };
        let dev = Device::wgpu_with(opts).expect("a wgpu device");
        let config = dev.configuration();
        let setting = config.settings.iter().find(|s| s.variable == "LAZULI_OVERLAP_SUBMIT").expect("listed");
        assert_eq!(setting.value, if overlap { "on" } else { "off" });
        let got = run(&dev);
        common::assert_close(&got, &want, 1e-4, 1e-5, &format!("overlap {overlap}"));
    }
}

/// Streamed submission (`LAZULI_STREAM_SUBMIT`, on by default): an
/// execution started with the GPU idle is submitted in pieces as it is
/// encoded. Forced to pieces of 1, 2, 4, ... launches, a training loop
/// that reads its loss every step (so every step starts idle) with a
/// split-K weight gradient (a two-pass kernel and its scratch), a
/// gather of its batch's rows (an index-checking kernel and its error
/// slot) and timed launches (timestamp queries across the pieces) gives
/// what one piece gives and what the CPU gives; a bad label is still
/// reported, and the device runs on after it.
#[test]
fn streamed_executions_match_one_piece_ones() {
    let Some(_) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    let tokens = 1100;
    let x = common::rand_vec(tokens * 48, 11, -1.0, 1.0);
    let labels: Vec<i32> = (0..tokens as i32).map(|i| (i * 7) % 10).collect();
    let order: Vec<i32> = (0..tokens as i32).map(|i| (i * 37) % tokens as i32).collect();
    let run = |dev: &Device| {
        dev.manual_seed(5);
        let w1 = Tensor::from_slice(&common::rand_vec(48 * 40, 12, -0.2, 0.2), [48, 40], dev).unwrap();
        let w2 = Tensor::from_slice(&common::rand_vec(40 * 10, 13, -0.2, 0.2), [40, 10], dev).unwrap();
        let (mut w1, mut w2) = (w1.requires_grad_(true).unwrap(), w2.requires_grad_(true).unwrap());
        let x = Tensor::from_slice(&x, [tokens, 48], dev).unwrap();
        let y = Tensor::from_slice(&labels, [tokens], dev).unwrap();
        let order = Tensor::from_slice(&order, [tokens], dev).unwrap();
        let mut out = Vec::new();
        for _ in 0..4 {
            let h = x.gather(0, &order).unwrap().matmul(&w1).unwrap().relu().unwrap();
            let loss = lazuli::nn::cross_entropy(&h.matmul(&w2).unwrap(), &y).unwrap();
            loss.backward().unwrap();
            let step = |w: &Tensor| w.sub(&w.grad().unwrap().mul_scalar(0.5).unwrap()).unwrap();
            let (n1, n2) = (step(&w1), step(&w2));
            (w1, w2) = (n1.detach().requires_grad_(true).unwrap(), n2.detach().requires_grad_(true).unwrap());
            dev.mark_step().unwrap();
            out.push(loss.item::<f32>().unwrap());
        }
        out.extend(w1.to_vec::<f32>().unwrap());
        out.extend(w2.to_vec::<f32>().unwrap());
        out
    };
    let want = run(&Device::cpu());
    let cpu = Device::cpu().backend().clone();
    for (first, timed) in [(0, false), (1, false), (1, true)] {
        let what = format!("pieces from {first} launch(es), timed {timed}");
        let opts = lazuli::WgpuDeviceOptions {
            stream_submit: Some(first),
            kernel_forms: Some(lazuli::wgpu::forms::KernelForms::gpu()),
            ..Default::default()
        };
        let backend = std::sync::Arc::new(lazuli_wgpu::WgpuBackend::new(opts).expect("a wgpu device"));
        let dev = Device::new(backend.clone(), cpu.clone());
        let setting = dev.configuration().settings.into_iter().find(|s| s.variable == "LAZULI_STREAM_SUBMIT");
        let on = setting.expect("listed").value.starts_with("on");
        assert_eq!(on, first > 0, "{what}");
        backend.set_profiling(timed);
        let streamed = metrics::counter("StreamedSubmits");
        let got = run(&dev);
        let samples = backend.take_profile();
        backend.set_profiling(false);
        common::assert_close(&got, &want, 1e-3, 1e-4, &what);
        let pieces = metrics::counter("StreamedSubmits") - streamed;
        assert_eq!(pieces > 0, first > 0, "{what}: {pieces} extra submissions");
        if timed && backend.supports_profiling() {
            assert!(samples.iter().any(|s| s.cost.name.ends_with("_pass1")), "{what}: the weight gradient splits K");
            assert!(samples.iter().all(|s| s.ms.is_some_and(|ms| ms >= 0.0)), "{what}: every launch timed");
        }
        // A bad row index in a streamed execution is reported at its read
        // (its tensors dropped after, so the next step does not run them
        // again).
        {
            let bad: Vec<i32> = (0..tokens as i32).map(|i| if i == 700 { 5000 } else { i }).collect();
            let ones = Tensor::ones([48, 10], DType::F32, &dev).unwrap();
            let logits = Tensor::from_slice(&x, [tokens, 48], &dev).unwrap().matmul(&ones).unwrap().relu().unwrap();
            let bad = Tensor::from_slice(&bad, [tokens], &dev).unwrap();
            let picked = logits.gather(0, &bad).unwrap().exp().unwrap().matmul(&ones.t().unwrap()).unwrap();
            let err = picked.sum(&[], false).unwrap().item::<f32>().expect_err("row 5000 of 1100");
            assert!(err.to_string().contains("5000"), "{what}: {err}");
        }
        assert_eq!(run(&dev).len(), want.len(), "{what}: the device runs on");
    }
}

/// A plan's uniform of lifted scalars is written only when its values
/// change: the same step run with scalars A, A, B, A, B, B (each step
/// read, so each execution gets the plan's uniform buffer back) gives
/// what the CPU gives, and the repeated values skip their writes
/// (`UniformWritesSkipped`).
#[test]
fn repeated_scalar_values_skip_the_uniform_write_and_changed_ones_reach_the_kernel() {
    let Some(dev) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    let data = common::rand_vec(1024, 21, -1.0, 1.0);
    let run = |dev: &Device| {
        let x = Tensor::from_slice(&data, [32, 32], dev).unwrap();
        let mut out = Vec::new();
        for s in [0.5, 0.5, 1.5, 0.5, 1.5, 1.5] {
            let y = x.mul_scalar(s).unwrap().add_scalar(s * 0.25).unwrap().tanh().unwrap();
            out.extend(y.sum(&[1], false).unwrap().to_vec::<f32>().unwrap());
        }
        out
    };
    let want = run(&Device::cpu());
    run(&dev);
    let skipped = metrics::counter("UniformWritesSkipped");
    let got = run(&dev);
    common::assert_close(&got, &want, 1e-5, 1e-6, "scalars A A B A B B");
    let now = metrics::counter("UniformWritesSkipped") - skipped;
    assert!(now >= 2, "the repeats skip their writes: {now}");
}
