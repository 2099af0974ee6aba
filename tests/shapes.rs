//! Sizes as runtime data: graphs that differ only in sizes share generic
//! pipelines on wgpu (see `lazuli_wgpu::generic`), and every size still
//! matches the CPU reference, in both kernel-form profiles.

mod common;
use lazuli::metrics;
use lazuli::nn;
use lazuli::optim::Optimizer;
use lazuli::prelude::*;

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
    for (profile, dev) in common::wgpu_profiles() {
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
    for (profile, dev) in common::wgpu_profiles() {
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

/// A size that recurs gets static kernels: after `specialize_after`
/// executions of a plan with generic kernels, static ones compile in the
/// background and are swapped in at a later execution (see
/// `lazuli_wgpu::tier`); every execution before, during and after
/// matches the CPU, and so does the next size variant, which compiles
/// against the specialized plan. With the tuner on (GPU forms), the static
/// products are then tuned at the boundaries after the swap (their
/// candidates compiled in the background meanwhile).
#[test]
fn a_recurring_size_gets_static_kernels_in_the_background() {
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let cpu = Device::cpu();
    let d = 16;
    let wdata = common::rand_vec(d * d, 11, -0.5, 0.5);
    for forms in [lazuli::wgpu::forms::KernelForms::software(), lazuli::wgpu::forms::KernelForms::gpu()] {
        let tune = forms == lazuli::wgpu::forms::KernelForms::gpu();
        let opts = lazuli::WgpuDeviceOptions {
            kernel_forms: Some(forms),
            specialize_after: Some(3),
            autotune: Some(tune),
            autotune_min_flops: Some(1),
            cache_dir: Some(None),
            ..Default::default()
        };
        let dev = Device::wgpu_with(opts).unwrap();
        let w_gpu = Tensor::from_slice(&wdata, [d, d], &dev).unwrap();
        let w_cpu = Tensor::from_slice(&wdata, [d, d], &cpu).unwrap();
        let check = |t: usize, what: &str| {
            let xdata = common::rand_vec(t * d, t as u64, -1.0, 1.0);
            let got = attention_step(&Tensor::from_slice(&xdata, [t, d], &dev).unwrap(), &w_gpu, t).unwrap();
            let want = attention_step(&Tensor::from_slice(&xdata, [t, d], &cpu).unwrap(), &w_cpu, t).unwrap();
            let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
            common::assert_close(&got, &want, 1e-4, 1e-4, &format!("context {t}, {forms:?}, {what}"));
        };
        // A first size (static kernels), then a size variant: generic.
        check(8, "first size");
        let (plans0, kernels0) = (metrics::counter("SpecializedPlans"), metrics::counter("SpecializedKernels"));
        let tuned0 = metrics::counter("AutotuneRuns");
        let mut runs = 0;
        while metrics::counter("SpecializedPlans") == plans0 {
            assert!(runs < 2000, "no static kernels after {runs} executions of a recurring size");
            check(9, "recurring size");
            if metrics::counter("SpecializedPlans") == plans0 {
                assert_eq!(metrics::counter("AutotuneRuns"), tuned0, "a generic kernel was tuned");
            }
            runs += 1;
            if runs > 3 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        assert!(runs > 3, "specialized after {runs} executions, before the 3 asked for");
        assert!(metrics::counter("SpecializedKernels") > kernels0);
        check(9, "static kernels");
        check(9, "static kernels again");
        // The tuner compiles their candidates off the steps' path, then
        // times them at a boundary after that compile finished.
        let mut more = 0;
        while tune && metrics::counter("AutotuneRuns") == tuned0 {
            assert!(more < 2000, "the static products were not tuned after {more} more executions");
            check(9, "static kernels, tuning");
            more += 1;
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The next size compiles against the specialized plan.
        check(10, "the next size variant");
        check(10, "the next size variant again");
    }
}

/// A device dropped while its static kernels compile in the background
/// cancels and joins that compile: the drop returns, nothing outlives it.
#[test]
fn dropping_a_device_stops_its_background_compiles() {
    // It compiles size variants: the counters other tests read must not
    // see them.
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let d = 16;
    let wdata = common::rand_vec(d * d, 5, -0.5, 0.5);
    for _ in 0..3 {
        let opts = lazuli::WgpuDeviceOptions { specialize_after: Some(1), ..Default::default() };
        let dev = Device::wgpu_with(opts).unwrap();
        let w = Tensor::from_slice(&wdata, [d, d], &dev).unwrap();
        for t in [8usize, 9, 9] {
            let x = Tensor::from_slice(&common::rand_vec(t * d, t as u64, -1.0, 1.0), [t, d], &dev).unwrap();
            attention_step(&x, &w, t).unwrap().to_vec::<f32>().unwrap();
        }
        // The second run of size 9 started the compile; the drop stops it.
        drop((w, dev));
    }
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
    use lazuli_models::generate::{run, GenConfig, Window};
    let _g = common::metrics_lock();
    let cfg = GenConfig { vocab: 16, embd: 16, heads: 2, layers: 1, context: 12, prompt: 3, tokens: 14, seed: 3 };
    let cpu = run(cfg, Window::Fixed, &Device::cpu()).unwrap();
    assert_eq!(cpu.tokens.len(), 14);
    for dev in common::devices() {
        let skipped = metrics::counter("GenericKernelScanSkipped");
        let growing = run(cfg, Window::Growing, &dev).unwrap();
        let skipped = metrics::counter("GenericKernelScanSkipped") - skipped;
        let fixed = run(cfg, Window::Fixed, &dev).unwrap();
        assert_eq!(growing.tokens, cpu.tokens, "growing context on {}", dev.name());
        assert_eq!(fixed.tokens, cpu.tokens, "fixed window on {}", dev.name());
        assert_eq!(fixed.plans, 1, "the fixed window is one graph on {}", dev.name());
        // One structure: every later length is a size variant of the first.
        assert_eq!(growing.structures, 1, "{growing:?}");
        if dev.kind() == lazuli::BackendKind::Wgpu {
            // 10 lengths (3..=12), then the full window: new kernel code at
            // the first length (static) and the first size variant (generic
            // over every literal that differs from the first length), not
            // at every length, and not at the full window either, though
            // things are equal only there: the position slice that covers
            // its whole table (`PassOptions::sizes_vary`), two index ramps
            // (CSE with the classes of the length before,
            // `passes::optimize_traced`), sibling kernels and multi-tensor
            // segments of one shape (`fusion::plan_sized_like`) all keep
            // the structure of the other lengths.
            // (Compiled on the steps' path or, where sizes are compiled
            // ahead, on a thread of its own.)
            assert!(growing.plans + growing.compiled_ahead >= 10, "{growing:?}");
            assert!(growing.plans_with_new_code <= 2, "{growing:?}");
            // At most two sets of kernels: the first length's static ones
            // and one generic set (some kernels keep their sizes and stay
            // static).
            // (The fixed window after the growing context on one device
            // makes fewer: kernels whose sources match the growing run's
            // use their pipelines. So its full set is counted on a device
            // of its own.)
            let own = Device::wgpu_with(lazuli::WgpuDeviceOptions::default()).expect("a wgpu device");
            let fixed_alone = run(cfg, Window::Fixed, &own).unwrap();
            assert!(fixed.pipelines <= fixed_alone.pipelines, "{fixed:?} against {fixed_alone:?}");
            assert!(growing.pipelines <= 2 * fixed_alone.pipelines, "{growing:?} against {fixed_alone:?}");
            // From the third length on, a kernel of the generic set reads
            // its sizes against its own source at the length before
            // (`Families::specialize`), without scanning its source; debug
            // builds check each such read against a scan.
            assert!(2 * skipped >= growing.generic_reuse, "{skipped} of {growing:?} read without a scan");
        }
    }
}

/// A two-layer MLP on `x` with the parameters `p` (w1, b1, w2, b2).
fn mlp(p: &[Tensor], x: &Tensor) -> lazuli::Result<Tensor> {
    let h = x.matmul(&p[0])?.add(&p[1])?.relu()?;
    h.matmul(&p[2])?.add(&p[3])
}

/// Parameters of [`mlp`] on `dev`, the same values on every device.
fn mlp_params(dev: &Device) -> Vec<Tensor> {
    let dims = [[8usize, 32], [1, 32], [32, 4], [1, 4]];
    dims.iter()
        .enumerate()
        .map(|(i, &[r, c])| {
            let data = common::rand_vec(r * c, 100 + i as u64, -0.3, 0.3);
            Tensor::from_slice(&data, [r, c], dev).unwrap().requires_grad_(true).unwrap()
        })
        .collect()
}

/// Issue 13's batch targets. A training loop over 150 rows in batches of
/// 64 ends every epoch with a partial batch of 22: that batch costs one
/// extra plan and nothing more (later epochs compile nothing). Evaluating
/// with batch sizes that keep changing creates no pipelines once the
/// evaluation graph's family has seen three sizes (its first size,
/// the first size variant in size-independent forms, and the widening
/// that turns the batch-dependent literals into runtime values). Every
/// loss and every evaluation matches the CPU.
#[test]
fn a_partial_last_batch_costs_one_plan_and_new_eval_batch_sizes_compile_nothing() {
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let rows = 150;
    let xdata = common::rand_vec(rows * 8, 41, -1.0, 1.0);
    let labels: Vec<i32> = (0..rows as i32).map(|i| (i * 7 + 3) % 4).collect();
    let batches: Vec<(usize, usize)> = (0..rows).step_by(64).map(|s| (s, 64.min(rows - s))).collect();
    assert_eq!(batches.last().unwrap().1, 22);
    for (profile, dev) in common::wgpu_profiles() {
        let run = |d: &Device| {
            let p = mlp_params(d);
            let mut opt = lazuli::optim::Sgd::new(p.clone(), 0.1).momentum(0.9);
            let mut losses = Vec::new();
            // Plans compiled by each step, per epoch.
            let mut plans = Vec::new();
            // Of those, size variants of a structure compiled before.
            let mut variants = 0;
            for _epoch in 0..3 {
                let mut epoch = Vec::new();
                for &(start, len) in &batches {
                    let before = common::plans_compiled();
                    let variants_before = metrics::counter("SizeVariantCompile");
                    // Each batch is uploaded from the host, as a data loader does.
                    let xb = Tensor::from_slice(&xdata[start * 8..(start + len) * 8], [len, 8], d).unwrap();
                    let yb = Tensor::from_slice(&labels[start..start + len], [len], d).unwrap();
                    let loss = nn::cross_entropy(&mlp(&p, &xb).unwrap(), &yb).unwrap();
                    loss.backward().unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                    // One sync per step: the loss is computed with the update.
                    d.mark_step().unwrap();
                    losses.push(loss.to_vec::<f32>().unwrap()[0]);
                    epoch.push(common::plans_compiled() - before);
                    variants += metrics::counter("SizeVariantCompile") - variants_before;
                }
                plans.push(epoch);
            }
            // Evaluation with batch sizes that keep changing.
            let mut evals = Vec::new();
            let mut pipelines = Vec::new();
            for n in [100usize, 37, 64, 13, 150, 90, 21] {
                let before = metrics::counter("PipelinesCreated");
                let xb = Tensor::from_slice(&xdata[..n * 8], [n, 8], d).unwrap();
                evals.push(mlp(&p, &xb).unwrap().softmax(-1).unwrap().to_vec::<f32>().unwrap());
                pipelines.push(metrics::counter("PipelinesCreated") - before);
            }
            (losses, plans, variants, evals, pipelines)
        };
        let (want_losses, _, _, want_evals, _) = run(&cpu);
        let (losses, plans, variants, evals, pipelines) = run(&dev);
        common::assert_close(&losses, &want_losses, 1e-4, 1e-4, &format!("losses, {profile}"));
        for (got, want) in evals.iter().zip(&want_evals) {
            common::assert_close(got, want, 1e-4, 1e-4, &format!("evaluation, {profile}"));
        }
        // The first epoch compiles the full batch (twice: on the second
        // step the parameters and momenta are device data), then the
        // partial batch once; later epochs compile nothing.
        assert_eq!(plans[0].iter().sum::<u64>(), 3, "{profile}: plans per step {plans:?}");
        assert_eq!(plans[0][2], 1, "{profile}: the partial batch is one extra plan: {plans:?}");
        // ... a size variant of the full batch's structure, not a new one.
        assert_eq!(variants, 1, "{profile}: size variants compiled");
        assert!(plans[1..].iter().flatten().all(|&n| n == 0), "{profile}: plans per step {plans:?}");
        // Measured on lavapipe, both profiles: 3, 3, then 0 pipelines: the
        // first size compiles static kernels, the second generic ones, and
        // no later size compiles.
        assert!(pipelines[2..].iter().all(|&n| n == 0), "{profile}: pipelines per evaluation size {pipelines:?}");
    }
}

/// A size variant keeps, as compiled, each kernel whose nodes are exactly
/// those of the plan before it (`KernelsKept`), and lowers every kernel
/// that differs in anything: a kernel whose shapes all stay but whose
/// slice starts elsewhere is lowered again, and every result matches the
/// CPU.
#[test]
fn a_size_variant_keeps_only_the_kernels_it_does_not_change() {
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let wdata = common::rand_vec(64, 3, -1.0, 1.0);
    let step = |x: &[f32], start: usize, d: &Device| {
        let w = Tensor::from_slice(&wdata, [8usize, 8], d).unwrap();
        let x = Tensor::from_slice(x, [x.len() / 8, 8], d).unwrap();
        // Rows vary with the batch; the window's start moves (its shape
        // stays); the parameter's column sums change nothing.
        let outs = [x.sum(&[-1], false), w.narrow(0, start, 4).and_then(|v| v.exp()), w.sum(&[0], false)];
        let outs: Vec<Tensor> = outs.into_iter().collect::<lazuli::Result<_>>().unwrap();
        // One graph: the three outputs in one sync.
        lazuli::sync(&outs.iter().collect::<Vec<_>>()).unwrap();
        outs.iter().map(|t| t.to_vec::<f32>().unwrap()).collect::<Vec<_>>()
    };
    for (profile, dev) in common::wgpu_profiles() {
        let (mut variants, mut kept) = (0, 0);
        for (rows, start) in [(5usize, 1usize), (9, 3), (6, 2)] {
            let x = common::rand_vec(rows * 8, rows as u64, -1.0, 1.0);
            let counts = || (metrics::counter("SizeVariantCompile"), metrics::counter("KernelsKept"));
            let before = counts();
            let got = step(&x, start, &dev);
            variants += counts().0 - before.0;
            kept += counts().1 - before.1;
            for (i, (got, want)) in got.iter().zip(&step(&x, start, &cpu)).enumerate() {
                common::assert_close(got, want, 1e-5, 1e-5, &format!("output {i}, rows {rows}, {profile}"));
            }
        }
        assert_eq!(variants, 2, "{profile}: size variants");
        // Only the column sums of the parameter, in each of the two variants.
        assert_eq!(kept, 2, "{profile}: kernels kept");
    }
}

/// `narrow_at` takes its start as run-time data: a window moving over a
/// fixed buffer records one graph for every start (nothing compiles after
/// the first), reads the rows `narrow` would, on every device and in both
/// wgpu kernel profiles, and its gradient lands on those rows; a range
/// outside the axis is an error when recorded.
#[test]
fn narrow_at_moves_its_start_without_recompiling() {
    let _g = common::metrics_lock();
    let (rows, cols, len) = (8usize, 6usize, 2usize);
    let data: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut devices = vec![Device::cpu()];
    devices.extend(common::wgpu_profiles().into_iter().map(|(_, d)| d));
    for dev in devices {
        let x = Tensor::from_slice(&data, [rows, cols], &dev).unwrap();
        let mut compiled_after_first = None;
        for start in [0i64, 3, 6, 1, -2, 5] {
            let first = if start < 0 { (start + rows as i64) as usize } else { start as usize };
            let got = x.narrow_at(0, start, len).unwrap().mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap();
            let want: Vec<f32> = data[first * cols..(first + len) * cols].iter().map(|v| v * 2.0).collect();
            assert_eq!(got, want, "start {start} on {}", dev.name());
            let compiled = common::plans_compiled();
            assert_eq!(
                *compiled_after_first.get_or_insert(compiled),
                compiled,
                "start {start} compiled on {}",
                dev.name()
            );
        }
        // The gradient: ones on the picked rows, zeros elsewhere.
        let xg = Tensor::from_slice(&data, [rows, cols], &dev).unwrap().requires_grad_(true).unwrap();
        xg.narrow_at(0, 4, len).unwrap().sum(&[], false).unwrap().backward().unwrap();
        let grad = xg.grad().unwrap().to_vec::<f32>().unwrap();
        let want: Vec<f32> =
            (0..rows * cols).map(|i| if (4..4 + len).contains(&(i / cols)) { 1.0 } else { 0.0 }).collect();
        assert_eq!(grad, want, "gradient on {}", dev.name());
        for (start, l) in [(7i64, 2usize), (-9, 1), (0, 9)] {
            assert!(x.narrow_at(0, start, l).is_err(), "start {start} len {l} on {}", dev.name());
        }
    }
}
