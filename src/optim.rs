//! Optimizers: [`Sgd`] (momentum, Nesterov, weight decay), [`Adam`] and
//! AdamW ([`AdamW::new`], [`Adam::adamw`]), each over parameter groups with their own
//! weight decay and learning rate ([`ParamGroup`]; [`decay_groups`] exempts
//! biases, norms and embeddings as GPT-style training does), and
//! learning-rate schedulers with PyTorch's names ([`lr_scheduler`]).
//!
//! `step()` reads each parameter's lazy gradient, records the update under
//! [`no_grad`] and installs it with [`Tensor::assign`]: nothing runs until
//! the next sync (normally `Device::mark_step`), where forward, backward
//! and update are one graph. Hyperparameters (learning rate, betas, bias
//! corrections) enter the graph as lifted scalars, one per group where
//! groups differ, so changing a learning rate (by hand or by a scheduler)
//! or advancing Adam's step count compiles nothing new. Every step has
//! the same graph hash from the first on: an optimizer materializes its
//! parameters when it is made (a model's lazily initialized weights would
//! otherwise be computed inside the first step's graph), and a step gives
//! each parameter that has no state yet buffers of zeros, materialized by
//! one sync of their own, before it records its update.
//! From zeros, the first update is exactly PyTorch's (its moments start at
//! zero; SGD's `buf = mu * 0 + g` is its `buf = g`), except for SGD with
//! dampening, whose first step keeps its own graph.
//!
//! **A step marks itself.** PyTorch has no `mark_step`, so a training loop
//! written from its habits calls none, and without a sync point the
//! pending graph would grow across iterations until the graph size limit
//! cut it, compiling a new graph at every cut (hundreds of times slower).
//! So `step()` ([`Sgd`], [`Adam`]) ends the training step itself, with
//! [`Device::auto_mark_step`] on each of its parameters' devices, where
//! the program does not: from its second step on, when the program called
//! no [`Device::mark_step`] on that device since the optimizer's previous
//! step. A program that marks its own steps is never marked for (its
//! graphs, compiles and RNG streams are exactly what they were; the first
//! step, where the optimizer cannot know yet, is never marked), and a
//! program that does not gets one sync per step, whose graph is the
//! whole iteration (forward, backward, update) from the third step on
//! (the second holds the first's update too). `auto_mark_step(false)`
//! ([`Sgd::auto_mark_step`], [`Adam::auto_mark_step`]) turns it off.
//! Work recorded after `step()` (an EMA of the weights, a read of the
//! loss) joins the next step's graph, or is synced by its own read.
//!
//! Each optimizer's state (SGD's momentum buffers, Adam's moments and step
//! count) saves to and loads from safetensors by PyTorch's names with the
//! parameter's index (`state_dict`, `save_state_dict`, `load_state_dict`),
//! so a run resumed from a model checkpoint and an optimizer checkpoint
//! continues as the uninterrupted run would.

use crate::nn::{Module, ModuleExt};
use crate::serialize::{self, SerializeError};
use crate::{no_grad, DType, Device, DeviceExt, ExecError, Result, ScalarValue, Tensor};
use std::collections::HashMap;
use std::panic::Location;
use std::path::Path;

pub mod lr_scheduler;
pub use lr_scheduler::{Anneal, CosineAnnealingLR, LinearLR, LrScheduler, OneCycleLR, Schedule, SequentialLR, StepLR};

/// Parameters that share a weight decay and a learning rate. Groups let
/// one optimizer decay weight matrices but not biases, norm scales or
/// embeddings, or train a pretrained body slower than a new head.
#[derive(Clone, Debug)]
pub struct ParamGroup {
    /// The parameters.
    pub params: Vec<Tensor>,
    /// Their weight decay; `None` uses the optimizer's
    /// (`Adam::weight_decay`, `Sgd::weight_decay`).
    pub weight_decay: Option<f64>,
    /// Their learning rate; `None` uses the optimizer's ([`Optimizer::lr`]).
    pub lr: Option<f64>,
}

impl ParamGroup {
    /// A group with its own weight decay.
    pub fn new(params: Vec<Tensor>, weight_decay: f64) -> ParamGroup {
        ParamGroup { params, weight_decay: Some(weight_decay), lr: None }
    }

    /// A group with the optimizer's weight decay and learning rate.
    pub fn plain(params: Vec<Tensor>) -> ParamGroup {
        ParamGroup { params, weight_decay: None, lr: None }
    }

