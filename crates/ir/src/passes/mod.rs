//! Optimization passes over the arena [`Graph`]: algebraic simplification
//! ([`simplify`]), constant folding ([`fold`]), common-subexpression
//! elimination ([`cse`]) and dead-code elimination ([`dce`]), and the
//! driver [`optimize`] that runs them to a fixed point.
//!
//! Every pass is a pure function `&Graph -> Graph`: it rebuilds the graph
//! front to back with [`Graph::push_typed`], mapping old node ids to new
//! ones. Each pass keeps the parameter and scalar tables exactly as they
//! are (so `Op::Parameter(i)` and `Op::ScalarParam(i)` indices stay valid
//! for the executor) and keeps the outputs in order, duplicates included.
//! A rewrite never changes the shape or dtype of the value it replaces.
//!
//! In debug builds the driver re-checks the graph after every pass and
//! panics with the pass name on failure: an invalid graph out of a pass is
//! a bug in the pass, not a condition a caller can handle.

mod cse;
mod dce;
mod fold;
mod simplify;
#[cfg(test)]
mod test_eval;

pub use cse::cse;
pub use dce::dce;
pub use fold::fold;
pub use simplify::simplify;

use crate::{Graph, NodeId};

/// Settings of the optimization pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassOptions {
    /// Assume floating-point values are finite and that the sign of zero
    /// does not matter (like fast-math's `nnan ninf nsz`). Enables float
    /// rewrites that are otherwise wrong for some inputs: `x * 0 -> 0`
    /// (`inf * 0` is NaN) and `x + 0.0 -> x` (`-0.0 + 0.0` is `+0.0`).
    /// Default `false`.
    pub finite_math: bool,
    /// Upper bound on the rounds of simplify, fold, cse and dce; the
    /// driver stops earlier when a round changes nothing. Default 8.
    pub max_iterations: usize,
    /// The graph is a size variant of a structure compiled before at
    /// other sizes: a slice that covers its whole operand stays (at other
    /// sizes it would not), so that the optimized graph keeps the
    /// structure of the other sizes' and its kernels stay in their
    /// families (a growing context reaching the length of its position
    /// table). CSE still merges nodes whose shapes happen to be equal.
    /// Default `false`.
    pub sizes_vary: bool,
}

impl Default for PassOptions {
    fn default() -> PassOptions {
        PassOptions { finite_math: false, max_iterations: 8, sizes_vary: false }
    }
}

/// What [`optimize_with_stats`] did, for the executor's metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassStats {
    /// Nodes in the input graph.
    pub nodes_before: usize,
    /// Nodes in the optimized graph.
    pub nodes_after: usize,
    /// Rounds of the pass pipeline that ran (the last one changed nothing
    /// unless the bound was hit).
    pub iterations: usize,
    /// Nodes replaced by algebraic simplification.
    pub simplified: usize,
    /// Nodes replaced by a folded constant.
    pub folded: usize,
    /// Nodes merged into an earlier identical node.
    pub cse_merged: usize,
    /// Unreachable nodes removed.
    pub dce_removed: usize,
}

/// Runs simplify, fold, cse and dce until nothing changes (at most
/// `opts.max_iterations` rounds) and returns the optimized graph.
pub fn optimize(graph: &Graph, opts: &PassOptions) -> Graph {
    optimize_with_stats(graph, opts).0
}

/// [`optimize`], also returning what each pass did.
pub fn optimize_with_stats(graph: &Graph, opts: &PassOptions) -> (Graph, PassStats) {
    let mut stats = PassStats { nodes_before: graph.len(), ..PassStats::default() };
    let mut g = graph.clone();
    for _ in 0..opts.max_iterations.max(1) {
        stats.iterations += 1;
        let (next, simplified) = simplify::run(&g, opts);
        debug_check(&next, "simplify");
        let (next, folded) = fold::run(&next);
        debug_check(&next, "fold");
        let (next, merged) = cse::run(&next);
        debug_check(&next, "cse");
        let (next, removed) = dce::run(&next);
        debug_check(&next, "dce");
        g = next;
        stats.simplified += simplified;
        stats.folded += folded;
        stats.cse_merged += merged;
        stats.dce_removed += removed;
        if simplified + folded + merged + removed == 0 {
            break;
        }
    }
    stats.nodes_after = g.len();
    (g, stats)
}

