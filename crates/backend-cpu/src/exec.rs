//! The executor of compiled graphs: [`CpuExecutable`] holds a `Program`,
//! an ordered list of steps built once per graph, and [`run`] executes it.
//!
//! Compilation takes the fusion plan of `lazuli_ir::fusion`: each
//! elementwise kernel of the plan becomes one `FusedLoop` when all its
//! nodes fuse; every other kernel runs its prologue (as fused loops where
//! possible) and then its root through the node interpreter
//! (`eval_node`). Nodes that cannot fuse are interpreted one by one; an
//! elementwise node alone is still a one-instruction fused loop, so fused
//! and unfused evaluation use the same kernels.
//!
//! Each value lives in an `Arc`'d [`CpuStorage`] until the last step that
//! reads it, then it is dropped; `Reshape` shares its operand's storage.
//! Outputs are returned as [`Buffer`]s sharing the same storage (no copy).
//! Every value is allocated from the backend's `Memory`, so a step whose
//! output does not fit fails with `BackendError::OutOfMemory`; the values
//! made so far are dropped with the run.

use crate::fused::FusedLoop;
use crate::memory::Memory;
use crate::storage::{CpuData, CpuStorage};
use crate::{attention, cache, conv, matmul, movement, quant, reduce, source};
use lazuli_executor::{BackendError, BackendKind, Buffer, DeviceStorage, Executable};
use lazuli_ir::fusion::{self, FusionLimits, KernelKind};
use lazuli_ir::{Graph, NodeId, Op, ScalarValue, VerifiedGraph};
use std::any::Any;
use std::sync::Arc;

/// A compiled graph for the CPU backend: the verified graph and the
/// program of steps that evaluates it.
///
/// `kernel_count` is the number of steps (fused loops and interpreted
/// nodes); `kernel_sources` is empty.
pub struct CpuExecutable {
    graph: VerifiedGraph,
    program: Program,
    memory: Arc<Memory>,
}

impl std::fmt::Debug for CpuExecutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutable").field("steps", &self.program.steps.len()).finish()
    }
}

impl CpuExecutable {
    /// Compiles a verified graph into a program (with its own memory, of
    /// the default budget).
    pub fn new(graph: VerifiedGraph) -> CpuExecutable {
        CpuExecutable::with_memory(graph, Arc::default())
    }

    /// Compiles a verified graph whose values are allocated from `memory`.
    pub(crate) fn with_memory(graph: VerifiedGraph, memory: Arc<Memory>) -> CpuExecutable {
        let program = Program::compile(&graph, &memory);
        CpuExecutable { graph, program, memory }
    }

    /// The graph this executable runs.
    pub fn graph(&self) -> &VerifiedGraph {
        &self.graph
    }

    /// Runs the program on `inputs` (one per parameter) and `scalars`.
    pub fn run(&self, inputs: Vec<Buffer>, scalars: &[ScalarValue]) -> Result<Vec<Buffer>, BackendError> {
        self.program.run(&self.graph, inputs, scalars, &self.memory)
    }

    /// How many steps are fused loops (for tests).
    pub fn fused_loops(&self) -> usize {
        self.program.steps.iter().filter(|s| matches!(s.kind, StepKind::Fused(_))).count()
    }
}

impl Executable for CpuExecutable {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn kernel_count(&self) -> usize {
        self.program.steps.len()
    }

