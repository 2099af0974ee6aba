//! Mixed precision (PyTorch's `torch.amp`): [`autocast`] scopes in which
//! matmul, conv and attention run in a 16-bit float while reductions,
//! softmax, norms and losses run in f32, and a [`GradScaler`] that scales
//! the loss so that f16 gradients do not underflow and skips the steps
//! whose gradients overflowed.
//!
//! ```no_run
//! use lazuli::amp::{self, GradScaler};
//! use lazuli::optim::{Adam, Optimizer};
//! use lazuli::prelude::*;
//! # fn main() -> lazuli::Result<()> {
//! let dev = Device::default();
//! let model = lazuli::nn::Linear::new(16, 4, &dev)?;
//! let mut opt = Adam::new(model.parameters(), 1e-3);
//! let mut scaler = GradScaler::new(&dev)?;
//! let (x, y) = (Tensor::randn([8, 16], DType::F32, &dev)?, Tensor::randn([8, 4], DType::F32, &dev)?);
//! for _ in 0..10 {
//!     // f16 matmul inside, f32 loss out; the parameters stay f32.
//!     let loss = amp::autocast(DType::F16, || lazuli::nn::mse(&model.forward(&x)?, &y))?;
//!     scaler.scale(&loss)?.backward()?;
//!     scaler.step(&mut opt)?; // skipped on the device if a gradient is inf/nan
//!     scaler.update()?;
//!     opt.zero_grad();
//!     dev.mark_step()?;
//! }
//! # Ok(()) }
//! ```
//!
//! The autocast scope itself lives in the executor (`lazuli_executor::
//! autocast`, re-exported here), because every op records through it.
//!
//! The scaler's state is device data: the scale and the growth counter are
//! rank-0 f32 tensors and the found-inf flag a lazy bool, and the skip and
//! the scale update are `where` selections recorded into the step's graph,
//! with the growth and backoff factors and the interval as lifted scalars.
//! Nothing is read back and nothing recompiles from step to step (PyTorch's
//! `scaler.step` reads the flag on the host). A skipped step leaves every
//! parameter and every optimizer state tensor as it was, with one
//! difference from PyTorch: an optimizer's host-side step count (Adam's
//! bias correction) still advances, as the host cannot know.

use crate::optim::Optimizer;
use crate::serialize::SerializeError;
use crate::{no_grad, DType, Device, ExecError, Result, ScalarValue, Tensor};
use std::collections::HashMap;
use std::path::Path;

pub use lazuli_executor::autocast::{
    autocast, autocast_dtype, float32, is_low_precision, policy, set_autocast, AutocastGuard, CastPolicy,
};

/// Autocast to `dtype` (a 16-bit float; `None`: off) on this thread until
/// the guard is dropped: the guard form of [`autocast`].
pub fn autocast_guard(dtype: impl Into<Option<DType>>) -> Result<AutocastGuard> {
    AutocastGuard::new(dtype)
}

/// A layer's `bias` for adding to its product `y`: inside an autocast
/// scope in `y`'s dtype, as PyTorch's `addmm` and convolutions (on the
/// low-precision list) take it, so the layer's output stays 16-bit;
/// outside, `bias` itself.
pub(crate) fn bias_like(bias: &Tensor, y: &Tensor) -> Result<Tensor> {
    if autocast_dtype().is_some() {
        bias.cast(y.dtype())
    } else {
        Ok(bias.clone())
    }
}

/// The settings of a [`GradScaler`], PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerOptions {
    /// The first scale (2^16).
    pub init_scale: f64,
    /// The scale is multiplied by this after `growth_interval` clean
    /// steps in a row (2).
    pub growth_factor: f64,
    /// The scale is multiplied by this after a step with an inf/nan
    /// gradient (0.5).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: u32,
    /// A disabled scaler passes the loss through and steps plainly.
    pub enabled: bool,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        GradScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// Where a scaler is within one step, for PyTorch's order of calls:
/// `scale`, (`unscale_`), `step`, `update`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Ready,
    Unscaled,
    Stepped,
}

/// Dynamic loss scaling (PyTorch's `torch.amp.GradScaler`); see the
/// module documentation.
#[derive(Debug)]
pub struct GradScaler {
    opts: GradScalerOptions,
    device: Device,
    /// f32[], the current scale.
    scale: Tensor,
    /// f32[], clean steps in a row since the scale last changed.
    growth_tracker: Tensor,
    /// bool[]: some gradient of this step was inf or nan (after `unscale_`).
    found_inf: Option<Tensor>,
    stage: Stage,
}

