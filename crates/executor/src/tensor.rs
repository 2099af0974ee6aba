//! The [`Tensor`] handle: cheap to clone, `Send + Sync`, with a unique id
//! and one of three states — device data, pending IR, or host data (not yet
//! uploaded). Creating tensors, reading values (the barriers) and in-place
//! updates live here; op methods live in `ops`.

use crate::device::Device;
use crate::element::{self, Element};
use crate::lazy::{CellState, DataCell, LazyNode, Operands};
use crate::{metrics, ExecError, Result};
use lazuli_ir::{DType, IrError, Op, ScalarValue, Shape, StableHasher, ValueType};
use smallvec::SmallVec;
use std::hash::BuildHasherDefault;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_TENSOR: AtomicU64 = AtomicU64::new(1);

/// A lazy tensor. Ops record IR; values are computed at sync points
/// ([`Tensor::to_vec`], [`Tensor::item`], [`sync`], [`Device::mark_step`]).
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorInner>);

pub(crate) struct TensorInner {
    id: u64,
    device: Device,
    ty: ValueType,
    node: Mutex<Arc<LazyNode>>,
    /// The slot in the device's live-tensor registry, if registered.
    pub(crate) live_slot: Option<u32>,
    /// Serializes in-place updates (`assign`, `add_` ...) so that a
    /// read-modify-write from several threads loses no update.
    update: Mutex<()>,
    generation: AtomicU64,
    pub(crate) grad: Mutex<crate::autograd::GradState>,
    /// False while `grad` certainly holds no gradient edge (neither
    /// `requires_grad` nor a `grad_fn`): recording then skips its lock.
    pub(crate) grad_tracked: std::sync::atomic::AtomicBool,
}

impl Drop for TensorInner {
    fn drop(&mut self) {
        if let Some(slot) = self.live_slot {
            self.device.0.live.lock().unwrap_or_else(|e| e.into_inner()).remove(slot);
        }
    }
}

/// Where a tensor's value is right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorState {
    /// On the device (or being computed into a placeholder there).
    DeviceData,
    /// Recorded ops not yet synced.
    PendingIr,
    /// Host data not yet uploaded.
    HostData,
}

/// The pending-graph size at which recording syncs (`LAZULI_MAX_GRAPH_NODES`,
/// default 4096), read once per process. A malformed value takes the
/// default here, which is safe: `Device::new` reports it, and every
/// compilation on a device created with it fails naming the variable.
fn max_graph_nodes() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        crate::config::count(&crate::config::process, "LAZULI_MAX_GRAPH_NODES").ok().flatten().unwrap_or(4096)
    })
}

impl Tensor {
    pub(crate) fn from_node(device: &Device, node: Arc<LazyNode>) -> Tensor {
        Tensor::make(device, node, true)
    }

    /// A handle on `node` kept out of the live-tensor registry: for the
    /// executor's own short-lived views of recorded values (autograd reads
    /// an op's operands through them), which `mark_step` never needs.
    pub(crate) fn unregistered(device: &Device, node: Arc<LazyNode>) -> Tensor {
        Tensor::make(device, node, false)
    }

