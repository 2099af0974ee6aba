//! The training demo as a library function: an MLP (64 -> 256 -> 10,
//! ReLU) or a LeNet-style CNN ([`LeNet`]: two 3x3 convolutions with ReLU
//! and 2x2 max pooling, then a linear layer) trained with cross-entropy
//! and SGD on the 8x8 digits dataset (`data/digits`, see its README for
//! the format, licence and the fixed train/test split).
//!
//! Every training step records forward, backward and the optimizer update
//! lazily and ends with ONE sync, `Device::mark_step()`. Shapes never change
//! (the last partial batch of an epoch is dropped) and hyperparameters are
//! lifted scalars, so every step after the second has the same graph hash
//! and compiles nothing: [`TrainReport::uncached_compiles_after_step_2`]
//! counts that.
//!
//! With the cargo feature `mpi`, `train_digits_distributed` trains the
//! same model data-parallel across the ranks of a [`ProcessGroup`]: each
//! rank takes its shard of every global batch from a
//! [`DistributedSampler`] and the gradients are averaged across ranks
//! before the optimizer, inside the recorded step
//! (`DataParallel::reduce_in_graph`: the all-reduces overlap the rest of
//! the backward pass).

use crate::amp::{GradScaler, GradScalerOptions};
use crate::nn::{cross_entropy, Conv2d, Init, Linear, MaxPool2d, Module, ModuleExt};
use crate::optim::{Optimizer, Sgd};
use crate::{metrics, no_grad, DType, Device, ExecError, Tensor};
use lazuli_distributed::{DataParallel, DistError, DistributedSampler, ProcessGroup};
use lazuli_executor::platform::Instant;
use lazuli_executor::HostRng;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Pixels per image.
pub const DIGITS_FEATURES: usize = 64;
/// Classes.
pub const DIGITS_CLASSES: usize = 10;
/// Rows of the training split (`[0, 1437)`); the rest is the test split.
pub const DIGITS_TRAIN_ROWS: usize = 1437;

/// An error of the training demo.
#[derive(Error)]
pub enum TrainError {
    /// The dataset could not be read or is malformed.
    #[error("digits dataset at {path}: {detail}")]
    Data {
        /// The file or directory.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// The engine failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// Distributed training failed (on this rank or another).
    #[error(transparent)]
    Dist(#[from] DistError),
}

/// `Debug` prints the message and its causes (what `?` out of `main`
/// shows); an engine error prints as it does on its own.
impl std::fmt::Debug for TrainError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrainError::Exec(e) => std::fmt::Debug::fmt(e, f),
            other => lazuli_executor::error::write_chain(f, other),
        }
    }
}

/// The digits dataset: `images` row-major `[n, 64]` in `[0, 1]`, `labels` 0..9.
#[derive(Clone, Debug)]
pub struct Digits {
    /// Pixel values / 16, 64 per row.
    pub images: Vec<f32>,
    /// Class of each row.
    pub labels: Vec<u8>,
}

impl Digits {
    /// The directory shipped with the repository (`data/digits` of the
    /// source tree this crate was built from, else of the working directory).
    pub fn default_dir() -> PathBuf {
        let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join("digits");
        if built.is_dir() {
            built
        } else {
            Path::new("data").join("digits")
        }
    }

    /// Reads `images.f32` and `labels.u8` from `dir`.
    pub fn load(dir: &Path) -> Result<Digits, TrainError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|e| TrainError::Data { path: p.display().to_string(), detail: e.to_string() })
        };
        let raw = read("images.f32")?;
        let labels = read("labels.u8")?;
        Digits::from_bytes(&raw, labels, &dir.display().to_string())
    }

    /// The dataset from the bytes of `images.f32` and `labels.u8` (a page
    /// embeds them); `path` names their origin in errors.
    pub fn from_bytes(raw: &[u8], labels: Vec<u8>, path: &str) -> Result<Digits, TrainError> {
        let bad = |detail: String| TrainError::Data { path: path.to_string(), detail };
        if raw.len() != labels.len() * 4 * DIGITS_FEATURES {
            return Err(bad(format!("{} image bytes do not match {} labels", raw.len(), labels.len())));
        }
        if labels.len() <= DIGITS_TRAIN_ROWS || labels.iter().any(|&l| l as usize >= DIGITS_CLASSES) {
            return Err(bad("expected more than 1437 rows with labels 0..9".into()));
        }
        let images = raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(Digits { images, labels })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True without rows.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// The model [`train_digits`] trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DigitsModel {
    /// [`Mlp`]: 64 -> hidden -> 10.
    #[default]
    Mlp,
    /// [`LeNet`]: conv 3x3 1->16, ReLU, max-pool 2, conv 3x3 16->32, ReLU,
    /// max-pool 2, linear 128 -> 10.
    Cnn,
}

