//! f32 against f16 (native and packed) and bf16 on the wgpu device: an
//! elementwise chain over 4M elements, a row softmax and a 512^3 matmul,
//! median wall time of 5 runs after a warm-up, with kernel launches and
//! CPU fallback ops per run. Run with `cargo run --release --example
//! half_bench`; on a software adapter (lavapipe) the times are CPU times,
//! noisy, and say nothing of a GPU's bandwidth (see BENCHMARKS.md).

use lazuli::metrics;
use lazuli::prelude::*;
use std::time::Instant;

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let devices = [("f16 native", false), ("f16 packed", true)]
        .map(|(name, packed)| (name, lazuli::WgpuDeviceOptions { f16_packed: Some(packed), ..Default::default() }));
    for (label, opts) in devices {
        let dev = Device::wgpu_with(opts)?;
        println!("device {dev} ({label} for f16)");
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            if label == "f16 packed" && dtype != DType::F16 {
                continue;
            }
            let x = Tensor::rand([2048, 2048], DType::F32, &dev)?.cast(dtype)?;
            let a = Tensor::rand([512, 512], DType::F32, &dev)?.cast(dtype)?;
            lazuli::sync(&[&x, &a])?;
            let mut row = format!("{dtype:>4}");
            let cases: [(&str, &dyn Fn() -> lazuli::Result<Tensor>); 3] = [
                ("chain", &|| x.mul_scalar(1.5)?.add_scalar(0.25)?.relu()?.tanh()?.mul(&x)),
                ("softmax", &|| x.softmax(-1)),
                ("matmul", &|| a.matmul(&a)),
            ];
            for (name, f) in cases {
                let (l0, f0) = (metrics::counter("KernelLaunches"), metrics::counter("FallbackOps"));
                let ms = median_ms(|| {
                    f().and_then(|t| lazuli::sync(&[&t])).and_then(|_| dev.wait()).expect("run");
                });
                let launches = (metrics::counter("KernelLaunches") - l0) / 6;
                let fallback = (metrics::counter("FallbackOps") - f0) / 6;
                row.push_str(&format!("  {name}: {ms:8.2} ms ({launches} kernels, {fallback} fallback ops)"));
            }
            println!("{row}");
        }
    }
    Ok(())
}
