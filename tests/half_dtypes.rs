//! f16 and bf16 on wgpu against the CPU reference: elementwise chains and
//! casts, reductions, softmax and log-softmax, matmul and a small MLP, on
//! both kernel-form profiles, with f16 stored natively (lavapipe has
//! `SHADER_F16`) and forced packed; no op of these programs falls back to
//! the CPU. bf16 rounding (nearest even, ties, NaN, infinities,
//! subnormals) is checked bit for bit on the device.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

/// The wgpu devices to test: each kernel-form profile, with f16 native
/// (where the adapter has it) and forced packed.
fn devices() -> Vec<(String, Device)> {
    if common::wgpu().is_none() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (name, forms) in
        [("software", lazuli::wgpu::forms::KernelForms::software()), ("gpu", lazuli::wgpu::forms::KernelForms::gpu())]
    {
        for packed in [false, true] {
            let opts =
                lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), f16_packed: Some(packed), ..Default::default() };
            let label = format!("{name} forms, f16 {}", if packed { "packed" } else { "native" });
            out.push((label, Device::wgpu_with(opts).expect("a wgpu device")));
        }
    }
    out
}

/// `data` of `shape` as a tensor of `dtype` on `dev` (rounded once, on the
/// host, so both devices start from the same values).
fn input(data: &[f32], shape: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_slice(data, shape.to_vec(), &Device::cpu())
        .and_then(|t| t.cast(dtype))
        .and_then(|t| t.to_bytes())
        .and_then(|b| Tensor::from_bytes(b, lazuli::ir::ValueType::new(shape.to_vec(), dtype), dev))
        .unwrap()
}

/// The named results of the test program, read back as f32.
fn program(dtype: DType, dev: &Device) -> Vec<(&'static str, Vec<f32>)> {
    let x = input(&common::rand_vec(7 * 13, 1, -2.0, 2.0), &[7, 13], dtype, dev);
    let y = input(&common::rand_vec(7 * 13, 2, 0.5, 1.5), &[7, 13], dtype, dev);
    let w1 = input(&common::rand_vec(13 * 64, 3, -0.3, 0.3), &[13, 64], dtype, dev);
    let b1 = input(&common::rand_vec(64, 4, -0.1, 0.1), &[64], dtype, dev);
    let w2 = input(&common::rand_vec(64 * 10, 5, -0.3, 0.3), &[64, 10], dtype, dev);
    let ew = x.mul(&y).unwrap().add(&x).unwrap().tanh().unwrap().sub(&y.sqrt().unwrap()).unwrap();
    let ew2 = x.div(&y).unwrap().relu().unwrap().exp().unwrap().neg().unwrap();
    let sel = x.gt_scalar(0.0).unwrap().where_(&x, &y).unwrap().mul_scalar(1.5).unwrap();
    let to32 = x.cast(DType::F32).unwrap().mul_scalar(3.0).unwrap();
    let back = to32.cast(dtype).unwrap();
    let sum = x.sum(&[1], false).unwrap();
    let mean = x.mean(&[0], true).unwrap();
    let max = x.max(&[1], false).unwrap();
    let total = x.sum(&[0, 1], false).unwrap();
    let sm = x.softmax(-1).unwrap();
    let lsm = x.log_softmax(-1).unwrap();
    let mm = x.matmul(&w1).unwrap();
    let h = mm.add(&b1).unwrap().relu().unwrap();
    let logits = h.matmul(&w2).unwrap();
    let loss = logits.log_softmax(-1).unwrap().mean(&[0, 1], false).unwrap();
    let outs = [
        ("elementwise chain", &ew),
        ("relu exp chain", &ew2),
        ("where", &sel),
        ("cast to f32", &to32),
        ("cast back", &back),
        ("row sums", &sum),
        ("column means", &mean),
        ("row maxima", &max),
        ("total", &total),
        ("softmax", &sm),
        ("log-softmax", &lsm),
        ("matmul", &mm),
        ("mlp hidden", &h),
        ("mlp logits", &logits),
        ("mlp loss", &loss),
    ];
    let tensors: Vec<&Tensor> = outs.iter().map(|o| o.1).collect();
    lazuli::sync(&tensors).unwrap();
    outs.iter()
        .map(|(name, t)| {
            assert!(t.dtype() == dtype || t.dtype() == DType::F32, "{name}: dtype {}", t.dtype());
            (*name, t.cast(DType::F32).unwrap().to_vec::<f32>().unwrap())
        })
        .collect()
}

