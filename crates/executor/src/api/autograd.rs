//! Reverse-mode autodiff on the lazy IR.
//!
//! Recording an op whose operands need gradients (a leaf marked with
//! [`Tensor::requires_grad_`], or the result of such an op) attaches a
//! `GradFn` to the result: the op's input nodes and output node as they were
//! when recorded, and one edge per operand (to the operand's own `GradFn`,
//! or to the leaf tensor itself). [`Tensor::backward`] walks these records
//! from the loss in reverse topological order and builds every gradient with
//! the public op methods, under [`no_grad`]: gradients are more lazy IR and
//! are fused with the forward pass at the next sync.
//!
//! The state lives on the tensor handle (`GradState`), not on its node:
//! [`Tensor::assign`] replaces the node but keeps the handle, so a parameter
//! stays a leaf that requires grad across optimizer updates, while each
//! step's forward pass builds a fresh record graph. [`Tensor::detach`] makes
//! a new handle on the same node, with no grad state.
//! `assign` keeps the target's gradient state and does not take over the
//! history of the assigned value.
//!
//! Conventions: integer and bool values never carry gradients (comparisons,
//! arg-reductions, casts to integers end the graph); `floor`, `ceil`,
//! `round` and `sign` have zero gradient; at ties, `maximum`/`minimum` and
//! the max/min reductions split the gradient evenly among the tied inputs,
//! while max pooling gives a window's whole gradient to its first maximum
//! in scan order (PyTorch's and XLA's rule; the first NaN when the maximum
//! is NaN, never a padded position);
//! `relu` and `abs` have zero gradient at 0; random ops have none.
//!
//! Rejected alternative: walking the recorded `LazyNode` graph itself.
//! Nodes are shared by handles that must differ for autodiff (a tensor and
//! its `detach()`, values recorded inside `no_grad`), and a node cannot
//! point back at the leaf handle whose `grad` it should fill.

use crate::api::lazy::{LazyNode, NodeKind};
use crate::{ExecError, Result, Tensor};
use lazuli_ir::{
    reduced_shape, AttentionAttrs, AttentionPart, BinaryOp, ConvAttrs, Op, PadMode, PoolKind, ReduceOp, Shape, UnaryOp,
};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// The elementwise ops with no gradient rule: their results are bool, so
/// recording them ends the graph. Every other [`UnaryOp`] and
/// [`BinaryOp`] has a rule (the coverage test checks both halves).
pub const NON_DIFFERENTIABLE_UNARY: &[UnaryOp] = &[UnaryOp::Not, UnaryOp::IsNan, UnaryOp::IsInf];

/// See [`NON_DIFFERENTIABLE_UNARY`].
pub const NON_DIFFERENTIABLE_BINARY: &[BinaryOp] = &[
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::And,
    BinaryOp::Or,
    BinaryOp::Xor,
];

/// True unless the current thread is inside a [`no_grad`] scope.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Turns gradient tracking of the current thread on or off; returns the
/// previous setting.
pub fn set_grad_enabled(enabled: bool) -> bool {
    GRAD_ENABLED.with(|c| c.replace(enabled))
}

/// Disables gradient tracking on this thread until dropped (then restores
/// the previous setting).
#[must_use = "tracking is re-enabled when the guard is dropped"]
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Disables tracking now.
    pub fn new() -> NoGradGuard {
        NoGradGuard { previous: set_grad_enabled(false) }
    }
}

impl Default for NoGradGuard {
    fn default() -> Self {
        NoGradGuard::new()
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        set_grad_enabled(self.previous);
    }
}

/// Runs `f` with gradient tracking disabled on this thread: ops recorded
/// inside get no gradient history (optimizer updates, evaluation).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard::new();
    f()
}

/// Gradient bookkeeping of one tensor handle (shared by its clones).
#[derive(Default)]
pub(crate) struct GradState {
    /// A leaf whose gradient is accumulated into `grad`.
    pub requires_grad: bool,
    /// The accumulated gradient (leaves only).
    pub grad: Option<Tensor>,
    /// How this value was computed from values that need gradients.
    pub grad_fn: Option<Arc<GradFn>>,
}

/// The record of one differentiable op application.
pub(crate) struct GradFn {
    /// The op's result as recorded (its kind is the op, its operands the
    /// op's inputs as recorded).
    output: Arc<LazyNode>,
    /// Where each operand's gradient goes; `None` for operands that need none.
    edges: Vec<Option<Edge>>,
    /// A backward of its own (a [`checkpoint`]ed segment) instead of the
    /// op's rule: its name and the gradient of each edge's input.
    custom: Option<(&'static str, CustomVjp)>,
}

/// A backward given by a closure: from the output gradient, the gradient
/// of each input (in edge order).
type CustomVjp = Arc<dyn Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

enum Edge {
    /// Accumulate into this leaf's `grad`.
    Leaf(Tensor),
    /// Propagate through this op.
    Node(Arc<GradFn>),
}

/// Called by `Tensor::record_on` for every recorded op: attaches a
/// `GradFn` to `out` when tracking is on and an operand needs gradients.
pub(crate) fn track(out: &Tensor, operands: &[&Tensor]) {
    if operands.is_empty() || !out.dtype().is_float() || !is_grad_enabled() {
        return;
    }
    let mut edges: Vec<Option<Edge>> = Vec::new();
    for (i, t) in operands.iter().enumerate() {
        if let Some(e) = t.edge() {
            // Allocated only once an operand needs a gradient.
            edges.resize_with(operands.len(), || None);
            edges[i] = Some(e);
        }
    }
    if edges.is_empty() {
        return;
    }
    let f = GradFn { output: out.node(), edges, custom: None };
    out.grad_state().grad_fn = Some(Arc::new(f));
    out.0.grad_tracked.store(true, Ordering::Relaxed);
}

impl Tensor {
    fn grad_state(&self) -> MutexGuard<'_, GradState> {
        self.0.grad.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn edge(&self) -> Option<Edge> {
        if !self.0.grad_tracked.load(Ordering::Relaxed) {
            return None;
        }
        let st = self.grad_state();
        if let Some(f) = &st.grad_fn {
            Some(Edge::Node(f.clone()))
        } else if st.requires_grad {
            Some(Edge::Leaf(self.clone()))
        } else {
            None
        }
    }

