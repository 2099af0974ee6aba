//! The layers of issue 28 against PyTorch's formulas computed here in f64:
//! `RMSNorm` / `rms_norm` (default eps, affine and not), `GLU` / `glu`,
//! the LLaMA SwiGLU feed-forward block and `BatchNorm1d` / `batch_norm`
//! (`[N, C]` and `[N, C, L]`, running statistics, train and eval),
//! `AdaptiveAvgPool2d` / `AdaptiveMaxPool2d` (dividing and not) and
//! `Conv1d` / `conv1d` (stride, padding, dilation, groups, bias, init), on the CPU and on wgpu in f32 with
//! no op falling back to the host; their parameter names; their errors on
//! bad input; and their gradients against central finite differences in
//! f64 on the CPU.

mod common;

use lazuli::nn::{self, Module, ModuleExt};
use lazuli::prelude::*;
use lazuli::{no_grad, Result};

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect()
}

fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f64> {
    common::rand_vec(n, seed, lo, hi).into_iter().map(f64::from).collect()
}

#[track_caller]
fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: element {i}: got {g}, want {w}");
    }
}

/// Runs `f` on every device under the metrics lock and checks that no op
/// fell back to the host while it ran and read its results back.
fn on_devices(f: impl Fn(&Device)) {
    for dev in common::devices() {
        let _guard = common::metrics_lock();
        lazuli::metrics::reset();
        f(&dev);
        assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{dev:?}: {}", lazuli::metrics::report());
    }
}

/// PyTorch's RMSNorm over the last `d` elements of each row of `x`.
fn rms_ref(x: &[f64], d: usize, w: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps).sqrt();
        y.extend(row.iter().enumerate().map(|(i, v)| v * inv * w.map_or(1.0, |w| w[i])));
    }
    y
}

#[test]
fn rms_norm_matches_pytorch() {
    on_devices(|dev| {
        let x = vals(2 * 3 * 2 * 4, 1, -2.0, 2.0);
        let xt = Tensor::from_slice(&common::rand_vec(48, 1, -2.0, 2.0), [2, 3, 2, 4], dev).unwrap();
        // The module: normalized over [2, 4], weight of ones, eps of f32's epsilon.
        let m = nn::RmsNorm::new(&[2, 4], dev).unwrap();
        assert_eq!(m.eps, None);
        let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["weight"]);
        assert_eq!(m.no_weight_decay(), ["weight"]);
        close(&f64s(&m.forward(&xt).unwrap()), &rms_ref(&x, 8, None, f64::from(f32::EPSILON)), 1e-5, "module");
        // A learned scale and a large eps, so eps visibly matters.
        let w = vals(4, 2, 0.5, 1.5);
        let wt = Tensor::from_slice(&common::rand_vec(4, 2, 0.5, 1.5), [4], dev).unwrap();
        let y = nn::rms_norm(&xt, &[4], Some(&wt), Some(0.5)).unwrap();
        close(&f64s(&y), &rms_ref(&x, 4, Some(&w), 0.5), 1e-5, "functional with weight");
        // Without elementwise affine there is no parameter.
        let plain = nn::RmsNorm::with_options(&[4], Some(1e-3), false, dev).unwrap();
        assert!(plain.named_parameters().is_empty());
        close(&f64s(&plain.forward(&xt).unwrap()), &rms_ref(&x, 4, None, 1e-3), 1e-5, "no affine");
    });
}

#[test]
fn rms_norm_rejects_bad_shapes() {
    let dev = Device::cpu();
    let x = Tensor::zeros([2, 3], DType::F32, &dev).unwrap();
    let msg = |e: lazuli::ExecError| e.to_string();
    let e = msg(nn::rms_norm(&x, &[4], None, None).unwrap_err());
    assert!(e.contains("rms_norm") && e.contains("[2, 3]"), "{e}");
    assert!(nn::rms_norm(&x, &[2, 3, 1], None, None).is_err());
    assert!(nn::rms_norm(&x, &[], None, None).is_err());
    let w = Tensor::ones([2], DType::F32, &dev).unwrap();
    let e = msg(nn::rms_norm(&x, &[3], Some(&w), None).unwrap_err());
    assert!(e.contains("weight"), "{e}");
    let ints = Tensor::zeros([2, 3], DType::I32, &dev).unwrap();
    assert!(nn::rms_norm(&ints, &[3], None, None).is_err());
    assert!(nn::RmsNorm::new(&[], &dev).is_err());
    assert!(nn::RmsNorm::new(&[4], &dev).unwrap().forward(&x).is_err());
}

