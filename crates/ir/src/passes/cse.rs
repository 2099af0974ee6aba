//! Common-subexpression elimination: nodes with the same op, attributes,
//! operands and type become one node.
//!
//! Every op in the IR is a pure function of its operands and attributes,
//! so equal keys mean equal values. That includes `Op::Random`, whose
//! values are a function of its key operands and shape (counter-based
//! Philox), and `Op::ScalarParam`, whose slot index is part of the key, so
//! two different slots never merge even when their values happen to match.
//! Operands of commutative binary ops are ordered in the key, so `a + b`
//! and `b + a` merge; the surviving node keeps its own operand order.
//!
//! Operands are remapped before the lookup, so one forward sweep also
//! merges chains whose operands were merged first.

use super::{empty_like, remap};
use crate::{BinaryOp, Graph, NodeId, Op, StableHasher, ValueType};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

/// What makes two nodes one: op with attributes, operands (sorted for a
/// commutative op), type, and class (see [`run`]).
type Key = (Op, Vec<NodeId>, ValueType, u32);

/// Merges structurally identical nodes.
pub fn cse(graph: &Graph) -> Graph {
    run(graph, None).0
}

/// [`cse`], also returning how many nodes were merged away and the node
/// each node became. With `classes` (one per node), only nodes of one
/// class merge: the classes of the graph of the same structure at other
/// sizes, so that nodes equal only at these sizes stay apart (see
/// [`super::optimize_traced`]).
pub(super) fn run(graph: &Graph, classes: Option<&[u32]>) -> (Graph, usize, Vec<NodeId>) {
    let mut out = empty_like(graph);
    // Keys are the graph's own ops and ids: the fast stable hasher, sized
    // for every node at once.
    let mut seen: HashMap<Key, NodeId, BuildHasherDefault<StableHasher>> =
        HashMap::with_capacity_and_hasher(graph.len(), Default::default());
    let mut map = Vec::with_capacity(graph.len());
    let mut merged = 0;
    for (i, n) in graph.nodes().iter().enumerate() {
        let inputs = remap(&n.inputs, &map);
        let mut key_inputs = inputs.clone();
        if is_commutative(&n.op) {
            key_inputs.sort();
        }
        let class = classes.map_or(0, |c| c[i]);
        let key = (n.op.clone(), key_inputs, n.ty(), class);
        let id = match seen.get(&key) {
            Some(&id) => {
                merged += 1;
                id
            }
            None => {
                let id = out.push_typed(n.op.clone(), inputs, n.ty());
                seen.insert(key, id);
                id
            }
        };
        map.push(id);
    }
    out.outputs = remap(&graph.outputs, &map);
    (out, merged, map)
}

/// Binary ops whose result does not depend on the operand order (exactly,
/// including for floats: IEEE addition and multiplication commute).
fn is_commutative(op: &Op) -> bool {
    use BinaryOp::*;
    matches!(op, Op::Binary(Add | Mul | Maximum | Minimum | Eq | Ne | And | Or | Xor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::test_eval::{assert_same_results, count_ops};
    use crate::{DType, RandomDist, ScalarValue, Shape, UnaryOp};

    #[test]
    fn merges_duplicated_subexpressions() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 3], DType::F32));
        let y = g.param(ValueType::new([3], DType::F32));
        // Two copies of exp(x + y) * c, built separately; the second add
        // has its operands swapped.
        let c1 = g.push(Op::Constant(ScalarValue::Float(-1.0), DType::F32), &[]).unwrap();
        let a1 = g.push(Op::Binary(BinaryOp::Add), &[x, y]).unwrap();
        let e1 = g.push(Op::Unary(UnaryOp::Exp), &[a1]).unwrap();
        let m1 = g.push(Op::Binary(BinaryOp::Mul), &[e1, c1]).unwrap();
        let c2 = g.push(Op::Constant(ScalarValue::Float(-1.0), DType::F32), &[]).unwrap();
        let a2 = g.push(Op::Binary(BinaryOp::Add), &[y, x]).unwrap();
        let e2 = g.push(Op::Unary(UnaryOp::Exp), &[a2]).unwrap();
        let m2 = g.push(Op::Binary(BinaryOp::Mul), &[e2, c2]).unwrap();
        // Sub does not commute: y - x and x - y stay apart.
        let s1 = g.push(Op::Binary(BinaryOp::Sub), &[x, y]).unwrap();
        let s2 = g.push(Op::Binary(BinaryOp::Sub), &[y, x]).unwrap();
        let r = g.push(Op::Binary(BinaryOp::Add), &[m1, m2]).unwrap();
        g.outputs = vec![r, m2, s1, s2];

        let (c, merged, _) = run(&g, None);
        assert_eq!(merged, 4);
        assert_eq!(c.len(), g.len() - 4, "{}", c.to_text());
        assert_eq!(count_ops(&c, |op| matches!(op, Op::Unary(UnaryOp::Exp))), 1);
        assert_eq!(count_ops(&c, |op| matches!(op, Op::Binary(BinaryOp::Sub))), 2);
        let r_new = c.node(c.outputs[0]);
        assert_eq!(r_new.inputs[0], r_new.inputs[1]);
        assert_eq!(c.outputs[1], r_new.inputs[0]);
        c.check().unwrap();
        assert_same_results(&g, &c);
    }

    #[test]
    fn distinct_scalar_slots_and_types_never_merge() {
        let mut g = Graph::new();
        let s0 = g.scalar(DType::F32);
        let s1 = g.scalar(DType::F32);
        let s0_again = g.push(Op::ScalarParam(0), &[]).unwrap();
        let zero_f = g.push(Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]).unwrap();
        let neg_zero_f = g.push(Op::Constant(ScalarValue::Float(-0.0), DType::F32), &[]).unwrap();
        let zero_f64 = g.push(Op::Constant(ScalarValue::Float(0.0), DType::F64), &[]).unwrap();
        g.outputs = vec![s0, s1, s0_again, zero_f, neg_zero_f, zero_f64];
        let (c, merged, _) = run(&g, None);
        assert_eq!(merged, 1);
        assert_eq!(c.outputs[0], c.outputs[2]);
        assert_ne!(c.outputs[0], c.outputs[1]);
        assert_ne!(c.outputs[3], c.outputs[4]);
        assert_ne!(c.outputs[3], c.outputs[5]);
    }

    #[test]
    fn random_merges_only_with_identical_keys() {
        let mut g = Graph::new();
        let seed = g.scalar(DType::U32);
        let step_a = g.scalar(DType::U32);
        let step_b = g.scalar(DType::U32);
        let shape = Shape::new([4]);
        let rand = |d| Op::Random { shape: shape.clone(), dist: d };
        let r1 = g.push(rand(RandomDist::Uniform), &[seed, step_a]).unwrap();
        let r2 = g.push(rand(RandomDist::Uniform), &[seed, step_a]).unwrap();
        let r3 = g.push(rand(RandomDist::Uniform), &[seed, step_b]).unwrap();
        let r4 = g.push(rand(RandomDist::Normal), &[seed, step_a]).unwrap();
        let r5 = g.push(Op::Random { shape: Shape::new([2, 2]), dist: RandomDist::Uniform }, &[seed, step_a]).unwrap();
        g.outputs = vec![r1, r2, r3, r4, r5];
        let (c, merged, _) = run(&g, None);
        assert_eq!(merged, 1);
        assert_eq!(c.outputs[0], c.outputs[1]);
        let distinct: std::collections::HashSet<_> = c.outputs.iter().collect();
        assert_eq!(distinct.len(), 4);
    }
}
