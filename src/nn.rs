//! Neural-network building blocks over lazy tensors: the [`Module`] trait,
//! [`Linear`], [`LayerNorm`], [`Embedding`], [`Dropout`], activations,
//! [`Sequential`], losses ([`cross_entropy`], [`mse`]) and seeded
//! initialization ([`Init`]).
//!
//! Everything here composes executor ops, so gradients come from
//! `lazuli_executor::autograd` and a whole training step stays one lazy
//! graph. Parameters are leaves created with `requires_grad_(true)`;
//! optimizers ([`crate::optim`]) update them in place with
//! [`Tensor::assign`]. Initialization draws from the device RNG
//! ([`Device::manual_seed`] makes it reproducible).

use crate::{DType, Device, ExecError, Result, Tensor};

/// A layer or model: a forward function and named parameters.
pub trait Module {
    /// Applies the module to `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// The trainable tensors, with dotted names ("0.weight", "fc1.bias").
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// The trainable tensors, in [`Module::named_parameters`] order.
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters().into_iter().map(|(_, t)| t).collect()
    }
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
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

/// `[batch, classes]` one-hot encoding of integer `labels` (`[batch]`) as `dtype`.
pub fn one_hot(labels: &Tensor, classes: usize, dtype: DType) -> Result<Tensor> {
    if labels.rank() != 1 || !labels.dtype().is_int() {
        return Err(ExecError::Invalid {
            op: "one_hot".into(),
            detail: format!("labels must be a rank-1 integer tensor, got {}{}", labels.dtype(), labels.shape()),
        });
    }
    let b = labels.dims()[0];
    let cols = Tensor::iota([b, classes], 1, labels.dtype(), labels.device())?;
    labels.reshape_to([b, 1])?.eq(&cols)?.cast(dtype)
}

/// Mean cross-entropy of `logits` (`[batch, classes]`, float) against
/// integer class `labels` (`[batch]`): `-mean_i log_softmax(logits)[i, labels[i]]`.
/// Written as log-softmax times a one-hot mask (`iota == labels`), so it
/// needs no gather and its gradient is `(softmax - one_hot) / batch`.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    if logits.rank() != 2 || labels.rank() != 1 || labels.dims()[0] != logits.dims()[0] {
        return Err(ExecError::Invalid {
            op: "cross_entropy".into(),
            detail: format!(
                "expected logits [batch, classes] and labels [batch], got {} and {}",
                logits.shape(),
                labels.shape()
            ),
        });
    }
    let (b, c) = (logits.dims()[0], logits.dims()[1]);
    let mask = one_hot(labels, c, logits.dtype())?;
    let picked = logits.log_softmax(-1)?.mul(&mask)?.sum(&[], false)?;
    picked.mul(&Tensor::scalar(-1.0 / b as f64, logits.dtype(), logits.device()))
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone()), ("bias".into(), self.bias.clone())]
    }
}

/// Inverted dropout with the device RNG (see [`Tensor::dropout`]).
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    x.dropout(p, training)
}

/// Dropout as a module; active while `training` is set.
#[derive(Clone, Debug)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    /// Apply dropout (training) or pass through (evaluation).
    pub training: bool,
}

impl Dropout {
    /// Dropout with probability `p`, in training mode.
    pub fn new(p: f64) -> Dropout {
        Dropout { p, training: true }
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.training)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone())]
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

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.named_parameters().into_iter().map(move |(n, t)| (format!("{i}.{n}"), t)))
            .collect()
    }
}
