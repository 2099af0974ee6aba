//! Size variants compiled ahead of time (`LAZULI_COMPILE_AHEAD`,
//! `Device::set_compile_ahead`): a structure whose sizes keep one step
//! gets its next sizes compiled on threads of their own, every result
//! matches the CPU reference (a growing `narrow`, and a decode loop whose
//! key cache stays on the device), a sequence without a steady step predicts
//! nothing, clearing the cache discards what was compiled ahead, and a
//! device dropped while it compiles ahead drops cleanly.

mod common;

use lazuli::prelude::*;

/// Rows of the context buffer the steps narrow.
const CONTEXT: usize = 32;

/// One step at length `t`: causal self-attention-like mixing over the
/// first `t` rows of a context buffer (a growing `narrow`, a product,
/// a causal mask from iotas, a softmax), summed per row. One sync.
fn step(d: &Device, t: usize) -> Vec<f32> {
    let ctx = Tensor::from_slice(&common::rand_vec(CONTEXT * 16, 7, -1.0, 1.0), [CONTEXT, 16], d).unwrap();
    let w = Tensor::from_slice(&common::rand_vec(16 * 16, 11, -0.5, 0.5), [16, 16], d).unwrap();
    let x = ctx.narrow(0, 0, t).unwrap();
    let h = x.matmul(&w).unwrap();
    let scores = h.matmul(&x.t().unwrap()).unwrap().mul_scalar(0.25).unwrap();
    let later = Tensor::iota([t, t], 0, DType::I32, d).unwrap().lt(&Tensor::iota([t, t], 1, DType::I32, d).unwrap());
    let p = scores.masked_fill(&later.unwrap(), f32::NEG_INFINITY).unwrap().softmax(-1).unwrap();
    p.matmul(&h).unwrap().sum(&[1], false).unwrap().to_vec::<f32>().unwrap()
}

/// The devices to compile ahead on: the CPU backend (which does not by
/// default) and both kernel-form profiles of the wgpu device.
fn devices() -> Vec<(&'static str, Device)> {
    let mut v = vec![("cpu", Device::cpu())];
    v.extend(common::wgpu_profiles());
    v
}

