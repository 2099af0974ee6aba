//! Learning-rate schedulers with PyTorch's names and semantics
//! (`torch.optim.lr_scheduler`): [`StepLR`], [`CosineAnnealingLR`],
//! [`LinearLR`], [`OneCycleLR`] and [`SequentialLR`] (with
//! [`SequentialLR::warmup_cosine`], the GPT recipe), each a [`Schedule`]:
//! a pure function from a group's base learning rate and the step count to
//! the group's learning rate. An [`LrScheduler`] drives one over an
//! optimizer: made after the optimizer, it records every group's learning
//! rate as that group's base and sets step 0's rates; `step` after each
//! optimizer step sets the next ones. The rates enter the traced step as
//! lifted scalars, so a scheduled loop compiles nothing new.
//!
//! Where this differs from PyTorch, on purpose: every rate comes from its
//! closed form (PyTorch's `_get_closed_form_lr`), not from the recursive
//! update of the previous rate, so rates agree with PyTorch's up to
//! rounding and a resumed run computes the very same bits; schedulers do
//! not chain multiplicatively (no `ChainedScheduler`); `OneCycleLR` does
//! not cycle momentum (PyTorch's `cycle_momentum=False`); settings PyTorch
//! would divide by zero on (`LinearLR` with `total_iters` 0, `StepLR` with
//! `step_size` 0, `CosineAnnealingLR` with `t_max` 0) are errors, and a
//! `OneCycleLR` phase of no steps ends at its final rate. The scheduler's
//! state (step count and base rates) saves to safetensors like the
//! optimizers' (`state_dict`, `save_state_dict`, `load_state_dict`).

use super::{mismatch, Optimizer};
use crate::serialize;
use crate::{DType, Device, DeviceExt, ExecError, Result, Tensor};
use std::collections::HashMap;
use std::fmt::Debug;
use std::path::Path;

/// A learning-rate schedule: the rate of a parameter group at a step.
pub trait Schedule: Debug + Send + Sync {
    /// The learning rate, after `t` optimizer steps, of group `group`
    /// whose base (initial) rate is `base`.
    fn lr(&self, base: f64, group: usize, t: u64) -> Result<f64>;

    /// Checks the settings for an optimizer of `groups` parameter groups,
    /// naming the first bad one.
    fn check(&self, groups: usize) -> Result<()>;
}

/// A boxed schedule is a schedule, so schedules chosen at run time (a
/// `Vec<Box<dyn Schedule>>`, a configuration) drive an [`LrScheduler`].
impl<S: Schedule + ?Sized> Schedule for Box<S> {
    fn lr(&self, base: f64, group: usize, t: u64) -> Result<f64> {
        (**self).lr(base, group, t)
    }

    fn check(&self, groups: usize) -> Result<()> {
        (**self).check(groups)
    }
}

fn invalid(op: &str, detail: String) -> ExecError {
    ExecError::Invalid { op: op.into(), detail }
}

fn finite(op: &str, name: &str, v: f64) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(invalid(op, format!("{name} must be finite, got {v}")))
    }
}

/// PyTorch's `StepLR`: `base * gamma^(t / step_size)` (integer division),
/// the rate times `gamma` every `step_size` steps.
#[derive(Clone, Debug)]
pub struct StepLR {
    /// Steps between decays (at least 1).
    pub step_size: u64,
    /// The factor of each decay.
    pub gamma: f64,
}

impl StepLR {
    /// Decays by `gamma` every `step_size` steps (PyTorch's default gamma
    /// is 0.1).
    pub fn new(step_size: u64, gamma: f64) -> StepLR {
        StepLR { step_size, gamma }
    }
}

impl Schedule for StepLR {
    fn lr(&self, base: f64, _group: usize, t: u64) -> Result<f64> {
        Ok(base * self.gamma.powf((t / self.step_size.max(1)) as f64))
    }

    fn check(&self, _groups: usize) -> Result<()> {
        if self.step_size == 0 {
            return Err(invalid("StepLR", "step_size must be at least 1, got 0".into()));
        }
        finite("StepLR", "gamma", self.gamma)
    }
}

/// PyTorch's `CosineAnnealingLR`:
/// `eta_min + (base - eta_min) * (1 + cos(pi * t / t_max)) / 2`, from the
/// base rate at step 0 down to `eta_min` at step `t_max` (and, as in
/// PyTorch, back up after it).
#[derive(Clone, Debug)]
pub struct CosineAnnealingLR {
    /// Steps from the base rate to `eta_min` (at least 1).
    pub t_max: u64,
    /// The lowest rate.
    pub eta_min: f64,
}

