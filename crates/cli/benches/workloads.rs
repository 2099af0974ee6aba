//! Criterion benches of the workloads in `docs/workloads.md` (W1–W5) and of C1
//! (a 3x3 convolution forward and backward) on the CPU backend and, where
//! an adapter exists, on wgpu, and of the host's cost per recorded op.
//! Sample counts are small:
//! the workloads are large and a software adapter is slow. `lazuli bench`
//! is the harness the figures in BENCHMARKS.md come from; these benches
//! track the same code paths over time.

use criterion::{criterion_group, criterion_main, Criterion};
use lazuli_cli::bench::{self, BenchDevice};
use std::time::Duration;

fn devices() -> Vec<BenchDevice> {
    let mut v = vec![BenchDevice::cpu()];
    match BenchDevice::wgpu() {
        Ok(d) => v.push(d),
        Err(e) => eprintln!("skipping wgpu: {e}"),
    }
    v
}

fn workloads(c: &mut Criterion) {
    for d in devices() {
        let dev = &d.device;
        let mut g = c.benchmark_group(format!("workloads/{}", d.label));
        g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
        let x = bench::w1_input(dev).expect("W1 input");
        g.bench_function("W1 elementwise", |b| b.iter(|| bench::w1_step(&x).expect("W1")));
        drop(x);
        let (a, m) = bench::w2_inputs(dev).expect("W2 inputs");
        g.bench_function("W2 matmul 1024", |b| b.iter(|| bench::w2_step(&a, &m).expect("W2")));
        drop((a, m));
        let x = bench::w3_input(dev).expect("W3 input");
        g.bench_function("W3 softmax", |b| b.iter(|| bench::w3_step(&x).expect("W3")));
        drop(x);
        let mut mlp = bench::Mlp::new(dev).expect("W4 model");
        g.bench_function("W4 mlp step", |b| b.iter(|| mlp.step().expect("W4")));
        let x = bench::w5_input(dev).expect("W5 input");
        g.bench_function("W5 100 tiny ops", |b| b.iter(|| bench::w5_step(&x).expect("W5")));
        let mut conv = bench::ConvStep::new(dev, bench::ConvSizes::C1).expect("C1 inputs");
        g.bench_function("C1 conv2d 3x3 forward + backward", |b| b.iter(|| conv.step().expect("C1")));
        g.finish();
    }
}

/// Host cost per op on the CPU device (no device work to wait for): W5's
/// 200 ops recorded, then recorded and synced (trace, hash, cache hit,
/// submit) with the wait. `lazuli bench H1` splits the same by phase.
fn host(c: &mut Criterion) {
    let d = BenchDevice::cpu();
    let x = bench::w5_input(&d.device).expect("W5 input");
    let chain = || {
        let mut y = x.clone();
        for _ in 0..bench::HOST_OPS / 2 {
            y = y.mul_scalar(1.0001).expect("mul").add_scalar(0.0001).expect("add");
        }
        y
    };
    let mut g = c.benchmark_group("host/cpu");
    g.sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    g.bench_function("record 200 ops", |b| b.iter_with_large_drop(chain));
    g.bench_function("record + sync + wait 200 ops", |b| {
        b.iter(|| {
            chain().sync().expect("sync");
            d.device.wait().expect("wait")
        })
    });
    g.finish();
}

criterion_group!(benches, workloads, host);
criterion_main!(benches);
