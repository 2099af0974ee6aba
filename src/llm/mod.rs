//! Language-model inference: GGUF and Hugging Face checkpoints, weights
//! that stay quantized, a KV cache written in place, sampling on the
//! device, and a streaming generation API.
//!
//! ```no_run
//! # fn main() -> Result<(), lazuli::llm::LlmError> {
//! let model = lazuli::llm::Model::load("tiny-q4_0.gguf")?;
//! let out = model.generate_text("Once upon a time", &lazuli::llm::GenerateOptions::default(), |_| true)?;
//! println!("{}", out.text.unwrap_or_default());
//! # Ok(()) }
//! ```
//!
//! How it runs (see `model` for the graph of one step):
//! - **Checkpoints** (`gguf`, `Model::load`): a GGUF file is memory-mapped
//!   and checked (every offset and size against the file) before a byte
//!   of a tensor is read; a Hugging Face folder is `config.json` plus one
//!   or sharded `*.safetensors` (read through `crate::serialize`). The
//!   map is dropped once the weights are on the device.
//! - **Weights** (`weights`): F32 tensors become dense f32 matrices; Q8_0,
//!   Q4_0, Q5_0, Q4_K, Q6_K, F16 and BF16 stay in their blocks (`QTensor`),
//!   read by `Op::QuantMatMul`, which dequantizes inside the product. Any
//!   other type is an error naming the tensor and the type.
//! - **Phases**: prefill runs the prompt in chunks of `chunk` tokens (the
//!   last chunk padded to the same length, so every chunk is one plan);
//!   decoding runs one token per step. The position is a lifted scalar
//!   (one sequence) or a small data tensor (several), so every decoding
//!   step is the same graph: compiled once, then cache hits.
//! - **Sampling** (`sample`): inside the step's graph; only the ids cross
//!   to the host.

mod config;
pub mod gguf;
mod model;
mod sample;
mod tokenizer;
mod weights;

pub use config::{Arch, Config, RopeScaling, RopeStyle};
pub use model::KvCache;
pub use sample::Sampling;
pub use tokenizer::Tokenizer;
pub use weights::{quantize, QTensor, Weight};

use crate::ir::QuantFormat;
use crate::{DType, Device, DeviceExt, ExecError, ScalarValue, Tensor};
use gguf::{GgufError, GgufFile};
use model::{Names, Source, Step, Weights};
use std::path::{Path, PathBuf};

/// What can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The GGUF file is malformed or lacks what the model needs.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A safetensors checkpoint could not be read.
    #[error(transparent)]
    Safetensors(Box<crate::serialize::SerializeError>),
    /// An architecture the loader does not build.
    #[error("unsupported architecture {0:?} (llama, mistral, qwen2 and gpt2 are supported)")]
    Architecture(String),
    /// A tensor of a type the engine does not run.
    #[error("tensor {name}: type {ty} is not supported (f32, f16, bf16, q8_0, q4_0, q5_0, q4_K and q6_K are)")]
    TensorType {
        /// The tensor.
        name: String,
        /// Its type.
        ty: String,
    },
    /// A tensor missing or of the wrong shape.
    #[error("tensor {name}: {detail}")]
    Shape {
        /// The tensor.
        name: String,
        /// What is wrong.
        detail: String,
    },
    /// A tensor could not be made on the device.
    #[error("tensor {name}: {source}")]
    Tensor {
        /// The tensor.
        name: String,
        /// The cause.
        #[source]
        source: Box<ExecError>,
    },
    /// Bad hyperparameters.
    #[error("model configuration: {0}")]
    Config(String),
    /// The tokenizer could not be loaded or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request the model cannot serve (a prompt beyond the context ...).
    #[error("{0}")]
    Request(String),
    /// The engine failed while running the model.
    #[error(transparent)]
    Exec(Box<ExecError>),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl From<ExecError> for LlmError {
    fn from(e: ExecError) -> LlmError {
        LlmError::Exec(Box::new(e))
    }
}

impl From<crate::serialize::SerializeError> for LlmError {
    fn from(e: crate::serialize::SerializeError) -> LlmError {
        LlmError::Safetensors(Box::new(e))
    }
}

