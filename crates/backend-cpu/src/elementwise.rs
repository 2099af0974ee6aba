//! Elementwise kernels over blocks: unary functions, binary functions,
//! `where` and casts, each compiled once per (op, dtype) into a
//! [`BlockFn`] that maps operand runs to a destination run.
//!
//! A block kernel sees its operands as raw bytes ([`Operand`]: a run of
//! elements or one splatted value) and casts them to the element type once
//! per block, so the per-element loop is monomorphic, has no dispatch and
//! vectorizes. The fused loops ([`crate::fused`]) call these kernels on
//! blocks of a few thousand elements; the same kernels evaluate every
//! elementwise node, fused or not, so the two paths cannot disagree. The
//! per-element loops run through [`wide`], which compiles them a second
//! time for AVX2 and picks that copy at run time (no FMA, so both copies
//! round identically).
//!
//! Float transcendental functions are evaluated in `f64` by the reference
//! semantics ([`lazuli_ir::semantics`]) and rounded to the element type, except f32 `exp`, `tanh`, `sigmoid`, `erf` and `gelu`, which use the
//! vectorized f32 code of [`crate::fastmath`] (a few ulp). f32 `sqrt`,
//! `reciprocal`, `floor`, `ceil` and `round` run in f32 directly, which
//! rounds identically to the `f64` definition. Basic float arithmetic
//! (`+ - * /`) runs in the element type itself (f16 and bf16 through f32,
//! which rounds identically: f32 has more than twice their precision).

use crate::elem::{CastVal, Elem, Float, Num};
use crate::fastmath;
use bytemuck::Pod;
use half::{bf16, f16};
use lazuli_ir::{semantics, BinaryOp, DType, Op, UnaryOp};

/// One operand of a block kernel, as the bytes of its element type.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Operand<'a> {
    /// One element per output element of the block.
    Slice(&'a [u8]),
    /// The same element for the whole block (its bytes, zero-padded).
    Splat([u8; 8]),
}

/// A compiled elementwise kernel: `f(operands, destination bytes)`.
pub(crate) type BlockFn = Box<dyn Fn(&[Operand<'_>], &mut [u8]) + Send + Sync>;

/// Matches a dtype to its storage type, binding it as the type alias `$T`
/// (bool is stored as `u8`).
macro_rules! any_t {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::Bool | DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::I16 => {
                type $T = i16;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U16 => {
                type $T = u16;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
        }
    };
}

/// Like `any_t!` for the float dtypes only.
macro_rules! float_t {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            _ => unreachable!("float op on a non-float dtype in a verified graph"),
        }
    };
}

/// A typed operand.
#[derive(Clone, Copy)]
enum Arg<'a, T> {
    Slice(&'a [T]),
    Splat(T),
}

#[inline]
fn arg<T: Pod>(o: Operand<'_>) -> Arg<'_, T> {
    match o {
        Operand::Slice(b) => Arg::Slice(bytemuck::cast_slice(b)),
        Operand::Splat(b) => Arg::Splat(bytemuck::pod_read_unaligned(&b[..std::mem::size_of::<T>()])),
    }
}

/// The bytes of one element, zero-padded, for [`Operand::Splat`].
pub(crate) fn splat_bytes<T: Pod>(v: T) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..std::mem::size_of::<T>()].copy_from_slice(bytemuck::bytes_of(&v));
    b
}

#[inline]
fn map1<A: Pod, U: Pod>(a: Operand<'_>, dst: &mut [u8], f: impl Fn(A) -> U) {
    let d: &mut [U] = bytemuck::cast_slice_mut(dst);
    match arg::<A>(a) {
        Arg::Slice(x) => wide(|| {
            for (o, &x) in d.iter_mut().zip(x) {
                *o = f(x);
            }
        }),
        Arg::Splat(x) => d.fill(f(x)),
    }
}

#[inline]
fn map2<A: Pod, B: Pod, U: Pod>(a: Operand<'_>, b: Operand<'_>, dst: &mut [u8], f: impl Fn(A, B) -> U) {
    let d: &mut [U] = bytemuck::cast_slice_mut(dst);
    match (arg::<A>(a), arg::<B>(b)) {
        (Arg::Slice(x), Arg::Slice(y)) => wide(|| {
            for ((o, &x), &y) in d.iter_mut().zip(x).zip(y) {
                *o = f(x, y);
            }
        }),
        (Arg::Slice(x), Arg::Splat(y)) => wide(|| {
            for (o, &x) in d.iter_mut().zip(x) {
                *o = f(x, y);
            }
        }),
        (Arg::Splat(x), Arg::Slice(y)) => wide(|| {
            for (o, &y) in d.iter_mut().zip(y) {
                *o = f(x, y);
            }
        }),
        (Arg::Splat(x), Arg::Splat(y)) => d.fill(f(x, y)),
    }
}