impl CosineAnnealingLR {
    /// Anneals to `eta_min` over `t_max` steps.
    pub fn new(t_max: u64, eta_min: f64) -> CosineAnnealingLR {
        CosineAnnealingLR { t_max, eta_min }
    }
}

impl Schedule for CosineAnnealingLR {
    fn lr(&self, base: f64, _group: usize, t: u64) -> Result<f64> {
        let x = std::f64::consts::PI * t as f64 / self.t_max.max(1) as f64;
        Ok(self.eta_min + (base - self.eta_min) * (1.0 + x.cos()) / 2.0)
    }

    fn check(&self, _groups: usize) -> Result<()> {
        if self.t_max == 0 {
            return Err(invalid("CosineAnnealingLR", "t_max must be at least 1, got 0".into()));
        }
        finite("CosineAnnealingLR", "eta_min", self.eta_min)
    }
}

/// PyTorch's `LinearLR`: the base rate times a factor that moves linearly
/// from `start_factor` at step 0 to `end_factor` at step `total_iters`
/// and stays there; a warmup with `end_factor` 1.
#[derive(Clone, Debug)]
pub struct LinearLR {
    /// The factor at step 0, in (0, 1].
    pub start_factor: f64,
    /// The factor from step `total_iters` on, in [0, 1].
    pub end_factor: f64,
    /// Steps from `start_factor` to `end_factor` (at least 1).
    pub total_iters: u64,
}

impl LinearLR {
    /// Moves the factor from `start_factor` to `end_factor` over
    /// `total_iters` steps (PyTorch's defaults: 1/3, 1, 5).
    pub fn new(start_factor: f64, end_factor: f64, total_iters: u64) -> LinearLR {
        LinearLR { start_factor, end_factor, total_iters }
    }
}

impl Schedule for LinearLR {
    fn lr(&self, base: f64, _group: usize, t: u64) -> Result<f64> {
        let total = self.total_iters.max(1);
        let done = t.min(total) as f64 / total as f64;
        Ok(base * (self.start_factor + (self.end_factor - self.start_factor) * done))
    }

    fn check(&self, _groups: usize) -> Result<()> {
        if !(self.start_factor > 0.0 && self.start_factor <= 1.0) {
            return Err(invalid("LinearLR", format!("start_factor must be in (0, 1], got {}", self.start_factor)));
        }
        if !(0.0..=1.0).contains(&self.end_factor) {
            return Err(invalid("LinearLR", format!("end_factor must be in [0, 1], got {}", self.end_factor)));
        }
        if self.total_iters == 0 {
            return Err(invalid("LinearLR", "total_iters must be at least 1, got 0".into()));
        }
        Ok(())
    }
}

/// How [`OneCycleLR`] moves between two rates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anneal {
    /// Half a cosine (PyTorch's `"cos"`, the default).
    Cos,
    /// A straight line (PyTorch's `"linear"`).
    Linear,
}

/// PyTorch's `OneCycleLR`: from `max_lr / div_factor` up to `max_lr` over
/// the first `pct_start` of `total_steps`, then down to
/// `max_lr / div_factor / final_div_factor` at step `total_steps - 1`
/// (with `three_phase`, back to the initial rate before the final
/// descent). It ignores the groups' base rates, as PyTorch does. As in
/// PyTorch, step `total_steps` (the rate after the last of `total_steps`
/// optimizer steps, never used by them) extrapolates the last phase past
/// the final rate, and stepping beyond it is an error. Momentum is not
/// cycled.
#[derive(Clone, Debug)]
pub struct OneCycleLR {
    /// The peak rate: one for every group, or one per group.
    pub max_lrs: Vec<f64>,
    /// The length of the cycle in steps (at least 1).
    pub total_steps: u64,
    /// The fraction of the cycle spent rising, in [0, 1].
    pub pct_start: f64,
    /// The curve of each phase.
    pub anneal: Anneal,
    /// The initial rate is `max_lr / div_factor`.
    pub div_factor: f64,
    /// The final rate is the initial rate / `final_div_factor`.
    pub final_div_factor: f64,
    /// Three phases (up, down to the initial rate, down to the final).
    pub three_phase: bool,
}

impl OneCycleLR {
    /// One cycle peaking at `max_lr` for every group, with PyTorch's
    /// defaults (pct_start 0.3, cosine, div_factor 25, final_div_factor
    /// 1e4, two phases).
    pub fn new(max_lr: f64, total_steps: u64) -> OneCycleLR {
        OneCycleLR::with_max_lrs(vec![max_lr], total_steps)
    }

