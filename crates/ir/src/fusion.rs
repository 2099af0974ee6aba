//! Fusion planning: cuts a [`Graph`] into an ordered list of kernels
//! ([`FusionPlan`]), each of which a backend lowers to one compute shader.
//!
//! Rules:
//! - Chains of elementwise, broadcast and view ops (`Reshape`, `Permute`,
//!   `Expand`, `Slice`, `Concat`, `Pad`, `Where`, `Cast`, leaves) become one
//!   [`KernelKind::Elementwise`] kernel evaluated per output element; views
//!   are index math, never materialized.
//! - Reductions, arg-reductions, softmax, cumulative sums, gathers,
//!   scatter-adds and random ops are kernel roots that inline their
//!   elementwise prologue (operands evaluated at the operand index inside
//!   the loop). Matmul, convolution, pooling and its gradient inline only
//!   views and leaves (an inlined elementwise prologue would be recomputed
//!   once per output column or window).
//! - Graph outputs, non-elementwise roots and nodes needed by several
//!   kernels are materialized (written to a buffer). Cheap leaves
//!   (constants, lifted scalars, iota) are duplicated instead.
//! - Every kernel binds at most [`FusionLimits::max_storage_buffers`]
//!   storage buffers (inputs + outputs; a value of more than
//!   [`FusionLimits::window_elements`] counts once per window); a group
//!   that would exceed it is
//!   split by materializing an intermediate node, and a `Concat` with too
//!   many operands is written by several kernels, each covering a range of
//!   its operands. Planning never fails.
//! - Independent elementwise kernels with identical output shapes may share
//!   one multi-output kernel when the buffer limit allows.
//! - Attention parts (`Op::Attention`) are roots that inline views and
//!   leaves only. Parts over the same operands that one loop computes
//!   together share a kernel when the buffer limit allows (windows
//!   counted): the output with its log-sum-exp, and the key gradient with
//!   the value gradient ([`KernelKind::Attention`]); they never join a
//!   multi-tensor kernel. A view read only by attention kernels
//!   (the heads of a multi-head projection, read by the forward and the
//!   three gradients) is inlined into each, like a cheap leaf, instead of
//!   being written once: its index math costs less than a copy kernel.
//! - Opt-in ([`FusionLimits`]): a matmul may absorb its same-shape
//!   elementwise consumers as an epilogue (`matmul_epilogue`), and a graph
//!   output used only inside one elementwise kernel of its shape may be
//!   computed there and written as an extra output (`inline_outputs`),
//!   and reductions over the last axis may fold into the elementwise
//!   kernel that consumes them row by row (`row_kernels`).
//! - Opt-in ([`FusionLimits::multi_tensor`]): independent elementwise
//!   kernels of any shapes join one multi-tensor (horizontal) kernel, one
//!   segment per output shape, within the buffer limit (see [`multi`]).
//!
//! The plan is deterministic: the same graph and limits give the same plan.

use crate::{Graph, NodeId, Op};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

pub mod multi;

/// Limits a backend imposes on one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusionLimits {
    /// Most storage buffers (inputs + outputs) one kernel may bind. The
    /// uniform buffer of lifted scalars does not count. At least 2.
    pub max_storage_buffers: usize,
    /// Most times one inlined node may be evaluated per output element
    /// before it is materialized instead (guards against exponential
    /// recomputation in DAGs with much sharing).
    pub max_inline_evals: usize,
    /// Merge independent elementwise kernels of identical shape.
    pub merge_siblings: bool,
    /// Let a matmul absorb its elementwise consumers as an epilogue (see
    /// [`KernelKind::MatMul`]). Off by default; backends that lower
    /// epilogues turn it on.
    pub matmul_epilogue: bool,
    /// Let a graph output whose users all sit in one elementwise kernel of
    /// its shape be computed inside that kernel and written as an extra
    /// output of it (instead of a kernel of its own that the consumer then
    /// reads back). Off by default.
    pub inline_outputs: bool,
    /// Fold f32 reductions over the last axis (keepdim) into the
    /// elementwise kernel that consumes them row by row, as one
    /// [`KernelKind::Rows`] kernel: layer norm (mean, variance,
    /// normalize) or a hand-written softmax becomes one kernel that reads
    /// each row where three kernels read it three times. Off by default;
    /// backends whose row kernels cooperate through workgroup memory
    /// turn it on.
    pub row_kernels: bool,
    /// Join independent elementwise kernels of any shapes (no data
    /// dependency between them) into one [`KernelKind::MultiTensor`]
    /// kernel, as a fused multi-tensor optimizer update does, while the
    /// joined kernel binds at most `max_storage_buffers` (windows
    /// counted). Off by default; backends that lower multi-tensor kernels
    /// turn it on.
    pub multi_tensor: bool,
    /// Most elements one storage binding covers: a materialized value of
    /// more elements is bound as several windows of this many elements
    /// (how a backend reaches tensors beyond its binding limit), each
    /// counting against `max_storage_buffers`. `u64::MAX` (the default):
    /// every value is one binding.
    pub window_elements: u64,
    /// Most elements an f32 reduction may combine per output and still be
    /// evaluated inside the one kernel that consumes it, as a loop per
    /// element, instead of in a kernel of its own (0: never). It joins an
    /// elementwise kernel over its own output's elements (a bias
    /// gradient's column sum inside the optimizer's update) or a reduction
    /// over them (a loss's sum over classes inside its mean over the
    /// batch), evaluated at most [`MAX_INLINE_REDUCTION_EVALS`] times per
    /// element there. The invocation that uses an element computes it, so
    /// the reduction costs no dispatch and no buffer. Off by default;
    /// backends that lower a reduction as a value function turn it on.
    pub inline_reductions: u64,
    /// Let a kernel with an inlined reduction join a multi-tensor kernel
    /// (see [`FusionLimits::multi_tensor`]). A GPU runs each segment on
    /// warps of its own (segments start on whole subgroups), so the
    /// reduction's loop delays no other segment; llvmpipe runs every
    /// segment's code, masked, for every batch of lanes, so there the
    /// loop is paid once per batch of the whole dispatch. Off by default.
    pub join_inlined_reductions: bool,
}

/// Most times per element of its kernel an inlined reduction (see
/// [`FusionLimits::inline_reductions`]) may be evaluated: a kernel written
/// per element evaluates a value once per use (an SGD update with
/// momentum uses the gradient twice), one in straight-line form once.
pub const MAX_INLINE_REDUCTION_EVALS: usize = 2;

impl Default for FusionLimits {
    fn default() -> Self {
        FusionLimits {
            max_storage_buffers: 8,
            max_inline_evals: 8,
            merge_siblings: true,
            matmul_epilogue: false,
            inline_outputs: false,
            row_kernels: false,
            multi_tensor: false,
            window_elements: u64::MAX,
            inline_reductions: 0,
            join_inlined_reductions: false,
        }
    }
}

/// What a kernel computes; decides the loop structure of its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelKind {
    /// Per-element evaluation of one or more outputs of identical shape.
    Elementwise,
    /// Several independent elementwise kernels in one dispatch (see
    /// [`FusionLimits::multi_tensor`]): the outputs, grouped by shape and
    /// contiguous per shape, form segments, each evaluated like an
    /// [`KernelKind::Elementwise`] kernel over its own shape
    /// ([`Kernel::segments`]).
    MultiTensor,
    /// Part of a `Concat` root: operands `start..end` of the root.
    ConcatPart {
        /// First operand index.
        start: usize,
        /// One past the last operand index.
        end: usize,
    },
    /// `Op::Reduce`.
    Reduce,
    /// `Op::ArgReduce`.
    ArgReduce,
    /// `Op::Softmax`.
    Softmax,
    /// `Op::CumSum`.
    CumSum,
    /// `Op::MatMul`. With [`FusionLimits::matmul_epilogue`] the kernel may
    /// carry an epilogue: then its output is an elementwise node of the
    /// matmul's shape, the matmul node is listed in `inline`, and every
    /// inlined node that depends on the matmul (the output included) is an
    /// elementwise op (`Unary`, `Binary`, `Where`, `Cast`) of that shape, so
    /// it can be evaluated from the accumulator at the output index. See
    /// [`Kernel::matmul_node`].
    MatMul,
    /// `Op::Gather`.
    Gather,
    /// Rows of the output shape, one at a time (see
    /// [`FusionLimits::row_kernels`]): the inlined `Reduce` nodes reduce
    /// the last axis (keepdim, f32) of a value of the output shape; every
    /// other node is an elementwise op or view evaluated at an index of
    /// its row, so a row's reductions complete before its outputs are
    /// written.
    Rows,
    /// `Op::Random`.
    Random,
    /// `Op::Conv2d`.
    Conv2d,
    /// `Op::Pool`.
    Pool,
    /// `Op::ScatterAdd`.
    ScatterAdd,
    /// `Op::PoolGrad`.
    PoolGrad,
    /// `Op::Attention`: one part, or several parts over the same operands
    /// and attributes (`Out` with `LogSumExp`, `GradK` with `GradV`), one
    /// output each.
    Attention,
    /// `Op::Dequantize` or `Op::QuantMatMul`: reads a block-quantized
    /// weight (see `crate::quant`).
    Quant,
    /// `Op::WriteAt` or `Op::PrefixAttention`: a KV cache written or read
    /// at positions taken from data (they check them: an error slot).
    Cache,
}

impl KernelKind {
    /// Kernels that read indices from data and must report one out of
    /// range: they bind one storage buffer more than their inputs and
    /// outputs (a backend's error slot), counted by
    /// [`Kernel::storage_buffers`].
    pub fn checks_indices(self) -> bool {
        matches!(self, KernelKind::Gather | KernelKind::ScatterAdd | KernelKind::Cache)
    }
}

