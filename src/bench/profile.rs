//! A roofline of a workload on a wgpu device ([`profile`]): per kernel,
//! the workgroups, FLOPs and bytes of a launch by the backend's cost
//! model (computed when the kernel compiled) and, where the adapter has
//! timestamp queries, its GPU time, achieved GB/s and TFLOP/s and share of
//! the workload's GPU time: what `lazuli bench --profile` prints.

use super::{
    prepare_gpu, w1_input, w1_step, w2_inputs, w2_step, w3_input, w3_step, w5_input, w5_step, AttnStep, BenchConfig,
    BenchDevice, ConvSizes, ConvStep, GpuSizes, Mlp, Workload,
};
use crate::Result;

/// One kernel of a workload's profile: its launches over the profiled
/// iterations, with the cost model's figures for one launch (see
/// `lazuli_wgpu`'s cost model: bytes count each tensor a launch reads or
/// writes once, FLOPs follow the graph) and the GPU time of all of them.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelProfile {
    /// The launch name, e.g. `k3_MatMul_matmul` (`..._pass1` for the first
    /// pass of a two-pass kernel).
    pub name: String,
    /// Launches profiled (one per iteration for most kernels).
    pub launches: u64,
    /// Workgroups one launch dispatches.
    pub workgroups: u64,
    /// FLOPs of one launch.
    pub flops: u64,
    /// Bytes one launch reads and writes.
    pub bytes: u64,
    /// GPU time of all its launches in ms; `None` without timestamp
    /// queries.
    pub ms: Option<f64>,
    /// Its share of the workload's GPU time (0 to 1); `None` untimed.
    pub share: Option<f64>,
}

impl KernelProfile {
    /// Achieved bandwidth in GB/s (1e9 bytes a second): all launches'
    /// bytes over their time; `None` untimed or without time.
    pub fn gbps(&self) -> Option<f64> {
        self.rate(self.bytes)
    }

    /// Achieved TFLOP/s (1e12 FLOPs a second), as [`KernelProfile::gbps`].
    pub fn tflops(&self) -> Option<f64> {
        self.rate(self.flops).map(|r| r / 1e3)
    }

    /// `per_launch * launches` per ns (GB/s for bytes), where timed.
    fn rate(&self, per_launch: u64) -> Option<f64> {
        let ms = self.ms.filter(|&ms| ms > 0.0)?;
        Some(per_launch as f64 * self.launches as f64 / (ms * 1e6))
    }

    /// The kernel as a JSON object: `kernel`, `launches`, `workgroups`,
    /// `flops`, `bytes` (per launch), and where timed `ms`, `share`,
    /// `gbps` and `tflops` (else `null`).
    pub fn to_json(&self) -> serde_json::Value {
        let opt = |v: Option<f64>| v.map_or(serde_json::Value::Null, Into::into);
        serde_json::json!({
            "kernel": self.name,
            "launches": self.launches,
            "workgroups": self.workgroups,
            "flops": self.flops,
            "bytes": self.bytes,
            "ms": opt(self.ms),
            "share": opt(self.share),
            "gbps": opt(self.gbps()),
            "tflops": opt(self.tflops()),
        })
    }
}

/// A workload's kernels over the profiled iterations.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// Iterations profiled.
    pub iterations: usize,
    /// Whether the adapter timed the launches (timestamp queries).
    pub timed: bool,
    /// One entry per distinct kernel (name and cost), the most GPU time
    /// first where timed, else in launch order.
    pub kernels: Vec<KernelProfile>,
}

impl Profile {
    /// The profile as a JSON object: `iterations`, `timed` and `kernels`
    /// (see [`KernelProfile::to_json`]).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "iterations": self.iterations,
            "timed": self.timed,
            "kernels": self.kernels.iter().map(KernelProfile::to_json).collect::<Vec<_>>(),
        })
    }
}

