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
    /// table). Nodes whose shapes happen to be equal at these sizes stay
    /// apart where [`optimize_traced`] is given the classes of the other
    /// sizes. Default `false`.
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
    let (g, stats, _) = optimize_traced(graph, opts, None);
    (g, stats)
}

/// In what [`optimize_traced`] returns: a node of the input graph that
/// no node of the optimized graph stands for (dead code).
pub const GONE: u32 = u32::MAX;

/// [`optimize_with_stats`], also returning, per node of `graph`, the node
/// of the optimized graph it became ([`GONE`] if none): nodes merged,
/// bypassed or folded into one share it.
///
/// `classes`, for a size variant: per node of `graph`, what the same
/// call returned for the graph of the same structure optimized before at
/// other sizes (aligned node for node). CSE then merges two nodes only
/// where their counterparts there became one node too: two index ramps
/// whose shapes are equal only at these sizes (a causal mask's `[T, T]`
/// and a table's `[T, 64]` at `T = 64`) stay two nodes, so the optimized
/// graph keeps the structure of the other sizes, and its kernels their
/// families. Never less exact: a class only keeps nodes apart.
pub fn optimize_traced(graph: &Graph, opts: &PassOptions, classes: Option<&[u32]>) -> (Graph, PassStats, Vec<u32>) {
    let mut stats = PassStats { nodes_before: graph.len(), ..PassStats::default() };
    let mut g = graph.clone();
    // Per input node, its node in `g`; per node of `g`, its class.
    let mut became: Vec<u32> = (0..graph.len() as u32).collect();
    let mut class: Option<Vec<u32>> = classes.map(<[u32]>::to_vec);
    let mut follow = |map: &[NodeId], len: usize, class: &mut Option<Vec<u32>>| {
        for b in became.iter_mut().filter(|b| **b != GONE) {
            *b = map[*b as usize].0;
        }
        if let Some(old) = class.as_mut() {
            // A node stands for the first node that became it; new
            // nodes (a rewrite's) have no class of their own.
            let mut new = vec![GONE; len];
            for (i, m) in map.iter().enumerate() {
                if m.0 != GONE && new[m.index()] == GONE {
                    new[m.index()] = old[i];
                }
            }
            *old = new;
        }
    };
    for _ in 0..opts.max_iterations.max(1) {
        stats.iterations += 1;
        let (next, simplified, map) = simplify::run(&g, opts);
        debug_check(&next, "simplify");
        follow(&map, next.len(), &mut class);
        let (next, folded, map) = fold::run(&next);
        debug_check(&next, "fold");
        follow(&map, next.len(), &mut class);
        let (next, merged, map) = cse::run(&next, class.as_deref());
        debug_check(&next, "cse");
        follow(&map, next.len(), &mut class);
        let (next, removed, map) = dce::run(&next);
        debug_check(&next, "dce");
        follow(&map, next.len(), &mut class);
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
    (g, stats, became)
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

    /// Two index ramps and a product of each with `x`: `[t, n]` beside
    /// `[t, t]`, equal at `t = n` only.
    fn ramps(t: usize, n: usize) -> Graph {
        use crate::{BinaryOp, DType, Op, Shape, ValueType};
        let mut g = Graph::new();
        let x = g.param(ValueType::new([t, 1], DType::F32));
        let iota = |g: &mut Graph, d: usize| {
            g.push(Op::Iota { shape: Shape::new([t, d]), axis: 1, dtype: DType::F32 }, &[]).unwrap()
        };
        let (a, b) = (iota(&mut g, n), iota(&mut g, t));
        let ya = g.push(Op::Binary(BinaryOp::Mul), &[a, x]).unwrap();
        let yb = g.push(Op::Binary(BinaryOp::Mul), &[b, x]).unwrap();
        g.outputs.extend([ya, yb]);
        g
    }

    #[test]
    fn a_size_variant_keeps_apart_what_stayed_apart_at_the_other_sizes() {
        let opts = PassOptions { sizes_vary: true, ..PassOptions::default() };
        // At other sizes the two ramps differ: four nodes stay (and x).
        let (earlier, _, became) = optimize_traced(&ramps(5, 8), &opts, None);
        assert_eq!(earlier.len(), 5);
        assert_eq!(became, [0, 1, 2, 3, 4]);
        // Equal at t = n: alone, CSE merges the ramps and their products.
        let (alone, stats, became) = optimize_traced(&ramps(8, 8), &opts, None);
        assert_eq!((alone.len(), stats.cse_merged), (3, 2), "{}", alone.to_text());
        assert_eq!(became[1], became[2]);
        // With the classes of the other sizes they stay apart, the same
        // structure as there.
        let (kept, stats, _) = optimize_traced(&ramps(8, 8), &opts, Some(&[0, 1, 2, 3, 4]));
        assert_eq!((kept.len(), stats.cse_merged), (5, 0), "{}", kept.to_text());
        assert_eq!(kept.shape_free_hash(), earlier.shape_free_hash());
        // Classes never merge what differs, and merge what merged there.
        let (merged, stats, _) = optimize_traced(&ramps(8, 8), &opts, Some(&[0, 1, 1, 3, 3]));
        assert_eq!((merged.len(), stats.cse_merged), (3, 2));
    }
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
