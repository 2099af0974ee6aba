//! Mixed precision (`lazuli::amp`): which ops autocast casts (PyTorch's
//! lists), gradients through autocast regions into f32 parameters, the
//! digits demo and the tiny G8 GPT under autocast following their f32 loss
//! curves, and `GradScaler`: a step with an injected inf is skipped on the
//! device (parameters and momentum unchanged, scale halved), the scale
//! grows again after `growth_interval` clean steps, the state survives a
//! checkpoint, and a scaled training loop recompiles and reads back
//! nothing after its second step. Every test runs on the CPU and, where an
//! adapter exists, on wgpu (f16 runs there through the CPU fallback).

// Metrics counters are process-wide: every test here holds
// `common::metrics_lock`, so a test counting downloads, compiles or
// fallbacks sees only its own.
mod common;

use lazuli::amp::{self, GradScaler, GradScalerOptions};
use lazuli::autograd::checkpoint;
use lazuli::checkpoint::Checkpoint;
use lazuli::ir::ConvAttrs;
use lazuli::metrics;
use lazuli::nn::{self, Linear, Module};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;
use lazuli_models::digits::{train_digits, Digits, TrainConfig};
use lazuli_models::gpt::{Gpt, GptSizes};

fn data(dev: &Device, dims: [usize; 2], seed: u64) -> Tensor {
    Tensor::from_slice(&common::rand_vec(dims[0] * dims[1], seed, -1.0, 1.0), dims, dev).unwrap()
}

#[test]
fn autocast_casts_by_the_op_lists() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let a = data(&dev, [4, 8], 1);
        let w = data(&dev, [8, 3], 2);
        let a64 = a.cast(DType::F64).unwrap();
        let outside = a.matmul(&w).unwrap();
        assert_eq!(outside.dtype(), DType::F32, "no scope: f32");
        amp::autocast(DType::F16, || {
            let y = a.matmul(&w)?;
            assert_eq!(y.dtype(), DType::F16, "matmul is on the low-precision list");
            assert_eq!(a64.matmul(&a64.t()?)?.dtype(), DType::F64, "f64 is never cast down");
            assert_eq!(y.relu()?.dtype(), DType::F16, "relu runs in its input's dtype");
            assert_eq!(y.softmax(-1)?.dtype(), DType::F32, "softmax is on the f32 list");
            assert_eq!(y.log_softmax(-1)?.dtype(), DType::F32);
            assert_eq!(y.sum(&[], false)?.dtype(), DType::F32, "sum is on the f32 list");
            assert_eq!(y.mean(&[0], false)?.dtype(), DType::F32);
            assert_eq!(y.exp()?.dtype(), DType::F32);
            assert_eq!(y.max(&[], false)?.dtype(), DType::F16, "max is not");
            assert_eq!(y.pow_scalar(2.0)?.dtype(), DType::F32, "pow with a scalar follows its operand");
            let b = data(&dev, [1, 3], 3);
            assert_eq!(y.add(&b)?.dtype(), DType::F32, "f16 + f32 promotes to f32");
            assert_eq!(y.mul_scalar(3.0)?.dtype(), DType::F16);
            let lin = Linear::new(8, 3, &dev)?;
            assert_eq!(lin.forward(&a)?.dtype(), DType::F16, "linear's bias joins its f16 product (PyTorch's addmm)");
            let img = data(&dev, [2, 18], 13).reshape([1, 2, 3, 6])?;
            let kernel = data(&dev, [4, 2], 14).reshape([4, 2, 1, 1])?;
            assert_eq!(img.conv2d(&kernel, ConvAttrs::default())?.dtype(), DType::F16, "conv is on the low list");
            let q = data(&dev, [5, 4], 15).reshape([1, 5, 4])?;
            assert_eq!(q.attention(&q, &q, 0.5, true, None)?.dtype(), DType::F16, "attention is on the low list");
            let e = lazuli::einsum("ij,jk->ik", &[&a, &w])?;
            assert_eq!(e.dtype(), DType::F16, "einsum lowers to matmul");
            let ln = nn::layer_norm(&y, 1, None, None, 1e-5)?;
            assert_eq!(ln.dtype(), DType::F32, "norms run in f32");
            let labels = Tensor::from_slice(&[0i32, 1, 2, 0], [4], &dev)?;
            assert_eq!(nn::cross_entropy(&y, &labels)?.dtype(), DType::F32, "losses run in f32");
            // Turned off inside: f32 again.
            amp::autocast(None, || {
                assert_eq!(a.matmul(&w)?.dtype(), DType::F32);
                Ok(())
            })?;
            // The guard form nests the same way.
            {
                let _off = amp::autocast_guard(None)?;
                assert_eq!(a.matmul(&w)?.dtype(), DType::F32);
            }
            assert_eq!(a.matmul(&w)?.dtype(), DType::F16);
            // The values: the f16 matmul is the f32 one within f16 rounding.
            let want = outside.to_vec::<f32>()?;
            let got = y.cast(DType::F32)?.to_vec::<f32>()?;
            common::assert_close(&got, &want, 2e-3, 2e-3, &format!("f16 matmul on {}", dev.name()));
            Ok(())
        })
        .unwrap();
        assert_eq!(amp::autocast_dtype(), None);
    }
}

