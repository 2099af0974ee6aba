//! `ConvTranspose2d`, `RotaryEmbedding`, `Lstm`, `Gru` and
//! `TransformerBlock`: values against naive references computed here (on
//! the CPU and on wgpu, with no fallback op in f32), gradients against
//! central finite differences in f64 on the CPU, PyTorch's parameter
//! names, and errors naming the layer and the caller.

mod common;

use lazuli::nn::{
    conv_transpose1d, conv_transpose2d, layer_norm, scaled_dot_product_attention_unfused, AttentionOptions,
    ConvTranspose1d, ConvTranspose2d, ConvTranspose2dAttrs, Gru, Lstm, RnnOptions, RotaryEmbedding, TransformerBlock,
};
use lazuli::prelude::*;
use lazuli::{no_grad, Result};

fn t32(dev: &Device, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape.to_vec(), dev).unwrap()
}

/// The values as f64, read in the tensor's own dtype (f32 or f64).
fn f64s(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F64 => t.to_vec::<f64>().unwrap(),
        _ => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
    }
}

fn vals(n: usize, seed: u64) -> Vec<f32> {
    common::rand_vec(n, seed, -1.0, 1.0)
}

/// Asserts that `f` ran on `dev` with no op falling back to the CPU.
#[track_caller]
fn no_fallback(what: &str, dev: &Device) {
    assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{what} on {}: {}", dev.name(), lazuli::metrics::report());
}

/// `sum(f(inputs) * w)`'s gradient in input `wrt` against central
/// differences, in f64 on the CPU.
#[track_caller]
fn gradcheck(
    dev: &Device,
    name: &str,
    inputs: &[(Vec<f64>, Vec<usize>)],
    wrt: usize,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let loss = |x: &[f64]| -> Result<(Tensor, Tensor)> {
        let leaf = Tensor::from_slice(x, inputs[wrt].1.clone(), dev)?.requires_grad_(true)?;
        let ts: Vec<Tensor> = inputs
            .iter()
            .enumerate()
            .map(|(i, (v, s))| if i == wrt { Ok(leaf.clone()) } else { Tensor::from_slice(v, s.clone(), dev) })
            .collect::<Result<_>>()?;
        let out = f(&ts)?;
        let w: Vec<f64> = (0..out.numel()).map(|i| 0.5 + 0.37 * ((i * 7) % 5) as f64).collect();
        Ok((out.mul(&Tensor::from_slice(&w, out.shape().clone(), dev)?)?.sum(&[], false)?, leaf))
    };
    let x = &inputs[wrt].0;
    let (l, leaf) = loss(x).unwrap();
    l.backward().unwrap();
    let analytic = leaf.grad().map(|g| g.to_vec::<f64>().unwrap()).unwrap_or_else(|| vec![0.0; x.len()]);
    for (j, &a) in analytic.iter().enumerate() {
        let mut v = x.clone();
        v[j] += 1e-6;
        let up = no_grad(|| loss(&v).unwrap().0.item::<f64>().unwrap());
        v[j] -= 2e-6;
        let down = no_grad(|| loss(&v).unwrap().0.item::<f64>().unwrap());
        let numeric = (up - down) / 2e-6;
        assert!(
            (a - numeric).abs() <= 1e-5 + 1e-4 * numeric.abs(),
            "{name}: element {j}: analytic {a}, numeric {numeric}"
        );
    }
}

// ---- ConvTranspose2d ----

/// The transposed convolution by scattering every input element.
fn conv_t_ref(x: &[f32], xd: [usize; 4], w: &[f32], wd: [usize; 4], b: &[f32], a: &ConvTranspose2dAttrs) -> Vec<f32> {
    let [n, cin, h, wi] = xd;
    let [_, cog, kh, kw] = wd;
    let g = a.groups;
    let cout = cog * g;
    let out = |i: usize, len: usize, k: usize| {
        (len - 1) * a.stride[i] + a.dilation[i] * (k - 1) + a.output_padding[i] + 1 - 2 * a.padding[i]
    };
    let (ho, wo) = (out(0, h, kh), out(1, wi, kw));
    let mut y = vec![0.0f64; n * cout * ho * wo];
    for (e, v) in y.iter_mut().enumerate() {
        *v = b[(e / (ho * wo)) % cout] as f64;
    }
    for ni in 0..n {
        for ic in 0..cin {
            let grp = ic / (cin / g);
            for ih in 0..h {
                for iw in 0..wi {
                    let xv = x[((ni * cin + ic) * h + ih) * wi + iw] as f64;
                    for ol in 0..cog {
                        for ki in 0..kh {
                            for kj in 0..kw {
                                let oh = (ih * a.stride[0] + ki * a.dilation[0]) as i64 - a.padding[0] as i64;
                                let ow = (iw * a.stride[1] + kj * a.dilation[1]) as i64 - a.padding[1] as i64;
                                if oh < 0 || ow < 0 || oh >= ho as i64 || ow >= wo as i64 {
                                    continue;
                                }
                                let oc = grp * cog + ol;
                                let wv = w[((ic * cog + ol) * kh + ki) * kw + kj] as f64;
                                y[((ni * cout + oc) * ho + oh as usize) * wo + ow as usize] += xv * wv;
                            }
                        }
                    }
                }
            }
        }
    }
    y.into_iter().map(|v| v as f32).collect()
}