/// A language model on a device.
#[derive(Debug)]
pub struct Model {
    config: Config,
    weights: Weights,
    tokenizer: Option<Tokenizer>,
    device: Device,
    file_bytes: usize,
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// The seed of the draws.
    pub seed: u64,
    /// Positions the cache holds (default: prompt + max_tokens, at most
    /// the model's context).
    pub context: Option<usize>,
    /// Prompt tokens per prefill step.
    pub chunk: usize,
    /// Stop at the end-of-sequence token.
    pub stop_at_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> GenerateOptions {
        GenerateOptions {
            max_tokens: 32,
            sampling: Sampling::default(),
            seed: 0,
            context: None,
            chunk: 64,
            stop_at_eos: true,
        }
    }
}

/// The result of one generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The prompt's ids.
    pub prompt_ids: Vec<u32>,
    /// The generated ids (per sequence for a batch).
    pub generated_ids: Vec<u32>,
    /// The generated text, where the model has a tokenizer.
    pub text: Option<String>,
    /// Seconds spent on the prompt (prefill, to the first token).
    pub prompt_seconds: f64,
    /// Seconds spent decoding the tokens after the first.
    pub decode_seconds: f64,
    /// Prompt tokens per second.
    pub prompt_tps: f64,
    /// Generated tokens per second (after the first).
    pub decode_tps: f64,
    /// Bytes of the weights on the device.
    pub weights_bytes: usize,
    /// Bytes of the KV cache.
    pub kv_bytes: usize,
    /// Plans compiled by the decoding steps after the first one (which
    /// compiles the decoding plan): 0 is the promise.
    pub decode_compiles: u64,
}

