//! Scaled dot-product attention against a host reference: the unfused
//! definition written as f64 loops (scores, masked softmax, weighted sum)
//! with its hand-derived backward (dV = P^T dO; dS = P * (dP - rowsum(dP * P));
//! dQ = dS K s; dK = dS^T Q s). Fuzzed shapes (lengths 1..70, head dims up
//! to 256, equal and unequal query/key lengths), causal and not, additive
//! and bool masks, on the CPU backend and on wgpu; forward and gradients.
//! Also `MultiheadAttention` against the same reference, head by head.

mod common;

use lazuli::nn::{self, AttentionOptions, Module};
use lazuli::prelude::*;

/// One attention problem: `b` independent (batch x head) slices.
#[derive(Clone, Debug)]
struct Case {
    b: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
    causal: bool,
    /// Additive mask `[tq, tk]` (shared by every slice), or none.
    mask: Option<Vec<f64>>,
    scale: f64,
}

/// Forward and gradients of `sum(O * w)` for every slice, in f64.
struct Reference {
    o: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(c: &Case, q: &[f64], k: &[f64], v: &[f64], w: &[f64]) -> Reference {
    let (tq, tk, d, dv) = (c.tq, c.tk, c.d, c.dv);
    let mut r = Reference {
        o: vec![0.0; c.b * tq * dv],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
    };
    for s in 0..c.b {
        let (q, k, v) = (&q[s * tq * d..], &k[s * tk * d..], &v[s * tk * dv..]);
        let w = &w[s * tq * dv..];
        // P = softmax(Q K^T s + mask), with -inf where masked.
        let mut p = vec![0.0; tq * tk];
        for i in 0..tq {
            for j in 0..tk {
                let mut acc = 0.0;
                for e in 0..d {
                    acc += q[i * d + e] * k[j * d + e];
                }
                let mut sc = acc * c.scale;
                if c.causal && j > i {
                    sc = f64::NEG_INFINITY;
                }
                if let Some(m) = &c.mask {
                    sc += m[i * tk + j];
                }
                p[i * tk + j] = sc;
            }
            let row = &mut p[i * tk..(i + 1) * tk];
            let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|x| (x - mx).exp()).sum();
            for x in row.iter_mut() {
                *x = (*x - mx).exp() / z;
            }
        }
        for i in 0..tq {
            for e in 0..dv {
                r.o[s * tq * dv + i * dv + e] = (0..tk).map(|j| p[i * tk + j] * v[j * dv + e]).sum();
            }
        }
        // dO = w.
        for j in 0..tk {
            for e in 0..dv {
                r.dv[s * tk * dv + j * dv + e] = (0..tq).map(|i| p[i * tk + j] * w[i * dv + e]).sum();
            }
        }
        let mut ds = vec![0.0; tq * tk];
        for i in 0..tq {
            let dp: Vec<f64> = (0..tk).map(|j| (0..dv).map(|e| w[i * dv + e] * v[j * dv + e]).sum()).collect();
            let dot: f64 = (0..tk).map(|j| dp[j] * p[i * tk + j]).sum();
            for j in 0..tk {
                ds[i * tk + j] = p[i * tk + j] * (dp[j] - dot);
            }
        }
        for i in 0..tq {
            for e in 0..d {
                r.dq[s * tq * d + i * d + e] = (0..tk).map(|j| ds[i * tk + j] * k[j * d + e]).sum::<f64>() * c.scale;
            }
        }
        for j in 0..tk {
            for e in 0..d {
                r.dk[s * tk * d + j * d + e] = (0..tq).map(|i| ds[i * tk + j] * q[i * d + e]).sum::<f64>() * c.scale;
            }
        }
    }
    r
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Runs `c` on `dev` through `nn::scaled_dot_product_attention` (the mask
/// given as float or as bool) and compares with the reference.
fn check_case(dev: &Device, c: &Case, seed: u64, bool_mask: bool) {
    let r = |n: usize, s: u64| -> Vec<f64> { common::rand_vec(n, s, -1.0, 1.0).into_iter().map(f64::from).collect() };
    let (q, k, v, w) = (
        r(c.b * c.tq * c.d, seed),
        r(c.b * c.tk * c.d, seed + 1),
        r(c.b * c.tk * c.dv, seed + 2),
        r(c.b * c.tq * c.dv, seed + 3),
    );
    let want = reference(c, &q, &k, &v, &w);
    let leaf =
        |x: &[f64], dims: [usize; 3]| Tensor::from_slice(&f32s(x), dims, dev).unwrap().requires_grad_(true).unwrap();
    let (tq, tk, tv) = (leaf(&q, [c.b, c.tq, c.d]), leaf(&k, [c.b, c.tk, c.d]), leaf(&v, [c.b, c.tk, c.dv]));
    let mut opts = AttentionOptions { causal: c.causal, scale: Some(c.scale), mask: None };
    if let Some(m) = &c.mask {
        opts.mask = Some(if bool_mask {
            let keep: Vec<bool> = m.iter().map(|&x| x == 0.0).collect();
            Tensor::from_slice(&keep, [c.tq, c.tk], dev).unwrap()
        } else {
            Tensor::from_slice(&f32s(m), [c.tq, c.tk], dev).unwrap()
        });
    }
    let o = nn::scaled_dot_product_attention(&tq, &tk, &tv, &opts).unwrap();
    let wt = Tensor::from_slice(&f32s(&w), [c.b, c.tq, c.dv], dev).unwrap();
    o.mul(&wt).unwrap().sum(&[], false).unwrap().backward().unwrap();
    let what = format!("{c:?} on {} (bool mask {bool_mask})", dev.name());
    // f32 sums over up to 256-long dot products and 70-long rows.
    let tol = 2e-4 * (c.d.max(c.tk) as f32).sqrt();
    common::assert_close(&o.to_vec::<f32>().unwrap(), &f32s(&want.o), tol, tol, &format!("forward {what}"));
    for (name, t, g) in [("dq", &tq, &want.dq), ("dk", &tk, &want.dk), ("dv", &tv, &want.dv)] {
        common::assert_close(
            &t.grad().unwrap().to_vec::<f32>().unwrap(),
            &f32s(g),
            tol,
            tol,
            &format!("{name} {what}"),
        );
    }
}

/// Deterministic fuzzed cases: a mask that removes keys (never all keys
/// of a row) and every length from 1 up.
fn cases() -> Vec<Case> {
    let mut rng = 0x5DEECE66Du64;
    let mut next = |n: usize| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((rng >> 33) as usize) % n
    };
    let mut out = Vec::new();
    for i in 0..16 {
        let tq = 1 + next(if i % 4 == 0 { 70 } else { 12 });
        // Causal rows need a key at j <= i: t_k >= 1 always gives key 0.
        let tk = if i % 3 == 0 { tq } else { 1 + next(if i % 4 == 0 { 70 } else { 12 }) };
        let d = [1, 3, 8, 16, 33, 64, 128, 256][next(8)];
        let dv = if i % 2 == 0 { d } else { 1 + next(40) };
        let causal = i % 2 == 1;
        let mask = (i % 5 == 2).then(|| {
            (0..tq * tk).map(|x| if x % tk != 0 && (x * 7) % 5 == 0 { f64::NEG_INFINITY } else { 0.0 }).collect()
        });
        let scale = if i % 4 == 3 { 0.7 } else { 1.0 / (d as f64).sqrt() };
        out.push(Case { b: 1 + next(3), tq, tk, d, dv, causal, mask, scale });
    }
    // Fixed corners: one query and one key; a long causal square; head dim 256.
    out.push(Case { b: 1, tq: 1, tk: 1, d: 4, dv: 4, causal: true, mask: None, scale: 0.5 });
    out.push(Case { b: 2, tq: 64, tk: 64, d: 32, dv: 32, causal: true, mask: None, scale: 1.0 / 32f64.sqrt() });
    out.push(Case { b: 1, tq: 9, tk: 17, d: 256, dv: 256, causal: false, mask: None, scale: 1.0 / 16.0 });
    out
}

#[test]
fn sdpa_matches_the_reference_on_every_backend() {
    for dev in common::devices() {
        for (i, c) in cases().iter().enumerate() {
            check_case(&dev, c, 1000 + 10 * i as u64, false);
            if c.mask.is_some() {
                check_case(&dev, c, 1000 + 10 * i as u64, true);
            }
        }
    }
}

#[test]
fn sdpa_broadcasts_batch_and_head_dims_and_checks_shapes() {
    let dev = Device::cpu();
    let q = Tensor::randn([2, 3, 5, 8], DType::F32, &dev).unwrap();
    let k = Tensor::randn([1, 3, 7, 8], DType::F32, &dev).unwrap();
    let v = Tensor::randn([2, 1, 7, 4], DType::F32, &dev).unwrap();
    let o = nn::scaled_dot_product_attention(&q, &k, &v, &AttentionOptions::causal()).unwrap();
    assert_eq!(o.dims(), &[2, 3, 5, 4]);
    let bad = Tensor::randn([2, 3, 7, 6], DType::F32, &dev).unwrap();
    let e = nn::scaled_dot_product_attention(&q, &bad, &v, &AttentionOptions::default()).unwrap_err().to_string();
    assert!(e.contains("scaled_dot_product_attention") && e.contains("[2, 3, 7, 6]"), "{e}");
    let e = nn::scaled_dot_product_attention(
        &q,
        &k,
        &v,
        &AttentionOptions::default().with_mask(Tensor::zeros([5, 7], DType::I32, &dev).unwrap()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("mask"), "{e}");
    // The causal mask helper: 0 on and below the diagonal, -inf above.
    let m = nn::causal_mask(2, 3, DType::F32, &dev).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(m, vec![0.0, f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0, f32::NEG_INFINITY]);
}

/// `MultiheadAttention` is the input projection, per-head attention and
/// the output projection: compared with the reference run head by head.
#[test]
fn multihead_attention_matches_per_head_reference() {
    for dev in common::devices() {
        dev.manual_seed(11);
        let (b, t, e, h) = (2, 5, 8, 2);
        let mha = nn::MultiheadAttention::new(e, h, &dev).unwrap().causal(true);
        let x: Vec<f32> = common::rand_vec(b * t * e, 5, -1.0, 1.0);
        let xt = Tensor::from_slice(&x, [b, t, e], &dev).unwrap();
        let got = mha.forward(&xt).unwrap().to_vec::<f32>().unwrap();
        let wi: Vec<f64> = mha.in_proj_weight.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
        let bi: Vec<f64> =
            mha.in_proj_bias.as_ref().unwrap().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
        let wo: Vec<f64> = mha.out_proj.weight.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
        let bo: Vec<f64> =
            mha.out_proj.bias.as_ref().unwrap().to_vec::<f32>().unwrap().into_iter().map(f64::from).collect();
        let dh = e / h;
        let mut want = vec![0.0f64; b * t * e];
        for bb in 0..b {
            // proj[p][i][f]: projection p (q, k, v) of token i.
            let proj = |p: usize, i: usize, f: usize| -> f64 {
                bi[p * e + f] + (0..e).map(|c| x[(bb * t + i) * e + c] as f64 * wi[(p * e + f) * e + c]).sum::<f64>()
            };
            let mut concat = vec![0.0f64; t * e];
            for hh in 0..h {
                let slice = |p: usize| -> Vec<f64> {
                    (0..t).flat_map(|i| (0..dh).map(move |f| (i, f))).map(|(i, f)| proj(p, i, hh * dh + f)).collect()
                };
                let c = Case {
                    b: 1,
                    tq: t,
                    tk: t,
                    d: dh,
                    dv: dh,
                    causal: true,
                    mask: None,
                    scale: 1.0 / (dh as f64).sqrt(),
                };
                let r = reference(&c, &slice(0), &slice(1), &slice(2), &vec![0.0; t * dh]);
                for i in 0..t {
                    for f in 0..dh {
                        concat[i * e + hh * dh + f] = r.o[i * dh + f];
                    }
                }
            }
            for i in 0..t {
                for o in 0..e {
                    want[(bb * t + i) * e + o] = bo[o] + (0..e).map(|c| concat[i * e + c] * wo[o * e + c]).sum::<f64>();
                }
            }
        }
        common::assert_close(&got, &f32s(&want), 1e-4, 1e-5, &format!("MultiheadAttention on {}", dev.name()));
        let names: Vec<String> = mha.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]);
    }
}
