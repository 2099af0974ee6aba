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
//!
//! A matmul kernel whose operands are views (transposes, slices,
//! broadcasts) of materialized nodes is one `MatMul` step that reads them
//! through their strides, never a copy loop and a product.
//!
//! Each step has a name (`k3_fused_mul_add_tanh`, `k7_matmul`) and a cost
//! (FLOPs and bytes, [`crate::profile`]) from compilation; while the
//! backend profiles or the timeline records, each step's wall time, CPU
//! time and threads are taken too.

use crate::fused::FusedLoop;
use crate::layout::View;
use crate::memory::Memory;
use crate::profile::{self, Profiler};
use crate::storage::{data, CpuData, CpuStorage};
use crate::{attention, cache, conv, matmul, movement, quant, reduce, source, threads};
use lazuli_executor::platform::Instant;
use lazuli_executor::{
    timeline, BackendError, BackendKind, Buffer, DeviceStorage, Executable, LaunchCost, LaunchSample,
};
use lazuli_ir::fusion::{self, FusionLimits, KernelKind};
use lazuli_ir::{DType, Graph, NodeId, Op, ScalarValue, VerifiedGraph};
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
        self.program.run(&self.graph, inputs, scalars, &self.memory, None)
    }

    /// [`CpuExecutable::run`], each step timed into `profiler` while it
    /// collects.
    pub(crate) fn run_profiled(
        &self,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
        profiler: &Profiler,
    ) -> Result<Vec<Buffer>, BackendError> {
        self.program.run(&self.graph, inputs, scalars, &self.memory, Some(profiler))
    }

    /// Whether an execution has enough work to run on the worker pool
    /// ([`threads::PARALLEL_WORK`]); smaller ones run serially on the
    /// calling thread.
    pub(crate) fn parallel(&self) -> bool {
        self.program.work >= threads::PARALLEL_WORK
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

    fn launch_costs(&self) -> Vec<LaunchCost> {
        self.program.steps.iter().map(|s| s.cost.clone()).collect()
    }
}

/// The steps that evaluate a graph, in order.
struct Program {
    steps: Vec<Step>,
    /// Per node: how many steps read it (plus one for graph outputs).
    uses: Vec<usize>,
    /// FLOPs plus bytes of all steps (the threading policy's measure).
    work: u64,
}

struct Step {
    kind: StepKind,
    /// Nodes read, deduplicated (released after their last reading step).
    reads: Vec<NodeId>,
    /// Its name in profiles and its FLOPs and bytes.
    cost: LaunchCost,
}

