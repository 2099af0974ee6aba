//! Size variants compiled ahead of time: where the sizes of a structure
//! move by the same step twice in a row (a growing context: 12, 13, 14
//! tokens), the next [`DEPTH`] sizes' plans are compiled on threads of
//! their own while the current one runs, so the step that needs one
//! finds it in the compile cache instead of compiling on its own path.
//! Several sizes at once, because a size variant's compile (a few
//! milliseconds of host time) can take longer than a step of a small
//! model on a GPU (under a millisecond): one thread compiling one size
//! ahead would set the loop's pace; [`DEPTH`] of them, on a GPU host's
//! idle cores, keep ahead of it.
//!
//! A graph's *free sizes* are the integers its sizes follow from: the
//! parameters' dimensions and the size attributes of its ops (the shapes
//! of `Iota`, `Random`, `Reshape` and `Expand`, the starts and lengths of
//! `Slice`, the padding of `Pad`); every node's shape is inferred from
//! them. Two plans of one structure are a *step* apart when rebuilding
//! the earlier graph with the later one's free sizes gives the later
//! graph exactly (so they differ in nothing else). When a size variant is
//! the same step from its predecessor as that one was from its own, the
//! sync queues a request and goes on; on the compile-ahead thread the
//! graph one more step on is rebuilt (every node's type inferred again;
//! a size that would turn negative, or an op that rejects the new sizes,
//! predicts nothing) and, unless the cache has it, compiled with the
//! current plan as its `CompileHints::earlier`, as the sync would have
//! compiled it (the sizes two and three steps on likewise, by other
//! threads). A plan compiled ahead, when a sync first uses it, predicts
//! the next ones the same way (those already cached or being compiled
//! are skipped), so a sequence that keeps its step compiles on its own
//! path only its first three sizes.
//!
//! Sound by construction: a plan compiled ahead is only ever found by a
//! sync whose traced graph is equal to the predicted one (the compile
//! cache checks graph equality on every hit), so a wrong prediction costs
//! a background compile, never a result. A sync that misses the cache
//! while a request is waiting or being rebuilt, or while its very graph
//! is being compiled, waits for that rather than compiling it twice.
//! Clearing the cache (`Device::set_force_fallback`) drops a waiting
//! request and discards a plan being compiled. A plan compiled
//! ahead becomes its structure's last plan (what the next size variant
//! compiles against) only once a sync uses it. A device's drop
//! stops and joins the thread before the backends persist their caches.
//!
//! On by default where the main backend says background compiles pay
//! ([`crate::Backend::compiles_ahead`]: a GPU adapter, whose host cores
//! are idle while its kernels run) and the platform has threads;
//! `LAZULI_COMPILE_AHEAD` or [`crate::Device::set_compile_ahead`]
//! decide otherwise. Counters: `AheadCompiles` (plans compiled ahead),
//! `AheadHits` (of those, the ones a sync used), `AheadWaits` (syncs that
//! waited and then found their plan); timer `AheadCompile`.

use crate::backend::Backend;
use crate::metrics;
use crate::platform::Instant;
use crate::runtime::compile_cache::CompileCache;
use crate::runtime::plan::{Lineage, Plan};
use lazuli_ir::{Graph, Op, Shape, ValueType};
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Sizes compiled ahead of the one a sync uses, each on a thread of its
/// own.
pub const DEPTH: usize = 3;

/// The free sizes of `g`, in a fixed order (see the module doc).
pub(crate) fn free_sizes(g: &Graph) -> Vec<i64> {
    let mut sizes = Vec::new();
    let dims = |s: &Shape, sizes: &mut Vec<i64>| sizes.extend(s.dims().iter().map(|&d| d as i64));
    for p in &g.params {
        dims(&p.shape, &mut sizes);
    }
    for n in g.nodes() {
        match &n.op {
            Op::Iota { shape, .. } | Op::Random { shape, .. } | Op::Reshape(shape) | Op::Expand(shape) => {
                dims(shape, &mut sizes)
            }
            Op::Slice { starts, lens, .. } => {
                sizes.extend_from_slice(starts);
                sizes.extend(lens.iter().map(|&l| l as i64));
            }
            Op::Pad { before, after, .. } => sizes.extend(before.iter().chain(after).map(|&p| p as i64)),
            _ => {}
        }
    }
    sizes
}

