//! Rotary position embeddings, [`RotaryEmbedding`] (RoPE, Su et al.):
//! each pair of features of a query or key at position `p` is rotated by
//! the angle `p * base^(-2i / dim)`, so attention scores depend on
//! relative positions only.
//!
//! Convention, chosen on purpose: the *half rotation* of GPT-NeoX and
//! Hugging Face's LLaMA (`rotate_half`): feature `i` pairs with feature
//! `i + dim / 2`, and `out = x * cos + rotate_half(x) * sin` with
//! `rotate_half(x) = [-x2, x1]`. Checkpoints converted for that layout
//! (Hugging Face's LLaMA, NeoX, Mistral, Qwen) use it;
//! [`RotaryEmbedding::interleaved`] switches to the pairs `(2i, 2i + 1)` of
//! GPT-J and Meta's original LLaMA code. With `dim` smaller than the last
//! dim, only the first `dim` features rotate and the rest pass through
//! (NeoX's partial rotary). The angles are computed on the device in the
//! input's dtype from positions `offset..offset + t` (the offset lets
//! generation continue a cached prefix; it travels as a lifted scalar, so
//! a new offset compiles nothing, except that 0 and 1, special constants,
//! have a plan each), the inverse frequencies in f64 rounded once to f32.

use super::{invalid_at, Module};
use crate::{DType, Result, Tensor};
use std::panic::Location;

/// Rotary position embeddings over the last dim of `[.., t, features]`
/// inputs (queries or keys, e.g. `[batch, heads, t, head_dim]`), with
/// positions along dim -2. No parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct RotaryEmbedding {
    /// Features rotated (even): the first `dim` of the last dim.
    pub dim: usize,
    /// The frequency base (10000 in RoFormer, LLaMA and NeoX).
    pub base: f64,
    /// Pairs `(2i, 2i + 1)` (GPT-J) instead of `(i, i + dim / 2)` (NeoX).
    pub interleaved: bool,
}

impl RotaryEmbedding {
    /// Half-rotation RoPE over `dim` features (even, non-zero) with
    /// frequency base `base` (positive).
    #[track_caller]
    pub fn new(dim: usize, base: f64) -> Result<RotaryEmbedding> {
        let at = Location::caller();
        if dim == 0 || !dim.is_multiple_of(2) || !(base.is_finite() && base > 0.0) {
            return Err(invalid_at(
                "RotaryEmbedding",
                format!("dim {dim} must be even and non-zero and base {base} positive"),
                at,
            ));
        }
        Ok(RotaryEmbedding { dim, base, interleaved: false })
    }

    /// Switches to interleaved pairs (GPT-J, Meta's LLaMA reference).
    pub fn interleaved(mut self, interleaved: bool) -> RotaryEmbedding {
        self.interleaved = interleaved;
        self
    }

    /// `x` (`[.., t, features]`, float, `features >= dim`) rotated for
    /// positions `offset..offset + t`.
    #[track_caller]
    pub fn apply(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        let at = Location::caller();
        let r = x.rank();
        if r < 2 || x.dims()[r - 1] < self.dim || !x.dtype().is_float() {
            return Err(invalid_at(
                "RotaryEmbedding",
                format!(
                    "expected a float [.., t, features] input with at least {} features, got {} {}",
                    self.dim,
                    x.dtype(),
                    x.shape()
                ),
                at,
            ));
        }
        let (t, features) = (x.dims()[r - 2], x.dims()[r - 1]);
        if offset + t > 1 << 24 {
            return Err(invalid_at(
                "RotaryEmbedding",
                format!("positions up to {} are beyond f32's exact integers", offset + t),
                at,
            ));
        }
        let (dev, dt) = (x.device(), x.dtype());
        let half = self.dim / 2;
        let inv: Vec<f32> =
            (0..half).map(|i| (1.0 / self.base.powf((2 * i) as f64 / self.dim as f64)) as f32).collect();
        let inv = Tensor::from_slice(&inv, [1, half], dev)?;
        let pos = Tensor::iota([t, 1], 0, DType::F32, dev)?.add_scalar(offset as f64)?;
        let angles = pos.mul(&inv)?; // [t, half]
        let (cos, sin) = (angles.cos()?.cast(dt)?, angles.sin()?.cast(dt)?);
        let rot = if features == self.dim { x.clone() } else { x.narrow(-1, 0, self.dim)? };
        let out = if self.interleaved {
            let mut dims = rot.dims().to_vec();
            dims.pop();
            dims.extend([half, 2]);
            let pairs = rot.reshape_to(dims)?;
            let (xe, xo) = (pairs.narrow(-1, 0, 1)?, pairs.narrow(-1, 1, 1)?);
            let (c, s) = (cos.unsqueeze(-1)?, sin.unsqueeze(-1)?);
            let oe = xe.mul(&c)?.sub(&xo.mul(&s)?)?;
            let oo = xe.mul(&s)?.add(&xo.mul(&c)?)?;
            Tensor::concat(&[&oe, &oo], -1)?.reshape_to(rot.shape().clone())?
        } else {
            let (x1, x2) = (rot.narrow(-1, 0, half)?, rot.narrow(-1, half, half)?);
            let rotated = Tensor::concat(&[&x2.neg()?, &x1], -1)?;
            let cos = Tensor::concat(&[&cos, &cos], -1)?;
            let sin = Tensor::concat(&[&sin, &sin], -1)?;
            rot.mul(&cos)?.add(&rotated.mul(&sin)?)?
        };
        if features == self.dim {
            Ok(out)
        } else {
            Tensor::concat(&[&out, &x.narrow(-1, self.dim, features - self.dim)?], -1)
        }
    }
}

impl Module for RotaryEmbedding {
    /// [`RotaryEmbedding::apply`] from position 0.
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        self.apply(x, 0)
    }
}