enum StepKind {
    /// Interpret one node.
    Node(NodeId),
    /// A fused elementwise loop.
    Fused(Box<FusedLoop>),
    /// Attention parts over the same operands, computed together.
    Attention(Vec<NodeId>),
    /// A product (f32 or f64) reading each operand in place through a
    /// view of a materialized node (a transpose, slice or broadcast of it
    /// is never copied).
    MatMul { node: NodeId, a: (NodeId, View), b: (NodeId, View) },
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
                    // A product whose operands it can read in place.
                    if k.kind == KernelKind::MatMul && b.strided_matmul(k.root(), &k.inline) {
                        continue;
                    }
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
        let work = b.steps.iter().map(|s| s.cost.flops + s.cost.bytes).sum();
        Program { steps: b.steps, uses, work }
    }

    fn run(
        &self,
        graph: &Graph,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
        mem: &Arc<Memory>,
        profiler: Option<&Profiler>,
    ) -> Result<Vec<Buffer>, BackendError> {
        let profiling = profiler.is_some_and(Profiler::on);
        let timed = profiling || timeline::enabled();
        let mut samples = Vec::new();
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
            let start = timed.then(|| {
                threads::take_used();
                (Instant::now(), profile::thread_cpu_time())
            });
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
                StepKind::MatMul { node, a, b } => {
                    let arg =
                        |(src, _): &(NodeId, View)| data(vals[src.index()].as_ref().expect("operands precede users"));
                    let out = matmul::matmul_views(mem, arg(a), &a.1, arg(b), &b.1, graph.node(*node).shape.dims())?;
                    vals[node.index()] = Some(Arc::new(mem.track(out)));
                }
                StepKind::Fused(lp) => {
                    let outs = lp.run(&vals, scalars, mem)?;
                    for (o, d) in lp.writes().into_iter().zip(outs) {
                        vals[o.index()] = Some(Arc::new(mem.track(d)));
                    }
                }
            }
            if let Some((start, cpu_start)) = start {
                let took = start.elapsed();
                let cpu = profile::thread_cpu_time().zip(cpu_start).map(|(end, begin)| end.saturating_sub(begin));
                let threads = threads::take_used();
                if timeline::enabled() {
                    let c = &step.cost;
                    let cpu = cpu.map_or(String::new(), |d| format!(", {:.1} µs CPU", d.as_secs_f64() * 1e6));
                    let what = format!("{} FLOPs, {} bytes, {threads} threads{cpu}", c.flops, c.bytes);
                    timeline::cpu_kernel(&c.name, start, took, what);
                }
                if profiling {
                    samples.push(LaunchSample {
                        cost: step.cost.clone(),
                        ms: Some(took.as_secs_f64() * 1e3),
                        threads: Some(threads as u32),
                        cpu_ms: cpu.map(|d| d.as_secs_f64() * 1e3),
                    });
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
        if let Some(p) = profiler.filter(|_| profiling) {
            p.record(samples);
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
        let writes = lp.writes();
        for w in &writes {
            self.done[w.index()] = true;
        }
        let reads = lp.reads();
        let name = format!("k{}_fused_{}", self.steps.len(), lp.describe());
        let cost = profile::step_cost(self.graph, name, lp.flops(), &reads, &writes);
        self.steps.push(Step { kind: StepKind::Fused(Box::new(lp)), reads, cost });
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

    /// Plans the product `root` (the root of a matmul kernel with prologue
    /// `inline`) as a [`StepKind::MatMul`] when it is an f32 or f64
    /// `MatMul` whose operands are views (or none) of materialized nodes
    /// that the product can read in place; the other inlined operands
    /// are computed first. False (nothing planned) otherwise.
    fn strided_matmul(&mut self, root: NodeId, inline: &[NodeId]) -> bool {
        let node = self.graph.node(root);
        if !matches!(node.op, Op::MatMul) || !matches!(node.dtype, DType::F32 | DType::F64) {
            return false;
        }
        let view = |o: NodeId| view_of(self.graph, o, inline).filter(|(_, v)| matmul::readable_in_place(v));
        let (Some(a), Some(b)) = (view(node.inputs[0]), view(node.inputs[1])) else { return false };
        for src in [a.0, b.0] {
            if !self.done[src.index()] && inline.contains(&src) {
                // A non-view node of the prologue the view reads.
                match FusedLoop::compile(self.graph, inline, &[src], self.mem) {
                    Some(lp) => self.fused(lp),
                    None => self.closure(src, inline),
                }
            }
        }
        let mut reads = vec![a.0, b.0];
        reads.dedup();
        self.done[root.index()] = true;
        let name = format!("k{}_matmul", self.steps.len());
        let cost = profile::step_cost(self.graph, name, profile::node_flops(self.graph, root), &reads, &[root]);
        self.steps.push(Step { kind: StepKind::MatMul { node: root, a, b }, reads, cost });
        true
    }

    /// Computes attention parts over the same operands in one step.
    fn attention(&mut self, outputs: Vec<NodeId>) {
        let mut reads = self.graph.node(outputs[0]).inputs.clone();
        reads.sort();
        reads.dedup();
        for o in &outputs {
            self.done[o.index()] = true;
        }
        let parts: Vec<String> = outputs
            .iter()
            .map(|&o| match self.graph.node(o).op {
                Op::Attention { part, .. } => format!("{part:?}").to_lowercase(),
                _ => unreachable!("attention step of a non-attention node"),
            })
            .collect();
        let name = format!("k{}_attention_{}", self.steps.len(), parts.join("_"));
        let flops = profile::attention_flops(self.graph, &outputs);
        let cost = profile::step_cost(self.graph, name, flops, &reads, &outputs);
        self.steps.push(Step { kind: StepKind::Attention(outputs), reads, cost });
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
        let name = format!("k{}_{}", self.steps.len(), node.op.label());
        // A reshape shares its operand's storage: it moves nothing.
        let cost = match node.op {
            Op::Reshape(_) => LaunchCost { name, ..LaunchCost::default() },
            _ => profile::step_cost(self.graph, name, profile::node_flops(self.graph, id), &reads, &[id]),
        };
        self.steps.push(Step { kind: StepKind::Node(id), reads, cost });
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

/// Node `id` as a view of a node outside `inline` (materialized before
/// the kernel runs), or of a node of `inline` that is no view op: the
/// chain of `Reshape`, `Permute`, `Expand` and `Slice` nodes of `inline`
/// that leads to it, folded into strides. `None` where a reshape cannot
/// be a view.
fn view_of(graph: &Graph, id: NodeId, inline: &[NodeId]) -> Option<(NodeId, View)> {
    let node = graph.node(id);
    let dims = node.shape.dims();
    if !inline.contains(&id) {
        return Some((id, View::contiguous(dims)));
    }
    let below = || view_of(graph, node.inputs[0], inline);
    Some(match &node.op {
        Op::Reshape(_) => {
            let (src, v) = below()?;
            (src, v.reshape(dims)?)
        }
        Op::Permute(perm) => {
            let (src, v) = below()?;
            (src, v.permute(perm))
        }
        Op::Expand(_) => {
            let (src, v) = below()?;
            (src, v.expand(dims))
        }
        Op::Slice { starts, steps, lens } => {
            let (src, v) = below()?;
            (src, v.slice(starts, steps, lens))
        }
        _ => (id, View::contiguous(dims)),
    })
}

/// Runs `graph` on `inputs` (one per parameter) and `scalars` (one per
/// scalar slot), returning one buffer per output. Compiles the graph first;
/// [`CpuExecutable::run`] reuses a compiled program.
pub fn run(graph: &Graph, inputs: Vec<Buffer>, scalars: &[ScalarValue]) -> Result<Vec<Buffer>, BackendError> {
    let mem = Arc::default();
    Program::compile(graph, &mem).run(graph, inputs, scalars, &mem, None)
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