/// Reads free sizes in [`free_sizes`]'s order.
struct Sizes<'a>(std::slice::Iter<'a, i64>);

impl Sizes<'_> {
    /// The next size where it is not negative.
    fn size(&mut self) -> Option<usize> {
        self.0.next().and_then(|&v| usize::try_from(v).ok())
    }

    /// The next value, signed (a slice start counts from the end where
    /// negative).
    fn signed(&mut self) -> Option<i64> {
        self.0.next().copied()
    }

    /// A shape of `s`'s rank from the next sizes.
    fn shape(&mut self, s: &Shape) -> Option<Shape> {
        s.dims().iter().map(|_| self.size()).collect::<Option<Vec<usize>>>().map(Shape::new)
    }

    /// `n` sizes.
    fn list(&mut self, n: usize) -> Option<Vec<usize>> {
        (0..n).map(|_| self.size()).collect()
    }
}

/// `g` with its free sizes replaced by `sizes` (in [`free_sizes`]'s
/// order) and every node's type inferred again; `None` where a size does
/// not fit its place (negative where it must not be) or an op rejects
/// the new sizes.
pub(crate) fn with_free_sizes(g: &Graph, sizes: &[i64]) -> Option<Graph> {
    let mut next = Sizes(sizes.iter());
    let mut out = Graph::new();
    for p in &g.params {
        out.params.push(ValueType { shape: next.shape(&p.shape)?, dtype: p.dtype });
    }
    out.scalars = g.scalars.clone();
    out.reserve(g.len());
    for n in g.nodes() {
        let op = match &n.op {
            Op::Iota { shape, axis, dtype } => Op::Iota { shape: next.shape(shape)?, axis: *axis, dtype: *dtype },
            Op::Random { shape, dist } => Op::Random { shape: next.shape(shape)?, dist: *dist },
            Op::Reshape(shape) => Op::Reshape(next.shape(shape)?),
            Op::Expand(shape) => Op::Expand(next.shape(shape)?),
            Op::Slice { starts, steps, lens } => {
                let starts = starts.iter().map(|_| next.signed()).collect::<Option<Vec<i64>>>()?;
                Op::Slice { starts, steps: steps.clone(), lens: next.list(lens.len())? }
            }
            Op::Pad { before, after, mode } => {
                Op::Pad { before: next.list(before.len())?, after: next.list(after.len())?, mode: *mode }
            }
            op => op.clone(),
        };
        out.push(op, &n.inputs).ok()?;
    }
    out.outputs = g.outputs.clone();
    // Every size taken, none left over.
    next.0.next().is_none().then_some(out)
}

/// The step of the free sizes from `earlier` to `now`, where the two
/// graphs differ in nothing else and in at least one free size.
pub(crate) fn step_between(earlier: &Graph, now: &Graph) -> Option<Vec<i64>> {
    let (from, to) = (free_sizes(earlier), free_sizes(now));
    if from.len() != to.len() || from == to {
        return None;
    }
    // Graphs that differ in anything but free sizes (an axis, a
    // permutation, a dtype) do not rebuild into one another.
    if with_free_sizes(earlier, &to).as_ref() != Some(now) {
        return None;
    }
    Some(to.iter().zip(&from).map(|(t, f)| t - f).collect())
}

/// `g` one `step` further on (see [`with_free_sizes`]).
pub(crate) fn predict(g: &Graph, step: &[i64]) -> Option<Graph> {
    let sizes = free_sizes(g);
    if sizes.len() != step.len() {
        return None;
    }
    let next: Option<Vec<i64>> = sizes.iter().zip(step).map(|(s, d)| s.checked_add(*d)).collect();
    with_free_sizes(g, &next?)
}

/// A size to be compiled ahead: `steps` steps on from a plan.
struct Request {
    /// The plan it is a step on from (`CompileHints::earlier`).
    earlier: Arc<Plan>,
    /// The plan's step of the free sizes.
    step: Vec<i64>,
    /// How many steps on (1 to [`DEPTH`]).
    steps: i64,
    force_fallback: BTreeSet<String>,
    /// The cache's epoch when it was made (see [`State::epoch`]).
    epoch: u64,
}

