//! The transposed convolution, [`ConvTranspose2d`] with its
//! [`ConvTranspose2dBuilder`], and the functional [`conv_transpose2d`]
//! ([`ConvTranspose1d`] and [`conv_transpose1d`] run over a height of 1):
//! PyTorch's `nn.ConvTranspose2d` (the gradient of a convolution with
//! respect to its input), weight layout `[in, out / groups, kh, kw]`.
//!
//! It is lowered as the input gradient of a convolution is (autograd's
//! `conv2d_grad` does the same): the input dilated by the stride (zeros
//! between its elements), padded by `dilation * (k - 1) - padding` on each
//! side (plus `output_padding` at the bottom and right; a negative pad
//! crops the result instead), convolved at stride 1 with the kernel
//! flipped and its channel axes swapped per group. So it runs on the
//! convolution kernels of every backend and its gradients come from
//! autodiff. The dilated input costs `stride^2` times the multiplies of a
//! direct scatter form; rejected because it needs an op of its own.

use super::conv::{batched, Size2};
use super::init::{parameter, Init};
use super::{invalid_at, Module};
use crate::ir::{ConvAttrs, Op};
use crate::{Device, Result, Tensor};
use std::panic::Location;

/// A 2-d transposed convolution layer, PyTorch's `nn.ConvTranspose2d`:
/// `weight` is `[in, out / groups, kh, kw]`, `bias` is `[out]`; inputs
/// are `[N, C, H, W]` (or `[C, H, W]`), and the output is `H_out = (H - 1)
/// * stride - 2 * padding + dilation * (kh - 1) + output_padding + 1`
/// (likewise `W_out`).
#[derive(Clone, Debug)]
pub struct ConvTranspose2d {
    /// `[in_channels, out_channels / groups, kh, kw]`.
    pub weight: Tensor,
    /// `[out_channels]`.
    pub bias: Option<Tensor>,
    /// Stride, padding, output padding, dilation and groups.
    pub attrs: ConvTranspose2dAttrs,
}

/// The settings of a transposed convolution (PyTorch's arguments of
/// `F.conv_transpose2d`); the default is stride 1, no padding, no output
/// padding, no dilation, one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvTranspose2dAttrs {
    /// Stride (h, w).
    pub stride: [usize; 2],
    /// Implicit padding removed from each side (h, w).
    pub padding: [usize; 2],
    /// Extra size added at the bottom and right (h, w); less than the
    /// stride or the dilation.
    pub output_padding: [usize; 2],
    /// Dilation (h, w).
    pub dilation: [usize; 2],
    /// Groups.
    pub groups: usize,
}

