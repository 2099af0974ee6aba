//! Reading a timeline back: the steady state of a `LAZULI_TRACE` file in
//! numbers, so that one run on a lent GPU says where a step's wall time
//! goes without opening the trace in a viewer (`lazuli trace FILE`).
//!
//! The steady state is the loop the program means: the stretch of
//! executions (`Execute` spans) where one step repeats, with no compile
//! (`Compile` span) in it, that covers the most wall time. A step is one
//! execution or up to 16 in a row (a training step that syncs its loss
//! and then its update; a loop that checkpoints every tenth step), and
//! two executions are the same step where they launch the same kernels
//! on the CPU backend's kernel track (elsewhere the same host spans
//! inside them: GPU kernels run after their execution returns and drift
//! into the next one's stretch where executions overlap). So a
//! program that loads weights, warms up and then runs its inference loop
//! gets the inference loop, not the load's executions nor the warm-up;
//! a training loop wins over a cheaper evaluation loop after it even
//! with fewer executions. A checkpoint further apart than 16 executions
//! splits the loop: the longest stretch between two checkpoints is
//! chosen. The summary lists what the window leaves out (executions
//! before and after it, the other loops); where no step repeats (a
//! single long step) it says so and summarizes the longest run of
//! executions without a compile. The window runs from the first
//! execution's start to the later of the last one's end and the end of
//! the last kernel that starts inside the window (an execution returns before its kernels
//! finish where executions overlap). In it:
//! - wall time, summed kernel time (the GPU track) and their ratio, the
//!   time the GPU track is busy (the union of its intervals) and idle;
//! - per host thread and span name: count, total and median;
//! - the kernels by total time;
//! - the longest stretches where the GPU track is idle, each with the
//!   host spans over it (what the host was doing while the GPU waited);
//! - per thread that records, its own work: its `Record` spans (the time
//!   between syncs) less the reads and waits inside them, per
//!   execution, which bounds a loop's step from below however fast the
//!   GPU is.
//!
//! And over the whole trace, for a first run: each compile's wall time
//! and the longest pipeline creations, with the kernel each was for (a
//! compile's wall time is its slowest pipeline where the pipelines are
//! created in parallel).

use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

/// Time spent under one name: how often, in total and the median, in µs.
#[derive(Clone, Debug, PartialEq)]
pub struct Spent {
    /// The span's or kernel's name.
    pub name: String,
    /// How many there are in the window.
    pub count: usize,
    /// Their summed duration, µs.
    pub total_us: f64,
    /// Their median duration, µs.
    pub median_us: f64,
}

/// A stretch of the steady window where the GPU track is idle.
#[derive(Clone, Debug, PartialEq)]
pub struct IdleGap {
    /// Where it starts, µs of the trace.
    pub start_us: f64,
    /// How long it is, µs.
    pub dur_us: f64,
    /// The host spans over it, as ("thread: span", µs of overlap), most
    /// overlap first.
    pub host: Vec<(String, f64)>,
}

/// A loop in the timeline: consecutive executions that repeat one step
/// (a step is one execution or a few, `period`, that a loop's body
/// syncs; two executions are the same step where they launch the same
/// kernels, or without a kernel track the same host spans).
#[derive(Clone, Debug, PartialEq)]
pub struct Loop {
    /// Where its first execution starts, µs of the trace.
    pub start_us: f64,
    /// Where its last execution ends, µs of the trace.
    pub end_us: f64,
    /// How many times the step repeats.
    pub repetitions: usize,
    /// Executions per step.
    pub period: usize,
    /// The kernels (or host spans) one step launches, sorted by name.
    pub step: Vec<String>,
    /// Whether `step` holds kernels (the CPU kernel track), else host spans.
    pub step_is_kernels: bool,
}

impl Loop {
    /// "N repetitions of a step of P executions (K kernels: a, b, c, ...)".
    pub fn what(&self) -> String {
        let shown: Vec<&str> = self.step.iter().take(3).map(String::as_str).collect();
        let more = if self.step.len() > shown.len() { ", ..." } else { "" };
        format!(
            "{} repetitions of a step of {} execution{} ({} {}: {}{more})",
            self.repetitions,
            self.period,
            if self.period == 1 { "" } else { "s" },
            self.step.len(),
            if self.step_is_kernels { "kernels" } else { "host spans" },
            shown.join(", ")
        )
    }
}