#[derive(Default)]
struct State {
    /// The requests no thread has taken yet (newer ones replace them).
    waiting: VecDeque<Request>,
    /// Threads rebuilding a request's graph.
    predicting: usize,
    /// The hashes of the graphs being compiled.
    compiling: Vec<u64>,
    /// Bumped when the compile cache is cleared: a plan compiled for an
    /// older epoch is discarded.
    epoch: u64,
    stop: bool,
    /// Plans compiled ahead and cached.
    compiled: u64,
}

/// What the compile-ahead thread works with: the device's cache and
/// backends, and the state it shares with the syncs.
struct Shared {
    state: Mutex<State>,
    /// Signalled whenever `waiting`, `predicting` or `compiling` changes
    /// or the thread is to stop.
    changed: Condvar,
    cache: Arc<Mutex<CompileCache>>,
    main: Arc<dyn Backend>,
    cpu: Arc<dyn Backend>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The compile-ahead thread of a device (started at its first request).
pub(crate) struct Ahead {
    on: AtomicBool,
    /// `on` as the device was created.
    initially: bool,
    /// Plans compiled ahead that a sync used.
    used: std::sync::atomic::AtomicU64,
    shared: Arc<Shared>,
    /// The compiling threads (up to [`DEPTH`], started at the first
    /// request).
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Ahead {
    /// Compiling ahead, on or off, into `cache` with the device's
    /// backends.
    pub fn new(on: bool, cache: Arc<Mutex<CompileCache>>, main: Arc<dyn Backend>, cpu: Arc<dyn Backend>) -> Ahead {
        Ahead {
            on: AtomicBool::new(on),
            initially: on,
            used: Default::default(),
            shared: Arc::new(Shared { state: Default::default(), changed: Condvar::new(), cache, main, cpu }),
            threads: Mutex::new(Vec::new()),
        }
    }

    /// A sync used a plan compiled ahead (counted here and as
    /// `AheadHits`).
    pub fn used(&self) {
        self.used.fetch_add(1, Ordering::Relaxed);
        metrics::inc("AheadHits", 1);
    }

    /// Plans compiled ahead and cached, and of those the ones a sync used.
    pub fn counts(&self) -> (u64, u64) {
        (self.shared.lock().compiled, self.used.load(Ordering::Relaxed))
    }

    /// Whether predictions were compiled as the device was created.
    pub fn initially(&self) -> bool {
        self.initially
    }

    /// Whether predictions are compiled.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Turns compiling ahead on or off (off drops the waiting requests;
    /// graphs being compiled finish).
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
        if !on {
            self.shared.lock().waiting.clear();
            // A sync waiting for the dropped request goes on.
            self.shared.changed.notify_all();
        }
    }

    /// Asks for the graphs one to [`DEPTH`] steps on from `plan` (just
    /// compiled or first used, its step seen twice: a plan compiled on
    /// the path whose predecessor took the same step, or a plan compiled
    /// ahead) to be compiled in the background; they replace the requests
    /// no thread took yet. A thread rebuilds each graph and skips it where
    /// the cache has it or another thread compiles it: nothing but the
    /// requests is done on the syncing thread.
    pub fn foresee(&self, plan: &Arc<Plan>, force_fallback: BTreeSet<String>) {
        let (true, Some(step)) = (self.is_on(), plan.lineage.step.as_ref()) else { return };
        {
            let mut state = self.shared.lock();
            if state.stop {
                return;
            }
            let epoch = state.epoch;
            state.waiting = (1..=DEPTH as i64)
                .map(|steps| Request {
                    earlier: plan.clone(),
                    step: step.clone(),
                    steps,
                    force_fallback: force_fallback.clone(),
                    epoch,
                })
                .collect();
        }
        self.shared.changed.notify_all();
        let mut threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        while threads.len() < DEPTH {
            let shared = self.shared.clone();
            match std::thread::Builder::new().name("lazuli-ahead".into()).spawn(move || compile_loop(&shared)) {
                Ok(handle) => threads.push(handle),
                Err(e) if threads.is_empty() => {
                    tracing::warn!("could not start the compile-ahead thread: {e}; sizes compile on the path");
                    self.on.store(false, Ordering::Relaxed);
                    self.shared.lock().waiting.clear();
                    return;
                }
                Err(e) => {
                    tracing::warn!("compiling ahead on {} thread(s): {e}", threads.len());
                    return;
                }
            }
        }
    }

