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

use crate::nn::{self, Module};
use crate::optim::{Optimizer, Sgd};
use crate::{metrics, Device, ExecError, Result, Tensor};
use lazuli_wgpu::baseline::{Baseline, BaselineBinding, MATMUL_NAIVE, W1_VEC4};
use lazuli_wgpu::{WgpuBackend, WgpuOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod gpt;
mod host;

pub use gpt::{Gpt, GptModel, GptSizes, StepTimes};
pub use host::{host_split, HOST_OPS};

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
    /// 100 tiny ops on f32 [1024], then sync.
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
}

impl Workload {
    /// Every workload, in order.
    pub const ALL: [Workload; 17] = [
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

    /// Parses "W1" .. "W6", "G1" .. "G8", "H1", "C1", "A1" (case-insensitive).
    pub fn parse(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name().eq_ignore_ascii_case(s))
    }

    /// "W1" .. "W6", "G1" .. "G8", "H1", "C1", "A1".
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
        }
    }

    /// Whether this is one of the GPU-scale workloads G1–G8.
    pub fn is_gpu_scale(self) -> bool {
        Workload::GPU.contains(&self)
    }
}

/// Which set of workloads `lazuli bench` runs when none is named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Scale {
    /// W1–W6 and H1, sized for a 2-core box.
    #[default]
    Small,
    /// G1–G8, sized for a GPU.
    Gpu,
}

impl Scale {
    /// Parses "small" or "gpu".
    pub fn parse(s: &str) -> Option<Scale> {
        match s {
            "small" => Some(Scale::Small),
            "gpu" => Some(Scale::Gpu),
            _ => None,
        }
    }

    /// The workloads of the set, in order.
    pub fn workloads(self) -> Vec<Workload> {
        match self {
            Scale::Small => Workload::SMALL.to_vec(),
            Scale::Gpu => Workload::GPU.to_vec(),
        }
    }
}

/// The sizes of an MLP training step: input [batch, input] ->
/// Linear(input, hidden) -> ReLU -> Linear(hidden, classes) ->
/// cross-entropy with labels `i * 7 mod classes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpSizes {
    /// Rows of the input.
    pub batch: usize,
    /// Input features.
    pub input: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Output classes.
    pub classes: usize,
}

impl MlpSizes {
    /// W4: batch 256, 64 -> 256 -> 10.
    pub const W4: MlpSizes = MlpSizes { batch: 256, input: 64, hidden: 256, classes: 10 };
    /// G7: batch 4096, 1024 -> 4096 -> 1024.
    pub const G7: MlpSizes = MlpSizes { batch: 4096, input: 1024, hidden: 4096, classes: 1024 };

    /// FLOPs of one step as `WORKLOADS.md` counts them: 2 per multiply-add
    /// of the two matmuls, three times (forward, and the two products of
    /// each backward matmul).
    pub fn flops(self) -> f64 {
        6.0 * self.batch as f64 * (self.input * self.hidden + self.hidden * self.classes) as f64
    }
}

/// The sizes of the G workloads. [`GpuSizes::default`] gives those of
/// `WORKLOADS.md`; tests run the same code with [`GpuSizes::tiny`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuSizes {
    /// G1, G4 and G5: the f32 input, [rows, cols] ([16384, 4096]).
    pub wide: [usize; 2],
    /// G2: n of the n³ matmul (2048).
    pub matmul_g2: usize,
    /// G3: n of the n³ matmul (4096).
    pub matmul_g3: usize,
    /// G6: the layer norm input, [rows, cols] ([16384, 1024]).
    pub layer_norm: [usize; 2],
    /// G7: the MLP ([`MlpSizes::G7`]).
    pub mlp: MlpSizes,
    /// G8: the GPT ([`GptSizes::G8`]).
    pub gpt: GptSizes,
    /// A1: the attention problem ([`AttnSizes::A1`]).
    pub attention: AttnSizes,
}

impl Default for GpuSizes {
    fn default() -> Self {
        GpuSizes {
            wide: [16384, 4096],
            matmul_g2: 2048,
            matmul_g3: 4096,
            layer_norm: [16384, 1024],
            mlp: MlpSizes::G7,
            gpt: GptSizes::G8,
            attention: AttnSizes::A1,
        }
    }
}

impl GpuSizes {
    /// Sizes small enough for a debug-build test (every dimension still
    /// distinct, so a swapped axis shows).
    pub fn tiny() -> GpuSizes {
        GpuSizes {
            wide: [64, 256],
            matmul_g2: 32,
            matmul_g3: 48,
            layer_norm: [32, 128],
            mlp: MlpSizes { batch: 64, input: 32, hidden: 96, classes: 16 },
            gpt: GptSizes::TINY,
            attention: AttnSizes { batch: 1, heads: 2, t: 24, d: 8 },
        }
    }

