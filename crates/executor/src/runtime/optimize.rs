//! The optimization pipeline run on a compile-cache miss, before
//! partitioning: DCE, CSE, constant folding and algebraic simplification
//! from `lazuli_ir::passes`, with their effect recorded as metrics.

use crate::metrics;
use lazuli_ir::passes::{optimize_traced, PassOptions};
use lazuli_ir::Graph;

/// Runs the IR passes. `LAZULI_FINITE_MATH=1` enables the rewrites that are
/// only exact for finite values (x*0 -> 0, x+0.0 -> x on floats).
/// `earlier`: the graph is a size variant of this one, compiled before,
/// with what its nodes became (`PassOptions::sizes_vary`; CSE merges only
/// nodes whose counterparts there became one node, see
/// `passes::optimize_traced`). Returns the optimized graph and what each
/// node of `graph` became.
pub(crate) fn optimize(graph: &Graph, earlier: Option<(&Graph, &[u32])>) -> (Graph, Vec<u32>) {
    // A malformed value never gets here: `Device::new` checked it, and a
    // device created with one fails before compiling.
    let finite_math = crate::config::flag(&crate::config::process, "LAZULI_FINITE_MATH").ok().flatten();
    let opts = PassOptions {
        finite_math: finite_math.unwrap_or(false),
        sizes_vary: earlier.is_some(),
        ..PassOptions::default()
    };
    // Classes only from a graph that aligns node for node (one structure
    // hashes alike; a collision must not misalign them).
    let aligned = |e: &Graph| {
        e.len() == graph.len()
            && e.nodes().iter().zip(graph.nodes()).all(|(a, b)| a.op.label() == b.op.label() && a.inputs == b.inputs)
    };
    let classes = earlier.filter(|(e, became)| aligned(e) && became.len() == graph.len()).map(|(_, became)| became);
    let (g, stats, became) = optimize_traced(graph, &opts, classes);
    metrics::inc("PassNodesRemoved", (stats.nodes_before.saturating_sub(stats.nodes_after)) as u64);
    metrics::inc("PassSimplified", stats.simplified as u64);
    metrics::inc("PassFolded", stats.folded as u64);
    metrics::inc("PassCseMerged", stats.cse_merged as u64);
    metrics::inc("PassDceRemoved", stats.dce_removed as u64);
    (g, became)
}
