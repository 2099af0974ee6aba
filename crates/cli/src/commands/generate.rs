//! `lazuli generate`: with `--model FILE` (a GGUF file or a Hugging Face
//! folder) a language model through `lazuli::llm`, its text streamed as
//! it is chosen; without, greedy generation with the small GPT demo
//! (`lazuli_models::generate`), a growing context beside a fixed window,
//! with the time, plans compiled and pipelines created per window.

use super::{open_device, DeviceChoice};
use lazuli::llm::{GenerateOptions, Model, Sampling};
use lazuli::metrics;
use lazuli_models::generate::{GenConfig, Window};
use std::io::Write;
use std::path::PathBuf;

/// Which windows `lazuli generate` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WindowChoice {
    /// The context as it grows: a new size every step.
    Growing,
    /// A zero-padded window of the full context: one graph for the run.
    Fixed,
    /// Growing, then fixed, with their time ratio.
    Both,
}

/// The options of `lazuli generate`. With `--model FILE`: a language
/// model from a GGUF file (f32, f16, bf16, Q8_0, Q4_0, Q5_0, Q4_K, Q6_K)
/// or a Hugging Face folder (config.json, safetensors, tokenizer.json),
/// e.g. `lazuli generate --model tiny.gguf --prompt "Once upon a time"`.
/// Without: greedy generation with the small GPT demo (context up to 64,
/// 12-token prompt), the growing context a new size every step; prints
/// time, plans compiled and pipelines created per window.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The device (default: Device::default()).
    #[arg(long)]
    pub device: Option<DeviceChoice>,
    /// One JSON object (per window for the demo) instead of text.
    #[arg(long)]
    pub json: bool,
    /// The language model: a GGUF file or a Hugging Face folder.
    #[arg(long, value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// The prompt's text (needs the model's tokenizer).
    #[arg(long, requires = "model", conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, e.g. 1,15043,29871.
    #[arg(long, requires = "model", value_delimiter = ',', value_name = "IDS")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most (the model's end token stops earlier).
    #[arg(long, requires = "model", value_name = "N", default_value_t = 32)]
    pub max_tokens: usize,
    /// The most likely token each step (the default unless a sampling
    /// option is given).
    #[arg(long, requires = "model")]
    pub greedy: bool,
    /// Sampling temperature.
    #[arg(long, requires = "model", value_name = "T")]
    pub temperature: Option<f32>,
    /// Sample among the K most likely tokens (0: all).
    #[arg(long, requires = "model", value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample within the smallest set of tokens of probability P.
    #[arg(long, requires = "model", value_name = "P")]
    pub top_p: Option<f32>,
    /// Divides the logits of tokens already seen (1: off).
    #[arg(long, requires = "model", value_name = "R")]
    pub repeat_penalty: Option<f32>,
    /// The seed of the draws.
    #[arg(long, requires = "model", default_value_t = 0)]
    pub seed: u64,
    /// Positions the cache holds (default: prompt + max tokens, at most
    /// the model's context).
    #[arg(long, requires = "model", value_name = "N")]
    pub context: Option<usize>,
    /// Prompt tokens per prefill step.
    #[arg(long, requires = "model", value_name = "N", default_value_t = 64)]
    pub chunk: usize,
    /// The demo's windows to run.
    #[arg(long, value_enum, default_value_t = WindowChoice::Both, conflicts_with = "model")]
    pub window: WindowChoice,
    /// The demo's tokens to generate (default: its configuration).
    #[arg(long, value_name = "N", conflicts_with = "model")]
    pub tokens: Option<usize>,
}

/// A language-model run's options, from [`Args`].
#[derive(Debug)]
struct ModelRun {
    model: PathBuf,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    opts: GenerateOptions,
    json: bool,
}

impl Args {
    /// The language-model run these options ask for (`None` without
    /// `--model`): one of `--prompt` and `--prompt-ids` is required; a
    /// sampling option without `--greedy` turns sampling on.
    fn model_run(&self) -> Result<Option<ModelRun>, String> {
        let Some(model) = &self.model else { return Ok(None) };
        if self.prompt.is_none() && self.prompt_ids.is_none() {
            return Err("--model needs a prompt: --prompt TEXT or --prompt-ids 1,2,3".into());
        }
        let mut sampling = Sampling::default();
        let sampled = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        if let Some(t) = self.temperature {
            sampling.temperature = t;
        }
        if let Some(k) = self.top_k {
            sampling.top_k = k;
        }
        if let Some(p) = self.top_p {
            sampling.top_p = p;
        }
        if let Some(r) = self.repeat_penalty {
            sampling.repetition_penalty = r;
        }
        if sampled && !self.greedy {
            sampling.greedy = false;
        }
        let opts = GenerateOptions {
            max_tokens: self.max_tokens,
            sampling,
            seed: self.seed,
            context: self.context,
            chunk: self.chunk,
            ..GenerateOptions::default()
        };
        Ok(Some(ModelRun {
            model: model.clone(),
            prompt: self.prompt.clone(),
            prompt_ids: self.prompt_ids.clone(),
            opts,
            json: self.json,
        }))
    }
}

