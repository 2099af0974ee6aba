//! Bounded autotuning of kernel forms. Where no static rule is sure to
//! pick the fastest form (matmul tile shapes: the best one depends on the
//! GPU's SM count, registers and driver), the backend times the candidate
//! forms of a kernel on the adapter itself and keeps the winner: in
//! memory for the process and on disk (`LAZULI_CACHE_DIR`) for the next
//! one, which never times that kernel again.
//!
//! Tuning pays for itself or does not happen, and no step waits for
//! the compiles it needs:
//! - only products of at least [`MIN_FLOPS`] are tuned
//!   (`WgpuOptions::autotune_min_flops`): a matmul that takes
//!   microseconds never is;
//! - never on the first execution's path: a compile only looks winners
//!   up (`lookup`); a kernel without one runs in the rule's form. At its
//!   plan's second execution (a plan run once, such as an odd evaluation
//!   batch, is never tuned) the candidate forms of the plan's waiting
//!   kernels start compiling on a thread of their own, their pipelines
//!   on threads of that job, not on the compile threads a step's compile
//!   uses (`Compiler::compile_candidates`); the steps go on meanwhile. At the first plan boundary after that compile
//!   finished, the candidates are timed when nothing else of the backend
//!   runs (`time_candidates`), one key after another within
//!   [`BOUNDARY_BUDGET`] (the keys left over are timed at the next
//!   boundaries), and each winner replaces its kernels there. So a step
//!   waits for timed runs only (a few milliseconds for the products of
//!   a GPT step), never for a pipeline;
//! - kernels of the same problem (a model's identical layers, whatever
//!   their epilogues) are one key: compiled and timed once. The key is
//!   the schedule's ([`Schedule::tuning_key`]: sizes, batch dims, dtypes,
//!   operand layouts and the profile, as Burn's and CubeCL's tune keys
//!   hold the problem), so a compile looks a winner up without lowering
//!   the kernel to learn its key, and the candidates are the schedule's
//!   alternatives ([`Schedule::candidate_forms`]).
//!
//! Bounds: each kernel key gets at most [`KEY_BUDGET`] of timed runs (the
//! static choice is timed first, so a budget that runs out leaves a
//! measured answer), and the process spends at most [`PROCESS_BUDGET`] on
//! tuning in all, pipeline creation included; past it kernels keep their
//! static form. Tuning is on by default on GPUs and off on software
//! adapters (`LAZULI_AUTOTUNE=1` or `WgpuOptions::autotune` turns it on
//! anywhere; `LAZULI_AUTOTUNE=0` turns it off).
//!
//! Winners persist in the compile cache ([`crate::diskcache`]), entries
//! of kind `autotune` holding the form's name ([`form_name`]): one
//! format, one directory, one size bound and eviction with the other
//! compile-cache entries. Keys cover the adapter (name, vendor, device,
//! driver), the Lazuli version, the key format ([`KEY_FORMAT`]: keys of
//! an earlier format never match) and the product's problem, and the disk
//! cache salts them again with the adapter, limits, forms and build, so a
//! stale entry can never apply to another kernel or adapter; an entry
//! whose payload does not parse is ignored with a warning
//! (`AutotuneCacheBad`).

use crate::codegen::{LowerLimits, MatmulForm, MatmulTile, Schedule, Wgsl};
use crate::compile::CompiledKernel;
use crate::context::{dispatch_size, Context, READBACK, STORAGE};
use crate::diskcache::DiskCache;
use crate::pipeline::PipelineEntry;
use crate::profile::read_timestamps;
use lazuli_executor::platform::Instant;
use lazuli_executor::{metrics, BackendError};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::VerifiedGraph;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Timed-run budget of one kernel key.
pub const KEY_BUDGET: Duration = Duration::from_millis(50);

/// Tuning budget of one process (pipeline creation included).
pub const PROCESS_BUDGET: Duration = Duration::from_secs(3);

/// Least work of a product the tuner times by default (a 1024³ matmul:
/// about 0.1 ms on a GPU at 20 TFLOP/s, so its candidates take about a
/// millisecond to time); smaller ones keep the rule's form.
pub const MIN_FLOPS: u64 = 2 << 30;

