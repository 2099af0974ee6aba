//! Post-order tracing: copies the subgraph reachable from the roots into an
//! arena [`Graph`]. Data leaves (and nodes materialized by an earlier sync)
//! become parameters, deduplicated by cell identity; lifted scalars become
//! scalar slots whose values travel beside the graph.
//!
//! [`replay`] walks the same way but compares each node it would append
//! with the graph an earlier trace made, building nothing: a sync whose
//! pending graph has the structure of one compiled before (a training
//! step, W5's chain) collects its inputs and scalars and proves the graph
//! equal in one pass, without allocating, hashing or comparing an arena
//! graph (see `Device::sync_nodes`).

use crate::api::lazy::{DataCell, LazyNode, NodeKind};
use lazuli_ir::{DType, Graph, NodeId, Op, ScalarValue, StableHasher, ValueType};
use smallvec::SmallVec;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
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
    let mut graph = Graph::new();
    // Room for the nodes up front: growing the arena node by node
    // reallocates and copies it several times. The roots' size bounds
    // overcount shared nodes, so they are capped at the default graph size
    // limit.
    graph.reserve(expected_nodes(roots));
    let run = walk(roots, &mut Build(&mut graph)).expect("building never rejects a node");
    debug_assert!(graph.check().is_ok(), "traced graph must verify: {:?}", graph.check());
    debug_assert!(graph.nodes().iter().all(|n| !matches!(n.op, Op::Parameter(_)) || n.inputs.is_empty()));
    Traced { graph, inputs: run.inputs, scalars: run.scalars, locations: run.locations }
}

/// Walks `roots` as [`trace`] does, checking each node against `graph`
/// instead of appending it: `Some` (the inputs, scalars and locations of
/// this sync, `graph` standing in for the traced graph) exactly when
/// `trace(roots).graph == *graph`, `None` at the first difference.
pub(crate) fn replay(roots: &[Arc<LazyNode>], graph: &Graph) -> Option<Traced> {
    let mut check = Check { graph, next: 0, params: 0, scalars: 0, outputs: 0 };
    let run = walk(roots, &mut check)?;
    let complete = check.next == graph.len()
        && check.params == graph.params.len()
        && check.scalars == graph.scalars.len()
        && check.outputs == graph.outputs.len();
    complete.then(|| Traced { graph: Graph::new(), inputs: run.inputs, scalars: run.scalars, locations: run.locations })
}

/// A key for the structure of the graph a sync of `roots` traces: the
/// roots' structural hashes in order. Equal graphs have equal keys;
/// different graphs usually differ (parameter sharing, which the node
/// hashes do not see, is checked by [`replay`]).
pub(crate) fn roots_key(roots: &[Arc<LazyNode>]) -> u64 {
    let mut h = StableHasher::new();
    h.write_usize(roots.len());
    for r in roots {
        h.write_u64(r.hash);
    }
    h.finish()
}

fn expected_nodes(roots: &[Arc<LazyNode>]) -> usize {
    roots.iter().fold(0usize, |n, r| n.saturating_add(r.size)).min(4096)
}

/// What a walk collects besides the graph.
struct Run {
    inputs: Vec<Arc<DataCell>>,
    scalars: Vec<ScalarValue>,
    locations: Vec<&'static Location<'static>>,
}

/// Receives the nodes of a walk in graph order; `None` stops the walk.
trait Sink {
    fn param(&mut self, ty: &ValueType) -> Option<NodeId>;
    fn scalar(&mut self, dtype: DType) -> Option<NodeId>;
    fn op(&mut self, op: &Op, inputs: &[NodeId], ty: &ValueType) -> Option<NodeId>;
    fn output(&mut self, id: NodeId) -> Option<()>;
}

/// Appends to a graph ([`trace`]).
struct Build<'a>(&'a mut Graph);

impl Sink for Build<'_> {
    fn param(&mut self, ty: &ValueType) -> Option<NodeId> {
        Some(self.0.param(ty.clone()))
    }
    fn scalar(&mut self, dtype: DType) -> Option<NodeId> {
        Some(self.0.scalar(dtype))
    }
    fn op(&mut self, op: &Op, inputs: &[NodeId], ty: &ValueType) -> Option<NodeId> {
        Some(self.0.push_typed(op.clone(), inputs.to_vec(), ty.clone()))
    }
    fn output(&mut self, id: NodeId) -> Option<()> {
        self.0.outputs.push(id);
        Some(())
    }
}

