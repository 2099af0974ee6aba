//! Devices: one backend (plus the CPU fallback), the live-tensor registry,
//! the compile cache, the worker thread that runs plans asynchronously,
//! barriers, stored asynchronous errors and the step RNG state.
//!
//! Failures are reported once, by the computation they belong to: a failed
//! execution's error sits in its output cells (returned, as
//! [`ExecError::Failed`], when such a value is read) and in the device's
//! list of unreported failures (returned by [`Device::wait`] unless a read
//! reported it first). A sync whose graph would read a failed value does
//! not run the roots that need it: they get a cell holding
//! [`ExecError::Poisoned`] (which names the earlier failure as such), and
//! the other roots of the same sync run normally.

use crate::api::lazy::{CellState, DataCell, LazyNode};
use crate::api::tensor::TensorInner;
use crate::config::{self, ConfigError, Lookup, Setting, Source};
use crate::platform::{self, Instant};
use crate::runtime::compile_cache::CompileCache;
use crate::runtime::plan::Plan;
use crate::runtime::trace::{replay, roots_key, trace, Traced};
use crate::{metrics, Backend, BackendError, BackendKind, Buffer, ExecError, Result};
use crossbeam_channel::{unbounded, Receiver, Sender};
use lazuli_ir::ScalarValue;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;

static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);
static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

/// Unreported failures kept per device (only the first is ever returned;
/// the rest are kept so that reporting the first by a read leaves the
/// next one for [`Device::wait`]).
const MAX_UNREPORTED: usize = 16;

/// Most elements a plan may compute ([`Plan::work`]) to run on the thread
/// that synced it, when the main backend is the CPU and the device is
/// idle (see [`Device::sync_nodes`]). At this size the computation takes
/// about as long as handing it to the worker thread and waking the
/// reader again (tens of microseconds), so handing it over gains nothing.
pub const INLINE_MAX_WORK: u64 = 1 << 18;

/// The settings of a device that the environment gives (see
/// [`crate::config`]): each field's doc names its variable and default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSettings {
    /// Shadow validation against the CPU backend (`LAZULI_VALIDATE=cpu`;
    /// default off; [`Device::set_validate`] changes it later).
    pub validate: bool,
    /// Compiled plans the device keeps (`LAZULI_COMPILE_CACHE_SIZE`;
    /// default 1024).
    pub compile_cache_size: NonZeroUsize,
    /// Ops forced onto the CPU fallback (`LAZULI_FORCE_FALLBACK`, comma
    /// separated; default none; [`Device::set_force_fallback`] changes it
    /// later).
    pub force_fallback: BTreeSet<String>,
    /// Where every compiled graph and plan is written (`LAZULI_DUMP_DIR`;
    /// default nowhere).
    pub dump_dir: Option<PathBuf>,
    /// Compile the next size of a structure whose sizes keep one step
    /// ahead of time (`LAZULI_COMPILE_AHEAD`; default: where the main
    /// backend says it pays, [`Backend::compiles_ahead`]; see
    /// [`Device::set_compile_ahead`]).
    pub compile_ahead: Option<bool>,
}

impl Default for DeviceSettings {
    fn default() -> DeviceSettings {
        DeviceSettings {
            validate: false,
            compile_cache_size: NonZeroUsize::new(1024).expect("non-zero"),
            force_fallback: BTreeSet::new(),
            dump_dir: None,
            compile_ahead: None,
        }
    }
}

impl DeviceSettings {
    /// The defaults with every variable set in `lookup` applied; a
    /// malformed value is the error.
    pub fn from_env(lookup: Lookup<'_>) -> std::result::Result<DeviceSettings, ConfigError> {
        let mut s = DeviceSettings::default();
        if let Some(v) = config::choice(lookup, "LAZULI_VALIDATE")? {
            s.validate = v == "cpu";
        }
        if let Some(n) = config::count(lookup, "LAZULI_COMPILE_CACHE_SIZE")?.and_then(NonZeroUsize::new) {
            s.compile_cache_size = n;
        }
        if let Some(ops) = config::text(lookup, "LAZULI_FORCE_FALLBACK") {
            s.force_fallback = ops.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect();
        }
        s.dump_dir = config::path(lookup, "LAZULI_DUMP_DIR");
        s.compile_ahead = config::flag(lookup, "LAZULI_COMPILE_AHEAD")?;
        Ok(s)
    }
}

/// A compute device: cheap to clone, shared by every tensor on it.
#[derive(Clone)]
pub struct Device(pub(crate) Arc<DeviceInner>);

pub(crate) struct DeviceInner {
    pub id: u64,
    pub main: Arc<dyn Backend>,
    pub cpu: Arc<dyn Backend>,
    /// Every registered tensor handle (this set changes on every op).
    pub live: Mutex<LiveSet>,
    /// Compiled plans by graph, by sync structure (trace replay) and by
    /// shape-free structure (size variants); shared with the
    /// compile-ahead thread.
    cache: Arc<Mutex<CompileCache>>,
    /// Size variants compiled ahead of time ([`crate::runtime::compile_ahead`]).
    ahead: crate::runtime::compile_ahead::Ahead,
    tx: Option<Sender<Job>>,
    shared: Arc<Shared>,
    pub rng: Mutex<RngState>,
    force_fallback: RwLock<BTreeSet<String>>,
    explainer: Mutex<crate::runtime::explain::Explainer>,
    /// Plans this device compiled (the `UncachedCompile` and
    /// `SizeVariantCompile` counters) and found cached (`CachedCompile`).
    uncached: AtomicU64,
    cached: AtomicU64,
    /// Serializes syncs so plans reach the worker in trace order.
    sync_lock: Mutex<()>,
    /// Syncs forced by the graph size limit (the warning that a loop does
    /// not mark its step counts them).
    limit_syncs: AtomicU64,
    /// Calls of [`Device::mark_step`] by the program (not
    /// [`Device::auto_mark_step`]'s): how an optimizer tells whether the
    /// program marks its own steps.
    program_marks: AtomicU64,
    /// Persistent state ([`crate::Tensor::persist`]) still pending: the
    /// next sync materializes it with whatever it syncs.
    persist: Mutex<Vec<Weak<TensorInner>>>,
    /// True while `persist` may be non-empty (read on every sync without
    /// its lock).
    persist_waiting: std::sync::atomic::AtomicBool,
    /// Where compiled graphs and plans are dumped (`LAZULI_DUMP_DIR`).
    dump_dir: Option<PathBuf>,
    /// The configuration lookup the device was created with.
    lookup: fn(&str) -> Option<String>,
    /// A malformed configuration value found at creation: every
    /// compilation fails with it.
    config_error: Option<ConfigError>,
    worker: Option<JoinHandle<()>>,
}