/// Timed runs measured at one plan boundary: keys are timed there one
/// after another until this is spent (at least one is), the rest at the
/// boundaries that follow.
pub const BOUNDARY_BUDGET: Duration = KEY_BUDGET;

/// Timed runs of each candidate (after one untimed warm-up run).
pub const RUNS: usize = 3;

/// The tuner of one backend.
#[derive(Debug)]
pub struct Tuner {
    enabled: bool,
    /// Least work (floating-point operations) of a product worth tuning.
    pub min_flops: u64,
    /// What the keys are salted with: adapter identity and version.
    salt: String,
    /// Where winners persist, if anywhere.
    disk: Option<Arc<DiskCache>>,
    state: Mutex<State>,
}

/// Kind of the autotuning entries in the disk cache.
const DISK_KIND: &str = "autotune";

/// The format of the tuner's keys, hashed into every key: keys of an
/// earlier format (which hashed a kernel's canonical source) never match
/// one of this format, so winners stored under them are ignored, never
/// applied to another product.
const KEY_FORMAT: &str = "matmul problem v2";

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
    /// device, driver), keeping its winners in `disk` if given.
    pub fn new(enabled: bool, adapter: &str, disk: Option<Arc<DiskCache>>) -> Tuner {
        let salt = format!("{adapter} lazuli {}", env!("CARGO_PKG_VERSION"));
        Tuner { enabled, min_flops: MIN_FLOPS, salt, disk, state: Mutex::new(State::default()) }
    }

    /// Whether tuning is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The key of a kernel whose schedule keys it as `problem` (see
    /// [`Schedule::tuning_key`]: the product's sizes, dtypes and operand
    /// layouts and the limits, as Burn's and CubeCL's tune keys hold the
    /// problem rather than the code), salted with the adapter and
    /// version: the same product in every layer of a model is one key,
    /// tuned once, whatever its epilogue.
    pub fn key(&self, problem: u64) -> u64 {
        lazuli_ir::stable_hash(&(self.salt.as_str(), KEY_FORMAT, problem))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The remembered winner for `key`, from memory or the disk cache
    /// (counted as `AutotuneHits`).
    pub fn known(&self, key: u64) -> Option<MatmulForm> {
        let mut f = self.lock().known.get(&key).copied();
        if f.is_none() {
            f = self.load(key);
            if let Some(form) = f {
                self.lock().known.insert(key, form);
            }
        }
        if f.is_some() {
            metrics::inc("AutotuneHits", 1);
        }
        f
    }

    /// The winner of `key` in the disk cache, if a readable one is there.
    fn load(&self, key: u64) -> Option<MatmulForm> {
        let data = self.disk.as_ref()?.get(DISK_KIND, &key.to_le_bytes())?;
        let form = std::str::from_utf8(&data).ok().and_then(parse_form);
        if form.is_none() {
            tracing::warn!(key = format_args!("{key:016x}"), "autotune cache: ignoring an unreadable winner");
            metrics::inc("AutotuneCacheBad", 1);
        }
        form
    }

    /// Whether the process budget has room for another key.
    pub fn budget_left(&self) -> bool {
        self.lock().spent < PROCESS_BUDGET
    }

    /// Records the winner of `key` after `spent` of tuning, in memory and
    /// in the disk cache (a failed write is a warning there: the cache is
    /// an optimization).
    pub fn record(&self, key: u64, form: MatmulForm, spent: Duration) {
        metrics::inc("AutotuneKeys", 1);
        {
            let mut st = self.lock();
            st.known.insert(key, form);
            st.spent += spent;
        }
        if let Some(d) = &self.disk {
            d.put(DISK_KIND, &key.to_le_bytes(), form_name(form).as_bytes());
        }
    }

    /// Adds tuning time that found no winner (every candidate failed).
    pub fn spend(&self, spent: Duration) {
        self.lock().spent += spent;
    }
}