    /// Marks this tensor as a leaf whose gradient [`Tensor::backward`]
    /// accumulates (or unmarks it). Only float tensors can require grad; the
    /// flag survives [`Tensor::assign`]. A leaf marked so is persistent
    /// state ([`Tensor::persist`]): a pending value (a random
    /// initialization) is materialized by the next sync on its device.
    /// Returns the handle for chaining.
    pub fn requires_grad_(&self, requires: bool) -> Result<Tensor> {
        if requires && !self.dtype().is_float() {
            return Err(ExecError::Invalid {
                op: "requires_grad_".into(),
                detail: format!(
                    "only float tensors can require gradients, this one is {}{}",
                    self.dtype(),
                    self.shape()
                ),
            });
        }
        let mut st = self.grad_state();
        if st.grad_fn.is_some() {
            if !requires {
                return Err(ExecError::Invalid {
                    op: "requires_grad_".into(),
                    detail: "this tensor was computed from values that require grad; use detach() instead".into(),
                });
            }
        } else {
            st.requires_grad = requires;
        }
        let leaf = st.grad_fn.is_none();
        if requires {
            self.0.grad_tracked.store(true, Ordering::Relaxed);
        }
        drop(st);
        if requires && leaf && self.0.live_slot.is_some() {
            // A parameter is state: computed once (see `Tensor::persist`).
            // (Not the executor's own unregistered views, such as the
            // stand-ins `checkpoint` makes for a segment's inputs.)
            self.persist();
        }
        Ok(self.clone())
    }

    /// True for leaves marked with [`Tensor::requires_grad_`] and for values
    /// computed from them while tracking was on.
    pub fn requires_grad(&self) -> bool {
        let st = self.grad_state();
        st.requires_grad || st.grad_fn.is_some()
    }

    /// True unless this value was computed from values that require grad.
    pub fn is_leaf(&self) -> bool {
        self.grad_state().grad_fn.is_none()
    }

    /// The name of the op that produced this value, when it has gradient
    /// history (e.g. "matmul").
    pub fn grad_fn_name(&self) -> Option<String> {
        self.grad_state().grad_fn.as_ref().map(|f| match &f.custom {
            Some((name, _)) => (*name).to_string(),
            None => f.op().name(),
        })
    }

    /// The gradient accumulated into this leaf by [`Tensor::backward`]: a
    /// lazy tensor of this tensor's shape and dtype.
    pub fn grad(&self) -> Option<Tensor> {
        self.grad_state().grad.clone()
    }

    /// Replaces the accumulated gradient (e.g. after clipping it).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            if g.ty() != self.ty() {
                return Err(ExecError::Invalid {
                    op: "set_grad".into(),
                    detail: format!(
                        "gradient {}{} does not match {}{}",
                        g.dtype(),
                        g.shape(),
                        self.dtype(),
                        self.shape()
                    ),
                });
            }
        }
        self.grad_state().grad = grad;
        Ok(())
    }

    /// Drops the accumulated gradient (the next backward starts from none).
    pub fn zero_grad(&self) {
        self.grad_state().grad = None;
    }

    /// Backpropagates from this one-element value (a loss): every leaf that
    /// requires grad and that it depends on gets `d self / d leaf` added to
    /// its [`Tensor::grad`]. The gradients are lazy; nothing runs here.
    #[track_caller]
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 && self.requires_grad() {
            return Err(ExecError::Invalid {
                op: "backward".into(),
                detail: format!(
                    "backward() needs a one-element loss, got shape {}; use backward_with(grad) for others",
                    self.shape()
                ),
            });
        }
        let seed = Tensor::ones(self.shape().clone(), self.dtype(), self.device())?;
        self.backward_with(&seed)
    }

    /// Backpropagates the vector-Jacobian product with `grad` (same shape
    /// and dtype as `self`).
    #[track_caller]
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if grad.ty() != self.ty() {
            return Err(ExecError::Invalid {
                op: "backward".into(),
                detail: format!(
                    "output gradient {}{} does not match the output {}{}",
                    grad.dtype(),
                    grad.shape(),
                    self.dtype(),
                    self.shape()
                ),
            });
        }
        let Some(root) = self.edge() else {
            return Err(ExecError::Invalid {
                op: "backward".into(),
                detail: "the tensor does not require grad: no leaf marked with requires_grad_(true) reaches it".into(),
            });
        };
        let _guard = NoGradGuard::new();
        // The gradient's ops are the user's `backward()` line, not this file's.
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        // Each rule works in the dtypes its forward recorded.
        let _autocast = crate::autocast::AutocastGuard::disabled();
        match root {
            Edge::Leaf(t) => accumulate(&t, grad.clone()),
            Edge::Node(f) => run_backward(f, grad.clone()),
        }
    }
}

