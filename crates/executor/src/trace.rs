//! Post-order tracing: copies the subgraph reachable from the roots into an
//! arena [`Graph`]. Data leaves (and nodes materialized by an earlier sync)
//! become parameters, deduplicated by cell identity; lifted scalars become
//! scalar slots whose values travel beside the graph.

use crate::lazy::{DataCell, LazyNode, NodeKind};
use lazuli_ir::{Graph, NodeId, Op, ScalarValue, StableHasher};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::panic::Location;
use std::sync::Arc;

/// The arena form of one sync, with what it needs at run time.
pub(crate) struct Traced {
    /// The graph; `outputs` are the roots in order.
    pub graph: Graph,
    /// One data cell per graph parameter.
    pub inputs: Vec<Arc<DataCell>>,
    /// One value per scalar slot, cast to the slot's dtype.
    pub scalars: Vec<ScalarValue>,
    /// Source location of the call that recorded each node.
    pub locations: Vec<&'static Location<'static>>,
}

/// Traces `roots` into one graph.
pub(crate) fn trace(roots: &[Arc<LazyNode>]) -> Traced {
    let mut t = Traced { graph: Graph::new(), inputs: Vec::new(), scalars: Vec::new(), locations: Vec::new() };
    // Room for the nodes up front: growing the arena node by node
    // reallocates and copies it several times. The roots' size bounds
    // overcount shared nodes, so they are capped at the default graph size
    // limit.
    let expected = roots.iter().fold(0usize, |n, r| n.saturating_add(r.size)).min(4096);
    t.graph.reserve(expected);
    t.locations.reserve(expected);
    // Pointer and id keys: a fast non-SipHash hasher keeps tracing cheap.
    let mut ids: HashMap<*const LazyNode, NodeId, BuildHasherDefault<StableHasher>> =
        HashMap::with_capacity_and_hasher(expected, Default::default());
    let mut params: HashMap<u64, NodeId, BuildHasherDefault<StableHasher>> = HashMap::default();
    // Iterative DFS: (node, operands expanded?)
    let mut stack: Vec<(&Arc<LazyNode>, bool)> = Vec::new();
    for root in roots {
        stack.push((root, false));
        while let Some((node, expanded)) = stack.pop() {
            let key = Arc::as_ptr(node);
            if ids.contains_key(&key) {
                continue;
            }
            if let Some(cell) = node.cell() {
                let id = *params.entry(cell.id).or_insert_with(|| {
                    t.inputs.push(cell.clone());
                    t.locations.push(node.location);
                    t.graph.param(cell.ty.clone())
                });
                ids.insert(key, id);
                continue;
            }
            match &node.kind {
                NodeKind::Scalar(v) => {
                    t.scalars.push(v.cast(node.ty.dtype));
                    t.locations.push(node.location);
                    ids.insert(key, t.graph.scalar(node.ty.dtype));
                }
                NodeKind::Op(op) => {
                    if !expanded {
                        stack.push((node, true));
                        for o in node.operands.iter().rev() {
                            if !ids.contains_key(&Arc::as_ptr(o)) {
                                stack.push((o, false));
                            }
                        }
                    } else {
                        let inputs: Vec<NodeId> = node.operands.iter().map(|o| ids[&Arc::as_ptr(o)]).collect();
                        t.locations.push(node.location);
                        let id = t.graph.push_typed(op.clone(), inputs, node.ty.clone());
                        ids.insert(key, id);
                    }
                }
                NodeKind::Data(_) => unreachable!("data nodes always have a cell"),
            }
        }
        t.graph.outputs.push(ids[&Arc::as_ptr(root)]);
    }
    debug_assert!(t.graph.check().is_ok(), "traced graph must verify: {:?}", t.graph.check());
    debug_assert!(t.graph.nodes().iter().all(|n| !matches!(n.op, Op::Parameter(_)) || n.inputs.is_empty()));
    t
}