/// What the steady window leaves out of a trace's executions.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Skipped {
    /// Executions before the window (loading, warm-up, earlier loops).
    pub before: usize,
    /// Where the first execution before the window starts, µs.
    pub before_from_us: f64,
    /// Executions after the window (an evaluation, later loops).
    pub after: usize,
    /// Executions that overlap a compile (in no loop).
    pub compiling: usize,
    /// The other loops among them, most wall time first.
    pub loops: Vec<Loop>,
}

/// The steady window's executions as (start, end) µs, the loop it is
/// (`None` where no step repeats) and what it leaves out.
struct Steady {
    executions: Vec<(f64, f64)>,
    chosen: Option<Loop>,
    skipped: Skipped,
}

/// The longest step a loop is looked for with, in executions (a
/// training step that syncs its loss, then its update, is two; a loop
/// with a checkpoint every ten steps, ten).
const MAX_PERIOD: usize = 16;
/// Other loops listed.
const OTHER_LOOPS: usize = 3;

/// One stored `X` event: (name, track, start µs, duration µs).
type Event = (String, u64, f64, f64);

/// Chooses the steady state among the executions (`Execute` spans) of
/// `spans`: of every stretch where a step (one execution or up to
/// [`MAX_PERIOD`] in a row) repeats at least twice, with no compile in
/// it, the one that covers the most wall time (on a tie, the shorter
/// step, then the later stretch). That is the loop that dominates the
/// run, not a warm-up, the load's first executions or a shorter
/// evaluation loop after it; a loop with a periodic checkpoint is one
/// loop whose step includes the checkpoint. Where no step repeats (a
/// single long step), the window is the longest run of executions
/// without a compile and `chosen` is `None`.
fn steady_state(spans: &[Event], compiles: &[(f64, f64)], is_kernel: impl Fn(u64) -> bool) -> Steady {
    let mut all: Vec<&Event> = spans.iter().filter(|s| !is_kernel(s.1) && s.0 == "Execute").collect();
    all.sort_by(|a, b| a.2.total_cmp(&b.2));
    // Each execution's step: on the CPU backend's kernel track, the
    // kernels that run in it (they run inside the `Execute` span); on the
    // GPU track, whose kernels run after their execution returns and
    // drift into the next ones' where executions overlap, or without a
    // kernel track, the host spans inside it, less those that depend on
    // the buffer pool's state or on waiting (a set: a step that encodes
    // one more pass is still told apart by its kernels on the CPU).
    let starts: Vec<f64> = all.iter().map(|e| e.2).collect();
    let mut steps: Vec<std::collections::BTreeSet<&str>> = vec![Default::default(); all.len()];
    let cpu_kernels = spans.iter().any(|s| s.1 == crate::timeline::CPU_TRACK);
    let incidental = |name: &str| name.starts_with("Pool") || name.contains("Wait") || name == "Allocate";
    for s in spans {
        let at = starts.partition_point(|&t| t <= s.2);
        if at == 0 {
            continue;
        }
        let e = all[at - 1];
        let inside = !is_kernel(s.1) && s.1 == e.1 && s.2 + s.3 <= e.2 + e.3 && !std::ptr::eq(s, e);
        let counts = if cpu_kernels { s.1 == crate::timeline::CPU_TRACK } else { inside && !incidental(&s.0) };
        if counts {
            steps[at - 1].insert(s.0.as_str());
        }
    }
    let mut ids: BTreeMap<&std::collections::BTreeSet<&str>, usize> = BTreeMap::new();
    // (start, end, the run between compiles, the step's id, its index in `all`)
    let mut execs: Vec<(f64, f64, usize, usize, usize)> = Vec::new();
    let mut compiling = 0;
    for (i, e) in all.iter().enumerate() {
        // An execution that overlaps a compile belongs to no run.
        if compiles.iter().any(|c| e.2 < c.1 && c.0 < e.2 + e.3) {
            compiling += 1;
            continue;
        }
        let next = ids.len();
        let id = *ids.entry(&steps[i]).or_insert(next);
        execs.push((e.2, e.2 + e.3, compiles.iter().filter(|c| c.1 <= e.2).count(), id, i));
    }
    let n = execs.len();
    let wall = |from: usize, to: usize| execs[from..to].iter().map(|e| e.1).fold(f64::MIN, f64::max) - execs[from].0;
    // Every maximal stretch where execution k is the same step as k - p,
    // in one run between compiles, as (from, to, p), trimmed to whole
    // repetitions.
    let mut loops: Vec<(usize, usize, usize)> = Vec::new();
    for p in 1..=MAX_PERIOD.min(n / 2) {
        let same = |k: usize| k >= p && execs[k].2 == execs[k - p].2 && execs[k].3 == execs[k - p].3;
        let mut k = p;
        while k < n {
            if !same(k) {
                k += 1;
                continue;
            }
            let a = k;
            while k < n && same(k) {
                k += 1;
            }
            let (from, len) = (a - p, k - a + p);
            if len >= 2 * p {
                loops.push((from, from + len / p * p, p));
            }
        }
    }
    loops.sort_by(|x, y| wall(y.0, y.1).total_cmp(&wall(x.0, x.1)).then(x.2.cmp(&y.2)).then(y.0.cmp(&x.0)));
    let describe = |(from, to, p): (usize, usize, usize)| {
        let mut step: Vec<String> =
            (from..from + p).flat_map(|k| steps[execs[k].4].iter().map(|s| s.to_string())).collect();
        step.sort();
        step.dedup();
        Loop {
            start_us: execs[from].0,
            end_us: execs[from].0 + wall(from, to),
            repetitions: (to - from) / p,
            period: p,
            step,
            step_is_kernels: cpu_kernels,
        }
    };
    let (from, to, chosen) = match loops.first() {
        Some(&l) => (l.0, l.1, Some(describe(l))),
        None => {
            // The longest run without a compile (the later one of a tie).
            let mut best = (0, 0);
            let mut k = 0;
            while k < n {
                let a = k;
                while k < n && execs[k].2 == execs[a].2 {
                    k += 1;
                }
                if k - a >= best.1 - best.0 {
                    best = (a, k);
                }
            }
            (best.0, best.1, None)
        }
    };
    // The other loops, most wall time first, each clear of the chosen
    // one and of those listed before it.
    let mut others: Vec<(usize, usize, usize)> = Vec::new();
    for &l in &loops {
        if others.len() < OTHER_LOOPS && [(from, to, 0)].iter().chain(&others).all(|o| l.1 <= o.0 || o.1 <= l.0) {
            others.push(l);
        }
    }
    let skipped = Skipped {
        before: from,
        before_from_us: execs.first().map_or(0.0, |e| e.0),
        after: n - to,
        compiling,
        loops: others.into_iter().map(describe).collect(),
    };
    Steady { executions: execs[from..to].iter().map(|e| (e.0, e.1)).collect(), chosen, skipped }
}

