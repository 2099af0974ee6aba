//! Scaled dot-product attention (the fused op, `Tensor::attention`, behind
//! `nn::scaled_dot_product_attention`) against a host reference: the
//! unfused definition written as f64 loops (scores, masked softmax,
//! weighted sum) with its hand-derived backward (dV = P^T dO;
//! dS = P * (dP - rowsum(dP * P)); dQ = dS K s; dK = dS^T Q s). Fuzzed
//! shapes (lengths 1..70, head dims up to 256, equal and unequal
//! query/key lengths), causal and not, additive and bool masks, on the CPU
//! backend and on wgpu; forward and gradients. Also `MultiheadAttention`
//! against the same reference, head by head.
//!
//! Then the fused op against the unfused composition
//! (`nn::scaled_dot_product_attention_unfused`, on the CPU: the oracle),
//! forward and gradients, on the CPU and on wgpu in both kernel-form
//! profiles: fuzzed shapes with broadcast batch dims, t_q != t_k, lengths
//! of 1 and sizes that are no multiple of a tile, head dims 1..256,
//! causal and not, additive, broadcast and bool masks; rows whose keys
//! are all masked; that the fused path writes nothing of the scores' size
//! and runs no kernel on the CPU fallback.

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
    // One sync for the output and the gradients: one graph per case.
    let grads = [tq.grad().unwrap(), tk.grad().unwrap(), tv.grad().unwrap()];
    lazuli::sync(&[&o, &grads[0], &grads[1], &grads[2]]).unwrap();
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
        let cpu = dev.name() == "cpu";
        for (i, c) in cases().iter().enumerate() {
            // wgpu takes the long fuzzed cases (one with masks) and the
            // fixed corners; the differential tests below cover it more.
            if !cpu && i % 4 != 0 && i < 16 {
                continue;
            }
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

// ---- the fused op against the unfused composition ----

/// A mask of a differential case.
#[derive(Clone, Debug)]
enum MaskSpec {
    None,
    /// Additive, of these dims (broadcast to the scores).
    Add(Vec<usize>),
    /// Bool keep mask, of these dims.
    Keep(Vec<usize>),
}

/// One fused-vs-unfused problem: full shapes of q, k, v (leading dims
/// broadcast), options, and which devices run it.
#[derive(Clone, Debug)]
struct DiffCase {
    q: Vec<usize>,
    k: Vec<usize>,
    v: Vec<usize>,
    causal: bool,
    mask: MaskSpec,
    scale: Option<f64>,
}

impl DiffCase {
    fn new(q: &[usize], k: &[usize], v: &[usize], causal: bool, mask: MaskSpec) -> DiffCase {
        DiffCase { q: q.to_vec(), k: k.to_vec(), v: v.to_vec(), causal, mask, scale: None }
    }

    fn dims(&self) -> (usize, usize, usize) {
        let tq = self.q[self.q.len() - 2];
        let tk = self.k[self.k.len() - 2];
        (tq, tk, self.q[self.q.len() - 1].max(self.v[self.v.len() - 1]))
    }
}

/// Host data of a case: q, k, v, the mask (float or bool), the output
/// weights.
struct DiffData {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    mask_f: Vec<f32>,
    mask_b: Vec<bool>,
}

fn diff_data(c: &DiffCase, seed: u64) -> DiffData {
    let n = |d: &[usize]| d.iter().product::<usize>();
    let mask_dims = match &c.mask {
        MaskSpec::None => vec![0],
        MaskSpec::Add(d) | MaskSpec::Keep(d) => d.clone(),
    };
    let tk_mask = *mask_dims.last().unwrap_or(&1);
    // Removed keys (-inf, false) everywhere but key 0, so no query loses
    // every key.
    let r = common::rand_vec(n(&mask_dims), seed + 4, 0.0, 1.0);
    let mask_f = r
        .iter()
        .enumerate()
        .map(|(i, &x)| if i % tk_mask != 0 && x < 0.2 { f32::NEG_INFINITY } else { x * 3.0 - 2.0 })
        .collect();
    let mask_b = r.iter().enumerate().map(|(i, &x)| i % tk_mask == 0 || x >= 0.3).collect();
    DiffData {
        q: common::rand_vec(n(&c.q), seed, -1.5, 1.5),
        k: common::rand_vec(n(&c.k), seed + 1, -1.5, 1.5),
        v: common::rand_vec(n(&c.v), seed + 2, -1.0, 1.0),
        mask_f,
        mask_b,
    }
}

/// Forward output and the gradients of q, k and v of `sum(O * w)`, on
/// `dev`, through `f` (fused or unfused); one sync.
fn diff_run(
    dev: &Device,
    c: &DiffCase,
    data: &DiffData,
    f: fn(&Tensor, &Tensor, &Tensor, &AttentionOptions) -> lazuli::Result<Tensor>,
) -> [Vec<f32>; 4] {
    let leaf = |v: &[f32], d: &[usize]| Tensor::from_slice(v, d.to_vec(), dev).unwrap().requires_grad_(true).unwrap();
    let (q, k, v) = (leaf(&data.q, &c.q), leaf(&data.k, &c.k), leaf(&data.v, &c.v));
    let mut opts = AttentionOptions { causal: c.causal, scale: c.scale, mask: None };
    opts.mask = match &c.mask {
        MaskSpec::None => None,
        MaskSpec::Add(d) => Some(Tensor::from_slice(&data.mask_f, d.clone(), dev).unwrap()),
        MaskSpec::Keep(d) => Some(Tensor::from_slice(&data.mask_b, d.clone(), dev).unwrap()),
    };
    let o = f(&q, &k, &v, &opts).unwrap();
    let w = Tensor::from_slice(&common::rand_vec(o.numel(), 77, 0.5, 1.5), o.shape().clone(), dev).unwrap();
    o.mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
    let g = [q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()];
    lazuli::sync(&[&o, &g[0], &g[1], &g[2]]).unwrap();
    [o.to_vec().unwrap(), g[0].to_vec().unwrap(), g[1].to_vec().unwrap(), g[2].to_vec().unwrap()]
}

/// The differential cases, and whether the GPU kernel forms run them too
/// (their tiled kernels take lavapipe about a second each to compile, so
/// they get the cases that reach different code). Lengths are often no
/// multiple of 4, 32 or 64 (the tiles) and include 1; leading dims
/// broadcast in every pattern the composition allows (q, k, v, and the
/// mask, each missing a dim); head dims 1 to 256.
fn diff_cases() -> Vec<(DiffCase, bool)> {
    use MaskSpec::*;
    vec![
        // Head dim 16, causal, additive [t_q, t_k] mask: t_q > t_k, t_q <
        // t_k, one query, one key.
        (DiffCase::new(&[2, 70, 16], &[2, 33, 16], &[2, 33, 16], true, Add(vec![70, 33])), true),
        (DiffCase::new(&[2, 5, 16], &[2, 67, 16], &[2, 67, 16], true, Add(vec![5, 67])), false),
        (DiffCase::new(&[2, 1, 16], &[2, 40, 16], &[2, 40, 16], true, Add(vec![1, 40])), false),
        (DiffCase::new(&[2, 65, 16], &[2, 1, 16], &[2, 1, 16], true, Add(vec![65, 1])), true),
        // Broadcast batch dims (heads shared by k, batch shared by v), a
        // bool mask over [batch, 1, 1, t_k]; odd head dims, d != d_v.
        (DiffCase::new(&[2, 3, 9, 3], &[1, 3, 20, 3], &[2, 1, 20, 5], false, Keep(vec![2, 1, 1, 20])), true),
        (DiffCase::new(&[2, 3, 33, 1], &[1, 3, 64, 1], &[2, 1, 64, 7], false, Keep(vec![2, 1, 1, 64])), false),
        // A mask that grows the batch, broadcast along queries; a scale.
        (
            DiffCase {
                scale: Some(0.3),
                ..DiffCase::new(&[4, 31, 8], &[4, 29, 8], &[29, 8], false, Add(vec![3, 1, 1, 29]))
            },
            false,
        ),
        // Head dims 64, 100 (two output chunks, the second partial), 256;
        // one query and one key.
        (DiffCase::new(&[1, 2, 77, 64], &[1, 2, 77, 64], &[1, 2, 77, 64], true, None), true),
        // Head dim 32 (the flash forward's 64 x 32 tile on lavapipe's 32
        // KiB), t_q != t_k, several query blocks and key tiles, a keep
        // mask; and head dim 128 (the slice-staged tiled form there).
        (DiffCase::new(&[2, 130, 32], &[2, 75, 32], &[2, 75, 32], false, Keep(vec![130, 75])), true),
        (DiffCase::new(&[1, 40, 128], &[1, 70, 128], &[1, 70, 128], true, None), true),
        // Head dim 48: the 64 x 32 tile with the values in the keys'
        // memory on lavapipe; an additive mask broadcast along queries.
        (DiffCase::new(&[3, 66, 48], &[3, 50, 48], &[3, 50, 48], true, Add(vec![1, 50])), true),
        (DiffCase::new(&[3, 1, 100], &[3, 9, 100], &[3, 9, 36], false, None), true),
        (DiffCase::new(&[1, 1, 1, 8], &[1, 1, 1, 8], &[1, 1, 1, 8], true, None), false),
        (DiffCase::new(&[1, 12, 256], &[1, 19, 256], &[1, 19, 256], true, None), true),
    ]
}

/// The wgpu devices of the differential tests: one per kernel-form
/// profile, made once so compiles are shared across tests. When
/// `LAZULI_KERNEL_FORMS` forces a profile (scripts/test's second run), only
/// that one: the first run covered both.
fn form_devices() -> &'static [(&'static str, Device)] {
    static DEVS: std::sync::OnceLock<Vec<(&'static str, Device)>> = std::sync::OnceLock::new();
    DEVS.get_or_init(|| {
        if common::wgpu().is_none() {
            return Vec::new();
        }
        let with = |forms: lazuli::wgpu::forms::KernelForms| {
            let opts = lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), ..Default::default() };
            Device::wgpu_with(opts).expect("a wgpu device")
        };
        let forced = std::env::var("LAZULI_KERNEL_FORMS").unwrap_or_default();
        let mut v = Vec::new();
        if forced != "gpu" {
            v.push(("software forms", with(lazuli::wgpu::forms::KernelForms::software())));
        }
        if forced != "software" {
            v.push(("gpu forms", with(lazuli::wgpu::forms::KernelForms::gpu())));
        }
        v
    })
}

