//! The timeline (`LAZULI_TRACE`): a run of the `lazuli` demo writes a
//! Chrome trace whose host spans cover the phases of a sync and, on a wgpu
//! adapter with timestamp queries, whose GPU track holds every launched
//! kernel, placed between its execution's submission and the wait that
//! saw it done (executions overlap while the timeline records).

use serde_json::Value;

mod common;
use common::wgpu_adapter;

/// The `ph: X` events of the trace `lazuli demo --device <device>` wrote.
fn demo_trace(device: &str) -> Vec<Value> {
    with_demo_trace(device, "events", |path| {
        let doc: Value = serde_json::from_slice(&std::fs::read(path).expect("the trace file")).unwrap();
        assert_eq!(doc["otherData"]["dropped_events"], 0);
        doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").cloned().collect()
    })
}

/// `read` of the trace file `lazuli demo --device <device>` wrote.
fn with_demo_trace<T>(device: &str, tag: &str, read: impl FnOnce(&std::path::Path) -> T) -> T {
    let dir = std::env::temp_dir().join(format!("lazuli-timeline-{}-{device}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("trace.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazuli"))
        .args(["demo", "--device", device, "--epochs", "1"])
        .env("LAZULI_TRACE", &path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let got = read(&path);
    let _ = std::fs::remove_dir_all(&dir);
    got
}

/// `lazuli trace` summarizes the demo's training loop: the repeated step
/// that covers the most wall time (the 22 steps after the first two's
/// compiles; the evaluation after them compiles again), with the GPU
/// track's kernels where the adapter has timestamps.
#[test]
fn the_trace_command_summarizes_the_demo_s_training_loop() {
    let device = if wgpu_adapter() { "wgpu" } else { "cpu" };
    let out = with_demo_trace(device, "summary", |path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lazuli")).arg("trace").arg(path).output().unwrap()
    });
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let steady: usize = text
        .strip_prefix("steady state: ")
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no steady state line:\n{text}"));
    // One epoch is 22 steps; the first two compile.
    assert!((18..=22).contains(&steady), "{steady} steady executions:\n{text}");
    for want in ["wall ", "Execute", "Record", "repetitions of a step of", "skipped: "] {
        assert!(text.contains(want), "no {want} in:\n{text}");
    }
    let timestamps =
        device == "wgpu" && lazuli_wgpu::WgpuBackend::new(Default::default()).unwrap().supports_profiling();
    assert_eq!(text.contains("kernels by total time"), timestamps, "{text}");
    // The GPU waits at least while each execution is encoded.
    assert_eq!(text.contains("longest GPU idle stretches"), timestamps, "{text}");
}

fn names<'a>(events: &'a [Value], cat: &str) -> std::collections::BTreeSet<&'a str> {
    events.iter().filter(|e| e["cat"] == cat).map(|e| e["name"].as_str().unwrap()).collect()
}

fn check_well_formed(events: &[Value]) {
    for e in events {
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(ts >= 0.0 && dur >= 0.0 && dur.is_finite(), "{e}");
    }
}

/// Each span named in `phases` lies within a `Compile` span of its
/// thread: the phases split a compile's time, they are not beside it.
fn check_within_compiles(events: &[Value], phases: &[&str]) {
    let interval = |e: &Value| {
        let ts = e["ts"].as_f64().unwrap();
        (e["tid"].as_u64().unwrap(), ts, ts + e["dur"].as_f64().unwrap())
    };
    // A size compiled ahead runs its phases inside `AheadCompile`, on a
    // thread of its own.
    let compiles: Vec<_> =
        events.iter().filter(|e| e["name"] == "Compile" || e["name"] == "AheadCompile").map(interval).collect();
    for e in events.iter().filter(|e| phases.contains(&e["name"].as_str().unwrap())) {
        let (tid, a, b) = interval(e);
        assert!(
            compiles.iter().any(|&(t, ca, cb)| t == tid && ca <= a + 1.0 && b <= cb + 1.0),
            "{e} lies outside every Compile span of its thread"
        );
    }
}

#[test]
fn the_demo_on_the_cpu_writes_host_spans() {
    let events = demo_trace("cpu");
    check_well_formed(&events);
    let host = names(&events, "host");
    for want in ["Sync", "Record", "Trace", "Lookup", "Compile", "CompileOptimize", "Submit", "BarrierWait"] {
        assert!(host.contains(want), "no {want} span in {host:?}");
    }
    check_within_compiles(&events, &["CompileOptimize"]);
    assert!(names(&events, "gpu").is_empty());
}

#[test]
fn the_demo_on_wgpu_writes_host_spans_and_gpu_kernels() {
    if !wgpu_adapter() {
        return;
    }
    let events = demo_trace("wgpu");
    check_well_formed(&events);
    let host = names(&events, "host");
    let phases = ["CompileOptimize", "CompileFusion", "CompileLower", "CompileGeneric", "CompileBuild"];
    for want in
        ["Sync", "Compile", "CompilePipeline", "Allocate", "Encode", "QueueSubmit", "Wait"].iter().chain(&phases)
    {
        assert!(host.contains(want), "no {want} span in {host:?}");
    }
    check_within_compiles(&events, &phases);
    let timestamps = lazuli_wgpu::WgpuBackend::new(Default::default()).unwrap().supports_profiling();
    let gpu: Vec<&Value> = events.iter().filter(|e| e["cat"] == "gpu").collect();
    if !timestamps {
        assert!(gpu.is_empty());
        return;
    }
    assert!(!gpu.is_empty(), "no kernel on the GPU track");
    // Each kernel ends within its execution on the host: after the
    // execution's submission began (the device may run a kernel before the
    // host starts waiting) and by the end of the wait that saw it done:
    // its own, the next execution's where executions overlap, or a
    // readback's.
    let span = |name: &str| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e["name"] == name)
            .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let submits = span("QueueSubmit");
    let waits: Vec<(f64, f64)> = span("Wait").into_iter().chain(span("Readback")).collect();
    for k in &gpu {
        let end = k["ts"].as_f64().unwrap() + k["dur"].as_f64().unwrap();
        let submitted = submits.iter().rev().find(|s| s.0 <= end + 1.0);
        let Some(&(submitted, _)) = submitted else { panic!("{k} ends before any submission") };
        assert!(
            waits.iter().any(|&(a, b)| a >= submitted - 1.0 && end <= b + 1.0),
            "{k} ends after every wait that began after its submission"
        );
    }
}
