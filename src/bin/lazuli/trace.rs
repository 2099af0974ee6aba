//! `lazuli trace FILE`: the steady state of a `LAZULI_TRACE` file in
//! numbers (`lazuli::trace_summary`): wall against kernel time, the GPU's
//! idle time, host spans per thread and each recording thread's own work
//! per execution, the kernels by total time, the longest idle stretches
//! with the host spans over them, and the compiles with the longest
//! pipeline creations.

use lazuli::trace_summary::TraceSummary;

/// `lazuli trace FILE [--top N]`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut file = None;
    let mut top = 15;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--top" => {
                top = it.next().ok_or("--top needs a value")?.parse().map_err(|e| format!("--top: {e}"))?;
            }
            other if other.starts_with("--") => return Err(format!("unknown option {other:?}")),
            path if file.is_none() => file = Some(path.to_string()),
            extra => return Err(format!("one trace file at a time, got {extra:?} too")),
        }
    }
    let file = file.ok_or("name the trace file LAZULI_TRACE wrote")?;
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