#[test]
fn glu_matches_pytorch() {
    on_devices(|dev| {
        let x = vals(2 * 4 * 3, 3, -3.0, 3.0);
        let xt = Tensor::from_slice(&common::rand_vec(24, 3, -3.0, 3.0), [2, 4, 3], dev).unwrap();
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        // Over dim 1 (size 4): a = x[:, :2], b = x[:, 2:].
        let mut want = Vec::new();
        for n in 0..2 {
            for c in 0..2 {
                for l in 0..3 {
                    let a = x[n * 12 + c * 3 + l];
                    let b = x[n * 12 + (c + 2) * 3 + l];
                    want.push(a * sig(b));
                }
            }
        }
        let y = nn::Glu::new(1).forward(&xt).unwrap();
        assert_eq!(y.dims(), &[2, 2, 3]);
        close(&f64s(&y), &want, 1e-5, "glu dim 1");
        // The default, the last dim, on an even last dim.
        let x2 = Tensor::from_slice(&common::rand_vec(12, 4, -3.0, 3.0), [3, 4], dev).unwrap();
        let v2 = vals(12, 4, -3.0, 3.0);
        let want2: Vec<f64> = (0..3)
            .flat_map(|r| (0..2).map(move |j| (r, j)))
            .map(|(r, j)| v2[r * 4 + j] * sig(v2[r * 4 + j + 2]))
            .collect();
        assert_eq!(nn::Glu::default(), nn::Glu::new(-1));
        close(&f64s(&nn::Glu::default().forward(&x2).unwrap()), &want2, 1e-5, "glu dim -1");
        close(&f64s(&nn::glu(&x2, -1).unwrap()), &want2, 1e-5, "functional glu");
    });
}

#[test]
fn glu_rejects_odd_and_missing_dims() {
    let dev = Device::cpu();
    let x = Tensor::zeros([2, 3], DType::F32, &dev).unwrap();
    let e = nn::glu(&x, -1).unwrap_err().to_string();
    assert!(e.contains("glu") && e.contains("odd") && e.contains("[2, 3]"), "{e}");
    assert!(nn::glu(&x, 2).is_err());
    assert!(nn::glu(&x, -3).is_err());
    assert!(nn::glu(&x, 0).is_ok());
}

#[test]
fn swiglu_matches_llama_feed_forward() {
    on_devices(|dev| {
        dev.manual_seed(5);
        let (d, h) = (4, 6);
        let ffn = nn::SwiGlu::new(d, h, dev).unwrap();
        let names: Vec<String> = ffn.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["w1.weight", "w2.weight", "w3.weight"]);
        assert_eq!(ffn.w1.weight.dims(), &[h, d]);
        assert_eq!(ffn.w2.weight.dims(), &[d, h]);
        assert!(ffn.w1.bias.is_none() && ffn.w2.bias.is_none() && ffn.w3.bias.is_none());
        // Linear's default: |w| <= 1 / sqrt(fan_in).
        assert!(f64s(&ffn.w1.weight).iter().all(|w| w.abs() <= 0.5));
        assert!(f64s(&ffn.w2.weight).iter().all(|w| w.abs() <= 1.0 / 6f64.sqrt()));
        let x = vals(3 * d, 6, -1.0, 1.0);
        let xt = Tensor::from_slice(&common::rand_vec(3 * d, 6, -1.0, 1.0), [3, d], dev).unwrap();
        let (w1, w2, w3) = (f64s(&ffn.w1.weight), f64s(&ffn.w2.weight), f64s(&ffn.w3.weight));
        let mut want = Vec::new();
        for r in 0..3 {
            let row = &x[r * d..(r + 1) * d];
            let dot = |w: &[f64], o: usize| (0..d).map(|i| w[o * d + i] * row[i]).sum::<f64>();
            let hid: Vec<f64> = (0..h)
                .map(|o| {
                    let g = dot(&w1, o);
                    g / (1.0 + (-g).exp()) * dot(&w3, o)
                })
                .collect();
            want.extend((0..d).map(|o| (0..h).map(|i| w2[o * h + i] * hid[i]).sum::<f64>()));
        }
        close(&f64s(&ffn.forward(&xt).unwrap()), &want, 1e-5, "swiglu");
        assert!(ffn.forward(&Tensor::zeros([3, d + 1], DType::F32, dev).unwrap()).is_err());
    });
    assert!(nn::SwiGlu::new(0, 4, &Device::cpu()).is_err());
}

