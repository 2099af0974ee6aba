//! The `lazuli` command line, one module per command:
//!
//! - `info`: the wgpu adapters and the device `Device::default()` picks;
//! - `demo`: training on the 8x8 digits dataset (an MLP or a small CNN),
//!   or with `--fused` the small fused elementwise example;
//! - `bench`: the benchmark workloads of `WORKLOADS.md` and their
//!   baselines (the workloads are the library's `lazuli::bench`; the
//!   options, progress bar, table and ratios are here);
//! - `generate`: greedy generation with a small GPT, a growing context
//!   beside a fixed window;
//! - `conformance`: the ONNX conformance cases and their per-op table;
//! - `run`: an ONNX model on a device (`lazuli::onnx::cli` holds its logic);
//! - `dump`: the IR, DOT and WGSL of the demo's graph;
//! - `trace`: the steady state of a `LAZULI_TRACE` file in numbers.
//!
//! `lazuli help` (or `--help` after any command) prints `USAGE`, which
//! lists each command with the options its parser accepts.

mod bench;
mod conformance;
mod demo;
mod dump;
mod generate;
mod generate_model;
mod info;
mod run;
mod trace;

use lazuli::prelude::*;
use lazuli::DeviceKind;
use std::process::ExitCode;

/// The commands `main` dispatches, in the order `USAGE` lists them.
const COMMANDS: [&str; 8] = ["info", "demo", "dump", "conformance", "run", "bench", "generate", "trace"];

/// What `lazuli help` prints.
const USAGE: &str = "usage: lazuli <command> [options]

commands:
  info                      list wgpu adapters, the device Device::default() picks and the
                            effective configuration (each variable's value and source)
  demo [--model mlp|cnn] [--device cpu|wgpu] [--epochs N] [--batch N] [--seed N] [--data DIR] [--json]
       [--distributed]
                            train on the 8x8 digits dataset: an MLP (64 -> 256 -> 10, the
                            default) or a LeNet-style CNN (conv 3x3 1->16, ReLU, max-pool 2,
                            conv 3x3 16->32, ReLU, max-pool 2, linear 128->10; 30 epochs);
                            each step is one cached graph (see --json for the counters)
                            --distributed: data-parallel under mpirun -np N (built with
                            --features mpi); --batch is the global batch, rank 0 prints
  demo --fused [--device cpu|wgpu]
                            the small fused elementwise example (one graph, its kernels)
  dump [--device cpu|wgpu]  show the IR, DOT and WGSL of the demo's graph
  conformance [DIR] [--device cpu|wgpu|all]
                            run the ONNX conformance cases (default: LAZULI_CONFORMANCE_DIR or
                            ../shared/conformance/onnx) and print the per-op table
  run MODEL.onnx [--input NAME=FILE.npy ...] [--dim NAME=SIZE ...] [--device cpu|wgpu] [--repeat N]
      [--save DIR] [--json] [--check]
                            run an ONNX model: inputs from .npy files or random with their
                            declared shapes (symbolic dims from --dim); prints each output's
                            shape, dtype and statistics, the first run's time (compile
                            included), the median of --repeat runs (default 5), kernels per
                            run and fallback ops; --save DIR writes DIR/NAME.npy per output
                            (NAME with characters outside [A-Za-z0-9_.-] as _); --json prints
                            one JSON object; --check lists every unsupported node (exit 1)
  bench [W1 ... G1 ... H1 C1 A1 O1] [--scale small|gpu] [--size full|small] [--device cpu|wgpu|all]
        [--json] [--profile] [--amp] [--iterations N]
                            run the benchmark workloads and baselines; prints a table.
                            --scale small (default) runs W1-W6 and H1 (host cost per op, by
                            phase); --scale gpu runs G1-G8 of WORKLOADS.md (G8: the GPT
                            training step, with host and device ms per step); naming workloads
                            runs those (C1, a conv 3x3 forward + backward on x [32,32,32,32],
                            w [64,32,3,3], runs only when named, with the gemm crate on the
                            same three products as its baseline; A1, causal attention on
                            [4, 8, 1024, 64], the fused op beside the unfused composition,
                            forward and forward + backward, with the unfused / fused ratios;
                            O1, whole ONNX models: the onnx wheel's light CNNs and a transformer
                            encoder at batch 8, sequence 128, one row each).
                            --size small runs the G workloads and A1 at sizes for a small box.
                            Full-size G workloads time 10 iterations on a GPU, 3 on cpu and 1
                            on a software adapter unless --iterations is given; one that
                            cannot run on a device (e.g. a tensor over the adapter's binding
                            limit) gives a row with NaN times and the error (key 'error' in
                            --json), and the run goes on. --amp adds mixed-precision rows
                            after G3 (f16 inputs: 'G3 matmul 4096^3 f16') and G8 (under
                            autocast f16 with a grad scaler: 'G8 GPT train step autocast
                            f16'), named as torch_twin.py --engines amp names its rows
  generate [--device cpu|wgpu] [--window growing|fixed|both] [--tokens N] [--json]
           the small GPT demo; with --model FILE (GGUF or a Hugging Face folder) a language model:
           --model FILE [--prompt TEXT | --prompt-ids 1,2,3] [--max-tokens N]
           [--greedy | --temperature T --top-k K --top-p P] [--repeat-penalty R] [--seed S]
           [--context N] [--chunk N] [--device cpu|wgpu] [--json]
                            greedy generation with a small GPT (context up to 64, 12-token
                            prompt): the growing context is a new size every step; prints
                            time, plans compiled and pipelines created per window
  trace FILE [--top N]      summarize a LAZULI_TRACE file's steady state (from the end of its
                            last compile): wall against summed kernel time, the GPU track's
                            idle time, host spans per thread, the N kernels (default 15) that
                            took longest in total, the longest GPU idle stretches and the host
                            spans over them
  help, --help, -h          this text (also `lazuli <command> --help`)

