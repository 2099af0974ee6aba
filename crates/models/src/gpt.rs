//! G8: a GPT training step written against the public API, from
//! `lazuli::nn` layers, as `docs/workloads.md` defines it and as the PyTorch
//! twin (`shared/gpu/torch_twin.py`) builds it: token and learned position
//! embeddings, pre-LayerNorm blocks of causal self-attention (one qkv
//! `Linear`, an output `Linear`) and a GELU (erf) MLP, a final LayerNorm,
//! the lm_head tied to the token embedding, cross-entropy on the next
//! tokens, AdamW (lr 3e-4, weight decay 0.01).
//!
//! Attention is `nn::scaled_dot_product_attention` (causal): the fused
//! op, whose scores are never materialized. The token lookup is a one-hot
//! matmul (`one_hot(ids) @ wte`), not `Embedding::forward`'s gather: it
//! was written when a gather ran on the CPU fallback on wgpu, and stays so
//! that G8's figures remain comparable with those measured then (the
//! gather and its scatter-add gradient now run on the GPU, without the
//! `[rows, vocab]` one-hot products). Positions are `0..context`, so the
//! position lookup is the whole `wpe` table, broadcast over the batch.
//!
//! [`Gpt::step`] reports where a step's time goes: recording (forward,
//! backward and optimizer on the host), the sync (trace, hash, cache
//! lookup, submit) and the worker's execution.

use lazuli::amp::{GradScaler, GradScalerOptions};
use lazuli::nn::{self, Embedding, Init, LayerNorm, Linear, Module, ModuleExt};
use lazuli::optim::{Adam, Optimizer};
use lazuli::platform::Instant;
use lazuli::{metrics, DType, Device, Result, Tensor};
use std::time::Duration;

/// The sizes of a GPT training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptSizes {
    /// Vocabulary (token embedding rows, logits per position).
    pub vocab: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Embedding width (`n_embd`).
    pub embd: usize,
    /// Attention heads (`embd` must be a multiple).
    pub heads: usize,
    /// Context length (positions per sequence).
    pub context: usize,
    /// Sequences per step.
    pub batch: usize,
}

impl GptSizes {
    /// G8 of `docs/workloads.md`: vocab 256, 4 layers, n_embd 256, 4 heads,
    /// context 128, batch 32.
    pub const G8: GptSizes = GptSizes { vocab: 256, layers: 4, embd: 256, heads: 4, context: 128, batch: 32 };

    /// The small GPT of `GPU.md`'s host-cost measurement, for a 2-core box:
    /// 2 layers, n_embd 64, 4 heads, context 64, batch 16 (28 parameter
    /// tensors), vocab 256.
    pub const SMALL: GptSizes = GptSizes { vocab: 256, layers: 2, embd: 64, heads: 4, context: 64, batch: 16 };

    /// Sizes for debug-build tests (every dimension distinct).
    pub const TINY: GptSizes = GptSizes { vocab: 24, layers: 2, embd: 16, heads: 2, context: 8, batch: 3 };

    /// Parameter tensors: two embeddings, 12 per block, the final norm's 2.
    pub fn parameter_tensors(self) -> usize {
        4 + 12 * self.layers
    }
}

/// One pre-LayerNorm transformer block (a [`Module`] whose children
/// are its norms and linears, so every walk of the model reaches them).
struct Block {
    sizes: GptSizes,
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    out: Linear,
}

impl Block {
    fn new(sizes: GptSizes, dev: &Device) -> Result<Block> {
        let c = sizes.embd;
        // PyTorch's nn.Linear initialization, as the twin uses.
        let linear = |i, o| Linear::with_init(i, o, true, Init::LecunUniform, Init::LecunUniform, dev);
        Ok(Block {
            sizes,
            ln1: LayerNorm::new(&[c], dev)?,
            qkv: linear(c, 3 * c)?,
            proj: linear(c, c)?,
            ln2: LayerNorm::new(&[c], dev)?,
            fc: linear(c, 4 * c)?,
            out: linear(4 * c, c)?,
        })
    }
}

impl Module for Block {
    /// `x` is `[batch * context, embd]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let s = &self.sizes;
        let (b, t, c, h) = (s.batch, s.context, s.embd, s.heads);
        let d = c / h;
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?;
        let head = |i: usize| qkv.narrow(1, i * c, c)?.reshape_to([b, t, h, d])?.permute(&[0, 2, 1, 3]);
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let att = nn::scaled_dot_product_attention(&q, &k, &v, &nn::AttentionOptions::causal())?;
        let y = att.permute(&[0, 2, 1, 3])?.reshape_to([b * t, c])?;
        let x = x.add(&self.proj.forward(&y)?)?;
        let m = self.out.forward(&nn::gelu(&self.fc.forward(&self.ln2.forward(&x)?)?)?)?;
        x.add(&m)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![
            ("ln1".into(), &self.ln1),
            ("qkv".into(), &self.qkv),
            ("proj".into(), &self.proj),
            ("ln2".into(), &self.ln2),
            ("fc".into(), &self.fc),
            ("out".into(), &self.out),
        ]
    }
}

/// The GPT model: `forward(ids)` maps token ids (`[batch * context]`,
/// i32, sequence-major) to logits `[batch * context, vocab]`.
pub struct GptModel {
    sizes: GptSizes,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    lnf: LayerNorm,
}

