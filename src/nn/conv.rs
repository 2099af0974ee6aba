//! The convolution layers, [`Conv2d`] with its [`Conv2dBuilder`]
//! (stride, padding, dilation, groups, bias, initialization) and
//! [`Conv1d`] with its [`Conv1dBuilder`] (the functional [`conv1d`]: a
//! 2-d convolution over a height of 1, with the same initialization), and
//! what the 2-d layers share: [`Size2`] and the unbatched-input adapter.

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
        let (weight, bias) = self.draw("Conv2d", &self.kernel, device)?;
        Ok(Conv2d { weight, bias, attrs: self.attrs })
    }

    /// Checks the settings and draws a weight of `[out, in / groups,
    /// kernel...]` (`kernel` is this builder's kernel without its unit
    /// dims for a 1-d layer) and the bias, named `op` in errors.
    fn draw(&self, op: &str, kernel: &[usize], device: &Device) -> Result<(Tensor, Option<Tensor>)> {
        let g = self.attrs.groups;
        let [kh, kw] = self.kernel;
        if g == 0 || !self.in_channels.is_multiple_of(g) || !self.out_channels.is_multiple_of(g) || kh * kw == 0 {
            return Err(invalid(
                op,
                format!(
                    "{} -> {} channels, kernel {kernel:?}, {g} groups: channels must be multiples of the groups and the kernel non-empty",
                    self.in_channels, self.out_channels
                ),
            ));
        }
        let fan_in = self.in_channels / g * kh * kw;
        let fan_out = self.out_channels / g * kh * kw;
        let mut shape = vec![self.out_channels, self.in_channels / g];
        shape.extend_from_slice(kernel);
        let weight = parameter(self.weight_init, &shape, fan_in, fan_out, device)?;
        let bias = if self.bias {
            Some(parameter(self.bias_init, &[self.out_channels], fan_in, fan_out, device)?)
        } else {
            None
        };
        Ok((weight, bias))
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
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        batched("Conv2d", x, |x| {
            let y = x.conv2d(&self.weight, self.attrs.clone())?;
            match &self.bias {
                // Under autocast in the convolution's dtype.
                Some(b) => y.add(&crate::amp::bias_like(&b.reshape([b.numel(), 1, 1])?, &y)?),
                None => Ok(y),
            }
        })
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

/// A 1-d convolution layer, PyTorch's `nn.Conv1d`: `weight` is
/// `[out, in / groups, k]`, `bias` is `[out]`; inputs are `[N, C, L]` (or
/// `[C, L]`). It runs as a 2-d convolution over a height of 1 and draws
/// its parameters as [`Conv2d`] does (PyTorch's default,
/// `U(+-1/sqrt(in / groups * k))`).
#[derive(Clone, Debug)]
pub struct Conv1d {
    /// `[out_channels, in_channels / groups, k]`.
    pub weight: Tensor,
    /// `[out_channels]`.
    pub bias: Option<Tensor>,
    /// Stride (default 1).
    pub stride: usize,
    /// Zero padding on both ends (default 0).
    pub padding: usize,
    /// Dilation (default 1).
    pub dilation: usize,
    /// Groups (default 1).
    pub groups: usize,
}

/// Settings of a [`Conv1d`] before its parameters are drawn; every
/// setting has PyTorch's default.
#[derive(Clone, Debug)]
pub struct Conv1dBuilder {
    inner: Conv2dBuilder,
}

impl Conv1dBuilder {
    /// Stride (default 1).
    pub fn stride(mut self, s: usize) -> Self {
        self.inner = self.inner.stride([1, s]);
        self
    }

    /// Zero padding on both ends (default 0).
    pub fn padding(mut self, p: usize) -> Self {
        self.inner = self.inner.padding([0, p]);
        self
    }

    /// Dilation (default 1).
    pub fn dilation(mut self, d: usize) -> Self {
        self.inner = self.inner.dilation([1, d]);
        self
    }

    /// Groups (default 1); both channel counts must be multiples of it.
    pub fn groups(mut self, g: usize) -> Self {
        self.inner = self.inner.groups(g);
        self
    }

    /// With a bias (default true).
    pub fn bias(mut self, bias: bool) -> Self {
        self.inner = self.inner.bias(bias);
        self
    }

    /// Weight initialization (default [`Init::LecunUniform`], PyTorch's;
    /// `fan_in = in / groups * k`).
    pub fn weight_init(mut self, init: Init) -> Self {
        self.inner = self.inner.weight_init(init);
        self
    }

    /// Bias initialization (default `U(+-1/sqrt(fan_in))`, PyTorch's).
    pub fn bias_init(mut self, init: Init) -> Self {
        self.inner = self.inner.bias_init(init);
        self
    }

    /// Draws the parameters on `device`.
    pub fn build(self, device: &Device) -> Result<Conv1d> {
        let (weight, bias) = self.inner.draw("Conv1d", &[self.inner.kernel[1]], device)?;
        let a = &self.inner.attrs;
        Ok(Conv1d {
            weight,
            bias,
            stride: a.strides[1],
            padding: a.pads[1],
            dilation: a.dilations[1],
            groups: a.groups,
        })
    }
}

impl Conv1d {
    /// A layer with stride 1, no padding and a bias.
    pub fn new(in_channels: usize, out_channels: usize, kernel: usize, device: &Device) -> Result<Conv1d> {
        Conv1d::builder(in_channels, out_channels, kernel).build(device)
    }

    /// Settings starting from the defaults.
    pub fn builder(in_channels: usize, out_channels: usize, kernel: usize) -> Conv1dBuilder {
        Conv1dBuilder { inner: Conv2d::builder(in_channels, out_channels, [1, kernel]) }
    }
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        conv1d(x, &self.weight, self.bias.as_ref(), self.stride, self.padding, self.dilation, self.groups)
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

/// 1-d convolution (cross-correlation) of `x` (`[N, C, L]` or `[C, L]`)
/// with `weight` (`[out, C / groups, k]`) and an optional `bias` (`[out]`),
/// PyTorch's `F.conv1d` with integer `padding` (no `"same"`): a 2-d
/// convolution over a height of 1.
#[track_caller]
pub fn conv1d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    stride: usize,
    padding: usize,
    dilation: usize,
    groups: usize,
) -> Result<Tensor> {
    if !(x.rank() == 2 || x.rank() == 3) || weight.rank() != 3 {
        return Err(invalid(
            "conv1d",
            format!(
                "expected an [N, C, L] or [C, L] input and an [out, C / groups, k] weight, got {} and {}",
                x.shape(),
                weight.shape()
            ),
        ));
    }
    if let Some(b) = bias {
        if b.dims() != [weight.dims()[0]] {
            return Err(invalid(
                "conv1d",
                format!("bias of shape {} does not match weight {}", b.shape(), weight.shape()),
            ));
        }
    }
    let attrs = ConvAttrs { strides: [1, stride], pads: [0, padding, 0, padding], dilations: [1, dilation], groups };
    let w = weight.unsqueeze(2)?;
    let line = x.rank() as isize - 1;
    let y = batched("conv1d", &x.unsqueeze(line)?, |x| x.conv2d(&w, attrs))?.squeeze(&[line])?;
    match bias {
        Some(b) => y.add(&crate::amp::bias_like(&b.reshape([b.numel(), 1])?, &y)?),
        None => Ok(y),
    }
}
