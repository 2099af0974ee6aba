//! The benchmark harness behind `lazuli bench` and the criterion benches:
//! the workloads of `WORKLOADS.md` on a device — the small set W1–W6 (with
//! H1), sized for a 2-core box, and the GPU-scale set G1–G8 (`--scale gpu`)
//! — and the baselines they are judged against, measured in the same
//! process.
//!
//! Each workload builds its input once, outside the timed loop, runs 3
//! warm-up iterations, then the timed ones; every iteration ends at a
//! device barrier ([`Device::wait`]). A [`BenchResult`] reports median,
//! min and max, the throughput where the workload defines one, and the
//! kernels launched per iteration (the `KernelLaunches` counter delta).
//!
//! The G workloads take their sizes from [`GpuSizes`]: the full sizes of
//! `WORKLOADS.md` by default, [`GpuSizes::small`] for a 2-core box
//! (`--size small`), tiny ones in tests, through the same code. Their row
//! names are those of the PyTorch twin (`shared/gpu/torch_twin.py`), so
//! JSON rows of both line up. A G workload that cannot run on a device (a
//! tensor over the adapter's binding limit) becomes a row with NaN times
//! and the error, and the run goes on. G8, the GPT training step, lives in
//! `gpt` ([`Gpt`]); its row adds host and device ms per step.
//!
//! H1 (`host`) splits the host's cost per op of W5's chain into recording,
//! tracing, hashing with the cache lookup, and submitting, beside the
//! device's share.
//!
//! Baselines: [`memcpy`] (a plain copy of a 64 MiB f32 buffer, read + write
//! GB/s), and on wgpu the hand-written kernels of `shaders/` run through
//! [`lazuli_wgpu::baseline::Baseline`] on the same adapter: a vec4 kernel
//! for W1 and a naive one-thread-per-output matmul for W2.
//!
//! C1 is not in `WORKLOADS.md`: a 3x3 convolution forward and backward
//! (the CPU backend's im2col + GEMM), judged against [`conv_gemm_baseline`],
//! the `gemm` crate alone on the three matrix products a convolution's
//! forward and backward amount to (same FLOPs, no packing, no layout work).
//!
//! A1 is not in `WORKLOADS.md` either: causal scaled dot-product attention
//! ([`AttnSizes`], `GpuSizes::attention`, so `--size small` applies), the
//! fused op beside the unfused composition on the same device, forward
//! alone and forward + backward; the ratio lines give fused over unfused.
//!
//! One module per workload family: `small` (W1–W5 and the MLP step),
//! `gpu` (G1–G7 and the G sizes), `gpt` (G8), `host` (H1), `attention`
//! (A1), `conv` (C1), `baseline` and `profile`. This file holds what they
//! share: the [`Workload`] names, [`BenchConfig`], [`BenchResult`],
//! [`BenchDevice`], the timing loop and [`run_workload`], which runs any
//! workload into its rows. The command line (argument parsing, the
//! progress bar, the table and the ratios) is the `lazuli` binary's.

use crate::{metrics, Device, ExecError, Result, Tensor};
use lazuli_executor::platform::Instant;
use lazuli_wgpu::{WgpuBackend, WgpuOptions};
use std::sync::Arc;
use std::time::Duration;

mod attention;
mod baseline;
mod conv;
mod gpt;
mod gpu;
mod host;
pub mod models;
mod profile;
mod small;

use attention::attention_rows;
pub use attention::{AttnSizes, AttnStep};
pub use baseline::{conv_gemm_baseline, matmul_naive_baseline, memcpy, w1_vec4_baseline};
pub use conv::{ConvSizes, ConvStep};
pub use gpt::{Gpt, GptModel, GptSizes, StepTimes};
pub use gpu::{
    amp_row_name, gpu_row_name, prepare_gpu, run_amp_workload, run_gpu_workload, GpuRun, GpuSizes, AMP_DTYPES,
};
pub use host::{host_split, HOST_OPS};
pub use profile::{profile, KernelProfile, Profile};
pub use small::{w1_chain, w1_input, w1_step, w2_inputs, w2_step, w3_input, w3_step, w5_input, w5_step, Mlp, MlpSizes};

