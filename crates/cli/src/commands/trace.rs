//! `lazuli trace FILE`: the steady state of a `LAZULI_TRACE` file in
//! numbers (`lazuli::trace_summary`): the loop it is (the repeated step
//! that covers the most wall time) and what it skipped (the load, a
//! warm-up, other loops), wall against kernel time, the GPU's
//! idle time, host spans per thread and each recording thread's own work
//! per execution, the kernels by total time, the longest idle stretches
//! with the host spans over them, and the compiles with the longest
//! pipeline creations.

use lazuli::trace_summary::TraceSummary;

/// The options of `lazuli trace`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The trace file LAZULI_TRACE wrote (Chrome trace JSON).
    pub file: std::path::PathBuf,
    /// How many kernels to list by total time (and idle stretches to show).
    #[arg(long, default_value_t = 15, value_name = "N")]
    pub top: usize,
}

/// `lazuli trace FILE [--top N]`.
pub fn run(args: Args) -> Result<(), String> {
    let (file, top) = (args.file.display().to_string(), args.top);
    let bytes = std::fs::read(&file).map_err(|e| format!("{file}: {e}"))?;
    let doc: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| format!("{file}: {e}"))?;
    let summary = TraceSummary::of(&doc, top).map_err(|e| format!("{file}: {e}"))?;
    // A reader that stops early (`| head`) is no error.
    use std::io::Write as _;
    match write!(std::io::stdout().lock(), "{summary}") {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("writing the summary: {e}")),
        _ => Ok(()),
    }
}
