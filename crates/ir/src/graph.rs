//! The arena graph ([`Graph`]): nodes in topological order addressed by
//! typed [`NodeId`]s, a parameter table, a scalar table and the outputs.
//!
//! Operands always precede their users, so passes are forward loops. A
//! graph is built with [`Graph::push`], which infers and checks each node's
//! type; [`Graph::verify`] re-checks everything and returns a
//! [`VerifiedGraph`], the proof that lowering requires.

use crate::hash::StableHasher;
use crate::{DType, IrError, Op, Shape, ValueType};
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Index of a node in its [`Graph`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The index as usize.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One node: an op applied to earlier nodes, with its inferred type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Operands, all earlier in the graph.
    pub inputs: Vec<NodeId>,
    /// Result shape.
    pub shape: Shape,
    /// Result dtype.
    pub dtype: DType,
}

impl Node {
    /// The node's value type.
    pub fn ty(&self) -> ValueType {
        ValueType { shape: self.shape.clone(), dtype: self.dtype }
    }
}

/// A graph in topological order with its inputs (parameters and lifted
/// scalars) and outputs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Graph {
    nodes: Vec<Node>,
    /// Types of the graph inputs; `Op::Parameter(i)` reads entry `i`.
    pub params: Vec<ValueType>,
    /// Dtypes of the lifted scalars; `Op::ScalarParam(i)` reads entry `i`.
    pub scalars: Vec<DType>,
    /// Nodes whose values the graph produces, in order (may repeat).
    pub outputs: Vec<NodeId>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Adds a graph input of the given type and returns its `Parameter` node.
    pub fn param(&mut self, ty: ValueType) -> NodeId {
        let i = self.params.len() as u32;
        self.params.push(ty.clone());
        self.push_typed(Op::Parameter(i), Vec::new(), ty)
    }

    /// Adds a lifted scalar slot of `dtype` and returns its node.
    pub fn scalar(&mut self, dtype: DType) -> NodeId {
        let i = self.scalars.len() as u32;
        self.scalars.push(dtype);
        self.push_typed(Op::ScalarParam(i), Vec::new(), ValueType::new(Shape::scalar(), dtype))
    }

    /// Appends a node after inferring its type; operands must exist.
    pub fn push(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, IrError> {
        let n = self.nodes.len();
        if let Some(bad) = inputs.iter().find(|i| i.index() >= n) {
            return Err(IrError::Verify { node: n, detail: format!("operand {bad} does not precede the node") });
        }
        let tys: Vec<ValueType> = inputs.iter().map(|i| self.nodes[i.index()].ty()).collect();
        let ty = op.infer(&tys, &self.params, &self.scalars)?;
        Ok(self.push_typed(op, inputs.to_vec(), ty))
    }

    /// Appends a node whose type the caller already knows (passes use this
    /// when they copy nodes; [`Graph::verify`] re-checks it).
    pub fn push_typed(&mut self, op: Op, inputs: Vec<NodeId>, ty: ValueType) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        self.nodes.push(Node { op, inputs, shape: ty.shape, dtype: ty.dtype });
        id
    }

    /// Makes room for `additional` more nodes.
    pub fn reserve(&mut self, additional: usize) {
        self.nodes.reserve(additional);
    }

    /// All nodes, in topological order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// One node.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True when the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node ids in order.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.nodes.len() as u32).map(NodeId)
    }

    /// For each node, how many times it is used as an operand or output.
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for i in &n.inputs {
                uses[i.index()] += 1;
            }
        }
        for o in &self.outputs {
            uses[o.index()] += 1;
        }
        uses
    }

    /// For each node, the nodes that use it as an operand (each once).
    pub fn users(&self) -> Vec<Vec<NodeId>> {
        let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); self.nodes.len()];
        for (id, n) in self.nodes.iter().enumerate() {
            for i in &n.inputs {
                let list = &mut users[i.index()];
                if list.last() != Some(&NodeId(id as u32)) {
                    list.push(NodeId(id as u32));
                }
            }
        }
        users
    }

    /// Structural hash of the whole graph: ops, attributes, types, wiring,
    /// parameter and scalar tables and outputs. Never data or scalar values.
    pub fn structural_hash(&self) -> u64 {
        let mut h = StableHasher::new();
        self.hash(&mut h);
        h.finish()
    }

    /// Hash of the graph's structure without its sizes: each node's op
    /// name, dtype, rank and operands, and the outputs. Graphs that differ
    /// only in sizes (a growing sequence, a partial batch) share it; so may
    /// graphs that differ in an attribute (an axis, a permutation), which
    /// is fine for its use: a hint that sizes vary, never a cache key.
    pub fn shape_free_hash(&self) -> u64 {
        let mut h = StableHasher::new();
        for n in &self.nodes {
            n.op.name().hash(&mut h);
            n.dtype.hash(&mut h);
            n.shape.rank().hash(&mut h);
            n.inputs.hash(&mut h);
        }
        self.outputs.hash(&mut h);
        h.finish()
    }

    /// Re-infers every node's type and checks topological order, returning
    /// the proof that lowering requires.
    pub fn verify(self) -> Result<VerifiedGraph, IrError> {
        self.check()?;
        Ok(VerifiedGraph(self))
    }

    /// The checks behind [`Graph::verify`], without consuming the graph.
    pub fn check(&self) -> Result<(), IrError> {
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(bad) = n.inputs.iter().find(|x| x.index() >= i) {
                return Err(IrError::Verify { node: i, detail: format!("operand {bad} does not precede the node") });
            }
            let tys: Vec<ValueType> = n.inputs.iter().map(|x| self.nodes[x.index()].ty()).collect();
            let ty =
                n.op.infer(&tys, &self.params, &self.scalars)
                    .map_err(|e| IrError::Verify { node: i, detail: e.to_string() })?;
            if ty != n.ty() {
                return Err(IrError::Verify {
                    node: i,
                    detail: format!(
                        "{} recorded as {} {} but infers {} {}",
                        n.op.name(),
                        n.dtype,
                        n.shape,
                        ty.dtype,
                        ty.shape
                    ),
                });
            }
        }
        if let Some(o) = self.outputs.iter().find(|o| o.index() >= self.nodes.len()) {
            return Err(IrError::Verify { node: o.index(), detail: "output does not exist".into() });
        }
        Ok(())
    }

    /// Human-readable text dump, one node per line:
    /// `%3 = add(%1, %2) : f32[4, 4]`.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (i, ty) in self.params.iter().enumerate() {
            let _ = writeln!(s, "param #{i} : {}{}", ty.dtype, ty.shape);
        }
        for (i, d) in self.scalars.iter().enumerate() {
            let _ = writeln!(s, "scalar #{i} : {d}");
        }
        for (i, n) in self.nodes.iter().enumerate() {
            let args = n.inputs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
            let _ = writeln!(s, "%{i} = {}({args}) : {}{}", describe(&n.op), n.dtype, n.shape);
        }
        let outs = self.outputs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
        let _ = writeln!(s, "outputs: {outs}");
        s
    }

    /// Graphviz DOT rendering of the graph.
    pub fn to_dot(&self) -> String {
        let mut s = String::from("digraph lazuli {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n");
        for (i, n) in self.nodes.iter().enumerate() {
            let color = if n.op.is_leaf() {
                "lightblue"
            } else if n.op.is_elementwise() {
                "white"
            } else if n.op.is_view() {
                "lightyellow"
            } else {
                "lightpink"
            };
            let label = format!("%{i} {}\\n{}{}", describe(&n.op).replace('"', "'"), n.dtype, n.shape);
            let _ = writeln!(s, "  n{i} [label=\"{label}\", style=filled, fillcolor={color}];");
            for x in &n.inputs {
                let _ = writeln!(s, "  n{} -> n{i};", x.0);
            }
        }
        for (k, o) in self.outputs.iter().enumerate() {
            let _ = writeln!(s, "  out{k} [label=\"output {k}\", shape=ellipse];\n  n{} -> out{k};", o.0);
        }
        s.push_str("}\n");
        s
    }
}