    /// Sizes for a 2-core box (`--size small`): each G workload a few
    /// milliseconds on its CPU, and G8 the small GPT of `GPU.md`'s
    /// host-cost measurement ([`GptSizes::SMALL`]).
    pub fn small() -> GpuSizes {
        GpuSizes {
            wide: [1024, 1024],
            matmul_g2: 256,
            matmul_g3: 512,
            layer_norm: [1024, 256],
            mlp: MlpSizes { batch: 256, input: 256, hidden: 1024, classes: 256 },
            gpt: GptSizes::SMALL,
            attention: AttnSizes { batch: 2, heads: 4, t: 256, d: 64 },
        }
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

/// W1's chain: `tanh(relu(x * 1.5 + 0.5) - 0.25) * 2.0`.
pub fn w1_chain(x: &Tensor) -> Result<Tensor> {
    x.mul_scalar(1.5)?.add_scalar(0.5)?.relu()?.sub_scalar(0.25)?.tanh()?.mul_scalar(2.0)
}

/// W1's input on `dev`, already on the device.
pub fn w1_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(4096 * 4096, 1), [4096, 4096], dev)?;
    // Upload outside the timed loop.
    x.relu()?.sum(&[], false)?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W1 iteration: record, sync, wait.
pub fn w1_step(x: &Tensor) -> Result<()> {
    w1_chain(x)?.sync()?;
    x.device().wait()
}

/// The W2 operands (f32 [1024, 1024] each), on the device.
pub fn w2_inputs(dev: &Device) -> Result<(Tensor, Tensor)> {
    let a = Tensor::from_slice(&uniform_data(1024 * 1024, 2), [1024, 1024], dev)?;
    let b = Tensor::from_slice(&uniform_data(1024 * 1024, 3), [1024, 1024], dev)?;
    a.add(&b)?.sync()?;
    dev.wait()?;
    Ok((a, b))
}

/// One W2 iteration.
pub fn w2_step(a: &Tensor, b: &Tensor) -> Result<()> {
    a.matmul(b)?.sync()?;
    a.device().wait()
}

/// The W3 input (f32 [4096, 1024]), on the device.
pub fn w3_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(4096 * 1024, 4), [4096, 1024], dev)?;
    x.relu()?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W3 iteration.
pub fn w3_step(x: &Tensor) -> Result<()> {
    x.softmax(-1)?.sync()?;
    x.device().wait()
}

/// The model, optimizer and data of an MLP training step (W4, G7).
pub struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    opt: Sgd,
    x: Tensor,
    labels: Tensor,
}

impl Mlp {
    /// Linear(64, 256) -> ReLU -> Linear(256, 10), SGD lr 0.1, input
    /// [256, 64], integer labels [256].
    pub fn new(dev: &Device) -> Result<Mlp> {
        Mlp::with_sizes(dev, MlpSizes::W4, 0.1, 5)
    }

    /// Linear(input, hidden) -> ReLU -> Linear(hidden, classes), SGD with
    /// learning rate `lr`, input [batch, input] uniform in [-1, 1] (from
    /// `seed`), integer labels `i * 7 mod classes`.
    pub fn with_sizes(dev: &Device, sizes: MlpSizes, lr: f64, seed: u64) -> Result<Mlp> {
        let MlpSizes { batch, input, hidden, classes } = sizes;
        let l1 = nn::Linear::new(input, hidden, dev)?;
        let l2 = nn::Linear::new(hidden, classes, dev)?;
        let mut params = l1.parameters();
        params.extend(l2.parameters());
        let opt = Sgd::new(params, lr);
        let x = Tensor::from_slice(&uniform_data(batch * input, seed), [batch, input], dev)?;
        let labels: Vec<i32> = (0..batch).map(|i| (i * 7 % classes) as i32).collect();
        let labels = Tensor::from_slice(&labels, [batch], dev)?;
        Ok(Mlp { l1, l2, opt, x, labels })
    }

    /// One training step: forward, cross-entropy, backward, SGD update,
    /// `mark_step`, wait. Returns the (lazy, now computed) loss.
    pub fn step(&mut self) -> Result<Tensor> {
        self.opt.zero_grad();
        let h = nn::relu(&self.l1.forward(&self.x)?)?;
        let logits = self.l2.forward(&h)?;
        let loss = nn::cross_entropy(&logits, &self.labels)?;
        loss.backward()?;
        self.opt.step()?;
        let dev = self.x.device().clone();
        dev.mark_step()?;
        dev.wait()?;
        Ok(loss)
    }
}

/// The W5 input (f32 [1024]).
pub fn w5_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(1024, 6), [1024], dev)?;
    x.relu()?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W5 iteration: 100 times `x = x * 1.0001 + 0.0001`, sync, wait.
pub fn w5_step(x: &Tensor) -> Result<Tensor> {
    let mut y = x.clone();
    for _ in 0..100 {
        y = y.mul_scalar(1.0001)?.add_scalar(0.0001)?;
    }
    y.sync()?;
    x.device().wait()?;
    Ok(y)
}

/// A G workload ready to time: its inputs on the device, one iteration as
/// a closure, and what its throughput counts.
pub struct GpuRun {
    /// The row name ([`gpu_row_name`]).
    pub name: String,
    /// One iteration: record, sync, wait.
    pub step: Box<dyn FnMut() -> Result<()>>,
    /// Bytes read + written per iteration, for GB/s.
    pub bytes: Option<f64>,
    /// FLOPs per iteration, for GFLOP/s.
    pub flops: Option<f64>,
}

