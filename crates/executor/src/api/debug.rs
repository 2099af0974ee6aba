//! Introspection without syncing: the IR text, Graphviz DOT, graph hash and
//! generated kernel sources of what a sync of some tensors would run.

use crate::api::lazy::LazyNode;
use crate::runtime::plan::Plan;
use crate::runtime::trace::{trace, Traced};
use crate::{ExecError, Result, Tensor};
use std::fmt::Write as _;
use std::sync::Arc;

pub use crate::runtime::explain::{clear_compile_log, compile_log};

fn traced(tensors: &[&Tensor]) -> Traced {
    let mut roots: Vec<Arc<LazyNode>> = Vec::new();
    for t in tensors {
        let n = t.node();
        if !roots.iter().any(|r| Arc::ptr_eq(r, &n)) {
            roots.push(n);
        }
    }
    trace(&roots)
}

/// The IR a sync of `tensors` would trace, one node per line with the
/// source location of the call that recorded it.
pub fn ir_text(tensors: &[&Tensor]) -> String {
    let t = traced(tensors);
    let text = t.graph.to_text();
    let params = t.graph.params.len();
    let scalars = t.graph.scalars.len();
    let mut out = String::new();
    for (i, line) in text.lines().enumerate() {
        // Lines: params, scalars, nodes, outputs.
        let node = i.checked_sub(params + scalars).filter(|&k| k < t.graph.len());
        match node {
            Some(k) => {
                let loc = t.locations[k];
                let _ = writeln!(out, "{line:<60} # {}:{}", loc.file(), loc.line());
            }
            None => {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

/// Graphviz DOT of the IR a sync of `tensors` would trace.
pub fn ir_dot(tensors: &[&Tensor]) -> String {
    traced(tensors).graph.to_dot()
}

/// The structural hash (compile-cache key) of that graph.
pub fn graph_hash(tensors: &[&Tensor]) -> u64 {
    traced(tensors).graph.structural_hash()
}

/// The kernels (name, source) a sync of `tensors` would run, compiled
/// afresh (the compile cache is neither read nor written).
pub fn backend_code(tensors: &[&Tensor]) -> Result<Vec<(String, String)>> {
    let Some(first) = tensors.first() else { return Ok(Vec::new()) };
    let device = first.device();
    let t = traced(tensors);
    let force = device.force_fallback();
    let plan = Plan::compile(t.graph, device.0.main.as_ref(), device.0.cpu.as_ref(), &force, Default::default())
        .map_err(|source| ExecError::Backend { context: "debug::backend_code".into(), source })?;
    Ok(plan.kernel_sources())
}
