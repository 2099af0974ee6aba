//! The decoders: Llama (and Mistral), Qwen2 and GPT-2 built from a
//! checkpoint's tensors, and their forward pass over a [`KvCache`].
//!
//! One forward pass takes `t` new tokens of each of `b` sequences at
//! positions `pos` (a lifted rank-0 scalar, or one position per sequence),
//! writes their keys and values into the cache at those positions
//! (`Op::WriteAt`, in place) and attends over each query's valid prefix
//! (`Op::PrefixAttention`). Positions are data, so a decoding step at
//! position 1 and at position 1000 is the same graph: one plan, compiled
//! once. RMSNorm and LayerNorm come from `lazuli::nn`; RoPE reads `cos`
//! and `sin` rows of tables computed once on the host (f64, rounded once)
//! by position, so a new position compiles nothing either.

use super::config::{Arch, Config, RopeStyle};
use super::weights::{QTensor, Weight};
use super::LlmError;
use crate::ir::{Op, QuantFormat};
use crate::{DType, Device, Result, Tensor};

/// A norm's parameters: RMSNorm when there is no bias and the model is not
/// GPT-2, LayerNorm otherwise.
#[derive(Clone, Debug)]
pub(crate) struct Norm {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

/// Attention projections.
#[derive(Clone, Debug)]
pub(crate) enum Qkv {
    /// Separate q, k, v (Llama, Qwen2; biases in Qwen2).
    Split { q: Weight, k: Weight, v: Weight, bq: Option<Tensor>, bk: Option<Tensor>, bv: Option<Tensor> },
    /// One fused projection (GPT-2).
    Fused { qkv: Weight, bias: Option<Tensor> },
}

/// The feed-forward block.
#[derive(Clone, Debug)]
pub(crate) enum Ffn {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu { gate: Weight, up: Weight, down: Weight },
    /// `down(gelu_tanh(up(x) + b) ) + b` (GPT-2).
    Gelu { up: Weight, bup: Option<Tensor>, down: Weight, bdown: Option<Tensor> },
}

/// One decoder block.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    pub attn_norm: Norm,
    pub qkv: Qkv,
    pub wo: Weight,
    pub bo: Option<Tensor>,
    pub ffn_norm: Norm,
    pub ffn: Ffn,
}

/// A decoder's weights on a device.
#[derive(Clone, Debug)]
pub(crate) struct Weights {
    pub embed: Weight,
    pub pos_embed: Option<Tensor>,
    pub blocks: Vec<Block>,
    pub out_norm: Norm,
    /// `None`: tied to the embedding.
    pub output: Option<Weight>,
}

impl Weights {
    /// Bytes of every weight on its device (a tied output counted once).
    pub fn storage_bytes(&self) -> usize {
        let t = |x: &Tensor| x.numel() * x.dtype().size_bytes();
        let o = |x: &Option<Tensor>| x.as_ref().map_or(0, t);
        let n = |x: &Norm| t(&x.weight) + o(&x.bias);
        let mut total = self.embed.storage_bytes() + o(&self.pos_embed) + n(&self.out_norm);
        total += self.output.as_ref().map_or(0, Weight::storage_bytes);
        for b in &self.blocks {
            total += n(&b.attn_norm) + n(&b.ffn_norm) + b.wo.storage_bytes() + o(&b.bo);
            total += match &b.qkv {
                Qkv::Split { q, k, v, bq, bk, bv } => {
                    q.storage_bytes() + k.storage_bytes() + v.storage_bytes() + o(bq) + o(bk) + o(bv)
                }
                Qkv::Fused { qkv, bias } => qkv.storage_bytes() + o(bias),
            };
            total += match &b.ffn {
                Ffn::SwiGlu { gate, up, down } => gate.storage_bytes() + up.storage_bytes() + down.storage_bytes(),
                Ffn::Gelu { up, bup, down, bdown } => up.storage_bytes() + o(bup) + down.storage_bytes() + o(bdown),
            };
        }
        total
    }
}

/// The preallocated keys and values of every layer, `[b, kv_heads,
/// context, head_dim]` f32 each, written in place at the current
/// positions.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    batch: usize,
    context: usize,
}

