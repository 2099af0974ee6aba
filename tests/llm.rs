//! Language models from files (`lazuli::llm`) against the float64 numpy
//! reference of `scripts/llm/make_fixtures.py` (itself checked against
//! llama.cpp when it wrote the fixtures): logits within tolerance, greedy
//! continuations identical, generation through the KV cache equal to a
//! full recompute, no compile per decoded token, weights at their
//! quantized size, dequantization bit-exact against the `gguf` package,
//! on the CPU and (required with LAZULI_REQUIRE_ADAPTER=1) on wgpu.

mod common;

use lazuli::ir::QuantFormat;
use lazuli::llm::gguf::{GgufError, GgufFile};
use lazuli::llm::{GenerateOptions, LlmError, Model, Sampling};
use lazuli::prelude::*;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm")
}

/// A fixture's reference.
struct Reference {
    name: String,
    prompt: Vec<u32>,
    vocab: usize,
    logits: Vec<f64>,
    greedy: Vec<u32>,
    json: serde_json::Value,
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixtures().join(format!("{name}.json"))).expect("fixture json");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| json[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
    Reference {
        name: name.into(),
        prompt: ids("prompt_ids"),
        vocab: json["vocab"].as_u64().unwrap() as usize,
        logits: json["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect(),
        greedy: ids("greedy"),
        json,
    }
}

const GGUF: [&str; 10] = [
    "llama-f32",
    "llama-f16",
    "llama-bf16",
    "llama-q8_0",
    "llama-q4_0",
    "llama-q5_0",
    "llama-q4_k_m",
    "llama-q6_k",
    "qwen2-q8_0",
    "gpt2-q8_0",
];

fn load(name: &str, dev: &Device) -> Model {
    Model::load_on(fixtures().join(format!("{name}.gguf")), dev).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampling: Sampling::default(), chunk: 4, stop_at_eos: false, ..Default::default() }
}

/// Whether the model's quantized products round their activations to 8
/// bits: block-quantized weights, with `LAZULI_CPU_Q8_ACTIVATIONS` not off
/// (the CPU backend runs them, on wgpu too through the CPU fallback).
fn q8_activations(r: &Reference) -> bool {
    let off = std::env::var("LAZULI_CPU_Q8_ACTIVATIONS").is_ok_and(|v| ["0", "false", "off"].contains(&v.trim()));
    let types = r.json["types"].as_array().unwrap();
    !off && types.iter().any(|t| t.as_str().is_some_and(|t| t.starts_with('Q')))
}

/// Logits of every prompt position within 1e-3 of the largest reference
/// logit (the exact products), or 3e-2 where the activations are rounded
/// to 8 bits; the greedy continuation identical.
///
/// The 8-bit bound: each activation moves by up to half a step of its
/// 32-value block (`max|x| / 254`, 0.4 % of the block's largest value)
/// at every one of a layer's seven products, and the errors of the
/// layers add up; on these fixtures the largest error is 1.9e-2 of the
/// largest logit (llama-q5_0; 0.6e-2 to 1.3e-2 for the others, measured
/// with the AVX2 and the scalar builds alike, which are bit-identical).
/// llama.cpp rounds its activations the same way. The kernels themselves
/// are checked exactly against a float64 reference in `lazuli-cpu`'s
/// unit tests (`quant_dot`).
fn check_model(r: &Reference, dev: &Device) {
    let m = load(&r.name, dev);
    let got = m.logits(&r.prompt).unwrap();
    assert_eq!(got.len(), r.prompt.len() * r.vocab, "{}", r.name);
    let scale = r.logits.iter().fold(0f64, |a, b| a.max(b.abs()));
    let err = got.iter().zip(&r.logits).fold(0f64, |a, (g, w)| a.max((f64::from(*g) - w).abs()));
    let tol = if q8_activations(r) { 3e-2 } else { 1e-3 };
    eprintln!("{} on {}: max error {:.3e} of the largest logit", r.name, dev.name(), err / scale);
    assert!(err <= tol * scale, "{} on {}: max error {err:.3e} (largest logit {scale:.3})", r.name, dev.name());
    let g = m.generate(&r.prompt, &greedy(r.greedy.len()), |_| true).unwrap();
    assert_eq!(g.generated_ids, r.greedy, "{} on {}: greedy continuation", r.name, dev.name());
    assert_eq!(g.decode_compiles, 0, "{} on {}: decoding compiled", r.name, dev.name());
}

