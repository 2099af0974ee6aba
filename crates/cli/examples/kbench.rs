//! Kernel micro-benchmark straight on the backend (no executor): W1, W2, W3
//! and the hand-written baselines. `cargo run --release -p lazuli-cli
//! --example kbench [w1|w2|w3|base]... [tiled] [src]`; `tiled` forces the
//! workgroup-memory matmul. The full harness is `lazuli bench`.

use lazuli::ir::{BinaryOp, DType, Graph, Op, ScalarValue, UnaryOp, ValueType};
use lazuli_cli::bench::handwritten::{Baseline, BaselineBinding, MATMUL_NAIVE, W1_VEC4};
use lazuli_executor::Backend;
use lazuli_wgpu::{WgpuBackend, WgpuOptions};
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e3
}

/// Times `g`; with `sync` every iteration reads its first output back.
fn time_graph_sync(
    b: &WgpuBackend,
    g: Graph,
    inputs: &[Vec<f32>],
    scalars: &[ScalarValue],
    sync: bool,
) -> (f64, String) {
    let params = g.params.clone();
    let v = g.verify().expect("valid");
    let exe = b.compile(&v).expect("compile");
    let src = exe.kernel_sources().into_iter().map(|(n, s)| format!("--- {n}\n{s}")).collect::<Vec<_>>().join("\n");
    let bufs: Vec<_> =
        inputs.iter().zip(&params).map(|(d, ty)| b.upload(bytemuck::cast_slice(d), ty).expect("upload")).collect();
    let mut times = Vec::new();
    for i in 0..13 {
        let t = Instant::now();
        let outs = b.execute(exe.as_ref(), bufs.clone(), scalars).expect("execute");
        if sync {
            let y = b.download(&outs[0]).expect("download");
            if i == 0 {
                println!("first output value: {}", f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
            }
        }
        let e = t.elapsed();
        drop(outs);
        if i >= 3 {
            times.push(e);
        }
    }
    (median(times), src)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let want = |w: &str| args.is_empty() || args.iter().any(|a| a == w);
    let show = args.iter().any(|a| a == "src");
    let tiled = args.iter().any(|a| a == "tiled");
    let b = WgpuBackend::new(WgpuOptions { tiled_matmul: Some(tiled), ..WgpuOptions::default() }).expect("adapter");
    println!("{}", b.name());
    let n = 4096 * 4096;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let gb = |bytes: f64, ms: f64| bytes / ms / 1e6;
    if want("w1") {
        let mut g = Graph::new();
        let xp = g.param(ValueType::new([4096, 4096], DType::F32));
        let s: Vec<_> = (0..4).map(|_| g.scalar(DType::F32)).collect();
        let t = g.push(Op::Binary(BinaryOp::Mul), &[xp, s[0]]).unwrap();
        let t = g.push(Op::Binary(BinaryOp::Add), &[t, s[1]]).unwrap();
        let t = g.push(Op::Unary(UnaryOp::Relu), &[t]).unwrap();
        let t = g.push(Op::Binary(BinaryOp::Sub), &[t, s[2]]).unwrap();
        let t = g.push(Op::Unary(UnaryOp::Tanh), &[t]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Mul), &[t, s[3]]).unwrap();
        g.outputs.push(y);
        let sc = [1.5, 0.5, 0.25, 2.0].map(ScalarValue::Float);
        let (ms, src) = time_graph(&b, g, std::slice::from_ref(&x), &sc);
        println!("W1 generated: {ms:.2} ms, {:.2} GB/s", gb(8.0 * n as f64, ms));
        if show {
            println!("{src}");
        }
    }
    if let Some(pos) = args.iter().position(|a| a == "file") {
        // Experiment: a W1-shaped shader from a file, `vec4s` vec4 per invocation.
        let src = std::fs::read_to_string(&args[pos + 1]).expect("shader file");
        let per: u32 = args[pos + 2].parse().expect("vec4 per invocation");
        let mut u = vec![(n / 4) as u32];
        u.extend([1.5f32, 0.5, 0.25, 2.0].map(f32::to_bits));
        u.extend([0u32; 3]);
        let groups = ((n / 4) as u32).div_ceil(256 * per);
        let base = Baseline::new(
            &b,
            &src,
            &[
                BaselineBinding::Uniform(bytemuck::cast_slice(&u).to_vec()),
                BaselineBinding::Input(bytemuck::cast_slice(&x).to_vec()),
                BaselineBinding::Output(4 * n as u64),
            ],
            [groups.min(65535), groups.div_ceil(65535), 1],
        )
        .expect("baseline");
        let ms = median(base.time(3, 10).unwrap());
        let y = base.read_f32(2).unwrap();
        let want = |x: f32| ((x * 1.5 + 0.5f32).max(0.0) - 0.25).tanh() * 2.0;
        let err = (0..n).step_by(9973).map(|i| (y[i] - want(x[i])).abs()).fold(0.0f32, f32::max);
        println!("file: {ms:.2} ms, {:.2} GB/s, max err {err}", gb(8.0 * n as f64, ms));
        return;
    }
    if want("base") {
        let mut u = vec![(n / 4) as u32];
        u.extend([1.5f32, 0.5, 0.25, 2.0].map(f32::to_bits));
        u.extend([0u32; 3]);
        let groups = ((n / 4) as u32).div_ceil(256);
        let base = Baseline::new(
            &b,
            W1_VEC4,
            &[
                BaselineBinding::Uniform(bytemuck::cast_slice(&u).to_vec()),
                BaselineBinding::Input(bytemuck::cast_slice(&x).to_vec()),
                BaselineBinding::Output(4 * n as u64),
            ],
            [groups, 1, 1],
        )
        .expect("baseline");
        let ms = median(base.time(3, 10).unwrap());
        println!("W1 vec4 baseline: {ms:.2} ms, {:.2} GB/s", gb(8.0 * n as f64, ms));
        let m = 1024u32;
        let a: Vec<f32> = (0..m * m).map(|i| (i % 17) as f32 / 17.0).collect();
        let mm = Baseline::new(
            &b,
            MATMUL_NAIVE,
            &[
                BaselineBinding::Uniform(bytemuck::cast_slice(&[m, m, m, 0]).to_vec()),
                BaselineBinding::Input(bytemuck::cast_slice(&a).to_vec()),
                BaselineBinding::Input(bytemuck::cast_slice(&a).to_vec()),
                BaselineBinding::Output(4 * (m * m) as u64),
            ],
            [m / 16, m / 16, 1],
        )
        .expect("baseline");
        let ms = median(mm.time(1, 3).unwrap());
        println!("W2 naive: {ms:.2} ms, {:.2} GFLOP/s", 2.0 * (m as f64).powi(3) / ms / 1e6);
    }
    if want("w2") {
        let m = 1024usize;
        let mut g = Graph::new();
        let a = g.param(ValueType::new([m, m], DType::F32));
        let bb = g.param(ValueType::new([m, m], DType::F32));
        let c = g.push(Op::MatMul, &[a, bb]).unwrap();
        g.outputs.push(c);
        let av: Vec<f32> = (0..m * m).map(|i| (i % 17) as f32 / 17.0).collect();
        let (ms, src) = time_graph(&b, g, &[av.clone(), av], &[]);
        println!("W2 generated: {ms:.2} ms, {:.2} GFLOP/s", 2.0 * (m as f64).powi(3) / ms / 1e6);
        if show {
            println!("{src}");
        }
    }
    if want("red") {
        // sum(x * x) over all of x, and over the rows of x (4096 outputs).
        for (shape, axes) in [([4096, 4096], vec![0usize, 1]), ([4096, 4096], vec![1]), ([128, 131072], vec![1])] {
            let mut g = Graph::new();
            let xp = g.param(ValueType::new(shape, DType::F32));
            let sq = g.push(Op::Binary(BinaryOp::Mul), &[xp, xp]).unwrap();
            let r = g
                .push(Op::Reduce { op: lazuli::ir::ReduceOp::Sum, axes: axes.clone(), keepdim: false }, &[sq])
                .unwrap();
            g.outputs.push(r);
            let (ms, src) = time_graph_sync(&b, g, std::slice::from_ref(&x), &[], true);
            println!("sum(x*x) {shape:?} axes {axes:?}: {ms:.2} ms, {:.2} GB/s", gb(4.0 * n as f64, ms));
            if show {
                println!("{src}");
            }
        }
    }
    if want("w3") {
        let mut g = Graph::new();
        let xp = g.param(ValueType::new([4096, 1024], DType::F32));
        let y = g.push(Op::Softmax { axis: 1, log: false }, &[xp]).unwrap();
        g.outputs.push(y);
        let (ms, src) = time_graph(&b, g, &[x[..4096 * 1024].to_vec()], &[]);
        println!("W3 generated: {ms:.2} ms, {:.2} GB/s", gb(8.0 * 4096.0 * 1024.0, ms));
        if show {
            println!("{src}");
        }
    }
}

fn time_graph(b: &WgpuBackend, g: Graph, inputs: &[Vec<f32>], scalars: &[ScalarValue]) -> (f64, String) {
    time_graph_sync(b, g, inputs, scalars, false)
}