type Input = (Vec<f64>, Vec<usize>);

fn leaf(dev: &Device, (v, s): &Input, grad: bool) -> Tensor {
    let t = Tensor::from_slice(v, s.clone(), dev).unwrap();
    if grad {
        t.requires_grad_(true).unwrap()
    } else {
        t
    }
}

/// `sum(out * w)` with fixed weights, so every output element matters.
fn weighted(out: &Tensor) -> Result<Tensor> {
    let out = out.cast(DType::F64)?;
    let w = vals(out.numel(), 99, 0.5, 1.5);
    out.mul(&Tensor::from_slice(&w, out.shape().clone(), out.device())?)?.sum(&[], false)
}

/// Checks `f`'s gradients w.r.t. every input against central differences
/// in f64 on the CPU (tests/gradcheck.rs's approach).
#[track_caller]
fn gradcheck(name: &str, inputs: &[Input], f: impl Fn(&Device, &[Tensor]) -> Result<Tensor>) {
    let dev = Device::cpu();
    let leaves: Vec<Tensor> = inputs.iter().map(|i| leaf(&dev, i, true)).collect();
    weighted(&f(&dev, &leaves).unwrap()).unwrap().backward().unwrap();
    let eval = |vs: &[Input]| -> f64 {
        no_grad(|| {
            let ts: Vec<Tensor> = vs.iter().map(|i| leaf(&dev, i, false)).collect();
            weighted(&f(&dev, &ts).unwrap()).unwrap().item::<f64>().unwrap()
        })
    };
    let eps = 1e-6;
    for (i, l) in leaves.iter().enumerate() {
        let g = l.grad().unwrap_or_else(|| panic!("{name}: input {i} has no gradient"));
        assert_eq!(g.shape(), l.shape(), "{name}: gradient shape of input {i}");
        let analytic = g.to_vec::<f64>().unwrap();
        let mut vs = inputs.to_vec();
        for (j, &a) in analytic.iter().enumerate() {
            let x0 = inputs[i].0[j];
            vs[i].0[j] = x0 + eps;
            let up = eval(&vs);
            vs[i].0[j] = x0 - eps;
            let down = eval(&vs);
            vs[i].0[j] = x0;
            let numeric = (up - down) / (2.0 * eps);
            assert!(
                (a - numeric).abs() <= 1e-7 + 1e-5 * numeric.abs().max(a.abs()),
                "{name}: input {i} element {j}: analytic {a}, numeric {numeric}"
            );
        }
    }
}

#[test]
fn rms_norm_glu_and_swiglu_gradients_match_finite_differences() {
    let x = (vals(2 * 3 * 4, 10, -1.5, 1.5), vec![2, 3, 4]);
    let w = (vals(4, 11, 0.5, 1.5), vec![4]);
    gradcheck("rms_norm", &[x.clone(), w.clone()], |_, t| nn::rms_norm(&t[0], &[4], Some(&t[1]), Some(1e-3)));
    let w2 = (vals(12, 12, 0.5, 1.5), vec![3, 4]);
    gradcheck("RMSNorm over two dims", &[x.clone(), w2], |_, t| {
        let m = nn::RmsNorm { normalized_shape: vec![3, 4], weight: Some(t[1].clone()), eps: None };
        m.forward(&t[0])
    });
    gradcheck("glu", std::slice::from_ref(&x), |_, t| nn::glu(&t[0], 2));
    gradcheck("GLU dim 0", std::slice::from_ref(&x), |_, t| nn::Glu::new(0).forward(&t[0]));
    let (d, h) = (4, 5);
    let p = |n, s, shape: &[usize]| (vals(n, s, -0.6, 0.6), shape.to_vec());
    let inputs = [x, p(h * d, 13, &[h, d]), p(d * h, 14, &[d, h]), p(h * d, 15, &[h, d])];
    gradcheck("SwiGLU", &inputs, |dev, t| {
        let mut ffn = nn::SwiGlu::new(d, h, dev)?;
        ffn.w1.weight = t[1].clone();
        ffn.w2.weight = t[2].clone();
        ffn.w3.weight = t[3].clone();
        ffn.forward(&t[0])
    });
}

