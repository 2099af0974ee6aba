//! The `lazuli` command line: `info`, `demo`, `dump`.

use lazuli::prelude::*;
use lazuli::{debug, metrics, DeviceKind};
use std::process::ExitCode;

const USAGE: &str = "usage: lazuli <command> [options]

commands:
  info                      list wgpu adapters, the device Device::default() picks and the
                            effective configuration (each variable's value and source)
  demo [--model mlp|cnn] [--device cpu|wgpu] [--epochs N] [--seed N] [--data DIR] [--json]
                            train on the 8x8 digits dataset: an MLP (64 -> 256 -> 10, the
                            default) or a LeNet-style CNN (conv 3x3 1->16, ReLU, max-pool 2,
                            conv 3x3 16->32, ReLU, max-pool 2, linear 128->10; 30 epochs);
                            each step is one cached graph (see --json for the counters)
  demo --fused [--device cpu|wgpu]
                            the small fused elementwise example (one graph, its kernels)
  dump [--device cpu|wgpu]  show the IR, DOT and WGSL of the demo's graph
  conformance [DIR] [--device cpu|wgpu|all]
                            run the ONNX conformance cases (default: LAZULI_CONFORMANCE_DIR or
                            ../shared/conformance/onnx) and print the per-op table
  bench [W1 ... G1 ... H1 C1 A1] [--scale small|gpu] [--size full|small] [--device cpu|wgpu|all]
        [--json] [--profile] [--iterations N]
                            run the benchmark workloads and baselines; prints a table.
                            --scale small (default) runs W1-W6 and H1 (host cost per op, by
                            phase); --scale gpu runs G1-G8 of WORKLOADS.md (G8: the GPT
                            training step, with host and device ms per step); naming workloads
                            runs those (C1, a conv 3x3 forward + backward on x [32,32,32,32],
                            w [64,32,3,3], runs only when named, with the gemm crate on the
                            same three products as its baseline; A1, causal attention on
                            [4, 8, 1024, 64], the fused op beside the unfused composition,
                            forward and forward + backward, with the unfused / fused ratios).
                            --size small runs the G workloads and A1 at sizes for a small box. Full-size G workloads time 10
                            iterations on a GPU, 3 on cpu and 1 on a software adapter unless
                            --iterations is given; one that cannot run on a device (e.g. a
                            tensor over the adapter's binding limit) gives a row with NaN times
                            and the error (key 'error' in --json), and the run goes on
  generate [--device cpu|wgpu] [--window growing|fixed|both] [--tokens N] [--json]
                            greedy generation with a small GPT (context up to 64, 12-token
                            prompt): the growing context is a new size every step; prints
                            time, plans compiled and pipelines created per window
  help                      this text

environment: LAZULI_DEVICE, WGPU_BACKEND, WGPU_ADAPTER_NAME, LAZULI_KERNEL_FORMS, LAZULI_AUTOTUNE,
             LAZULI_CACHE_DIR, LAZULI_CACHE_MAX_BYTES, LAZULI_POOL_BYTES, LAZULI_DUMP_DIR, RUST_LOG

compile cache: validated kernels and the driver's pipeline cache persist in LAZULI_CACHE_DIR
(default $XDG_CACHE_HOME/lazuli or ~/.cache/lazuli; empty turns it off), bounded by
LAZULI_CACHE_MAX_BYTES (default 256 MiB, least recently used entries go first); delete the
directory to clear it";

fn main() -> ExitCode {
    init_tracing();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("info") => info(),
        Some("demo") => demo_command(&args[1..]),
        Some("dump") => device_arg(&args[1..]).and_then(|d| dump(&d)),
        Some("conformance") => conformance(&args[1..]),
        Some("bench") => lazuli::bench::cli(&args[1..]),
        Some("generate") => generate_command(&args[1..]),
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

fn device_arg(args: &[String]) -> Result<Device, String> {
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
        None => Ok(Device::default()),
        Some(k) => Device::of_kind(k).map_err(|e| e.to_string()),
    }
}

/// `lazuli generate`: greedy generation with a growing and/or a fixed
/// window, side by side, with compile counters.
fn generate_command(args: &[String]) -> Result<(), String> {
    use lazuli::generate::{run, GenConfig, Window};
    let mut cfg = GenConfig::default();
    let mut windows = vec![Window::Growing, Window::Fixed];
    let mut device_args = Vec::new();
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--device" => device_args.extend(["--device".to_string(), value("--device")?]),
            "--tokens" => cfg.tokens = value("--tokens")?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--window" => {
                windows = match value("--window")?.as_str() {
                    "growing" => vec![Window::Growing],
                    "fixed" => vec![Window::Fixed],
                    "both" => vec![Window::Growing, Window::Fixed],
                    other => return Err(format!("--window takes growing, fixed or both, got {other:?}")),
                }
            }
            "--json" => json = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let dev = device_arg(&device_args)?;
    let mut rows = Vec::new();
    for w in windows {
        let r = run(cfg, w, &dev).map_err(|e| e.to_string())?;
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

fn info() -> Result<(), String> {
    let adapters = lazuli::adapters();
    println!("wgpu adapters ({}):", adapters.len());
    for a in &adapters {
        println!("  {a}");
    }
    let dev = Device::default();
    println!("default device: {}", dev.name());
    let config = dev.configuration();
    println!("{config}");
    config.check().map_err(|e| e.to_string())
}

/// The demo computation: W1's elementwise chain over a 1024 x 1024 input,
/// plus a row-sum, synced as one graph.
fn demo_graph(dev: &Device) -> lazuli::Result<(Tensor, Tensor)> {
    let n = 1024usize;
    let data: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let x = Tensor::from_slice(&data, [n, n], dev)?;
    let y = (((&x * 1.5)? + 0.5)?.relu()? - 0.25)?.tanh()?.mul_scalar(2.0)?;
    let row_sums = y.sum(&[1], false)?;
    Ok((y, row_sums))
}

fn fused_demo(dev: &Device) -> Result<(), String> {
    let err = |e: lazuli::ExecError| e.to_string();
    println!("device: {}", dev.name());
    metrics::reset();
    let started = std::time::Instant::now();
    let (y, row_sums) = demo_graph(dev).map_err(err)?;
    let code = debug::backend_code(&[&y, &row_sums]).map_err(err)?;
    lazuli::sync(&[&y, &row_sums]).map_err(err)?;
    let sums = row_sums.to_vec::<f32>().map_err(err)?;
    let vals = y.to_vec::<f32>().map_err(err)?;
    let elapsed = started.elapsed();
    let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / vals.len() as f64;
    let (lo, hi) = vals.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| (a.min(v), b.max(v)));
    println!("y = tanh(relu(x * 1.5 + 0.5) - 0.25) * 2 over x: f32[1024, 1024]");
    println!("  y: mean {mean:.6}, min {lo:.6}, max {hi:.6}; row sums [0..4]: {:?}", &sums[..4]);
    println!("  wall time (first run, compile included): {:.1} ms", elapsed.as_secs_f64() * 1e3);
    println!(
        "compiled to {} kernel(s)",
        code.len().max(metrics::value("KernelsPerPlan").map(|v| v.last as usize).unwrap_or(0))
    );
    println!(
        "compile cache: UncachedCompile={} CachedCompile={} KernelLaunches={}",
        metrics::counter("UncachedCompile"),
        metrics::counter("CachedCompile"),
        metrics::counter("KernelLaunches")
    );
    for (name, src) in &code {
        println!("--- {name} ---\n{src}");
    }
    println!("{}", metrics::report());
    Ok(())
}

fn dump(dev: &Device) -> Result<(), String> {
    let err = |e: lazuli::ExecError| e.to_string();
    let (y, row_sums) = demo_graph(dev).map_err(err)?;
    println!("== IR ==\n{}", debug::ir_text(&[&y, &row_sums]));
    println!("== graph hash ==\n{:016x}\n", debug::graph_hash(&[&y, &row_sums]));
    println!("== DOT ==\n{}", debug::ir_dot(&[&y, &row_sums]));
    for (name, src) in debug::backend_code(&[&y, &row_sums]).map_err(err)? {
        println!("== {name} ==\n{src}");
    }
    Ok(())
}

/// `lazuli demo`: the training demo (`lazuli::train`), or with `--fused`
/// the fused elementwise example.
fn demo_command(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--fused") {
        let rest: Vec<String> = args.iter().filter(|a| *a != "--fused").cloned().collect();
        return device_arg(&rest).and_then(|d| fused_demo(&d));
    }
    // The model decides the defaults the other options override.
    let mut model = lazuli::train::DigitsModel::Mlp;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--model" {
            let v = it.next().ok_or("--model needs a value")?;
            model =
                lazuli::train::DigitsModel::parse(v).ok_or_else(|| format!("--model takes mlp or cnn, got {v:?}"))?;
        }
    }
    let mut cfg = lazuli::train::TrainConfig::for_model(model);
    let (mut device_args, mut json, mut data_dir) = (Vec::new(), false, lazuli::train::Digits::default_dir());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--model" => {
                value("--model")?;
            }
            "--device" => device_args.extend(["--device".to_string(), value("--device")?]),
            "--epochs" => cfg.epochs = value("--epochs")?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--seed" => cfg.seed = value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--data" => data_dir = value("--data")?.into(),
            "--json" => json = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let dev = device_arg(&device_args)?;
    let data = lazuli::train::Digits::load(&data_dir).map_err(|e| e.to_string())?;
    if !json {
        println!("device: {}", dev.name());
        let what = match cfg.model {
            lazuli::train::DigitsModel::Mlp => format!("an MLP 64 -> {} -> 10", cfg.hidden),
            lazuli::train::DigitsModel::Cnn => {
                "a CNN (conv 3x3 1->16, ReLU, max-pool 2, conv 3x3 16->32, ReLU, max-pool 2, linear 128->10)".into()
            }
        };
        println!(
            "training {what} on digits ({} train / {} test rows), batch {}, SGD lr {} (Nesterov momentum {}), {} epochs",
            lazuli::train::DIGITS_TRAIN_ROWS,
            data.len() - lazuli::train::DIGITS_TRAIN_ROWS,
            cfg.batch_size,
            cfg.lr,
            cfg.momentum,
            cfg.epochs
        );
    }
    let style = indicatif::ProgressStyle::with_template("epoch {prefix:>3} [{bar:30}] {pos}/{len} {msg}")
        .map_err(|e| e.to_string())?
        .progress_chars("=> ");
    let mut bar: Option<indicatif::ProgressBar> = None;
    let mut progress = |p: &lazuli::train::Progress| {
        if json {
            return;
        }
        let b = bar.get_or_insert_with(|| {
            let b = indicatif::ProgressBar::new(p.steps_per_epoch as u64).with_style(style.clone());
            b.set_prefix(format!("{}", p.epoch + 1));
            b
        });
        b.set_position(p.step_in_epoch as u64);
        if let Some(l) = p.loss {
            b.set_message(format!("loss {l:.4}"));
        }
        if let Some(l) = p.epoch_loss {
            b.finish_with_message(format!("mean loss {l:.4}"));
            bar = None;
        }
    };
    metrics::reset();
    let report = lazuli::train::train_digits(&dev, &data, &cfg, &mut progress).map_err(|e| e.to_string())?;
    if json {
        println!("{}", report.to_json());
        return Ok(());
    }
    println!("test accuracy: {:.2}% (train {:.2}%)", report.test_accuracy * 100.0, report.train_accuracy * 100.0);
    println!(
        "{} steps in {:.2} s: median {:.3} ms per step (mean {:.3} ms), each step one sync",
        report.steps, report.train_seconds, report.median_step_ms, report.mean_step_ms
    );
    println!(
        "compile cache: UncachedCompile={} CachedCompile={} (uncached after step 2: {})",
        report.uncached_compiles, report.cached_compiles, report.uncached_compiles_after_step_2
    );
    println!(
        "one step = {} graph nodes in {} kernel(s); {} node(s) ran on the CPU fallback",
        report.graph_nodes_per_step, report.kernels_per_step, report.fallback_ops
    );
    if !report.fallback_by_op.is_empty() {
        let by_op: Vec<String> = report.fallback_by_op.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("fallback by op: {}", by_op.join(" "));
    }
    println!("\n{}", metrics::report());
    Ok(())
}