#[test]
fn gguf_models_match_the_reference_on_the_cpu() {
    let _serial = common::metrics_lock();
    for name in GGUF {
        check_model(&reference(name), &Device::cpu());
    }
}

#[test]
fn gguf_models_match_the_reference_on_wgpu() {
    let _serial = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    // The LLM ops (and the embedding's gather of quantized rows) run as
    // WGSL kernels: nothing falls back to the CPU.
    let fallbacks = || lazuli::metrics::counter("FallbackOps");
    let before = fallbacks();
    for name in ["llama-q4_0", "llama-q4_k_m", "qwen2-q8_0", "gpt2-q8_0"] {
        check_model(&reference(name), &dev);
    }
    assert_eq!(fallbacks(), before, "ops fell back to the CPU on wgpu");
}

#[test]
fn cached_generation_equals_a_full_recompute() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q8_0");
    let m = load(&r.name, &Device::cpu());
    // Chunked prefill (3 tokens a chunk, the last padded) then decoding.
    let opts = GenerateOptions { chunk: 3, ..greedy(8) };
    let g = m.generate(&r.prompt, &opts, |_| true).unwrap();
    let mut all = r.prompt.clone();
    all.extend(&g.generated_ids);
    let logits = m.logits(&all).unwrap();
    for (i, &id) in g.generated_ids.iter().enumerate() {
        let row = &logits[(r.prompt.len() - 1 + i) * r.vocab..][..r.vocab];
        let best = row.iter().enumerate().fold(0, |b, (j, v)| if *v > row[b] { j } else { b });
        assert_eq!(best as u32, id, "token {i}");
    }
}

#[test]
fn decoding_runs_one_plan_whatever_the_position() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q4_0");
    let dev = Device::cpu();
    let m = load(&r.name, &dev);
    let opts = GenerateOptions { context: Some(64), ..greedy(40) };
    let counter = lazuli::metrics::counter;
    let (copied, in_place) = (counter("CpuWriteAtCopied"), counter("CpuWriteAtInPlace"));
    let g = m.generate(&r.prompt, &opts, |_| true).unwrap();
    assert_eq!(g.generated_ids.len(), 40);
    assert_eq!(g.decode_compiles, 0, "a plan compiled after the first decoding step");
    // The cache writes of the decoding steps land in place (the cache is
    // donated), never into a copy of the whole cache; one step's writes
    // (the first execution of a new plan) may still copy.
    let layers = m.config().layers as u64;
    assert!(counter("CpuWriteAtCopied") - copied <= 2 * layers);
    assert!(counter("CpuWriteAtInPlace") - in_place >= 2 * layers * 38);
}

#[test]
fn weights_stay_at_their_quantized_size() {
    let _serial = common::metrics_lock();
    let dev = Device::cpu();
    let f32_bytes = load("llama-f32", &dev).weights_bytes();
    for (name, ratio) in [("llama-q8_0", 3.5), ("llama-q4_0", 6.0), ("llama-f16", 1.9)] {
        let m = load(name, &dev);
        assert!(m.weights_bytes() <= m.file_bytes(), "{name}: {} > file {}", m.weights_bytes(), m.file_bytes());
        assert!((f32_bytes as f64 / m.weights_bytes() as f64) >= ratio, "{name}: {} bytes", m.weights_bytes());
    }
}

#[test]
fn dequantization_is_bit_exact_against_the_gguf_package() {
    let _serial = common::metrics_lock();
    for name in GGUF {
        let r = reference(name);
        let f = GgufFile::open(fixtures().join(format!("{name}.gguf"))).unwrap();
        for (ty, s) in r.json["dequant"].as_object().unwrap() {
            let t = f.tensor(s["tensor"].as_str().unwrap()).unwrap();
            let Some(format) = t.ty.quant_format() else { continue };
            let cols = t.ggml_dims[0];
            let rows = s["rows"].as_u64().unwrap() as usize;
            let row_bytes = format.row_bytes(cols).unwrap();
            let mut got = vec![0f32; rows * cols];
            format.dequantize_row(&f.data(t)[..rows * row_bytes], &mut got);
            let want: Vec<u32> = s["bits"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, want, "{name}: {ty} ({})", t.name);
        }
    }
}

#[test]
fn a_q4_k_m_file_mixes_the_types_llama_cpp_chose() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q4_k_m");
    let types: Vec<&str> = r.json["types"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for t in ["Q4_K", "Q6_K"] {
        assert!(types.contains(&t), "{types:?}");
    }
}

