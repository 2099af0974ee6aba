//! Sizes as runtime data: graphs that differ only in sizes share generic
//! pipelines on wgpu (see `lazuli_wgpu::generic`), and every size still
//! matches the CPU reference, in both kernel-form profiles.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

/// The wgpu devices to check: one per kernel-form profile.
fn wgpu_devices() -> Vec<(&'static str, Device)> {
    if common::wgpu().is_none() {
        return Vec::new();
    }
    let with = |forms: lazuli::KernelForms| {
        let opts = lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), ..Default::default() };
        Device::wgpu_with(opts).expect("a wgpu device")
    };
    vec![("software forms", with(lazuli::KernelForms::software())), ("gpu forms", with(lazuli::KernelForms::gpu()))]
}

/// One step of causal attention over a context of `t` tokens (as greedy
/// generation with a growing context runs it): projections, scores with a
/// causal mask, softmax, the weighted sum, a layer norm, and the last
/// position picked with `narrow` at a start that moves with `t`.
fn attention_step(x: &Tensor, w: &Tensor, t: usize) -> lazuli::Result<Tensor> {
    let dev = x.device();
    let q = x.matmul(w)?;
    let scores = (q.matmul(&x.transpose(0, 1)?)? * 0.25)?;
    let rows = Tensor::arange(0.0, t as f64, 1.0, DType::F32, dev)?.reshape([t as isize, 1])?;
    let cols = Tensor::arange(0.0, t as f64, 1.0, DType::F32, dev)?.reshape([1, t as isize])?;
    let masked = cols.gt(&rows)?.where_(&Tensor::full([1usize], -1e9, DType::F32, dev)?, &scores)?;
    let att = masked.softmax(-1)?.matmul(x)?;
    let h = (&att + x)?;
    let mean = h.mean(&[-1], true)?;
    let centered = (&h - &mean)?;
    let var = (&centered * &centered)?.mean(&[-1], true)?;
    let normed = (&centered / &(var + 1e-5)?.sqrt()?)?;
    normed.narrow(0, t - 1, 1)?.sum(&[0], false)
}

#[test]
fn a_growing_context_shares_pipelines_and_matches_the_cpu() {
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let d = 16;
    let wdata = common::rand_vec(d * d, 7, -0.5, 0.5);
    for (profile, dev) in wgpu_devices() {
        let w_gpu = Tensor::from_slice(&wdata, [d, d], &dev).unwrap();
        let w_cpu = Tensor::from_slice(&wdata, [d, d], &cpu).unwrap();
        let p0 = metrics::counter("PipelinesCreated");
        let mut created = Vec::new();
        for t in 5..=40usize {
            let xdata = common::rand_vec(t * d, t as u64, -1.0, 1.0);
            let x_gpu = Tensor::from_slice(&xdata, [t, d], &dev).unwrap();
            let x_cpu = Tensor::from_slice(&xdata, [t, d], &cpu).unwrap();
            let before = metrics::counter("PipelinesCreated");
            let got = attention_step(&x_gpu, &w_gpu, t).unwrap().to_vec::<f32>().unwrap();
            created.push(metrics::counter("PipelinesCreated") - before);
            let want = attention_step(&x_cpu, &w_cpu, t).unwrap().to_vec::<f32>().unwrap();
            common::assert_close(&got, &want, 1e-4, 1e-4, &format!("context {t}, {profile}"));
        }
        let total = metrics::counter("PipelinesCreated") - p0;
        // Without generic sizes every one of the 36 lengths compiles all
        // of its kernels (about 8): some 280 pipelines. With them, the
        // first size compiles static kernels, the second (a size variant)
        // size-independent forms, and later sizes only where a family
        // first sees a value change (a new row block, a slot split); by
        // lengths 25..=40 that is rare.
        let late: u64 = created[(25 - 5)..].iter().sum();
        assert!(late <= 4, "{profile}: lengths 25..=40 created {late} pipelines: {created:?}");
        assert!(total <= 60, "{profile}: {total} pipelines for 36 lengths: {created:?}");
    }
}

