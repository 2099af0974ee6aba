//! Text to token ids and back: a Hugging Face `tokenizer.json` through the
//! `tokenizers` crate (pure Rust: its `fancy-regex` backend, no Oniguruma),
//! or the vocabulary a GGUF file embeds: `llama` (SentencePiece-style
//! BPE by scores, llama.cpp's algorithm) and `gpt2` (byte-level BPE from
//! the file's merges, through `tokenizers`).
//!
//! A vocabulary whose size differs from the model's embedding is an error
//! when the model loads ([`Tokenizer::vocab_size`] is checked there).

use super::gguf::{GgufFile, Value};
use super::LlmError;
use std::collections::HashMap;

/// A tokenizer of one of the supported kinds.
pub struct Tokenizer {
    kind: Kind,
    /// The beginning-of-sequence id, if the vocabulary has one.
    pub bos: Option<u32>,
    /// The end-of-sequence id, if the vocabulary has one.
    pub eos: Option<u32>,
    /// Whether encoding a prompt starts with `bos`.
    pub add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            #[cfg(not(target_arch = "wasm32"))]
            Kind::Hf(_) => "tokenizers",
            Kind::Spm(_) => "sentencepiece (gguf)",
        };
        f.debug_struct("Tokenizer").field("kind", &kind).field("vocab", &self.vocab_size()).finish()
    }
}

enum Kind {
    #[cfg(not(target_arch = "wasm32"))]
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<Spm>),
}

/// llama.cpp's SentencePiece tokenizer over a GGUF vocabulary.
struct Spm {
    tokens: Vec<String>,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    /// Ids of the byte tokens `<0x00>` .. `<0xFF>`, where present.
    bytes: [Option<u32>; 256],
    add_space_prefix: bool,
}

impl Tokenizer {
    /// A `tokenizer.json` (not in the browser build).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_json_file(path: &std::path::Path) -> Result<Tokenizer, LlmError> {
        let tk = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| LlmError::Tokenizer(format!("{}: {e}", path.display())))?;
        let find = |names: &[&str]| names.iter().find_map(|n| tk.token_to_id(n));
        let bos = find(&["<s>", "<|begin_of_text|>", "<|endoftext|>", "<bos>"]);
        let eos = find(&["</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<eos>"]);
        Ok(Tokenizer { kind: Kind::Hf(Box::new(tk)), bos, eos, add_bos: false })
    }

    /// The vocabulary a GGUF file embeds (`tokenizer.ggml.*`), if any.
    pub fn from_gguf(f: &GgufFile) -> Result<Option<Tokenizer>, LlmError> {
        let Some(model) = f.get("tokenizer.ggml.model").and_then(Value::as_str) else { return Ok(None) };
        let bad = |d: String| LlmError::Tokenizer(format!("tokenizer.ggml: {d}"));
        let tokens: Vec<String> = f
            .get("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no token list".into()))?
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad("a token that is not a string".into())))
            .collect::<Result<_, _>>()?;
        let id =
            |key: &str| f.get(key).and_then(Value::as_u64).map(|v| v as u32).filter(|&v| (v as usize) < tokens.len());
        let bos = id("tokenizer.ggml.bos_token_id");
        let eos = id("tokenizer.ggml.eos_token_id");
        let flag = |key: &str, default: bool| match f.get(key) {
            Some(Value::Bool(b)) => *b,
            _ => default,
        };
        match model {
            "llama" => {
                let scores: Vec<f32> = match f.get("tokenizer.ggml.scores").and_then(Value::as_array) {
                    Some(s) if s.len() == tokens.len() => s.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect(),
                    Some(s) => return Err(bad(format!("{} scores for {} tokens", s.len(), tokens.len()))),
                    None => vec![0.0; tokens.len()],
                };
                let ids: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
                let mut bytes = [None; 256];
                for (b, slot) in bytes.iter_mut().enumerate() {
                    *slot = ids.get(&format!("<0x{b:02X}>")).copied();
                }
                let spm =
                    Spm { tokens, scores, ids, bytes, add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true) };
                Ok(Some(Tokenizer {
                    kind: Kind::Spm(Box::new(spm)),
                    bos,
                    eos,
                    add_bos: flag("tokenizer.ggml.add_bos_token", true),
                }))
            }
            #[cfg(target_arch = "wasm32")]
            "gpt2" => Err(bad("byte-level BPE needs the `tokenizers` crate, absent from the browser build".into())),
            #[cfg(not(target_arch = "wasm32"))]
            "gpt2" => {
                let merges: Vec<(String, String)> = f
                    .get("tokenizer.ggml.merges")
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad("a gpt2 vocabulary without merges".into()))?
                    .iter()
                    .map(|m| {
                        let s = m.as_str().ok_or_else(|| bad("a merge that is not a string".into()))?;
                        let (a, b) = s.split_once(' ').ok_or_else(|| bad(format!("merge {s:?} is not two tokens")))?;
                        Ok((a.to_string(), b.to_string()))
                    })
                    .collect::<Result<_, LlmError>>()?;
                let vocab: tokenizers::models::bpe::Vocab =
                    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
                let bpe = tokenizers::models::bpe::BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(|e| bad(format!("byte-level BPE: {e}")))?;
                let mut tk = tokenizers::Tokenizer::new(bpe);
                tk.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true)));
                tk.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
                Ok(Some(Tokenizer {
                    kind: Kind::Hf(Box::new(tk)),
                    bos,
                    eos,
                    add_bos: flag("tokenizer.ggml.add_bos_token", false),
                }))
            }
            other => Err(bad(format!("vocabulary model {other:?} (llama and gpt2 are supported)"))),
        }
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match &self.kind {
            #[cfg(not(target_arch = "wasm32"))]
            Kind::Hf(t) => t.get_vocab_size(true),
            Kind::Spm(s) => s.tokens.len(),
        }
    }

    /// The ids of `text` (with `bos` first where the vocabulary asks).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, LlmError> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        match &self.kind {
            #[cfg(not(target_arch = "wasm32"))]
            Kind::Hf(t) => ids.extend(
                t.encode(text, false).map_err(|e| LlmError::Tokenizer(e.to_string()))?.get_ids().iter().copied(),
            ),
            Kind::Spm(s) => ids.extend(s.encode(text)),
        }
        Ok(ids)
    }

    /// The text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, LlmError> {
        match &self.kind {
            #[cfg(not(target_arch = "wasm32"))]
            Kind::Hf(t) => t.decode(ids, true).map_err(|e| LlmError::Tokenizer(e.to_string())),
            Kind::Spm(s) => Ok(s.decode(ids, self.bos, self.eos)),
        }
    }
}

