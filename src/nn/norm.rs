//! Normalization layers: [`LayerNorm`] (and the functional
//! [`layer_norm`]), [`RmsNorm`] (and [`rms_norm`]), [`BatchNorm1d`] and
//! [`BatchNorm2d`] with their running statistics updated in place (both
//! through the functional [`batch_norm`]), and [`GroupNorm`] (and
//! [`group_norm`]).

use super::init::{parameter, Init};
use super::{invalid, Mode, Module};
use crate::{DType, Device, ExecError, Result, Tensor};

/// Layer normalization over the last `normalized_dims` dims of `x`, with
/// optional elementwise affine `weight` and `bias` (shape of those dims).
#[track_caller]
pub fn layer_norm(
    x: &Tensor,
    normalized_dims: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let x = &crate::amp::float32(x)?;
    if normalized_dims == 0 || normalized_dims > x.rank() {
        return Err(ExecError::Invalid {
            op: "layer_norm".into(),
            detail: format!("cannot normalize the last {normalized_dims} dims of {}", x.shape()),
        });
    }
    let axes: Vec<isize> = (x.rank() - normalized_dims..x.rank()).map(|a| a as isize).collect();
    let mu = x.mean(&axes, true)?;
    let xc = x.sub(&mu)?;
    let var = xc.mul(&xc)?.mean(&axes, true)?;
    let mut y = xc.mul(&var.add(&Tensor::scalar(eps, x.dtype(), x.device()))?.rsqrt()?)?;
    if let Some(w) = weight {
        y = y.mul(w)?;
    }
    if let Some(b) = bias {
        y = y.add(b)?;
    }
    Ok(y)
}

/// Layer normalization with a learned scale (ones) and shift (zeros).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Scale, of the normalized shape.
    pub weight: Tensor,
    /// Shift, of the normalized shape.
    pub bias: Tensor,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// Normalizes over trailing dims of shape `normalized_shape`.
    pub fn new(normalized_shape: &[usize], device: &Device) -> Result<LayerNorm> {
        let n: usize = normalized_shape.iter().product();
        Ok(LayerNorm {
            weight: parameter(Init::Constant(1.0), normalized_shape, n, n, device)?,
            bias: parameter(Init::Constant(0.0), normalized_shape, n, n, device)?,
            eps: 1e-5,
        })
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        layer_norm(x, self.weight.rank(), Some(&self.weight), Some(&self.bias), self.eps)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.weight, &mut self.bias]
    }

    fn own_no_weight_decay(&self) -> Vec<String> {
        vec!["weight".into(), "bias".into()]
    }
}

/// Root-mean-square normalization over the trailing dims of `x` that
/// equal `normalized_shape`, PyTorch's `F.rms_norm`: `y = x /
/// sqrt(mean(x^2) + eps) * weight`, with an optional elementwise `weight`
/// of `normalized_shape`. `eps` of `None` is PyTorch's default, the
/// machine epsilon of `x`'s dtype.
#[track_caller]
pub fn rms_norm(x: &Tensor, normalized_shape: &[usize], weight: Option<&Tensor>, eps: Option<f64>) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let x = &crate::amp::float32(x)?;
    let k = normalized_shape.len();
    if k == 0 || k > x.rank() || x.dims()[x.rank() - k..] != *normalized_shape {
        return Err(invalid(
            "rms_norm",
            format!("cannot normalize trailing dims {normalized_shape:?} of an input of shape {}", x.shape()),
        ));
    }
    if let Some(w) = weight {
        if w.dims() != normalized_shape {
            return Err(invalid(
                "rms_norm",
                format!("weight of shape {} does not match normalized shape {normalized_shape:?}", w.shape()),
            ));
        }
    }
    let eps = match eps {
        Some(e) => e,
        None => machine_epsilon(x.dtype()).ok_or_else(|| {
            invalid("rms_norm", format!("expected a floating-point input, got {:?} of shape {}", x.dtype(), x.shape()))
        })?,
    };
    let axes: Vec<isize> = (x.rank() - k..x.rank()).map(|a| a as isize).collect();
    let ms = x.mul(x)?.mean(&axes, true)?;
    let y = x.mul(&ms.add(&Tensor::scalar(eps, x.dtype(), x.device()))?.rsqrt()?)?;
    match weight {
        Some(w) => y.mul(&w.cast(x.dtype())?),
        None => Ok(y),
    }
}

