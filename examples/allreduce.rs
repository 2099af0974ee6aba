//! All-reduce throughput for data-parallel training (cargo feature `mpi`):
//! under `mpirun -np N`, times (1) the process group's host all-reduce of
//! a gradient volume (default G8's: 3.3M f32 parameters, 13 MB) and (2)
//! `DataParallel::average_gradients` over parameters of that size on this
//! rank's device (sync, download, all-reduce in 25 MB buckets, upload).
//! With `--gpt`, instead: the small GPT step of `GPU.md` (G8-small: 2
//! layers, n_embd 64, context 64, a global batch of 48 sequences split
//! between the ranks) trained data-parallel with the all-reduce recorded
//! into the step (`DataParallel::reduce_in_graph`), with how much of the
//! all-reduce time the rest of the step hid; `--host` averages on the
//! host after backward instead (`DataParallel::average_gradients`). The
//! bucket size is `LAZULI_DIST_BUCKET_BYTES` (default 25 MiB). Rank 0
//! prints the figures BENCHMARKS.md quotes.
//!
//! ```text
//! cargo build --features mpi --example allreduce
//! mpirun -np 2 --oversubscribe target/debug/examples/allreduce [--params N] [--iters N] [--gpt [--host]]
//! ```

use lazuli::distributed::{data_parallel, device_for, DataParallel, ProcessGroup};
use lazuli::nn::{cross_entropy, Module, ModuleExt};
use lazuli::optim::{Adam, Optimizer};
use lazuli::{DType, Device, Tensor};
use lazuli_models::gpt::{GptModel, GptSizes};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut params = 3_300_000usize;
    let mut iters = 20usize;
    let (mut gpt, mut host) = (false, false);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--gpt" => gpt = true,
            "--host" => host = true,
            "--params" | "--iters" => {
                let v = it.next().ok_or(format!("{a} needs a value"))?;
                if a == "--params" {
                    params = v.parse()?;
                } else {
                    iters = v.parse()?;
                }
            }
            other => return Err(format!("unknown option {other:?}").into()),
        }
    }
    if gpt {
        return gpt_steps(iters, host);
    }
    let group = ProcessGroup::init()?;
    let (world, rank) = (group.world_size(), group.rank());
    let dev = device_for(&group)?;
    let bytes = 4.0 * params as f64;
    // (1) The host all-reduce alone.
    let buf = vec![1.0f32; params];
    group.all_reduce_sum("warm-up", buf.clone())?;
    let started = Instant::now();
    for _ in 0..iters {
        let sum = group.all_reduce_sum("all-reduce", buf.clone())?;
        assert_eq!(sum[params / 2], world as f32);
    }
    let host_ms = started.elapsed().as_secs_f64() * 1e3 / iters as f64;
    // (2) The gradient average over parameters of that size on the device:
    // four tensors, as a model's layers.
    let quarter = params / 4;
    let named: Vec<(String, Tensor)> = (0..4)
        .map(|i| {
            let n = if i == 3 { params - 3 * quarter } else { quarter };
            Ok((format!("p{i}"), Tensor::zeros([n], DType::F32, &dev)?))
        })
        .collect::<lazuli::Result<_>>()?;
    let mut dp = DataParallel::new(group, named.clone())?;
    let mut total = 0.0;
    let mut wait = 0.0;
    for i in 0..iters + 2 {
        for (_, p) in &named {
            p.set_grad(Some(Tensor::ones(p.shape().clone(), DType::F32, &dev)?))?;
        }
        let s = dp.average_gradients()?;
        if i >= 2 {
            total += s.seconds;
            wait += s.wait_seconds;
        }
    }
    let dp_ms = total * 1e3 / iters as f64;
    if rank == 0 {
        let ring = 2.0 * (world as f64 - 1.0) / world as f64;
        println!(
            "ranks {world}, device {}, {params} f32 parameters ({:.1} MB), {iters} iterations",
            dev.name(),
            bytes / 1e6
        );
        println!(
            "host all-reduce: {host_ms:.2} ms, {:.2} GB/s of gradient (algorithm), {:.2} GB/s on the wire by the ring's 2(N-1)/N",
            bytes / host_ms / 1e6,
            bytes * ring / host_ms / 1e6
        );
        println!(
            "DataParallel::average_gradients: {dp_ms:.2} ms per step ({:.2} ms waiting for all-reduces, {} bucket(s))",
            wait * 1e3 / iters as f64,
            dp.buckets()
        );
    }
    Ok(())
}