/// One kernel of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    /// The loop structure.
    pub kind: KernelKind,
    /// Nodes whose values this kernel writes to buffers, in order. For a
    /// non-elementwise kind this is exactly the root (attention: the
    /// root and the parts grouped with it).
    pub outputs: Vec<NodeId>,
    /// Materialized nodes read from buffers (graph parameters or other
    /// kernels' outputs), sorted by id.
    pub inputs: Vec<NodeId>,
    /// Nodes evaluated inside the kernel, in topological order. For
    /// elementwise and row kernels this includes the outputs; for other
    /// kinds it is the root's prologue (the root itself is not listed).
    pub inline: Vec<NodeId>,
    /// For a [`KernelKind::MultiTensor`] kernel, how many of `outputs`
    /// (contiguous) each segment has, as the planner grouped them (see
    /// [`Kernel::segments`]); empty: grouped by shape.
    pub segment_lens: Vec<usize>,
}

impl Kernel {
    /// Storage buffers bound by this kernel: inputs, outputs and, for
    /// kinds that check indices, the error slot.
    pub fn storage_buffers(&self) -> usize {
        self.inputs.len() + self.outputs.len() + self.kind.checks_indices() as usize
    }

    /// The node whose shape defines the kernel's iteration (the root).
    pub fn root(&self) -> NodeId {
        self.outputs[0]
    }

    /// For a [`KernelKind::MatMul`] kernel: the matmul node (the root, or
    /// the inlined matmul of a kernel with an epilogue).
    pub fn matmul_node(&self, graph: &Graph) -> Option<NodeId> {
        if self.kind != KernelKind::MatMul {
            return None;
        }
        let root = self.root();
        if matches!(graph.node(root).op, Op::MatMul) {
            return Some(root);
        }
        self.inline.iter().copied().find(|&x| matches!(graph.node(x).op, Op::MatMul))
    }
}

/// An ordered list of kernels; running them in order computes every graph
/// output.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct FusionPlan {
    /// Kernels in execution order.
    pub kernels: Vec<Kernel>,
    /// Every node written to a buffer by some kernel, sorted.
    pub materialized: Vec<NodeId>,
}

impl FusionPlan {
    /// A short text dump, one kernel per line.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (i, k) in self.kernels.iter().enumerate() {
            let ids = |v: &[NodeId]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
            let _ = writeln!(
                s,
                "k{i} {:?}: out [{}] in [{}] inline [{}]",
                k.kind,
                ids(&k.outputs),
                ids(&k.inputs),
                ids(&k.inline)
            );
        }
        s
    }
}

/// How a node may be placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// Graph input: read from a buffer.
    Param,
    /// Duplicated into every kernel that uses it.
    CheapLeaf,
    /// Elementwise or view: inlined into its users' kernel when possible.
    Fusible,
    /// A kernel root of the given kind.
    Root(KernelKind),
}

fn class(op: &Op) -> Class {
    match op {
        Op::Parameter(_) => Class::Param,
        Op::Constant(..) | Op::ScalarParam(_) | Op::Iota { .. } => Class::CheapLeaf,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) => Class::Fusible,
        Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } | Op::Concat { .. } | Op::Pad { .. } => {
            Class::Fusible
        }
        Op::Reduce { .. } => Class::Root(KernelKind::Reduce),
        Op::ArgReduce { .. } => Class::Root(KernelKind::ArgReduce),
        Op::Softmax { .. } => Class::Root(KernelKind::Softmax),
        Op::CumSum { .. } => Class::Root(KernelKind::CumSum),
        Op::MatMul => Class::Root(KernelKind::MatMul),
        Op::Gather { .. } => Class::Root(KernelKind::Gather),
        Op::Random { .. } => Class::Root(KernelKind::Random),
        Op::Conv2d(_) => Class::Root(KernelKind::Conv2d),
        Op::Pool(_) => Class::Root(KernelKind::Pool),
        Op::ScatterAdd { .. } => Class::Root(KernelKind::ScatterAdd),
        Op::PoolGrad(_) => Class::Root(KernelKind::PoolGrad),
        Op::Attention { .. } => Class::Root(KernelKind::Attention),
        // No backend accepts a collective (`Backend::supports`), and both
        // backends refuse a graph holding one before planning it: the
        // executor's plan runs it in a segment of its own.
        Op::AllReduce { .. } => unreachable!("a collective reached the fusion planner"),
        Op::Dequantize(_) | Op::QuantMatMul(_) => Class::Root(KernelKind::Quant),
        Op::WriteAt { .. } | Op::PrefixAttention => Class::Root(KernelKind::Cache),
    }
}

fn is_view(op: &Op) -> bool {
    op.is_view()
}

/// Whether a group of `kind` may inline node `op` as part of its prologue.
fn accepts(kind: KernelKind, op: &Op) -> bool {
    match kind {
        KernelKind::MatMul
        | KernelKind::Conv2d
        | KernelKind::Pool
        | KernelKind::PoolGrad
        | KernelKind::Attention
        | KernelKind::Quant
        | KernelKind::Cache => is_view(op),
        _ => true,
    }
}

/// Plans the kernels of `graph` under `limits`. Never fails.
pub fn plan(graph: &Graph, limits: &FusionLimits) -> FusionPlan {
    plan_sized_like(graph, limits, None)
}

/// [`plan`] for a size variant: `earlier` is the graph of the same
/// structure planned before at other sizes, aligned node for node. Two
/// independent kernels of one shape merge (siblings), and outputs of a
/// multi-tensor kernel share a segment, only where their shapes were
/// equal there too: shapes equal only at these sizes (a `[T, T]` mask
/// and a `[T, 64]` activation at `T = 64`) would otherwise change the
/// kernels at that size alone, and with them their families. Never less
/// exact: it only keeps kernels and segments apart.
pub fn plan_sized_like(graph: &Graph, limits: &FusionLimits, earlier: Option<&Graph>) -> FusionPlan {
    debug_assert!(earlier.is_none_or(|e| e.len() == graph.len()), "the earlier graph aligns node for node");
    let max = Budget { graph, max: limits.max_storage_buffers.max(2), window: limits.window_elements.max(1) };
    let mut forced: BTreeSet<NodeId> = BTreeSet::new();
    // Each round materializes at least one more node, so this terminates.
    loop {
        let groups = assign(graph, &forced, limits);
        let mut progressed = false;
        for g in &groups {
            if max.fits_kernel(&g.kernel) {
                continue;
            }
            if let Some(n) = split_candidate(graph, &g.kernel, &max) {
                if forced.insert(n) {
                    progressed = true;
                    break;
                }
            }
        }
        if !progressed {
            return finish(graph, groups, max, limits, earlier);
        }
    }
}

struct Group {
    kernel: Kernel,
}

/// The storage bindings one kernel may use: at most `max`, a value of more
/// than `window` elements counting once per window
/// ([`FusionLimits::window_elements`]).
struct Budget<'g> {
    graph: &'g Graph,
    max: usize,
    window: u64,
}

impl Budget<'_> {
    /// Bindings value `id` takes.
    fn weight(&self, id: NodeId) -> usize {
        let n = self.graph.node(id).shape.numel() as u64;
        usize::try_from(n.div_ceil(self.window).max(1)).unwrap_or(usize::MAX)
    }

    /// Bindings the values `ids` take.
    fn cost<'i>(&self, ids: impl IntoIterator<Item = &'i NodeId>) -> usize {
        ids.into_iter().fold(0, |c, &x| c.saturating_add(self.weight(x)))
    }

    /// Whether the values `ids` fit one kernel.
    fn fits<'i>(&self, ids: impl IntoIterator<Item = &'i NodeId>) -> bool {
        self.cost(ids) <= self.max
    }

    /// Whether kernel `k` fits: its inputs and outputs, and the error slot
    /// of a kind that checks indices (see [`Kernel::storage_buffers`]).
    fn fits_kernel(&self, k: &Kernel) -> bool {
        self.cost(k.inputs.iter().chain(&k.outputs)).saturating_add(k.kind.checks_indices() as usize) <= self.max
    }
}

