//! `#[derive(Module)]`: parameters, buffers, children (fields, `Vec`s,
//! `Option`s, tuple structs, generics) and weight-decay exemptions from
//! fields; `forward` from the inherent method; train()/eval() reaching
//! every child; a derived model trains and round-trips its state dict.

mod common;

use lazuli::nn::{self, Module, ModuleExt};
use lazuli::optim::{Adam, Optimizer};
use lazuli::{DType, Device, DeviceExt, Result, Tensor};

/// A residual block with its own scale, a running counter buffer, a
/// skipped cache and plain settings.
#[derive(Module)]
struct Block {
    fc: nn::Linear,
    norm: nn::BatchNorm1d,
    drop: nn::Dropout,
    scale: Tensor,
    #[module(buffer)]
    calls: Tensor,
    #[module(skip)]
    #[allow(dead_code)] // Shows that a skipped field is left out.
    cache: Option<Tensor>,
    residual: bool,
    #[allow(dead_code)] // Shows that plain settings are left out.
    eps: f64,
}

impl Block {
    fn new(d: usize, dev: &Device) -> Result<Block> {
        Ok(Block {
            fc: nn::Linear::new(d, d, dev)?,
            norm: nn::BatchNorm1d::new(d, dev)?,
            drop: nn::Dropout::new(0.5),
            scale: Tensor::ones([d], DType::F32, dev)?.requires_grad_(true)?,
            calls: Tensor::zeros([1], DType::F32, dev)?,
            cache: None,
            residual: true,
            eps: 1e-5,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.drop.forward(&self.norm.forward(&self.fc.forward(x)?)?.relu()?)?.mul(&self.scale)?;
        if self.residual {
            h.add(x)
        } else {
            Ok(h)
        }
    }
}

/// A tuple struct: an embedding-like table exempted from weight decay.
#[derive(Module)]
struct Head(nn::Linear, #[module(no_weight_decay)] Tensor);

impl Head {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)?.add(&self.1)
    }
}

/// Generic over its head, with a list of blocks and an optional extra.
#[derive(Module)]
struct Net<H: Module> {
    blocks: Vec<Block>,
    extra: Option<nn::Linear>,
    head: H,
}

impl<H: Module> Net<H> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        if let Some(e) = &self.extra {
            h = e.forward(&h)?;
        }
        self.head.forward(&h)
    }
}

fn net(dev: &Device, extra: bool) -> Net<Head> {
    dev.manual_seed(4);
    Net {
        blocks: vec![Block::new(4, dev).unwrap(), Block::new(4, dev).unwrap()],
        extra: extra.then(|| nn::Linear::new(4, 4, dev).unwrap()),
        head: Head(nn::Linear::new(4, 3, dev).unwrap(), Tensor::zeros([3], DType::F32, dev).unwrap()),
    }
}

fn names(v: Vec<(String, Tensor)>) -> Vec<String> {
    v.into_iter().map(|(n, _)| n).collect()
}

#[test]
fn derived_walks_follow_the_fields() {
    let dev = Device::cpu();
    let m = net(&dev, true);
    let mut want = Vec::new();
    for i in 0..2 {
        for n in ["scale", "fc.weight", "fc.bias", "norm.weight", "norm.bias"] {
            want.push(format!("blocks.{i}.{n}"));
        }
    }
    want.extend(["extra.weight", "extra.bias", "head.1", "head.0.weight", "head.0.bias"].map(String::from));
    assert_eq!(names(m.named_parameters()), want);
    let buffers = names(m.named_buffers());
    assert_eq!(buffers.len(), 2 * 4, "{buffers:?}");
    assert_eq!(buffers[0], "blocks.0.calls");
    assert_eq!(buffers[1], "blocks.0.norm.running_mean");
    assert!(buffers.contains(&"blocks.1.norm.num_batches_tracked".to_string()));
    // An absent optional child is simply not there.
    assert!(!names(net(&dev, false).named_parameters()).iter().any(|n| n.starts_with("extra")));
    // Weight-decay exemptions: rank <= 1 by default, plus the marked table.
    let mut nd = m.no_weight_decay();
    nd.sort();
    assert!(nd.contains(&"head.1".to_string()) && nd.contains(&"blocks.0.scale".to_string()), "{nd:?}");
    assert!(!nd.contains(&"head.0.weight".to_string()));
}