#[test]
fn f16_matmul_accumulates_in_f32() {
    let _lock = common::metrics_lock();
    // 4096 ones: an f16 accumulator stops at 2048 (2048 + 1 rounds to
    // 2048), an f32 one reaches 4096, which f16 holds exactly.
    for dev in common::devices() {
        // Host data, so no pass can fold the product.
        let ones = Tensor::from_slice(&[1.0f32; 4096], [1, 4096], &dev).unwrap();
        let y = amp::autocast(DType::F16, || ones.matmul(&ones.t()?)).unwrap();
        assert_eq!(y.dtype(), DType::F16);
        assert_eq!(y.cast(DType::F32).unwrap().to_vec::<f32>().unwrap(), [4096.0], "{}", dev.name());
    }
}

#[test]
fn casts_are_explicit_ir_nodes() {
    let _lock = common::metrics_lock();
    let dev = Device::cpu();
    let (a, w) = (data(&dev, [2, 4], 5), data(&dev, [4, 2], 6));
    let y = amp::autocast(DType::F16, || a.matmul(&w)).unwrap();
    let ir = lazuli::debug::ir_text(&[&y]);
    assert_eq!(ir.matches("cast").count(), 2, "one cast per f32 operand:\n{ir}");
}

#[test]
fn autocast_rejects_dtypes_that_are_not_16_bit_floats() {
    let _lock = common::metrics_lock();
    for d in [DType::F32, DType::F64, DType::I16] {
        let e = amp::autocast(d, || Ok(())).unwrap_err();
        assert!(e.to_string().contains(&d.to_string()), "{e}");
        assert_eq!(amp::autocast_dtype(), None, "a refused scope changes nothing");
    }
}

/// Gradients of `mse(layer_norm(relu(lin(x))) @ head, t)` into the f32
/// parameters, with and without autocast to f16.
fn grads(dev: &Device, autocast: Option<DType>) -> Vec<(DType, Vec<f32>)> {
    dev.manual_seed(3);
    let lin = Linear::new(16, 12, dev).unwrap();
    let head = data(dev, [12, 4], 9).requires_grad_(true).unwrap();
    let (x, t) = (data(dev, [6, 16], 7), data(dev, [6, 4], 8));
    let loss = amp::autocast(autocast, || {
        let h = nn::layer_norm(&lin.forward(&x)?.relu()?, 1, None, None, 1e-5)?;
        nn::mse(&h.matmul(&head)?, &t)
    })
    .unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    loss.backward().unwrap();
    let mut params = lin.parameters();
    params.push(head);
    params
        .iter()
        .map(|p| {
            let g = p.grad().expect("every parameter gets a gradient");
            (g.dtype(), g.to_vec::<f32>().unwrap())
        })
        .collect()
}

#[test]
fn gradients_reach_f32_parameters_in_f32_and_match_within_f16_tolerance() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let f32_grads = grads(&dev, None);
        let amp_grads = grads(&dev, Some(DType::F16));
        for ((d, got), (_, want)) in amp_grads.iter().zip(&f32_grads) {
            assert_eq!(*d, DType::F32, "master weights get f32 gradients");
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            common::assert_close(got, want, 2e-2, 2e-2 * scale, &format!("autocast gradient on {}", dev.name()));
        }
    }
}

