//! Autotuning of matmul forms, forced on whatever adapter is present
//! (lavapipe in CI): a plan's first execution runs the rule's form and
//! times nothing; its second one starts compiling the candidate forms
//! off the step's path and times nothing either; the first execution
//! after that compile finished times them and records the winner on
//! disk; a later compile, or a second backend with the same cache
//! directory, reuses it without timing anything; kernels of one plan
//! with the same source are timed once; products below the tuner's
//! minimum are never timed; every chosen form computes the right
//! product; corrupt cache entries are ignored.

use lazuli_executor::{metrics, Backend};
use lazuli_ir::{DType, Graph, Op, ValueType};
use lazuli_wgpu::codegen::KernelForms;
use lazuli_wgpu::{WgpuBackend, WgpuOptions};
use std::path::Path;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn backend(dir: &Path) -> Option<WgpuBackend> {
    backend_with(dir, Some(0))
}

/// A backend tuning products of at least `min_flops` (`None`: the
/// default minimum).
fn backend_with(dir: &Path, min_flops: Option<u64>) -> Option<WgpuBackend> {
    let opts = WgpuOptions {
        kernel_forms: Some(KernelForms::gpu()),
        autotune: Some(true),
        autotune_min_flops: min_flops,
        cache_dir: Some(Some(dir.to_path_buf())),
        ..Default::default()
    };
    match WgpuBackend::new(opts) {
        Ok(b) => Some(b),
        Err(e) if std::env::var("LAZULI_REQUIRE_ADAPTER").as_deref() == Ok("1") => {
            panic!("no wgpu adapter but LAZULI_REQUIRE_ADAPTER=1: {e}")
        }
        Err(e) => {
            eprintln!("skipping: no wgpu adapter ({e})");
            None
        }
    }
}

/// Compiles `a [m, k] @ b [k, n]`, runs it `runs` times and checks each
/// result against a host product. After each execution the background
/// compiles are awaited, so the tuner's candidates are compiled by the
/// execution after the one that started them.
fn check_matmul(b: &WgpuBackend, m: usize, k: usize, n: usize, runs: usize) {
    let mut g = Graph::new();
    let x = g.param(ValueType::new([m, k], DType::F32));
    let w = g.param(ValueType::new([k, n], DType::F32));
    let y = g.push(Op::MatMul, &[x, w]).unwrap();
    g.outputs.push(y);
    let v = g.verify().unwrap();
    let exe = b.compile(&v).unwrap();
    let xs: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
    let ws: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 11) as f32 * 0.5 - 2.5).collect();
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let bx = b.upload(&bytes(&xs), &ValueType::new([m, k], DType::F32)).unwrap();
    let bw = b.upload(&bytes(&ws), &ValueType::new([k, n], DType::F32)).unwrap();
    for run in 0..runs {
        let out = b.execute(exe.as_ref(), vec![bx.clone(), bw.clone()], &[]).unwrap();
        let got: Vec<f32> =
            b.download(&out[0]).unwrap().chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|q| xs[i * k + q] * ws[q * n + j]).sum();
                assert_eq!(got[i * n + j], want, "({i}, {j}) of {m}x{k}x{n}, run {run}");
            }
        }
        b.await_background();
    }
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lazuli-autotune-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn tunes_once_then_reuses_the_disk_cache() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("reuse");
    let Some(b) = backend(&dir) else { return };
    let (runs, keys, hits) =
        (metrics::counter("AutotuneRuns"), metrics::counter("AutotuneKeys"), metrics::counter("AutotuneHits"));
    check_matmul(&b, 96, 64, 80, 1);
    assert_eq!(metrics::counter("AutotuneRuns"), runs, "a first execution times nothing");
    check_matmul(&b, 96, 64, 80, 3);
    assert!(metrics::counter("AutotuneRuns") > runs, "the second execution of a plan times candidates");
    assert_eq!(metrics::counter("AutotuneKeys"), keys + 1);
    assert_eq!(autotune_entries(&dir).len(), 1, "one winner in the compile cache");
    // Same process, same backend: the in-memory winner.
    let runs = metrics::counter("AutotuneRuns");
    check_matmul(&b, 96, 64, 80, 3);
    assert_eq!(metrics::counter("AutotuneRuns"), runs);
    // A new backend (as a new process would) reads the winner from disk.
    drop(b);
    let b2 = backend(&dir).unwrap();
    check_matmul(&b2, 96, 64, 80, 3);
    assert_eq!(metrics::counter("AutotuneRuns"), runs, "no timing with a warm disk cache");
    assert!(metrics::counter("AutotuneHits") >= hits + 2);
    // A different shape is a different key.
    check_matmul(&b2, 40, 24, 72, 3);
    assert!(metrics::counter("AutotuneRuns") > runs);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The autotuning entries of the compile cache in `dir`.
