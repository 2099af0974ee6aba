//! Attention: [`scaled_dot_product_attention`] (one fused op), its
//! unfused reference [`scaled_dot_product_attention_unfused`],
//! [`causal_mask`], the [`AttentionOptions`] both take, and the
//! [`MultiheadAttention`] layer built on them.

use super::init::{parameter, Init};
use super::linear::Linear;
use super::{invalid, Module};
use crate::{DType, Device, Result, Tensor};

/// An additive causal mask `[t_q, t_k]` of `dtype`: 0 where query `i` may
/// attend to key `j` (`j <= i`, aligned at the top left as PyTorch's
/// `is_causal`), `-inf` elsewhere. Add it to attention scores, or pass it
/// as [`AttentionOptions::mask`].
#[track_caller]
pub fn causal_mask(t_q: usize, t_k: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    if !dtype.is_float() {
        return Err(invalid("causal_mask", format!("an additive mask needs a float dtype, got {dtype}")));
    }
    let keep = causal_keep(t_q, t_k, device)?;
    keep.where_(&Tensor::scalar(0.0, dtype, device), &Tensor::scalar(f64::NEG_INFINITY, dtype, device))
}

/// `[t_q, t_k]` bool: true where `j <= i`.
fn causal_keep(t_q: usize, t_k: usize, device: &Device) -> Result<Tensor> {
    let i = Tensor::iota([t_q, t_k], 0, DType::I32, device)?;
    let j = Tensor::iota([t_q, t_k], 1, DType::I32, device)?;
    j.le(&i)
}

/// Options of [`scaled_dot_product_attention`]; the default is plain,
/// unmasked attention scaled by `1 / sqrt(head_dim)`.
#[derive(Clone, Debug, Default)]
pub struct AttentionOptions {
    /// Query `i` attends only to keys `j <= i` (top-left aligned, as
    /// PyTorch's `is_causal`).
    pub causal: bool,
    /// A mask broadcastable to the scores `[.., t_q, t_k]`: float, added
    /// to the scores (`-inf` removes a key), or bool, true where a query
    /// may attend (PyTorch's `attn_mask`). Combines with `causal`.
    pub mask: Option<Tensor>,
    /// The score scale; `1 / sqrt(head_dim)` when `None`.
    pub scale: Option<f64>,
}

impl AttentionOptions {
    /// Causal attention.
    pub fn causal() -> AttentionOptions {
        AttentionOptions { causal: true, ..AttentionOptions::default() }
    }

    /// With a mask (float additive or bool keep).
    pub fn with_mask(mut self, mask: Tensor) -> AttentionOptions {
        self.mask = Some(mask);
        self
    }

    /// With an explicit score scale.
    pub fn with_scale(mut self, scale: f64) -> AttentionOptions {
        self.scale = Some(scale);
        self
    }
}

/// Scaled dot-product attention: `softmax(q k^T * scale + mask) v` over
/// `q` `[.., t_q, d]`, `k` `[.., t_k, d]`, `v` `[.., t_k, d_v]` (leading
/// dims broadcast, e.g. `[batch, heads]`), giving `[.., t_q, d_v]`; any
/// lengths and head dims.
///
/// It records one fused op ([`Tensor::attention`]): the `[t_q, t_k]`
/// scores are never materialized, forward or backward (FlashAttention-2:
/// the backward recomputes them blockwise from the forward's per-query
/// log-sum-exp), on every backend. A query whose keys are all masked gets
/// NaN, like PyTorch's math backend. Two cases record the unfused
/// composition instead ([`scaled_dot_product_attention_unfused`], whose
/// results the fused op matches up to rounding): a mask that needs a
/// gradient (the fused op has none for it), and a mask whose last two
/// dims would grow the scores beyond `[t_q, t_k]`.
#[track_caller]
pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
    let scale = check_attention(q, k, v, opts)?;
    let (tq, tk) = (q.dims()[q.rank() - 2], k.dims()[k.rank() - 2]);
    if let Some(m) = &opts.mask {
        let md = m.dims();
        let at = |back: usize| if md.len() >= back { md[md.len() - back] } else { 1 };
        let fits = (at(2) == 1 || at(2) == tq) && (at(1) == 1 || at(1) == tk);
        if !fits || m.requires_grad() {
            return scaled_dot_product_attention_unfused(q, k, v, opts);
        }
    }
    q.attention(k, v, scale, opts.causal, opts.mask.as_ref())
}

/// Scaled dot-product attention as its unfused composition: two matmuls
/// around a softmax, the `[.., t_q, t_k]` scores materialized, gradients
/// from autodiff of each op. The reference the fused
/// [`scaled_dot_product_attention`] is tested against (same arguments,
/// same results up to rounding), and its path for masks that need a
/// gradient.
#[track_caller]
pub fn scaled_dot_product_attention_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOptions,
) -> Result<Tensor> {
    let scale = check_attention(q, k, v, opts)?;
    let (dt, dev) = (q.dtype(), q.device());
    let (tq, tk) = (q.dims()[q.rank() - 2], k.dims()[k.rank() - 2]);
    let mut scores = q.matmul(&k.t()?)?.mul(&Tensor::scalar(scale, dt, dev))?;
    let neg_inf = Tensor::scalar(f64::NEG_INFINITY, dt, dev);
    if opts.causal {
        scores = causal_keep(tq, tk, dev)?.where_(&scores, &neg_inf)?;
    }
    if let Some(m) = &opts.mask {
        scores = match m.dtype() {
            DType::Bool => m.where_(&scores, &neg_inf)?,
            _ => scores.add(m)?,
        };
    }
    scores.softmax(-1)?.matmul(v)
}

