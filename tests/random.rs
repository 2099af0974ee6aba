//! The device RNG: bit-identical uniform streams on the CPU and wgpu
//! backends for the same seed and step, reproducible by seed, advanced by
//! `mark_step`, dropout masks with the right statistics, and random ops
//! that do not recompile from step to step (the keys are parameters).

mod common;
use lazuli::prelude::*;

fn draws(dev: &Device, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<bool>) {
    dev.manual_seed(seed);
    let u = Tensor::rand([5, 1001], DType::F32, dev).unwrap();
    let n = Tensor::randn([2001], DType::F32, dev).unwrap();
    let b = Tensor::bernoulli([777], 0.3, dev).unwrap();
    lazuli::sync(&[&u, &n, &b]).unwrap();
    (u.to_vec().unwrap(), n.to_vec().unwrap(), b.to_vec().unwrap())
}

#[test]
fn streams_are_identical_across_backends() {
    let Some(gpu) = common::wgpu() else { return };
    let cpu = Device::cpu();
    let (uc, nc, bc) = draws(&cpu, 1234);
    let (ug, ng, bg) = draws(&gpu, 1234);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&uc), bits(&ug), "uniform streams must be bit-identical");
    assert_eq!(bc, bg, "bernoulli masks must be identical");
    // Normal draws use transcendental functions, which WGSL does not round
    // correctly: equal to ~1e-5.
    common::assert_close(&ng, &nc, 1e-4, 1e-5, "normal stream");
}

#[test]
fn reproducible_by_seed_and_advanced_by_mark_step() {
    for dev in common::devices() {
        let a = draws(&dev, 7);
        let b = draws(&dev, 7);
        assert_eq!(a.0, b.0, "same seed, same values on {}", dev.name());
        let c = draws(&dev, 8);
        assert_ne!(a.0, c.0, "another seed, other values");
        dev.manual_seed(7);
        let first = Tensor::rand([64], DType::F32, &dev).unwrap();
        dev.mark_step().unwrap();
        let second = Tensor::rand([64], DType::F32, &dev).unwrap();
        assert_ne!(first.to_vec::<f32>().unwrap(), second.to_vec::<f32>().unwrap(), "a new step, a new stream");
        let u = a.0;
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / u.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "uniform mean {mean}");
        let n = a.1;
        let m = n.iter().map(|&x| x as f64).sum::<f64>() / n.len() as f64;
        let var = n.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n.len() as f64;
        assert!(m.abs() < 0.08 && (var - 1.0).abs() < 0.1, "normal mean {m} var {var}");
    }
}

#[test]
fn dropout_mask_statistics() {
    for dev in common::devices() {
        dev.manual_seed(99);
        let n = 100_000;
        let p = 0.3;
        let x = Tensor::ones([n], DType::F32, &dev).unwrap();
        let y = x.dropout(p, true).unwrap().to_vec::<f32>().unwrap();
        let kept: Vec<bool> = y.iter().map(|&v| v != 0.0).collect();
        let k = kept.iter().filter(|&&b| b).count() as f64;
        // Binomial(n, 0.7): std ~ 145; allow 5 sigma.
        assert!((k - 0.7 * n as f64).abs() < 5.0 * (n as f64 * 0.21).sqrt(), "kept {k} on {}", dev.name());
        assert!(y.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6), "kept values are scaled by 1/(1-p)");
        // Neighbouring mask bits are independent: P(both kept) ~ 0.49.
        let both = kept.windows(2).filter(|w| w[0] && w[1]).count() as f64 / (n - 1) as f64;
        assert!((both - 0.49).abs() < 0.01, "adjacent keep rate {both}");
        let mean = y.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.02, "dropout keeps the expectation: {mean}");
    }
}

#[test]
fn random_ops_do_not_recompile_each_step() {
    for dev in common::devices() {
        dev.manual_seed(5);
        let w = Tensor::zeros([256], DType::F32, &dev).unwrap();
        let mut after_two = (0, 0);
        for step in 0..6 {
            let noise = Tensor::randn([256], DType::F32, &dev).unwrap().mul_scalar(0.01).unwrap();
            w.add_(&noise.dropout(0.5, true).unwrap()).unwrap();
            dev.mark_step().unwrap();
            if step == 1 {
                dev.wait().unwrap();
                after_two = dev.compile_counts();
            }
        }
        dev.wait().unwrap();
        assert_eq!(dev.compile_counts().0, after_two.0, "random ops recompiled on {}", dev.name());
        assert!(w.to_vec::<f32>().unwrap().iter().any(|&v| v != 0.0));
    }
}
