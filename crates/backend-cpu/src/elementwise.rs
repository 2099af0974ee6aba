//! Elementwise kernels: unary functions, binary functions with numpy
//! broadcasting, `where`, and casts.
//!
//! Float transcendental functions are evaluated in `f64` and rounded to the
//! element type, so f16 and f32 results are as accurate as the reference
//! can make them. Basic float arithmetic (`+ - * /`) runs in the element
//! type itself (f16 through f32, which rounds identically).

use crate::elem::{CastVal, Elem, Float, Num};
use crate::layout::{broadcast_strides, walk};
use crate::storage::{each_all, each_num2, same_all2, same_float, same_num, CpuData};
use lazuli_ir::{BinaryOp, DType, UnaryOp};

/// Applies `f` to every pair of elements of `a` (shape `sa`) and `b`
/// (shape `sb`) broadcast to `out`.
pub(crate) fn map2<A: Copy, B: Copy, U>(
    a: &[A],
    sa: &[usize],
    b: &[B],
    sb: &[usize],
    out: &[usize],
    f: impl Fn(A, B) -> U,
) -> Vec<U> {
    if sa == out && sb == out {
        return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
    }
    if b.len() == 1 && sa == out {
        let y = b[0];
        return a.iter().map(|&x| f(x, y)).collect();
    }
    if a.len() == 1 && sb == out {
        let x = a[0];
        return b.iter().map(|&y| f(x, y)).collect();
    }
    let n: usize = out.iter().product();
    let mut v = Vec::with_capacity(n);
    let (ta, tb) = (broadcast_strides(sa, out), broadcast_strides(sb, out));
    walk(out, [&ta, &tb], |[i, j]| v.push(f(a[i], b[j])));
    v
}

/// Applies a unary op to `x`.
pub(crate) fn unary(op: UnaryOp, x: &CpuData) -> CpuData {
    use UnaryOp::*;
    match op {
        Not => match x {
            CpuData::Bool(v) => CpuData::Bool(v.iter().map(|&b| (b == 0) as u8).collect()),
            _ => unreachable!("logical_not on a non-bool in a verified graph"),
        },
        IsNan => CpuData::Bool(each_float(x, |v| v.is_nan())),
        IsInf => CpuData::Bool(each_float(x, |v| v.is_infinite())),
        Neg => same_num!(x, v => v.iter().map(|&e| Num::neg(e)).collect()),
        Abs => same_num!(x, v => v.iter().map(|&e| Num::abs(e)).collect()),
        Sign => same_num!(x, v => v.iter().map(|&e| Num::sign(e)).collect()),
        Relu => same_num!(x, v => v.iter().map(|&e| Num::maximum(e, Num::ZERO)).collect()),
        _ => {
            let f = float_fn(op);
            same_float!(x, v => v.iter().map(|&e| Float::from_f64(f(Float::to_f64(e)))).collect())
        }
    }
}

/// A float predicate over any float variant, as bool bytes.
fn each_float(x: &CpuData, f: impl Fn(f64) -> bool) -> Vec<u8> {
    match x {
        CpuData::F16(v) => v.iter().map(|&e| f(e.to_f64()) as u8).collect(),
        CpuData::F32(v) => v.iter().map(|&e| f(e as f64) as u8).collect(),
        CpuData::F64(v) => v.iter().map(|&e| f(e) as u8).collect(),
        _ => unreachable!("float predicate on a non-float in a verified graph"),
    }
}

/// The `f64` definition of a float unary function.
fn float_fn(op: UnaryOp) -> fn(f64) -> f64 {
    use UnaryOp::*;
    match op {
        Exp => f64::exp,
        Log => f64::ln,
        Sqrt => f64::sqrt,
        Rsqrt => |x| 1.0 / x.sqrt(),
        Reciprocal => |x| 1.0 / x,
        Sigmoid => |x| 1.0 / (1.0 + (-x).exp()),
        Tanh => f64::tanh,
        // 0.5 x erfc(-x / sqrt 2) equals x Phi(x) without cancellation for
        // large negative x.
        Gelu => |x| 0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2),
        GeluTanh => |x| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        },
        Erf => libm::erf,
        Sin => f64::sin,
        Cos => f64::cos,
        Floor => f64::floor,
        Ceil => f64::ceil,
        Round => f64::round_ties_even,
        Neg | Abs | Relu | Sign | Not | IsNan | IsInf => unreachable!("handled by unary()"),
    }
}