impl DigitsModel {
    /// "mlp" or "cnn".
    pub fn name(self) -> &'static str {
        match self {
            DigitsModel::Mlp => "mlp",
            DigitsModel::Cnn => "cnn",
        }
    }

    /// Parses "mlp" or "cnn".
    pub fn parse(s: &str) -> Option<DigitsModel> {
        match s {
            "mlp" => Some(DigitsModel::Mlp),
            "cnn" => Some(DigitsModel::Cnn),
            _ => None,
        }
    }
}

/// Settings of [`train_digits`]; the defaults are the MLP demo's,
/// [`TrainConfig::cnn`] the CNN demo's.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The model.
    pub model: DigitsModel,
    /// Passes over the training split.
    pub epochs: usize,
    /// Rows per step (the last partial batch of an epoch is dropped).
    pub batch_size: usize,
    /// Hidden units (MLP only).
    pub hidden: usize,
    /// SGD learning rate.
    pub lr: f64,
    /// SGD momentum (Nesterov).
    pub momentum: f64,
    /// L2 weight decay.
    pub weight_decay: f64,
    /// Seed of the device RNG (initialization) and of the shuffles.
    pub seed: u64,
    /// Mixed precision: the forward pass and loss under
    /// [`crate::amp::autocast`] to this 16-bit float dtype, with a
    /// [`crate::amp::GradScaler`] (PyTorch's defaults) for f16; `None`
    /// trains in f32.
    pub autocast: Option<DType>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        // scikit-learn's MLPClassifier settings of the reference figure in
        // data/digits/README.md (its alpha=1e-4 is an L2 penalty of
        // alpha/2 * |W|^2 / n_samples per batch; weight decay 1e-4 is close).
        TrainConfig {
            model: DigitsModel::Mlp,
            epochs: 50,
            batch_size: 64,
            hidden: 256,
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-4,
            seed: 0,
            autocast: None,
        }
    }
}

impl TrainConfig {
    /// The CNN demo: [`LeNet`], batch 64, SGD lr 0.05 with Nesterov
    /// momentum 0.9 and weight decay 1e-4, 30 epochs.
    pub fn cnn() -> TrainConfig {
        TrainConfig { model: DigitsModel::Cnn, epochs: 30, lr: 0.05, ..TrainConfig::default() }
    }

    /// The demo settings of `model`.
    pub fn for_model(model: DigitsModel) -> TrainConfig {
        match model {
            DigitsModel::Mlp => TrainConfig::default(),
            DigitsModel::Cnn => TrainConfig::cnn(),
        }
    }
}

/// Progress of a running training, passed to the callback after each step.
#[derive(Clone, Debug)]
pub struct Progress {
    /// Epoch, from 0.
    pub epoch: usize,
    /// Step within the epoch, from 1.
    pub step_in_epoch: usize,
    /// Steps per epoch.
    pub steps_per_epoch: usize,
    /// Loss of the latest step whose value is known (lags one step).
    pub loss: Option<f64>,
    /// Mean loss of the epoch, set after its last step.
    pub epoch_loss: Option<f64>,
}

/// What [`train_digits`] measured.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The device's name.
    pub device: String,
    /// Epochs run.
    pub epochs: usize,
    /// Training steps run (each one sync).
    pub steps: usize,
    /// Rows per step.
    pub batch_size: usize,
    /// Mean training loss of each epoch.
    pub epoch_losses: Vec<f64>,
    /// Accuracy on the 360 test rows.
    pub test_accuracy: f64,
    /// Accuracy on the 1437 training rows.
    pub train_accuracy: f64,
    /// Median wall time of one step (record + sync), in steady state.
    pub median_step_ms: f64,
    /// Mean wall time of one step.
    pub mean_step_ms: f64,
    /// Wall time of the training loop, seconds.
    pub train_seconds: f64,
    /// Graphs compiled on the device during the whole run (training and
    /// evaluation), counted as plans added to its compile cache.
    pub uncached_compiles: u64,
    /// Compile-cache hits during the whole run (the process-wide
    /// `CachedCompile` counter).
    pub cached_compiles: u64,
    /// Graphs compiled by training steps 3 and later (should be 0).
    pub uncached_compiles_after_step_2: u64,
    /// Nodes of the last training step's graph.
    pub graph_nodes_per_step: usize,
    /// Kernels the last training step's graph ran as.
    pub kernels_per_step: usize,
    /// Nodes run on the CPU fallback during training (0 on the CPU backend).
    pub fallback_ops: u64,
    /// The same by op (`Fallback::<op>` counters), largest first.
    pub fallback_by_op: Vec<(String, u64)>,
    /// The model trained ("mlp" or "cnn").
    pub model: String,
    /// What data-parallel training added (`None` in one process without a
    /// group).
    pub distributed: Option<DistributedReport>,
}

