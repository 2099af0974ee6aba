//! Algebraic simplification: peephole rewrites that replace a node by a
//! simpler value of exactly the same shape and dtype.
//!
//! The rewrites, with `c` a splat constant (a rank-0 `Op::Constant`, seen
//! through `Expand` and `Reshape`):
//!
//! - `x * 1`, `1 * x`, `x / 1`, `x - 0`, `x + (-0.0)`: `x`; `x + 0`,
//!   `0 + x`: `x` for integers, for floats only with `finite_math`
//!   (`-0.0 + 0.0` is `+0.0`); `x - (-0.0)` likewise.
//! - `x * 0`, `0 * x`: zeros, for integers; for floats only with
//!   `finite_math` (`inf * 0` and `NaN * 0` are NaN).
//! - `x and true`, `x or false`, `x xor false` (either side): `x`;
//!   `where(true, a, b)`: `a`; `where(false, a, b)`: `b`.
//! - `neg(neg(x))`, `not(not(x))`: `x`.
//! - `permute(permute(x))`: one permute; the identity permute: `x`.
//! - `reshape(reshape(x))`: one reshape; `expand(expand(x))`: one expand;
//!   reshape or expand to the operand's shape, cast to its dtype, and a
//!   slice with step 1 over the whole tensor (not in a size variant:
//!   `PassOptions::sizes_vary`): `x`.
//! - `scatter_add(base, indices, src)` with no indices: `base`.
//!
//! When the surviving operand is smaller than the node (`x * ones` where
//! the ones broadcast `x`), the replacement is `Expand(x, shape)`, never
//! `x` itself. Rewrites look at operands that were already simplified, so
//! chains collapse in one sweep; the nodes they bypass are left for
//! dead-code elimination.

use super::{empty_like, remap, PassOptions};
use crate::{BinaryOp, DType, Graph, NodeId, Op, ScalarValue, UnaryOp, ValueType};

/// Applies the algebraic rewrites once over the graph.
pub fn simplify(graph: &Graph, opts: &PassOptions) -> Graph {
    run(graph, opts).0
}

/// [`simplify`], also returning how many nodes were rewritten and the
/// node each node became.
pub(super) fn run(graph: &Graph, opts: &PassOptions) -> (Graph, usize, Vec<NodeId>) {
    let mut out = empty_like(graph);
    let mut map = Vec::with_capacity(graph.len());
    let mut rewritten = 0;
    for n in graph.nodes() {
        let inputs = remap(&n.inputs, &map);
        let ty = n.ty();
        let id = match rewrite(&mut out, &n.op, &inputs, &ty, opts) {
            Some(id) => {
                debug_assert_eq!(out.node(id).ty(), ty, "simplify changed the type of a {}", n.op.name());
                rewritten += 1;
                id
            }
            None => out.push_typed(n.op.clone(), inputs, ty),
        };
        map.push(id);
    }
    out.outputs = remap(&graph.outputs, &map);
    (out, rewritten, map)
}

/// The replacement of a node `op(inputs) : ty` built in `g`, if any rule
/// applies. Operands already live in `g`.
fn rewrite(g: &mut Graph, op: &Op, inputs: &[NodeId], ty: &ValueType, opts: &PassOptions) -> Option<NodeId> {
    match op {
        Op::Binary(b) => binary(g, *b, inputs[0], inputs[1], ty, opts),
        Op::Where => match splat(g, inputs[0])? {
            ScalarValue::Bool(true) => conform(g, inputs[1], ty),
            ScalarValue::Bool(false) => conform(g, inputs[2], ty),
            _ => None,
        },
        Op::Unary(u @ (UnaryOp::Neg | UnaryOp::Not)) => {
            let inner = g.node(inputs[0]);
            (inner.op == Op::Unary(*u)).then(|| inner.inputs[0])
        }
        Op::Cast(d) => (g.node(inputs[0]).dtype == *d).then_some(inputs[0]),
        Op::Permute(perm) => {
            if is_identity(perm) {
                return Some(inputs[0]);
            }
            let inner = g.node(inputs[0]);
            let Op::Permute(first) = &inner.op else { return None };
            // out.dims[i] = mid.dims[perm[i]] = x.dims[first[perm[i]]].
            let composed: Vec<usize> = perm.iter().map(|&p| first[p]).collect();
            let x = inner.inputs[0];
            if is_identity(&composed) {
                return Some(x);
            }
            Some(g.push_typed(Op::Permute(composed), vec![x], ty.clone()))
        }
        Op::Reshape(shape) | Op::Expand(shape) => {
            let inner = g.node(inputs[0]);
            if inner.shape == *shape {
                return Some(inputs[0]);
            }
            // Reshape of reshape, expand of expand (broadcasting composes).
            let same_kind = std::mem::discriminant(&inner.op) == std::mem::discriminant(op);
            if !same_kind {
                return None;
            }
            let x = inner.inputs[0];
            if g.node(x).shape == *shape {
                return Some(x);
            }
            Some(g.push_typed(op.clone(), vec![x], ty.clone()))
        }
        Op::Slice { starts, steps, lens } => {
            let dims = g.node(inputs[0]).shape.dims();
            let whole = starts.iter().all(|&s| s == 0) && steps.iter().all(|&s| s == 1) && lens == dims;
            (whole && !opts.sizes_vary).then_some(inputs[0])
        }
        // No index, nothing added (an index that exists is kept even when
        // it moves no element: an out-of-range one must still be reported).
        Op::ScatterAdd { .. } => (g.node(inputs[1]).shape.numel() == 0).then_some(inputs[0]),
        _ => None,
    }
}