    /// Gives the group its own learning rate, as PyTorch's
    /// `{"params": ..., "lr": ...}`.
    pub fn with_lr(mut self, lr: f64) -> ParamGroup {
        self.lr = Some(lr);
        self
    }
}

/// Two groups over `module`'s parameters: those named by
/// [`ModuleExt::no_weight_decay`] (biases, norm scales and shifts,
/// embeddings) and every other parameter of rank 0 or 1 get no weight
/// decay; the rest get `weight_decay`. Empty groups are left out.
pub fn decay_groups<M: Module + ?Sized>(module: &M, weight_decay: f64) -> Vec<ParamGroup> {
    let exempt = module.no_weight_decay();
    let (mut decay, mut none) = (Vec::new(), Vec::new());
    for (name, t) in module.named_parameters() {
        if t.rank() <= 1 || exempt.contains(&name) {
            none.push(t);
        } else {
            decay.push(t);
        }
    }
    [ParamGroup::new(decay, weight_decay), ParamGroup::new(none, 0.0)]
        .into_iter()
        .filter(|g| !g.params.is_empty())
        .collect()
}

/// Flattened groups: the parameters, for each its group's index and the
/// group's own weight decay, and each group's own learning rate.
struct Flat {
    params: Vec<Tensor>,
    group: Vec<usize>,
    group_wd: Vec<Option<f64>>,
    group_lr: Vec<Option<f64>>,
}

fn flatten_groups(groups: Vec<ParamGroup>) -> Flat {
    let mut f = Flat { params: Vec::new(), group: Vec::new(), group_wd: Vec::new(), group_lr: Vec::new() };
    for (i, g) in groups.into_iter().enumerate() {
        f.group_lr.push(g.lr);
        for p in g.params {
            f.params.push(p);
            f.group.push(i);
            f.group_wd.push(g.weight_decay);
        }
    }
    f
}

/// Materializes `params` where they are pending (a model's weights are
/// initialized lazily), as one graph per device, without waiting, so that
/// the first step's graph reads them as every later step does. A failure
/// is not lost: the tensors stay as they were, and the next sync that
/// needs them (the first step's) reports it.
fn materialize(params: &[Tensor]) {
    let pending: Vec<&Tensor> = params.iter().filter(|p| p.state() == crate::TensorState::PendingIr).collect();
    let _ = sync_by_device(&pending);
}

/// Syncs `tensors` as one graph per device.
fn sync_by_device(tensors: &[&Tensor]) -> Result<()> {
    let mut by_device: Vec<Vec<&Tensor>> = Vec::new();
    for &t in tensors {
        match by_device.iter_mut().find(|ts| ts[0].device().same(t.device())) {
            Some(ts) => ts.push(t),
            None => by_device.push(vec![t]),
        }
    }
    by_device.iter().try_for_each(|ts| crate::sync(ts))
}

/// Gives each parameter that has a gradient and no buffer yet in `states`
/// a buffer of zeros in each, all materialized by one sync per device
/// before the step records its update: a zeros tensor left lazy would be
/// a constant folded into the step's graph, which would then differ from
/// every later step's (that reads the buffers).
fn fresh_state(params: &[Tensor], states: &mut [&mut Buffers]) -> Result<()> {
    let mut made: Vec<Tensor> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        if states.iter().all(|s| s[i].is_some()) || p.grad().is_none() {
            continue;
        }
        for s in states.iter_mut().filter(|s| s[i].is_none()) {
            let z = Tensor::zeros(p.shape().clone(), p.dtype(), p.device())?;
            made.push(z.clone());
            s[i] = Some(z);
        }
    }
    sync_by_device(&made.iter().collect::<Vec<_>>())
}

/// The learning rate of each group: its own, else the optimizer's.
fn effective_lrs(group_lr: &[Option<f64>], lr: f64) -> Vec<f64> {
    group_lr.iter().map(|g| g.unwrap_or(lr)).collect()
}

/// Gives group `group` of `group_lr` its own learning rate, or names the
/// group that does not exist.
fn set_group_lr(op: &str, group_lr: &mut [Option<f64>], group: usize, lr: f64) -> Result<()> {
    let n = group_lr.len();
    let slot = group_lr.get_mut(group).ok_or_else(|| ExecError::Invalid {
        op: op.into(),
        detail: format!("parameter group {group} does not exist (the optimizer has {n})"),
    })?;
    *slot = Some(lr);
    Ok(())
}

/// What every optimizer offers.
pub trait Optimizer {
    /// Records one update of every parameter that has a gradient. [`Sgd`]
    /// and [`Adam`] then mark the step on the parameters' devices unless
    /// the program marks steps itself (see the module documentation).
    #[track_caller]
    fn step(&mut self) -> Result<()>;

