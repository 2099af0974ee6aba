//! The baselines the workloads are judged against, measured in the same
//! process without the engine: [`memcpy`] on the host, the `gemm` crate on
//! C1's products ([`conv_gemm_baseline`]), and on wgpu the hand-written
//! kernels of this crate's `shaders/` (a vec4 kernel for W1, a naive
//! matmul for W2).

use super::handwritten::{Baseline, BaselineBinding, MATMUL_NAIVE, W1_VEC4};
use super::{uniform_data, BenchConfig, BenchResult, ConvSizes};
use lazuli::platform::Instant;
use lazuli::{ExecError, Result};
use lazuli_wgpu::WgpuBackend;
use std::time::Duration;

/// The C1 baseline: the `gemm` crate (through `lazuli_cpu::sgemm`, on the
/// same rayon pool) on the three products of a convolution's forward and
/// backward, with the operands already laid out: `Y = W @ col`,
/// `dW = dY @ col^T`, `dcol = W^T @ dY` (`m`, `k`, `n` of
/// [`ConvSizes::gemm_dims`]). Each product is timed in both row-major
/// orientations (`C = A @ B` and `C^T = B^T @ A^T`, which the crate runs
/// at very different speeds on 2 cores) and the faster one counts, so the
/// bar is the crate's best on these shapes. Same FLOPs as C1.
pub fn conv_gemm_baseline(cfg: &BenchConfig, sizes: ConvSizes) -> BenchResult {
    let (m, k, n) = sizes.gemm_dims();
    // (rows, inner, cols) of each product in both orientations.
    let products = [[(m, k, n), (n, k, m)], [(m, n, k), (k, n, m)], [(k, m, n), (n, m, k)]];
    let mut total = Vec::new();
    let mut chosen = Vec::new();
    for pair in products {
        let mut best: Option<(Vec<Duration>, (usize, usize, usize))> = None;
        for (r, i, c) in pair {
            let a = uniform_data(r * i, 31);
            let b = uniform_data(i * c, 32);
            let mut out = vec![0f32; r * c];
            for _ in 0..cfg.warmup {
                lazuli_cpu::sgemm(&a, &b, &mut out, r, i, c);
            }
            let mut times: Vec<Duration> = (0..cfg.iterations)
                .map(|_| {
                    let t = Instant::now();
                    lazuli_cpu::sgemm(&a, &b, &mut out, r, i, c);
                    t.elapsed()
                })
                .collect();
            times.sort();
            let median = |t: &[Duration]| t.get(t.len() / 2).copied().unwrap_or_default();
            if best.as_ref().is_none_or(|(bt, _)| median(&times) < median(bt)) {
                best = Some((times, (r, i, c)));
            }
        }
        let (times, shape) = best.expect("two orientations");
        total = if total.is_empty() { times } else { total.iter().zip(&times).map(|(a, b)| *a + *b).collect() };
        chosen.push(shape);
    }
    let r = BenchResult::from_times("C1 gemm baseline", "host", &total).with_flops(sizes.flops());
    let shapes: Vec<String> = chosen.iter().map(|(a, b, c)| format!("[{a},{b}]x[{b},{c}]")).collect();
    BenchResult { note: Some(format!("faster orientation of each product: {}", shapes.join(" "))), ..r }
}

/// The memcpy baseline: copies of a 64 MiB f32 buffer; GB/s counts read
/// plus write.
pub fn memcpy(cfg: &BenchConfig) -> BenchResult {
    let n = 16 << 20;
    let src = uniform_data(n, 7);
    let mut dst = vec![0f32; n];
    let mut times = Vec::new();
    for i in 0..cfg.warmup + cfg.iterations.max(1) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        if i >= cfg.warmup {
            times.push(t.elapsed());
        }
    }
    BenchResult::from_times("memcpy 64 MiB", "host", &times).with_bytes(2.0 * 4.0 * n as f64)
}

/// The hand-written W1 vec4 kernel on the backend's adapter.
pub fn w1_vec4_baseline(backend: &WgpuBackend, cfg: &BenchConfig) -> Result<BenchResult> {
    let n = 4096 * 4096;
    let x = uniform_data(n, 1);
    let mut u: Vec<u32> = vec![(n / 4) as u32];
    u.extend([1.5f32, 0.5, 0.25, 2.0].map(f32::to_bits));
    u.extend([0u32; 3]);
    let groups = ((n / 4) as u32).div_ceil(256);
    let b = Baseline::new(
        backend,
        W1_VEC4,
        &[
            BaselineBinding::Uniform(u32_bytes(&u)),
            BaselineBinding::Input(f32_bytes(&x)),
            BaselineBinding::Output(4 * n as u64),
        ],
        [groups.min(65535), groups.div_ceil(65535), 1],
    )
    .map_err(|source| ExecError::Backend { context: "W1 vec4 baseline".into(), source })?;
    let times = b
        .time(cfg.warmup, cfg.iterations)
        .map_err(|source| ExecError::Backend { context: "W1 vec4 baseline".into(), source })?;
    let mut r = BenchResult::from_times("W1 vec4 baseline", "wgpu", &times).with_bytes(8.0 * n as f64);
    r.kernels = Some(1.0);
    Ok(r)
}

/// The naive one-thread-per-output matmul on the backend's adapter
/// (1 warm-up, 3 timed runs: it is slow on software adapters).
pub fn matmul_naive_baseline(backend: &WgpuBackend, cfg: &BenchConfig) -> Result<BenchResult> {
    let m = 1024u32;
    let a = uniform_data((m * m) as usize, 2);
    let bm = uniform_data((m * m) as usize, 3);
    let b = Baseline::new(
        backend,
        MATMUL_NAIVE,
        &[
            BaselineBinding::Uniform(u32_bytes(&[m, m, m, 0])),
            BaselineBinding::Input(f32_bytes(&a)),
            BaselineBinding::Input(f32_bytes(&bm)),
            BaselineBinding::Output(4 * (m * m) as u64),
        ],
        [m / 16, m / 16, 1],
    )
    .map_err(|source| ExecError::Backend { context: "W2 naive baseline".into(), source })?;
    let times = b
        .time(cfg.warmup.min(1), cfg.iterations.min(3))
        .map_err(|source| ExecError::Backend { context: "W2 naive baseline".into(), source })?;
    let mut r = BenchResult::from_times("W2 naive baseline", "wgpu", &times).with_flops(2.0 * (m as f64).powi(3));
    r.kernels = Some(1.0);
    Ok(r)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
