//! Neural-network building blocks over lazy tensors: the [`Module`] trait
//! (own parameters, buffers and mode, children) and [`ModuleExt`], its
//! walks that no module can override (nested parameter names, buffers,
//! train/eval mode, weight-decay exemptions, state dicts over
//! safetensors), layers ([`Linear`], [`Conv1d`], [`Conv2d`],
//! [`MaxPool2d`], [`AvgPool2d`], [`AdaptiveAvgPool2d`],
//! [`AdaptiveMaxPool2d`], [`BatchNorm1d`], [`BatchNorm2d`], [`GroupNorm`],
//! [`LayerNorm`], [`RmsNorm`], [`Embedding`], [`Dropout`],
//! [`MultiheadAttention`], [`TransformerBlock`], [`RotaryEmbedding`],
//! [`ConvTranspose1d`], [`ConvTranspose2d`], [`Lstm`], [`Gru`], [`Glu`], [`SwiGlu`],
//! [`Sequential`]),
//! attention ([`scaled_dot_product_attention`], its unfused reference
//! [`scaled_dot_product_attention_unfused`], [`causal_mask`]), losses
//! ([`cross_entropy`], [`cross_entropy_with`], [`mse`]) and seeded
//! initialization ([`Init`]).
//!
//! Everything here composes executor ops, so gradients come from
//! `lazuli_executor::autograd` and a whole training step stays one lazy
//! graph. Parameters are leaves created with `requires_grad_(true)`;
//! optimizers ([`crate::optim`]) update them in place with
//! [`Tensor::assign`], and so do the batch norms their running statistics.
//! Initialization draws from the device RNG
//! ([`Device::manual_seed`](crate::Device::manual_seed) makes it
//! reproducible).
//!
//! Attention records the fused op ([`Tensor::attention`]: the scores are
//! never materialized); its unfused composition (two matmuls around a
//! softmax) stays available as the reference,
//! [`scaled_dot_product_attention_unfused`].
//!
//! `#[derive(Module)]` (from `lazuli_derive`, re-exported here beside the
//! trait) writes a struct's [`Module`] lists from its fields.
//!
//! One file per layer family: `init`, `linear`, `activation`, `loss`,
//! `norm`, `conv`, `conv_transpose`, `pool`, `dropout`, `embedding`,
//! `attention`, `transformer`, `rope`, `rnn`, `ffn` and `sequential`;
//! everything public is re-exported here, so every path is
//! `lazuli::nn::Name`. This file holds the [`Module`] and [`ModuleExt`]
//! traits and the train/eval flag the layers with a mode share.

mod activation;
mod attention;
mod conv;
mod conv_transpose;
mod dropout;
mod embedding;
mod ffn;
mod init;
mod linear;
mod loss;
mod norm;
mod pool;
mod rnn;
mod rope;
mod sequential;
mod transformer;

pub use activation::{gelu, leaky_relu, log_softmax, relu, sigmoid, silu, softmax, tanh, Activation};
pub use attention::{
    causal_mask, scaled_dot_product_attention, scaled_dot_product_attention_unfused, AttentionOptions,
    MultiheadAttention,
};
pub use conv::{conv1d, Conv1d, Conv1dBuilder, Conv2d, Conv2dBuilder, Size2};
pub use conv_transpose::{
    conv_transpose1d, conv_transpose2d, ConvTranspose1d, ConvTranspose1dBuilder, ConvTranspose2d, ConvTranspose2dAttrs,
    ConvTranspose2dBuilder,
};
pub use dropout::{dropout, Dropout};
pub use embedding::{one_hot, Embedding};
pub use ffn::{glu, Glu, SwiGlu};
pub use init::Init;
/// `#[derive(Module)]`: parameters, buffers and children from a struct's
/// fields, `forward` from its inherent method (see `lazuli_derive`).
pub use lazuli_derive::Module;
pub use linear::Linear;
pub use loss::{
    binary_cross_entropy_with_logits, cross_entropy, cross_entropy_with, huber_loss, kl_div, l1_loss, mse, nll_loss,
    smooth_l1_loss, BceWithLogitsOptions, CrossEntropyOptions, NllLossOptions, Reduction,
};
pub use norm::{batch_norm, group_norm, layer_norm, rms_norm, BatchNorm1d, BatchNorm2d, GroupNorm, LayerNorm, RmsNorm};
pub use pool::{adaptive_avg_pool2d, adaptive_max_pool2d, AdaptiveAvgPool2d, AdaptiveMaxPool2d, AvgPool2d, MaxPool2d};
pub use rnn::{Gru, Lstm, RnnLayer, RnnOptions};
pub use rope::RotaryEmbedding;
pub use sequential::{Flatten, Sequential};
pub use transformer::TransformerBlock;