    /// Drops the gradients of all parameters.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// The parameters being optimized.
    fn parameters(&self) -> &[Tensor];

    /// The learning rate of every group without its own.
    fn lr(&self) -> f64;

    /// Changes the learning rate of every group without its own (compiles
    /// nothing new).
    fn set_lr(&mut self, lr: f64);

    /// Each parameter group's learning rate: its own, else [`Optimizer::lr`].
    fn group_lrs(&self) -> Vec<f64>;

    /// Gives parameter group `group` its own learning rate (compiles
    /// nothing new); a group index past the last group is an error.
    fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()>;

    /// The optimizer's state by name, what its `save_state_dict` writes
    /// (moments, momentum buffers and step counts by PyTorch's names with
    /// the parameter's index); what a [`crate::checkpoint::Checkpoint`]
    /// saves.
    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>>;

    /// Replaces the state with `state`, named as
    /// [`Optimizer::state_tensors`] names it and read from `source` (named
    /// in errors), for an optimizer over parameters of the same types in
    /// the same order; on an error nothing changes.
    fn load_state_tensors(&mut self, state: HashMap<String, Tensor>, source: &Path) -> Result<()>;

    /// Records one update ([`Optimizer::step`]) that takes effect only
    /// where `skip` (a bool rank-0 tensor, lazy) is false: every parameter
    /// that has a gradient gets `where(skip, old, new)`, decided on the
    /// device with no read of `skip` (what [`crate::amp::GradScaler`]
    /// uses to drop a step with inf/nan gradients). This default keeps
    /// the parameters; an optimizer with state tensors overrides it to
    /// keep those too ([`Sgd`] and [`Adam`] do). Host-side counters are
    /// not device data and still advance (Adam's step count, so the bias
    /// correction of the steps after a skipped one differs from
    /// PyTorch's, whose `GradScaler` reads the flag on the host).
    #[track_caller]
    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        let old = kept_params(self.parameters());
        self.step()?;
        keep_params_if(skip, &old)
    }
}

/// Each parameter that has a gradient, and its value before a step.
fn kept_params(params: &[Tensor]) -> Vec<(Tensor, Tensor)> {
    params.iter().filter(|p| p.grad().is_some()).map(|p| (p.clone(), p.detach())).collect()
}

/// After a step: each parameter of `old` back to its old value where `skip`.
fn keep_params_if(skip: &Tensor, old: &[(Tensor, Tensor)]) -> Result<()> {
    no_grad(|| {
        for (p, before) in old {
            p.assign(&skip.where_(before, &p.detach())?)?;
        }
        Ok(())
    })
}

/// After a step: each state buffer back to its old value where `skip`; a
/// buffer the step created (first step) becomes zeros there, the state
/// from which a step with a zero buffer continues as from none (exactly so
/// for Adam's moments; for SGD's momentum without dampening too).
fn keep_state_if(skip: &Tensor, old: &[Option<Tensor>], new: &mut [Option<Tensor>]) -> Result<()> {
    no_grad(|| {
        for (o, n) in old.iter().zip(new.iter_mut()) {
            let Some(fresh) = n.take() else { continue };
            let before = match o {
                Some(b) => b.clone(),
                None => Tensor::zeros(fresh.shape().clone(), fresh.dtype(), fresh.device())?,
            };
            *n = Some(skip.where_(&before, &fresh)?);
        }
        Ok(())
    })
}