    /// One cycle with a peak rate per group.
    pub fn with_max_lrs(max_lrs: Vec<f64>, total_steps: u64) -> OneCycleLR {
        OneCycleLR {
            max_lrs,
            total_steps,
            pct_start: 0.3,
            anneal: Anneal::Cos,
            div_factor: 25.0,
            final_div_factor: 1e4,
            three_phase: false,
        }
    }

    /// Sets the fraction of the cycle spent rising.
    pub fn pct_start(mut self, pct_start: f64) -> OneCycleLR {
        self.pct_start = pct_start;
        self
    }

    /// Sets the curve of each phase.
    pub fn anneal(mut self, anneal: Anneal) -> OneCycleLR {
        self.anneal = anneal;
        self
    }

    /// Sets `div_factor` and `final_div_factor`.
    pub fn div_factors(mut self, div_factor: f64, final_div_factor: f64) -> OneCycleLR {
        self.div_factor = div_factor;
        self.final_div_factor = final_div_factor;
        self
    }

    /// Uses three phases.
    pub fn three_phase(mut self, three_phase: bool) -> OneCycleLR {
        self.three_phase = three_phase;
        self
    }
}

impl Schedule for OneCycleLR {
    fn lr(&self, _base: f64, group: usize, t: u64) -> Result<f64> {
        if t > self.total_steps {
            return Err(invalid(
                "OneCycleLR",
                format!("stepped {t} times, past the cycle's total_steps {}", self.total_steps),
            ));
        }
        let max = if self.max_lrs.len() == 1 { self.max_lrs[0] } else { self.max_lrs[group] };
        let initial = max / self.div_factor;
        let min = initial / self.final_div_factor;
        let total = self.total_steps as f64;
        let rise = self.pct_start * total - 1.0;
        // Each phase: (end step, start rate, end rate), as PyTorch's
        // `_schedule_phases`.
        let phases: Vec<(f64, f64, f64)> = if self.three_phase {
            vec![(rise, initial, max), (2.0 * self.pct_start * total - 2.0, max, initial), (total - 1.0, initial, min)]
        } else {
            vec![(rise, initial, max), (total - 1.0, max, min)]
        };
        let step = t as f64;
        let mut start = 0.0;
        for (i, &(end, from, to)) in phases.iter().enumerate() {
            if step <= end || i == phases.len() - 1 {
                // A phase of no steps (PyTorch divides by zero) is at its end.
                let pct = if end - start > 0.0 { (step - start) / (end - start) } else { 1.0 };
                return Ok(match self.anneal {
                    Anneal::Cos => to + (from - to) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0),
                    Anneal::Linear => (to - from) * pct + from,
                });
            }
            start = end;
        }
        unreachable!("the last phase always matches")
    }

    fn check(&self, groups: usize) -> Result<()> {
        const OP: &str = "OneCycleLR";
        if self.max_lrs.len() != 1 && self.max_lrs.len() != groups {
            let n = self.max_lrs.len();
            return Err(invalid(OP, format!("{n} max_lrs for an optimizer of {groups} parameter groups")));
        }
        for &m in &self.max_lrs {
            finite(OP, "max_lr", m)?;
        }
        if self.total_steps == 0 {
            return Err(invalid(OP, "total_steps must be at least 1, got 0".into()));
        }
        if !(0.0..=1.0).contains(&self.pct_start) {
            return Err(invalid(OP, format!("pct_start must be in [0, 1], got {}", self.pct_start)));
        }
        for (name, v) in [("div_factor", self.div_factor), ("final_div_factor", self.final_div_factor)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(OP, format!("{name} must be finite and positive, got {v}")));
            }
        }
        Ok(())
    }
}

/// PyTorch's `SequentialLR`: schedule `i` runs from milestone `i - 1`
/// (step 0 for the first) with its own step count restarted there, every
/// schedule from the same base rates. The milestones must increase.
#[derive(Debug)]
pub struct SequentialLR {
    /// The schedules, in order.
    pub schedules: Vec<Box<dyn Schedule>>,
    /// The steps where each schedule after the first begins.
    pub milestones: Vec<u64>,
}

impl SequentialLR {
    /// Runs `schedules` one after another, switching at `milestones`
    /// (one fewer than the schedules).
    pub fn new(schedules: Vec<Box<dyn Schedule>>, milestones: Vec<u64>) -> SequentialLR {
        SequentialLR { schedules, milestones }
    }

