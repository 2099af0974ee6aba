//! Learning-rate schedulers and per-group learning rates: each scheduler's
//! sequence against PyTorch's formulas (and a few values worked by hand),
//! two groups moving together, per-group rates honoured by SGD and Adam,
//! no recompile in a scheduled loop on every device, and a resumed run of
//! optimizer and scheduler continuing bit for bit.

mod common;

use lazuli::nn::{self, Module};
use lazuli::optim::{
    Adam, Anneal, CosineAnnealingLR, LinearLR, LrScheduler, OneCycleLR, Optimizer, ParamGroup, Schedule, SequentialLR,
    Sgd, StepLR,
};
use lazuli::prelude::*;
use std::f64::consts::PI;

/// An SGD over two one-element groups: the first with its own rate 0.1,
/// the second with the optimizer's 0.01.
fn two_groups(dev: &Device) -> Sgd {
    let p = |v: f32| Tensor::from_slice(&[v], [1], dev).unwrap();
    Sgd::with_groups(vec![ParamGroup::plain(vec![p(1.0)]).with_lr(0.1), ParamGroup::plain(vec![p(2.0)])], 0.01)
}

/// Each group's rate at steps 0..=n of `schedule` over [`two_groups`].
fn sequence(schedule: impl Schedule + 'static, n: u64) -> Vec<Vec<f64>> {
    let dev = Device::cpu();
    let mut opt = two_groups(&dev);
    let mut sched = LrScheduler::new(&mut opt, schedule).unwrap();
    let mut out = vec![opt.group_lrs()];
    for t in 1..=n {
        sched.step(&mut opt).unwrap();
        assert_eq!(sched.last_epoch(), t);
        assert_eq!(sched.last_lr().unwrap(), opt.group_lrs());
        out.push(opt.group_lrs());
    }
    out
}

/// Checks `got` (per step, per group) against `want(base, t)` for the
/// bases 0.1 and 0.01, to 1e-12 relative.
fn check(what: &str, got: &[Vec<f64>], want: impl Fn(f64, u64) -> f64) {
    for (t, lrs) in got.iter().enumerate() {
        for (g, (&lr, base)) in lrs.iter().zip([0.1, 0.01]).enumerate() {
            let w = want(base, t as u64);
            assert!((lr - w).abs() <= 1e-12 * w.abs().max(1e-12), "{what}: step {t}, group {g}: {lr} != {w}");
        }
    }
}

#[test]
fn step_lr_decays_by_gamma_every_step_size() {
    let got = sequence(StepLR::new(3, 0.5), 10);
    // PyTorch's closed form: base_lr * gamma ** (last_epoch // step_size).
    check("StepLR", &got, |b, t| b * 0.5f64.powi((t / 3) as i32));
    let by_hand = [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025];
    for (t, w) in by_hand.iter().enumerate() {
        assert!((got[t][0] - w).abs() < 1e-15, "step {t}: {}", got[t][0]);
    }
}

#[test]
fn cosine_annealing_reaches_eta_min_at_t_max() {
    let got = sequence(CosineAnnealingLR::new(8, 0.001), 12);
    // PyTorch's closed form: eta_min + (base_lr - eta_min) * (1 + cos(pi * last_epoch / T_max)) / 2.
    check("CosineAnnealingLR", &got, |b, t| 0.001 + (b - 0.001) * (1.0 + (PI * t as f64 / 8.0).cos()) / 2.0);
    assert!((got[0][0] - 0.1).abs() < 1e-15 && (got[8][0] - 0.001).abs() < 1e-15);
    assert!((got[4][0] - 0.0505).abs() < 1e-15, "halfway is the mean: {}", got[4][0]);
    assert!(got[9][0] > got[8][0], "past t_max the cosine rises again, as in PyTorch");
}

#[test]
fn linear_lr_warms_up_then_holds() {
    let got = sequence(LinearLR::new(0.25, 1.0, 4), 7);
    // PyTorch's closed form: base_lr * (start_factor + (end_factor - start_factor) * min(total_iters, last_epoch) / total_iters).
    check("LinearLR", &got, |b, t| b * (0.25 + 0.75 * t.min(4) as f64 / 4.0));
    let by_hand = [0.025, 0.04375, 0.0625, 0.08125, 0.1, 0.1];
    for (t, w) in by_hand.iter().enumerate() {
        assert!((got[t][0] - w).abs() < 1e-15, "step {t}: {}", got[t][0]);
    }
}