/// Assigns every live node to a group by a backward pass.
fn assign(graph: &Graph, forced: &BTreeSet<NodeId>, limits: &FusionLimits) -> Vec<Group> {
    let n = graph.len();
    let nodes = graph.nodes();
    let mut is_output = vec![false; n];
    for o in &graph.outputs {
        is_output[o.index()] = true;
    }
    // group[i]: the group node i is inlined into or roots; None = not in one.
    let mut group: Vec<Option<usize>> = vec![None; n];
    let mut live = vec![false; n];
    // evals[i]: how often node i is evaluated per iteration of its group.
    let mut evals = vec![0usize; n];
    let mut kinds: Vec<KernelKind> = Vec::new();
    let mut roots: Vec<NodeId> = Vec::new();
    // Extra outputs of each group (`FusionLimits::inline_outputs`).
    let mut extra: Vec<Vec<NodeId>> = Vec::new();
    // Views read only by attention kernels (directly or through other such
    // views): inlined into each of them instead of written once and read
    // back (see the module doc).
    let mut dup = vec![false; n];
    // Users of each node (with multiplicity), filled as users are visited.
    let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for (i, node) in nodes.iter().enumerate() {
        for x in &node.inputs {
            users[x.index()].push(NodeId(i as u32));
        }
    }
    for i in (0..n).rev() {
        let id = NodeId(i as u32);
        let node = &nodes[i];
        let used = users[i].iter().any(|u| live[u.index()]);
        if !used && !is_output[i] {
            continue;
        }
        live[i] = true;
        let c = class(&node.op);
        let new_group = |kind: KernelKind, kinds: &mut Vec<KernelKind>, roots: &mut Vec<NodeId>| {
            kinds.push(kind);
            roots.push(id);
            kinds.len() - 1
        };
        if c == Class::Root(KernelKind::Reduce) && !is_output[i] && !forced.contains(&id) {
            let at =
                Placed { users: &users[i], live: &live, group: &group, evals: &evals, kinds: &kinds, roots: &roots };
            if let Some((g, ev)) = inline_reduction_group(graph, id, &at, limits) {
                group[i] = Some(g);
                evals[i] = ev;
                continue;
            }
        }
        match c {
            Class::Param => {}
            Class::CheapLeaf => {
                if is_output[i] {
                    group[i] = Some(new_group(KernelKind::Elementwise, &mut kinds, &mut roots));
                    evals[i] = 1;
                }
            }
            Class::Root(kind) => {
                let epilogue = (kind == KernelKind::MatMul && limits.matmul_epilogue && !is_output[i])
                    .then(|| epilogue_group(graph, id, &users[i], &live, &group, &kinds, &roots))
                    .flatten()
                    .filter(|&g| extra.get(g).is_none_or(|e| e.is_empty()));
                group[i] = Some(match epilogue {
                    Some(g) => {
                        kinds[g] = KernelKind::MatMul;
                        g
                    }
                    None => new_group(kind, &mut kinds, &mut roots),
                });
                evals[i] = 1;
            }
            Class::Fusible
                if node.op.is_view() && !is_output[i] && !forced.contains(&id) && {
                    let mut live_users = users[i].iter().filter(|u| live[u.index()]).peekable();
                    live_users.peek().is_some()
                        && live_users.all(|u| {
                            dup[u.index()] || group[u.index()].is_some_and(|g| kinds[g] == KernelKind::Attention)
                        })
                } =>
            {
                dup[i] = true;
            }
            Class::Fusible => {
                let mut gs: BTreeSet<usize> = BTreeSet::new();
                let mut ev = 0usize;
                for u in &users[i] {
                    if !live[u.index()] {
                        continue;
                    }
                    match group[u.index()] {
                        Some(g) => {
                            gs.insert(g);
                            ev += evals[u.index()].max(1);
                        }
                        None => {
                            // A user outside any group (cannot happen for
                            // fusible users); force materialization.
                            gs.insert(usize::MAX);
                        }
                    }
                }
                let single = (gs.len() == 1).then(|| *gs.iter().next().expect("one group"));
                let join_out = is_output[i]
                    && limits.inline_outputs
                    && !forced.contains(&id)
                    && single.is_some_and(|g| {
                        g != usize::MAX
                            && kinds[g] == KernelKind::Elementwise
                            && nodes[roots[g].index()].shape == node.shape
                    })
                    && ev <= limits.max_inline_evals;
                let join = !is_output[i]
                    && !forced.contains(&id)
                    && gs.len() == 1
                    && {
                        let g = *gs.iter().next().expect("one group");
                        g != usize::MAX && accepts(kinds[g], &node.op)
                    }
                    && ev <= limits.max_inline_evals;
                if join_out {
                    let g = single.expect("one group");
                    extra.resize(kinds.len(), Vec::new());
                    group[i] = Some(g);
                    evals[i] = ev;
                    extra[g].push(id);
                } else if join {
                    group[i] = gs.iter().next().copied();
                    evals[i] = ev;
                } else {
                    group[i] = Some(new_group(KernelKind::Elementwise, &mut kinds, &mut roots));
                    evals[i] = 1;
                }
            }
        }
    }
    // Build kernels: inputs are materialized operands reached from members.
    let ng = kinds.len();
    let mut inline: Vec<Vec<NodeId>> = vec![Vec::new(); ng];
    let mut inputs: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); ng];
    let is_root = |x: NodeId, group: &[Option<usize>]| -> bool { group[x.index()].is_some_and(|g| roots[g] == x) };
    // Members per group, then operand closure including cheap leaves.
    let mut members: Vec<BTreeSet<NodeId>> = vec![BTreeSet::new(); ng];
    for (i, g) in group.iter().enumerate() {
        if let Some(g) = *g {
            members[g].insert(NodeId(i as u32));
        }
    }
    for g in 0..ng {
        let mut set = members[g].clone();
        // Walk operands: cheap leaves join, materialized nodes are inputs.
        let mut stack: Vec<NodeId> = members[g].iter().copied().collect();
        while let Some(x) = stack.pop() {
            for &op in &nodes[x.index()].inputs {
                let oc = class(&nodes[op.index()].op);
                let materialized = oc == Class::Param || is_root(op, &group);
                if materialized {
                    inputs[g].insert(op);
                } else if oc == Class::CheapLeaf || dup[op.index()] || group[op.index()] == Some(g) {
                    if set.insert(op) {
                        stack.push(op);
                    }
                } else {
                    inputs[g].insert(op);
                }
            }
        }
        let root = roots[g];
        let elementwise = kinds[g] == KernelKind::Elementwise;
        inline[g] = set.into_iter().filter(|&x| elementwise || x != root).collect();
    }
    let mut out: Vec<Group> = (0..ng)
        .map(|g| Group {
            kernel: Kernel {
                kind: kinds[g],
                outputs: std::iter::once(roots[g]).chain(extra.get(g).into_iter().flatten().copied()).collect(),
                inputs: inputs[g].iter().copied().collect(),
                inline: inline[g].clone(),
                segment_lens: Vec::new(),
            },
        })
        .collect();
    // Topological order of kernels: by root id (roots were created in
    // reverse order).
    out.sort_by_key(|g| g.kernel.outputs[0]);
    out
}

/// Where the backward pass of [`assign`] stands when it reaches a node:
/// the node's users, which nodes are live, the group of each assigned
/// node and how often it is evaluated per iteration, and each group's kind
/// and root.
struct Placed<'a> {
    users: &'a [NodeId],
    live: &'a [bool],
    group: &'a [Option<usize>],
    evals: &'a [usize],
    kinds: &'a [KernelKind],
    roots: &'a [NodeId],
}

/// The group reduction `id` joins as an inlined value, with how often it
/// is evaluated per iteration there (see
/// [`FusionLimits::inline_reductions`]): f32, at most that many elements
/// per output, every live user in one elementwise or reduction group that
/// iterates over exactly the reduction's output elements (an elementwise
/// kernel of its size, a reduction of a value of its size), so no element
/// is computed for more than [`MAX_INLINE_REDUCTION_EVALS`] uses; never a
/// reduction a row kernel may take ([`FusionLimits::row_kernels`]).
fn inline_reduction_group(graph: &Graph, id: NodeId, at: &Placed, limits: &FusionLimits) -> Option<(usize, usize)> {
    let nodes = graph.nodes();
    let n = &nodes[id.index()];
    let x = &nodes[n.inputs.first()?.index()];
    let (out, len) = (n.shape.numel() as u64, x.shape.numel() as u64);
    let f32s = n.dtype == crate::DType::F32 && x.dtype == crate::DType::F32;
    if !matches!(n.op, Op::Reduce { .. }) || !f32s || out == 0 || len / out > limits.inline_reductions {
        return None;
    }
    // A reduction a row kernel may take (layer norm's mean and variance)
    // is left to it: one row kernel reads the row once for all of them.
    if limits.row_kernels && row_reduction(graph, id, &x.shape) {
        return None;
    }
    let mut g = None;
    let mut ev = 0usize;
    for u in at.users.iter().filter(|u| at.live[u.index()]) {
        let gu = at.group[u.index()]?;
        if g.is_some_and(|x| x != gu) {
            return None;
        }
        g = Some(gu);
        ev += at.evals[u.index()].max(1);
    }
    let g = g?;
    let root = &nodes[at.roots[g].index()];
    let iterations = match at.kinds[g] {
        KernelKind::Elementwise => root.shape.numel(),
        KernelKind::Reduce => nodes[root.inputs[0].index()].shape.numel(),
        _ => return None,
    };
    (iterations as u64 == out && ev <= MAX_INLINE_REDUCTION_EVALS).then_some((g, ev))
}

/// Whether kernel `k` evaluates an inlined reduction (see
/// [`FusionLimits::inline_reductions`]; a row kernel's own reductions are
/// not such): such a kernel stays what it is, never an epilogue of a
/// matmul nor part of a row kernel, whose forms evaluate only elementwise
/// ops per element, nor (unless [`FusionLimits::join_inlined_reductions`])
/// a segment of a multi-tensor kernel.
pub fn inlines_reduction(graph: &Graph, k: &Kernel) -> bool {
    k.kind != KernelKind::Rows && k.inline.iter().any(|&x| matches!(graph.node(x).op, Op::Reduce { .. }))
}

/// The elementwise group matmul node `mm` may join as the producer of an
/// epilogue: all live users of `mm` are in one elementwise group whose root
/// has `mm`'s shape, and every member depending on `mm` is an elementwise
/// op of that shape (so it is evaluated at the output index only).
fn epilogue_group(
    graph: &Graph,
    mm: NodeId,
    users: &[NodeId],
    live: &[bool],
    group: &[Option<usize>],
    kinds: &[KernelKind],
    roots: &[NodeId],
) -> Option<usize> {
    let nodes = graph.nodes();
    let mut g = None;
    for u in users.iter().filter(|u| live[u.index()]) {
        let gu = group[u.index()]?;
        if g.is_some_and(|x| x != gu) {
            return None;
        }
        g = Some(gu);
    }
    let g = g?;
    let shape = &nodes[mm.index()].shape;
    if kinds[g] != KernelKind::Elementwise || nodes[roots[g].index()].shape != *shape {
        return None;
    }
    // Members of `g` are all later than `mm` or not yet assigned, so a
    // forward walk from `mm` over members finds every dependent.
    let mut dep: BTreeSet<NodeId> = BTreeSet::new();
    dep.insert(mm);
    for x in mm.index() + 1..nodes.len() {
        if group[x] != Some(g) {
            continue;
        }
        let n = &nodes[x];
        if matches!(n.op, Op::Reduce { .. }) {
            // An inlined reduction: the group stays elementwise.
            return None;
        }
        if !n.inputs.iter().any(|o| dep.contains(o)) {
            continue;
        }
        let elementwise = matches!(n.op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_));
        if !elementwise || n.shape != *shape {
            return None;
        }
        dep.insert(NodeId(x as u32));
    }
    Some(g)
}