/// Checks the operands of scaled dot-product attention; returns the scale.
fn check_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> Result<f64> {
    let op = "scaled_dot_product_attention";
    let (rq, rk, rv) = (q.rank(), k.rank(), v.rank());
    let shapes = || format!("q {}, k {}, v {}", q.shape(), k.shape(), v.shape());
    if rq < 2 || rk < 2 || rv < 2 {
        return Err(invalid(op, format!("q, k and v need rank >= 2 ([.., t, d]), got {}", shapes())));
    }
    if q.dims()[rq - 1] != k.dims()[rk - 1] || k.dims()[rk - 2] != v.dims()[rv - 2] {
        return Err(invalid(
            op,
            format!("q and k need the same head dim and k and v the same length, got {}", shapes()),
        ));
    }
    let dt = q.dtype();
    if !dt.is_float() || dt != k.dtype() || dt != v.dtype() {
        return Err(invalid(
            op,
            format!("q, k and v need one float dtype, got {}, {} and {}", q.dtype(), k.dtype(), v.dtype()),
        ));
    }
    if let Some(m) = &opts.mask {
        if m.dtype() != DType::Bool && m.dtype() != dt {
            return Err(invalid(op, format!("the mask must be bool or {dt} (the scores' dtype), got {}", m.dtype())));
        }
    }
    let d = q.dims()[rq - 1];
    Ok(opts.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt()))
}

/// Multi-head attention, PyTorch's `nn.MultiheadAttention` with
/// `batch_first=True`: inputs `[batch, t, embed_dim]`, one packed input
/// projection `in_proj_weight` `[3 * embed, embed]` (+ `in_proj_bias`),
/// `num_heads` heads of `embed / num_heads` dims through
/// [`scaled_dot_product_attention`], and the output projection
/// `out_proj`. [`Module::forward`] is self-attention (causal when built
/// with [`MultiheadAttention::causal`]); [`MultiheadAttention::attend`]
/// takes separate query, key and value and any [`AttentionOptions`].
#[derive(Clone, Debug)]
pub struct MultiheadAttention {
    /// `[3 * embed_dim, embed_dim]`: the query, key and value projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3 * embed_dim]`.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection.
    pub out_proj: Linear,
    /// Number of heads.
    pub num_heads: usize,
    /// Self-attention in [`Module::forward`] is causal.
    pub is_causal: bool,
}

impl MultiheadAttention {
    /// `num_heads` heads over `embed_dim` (a multiple of it), with biases:
    /// Xavier-uniform input projection, zero biases, PyTorch's.
    pub fn new(embed_dim: usize, num_heads: usize, device: &Device) -> Result<MultiheadAttention> {
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(invalid(
                "MultiheadAttention",
                format!("embed_dim {embed_dim} is not a multiple of num_heads {num_heads}"),
            ));
        }
        let e = embed_dim;
        Ok(MultiheadAttention {
            in_proj_weight: parameter(Init::XavierUniform, &[3 * e, e], e, 3 * e, device)?,
            in_proj_bias: Some(parameter(Init::Constant(0.0), &[3 * e], e, 3 * e, device)?),
            out_proj: Linear::with_init(e, e, true, Init::LecunUniform, Init::Constant(0.0), device)?,
            num_heads,
            is_causal: false,
        })
    }

    /// Makes [`Module::forward`] causal self-attention.
    pub fn causal(mut self, causal: bool) -> MultiheadAttention {
        self.is_causal = causal;
        self
    }

    /// Embedding width.
    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.dims()[1]
    }

    /// Attention of `query` (`[b, t_q, e]`) over `key` and `value`
    /// (`[b, t_k, e]`); a mask in `opts` broadcasts to `[b, heads, t_q, t_k]`.
    pub fn attend(&self, query: &Tensor, key: &Tensor, value: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
        let e = self.embed_dim();
        let h = self.num_heads;
        for t in [query, key, value] {
            if t.rank() != 3 || t.dims()[2] != e {
                return Err(invalid(
                    "MultiheadAttention",
                    format!(
                        "expected [batch, t, {e}] inputs, got {}, {} and {}",
                        query.shape(),
                        key.shape(),
                        value.shape()
                    ),
                ));
            }
        }
        let project = |x: &Tensor, i: usize| -> Result<Tensor> {
            let w = self.in_proj_weight.narrow(0, i * e, e)?;
            let mut y = x.matmul(&w.t()?)?;
            if let Some(b) = &self.in_proj_bias {
                y = y.add(&b.narrow(0, i * e, e)?)?;
            }
            // [b, t, e] -> [b, h, t, e / h]
            let (b, t) = (x.dims()[0], x.dims()[1]);
            y.reshape([b, t, h, e / h])?.permute(&[0, 2, 1, 3])
        };
        let (q, k, v) = (project(query, 0)?, project(key, 1)?, project(value, 2)?);
        let o = scaled_dot_product_attention(&q, &k, &v, opts)?;
        let (b, t) = (query.dims()[0], query.dims()[1]);
        self.out_proj.forward(&o.permute(&[0, 2, 1, 3])?.reshape([b, t, e])?)
    }
}

impl Module for MultiheadAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let opts = AttentionOptions { causal: self.is_causal, ..AttentionOptions::default() };
        self.attend(x, x, x, &opts)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("in_proj_weight".to_string(), self.in_proj_weight.clone())];
        v.extend(self.in_proj_bias.iter().map(|b| ("in_proj_bias".to_string(), b.clone())));
        v
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("out_proj".into(), &self.out_proj as &dyn Module)]
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.in_proj_weight];
        v.extend(self.in_proj_bias.as_mut());
        v
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.out_proj]
    }
}