#[inline]
fn get<T: Copy>(a: Arg<'_, T>, i: usize) -> T {
    match a {
        Arg::Slice(s) => s[i],
        Arg::Splat(v) => v,
    }
}

fn select<T: Pod>(c: Operand<'_>, a: Operand<'_>, b: Operand<'_>, dst: &mut [u8]) {
    let d: &mut [T] = bytemuck::cast_slice_mut(dst);
    wide(|| match (arg::<u8>(c), arg::<T>(a), arg::<T>(b)) {
        (Arg::Slice(c), Arg::Slice(x), Arg::Slice(y)) => {
            for (((o, &k), &x), &y) in d.iter_mut().zip(c).zip(x).zip(y) {
                *o = if k != 0 { x } else { y };
            }
        }
        (c, x, y) => {
            for (i, o) in d.iter_mut().enumerate() {
                *o = if get(c, i) != 0 { get(x, i) } else { get(y, i) };
            }
        }
    })
}

/// Runs `f` (a loop over a block) compiled for AVX2 when the CPU has it:
/// `f` is inlined into a copy of this function built with AVX2 enabled, so
/// its loops vectorize twice as wide as the SSE2 baseline. No FMA: every
/// operation rounds exactly as in the baseline build.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU supports AVX2 (checked just above), the only
        // precondition of a `target_feature` function.
        #[allow(unsafe_code)]
        return unsafe { avx2(f) };
    }
    f()
}

/// Copies (or fills) the destination with an operand of `size`-byte elements.
pub(crate) fn copy(a: Operand<'_>, dst: &mut [u8], size: usize) {
    match a {
        Operand::Slice(s) => dst.copy_from_slice(s),
        Operand::Splat(b) => {
            for c in dst.chunks_exact_mut(size) {
                c.copy_from_slice(&b[..size]);
            }
        }
    }
}

/// Compiles the block kernel of an elementwise op (`Unary`, `Binary`,
/// `Where`, `Cast`) whose operands have dtypes `ins`.
pub(crate) fn build(op: &Op, ins: &[DType]) -> BlockFn {
    match op {
        Op::Unary(u) => unary(*u, ins[0]),
        Op::Binary(b) => binary(*b, ins[0]),
        Op::Where => any_t!(ins[1], T => Box::new(|a, d| select::<T>(a[0], a[1], a[2], d))),
        Op::Cast(to) => cast(ins[0], *to),
        _ => unreachable!("{} is not an elementwise op", op.name()),
    }
}

fn unary(op: UnaryOp, dt: DType) -> BlockFn {
    use UnaryOp::*;
    match op {
        Not => Box::new(|a, d| map1::<u8, u8>(a[0], d, |b| (b == 0) as u8)),
        IsNan => float_t!(dt, T => Box::new(|a, d| map1::<T, u8>(a[0], d, |v| Num::is_nan(v) as u8))),
        IsInf => float_t!(dt, T => Box::new(|a, d| map1::<T, u8>(a[0], d, |v| Float::to_f64(v).is_infinite() as u8))),
        Neg => any_t!(dt, T => Box::new(|a, d| map1::<T, T>(a[0], d, Num::neg))),
        Abs => any_t!(dt, T => Box::new(|a, d| map1::<T, T>(a[0], d, Num::abs))),
        Sign => any_t!(dt, T => Box::new(|a, d| map1::<T, T>(a[0], d, Num::sign))),
        Relu => any_t!(dt, T => Box::new(|a, d| map1::<T, T>(a[0], d, |e| Num::maximum(e, T::ZERO)))),
        Exp | Log | Sqrt | Rsqrt | Reciprocal | Sigmoid | Tanh | Gelu | GeluTanh | Erf | Sin | Cos | Floor | Ceil
        | Round
            if dt == DType::F32 =>
        {
            unary_f32(op)
        }
        Exp | Log | Sqrt | Rsqrt | Reciprocal | Sigmoid | Tanh | Gelu | GeluTanh | Erf | Sin | Cos | Floor | Ceil
        | Round => {
            let f = fastmath::reference(op);
            float_t!(dt, T => Box::new(move |a, d| map1::<T, T>(a[0], d, |e| T::from_f64(f(Float::to_f64(e))))))
        }
    }
}

