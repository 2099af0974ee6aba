//! Typed host storage ([`CpuData`], [`CpuStorage`]) and the conversions
//! between it and canonical little-endian bytes.
//!
//! Each dtype has its own `Vec` variant; bool is stored as `u8` 0 or 1 and
//! f16 as `half::f16`. The dispatch macros here (`same_all!`, `each_all!`,
//! ...) turn a generic kernel over an element type into a match over the
//! variants, so every kernel is written once.

use crate::elem::{CastVal, Elem};
use half::f16;
use lazuli_executor::{BackendError, DeviceStorage};
use lazuli_ir::DType;
use std::any::Any;
use std::sync::{Arc, Mutex};

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

pub(crate) use {each_all, same_all, same_all2, same_float, same_num};

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

    /// `n` zeros of `dtype` (large vectors come zeroed from the OS).
    pub(crate) fn zeros(dtype: DType, n: usize) -> CpuData {
        match dtype {
            DType::Bool => CpuData::Bool(vec![0; n]),
            DType::I8 => CpuData::I8(vec![0; n]),
            DType::I16 => CpuData::I16(vec![0; n]),
            DType::I32 => CpuData::I32(vec![0; n]),
            DType::I64 => CpuData::I64(vec![0; n]),
            DType::U8 => CpuData::U8(vec![0; n]),
            DType::U16 => CpuData::U16(vec![0; n]),
            DType::U32 => CpuData::U32(vec![0; n]),
            DType::U64 => CpuData::U64(vec![0; n]),
            DType::F16 => CpuData::F16(vec![f16::ZERO; n]),
            DType::F32 => CpuData::F32(vec![0.0; n]),
            DType::F64 => CpuData::F64(vec![0.0; n]),
        }
    }

    /// `n` copies of a value converted to `dtype` (with cast semantics).
    pub(crate) fn filled(dtype: DType, value: CastVal, n: usize) -> CpuData {
        CpuData::from_fn(dtype, n, |_| value)
    }

    /// Element `i` is `f(i)` converted to `dtype` (with cast semantics).
    pub(crate) fn from_fn(dtype: DType, n: usize, f: impl Fn(usize) -> CastVal) -> CpuData {
        fn build<T: Elem>(n: usize, f: impl Fn(usize) -> CastVal) -> Vec<T> {
            (0..n).map(|i| T::from_cv(f(i))).collect()
        }
        match dtype {
            DType::Bool => CpuData::Bool((0..n).map(|i| f(i).is_nonzero() as u8).collect()),
            DType::I8 => CpuData::I8(build(n, f)),
            DType::I16 => CpuData::I16(build(n, f)),
            DType::I32 => CpuData::I32(build(n, f)),
            DType::I64 => CpuData::I64(build(n, f)),
            DType::U8 => CpuData::U8(build(n, f)),
            DType::U16 => CpuData::U16(build(n, f)),
            DType::U32 => CpuData::U32(build(n, f)),
            DType::U64 => CpuData::U64(build(n, f)),
            DType::F16 => CpuData::F16(build(n, f)),
            DType::F32 => CpuData::F32(build(n, f)),
            DType::F64 => CpuData::F64(build(n, f)),
        }
    }

    /// Decodes canonical little-endian bytes; the length must be a whole
    /// number of `dtype` elements.
    pub fn from_bytes(bytes: &[u8], dtype: DType) -> Result<CpuData, BackendError> {
        let size = dtype.size_bytes();
        if !bytes.chunks_exact(size).remainder().is_empty() {
            return Err(BackendError::Execution(format!(
                "upload: {} bytes is not a whole number of {dtype} elements",
                bytes.len()
            )));
        }
        macro_rules! dec {
            ($t:ty, $n:literal) => {
                bytes.chunks_exact($n).map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size"))).collect()
            };
        }
        Ok(match dtype {
            DType::Bool => CpuData::Bool(bytes.iter().map(|&b| (b != 0) as u8).collect()),
            DType::I8 => CpuData::I8(bytes.iter().map(|&b| b as i8).collect()),
            DType::U8 => CpuData::U8(bytes.to_vec()),
            DType::I16 => CpuData::I16(dec!(i16, 2)),
            DType::U16 => CpuData::U16(dec!(u16, 2)),
            DType::F16 => {
                CpuData::F16(bytes.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect())
            }
            DType::I32 => CpuData::I32(dec!(i32, 4)),
            DType::U32 => CpuData::U32(dec!(u32, 4)),
            DType::F32 => CpuData::F32(dec!(f32, 4)),
            DType::I64 => CpuData::I64(dec!(i64, 8)),
            DType::U64 => CpuData::U64(dec!(u64, 8)),
            DType::F64 => CpuData::F64(dec!(f64, 8)),
        })
    }

    /// Encodes as canonical little-endian bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            CpuData::Bool(v) | CpuData::U8(v) => v.clone(),
            CpuData::I8(v) => v.iter().map(|&x| x as u8).collect(),
            CpuData::I16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::U16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            CpuData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::U64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            CpuData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// The CPU backend's [`DeviceStorage`]: typed data in host memory.
