//! The GPU-scale workloads G1–G8 of `WORKLOADS.md`: their sizes
//! ([`GpuSizes`], full, small or tiny through the same code), their row
//! names (those of the PyTorch twin), building one ready to time
//! ([`prepare_gpu`]) and running it into a row, an error row when it
//! cannot run on the device ([`run_gpu_workload`]); G8 adds its host and
//! device split. G3 and G8 also have mixed-precision rows
//! ([`run_amp_workload`], one per [`AMP_DTYPES`] entry: G3 on 16-bit
//! inputs, G8 under autocast), named as the twin's `--engines amp` rows.

use super::{
    on_device, time_iterations, uniform_data, w1_step, w2_step, w3_step, AttnSizes, BenchConfig, BenchDevice,
    BenchResult, Gpt, GptSizes, Mlp, MlpSizes, StepTimes, Workload,
};
use crate::nn;
use crate::{metrics, DType, Device, ExecError, Result, Tensor};
use std::time::Duration;

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
/// sizes, e.g. `"G1 elementwise [16384,4096]"` (G8 at other sizes names
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
        | Workload::A1
        | Workload::O1 => w.name().to_string(),
    }
}

/// The 16-bit float dtypes of the mixed-precision rows (`lazuli bench
/// --amp`), in the order of `torch_twin.py --engines amp`'s G3 rows.
pub const AMP_DTYPES: &[DType] = &[DType::F16, DType::BF16];

/// The row name of workload `w`'s mixed-precision row in `dtype`, as the
/// PyTorch twin's `--engines amp` names it: `"G3 matmul 4096^3 f16"` (f16
/// inputs, f32 accumulation) and `"G8 GPT train step autocast f16"` (the
/// step under autocast); `None` for workloads without one.
pub fn amp_row_name(w: Workload, sizes: &GpuSizes, dtype: DType) -> Option<String> {
    match w {
        Workload::G3 => Some(format!("{} {dtype}", gpu_row_name(w, sizes))),
        Workload::G8 => Some(format!("{} autocast {dtype}", gpu_row_name(w, sizes))),
        _ => None,
    }
}

/// Runs the mixed-precision row of `w` in `dtype` (see [`amp_row_name`]):
/// G3 on `dtype` inputs made on the device from G3's f32 ones, G8 with
/// [`Gpt::with_autocast`]. `None` for workloads without one; a row that
/// cannot run has NaN times and the error, as [`run_gpu_workload`].
pub fn run_amp_workload(
    w: Workload,
    bd: &BenchDevice,
    cfg: &BenchConfig,
    sizes: &GpuSizes,
    dtype: DType,
) -> Option<BenchResult> {
    let name = amp_row_name(w, sizes, dtype)?;
    let measured = match w {
        Workload::G8 => run_g8(bd, cfg, sizes, Some(dtype)),
        _ => (|| {
            let n = sizes.matmul_g3;
            let a = on_device(uniform_input(&bd.device, [n, n], 12)?.cast(dtype)?)?;
            let b = on_device(uniform_input(&bd.device, [n, n], 13)?.cast(dtype)?)?;
            let (times, kernels) = time_iterations(cfg, || w2_step(&a, &b))?;
            let mut r = BenchResult::from_times(&name, bd.label, &times).with_flops(2.0 * (n as f64).powi(3));
            r.kernels = Some(kernels);
            Ok(r)
        })(),
    };
    Some(measured.unwrap_or_else(|e| {
        let _ = bd.device.wait();
        BenchResult::failed(&name, bd.label, e.to_string())
    }))
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
        | Workload::A1
        | Workload::O1 => {
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
        return run_g8(bd, cfg, sizes, None).unwrap_or_else(|e| {
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
/// and `mark_step`) and device (the worker's execution) ms per step; with
/// `autocast`, the step under it (its [`amp_row_name`]).
fn run_g8(bd: &BenchDevice, cfg: &BenchConfig, sizes: &GpuSizes, autocast: Option<DType>) -> Result<BenchResult> {
    let mut gpt = Gpt::new(&bd.device, sizes.gpt)?.with_autocast(autocast)?;
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
    let name = match autocast {
        Some(d) => amp_row_name(Workload::G8, sizes, d).expect("G8 has an autocast row"),
        None => gpu_row_name(Workload::G8, sizes),
    };
    let mut r = BenchResult::from_times(&name, bd.label, &totals);
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