/// f32 float functions: vectorized where that keeps the reference result.
fn unary_f32(op: UnaryOp) -> BlockFn {
    use UnaryOp::*;
    fn fast(f: fn(&[f32], &mut [f32])) -> BlockFn {
        Box::new(move |a, d| {
            let d: &mut [f32] = bytemuck::cast_slice_mut(d);
            match arg::<f32>(a[0]) {
                Arg::Slice(x) => f(x, d),
                Arg::Splat(x) => {
                    let mut y = [0.0f32];
                    f(&[x], &mut y);
                    d.fill(y[0]);
                }
            }
        })
    }
    match op {
        Exp => fast(fastmath::exp),
        Tanh => fast(fastmath::tanh),
        Sigmoid => fast(fastmath::sigmoid),
        Erf => fast(fastmath::erf),
        Gelu => fast(fastmath::gelu),
        Sqrt => Box::new(|a, d| map1::<f32, f32>(a[0], d, f32::sqrt)),
        Reciprocal => Box::new(|a, d| map1::<f32, f32>(a[0], d, |x| 1.0 / x)),
        Floor => Box::new(|a, d| map1::<f32, f32>(a[0], d, f32::floor)),
        Ceil => Box::new(|a, d| map1::<f32, f32>(a[0], d, f32::ceil)),
        Round => Box::new(|a, d| map1::<f32, f32>(a[0], d, f32::round_ties_even)),
        Rsqrt => Box::new(|a, d| map1::<f32, f32>(a[0], d, |x| (1.0 / (x as f64).sqrt()) as f32)),
        Log | GeluTanh | Sin | Cos => {
            let f = fastmath::reference(op);
            Box::new(move |a, d| map1::<f32, f32>(a[0], d, |e| f(e as f64) as f32))
        }
        Neg | Abs | Relu | Sign | Not | IsNan | IsInf => unreachable!("{op:?} is handled by unary()"),
    }
}

fn binary(op: BinaryOp, dt: DType) -> BlockFn {
    use BinaryOp::*;
    // `partial_cmp` is None only when a NaN is involved: every comparison
    // is then false except `!=`. Bool (u8) compares as integers.
    macro_rules! cmp {
        ($f:expr, $eq_nan:expr) => {
            any_t!(dt, T => Box::new(|a, d| {
                map2::<T, T, u8>(a[0], a[1], d, |p, q| p.partial_cmp(&q).map_or($eq_nan, $f) as u8)
            }))
        };
    }
    macro_rules! logic {
        ($f:expr) => {
            Box::new(|a, d| map2::<u8, u8, u8>(a[0], a[1], d, |p, q| $f(p != 0, q != 0) as u8))
        };
    }
    // One monomorphic loop per (op, dtype), so the element function inlines.
    macro_rules! arith {
        ($f:ident) => {
            any_t!(dt, T => Box::new(|a, d| map2::<T, T, T>(a[0], a[1], d, Num::$f)))
        };
    }
    match op {
        Eq => cmp!(|o: std::cmp::Ordering| o.is_eq(), false),
        Ne => cmp!(|o: std::cmp::Ordering| o.is_ne(), true),
        Lt => cmp!(|o: std::cmp::Ordering| o.is_lt(), false),
        Le => cmp!(|o: std::cmp::Ordering| o.is_le(), false),
        Gt => cmp!(|o: std::cmp::Ordering| o.is_gt(), false),
        Ge => cmp!(|o: std::cmp::Ordering| o.is_ge(), false),
        And => logic!(|p, q| p && q),
        Or => logic!(|p, q| p || q),
        Xor => logic!(|p: bool, q: bool| p != q),
        Add => arith!(add),
        Sub => arith!(sub),
        Mul => arith!(mul),
        Div => arith!(div),
        Pow => arith!(pow),
        Maximum => arith!(maximum),
        Minimum => arith!(minimum),
        Mod => arith!(modulo),
        Rem => arith!(rem),
        LogAddExp => {
            let f = semantics::float_binary(op).expect("logaddexp is arithmetic");
            float_t!(dt, T => Box::new(move |a, d| {
                map2::<T, T, T>(a[0], a[1], d, |p, q| T::from_f64(f(Float::to_f64(p), Float::to_f64(q))))
            }))
        }
    }
}

/// Converts with the IR's cast semantics (through [`CastVal`]).
fn cast(from: DType, to: DType) -> BlockFn {
    if from == to || (from == DType::Bool && to == DType::U8) {
        let size = to.size_bytes();
        return Box::new(move |a, d| copy(a[0], d, size));
    }
    if to == DType::Bool {
        return any_t!(from, S => Box::new(|a, d| map1::<S, u8>(a[0], d, |x| x.to_cv().is_nonzero() as u8)));
    }
    any_t!(from, S => any_t!(to, D => Box::new(|a, d| map1::<S, D>(a[0], d, |x| D::from_cv(x.to_cv())))))
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

/// A scalar converted to `dtype` (cast semantics), as splat bytes.
pub(crate) fn scalar_bytes(v: lazuli_ir::ScalarValue, dtype: DType) -> [u8; 8] {
    let cv = scalar_cv(v);
    if dtype == DType::Bool {
        return splat_bytes(cv.is_nonzero() as u8);
    }
    any_t!(dtype, T => splat_bytes(T::from_cv(cv)))
}
