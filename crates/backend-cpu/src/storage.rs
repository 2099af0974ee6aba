//! Typed host storage ([`CpuData`], [`CpuStorage`]) and the conversions
//! between it and canonical little-endian bytes.
//!
//! Each dtype has its own `Vec` variant; bool is stored as `u8` 0 or 1 and
//! f16 and bf16 as `half::f16` and `half::bf16`. The dispatch macros here (`same_all!`, `each_all!`,
//! ...) turn a generic kernel over an element type into a match over the
//! variants, so every kernel is written once.

use crate::elem::{CastVal, Elem};
use crate::memory::Memory;
use half::{bf16, f16};
use lazuli_executor::{BackendError, DeviceStorage};
use lazuli_ir::DType;
use std::any::Any;
use std::sync::Arc;

/// Tensor elements in row-major order, one variant per dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuData {
    /// Bool, one byte per element, 0 or 1.
    Bool(Vec<u8>),
    /// i8 elements.
    I8(Vec<i8>),
    /// i16 elements.
    I16(Vec<i16>),
    /// i32 elements.
    I32(Vec<i32>),
    /// i64 elements.
    I64(Vec<i64>),
    /// u8 elements.
    U8(Vec<u8>),
    /// u16 elements.
    U16(Vec<u16>),
    /// u32 elements.
    U32(Vec<u32>),
    /// u64 elements.
    U64(Vec<u64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements (computed in f32, rounded to nearest even on store).
    BF16(Vec<bf16>),
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
}

/// Matches every variant of a [`CpuData`], binding the vector as `$v`, and
/// wraps the body's `Vec` result in the same variant.
macro_rules! same_all {
    ($d:expr, $v:ident => $body:expr) => {
        match $d {
            $crate::storage::CpuData::Bool($v) => $crate::storage::CpuData::Bool($body),
            $crate::storage::CpuData::I8($v) => $crate::storage::CpuData::I8($body),
            $crate::storage::CpuData::I16($v) => $crate::storage::CpuData::I16($body),
            $crate::storage::CpuData::I32($v) => $crate::storage::CpuData::I32($body),
            $crate::storage::CpuData::I64($v) => $crate::storage::CpuData::I64($body),
            $crate::storage::CpuData::U8($v) => $crate::storage::CpuData::U8($body),
            $crate::storage::CpuData::U16($v) => $crate::storage::CpuData::U16($body),
            $crate::storage::CpuData::U32($v) => $crate::storage::CpuData::U32($body),
            $crate::storage::CpuData::U64($v) => $crate::storage::CpuData::U64($body),
            $crate::storage::CpuData::F16($v) => $crate::storage::CpuData::F16($body),
            $crate::storage::CpuData::BF16($v) => $crate::storage::CpuData::BF16($body),
            $crate::storage::CpuData::F32($v) => $crate::storage::CpuData::F32($body),
            $crate::storage::CpuData::F64($v) => $crate::storage::CpuData::F64($body),
        }
    };
}

/// Like `same_all!` for the numeric variants; bool is unreachable because
/// verified graphs never apply a numeric op to bool.
macro_rules! same_num {
    ($d:expr, $v:ident => $body:expr) => {
        match $d {
            $crate::storage::CpuData::I8($v) => $crate::storage::CpuData::I8($body),
            $crate::storage::CpuData::I16($v) => $crate::storage::CpuData::I16($body),
            $crate::storage::CpuData::I32($v) => $crate::storage::CpuData::I32($body),
            $crate::storage::CpuData::I64($v) => $crate::storage::CpuData::I64($body),
            $crate::storage::CpuData::U8($v) => $crate::storage::CpuData::U8($body),
            $crate::storage::CpuData::U16($v) => $crate::storage::CpuData::U16($body),
            $crate::storage::CpuData::U32($v) => $crate::storage::CpuData::U32($body),
            $crate::storage::CpuData::U64($v) => $crate::storage::CpuData::U64($body),
            $crate::storage::CpuData::F16($v) => $crate::storage::CpuData::F16($body),
            $crate::storage::CpuData::BF16($v) => $crate::storage::CpuData::BF16($body),
            $crate::storage::CpuData::F32($v) => $crate::storage::CpuData::F32($body),
            $crate::storage::CpuData::F64($v) => $crate::storage::CpuData::F64($body),
            $crate::storage::CpuData::Bool(_) => unreachable!("numeric op on bool in a verified graph"),
        }
    };
}

/// Like `same_all!` for the float variants only.
macro_rules! same_float {
    ($d:expr, $v:ident => $body:expr) => {
        match $d {
            $crate::storage::CpuData::F16($v) => $crate::storage::CpuData::F16($body),
            $crate::storage::CpuData::BF16($v) => $crate::storage::CpuData::BF16($body),
            $crate::storage::CpuData::F32($v) => $crate::storage::CpuData::F32($body),
            $crate::storage::CpuData::F64($v) => $crate::storage::CpuData::F64($body),
            _ => unreachable!("float op on a non-float dtype in a verified graph"),
        }
    };
}