/// Applies a binary op with broadcasting; `out` is the result shape.
pub(crate) fn binary(op: BinaryOp, a: &CpuData, sa: &[usize], b: &CpuData, sb: &[usize], out: &[usize]) -> CpuData {
    use BinaryOp::*;
    let cmp = |f: fn(std::cmp::Ordering) -> bool, eq_nan: bool| -> CpuData {
        // `partial_cmp` is None only when a NaN is involved: every comparison
        // is then false except `!=`.
        CpuData::Bool(match (a, b) {
            (CpuData::Bool(x), CpuData::Bool(y)) => map2(x, sa, y, sb, out, |p, q| f(p.cmp(&q)) as u8),
            _ => each_num2!(a, b, x, y => map2(x, sa, y, sb, out, |p, q| p.partial_cmp(&q).map_or(eq_nan, f) as u8)),
        })
    };
    let logic = |f: fn(bool, bool) -> bool| -> CpuData {
        match (a, b) {
            (CpuData::Bool(x), CpuData::Bool(y)) => {
                CpuData::Bool(map2(x, sa, y, sb, out, |p, q| f(p != 0, q != 0) as u8))
            }
            _ => unreachable!("logical op on non-bool in a verified graph"),
        }
    };
    // One monomorphic loop per (op, dtype), so the element function inlines.
    macro_rules! arith {
        ($f:ident) => {
            same_all2!(a, b, x, y => map2(x, sa, y, sb, out, |p, q| Num::$f(p, q)))
        };
    }
    match op {
        Eq => cmp(|o| o.is_eq(), false),
        Ne => cmp(|o| o.is_ne(), true),
        Lt => cmp(|o| o.is_lt(), false),
        Le => cmp(|o| o.is_le(), false),
        Gt => cmp(|o| o.is_gt(), false),
        Ge => cmp(|o| o.is_ge(), false),
        And => logic(|p, q| p && q),
        Or => logic(|p, q| p || q),
        Xor => logic(|p, q| p != q),
        Add => arith!(add),
        Sub => arith!(sub),
        Mul => arith!(mul),
        Div => arith!(div),
        Pow => arith!(pow),
        Maximum => arith!(maximum),
        Minimum => arith!(minimum),
        Mod => arith!(modulo),
        Rem => arith!(rem),
    }
}

/// Evaluates `where(cond, a, b)` with three-way broadcasting.
pub(crate) fn select(
    c: &CpuData,
    sc: &[usize],
    a: &CpuData,
    sa: &[usize],
    b: &CpuData,
    sb: &[usize],
    out: &[usize],
) -> CpuData {
    let CpuData::Bool(cv) = c else { unreachable!("where condition is bool in a verified graph") };
    same_all2!(a, b, x, y => select_typed(cv, sc, x, sa, y, sb, out))
}

fn select_typed<T: Copy>(
    c: &[u8],
    sc: &[usize],
    a: &[T],
    sa: &[usize],
    b: &[T],
    sb: &[usize],
    out: &[usize],
) -> Vec<T> {
    if sc == out && sa == out && sb == out {
        return c.iter().zip(a.iter().zip(b)).map(|(&k, (&x, &y))| if k != 0 { x } else { y }).collect();
    }
    let n: usize = out.iter().product();
    let mut v = Vec::with_capacity(n);
    let (tc, ta, tb) = (broadcast_strides(sc, out), broadcast_strides(sa, out), broadcast_strides(sb, out));
    walk(out, [&tc, &ta, &tb], |[i, j, k]| v.push(if c[i] != 0 { a[j] } else { b[k] }));
    v
}

/// Converts `x` to `dtype` with the IR's cast semantics.
pub(crate) fn cast(x: &CpuData, dtype: DType) -> CpuData {
    if x.dtype() == dtype {
        return x.clone();
    }
    each_all!(x, v => cast_slice(v, dtype))
}

fn cast_slice<S: Elem>(src: &[S], dtype: DType) -> CpuData {
    fn conv<S: Elem, D: Elem>(src: &[S]) -> Vec<D> {
        src.iter().map(|&x| D::from_cv(x.to_cv())).collect()
    }
    match dtype {
        DType::Bool => CpuData::Bool(src.iter().map(|&x| x.to_cv().is_nonzero() as u8).collect()),
        DType::I8 => CpuData::I8(conv(src)),
        DType::I16 => CpuData::I16(conv(src)),
        DType::I32 => CpuData::I32(conv(src)),
        DType::I64 => CpuData::I64(conv(src)),
        DType::U8 => CpuData::U8(conv(src)),
        DType::U16 => CpuData::U16(conv(src)),
        DType::U32 => CpuData::U32(conv(src)),
        DType::U64 => CpuData::U64(conv(src)),
        DType::F16 => CpuData::F16(conv(src)),
        DType::F32 => CpuData::F32(conv(src)),
        DType::F64 => CpuData::F64(conv(src)),
    }
}

/// The value of a scalar as a cast intermediate.
pub(crate) fn scalar_cv(v: lazuli_ir::ScalarValue) -> CastVal {
    match v {
        lazuli_ir::ScalarValue::Float(f) => CastVal::F(f),
        lazuli_ir::ScalarValue::Int(i) => CastVal::I(i),
        lazuli_ir::ScalarValue::UInt(u) => CastVal::U(u),
        lazuli_ir::ScalarValue::Bool(b) => CastVal::U(b as u64),
    }
}