/// The row name of workload `w` at `sizes`: for G1–G8 the name the PyTorch
/// twin (`shared/gpu/torch_twin.py`) gives the same workload at the default
/// sizes, e.g. "G1 elementwise [16384,4096]" (G8 at other sizes names
/// them: "G8 GPT train step [L2 C64 T64 B16]"); for W1–W6 and H1 the short
/// name.
pub fn gpu_row_name(w: Workload, sizes: &GpuSizes) -> String {
    let [wr, wc] = sizes.wide;
    let [lr, lc] = sizes.layer_norm;
    match w {
        Workload::G1 => format!("G1 elementwise [{wr},{wc}]"),
        Workload::G2 => format!("G2 matmul {}^3", sizes.matmul_g2),
        Workload::G3 => format!("G3 matmul {}^3", sizes.matmul_g3),
        Workload::G4 => format!("G4 softmax [{wr},{wc}]"),
        Workload::G5 => format!("G5 row sum [{wr},{wc}]"),
        Workload::G6 => format!("G6 layer norm [{lr},{lc}]"),
        Workload::G7 => "G7 MLP train step".to_string(),
        Workload::G8 if sizes.gpt == GptSizes::G8 => "G8 GPT train step".to_string(),
        Workload::G8 => {
            let g = sizes.gpt;
            format!("G8 GPT train step [L{} C{} T{} B{}]", g.layers, g.embd, g.context, g.batch)
        }
        Workload::W1
        | Workload::W2
        | Workload::W3
        | Workload::W4
        | Workload::W5
        | Workload::W6
        | Workload::H1
        | Workload::C1
        | Workload::A1 => w.name().to_string(),
    }
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

/// f32 [rows, cols] uniform in [-1, 1], on the device.
#[track_caller]
fn uniform_input(dev: &Device, [rows, cols]: [usize; 2], seed: u64) -> Result<Tensor> {
    on_device(Tensor::from_slice(&uniform_data(rows * cols, seed), [rows, cols], dev)?)
}

/// Builds G workload `w` at `sizes` on `dev`: inputs made and uploaded,
/// nothing timed yet. A W workload is an `Invalid` error.
pub fn prepare_gpu(w: Workload, dev: &Device, sizes: &GpuSizes) -> Result<GpuRun> {
    type Step = Box<dyn FnMut() -> Result<()>>;
    let (step, bytes, flops): (Step, Option<f64>, Option<f64>) = match w {
        Workload::G1 => {
            let x = uniform_input(dev, sizes.wide, 11)?;
            let bytes = 8.0 * x.numel() as f64;
            (Box::new(move || w1_step(&x)), Some(bytes), None)
        }
        Workload::G2 | Workload::G3 => {
            let n = if w == Workload::G2 { sizes.matmul_g2 } else { sizes.matmul_g3 };
            let a = uniform_input(dev, [n, n], 12)?;
            let b = uniform_input(dev, [n, n], 13)?;
            (Box::new(move || w2_step(&a, &b)), None, Some(2.0 * (n as f64).powi(3)))
        }
        Workload::G4 => {
            let x = uniform_input(dev, sizes.wide, 14)?;
            let bytes = 8.0 * x.numel() as f64;
            (Box::new(move || w3_step(&x)), Some(bytes), None)
        }
        Workload::G5 => {
            let x = uniform_input(dev, sizes.wide, 15)?;
            let bytes = 4.0 * x.numel() as f64;
            let step = move || {
                x.sum(&[-1], false)?.sync()?;
                x.device().wait()
            };
            (Box::new(step), Some(bytes), None)
        }
        Workload::G6 => {
            let x = uniform_input(dev, sizes.layer_norm, 16)?;
            let d = sizes.layer_norm[1];
            let weight = on_device(Tensor::from_slice(&vec![1f32; d], [d], dev)?)?;
            let bias = on_device(Tensor::from_slice(&vec![0f32; d], [d], dev)?)?;
            let bytes = 8.0 * x.numel() as f64;
            let step = move || {
                nn::layer_norm(&x, 1, Some(&weight), Some(&bias), 1e-5)?.sync()?;
                x.device().wait()
            };
            (Box::new(step), Some(bytes), None)
        }
        Workload::G7 => {
            let mut mlp = Mlp::with_sizes(dev, sizes.mlp, 0.01, 17)?;
            (Box::new(move || mlp.step().map(drop)), None, Some(sizes.mlp.flops()))
        }
        Workload::G8 => {
            let mut gpt = Gpt::new(dev, sizes.gpt)?;
            (Box::new(move || gpt.step().map(drop)), None, None)
        }
        Workload::W1
        | Workload::W2
        | Workload::W3
        | Workload::W4
        | Workload::W5
        | Workload::W6
        | Workload::H1
        | Workload::C1
        | Workload::A1 => {
            return Err(ExecError::Invalid {
                op: "bench::prepare_gpu".into(),
                detail: format!("{} is not a GPU-scale workload", w.name()),
            })
        }
    };
    Ok(GpuRun { name: gpu_row_name(w, sizes), step, bytes, flops })
}

/// Runs G workload `w` at `sizes` on `bd`. A workload that cannot run on
/// this device (a tensor over the adapter's binding limit, say) gives a row
/// with NaN times and the error instead of failing the whole run.
pub fn run_gpu_workload(w: Workload, bd: &BenchDevice, cfg: &BenchConfig, sizes: &GpuSizes) -> BenchResult {
    if w == Workload::G8 {
        return run_g8(bd, cfg, sizes).unwrap_or_else(|e| {
            let _ = bd.device.wait();
            BenchResult::failed(&gpu_row_name(w, sizes), bd.label, e.to_string())
        });
    }
    let measured = prepare_gpu(w, &bd.device, sizes).and_then(|mut run| {
        let (times, kernels) = time_iterations(cfg, &mut run.step)?;
        let mut r = BenchResult::from_times(&run.name, bd.label, &times);
        r.kernels = Some(kernels);
        if let Some(b) = run.bytes {
            r = r.with_bytes(b);
        }
        if let Some(f) = run.flops {
            r = r.with_flops(f);
        }
        Ok(r)
    });
    measured.unwrap_or_else(|e| {
        // The failure may also be stored in the device as an asynchronous
        // error; take it here, or the next workload's first barrier would
        // report it.
        let _ = bd.device.wait();
        BenchResult::failed(&gpu_row_name(w, sizes), bd.label, e.to_string())
    })
}

/// G8: the GPT step timed with its split: median total, host (recording
/// and `mark_step`) and device (the worker's execution) ms per step.
fn run_g8(bd: &BenchDevice, cfg: &BenchConfig, sizes: &GpuSizes) -> Result<BenchResult> {
    let mut gpt = Gpt::new(&bd.device, sizes.gpt)?;
    for _ in 0..cfg.warmup {
        gpt.step()?;
    }
    let before = metrics::counter("KernelLaunches");
    let n = cfg.iterations.max(1);
    let steps: Vec<StepTimes> = (0..n).map(|_| gpt.step().map(|(_, t)| t)).collect::<Result<_>>()?;
    let kernels = (metrics::counter("KernelLaunches") - before) as f64 / n as f64;
    let median = |f: &dyn Fn(&StepTimes) -> Duration| {
        let mut v: Vec<f64> = steps.iter().map(|s| f(s).as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let totals: Vec<Duration> = steps.iter().map(|s| s.total).collect();
    let mut r = BenchResult::from_times(&gpu_row_name(Workload::G8, sizes), bd.label, &totals);
    r.kernels = Some(kernels);
    r.host_ms = Some(median(&|s| s.host()));
    r.device_ms = Some(median(&|s| s.device));
    r.note = Some(format!(
        "host {:.3} ms (record {:.3} + sync {:.3}), device {:.3} ms; {} parameter tensors",
        median(&|s| s.host()),
        median(&|s| s.record),
        median(&|s| s.sync),
        median(&|s| s.device),
        sizes.gpt.parameter_tensors()
    ));
    Ok(r)
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
    })
}

/// The sizes of the attention workload: q, k, v f32 `[batch, heads, t, d]`,
/// causal, the default scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSizes {
    /// Sequences.
    pub batch: usize,
    /// Heads.
    pub heads: usize,
    /// Sequence length (queries and keys).
    pub t: usize,
    /// Head dim.
    pub d: usize,
}