#[test]
fn generic_kernels_match_the_cpu_across_sizes() {
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    for (profile, dev) in wgpu_devices() {
        // Sizes in an order that widens families several times: equal,
        // larger, smaller, multiples of 4 and not.
        for &(m, n) in &[(8usize, 12usize), (8, 12), (9, 13), (16, 20), (3, 5), (33, 64), (1, 7), (64, 33)] {
            let a = common::rand_vec(m * n, (m * 31 + n) as u64, -2.0, 2.0);
            let b = common::rand_vec(n, n as u64, -1.0, 1.0);
            let run = |dev: &Device| -> Vec<f32> {
                let x = Tensor::from_slice(&a, [m, n], dev).unwrap();
                let bias = Tensor::from_slice(&b, [n], dev).unwrap();
                let y = ((&x * 1.5).unwrap() + bias).unwrap().tanh().unwrap();
                let s = y.softmax(-1).unwrap();
                let col = y.sum(&[0], true).unwrap();
                let mm = y.transpose(0, 1).unwrap().matmul(&s).unwrap();
                let tail = y.slice(1, (n / 3) as i64, n as i64, 1).unwrap().max(&[-1], false).unwrap();
                let parts = [s.reshape([-1]).unwrap(), col.reshape([-1]).unwrap(), mm.reshape([-1]).unwrap(), tail];
                Tensor::concat(&parts.iter().collect::<Vec<_>>(), 0).unwrap().to_vec::<f32>().unwrap()
            };
            common::assert_close(&run(&dev), &run(&cpu), 1e-4, 1e-5, &format!("[{m}, {n}], {profile}"));
        }
    }
    assert!(metrics::counter("GenericKernelWidened") > 0, "no family was widened");
}

#[test]
fn generic_sizes_can_be_turned_off() {
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let opts = lazuli::WgpuDeviceOptions { generic_sizes: Some(false), ..Default::default() };
    let dev = Device::wgpu_with(opts).unwrap();
    let (w0, r0) = (metrics::counter("GenericKernelWidened"), metrics::counter("GenericKernelReuse"));
    for n in [10usize, 11, 12, 13] {
        let x = Tensor::from_slice(&common::rand_vec(n, 1, -1.0, 1.0), [n], &dev).unwrap();
        let got = x.exp().unwrap().sum(&[0], false).unwrap().item::<f32>().unwrap();
        let want: f32 = common::rand_vec(n, 1, -1.0, 1.0).iter().map(|v| v.exp()).sum();
        assert!((got - want).abs() < 1e-4 * want.abs());
    }
    assert_eq!(metrics::counter("GenericKernelWidened") - w0, 0);
    assert_eq!(metrics::counter("GenericKernelReuse") - r0, 0);
}

#[test]
fn greedy_generation_with_a_growing_context_matches_the_fixed_window() {
    use lazuli::generate::{run, GenConfig, Window};
    let _g = common::metrics_lock();
    let cfg = GenConfig { vocab: 16, embd: 16, heads: 2, layers: 1, context: 12, prompt: 3, tokens: 14, seed: 3 };
    let cpu = run(cfg, Window::Fixed, &Device::cpu()).unwrap();
    assert_eq!(cpu.tokens.len(), 14);
    for dev in common::devices() {
        let growing = run(cfg, Window::Growing, &dev).unwrap();
        let fixed = run(cfg, Window::Fixed, &dev).unwrap();
        assert_eq!(growing.tokens, cpu.tokens, "growing context on {}", dev.name());
        assert_eq!(fixed.tokens, cpu.tokens, "fixed window on {}", dev.name());
        assert_eq!(fixed.plans, 1, "the fixed window is one graph on {}", dev.name());
        if dev.kind() == lazuli::BackendKind::Wgpu {
            // 10 lengths (3..=12), then the full window: new kernel code at
            // the first length, the first size variant and a few widenings,
            // not at every length.
            assert!(growing.plans >= 10, "{growing:?}");
            assert!(growing.plans_with_new_code <= 5, "{growing:?}");
        }
    }
}
