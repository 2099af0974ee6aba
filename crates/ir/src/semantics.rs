//! The reference meaning of every elementwise op, in one place: unary and
//! binary functions on `f64` (floats of every width are computed here and
//! rounded to the element type), on wrapping `i64` (signed integers) and
//! on wrapping `u64` (unsigned), and the comparisons and logical ops.
//!
//! Constant folding ([`crate::passes::fold`]) evaluates nodes with these
//! functions, and the CPU backend, the executable specification, uses them
//! for every float function it does not run in the element type itself
//! (its vectorized f32 fast paths are tested against them). Wrapping at
//! full width and then casting to the narrow dtype gives the narrow
//! type's wrapping result, so one `i64` and one `u64` definition serve
//! every integer width.
//!
//! A `None` result means the op is not defined on that domain (a float
//! function on an integer, say), or its result there is left unspecified
//! by the op docs (integer `mod` and `rem` by zero, an integer power with
//! a negative exponent): backends may then differ, and folding leaves the
//! node alone rather than guess.

use crate::{BinaryOp, DType, ScalarValue, UnaryOp};
use std::cmp::Ordering;

/// What a unary op computes on a float.
#[derive(Clone, Copy, Debug)]
pub enum FloatUnary {
    /// A float result.
    Map(fn(f64) -> f64),
    /// A bool result (`isnan`, `isinf`).
    Test(fn(f64) -> bool),
}

/// The meaning of `op` on a float (`None` for the bool-only `Not`).
pub fn float_unary(op: UnaryOp) -> Option<FloatUnary> {
    use FloatUnary::{Map, Test};
    use UnaryOp::*;
    Some(match op {
        Neg => Map(|x| -x),
        Abs => Map(f64::abs),
        Exp => Map(f64::exp),
        Log => Map(f64::ln),
        Sqrt => Map(f64::sqrt),
        Rsqrt => Map(|x| 1.0 / x.sqrt()),
        Reciprocal => Map(|x| 1.0 / x),
        // NaN stays NaN and -0 stays -0, as `maximum(x, 0)` gives.
        Relu => Map(|x| if x < 0.0 { 0.0 } else { x }),
        Sigmoid => Map(|x| 1.0 / (1.0 + (-x).exp())),
        Tanh => Map(f64::tanh),
        // 0.5 x erfc(-x / sqrt 2) equals x Phi(x) without cancellation for
        // large negative x.
        Gelu => Map(|x| 0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)),
        GeluTanh => Map(|x| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }),
        Erf => Map(libm::erf),
        Sin => Map(f64::sin),
        Cos => Map(f64::cos),
        Floor => Map(f64::floor),
        Ceil => Map(f64::ceil),
        Round => Map(f64::round_ties_even),
        // 0 and NaN stay themselves (the sign of a zero included).
        Sign => Map(|x| if x.is_nan() || x == 0.0 { x } else { x.signum() }),
        IsNan => Test(f64::is_nan),
        IsInf => Test(f64::is_infinite),
        Not => return None,
    })
}

/// The meaning of `op` on a signed integer, wrapping at 64 bits.
pub fn int_unary(op: UnaryOp, x: i64) -> Option<i64> {
    use UnaryOp::*;
    match op {
        Neg => Some(x.wrapping_neg()),
        Abs => Some(x.wrapping_abs()),
        Relu => Some(x.max(0)),
        Sign => Some(x.signum()),
        Exp | Log | Sqrt | Rsqrt | Reciprocal | Sigmoid | Tanh | Gelu | GeluTanh | Erf | Sin | Cos | Floor | Ceil
        | Round | Not | IsNan | IsInf => None,
    }
}

/// The meaning of `op` on an unsigned integer.
pub fn uint_unary(op: UnaryOp, x: u64) -> Option<u64> {
    use UnaryOp::*;
    match op {
        Abs | Relu => Some(x),
        Sign => Some(x.min(1)),
        Neg | Exp | Log | Sqrt | Rsqrt | Reciprocal | Sigmoid | Tanh | Gelu | GeluTanh | Erf | Sin | Cos | Floor
        | Ceil | Round | Not | IsNan | IsInf => None,
    }
}