#[test]
fn f16_and_bf16_match_the_cpu_without_fallback() {
    let _g = common::metrics_lock();
    let devs = devices();
    for dtype in [DType::F16, DType::BF16] {
        let want = program(dtype, &Device::cpu());
        // The CPU rounds after every op, the device once per fused chain:
        // a few roundings of the dtype apart (2^-11 for f16, 2^-8 for bf16).
        let tol = if dtype == DType::F16 { 4e-3 } else { 3e-2 };
        for (label, dev) in &devs {
            let before = metrics::counter("FallbackOps");
            let got = program(dtype, dev);
            assert_eq!(metrics::counter("FallbackOps"), before, "{dtype} on {label}: some op fell back");
            for ((name, g), (_, w)) in got.iter().zip(&want) {
                common::assert_close(g, w, tol, tol, &format!("{dtype} {name} on {label}"));
            }
        }
    }
}

/// bf16 bit patterns after a cast from the f32 bit patterns `from`.
fn bf16_bits(from: &[u32], dev: &Device) -> Vec<u16> {
    let vals: Vec<f32> = from.iter().map(|&b| f32::from_bits(b)).collect();
    let t = Tensor::from_slice(&vals, [vals.len()], dev).unwrap().cast(DType::BF16).unwrap();
    t.to_vec::<half::bf16>().unwrap().iter().map(|h| h.to_bits()).collect()
}

#[test]
fn bf16_rounds_to_nearest_even_on_the_device() {
    let devs = devices();
    let from = [
        0x3F80_0000,
        0x3F80_8000, // tie, even: down
        0x3F81_8000, // tie, odd: up
        0x3F80_8001, // above the tie
        0x3F80_7FFF, // below the tie
        0xBF80_8000, // negative tie
        0x7F80_0000, // +inf
        0xFF80_0000, // -inf
        0x7F7F_FFFF, // f32::MAX: to inf
        0x0001_8000, // subnormal tie, odd: up
        0x0000_8000, // subnormal tie, even: +0
        0x8000_0000, // -0
        0x007F_FFFF, // largest subnormal: smallest normal
    ];
    let want = bf16_bits(&from, &Device::cpu());
    assert_eq!(
        want,
        [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7F80, 0x0002, 0, 0x8000, 0x0080]
    );
    let nans = [0x7FC0_0000, 0x7F80_0001, 0xFF80_0001];
    for (label, dev) in &devs {
        assert_eq!(bf16_bits(&from, dev), want, "{label}");
        for (k, b) in bf16_bits(&nans, dev).iter().enumerate() {
            assert!(half::bf16::from_bits(*b).is_nan(), "{label}: NaN {k} became {b:#06x}");
        }
        // Odd lengths: the last word's other half is padding; every
        // element of a round trip keeps its bits.
        let odd: Vec<half::bf16> = (0..9).map(|k| half::bf16::from_f32(k as f32 * 0.37 - 1.0)).collect();
        let t = Tensor::from_slice(&odd, [9], dev).unwrap();
        assert_eq!(t.to_vec::<half::bf16>().unwrap(), odd, "{label}");
        let f: Vec<half::f16> = odd.iter().map(|v| half::f16::from_f32(v.to_f32())).collect();
        let t = Tensor::from_slice(&f, [9], dev).unwrap();
        assert_eq!(t.add_scalar(0.0).unwrap().to_vec::<half::f16>().unwrap(), f, "{label}");
    }
}

/// The fallback counters that moved between `before` and now.
fn fallbacks_since(before: &[(String, u64)]) -> Vec<String> {
    metrics::counters()
        .into_iter()
        .filter(|(name, n)| {
            name.starts_with("Fallback::") && before.iter().find(|(b, _)| b == name).map_or(0, |b| b.1) != *n
        })
        .map(|(name, _)| name)
        .collect()
}

