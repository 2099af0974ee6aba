//! Split-K matmul through the facade: the weight gradient of a linear
//! layer over many tokens (`x^T dy`, as the autograd records it) is split
//! over K by the GPU profile's rule and must match the CPU reference in
//! both kernel-form profiles.

mod common;
use lazuli::prelude::*;

fn f32s(dev: &Device, dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_slice(&common::rand_vec(n, seed, -1.0, 1.0), dims.to_vec(), dev).unwrap()
}

/// `relu(x w^T + b)` over `tokens` rows (as `nn::Linear` records it,
/// `w` of [out, in]), a squared loss, backward: the weight gradient
/// `(x^T dy)^T` has K = `tokens`. Returns the loss and the
/// gradients of `w`, `b` and `x`, and the kernel names of the gradients.
fn linear_step(dev: &Device, tokens: usize, d_in: usize, d_out: usize) -> (Vec<Vec<f32>>, Vec<String>) {
    let x = f32s(dev, &[tokens, d_in], 1).requires_grad_(true).unwrap();
    let w = f32s(dev, &[d_out, d_in], 2).requires_grad_(true).unwrap();
    let b = f32s(dev, &[d_out], 3).requires_grad_(true).unwrap();
    let y = x.matmul(&w.t().unwrap()).unwrap().add(&b).unwrap().relu().unwrap();
    let loss = y.mul(&y).unwrap().sum(&[], false).unwrap();
    loss.backward().unwrap();
    let (gw, gb, gx) = (w.grad().unwrap(), b.grad().unwrap(), x.grad().unwrap());
    let names = lazuli::debug::backend_code(&[&gw]).unwrap().into_iter().map(|(n, _)| n).collect();
    lazuli::sync(&[&loss, &gw, &gb, &gx]).unwrap();
    let vals = [&loss, &gw, &gb, &gx].iter().map(|t| t.to_vec::<f32>().unwrap()).collect();
    (vals, names)
}

#[test]
fn weight_gradient_split_over_k_matches_the_cpu() {
    let cpu = Device::cpu();
    for (profile, dev) in common::wgpu_profiles() {
        for (tokens, d_in, d_out) in [(2048, 64, 64), (1100, 48, 40)] {
            let (got, names) = linear_step(&dev, tokens, d_in, d_out);
            let (want, _) = linear_step(&cpu, tokens, d_in, d_out);
            let split = names.iter().any(|n| n.ends_with("_pass1"));
            // The GPU profile splits the weight gradient; the software one
            // never does.
            assert_eq!(split, profile == "gpu forms", "{profile} {tokens}x{d_in}x{d_out}: {names:?}");
            for (what, (g, w)) in ["loss", "dw", "db", "dx"].iter().zip(got.iter().zip(&want)) {
                common::assert_close(g, w, 1e-4, 1e-3, &format!("{what}, {profile}, {tokens}x{d_in}x{d_out}"));
            }
        }
    }
}

/// A token count that recurs gets the static kernels back, the split
/// weight gradient (a two-pass kernel, with its scratch) among them: a
/// size variant's generic product never splits, and the second tier
/// (`lazuli_wgpu::tier`) swaps the split one in between two steps. Every
/// step before and after matches the CPU.
#[test]
fn a_recurring_token_count_gets_the_split_weight_gradient_back() {
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let opts = lazuli::WgpuDeviceOptions {
        kernel_forms: Some(lazuli::wgpu::forms::KernelForms::gpu()),
        specialize_after: Some(2),
        ..Default::default()
    };
    let dev = Device::wgpu_with(opts).unwrap();
    let cpu = Device::cpu();
    let (tokens, d_in, d_out) = (1101, 48, 40);
    let (want, _) = linear_step(&cpu, tokens, d_in, d_out);
    let check = |what: &str| {
        let (got, _) = linear_step(&dev, tokens, d_in, d_out);
        for (part, (g, w)) in ["loss", "dw", "db", "dx"].iter().zip(got.iter().zip(&want)) {
            common::assert_close(g, w, 1e-4, 1e-3, &format!("{part}, {what}"));
        }
    };
    // A first token count compiles static kernels; the next is a size
    // variant, generic.
    linear_step(&dev, 1100, d_in, d_out);
    let plans0 = lazuli::metrics::counter("SpecializedPlans");
    let mut steps = 0;
    while lazuli::metrics::counter("SpecializedPlans") == plans0 {
        assert!(steps < 2000, "no static kernels after {steps} steps");
        check("generic kernels");
        steps += 1;
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    check("static kernels");
    check("static kernels again");
}
