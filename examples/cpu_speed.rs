//! CPU backend speed check: W1 (elementwise chain), W2 (matmul), W3
//! (softmax) and W5 (100 tiny ops) from `WORKLOADS.md`, plus the memcpy
//! baseline, each timed on `Device::cpu()` through the public API.
//!
//! Run with `cargo run --release --example cpu_speed`; pass workload ids
//! (`W1 W3`) to run only some. Every iteration ends with `dev.wait()`.

use lazuli::prelude::*;
use std::time::{Duration, Instant};

const WARMUP: usize = 3;
const ITERS: usize = 10;

/// Times `f` (which must end with a device wait): median, min, max in ms.
fn time(mut f: impl FnMut() -> lazuli::Result<()>) -> lazuli::Result<(f64, f64, f64)> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut ts: Vec<Duration> = Vec::with_capacity(ITERS);
    for _ in 0..ITERS {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed());
    }
    ts.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Ok((ms(ts[ITERS / 2]), ms(ts[0]), ms(ts[ITERS - 1])))
}

fn report(id: &str, (med, min, max): (f64, f64, f64), rate: Option<(f64, &str)>) {
    let rate = rate.map(|(per_ms, unit)| format!("{:8.2} {unit}", per_ms / med)).unwrap_or_default();
    println!("{id:<8} median {med:9.3} ms  min {min:9.3}  max {max:9.3}  {rate}");
}

/// Deterministic values in [-1, 1).
fn data(n: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9u32;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

fn main() -> lazuli::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |id: &str| args.is_empty() || args.iter().any(|a| a.eq_ignore_ascii_case(id));
    let dev = Device::cpu();

    if want("memcpy") {
        let n = 16 << 20; // 64 MiB of f32
        let src = vec![1.0f32; n];
        let mut dst = vec![0.0f32; n];
        let t = time(|| {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            Ok(())
        })?;
        report("memcpy", t, Some((2.0 * 4.0 * n as f64 / 1e6, "GB/s")));
    }

    if want("W1") {
        let n = 4096 * 4096;
        let x = Tensor::from_slice(&data(n), [4096, 4096], &dev)?;
        let t = time(|| {
            let y = ((((&x * 1.5)? + 0.5)?.relu()? - 0.25)?.tanh()? * 2.0)?;
            y.sync()?;
            dev.wait()
        })?;
        report("W1", t, Some((2.0 * 4.0 * n as f64 / 1e6, "GB/s")));
    }

    if want("W2") {
        let n = 1024;
        let a = Tensor::from_slice(&data(n * n), [n, n], &dev)?;
        let b = Tensor::from_slice(&data(n * n), [n, n], &dev)?;
        let t = time(|| {
            a.matmul(&b)?.sync()?;
            dev.wait()
        })?;
        report("W2", t, Some((2.0 * (n * n * n) as f64 / 1e6, "GFLOP/s")));
    }

    if want("W3") {
        let (r, c) = (4096, 1024);
        let x = Tensor::from_slice(&data(r * c), [r, c], &dev)?;
        let t = time(|| {
            x.softmax(-1)?.sync()?;
            dev.wait()
        })?;
        report("W3", t, Some((2.0 * 4.0 * (r * c) as f64 / 1e6, "GB/s")));
    }

    if want("W5") {
        let x0 = Tensor::from_slice(&data(1024), [1024], &dev)?;
        let t = time(|| {
            let mut x = x0.clone();
            for _ in 0..100 {
                x = ((&x * 1.0001)? + 0.0001)?;
            }
            x.sync()?;
            dev.wait()
        })?;
        report("W5", t, None);
    }
    Ok(())
}