/// One training step of a small MLP (matmul, bias, relu, cross-entropy,
/// and their gradients) in f16 and bf16: the loss and every gradient match
/// the CPU, and no op falls back.
#[test]
fn an_mlp_training_step_runs_in_half_precision_without_fallback() {
    let _g = common::metrics_lock();
    let step = |dtype: DType, dev: &Device| -> Vec<Vec<f32>> {
        let x = input(&common::rand_vec(16 * 13, 11, -1.0, 1.0), &[16, 13], dtype, dev);
        let w1 = input(&common::rand_vec(13 * 32, 12, -0.4, 0.4), &[13, 32], dtype, dev);
        let b1 = input(&common::rand_vec(32, 13, -0.1, 0.1), &[32], dtype, dev);
        let w2 = input(&common::rand_vec(32 * 10, 14, -0.4, 0.4), &[32, 10], dtype, dev);
        let params = [&w1, &b1, &w2];
        for p in params {
            p.requires_grad_(true).unwrap();
        }
        let labels: Vec<i32> = (0..16).map(|i| i * 7 % 10).collect();
        let labels = Tensor::from_slice(&labels, [16], dev).unwrap();
        let h = x.matmul(&w1).unwrap().add(&b1).unwrap().relu().unwrap();
        let loss = lazuli::nn::cross_entropy(&h.matmul(&w2).unwrap(), &labels).unwrap();
        loss.backward().unwrap();
        let mut out = vec![loss.cast(DType::F32).unwrap().to_vec::<f32>().unwrap()];
        for p in params {
            let g = p.grad().expect("a gradient");
            assert_eq!(g.dtype(), dtype);
            out.push(g.cast(DType::F32).unwrap().to_vec::<f32>().unwrap());
        }
        out
    };
    let devs = devices();
    for dtype in [DType::F16, DType::BF16] {
        let want = step(dtype, &Device::cpu());
        let tol = if dtype == DType::F16 { 4e-3 } else { 3e-2 };
        for (label, dev) in &devs {
            let before = metrics::counters();
            let got = step(dtype, dev);
            let fell = fallbacks_since(&before);
            assert!(fell.is_empty(), "{dtype} on {label}: fell back: {fell:?}");
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                common::assert_close(g, w, tol, tol, &format!("{dtype} loss/gradient {k} on {label}"));
            }
        }
        // Shadow validation compares every kernel with the CPU within the
        // dtype's tolerance: the step passes it.
        if let Some((label, dev)) = devs.first() {
            dev.set_validate(true);
            step(dtype, dev);
            dev.set_validate(false);
            dev.wait().unwrap_or_else(|e| panic!("{dtype} on {label}, validated: {e}"));
        }
    }
}

/// Layer norm in f16 and bf16, forward and backward, against the CPU on
/// every device: the GPU profile's held-row kernels (rows in vec4
/// registers, `codegen::rows`) store 16-bit outputs through the `halves`
/// rewrite like every other family.
#[test]
fn layer_norm_rows_in_half_precision_match_the_cpu() {
    let run = |dtype: DType, dev: &Device| -> Vec<Vec<f32>> {
        let x = input(&common::rand_vec(24 * 64, 21, -2.0, 2.0), &[24, 64], dtype, dev);
        let w = input(&common::rand_vec(64, 22, 0.5, 1.5), &[64], dtype, dev);
        let b = input(&common::rand_vec(64, 23, -0.5, 0.5), &[64], dtype, dev);
        for p in [&x, &w, &b] {
            p.requires_grad_(true).unwrap();
        }
        let y = lazuli::nn::layer_norm(&x, 1, Some(&w), Some(&b), 1e-5).unwrap();
        let loss = y.mul(&y).unwrap().sum(&[0, 1], false).unwrap();
        loss.backward().unwrap();
        let mut out = vec![y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap()];
        for p in [&x, &w, &b] {
            out.push(p.grad().expect("a gradient").cast(DType::F32).unwrap().to_vec::<f32>().unwrap());
        }
        out
    };
    for dtype in [DType::F16, DType::BF16] {
        let want = run(dtype, &Device::cpu());
        let tol = if dtype == DType::F16 { 2e-2 } else { 1e-1 };
        for (label, dev) in &devices() {
            for (k, (g, w)) in run(dtype, dev).iter().zip(&want).enumerate() {
                common::assert_close(g, w, tol, tol, &format!("{dtype} layer norm output/gradient {k} on {label}"));
            }
        }
    }
}

