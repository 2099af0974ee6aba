//! Neural-network building blocks over lazy tensors: the [`Module`] trait
//! (nested parameter names, buffers, train/eval mode, state dicts over
//! safetensors), layers ([`Linear`], [`Conv2d`], [`MaxPool2d`],
//! [`AvgPool2d`], [`BatchNorm2d`], [`GroupNorm`], [`LayerNorm`],
//! [`Embedding`], [`Dropout`], [`MultiheadAttention`], [`Sequential`]),
//! attention ([`scaled_dot_product_attention`], its unfused reference
//! [`scaled_dot_product_attention_unfused`], [`causal_mask`]), losses
//! ([`cross_entropy`], [`cross_entropy_with`], [`mse`]) and seeded
//! initialization ([`Init`]).
//!
//! Everything here composes executor ops, so gradients come from
//! `lazuli_executor::autograd` and a whole training step stays one lazy
//! graph. Parameters are leaves created with `requires_grad_(true)`;
//! optimizers ([`crate::optim`]) update them in place with
//! [`Tensor::assign`], and so does [`BatchNorm2d`] its running statistics.
//! Initialization draws from the device RNG ([`Device::manual_seed`] makes
//! it reproducible).
//!
//! Attention records the fused op ([`Tensor::attention`]: the scores are
//! never materialized); its unfused composition (two matmuls around a
//! softmax) stays available as the reference,
//! [`scaled_dot_product_attention_unfused`].

use crate::ir::{ConvAttrs, PoolAttrs, PoolKind};
use crate::{DType, Device, ExecError, Result, Tensor};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// A layer or model: a forward function, named parameters and buffers,
/// and a training/evaluation mode.
///
/// A module lists its own tensors ([`Module::own_parameters`],
/// [`Module::own_buffers`]) and its sub-modules ([`Module::children`]);
/// the provided methods walk the tree and join names with dots
/// (`"features.0.weight"`), PyTorch's convention, so a model built from
/// layers gets nested names without writing them by hand.
pub trait Module {
    /// Applies the module to `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// This module's own trainable tensors with short names ("weight"),
    /// not those of its children. None by default.
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// This module's own state that is not trained (running statistics),
    /// with short names. None by default.
    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// The direct sub-modules with their names. None by default.
    fn children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// Own parameters that weight decay should skip (short names). By
    /// default those of rank 0 or 1: biases and the scales of norms.
    fn own_no_weight_decay(&self) -> Vec<String> {
        self.own_parameters().into_iter().filter(|(_, t)| t.rank() <= 1).map(|(n, _)| n).collect()
    }

    /// Switches this module's own mode (dropout active, batch statistics)
    /// without touching children; [`Module::set_training`] walks the tree.
    /// Modules without a mode ignore it.
    fn set_own_training(&self, _training: bool) {}

    /// Every trainable tensor of the tree with its dotted name
    /// ("0.weight", "fc1.bias"), own parameters first, then each child's
    /// in order.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = self.own_parameters();
        for (name, child) in self.children() {
            v.extend(child.named_parameters().into_iter().map(|(n, t)| (format!("{name}.{n}"), t)));
        }
        v
    }

    /// The trainable tensors, in [`Module::named_parameters`] order.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }

    /// Every buffer of the tree with its dotted name.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut v = self.own_buffers();
        for (name, child) in self.children() {
            v.extend(child.named_buffers().into_iter().map(|(n, t)| (format!("{name}.{n}"), t)));
        }
        v
    }

    /// Dotted names of the parameters that weight decay should skip:
    /// biases, norm scales and shifts, embeddings (see
    /// [`crate::optim::decay_groups`]).
    fn no_weight_decay(&self) -> Vec<String> {
        let mut v = self.own_no_weight_decay();
        for (name, child) in self.children() {
            v.extend(child.no_weight_decay().into_iter().map(|n| format!("{name}.{n}")));
        }
        v
    }

    /// Sets training (`true`) or evaluation mode on the whole tree.
    fn set_training(&self, training: bool) {
        self.set_own_training(training);
        for (_, child) in self.children() {
            child.set_training(training);
        }
    }

    /// Training mode: dropout drops, batch norm uses and updates batch statistics.
    fn train(&self) {
        self.set_training(true)
    }

    /// Evaluation mode: dropout passes through, batch norm uses its running statistics.
    fn eval(&self) {
        self.set_training(false)
    }

    /// Parameters and buffers by dotted name: what a checkpoint holds.
    fn state_dict(&self) -> Vec<(String, Tensor)> {
        let mut v = self.named_parameters();
        v.extend(self.named_buffers());
        v
    }

    /// Writes [`Module::state_dict`] to `path` as safetensors (a barrier).
    fn save_state_dict(&self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        Ok(crate::serialize::save(path, &self.state_dict())?)
    }

    /// Loads a safetensors file written by [`Module::save_state_dict`] (or
    /// by PyTorch with the same names) into this module's tensors in place:
    /// every entry of the state dict must be in the file with the same
    /// shape and dtype, and the file may hold nothing else. Parameters keep
    /// their identity, so optimizers keep working on them.
    fn load_state_dict(&self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        Ok(crate::serialize::load_state_dict(path, &self.state_dict())?)
    }
}