impl Model {
    /// Loads a GGUF file, or a Hugging Face folder (`config.json`,
    /// `*.safetensors`, `tokenizer.json`) onto the default device.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, LlmError> {
        Model::load_on(path, &Device::default())
    }

    /// [`Model::load`] onto `device`.
    pub fn load_on(path: impl AsRef<Path>, device: &Device) -> Result<Model, LlmError> {
        let path = path.as_ref();
        if path.is_dir() {
            return Model::load_hf(path, device);
        }
        let f = GgufFile::open(path)?;
        let mut config = Config::from_gguf(&f)?;
        if let Some(t) = f.tensor("rope_freqs.weight") {
            let v = GgufSource(&f).floats("rope_freqs.weight", &[config.rope_dim / 2])?;
            let _ = t;
            config.rope_scaling = RopeScaling::Factors(v);
        }
        let tokenizer = Tokenizer::from_gguf(&f)?;
        if let Some(t) = &tokenizer {
            if t.vocab_size() != config.vocab {
                return Err(LlmError::Tokenizer(format!(
                    "the vocabulary has {} tokens but the embedding {} rows",
                    t.vocab_size(),
                    config.vocab
                )));
            }
        }
        let names = Names {
            embed: "token_embd.weight",
            pos_embed: "position_embd.weight",
            out_norm: "output_norm",
            output: "output.weight",
            block: |i, part, suffix| format!("blk.{i}.{part}.{suffix}"),
        };
        let weights = model::build(&config, &GgufSource(&f), &names, device)?;
        let file_bytes = f.file_bytes();
        Ok(Model { config, weights, tokenizer, device: device.clone(), file_bytes })
    }

    fn load_hf(dir: &Path, device: &Device) -> Result<Model, LlmError> {
        let io = |path: &Path| {
            let p = path.to_path_buf();
            move |source| LlmError::Io { path: p, source }
        };
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LlmError::Config(format!("{}: {e}", cfg_path.display())))?;
        let config = Config::from_hf(&json)?;
        let index = dir.join("model.safetensors.index.json");
        let weights_path = if index.exists() { index } else { dir.join("model.safetensors") };
        let archive = crate::serialize::Archive::open(&weights_path)?;
        let tk_path = dir.join("tokenizer.json");
        #[cfg(not(target_arch = "wasm32"))]
        let tokenizer = if tk_path.exists() { Some(Tokenizer::from_json_file(&tk_path)?) } else { None };
        #[cfg(target_arch = "wasm32")]
        let tokenizer: Option<Tokenizer> = {
            let _ = tk_path;
            None
        };
        if let Some(t) = &tokenizer {
            if t.vocab_size() > config.vocab {
                return Err(LlmError::Tokenizer(format!(
                    "the vocabulary has {} tokens but the embedding {} rows",
                    t.vocab_size(),
                    config.vocab
                )));
            }
        }
        let gpt2 = config.arch == Arch::Gpt2;
        let names = if gpt2 {
            Names {
                embed: "transformer.wte.weight",
                pos_embed: "transformer.wpe.weight",
                out_norm: "transformer.ln_f",
                output: "lm_head.weight",
                block: hf_gpt2_name,
            }
        } else {
            Names {
                embed: "model.embed_tokens.weight",
                pos_embed: "",
                out_norm: "model.norm",
                output: "lm_head.weight",
                block: hf_llama_name,
            }
        };
        let src = HfSource { archive: &archive, gpt2 };
        let weights = model::build(&config, &src, &names, device)?;
        let file_bytes = archive.stored_bytes();
        Ok(Model { config, weights, tokenizer, device: device.clone(), file_bytes })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The tokenizer, where the checkpoint has one.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of the weights on the device (quantized weights at their
    /// quantized size).
    pub fn weights_bytes(&self) -> usize {
        self.weights.storage_bytes()
    }

    /// Bytes of the checkpoint file(s).
    pub fn file_bytes(&self) -> usize {
        self.file_bytes
    }

    /// The logits of every position of `tokens` (one sequence, a full
    /// recompute through a fresh cache): `[tokens.len() * vocab]`,
    /// row-major.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>, LlmError> {
        let n = tokens.len();
        self.check_prompt(n, n)?;
        let cache = KvCache::new(&self.config, 1, n, &self.device)?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let tok = Tensor::from_slice(&ids, [1, n], &self.device)?;
        let pos = Tensor::lifted_scalar(ScalarValue::from(0i32), DType::I32, &self.device);
        let rope = self.rope(n)?;
        let logits = model::forward(
            &self.config,
            &self.weights,
            rope.as_ref(),
            &cache,
            &Step { tokens: &tok, pos: &pos, last: None },
        )?;
        Ok(logits.to_vec::<f32>()?)
    }

    fn rope(&self, positions: usize) -> Result<Option<model::Rope>, LlmError> {
        Ok(if self.config.arch == Arch::Gpt2 {
            None
        } else {
            Some(model::Rope::new(&self.config, positions, &self.device)?)
        })
    }

    fn check_prompt(&self, prompt: usize, context: usize) -> Result<(), LlmError> {
        if prompt == 0 {
            return Err(LlmError::Request("the prompt is empty".into()));
        }
        if context > self.config.max_context {
            return Err(LlmError::Request(format!(
                "{context} positions exceed the model's context of {}",
                self.config.max_context
            )));
        }
        if prompt > context {
            return Err(LlmError::Request(format!("a prompt of {prompt} tokens does not fit a context of {context}")));
        }
        Ok(())
    }

    /// Generates from `prompt` ids, calling `on_token` with each new id as
    /// it is chosen (return false to stop).
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, LlmError> {
        let mut out = self.generate_batch(&[prompt.to_vec()], opts, |_, t| on_token(t))?;
        Ok(out.remove(0))
    }

    /// Tokenizes `text`, generates, and decodes the result.
    pub fn generate_text(
        &self,
        text: &str,
        opts: &GenerateOptions,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, LlmError> {
        let tk = self.tokenizer.as_ref().ok_or_else(|| LlmError::Tokenizer("the model has no tokenizer".into()))?;
        let ids = tk.encode(text)?;
        self.generate(&ids, opts, on_token)
    }

    /// Generates from several prompts at once, one batch (`on_token`
    /// gets the sequence index and its new id). Sequences run in
    /// lockstep; one that has finished (its end-of-sequence token, or
    /// `on_token` returned false) stops collecting tokens.
    pub fn generate_batch(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Generation>, LlmError> {
        let b = prompts.len();
        if b == 0 {
            return Ok(Vec::new());
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let shortest = prompts.iter().map(Vec::len).min().unwrap_or(0);
        let chunk = opts.chunk.max(1);
        let context = opts.context.unwrap_or((longest + opts.max_tokens).min(self.config.max_context));
        self.check_prompt(shortest.min(longest), context)?;
        self.check_prompt(longest, context)?;
        for p in prompts {
            if let Some(&bad) = p.iter().find(|&&t| t as usize >= self.config.vocab) {
                return Err(LlmError::Request(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.config.vocab
                )));
            }
        }
        let dev = &self.device;
        let cache = KvCache::new(&self.config, b, context, dev)?;
        let rope = self.rope(context)?;
        let mut state = sample::SamplerState::new(b, self.config.vocab, opts.seed, dev)?;
        let started = crate::platform::Instant::now();
        // Prompts mark their tokens seen (repetition penalty).
        if opts.sampling.repetition_penalty != 1.0 {
            for (r, p) in prompts.iter().enumerate() {
                let ids: Vec<i32> = p.iter().map(|&t| t as i32).collect();
                let mut onehot = vec![0f32; self.config.vocab];
                for &t in &ids {
                    onehot[t as usize] = 1.0;
                }
                let row = Tensor::from_slice(&onehot, [1, self.config.vocab], dev)?;
                let mask = Tensor::iota([b, 1], 0, DType::I32, dev)?.eq_scalar(r as i32)?.cast(DType::F32)?;
                state.seen.assign(&state.seen.maximum(&row.mul(&mask)?)?)?;
            }
        }
        // Prefill: all rows in lockstep chunks from position 0; rows past
        // their prompt process padding whose cache entries later steps
        // overwrite before anything reads them.
        let mut first: Option<Tensor> = None;
        let mut at = 0;
        while at < longest {
            let len = chunk.min(longest - at);
            // Pad to the chunk size where the cache has room: one plan for
            // every chunk.
            let t = if at + chunk <= context { chunk } else { len };
            let mut ids = vec![0i32; b * t];
            let mut last = vec![0i32; b];
            for (r, p) in prompts.iter().enumerate() {
                for j in 0..t {
                    ids[r * t + j] = p.get(at + j).map_or(0, |&x| x as i32);
                }
                // The row's last prompt token if it lies in this chunk.
                last[r] = (p.len().saturating_sub(1).clamp(at, at + len - 1) - at) as i32;
            }
            let tok = Tensor::from_slice(&ids, [b, t], dev)?;
            let lastt = Tensor::from_slice(&last, [b], dev)?;
            let pos = Tensor::lifted_scalar(ScalarValue::from(at as i32), DType::I32, dev);
            let logits = model::forward(
                &self.config,
                &self.weights,
                rope.as_ref(),
                &cache,
                &Step { tokens: &tok, pos: &pos, last: Some(&lastt) },
            )?;
            // Each row's logits come from the chunk holding its last token.
            first = Some(match first {
                None => logits,
                Some(prev) => {
                    let here: Vec<f32> =
                        prompts.iter().map(|p| if p.len() > at && p.len() <= at + len { 1.0 } else { 0.0 }).collect();
                    let m = Tensor::from_slice(&here, [b, 1], dev)?;
                    Tensor::where_(&m.gt_scalar(0.0f32)?, &logits, &prev)?
                }
            });
            let mut roots: Vec<&Tensor> = cache.tensors().collect();
            let f = first.as_ref().expect("set above");
            roots.push(f);
            crate::sync(&roots)?;
            at += len;
        }
        let logits = first.expect("a non-empty prompt");
        let mut ids_t = sample::sample(&logits, &opts.sampling, &mut state)?;
        let mut pos: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let mut outs: Vec<Vec<u32>> = vec![Vec::new(); b];
        let mut done = vec![false; b];
        let mut prompt_seconds = 0.0;
        let mut decode_started = started;
        let mut compiles_at_first = 0;
        for step in 0..opts.max_tokens {
            let mut roots: Vec<&Tensor> = cache.tensors().collect();
            roots.push(&ids_t);
            roots.push(&state.seen);
            crate::sync(&roots)?;
            let ids = ids_t.to_vec::<i32>()?;
            if step == 0 {
                prompt_seconds = started.elapsed().as_secs_f64();
                decode_started = crate::platform::Instant::now();
            }
            // The first decoding step compiles the decoding plan; every
            // later one must find it.
            if step <= 1 {
                compiles_at_first = dev.compile_counts().0;
            }
            for r in 0..b {
                if done[r] {
                    continue;
                }
                let id = ids[r] as u32;
                outs[r].push(id);
                let eos = opts.stop_at_eos && self.tokenizer.as_ref().and_then(|t| t.eos) == Some(id);
                if eos || !on_token(r, id) || pos[r] + 1 >= context {
                    done[r] = true;
                }
            }
            if done.iter().all(|&d| d) || step + 1 == opts.max_tokens {
                break;
            }
            // One decoding step: each row's token at its position.
            let tok = Tensor::from_slice(&ids, [b, 1], dev)?;
            let post = if b == 1 {
                Tensor::lifted_scalar(ScalarValue::from(pos[0] as i32), DType::I32, dev)
            } else {
                let p: Vec<i32> = pos.iter().map(|&p| p.min(context - 1) as i32).collect();
                Tensor::from_slice(&p, [b], dev)?
            };
            let zero = Tensor::from_slice(&vec![0i32; b], [b], dev)?;
            let logits = model::forward(
                &self.config,
                &self.weights,
                rope.as_ref(),
                &cache,
                &Step { tokens: &tok, pos: &post, last: Some(&zero) },
            )?;
            ids_t = sample::sample(&logits, &opts.sampling, &mut state)?;
            for p in pos.iter_mut() {
                *p += 1;
            }
        }
        let decode_seconds = decode_started.elapsed().as_secs_f64();
        let decode_compiles = dev.compile_counts().0 - compiles_at_first;
        let kv_bytes = cache.storage_bytes();
        let weights_bytes = self.weights_bytes();
        let mut gens = Vec::new();
        for (r, ids) in outs.into_iter().enumerate() {
            let text = match &self.tokenizer {
                Some(t) => Some(t.decode(&ids)?),
                None => None,
            };
            let decoded = ids.len().saturating_sub(1);
            gens.push(Generation {
                prompt_ids: prompts[r].clone(),
                generated_ids: ids,
                text,
                prompt_seconds,
                decode_seconds,
                prompt_tps: prompts[r].len() as f64 / prompt_seconds.max(1e-9),
                decode_tps: decoded as f64 / decode_seconds.max(1e-9),
                weights_bytes,
                kv_bytes,
                decode_compiles,
            });
        }
        Ok(gens)
    }
}

/// Hugging Face Llama/Qwen2 names of block `i`'s parts.
fn hf_llama_name(i: usize, part: &str, suffix: &str) -> String {
    let p = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{i}.{p}.{suffix}")
}

/// Hugging Face GPT-2 names of block `i`'s parts.
fn hf_gpt2_name(i: usize, part: &str, suffix: &str) -> String {
    let p = match part {
        "attn_norm" => "ln_1",
        "ffn_norm" => "ln_2",
        "attn_qkv" => "attn.c_attn",
        "attn_output" => "attn.c_proj",
        "ffn_up" => "mlp.c_fc",
        "ffn_down" => "mlp.c_proj",
        other => other,
    };
    format!("transformer.h.{i}.{p}.{suffix}")
}

/// Tensors of a GGUF file.
struct GgufSource<'a>(&'a GgufFile);