#[test]
fn fused_matches_unfused_on_every_backend_and_form() {
    let cpu = Device::cpu();
    for (i, (c, on_gpu_forms)) in diff_cases().iter().enumerate() {
        let data = diff_data(c, 500 + 10 * i as u64);
        let want = diff_run(&cpu, c, &data, nn::scaled_dot_product_attention_unfused);
        let (_, tk, d) = c.dims();
        // f32 sums over the head dim and the keys, in other orders.
        let tol = 3e-5 * ((d.max(tk)) as f32).sqrt();
        let mut devs: Vec<(&str, &Device)> = vec![("cpu", &cpu)];
        devs.extend(form_devices().iter().filter(|(n, _)| *on_gpu_forms || *n != "gpu forms").map(|(n, d)| (*n, d)));
        for (name, dev) in devs {
            let got = diff_run(dev, c, &data, nn::scaled_dot_product_attention);
            for (k, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
                common::assert_close(&got[k], &want[k], tol, tol, &format!("{what} of case {i} {c:?} on {name}"));
            }
        }
    }
}

/// Random shapes through the GPU kernel forms (the flash forward at every
/// plan lavapipe's 32 KiB admits, the slice-staged gradients): lengths on
/// and off the tile edges, head and value dims on and off multiples of 4
/// (vec4 and scalar loads), causal or not, with each mask kind; fused on
/// wgpu against the unfused composition on the CPU.
#[test]
fn random_shapes_match_the_cpu_on_the_gpu_forms() {
    let Some((_, gpu)) = form_devices().iter().find(|(n, _)| *n == "gpu forms") else { return };
    let cpu = Device::cpu();
    let pick = |r: f32, from: &[usize]| from[((r * from.len() as f32) as usize).min(from.len() - 1)];
    for case in 0..6u64 {
        let r = common::rand_vec(8, 9000 + case, 0.0, 1.0);
        let (tq, tk) = (1 + (r[0] * 140.0) as usize, 1 + (r[1] * 140.0) as usize);
        let d = pick(r[2], &[4, 8, 12, 16, 20, 32, 40, 48, 64, 7]);
        let dv = pick(r[3], &[4, 8, 16, 24, 32, 64, 5, d]);
        let mask = match (r[5] * 3.0) as usize {
            0 => MaskSpec::None,
            1 => MaskSpec::Add(vec![tq, tk]),
            _ => MaskSpec::Keep(vec![2, 1, tk]),
        };
        let c = DiffCase::new(&[2, tq, d], &[2, tk, d], &[2, tk, dv], r[4] < 0.5, mask);
        let data = diff_data(&c, 7000 + case);
        let want = diff_run(&cpu, &c, &data, nn::scaled_dot_product_attention_unfused);
        let got = diff_run(gpu, &c, &data, nn::scaled_dot_product_attention);
        let tol = 3e-5 * (d.max(dv).max(tk) as f32).sqrt();
        for (k, what) in ["output", "dq", "dk", "dv"].iter().enumerate() {
            common::assert_close(&got[k], &want[k], tol, tol, &format!("{what} of random case {case} {c:?}"));
        }
    }
}