///
/// Storage made by the compiled programs remembers the backend's
/// [`BufferPool`] and returns its vector there when dropped, so a workload
/// that allocates the same large outputs every step reuses warm memory
/// instead of faulting in fresh pages from the OS each time.
#[derive(Debug)]
pub struct CpuStorage {
    /// The elements.
    pub data: CpuData,
    pool: Option<Arc<BufferPool>>,
}

impl CpuStorage {
    /// Storage for `data`, freed normally.
    pub fn new(data: CpuData) -> CpuStorage {
        CpuStorage { data, pool: None }
    }

    /// Storage whose vector goes back to `pool` when dropped.
    pub(crate) fn pooled(data: CpuData, pool: &Arc<BufferPool>) -> CpuStorage {
        CpuStorage { data, pool: Some(pool.clone()) }
    }
}

impl Drop for CpuStorage {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::replace(&mut self.data, CpuData::Bool(Vec::new())));
        }
    }
}

impl DeviceStorage for CpuStorage {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn byte_size(&self) -> usize {
        self.data.len() * self.data.dtype().size_bytes()
    }
}

/// Recently freed large vectors, reused for outputs of the same dtype and
/// length. Bounded; smaller vectors are left to the allocator, which
/// already recycles them cheaply.
#[derive(Debug, Default)]
pub(crate) struct BufferPool {
    free: Mutex<Vec<CpuData>>,
}

impl BufferPool {
    /// Vectors smaller than this are not pooled.
    const MIN_BYTES: usize = 1 << 20;
    /// Most bytes kept free.
    const MAX_BYTES: usize = 512 << 20;

    /// A vector of `n` elements of `dtype` whose contents are unspecified
    /// (zeros when fresh): the caller overwrites every element.
    pub(crate) fn take(&self, dtype: DType, n: usize) -> CpuData {
        if n * dtype.size_bytes() >= Self::MIN_BYTES {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = free.iter().position(|d| d.dtype() == dtype && d.len() == n) {
                return free.swap_remove(i);
            }
        }
        CpuData::zeros(dtype, n)
    }

    fn give(&self, d: CpuData) {
        let bytes = |d: &CpuData| d.len() * d.dtype().size_bytes();
        if bytes(&d) < Self::MIN_BYTES || bytes(&d) > Self::MAX_BYTES {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.push(d);
        // Drop the oldest until the pool fits its budget.
        while free.iter().map(bytes).sum::<usize>() > Self::MAX_BYTES {
            free.remove(0);
        }
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
            assert_eq!(data.to_bytes(), bytes, "{d}");
        }
        assert!(CpuData::from_bytes(&[0, 1, 2], DType::F32).is_err());
    }
}