/// A workload of `WORKLOADS.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Elementwise chain over f32 [4096, 4096].
    W1,
    /// Matmul 1024³.
    W2,
    /// Softmax over the last dim of f32 [4096, 1024].
    W3,
    /// MLP training step (64 -> 256 -> 10, batch 256, SGD).
    W4,
    /// 100 tiny ops on f32 `[1024]`, then sync.
    W5,
    /// Cold compile: first sync of W1 and of W4 on a fresh device.
    W6,
    /// W1's chain over f32 [16384, 4096].
    G1,
    /// Matmul 2048³.
    G2,
    /// Matmul 4096³.
    G3,
    /// Softmax over the last dim of f32 [16384, 4096].
    G4,
    /// Sum over the last dim of f32 [16384, 4096].
    G5,
    /// Layer norm over the last dim of f32 [16384, 1024].
    G6,
    /// MLP training step (1024 -> 4096 -> 1024, batch 4096, SGD).
    G7,
    /// GPT training step (4 layers, n_embd 256, context 128, batch 32, AdamW).
    G8,
    /// Host cost per op of W5's chain, split by phase (record, trace,
    /// hash + cache hit, submit) beside the device time.
    H1,
    /// Conv2d 3x3 forward + backward ([`ConvSizes::C1`]).
    C1,
    /// Causal attention, fused and unfused, forward and forward + backward
    /// ([`AttnSizes`]).
    A1,
    /// Whole ONNX models: the `light` CNNs and a transformer encoder
    /// (`models`), one row each.
    O1,
}

impl Workload {
    /// Every workload, in order.
    pub const ALL: [Workload; 18] = [
        Workload::W1,
        Workload::W2,
        Workload::W3,
        Workload::W4,
        Workload::W5,
        Workload::W6,
        Workload::G1,
        Workload::G2,
        Workload::G3,
        Workload::G4,
        Workload::G5,
        Workload::G6,
        Workload::G7,
        Workload::G8,
        Workload::H1,
        Workload::C1,
        Workload::A1,
        Workload::O1,
    ];

    /// The small set, W1–W6 and H1 (`--scale small`, the default).
    pub const SMALL: [Workload; 7] =
        [Workload::W1, Workload::W2, Workload::W3, Workload::W4, Workload::W5, Workload::W6, Workload::H1];

    /// The GPU-scale set, G1–G8 (`--scale gpu`).
    pub const GPU: [Workload; 8] = [
        Workload::G1,
        Workload::G2,
        Workload::G3,
        Workload::G4,
        Workload::G5,
        Workload::G6,
        Workload::G7,
        Workload::G8,
    ];

    /// Parses "W1" .. "W6", "G1" .. "G8", "H1", "C1", "A1", "O1" (case-insensitive).
    pub fn parse(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name().eq_ignore_ascii_case(s))
    }

    /// "W1" .. "W6", "G1" .. "G8", "H1", "C1", "A1", "O1".
    pub fn name(self) -> &'static str {
        match self {
            Workload::W1 => "W1",
            Workload::W2 => "W2",
            Workload::W3 => "W3",
            Workload::W4 => "W4",
            Workload::W5 => "W5",
            Workload::W6 => "W6",
            Workload::G1 => "G1",
            Workload::G2 => "G2",
            Workload::G3 => "G3",
            Workload::G4 => "G4",
            Workload::G5 => "G5",
            Workload::G6 => "G6",
            Workload::G7 => "G7",
            Workload::G8 => "G8",
            Workload::H1 => "H1",
            Workload::C1 => "C1",
            Workload::A1 => "A1",
            Workload::O1 => "O1",
        }
    }

    /// Whether this is one of the GPU-scale workloads G1–G8.
    pub fn is_gpu_scale(self) -> bool {
        Workload::GPU.contains(&self)
    }
}

/// How many iterations to run.
#[derive(Clone, Copy, Debug)]
pub struct BenchConfig {
    /// Untimed iterations first (3 by the workload rules).
    pub warmup: usize,
    /// Timed iterations (at least 10 by the workload rules).
    pub iterations: usize,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig { warmup: 3, iterations: 10 }
    }
}

/// One measured row.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchResult {
    /// Workload or baseline name ("W1", "memcpy", "W1 vec4 baseline" ...).
    pub workload: String,
    /// "cpu", "wgpu" or "host".
    pub device: String,
    /// Median time per iteration, ms.
    pub median_ms: f64,
    /// Fastest iteration, ms.
    pub min_ms: f64,
    /// Slowest iteration, ms.
    pub max_ms: f64,
    /// Bytes read + written per median time, where defined.
    pub gbps: Option<f64>,
    /// 2·n³ per median time, where defined.
    pub gflops: Option<f64>,
    /// Kernels launched per iteration (None for baselines and CPU work
    /// that launches none).
    pub kernels: Option<f64>,
    /// Median host time per iteration (recording and syncing), ms, where
    /// the workload splits it (G8).
    pub host_ms: Option<f64>,
    /// Median time the device worker spent executing per iteration, ms,
    /// where the workload splits it (G8).
    pub device_ms: Option<f64>,
    /// A remark ("µs per op", "not supported" ...).
    pub note: Option<String>,
    /// Why the workload could not run on this device (its times are then
    /// NaN).
    pub error: Option<String>,
}