/// More query blocks than one dispatch dimension holds (65,537 batch
/// slices of one block each): the GPU forms' forward (the flash kernel,
/// causal, so blocks are ordered heaviest first) runs a 2-D grid and
/// matches the CPU.
#[test]
fn a_forward_grid_beyond_one_dispatch_dimension_matches_the_cpu() {
    let Some((_, gpu)) = form_devices().iter().find(|(n, _)| *n == "gpu forms") else { return };
    let (b, t, d) = (65537, 3, 4);
    let q = common::rand_vec(b * t * d, 61, -1.0, 1.0);
    let k = common::rand_vec(b * t * d, 62, -1.0, 1.0);
    let v = common::rand_vec(b * t * d, 63, -1.0, 1.0);
    let run = |dev: &Device| {
        let x = |v: &[f32]| Tensor::from_slice(v, vec![b, t, d], dev).unwrap();
        x(&q).attention(&x(&k), &x(&v), 0.5, true, None).unwrap().to_vec::<f32>().unwrap()
    };
    common::assert_close(&run(gpu), &run(&Device::cpu()), 1e-5, 1e-6, "forward over a 2-D grid");
}

/// A query whose keys are all masked: NaN output in both paths and the
/// same gradients (NaN for the keys and values it weighs, 0 for its own
/// query, as the keep mask's `where` passes nothing back); no causal
/// removal here, so the paths agree exactly in where NaN appears.
#[test]
fn fully_masked_rows_are_nan_in_both_paths() {
    for keep in [true, false] {
        let mask = if keep { MaskSpec::Keep(vec![6, 5]) } else { MaskSpec::Add(vec![6, 5]) };
        let c = DiffCase::new(&[1, 6, 8], &[1, 5, 8], &[1, 5, 4], false, mask);
        let mut data = diff_data(&c, 9);
        // Row 2 keeps no key.
        data.mask_b = (0..30).map(|i| i / 5 != 2).collect();
        data.mask_f = (0..30).map(|i| if i / 5 == 2 { f32::NEG_INFINITY } else { 0.5 }).collect();
        let want = diff_run(&Device::cpu(), &c, &data, nn::scaled_dot_product_attention_unfused);
        assert!(want[0][8..12].iter().all(|x| x.is_nan()) && want[0][..8].iter().all(|x| x.is_finite()));
        // The additive mask passes NaN back to row 2's query; the keep
        // mask passes 0.
        assert_eq!(want[1][16..24].iter().all(|x| x.is_nan()), !keep);
        let mut devs = vec![("cpu", Device::cpu())];
        // The GPU forms take the keep mask (whose zero gradients are their
        // own code); the additive mask is plain arithmetic there.
        devs.extend(form_devices().iter().filter(|(n, _)| keep || *n != "gpu forms").cloned());
        for (name, dev) in devs {
            let got = diff_run(&dev, &c, &data, nn::scaled_dot_product_attention);
            for k in 0..4 {
                common::assert_close(&got[k], &want[k], 1e-4, 1e-5, &format!("part {k} on {name} (keep {keep})"));
            }
        }
    }
}