    fn kernel_sources(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// The steps that evaluate a graph, in order.
struct Program {
    steps: Vec<Step>,
    /// Per node: how many steps read it (plus one for graph outputs).
    uses: Vec<usize>,
}

struct Step {
    kind: StepKind,
    /// Nodes read, deduplicated (released after their last reading step).
    reads: Vec<NodeId>,
}

enum StepKind {
    /// Interpret one node.
    Node(NodeId),
    /// A fused elementwise loop.
    Fused(Box<FusedLoop>),
    /// Attention parts over the same operands, computed together.
    Attention(Vec<NodeId>),
}

impl Program {
    fn compile(graph: &Graph, mem: &Memory) -> Program {
        let limits = FusionLimits { max_storage_buffers: 1 << 16, ..FusionLimits::default() };
        let plan = fusion::plan(graph, &limits);
        let mut b = ProgramBuilder { graph, mem, steps: Vec::new(), done: vec![false; graph.len()] };
        for k in &plan.kernels {
            match k.kind {
                KernelKind::Elementwise | KernelKind::MultiTensor => {
                    // A multi-tensor kernel (not planned by default) is its
                    // segments, each an elementwise kernel.
                    for k in k.segments(graph) {
                        if let Some(lp) = FusedLoop::compile(graph, &k.inline, &k.outputs, mem) {
                            b.fused(lp);
                        } else {
                            for &x in &k.inline {
                                b.node(x);
                            }
                        }
                    }
                }
                KernelKind::ConcatPart { end, .. } => {
                    let root = k.root();
                    for &x in k.inline.iter().filter(|&&x| x != root) {
                        b.node(x);
                    }
                    if end == graph.node(root).inputs.len() {
                        b.node(root);
                    }
                }
                KernelKind::Attention => {
                    // A kernel of parts over operands an earlier one shared.
                    if k.outputs.iter().all(|o| b.done[o.index()]) {
                        continue;
                    }
                    let root = k.root();
                    b.prologue(root, &k.inline);
                    // Every later attention kernel over the same operands
                    // (the query gradient beside the key and value ones)
                    // joins this step: one pass computes them all.
                    let mut outs = k.outputs.clone();
                    let same = |x: NodeId| {
                        let (n, r) = (graph.node(x), graph.node(root));
                        match (&n.op, &r.op) {
                            (Op::Attention { attrs: a, .. }, Op::Attention { attrs: c, .. }) => {
                                a == c && n.inputs == r.inputs
                            }
                            _ => false,
                        }
                    };
                    for later in plan.kernels.iter().filter(|l| l.kind == KernelKind::Attention) {
                        if later.root() != root && same(later.root()) {
                            for &o in &later.outputs {
                                if !outs.contains(&o) {
                                    outs.push(o);
                                }
                            }
                        }
                    }
                    b.attention(outs);
                }
                // Every other kind is its root node interpreted after its
                // prologue (`eval_node` matches every op): a new kind is
                // correct here, just not specialized.
                _ => {
                    let root = k.root();
                    b.prologue(root, &k.inline);
                    b.node(root);
                }
            }
        }
        let mut uses = vec![0usize; graph.len()];
        for s in &b.steps {
            for r in &s.reads {
                uses[r.index()] += 1;
            }
        }
        for o in &graph.outputs {
            uses[o.index()] += 1;
        }
        Program { steps: b.steps, uses }
    }

    fn run(
        &self,
        graph: &Graph,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
        mem: &Arc<Memory>,
    ) -> Result<Vec<Buffer>, BackendError> {
        check_inputs(graph, &inputs, scalars)?;
        let mut uses = self.uses.clone();
        let mut vals: Vec<Option<Arc<dyn DeviceStorage>>> = vec![None; graph.len()];
        // Moved, not cloned: a donated input stays uniquely held, so a
        // write into it (`Op::WriteAt`) can happen in place.
        let mut inputs: Vec<Option<Arc<dyn DeviceStorage>>> = inputs.into_iter().map(|b| Some(b.storage)).collect();
        for (id, node) in graph.nodes().iter().enumerate() {
            if let Op::Parameter(i) = node.op {
                vals[id] = inputs[i as usize].take();
            }
        }
        for step in &self.steps {
            match &step.kind {
                StepKind::Node(id) if matches!(graph.node(*id).op, Op::WriteAt { .. }) => {
                    let v = write_at(graph, *id, &mut vals, &uses, mem)?;
                    vals[id.index()] = Some(v);
                }
                StepKind::Node(id) => {
                    let v = eval_node(graph, *id, &vals, scalars, mem)?;
                    vals[id.index()] = Some(v);
                }
                StepKind::Attention(outputs) => {
                    let node = graph.node(outputs[0]);
                    let arg = |k: usize| data(vals[node.inputs[k].index()].as_ref().expect("operands precede users"));
                    let outs = attention::attention(mem, graph, outputs, &arg)?;
                    for (o, d) in outputs.iter().zip(outs) {
                        vals[o.index()] = Some(Arc::new(mem.track(d)));
                    }
                }
                StepKind::Fused(lp) => {
                    let outs = lp.run(&vals, scalars, mem)?;
                    for (o, d) in lp.writes().into_iter().zip(outs) {
                        vals[o.index()] = Some(Arc::new(mem.track(d)));
                    }
                }
            }
            for r in &step.reads {
                let u = &mut uses[r.index()];
                *u -= 1;
                if *u == 0 {
                    vals[r.index()] = None;
                }
            }
        }
        Ok(graph
            .outputs
            .iter()
            .map(|o| Buffer {
                storage: vals[o.index()].clone().expect("outputs are never released"),
                ty: graph.node(*o).ty(),
                kind: BackendKind::Cpu,
            })
            .collect())
    }
}

struct ProgramBuilder<'g> {
    graph: &'g Graph,
    mem: &'g Memory,
    steps: Vec<Step>,
    /// Nodes already computed by an earlier step (or parameters).
    done: Vec<bool>,
}

impl ProgramBuilder<'_> {
    fn fused(&mut self, lp: FusedLoop) {
        for w in lp.writes() {
            self.done[w.index()] = true;
        }
        let reads = lp.reads();
        self.steps.push(Step { kind: StepKind::Fused(Box::new(lp)), reads });
    }

