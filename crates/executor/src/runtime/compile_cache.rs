//! The compile cache of a device, the one owner of what the executor
//! remembers about compiled graphs:
//! - plans by the exact structural hash of their graph (bounded LRU,
//!   verified by graph equality on a hit);
//! - plans by the structure of the pending graphs of their syncs
//!   (`trace::roots_key`), so a sync of a known structure replays the
//!   trace against the plan's graph instead of tracing anew;
//! - the last plan of each shape-free structure
//!   ([`lazuli_ir::Graph::shape_free_hash`]): a miss whose structure was
//!   compiled before at other sizes is a size variant, and its backends
//!   get the earlier plan's executables in `CompileHints::earlier`, so
//!   they need not keep a map of their own nor plan the earlier graph
//!   again.

use crate::runtime::plan::Plan;
use lazuli_ir::Graph;
use lru::LruCache;
use std::num::NonZeroUsize;
use std::sync::Arc;

/// Plans remembered by the structure of their syncs' pending graphs, for
/// replaying the trace (see `trace::replay`).
const REPLAY_PLANS: usize = 64;

/// Structures whose last plan is remembered for size variants.
const STRUCTURES: usize = 1024;

/// The compile cache of one device.
pub(crate) struct CompileCache {
    plans: LruCache<u64, Arc<Plan>>,
    replays: LruCache<u64, Arc<Plan>>,
    structures: LruCache<u64, Arc<Plan>>,
}

impl CompileCache {
    /// A cache of at most `capacity` plans by graph.
    pub fn new(capacity: NonZeroUsize) -> CompileCache {
        CompileCache {
            plans: LruCache::new(capacity),
            replays: LruCache::new(NonZeroUsize::new(REPLAY_PLANS).expect("non-zero")),
            structures: LruCache::new(NonZeroUsize::new(STRUCTURES).expect("non-zero")),
        }
    }

    /// The plan compiled for `graph` (of structural hash `hash`), if any.
    pub fn get(&mut self, hash: u64, graph: &Graph) -> Option<Arc<Plan>> {
        self.plans.get(&hash).filter(|plan| plan.graph == *graph).cloned()
    }

    /// Whether a plan for `graph` (of structural hash `hash`) is cached,
    /// without counting as a use.
    pub fn contains(&self, hash: u64, graph: &Graph) -> bool {
        self.plans.peek(&hash).is_some_and(|plan| plan.graph == *graph)
    }

    /// The plan of the last sync whose pending graphs had structure `key`.
    pub fn replay(&mut self, key: u64) -> Option<Arc<Plan>> {
        self.replays.get(&key).cloned()
    }

    /// Remembers `plan` as the plan of syncs of structure `key`.
    pub fn remember_replay(&mut self, key: u64, plan: Arc<Plan>) {
        self.replays.put(key, plan);
    }

    /// The last plan compiled with the structure of `graph` (exact hash
    /// `hash`) but other sizes, if any.
    pub fn earlier_sizes(&mut self, graph: &Graph, hash: u64) -> Option<Arc<Plan>> {
        self.structures.get(&graph.shape_free_hash()).filter(|plan| plan.hash != hash).cloned()
    }

    /// Caches a newly compiled plan, also as its structure's last.
    pub fn insert(&mut self, plan: Arc<Plan>) {
        self.structures.put(plan.graph.shape_free_hash(), plan.clone());
        self.plans.put(plan.hash, plan);
    }

    /// Caches a plan compiled ahead of time (see [`crate::runtime::compile_ahead`]): by
    /// graph only, until a sync uses it ([`CompileCache::used_ahead`]);
    /// a prediction no sync asked for never guides a size variant.
    pub fn insert_ahead(&mut self, plan: Arc<Plan>) {
        self.plans.put(plan.hash, plan);
    }

    /// A sync used `plan`, compiled ahead: it is now its structure's last.
    pub fn used_ahead(&mut self, plan: &Arc<Plan>) {
        self.structures.put(plan.graph.shape_free_hash(), plan.clone());
    }

    /// Number of plans cached by graph.
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    /// Forgets the plans by graph and by sync structure (the last plan of
    /// each structure stays: it only guides how size variants compile).
    pub fn clear(&mut self) {
        self.plans.clear();
        self.replays.clear();
    }
}