fn conv_t_cases() -> Vec<(ConvTranspose2dAttrs, [usize; 4], [usize; 4])> {
    let a = |stride, padding, output_padding, dilation, groups| ConvTranspose2dAttrs {
        stride,
        padding,
        output_padding,
        dilation,
        groups,
    };
    vec![
        (a([1, 1], [0, 0], [0, 0], [1, 1], 1), [2, 3, 4, 5], [3, 2, 3, 3]),
        (a([2, 2], [1, 1], [1, 1], [1, 1], 1), [1, 2, 3, 4], [2, 3, 3, 3]),
        (a([3, 2], [2, 0], [1, 0], [2, 1], 2), [1, 4, 3, 3], [4, 1, 2, 3]),
        (a([2, 1], [2, 1], [0, 0], [1, 1], 1), [2, 2, 4, 3], [2, 2, 2, 2]),
    ]
}

#[test]
fn conv_transpose2d_matches_a_scatter_reference() {
    let _lock = common::metrics_lock();
    for (i, (attrs, xd, wd)) in conv_t_cases().into_iter().enumerate() {
        let (x, w) = (vals(xd.iter().product(), 1 + i as u64), vals(wd.iter().product(), 2 + i as u64));
        let b = vals(wd[1] * attrs.groups, 3);
        let want = conv_t_ref(&x, xd, &w, wd, &b, &attrs);
        for dev in common::devices() {
            lazuli::metrics::reset();
            let y =
                conv_transpose2d(&t32(&dev, &x, &xd), &t32(&dev, &w, &wd), Some(&t32(&dev, &b, &[b.len()])), &attrs)
                    .unwrap();
            common::assert_close(
                &y.to_vec::<f32>().unwrap(),
                &want,
                1e-5,
                1e-5,
                &format!("case {i} on {}", dev.name()),
            );
            no_fallback("conv_transpose2d", &dev);
        }
    }
    // The layer: PyTorch's weight layout and output size.
    let dev = Device::cpu();
    let layer = ConvTranspose2d::builder(4, 6, 3).stride(2).padding(1).output_padding(1).groups(2).build(&dev).unwrap();
    assert_eq!(layer.weight.dims(), &[4, 3, 3, 3]);
    let names: Vec<String> = layer.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias"]);
    let y = layer.forward(&Tensor::zeros([4, 5, 7], DType::F32, &dev).unwrap()).unwrap();
    assert_eq!(y.dims(), &[6, 10, 14], "unbatched input, (5 - 1) * 2 - 2 + 2 + 1 + 1");
}