use crate::serialize::{LoadOptions, LoadReport};
use crate::{ExecError, Result, Tensor};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// A layer or model: a forward function, its own parameters and buffers,
/// its sub-modules and its own training/evaluation mode.
///
/// A module lists its own tensors ([`Module::own_parameters`],
/// [`Module::own_buffers`]) and its sub-modules ([`Module::children`]);
/// [`ModuleExt`] walks the tree and joins names with dots
/// (`"features.0.weight"`), PyTorch's convention, so a model built from
/// layers gets nested names without writing them by hand.
///
/// The walks (parameters, buffers, weight-decay exemptions, train/eval,
/// state dicts) are not methods of this trait, so no module can override
/// one of them and leave the others behind: every walk sees the same
/// tree. A module that lists a sub-module's tensors must return it from
/// [`Module::children`].
///
/// `#[derive(Module)]` writes those lists from the fields (tensors are
/// parameters, or buffers with `#[module(buffer)]`; other fields are
/// children, `Vec`s of them lists of children; numbers and flags are left
/// out; `#[module(skip)]` leaves out anything) and makes `forward` the
/// type's inherent `forward`:
///
/// ```
/// use lazuli::nn::{self, Module, ModuleExt};
/// use lazuli::prelude::*;
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: nn::Linear,
///     drop: nn::Dropout,
///     fc2: nn::Linear,
/// }
///
/// impl Mlp {
///     fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
///         self.fc2.forward(&self.drop.forward(&self.fc1.forward(x)?.relu()?)?)
///     }
/// }
///
/// # fn main() -> lazuli::Result<()> {
/// let dev = Device::cpu();
/// let m = Mlp { fc1: nn::Linear::new(4, 8, &dev)?, drop: nn::Dropout::new(0.1), fc2: nn::Linear::new(8, 2, &dev)? };
/// let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]);
/// m.eval(); // reaches the dropout
/// # Ok(()) }
/// ```
///
/// Without an inherent `forward` the derive does not compile (its
/// `Module::forward` would call itself):
///
/// ```compile_fail
/// #[derive(lazuli::nn::Module)]
/// struct NoForward {
///     fc: lazuli::nn::Linear,
/// }
/// ```
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
    /// without touching children; [`ModuleExt::set_training`] walks the
    /// tree. Modules without a mode ignore it.
    fn set_own_training(&self, _training: bool) {}
}

/// The walks over a [`Module`] tree: every method here is derived from
/// the module's own tensors and [`Module::children`], and this trait is
/// implemented for every module and cannot be implemented again, so a
/// model cannot list its parameters one way and switch modes or exempt
/// weight decay another. (It is in [`crate::prelude`].)
///
/// Overriding a walk in a module does not compile:
///
/// ```compile_fail,E0407
/// use lazuli::nn::{Linear, Module};
/// use lazuli::{Result, Tensor};
///
/// struct Net {
///     fc: Linear,
/// }
///
/// impl Module for Net {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> {
///         self.fc.forward(x)
///     }
///
///     fn named_parameters(&self) -> Vec<(String, Tensor)> {
///         vec![("fc.weight".into(), self.fc.weight.clone())]
///     }
/// }
/// ```
pub trait ModuleExt: Module {
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

    /// The trainable tensors, in [`ModuleExt::named_parameters`] order.
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

    /// Writes [`ModuleExt::state_dict`] to `path` as safetensors (a barrier).
    fn save_state_dict(&self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        Ok(crate::serialize::save(path, &self.state_dict())?)
    }

    /// Loads a safetensors file written by [`ModuleExt::save_state_dict`]
    /// (or by PyTorch with the same names; or a sharded checkpoint's
    /// `*.safetensors.index.json`) into this module's tensors in place:
    /// every entry of the state dict must be in the file with the same
    /// shape (float tensors of another float dtype, f16 and bf16 included,
    /// are converted to the entry's dtype), and the file may hold nothing
    /// else. Parameters keep their identity, so optimizers keep working on
    /// them.
    fn load_state_dict(&self, path: impl AsRef<Path>) -> Result<()>
    where
        Self: Sized,
    {
        Ok(crate::serialize::load_state_dict(path, &self.state_dict())?)
    }

    /// [`ModuleExt::load_state_dict`] with options: non-strict keys and
    /// key renaming ([`LoadOptions`]); the [`LoadReport`] names the missing
    /// and unexpected keys of a non-strict load.
    ///
    /// ```no_run
    /// # use lazuli::prelude::*;
    /// # use lazuli::serialize::LoadOptions;
    /// # fn main() -> lazuli::Result<()> {
    /// # let dev = Device::cpu();
    /// let head = lazuli::nn::Linear::new(768, 10, &dev)?;
    /// // The file's "classifier.weight" is this module's "weight".
    /// let opts = LoadOptions::non_strict().rename(|k| k.strip_prefix("classifier.").map(str::to_string));
    /// let report = head.load_state_dict_with("model.safetensors", &opts)?;
    /// assert!(report.missing_keys.is_empty());
    /// # Ok(()) }
    /// ```
    fn load_state_dict_with(&self, path: impl AsRef<Path>, options: &LoadOptions<'_>) -> Result<LoadReport>
    where
        Self: Sized,
    {
        Ok(crate::serialize::load_into_with(path, &self.state_dict(), options)?)
    }
}

// The only implementation: a second one for any type would overlap this
// one, which is what keeps the walks from being overridden.
impl<M: Module + ?Sized> ModuleExt for M {}

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