/// A train/eval flag that modules flip through `&self` (modules are
/// shared, e.g. inside a [`Sequential`], and their mode changes rarely).
#[derive(Debug)]
struct Mode(AtomicBool);

impl Mode {
    fn new(training: bool) -> Mode {
        Mode(AtomicBool::new(training))
    }

    fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, training: bool) {
        self.0.store(training, Ordering::Relaxed)
    }
}

impl Clone for Mode {
    fn clone(&self) -> Mode {
        Mode::new(self.get())
    }
}

fn invalid(op: &str, detail: String) -> ExecError {
    ExecError::Invalid { op: op.into(), detail }
}

/// How to initialize a parameter of a layer with `fan_in` inputs and
/// `fan_out` outputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// He/Kaiming uniform for ReLU nets: `U(-b, b)`, `b = sqrt(6 / fan_in)`.
    KaimingUniform,
    /// He/Kaiming normal: `N(0, 2 / fan_in)`.
    KaimingNormal,
    /// Glorot/Xavier uniform: `U(-b, b)`, `b = sqrt(6 / (fan_in + fan_out))`.
    XavierUniform,
    /// Glorot/Xavier normal: `N(0, 2 / (fan_in + fan_out))`.
    XavierNormal,
    /// PyTorch's `nn.Linear` default: `U(-b, b)`, `b = 1 / sqrt(fan_in)`.
    LecunUniform,
    /// `U(lo, hi)`.
    Uniform(f64, f64),
    /// `N(0, std^2)`.
    Normal(f64),
    /// All elements equal to the value.
    Constant(f64),
}

impl Init {
    /// A new f32 tensor of `shape` drawn from this distribution.
    pub fn tensor(self, shape: &[usize], fan_in: usize, fan_out: usize, device: &Device) -> Result<Tensor> {
        let (fi, fo) = (fan_in.max(1) as f64, fan_out.max(1) as f64);
        let uniform = |b: f64| Tensor::rand_uniform(shape.to_vec(), -b, b, DType::F32, device);
        let normal =
            |std: f64| Tensor::randn(shape.to_vec(), DType::F32, device)?.mul(&Tensor::scalar(std, DType::F32, device));
        match self {
            Init::KaimingUniform => uniform((6.0 / fi).sqrt()),
            Init::KaimingNormal => normal((2.0 / fi).sqrt()),
            Init::XavierUniform => uniform((6.0 / (fi + fo)).sqrt()),
            Init::XavierNormal => normal((2.0 / (fi + fo)).sqrt()),
            Init::LecunUniform => uniform(1.0 / fi.sqrt()),
            Init::Uniform(lo, hi) => Tensor::rand_uniform(shape.to_vec(), lo, hi, DType::F32, device),
            Init::Normal(std) => normal(std),
            Init::Constant(v) => Tensor::full(shape.to_vec(), v, DType::F32, device),
        }
    }
}

/// A parameter: `init` drawn, then marked as a leaf that requires grad.
fn parameter(init: Init, shape: &[usize], fan_in: usize, fan_out: usize, device: &Device) -> Result<Tensor> {
    init.tensor(shape, fan_in, fan_out, device)?.requires_grad_(true)
}

