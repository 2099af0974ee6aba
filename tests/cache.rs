//! Compile-cache behaviour: a repeated loop compiles once; a new scalar
//! value compiles nothing; any change of meaning compiles anew.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

fn step(dev: &Device, x: &Tensor, s: f32) -> lazuli::Result<Vec<f32>> {
    let _ = dev;
    let y = ((x * s)? + 0.5)?.tanh()?;
    y.to_vec::<f32>()
}

#[test]
fn same_loop_ten_times_compiles_once() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let x = Tensor::from_slice(&common::rand_vec(300, 1, -1.0, 1.0), [10, 30], &dev).unwrap();
        let (u0, c0) = (common::plans_compiled(), metrics::counter("CachedCompile"));
        for _ in 0..10 {
            step(&dev, &x, 0.37).unwrap();
        }
        assert_eq!(common::plans_compiled() - u0, 1, "{}", dev.name());
        assert_eq!(metrics::counter("CachedCompile") - c0, 9, "{}", dev.name());
    }
}

#[test]
fn new_scalar_value_compiles_nothing() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let data = common::rand_vec(64, 2, -1.0, 1.0);
        let x = Tensor::from_slice(&data, [64], &dev).unwrap();
        let u0 = common::plans_compiled();
        let p0 = metrics::counter("PipelinesCreated");
        for (k, s) in [0.37f32, 0.5, 2.25, -3.5, 7.0].into_iter().enumerate() {
            let got = step(&dev, &x, s).unwrap();
            let want: Vec<f32> = data.iter().map(|v| (v * s + 0.5).tanh()).collect();
            common::assert_close(&got, &want, 1e-5, 1e-6, &format!("scalar {s} on {}", dev.name()));
            if k == 0 {
                assert_eq!(common::plans_compiled() - u0, 1);
            }
        }
        assert_eq!(common::plans_compiled() - u0, 1, "scalar change recompiled on {}", dev.name());
        if dev.kind() == BackendKind::Wgpu {
            // One pipeline for the whole loop (possibly none if an earlier test built it).
            assert!(metrics::counter("PipelinesCreated") - p0 <= 1);
        }
    }
}

use lazuli::BackendKind;

#[test]
fn changed_meaning_changes_the_key() {
    let _g = common::metrics_lock();
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], &dev).unwrap();
    let h = |t: &Tensor| lazuli::debug::graph_hash(&[t]);
    let base = h(&x.exp().unwrap());
    assert_eq!(base, h(&x.exp().unwrap()), "same graph, same key");
    assert_ne!(base, h(&x.log().unwrap()), "op differs");
    assert_ne!(base, h(&x.reshape([4]).unwrap().exp().unwrap()), "shape differs");
    assert_ne!(base, h(&x.cast(DType::F16).unwrap().exp().unwrap()), "dtype differs");
    let a = (&x * 0.25).unwrap();
    let b = (&x * 0.75).unwrap();
    assert_eq!(h(&a), h(&b), "lifted scalar values are not part of the key");
    let c = (&x * 1.0).unwrap();
    assert_ne!(h(&a), h(&c), "baked special constants are");
    let y = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], &dev).unwrap();
    assert_ne!(h(&(&x + &x).unwrap()), h(&(&x + &y).unwrap()), "parameter aliasing is part of the key");
}

#[test]
fn cached_plan_behaves_like_a_fresh_one() {
    let _g = common::metrics_lock();
    for dev in common::devices() {
        let data = common::rand_vec(40, 3, -2.0, 2.0);
        let x = Tensor::from_slice(&data, [8, 5], &dev).unwrap();
        let run = || x.exp().unwrap().sum(&[1], false).unwrap().to_vec::<f32>().unwrap();
        let first = run();
        let second = run();
        assert_eq!(first, second, "{}", dev.name());
    }
}

/// The two plans of [`a_kernel_in_a_plan_with_other_scalars_reuses_its_pipeline`]:
/// `A` is a softmax of `x * 1.75` (one kernel reading one lifted scalar);
/// `B` lifts `2.5` first, read by a row sum, then computes `A`.
fn plan_a(x: &Tensor) -> lazuli::Result<Tensor> {
    (x * 1.75)?.softmax(1)
}

fn plan_b(x: &Tensor) -> lazuli::Result<(Tensor, Tensor)> {
    let sums = (x * 2.5)?.sum(&[1], false)?;
    Ok((sums, plan_a(x)?))
}

/// A kernel declares only the scalars it reads, numbered in its own order:
/// the same kernel in a plan whose graph lifts another scalar before its
/// own is the same source and runs the pipeline the first plan made
/// (before, every kernel declared all of its graph's scalars, so none of a
/// plan's kernels matched another plan's with other scalars).
#[test]
fn a_kernel_in_a_plan_with_other_scalars_reuses_its_pipeline() {
    let _g = common::metrics_lock();
    let data = common::rand_vec(8 * 96, 3, -1.0, 1.0);
    let cpu = Device::cpu();
    let xc = Tensor::from_slice(&data, [8, 96], &cpu).unwrap();
    let (want_sums, want_soft) = plan_b(&xc).unwrap();
    let (want_sums, want_soft) = (want_sums.to_vec::<f32>().unwrap(), want_soft.to_vec::<f32>().unwrap());
    let created = || metrics::counter("PipelinesCreated");
    let fresh = common::wgpu_profiles();
    for ((forms, dev), (_, alone)) in common::wgpu_profiles().into_iter().zip(fresh) {
        let x = Tensor::from_slice(&data, [8, 96], &dev).unwrap();
        let p0 = created();
        let a = plan_a(&x).unwrap().to_vec::<f32>().unwrap();
        let made_a = created() - p0;
        common::assert_close(&a, &want_soft, 1e-5, 1e-6, &format!("plan A, {forms}"));
        let p1 = created();
        let (sums, soft) = plan_b(&x).unwrap();
        lazuli::sync(&[&sums, &soft]).unwrap();
        let made_b = created() - p1;
        common::assert_close(&sums.to_vec::<f32>().unwrap(), &want_sums, 1e-5, 1e-5, &format!("plan B sums, {forms}"));
        common::assert_close(
            &soft.to_vec::<f32>().unwrap(),
            &want_soft,
            1e-5,
            1e-6,
            &format!("plan B softmax, {forms}"),
        );
        // Plan B alone, on a device that has seen nothing.
        let x = Tensor::from_slice(&data, [8, 96], &alone).unwrap();
        let p2 = created();
        let (sums, soft) = plan_b(&x).unwrap();
        lazuli::sync(&[&sums, &soft]).unwrap();
        let made_alone = created() - p2;
        assert!(made_a >= 1, "{forms}: plan A made its pipelines");
        assert_eq!(made_a + made_b, made_alone, "{forms}: plan B reused every pipeline of plan A");
    }
}
