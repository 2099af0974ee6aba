//! O1: whole ONNX models on a device — the `light` models of the `onnx`
//! wheel (weights from `ConstantOfShape`, real shapes and FLOPs) and the
//! exported transformer encoder at batch 8, sequence 128 — one row each.
//! `scripts/onnx/bench-vs-onnxruntime.py` times onnxruntime's CPU provider
//! on the same models beside `lazuli run` in one run (same threads) and
//! prints the ratios BENCHMARKS.md records.

use super::{time_iterations, BenchConfig, BenchDevice, BenchResult};
use crate::onnx::{Dim, Model};
use crate::{ExecError, Result, Tensor};
use std::path::PathBuf;

/// The fixtures folder the models come from.
pub fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/onnx")
}

/// An O1 row: its name, the model file and the sizes of its symbolic dims.
pub type O1Model = (String, PathBuf, Vec<(&'static str, usize)>);

/// Every O1 model.
pub fn o1_models() -> Vec<O1Model> {
    let dir = models_dir();
    let mut v: Vec<O1Model> = [
        "alexnet",
        "densenet121",
        "inception_v1",
        "inception_v2",
        "resnet50",
        "shufflenet",
        "squeezenet",
        "vgg19",
        "zfnet512",
    ]
    .iter()
    .map(|m| {
        let name = if *m == "alexnet" { "bvlc_alexnet" } else { m };
        (format!("O1 {name}"), dir.join("light").join(name).join("model.onnx"), vec![])
    })
    .collect();
    v.push(("O1 encoder b8 t128".into(), dir.join("exported/encoder/model.onnx"), vec![("batch", 8), ("seq", 128)]));
    v
}

/// A model's O1 inputs on `dev`: floats uniform in [0, 1), int64 ids in
/// [1, 97], symbolic dims from `dims` (1 where not given).
fn inputs(model: &Model, dims: &[(&str, usize)], dev: &crate::Device) -> Result<Vec<(String, Tensor)>> {
    let mut out = vec![];
    for info in model.inputs() {
        let shape: Vec<usize> = info
            .dims
            .iter()
            .flatten()
            .map(|d| match d {
                Dim::Fixed(n) => *n,
                Dim::Symbolic(s) => dims.iter().find(|(k, _)| k == s).map(|p| p.1).unwrap_or(1),
                Dim::Unknown => 1,
            })
            .collect();
        let n: usize = shape.iter().product();
        let t = match info.dtype {
            Some(crate::DType::I64) => {
                Tensor::from_slice(&(0..n).map(|i| (i % 97 + 1) as i64).collect::<Vec<_>>(), shape, dev)?
            }
            _ => Tensor::from_slice(&super::uniform_data(n, 46), shape, dev)?,
        };
        out.push((info.name.clone(), t));
    }
    Ok(out)
}

/// A step that runs `model` once (outputs synced and waited for).
fn step(
    model: Model,
    inputs: Vec<(String, Tensor)>,
    dev: &crate::Device,
    name: &str,
) -> Box<dyn FnMut() -> Result<()>> {
    let dev = dev.clone();
    let name = name.to_string();
    Box::new(move || {
        let named: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let outs =
            model.run_on(&dev, &named).map_err(|e| ExecError::Invalid { op: name.clone(), detail: e.to_string() })?;
        crate::sync(&outs.tensors())?;
        dev.wait()
    })
}

fn load(name: &str, path: &std::path::Path) -> Result<Model> {
    Model::load(path).map_err(|e| ExecError::Invalid { op: name.to_string(), detail: e.to_string() })
}

/// The encoder's step at batch 8, sequence 128 (`lazuli bench O1 --profile`).
pub fn encoder_step(dev: &crate::Device) -> Result<Box<dyn FnMut() -> Result<()>>> {
    let models = o1_models();
    let (name, path, dims) = models.last().expect("the encoder row");
    let model = load(name, path)?;
    let inputs = inputs(&model, dims, dev)?;
    Ok(step(model, inputs, dev, name))
}

/// One row per model: a run (inputs uploaded before, outputs synced and
/// waited for) per iteration.
pub fn o1_rows(bd: &BenchDevice, cfg: &BenchConfig) -> Result<Vec<BenchResult>> {
    let dev = &bd.device;
    let mut rows = vec![];
    for (name, path, dims) in o1_models() {
        let model = load(&name, &path)?;
        let nodes = model.node_count();
        let ins = inputs(&model, &dims, dev)?;
        let mut body = step(model, ins, dev, &name);
        let timed = time_iterations(cfg, &mut body)?;
        let mut r = BenchResult::from_times(&name, bd.label, &timed.0);
        r.kernels = Some(timed.1);
        r.note = Some(format!("{nodes} nodes"));
        rows.push(r);
    }
    Ok(rows)
}
