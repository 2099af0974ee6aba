//! Element types ([`DType`]) and the host-side scalar value ([`ScalarValue`]).
//!
//! Every tensor has one `DType`. `f64` and `i64` (and the narrow integer
//! types) exist for the CPU backend: WGSL has no such types, so a GPU backend
//! runs nodes of these types on the CPU fallback, never narrowing them.
//!
//! `bf16` (bfloat16: f32's sign and exponent, 7 mantissa bits) is a storage
//! dtype: backends compute it in f32 and round to nearest even on store, as
//! PyTorch does. It never converts implicitly; a cast is an explicit IR op.

use std::fmt;
use std::hash::{Hash, Hasher};

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean; stored as one byte on the host.
    Bool,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer (CPU backend).
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer (CPU backend).
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16 (Brain floating point): computed in f32, rounded to
    /// nearest even on store.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision (CPU backend).
    F64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element in the canonical host representation.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// True for `f16`, `bf16`, `f32`, `f64`.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }

    /// True for the signed and unsigned integer types (not bool).
    pub fn is_int(self) -> bool {
        self.is_signed_int() || self.is_unsigned_int()
    }

    /// True for `i8` .. `i64`.
    pub fn is_signed_int(self) -> bool {
        matches!(self, DType::I8 | DType::I16 | DType::I32 | DType::I64)
    }

    /// True for `u8` .. `u64`.
    pub fn is_unsigned_int(self) -> bool {
        matches!(self, DType::U8 | DType::U16 | DType::U32 | DType::U64)
    }

    /// True for every type that supports arithmetic (all but bool).
    pub fn is_numeric(self) -> bool {
        self != DType::Bool
    }

    /// Short lowercase name, as used in error messages and dumps.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// Parses a name produced by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `v` rounded once to the nearest f32 of odd last bit when inexact
/// ("round to odd"): rounding that f32 again to any format of at most 22
/// significand bits gives the correctly rounded result of `v` (f32 has
/// more than twice their precision plus two bits).
fn f64_to_f32_round_to_odd(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f as f64 == v {
        return f;
    }
    let bits = f.to_bits();
    if bits & 1 == 1 {
        return f;
    }
    // `f` is even and inexact: its neighbour toward `v` is odd. The bits
    // are sign and magnitude, so one step of the magnitude is +-1.
    f32::from_bits(if (f as f64).abs() > v.abs() { bits - 1 } else { bits + 1 })
}

/// `v` rounded to the nearest bf16, ties to even (NaN stays NaN with its
/// sign, overflow gives inf). `half::bf16::from_f64` drops the low 32
/// bits of the f64 significand before rounding, which rounds some values
/// just above a tie down; this does not.
pub fn bf16_from_f64(v: f64) -> half::bf16 {
    half::bf16::from_f32(f64_to_f32_round_to_odd(v))
}

/// `v` rounded to the nearest f16, ties to even (correctly, like
/// [`bf16_from_f64`]; `half::f16::from_f64` has the same truncation).
pub fn f16_from_f64(v: f64) -> half::f16 {
    half::f16::from_f32(f64_to_f32_round_to_odd(v))
}

/// A scalar value as recorded by the host. Its dtype lives beside it (on
/// the node or the scalar slot); the value is kept at full width so that a
/// cast to the node's dtype is exact for every representable value.
#[derive(Clone, Copy, Debug)]
pub enum ScalarValue {
    /// A floating-point value.
    Float(f64),
    /// A signed integer value.
    Int(i64),
    /// An unsigned integer value.
    UInt(u64),
    /// A boolean value.
    Bool(bool),
}

impl ScalarValue {
    /// The value as `f64` (integers convert, bool is 0 or 1).
    pub fn as_f64(self) -> f64 {
        match self {
            ScalarValue::Float(v) => v,
            ScalarValue::Int(v) => v as f64,
            ScalarValue::UInt(v) => v as f64,
            ScalarValue::Bool(v) => v as u8 as f64,
        }
    }

    /// The value as `i64` (floats truncate toward zero, saturating).
    pub fn as_i64(self) -> i64 {
        match self {
            ScalarValue::Float(v) => v as i64,
            ScalarValue::Int(v) => v,
            ScalarValue::UInt(v) => v as i64,
            ScalarValue::Bool(v) => v as i64,
        }
    }

    /// The value as `u64` (wrapping for negative integers, as a C cast).
    pub fn as_u64(self) -> u64 {
        match self {
            ScalarValue::Float(v) => v as u64,
            ScalarValue::Int(v) => v as u64,
            ScalarValue::UInt(v) => v,
            ScalarValue::Bool(v) => v as u64,
        }
    }

    /// The value as bool (non-zero is true).
    pub fn as_bool(self) -> bool {
        match self {
            ScalarValue::Float(v) => v != 0.0,
            ScalarValue::Int(v) => v != 0,
            ScalarValue::UInt(v) => v != 0,
            ScalarValue::Bool(v) => v,
        }
    }