    /// The GPT recipe: a linear warmup from `start_factor` times the base
    /// rate over `warmup_steps`, then a cosine down to `eta_min` at step
    /// `total_steps`; as PyTorch's `SequentialLR([LinearLR(opt,
    /// start_factor, 1.0, warmup_steps), CosineAnnealingLR(opt,
    /// total_steps - warmup_steps, eta_min)], [warmup_steps])`.
    pub fn warmup_cosine(warmup_steps: u64, total_steps: u64, start_factor: f64, eta_min: f64) -> SequentialLR {
        SequentialLR::new(
            vec![
                Box::new(LinearLR::new(start_factor, 1.0, warmup_steps)),
                Box::new(CosineAnnealingLR::new(total_steps.saturating_sub(warmup_steps), eta_min)),
            ],
            vec![warmup_steps],
        )
    }
}

impl Schedule for SequentialLR {
    fn lr(&self, base: f64, group: usize, t: u64) -> Result<f64> {
        let i = self.milestones.iter().take_while(|&&m| m <= t).count();
        let local = if i == 0 { t } else { t - self.milestones[i - 1] };
        let schedule = self.schedules.get(i).ok_or_else(|| {
            invalid(
                "SequentialLR",
                format!("{} milestones for {} schedules", self.milestones.len(), self.schedules.len()),
            )
        })?;
        schedule.lr(base, group, local)
    }

    fn check(&self, groups: usize) -> Result<()> {
        if self.schedules.is_empty() || self.milestones.len() + 1 != self.schedules.len() {
            let detail = format!(
                "{} milestones for {} schedules (one fewer expected)",
                self.milestones.len(),
                self.schedules.len()
            );
            return Err(invalid("SequentialLR", detail));
        }
        if let Some(w) = self.milestones.windows(2).find(|w| w[0] >= w[1]) {
            return Err(invalid("SequentialLR", format!("milestones must increase, got {} then {}", w[0], w[1])));
        }
        self.schedules.iter().try_for_each(|s| s.check(groups))
    }
}

/// Drives a [`Schedule`] over an optimizer's parameter groups, as a
/// PyTorch scheduler object does: call [`LrScheduler::step`] once after
/// each optimizer step.
///
/// ```no_run
/// # use lazuli::prelude::*;
/// # use lazuli::optim::{Adam, LrScheduler, Optimizer, SequentialLR};
/// # fn main() -> lazuli::Result<()> {
/// # let dev = Device::cpu();
/// # let params: Vec<Tensor> = Vec::new();
/// let mut opt = Adam::adamw(params, 6e-4, 0.1);
/// let mut sched = LrScheduler::new(&mut opt, SequentialLR::warmup_cosine(100, 5000, 0.01, 6e-5))?;
/// for _ in 0..5000 {
///     // forward, backward ...
///     opt.step()?;
///     sched.step(&mut opt)?;
///     dev.mark_step()?;
/// }
/// # Ok(()) }
/// ```
///
/// The scheduler gives every group its own rate ([`Optimizer::set_group_lr`]);
/// read them with [`LrScheduler::last_lr`] or [`Optimizer::group_lrs`]
/// (`Optimizer::lr` keeps the optimizer's unscheduled default).
#[derive(Debug)]
pub struct LrScheduler {
    schedule: Box<dyn Schedule>,
    base_lrs: Vec<f64>,
    last_epoch: u64,
}

impl LrScheduler {
    /// Checks `schedule` for `opt`, records each group's current rate as
    /// its base, and sets step 0's rates (PyTorch's initial step).
    pub fn new(opt: &mut (impl Optimizer + ?Sized), schedule: impl Schedule + 'static) -> Result<LrScheduler> {
        let base_lrs = opt.group_lrs();
        schedule.check(base_lrs.len())?;
        let s = LrScheduler { schedule: Box::new(schedule), base_lrs, last_epoch: 0 };
        s.apply(opt)?;
        Ok(s)
    }

    /// Advances one step and sets the optimizer's rates for it; on an
    /// error (a cycle past its end, another optimizer) nothing changes.
    pub fn step(&mut self, opt: &mut (impl Optimizer + ?Sized)) -> Result<()> {
        self.last_epoch += 1;
        let r = self.apply(opt);
        if r.is_err() {
            self.last_epoch -= 1;
        }
        r
    }

    /// Steps taken (PyTorch's `last_epoch`).
    pub fn last_epoch(&self) -> u64 {
        self.last_epoch
    }

    /// Each group's base rate.
    pub fn base_lrs(&self) -> &[f64] {
        &self.base_lrs
    }

    /// Each group's rate at the current step (PyTorch's `get_last_lr`).
    pub fn last_lr(&self) -> Result<Vec<f64>> {
        self.lrs_at(self.last_epoch)
    }