/// The steady state of one trace (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSummary {
    /// Where the steady window starts, in µs of the trace.
    pub start_us: f64,
    /// Where it ends, in µs of the trace.
    pub end_us: f64,
    /// Compiles in the trace (else the window is all its executions).
    pub compiles: usize,
    /// Executions that start in the window.
    pub executions: usize,
    /// The loop the window is: the repeated step that covers the most
    /// wall time; `None` where no step repeats in the trace (then the
    /// window is the longest run of executions without a compile).
    pub steady_loop: Option<Loop>,
    /// The executions the window leaves out, and the other loops.
    pub skipped: Skipped,
    /// Kernels that start in the window.
    pub kernels: usize,
    /// Their summed time, µs.
    pub kernel_us: f64,
    /// Time the GPU track is busy in the window (overlaps counted once).
    pub gpu_busy_us: f64,
    /// Host spans in the window, per thread name, by total time.
    pub host: Vec<(String, Vec<Spent>)>,
    /// Per thread that records (has `Record` spans in the window), its
    /// own work in µs: the `Record` spans less the `Readback`,
    /// `BarrierWait` and `DeviceWait` spans inside them.
    pub host_work: Vec<(String, f64)>,
    /// Kernels in the window by total time.
    pub top_kernels: Vec<Spent>,
    /// The longest idle stretches of the GPU track in the window (from
    /// the window's start to its first kernel, and between kernels).
    pub idle_gaps: Vec<IdleGap>,
    /// Each compile in the whole trace, as (start, duration) in µs.
    pub compile_spans: Vec<(f64, f64)>,
    /// The longest pipeline creations in the whole trace, as (the kernel,
    /// µs), longest first.
    pub slowest_pipelines: Vec<(String, f64)>,
}

/// Idle stretches listed, and host spans per stretch.
const GAPS: usize = 5;
const SPANS_PER_GAP: usize = 4;
/// Pipeline creations listed.
const PIPELINES: usize = 8;

impl TraceSummary {
    /// Wall time of the window, µs.
    pub fn wall_us(&self) -> f64 {
        self.end_us - self.start_us
    }

    /// Wall time over summed kernel time (`None` without kernels).
    pub fn wall_per_kernel(&self) -> Option<f64> {
        (self.kernel_us > 0.0).then(|| self.wall_us() / self.kernel_us)
    }

