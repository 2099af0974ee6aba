//! Compiled plans: a traced graph optimized, partitioned into backend
//! segments (native and CPU fallback) and collective segments, and
//! compiled. [`Plan::run`] executes the steps in order, moving data across
//! at segment boundaries only.
//!
//! Collectives ([`Op::AllReduce`]) cut the plan into phases so that their
//! communication overlaps the work that does not need it: phase `j` holds
//! the not yet placed ancestors of the collective with the fewest of them
//! (the gradients backward produces first), then that collective, which
//! [`Plan::run`] starts and leaves running; the remaining nodes follow,
//! grouped by the latest collective they depend on, so a segment waits
//! for one all-reduce while later ones are still in flight. Within a
//! phase the native/fallback partition is the usual one. The phases are a
//! function of the graph alone, so every rank (same graph) starts the same
//! collectives in the same order, and a cached plan keeps its order.

use crate::platform::Instant;
use crate::PendingCollective;
use crate::{
    metrics, Backend, BackendError, BackendKind, Buffer, Collective, CollectiveError, CompileHints, Executable,
};
use lazuli_ir::{CollectiveOp, DType, Graph, NodeId, Op, ScalarValue, ValueType};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Where a value comes from when a segment or the plan reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ValueRef {
    /// Graph parameter `i`.
    Param(usize),
    /// A node of the optimized graph computed by an earlier segment.
    Node(NodeId),
}

/// A run of nodes compiled for one backend.
pub(crate) struct Segment {
    /// True if this segment runs on the CPU fallback.
    pub on_cpu: bool,
    pub exe: Arc<dyn Executable>,
    pub inputs: Vec<ValueRef>,
    /// Nodes of the optimized graph this segment produces, in its output order.
    pub outputs: Vec<NodeId>,
    /// The segment's own graph (for dumps).
    pub graph: Graph,
    /// The shape-free hash of `graph`: a size variant's segment finds the
    /// earlier segment of its structure by it.
    pub structure: u64,
    /// For each node of `graph`, the node of the optimized graph it copies
    /// (shadow validation maps kernels back to source locations with it).
    pub origin: Vec<NodeId>,
    /// Executables shadow validation compiles for this segment on first use.
    pub shadow: crate::runtime::shadow::ShadowCache,
}

/// A collective node of the optimized graph, run by the executor.
pub(crate) struct CollectiveSegment {
    /// The [`Op::AllReduce`] node.
    pub node: NodeId,
    /// Its operand.
    pub input: ValueRef,
    /// Sum or mean.
    pub op: CollectiveOp,
    /// Its bucket tag.
    pub bucket: u32,
    /// Its type (f32).
    pub ty: ValueType,
}

/// One step of a plan's execution, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Run `segments[i]`.
    Segment(usize),
    /// Start `collectives[i]`.
    Collective(usize),
}

/// A compiled, cacheable plan for one graph shape.
pub(crate) struct Plan {
    /// The traced graph (the cache key's source; compared on a hit).
    pub graph: Graph,
    /// Its structural hash: the compile-cache key.
    pub hash: u64,
    pub optimized: Graph,
    /// Per node of `graph`, the node of `optimized` it became
    /// (`lazuli_ir::passes::GONE` if none): a later size variant's passes
    /// keep apart what stayed apart here (`passes::optimize_traced`).
    pub became: Vec<u32>,
    pub segments: Vec<Segment>,
    /// The collectives, in the order they start.
    pub collectives: Vec<CollectiveSegment>,
    /// Segments and collectives in execution order.
    pub steps: Vec<Step>,
    /// One entry per output of `graph`.
    pub outputs: Vec<ValueRef>,
    /// The `Fallback::<op>` counter of each node that runs on the CPU
    /// fallback (named once here, not on every execution).
    pub fallback_ops: Vec<String>,
    /// Elements computed by one execution: the element counts of the
    /// optimized graph's op nodes, summed (saturating). A cost estimate.
    pub work: u64,
    /// How it relates to the other sizes of its structure (set by whoever
    /// compiled it, see [`crate::runtime::compile_ahead`]).
    pub lineage: Lineage,
}

/// How a plan relates to the other sizes of its structure: what the
/// compile-ahead (`crate::runtime::compile_ahead`) predicts the next sizes from and counts
/// its hits with. Held by the plan, set by whoever compiled it.
#[derive(Debug, Default)]
pub(crate) struct Lineage {
    /// The step of the free sizes from the structure's previous plan to
    /// this one, where the two graphs differ in nothing else.
    pub step: Option<Vec<i64>>,
    /// Compiled ahead and not used by a sync yet.
    pub unused_ahead: AtomicBool,
}