/// `lazuli generate`: a language model with `--model`, else the demo's
/// greedy generation with a growing and/or a fixed window, side by side,
/// with compile counters.
pub fn run(args: Args) -> Result<(), String> {
    if let Some(m) = args.model_run()? {
        return run_model(m, args.device);
    }
    let mut cfg = GenConfig::default();
    if let Some(n) = args.tokens {
        cfg.tokens = n;
    }
    let windows = match args.window {
        WindowChoice::Growing => vec![Window::Growing],
        WindowChoice::Fixed => vec![Window::Fixed],
        WindowChoice::Both => vec![Window::Growing, Window::Fixed],
    };
    let json = args.json;
    let dev = open_device(args.device)?;
    let mut rows = Vec::new();
    for w in windows {
        let r = lazuli_models::generate::run(cfg, w, &dev).map_err(|e| e.to_string())?;
        println!("{}", if json { r.to_json(&dev.name()) } else { r.summary(&dev.name()) });
        rows.push(r);
    }
    if let [a, b] = rows.as_slice() {
        let same = a.tokens.iter().zip(&b.tokens).filter(|(x, y)| x == y).count();
        if !json {
            println!(
                "growing / fixed time: {:.2}x; tokens equal: {same}/{}",
                a.total.as_secs_f64() / b.total.as_secs_f64(),
                a.tokens.len()
            );
        }
    }
    if !json {
        println!("\n{}", metrics::report());
    }
    Ok(())
}

/// `lazuli generate --model FILE`: text (or ids) from a GGUF file or a
/// Hugging Face folder through `lazuli::llm`, streamed as it is chosen,
/// with prompt and generated tokens per second (`--json`: one object with
/// the ids, the rates and the bytes of the weights and the cache).
fn run_model(a: ModelRun, device: Option<DeviceChoice>) -> Result<(), String> {
    let dev = open_device(device)?;
    let model = Model::load_on(&a.model, &dev).map_err(|e| e.to_string())?;
    let ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => model
            .tokenizer()
            .ok_or("the model has no tokenizer: use --prompt-ids")?
            .encode(text)
            .map_err(|e| e.to_string())?,
        (None, None) => unreachable!("model_run requires one"),
    };
    let stream = !a.json;
    let tk = model.tokenizer();
    let mut shown = String::new();
    let mut so_far = Vec::new();
    let g = model
        .generate(&ids, &a.opts, |id| {
            if stream {
                so_far.push(id);
                match tk.and_then(|t| t.decode(&so_far).ok()) {
                    Some(text) => {
                        // Print what decoding the whole adds (a token may
                        // complete a character the last one started).
                        if let Some(rest) = text.strip_prefix(shown.as_str()) {
                            print!("{rest}");
                            shown = text;
                        }
                    }
                    None => print!("{id} "),
                }
                let _ = std::io::stdout().flush();
            }
            true
        })
        .map_err(|e| e.to_string())?;
    if a.json {
        let j = serde_json::json!({
            "model": a.model.display().to_string(),
            "device": dev.name(),
            "prompt_ids": g.prompt_ids,
            "generated_ids": g.generated_ids,
            "text": g.text,
            "prompt_tps": g.prompt_tps,
            "decode_tps": g.decode_tps,
            "weights_bytes": g.weights_bytes,
            "kv_bytes": g.kv_bytes,
            "decode_compiles": g.decode_compiles,
        });
        println!("{j}");
    } else {
        println!();
        println!(
            "prompt: {} tokens, {:.1} tokens/s; generated: {} tokens, {:.1} tokens/s ({}; weights {} bytes, cache {} bytes)",
            g.prompt_ids.len(),
            g.prompt_tps,
            g.generated_ids.len(),
            g.decode_tps,
            dev.name(),
            g.weights_bytes,
            g.kv_bytes
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(s: &str) -> Result<Args, String> {
        Cli::try_parse_from(std::iter::once("generate").chain(s.split_whitespace()))
            .map(|c| c.args)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn parses_the_issue_s_command_line() {
        let a = parse(
            "--model m.gguf --prompt-ids 1,2,3 --max-tokens 5 --temperature 0.7 --top-k 40 --top-p 0.9 --seed 9 --json",
        )
        .unwrap()
        .model_run()
        .unwrap()
        .unwrap();
        assert_eq!(a.prompt_ids, Some(vec![1, 2, 3]));
        assert_eq!(a.opts.max_tokens, 5);
        assert!(!a.opts.sampling.greedy);
        assert_eq!((a.opts.sampling.top_k, a.opts.seed), (40, 9));
        assert!(a.json);
        let g = parse("--model m.gguf --prompt hi --greedy").unwrap().model_run().unwrap().unwrap();
        assert!(g.opts.sampling.greedy);
        assert!(parse("--model m.gguf").unwrap().model_run().is_err(), "a prompt is required");
        assert!(parse("--prompt-ids 1").is_err(), "a prompt without --model");
        assert!(parse("--model m --prompt-ids 1,x").is_err());
        assert!(parse("--model m --prompt a --prompt-ids 1").is_err());
        assert!(parse("--model m --prompt a --window fixed").is_err(), "the demo's options without the demo");
        assert!(parse("--window fixed --tokens 3").unwrap().model_run().unwrap().is_none());
    }
}
