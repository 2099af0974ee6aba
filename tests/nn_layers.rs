//! The layers of `lazuli::nn` against hand computations on the host, on
//! every backend: PyTorch's default initialization of Linear and Conv2d,
//! Conv2d (builder defaults, bias, unbatched input),
//! pooling layers, BatchNorm2d (training statistics, running-stat updates,
//! evaluation), GroupNorm, cross-entropy (leading dims, ignore_index,
//! label smoothing, reductions); nested parameter names, state dicts over
//! safetensors, weight-decay groups and AdamW over them.

mod common;

use lazuli::ir::ConvAttrs;
use lazuli::nn::{self, Module};
use lazuli::optim::{self, Adam, Optimizer, ParamGroup};
use lazuli::prelude::*;

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i}: got {g}, want {w}");
    }
}

#[test]
fn conv2d_layer_defaults_bias_and_unbatched_input() {
    for dev in common::devices() {
        dev.manual_seed(3);
        let conv = nn::Conv2d::new(2, 3, 3, &dev).unwrap();
        assert_eq!(conv.weight.dims(), &[3, 2, 3, 3]);
        assert_eq!(conv.attrs, ConvAttrs::default());
        // PyTorch's default: |w| <= 1 / sqrt(fan_in), fan_in = 2 * 3 * 3.
        let bound = 1.0 / 18.0f64.sqrt();
        assert!(f64s(&conv.weight).iter().all(|w| w.abs() <= bound));
        let x: Vec<f32> = common::rand_vec(2 * 2 * 5 * 4, 9, -1.0, 1.0);
        let xt = Tensor::from_slice(&x, [2, 2, 5, 4], &dev).unwrap();
        let y = conv.forward(&xt).unwrap();
        assert_eq!(y.dims(), &[2, 3, 3, 2]);
        let plain = xt.conv2d(&conv.weight, ConvAttrs::default()).unwrap();
        let b = f64s(conv.bias.as_ref().unwrap());
        let want: Vec<f64> = f64s(&plain).iter().enumerate().map(|(i, v)| v + b[(i / 6) % 3]).collect();
        close(&f64s(&y), &want, 1e-6, "conv + bias");
        // An unbatched [C, H, W] input gives [O, oh, ow].
        let one = conv.forward(&xt.narrow(0, 1, 1).unwrap().squeeze(&[0]).unwrap()).unwrap();
        assert_eq!(one.dims(), &[3, 3, 2]);
        close(&f64s(&one), &want[18..], 1e-6, "unbatched");
        // The builder: padding, stride, groups, no bias.
        let c = nn::Conv2d::builder(4, 6, [3, 1]).padding(1).stride(2).groups(2).bias(false).build(&dev).unwrap();
        assert_eq!(c.weight.dims(), &[6, 2, 3, 1]);
        assert!(c.bias.is_none());
        assert_eq!(c.attrs, ConvAttrs { strides: [2, 2], pads: [1, 1, 1, 1], dilations: [1, 1], groups: 2 });
        assert_eq!(c.forward(&Tensor::zeros([1, 4, 7, 7], DType::F32, &dev).unwrap()).unwrap().dims(), &[1, 6, 4, 5]);
        assert!(nn::Conv2d::builder(3, 4, 3).groups(2).build(&dev).is_err());
    }
}

/// Checks that `values` look drawn from `U(-bound, bound)`: all inside,
/// the extremes near the bound and the standard deviation `bound / sqrt(3)`
/// (so a distribution 2.45 times wider or narrower fails).
fn assert_uniform(values: &[f64], bound: f64, what: &str) {
    let n = values.len() as f64;
    let max = values.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    assert!(max <= bound, "{what}: max |w| {max} above the bound {bound}");
    assert!(max >= 0.9 * bound, "{what}: max |w| {max} far below the bound {bound}");
    let mean = values.iter().sum::<f64>() / n;
    let std = (values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n).sqrt();
    let want = bound / 3.0f64.sqrt();
    assert!((std - want).abs() <= 0.1 * want, "{what}: std {std}, want {want}");
}

