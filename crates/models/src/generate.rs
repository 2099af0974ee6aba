//! Greedy generation with a small GPT built from [`lazuli::nn`]: the
//! workload of sizes that change every step.
//!
//! Two programs produce the same tokens. *Growing* feeds the context as it
//! is (lengths 1..=`context`, then the last `context` tokens) and picks the
//! last position with `narrow_at`, whose start is run-time data: every
//! length is a new graph (the start alone would not be). *Fixed* feeds a zero-padded window of `context`
//! tokens and picks the last position with a one-hot row mask: one graph
//! for the whole run. [`run`] measures either, with the compile counters,
//! so the cost of new sizes is visible (`lazuli generate`).

use lazuli::nn;
use lazuli::platform::Instant;
use lazuli::{metrics, DType, Device, Result, Tensor};
use std::time::Duration;

/// Model and run sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Embedding width.
    pub embd: usize,
    /// Attention heads (`embd` must be a multiple).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Longest context (the fixed window).
    pub context: usize,
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Seed of the weights and the prompt.
    pub seed: u64,
}

impl Default for GenConfig {
    /// The workload: 200 tokens from a 12-token prompt, context up
    /// to 64, a 2-layer GPT of width 64.
    fn default() -> Self {
        GenConfig { vocab: 64, embd: 64, heads: 4, layers: 2, context: 64, prompt: 12, tokens: 200, seed: 1 }
    }
}

/// How the context is fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The context as it is: a new length (and graph) every step until it
    /// reaches the window.
    Growing,
    /// A zero-padded window of fixed length: one graph.
    Fixed,
}

/// What a run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct GenReport {
    /// The context feeding.
    pub window: Window,
    /// The generated tokens.
    pub tokens: Vec<i32>,
    /// Wall time of the whole run (first step included).
    pub total: Duration,
    /// Wall time of the first step (compiles included).
    pub first: Duration,
    /// Median wall time of a step once the context is full (the same
    /// sizes every step: no compile; `None` if no step got there).
    pub steady: Option<Duration>,
    /// The same over the second half of those steps: after a recurring
    /// size got its static kernels, where it does (see
    /// `lazuli_wgpu::tier`).
    pub steady_late: Option<Duration>,
    /// Generic kernels replaced by static ones for a recurring size
    /// (`SpecializedKernels`).
    pub specialized: u64,
    /// Plans compiled on the steps' path (compile-cache misses).
    pub plans: u64,
    /// Size variants compiled ahead of time that a step then used
    /// (`AheadHits`, see `LAZULI_COMPILE_AHEAD`).
    pub compiled_ahead: u64,
    /// Of those, new structures (`UncachedCompile`); the rest are size
    /// variants of a structure compiled before (`SizeVariantCompile`).
    pub structures: u64,
    /// Host time of the size-variant compiles, in all.
    pub variant_compile: Duration,
    /// Median host time of one size variant that created no pipeline
    /// (what a new size costs once its kernels' families are generic;
    /// `None` if there was none).
    pub variant_median: Option<Duration>,
    /// Compiled plans that created pipelines (new kernel code).
    pub plans_with_new_code: u64,
    /// Pipelines created.
    pub pipelines: u64,
    /// Kernels run through a generic pipeline with their own sizes.
    pub generic_reuse: u64,
    /// Kernels a size variant kept from the plan of its structure before
    /// it, as compiled, lowering nothing for them (`KernelsKept`).
    pub kept: u64,
}

impl GenReport {
    /// One JSON object: the device, the window and every measure.
    pub fn to_json(&self, device: &str) -> String {
        format!(
            "{{\"device\": {device:?}, \"window\": \"{:?}\", \"tokens\": {}, \"total_ms\": {:.1}, \"first_step_ms\": {:.1}, \"steady_step_ms\": {}, \"steady_late_step_ms\": {}, \"specialized_kernels\": {}, \"plans_compiled\": {}, \"plans_compiled_ahead\": {}, \"structures_compiled\": {}, \"size_variant_compile_ms\": {:.1}, \"size_variant_median_ms\": {}, \"plans_with_new_code\": {}, \"pipelines_created\": {}, \"generic_kernel_reuse\": {}, \"kernels_kept\": {}}}",
            self.window,
            self.tokens.len(),
            self.total.as_secs_f64() * 1e3,
            self.first.as_secs_f64() * 1e3,
            self.steady.map_or("null".to_string(), |d| format!("{:.2}", d.as_secs_f64() * 1e3)),
            self.steady_late.map_or("null".to_string(), |d| format!("{:.2}", d.as_secs_f64() * 1e3)),
            self.specialized,
            self.plans,
            self.compiled_ahead,
            self.structures,
            self.variant_compile.as_secs_f64() * 1e3,
            self.variant_median.map_or("null".to_string(), |d| format!("{:.3}", d.as_secs_f64() * 1e3)),
            self.plans_with_new_code,
            self.pipelines,
            self.generic_reuse,
            self.kept
        )
    }

