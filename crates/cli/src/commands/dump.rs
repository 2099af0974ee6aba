//! `lazuli dump`: the IR text, graph hash, DOT graph and generated kernel
//! source of the fused example's graph (`demo::demo_graph`) on the chosen
//! device.

use super::demo::demo_graph;
use super::{open_device, DeviceChoice};
use lazuli::debug;
use lazuli::prelude::*;

/// The options of `lazuli dump`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The device whose kernels to show (default: Device::default()).
    #[arg(long)]
    pub device: Option<DeviceChoice>,
}

/// `lazuli dump [--device cpu|wgpu]`.
pub fn run(args: Args) -> Result<(), String> {
    open_device(args.device).and_then(|d| dump(&d))
}

/// Prints the dumps of the demo graph recorded on `dev`.
fn dump(dev: &Device) -> Result<(), String> {
    let err = |e: lazuli::ExecError| e.to_string();
    let (y, row_sums) = demo_graph(dev).map_err(err)?;
    println!("== IR ==\n{}", debug::ir_text(&[&y, &row_sums]));
    println!("== graph hash ==\n{:016x}\n", debug::graph_hash(&[&y, &row_sums]));
    println!("== DOT ==\n{}", debug::ir_dot(&[&y, &row_sums]));
    for (name, src) in debug::backend_code(&[&y, &row_sums]).map_err(err)? {
        println!("== {name} ==\n{src}");
    }
    Ok(())
}
