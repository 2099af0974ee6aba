//! The `lazuli bench` harness without timing anything large: argument
//! parsing (`--scale`, workload names, iteration defaults), the GPU-scale
//! workloads G1–G7 run at tiny sizes on the CPU device through the same code
//! as the full-size run, and a workload that fails becoming an error row
//! instead of ending the run.

use lazuli::bench::{
    gpu_row_name, run_gpu_workload, BenchArgs, BenchConfig, BenchDevice, GpuSizes, Workload, GPU_SCALE_CPU_ITERATIONS,
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
    let all = parse("G1 g2 G3 G4 G5 G6 G7").unwrap();
    assert_eq!(all.workloads, Workload::GPU.to_vec());
    assert!(Workload::GPU.iter().all(|w| w.is_gpu_scale()));
    assert!(Workload::SMALL.iter().all(|w| !w.is_gpu_scale()));
    assert!(parse("G8").unwrap_err().contains("unknown workload"));
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
        ]
    );
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
        let throughput = r.gbps.or(r.gflops);
        assert!(throughput.is_some_and(f64::is_finite), "{}: {r:?}", w.name());
    }
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