/// The meaning of an arithmetic `op` on floats (`None` for the
/// comparisons and logical ops, whose results are bool). Inlined, so that
/// a caller naming the op gets the function itself.
#[inline]
pub fn float_binary(op: BinaryOp) -> Option<fn(f64, f64) -> f64> {
    use BinaryOp::*;
    Some(match op {
        Add => |p, q| p + q,
        Sub => |p, q| p - q,
        Mul => |p, q| p * q,
        Div => |p, q| p / q,
        Pow => f64::powf,
        Maximum => |p, q| if p.is_nan() || q.is_nan() { f64::NAN } else { p.max(q) },
        Minimum => |p, q| if p.is_nan() || q.is_nan() { f64::NAN } else { p.min(q) },
        // Floored: the result has the sign of `q`, a zero result included
        // (Python's `%`).
        Mod => |p, q| {
            let r = p % q;
            if r == 0.0 {
                0.0f64.copysign(q)
            } else if (r < 0.0) != (q < 0.0) {
                r + q
            } else {
                r
            }
        },
        Rem => |p, q| p % q,
        LogAddExp => logaddexp,
        Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor => return None,
    })
}

/// The meaning of an arithmetic `op` on signed integers, wrapping at 64
/// bits; `None` for unspecified results and non-arithmetic ops.
pub fn int_binary(op: BinaryOp, p: i64, q: i64) -> Option<i64> {
    use BinaryOp::*;
    match op {
        Add => Some(p.wrapping_add(q)),
        Sub => Some(p.wrapping_sub(q)),
        Mul => Some(p.wrapping_mul(q)),
        Div if q == 0 => Some(0),
        Div => Some(p.wrapping_div(q)),
        Pow => Some(p.wrapping_pow(u32::try_from(q).ok()?)),
        Maximum => Some(p.max(q)),
        Minimum => Some(p.min(q)),
        Rem | Mod if q == 0 => None,
        Rem => Some(p.wrapping_rem(q)),
        Mod => {
            let r = p.wrapping_rem(q);
            Some(if r != 0 && (r < 0) != (q < 0) { r.wrapping_add(q) } else { r })
        }
        LogAddExp | Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor => None,
    }
}

/// The meaning of an arithmetic `op` on unsigned integers, wrapping at 64
/// bits; `None` for unspecified results and non-arithmetic ops.
pub fn uint_binary(op: BinaryOp, p: u64, q: u64) -> Option<u64> {
    use BinaryOp::*;
    match op {
        Add => Some(p.wrapping_add(q)),
        Sub => Some(p.wrapping_sub(q)),
        Mul => Some(p.wrapping_mul(q)),
        Div if q == 0 => Some(0),
        Div => Some(p / q),
        Pow => Some(p.wrapping_pow(u32::try_from(q).ok()?)),
        Maximum => Some(p.max(q)),
        Minimum => Some(p.min(q)),
        Rem | Mod if q == 0 => None,
        Rem | Mod => Some(p % q),
        LogAddExp | Eq | Ne | Lt | Le | Gt | Ge | And | Or | Xor => None,
    }
}

/// `log(e^a + e^b)` without overflow: `max(a, b) + log1p(e^-|a - b|)`.
/// Equal infinities give themselves (`a - b` would be NaN there) and a
/// NaN operand gives NaN, as `torch.logaddexp`.
pub fn logaddexp(a: f64, b: f64) -> f64 {
    if a.is_infinite() && a == b {
        return a;
    }
    if a.is_nan() || b.is_nan() {
        return f64::NAN;
    }
    a.max(b) + (-(a - b).abs()).exp().ln_1p()
}