/// A one-line description of an op with its attributes.
pub fn describe(op: &Op) -> String {
    match op {
        Op::Parameter(i) => format!("parameter #{i}"),
        Op::Constant(v, _) => format!("constant {v}"),
        Op::ScalarParam(i) => format!("scalar #{i}"),
        Op::Iota { axis, .. } => format!("iota axis={axis}"),
        Op::Cast(d) => format!("cast to {d}"),
        Op::Reduce { op, axes, keepdim } => format!("reduce_{} axes={axes:?} keepdim={keepdim}", op.name()),
        Op::ArgReduce { axis, keepdim, select_last, .. } => {
            format!("{} axis={axis} keepdim={keepdim} select_last={select_last}", op.name())
        }
        Op::CumSum { axis, exclusive, reverse } => {
            format!("cumsum axis={axis} exclusive={exclusive} reverse={reverse}")
        }
        Op::Softmax { axis, .. } => format!("{} axis={axis}", op.name()),
        Op::Reshape(s) => format!("reshape {s}"),
        Op::Permute(p) => format!("permute {p:?}"),
        Op::Expand(s) => format!("expand {s}"),
        Op::Slice { starts, steps, lens } => format!("slice starts={starts:?} steps={steps:?} lens={lens:?}"),
        Op::Concat { axis } => format!("concat axis={axis}"),
        Op::Pad { before, after, mode } => format!("pad {mode:?} before={before:?} after={after:?}"),
        Op::Gather { axis } => format!("gather axis={axis}"),
        Op::ScatterAdd { axis } => format!("scatter_add axis={axis}"),
        Op::Conv2d(c) => {
            format!("conv2d strides={:?} pads={:?} dilations={:?} groups={}", c.strides, c.pads, c.dilations, c.groups)
        }
        Op::Pool(p) | Op::PoolGrad(p) => format!(
            "{} kernel={:?} strides={:?} pads={:?}/{:?}",
            op.name(),
            p.kernel,
            p.strides,
            p.pads_begin,
            p.pads_end
        ),
        Op::Attention { attrs, .. } => format!("{} causal={} mask={:?}", op.name(), attrs.causal, attrs.mask),
        Op::AllReduce { bucket, .. } => format!("{} bucket={bucket}", op.name()),
        Op::Dequantize(f) | Op::QuantMatMul(f) => format!("{} {f}", op.name()),
        Op::WriteAt { axis } => format!("write_at axis={axis}"),
        other => other.name(),
    }
}