/// `torch.finfo(dtype).eps` for the float dtypes, `None` for the others.
fn machine_epsilon(dtype: DType) -> Option<f64> {
    match dtype {
        DType::F16 => Some(f64::from(half::f16::EPSILON)),
        DType::BF16 => Some(f64::from(half::bf16::EPSILON)),
        DType::F32 => Some(f64::from(f32::EPSILON)),
        DType::F64 => Some(f64::EPSILON),
        _ => None,
    }
}

/// Root-mean-square normalization (Zhang & Sennrich), PyTorch's
/// `nn.RMSNorm`: [`rms_norm`] over trailing dims of `normalized_shape`
/// with a learned scale `weight` (ones) when `elementwise_affine`, and no
/// shift. `eps` defaults to `None`, the machine epsilon of the input's
/// dtype, as in PyTorch. (The Rust name follows this crate's casing of
/// acronyms, as [`Activation::Gelu`](super::Activation::Gelu) does.)
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// The trailing dims normalized over.
    pub normalized_shape: Vec<usize>,
    /// Scale, of the normalized shape; `None` without elementwise affine.
    pub weight: Option<Tensor>,
    /// Added to the mean square; `None` is the input dtype's epsilon.
    pub eps: Option<f64>,
}

impl RmsNorm {
    /// Normalizes over trailing dims of `normalized_shape` with a scale of
    /// ones and PyTorch's default eps; [`RmsNorm::with_options`] chooses.
    pub fn new(normalized_shape: &[usize], device: &Device) -> Result<RmsNorm> {
        RmsNorm::with_options(normalized_shape, None, true, device)
    }

    /// PyTorch's full constructor: `eps` (`None`: the input dtype's
    /// epsilon) and whether to learn a scale.
    pub fn with_options(
        normalized_shape: &[usize],
        eps: Option<f64>,
        elementwise_affine: bool,
        device: &Device,
    ) -> Result<RmsNorm> {
        if normalized_shape.is_empty() {
            return Err(invalid("RMSNorm", "the normalized shape must name at least one dim, got []".into()));
        }
        let n: usize = normalized_shape.iter().product();
        let weight = if elementwise_affine {
            Some(parameter(Init::Constant(1.0), normalized_shape, n, n, device)?)
        } else {
            None
        };
        Ok(RmsNorm { normalized_shape: normalized_shape.to_vec(), weight, eps })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        rms_norm(x, &self.normalized_shape, self.weight.as_ref(), self.eps)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        self.weight.iter().map(|w| ("weight".to_string(), w.clone())).collect()
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        self.weight.iter_mut().collect()
    }

    fn own_no_weight_decay(&self) -> Vec<String> {
        self.weight.iter().map(|_| "weight".to_string()).collect()
    }
}

/// `[1, C, 1, ...]`: a per-channel vector shaped to broadcast over `x`
/// (`[N, C, ...]`).
fn per_channel(v: &Tensor, x: &Tensor) -> Result<Tensor> {
    let mut dims = vec![1usize; x.rank()];
    dims[1] = v.numel();
    v.reshape(dims)
}

/// Batch normalization over the channels of `[N, C, H, W]`, PyTorch's
/// `nn.BatchNorm2d`. In training mode it normalizes with the batch's
/// mean and (biased) variance over `N, H, W` and updates the running
/// statistics in place, `running = (1 - momentum) * running + momentum *
/// batch` (the unbiased variance, as PyTorch); in evaluation mode it uses
/// the running statistics. Learned scale `weight` (ones) and shift `bias`
/// (zeros).
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    /// Scale, `[C]`.
    pub weight: Tensor,
    /// Shift, `[C]`.
    pub bias: Tensor,
    /// Running mean, `[C]` (a buffer).
    pub running_mean: Tensor,
    /// Running variance, `[C]` (a buffer).
    pub running_var: Tensor,
    /// Training forwards so far: a rank-0 i64 buffer, PyTorch's
    /// `num_batches_tracked` (counted on the host, so it never makes a
    /// device kernel or a fallback).
    pub num_batches_tracked: Tensor,
    /// Added to the variance.
    pub eps: f64,
    /// Weight of the batch statistics in the running ones (PyTorch's
    /// `momentum=None`, a cumulative average over `num_batches_tracked`,
    /// is not offered).
    pub momentum: f64,
    training: Mode,
}