    /// The prologue of a kernel rooted at `root`: each inlined operand of
    /// the root as a loop (or interpreted).
    fn prologue(&mut self, root: NodeId, inline: &[NodeId]) {
        for &o in &self.graph.node(root).inputs {
            if self.done[o.index()] || !inline.contains(&o) {
                continue;
            }
            match FusedLoop::compile(self.graph, inline, &[o], self.mem) {
                Some(lp) => self.fused(lp),
                None => self.closure(o, inline),
            }
        }
    }

    /// Computes attention parts over the same operands in one step.
    fn attention(&mut self, outputs: Vec<NodeId>) {
        let mut reads = self.graph.node(outputs[0]).inputs.clone();
        reads.sort();
        reads.dedup();
        for o in &outputs {
            self.done[o.index()] = true;
        }
        self.steps.push(Step { kind: StepKind::Attention(outputs), reads });
    }

    /// Interprets one node (elementwise nodes as one-node loops).
    fn node(&mut self, id: NodeId) {
        let node = self.graph.node(id);
        if self.done[id.index()] || matches!(node.op, Op::Parameter(_)) {
            return;
        }
        if matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_)) {
            let lp =
                FusedLoop::compile(self.graph, &[id], &[id], self.mem).expect("a lone elementwise node always fuses");
            return self.fused(lp);
        }
        let mut reads = node.inputs.clone();
        reads.sort();
        reads.dedup();
        self.done[id.index()] = true;
        self.steps.push(Step { kind: StepKind::Node(id), reads });
    }

    /// Interprets the nodes of `members` that `root` needs, in order.
    fn closure(&mut self, root: NodeId, members: &[NodeId]) {
        let mut need = vec![false; self.graph.len()];
        need[root.index()] = true;
        for &x in members.iter().rev() {
            if need[x.index()] {
                for i in &self.graph.node(x).inputs {
                    need[i.index()] = true;
                }
            }
        }
        for &x in members {
            if need[x.index()] {
                self.node(x);
            }
        }
    }
}

/// Runs `graph` on `inputs` (one per parameter) and `scalars` (one per
/// scalar slot), returning one buffer per output. Compiles the graph first;
/// [`CpuExecutable::run`] reuses a compiled program.
pub fn run(graph: &Graph, inputs: Vec<Buffer>, scalars: &[ScalarValue]) -> Result<Vec<Buffer>, BackendError> {
    let mem = Arc::default();
    Program::compile(graph, &mem).run(graph, inputs, scalars, &mem)
}

