//! Training checkpoints: one safetensors file holding a model's state
//! dict, an optimizer's state, a learning-rate scheduler's state and the
//! device RNG's state, so that a run stopped at step k and resumed into
//! freshly made objects continues with the losses of the uninterrupted
//! run, bit for bit.
//!
//! A [`Checkpoint`] collects the parts under fixed prefixes (`model.`,
//! `optimizer.`, `scheduler.`, `rng.`, `scaler.` for a mixed-precision
//! run's [`GradScaler`], and `extra.` for the caller's own
//! tensors, e.g. the epoch) and saves them in one file;
//! [`Checkpoint::load`] memory-maps a saved one into a
//! [`LoadedCheckpoint`], whose `restore_*` methods put each part back.
//! Every part restores atomically (checked, then assigned: a failed part
//! changes nothing of its object), and [`LoadedCheckpoint::restore`]
//! restores the parts in the order optimizer, scheduler, model, RNG.
//!
//! ```no_run
//! # use lazuli::prelude::*;
//! # use lazuli::checkpoint::Checkpoint;
//! # use lazuli::optim::{Adam, LrScheduler, Optimizer, SequentialLR};
//! # fn main() -> lazuli::Result<()> {
//! # let dev = Device::cpu();
//! let model = lazuli::nn::Linear::new(4, 2, &dev)?;
//! let mut opt = Adam::adamw(model.parameters(), 1e-3, 0.01);
//! let mut sched = LrScheduler::new(&mut opt, SequentialLR::warmup_cosine(10, 100, 0.1, 0.0))?;
//! // ... train, then after `dev.mark_step()`:
//! Checkpoint::training(&model, &opt, Some(&sched), &dev)?.save("run.ckpt.safetensors")?;
//! // Later, into freshly made objects:
//! Checkpoint::load("run.ckpt.safetensors")?.restore(&model, &mut opt, Some(&mut sched), &dev)?;
//! # Ok(()) }
//! ```
//!
//! What a resumed run needs beyond this file is the caller's: the same
//! data in the same order (a [`crate::data::DataLoader`] resumes from its
//! seed and epoch), and the same hyperparameters (they are settings, not
//! state).

use crate::amp::GradScaler;
use crate::nn::{Module, ModuleExt};
use crate::optim::{LrScheduler, Optimizer};
use crate::serialize::{self, load_archive, Archive, LoadOptions, LoadReport, SerializeError};
use crate::{Device, DeviceExt, ExecError, Result, RngState, Tensor};
use std::path::{Path, PathBuf};

const MODEL: &str = "model.";
const OPTIMIZER: &str = "optimizer.";
const SCHEDULER: &str = "scheduler.";
const RNG: &str = "rng.";
const EXTRA: &str = "extra.";
const SCALER: &str = "scaler.";
const RNG_FIELDS: [&str; 3] = ["seed", "step", "offset"];

/// The parts of a training run to save in one file (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    entries: Vec<(String, Tensor)>,
}

impl Checkpoint {
    /// An empty checkpoint.
    pub fn new() -> Checkpoint {
        Checkpoint::default()
    }

    /// Model, optimizer, scheduler (if any) and the RNG state of `device`:
    /// everything a bit-identical resume needs. Call it after
    /// `device.mark_step()`, between steps.
    pub fn training<M, O>(model: &M, opt: &O, scheduler: Option<&LrScheduler>, device: &Device) -> Result<Checkpoint>
    where
        M: Module + ?Sized,
        O: Optimizer + ?Sized,
    {
        let mut c = Checkpoint::new().model(model).optimizer(opt)?;
        if let Some(s) = scheduler {
            c = c.scheduler(s)?;
        }
        c.rng(device)
    }

    /// Adds the model's state dict (parameters and buffers), as `model.*`.
    pub fn model<M: Module + ?Sized>(mut self, model: &M) -> Checkpoint {
        self.add(MODEL, model.state_dict());
        self
    }

    /// Adds the optimizer's state ([`Optimizer::state_tensors`]), as
    /// `optimizer.*`.
    pub fn optimizer<O: Optimizer + ?Sized>(mut self, opt: &O) -> Result<Checkpoint> {
        self.add(OPTIMIZER, opt.state_tensors()?);
        Ok(self)
    }