/// NaN and dead rows through the GPU forms' forward (the flash form at
/// head dim 64) and backward, against the CPU's fused kernels: a NaN in
/// one query poisons its row only, a NaN in a key poisons the rows that
/// see it (causal: from that key's index on), a row whose keys the mask
/// removes is NaN with a log-sum-exp of -inf, an infinite score is NaN in
/// its row; every other row stays finite and matches.
#[test]
fn nan_and_dead_rows_match_the_cpu_on_every_form() {
    let c = DiffCase::new(&[1, 70, 64], &[1, 45, 64], &[1, 45, 64], true, MaskSpec::Add(vec![70, 45]));
    let mut data = diff_data(&c, 31);
    data.mask_f = (0..70 * 45).map(|i| if i / 45 == 10 { f32::NEG_INFINITY } else { 0.25 }).collect();
    data.q[3 * 64 + 7] = f32::NAN;
    data.k[40 * 64 + 1] = f32::NAN;
    data.q[20 * 64 + 5] = f32::INFINITY;
    let want = diff_run(&Device::cpu(), &c, &data, nn::scaled_dot_product_attention);
    let row_nan = |r: usize| want[0][r * 64..(r + 1) * 64].iter().all(|x| x.is_nan());
    assert!(row_nan(3) && row_nan(10) && row_nan(20) && row_nan(41) && !row_nan(0) && !row_nan(39));
    for (name, dev) in form_devices() {
        let got = diff_run(dev, &c, &data, nn::scaled_dot_product_attention);
        for k in 0..4 {
            common::assert_close(&got[k], &want[k], 1e-4, 1e-5, &format!("part {k} on {name}"));
        }
    }
}