fn accumulate(leaf: &Tensor, g: Tensor) -> Result<()> {
    let g = if g.dtype() != leaf.dtype() { g.cast(leaf.dtype())? } else { g };
    debug_assert_eq!(g.shape(), leaf.shape(), "gradient shape of a leaf");
    let old = leaf.grad_state().grad.take();
    let new = match old {
        Some(o) => o.add(&g)?,
        None => g,
    };
    leaf.grad_state().grad = Some(new);
    Ok(())
}

fn add_into(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    *slot = Some(match slot.take() {
        Some(o) => o.add(&g)?,
        None => g,
    });
    Ok(())
}

/// Gradient checkpointing (PyTorch's `torch.utils.checkpoint`): runs the
/// segment `f` on `inputs` and returns its output, but keeps no gradient
/// record of the segment's inside; [`Tensor::backward`] records `f` again
/// on the same inputs (and the same RNG state, so dropout draws the same
/// masks) and backpropagates through that recomputation. Gradients are
/// those of the plain `f(inputs)`: into the inputs that require grad and
/// into every leaf `f` uses (a layer's parameters).
///
/// `f` is kept until backward, so it must own what it uses: clone the
/// layers into it (their tensors are shared handles) or hold them in an
/// `Arc`. Under [`no_grad`], or when nothing `f` uses requires grad, this
/// is `f(inputs)`.
///
/// Memory: the recomputed segment is more lazy IR, structurally the
/// forward segment again. Within one sync the compiler's CSE may merge
/// much of it with the forward (then little is recomputed, and the
/// activations are kept as without checkpointing); the recomputation is
/// real, and the segment's activations are freed, when the forward was
/// materialized before the backward runs (e.g. `sync` of each segment's
/// output between forward and backward, the pattern that bounds a long
/// model's peak memory).
#[track_caller]
pub fn checkpoint<F>(f: F, inputs: &[Tensor]) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    if !is_grad_enabled() {
        return f(inputs);
    }
    let rng = inputs.first().map(|t| t.device().rng_state());
    // The forward with gradient tracking, on fresh leaves standing for the
    // inputs: whether the output needs a gradient at all, then the record
    // is dropped (only the output's value is kept).
    let leaves = |from: &[Tensor]| -> Result<Vec<Tensor>> {
        from.iter()
            .map(|t| {
                let l = Tensor::unregistered(t.device(), t.node());
                if t.requires_grad() && t.dtype().is_float() {
                    l.requires_grad_(true)?;
                }
                Ok(l)
            })
            .collect()
    };
    let out = f(&leaves(inputs)?)?;
    if !out.requires_grad() {
        return Ok(out);
    }
    let dev = out.device().clone();
    let rng = rng.unwrap_or_else(|| dev.rng_state());
    let edges: Vec<Option<Edge>> = inputs.iter().map(Tensor::edge).collect();
    // Unregistered: `mark_step` need not sync the saved inputs.
    let saved: Vec<Tensor> = inputs.iter().map(|t| Tensor::unregistered(t.device(), t.node())).collect();
    let needs: Vec<bool> = edges.iter().map(Option::is_some).collect();
    let out_ty = out.ty().clone();
    let autocast = crate::autocast::autocast_dtype();
    let vjp = move |g: &Tensor| -> Result<Vec<Option<Tensor>>> {
        let now = dev.rng_state();
        dev.set_rng_state(rng);
        let recomputed = {
            let _on = GradEnabledGuard::new(true);
            let _autocast = crate::autocast::AutocastGuard::restore(autocast);
            let xs: Vec<Tensor> = saved
                .iter()
                .zip(&needs)
                .map(|(t, &need)| {
                    let l = Tensor::unregistered(t.device(), t.node());
                    if need {
                        l.requires_grad_(true)?;
                    }
                    Ok(l)
                })
                .collect::<Result<_>>()?;
            f(&xs).map(|y| (xs, y))
        };
        dev.set_rng_state(now);
        let (xs, y) = recomputed?;
        if y.ty() != &out_ty {
            return Err(ExecError::Invalid {
                op: "checkpoint".into(),
                detail: format!(
                    "the segment's recomputation gave {}{}, its forward {}{}: it must be deterministic",
                    y.dtype(),
                    y.shape(),
                    out_ty.dtype,
                    out_ty.shape
                ),
            });
        }
        y.backward_with(g)?;
        Ok(xs.iter().zip(&needs).map(|(x, &need)| if need { x.grad() } else { None }).collect())
    };
    let result = out.detach();
    let f = GradFn { output: result.node(), edges, custom: Some(("checkpoint", Arc::new(vjp))) };
    result.grad_state().grad_fn = Some(Arc::new(f));
    result.0.grad_tracked.store(true, Ordering::Relaxed);
    Ok(result)
}