#[test]
fn a_checkpointed_segment_recomputes_under_its_autocast_setting() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let run = |checkpointed: bool| -> Vec<Vec<f32>> {
            dev.manual_seed(4);
            let lin = Linear::new(8, 6, &dev).unwrap();
            let x = data(&dev, [3, 8], 21);
            let inner = lin.clone();
            let segment = move |xs: &[Tensor]| inner.forward(&xs[0])?.tanh();
            let y = amp::autocast(DType::F16, || {
                if checkpointed {
                    checkpoint(segment, std::slice::from_ref(&x))
                } else {
                    segment(std::slice::from_ref(&x))
                }
            })
            .unwrap();
            // Backward outside the scope: the recomputation must still be f16.
            y.sum(&[], false).unwrap().backward().unwrap();
            lin.parameters().iter().map(|p| p.grad().unwrap().to_vec::<f32>().unwrap()).collect()
        };
        assert_eq!(run(true), run(false), "{}: checkpointed autocast gradients", dev.name());
    }
}

fn digits() -> Digits {
    Digits::load(&Digits::default_dir()).expect("data/digits ships with the repository")
}

#[test]
fn digits_demo_under_autocast_follows_the_f32_loss_curve() {
    let _lock = common::metrics_lock();
    let data = digits();
    for dev in common::devices() {
        let cfg = TrainConfig { epochs: 3, ..TrainConfig::default() };
        let f32_run = train_digits(&dev, &data, &cfg, &mut |_| {}).unwrap();
        let cfg = TrainConfig { autocast: Some(DType::F16), ..cfg };
        let amp_run = train_digits(&dev, &data, &cfg, &mut |_| {}).unwrap();
        eprintln!("{}: f32 {:?}, f16 autocast {:?}", dev.name(), f32_run.epoch_losses, amp_run.epoch_losses);
        // The stated tolerance: each epoch's mean loss within 2% (+0.005)
        // of the f32 run's (lavapipe and CPU: within 2e-4 relative), and
        // the same accuracy within 2 points.
        for (a, f) in amp_run.epoch_losses.iter().zip(&f32_run.epoch_losses) {
            assert!(
                (a - f).abs() <= 0.02 * f + 0.005,
                "{}: {:?} vs {:?}",
                dev.name(),
                amp_run.epoch_losses,
                f32_run.epoch_losses
            );
        }
        assert!((amp_run.test_accuracy - f32_run.test_accuracy).abs() <= 0.02, "{}", dev.name());
        assert_eq!(amp_run.uncached_compiles_after_step_2, 0, "{}", dev.name());
    }
}

#[test]
fn gpt_under_autocast_follows_the_f32_loss_curve_and_compiles_nothing_after_step_two() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let mut curves = Vec::new();
        for dtype in [None, Some(DType::F16)] {
            let mut gpt = Gpt::new(&dev, GptSizes::TINY).unwrap().with_autocast(dtype).unwrap();
            let mut losses = Vec::new();
            let mut compiles = Vec::new();
            for _ in 0..8 {
                let before = dev.compile_counts().0;
                let (loss, _) = gpt.step().unwrap();
                compiles.push(dev.compile_counts().0 - before);
                losses.push(loss.item::<f32>().unwrap());
            }
            assert!(compiles[2..].iter().all(|&c| c == 0), "{} {dtype:?}: {compiles:?}", dev.name());
            curves.push(losses);
        }
        eprintln!("{}: f32 {:?}\n f16 autocast {:?}", dev.name(), curves[0], curves[1]);
        // The stated tolerance: every step's loss within 0.5% of the f32
        // run's (lavapipe and CPU: within 2e-4 relative).
        common::assert_close(&curves[1], &curves[0], 5e-3, 0.0, &format!("G8 tiny under autocast on {}", dev.name()));
        assert!(curves[1][7] < curves[1][0], "{}: {:?}", dev.name(), curves[1]);
    }
}

/// A linear model, SGD with momentum and a scaler with growth interval 3.
struct Setup {
    dev: Device,
    lin: Linear,
    opt: Sgd,
    scaler: GradScaler,
    x: Tensor,
    t: Tensor,
}

fn setup(dev: &Device) -> Setup {
    dev.manual_seed(1);
    let lin = Linear::new(8, 4, dev).unwrap();
    let opt = Sgd::new(lin.parameters(), 0.05).momentum(0.9);
    let opts = GradScalerOptions { growth_interval: 3, ..GradScalerOptions::default() };
    let scaler = GradScaler::with_options(dev, opts).unwrap();
    Setup { dev: dev.clone(), lin, opt, scaler, x: data(dev, [5, 8], 11), t: data(dev, [5, 4], 12) }
}