impl AttnSizes {
    /// A1: batch 4, 8 heads, 1024 tokens, head dim 64 (the target
    /// size for the fused forward: at least 2x the unfused on a GPU).
    pub const A1: AttnSizes = AttnSizes { batch: 4, heads: 8, t: 1024, d: 64 };

    /// FLOPs of the forward as counted for a causal mask: the two products
    /// (`2 t t d` each per head) over the half of the scores a query sees.
    pub fn forward_flops(self) -> f64 {
        2.0 * (self.batch * self.heads) as f64 * (self.t * self.t * self.d) as f64
    }

    /// FLOPs of forward + backward: the backward's four products (dV, dP,
    /// dQ, dK) on top of the forward's two, all causal halves.
    pub fn training_flops(self) -> f64 {
        3.0 * self.forward_flops()
    }

    /// "[B4 H8 T1024 D64] causal".
    pub fn describe(self) -> String {
        format!("[B{} H{} T{} D{}] causal", self.batch, self.heads, self.t, self.d)
    }
}

/// One A1 iteration's state: q, k, v (leaves that require grad) and the
/// output gradient, on the device.
pub struct AttnStep {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    r: Tensor,
}

impl AttnStep {
    /// Inputs uniform in [-1, 1], uploaded outside any timed loop.
    pub fn new(dev: &Device, sizes: AttnSizes) -> Result<AttnStep> {
        let AttnSizes { batch, heads, t, d } = sizes;
        let n = batch * heads * t * d;
        let leaf = |seed| on_device(Tensor::from_slice(&uniform_data(n, seed), [batch, heads, t, d], dev)?);
        Ok(AttnStep {
            q: leaf(41)?.requires_grad_(true)?,
            k: leaf(42)?.requires_grad_(true)?,
            v: leaf(43)?.requires_grad_(true)?,
            r: leaf(44)?,
        })
    }