impl Spm {
    /// llama.cpp's `llm_tokenizer_spm`: characters (unknown ones as byte
    /// tokens), then repeatedly the adjacent pair whose concatenation is a
    /// token of the highest score (the leftmost of equals) is merged.
    fn encode(&self, text: &str) -> Vec<u32> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut s = String::new();
        if self.add_space_prefix {
            s.push(' ');
        }
        s.push_str(text);
        let s = s.replace(' ', "\u{2581}");
        let mut pieces: Vec<String> = s.chars().map(|c| c.to_string()).collect();
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..pieces.len().saturating_sub(1) {
                let joined = format!("{}{}", pieces[i], pieces[i + 1]);
                if let Some(&id) = self.ids.get(&joined) {
                    let score = self.scores[id as usize];
                    if best.is_none_or(|(b, _)| score > b) {
                        best = Some((score, i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = pieces.remove(i + 1);
            pieces[i].push_str(&right);
        }
        let mut ids = Vec::new();
        for p in &pieces {
            match self.ids.get(p) {
                Some(&id) => ids.push(id),
                None => ids.extend(p.bytes().filter_map(|b| self.bytes[b as usize])),
            }
        }
        ids
    }

    fn decode(&self, ids: &[u32], bos: Option<u32>, eos: Option<u32>) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if Some(id) == bos || Some(id) == eos {
                continue;
            }
            let Some(tok) = self.tokens.get(id as usize) else { continue };
            if let Some(b) = self.bytes.iter().position(|&x| x == Some(id)) {
                bytes.push(b as u8);
            } else {
                bytes.extend_from_slice(tok.replace('\u{2581}', " ").as_bytes());
            }
        }
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        if self.add_space_prefix && text.starts_with(' ') {
            text.remove(0);
        }
        text
    }
}
