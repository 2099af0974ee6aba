//! Dead-code elimination: drops every node no output depends on.
//!
//! Liveness is one backward sweep (operands precede users, so a reverse
//! loop sees every user before its operands); the rebuild is one forward
//! sweep that copies live nodes and remaps ids. The parameter and scalar
//! tables are kept whole even when a parameter node dies, so the indices
//! the executor binds stay valid.

use super::{empty_like, remap};
use crate::{Graph, NodeId};

/// Removes the nodes that no output reaches.
pub fn dce(graph: &Graph) -> Graph {
    run(graph).0
}

/// [`dce`], also returning how many nodes were removed.
pub(super) fn run(graph: &Graph) -> (Graph, usize, Vec<NodeId>) {
    let mut live = vec![false; graph.len()];
    for o in &graph.outputs {
        live[o.index()] = true;
    }
    for (i, n) in graph.nodes().iter().enumerate().rev() {
        if live[i] {
            for x in &n.inputs {
                live[x.index()] = true;
            }
        }
    }
    let mut out = empty_like(graph);
    // Dead entries keep a placeholder; no live node refers to them.
    let mut map = vec![NodeId(u32::MAX); graph.len()];
    for (i, n) in graph.nodes().iter().enumerate() {
        if live[i] {
            map[i] = out.push_typed(n.op.clone(), remap(&n.inputs, &map), n.ty());
        }
    }
    out.outputs = remap(&graph.outputs, &map);
    let removed = graph.len() - out.len();
    (out, removed, map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::test_eval::assert_same_results;
    use crate::{BinaryOp, DType, Op, UnaryOp, ValueType};

    #[test]
    fn removes_unused_nodes_and_keeps_tables_and_outputs() {
        let mut g = Graph::new();
        let unused_param = g.param(ValueType::new([4], DType::F32));
        let x = g.param(ValueType::new([4], DType::F32));
        let s = g.scalar(DType::F32);
        let dead = g.push(Op::Unary(UnaryOp::Exp), &[unused_param]).unwrap();
        g.push(Op::Binary(BinaryOp::Add), &[dead, x]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Mul), &[x, s]).unwrap();
        let z = g.push(Op::Unary(UnaryOp::Neg), &[y]).unwrap();
        g.outputs = vec![z, y, z];

        let d = dce(&g);
        assert_eq!(g.len(), 7);
        assert_eq!(d.len(), 4, "{}", d.to_text());
        assert_eq!(d.params, g.params);
        assert_eq!(d.scalars, g.scalars);
        // Parameter #1 keeps its index although parameter #0 is gone.
        assert_eq!(d.node(NodeId(0)).op, Op::Parameter(1));
        assert_eq!(d.outputs.len(), 3);
        assert_eq!(d.outputs[0], d.outputs[2]);
        assert_eq!(d.node(d.outputs[0]).op, Op::Unary(UnaryOp::Neg));
        assert_eq!(d.node(d.outputs[1]).op, Op::Binary(BinaryOp::Mul));
        d.check().unwrap();
        assert_same_results(&g, &d);
        assert_eq!(run(&d).1, 0);
    }

    #[test]
    fn graph_without_outputs_becomes_empty() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2], DType::I32));
        g.push(Op::Unary(UnaryOp::Abs), &[x]).unwrap();
        let d = dce(&g);
        assert!(d.is_empty());
        assert_eq!(d.params.len(), 1);
    }
}
