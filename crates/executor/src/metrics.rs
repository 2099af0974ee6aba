//! Process-wide metrics: counters, value metrics and timers, with a text
//! report. A process-wide registry is the point here (like LTC's metrics),
//! so this is one of the few globals, behind a small API.
//!
//! The report starts with where the wall time since the last [`reset`]
//! (or since the first device was made) went on the threads that call
//! the engine: syncs (tracing, cache
//! lookup and compiling, submitting, and running a plan inline), waits for
//! the device (barriers before reads, `Device::wait`), downloads, and the
//! rest, which is the program's own work with the recording of its ops.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

struct Registry {
    counters: BTreeMap<String, u64>,
    values: BTreeMap<String, Stat>,
    timers: BTreeMap<String, Stat>,
    notes: Vec<String>,
    /// When the registry was made or last reset.
    since: crate::platform::Instant,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry {
            counters: BTreeMap::new(),
            values: BTreeMap::new(),
            timers: BTreeMap::new(),
            notes: Vec::new(),
            since: crate::platform::Instant::now(),
        }
    }
}

/// The timers of the calling threads' time inside the engine, grouped as
/// the report's wall-time line names them (none nests in another).
const WALL_PARTS: [(&str, &[&str]); 3] = [
    ("syncs (trace, lookup and compile, submit)", &["Trace", "Lookup", "Submit"]),
    ("waiting for the device", &["BarrierWait", "DeviceWait"]),
    ("downloads", &["Download"]),
];

/// Running statistics of a sampled metric.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stat {
    /// Number of samples.
    pub count: u64,
    /// Sum of samples.
    pub sum: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Last sample.
    pub last: f64,
}

impl Stat {
    fn add(&mut self, v: f64) {
        if self.count == 0 {
            self.min = v;
            self.max = v;
        } else {
            self.min = self.min.min(v);
            self.max = self.max.max(v);
        }
        self.count += 1;
        self.sum += v;
        self.last = v;
    }

    /// Mean of the samples (0 when empty).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn with<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    let mut guard = registry().lock().unwrap_or_else(|e| e.into_inner());
    f(&mut guard)
}

/// Adds `by` to counter `name`.
pub fn inc(name: &str, by: u64) {
    with(|r| {
        if let Some(c) = r.counters.get_mut(name) {
            *c += by;
        } else {
            r.counters.insert(name.to_string(), by);
        }
    })
}

/// Current value of counter `name` (0 if never incremented).
pub fn counter(name: &str) -> u64 {
    with(|r| r.counters.get(name).copied().unwrap_or(0))
}

/// All counters, sorted by name.
pub fn counters() -> Vec<(String, u64)> {
    with(|r| r.counters.iter().map(|(k, v)| (k.clone(), *v)).collect())
}

/// Records a sample of value metric `name` (graph size, bytes moved ...).
pub fn record_value(name: &str, v: f64) {
    with(|r| match r.values.get_mut(name) {
        Some(s) => s.add(v),
        None => r.values.entry(name.to_string()).or_default().add(v),
    })
}

/// Statistics of value metric `name`.
pub fn value(name: &str) -> Option<Stat> {
    with(|r| r.values.get(name).copied())
}

/// Records a duration sample of timer `name`.
pub fn record_time(name: &str, d: Duration) {
    record_time_of(name, None, d);
}

/// [`record_time`], the timeline's span saying what it was for (`what`,
/// e.g. the kernel whose pipeline was created).
pub fn record_time_of(name: &str, what: Option<&str>, d: Duration) {
    crate::timeline::host_span_of(name, what, d);
    let ms = d.as_secs_f64() * 1e3;
    with(|r| match r.timers.get_mut(name) {
        Some(s) => s.add(ms),
        None => r.timers.entry(name.to_string()).or_default().add(ms),
    })
}

/// Statistics of timer `name`, in milliseconds.
pub fn timer(name: &str) -> Option<Stat> {
    with(|r| r.timers.get(name).copied())
}

/// Appends a note (e.g. a recompile explanation) to the report.
pub fn note(text: String) {
    with(|r| {
        if r.notes.len() >= 64 {
            r.notes.remove(0);
        }
        r.notes.push(text)
    })
}

/// Starts the wall-time clock of the report if nothing started it yet
/// (the first device does, so the report covers the program from then).
pub fn start() {
    with(|_| ());
}

/// Clears every metric.
pub fn reset() {
    with(|r| *r = Registry::default())
}

/// A readable text report of every metric.
pub fn report() -> String {
    with(|r| {
        let mut s = String::from("== Lazuli metrics ==\n");
        let wall = r.since.elapsed().as_secs_f64() * 1e3;
        let mut inside = 0.0;
        let mut parts = Vec::new();
        for (name, timers) in WALL_PARTS {
            let ms: f64 = timers.iter().filter_map(|t| r.timers.get(*t)).map(|t| t.sum).sum();
            inside += ms;
            parts.push(format!("{name} {ms:.1} ms"));
        }
        let _ = writeln!(
            s,
            "Wall time: {wall:.1} ms since the metrics were reset or the first device was made: {}; the rest, \
             {:.1} ms, is the program's own work (recording ops included)",
            parts.join(", "),
            (wall - inside).max(0.0)
        );
        s.push_str("Counters:\n");
        for (k, v) in &r.counters {
            let _ = writeln!(s, "  {k:<32} {v}");
        }
        if !r.values.is_empty() {
            s.push_str("Values:                            count        mean         min         max\n");
            for (k, v) in &r.values {
                let _ = writeln!(s, "  {k:<32} {:>5} {:>11.1} {:>11.1} {:>11.1}", v.count, v.mean(), v.min, v.max);
            }
        }
        if !r.timers.is_empty() {
            s.push_str("Timers (ms):                       count        mean         min         max       total\n");
            for (k, v) in &r.timers {
                let _ = writeln!(
                    s,
                    "  {k:<32} {:>5} {:>11.3} {:>11.3} {:>11.3} {:>11.3}",
                    v.count,
                    v.mean(),
                    v.min,
                    v.max,
                    v.sum
                );
            }
        }
        if !r.notes.is_empty() {
            s.push_str("Notes:\n");
            for n in &r.notes {
                for (i, line) in n.lines().enumerate() {
                    let _ = writeln!(s, "  {}{line}", if i == 0 { "- " } else { "  " });
                }
            }
        }
        s
    })
}