/// PyTorch's `OneCycleLR.get_lr`, written out: phases by end step, the
/// last one taking every later step.
fn one_cycle_reference(max: f64, total: u64, pct: f64, cos: bool, three: bool, t: u64) -> f64 {
    let (initial, total) = (max / 25.0, total as f64);
    let min = initial / 1e4;
    let phases = if three {
        vec![(pct * total - 1.0, initial, max), (2.0 * pct * total - 2.0, max, initial), (total - 1.0, initial, min)]
    } else {
        vec![(pct * total - 1.0, initial, max), (total - 1.0, max, min)]
    };
    let mut start = 0.0;
    for (i, (end, a, b)) in phases.iter().enumerate() {
        if t as f64 <= *end || i == phases.len() - 1 {
            let p = (t as f64 - start) / (end - start);
            return if cos { b + (a - b) / 2.0 * ((PI * p).cos() + 1.0) } else { (b - a) * p + a };
        }
        start = *end;
    }
    unreachable!()
}

#[test]
fn one_cycle_rises_to_max_lr_then_anneals_and_stops_at_total_steps() {
    let got = sequence(OneCycleLR::new(1.0, 20), 20);
    check("OneCycleLR", &got, |_, t| one_cycle_reference(1.0, 20, 0.3, true, false, t));
    assert!((got[0][1] - 0.04).abs() < 1e-15, "starts at max_lr / div_factor, every group");
    assert!((got[5][0] - 1.0).abs() < 1e-15, "peaks at step pct_start * total_steps - 1");
    assert!((got[19][0] - 4e-6).abs() < 1e-18, "ends at initial / final_div_factor: {}", got[19][0]);
    let got = sequence(OneCycleLR::with_max_lrs(vec![2.0, 0.5], 10).anneal(Anneal::Linear).three_phase(true), 10);
    for (t, lrs) in got.iter().enumerate() {
        for (lr, max) in lrs.iter().zip([2.0, 0.5]) {
            let w = one_cycle_reference(max, 10, 0.3, false, true, t as u64);
            assert!((lr - w).abs() <= 1e-12 * w.abs(), "three-phase linear, step {t}: {lr} != {w}");
        }
    }
    // A rise of no steps (PyTorch divides by zero) starts at its end, max_lr.
    let got = sequence(OneCycleLR::new(1.0, 10).pct_start(0.1), 1);
    assert_eq!(got[0], vec![1.0, 1.0]);
    // Past the cycle is an error that changes nothing, as PyTorch's ValueError.
    let dev = Device::cpu();
    let mut opt = two_groups(&dev);
    let mut sched = LrScheduler::new(&mut opt, OneCycleLR::new(1.0, 2)).unwrap();
    sched.step(&mut opt).unwrap();
    sched.step(&mut opt).unwrap();
    let before = opt.group_lrs();
    let e = sched.step(&mut opt).unwrap_err().to_string();
    assert!(e.contains("OneCycleLR") && e.contains("total_steps 2"), "{e}");
    assert_eq!((sched.last_epoch(), opt.group_lrs()), (2, before));
}

#[test]
fn sequential_lr_switches_at_milestones_and_warmup_cosine_is_the_gpt_recipe() {
    let seq = SequentialLR::new(vec![Box::new(LinearLR::new(0.5, 1.0, 2)), Box::new(StepLR::new(2, 0.1))], vec![3]);
    let got = sequence(seq, 8);
    // Each schedule from its milestone with its own count restarted.
    check("SequentialLR", &got, |b, t| {
        if t < 3 {
            b * (0.5 + 0.5 * t.min(2) as f64 / 2.0)
        } else {
            b * 0.1f64.powi(((t - 3) / 2) as i32)
        }
    });
    let got = sequence(SequentialLR::warmup_cosine(4, 14, 0.1, 1e-4), 14);
    check("warmup_cosine", &got, |b, t| {
        if t < 4 {
            b * (0.1 + 0.9 * t as f64 / 4.0)
        } else {
            1e-4 + (b - 1e-4) * (1.0 + (PI * (t - 4) as f64 / 10.0).cos()) / 2.0
        }
    });
    assert!((got[4][0] - 0.1).abs() < 1e-15 && (got[14][0] - 1e-4).abs() < 1e-15);
}