/// The fused path's graph holds nothing of the scores' size and its
/// buffers stay far below one score matrix, where the composition's do
/// not (so the check can fail); on wgpu it runs four attention-related
/// kernels (output with log-sum-exp, delta, dQ, dK with dV) and nothing on
/// the CPU fallback.
#[test]
fn fused_path_never_materializes_the_scores_and_never_falls_back() {
    let (b, t, s, d) = (4, 256, 256, 4);
    let scores = format!("[{b}, {t}, {s}]");
    let c = DiffCase::new(&[b, t, d], &[b, s, d], &[b, s, d], true, MaskSpec::None);
    let data = diff_data(&c, 3);
    let record = |dev: &Device, fused: bool| -> Vec<Tensor> {
        let leaf = |v: &[f32], dims: &[usize]| {
            Tensor::from_slice(v, dims.to_vec(), dev).unwrap().requires_grad_(true).unwrap()
        };
        let (q, k, v) = (leaf(&data.q, &c.q), leaf(&data.k, &c.k), leaf(&data.v, &c.v));
        let f = if fused { nn::scaled_dot_product_attention } else { nn::scaled_dot_product_attention_unfused };
        let o = f(&q, &k, &v, &AttentionOptions::causal()).unwrap();
        o.sum(&[], false).unwrap().backward().unwrap();
        vec![o, q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()]
    };
    for dev in common::devices() {
        for fused in [true, false] {
            let ts = record(&dev, fused);
            let refs: Vec<&Tensor> = ts.iter().collect();
            let ir = lazuli::debug::ir_text(&refs);
            assert_eq!(ir.contains(&scores), !fused, "fused {fused} on {}: scores {scores} in\n{ir}", dev.name());
        }
    }
    let score_bytes = (b * t * s * 4) as u64;
    for (name, _) in form_devices() {
        let _lock = common::metrics_lock();
        for fused in [true, false] {
            // A fresh device: its pool then holds every buffer the run made.
            let opts = lazuli::WgpuDeviceOptions {
                kernel_forms: Some(if *name == "gpu forms" {
                    lazuli::wgpu::forms::KernelForms::gpu()
                } else {
                    lazuli::wgpu::forms::KernelForms::software()
                }),
                ..Default::default()
            };
            let fresh = Device::wgpu_with(opts).unwrap();
            lazuli::metrics::reset();
            let ts = record(&fresh, fused);
            let refs: Vec<&Tensor> = ts.iter().collect();
            let kernels = lazuli::debug::backend_code(&refs).unwrap();
            lazuli::sync(&refs).unwrap();
            fresh.wait().unwrap();
            let held = fresh.pool_bytes() + fresh.bytes_in_use();
            assert_eq!(held < score_bytes, fused, "fused {fused} on {name}: {held} bytes held, scores {score_bytes}");
            if fused {
                assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{name}: {}", lazuli::metrics::report());
                let names: Vec<&str> = kernels.iter().map(|(n, _)| n.as_str()).collect();
                let attention = names.iter().filter(|n| n.contains("Attention")).count();
                assert_eq!(attention, 3, "{name}: {names:?}");
                assert!(names.iter().any(|n| n.ends_with("Attention_attention")), "{name}: {names:?}");
                assert!(names.iter().any(|n| n.ends_with("attention_grad_q")), "{name}: {names:?}");
                assert!(names.iter().any(|n| n.ends_with("attention_grad_k")), "{name}: {names:?}");
            }
            drop(ts);
        }
    }
}

