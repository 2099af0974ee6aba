//! `lazuli conformance`: the ONNX conformance cases (`lazuli::onnx`) on
//! the chosen backends, as a per-op table and a summary line.

use super::DevicesChoice;
use lazuli::prelude::*;

/// The options of `lazuli conformance`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The directory of conformance cases (default: LAZULI_CONFORMANCE_DIR,
    /// else the default of `crate::conformance::default_dir`).
    pub dir: Option<std::path::PathBuf>,
    /// The backends to run the cases on.
    #[arg(long, value_enum, default_value_t = DevicesChoice::All)]
    pub device: DevicesChoice,
}

/// `lazuli conformance [DIR] [--device cpu|wgpu|all]`: runs every ONNX
/// conformance case on the chosen backends (default: both) and prints the
/// per-op table and the `conformance: N passed, M failed, K unsupported`
/// line; fails when a case fails.
pub fn run(args: Args) -> Result<(), String> {
    let dir = args.dir.unwrap_or_else(crate::conformance::default_dir);
    let mut devices = Vec::new();
    if args.device.cpu() {
        devices.push(("cpu", Device::cpu()));
    }
    if args.device.wgpu() {
        devices.push(("wgpu", Device::wgpu().map_err(|e| format!("no wgpu device: {e}"))?));
    }
    let backends: Vec<(&str, &Device)> = devices.iter().map(|(n, d)| (*n, d)).collect();
    let report = crate::conformance::run_dir(&dir, &backends).map_err(|e| e.to_string())?;
    println!("conformance cases from {}", dir.display());
    print!("{}", report.table());
    println!("{}", report.summary_line());
    match report.totals().failed {
        0 => Ok(()),
        n => Err(format!("{n} conformance case(s) failed")),
    }
}
