//! `lazuli run MODEL.onnx`: parses the arguments and calls the library's
//! `lazuli::onnx::cli::run`, which holds the command's logic.

use lazuli::onnx::cli::{run as run_model, RunArgs};

/// Runs the command; `--check` with unsupported nodes is an error exit.
pub fn run(args: &[String]) -> Result<(), String> {
    let parsed = RunArgs::parse(args)?;
    let outcome = run_model(&parsed)?;
    println!("{}", outcome.text);
    if outcome.ok {
        Ok(())
    } else {
        Err("the model has unsupported nodes".into())
    }
}
