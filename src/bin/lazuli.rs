//! The `lazuli` command line: `info`, `demo`, `dump`.

use lazuli::prelude::*;
use lazuli::{debug, metrics, DeviceKind};
use std::process::ExitCode;

const USAGE: &str = "usage: lazuli <command> [options]

commands:
  info                      list wgpu adapters and the device Device::default() picks
  demo [--device cpu|wgpu]  run the end-to-end example on the default (or given) device
  dump [--device cpu|wgpu]  show the IR, DOT and WGSL of the demo's graph
  help                      this text

environment: LAZULI_DEVICE, WGPU_BACKEND, WGPU_ADAPTER_NAME, LAZULI_DUMP_DIR, RUST_LOG";

fn main() -> ExitCode {
    init_tracing();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("info") => info(),
        Some("demo") => device_arg(&args[1..]).and_then(|d| demo(&d)),
        Some("dump") => device_arg(&args[1..]).and_then(|d| dump(&d)),
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

fn info() -> Result<(), String> {
    let adapters = lazuli::adapters();
    println!("wgpu adapters ({}):", adapters.len());
    for a in &adapters {
        println!("  {a}");
    }
    let dev = Device::default();
    println!("default device: {}", dev.name());
    Ok(())
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

fn demo(dev: &Device) -> Result<(), String> {
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
    println!("compiled to {} kernel(s)", code.len().max(metrics::value("KernelsPerPlan").map(|v| v.last as usize).unwrap_or(0)));
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