/// The live-tensor registry: a slab of weak handles, so that registering
/// a tensor (on every recorded op) and dropping one are a vector write
/// each, with no hashing. A tensor keeps its slot index.
#[derive(Default)]
pub(crate) struct LiveSet {
    slots: Vec<Option<Weak<TensorInner>>>,
    free: Vec<u32>,
    len: usize,
}

impl LiveSet {
    /// Registers a handle; returns its slot.
    pub fn insert(&mut self, handle: Weak<TensorInner>) -> u32 {
        self.len += 1;
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(handle);
                slot
            }
            None => {
                self.slots.push(Some(handle));
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Unregisters the handle in `slot`.
    pub fn remove(&mut self, slot: u32) {
        if let Some(entry) = self.slots.get_mut(slot as usize) {
            if entry.take().is_some() {
                self.len -= 1;
                self.free.push(slot);
            }
        }
    }

    /// Registered handles.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Every registered handle.
    pub fn handles(&self) -> impl Iterator<Item = &Weak<TensorInner>> {
        self.slots.iter().flatten()
    }
}

/// The state of the device RNG: everything the next random op's stream
/// depends on ([`Device::rng_state`] reads it, [`Device::set_rng_state`]
/// restores it, e.g. from a training checkpoint, so a resumed run draws
/// the very streams the uninterrupted run would).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RngState {
    /// The seed given to [`Device::manual_seed`] (0 by default).
    pub seed: u64,
    /// Steps marked since seeding ([`Device::mark_step`] advances it).
    pub step: u64,
    /// Random ops recorded in the current step (each gets its own stream).
    pub offset: u64,
}

/// State shared with the worker thread.
#[derive(Default)]
struct Shared {
    outstanding: Mutex<usize>,
    idle: Condvar,
    /// Failed jobs no barrier has reported yet, as (job id, error), oldest
    /// first.
    unreported: Mutex<Vec<(u64, ExecError)>>,
    faults: Mutex<crate::runtime::fault::Faults>,
    /// Shadow validation against the CPU backend (`crate::runtime::shadow_run`).
    validate: std::sync::atomic::AtomicBool,
    /// Runs the collectives of plans (`Device::set_collective`).
    collective: RwLock<Option<Arc<dyn crate::Collective>>>,
}

struct Job {
    id: u64,
    plan: Arc<Plan>,
    inputs: Vec<Arc<DataCell>>,
    scalars: Vec<ScalarValue>,
    outputs: Vec<Arc<DataCell>>,
    context: String,
    /// Source locations of the traced graph's nodes (for validation reports).
    locations: Vec<&'static std::panic::Location<'static>>,
    /// Set once the plan starts running (its collectives are then its own
    /// business; before, a failure still joins them: `Plan::join_failed`).
    ran: std::sync::atomic::AtomicBool,
}

impl Device {
    /// A device running on `main`, with `cpu` as the fallback for nodes
    /// `main` does not support (pass the same CPU backend twice for a CPU
    /// device), configured by the process environment
    /// ([`DeviceSettings::from_env`]).
    ///
    /// Every library `LAZULI_*` variable is checked here
    /// ([`config::check`]): with a malformed one the device is created
    /// (this constructor cannot fail) but every compilation on it fails
    /// with [`ExecError::Config`] naming the variable, so the value is
    /// never silently replaced by a default. Unknown `LAZULI_*` names are
    /// warned about once per process.
    pub fn new(main: Arc<dyn Backend>, cpu: Arc<dyn Backend>) -> Device {
        config::warn_unknown_once();
        Device::with_env(main, cpu, config::process)
    }

    /// [`Device::new`] with the configuration read from `lookup` instead
    /// of the process environment (tests; the backends read their own
    /// variables when they are created).
    pub fn with_env(main: Arc<dyn Backend>, cpu: Arc<dyn Backend>, lookup: fn(&str) -> Option<String>) -> Device {
        metrics::start();
        let (settings, config_error) = match config::check(&lookup).and_then(|()| DeviceSettings::from_env(&lookup)) {
            Ok(settings) => (settings, None),
            Err(e) => {
                tracing::error!("{e}; every compilation on this device fails with it");
                (DeviceSettings::default(), Some(e))
            }
        };
        crate::timeline::start_from_env(&lookup);
        // Compiling ahead needs a thread of its own.
        let on = platform::WORKER_THREAD && settings.compile_ahead.unwrap_or_else(|| main.compiles_ahead());
        let cache = Arc::new(Mutex::new(CompileCache::new(settings.compile_cache_size)));
        let ahead = crate::runtime::compile_ahead::Ahead::new(on, cache.clone(), main.clone(), cpu.clone());
        let (tx, rx) = unbounded::<Job>();
        let shared = Arc::new(Shared::default());
        shared.validate.store(settings.validate, Ordering::Relaxed);
        // Where there are no threads (a browser tab) the syncing caller
        // runs every plan (see `Device::inline`).
        let worker = platform::WORKER_THREAD.then(|| {
            let (main, cpu, shared) = (main.clone(), cpu.clone(), shared.clone());
            std::thread::Builder::new()
                .name("lazuli-worker".into())
                .spawn(move || worker_loop(rx, main, cpu, shared))
                .expect("spawning the device worker thread")
        });
        Device(Arc::new(DeviceInner {
            id: NEXT_DEVICE.fetch_add(1, Ordering::Relaxed),
            main,
            cpu,
            live: Mutex::new(LiveSet::default()),
            cache,
            ahead,
            tx: Some(tx),
            shared,
            rng: Mutex::new(RngState::default()),
            force_fallback: RwLock::new(settings.force_fallback),
            explainer: Mutex::new(Default::default()),
            uncached: AtomicU64::new(0),
            cached: AtomicU64::new(0),
            sync_lock: Mutex::new(()),
            limit_syncs: AtomicU64::new(0),
            program_marks: AtomicU64::new(0),
            persist: Mutex::new(Vec::new()),
            persist_waiting: Default::default(),
            dump_dir: settings.dump_dir,
            lookup,
            config_error,
            worker,
        }))
    }

    /// The effective configuration of this device: every library
    /// variable's value and source, the executor's own settings as they
    /// are now (a setting changed by [`Device::set_validate`] or
    /// [`Device::set_force_fallback`] has source code), the backends'
    /// effective values ([`Backend::settings`]), malformed values and
    /// unknown `LAZULI_*` names. `lazuli info` prints it.
    pub fn configuration(&self) -> config::Report {
        let lookup = self.0.lookup;
        let mut report = config::report(&lookup, config::process_names());
        let env = DeviceSettings::from_env(&lookup).unwrap_or_default();
        let source = |code: bool, name| Source::of(code, config::text(&lookup, name).is_some());
        let validate = self.validating();
        let force = self.force_fallback();
        let ahead_by_code = self.compiling_ahead() != self.0.ahead.initially();
        let ahead = match self.compiling_ahead() {
            true => "on",
            false if !platform::WORKER_THREAD => "off (no threads here)",
            false if !ahead_by_code && env.compile_ahead.is_none() => "off (kernels run on the host's cores)",
            false => "off",
        };
        let listed =
            if force.is_empty() { "none".to_string() } else { force.iter().cloned().collect::<Vec<_>>().join(",") };
        report.apply([
            Setting::new(
                "LAZULI_VALIDATE",
                if validate { "cpu" } else { "off" },
                source(validate != env.validate, "LAZULI_VALIDATE"),
            ),
            Setting::new("LAZULI_FORCE_FALLBACK", listed, source(force != env.force_fallback, "LAZULI_FORCE_FALLBACK")),
            Setting::new("LAZULI_COMPILE_AHEAD", ahead, source(ahead_by_code, "LAZULI_COMPILE_AHEAD")),
        ]);
        report.apply(self.0.cpu.settings());
        report.apply(self.0.main.settings());
        report
    }

