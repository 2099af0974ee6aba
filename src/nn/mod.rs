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
use crate::{no_grad, Device, ExecError, Result, Tensor};
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
    /// Applies the module to `x`. `#[track_caller]` (for every
    /// implementation): a shape error names the line that called
    /// `forward`.
    #[track_caller]
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

    /// This module's own parameters and buffers, mutably, in any order:
    /// what [`ModuleExt::to_device`] replaces. None by default; a module
    /// with tensors of its own implements it (`#[derive(Module)]` and
    /// every layer of this module do), or `to_device` refuses to move it.
    fn own_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        Vec::new()
    }

    /// The direct sub-modules, mutably, in any order (see
    /// [`Module::own_tensors_mut`]). None by default.
    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
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

    /// Computes every parameter and buffer that is still pending (a
    /// layer's random initialization) in one sync per device, returning
    /// without waiting. Optional: the first sync on a device materializes
    /// them anyway ([`Tensor::persist`]); this does it at a moment of the
    /// program's choosing, e.g. before timing a loop.
    #[track_caller]
    fn materialize(&self) -> Result<()> {
        let state = self.state_dict();
        let mut by_device: Vec<Vec<&Tensor>> = Vec::new();
        for (_, t) in &state {
            match by_device.iter_mut().find(|g| g[0].device().same(t.device())) {
                Some(group) => group.push(t),
                None => by_device.push(vec![t]),
            }
        }
        for group in by_device {
            crate::sync(&group)?;
        }
        Ok(())
    }

    /// Moves every parameter and buffer to `device` in place (PyTorch's
    /// `model.to(device)`): each tensor field is replaced by its copy on
    /// `device` (a parameter stays a leaf that requires grad; its
    /// gradient, if any, moves with it; a tensor listed twice, a tied
    /// weight, stays one tensor). Pending values are computed first, one
    /// sync per device. Move a model before making its optimizer: an
    /// optimizer holds the tensors it was given, as PyTorch's does.
    ///
    /// Every tensor of [`ModuleExt::state_dict`] must be reachable through
    /// [`Module::own_tensors_mut`] and [`Module::children_mut`]
    /// (`#[derive(Module)]` and the layers of this module implement them);
    /// otherwise nothing moves and the error names the tensors that could
    /// not.
    #[track_caller]
    fn to_device(&mut self, device: &Device) -> Result<()> {
        let at = std::panic::Location::caller();
        let op = format!("ModuleExt::to_device at {}:{}", at.file(), at.line());
        let state = self.state_dict();
        let mut reachable = std::collections::HashSet::new();
        walk_tensors_mut(self, &mut |t| {
            reachable.insert(t.id());
            Ok(())
        })?;
        let stuck: Vec<&str> =
            state.iter().filter(|(_, t)| !reachable.contains(&t.id())).map(|(n, _)| n.as_str()).collect();
        if !stuck.is_empty() {
            return Err(ExecError::Invalid {
                op,
                detail: format!(
                    "the module lists tensors it does not give mutably: {}; implement Module::own_tensors_mut \
                     and Module::children_mut for the modules that hold them (#[derive(Module)] does)",
                    stuck.join(", ")
                ),
            });
        }
        self.materialize()?;
        let mut moved: std::collections::HashMap<u64, Tensor> = std::collections::HashMap::new();
        walk_tensors_mut(self, &mut |t| {
            if t.device().same(device) {
                return Ok(());
            }
            let new = match moved.get(&t.id()) {
                Some(m) => m.clone(),
                None => {
                    let m = no_grad(|| t.detach().to_device(device))?;
                    if t.requires_grad() {
                        m.requires_grad_(true)?;
                    }
                    if let Some(g) = t.grad() {
                        m.set_grad(Some(no_grad(|| g.to_device(device))?))?;
                    }
                    moved.insert(t.id(), m.clone());
                    m
                }
            };
            *t = new;
            Ok(())
        })
    }

    /// [`ModuleExt::load_state_dict`] from tensors in memory instead of a
    /// file: another model's [`ModuleExt::state_dict`] (on any device) or
    /// any named tensors. The same checks (every entry present with its
    /// shape, nothing extra; float dtypes convert); each value is copied
    /// into this module's tensor on its device, which keeps its identity.
    fn load_state_dict_from(&self, state: &[(String, Tensor)]) -> Result<()> {
        Ok(crate::serialize::load_tensors_into_with(state, &self.state_dict(), &LoadOptions::strict()).map(|_| ())?)
    }

    /// [`ModuleExt::load_state_dict_from`] with options (non-strict keys,
    /// renaming), as [`ModuleExt::load_state_dict_with`].
    fn load_state_dict_from_with(&self, state: &[(String, Tensor)], options: &LoadOptions<'_>) -> Result<LoadReport> {
        Ok(crate::serialize::load_tensors_into_with(state, &self.state_dict(), options)?)
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

/// Calls `f` on every tensor of the tree, mutably, own tensors first.
fn walk_tensors_mut<M: Module + ?Sized>(m: &mut M, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
    for t in m.own_tensors_mut() {
        f(t)?;
    }
    for child in m.children_mut() {
        walk_tensors_mut(child, f)?;
    }
    Ok(())
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

/// A misuse of a layer or loss, named `op`, at the caller's line (the
/// public functions and `Module::forward` are `#[track_caller]`, so it is
/// the program's).
#[track_caller]
fn invalid(op: &str, detail: String) -> ExecError {
    invalid_at(op, detail, std::panic::Location::caller())
}

/// [`invalid`] at a location the caller took (or at the entered
/// [`CallSite`](crate::CallSite), the program's call into the layer).
fn invalid_at(op: &str, detail: String, at: &std::panic::Location<'_>) -> ExecError {
    let (file, line) = match crate::CallSite::current() {
        Some(site) => (site.file(), site.line()),
        None => (at.file(), at.line()),
    };
    ExecError::Invalid { op: format!("{op} at {file}:{line}"), detail }
}