/// The data-parallel part of a [`TrainReport`], as measured on this rank.
#[derive(Clone, Debug)]
pub struct DistributedReport {
    /// Ranks.
    pub world_size: usize,
    /// Rows per rank per step (the global batch over the ranks).
    pub batch_per_rank: usize,
    /// Gradient bytes each rank all-reduces per step.
    pub allreduce_bytes_per_step: u64,
    /// All-reduce buckets per step.
    pub buckets: usize,
    /// Mean time per step the communication thread spent in the
    /// all-reduces recorded into the step (`DataParallel::reduce_in_graph`),
    /// steady state, milliseconds.
    pub allreduce_ms_per_step: f64,
    /// Of that, time the device waited for all-reduces (the rest was
    /// hidden behind the backward pass and the optimizer), milliseconds.
    pub allreduce_wait_ms_per_step: f64,
}

impl TrainReport {
    /// The report as one JSON object (with a `distributed` object only for
    /// data-parallel training).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "device": self.device,
            "epochs": self.epochs,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "final_loss": self.epoch_losses.last().copied(),
            "test_accuracy": self.test_accuracy,
            "train_accuracy": self.train_accuracy,
            "median_step_ms": self.median_step_ms,
            "mean_step_ms": self.mean_step_ms,
            "train_seconds": self.train_seconds,
            "uncached_compiles": self.uncached_compiles,
            "cached_compiles": self.cached_compiles,
            "uncached_compiles_after_step_2": self.uncached_compiles_after_step_2,
            "graph_nodes_per_step": self.graph_nodes_per_step,
            "kernels_per_step": self.kernels_per_step,
            "fallback_ops": self.fallback_ops,
            "fallback_by_op": self
                .fallback_by_op
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
                .collect::<serde_json::Map<String, serde_json::Value>>(),
            "model": self.model,
        });
        if let Some(d) = &self.distributed {
            v["distributed"] = serde_json::json!({
                "world_size": d.world_size,
                "batch_per_rank": d.batch_per_rank,
                "allreduce_bytes_per_step": d.allreduce_bytes_per_step,
                "buckets": d.buckets,
                "allreduce_ms_per_step": d.allreduce_ms_per_step,
                "allreduce_wait_ms_per_step": d.allreduce_wait_ms_per_step,
            });
        }
        v
    }
}

/// The demo's model: `Linear(64, hidden) -> ReLU -> Linear(hidden, 10)`,
/// Glorot-uniform weights and biases (as scikit-learn's MLPClassifier).
pub struct Mlp {
    /// Input layer.
    pub fc1: Linear,
    /// Output layer.
    pub fc2: Linear,
}