impl KvCache {
    /// A zeroed cache for `batch` sequences of up to `context` positions.
    pub fn new(config: &Config, batch: usize, context: usize, device: &Device) -> Result<KvCache> {
        let dims = [batch, config.kv_heads, context, config.head_dim];
        let numel: usize = dims.iter().product();
        // Data from the start (zeroed bytes, uploaded where first read), so
        // every step's graph reads the cache as a parameter and the first
        // write already lands in place.
        let make =
            || Tensor::from_bytes(vec![0u8; numel * 4], crate::ir::ValueType::new(dims.to_vec(), DType::F32), device);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for _ in 0..config.layers {
            k.push(make()?);
            v.push(make()?);
        }
        Ok(KvCache { k, v, batch, context })
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Positions each sequence may hold.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Bytes of every layer's keys and values.
    pub fn storage_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|t| t.numel() * 4).sum()
    }

    /// Every cache tensor (to sync with a step's outputs).
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.k.iter().chain(&self.v)
    }
}

/// The RoPE tables on the device, `[positions, rope_dim / 2]`.
#[derive(Clone, Debug)]
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(config: &Config, positions: usize, device: &Device) -> Result<Rope> {
        let half = config.rope_dim / 2;
        let (cos, sin) = config.rope_tables(positions);
        Ok(Rope {
            cos: Tensor::from_slice(&cos, [positions, half], device)?,
            sin: Tensor::from_slice(&sin, [positions, half], device)?,
        })
    }
}

/// `x [b, t, heads, head_dim]` rotated at `positions [pb, t]`.
fn rope(config: &Config, tables: &Rope, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
    let (rd, hd) = (config.rope_dim, config.head_dim);
    let half = rd / 2;
    // [pb, t, 1, half]
    let cos = tables.cos.gather(0, positions)?.unsqueeze(2)?;
    let sin = tables.sin.gather(0, positions)?.unsqueeze(2)?;
    let xr = if rd < hd { x.narrow(-1, 0, rd)? } else { x.clone() };
    let rotated = match config.rope_style {
        RopeStyle::Interleaved => {
            let d = xr.dims().to_vec();
            let pairs = xr.reshape([d[0], d[1], d[2], half, 2])?;
            let x0 = pairs.narrow(-1, 0, 1)?.squeeze(&[-1])?;
            let x1 = pairs.narrow(-1, 1, 1)?.squeeze(&[-1])?;
            let o0 = x0.mul(&cos)?.sub(&x1.mul(&sin)?)?;
            let o1 = x0.mul(&sin)?.add(&x1.mul(&cos)?)?;
            Tensor::stack(&[&o0, &o1], -1)?.reshape([d[0], d[1], d[2], rd])?
        }
        RopeStyle::Half => {
            let x0 = xr.narrow(-1, 0, half)?;
            let x1 = xr.narrow(-1, half, half)?;
            let o0 = x0.mul(&cos)?.sub(&x1.mul(&sin)?)?;
            let o1 = x0.mul(&sin)?.add(&x1.mul(&cos)?)?;
            Tensor::concat(&[&o0, &o1], -1)?
        }
    };
    if rd < hd {
        Tensor::concat(&[&rotated, &x.narrow(-1, rd, hd - rd)?], -1)
    } else {
        Ok(rotated)
    }
}

fn norm(config: &Config, n: &Norm, x: &Tensor) -> Result<Tensor> {
    if config.arch == Arch::Gpt2 || n.bias.is_some() {
        crate::nn::layer_norm(x, 1, Some(&n.weight), n.bias.as_ref(), config.norm_eps)
    } else {
        crate::nn::rms_norm(x, &[config.dim], Some(&n.weight), Some(config.norm_eps))
    }
}

fn plus(x: Tensor, b: &Option<Tensor>) -> Result<Tensor> {
    match b {
        Some(b) => x.add(b),
        None => Ok(x),
    }
}

/// What one forward pass reads besides the weights.
pub(crate) struct Step<'a> {
    /// Token ids, i32 `[b, t]`.
    pub tokens: &'a Tensor,
    /// Positions of the first token of each row: i32, rank 0 or `[b]`.
    pub pos: &'a Tensor,
    /// Where to take the logits: `None` for every position (`[b, t,
    /// vocab]`), else i32 `[b]` indices into each row (`[b, vocab]`).
    pub last: Option<&'a Tensor>,
}

