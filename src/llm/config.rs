//! A decoder's hyperparameters ([`Config`]) as GGUF metadata or a Hugging
//! Face `config.json` give them, and the RoPE tables they imply.

use super::gguf::{GgufError, GgufFile};
use super::LlmError;

/// The architectures the loader builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, Mistral and their kin: RMSNorm, RoPE, grouped-query
    /// attention, SwiGLU.
    Llama,
    /// Qwen2: Llama with biases on q, k and v, RoPE over half rotations.
    Qwen2,
    /// GPT-2: LayerNorm, learned positions, fused qkv, GELU (tanh).
    Gpt2,
}

impl Arch {
    /// The name GGUF's `general.architecture` uses.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gpt2 => "gpt2",
        }
    }
}

/// How RoPE pairs features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(2i, 2i + 1)`: GGUF's Llama (its converter permutes q and k
    /// rows to this layout), GPT-J.
    Interleaved,
    /// Pairs `(i, i + d/2)`: Hugging Face's Llama, NeoX, Qwen2 in both.
    Half,
}

/// How the RoPE frequencies are scaled for long contexts.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// None.
    None,
    /// Positions divided by `factor` (GGUF `rope.scaling.type = linear`,
    /// HF `rope_type: linear`).
    Linear(f64),
    /// Llama 3's per-frequency scaling (HF `rope_type: llama3`).
    Llama3 {
        /// The factor for low frequencies.
        factor: f64,
        /// Low-frequency bound factor.
        low_freq_factor: f64,
        /// High-frequency bound factor.
        high_freq_factor: f64,
        /// The context the model was trained at.
        original_max: f64,
    },
    /// Per-frequency divisors, GGUF's `rope_freqs.weight` (Llama 3 files).
    Factors(Vec<f32>),
}

/// A decoder's hyperparameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Model width.
    pub dim: usize,
    /// Decoder blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer).
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Hidden width of the feed-forward block.
    pub ffn_dim: usize,
    /// Normalization epsilon.
    pub norm_eps: f64,
    /// The longest context the model supports.
    pub max_context: usize,
    /// RoPE frequency base.
    pub rope_base: f64,
    /// Features rotated per head (all of them unless partial).
    pub rope_dim: usize,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
}

impl Config {
    /// The hyperparameters of a GGUF file (`{arch}.*` keys).
    pub fn from_gguf(f: &GgufFile) -> Result<Config, LlmError> {
        let arch_name = f.str("general.architecture")?;
        let arch = match arch_name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gpt2" => Arch::Gpt2,
            other => return Err(LlmError::Architecture(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let dim = f.usize(&key("embedding_length"))?;
        let heads = f.usize(&key("attention.head_count"))?;
        let kv_heads = match f.get(&key("attention.head_count_kv")) {
            Some(_) => f.usize(&key("attention.head_count_kv"))?,
            None => heads,
        };
        if heads == 0 || kv_heads == 0 || !dim.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
            return Err(GgufError::Metadata {
                key: key("attention.head_count"),
                detail: format!("{heads} heads, {kv_heads} kv heads and width {dim} do not divide"),
            }
            .into());
        }
        let head_dim = match f.get(&key("attention.key_length")) {
            Some(_) => f.usize(&key("attention.key_length"))?,
            None => dim / heads,
        };
        let eps_key =
            if arch == Arch::Gpt2 { "attention.layer_norm_epsilon" } else { "attention.layer_norm_rms_epsilon" };
        let rope_scaling = match f.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear(f.f64_or(&key("rope.scaling.factor"), 1.0)?),
            Some(other) => {
                return Err(GgufError::Metadata {
                    key: key("rope.scaling.type"),
                    detail: format!("{other:?} is not supported (none and linear are)"),
                }
                .into())
            }
        };
        let vocab = match f.tensor("token_embd.weight") {
            Some(t) if t.ggml_dims.len() == 2 => t.ggml_dims[1],
            _ => {
                return Err(GgufError::Tensor {
                    tensor: "token_embd.weight".into(),
                    detail: "missing or not 2-d".into(),
                }
                .into())
            }
        };
        let config = Config {
            arch,
            vocab,
            dim,
            layers: f.usize(&key("block_count"))?,
            heads,
            kv_heads,
            head_dim,
            ffn_dim: f.usize(&key("feed_forward_length"))?,
            norm_eps: f.f64_or(&key(eps_key), 1e-5)?,
            max_context: f.usize(&key("context_length"))?,
            rope_base: f.f64_or(&key("rope.freq_base"), 10000.0)?,
            rope_dim: match f.get(&key("rope.dimension_count")) {
                Some(_) => f.usize(&key("rope.dimension_count"))?,
                None => head_dim,
            },
            rope_style: if arch == Arch::Llama { RopeStyle::Interleaved } else { RopeStyle::Half },
            rope_scaling,
        };
        config.check()?;
        Ok(config)
    }

