//! `lazuli generate`: greedy generation with a small GPT
//! (`lazuli::generate`), a growing context beside a fixed window, with the
//! time, plans compiled and pipelines created per window.

use lazuli::generate::{GenConfig, Window};
use lazuli::metrics;

/// `lazuli generate`: greedy generation with a growing and/or a fixed
/// window, side by side, with compile counters.
pub fn run(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--model") {
        return crate::generate_model::run(args);
    }
    let mut cfg = GenConfig::default();
    let mut windows = vec![Window::Growing, Window::Fixed];
    let mut device_args = Vec::new();
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        match a.as_str() {
            "--device" => device_args.extend(["--device".to_string(), value("--device")?]),
            "--tokens" => cfg.tokens = value("--tokens")?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--window" => {
                windows = match value("--window")?.as_str() {
                    "growing" => vec![Window::Growing],
                    "fixed" => vec![Window::Fixed],
                    "both" => vec![Window::Growing, Window::Fixed],
                    other => return Err(format!("--window takes growing, fixed or both, got {other:?}")),
                }
            }
            "--json" => json = true,
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let dev = crate::device_arg(&device_args)?;
    let mut rows = Vec::new();
    for w in windows {
        let r = lazuli::generate::run(cfg, w, &dev).map_err(|e| e.to_string())?;
        println!("{}", if json { r.to_json(&dev.name()) } else { r.summary(&dev.name()) });
        rows.push(r);
    }
    if let [a, b] = rows.as_slice() {
        let same = a.tokens.iter().zip(&b.tokens).filter(|(x, y)| x == y).count();
        if !json {
            println!(
                "growing / fixed time: {:.2}x; tokens equal: {same}/{}",
                a.total.as_secs_f64() / b.total.as_secs_f64(),
                a.tokens.len()
            );
        }
    }
    if !json {
        println!("\n{}", metrics::report());
    }
    Ok(())
}