impl GradScaler {
    /// A scaler with PyTorch's defaults on `device`.
    pub fn new(device: &Device) -> Result<GradScaler> {
        GradScaler::with_options(device, GradScalerOptions::default())
    }

    /// A scaler with `opts`; a non-positive or non-finite scale, a growth
    /// factor not above 1, a backoff factor outside (0, 1) or a zero
    /// interval is an error.
    pub fn with_options(device: &Device, opts: GradScalerOptions) -> Result<GradScaler> {
        let bad = |detail: String| ExecError::Invalid { op: "GradScaler".into(), detail };
        if !(opts.init_scale.is_finite() && opts.init_scale > 0.0) {
            return Err(bad(format!("init_scale must be finite and positive, got {}", opts.init_scale)));
        }
        if !(opts.growth_factor.is_finite() && opts.growth_factor > 1.0) {
            return Err(bad(format!("growth_factor must be above 1, got {}", opts.growth_factor)));
        }
        if !(opts.backoff_factor > 0.0 && opts.backoff_factor < 1.0) {
            return Err(bad(format!("backoff_factor must be in (0, 1), got {}", opts.backoff_factor)));
        }
        if opts.growth_interval == 0 {
            return Err(bad("growth_interval must be at least 1".into()));
        }
        Ok(GradScaler {
            scale: Tensor::from_slice(&[opts.init_scale as f32], [], device)?,
            growth_tracker: Tensor::from_slice(&[0.0f32], [], device)?,
            device: device.clone(),
            opts,
            found_inf: None,
            stage: Stage::Ready,
        })
    }

    /// The settings.
    pub fn options(&self) -> &GradScalerOptions {
        &self.opts
    }

    /// Whether the scaler scales at all.
    pub fn is_enabled(&self) -> bool {
        self.opts.enabled
    }

    /// The current scale, a lazy f32 rank-0 tensor (reading it is a
    /// barrier; the training step itself never reads it).
    pub fn get_scale(&self) -> &Tensor {
        &self.scale
    }

    /// The growth counter, a lazy f32 rank-0 tensor.
    pub fn growth_tracker(&self) -> &Tensor {
        &self.growth_tracker
    }

    /// This step's found-inf flag (bool rank-0), once `unscale_` or `step`
    /// recorded it.
    pub fn found_inf(&self) -> Option<&Tensor> {
        self.found_inf.as_ref()
    }