    /// One line of text with the same measures.
    pub fn summary(&self, device: &str) -> String {
        format!(
            "{:?} window on {device}: {} tokens in {:.1} ms (first step {:.1} ms, steady step {}, {} in the second half, {} kernels specialized); {} plans compiled on the path and {} ahead ({} structures, size variants {:.1} ms of host time, {} each at the median once their kernels are generic), {} with new kernel code, {} pipelines created, {} kernels reused generic pipelines, {} kept as compiled",
            self.window,
            self.tokens.len(),
            self.total.as_secs_f64() * 1e3,
            self.first.as_secs_f64() * 1e3,
            self.steady.map_or("-".to_string(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3)),
            self.steady_late.map_or("-".to_string(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3)),
            self.specialized,
            self.plans,
            self.compiled_ahead,
            self.structures,
            self.variant_compile.as_secs_f64() * 1e3,
            self.variant_median.map_or("-".to_string(), |d| format!("{:.2} ms", d.as_secs_f64() * 1e3)),
            self.plans_with_new_code,
            self.pipelines,
            self.generic_reuse,
            self.kept
        )
    }
}

struct Block {
    ln1: (Tensor, Tensor),
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: (Tensor, Tensor),
    fc: nn::Linear,
    fc2: nn::Linear,
}

/// A small GPT (pre-LayerNorm blocks, causal self-attention, GELU MLP,
/// lm_head tied to the token embedding) with deterministic weights.
pub struct Gpt {
    cfg: GenConfig,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
}

/// Deterministic values in `[-scale, scale)`.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            scale * (2.0 * ((s >> 40) as f32 / (1u64 << 24) as f32) - 1.0)
        })
        .collect()
}

impl Gpt {
    /// The model of `cfg` on `device` (the same weights on every device).
    pub fn new(cfg: GenConfig, device: &Device) -> Result<Gpt> {
        let mut seed = cfg.seed.wrapping_mul(1000);
        let mut tensor = |dims: &[usize], scale: f32| {
            seed += 1;
            Tensor::from_slice(&values(dims.iter().product(), seed, scale), dims, device)
        };
        let c = cfg.embd;
        let norm = |device: &Device| -> Result<(Tensor, Tensor)> {
            Ok((Tensor::full([c], 1.0, DType::F32, device)?, Tensor::full([c], 0.0, DType::F32, device)?))
        };
        let mut linear = |i: usize, o: usize| -> Result<nn::Linear> {
            let bound = 1.0 / (i as f32).sqrt();
            Ok(nn::Linear { weight: tensor(&[o, i], bound)?, bias: Some(tensor(&[o], bound)?) })
        };
        let mut blocks = Vec::new();
        for _ in 0..cfg.layers {
            blocks.push(Block {
                ln1: norm(device)?,
                qkv: linear(c, 3 * c)?,
                proj: linear(c, c)?,
                ln2: norm(device)?,
                fc: linear(c, 4 * c)?,
                fc2: linear(4 * c, c)?,
            });
        }
        Ok(Gpt {
            cfg,
            wte: tensor(&[cfg.vocab, c], 0.5)?,
            wpe: tensor(&[cfg.context, c], 0.5)?,
            blocks,
            ln_f: norm(device)?,
        })
    }

    /// Logits `[T, vocab]` of the `T` tokens of `tokens` (an i32 tensor).
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        use nn::Module as _;
        let (c, h) = (self.cfg.embd, self.cfg.heads);
        let d = c / h;
        let t = tokens.dims()[0];
        let dev = tokens.device();
        let mut x =
            nn::one_hot(tokens, self.cfg.vocab, DType::F32)?.matmul(&self.wte)?.add(&self.wpe.narrow(0, 0, t)?)?;
        let rows = Tensor::iota([t, t], 0, DType::I32, dev)?;
        let cols = Tensor::iota([t, t], 1, DType::I32, dev)?;
        let future = cols.gt(&rows)?;
        let minus_inf = Tensor::full([1usize], -1e9, DType::F32, dev)?;
        for b in &self.blocks {
            let a = nn::layer_norm(&x, 1, Some(&b.ln1.0), Some(&b.ln1.1), 1e-5)?;
            let qkv = b.qkv.forward(&a)?;
            let heads = |k: usize| -> Result<Tensor> {
                qkv.narrow(1, k * c, c)?.reshape([t as isize, h as isize, d as isize])?.transpose(0, 1)
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            let scores =
                q.matmul(&k.transpose(1, 2)?)?.mul(&Tensor::scalar(1.0 / (d as f64).sqrt(), DType::F32, dev))?;
            let att = future.where_(&minus_inf, &scores)?.softmax(-1)?;
            let y = att.matmul(&v)?.transpose(0, 1)?.reshape([t as isize, c as isize])?;
            x = x.add(&b.proj.forward(&y)?)?;
            let m = nn::layer_norm(&x, 1, Some(&b.ln2.0), Some(&b.ln2.1), 1e-5)?;
            x = x.add(&b.fc2.forward(&nn::gelu(&b.fc.forward(&m)?)?)?)?;
        }
        let x = nn::layer_norm(&x, 1, Some(&self.ln_f.0), Some(&self.ln_f.1), 1e-5)?;
        x.matmul(&self.wte.t()?)
    }