/// Rank-0 lifted scalars (never baked into kernels), one per role, group,
/// dtype and device within one `step()`, so all parameters share their
/// slots. Keyed by role (and the parameter group, for per-group values),
/// not value: two roles that happen to have equal values still get two
/// slots, so the graph never depends on the values.
#[derive(Default)]
struct Scalars(Vec<((&'static str, usize), DType, Tensor)>);

impl Scalars {
    fn get(&mut self, role: &'static str, v: f64, like: &Tensor) -> Tensor {
        self.get_in(role, 0, v, like)
    }

    fn get_in(&mut self, role: &'static str, group: usize, v: f64, like: &Tensor) -> Tensor {
        let key = (role, group);
        let found = self.0.iter().find(|(r, d, t)| *r == key && *d == like.dtype() && t.device().same(like.device()));
        if let Some((_, _, t)) = found {
            return t.clone();
        }
        let t = Tensor::lifted_scalar(ScalarValue::Float(v), like.dtype(), like.device());
        self.0.push((key, like.dtype(), t.clone()));
        t
    }
}

/// Stochastic gradient descent, as PyTorch's `torch.optim.SGD`:
/// `g += wd * p; buf = mu * buf + (1 - dampening) * g` (the first step
/// sets `buf = g`: without dampening, from a buffer of zeros, see the
/// module documentation); `g = nesterov ? g + mu * buf : buf`;
/// `p -= lr * g`.
#[derive(Clone, Debug)]
pub struct Sgd {
    params: Vec<Tensor>,
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum's gradient term.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    bufs: Vec<Option<Tensor>>,
    group: Vec<usize>,
    group_wd: Vec<Option<f64>>,
    group_lr: Vec<Option<f64>>,
    marks: StepMarks,
}

impl Sgd {
    /// Plain SGD over `params` with learning rate `lr`.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Sgd {
        Sgd::with_groups(vec![ParamGroup::plain(params)], lr)
    }

    /// Plain SGD over parameter groups (each with its own weight decay and
    /// learning rate, or [`Sgd::weight_decay`]'s and `lr`).
    pub fn with_groups(groups: Vec<ParamGroup>, lr: f64) -> Sgd {
        let Flat { params, group, group_wd, group_lr } = flatten_groups(groups);
        materialize(&params);
        let n = params.len();
        Sgd {
            params,
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            bufs: vec![None; n],
            group,
            group_wd,
            group_lr,
            marks: StepMarks::default(),
        }
    }

    /// Whether [`Optimizer::step`] marks the step when the program does
    /// not (on by default; see the module documentation). Off, a program
    /// that never calls `Device::mark_step` grows one graph across its
    /// steps, and the engine warns.
    pub fn auto_mark_step(mut self, on: bool) -> Sgd {
        self.marks.on = on;
        self
    }

    /// Sets the momentum factor.
    pub fn momentum(mut self, momentum: f64) -> Sgd {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening of the momentum's gradient term.
    pub fn dampening(mut self, dampening: f64) -> Sgd {
        self.dampening = dampening;
        self
    }

    /// Enables Nesterov momentum.
    pub fn nesterov(mut self, nesterov: bool) -> Sgd {
        self.nesterov = nesterov;
        self
    }

    /// Sets the L2 weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Sgd {
        self.weight_decay = weight_decay;
        self
    }

    /// The momentum buffers by parameter index (`"momentum_buffer.3"`,
    /// PyTorch's name), one for each parameter that has one; the
    /// hyperparameters are the caller's (they are settings, not state).
    pub fn state_dict(&self) -> Vec<(String, Tensor)> {
        indexed("momentum_buffer", &self.bufs)
    }

    /// Writes [`Sgd::state_dict`] to `path` as safetensors (a barrier).
    pub fn save_state_dict(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(serialize::save(path, &self.state_dict())?)
    }

    /// Replaces the momentum buffers with those of a file written by
    /// [`Sgd::save_state_dict`] for an optimizer over parameters of the
    /// same types in the same order. The file may hold nothing else, and
    /// each buffer must have its parameter's shape and dtype; on an error
    /// nothing changes. A parameter without a buffer in the file starts
    /// its momentum afresh at its next gradient.
    pub fn load_state_dict(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let state = serialize::load(path, &state_device(&self.params))?;
        self.load_state_tensors(state, path)
    }
}

impl Sgd {
    /// Zero momentum buffers for the parameters about to take their
    /// first step (see `fresh_state`); none without momentum, and none
    /// with dampening, whose first step sets the buffer to the
    /// undampened gradient.
    fn fresh_state(&mut self) -> Result<()> {
        if self.momentum != 0.0 && self.dampening == 0.0 {
            fresh_state(&self.params, &mut [&mut self.bufs])?;
        }
        Ok(())
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _site = crate::CallSite::enter(Location::caller());
        self.record_step()?;
        self.marks.after_step(&self.params, "Sgd::step")
    }

    fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn group_lrs(&self) -> Vec<f64> {
        effective_lrs(&self.group_lr, self.lr)
    }

    fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        set_group_lr("Sgd::set_group_lr", &mut self.group_lr, group, lr)
    }

    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        let _site = crate::CallSite::enter(Location::caller());
        // The zeros first, so that a skipped first step keeps them and
        // its graph is every later step's.
        self.fresh_state()?;
        let (old, bufs) = (kept_params(&self.params), self.bufs.clone());
        self.record_step()?;
        keep_params_if(skip, &old)?;
        keep_state_if(skip, &bufs, &mut self.bufs)?;
        self.marks.after_step(&self.params, "Sgd::step_unless")
    }

    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.state_dict())
    }

    fn load_state_tensors(&mut self, state: HashMap<String, Tensor>, source: &Path) -> Result<()> {
        let (mut bufs, _) = load_state(source, state, &self.params, &["momentum_buffer"], &[])?;
        self.bufs = bufs.remove(0);
        Ok(())
    }
}