    /// Adds the scheduler's state ([`LrScheduler::state_dict`]), as
    /// `scheduler.*`.
    pub fn scheduler(mut self, scheduler: &LrScheduler) -> Result<Checkpoint> {
        self.add(SCHEDULER, scheduler.state_dict()?);
        Ok(self)
    }

    /// Adds `device`'s RNG state ([`Device::rng_state`]) as three rank-0
    /// u64 tensors, `rng.seed`, `rng.step` and `rng.offset`.
    pub fn rng(mut self, device: &Device) -> Result<Checkpoint> {
        let s = device.rng_state();
        let cpu = Device::cpu();
        let values = [s.seed, s.step, s.offset];
        let tensors =
            RNG_FIELDS.iter().zip(values).map(|(n, v)| Ok((n.to_string(), Tensor::from_slice(&[v], [], &cpu)?)));
        self.add(RNG, tensors.collect::<Result<_>>()?);
        Ok(self)
    }

    /// Adds a [`GradScaler`]'s state (its scale and growth counter,
    /// [`GradScaler::state_tensors`]), as `scaler.*`.
    pub fn grad_scaler(mut self, scaler: &GradScaler) -> Checkpoint {
        self.add(SCALER, scaler.state_tensors());
        self
    }

    /// Adds a tensor of the caller's (an epoch counter, a data-loader
    /// position), as `extra.<name>`.
    pub fn extra(mut self, name: &str, tensor: &Tensor) -> Checkpoint {
        self.add(EXTRA, vec![(name.to_string(), tensor.clone())]);
        self
    }

    fn add(&mut self, prefix: &str, entries: Vec<(String, Tensor)>) {
        self.entries.extend(entries.into_iter().map(|(n, t)| (format!("{prefix}{n}"), t)));
    }

    /// Every entry with its full name.
    pub fn entries(&self) -> &[(String, Tensor)] {
        &self.entries
    }

    /// Writes the checkpoint to `path` as one safetensors file (a barrier:
    /// every tensor is read).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(serialize::save(path, &self.entries)?)
    }

    /// Opens (memory-maps) a checkpoint written by [`Checkpoint::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<LoadedCheckpoint> {
        let path = path.as_ref();
        Ok(LoadedCheckpoint { archive: Archive::open(path)?, path: path.to_path_buf() })
    }
}

/// A checkpoint file opened by [`Checkpoint::load`]; each `restore_*`
/// puts one part back.
pub struct LoadedCheckpoint {
    archive: Archive,
    path: PathBuf,
}

impl std::fmt::Debug for LoadedCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedCheckpoint").field("path", &self.path).finish()
    }
}

