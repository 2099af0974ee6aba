//! Constant folding: an elementwise node whose operands are all rank-0
//! `Op::Constant`s becomes one `Op::Constant`.
//!
//! Values are computed at full width by the reference semantics
//! ([`crate::semantics`], which the CPU backend uses too): floats in `f64`
//! (then rounded to the node dtype), signed integers in wrapping `i64`,
//! unsigned in wrapping `u64`, so that the final [`ScalarValue::cast`] to
//! the node dtype wraps exactly as the narrow type would. Where the op
//! docs leave a result unspecified (integer `%` by zero, a negative
//! integer power), the node is left alone rather than guessed.
//!
//! Views of constants (`Expand`, `Reshape`) are not folded: the constant
//! stays rank-0 and the view stays, which is what code generation wants.
//!
//! A folded value may be a non-special number (say `1 + 1 = 2`). That
//! does not hurt compile-cache reuse: it is derived only from constants
//! already baked into the graph, so it is part of the graph's hash anyway.

use super::{empty_like, remap};
use crate::{semantics, DType, Graph, Node, NodeId, Op, ScalarValue};

/// Replaces elementwise nodes of constant operands by their value.
pub fn fold(graph: &Graph) -> Graph {
    run(graph).0
}

/// [`fold`], also returning how many nodes were folded.
pub(super) fn run(graph: &Graph) -> (Graph, usize, Vec<NodeId>) {
    let mut out = empty_like(graph);
    let mut map = Vec::with_capacity(graph.len());
    let mut folded = 0;
    for n in graph.nodes() {
        let inputs = remap(&n.inputs, &map);
        let value = if n.op.is_elementwise() && n.shape.rank() == 0 {
            let consts: Option<Vec<(ScalarValue, DType)>> = inputs.iter().map(|&i| constant(out.node(i))).collect();
            consts.and_then(|c| eval(&n.op, &c))
        } else {
            None
        };
        let id = match value {
            Some(v) => {
                folded += 1;
                out.push_typed(Op::Constant(v.cast(n.dtype), n.dtype), Vec::new(), n.ty())
            }
            None => out.push_typed(n.op.clone(), inputs, n.ty()),
        };
        map.push(id);
    }
    out.outputs = remap(&graph.outputs, &map);
    (out, folded, map)
}

/// The value and dtype of a rank-0 constant node.
fn constant(n: &Node) -> Option<(ScalarValue, DType)> {
    match n.op {
        Op::Constant(v, d) if n.shape.rank() == 0 => Some((v, d)),
        _ => None,
    }
}

/// Evaluates an elementwise op on constant operands; `None` when the op
/// is not folded. The result is not yet cast to the node dtype.
fn eval(op: &Op, args: &[(ScalarValue, DType)]) -> Option<ScalarValue> {
    match (op, args) {
        (Op::Unary(u), &[(x, d)]) => semantics::eval_unary(*u, x, d),
        (Op::Binary(b), &[(x, d), (y, _)]) => semantics::eval_binary(*b, x, y, d),
        (Op::Where, &[(c, _), (a, _), (b, _)]) => Some(if c.as_bool() { a } else { b }),
        (Op::Cast(to), &[(x, from)]) => Some(cast(x, from, *to)),
        _ => None,
    }
}

