//! Per-kernel profiles of the CPU backend: the cost of each step of a
//! program by a simple model, computed when it compiles ([`step_cost`]:
//! FLOPs and bytes, as the wgpu backend's cost model counts them), and
//! the [`Profiler`] that collects each step's wall time and threads while
//! profiling is on (`Backend::set_profiling`, `lazuli bench --profile`).
//! The timeline (`LAZULI_TRACE`) gets the same steps as intervals on its
//! CPU kernel track.
//!
//! The model: a fused loop does one FLOP per element per instruction; a
//! product `2 M N K`; a convolution `2` per output element per tap; a
//! reduction one per element read; softmax five per element; attention
//! `2 T_q T_k (d + d_v)` per batch slice forward and `2 T_q T_k (3 d + 2
//! d_v)` for the gradients (halved when causal). Bytes count every distinct tensor
//! a step reads and every one it writes, once. Nodes that only move data
//! (permute, slice, gather, ...) have no FLOPs.

use lazuli_executor::{LaunchCost, LaunchSample};
use lazuli_ir::{AttentionPart, Graph, NodeId, Op};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Launches collected while profiling is on.
#[derive(Debug, Default)]
pub(crate) struct Profiler {
    /// Read by every execution without the lock.
    on: AtomicBool,
    samples: Mutex<Vec<LaunchSample>>,
}

impl Profiler {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<LaunchSample>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts or stops collecting (stopping drops what was collected).
    pub(crate) fn set(&self, on: bool) {
        let mut s = self.lock();
        s.clear();
        self.on.store(on, Ordering::Relaxed);
    }

    /// Whether it collects.
    pub(crate) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// The launches collected since the last call, in launch order.
    pub(crate) fn take(&self) -> Vec<LaunchSample> {
        std::mem::take(&mut *self.lock())
    }

    /// Adds one execution's launches while collecting.
    pub(crate) fn record(&self, samples: Vec<LaunchSample>) {
        if self.on() {
            self.lock().extend(samples);
        }
    }
}

/// The CPU time of the calling thread, where the platform tells.
pub(crate) fn thread_cpu_time() -> Option<std::time::Duration> {
    #[cfg(unix)]
    {
        cpu_time::ThreadTime::try_now().ok().map(|t| t.as_duration())
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Bytes of node `id`'s value.
fn bytes_of(graph: &Graph, id: NodeId) -> u64 {
    let n = graph.node(id);
    (n.shape.numel() * n.dtype.size_bytes()) as u64
}

/// Bytes read from `reads` and written to `writes`, each tensor once.
pub(crate) fn traffic(graph: &Graph, reads: &[NodeId], writes: &[NodeId]) -> u64 {
    reads.iter().chain(writes).map(|&id| bytes_of(graph, id)).sum()
}

/// FLOPs of interpreting node `id` by the model of the module
/// documentation.
pub(crate) fn node_flops(graph: &Graph, id: NodeId) -> u64 {
    let node = graph.node(id);
    let out = node.shape.numel() as u64;
    let input = |k: usize| graph.node(node.inputs[k]).shape.dims().to_vec();
    match &node.op {
        Op::MatMul => {
            let a = input(0);
            2 * out * a[a.len() - 1] as u64
        }
        Op::Conv2d(_) => {
            let w = input(1);
            2 * out * (w[1] * w[2] * w[3]) as u64
        }
        Op::Reduce { .. } | Op::ArgReduce { .. } | Op::CumSum { .. } | Op::Pool(_) | Op::PoolGrad(_) => {
            graph.node(node.inputs[0]).shape.numel() as u64
        }
        Op::Softmax { .. } => 5 * out,
        Op::Attention { .. } => attention_flops(graph, &[id]),
        Op::ScatterAdd { .. } => graph.node(node.inputs[2]).shape.numel() as u64,
        _ => 0,
    }
}

/// FLOPs of one pass computing the attention parts `parts` (nodes over
/// the same operands): the forward's two products, halved when causal;
/// with any gradient, the backward's five (scores again, `dP`, `dQ`,
/// `dK`, `dV`).
pub(crate) fn attention_flops(graph: &Graph, parts: &[NodeId]) -> u64 {
    let node = graph.node(parts[0]);
    let Op::Attention { attrs, .. } = node.op else { return 0 };
    let dims = |k: usize| graph.node(node.inputs[k]).shape.dims().to_vec();
    let (q, k, v) = (dims(0), dims(1), dims(2));
    let (tq, d) = (q[q.len() - 2] as u64, q[q.len() - 1] as u64);
    let (tk, dv) = (k[k.len() - 2] as u64, v[v.len() - 1] as u64);
    let out = node.shape.dims();
    let lead = if matches!(node.op, Op::Attention { part: AttentionPart::LogSumExp, .. }) { 1 } else { 2 };
    let slices: u64 = out[..out.len() - lead].iter().map(|&x| x as u64).product();
    let causal = if attrs.causal { 2 } else { 1 };
    let grad = parts.iter().any(|&p| matches!(graph.node(p).op, Op::Attention { part, .. } if part.is_grad()));
    let products = if grad { 3 * d + 2 * dv } else { d + dv };
    2 * slices * tq * tk * products / causal
}

/// The cost of a step named `name` that computes `flops`, reads `reads`
/// and writes `writes`.
pub(crate) fn step_cost(graph: &Graph, name: String, flops: u64, reads: &[NodeId], writes: &[NodeId]) -> LaunchCost {
    LaunchCost { name, flops, bytes: traffic(graph, reads, writes), workgroups: 1 }
}