/// `y = x W^T + b` over the last dim of `x`; `weight` is `[out, in]`
/// (PyTorch's layout), `bias` is `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A layer with Kaiming-uniform weights and `U(+-1/sqrt(in))` biases.
    pub fn new(in_features: usize, out_features: usize, device: &Device) -> Result<Linear> {
        Linear::with_init(in_features, out_features, true, Init::KaimingUniform, Init::LecunUniform, device)
    }

    /// A layer with the given initializations (`bias_init` is ignored
    /// without a bias).
    pub fn with_init(
        in_features: usize,
        out_features: usize,
        bias: bool,
        weight_init: Init,
        bias_init: Init,
        device: &Device,
    ) -> Result<Linear> {
        let weight = parameter(weight_init, &[out_features, in_features], in_features, out_features, device)?;
        let bias =
            if bias { Some(parameter(bias_init, &[out_features], in_features, out_features, device)?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.weight.dims()[1]
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        v.extend(self.bias.iter().map(|b| ("bias".to_string(), b.clone())));
        v
    }
}

/// Elementwise activation functions, usable as modules.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// `max(x, 0)`.
    Relu,
    /// `x` for `x > 0`, else `slope * x`.
    LeakyRelu(f64),
    /// Exact GELU.
    Gelu,
    /// Logistic sigmoid.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// `x * sigmoid(x)`.
    Silu,
}

impl Module for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Activation::Relu => relu(x),
            Activation::LeakyRelu(s) => leaky_relu(x, s),
            Activation::Gelu => gelu(x),
            Activation::Sigmoid => sigmoid(x),
            Activation::Tanh => tanh(x),
            Activation::Silu => silu(x),
        }
    }
}

/// `max(x, 0)`.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    x.relu()
}

/// `x` where positive, else `slope * x`.
pub fn leaky_relu(x: &Tensor, slope: f64) -> Result<Tensor> {
    let zero = Tensor::scalar(0, x.dtype(), x.device());
    x.gt(&zero)?.where_(x, &x.mul(&Tensor::scalar(slope, x.dtype(), x.device()))?)
}

/// Exact (erf) GELU.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    x.gelu()
}

/// Logistic sigmoid.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    x.sigmoid()
}

/// Hyperbolic tangent.
pub fn tanh(x: &Tensor) -> Result<Tensor> {
    x.tanh()
}

/// SiLU / swish: `x * sigmoid(x)`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    x.mul(&x.sigmoid()?)
}

/// Softmax along `axis`.
pub fn softmax(x: &Tensor, axis: isize) -> Result<Tensor> {
    x.softmax(axis)
}

/// Log-softmax along `axis`.
pub fn log_softmax(x: &Tensor, axis: isize) -> Result<Tensor> {
    x.log_softmax(axis)
}

/// One-hot encoding of integer `labels` (any shape `[..]`) as `dtype`,
/// shape `[.., classes]`; a label outside `0..classes` gives a row of zeros.
pub fn one_hot(labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    if !labels.dtype().is_int() {
        return Err(invalid(
            "one_hot",
            format!("labels must have an integer dtype, got {}{}", labels.dtype(), labels.shape()),
        ));
    }
    let mut dims = labels.dims().to_vec();
    dims.push(classes);
    let cols = Tensor::iota(dims.clone(), dims.len() - 1, labels.dtype(), labels.device())?;
    labels.unsqueeze(-1)?.eq(&cols)?.cast(dtype)
}

/// How a loss combines its per-element values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The mean over the elements that count (PyTorch's default).
    #[default]
    Mean,
    /// The sum.
    Sum,
    /// No reduction: one value per element.
    None,
}

/// Options of [`cross_entropy_with`]; the default is plain mean
/// cross-entropy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CrossEntropyOptions {
    /// Targets equal to this value contribute nothing, and the mean is
    /// taken over the others (PyTorch's `ignore_index`, often -100 or a
    /// padding token).
    pub ignore_index: Option<i64>,
    /// Label smoothing `eps` in `[0, 1]`: the target distribution is
    /// `(1 - eps) * one_hot + eps / classes`.
    pub label_smoothing: f64,
    /// How per-element losses combine.
    pub reduction: Reduction,
}