impl Default for ConvTranspose2dAttrs {
    fn default() -> Self {
        ConvTranspose2dAttrs { stride: [1, 1], padding: [0, 0], output_padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

/// Settings of a [`ConvTranspose2d`] before its parameters are drawn;
/// every setting has PyTorch's default.
#[derive(Clone, Debug)]
pub struct ConvTranspose2dBuilder {
    in_channels: usize,
    out_channels: usize,
    kernel: [usize; 2],
    attrs: ConvTranspose2dAttrs,
    bias: bool,
    weight_init: Init,
    bias_init: Init,
}

impl ConvTranspose2dBuilder {
    /// Stride (default 1).
    pub fn stride(mut self, s: impl Into<Size2>) -> Self {
        self.attrs.stride = s.into().0;
        self
    }

    /// Padding removed from both sides of each spatial dim (default 0).
    pub fn padding(mut self, p: impl Into<Size2>) -> Self {
        self.attrs.padding = p.into().0;
        self
    }

    /// Size added at the bottom and right (default 0).
    pub fn output_padding(mut self, p: impl Into<Size2>) -> Self {
        self.attrs.output_padding = p.into().0;
        self
    }

    /// Dilation (default 1).
    pub fn dilation(mut self, d: impl Into<Size2>) -> Self {
        self.attrs.dilation = d.into().0;
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

    /// Weight initialization (default [`Init::LecunUniform`], PyTorch's:
    /// `fan_in` is `weight.size(1) * kh * kw = out / groups * kh * kw`, as
    /// PyTorch computes it from the transposed layout).
    pub fn weight_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }

    /// Bias initialization (default `U(+-1/sqrt(fan_in))`, PyTorch's).
    pub fn bias_init(mut self, init: Init) -> Self {
        self.bias_init = init;
        self
    }

    /// Checks the settings and draws the parameters on `device`.
    #[track_caller]
    pub fn build(self, device: &Device) -> Result<ConvTranspose2d> {
        let at = Location::caller();
        let (cin, cout, g, [kh, kw]) = (self.in_channels, self.out_channels, self.attrs.groups, self.kernel);
        if g == 0 || !cin.is_multiple_of(g) || !cout.is_multiple_of(g) || kh * kw == 0 {
            return Err(invalid_at(
                "ConvTranspose2d",
                format!(
                    "{cin} -> {cout} channels, kernel {:?}, {g} groups: channels must be multiples of the groups \
                     and the kernel non-empty",
                    self.kernel
                ),
                at,
            ));
        }
        check_settings(&self.attrs, at)?;
        // PyTorch's fan_in of a transposed weight [in, out / g, kh, kw]
        // is its dim 1 times the kernel.
        let fan_in = cout / g * kh * kw;
        let fan_out = cin / g * kh * kw;
        let weight = parameter(self.weight_init, &[cin, cout / g, kh, kw], fan_in, fan_out, device)?;
        let bias = if self.bias { Some(parameter(self.bias_init, &[cout], fan_in, fan_out, device)?) } else { None };
        Ok(ConvTranspose2d { weight, bias, attrs: self.attrs })
    }
}

impl ConvTranspose2d {
    /// A layer with stride 1, no padding and a bias.
    #[track_caller]
    pub fn new(
        in_channels: usize,
        out_channels: usize,
        kernel: impl Into<Size2>,
        device: &Device,
    ) -> Result<ConvTranspose2d> {
        ConvTranspose2d::builder(in_channels, out_channels, kernel).build(device)
    }

    /// Settings starting from PyTorch's defaults.
    pub fn builder(in_channels: usize, out_channels: usize, kernel: impl Into<Size2>) -> ConvTranspose2dBuilder {
        ConvTranspose2dBuilder {
            in_channels,
            out_channels,
            kernel: kernel.into().0,
            attrs: ConvTranspose2dAttrs::default(),
            bias: true,
            weight_init: Init::LecunUniform,
            bias_init: Init::LecunUniform,
        }
    }
}

impl Module for ConvTranspose2d {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let at = Location::caller();
        batched("ConvTranspose2d", x, |x| conv_transpose2d_at(x, &self.weight, self.bias.as_ref(), &self.attrs, at))
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

/// PyTorch's `F.conv_transpose2d` on `x` (`[N, C_in, H, W]`) with `weight`
/// (`[C_in, C_out / groups, kh, kw]`) and an optional `bias` (`[C_out]`).
#[track_caller]
pub fn conv_transpose2d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    attrs: &ConvTranspose2dAttrs,
) -> Result<Tensor> {
    conv_transpose2d_at(x, weight, bias, attrs, Location::caller())
}

fn check_settings(s: &ConvTranspose2dAttrs, at: &Location<'_>) -> Result<()> {
    let (stride, dilation, output_padding) = (s.stride, s.dilation, s.output_padding);
    for i in 0..2 {
        if stride[i] == 0 || dilation[i] == 0 {
            return Err(invalid_at(
                "conv_transpose2d",
                format!("stride {stride:?} and dilation {dilation:?} must be positive"),
                at,
            ));
        }
        if output_padding[i] >= stride[i].max(dilation[i]) {
            return Err(invalid_at(
                "conv_transpose2d",
                format!(
                    "output_padding {output_padding:?} must be smaller than the stride {stride:?} or the \
                     dilation {dilation:?}"
                ),
                at,
            ));
        }
    }
    Ok(())
}

fn conv_transpose2d_at(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    s: &ConvTranspose2dAttrs,
    at: &Location<'_>,
) -> Result<Tensor> {
    let op = "conv_transpose2d";
    check_settings(s, at)?;
    let g = s.groups;
    let shapes = || format!("input {}, weight {}", x.shape(), w.shape());
    if x.rank() != 4 || w.rank() != 4 || g == 0 || x.dims()[1] != w.dims()[0] || !w.dims()[0].is_multiple_of(g) {
        return Err(invalid_at(
            op,
            format!(
                "expected an [N, C_in, H, W] input and a [C_in, C_out / {g}, kh, kw] weight with C_in a multiple \
                 of the groups, got {}",
                shapes()
            ),
            at,
        ));
    }
    let (cin, cog, kh, kw) = (w.dims()[0], w.dims()[1], w.dims()[2], w.dims()[3]);
    let cout = cog * g;
    if let Some(b) = bias {
        if b.dims() != [cout] {
            return Err(invalid_at(op, format!("bias {} is not [{cout}] for {}", b.shape(), shapes()), at));
        }
    }
    let k = [kh, kw];
    let mut out_size = [0usize; 2];
    for i in 0..2 {
        let n = x.dims()[2 + i];
        let full = (n.max(1) - 1) * s.stride[i] + s.dilation[i] * (k[i] - 1) + s.output_padding[i] + 1;
        if n == 0 || full <= 2 * s.padding[i] {
            return Err(invalid_at(op, format!("padding {:?} leaves no output for {}", s.padding, shapes()), at));
        }
        out_size[i] = full - 2 * s.padding[i];
    }
    // The input dilated by the stride.
    let mut t = x.clone();
    for i in 0..2 {
        t = dilate(&t, 2 + i, s.stride[i])?;
    }
    // Kernel: [in, out/g, kh, kw] -> [out, in/g, kh, kw], flipped.
    let wc = w.reshape([g, cin / g, cog, kh, kw])?.permute(&[0, 2, 1, 3, 4])?.reshape([cout, cin / g, kh, kw])?;
    let wc = flip(&flip(&wc, 2)?, 3)?;
    let mut pads = [0usize; 4];
    let mut crop = [0usize; 2];
    for i in 0..2 {
        let lo = (s.dilation[i] * (k[i] - 1)) as i64 - s.padding[i] as i64;
        let hi = lo + s.output_padding[i] as i64;
        // A negative pad crops; cropping the (stride-1) output by the
        // same amount is the same thing.
        pads[i] = lo.max(0) as usize;
        pads[i + 2] = hi.max(0) as usize;
        crop[i] = (-lo).max(0) as usize;
    }
    let attrs = ConvAttrs { strides: [1, 1], pads, dilations: s.dilation, groups: g };
    let mut y = t.conv2d(&wc, attrs)?;
    for i in 0..2 {
        if crop[i] > 0 || y.dims()[2 + i] != out_size[i] {
            y = y.narrow(2 + i as isize, crop[i], out_size[i])?;
        }
    }
    match bias {
        Some(b) => y.add(&crate::amp::bias_like(&b.reshape([cout, 1, 1])?, &y)?),
        None => Ok(y),
    }
}

/// Zeros between the elements of dim `d` (`s - 1` of them).
fn dilate(t: &Tensor, d: usize, s: usize) -> Result<Tensor> {
    let l = t.dims()[d];
    if s <= 1 || l <= 1 {
        return Ok(t.clone());
    }
    let mut pads = vec![(0usize, 0usize); t.rank() + 1];
    pads[d + 1] = (0, s - 1);
    let u = t.unsqueeze(d as isize + 1)?.pad(&pads, 0.0)?;
    let mut dims = t.dims().to_vec();
    dims[d] = l * s;
    u.reshape_to(dims)?.narrow(d as isize, 0, (l - 1) * s + 1)
}

/// `t` reversed along dim `d`.
fn flip(t: &Tensor, d: usize) -> Result<Tensor> {
    let n = t.dims()[d];
    if n <= 1 {
        return Ok(t.clone());
    }
    let mut starts = vec![0i64; t.rank()];
    let mut steps = vec![1i64; t.rank()];
    starts[d] = n as i64 - 1;
    steps[d] = -1;
    Tensor::record(Op::Slice { starts, steps, lens: t.dims().to_vec() }, &[t])
}

/// A 1-d transposed convolution layer, PyTorch's `nn.ConvTranspose1d`:
/// `weight` is `[in, out / groups, k]`, `bias` is `[out]`; inputs are
/// `[N, C, L]` (or `[C, L]`), the output length `(L - 1) * stride - 2 *
/// padding + dilation * (k - 1) + output_padding + 1`. It runs as
/// [`conv_transpose2d`] over a height of 1 and draws its parameters as
/// [`ConvTranspose2d`] does (PyTorch's default).
#[derive(Clone, Debug)]
pub struct ConvTranspose1d {
    /// `[in_channels, out_channels / groups, k]`.
    pub weight: Tensor,
    /// `[out_channels]`.
    pub bias: Option<Tensor>,
    /// The settings; the width entries (index 1) are the length's, the
    /// height entries are unused.
    pub attrs: ConvTranspose2dAttrs,
}

/// Settings of a [`ConvTranspose1d`] before its parameters are drawn;
/// every setting has PyTorch's default.
#[derive(Clone, Debug)]
pub struct ConvTranspose1dBuilder {
    inner: ConvTranspose2dBuilder,
}

impl ConvTranspose1dBuilder {
    /// Stride (default 1).
    pub fn stride(mut self, s: usize) -> Self {
        self.inner = self.inner.stride([1, s]);
        self
    }

    /// Padding removed from both ends (default 0).
    pub fn padding(mut self, p: usize) -> Self {
        self.inner = self.inner.padding([0, p]);
        self
    }

    /// Length added at the end (default 0).
    pub fn output_padding(mut self, p: usize) -> Self {
        self.inner = self.inner.output_padding([0, p]);
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

    /// Weight initialization (default [`Init::LecunUniform`], PyTorch's).
    pub fn weight_init(mut self, init: Init) -> Self {
        self.inner = self.inner.weight_init(init);
        self
    }

    /// Bias initialization (default `U(+-1/sqrt(fan_in))`, PyTorch's).
    pub fn bias_init(mut self, init: Init) -> Self {
        self.inner = self.inner.bias_init(init);
        self
    }

    /// Checks the settings and draws the parameters on `device`.
    #[track_caller]
    pub fn build(self, device: &Device) -> Result<ConvTranspose1d> {
        let layer = self.inner.build(device)?;
        let weight = layer.weight.detach().squeeze(&[2])?.requires_grad_(true)?;
        Ok(ConvTranspose1d { weight, bias: layer.bias, attrs: layer.attrs })
    }
}

impl ConvTranspose1d {
    /// A layer with stride 1, no padding and a bias.
    #[track_caller]
    pub fn new(in_channels: usize, out_channels: usize, kernel: usize, device: &Device) -> Result<ConvTranspose1d> {
        ConvTranspose1d::builder(in_channels, out_channels, kernel).build(device)
    }

    /// Settings starting from PyTorch's defaults.
    pub fn builder(in_channels: usize, out_channels: usize, kernel: usize) -> ConvTranspose1dBuilder {
        ConvTranspose1dBuilder { inner: ConvTranspose2d::builder(in_channels, out_channels, [1, kernel]) }
    }
}

impl Module for ConvTranspose1d {
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        conv_transpose1d(x, &self.weight, self.bias.as_ref(), &self.attrs)
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

/// PyTorch's `F.conv_transpose1d` on `x` (`[N, C_in, L]` or `[C_in, L]`)
/// with `weight` (`[C_in, C_out / groups, k]`) and an optional `bias`;
/// `attrs`' width entries (index 1) are the length's settings.
#[track_caller]
pub fn conv_transpose1d(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    attrs: &ConvTranspose2dAttrs,
) -> Result<Tensor> {
    let at = Location::caller();
    if !(x.rank() == 2 || x.rank() == 3) || weight.rank() != 3 {
        return Err(invalid_at(
            "conv_transpose1d",
            format!(
                "expected an [N, C_in, L] or [C_in, L] input and a [C_in, C_out / groups, k] weight, got {} and {} \
                ",
                x.shape(),
                weight.shape()
            ),
            at,
        ));
    }
    let line = ConvTranspose2dAttrs {
        stride: [1, attrs.stride[1]],
        padding: [0, attrs.padding[1]],
        output_padding: [0, attrs.output_padding[1]],
        dilation: [1, attrs.dilation[1]],
        groups: attrs.groups,
    };
    let w = weight.unsqueeze(2)?;
    let h = x.rank() as isize - 1;
    let y = batched("conv_transpose1d", &x.unsqueeze(h)?, |x| conv_transpose2d_at(x, &w, bias, &line, at))?;
    y.squeeze(&[h])
}