impl BatchNorm2d {
    /// Batch norm over `channels`, eps 1e-5, momentum 0.1, training mode.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm2d> {
        let (weight, bias, running_mean, running_var) = batch_norm_state(channels, device)?;
        let num_batches_tracked = Tensor::from_slice(&[0i64], [], device)?;
        Ok(BatchNorm2d {
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            eps: 1e-5,
            momentum: 0.1,
            training: Mode::new(true),
        })
    }

    /// True in training mode.
    pub fn is_training(&self) -> bool {
        self.training.get()
    }
}

impl Module for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let c = self.weight.numel();
        if x.rank() != 4 || x.dims()[1] != c {
            return Err(invalid("BatchNorm2d", format!("expected an [N, {c}, H, W] input, got {}", x.shape())));
        }
        batch_norm_layer("BatchNorm2d", x, &self.weight, &self.bias, &self.running_mean, &self.running_var, self)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            ("running_mean".into(), self.running_mean.clone()),
            ("running_var".into(), self.running_var.clone()),
            ("num_batches_tracked".into(), self.num_batches_tracked.clone()),
        ]
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![
            &mut self.weight,
            &mut self.bias,
            &mut self.running_mean,
            &mut self.running_var,
            &mut self.num_batches_tracked,
        ]
    }

    fn set_own_training(&self, training: bool) {
        self.training.set(training)
    }
}

/// Batch normalization over the channels of `[N, C]` or `[N, C, L]`,
/// PyTorch's `nn.BatchNorm1d`: the same statistics, running-stat updates,
/// modes and defaults as [`BatchNorm2d`] (whose code it shares, through
/// [`batch_norm`]), with the statistics over `N` (and `L`).
#[derive(Clone, Debug)]
pub struct BatchNorm1d {
    /// Scale, `[C]`.
    pub weight: Tensor,
    /// Shift, `[C]`.
    pub bias: Tensor,
    /// Running mean, `[C]` (a buffer).
    pub running_mean: Tensor,
    /// Running variance, `[C]` (a buffer).
    pub running_var: Tensor,
    /// Training forwards so far: a rank-0 i64 buffer, PyTorch's
    /// `num_batches_tracked` (counted on the host, so it never makes a
    /// device kernel or a fallback).
    pub num_batches_tracked: Tensor,
    /// Added to the variance.
    pub eps: f64,
    /// Weight of the batch statistics in the running ones (PyTorch's
    /// `momentum=None`, a cumulative average over `num_batches_tracked`,
    /// is not offered).
    pub momentum: f64,
    training: Mode,
}

impl BatchNorm1d {
    /// Batch norm over `channels`, eps 1e-5, momentum 0.1, training mode.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm1d> {
        let (weight, bias, running_mean, running_var) = batch_norm_state(channels, device)?;
        let num_batches_tracked = Tensor::from_slice(&[0i64], [], device)?;
        Ok(BatchNorm1d {
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            eps: 1e-5,
            momentum: 0.1,
            training: Mode::new(true),
        })
    }

    /// True in training mode.
    pub fn is_training(&self) -> bool {
        self.training.get()
    }
}

impl Module for BatchNorm1d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let c = self.weight.numel();
        if !(x.rank() == 2 || x.rank() == 3) || x.dims()[1] != c {
            return Err(invalid(
                "BatchNorm1d",
                format!("expected an [N, {c}] or [N, {c}, L] input, got {}", x.shape()),
            ));
        }
        batch_norm_layer("BatchNorm1d", x, &self.weight, &self.bias, &self.running_mean, &self.running_var, self)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            ("running_mean".into(), self.running_mean.clone()),
            ("running_var".into(), self.running_var.clone()),
            ("num_batches_tracked".into(), self.num_batches_tracked.clone()),
        ]
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![
            &mut self.weight,
            &mut self.bias,
            &mut self.running_mean,
            &mut self.running_var,
            &mut self.num_batches_tracked,
        ]
    }

    fn set_own_training(&self, training: bool) {
        self.training.set(training)
    }
}

/// The scale (ones), shift (zeros), running mean (zeros) and running
/// variance (ones) of a batch norm over `channels`, as PyTorch makes them.
fn batch_norm_state(channels: usize, device: &Device) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    Ok((
        parameter(Init::Constant(1.0), &[channels], channels, channels, device)?,
        parameter(Init::Constant(0.0), &[channels], channels, channels, device)?,
        Tensor::zeros([channels], DType::F32, device)?.persist().clone(),
        Tensor::ones([channels], DType::F32, device)?.persist().clone(),
    ))
}

