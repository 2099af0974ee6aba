//! `lazuli conformance`: the ONNX conformance cases (`lazuli::onnx`) on
//! the chosen backends, as a per-op table and a summary line.

use lazuli::prelude::*;

/// `lazuli conformance [DIR] [--device cpu|wgpu|all]`: runs every ONNX
/// conformance case on the chosen backends (default: both) and prints the
/// per-op table and the `conformance: N passed, M failed, K unsupported`
/// line; fails when a case fails.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut dir = None;
    let mut which = "all".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => which = it.next().cloned().unwrap_or_default(),
            s if s.starts_with("--") => return Err(format!("unknown option {s:?}")),
            s => dir = Some(std::path::PathBuf::from(s)),
        }
    }
    let dir = dir.unwrap_or_else(lazuli::onnx::default_dir);
    let mut devices = Vec::new();
    if which == "cpu" || which == "all" {
        devices.push(("cpu", Device::cpu()));
    }
    if which == "wgpu" || which == "all" {
        devices.push(("wgpu", Device::wgpu().map_err(|e| format!("no wgpu device: {e}"))?));
    }
    if devices.is_empty() {
        return Err(format!("--device takes cpu, wgpu or all, got {which:?}"));
    }
    let backends: Vec<(&str, &Device)> = devices.iter().map(|(n, d)| (*n, d)).collect();
    let report = lazuli::onnx::run_dir(&dir, &backends).map_err(|e| e.to_string())?;
    println!("conformance cases from {}", dir.display());
    print!("{}", report.table());
    println!("{}", report.summary_line());
    match report.totals().failed {
        0 => Ok(()),
        n => Err(format!("{n} conformance case(s) failed")),
    }
}