/// A comparison given how its operands order (`None`: a NaN operand,
/// unequal and unordered, so every comparison but `!=` is false); `None`
/// for the other ops.
pub fn compare(op: BinaryOp, ord: Option<Ordering>) -> Option<bool> {
    use BinaryOp::*;
    match op {
        Eq => Some(ord.is_some_and(Ordering::is_eq)),
        Ne => Some(!ord.is_some_and(Ordering::is_eq)),
        Lt => Some(ord.is_some_and(Ordering::is_lt)),
        Le => Some(ord.is_some_and(Ordering::is_le)),
        Gt => Some(ord.is_some_and(Ordering::is_gt)),
        Ge => Some(ord.is_some_and(Ordering::is_ge)),
        Add | Sub | Mul | Div | Pow | Maximum | Minimum | Mod | Rem | LogAddExp | And | Or | Xor => None,
    }
}

/// A logical op on bools; `None` for the other ops.
pub fn logical(op: BinaryOp, p: bool, q: bool) -> Option<bool> {
    use BinaryOp::*;
    match op {
        And => Some(p && q),
        Or => Some(p || q),
        Xor => Some(p != q),
        Add | Sub | Mul | Div | Pow | Maximum | Minimum | Mod | Rem | LogAddExp | Eq | Ne | Lt | Le | Gt | Ge => None,
    }
}

/// `op` on a scalar operand of dtype `d`, at full width (not yet cast to
/// the result dtype); `None` where the result is unspecified or the op
/// is not defined on `d`.
pub fn eval_unary(op: UnaryOp, x: ScalarValue, d: DType) -> Option<ScalarValue> {
    if d == DType::Bool {
        return (op == UnaryOp::Not).then(|| ScalarValue::Bool(!x.as_bool()));
    }
    if d.is_float() {
        return match float_unary(op)? {
            FloatUnary::Map(f) => Some(ScalarValue::Float(f(x.as_f64()))),
            FloatUnary::Test(f) => Some(ScalarValue::Bool(f(x.as_f64()))),
        };
    }
    if d.is_signed_int() {
        return int_unary(op, x.as_i64()).map(ScalarValue::Int);
    }
    uint_unary(op, x.as_u64()).map(ScalarValue::UInt)
}