/// What compiling a kernel learned from the tuner.
pub(crate) enum Tuning {
    /// Not a kernel the tuner times (see [`tunable`]).
    Untuned,
    /// A remembered winner (this process or an earlier one's).
    Known(MatmulForm),
    /// A tunable kernel with no winner yet: it runs in the rule's form,
    /// and is tuned before its plan's second execution.
    Pending,
}

/// Whether and how kernel `k` of `graph`, scheduled as `schedule` under
/// the compiler's own limits, is tuned: the key comes from the schedule's
/// problem, so nothing is lowered and nothing is timed here (a compile
/// never waits for measurements).
pub(crate) fn lookup(ctx: &Context, tuner: &Tuner, k: &Kernel, graph: &VerifiedGraph, schedule: &Schedule) -> Tuning {
    if !tunable(ctx, tuner, k, graph, schedule) {
        return Tuning::Untuned;
    }
    match schedule.tuning_key(k, graph).and_then(|problem| tuner.known(tuner.key(problem))) {
        Some(form) => Tuning::Known(form),
        None => Tuning::Pending,
    }
}

/// Where the kernels of an executable that wait for the tuner stand
/// (see [`crate::compile::Compiler::tune_at_boundary`]).
#[derive(Default)]
pub(crate) enum Waiting {
    /// No candidates compiled or compiling.
    #[default]
    Idle,
    /// Their candidates are being compiled, off the steps' path.
    Compiling,
    /// Compiled, to be timed at the plan boundaries that follow.
    Ready(VecDeque<KeyCandidates>),
    /// Tuning was given up for this executable (the process budget is
    /// spent, or its candidates could not be compiled): its kernels keep
    /// the rule's forms.
    Abandoned,
}

/// One tuning key's candidates in one executable, compiled.
pub(crate) struct KeyCandidates {
    /// The key (see [`Tuner::key`]).
    pub key: u64,
    /// The form the rule gives the key's kernels (the one they run until
    /// a winner replaces it).
    pub rule: MatmulForm,
    /// The executable's kernels (indices) with this key: the same static
    /// source, so one measurement decides them all.
    pub kernels: Vec<usize>,
    /// Each candidate form with its compiled kernel for each of
    /// `kernels`, the rule's choice first; where the winner was known
    /// by the time the candidates were compiled (another executable or
    /// process tuned the key), that form alone.
    pub forms: Vec<(MatmulForm, Vec<CompiledKernel>)>,
    /// Whether `forms` is a known winner (nothing to time).
    pub known: bool,
}

/// The kernels of an executable whose candidates are to be compiled,
/// handed to the compiling thread; [`TuneJob::finish`] hands them back
/// (dropped unfinished, it gives tuning up for the executable).
pub(crate) struct TuneJob {
    /// The executable's graph.
    pub graph: VerifiedGraph,
    /// Each waiting kernel: its index in the plan, its kernel and name.
    pub kernels: Vec<(usize, Kernel, String)>,
    waiting: Arc<Mutex<Waiting>>,
}

impl TuneJob {
    /// The job for `kernels` of `graph`, whose executable's state is
    /// `waiting` (set to [`Waiting::Compiling`] here).
    pub fn new(graph: VerifiedGraph, kernels: Vec<(usize, Kernel, String)>, waiting: Arc<Mutex<Waiting>>) -> TuneJob {
        *lock(&waiting) = Waiting::Compiling;
        TuneJob { graph, kernels, waiting }
    }

    /// Hands the compiled candidates to the executable (timed at its next
    /// boundaries); a failure gives tuning up for it, with a warning.
    /// `Ok(None)`: cancelled (the backend is going away).
    pub fn finish(&self, compiled: Result<Option<VecDeque<KeyCandidates>>, BackendError>) {
        *lock(&self.waiting) = match compiled {
            Ok(Some(ready)) => Waiting::Ready(ready),
            Ok(None) => Waiting::Abandoned,
            Err(e) => {
                tracing::warn!("compiling autotune candidates failed, the kernels keep their forms: {e}");
                Waiting::Abandoned
            }
        };
    }
}