/// PyTorch's batch norm of `x` (`[n, c, l]` row-major) with the given
/// per-channel mean and variance, scale and shift.
fn bn_ref(x: &[f64], (n, c, l): (usize, usize, usize), mean: &[f64], var: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    (0..n * c * l)
        .map(|i| {
            let ch = (i / l) % c;
            (x[i] - mean[ch]) / (var[ch] + 1e-5).sqrt() * w[ch] + b[ch]
        })
        .collect()
}

/// Per-channel mean, biased and unbiased variance of `[n, c, l]`.
fn channel_stats(x: &[f64], (n, c, l): (usize, usize, usize)) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut out = (Vec::new(), Vec::new(), Vec::new());
    for ch in 0..c {
        let v: Vec<f64> = (0..n).flat_map(|b| (0..l).map(move |i| x[(b * c + ch) * l + i])).collect();
        let m = v.iter().sum::<f64>() / v.len() as f64;
        let ss = v.iter().map(|a| (a - m).powi(2)).sum::<f64>();
        out.0.push(m);
        out.1.push(ss / v.len() as f64);
        out.2.push(ss / (v.len() - 1) as f64);
    }
    out
}

#[test]
fn batch_norm1d_trains_updates_running_stats_and_evaluates() {
    on_devices(|dev| {
        for dims in [vec![5, 3], vec![2, 3, 4]] {
            let (n, c) = (dims[0], dims[1]);
            let l = dims.get(2).copied().unwrap_or(1);
            let x = vals(n * c * l, 20, -2.0, 3.0);
            let xt = Tensor::from_slice(&common::rand_vec(n * c * l, 20, -2.0, 3.0), dims.clone(), dev).unwrap();
            let bn = nn::BatchNorm1d::new(c, dev).unwrap();
            assert!(bn.is_training());
            let names: Vec<String> = bn.state_dict().into_iter().map(|(n, _)| n).collect();
            assert_eq!(names, ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]);
            let (w, b) = ([2.0, 0.5, -1.0], [0.1, -0.3, 0.25]);
            bn.weight.assign(&Tensor::from_slice(&[2.0f32, 0.5, -1.0], [3], dev).unwrap()).unwrap();
            bn.bias.assign(&Tensor::from_slice(&[0.1f32, -0.3, 0.25], [3], dev).unwrap()).unwrap();
            let (mean, var, unbiased) = channel_stats(&x, (n, c, l));
            let y = bn.forward(&xt).unwrap();
            assert_eq!(y.dims(), &dims[..]);
            close(&f64s(&y), &bn_ref(&x, (n, c, l), &mean, &var, &w, &b), 1e-5, "training");
            // Running statistics: 0.9 * (0 or 1) + 0.1 * batch, unbiased variance.
            let rm: Vec<f64> = mean.iter().map(|m| 0.1 * m).collect();
            let rv: Vec<f64> = unbiased.iter().map(|v| 0.9 + 0.1 * v).collect();
            close(&f64s(&bn.running_mean), &rm, 1e-6, "running mean");
            close(&f64s(&bn.running_var), &rv, 1e-6, "running var");
            // Evaluation uses the running statistics and leaves them alone.
            bn.eval();
            close(&f64s(&bn.forward(&xt).unwrap()), &bn_ref(&x, (n, c, l), &rm, &rv, &w, &b), 1e-5, "eval");
            close(&f64s(&bn.running_mean), &rm, 1e-6, "running mean after eval");
            // The functional form without running statistics or affine.
            let f = nn::batch_norm(&xt, None, None, None, None, true, 0.1, 1e-5).unwrap();
            close(&f64s(&f), &bn_ref(&x, (n, c, l), &mean, &var, &[1.0; 3], &[0.0; 3]), 1e-5, "functional");
        }
    });
}

