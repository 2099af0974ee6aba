//! The fully connected layer, [`Linear`]: `y = x W^T + b` over the last
//! dim, with PyTorch's weight layout and default initialization.

use super::init::{parameter, Init};
use super::{invalid, Module};
use crate::{Device, Result, Tensor};

/// `y = x W^T + b` over the last dim of `x`; `weight` is `[out, in]`
/// (PyTorch's layout), `bias` is `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer with PyTorch's default initialization: weights and biases
    /// both from `U(+-1/sqrt(in_features))` ([`Init::LecunUniform`]);
    /// [`Linear::with_init`] chooses others.
    pub fn new(in_features: usize, out_features: usize, device: &Device) -> Result<Linear> {
        Linear::with_init(in_features, out_features, true, Init::LecunUniform, Init::LecunUniform, device)
    }

    /// A layer with the given initializations (`bias_init` is ignored
    /// without a bias).
    pub fn with_init(
        in_features: usize,
        out_features: usize,
        bias: bool,
        weight_init: Init,
        bias_init: Init,
        device: &Device,
    ) -> Result<Linear> {
        let weight = parameter(weight_init, &[out_features, in_features], in_features, out_features, device)?;
        let bias =
            if bias { Some(parameter(bias_init, &[out_features], in_features, out_features, device)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

impl Linear {
    /// The layer as PyTorch prints it, for errors.
    fn describe(&self) -> String {
        format!(
            "Linear(in_features={}, out_features={}, bias={})",
            self.in_features(),
            self.out_features(),
            self.bias.is_some()
        )
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let features = x.dims().last().copied();
        if features != Some(self.in_features()) {
            return Err(invalid(
                &self.describe(),
                format!(
                    "input of shape {} has {} features in its last dim, expected in_features = {}",
                    x.shape(),
                    features.map_or_else(|| "no".to_string(), |f| f.to_string()),
                    self.in_features()
                ),
            ));
        }
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            // Under autocast in the product's dtype (PyTorch's `addmm`).
            Some(b) => y.add(&crate::amp::bias_like(b, &y)?),
            None => Ok(y),
        }
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        v.extend(self.bias.iter().map(|b| ("bias".to_string(), b.clone())));
        v
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.weight];
        v.extend(self.bias.as_mut());
        v
    }
}
