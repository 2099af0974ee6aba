//! The recording form of the IR: immutable, reference-counted [`LazyNode`]s
//! (like LTC's `NodePtr`) and the [`DataCell`]s that hold materialized data.
//!
//! A node is made once per op call and never changes, except that a sync
//! may record the cell its value was materialized into, so that a later
//! graph reading the same node uses the data instead of recomputing it.
//! Nodes nobody can reach are freed by reference counting.
//!
//! A process-wide count of pending nodes alive ([`pending_nodes`]) bounds
//! the size of any one pending graph, so that the graph size limit costs
//! nothing per op while the count is under it.

use crate::{Buffer, ExecError};
use lazuli_ir::{stable_hash, Op, ScalarValue, StableHasher, ValueType};
use smallvec::SmallVec;
use std::hash::{Hash, Hasher};
use std::panic::Location;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

static NEXT_CELL: AtomicU64 = AtomicU64::new(1);

/// Op and scalar nodes alive and not materialized, on every device.
static PENDING_NODES: AtomicUsize = AtomicUsize::new(0);

/// How many pending nodes are alive in the process: no pending graph has
/// more nodes than this. Relaxed ordering suffices: a thread that holds a
/// node obtained it through a lock (a tensor's node slot) after the node's
/// creation counted it, so its count is visible.
pub(crate) fn pending_nodes() -> usize {
    PENDING_NODES.load(Ordering::Relaxed)
}

/// A node's operands: up to three inline (`where` has three), so recording
/// an op allocates nothing for them.
pub(crate) type Operands = SmallVec<[Arc<LazyNode>; 3]>;

/// What a lazy node is.
#[derive(Debug)]
pub(crate) enum NodeKind {
    /// An op over the operands (never `Parameter` or `ScalarParam`).
    Op(Op),
    /// Materialized data: becomes a graph parameter.
    Data(Arc<DataCell>),
    /// A lifted (non-special) scalar: becomes a scalar slot, value passed at run time.
    Scalar(ScalarValue),
}

/// One recorded value.
#[derive(Debug)]
pub(crate) struct LazyNode {
    pub kind: NodeKind,
    pub operands: Operands,
    pub ty: ValueType,
    /// Structural hash: op, attributes, type and operand hashes; never data.
    pub hash: u64,
    /// The user call that recorded the node.
    pub location: &'static Location<'static>,
    /// An upper bound on the size of the pending graph under this node
    /// (saturating): operands' bounds summed, so shared nodes count more
    /// than once, unless the recorder counted it exactly.
    pub size: usize,
    /// Set when a sync materialized this node's value.
    pub materialized: OnceLock<Arc<DataCell>>,
}

impl LazyNode {
    pub fn op(op: Op, operands: Operands, ty: ValueType, location: &'static Location<'static>) -> LazyNode {
        let mut h = StableHasher::new();
        h.write_u8(1);
        op.hash(&mut h);
        for o in &operands {
            h.write_u64(o.hash);
        }
        ty.hash(&mut h);
        let hash = h.finish();
        let size = operands.iter().fold(1usize, |acc, o| acc.saturating_add(o.pending_size()));
        PENDING_NODES.fetch_add(1, Ordering::Relaxed);
        LazyNode { kind: NodeKind::Op(op), operands, ty, hash, location, size, materialized: OnceLock::new() }
    }

    pub fn data(cell: Arc<DataCell>, location: &'static Location<'static>) -> LazyNode {
        let ty = cell.ty.clone();
        let hash = stable_hash(&(2u8, &ty));
        LazyNode {
            kind: NodeKind::Data(cell),
            operands: Operands::new(),
            ty,
            hash,
            location,
            size: 0,
            materialized: OnceLock::new(),
        }
    }

    pub fn scalar(value: ScalarValue, ty: ValueType, location: &'static Location<'static>) -> LazyNode {
        let hash = stable_hash(&(3u8, &ty));
        PENDING_NODES.fetch_add(1, Ordering::Relaxed);
        LazyNode {
            kind: NodeKind::Scalar(value),
            operands: Operands::new(),
            ty,
            hash,
            location,
            size: 1,
            materialized: OnceLock::new(),
        }
    }

    /// Records that a sync materialized this node's value into `cell`;
    /// false if another sync did first.
    pub fn materialize(&self, cell: Arc<DataCell>) -> bool {
        let first = self.materialized.set(cell).is_ok();
        if first && !matches!(self.kind, NodeKind::Data(_)) {
            PENDING_NODES.fetch_sub(1, Ordering::Relaxed);
        }
        first
    }

    /// Size counted toward the graph size limit: zero once materialized.
    pub fn pending_size(&self) -> usize {
        if self.materialized.get().is_some() {
            0
        } else {
            self.size
        }
    }

    /// The data cell this node reads from, if it is data or was materialized.
    pub fn cell(&self) -> Option<&Arc<DataCell>> {
        match &self.kind {
            NodeKind::Data(c) => Some(c),
            _ => self.materialized.get(),
        }
    }

    /// True if the node's value is not in a data cell yet (ops, and lifted
    /// scalars, which a sync of the scalar itself must materialize).
    pub fn is_pending(&self) -> bool {
        self.cell().is_none()
    }
}

impl Drop for LazyNode {
    fn drop(&mut self) {
        if !matches!(self.kind, NodeKind::Data(_)) && self.materialized.get().is_none() {
            PENDING_NODES.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// State of a data cell.
#[derive(Debug)]
pub(crate) enum CellState {
    /// Host data not yet uploaded to the device (uploaded on first use).
    /// (An `Arc<Vec<u8>>`, not `Arc<[u8]>`: wrapping takes the caller's
    /// vector without copying it, so no tensor-sized allocation can fail.)
    Host(Arc<Vec<u8>>),
    /// A placeholder: an execution will fill it.
    Pending,
    /// Device data.
    Ready(Buffer),
    /// The execution that was to fill it failed. `job` identifies that
    /// execution so that the device reports each failure once (`None`
    /// for a failure no execution caused, like a donated value).
    Failed { error: ExecError, job: Option<u64> },
}

/// A slot for one tensor's data, filled asynchronously by the device worker.
#[derive(Debug)]
pub(crate) struct DataCell {
    pub id: u64,
    pub device_id: u64,
    pub ty: ValueType,
    pub state: Mutex<CellState>,
    pub ready: Condvar,
}

impl DataCell {
    pub fn new(device_id: u64, ty: ValueType, state: CellState) -> Arc<DataCell> {
        Arc::new(DataCell {
            id: NEXT_CELL.fetch_add(1, Ordering::Relaxed),
            device_id,
            ty,
            state: Mutex::new(state),
            ready: Condvar::new(),
        })
    }

    pub fn fill(&self, state: CellState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = state;
        self.ready.notify_all();
    }

    /// Barrier on this cell: waits until it is not pending.
    pub fn wait(&self) -> std::sync::MutexGuard<'_, CellState> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while matches!(*g, CellState::Pending) {
            g = self.ready.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g
    }
}