    /// The device's name, e.g. "cpu" or "wgpu: llvmpipe (Vulkan, Cpu)".
    pub fn name(&self) -> String {
        self.0.main.name()
    }

    /// The backend family.
    pub fn kind(&self) -> BackendKind {
        self.0.main.kind()
    }

    /// The main backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.0.main
    }

    /// True if both handles are the same device.
    pub fn same(&self, other: &Device) -> bool {
        self.0.id == other.0.id
    }

    /// Number of live tensors (handles not yet dropped) on this device.
    pub fn live_tensors(&self) -> usize {
        self.0.live.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Compile-cache misses and hits of syncs on this device, as
    /// `(uncached, cached)`: the misses are the plans compiled, new
    /// structures (`UncachedCompile`) and size variants of known ones
    /// (`SizeVariantCompile`) alike (the process-wide counters sum all
    /// devices).
    pub fn compile_counts(&self) -> (u64, u64) {
        (self.0.uncached.load(Ordering::Relaxed), self.0.cached.load(Ordering::Relaxed))
    }

    /// Number of compiled plans in the compile cache.
    pub fn cached_plans(&self) -> usize {
        self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Bytes held by the main backend's buffer pool.
    pub fn pool_bytes(&self) -> u64 {
        self.0.main.pool_bytes()
    }

    /// Bytes of the main backend's buffers in use now (the gauge a memory
    /// budget is checked against; freed buffers a pool keeps are not in
    /// use). The CPU fallback's buffers are not counted.
    pub fn bytes_in_use(&self) -> u64 {
        self.0.main.bytes_in_use()
    }

    /// Turns compiling size variants ahead of time on or off (see
    /// `LAZULI_COMPILE_AHEAD`): where the sizes of a structure keep
    /// one step (a growing context), the next size's plan is compiled on
    /// a thread of its own while the current one runs (steps count from
    /// the sizes compiled while it is on). Off drops a prediction not
    /// started yet. Where the platform has no threads, it stays off.
    pub fn set_compile_ahead(&self, on: bool) {
        self.0.ahead.set(on && platform::WORKER_THREAD);
    }

    /// True while size variants are compiled ahead of time.
    pub fn compiling_ahead(&self) -> bool {
        self.0.ahead.is_on()
    }

    /// Size variants this device compiled ahead of time, as `(compiled,
    /// used)`: plans compiled and cached, and of those the ones a sync
    /// then used (the rest were predictions no sync asked for). Used
    /// ones count as cache hits in [`Device::compile_counts`].
    pub fn compiled_ahead(&self) -> (u64, u64) {
        self.0.ahead.counts()
    }

    /// Forces nodes of the named ops (e.g. "exp", "matmul") onto the CPU
    /// fallback, as `LAZULI_FORCE_FALLBACK=exp,matmul` does. Plans compiled
    /// before the call keep their partition, so the cache is cleared.
    pub fn set_force_fallback(&self, ops: &[&str]) {
        *self.0.force_fallback.write().unwrap_or_else(|e| e.into_inner()) = ops.iter().map(|s| s.to_string()).collect();
        self.0.ahead.invalidate();
        self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Fault injection (tests): the next `n` executions on this device fail
    /// with a device error, raised at the next barrier.
    pub fn fail_next_executions(&self, n: usize) {
        self.0.shared.faults.lock().unwrap_or_else(|e| e.into_inner()).fail_next = n;
    }

    /// Fault injection (tests): the next execution on this device panics
    /// inside the worker, as a backend bug would; the panic becomes an error
    /// at the next barrier and the device keeps working.
    pub fn panic_next_execution(&self) {
        self.0.shared.faults.lock().unwrap_or_else(|e| e.into_inner()).panic_next = true;
    }

    /// Fault injection (tests): delay every execution on this device by `d`.
    pub fn set_execution_delay(&self, d: Option<std::time::Duration>) {
        self.0.shared.faults.lock().unwrap_or_else(|e| e.into_inner()).delay = d;
    }

    /// Shadow validation, as `LAZULI_VALIDATE=cpu` turns on: every plan
    /// also runs on the CPU reference backend and each kernel's outputs are
    /// compared; the first disagreeing kernel is returned at the barrier as
    /// [`ExecError::Validation`] with its IR nodes, their source locations
    /// and its source. Slow: for debugging, not production.
    pub fn set_validate(&self, on: bool) {
        self.0.shared.validate.store(on, Ordering::Relaxed);
    }

    /// True while shadow validation is on.
    pub fn validating(&self) -> bool {
        self.0.shared.validate.load(Ordering::Relaxed)
    }

    /// Registers what runs the collectives ([`lazuli_ir::Op::AllReduce`])
    /// of this device's plans (`lazuli-distributed` registers its process
    /// group's). A plan with a collective fails to compile on a device
    /// without one.
    pub fn set_collective(&self, collective: Arc<dyn crate::Collective>) {
        *self.0.shared.collective.write().unwrap_or_else(|e| e.into_inner()) = Some(collective);
    }

    /// True if a [`crate::Collective`] is registered.
    pub fn has_collective(&self) -> bool {
        self.0.shared.collective.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    pub(crate) fn force_fallback(&self) -> BTreeSet<String> {
        self.0.force_fallback.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Seeds the device RNG and restarts its step counter.
    pub fn manual_seed(&self, seed: u64) {
        *self.0.rng.lock().unwrap_or_else(|e| e.into_inner()) = RngState { seed, step: 0, offset: 0 };
    }

    /// The RNG state now: seed, step counter and the number of random ops
    /// recorded in the current step.
    pub fn rng_state(&self) -> RngState {
        *self.0.rng.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Restores an RNG state read by [`Device::rng_state`] (on this device
    /// or another of any backend: streams depend on the state only), so the
    /// next random op draws what it would have drawn there.
    pub fn set_rng_state(&self, state: RngState) {
        *self.0.rng.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }

    /// Waits until every submitted execution has finished (LTC's
    /// WaitDeviceOps) and returns the first asynchronous failure since the
    /// last `wait` that no read has reported yet, if any (reading a value
    /// whose computation failed reports that failure). Where the device
    /// cannot be waited for without blocking (a browser tab, see
    /// [`crate::platform`]), [`BackendError::WouldBlock`]: use
    /// [`Device::wait_async`].
    pub fn wait(&self) -> Result<()> {
        self.wait_for_jobs();
        let started = Instant::now();
        let finished = self.0.main.finish();
        metrics::record_time("DeviceWait", started.elapsed());
        self.finished(finished)
    }

    /// [`Device::wait`] without blocking the caller where the device works
    /// asynchronously (a browser tab): the future yields until the device
    /// is done. On native targets it blocks like [`Device::wait`].
    pub async fn wait_async(&self) -> Result<()> {
        self.wait_for_jobs();
        let finished = self.0.main.finish_async().await;
        self.finished(finished)
    }

    /// Blocks until the worker has run every job handed to it (none is
    /// ever outstanding where the caller runs them).
    fn wait_for_jobs(&self) {
        let started = Instant::now();
        let shared = &self.0.shared;
        let mut n = shared.outstanding.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = shared.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        drop(n);
        metrics::record_time("BarrierWait", started.elapsed());
    }

    /// The end of a wait: the backend's own error (`finished`), else the
    /// first unreported failure.
    fn finished(&self, finished: std::result::Result<(), BackendError>) -> Result<()> {
        finished.map_err(|source| ExecError::Backend { context: "waiting for the device".into(), source })?;
        let shared = &self.0.shared;
        let mut unreported = shared.unreported.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::take(&mut *unreported).into_iter().next() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Notes that a barrier returned the failure of job `job`.
    fn reported(&self, job: Option<u64>) {
        if let Some(job) = job {
            self.0.shared.unreported.lock().unwrap_or_else(|e| e.into_inner()).retain(|(j, _)| *j != job);
        }
    }

    /// An empty host vector with room for `n` elements, for `op`'s copy of
    /// a tensor's values on the host; a refused allocation is a typed
    /// out-of-memory error, never an abort.
    pub(crate) fn host_vec<T>(&self, n: usize, op: &str) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| ExecError::Backend {
            context: format!("{op}: copying a tensor's values on the host"),
            source: BackendError::OutOfMemory {
                bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
                in_use: self.bytes_in_use(),
                device: format!("{}: the host allocator refused the request", self.name()),
            },
        })?;
        Ok(v)
    }

    /// Syncs every live tensor with pending IR in one graph and advances the
    /// step RNG (LTC's MarkStep). Returns without waiting for the device.
    ///
    /// Call it once per iteration of a loop that carries values from one
    /// iteration to the next (a training loop's parameters): without a
    /// sync point the pending graph grows across iterations until the
    /// graph size limit cuts it, and each cut compiles a new graph (a
    /// warning says so). An optimizer's `step()` marks the step itself
    /// when the program does not (see `lazuli::optim`).
    #[track_caller]
    pub fn mark_step(&self) -> Result<()> {
        self.0.program_marks.fetch_add(1, Ordering::Relaxed);
        self.mark_step_at("mark_step", std::panic::Location::caller())
    }

    /// [`Device::mark_step`] on behalf of library code that ends a step
    /// (an optimizer's `step()` where the program marks no step of its
    /// own): the same sync, named in metrics and errors as by `what` at
    /// the caller's line, and not counted in [`Device::program_marks`].
    #[track_caller]
    pub fn auto_mark_step(&self, what: &str) -> Result<()> {
        self.mark_step_at(&format!("mark_step by {what}"), std::panic::Location::caller())
    }

    /// How many times the program called [`Device::mark_step`] on this
    /// device (library code marking a step, [`Device::auto_mark_step`],
    /// does not count): an optimizer compares it between two of its steps
    /// to learn whether the program marks steps itself.
    pub fn program_marks(&self) -> u64 {
        self.0.program_marks.load(Ordering::Relaxed)
    }

    fn mark_step_at(&self, what: &str, loc: &'static std::panic::Location<'static>) -> Result<()> {
        let tensors: Vec<crate::Tensor> = {
            let live = self.0.live.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<_> = live.handles().filter_map(|w| w.upgrade()).map(crate::Tensor).collect();
            v.sort_by_key(|t| t.id());
            v
        };
        metrics::inc("MarkStep", 1);
        let refs: Vec<&crate::Tensor> = tensors.iter().collect();
        let r = self.sync_tensors(&refs, &format!("{what} at {}:{}", loc.file(), loc.line()));
        let mut rng = self.0.rng.lock().unwrap_or_else(|e| e.into_inner());
        rng.step += 1;
        rng.offset = 0;
        r
    }

    /// Queues a pending tensor of persistent state (a parameter, a
    /// buffer) to be materialized by the next sync on this device,
    /// whatever that sync is for ([`crate::Tensor::persist`]).
    pub(crate) fn persist_at_next_sync(&self, t: &crate::Tensor) {
        self.0.persist.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::downgrade(&t.0));
        self.0.persist_waiting.store(true, Ordering::Release);
    }

    /// `pairs` and the persistent state still pending on this device
    /// (which this takes off the queue).
    fn with_persisted(&self, pairs: &[(crate::Tensor, Arc<LazyNode>)]) -> Option<Vec<(crate::Tensor, Arc<LazyNode>)>> {
        // A load first: the common case (nothing queued) writes nothing.
        if !self.0.persist_waiting.load(Ordering::Acquire) || !self.0.persist_waiting.swap(false, Ordering::AcqRel) {
            return None;
        }
        let queued = std::mem::take(&mut *self.0.persist.lock().unwrap_or_else(|e| e.into_inner()));
        let mut all = pairs.to_vec();
        for t in queued.iter().filter_map(Weak::upgrade).map(crate::Tensor) {
            let node = t.node();
            if node.is_pending() {
                all.push((t, node));
            }
        }
        Some(all)
    }

    /// Counts a sync forced by the graph size limit at `location` (the
    /// recording that crossed it) and, from the third, warns once that
    /// the program seems to lack a step boundary.
    pub(crate) fn graph_limit_hit(&self, limit: usize, location: &'static std::panic::Location<'static>) {
        let hits = self.0.limit_syncs.fetch_add(1, Ordering::Relaxed) + 1;
        if hits == 3 {
            crate::warn::once(
                &format!("graph-size-limit {}", self.0.id),
                &format!(
                    "the pending graph on {} reached the graph size limit ({limit} nodes) {hits} times, the last \
                     at {}:{}: each time it was synced in the middle of recording and compiled as a new graph, \
                     which makes a loop hundreds of times slower. Does the loop call Device::mark_step() once \
                     per iteration (an optimizer's step() does it for a training loop)? One computation this \
                     large may raise LAZULI_MAX_GRAPH_NODES instead.",
                    self.name(),
                    location.file(),
                    location.line()
                ),
            );
        }
    }

    /// Traces the pending IR of `tensors` into one graph, compiles it (or
    /// takes it from the cache) and submits it to the worker. Outputs get
    /// placeholders at once; the call returns before the device is done.
    /// Tensors that depend on a failed value are not computed: they hold
    /// [`ExecError::Poisoned`], and the first such error is returned once
    /// the others are submitted.
    pub(crate) fn sync_tensors(&self, tensors: &[&crate::Tensor], trigger: &str) -> Result<()> {
        let pairs: Vec<(crate::Tensor, Arc<LazyNode>)> = tensors.iter().map(|t| ((*t).clone(), t.node())).collect();
        self.sync_owned(pairs, trigger)
    }

    /// Syncs the given (tensor, node) pairs: each node is the value of its
    /// tensor as the caller saw it. Afterwards every given node has a
    /// materialized cell; a tensor whose value another thread replaced in
    /// the meantime keeps the newer value (compare-and-swap).
    pub(crate) fn sync_nodes(&self, pairs: &[(crate::Tensor, Arc<LazyNode>)], trigger: &str) -> Result<()> {
        self.sync_owned(pairs.to_vec(), trigger)
    }

    /// [`Device::sync_nodes`] over pairs it owns, with the persistent
    /// state still pending: the traced nodes are dropped before an inline
    /// job runs, so an input only they held (a value just replaced by
    /// `assign`, like a KV cache) is held by the job alone, and donated.
    fn sync_owned(&self, pairs: Vec<(crate::Tensor, Arc<LazyNode>)>, trigger: &str) -> Result<()> {
        let given = pairs.len();
        let pairs = self.with_persisted(&pairs).unwrap_or(pairs);
        crate::timeline::between_syncs();
        let _span = crate::timeline::span("Sync");
        let _guard = self.0.sync_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut inline = None;
        let synced = self.sync_locked(&pairs, trigger, &mut inline);
        if synced.is_err() {
            // What could not be materialized now waits for the next sync.
            for (t, node) in pairs.iter().skip(given) {
                if node.is_pending() {
                    self.persist_at_next_sync(t);
                }
            }
        }
        drop(pairs);
        self.run_inline(inline);
        crate::timeline::sync_ended();
        synced
    }

    /// Runs the job a sync chose to run on its own thread (under the sync
    /// lock: nothing is queued), exactly as the worker would, results and
    /// failures going to the cells and the device the same way.
    fn run_inline(&self, job: Option<Job>) {
        if let Some(job) = job {
            metrics::inc("InlineExecutions", 1);
            execute_job(job, self.0.main.as_ref(), self.0.cpu.as_ref(), &self.0.shared);
        }
    }

    /// [`Device::sync_nodes`] under the sync lock; a job to run on this
    /// thread is left in `inline` for the caller (see [`Device::run_inline`]).
    fn sync_locked(
        &self,
        pairs: &[(crate::Tensor, Arc<LazyNode>)],
        trigger: &str,
        inline: &mut Option<Job>,
    ) -> Result<()> {
        let started = Instant::now();
        // Collect pending roots, deduplicated by node identity.
        let mut roots: Vec<Arc<LazyNode>> = Vec::new();
        // Root index by node identity: mark_step passes every live tensor.
        let mut index: HashMap<usize, usize> = HashMap::new();
        let mut owners: Vec<(crate::Tensor, usize)> = Vec::new();
        for (t, node) in pairs {
            if !t.device().same(self) {
                return Err(ExecError::DeviceMismatch { op: "sync".into(), a: self.name(), b: t.device().name() });
            }
            // An earlier sync (another thread's) may have materialized the
            // node since the caller read it.
            if !node.is_pending() {
                continue;
            }
            let idx = *index.entry(Arc::as_ptr(node) as usize).or_insert_with(|| {
                roots.push(node.clone());
                roots.len() - 1
            });
            owners.push((t.clone(), idx));
        }
        if roots.is_empty() {
            return Ok(());
        }
        // A structure synced before: replay the walk against its graph
        // (which proves the graphs equal) instead of tracing anew.
        let key = roots_key(&roots);
        let replayed = {
            let recent = self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).replay(key);
            recent.and_then(|plan| replay(&roots, &plan.graph).map(|t| (t, plan)))
        };
        let (traced, replayed) = match replayed {
            Some((t, plan)) => (t, Some(plan)),
            None => (trace(&roots), None),
        };
        metrics::record_time("Trace", started.elapsed());
        // Values whose computation already failed: the roots needing them
        // are not run.
        let mut failed: HashMap<u64, (ExecError, Option<u64>)> = HashMap::new();
        for cell in &traced.inputs {
            debug_assert_eq!(cell.device_id, self.0.id, "record_on rejects operands of other devices");
            if let CellState::Failed { error, job } = &*cell.state.lock().unwrap_or_else(|e| e.into_inner()) {
                failed.insert(cell.id, (error.clone(), *job));
            }
        }
        if !failed.is_empty() {
            return self.sync_around_failures(pairs, &failed, trigger, inline);
        }
        let looked_up = Instant::now();
        let plan = match replayed {
            Some(plan) => {
                metrics::inc("TraceReplays", 1);
                self.cache_hit();
                plan
            }
            None => {
                let plan = self.lookup_or_compile(&traced, trigger)?;
                self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).remember_replay(key, plan.clone());
                plan
            }
        };
        let submitting = Instant::now();
        metrics::record_time("Lookup", submitting - looked_up);
        metrics::inc("SyncedTensors", owners.len() as u64);
        metrics::record_value("GraphSize", plan.graph.len() as f64);
        metrics::record_value("KernelsPerPlan", plan.kernel_count() as f64);
        // Install placeholders.
        let outputs: Vec<Arc<DataCell>> =
            roots.iter().map(|r| DataCell::new(self.0.id, r.ty.clone(), CellState::Pending)).collect();
        for (root, cell) in roots.iter().zip(&outputs) {
            root.materialize(cell.clone());
        }
        for (t, idx) in &owners {
            // Only if the tensor still holds the traced node: another
            // thread may have assigned it a newer value meanwhile, which
            // must not be lost (the traced node knows its cell anyway).
            t.replace_node_if(&roots[*idx], Arc::new(LazyNode::data(outputs[*idx].clone(), roots[*idx].location)));
        }
        let hash = plan.hash;
        let context = format!(
            "executing graph {hash:016x} ({} nodes, {} kernels), synced by {trigger}",
            plan.graph.len(),
            plan.kernel_count()
        );
        let Traced { inputs, scalars, locations, .. } = traced;
        let idle = {
            let mut n = self.0.shared.outstanding.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            *n == 1
        };
        let id = NEXT_JOB.fetch_add(1, Ordering::Relaxed);
        let job = Job { id, plan, inputs, scalars, outputs, context, locations, ran: Default::default() };
        if !platform::WORKER_THREAD || (idle && self.inline(&job.plan)) {
            // Nothing queued (the sync lock keeps it so): this thread runs
            // the job once the caller has let go of the traced nodes.
            *inline = Some(job);
        } else {
            self.0.tx.as_ref().expect("worker channel open while the device lives").send(job).map_err(|_| {
                ExecError::Invalid { op: trigger.to_string(), detail: "the device worker has stopped".into() }
            })?;
        }
        metrics::record_time("Submit", submitting.elapsed());
        Ok(())
    }

    /// Whether a plan runs on the syncing thread when the device is idle:
    /// on the CPU backend, small plans ([`INLINE_MAX_WORK`]), unless shadow
    /// validation or an injected delay asks for the worker.
    fn inline(&self, plan: &Plan) -> bool {
        let shared = &self.0.shared;
        self.0.main.kind() == BackendKind::Cpu
            && plan.work <= INLINE_MAX_WORK
            && !plan.has_collectives()
            && !shared.validate.load(Ordering::Relaxed)
            && shared.faults.lock().unwrap_or_else(|e| e.into_inner()).delay.is_none()
    }

    /// The sync of `pairs` when some of the values they read have failed
    /// (`failed`: by cell id, the failure and the job that failed): each
    /// root needing a failed value gets a cell holding
    /// [`ExecError::Poisoned`] (so it is not retried, and later syncs that
    /// do not need it are not blamed for it), the other roots are synced
    /// as usual, and the first poisoned root's error is returned.
    fn sync_around_failures(
        &self,
        pairs: &[(crate::Tensor, Arc<LazyNode>)],
        failed: &HashMap<u64, (ExecError, Option<u64>)>,
        trigger: &str,
        inline: &mut Option<Job>,
    ) -> Result<()> {
        let mut memo: HashMap<*const LazyNode, Option<u64>> = HashMap::new();
        // Roots given a failed cell here (a node may be the value of
        // several tensors).
        let mut poisoned: HashMap<*const LazyNode, Arc<DataCell>> = HashMap::new();
        let mut healthy = Vec::new();
        let mut first: Option<ExecError> = None;
        for (t, node) in pairs {
            let cell = match poisoned.get(&Arc::as_ptr(node)) {
                Some(cell) => cell.clone(),
                None if !node.is_pending() => continue,
                None => {
                    let Some(cell_id) = failed_input(node, failed, &mut memo) else {
                        healthy.push((t.clone(), node.clone()));
                        continue;
                    };
                    let (cause, job) = &failed[&cell_id];
                    self.reported(*job);
                    let error = ExecError::Poisoned { op: trigger.to_string(), cause: Box::new(cause.clone()) };
                    first.get_or_insert(error.clone());
                    let cell = DataCell::new(self.0.id, node.ty.clone(), CellState::Failed { error, job: None });
                    node.materialize(cell.clone());
                    poisoned.insert(Arc::as_ptr(node), cell.clone());
                    cell
                }
            };
            t.replace_node_if(node, Arc::new(LazyNode::data(cell, node.location)));
        }
        self.sync_locked(&healthy, trigger, inline)?;
        first.map_or(Ok(()), Err)
    }

    fn lookup_or_compile(&self, traced: &Traced, trigger: &str) -> Result<Arc<Plan>> {
        if let Some(e) = &self.0.config_error {
            return Err(ExecError::Config(e.clone()));
        }
        let hash = traced.graph.structural_hash();
        let lookup = || self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).get(hash, &traced.graph);
        // A graph being compiled ahead is waited for, not compiled twice.
        let cached = lookup().or_else(|| {
            let waited = self.0.ahead.settle(hash).then(lookup).flatten();
            if waited.is_some() {
                metrics::inc("AheadWaits", 1);
            }
            waited
        });
        if let Some(plan) = cached {
            self.cache_hit();
            if plan.lineage.unused_ahead.swap(false, Ordering::Relaxed) {
                self.0.ahead.used();
                self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).used_ahead(&plan);
                self.dump(hash, traced, &plan);
                self.foresee(&plan, true);
            }
            return Ok(plan);
        }
        self.0.uncached.fetch_add(1, Ordering::Relaxed);
        let _span =
            tracing::debug_span!("compile", hash = format_args!("{hash:016x}"), nodes = traced.graph.len()).entered();
        self.0.explainer.lock().unwrap_or_else(|e| e.into_inner()).on_miss(&traced.graph, &traced.locations, trigger);
        let started = Instant::now();
        let force = self.0.force_fallback.read().unwrap_or_else(|e| e.into_inner()).clone();
        let earlier = self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).earlier_sizes(&traced.graph, hash);
        // A new structure, or a known one at new sizes (timed on its own:
        // its host cost is what a growing sequence pays per size).
        let counter = if earlier.is_some() { "SizeVariantCompile" } else { "UncachedCompile" };
        metrics::inc(counter, 1);
        let context = || format!("compiling graph {hash:016x} ({} nodes) for {trigger}", traced.graph.len());
        if let Some(n) = traced.graph.nodes().iter().find(|n| n.op.is_collective()) {
            if !self.has_collective() {
                let lazuli_ir::Op::AllReduce { bucket, .. } = n.op else { unreachable!("the one collective") };
                let source = crate::CollectiveError::new(crate::runtime::plan::NO_COLLECTIVE);
                let source = BackendError::Collective { op: n.op.name(), bucket, source };
                return Err(ExecError::Backend { context: context(), source });
            }
        }
        let mut plan =
            Plan::compile(traced.graph.clone(), self.0.main.as_ref(), self.0.cpu.as_ref(), &force, earlier.as_deref())
                .map_err(|source| ExecError::Backend { context: context(), source })?;
        metrics::record_time("Compile", started.elapsed());
        if earlier.is_some() {
            metrics::record_time("SizeVariantCompile", started.elapsed());
        }
        // A step of the sizes seen twice in a row predicts the next size
        // (looked for only while sizes are compiled ahead).
        if self.0.ahead.is_on() {
            plan.lineage.step =
                earlier.as_ref().and_then(|e| crate::runtime::compile_ahead::step_between(&e.graph, &plan.graph));
        }
        let confirmed = plan.lineage.step.is_some() && earlier.is_some_and(|e| e.lineage.step == plan.lineage.step);
        let plan = Arc::new(plan);
        self.dump(hash, traced, &plan);
        self.0.cache.lock().unwrap_or_else(|e| e.into_inner()).insert(plan.clone());
        self.foresee(&plan, confirmed);
        Ok(plan)
    }

    /// Asks for the size after `plan`'s to be compiled ahead of time,
    /// where its step is `confirmed` (see [`crate::runtime::compile_ahead`]).
    fn foresee(&self, plan: &Arc<Plan>, confirmed: bool) {
        if confirmed && self.0.ahead.is_on() {
            let force = self.0.force_fallback.read().unwrap_or_else(|e| e.into_inner()).clone();
            self.0.ahead.foresee(plan, force);
        }
    }

    /// Writes `plan`'s dump where `LAZULI_DUMP_DIR` asks for one (when it
    /// is compiled, or first used where it was compiled ahead).
    fn dump(&self, hash: u64, traced: &Traced, plan: &Plan) {
        if let Some(dir) = &self.0.dump_dir {
            if let Err(e) = dump_plan(dir, hash, traced, plan) {
                tracing::warn!(dir = %dir.display(), error = %e, "LAZULI_DUMP_DIR: could not write the dump");
            }
        }
    }

    /// Counts a compile-cache hit.
    fn cache_hit(&self) {
        metrics::inc("CachedCompile", 1);
        self.0.cached.fetch_add(1, Ordering::Relaxed);
    }

    /// Resolves a ready cell to its buffer (barrier), uploading host data;
    /// a failed cell is [`ExecError::Failed`] around its failure, which
    /// this reports.
    pub(crate) fn buffer_of(&self, cell: &DataCell, op: &str) -> Result<Buffer> {
        let started = Instant::now();
        let mut st = cell.wait();
        metrics::record_time("BarrierWait", started.elapsed());
        if let CellState::Failed { error, job } = &*st {
            self.reported(*job);
            return Err(ExecError::Failed { op: op.to_string(), cause: Box::new(error.clone()) });
        }
        resolve(&mut st, &cell.ty, self.0.main.as_ref(), self.0.cpu.as_ref(), op)
    }

    /// Reads the canonical bytes of a cell (barrier + download).
    pub(crate) fn read_cell(&self, cell: &DataCell, op: &str) -> Result<Vec<u8>> {
        let (owner, buf) = match self.readable(cell, op)? {
            Readable::Host(bytes) => return Ok(bytes),
            Readable::Device(owner, buf) => (owner, buf),
        };
        let started = Instant::now();
        let bytes = owner.download(&buf);
        metrics::record_time("Download", started.elapsed());
        self.downloaded(bytes, op)
    }

    /// [`Device::read_cell`] without blocking the caller where the device
    /// works asynchronously (see [`crate::platform`]).
    pub(crate) async fn read_cell_async(&self, cell: &DataCell, op: &str) -> Result<Vec<u8>> {
        let (owner, buf) = match self.readable(cell, op)? {
            Readable::Host(bytes) => return Ok(bytes),
            Readable::Device(owner, buf) => (owner, buf),
        };
        let started = Instant::now();
        let bytes = owner.download_async(&buf).await;
        metrics::record_time("Download", started.elapsed());
        self.downloaded(bytes, op)
    }

    /// A cell's host bytes, or its buffer and the backend holding it
    /// (after the barrier).
    fn readable(&self, cell: &DataCell, op: &str) -> Result<Readable<'_>> {
        {
            let st = cell.state.lock().unwrap_or_else(|e| e.into_inner());
            if let CellState::Host(bytes) = &*st {
                let mut v = self.host_vec(bytes.len(), op)?;
                v.extend_from_slice(bytes);
                return Ok(Readable::Host(v));
            }
        }
        let buf = self.buffer_of(cell, op)?;
        let owner = if buf.kind == self.0.cpu.kind() { &self.0.cpu } else { &self.0.main };
        Ok(Readable::Device(owner, buf))
    }

    /// The result of a download, counted.
    fn downloaded(&self, bytes: std::result::Result<Vec<u8>, BackendError>, op: &str) -> Result<Vec<u8>> {
        let bytes =
            bytes.map_err(|source| ExecError::Backend { context: format!("{op}: reading back a tensor"), source })?;
        metrics::record_value("BytesDownloaded", bytes.len() as f64);
        Ok(bytes)
    }
}

