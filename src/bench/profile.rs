//! Per-kernel GPU times of a workload on a wgpu device, from timestamp
//! queries ([`profile`]): what `lazuli bench --profile` prints.

use super::{
    prepare_gpu, w1_input, w1_step, w2_inputs, w2_step, w3_input, w3_step, w5_input, w5_step, AttnStep, BenchConfig,
    BenchDevice, ConvSizes, ConvStep, GpuSizes, Mlp, Workload,
};
use crate::Result;

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