#[test]
fn linear_and_conv2d_default_init_is_pytorchs() {
    for dev in common::devices() {
        dev.manual_seed(11);
        // nn.Linear.reset_parameters: weight and bias from U(+-1/sqrt(in)).
        let l = nn::Linear::new(64, 48, &dev).unwrap();
        assert_uniform(&f64s(&l.weight), 1.0 / 8.0, "Linear weight");
        assert_uniform(&f64s(l.bias.as_ref().unwrap()), 1.0 / 8.0, "Linear bias");
        // nn.Conv2d.reset_parameters: the same with fan_in = in / groups * kh * kw.
        let c = nn::Conv2d::builder(8, 64, 3).groups(2).build(&dev).unwrap();
        assert_uniform(&f64s(&c.weight), 1.0 / 6.0, "Conv2d weight");
        assert_uniform(&f64s(c.bias.as_ref().unwrap()), 1.0 / 6.0, "Conv2d bias");
        // The other initializations stay selectable.
        let k = nn::Conv2d::builder(8, 64, 3).groups(2).weight_init(nn::Init::KaimingUniform).build(&dev).unwrap();
        assert_uniform(&f64s(&k.weight), (6.0f64 / 36.0).sqrt(), "Conv2d Kaiming weight");
        let x = nn::Linear::with_init(64, 48, true, nn::Init::KaimingUniform, nn::Init::Constant(0.5), &dev).unwrap();
        assert_uniform(&f64s(&x.weight), (6.0f64 / 64.0).sqrt(), "Linear Kaiming weight");
        assert!(f64s(x.bias.as_ref().unwrap()).iter().all(|&b| b == 0.5));
    }
}

#[test]
fn pooling_layers() {
    for dev in common::devices() {
        let x: Vec<f32> = (0..16).map(|i| ((i * 7) % 16) as f32).collect();
        let xt = Tensor::from_slice(&x, [1, 1, 4, 4], &dev).unwrap();
        let m = nn::MaxPool2d::default().forward(&xt).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(m, vec![12.0, 14.0, 15.0, 13.0]);
        // PyTorch's AvgPool2d counts the padding by default.
        let a = nn::AvgPool2d::new(2).padding(1).forward(&xt).unwrap();
        assert_eq!(a.dims(), &[1, 1, 3, 3]);
        assert_eq!(a.to_vec::<f32>().unwrap()[0], x[0] / 4.0);
        let a = nn::AvgPool2d::new(2).padding(1).count_include_pad(false).forward(&xt).unwrap();
        assert_eq!(a.to_vec::<f32>().unwrap()[0], x[0]);
        let c = nn::MaxPool2d::new(3).stride(2).ceil_mode(true).forward(&xt).unwrap();
        assert_eq!(c.dims(), &[1, 1, 2, 2]);
        assert!(nn::MaxPool2d::new(2).forward(&Tensor::zeros([4, 4], DType::F32, &dev).unwrap()).is_err());
    }
}