#[test]
fn conv_transpose2d_gradients_and_errors() {
    let dev = Device::cpu();
    for (attrs, xd, wd) in conv_t_cases().into_iter().skip(1) {
        let inputs = vec![
            (vals(xd.iter().product(), 4).into_iter().map(f64::from).collect(), xd.to_vec()),
            (vals(wd.iter().product(), 5).into_iter().map(f64::from).collect(), wd.to_vec()),
        ];
        for wrt in 0..2 {
            gradcheck(&dev, "conv_transpose2d", &inputs, wrt, |t| conv_transpose2d(&t[0], &t[1], None, &attrs));
        }
    }
    let err = ConvTranspose2d::builder(3, 4, 3).groups(2).build(&dev).unwrap_err().to_string();
    assert!(err.contains("ConvTranspose2d") && err.contains("nn_blocks.rs"), "{err}");
    let err = ConvTranspose2d::builder(2, 2, 3).stride(2).output_padding(2).build(&dev).unwrap_err().to_string();
    assert!(err.contains("output_padding"), "{err}");
    let layer = ConvTranspose2d::new(2, 2, 3, &dev).unwrap();
    let err = layer.forward(&Tensor::zeros([1, 3, 4, 4], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(err.contains("conv_transpose2d") && err.contains("[1, 3, 4, 4]"), "{err}");
}

#[test]
fn conv_transpose1d_is_the_2d_layer_over_a_height_of_one() {
    let _lock = common::metrics_lock();
    let attrs =
        ConvTranspose2dAttrs { stride: [1, 3], padding: [0, 1], output_padding: [0, 2], dilation: [1, 2], groups: 2 };
    let (xd, wd) = ([2, 4, 1, 5], [4, 3, 1, 3]);
    let (x, w, b) = (vals(40, 51), vals(36, 52), vals(6, 53));
    let want = conv_t_ref(&x, xd, &w, wd, &b, &attrs);
    for dev in common::devices() {
        lazuli::metrics::reset();
        let y = conv_transpose1d(
            &t32(&dev, &x, &[2, 4, 5]),
            &t32(&dev, &w, &[4, 3, 3]),
            Some(&t32(&dev, &b, &[6])),
            &attrs,
        )
        .unwrap();
        assert_eq!(y.dims(), &[2, 6, (5 - 1) * 3 - 2 + 2 * 2 + 2 + 1]);
        common::assert_close(
            &y.to_vec::<f32>().unwrap(),
            &want,
            1e-5,
            1e-5,
            &format!("conv_transpose1d on {}", dev.name()),
        );
        no_fallback("conv_transpose1d", &dev);
    }
    let dev = Device::cpu();
    let layer = ConvTranspose1d::builder(4, 6, 3).stride(2).padding(1).output_padding(1).groups(2).build(&dev).unwrap();
    assert_eq!(layer.weight.dims(), &[4, 3, 3]);
    assert!(layer.weight.requires_grad());
    assert_eq!(layer.forward(&Tensor::zeros([4, 5], DType::F32, &dev).unwrap()).unwrap().dims(), &[6, 10]);
    let inputs = vec![
        (vals(8, 54).into_iter().map(f64::from).collect(), vec![1, 2, 4]),
        (vals(12, 55).into_iter().map(f64::from).collect(), vec![2, 2, 3]),
    ];
    let a = ConvTranspose2dAttrs { stride: [1, 2], padding: [0, 1], ..Default::default() };
    for wrt in 0..2 {
        gradcheck(&dev, "conv_transpose1d", &inputs, wrt, |t| conv_transpose1d(&t[0], &t[1], None, &a));
    }
    let err = layer.forward(&Tensor::zeros([4, 5, 1, 1], DType::F32, &dev).unwrap()).unwrap_err().to_string();
    assert!(err.contains("conv_transpose1d") && err.contains("nn_blocks.rs"), "{err}");
}

// ---- RotaryEmbedding ----

fn rope_ref(x: &[f32], t: usize, f: usize, dim: usize, offset: usize, interleaved: bool) -> Vec<f32> {
    let half = dim / 2;
    let mut y = x.to_vec();
    for (r, row) in x.chunks(f).enumerate() {
        let pos = (offset + r % t) as f64;
        for i in 0..half {
            let inv = (1.0 / 10000f64.powf((2 * i) as f64 / dim as f64)) as f32 as f64;
            let (c, s) = ((pos * inv).cos(), (pos * inv).sin());
            let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            let (xa, xb) = (row[a] as f64, row[b] as f64);
            y[r * f + a] = (xa * c - xb * s) as f32;
            y[r * f + b] = (xb * c + xa * s) as f32;
        }
    }
    y
}

#[test]
fn rotary_embedding_matches_the_reference_both_conventions() {
    let _lock = common::metrics_lock();
    let (b, h, t, f) = (2, 2, 5, 8);
    let x = vals(b * h * t * f, 7);
    for (dim, offset, interleaved) in [(8, 0, false), (8, 11, false), (6, 3, false), (8, 4, true), (4, 0, true)] {
        let want = rope_ref(&x, t, f, dim, offset, interleaved);
        for dev in common::devices() {
            lazuli::metrics::reset();
            let rope = RotaryEmbedding::new(dim, 10000.0).unwrap().interleaved(interleaved);
            let y = rope.apply(&t32(&dev, &x, &[b, h, t, f]), offset).unwrap();
            let what = format!("rope dim {dim} offset {offset} interleaved {interleaved} on {}", dev.name());
            common::assert_close(&y.to_vec::<f32>().unwrap(), &want, 1e-5, 1e-5, &what);
            no_fallback(&what, &dev);
        }
    }
    // Scores of rotated queries and keys depend on relative positions only.
    let dev = Device::cpu();
    let rope = RotaryEmbedding::new(8, 10000.0).unwrap();
    let (q, k) = (t32(&dev, &vals(8, 1), &[1, 8]), t32(&dev, &vals(8, 2), &[1, 8]));
    let score = |pq: usize, pk: usize| -> f32 {
        let a = rope.apply(&q, pq).unwrap();
        let b = rope.apply(&k, pk).unwrap();
        a.mul(&b).unwrap().sum(&[], false).unwrap().item::<f32>().unwrap()
    };
    assert!((score(3, 1) - score(10, 8)).abs() < 1e-5);
    let inputs = vec![(vals(2 * 3 * 6, 9).into_iter().map(f64::from).collect(), vec![2, 3, 6])];
    for interleaved in [false, true] {
        gradcheck(&dev, "rope", &inputs, 0, |t| {
            RotaryEmbedding::new(4, 10000.0)?.interleaved(interleaved).apply(&t[0], 2)
        });
    }
    let err = RotaryEmbedding::new(8, 10000.0).unwrap().apply(&Tensor::zeros([3, 6], DType::F32, &dev).unwrap(), 0);
    let err = err.unwrap_err().to_string();
    assert!(err.contains("RotaryEmbedding") && err.contains("[3, 6]") && err.contains("nn_blocks.rs"), "{err}");
    assert!(RotaryEmbedding::new(7, 10000.0).is_err());
}

/// Generation steps at new offsets replay one plan: the offset is a lifted
/// scalar, never baked into the graph.
#[test]
fn rotary_offsets_compile_once() {
    for dev in common::devices() {
        let rope = RotaryEmbedding::new(8, 10000.0).unwrap();
        let x = t32(&dev, &vals(2 * 8, 3), &[1, 2, 8]);
        let run = |offset: usize| rope.apply(&x, offset).unwrap().to_vec::<f32>().unwrap();
        run(5);
        let (uncached, _) = dev.compile_counts();
        let (a, b) = (run(9), run(1234));
        assert_eq!(dev.compile_counts().0, uncached, "a new offset compiled on {}", dev.name());
        assert_ne!(a, b);
    }
}

// ---- LSTM / GRU ----

/// One layer's `weight_ih`, `weight_hh`, `bias_ih` and `bias_hh`.
type LayerParams = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// A multi-layer LSTM (`gates` 4) or GRU (3) over time-major `[t, n, i]`,
/// with PyTorch's equations, `dirs` directions per layer (cells in
/// PyTorch's order); returns the outputs, the final h and c.
#[allow(clippy::too_many_arguments)] // The reference spells out every input.
fn rnn_ref(
    lstm: bool,
    x: &[f64],
    (t, n, input): (usize, usize, usize),
    cells: &[LayerParams],
    h0: &[f64],
    c0: &[f64],
    hid: usize,
    dirs: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let g = if lstm { 4 } else { 3 };
    let mut seq = x.to_vec();
    let mut width = input;
    let (mut hn, mut cn) = (Vec::new(), Vec::new());
    for l in 0..cells.len() / dirs {
        let mut out = vec![0.0; t * n * dirs * hid];
        for d in 0..dirs {
            let k = l * dirs + d;
            let (wih, whh, bih, bhh) = &cells[k];
            let mut h = h0[k * n * hid..(k + 1) * n * hid].to_vec();
            let mut c = c0[k * n * hid..(k + 1) * n * hid].to_vec();
            for step in 0..t {
                let ti = if d == 0 { step } else { t - 1 - step };
                let mut hnew = vec![0.0; n * hid];
                for b in 0..n {
                    let xv = &seq[(ti * n + b) * width..(ti * n + b + 1) * width];
                    let hv = &h[b * hid..(b + 1) * hid];
                    let gi: Vec<f64> = (0..g * hid)
                        .map(|r| bih[r] + (0..width).map(|q| wih[r * width + q] * xv[q]).sum::<f64>())
                        .collect();
                    let gh: Vec<f64> = (0..g * hid)
                        .map(|r| bhh[r] + (0..hid).map(|q| whh[r * hid + q] * hv[q]).sum::<f64>())
                        .collect();
                    for j in 0..hid {
                        if lstm {
                            let s = |q: usize| gi[q * hid + j] + gh[q * hid + j];
                            let (i, f, gg, o) = (sigmoid(s(0)), sigmoid(s(1)), s(2).tanh(), sigmoid(s(3)));
                            let cc = f * c[b * hid + j] + i * gg;
                            c[b * hid + j] = cc;
                            hnew[b * hid + j] = o * cc.tanh();
                        } else {
                            let r = sigmoid(gi[j] + gh[j]);
                            let z = sigmoid(gi[hid + j] + gh[hid + j]);
                            let nn = (gi[2 * hid + j] + r * gh[2 * hid + j]).tanh();
                            hnew[b * hid + j] = (1.0 - z) * nn + z * hv[j];
                        }
                    }
                }
                h = hnew;
                for b in 0..n {
                    for j in 0..hid {
                        out[((ti * n + b) * dirs + d) * hid + j] = h[b * hid + j];
                    }
                }
            }
            hn.extend(h);
            cn.extend(c);
        }
        seq = out;
        width = dirs * hid;
    }
    (seq, hn, cn)
}

fn layer_params(layers: &[lazuli::nn::RnnLayer]) -> Vec<LayerParams> {
    layers
        .iter()
        .map(|l| {
            (
                f64s(&l.weight_ih),
                f64s(&l.weight_hh),
                f64s(l.bias_ih.as_ref().unwrap()),
                f64s(l.bias_hh.as_ref().unwrap()),
            )
        })
        .collect()
}

/// `[a, b, c]` -> `[b, a, c]`.
fn swap01(x: &[f64], a: usize, b: usize, c: usize) -> Vec<f64> {
    (0..a * b * c).map(|e| x[((e / c) % a * b + e / (a * c)) * c + e % c]).collect()
}

#[test]
fn lstm_and_gru_match_pytorchs_equations() {
    let _lock = common::metrics_lock();
    let (t, n, i, h, layers) = (4, 2, 3, 5, 2);
    let x = vals(t * n * i, 11);
    let h0 = vals(2 * layers * n * h, 12);
    let c0 = vals(2 * layers * n * h, 13);
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let (h064, c064): (Vec<f64>, Vec<f64>) =
        (h0.iter().map(|&v| v as f64).collect(), c0.iter().map(|&v| v as f64).collect());
    for dev in common::devices() {
        for (batch_first, bidirectional) in [(false, false), (true, false), (false, true), (true, true)] {
            let dirs = if bidirectional { 2 } else { 1 };
            let opts = RnnOptions { num_layers: layers, batch_first, bidirectional, ..Default::default() };
            let states = dirs * layers * n * h;
            let (h0, c0) = (&h0[..states], &c0[..states]);
            let (h064, c064) = (&h064[..states], &c064[..states]);
            let xin = if batch_first {
                t32(&dev, &swap01(&x64, t, n, i).iter().map(|&v| v as f32).collect::<Vec<_>>(), &[n, t, i])
            } else {
                t32(&dev, &x, &[t, n, i])
            };
            let (hs, cs) = (t32(&dev, h0, &[dirs * layers, n, h]), t32(&dev, c0, &[dirs * layers, n, h]));
            lazuli::metrics::reset();
            let lstm = Lstm::with_options(i, h, opts.clone(), &dev).unwrap();
            let (out, (hn, cn)) = lstm.forward_with(&xin, Some((&hs, &cs))).unwrap();
            let (wo, wh, wc) = rnn_ref(true, &x64, (t, n, i), &layer_params(lstm.layers()), h064, c064, h, dirs);
            let wo = if batch_first { swap01(&wo, t, n, dirs * h) } else { wo };
            let what = format!("LSTM batch_first={batch_first} bidirectional={bidirectional} on {}", dev.name());
            let close = |got: &Tensor, want: &[f64], part: &str| {
                let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
                common::assert_close(&got.to_vec::<f32>().unwrap(), &want, 1e-5, 1e-5, &format!("{what}: {part}"));
            };
            close(&out, &wo, "output");
            close(&hn, &wh, "h_n");
            close(&cn, &wc, "c_n");
            no_fallback(&what, &dev);

            lazuli::metrics::reset();
            let gru = Gru::with_options(i, h, opts, &dev).unwrap();
            let (out, hn) = gru.forward_with(&xin, Some(&hs)).unwrap();
            let (wo, wh, _) = rnn_ref(false, &x64, (t, n, i), &layer_params(gru.layers()), h064, c064, h, dirs);
            let wo = if batch_first { swap01(&wo, t, n, dirs * h) } else { wo };
            let what = format!("GRU batch_first={batch_first} bidirectional={bidirectional} on {}", dev.name());
            let want: Vec<f32> = wo.iter().map(|&v| v as f32).collect();
            common::assert_close(&out.to_vec::<f32>().unwrap(), &want, 1e-5, 1e-5, &what);
            let want: Vec<f32> = wh.iter().map(|&v| v as f32).collect();
            common::assert_close(&hn.to_vec::<f32>().unwrap(), &want, 1e-5, 1e-5, &what);
            no_fallback(&what, &dev);
        }
    }
}

#[test]
fn rnn_names_shapes_defaults_and_unbatched_inputs() {
    let dev = Device::cpu();
    let lstm = Lstm::with_options(3, 4, RnnOptions { num_layers: 2, ..Default::default() }, &dev).unwrap();
    let names: Vec<(String, Vec<usize>)> =
        lstm.named_parameters().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
    let want = [
        ("weight_ih_l0", vec![16, 3]),
        ("weight_hh_l0", vec![16, 4]),
        ("bias_ih_l0", vec![16]),
        ("bias_hh_l0", vec![16]),
        ("weight_ih_l1", vec![16, 4]),
        ("weight_hh_l1", vec![16, 4]),
        ("bias_ih_l1", vec![16]),
        ("bias_hh_l1", vec![16]),
    ];
    assert_eq!(names, want.iter().map(|(n, d)| (n.to_string(), d.clone())).collect::<Vec<_>>());
    // PyTorch's init bound 1/sqrt(hidden).
    for (_, p) in lstm.named_parameters() {
        assert!(f64s(&p).iter().all(|v| v.abs() <= 0.5), "U(+-1/sqrt(4))");
    }
    let gru = Gru::new(3, 4, &dev).unwrap();
    assert_eq!(gru.named_parameters()[0].1.dims(), &[12, 3]);
    let opts = RnnOptions { num_layers: 2, bidirectional: true, bias: false, ..Default::default() };
    let bi = Gru::with_options(3, 4, opts, &dev).unwrap();
    let names: Vec<(String, Vec<usize>)> =
        bi.named_parameters().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
    let want = [
        ("weight_ih_l0", vec![12, 3]),
        ("weight_hh_l0", vec![12, 4]),
        ("weight_ih_l0_reverse", vec![12, 3]),
        ("weight_hh_l0_reverse", vec![12, 4]),
        ("weight_ih_l1", vec![12, 8]),
        ("weight_hh_l1", vec![12, 4]),
        ("weight_ih_l1_reverse", vec![12, 8]),
        ("weight_hh_l1_reverse", vec![12, 4]),
    ];
    assert_eq!(names, want.iter().map(|(n, d)| (n.to_string(), d.clone())).collect::<Vec<_>>());
    // Unbatched [t, input] runs as a batch of one.
    let x = t32(&dev, &vals(15, 3), &[5, 3]);
    let (out, hn) = gru.forward_with(&x, None).unwrap();
    assert_eq!((out.dims(), hn.dims()), (&[5usize, 4][..], &[1usize, 4][..]));
    let (batched, _) = gru.forward_with(&x.unsqueeze(1).unwrap(), None).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), batched.reshape([5, 4]).unwrap().to_vec::<f32>().unwrap());
    let err = lstm.forward(&t32(&dev, &vals(10, 1), &[2, 5])).unwrap_err().to_string();
    assert!(err.contains("LSTM") && err.contains("[2, 5]") && err.contains("nn_blocks.rs"), "{err}");
    let bad_h = Tensor::zeros([1, 1, 4], DType::F32, &dev).unwrap();
    let err = lstm.forward_with(&t32(&dev, &vals(6, 1), &[2, 1, 3]), Some((&bad_h, &bad_h))).unwrap_err();
    assert!(err.to_string().contains("h_0"), "{err}");
}