/// Mean cross-entropy of `logits` (`[.., classes]`, float, any leading
/// dims) against integer class `labels` (`[..]`):
/// `-mean log_softmax(logits)[.., labels[..]]`. See [`cross_entropy_with`]
/// for `ignore_index`, label smoothing and other reductions.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, labels, &CrossEntropyOptions::default())
}

/// Cross-entropy of `logits` (`[.., classes]`, float) against integer
/// class `labels` (`[..]`, the leading dims of `logits`), with an optional
/// ignored target value, label smoothing and a reduction. The classes are
/// the last dim (so a `[batch, time, vocab]` language-model output needs
/// no transpose; PyTorch puts them at dim 1).
///
/// Per element, with `p = log_softmax(logits)`:
/// `loss = -(1 - eps) * p[label] - eps * mean_c p[c]`, zero where the
/// label is `ignore_index`; `Mean` divides the sum by the number of
/// elements not ignored (NaN when every element is ignored, like
/// PyTorch). It is written as log-softmax times a one-hot mask (`iota ==
/// labels`), so it needs no gather (whose out-of-range check would make a
/// bad label an error) and its gradient is `(softmax - target) / count`. A label outside
/// `0..classes` that is not ignored matches no class: only its smoothing
/// term counts.
pub fn cross_entropy_with(logits: &Tensor, labels: &Tensor, opts: &CrossEntropyOptions) -> Result<Tensor> {
    let op = "cross_entropy";
    if logits.rank() == 0 || labels.dims() != &logits.dims()[..logits.rank() - 1] {
        return Err(invalid(
            op,
            format!(
                "expected logits [.., classes] and labels of their leading dims [..], got {} and {}",
                logits.shape(),
                labels.shape()
            ),
        ));
    }
    if !logits.dtype().is_float() || !labels.dtype().is_int() {
        return Err(invalid(
            op,
            format!("expected float logits and integer labels, got {} and {}", logits.dtype(), labels.dtype()),
        ));
    }
    let eps = opts.label_smoothing;
    if !(0.0..=1.0).contains(&eps) {
        return Err(invalid(op, format!("label_smoothing must be in [0, 1], got {eps}")));
    }
    let (dt, dev) = (logits.dtype(), logits.device());
    let c = logits.dims()[logits.rank() - 1];
    let logp = logits.log_softmax(-1)?;
    let mask = one_hot(labels, c, dt)?;
    let mut loss = logp.mul(&mask)?.sum(&[-1], false)?.neg()?;
    if eps > 0.0 {
        let smooth = logp.mean(&[-1], false)?.neg()?;
        loss = loss.mul(&Tensor::scalar(1.0 - eps, dt, dev))?.add(&smooth.mul(&Tensor::scalar(eps, dt, dev))?)?;
    }
    let valid = match opts.ignore_index {
        Some(ignore) => {
            let ld = labels.dtype();
            let bits = 8 * ld.size_bytes() as u32;
            let (lo, hi) = if ld.is_unsigned_int() {
                (0i128, (1i128 << bits) - 1)
            } else {
                (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
            };
            // A value the labels cannot hold ignores nothing.
            let keep = if (lo..=hi).contains(&(ignore as i128)) {
                labels.ne(&Tensor::scalar(ignore, labels.dtype(), dev))?
            } else {
                Tensor::full(labels.shape().clone(), true, DType::Bool, dev)?
            };
            loss = keep.where_(&loss, &Tensor::scalar(0.0, dt, dev))?;
            Some(keep)
        }
        None => None,
    };
    match opts.reduction {
        Reduction::None => Ok(loss),
        Reduction::Sum => loss.sum(&[], false),
        Reduction::Mean => match valid {
            None => loss.mean(&[], false),
            Some(keep) => loss.sum(&[], false)?.div(&keep.cast(dt)?.sum(&[], false)?),
        },
    }
}

/// Mean squared error over all elements (`target` broadcasts to `pred`).
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = pred.sub(target)?;
    d.mul(&d)?.mean(&[], false)
}