impl GgufSource<'_> {
    /// An F32 or F16 tensor of `dims` as f32 values.
    fn floats(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, LlmError> {
        let t = self.0.tensor(name).ok_or_else(|| LlmError::Shape { name: name.into(), detail: "missing".into() })?;
        if t.dims() != dims {
            return Err(LlmError::Shape {
                name: name.into(),
                detail: format!("dims {:?}, expected {dims:?}", t.dims()),
            });
        }
        let data = self.0.data(t);
        match t.ty.id {
            0 => Ok(data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            _ => match t.ty.quant_format() {
                Some(f) => {
                    let mut out = vec![0f32; t.numel()];
                    f.dequantize_row(data, &mut out);
                    Ok(out)
                }
                None => Err(LlmError::TensorType { name: name.into(), ty: t.ty.name.into() }),
            },
        }
    }
}

impl Source for GgufSource<'_> {
    fn matrix(&self, name: &str, dims: [usize; 2], device: &Device) -> Result<Weight, LlmError> {
        let t = self.0.tensor(name).ok_or_else(|| LlmError::Shape { name: name.into(), detail: "missing".into() })?;
        if t.dims() != dims {
            return Err(LlmError::Shape {
                name: name.into(),
                detail: format!("dims {:?}, expected {dims:?}", t.dims()),
            });
        }
        let format = match t.ty.id {
            0 => None,
            _ => Some(
                t.ty.quant_format().ok_or_else(|| LlmError::TensorType { name: name.into(), ty: t.ty.name.into() })?,
            ),
        };
        let bytes = self.0.read(t).map_err(|source| LlmError::Io { path: name.into(), source })?;
        model::matrix_from(name, format, bytes, dims, device)
    }

    fn vector(&self, name: &str, dims: &[usize], device: &Device) -> Result<Tensor, LlmError> {
        let v = self.floats(name, dims)?;
        Tensor::from_slice(&v, dims.to_vec(), device)
            .map_err(|e| LlmError::Tensor { name: name.into(), source: Box::new(e) })
    }

    fn has(&self, name: &str) -> bool {
        self.0.tensor(name).is_some()
    }
}

