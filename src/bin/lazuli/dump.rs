//! `lazuli dump`: the IR text, graph hash, DOT graph and generated kernel
//! source of the demo's graph (`demo::demo_graph`) on the chosen device.

use crate::demo::demo_graph;
use lazuli::debug;
use lazuli::prelude::*;

/// `lazuli dump [--device cpu|wgpu]`.
pub fn run(args: &[String]) -> Result<(), String> {
    crate::device_arg(args).and_then(|d| dump(&d))
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