fn binary(g: &mut Graph, b: BinaryOp, x: NodeId, y: NodeId, ty: &ValueType, opts: &PassOptions) -> Option<NodeId> {
    use BinaryOp::*;
    let (cx, cy) = (splat(g, x), splat(g, y));
    let float = ty.dtype.is_float();
    // The sign-exact identities for floats: x + (-0.0) = x and x - 0.0 = x.
    let add_identity =
        |c: Option<ScalarValue>| c.is_some_and(|c| is_zero(c) && (!float || opts.finite_math || is_neg_zero(c)));
    let sub_identity =
        |c: Option<ScalarValue>| c.is_some_and(|c| is_zero(c) && (!float || opts.finite_math || !is_neg_zero(c)));
    let absorbing_zero = |c: Option<ScalarValue>| c.is_some_and(is_zero) && (ty.dtype.is_int() || opts.finite_math);
    let is = |c: Option<ScalarValue>, v: bool| c == Some(ScalarValue::Bool(v));
    match b {
        Mul if cy.is_some_and(is_one) => conform(g, x, ty),
        Mul if cx.is_some_and(is_one) => conform(g, y, ty),
        Mul if absorbing_zero(cy) => zeros(g, y, ty),
        Mul if absorbing_zero(cx) => zeros(g, x, ty),
        Div if cy.is_some_and(is_one) => conform(g, x, ty),
        Add if add_identity(cy) => conform(g, x, ty),
        Add if add_identity(cx) => conform(g, y, ty),
        Sub if sub_identity(cy) => conform(g, x, ty),
        And if is(cy, true) => conform(g, x, ty),
        And if is(cx, true) => conform(g, y, ty),
        Or | Xor if is(cy, false) => conform(g, x, ty),
        Or | Xor if is(cx, false) => conform(g, y, ty),
        _ => None,
    }
}

/// `x` if it already has type `ty`, else `Expand(x)` to `ty`'s shape when
/// that is a broadcast of the same dtype; `None` otherwise.
fn conform(g: &mut Graph, x: NodeId, ty: &ValueType) -> Option<NodeId> {
    let xt = g.node(x).ty();
    if xt == *ty {
        Some(x)
    } else if xt.dtype == ty.dtype && xt.shape.broadcasts_to(&ty.shape) {
        Some(g.push_typed(Op::Expand(ty.shape.clone()), vec![x], ty.clone()))
    } else {
        None
    }
}

/// Zeros of type `ty`: `zero` itself when it has that type, else a fresh
/// rank-0 zero, expanded when `ty` is not rank-0.
fn zeros(g: &mut Graph, zero: NodeId, ty: &ValueType) -> Option<NodeId> {
    if g.node(zero).ty() == *ty {
        return Some(zero);
    }
    let scalar = ValueType::new(crate::Shape::scalar(), ty.dtype);
    let c = g.push_typed(Op::Constant(ScalarValue::Int(0).cast(ty.dtype), ty.dtype), Vec::new(), scalar);
    conform(g, c, ty)
}

/// The value of a splat constant: a rank-0 `Constant`, possibly behind
/// `Expand` and `Reshape` views.
fn splat(g: &Graph, mut id: NodeId) -> Option<ScalarValue> {
    loop {
        let n = g.node(id);
        match &n.op {
            Op::Constant(v, d) => return Some(canonical(*v, *d)),
            Op::Expand(_) | Op::Reshape(_) => id = n.inputs[0],
            _ => return None,
        }
    }
}