#[test]
fn batch_norm_training_statistics_running_updates_and_eval() {
    for dev in common::devices() {
        let (n, c, hw) = (3, 2, 4);
        let x: Vec<f32> = common::rand_vec(n * c * hw, 21, -2.0, 3.0);
        let xt = Tensor::from_slice(&x, [n, c, 2, 2], &dev).unwrap();
        let bn = nn::BatchNorm2d::new(c, &dev).unwrap();
        bn.weight.assign(&Tensor::from_slice(&[2.0f32, 0.5], [2], &dev).unwrap()).unwrap();
        bn.bias.assign(&Tensor::from_slice(&[0.1f32, -0.3], [2], &dev).unwrap()).unwrap();
        let xs = &x;
        let stats = |ch: usize| {
            let v: Vec<f64> = (0..n).flat_map(|b| (0..hw).map(move |i| xs[(b * c + ch) * hw + i] as f64)).collect();
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let var = v.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / v.len() as f64;
            (mean, var)
        };
        let y = f64s(&bn.forward(&xt).unwrap());
        let (w, b) = ([2.0, 0.5], [0.1, -0.3]);
        let want: Vec<f64> = (0..x.len())
            .map(|i| {
                let ch = (i / hw) % c;
                let (m, v) = stats(ch);
                (x[i] as f64 - m) / (v + 1e-5).sqrt() * w[ch] + b[ch]
            })
            .collect();
        close(&y, &want, 1e-5, "batch norm training");
        dev.mark_step().unwrap();
        let cnt = (n * hw) as f64;
        let rm: Vec<f64> = (0..c).map(|ch| 0.1 * stats(ch).0).collect();
        let rv: Vec<f64> = (0..c).map(|ch| 0.9 + 0.1 * stats(ch).1 * cnt / (cnt - 1.0)).collect();
        close(&f64s(&bn.running_mean), &rm, 1e-6, "running mean");
        close(&f64s(&bn.running_var), &rv, 1e-6, "running var");
        let names: Vec<String> = bn.state_dict().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]);
        assert_eq!(bn.num_batches_tracked.item::<i64>().unwrap(), 1, "one training forward");
        // Evaluation uses the running statistics and updates nothing.
        bn.eval();
        assert!(!bn.is_training());
        let y = f64s(&bn.forward(&xt).unwrap());
        let want: Vec<f64> = (0..x.len())
            .map(|i| {
                let ch = (i / hw) % c;
                (x[i] as f64 - rm[ch]) / (rv[ch] + 1e-5).sqrt() * w[ch] + b[ch]
            })
            .collect();
        close(&y, &want, 1e-5, "batch norm eval");
        dev.mark_step().unwrap();
        close(&f64s(&bn.running_mean), &rm, 1e-6, "running mean after eval");
        bn.train();
        let e = bn.forward(&Tensor::zeros([1, 2, 1, 1], DType::F32, &dev).unwrap()).unwrap_err().to_string();
        assert!(e.contains("more than one value"), "{e}");
    }
}

#[test]
fn group_norm_matches_hand_computation() {
    for dev in common::devices() {
        let (n, c, hw, g) = (2, 6, 3, 3);
        let x: Vec<f32> = common::rand_vec(n * c * hw, 31, -1.0, 2.0);
        let gn = nn::GroupNorm::new(g, c, &dev).unwrap();
        let y = f64s(&gn.forward(&Tensor::from_slice(&x, [n, c, 3], &dev).unwrap()).unwrap());
        let per = c / g * hw;
        let want: Vec<f64> = (0..x.len())
            .map(|i| {
                let grp = i / per;
                let v: Vec<f64> = x[grp * per..(grp + 1) * per].iter().map(|&a| a as f64).collect();
                let m = v.iter().sum::<f64>() / per as f64;
                let var = v.iter().map(|a| (a - m).powi(2)).sum::<f64>() / per as f64;
                (x[i] as f64 - m) / (var + 1e-5).sqrt()
            })
            .collect();
        close(&y, &want, 1e-5, "group norm");
        assert!(nn::GroupNorm::new(4, 6, &dev).is_err());
    }
}