    /// One iteration: the output (`fused`: `nn::scaled_dot_product_attention`,
    /// else its unfused composition), and with `backward` the gradients of
    /// `sum(O * r)`; one sync, wait.
    pub fn step(&mut self, fused: bool, backward: bool) -> Result<()> {
        let f = if fused { nn::scaled_dot_product_attention } else { nn::scaled_dot_product_attention_unfused };
        let opts = nn::AttentionOptions::causal();
        if !backward {
            let o = crate::no_grad(|| f(&self.q, &self.k, &self.v, &opts))?;
            o.sync()?;
            return self.q.device().wait();
        }
        let loss = f(&self.q, &self.k, &self.v, &opts)?.mul(&self.r)?.sum(&[], false)?;
        loss.backward()?;
        let grads: Vec<Tensor> = [&self.q, &self.k, &self.v].iter().filter_map(|t| t.grad()).collect();
        for t in [&self.q, &self.k, &self.v] {
            t.zero_grad();
        }
        if grads.len() != 3 {
            return Err(ExecError::Invalid { op: "bench A1".into(), detail: "no gradient".into() });
        }
        crate::sync(&[&loss, &grads[0], &grads[1], &grads[2]])?;
        self.q.device().wait()
    }
}

/// The four A1 rows on `bd`: fused and unfused, forward and forward +
/// backward.
fn attention_rows(bd: &BenchDevice, cfg: &BenchConfig, sizes: AttnSizes) -> Result<Vec<BenchResult>> {
    let mut step = AttnStep::new(&bd.device, sizes)?;
    let mut rows = Vec::new();
    for (backward, flops, what) in
        [(false, sizes.forward_flops(), "forward"), (true, sizes.training_flops(), "forward+backward")]
    {
        for fused in [true, false] {
            let (times, kernels) = time_iterations(cfg, || step.step(fused, backward))?;
            let name = format!("A1 attention {what} {}", if fused { "fused" } else { "unfused" });
            let mut r = BenchResult::from_times(&name, bd.label, &times).with_flops(flops);
            r.kernels = Some(kernels);
            rows.push(BenchResult { note: Some(sizes.describe()), ..r });
        }
    }
    Ok(rows)
}

/// The sizes of a convolution workload: a `kernel` x `kernel` convolution,
/// stride 1, padding `kernel / 2` (same size out), of x f32 `[batch,
/// channels, size, size]` by w `[out_channels, channels, kernel, kernel]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSizes {
    /// Images.
    pub batch: usize,
    /// Input channels.
    pub channels: usize,
    /// Height and width.
    pub size: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel height and width (odd).
    pub kernel: usize,
}

impl ConvSizes {
    /// C1: x [32, 32, 32, 32], w [64, 32, 3, 3].
    pub const C1: ConvSizes = ConvSizes { batch: 32, channels: 32, size: 32, out_channels: 64, kernel: 3 };

    /// The matrix product of the forward pass: `[m, k] @ [k, n]` with m the
    /// output channels, k the taps per output, n the output positions.
    pub fn gemm_dims(self) -> (usize, usize, usize) {
        (self.out_channels, self.channels * self.kernel * self.kernel, self.batch * self.size * self.size)
    }

    /// FLOPs of forward + backward: three products of `2 m k n`.
    pub fn flops(self) -> f64 {
        let (m, k, n) = self.gemm_dims();
        6.0 * (m * k * n) as f64
    }

    /// "x [32,32,32,32] w [64,32,3,3] pad 1".
    pub fn describe(self) -> String {
        let (b, c, s, o, k) = (self.batch, self.channels, self.size, self.out_channels, self.kernel);
        format!("x [{b},{c},{s},{s}] w [{o},{c},{k},{k}] pad {}", k / 2)
    }
}

/// One C1 iteration's state: the input and weight (leaves that require
/// grad) and the fixed output gradient, on the device.
pub struct ConvStep {
    x: Tensor,
    w: Tensor,
    r: Tensor,
    sizes: ConvSizes,
}

impl ConvStep {
    /// Inputs uniform in [-1, 1], uploaded outside any timed loop.
    pub fn new(dev: &Device, sizes: ConvSizes) -> Result<ConvStep> {
        let ConvSizes { batch: b, channels: c, size: s, out_channels: o, kernel: k } = sizes;
        let x = on_device(Tensor::from_slice(&uniform_data(b * c * s * s, 21), [b, c, s, s], dev)?)?;
        let w = on_device(Tensor::from_slice(&uniform_data(o * c * k * k, 22), [o, c, k, k], dev)?)?;
        let r = on_device(Tensor::from_slice(&uniform_data(b * o * s * s, 23), [b, o, s, s], dev)?)?;
        Ok(ConvStep { x: x.requires_grad_(true)?, w: w.requires_grad_(true)?, r, sizes })
    }

