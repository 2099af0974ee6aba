//! Host element types ([`Element`]): how Rust values map to dtypes and to
//! the canonical little-endian byte format backends exchange.

use lazuli_ir::{DType, ScalarValue};

/// A Rust type that can be read from or written to a tensor.
pub trait Element: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// The matching dtype.
    const DTYPE: DType;
    /// Appends the canonical bytes of `self`.
    fn write_bytes(self, out: &mut Vec<u8>);
    /// Appends the canonical bytes of every value of `data`, in order: on
    /// a little-endian host the numeric types' memory is already their
    /// canonical bytes, and this is one copy (a batch of a training loop
    /// is encoded every step).
    fn extend_bytes(data: &[Self], out: &mut Vec<u8>)
    where
        Self: Sized,
    {
        each_bytes(data, out);
    }
    /// Reads one value from canonical bytes (exactly `DTYPE.size_bytes()`).
    fn read_bytes(bytes: &[u8]) -> Self;
    /// The value as a [`ScalarValue`].
    fn to_scalar(self) -> ScalarValue;
}

macro_rules! element {
    ($t:ty, $d:expr, $variant:ident, $conv:ty) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn write_bytes(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn extend_bytes(data: &[Self], out: &mut Vec<u8>) {
                little_endian_bytes(data, out);
            }
            fn read_bytes(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element width"))
            }
            fn to_scalar(self) -> ScalarValue {
                ScalarValue::$variant(self as $conv)
            }
        }
    };
}

element!(f32, DType::F32, Float, f64);
element!(f64, DType::F64, Float, f64);
element!(i8, DType::I8, Int, i64);
element!(i16, DType::I16, Int, i64);
element!(i32, DType::I32, Int, i64);
element!(i64, DType::I64, Int, i64);
element!(u8, DType::U8, UInt, u64);
element!(u16, DType::U16, UInt, u64);
element!(u32, DType::U32, UInt, u64);
element!(u64, DType::U64, UInt, u64);

impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
    fn write_bytes(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn extend_bytes(data: &[Self], out: &mut Vec<u8>) {
        little_endian_bytes(data, out);
    }
    fn read_bytes(bytes: &[u8]) -> Self {
        half::f16::from_le_bytes(bytes.try_into().expect("element width"))
    }
    fn to_scalar(self) -> ScalarValue {
        ScalarValue::Float(self.to_f64())
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
    fn write_bytes(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn extend_bytes(data: &[Self], out: &mut Vec<u8>) {
        little_endian_bytes(data, out);
    }
    fn read_bytes(bytes: &[u8]) -> Self {
        half::bf16::from_le_bytes(bytes.try_into().expect("element width"))
    }
    fn to_scalar(self) -> ScalarValue {
        ScalarValue::Float(self.to_f64())
    }
}

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn write_bytes(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn read_bytes(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
    fn to_scalar(self) -> ScalarValue {
        ScalarValue::Bool(self)
    }
}

/// Appends `data`'s canonical (little-endian) bytes: its memory as it is
/// on a little-endian host, each value's `to_le_bytes` elsewhere.
fn little_endian_bytes<T: bytemuck::Pod + Element>(data: &[T], out: &mut Vec<u8>) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(data));
    } else {
        each_bytes(data, out);
    }
}

/// Appends each value's `write_bytes`, one after another.
fn each_bytes<T: Element>(data: &[T], out: &mut Vec<u8>) {
    for &v in data {
        v.write_bytes(out);
    }
}

/// Encodes a slice as canonical bytes.
pub fn to_bytes<T: Element>(data: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() * T::DTYPE.size_bytes());
    T::extend_bytes(data, &mut out);
    out
}

/// Decodes canonical bytes.
pub fn from_bytes<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::DTYPE.size_bytes()).map(T::read_bytes).collect()
}

