//! `lazuli run` and `lazuli generate --model` as processes: an exported
//! encoder at chosen sizes with `--json` and `--save`, `--check` on a
//! supported and an unsupported model (the fixtures of the facade's ONNX
//! tests); a quantized language model's greedy continuation on both
//! devices (the facade's LLM fixtures).

mod common;

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

/// The LLM issue's command line: `lazuli generate --model tiny-q4_0.gguf
/// --prompt-ids ... --greedy --json` gives the reference continuation
/// (`scripts/llm/make_fixtures.py`'s float64 numpy run) on both devices,
/// with its rates and sizes and no compile per decoded token.
#[test]
fn lazuli_generate_continues_a_quantized_model_as_the_reference() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llm");
    let text = std::fs::read_to_string(dir.join("llama-q4_0.json")).expect("fixture json");
    let r: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |k: &str| r[k].as_array().expect(k).iter().map(|v| v.as_u64().expect("id") as u32).collect::<Vec<_>>();
    let (prompt, greedy) = (ids("prompt_ids"), ids("greedy"));
    let prompt: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let mut devices = vec!["cpu"];
    if common::wgpu_adapter() {
        devices.push("wgpu");
    }
    for dev in devices {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazuli"))
            .args(["generate", "--model"])
            .arg(dir.join("llama-q4_0.gguf"))
            .args(["--prompt-ids", &prompt.join(","), "--max-tokens", &greedy.len().to_string(), "--greedy"])
            .args(["--device", dev, "--json"])
            .env("LAZULI_CACHE_DIR", "")
            .output()
            .expect("lazuli generate");
        assert!(out.status.success(), "{dev}: {}", common::describe(&out));
        let line = String::from_utf8(out.stdout).expect("utf-8");
        let j: serde_json::Value = serde_json::from_str(line.trim().lines().last().expect("a line")).expect("json");
        let got: Vec<u32> =
            j["generated_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        // The vocabulary's end token may stop it early: a prefix then.
        assert!(!got.is_empty() && greedy.starts_with(&got), "{dev}: {got:?} vs {greedy:?}");
        for key in ["prompt_tps", "decode_tps", "weights_bytes", "kv_bytes"] {
            assert!(j[key].as_f64().is_some_and(|v| v > 0.0), "{dev}: {key} in {j}");
        }
        assert_eq!(j["decode_compiles"].as_u64(), Some(0), "{dev}");
    }
}