#[test]
fn a_hugging_face_folder_equals_its_gguf_conversion() {
    let _serial = common::metrics_lock();
    let dev = Device::cpu();
    let r = reference("llama-f16");
    let hf = Model::load_on(fixtures().join("hf-llama"), &dev).unwrap();
    let got = hf.logits(&r.prompt).unwrap();
    let scale = r.logits.iter().fold(0f64, |a, b| a.max(b.abs()));
    let err = got.iter().zip(&r.logits).fold(0f64, |a, (g, w)| a.max((f64::from(*g) - w).abs()));
    assert!(err <= 1e-3 * scale, "max error {err:.3e}");
    let tk = hf.tokenizer().expect("tokenizer.json");
    let ids = tk.encode("hello world").unwrap();
    assert_eq!(tk.decode(&ids).unwrap(), "hello world");
}

#[test]
fn gguf_vocabularies_tokenize_as_llama_cpp() {
    let _serial = common::metrics_lock();
    for name in ["llama-q8_0", "qwen2-q8_0", "gpt2-q8_0"] {
        let r = reference(name);
        let m = load(name, &Device::cpu());
        let tk = m.tokenizer().expect("an embedded vocabulary");
        let text = r.json["text"].as_str().unwrap();
        let ids = tk.encode(text).unwrap();
        if let Some(want) = r.json["text_ids"].as_array() {
            let want: Vec<u32> = want.iter().map(|v| v.as_u64().unwrap() as u32).collect();
            assert_eq!(ids, want, "{name}");
        }
        assert_eq!(tk.decode(&ids).unwrap(), text, "{name}");
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_identical_on_every_device() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q4_0");
    let sampling = Sampling { greedy: false, temperature: 0.8, top_k: 40, top_p: 0.9, repetition_penalty: 1.1 };
    let opts = GenerateOptions { sampling, seed: 42, ..greedy(10) };
    let mut runs = Vec::new();
    for dev in common::devices() {
        let m = load(&r.name, &dev);
        let a = m.generate(&r.prompt, &opts, |_| true).unwrap().generated_ids;
        let b = m.generate(&r.prompt, &opts, |_| true).unwrap().generated_ids;
        assert_eq!(a, b, "same seed on {}", dev.name());
        runs.push(a);
    }
    assert!(runs.windows(2).all(|w| w[0] == w[1]), "{runs:?}");
    let m = load(&r.name, &Device::cpu());
    let other = GenerateOptions { seed: 43, ..opts.clone() };
    let c = m.generate(&r.prompt, &other, |_| true).unwrap().generated_ids;
    let d = m.generate(&r.prompt, &GenerateOptions { seed: 44, ..opts }, |_| true).unwrap().generated_ids;
    assert!(c != runs[0] || d != runs[0], "three seeds, one sequence");
}

#[test]
fn a_batch_generates_what_each_sequence_would_alone() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q8_0");
    let m = load(&r.name, &Device::cpu());
    let short = r.prompt[..4].to_vec();
    let opts = greedy(6);
    let batch = m.generate_batch(&[r.prompt.clone(), short.clone()], &opts, |_, _| true).unwrap();
    let a = m.generate(&r.prompt, &opts, |_| true).unwrap();
    let b = m.generate(&short, &opts, |_| true).unwrap();
    assert_eq!(batch[0].generated_ids, a.generated_ids);
    assert_eq!(batch[1].generated_ids, b.generated_ids);
}

#[test]
fn a_prompt_beyond_the_context_is_an_error() {
    let _serial = common::metrics_lock();
    let r = reference("llama-q8_0");
    let m = load(&r.name, &Device::cpu());
    let long = vec![3u32; 65];
    let e = m.generate(&long, &greedy(2), |_| true).unwrap_err();
    assert!(matches!(e, LlmError::Request(_)), "{e}");
    let e = m.generate(&[100_000], &greedy(2), |_| true).unwrap_err();
    assert!(matches!(e, LlmError::Request(_)), "{e}");
}