    /// A tensor handle; `registered` puts it in the device's live-tensor
    /// registry (what `mark_step` syncs). Rank-0 scalar leaves stay out of
    /// it: their values are known on the host, and they are made on every
    /// `x * 0.5`, so registering them would only cost time.
    fn make(device: &Device, node: Arc<LazyNode>, registered: bool) -> Tensor {
        let id = NEXT_TENSOR.fetch_add(1, Ordering::Relaxed);
        // Registered while it is made: the registry holds a weak handle,
        // which `mark_step` cannot upgrade until the tensor exists.
        Tensor(Arc::new_cyclic(|handle| TensorInner {
            id,
            device: device.clone(),
            ty: node.ty.clone(),
            node: Mutex::new(node),
            live_slot: registered
                .then(|| device.0.live.lock().unwrap_or_else(|e| e.into_inner()).insert(handle.clone())),
            update: Mutex::new(()),
            generation: AtomicU64::new(0),
            grad: Mutex::new(Default::default()),
            grad_tracked: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    /// Unique id of this tensor (shared by its clones).
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> &Device {
        &self.0.device
    }

    /// Shape.
    pub fn shape(&self) -> &Shape {
        &self.0.ty.shape
    }

    /// Dimension sizes.
    pub fn dims(&self) -> &[usize] {
        self.0.ty.shape.dims()
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.0.ty.shape.rank()
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.0.ty.shape.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.0.ty.dtype
    }

    /// Shape and dtype.
    pub fn ty(&self) -> &ValueType {
        &self.0.ty
    }

    /// How many in-place updates ([`Tensor::assign`]) this tensor has seen.
    pub fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::Relaxed)
    }

    pub(crate) fn node(&self) -> Arc<LazyNode> {
        self.0.node.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set_node(&self, node: Arc<LazyNode>) {
        *self.0.node.lock().unwrap_or_else(|e| e.into_inner()) = node;
    }

    /// Replaces the node only if it is still `expected` (a sync must not
    /// undo a concurrent `assign`).
    pub(crate) fn replace_node_if(&self, expected: &Arc<LazyNode>, node: Arc<LazyNode>) {
        let mut cur = self.0.node.lock().unwrap_or_else(|e| e.into_inner());
        if Arc::ptr_eq(&cur, expected) {
            *cur = node;
        }
    }

    /// The tensor's current state.
    pub fn state(&self) -> TensorState {
        let node = self.node();
        match node.cell() {
            None => TensorState::PendingIr,
            Some(c) => match &*c.state.lock().unwrap_or_else(|e| e.into_inner()) {
                CellState::Host(_) => TensorState::HostData,
                _ => TensorState::DeviceData,
            },
        }
    }

    /// A tensor from host values in row-major order.
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            let at = Location::caller();
            return Err(ExecError::DataLength {
                op: format!("from_slice at {}:{}", at.file(), at.line()),
                len: data.len(),
                shape: shape.clone(),
                numel: shape.numel(),
            });
        }
        let mut bytes = device.host_vec(data.len().saturating_mul(T::DTYPE.size_bytes()), "from_slice")?;
        T::extend_bytes(data, &mut bytes);
        Tensor::from_bytes(bytes, ValueType::new(shape, T::DTYPE), device)
    }

    /// A tensor from canonical little-endian bytes (see the Backend docs).
    #[track_caller]
    pub fn from_bytes(bytes: Vec<u8>, ty: ValueType, device: &Device) -> Result<Tensor> {
        let want = ty.shape.numel().saturating_mul(ty.dtype.size_bytes());
        if bytes.len() != want {
            let at = Location::caller();
            return Err(ExecError::DataLength {
                op: format!("from_bytes at {}:{}", at.file(), at.line()),
                len: bytes.len() / ty.dtype.size_bytes().max(1),
                shape: ty.shape.clone(),
                numel: ty.shape.numel(),
            });
        }
        let cell = DataCell::new(device.0.id, ty, CellState::Host(Arc::new(bytes)));
        Ok(Tensor::from_node(device, Arc::new(LazyNode::data(cell, Location::caller()))))
    }

    /// A rank-0 tensor. Special values (0, 1, -1, booleans) are baked into
    /// kernels; others are lifted into a parameter slot so that a new value
    /// compiles nothing new.
    #[track_caller]
    pub fn scalar(value: impl Into<ScalarValue>, dtype: DType, device: &Device) -> Tensor {
        Tensor::make(device, Tensor::scalar_node(value.into(), dtype, Location::caller()), false)
    }

    /// The node of [`Tensor::scalar`], without a handle.
    pub(crate) fn scalar_node(value: ScalarValue, dtype: DType, location: &'static Location<'static>) -> Arc<LazyNode> {
        let v = value.cast(dtype);
        let ty = ValueType::new(Shape::scalar(), dtype);
        Arc::new(if v.is_special() {
            LazyNode::op(Op::Constant(v, dtype), Operands::new(), ty, location)
        } else {
            LazyNode::scalar(v, ty, location)
        })
    }

    /// The node of [`Tensor::lifted_scalar`], without a handle.
    pub(crate) fn lifted_node(value: ScalarValue, dtype: DType, location: &'static Location<'static>) -> Arc<LazyNode> {
        Arc::new(LazyNode::scalar(value.cast(dtype), ValueType::new(Shape::scalar(), dtype), location))
    }

    /// A rank-0 tensor that is always a lifted parameter, never baked (for
    /// values that change every step, like RNG keys).
    #[track_caller]
    pub fn lifted_scalar(value: ScalarValue, dtype: DType, device: &Device) -> Tensor {
        let node = LazyNode::scalar(value.cast(dtype), ValueType::new(Shape::scalar(), dtype), Location::caller());
        Tensor::make(device, Arc::new(node), false)
    }

    /// A tensor of `shape` filled with `value`.
    #[track_caller]
    pub fn full(
        shape: impl Into<Shape>,
        value: impl Into<ScalarValue>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let s = Tensor::scalar(value, dtype, device);
        if shape.rank() == 0 {
            return Ok(s);
        }
        s.expand(shape)
    }

    /// A tensor of zeros.
    #[track_caller]
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(shape, ScalarValue::Int(0), dtype, device)
    }

