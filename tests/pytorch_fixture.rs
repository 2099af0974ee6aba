//! A checkpoint in PyTorch's layout (`tests/fixtures/pytorch_layout`,
//! written by its `generate.py` with numpy, no Lazuli code): PyTorch's
//! names, an int64 `num_batches_tracked`, f16 and bf16 tensors. It loads
//! strictly into the same Lazuli model, and the forward output matches the
//! reference numpy computed from the stored values, to 1e-5, on the CPU
//! backend and on wgpu (with no fallback in f32).

mod common;

use lazuli::nn::{self, Module, ModuleExt};
use lazuli::{DType, Device, DeviceExt, Result, Tensor};
use std::path::PathBuf;

/// PyTorch's `body = Sequential(Conv2d(1, 4, 3, padding=1), BatchNorm2d(4),
/// ReLU(), Flatten(), Linear(64, 8), LayerNorm(8))`, `emb = Embedding(10, 8)`,
/// `forward(x, ids) = body(x) + emb(ids)`.
struct Net {
    body: nn::Sequential,
    emb: nn::Embedding,
}

impl Net {
    fn new(dev: &Device) -> Result<Net> {
        let body = nn::Sequential::new()
            .add(nn::Conv2d::builder(1, 4, 3).padding(1).build(dev)?)
            .add(nn::BatchNorm2d::new(4, dev)?)
            .add(nn::Activation::Relu)
            .add(nn::Flatten)
            .add(nn::Linear::new(64, 8, dev)?)
            .add(nn::LayerNorm::new(&[8], dev)?);
        Ok(Net { body, emb: nn::Embedding::new(10, 8, dev)? })
    }

    fn forward_with(&self, x: &Tensor, ids: &Tensor) -> Result<Tensor> {
        self.body.forward(x)?.add(&self.emb.forward(ids)?)
    }
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.body.forward(x)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("body".into(), &self.body), ("emb".into(), &self.emb)]
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pytorch_layout").join(name)
}

#[test]
fn pytorch_layout_checkpoint_loads_strictly_and_matches_numpy() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let net = Net::new(&dev).unwrap();
        let names: Vec<String> = net.state_dict().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), 12, "{names:?}");
        net.load_state_dict(fixture("model.safetensors")).unwrap();
        net.eval();
        let bn = net.state_dict().into_iter().find(|(n, _)| n == "body.1.num_batches_tracked").unwrap().1;
        assert_eq!(bn.item::<i64>().unwrap(), 37);
        assert!(net.parameters().iter().all(|p| p.dtype() == DType::F32 && p.requires_grad()));
        let reference = lazuli::serialize::load(fixture("reference.safetensors"), &dev).unwrap();
        // Lazuli's embedding gathers with i32 ids on wgpu without a fallback;
        // PyTorch's int64 ids narrow on the host.
        let ids = reference["ids"].to_vec::<i64>().unwrap();
        let ids: Vec<i32> = ids.iter().map(|&i| i32::try_from(i).unwrap()).collect();
        let ids = Tensor::from_slice(&ids, [2], &dev).unwrap();
        lazuli::metrics::reset();
        let y = net.forward_with(&reference["x"], &ids).unwrap().to_vec::<f32>().unwrap();
        let want = reference["y"].to_vec::<f32>().unwrap();
        common::assert_close(&y, &want, 0.0, 1e-5, &format!("{dev:?}: forward vs numpy"));
        assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{dev:?}: {}", lazuli::metrics::report());
    }
}

#[test]
fn pytorch_layout_checkpoint_is_refused_by_another_model() {
    let dev = Device::cpu();
    let net = Net::new(&dev).unwrap();
    // The body alone has other names ("0.weight", not "body.0.weight").
    let e = net.body.load_state_dict(fixture("model.safetensors")).unwrap_err().to_string();
    assert!(e.contains("\"0.weight\"") && e.contains("not in the file"), "{e}");
    let opts = lazuli::serialize::LoadOptions::non_strict().rename(|k| k.strip_prefix("body.").map(str::to_string));
    let report = net.body.load_state_dict_with(fixture("model.safetensors"), &opts).unwrap();
    assert_eq!(report, lazuli::serialize::LoadReport::default());
}