impl Sgd {
    /// One update of every parameter that has a gradient, recorded.
    fn record_step(&mut self) -> Result<()> {
        let _guard = crate::NoGradGuard::new();
        self.fresh_state()?;
        let mut sc = Scalars::default();
        for (i, (p, buf)) in self.params.iter().zip(self.bufs.iter_mut()).enumerate() {
            let Some(mut g) = p.grad() else { continue };
            let wd = self.group_wd[i].unwrap_or(self.weight_decay);
            if wd != 0.0 {
                g = g.add(&p.mul(&sc.get_in("wd", self.group[i], wd, p))?)?;
            }
            if self.momentum != 0.0 {
                let mu = sc.get("mu", self.momentum, p);
                let b = match buf.take() {
                    None => g.detach(),
                    Some(b) => {
                        let gd = if self.dampening != 0.0 {
                            g.mul(&sc.get("1-dampening", 1.0 - self.dampening, p))?
                        } else {
                            g.clone()
                        };
                        b.mul(&mu)?.add(&gd)?
                    }
                };
                g = if self.nesterov { g.add(&b.mul(&mu)?)? } else { b.clone() };
                *buf = Some(b);
            }
            let lr = self.group_lr[self.group[i]].unwrap_or(self.lr);
            p.assign(&p.sub(&g.mul(&sc.get_in("lr", self.group[i], lr, p))?)?)?;
        }
        Ok(())
    }
}

/// Adam (Kingma & Ba), and AdamW with decoupled weight decay (Loshchilov &
/// Hutter), as PyTorch's `torch.optim.Adam` / `AdamW`.
#[derive(Clone, Debug)]
pub struct Adam {
    params: Vec<Tensor>,
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: an L2 term in the gradient (Adam) or a decoupled
    /// shrink of the parameter (AdamW).
    pub weight_decay: f64,
    /// Decoupled weight decay (AdamW).
    pub decoupled: bool,
    t: u64,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
    group: Vec<usize>,
    group_wd: Vec<Option<f64>>,
    group_lr: Vec<Option<f64>>,
    marks: StepMarks,
}

impl Adam {
    /// Adam with betas (0.9, 0.999), eps 1e-8, no weight decay.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Adam {
        Adam::with_groups(vec![ParamGroup::plain(params)], lr)
    }

    /// Adam over parameter groups, each with its own (L2) weight decay and
    /// learning rate, or [`Adam::weight_decay`]'s and `lr`.
    pub fn with_groups(groups: Vec<ParamGroup>, lr: f64) -> Adam {
        let Flat { params, group, group_wd, group_lr } = flatten_groups(groups);
        materialize(&params);
        let n = params.len();
        Adam {
            params,
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            t: 0,
            m: vec![None; n],
            v: vec![None; n],
            group,
            group_wd,
            group_lr,
            marks: StepMarks::default(),
        }
    }

    /// Whether [`Optimizer::step`] marks the step when the program does
    /// not (on by default), as [`Sgd::auto_mark_step`].
    pub fn auto_mark_step(mut self, on: bool) -> Adam {
        self.marks.on = on;
        self
    }

    /// AdamW with betas (0.9, 0.999), eps 1e-8 and decoupled weight decay.
    pub fn adamw(params: Vec<Tensor>, lr: f64, weight_decay: f64) -> Adam {
        Adam { weight_decay, decoupled: true, ..Adam::new(params, lr) }
    }

    /// AdamW over parameter groups, each with its own decoupled weight
    /// decay: `Adam::adamw_groups(optim::decay_groups(&model, 0.1), lr)`
    /// decays weight matrices only.
    pub fn adamw_groups(groups: Vec<ParamGroup>, lr: f64) -> Adam {
        Adam { decoupled: true, ..Adam::with_groups(groups, lr) }
    }

    /// Sets the betas.
    pub fn betas(mut self, b1: f64, b2: f64) -> Adam {
        self.betas = (b1, b2);
        self
    }

    /// Sets eps.
    pub fn eps(mut self, eps: f64) -> Adam {
        self.eps = eps;
        self
    }

    /// Sets the (L2, or decoupled for AdamW) weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Adam {
        self.weight_decay = weight_decay;
        self
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// The state by PyTorch's names: the step count (`"step"`, a rank-0
    /// i64 tensor) and, for each parameter that has taken a step, the
    /// moment estimates by parameter index (`"exp_avg.3"`,
    /// `"exp_avg_sq.3"`). The hyperparameters are the caller's.
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let step = i64::try_from(self.t).map_err(|_| ExecError::Invalid {
            op: "Adam::state_dict".into(),
            detail: format!("step count {} exceeds i64", self.t),
        })?;
        let dev = self.params.first().map_or_else(Device::cpu, |p| p.device().clone());
        // Host data: an i64 scalar node would not compile on wgpu.
        let mut v = vec![("step".to_string(), Tensor::from_slice(&[step], [], &dev)?)];
        v.extend(indexed("exp_avg", &self.m));
        v.extend(indexed("exp_avg_sq", &self.v));
        Ok(v)
    }

    /// Writes [`Adam::state_dict`] to `path` as safetensors (a barrier).
    pub fn save_state_dict(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(serialize::save(path, &self.state_dict()?)?)
    }

    /// Replaces the step count and moments with those of a file written
    /// by [`Adam::save_state_dict`] for an optimizer over parameters of
    /// the same types in the same order. The file must hold `"step"`, may
    /// hold nothing but it and moments, each with its parameter's shape
    /// and dtype, and holds both moments of a parameter or neither; on an
    /// error nothing changes.
    pub fn load_state_dict(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let state = serialize::load(path, &state_device(&self.params))?;
        self.load_state_tensors(state, path)
    }
}