#[test]
fn batch_norm1d_rejects_bad_input() {
    let dev = Device::cpu();
    let bn = nn::BatchNorm1d::new(3, &dev).unwrap();
    let e = bn.forward(&Tensor::zeros([2, 4], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("BatchNorm1d") && e.contains("[2, 4]"), "{e}");
    assert!(bn.forward(&Tensor::zeros([2, 3, 4, 5], DType::F32, &dev).unwrap()).is_err());
    let e = bn.forward(&Tensor::zeros([1, 3], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("more than one value per channel"), "{e}");
    bn.eval();
    assert!(bn.forward(&Tensor::zeros([1, 3], DType::F32, &dev).unwrap()).is_ok());
    let x = Tensor::zeros([4, 3], DType::F32, &dev).unwrap();
    assert!(nn::batch_norm(&x, None, None, None, None, false, 0.1, 1e-5).is_err());
    let w = Tensor::ones([2], DType::F32, &dev).unwrap();
    assert!(nn::batch_norm(&x, None, None, Some(&w), None, true, 0.1, 1e-5).is_err());
}

#[test]
fn batch_norm1d_gradients_match_finite_differences() {
    let x = (vals(3 * 2 * 4, 30, -1.0, 1.0), vec![3, 2, 4]);
    let g = (vals(2, 31, 0.5, 1.5), vec![2]);
    let h = (vals(2, 32, -0.5, 0.5), vec![2]);
    gradcheck("BatchNorm1d [N, C, L] training", &[x, g.clone(), h.clone()], |dev, t| {
        let mut bn = nn::BatchNorm1d::new(2, dev)?;
        bn.weight = t[1].clone();
        bn.bias = t[2].clone();
        bn.forward(&t[0])
    });
    let x2 = (vals(5 * 2, 33, -1.0, 1.0), vec![5, 2]);
    gradcheck("BatchNorm1d [N, C] eval", &[x2.clone(), g, h], |dev, t| {
        let mut bn = nn::BatchNorm1d::new(2, dev)?;
        bn.weight = t[1].clone();
        bn.bias = t[2].clone();
        bn.running_mean = Tensor::from_slice(&[0.1f32, -0.2], [2], dev)?;
        bn.running_var = Tensor::from_slice(&[0.5f32, 1.5], [2], dev)?;
        bn.eval();
        bn.forward(&t[0])
    });
    gradcheck("batch_norm [N, C] training", &[x2], |_, t| {
        nn::batch_norm(&t[0], None, None, None, None, true, 0.1, 1e-5)
    });
}

/// PyTorch's adaptive pooling of `[nc, h, w]` to `[nc, oh, ow]`: cell `i`
/// covers `floor(i * n / m) .. ceil((i + 1) * n / m)` in each dim.
fn adaptive_ref(x: &[f64], (nc, h, w): (usize, usize, usize), (oh, ow): (usize, usize), max: bool) -> Vec<f64> {
    let range = |i: usize, n: usize, m: usize| (i * n / m)..((i + 1) * n).div_ceil(m);
    let mut y = Vec::new();
    for p in 0..nc {
        for i in 0..oh {
            for j in 0..ow {
                let cell: Vec<f64> =
                    range(i, h, oh).flat_map(|r| range(j, w, ow).map(move |c| x[(p * h + r) * w + c])).collect();
                y.push(if max {
                    cell.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                } else {
                    cell.iter().sum::<f64>() / cell.len() as f64
                });
            }
        }
    }
    y
}

#[test]
fn adaptive_pools_match_pytorch_windows() {
    on_devices(|dev| {
        for (h, w, oh, ow) in [(5, 7, 3, 4), (6, 4, 3, 2), (5, 5, 5, 2), (4, 3, 1, 1), (2, 3, 4, 5)] {
            let (n, c) = (2, 3);
            let x = vals(n * c * h * w, 40, -2.0, 2.0);
            let xt = Tensor::from_slice(&common::rand_vec(n * c * h * w, 40, -2.0, 2.0), [n, c, h, w], dev).unwrap();
            let what = format!("{h}x{w} -> {oh}x{ow}");
            let avg = nn::AdaptiveAvgPool2d::new([oh, ow]).forward(&xt).unwrap();
            assert_eq!(avg.dims(), &[n, c, oh, ow], "{what}");
            close(&f64s(&avg), &adaptive_ref(&x, (n * c, h, w), (oh, ow), false), 1e-5, &format!("avg {what}"));
            let mx = nn::AdaptiveMaxPool2d::new([oh, ow]).forward(&xt).unwrap();
            close(&f64s(&mx), &adaptive_ref(&x, (n * c, h, w), (oh, ow), true), 0.0, &format!("max {what}"));
            let f = nn::adaptive_avg_pool2d(&xt, [oh, ow]).unwrap();
            close(&f64s(&f), &f64s(&avg), 0.0, &format!("functional avg {what}"));
            let f = nn::adaptive_max_pool2d(&xt, [oh, ow]).unwrap();
            close(&f64s(&f), &f64s(&mx), 0.0, &format!("functional max {what}"));
        }
        // An unbatched [C, H, W] input, a square size.
        let xt = Tensor::from_slice(&common::rand_vec(3 * 5 * 5, 41, -1.0, 1.0), [3, 5, 5], dev).unwrap();
        let y = nn::AdaptiveAvgPool2d::new(2).forward(&xt).unwrap();
        assert_eq!(y.dims(), &[3, 2, 2]);
        close(&f64s(&y), &adaptive_ref(&vals(75, 41, -1.0, 1.0), (3, 5, 5), (2, 2), false), 1e-5, "unbatched");
    });
}

#[test]
fn adaptive_pools_reject_bad_input() {
    let dev = Device::cpu();
    let x = Tensor::zeros([2, 3, 4], DType::F32, &dev).unwrap();
    let e = nn::AdaptiveMaxPool2d::new([0, 2]).forward(&x).unwrap_err().to_string();
    assert!(e.contains("AdaptiveMaxPool2d") && e.contains("[2, 3, 4]"), "{e}");
    let e = nn::adaptive_avg_pool2d(&Tensor::zeros([4, 4], DType::F32, &dev).unwrap(), 2).unwrap_err().to_string();
    assert!(e.contains("adaptive_avg_pool2d") && e.contains("[4, 4]"), "{e}");
    assert!(nn::adaptive_max_pool2d(&Tensor::zeros([1, 2, 0, 3], DType::F32, &dev).unwrap(), 1).is_err());
}

/// Distinct values, well apart, so the maximum of every window is unique.
fn distinct(n: usize, seed: u64) -> Vec<f64> {
    let r = common::rand_vec(n, seed, 0.0, 1.0);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| r[a].total_cmp(&r[b]));
    let mut v = vec![0.0; n];
    for (rank, &i) in idx.iter().enumerate() {
        v[i] = rank as f64 * 0.25 - n as f64 * 0.125;
    }
    v
}

#[test]
fn adaptive_pool_gradients_match_finite_differences() {
    for (h, w, oh, ow) in [(5, 7, 3, 4), (6, 4, 3, 2)] {
        let x = (vals(2 * 2 * h * w, 50, -1.0, 1.0), vec![2, 2, h, w]);
        gradcheck("adaptive_avg_pool2d", &[x], |_, t| nn::adaptive_avg_pool2d(&t[0], [oh, ow]));
        let x = (distinct(2 * 2 * h * w, 51), vec![2, 2, h, w]);
        gradcheck("adaptive_max_pool2d", &[x], |_, t| nn::adaptive_max_pool2d(&t[0], [oh, ow]));
    }
}

/// PyTorch's conv1d of `x` (`[n, c, l]`) with `w` (`[o, c / g, k]`).
#[allow(clippy::too_many_arguments)] // The formula's settings, spelled out as PyTorch's arguments.
fn conv1d_ref(
    x: &[f64],
    (n, c, l): (usize, usize, usize),
    w: &[f64],
    (o, k): (usize, usize),
    b: Option<&[f64]>,
    stride: usize,
    pad: usize,
    dil: usize,
    g: usize,
) -> (Vec<f64>, usize) {
    let out_l = (l + 2 * pad - dil * (k - 1) - 1) / stride + 1;
    let (cg, og) = (c / g, o / g);
    let mut y = Vec::new();
    for bi in 0..n {
        for oc in 0..o {
            let grp = oc / og;
            for t in 0..out_l {
                let mut acc = b.map_or(0.0, |b| b[oc]);
                for ic in 0..cg {
                    for kk in 0..k {
                        let pos = (t * stride + kk * dil) as isize - pad as isize;
                        if pos >= 0 && (pos as usize) < l {
                            acc += w[(oc * cg + ic) * k + kk] * x[(bi * c + grp * cg + ic) * l + pos as usize];
                        }
                    }
                }
                y.push(acc);
            }
        }
    }
    (y, out_l)
}

#[test]
fn conv1d_matches_pytorch() {
    on_devices(|dev| {
        dev.manual_seed(8);
        let conv = nn::Conv1d::new(4, 6, 3, dev).unwrap();
        assert_eq!(conv.weight.dims(), &[6, 4, 3]);
        assert_eq!((conv.stride, conv.padding, conv.dilation, conv.groups), (1, 0, 1, 1));
        let names: Vec<String> = conv.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["weight", "bias"]);
        // PyTorch's default init, as Conv2d: |w| <= 1 / sqrt(4 * 3).
        let bound = 1.0 / 12f64.sqrt();
        assert!(f64s(&conv.weight).iter().chain(&f64s(conv.bias.as_ref().unwrap())).all(|w| w.abs() <= bound));
        let (n, c, l) = (2, 4, 9);
        let x = vals(n * c * l, 60, -1.0, 1.0);
        let xt = Tensor::from_slice(&common::rand_vec(n * c * l, 60, -1.0, 1.0), [n, c, l], dev).unwrap();
        let (w, b) = (f64s(&conv.weight), f64s(conv.bias.as_ref().unwrap()));
        let (want, ol) = conv1d_ref(&x, (n, c, l), &w, (6, 3), Some(&b), 1, 0, 1, 1);
        let y = conv.forward(&xt).unwrap();
        assert_eq!(y.dims(), &[n, 6, ol]);
        close(&f64s(&y), &want, 1e-5, "conv1d defaults");
        // An unbatched [C, L] input gives [O, L'].
        let one = conv.forward(&xt.narrow(0, 1, 1).unwrap().squeeze(&[0]).unwrap()).unwrap();
        assert_eq!(one.dims(), &[6, ol]);
        close(&f64s(&one), &want[6 * ol..], 1e-5, "unbatched");
        // Stride, padding, dilation, groups, no bias.
        let c2 =
            nn::Conv1d::builder(4, 6, 2).stride(2).padding(2).dilation(3).groups(2).bias(false).build(dev).unwrap();
        assert_eq!(c2.weight.dims(), &[6, 2, 2]);
        assert!(c2.bias.is_none());
        let (want, ol) = conv1d_ref(&x, (n, c, l), &f64s(&c2.weight), (6, 2), None, 2, 2, 3, 2);
        let y = c2.forward(&xt).unwrap();
        assert_eq!(y.dims(), &[n, 6, ol]);
        close(&f64s(&y), &want, 1e-5, "conv1d with settings");
        let f = nn::conv1d(&xt, &c2.weight, None, 2, 2, 3, 2).unwrap();
        close(&f64s(&f), &want, 1e-5, "functional conv1d");
    });
}