/// The value in the representation of its dtype (a constant may be
/// recorded as, say, `Int(1)` with dtype f32).
fn canonical(v: ScalarValue, d: DType) -> ScalarValue {
    v.cast(d)
}

fn is_one(v: ScalarValue) -> bool {
    match v {
        ScalarValue::Float(f) => f == 1.0,
        ScalarValue::Int(i) => i == 1,
        ScalarValue::UInt(u) => u == 1,
        ScalarValue::Bool(_) => false,
    }
}

fn is_zero(v: ScalarValue) -> bool {
    match v {
        ScalarValue::Float(f) => f == 0.0,
        ScalarValue::Int(i) => i == 0,
        ScalarValue::UInt(u) => u == 0,
        ScalarValue::Bool(_) => false,
    }
}

fn is_neg_zero(v: ScalarValue) -> bool {
    matches!(v, ScalarValue::Float(f) if f == 0.0 && f.is_sign_negative())
}

fn is_identity(perm: &[usize]) -> bool {
    perm.iter().enumerate().all(|(i, &p)| i == p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::dce;
    use crate::passes::test_eval::{assert_same_results, count_ops, same_results};
    use crate::Shape;

    fn c(g: &mut Graph, v: ScalarValue, d: DType) -> NodeId {
        g.push(Op::Constant(v, d), &[]).unwrap()
    }

    fn bin(g: &mut Graph, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
        g.push(Op::Binary(b), &[x, y]).unwrap()
    }

    /// Simplifies with `opts`, checks the graph, the node count drop (after
    /// dce) and that every output is unchanged; returns the clean graph.
    fn check(g: &Graph, opts: &PassOptions) -> Graph {
        let (s, n, _) = run(g, opts);
        s.check().unwrap();
        assert!(n > 0, "nothing rewritten:\n{}", g.to_text());
        let s = dce(&s);
        assert!(s.len() < g.len(), "{} -> {}:\n{}", g.len(), s.len(), s.to_text());
        for (a, b) in g.outputs.iter().zip(&s.outputs) {
            assert_eq!(g.node(*a).ty(), s.node(*b).ty());
        }
        assert_same_results(g, &s);
        s
    }

    #[test]
    fn mul_by_broadcast_one_keeps_the_shape() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([3], DType::F32));
        let one = c(&mut g, ScalarValue::Float(1.0), DType::F32);
        let ones = g.push(Op::Expand(Shape::new([2, 3])), &[one]).unwrap();
        let y = bin(&mut g, BinaryOp::Mul, ones, x);
        // Same-shape case: x * 1 (rank-0 one) is x itself.
        let z = bin(&mut g, BinaryOp::Mul, x, one);
        let w = bin(&mut g, BinaryOp::Div, z, one);
        g.outputs = vec![y, w];
        let s = check(&g, &PassOptions::default());
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Binary(_))), 0, "{}", s.to_text());
        let out = s.node(s.outputs[0]);
        assert_eq!(out.op, Op::Expand(Shape::new([2, 3])));
        assert_eq!(out.shape, Shape::new([2, 3]));
        assert_eq!(s.node(s.outputs[1]).op, Op::Parameter(0));
    }

    #[test]
    fn float_mul_by_zero_is_kept_unless_finite_math() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 2], DType::F32));
        let zero = c(&mut g, ScalarValue::Float(0.0), DType::F32);
        let y = bin(&mut g, BinaryOp::Mul, x, zero);
        g.outputs = vec![y];
        let (s, n, _) = run(&g, &PassOptions::default());
        assert_eq!(n, 0);
        assert_eq!(s, g);
        // The evaluator feeds inf and NaN among the inputs: x * 0 is not 0 there.
        assert_same_results(&g, &s);

        let fast = PassOptions { finite_math: true, ..PassOptions::default() };
        let s = dce(&simplify(&g, &fast));
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Binary(_))), 0);
        let out = s.node(s.outputs[0]);
        assert_eq!((out.op.clone(), out.ty()), (Op::Expand(Shape::new([2, 2])), g.node(y).ty()));
        // And that rewrite is visibly wrong on the evaluator's inf/NaN inputs.
        assert!(same_results(&g, &s).is_err());
    }

    #[test]
    fn integer_mul_by_zero_becomes_zeros() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 3], DType::I32));
        let zero = c(&mut g, ScalarValue::Int(0), DType::I32);
        let zeros = g.push(Op::Expand(Shape::new([2, 3])), &[zero]).unwrap();
        let a = bin(&mut g, BinaryOp::Mul, x, zero);
        let b = bin(&mut g, BinaryOp::Mul, zeros, x);
        let d = bin(&mut g, BinaryOp::Add, a, b);
        g.outputs = vec![d, b];
        let s = check(&g, &PassOptions::default());
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Binary(BinaryOp::Mul))), 0, "{}", s.to_text());
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Parameter(_))), 0);
    }

    #[test]
    fn additive_identities_respect_signed_zero() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([4], DType::F32));
        let i = g.param(ValueType::new([4], DType::I32));
        let pz = c(&mut g, ScalarValue::Float(0.0), DType::F32);
        let nz = c(&mut g, ScalarValue::Float(-0.0), DType::F32);
        let iz = c(&mut g, ScalarValue::Int(0), DType::I32);
        let add_pz = bin(&mut g, BinaryOp::Add, x, pz); // kept: -0.0 + 0.0 = +0.0
        let add_nz = bin(&mut g, BinaryOp::Add, nz, x); // x
        let sub_pz = bin(&mut g, BinaryOp::Sub, x, pz); // x
        let sub_nz = bin(&mut g, BinaryOp::Sub, x, nz); // kept
        let int_add = bin(&mut g, BinaryOp::Add, iz, i); // i
        let int_sub = bin(&mut g, BinaryOp::Sub, i, iz); // i
        let zero_minus = bin(&mut g, BinaryOp::Sub, iz, i); // kept: it is -i
        g.outputs = vec![add_pz, add_nz, sub_pz, sub_nz, int_add, int_sub, zero_minus];
        let s = check(&g, &PassOptions::default());
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Binary(_))), 3, "{}", s.to_text());
        let fast = PassOptions { finite_math: true, ..PassOptions::default() };
        let s = dce(&simplify(&g, &fast));
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Binary(_))), 1, "{}", s.to_text());
        // The evaluator's -0.0 inputs tell the fast-math graph apart.
        assert!(same_results(&g, &s).is_err());
    }

    #[test]
    fn double_negation_and_double_not() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([5], DType::I32));
        let p = g.param(ValueType::new([5], DType::Bool));
        let n1 = g.push(Op::Unary(UnaryOp::Neg), &[x]).unwrap();
        let n2 = g.push(Op::Unary(UnaryOp::Neg), &[n1]).unwrap();
        let n3 = g.push(Op::Unary(UnaryOp::Neg), &[n2]).unwrap();
        let b1 = g.push(Op::Unary(UnaryOp::Not), &[p]).unwrap();
        let b2 = g.push(Op::Unary(UnaryOp::Not), &[b1]).unwrap();
        let t = c(&mut g, ScalarValue::Bool(true), DType::Bool);
        let and = bin(&mut g, BinaryOp::And, b2, t);
        g.outputs = vec![n2, n3, and];
        let s = check(&g, &PassOptions::default());
        assert_eq!(s.node(s.outputs[0]).op, Op::Parameter(0));
        // neg(neg(neg x)) is one neg.
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Unary(UnaryOp::Neg))), 1);
        assert_eq!(s.node(s.outputs[2]).op, Op::Parameter(1));
    }

    #[test]
    fn permute_of_permute_composes() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 3, 4], DType::F32));
        let p1 = g.push(Op::Permute(vec![1, 2, 0]), &[x]).unwrap();
        let p2 = g.push(Op::Permute(vec![2, 0, 1]), &[p1]).unwrap(); // identity overall
        let p3 = g.push(Op::Permute(vec![0, 2, 1]), &[p1]).unwrap();
        let e = g.push(Op::Unary(UnaryOp::Exp), &[p3]).unwrap();
        let id = g.push(Op::Permute(vec![0, 1, 2]), &[x]).unwrap();
        g.outputs = vec![p2, e, id];
        let s = check(&g, &PassOptions::default());
        assert_eq!(s.node(s.outputs[0]).op, Op::Parameter(0));
        assert_eq!(s.node(s.outputs[2]).op, Op::Parameter(0));
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Permute(_))), 1, "{}", s.to_text());
        let exp_in = s.node(s.outputs[1]).inputs[0];
        assert_eq!(s.node(exp_in).op, Op::Permute(vec![1, 0, 2]));
        assert_eq!(s.node(exp_in).inputs[0], s.outputs[0]);
    }

    #[test]
    fn reshape_expand_cast_slice_identities() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([2, 6], DType::F32));
        let r1 = g.push(Op::Reshape(Shape::new([3, 4])), &[x]).unwrap();
        let r2 = g.push(Op::Reshape(Shape::new([12])), &[r1]).unwrap();
        let r3 = g.push(Op::Reshape(Shape::new([12])), &[r2]).unwrap();
        let back = g.push(Op::Reshape(Shape::new([2, 6])), &[r3]).unwrap();
        let y = g.param(ValueType::new([1, 6], DType::F32));
        let e1 = g.push(Op::Expand(Shape::new([2, 6])), &[y]).unwrap();
        let e2 = g.push(Op::Expand(Shape::new([3, 2, 6])), &[e1]).unwrap();
        let e3 = g.push(Op::Expand(Shape::new([3, 2, 6])), &[e2]).unwrap();
        let cast = g.push(Op::Cast(DType::F32), &[back]).unwrap();
        let whole = Op::Slice { starts: vec![0, 0], steps: vec![1, 1], lens: vec![2, 6] };
        let sl = g.push(whole, &[cast]).unwrap();
        let part = Op::Slice { starts: vec![1, 0], steps: vec![1, 2], lens: vec![1, 3] };
        let sl2 = g.push(part, &[x]).unwrap();
        let sum = bin(&mut g, BinaryOp::Add, sl, e3);
        g.outputs = vec![r3, sum, sl2];
        let s = check(&g, &PassOptions::default());
        assert_eq!(s.node(s.outputs[0]).op, Op::Reshape(Shape::new([12])));
        assert_eq!(s.node(s.node(s.outputs[0]).inputs[0]).op, Op::Parameter(0));
        let sum = s.node(s.outputs[1]);
        assert_eq!(s.node(sum.inputs[0]).op, Op::Parameter(0));
        assert_eq!(s.node(sum.inputs[1]).op, Op::Expand(Shape::new([3, 2, 6])));
        assert_eq!(s.node(s.node(sum.inputs[1]).inputs[0]).op, Op::Parameter(1));
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Slice { .. })), 1);
        assert_eq!(count_ops(&s, |op| matches!(op, Op::Cast(_))), 0);
        // In a size variant the whole slice stays (at another size it
        // would not cover its operand); the other identities go as before.
        let v = check(&g, &PassOptions { sizes_vary: true, ..PassOptions::default() });
        assert_eq!(count_ops(&v, |op| matches!(op, Op::Slice { .. })), 2);
        assert_eq!(count_ops(&v, |op| matches!(op, Op::Cast(_))), 0);
        assert_eq!(v.node(v.outputs[0]).op, Op::Reshape(Shape::new([12])));
    }

    #[test]
    fn scatter_add_without_indices_is_its_base() {
        let mut g = Graph::new();
        let base = g.param(ValueType::new([3, 2], DType::F32));
        let none = g.param(ValueType::new([0], DType::I32));
        let src = g.param(ValueType::new([0, 2], DType::F32));
        let s0 = g.push(Op::ScatterAdd { axis: 0 }, &[base, none, src]).unwrap();
        // An index that moves no element (inner dim 0) stays: it may be out of range.
        let empty = g.param(ValueType::new([3, 0], DType::F32));
        let zero = c(&mut g, ScalarValue::Int(0), DType::I32);
        let one = g.push(Op::Expand(Shape::new([1])), &[zero]).unwrap();
        let src1 = g.param(ValueType::new([1, 0], DType::F32));
        let s1 = g.push(Op::ScatterAdd { axis: 0 }, &[empty, one, src1]).unwrap();
        g.outputs = vec![s0, s1];
        let s = check(&g, &PassOptions::default());
        assert_eq!(s.node(s.outputs[0]).op, Op::Parameter(0));
        assert_eq!(count_ops(&s, |op| matches!(op, Op::ScatterAdd { .. })), 1, "{}", s.to_text());
    }

    #[test]
    fn where_with_constant_condition_picks_a_branch() {
        let mut g = Graph::new();
        let a = g.param(ValueType::new([3], DType::F32));
        let b = g.param(ValueType::new([2, 3], DType::F32));
        let t = c(&mut g, ScalarValue::Bool(true), DType::Bool);
        let w = g.push(Op::Where, &[t, a, b]).unwrap();
        g.outputs = vec![w];
        let s = check(&g, &PassOptions::default());
        assert_eq!(s.node(s.outputs[0]).op, Op::Expand(Shape::new([2, 3])));
    }
}
