//! Leaf kernels that make values from nothing but attributes: constants,
//! lifted scalars, `Iota` and `Random` (Philox-4x32-10 from
//! `lazuli_ir::philox`).

use crate::elem::CastVal;
use crate::elementwise::scalar_cv;
use crate::storage::CpuData;
use lazuli_ir::{philox, DType, RandomDist, ScalarValue};

/// A rank-0 tensor holding `v` converted to `dtype`.
pub(crate) fn scalar(v: ScalarValue, dtype: DType) -> CpuData {
    CpuData::filled(dtype, scalar_cv(v), 1)
}

/// `out[idx] = idx[axis]`, converted to `dtype`.
pub(crate) fn iota(dims: &[usize], axis: usize, dtype: DType) -> CpuData {
    let n: usize = dims.iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let len = dims[axis];
    CpuData::from_fn(dtype, n, |i| CastVal::U(((i / inner) % len) as u64))
}

/// Random f32 values of `n` elements under key `[seed, step]`.
pub(crate) fn random(n: usize, dist: RandomDist, seed: u32, step: u32) -> CpuData {
    let f = match dist {
        RandomDist::Uniform => philox::uniform_f32,
        RandomDist::Normal => philox::normal_f32,
    };
    CpuData::F32((0..n as u64).map(|i| f(seed, step, i)).collect())
}
