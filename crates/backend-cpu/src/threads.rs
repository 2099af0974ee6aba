//! The threading policy: which executions run on the worker pool, how
//! many threads it has, and what each kernel reports it used.
//!
//! One pool per thread count, shared by every backend of the process that
//! asks for that count ([`Threads::new`]): the fused loops, reductions,
//! convolutions and attention split their work over it with rayon, and
//! the `gemm` crate's own parallel loops run on it too (they use the pool
//! of the thread that calls them), so the two never oversubscribe the
//! cores. Its size is the host's cores, capped by
//! [`crate::CpuOptions::threads`] (`LAZULI_CPU_THREADS`).
//!
//! An execution whose work is small runs on the calling thread (the
//! device's worker) with no pool dispatch at all: [`Threads::run`] marks
//! the thread serial, and every kernel then sees [`available`] = 1. A
//! large one is handed to the pool once (`install`), and its kernels split
//! themselves by their own thresholds. Rejected alternative: rayon's
//! global pool, entered by each parallel kernel from the worker thread.
//! Every such kernel then pays an injection and a wake-up, and the pool's
//! size cannot follow a backend's option.
//!
//! Kernels that split report how many threads they split over
//! ([`note`]); the profile and the timeline show the most any part of a
//! step used ([`take_used`]).

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Executions with less work than this (FLOPs plus bytes moved, by the
/// cost model of [`crate::profile`]) run serially on the calling thread:
/// about a quarter of a millisecond on one core, less than what waking
/// the pool's threads risks on a busy host.
pub(crate) const PARALLEL_WORK: u64 = 1 << 23;

thread_local! {
    /// Set while an execution runs serially on this thread.
    static SERIAL: Cell<bool> = const { Cell::new(false) };
    /// The most threads a kernel split over since the last [`take_used`].
    static USED: Cell<usize> = const { Cell::new(1) };
}

/// Threads a kernel may split over here: 1 inside a serial execution,
/// else the current rayon pool's size.
pub(crate) fn available() -> usize {
    if SERIAL.with(Cell::get) {
        1
    } else {
        rayon::current_num_threads()
    }
}

/// Notes that a kernel split its work over `threads` threads.
pub(crate) fn note(threads: usize) {
    USED.with(|u| u.set(u.get().max(threads)));
}

/// The most threads noted since the last call (1 if none split), reset.
pub(crate) fn take_used() -> usize {
    USED.with(|u| u.replace(1))
}

/// The worker pool of a CPU backend.
#[derive(Clone)]
pub(crate) struct Threads {
    /// `None` where the host has one core or the pool's threads could
    /// not start: every execution is serial then.
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl std::fmt::Debug for Threads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Threads").field("count", &self.count()).finish()
    }
}

impl Threads {
    /// The pool of `cap` threads (at most the host's cores; `None`: the
    /// host's cores), shared with every backend asking for as many.
    pub(crate) fn new(cap: Option<usize>) -> Threads {
        let count = cap.unwrap_or_else(cores).clamp(1, cores());
        if count == 1 {
            return Threads { pool: None };
        }
        type Pools = Mutex<HashMap<usize, Option<Arc<rayon::ThreadPool>>>>;
        static POOLS: OnceLock<Pools> = OnceLock::new();
        let mut pools = POOLS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
        let pool = pools.entry(count).or_insert_with(|| {
            let built =
                rayon::ThreadPoolBuilder::new().num_threads(count).thread_name(|i| format!("lazuli-cpu-{i}")).build();
            // A pool that cannot start its threads leaves the work on
            // the callers' threads, never an abort.
            built.map(Arc::new).map_err(|e| tracing::error!("cpu backend: no pool of {count} threads ({e})")).ok()
        });
        Threads { pool: pool.clone() }
    }

    /// Threads of the pool.
    pub(crate) fn count(&self) -> usize {
        self.pool.as_ref().map_or(1, |p| p.current_num_threads())
    }

    /// Runs `f`: on the pool where `parallel` and there is one, else on
    /// this thread with every kernel serial.
    pub(crate) fn run<R: Send>(&self, parallel: bool, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) if parallel => pool.install(f),
            _ => {
                let _serial = Serial(SERIAL.with(|s| s.replace(true)));
                f()
            }
        }
    }
}

/// Restores the thread's serial flag when dropped (a panicking kernel
/// must not leave the device's worker serial).
struct Serial(bool);

impl Drop for Serial {
    fn drop(&mut self) {
        SERIAL.with(|s| s.set(self.0));
    }
}

/// The host's cores (1 where it does not tell).
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