impl Setup {
    /// One scaled step on `x` (the usual batch, or one holding an inf).
    fn step(&mut self, x: &Tensor) {
        let loss = amp::autocast(DType::F16, || nn::mse(&self.lin.forward(x)?, &self.t)).unwrap();
        self.scaler.scale(&loss).unwrap().backward().unwrap();
        self.scaler.step(&mut self.opt).unwrap();
        self.scaler.update().unwrap();
        self.opt.zero_grad();
        self.dev.mark_step().unwrap();
    }

    fn params(&self) -> Vec<Vec<f32>> {
        self.lin.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect()
    }

    fn momentum(&self) -> Vec<Vec<f32>> {
        self.opt.state_dict().iter().map(|(_, t)| t.to_vec::<f32>().unwrap()).collect()
    }

    fn scale(&self) -> (f32, f32) {
        (self.scaler.get_scale().item::<f32>().unwrap(), self.scaler.growth_tracker().item::<f32>().unwrap())
    }
}

fn with_inf(x: &Tensor) -> Tensor {
    let mut v = x.to_vec::<f32>().unwrap();
    v[3] = f32::INFINITY;
    Tensor::from_slice(&v, x.shape().clone(), x.device()).unwrap()
}

#[test]
fn grad_scaler_skips_a_step_with_an_inf_and_recovers() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let mut s = setup(&dev);
        let x = s.x.clone();
        s.step(&x);
        s.step(&x);
        assert_eq!(s.scale(), (65536.0, 2.0), "{}: two clean steps", dev.name());
        let (p0, m0) = (s.params(), s.momentum());
        s.step(&with_inf(&x));
        assert_eq!(s.params(), p0, "{}: the step with an inf changed the parameters", dev.name());
        assert_eq!(s.momentum(), m0, "{}: the step with an inf changed the momentum", dev.name());
        assert_eq!(s.scale(), (32768.0, 0.0), "{}: backoff halves the scale and restarts the count", dev.name());
        for k in 1..=3 {
            s.step(&x);
            let want = if k < 3 { (32768.0, k as f32) } else { (65536.0, 0.0) };
            assert_eq!(s.scale(), want, "{}: clean step {k} after the skip", dev.name());
        }
        assert_ne!(s.params(), p0, "{}: clean steps update", dev.name());
    }
}

#[test]
fn grad_scaler_steps_record_no_readback_and_compile_nothing_after_step_two() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let mut s = setup(&dev);
        let x = s.x.clone();
        let bad = with_inf(&x);
        let downloads = || metrics::value("BytesDownloaded").map_or(0, |v| v.count);
        let mut compiles = Vec::new();
        let mut reads = Vec::new();
        for i in 0..6 {
            let (c0, r0) = (dev.compile_counts().0, downloads());
            // Step 4 overflows: skipped on the device, same graph.
            s.step(if i == 3 { &bad } else { &x });
            compiles.push(dev.compile_counts().0 - c0);
            reads.push(downloads() - r0);
        }
        assert!(compiles[2..].iter().all(|&c| c == 0), "{}: compiles per step {compiles:?}", dev.name());
        assert!(reads.iter().all(|&r| r == 0), "{}: downloads per step {reads:?}", dev.name());
        // Three clean steps grew 2^16 to 2^17, the inf halved it back.
        assert_eq!(s.scale(), (65536.0, 2.0), "{}", dev.name());
    }
}