/// Re-verifies a pass result in debug builds; a failure is a pass bug.
fn debug_check(g: &Graph, pass: &str) {
    if cfg!(debug_assertions) {
        if let Err(e) = g.check() {
            panic!("optimization pass `{pass}` produced an invalid graph: {e}\n{}", g.to_text());
        }
    }
}

/// A graph with the tables of `g` and no nodes or outputs: the start of
/// every pass's rebuild.
fn empty_like(g: &Graph) -> Graph {
    let mut out = Graph::new();
    // A pass keeps most nodes: room for all of them up front.
    out.reserve(g.len());
    out.params = g.params.clone();
    out.scalars = g.scalars.clone();
    out
}

/// Maps operand ids through `map` (old id -> new id).
fn remap(ids: &[NodeId], map: &[NodeId]) -> Vec<NodeId> {
    ids.iter().map(|i| map[i.index()]).collect()
}

#[cfg(test)]
mod tests {
    use super::test_eval::{assert_same_results, count_ops};
    use super::*;
    use crate::{BinaryOp, DType, Op, ScalarValue, UnaryOp, ValueType};

    /// `neg(neg(x * 1 + 0)) * (1 + 1)` twice, plus dead code: everything
    /// but `x * 2` disappears.
    fn messy() -> Graph {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 3], DType::I32));
        let mut outs = Vec::new();
        for _ in 0..2 {
            let one = g.push(Op::Constant(ScalarValue::Int(1), DType::I32), &[]).unwrap();
            let zero = g.push(Op::Constant(ScalarValue::Int(0), DType::I32), &[]).unwrap();
            let a = g.push(Op::Binary(BinaryOp::Mul), &[x, one]).unwrap();
            let b = g.push(Op::Binary(BinaryOp::Add), &[a, zero]).unwrap();
            let c = g.push(Op::Unary(UnaryOp::Neg), &[b]).unwrap();
            let d = g.push(Op::Unary(UnaryOp::Neg), &[c]).unwrap();
            let two = g.push(Op::Binary(BinaryOp::Add), &[one, one]).unwrap();
            let e = g.push(Op::Binary(BinaryOp::Mul), &[d, two]).unwrap();
            g.push(Op::Unary(UnaryOp::Abs), &[e]).unwrap();
            outs.push(e);
        }
        g.outputs = vec![outs[1], outs[0], outs[1]];
        g
    }

    #[test]
    fn optimize_reaches_a_small_fixed_point() {
        let g = messy();
        let (opt, stats) = optimize_with_stats(&g, &PassOptions::default());
        // x, the constant 2, and one multiply.
        assert_eq!(opt.len(), 3, "{}", opt.to_text());
        assert_eq!(count_ops(&opt, |op| matches!(op, Op::Binary(BinaryOp::Mul))), 1);
        assert_eq!(opt.outputs.len(), 3);
        assert_eq!(opt.outputs[0], opt.outputs[2]);
        assert_eq!(opt.params, g.params);
        assert_eq!(stats.nodes_before, g.len());
        assert_eq!(stats.nodes_after, 3);
        assert!(stats.simplified > 0 && stats.folded > 0 && stats.cse_merged > 0 && stats.dce_removed > 0);
        assert_same_results(&g, &opt);
        // Optimizing again changes nothing.
        let (again, stats2) = optimize_with_stats(&opt, &PassOptions::default());
        assert_eq!(again, opt);
        assert_eq!(stats2.iterations, 1);
    }

    #[test]
    fn iteration_bound_is_respected() {
        let g = messy();
        let opts = PassOptions { max_iterations: 1, ..PassOptions::default() };
        let (opt, stats) = optimize_with_stats(&g, &opts);
        assert_eq!(stats.iterations, 1);
        assert_same_results(&g, &opt);
    }
}