/// Matches every variant, binding the vector as `$v`; the body's value is
/// returned as is (all arms must have the same type).
macro_rules! each_all {
    ($d:expr, $v:ident => $body:expr) => {
        match $d {
            $crate::storage::CpuData::Bool($v) => $body,
            $crate::storage::CpuData::I8($v) => $body,
            $crate::storage::CpuData::I16($v) => $body,
            $crate::storage::CpuData::I32($v) => $body,
            $crate::storage::CpuData::I64($v) => $body,
            $crate::storage::CpuData::U8($v) => $body,
            $crate::storage::CpuData::U16($v) => $body,
            $crate::storage::CpuData::U32($v) => $body,
            $crate::storage::CpuData::U64($v) => $body,
            $crate::storage::CpuData::F16($v) => $body,
            $crate::storage::CpuData::BF16($v) => $body,
            $crate::storage::CpuData::F32($v) => $body,
            $crate::storage::CpuData::F64($v) => $body,
        }
    };
}

/// Matches two values of the same variant (bool included), wrapping the
/// body's `Vec` in that variant.
macro_rules! same_all2 {
    ($x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            ($crate::storage::CpuData::Bool($a), $crate::storage::CpuData::Bool($b)) => {
                $crate::storage::CpuData::Bool($body)
            }
            ($crate::storage::CpuData::I8($a), $crate::storage::CpuData::I8($b)) => $crate::storage::CpuData::I8($body),
            ($crate::storage::CpuData::I16($a), $crate::storage::CpuData::I16($b)) => {
                $crate::storage::CpuData::I16($body)
            }
            ($crate::storage::CpuData::I32($a), $crate::storage::CpuData::I32($b)) => {
                $crate::storage::CpuData::I32($body)
            }
            ($crate::storage::CpuData::I64($a), $crate::storage::CpuData::I64($b)) => {
                $crate::storage::CpuData::I64($body)
            }
            ($crate::storage::CpuData::U8($a), $crate::storage::CpuData::U8($b)) => $crate::storage::CpuData::U8($body),
            ($crate::storage::CpuData::U16($a), $crate::storage::CpuData::U16($b)) => {
                $crate::storage::CpuData::U16($body)
            }
            ($crate::storage::CpuData::U32($a), $crate::storage::CpuData::U32($b)) => {
                $crate::storage::CpuData::U32($body)
            }
            ($crate::storage::CpuData::U64($a), $crate::storage::CpuData::U64($b)) => {
                $crate::storage::CpuData::U64($body)
            }
            ($crate::storage::CpuData::F16($a), $crate::storage::CpuData::F16($b)) => {
                $crate::storage::CpuData::F16($body)
            }
            ($crate::storage::CpuData::BF16($a), $crate::storage::CpuData::BF16($b)) => {
                $crate::storage::CpuData::BF16($body)
            }
            ($crate::storage::CpuData::F32($a), $crate::storage::CpuData::F32($b)) => {
                $crate::storage::CpuData::F32($body)
            }
            ($crate::storage::CpuData::F64($a), $crate::storage::CpuData::F64($b)) => {
                $crate::storage::CpuData::F64($body)
            }
            _ => unreachable!("operand dtypes differ in a verified graph"),
        }
    };
}

/// Like `same_all2!` for the numeric variants; bool is unreachable because
/// verified graphs never apply a numeric op to bool.
macro_rules! same_num2 {
    ($x:expr, $y:expr, $a:ident, $b:ident => $body:expr) => {
        match ($x, $y) {
            ($crate::storage::CpuData::I8($a), $crate::storage::CpuData::I8($b)) => $crate::storage::CpuData::I8($body),
            ($crate::storage::CpuData::I16($a), $crate::storage::CpuData::I16($b)) => {
                $crate::storage::CpuData::I16($body)
            }
            ($crate::storage::CpuData::I32($a), $crate::storage::CpuData::I32($b)) => {
                $crate::storage::CpuData::I32($body)
            }
            ($crate::storage::CpuData::I64($a), $crate::storage::CpuData::I64($b)) => {
                $crate::storage::CpuData::I64($body)
            }
            ($crate::storage::CpuData::U8($a), $crate::storage::CpuData::U8($b)) => $crate::storage::CpuData::U8($body),
            ($crate::storage::CpuData::U16($a), $crate::storage::CpuData::U16($b)) => {
                $crate::storage::CpuData::U16($body)
            }
            ($crate::storage::CpuData::U32($a), $crate::storage::CpuData::U32($b)) => {
                $crate::storage::CpuData::U32($body)
            }
            ($crate::storage::CpuData::U64($a), $crate::storage::CpuData::U64($b)) => {
                $crate::storage::CpuData::U64($body)
            }
            ($crate::storage::CpuData::F16($a), $crate::storage::CpuData::F16($b)) => {
                $crate::storage::CpuData::F16($body)
            }
            ($crate::storage::CpuData::BF16($a), $crate::storage::CpuData::BF16($b)) => {
                $crate::storage::CpuData::BF16($body)
            }
            ($crate::storage::CpuData::F32($a), $crate::storage::CpuData::F32($b)) => {
                $crate::storage::CpuData::F32($body)
            }
            ($crate::storage::CpuData::F64($a), $crate::storage::CpuData::F64($b)) => {
                $crate::storage::CpuData::F64($body)
            }
            _ => unreachable!("numeric operands of one dtype in a verified graph"),
        }
    };
}