/// Gives `result` a backward of its own, `vjp` (named `name`), from the
/// gradients of `inputs`, when tracking is on and an input needs one.
pub(crate) fn attach_custom(
    result: &Tensor,
    inputs: &[&Tensor],
    name: &'static str,
    vjp: impl Fn(&Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
) {
    if !is_grad_enabled() || !result.dtype().is_float() {
        return;
    }
    let edges: Vec<Option<Edge>> = inputs.iter().map(|t| t.edge()).collect();
    if edges.iter().all(Option::is_none) {
        return;
    }
    let f = GradFn { output: result.node(), edges, custom: Some((name, Arc::new(vjp))) };
    result.grad_state().grad_fn = Some(Arc::new(f));
    result.0.grad_tracked.store(true, Ordering::Relaxed);
}

/// Sets gradient tracking on this thread until dropped (then restores the
/// previous setting).
struct GradEnabledGuard {
    previous: bool,
}

impl GradEnabledGuard {
    fn new(enabled: bool) -> GradEnabledGuard {
        GradEnabledGuard { previous: set_grad_enabled(enabled) }
    }
}

impl Drop for GradEnabledGuard {
    fn drop(&mut self) {
        set_grad_enabled(self.previous);
    }
}

/// Reverse-mode sweep from `root` with output gradient `seed`.
fn run_backward(root: Arc<GradFn>, seed: Tensor) -> Result<()> {
    let order = topo_order(&root);
    let mut pending: HashMap<*const GradFn, Option<Tensor>> = HashMap::new();
    pending.insert(Arc::as_ptr(&root), Some(seed));
    let mut leaves: Vec<(Tensor, Option<Tensor>)> = Vec::new();
    let mut leaf_index: HashMap<u64, usize> = HashMap::new();
    for f in order {
        let Some(Some(g)) = pending.remove(&Arc::as_ptr(&f)) else { continue };
        let grads = f.vjp(&g)?;
        for (edge, gi) in f.edges.iter().zip(grads) {
            let (Some(edge), Some(gi)) = (edge, gi) else { continue };
            match edge {
                Edge::Node(n) => add_into(pending.entry(Arc::as_ptr(n)).or_default(), gi)?,
                Edge::Leaf(t) => {
                    let i = *leaf_index.entry(t.id()).or_insert_with(|| {
                        leaves.push((t.clone(), None));
                        leaves.len() - 1
                    });
                    add_into(&mut leaves[i].1, gi)?;
                }
            }
        }
    }
    for (leaf, g) in leaves {
        if let Some(g) = g {
            accumulate(&leaf, g)?;
        }
    }
    Ok(())
}

/// The `GradFn`s reachable from `root`, each before the ones it depends on.
fn topo_order(root: &Arc<GradFn>) -> Vec<Arc<GradFn>> {
    let mut post: Vec<Arc<GradFn>> = Vec::new();
    let mut seen: std::collections::HashSet<*const GradFn> = std::collections::HashSet::new();
    let mut stack: Vec<(Arc<GradFn>, bool)> = vec![(root.clone(), false)];
    while let Some((f, expanded)) = stack.pop() {
        if expanded {
            post.push(f);
            continue;
        }
        if !seen.insert(Arc::as_ptr(&f)) {
            continue;
        }
        stack.push((f.clone(), true));
        for e in f.edges.iter().flatten() {
            if let Edge::Node(n) = e {
                if !seen.contains(&Arc::as_ptr(n)) {
                    stack.push((n.clone(), false));
                }
            }
        }
    }
    post.reverse();
    post
}

/// A rank-0 tensor of `like`'s dtype on its device.
fn scalar(v: f64, like: &Tensor) -> Tensor {
    Tensor::scalar(v, like.dtype(), like.device())
}

/// Sums `g` (broadcast from `shape`) back down to `shape`.
fn sum_to(g: Tensor, shape: &Shape) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g);
    }
    let lead = g.rank() - shape.rank();
    let mut axes: Vec<isize> = (0..lead as isize).collect();
    for (i, &d) in shape.dims().iter().enumerate() {
        if d == 1 && g.dims()[lead + i] != 1 {
            axes.push((lead + i) as isize);
        }
    }
    let r = if axes.is_empty() { g } else { g.reduce_axes(ReduceOp::Sum, &axes, true)? };
    r.reshape_to(shape.clone())
}

/// Broadcasts a reduction's output (or its gradient) back to the input shape.
fn unreduce(g: &Tensor, in_shape: &Shape, axes: &[usize], keepdim: bool) -> Result<Tensor> {
    let g = if keepdim { g.clone() } else { g.reshape_to(reduced_shape(in_shape, axes, true))? };
    g.expand(in_shape.clone())
}

/// `t` with dim `d` reversed.
fn reverse(t: &Tensor, d: usize) -> Result<Tensor> {
    let n = t.dims()[d];
    if n <= 1 {
        return Ok(t.clone());
    }
    let mut starts = vec![0i64; t.rank()];
    let mut steps = vec![1i64; t.rank()];
    starts[d] = n as i64 - 1;
    steps[d] = -1;
    Tensor::record(Op::Slice { starts, steps, lens: t.dims().to_vec() }, &[t])
}

/// Zero-pads dim `d` of `t` by `(before, after)`.
fn pad_dim(t: &Tensor, d: usize, before: usize, after: usize) -> Result<Tensor> {
    if before == 0 && after == 0 {
        return Ok(t.clone());
    }
    let mut pads = vec![(0, 0); t.rank()];
    pads[d] = (before, after);
    t.pad(&pads, 0)
}

/// Spreads dim `d` of `t` (length `l`) to `(l - 1) * s + 1` with `s - 1`
/// zeros between neighbours.
fn dilate_dim(t: &Tensor, d: usize, s: usize) -> Result<Tensor> {
    let l = t.dims()[d];
    if s <= 1 || l <= 1 {
        return Ok(t.clone());
    }
    let u = t.unsqueeze(d as isize + 1)?;
    let u = pad_dim(&u, d + 1, 0, s - 1)?;
    let mut dims = t.dims().to_vec();
    dims[d] = l * s;
    u.reshape_to(dims)?.narrow(d as isize, 0, (l - 1) * s + 1)
}