/// f16 products on the default wgpu device against the CPU reference
/// (f32 accumulation: within f16 rounding of the output), over transposed
/// and batched operands, odd sizes and a fused epilogue. Where the adapter
/// runs cooperative matrices (its configuration says
/// `LAZULI_COOPERATIVE_MATRIX` on: an NVIDIA GPU) every product takes the
/// tensor-core form and the test checks that it did; elsewhere (lavapipe
/// has none) it says so and checks the f32-compute forms of the same
/// products, while `codegen::coop`'s unit tests validate the tensor-core
/// kernels with naga.
#[test]
fn f16_products_match_the_cpu_on_tensor_cores_where_the_adapter_has_them() {
    let Some(dev) = common::wgpu() else { return };
    let coop = dev
        .configuration()
        .settings
        .iter()
        .find(|s| s.variable == "LAZULI_COOPERATIVE_MATRIX")
        .map(|s| s.value.starts_with("on"))
        .expect("the wgpu backend reports LAZULI_COOPERATIVE_MATRIX");
    if !coop {
        eprintln!(
            "f16 products: this adapter has no cooperative matrices as the tensor-core form needs; \
             testing the f32-compute forms (the tensor-core kernels are validated by naga in codegen::coop)"
        );
    }
    let cpu = Device::cpu();
    let data = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 97) as f32 - 48.0) / 64.0).collect()
    };
    type Case = (&'static [usize], (usize, usize, usize), bool, bool, bool);
    let cases: [Case; 6] = [
        (&[], (16, 16, 16), false, false, false),
        (&[], (130, 70, 200), false, false, true),
        (&[], (64, 300, 96), true, false, false),
        (&[], (96, 64, 80), false, true, true),
        (&[2], (33, 48, 65), true, true, false),
        (&[], (256, 512, 256), false, false, true),
    ];
    for (batch, (m, k, n), ta, tb, epi) in cases {
        let what = format!("{batch:?} {m}x{k}x{n} ta={ta} tb={tb} epi={epi}");
        let shape = |r: usize, c: usize| [batch, &[r, c]].concat();
        let run = |d: &Device| -> (Vec<f32>, Tensor) {
            let a = if ta {
                let s = shape(k, m);
                input(&data(s.iter().product(), 1), &s, DType::F16, d).transpose(-1, -2).unwrap()
            } else {
                let s = shape(m, k);
                input(&data(s.iter().product(), 1), &s, DType::F16, d)
            };
            let b = if tb {
                let s = shape(n, k);
                input(&data(s.iter().product(), 2), &s, DType::F16, d).transpose(-1, -2).unwrap()
            } else {
                let s = shape(k, n);
                input(&data(s.iter().product(), 2), &s, DType::F16, d)
            };
            let mut y = a.matmul(&b).unwrap();
            if epi {
                let bias = input(&data(n, 3), &[n], DType::F16, d);
                y = y.add(&bias).unwrap().relu().unwrap();
            }
            (y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap(), y)
        };
        let (want, _) = run(&cpu);
        let (got, y) = run(&dev);
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // One f16 rounding of the output, plus f32 summation order.
            assert!((g - w).abs() <= 2e-3 * w.abs().max(1.0) + 1e-3 * (k as f32).sqrt(), "{what}: [{i}] {g} vs {w}");
        }
        let code = lazuli::debug::backend_code(&[&y]).unwrap();
        let tensor_cores = code.iter().any(|(_, src)| src.contains("coopMultiplyAdd"));
        assert_eq!(tensor_cores, coop, "{what}: tensor-core form where (and only where) the adapter runs it");
    }
}

/// Fused attention in f16 and bf16 (what autocast records for a GPT's
/// attention): forward and the gradients of q, k and v, causal, against the
/// CPU on every device, with no fallback.
#[test]
fn attention_in_half_precision_runs_on_the_device_and_matches_the_cpu() {
    let _g = common::metrics_lock();
    let run = |dtype: DType, dev: &Device, shape: [usize; 4]| -> Vec<Vec<f32>> {
        let n: usize = shape.iter().product();
        let q = input(&common::rand_vec(n, 31, -1.0, 1.0), &shape, dtype, dev);
        let k = input(&common::rand_vec(n, 32, -1.0, 1.0), &shape, dtype, dev);
        let v = input(&common::rand_vec(n, 33, -1.0, 1.0), &shape, dtype, dev);
        for p in [&q, &k, &v] {
            p.requires_grad_(true).unwrap();
        }
        let opts = lazuli::nn::AttentionOptions { causal: true, ..Default::default() };
        let y = lazuli::nn::scaled_dot_product_attention(&q, &k, &v, &opts).unwrap();
        let loss =
            y.cast(DType::F32).unwrap().mul(&y.cast(DType::F32).unwrap()).unwrap().sum(&[0, 1, 2, 3], false).unwrap();
        loss.backward().unwrap();
        let mut out = vec![y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap()];
        for p in [&q, &k, &v] {
            out.push(p.grad().expect("a gradient").cast(DType::F32).unwrap().to_vec::<f32>().unwrap());
        }
        out
    };
    // Head dims 16 and 64 (the tiled form's flash forward at G8's width).
    for (dtype, shape) in [(DType::F16, [2, 2, 40, 16]), (DType::BF16, [2, 2, 40, 16]), (DType::F16, [1, 2, 70, 64])] {
        let want = run(dtype, &Device::cpu(), shape);
        let tol = if dtype == DType::F16 { 1e-2 } else { 6e-2 };
        for (label, dev) in &devices() {
            let before = metrics::counters();
            let got = run(dtype, dev, shape);
            let fell = fallbacks_since(&before);
            assert!(fell.is_empty(), "{dtype} attention {shape:?} on {label}: fell back: {fell:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                common::assert_close(
                    g,
                    w,
                    tol,
                    tol,
                    &format!("{dtype} attention {shape:?} output/gradient {i} on {label}"),
                );
            }
        }
    }
}

