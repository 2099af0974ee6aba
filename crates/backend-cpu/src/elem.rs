//! Element traits: [`Elem`] (every stored type, with cast semantics),
//! [`Num`] (arithmetic with the IR's integer and float rules) and [`Float`]
//! (conversions to and from `f64` for transcendental functions).
//!
//! Integer arithmetic wraps; integer division and remainder by zero give 0;
//! `modulo` is floored (sign of the divisor) and `rem` truncated (sign of the
//! dividend); integer `pow` with a negative exponent is 0 except for bases
//! 1 and -1. Float `maximum`/`minimum` propagate NaN. Float sums and
//! products accumulate in `f64`. Float `pow`, `modulo` and `rem` are the
//! `f64` reference ([`lazuli_ir::semantics`]) rounded to the element type.

use half::{bf16, f16};
use lazuli_ir::{semantics, BinaryOp};
use std::fmt::Debug;

/// A scalar in transit between dtypes: cast semantics are defined by
/// converting the source element to this and this to the target type
/// (Rust `as` rules: float->int truncates toward zero and saturates, NaN
/// gives 0; int->int wraps; nonzero->true).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum CastVal {
    /// A signed integer.
    I(i64),
    /// An unsigned integer (also bool as 0/1).
    U(u64),
    /// A float.
    F(f64),
}

impl CastVal {
    /// Nonzero (NaN counts as nonzero, as in C and numpy).
    pub(crate) fn is_nonzero(self) -> bool {
        match self {
            CastVal::I(v) => v != 0,
            CastVal::U(v) => v != 0,
            CastVal::F(v) => v != 0.0,
        }
    }

    /// The value as i128 when it is an integer (indices).
    pub(crate) fn as_i128(self) -> i128 {
        match self {
            CastVal::I(v) => v as i128,
            CastVal::U(v) => v as i128,
            CastVal::F(v) => v as i128,
        }
    }
}

/// Every element type stored in a `CpuData` (bool is stored as `u8`).
pub(crate) trait Elem: bytemuck::Pod + PartialOrd + Send + Sync + Debug + 'static {
    /// The element as a cast intermediate.
    fn to_cv(self) -> CastVal;
    /// An element from a cast intermediate.
    fn from_cv(v: CastVal) -> Self;
}

/// Arithmetic on numeric element types with the IR's semantics.
pub(crate) trait Num: Elem {
    /// Accumulator of sums and products (the type itself for integers, `f64` for floats).
    type Acc: Copy;
    /// 0.
    const ZERO: Self;
    /// The lowest value (-inf for floats).
    const LOWEST: Self;
    /// The highest value (+inf for floats).
    const HIGHEST: Self;
    /// The zero accumulator.
    fn acc_zero() -> Self::Acc;
    /// The unit accumulator.
    fn acc_one() -> Self::Acc;
    /// `acc + x`.
    fn acc_add(acc: Self::Acc, x: Self) -> Self::Acc;
    /// `acc * x`.
    fn acc_mul(acc: Self::Acc, x: Self) -> Self::Acc;
    /// The accumulator rounded to the element type.
    fn from_acc(acc: Self::Acc) -> Self;
    /// `a + b`.
    fn add(a: Self, b: Self) -> Self;
    /// `a - b`.
    fn sub(a: Self, b: Self) -> Self;
    /// `a * b`.
    fn mul(a: Self, b: Self) -> Self;
    /// `a / b`.
    fn div(a: Self, b: Self) -> Self;
    /// `a ^ b`.
    fn pow(a: Self, b: Self) -> Self;
    /// Floored modulo.
    fn modulo(a: Self, b: Self) -> Self;
    /// Truncated remainder.
    fn rem(a: Self, b: Self) -> Self;
    /// True for NaN.
    fn is_nan(self) -> bool;
    /// `-x`.
    fn neg(self) -> Self;
    /// `|x|`.
    fn abs(self) -> Self;
    /// -1, 0 or 1 (NaN stays NaN).
    fn sign(self) -> Self;
    /// NaN-propagating maximum.
    fn maximum(a: Self, b: Self) -> Self {
        if a.is_nan() || b.is_nan() {
            if a.is_nan() {
                a
            } else {
                b
            }
        } else if b > a {
            b
        } else {
            a
        }
    }
    /// NaN-propagating minimum.
    fn minimum(a: Self, b: Self) -> Self {
        if a.is_nan() || b.is_nan() {
            if a.is_nan() {
                a
            } else {
                b
            }
        } else if b < a {
            b
        } else {
            a
        }
    }
}

