//! The shadow of a plan's native segment, what shadow validation
//! (`crate::runtime::shadow_run`) runs in its place: the segment's graph with every
//! kernel output also made a graph output (those nodes are materialized
//! anyway, so the backend plans the same kernels), compiled once for the
//! main backend and once for the CPU, on the segment's first validated
//! run. A segment holds its [`ShadowCache`]; this module knows nothing of
//! plans, so the plan (which owns the cache) and the validated run (which
//! reads it) both build on it.

use crate::{Backend, BackendError, Executable, KernelInfo};
use lazuli_ir::{Graph, Op};
use std::sync::{Arc, OnceLock};

/// The shadow executables of one segment, compiled on first validated run.
#[derive(Default)]
pub(crate) struct ShadowCache(OnceLock<Result<Shadow, BackendError>>);

/// A segment's shadow executables and the kernels they expose.
pub(crate) struct Shadow {
    /// The segment graph with every kernel output also a graph output
    /// (the segment's own outputs first, in order).
    pub graph: Graph,
    pub main: Arc<dyn Executable>,
    pub cpu: Arc<dyn Executable>,
    /// The main shadow's kernels, or one pseudo-kernel for the segment.
    pub kernels: Vec<KernelInfo>,
}

impl ShadowCache {
    /// The segment's shadow (`graph` compiled by `exe`'s backend `main`
    /// and by `cpu`), compiled on the first call; a failed compile is
    /// returned again on every call.
    pub(crate) fn get_or_compile(
        &self,
        graph: &Graph,
        exe: &dyn Executable,
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<&Shadow, BackendError> {
        self.0.get_or_init(|| Shadow::compile(graph, exe, main, cpu)).as_ref().map_err(Clone::clone)
    }
}

impl Shadow {
    fn compile(
        graph: &Graph,
        exe: &dyn Executable,
        main: &dyn Backend,
        cpu: &dyn Backend,
    ) -> Result<Shadow, BackendError> {
        let mut g = graph.clone();
        let mut kernels = exe.kernels();
        // Expose every kernel output; recompiling must give the same
        // kernels, but if the planner materializes a node it did not
        // before, expose that too (a few rounds at most).
        for _ in 0..4 {
            for k in &kernels {
                for o in &k.outputs {
                    if !g.outputs.contains(o) {
                        g.outputs.push(*o);
                    }
                }
            }
            let verified = g.clone().verify().map_err(|e| BackendError::Compile {
                kernel: "shadow validation".into(),
                message: format!("shadow graph failed verification (a bug): {e}"),
            })?;
            let m = main.compile(&verified)?;
            kernels = m.kernels();
            if kernels.is_empty() {
                // Per-segment comparison for backends that list no kernels.
                let sources = m.kernel_sources();
                kernels = vec![KernelInfo {
                    name: "segment".into(),
                    source: sources.iter().map(|(n, s)| format!("// {n}\n{s}")).collect::<Vec<_>>().join("\n"),
                    nodes: g.ids().filter(|id| !is_leaf(&g.node(*id).op)).collect(),
                    outputs: graph.outputs.clone(),
                }];
            }
            if kernels.iter().all(|k| k.outputs.iter().all(|o| g.outputs.contains(o))) {
                let verified = g.clone().verify().map_err(|e| BackendError::Compile {
                    kernel: "shadow validation".into(),
                    message: format!("shadow graph failed verification (a bug): {e}"),
                })?;
                let c = cpu.compile(&verified)?;
                return Ok(Shadow { graph: g, main: m, cpu: c, kernels });
            }
        }
        Err(BackendError::Compile {
            kernel: "shadow validation".into(),
            message: "the kernel plan kept changing as kernel outputs were exposed".into(),
        })
    }
}

fn is_leaf(op: &Op) -> bool {
    matches!(op, Op::Parameter(_) | Op::Constant(..) | Op::ScalarParam(_))
}