/// What reading a cell starts from.
enum Readable<'d> {
    /// Host data, copied.
    Host(Vec<u8>),
    /// A buffer and the backend that holds it.
    Device(&'d Arc<dyn Backend>, Buffer),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.name())
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Nothing compiles ahead past the device (nor into the backends'
        // persisted caches).
        self.ahead.stop();
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        self.main.persist_caches();
        if crate::timeline::enabled() {
            // The last execution's kernels reach the timeline once it is
            // seen done.
            let _ = self.main.finish();
        }
        if let Err(e) = crate::timeline::flush() {
            tracing::warn!("LAZULI_TRACE: could not write the timeline: {e}");
        }
    }
}

/// Writes `<hash>.ir.txt`, `<hash>.dot` and one `<hash>.<kernel>.wgsl`
/// per kernel of a newly compiled graph.
fn dump_plan(dir: &std::path::Path, hash: u64, traced: &Traced, plan: &Plan) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut ir = traced.graph.to_text();
    ir.push_str("\n# optimized\n");
    ir.push_str(&plan.optimized.to_text());
    for (k, seg) in plan.segments.iter().enumerate() {
        let side = if seg.on_cpu { "cpu fallback" } else { "native" };
        ir.push_str(&format!("\n# segment {k} ({side})\n{}", seg.graph.to_text()));
    }
    std::fs::write(dir.join(format!("{hash:016x}.ir.txt")), ir)?;
    std::fs::write(dir.join(format!("{hash:016x}.dot")), traced.graph.to_dot())?;
    for (i, (name, src)) in plan.kernel_sources().iter().enumerate() {
        let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
        std::fs::write(dir.join(format!("{hash:016x}.{i:02}_{safe}.wgsl")), src)?;
    }
    Ok(())
}