#[test]
fn cross_entropy_over_leading_dims_with_ignore_index_and_smoothing() {
    for dev in common::devices() {
        let (b, t, k) = (2, 3, 4);
        let logits: Vec<f32> = common::rand_vec(b * t * k, 41, -2.0, 2.0);
        let labels = [3i32, -100, 0, 1, 1, 2];
        let lt = Tensor::from_slice(&logits, [b, t, k], &dev).unwrap();
        let yt = Tensor::from_slice(&labels, [b, t], &dev).unwrap();
        let per = |eps: f64| -> Vec<f64> {
            (0..b * t)
                .map(|r| {
                    let row: Vec<f64> = logits[r * k..(r + 1) * k].iter().map(|&v| v as f64).collect();
                    let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
                    if labels[r] < 0 {
                        return 0.0;
                    }
                    let nll = lse - row[labels[r] as usize];
                    let smooth = row.iter().map(|v| lse - v).sum::<f64>() / k as f64;
                    (1.0 - eps) * nll + eps * smooth
                })
                .collect()
        };
        let opts = |eps: f64, reduction: nn::Reduction| nn::CrossEntropyOptions {
            ignore_index: Some(-100),
            label_smoothing: eps,
            reduction,
        };
        for eps in [0.0, 0.2] {
            let p = per(eps);
            let mean = nn::cross_entropy_with(&lt, &yt, &opts(eps, nn::Reduction::Mean)).unwrap();
            close(&f64s(&mean), &[p.iter().sum::<f64>() / 5.0], 1e-5, "mean over the 5 counted");
            let sum = nn::cross_entropy_with(&lt, &yt, &opts(eps, nn::Reduction::Sum)).unwrap();
            close(&f64s(&sum), &[p.iter().sum::<f64>()], 1e-5, "sum");
            let none = nn::cross_entropy_with(&lt, &yt, &opts(eps, nn::Reduction::None)).unwrap();
            assert_eq!(none.dims(), &[b, t]);
            close(&f64s(&none), &p, 1e-5, "per element");
        }
        // Without ignore_index every element counts: the 2-d case of old.
        let flat = nn::cross_entropy(
            &lt.reshape([6, 4]).unwrap(),
            &yt.reshape([6]).unwrap().abs().unwrap().minimum_scalar(3).unwrap(),
        );
        assert!(flat.is_ok());
        let e = nn::cross_entropy(&lt, &Tensor::from_slice(&[0i32; 3], [3], &dev).unwrap()).unwrap_err().to_string();
        assert!(e.contains("cross_entropy") && e.contains("[2, 3, 4]") && e.contains("[3]"), "{e}");
        let bad = nn::CrossEntropyOptions { label_smoothing: 1.5, ..Default::default() };
        assert!(nn::cross_entropy_with(&lt, &yt, &bad).is_err());
    }
}

/// A model with nested modules: names are joined with dots through
/// every level, buffers included in the state dict.
struct Net {
    features: nn::Sequential,
    head: nn::Linear,
    emb: nn::Embedding,
}

impl Module for Net {
    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        self.head.forward(&self.features.forward(x)?.flatten(1, -1)?)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("features".into(), &self.features as &dyn Module), ("head".into(), &self.head), ("emb".into(), &self.emb)]
    }
}

/// The first layer of [`Net`] alone, under the same name.
struct Part(nn::Sequential);

impl Module for Part {
    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        self.0.forward(x)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("features".into(), &self.0 as &dyn Module)]
    }
}

fn net(dev: &Device) -> Net {
    Net {
        features: nn::Sequential::new()
            .add(nn::Conv2d::builder(1, 2, 3).padding(1).build(dev).unwrap())
            .add(nn::BatchNorm2d::new(2, dev).unwrap())
            .add(nn::Sequential::new().add(nn::Activation::Relu).add(nn::MaxPool2d::new(2)))
            .add(nn::Dropout::new(0.5)),
        head: nn::Linear::new(8, 3, dev).unwrap(),
        emb: nn::Embedding::new(5, 2, dev).unwrap(),
    }
}