#[test]
fn quantize_keeps_blocks_and_its_product_matches_the_dequantized_one() {
    let _serial = common::metrics_lock();
    let dev = Device::cpu();
    let w: Vec<f32> = (0..16 * 64).map(|i| ((i * 7919 % 257) as f32 - 128.0) / 64.0).collect();
    let x: Vec<f32> = (0..3 * 64).map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0).collect();
    let wt = Tensor::from_slice(&w, [16, 64], &dev).unwrap();
    let xt = Tensor::from_slice(&x, [3, 64], &dev).unwrap();
    for format in [QuantFormat::Q8_0, QuantFormat::Q4_0] {
        let q = lazuli::llm::quantize(&wt, format).unwrap();
        assert_eq!(q.storage_bytes(), 16 * format.row_bytes(64).unwrap());
        let deq = q.dequantize().unwrap();
        let want = xt.matmul(&deq.t().unwrap()).unwrap().to_vec::<f32>().unwrap();
        let got = q.matmul_t(&xt).unwrap().to_vec::<f32>().unwrap();
        // The CPU backend rounds the activations to 8 bits by default
        // (`LAZULI_CPU_Q8_ACTIVATIONS`, as llama.cpp): each value moves by
        // at most half a step of its 32-value block, `max|x| / 254`, so an
        // output moves by at most the sum over blocks of that step times
        // the block's `sum |w|`. The f32 reassociation adds 1e-4.
        let back = deq.to_vec::<f32>().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let (r, c) = (i / 16, i % 16);
            let rounding: f32 = (0..2)
                .map(|blk| {
                    let span = 32 * blk..32 * blk + 32;
                    let amax = x[64 * r..][span.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
                    amax / 254.0 * back[64 * c..][span].iter().map(|v| v.abs()).sum::<f32>()
                })
                .sum();
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()) + rounding, "{format}: {a} vs {b}");
        }
        // The error of quantization itself is bounded by the block step.
        let worst = w.iter().zip(&back).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 2.0 / if format == QuantFormat::Q8_0 { 127.0 } else { 7.0 }, "{format}: {worst}");
    }
    let bad = Tensor::from_slice(&w[..16 * 40], [16, 40], &dev).unwrap();
    assert!(lazuli::llm::quantize(&bad, QuantFormat::Q8_0).is_err());
}

#[test]
fn quantized_bytes_admit_only_their_ops() {
    let _serial = common::metrics_lock();
    let dev = Device::cpu();
    let q = lazuli::llm::quantize(&Tensor::ones([4, 32], DType::F32, &dev).unwrap(), QuantFormat::Q4_0).unwrap();
    // A product whose columns do not match the rows' values.
    let x = Tensor::ones([2, 31], DType::F32, &dev).unwrap();
    assert!(q.matmul_t(&x).is_err());
    // Rows that are not whole blocks.
    let bytes = Tensor::zeros([4, 17], DType::U8, &dev).unwrap();
    let e = Tensor::record(lazuli::ir::Op::Dequantize(QuantFormat::Q4_0), &[&bytes]).unwrap_err();
    assert!(e.to_string().contains("whole q4_0 blocks"), "{e}");
}

/// A truncated file, offsets beyond it, an unknown type: errors, not
/// panics, and nothing allocated at a declared size before it is checked.
#[test]
fn bad_files_are_errors() {
    let _serial = common::metrics_lock();
    let good = std::fs::read(fixtures().join("llama-q4_0.gguf")).unwrap();
    let end = GgufFile::from_bytes(good.clone()).unwrap().tensors.iter().map(|t| t.start + t.bytes).max().unwrap();
    for cut in [0, 3, 8, 23, 100, good.len() / 2, end - 1] {
        assert!(GgufFile::from_bytes(good[..cut].to_vec()).is_err(), "cut at {cut}");
    }
    let mut bad = good.clone();
    bad[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    assert!(GgufFile::from_bytes(bad).is_err());
    let mut bad = good.clone();
    bad[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes()); // metadata count
    assert!(matches!(GgufFile::from_bytes(bad), Err(GgufError::Truncated { .. })));
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(GgufFile::from_bytes(bad), Err(GgufError::Header(_))));
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Mutated real files: parsing and loading never panic.
        #[test]
        fn mutated_files_never_panic(edits in proptest::collection::vec((0usize..1 << 20, any::<u8>()), 1..8), span in 0usize..4096) {
            let good = std::fs::read(fixtures().join("llama-q4_0.gguf")).unwrap();
            let mut bytes = good.clone();
            // Most edits land in the header and metadata, where the parser works.
            for (at, v) in edits {
                let i = if at % 4 == 0 { at % bytes.len() } else { at % span.clamp(1, bytes.len()) };
                bytes[i] = v;
            }
            if let Ok(f) = GgufFile::from_bytes(bytes.clone()) {
                for t in &f.tensors {
                    prop_assert!(t.start + t.bytes <= bytes.len());
                }
                let path = std::env::temp_dir().join(format!("lazuli-fuzz-{}.gguf", std::process::id()));
                std::fs::write(&path, &bytes).unwrap();
                let _ = Model::load_on(&path, &Device::cpu());
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}