/// The id of a failed cell (a key of `failed`) that `node`'s pending
/// subgraph reads, if any; `memo` caches the answer per node.
fn failed_input(
    node: &Arc<LazyNode>,
    failed: &HashMap<u64, (ExecError, Option<u64>)>,
    memo: &mut HashMap<*const LazyNode, Option<u64>>,
) -> Option<u64> {
    // Iterative post-order walk: graphs can be thousands of nodes deep.
    let mut stack: Vec<(&Arc<LazyNode>, bool)> = vec![(node, false)];
    while let Some((n, expanded)) = stack.pop() {
        let key = Arc::as_ptr(n);
        if memo.contains_key(&key) {
            continue;
        }
        if let Some(cell) = n.cell() {
            memo.insert(key, failed.contains_key(&cell.id).then_some(cell.id));
        } else if expanded {
            let hit = n.operands.iter().find_map(|o| memo.get(&Arc::as_ptr(o)).copied().flatten());
            memo.insert(key, hit);
        } else {
            stack.push((n, true));
            stack.extend(n.operands.iter().map(|o| (o, false)));
        }
    }
    memo.get(&Arc::as_ptr(node)).copied().flatten()
}

/// Turns a ready or host cell state into a buffer, uploading host data
/// once. Host data goes to the main backend, or to the CPU backend when the
/// main one cannot hold its dtype (f64, i64 ... on wgpu); plans move it
/// across at segment boundaries.
fn resolve(
    st: &mut CellState,
    ty: &lazuli_ir::ValueType,
    main: &dyn Backend,
    cpu: &dyn Backend,
    op: &str,
) -> Result<Buffer> {
    match st {
        CellState::Ready(b) => Ok(b.clone()),
        CellState::Host(bytes) => {
            let buf = match main.upload(bytes, ty) {
                Err(BackendError::Unsupported { .. }) => cpu.upload(bytes, ty),
                other => other,
            }
            .map_err(|source| ExecError::Backend { context: format!("{op}: uploading host data"), source })?;
            metrics::record_value("BytesUploaded", bytes.len() as f64);
            *st = CellState::Ready(buf.clone());
            Ok(buf)
        }
        CellState::Pending => unreachable!("resolve is called after the barrier"),
        CellState::Failed { .. } => unreachable!("callers handle failed cells"),
    }
}