    /// A tensor of ones.
    #[track_caller]
    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(shape, ScalarValue::Int(1), dtype, device)
    }

    /// `[start, start + step, ...]` up to (excluding) `end`, like numpy.
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(ExecError::Invalid {
                op: "arange".into(),
                detail: format!("bad range {start}..{end} step {step}"),
            });
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let idx = Tensor::iota([n], 0, dtype, device)?;
        let scaled = if step == 1.0 { idx } else { idx.mul(&Tensor::scalar(step, dtype, device))? };
        if start == 0.0 {
            Ok(scaled)
        } else {
            scaled.add(&Tensor::scalar(start, dtype, device))
        }
    }

    /// `out[i] = index of i along axis`, as `dtype`.
    #[track_caller]
    pub fn iota(shape: impl Into<Shape>, axis: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::record_on(device, Op::Iota { shape: shape.into(), axis, dtype }, &[])
    }

    /// Records `op` over `operands` (all on one device), inferring and
    /// checking the result type now.
    #[track_caller]
    pub fn record(op: Op, operands: &[&Tensor]) -> Result<Tensor> {
        let Some(device) = operands.first().map(|t| t.device().clone()) else {
            return Err(ExecError::from(IrError::Arity { op: op.name(), expected: "at least 1".into(), got: 0 }));
        };
        Tensor::record_on(&device, op, operands)
    }

    /// [`Tensor::record`] with an explicit device (for leaf ops).
    #[track_caller]
    pub fn record_on(device: &Device, op: Op, operands: &[&Tensor]) -> Result<Tensor> {
        Tensor::record_at(device, op, operands, None, Location::caller())
    }

    /// Records `op` over `operands` followed, if given, by the rank-0
    /// `scalar` node (the `x * 0.5` methods pass their constant or lifted
    /// scalar this way, without making a tensor handle for it), attributed
    /// to `location`.
    pub(crate) fn record_at(
        device: &Device,
        op: Op,
        operands: &[&Tensor],
        scalar: Option<Arc<LazyNode>>,
        location: &'static Location<'static>,
    ) -> Result<Tensor> {
        let _span = tracing::trace_span!("record", op = op.label()).entered();
        let location = crate::site::CallSite::current().unwrap_or(location);
        for t in operands {
            if !t.device().same(device) {
                return Err(ExecError::DeviceMismatch {
                    op: format!("{} at {}:{}", op.name(), location.file(), location.line()),
                    a: device.name(),
                    b: t.device().name(),
                });
            }
        }
        // Inside an autocast scope, operands may be cast first (explicit
        // `Op::Cast` nodes, differentiable like any op).
        let autocast = crate::autocast::apply(&op, operands, scalar.as_ref(), location)?;
        let cast_refs: SmallVec<[&Tensor; 3]>;
        let (operands, scalar) = match &autocast {
            Some((cast, s)) => {
                cast_refs = cast.iter().collect();
                (&cast_refs[..], s.clone())
            }
            None => (operands, scalar),
        };
        let mut nodes = Operands::new();
        for t in operands {
            nodes.push(t.node());
        }
        if let Some(s) = scalar {
            nodes.push(s);
        }
        let ty = match &nodes[..] {
            // The common arities without a vector of types.
            [a] => op.infer(std::slice::from_ref(&a.ty), &[], &[]),
            [a, b] => op.infer(&[a.ty.clone(), b.ty.clone()], &[], &[]),
            _ => op.infer(&nodes.iter().map(|n| n.ty.clone()).collect::<SmallVec<[ValueType; 3]>>(), &[], &[]),
        }
        .map_err(|e| ExecError::ir(e, location))?;
        // No allocation can hold more than isize::MAX bytes: refuse such a
        // shape here rather than fail (or overflow) in a backend later.
        if ty.shape.numel().checked_mul(ty.dtype.size_bytes()).is_none_or(|b| b > isize::MAX as usize) {
            return Err(ExecError::ir(
                IrError::Shape {
                    op: op.name(),
                    detail: format!("result shape {} of {} has too many elements to exist", ty.shape, ty.dtype),
                },
                location,
            ));
        }
        let mut node = LazyNode::op(op, nodes, ty, location);
        // The graph size limit, cheaply: the node's bound (operands' bounds
        // summed) and the process-wide count of pending nodes are both upper
        // bounds on its pending graph; only when both exceed the limit is it
        // counted exactly, and the exact count becomes the node's bound.
        let limit = max_graph_nodes();
        let mut over = false;
        if node.size > limit && crate::lazy::pending_nodes() > limit {
            node.size = 1 + pending_count(&node.operands, limit);
            over = node.size > limit;
        }
        let node = Arc::new(node);
        let t = Tensor::from_node(device, node);
        crate::autograd::track(&t, operands);
        if over {
            metrics::inc("GraphSizeLimitHits", 1);
            device.graph_limit_hit(limit, location);
            device.sync_tensors(
                &[&t],
                &format!("graph size limit ({limit} nodes) at {}:{}", location.file(), location.line()),
            )?;
        }
        Ok(t)
    }

    /// Materializes this tensor (asynchronously); see [`sync`].
    #[track_caller]
    pub fn sync(&self) -> Result<()> {
        sync(&[self])
    }

    /// Reads the values as `T`, which must match the dtype (a barrier).
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let loc = Location::caller();
        let op = format!("to_vec at {}:{}", loc.file(), loc.line());
        self.check_read::<T>(&op)?;
        let bytes = self.read_bytes_at(&op)?;
        let mut out = self.device().host_vec(self.numel(), &op)?;
        out.extend(bytes.chunks_exact(T::DTYPE.size_bytes()).map(T::read_bytes));
        Ok(out)
    }

    /// [`Tensor::to_vec`] without blocking the caller where the device
    /// works asynchronously (a browser tab, see [`crate::platform`]): the
    /// future yields to the event loop until the values are back. On
    /// native targets it is `to_vec`, done when first polled.
    #[track_caller]
    pub fn to_vec_async<T: Element>(&self) -> impl std::future::Future<Output = Result<Vec<T>>> + '_ {
        let loc = Location::caller();
        async move {
            let op = format!("to_vec_async at {}:{}", loc.file(), loc.line());
            self.check_read::<T>(&op)?;
            let bytes = self.read_bytes_async(&op).await?;
            let mut out = self.device().host_vec(self.numel(), &op)?;
            out.extend(bytes.chunks_exact(T::DTYPE.size_bytes()).map(T::read_bytes));
            Ok(out)
        }
    }

    /// [`Tensor::item`] without blocking the caller (see
    /// [`Tensor::to_vec_async`]).
    #[track_caller]
    pub fn item_async<T: Element>(&self) -> impl std::future::Future<Output = Result<T>> + '_ {
        let loc = Location::caller();
        async move {
            if self.numel() != 1 {
                return Err(ExecError::Invalid {
                    op: "item_async".into(),
                    detail: format!("tensor of shape {} has {} elements, not 1", self.shape(), self.numel()),
                });
            }
            let op = format!("item_async at {}:{}", loc.file(), loc.line());
            self.check_read::<T>(&op)?;
            let bytes = self.read_bytes_async(&op).await?;
            Ok(T::read_bytes(&bytes))
        }
    }

    /// `T` must be this tensor's dtype.
    fn check_read<T: Element>(&self, op: &str) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(ExecError::ReadDType {
                op: op.into(),
                actual: self.dtype(),
                expected: T::DTYPE,
                shape: self.shape().clone(),
            });
        }
        Ok(())
    }

    /// Reads the single value of a one-element tensor (a barrier).
    #[track_caller]
    pub fn item<T: Element>(&self) -> Result<T> {
        let loc = Location::caller();
        let op = format!("item at {}:{}", loc.file(), loc.line());
        if self.numel() != 1 {
            return Err(ExecError::Invalid {
                op,
                detail: format!(
                    "tensor of shape {} has {} elements, not 1; read them with to_vec, or reduce first \
                     (sum_all, mean_all)",
                    self.shape(),
                    self.numel()
                ),
            });
        }
        self.check_read::<T>(&op)?;
        let bytes = self.read_bytes_at(&op)?;
        Ok(T::read_bytes(&bytes))
    }

    /// Reads every value as a [`ScalarValue`] whatever the dtype (a barrier).
    #[track_caller]
    pub fn to_scalars(&self) -> Result<Vec<ScalarValue>> {
        let loc = Location::caller();
        let op = format!("to_scalars at {}:{}", loc.file(), loc.line());
        let bytes = self.read_bytes_at(&op)?;
        let mut out = self.device().host_vec(self.numel(), &op)?;
        out.extend((0..self.numel()).map(|i| element::read_scalar(&bytes, self.dtype(), i)));
        Ok(out)
    }

    /// Reads the canonical bytes (a barrier).
    #[track_caller]
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let loc = Location::caller();
        self.read_bytes_at(&format!("to_bytes at {}:{}", loc.file(), loc.line()))
    }

    fn read_bytes_at(&self, trigger: &str) -> Result<Vec<u8>> {
        let _span = tracing::debug_span!("barrier", trigger).entered();
        // Read the value the tensor has now, even if another thread assigns
        // a new one while this read is in flight.
        let node = self.node();
        self.device().sync_nodes(&[(self.clone(), node.clone())], trigger)?;
        let cell = node.cell().expect("a synced node holds a data cell");
        self.device().read_cell(cell, trigger)
    }

    async fn read_bytes_async(&self, trigger: &str) -> Result<Vec<u8>> {
        let node = self.node();
        self.device().sync_nodes(&[(self.clone(), node.clone())], trigger)?;
        let cell = node.cell().expect("a synced node holds a data cell");
        self.device().read_cell_async(cell, trigger).await
    }

    /// Replaces this tensor's value with `other`'s (same shape and dtype),
    /// for every clone of the handle: the in-place update an optimizer
    /// needs. Records nothing and copies nothing; bumps the generation.
    #[track_caller]
    pub fn assign(&self, other: &Tensor) -> Result<()> {
        let _guard = self.0.update.lock().unwrap_or_else(|e| e.into_inner());
        self.assign_locked(other)
    }

    fn assign_locked(&self, other: &Tensor) -> Result<()> {
        if other.ty() != self.ty() {
            return Err(ExecError::Invalid {
                op: "assign".into(),
                detail: format!("cannot assign {}{} to {}{}", other.dtype(), other.shape(), self.dtype(), self.shape()),
            });
        }
        if !other.device().same(self.device()) {
            return Err(ExecError::DeviceMismatch {
                op: "assign".into(),
                a: self.device().name(),
                b: other.device().name(),
            });
        }
        self.set_node(other.node());
        self.0.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// `self = f(self)` atomically with respect to other in-place updates
    /// of this tensor (from any thread).
    #[track_caller]
    pub fn update(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<()> {
        let _guard = self.0.update.lock().unwrap_or_else(|e| e.into_inner());
        let new = f(self)?;
        self.assign_locked(&new)
    }

    /// `self += other` in place (other broadcasts to self's shape).
    #[track_caller]
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        self.update(|t| t.add(other))
    }

    /// `self -= other` in place.
    #[track_caller]
    pub fn sub_(&self, other: &Tensor) -> Result<()> {
        self.update(|t| t.sub(other))
    }

    /// `self *= other` in place.
    #[track_caller]
    pub fn mul_(&self, other: &Tensor) -> Result<()> {
        self.update(|t| t.mul(other))
    }

    /// This tensor's value on `device` (PyTorch's `x.to(device)`): the
    /// same handle when it is already there, else a new tensor of the
    /// same type holding a copy. Host data not yet uploaded is shared, not
    /// copied; a value on a device is read back first (a barrier: a
    /// pending value is synced and waited for), and the copy is uploaded
    /// to `device` at its first use there. The copy is differentiable: a
    /// gradient reaching it moves back to this tensor's device. A
    /// parameter should be moved as a leaf instead (`ModuleExt::to_device`
    /// moves a whole model and keeps its parameters leaves).
    #[track_caller]
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device().same(device) {
            return Ok(self.clone());
        }
        let loc = Location::caller();
        let op = format!("to_device at {}:{}", loc.file(), loc.line());
        let node = self.node();
        let host = node.cell().and_then(|c| match &*c.state.lock().unwrap_or_else(|e| e.into_inner()) {
            CellState::Host(bytes) => Some(bytes.clone()),
            _ => None,
        });
        let bytes = match host {
            Some(bytes) => bytes,
            None => Arc::new(self.read_bytes_at(&op)?),
        };
        let cell = DataCell::new(device.0.id, self.ty().clone(), CellState::Host(bytes));
        let moved = Tensor::from_node(device, Arc::new(LazyNode::data(cell, loc)));
        let home = self.device().clone();
        crate::autograd::attach_custom(&moved, &[self], "to_device", move |g| Ok(vec![Some(g.to_device(&home)?)]));
        Ok(moved)
    }

    /// Marks this tensor as persistent state (a parameter, a buffer, a
    /// table computed once): if its value is still pending (a random
    /// initialization, say), the next sync on its device materializes it,
    /// whatever that sync is for, so the value is computed once and every
    /// later graph reads it as data, instead of recomputing it in each
    /// graph that uses it (an inference loop would otherwise re-run a
    /// model's initialization at every forward). Costs nothing for data.
    /// `requires_grad_(true)` persists its tensor, so every parameter of
    /// `lazuli::nn` is persistent; a module's buffers are persisted by its
    /// layer.
    pub fn persist(&self) -> &Tensor {
        if self.node().is_pending() {
            self.device().persist_at_next_sync(self);
        }
        self
    }

    /// A new handle sharing this tensor's current value but no history:
    /// gradients do not flow through it.
    #[track_caller]
    pub fn detach(&self) -> Tensor {
        Tensor::from_node(self.device(), self.node())
    }
}