/// Picks an inlined node of `k` to materialize so that `k` gets fewer
/// inputs: the one reaching the most distinct inputs while still fitting.
fn split_candidate(graph: &Graph, k: &Kernel, max: &Budget) -> Option<NodeId> {
    let nodes = graph.nodes();
    let inl: BTreeSet<NodeId> = k.inline.iter().copied().collect();
    let inputs: BTreeSet<NodeId> = k.inputs.iter().copied().collect();
    let mut reach: HashMap<NodeId, BTreeSet<NodeId>> = HashMap::new();
    let mut best: Option<(usize, NodeId)> = None;
    for &x in &k.inline {
        let mut set = BTreeSet::new();
        for op in &nodes[x.index()].inputs {
            if inputs.contains(op) {
                set.insert(*op);
            } else if let Some(s) = reach.get(op) {
                set.extend(s.iter().copied());
            }
        }
        let c = class(&nodes[x.index()].op);
        // Materializing `x` trades the inputs it reaches for itself, in a
        // kernel of its own that must fit too.
        let (cost, own) = (max.cost(&set), max.weight(x));
        let candidate = c == Class::Fusible && !k.outputs.contains(&x) && cost > own && cost + own <= max.max;
        if candidate && best.is_none_or(|(b, _)| cost > b) {
            best = Some((cost, x));
        }
        reach.insert(x, set);
    }
    let _ = inl;
    // No subtree fits: materialize an inlined concat, whose kernel is then
    // split by operand ranges.
    best.map(|(_, x)| x)
        .or_else(|| {
            k.inline
                .iter()
                .copied()
                .filter(|x| !k.outputs.contains(x) && matches!(nodes[x.index()].op, Op::Concat { .. }))
                .max_by_key(|x| nodes[x.index()].inputs.len())
        })
        // An extra output (inline_outputs) goes back to a kernel of its own.
        .or_else(|| k.outputs.get(1).copied())
}

/// The nodes of `order` (topologically sorted) that depend on `dep`'s
/// nodes, added to `dep`, when every one of them is an elementwise op
/// whose shape `shape_ok` accepts, or a node `other_ok` accepts; `None` as
/// soon as one is not. Nodes for which `seed` holds join unchecked (the
/// values others depend on).
fn elementwise_dependents(
    graph: &Graph,
    order: &[NodeId],
    mut dep: BTreeSet<NodeId>,
    seed: impl Fn(NodeId) -> bool,
    shape_ok: impl Fn(&crate::Shape) -> bool,
    other_ok: impl Fn(&crate::Node) -> bool,
) -> Option<BTreeSet<NodeId>> {
    for &x in order {
        let n = graph.node(x);
        if seed(x) {
            dep.insert(x);
        } else if n.inputs.iter().any(|o| dep.contains(o)) {
            if !(n.op.is_elementwise() && shape_ok(&n.shape) || other_ok(n)) {
                return None;
            }
            dep.insert(x);
        }
    }
    Some(dep)
}

/// Whether `x` is a reduction a row kernel of output shape `shape` can
/// absorb: f32, over the last axis only, keepdim, of a value of `shape`.
fn row_reduction(graph: &Graph, x: NodeId, shape: &crate::Shape) -> bool {
    let n = graph.node(x);
    let Op::Reduce { axes, keepdim: true, .. } = &n.op else { return false };
    let rank = shape.rank();
    n.dtype == crate::DType::F32 && rank > 0 && axes[..] == [rank - 1] && graph.node(n.inputs[0]).shape == *shape
}

/// Folds reduction kernels into the elementwise kernel that consumes them
/// row by row (see [`FusionLimits::row_kernels`]). For an elementwise
/// kernel `e` of output shape `S` (last dim at least 2), the kernels
/// producing its inputs join it, transitively, when they are `Reduce`
/// kernels over the last axis of a value of shape `S` (keepdim, f32) or
/// elementwise kernels whose outputs have shape `S` or the row shape (`S`
/// with last dim 1), recomputed per element (as layer norm's centred
/// value, read by both the variance and the output), and none of their
/// outputs is a graph output. What a joined kernel writes that other
/// kernels read stays written, by the row kernel, when all those readers
/// run after `e` (training's centred value and inverse deviation, saved
/// for the backward); otherwise that kernel stays apart, and so, in turn,
/// do the kernels only it needed (a reduction read elsewhere always
/// does). At least one reduction must join, and every node that depends on
/// a joined reduction must be an elementwise op of shape `S` or of the row
/// shape, or an expand of a row-shape value to `S`, so each element only
/// ever needs its own row's reductions. The result is a
/// [`KernelKind::Rows`] kernel at `e`'s place writing `e`'s outputs and
/// the values kept for later readers; the joined kernels' other outputs
/// are never written.
fn merge_row_kernels(graph: &Graph, kernels: Vec<Kernel>, max: &Budget) -> Vec<Kernel> {
    let nodes = graph.nodes();
    let mut ks: Vec<Option<Kernel>> = kernels.into_iter().map(Some).collect();
    // Last consumers first, so one kernel takes the whole chain.
    for e in (0..ks.len()).rev() {
        let Some(ke) = ks[e].clone() else { continue };
        if ke.kind != KernelKind::Elementwise || inlines_reduction(graph, &ke) {
            continue;
        }
        let shape = nodes[ke.root().index()].shape.clone();
        let rank = shape.rank();
        if rank == 0 || shape.dims()[rank - 1] < 2 || !ke.outputs.iter().all(|o| nodes[o.index()].shape == shape) {
            continue;
        }
        let mut row_dims = shape.dims().to_vec();
        row_dims[rank - 1] = 1;
        let row_shape = crate::Shape::new(row_dims);
        let producer =
            |x: NodeId, ks: &[Option<Kernel>]| (0..e).find(|&c| ks[c].as_ref().is_some_and(|k| k.outputs.contains(&x)));
        let mut folded: Vec<usize> = Vec::new();
        let mut frontier: Vec<NodeId> = ke.inputs.clone();
        while let Some(x) = frontier.pop() {
            let Some(c) = producer(x, &ks) else { continue };
            // A kernel with an inlined reduction is never folded.
            let Some(kc) = ks[c].as_ref().filter(|kc| !inlines_reduction(graph, kc)) else { continue };
            let reduce = kc.kind == KernelKind::Reduce && row_reduction(graph, x, &shape);
            let elementwise = matches!(kc.kind, KernelKind::Elementwise | KernelKind::Rows)
                && kc.outputs.iter().all(|o| {
                    let s = &nodes[o.index()].shape;
                    (*s == shape || *s == row_shape) && !graph.outputs.contains(o)
                });
            if folded.contains(&c) || graph.outputs.contains(&x) || !(reduce || elementwise) {
                continue;
            }
            folded.push(c);
            frontier.extend(kc.inputs.iter().copied());
        }
        let kernel = |c: usize, ks: &[Option<Kernel>]| ks[c].clone().expect("folded kernel");
        // What the folded kernels write that other kernels read: kept as
        // an output of the row kernel when every such reader runs after
        // it (the forward's centred value and inverse deviation, saved for
        // the backward), written per element or, for a row-shape value,
        // once per row. A folded kernel read earlier, or a reduction read
        // elsewhere, stays as it is (its outputs become inputs here), and
        // so, in turn, do the kernels only it needed.
        let mut extra: BTreeSet<NodeId>;
        loop {
            let mine = |c: usize, folded: &[usize]| c == e || folded.contains(&c);
            extra = BTreeSet::new();
            let mut apart = None;
            for (i, &c) in folded.iter().enumerate() {
                let kc = kernel(c, &ks);
                for &r in &kc.outputs {
                    let readers: Vec<usize> = (0..ks.len())
                        .filter(|&d| !mine(d, &folded) && ks[d].as_ref().is_some_and(|k| k.inputs.contains(&r)))
                        .collect();
                    if readers.is_empty() {
                        continue;
                    }
                    if kc.kind == KernelKind::Reduce || readers.iter().any(|&d| d < e) {
                        apart = Some(i);
                    } else {
                        extra.insert(r);
                    }
                }
                if apart.is_some() {
                    break;
                }
            }
            match apart {
                Some(i) => {
                    folded.remove(i);
                }
                None => break,
            }
        }
        if !folded.iter().any(|&c| kernel(c, &ks).kind == KernelKind::Reduce) {
            continue;
        }
        let written: BTreeSet<NodeId> = folded.iter().flat_map(|&c| kernel(c, &ks).outputs).collect();
        let mut inputs: BTreeSet<NodeId> = BTreeSet::new();
        let mut inline: BTreeSet<NodeId> = written.clone();
        for k in folded.iter().map(|&c| kernel(c, &ks)).chain([ke.clone()]) {
            inputs.extend(k.inputs.iter().copied().filter(|x| !written.contains(x)));
            inline.extend(k.inline.iter().copied());
        }
        // Row-locality: whatever depends on a joined reduction is an
        // elementwise op of the output or row shape, or the broadcast of a
        // row value along its row (autograd's expand of a keepdim sum).
        let order: Vec<NodeId> = inline.iter().copied().collect();
        let reduction = |x: NodeId| matches!(nodes[x.index()].op, Op::Reduce { .. });
        let row_broadcast = |n: &crate::Node| {
            matches!(n.op, Op::Expand(_)) && n.shape == shape && nodes[n.inputs[0].index()].shape == row_shape
        };
        let local = elementwise_dependents(
            graph,
            &order,
            BTreeSet::new(),
            reduction,
            |s| *s == shape || *s == row_shape,
            row_broadcast,
        );
        let outputs: Vec<NodeId> = ke.outputs.iter().copied().chain(extra).collect();
        if local.is_none() || !max.fits(inputs.iter().chain(&outputs)) {
            continue;
        }
        ks[e] = Some(Kernel {
            kind: KernelKind::Rows,
            outputs,
            inputs: inputs.into_iter().collect(),
            inline: inline.into_iter().collect(),
            segment_lens: Vec::new(),
        });
        for c in folded {
            ks[c] = None;
        }
    }
    ks.into_iter().flatten().collect()
}

