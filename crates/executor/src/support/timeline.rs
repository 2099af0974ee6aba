//! The timeline: host spans and GPU kernel intervals on one clock, written
//! as a Chrome trace (the JSON "trace event" format that Perfetto,
//! `chrome://tracing` and every browser's profiler open), so one run shows
//! where a step's wall time goes.
//!
//! Off by default. `LAZULI_TRACE=path.json` (read when the first device is
//! made) or [`start`] turns it on; [`flush`] writes the file (devices
//! flush when they are dropped, so a program that drops its devices needs
//! no call). While off, every entry point costs one relaxed atomic load.
//!
//! What it records:
//! - each sync (`Sync`) and, before it, the time since the thread's last
//!   sync (`Record`: the program's own work, recording its ops included);
//! - every timer of [`crate::metrics`] (`record_time`) as a host span on
//!   the calling thread: tracing, lookup, each compile phase, pipeline
//!   creation, segment execution, barrier waits, `Device::wait`'s wait
//!   for the device (`DeviceWait`), and what backends time
//!   (the wgpu backend adds spans of its own: `Allocate`, `Encode`,
//!   `QueueSubmit`, `Wait`, `Upload`, `Readback`, `PoolCreateBuffer`);
//! - GPU intervals from timestamp queries ([`gpu_execution`]): each
//!   execution's kernels in the device's own clock, with the host time by
//!   which the execution was known to be done. Per device clock, the
//!   smallest gap seen between that host time and the execution's last
//!   timestamp is the clock's offset (every such gap is the true offset
//!   plus a delay, so the smallest is the closest), applied when the file
//!   is written: GPU intervals are exact relative to each other and
//!   placed within the best-observed polling latency on the host clock.
//!   Collecting them never makes an execution wait for itself, so the
//!   timeline shows a steady loop as it runs without it;
//! - the CPU backend's kernels ([`cpu_kernel`]): each fused loop, product,
//!   reduction or interpreted node of an execution on a track of its own
//!   (`CPU kernels`), with its FLOPs, bytes and threads as `args.what`.
//!
//! At most [`MAX_EVENTS`] events are kept; later ones are counted as
//! `TimelineDropped` and the file says how many were dropped.

use crate::platform::Instant;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Most events kept in memory.
pub const MAX_EVENTS: usize = 4 << 20;

/// The thread id of the GPU track in the trace.
pub const GPU_TRACK: u64 = 1 << 20;

/// The thread id of the CPU backend's kernel track in the trace.
pub const CPU_TRACK: u64 = GPU_TRACK + 1;

static ON: AtomicBool = AtomicBool::new(false);

/// A complete event ("ph":"X"): a named interval on one track.
struct Event {
    name: String,
    cat: &'static str,
    /// Microseconds since [`epoch`], or of the device clock `clock`.
    ts: f64,
    dur: f64,
    tid: u64,
    /// The device clock of a GPU interval.
    clock: Option<u64>,
    /// What the span was for (a pipeline's kernel), written as the
    /// event's `args.what`.
    what: Option<String>,
}

#[derive(Default)]
struct Recorder {
    path: Option<PathBuf>,
    events: Vec<Event>,
    dropped: u64,
    /// Host threads in order of their first event (their track ids).
    threads: Vec<(std::thread::ThreadId, String)>,
    /// Per device clock, the smallest host-minus-device gap seen so far
    /// (see [`gpu_execution`]), in µs.
    offsets: HashMap<u64, f64>,
}

fn recorder() -> &'static Mutex<Recorder> {
    static R: OnceLock<Mutex<Recorder>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The clock's origin: the first time the timeline was asked for it.
fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// Whether the timeline records.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Starts recording; [`flush`] writes to `path`. Events recorded before
/// (none while off) are kept.
pub fn start(path: impl Into<PathBuf>) {
    epoch();
    recorder().lock().unwrap_or_else(|e| e.into_inner()).path = Some(path.into());
    ON.store(true, Ordering::Relaxed);
}

/// Starts recording when `LAZULI_TRACE` (read through `lookup`) names a
/// file and nothing started it yet (called when a device is made).
pub(crate) fn start_from_env(lookup: crate::config::Lookup<'_>) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(path) = crate::config::path(lookup, "LAZULI_TRACE") {
            if !enabled() {
                start(path);
            }
        }
    });
}