/// Float element types.
pub(crate) trait Float: Num<Acc = f64> {
    /// Widening conversion.
    fn to_f64(self) -> f64;
    /// Rounding conversion.
    fn from_f64(v: f64) -> Self;
}

macro_rules! int_elem {
    ($t:ty, $cv:ident, $w:ty) => {
        impl Elem for $t {
            #[inline]
            fn to_cv(self) -> CastVal {
                CastVal::$cv(self as $w)
            }
            #[inline]
            fn from_cv(v: CastVal) -> Self {
                match v {
                    CastVal::I(x) => x as $t,
                    CastVal::U(x) => x as $t,
                    CastVal::F(x) => x as $t,
                }
            }
        }
    };
}

macro_rules! int_num {
    ($t:ty, signed: $signed:tt) => {
        impl Num for $t {
            type Acc = $t;
            const ZERO: $t = 0;
            const LOWEST: $t = <$t>::MIN;
            const HIGHEST: $t = <$t>::MAX;
            #[inline]
            fn acc_zero() -> $t {
                0
            }
            #[inline]
            fn acc_one() -> $t {
                1
            }
            #[inline]
            fn acc_add(acc: $t, x: $t) -> $t {
                acc.wrapping_add(x)
            }
            #[inline]
            fn acc_mul(acc: $t, x: $t) -> $t {
                acc.wrapping_mul(x)
            }
            #[inline]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline]
            fn sub(a: $t, b: $t) -> $t {
                a.wrapping_sub(b)
            }
            #[inline]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline]
            fn div(a: $t, b: $t) -> $t {
                if b == 0 {
                    0
                } else {
                    a.wrapping_div(b)
                }
            }
            fn pow(a: $t, b: $t) -> $t {
                int_num!(@pow $signed, a, b)
            }
            #[inline]
            fn modulo(a: $t, b: $t) -> $t {
                if b == 0 {
                    return 0;
                }
                let r = a.wrapping_rem(b);
                int_num!(@floor $signed, r, b)
            }
            #[inline]
            fn rem(a: $t, b: $t) -> $t {
                if b == 0 {
                    0
                } else {
                    a.wrapping_rem(b)
                }
            }
            #[inline]
            fn is_nan(self) -> bool {
                false
            }
            #[inline]
            fn neg(self) -> $t {
                self.wrapping_neg()
            }
            #[inline]
            fn abs(self) -> $t {
                int_num!(@abs $signed, self)
            }
            #[inline]
            fn sign(self) -> $t {
                int_num!(@sign $signed, self)
            }
        }
    };
    (@pow true, $a:expr, $b:expr) => {{
        let (a, b) = ($a, $b);
        if b < 0 {
            match a {
                1 => 1,
                -1 => if b % 2 == 0 { 1 } else { -1 },
                _ => 0,
            }
        } else {
            ipow(a, b as u64, |x, y| x.wrapping_mul(y), 1)
        }
    }};
    (@pow false, $a:expr, $b:expr) => {
        ipow($a, $b as u64, |x, y| x.wrapping_mul(y), 1)
    };
    (@floor true, $r:expr, $b:expr) => {
        if $r != 0 && (($r < 0) != ($b < 0)) { $r + $b } else { $r }
    };
    (@floor false, $r:expr, $b:expr) => {
        $r
    };
    (@abs true, $x:expr) => {
        $x.wrapping_abs()
    };
    (@abs false, $x:expr) => {
        $x
    };
    (@sign true, $x:expr) => {
        $x.signum()
    };
    (@sign false, $x:expr) => {
        ($x != 0) as _
    };
}

/// Exponentiation by squaring with a wrapping multiply.
fn ipow<T: Copy>(mut base: T, mut exp: u64, mul: impl Fn(T, T) -> T, one: T) -> T {
    let mut acc = one;
    while exp > 0 {
        if exp & 1 == 1 {
            acc = mul(acc, base);
        }
        exp >>= 1;
        if exp > 0 {
            base = mul(base, base);
        }
    }
    acc
}

