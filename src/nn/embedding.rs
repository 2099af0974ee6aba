//! Lookup by integer ids: the [`Embedding`] table and [`one_hot`]
//! encoding (PyTorch lists both among its sparse functions).

use super::init::{parameter, Init};
use super::{invalid, Module};
use crate::{DType, Device, Result, Tensor};

/// A lookup table: `forward(ids)` gathers rows of `weight` (`[num, dim]`)
/// for integer `ids` of any shape, giving `[..ids, dim]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// `[num_embeddings, dim]`, initialized `N(0, 1)`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num` rows of `dim` values.
    pub fn new(num: usize, dim: usize, device: &Device) -> Result<Embedding> {
        Ok(Embedding { weight: parameter(Init::Normal(1.0), &[num, dim], num, dim, device)? })
    }
}

impl Module for Embedding {
    /// The rows of `weight` for `ids` ([`Tensor::embedding`]): an id
    /// outside `0..num_embeddings` is an error at the barrier that names
    /// the line of this call as an embedding lookup.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if !ids.dtype().is_int() {
            let [num, dim] = [self.weight.dims()[0], self.weight.dims()[1]];
            return Err(invalid(
                &format!("Embedding({num}, {dim})"),
                format!("ids must be integers, got {}{}", ids.dtype(), ids.shape()),
            ));
        }
        self.weight.embedding(ids)
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.weight]
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone())]
    }

    fn own_no_weight_decay(&self) -> Vec<String> {
        vec!["weight".into()]
    }
}

/// One-hot encoding of integer `labels` (any shape `[..]`) as `dtype`,
/// shape `[.., classes]`; a label outside `0..classes` gives a row of zeros.
#[track_caller]
pub fn one_hot(labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    if !labels.dtype().is_int() {
        return Err(invalid(
            "one_hot",
            format!("labels must have an integer dtype, got {}{}", labels.dtype(), labels.shape()),
        ));
    }
    let mut dims = labels.dims().to_vec();
    dims.push(classes);
    let cols = Tensor::iota(dims.clone(), dims.len() - 1, labels.dtype(), labels.device())?;
    labels.unsqueeze(-1)?.eq(&cols)?.cast(dtype)
}