    /// Before a sync compiles graph `hash` itself: while a request is
    /// waiting or being rebuilt (its graph may be this one), or this
    /// graph is being compiled ahead, waits. Returns whether it waited
    /// (the graph may then be in the cache).
    pub fn settle(&self, hash: u64) -> bool {
        let mut state = self.shared.lock();
        let pending = |s: &State| !s.waiting.is_empty() || s.predicting > 0 || s.compiling.contains(&hash);
        if !pending(&state) {
            return false;
        }
        while pending(&state) && !state.stop {
            state = self.shared.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        true
    }

    /// The compile cache is being cleared: drops the waiting requests and
    /// discards the plans being compiled. Call before clearing.
    pub fn invalidate(&self) {
        let mut state = self.shared.lock();
        state.epoch += 1;
        state.waiting.clear();
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Stops the threads and joins them (compiles in progress finish).
    pub fn stop(&self) {
        {
            let mut state = self.shared.lock();
            state.stop = true;
            state.waiting.clear();
        }
        self.shared.changed.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for handle in threads {
            let _ = handle.join();
        }
    }
}

/// A compile-ahead thread: rebuilds each request's graph its steps on
/// and, where the cache lacks it and no other thread compiles it,
/// compiles it and caches its plan.
fn compile_loop(shared: &Shared) {
    loop {
        let request = {
            let mut s = shared.lock();
            loop {
                if s.stop {
                    return;
                }
                if let Some(r) = s.waiting.pop_front() {
                    s.predicting += 1;
                    break r;
                }
                s = shared.changed.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        };
        // A panic here must not leave a sync waiting forever: the state
        // is reset whatever happens.
        let mut compiling = None;
        let done =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compile_one(shared, request, &mut compiling)));
        if done.is_err() {
            tracing::warn!("compiling ahead panicked");
        }
        let mut s = shared.lock();
        match compiling {
            Some(hash) => s.compiling.retain(|&h| h != hash),
            None => s.predicting -= 1,
        }
        drop(s);
        shared.changed.notify_all();
    }
}

/// One request: its graph its steps on, compiled and cached unless the
/// cache has it or another thread compiles it. `compiling` is set to its
/// hash when it moves from rebuilding to compiling.
fn compile_one(shared: &Shared, request: Request, compiling: &mut Option<u64>) {
    let Request { earlier, step, steps, force_fallback, epoch } = request;
    let on: Option<Vec<i64>> = step.iter().map(|d| d.checked_mul(steps)).collect();
    let predicted = on.and_then(|on| predict(&earlier.graph, &on)).map(|g| (g.structural_hash(), g));
    let known = |hash, g: &Graph| shared.cache.lock().unwrap_or_else(|e| e.into_inner()).contains(hash, g);
    let Some((hash, graph)) = predicted.filter(|(hash, g)| !known(*hash, g)) else { return };
    {
        let mut s = shared.lock();
        // Again under the state lock, under which plans compiled ahead
        // are cached: another thread may just have finished this one.
        if s.compiling.contains(&hash) || known(hash, &graph) {
            return;
        }
        s.predicting -= 1;
        s.compiling.push(hash);
        *compiling = Some(hash);
    }
    shared.changed.notify_all();
    // (Its timer is its timeline span too.)
    let started = Instant::now();
    let compiled = Plan::compile(graph, shared.main.as_ref(), shared.cpu.as_ref(), &force_fallback, Some(&earlier));
    metrics::record_time("AheadCompile", started.elapsed());
    match compiled {
        Ok(mut plan) => {
            plan.lineage = Lineage { step: Some(step), unused_ahead: AtomicBool::new(true) };
            let mut s = shared.lock();
            // Under the state lock: a clear bumps the epoch first.
            if s.epoch == epoch && !s.stop {
                shared.cache.lock().unwrap_or_else(|e| e.into_inner()).insert_ahead(Arc::new(plan));
                s.compiled += 1;
                metrics::inc("AheadCompiles", 1);
            }
        }
        Err(e) => tracing::debug!(hash = format_args!("{hash:016x}"), "compiling ahead failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazuli_ir::{BinaryOp, DType, PadMode, ReduceOp};

    /// A graph over a `[t, 8]` input: softmax of a sliced, padded,
    /// reshaped view plus a row sum, all sized by `t`.
    fn growing(t: usize) -> Graph {
        let mut g = Graph::new();
        let x = g.param(ValueType::new(Shape::new([t, 8]), DType::F32));
        let r = g.push(Op::Reshape(Shape::new([t * 2, 4])), &[x]).unwrap();
        let s = g.push(Op::Slice { starts: vec![1, 0], steps: vec![1, 1], lens: vec![t * 2 - 1, 4] }, &[r]).unwrap();
        let fill = g.scalar(DType::F32);
        let p = g.push(Op::Pad { before: vec![1, 0], after: vec![0, 0], mode: PadMode::Constant }, &[s, fill]).unwrap();
        let i = g.push(Op::Iota { shape: Shape::new([t * 2, 4]), axis: 0, dtype: DType::F32 }, &[]).unwrap();
        let a = g.push(Op::Binary(BinaryOp::Add), &[p, i]).unwrap();
        let m = g.push(Op::Softmax { axis: 1, log: false }, &[a]).unwrap();
        let sum = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[m]).unwrap();
        g.outputs = vec![m, sum];
        g
    }

    #[test]
    fn free_sizes_rebuild_the_graph_they_come_from() {
        let g = growing(5);
        assert_eq!(with_free_sizes(&g, &free_sizes(&g)).as_ref(), Some(&g));
        assert_eq!(with_free_sizes(&g, &free_sizes(&growing(9))).as_ref(), Some(&growing(9)));
    }

    #[test]
    fn a_step_predicts_the_next_size_exactly() {
        let step = step_between(&growing(5), &growing(6)).expect("one step apart");
        assert_eq!(predict(&growing(6), &step).as_ref(), Some(&growing(7)));
        let by_three = step_between(&growing(5), &growing(8)).unwrap();
        assert_eq!(predict(&growing(8), &by_three).as_ref(), Some(&growing(11)));
        // Shrinking by one from 2 reaches 1, then nothing: a length of
        // 2 * 0 - 1 cannot be.
        let down = step_between(&growing(3), &growing(2)).unwrap();
        assert_eq!(predict(&growing(2), &down).as_ref(), Some(&growing(1)));
        assert!(predict(&growing(1), &down).is_none());
    }

    #[test]
    fn graphs_that_differ_beyond_sizes_are_no_step_apart() {
        assert!(step_between(&growing(5), &growing(5)).is_none(), "no size moved");
        let mut other = growing(6);
        other.outputs.reverse();
        assert!(step_between(&growing(5), &other).is_none(), "outputs differ");
        let mut g = Graph::new();
        let x = g.param(ValueType::new(Shape::new([6, 8]), DType::F32));
        let s = g.push(Op::Softmax { axis: 0, log: false }, &[x]).unwrap();
        g.outputs = vec![s];
        let mut h = Graph::new();
        let x = h.param(ValueType::new(Shape::new([5, 8]), DType::F32));
        let s = h.push(Op::Softmax { axis: 1, log: false }, &[x]).unwrap();
        h.outputs = vec![s];
        assert!(step_between(&h, &g).is_none(), "an attribute differs");
    }

    #[test]
    fn sizes_an_op_rejects_predict_nothing() {
        // [rows, 6] reshaped to [target]: a step predicts the next size
        // where the target moves with the rows, and nothing where the
        // element counts would disagree.
        let build = |rows: usize, target: usize| {
            let mut g = Graph::new();
            let x = g.param(ValueType::new(Shape::new([rows, 6]), DType::F32));
            let r = g.push(Op::Reshape(Shape::new([target])), &[x]).unwrap();
            g.outputs = vec![r];
            g
        };
        let step = step_between(&build(4, 24), &build(5, 30)).unwrap();
        assert_eq!(predict(&build(5, 30), &step).as_ref(), Some(&build(6, 36)));
        // Rows that step by 1 while the target steps by 7: the next
        // reshape's counts disagree (42 against 36 elements).
        let odd = vec![1, 0, 7];
        assert!(predict(&build(5, 30), &odd).is_none());
    }
}