int_elem!(i8, I, i64);
int_elem!(i16, I, i64);
int_elem!(i32, I, i64);
int_elem!(i64, I, i64);
int_elem!(u8, U, u64);
int_elem!(u16, U, u64);
int_elem!(u32, U, u64);
int_elem!(u64, U, u64);
int_num!(i8, signed: true);
int_num!(i16, signed: true);
int_num!(i32, signed: true);
int_num!(i64, signed: true);
int_num!(u8, signed: false);
int_num!(u16, signed: false);
int_num!(u32, signed: false);
int_num!(u64, signed: false);

impl Elem for f32 {
    #[inline]
    fn to_cv(self) -> CastVal {
        CastVal::F(self as f64)
    }
    #[inline]
    fn from_cv(v: CastVal) -> Self {
        match v {
            CastVal::I(x) => x as f32,
            CastVal::U(x) => x as f32,
            CastVal::F(x) => x as f32,
        }
    }
}

impl Elem for f64 {
    #[inline]
    fn to_cv(self) -> CastVal {
        CastVal::F(self)
    }
    #[inline]
    fn from_cv(v: CastVal) -> Self {
        match v {
            CastVal::I(x) => x as f64,
            CastVal::U(x) => x as f64,
            CastVal::F(x) => x,
        }
    }
}

impl Elem for f16 {
    #[inline]
    fn to_cv(self) -> CastVal {
        CastVal::F(self.to_f64())
    }
    #[inline]
    fn from_cv(v: CastVal) -> Self {
        match v {
            CastVal::I(x) => f16::from_f32(x as f32),
            CastVal::U(x) => f16::from_f32(x as f32),
            CastVal::F(x) => lazuli_ir::f16_from_f64(x),
        }
    }
}

impl Elem for bf16 {
    #[inline]
    fn to_cv(self) -> CastVal {
        CastVal::F(self.to_f64())
    }
    #[inline]
    fn from_cv(v: CastVal) -> Self {
        match v {
            CastVal::I(x) => lazuli_ir::bf16_from_f64(x as f64),
            CastVal::U(x) => lazuli_ir::bf16_from_f64(x as f64),
            CastVal::F(x) => lazuli_ir::bf16_from_f64(x),
        }
    }
}

macro_rules! float_num {
    ($t:ty, $zero:expr, $one:expr, $lo:expr, $hi:expr) => {
        impl Num for $t {
            type Acc = f64;
            const ZERO: $t = $zero;
            const LOWEST: $t = $lo;
            const HIGHEST: $t = $hi;
            #[inline]
            fn acc_zero() -> f64 {
                0.0
            }
            #[inline]
            fn acc_one() -> f64 {
                1.0
            }
            #[inline]
            fn acc_add(acc: f64, x: $t) -> f64 {
                acc + Float::to_f64(x)
            }
            #[inline]
            fn acc_mul(acc: f64, x: $t) -> f64 {
                acc * Float::to_f64(x)
            }
            #[inline]
            fn from_acc(acc: f64) -> $t {
                <$t as Float>::from_f64(acc)
            }
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline]
            fn sub(a: $t, b: $t) -> $t {
                a - b
            }
            #[inline]
            fn mul(a: $t, b: $t) -> $t {
                a * b
            }
            #[inline]
            fn div(a: $t, b: $t) -> $t {
                a / b
            }
            #[inline]
            fn pow(a: $t, b: $t) -> $t {
                reference(BinaryOp::Pow, a, b)
            }
            #[inline]
            fn modulo(a: $t, b: $t) -> $t {
                reference(BinaryOp::Mod, a, b)
            }
            #[inline]
            fn rem(a: $t, b: $t) -> $t {
                reference(BinaryOp::Rem, a, b)
            }
            #[inline]
            fn is_nan(self) -> bool {
                self.is_nan()
            }
            #[inline]
            fn neg(self) -> $t {
                -self
            }
            #[inline]
            fn abs(self) -> $t {
                <$t as Float>::from_f64(Float::to_f64(self).abs())
            }
            #[inline]
            fn sign(self) -> $t {
                if self > $zero {
                    $one
                } else if self < $zero {
                    -$one
                } else {
                    self
                }
            }
        }
    };
}

