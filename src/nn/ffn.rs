//! Gated linear units: the functional [`glu`] and its module [`Glu`]
//! (PyTorch's `F.glu` and `nn.GLU`), and [`SwiGlu`], the LLaMA
//! feed-forward block `w2(silu(w1 x) * w3 x)` built from three bias-free
//! [`Linear`] layers. PyTorch has no SwiGLU module; the names follow
//! LLaMA's `FeedForward`, so its state dicts line up.

use super::activation::silu;
use super::init::Init;
use super::{invalid, Linear, Module};
use crate::{Device, Result, Tensor};

/// The gated linear unit, PyTorch's `F.glu`: `x` split in halves `a`, `b`
/// along `dim` (negative counts from the end), `a * sigmoid(b)`. The size
/// of `dim` must be even.
#[track_caller]
pub fn glu(x: &Tensor, dim: isize) -> Result<Tensor> {
    let rank = x.rank() as isize;
    let axis = if dim < 0 { dim + rank } else { dim };
    if axis < 0 || axis >= rank {
        return Err(invalid("glu", format!("dim {dim} is out of range for an input of shape {}", x.shape())));
    }
    let size = x.dims()[axis as usize];
    if !size.is_multiple_of(2) {
        return Err(invalid(
            "glu",
            format!("dim {dim} of an input of shape {} has odd size {size}, which cannot be halved", x.shape()),
        ));
    }
    let half = size / 2;
    let a = x.narrow(axis, 0, half)?;
    let b = x.narrow(axis, half, half)?;
    a.mul(&b.sigmoid()?)
}

/// [`glu`] as a module, PyTorch's `nn.GLU` (default `dim` -1). The Rust
/// name follows this crate's casing of acronyms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Glu {
    /// The dim split in halves.
    pub dim: isize,
}

impl Glu {
    /// A gated linear unit over `dim`.
    pub fn new(dim: isize) -> Glu {
        Glu { dim }
    }
}

impl Default for Glu {
    /// PyTorch's default, the last dim.
    fn default() -> Glu {
        Glu { dim: -1 }
    }
}

impl Module for Glu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        glu(x, self.dim)
    }
}

/// The SwiGLU feed-forward block of LLaMA (Shazeer, "GLU Variants Improve
/// Transformer"): `w2(silu(w1 x) * w3 x)` over the last dim, with `w1`
/// and `w3` `[hidden, dim]` and `w2` `[dim, hidden]`, all without bias
/// and with [`Linear`]'s default initialization. Parameters are named
/// `w1.weight`, `w2.weight` and `w3.weight`, as in LLaMA's `FeedForward`.
#[derive(Clone, Debug)]
pub struct SwiGlu {
    /// The gate projection, `dim -> hidden`.
    pub w1: Linear,
    /// The output projection, `hidden -> dim`.
    pub w2: Linear,
    /// The value projection, `dim -> hidden`.
    pub w3: Linear,
}

impl SwiGlu {
    /// A block from `dim` features through `hidden` and back.
    pub fn new(dim: usize, hidden: usize, device: &Device) -> Result<SwiGlu> {
        if dim == 0 || hidden == 0 {
            return Err(invalid("SwiGLU", format!("dim and hidden must be positive, got dim {dim}, hidden {hidden}")));
        }
        let lin = |i, o| Linear::with_init(i, o, false, Init::LecunUniform, Init::LecunUniform, device);
        Ok(SwiGlu { w1: lin(dim, hidden)?, w2: lin(hidden, dim)?, w3: lin(dim, hidden)? })
    }
}

impl Module for SwiGlu {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let d = self.w1.in_features();
        if x.rank() == 0 || x.dims()[x.rank() - 1] != d {
            return Err(invalid("SwiGLU", format!("expected an input of shape [..., {d}], got {}", x.shape())));
        }
        let h = silu(&self.w1.forward(x)?)?.mul(&self.w3.forward(x)?)?;
        self.w2.forward(&h)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("w1".into(), &self.w1), ("w2".into(), &self.w2), ("w3".into(), &self.w3)]
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        vec![&mut self.w1, &mut self.w2, &mut self.w3]
    }
}
