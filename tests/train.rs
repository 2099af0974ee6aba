//! Training through the public API: the digits demo (accuracy, one cached
//! graph per step), optimizers against hand-computed updates, learning-rate
//! changes without recompiles, safetensors round trips, and resuming a run
//! from model and optimizer checkpoints.

mod common;

use lazuli::debug;
use lazuli::nn::{self, Module};
use lazuli::optim::{Adam, Optimizer, Sgd};
use lazuli::prelude::*;
use lazuli::train::{train_digits, Digits, TrainConfig};

fn digits() -> Digits {
    Digits::load(&Digits::default_dir()).expect("data/digits ships with the repository")
}

#[test]
fn digits_demo_trains_on_cpu_with_one_graph_per_step() {
    let cfg = TrainConfig { epochs: 8, ..TrainConfig::default() };
    let report = train_digits(&Device::cpu(), &digits(), &cfg, &mut |_| {}).unwrap();
    assert_eq!(report.steps, 8 * (1437 / 64));
    assert!(report.test_accuracy >= 0.95, "test accuracy {}", report.test_accuracy);
    assert_eq!(report.uncached_compiles_after_step_2, 0);
    assert!(report.epoch_losses.windows(2).all(|w| w[1] < w[0] * 1.2), "{:?}", report.epoch_losses);
    let json = report.to_json();
    for key in [
        "device",
        "epochs",
        "steps",
        "test_accuracy",
        "median_step_ms",
        "uncached_compiles",
        "uncached_compiles_after_step_2",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
}

#[test]
fn digits_demo_trains_on_wgpu() {
    let Some(dev) = common::wgpu() else { return };
    let cfg = TrainConfig { epochs: 3, ..TrainConfig::default() };
    let report = train_digits(&dev, &digits(), &cfg, &mut |_| {}).unwrap();
    assert!(report.test_accuracy >= 0.9, "test accuracy {}", report.test_accuracy);
    assert_eq!(report.uncached_compiles_after_step_2, 0);
}

#[test]
fn cnn_demo_trains_on_cpu_with_one_graph_per_step() {
    // `fallback_ops` is a process-wide counter: no wgpu training beside it.
    let _lock = common::metrics_lock();
    // With PyTorch's default initialization the CNN reaches 96.4% after 4
    // epochs on the CPU (92.2% after 3, 98.9% after 30).
    let cfg = TrainConfig { epochs: 4, ..TrainConfig::cnn() };
    let report = train_digits(&Device::cpu(), &digits(), &cfg, &mut |_| {}).unwrap();
    assert_eq!(report.model, "cnn");
    assert_eq!(report.steps, 4 * (1437 / 64));
    assert!(report.test_accuracy >= 0.93, "test accuracy {}", report.test_accuracy);
    assert_eq!(report.uncached_compiles_after_step_2, 0);
    assert_eq!(report.fallback_ops, 0);
}

/// On wgpu the whole CNN step runs natively: convolutions (forward and
/// both gradients), pooling and its gradient; the report lists nothing on
/// the CPU fallback.
#[test]
fn cnn_demo_trains_on_wgpu_with_no_fallback() {
    let Some(dev) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    let cfg = TrainConfig { epochs: 1, ..TrainConfig::cnn() };
    let report = train_digits(&dev, &digits(), &cfg, &mut |_| {}).unwrap();
    // One epoch reaches 61% on the CPU (chance is 10%).
    assert!(report.test_accuracy >= 0.5, "test accuracy {}", report.test_accuracy);
    assert_eq!(report.uncached_compiles_after_step_2, 0);
    assert_eq!(report.fallback_ops, 0, "{:?}", report.fallback_by_op);
    assert!(report.fallback_by_op.is_empty(), "{:?}", report.fallback_by_op);
}

/// Library use prints nothing about Wayland on a headless machine: with
/// XDG_RUNTIME_DIR unset, opening the wgpu device used to print libwayland's
/// "error: XDG_RUNTIME_DIR is invalid or not set" twice per instance.
#[test]
fn opening_wgpu_without_xdg_runtime_dir_prints_nothing_about_it() {
    if common::wgpu().is_none() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazuli"))
        .arg("info")
        // The adapter even where it is a software one (lavapipe): opening
        // it is what this checks.
        .env("LAZULI_DEVICE", "wgpu")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("WAYLAND_SOCKET")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("default device: wgpu"), "{stdout}");
    assert!(!stderr.contains("XDG_RUNTIME_DIR"), "{stderr}");
    let bad =
        std::process::Command::new(env!("CARGO_BIN_EXE_lazuli")).args(["demo", "--model", "rnn"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--model takes mlp or cnn"));
}

/// One W4-style step: forward, backward, SGD update, one mark_step.
fn mlp_step(dev: &Device, model: &impl Module, opt: &mut (impl Optimizer + ?Sized), x: &Tensor, y: &Tensor) -> u64 {
    let loss = nn::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
    opt.zero_grad();
    let live: Vec<Tensor> = model.parameters();
    let refs: Vec<&Tensor> = live.iter().collect();
    let hash = debug::graph_hash(&refs);
    drop(loss);
    dev.mark_step().unwrap();
    hash
}

/// Every step from the first has one graph (the optimizer materializes
/// the lazily initialized weights when made, and each step's fresh state
/// as zeros before recording): one compile for the step, none after it,
/// learning-rate changes included; SGD with dampening keeps a first step
/// of its own (PyTorch's first buffer is the undampened gradient).
#[test]
fn steady_training_step_has_one_graph_hash_and_lr_changes_compile_nothing() {
    type MakeOpt = fn(Vec<Tensor>) -> Box<dyn Optimizer>;
    let optimizers: [(&str, MakeOpt, usize); 5] = [
        ("sgd", |p| Box::new(Sgd::new(p, 0.1).weight_decay(1e-4)), 0),
        ("sgd momentum", |p| Box::new(Sgd::new(p, 0.1).momentum(0.9).weight_decay(1e-4)), 0),
        ("sgd nesterov", |p| Box::new(Sgd::new(p, 0.1).momentum(0.9).nesterov(true)), 0),
        ("sgd dampening", |p| Box::new(Sgd::new(p, 0.1).momentum(0.9).dampening(0.1)), 1),
        ("adamw", |p| Box::new(Adam::adamw(p, 0.01, 0.1)), 0),
    ];
    for (name, make, first_steady) in optimizers {
        let dev = Device::cpu();
        dev.manual_seed(5);
        let model = nn::Sequential::new()
            .add(nn::Linear::new(8, 16, &dev).unwrap())
            .add(nn::Activation::Relu)
            .add(nn::Linear::new(16, 4, &dev).unwrap());
        let mut opt = make(model.parameters());
        let x = Tensor::from_slice(&common::rand_vec(32, 1, -1.0, 1.0), [4, 8], &dev).unwrap();
        let y = Tensor::from_slice(&[0i32, 1, 2, 3], [4], &dev).unwrap();
        let mut hashes = Vec::new();
        let mut compiles = Vec::new();
        for step in 0..6 {
            opt.set_lr(0.1 / (step + 1) as f64);
            let before = dev.cached_plans();
            hashes.push(mlp_step(&dev, &model, opt.as_mut(), &x, &y));
            dev.wait().unwrap();
            compiles.push(dev.cached_plans() - before);
        }
        let steady = &hashes[first_steady..];
        assert!(steady.iter().all(|h| *h == steady[0]), "{name}: {hashes:x?}");
        assert!(compiles[first_steady + 1..].iter().all(|&c| c == 0), "{name}: plans compiled per step {compiles:?}");
        if first_steady > 0 {
            assert_ne!(hashes[0], hashes[1], "{name}: the first step has its own graph");
        }
        // Parameters stay trainable leaves across the in-place updates.
        assert!(model.parameters().iter().all(|p| p.requires_grad() && p.is_leaf() && p.grad().is_none()), "{name}");
    }
}

#[test]
fn sgd_momentum_matches_hand_computation() {
    let dev = Device::cpu();
    let w = Tensor::from_slice(&[1.0f32, -2.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    let mut opt = Sgd::new(vec![w.clone()], 0.1).momentum(0.5).weight_decay(0.1);
    let (mut wh, mut buf) = ([1.0f64, -2.0], [0.0f64; 2]);
    for step in 0..3 {
        opt.zero_grad();
        // loss = sum(w^2) -> grad 2w.
        w.mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
        opt.step().unwrap();
        dev.mark_step().unwrap();
        for i in 0..2 {
            let g = 2.0 * wh[i] + 0.1 * wh[i];
            buf[i] = if step == 0 { g } else { 0.5 * buf[i] + g };
            wh[i] -= 0.1 * buf[i];
        }
    }
    let got = w.to_vec::<f32>().unwrap();
    common::assert_close(&got, &[wh[0] as f32, wh[1] as f32], 1e-5, 1e-6, "sgd momentum");
}

#[test]
fn adam_and_adamw_match_hand_computation() {
    for decoupled in [false, true] {
        let dev = Device::cpu();
        let w = Tensor::from_slice(&[0.5f32, -1.5, 2.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
        let mut opt = if decoupled {
            Adam::adamw(vec![w.clone()], 0.05, 0.1)
        } else {
            Adam::new(vec![w.clone()], 0.05).weight_decay(0.1)
        };
        let mut wh = [0.5f64, -1.5, 2.0];
        let (mut m, mut v) = ([0.0f64; 3], [0.0f64; 3]);
        for t in 1..=4 {
            opt.zero_grad();
            // loss = sum(w^3) -> grad 3w^2.
            w.mul(&w).unwrap().mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
            opt.step().unwrap();
            dev.mark_step().unwrap();
            for i in 0..3 {
                let mut g = 3.0 * wh[i] * wh[i];
                if decoupled {
                    wh[i] *= 1.0 - 0.05 * 0.1;
                } else {
                    g += 0.1 * wh[i];
                }
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.999 * v[i] + 0.001 * g * g;
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                wh[i] -= 0.05 * mh / (vh.sqrt() + 1e-8);
            }
        }
        let want: Vec<f32> = wh.iter().map(|&x| x as f32).collect();
        common::assert_close(&w.to_vec::<f32>().unwrap(), &want, 1e-5, 1e-6, &format!("adam decoupled={decoupled}"));
    }
}

#[test]
fn safetensors_round_trip_keeps_parameters_trainable() {
    let dev = Device::cpu();
    dev.manual_seed(9);
    let a = nn::Linear::new(3, 2, &dev).unwrap();
    let b = nn::Linear::new(3, 2, &dev).unwrap();
    let dir = std::env::temp_dir().join(format!("lazuli-safetensors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("linear.safetensors");
    lazuli::serialize::save(&path, &a.named_parameters()).unwrap();
    let loaded = lazuli::serialize::load(&path, &dev).unwrap();
    assert_eq!(loaded.len(), 2);
    assert_eq!(loaded["weight"].to_vec::<f32>().unwrap(), a.weight.to_vec::<f32>().unwrap());
    lazuli::serialize::load_into(&path, &b.named_parameters()).unwrap();
    assert_eq!(b.weight.to_vec::<f32>().unwrap(), a.weight.to_vec::<f32>().unwrap());
    assert_eq!(b.bias.as_ref().unwrap().to_vec::<f32>().unwrap(), a.bias.as_ref().unwrap().to_vec::<f32>().unwrap());
    assert!(b.weight.requires_grad() && b.weight.is_leaf());
    // A missing name is an error naming it.
    let wrong = vec![("nope".to_string(), b.weight.clone())];
    let e = lazuli::serialize::load_into(&path, &wrong).unwrap_err().to_string();
    assert!(e.contains("nope"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn dropout_is_seeded_and_scaled() {
    let dev = Device::cpu();
    let x = Tensor::ones([1000], DType::F32, &dev).unwrap();
    dev.manual_seed(4);
    let a = x.dropout(0.25, true).unwrap().to_vec::<f32>().unwrap();
    dev.manual_seed(4);
    let b = x.dropout(0.25, true).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a, b, "same seed, same mask");
    let kept = a.iter().filter(|&&v| v != 0.0).count();
    assert!((650..850).contains(&kept), "kept {kept} of 1000");
    assert!(a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6));
    let c = x.dropout(0.25, true).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a, c, "a second draw in the same step uses a new stream");
    assert_eq!(x.dropout(0.25, false).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 1000]);
}

/// The model of the resume tests, drawn from `seed`.
fn resume_model(dev: &Device, seed: u64) -> nn::Sequential {
    dev.manual_seed(seed);
    nn::Sequential::new()
        .add(nn::Linear::new(6, 10, dev).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::Linear::new(10, 4, dev).unwrap())
}

/// `steps` training steps on a fixed batch; each loss's bits.
fn run_steps(dev: &Device, model: &nn::Sequential, opt: &mut impl Optimizer, steps: usize) -> Vec<u32> {
    let x = Tensor::from_slice(&common::rand_vec(8 * 6, 31, -1.0, 1.0), [8, 6], dev).unwrap();
    let y = Tensor::from_slice(&[0i64, 1, 2, 3, 3, 2, 1, 0], [8], dev).unwrap();
    (0..steps)
        .map(|_| {
            opt.zero_grad();
            let loss = nn::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            dev.mark_step().unwrap();
            loss.item::<f32>().unwrap().to_bits()
        })
        .collect()
}

/// Stopping after 3 steps, saving model and optimizer, and loading both
/// into a freshly drawn model and a new optimizer continues with the
/// losses of the uninterrupted run, bit for bit (CPU backend), for SGD
/// with Nesterov momentum and for AdamW over decay groups; loading the
/// model alone does not (the test can tell).
#[test]
fn resumed_training_matches_the_uninterrupted_run_bit_for_bit() {
    let dev = Device::cpu();
    let dir = std::env::temp_dir().join(format!("lazuli-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (model_path, opt_path) = (dir.join("model.safetensors"), dir.join("opt.safetensors"));
    let sgd = |m: &nn::Sequential| Sgd::new(m.parameters(), 0.1).momentum(0.9).nesterov(true).weight_decay(1e-3);
    let adamw = |m: &nn::Sequential| Adam::adamw_groups(lazuli::optim::decay_groups(m, 0.01), 1e-2);
    // SGD with momentum.
    let a = resume_model(&dev, 21);
    let want = run_steps(&dev, &a, &mut sgd(&a), 6);
    let b = resume_model(&dev, 21);
    let mut opt = sgd(&b);
    assert_eq!(run_steps(&dev, &b, &mut opt, 3), want[..3]);
    assert_eq!(opt.state_dict().len(), 4, "a momentum buffer per parameter");
    b.save_state_dict(&model_path).unwrap();
    opt.save_state_dict(&opt_path).unwrap();
    let c = resume_model(&dev, 99);
    c.load_state_dict(&model_path).unwrap();
    let mut resumed = sgd(&c);
    resumed.load_state_dict(&opt_path).unwrap();
    assert_eq!(run_steps(&dev, &c, &mut resumed, 3), want[3..], "sgd resumed");
    let d = resume_model(&dev, 99);
    d.load_state_dict(&model_path).unwrap();
    assert_ne!(run_steps(&dev, &d, &mut sgd(&d), 3), want[3..], "sgd without its momentum");

    // AdamW: moments and the step count (its bias corrections).
    let a = resume_model(&dev, 22);
    let want = run_steps(&dev, &a, &mut adamw(&a), 6);
    let b = resume_model(&dev, 22);
    let mut opt = adamw(&b);
    assert_eq!(run_steps(&dev, &b, &mut opt, 3), want[..3]);
    b.save_state_dict(&model_path).unwrap();
    opt.save_state_dict(&opt_path).unwrap();
    let c = resume_model(&dev, 99);
    c.load_state_dict(&model_path).unwrap();
    let mut resumed = adamw(&c);
    resumed.load_state_dict(&opt_path).unwrap();
    assert_eq!(resumed.steps(), 3);
    assert_eq!(run_steps(&dev, &c, &mut resumed, 3), want[3..], "adamw resumed");
    let d = resume_model(&dev, 99);
    d.load_state_dict(&model_path).unwrap();
    assert_ne!(run_steps(&dev, &d, &mut adamw(&d), 3), want[3..], "adamw without its state");

    // A checkpoint of another optimizer or model is refused, naming the
    // tensor, and changes nothing.
    let e = sgd(&c).load_state_dict(&opt_path).unwrap_err().to_string();
    assert!(e.contains("exp_avg") && e.contains("not optimizer state"), "{e}");
    let other = nn::Sequential::new().add(nn::Linear::new(6, 5, &dev).unwrap());
    let mut wrong = adamw(&other);
    let e = wrong.load_state_dict(&opt_path).unwrap_err().to_string();
    assert!(e.contains("exp_avg") && e.contains("parameter"), "{e}");
    assert_eq!(wrong.steps(), 0);
    lazuli::serialize::save(&opt_path, &[]).unwrap();
    let e = adamw(&c).load_state_dict(&opt_path).unwrap_err().to_string();
    assert!(e.contains("\"step\"") && e.contains("not in the file"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