/// The eps, momentum and mode of a batch-norm module, so the layers of
/// every rank share one forward.
trait BatchNormConfig {
    fn eps(&self) -> f64;
    fn momentum(&self) -> f64;
    fn training(&self) -> bool;
    fn num_batches_tracked(&self) -> &Tensor;
}

impl BatchNormConfig for BatchNorm1d {
    fn eps(&self) -> f64 {
        self.eps
    }
    fn momentum(&self) -> f64 {
        self.momentum
    }
    fn training(&self) -> bool {
        self.training.get()
    }
    fn num_batches_tracked(&self) -> &Tensor {
        &self.num_batches_tracked
    }
}

impl BatchNormConfig for BatchNorm2d {
    fn eps(&self) -> f64 {
        self.eps
    }
    fn momentum(&self) -> f64 {
        self.momentum
    }
    fn training(&self) -> bool {
        self.training.get()
    }
    fn num_batches_tracked(&self) -> &Tensor {
        &self.num_batches_tracked
    }
}

/// A batch-norm module's forward, named `layer` in errors: [`batch_norm`]
/// with the module's tensors and settings.
fn batch_norm_layer(
    layer: &str,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    cfg: &dyn BatchNormConfig,
) -> Result<Tensor> {
    let stats = BatchStats { running_mean: Some(running_mean), running_var: Some(running_var) };
    let y = batch_norm_named(layer, x, stats, Some(weight), Some(bias), cfg.training(), cfg.momentum(), cfg.eps())?;
    if cfg.training() {
        // PyTorch counts every training forward. The counter is read and
        // replaced on the host (it holds host data unless a program uses
        // it in a graph): an i64 add on the device would run on the CPU
        // fallback of wgpu every step.
        let tracked = cfg.num_batches_tracked();
        let n = tracked.item::<i64>()?;
        tracked.assign(&Tensor::from_slice(&[n.saturating_add(1)], [], tracked.device())?)?;
    }
    Ok(y)
}

/// Batch normalization of `x` (`[N, C, ...]`) over every dim but the
/// channels, PyTorch's `F.batch_norm`: with `training`, the batch's mean
/// and biased variance, and the running statistics (when given) updated
/// in place, `running = (1 - momentum) * running + momentum * batch`
/// (the unbiased variance, as PyTorch); without, the running statistics,
/// which must then be given. Optional per-channel `weight` and `bias`.
// PyTorch's `F.batch_norm` takes these eight arguments; keeping its
// signature argument for argument keeps call sites translatable.
#[allow(clippy::too_many_arguments)]
#[track_caller]
pub fn batch_norm(
    x: &Tensor,
    running_mean: Option<&Tensor>,
    running_var: Option<&Tensor>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    let stats = BatchStats { running_mean, running_var };
    batch_norm_named("batch_norm", x, stats, weight, bias, training, momentum, eps)
}

/// The optional running statistics of a batch norm.
#[derive(Clone, Copy)]
struct BatchStats<'a> {
    running_mean: Option<&'a Tensor>,
    running_var: Option<&'a Tensor>,
}

