//! 2-d pooling layers, [`MaxPool2d`] and [`AvgPool2d`], with PyTorch's
//! defaults and builder methods for stride, padding, ceil mode, dilation
//! and the divisor of an average; and the adaptive ones,
//! [`AdaptiveAvgPool2d`] and [`AdaptiveMaxPool2d`] (and their functional
//! forms), which choose their windows from the output size.

use super::conv::{batched, Size2};
use super::{invalid, Module};
use crate::ir::{PoolAttrs, PoolKind};
use crate::{Result, Tensor};

/// 2-d max pooling, PyTorch's `nn.MaxPool2d`: stride defaults to the
/// window, no padding (padding never wins), floor mode. Its gradient goes
/// to the first maximum of each window.
#[derive(Clone, Debug, PartialEq)]
pub struct MaxPool2d {
    /// The pooling attributes (kind `Max`).
    pub attrs: PoolAttrs,
}

/// 2-d average pooling, PyTorch's `nn.AvgPool2d`: stride defaults to the
/// window, no padding, floor mode, padding counted in the divisor.
#[derive(Clone, Debug, PartialEq)]
pub struct AvgPool2d {
    /// The pooling attributes (kind `Avg`).
    pub attrs: PoolAttrs,
}

macro_rules! pool_builders {
    ($t:ident) => {
        impl $t {
            /// Stride (default: the window).
            pub fn stride(mut self, s: impl Into<Size2>) -> Self {
                self.attrs.strides = s.into().0.to_vec();
                self
            }

            /// Padding on both sides of each spatial dim (default 0).
            pub fn padding(mut self, p: impl Into<Size2>) -> Self {
                self.attrs = self.attrs.with_padding(&p.into().0);
                self
            }

            /// Ceil instead of floor for the output size (default false).
            pub fn ceil_mode(mut self, ceil: bool) -> Self {
                self.attrs.ceil_mode = ceil;
                self
            }
        }

        impl Module for $t {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                batched(stringify!($t), x, |x| x.pool(self.attrs.clone()))
            }
        }
    };
}

impl MaxPool2d {
    /// Max pooling over `kernel` windows with stride `kernel`.
    pub fn new(kernel: impl Into<Size2>) -> MaxPool2d {
        MaxPool2d { attrs: PoolAttrs::new(PoolKind::Max, &kernel.into().0) }
    }

    /// Dilation (default 1).
    pub fn dilation(mut self, d: impl Into<Size2>) -> Self {
        self.attrs.dilations = d.into().0.to_vec();
        self
    }
}

impl Default for MaxPool2d {
    /// 2x2 windows, stride 2.
    fn default() -> MaxPool2d {
        MaxPool2d::new(2)
    }
}

impl AvgPool2d {
    /// Average pooling over `kernel` windows with stride `kernel`.
    pub fn new(kernel: impl Into<Size2>) -> AvgPool2d {
        AvgPool2d { attrs: PoolAttrs::new(PoolKind::Avg { count_include_pad: true }, &kernel.into().0) }
    }

    /// Count padded positions in the divisor (default true, PyTorch's).
    pub fn count_include_pad(mut self, include: bool) -> Self {
        self.attrs.kind = PoolKind::Avg { count_include_pad: include };
        self
    }
}

impl Default for AvgPool2d {
    /// 2x2 windows, stride 2.
    fn default() -> AvgPool2d {
        AvgPool2d::new(2)
    }
}

pool_builders!(MaxPool2d);
pool_builders!(AvgPool2d);

/// Adaptive 2-d average pooling, PyTorch's `nn.AdaptiveAvgPool2d`:
/// [`adaptive_avg_pool2d`] to a fixed output size. (PyTorch's `None`
/// entries, which keep an input size, are not supported: give the size.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveAvgPool2d {
    /// `[oh, ow]`.
    pub output_size: [usize; 2],
}

