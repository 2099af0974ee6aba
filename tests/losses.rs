//! The PyTorch-style losses of `nn` (binary_cross_entropy_with_logits,
//! l1_loss, smooth_l1_loss, huber_loss, nll_loss, kl_div) against values
//! computed here in f64 from PyTorch's formulas, over several shapes,
//! broadcasting and edge values, on the CPU and on wgpu (with no op on the
//! CPU fallback); their gradients against central finite differences in
//! f64 (the approach of tests/gradcheck.rs) and on wgpu against the CPU
//! (again with no fallback op); and their errors.

mod common;

use lazuli::nn::{self, BceWithLogitsOptions, NllLossOptions, Reduction};
use lazuli::prelude::*;
use lazuli::{metrics, no_grad, BackendKind, Result};

const REDUCTIONS: [Reduction; 3] = [Reduction::None, Reduction::Mean, Reduction::Sum];

/// Deterministic values in `[lo, hi)` as f64 (exact f32 values).
fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f64> {
    common::rand_vec(n, seed, lo, hi).into_iter().map(f64::from).collect()
}

fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// `v` (of shape `from`) broadcast to `to` (numpy rules, aligned right).
fn bcast(v: &[f64], from: &[usize], to: &[usize]) -> Vec<f64> {
    let off = to.len() - from.len();
    (0..numel(to))
        .map(|flat| {
            let (mut rem, mut src, mut stride) = (flat, 0, 1);
            for d in (0..to.len()).rev() {
                let i = rem % to[d];
                rem /= to[d];
                if d >= off && from[d - off] != 1 {
                    src += i * stride;
                }
                if d >= off {
                    stride *= from[d - off];
                }
            }
            v[src]
        })
        .collect()
}

/// Reduces reference values as `r` does; the dims of the result.
fn reduce(v: Vec<f64>, dims: &[usize], r: Reduction) -> (Vec<f64>, Vec<usize>) {
    match r {
        Reduction::None => (v, dims.to_vec()),
        Reduction::Sum => (vec![v.iter().sum()], vec![]),
        Reduction::Mean => (vec![v.iter().sum::<f64>() / v.len() as f64], vec![]),
        Reduction::BatchMean => (vec![v.iter().sum::<f64>() / dims.first().map_or(1, |&b| b) as f64], vec![]),
    }
}

/// Runs `f` on every device and compares with `want` (dims and values);
/// on wgpu no op may run on the CPU fallback.
#[track_caller]
fn expect(what: &str, want: &(Vec<f64>, Vec<usize>), f: impl Fn(&Device) -> Result<Tensor>) {
    let _lock = common::metrics_lock();
    let want_f32: Vec<f32> = want.0.iter().map(|&v| v as f32).collect();
    for dev in common::devices() {
        let fallback0 = metrics::counter("FallbackOps");
        let out = f(&dev).unwrap();
        let got = out.to_vec::<f32>().unwrap();
        if dev.kind() != BackendKind::Cpu {
            assert_eq!(metrics::counter("FallbackOps") - fallback0, 0, "{what}: ops on the CPU fallback");
        }
        assert_eq!(out.dims(), &want.1[..], "{what} on {:?}: dims", dev.kind());
        common::assert_close(&got, &want_f32, 2e-5, 2e-6, &format!("{what} on {:?}", dev.kind()));
    }
}

fn t32(v: &[f64], dims: &[usize], dev: &Device) -> Tensor {
    let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    Tensor::from_slice(&v, dims.to_vec(), dev).unwrap()
}

fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// A case of the BCE test: its name, the weight and its dims, and whether
/// a pos_weight is given.
type BceCase<'a> = (&'a str, Option<(&'a [f64], Vec<usize>)>, bool);

/// Logits with large magnitudes mixed in (where a naive sigmoid then log
/// overflows or loses everything).
fn logits(n: usize, seed: u64) -> Vec<f64> {
    let mut v = vals(n, seed, -4.0, 4.0);
    for (i, big) in [(0, 90.0), (3, -90.0), (5, 30.0), (7, -30.0)] {
        if i < n {
            v[i] = big;
        }
    }
    v
}

#[test]
fn binary_cross_entropy_with_logits_matches_pytorch() {
    for dims in [vec![6], vec![3, 4], vec![2, 3, 5]] {
        let n = numel(&dims);
        let c = *dims.last().unwrap();
        let x = logits(n, 1);
        // Hard 0/1 targets at the large logits (the cases that must stay
        // exact), soft ones elsewhere.
        let mut y = vals(n, 2, 0.0, 1.0);
        for (i, hard) in [(0, 0.0), (3, 0.0), (5, 1.0), (7, 1.0), (1, 1.0)] {
            if i < n {
                y[i] = hard;
            }
        }
        let pos = vals(c, 3, 0.5, 3.0);
        let full_weight = vals(n, 4, 0.0, 2.0);
        let row_weight = vals(c, 5, 0.0, 2.0);
        let cases: [BceCase; 4] = [
            ("plain", None, false),
            ("pos_weight", None, true),
            ("full weight", Some((&full_weight, dims.clone())), false),
            ("row weight and pos_weight", Some((&row_weight, vec![c])), true),
        ];
        for (name, weight, with_pos) in &cases {
            let w = match weight {
                Some((w, wd)) => bcast(w, wd, &dims),
                None => vec![1.0; n],
            };
            let p = if *with_pos { bcast(&pos, &[c], &dims) } else { vec![1.0; n] };
            let per: Vec<f64> =
                (0..n).map(|i| w[i] * ((1.0 - y[i]) * x[i] + (1.0 + (p[i] - 1.0) * y[i]) * softplus(-x[i]))).collect();
            for r in REDUCTIONS {
                let want = reduce(per.clone(), &dims, r);
                expect(&format!("bce_with_logits {dims:?} {name} {r:?}"), &want, |dev| {
                    let opts = BceWithLogitsOptions {
                        weight: weight.as_ref().map(|(w, wd)| t32(w, wd, dev)),
                        pos_weight: with_pos.then(|| t32(&pos, &[c], dev)),
                        reduction: r,
                    };
                    nn::binary_cross_entropy_with_logits(&t32(&x, &dims, dev), &t32(&y, &dims, dev), &opts)
                });
            }
        }
    }
}

/// Shapes of (input, target) for the regression losses: the same shape,
/// and targets that broadcast to the input, which the losses refuse
/// (PyTorch warns and broadcasts) unless the caller expands the target.
fn regression_shapes() -> Vec<(Vec<usize>, Vec<usize>)> {
    vec![(vec![7], vec![7]), (vec![3, 4], vec![3, 4]), (vec![3, 4], vec![4]), (vec![2, 3, 5], vec![2, 1, 5])]
}

/// Checks a regression loss whose per-element value is `per(input - target)`:
/// PyTorch's values where the shapes agree or the target is expanded on
/// purpose, and an error naming both shapes where they differ.
fn check_regression(name: &str, per: impl Fn(f64) -> f64, f: impl Fn(&Tensor, &Tensor, Reduction) -> Result<Tensor>) {
    for (xd, yd) in regression_shapes() {
        let x = vals(numel(&xd), 11, -3.0, 3.0);
        let y = vals(numel(&yd), 12, -3.0, 3.0);
        let yb = bcast(&y, &yd, &xd);
        let v: Vec<f64> = x.iter().zip(&yb).map(|(a, b)| per(a - b)).collect();
        for r in REDUCTIONS {
            let want = reduce(v.clone(), &xd, r);
            expect(&format!("{name} {xd:?} vs {yd:?} {r:?}"), &want, |dev| {
                f(&t32(&x, &xd, dev), &t32(&y, &yd, dev).expand(xd.clone())?, r)
            });
            if xd != yd {
                let dev = Device::cpu();
                let e = f(&t32(&x, &xd, &dev), &t32(&y, &yd, &dev), r).expect_err("shapes differ").to_string();
                let (xs, ys) = (format!("{:?}", xd), format!("{:?}", yd));
                let op = name.split(' ').next().unwrap();
                assert!(e.contains(op) && e.contains(&xs) && e.contains(&ys), "{name}: {e}");
            }
        }
    }
}

#[test]
fn l1_loss_matches_pytorch() {
    check_regression("l1_loss", f64::abs, nn::l1_loss);
}

#[test]
fn smooth_l1_loss_matches_pytorch() {
    for beta in [0.0, 0.5, 1.0, 2.5] {
        let per = |d: f64| {
            if d.abs() < beta {
                0.5 * d * d / beta
            } else {
                d.abs() - 0.5 * beta
            }
        };
        check_regression(&format!("smooth_l1_loss beta {beta}"), per, |x, y, r| nn::smooth_l1_loss(x, y, beta, r));
    }
}

#[test]
fn huber_loss_matches_pytorch() {
    for delta in [0.5, 1.0, 2.5] {
        let per = |d: f64| {
            if d.abs() < delta {
                0.5 * d * d
            } else {
                delta * (d.abs() - 0.5 * delta)
            }
        };
        check_regression(&format!("huber_loss delta {delta}"), per, |x, y, r| nn::huber_loss(x, y, delta, r));
    }
}

/// Log-softmax over the last dim of `v` (`dims`), in f64.
fn log_softmax(v: &[f64], c: usize) -> Vec<f64> {
    v.chunks(c)
        .flat_map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            row.iter().map(move |x| x - lse).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn nll_loss_matches_pytorch() {
    let c = 4;
    for dims in [vec![5, c], vec![2, 3, c], vec![c]] {
        let rows = numel(&dims) / c;
        let logp = log_softmax(&vals(numel(&dims), 21, -3.0, 3.0), c);
        // Class indices with the ignored values -100 and 1 among them.
        let target: Vec<i64> = [2, -100, 0, 1, 3, 1, 0].iter().cycle().take(rows).copied().collect();
        let class_w = vals(c, 22, 0.2, 2.0);
        for ignore in [-100i64, 1] {
            for weighted in [false, true] {
                let (mut per, mut den) = (Vec::new(), 0.0);
                for (i, &t) in target.iter().enumerate() {
                    if t == ignore || t < 0 {
                        per.push(0.0);
                        continue;
                    }
                    let w = if weighted { class_w[t as usize] } else { 1.0 };
                    per.push(-w * logp[i * c + t as usize]);
                    den += w;
                }
                let tdims = &dims[..dims.len() - 1];
                for r in REDUCTIONS {
                    let mut want = reduce(per.clone(), tdims, r);
                    if r == Reduction::Mean {
                        // PyTorch's weighted mean: over the weights of the
                        // targets that count.
                        want.0 = vec![per.iter().sum::<f64>() / den];
                    }
                    let what = format!("nll_loss {dims:?} ignore {ignore} weighted {weighted} {r:?}");
                    expect(&what, &want, |dev| {
                        let opts = NllLossOptions {
                            weight: weighted.then(|| t32(&class_w, &[c], dev)),
                            ignore_index: ignore,
                            reduction: r,
                        };
                        let t = Tensor::from_slice(&target, tdims.to_vec(), dev)?;
                        nn::nll_loss(&t32(&logp, &dims, dev), &t, &opts)
                    });
                }
            }
        }
    }
}

#[test]
fn nll_loss_with_every_target_ignored_is_nan_for_mean_like_pytorch() {
    let dev = Device::cpu();
    let x = t32(&log_softmax(&vals(8, 23, -1.0, 1.0), 4), &[2, 4], &dev);
    let t = Tensor::from_slice(&[-100i64, -100], [2], &dev).unwrap();
    let mean = nn::nll_loss(&x, &t, &NllLossOptions::default()).unwrap().item::<f32>().unwrap();
    assert!(mean.is_nan(), "mean over no targets: got {mean}");
    let sum = NllLossOptions { reduction: Reduction::Sum, ..Default::default() };
    assert_eq!(nn::nll_loss(&x, &t, &sum).unwrap().item::<f32>().unwrap(), 0.0);
}

#[test]
fn kl_div_matches_pytorch() {
    // (input dims, target dims)
    for (xd, yd) in
        [(vec![6], vec![6]), (vec![3, 4], vec![3, 4]), (vec![3, 4], vec![4]), (vec![2, 3, 5], vec![2, 3, 5])]
    {
        let c = *xd.last().unwrap();
        let x = log_softmax(&vals(numel(&xd), 31, -2.0, 2.0), c);
        // Probabilities with exact zeros among them (xlogy gives 0 there).
        let mut y = vals(numel(&yd), 32, 0.0, 1.0);
        for i in (0..y.len()).step_by(3) {
            y[i] = 0.0;
        }
        let yb = bcast(&y, &yd, &xd);
        for log_target in [false, true] {
            let per: Vec<f64> = x
                .iter()
                .zip(&yb)
                .map(|(&a, &t)| {
                    if log_target {
                        t.exp() * (t - a)
                    } else if t == 0.0 {
                        0.0
                    } else {
                        t * (t.ln() - a)
                    }
                })
                .collect();
            for r in [Reduction::None, Reduction::Mean, Reduction::Sum, Reduction::BatchMean] {
                let want = reduce(per.clone(), &xd, r);
                expect(&format!("kl_div {xd:?} vs {yd:?} log_target {log_target} {r:?}"), &want, |dev| {
                    nn::kl_div(&t32(&x, &xd, dev), &t32(&y, &yd, dev), r, log_target)
                });
            }
        }
    }
}

// ---- gradients: central finite differences in f64 on the CPU ----

type Input = (Vec<f64>, Vec<usize>);

fn leaf(dev: &Device, (v, s): &Input, grad: bool) -> Tensor {
    let t = Tensor::from_slice(v, s.clone(), dev).unwrap();
    if grad {
        t.requires_grad_(true).unwrap()
    } else {
        t
    }
}

/// `sum(out * w)` with weights fixed by the output's size.
fn weighted(out: &Tensor) -> Result<Tensor> {
    let w = vals(out.numel(), 99, 0.5, 1.5);
    let wt = Tensor::from_slice(&w, out.shape().clone(), out.device())?;
    out.mul(&wt)?.sum(&[], false)
}

/// Checks `f`'s gradients w.r.t. the inputs at `wrt` against central
/// differences (the others are constants).
#[track_caller]
fn check_grad(name: &str, inputs: &[Input], wrt: &[usize], f: impl Fn(&Device, &[Tensor]) -> Result<Tensor>) {
    let (eps, atol, rtol) = (1e-6, 1e-7, 1e-5);
    let dev = Device::cpu();
    let leaves: Vec<Tensor> = inputs.iter().enumerate().map(|(i, x)| leaf(&dev, x, wrt.contains(&i))).collect();
    weighted(&f(&dev, &leaves).unwrap()).unwrap().backward().unwrap();
    let eval = |vs: &[Input]| -> f64 {
        no_grad(|| {
            let ts: Vec<Tensor> = vs.iter().map(|i| leaf(&dev, i, false)).collect();
            weighted(&f(&dev, &ts).unwrap()).unwrap().item::<f64>().unwrap()
        })
    };
    for &i in wrt {
        let g = leaves[i].grad().unwrap_or_else(|| panic!("{name}: no gradient for input {i}"));
        assert_eq!(g.shape(), leaves[i].shape(), "{name}: gradient shape of input {i}");
        let analytic = g.to_vec::<f64>().unwrap();
        let mut vs: Vec<Input> = inputs.to_vec();
        for (j, &a) in analytic.iter().enumerate() {
            let x0 = inputs[i].0[j];
            vs[i].0[j] = x0 + eps;
            let up = eval(&vs);
            vs[i].0[j] = x0 - eps;
            let down = eval(&vs);
            vs[i].0[j] = x0;
            let numeric = (up - down) / (2.0 * eps);
            assert!(
                (a - numeric).abs() <= atol + rtol * numeric.abs().max(a.abs()),
                "{name}: input {i} element {j}: analytic {a}, numeric {numeric}"
            );
        }
    }
}

fn inp(v: Vec<f64>, shape: &[usize]) -> Input {
    (v, shape.to_vec())
}

#[test]
fn grad_binary_cross_entropy_with_logits() {
    let x = inp(logits(12, 41).into_iter().map(|v| v.clamp(-35.0, 35.0)).collect(), &[3, 4]);
    let y = inp(vals(12, 42, 0.0, 1.0), &[3, 4]);
    let w = inp(vals(4, 43, 0.2, 2.0), &[4]);
    let p = inp(vals(4, 44, 0.5, 3.0), &[4]);
    for r in REDUCTIONS {
        check_grad(
            &format!("bce_with_logits {r:?}"),
            &[x.clone(), y.clone(), w.clone(), p.clone()],
            &[0, 1, 2, 3],
            |_, t| {
                let opts =
                    BceWithLogitsOptions { weight: Some(t[2].clone()), pos_weight: Some(t[3].clone()), reduction: r };
                nn::binary_cross_entropy_with_logits(&t[0], &t[1], &opts)
            },
        );
    }
}

#[test]
fn grad_regression_losses() {
    // Differences well away from 0 and from the thresholds 0.5 and 1 (the
    // kinks), with a target broadcast on purpose (its gradient sums over
    // the broadcast rows).
    let x = inp(vec![-2.7, -1.3, -0.8, -0.3, -0.1, 0.2, 0.35, 0.7, 1.2, 1.6, 2.2, 3.1], &[3, 4]);
    let y = inp(vec![0.02, -0.04, 0.03, 0.0], &[4]);
    for r in REDUCTIONS {
        let both = [x.clone(), y.clone()];
        check_grad(&format!("l1_loss {r:?}"), &both, &[0, 1], |_, t| nn::l1_loss(&t[0], &t[1].expand([3, 4])?, r));
        for beta in [0.0, 0.5, 1.0] {
            check_grad(&format!("smooth_l1_loss {beta} {r:?}"), &both, &[0, 1], |_, t| {
                nn::smooth_l1_loss(&t[0], &t[1].expand([3, 4])?, beta, r)
            });
        }
        for delta in [0.5, 1.0] {
            check_grad(&format!("huber_loss {delta} {r:?}"), &both, &[0, 1], |_, t| {
                nn::huber_loss(&t[0], &t[1].expand([3, 4])?, delta, r)
            });
        }
    }
}

#[test]
fn grad_nll_loss() {
    let x = inp(log_softmax(&vals(20, 51, -2.0, 2.0), 4), &[5, 4]);
    let w = inp(vals(4, 52, 0.2, 2.0), &[4]);
    let target = [2i64, 1, 0, -100, 3];
    for r in REDUCTIONS {
        for ignore in [-100, 1] {
            check_grad(&format!("nll_loss ignore {ignore} {r:?}"), &[x.clone(), w.clone()], &[0, 1], |dev, t| {
                let opts = NllLossOptions { weight: Some(t[1].clone()), ignore_index: ignore, reduction: r };
                nn::nll_loss(&t[0], &Tensor::from_slice(&target, [5], dev)?, &opts)
            });
        }
    }
}

#[test]
fn grad_kl_div() {
    let x = inp(log_softmax(&vals(12, 61, -2.0, 2.0), 4), &[3, 4]);
    let y = inp(vals(12, 62, 0.05, 1.0), &[3, 4]);
    let log_y = inp(vals(12, 63, -3.0, 0.0), &[3, 4]);
    for r in [Reduction::None, Reduction::Mean, Reduction::Sum, Reduction::BatchMean] {
        check_grad(&format!("kl_div {r:?}"), &[x.clone(), y.clone()], &[0, 1], |_, t| {
            nn::kl_div(&t[0], &t[1], r, false)
        });
        check_grad(&format!("kl_div log_target {r:?}"), &[x.clone(), log_y.clone()], &[0, 1], |_, t| {
            nn::kl_div(&t[0], &t[1], r, true)
        });
    }
    // A zero target gives a finite gradient w.r.t. the input (no 0 * -inf).
    let dev = Device::cpu();
    let xs = leaf(&dev, &x, true);
    let mut zeros = y.clone();
    zeros.0[0] = 0.0;
    nn::kl_div(&xs, &leaf(&dev, &zeros, false), Reduction::Sum, false).unwrap().backward().unwrap();
    let g = xs.grad().unwrap().to_vec::<f64>().unwrap();
    assert_eq!(g[0], 0.0, "kl_div: gradient at a zero target");
    assert!(g.iter().all(|v| v.is_finite()), "kl_div: gradient {g:?}");
}

// ---- errors ----

#[track_caller]
fn expect_err(r: Result<Tensor>, words: &[&str]) {
    let e = match r {
        Ok(_) => panic!("expected an error mentioning {words:?}"),
        Err(e) => e.to_string(),
    };
    for w in words {
        assert!(e.contains(w), "error {e:?} should mention {w:?}");
    }
    assert!(e.contains("losses.rs"), "error {e:?} should name the caller's location");
}

/// Class indices for a `[3, 4]` input.
fn class_indices(dev: &Device) -> Tensor {
    Tensor::from_slice(&[0i64, 1, 2], [3], dev).unwrap()
}

#[test]
fn losses_reject_bad_shapes_dtypes_and_options() {
    let dev = Device::cpu();
    let a = Tensor::zeros([3, 4], DType::F32, &dev).unwrap();
    let b = Tensor::zeros([3, 5], DType::F32, &dev).unwrap();
    let row = Tensor::zeros([4], DType::F32, &dev).unwrap();
    let m = Reduction::Mean;
    expect_err(nn::l1_loss(&a, &b, m), &["l1_loss", "[3, 4]", "[3, 5]"]);
    expect_err(nn::smooth_l1_loss(&a, &b, 1.0, m), &["smooth_l1_loss", "[3, 4]", "[3, 5]"]);
    expect_err(nn::huber_loss(&a, &b, 1.0, m), &["huber_loss", "[3, 4]", "[3, 5]"]);
    expect_err(nn::kl_div(&a, &b, m, false), &["kl_div", "[3, 4]", "[3, 5]"]);
    // PyTorch demands the target's shape exactly here, not a broadcast.
    let bce = BceWithLogitsOptions::default();
    expect_err(
        nn::binary_cross_entropy_with_logits(&a, &row, &bce),
        &["binary_cross_entropy_with_logits", "[3, 4]", "[4]"],
    );
    let bad_pos =
        BceWithLogitsOptions { pos_weight: Some(Tensor::zeros([5], DType::F32, &dev).unwrap()), ..Default::default() };
    expect_err(nn::binary_cross_entropy_with_logits(&a, &a, &bad_pos), &["pos_weight", "[5]", "[3, 4]"]);
    // BatchMean is kl_div's alone.
    for r in [
        nn::l1_loss(&a, &a, Reduction::BatchMean),
        nn::smooth_l1_loss(&a, &a, 1.0, Reduction::BatchMean),
        nn::huber_loss(&a, &a, 1.0, Reduction::BatchMean),
        nn::binary_cross_entropy_with_logits(
            &a,
            &a,
            &BceWithLogitsOptions { reduction: Reduction::BatchMean, ..Default::default() },
        ),
    ] {
        expect_err(r, &["BatchMean", "kl_div only"]);
    }
    let ce = nn::CrossEntropyOptions { reduction: Reduction::BatchMean, ..Default::default() };
    expect_err(nn::cross_entropy_with(&a, &class_indices(&dev), &ce), &["cross_entropy", "kl_div only"]);
    assert!(nn::kl_div(&a, &a, Reduction::BatchMean, false).is_ok());
    expect_err(nn::smooth_l1_loss(&a, &a, -1.0, m), &["smooth_l1_loss", "beta", "-1"]);
    expect_err(nn::huber_loss(&a, &a, 0.0, m), &["huber_loss", "delta"]);
    let ints = Tensor::zeros([3, 4], DType::I32, &dev).unwrap();
    expect_err(nn::l1_loss(&a, &ints, m), &["l1_loss", "f32", "i32"]);
    // nll_loss: target of the input's leading dims, integer; weight [classes].
    let t3 = Tensor::zeros([3], DType::I64, &dev).unwrap();
    let t4 = Tensor::zeros([4], DType::I64, &dev).unwrap();
    expect_err(nn::nll_loss(&a, &t4, &NllLossOptions::default()), &["nll_loss", "[3, 4]", "[4]"]);
    expect_err(
        nn::nll_loss(&a, &Tensor::zeros([3], DType::F32, &dev).unwrap(), &NllLossOptions::default()),
        &["nll_loss", "f32"],
    );
    let bad_w = NllLossOptions { weight: Some(Tensor::zeros([5], DType::F32, &dev).unwrap()), ..Default::default() };
    expect_err(nn::nll_loss(&a, &t3, &bad_w), &["nll_loss", "weight", "[5]"]);
    let bm = NllLossOptions { reduction: Reduction::BatchMean, ..Default::default() };
    expect_err(nn::nll_loss(&a, &t3, &bm), &["nll_loss", "kl_div only"]);
}

/// Every new loss with its input's gradient, for the wgpu-vs-CPU check.
fn loss_and_grad(dev: &Device, which: usize) -> Result<(f32, Vec<f32>)> {
    let x = t32(&log_softmax(&vals(12, 71, -2.0, 2.0), 4), &[3, 4], dev).requires_grad_(true)?;
    let y = t32(&vals(12, 72, 0.0, 1.0), &[3, 4], dev);
    let row = t32(&vals(4, 73, 0.5, 2.0), &[4], dev);
    let m = Reduction::Mean;
    let loss = match which {
        0 => nn::binary_cross_entropy_with_logits(
            &x,
            &y,
            &BceWithLogitsOptions { weight: Some(row.clone()), pos_weight: Some(row), reduction: m },
        )?,
        1 => nn::l1_loss(&x, &y, m)?,
        2 => nn::smooth_l1_loss(&x, &y, 0.5, m)?,
        3 => nn::huber_loss(&x, &y, 0.5, m)?,
        4 => {
            let t = Tensor::from_slice(&[2i64, -100, 1], [3], dev)?;
            nn::nll_loss(&x, &t, &NllLossOptions { weight: Some(row), ..Default::default() })?
        }
        _ => nn::kl_div(&x, &y, Reduction::BatchMean, false)?,
    };
    loss.backward()?;
    Ok((loss.item::<f32>()?, x.grad().expect("a gradient").to_vec::<f32>()?))
}

#[test]
fn wgpu_gradients_match_the_cpu_with_no_fallback() {
    let Some(gpu) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    for which in 0..6 {
        let (want_loss, want_grad) = loss_and_grad(&Device::cpu(), which).unwrap();
        let fallback0 = metrics::counter("FallbackOps");
        let (loss, grad) = loss_and_grad(&gpu, which).unwrap();
        assert_eq!(metrics::counter("FallbackOps") - fallback0, 0, "loss {which}: backward ops on the CPU fallback");
        common::assert_close(&[loss], &[want_loss], 1e-5, 1e-6, &format!("loss {which}"));
        common::assert_close(&grad, &want_grad, 1e-5, 1e-6, &format!("loss {which}: gradient"));
    }
}

/// The classic regression bug: a `[n, 1]` prediction against an `[n]`
/// target, which PyTorch warns about and broadcasts to `[n, n]`.
#[test]
fn regression_losses_refuse_mismatched_shapes() {
    let dev = Device::cpu();
    let pred = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4, 1], &dev).unwrap();
    let target = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [4], &dev).unwrap();
    let line = line!() + 1;
    let e = nn::mse(&pred, &target).unwrap_err().to_string();
    for part in ["mse", "[4, 1]", "[4]", "[4, 4]", "target.reshape([4, 1])"] {
        assert!(e.contains(part), "{e:?} should mention {part:?}");
    }
    assert!(e.contains(&format!("{}:{line}", file!())), "{e}");
    for r in [Reduction::Mean, Reduction::Sum] {
        assert!(nn::l1_loss(&pred, &target, r).is_err());
        assert!(nn::smooth_l1_loss(&pred, &target, 1.0, r).is_err());
        assert!(nn::huber_loss(&pred, &target, 1.0, r).is_err());
    }
    let opts = BceWithLogitsOptions::default();
    assert!(nn::binary_cross_entropy_with_logits(&pred, &target, &opts).is_err());
    // Reshaped, the loss is what it should be: zero.
    let fixed = nn::mse(&pred, &target.reshape([4, 1]).unwrap()).unwrap();
    assert_eq!(fixed.item::<f32>().unwrap(), 0.0);
}
