//! `lazuli generate --model FILE`: text (or ids) from a GGUF file or a
//! Hugging Face folder through `lazuli::llm`, streamed as it is chosen,
//! with prompt and generated tokens per second (`--json`: one object with
//! the ids, the rates and the bytes of the weights and the cache).

use lazuli::llm::{GenerateOptions, Model, Sampling};
use std::io::Write;

/// What the command line asked for.
#[derive(Debug)]
pub struct Args {
    /// The checkpoint.
    pub model: String,
    /// Prompt text (needs the model's tokenizer).
    pub prompt: Option<String>,
    /// Prompt ids.
    pub prompt_ids: Option<Vec<u32>>,
    /// Generation options.
    pub opts: GenerateOptions,
    /// `--device cpu|wgpu`, passed on.
    pub device: Vec<String>,
    /// One JSON object instead of text.
    pub json: bool,
}

/// Parses the options after `generate`.
pub fn parse(args: &[String]) -> Result<Args, String> {
    let mut out = Args {
        model: String::new(),
        prompt: None,
        prompt_ids: None,
        opts: GenerateOptions::default(),
        device: Vec::new(),
        json: false,
    };
    let mut sampled = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        fn num<T: std::str::FromStr>(name: &str, v: String) -> Result<T, String>
        where
            T::Err: std::fmt::Display,
        {
            v.parse().map_err(|e| format!("{name}: {e} ({v:?})"))
        }
        match a.as_str() {
            "--model" => out.model = value("--model")?,
            "--prompt" => out.prompt = Some(value("--prompt")?),
            "--prompt-ids" => {
                let v = value("--prompt-ids")?;
                let ids =
                    v.split(',').map(|s| num::<u32>("--prompt-ids", s.trim().to_string())).collect::<Result<_, _>>()?;
                out.prompt_ids = Some(ids);
            }
            "--max-tokens" => out.opts.max_tokens = num("--max-tokens", value("--max-tokens")?)?,
            "--greedy" => out.opts.sampling = Sampling::default(),
            "--temperature" => {
                out.opts.sampling.temperature = num("--temperature", value("--temperature")?)?;
                sampled = true;
            }
            "--top-k" => {
                out.opts.sampling.top_k = num("--top-k", value("--top-k")?)?;
                sampled = true;
            }
            "--top-p" => {
                out.opts.sampling.top_p = num("--top-p", value("--top-p")?)?;
                sampled = true;
            }
            "--repeat-penalty" => {
                out.opts.sampling.repetition_penalty = num("--repeat-penalty", value("--repeat-penalty")?)?
            }
            "--seed" => out.opts.seed = num("--seed", value("--seed")?)?,
            "--context" => out.opts.context = Some(num("--context", value("--context")?)?),
            "--chunk" => out.opts.chunk = num("--chunk", value("--chunk")?)?,
            "--device" => out.device.extend(["--device".to_string(), value("--device")?]),
            "--json" => out.json = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if out.model.is_empty() {
        return Err("--model FILE is required".into());
    }
    if out.prompt.is_some() == out.prompt_ids.is_some() {
        return Err("give one of --prompt TEXT or --prompt-ids 1,2,3".into());
    }
    if sampled && !args.iter().any(|a| a == "--greedy") {
        out.opts.sampling.greedy = false;
    }
    Ok(out)
}

/// Runs it.
pub fn run(args: &[String]) -> Result<(), String> {
    let a = parse(args)?;
    let dev = crate::device_arg(&a.device)?;
    let model = Model::load_on(&a.model, &dev).map_err(|e| e.to_string())?;
    let ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => model
            .tokenizer()
            .ok_or("the model has no tokenizer: use --prompt-ids")?
            .encode(text)
            .map_err(|e| e.to_string())?,
        (None, None) => unreachable!("parse requires one"),
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
            "model": a.model,
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

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_the_issue_s_command_line() {
        let a = parse(&args(
            "--model m.gguf --prompt-ids 1,2,3 --max-tokens 5 --temperature 0.7 --top-k 40 --top-p 0.9 --seed 9 --json",
        ))
        .unwrap();
        assert_eq!(a.prompt_ids, Some(vec![1, 2, 3]));
        assert_eq!(a.opts.max_tokens, 5);
        assert!(!a.opts.sampling.greedy);
        assert_eq!((a.opts.sampling.top_k, a.opts.seed), (40, 9));
        assert!(a.json);
        let g = parse(&args("--model m.gguf --prompt hi --greedy")).unwrap();
        assert!(g.opts.sampling.greedy);
        assert!(parse(&args("--model m.gguf")).is_err());
        assert!(parse(&args("--prompt-ids 1")).is_err());
        assert!(parse(&args("--model m --prompt-ids 1,x")).is_err());
    }
}
