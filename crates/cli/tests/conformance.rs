//! The ONNX conformance suite (`shared/conformance/onnx`, or
//! `LAZULI_CONFORMANCE_DIR`) on the CPU backend and, when an adapter
//! exists, on the wgpu backend (required with LAZULI_REQUIRE_ADAPTER=1).
//! Prints the per-op table and ends with one line
//! `conformance: N passed, M failed, K unsupported`; fails if any case fails.

mod common;

use lazuli::prelude::*;
use lazuli_cli::conformance as onnx;

#[test]
fn onnx_conformance() {
    let dir = onnx::default_dir();
    let files =
        onnx::load_dir(&dir).unwrap_or_else(|e| panic!("reading the conformance cases in {}: {e}", dir.display()));
    assert!(!files.is_empty(), "no *.json conformance files in {}", dir.display());
    let cpu = Device::cpu();
    let wgpu = if common::wgpu_adapter() { Some(Device::wgpu().expect("the wgpu device")) } else { None };
    let mut backends: Vec<(&str, &Device)> = vec![("cpu", &cpu)];
    if let Some(w) = &wgpu {
        backends.push(("wgpu", w));
    }
    let report = onnx::run_files(&files, &backends);
    println!("conformance cases from {}", dir.display());
    print!("{}", report.table());
    println!("{}", report.summary_line());
    let failed = report.totals().failed;
    assert_eq!(failed, 0, "{failed} conformance case(s) failed; see the table above");
}