/// `Op::WriteAt` node `id`: into its base's own storage when this step
/// reads the base last and nobody else holds it (a donated cache: counted
/// `CpuWriteAtInPlace`), else into a copy (`CpuWriteAtCopied`).
fn write_at(
    graph: &Graph,
    id: NodeId,
    vals: &mut [Option<Arc<dyn DeviceStorage>>],
    uses: &[usize],
    mem: &Arc<Memory>,
) -> Result<Arc<dyn DeviceStorage>, BackendError> {
    let node = graph.node(id);
    let Op::WriteAt { axis } = node.op else { unreachable!("a write_at step") };
    let [b, u, p] = [node.inputs[0], node.inputs[1], node.inputs[2]];
    let pos = cache::positions(data(vals[p.index()].as_ref().expect("operands precede users")));
    let dims = |x: NodeId| graph.node(x).shape.dims();
    let last_read = uses[b.index()] == 1 && b != u && b != p;
    let mut base =
        if last_read { vals[b.index()].take() } else { vals[b.index()].clone() }.expect("operands precede users");
    let update = vals[u.index()].as_ref().expect("operands precede users");
    let in_place = Arc::get_mut(&mut base).and_then(|s| s.as_any_mut()).and_then(|a| a.downcast_mut::<CpuStorage>());
    if let Some(storage) = in_place {
        cache::write_at(&mut storage.data, dims(b), data(update), dims(u), &pos, axis)?;
        lazuli_executor::metrics::inc("CpuWriteAtInPlace", 1);
        return Ok(base);
    }
    let mut copy = mem.take(node.dtype, node.shape.numel())?;
    each_pair_copy(&mut copy, data(&base));
    cache::write_at(&mut copy, dims(b), data(update), dims(u), &pos, axis)?;
    lazuli_executor::metrics::inc("CpuWriteAtCopied", 1);
    Ok(Arc::new(mem.track(copy)))
}

/// Copies `src` into `dst` (same dtype and length).
fn each_pair_copy(dst: &mut CpuData, src: &CpuData) {
    let to: &mut [u8] = crate::storage::each_all!(dst, v => bytemuck::cast_slice_mut(v.as_mut_slice()));
    let from: &[u8] = crate::storage::each_all!(src, v => bytemuck::cast_slice(v.as_slice()));
    to.copy_from_slice(from);
}

pub(crate) fn data(s: &Arc<dyn DeviceStorage>) -> &CpuData {
    &s.as_any().downcast_ref::<CpuStorage>().expect("checked when inputs are bound").data
}

fn check_inputs(graph: &Graph, inputs: &[Buffer], scalars: &[ScalarValue]) -> Result<(), BackendError> {
    if inputs.len() != graph.params.len() {
        return Err(BackendError::Execution(format!("expected {} inputs, got {}", graph.params.len(), inputs.len())));
    }
    for (i, (buf, ty)) in inputs.iter().zip(&graph.params).enumerate() {
        let d =
            buf.storage.as_any().downcast_ref::<CpuStorage>().ok_or_else(|| {
                BackendError::Execution(format!("input {i} is a {} buffer, not a cpu buffer", buf.kind))
            })?;
        if buf.ty != *ty || d.data.dtype() != ty.dtype || d.data.len() != ty.shape.numel() {
            return Err(BackendError::Execution(format!(
                "input {i} is {}{} but the graph expects {}{}",
                d.data.dtype(),
                buf.ty.shape,
                ty.dtype,
                ty.shape
            )));
        }
    }
    if scalars.len() < graph.scalars.len() {
        return Err(BackendError::Execution(format!(
            "expected {} scalars, got {}",
            graph.scalars.len(),
            scalars.len()
        )));
    }
    Ok(())
}

