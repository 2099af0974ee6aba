//! `lazuli run` as a process: an exported encoder at chosen sizes with
//! `--json` and `--save`, and `--check` on a supported and an unsupported
//! model (the fixtures of the facade's ONNX tests).

use lazuli::prelude::*;
use std::path::PathBuf;

/// The facade's ONNX fixtures (`tests/fixtures/onnx` of the workspace).
fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx")
}

#[test]
fn lazuli_run_reports_saves_and_checks() {
    let exe = env!("CARGO_BIN_EXE_lazuli");
    let model = fixtures().join("exported/encoder/model.onnx");
    let out = std::env::temp_dir().join(format!("lazuli-run-{}", std::process::id()));
    let r = std::process::Command::new(exe)
        .args(["run", model.to_str().expect("path"), "--device", "cpu", "--dim", "batch=2", "--dim", "seq=5"])
        .args(["--repeat", "2", "--json", "--save", out.to_str().expect("path")])
        .env("LAZULI_CACHE_DIR", "")
        .output()
        .expect("lazuli run");
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).expect("one JSON object");
    for key in ["first_run_ms", "median_ms", "kernels", "fallback_ops", "uncached_compiles", "outputs"] {
        assert!(v.get(key).is_some(), "--json lacks {key}: {v}");
    }
    assert_eq!(v["outputs"]["logits"]["shape"], serde_json::json!([2, 5, 8]), "{v}");
    assert_eq!(v["outputs"]["pooled"]["dtype"], "f32", "{v}");
    let saved = lazuli_cli::commands::run::read_npy(&out.join("logits.npy"), &Device::cpu()).expect("logits.npy");
    assert_eq!(saved.dims(), &[2, 5, 8]);
    std::fs::remove_dir_all(&out).expect("cleanup");
    // --check: every node of the encoder is supported; a string model is not.
    let ok =
        std::process::Command::new(exe).args(["run", model.to_str().expect("path"), "--check"]).output().expect("run");
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stdout));
    let strings = fixtures().join("simple/strnorm_model_monday_casesensintive_lower/model.onnx");
    let bad = std::process::Command::new(exe)
        .args(["run", strings.to_str().expect("path"), "--check"])
        .output()
        .expect("run");
    assert!(!bad.status.success());
    let text = String::from_utf8_lossy(&bad.stdout);
    assert!(text.contains("StringNormalizer") && text.contains("unsupported"), "{text}");
}