/// The gradient of a strided slice: `g` scattered back into zeros of `in_shape`.
fn slice_backward(g: &Tensor, in_shape: &Shape, starts: &[i64], steps: &[i64], lens: &[usize]) -> Result<Tensor> {
    if lens.contains(&0) {
        return Tensor::zeros(in_shape.clone(), g.dtype(), g.device());
    }
    let mut cur = g.clone();
    for d in 0..in_shape.rank() {
        let (n, st, sp, l) = (in_shape.dims()[d], starts[d], steps[d], lens[d]);
        if sp == 1 && st == 0 && l == n {
            continue;
        }
        let (t, lo) = if sp < 0 { (reverse(&cur, d)?, st + (l as i64 - 1) * sp) } else { (cur.clone(), st) };
        let s = sp.unsigned_abs() as usize;
        let t = dilate_dim(&t, d, s)?;
        let span = (l - 1) * s + 1;
        cur = pad_dim(&t, d, lo as usize, n - lo as usize - span)?;
    }
    Ok(cur)
}

fn not_implemented(op: &str) -> ExecError {
    ExecError::Invalid { op: "backward".into(), detail: format!("gradient of {op} not implemented") }
}

impl GradFn {
    fn op(&self) -> &Op {
        match &self.output.kind {
            NodeKind::Op(op) => op,
            _ => unreachable!("a GradFn records an op node"),
        }
    }

    /// The gradient of each operand that has an edge, given the output gradient `g`.
    fn vjp(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if let Some((_, custom)) = &self.custom {
            return custom(g);
        }
        let dev = g.device();
        let x: Vec<Tensor> = self.output.operands.iter().map(|n| Tensor::unregistered(dev, n.clone())).collect();
        let y = Tensor::unregistered(dev, self.output.clone());
        let need = |i: usize| self.edges.get(i).is_some_and(Option::is_some);
        let mut out: Vec<Option<Tensor>> = vec![None; x.len()];
        match self.op() {
            Op::Unary(u) => out[0] = Some(unary_grad(*u, &x[0], &y, g)?),
            Op::Binary(b) => {
                let (ga, gb) = binary_grad(*b, &x[0], &x[1], &y, g, need(0), need(1))?;
                out[0] = ga.map(|t| sum_to(t, x[0].shape())).transpose()?;
                out[1] = gb.map(|t| sum_to(t, x[1].shape())).transpose()?;
            }
            Op::Where => {
                let zero = scalar(0.0, g);
                if need(1) {
                    out[1] = Some(sum_to(x[0].where_(g, &zero)?, x[1].shape())?);
                }
                if need(2) {
                    out[2] = Some(sum_to(x[0].where_(&zero, g)?, x[2].shape())?);
                }
            }
            Op::Cast(_) => {
                if x[0].dtype().is_float() {
                    out[0] = Some(g.cast(x[0].dtype())?);
                }
            }
            Op::Reduce { op, axes, keepdim } => out[0] = Some(reduce_grad(*op, axes, *keepdim, &x[0], &y, g)?),
            Op::CumSum { axis, exclusive, reverse } => {
                let op = Op::CumSum { axis: *axis, exclusive: *exclusive, reverse: !*reverse };
                out[0] = Some(Tensor::record(op, &[g])?);
            }
            Op::Softmax { axis, log } => {
                let ax = [*axis as isize];
                out[0] = Some(if *log {
                    g.sub(&y.exp()?.mul(&g.reduce_axes(ReduceOp::Sum, &ax, true)?)?)?
                } else {
                    let s = g.mul(&y)?.reduce_axes(ReduceOp::Sum, &ax, true)?;
                    y.mul(&g.sub(&s)?)?
                });
            }
            Op::MatMul => {
                if need(0) {
                    out[0] = Some(sum_to(g.matmul(&x[1].t()?)?, x[0].shape())?);
                }
                if need(1) {
                    out[1] = Some(sum_to(x[0].t()?.matmul(g)?, x[1].shape())?);
                }
            }
            Op::Reshape(_) => out[0] = Some(g.reshape_to(x[0].shape().clone())?),
            Op::Permute(perm) => {
                let mut inv = vec![0isize; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i as isize;
                }
                out[0] = Some(g.permute(&inv)?);
            }
            Op::Expand(_) => out[0] = Some(sum_to(g.clone(), x[0].shape())?),
            Op::Slice { starts, steps, lens } => out[0] = Some(slice_backward(g, x[0].shape(), starts, steps, lens)?),
            Op::Concat { axis } => {
                let mut offset = 0;
                for (i, xi) in x.iter().enumerate() {
                    let len = xi.dims()[*axis];
                    if need(i) {
                        out[i] = Some(g.narrow(*axis as isize, offset, len)?);
                    }
                    offset += len;
                }
            }
            Op::Pad { before, after, mode } => {
                let gx = pad_grad(g, x[0].shape(), before, after, *mode)?;
                if need(1) {
                    out[1] = Some(g.sum(&[], false)?.sub(&gx.sum(&[], false)?)?);
                }
                out[0] = Some(gx);
            }
            Op::Gather { axis } => {
                if need(0) {
                    let zeros = Tensor::zeros(x[0].shape().clone(), g.dtype(), dev)?;
                    out[0] = Some(zeros.scatter_add(*axis as isize, &x[1], g)?);
                }
            }
            Op::ScatterAdd { axis } => {
                if need(0) {
                    out[0] = Some(g.clone());
                }
                if need(2) {
                    out[2] = Some(g.gather(*axis as isize, &x[1])?);
                }
            }
            Op::Conv2d(attrs) => {
                let (gx, gw) = conv2d_grad(attrs, &x[0], &x[1], g, need(0), need(1))?;
                out[0] = gx;
                out[1] = gw;
            }
            Op::Pool(attrs) => out[0] = Some(x[0].pool_grad(g, attrs.clone())?),
            Op::PoolGrad(attrs) => {
                // Piecewise constant in the input (which window maximum
                // wins), linear in the output gradient.
                if need(0) {
                    out[0] = Some(Tensor::zeros(x[0].shape().clone(), x[0].dtype(), dev)?);
                }
                if need(1) {
                    out[1] = Some(match attrs.kind {
                        // Its adjoint: each window averages what its taps received.
                        PoolKind::Avg { .. } => g.pool(attrs.clone())?,
                        PoolKind::Max => return Err(not_implemented("max_pool_grad (a second derivative)")),
                    });
                }
            }
            Op::Attention { attrs, part: AttentionPart::Out } => {
                let nf = attrs.forward_operands();
                if (3..nf).any(need) {
                    let what = if need(3) { "its scale" } else { "its mask" };
                    return Err(not_implemented(&format!("attention with respect to {what}")));
                }
                let grads = attention_grad(*attrs, &x, &y, g, [need(0), need(1), need(2)])?;
                for (i, gi) in grads.into_iter().enumerate() {
                    out[i] = gi;
                }
            }
            op @ (Op::Attention { .. }
            | Op::Parameter(_)
            | Op::Constant(..)
            | Op::ScalarParam(_)
            | Op::Iota { .. }
            | Op::Random { .. }
            | Op::ArgReduce { .. }
            | Op::AllReduce { .. }
            | Op::Dequantize(_)
            | Op::QuantMatMul(_)
            | Op::WriteAt { .. }
            | Op::PrefixAttention) => return Err(not_implemented(&op.name())),
        }
        for (i, o) in out.iter_mut().enumerate() {
            if !need(i) {
                *o = None;
            }
        }
        debug_assert!(out.iter().zip(&x).all(|(o, xi)| o.as_ref().is_none_or(|o| o.shape() == xi.shape())));
        Ok(out)
    }
}

