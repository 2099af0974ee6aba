//! Elementwise activations: the functional forms ([`relu`], [`gelu`],
//! [`leaky_relu`], [`sigmoid`], [`tanh`], [`silu`], [`softmax`],
//! [`log_softmax`]) and [`Activation`], which makes one of them a module
//! for a [`super::Sequential`].

use super::Module;
use crate::{Result, Tensor};

/// Elementwise activation functions, usable as modules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// `x` for `x > 0`, else `slope * x`.
    LeakyRelu(f64),
    /// Exact GELU.
    Gelu,
    /// Logistic sigmoid.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// `x * sigmoid(x)`.
    Silu,
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Activation::Relu => relu(x),
            Activation::LeakyRelu(s) => leaky_relu(x, s),
            Activation::Gelu => gelu(x),
            Activation::Sigmoid => sigmoid(x),
            Activation::Tanh => tanh(x),
            Activation::Silu => silu(x),
        }
    }
}

/// `max(x, 0)`.
#[track_caller]
pub fn relu(x: &Tensor) -> Result<Tensor> {
    x.relu()
}

/// `x` where positive, else `slope * x`.
#[track_caller]
pub fn leaky_relu(x: &Tensor, slope: f64) -> Result<Tensor> {
    let zero = Tensor::scalar(0, x.dtype(), x.device());
    x.gt(&zero)?.where_(x, &x.mul(&Tensor::scalar(slope, x.dtype(), x.device()))?)
}

/// Exact (erf) GELU.
#[track_caller]
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu()
}

/// Logistic sigmoid.
#[track_caller]
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    x.sigmoid()
}

/// Hyperbolic tangent.
#[track_caller]
pub fn tanh(x: &Tensor) -> Result<Tensor> {
    x.tanh()
}

/// SiLU / swish: `x * sigmoid(x)`.
#[track_caller]
pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.mul(&x.sigmoid()?)
}

/// Softmax along `axis`.
#[track_caller]
pub fn softmax(x: &Tensor, axis: isize) -> Result<Tensor> {
    x.softmax(axis)
}

/// Log-softmax along `axis`.
#[track_caller]
pub fn log_softmax(x: &Tensor, axis: isize) -> Result<Tensor> {
    x.log_softmax(axis)
}