/// Microseconds on the timeline's clock at `t`.
pub fn micros(t: Instant) -> f64 {
    t.saturating_duration_since(epoch()).as_secs_f64() * 1e6
}

fn push(name: String, cat: &'static str, ts: f64, dur: f64, what: Option<String>) {
    let mut r = recorder().lock().unwrap_or_else(|e| e.into_inner());
    push_locked(&mut r, Event { name, cat, ts, dur, tid: 0, clock: None, what }, true);
}

/// Adds `e` to `r`; on this thread's track where `on_this_thread`.
fn push_locked(r: &mut Recorder, mut e: Event, on_this_thread: bool) {
    if r.events.len() >= MAX_EVENTS {
        r.dropped += 1;
        // The metrics' lock is never held while taking this one.
        crate::metrics::inc("TimelineDropped", 1);
        return;
    }
    if on_this_thread {
        let me = std::thread::current();
        e.tid = match r.threads.iter().position(|(id, _)| *id == me.id()) {
            Some(i) => i as u64 + 1,
            None => {
                r.threads.push((me.id(), me.name().unwrap_or("thread").to_string()));
                r.threads.len() as u64
            }
        };
    }
    r.events.push(e);
}

/// Records a host span `name` on this thread that ended now and took `d`.
pub fn host_span(name: &str, d: Duration) {
    host_span_of(name, None, d);
}

/// [`host_span`] with what the span was for (`what`, e.g. the kernel a
/// pipeline was created for), shown as its `args.what`.
pub fn host_span_of(name: &str, what: Option<&str>, d: Duration) {
    if !enabled() {
        return;
    }
    let end = micros(Instant::now());
    let dur = d.as_secs_f64() * 1e6;
    push(name.to_string(), "host", (end - dur).max(0.0), dur, what.map(str::to_string));
}