/// Gradients of fused attention (`Op::Attention`, part `Out` with output
/// `y` over operands `x`) for the operands in `need` (q, k, v), in
/// FlashAttention-2's form: the log-sum-exp part over the same operands
/// (the planner computes it in the forward's kernel when both are in one
/// graph), `delta = rowsum(dO * O)`, and one gradient part per operand,
/// each recomputing the scores blockwise; summed down to the operand's
/// shape where its batch dims broadcast.
fn attention_grad(
    attrs: AttentionAttrs,
    x: &[Tensor],
    y: &Tensor,
    g: &Tensor,
    need: [bool; 3],
) -> Result<Vec<Option<Tensor>>> {
    let nf = attrs.forward_operands();
    let fwd: Vec<&Tensor> = x[..nf].iter().collect();
    let lse = Tensor::record(Op::Attention { attrs, part: AttentionPart::LogSumExp }, &fwd)?;
    let delta = g.mul(y)?.sum(&[-1], false)?;
    let mut operands = fwd;
    operands.extend([g, &lse, &delta]);
    let parts = [AttentionPart::GradQ, AttentionPart::GradK, AttentionPart::GradV];
    let mut out = Vec::with_capacity(3);
    for (i, part) in parts.into_iter().enumerate() {
        out.push(if need[i] {
            let gi = Tensor::record(Op::Attention { attrs, part }, &operands)?;
            Some(sum_to(gi, x[i].shape())?)
        } else {
            None
        });
    }
    Ok(out)
}

fn unary_grad(u: UnaryOp, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    use UnaryOp::*;
    let s = |v: f64| scalar(v, x);
    Ok(match u {
        Neg => g.neg()?,
        Abs => g.mul(&x.sign()?)?,
        Exp => g.mul(y)?,
        Log => g.div(x)?,
        Sqrt => g.div(&y.mul(&s(2.0))?)?,
        // d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 * y^3.
        Rsqrt => g.mul(&y.mul(y)?.mul(y)?.mul(&s(-0.5))?)?,
        Reciprocal => g.mul(&y.mul(y)?.neg()?)?,
        Relu => x.gt(&s(0.0))?.where_(g, &s(0.0))?,
        Sigmoid => g.mul(&y.mul(&s(1.0).sub(y)?)?)?,
        Tanh => g.mul(&s(1.0).sub(&y.mul(y)?)?)?,
        Gelu => {
            // Phi(x) + x phi(x).
            let cdf = x.mul(&s(std::f64::consts::FRAC_1_SQRT_2))?.erf()?.add(&s(1.0))?.mul(&s(0.5))?;
            let pdf = x
                .mul(x)?
                .mul(&s(-0.5))?
                .exp()?
                .mul(&s(0.5 * std::f64::consts::FRAC_2_SQRT_PI * std::f64::consts::FRAC_1_SQRT_2))?;
            g.mul(&cdf.add(&x.mul(&pdf)?)?)?
        }
        GeluTanh => {
            // y = x/2 (1 + tanh(u)), u = c (x + a x^3).
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let a = 0.044715;
            let x2 = x.mul(x)?;
            let t = x.mul(&x2.mul(&s(a))?.add(&s(1.0))?)?.mul(&s(c))?.tanh()?;
            let du = x2.mul(&s(3.0 * a))?.add(&s(1.0))?.mul(&s(c))?;
            let left = t.add(&s(1.0))?.mul(&s(0.5))?;
            let right = x.mul(&s(0.5))?.mul(&s(1.0).sub(&t.mul(&t)?)?)?.mul(&du)?;
            g.mul(&left.add(&right)?)?
        }
        Erf => g.mul(&x.mul(x)?.neg()?.exp()?.mul(&s(std::f64::consts::FRAC_2_SQRT_PI))?)?,
        Sin => g.mul(&x.cos()?)?,
        Cos => g.mul(&x.sin()?.neg()?)?,
        Floor | Ceil | Round | Sign => Tensor::zeros(x.shape().clone(), x.dtype(), x.device())?,
        // `NON_DIFFERENTIABLE_UNARY`.
        Not | IsNan | IsInf => unreachable!("bool results are never tracked"),
    })
}