/// Splits over-wide concats, merges siblings and collects the plan.
fn finish(
    graph: &Graph,
    groups: Vec<Group>,
    max: Budget,
    limits: &FusionLimits,
    earlier: Option<&Graph>,
) -> FusionPlan {
    let nodes = graph.nodes();
    let mut kernels: Vec<Kernel> = Vec::new();
    for g in groups {
        let k = g.kernel;
        let root = k.root();
        let concat_root = matches!(nodes[root.index()].op, Op::Concat { .. }) && k.kind == KernelKind::Elementwise;
        if !max.fits_kernel(&k) && concat_root {
            kernels.extend(split_concat(graph, &k, &max));
        } else {
            kernels.push(k);
        }
    }
    if limits.merge_siblings {
        kernels = merge_siblings(graph, kernels, &max, earlier);
    }
    if limits.matmul_epilogue {
        kernels = merge_epilogue_kernels(graph, kernels, &max);
    }
    if limits.row_kernels {
        kernels = merge_row_kernels(graph, kernels, &max);
    }
    kernels = merge_attention_parts(graph, kernels, &max);
    if limits.multi_tensor {
        kernels = multi::merge(graph, kernels, &max, earlier, limits.join_inlined_reductions);
    }
    let mut materialized: Vec<NodeId> = kernels.iter().flat_map(|k| k.outputs.iter().copied()).collect();
    materialized.sort();
    materialized.dedup();
    FusionPlan { kernels, materialized }
}

/// Folds an elementwise kernel into the epilogue of the matmul kernel that
/// produces its operand, when that operand (the matmul kernel's only
/// output) is read by no other kernel and is no graph output: the
/// elementwise kernel's outputs become the matmul kernel's outputs and the
/// operand is never written. E.g. `h = x @ w + b` feeding both `relu(h)`
/// and `h > 0`: one kernel writes both. Every node depending on the
/// operand must be a same-shape elementwise op (the epilogue rule), and the
/// elementwise kernel's other inputs must exist before the matmul runs.
fn merge_epilogue_kernels(graph: &Graph, kernels: Vec<Kernel>, max: &Budget) -> Vec<Kernel> {
    let nodes = graph.nodes();
    let mut ks: Vec<Option<Kernel>> = kernels.into_iter().map(Some).collect();
    for a in 0..ks.len() {
        let Some(ka) = ks[a].clone() else { continue };
        if ka.kind != KernelKind::MatMul || ka.outputs.len() != 1 {
            continue;
        }
        let r = ka.root();
        let shape = &nodes[r.index()].shape;
        if graph.outputs.contains(&r) {
            continue;
        }
        let readers: Vec<usize> =
            (0..ks.len()).filter(|&c| ks[c].as_ref().is_some_and(|kc| kc.inputs.contains(&r))).collect();
        let [b] = readers[..] else { continue };
        let Some(kb) = ks[b].clone() else { continue };
        if b <= a
            || kb.kind != KernelKind::Elementwise
            || nodes[kb.root().index()].shape != *shape
            || inlines_reduction(graph, &kb)
        {
            continue;
        }
        // Every input of kb other than r is produced before ka.
        let early = |x: &NodeId| {
            *x == r || !(0..ks.len()).any(|c| c >= a && ks[c].as_ref().is_some_and(|kc| kc.outputs.contains(x)))
        };
        if !kb.inputs.iter().all(early) {
            continue;
        }
        // Nodes of kb depending on r: same-shape elementwise only.
        let dep = elementwise_dependents(graph, &kb.inline, BTreeSet::from([r]), |_| false, |s| s == shape, |_| false);
        if !dep.is_some_and(|dep| kb.outputs.iter().all(|o| dep.contains(o))) {
            continue;
        }
        let mut inputs: BTreeSet<NodeId> = ka.inputs.iter().copied().collect();
        inputs.extend(kb.inputs.iter().copied().filter(|&x| x != r));
        if !max.fits(inputs.iter().chain(&kb.outputs)) {
            continue;
        }
        let mut inline: BTreeSet<NodeId> = ka.inline.iter().copied().collect();
        inline.insert(r);
        inline.extend(kb.inline.iter().copied());
        ks[a] = Some(Kernel {
            kind: KernelKind::MatMul,
            outputs: kb.outputs.clone(),
            inputs: inputs.into_iter().collect(),
            inline: inline.into_iter().collect(),
            segment_lens: Vec::new(),
        });
        ks[b] = None;
    }
    ks.into_iter().flatten().collect()
}

/// The attention parts one kernel computes together: the output with its
/// log-sum-exp (one pass over the keys per query block), and the key with
/// the value gradient (one pass over the queries per key block).
fn attention_partners(a: crate::AttentionPart, b: crate::AttentionPart) -> bool {
    use crate::AttentionPart::*;
    matches!((a, b), (Out, LogSumExp) | (LogSumExp, Out) | (GradK, GradV) | (GradV, GradK))
}

/// Groups attention kernels whose roots are partner parts (see
/// [`attention_partners`]) over the same operands and attributes into the
/// earlier kernel, outputs in part order, when the pair fits `max` (each
/// window of a windowed value a binding). Moving the later part earlier is
/// valid: its operands are the earlier kernel's, so they exist there. Runs
/// before the multi-tensor pass, which never joins attention kernels.
fn merge_attention_parts(graph: &Graph, kernels: Vec<Kernel>, max: &Budget) -> Vec<Kernel> {
    let nodes = graph.nodes();
    let mut ks: Vec<Option<Kernel>> = kernels.into_iter().map(Some).collect();
    let attention = |k: &Kernel| match &nodes[k.root().index()].op {
        Op::Attention { attrs, part } if k.kind == KernelKind::Attention && k.outputs.len() == 1 => {
            Some((*attrs, *part))
        }
        _ => None,
    };
    for a in 0..ks.len() {
        let Some(ka) = ks[a].clone() else { continue };
        let Some((attrs_a, part_a)) = attention(&ka) else { continue };
        for b in a + 1..ks.len() {
            let Some(kb) = ks[b].clone() else { continue };
            let Some((attrs_b, part_b)) = attention(&kb) else { continue };
            let same_operands = nodes[ka.root().index()].inputs == nodes[kb.root().index()].inputs;
            // An empty part has no elements to iterate (its kernel is
            // skipped): it stays on its own.
            let empty = [ka.root(), kb.root()].iter().any(|&x| nodes[x.index()].shape.numel() == 0);
            if attrs_a != attrs_b || !same_operands || empty || !attention_partners(part_a, part_b) {
                continue;
            }
            let mut inputs: BTreeSet<NodeId> = ka.inputs.iter().copied().collect();
            inputs.extend(kb.inputs.iter().copied());
            let mut outputs = vec![ka.root(), kb.root()];
            if part_b < part_a {
                outputs.reverse();
            }
            // Windows counted: a part over operands beyond one binding may
            // fit alone where the pair does not.
            if !max.fits(inputs.iter().chain(&outputs)) {
                continue;
            }
            let mut inline: BTreeSet<NodeId> = ka.inline.iter().copied().collect();
            inline.extend(kb.inline.iter().copied());
            ks[a] = Some(Kernel {
                kind: KernelKind::Attention,
                outputs,
                inputs: inputs.into_iter().collect(),
                inline: inline.into_iter().collect(),
                segment_lens: Vec::new(),
            });
            ks[b] = None;
            break;
        }
    }
    ks.into_iter().flatten().collect()
}

/// The inline closure and inputs of a set of operand subtrees of `k`.
fn sub_kernel(graph: &Graph, k: &Kernel, roots: &[NodeId]) -> (Vec<NodeId>, Vec<NodeId>) {
    let nodes = graph.nodes();
    let inl: BTreeSet<NodeId> = k.inline.iter().copied().collect();
    let mut set = BTreeSet::new();
    let mut ins = BTreeSet::new();
    let mut stack: Vec<NodeId> = Vec::new();
    for &r in roots {
        if inl.contains(&r) {
            if set.insert(r) {
                stack.push(r);
            }
        } else {
            ins.insert(r);
        }
    }
    while let Some(x) = stack.pop() {
        for &op in &nodes[x.index()].inputs {
            if inl.contains(&op) {
                if set.insert(op) {
                    stack.push(op);
                }
            } else {
                ins.insert(op);
            }
        }
    }
    (set.into_iter().collect(), ins.into_iter().collect())
}

fn split_concat(graph: &Graph, k: &Kernel, max: &Budget) -> Vec<Kernel> {
    let root = k.root();
    let operands = &graph.node(root).inputs;
    let mut parts = Vec::new();
    let mut start = 0;
    while start < operands.len() {
        let mut end = start + 1;
        while end < operands.len() {
            let (_, ins) = sub_kernel(graph, k, &operands[start..end + 1]);
            if !max.fits(ins.iter().chain([&root])) {
                break;
            }
            end += 1;
        }
        let (mut inline, inputs) = sub_kernel(graph, k, &operands[start..end]);
        inline.push(root);
        parts.push(Kernel {
            kind: KernelKind::ConcatPart { start, end },
            outputs: vec![root],
            inputs,
            inline,
            segment_lens: Vec::new(),
        });
        start = end;
    }
    parts
}