fn worker_loop(rx: Receiver<Job>, main: Arc<dyn Backend>, cpu: Arc<dyn Backend>, shared: Arc<Shared>) {
    for job in rx {
        execute_job(job, main.as_ref(), cpu.as_ref(), &shared);
    }
}

/// Runs `job` (on the worker thread, or inline on the syncing thread of an
/// idle device), fills its output cells with the results or the failure,
/// and counts it finished.
fn execute_job(job: Job, main: &dyn Backend, cpu: &dyn Backend, shared: &Shared) {
    let _span = tracing::debug_span!("execute", context = %job.context).entered();
    let started = Instant::now();
    // A panic inside a backend (a bug) must not kill the worker: every
    // later barrier on the device would wait forever. It becomes this
    // job's error, raised at the next barrier like any other.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_job(&job, main, cpu, shared)))
        .unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(ExecError::Backend {
                context: job.context.clone(),
                source: crate::BackendError::Execution(format!("the backend panicked (a bug): {msg}")),
            })
        });
    metrics::record_time("Execute", started.elapsed());
    match result {
        Ok(bufs) => {
            for (cell, buf) in job.outputs.iter().zip(bufs) {
                cell.fill(CellState::Ready(buf));
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "asynchronous execution failed");
            // Listed before the cells are filled: a read woken by the
            // fill must find the failure to mark it reported.
            {
                let mut unreported = shared.unreported.lock().unwrap_or_else(|e| e.into_inner());
                if unreported.len() < MAX_UNREPORTED {
                    unreported.push((job.id, e.clone()));
                }
            }
            for cell in &job.outputs {
                cell.fill(CellState::Failed { error: e.clone(), job: Some(job.id) });
            }
        }
    }
    // The job's buffers are released before it counts as finished, so
    // that memory gauges read after `Device::wait` are exact.
    drop(job);
    let mut n = shared.outstanding.lock().unwrap_or_else(|e| e.into_inner());
    *n -= 1;
    if *n == 0 {
        shared.idle.notify_all();
    }
}