/// Gradients of a binary op at the broadcast output shape (summed down by the caller).
fn binary_grad(
    b: BinaryOp,
    a: &Tensor,
    bb: &Tensor,
    y: &Tensor,
    g: &Tensor,
    need_a: bool,
    need_b: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    use BinaryOp::*;
    let s = |v: f64| scalar(v, a);
    let only = |want: bool, f: &dyn Fn() -> Result<Tensor>| if want { f().map(Some) } else { Ok(None) };
    let trunc = |q: Tensor| -> Result<Tensor> { q.sign()?.mul(&q.abs()?.floor()?) };
    Ok(match b {
        Add => (only(need_a, &|| Ok(g.clone()))?, only(need_b, &|| Ok(g.clone()))?),
        Sub => (only(need_a, &|| Ok(g.clone()))?, only(need_b, &|| g.neg())?),
        Mul => (only(need_a, &|| g.mul(bb))?, only(need_b, &|| g.mul(a))?),
        Div => (only(need_a, &|| g.div(bb))?, only(need_b, &|| g.mul(y)?.div(bb)?.neg())?),
        Pow => (
            only(need_a, &|| g.mul(bb)?.mul(&a.pow(&bb.sub(&s(1.0))?)?))?,
            // d/db a^b = a^b ln a, taken as 0 where a == 0 (like PyTorch).
            only(need_b, &|| {
                let d = g.mul(y)?.mul(&a.log()?)?;
                a.eq(&s(0.0))?.where_(&s(0.0), &d)
            })?,
        ),
        Maximum | Minimum => {
            let (wa, wb) = if b == Maximum { (a.gt(bb)?, bb.gt(a)?) } else { (a.lt(bb)?, bb.lt(a)?) };
            let tie = a.eq(bb)?.cast(a.dtype())?.mul(&s(0.5))?;
            (
                only(need_a, &|| g.mul(&wa.cast(a.dtype())?.add(&tie)?))?,
                only(need_b, &|| g.mul(&wb.cast(a.dtype())?.add(&tie)?))?,
            )
        }
        // a mod b = a - floor(a / b) * b.
        Mod => (only(need_a, &|| Ok(g.clone()))?, only(need_b, &|| g.mul(&a.div(bb)?.floor()?)?.neg())?),
        // rem(a, b) = a - trunc(a / b) * b.
        Rem => (only(need_a, &|| Ok(g.clone()))?, only(need_b, &|| g.mul(&trunc(a.div(bb)?)?)?.neg())?),
        // d/da log(e^a + e^b) = e^a / (e^a + e^b) = e^(a - out); likewise b.
        LogAddExp => (only(need_a, &|| g.mul(&a.sub(y)?.exp()?))?, only(need_b, &|| g.mul(&bb.sub(y)?.exp()?))?),
        // `NON_DIFFERENTIABLE_BINARY`.
        Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor => unreachable!("bool results are never tracked"),
    })
}