/// A float binary function by its `f64` reference ([`semantics`]).
#[inline]
fn reference<T: Float>(op: BinaryOp, a: T, b: T) -> T {
    let f = semantics::float_binary(op).expect("an arithmetic op");
    T::from_f64(f(a.to_f64(), b.to_f64()))
}

float_num!(f32, 0.0, 1.0, f32::NEG_INFINITY, f32::INFINITY);
float_num!(f64, 0.0, 1.0, f64::NEG_INFINITY, f64::INFINITY);
float_num!(f16, f16::ZERO, f16::ONE, f16::NEG_INFINITY, f16::INFINITY);
float_num!(bf16, bf16::ZERO, bf16::ONE, bf16::NEG_INFINITY, bf16::INFINITY);

impl Float for f32 {
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline]
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
}

impl Float for f64 {
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn from_f64(v: f64) -> f64 {
        v
    }
}

impl Float for f16 {
    #[inline]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    #[inline]
    fn from_f64(v: f64) -> f16 {
        lazuli_ir::f16_from_f64(v)
    }
}

impl Float for bf16 {
    #[inline]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    #[inline]
    fn from_f64(v: f64) -> bf16 {
        lazuli_ir::bf16_from_f64(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_rules() {
        assert_eq!(<i32 as Num>::div(-7, 2), -3);
        assert_eq!(<i32 as Num>::div(7, 0), 0);
        assert_eq!(<i32 as Num>::div(i32::MIN, -1), i32::MIN);
        assert_eq!(<i32 as Num>::modulo(-7, 3), 2);
        assert_eq!(<i32 as Num>::modulo(7, -3), -2);
        assert_eq!(<i32 as Num>::rem(-7, 3), -1);
        assert_eq!(<i32 as Num>::rem(i32::MIN, -1), 0);
        assert_eq!(<i8 as Num>::add(127, 1), -128);
        assert_eq!(<u8 as Num>::sub(0, 1), 255);
        assert_eq!(<i32 as Num>::pow(3, 4), 81);
        assert_eq!(<i32 as Num>::pow(2, -1), 0);
        assert_eq!(<i32 as Num>::pow(-1, -3), -1);
        assert_eq!(<i32 as Num>::pow(-1, -2), 1);
        assert_eq!(<i32 as Num>::pow(1, -5), 1);
        assert_eq!(<i32 as Num>::pow(0, 0), 1);
        assert_eq!(<i8 as Num>::pow(2, 7), -128);
        assert_eq!(<u8 as Num>::pow(3, 5), 243);
        assert_eq!(<i8 as Num>::abs(-128), -128);
        assert_eq!(<u16 as Num>::sign(7), 1);
        assert_eq!(<i64 as Num>::sign(-7), -1);
    }

    #[test]
    fn float_rules() {
        assert_eq!(<f32 as Num>::modulo(-7.0, 3.0), 2.0);
        assert_eq!(<f32 as Num>::modulo(7.0, -3.0), -2.0);
        assert_eq!(<f32 as Num>::rem(-7.0, 3.0), -1.0);
        assert!(<f32 as Num>::modulo(1.0, 0.0).is_nan());
        assert!(<f32 as Num>::maximum(f32::NAN, 1.0).is_nan());
        assert!(<f32 as Num>::minimum(1.0, f32::NAN).is_nan());
        assert!(<f64 as Num>::sign(f64::NAN).is_nan());
        assert_eq!(<f16 as Num>::sign(f16::from_f32(-3.0)), f16::from_f32(-1.0));
    }

    #[test]
    fn cast_rules() {
        assert_eq!(i32::from_cv(CastVal::F(-2.9)), -2);
        assert_eq!(i32::from_cv(CastVal::F(1e20)), i32::MAX);
        assert_eq!(i32::from_cv(CastVal::F(f64::NAN)), 0);
        assert_eq!(u8::from_cv(CastVal::F(-5.0)), 0);
        assert_eq!(u8::from_cv(CastVal::I(-1)), 255);
        assert_eq!(i8::from_cv(CastVal::U(200)), -56);
        assert!(CastVal::F(f64::NAN).is_nonzero());
        assert!(!CastVal::F(-0.0).is_nonzero());
    }
}