fn run_job(job: &Job, main: &dyn Backend, cpu: &dyn Backend, shared: &Shared) -> Result<Vec<Buffer>> {
    let collective = shared.collective.read().unwrap_or_else(|e| e.into_inner()).clone();
    let result = run_job_with(job, main, cpu, shared, collective.as_deref());
    if result.is_err() && !job.ran.load(Ordering::Relaxed) {
        // The plan did not run: its collectives still start (with the
        // failure flag) so that no peer waits for this rank.
        job.plan.join_failed(collective.as_deref());
    }
    result
}

fn run_job_with(
    job: &Job,
    main: &dyn Backend,
    cpu: &dyn Backend,
    shared: &Shared,
    collective: Option<&dyn crate::Collective>,
) -> Result<Vec<Buffer>> {
    let mut inputs = Vec::with_capacity(job.inputs.len());
    for cell in &job.inputs {
        let mut st = cell.wait();
        if let CellState::Failed { error, job: failed_job } = &*st {
            // An input failed after this job was submitted: the job is not
            // run, and its own failure includes (so reports) the cause.
            if let Some(failed_job) = failed_job {
                shared.unreported.lock().unwrap_or_else(|e| e.into_inner()).retain(|(j, _)| j != failed_job);
            }
            return Err(ExecError::Poisoned { op: job.context.clone(), cause: Box::new(error.clone()) });
        }
        let buf = resolve(&mut st, &cell.ty, main, cpu, &job.context)?;
        // Donation: if this job holds the only reference to the cell, nobody
        // can read the old value again (e.g. a parameter just replaced by
        // `assign`), so its buffer leaves the cell and the backend receives
        // it uniquely held: it may reuse it, and it returns to the pool as
        // soon as the plan has run.
        if Arc::strong_count(cell) == 1 {
            *st = CellState::Failed {
                error: ExecError::Invalid {
                    op: "read".into(),
                    detail: "the value was donated to a later computation".into(),
                },
                job: None,
            };
            metrics::inc("DonatedBuffers", 1);
        }
        inputs.push(buf);
    }
    crate::runtime::fault::before_execute(&shared.faults, &job.context)?;
    job.ran.store(true, Ordering::Relaxed);
    if shared.validate.load(Ordering::Relaxed) {
        let (plan, scalars, locations) = (&job.plan, &job.scalars, &job.locations);
        let context = &job.context;
        return crate::runtime::shadow_run::run_validated(
            plan, inputs, scalars, main, cpu, locations, context, collective,
        );
    }
    job.plan.run(inputs, &job.scalars, main, cpu, collective).map_err(|source| {
        let context = match &source {
            BackendError::IndexOutOfRange(e) => {
                format!("{}; {}", job.context, index_recorded_at(&job.plan.graph, &job.locations, e))
            }
            _ => job.context.clone(),
        };
        ExecError::Backend { context, source }
    })
}