impl Drop for TuneJob {
    /// A compile that never finished (its thread did not start, or
    /// panicked) gives tuning up for the executable.
    fn drop(&mut self) {
        let mut waiting = lock(&self.waiting);
        if matches!(*waiting, Waiting::Compiling) {
            *waiting = Waiting::Abandoned;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The candidate forms of matmul kernel `k` of `graph` the adapter can
/// run, the rule's choice first: the alternatives of its schedule
/// `base` (each form the schedule keeps as it is when forced; one that
/// needs more workgroup memory than the adapter has is no candidate).
pub(crate) fn candidate_forms(k: &Kernel, graph: &VerifiedGraph, base: &Schedule) -> Vec<MatmulForm> {
    base.candidate_forms(k, graph)
}

/// Times `c`'s candidate forms of kernel `k` of `graph` (named `name`)
/// one after another, the rule's choice first, within [`KEY_BUDGET`] of
/// timed runs (a candidate whose runs would not fit, judged by the best
/// time so far, is not started), and records the winner in the tuner
/// (memory and disk);
/// returns its index in `c.forms`, `None` when every candidate failed.
/// Called at a plan boundary, when nothing else of the backend runs
/// (the caller settles the execution in flight first).
pub(crate) fn time_candidates(
    ctx: &Context,
    tuner: &Tuner,
    (k, graph, name): (&Kernel, &VerifiedGraph, &str),
    c: &KeyCandidates,
) -> Option<usize> {
    let start = Instant::now();
    let mut best: Option<(f64, usize)> = None;
    // The rule's choice is the first candidate: what tuning buys is
    // measured against it.
    let mut rule_ms = None;
    for (i, (form, compiled)) in c.forms.iter().enumerate() {
        // The next candidate's runs, at about the best one's speed, must
        // fit in what is left of the budget (a product that takes long
        // on this adapter keeps the rule's form rather than overrun it).
        if let Some((ms, _)) = best {
            let next = Duration::from_secs_f64((RUNS + 1) as f64 * ms * 1e-3);
            if start.elapsed() + next >= KEY_BUDGET {
                break;
            }
        }
        let ms = time_kernel(ctx, k, graph, &compiled[0].wgsl, &compiled[0].pipeline);
        metrics::inc("AutotuneRuns", 1);
        match ms {
            Ok(ms) => {
                tracing::debug!(kernel = name, ?form, ms, "autotune candidate");
                if i == 0 {
                    rule_ms = Some(ms);
                }
                if best.is_none_or(|(b, _)| ms < b) {
                    best = Some((ms, i));
                }
            }
            Err(e) => tracing::warn!(kernel = name, ?form, "autotune candidate failed: {e}"),
        }
    }
    metrics::record_time("Autotune", start.elapsed());
    match best {
        Some((ms, i)) => {
            let form = c.forms[i].0;
            tuner.record(c.key, form, start.elapsed());
            if let Some(rule) = rule_ms {
                metrics::note(format!(
                    "autotuned {name}: {} at {ms:.3} ms against the rule's choice at {rule:.3} ms, after {:.1} ms of timing",
                    form_name(form),
                    start.elapsed().as_secs_f64() * 1e3
                ));
            }
            Some(i)
        }
        None => {
            tuner.spend(start.elapsed());
            None
        }
    }
}

/// `base` with the matmul form `form`.
pub(crate) fn with_form(base: LowerLimits, form: MatmulForm) -> LowerLimits {
    let mut l = base;
    l.forms.matmul = form;
    l
}

/// Whether kernel `k`, scheduled as `schedule`, is one the tuner times: a
/// matmul whose form the profile leaves to the shape, tuning on, at least
/// the tuner's minimum work ([`Tuner::min_flops`]: a product that takes
/// microseconds is never worth tuning), and every tensor on whole-buffer
/// bindings (candidates are timed so; a kernel with windowed tensors
/// keeps the form its shape asks for). A kernel the rule splits over K
/// keeps its split: the tuner times one pass, and a split kernel has two;
/// a tensor-core kernel (`MatmulForm::Cooperative`) has no f32-compute
/// rival worth timing.
fn tunable(ctx: &Context, tuner: &Tuner, k: &Kernel, graph: &VerifiedGraph, schedule: &Schedule) -> bool {
    k.kind == KernelKind::MatMul
        && tuner.enabled()
        && schedule.limits.forms.matmul == MatmulForm::ByShape
        && !matches!(schedule.matmul_form(), Some(MatmulForm::SplitK { .. } | MatmulForm::Cooperative(_)))
        && matmul_flops(k, graph) >= tuner.min_flops
        && k.inputs.iter().chain(&k.outputs).all(|id| ctx.windows.count(graph.node(*id).shape.numel() as u64) <= 1)
}

/// Floating-point operations of the product a matmul kernel computes,
/// by the cost model (`2 * M * N * K`, see [`crate::cost`]).
fn matmul_flops(k: &Kernel, graph: &VerifiedGraph) -> u64 {
    k.matmul_node(graph).map_or(0, |id| crate::cost::node_flops(graph, id))
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
    let scalars: Vec<_> = wgsl.scalars.iter().map(|&i| graph.scalars[i]).collect();
    let uniform = ctx.uniform(&scalars, None)?;
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
            let t = Instant::now();
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
        MatmulForm::SplitK { tile, parts } => format!("s{}x{}k{parts}", tile.bm, tile.bn),
        MatmulForm::Cooperative(t) => format!("c{}x{}", t.bm(), t.bn()),
        MatmulForm::ByShape => "shape".into(),
    }
}

/// Parses [`form_name`]'s text; tiles must be ones the generator writes.
pub fn parse_form(s: &str) -> Option<MatmulForm> {
    if s == "rb" {
        return Some(MatmulForm::RegisterBlocked);
    }
    let ok = |v: u32| v == 64 || v == 128;
    if let Some(rest) = s.strip_prefix('s') {
        let (bm, rest) = rest.split_once('x')?;
        let (bn, parts) = rest.split_once('k')?;
        let (bm, bn, parts) = (bm.parse().ok()?, bn.parse().ok()?, parts.parse().ok()?);
        return (ok(bm) && ok(bn) && parts > 1).then_some(MatmulForm::SplitK { tile: MatmulTile { bm, bn }, parts });
    }
    let (bm, bn) = s.strip_prefix('t')?.split_once('x')?;
    let (bm, bn) = (bm.parse().ok()?, bn.parse().ok()?);
    (ok(bm) && ok(bn)).then_some(MatmulForm::Tiled(MatmulTile { bm, bn }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms_round_trip_and_winners_persist_in_the_disk_cache() {
        for f in [
            MatmulForm::RegisterBlocked,
            MatmulForm::Tiled(MatmulTile { bm: 128, bn: 64 }),
            MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 }),
            MatmulForm::SplitK { tile: MatmulTile { bm: 64, bn: 64 }, parts: 17 },
        ] {
            assert_eq!(parse_form(&form_name(f)), Some(f));
        }
        assert_eq!(parse_form("t96x64"), None);
        assert_eq!(parse_form("shape"), None);
        let dir = std::env::temp_dir().join(format!("lazuli-autotune-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let disk = || DiskCache::open(Some(&dir), "adapter", None).map(Arc::new);
        let t = Tuner::new(true, "adapter", disk());
        t.record(7, MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 }), Duration::from_millis(1));
        // A payload that is no form (written by something else) is skipped.
        disk().unwrap().put(DISK_KIND, &0xffu64.to_le_bytes(), b"t128");
        let t2 = Tuner::new(true, "adapter", disk());
        assert_eq!(t2.known(7), Some(MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 })));
        let bad = metrics::counter("AutotuneCacheBad");
        assert_eq!(t2.known(0xff), None);
        assert_eq!(metrics::counter("AutotuneCacheBad"), bad + 1);
        assert_eq!(Tuner::new(true, "adapter", None).known(7), None, "no disk: nothing remembered");
        assert_ne!(t2.key(1), Tuner::new(true, "other adapter", None).key(1));
        assert_ne!(t2.key(1), t2.key(2));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