impl Adam {
    /// [`Optimizer::load_state_tensors`] for Adam (see [`Adam::load_state_dict`]).
    fn load_adam_state(&mut self, state: HashMap<String, Tensor>, path: &Path) -> Result<()> {
        let (mut moments, scalars) = load_state(path, state, &self.params, &["exp_avg", "exp_avg_sq"], &["step"])?;
        let (m, v) = (moments.remove(0), moments.remove(0));
        if let Some(i) = (0..m.len()).find(|&i| m[i].is_some() != v[i].is_some()) {
            let name = if m[i].is_some() { format!("exp_avg_sq.{i}") } else { format!("exp_avg.{i}") };
            return Err(
                mismatch(path, &name, "not in the file, but the other moment of its parameter is".into()).into()
            );
        }
        let step = scalars[0].item::<i64>()?;
        self.t = u64::try_from(step).map_err(|_| mismatch(path, "step", format!("a negative step count, {step}")))?;
        self.m = m;
        self.v = v;
        Ok(())
    }
}

impl Optimizer for Adam {
    fn step(&mut self) -> Result<()> {
        let _site = crate::CallSite::enter(Location::caller());
        self.record_step()?;
        self.marks.after_step(&self.params, if self.decoupled { "AdamW::step" } else { "Adam::step" })
    }

    fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn group_lrs(&self) -> Vec<f64> {
        effective_lrs(&self.group_lr, self.lr)
    }

    fn set_group_lr(&mut self, group: usize, lr: f64) -> Result<()> {
        set_group_lr("Adam::set_group_lr", &mut self.group_lr, group, lr)
    }

    fn step_unless(&mut self, skip: &Tensor) -> Result<()> {
        let _site = crate::CallSite::enter(Location::caller());
        // The zeros first (see `Sgd::step_unless`).
        fresh_state(&self.params, &mut [&mut self.m, &mut self.v])?;
        let (old, m, v) = (kept_params(&self.params), self.m.clone(), self.v.clone());
        self.record_step()?;
        keep_params_if(skip, &old)?;
        keep_state_if(skip, &m, &mut self.m)?;
        keep_state_if(skip, &v, &mut self.v)?;
        self.marks.after_step(&self.params, if self.decoupled { "AdamW::step_unless" } else { "Adam::step_unless" })
    }

    fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.state_dict()
    }

    fn load_state_tensors(&mut self, state: HashMap<String, Tensor>, source: &Path) -> Result<()> {
        self.load_adam_state(state, source)
    }
}

