//! Bounded autotuning of kernel forms. Where no static rule is sure to
//! pick the fastest form (matmul tile shapes: the best one depends on the
//! GPU's SM count, registers and driver), the backend times the candidate
//! forms of a kernel on the adapter itself the first time it sees the
//! kernel, and keeps the winner: in memory for the process and on disk
//! (`LAZULI_CACHE_DIR`) for the next one.
//!
//! Bounds: each kernel key gets at most [`KEY_BUDGET`] of timed runs (the
//! static choice is timed first, so a budget that runs out leaves a
//! measured answer), and the process spends at most [`PROCESS_BUDGET`] on
//! tuning in all, pipeline creation included; past it kernels keep their
//! static form. Tuning is on by default on GPUs and off on software
//! adapters (`LAZULI_AUTOTUNE=1` or `WgpuOptions::autotune` turns it on
//! anywhere; `LAZULI_AUTOTUNE=0` turns it off).
//!
//! The disk cache is one text file per format version, `autotune-v1.txt`,
//! a line per key (`<key hex> <form>`), appended with one write per line
//! so concurrent processes do not interleave partial lines. Lines that do
//! not parse (a truncated or corrupt file) are ignored with a warning;
//! keys cover the adapter (name, vendor, device, driver), the Lazuli
//! version and the kernel's source, so a stale entry can never apply to
//! another kernel or adapter.

use crate::codegen::{self, LowerLimits, MatmulForm, MatmulTile, Wgsl};
use crate::context::{dispatch_size, Context, READBACK, STORAGE};
use crate::pipeline::{PipelineEntry, Pipelines};
use crate::profile::read_timestamps;
use lazuli_executor::{metrics, BackendError};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::VerifiedGraph;
use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

/// Timed-run budget of one kernel key.
pub const KEY_BUDGET: Duration = Duration::from_millis(50);

/// Tuning budget of one process (pipeline creation included).
pub const PROCESS_BUDGET: Duration = Duration::from_secs(3);

/// Timed runs of each candidate (after one untimed warm-up run).
pub const RUNS: usize = 3;

/// File name of the on-disk cache.
pub const CACHE_FILE: &str = "autotune-v1.txt";

/// The tuner of one backend.
#[derive(Debug)]
pub struct Tuner {
    enabled: bool,
    /// What the keys are salted with: adapter identity and version.
    salt: String,
    file: Option<PathBuf>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    known: HashMap<u64, MatmulForm>,
    spent: Duration,
}

/// The default cache directory, when neither code nor `LAZULI_CACHE_DIR`
/// names one (see `WgpuOptions::resolve`): `$XDG_CACHE_HOME/lazuli`, else
/// `$HOME/.cache/lazuli`.
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("lazuli"))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("lazuli")))
}

/// Whether tuning is on: `option` if given (code, else `LAZULI_AUTOTUNE`,
/// resolved by `WgpuOptions::resolve`), else on for GPUs and off for
/// software adapters.
pub fn enabled(option: Option<bool>, software: bool) -> bool {
    option.unwrap_or(!software)
}

impl Tuner {
    /// A tuner for the adapter described by `adapter` (name, vendor,
    /// device, driver), caching on disk under `dir` if given.
    pub fn new(enabled: bool, adapter: &str, dir: Option<&Path>) -> Tuner {
        let salt = format!("{adapter} lazuli {}", env!("CARGO_PKG_VERSION"));
        let file = dir.map(|d| d.join(CACHE_FILE));
        let mut state = State::default();
        if enabled {
            if let Some(f) = &file {
                state.known = load(f);
            }
        }
        Tuner { enabled, salt, file, state: Mutex::new(state) }
    }

