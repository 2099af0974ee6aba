//! Matmul kernel experiments: times a hand-written WGSL matmul (bindings:
//! uniform, a, b, c; shapes baked in) on 1024 x 1024 x 1024 and checks it.
//! `cargo run --release -p lazuli-cli --example mmx -- FILE WGX [WGY]`.

use lazuli_cli::bench::handwritten::{Baseline, BaselineBinding};
use lazuli_wgpu::{WgpuBackend, WgpuOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let src = std::fs::read_to_string(&args[0]).expect("read");
    let wx: u32 = args[1].parse().unwrap();
    let wy: u32 = args.get(2).map_or(1, |s| s.parse().unwrap());
    let dim = |i: usize| args.get(i).map_or(1024, |s| s.parse().unwrap());
    let (m, n, kk) = (dim(3), dim(4), dim(5));
    let a: Vec<f32> = (0..m * kk).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let bm: Vec<f32> = (0..kk * n).map(|i| ((i * 104729) % 1999) as f32 / 1000.0 - 1.0).collect();
    let be = WgpuBackend::new(WgpuOptions::default()).expect("adapter");
    let base = Baseline::new(
        &be,
        &src,
        &[
            BaselineBinding::Uniform(vec![0; 16]),
            BaselineBinding::Input(bytemuck::cast_slice(&a).to_vec()),
            BaselineBinding::Input(bytemuck::cast_slice(&bm).to_vec()),
            BaselineBinding::Output((m * n * 4) as u64),
        ],
        [wx, wy, 1],
    )
    .expect("pipeline");
    let mut t = base.time(2, 15).expect("run");
    t.sort();
    let c = base.read_f32(3).unwrap();
    let mut err = 0f32;
    for &(i, j) in &[(0usize, 0usize), (5, 1023), (1023, 7), (517, 333), (1000, 1000), (64, 65)] {
        let (i, j) = (i % m, j % n);
        let r: f32 = (0..kk).map(|k| a[i * kk + k] * bm[k * n + j]).sum();
        err = err.max((r - c[i * n + j]).abs());
    }
    println!(
        "{}: median {:.1} ms min {:.1} ms, max err {err:.2e}",
        args[0],
        t[7].as_secs_f64() * 1e3,
        t[0].as_secs_f64() * 1e3
    );
}