impl Adam {
    /// One update of every parameter that has a gradient, recorded.
    fn record_step(&mut self) -> Result<()> {
        let _guard = crate::NoGradGuard::new();
        fresh_state(&self.params, &mut [&mut self.m, &mut self.v])?;
        let mut sc = Scalars::default();
        self.t += 1;
        let (b1, b2) = self.betas;
        let c1 = 1.0 - b1.powi(self.t.min(i32::MAX as u64) as i32);
        let c2 = 1.0 - b2.powi(self.t.min(i32::MAX as u64) as i32);
        for (i, ((p, m), v)) in self.params.iter().zip(self.m.iter_mut()).zip(self.v.iter_mut()).enumerate() {
            let Some(mut g) = p.grad() else { continue };
            let mut base = p.clone();
            let wd = self.group_wd[i].unwrap_or(self.weight_decay);
            let lr = self.group_lr[self.group[i]].unwrap_or(self.lr);
            if wd != 0.0 {
                if self.decoupled {
                    base = p.mul(&sc.get_in("1-lr*wd", self.group[i], 1.0 - lr * wd, p))?;
                } else {
                    g = g.add(&p.mul(&sc.get_in("wd", self.group[i], wd, p))?)?;
                }
            }
            let g1 = g.mul(&sc.get("1-b1", 1.0 - b1, p))?;
            let g2 = g.mul(&g)?.mul(&sc.get("1-b2", 1.0 - b2, p))?;
            let nm = match m.take() {
                None => g1,
                Some(old) => old.mul(&sc.get("b1", b1, p))?.add(&g1)?,
            };
            let nv = match v.take() {
                None => g2,
                Some(old) => old.mul(&sc.get("b2", b2, p))?.add(&g2)?,
            };
            // PyTorch's m / (sqrt(v) / sqrt(c2) + eps) * lr / c1, with sqrt(c2)
            // moved into the scalars: m / (sqrt(v) + eps sqrt(c2)) *
            // (lr sqrt(c2) / c1), one recorded op fewer per parameter.
            let denom = nv.sqrt()?.add(&sc.get("eps*sqrt(c2)", self.eps * c2.sqrt(), p))?;
            let update = nm.div(&denom)?.mul(&sc.get_in("lr*sqrt(c2)/c1", self.group[i], lr * c2.sqrt() / c1, p))?;
            p.assign(&base.sub(&update)?)?;
            *m = Some(nm);
            *v = Some(nv);
        }
        Ok(())
    }
}

/// AdamW under its own name (PyTorch's `torch.optim.AdamW`, and what
/// rustdoc's search finds): constructors of an [`Adam`] with decoupled
/// weight decay. `AdamW::new(params, 1e-3)` has PyTorch's default weight
/// decay, 0.01.
#[derive(Clone, Copy, Debug)]
pub struct AdamW;

impl AdamW {
    /// PyTorch's default weight decay of AdamW.
    pub const DEFAULT_WEIGHT_DECAY: f64 = 0.01;

    /// AdamW over `params` with learning rate `lr`, betas (0.9, 0.999),
    /// eps 1e-8 and weight decay 0.01 (PyTorch's defaults); the builder
    /// methods of [`Adam`] change them.
    #[allow(clippy::new_ret_no_self)] // A constructor namespace: AdamW is an `Adam`.
    pub fn new(params: Vec<Tensor>, lr: f64) -> Adam {
        Adam::adamw(params, lr, AdamW::DEFAULT_WEIGHT_DECAY)
    }

    /// AdamW over parameter groups, each with its own decoupled weight
    /// decay ([`Adam::adamw_groups`]).
    pub fn with_groups(groups: Vec<ParamGroup>, lr: f64) -> Adam {
        Adam::adamw_groups(groups, lr)
    }
}

/// Marks the step at the end of an optimizer's `step()` where the program
/// marks none itself (see the module documentation): from the second
/// step on, on each device of the parameters whose program marks did not
/// change since the previous step.
#[derive(Clone, Debug)]
struct StepMarks {
    on: bool,
    /// Each device's [`Device::program_marks`] at the previous step.
    last: Option<Vec<(Device, u64)>>,
}

impl Default for StepMarks {
    fn default() -> StepMarks {
        StepMarks { on: true, last: None }
    }
}

impl StepMarks {
    #[track_caller]
    fn after_step(&mut self, params: &[Tensor], what: &str) -> Result<()> {
        let mut now: Vec<(Device, u64)> = Vec::new();
        for p in params {
            if !now.iter().any(|(d, _)| d.same(p.device())) {
                now.push((p.device().clone(), p.device().program_marks()));
            }
        }
        let previous = self.last.replace(now);
        let (Some(previous), true) = (previous, self.on) else { return Ok(()) };
        for (device, marks) in self.last.iter().flatten() {
            if previous.iter().any(|(d, m)| d.same(device) && m == marks) {
                device.auto_mark_step(what)?;
            }
        }
        Ok(())
    }
}

