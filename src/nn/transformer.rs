//! A public pre-norm transformer block, [`TransformerBlock`]: PyTorch's
//! `nn.TransformerEncoderLayer` with `norm_first=True` and
//! `batch_first=True` (its names, so its state dicts line up: `self_attn`
//! with `in_proj_weight`/`in_proj_bias`/`out_proj`, `linear1`, `linear2`,
//! `norm1`, `norm2`), multi-head self-attention through the fused
//! attention op ([`MultiheadAttention`]), an optional causal mask, an MLP
//! and dropout.
//!
//! Differences from PyTorch's defaults, on purpose: none in the values
//! (ReLU, dropout 0.1, `layer_norm_eps` 1e-5), but the block is always
//! pre-norm (`norm_first=True`, what GPT-style models use; PyTorch's
//! default is post-norm) and batch-first.

use super::activation::Activation;
use super::attention::{AttentionOptions, MultiheadAttention};
use super::dropout::Dropout;
use super::linear::Linear;
use super::norm::LayerNorm;
use super::{invalid_at, Module};
use crate::{Device, Result, Tensor};
use std::panic::Location;

/// `x + dropout1(self_attn(norm1(x)))`, then `x + dropout2(linear2(
/// dropout(activation(linear1(norm2(x))))))` over `[batch, t, d_model]`.
#[derive(Clone, Debug)]
pub struct TransformerBlock {
    /// Multi-head self-attention (causal when built so).
    pub self_attn: MultiheadAttention,
    /// `d_model -> dim_feedforward`.
    pub linear1: Linear,
    /// `dim_feedforward -> d_model`.
    pub linear2: Linear,
    /// Before attention.
    pub norm1: LayerNorm,
    /// Before the MLP.
    pub norm2: LayerNorm,
    /// Inside the MLP, after the activation.
    pub dropout: Dropout,
    /// On the attention branch.
    pub dropout1: Dropout,
    /// On the MLP branch.
    pub dropout2: Dropout,
    /// The MLP's activation (default ReLU, PyTorch's).
    pub activation: Activation,
}

impl TransformerBlock {
    /// A block of width `d_model` with `nhead` heads (dividing it) and an
    /// MLP of `dim_feedforward`, PyTorch's defaults otherwise (dropout
    /// 0.1, ReLU, eps 1e-5, not causal).
    #[track_caller]
    pub fn new(d_model: usize, nhead: usize, dim_feedforward: usize, device: &Device) -> Result<TransformerBlock> {
        let at = Location::caller();
        if d_model == 0 || dim_feedforward == 0 || nhead == 0 || !d_model.is_multiple_of(nhead) {
            return Err(invalid_at(
                "TransformerBlock",
                format!(
                    "d_model {d_model} must be a positive multiple of nhead {nhead} and dim_feedforward \
                     {dim_feedforward} positive"
                ),
                at,
            ));
        }
        Ok(TransformerBlock {
            self_attn: MultiheadAttention::new(d_model, nhead, device)?,
            linear1: Linear::new(d_model, dim_feedforward, device)?,
            linear2: Linear::new(dim_feedforward, d_model, device)?,
            norm1: LayerNorm::new(&[d_model], device)?,
            norm2: LayerNorm::new(&[d_model], device)?,
            dropout: Dropout::new(0.1),
            dropout1: Dropout::new(0.1),
            dropout2: Dropout::new(0.1),
            activation: Activation::Relu,
        })
    }

    /// Sets every dropout probability (PyTorch's `dropout` argument).
    pub fn with_dropout(mut self, p: f64) -> TransformerBlock {
        for d in [&mut self.dropout, &mut self.dropout1, &mut self.dropout2] {
            d.p = p;
        }
        self
    }

    /// Sets the MLP's activation.
    pub fn with_activation(mut self, activation: Activation) -> TransformerBlock {
        self.activation = activation;
        self
    }

    /// Makes self-attention causal (PyTorch's `is_causal=True`).
    pub fn causal(mut self, causal: bool) -> TransformerBlock {
        self.self_attn = self.self_attn.causal(causal);
        self
    }

    /// Sets the norms' epsilon (PyTorch's `layer_norm_eps`).
    pub fn with_layer_norm_eps(mut self, eps: f64) -> TransformerBlock {
        self.norm1.eps = eps;
        self.norm2.eps = eps;
        self
    }

    /// The block with `opts` for attention (a mask, a scale); the block's
    /// own causal flag applies as well.
    #[track_caller]
    pub fn forward_with(&self, x: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
        let at = Location::caller();
        let e = self.self_attn.embed_dim();
        if x.rank() != 3 || x.dims()[2] != e {
            return Err(invalid_at(
                "TransformerBlock",
                format!("expected a [batch, t, {e}] input, got {}", x.shape()),
                at,
            ));
        }
        let opts = AttentionOptions { causal: opts.causal || self.self_attn.is_causal, ..opts.clone() };
        let n1 = self.norm1.forward(x)?;
        let a = self.self_attn.attend(&n1, &n1, &n1, &opts)?;
        let x = x.add(&self.dropout1.forward(&a)?)?;
        let hidden = self.activation.forward(&self.linear1.forward(&self.norm2.forward(&x)?)?)?;
        let m = self.linear2.forward(&self.dropout.forward(&hidden)?)?;
        x.add(&self.dropout2.forward(&m)?)
    }
}

impl Module for TransformerBlock {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        self.forward_with(x, &AttentionOptions::default())
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("self_attn".into(), &self.self_attn as &dyn Module),
            ("linear1".into(), &self.linear1),
            ("dropout".into(), &self.dropout),
            ("linear2".into(), &self.linear2),
            ("norm1".into(), &self.norm1),
            ("norm2".into(), &self.norm2),
            ("dropout1".into(), &self.dropout1),
            ("dropout2".into(), &self.dropout2),
        ]
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![
            &mut self.self_attn,
            &mut self.linear1,
            &mut self.dropout,
            &mut self.linear2,
            &mut self.norm1,
            &mut self.norm2,
            &mut self.dropout1,
            &mut self.dropout2,
        ]
    }
}