/// One forward pass (see the module doc); returns the logits.
pub(crate) fn forward(
    config: &Config,
    w: &Weights,
    tables: Option<&Rope>,
    cache: &KvCache,
    step: &Step<'_>,
) -> Result<Tensor> {
    let device = step.tokens.device();
    let (b, t) = (step.tokens.dims()[0], step.tokens.dims()[1]);
    let pb = if step.pos.rank() == 0 { 1 } else { b };
    let (h, g, hd) = (config.heads, config.kv_heads, config.head_dim);
    // Absolute positions [pb, t].
    let positions = step.pos.reshape([pb, 1])?.add(&Tensor::iota([1, t], 1, DType::I32, device)?)?;
    let mut x = w.embed.rows(step.tokens)?;
    if let Some(pe) = &w.pos_embed {
        x = x.add(&pe.gather(0, &positions)?)?;
    }
    let scale = Tensor::scalar(1.0 / (hd as f64).sqrt(), DType::F32, device);
    for (l, blk) in w.blocks.iter().enumerate() {
        let hn = norm(config, &blk.attn_norm, &x)?;
        let (q, k, v) = match &blk.qkv {
            Qkv::Split { q, k, v, bq, bk, bv } => {
                (plus(q.linear(&hn)?, bq)?, plus(k.linear(&hn)?, bk)?, plus(v.linear(&hn)?, bv)?)
            }
            Qkv::Fused { qkv, bias } => {
                let all = plus(qkv.linear(&hn)?, bias)?;
                (all.narrow(-1, 0, h * hd)?, all.narrow(-1, h * hd, g * hd)?, all.narrow(-1, (h + g) * hd, g * hd)?)
            }
        };
        let mut q = q.reshape([b, t, h, hd])?;
        let mut k = k.reshape([b, t, g, hd])?;
        if let Some(tables) = tables {
            q = rope(config, tables, &q, &positions)?;
            k = rope(config, tables, &k, &positions)?;
        }
        let heads_first = [0isize, 2, 1, 3];
        let q = q.permute(&heads_first)?;
        let k = k.permute(&heads_first)?;
        let v = v.reshape([b, t, g, hd])?.permute(&heads_first)?;
        let kc = Tensor::record(Op::WriteAt { axis: 2 }, &[&cache.k[l], &k, step.pos])?;
        let vc = Tensor::record(Op::WriteAt { axis: 2 }, &[&cache.v[l], &v, step.pos])?;
        cache.k[l].assign(&kc)?;
        cache.v[l].assign(&vc)?;
        let att = Tensor::record(Op::PrefixAttention, &[&q, &kc, &vc, &scale, step.pos])?;
        let att = att.permute(&heads_first)?.reshape([b, t, h * hd])?;
        x = x.add(&plus(blk.wo.linear(&att)?, &blk.bo)?)?;
        let hn = norm(config, &blk.ffn_norm, &x)?;
        let f = match &blk.ffn {
            Ffn::SwiGlu { gate, up, down } => {
                let gt = gate.linear(&hn)?;
                let silu = gt.mul(&gt.sigmoid()?)?;
                down.linear(&silu.mul(&up.linear(&hn)?)?)?
            }
            Ffn::Gelu { up, bup, down, bdown } => {
                let u = plus(up.linear(&hn)?, bup)?.gelu_tanh()?;
                plus(down.linear(&u)?, bdown)?
            }
        };
        x = x.add(&f)?;
    }
    if let Some(last) = step.last {
        // Row r's token last[r]: gather from the flattened [b * t, dim].
        let base = Tensor::iota([b], 0, DType::I32, device)?.mul_scalar(t as i32)?;
        let idx = base.add(last)?;
        x = x.reshape([b * t, config.dim])?.gather(0, &idx)?;
    }
    let x = norm(config, &w.out_norm, &x)?;
    w.output.as_ref().unwrap_or(&w.embed).linear(&x)
}

/// Reads a checkpoint's tensors by name into weights (a trait so that
/// GGUF and safetensors share the architecture code below).
pub(crate) trait Source {
    /// The `[out, in]` matrix `name` (2-d, checked against `dims`).
    fn matrix(&self, name: &str, dims: [usize; 2], device: &Device) -> std::result::Result<Weight, LlmError>;
    /// The vector or small tensor `name` in f32, of `dims`.
    fn vector(&self, name: &str, dims: &[usize], device: &Device) -> std::result::Result<Tensor, LlmError>;
    /// Whether `name` exists.
    fn has(&self, name: &str) -> bool;
}

/// Tensor names of one layout (GGUF's or Hugging Face's).
pub(crate) struct Names {
    pub embed: &'static str,
    pub pos_embed: &'static str,
    pub out_norm: &'static str,
    pub output: &'static str,
    /// Per block: the name of part `p` (`attn_q`, `ffn_up`, ...) with a
    /// suffix (`weight`, `bias`).
    pub block: fn(usize, &str, &str) -> String,
}