pub(crate) use {each_all, same_all, same_all2, same_float, same_num, same_num2};

impl CpuData {
    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self {
            CpuData::Bool(_) => DType::Bool,
            CpuData::I8(_) => DType::I8,
            CpuData::I16(_) => DType::I16,
            CpuData::I32(_) => DType::I32,
            CpuData::I64(_) => DType::I64,
            CpuData::U8(_) => DType::U8,
            CpuData::U16(_) => DType::U16,
            CpuData::U32(_) => DType::U32,
            CpuData::U64(_) => DType::U64,
            CpuData::F16(_) => DType::F16,
            CpuData::BF16(_) => DType::BF16,
            CpuData::F32(_) => DType::F32,
            CpuData::F64(_) => DType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_all!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `n` copies of a value converted to `dtype` (with cast semantics).
    pub(crate) fn filled(mem: &Memory, dtype: DType, value: CastVal, n: usize) -> Result<CpuData, BackendError> {
        CpuData::from_fn(mem, dtype, n, |_| value)
    }

    /// Element `i` is `f(i)` converted to `dtype` (with cast semantics).
    pub(crate) fn from_fn(
        mem: &Memory,
        dtype: DType,
        n: usize,
        f: impl Fn(usize) -> CastVal,
    ) -> Result<CpuData, BackendError> {
        fn build<T: Elem>(mem: &Memory, n: usize, f: impl Fn(usize) -> CastVal) -> Result<Vec<T>, BackendError> {
            mem.collect(n, |i| T::from_cv(f(i)))
        }
        Ok(match dtype {
            DType::Bool => CpuData::Bool(mem.collect(n, |i| f(i).is_nonzero() as u8)?),
            DType::I8 => CpuData::I8(build(mem, n, f)?),
            DType::I16 => CpuData::I16(build(mem, n, f)?),
            DType::I32 => CpuData::I32(build(mem, n, f)?),
            DType::I64 => CpuData::I64(build(mem, n, f)?),
            DType::U8 => CpuData::U8(build(mem, n, f)?),
            DType::U16 => CpuData::U16(build(mem, n, f)?),
            DType::U32 => CpuData::U32(build(mem, n, f)?),
            DType::U64 => CpuData::U64(build(mem, n, f)?),
            DType::F16 => CpuData::F16(build(mem, n, f)?),
            DType::BF16 => CpuData::BF16(build(mem, n, f)?),
            DType::F32 => CpuData::F32(build(mem, n, f)?),
            DType::F64 => CpuData::F64(build(mem, n, f)?),
        })
    }

    /// Decodes canonical little-endian bytes; the length must be a whole
    /// number of `dtype` elements. A failed allocation is
    /// [`BackendError::OutOfMemory`].
    pub fn from_bytes(bytes: &[u8], dtype: DType) -> Result<CpuData, BackendError> {
        CpuData::decode(&Memory::new(Some(u64::MAX)), bytes, dtype)
    }

    /// [`CpuData::from_bytes`] allocating from `mem`.
    pub(crate) fn decode(mem: &Memory, bytes: &[u8], dtype: DType) -> Result<CpuData, BackendError> {
        let size = dtype.size_bytes();
        if !bytes.chunks_exact(size).remainder().is_empty() {
            return Err(BackendError::Execution(format!(
                "upload: {} bytes is not a whole number of {dtype} elements",
                bytes.len()
            )));
        }
        let n = bytes.len() / size;
        fn dec<T: 'static, const N: usize>(
            mem: &Memory,
            bytes: &[u8],
            n: usize,
            f: impl Fn([u8; N]) -> T,
        ) -> Result<Vec<T>, BackendError> {
            let mut v = mem.vec(n)?;
            v.extend(bytes.chunks_exact(N).map(|c| f(c.try_into().expect("chunk size"))));
            Ok(v)
        }
        Ok(match dtype {
            DType::Bool => CpuData::Bool(dec(mem, bytes, n, |[b]: [u8; 1]| (b != 0) as u8)?),
            DType::I8 => CpuData::I8(dec(mem, bytes, n, i8::from_le_bytes)?),
            DType::U8 => CpuData::U8(dec(mem, bytes, n, u8::from_le_bytes)?),
            DType::I16 => CpuData::I16(dec(mem, bytes, n, i16::from_le_bytes)?),
            DType::U16 => CpuData::U16(dec(mem, bytes, n, u16::from_le_bytes)?),
            DType::F16 => CpuData::F16(dec(mem, bytes, n, |c| f16::from_bits(u16::from_le_bytes(c)))?),
            DType::BF16 => CpuData::BF16(dec(mem, bytes, n, |c| bf16::from_bits(u16::from_le_bytes(c)))?),
            DType::I32 => CpuData::I32(dec(mem, bytes, n, i32::from_le_bytes)?),
            DType::U32 => CpuData::U32(dec(mem, bytes, n, u32::from_le_bytes)?),
            DType::F32 => CpuData::F32(dec(mem, bytes, n, f32::from_le_bytes)?),
            DType::I64 => CpuData::I64(dec(mem, bytes, n, i64::from_le_bytes)?),
            DType::U64 => CpuData::U64(dec(mem, bytes, n, u64::from_le_bytes)?),
            DType::F64 => CpuData::F64(dec(mem, bytes, n, f64::from_le_bytes)?),
        })
    }