/// Encodes one scalar value as canonical bytes of `dtype`.
pub fn scalar_bytes(v: ScalarValue, dtype: DType) -> Vec<u8> {
    let v = v.cast(dtype);
    let mut out = Vec::with_capacity(dtype.size_bytes());
    match dtype {
        DType::Bool => v.as_bool().write_bytes(&mut out),
        DType::F16 => lazuli_ir::f16_from_f64(v.as_f64()).write_bytes(&mut out),
        DType::BF16 => lazuli_ir::bf16_from_f64(v.as_f64()).write_bytes(&mut out),
        DType::F32 => (v.as_f64() as f32).write_bytes(&mut out),
        DType::F64 => v.as_f64().write_bytes(&mut out),
        DType::I8 => (v.as_i64() as i8).write_bytes(&mut out),
        DType::I16 => (v.as_i64() as i16).write_bytes(&mut out),
        DType::I32 => (v.as_i64() as i32).write_bytes(&mut out),
        DType::I64 => v.as_i64().write_bytes(&mut out),
        DType::U8 => (v.as_u64() as u8).write_bytes(&mut out),
        DType::U16 => (v.as_u64() as u16).write_bytes(&mut out),
        DType::U32 => (v.as_u64() as u32).write_bytes(&mut out),
        DType::U64 => v.as_u64().write_bytes(&mut out),
    }
    out
}

/// Decodes element `i` of canonical bytes of `dtype` as a [`ScalarValue`].
pub fn read_scalar(bytes: &[u8], dtype: DType, i: usize) -> ScalarValue {
    let w = dtype.size_bytes();
    let b = &bytes[i * w..(i + 1) * w];
    match dtype {
        DType::Bool => ScalarValue::Bool(b[0] != 0),
        DType::F16 => half::f16::read_bytes(b).to_scalar(),
        DType::BF16 => half::bf16::read_bytes(b).to_scalar(),
        DType::F32 => f32::read_bytes(b).to_scalar(),
        DType::F64 => f64::read_bytes(b).to_scalar(),
        DType::I8 => i8::read_bytes(b).to_scalar(),
        DType::I16 => i16::read_bytes(b).to_scalar(),
        DType::I32 => i32::read_bytes(b).to_scalar(),
        DType::I64 => i64::read_bytes(b).to_scalar(),
        DType::U8 => u8::read_bytes(b).to_scalar(),
        DType::U16 => u16::read_bytes(b).to_scalar(),
        DType::U32 => u32::read_bytes(b).to_scalar(),
        DType::U64 => u64::read_bytes(b).to_scalar(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each element's bytes one by one, as `write_bytes` writes them.
    fn one_by_one<T: Element>(data: &[T]) -> Vec<u8> {
        let mut out = Vec::new();
        for &v in data {
            v.write_bytes(&mut out);
        }
        out
    }

    #[test]
    fn bulk_encoding_is_each_values_canonical_bytes() {
        fn check<T: Element + std::fmt::Debug + PartialEq>(data: &[T]) {
            let bulk = to_bytes(data);
            assert_eq!(bulk, one_by_one(data), "{:?}", T::DTYPE);
            assert_eq!(from_bytes::<T>(&bulk), data, "{:?}", T::DTYPE);
        }
        check(&[1.5f32, -0.0, f32::MAX, 3e-39]);
        check(&[1.5f64, -2.25]);
        check(&[-3i8, 7]);
        check(&[-300i16, 7]);
        check(&[-70000i32, 0x1234_5678]);
        check(&[-1i64, 1 << 40]);
        check(&[200u8, 1]);
        check(&[60000u16, 2]);
        check(&[0xdead_beefu32, 3]);
        check(&[u64::MAX, 4]);
        check(&[half::f16::from_f32(1.5), half::f16::NEG_INFINITY]);
        check(&[half::bf16::from_f32(-2.0), half::bf16::ONE]);
        check(&[true, false, true]);
        assert_eq!(to_bytes(&[1.0f32]), [0, 0, 0x80, 0x3f], "little endian");
    }
}