/// Where the op of an index error was recorded (its node is found by op,
/// indexed axis and data shape; a graph may hold several such), and what
/// recorded it where a layer said so ([`crate::api::compose`]'s `embedding`).
fn index_recorded_at(
    graph: &lazuli_ir::Graph,
    locations: &[&'static std::panic::Location<'static>],
    e: &crate::IndexError,
) -> String {
    let mut sites: Vec<String> = Vec::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        let axis = match node.op {
            lazuli_ir::Op::Gather { axis } | lazuli_ir::Op::ScatterAdd { axis } => axis,
            _ => continue,
        };
        let data = node.inputs.first().map(|d| &graph.nodes()[d.0 as usize].shape);
        if node.op.name() != e.op || axis != e.axis || data != Some(&e.shape) {
            continue;
        }
        let Some(loc) = locations.get(i) else { continue };
        let mut site = format!("{}:{}", loc.file(), loc.line());
        if let Some(what) = crate::api::compose::recorded_by(loc) {
            site = format!("{site} ({what})");
        }
        if !sites.contains(&site) {
            sites.push(site);
        }
    }
    match sites.len() {
        0 => format!("the failing {} is not in the graph as recorded", e.op),
        1 => format!("the {} was recorded at {}", e.op, sites[0]),
        _ => format!("the {} was recorded at one of {}", e.op, sites.join(", ")),
    }
}