/// `Op::Cast`: float -> integer truncates toward zero and saturates (NaN
/// gives 0); every other conversion is [`ScalarValue::cast`].
fn cast(x: ScalarValue, from: DType, to: DType) -> ScalarValue {
    if !from.is_float() || !to.is_int() {
        return x.cast(to);
    }
    let v = x.as_f64();
    // Rust's float-to-int `as` truncates, saturates and maps NaN to 0.
    match to {
        DType::I8 => ScalarValue::Int(v as i8 as i64),
        DType::I16 => ScalarValue::Int(v as i16 as i64),
        DType::I32 => ScalarValue::Int(v as i32 as i64),
        DType::I64 => ScalarValue::Int(v as i64),
        DType::U8 => ScalarValue::UInt(v as u8 as u64),
        DType::U16 => ScalarValue::UInt(v as u16 as u64),
        DType::U32 => ScalarValue::UInt(v as u32 as u64),
        _ => ScalarValue::UInt(v as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::passes::test_eval::{assert_same_results, count_ops};
    use crate::{BinaryOp, UnaryOp};
    use crate::{NodeId, Shape, ValueType};

    fn c(g: &mut Graph, v: ScalarValue, d: DType) -> NodeId {
        g.push(Op::Constant(v, d), &[]).unwrap()
    }

    fn constant_of(g: &Graph, id: NodeId) -> ScalarValue {
        match g.node(id).op {
            Op::Constant(v, _) => v,
            ref other => panic!("expected a constant, got {other:?}"),
        }
    }

    #[test]
    fn folds_float_arithmetic_chains() {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([3], DType::F32));
        let one = c(&mut g, ScalarValue::Float(1.0), DType::F32);
        let m1 = c(&mut g, ScalarValue::Float(-1.0), DType::F32);
        let two = g.push(Op::Binary(BinaryOp::Add), &[one, one]).unwrap();
        let half = g.push(Op::Binary(BinaryOp::Div), &[one, two]).unwrap();
        let e = g.push(Op::Unary(UnaryOp::Exp), &[half]).unwrap();
        let k = g.push(Op::Binary(BinaryOp::Mul), &[e, m1]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Mul), &[x, k]).unwrap();
        g.outputs = vec![y, k];

        let (f, n, _) = run(&g);
        assert_eq!(n, 4);
        let f = crate::passes::dce(&f);
        // x, the folded constant, and the multiply.
        assert_eq!(f.len(), 3, "{}", f.to_text());
        assert_eq!(constant_of(&f, f.outputs[1]), ScalarValue::Float(-(0.5f64.exp()) as f32 as f64));
        assert_same_results(&g, &f);
    }

    #[test]
    fn folds_integers_with_wrap_and_truncation() {
        let mut g = Graph::new();
        let max = c(&mut g, ScalarValue::Int(i32::MAX as i64), DType::I32);
        let one = c(&mut g, ScalarValue::Int(1), DType::I32);
        let zero = c(&mut g, ScalarValue::Int(0), DType::I32);
        let m7 = c(&mut g, ScalarValue::Int(-7), DType::I32);
        let two = g.push(Op::Binary(BinaryOp::Add), &[one, one]).unwrap();
        let wrapped = g.push(Op::Binary(BinaryOp::Add), &[max, one]).unwrap();
        let prod = g.push(Op::Binary(BinaryOp::Mul), &[max, max]).unwrap();
        let quot = g.push(Op::Binary(BinaryOp::Div), &[m7, two]).unwrap();
        let by_zero = g.push(Op::Binary(BinaryOp::Div), &[m7, zero]).unwrap();
        let modulo = g.push(Op::Binary(BinaryOp::Mod), &[m7, two]).unwrap();
        let rem = g.push(Op::Binary(BinaryOp::Rem), &[m7, two]).unwrap();
        let neg_min = g.push(Op::Unary(UnaryOp::Neg), &[wrapped]).unwrap();
        let lt = g.push(Op::Binary(BinaryOp::Lt), &[wrapped, zero]).unwrap();
        let u8_of = g.push(Op::Cast(DType::U8), &[max]).unwrap();
        g.outputs = vec![wrapped, prod, quot, by_zero, modulo, rem, neg_min, lt, u8_of];

        let f = crate::passes::dce(&fold(&g));
        assert!(f.len() < g.len());
        assert_eq!(count_ops(&f, |op| !matches!(op, Op::Constant(..))), 0, "{}", f.to_text());
        let got: Vec<ScalarValue> = f.outputs.iter().map(|&o| constant_of(&f, o)).collect();
        let want = [
            ScalarValue::Int(i32::MIN as i64),
            ScalarValue::Int(1),
            ScalarValue::Int(-3),
            ScalarValue::Int(0),
            ScalarValue::Int(1),
            ScalarValue::Int(-1),
            ScalarValue::Int(i32::MIN as i64),
            ScalarValue::Bool(true),
            ScalarValue::UInt(255),
        ];
        assert_eq!(got, want);
        assert_same_results(&g, &f);
    }

    #[test]
    fn float_to_int_cast_saturates_and_nan_is_zero() {
        let mut g = Graph::new();
        let big = c(&mut g, ScalarValue::Float(1e10), DType::F32);
        let nan = c(&mut g, ScalarValue::Float(f64::NAN), DType::F32);
        let m = c(&mut g, ScalarValue::Float(-2.7), DType::F32);
        let a = g.push(Op::Cast(DType::I32), &[big]).unwrap();
        let b = g.push(Op::Cast(DType::I32), &[nan]).unwrap();
        let t = g.push(Op::Cast(DType::I32), &[m]).unwrap();
        let isnan = g.push(Op::Unary(UnaryOp::IsNan), &[nan]).unwrap();
        g.outputs = vec![a, b, t, isnan];
        let f = fold(&g);
        let got: Vec<ScalarValue> = f.outputs.iter().map(|&o| constant_of(&f, o)).collect();
        let want =
            [ScalarValue::Int(i32::MAX as i64), ScalarValue::Int(0), ScalarValue::Int(-2), ScalarValue::Bool(true)];
        assert_eq!(got, want);
        assert_same_results(&g, &f);
    }

    #[test]
    fn folds_gelu_and_erf_with_the_reference() {
        let mut g = Graph::new();
        let one = c(&mut g, ScalarValue::Float(1.0), DType::F32);
        let gelu = g.push(Op::Unary(UnaryOp::Gelu), &[one]).unwrap();
        let erf = g.push(Op::Unary(UnaryOp::Erf), &[one]).unwrap();
        g.outputs = vec![gelu, erf];
        let (f, n, _) = run(&g);
        assert_eq!(n, 2);
        let got: Vec<ScalarValue> = f.outputs.iter().map(|&o| constant_of(&f, o)).collect();
        let want = [0.841_344_746_068_542_9f64 as f32 as f64, 0.842_700_792_949_714_9f64 as f32 as f64];
        assert_eq!(got, want.map(ScalarValue::Float));
    }

    #[test]
    fn unspecified_results_and_views_are_left_alone() {
        let mut g = Graph::new();
        let one = c(&mut g, ScalarValue::Int(1), DType::I32);
        let zero = c(&mut g, ScalarValue::Int(0), DType::I32);
        let rem0 = g.push(Op::Binary(BinaryOp::Rem), &[one, zero]).unwrap();
        let e = g.push(Op::Expand(Shape::new([2, 2])), &[one]).unwrap();
        // Elementwise but not rank-0: the view of a constant is no constant.
        let a = g.push(Op::Binary(BinaryOp::Add), &[e, one]).unwrap();
        g.outputs = vec![rem0, e, a];
        let (f, n, _) = run(&g);
        assert_eq!(n, 0);
        assert_eq!(f, g);
    }
}