    /// Forward, backward of `sum(conv(x, w) * r)` (so the output gradient
    /// is `r`), one sync of the loss and both gradients, wait.
    pub fn step(&mut self) -> Result<()> {
        let pad = self.sizes.kernel / 2;
        let attrs = crate::ir::ConvAttrs { pads: [pad; 4], ..Default::default() };
        let loss = self.x.conv2d(&self.w, attrs)?.mul(&self.r)?.sum(&[], false)?;
        loss.backward()?;
        let (gx, gw) = (self.x.grad(), self.w.grad());
        self.x.zero_grad();
        self.w.zero_grad();
        let (Some(gx), Some(gw)) = (gx, gw) else {
            return Err(ExecError::Invalid { op: "bench C1".into(), detail: "no gradient".into() });
        };
        crate::sync(&[&loss, &gx, &gw])?;
        self.x.device().wait()
    }
}

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

/// Per-kernel GPU times of `iterations` runs of workload `w` on a wgpu
/// device: `(kernel, total ms, share of the total)`, largest first; `None`
/// when the adapter has no timestamp queries.
pub fn profile(
    w: Workload,
    bd: &BenchDevice,
    sizes: &GpuSizes,
    iterations: usize,
) -> Result<Option<Vec<(String, f64, f64)>>> {
    let Some(backend) = &bd.wgpu else { return Ok(None) };
    if !backend.supports_profiling() {
        return Ok(None);
    }
    let cfg = BenchConfig { warmup: 1, iterations: 0 };
    // Warm up (compile) without profiling, then profile.
    let dev = &bd.device;
    let mut body: Box<dyn FnMut() -> Result<()>> = match w {
        Workload::W1 | Workload::W6 => {
            let x = w1_input(dev)?;
            Box::new(move || w1_step(&x))
        }
        Workload::W2 => {
            let (a, b) = w2_inputs(dev)?;
            Box::new(move || w2_step(&a, &b))
        }
        Workload::W3 => {
            let x = w3_input(dev)?;
            Box::new(move || w3_step(&x))
        }
        Workload::W4 => {
            let mut mlp = Mlp::new(dev)?;
            Box::new(move || mlp.step().map(drop))
        }
        Workload::W5 | Workload::H1 => {
            let x = w5_input(dev)?;
            Box::new(move || w5_step(&x).map(drop))
        }
        Workload::G1
        | Workload::G2
        | Workload::G3
        | Workload::G4
        | Workload::G5
        | Workload::G6
        | Workload::G7
        | Workload::G8 => prepare_gpu(w, dev, sizes)?.step,
        Workload::C1 => {
            let mut conv = ConvStep::new(dev, ConvSizes::C1)?;
            Box::new(move || conv.step())
        }
        Workload::A1 => {
            let mut attn = AttnStep::new(dev, sizes.attention)?;
            Box::new(move || attn.step(true, true))
        }
    };
    for _ in 0..cfg.warmup {
        body()?;
    }
    backend.set_profiling(true);
    for _ in 0..iterations.max(1) {
        body()?;
    }
    let samples = backend.take_profile();
    backend.set_profiling(false);
    let mut totals: Vec<(String, f64)> = Vec::new();
    for (name, ms) in samples {
        match totals.iter_mut().find(|(n, _)| *n == name) {
            Some(t) => t.1 += ms,
            None => totals.push((name, ms)),
        }
    }
    let all: f64 = totals.iter().map(|t| t.1).sum();
    totals.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(Some(totals.into_iter().map(|(n, ms)| (n, ms, if all > 0.0 { ms / all } else { 0.0 })).collect()))
}

/// Timed iterations of a G workload on the CPU device when `--iterations`
/// is not given: a 4096³ matmul takes about a second there.
pub const GPU_SCALE_CPU_ITERATIONS: usize = 3;

/// Timed iterations of a G workload on a software adapter (lavapipe) when
/// `--iterations` is not given: a G3 or G7 iteration takes about 22 s there.
pub const GPU_SCALE_SOFTWARE_ITERATIONS: usize = 1;

/// The options of `lazuli bench`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchArgs {
    /// The workloads to run, in order: those named, or else the `--scale`
    /// set.
    pub workloads: Vec<Workload>,
    /// Run on the CPU device.
    pub cpu: bool,
    /// Run on a wgpu device.
    pub wgpu: bool,
    /// Print a JSON array instead of the table.
    pub json: bool,
    /// Add per-kernel GPU times on wgpu.
    pub profile: bool,
    /// `--iterations N`, if given.
    pub iterations: Option<usize>,
    /// The sizes of the G workloads: `WORKLOADS.md`'s, or with `--size
    /// small` [`GpuSizes::small`].
    pub sizes: GpuSizes,
}

