//! Compiled plans: a traced graph optimized, partitioned into backend
//! segments (native and CPU fallback), and compiled. [`Plan::run`] executes
//! the segments in order, moving data across at segment boundaries only.

use crate::platform::Instant;
use crate::{metrics, Backend, BackendError, BackendKind, Buffer, CompileHints, Executable};
use lazuli_ir::{Graph, NodeId, Op, ScalarValue};
use std::collections::{BTreeSet, HashMap};
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
    pub shadow: crate::validate::ShadowCache,
}

/// A compiled, cacheable plan for one graph shape.
pub(crate) struct Plan {
    /// The traced graph (the cache key's source; compared on a hit).
    pub graph: Graph,
    /// Its structural hash: the compile-cache key.
    pub hash: u64,
    pub optimized: Graph,
    pub segments: Vec<Segment>,
    /// One entry per output of `graph`.
    pub outputs: Vec<ValueRef>,
    /// The `Fallback::<op>` counter of each node that runs on the CPU
    /// fallback (named once here, not on every execution).
    pub fallback_ops: Vec<String>,
    /// Elements computed by one execution: the element counts of the
    /// optimized graph's op nodes, summed (saturating). A cost estimate.
    pub work: u64,
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
    /// segment of its structure, see [`CompileHints`]).
    pub fn compile(
        graph: Graph,
        main: &dyn Backend,
        cpu: &dyn Backend,
        force_fallback: &BTreeSet<String>,
        earlier: Option<&Plan>,
    ) -> Result<Plan, BackendError> {
        let optimized = crate::optimize::optimize(&graph);
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
        // Segment index: the smallest index of the right parity after every
        // operand's segment (strictly after when the colour differs).
        let mut seg = vec![usize::MAX; n];
        let outputs_set: BTreeSet<NodeId> = optimized.outputs.iter().copied().collect();
        for (i, node) in optimized.nodes().iter().enumerate() {
            // Leaves are copied into whichever segment reads them, except a
            // constant or scalar that is itself a graph output: some segment
            // must produce it.
            let produced_leaf = outputs_set.contains(&NodeId(i as u32)) && !matches!(node.op, Op::Parameter(_));
            if is_leaf(&node.op) && !produced_leaf {
                continue;
            }
            let parity = on_cpu[i] as usize;
            let mut k = parity;
            for x in &node.inputs {
                let s = seg[x.index()];
                if s == usize::MAX {
                    continue;
                }
                let min = if on_cpu[x.index()] == on_cpu[i] { s } else { s + 1 };
                k = k.max(min);
            }
            if k % 2 != parity {
                k += 1;
            }
            seg[i] = k;
        }
        let users = optimized.users();
        let max_seg = seg.iter().copied().filter(|&s| s != usize::MAX).max();
        let mut segments = Vec::new();
        if let Some(max_seg) = max_seg {
            for k in 0..=max_seg {
                let members: Vec<usize> = (0..n).filter(|&i| seg[i] == k).collect();
                if members.is_empty() {
                    continue;
                }
                let (sg, inputs, outs, origin) = build_segment(&optimized, &members, &seg, k, &users, &outputs_set);
                let backend = if k % 2 == 1 { cpu } else { main };
                let verified = sg.clone().verify().map_err(|e| BackendError::Compile {
                    kernel: format!("segment {k}"),
                    message: format!("segment graph failed verification (a bug): {e}"),
                })?;
                let structure = sg.shape_free_hash();
                let on_cpu = k % 2 == 1;
                let hints = CompileHints {
                    sizes_vary: earlier.is_some(),
                    earlier: earlier.and_then(|p| {
                        p.segments
                            .iter()
                            .find(|s| s.on_cpu == on_cpu && s.structure == structure)
                            .map(|s| s.exe.as_ref())
                    }),
                };
                let exe = backend.compile_with(&verified, hints)?;
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
        Ok(Plan { hash: graph.structural_hash(), graph, optimized, segments, outputs, fallback_ops, work })
    }

    /// Runs the plan (on the worker thread) and returns one buffer per output.
    pub fn run(
        &self,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<Vec<Buffer>, BackendError> {
        let mut values: HashMap<NodeId, Buffer> = HashMap::new();
        for counter in &self.fallback_ops {
            metrics::inc(counter, 1);
        }
        if !self.fallback_ops.is_empty() {
            metrics::inc("FallbackOps", self.fallback_ops.len() as u64);
        }
        for s in &self.segments {
            let backend = if s.on_cpu { cpu } else { main };
            let args = s.arguments(&inputs, &values, backend, main, cpu)?;
            let started = Instant::now();
            let outs = backend.execute(s.exe.as_ref(), args, scalars)?;
            metrics::record_time(if s.on_cpu { "ExecuteFallback" } else { "ExecuteSegment" }, started.elapsed());
            for (id, buf) in s.outputs.iter().zip(outs) {
                values.insert(*id, buf);
            }
        }
        Ok(self.collect_outputs(&inputs, &values))
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
    /// This segment's arguments, moved to `backend` where another owns them.
    pub fn arguments(
        &self,
        inputs: &[Buffer],
        values: &HashMap<NodeId, Buffer>,
        backend: &dyn Backend,
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<Vec<Buffer>, BackendError> {
        self.inputs
            .iter()
            .map(|r| {
                let buf = match r {
                    ValueRef::Param(p) => inputs[*p].clone(),
                    ValueRef::Node(id) => values.get(id).expect("earlier segment produced the value").clone(),
                };
                transfer(buf, backend, main, cpu)
            })
            .collect()
    }
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