/// `op` on scalar operands of dtype `d`, at full width (not yet cast to
/// the result dtype); `None` where the result is unspecified or the op
/// is not defined on `d`.
pub fn eval_binary(op: BinaryOp, x: ScalarValue, y: ScalarValue, d: DType) -> Option<ScalarValue> {
    if op.is_comparison() {
        let ord = if d.is_float() {
            x.as_f64().partial_cmp(&y.as_f64())
        } else if d.is_signed_int() {
            Some(x.as_i64().cmp(&y.as_i64()))
        } else if d == DType::Bool {
            Some(x.as_bool().cmp(&y.as_bool()))
        } else {
            Some(x.as_u64().cmp(&y.as_u64()))
        };
        return compare(op, ord).map(ScalarValue::Bool);
    }
    if op.is_logical() {
        return logical(op, x.as_bool(), y.as_bool()).map(ScalarValue::Bool);
    }
    if d.is_float() {
        return float_binary(op).map(|f| ScalarValue::Float(f(x.as_f64(), y.as_f64())));
    }
    if d.is_signed_int() {
        return int_binary(op, x.as_i64(), y.as_i64()).map(ScalarValue::Int);
    }
    if d.is_unsigned_int() {
        return uint_binary(op, x.as_u64(), y.as_u64()).map(ScalarValue::UInt);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(op: UnaryOp) -> fn(f64) -> f64 {
        match float_unary(op) {
            Some(FloatUnary::Map(f)) => f,
            other => panic!("{op:?} is no float map: {other:?}"),
        }
    }

    #[test]
    fn every_unary_op_has_a_meaning_on_some_dtype() {
        for &op in UnaryOp::ALL {
            let defined = [DType::F32, DType::I32, DType::U32, DType::Bool]
                .iter()
                .any(|&d| eval_unary(op, ScalarValue::Float(0.5).cast(d), d).is_some());
            assert!(defined, "{op:?}");
        }
    }

    #[test]
    fn every_binary_op_has_a_meaning_on_some_dtype() {
        for &op in BinaryOp::ALL {
            let defined = [DType::F32, DType::I32, DType::U32, DType::Bool].iter().any(|&d| {
                let v = ScalarValue::Float(1.0).cast(d);
                eval_binary(op, v, v, d).is_some()
            });
            assert!(defined, "{op:?}");
        }
    }

    #[test]
    fn gelu_and_erf() {
        assert!((map(UnaryOp::Erf)(0.5) - 0.520_499_877_813_046_5).abs() < 1e-15);
        assert!((map(UnaryOp::Gelu)(1.0) - 0.841_344_746_068_542_9).abs() < 1e-15);
        // Far left the erfc form keeps relative precision.
        let g = map(UnaryOp::Gelu)(-10.0);
        assert!(g < 0.0 && g > -1e-20, "{g}");
    }

    #[test]
    fn edge_values() {
        assert!(map(UnaryOp::Sign)(-0.0).is_sign_negative());
        assert!(map(UnaryOp::Relu)(f64::NAN).is_nan());
        let modulo = float_binary(BinaryOp::Mod).unwrap();
        assert_eq!(modulo(-7.0, 3.0), 2.0);
        assert!(modulo(-4.0, 2.0).is_sign_positive());
        assert!(modulo(4.0, -2.0).is_sign_negative());
        assert_eq!(int_binary(BinaryOp::Mod, -7, 2), Some(1));
        assert_eq!(int_binary(BinaryOp::Rem, -7, 0), None);
        assert_eq!(int_binary(BinaryOp::Pow, 2, -1), None);
        assert_eq!(int_binary(BinaryOp::Div, -7, 0), Some(0));
        assert_eq!(uint_unary(UnaryOp::Sign, 9), Some(1));
        assert_eq!(compare(BinaryOp::Ne, None), Some(true));
        assert_eq!(compare(BinaryOp::Le, None), Some(false));
        assert_eq!(logical(BinaryOp::Xor, true, true), Some(false));
    }

    #[test]
    fn logaddexp_is_stable_and_handles_infinities_like_torch() {
        let f = float_binary(BinaryOp::LogAddExp).unwrap();
        assert!((f(0.0, 0.0) - std::f64::consts::LN_2).abs() < 1e-15);
        assert!((f(1.0, 2.0) - (1f64.exp() + 2f64.exp()).ln()).abs() < 1e-14);
        // No overflow where exp would overflow, no underflow to -inf.
        assert!((f(1000.0, 1000.0) - (1000.0 + std::f64::consts::LN_2)).abs() < 1e-12);
        assert!((f(-1000.0, -1000.0) - (-1000.0 + std::f64::consts::LN_2)).abs() < 1e-12);
        // Tiny corrections keep their relative precision (log1p).
        let t = f(0.0, -40.0);
        assert!((t - (-40f64).exp()).abs() < 1e-30, "{t}");
        assert_eq!(f(f64::INFINITY, f64::INFINITY), f64::INFINITY);
        assert_eq!(f(f64::NEG_INFINITY, f64::NEG_INFINITY), f64::NEG_INFINITY);
        assert_eq!(f(f64::INFINITY, f64::NEG_INFINITY), f64::INFINITY);
        assert_eq!(f(f64::NEG_INFINITY, 3.0), 3.0);
        assert_eq!(f(2.0, f64::INFINITY), f64::INFINITY);
        assert!(f(f64::NAN, 1.0).is_nan());
        assert!(f(1.0, f64::NAN).is_nan());
        assert!(f(f64::NAN, f64::INFINITY).is_nan());
        assert_eq!(eval_binary(BinaryOp::LogAddExp, ScalarValue::Int(1), ScalarValue::Int(2), DType::I32), None);
    }
}
