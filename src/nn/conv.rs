//! The 2-d convolution layer, [`Conv2d`], with its [`Conv2dBuilder`]
//! (stride, padding, dilation, groups, bias, initialization), and what
//! the 2-d layers share: [`Size2`] and the unbatched-input adapter.

use super::init::{parameter, Init};
use super::{invalid, Module};
use crate::ir::ConvAttrs;
use crate::{Device, Result, Tensor};

/// Square or rectangular sizes for the 2-d layers: `3` or `[3, 5]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size2(pub [usize; 2]);

impl From<usize> for Size2 {
    fn from(v: usize) -> Size2 {
        Size2([v, v])
    }
}

impl From<[usize; 2]> for Size2 {
    fn from(v: [usize; 2]) -> Size2 {
        Size2(v)
    }
}

impl From<(usize, usize)> for Size2 {
    fn from((h, w): (usize, usize)) -> Size2 {
        Size2([h, w])
    }
}

/// Runs `f` on `x` as a batch: an unbatched `[C, H, W]` input becomes
/// `[1, C, H, W]` and the result loses the batch dim again.
pub(super) fn batched(op: &str, x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    match x.rank() {
        4 => f(x),
        3 => f(&x.unsqueeze(0)?)?.squeeze(&[0]),
        _ => Err(invalid(op, format!("expected an [N, C, H, W] or [C, H, W] input, got {}", x.shape()))),
    }
}

/// A 2-d convolution layer, PyTorch's `nn.Conv2d`: `weight` is
/// `[out, in / groups, kh, kw]`, `bias` is `[out]`; inputs are
/// `[N, C, H, W]` (or `[C, H, W]`).
///
/// `Conv2d::new(in, out, 3, &dev)` gives stride 1, no padding, no
/// dilation, one group and a bias; [`Conv2d::builder`] changes any of them.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// `[out_channels, in_channels / groups, kh, kw]`.
    pub weight: Tensor,
    /// `[out_channels]`.
    pub bias: Option<Tensor>,
    /// Stride, padding, dilation and groups.
    pub attrs: ConvAttrs,
}

/// Settings of a [`Conv2d`] before its parameters are drawn; every
/// setting has PyTorch's default.
#[derive(Clone, Debug)]
pub struct Conv2dBuilder {
    in_channels: usize,
    out_channels: usize,
    kernel: [usize; 2],
    attrs: ConvAttrs,
    bias: bool,
    weight_init: Init,
    bias_init: Init,
}

impl Conv2dBuilder {
    /// Stride (default 1).
    pub fn stride(mut self, s: impl Into<Size2>) -> Self {
        self.attrs.strides = s.into().0;
        self
    }

    /// Zero padding on both sides of each spatial dim (default 0).
    pub fn padding(mut self, p: impl Into<Size2>) -> Self {
        let [h, w] = p.into().0;
        self.attrs.pads = [h, w, h, w];
        self
    }

    /// Zero padding (top, left, bottom, right).
    pub fn padding_tlbr(mut self, pads: [usize; 4]) -> Self {
        self.attrs.pads = pads;
        self
    }

    /// Dilation (default 1).
    pub fn dilation(mut self, d: impl Into<Size2>) -> Self {
        self.attrs.dilations = d.into().0;
        self
    }

    /// Groups (default 1); both channel counts must be multiples of it.
    pub fn groups(mut self, g: usize) -> Self {
        self.attrs.groups = g;
        self
    }

    /// With a bias (default true).
    pub fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// Weight initialization (default `U(+-1/sqrt(fan_in))`,
    /// [`Init::LecunUniform`], PyTorch's; `fan_in = in / groups * kh * kw`).
    pub fn weight_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }

    /// Bias initialization (default `U(+-1/sqrt(fan_in))`, PyTorch's).
    pub fn bias_init(mut self, init: Init) -> Self {
        self.bias_init = init;
        self
    }

    /// Draws the parameters on `device`.
    pub fn build(self, device: &Device) -> Result<Conv2d> {
        let g = self.attrs.groups;
        let [kh, kw] = self.kernel;
        if g == 0 || !self.in_channels.is_multiple_of(g) || !self.out_channels.is_multiple_of(g) || kh * kw == 0 {
            return Err(invalid(
                "Conv2d",
                format!(
                    "{} -> {} channels, kernel {kh}x{kw}, {g} groups: channels must be multiples of the groups and the kernel non-empty",
                    self.in_channels, self.out_channels
                ),
            ));
        }
        let fan_in = self.in_channels / g * kh * kw;
        let fan_out = self.out_channels / g * kh * kw;
        let weight =
            parameter(self.weight_init, &[self.out_channels, self.in_channels / g, kh, kw], fan_in, fan_out, device)?;
        let bias = if self.bias {
            Some(parameter(self.bias_init, &[self.out_channels], fan_in, fan_out, device)?)
        } else {
            None
        };
        Ok(Conv2d { weight, bias, attrs: self.attrs })
    }
}

impl Conv2d {
    /// A layer with stride 1, no padding and a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel: impl Into<Size2>, device: &Device) -> Result<Conv2d> {
        Conv2d::builder(in_channels, out_channels, kernel).build(device)
    }

    /// Settings starting from the defaults.
    pub fn builder(in_channels: usize, out_channels: usize, kernel: impl Into<Size2>) -> Conv2dBuilder {
        Conv2dBuilder {
            in_channels,
            out_channels,
            kernel: kernel.into().0,
            attrs: ConvAttrs::default(),
            bias: true,
            weight_init: Init::LecunUniform,
            bias_init: Init::LecunUniform,
        }
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        batched("Conv2d", x, |x| {
            let y = x.conv2d(&self.weight, self.attrs.clone())?;
            match &self.bias {
                Some(b) => y.add(&b.reshape([b.numel(), 1, 1])?),
                None => Ok(y),
            }
        })
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        v.extend(self.bias.iter().map(|b| ("bias".to_string(), b.clone())));
        v
    }
}