    /// The greedy next token after `context` (at most `cfg.context` tokens).
    pub fn next_token(&self, context: &[i32], window: Window, device: &Device) -> Result<i32> {
        let n = context.len();
        match window {
            Window::Growing => {
                let tokens = Tensor::from_slice(context, [n], device)?;
                self.logits(&tokens)?.narrow_at(0, n - 1, 1)?.argmax(-1, false)?.to_vec::<i32>().map(|v| v[0])
            }
            Window::Fixed => {
                let w = self.cfg.context;
                let mut padded = context.to_vec();
                padded.resize(w, 0);
                let tokens = Tensor::from_slice(&padded, [w], device)?;
                // The last real position as data, not as a graph constant.
                let last = Tensor::from_slice(&[n as i32 - 1], [1usize], device)?;
                let pick = Tensor::iota([w, 1], 0, DType::I32, device)?.eq(&last)?.cast(DType::F32)?;
                self.logits(&tokens)?.mul(&pick)?.sum(&[0], false)?.argmax(-1, false)?.item::<i32>()
            }
        }
    }
}

/// Runs greedy generation of `cfg.tokens` tokens with `window` on
/// `device`, counting compiles and pipelines (process-wide counters: run
/// one measurement at a time).
pub fn run(cfg: GenConfig, window: Window, device: &Device) -> Result<GenReport> {
    let gpt = Gpt::new(cfg, device)?;
    let mut tokens: Vec<i32> = values(cfg.prompt, cfg.seed + 7, 1.0)
        .into_iter()
        .map(|v| ((v + 1.0) * 0.5 * cfg.vocab as f32) as i32 % cfg.vocab as i32)
        .collect();
    let counters = || {
        (
            metrics::counter("UncachedCompile"),
            metrics::counter("SizeVariantCompile"),
            metrics::counter("PipelinesCreated"),
            metrics::counter("GenericKernelReuse"),
            metrics::timer("SizeVariantCompile").map_or(0.0, |t| t.sum),
        )
    };
    let specialized0 = metrics::counter("SpecializedKernels");
    let ahead0 = metrics::counter("AheadHits");
    let kept0 = metrics::counter("KernelsKept");
    let (structures0, variants0, pipes0, reuse0, variant_ms0) = counters();
    let mut plans_with_new_code = 0;
    let started = Instant::now();
    let mut first = Duration::ZERO;
    let mut full = Vec::new();
    let mut variant_costs = Vec::new();
    for step in 0..cfg.tokens {
        let (structures_before, variants_before, pipes, _, variant_ms_before) = counters();
        let from = tokens.len().saturating_sub(cfg.context);
        let step_started = Instant::now();
        let next = gpt.next_token(&tokens[from..], window, device)?;
        if tokens.len() - from == cfg.context {
            full.push(step_started.elapsed());
        }
        tokens.push(next);
        let (structures_after, variants_after, pipes_after, _, variant_ms_after) = counters();
        // Pipelines made by this step's compile, not by the background
        // compile of a recurring size's static kernels.
        let compiled = structures_after > structures_before || variants_after > variants_before;
        if compiled && pipes_after > pipes {
            plans_with_new_code += 1;
        } else if variants_after > variants_before {
            variant_costs.push(Duration::from_secs_f64((variant_ms_after - variant_ms_before).max(0.0) / 1e3));
        }
        if step == 0 {
            first = started.elapsed();
        }
    }
    let total = started.elapsed();
    let (structures, variants, pipes, reuse, variant_ms) = counters();
    let mut late = full.split_off(full.len() / 2);
    late.sort();
    full.extend_from_slice(&late);
    full.sort();
    variant_costs.sort();
    Ok(GenReport {
        window,
        tokens: tokens[cfg.prompt..].to_vec(),
        total,
        first,
        steady: full.get(full.len() / 2).copied(),
        steady_late: late.get(late.len() / 2).copied(),
        specialized: metrics::counter("SpecializedKernels") - specialized0,
        plans: structures - structures0 + variants - variants0,
        compiled_ahead: metrics::counter("AheadHits") - ahead0,
        structures: structures - structures0,
        variant_compile: Duration::from_secs_f64((variant_ms - variant_ms0).max(0.0) / 1e3),
        variant_median: variant_costs.get(variant_costs.len() / 2).copied(),
        plans_with_new_code,
        pipelines: pipes - pipes0,
        generic_reuse: reuse - reuse0,
        kept: metrics::counter("KernelsKept") - kept0,
    })
}