/// `(format!("{kind}.{i}"), buffer)` for every parameter index `i` that
/// has a buffer.
fn indexed(kind: &str, bufs: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    bufs.iter().enumerate().filter_map(|(i, b)| b.as_ref().map(|b| (format!("{kind}.{i}"), b.clone()))).collect()
}

fn mismatch(path: &Path, name: &str, detail: String) -> SerializeError {
    SerializeError::Mismatch { path: path.display().to_string(), name: name.into(), detail }
}

/// The device an optimizer's state loads onto: its parameters' (the CPU
/// for an optimizer without parameters).
fn state_device(params: &[Tensor]) -> Device {
    params.first().map_or_else(Device::cpu, |p| p.device().clone())
}

/// One optional state tensor per parameter.
type Buffers = Vec<Option<Tensor>>;

/// Reads an optimizer's state from `state` (loaded from `path`): for each of `kinds`, one
/// optional buffer per parameter (named `"{kind}.{i}"`, with parameter
/// `i`'s type, on its device), and each of `scalars` (rank 0, i64,
/// required). Anything else in the file is an error, found before the
/// caller changes anything.
fn load_state(
    path: &Path,
    state: HashMap<String, Tensor>,
    params: &[Tensor],
    kinds: &[&str],
    scalars: &[&str],
) -> std::result::Result<(Vec<Buffers>, Vec<Tensor>), SerializeError> {
    let mut bufs = vec![vec![None; params.len()]; kinds.len()];
    let mut found = vec![None; scalars.len()];
    let mut names: Vec<(String, Tensor)> = state.into_iter().collect();
    names.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in names {
        if let Some(j) = scalars.iter().position(|s| *s == name) {
            if t.rank() != 0 || t.dtype() != DType::I64 {
                return Err(mismatch(path, &name, format!("stored as {}{}, expected i64[]", t.dtype(), t.shape())));
            }
            found[j] = Some(t);
            continue;
        }
        let slot = name.rsplit_once('.').and_then(|(kind, i)| {
            let k = kinds.iter().position(|k| *k == kind)?;
            let i = i.parse::<usize>().ok().filter(|&i| i < params.len())?;
            Some((k, i))
        });
        let Some((k, i)) = slot else {
            let detail = format!(
                "not optimizer state for {} parameter(s) (expected {} with a parameter index, or {scalars:?})",
                params.len(),
                kinds.join(" or ")
            );
            return Err(mismatch(path, &name, detail));
        };
        let p = &params[i];
        if t.ty() != p.ty() {
            let detail =
                format!("stored as {}{}, but parameter {i} is {}{}", t.dtype(), t.shape(), p.dtype(), p.shape());
            return Err(mismatch(path, &name, detail));
        }
        let t = if p.device().same(t.device()) {
            t
        } else {
            Tensor::from_bytes(t.to_bytes()?, t.ty().clone(), p.device())?
        };
        bufs[k][i] = Some(t);
    }
    let scalars = scalars
        .iter()
        .zip(found)
        .map(|(s, t)| t.ok_or_else(|| mismatch(path, s, "not in the file".into())))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((bufs, scalars))
}

/// Scales the gradients of `params` so that their joint L2 norm is at most
/// `max_norm` (lazily, without reading them); returns the norm before
/// clipping as a lazy f32 scalar.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<Option<Tensor>> {
    no_grad(|| {
        let grads: Vec<(Tensor, Tensor)> = params.iter().filter_map(|p| p.grad().map(|g| (p.clone(), g))).collect();
        let Some((first, _)) = grads.first() else { return Ok(None) };
        let dev = first.device().clone();
        let mut total: Option<Tensor> = None;
        for (_, g) in &grads {
            let s = g.cast(DType::F32)?.mul(&g.cast(DType::F32)?)?.sum(&[], false)?;
            total = Some(match total {
                None => s,
                Some(t) => t.add(&s)?,
            });
        }
        let norm = total.expect("at least one gradient").sqrt()?;
        let max = Tensor::lifted_scalar(ScalarValue::Float(max_norm), DType::F32, &dev);
        let eps = Tensor::lifted_scalar(ScalarValue::Float(1e-6), DType::F32, &dev);
        let scale = max.div(&norm.add(&eps)?)?.minimum(&Tensor::scalar(1, DType::F32, &dev))?;
        for (p, g) in &grads {
            p.set_grad(Some(g.mul(&scale.cast(g.dtype())?)?))?;
        }
        Ok(Some(norm))
    })
}
