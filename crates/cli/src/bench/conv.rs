//! C1: a 3x3 convolution forward and backward ([`ConvSizes`],
//! [`ConvStep`]); its baseline, the `gemm` crate on the same products, is
//! in `baseline`.

use super::{on_device, uniform_data};
use lazuli::{Device, ExecError, Result, Tensor};

/// The sizes of a convolution workload: a `kernel` x `kernel` convolution,
/// stride 1, padding `kernel / 2` (same size out), of x f32 `[batch,
/// channels, size, size]` by w `[out_channels, channels, kernel, kernel]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvSizes {
    /// Images.
    pub batch: usize,
    /// Input channels.
    pub channels: usize,
    /// Height and width.
    pub size: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel height and width (odd).
    pub kernel: usize,
}

impl ConvSizes {
    /// C1: x [32, 32, 32, 32], w [64, 32, 3, 3].
    pub const C1: ConvSizes = ConvSizes { batch: 32, channels: 32, size: 32, out_channels: 64, kernel: 3 };

    /// The matrix product of the forward pass: `[m, k] @ [k, n]` with m the
    /// output channels, k the taps per output, n the output positions.
    pub fn gemm_dims(self) -> (usize, usize, usize) {
        (self.out_channels, self.channels * self.kernel * self.kernel, self.batch * self.size * self.size)
    }

    /// FLOPs of forward + backward: three products of `2 m k n`.
    pub fn flops(self) -> f64 {
        let (m, k, n) = self.gemm_dims();
        6.0 * (m * k * n) as f64
    }

    /// `"x [32,32,32,32] w [64,32,3,3] pad 1"`.
    pub fn describe(self) -> String {
        let (b, c, s, o, k) = (self.batch, self.channels, self.size, self.out_channels, self.kernel);
        format!("x [{b},{c},{s},{s}] w [{o},{c},{k},{k}] pad {}", k / 2)
    }
}

/// One C1 iteration's state: the input and weight (leaves that require
/// grad) and the fixed output gradient, on the device.
pub struct ConvStep {
    x: Tensor,
    w: Tensor,
    r: Tensor,
    sizes: ConvSizes,
}

impl ConvStep {
    /// Inputs uniform in [-1, 1], uploaded outside any timed loop.
    pub fn new(dev: &Device, sizes: ConvSizes) -> Result<ConvStep> {
        let ConvSizes { batch: b, channels: c, size: s, out_channels: o, kernel: k } = sizes;
        let x = on_device(Tensor::from_slice(&uniform_data(b * c * s * s, 21), [b, c, s, s], dev)?)?;
        let w = on_device(Tensor::from_slice(&uniform_data(o * c * k * k, 22), [o, c, k, k], dev)?)?;
        let r = on_device(Tensor::from_slice(&uniform_data(b * o * s * s, 23), [b, o, s, s], dev)?)?;
        Ok(ConvStep { x: x.requires_grad_(true)?, w: w.requires_grad_(true)?, r, sizes })
    }

    /// Forward, backward of `sum(conv(x, w) * r)` (so the output gradient
    /// is `r`), one sync of the loss and both gradients, wait.
    pub fn step(&mut self) -> Result<()> {
        let pad = self.sizes.kernel / 2;
        let attrs = lazuli::ir::ConvAttrs { pads: [pad; 4], ..Default::default() };
        let loss = self.x.conv2d(&self.w, attrs)?.mul(&self.r)?.sum(&[], false)?;
        loss.backward()?;
        let (gx, gw) = (self.x.grad(), self.w.grad());
        self.x.zero_grad();
        self.w.zero_grad();
        let (Some(gx), Some(gw)) = (gx, gw) else {
            return Err(ExecError::Invalid { op: "bench C1".into(), detail: "no gradient".into() });
        };
        lazuli::sync(&[&loss, &gx, &gw])?;
        self.x.device().wait()
    }
}