/// Compares with a graph ([`replay`]): each node must be the one `graph`
/// holds at the next position, as `Graph::param`, `Graph::scalar` and
/// `Graph::push_typed` would have made it.
struct Check<'a> {
    graph: &'a Graph,
    next: usize,
    params: usize,
    scalars: usize,
    outputs: usize,
}

impl Check<'_> {
    fn expect(&mut self, same: impl FnOnce(&lazuli_ir::Node) -> bool) -> Option<NodeId> {
        let node = self.graph.nodes().get(self.next)?;
        if !same(node) {
            return None;
        }
        self.next += 1;
        Some(NodeId(self.next as u32 - 1))
    }
}

impl Sink for Check<'_> {
    fn param(&mut self, ty: &ValueType) -> Option<NodeId> {
        let i = self.params;
        if self.graph.params.get(i) != Some(ty) {
            return None;
        }
        let id = self.expect(|n| {
            n.op == Op::Parameter(i as u32) && n.inputs.is_empty() && n.shape == ty.shape && n.dtype == ty.dtype
        })?;
        self.params += 1;
        Some(id)
    }
    fn scalar(&mut self, dtype: DType) -> Option<NodeId> {
        let i = self.scalars;
        if self.graph.scalars.get(i) != Some(&dtype) {
            return None;
        }
        let id = self.expect(|n| {
            n.op == Op::ScalarParam(i as u32) && n.inputs.is_empty() && n.shape.rank() == 0 && n.dtype == dtype
        })?;
        self.scalars += 1;
        Some(id)
    }
    fn op(&mut self, op: &Op, inputs: &[NodeId], ty: &ValueType) -> Option<NodeId> {
        self.expect(|n| n.op == *op && n.inputs == inputs && n.shape == ty.shape && n.dtype == ty.dtype)
    }
    fn output(&mut self, id: NodeId) -> Option<()> {
        if self.graph.outputs.get(self.outputs) != Some(&id) {
            return None;
        }
        self.outputs += 1;
        Some(())
    }
}