thread_local! {
    /// When this thread's last sync ended (see [`between_syncs`]).
    static LAST_SYNC: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Records the time since this thread's last sync as a `Record` span:
/// the program's own work between syncs, recording its ops included.
pub(crate) fn between_syncs() {
    if enabled() {
        if let Some(last) = LAST_SYNC.with(|l| l.get()) {
            host_span("Record", last.elapsed());
        }
    }
}

/// Notes the end of a sync on this thread (see [`between_syncs`]).
pub(crate) fn sync_ended() {
    if enabled() {
        LAST_SYNC.with(|l| l.set(Some(Instant::now())));
    }
}

/// A host span that records itself when dropped (see [`span`]).
pub struct Span {
    name: &'static str,
    start: Instant,
}

impl Drop for Span {
    fn drop(&mut self) {
        host_span(self.name, self.start.elapsed());
    }
}

/// A span from now until the returned guard drops; `None` (nothing to
/// drop) while the timeline is off.
pub fn span(name: &'static str) -> Option<Span> {
    enabled().then(|| Span { name, start: Instant::now() })
}

/// Records a kernel of the CPU backend on the CPU kernel track: `name`
/// ran from `start` for `dur`, and `what` says what it did (FLOPs,
/// bytes, threads).
pub fn cpu_kernel(name: &str, start: Instant, dur: Duration, what: String) {
    if !enabled() {
        return;
    }
    let ts = micros(start);
    let mut r = recorder().lock().unwrap_or_else(|e| e.into_inner());
    let event = Event {
        name: name.to_string(),
        cat: "cpu",
        ts,
        dur: dur.as_secs_f64() * 1e6,
        tid: CPU_TRACK,
        clock: None,
        what: Some(what),
    };
    push_locked(&mut r, event, false);
}

/// Records one execution's kernels on the GPU track: `names` ran over
/// `intervals` (begin and end in µs of device clock `clock`, an id the
/// backend gives each device), and the host knew the execution was done
/// at `done`. The clock's offset to the host clock is the smallest
/// `done` minus last end seen (see the module documentation), so an
/// execution collected late places as well as one waited for at once.
pub fn gpu_execution(clock: u64, names: &[String], intervals: &[(f64, f64)], done: Instant) {
    if !enabled() {
        return;
    }
    recorder().lock().unwrap_or_else(|e| e.into_inner()).gpu_execution(clock, names, intervals, micros(done));
}

impl Recorder {
    /// [`gpu_execution`] with `done` in µs of the timeline's clock.
    fn gpu_execution(&mut self, clock: u64, names: &[String], intervals: &[(f64, f64)], done: f64) {
        let Some(last) = intervals.iter().map(|i| i.1).reduce(f64::max) else { return };
        let gap = done - last;
        let offset = self.offsets.entry(clock).or_insert(gap);
        *offset = offset.min(gap);
        for (name, &(begin, end)) in names.iter().zip(intervals) {
            let dur = (end - begin).max(0.0);
            push_locked(
                self,
                Event {
                    name: name.clone(),
                    cat: "gpu",
                    ts: begin,
                    dur,
                    tid: GPU_TRACK,
                    clock: Some(clock),
                    what: None,
                },
                false,
            );
        }
    }

    /// Where event `e` starts on the timeline's clock (GPU intervals
    /// moved by their clock's offset).
    fn start_of(&self, e: &Event) -> f64 {
        match e.clock {
            Some(c) => (e.ts + self.offsets.get(&c).copied().unwrap_or(0.0)).max(0.0),
            None => e.ts,
        }
    }
}

/// Writes everything recorded so far to the file given at [`start`]
/// (`LAZULI_TRACE`); does nothing while off. The file is rewritten whole
/// each time, so the last flush has everything.
pub fn flush() -> std::io::Result<()> {
    if !enabled() {
        return Ok(());
    }
    let r = recorder().lock().unwrap_or_else(|e| e.into_inner());
    let Some(path) = r.path.clone() else { return Ok(()) };
    write(&r, &path)
}

fn write(r: &Recorder, path: &Path) -> std::io::Result<()> {
    use serde_json::json;
    let mut events = Vec::with_capacity(r.events.len() + r.threads.len() + 2);
    events.push(json!({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "lazuli"}}));
    for (i, (_, name)) in r.threads.iter().enumerate() {
        events.push(json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": i + 1, "args": {"name": name}}));
    }
    events.push(json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": GPU_TRACK, "args": {"name": "GPU"}}));
    if r.events.iter().any(|e| e.tid == CPU_TRACK) {
        events.push(
            json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": CPU_TRACK, "args": {"name": "CPU kernels"}}),
        );
    }
    for e in &r.events {
        let ts = r.start_of(e);
        let mut event =
            json!({"name": e.name, "cat": e.cat, "ph": "X", "ts": ts, "dur": e.dur, "pid": 1, "tid": e.tid});
        if let Some(what) = &e.what {
            event["args"] = json!({ "what": what });
        }
        events.push(event);
    }
    let doc = json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"dropped_events": r.dropped},
    });
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&doc).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_intervals_take_the_smallest_gap_seen_on_their_clock() {
        let mut r = Recorder::default();
        let names = |n: &str| vec![format!("{n}a"), format!("{n}b")];
        // Device clock 1: the first execution is seen done 2000 µs (of
        // host clock minus device clock) after its last timestamp, the
        // second 1500 µs after; both move by the smaller gap.
        r.gpu_execution(1, &names("x"), &[(1000.0, 1100.0), (1100.0, 1300.0)], 3300.0);
        r.gpu_execution(1, &names("y"), &[(5000.0, 5050.0), (5060.0, 5100.0)], 6600.0);
        // Another device keeps its own clock.
        r.gpu_execution(2, &names("z"), &[(10.0, 30.0), (30.0, 40.0)], 7000.0);
        let placed: Vec<(&str, f64, f64)> = r.events.iter().map(|e| (e.name.as_str(), r.start_of(e), e.dur)).collect();
        assert_eq!(
            placed,
            [
                ("xa", 2500.0, 100.0),
                ("xb", 2600.0, 200.0),
                ("ya", 6500.0, 50.0),
                ("yb", 6560.0, 40.0),
                ("za", 6970.0, 20.0),
                ("zb", 6990.0, 10.0),
            ]
        );
        assert!(r.events.iter().all(|e| e.tid == GPU_TRACK && e.cat == "gpu"));
        // Each execution ends no later than when it was seen done.
        assert!(placed[1].1 + placed[1].2 <= 3300.0 && placed[3].1 + placed[3].2 <= 6600.0);
    }
}