/// Evaluates one non-elementwise node from its operands' values.
fn eval_node(
    graph: &Graph,
    id: NodeId,
    vals: &[Option<Arc<dyn DeviceStorage>>],
    scalars: &[ScalarValue],
    mem: &Arc<Memory>,
) -> Result<Arc<dyn DeviceStorage>, BackendError> {
    let node = graph.node(id);
    let arg = |k: usize| data(vals[node.inputs[k].index()].as_ref().expect("operands precede users"));
    let shape = |k: usize| graph.node(node.inputs[k]).shape.dims();
    let dims = node.shape.dims();
    let out: CpuData = match &node.op {
        Op::Reshape(_) => return Ok(vals[node.inputs[0].index()].clone().expect("operands precede users")),
        Op::Constant(v, dt) => source::scalar(mem, *v, *dt)?,
        Op::ScalarParam(i) => source::scalar(mem, scalars[*i as usize], node.dtype)?,
        Op::Iota { shape, axis, dtype } => source::iota(mem, shape.dims(), *axis, *dtype)?,
        Op::Random { dist, .. } => {
            let word = |k: usize| match arg(k) {
                CpuData::U32(v) => v[0],
                _ => unreachable!("random keys are u32 in a verified graph"),
            };
            source::random(mem, node.shape.numel(), *dist, word(0), word(1))?
        }
        Op::Reduce { op, axes, .. } => reduce::reduce(mem, *op, arg(0), shape(0), axes)?,
        Op::ArgReduce { op, axis, select_last, .. } => {
            reduce::arg_reduce(mem, *op, arg(0), shape(0), *axis, *select_last)?
        }
        Op::CumSum { axis, exclusive, reverse } => reduce::cumsum(mem, arg(0), shape(0), *axis, *exclusive, *reverse)?,
        Op::Softmax { axis, log } => reduce::softmax(mem, arg(0), shape(0), *axis, *log)?,
        Op::MatMul => matmul::matmul(mem, arg(0), shape(0), arg(1), shape(1), dims)?,
        Op::Permute(perm) => movement::permute(mem, arg(0), shape(0), perm)?,
        Op::Expand(_) => movement::expand(mem, arg(0), shape(0), dims)?,
        Op::Slice { starts, steps, lens } => movement::slice(mem, arg(0), shape(0), starts, steps, lens)?,
        Op::Concat { axis } => {
            let parts: Vec<&CpuData> = (0..node.inputs.len()).map(arg).collect();
            let shapes: Vec<&[usize]> = (0..node.inputs.len()).map(shape).collect();
            movement::concat(mem, &parts, &shapes, *axis)?
        }
        Op::Pad { before, after, mode } => {
            let value = (node.inputs.len() > 1).then(|| arg(1));
            movement::pad(mem, arg(0), shape(0), before, after, *mode, value)?
        }
        Op::Gather { axis } => movement::gather(mem, arg(0), shape(0), *axis, arg(1))?,
        Op::Conv2d(c) => conv::conv2d(mem, arg(0), shape(0), arg(1), shape(1), dims, c)?,
        Op::Pool(p) => conv::pool(mem, arg(0), shape(0), dims, p)?,
        Op::ScatterAdd { axis } => movement::scatter_add(mem, arg(0), shape(0), *axis, arg(1), arg(2))?,
        Op::PoolGrad(p) => conv::pool_grad(mem, arg(0), shape(0), arg(1), shape(1), p)?,
        Op::Attention { .. } => {
            let mut out = attention::attention(mem, graph, &[id], &|k| arg(k))?;
            out.pop().expect("one part asked, one computed")
        }
        // `CpuBackend::compile` refuses collectives; never an identity.
        Op::AllReduce { .. } => {
            return Err(BackendError::Unsupported { backend: "cpu".into(), op: node.op.name(), dtype: node.dtype })
        }
        Op::Dequantize(format) => quant::dequantize(mem, *format, arg(0), shape(0))?,
        Op::QuantMatMul(format) => quant::matmul(mem, *format, arg(0), shape(0), arg(1), shape(1))?,
        Op::PrefixAttention => {
            let pos = cache::positions(arg(4));
            cache::prefix_attention(mem, arg(0), shape(0), arg(1), shape(1), arg(2), shape(2), arg(3), &pos)?
        }
        // Run by `write_at` (in place where it may be).
        Op::WriteAt { .. } => unreachable!("write_at is run by its own step"),
        Op::Parameter(_) | Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) => {
            unreachable!("{} is bound or fused, never interpreted", node.op.name())
        }
    };
    debug_assert_eq!(out.dtype(), node.dtype, "{}", node.op.name());
    debug_assert_eq!(out.len(), node.shape.numel(), "{}", node.op.name());
    Ok(Arc::new(mem.track(out)))
}