    /// `loss * scale` (in `loss`'s dtype), to call `backward` on; `loss`
    /// itself when disabled.
    #[track_caller]
    pub fn scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.opts.enabled {
            return Ok(loss.clone());
        }
        if !loss.dtype().is_float() {
            return Err(ExecError::Invalid {
                op: "GradScaler::scale".into(),
                detail: format!("expected a float loss, got {}{}", loss.dtype(), loss.shape()),
            });
        }
        let s = self.scale.cast(loss.dtype())?;
        loss.mul(&s)
    }

    /// Divides every gradient of `opt`'s parameters by the scale (in
    /// place, lazily) and records whether any is inf or nan. At most once
    /// per step, before [`GradScaler::step`] (which calls it if not
    /// called): e.g. to clip the true gradients first.
    pub fn unscale_<O: Optimizer + ?Sized>(&mut self, opt: &O) -> Result<()> {
        if !self.opts.enabled {
            return Ok(());
        }
        if self.stage != Stage::Ready {
            return Err(self.order_error("unscale_", "unscale_() was already called this step; call update() first"));
        }
        no_grad(|| {
            let inv = self.scale.reciprocal()?;
            let mut found: Option<Tensor> = None;
            for p in opt.parameters() {
                let Some(g) = p.grad() else { continue };
                let g = g.mul(&inv.cast(g.dtype())?)?;
                let bad = g.isnan()?.logical_or(&g.isinf()?)?.cast(DType::F32)?;
                let bad = if bad.rank() == 0 { bad } else { bad.max(&[], false)? };
                found = Some(match found {
                    None => bad,
                    Some(f) => f.maximum(&bad)?,
                });
                p.set_grad(Some(g))?;
            }
            let found = match found {
                Some(f) => f.gt_scalar(0.0)?,
                None => Tensor::scalar(ScalarValue::Bool(false), DType::Bool, &self.device),
            };
            self.found_inf = Some(found);
            Ok::<_, ExecError>(())
        })?;
        self.stage = Stage::Unscaled;
        Ok(())
    }

    /// Unscales the gradients (if [`GradScaler::unscale_`] was not called)
    /// and records `opt`'s step, kept only where no gradient was inf or
    /// nan ([`Optimizer::step_unless`]): decided on the device.
    pub fn step<O: Optimizer + ?Sized>(&mut self, opt: &mut O) -> Result<()> {
        if !self.opts.enabled {
            return opt.step();
        }
        match self.stage {
            Stage::Ready => self.unscale_(opt)?,
            Stage::Unscaled => {}
            Stage::Stepped => return Err(self.order_error("step", "step() was already called this step")),
        }
        let found = self.found_inf.clone().expect("unscale_ records the flag");
        opt.step_unless(&found)?;
        self.stage = Stage::Stepped;
        Ok(())
    }

    /// Updates the scale for the next step: times `backoff_factor` if this
    /// step found an inf/nan gradient (and the counter restarts), times
    /// `growth_factor` after `growth_interval` clean steps in a row, else
    /// unchanged; all recorded lazily on the device.
    pub fn update(&mut self) -> Result<()> {
        if !self.opts.enabled {
            return Ok(());
        }
        let Some(found) = self.found_inf.take() else {
            return Err(self.order_error("update", "no inf checks were recorded: call step() (or unscale_()) first"));
        };
        no_grad(|| {
            let dev = &self.device;
            let lifted = |v: f64| Tensor::lifted_scalar(ScalarValue::Float(v), DType::F32, dev);
            let counted = self.growth_tracker.add_scalar(1.0)?;
            let grow = counted.ge(&lifted(self.opts.growth_interval as f64))?;
            let grown = self.scale.mul(&lifted(self.opts.growth_factor))?;
            let backed_off = self.scale.mul(&lifted(self.opts.backoff_factor))?;
            let scale = found.where_(&backed_off, &grow.where_(&grown, &self.scale)?)?;
            let zero = Tensor::scalar(0.0, DType::F32, dev);
            let tracker = found.logical_or(&grow)?.where_(&zero, &counted)?;
            self.scale = scale;
            self.growth_tracker = tracker;
            Ok::<_, ExecError>(())
        })?;
        self.stage = Stage::Ready;
        Ok(())
    }

    /// The state by PyTorch's names (`scale`, `_growth_tracker`) as
    /// rank-0 f32 tensors; what [`crate::checkpoint::Checkpoint`] saves.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        vec![("scale".into(), self.scale.clone()), ("_growth_tracker".into(), self.growth_tracker.clone())]
    }

    /// Replaces the scale and growth counter with `state` (named as
    /// [`GradScaler::state_tensors`] names them, read from `source`); on
    /// an error nothing changes.
    pub fn load_state_tensors(&mut self, mut state: HashMap<String, Tensor>, source: &Path) -> Result<()> {
        let mut take = |name: &str| -> Result<Tensor> {
            let mismatch = |detail: String| SerializeError::Mismatch {
                path: source.display().to_string(),
                name: name.into(),
                detail,
            };
            let t = state.remove(name).ok_or_else(|| mismatch("not in the file".into()))?;
            if t.rank() != 0 || !t.dtype().is_float() {
                return Err(mismatch(format!("stored as {}{}, expected a float scalar", t.dtype(), t.shape())).into());
            }
            let t = t.cast(DType::F32)?;
            // Onto this scaler's device, as device data.
            Tensor::from_slice(&[t.item::<f32>()?], [], &self.device)
        };
        let scale = take("scale")?;
        let tracker = take("_growth_tracker")?;
        if let Some(extra) = state.keys().next() {
            return Err(SerializeError::Mismatch {
                path: source.display().to_string(),
                name: extra.clone(),
                detail: "not part of a GradScaler's state".into(),
            }
            .into());
        }
        self.scale = scale;
        self.growth_tracker = tracker;
        self.found_inf = None;
        self.stage = Stage::Ready;
        Ok(())
    }

    fn order_error(&self, op: &str, detail: &str) -> ExecError {
        ExecError::Invalid { op: format!("GradScaler::{op}"), detail: detail.into() }
    }
}