#[test]
fn grad_scaler_state_survives_a_checkpoint() {
    let _lock = common::metrics_lock();
    let dir = std::env::temp_dir().join(format!("lazuli-amp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for dev in common::devices() {
        let mut s = setup(&dev);
        let x = s.x.clone();
        s.step(&with_inf(&x));
        s.step(&x);
        assert_eq!(s.scale(), (32768.0, 1.0));
        let path = dir.join("amp.ckpt.safetensors");
        Checkpoint::new().optimizer(&s.opt).unwrap().grad_scaler(&s.scaler).save(&path).unwrap();
        let mut fresh = setup(&dev);
        assert_eq!(fresh.scale(), (65536.0, 0.0));
        let loaded = Checkpoint::load(&path).unwrap();
        assert!(loaded.has("scaler"));
        loaded.restore_grad_scaler(&mut fresh.scaler).unwrap();
        assert_eq!(fresh.scale(), (32768.0, 1.0), "{}", dev.name());
        // Two more clean steps grow it, as in the original run.
        fresh.step(&x);
        fresh.step(&x);
        assert_eq!(fresh.scale(), (65536.0, 0.0), "{}", dev.name());
        // A checkpoint without the part says so.
        Checkpoint::new().optimizer(&s.opt).unwrap().save(&path).unwrap();
        let e = Checkpoint::load(&path).unwrap().restore_grad_scaler(&mut fresh.scaler).unwrap_err();
        assert!(e.to_string().contains("scaler"), "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn grad_scaler_misuse_is_an_error_and_disabled_is_plain() {
    let _lock = common::metrics_lock();
    let dev = Device::cpu();
    let mut s = setup(&dev);
    let e = s.scaler.update().unwrap_err();
    assert!(e.to_string().contains("update"), "{e}");
    let loss = nn::mse(&s.lin.forward(&s.x).unwrap(), &s.t).unwrap();
    s.scaler.scale(&loss).unwrap().backward().unwrap();
    s.scaler.unscale_(&s.opt).unwrap();
    assert!(s.scaler.unscale_(&s.opt).is_err(), "unscale_ twice in a step");
    let bad = GradScaler::with_options(&dev, GradScalerOptions { backoff_factor: 1.5, ..Default::default() });
    assert!(bad.unwrap_err().to_string().contains("backoff_factor"));
    // Disabled: the loss passes through and the step is plain.
    let off = GradScaler::with_options(&dev, GradScalerOptions { enabled: false, ..Default::default() }).unwrap();
    let l = Tensor::from_slice(&[2.0f32], [], &dev).unwrap();
    assert_eq!(off.scale(&l).unwrap().item::<f32>().unwrap(), 2.0);
}

/// On wgpu, the tiny GPT step under autocast (f16 and bf16) runs every op
/// on the device: its 16-bit matmuls, softmax, norms and fused attention
/// have kernels, so no `Fallback::*` counter moves.
#[test]
fn gpt_under_autocast_runs_without_fallback_on_wgpu() {
    let _g = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    for dtype in [DType::F16, DType::BF16] {
        let mut gpt = Gpt::new(&dev, GptSizes::TINY).unwrap().with_autocast(Some(dtype)).unwrap();
        let before = metrics::counters();
        for _ in 0..2 {
            gpt.step().unwrap().0.item::<f32>().unwrap();
        }
        let after = metrics::counters();
        let fell: Vec<String> = after
            .iter()
            .filter(|(k, v)| {
                k.starts_with("Fallback") && before.iter().find(|(b, _)| b == k).map_or(*v, |(_, bv)| v - bv) > 0
            })
            .map(|(k, _)| k.clone())
            .collect();
        assert!(fell.is_empty(), "{dtype} autocast GPT step fell back on {}: {fell:?}", dev.name());
    }
}

/// A training loop under autocast to f16 with a `GradScaler` (whose
/// `step` is `Optimizer::step_unless`) compiles its step once: the
/// momentum buffers start as zeros made before the first update, so a
/// skipped first step keeps buffers rather than folding zeros into its
/// graph, and every step has the first step's graph.
#[test]
fn a_scaled_training_loop_compiles_its_step_once() {
    for dev in common::devices() {
        dev.manual_seed(2);
        let lin = Linear::new(16, 4, &dev).unwrap();
        let mut opt = Sgd::new(lin.parameters(), 0.1).momentum(0.9);
        let opts = GradScalerOptions { enabled: true, ..GradScalerOptions::default() };
        let mut scaler = GradScaler::with_options(&dev, opts).unwrap();
        let (x, t) = (data(&dev, [8, 16], 1), data(&dev, [8, 4], 2));
        let mut compiles = Vec::new();
        for _ in 0..5 {
            let before = dev.cached_plans();
            let loss = amp::autocast(Some(DType::F16), || nn::mse(&lin.forward(&x)?, &t)).unwrap();
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update().unwrap();
            opt.zero_grad();
            dev.mark_step().unwrap();
            dev.wait().unwrap();
            compiles.push(dev.cached_plans() - before);
        }
        assert!(compiles[0] >= 1, "{}: {compiles:?}", dev.name());
        assert!(compiles[1..].iter().all(|&c| c == 0), "{}: plans compiled per step {compiles:?}", dev.name());
    }
}