/// Builds the weights of `config`'s architecture from `src`.
pub(crate) fn build(
    config: &Config,
    src: &dyn Source,
    names: &Names,
    device: &Device,
) -> std::result::Result<Weights, LlmError> {
    let (d, h, g, hd, f) = (config.dim, config.heads, config.kv_heads, config.head_dim, config.ffn_dim);
    let bias = |name: String, n: usize| -> std::result::Result<Option<Tensor>, LlmError> {
        if src.has(&name) {
            Ok(Some(src.vector(&name, &[n], device)?))
        } else {
            Ok(None)
        }
    };
    let norm = |name: String, with_bias: bool| -> std::result::Result<Norm, LlmError> {
        let weight = src.vector(&format!("{name}.weight"), &[d], device)?;
        let bias = if with_bias { Some(src.vector(&format!("{name}.bias"), &[d], device)?) } else { None };
        Ok(Norm { weight, bias })
    };
    let gpt2 = config.arch == Arch::Gpt2;
    let embed = src.matrix(names.embed, [config.vocab, d], device)?;
    let pos_embed = if gpt2 { Some(src.vector(names.pos_embed, &[config.max_context, d], device)?) } else { None };
    let mut blocks = Vec::new();
    for i in 0..config.layers {
        let n = |part: &str, suffix: &str| (names.block)(i, part, suffix);
        let qkv = if gpt2 {
            Qkv::Fused {
                qkv: src.matrix(&n("attn_qkv", "weight"), [(h + 2 * g) * hd, d], device)?,
                bias: bias(n("attn_qkv", "bias"), (h + 2 * g) * hd)?,
            }
        } else {
            Qkv::Split {
                q: src.matrix(&n("attn_q", "weight"), [h * hd, d], device)?,
                k: src.matrix(&n("attn_k", "weight"), [g * hd, d], device)?,
                v: src.matrix(&n("attn_v", "weight"), [g * hd, d], device)?,
                bq: bias(n("attn_q", "bias"), h * hd)?,
                bk: bias(n("attn_k", "bias"), g * hd)?,
                bv: bias(n("attn_v", "bias"), g * hd)?,
            }
        };
        let ffn = if gpt2 {
            Ffn::Gelu {
                up: src.matrix(&n("ffn_up", "weight"), [f, d], device)?,
                bup: bias(n("ffn_up", "bias"), f)?,
                down: src.matrix(&n("ffn_down", "weight"), [d, f], device)?,
                bdown: bias(n("ffn_down", "bias"), d)?,
            }
        } else {
            Ffn::SwiGlu {
                gate: src.matrix(&n("ffn_gate", "weight"), [f, d], device)?,
                up: src.matrix(&n("ffn_up", "weight"), [f, d], device)?,
                down: src.matrix(&n("ffn_down", "weight"), [d, f], device)?,
            }
        };
        blocks.push(Block {
            attn_norm: norm(n("attn_norm", "").trim_end_matches('.').to_string(), gpt2)?,
            qkv,
            wo: src.matrix(&n("attn_output", "weight"), [d, h * hd], device)?,
            bo: bias(n("attn_output", "bias"), d)?,
            ffn_norm: norm(n("ffn_norm", "").trim_end_matches('.').to_string(), gpt2)?,
            ffn,
        });
    }
    let out_norm = norm(names.out_norm.to_string(), gpt2)?;
    let output = if src.has(names.output) { Some(src.matrix(names.output, [config.vocab, d], device)?) } else { None };
    Ok(Weights { embed, pos_embed, blocks, out_norm, output })
}

/// A dense or quantized matrix from raw bytes of a GGML type or an f32
/// array: what both sources end with.
pub(crate) fn matrix_from(
    name: &str,
    format: Option<QuantFormat>,
    bytes: Vec<u8>,
    [out, inp]: [usize; 2],
    device: &Device,
) -> std::result::Result<Weight, LlmError> {
    Ok(match format {
        None => {
            let values: Vec<f32> =
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            Weight::dense(&values, out, inp, device)
                .map_err(|e| LlmError::Tensor { name: name.into(), source: Box::new(e) })?
        }
        Some(f) => Weight::Quant(
            QTensor::from_blocks(bytes, f, out, inp, device)
                .map_err(|e| LlmError::Tensor { name: name.into(), source: Box::new(e) })?,
        ),
    })
}
