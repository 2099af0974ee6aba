//! `lazuli bench` and the command line without timing anything large: the
//! `lazuli` binary run end to end (a bad option, `--help`, the completion
//! scripts, one small workload as JSON), the GPU-scale workloads G1–G8 run
//! at tiny sizes on the CPU device through the same code as the full-size
//! run, their row names, G8's host/device split and H1's phase rows.
//! Argument parsing, iteration defaults, the table and the ratios are the
//! unit tests of `src/commands/bench.rs` (`cargo test -p lazuli-cli --lib`).

use lazuli::DType;
use lazuli_cli::bench::{
    amp_row_name, gpu_row_name, host_split, run_amp_workload, run_gpu_workload, BenchConfig, BenchDevice, GpuSizes,
    Workload, AMP_DTYPES,
};
use std::process::{Command, Output};

mod common;

/// Runs the `lazuli` binary with `args` (the compile cache off, as under
/// cargo).
fn lazuli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lazuli"))
        .args(args)
        .env("LAZULI_CACHE_DIR", "")
        .output()
        .expect("the lazuli binary runs")
}

/// A usage error exits with clap's status 2 and names the option, the
/// value and what it takes; a failing command exits 1 with `lazuli: `.
#[test]
fn the_binary_rejects_a_bad_option_with_its_message() {
    let out = lazuli(&["bench", "--scale", "huge"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("'huge'") && stderr.contains("--scale") && stderr.contains("small, gpu"), "{stderr}");
    let out = lazuli(&["bench", "W9"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown workload \"W9\""));
    let out = lazuli(&["trace", "/nonexistent/trace.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("lazuli: /nonexistent/trace.json"));
}

/// `lazuli --help` lists every command; each command has its own help.
#[test]
fn help_lists_the_commands_and_each_command_has_its_own() {
    for top in [lazuli(&["--help"]), lazuli(&["help"])] {
        assert!(top.status.success());
        let usage = String::from_utf8_lossy(&top.stdout).into_owned();
        for command in ["info", "demo", "dump", "conformance", "bench", "generate", "trace", "completions"] {
            assert!(usage.contains(&format!("\n  {command} ")), "{command} missing from:\n{usage}");
        }
    }
    let bench = lazuli(&["bench", "--help"]);
    assert!(bench.status.success());
    let text = String::from_utf8_lossy(&bench.stdout);
    assert!(text.contains("Usage: lazuli bench") && text.contains("--scale <SCALE>"), "{text}");
    assert_eq!(String::from_utf8_lossy(&lazuli(&["help", "bench"]).stdout), text);
    // An unknown command is an error, --help or not.
    assert!(!lazuli(&["frobnicate", "--help"]).status.success());
}

/// `lazuli completions SHELL` prints a script that completes the commands.
#[test]
fn completions_print_a_script_per_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = lazuli(&["completions", shell]);
        assert!(out.status.success(), "{shell}");
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(script.contains("lazuli") && script.contains("conformance"), "{shell}:\n{script}");
    }
    assert!(!lazuli(&["completions", "cmd.exe"]).status.success());
}

/// One small workload on the CPU device through the binary: the memcpy
/// baseline row and the workload's row, as a JSON array on stdout.
#[test]
fn bench_prints_its_rows_as_json() {
    let out = lazuli(&["bench", "W5", "--device", "cpu", "--iterations", "1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let rows = rows.as_array().expect("a JSON array");
    let names: Vec<(&str, &str)> =
        rows.iter().map(|r| (r["workload"].as_str().unwrap(), r["device"].as_str().unwrap())).collect();
    assert_eq!(names, [("memcpy 64 MiB", "host"), ("W5", "cpu")]);
    assert!(rows[1]["median_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{rows:?}");
    assert!(rows[1]["note"].as_str().is_some_and(|n| n.ends_with("µs per op")), "{rows:?}");
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
fn amp_row_names_match_the_pytorch_twin_and_run_at_tiny_size() {
    let full = GpuSizes::default();
    assert_eq!(amp_row_name(Workload::G3, &full, DType::F16).unwrap(), "G3 matmul 4096^3 f16");
    assert_eq!(amp_row_name(Workload::G8, &full, DType::F16).unwrap(), "G8 GPT train step autocast f16");
    assert_eq!(amp_row_name(Workload::G1, &full, DType::F16), None);
    assert_eq!(AMP_DTYPES, &[DType::F16, DType::BF16]);
    assert_eq!(amp_row_name(Workload::G3, &full, DType::BF16).unwrap(), "G3 matmul 4096^3 bf16");
    let bd = BenchDevice::cpu();
    let cfg = BenchConfig { warmup: 1, iterations: 1 };
    let sizes = GpuSizes::tiny();
    for w in [Workload::G3, Workload::G8] {
        for &dtype in AMP_DTYPES {
            let r = run_amp_workload(w, &bd, &cfg, &sizes, dtype).expect("G3 and G8 have amp rows");
            assert_eq!(r.error, None, "{}", r.workload);
            assert_eq!(Some(r.workload.clone()), amp_row_name(w, &sizes, dtype));
            assert!(r.median_ms.is_finite(), "{r:?}");
            if w == Workload::G3 {
                assert!(r.gflops.is_some_and(f64::is_finite), "{r:?}");
            } else {
                assert!(r.host_ms.is_some() && r.device_ms.is_some(), "{r:?}");
            }
        }
    }
    assert!(run_amp_workload(Workload::G5, &bd, &cfg, &sizes, DType::F16).is_none());
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

/// `--profile --json` on wgpu: the workload's first row carries its
/// roofline, each kernel with its workgroups, FLOPs and bytes, and where
/// the adapter times kernels, GB/s and TFLOP/s that are its bytes and
/// FLOPs over its time. W5 is 100 multiply-adds by lifted scalars of a
/// 1024-element vector: 200 FLOPs an element in all, whatever the fusion.
#[test]
fn bench_profile_json_carries_each_kernels_roofline() {
    if !common::wgpu_adapter() {
        return;
    }
    let out = lazuli(&["bench", "W5", "--device", "wgpu", "--profile", "--iterations", "1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let w5 = rows.as_array().unwrap().iter().find(|r| r["workload"] == "W5").expect("a W5 row");
    let profile = &w5["profile"];
    assert_eq!(profile["iterations"], 1, "{profile}");
    let timed = profile["timed"].as_bool().expect("timed is a bool");
    let kernels = profile["kernels"].as_array().expect("a kernel list");
    assert!(!kernels.is_empty(), "{profile}");
    let (mut flops, mut share) = (0, 0.0);
    for k in kernels {
        let int = |f: &str| k[f].as_u64().unwrap_or_else(|| panic!("{f} in {k}"));
        assert!(k["kernel"].as_str().is_some_and(|n| n.starts_with('k')), "{k}");
        let (launches, bytes) = (int("launches"), int("bytes"));
        assert!(launches >= 1 && int("workgroups") > 0 && bytes > 0, "{k}");
        flops += int("flops") * launches;
        if timed {
            let ms = k["ms"].as_f64().expect("a timed kernel has ms");
            share += k["share"].as_f64().expect("and a share");
            if ms > 0.0 {
                let gbps = k["gbps"].as_f64().expect("and GB/s");
                let expected = (bytes * launches) as f64 / (ms * 1e6);
                assert!((gbps - expected).abs() <= 1e-9 * expected, "{k}");
                let tflops = k["tflops"].as_f64().expect("and TFLOP/s");
                let expected = (int("flops") * launches) as f64 / (ms * 1e9);
                assert!((tflops - expected).abs() <= 1e-9 * expected, "{k}");
            }
        } else {
            assert!(k["ms"].is_null() && k["gbps"].is_null() && k["tflops"].is_null(), "{k}");
        }
    }
    assert_eq!(flops, 200 * 1024, "{profile}");
    if timed {
        assert!((share - 1.0).abs() < 1e-9, "{profile}");
    }
}