    /// Summarizes a Chrome trace as [`crate::timeline`] writes it;
    /// `top` kernels are listed. An error names what the document lacks.
    pub fn of(doc: &Value, top: usize) -> Result<TraceSummary, String> {
        let events = doc["traceEvents"].as_array().ok_or("no traceEvents array: not a Chrome trace")?;
        let mut threads: BTreeMap<u64, String> = BTreeMap::new();
        let mut spans = Vec::new();
        let mut pipelines: Vec<(String, f64)> = Vec::new();
        for e in events {
            let tid = e["tid"].as_u64().unwrap_or(0);
            match e["ph"].as_str() {
                Some("M") if e["name"] == "thread_name" => {
                    threads.insert(tid, e["args"]["name"].as_str().unwrap_or("thread").to_string());
                }
                Some("X") => {
                    let (Some(ts), Some(dur)) = (e["ts"].as_f64(), e["dur"].as_f64()) else { continue };
                    let name = e["name"].as_str().unwrap_or("");
                    if name == "CompilePipeline" {
                        pipelines.push((e["args"]["what"].as_str().unwrap_or("?").to_string(), dur));
                    }
                    spans.push((name.to_string(), tid, ts, dur));
                }
                _ => {}
            }
        }
        // Kernels: the GPU track, or on the CPU backend its kernel track.
        let is_kernel = |tid: u64| tid == crate::timeline::GPU_TRACK || tid == crate::timeline::CPU_TRACK;
        let is_host = |tid: u64| !is_kernel(tid);
        let mut compiles: Vec<(f64, f64)> =
            spans.iter().filter(|s| is_host(s.1) && s.0 == "Compile").map(|s| (s.2, s.2 + s.3)).collect();
        compiles.sort_by(|a, b| a.0.total_cmp(&b.0));
        let steady = steady_state(&spans, &compiles, is_kernel);
        let (Some(first), Some(last)) =
            (steady.executions.first().map(|s| s.0), steady.executions.iter().map(|s| s.1).reduce(f64::max))
        else {
            return Err("no execution in the trace".into());
        };
        let mut kernels: Vec<_> = spans.iter().filter(|s| is_kernel(s.1) && s.2 >= first && s.2 <= last).collect();
        let end = kernels.iter().map(|k| k.2 + k.3).fold(last, f64::max);
        kernels.sort_by(|a, b| a.2.total_cmp(&b.2));
        // The union of the kernels' intervals, and the stretches between.
        let mut busy = 0.0;
        let mut reach = first;
        let mut gaps: Vec<(f64, f64)> = Vec::new();
        for k in &kernels {
            if k.2 > reach {
                gaps.push((reach, k.2));
            }
            let (a, b) = (k.2.max(reach), k.2 + k.3);
            if b > a {
                busy += b - a;
            }
            reach = reach.max(b);
        }
        gaps.sort_by(|x, y| (y.1 - y.0).total_cmp(&(x.1 - x.0)));
        gaps.truncate(GAPS);
        let thread_name = |tid: u64| threads.get(&tid).cloned().unwrap_or_else(|| format!("track {tid}"));
        let idle_gaps = gaps
            .into_iter()
            .filter(|_| !kernels.is_empty())
            .map(|(a, b)| {
                let mut over: BTreeMap<String, f64> = BTreeMap::new();
                for sp in spans.iter().filter(|sp| is_host(sp.1)) {
                    let o = (b.min(sp.2 + sp.3) - a.max(sp.2)).max(0.0);
                    if o > 0.0 {
                        *over.entry(format!("{}: {}", thread_name(sp.1), sp.0)).or_default() += o;
                    }
                }
                let mut host: Vec<(String, f64)> = over.into_iter().collect();
                host.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
                host.truncate(SPANS_PER_GAP);
                IdleGap { start_us: a, dur_us: b - a, host }
            })
            .collect();
        let spent = |items: Vec<(&str, f64)>| -> Vec<Spent> {
            let mut by: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
            for (name, d) in items {
                by.entry(name).or_default().push(d);
            }
            let mut out: Vec<Spent> = by
                .into_iter()
                .map(|(name, mut ds)| {
                    ds.sort_by(f64::total_cmp);
                    Spent {
                        name: name.to_string(),
                        count: ds.len(),
                        total_us: ds.iter().sum(),
                        median_us: ds[ds.len() / 2],
                    }
                })
                .collect();
            out.sort_by(|a, b| b.total_us.total_cmp(&a.total_us).then(a.name.cmp(&b.name)));
            out
        };
        let mut host = Vec::new();
        let mut host_work = Vec::new();
        for (&tid, name) in threads.iter().filter(|(t, _)| is_host(**t)) {
            let mine: Vec<_> = spans.iter().filter(|s| s.1 == tid && s.2 >= first && s.2 <= end).collect();
            let items: Vec<(&str, f64)> = mine.iter().map(|s| (s.0.as_str(), s.3)).collect();
            if !items.is_empty() {
                host.push((format!("{name} (track {tid})"), spent(items)));
            }
            // A thread's Record spans do not overlap: sorted by start, the
            // one a wait may lie in is the last that starts at or before it.
            let mut records: Vec<_> = mine.iter().filter(|s| s.0 == "Record").collect();
            records.sort_by(|a, b| a.2.total_cmp(&b.2));
            if !records.is_empty() {
                let inside = |w: &&&(String, u64, f64, f64)| {
                    let at = records.partition_point(|r| r.2 <= w.2);
                    at > 0 && w.2 + w.3 <= records[at - 1].2 + records[at - 1].3
                };
                let waiting: f64 = mine
                    .iter()
                    .filter(|w| matches!(w.0.as_str(), "Readback" | "BarrierWait" | "DeviceWait"))
                    .filter(inside)
                    .map(|w| w.3)
                    .sum();
                let recorded: f64 = records.iter().map(|r| r.3).sum();
                host_work.push((format!("{name} (track {tid})"), (recorded - waiting).max(0.0)));
            }
        }
        let mut top_kernels = spent(kernels.iter().map(|k| (k.0.as_str(), k.3)).collect());
        top_kernels.truncate(top);
        pipelines.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        pipelines.truncate(PIPELINES);
        Ok(TraceSummary {
            start_us: first,
            end_us: end,
            compiles: compiles.len(),
            executions: steady.executions.len(),
            steady_loop: steady.chosen,
            skipped: steady.skipped,
            kernels: kernels.len(),
            kernel_us: kernels.iter().map(|k| k.3).sum(),
            gpu_busy_us: busy,
            host,
            top_kernels,
            idle_gaps,
            host_work,
            compile_spans: compiles.iter().map(|c| (c.0, c.1 - c.0)).collect(),
            slowest_pipelines: pipelines,
        })
    }
}