#[test]
fn nested_names_modes_and_state_dict_round_trip() {
    let dev = Device::cpu();
    dev.manual_seed(1);
    let m = net(&dev);
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "features.0.weight",
            "features.0.bias",
            "features.1.weight",
            "features.1.bias",
            "head.weight",
            "head.bias",
            "emb.weight"
        ]
    );
    let buffers: Vec<String> = m.named_buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(buffers, ["features.1.running_mean", "features.1.running_var", "features.1.num_batches_tracked"]);
    let mut no_decay = m.no_weight_decay();
    no_decay.sort();
    assert_eq!(no_decay, ["emb.weight", "features.0.bias", "features.1.bias", "features.1.weight", "head.bias"]);
    // eval() reaches the dropout inside the sequence: two passes agree.
    m.eval();
    let x = Tensor::from_slice(&common::rand_vec(2 * 16, 3, -1.0, 1.0), [2, 1, 4, 4], &dev).unwrap();
    let y0 = m.forward(&x).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(y0, m.forward(&x).unwrap().to_vec::<f32>().unwrap());
    // Save, load into a freshly drawn model, and get the same outputs.
    let dir = std::env::temp_dir().join(format!("lazuli-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("net.safetensors");
    m.save_state_dict(&path).unwrap();
    dev.manual_seed(2);
    let other = net(&dev);
    other.eval();
    assert_ne!(other.forward(&x).unwrap().to_vec::<f32>().unwrap(), y0);
    let params_before: Vec<u64> = other.parameters().iter().map(|p| p.id()).collect();
    other.load_state_dict(&path).unwrap();
    assert_eq!(other.forward(&x).unwrap().to_vec::<f32>().unwrap(), y0);
    assert_eq!(other.parameters().iter().map(|p| p.id()).collect::<Vec<_>>(), params_before);
    assert!(other.parameters().iter().all(|p| p.requires_grad()));
    // Strict: a checkpoint of another model is refused, naming the tensor.
    let small = Part(nn::Sequential::new().add(nn::Conv2d::builder(1, 2, 3).padding(1).build(&dev).unwrap()));
    let before = small.parameters()[0].to_vec::<f32>().unwrap();
    let e = small.load_state_dict(&path).unwrap_err().to_string();
    assert!(e.contains("emb.weight") && e.contains("not in the model"), "{e}");
    // Nothing was assigned by the failed load.
    assert_eq!(small.parameters()[0].to_vec::<f32>().unwrap(), before);
    small.save_state_dict(&path).unwrap();
    let e = other.load_state_dict(&path).unwrap_err().to_string();
    assert!(e.contains("features.1.weight") && e.contains("not in the file"), "{e}");
    // A missing file converts into the crate's error with `?`.
    let f = || -> lazuli::Result<()> { m.load_state_dict(dir.join("missing.safetensors")) };
    let e = f().unwrap_err();
    assert!(matches!(e, lazuli::ExecError::External { .. }), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn adamw_groups_skip_decay_on_biases_norms_and_embeddings() {
    let dev = Device::cpu();
    dev.manual_seed(4);
    let m = net(&dev);
    let groups = optim::decay_groups(&m, 0.5);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].params.len(), 2, "conv and linear weights decay");
    assert_eq!(groups[1].params.len(), 5);
    assert_eq!(groups[1].weight_decay, Some(0.0));
    // Hand computation: AdamW over a decayed and an exempt parameter with
    // the same gradient; only the first shrinks.
    let a = Tensor::from_slice(&[1.0f32, -2.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    let b = Tensor::from_slice(&[1.0f32, -2.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    let mut opt =
        Adam::adamw_groups(vec![ParamGroup::new(vec![a.clone()], 0.5), ParamGroup::new(vec![b.clone()], 0.0)], 0.1);
    let (mut wa, mut wb) = ([1.0f64, -2.0], [1.0f64, -2.0]);
    let (mut ma, mut va, mut mb, mut vb) = ([0.0f64; 2], [0.0f64; 2], [0.0f64; 2], [0.0f64; 2]);
    for t in 1..=3 {
        opt.zero_grad();
        a.mul(&a)
            .unwrap()
            .sum(&[], false)
            .unwrap()
            .add(&b.mul(&b).unwrap().sum(&[], false).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
        dev.mark_step().unwrap();
        let step = |w: &mut [f64; 2], m: &mut [f64; 2], v: &mut [f64; 2], wd: f64| {
            for i in 0..2 {
                let g = 2.0 * w[i];
                m[i] = 0.9 * m[i] + 0.1 * g;
                v[i] = 0.999 * v[i] + 0.001 * g * g;
                let mh = m[i] / (1.0 - 0.9f64.powi(t));
                let vh = v[i] / (1.0 - 0.999f64.powi(t));
                w[i] = w[i] * (1.0 - 0.1 * wd) - 0.1 * mh / (vh.sqrt() + 1e-8);
            }
        };
        step(&mut wa, &mut ma, &mut va, 0.5);
        step(&mut wb, &mut mb, &mut vb, 0.0);
    }
    common::assert_close(&a.to_vec::<f32>().unwrap(), &[wa[0] as f32, wa[1] as f32], 1e-5, 1e-6, "decayed");
    common::assert_close(&b.to_vec::<f32>().unwrap(), &[wb[0] as f32, wb[1] as f32], 1e-5, 1e-6, "exempt");
    assert_ne!(wa, wb);
}

/// The bench's GPT lists its blocks as children, so every walk sees the
/// same tree: parameter names, weight-decay exemptions (biases, norms,
/// embeddings) and the state dict agree.
#[test]
fn bench_gpt_walks_agree_on_its_tree() {
    let dev = Device::cpu();
    dev.manual_seed(4);
    let sizes = lazuli::bench::GptSizes::TINY;
    let model = lazuli::bench::GptModel::new(sizes, &dev).unwrap();
    let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), sizes.parameter_tensors());
    assert_eq!(&names[..4], ["wte.weight", "wpe.weight", "blocks.0.ln1.weight", "blocks.0.ln1.bias"]);
    assert_eq!(&names[names.len() - 2..], ["lnf.weight", "lnf.bias"]);
    let mut no_decay = model.no_weight_decay();
    no_decay.sort();
    let mut want: Vec<String> =
        names.iter().filter(|n| !n.ends_with("qkv.weight") && !n.ends_with("proj.weight")).cloned().collect();
    want.retain(|n| !n.ends_with("fc.weight") && !n.ends_with("out.weight"));
    want.sort();
    assert_eq!(no_decay, want, "every parameter but the linears' weights skips weight decay");
    // The embeddings (rank 2) are exempt only through the walk.
    let groups = optim::decay_groups(&model, 0.1);
    let lens: Vec<(usize, Option<f64>)> = groups.iter().map(|g| (g.params.len(), g.weight_decay)).collect();
    assert_eq!(lens, [(4 * sizes.layers, Some(0.1)), (names.len() - 4 * sizes.layers, Some(0.0))]);
    let state: Vec<String> = model.state_dict().into_iter().map(|(n, _)| n).collect();
    assert_eq!(state, names, "no buffers");
}

/// Parameters are data: the first sync on a device computes a model's
/// initialization once, so an inference loop runs the model's ops only,
/// never an initializer again.
#[test]
fn inference_runs_no_initializer_after_the_first_sync() {
    for dev in common::devices() {
        let model = nn::Sequential::new()
            .add(nn::Linear::new(4, 8, &dev).unwrap())
            .add(nn::Activation::Relu)
            .add(nn::LayerNorm::new(&[8], &dev).unwrap())
            .add(nn::Linear::new(8, 3, &dev).unwrap());
        model.eval();
        let x = Tensor::from_slice(&[0.5f32; 8], [2, 4], &dev).unwrap();
        let first = lazuli::no_grad(|| model.forward(&x)).unwrap().to_vec::<f32>().unwrap();
        for (name, p) in model.state_dict() {
            assert_eq!(p.state(), TensorState::DeviceData, "{}: {name} was materialized", dev.name());
        }
        // The model again from host data: the kernels a forward needs.
        let same = nn::Sequential::new()
            .add(nn::Linear::new(4, 8, &dev).unwrap())
            .add(nn::Activation::Relu)
            .add(nn::LayerNorm::new(&[8], &dev).unwrap())
            .add(nn::Linear::new(8, 3, &dev).unwrap());
        same.load_state_dict_from(&model.state_dict()).unwrap();
        same.materialize().unwrap();
        // Each forward: no initializer in its graph, and the kernels of the
        // model's ops only (the same plan as the data-built model's).
        let kernels = |m: &nn::Sequential| {
            let y = lazuli::no_grad(|| m.forward(&x)).unwrap();
            let ir = lazuli::debug::ir_text(&[&y]);
            assert!(!ir.contains("rand"), "{}: no initializer in an inference forward:\n{ir}", dev.name());
            let kernels: Vec<String> =
                lazuli::debug::backend_code(&[&y]).unwrap().into_iter().map(|(name, _)| name).collect();
            let hash = lazuli::debug::graph_hash(&[&y]);
            (y.to_vec::<f32>().unwrap(), hash, kernels)
        };
        for _ in 0..3 {
            let (v, hash, names) = kernels(&model);
            let (w, same_hash, same_names) = kernels(&same);
            assert_eq!(v, first, "{}", dev.name());
            assert_eq!(w, first, "{}", dev.name());
            assert_eq!((hash, &names), (same_hash, &same_names), "{}: the model's kernels only", dev.name());
            assert!(names.iter().all(|k| !k.contains("Random")), "{}: {names:?}", dev.name());
        }
    }
}
