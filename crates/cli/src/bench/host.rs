//! H1: what the host spends per recorded op, split by phase, on W5's chain
//! (`x = x * 1.0001 + 0.0001` a hundred times over f32 [1024]: 200 ops,
//! each with its lifted scalar), beside what the device spends.
//!
//! Phases of one iteration, each a row with its median and its cost per op:
//! recording the 200 ops; the sync split into tracing (copying the pending
//! nodes into an arena graph), hashing with the compile-cache lookup (a hit
//! after the warm-up) and submitting (placeholders, the job to the worker);
//! host total (record + sync: the "cached op end to end"); and the
//! device wait. The split comes from the executor's `Trace`, `Lookup` and
//! `Submit` timers.

use super::{w5_input, BenchConfig, BenchDevice, BenchResult};
use lazuli::platform::Instant;
use lazuli::{metrics, Result};
use std::time::Duration;

/// Ops recorded per H1 iteration (100 multiplies and 100 adds).
pub const HOST_OPS: usize = 200;

/// Runs H1 on `bd`: one row per phase ("H1 record", "H1 trace", "H1 hash +
/// cache hit", "H1 submit", "H1 host total", "H1 device wait"), each
/// noting its µs per op.
pub fn host_split(bd: &BenchDevice, cfg: &BenchConfig) -> Result<Vec<BenchResult>> {
    let dev = &bd.device;
    let x = w5_input(dev)?;
    let timer = |name: &str| metrics::timer(name).map_or(0.0, |s| s.sum);
    const PHASES: [&str; 6] =
        ["H1 record", "H1 trace", "H1 hash + cache hit", "H1 submit", "H1 host total", "H1 device wait"];
    let mut times: [Vec<Duration>; 6] = Default::default();
    for i in 0..cfg.warmup + cfg.iterations.max(1) {
        let (trace0, lookup0, submit0) = (timer("Trace"), timer("Lookup"), timer("Submit"));
        let started = Instant::now();
        let mut y = x.clone();
        for _ in 0..HOST_OPS / 2 {
            y = y.mul_scalar(1.0001)?.add_scalar(0.0001)?;
        }
        let recorded = Instant::now();
        y.sync()?;
        let synced = Instant::now();
        dev.wait()?;
        let waited = Instant::now();
        if i < cfg.warmup {
            continue;
        }
        let ms = |v: f64| Duration::from_secs_f64((v * 1e-3).max(0.0));
        let phase = [
            recorded - started,
            ms(timer("Trace") - trace0),
            ms(timer("Lookup") - lookup0),
            ms(timer("Submit") - submit0),
            synced - started,
            waited - synced,
        ];
        for (v, t) in times.iter_mut().zip(phase) {
            v.push(t);
        }
    }
    Ok(PHASES
        .iter()
        .zip(&times)
        .map(|(name, t)| {
            let mut r = BenchResult::from_times(name, bd.label, t);
            r.note = Some(format!("{:.3} µs per op", r.median_ms * 1e3 / HOST_OPS as f64));
            r
        })
        .collect())
}
