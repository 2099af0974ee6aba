//! Elementwise kernel experiments: times a hand-written WGSL kernel
//! (bindings: uniform, x, y; 4096 x 4096 f32) on the backend's adapter.
//! `cargo run --release -p lazuli-cli --example ewx -- FILE WORKGROUPS`.

use lazuli_cli::bench::handwritten::{Baseline, BaselineBinding};
use lazuli_wgpu::{WgpuBackend, WgpuOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let src = std::fs::read_to_string(&args[0]).expect("read");
    let wx: u32 = args[1].parse().unwrap();
    let n = 4096 * 4096;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let be = WgpuBackend::new(WgpuOptions::default()).expect("adapter");
    let base = Baseline::new(
        &be,
        &src,
        &[
            BaselineBinding::Uniform(vec![0; 16]),
            BaselineBinding::Input(bytemuck::cast_slice(&x).to_vec()),
            BaselineBinding::Output((n * 4) as u64),
        ],
        [wx, 1, 1],
    )
    .expect("pipeline");
    let mut t = base.time(2, 9).expect("run");
    t.sort();
    let y = base.read_f32(2).unwrap();
    println!("y[0] = {}", y[0]);
    let mut err = 0f32;
    for i in [0usize, 1, 2, 3, 4, 5, 77, 1000, n - 1] {
        let r = ((x[i] * 1.5 + 0.5).max(0.0) - 0.25).tanh() * 2.0;
        err = err.max((r - y[i]).abs());
    }
    println!(
        "{}: median {:.1} ms min {:.1} ms, max err {err:.2e}",
        args[0],
        t[4].as_secs_f64() * 1e3,
        t[0].as_secs_f64() * 1e3
    );
}