/// The kernels of `iterations` runs of workload `w` on a wgpu device
/// (after one unprofiled warm-up run): each kernel's launches, the cost
/// model's workgroups, FLOPs and bytes, and where the adapter has
/// timestamp queries its GPU time; `None` on a device without wgpu.
pub fn profile(w: Workload, bd: &BenchDevice, sizes: &GpuSizes, iterations: usize) -> Result<Option<Profile>> {
    let Some(backend) = &bd.wgpu else { return Ok(None) };
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
        Workload::O1 => super::models::encoder_step(dev)?,
    };
    for _ in 0..cfg.warmup {
        body()?;
    }
    let iterations = iterations.max(1);
    let timed = backend.set_profiling(true);
    let ran = (0..iterations).try_for_each(|_| body());
    let samples = backend.take_profile();
    backend.set_profiling(false);
    ran?;
    Ok(Some(Profile { iterations, timed, kernels: aggregate(samples) }))
}

/// The launches `samples` summed per kernel (the same name and cost; a
/// name repeats across the plans of a workload), with their shares of
/// the GPU time where timed; the most time first, else in launch order.
fn aggregate(samples: Vec<lazuli_wgpu::LaunchSample>) -> Vec<KernelProfile> {
    let mut kernels: Vec<KernelProfile> = Vec::new();
    for s in samples {
        let c = s.cost;
        let same = |k: &&mut KernelProfile| {
            k.name == c.name && (k.flops, k.bytes, k.workgroups) == (c.flops, c.bytes, c.workgroups)
        };
        match kernels.iter_mut().find(|k| same(k)) {
            Some(k) => {
                k.launches += 1;
                k.ms = k.ms.zip(s.ms).map(|(a, b)| a + b);
            }
            None => kernels.push(KernelProfile {
                name: c.name,
                launches: 1,
                workgroups: c.workgroups,
                flops: c.flops,
                bytes: c.bytes,
                ms: s.ms,
                share: None,
            }),
        }
    }
    let all: Option<f64> = kernels.iter().map(|k| k.ms).sum();
    if let Some(all) = all {
        for k in &mut kernels {
            k.share = k.ms.map(|ms| if all > 0.0 { ms / all } else { 0.0 });
        }
        kernels.sort_by(|a, b| b.ms.unwrap_or(0.0).total_cmp(&a.ms.unwrap_or(0.0)));
    }
    kernels
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazuli_executor::LaunchCost;
    use lazuli_wgpu::LaunchSample;

    fn sample(name: &str, flops: u64, ms: Option<f64>) -> LaunchSample {
        LaunchSample { cost: LaunchCost { name: name.into(), flops, bytes: 4000, workgroups: 2 }, ms }
    }

    #[test]
    fn untimed_launches_keep_their_counts_in_launch_order() {
        let k = aggregate(vec![sample("k1", 10, None), sample("k0", 20, None), sample("k1", 10, None)]);
        let names: Vec<(&str, u64)> = k.iter().map(|k| (k.name.as_str(), k.launches)).collect();
        assert_eq!(names, [("k1", 2), ("k0", 1)]);
        assert!(k.iter().all(|k| k.ms.is_none() && k.share.is_none() && k.gbps().is_none() && k.tflops().is_none()));
        assert_eq!((k[0].flops, k[0].bytes, k[0].workgroups), (10, 4000, 2));
        assert!(k[0].to_json()["gbps"].is_null());
    }

    #[test]
    fn timed_launches_sum_per_kernel_with_shares_and_rates() {
        // The same name with another cost is another plan's kernel.
        let k = aggregate(vec![
            sample("k0", 1_000_000, Some(1.0)),
            sample("k1", 0, Some(2.0)),
            sample("k0", 1_000_000, Some(3.0)),
            sample("k0", 5, Some(4.0)),
        ]);
        let rows: Vec<(&str, u64, Option<f64>, Option<f64>)> =
            k.iter().map(|k| (k.name.as_str(), k.flops, k.ms, k.share)).collect();
        assert_eq!(
            rows,
            [("k0", 1_000_000, Some(4.0), Some(0.4)), ("k0", 5, Some(4.0), Some(0.4)), ("k1", 0, Some(2.0), Some(0.2))]
        );
        // 2 launches of 4000 bytes and 1e6 FLOPs in 4 ms.
        assert_eq!(k[0].gbps(), Some(8000.0 / 4e6));
        assert_eq!(k[0].tflops(), Some(2e6 / 4e9));
        assert_eq!(k[0].to_json()["launches"], 2);
    }
}
