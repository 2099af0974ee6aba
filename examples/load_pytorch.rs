//! Loading a checkpoint saved in PyTorch's layout: the committed fixture
//! `tests/fixtures/pytorch_layout` (written by its `generate.py` with
//! numpy; PyTorch's names, an int64 `num_batches_tracked`, f16 and bf16
//! tensors) loads strictly into the same model built from `lazuli::nn`
//! layers, and the forward output matches the reference numpy computed.
//!
//! ```text
//! cargo run --example load_pytorch
//! ```
//!
//! The model, in PyTorch:
//!
//! ```text
//! body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
//!                      nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8))
//! emb = nn.Embedding(10, 8)
//! forward(x, ids) = body(x) + emb(ids)
//! ```

use lazuli::nn::{self, Module, ModuleExt};
use lazuli::prelude::*;
use lazuli::serialize::LoadOptions;
use std::path::PathBuf;

/// The same model with the same names (`body.0.weight`, ..., `emb.weight`).
#[derive(Module)]
struct Net {
    body: nn::Sequential,
    emb: nn::Embedding,
}

impl Net {
    fn new(dev: &Device) -> lazuli::Result<Net> {
        let body = nn::Sequential::new()
            .add(nn::Conv2d::builder(1, 4, 3).padding(1).build(dev)?)
            .add(nn::BatchNorm2d::new(4, dev)?)
            .add(nn::Activation::Relu)
            .add(nn::Flatten)
            .add(nn::Linear::new(64, 8, dev)?)
            .add(nn::LayerNorm::new(&[8], dev)?);
        Ok(Net { body, emb: nn::Embedding::new(10, 8, dev)? })
    }

    /// The image path (what `Module::forward` runs).
    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        self.body.forward(x)
    }
}

fn main() -> lazuli::Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pytorch_layout");
    let dev = Device::default();
    let net = Net::new(&dev)?;
    // Strict: every name must match, f16/bf16 become the parameters' f32.
    net.load_state_dict(dir.join("model.safetensors"))?;
    net.eval();
    let reference = lazuli::serialize::load(dir.join("reference.safetensors"), &dev)?;
    // PyTorch's int64 ids, narrowed on the host for the gather.
    let ids: Vec<i32> = reference["ids"].to_vec::<i64>()?.into_iter().map(|i| i as i32).collect();
    let ids = Tensor::from_slice(&ids, [ids.len()], &dev)?;
    let y = net.forward(&reference["x"])?.add(&net.emb.forward(&ids)?)?.to_vec::<f32>()?;
    let want = reference["y"].to_vec::<f32>()?;
    let diff = y.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("device: {}; largest difference from numpy's output: {diff:.2e}", dev.name());

    // A checkpoint whose names differ loads through a renaming, and a
    // partial one non-strictly, reporting what it did not find.
    let opts = LoadOptions::non_strict().rename(|k| k.strip_prefix("body.").map(str::to_string));
    let report = net.body.load_state_dict_with(dir.join("model.safetensors"), &opts)?;
    println!("body alone: missing {:?}, unexpected {:?}", report.missing_keys, report.unexpected_keys);
    if diff > 1e-5 {
        eprintln!("load_pytorch: the outputs differ by more than 1e-5");
        std::process::exit(1);
    }
    Ok(())
}