/// Adaptive 2-d max pooling, PyTorch's `nn.AdaptiveMaxPool2d`:
/// [`adaptive_max_pool2d`] to a fixed output size. (PyTorch's
/// `return_indices` and `None` entries are not supported.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveMaxPool2d {
    /// `[oh, ow]`.
    pub output_size: [usize; 2],
}

impl AdaptiveAvgPool2d {
    /// Pools `[N, C, H, W]` (or `[C, H, W]`) to `output_size`.
    pub fn new(output_size: impl Into<Size2>) -> AdaptiveAvgPool2d {
        AdaptiveAvgPool2d { output_size: output_size.into().0 }
    }
}

impl AdaptiveMaxPool2d {
    /// Pools `[N, C, H, W]` (or `[C, H, W]`) to `output_size`.
    pub fn new(output_size: impl Into<Size2>) -> AdaptiveMaxPool2d {
        AdaptiveMaxPool2d { output_size: output_size.into().0 }
    }
}

impl Module for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        adaptive_pool2d("AdaptiveAvgPool2d", x, self.output_size, false)
    }
}

impl Module for AdaptiveMaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        adaptive_pool2d("AdaptiveMaxPool2d", x, self.output_size, true)
    }
}

/// Average of `x` (`[N, C, H, W]` or `[C, H, W]`) over adaptive windows,
/// PyTorch's `F.adaptive_avg_pool2d`: output cell `i` of a dim of input
/// size `n` and output size `m` covers `floor(i n / m) ..
/// ceil((i + 1) n / m)`. When `m` divides `n` the windows are a plain
/// pooling of `n / m` (one pooling op); otherwise each dim is reduced
/// window by window (the windows are rectangles, so the average and the
/// maximum separate by dim).
#[track_caller]
pub fn adaptive_avg_pool2d(x: &Tensor, output_size: impl Into<Size2>) -> Result<Tensor> {
    adaptive_pool2d("adaptive_avg_pool2d", x, output_size.into().0, false)
}

/// Maximum of `x` over adaptive windows, PyTorch's `F.adaptive_max_pool2d`
/// (without `return_indices`); the windows as in [`adaptive_avg_pool2d`].
#[track_caller]
pub fn adaptive_max_pool2d(x: &Tensor, output_size: impl Into<Size2>) -> Result<Tensor> {
    adaptive_pool2d("adaptive_max_pool2d", x, output_size.into().0, true)
}

fn adaptive_pool2d(op: &str, x: &Tensor, out: [usize; 2], max: bool) -> Result<Tensor> {
    let spatial = &x.dims()[x.rank().saturating_sub(2)..];
    if out.contains(&0) || spatial.contains(&0) {
        return Err(invalid(
            op,
            format!("cannot pool an input of shape {} to output size {out:?}: sizes must be positive", x.shape()),
        ));
    }
    batched(op, x, |x| {
        let (h, w) = (x.dims()[2], x.dims()[3]);
        if h.is_multiple_of(out[0]) && w.is_multiple_of(out[1]) {
            let kernel = [h / out[0], w / out[1]];
            let kind = if max { PoolKind::Max } else { PoolKind::Avg { count_include_pad: true } };
            return x.pool(PoolAttrs::new(kind, &kernel));
        }
        let y = adaptive_axis(x, 2, out[0], max)?;
        adaptive_axis(&y, 3, out[1], max)
    })
}

/// Reduces `axis` of `x` to `out` cells with PyTorch's adaptive windows.
fn adaptive_axis(x: &Tensor, axis: usize, out: usize, max: bool) -> Result<Tensor> {
    let n = x.dims()[axis];
    if n == out {
        return Ok(x.clone());
    }
    let cells = (0..out)
        .map(|i| {
            let start = i * n / out;
            let end = ((i + 1) * n).div_ceil(out);
            let window = x.narrow(axis as isize, start, end - start)?;
            if max {
                window.max(&[axis as isize], true)
            } else {
                window.mean(&[axis as isize], true)
            }
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let refs: Vec<&Tensor> = cells.iter().collect();
    Tensor::concat(&refs, axis as isize)
}