    /// Encodes as canonical little-endian bytes. A failed allocation is
    /// [`BackendError::OutOfMemory`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, BackendError> {
        self.encode(&Memory::new(Some(u64::MAX)))
    }

    /// [`CpuData::to_bytes`] allocating from `mem` (outside its budget).
    pub(crate) fn encode(&self, mem: &Memory) -> Result<Vec<u8>, BackendError> {
        let mut out = mem.host_vec::<u8>(self.len() * self.dtype().size_bytes())?;
        match self {
            CpuData::Bool(v) | CpuData::U8(v) => out.extend_from_slice(v),
            CpuData::I8(v) => out.extend(v.iter().map(|&x| x as u8)),
            CpuData::I16(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::U16(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::F16(v) => out.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes())),
            CpuData::BF16(v) => out.extend(v.iter().flat_map(|x| x.to_bits().to_le_bytes())),
            CpuData::I32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::U32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::F32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::I64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::U64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            CpuData::F64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        }
        Ok(out)
    }
}

/// The CPU backend's [`DeviceStorage`]: typed data in host memory.
///
/// Storage made by the backend (`Memory::track`) counts as in use in its
/// `Memory` until dropped and then returns its vector to that memory's
/// pool, so a workload that allocates the same large outputs every step
/// reuses warm memory instead of faulting in fresh pages from the OS each
/// time.
#[derive(Debug)]
pub struct CpuStorage {
    /// The elements.
    pub data: CpuData,
    memory: Option<Arc<Memory>>,
}

impl CpuStorage {
    /// Storage for `data`, freed normally and counted nowhere.
    pub fn new(data: CpuData) -> CpuStorage {
        CpuStorage { data, memory: None }
    }

    /// Storage counted in `memory` (see [`Memory::track`]).
    pub(crate) fn tracked(data: CpuData, memory: &Arc<Memory>) -> CpuStorage {
        CpuStorage { data, memory: Some(memory.clone()) }
    }
}

impl Drop for CpuStorage {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            memory.release(std::mem::replace(&mut self.data, CpuData::Bool(Vec::new())));
        }
    }
}

/// The typed data of a value the CPU backend computed or bound (every
/// such storage is a [`CpuStorage`]: inputs are checked when bound).
pub(crate) fn data(s: &Arc<dyn DeviceStorage>) -> &CpuData {
    &s.as_any().downcast_ref::<CpuStorage>().expect("checked when inputs are bound").data
}

impl DeviceStorage for CpuStorage {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn byte_size(&self) -> usize {
        self.data.len() * self.data.dtype().size_bytes()
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_every_dtype() {
        for d in DType::ALL {
            let n = 5;
            let bytes: Vec<u8> = (0..n * d.size_bytes()).map(|i| (i * 37 % 251) as u8).collect();
            let bytes = if d == DType::Bool { bytes.iter().map(|b| b & 1).collect() } else { bytes };
            let data = CpuData::from_bytes(&bytes, d).unwrap();
            assert_eq!(data.dtype(), d);
            assert_eq!(data.len(), n);
            assert_eq!(data.to_bytes().unwrap(), bytes, "{d}");
        }
        assert!(CpuData::from_bytes(&[0, 1, 2], DType::F32).is_err());
    }
}
