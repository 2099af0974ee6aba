//! The optimization pipeline run on a compile-cache miss, before
//! partitioning: DCE, CSE, constant folding and algebraic simplification
//! from `lazuli_ir::passes`, with their effect recorded as metrics.

use crate::metrics;
use lazuli_ir::passes::{optimize_with_stats, PassOptions};
use lazuli_ir::Graph;

/// Runs the IR passes. `LAZULI_FINITE_MATH=1` enables the rewrites that are
/// only exact for finite values (x*0 -> 0, x+0.0 -> x on floats).
/// `sizes_vary`: the graph is a size variant of a structure compiled
/// before (`PassOptions::sizes_vary`).
pub(crate) fn optimize(graph: &Graph, sizes_vary: bool) -> Graph {
    // A malformed value never gets here: `Device::new` checked it, and a
    // device created with one fails before compiling.
    let finite_math = crate::config::flag(&crate::config::process, "LAZULI_FINITE_MATH").ok().flatten();
    let opts = PassOptions { finite_math: finite_math.unwrap_or(false), sizes_vary, ..PassOptions::default() };
    let (g, stats) = optimize_with_stats(graph, &opts);
    metrics::inc("PassNodesRemoved", (stats.nodes_before.saturating_sub(stats.nodes_after)) as u64);
    metrics::inc("PassSimplified", stats.simplified as u64);
    metrics::inc("PassFolded", stats.folded as u64);
    metrics::inc("PassCseMerged", stats.cse_merged as u64);
    metrics::inc("PassDceRemoved", stats.dce_removed as u64);
    g
}