impl Plan {
    /// Kernel launches of one execution.
    pub fn kernel_count(&self) -> usize {
        self.segments.iter().map(|s| s.exe.kernel_count()).sum()
    }

    /// Generated kernel sources of every segment, as (name, source).
    pub fn kernel_sources(&self) -> Vec<(String, String)> {
        self.segments.iter().flat_map(|s| s.exe.kernel_sources()).collect()
    }

    /// Optimizes, partitions and compiles `graph`; `earlier` is the last
    /// plan of the same structure at other sizes, if any (a size variant:
    /// each segment's backend is handed the earlier executable of the
    /// segment of its structure, see [`CompileHints`]; and the passes
    /// keep the structure the same at every size: `PassOptions::sizes_vary`,
    /// and CSE merging only what merged in `earlier`).
    pub fn compile(
        graph: Graph,
        main: &dyn Backend,
        cpu: &dyn Backend,
        force_fallback: &BTreeSet<String>,
        earlier: Option<&Plan>,
    ) -> Result<Plan, BackendError> {
        let optimizing = Instant::now();
        let (optimized, became) =
            crate::runtime::optimize::optimize(&graph, earlier.map(|e| (&e.graph, e.became.as_slice())));
        metrics::record_time("CompileOptimize", optimizing.elapsed());
        let n = optimized.len();
        let is_leaf = |op: &Op| matches!(op, Op::Parameter(_) | Op::Constant(..) | Op::ScalarParam(_));
        // Colour each node: native (even segments) or CPU fallback (odd).
        let mut on_cpu = vec![false; n];
        let mut fallback_ops = Vec::new();
        if main.kind() != BackendKind::Cpu {
            for (i, node) in optimized.nodes().iter().enumerate() {
                if is_leaf(&node.op) {
                    continue;
                }
                let inputs: Vec<_> = node.inputs.iter().map(|x| optimized.node(*x)).collect();
                let name = node.op.name();
                if force_fallback.contains(&name) || !main.supports(node, &inputs) {
                    on_cpu[i] = true;
                    fallback_ops.push(format!("Fallback::{name}"));
                }
            }
        }
        let colour: Vec<usize> = (0..n)
            .map(|i| if optimized.nodes()[i].op.is_collective() { COLLECTIVE } else { on_cpu[i] as usize })
            .collect();
        let phase = phases(&optimized, &is_leaf);
        // Segment index within a phase: the smallest index of the node's
        // colour (modulo 3) after every operand's segment of the same phase
        // (strictly after when the colour differs).
        let outputs_set: BTreeSet<NodeId> = optimized.outputs.iter().copied().collect();
        let users = optimized.users();
        let mut local = vec![usize::MAX; n];
        for (i, node) in optimized.nodes().iter().enumerate() {
            // Leaves are copied into whichever segment reads them, except a
            // constant or scalar that is itself a graph output or a
            // collective's operand: some segment must produce it.
            let produced_leaf = !matches!(node.op, Op::Parameter(_))
                && (outputs_set.contains(&NodeId(i as u32))
                    || users[i].iter().any(|u| optimized.node(*u).op.is_collective()));
            if is_leaf(&node.op) && !produced_leaf {
                continue;
            }
            let c = colour[i];
            let mut k = c;
            for x in &node.inputs {
                let s = local[x.index()];
                if s == usize::MAX || phase[x.index()] != phase[i] {
                    continue;
                }
                let min = if colour[x.index()] == c { s } else { s + 1 };
                k = k.max(min);
            }
            k += (c + 3 - k % 3) % 3;
            local[i] = k;
        }
        // Global segment numbers: (phase, local index) in order.
        let keys: BTreeSet<((usize, usize), usize)> =
            (0..n).filter(|&i| local[i] != usize::MAX).map(|i| (phase[i], local[i])).collect();
        let number: HashMap<((usize, usize), usize), usize> =
            keys.iter().enumerate().map(|(k, key)| (*key, k)).collect();
        let seg: Vec<usize> =
            (0..n).map(|i| if local[i] == usize::MAX { usize::MAX } else { number[&(phase[i], local[i])] }).collect();
        let mut segments = Vec::new();
        let mut collectives = Vec::new();
        let mut steps = Vec::new();
        for (k, &(_, local_k)) in keys.iter().enumerate() {
            let members: Vec<usize> = (0..n).filter(|&i| seg[i] == k).collect();
            if local_k % 3 == COLLECTIVE {
                for &i in &members {
                    let node = &optimized.nodes()[i];
                    let Op::AllReduce { op, bucket } = node.op else {
                        unreachable!("only collectives have this colour")
                    };
                    let x = node.inputs[0];
                    let input = match optimized.node(x).op {
                        Op::Parameter(p) => ValueRef::Param(p as usize),
                        _ => ValueRef::Node(x),
                    };
                    steps.push(Step::Collective(collectives.len()));
                    collectives.push(CollectiveSegment { node: NodeId(i as u32), input, op, bucket, ty: node.ty() });
                }
                continue;
            }
            let (sg, inputs, outs, origin) = build_segment(&optimized, &members, &seg, k, &users, &outputs_set);
            let on_cpu = local_k % 3 == 1;
            let backend = if on_cpu { cpu } else { main };
            let verified = sg.clone().verify().map_err(|e| BackendError::Compile {
                kernel: format!("segment {k}"),
                message: format!("segment graph failed verification (a bug): {e}"),
            })?;
            let structure = sg.shape_free_hash();
            let hints = CompileHints {
                sizes_vary: earlier.is_some(),
                earlier: earlier.and_then(|p| {
                    p.segments.iter().find(|s| s.on_cpu == on_cpu && s.structure == structure).map(|s| s.exe.as_ref())
                }),
            };
            let exe = backend.compile_with(&verified, hints)?;
            steps.push(Step::Segment(segments.len()));
            segments.push(Segment {
                on_cpu,
                exe,
                inputs,
                outputs: outs,
                graph: sg,
                structure,
                origin,
                shadow: Default::default(),
            });
        }
        let outputs = optimized
            .outputs
            .iter()
            .map(|o| match optimized.node(*o).op {
                Op::Parameter(p) => ValueRef::Param(p as usize),
                _ => ValueRef::Node(*o),
            })
            .collect();
        let work = optimized
            .nodes()
            .iter()
            .filter(|n| !is_leaf(&n.op))
            .fold(0u64, |w, n| w.saturating_add(n.shape.numel() as u64));
        Ok(Plan {
            hash: graph.structural_hash(),
            graph,
            optimized,
            became,
            segments,
            collectives,
            steps,
            outputs,
            fallback_ops,
            work,
            lineage: Default::default(),
        })
    }