#[test]
fn train_and_eval_reach_every_child_and_forward_is_the_inherent_one() {
    let dev = Device::cpu();
    let m = net(&dev, false);
    let x = Tensor::from_slice(&common::rand_vec(8 * 4, 2, -1.0, 1.0), [8, 4], &dev).unwrap();
    // Training: dropout draws, so two passes differ; batch norm counts.
    let a = Module::forward(&m, &x).unwrap().to_vec::<f32>().unwrap();
    let b = Module::forward(&m, &x).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a, b);
    assert_eq!(m.blocks[1].norm.num_batches_tracked.item::<i64>().unwrap(), 2);
    m.eval();
    assert!(m.blocks.iter().all(|b| !b.norm.is_training()));
    let a = Module::forward(&m, &x).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(a, Module::forward(&m, &x).unwrap().to_vec::<f32>().unwrap());
    assert_eq!(a, m.forward(&x).unwrap().to_vec::<f32>().unwrap(), "Module::forward is the inherent forward");
    assert_eq!(m.blocks[1].norm.num_batches_tracked.item::<i64>().unwrap(), 2);
    m.train();
    assert!(m.blocks.iter().all(|b| b.norm.is_training()));
}

#[test]
fn a_derived_model_trains_and_round_trips_its_state() {
    let dev = Device::cpu();
    let m = net(&dev, true);
    m.eval(); // deterministic steps
    let x = Tensor::from_slice(&common::rand_vec(8 * 4, 3, -1.0, 1.0), [8, 4], &dev).unwrap();
    let y = Tensor::from_slice(&[0i32, 1, 2, 0, 1, 2, 0, 1], [8], &dev).unwrap();
    let mut opt = Adam::new(m.parameters(), 1e-2);
    let mut losses = Vec::new();
    for _ in 0..5 {
        opt.zero_grad();
        let loss = nn::cross_entropy(&m.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        dev.mark_step().unwrap();
        losses.push(loss.item::<f32>().unwrap());
    }
    assert!(losses[4] < losses[0], "{losses:?}");
    assert!(m.blocks[0].scale.grad().is_some(), "the field parameter gets a gradient");
    let dir = std::env::temp_dir().join(format!("lazuli-derive-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("net.safetensors");
    m.save_state_dict(&path).unwrap();
    let other = net(&dev, true);
    other.load_state_dict(&path).unwrap();
    other.eval();
    assert_eq!(other.forward(&x).unwrap().to_vec::<f32>().unwrap(), m.forward(&x).unwrap().to_vec::<f32>().unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Lists of tensors: parameters and buffers named `field.i`.
#[derive(Module)]
struct Lists {
    #[module(no_weight_decay)]
    gains: Vec<Tensor>,
    #[module(buffer)]
    stats: Vec<Tensor>,
    layers: Vec<nn::Linear>,
}

impl Lists {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (l, g) in self.layers.iter().zip(&self.gains) {
            h = l.forward(&h)?.mul(g)?;
        }
        Ok(h)
    }
}

#[test]
fn tensor_lists_are_parameter_and_buffer_lists() {
    let dev = Device::cpu();
    let t = |n: usize| Tensor::ones([n, 2], DType::F32, &dev).unwrap().requires_grad_(true).unwrap();
    let m = Lists {
        gains: vec![t(1), t(1)],
        stats: vec![Tensor::zeros([2], DType::F32, &dev).unwrap()],
        layers: vec![nn::Linear::new(2, 2, &dev).unwrap(), nn::Linear::new(2, 2, &dev).unwrap()],
    };
    let params = names(m.named_parameters());
    assert_eq!(params[..2], ["gains.0", "gains.1"]);
    assert_eq!(params[2..4], ["layers.0.weight", "layers.0.bias"]);
    assert_eq!(names(m.named_buffers()), ["stats.0"]);
    let mut nd = m.no_weight_decay();
    nd.sort();
    assert_eq!(nd, ["gains.0", "gains.1", "layers.0.bias", "layers.1.bias"]);
    assert_eq!(Module::forward(&m, &Tensor::ones([1, 2], DType::F32, &dev).unwrap()).unwrap().dims(), [1, 2]);
}