impl BenchResult {
    fn from_times(workload: &str, device: &str, times: &[Duration]) -> BenchResult {
        let mut ms: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let median = if ms.is_empty() { f64::NAN } else { ms[ms.len() / 2] };
        BenchResult {
            workload: workload.to_string(),
            device: device.to_string(),
            median_ms: median,
            min_ms: ms.first().copied().unwrap_or(f64::NAN),
            max_ms: ms.last().copied().unwrap_or(f64::NAN),
            gbps: None,
            gflops: None,
            kernels: None,
            host_ms: None,
            device_ms: None,
            note: None,
            error: None,
        }
    }

    /// A row for a workload that could not run: NaN times and the error.
    pub fn failed(workload: &str, device: &str, error: String) -> BenchResult {
        BenchResult { error: Some(error), ..BenchResult::from_times(workload, device, &[]) }
    }

    fn with_bytes(mut self, bytes: f64) -> BenchResult {
        self.gbps = Some(bytes / (self.median_ms * 1e-3) / 1e9);
        self
    }

    fn with_flops(mut self, flops: f64) -> BenchResult {
        self.gflops = Some(flops / (self.median_ms * 1e-3) / 1e9);
        self
    }

    /// The row as a JSON object: `workload`, `device`, `median_ms`,
    /// `min_ms`, `max_ms`, `gbps` or `gflops` where defined, `kernels`,
    /// `host_ms` and `device_ms` where split, `note` and `error` where
    /// present (NaN times are written as `null`).
    pub fn to_json(&self) -> serde_json::Value {
        let mut o = serde_json::Map::new();
        o.insert("workload".into(), self.workload.clone().into());
        o.insert("device".into(), self.device.clone().into());
        o.insert("median_ms".into(), self.median_ms.into());
        o.insert("min_ms".into(), self.min_ms.into());
        o.insert("max_ms".into(), self.max_ms.into());
        if let Some(g) = self.gbps {
            o.insert("gbps".into(), g.into());
        }
        if let Some(g) = self.gflops {
            o.insert("gflops".into(), g.into());
        }
        o.insert("kernels".into(), self.kernels.map_or(serde_json::Value::Null, Into::into));
        if let Some(h) = self.host_ms {
            o.insert("host_ms".into(), h.into());
        }
        if let Some(d) = self.device_ms {
            o.insert("device_ms".into(), d.into());
        }
        if let Some(n) = &self.note {
            o.insert("note".into(), n.clone().into());
        }
        if let Some(e) = &self.error {
            o.insert("error".into(), e.clone().into());
        }
        serde_json::Value::Object(o)
    }
}

/// A device to benchmark: a wgpu device keeps its concrete backend, for
/// the baselines and for profiling.
#[derive(Clone)]
pub struct BenchDevice {
    /// The device.
    pub device: Device,
    /// "cpu" or "wgpu".
    pub label: &'static str,
    /// The wgpu backend behind `device`, if it is a wgpu device.
    pub wgpu: Option<Arc<WgpuBackend>>,
}

impl BenchDevice {
    /// A fresh CPU device.
    pub fn cpu() -> BenchDevice {
        BenchDevice { device: <Device as crate::DeviceExt>::cpu(), label: "cpu", wgpu: None }
    }

    /// A fresh wgpu device on the default adapter (its own wgpu device,
    /// pipeline cache and compile cache).
    pub fn wgpu() -> Result<BenchDevice> {
        let backend = Arc::new(
            WgpuBackend::new(WgpuOptions::default())
                .map_err(|source| ExecError::Backend { context: "opening the wgpu adapter".into(), source })?,
        );
        let cpu = <Device as crate::DeviceExt>::cpu().backend().clone();
        let device = Device::new(backend.clone(), cpu);
        Ok(BenchDevice { device, label: "wgpu", wgpu: Some(backend) })
    }

    /// A fresh device of the same kind (cold caches).
    pub fn fresh(&self) -> Result<BenchDevice> {
        if self.wgpu.is_some() {
            BenchDevice::wgpu()
        } else {
            Ok(BenchDevice::cpu())
        }
    }
}