impl GptModel {
    /// A model of `sizes` on `dev`, initialized from the device RNG.
    pub fn new(sizes: GptSizes, dev: &Device) -> Result<GptModel> {
        Ok(GptModel {
            sizes,
            wte: Embedding::new(sizes.vocab, sizes.embd, dev)?,
            wpe: Embedding::new(sizes.context, sizes.embd, dev)?,
            blocks: (0..sizes.layers).map(|_| Block::new(sizes, dev)).collect::<Result<_>>()?,
            lnf: LayerNorm::new(&[sizes.embd], dev)?,
        })
    }

    /// The sizes.
    pub fn sizes(&self) -> GptSizes {
        self.sizes
    }
}

impl Module for GptModel {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let s = &self.sizes;
        let (n, c) = (s.batch * s.context, s.embd);
        let tok = nn::one_hot(ids, s.vocab, DType::F32)?.matmul(&self.wte.weight)?;
        let mut x = tok.reshape_to([s.batch, s.context, c])?.add(&self.wpe.weight)?.reshape_to([n, c])?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        self.lnf.forward(&x)?.matmul(&self.wte.weight.t()?)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        let mut v: Vec<(String, &dyn Module)> = vec![("wte".into(), &self.wte), ("wpe".into(), &self.wpe)];
        v.extend(self.blocks.iter().enumerate().map(|(i, b)| (format!("blocks.{i}"), b as &dyn Module)));
        v.push(("lnf".into(), &self.lnf));
        v
    }
}

/// Where one training step's time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// The whole step, until the device finished.
    pub total: Duration,
    /// Host: recording the forward pass, backward and optimizer update.
    pub record: Duration,
    /// Host: `mark_step` (trace, hash, cache lookup or compile, submit).
    pub sync: Duration,
    /// The worker's execution of the step's plans (uploads, kernels,
    /// waiting for the device), from the `Execute` timer.
    pub device: Duration,
}

impl StepTimes {
    /// Host time: recording plus the sync.
    pub fn host(&self) -> Duration {
        self.record + self.sync
    }
}

/// The model, its AdamW optimizer and a fixed batch of token ids.
pub struct Gpt {
    /// The model.
    pub model: GptModel,
    opt: Adam,
    ids: Tensor,
    targets: Tensor,
    /// Autocast dtype of the forward pass and its loss scaler (enabled
    /// for f16, as the twin's `GradScaler(enabled=(dt == float16))`).
    amp: Option<(DType, GradScaler)>,
}

impl Gpt {
    /// The G8 step at `sizes` on `dev`: model, AdamW (lr 3e-4, weight
    /// decay 0.01) and deterministic token ids, all on the device.
    pub fn new(dev: &Device, sizes: GptSizes) -> Result<Gpt> {
        dev.manual_seed(8);
        let model = GptModel::new(sizes, dev)?;
        let opt = Adam::adamw(model.parameters(), 3e-4, 0.01);
        let (b, t, v) = (sizes.batch, sizes.context, sizes.vocab);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let tokens: Vec<i32> = (0..b * (t + 1))
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % v as u64) as i32
            })
            .collect();
        let ids: Vec<i32> = (0..b).flat_map(|i| tokens[i * (t + 1)..i * (t + 1) + t].to_vec()).collect();
        let targets: Vec<i32> = (0..b).flat_map(|i| tokens[i * (t + 1) + 1..(i + 1) * (t + 1)].to_vec()).collect();
        let ids = Tensor::from_slice(&ids, [b * t], dev)?;
        let targets = Tensor::from_slice(&targets, [b * t], dev)?;
        // Parameters and data on the device before any step.
        dev.mark_step()?;
        dev.wait()?;
        Ok(Gpt { model, opt, ids, targets, amp: None })
    }

    /// The same step with the forward pass and loss under
    /// [`lazuli::amp::autocast`] to `dtype` (a 16-bit float; `None`: f32),
    /// and for f16 a [`GradScaler`] with PyTorch's defaults (the G8
    /// autocast rows of `torch_twin.py --engines amp`).
    pub fn with_autocast(mut self, dtype: Option<DType>) -> Result<Gpt> {
        self.amp = match dtype {
            None => None,
            Some(d) => {
                let opts = GradScalerOptions { enabled: d == DType::F16, ..GradScalerOptions::default() };
                Some((d, GradScaler::with_options(self.ids.device(), opts)?))
            }
        };
        Ok(self)
    }

    /// The loss of the current parameters on the batch (lazy; recorded
    /// with gradient tracking), under autocast if the step has it.
    pub fn loss(&self) -> Result<Tensor> {
        let dtype = self.amp.as_ref().map(|(d, _)| *d);
        lazuli::amp::autocast(dtype, || nn::cross_entropy(&self.model.forward(&self.ids)?, &self.targets))
    }

    /// One training step: zero grads, forward, cross-entropy, backward,
    /// AdamW, `mark_step`, wait. Returns the loss (computed) and the times.
    pub fn step(&mut self) -> Result<(Tensor, StepTimes)> {
        let dev = self.ids.device().clone();
        let executed = || metrics::timer("Execute").map_or(0.0, |s| s.sum);
        let before = executed();
        let started = Instant::now();
        self.opt.zero_grad();
        let loss = self.loss()?;
        match &mut self.amp {
            None => {
                loss.backward()?;
                self.opt.step()?;
            }
            Some((_, scaler)) => {
                scaler.scale(&loss)?.backward()?;
                scaler.step(&mut self.opt)?;
                scaler.update()?;
            }
        }
        let recorded = Instant::now();
        dev.mark_step()?;
        let synced = Instant::now();
        dev.wait()?;
        let total = started.elapsed();
        let device = Duration::from_secs_f64(((executed() - before) * 1e-3).max(0.0));
        Ok((loss, StepTimes { total, record: recorded - started, sync: synced - recorded, device }))
    }
}