impl LoadedCheckpoint {
    /// Every entry's full name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.archive.names()
    }

    /// True if the checkpoint holds a part: `"model"`, `"optimizer"`,
    /// `"scheduler"`, `"rng"`, `"scaler"` or `"extra"`.
    pub fn has(&self, part: &str) -> bool {
        let prefix = format!("{part}.");
        self.archive.names().iter().any(|n| n.starts_with(&prefix))
    }

    /// Restores model, optimizer, scheduler (when given) and the RNG state
    /// of `device`, in the order optimizer, scheduler, model, RNG; each
    /// part must be in the checkpoint (the model's strictly, as
    /// [`LoadedCheckpoint::restore_model`]).
    pub fn restore<M, O>(
        &self,
        model: &M,
        opt: &mut O,
        scheduler: Option<&mut LrScheduler>,
        device: &Device,
    ) -> Result<()>
    where
        M: Module + ?Sized,
        O: Optimizer + ?Sized,
    {
        self.restore_optimizer(opt)?;
        if let Some(s) = scheduler {
            self.restore_scheduler(s, opt)?;
        }
        self.restore_model(model)?;
        self.restore_rng(device)
    }

    /// Loads the model part into `model` strictly: every entry of its
    /// state dict must be there with its shape (float dtypes convert), and
    /// nothing else may be. Parameters keep their identity.
    pub fn restore_model<M: Module + ?Sized>(&self, model: &M) -> Result<()> {
        self.restore_model_with(model, &LoadOptions::strict()).map(|_| ())
    }

    /// Loads the model part with `options` (non-strict keys, renaming; the
    /// renaming sees the names without the `model.` prefix).
    pub fn restore_model_with<M: Module + ?Sized>(&self, model: &M, options: &LoadOptions<'_>) -> Result<LoadReport> {
        let inner = if options.strict { LoadOptions::strict() } else { LoadOptions::non_strict() };
        let inner = inner.rename(|k| k.strip_prefix(MODEL).and_then(|k| options.renamed(k)));
        Ok(load_archive(&self.archive, &model.state_dict(), &inner)?)
    }

    /// Restores the optimizer part into `opt`, an optimizer of the same
    /// kind over parameters of the same types in the same order.
    pub fn restore_optimizer<O: Optimizer + ?Sized>(&self, opt: &mut O) -> Result<()> {
        let dev = opt.parameters().first().map_or_else(Device::cpu, |p| p.device().clone());
        let state = self.part(OPTIMIZER, &dev)?;
        opt.load_state_tensors(state, &self.path)
    }

    /// Restores the scheduler part into `scheduler` and sets `opt`'s
    /// learning rates for the restored step.
    pub fn restore_scheduler<O: Optimizer + ?Sized>(&self, scheduler: &mut LrScheduler, opt: &mut O) -> Result<()> {
        let state = self.part(SCHEDULER, &Device::cpu())?;
        scheduler.load_state_tensors(state, &self.path, opt)
    }

    /// Restores the scaler part (saved by [`Checkpoint::grad_scaler`])
    /// into `scaler`.
    pub fn restore_grad_scaler(&self, scaler: &mut GradScaler) -> Result<()> {
        let state = self.part(SCALER, &Device::cpu())?;
        scaler.load_state_tensors(state, &self.path)
    }

    /// Restores the RNG part into `device` ([`Device::set_rng_state`]).
    pub fn restore_rng(&self, device: &Device) -> Result<()> {
        let state = self.rng_state()?;
        device.set_rng_state(state);
        Ok(())
    }

    /// The saved RNG state.
    pub fn rng_state(&self) -> Result<RngState> {
        let cpu = Device::cpu();
        let mut v = [0u64; 3];
        for (slot, field) in v.iter_mut().zip(RNG_FIELDS) {
            let name = format!("{RNG}{field}");
            if !self.archive.names().contains(&name) {
                return Err(self.missing(&name));
            }
            let t = self.archive.tensor(&name, &cpu)?;
            if t.rank() != 0 {
                return Err(self.mismatch(&name, format!("stored as {}{}, expected u64[]", t.dtype(), t.shape())));
            }
            *slot =
                t.item::<u64>().map_err(|_| self.mismatch(&name, format!("stored as {}, expected u64", t.dtype())))?;
        }
        Ok(RngState { seed: v[0], step: v[1], offset: v[2] })
    }

    /// The caller's tensor saved by [`Checkpoint::extra`], on `device`.
    pub fn extra(&self, name: &str, device: &Device) -> Result<Tensor> {
        let full = format!("{EXTRA}{name}");
        if !self.archive.names().contains(&full) {
            return Err(self.missing(&full));
        }
        Ok(self.archive.tensor(&full, device)?)
    }

    /// The entries under `prefix`, without it, on `device`; an error if
    /// there are none.
    fn part(&self, prefix: &str, device: &Device) -> Result<std::collections::HashMap<String, Tensor>> {
        let part = self.archive.with_prefix(prefix, device)?;
        if part.is_empty() {
            let detail = format!("the checkpoint has no {} part", prefix.trim_end_matches('.'));
            return Err(self.mismatch(prefix.trim_end_matches('.'), detail));
        }
        Ok(part)
    }

    fn missing(&self, name: &str) -> ExecError {
        self.mismatch(name, "not in the checkpoint".into())
    }

    fn mismatch(&self, name: &str, detail: String) -> ExecError {
        SerializeError::Mismatch { path: self.path.display().to_string(), name: name.into(), detail }.into()
    }
}