/// The layers' parameters as f64 leaves.
fn to_f64(layers: &mut [lazuli::nn::RnnLayer]) {
    let conv = |t: &Tensor| t.cast(DType::F64).unwrap().detach().requires_grad_(true).unwrap();
    for l in layers {
        l.weight_ih = conv(&l.weight_ih);
        l.weight_hh = conv(&l.weight_hh);
        l.bias_ih = l.bias_ih.as_ref().map(conv);
        l.bias_hh = l.bias_hh.as_ref().map(conv);
    }
}

#[test]
fn rnn_gradients_through_time_match_finite_differences() {
    let dev = Device::cpu();
    let opts = RnnOptions { num_layers: 2, ..Default::default() };
    let mut lstm = Lstm::with_options(2, 3, opts.clone(), &dev).unwrap();
    to_f64(lstm.layers_mut());
    let mut gru = Gru::with_options(2, 3, opts, &dev).unwrap();
    to_f64(gru.layers_mut());
    let x: Vec<f64> = vals(3 * 2 * 2, 21).into_iter().map(f64::from).collect();
    let h0: Vec<f64> = vals(2 * 2 * 3, 22).into_iter().map(f64::from).collect();
    let inputs = vec![(x, vec![3, 2, 2]), (h0.clone(), vec![2, 2, 3]), (h0, vec![2, 2, 3])];
    for wrt in 0..3 {
        gradcheck(&dev, "LSTM", &inputs, wrt, |t| {
            let (out, (hn, cn)) = lstm.forward_with(&t[0], Some((&t[1], &t[2])))?;
            Tensor::concat(&[&out.reshape([-1])?, &hn.reshape([-1])?, &cn.reshape([-1])?], 0)
        });
    }
    for wrt in 0..2 {
        gradcheck(&dev, "GRU", &inputs, wrt, |t| {
            let (out, hn) = gru.forward_with(&t[0], Some(&t[1]))?;
            Tensor::concat(&[&out.reshape([-1])?, &hn.reshape([-1])?], 0)
        });
    }
    // Both directions of a bidirectional layer.
    let bi_opts = RnnOptions { bidirectional: true, ..Default::default() };
    let mut bi = Lstm::with_options(2, 3, bi_opts, &dev).unwrap();
    to_f64(bi.layers_mut());
    gradcheck(&dev, "bidirectional LSTM", &inputs[..1], 0, |t| {
        let (out, (hn, cn)) = bi.forward_with(&t[0], None)?;
        Tensor::concat(&[&out.reshape([-1])?, &hn.reshape([-1])?, &cn.reshape([-1])?], 0)
    });
    // A weight's gradient too (the hidden weights of the first layer).
    let w = f64s(&lstm.layers()[0].weight_hh);
    let x = vals(3 * 2 * 2, 23).into_iter().map(f64::from).collect();
    gradcheck(&dev, "LSTM weight_hh_l0", &[(w, vec![12, 3]), (x, vec![3, 2, 2])], 0, |t| {
        let mut l = lstm.clone();
        l.layers_mut()[0].weight_hh = t[0].clone();
        l.forward(&t[1])
    });
}