/// Padding (constant, reflect, edge) of f16 and bf16 tensors, and
/// its gradient (a slice), on every device against the CPU, without
/// fallback (a GPT's backward pads under autocast).
#[test]
fn padding_in_half_precision_matches_the_cpu_without_fallback() {
    let _g = common::metrics_lock();
    let run = |dtype: DType, dev: &Device| -> Vec<Vec<f32>> {
        let x = input(&common::rand_vec(3 * 5 * 7, 41, -2.0, 2.0), &[3, 5, 7], dtype, dev);
        let mut out = Vec::new();
        let pads = [(0, 0), (1, 2), (2, 1)];
        let mut ys = vec![x.pad(&pads, 0.5).unwrap()];
        for mode in [lazuli::ir::PadMode::Reflect, lazuli::ir::PadMode::Edge] {
            ys.push(x.pad_mode(&pads, mode).unwrap());
        }
        for y in ys {
            out.push(y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap());
        }
        out
    };
    for dtype in [DType::F16, DType::BF16] {
        let want = run(dtype, &Device::cpu());
        for (label, dev) in &devices() {
            let before = metrics::counters();
            let got = run(dtype, dev);
            let fell = fallbacks_since(&before);
            assert!(fell.is_empty(), "{dtype} pad on {label}: fell back: {fell:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                common::assert_close(g, w, 0.0, 0.0, &format!("{dtype} pad {i} on {label}"));
            }
        }
    }
}

/// Convolution (stride, padding), max and average pooling and a gather
/// with its scatter-add gradient (an embedding lookup) in f16 and bf16,
/// forward and gradients, on every device against the CPU, without
/// fallback.
#[test]
fn conv_pool_and_gather_in_half_precision_match_the_cpu_without_fallback() {
    let _g = common::metrics_lock();
    use lazuli::ir::{ConvAttrs, PoolAttrs, PoolKind};
    let run = |dtype: DType, dev: &Device| -> Vec<Vec<f32>> {
        let x = input(&common::rand_vec(2 * 3 * 9 * 9, 51, -1.0, 1.0), &[2, 3, 9, 9], dtype, dev);
        let w = input(&common::rand_vec(4 * 3 * 3 * 3, 52, -0.5, 0.5), &[4, 3, 3, 3], dtype, dev);
        let table = input(&common::rand_vec(10 * 6, 53, -1.0, 1.0), &[10, 6], dtype, dev);
        for p in [&x, &w, &table] {
            p.requires_grad_(true).unwrap();
        }
        let attrs = ConvAttrs { strides: [2, 1], pads: [1, 1, 0, 1], ..ConvAttrs::default() };
        let c = x.conv2d(&w, attrs).unwrap();
        let mp = c.pool(PoolAttrs::new(PoolKind::Max, &[2, 2])).unwrap();
        let ap = x.pool(PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[3, 3])).unwrap();
        let idx = Tensor::from_slice(&[3i32, 0, 9, 3, 7, 1], [6], dev).unwrap();
        let g = table.gather(0, &idx).unwrap();
        let f = |t: &Tensor| t.cast(DType::F32).unwrap();
        let loss = f(&mp)
            .sum(&[], false)
            .unwrap()
            .add(&f(&ap).mul(&f(&ap)).unwrap().sum(&[], false).unwrap())
            .unwrap()
            .add(&f(&g).mul(&f(&g)).unwrap().sum(&[], false).unwrap())
            .unwrap();
        loss.backward().unwrap();
        let mut out: Vec<Vec<f32>> = [&c, &mp, &ap, &g].iter().map(|t| f(t).to_vec::<f32>().unwrap()).collect();
        for p in [&x, &w, &table] {
            out.push(f(&p.grad().expect("a gradient")).to_vec::<f32>().unwrap());
        }
        out
    };
    for dtype in [DType::F16, DType::BF16] {
        let want = run(dtype, &Device::cpu());
        let tol = if dtype == DType::F16 { 1e-2 } else { 6e-2 };
        for (label, dev) in &devices() {
            let before = metrics::counters();
            let got = run(dtype, dev);
            let fell = fallbacks_since(&before);
            assert!(fell.is_empty(), "{dtype} conv/pool/gather on {label}: fell back: {fell:?}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                common::assert_close(
                    g,
                    w,
                    tol,
                    tol,
                    &format!("{dtype} conv/pool/gather output/gradient {i} on {label}"),
                );
            }
        }
    }
}
