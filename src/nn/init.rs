//! Seeded parameter initialization: [`Init`], the distributions layers
//! draw their weights from (Kaiming, Xavier, LeCun, uniform, normal,
//! constant) with the device RNG, and the helper that makes a drawn tensor
//! a trainable leaf.

use crate::{DType, Device, Result, Tensor};

/// How to initialize a parameter of a layer with `fan_in` inputs and
/// `fan_out` outputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// He/Kaiming uniform for ReLU nets: `U(-b, b)`, `b = sqrt(6 / fan_in)`
    /// (PyTorch's `kaiming_uniform_` with its defaults; `sqrt(6)` times the
    /// layers' default bound, [`Init::LecunUniform`]).
    KaimingUniform,
    /// He/Kaiming normal: `N(0, 2 / fan_in)`.
    KaimingNormal,
    /// Glorot/Xavier uniform: `U(-b, b)`, `b = sqrt(6 / (fan_in + fan_out))`.
    XavierUniform,
    /// Glorot/Xavier normal: `N(0, 2 / (fan_in + fan_out))`.
    XavierNormal,
    /// PyTorch's default for the weights and biases of `nn.Linear` and
    /// `nn.Conv2d` (their `reset_parameters`: Kaiming uniform with
    /// `a = sqrt(5)`), and the default of [`Linear`](super::Linear) and
    /// [`Conv2d`](super::Conv2d) here: `U(-b, b)`, `b = 1 / sqrt(fan_in)`.
    /// (Keras's `lecun_uniform` is wider, `b = sqrt(3 / fan_in)`; use
    /// [`Init::Uniform`] for it.)
    LecunUniform,
    /// `U(lo, hi)`.
    Uniform(f64, f64),
    /// `N(0, std^2)`.
    Normal(f64),
    /// All elements equal to the value.
    Constant(f64),
}

impl Init {
    /// A new f32 tensor of `shape` drawn from this distribution.
    pub fn tensor(self, shape: &[usize], fan_in: usize, fan_out: usize, device: &Device) -> Result<Tensor> {
        let (fi, fo) = (fan_in.max(1) as f64, fan_out.max(1) as f64);
        let uniform = |b: f64| Tensor::rand_uniform(shape.to_vec(), -b, b, DType::F32, device);
        let normal =
            |std: f64| Tensor::randn(shape.to_vec(), DType::F32, device)?.mul(&Tensor::scalar(std, DType::F32, device));
        match self {
            Init::KaimingUniform => uniform((6.0 / fi).sqrt()),
            Init::KaimingNormal => normal((2.0 / fi).sqrt()),
            Init::XavierUniform => uniform((6.0 / (fi + fo)).sqrt()),
            Init::XavierNormal => normal((2.0 / (fi + fo)).sqrt()),
            Init::LecunUniform => uniform(1.0 / fi.sqrt()),
            Init::Uniform(lo, hi) => Tensor::rand_uniform(shape.to_vec(), lo, hi, DType::F32, device),
            Init::Normal(std) => normal(std),
            Init::Constant(v) => Tensor::full(shape.to_vec(), v, DType::F32, device),
        }
    }
}

/// A parameter: `init` drawn, then marked as a leaf that requires grad.
pub(super) fn parameter(init: Init, shape: &[usize], fan_in: usize, fan_out: usize, device: &Device) -> Result<Tensor> {
    init.tensor(shape, fan_in, fan_out, device)?.requires_grad_(true)
}
