//! The interpreter: [`CpuExecutable`] and [`run`], which evaluates a
//! verified graph node by node in its topological order.
//!
//! Each node's value lives in an `Arc`'d [`CpuStorage`] until its last use
//! (counted with `Graph::use_counts`), then it is dropped; `Reshape` shares
//! its operand's storage. Outputs are returned as [`Buffer`]s sharing the
//! same storage (no copy).

use crate::storage::{CpuData, CpuStorage};
use crate::{conv, elementwise, matmul, movement, reduce, source};
use lazuli_executor::{BackendError, BackendKind, Buffer, DeviceStorage, Executable};
use lazuli_ir::{Graph, Op, ScalarValue, VerifiedGraph};
use std::any::Any;
use std::sync::Arc;

/// A compiled graph for the CPU backend: the verified graph itself.
///
/// `kernel_count` is the number of non-leaf nodes (each is one kernel
/// invocation of the interpreter); `kernel_sources` is empty.
#[derive(Debug)]
pub struct CpuExecutable {
    graph: VerifiedGraph,
    kernels: usize,
}

impl CpuExecutable {
    /// Wraps a verified graph.
    pub fn new(graph: VerifiedGraph) -> CpuExecutable {
        let kernels = graph.nodes().iter().filter(|n| !n.op.is_leaf()).count();
        CpuExecutable { graph, kernels }
    }

    /// The graph this executable runs.
    pub fn graph(&self) -> &VerifiedGraph {
        &self.graph
    }
}

impl Executable for CpuExecutable {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn kernel_count(&self) -> usize {
        self.kernels
    }

    fn kernel_sources(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

fn data(s: &Arc<dyn DeviceStorage>) -> &CpuData {
    &s.as_any().downcast_ref::<CpuStorage>().expect("checked when inputs are bound").data
}

/// Runs `graph` on `inputs` (one per parameter) and `scalars` (one per
/// scalar slot), returning one buffer per output.
pub fn run(graph: &Graph, inputs: Vec<Buffer>, scalars: &[ScalarValue]) -> Result<Vec<Buffer>, BackendError> {
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
    let mut uses = graph.use_counts();
    let mut vals: Vec<Option<Arc<dyn DeviceStorage>>> = vec![None; graph.len()];
    for (id, node) in graph.nodes().iter().enumerate() {
        let arg = |k: usize| data(vals[node.inputs[k].index()].as_ref().expect("operands precede users"));
        let shape = |k: usize| graph.node(node.inputs[k]).shape.dims();
        let dims = node.shape.dims();
        let out: Result<CpuData, BackendError> = match &node.op {
            Op::Parameter(i) => {
                vals[id] = Some(inputs[*i as usize].storage.clone());
                continue;
            }
            Op::Reshape(_) => {
                vals[id] = vals[node.inputs[0].index()].clone();
                release(&mut uses, &mut vals, &node.inputs);
                continue;
            }
            Op::Constant(v, dt) => Ok(source::scalar(*v, *dt)),
            Op::ScalarParam(i) => Ok(source::scalar(scalars[*i as usize], node.dtype)),
            Op::Iota { shape, axis, dtype } => Ok(source::iota(shape.dims(), *axis, *dtype)),
            Op::Random { dist, .. } => {
                let word = |k: usize| match arg(k) {
                    CpuData::U32(v) => v[0],
                    _ => unreachable!("random keys are u32 in a verified graph"),
                };
                Ok(source::random(node.shape.numel(), *dist, word(0), word(1)))
            }
            Op::Unary(u) => Ok(elementwise::unary(*u, arg(0))),
            Op::Binary(b) => Ok(elementwise::binary(*b, arg(0), shape(0), arg(1), shape(1), dims)),
            Op::Where => Ok(elementwise::select(arg(0), shape(0), arg(1), shape(1), arg(2), shape(2), dims)),
            Op::Cast(dt) => Ok(elementwise::cast(arg(0), *dt)),
            Op::Reduce { op, axes, .. } => Ok(reduce::reduce(*op, arg(0), shape(0), axes)),
            Op::ArgReduce { op, axis, select_last, .. } => {
                Ok(reduce::arg_reduce(*op, arg(0), shape(0), *axis, *select_last))
            }
            Op::CumSum { axis, exclusive, reverse } => {
                Ok(reduce::cumsum(arg(0), shape(0), *axis, *exclusive, *reverse))
            }
            Op::Softmax { axis, log } => Ok(reduce::softmax(arg(0), shape(0), *axis, *log)),
            Op::MatMul => Ok(matmul::matmul(arg(0), shape(0), arg(1), shape(1), dims)),
            Op::Permute(perm) => Ok(movement::permute(arg(0), shape(0), perm)),
            Op::Expand(_) => Ok(movement::expand(arg(0), shape(0), dims)),
            Op::Slice { starts, steps, lens } => Ok(movement::slice(arg(0), shape(0), starts, steps, lens)),
            Op::Concat { axis } => {
                let parts: Vec<&CpuData> = (0..node.inputs.len()).map(arg).collect();
                let shapes: Vec<&[usize]> = (0..node.inputs.len()).map(shape).collect();
                Ok(movement::concat(&parts, &shapes, *axis))
            }
            Op::Pad { before, after, mode } => {
                let value = (node.inputs.len() > 1).then(|| arg(1));
                Ok(movement::pad(arg(0), shape(0), before, after, *mode, value))
            }
            Op::Gather { axis } => movement::gather(arg(0), shape(0), *axis, arg(1)),
            Op::Conv2d(c) => Ok(conv::conv2d(arg(0), shape(0), arg(1), shape(1), dims, c)),
            Op::Pool(p) => Ok(conv::pool(arg(0), shape(0), dims, p)),
        };
        let out = out?;
        debug_assert_eq!(out.dtype(), node.dtype, "{}", node.op.name());
        debug_assert_eq!(out.len(), node.shape.numel(), "{}", node.op.name());
        vals[id] = Some(Arc::new(CpuStorage { data: out }));
        release(&mut uses, &mut vals, &node.inputs);
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

/// Drops operand values after their last use.
fn release(uses: &mut [usize], vals: &mut [Option<Arc<dyn DeviceStorage>>], inputs: &[lazuli_ir::NodeId]) {
    for i in inputs {
        let u = &mut uses[i.index()];
        *u -= 1;
        if *u == 0 {
            vals[i.index()] = None;
        }
    }
}