#[test]
fn bad_settings_are_errors_naming_the_setting() {
    let dev = Device::cpu();
    let mut opt = two_groups(&dev);
    let cases: Vec<(Box<dyn Schedule>, &str)> = vec![
        (Box::new(StepLR::new(0, 0.1)), "step_size"),
        (Box::new(CosineAnnealingLR::new(0, 0.0)), "t_max"),
        (Box::new(LinearLR::new(0.0, 1.0, 5)), "start_factor"),
        (Box::new(LinearLR::new(0.5, 1.5, 5)), "end_factor"),
        (Box::new(OneCycleLR::with_max_lrs(vec![1.0, 2.0, 3.0], 5)), "3 max_lrs"),
        (Box::new(OneCycleLR::new(1.0, 5).pct_start(1.5)), "pct_start"),
        (Box::new(SequentialLR::new(vec![Box::new(StepLR::new(1, 0.5))], vec![2])), "milestones"),
        (Box::new(SequentialLR::warmup_cosine(0, 10, 0.1, 0.0)), "total_iters"),
    ];
    for (schedule, want) in cases {
        let e = LrScheduler::new(&mut opt, schedule).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
        assert_eq!(opt.group_lrs(), vec![0.1, 0.01], "a refused scheduler changes nothing");
    }
    // Stepping another optimizer, of another group count, is refused.
    let mut sched = LrScheduler::new(&mut opt, StepLR::new(1, 0.5)).unwrap();
    let mut single = Sgd::new(vec![Tensor::from_slice(&[1.0f32], [1], &dev).unwrap()], 0.3);
    let e = sched.step(&mut single).unwrap_err().to_string();
    assert!(e.contains("1 parameter groups, the scheduler 2"), "{e}");
    assert_eq!((sched.last_epoch(), single.group_lrs()), (0, vec![0.3]));
    let e = opt.set_group_lr(2, 0.5).unwrap_err().to_string();
    assert!(e.contains("group 2") && e.contains("has 2"), "{e}");
}

/// `loss = sum(a) + sum(b)`: every gradient is 1.
fn unit_grads(a: &Tensor, b: &Tensor) {
    a.sum(&[], false).unwrap().add(&b.sum(&[], false).unwrap()).unwrap().backward().unwrap();
}

#[test]
fn each_group_steps_with_its_own_learning_rate_in_sgd_and_adam() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let param = || Tensor::from_slice(&[1.0f32, 1.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
        let (a, b) = (param(), param());
        let groups = vec![ParamGroup::plain(vec![a.clone()]).with_lr(0.5), ParamGroup::plain(vec![b.clone()])];
        let mut sgd = Sgd::with_groups(groups, 0.1);
        unit_grads(&a, &b);
        sgd.step().unwrap();
        dev.mark_step().unwrap();
        common::assert_close(&a.to_vec::<f32>().unwrap(), &[0.5, 0.5], 1e-6, 0.0, "sgd group with lr 0.5");
        common::assert_close(&b.to_vec::<f32>().unwrap(), &[0.9, 0.9], 1e-6, 0.0, "sgd group with the default 0.1");
        // Adam's first step moves each parameter by its rate (m / sqrt(v) = 1).
        let (a, b) = (param(), param());
        let groups = vec![ParamGroup::plain(vec![a.clone()]), ParamGroup::plain(vec![b.clone()]).with_lr(0.02)];
        let mut adam = Adam::with_groups(groups, 0.25);
        unit_grads(&a, &b);
        adam.step().unwrap();
        dev.mark_step().unwrap();
        common::assert_close(&a.to_vec::<f32>().unwrap(), &[0.75, 0.75], 1e-5, 0.0, "adam default lr");
        common::assert_close(&b.to_vec::<f32>().unwrap(), &[0.98, 0.98], 1e-5, 0.0, "adam group lr");
    }
}

/// The model of the loop tests, drawn from `seed`.
fn model(dev: &Device, seed: u64) -> nn::Sequential {
    dev.manual_seed(seed);
    nn::Sequential::new()
        .add(nn::Linear::new(6, 10, dev).unwrap())
        .add(nn::Activation::Relu)
        .add(nn::Linear::new(10, 4, dev).unwrap())
}

/// AdamW over decay groups, the second with its own rate.
fn adamw(m: &nn::Sequential) -> Adam {
    let mut groups = lazuli::optim::decay_groups(m, 0.01);
    groups[1].lr = Some(3e-3);
    Adam::adamw_groups(groups, 1e-2)
}