/// The CPU computes f64 in f64 and f16 through f32: the fused op matches
/// the composition in those dtypes too (f64 tightly), and wgpu runs f64
/// on the CPU fallback rather than narrowing it.
#[test]
fn fused_attention_in_f64_and_f16() {
    let c = DiffCase::new(&[2, 7, 5], &[2, 9, 5], &[2, 9, 3], true, MaskSpec::Add(vec![7, 9]));
    let data = diff_data(&c, 41);
    for dtype in [DType::F64, DType::F16] {
        let run = |f: fn(&Tensor, &Tensor, &Tensor, &AttentionOptions) -> lazuli::Result<Tensor>| -> Vec<f64> {
            let dev = Device::cpu();
            let leaf = |v: &[f32], d: &[usize]| {
                Tensor::from_slice(v, d.to_vec(), &dev).unwrap().cast(dtype).unwrap().requires_grad_(true).unwrap()
            };
            let (q, k, v) = (leaf(&data.q, &c.q), leaf(&data.k, &c.k), leaf(&data.v, &c.v));
            let m = Tensor::from_slice(&data.mask_f, [7, 9], &dev).unwrap().cast(dtype).unwrap();
            let o = f(&q, &k, &v, &AttentionOptions::causal().with_mask(m)).unwrap();
            assert_eq!(o.dtype(), dtype);
            o.sum(&[], false).unwrap().backward().unwrap();
            let mut all = o.cast(DType::F64).unwrap().to_vec::<f64>().unwrap();
            for t in [&q, &k, &v] {
                all.extend(t.grad().unwrap().cast(DType::F64).unwrap().to_vec::<f64>().unwrap());
            }
            all
        };
        let (got, want) = (run(nn::scaled_dot_product_attention), run(nn::scaled_dot_product_attention_unfused));
        let tol = if dtype == DType::F64 { 1e-12 } else { 2e-2 };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{dtype} element {i}: {g} vs {w}");
        }
    }
    if let Some(gpu) = common::wgpu() {
        let _lock = common::metrics_lock();
        lazuli::metrics::reset();
        let x = Tensor::from_slice(&data.q, c.q.clone(), &gpu).unwrap().cast(DType::F64).unwrap();
        let o = x.attention(&x, &x, 0.5, false, None).unwrap();
        assert_eq!(o.to_vec::<f64>().unwrap().len(), 2 * 7 * 5);
        assert!(lazuli::metrics::counter("Fallback::attention") > 0, "{}", lazuli::metrics::report());
    }
}

/// Empty lengths: no keys gives a zero output (the composition's empty
/// sum) and zero query gradients; no queries gives empty outputs and zero
/// key and value gradients; on every backend.
#[test]
fn empty_lengths_match_the_composition() {
    for dev in common::devices() {
        for (tq, tk) in [(3, 0), (0, 5), (0, 0)] {
            let c = DiffCase::new(&[1, tq, 4], &[1, tk, 4], &[1, tk, 2], false, MaskSpec::None);
            let data = diff_data(&c, 3);
            let want = diff_run(&Device::cpu(), &c, &data, nn::scaled_dot_product_attention_unfused);
            let got = diff_run(&dev, &c, &data, nn::scaled_dot_product_attention);
            assert_eq!(got, want, "t_q {tq}, t_k {tk} on {}", dev.name());
            assert!(got.iter().flatten().all(|&x| x == 0.0), "{got:?}");
        }
    }
}