/// A step of the walk: a node to enter, or an op to finish once its
/// operands are done. `once` marks a node only one reference reaches (see
/// `walk`); `mask` the operands of an op that were entered so.
enum Visit<'a> {
    Enter(&'a Arc<LazyNode>, bool),
    Exit(&'a Arc<LazyNode>, bool, u64),
}

/// The post-order walk shared by [`trace`] and [`replay`].
fn walk(roots: &[Arc<LazyNode>], sink: &mut impl Sink) -> Option<Run> {
    let expected = expected_nodes(roots);
    let mut run = Run { inputs: Vec::new(), scalars: Vec::new(), locations: Vec::with_capacity(expected) };
    // Pointer and id keys: a fast non-SipHash hasher keeps tracing cheap.
    let mut ids: HashMap<*const LazyNode, NodeId, BuildHasherDefault<StableHasher>> =
        HashMap::with_capacity_and_hasher(expected, Default::default());
    let mut params: HashMap<u64, NodeId, BuildHasherDefault<StableHasher>> = HashMap::default();
    // A node only one reference reaches when its user is expanded (that
    // user's operand slot: the way this walk comes) is met exactly once,
    // so it needs no entry in `ids`: its id goes to `done`, where its user
    // takes it back. Other threads may add and drop references meanwhile,
    // but a node that two operand slots of this graph (or a root) reach
    // always has two, so the decision, taken once per operand slot, is
    // safe. Most nodes of a chain are such nodes.
    let once = |n: &Arc<LazyNode>| Arc::strong_count(n) == 1;
    let mut done: Vec<NodeId> = Vec::new();
    let mut stack: Vec<Visit> = Vec::new();
    let mut inputs: SmallVec<[NodeId; 4]> = SmallVec::new();
    for root in roots {
        stack.push(Visit::Enter(root, false));
        while let Some(visit) = stack.pop() {
            let (node, single, id) = match visit {
                Visit::Enter(node, single) => {
                    if !single && ids.contains_key(&Arc::as_ptr(node)) {
                        continue;
                    }
                    if let Some(cell) = node.cell() {
                        let id = match params.get(&cell.id) {
                            Some(&id) => id,
                            None => {
                                let id = sink.param(&cell.ty)?;
                                params.insert(cell.id, id);
                                run.inputs.push(cell.clone());
                                run.locations.push(node.location);
                                id
                            }
                        };
                        (node, single, id)
                    } else {
                        match &node.kind {
                            NodeKind::Scalar(v) => {
                                let id = sink.scalar(node.ty.dtype)?;
                                run.scalars.push(v.cast(node.ty.dtype));
                                run.locations.push(node.location);
                                (node, single, id)
                            }
                            NodeKind::Op(_) => {
                                let mut mask = 0u64;
                                for (k, o) in node.operands.iter().enumerate().take(64) {
                                    if once(o) {
                                        mask |= 1 << k;
                                    }
                                }
                                stack.push(Visit::Exit(node, single, mask));
                                for (k, o) in node.operands.iter().enumerate().rev() {
                                    let o_once = mask & (1u64.checked_shl(k as u32).unwrap_or(0)) != 0;
                                    if o_once || !ids.contains_key(&Arc::as_ptr(o)) {
                                        stack.push(Visit::Enter(o, o_once));
                                    }
                                }
                                continue;
                            }
                            NodeKind::Data(_) => unreachable!("data nodes always have a cell"),
                        }
                    }
                }
                Visit::Exit(node, single, mask) => {
                    let NodeKind::Op(op) = &node.kind else { unreachable!("only ops are finished") };
                    // The single-reference operands' ids are the last
                    // entries of `done`, in operand order.
                    let mut next = done.len() - mask.count_ones() as usize;
                    let base = next;
                    inputs.clear();
                    for (k, o) in node.operands.iter().enumerate() {
                        if k < 64 && mask & (1 << k) != 0 {
                            inputs.push(done[next]);
                            next += 1;
                        } else {
                            inputs.push(ids[&Arc::as_ptr(o)]);
                        }
                    }
                    done.truncate(base);
                    let id = sink.op(op, &inputs, &node.ty)?;
                    run.locations.push(node.location);
                    (node, single, id)
                }
            };
            if single {
                done.push(id);
            } else {
                ids.insert(Arc::as_ptr(node), id);
            }
        }
        sink.output(ids[&Arc::as_ptr(root)])?;
    }
    Some(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::lazy::{CellState, Operands};
    use lazuli_ir::{BinaryOp, UnaryOp};
    use smallvec::smallvec;

    fn ty() -> ValueType {
        ValueType::new([4], DType::F32)
    }

    fn data() -> Arc<LazyNode> {
        let cell = DataCell::new(1, ty(), CellState::Host(Arc::new(vec![0; 16])));
        Arc::new(LazyNode::data(cell, Location::caller()))
    }

    fn scalar(v: f64) -> Arc<LazyNode> {
        Arc::new(LazyNode::scalar(ScalarValue::Float(v), ValueType::new([], DType::F32), Location::caller()))
    }

    fn bin(a: &Arc<LazyNode>, b: &Arc<LazyNode>) -> Arc<LazyNode> {
        let ops: Operands = smallvec![a.clone(), b.clone()];
        Arc::new(LazyNode::op(Op::Binary(BinaryOp::Add), ops, ty(), Location::caller()))
    }

    fn un(a: &Arc<LazyNode>) -> Arc<LazyNode> {
        Arc::new(LazyNode::op(Op::Unary(UnaryOp::Exp), smallvec![a.clone()], a.ty.clone(), Location::caller()))
    }

    /// A DAG mixing chains (nodes one reference reaches), shared nodes,
    /// a cell read twice and a shared scalar: `(e + e) + (x + (x + s))`
    /// twice over, with `e = exp(chain of x)`.
    fn dag() -> (Vec<Arc<LazyNode>>, Arc<LazyNode>) {
        let x = data();
        let s = scalar(0.5);
        let mut chain = x.clone();
        for _ in 0..5 {
            chain = un(&chain);
        }
        let e = un(&chain);
        drop(chain);
        let left = bin(&e, &e);
        let right = bin(&x, &bin(&x, &s));
        let root = bin(&left, &right);
        let root2 = bin(&root, &un(&un(&bin(&x, &s))));
        (vec![root2, root], x)
    }

    /// The trace as first written: every node memoized by identity,
    /// operands in order, recursively.
    fn reference(roots: &[Arc<LazyNode>]) -> Graph {
        fn visit(
            n: &Arc<LazyNode>,
            g: &mut Graph,
            ids: &mut HashMap<*const LazyNode, NodeId>,
            cells: &mut HashMap<u64, NodeId>,
        ) -> NodeId {
            if let Some(&id) = ids.get(&Arc::as_ptr(n)) {
                return id;
            }
            let id = if let Some(cell) = n.cell() {
                *cells.entry(cell.id).or_insert_with(|| g.param(cell.ty.clone()))
            } else {
                match &n.kind {
                    NodeKind::Scalar(_) => g.scalar(n.ty.dtype),
                    NodeKind::Op(op) => {
                        let ins: Vec<NodeId> = n.operands.iter().map(|o| visit(o, g, ids, cells)).collect();
                        g.push_typed(op.clone(), ins, n.ty.clone())
                    }
                    NodeKind::Data(_) => unreachable!(),
                }
            };
            ids.insert(Arc::as_ptr(n), id);
            id
        }
        let (mut g, mut ids, mut cells) = (Graph::new(), HashMap::new(), HashMap::new());
        for r in roots {
            let id = visit(r, &mut g, &mut ids, &mut cells);
            g.outputs.push(id);
        }
        g
    }

    #[test]
    fn trace_wires_chains_and_shared_nodes() {
        let (roots, _x) = dag();
        let t = trace(&roots);
        t.graph.check().unwrap();
        // x, 5 + 1 exps, e + e, s, x + s, x + (x + s), left + right,
        // another x + s, two exps of it, the second root.
        assert_eq!(t.graph.len(), 16, "{}", t.graph.to_text());
        assert_eq!((t.inputs.len(), t.scalars.len(), t.graph.outputs.len()), (1, 1, 2));
        let nodes = t.graph.nodes();
        // `e + e` reads one node twice; `x` is one parameter.
        assert!(nodes.iter().any(|n| n.inputs.len() == 2 && n.inputs[0] == n.inputs[1]));
        assert_eq!(nodes.iter().filter(|n| matches!(n.op, Op::Parameter(_))).count(), 1);
        assert_eq!(t.graph, reference(&roots), "against the memoize-everything walk");
        // Deterministic: the same structure traces to the same graph.
        let (roots2, _) = dag();
        assert_eq!(trace(&roots2).graph, t.graph);
    }

    #[test]
    fn replay_accepts_the_same_structure_and_rejects_any_other() {
        let (roots, _x) = dag();
        let t = trace(&roots);
        let (again, _) = dag();
        let r = replay(&again, &t.graph).expect("same structure");
        assert_eq!((r.inputs.len(), r.scalars.len(), r.locations.len()), (1, 1, t.locations.len()));
        // Same node hashes, other parameter sharing: `a + b` against
        // `a + a`.
        let (a, b) = (data(), data());
        let ab = vec![bin(&a, &b)];
        let aa = vec![bin(&a, &a)];
        assert_eq!(roots_key(&ab), roots_key(&aa));
        let g_ab = trace(&ab).graph;
        assert!(replay(&ab, &g_ab).is_some());
        assert!(replay(&aa, &g_ab).is_none());
        assert!(replay(&ab, &trace(&aa).graph).is_none());
        // A shared scalar against two scalars, a different op, an extra
        // root, fewer nodes.
        let s = scalar(1.0);
        let shared = vec![bin(&bin(&a, &s), &s)];
        let two = vec![bin(&bin(&a, &scalar(1.0)), &scalar(1.0))];
        assert!(replay(&two, &trace(&shared).graph).is_none());
        assert!(replay(&shared, &trace(&two).graph).is_none());
        assert!(replay(&[un(&a)], &trace(&[bin(&a, &a)]).graph).is_none());
        assert!(replay(&[un(&a)], &trace(&[un(&a), un(&a)]).graph).is_none());
        assert!(replay(&[un(&a), un(&a)], &trace(&[un(&a)]).graph).is_none());
        assert!(replay(&[un(&un(&a))], &trace(&[un(&a)]).graph).is_none());
    }
}
