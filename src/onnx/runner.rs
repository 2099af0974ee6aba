//! Runs conformance cases on devices and reports: [`run_dir`] /
//! [`run_files`] run every case as a one-node [`super::Model`]
//! ([`super::Case::to_model`]), read the outputs
//! and compare them with the expected tensors under the README's
//! tolerances ([`tolerance`]); [`Report`] prints the per-op table
//! (passed / failed / unsupported per backend), the reasons, and the final
//! `conformance: N passed, M failed, K unsupported` line.
//!
//! Comparison rules: dtypes and shapes must match exactly; integers and
//! booleans are exact; floats pass when `|got - want| <= atol + rtol *
//! |want|`, NaN equals NaN and an infinity must match exactly. A panic
//! inside a case is caught and reported as a failure of that case.

use super::case::{load_dir, Case, CaseError, OpFile, TensorData};
use super::error::OnnxError;
use super::model::{Int64Mode, Model, ModelOptions};
use crate::{Device, Tensor};
use lazuli_ir::{DType, ScalarValue};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// The result of one case on one backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every checked output matched.
    Passed,
    /// Wrong values, dtype or shape, an error Lazuli should not raise, or a panic.
    Failed(String),
    /// Lazuli cannot express the case; the reason says why.
    Unsupported(String),
}

/// One case's outcome on one backend.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// The ONNX operator (the file's `op`).
    pub op: String,
    /// The case name.
    pub case: String,
    /// The backend's label, e.g. `"cpu"`.
    pub backend: String,
    /// What happened.
    pub outcome: Outcome,
}

/// Every case's outcome on every backend, in run order.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Backend labels, in column order.
    pub backends: Vec<String>,
    /// The outcomes.
    pub results: Vec<CaseResult>,
}

/// Passed / failed / unsupported counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Cases that passed.
    pub passed: usize,
    /// Cases that failed.
    pub failed: usize,
    /// Cases Lazuli cannot express.
    pub unsupported: usize,
}

impl Counts {
    fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Passed => self.passed += 1,
            Outcome::Failed(_) => self.failed += 1,
            Outcome::Unsupported(_) => self.unsupported += 1,
        }
    }

    /// All cases counted.
    pub fn total(&self) -> usize {
        self.passed + self.failed + self.unsupported
    }
}

/// The conformance folder: `LAZULI_CONFORMANCE_DIR` when set, else
/// `shared/conformance/onnx` beside the repository.
pub fn default_dir() -> PathBuf {
    let config = lazuli_executor::config::path(&lazuli_executor::config::process, "LAZULI_CONFORMANCE_DIR");
    config.unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/conformance/onnx"))
}

/// `(rtol, atol)` for an output of `dtype` of the ONNX operator `op`
/// (integers and bool: exact, given as zeros).
pub fn tolerance(op: &str, dtype: DType) -> (f64, f64) {
    const TRANSCENDENTAL: &[&str] = &[
        "Exp",
        "Log",
        "Sigmoid",
        "Tanh",
        "Elu",
        "Selu",
        "Gelu",
        "Softplus",
        "Erf",
        "Sin",
        "Cos",
        "Pow",
        "Softmax",
        "LogSoftmax",
    ];
    let tr = TRANSCENDENTAL.contains(&op);
    match dtype {
        DType::F32 if tr => (1e-3, 1e-3),
        DType::F32 => (1e-4, 1e-5),
        DType::F16 if tr => (1e-2, 1e-3),
        DType::F16 => (1e-3, 1e-3),
        // bf16 keeps 8 significand bits: 2^-8 relative per rounding.
        DType::BF16 if tr => (2e-2, 1e-2),
        DType::BF16 => (1e-2, 1e-2),
        DType::F64 => (1e-7, 1e-9),
        _ => (0.0, 0.0),
    }
}

/// Runs every case of every `*.json` file in `dir` on each backend.
pub fn run_dir(dir: &Path, backends: &[(&str, &Device)]) -> Result<Report, CaseError> {
    Ok(run_files(&load_dir(dir)?, backends))
}

/// Runs every case of `files` on each backend.
pub fn run_files(files: &[OpFile], backends: &[(&str, &Device)]) -> Report {
    let mut report = Report { backends: backends.iter().map(|b| b.0.to_string()).collect(), results: vec![] };
    for (label, device) in backends {
        for f in files {
            for case in &f.cases {
                report.results.push(CaseResult {
                    op: f.op.clone(),
                    case: case.name.clone(),
                    backend: label.to_string(),
                    outcome: run_case(&f.op, case, device),
                });
            }
        }
    }
    report
}

