//! `lazuli generate`: greedy generation with a small GPT
//! (`lazuli_models::generate`), a growing context beside a fixed window,
//! with the time, plans compiled and pipelines created per window.

use super::{open_device, DeviceChoice};
use lazuli::metrics;
use lazuli_models::generate::{GenConfig, Window};

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

/// The options of `lazuli generate`: greedy generation with a small GPT
/// (context up to 64, 12-token prompt). The growing context is a new size
/// every step; prints time, plans compiled and pipelines created per
/// window.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The device (default: Device::default()).
    #[arg(long)]
    pub device: Option<DeviceChoice>,
    /// The windows to run.
    #[arg(long, value_enum, default_value_t = WindowChoice::Both)]
    pub window: WindowChoice,
    /// Tokens to generate (default: the model's configuration).
    #[arg(long, value_name = "N")]
    pub tokens: Option<usize>,
    /// One JSON object per window instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// `lazuli generate`: greedy generation with a growing and/or a fixed
/// window, side by side, with compile counters.
pub fn run(args: Args) -> Result<(), String> {
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