/// Layer normalization over the last `normalized_dims` dims of `x`, with
/// optional elementwise affine `weight` and `bias` (shape of those dims).
pub fn layer_norm(
    x: &Tensor,
    normalized_dims: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
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
        layer_norm(x, self.weight.rank(), Some(&self.weight), Some(&self.bias), self.eps)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_no_weight_decay(&self) -> Vec<String> {
        vec!["weight".into(), "bias".into()]
    }
}

/// Inverted dropout with the device RNG (see [`Tensor::dropout`]).
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    x.dropout(p, training)
}

/// Dropout as a module; active in training mode ([`Module::train`],
/// the default), a pass-through in evaluation mode ([`Module::eval`]).
#[derive(Clone, Debug)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    training: Mode,
}

impl Dropout {
    /// Dropout with probability `p`, in training mode.
    pub fn new(p: f64) -> Dropout {
        Dropout { p, training: Mode::new(true) }
    }

    /// True in training mode.
    pub fn is_training(&self) -> bool {
        self.training.get()
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.training.get())
    }

    fn set_own_training(&self, training: bool) {
        self.training.set(training)
    }
}

/// A lookup table: `forward(ids)` gathers rows of `weight` (`[num, dim]`)
/// for integer `ids` of any shape, giving `[..ids, dim]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// `[num_embeddings, dim]`, initialized `N(0, 1)`.
    pub weight: Tensor,
}

impl Embedding {
    /// A table of `num` rows of `dim` values.
    pub fn new(num: usize, dim: usize, device: &Device) -> Result<Embedding> {
        Ok(Embedding { weight: parameter(Init::Normal(1.0), &[num, dim], num, dim, device)? })
    }
}

impl Module for Embedding {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.gather(0, ids)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone())]
    }

    fn own_no_weight_decay(&self) -> Vec<String> {
        vec!["weight".into()]
    }
}

/// Modules applied in order; parameters are named `"{index}.{name}"`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module + Send + Sync>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends a module.
    #[allow(clippy::should_implement_trait)] // A builder method, not `std::ops::Add`.
    pub fn add(mut self, m: impl Module + Send + Sync + 'static) -> Sequential {
        self.layers.push(Box::new(m));
        self
    }

    /// Number of modules.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True without modules.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers.iter().enumerate().map(|(i, l)| (i.to_string(), l.as_ref() as &dyn Module)).collect()
    }
}

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
fn batched(op: &str, x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
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

    /// Weight initialization (default Kaiming uniform, `fan_in = in / groups * kh * kw`).
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
            weight_init: Init::KaimingUniform,
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
    /// Added to the variance.
    pub eps: f64,
    /// Weight of the batch statistics in the running ones.
    pub momentum: f64,
    training: Mode,
}

