//! The `lazuli bench` harness without timing anything large: argument
//! parsing (`--scale`, `--size`, workload names, iteration defaults), the
//! GPU-scale workloads G1–G8 run at tiny sizes on the CPU device through the
//! same code as the full-size run, G8's host/device split, H1's phase rows,
//! a workload that fails becoming an error row instead of ending the run,
//! and the C1 and A1 workloads beside their baselines.

use lazuli::bench::{
    conv_gemm_baseline, gpu_row_name, host_split, ratios, run_gpu_workload, run_workload, BenchArgs, BenchConfig,
    BenchDevice, ConvSizes, ConvStep, GptSizes, GpuSizes, Workload, GPU_SCALE_CPU_ITERATIONS,
    GPU_SCALE_SOFTWARE_ITERATIONS,
};

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn parse(s: &str) -> Result<BenchArgs, String> {
    BenchArgs::parse(&args(s))
}

#[test]
fn scale_selects_the_workload_set() {
    assert_eq!(parse("").unwrap().workloads, Workload::SMALL.to_vec());
    assert_eq!(parse("--scale small").unwrap().workloads, Workload::SMALL.to_vec());
    let gpu = parse("--scale gpu --device cpu --json --profile --iterations 2").unwrap();
    assert_eq!(gpu.workloads, Workload::GPU.to_vec());
    assert!(gpu.cpu && !gpu.wgpu && gpu.json && gpu.profile);
    assert_eq!(gpu.iterations, Some(2));
    // Named workloads win over the set.
    assert_eq!(parse("--scale gpu W3").unwrap().workloads, vec![Workload::W3]);
}

#[test]
fn g_workloads_parse_by_name() {
    let all = parse("G1 g2 G3 G4 G5 G6 G7 G8").unwrap();
    assert_eq!(all.workloads, Workload::GPU.to_vec());
    assert!(Workload::GPU.iter().all(|w| w.is_gpu_scale()));
    assert!(Workload::SMALL.iter().all(|w| !w.is_gpu_scale()));
    assert_eq!(parse("h1").unwrap().workloads, vec![Workload::H1]);
    assert!(parse("G9").unwrap_err().contains("unknown workload"));
}

#[test]
fn size_selects_the_g_workload_sizes() {
    assert_eq!(parse("G8").unwrap().sizes, GpuSizes::default());
    assert_eq!(parse("G8 --size small").unwrap().sizes, GpuSizes::small());
    assert_eq!(parse("G8 --size small --size full").unwrap().sizes, GpuSizes::default());
    assert!(parse("--size huge").unwrap_err().contains("--size takes full or small"));
    // Small sizes take the ordinary iteration count everywhere.
    let small = parse("G8 --size small").unwrap();
    assert_eq!(small.config(Workload::G8, "wgpu (software)").iterations, 10);
    assert_eq!(small.config(Workload::G8, "cpu").iterations, 10);
    assert_eq!(GpuSizes::small().gpt.parameter_tensors(), 28);
    assert_eq!(GptSizes::G8.parameter_tensors(), 52);
}

#[test]
fn bad_scale_is_rejected() {
    assert!(parse("--scale huge").unwrap_err().contains("--scale takes small or gpu"));
    assert!(parse("--scale").is_err());
    assert!(parse("--iterations 0").is_err());
}

#[test]
fn iteration_defaults_are_small_for_g_on_cpu() {
    let a = parse("--scale gpu").unwrap();
    assert_eq!(a.config(Workload::G3, "cpu").iterations, GPU_SCALE_CPU_ITERATIONS);
    assert_eq!(a.config(Workload::G3, "wgpu").iterations, 10);
    assert_eq!(a.config(Workload::G3, "wgpu (software)").iterations, GPU_SCALE_SOFTWARE_ITERATIONS);
    assert_eq!(a.config(Workload::W1, "wgpu (software)").iterations, 10);
    assert_eq!(a.config(Workload::W2, "cpu").iterations, 10);
    assert_eq!(a.config(Workload::G3, "cpu").warmup, 3);
    let n = parse("--scale gpu --iterations 1").unwrap();
    assert_eq!(n.config(Workload::G3, "cpu").iterations, 1);
    assert_eq!(n.config(Workload::G3, "wgpu").iterations, 1);
}

#[test]
fn row_names_match_the_pytorch_twin() {
    let names: Vec<String> = Workload::GPU.iter().map(|&w| gpu_row_name(w, &GpuSizes::default())).collect();
    assert_eq!(
        names,
        [
            "G1 elementwise [16384,4096]",
            "G2 matmul 2048^3",
            "G3 matmul 4096^3",
            "G4 softmax [16384,4096]",
            "G5 row sum [16384,4096]",
            "G6 layer norm [16384,1024]",
            "G7 MLP train step",
            "G8 GPT train step",
        ]
    );
    assert_eq!(gpu_row_name(Workload::G8, &GpuSizes::small()), "G8 GPT train step [L2 C64 T64 B16]");
}

#[test]
fn every_g_workload_runs_at_tiny_size_on_cpu() {
    let bd = BenchDevice::cpu();
    let cfg = BenchConfig { warmup: 1, iterations: 1 };
    let sizes = GpuSizes::tiny();
    for w in Workload::GPU {
        let r = run_gpu_workload(w, &bd, &cfg, &sizes);
        assert_eq!(r.error, None, "{}", w.name());
        assert_eq!(r.workload, gpu_row_name(w, &sizes));
        assert_eq!(r.device, "cpu");
        assert!(r.median_ms.is_finite(), "{}: {r:?}", w.name());
        if w == Workload::G8 {
            // The GPT step has no throughput; it splits host and device time.
            let (host, device) = (r.host_ms.unwrap(), r.device_ms.unwrap());
            assert!(host > 0.0 && device > 0.0 && host < r.median_ms * 1.5, "{r:?}");
            assert!(r.kernels.is_some());
            let json = r.to_json();
            assert!(json["host_ms"].is_f64() && json["device_ms"].is_f64(), "{json}");
        } else {
            let throughput = r.gbps.or(r.gflops);
            assert!(throughput.is_some_and(f64::is_finite), "{}: {r:?}", w.name());
            assert_eq!((r.host_ms, r.device_ms), (None, None));
        }
    }
}