    /// Converts the value to the representation used for `dtype`
    /// (floats round to the dtype's precision; integers wrap like a cast).
    pub fn cast(self, dtype: DType) -> ScalarValue {
        match dtype {
            DType::Bool => ScalarValue::Bool(self.as_bool()),
            DType::F16 => ScalarValue::Float(f16_from_f64(self.as_f64()).to_f64()),
            DType::BF16 => ScalarValue::Float(bf16_from_f64(self.as_f64()).to_f64()),
            DType::F32 => ScalarValue::Float(self.as_f64() as f32 as f64),
            DType::F64 => ScalarValue::Float(self.as_f64()),
            DType::I8 => ScalarValue::Int(self.as_i64() as i8 as i64),
            DType::I16 => ScalarValue::Int(self.as_i64() as i16 as i64),
            DType::I32 => ScalarValue::Int(self.as_i64() as i32 as i64),
            DType::I64 => ScalarValue::Int(self.as_i64()),
            DType::U8 => ScalarValue::UInt(self.as_u64() as u8 as u64),
            DType::U16 => ScalarValue::UInt(self.as_u64() as u16 as u64),
            DType::U32 => ScalarValue::UInt(self.as_u64() as u32 as u64),
            DType::U64 => ScalarValue::UInt(self.as_u64()),
        }
    }

    /// True for the values that may be baked into generated code without
    /// harming cache reuse: 0, 1 and -1 (and booleans). Everything else is
    /// lifted into a parameter slot.
    pub fn is_special(self) -> bool {
        match self {
            ScalarValue::Float(v) => v == 0.0 || v == 1.0 || v == -1.0,
            ScalarValue::Int(v) => v == 0 || v == 1 || v == -1,
            ScalarValue::UInt(v) => v == 0 || v == 1,
            ScalarValue::Bool(_) => true,
        }
    }

    /// Raw bits used for hashing and equality (so that NaN == NaN and
    /// 0.0 != -0.0, which is what a cache key needs).
    fn key(self) -> (u8, u64) {
        match self {
            ScalarValue::Float(v) => (0, v.to_bits()),
            ScalarValue::Int(v) => (1, v as u64),
            ScalarValue::UInt(v) => (2, v),
            ScalarValue::Bool(v) => (3, v as u64),
        }
    }
}

impl PartialEq for ScalarValue {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for ScalarValue {}

impl Hash for ScalarValue {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state)
    }
}

impl fmt::Display for ScalarValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScalarValue::Float(v) => write!(f, "{v:?}"),
            ScalarValue::Int(v) => write!(f, "{v}"),
            ScalarValue::UInt(v) => write!(f, "{v}"),
            ScalarValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
    }

    #[test]
    fn scalar_cast_wraps_and_rounds() {
        assert_eq!(ScalarValue::Int(300).cast(DType::U8), ScalarValue::UInt(44));
        assert_eq!(ScalarValue::Float(0.1).cast(DType::F32), ScalarValue::Float(0.1f32 as f64));
        assert!(ScalarValue::Float(-1.0).is_special());
        assert!(!ScalarValue::Float(0.37).is_special());
        assert_eq!(ScalarValue::Float(f64::NAN), ScalarValue::Float(f64::NAN));
    }

    #[test]
    fn half_rounding_from_f64_is_correct_above_ties() {
        // Just above a tie, by less than f32 can hold: rounds up.
        let v = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(bf16_from_f64(v).to_bits(), 0x3F81);
        let v = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(f16_from_f64(v).to_bits(), 0x3C01);
        // Exact ties still go to even; just below goes down.
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8)).to_bits(), 0x3F80);
        assert_eq!(bf16_from_f64(1.0 + 2f64.powi(-8) - 2f64.powi(-40)).to_bits(), 0x3F80);
        assert_eq!(bf16_from_f64(-(1.0 + 2f64.powi(-8) + 2f64.powi(-40))).to_bits(), 0xBF81);
        assert!(bf16_from_f64(f64::NAN).is_nan() && bf16_from_f64(-f64::NAN).is_sign_negative());
        assert_eq!(bf16_from_f64(1e300), half::bf16::INFINITY);
        assert_eq!(bf16_from_f64(-1e-300).to_bits(), 0x8000);
        assert_eq!(f16_from_f64(70000.0), half::f16::INFINITY);
    }

    #[test]
    fn bf16_is_a_two_byte_float() {
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert!(DType::BF16.is_float() && !DType::BF16.is_int());
        assert_eq!(DType::BF16.to_string(), "bf16");
        assert_eq!(DType::from_name("bf16"), Some(DType::BF16));
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: round to even (1.0);
        // 1 + 3 * 2^-8 ties to 1 + 2^-6 (even mantissa).
        assert_eq!(ScalarValue::Float(1.0 + 2f64.powi(-8)).cast(DType::BF16), ScalarValue::Float(1.0));
        let up = 1.0 + 3.0 * 2f64.powi(-8);
        assert_eq!(ScalarValue::Float(up).cast(DType::BF16), ScalarValue::Float(1.0 + 2f64.powi(-6)));
        // bf16 keeps f32's range: 1e38 stays finite (f16 would overflow).
        assert!(ScalarValue::Float(1e38).cast(DType::BF16).as_f64().is_finite());
    }
}

macro_rules! scalar_from {
    ($($t:ty => $v:ident as $c:ty),*) => {$(
        impl From<$t> for ScalarValue {
            fn from(x: $t) -> ScalarValue {
                ScalarValue::$v(x as $c)
            }
        }
    )*};
}

scalar_from!(f32 => Float as f64, f64 => Float as f64, i8 => Int as i64, i16 => Int as i64, i32 => Int as i64,
    i64 => Int as i64, u8 => UInt as u64, u16 => UInt as u64, u32 => UInt as u64, u64 => UInt as u64,
    usize => UInt as u64, bool => Bool as bool);