#[test]
fn a_growing_length_compiles_its_next_sizes_ahead() {
    let cpu = Device::cpu();
    let lengths: Vec<usize> = (3..=20).collect();
    let want: Vec<Vec<f32>> = lengths.iter().map(|&t| step(&cpu, t)).collect();
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        assert!(dev.compiling_ahead(), "{name}");
        for (&t, want) in lengths.iter().zip(&want) {
            common::assert_close(&step(&dev, t), want, 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        // On the path: the structure, then two size variants (the step
        // counts once seen twice); every later length was compiled ahead.
        let (compiled, _) = dev.compile_counts();
        let (ahead, used) = dev.compiled_ahead();
        assert_eq!(compiled, 3, "{name}: plans compiled on the path");
        assert_eq!(used, lengths.len() as u64 - 3, "{name}: plans compiled ahead and used");
        assert!(ahead >= used, "{name}: {ahead} compiled ahead, {used} used");
    }
}

/// Once a step is confirmed, the next `COMPILE_AHEAD_DEPTH` sizes compile
/// ahead at once, on threads of their own, before any sync asks for
/// them (one thread one size ahead would set the pace of a loop whose
/// steps take less than a compile).
#[test]
fn several_sizes_compile_ahead_at_once() {
    let cpu = Device::cpu();
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        for t in 3..=5 {
            common::assert_close(&step(&dev, t), &step(&cpu, t), 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        let depth = lazuli::COMPILE_AHEAD_DEPTH as u64;
        assert!(depth >= 2, "several sizes at once");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while dev.compiled_ahead().0 < depth {
            assert!(std::time::Instant::now() < deadline, "{name}: {:?} compiled ahead", dev.compiled_ahead());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for t in 6..6 + depth as usize {
            common::assert_close(&step(&dev, t), &step(&cpu, t), 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        assert_eq!(dev.compile_counts().0, 3, "{name}: lengths 3, 4 and 5 compiled on the path");
        assert_eq!(dev.compiled_ahead().1, depth, "{name}: the lengths after 5 were compiled ahead");
    }
}

/// A decode loop with a key cache kept on the device: each step appends
/// one row to the cache (the previous step's output), attends a query
/// over it, and syncs the output and the new cache as one graph. Returns
/// the outputs of every step.
fn decode(d: &Device, steps: usize) -> Vec<Vec<f32>> {
    let mut cache = Tensor::from_slice(&common::rand_vec(2 * 8, 5, -1.0, 1.0), [2, 8], d).unwrap();
    let mut outs = Vec::new();
    for s in 0..steps {
        let row = Tensor::from_slice(&common::rand_vec(8, 100 + s as u64, -1.0, 1.0), [1, 8], d).unwrap();
        let q = Tensor::from_slice(&common::rand_vec(8, 200 + s as u64, -1.0, 1.0), [1, 8], d).unwrap();
        let keys = Tensor::concat(&[&cache, &row], 0).unwrap();
        let p = q.matmul(&keys.t().unwrap()).unwrap().softmax(-1).unwrap();
        let out = p.matmul(&keys).unwrap();
        lazuli::sync(&[&out, &keys]).unwrap();
        outs.push(out.to_vec::<f32>().unwrap());
        cache = keys;
    }
    outs
}

#[test]
fn a_decode_loop_with_a_device_cache_compiles_ahead() {
    let want = decode(&Device::cpu(), 16);
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        let got = decode(&dev, 16);
        for (s, (got, want)) in got.iter().zip(&want).enumerate() {
            common::assert_close(got, want, 1e-4, 1e-4, &format!("{name}, step {s}"));
        }
        // The first cache length on the path, then two size variants
        // that confirm the step; the other 13 were compiled ahead.
        assert_eq!(dev.compile_counts().0, 3, "{name}: plans compiled on the path");
        assert_eq!(dev.compiled_ahead().1, 13, "{name}: plans compiled ahead and used");
    }
}

#[test]
fn lengths_without_a_steady_step_predict_nothing() {
    let cpu = Device::cpu();
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        // Steps of +2, -1, +4, -6, +9: never the same twice in a row.
        for t in [5, 7, 6, 10, 4, 13] {
            common::assert_close(&step(&dev, t), &step(&cpu, t), 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        assert_eq!(dev.compile_counts().0, 6, "{name}");
        assert_eq!(dev.compiled_ahead(), (0, 0), "{name}");
    }
}

#[test]
fn clearing_the_cache_discards_what_was_compiled_ahead() {
    let cpu = Device::cpu();
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        for t in 3..=6 {
            common::assert_close(&step(&dev, t), &step(&cpu, t), 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        // Length 6 was compiled ahead, and length 7 is being (or was):
        // a new fallback set clears the cache, so 7 compiles on the path
        // with it, and predicts 8 under it.
        dev.set_force_fallback(&["softmax"]);
        for t in 7..=9 {
            common::assert_close(&step(&dev, t), &step(&cpu, t), 1e-4, 1e-4, &format!("{name}, length {t}"));
        }
        assert_eq!(dev.compile_counts().0, 4, "{name}: lengths 3, 4, 5 and 7 compiled on the path");
        assert_eq!(dev.compiled_ahead().1, 3, "{name}: lengths 6, 8 and 9 compiled ahead");
        dev.set_force_fallback(&[]);
    }
}

#[test]
fn a_device_dropped_while_compiling_ahead_drops_cleanly() {
    for (name, dev) in devices() {
        dev.set_compile_ahead(true);
        for t in 3..=5 {
            step(&dev, t);
        }
        // Length 6 is waiting to compile or compiling: the drop stops
        // and joins the thread.
        drop(dev);
        let again = Device::cpu();
        assert_eq!(step(&again, 4).len(), 4, "{name}: a new device works");
    }
}

#[test]
fn compiling_ahead_is_on_where_kernels_leave_the_host_idle() {
    if std::env::var_os("LAZULI_COMPILE_AHEAD").is_some() {
        return; // The environment decides.
    }
    // The CPU backend's kernels and a software adapter's run on the
    // host's cores: off.
    assert!(!Device::cpu().compiling_ahead());
    if let Some(dev) = common::wgpu() {
        let software = dev.name().contains("llvmpipe") || dev.name().contains("(Vulkan, Cpu)");
        assert_eq!(dev.compiling_ahead(), !software, "{}", dev.name());
        let setting = dev.configuration().to_string();
        assert!(setting.contains("LAZULI_COMPILE_AHEAD"), "{setting}");
    }
}