    /// Whether tuning is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The key of a kernel whose static-form source is `source`.
    pub fn key(&self, family: &str, source: &str) -> u64 {
        lazuli_ir::stable_hash(&(self.salt.as_str(), family, source))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered winner for `key` (counted as `AutotuneHits`).
    pub fn known(&self, key: u64) -> Option<MatmulForm> {
        let f = self.lock().known.get(&key).copied();
        if f.is_some() {
            metrics::inc("AutotuneHits", 1);
        }
        f
    }

    /// Whether the process budget has room for another key.
    pub fn budget_left(&self) -> bool {
        self.lock().spent < PROCESS_BUDGET
    }

    /// Records the winner of `key` after `spent` of tuning, in memory and
    /// on disk (a failed write is a warning: the cache is an optimization).
    pub fn record(&self, key: u64, form: MatmulForm, spent: Duration) {
        metrics::inc("AutotuneKeys", 1);
        {
            let mut st = self.lock();
            st.known.insert(key, form);
            st.spent += spent;
        }
        if let Some(f) = &self.file {
            if let Err(e) = append(f, key, form) {
                tracing::warn!("autotune cache {}: {e}", f.display());
            }
        }
    }

    /// Adds tuning time that found no winner (every candidate failed).
    pub fn spend(&self, spent: Duration) {
        self.lock().spent += spent;
    }
}

/// Kernel `k` of `graph` (named `name`) lowered in the form the tuner
/// picks where tuning applies (see [`tunable`]), else with `base`:
/// `lower` lowers it with given limits. A remembered winner is used as
/// it is; a new kernel has its candidate forms timed on the adapter, each
/// lowered once, and the fastest one's source is returned (so the kernel
/// is not lowered again to run).
pub(crate) fn lower_tuned(
    ctx: &Context,
    tuner: &Tuner,
    pipelines: &Pipelines,
    base: LowerLimits,
    (k, graph, name): (&Kernel, &VerifiedGraph, &str),
    lower: impl Fn(&LowerLimits) -> Result<Wgsl, BackendError>,
) -> Result<Wgsl, BackendError> {
    if !tunable(ctx, tuner, &base, k, graph) {
        return lower(&base);
    }
    let with = |form: MatmulForm| {
        let mut l = base;
        l.forms.matmul = form;
        l
    };
    // The key is the static form's source, so a remembered winner costs
    // a second lowering; a new kernel's winner is lowered once.
    let static_wgsl = lower(&base)?;
    let key = tuner.key("matmul", &static_wgsl.source);
    if let Some(form) = tuner.known(key) {
        return lower(&with(form));
    }
    if !tuner.budget_left() {
        return Ok(static_wgsl);
    }
    let start = std::time::Instant::now();
    let mut measuring = std::time::Duration::ZERO;
    let mut best: Option<(f64, MatmulForm, Option<Wgsl>)> = None;
    for form in codegen::matmul::candidates(k, graph) {
        if best.is_some() && measuring >= KEY_BUDGET {
            break;
        }
        let limits = with(form);
        if codegen::matmul::resolve_form(k, graph, &limits) != form {
            continue; // not available on this adapter (workgroup memory)
        }
        let wgsl = lower(&limits)?;
        let pipeline = pipelines.fixed(ctx, &format!("{name} tune {form:?}"), &wgsl)?;
        let t = std::time::Instant::now();
        let ms = time_kernel(ctx, k, graph, &wgsl, &pipeline);
        measuring += t.elapsed();
        metrics::inc("AutotuneRuns", 1);
        match ms {
            Ok(ms) => {
                tracing::debug!(kernel = name, ?form, ms, "autotune candidate");
                if best.as_ref().is_none_or(|(b, _, _)| ms < *b) {
                    best = Some((ms, form, Some(wgsl)));
                }
            }
            Err(e) => tracing::warn!(kernel = name, ?form, "autotune candidate failed: {e}"),
        }
    }
    match best {
        Some((_, form, wgsl)) => {
            tuner.record(key, form, start.elapsed());
            match wgsl {
                Some(w) => Ok(w),
                None => lower(&with(form)),
            }
        }
        None => {
            tuner.spend(start.elapsed());
            Ok(static_wgsl)
        }
    }
}

/// Whether kernel `k` is one the tuner times: a matmul whose form the
/// profile leaves to the shape, tuning on, and every tensor on
/// whole-buffer bindings (candidates are timed so; a kernel with windowed
/// tensors keeps the form its shape asks for).
fn tunable(ctx: &Context, tuner: &Tuner, base: &LowerLimits, k: &Kernel, graph: &VerifiedGraph) -> bool {
    k.kind == KernelKind::MatMul
        && tuner.enabled()
        && base.forms.matmul == MatmulForm::ByShape
        && k.inputs.iter().chain(&k.outputs).all(|id| ctx.windows.count(graph.node(*id).shape.numel() as u64) <= 1)
}

/// The GPU time in ms of one run of kernel `k` lowered as `wgsl`, on
/// scratch buffers (contents irrelevant to a matmul's speed): the fastest
/// of [`RUNS`] runs after a warm-up, from timestamp queries where the
/// adapter has them, else wall time to a device wait.
fn time_kernel(
    ctx: &Context,
    k: &Kernel,
    graph: &VerifiedGraph,
    wgsl: &Wgsl,
    pipeline: &PipelineEntry,
) -> Result<f64, BackendError> {
    let dev = &ctx.device;
    let uniform = ctx.uniform(&graph.scalars, None)?;
    let mut scratch = Vec::new();
    for &id in k.inputs.iter().chain(&k.outputs) {
        let bytes = (graph.node(id).shape.numel() as u64 * 4).max(4);
        scratch.push(ctx.pool.acquire(bytes, STORAGE)?);
    }
    let mut bufs = vec![uniform.buffer()];
    bufs.extend(scratch.iter().map(|b| b.buffer()));
    let bg = ctx.bind_group(&pipeline.layout, &bufs);
    let (x, y) = dispatch_size(wgsl.invocations, wgsl.workgroup_size);
    let runs = RUNS + 1;
    let dispatch = |pass: &mut wgpu::ComputePass| {
        pass.set_pipeline(&pipeline.pipeline);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(x, y, 1);
    };
    if !ctx.timestamps {
        let mut best = f64::INFINITY;
        for r in 0..runs {
            let t = std::time::Instant::now();
            let mut enc = dev.create_command_encoder(&Default::default());
            dispatch(&mut enc.begin_compute_pass(&Default::default()));
            ctx.queue.submit([enc.finish()]);
            ctx.wait()?;
            if r > 0 {
                best = best.min(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        return Ok(best);
    }
    let n = 2 * runs as u32;
    let set = dev.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("lazuli autotune"),
        ty: wgpu::QueryType::Timestamp,
        count: n,
    });
    let resolve = ctx.pool.acquire(n as u64 * 8, wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC)?;
    let read = ctx.pool.acquire(n as u64 * 8, READBACK)?;
    let mut enc = dev.create_command_encoder(&Default::default());
    for r in 0..runs as u32 {
        dispatch(&mut enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: &set,
                beginning_of_pass_write_index: Some(2 * r),
                end_of_pass_write_index: Some(2 * r + 1),
            }),
        }));
    }
    enc.resolve_query_set(&set, 0..n, resolve.buffer(), 0);
    enc.copy_buffer_to_buffer(resolve.buffer(), 0, read.buffer(), 0, n as u64 * 8);
    ctx.queue.submit([enc.finish()]);
    // Run 0 is the warm-up.
    Ok(read_timestamps(ctx, read.buffer(), runs)?.into_iter().skip(1).fold(f64::INFINITY, f64::min))
}

