//! Leaf kernels that make values from nothing but attributes: constants,
//! lifted scalars, `Iota` and `Random` (Philox-4x32-10 from
//! `lazuli_ir::philox`).

use crate::elem::CastVal;
use crate::elementwise::scalar_cv;
use crate::memory::Memory;
use crate::storage::CpuData;
use lazuli_executor::BackendError;
use lazuli_ir::{philox, DType, RandomDist, ScalarValue};

/// A rank-0 tensor holding `v` converted to `dtype`.
pub(crate) fn scalar(mem: &Memory, v: ScalarValue, dtype: DType) -> Result<CpuData, BackendError> {
    CpuData::filled(mem, dtype, scalar_cv(v), 1)
}

/// `out[idx] = idx[axis]`, converted to `dtype`.
pub(crate) fn iota(mem: &Memory, dims: &[usize], axis: usize, dtype: DType) -> Result<CpuData, BackendError> {
    let n: usize = dims.iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let len = dims[axis];
    CpuData::from_fn(mem, dtype, n, |i| CastVal::U(((i / inner) % len) as u64))
}

/// Random f32 values of `n` elements under key `[seed, step]`.
pub(crate) fn random(mem: &Memory, n: usize, dist: RandomDist, seed: u32, step: u32) -> Result<CpuData, BackendError> {
    let f = match dist {
        RandomDist::Uniform => philox::uniform_f32,
        RandomDist::Normal => philox::normal_f32,
    };
    Ok(CpuData::F32(mem.collect(n, |i| f(seed, step, i as u64))?))
}