impl Mlp {
    /// A freshly initialized model (draws from the device RNG).
    pub fn new(inputs: usize, hidden: usize, outputs: usize, device: &Device) -> crate::Result<Mlp> {
        let x = Init::XavierUniform;
        Ok(Mlp {
            fc1: Linear::with_init(inputs, hidden, true, x, x, device)?,
            fc2: Linear::with_init(hidden, outputs, true, x, x, device)?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("fc1".into(), &self.fc1 as &dyn Module), ("fc2".into(), &self.fc2 as &dyn Module)]
    }
}

/// The CNN demo's model, LeNet-style for 8x8 images: `conv1` (3x3, 1 ->
/// 16, padding 1), ReLU, 2x2 max pool, `conv2` (3x3, 16 -> 32, padding 1),
/// ReLU, 2x2 max pool, flatten (32 x 2 x 2 = 128), `fc` (128 -> 10). Its
/// input is the flat `[batch, 64]` pixel rows.
pub struct LeNet {
    /// First convolution.
    pub conv1: Conv2d,
    /// Second convolution.
    pub conv2: Conv2d,
    /// Classifier.
    pub fc: Linear,
}

impl LeNet {
    /// A freshly initialized model (Kaiming-uniform weights, draws from the
    /// device RNG).
    pub fn new(device: &Device) -> crate::Result<LeNet> {
        Ok(LeNet {
            conv1: Conv2d::builder(1, 16, 3).padding(1).build(device)?,
            conv2: Conv2d::builder(16, 32, 3).padding(1).build(device)?,
            fc: Linear::new(128, DIGITS_CLASSES, device)?,
        })
    }
}

impl Module for LeNet {
    fn forward(&self, x: &Tensor) -> crate::Result<Tensor> {
        let pool = MaxPool2d::new(2);
        let x = x.reshape([-1, 1, 8, 8])?;
        let h = pool.forward(&self.conv1.forward(&x)?.relu()?)?;
        let h = pool.forward(&self.conv2.forward(&h)?.relu()?)?;
        self.fc.forward(&h.flatten(1, -1)?)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("conv1".into(), &self.conv1 as &dyn Module),
            ("conv2".into(), &self.conv2 as &dyn Module),
            ("fc".into(), &self.fc as &dyn Module),
        ]
    }
}

/// Accuracy of `model` on rows `rows` of `data` (one sync, no gradients).
pub fn accuracy(
    model: &(impl Module + ?Sized),
    data: &Digits,
    rows: std::ops::Range<usize>,
    device: &Device,
) -> crate::Result<f64> {
    Ok(accuracies(model, data, std::slice::from_ref(&rows), device)?[0])
}

/// Accuracy of `model` on each of `splits` (row ranges of `data`), all
/// computed by one graph (one sync, one compile, no gradients): the
/// splits' predictions are read after one execution, and a process that
/// evaluates a train and a test split compiles one plan for both rather
/// than one per split size.
pub fn accuracies(
    model: &(impl Module + ?Sized),
    data: &Digits,
    splits: &[std::ops::Range<usize>],
    device: &Device,
) -> crate::Result<Vec<f64>> {
    no_grad(|| {
        let mut preds = Vec::with_capacity(splits.len());
        for rows in splits {
            let x = Tensor::from_slice(
                &data.images[rows.start * DIGITS_FEATURES..rows.end * DIGITS_FEATURES],
                [rows.len(), DIGITS_FEATURES],
                device,
            )?;
            preds.push(model.forward(&x)?.argmax(-1, false)?);
        }
        crate::sync(&preds.iter().collect::<Vec<_>>())?;
        splits
            .iter()
            .zip(&preds)
            .map(|(rows, pred)| {
                let pred = pred.to_vec::<i32>()?;
                let correct = pred.iter().zip(&data.labels[rows.clone()]).filter(|(&p, &l)| p == l as i32).count();
                Ok(correct as f64 / rows.len().max(1) as f64)
            })
            .collect()
    })
}

/// Trains the demo model (`cfg.model`) on `data` (train split) and
/// evaluates it on the test split; `progress` is called after every step.
pub fn train_digits(
    device: &Device,
    data: &Digits,
    cfg: &TrainConfig,
    progress: &mut dyn FnMut(&Progress),
) -> Result<TrainReport, TrainError> {
    train_loop(device, data, cfg, None, progress)
}

/// [`train_digits`] data-parallel over `group`: `cfg.batch_size` is the
/// global batch (it must divide by the world size), rank 0's initial
/// parameters are broadcast, each rank trains on its shard of each
/// epoch's permutation ([`DistributedSampler`] with `drop_last`) and the
/// gradients are averaged across ranks every step. Every rank returns the
/// same accuracies; the losses reported are this rank's.
#[cfg(feature = "mpi")]
pub fn train_digits_distributed(
    device: &Device,
    data: &Digits,
    cfg: &TrainConfig,
    group: ProcessGroup,
    progress: &mut dyn FnMut(&Progress),
) -> Result<TrainReport, TrainError> {
    train_loop(device, data, cfg, Some(group), progress)
}