// ---- TransformerBlock ----

fn block_ref(b: &TransformerBlock, x: &Tensor, causal: bool) -> Result<Tensor> {
    let (n, t, e) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let heads = b.self_attn.num_heads;
    let ln1 = layer_norm(x, 1, Some(&b.norm1.weight), Some(&b.norm1.bias), 1e-5)?;
    let proj = |i: usize| -> Result<Tensor> {
        let w = b.self_attn.in_proj_weight.narrow(0, i * e, e)?;
        let bias = b.self_attn.in_proj_bias.as_ref().unwrap().narrow(0, i * e, e)?;
        ln1.matmul(&w.t()?)?.add(&bias)?.reshape([n, t, heads, e / heads])?.permute(&[0, 2, 1, 3])
    };
    let opts = AttentionOptions { causal, ..Default::default() };
    let a = scaled_dot_product_attention_unfused(&proj(0)?, &proj(1)?, &proj(2)?, &opts)?;
    let a = a.permute(&[0, 2, 1, 3])?.reshape([n, t, e])?;
    let a = a.matmul(&b.self_attn.out_proj.weight.t()?)?.add(b.self_attn.out_proj.bias.as_ref().unwrap())?;
    let x = x.add(&a)?;
    let ln2 = layer_norm(&x, 1, Some(&b.norm2.weight), Some(&b.norm2.bias), 1e-5)?;
    let m = ln2.matmul(&b.linear1.weight.t()?)?.add(b.linear1.bias.as_ref().unwrap())?.relu()?;
    let m = m.matmul(&b.linear2.weight.t()?)?.add(b.linear2.bias.as_ref().unwrap())?;
    x.add(&m)
}