#[test]
fn conv1d_rejects_bad_input() {
    let dev = Device::cpu();
    assert!(nn::Conv1d::builder(3, 4, 3).groups(2).build(&dev).is_err());
    assert!(nn::Conv1d::new(3, 4, 0, &dev).is_err());
    let conv = nn::Conv1d::new(3, 4, 3, &dev).unwrap();
    let e = conv.forward(&Tensor::zeros([1, 3, 4, 5], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("conv1d") && e.contains("[1, 3, 4, 5]"), "{e}");
    assert!(conv.forward(&Tensor::zeros([1, 2, 5], DType::F32, &dev).unwrap()).is_err());
    let x = Tensor::zeros([1, 3, 5], DType::F32, &dev).unwrap();
    let bad_bias = Tensor::zeros([5], DType::F32, &dev).unwrap();
    let e = nn::conv1d(&x, &conv.weight, Some(&bad_bias), 1, 0, 1, 1).unwrap_err().to_string();
    assert!(e.contains("bias"), "{e}");
}

#[test]
fn conv1d_gradients_match_finite_differences() {
    let x = (vals(2 * 4 * 7, 70, -1.0, 1.0), vec![2, 4, 7]);
    let w = (vals(6 * 2 * 3, 71, -0.5, 0.5), vec![6, 2, 3]);
    let b = (vals(6, 72, -0.5, 0.5), vec![6]);
    gradcheck("Conv1d", &[x, w, b], |_, t| {
        let conv = nn::Conv1d {
            weight: t[1].clone(),
            bias: Some(t[2].clone()),
            stride: 2,
            padding: 1,
            dilation: 2,
            groups: 2,
        };
        conv.forward(&t[0])
    });
}