/// `lazuli conformance [DIR] [--device cpu|wgpu|all]`: runs every ONNX
/// conformance case on the chosen backends (default: both) and prints the
/// per-op table and the `conformance: N passed, M failed, K unsupported`
/// line; fails when a case fails.
fn conformance(args: &[String]) -> Result<(), String> {
    let mut dir = None;
    let mut which = "all".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => which = it.next().cloned().unwrap_or_default(),
            s if s.starts_with("--") => return Err(format!("unknown option {s:?}")),
            s => dir = Some(std::path::PathBuf::from(s)),
        }
    }
    let dir = dir.unwrap_or_else(lazuli::onnx::default_dir);
    let mut devices = Vec::new();
    if which == "cpu" || which == "all" {
        devices.push(("cpu", Device::cpu()));
    }
    if which == "wgpu" || which == "all" {
        devices.push(("wgpu", Device::wgpu().map_err(|e| format!("no wgpu device: {e}"))?));
    }
    if devices.is_empty() {
        return Err(format!("--device takes cpu, wgpu or all, got {which:?}"));
    }
    let backends: Vec<(&str, &Device)> = devices.iter().map(|(n, d)| (*n, d)).collect();
    let report = lazuli::onnx::run_dir(&dir, &backends).map_err(|e| e.to_string())?;
    println!("conformance cases from {}", dir.display());
    print!("{}", report.table());
    println!("{}", report.summary_line());
    match report.totals().failed {
        0 => Ok(()),
        n => Err(format!("{n} conformance case(s) failed")),
    }
}