fn train_loop(
    device: &Device,
    data: &Digits,
    cfg: &TrainConfig,
    group: Option<ProcessGroup>,
    progress: &mut dyn FnMut(&Progress),
) -> Result<TrainReport, TrainError> {
    // Compiles are counted on this device (plans added to its cache), so
    // other work in the process cannot disturb the figures.
    let plans0 = device.cached_plans();
    let cached0 = metrics::counter("CachedCompile");
    let fallback0 = metrics::counter("FallbackOps");
    device.manual_seed(cfg.seed);
    let fallback_counters0: Vec<(String, u64)> = fallback_counters();
    let model: Box<dyn Module> = match cfg.model {
        DigitsModel::Mlp => Box::new(Mlp::new(DIGITS_FEATURES, cfg.hidden, DIGITS_CLASSES, device)?),
        DigitsModel::Cnn => Box::new(LeNet::new(device)?),
    };
    let mut opt = Sgd::new(model.parameters(), cfg.lr)
        .momentum(cfg.momentum)
        .nesterov(cfg.momentum != 0.0)
        .weight_decay(cfg.weight_decay);

    let mut scaler = match cfg.autocast {
        Some(d) => Some(GradScaler::with_options(
            device,
            GradScalerOptions { enabled: d == DType::F16, ..GradScalerOptions::default() },
        )?),
        None => None,
    };
    let b = cfg.batch_size.clamp(1, DIGITS_TRAIN_ROWS);
    let mut dp = match group {
        Some(g) => Some(DataParallel::new(g, model.named_parameters())?),
        None => None,
    };
    let (world, rank) = dp.as_ref().map_or((1, 0), |d| (d.group().world_size(), d.group().rank()));
    if !b.is_multiple_of(world) {
        return Err(DistError::Invalid {
            op: "train_digits_distributed",
            detail: format!("the global batch of {b} rows does not divide between {world} ranks"),
        }
        .into());
    }
    // Rows per step on this rank.
    let bl = b / world;
    let mut sampler = match &dp {
        Some(_) => Some(DistributedSampler::new(DIGITS_TRAIN_ROWS, world, rank)?.seed(cfg.seed).drop_last(true)),
        None => None,
    };
    let steps_per_epoch = sampler.as_ref().map_or(DIGITS_TRAIN_ROWS / b, |s| s.num_samples() / bl);
    let mut rng = HostRng::new(cfg.seed ^ 0xD1_6175);
    let mut order: Vec<usize> = (0..DIGITS_TRAIN_ROWS).collect();
    let mut xb = vec![0f32; bl * DIGITS_FEATURES];
    let mut yb = vec![0i32; bl];
    let mut step_ms: Vec<f64> = Vec::new();
    let mut epoch_losses = Vec::new();
    let mut after_step_2 = None;
    let mut step = 0usize;
    let started = Instant::now();
    let mut last_loss: Option<f64> = None;
    for epoch in 0..cfg.epochs {
        match &mut sampler {
            Some(s) => {
                s.set_epoch(epoch as u64);
                order = s.indices();
            }
            None => rng.shuffle(&mut order),
        }
        let mut losses: Vec<Tensor> = Vec::with_capacity(steps_per_epoch);
        for s in 0..steps_per_epoch {
            let t0 = Instant::now();
            for (i, &row) in order[s * bl..(s + 1) * bl].iter().enumerate() {
                xb[i * DIGITS_FEATURES..(i + 1) * DIGITS_FEATURES]
                    .copy_from_slice(&data.images[row * DIGITS_FEATURES..(row + 1) * DIGITS_FEATURES]);
                yb[i] = data.labels[row] as i32;
            }
            let forward_backward = || -> crate::Result<Tensor> {
                let x = Tensor::from_slice(&xb, [bl, DIGITS_FEATURES], device)?;
                let y = Tensor::from_slice(&yb, [bl], device)?;
                let loss = crate::amp::autocast(cfg.autocast, || cross_entropy(&model.forward(&x)?, &y))?;
                match &scaler {
                    Some(s) => s.scale(&loss)?.backward()?,
                    None => loss.backward()?,
                }
                Ok(loss)
            };
            let loss = match &mut dp {
                None => forward_backward()?,
                // A rank that failed still takes part in the all-reduce, so
                // that every rank reports its error instead of waiting.
                Some(dp) => match forward_backward() {
                    Ok(loss) => {
                        dp.reduce_in_graph()?;
                        loss
                    }
                    Err(e) => return Err(dp.abandon_step(&e).into()),
                },
            };
            match &mut scaler {
                Some(s) => {
                    s.step(&mut opt)?;
                    s.update()?;
                }
                None => opt.step()?,
            }
            opt.zero_grad();
            losses.push(loss.detach());
            drop(loss);
            device.mark_step()?;
            step += 1;
            // Read the loss of two steps before (done by now, from the
            // copy its own execution made): the GPU keeps two steps queued
            // while this thread records the next one. A read one step
            // behind would leave it only the step just submitted, and it
            // would idle whenever recording and encoding a step take
            // longer than running one (a small model on a fast GPU). The
            // progress bar gets a value without a new graph.
            if losses.len() >= 3 {
                last_loss = Some(losses[losses.len() - 3].item::<f32>()? as f64);
            }
            if step == 2 {
                after_step_2 = Some(device.cached_plans());
                // The first steps compile: their all-reduces are left out.
                if let Some(dp) = &mut dp {
                    dp.take_stats();
                }
            }
            step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            let epoch_loss = if s + 1 == steps_per_epoch {
                let mut sum = 0.0;
                for l in &losses {
                    sum += l.item::<f32>()? as f64;
                }
                let mean = sum / losses.len() as f64;
                epoch_losses.push(mean);
                last_loss = losses.last().map(|l| l.item::<f32>()).transpose()?.map(f64::from);
                Some(mean)
            } else {
                None
            };
            progress(&Progress { epoch, step_in_epoch: s + 1, steps_per_epoch, loss: last_loss, epoch_loss });
        }
    }
    device.wait()?;
    let train_seconds = started.elapsed().as_secs_f64();
    let plans_train_end = device.cached_plans();
    let fallback_ops = metrics::counter("FallbackOps") - fallback0;
    let mut fallback_by_op: Vec<(String, u64)> = fallback_counters()
        .into_iter()
        .map(|(k, v)| {
            let before = fallback_counters0.iter().find(|(k0, _)| *k0 == k).map_or(0, |(_, v0)| *v0);
            (k, v - before.min(v))
        })
        .filter(|(_, v)| *v > 0)
        .collect();
    fallback_by_op.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let last = |name: &str| metrics::value(name).map(|v| v.last as usize).unwrap_or(0);
    let (graph_nodes_per_step, kernels_per_step) = (last("GraphSize"), last("KernelsPerPlan"));
    let splits = [DIGITS_TRAIN_ROWS..data.len(), 0..DIGITS_TRAIN_ROWS];
    let split_accuracies = accuracies(model.as_ref(), data, &splits, device)?;
    let (test_accuracy, train_accuracy) = (split_accuracies[0], split_accuracies[1]);
    // Steady state: leave out the first two steps (they compile).
    let mut steady: Vec<f64> = step_ms.iter().skip(2).copied().collect();
    if steady.is_empty() {
        steady = step_ms.clone();
    }
    steady.sort_by(f64::total_cmp);
    let median_step_ms = steady.get(steady.len() / 2).copied().unwrap_or(0.0);
    let mean_step_ms = if steady.is_empty() { 0.0 } else { steady.iter().sum::<f64>() / steady.len() as f64 };
    Ok(TrainReport {
        device: device.name(),
        epochs: cfg.epochs,
        steps: step,
        batch_size: b,
        epoch_losses,
        test_accuracy,
        train_accuracy,
        median_step_ms,
        mean_step_ms,
        train_seconds,
        uncached_compiles: (device.cached_plans() - plans0) as u64,
        cached_compiles: metrics::counter("CachedCompile") - cached0,
        uncached_compiles_after_step_2: after_step_2.map(|c| (plans_train_end - c) as u64).unwrap_or(0),
        graph_nodes_per_step,
        kernels_per_step,
        fallback_ops,
        fallback_by_op,
        model: cfg.model.name().to_string(),
        distributed: dp.map(|mut dp| {
            // Steady state: the all-reduces waited for since step 2, as
            // whole steps of `buckets` each.
            let s = dp.take_stats();
            let n = (s.buckets as f64 / dp.buckets().max(1) as f64).max(1.0);
            DistributedReport {
                world_size: world,
                batch_per_rank: bl,
                allreduce_bytes_per_step: dp.bytes_per_step(),
                buckets: dp.buckets(),
                allreduce_ms_per_step: s.seconds * 1e3 / n,
                allreduce_wait_ms_per_step: s.wait_seconds * 1e3 / n,
            }
        }),
    })
}

/// The process-wide `Fallback::<op>` counters.
fn fallback_counters() -> Vec<(String, u64)> {
    metrics::counters().into_iter().filter(|(k, _)| k.starts_with("Fallback::")).collect()
}