impl BenchArgs {
    /// Parses `[W1 ... G1 ...] [--scale small|gpu] [--size full|small]
    /// [--device cpu|wgpu|all] [--json] [--profile] [--iterations N]`.
    pub fn parse(args: &[String]) -> std::result::Result<BenchArgs, String> {
        let mut workloads = Vec::new();
        let mut scale = Scale::default();
        let (mut cpu, mut wgpu) = (true, true);
        let (mut json, mut profile) = (false, false);
        let mut iterations = None;
        let mut sizes = GpuSizes::default();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--device" => match it.next().map(String::as_str) {
                    Some("cpu") => (cpu, wgpu) = (true, false),
                    Some("wgpu") => (cpu, wgpu) = (false, true),
                    Some("all") => (cpu, wgpu) = (true, true),
                    other => return Err(format!("--device takes cpu, wgpu or all, got {other:?}")),
                },
                "--scale" => {
                    let v = it.next().map(String::as_str);
                    scale = v.and_then(Scale::parse).ok_or_else(|| format!("--scale takes small or gpu, got {v:?}"))?;
                }
                "--size" => match it.next().map(String::as_str) {
                    Some("full") => sizes = GpuSizes::default(),
                    Some("small") => sizes = GpuSizes::small(),
                    other => return Err(format!("--size takes full or small, got {other:?}")),
                },
                "--json" => json = true,
                "--profile" => profile = true,
                "--iterations" => {
                    iterations = Some(
                        it.next()
                            .and_then(|n| n.parse().ok())
                            .filter(|&n| n >= 1)
                            .ok_or("--iterations takes a positive number")?,
                    );
                }
                w => workloads.push(Workload::parse(w).ok_or_else(|| format!("unknown workload or option {w:?}"))?),
            }
        }
        if workloads.is_empty() {
            workloads = scale.workloads();
        }
        Ok(BenchArgs { workloads, cpu, wgpu, json, profile, iterations, sizes })
    }

    /// The iterations of workload `w` on the device labelled `device`
    /// ("cpu", "wgpu" or "wgpu (software)"): `--iterations` if given, else
    /// 10, except for G workloads at full size on the CPU device
    /// ([`GPU_SCALE_CPU_ITERATIONS`]) and on software adapters
    /// ([`GPU_SCALE_SOFTWARE_ITERATIONS`]).
    pub fn config(&self, w: Workload, device: &str) -> BenchConfig {
        let default = BenchConfig::default();
        let fallback = match device {
            _ if !(w.is_gpu_scale() || w == Workload::A1) || self.sizes == GpuSizes::small() => default.iterations,
            "cpu" => GPU_SCALE_CPU_ITERATIONS,
            "wgpu (software)" => GPU_SCALE_SOFTWARE_ITERATIONS,
            _ => default.iterations,
        };
        BenchConfig { iterations: self.iterations.unwrap_or(fallback), ..default }
    }
}