#[test]
fn h1_splits_the_host_cost_by_phase() {
    let bd = BenchDevice::cpu();
    let rows = host_split(&bd, &BenchConfig { warmup: 1, iterations: 2 }).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.workload.as_str()).collect();
    assert_eq!(names, ["H1 record", "H1 trace", "H1 hash + cache hit", "H1 submit", "H1 host total", "H1 device wait"]);
    for r in &rows {
        assert!(r.median_ms.is_finite() && r.median_ms >= 0.0, "{r:?}");
        assert!(r.note.as_deref().is_some_and(|n| n.ends_with("µs per op")), "{r:?}");
    }
    // The host total covers recording and every phase of the sync.
    let median = |i: usize| rows[i].median_ms;
    assert!(median(4) >= median(0), "{rows:?}");
    assert!(median(1) > 0.0 && median(2) > 0.0 && median(3) > 0.0, "{rows:?}");
}

#[test]
fn a_failing_workload_is_an_error_row_and_the_run_goes_on() {
    let bd = BenchDevice::cpu();
    let cfg = BenchConfig { warmup: 1, iterations: 1 };
    let sizes = GpuSizes::tiny();
    bd.device.fail_next_executions(1);
    let failed = run_gpu_workload(Workload::G5, &bd, &cfg, &sizes);
    assert!(failed.median_ms.is_nan() && failed.gbps.is_none());
    assert!(failed.error.as_deref().is_some_and(|e| e.contains("injected")), "{failed:?}");
    let json = failed.to_json();
    assert!(json["error"].as_str().is_some_and(|e| e.contains("injected")));
    assert!(json["median_ms"].is_null());
    assert!(lazuli::bench::table(std::slice::from_ref(&failed)).contains("error: "));
    // The same device runs the next workload.
    let next = run_gpu_workload(Workload::G1, &bd, &cfg, &sizes);
    assert_eq!(next.error, None);
    assert!(next.median_ms.is_finite());
}

/// C1 parses by name (outside both sets), runs at a tiny size through the
/// same step, and its ratio to the gemm baseline is printed.
#[test]
fn c1_conv_workload_and_its_gemm_baseline() {
    assert_eq!(parse("c1").unwrap().workloads, vec![Workload::C1]);
    assert!(!Workload::SMALL.contains(&Workload::C1) && !Workload::GPU.contains(&Workload::C1));
    let tiny = ConvSizes { batch: 2, channels: 3, size: 6, out_channels: 4, kernel: 3 };
    assert_eq!(tiny.gemm_dims(), (4, 27, 72));
    assert_eq!(tiny.flops(), 6.0 * 4.0 * 27.0 * 72.0);
    let dev = BenchDevice::cpu().device;
    let mut step = ConvStep::new(&dev, tiny).unwrap();
    step.step().unwrap();
    step.step().unwrap();
    let cfg = BenchConfig { warmup: 1, iterations: 2 };
    let base = conv_gemm_baseline(&cfg, tiny);
    assert_eq!((base.workload.as_str(), base.device.as_str()), ("C1 gemm baseline", "host"));
    assert!(base.gflops.is_some_and(|g| g > 0.0), "{base:?}");
    let mut c1 = base.clone();
    (c1.workload, c1.device, c1.gflops) = ("C1".into(), "cpu".into(), base.gflops.map(|g| g / 2.0));
    assert!(ratios(&[base, c1]).contains("C1 cpu / gemm baseline           0.50x"));
}

/// A1 parses by name (outside both sets), runs at the tiny size on the
/// CPU (the fused op and the composition, forward and forward +
/// backward), and prints the unfused / fused ratios.
#[test]
fn a1_attention_workload_fused_beside_unfused() {
    assert_eq!(parse("a1").unwrap().workloads, vec![Workload::A1]);
    assert!(!Workload::SMALL.contains(&Workload::A1) && !Workload::GPU.contains(&Workload::A1));
    let sizes = GpuSizes::tiny();
    let bd = BenchDevice::cpu();
    let cfg = BenchConfig { warmup: 1, iterations: 2 };
    let rows = run_workload(Workload::A1, &bd, &cfg, &sizes).unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r.workload.as_str()).collect();
    assert_eq!(
        names,
        [
            "A1 attention forward fused",
            "A1 attention forward unfused",
            "A1 attention forward+backward fused",
            "A1 attention forward+backward unfused"
        ]
    );
    assert!(rows.iter().all(|r| r.median_ms.is_finite() && r.gflops.is_some_and(|g| g > 0.0)), "{rows:?}");
    assert!(rows[0].note.as_deref() == Some("[B1 H2 T24 D8] causal"), "{rows:?}");
    let mut fused = rows[0].clone();
    let mut unfused = rows[1].clone();
    (fused.median_ms, unfused.median_ms) = (1.0, 2.5);
    fused.device = "wgpu".into();
    unfused.device = "wgpu".into();
    assert!(ratios(&[fused, unfused]).contains("A1 wgpu forward: unfused / fused 2.50x"), "{}", ratios(&rows));
}