fn reduce_grad(op: ReduceOp, axes: &[usize], keepdim: bool, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Tensor> {
    if axes.is_empty() {
        // A reduction over no axes (recorded as an IR node) is the identity.
        return Ok(g.clone());
    }
    let shape = x.shape();
    let ge = unreduce(g, shape, axes, keepdim)?;
    let count: usize = axes.iter().map(|&a| shape.dims()[a]).product();
    let ax: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
    Ok(match op {
        ReduceOp::Sum => ge,
        ReduceOp::Mean => ge.div(&scalar(count as f64, x))?,
        ReduceOp::Max | ReduceOp::Min => {
            // Ties share the gradient evenly.
            let mask = x.eq(&unreduce(y, shape, axes, keepdim)?)?.cast(x.dtype())?;
            let n = mask.reduce_axes(ReduceOp::Sum, &ax, true)?;
            ge.mul(&mask)?.div(&n)?
        }
        ReduceOp::Prod => {
            // The product of the other elements, exact with zeros among them.
            let zero = scalar(0.0, x);
            let one = scalar(1.0, x);
            let is_zero = x.eq(&zero)?;
            let nonzero = is_zero.where_(&one, x)?;
            let p = nonzero.reduce_axes(ReduceOp::Prod, &ax, true)?;
            let zeros = is_zero.cast(x.dtype())?.reduce_axes(ReduceOp::Sum, &ax, true)?;
            let none_zero = p.div(&nonzero)?;
            let one_zero = is_zero.where_(&p.expand(shape.clone())?, &zero)?;
            let others = zeros.eq(&zero)?.where_(&none_zero, &zeros.eq(&one)?.where_(&one_zero, &zero)?)?;
            ge.mul(&others)?
        }
    })
}

fn pad_grad(g: &Tensor, in_shape: &Shape, before: &[usize], after: &[usize], mode: PadMode) -> Result<Tensor> {
    let mut cur = g.clone();
    for d in 0..in_shape.rank() {
        let (p, q, n) = (before[d], after[d], in_shape.dims()[d]);
        if p == 0 && q == 0 {
            continue;
        }
        let ax = d as isize;
        let center = cur.narrow(ax, p, n)?;
        cur = match mode {
            PadMode::Constant => center,
            PadMode::Reflect => {
                let mut acc = center;
                if p > 0 {
                    let b = reverse(&cur.narrow(ax, 0, p)?, d)?;
                    acc = acc.add(&pad_dim(&b, d, 1, n - 1 - p)?)?;
                }
                if q > 0 {
                    let a = reverse(&cur.narrow(ax, p + n, q)?, d)?;
                    acc = acc.add(&pad_dim(&a, d, n - 1 - q, 1)?)?;
                }
                acc
            }
            PadMode::Edge => {
                let mut acc = center;
                if p > 0 {
                    let b = cur.narrow(ax, 0, p)?.reduce_axes(ReduceOp::Sum, &[ax], true)?;
                    acc = acc.add(&pad_dim(&b, d, 0, n - 1)?)?;
                }
                if q > 0 {
                    let a = cur.narrow(ax, p + n, q)?.reduce_axes(ReduceOp::Sum, &[ax], true)?;
                    acc = acc.add(&pad_dim(&a, d, n - 1, 0)?)?;
                }
                acc
            }
        };
    }
    Ok(cur)
}

/// Conv2d gradients, written as more convolutions (groups handled one by one).
fn conv2d_grad(
    c: &ConvAttrs,
    x: &Tensor,
    w: &Tensor,
    g: &Tensor,
    need_x: bool,
    need_w: bool,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let groups = c.groups;
    if groups > 1 {
        let (cg, og) = (x.dims()[1] / groups, w.dims()[0] / groups);
        let mut gxs = Vec::new();
        let mut gws = Vec::new();
        for i in 0..groups {
            let xi = x.narrow(1, i * cg, cg)?;
            let wi = w.narrow(0, i * og, og)?;
            let gi = g.narrow(1, i * og, og)?;
            let one = ConvAttrs { groups: 1, ..c.clone() };
            let (gx, gw) = conv2d_grad(&one, &xi, &wi, &gi, need_x, need_w)?;
            gxs.extend(gx);
            gws.extend(gw);
        }
        // Input gradients join on the channel axis, weight gradients on the output axis.
        let cat = |v: Vec<Tensor>, axis: isize| -> Result<Option<Tensor>> {
            if v.is_empty() {
                return Ok(None);
            }
            let refs: Vec<&Tensor> = v.iter().collect();
            Tensor::concat(&refs, axis).map(Some)
        };
        return Ok((cat(gxs, 1)?, cat(gws, 0)?));
    }
    let (xd, wd, gd) = (x.dims().to_vec(), w.dims().to_vec(), g.dims().to_vec());
    let (s, pd, dl) = (c.strides, c.pads, c.dilations);
    let mut gx = None;
    if need_x {
        // Full correlation of the dilated gradient with the flipped,
        // transposed kernel, then cropped/padded to the input's extent.
        let mut t = g.clone();
        for (i, &si) in s.iter().enumerate() {
            t = dilate_dim(&t, 2 + i, si)?;
        }
        let wf = reverse(&reverse(w, 2)?, 3)?.permute(&[1, 0, 2, 3])?;
        let mut t2 = t;
        // Zero padding goes to the convolution itself (nothing
        // materialized); only a crop needs its own op.
        let mut pads = [0usize; 4];
        for i in 0..2 {
            let k_eff = dl[i] * (wd[2 + i] - 1);
            // Output index h (unpadded input coordinate) reads gradient rows h + pad - k_eff .. h + pad.
            let lo = k_eff as i64 - pd[i] as i64;
            let covered = (gd[2 + i] - 1) * s[i] + 1;
            let hi = xd[2 + i] as i64 + pd[i] as i64 - covered as i64;
            if lo >= 0 && hi >= 0 {
                (pads[i], pads[i + 2]) = (lo as usize, hi as usize);
            } else {
                t2 = pad_or_crop(&t2, 2 + i, lo, hi)?;
            }
        }
        let attrs = ConvAttrs { strides: [1, 1], pads, dilations: dl, groups: 1 };
        gx = Some(t2.conv2d(&wf, attrs)?);
    }
    let mut gw = None;
    if need_w {
        let xt = x.permute(&[1, 0, 2, 3])?;
        let gt = g.permute(&[1, 0, 2, 3])?;
        let attrs = ConvAttrs { strides: dl, pads: pd, dilations: s, groups: 1 };
        let r = xt.conv2d(&gt, attrs)?;
        let r = r.narrow(2, 0, wd[2])?.narrow(3, 0, wd[3])?;
        gw = Some(r.permute(&[1, 0, 2, 3])?);
    }
    Ok((gx, gw))
}

/// Pads dim `d` by `lo`/`hi` elements (negative values crop).
fn pad_or_crop(t: &Tensor, d: usize, lo: i64, hi: i64) -> Result<Tensor> {
    let mut t = t.clone();
    if lo < 0 || hi < 0 {
        let n = t.dims()[d] as i64;
        let start = (-lo).max(0);
        let end = n - (-hi).max(0);
        t = t.narrow(d as isize, start as usize, (end - start).max(0) as usize)?;
    }
    pad_dim(&t, d, lo.max(0) as usize, hi.max(0) as usize)
}
