//! 2-d pooling layers, [`MaxPool2d`] and [`AvgPool2d`], with PyTorch's
//! defaults and builder methods for stride, padding, ceil mode, dilation
//! and the divisor of an average.

use super::conv::{batched, Size2};
use super::Module;
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