    /// Runs the plan (on the worker thread) and returns one buffer per
    /// output. Collectives start through `collective` and are waited for
    /// where a later segment (or the plan's output) reads them. After a
    /// failure the remaining collectives still start, with zeros and the
    /// failure flag, so that peers never wait for this rank; the first
    /// failure is returned.
    pub fn run(
        &self,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
        main: &dyn Backend,
        cpu: &dyn Backend,
        collective: Option<&dyn Collective>,
    ) -> Result<Vec<Buffer>, BackendError> {
        let mut values: HashMap<NodeId, Buffer> = HashMap::new();
        for counter in &self.fallback_ops {
            metrics::inc(counter, 1);
        }
        if !self.fallback_ops.is_empty() {
            metrics::inc("FallbackOps", self.fallback_ops.len() as u64);
        }
        let mut pending: HashMap<NodeId, (usize, Box<dyn PendingCollective>)> = HashMap::new();
        let mut failure: Option<BackendError> = None;
        // Each input leaves the plan's hands with its last reader, so a
        // segment that reads a donated buffer last holds it uniquely and
        // may write into it (a KV cache updated in place).
        let mut reads = vec![0usize; inputs.len()];
        let refs = self.segments.iter().flat_map(|s| s.inputs.iter());
        for r in refs.chain(self.collectives.iter().map(|c| &c.input)).chain(&self.outputs) {
            if let ValueRef::Param(p) = r {
                reads[*p] += 1;
            }
        }
        let mut inputs: Vec<Option<Buffer>> = inputs.into_iter().map(Some).collect();
        for step in &self.steps {
            match *step {
                Step::Segment(i) => {
                    if failure.is_some() {
                        continue;
                    }
                    let s = &self.segments[i];
                    let backend = if s.on_cpu { cpu } else { main };
                    let ran = self.finish_collectives(&s.inputs, &mut pending, &mut values, main).and_then(|()| {
                        let args = s.arguments_from(&mut inputs, &mut reads, &values, backend, main, cpu)?;
                        let started = Instant::now();
                        let outs = backend.execute(s.exe.as_ref(), args, scalars)?;
                        metrics::record_time(
                            if s.on_cpu { "ExecuteFallback" } else { "ExecuteSegment" },
                            started.elapsed(),
                        );
                        Ok(outs)
                    });
                    match ran {
                        Ok(outs) => values.extend(s.outputs.iter().copied().zip(outs)),
                        Err(e) => failure = Some(e),
                    }
                }
                Step::Collective(i) => {
                    let c = &self.collectives[i];
                    let error = |source: CollectiveError| BackendError::Collective {
                        op: Op::AllReduce { op: c.op, bucket: c.bucket }.name(),
                        bucket: c.bucket,
                        source,
                    };
                    let Some(collective) = collective else {
                        failure.get_or_insert_with(|| error(CollectiveError::new(NO_COLLECTIVE)));
                        continue;
                    };
                    if failure.is_none() {
                        if let Err(e) = self.finish_collectives(&[c.input], &mut pending, &mut values, main) {
                            failure = Some(e);
                        }
                    }
                    let data = match &failure {
                        None => read_f32(c, &inputs, &values, main, cpu),
                        Some(_) => Err(None),
                    };
                    let (data, failed) = match data {
                        Ok(v) => (v, false),
                        Err(e) => {
                            if let Some(e) = e {
                                failure = Some(e);
                            }
                            let mut zeros = Vec::new();
                            if zeros.try_reserve_exact(c.ty.shape.numel()).is_err() {
                                // No room even for the zeros: the peers
                                // learn of it through their timeout.
                                continue;
                            }
                            zeros.resize(c.ty.shape.numel(), 0.0);
                            (zeros, true)
                        }
                    };
                    metrics::inc("CollectivesStarted", 1);
                    match collective.start_all_reduce(c.bucket, c.op, data, failed) {
                        Ok(h) => {
                            pending.insert(c.node, (i, h));
                        }
                        Err(e) => {
                            failure.get_or_insert(error(e));
                        }
                    }
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let outs: Vec<ValueRef> = self.outputs.clone();
        self.finish_collectives(&outs, &mut pending, &mut values, main)?;
        Ok(self
            .outputs
            .iter()
            .map(|r| match r {
                ValueRef::Param(p) => inputs[*p].clone().expect("an output's input is never handed over"),
                ValueRef::Node(id) => values[id].clone(),
            })
            .collect())
    }

    /// Waits for the collectives among `refs` that are still in flight and
    /// uploads their results to `main`.
    fn finish_collectives(
        &self,
        refs: &[ValueRef],
        pending: &mut HashMap<NodeId, (usize, Box<dyn PendingCollective>)>,
        values: &mut HashMap<NodeId, Buffer>,
        main: &dyn Backend,
    ) -> Result<(), BackendError> {
        for r in refs {
            let ValueRef::Node(id) = r else { continue };
            let Some((i, handle)) = pending.remove(id) else { continue };
            let c = &self.collectives[i];
            let started = Instant::now();
            let result = handle.wait();
            metrics::record_time("CollectiveWait", started.elapsed());
            let data = result.map_err(|source| BackendError::Collective {
                op: Op::AllReduce { op: c.op, bucket: c.bucket }.name(),
                bucket: c.bucket,
                source,
            })?;
            if data.len() != c.ty.shape.numel() {
                return Err(BackendError::Collective {
                    op: Op::AllReduce { op: c.op, bucket: c.bucket }.name(),
                    bucket: c.bucket,
                    source: CollectiveError::new(format!(
                        "the collective returned {} values for a tensor of {}",
                        data.len(),
                        c.ty.shape.numel()
                    )),
                });
            }
            let mut bytes = Vec::new();
            bytes.try_reserve_exact(4 * data.len()).map_err(|_| BackendError::OutOfMemory {
                bytes: 4 * data.len() as u64,
                in_use: 0,
                device: "host (all-reduce staging)".into(),
            })?;
            bytes.extend(data.iter().flat_map(|v| v.to_le_bytes()));
            values.insert(*id, main.upload(&bytes, &c.ty)?);
        }
        Ok(())
    }

    /// Starts every collective of the plan with zeros and the failure flag
    /// (the plan could not run: a failed input, an injected fault), so
    /// that the peers learn of the failure instead of waiting.
    pub fn join_failed(&self, collective: Option<&dyn Collective>) {
        let Some(collective) = collective else { return };
        for c in &self.collectives {
            let mut zeros = Vec::new();
            if zeros.try_reserve_exact(c.ty.shape.numel()).is_err() {
                return;
            }
            zeros.resize(c.ty.shape.numel(), 0.0);
            // The handle is dropped: this rank reports its own failure.
            let _ = collective.start_all_reduce(c.bucket, c.op, zeros, true);
        }
    }

    /// True if the plan runs collectives.
    pub fn has_collectives(&self) -> bool {
        !self.collectives.is_empty()
    }

    /// The plan's outputs, from its inputs and the segments' results.
    pub fn collect_outputs(&self, inputs: &[Buffer], values: &HashMap<NodeId, Buffer>) -> Vec<Buffer> {
        self.outputs
            .iter()
            .map(|r| match r {
                ValueRef::Param(p) => inputs[*p].clone(),
                ValueRef::Node(id) => values[id].clone(),
            })
            .collect()
    }
}

impl Segment {
    /// [`Segment::arguments`] for [`Plan::run`]: an input this segment
    /// reads last (`reads` counts the readers still to come) is moved out
    /// of `inputs`, not cloned.
    fn arguments_from(
        &self,
        inputs: &mut [Option<Buffer>],
        reads: &mut [usize],
        values: &HashMap<NodeId, Buffer>,
        backend: &dyn Backend,
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<Vec<Buffer>, BackendError> {
        self.inputs
            .iter()
            .map(|r| {
                let buf = match r {
                    ValueRef::Param(p) => {
                        reads[*p] -= 1;
                        let held = if reads[*p] == 0 { inputs[*p].take() } else { inputs[*p].clone() };
                        held.expect("an input is handed over only to its last reader")
                    }
                    ValueRef::Node(id) => values.get(id).expect("earlier segment produced the value").clone(),
                };
                transfer(buf, backend, main, cpu)
            })
            .collect()
    }

    /// This segment's arguments, moved to `backend` where another owns them.
    pub fn arguments(
        &self,
        inputs: &[Buffer],
        values: &HashMap<NodeId, Buffer>,
        backend: &dyn Backend,
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<Vec<Buffer>, BackendError> {
        // Every input stays held: readers are never counted down to zero.
        let mut held: Vec<Option<Buffer>> = inputs.iter().cloned().map(Some).collect();
        let mut reads = vec![usize::MAX; inputs.len()];
        self.arguments_from(&mut held, &mut reads, values, backend, main, cpu)
    }
}

/// The message of a collective run on a device without a [`Collective`].
pub(crate) const NO_COLLECTIVE: &str =
    "the step has a collective but no Collective is registered on the device (Device::set_collective; \
     lazuli-distributed's DataParallel registers one)";

/// The colour of collective nodes (native is 0, CPU fallback 1).
const COLLECTIVE: usize = 2;

/// The phase of each node (see the module doc): `(j, 0)` for the nodes
/// that collective `j` (in start order) needs and that no earlier one
/// needs, and `(m, d + 1)` for the rest, `d` the latest collective they
/// depend on (`-1`: none, so `0`). Leaves get `(0, 0)`; they are copied
/// where they are read.
fn phases(g: &Graph, is_leaf: &dyn Fn(&Op) -> bool) -> Vec<(usize, usize)> {
    let n = g.len();
    let collectives: Vec<usize> = (0..n).filter(|&i| g.nodes()[i].op.is_collective()).collect();
    let m = collectives.len();
    let mut phase = vec![(usize::MAX, 0); n];
    if m == 0 {
        return vec![(0, 0); n];
    }
    let mut left: Vec<usize> = collectives.clone();
    let mut order = Vec::with_capacity(m);
    // The unplaced ancestors of `c` (itself included), as a mark per node.
    let ancestors = |c: usize, phase: &[(usize, usize)]| -> Vec<usize> {
        let mut seen = vec![false; n];
        let mut stack = vec![c];
        let mut out = Vec::new();
        while let Some(i) = stack.pop() {
            if seen[i] || phase[i].0 != usize::MAX || is_leaf(&g.nodes()[i].op) {
                continue;
            }
            seen[i] = true;
            out.push(i);
            stack.extend(g.nodes()[i].inputs.iter().map(|x| x.index()));
        }
        out
    };
    for j in 0..m {
        let (pick, nodes) = left
            .iter()
            .enumerate()
            .map(|(k, &c)| (k, ancestors(c, &phase)))
            .min_by_key(|(k, a)| (a.len(), left[*k]))
            .expect("a collective is left");
        order.push(left.remove(pick));
        for i in nodes {
            phase[i] = (j, 0);
        }
    }
    // The rest, by the latest collective each depends on.
    let mut latest = vec![0usize; n];
    for (j, &c) in order.iter().enumerate() {
        latest[c] = j + 1;
    }
    for i in 0..n {
        let node = &g.nodes()[i];
        if !node.op.is_collective() {
            latest[i] = node.inputs.iter().map(|x| latest[x.index()]).max().unwrap_or(0);
        }
        if phase[i].0 == usize::MAX {
            phase[i] = if is_leaf(&node.op) { (0, 0) } else { (m, latest[i]) };
        }
    }
    phase
}

/// The f32 values of collective `c`'s operand, read to the host; `Err(Some)`
/// when reading failed.
fn read_f32(
    c: &CollectiveSegment,
    inputs: &[Option<Buffer>],
    values: &HashMap<NodeId, Buffer>,
    main: &dyn Backend,
    cpu: &dyn Backend,
) -> Result<Vec<f32>, Option<BackendError>> {
    let buf = match c.input {
        ValueRef::Param(p) => inputs[p].as_ref().expect("a collective's input is never handed over before it"),
        ValueRef::Node(id) => values.get(&id).expect("an earlier segment produced the operand"),
    };
    debug_assert_eq!(buf.ty.dtype, DType::F32, "the IR admits f32 collectives only");
    let from = if buf.kind == cpu.kind() { cpu } else { main };
    let started = Instant::now();
    let bytes = from.download(buf).map_err(Some)?;
    metrics::record_time("CollectiveStaging", started.elapsed());
    let mut out = Vec::new();
    out.try_reserve_exact(bytes.len() / 4).map_err(|_| {
        Some(BackendError::OutOfMemory {
            bytes: bytes.len() as u64,
            in_use: 0,
            device: "host (all-reduce staging)".into(),
        })
    })?;
    out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    Ok(out)
}

/// Moves a buffer to `to` through host memory if another backend owns it.
pub(crate) fn transfer(
    buf: Buffer,
    to: &dyn Backend,
    main: &dyn Backend,
    cpu: &dyn Backend,
) -> Result<Buffer, BackendError> {
    if buf.kind == to.kind() {
        return Ok(buf);
    }
    let from = if buf.kind == cpu.kind() { cpu } else { main };
    let bytes = from.download(&buf)?;
    metrics::inc("FallbackTransfers", 1);
    metrics::record_value("FallbackTransferBytes", bytes.len() as f64);
    to.upload(&bytes, &buf.ty)
}

/// Builds the graph of one segment: its member nodes, leaves copied in,
/// values from elsewhere as parameters.
fn build_segment(
    g: &Graph,
    members: &[usize],
    seg: &[usize],
    k: usize,
    users: &[Vec<NodeId>],
    outputs: &BTreeSet<NodeId>,
) -> (Graph, Vec<ValueRef>, Vec<NodeId>, Vec<NodeId>) {
    let mut sg = Graph::new();
    sg.scalars = g.scalars.clone();
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    let mut inputs: Vec<ValueRef> = Vec::new();
    let mut input_ids: HashMap<ValueRef, NodeId> = HashMap::new();
    for &i in members {
        let node = &g.nodes()[i];
        let mut args = Vec::with_capacity(node.inputs.len());
        for x in &node.inputs {
            if let Some(m) = map.get(x) {
                args.push(*m);
                continue;
            }
            let xn = g.node(*x);
            let id = match &xn.op {
                Op::Constant(..) | Op::ScalarParam(_) if seg[x.index()] == usize::MAX => {
                    sg.push_typed(xn.op.clone(), vec![], xn.ty())
                }
                _ => {
                    let r = match xn.op {
                        Op::Parameter(p) => ValueRef::Param(p as usize),
                        _ => ValueRef::Node(*x),
                    };
                    *input_ids.entry(r).or_insert_with(|| {
                        inputs.push(r);
                        sg.param(xn.ty())
                    })
                }
            };
            map.insert(*x, id);
            args.push(id);
        }
        let id = sg.push_typed(node.op.clone(), args, node.ty());
        map.insert(NodeId(i as u32), id);
    }
    let mut outs = Vec::new();
    for &i in members {
        let id = NodeId(i as u32);
        let used_later = users[i].iter().any(|u| seg[u.index()] != k);
        if used_later || outputs.contains(&id) {
            outs.push(id);
            sg.outputs.push(map[&id]);
        }
    }
    let mut origin = vec![NodeId(0); sg.len()];
    for (from, to) in &map {
        origin[to.index()] = *from;
    }
    (sg, inputs, outs, origin)
}