impl fmt::Display for TraceSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |us: f64| us / 1e3;
        let per = |us: f64| if self.executions > 0 { us / 1e3 / self.executions as f64 } else { 0.0 };
        match &self.steady_loop {
            Some(l) => writeln!(
                f,
                "steady state: {} executions from {:.1} ms to {:.1} ms: {}; the repeated step that covers the most wall time ({} compiles in the trace)",
                self.executions,
                ms(self.start_us),
                ms(self.end_us),
                l.what(),
                self.compiles
            )?,
            None => writeln!(
                f,
                "steady state: {} executions from {:.1} ms to {:.1} ms: no step repeats in the trace (no loop: a single long step?), so this is the longest run of executions without a compile ({} compiles in the trace)",
                self.executions,
                ms(self.start_us),
                ms(self.end_us),
                self.compiles
            )?,
        }
        let k = &self.skipped;
        let mut left = Vec::new();
        if k.before > 0 {
            left.push(format!(
                "{} executions before it (from {:.1} ms: loading, warm-up)",
                k.before,
                ms(k.before_from_us)
            ));
        }
        if k.after > 0 {
            left.push(format!("{} executions after it", k.after));
        }
        if k.compiling > 0 {
            left.push(format!("{} executions during a compile", k.compiling));
        }
        for l in &k.loops {
            left.push(format!(
                "another loop from {:.1} ms to {:.1} ms ({:.1} ms): {}",
                ms(l.start_us),
                ms(l.end_us),
                ms(l.end_us - l.start_us),
                l.what()
            ));
        }
        if left.is_empty() {
            writeln!(f, "skipped: nothing")?;
        } else {
            writeln!(f, "skipped: {}", left.join("; "))?;
        }
        writeln!(
            f,
            "wall {:.3} ms ({:.3} ms per execution); kernels {:.3} ms ({:.3} per execution, {} kernels); wall / kernel {}",
            ms(self.wall_us()),
            per(self.wall_us()),
            ms(self.kernel_us),
            per(self.kernel_us),
            self.kernels,
            self.wall_per_kernel().map_or("- (no GPU track: no timestamps)".to_string(), |r| format!("{r:.2}"))
        )?;
        writeln!(
            f,
            "GPU track busy {:.3} ms, idle {:.3} ms ({:.0}% of the wall)",
            ms(self.gpu_busy_us),
            ms(self.wall_us() - self.gpu_busy_us),
            100.0 * (self.wall_us() - self.gpu_busy_us) / self.wall_us().max(f64::MIN_POSITIVE)
        )?;
        for (thread, us) in &self.host_work {
            writeln!(
                f,
                "host {thread}: its own work between syncs {:.3} ms per execution (Record less the reads and waits in it)",
                per(*us)
            )?;
        }
        for (thread, spans) in &self.host {
            writeln!(f, "host {thread}: span count total ms median µs")?;
            for s in spans {
                writeln!(f, "  {:<24} {:>7} {:>10.3} {:>10.1}", s.name, s.count, ms(s.total_us), s.median_us)?;
            }
        }
        if !self.top_kernels.is_empty() {
            writeln!(f, "kernels by total time: count total ms median µs")?;
            for s in &self.top_kernels {
                writeln!(f, "  {:<40} {:>7} {:>10.3} {:>10.1}", s.name, s.count, ms(s.total_us), s.median_us)?;
            }
        }
        if !self.idle_gaps.is_empty() {
            writeln!(f, "longest GPU idle stretches, with the host spans over them (ms):")?;
            for g in &self.idle_gaps {
                let host: Vec<String> = g.host.iter().map(|(what, us)| format!("{what} {:.3}", ms(*us))).collect();
                writeln!(f, "  {:.3} at {:.1}: {}", ms(g.dur_us), ms(g.start_us), host.join(", "))?;
            }
        }
        if !self.compile_spans.is_empty() {
            let each: Vec<String> =
                self.compile_spans.iter().map(|(at, d)| format!("{:.1} at {:.1}", ms(*d), ms(*at))).collect();
            let total: f64 = self.compile_spans.iter().map(|c| c.1).sum();
            writeln!(f, "compiles in the trace: {:.1} ms in all (ms): {}", ms(total), each.join(", "))?;
        }
        if !self.slowest_pipelines.is_empty() {
            writeln!(f, "longest pipeline creations in the trace (ms):")?;
            for (kernel, us) in &self.slowest_pipelines {
                writeln!(f, "  {:>8.1}  {kernel}", ms(*us))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn x(name: &str, tid: u64, ts: f64, dur: f64) -> Value {
        json!({"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid})
    }

    #[test]
    fn the_steady_state_is_the_longest_run_without_a_compile() {
        let gpu = crate::timeline::GPU_TRACK;
        let doc = json!({"traceEvents": [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "main"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "worker"}},
            x("Compile", 2, 0.0, 100.0),
            // Its pipelines, created in parallel: the longest sets its wall.
            json!({"name": "CompilePipeline", "ph": "X", "ts": 10.0, "dur": 80.0, "pid": 1, "tid": 3, "args": {"what": "k0_MatMul_matmul"}}),
            json!({"name": "CompilePipeline", "ph": "X", "ts": 10.0, "dur": 30.0, "pid": 1, "tid": 4, "args": {"what": "k1_Elementwise_add"}}),
            x("Execute", 2, 100.0, 50.0),
            x("k0", gpu, 120.0, 30.0),
            // Steady state: two executions; the second returns before its
            // kernels end (overlap), and two kernels overlap each other.
            x("Compile", 2, 150.0, 50.0),
            x("Execute", 2, 200.0, 20.0),
            x("Encode", 2, 205.0, 5.0),
            x("k0", gpu, 210.0, 40.0),
            x("k1", gpu, 240.0, 20.0),
            x("Record", 1, 220.0, 60.0),
            // A read and a device wait inside it: waiting, not the
            // program's own work.
            x("Readback", 1, 230.0, 20.0),
            x("DeviceWait", 1, 252.0, 5.0),
            x("Execute", 2, 300.0, 10.0),
            x("Encode", 2, 302.0, 3.0),
            x("k0", gpu, 305.0, 50.0),
            // An evaluation after the loop compiles and runs once.
            x("Compile", 2, 400.0, 30.0),
            x("Execute", 2, 430.0, 10.0),
            x("k2", gpu, 432.0, 5.0),
        ]});
        let s = TraceSummary::of(&doc, 1).unwrap();
        assert_eq!(s.compiles, 3);
        assert_eq!((s.start_us, s.end_us, s.executions, s.kernels), (200.0, 355.0, 2, 3));
        assert_eq!((s.kernel_us, s.gpu_busy_us), (110.0, 100.0));
        assert_eq!(s.wall_per_kernel(), Some(155.0 / 110.0));
        assert_eq!(s.top_kernels, [Spent { name: "k0".into(), count: 2, total_us: 90.0, median_us: 50.0 }]);
        let worker = &s.host.iter().find(|(t, _)| t.starts_with("worker")).unwrap().1;
        assert_eq!(worker[0], Spent { name: "Execute".into(), count: 2, total_us: 30.0, median_us: 20.0 });
        assert_eq!(worker[1], Spent { name: "Encode".into(), count: 2, total_us: 8.0, median_us: 5.0 });
        // Idle: 200..210 (before the first kernel; the worker's Execute
        // and Encode over it) and 260..305 (main's Record, then the
        // worker's next Execute and Encode).
        assert_eq!(s.idle_gaps.len(), 2);
        assert_eq!((s.idle_gaps[0].start_us, s.idle_gaps[0].dur_us), (260.0, 45.0));
        assert_eq!(
            s.idle_gaps[0].host,
            [
                ("main: Record".to_string(), 20.0),
                ("worker: Execute".to_string(), 5.0),
                ("worker: Encode".to_string(), 3.0)
            ]
        );
        assert_eq!((s.idle_gaps[1].start_us, s.idle_gaps[1].dur_us), (200.0, 10.0));
        let text = s.to_string();
        assert!(text.contains("wall / kernel 1.41") && text.contains("idle 0.055 ms"), "{text}");
        assert!(
            text.contains("0.045 at 0.3: main: Record 0.020, worker: Execute 0.005, worker: Encode 0.003"),
            "{text}"
        );
        // The main thread's own work: 60 µs of Record less a 20 µs read
        // and a 5 µs device wait, over 2 executions.
        assert_eq!(s.host_work, [("main (track 1)".to_string(), 35.0)]);
        assert!(text.contains("host main (track 1): its own work between syncs 0.018 ms per execution"), "{text}");
        // Over the whole trace: each compile, the longest pipelines first.
        assert_eq!(s.compile_spans, [(0.0, 100.0), (150.0, 50.0), (400.0, 30.0)]);
        assert_eq!(
            s.slowest_pipelines,
            [("k0_MatMul_matmul".to_string(), 80.0), ("k1_Elementwise_add".to_string(), 30.0)]
        );
        assert!(
            text.contains("compiles in the trace: 0.2 ms in all") && text.contains("0.1  k0_MatMul_matmul"),
            "{text}"
        );
    }

    /// A trace of `steps` run one after another from `at` µs on track 2,
    /// each step as (its kernels on the CPU kernel track, µs per
    /// execution); a compile first where `compile`.
    fn timeline(compile: bool, steps: &[(&[&str], f64)]) -> Value {
        let mut events = vec![json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "main"}})];
        let mut t = 0.0;
        if compile {
            events.push(x("Compile", 2, 0.0, 100.0));
            t = 100.0;
        }
        for (kernels, dur) in steps {
            events.push(x("Execute", 2, t, *dur));
            let each = dur / kernels.len().max(1) as f64;
            for (i, k) in kernels.iter().enumerate() {
                events.push(x(k, crate::timeline::CPU_TRACK, t + i as f64 * each, each));
            }
            t += dur + 1.0;
        }
        json!({ "traceEvents": events })
    }

    fn times<'a>(n: usize, step: &[(&'a [&'a str], f64)]) -> Vec<(&'a [&'a str], f64)> {
        (0..n).flat_map(|_| step.iter().copied()).collect()
    }

    #[test]
    fn the_steady_state_is_the_loop_after_the_load_and_the_warm_up() {
        // The load uploads four weights (one graph, four times), three
        // warm-up runs of a slower graph, then 200 inferences: all after
        // the one compile, which made the longest run without a compile
        // the whole trace.
        let mut steps = times(4, &[(&["upload"], 30.0)]);
        steps.extend(times(3, &[(&["warm_matmul", "warm_add"], 500.0)]));
        steps.extend(times(200, &[(&["matmul", "relu", "softmax"], 20.0)]));
        let s = TraceSummary::of(&timeline(true, &steps), 5).unwrap();
        assert_eq!(s.executions, 200);
        assert_eq!(s.start_us, 100.0 + 4.0 * 31.0 + 3.0 * 501.0);
        let l = s.steady_loop.as_ref().unwrap();
        assert_eq!((l.repetitions, l.period), (200, 1));
        assert_eq!(l.step, ["matmul", "relu", "softmax"]);
        assert_eq!((s.skipped.before, s.skipped.after, s.skipped.compiling), (7, 0, 0));
        // The warm-up (1.5 ms) before the uploads (0.12 ms).
        let other: Vec<(usize, &str)> = s.skipped.loops.iter().map(|l| (l.repetitions, l.step[0].as_str())).collect();
        assert_eq!(other, [(3, "warm_add"), (4, "upload")]);
        let text = s.to_string();
        assert!(text.starts_with("steady state: 200 executions from 1.7 ms"), "{text}");
        assert!(text.contains("200 repetitions of a step of 1 execution (3 kernels: matmul, relu, softmax)"), "{text}");
        assert!(
            text.contains("skipped: 7 executions before it (from 0.1 ms: loading, warm-up); another loop from 0.2 ms to 1.7 ms (1.5 ms): 3 repetitions"),
            "{text}"
        );
    }

    #[test]
    fn a_training_loop_beats_a_shorter_evaluation_loop_with_more_executions() {
        // 50 training steps, each syncing its loss then its update (two
        // executions), then 150 cheap evaluation batches: more
        // executions, a fifth of the wall time.
        let mut steps = times(50, &[(&["forward", "backward"], 100.0), (&["adam"], 50.0)]);
        steps.extend(times(150, &[(&["eval"], 10.0)]));
        let s = TraceSummary::of(&timeline(false, &steps), 5).unwrap();
        let l = s.steady_loop.as_ref().unwrap();
        assert_eq!((s.executions, l.repetitions, l.period), (100, 50, 2));
        assert_eq!(l.step, ["adam", "backward", "forward"]);
        assert_eq!((s.start_us, s.skipped.before, s.skipped.after), (0.0, 0, 150));
        assert_eq!(s.skipped.loops.len(), 1);
        assert_eq!((s.skipped.loops[0].repetitions, s.skipped.loops[0].period), (150, 1));
        let text = s.to_string();
        assert!(text.contains("50 repetitions of a step of 2 executions"), "{text}");
        assert!(text.contains("skipped: 150 executions after it; another loop from 7.6 ms"), "{text}");
    }

    #[test]
    fn a_periodic_checkpoint_is_part_of_the_loop_s_step() {
        // Ten rounds of nine steps and a step that also saves.
        let mut round = times(9, &[(&["step"], 40.0)]);
        round.push((&["step", "save"], 400.0));
        let mut steps = vec![(&["init"][..], 10.0)];
        steps.extend(times(10, &round));
        let s = TraceSummary::of(&timeline(true, &steps), 5).unwrap();
        let l = s.steady_loop.as_ref().unwrap();
        assert_eq!((s.executions, l.repetitions, l.period), (100, 10, 10));
        assert_eq!(l.step, ["save", "step"]);
        assert_eq!((s.skipped.before, s.skipped.after), (1, 0));
        // The nine-step stretches between checkpoints lie inside it.
        assert!(s.skipped.loops.is_empty(), "{:?}", s.skipped.loops);
    }

    #[test]
    fn a_single_long_step_is_no_loop_and_says_so() {
        let steps = [(&["load"][..], 10.0), (&["generate"][..], 5000.0)];
        let s = TraceSummary::of(&timeline(true, &steps), 5).unwrap();
        assert_eq!(s.steady_loop, None);
        // The longest run without a compile: the whole trace here.
        assert_eq!((s.executions, s.skipped.before, s.skipped.after), (2, 0, 0));
        let text = s.to_string();
        assert!(text.contains("no step repeats in the trace"), "{text}");
        assert!(text.contains("skipped: nothing"), "{text}");
    }

    #[test]
    fn without_a_kernel_track_a_step_is_its_host_spans() {
        // No timestamps: two loops told apart by what the host did in
        // each execution; the longer one (in wall time) is chosen.
        let mut events = vec![];
        let mut t = 0.0;
        for (n, inner, dur) in [(30, "Encode", 10.0), (5, "Readback", 200.0)] {
            for _ in 0..n {
                events.push(x("Execute", 2, t, dur));
                events.push(x(inner, 2, t + 1.0, 2.0));
                t += dur + 1.0;
            }
        }
        let s = TraceSummary::of(&json!({ "traceEvents": events }), 5).unwrap();
        let l = s.steady_loop.as_ref().unwrap();
        assert_eq!((s.executions, l.repetitions, l.step.clone()), (5, 5, vec!["Readback".to_string()]));
        assert!(s.to_string().contains("(1 host spans: Readback)"), "{s}");
    }

    #[test]
    fn a_trace_without_executions_is_an_error() {
        assert!(TraceSummary::of(&json!({"traceEvents": [x("Compile", 1, 0.0, 5.0)]}), 5)
            .unwrap_err()
            .contains("no execution"));
        assert!(TraceSummary::of(&json!({"nothing": 1}), 5).unwrap_err().contains("not a Chrome trace"));
    }
}
