//! Shared helpers of the integration tests: the devices to run on (wgpu is
//! required when LAZULI_REQUIRE_ADAPTER=1), closeness checks, a lock for
//! tests that assert process-wide metrics, and a small deterministic RNG.
#![allow(dead_code)] // Each test binary uses a different subset of the helpers.

use lazuli::prelude::*;
use std::sync::{Mutex, MutexGuard};

/// True when CI demands a GPU adapter (tests fail instead of skipping).
pub fn adapter_required() -> bool {
    std::env::var("LAZULI_REQUIRE_ADAPTER").map(|v| v == "1").unwrap_or(false)
}

/// The wgpu device, or None (printing why) when no adapter exists and none
/// is required.
pub fn wgpu() -> Option<Device> {
    match Device::wgpu() {
        Ok(d) => Some(d),
        Err(e) if !adapter_required() => {
            eprintln!("skipping wgpu part: no adapter ({e})");
            None
        }
        Err(e) => panic!("LAZULI_REQUIRE_ADAPTER=1 but no wgpu adapter: {e}"),
    }
}

/// One wgpu device per kernel-form profile (software, then GPU), each
/// named; empty when no adapter exists and none is required.
pub fn wgpu_profiles() -> Vec<(&'static str, Device)> {
    if wgpu().is_none() {
        return Vec::new();
    }
    let with = |forms: lazuli::wgpu::forms::KernelForms| {
        let opts = lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), ..Default::default() };
        Device::wgpu_with(opts).expect("a wgpu device")
    };
    vec![
        ("software forms", with(lazuli::wgpu::forms::KernelForms::software())),
        ("gpu forms", with(lazuli::wgpu::forms::KernelForms::gpu())),
    ]
}

/// The CPU device and, when available, the wgpu device.
pub fn devices() -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    v.extend(wgpu());
    v
}

/// Serializes tests that assert process-wide metrics counters.
pub fn metrics_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Plans compiled in this process so far: new structures
/// (`UncachedCompile`) and size variants of known ones
/// (`SizeVariantCompile`).
pub fn plans_compiled() -> u64 {
    lazuli::metrics::counter("UncachedCompile") + lazuli::metrics::counter("SizeVariantCompile")
}

/// Deterministic pseudo-random values in [lo, hi).
pub fn rand_vec(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// Asserts |a - b| <= atol + rtol * |b| elementwise; NaN equals NaN.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], rtol: f32, atol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= atol + rtol * w.abs();
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}
