//! A small character-level GPT trained on text, the way a PyTorch user
//! would write it: a `DataLoader` over seeded-shuffled windows of the text,
//! AdamW over decay groups, a linear warmup then a cosine schedule, and a
//! resumable `Checkpoint` (model, optimizer, scheduler, RNG and the step).
//!
//! ```text
//! cargo run --example gpt_text                     # 60 steps on a built-in text
//! cargo run --example gpt_text -- --text FILE      # on a file of your own
//! cargo run --example gpt_text -- --stop-after 30  # stop and save at step 30 ...
//! cargo run --example gpt_text                     # ... and resume from there
//! ```
//!
//! A run that finds the checkpoint resumes from it and continues with the
//! losses the uninterrupted run would have had (`tests/checkpoint.rs`
//! proves that bit for bit). `--fresh` ignores the checkpoint; `--steps N`
//! and `--checkpoint PATH` change the defaults.

use lazuli::checkpoint::Checkpoint;
use lazuli::data::{DataLoader, HostArray, TensorDataset};
use lazuli::nn::{self, Module};
use lazuli::optim::{decay_groups, Adam, LrScheduler, Optimizer, SequentialLR};
use lazuli::prelude::*;
use lazuli_models::gpt::{GptModel, GptSizes};
use std::path::PathBuf;

const TEXT: &str = "It was the best of times, it was the worst of times, it was the age of wisdom, \
it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, \
it was the season of Light, it was the season of Darkness, it was the spring of hope, \
it was the winter of despair, we had everything before us, we had nothing before us.";

/// Bytes as tokens: a vocabulary of 256, no tokenizer to ship.
const SIZES: GptSizes = GptSizes { vocab: 256, layers: 2, embd: 32, heads: 2, context: 16, batch: 8 };

struct Args {
    steps: u64,
    stop_after: Option<u64>,
    text: Option<PathBuf>,
    checkpoint: PathBuf,
    fresh: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        steps: 60,
        stop_after: None,
        text: None,
        checkpoint: std::env::temp_dir().join("lazuli-gpt-text.ckpt.safetensors"),
        fresh: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--steps" => a.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--stop-after" => a.stop_after = Some(value()?.parse().map_err(|e| format!("--stop-after: {e}"))?),
            "--text" => a.text = Some(value()?.into()),
            "--checkpoint" => a.checkpoint = value()?.into(),
            "--fresh" => a.fresh = true,
            other => return Err(format!("unknown argument {other:?} (see the example's doc)")),
        }
    }
    Ok(a)
}

fn main() -> lazuli::Result<()> {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpt_text: {e}");
            std::process::exit(2);
        }
    };
    let text = match &args.text {
        Some(p) => std::fs::read(p).map_err(|e| lazuli::ExecError::Invalid {
            op: "gpt_text".into(),
            detail: format!("{}: {e}", p.display()),
        })?,
        None => TEXT.as_bytes().to_vec(),
    };
    let dev = Device::default();
    println!("device: {}", dev.name());

    // Every window of context + 1 bytes: the inputs and, shifted by one,
    // the next-token targets.
    let t = SIZES.context;
    if text.len() <= t + SIZES.batch {
        eprintln!("gpt_text: the text needs more than {} bytes", t + SIZES.batch);
        std::process::exit(2);
    }
    let windows = text.len() - t;
    let tokens: Vec<i32> = (0..windows).flat_map(|i| text[i..i + t + 1].iter().map(|&b| i32::from(b))).collect();
    let data = TensorDataset::new(vec![HostArray::from_slice(&tokens, &[windows, t + 1])?])?;
    let loader = DataLoader::new(data, SIZES.batch, &dev)?.shuffle(1234).drop_last(true);

    dev.manual_seed(0);
    let model = GptModel::new(SIZES, &dev)?;
    let mut opt = Adam::adamw_groups(decay_groups(&model, 0.1), 3e-3);
    let warmup = (args.steps / 10).max(1);
    let mut sched = LrScheduler::new(&mut opt, SequentialLR::warmup_cosine(warmup, args.steps, 0.1, 3e-4))?;

    // Resume where a previous run stopped.
    let mut step = 0u64;
    if !args.fresh && args.checkpoint.exists() {
        let ckpt = Checkpoint::load(&args.checkpoint)?;
        ckpt.restore(&model, &mut opt, Some(&mut sched), &dev)?;
        step = u64::try_from(ckpt.extra("step", &dev)?.item::<i64>()?).unwrap_or(0);
        println!("resumed from {} at step {step}", args.checkpoint.display());
    }

    let per_epoch = loader.len() as u64;
    while step < args.steps {
        // The epoch's batches, skipping those a resumed run already used.
        let (epoch, skip) = (step / per_epoch, (step % per_epoch) as usize);
        for batch in loader.epoch(epoch)?.skip(skip) {
            if step == args.steps {
                break;
            }
            let windows = &batch?[0];
            let ids = windows.narrow(1, 0, t)?.reshape([-1])?;
            let targets = windows.narrow(1, 1, t)?.reshape([-1])?;
            opt.zero_grad();
            let loss = nn::cross_entropy(&model.forward(&ids)?, &targets)?;
            loss.backward()?;
            opt.step()?;
            sched.step(&mut opt)?;
            dev.mark_step()?;
            step += 1;
            if step.is_multiple_of(10) || step == args.steps {
                println!("step {step:4}: loss {:.4}  lr {:.2e}", loss.item::<f32>()?, sched.last_lr()?[0]);
            }
            if Some(step) == args.stop_after || step.is_multiple_of(20) || step == args.steps {
                let step_t = Tensor::from_slice(&[step as i64], [], &dev)?;
                Checkpoint::training(&model, &opt, Some(&sched), &dev)?
                    .extra("step", &step_t)
                    .save(&args.checkpoint)?;
            }
            if Some(step) == args.stop_after {
                println!("stopped at step {step}; run again to resume from {}", args.checkpoint.display());
                return Ok(());
            }
        }
    }
    // Done: a later run starts afresh.
    std::fs::remove_file(&args.checkpoint).ok();
    Ok(())
}