    fn lrs_at(&self, t: u64) -> Result<Vec<f64>> {
        self.base_lrs.iter().enumerate().map(|(g, &b)| self.schedule.lr(b, g, t)).collect()
    }

    /// Sets the optimizer's rates for the current step, after computing
    /// all of them and checking the group count.
    fn apply(&self, opt: &mut (impl Optimizer + ?Sized)) -> Result<()> {
        let groups = opt.group_lrs().len();
        if groups != self.base_lrs.len() {
            let detail = format!("the optimizer has {groups} parameter groups, the scheduler {}", self.base_lrs.len());
            return Err(invalid("LrScheduler::step", detail));
        }
        let lrs = self.lrs_at(self.last_epoch)?;
        for (g, lr) in lrs.into_iter().enumerate() {
            opt.set_group_lr(g, lr)?;
        }
        Ok(())
    }

    /// The state: the step count (`"last_epoch"`, a rank-0 i64 tensor) and
    /// the base rates (`"base_lrs"`, f64, one per group), on the CPU. The
    /// schedule's settings are the caller's.
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let step = i64::try_from(self.last_epoch)
            .map_err(|_| invalid("LrScheduler::state_dict", format!("step count {} exceeds i64", self.last_epoch)))?;
        let dev = Device::cpu();
        Ok(vec![
            ("last_epoch".to_string(), Tensor::scalar(step, DType::I64, &dev)),
            ("base_lrs".to_string(), Tensor::from_slice(&self.base_lrs, [self.base_lrs.len()], &dev)?),
        ])
    }

    /// Writes [`LrScheduler::state_dict`] to `path` as safetensors.
    pub fn save_state_dict(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(serialize::save(path, &self.state_dict()?)?)
    }

    /// Replaces the step count and base rates with those of a file written
    /// by [`LrScheduler::save_state_dict`], and sets `opt`'s rates for the
    /// loaded step, so a resumed run continues bit for bit. The file must
    /// hold both entries and nothing else, with one base rate per group of
    /// `opt`; on an error nothing changes.
    pub fn load_state_dict(&mut self, path: impl AsRef<Path>, opt: &mut (impl Optimizer + ?Sized)) -> Result<()> {
        let path = path.as_ref();
        let loaded = serialize::load(path, &Device::cpu())?;
        self.load_state_tensors(loaded, path, opt)
    }

    /// [`LrScheduler::load_state_dict`] from tensors already read from
    /// `source` (named in errors), as [`LrScheduler::state_dict`] names them.
    pub fn load_state_tensors(
        &mut self,
        mut loaded: HashMap<String, Tensor>,
        source: &Path,
        opt: &mut (impl Optimizer + ?Sized),
    ) -> Result<()> {
        let path = source;
        let groups = opt.group_lrs().len();
        let mut names: Vec<&String> = loaded.keys().collect();
        names.sort();
        if let Some(other) = names.iter().find(|n| !matches!(n.as_str(), "last_epoch" | "base_lrs")) {
            let detail = "not scheduler state (expected last_epoch and base_lrs)".to_string();
            return Err(mismatch(path, other, detail).into());
        }
        let step = loaded.remove("last_epoch").ok_or_else(|| mismatch(path, "last_epoch", "not in the file".into()))?;
        let base = loaded.remove("base_lrs").ok_or_else(|| mismatch(path, "base_lrs", "not in the file".into()))?;
        if step.rank() != 0 || step.dtype() != DType::I64 {
            let detail = format!("stored as {}{}, expected i64[]", step.dtype(), step.shape());
            return Err(mismatch(path, "last_epoch", detail).into());
        }
        if base.rank() != 1 || base.dtype() != DType::F64 || base.shape().dims()[0] != groups {
            let detail =
                format!("stored as {}{}, expected f64[{groups}] for {groups} groups", base.dtype(), base.shape());
            return Err(mismatch(path, "base_lrs", detail).into());
        }
        let step = step.item::<i64>()?;
        let last_epoch =
            u64::try_from(step).map_err(|_| mismatch(path, "last_epoch", format!("a negative step count, {step}")))?;
        let base_lrs = base.to_vec::<f64>()?;
        let lrs = base_lrs.iter().enumerate().map(|(g, &b)| self.schedule.lr(b, g, last_epoch));
        let lrs = lrs.collect::<Result<Vec<f64>>>()?;
        for (g, lr) in lrs.into_iter().enumerate() {
            opt.set_group_lr(g, lr)?;
        }
        self.base_lrs = base_lrs;
        self.last_epoch = last_epoch;
        Ok(())
    }
}