/// The text of a form in the cache file.
pub fn form_name(f: MatmulForm) -> String {
    match f {
        MatmulForm::RegisterBlocked => "rb".into(),
        MatmulForm::Tiled(t) => format!("t{}x{}", t.bm, t.bn),
        MatmulForm::ByShape => "shape".into(),
    }
}

/// Parses [`form_name`]'s text; tiles must be ones the generator writes.
pub fn parse_form(s: &str) -> Option<MatmulForm> {
    if s == "rb" {
        return Some(MatmulForm::RegisterBlocked);
    }
    let (bm, bn) = s.strip_prefix('t')?.split_once('x')?;
    let (bm, bn) = (bm.parse().ok()?, bn.parse().ok()?);
    let ok = |v: u32| v == 64 || v == 128;
    (ok(bm) && ok(bn)).then_some(MatmulForm::Tiled(MatmulTile { bm, bn }))
}

fn load(file: &Path) -> HashMap<u64, MatmulForm> {
    let Ok(bytes) = std::fs::read(file) else { return HashMap::new() };
    // Invalid UTF-8 (a corrupt file) only spoils the lines it is in.
    let text = String::from_utf8_lossy(&bytes);
    let mut known = HashMap::new();
    let mut bad = 0usize;
    for line in text.lines() {
        let parsed =
            line.split_once(' ').and_then(|(k, f)| Some((u64::from_str_radix(k, 16).ok()?, parse_form(f.trim())?)));
        match parsed {
            Some((k, f)) => {
                known.insert(k, f);
            }
            None if line.trim().is_empty() => {}
            None => bad += 1,
        }
    }
    if bad > 0 {
        tracing::warn!("autotune cache {}: ignored {bad} unreadable line(s)", file.display());
        metrics::inc("AutotuneCacheBadLines", bad as u64);
    }
    known
}

fn append(file: &Path, key: u64, form: MatmulForm) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(file)?;
    // One write per line: appends of this size are not interleaved.
    f.write_all(format!("{key:016x} {}\n", form_name(form)).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_round_trip_and_bad_lines_are_ignored() {
        for f in [
            MatmulForm::RegisterBlocked,
            MatmulForm::Tiled(MatmulTile { bm: 128, bn: 64 }),
            MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 }),
        ] {
            assert_eq!(parse_form(&form_name(f)), Some(f));
        }
        assert_eq!(parse_form("t96x64"), None);
        assert_eq!(parse_form("shape"), None);
        let dir = std::env::temp_dir().join(format!("lazuli-autotune-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let t = Tuner::new(true, "adapter", Some(&dir));
        t.record(7, MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 }), Duration::from_millis(1));
        // A corrupt tail (a truncated line, garbage) is skipped.
        let file = dir.join(CACHE_FILE);
        let mut text = std::fs::read_to_string(&file).unwrap();
        text.push_str("00000000000000ff t128\nnot a line\n");
        std::fs::write(&file, text).unwrap();
        let t2 = Tuner::new(true, "adapter", Some(&dir));
        assert_eq!(t2.known(7), Some(MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 })));
        assert_eq!(t2.known(0xff), None);
        assert_ne!(t2.key("matmul", "src"), Tuner::new(true, "other adapter", None).key("matmul", "src"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