impl BatchNorm2d {
    /// Batch norm over `channels`, eps 1e-5, momentum 0.1, training mode.
    pub fn new(channels: usize, device: &Device) -> Result<BatchNorm2d> {
        Ok(BatchNorm2d {
            weight: parameter(Init::Constant(1.0), &[channels], channels, channels, device)?,
            bias: parameter(Init::Constant(0.0), &[channels], channels, channels, device)?,
            running_mean: Tensor::zeros([channels], DType::F32, device)?,
            running_var: Tensor::ones([channels], DType::F32, device)?,
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
        let c = self.weight.numel();
        if x.rank() != 4 || x.dims()[1] != c {
            return Err(invalid("BatchNorm2d", format!("expected an [N, {c}, H, W] input, got {}", x.shape())));
        }
        let (dt, dev) = (x.dtype(), x.device());
        let s = |v: f64| Tensor::scalar(v, dt, dev);
        let (mean, var) = if self.training.get() {
            let n = x.dims()[0] * x.dims()[2] * x.dims()[3];
            if n < 2 {
                return Err(invalid(
                    "BatchNorm2d",
                    format!("training needs more than one value per channel, got input {}", x.shape()),
                ));
            }
            let mean = x.mean(&[0, 2, 3], false)?;
            let xc = x.sub(&per_channel(&mean, x)?)?;
            let var = xc.mul(&xc)?.mean(&[0, 2, 3], false)?;
            crate::no_grad(|| -> Result<()> {
                let m = self.momentum;
                let update = |running: &Tensor, batch: &Tensor| -> Result<()> {
                    let batch = batch.detach().cast(running.dtype())?;
                    let keep = Tensor::scalar(1.0 - m, running.dtype(), dev);
                    let take = Tensor::scalar(m, running.dtype(), dev);
                    running.assign(&running.mul(&keep)?.add(&batch.mul(&take)?)?)
                };
                update(&self.running_mean, &mean)?;
                update(&self.running_var, &var.mul(&s(n as f64 / (n - 1) as f64))?)
            })?;
            (mean, var)
        } else {
            (self.running_mean.cast(dt)?, self.running_var.cast(dt)?)
        };
        let inv = var.add(&s(self.eps))?.rsqrt()?;
        let scale = inv.mul(&self.weight.cast(dt)?)?;
        let shift = self.bias.cast(dt)?.sub(&mean.mul(&scale)?)?;
        x.mul(&per_channel(&scale, x)?)?.add(&per_channel(&shift, x)?)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }

    fn own_buffers(&self) -> Vec<(String, Tensor)> {
        vec![("running_mean".into(), self.running_mean.clone()), ("running_var".into(), self.running_var.clone())]
    }

    fn set_own_training(&self, training: bool) {
        self.training.set(training)
    }
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
pub fn group_norm(
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
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
        let c = self.weight.numel();
        if x.rank() < 2 || x.dims()[1] != c {
            return Err(invalid("GroupNorm", format!("expected an [N, {c}, ...] input, got {}", x.shape())));
        }
        group_norm(x, self.groups, Some(&self.weight), Some(&self.bias), self.eps)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
}

/// An additive causal mask `[t_q, t_k]` of `dtype`: 0 where query `i` may
/// attend to key `j` (`j <= i`, aligned at the top left as PyTorch's
/// `is_causal`), `-inf` elsewhere. Add it to attention scores, or pass it
/// as [`AttentionOptions::mask`].
pub fn causal_mask(t_q: usize, t_k: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    if !dtype.is_float() {
        return Err(invalid("causal_mask", format!("an additive mask needs a float dtype, got {dtype}")));
    }
    let keep = causal_keep(t_q, t_k, device)?;
    keep.where_(&Tensor::scalar(0.0, dtype, device), &Tensor::scalar(f64::NEG_INFINITY, dtype, device))
}

/// `[t_q, t_k]` bool: true where `j <= i`.
fn causal_keep(t_q: usize, t_k: usize, device: &Device) -> Result<Tensor> {
    let i = Tensor::iota([t_q, t_k], 0, DType::I32, device)?;
    let j = Tensor::iota([t_q, t_k], 1, DType::I32, device)?;
    j.le(&i)
}

/// Options of [`scaled_dot_product_attention`]; the default is plain,
/// unmasked attention scaled by `1 / sqrt(head_dim)`.
#[derive(Clone, Debug, Default)]
pub struct AttentionOptions {
    /// Query `i` attends only to keys `j <= i` (top-left aligned, as
    /// PyTorch's `is_causal`).
    pub causal: bool,
    /// A mask broadcastable to the scores `[.., t_q, t_k]`: float, added
    /// to the scores (`-inf` removes a key), or bool, true where a query
    /// may attend (PyTorch's `attn_mask`). Combines with `causal`.
    pub mask: Option<Tensor>,
    /// The score scale; `1 / sqrt(head_dim)` when `None`.
    pub scale: Option<f64>,
}

impl AttentionOptions {
    /// Causal attention.
    pub fn causal() -> AttentionOptions {
        AttentionOptions { causal: true, ..AttentionOptions::default() }
    }

    /// With a mask (float additive or bool keep).
    pub fn with_mask(mut self, mask: Tensor) -> AttentionOptions {
        self.mask = Some(mask);
        self
    }

    /// With an explicit score scale.
    pub fn with_scale(mut self, scale: f64) -> AttentionOptions {
        self.scale = Some(scale);
        self
    }
}

/// Scaled dot-product attention: `softmax(q k^T * scale + mask) v` over
/// `q` `[.., t_q, d]`, `k` `[.., t_k, d]`, `v` `[.., t_k, d_v]` (leading
/// dims broadcast, e.g. `[batch, heads]`), giving `[.., t_q, d_v]`; any
/// lengths and head dims.
///
/// It records one fused op ([`Tensor::attention`]): the `[t_q, t_k]`
/// scores are never materialized, forward or backward (FlashAttention-2:
/// the backward recomputes them blockwise from the forward's per-query
/// log-sum-exp), on every backend. A query whose keys are all masked gets
/// NaN, like PyTorch's math backend. Two cases record the unfused
/// composition instead ([`scaled_dot_product_attention_unfused`], whose
/// results the fused op matches up to rounding): a mask that needs a
/// gradient (the fused op has none for it), and a mask whose last two
/// dims would grow the scores beyond `[t_q, t_k]`.
pub fn scaled_dot_product_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
    let scale = check_attention(q, k, v, opts)?;
    let (tq, tk) = (q.dims()[q.rank() - 2], k.dims()[k.rank() - 2]);
    if let Some(m) = &opts.mask {
        let md = m.dims();
        let at = |back: usize| if md.len() >= back { md[md.len() - back] } else { 1 };
        let fits = (at(2) == 1 || at(2) == tq) && (at(1) == 1 || at(1) == tk);
        if !fits || m.requires_grad() {
            return scaled_dot_product_attention_unfused(q, k, v, opts);
        }
    }
    q.attention(k, v, scale, opts.causal, opts.mask.as_ref())
}

/// Scaled dot-product attention as its unfused composition: two matmuls
/// around a softmax, the `[.., t_q, t_k]` scores materialized, gradients
/// from autodiff of each op. The reference the fused
/// [`scaled_dot_product_attention`] is tested against (same arguments,
/// same results up to rounding), and its path for masks that need a
/// gradient.
pub fn scaled_dot_product_attention_unfused(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOptions,
) -> Result<Tensor> {
    let scale = check_attention(q, k, v, opts)?;
    let (dt, dev) = (q.dtype(), q.device());
    let (tq, tk) = (q.dims()[q.rank() - 2], k.dims()[k.rank() - 2]);
    let mut scores = q.matmul(&k.t()?)?.mul(&Tensor::scalar(scale, dt, dev))?;
    let neg_inf = Tensor::scalar(f64::NEG_INFINITY, dt, dev);
    if opts.causal {
        scores = causal_keep(tq, tk, dev)?.where_(&scores, &neg_inf)?;
    }
    if let Some(m) = &opts.mask {
        scores = match m.dtype() {
            DType::Bool => m.where_(&scores, &neg_inf)?,
            _ => scores.add(m)?,
        };
    }
    scores.softmax(-1)?.matmul(v)
}

/// Checks the operands of scaled dot-product attention; returns the scale.
fn check_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOptions) -> Result<f64> {
    let op = "scaled_dot_product_attention";
    let (rq, rk, rv) = (q.rank(), k.rank(), v.rank());
    let shapes = || format!("q {}, k {}, v {}", q.shape(), k.shape(), v.shape());
    if rq < 2 || rk < 2 || rv < 2 {
        return Err(invalid(op, format!("q, k and v need rank >= 2 ([.., t, d]), got {}", shapes())));
    }
    if q.dims()[rq - 1] != k.dims()[rk - 1] || k.dims()[rk - 2] != v.dims()[rv - 2] {
        return Err(invalid(
            op,
            format!("q and k need the same head dim and k and v the same length, got {}", shapes()),
        ));
    }
    let dt = q.dtype();
    if !dt.is_float() || dt != k.dtype() || dt != v.dtype() {
        return Err(invalid(
            op,
            format!("q, k and v need one float dtype, got {}, {} and {}", q.dtype(), k.dtype(), v.dtype()),
        ));
    }
    if let Some(m) = &opts.mask {
        if m.dtype() != DType::Bool && m.dtype() != dt {
            return Err(invalid(op, format!("the mask must be bool or {dt} (the scores' dtype), got {}", m.dtype())));
        }
    }
    let d = q.dims()[rq - 1];
    Ok(opts.scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt()))
}