// The arguments of `batch_norm` plus the name to report, bundled no
// further so the two entry points stay one-line wrappers.
#[allow(clippy::too_many_arguments)]
fn batch_norm_named(
    op: &str,
    x: &Tensor,
    stats: BatchStats<'_>,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    training: bool,
    momentum: f64,
    eps: f64,
) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let x = &crate::amp::float32(x)?;
    if x.rank() < 2 {
        return Err(invalid(op, format!("expected an [N, C, ...] input, got {}", x.shape())));
    }
    let c = x.dims()[1];
    for (what, t) in
        [("running_mean", stats.running_mean), ("running_var", stats.running_var), ("weight", weight), ("bias", bias)]
    {
        if let Some(t) = t {
            if t.dims() != [c] {
                return Err(invalid(
                    op,
                    format!("{what} of shape {} does not match the {c} channels of input {}", t.shape(), x.shape()),
                ));
            }
        }
    }
    let (dt, dev) = (x.dtype(), x.device());
    let s = |v: f64| Tensor::scalar(v, dt, dev);
    let axes: Vec<isize> = (0..x.rank()).filter(|&a| a != 1).map(|a| a as isize).collect();
    let (mean, var) = if training {
        let n = x.numel() / c.max(1);
        if n < 2 {
            return Err(invalid(
                op,
                format!("training needs more than one value per channel, got input {}", x.shape()),
            ));
        }
        let mean = x.mean(&axes, false)?;
        let xc = x.sub(&per_channel(&mean, x)?)?;
        let var = xc.mul(&xc)?.mean(&axes, false)?;
        crate::no_grad(|| -> Result<()> {
            let update = |running: &Tensor, batch: &Tensor| -> Result<()> {
                let batch = batch.detach().cast(running.dtype())?;
                let keep = Tensor::scalar(1.0 - momentum, running.dtype(), dev);
                let take = Tensor::scalar(momentum, running.dtype(), dev);
                running.assign(&running.mul(&keep)?.add(&batch.mul(&take)?)?)
            };
            if let Some(rm) = stats.running_mean {
                update(rm, &mean)?;
            }
            if let Some(rv) = stats.running_var {
                update(rv, &var.mul(&s(n as f64 / (n - 1) as f64))?)?;
            }
            Ok(())
        })?;
        (mean, var)
    } else {
        match (stats.running_mean, stats.running_var) {
            (Some(m), Some(v)) => (m.cast(dt)?, v.cast(dt)?),
            _ => {
                return Err(invalid(op, format!("evaluation needs the running mean and variance, input {}", x.shape())))
            }
        }
    };
    let inv = var.add(&s(eps))?.rsqrt()?;
    let scale = match weight {
        Some(w) => inv.mul(&w.cast(dt)?)?,
        None => inv,
    };
    let centre = mean.mul(&scale)?;
    let shift = match bias {
        Some(b) => b.cast(dt)?.sub(&centre)?,
        None => centre.neg()?,
    };
    x.mul(&per_channel(&scale, x)?)?.add(&per_channel(&shift, x)?)
}

/// Group normalization (Wu & He), PyTorch's `nn.GroupNorm`: the channels
/// of `[N, C, ...]` split into `groups` groups, each normalized with its
/// own mean and variance over its channels and the spatial dims, then a
/// per-channel scale (ones) and shift (zeros). The same in training and
/// evaluation.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    /// Number of groups (divides the channels).
    pub groups: usize,
    /// Scale, `[C]`.
    pub weight: Tensor,
    /// Shift, `[C]`.
    pub bias: Tensor,
    /// Added to the variance.
    pub eps: f64,
}

impl GroupNorm {
    /// `groups` groups over `channels` channels, eps 1e-5.
    pub fn new(groups: usize, channels: usize, device: &Device) -> Result<GroupNorm> {
        if groups == 0 || !channels.is_multiple_of(groups) {
            return Err(invalid("GroupNorm", format!("{channels} channels do not split into {groups} groups")));
        }
        Ok(GroupNorm {
            groups,
            weight: parameter(Init::Constant(1.0), &[channels], channels, channels, device)?,
            bias: parameter(Init::Constant(0.0), &[channels], channels, channels, device)?,
            eps: 1e-5,
        })
    }
}

/// Group normalization of `x` (`[N, C, ...]`) with optional per-channel
/// `weight` and `bias` (`[C]`); see [`GroupNorm`].
#[track_caller]
pub fn group_norm(
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let x = &crate::amp::float32(x)?;
    if x.rank() < 2 || groups == 0 || !x.dims()[1].is_multiple_of(groups) {
        return Err(invalid(
            "group_norm",
            format!("expected an [N, C, ...] input with C a multiple of {groups}, got {}", x.shape()),
        ));
    }
    let n = x.dims()[0];
    let g = x.reshape([n, groups, x.numel() / n.max(1) / groups])?;
    let y = layer_norm(&g, 1, None, None, eps)?.reshape(x.shape())?;
    let mut y = y;
    if let Some(w) = weight {
        y = y.mul(&per_channel(w, x)?)?;
    }
    if let Some(b) = bias {
        y = y.add(&per_channel(b, x)?)?;
    }
    Ok(y)
}

impl Module for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let c = self.weight.numel();
        if x.rank() < 2 || x.dims()[1] != c {
            return Err(invalid("GroupNorm", format!("expected an [N, {c}, ...] input, got {}", x.shape())));
        }
        group_norm(x, self.groups, Some(&self.weight), Some(&self.bias), self.eps)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        vec![&mut self.weight, &mut self.bias]
    }
}