/// Number of pending nodes reachable from `roots` (stopping at data), or
/// some number over `stop_above` once it is known to exceed it.
fn pending_count(roots: &[Arc<LazyNode>], stop_above: usize) -> usize {
    let mut seen: std::collections::HashSet<*const LazyNode, BuildHasherDefault<StableHasher>> = Default::default();
    let mut stack: Vec<&LazyNode> = roots.iter().map(|r| &**r).collect();
    while let Some(n) = stack.pop() {
        if !n.is_pending() || !seen.insert(n as *const LazyNode) {
            continue;
        }
        if seen.len() > stop_above {
            break;
        }
        stack.extend(n.operands.iter().map(|o| &**o));
    }
    seen.len()
}

/// Materializes all given tensors with pending IR as ONE graph and returns
/// without waiting for the device (read a value or call
/// [`Device::wait`] to wait). All tensors must share one device.
#[track_caller]
pub fn sync(tensors: &[&Tensor]) -> Result<()> {
    let loc = Location::caller();
    let Some(first) = tensors.first() else { return Ok(()) };
    first.device().sync_tensors(tensors, &format!("sync at {}:{}", loc.file(), loc.line()))
}

/// [`sync`], then [`Device::wait_async`]: materializes the tensors as one
/// graph and waits, without blocking the caller where the device works
/// asynchronously (a browser tab, see [`crate::platform`]), until the
/// device is done with them.
#[track_caller]
pub fn sync_async<'a>(tensors: &'a [&'a Tensor]) -> impl std::future::Future<Output = Result<()>> + 'a {
    let loc = Location::caller();
    async move {
        let Some(first) = tensors.first() else { return Ok(()) };
        first.device().sync_tensors(tensors, &format!("sync_async at {}:{}", loc.file(), loc.line()))?;
        first.device().wait_async().await
    }
}