#[test]
fn transformer_block_matches_its_composition_and_pytorchs_names() {
    let _lock = common::metrics_lock();
    let (n, t, e) = (2, 5, 8);
    let x = vals(n * t * e, 31);
    for dev in common::devices() {
        for causal in [false, true] {
            let block = TransformerBlock::new(e, 2, 16, &dev).unwrap().causal(causal);
            block.eval();
            let xin = t32(&dev, &x, &[n, t, e]);
            lazuli::metrics::reset();
            let got = block.forward(&xin).unwrap().to_vec::<f32>().unwrap();
            no_fallback("TransformerBlock", &dev);
            let want = block_ref(&block, &xin, causal).unwrap().to_vec::<f32>().unwrap();
            common::assert_close(&got, &want, 1e-4, 1e-5, &format!("causal={causal} on {}", dev.name()));
        }
    }
    let dev = Device::cpu();
    let block = TransformerBlock::new(e, 2, 16, &dev).unwrap();
    let names: Vec<String> = block.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "self_attn.in_proj_weight",
            "self_attn.in_proj_bias",
            "self_attn.out_proj.weight",
            "self_attn.out_proj.bias",
            "linear1.weight",
            "linear1.bias",
            "linear2.weight",
            "linear2.bias",
            "norm1.weight",
            "norm1.bias",
            "norm2.weight",
            "norm2.bias",
        ]
    );
    // Causal: the first position ignores the others.
    let block = TransformerBlock::new(e, 2, 16, &dev).unwrap().causal(true);
    block.eval();
    let mut x2 = x.clone();
    for v in &mut x2[e..t * e] {
        *v += 1.0;
    }
    let first =
        |v: &[f32]| block.forward(&t32(&dev, v, &[n, t, e])).unwrap().narrow(1, 0, 1).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(first(&x), first(&x2));
    // Dropout is active in training mode only.
    block.train();
    let a = block.forward(&t32(&dev, &x, &[n, t, e])).unwrap().to_vec::<f32>().unwrap();
    block.eval();
    let b = block.forward(&t32(&dev, &x, &[n, t, e])).unwrap().to_vec::<f32>().unwrap();
    assert_ne!(a, b);
    let err = block.forward(&t32(&dev, &x[..2 * t * 4], &[2, t, 4])).unwrap_err().to_string();
    assert!(err.contains("TransformerBlock") && err.contains("nn_blocks.rs"), "{err}");
    assert!(TransformerBlock::new(8, 3, 16, &dev).is_err());
}