/// Deterministic data uniform in [-1, 1].
pub fn uniform_data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Times `iteration` (warm-up first); returns the durations and the
/// kernels launched per timed iteration.
pub fn time_iterations(cfg: &BenchConfig, mut iteration: impl FnMut() -> Result<()>) -> Result<(Vec<Duration>, f64)> {
    for _ in 0..cfg.warmup {
        iteration()?;
    }
    let before = metrics::counter("KernelLaunches");
    let mut times = Vec::with_capacity(cfg.iterations);
    for _ in 0..cfg.iterations.max(1) {
        let t = Instant::now();
        iteration()?;
        times.push(t.elapsed());
    }
    let launches = metrics::counter("KernelLaunches") - before;
    Ok((times, launches as f64 / cfg.iterations.max(1) as f64))
}

/// Uploads `x` to its device outside any timed loop (its first use
/// uploads the host data into its cell) and waits. `#[track_caller]`: the
/// recording and the sync are attributed to each caller, so uploads of
/// different shapes do not look like one sync point recompiling in a loop.
#[track_caller]
fn on_device(x: Tensor) -> Result<Tensor> {
    x.relu()?.sync()?;
    x.device().wait()?;
    Ok(x)
}

/// Runs workload `w` on `bd`, returning its rows (W6 gives two, H1 one
/// per phase). G workloads run at `sizes` and never fail: see
/// [`run_gpu_workload`].
pub fn run_workload(w: Workload, bd: &BenchDevice, cfg: &BenchConfig, sizes: &GpuSizes) -> Result<Vec<BenchResult>> {
    let dev = &bd.device;
    let label = bd.label;
    let row = |name: &str, (times, kernels): (Vec<Duration>, f64)| {
        let mut r = BenchResult::from_times(name, label, &times);
        r.kernels = Some(kernels);
        r
    };
    Ok(match w {
        Workload::W1 => {
            let x = w1_input(dev)?;
            let bytes = 2.0 * 4.0 * x.numel() as f64;
            vec![row("W1", time_iterations(cfg, || w1_step(&x))?).with_bytes(bytes)]
        }
        Workload::W2 => {
            let (a, b) = w2_inputs(dev)?;
            vec![row("W2", time_iterations(cfg, || w2_step(&a, &b))?).with_flops(2.0 * 1024f64.powi(3))]
        }
        Workload::W3 => {
            let x = w3_input(dev)?;
            let bytes = 2.0 * 4.0 * x.numel() as f64;
            vec![row("W3", time_iterations(cfg, || w3_step(&x))?).with_bytes(bytes)]
        }
        Workload::W4 => {
            let mut mlp = Mlp::new(dev)?;
            vec![row("W4", time_iterations(cfg, || mlp.step().map(drop))?)]
        }
        Workload::W5 => {
            let x = w5_input(dev)?;
            let mut r = row("W5", time_iterations(cfg, || w5_step(&x).map(drop))?);
            r.note = Some(format!("{:.2} µs per op", r.median_ms * 1e3 / 100.0));
            vec![r]
        }
        Workload::W6 => {
            // A fresh device per run: empty compile cache and, on wgpu, an
            // empty pipeline cache. Fewer runs: each compiles from scratch.
            let runs = cfg.iterations.clamp(1, 3);
            let mut w1 = Vec::new();
            let mut w4 = Vec::new();
            for _ in 0..runs {
                let fresh = bd.fresh()?;
                let x = w1_input(&fresh.device)?;
                let t = Instant::now();
                w1_step(&x)?;
                w1.push(t.elapsed());
                let mut mlp = Mlp::new(&fresh.device)?;
                let t = Instant::now();
                mlp.step()?;
                w4.push(t.elapsed());
            }
            let mut a = BenchResult::from_times("W6 (W1 cold)", label, &w1);
            a.note = Some(format!("{runs} fresh devices"));
            let mut b = BenchResult::from_times("W6 (W4 cold)", label, &w4);
            b.note = a.note.clone();
            vec![a, b]
        }
        Workload::H1 => host_split(bd, cfg)?,
        Workload::G1
        | Workload::G2
        | Workload::G3
        | Workload::G4
        | Workload::G5
        | Workload::G6
        | Workload::G7
        | Workload::G8 => vec![run_gpu_workload(w, bd, cfg, sizes)],
        Workload::C1 => {
            let mut conv = ConvStep::new(dev, ConvSizes::C1)?;
            let r = row("C1", time_iterations(cfg, || conv.step())?).with_flops(ConvSizes::C1.flops());
            vec![BenchResult { note: Some(ConvSizes::C1.describe()), ..r }]
        }
        Workload::A1 => attention_rows(bd, cfg, sizes.attention)?,
        Workload::O1 => models::o1_rows(bd, cfg)?,
    })
}