environment: LAZULI_DEVICE, WGPU_BACKEND, WGPU_ADAPTER_NAME, LAZULI_KERNEL_FORMS, LAZULI_AUTOTUNE,
             LAZULI_CACHE_DIR, LAZULI_CACHE_MAX_BYTES, LAZULI_POOL_BYTES, LAZULI_DUMP_DIR, RUST_LOG

compile cache: validated kernels and the driver's pipeline cache persist in LAZULI_CACHE_DIR
(default $XDG_CACHE_HOME/lazuli or ~/.cache/lazuli; empty turns it off), bounded by
LAZULI_CACHE_MAX_BYTES (default 256 MiB, least recently used entries go first); delete the
directory to clear it";

fn main() -> ExitCode {
    init_tracing();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    let result = match args.first().map(String::as_str) {
        Some(c) if COMMANDS.contains(&c) && rest.iter().any(|a| a == "--help" || a == "-h") => {
            println!("{USAGE}");
            Ok(())
        }
        Some("info") => info::run(),
        Some("demo") => demo::run(rest),
        Some("dump") => dump::run(rest),
        Some("conformance") => conformance::run(rest),
        Some("run") => run::run(rest),
        Some("bench") => bench::run(rest),
        Some("generate") => generate::run(rest),
        Some("trace") => trace::run(rest),
        Some("help") | Some("--help") | Some("-h") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lazuli: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// The device `--device cpu|wgpu` names, else `Device::default()`;
/// any other option is an error.
fn device_arg(args: &[String]) -> Result<Device, String> {
    device_and_reason(args).map(|(d, _)| d)
}

/// [`device_arg`] with why that device: the option, or what
/// `Device::default()` chose and why.
fn device_and_reason(args: &[String]) -> Result<(Device, String), String> {
    let mut it = args.iter();
    let mut kind = None;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => {
                kind = match it.next().map(String::as_str) {
                    Some("cpu") => Some(DeviceKind::Cpu),
                    Some("wgpu") => Some(DeviceKind::Wgpu),
                    other => return Err(format!("--device takes cpu or wgpu, got {other:?}")),
                }
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    match kind {
        None => match Device::default_choice() {
            Ok((d, choice)) => Ok((d, format!("the default: {}", choice.reason))),
            Err(e) => Err(e.to_string()),
        },
        Some(k) => {
            let reason = format!("--device {}", if k == DeviceKind::Cpu { "cpu" } else { "wgpu" });
            Device::of_kind(k).map(|d| (d, reason)).map_err(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{COMMANDS, USAGE};

    /// Every command `main` dispatches has its own line in `USAGE`.
    #[test]
    fn usage_lists_every_command() {
        for c in COMMANDS {
            let line = format!("\n  {c} ");
            assert!(USAGE.contains(&line), "USAGE has no line for {c}");
        }
    }
}
