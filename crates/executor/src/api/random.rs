//! Device-seeded random tensors: uniform, normal, Bernoulli masks and
//! dropout, all recorded as `Op::Random` (Philox-4x32-10, see
//! `lazuli_ir::philox`).
//!
//! Each random op takes a fresh stream from the device RNG: its two key
//! words are derived from the device seed ([`Device::manual_seed`]), the
//! step counter (advanced by [`Device::mark_step`]) and the op's offset in
//! the step. The keys are lifted scalars, never baked, so a training loop
//! that draws the same random shapes every step keeps one graph hash.

use crate::{Device, Result, Tensor};
use lazuli_ir::{DType, Op, RandomDist, ScalarValue, Shape};

/// SplitMix64's step and finalizer: a bijective 64-bit mix, used for
/// device key words here and for host-side seeds elsewhere.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

use splitmix64 as mix;

/// A small seeded generator for host-side choices such as the order of
/// training samples (SplitMix64; not the device's Philox stream): the same
/// seed gives the same numbers on every platform and rank.
#[derive(Clone, Debug)]
pub struct HostRng(u64);

impl HostRng {
    /// The generator whose state starts at `seed`.
    pub fn new(seed: u64) -> HostRng {
        HostRng(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        let z = self.0;
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(z)
    }

    /// Shuffles `v` in place (Fisher-Yates, last element first).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The key words of the next random op on `device`, as lifted u32 scalars.
fn next_keys(device: &Device) -> (Tensor, Tensor) {
    let (seed, step, offset) = {
        let mut rng = device.0.rng.lock().unwrap_or_else(|e| e.into_inner());
        let s = (rng.seed, rng.step, rng.offset);
        rng.offset += 1;
        s
    };
    let k = mix(seed ^ mix(offset));
    let k0 = k as u32;
    let k1 = (step as u32) ^ ((k >> 32) as u32);
    (
        Tensor::lifted_scalar(ScalarValue::UInt(k0 as u64), DType::U32, device),
        Tensor::lifted_scalar(ScalarValue::UInt(k1 as u64), DType::U32, device),
    )
}

impl Tensor {
    /// Uniform values in `[0, 1)` of `shape`, as `dtype` (a float dtype;
    /// drawn in f32).
    #[track_caller]
    pub fn rand(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let (k0, k1) = next_keys(device);
        Tensor::record_on(device, Op::Random { shape: shape.into(), dist: RandomDist::Uniform }, &[&k0, &k1])?
            .cast(dtype)
    }

    /// Standard normal values of `shape`, as `dtype` (drawn in f32).
    #[track_caller]
    pub fn randn(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let (k0, k1) = next_keys(device);
        Tensor::record_on(device, Op::Random { shape: shape.into(), dist: RandomDist::Normal }, &[&k0, &k1])?
            .cast(dtype)
    }

    /// Uniform values in `[lo, hi)`.
    #[track_caller]
    pub fn rand_uniform(shape: impl Into<Shape>, lo: f64, hi: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let u = Tensor::rand(shape, dtype, device)?;
        u.mul(&Tensor::scalar(hi - lo, dtype, device))?.add(&Tensor::scalar(lo, dtype, device))
    }

    /// A bool mask of `shape`, each element true with probability `p`.
    #[track_caller]
    pub fn bernoulli(shape: impl Into<Shape>, p: f64, device: &Device) -> Result<Tensor> {
        let u = Tensor::rand(shape, DType::F32, device)?;
        u.lt(&Tensor::lifted_scalar(ScalarValue::Float(p), DType::F32, device))
    }

    /// Inverted dropout: in training, zeroes each element with probability
    /// `p` and scales the others by `1 / (1 - p)`; otherwise the identity.
    #[track_caller]
    pub fn dropout(&self, p: f64, training: bool) -> Result<Tensor> {
        if !training || p <= 0.0 {
            return Ok(self.clone());
        }
        if p >= 1.0 {
            return self.mul(&Tensor::scalar(0, self.dtype(), self.device()));
        }
        let keep = Tensor::bernoulli(self.shape().clone(), 1.0 - p, self.device())?;
        let scale = Tensor::lifted_scalar(ScalarValue::Float(1.0 / (1.0 - p)), self.dtype(), self.device());
        keep.where_(&self.mul(&scale)?, &Tensor::scalar(0, self.dtype(), self.device()))
    }
}
