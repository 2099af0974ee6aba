//! `lazuli demo`: training on the 8x8 digits dataset (`lazuli::train`, an
//! MLP or a small CNN) with a progress bar and the compile counters, or
//! with `--fused` the small fused elementwise example: one graph, its
//! kernels and their WGSL. With `--distributed` (a CLI built with the
//! cargo feature `mpi`, run under `mpirun -np N`) the training is
//! data-parallel across the ranks; rank 0 prints.

use lazuli::prelude::*;
use lazuli::{debug, metrics};
use lazuli_distributed::ProcessGroup;

/// `lazuli demo`: the training demo (`lazuli::train`), or with `--fused`
/// the fused elementwise example.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--fused") {
        let rest: Vec<String> = args.iter().filter(|a| *a != "--fused").cloned().collect();
        return crate::device_and_reason(&rest).and_then(|(d, why)| fused_demo(&d, &why));
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
    let mut distributed = false;
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
            "--batch" => cfg.batch_size = value("--batch")?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--json" => json = true,
            "--distributed" => distributed = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let group = if distributed { Some(process_group()?) } else { None };
    // Only rank 0 prints.
    let quiet = group.as_ref().is_some_and(|g| g.rank() != 0);
    let (dev, why) = match &group {
        Some(g) if device_args.is_empty() => (rank_device(g)?, "this rank's device".to_string()),
        _ => crate::device_and_reason(&device_args)?,
    };
    let data = lazuli::train::Digits::load(&data_dir).map_err(|e| e.to_string())?;
    if let (Some(g), false) = (&group, json || quiet) {
        println!(
            "data-parallel over {} rank(s) ({:?}): batch {} per rank, gradients averaged every step",
            g.world_size(),
            g.transport(),
            cfg.batch_size / g.world_size().max(1)
        );
    }
    if !json && !quiet {
        println!("device: {} ({why})", dev.name());
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
        if json || quiet {
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
    let report = match group {
        Some(g) => train_distributed(&dev, &data, &cfg, g, &mut progress)?,
        None => lazuli::train::train_digits(&dev, &data, &cfg, &mut progress).map_err(|e| e.to_string())?,
    };
    if quiet {
        return Ok(());
    }
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
        "compile cache: {} plans compiled, CachedCompile={} (compiled after step 2: {})",
        report.uncached_compiles, report.cached_compiles, report.uncached_compiles_after_step_2
    );
    println!(
        "one step = {} graph nodes in {} kernel(s); {} node(s) ran on the CPU fallback",
        report.graph_nodes_per_step, report.kernels_per_step, report.fallback_ops
    );
    if let Some(d) = &report.distributed {
        println!(
            "all-reduce in the step: {} ranks, {:.3} MB of gradients per step in {} bucket(s), {:.3} ms per step, \
             of which the step waited {:.3} ms (the rest hidden behind the backward pass)",
            d.world_size,
            d.allreduce_bytes_per_step as f64 / 1e6,
            d.buckets,
            d.allreduce_ms_per_step,
            d.allreduce_wait_ms_per_step
        );
    }
    if !report.fallback_by_op.is_empty() {
        let by_op: Vec<String> = report.fallback_by_op.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("fallback by op: {}", by_op.join(" "));
    }
    println!("\n{}", metrics::report());
    Ok(())
}

/// What `--distributed` says in a CLI built without the feature `mpi`.
#[cfg(not(feature = "mpi"))]
const NO_MPI: &str = "--distributed needs a lazuli built with the cargo feature `mpi` (cargo build --features mpi)";

#[cfg(feature = "mpi")]
fn process_group() -> Result<ProcessGroup, String> {
    ProcessGroup::init().map_err(|e| e.to_string())
}

#[cfg(not(feature = "mpi"))]
fn process_group() -> Result<ProcessGroup, String> {
    Err(NO_MPI.into())
}

#[cfg(feature = "mpi")]
fn rank_device(group: &ProcessGroup) -> Result<Device, String> {
    lazuli::distributed::device_for(group).map_err(|e| e.to_string())
}

#[cfg(not(feature = "mpi"))]
fn rank_device(_group: &ProcessGroup) -> Result<Device, String> {
    Err(NO_MPI.into())
}

#[cfg(feature = "mpi")]
fn train_distributed(
    dev: &Device,
    data: &lazuli::train::Digits,
    cfg: &lazuli::train::TrainConfig,
    group: ProcessGroup,
    progress: &mut dyn FnMut(&lazuli::train::Progress),
) -> Result<lazuli::train::TrainReport, String> {
    lazuli::train::train_digits_distributed(dev, data, cfg, group, progress).map_err(|e| e.to_string())
}

#[cfg(not(feature = "mpi"))]
fn train_distributed(
    _dev: &Device,
    _data: &lazuli::train::Digits,
    _cfg: &lazuli::train::TrainConfig,
    _group: ProcessGroup,
    _progress: &mut dyn FnMut(&lazuli::train::Progress),
) -> Result<lazuli::train::TrainReport, String> {
    Err(NO_MPI.into())
}

/// The demo computation: W1's elementwise chain over a 1024 x 1024 input,
/// plus a row-sum, synced as one graph.
pub(crate) fn demo_graph(dev: &Device) -> lazuli::Result<(Tensor, Tensor)> {
    let n = 1024usize;
    let data: Vec<f32> = (0..n * n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let x = Tensor::from_slice(&data, [n, n], dev)?;
    let y = (((&x * 1.5)? + 0.5)?.relu()? - 0.25)?.tanh()?.mul_scalar(2.0)?;
    let row_sums = y.sum(&[1], false)?;
    Ok((y, row_sums))
}

/// `lazuli demo --fused`: runs the demo graph once on `dev` (compile
/// included) and prints its values, kernels, WGSL and counters.
fn fused_demo(dev: &Device, why: &str) -> Result<(), String> {
    let err = |e: lazuli::ExecError| e.to_string();
    println!("device: {} ({why})", dev.name());
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
