//! All-reduce throughput for data-parallel training (cargo feature `mpi`):
//! under `mpirun -np N`, times (1) the process group's host all-reduce of
//! a gradient volume (default G8's: 3.3M f32 parameters, 13 MB) and (2)
//! `DataParallel::average_gradients` over parameters of that size on this
//! rank's device (sync, download, all-reduce in 25 MB buckets, upload).
//! Rank 0 prints the figures BENCHMARKS.md quotes.
//!
//! ```text
//! cargo build --features mpi --example allreduce
//! mpirun -np 2 --oversubscribe target/debug/examples/allreduce [--params N] [--iters N]
//! ```

use lazuli::distributed::{device_for, DataParallel, ProcessGroup};
use lazuli::{DType, Tensor};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut params = 3_300_000usize;
    let mut iters = 20usize;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let v = it.next().ok_or(format!("{a} needs a value"))?;
        match a.as_str() {
            "--params" => params = v.parse()?,
            "--iters" => iters = v.parse()?,
            other => return Err(format!("unknown option {other:?}").into()),
        }
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