/// Merges independent elementwise kernels of one shape; with `earlier`
/// (see [`plan_sized_like`]), only those whose shapes were equal there.
fn merge_siblings(graph: &Graph, kernels: Vec<Kernel>, max: &Budget, earlier: Option<&Graph>) -> Vec<Kernel> {
    let mut ks: Vec<Option<Kernel>> = kernels.into_iter().map(Some).collect();
    for a in 0..ks.len() {
        for b in a + 1..ks.len() {
            let (Some(ka), Some(kb)) = (&ks[a], &ks[b]) else { continue };
            if ka.kind != KernelKind::Elementwise || kb.kind != KernelKind::Elementwise {
                continue;
            }
            let same_shape = |g: &Graph| g.node(ka.root()).shape == g.node(kb.root()).shape;
            if !same_shape(graph) || earlier.is_some_and(|e| !same_shape(e)) {
                continue;
            }
            let mut ins: BTreeSet<NodeId> = ka.inputs.iter().copied().collect();
            ins.extend(kb.inputs.iter().copied());
            if !max.fits(ins.iter().chain(&ka.outputs).chain(&kb.outputs)) {
                continue;
            }
            // Moving `a` to position `b` is valid if no kernel in (a, b]
            // reads a's outputs.
            let reads_a =
                (a + 1..=b).any(|c| ks[c].as_ref().is_some_and(|kc| kc.inputs.iter().any(|x| ka.outputs.contains(x))));
            if reads_a {
                continue;
            }
            let mut outputs = ka.outputs.clone();
            outputs.extend(kb.outputs.iter().copied());
            let mut inline: BTreeSet<NodeId> = ka.inline.iter().copied().collect();
            inline.extend(kb.inline.iter().copied());
            let merged = Kernel {
                kind: KernelKind::Elementwise,
                outputs,
                inputs: ins.into_iter().collect(),
                inline: inline.into_iter().collect(),
                segment_lens: Vec::new(),
            };
            ks[a] = None;
            ks[b] = Some(merged);
            break;
        }
    }
    ks.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, DType, ReduceOp, ScalarValue, UnaryOp, ValueType};

    fn bin(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        g.push(Op::Binary(op), &[a, b]).unwrap()
    }

    fn check_limits(g: &Graph, p: &FusionPlan, max: usize) {
        for k in &p.kernels {
            assert!(k.storage_buffers() <= max, "{}", p.to_text());
        }
        for o in &g.outputs {
            if !matches!(g.node(*o).op, Op::Parameter(_)) {
                assert!(p.materialized.contains(o));
            }
        }
    }

    #[test]
    fn w1_is_one_kernel() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([4096, 4096], DType::F32));
        let a = g.scalar(DType::F32);
        let b = g.scalar(DType::F32);
        let c = g.scalar(DType::F32);
        let two = g.scalar(DType::F32);
        let t = bin(&mut g, BinaryOp::Mul, x, a);
        let t = bin(&mut g, BinaryOp::Add, t, b);
        let t = g.push(Op::Unary(UnaryOp::Relu), &[t]).unwrap();
        let t = bin(&mut g, BinaryOp::Sub, t, c);
        let t = g.push(Op::Unary(UnaryOp::Tanh), &[t]).unwrap();
        let y = bin(&mut g, BinaryOp::Mul, t, two);
        g.outputs.push(y);
        let p = plan(&g, &FusionLimits::default());
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        assert_eq!(p.kernels[0].inputs, vec![x]);
        assert_eq!(p.kernels[0].outputs, vec![y]);
    }

    #[test]
    fn twelve_input_sum_splits() {
        let mut g = Graph::new();
        let xs: Vec<NodeId> = (0..12).map(|_| g.param(ValueType::new([4, 4], DType::F32))).collect();
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = bin(&mut g, BinaryOp::Add, acc, x);
        }
        g.outputs.push(acc);
        let p = plan(&g, &FusionLimits::default());
        assert!(p.kernels.len() >= 2, "{}", p.to_text());
        check_limits(&g, &p, 8);
        for lim in 3..8 {
            let p = plan(&g, &FusionLimits { max_storage_buffers: lim, ..FusionLimits::default() });
            check_limits(&g, &p, lim);
        }
    }

    /// Values over `window_elements` count once per window: four inputs of
    /// three windows each, summed, do not fit one kernel of 9 bindings, so
    /// the sum is split into kernels that each fit; with windows off (the
    /// default) the same graph is one kernel.
    #[test]
    fn windowed_values_count_once_per_window() {
        let mut g = Graph::new();
        let xs: Vec<NodeId> = (0..4).map(|_| g.param(ValueType::new([10, 10], DType::F32))).collect();
        let mut acc = xs[0];
        for &x in &xs[1..] {
            acc = bin(&mut g, BinaryOp::Add, acc, x);
        }
        g.outputs.push(acc);
        let unwindowed = FusionLimits { max_storage_buffers: 9, ..FusionLimits::default() };
        assert_eq!(plan(&g, &unwindowed).kernels.len(), 1);
        let limits = FusionLimits { window_elements: 40, ..unwindowed };
        let p = plan(&g, &limits);
        assert!(p.kernels.len() >= 2, "{}", p.to_text());
        let budget = Budget { graph: &g, max: 9, window: 40 };
        for k in &p.kernels {
            assert!(budget.fits_kernel(k), "{}", p.to_text());
        }
    }

    #[test]
    fn wide_concat_splits() {
        let mut g = Graph::new();
        let xs: Vec<NodeId> = (0..12).map(|_| g.param(ValueType::new([2, 3], DType::F32))).collect();
        let c = g.push(Op::Concat { axis: 1 }, &xs).unwrap();
        let r = g.push(Op::Unary(UnaryOp::Exp), &[c]).unwrap();
        g.outputs.push(r);
        let p = plan(&g, &FusionLimits::default());
        check_limits(&g, &p, 8);
        assert!(p.kernels.iter().any(|k| matches!(k.kind, KernelKind::ConcatPart { .. })), "{}", p.to_text());
    }

    /// `nn::layer_norm`'s graph: mean, variance of the centred value, the
    /// normalization with weight and bias.
    fn layer_norm_graph(mean_is_output: bool) -> Graph {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([6, 10], DType::F32));
        let w = g.param(ValueType::new([10], DType::F32));
        let b = g.param(ValueType::new([10], DType::F32));
        let mean =
            |g: &mut Graph, v| g.push(Op::Reduce { op: ReduceOp::Mean, axes: vec![1], keepdim: true }, &[v]).unwrap();
        let mu = mean(&mut g, x);
        let xc = bin(&mut g, BinaryOp::Sub, x, mu);
        let sq = bin(&mut g, BinaryOp::Mul, xc, xc);
        let var = mean(&mut g, sq);
        let r = g.push(Op::Unary(UnaryOp::Rsqrt), &[var]).unwrap();
        let y = bin(&mut g, BinaryOp::Mul, xc, r);
        let y = bin(&mut g, BinaryOp::Mul, y, w);
        let y = bin(&mut g, BinaryOp::Add, y, b);
        g.outputs.push(y);
        if mean_is_output {
            g.outputs.push(mu);
        }
        g
    }

    #[test]
    fn layer_norm_is_one_row_kernel() {
        let g = layer_norm_graph(false);
        let rows = FusionLimits { row_kernels: true, ..FusionLimits::default() };
        let p = plan(&g, &rows);
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        assert_eq!(p.kernels[0].kind, KernelKind::Rows);
        assert_eq!(p.kernels[0].inputs.len(), 3, "x, weight and bias: {}", p.to_text());
        check_limits(&g, &p, 8);
        // Without row kernels: mean, centred value, variance and the
        // normalization.
        assert_eq!(plan(&g, &FusionLimits::default()).kernels.len(), 4);
        // A reduction someone else needs (here a graph output) is written
        // by its own kernel; only the variance folds.
        let g = layer_norm_graph(true);
        let p = plan(&g, &rows);
        assert_eq!(p.kernels.len(), 2, "{}", p.to_text());
        assert_eq!(p.kernels[1].kind, KernelKind::Rows);
        check_limits(&g, &p, 8);
    }

    #[test]
    fn layer_norm_backward_row_sums_broadcast_by_expand_fold_into_one_row_kernel() {
        // The shape of autograd's layer-norm input gradient: two row sums,
        // the second over a value that uses the first through an expand.
        let mut g = Graph::new();
        let x = g.param(ValueType::new([6, 10], DType::F32));
        let dy = g.param(ValueType::new([6, 10], DType::F32));
        let rstd = g.param(ValueType::new([6, 1], DType::F32));
        let sum =
            |g: &mut Graph, v| g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: true }, &[v]).unwrap();
        let expand = |g: &mut Graph, v| g.push(Op::Expand(crate::Shape::new([6, 10])), &[v]).unwrap();
        let dyx = bin(&mut g, BinaryOp::Mul, dy, x);
        let s1 = sum(&mut g, dyx);
        let t = bin(&mut g, BinaryOp::Mul, s1, rstd);
        let te = expand(&mut g, t);
        let a = bin(&mut g, BinaryOp::Mul, dy, rstd);
        let b = bin(&mut g, BinaryOp::Mul, te, x);
        let y = bin(&mut g, BinaryOp::Add, a, b);
        let ny = g.push(Op::Unary(UnaryOp::Neg), &[y]).unwrap();
        let s2 = sum(&mut g, ny);
        let s2e = expand(&mut g, s2);
        let out = bin(&mut g, BinaryOp::Add, y, s2e);
        g.outputs.push(out);
        let rows = FusionLimits { row_kernels: true, ..FusionLimits::default() };
        let p = plan(&g, &rows);
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        assert_eq!(p.kernels[0].kind, KernelKind::Rows);
        check_limits(&g, &p, 8);
        assert_eq!(
            plan(&g, &FusionLimits::default()).kernels.len(),
            4,
            "{}",
            plan(&g, &FusionLimits::default()).to_text()
        );
        // An expand that reaches across rows (a column value broadcast)
        // keeps the reductions apart.
        let mut g2 = g.clone();
        g2.outputs.clear();
        let col = g2.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: true }, &[y]).unwrap();
        let cole = g2.push(Op::Expand(crate::Shape::new([6, 10])), &[col]).unwrap();
        let out2 = bin(&mut g2, BinaryOp::Add, out, cole);
        g2.outputs.push(out2);
        let p2 = plan(&g2, &rows);
        assert!(p2.kernels.len() > 1, "{}", p2.to_text());
        check_limits(&g2, &p2, 8);
        // An operand computed by a kernel others read too (the forward's
        // centred value, which the backward reads in several places)
        // stays that kernel's output; the rest still folds.
        let mut g3 = Graph::new();
        let x0 = g3.param(ValueType::new([6, 10], DType::F32));
        let dy = g3.param(ValueType::new([6, 10], DType::F32));
        let rstd = g3.param(ValueType::new([6, 1], DType::F32));
        let two = g3.push(Op::Constant(ScalarValue::Float(2.0), DType::F32), &[]).unwrap();
        let x = bin(&mut g3, BinaryOp::Mul, x0, two);
        let col = g3.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[x]).unwrap();
        let dyx = bin(&mut g3, BinaryOp::Mul, dy, x);
        let s1 = sum(&mut g3, dyx);
        let t = bin(&mut g3, BinaryOp::Mul, s1, rstd);
        let te = expand(&mut g3, t);
        let c = bin(&mut g3, BinaryOp::Mul, te, x);
        let y = bin(&mut g3, BinaryOp::Add, dy, c);
        g3.outputs.extend([y, col]);
        let p3 = plan(&g3, &rows);
        assert_eq!(p3.kernels.iter().filter(|k| k.kind == KernelKind::Rows).count(), 1, "{}", p3.to_text());
        assert_eq!(p3.kernels.len(), 3, "x, its column sum, the row kernel: {}", p3.to_text());
        check_limits(&g3, &p3, 8);
    }

    #[test]
    fn layer_norm_keeping_values_for_later_kernels_is_one_row_kernel() {
        // Training keeps the centred value and the inverse deviation for
        // the backward: the row kernel writes them besides its output.
        let mut g = Graph::new();
        let x = g.param(ValueType::new([6, 10], DType::F32));
        let w = g.param(ValueType::new([10], DType::F32));
        let mean =
            |g: &mut Graph, v| g.push(Op::Reduce { op: ReduceOp::Mean, axes: vec![1], keepdim: true }, &[v]).unwrap();
        let mu = mean(&mut g, x);
        let xc = bin(&mut g, BinaryOp::Sub, x, mu);
        let sq = bin(&mut g, BinaryOp::Mul, xc, xc);
        let var = mean(&mut g, sq);
        let eps = g.push(Op::Constant(ScalarValue::Float(1e-5), DType::F32), &[]).unwrap();
        let ve = bin(&mut g, BinaryOp::Add, var, eps);
        let rstd = g.push(Op::Unary(UnaryOp::Rsqrt), &[ve]).unwrap();
        let xhat = bin(&mut g, BinaryOp::Mul, xc, rstd);
        let y = bin(&mut g, BinaryOp::Mul, xhat, w);
        let col =
            |g: &mut Graph, v| g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[v]).unwrap();
        let p = bin(&mut g, BinaryOp::Mul, y, xc);
        let s0 = col(&mut g, p);
        let q = bin(&mut g, BinaryOp::Mul, y, rstd);
        let r0 = col(&mut g, q);
        g.outputs.extend([s0, r0]);
        let rows = FusionLimits { row_kernels: true, ..FusionLimits::default() };
        let plan_rows = plan(&g, &rows);
        let row_kernels: Vec<&Kernel> = plan_rows.kernels.iter().filter(|k| k.kind == KernelKind::Rows).collect();
        assert_eq!(row_kernels.len(), 1, "{}", plan_rows.to_text());
        let mut written = row_kernels[0].outputs.clone();
        written.sort();
        assert_eq!(written, [xc, rstd, y], "{}", plan_rows.to_text());
        assert_eq!(plan_rows.kernels.len(), 3, "the row kernel and two column sums: {}", plan_rows.to_text());
        check_limits(&g, &plan_rows, 8);
    }

    #[test]
    fn reduce_of_elementwise_is_one_kernel() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8, 16], DType::F32));
        let e = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let t = g.push(Op::Permute(vec![1, 0]), &[e]).unwrap();
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[t]).unwrap();
        g.outputs.push(s);
        let p = plan(&g, &FusionLimits::default());
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        assert_eq!(p.kernels[0].kind, KernelKind::Reduce);
        assert_eq!(p.kernels[0].inline, vec![e, t]);
    }

    #[test]
    fn matmul_reads_through_transpose() {
        let mut g = Graph::new();
        let a = g.param(ValueType::new([8, 4], DType::F32));
        let b = g.param(ValueType::new([5, 4], DType::F32));
        let bt = g.push(Op::Permute(vec![1, 0]), &[b]).unwrap();
        let m = g.push(Op::MatMul, &[a, bt]).unwrap();
        g.outputs.push(m);
        let p = plan(&g, &FusionLimits::default());
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        assert_eq!(p.kernels[0].inputs, vec![a, b]);
    }

    #[test]
    fn shared_node_is_materialized_and_siblings_merge() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([4, 8], DType::F32));
        let e = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: true }, &[e]).unwrap();
        let y = bin(&mut g, BinaryOp::Div, e, s);
        let one = g.push(Op::Constant(ScalarValue::Float(1.0), DType::F32), &[]).unwrap();
        let z = bin(&mut g, BinaryOp::Add, x, one);
        g.outputs.push(y);
        g.outputs.push(z);
        let p = plan(&g, &FusionLimits::default());
        assert!(p.materialized.contains(&e), "{}", p.to_text());
        check_limits(&g, &p, 8);
        // e and z are independent elementwise roots of the same shape.
        assert_eq!(p.kernels.len(), 3, "{}", p.to_text());
    }

    #[test]
    fn siblings_of_one_shape_only_at_these_sizes_stay_apart_in_a_size_variant() {
        // exp(x) over [t, 8] beside y + 1 over [t, t]: one shape at t = 8.
        let at = |t: usize| {
            let mut g = Graph::new();
            let x = g.param(ValueType::new([t, 8], DType::F32));
            let y = g.param(ValueType::new([t, t], DType::F32));
            let e = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
            let one = g.push(Op::Constant(ScalarValue::Float(1.0), DType::F32), &[]).unwrap();
            let z = bin(&mut g, BinaryOp::Add, y, one);
            g.outputs.extend([e, z]);
            g
        };
        let limits = FusionLimits { multi_tensor: false, ..FusionLimits::default() };
        assert_eq!(plan(&at(8), &limits).kernels.len(), 1, "siblings of one shape merge");
        assert_eq!(plan_sized_like(&at(8), &limits, Some(&at(7))).kernels.len(), 2);
        // Equal at the other sizes too: they merge.
        assert_eq!(plan_sized_like(&at(8), &limits, Some(&at(8))).kernels.len(), 1);
    }

    /// Fused attention's training graph: the output, then in the backward
    /// the log-sum-exp over the same operands, delta, and the three
    /// gradients.
    fn attention_graph() -> (Graph, [NodeId; 5]) {
        use crate::{AttentionAttrs, AttentionMask, AttentionPart};
        let mut g = Graph::new();
        let f = DType::F32;
        let qp = g.param(ValueType::new([2, 8, 9], f));
        let q = g.push(Op::Permute(vec![0, 2, 1]), &[qp]).unwrap();
        let k = g.param(ValueType::new([2, 12, 8], f));
        let v = g.param(ValueType::new([2, 12, 4], f));
        let s = g.scalar(f);
        let m = g.param(ValueType::new([9, 12], f));
        let attrs = AttentionAttrs { causal: true, mask: AttentionMask::Additive };
        let part = |g: &mut Graph, part, ins: &[NodeId]| g.push(Op::Attention { attrs, part }, ins).unwrap();
        let o = part(&mut g, AttentionPart::Out, &[q, k, v, s, m]);
        let go = g.param(ValueType::new([2, 9, 4], f));
        let lse = part(&mut g, AttentionPart::LogSumExp, &[q, k, v, s, m]);
        let prod = bin(&mut g, BinaryOp::Mul, go, o);
        let delta = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![2], keepdim: false }, &[prod]).unwrap();
        let ins = [q, k, v, s, m, go, lse, delta];
        let dq = part(&mut g, AttentionPart::GradQ, &ins);
        let dk = part(&mut g, AttentionPart::GradK, &ins);
        let dv = part(&mut g, AttentionPart::GradV, &ins);
        g.outputs.extend([o, dq, dk, dv]);
        (g, [o, lse, dq, dk, dv])
    }

    #[test]
    fn attention_parts_over_the_same_operands_share_kernels() {
        let (g, [o, lse, dq, dk, dv]) = attention_graph();
        let wide = FusionLimits { max_storage_buffers: 16, ..FusionLimits::default() };
        let p = plan(&g, &wide);
        // Output with its log-sum-exp, delta, dQ, dK with dV; the
        // transposed q, read by all four attention parts, inlined in each.
        assert_eq!(p.kernels.len(), 4, "{}", p.to_text());
        let view = NodeId(1);
        assert!(matches!(g.node(view).op, Op::Permute(_)) && !p.materialized.contains(&view));
        let att: Vec<&Kernel> = p.kernels.iter().filter(|k| k.kind == KernelKind::Attention).collect();
        assert_eq!(att.len(), 3, "{}", p.to_text());
        assert_eq!(att[0].outputs, vec![o, lse]);
        assert_eq!(att[1].outputs, vec![dq]);
        assert_eq!(att[2].outputs, vec![dk, dv]);
        assert!(att.iter().all(|k| k.inline.contains(&view)), "{}", p.to_text());
        // Nothing the size of the scores ([2, 9, 12]) is written.
        assert!(p.materialized.iter().all(|&x| g.node(x).shape.numel() < 2 * 9 * 12), "{}", p.to_text());
        check_limits(&g, &p, 16);
        // Too few buffers for a merged kernel: each part on its own.
        let p = plan(&g, &FusionLimits { max_storage_buffers: 8, ..FusionLimits::default() });
        assert_eq!(p.kernels.iter().filter(|k| k.kind == KernelKind::Attention).count(), 4, "{}", p.to_text());
        let p = plan(&g, &FusionLimits { max_storage_buffers: 9, ..FusionLimits::default() });
        assert_eq!(p.kernels.iter().filter(|k| k.kind == KernelKind::Attention).count(), 3, "{}", p.to_text());
        // Deterministic.
        assert_eq!(p, plan(&g, &FusionLimits { max_storage_buffers: 9, ..FusionLimits::default() }));
        assert_eq!(plan(&g, &wide), plan(&g, &wide));
    }

    #[test]
    fn attention_parts_merge_within_the_window_budget() {
        let (mut g, [o, lse, dq, dk, dv]) = attention_graph();
        // An independent elementwise output beside them: multi-tensor
        // kernels join elementwise kernels only, never attention parts.
        let v = NodeId(4);
        let twice = bin(&mut g, BinaryOp::Add, v, v);
        g.outputs.push(twice);
        // Windows of 100 elements: q (through its view), k and the mask
        // take 2 bindings each, dK 2; the key/value pair would bind 13.
        let limits = FusionLimits {
            max_storage_buffers: 12,
            multi_tensor: true,
            window_elements: 100,
            ..FusionLimits::default()
        };
        let p = plan(&g, &limits);
        let budget = Budget { graph: &g, max: 12, window: 100 };
        assert!(p.kernels.iter().all(|k| budget.fits_kernel(k)), "{}", p.to_text());
        let att: Vec<&Kernel> = p.kernels.iter().filter(|k| k.kind == KernelKind::Attention).collect();
        let outputs: Vec<Vec<NodeId>> = att.iter().map(|k| k.outputs.clone()).collect();
        assert_eq!(outputs, [vec![o, lse], vec![dq], vec![dk], vec![dv]], "{}", p.to_text());
        let attention_node = |x: &NodeId| matches!(g.node(*x).op, Op::Attention { .. });
        for k in p.kernels.iter().filter(|k| k.kind != KernelKind::Attention) {
            assert!(!k.outputs.iter().any(attention_node), "{}", p.to_text());
        }
        // Unwindowed, the same limit holds the pair: one kernel for dK and dV.
        let p = plan(&g, &FusionLimits { window_elements: u64::MAX, ..limits });
        let att: Vec<Vec<NodeId>> =
            p.kernels.iter().filter(|k| k.kind == KernelKind::Attention).map(|k| k.outputs.clone()).collect();
        assert_eq!(att, [vec![o, lse], vec![dq], vec![dk, dv]], "{}", p.to_text());
    }

    #[test]
    fn matmul_epilogue_and_inline_outputs_are_opt_in() {
        let mut g = Graph::new();
        let a = g.param(ValueType::new([8, 4], DType::F32));
        let w = g.param(ValueType::new([4, 6], DType::F32));
        let bias = g.param(ValueType::new([6], DType::F32));
        let m = g.push(Op::MatMul, &[a, w]).unwrap();
        let be = g.push(Op::Expand(vec![8, 6].into()), &[bias]).unwrap();
        let y = bin(&mut g, BinaryOp::Add, m, be);
        let y = g.push(Op::Unary(UnaryOp::Relu), &[y]).unwrap();
        g.outputs.push(y);
        // A graph output consumed by one same-shape elementwise kernel.
        let p = g.param(ValueType::new([6, 8], DType::F32));
        let t = g.push(Op::Permute(vec![1, 0]), &[p]).unwrap();
        let u = bin(&mut g, BinaryOp::Sub, t, t);
        g.outputs.push(t);
        g.outputs.push(u);
        let off = plan(&g, &FusionLimits::default());
        assert_eq!(off.kernels.len(), 3, "{}", off.to_text());
        assert!(off.kernels.iter().all(|k| k.kind != KernelKind::MatMul || k.root() == m));
        let on = FusionLimits { matmul_epilogue: true, inline_outputs: true, ..FusionLimits::default() };
        let p2 = plan(&g, &on);
        assert_eq!(p2.kernels.len(), 2, "{}", p2.to_text());
        let k0 = &p2.kernels[0];
        assert_eq!(k0.kind, KernelKind::MatMul);
        assert_eq!(k0.outputs, vec![y]);
        assert_eq!(k0.matmul_node(&g), Some(m));
        assert!(k0.inline.contains(&m) && k0.inline.contains(&be));
        assert_eq!(p2.kernels[1].outputs, vec![u, t]);
        check_limits(&g, &p2, 8);
        // Deterministic.
        assert_eq!(p2, plan(&g, &on));
    }

    /// A column sum over 64 rows read by an SGD update (twice, through the
    /// momentum) joins the update's kernel as an inlined reduction; a loss's
    /// sum over 10 classes joins the mean over the batch that reads it.
    /// Off (the default limit 0), each is a kernel of its own.
    #[test]
    fn small_reductions_join_their_consumers() {
        let mut g = Graph::new();
        let grad = g.param(ValueType::new([64, 256], DType::F32));
        let m = g.param(ValueType::new([256], DType::F32));
        let db = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[grad]).unwrap();
        let m2 = bin(&mut g, BinaryOp::Add, m, db);
        let both = bin(&mut g, BinaryOp::Add, db, m2);
        g.outputs.extend([both, m2]);
        let logp = g.param(ValueType::new([64, 10], DType::F32));
        let rows = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[logp]).unwrap();
        let neg = g.push(Op::Unary(UnaryOp::Neg), &[rows]).unwrap();
        let loss = g.push(Op::Reduce { op: ReduceOp::Mean, axes: vec![0], keepdim: false }, &[neg]).unwrap();
        g.outputs.push(loss);
        let base = FusionLimits { inline_outputs: true, ..FusionLimits::default() };
        let off = plan(&g, &base);
        assert_eq!(off.kernels.iter().filter(|k| k.kind == KernelKind::Reduce).count(), 3, "{}", off.to_text());
        let on = plan(&g, &FusionLimits { inline_reductions: 64, ..base });
        let update = on.kernels.iter().find(|k| k.outputs.contains(&both)).expect("the update");
        assert_eq!(update.kind, KernelKind::Elementwise, "{}", on.to_text());
        assert!(update.inline.contains(&db) && update.inputs == vec![grad, m], "{}", on.to_text());
        let mean = on.kernels.iter().find(|k| k.outputs == vec![loss]).expect("the loss");
        assert!(mean.inline.contains(&rows) && mean.inputs == vec![logp], "{}", on.to_text());
        assert_eq!(on.kernels.len(), 2, "{}", on.to_text());
        assert!(on.kernels.iter().all(|k| inlines_reduction(&g, k)));
        // One element short of the limit's reach: the 64-row sum stays.
        let short = plan(&g, &FusionLimits { inline_reductions: 63, ..base });
        assert!(short.kernels.iter().any(|k| k.outputs == vec![db]), "{}", short.to_text());
    }

    /// A kernel with an inlined reduction joins a multi-tensor kernel only
    /// with `join_inlined_reductions` (GPUs); without it (llvmpipe) it
    /// stays beside the multi-tensor kernel of the others.
    #[test]
    fn inlined_reductions_join_multi_tensor_kernels_only_when_asked() {
        let mut g = Graph::new();
        let grad = g.param(ValueType::new([64, 256], DType::F32));
        let b = g.param(ValueType::new([256], DType::F32));
        let w = g.param(ValueType::new([10, 256], DType::F32));
        let db = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[grad]).unwrap();
        let b2 = bin(&mut g, BinaryOp::Sub, b, db);
        let w2 = g.push(Op::Unary(UnaryOp::Neg), &[w]).unwrap();
        g.outputs.extend([b2, w2]);
        let limits = FusionLimits { multi_tensor: true, inline_reductions: 64, ..FusionLimits::default() };
        let apart = plan(&g, &limits);
        assert_eq!(apart.kernels.len(), 2, "{}", apart.to_text());
        assert!(apart.kernels.iter().all(|k| k.kind == KernelKind::Elementwise), "{}", apart.to_text());
        let joined = plan(&g, &FusionLimits { join_inlined_reductions: true, ..limits });
        assert_eq!(joined.kernels.len(), 1, "{}", joined.to_text());
        assert_eq!(joined.kernels[0].kind, KernelKind::MultiTensor, "{}", joined.to_text());
        assert!(joined.kernels[0].inline.contains(&db), "{}", joined.to_text());
    }

    /// Layer norm's variance (a keepdim mean over the last axis, read by
    /// `rsqrt` per row, which training keeps for the backward) is left to
    /// the row kernel where row kernels are on: one kernel reads each row
    /// once for the mean, the variance and the output. Without row
    /// kernels it is inlined into the kernel writing the `rsqrt`.
    #[test]
    fn row_reductions_are_left_to_row_kernels() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([16, 64], DType::F32));
        let mean = g.push(Op::Reduce { op: ReduceOp::Mean, axes: vec![1], keepdim: true }, &[x]).unwrap();
        let c = bin(&mut g, BinaryOp::Sub, x, mean);
        let sq = bin(&mut g, BinaryOp::Mul, c, c);
        let var = g.push(Op::Reduce { op: ReduceOp::Mean, axes: vec![1], keepdim: true }, &[sq]).unwrap();
        let inv = g.push(Op::Unary(UnaryOp::Rsqrt), &[var]).unwrap();
        let y = bin(&mut g, BinaryOp::Mul, c, inv);
        // The backward's reader of the inverse deviation.
        let saved = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[inv]).unwrap();
        g.outputs.extend([y, saved]);
        let base = FusionLimits { inline_reductions: 64, ..FusionLimits::default() };
        let rows = plan(&g, &FusionLimits { row_kernels: true, ..base });
        let row = rows.kernels.iter().find(|k| k.kind == KernelKind::Rows).expect("a row kernel");
        assert!(row.inline.contains(&var) && row.outputs.contains(&inv), "{}", rows.to_text());
        let flat = plan(&g, &base);
        let writer = flat.kernels.iter().find(|k| k.outputs.contains(&inv)).expect("the rsqrt's kernel");
        assert!(writer.kind == KernelKind::Elementwise && writer.inline.contains(&var), "{}", flat.to_text());
    }

    /// A reduction whose value is broadcast (each element read by a row of
    /// the consumer), read by two kernels, or itself an output keeps a
    /// kernel of its own: inlined, it would be computed per use.
    #[test]
    fn reductions_read_more_than_once_per_element_stay_kernels() {
        let limits = FusionLimits { inline_reductions: 1 << 20, ..FusionLimits::default() };
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8, 16], DType::F32));
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: true }, &[x]).unwrap();
        let centred = bin(&mut g, BinaryOp::Sub, x, s);
        g.outputs.push(centred);
        let p = plan(&g, &limits);
        assert!(p.kernels.iter().any(|k| k.outputs == vec![s]), "{}", p.to_text());
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8, 16], DType::F32));
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[x]).unwrap();
        let a = g.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap();
        let b = g.push(Op::Reduce { op: ReduceOp::Max, axes: vec![0], keepdim: false }, &[s]).unwrap();
        g.outputs.extend([a, b]);
        let p = plan(&g, &limits);
        assert!(p.kernels.iter().any(|k| k.outputs == vec![s]), "two readers: {}", p.to_text());
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8, 16], DType::F32));
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[x]).unwrap();
        let a = g.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap();
        g.outputs.extend([a, s]);
        let p = plan(&g, &limits);
        assert!(p.kernels.iter().any(|k| k.outputs == vec![s]), "an output: {}", p.to_text());
    }
}