/// `steps` scheduled training steps on a fixed batch; each loss's bits.
fn run(dev: &Device, m: &nn::Sequential, opt: &mut Adam, sched: &mut LrScheduler, steps: usize) -> Vec<u32> {
    let x = Tensor::from_slice(&common::rand_vec(8 * 6, 31, -1.0, 1.0), [8, 6], dev).unwrap();
    let y = Tensor::from_slice(&[0i64, 1, 2, 3, 3, 2, 1, 0], [8], dev).unwrap();
    (0..steps)
        .map(|_| {
            opt.zero_grad();
            let loss = nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            sched.step(opt).unwrap();
            dev.mark_step().unwrap();
            loss.item::<f32>().unwrap().to_bits()
        })
        .collect()
}

#[test]
fn a_scheduled_loop_compiles_nothing_after_step_two_on_every_device() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let m = model(&dev, 3);
        let mut opt = adamw(&m);
        let mut sched = LrScheduler::new(&mut opt, SequentialLR::warmup_cosine(3, 8, 0.1, 1e-4)).unwrap();
        let mut seen = Vec::new();
        run(&dev, &m, &mut opt, &mut sched, 2);
        dev.wait().unwrap();
        let before = common::plans_compiled();
        for _ in 0..6 {
            run(&dev, &m, &mut opt, &mut sched, 1);
            seen.push(opt.group_lrs());
        }
        dev.wait().unwrap();
        assert_eq!(common::plans_compiled() - before, 0, "{}: a new rate compiled a graph", dev.name());
        assert!(seen.windows(2).all(|w| w[0] != w[1]), "{}: every step changed the rates: {seen:?}", dev.name());
        assert!((seen[0][0] / seen[0][1] - 1e-2 / 3e-3).abs() < 1e-12, "both groups scale from their own base");
    }
}

/// Stopping after 3 steps, saving model, optimizer and scheduler, and
/// loading all three into fresh ones continues with the uninterrupted
/// run's losses, bit for bit (CPU backend); without the scheduler's state
/// the run differs (the test can tell).
#[test]
fn resumed_optimizer_and_scheduler_continue_bit_for_bit() {
    let _lock = common::metrics_lock();
    let dev = Device::cpu();
    let dir = std::env::temp_dir().join(format!("lazuli-schedulers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let paths = ["model", "opt", "sched"].map(|n| dir.join(format!("{n}.safetensors")));
    let schedule = || OneCycleLR::with_max_lrs(vec![2e-2, 5e-3], 8);
    let fresh = |seed| {
        let m = model(&dev, seed);
        let mut opt = adamw(&m);
        let sched = LrScheduler::new(&mut opt, schedule()).unwrap();
        (m, opt, sched)
    };
    let (a, mut opt, mut sched) = fresh(41);
    let want = run(&dev, &a, &mut opt, &mut sched, 8);
    let (b, mut opt, mut sched) = fresh(41);
    assert_eq!(run(&dev, &b, &mut opt, &mut sched, 4), want[..4]);
    b.save_state_dict(&paths[0]).unwrap();
    opt.save_state_dict(&paths[1]).unwrap();
    sched.save_state_dict(&paths[2]).unwrap();
    let resume = |with_sched: bool| {
        let (c, mut opt, mut sched) = fresh(99);
        c.load_state_dict(&paths[0]).unwrap();
        opt.load_state_dict(&paths[1]).unwrap();
        if with_sched {
            sched.load_state_dict(&paths[2], &mut opt).unwrap();
            assert_eq!(sched.last_epoch(), 4);
        }
        run(&dev, &c, &mut opt, &mut sched, 4)
    };
    assert_eq!(resume(true), want[4..], "resumed with the scheduler");
    assert_ne!(resume(false), want[4..], "resumed without the scheduler's state");

    // A scheduler state for another number of groups, or an optimizer
    // state, is refused by name and changes nothing.
    let mut one = Adam::new(model(&dev, 5).parameters(), 1e-3);
    let mut s = LrScheduler::new(&mut one, StepLR::new(2, 0.5)).unwrap();
    let e = s.load_state_dict(&paths[2], &mut one).unwrap_err().to_string();
    assert!(e.contains("base_lrs") && e.contains("1 groups"), "{e}");
    let e = s.load_state_dict(&paths[1], &mut one).unwrap_err().to_string();
    assert!(e.contains("not scheduler state"), "{e}");
    assert_eq!((s.last_epoch(), one.group_lrs()), (0, vec![1e-3]));
    std::fs::remove_dir_all(&dir).ok();
}