/// `lazuli bench [W1 ... G1 ...] [--scale small|gpu] [--size full|small]
/// [--device cpu|wgpu|all] [--json] [--profile] [--iterations N]`: runs the
/// workloads (the `--scale` set by default: W1–W6 and H1, or G1–G8 with
/// `--scale gpu`; G workloads at `--size`) and
/// the baselines on the chosen devices (default all), with a progress bar
/// on stderr, and prints a table, or a JSON array with `--json`.
/// `--profile` adds the per-kernel GPU times of each workload on wgpu
/// (timestamp queries).
pub fn cli(args: &[String]) -> std::result::Result<(), String> {
    let args = BenchArgs::parse(args)?;
    let workloads = &args.workloads;
    let cfg = BenchConfig {
        iterations: args.iterations.unwrap_or(BenchConfig::default().iterations),
        ..BenchConfig::default()
    };
    let mut devices = Vec::new();
    if args.cpu {
        devices.push(BenchDevice::cpu());
    }
    if args.wgpu {
        match BenchDevice::wgpu() {
            Ok(d) => devices.push(d),
            Err(e) if args.cpu => eprintln!("lazuli bench: no wgpu device ({e}); CPU only"),
            Err(e) => return Err(e.to_string()),
        }
    }
    let has = |w: Workload| workloads.contains(&w);
    let wgpu_dev = devices.iter().find_map(|d| d.wgpu.clone());
    let steps = 1
        + has(Workload::C1) as usize
        + workloads.len() * devices.len()
        + wgpu_dev.as_ref().map_or(0, |_| has(Workload::W1) as usize + has(Workload::W2) as usize);
    let bar = indicatif::ProgressBar::new(steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    bar.set_message("memcpy");
    rows.push(memcpy(&cfg));
    bar.inc(1);
    if has(Workload::C1) {
        bar.set_message("C1 gemm baseline");
        rows.push(conv_gemm_baseline(&cfg, ConvSizes::C1));
        bar.inc(1);
    }
    if let Some(b) = &wgpu_dev {
        if has(Workload::W1) {
            bar.set_message("W1 vec4 baseline (wgpu)");
            rows.push(w1_vec4_baseline(b, &cfg).map_err(|e| e.to_string())?);
            bar.inc(1);
        }
        if has(Workload::W2) {
            bar.set_message("W2 naive baseline (wgpu)");
            rows.push(matmul_naive_baseline(b, &cfg).map_err(|e| e.to_string())?);
            bar.inc(1);
        }
    }
    let mut profiles = Vec::new();
    for d in &devices {
        for &w in workloads {
            bar.set_message(format!("{} ({})", w.name(), d.label));
            let kind = if d.wgpu.as_ref().is_some_and(|b| b.is_software()) { "wgpu (software)" } else { d.label };
            let measured = run_workload(w, d, &args.config(w, kind), &args.sizes)
                .map_err(|e| format!("{} on {}: {e}", w.name(), d.label))?;
            let ran = measured.iter().all(|r| r.error.is_none());
            rows.extend(measured);
            if args.profile && d.wgpu.is_some() && w != Workload::W6 {
                if !w.is_gpu_scale() {
                    profiles.push((w, Ok(profile(w, d, &args.sizes, 3).map_err(|e| e.to_string())?)));
                } else if !ran {
                    profiles.push((w, Err("not profiled: the workload did not run".to_string())));
                } else {
                    let p = profile(w, d, &args.sizes, 3).map_err(|e| e.to_string());
                    if p.is_err() {
                        let _ = d.device.wait();
                    }
                    profiles.push((w, p));
                }
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if args.json {
        let arr: Vec<serde_json::Value> = rows.iter().map(BenchResult::to_json).collect();
        println!("{}", serde_json::Value::Array(arr));
    } else {
        if let Some(b) = &wgpu_dev {
            println!("wgpu adapter: {}", lazuli_executor::Backend::name(b.as_ref()));
        }
        print!("{}", table(&rows));
        print!("{}", ratios(&rows));
    }
    if args.profile {
        if profiles.is_empty() && wgpu_dev.is_none() {
            println!("profile: no wgpu device");
        }
        for (w, p) in profiles {
            match p {
                Err(e) => println!("profile {}: {e}", w.name()),
                Ok(None) => println!("profile {}: timestamp queries not supported by this adapter", w.name()),
                Ok(Some(k)) => {
                    println!("profile {} (GPU time over 3 iterations):", w.name());
                    for (name, ms, share) in k {
                        println!("  {:>9.3} ms {:>5.1}%  {name}", ms, share * 100.0);
                    }
                }
            }
        }
    }
    Ok(())
}

/// The rows as an aligned text table (the workload column at least 20
/// wide; a row that could not run shows its error as the note).
pub fn table(rows: &[BenchResult]) -> String {
    let width = rows.iter().map(|r| r.workload.chars().count()).max().unwrap_or(0).max(20);
    let mut s = format!(
        "{:<width$} {:<6} {:>11} {:>11} {:>11} {:>16} {:>8}  {}\n",
        "workload", "device", "median ms", "min ms", "max ms", "throughput", "kernels", "note"
    );
    for r in rows {
        let tp = match (r.gbps, r.gflops) {
            (Some(g), _) => format!("{g:.2} GB/s"),
            (_, Some(f)) => format!("{f:.2} GFLOP/s"),
            _ => String::new(),
        };
        let k = r.kernels.map(|k| format!("{k:.1}")).unwrap_or_default();
        let note = match &r.error {
            Some(e) => format!("error: {e}"),
            None => r.note.clone().unwrap_or_default(),
        };
        s.push_str(&format!(
            "{:<width$} {:<6} {:>11.3} {:>11.3} {:>11.3} {:>16} {:>8}  {}\n",
            r.workload, r.device, r.median_ms, r.min_ms, r.max_ms, tp, k, note
        ));
    }
    s
}

/// The ratios the targets are stated in, for the rows present.
pub fn ratios(rows: &[BenchResult]) -> String {
    let find = |w: &str, d: &str| rows.iter().find(|r| r.workload == w && r.device == d);
    let mut s = String::new();
    let mut line = |name: &str, v: Option<f64>| {
        if let Some(v) = v {
            s.push_str(&format!("{name:<32} {v:.2}x\n"));
        }
    };
    let memcpy = find("memcpy 64 MiB", "host").and_then(|r| r.gbps);
    for d in ["wgpu", "cpu"] {
        let w1 = find("W1", d).and_then(|r| r.gbps);
        line(&format!("W1 {d} / memcpy"), w1.zip(memcpy).map(|(a, b)| a / b));
        let w3 = find("W3", d).and_then(|r| r.gbps);
        line(&format!("W3 {d} / W1 {d} (GB/s)"), w3.zip(w1).map(|(a, b)| a / b));
    }
    let vec4 = find("W1 vec4 baseline", "wgpu").and_then(|r| r.gbps);
    line("W1 wgpu / vec4 baseline", find("W1", "wgpu").and_then(|r| r.gbps).zip(vec4).map(|(a, b)| a / b));
    let gemm = find("C1 gemm baseline", "host").and_then(|r| r.gflops);
    for d in ["cpu", "wgpu"] {
        line(&format!("C1 {d} / gemm baseline"), find("C1", d).and_then(|r| r.gflops).zip(gemm).map(|(a, b)| a / b));
    }
    for d in ["cpu", "wgpu"] {
        for what in ["forward", "forward+backward"] {
            let ms = |kind: &str| find(&format!("A1 attention {what} {kind}"), d).map(|r| r.median_ms);
            line(&format!("A1 {d} {what}: unfused / fused"), ms("unfused").zip(ms("fused")).map(|(u, f)| u / f));
        }
    }
    let naive = find("W2 naive baseline", "wgpu").and_then(|r| r.gflops);
    line("W2 wgpu / naive baseline", find("W2", "wgpu").and_then(|r| r.gflops).zip(naive).map(|(a, b)| a / b));
    s
}