/// G8-small trained data-parallel: per step, the wall time and the
/// gradient exchange, recorded into the step (how much of its all-reduce
/// time the step hid) or, with `host`, on the host after backward.
fn gpt_steps(iters: usize, host: bool) -> Result<(), Box<dyn std::error::Error>> {
    let group = ProcessGroup::init()?;
    let (world, rank) = (group.world_size(), group.rank());
    let global = 48;
    if global % world != 0 {
        return Err(format!("the global batch of {global} sequences does not divide between {world} ranks").into());
    }
    let sizes = GptSizes { batch: global / world, ..GptSizes::SMALL };
    let dev = device_for(&group)?;
    dev.manual_seed(8);
    let model = GptModel::new(sizes, &dev)?;
    let mut dp = data_parallel(group, &model)?;
    let mut opt = Adam::adamw(model.parameters(), 3e-4, 0.01);
    let (ids, targets) = tokens(sizes, rank, &dev)?;
    let (mut total, mut backward, mut exchange, mut wait) = (0.0, 0.0, 0.0, 0.0);
    let mut compiled_at_2 = 0;
    for i in 0..iters + 2 {
        let started = Instant::now();
        opt.zero_grad();
        cross_entropy(&model.forward(&ids)?, &targets)?.backward()?;
        let s = if host { Some(dp.average_gradients()?) } else { None };
        if !host {
            dp.reduce_in_graph()?;
        }
        opt.step()?;
        dev.mark_step()?;
        dev.wait()?;
        if i == 1 {
            // The first two steps compile: left out.
            dp.take_stats();
            compiled_at_2 = dev.compile_counts().0;
        }
        if i >= 2 {
            total += started.elapsed().as_secs_f64();
            if let Some(s) = s {
                backward += s.backward_seconds;
                exchange += s.seconds;
                wait += s.wait_seconds;
            }
        }
    }
    if !host {
        let s = dp.take_stats();
        exchange = s.seconds;
        wait = s.wait_seconds;
    }
    if rank == 0 {
        let ms = |x: f64| x * 1e3 / iters as f64;
        println!(
            "G8-small, {world} rank(s) of {} sequences, device {}, {:.2} MB of gradients in {} bucket(s), {}",
            sizes.batch,
            dev.name(),
            dp.bytes_per_step() as f64 / 1e6,
            dp.buckets(),
            if host { "averaged on the host after backward" } else { "all-reduce recorded into the step" }
        );
        if host {
            println!(
                "step {:.2} ms: recording + backward until the gradients exist {:.2} ms, exchange {:.2} ms \
                 (of which waiting for the all-reduce {:.2} ms), optimizer and the rest {:.2} ms",
                ms(total),
                ms(backward),
                ms(exchange),
                ms(wait),
                ms(total - backward - exchange)
            );
        } else {
            let hidden = if exchange > 0.0 { 100.0 * (1.0 - wait / exchange).max(0.0) } else { 0.0 };
            println!(
                "step {:.2} ms: all-reduce {:.2} ms per step, of which the step waited {:.2} ms \
                 ({hidden:.0}% hidden behind the backward pass and the optimizer); \
                 plans compiled after step 2: {}",
                ms(total),
                ms(exchange),
                ms(wait),
                dev.compile_counts().0 - compiled_at_2
            );
        }
    }
    Ok(())
}

/// Each rank's share of a fixed global batch of token ids and targets.
fn tokens(sizes: GptSizes, rank: usize, dev: &Device) -> lazuli::Result<(Tensor, Tensor)> {
    let (b, t, v) = (sizes.batch, sizes.context, sizes.vocab);
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ rank as u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % v as u64) as i32
    };
    let seq: Vec<i32> = (0..b * (t + 1)).map(|_| next()).collect();
    let ids: Vec<i32> = (0..b).flat_map(|i| seq[i * (t + 1)..i * (t + 1) + t].to_vec()).collect();
    let targets: Vec<i32> = (0..b).flat_map(|i| seq[i * (t + 1) + 1..(i + 1) * (t + 1)].to_vec()).collect();
    Ok((Tensor::from_slice(&ids, [b * t], dev)?, Tensor::from_slice(&targets, [b * t], dev)?))
}