/// Tensors of a safetensors checkpoint (Hugging Face names and layouts).
struct HfSource<'a> {
    archive: &'a crate::serialize::Archive,
    /// GPT-2 stores its projections as `Conv1D`, `[in, out]`.
    gpt2: bool,
}

impl HfSource<'_> {
    fn raw(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), LlmError> {
        Ok(self.archive.raw(name)?)
    }
}

impl Source for HfSource<'_> {
    fn matrix(&self, name: &str, dims: [usize; 2], device: &Device) -> Result<Weight, LlmError> {
        let (dtype, shape, data) = self.raw(name)?;
        let conv1d = self.gpt2 && !name.ends_with("wte.weight") && !name.starts_with("lm_head");
        let want = if conv1d { vec![dims[1], dims[0]] } else { dims.to_vec() };
        if shape != want {
            return Err(LlmError::Shape { name: name.into(), detail: format!("shape {shape:?}, expected {want:?}") });
        }
        if conv1d {
            // `[in, out]`: transposed once here into f32 `[out, in]`.
            let v = to_f32(name, dtype, data)?;
            let mut t = vec![0f32; v.len()];
            for i in 0..dims[1] {
                for o in 0..dims[0] {
                    t[o * dims[1] + i] = v[i * dims[0] + o];
                }
            }
            return Weight::dense(&t, dims[0], dims[1], device)
                .map_err(|e| LlmError::Tensor { name: name.into(), source: Box::new(e) });
        }
        let format = match dtype {
            DType::F32 => None,
            DType::F16 => Some(QuantFormat::F16),
            DType::BF16 => Some(QuantFormat::BF16),
            other => return Err(LlmError::TensorType { name: name.into(), ty: other.name().into() }),
        };
        model::matrix_from(name, format, data.to_vec(), dims, device)
    }

    fn vector(&self, name: &str, dims: &[usize], device: &Device) -> Result<Tensor, LlmError> {
        let (dtype, shape, data) = self.raw(name)?;
        if shape != dims {
            return Err(LlmError::Shape { name: name.into(), detail: format!("shape {shape:?}, expected {dims:?}") });
        }
        let v = to_f32(name, dtype, data)?;
        Tensor::from_slice(&v, dims.to_vec(), device)
            .map_err(|e| LlmError::Tensor { name: name.into(), source: Box::new(e) })
    }

    fn has(&self, name: &str) -> bool {
        self.archive.raw(name).is_ok()
    }
}

/// Little-endian f32, f16 or bf16 bytes as f32 values.
fn to_f32(name: &str, dtype: DType, data: &[u8]) -> Result<Vec<f32>, LlmError> {
    let format = match dtype {
        DType::F32 => {
            return Ok(data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
        }
        DType::F16 => QuantFormat::F16,
        DType::BF16 => QuantFormat::BF16,
        other => return Err(LlmError::TensorType { name: name.into(), ty: other.name().into() }),
    };
    let mut out = vec![0f32; data.len() / 2];
    format.dequantize_row(data, &mut out);
    Ok(out)
}

/// The CPU device, for callers that name it.
pub fn cpu() -> Device {
    Device::cpu()
}