fn autotune_entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("autotune-"))
        .collect();
    v.sort();
    v
}

#[test]
fn corrupt_cache_entries_are_ignored() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("corrupt");
    let Some(b) = backend(&dir) else { return };
    check_matmul(&b, 64, 32, 64, 3);
    drop(b);
    let entries = autotune_entries(&dir);
    assert_eq!(entries.len(), 1);
    // Truncated and garbled: the next backend ignores it, tunes again and
    // still computes the right product.
    let mut bytes = std::fs::read(&entries[0]).unwrap();
    bytes.truncate(bytes.len() / 2);
    bytes.extend_from_slice(b"\x00\xffgarbage");
    std::fs::write(&entries[0], bytes).unwrap();
    let (bad, runs) = (metrics::counter("DiskCacheBad"), metrics::counter("AutotuneRuns"));
    let b2 = backend(&dir).unwrap();
    check_matmul(&b2, 64, 32, 64, 3);
    assert!(metrics::counter("DiskCacheBad") > bad, "the corrupt entry is counted");
    assert!(metrics::counter("AutotuneRuns") > runs, "tuned again");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn small_products_are_never_tuned() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("small");
    // The default minimum: a 96x64x80 product (about 1 MFLOP) is far below.
    let Some(b) = backend_with(&dir, None) else { return };
    let runs = metrics::counter("AutotuneRuns");
    check_matmul(&b, 96, 64, 80, 4);
    assert_eq!(metrics::counter("AutotuneRuns"), runs);
    assert!(autotune_entries(&dir).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn candidates_compile_off_the_steps_path_and_one_source_is_timed_once() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("background");
    let Some(b) = backend(&dir) else { return };
    // Two products with the same source (two layers of one shape): one
    // tuning key.
    let (m, k, n) = (72, 48, 56);
    let mut g = Graph::new();
    let x = g.param(ValueType::new([m, k], DType::F32));
    let w1 = g.param(ValueType::new([k, n], DType::F32));
    let w2 = g.param(ValueType::new([k, n], DType::F32));
    let y1 = g.push(Op::MatMul, &[x, w1]).unwrap();
    let y2 = g.push(Op::MatMul, &[x, w2]).unwrap();
    g.outputs.extend([y1, y2]);
    let v = g.verify().unwrap();
    let exe = b.compile(&v).unwrap();
    let up = |len: usize, shape: [usize; 2], f: fn(usize) -> f32| {
        let bytes: Vec<u8> = (0..len).flat_map(|i| f(i).to_le_bytes()).collect();
        b.upload(&bytes, &ValueType::new(shape, DType::F32)).unwrap()
    };
    let inputs = vec![
        up(m * k, [m, k], |i| ((i * 7) % 13) as f32 - 6.0),
        up(k * n, [k, n], |i| ((i * 5) % 11) as f32 * 0.5 - 2.5),
        up(k * n, [k, n], |i| ((i * 3) % 7) as f32 - 3.0),
    ];
    let run = || {
        let out = b.execute(exe.as_ref(), inputs.clone(), &[]).unwrap();
        out.iter().map(|o| b.download(o).unwrap()).collect::<Vec<_>>()
    };
    let counters = || ["AutotuneRuns", "AutotuneKeys"].map(metrics::counter);
    let compiles = || metrics::timer("AutotuneCompile").map_or(0, |t| t.count);
    let (before, compiled) = (counters(), compiles());
    let first = run();
    assert_eq!(counters(), before, "a first execution tunes nothing");
    let second = run();
    assert_eq!(counters()[0], before[0], "the execution that starts the candidates' compile times nothing");
    b.await_background();
    assert_eq!(compiles(), compiled + 1, "one compile of candidates, off the step's path");
    let third = run();
    let after = counters();
    assert!(after[0] > before[0], "the first execution after the compile times the candidates");
    assert_eq!(after[1], before[1] + 1, "two kernels of one source are one key");
    // Nothing left to tune: later executions time nothing; every form
    // computes the same products.
    let fourth = run();
    b.await_background();
    let fifth = run();
    assert_eq!(counters(), after);
    assert_eq!(compiles(), compiled + 1);
    for later in [&second, &third, &fourth, &fifth] {
        assert_eq!(later, &first);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