/// Multi-head attention, PyTorch's `nn.MultiheadAttention` with
/// `batch_first=True`: inputs `[batch, t, embed_dim]`, one packed input
/// projection `in_proj_weight` `[3 * embed, embed]` (+ `in_proj_bias`),
/// `num_heads` heads of `embed / num_heads` dims through
/// [`scaled_dot_product_attention`], and the output projection
/// `out_proj`. [`Module::forward`] is self-attention (causal when built
/// with [`MultiheadAttention::causal`]); [`MultiheadAttention::attend`]
/// takes separate query, key and value and any [`AttentionOptions`].
#[derive(Clone, Debug)]
pub struct MultiheadAttention {
    /// `[3 * embed_dim, embed_dim]`: the query, key and value projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3 * embed_dim]`.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection.
    pub out_proj: Linear,
    /// Number of heads.
    pub num_heads: usize,
    /// Self-attention in [`Module::forward`] is causal.
    pub is_causal: bool,
}

impl MultiheadAttention {
    /// `num_heads` heads over `embed_dim` (a multiple of it), with biases:
    /// Xavier-uniform input projection, zero biases, PyTorch's.
    pub fn new(embed_dim: usize, num_heads: usize, device: &Device) -> Result<MultiheadAttention> {
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(invalid(
                "MultiheadAttention",
                format!("embed_dim {embed_dim} is not a multiple of num_heads {num_heads}"),
            ));
        }
        let e = embed_dim;
        Ok(MultiheadAttention {
            in_proj_weight: parameter(Init::XavierUniform, &[3 * e, e], e, 3 * e, device)?,
            in_proj_bias: Some(parameter(Init::Constant(0.0), &[3 * e], e, 3 * e, device)?),
            out_proj: Linear::with_init(e, e, true, Init::LecunUniform, Init::Constant(0.0), device)?,
            num_heads,
            is_causal: false,
        })
    }

    /// Makes [`Module::forward`] causal self-attention.
    pub fn causal(mut self, causal: bool) -> MultiheadAttention {
        self.is_causal = causal;
        self
    }

    /// Embedding width.
    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.dims()[1]
    }

    /// Attention of `query` (`[b, t_q, e]`) over `key` and `value`
    /// (`[b, t_k, e]`); a mask in `opts` broadcasts to `[b, heads, t_q, t_k]`.
    pub fn attend(&self, query: &Tensor, key: &Tensor, value: &Tensor, opts: &AttentionOptions) -> Result<Tensor> {
        let e = self.embed_dim();
        let h = self.num_heads;
        for t in [query, key, value] {
            if t.rank() != 3 || t.dims()[2] != e {
                return Err(invalid(
                    "MultiheadAttention",
                    format!(
                        "expected [batch, t, {e}] inputs, got {}, {} and {}",
                        query.shape(),
                        key.shape(),
                        value.shape()
                    ),
                ));
            }
        }
        let project = |x: &Tensor, i: usize| -> Result<Tensor> {
            let w = self.in_proj_weight.narrow(0, i * e, e)?;
            let mut y = x.matmul(&w.t()?)?;
            if let Some(b) = &self.in_proj_bias {
                y = y.add(&b.narrow(0, i * e, e)?)?;
            }
            // [b, t, e] -> [b, h, t, e / h]
            let (b, t) = (x.dims()[0], x.dims()[1]);
            y.reshape([b, t, h, e / h])?.permute(&[0, 2, 1, 3])
        };
        let (q, k, v) = (project(query, 0)?, project(key, 1)?, project(value, 2)?);
        let o = scaled_dot_product_attention(&q, &k, &v, opts)?;
        let (b, t) = (query.dims()[0], query.dims()[1]);
        self.out_proj.forward(&o.permute(&[0, 2, 1, 3])?.reshape([b, t, e])?)
    }
}

impl Module for MultiheadAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let opts = AttentionOptions { causal: self.is_causal, ..AttentionOptions::default() };
        self.attend(x, x, x, &opts)
    }

    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("in_proj_weight".to_string(), self.in_proj_weight.clone())];
        v.extend(self.in_proj_bias.iter().map(|b| ("in_proj_bias".to_string(), b.clone())));
        v
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("out_proj".into(), &self.out_proj as &dyn Module)]
    }
}

/// Flattens `[N, ...]` to `[N, rest]` (PyTorch's `nn.Flatten`), as a module
/// for [`Sequential`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() < 2 {
            return Ok(x.clone());
        }
        x.flatten(1, -1)
    }
}