/// A graph that passed [`Graph::verify`]; lowering takes this type so an
/// unchecked graph cannot reach code generation.
#[derive(Clone, Debug)]
pub struct VerifiedGraph(Graph);

impl VerifiedGraph {
    /// Gives the graph back (e.g. to run another pass, then verify again).
    pub fn into_inner(self) -> Graph {
        self.0
    }
}

impl Deref for VerifiedGraph {
    type Target = Graph;
    fn deref(&self) -> &Graph {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, UnaryOp};

    #[test]
    fn build_verify_hash_dump() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 3], DType::F32));
        let s = g.scalar(DType::F32);
        let y = g.push(Op::Binary(BinaryOp::Mul), &[x, s]).unwrap();
        let z = g.push(Op::Unary(UnaryOp::Tanh), &[y]).unwrap();
        g.outputs.push(z);
        let h1 = g.structural_hash();
        let text = g.to_text();
        assert!(text.contains("%2 = mul(%0, %1) : f32[2, 3]"), "{text}");
        assert!(g.to_dot().starts_with("digraph"));
        let v = g.clone().verify().unwrap();
        assert_eq!(v.len(), 4);
        let mut g2 = g.clone();
        g2.outputs.push(y);
        assert_ne!(g2.structural_hash(), h1);
        assert_eq!(g.structural_hash(), h1);
    }

    /// Scatter-add and pooling-gradient attributes are part of the hash
    /// and the dump: a different axis or pooling kind is another graph.
    #[test]
    fn scatter_add_and_pool_grad_hash_their_attributes() {
        let scatter = |axis: usize| {
            let mut g = Graph::new();
            let b = g.param(ValueType::new([3, 3], DType::F32));
            let i = g.param(ValueType::new([3], DType::I32));
            let s = g.param(ValueType::new([3, 3], DType::F32));
            let o = g.push(Op::ScatterAdd { axis }, &[b, i, s]).unwrap();
            g.outputs.push(o);
            g
        };
        let (a0, a1) = (scatter(0), scatter(1));
        assert_ne!(a0.structural_hash(), a1.structural_hash());
        assert_eq!(a0.structural_hash(), scatter(0).structural_hash());
        assert!(a1.to_text().contains("scatter_add axis=1"), "{}", a1.to_text());
        let pool_grad = |kind: crate::PoolKind| {
            let mut g = Graph::new();
            let x = g.param(ValueType::new([1, 1, 4, 4], DType::F32));
            let gy = g.param(ValueType::new([1, 1, 2, 2], DType::F32));
            let o = g.push(Op::PoolGrad(crate::PoolAttrs::new(kind, &[2, 2])), &[x, gy]).unwrap();
            g.outputs.push(o);
            g
        };
        let m = pool_grad(crate::PoolKind::Max);
        let a = pool_grad(crate::PoolKind::Avg { count_include_pad: false });
        assert_ne!(m.structural_hash(), a.structural_hash());
        assert!(m.to_text().contains("max_pool_grad kernel=[2, 2]"), "{}", m.to_text());
    }

    #[test]
    fn verify_catches_wrong_type() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2], DType::F32));
        g.push_typed(Op::Unary(UnaryOp::Exp), vec![x], ValueType::new([3], DType::F32));
        assert!(matches!(g.verify(), Err(IrError::Verify { .. })));
    }
}