/// Runs one case on `device`; never panics.
pub fn run_case(op: &str, case: &Case, device: &Device) -> Outcome {
    match catch_unwind(AssertUnwindSafe(|| run_case_inner(op, case, device))) {
        Ok(o) => o,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic payload".into());
            Outcome::Failed(format!("panicked: {msg}"))
        }
    }
}

fn run_case_inner(op: &str, case: &Case, device: &Device) -> Outcome {
    // int64 stays int64 (on wgpu through the CPU fallback): the suite
    // checks ONNX's exact semantics, values beyond the 32-bit range included.
    let options = ModelOptions { int64: Int64Mode::Keep };
    let model = match Model::from_proto(&case.to_model(op), options) {
        Ok(m) => m,
        Err(OnnxError::Unsupported(list)) => {
            return Outcome::Unsupported(list.iter().map(|u| u.reason.clone()).collect::<Vec<_>>().join("; "))
        }
        Err(e) => return Outcome::Failed(format!("loading: {e}")),
    };
    let mut tensors = vec![];
    for (name, d) in case.model_inputs(op) {
        match Tensor::from_bytes(d.to_bytes(), d.ty(), device) {
            Ok(t) => tensors.push((name, t)),
            Err(e) => return Outcome::Failed(format!("input {name}: {e}")),
        }
    }
    let inputs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let outs = match model.run_on(device, &inputs) {
        Ok(o) => o,
        Err(OnnxError::Node { detail, .. }) if detail.starts_with("unsupported: ") => {
            return Outcome::Unsupported(detail["unsupported: ".len()..].to_string())
        }
        Err(e) => return Outcome::Failed(format!("recording: {e}")),
    };
    let checked: Vec<(usize, &TensorData, &Tensor)> = case
        .outputs
        .iter()
        .enumerate()
        .filter_map(|(i, w)| w.as_ref().and_then(|w| outs.get(&format!("y{i}")).map(|t| (i, w, t))))
        .collect();
    let refs: Vec<&Tensor> = checked.iter().map(|c| c.2).collect();
    if let Err(e) = crate::sync(&refs) {
        return Outcome::Failed(format!("sync: {e}"));
    }
    for (i, want, got) in checked {
        if let Err(e) = compare(op, want, got) {
            return Outcome::Failed(format!("output {i}: {e}"));
        }
    }
    Outcome::Passed
}

fn compare(op: &str, want: &TensorData, got: &Tensor) -> Result<(), String> {
    if got.dtype() != want.dtype {
        return Err(format!("dtype {} (want {})", got.dtype(), want.dtype));
    }
    if got.dims() != want.shape.as_slice() {
        return Err(format!("shape {} (want {:?})", got.shape(), want.shape));
    }
    let vals = got.to_scalars().map_err(|e| format!("reading the result: {e}"))?;
    let (rtol, atol) = tolerance(op, want.dtype);
    let mut bad = 0;
    let mut first = None;
    for (i, (g, w)) in vals.iter().zip(&want.data).enumerate() {
        if !element_ok(*g, *w, want.dtype, rtol, atol) {
            bad += 1;
            first.get_or_insert((i, *g, *w));
        }
    }
    match first {
        None => Ok(()),
        Some((i, g, w)) => Err(format!(
            "{bad} of {} elements differ (rtol {rtol:e}, atol {atol:e}); first at flat index {i}: got {}, want {}",
            vals.len(),
            show(g),
            show(w)
        )),
    }
}

fn element_ok(g: ScalarValue, w: ScalarValue, dtype: DType, rtol: f64, atol: f64) -> bool {
    match dtype {
        DType::Bool => g.as_bool() == w.as_bool(),
        d if d.is_float() => {
            let (g, w) = (g.as_f64(), w.as_f64());
            if w.is_nan() || g.is_nan() {
                w.is_nan() && g.is_nan()
            } else if w.is_infinite() || g.is_infinite() {
                g == w
            } else {
                (g - w).abs() <= atol + rtol * w.abs()
            }
        }
        d if d.is_unsigned_int() => g.as_u64() == w.as_u64(),
        _ => g.as_i64() == w.as_i64(),
    }
}

fn show(v: ScalarValue) -> String {
    match v {
        ScalarValue::Float(f) => format!("{f:e}"),
        ScalarValue::Int(i) => i.to_string(),
        ScalarValue::UInt(u) => u.to_string(),
        ScalarValue::Bool(b) => b.to_string(),
    }
}