#[test]
fn transformer_block_gradient_matches_finite_differences() {
    let dev = Device::cpu();
    let mut b = TransformerBlock::new(4, 2, 6, &dev).unwrap().causal(true).with_dropout(0.0);
    let conv = |t: &Tensor| t.cast(DType::F64).unwrap().detach().requires_grad_(true).unwrap();
    b.self_attn.in_proj_weight = conv(&b.self_attn.in_proj_weight);
    b.self_attn.in_proj_bias = b.self_attn.in_proj_bias.as_ref().map(conv);
    for l in [&mut b.self_attn.out_proj, &mut b.linear1, &mut b.linear2] {
        l.weight = conv(&l.weight);
        l.bias = l.bias.as_ref().map(conv);
    }
    for nm in [&mut b.norm1, &mut b.norm2] {
        nm.weight = conv(&nm.weight);
        nm.bias = conv(&nm.bias);
    }
    let x: Vec<f64> = vals(3 * 4, 41).into_iter().map(f64::from).collect();
    gradcheck(&dev, "TransformerBlock", &[(x, vec![1, 3, 4])], 0, |t| b.forward(&t[0]));
}

/// Gradients of every layer here on wgpu equal the CPU's in f32, with no
/// op of the backward pass falling back to the CPU.
#[test]
fn f32_gradients_agree_across_devices_without_fallback() {
    let _lock = common::metrics_lock();
    type Case = (&'static str, Vec<usize>, Box<dyn Fn(&Tensor) -> Result<Tensor>>);
    let cases: Vec<Case> = vec![
        (
            "conv_transpose2d",
            vec![1, 4, 3, 3],
            Box::new(|x: &Tensor| {
                let attrs = conv_t_cases()[2].0.clone();
                let w = t32(x.device(), &vals(4 * 2 * 3, 3), &[4, 1, 2, 3]);
                conv_transpose2d(x, &w, None, &attrs)
            }),
        ),
        ("rope", vec![2, 3, 8], Box::new(|x: &Tensor| RotaryEmbedding::new(8, 10000.0)?.apply(x, 5))),
        (
            "lstm",
            vec![3, 2, 4],
            Box::new(|x: &Tensor| {
                x.device().manual_seed(5);
                let l = Lstm::with_options(4, 3, RnnOptions { num_layers: 2, ..Default::default() }, x.device())?;
                l.forward(x)
            }),
        ),
        (
            "gru",
            vec![2, 3, 4],
            Box::new(|x: &Tensor| {
                x.device().manual_seed(6);
                let opts = RnnOptions { batch_first: true, bidirectional: true, ..Default::default() };
                Gru::with_options(4, 3, opts, x.device())?.forward(x)
            }),
        ),
        (
            "transformer_block",
            vec![2, 3, 8],
            Box::new(|x: &Tensor| {
                x.device().manual_seed(7);
                TransformerBlock::new(8, 2, 16, x.device())?.causal(true).with_dropout(0.0).forward(x)
            }),
        ),
    ];
    let devs = common::devices();
    for (name, shape, f) in &cases {
        let x = vals(shape.iter().product(), 8);
        let mut grads = Vec::new();
        for dev in &devs {
            lazuli::metrics::reset();
            let leaf = t32(dev, &x, shape).requires_grad_(true).unwrap();
            let y = f(&leaf).unwrap();
            let w = t32(dev, &vals(y.numel(), 9), y.dims());
            y.mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
            grads.push(leaf.grad().unwrap().to_vec::<f32>().unwrap());
            no_fallback(&format!("{name} backward"), dev);
        }
        for g in &grads[1..] {
            common::assert_close(g, &grads[0], 1e-4, 1e-5, &format!("{name} gradient across devices"));
        }
    }
}