    /// The hyperparameters of a Hugging Face `config.json`.
    pub fn from_hf(json: &serde_json::Value) -> Result<Config, LlmError> {
        let bad = |key: &str, detail: &str| LlmError::Config(format!("config.json: {key}: {detail}"));
        let num = |key: &str| -> Result<usize, LlmError> {
            json.get(key)
                .and_then(|v| v.as_u64())
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| bad(key, "missing or not a non-negative integer"))
        };
        let float = |key: &str, default: f64| json.get(key).and_then(|v| v.as_f64()).unwrap_or(default);
        let model_type = json.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let arch = match model_type {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gpt2" => Arch::Gpt2,
            other => return Err(LlmError::Architecture(other.to_string())),
        };
        if arch == Arch::Gpt2 {
            let dim = num("n_embd")?;
            let heads = num("n_head")?;
            if heads == 0 || !dim.is_multiple_of(heads) {
                return Err(bad("n_head", "does not divide n_embd"));
            }
            let config = Config {
                arch,
                vocab: num("vocab_size")?,
                dim,
                layers: num("n_layer")?,
                heads,
                kv_heads: heads,
                head_dim: dim / heads,
                ffn_dim: json.get("n_inner").and_then(|v| v.as_u64()).map_or(4 * dim, |v| v as usize),
                norm_eps: float("layer_norm_epsilon", 1e-5),
                max_context: num("n_positions")?,
                rope_base: 10000.0,
                rope_dim: 0,
                rope_style: RopeStyle::Half,
                rope_scaling: RopeScaling::None,
            };
            config.check()?;
            return Ok(config);
        }
        let dim = num("hidden_size")?;
        let heads = num("num_attention_heads")?;
        let kv_heads = if json.get("num_key_value_heads").is_some() { num("num_key_value_heads")? } else { heads };
        if heads == 0 || kv_heads == 0 || !dim.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
            return Err(bad("num_attention_heads", "heads, kv heads and hidden size do not divide"));
        }
        let head_dim = if json.get("head_dim").is_some_and(|v| !v.is_null()) { num("head_dim")? } else { dim / heads };
        let rope_scaling = match json.get("rope_scaling").filter(|v| !v.is_null()) {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(|v| v.as_str()).unwrap_or("");
                let f = |k: &str, d: f64| s.get(k).and_then(|v| v.as_f64()).unwrap_or(d);
                match kind {
                    "linear" => RopeScaling::Linear(f("factor", 1.0)),
                    "llama3" => RopeScaling::Llama3 {
                        factor: f("factor", 8.0),
                        low_freq_factor: f("low_freq_factor", 1.0),
                        high_freq_factor: f("high_freq_factor", 4.0),
                        original_max: f("original_max_position_embeddings", 8192.0),
                    },
                    "default" => RopeScaling::None,
                    other => return Err(bad("rope_scaling", &format!("{other:?} is not supported (linear, llama3)"))),
                }
            }
        };
        let config = Config {
            arch,
            vocab: num("vocab_size")?,
            dim,
            layers: num("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            ffn_dim: num("intermediate_size")?,
            norm_eps: float("rms_norm_eps", 1e-6),
            max_context: num("max_position_embeddings")?,
            rope_base: float("rope_theta", 10000.0),
            rope_dim: head_dim,
            rope_style: RopeStyle::Half,
            rope_scaling,
        };
        config.check()?;
        Ok(config)
    }

    /// Sizes that cannot build a model are errors here, before any
    /// tensor is read.
    fn check(&self) -> Result<(), LlmError> {
        let fail = |d: String| Err(LlmError::Config(d));
        if self.vocab == 0 || self.dim == 0 || self.layers == 0 || self.head_dim == 0 || self.max_context == 0 {
            return fail(format!("empty model: {self:?}"));
        }
        if self.arch != Arch::Gpt2
            && (self.rope_dim == 0 || !self.rope_dim.is_multiple_of(2) || self.rope_dim > self.head_dim)
        {
            return fail(format!("rope dimension {} for heads of {}", self.rope_dim, self.head_dim));
        }
        // Bounds that keep every size below in usize on any host.
        if self.max_context > 1 << 24 || self.dim > 1 << 20 || self.layers > 1 << 12 || self.vocab > 1 << 24 {
            return fail(format!("implausible sizes: {self:?}"));
        }
        Ok(())
    }

    /// `cos` and `sin` of the angles of positions `0..positions`,
    /// `[positions, rope_dim / 2]` each, computed in f64 and rounded once
    /// to f32.
    pub fn rope_tables(&self, positions: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.rope_dim / 2;
        let mut inv: Vec<f64> =
            (0..half).map(|i| self.rope_base.powf(-(2.0 * i as f64) / self.rope_dim as f64)).collect();
        let mut pos_scale = 1.0;
        match &self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear(f) => pos_scale = 1.0 / f,
            RopeScaling::Factors(fs) => {
                for (f, d) in inv.iter_mut().zip(fs) {
                    *f /= f64::from(*d);
                }
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max } => {
                let low_wavelen = original_max / low_freq_factor;
                let high_wavelen = original_max / high_freq_factor;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        let n = positions * half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in 0..positions {
            for f in &inv {
                let a = p as f64 * pos_scale * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        (cos, sin)
    }
}