impl Report {
    /// Counts over every backend.
    pub fn totals(&self) -> Counts {
        let mut c = Counts::default();
        for r in &self.results {
            c.add(&r.outcome);
        }
        c
    }

    /// Counts of one backend.
    pub fn backend_totals(&self, backend: &str) -> Counts {
        let mut c = Counts::default();
        for r in self.results.iter().filter(|r| r.backend == backend) {
            c.add(&r.outcome);
        }
        c
    }

    /// The cases that failed.
    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.results.iter().filter(|r| matches!(r.outcome, Outcome::Failed(_)))
    }

    /// `conformance: N passed, M failed, K unsupported`, summed over backends.
    pub fn summary_line(&self) -> String {
        let t = self.totals();
        format!("conformance: {} passed, {} failed, {} unsupported", t.passed, t.failed, t.unsupported)
    }

    /// The per-op table (passed / failed / unsupported per backend), a
    /// total row with pass rates, then every unsupported and failed case
    /// with its reason. Does not include the summary line.
    pub fn table(&self) -> String {
        let mut per_op: BTreeMap<&str, BTreeMap<&str, Counts>> = BTreeMap::new();
        for r in &self.results {
            per_op.entry(&r.op).or_default().entry(&r.backend).or_default().add(&r.outcome);
        }
        let mut s = String::new();
        let _ = write!(s, "{:<20}", "op");
        for b in &self.backends {
            let _ = write!(s, " | {:>6} {:>5} {:>5} {:>5}", b, "pass", "fail", "unsup");
        }
        s.push('\n');
        let width = 20 + self.backends.len() * 28;
        s.push_str(&"-".repeat(width));
        s.push('\n');
        for (op, by_backend) in &per_op {
            let _ = write!(s, "{op:<20}");
            for b in &self.backends {
                let c = by_backend.get(b.as_str()).copied().unwrap_or_default();
                let _ = write!(s, " | {:>6} {:>5} {:>5} {:>5}", "", c.passed, c.failed, c.unsupported);
            }
            s.push('\n');
        }
        s.push_str(&"-".repeat(width));
        s.push('\n');
        let _ = write!(s, "{:<20}", "total");
        for b in &self.backends {
            let c = self.backend_totals(b);
            let _ = write!(s, " | {:>6} {:>5} {:>5} {:>5}", "", c.passed, c.failed, c.unsupported);
        }
        s.push('\n');
        for b in &self.backends {
            let c = self.backend_totals(b);
            let pct = if c.total() == 0 { 0.0 } else { 100.0 * c.passed as f64 / c.total() as f64 };
            let _ = writeln!(s, "{b}: {}/{} passed ({pct:.1}%)", c.passed, c.total());
        }
        let mut section = |title: &str, pick: &dyn Fn(&Outcome) -> Option<String>| {
            let rows: Vec<String> = self
                .results
                .iter()
                .filter_map(|r| pick(&r.outcome).map(|why| format!("  [{}] {}/{}: {why}", r.backend, r.op, r.case)))
                .collect();
            if !rows.is_empty() {
                let _ = writeln!(s, "{title} ({}):", rows.len());
                for r in rows {
                    s.push_str(&r);
                    s.push('\n');
                }
            }
        };
        section("unsupported", &|o| if let Outcome::Unsupported(w) = o { Some(w.clone()) } else { None });
        section("failed", &|o| if let Outcome::Failed(w) = o { Some(w.clone()) } else { None });
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_comparison_rules() {
        let f = ScalarValue::Float;
        assert!(element_ok(f(f64::NAN), f(f64::NAN), DType::F32, 1e-4, 1e-5));
        assert!(!element_ok(f(1.0), f(f64::NAN), DType::F32, 1e-4, 1e-5));
        assert!(element_ok(f(f64::INFINITY), f(f64::INFINITY), DType::F32, 1e-4, 1e-5));
        assert!(!element_ok(f(f64::MAX), f(f64::INFINITY), DType::F32, 1e-4, 1e-5));
        assert!(element_ok(f(1.00005), f(1.0), DType::F32, 1e-4, 1e-5));
        assert!(!element_ok(f(1.001), f(1.0), DType::F32, 1e-4, 1e-5));
        assert!(!element_ok(ScalarValue::Int(3), ScalarValue::Int(4), DType::I64, 0.0, 0.0));
    }

    #[test]
    fn tolerances_follow_the_readme() {
        assert_eq!(tolerance("Add", DType::F32), (1e-4, 1e-5));
        assert_eq!(tolerance("Softmax", DType::F32), (1e-3, 1e-3));
        assert_eq!(tolerance("Add", DType::I64), (0.0, 0.0));
    }
}
