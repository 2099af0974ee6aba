//! PyTorch-named compositions (`masked_fill`, `tril`/`triu`, `var`/`std`,
//! `logsumexp`, `repeat`, `linspace`, `gather_torch`): values against
//! PyTorch's formulas computed here, on the CPU and on wgpu with no
//! fallback op in f32; gradients against central finite differences in
//! f64 on the CPU; and errors naming the op.

mod common;

use lazuli::prelude::*;
use lazuli::{no_grad, Result};

/// Runs `f` on every device and checks the f32 result against `want`,
/// with no op falling back to the CPU.
#[track_caller]
fn on_devices(what: &str, want: &[f32], shape: &[usize], f: impl Fn(&Device) -> Result<Tensor>) {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        lazuli::metrics::reset();
        let out = f(&dev).unwrap();
        assert_eq!(out.dims(), shape, "{what} on {}: shape", dev.name());
        let got = out.to_vec::<f32>().unwrap();
        common::assert_close(&got, want, 1e-5, 1e-5, &format!("{what} on {}", dev.name()));
        assert_eq!(
            lazuli::metrics::counter("FallbackOps"),
            0,
            "{what} on {}: {}",
            dev.name(),
            lazuli::metrics::report()
        );
    }
}

fn t32(dev: &Device, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape.to_vec(), dev).unwrap()
}

/// `sum(f(x) * w)` gradients against central differences, in f64 on the CPU.
#[track_caller]
fn gradcheck(name: &str, x: &[f64], shape: &[usize], f: impl Fn(&Tensor) -> Result<Tensor>) {
    let dev = Device::cpu();
    let loss = |t: &Tensor| -> Result<Tensor> {
        let out = f(t)?;
        let w: Vec<f64> = common::rand_vec(out.numel(), 99, 0.5, 1.5).into_iter().map(f64::from).collect();
        out.mul(&Tensor::from_slice(&w, out.shape().clone(), &dev)?)?.sum(&[], false)
    };
    let leaf = Tensor::from_slice(x, shape.to_vec(), &dev).unwrap().requires_grad_(true).unwrap();
    loss(&leaf).unwrap().backward().unwrap();
    let analytic = leaf.grad().map(|g| g.to_vec::<f64>().unwrap()).unwrap_or_else(|| vec![0.0; x.len()]);
    let eval = |v: &[f64]| {
        no_grad(|| loss(&Tensor::from_slice(v, shape.to_vec(), &dev).unwrap()).unwrap().item::<f64>().unwrap())
    };
    let eps = 1e-6;
    for (j, &a) in analytic.iter().enumerate() {
        let mut v = x.to_vec();
        v[j] = x[j] + eps;
        let up = eval(&v);
        v[j] = x[j] - eps;
        let numeric = (up - eval(&v)) / (2.0 * eps);
        assert!(
            (a - numeric).abs() <= 1e-6 + 1e-5 * numeric.abs(),
            "{name}: element {j}: analytic {a}, numeric {numeric}"
        );
    }
}

fn vals64(n: usize, seed: u64) -> Vec<f64> {
    common::rand_vec(n, seed, -2.0, 2.0).into_iter().map(f64::from).collect()
}

/// The error's message, which must name `op`.
#[track_caller]
fn err_names(r: Result<Tensor>, op: &str, also: &str) {
    let msg = r.expect_err("an error").to_string();
    assert!(msg.contains(op) && msg.contains(also), "{msg:?} should name {op} and {also}");
}

// ---- masked_fill ----

#[test]
fn masked_fill_broadcasts_a_row_mask() {
    let x = common::rand_vec(12, 1, -1.0, 1.0);
    let m = [1.0f32, 0.0, 0.0, 1.0];
    let want: Vec<f32> = (0..12).map(|i| if m[i % 4] > 0.5 { -7.5 } else { x[i] }).collect();
    on_devices("masked_fill", &want, &[3, 4], |d| {
        let mask = t32(d, &m, &[4]).gt_scalar(0.5)?;
        t32(d, &x, &[3, 4]).masked_fill(&mask, -7.5)
    });
    let dev = Device::cpu();
    let y = Tensor::from_slice(&[1i32, 2, 3], [3], &dev).unwrap();
    let mask = t32(&dev, &[0.0, 1.0, 0.0], &[3]).gt_scalar(0.5).unwrap();
    assert_eq!(y.masked_fill(&mask, 9).unwrap().to_vec::<i32>().unwrap(), vec![1, 9, 3]);
}

#[test]
fn masked_fill_gradient_skips_filled_positions() {
    let m = [1.0f64, 0.0, 1.0, 0.0, 0.0, 1.0];
    gradcheck("masked_fill", &vals64(6, 2), &[2, 3], |x| {
        let mask = Tensor::from_slice(&m, [2, 3], x.device())?.gt_scalar(0.5)?;
        x.masked_fill(&mask, 3.0)
    });
}

#[test]
fn masked_fill_errors_name_the_op() {
    let dev = Device::cpu();
    let x = t32(&dev, &[0.0; 6], &[2, 3]);
    err_names(x.masked_fill(&t32(&dev, &[0.0; 3], &[3]), 1.0), "masked_fill", "bool");
    let wide = t32(&dev, &[0.0; 4], &[4]).gt_scalar(0.5).unwrap();
    err_names(x.masked_fill(&wide, 1.0), "masked_fill", "[4]");
    let y = Tensor::from_slice(&[1i32, 2, 3], [3], &dev).unwrap();
    let m = t32(&dev, &[0.0; 3], &[3]).gt_scalar(0.5).unwrap();
    err_names(y.masked_fill(&m, 1.5), "masked_fill", "i32");
}

// ---- tril / triu ----

fn triangle(x: &[f32], b: usize, n: usize, m: usize, k: i64, upper: bool) -> Vec<f32> {
    (0..b * n * m)
        .map(|e| {
            let (i, j) = (((e / m) % n) as i64, (e % m) as i64);
            let keep = if upper { j - i >= k } else { j - i <= k };
            if keep {
                x[e]
            } else {
                0.0
            }
        })
        .collect()
}

#[test]
fn tril_and_triu_match_pytorch() {
    let x = common::rand_vec(2 * 3 * 4, 3, -1.0, 1.0);
    for k in [-5i64, -1, 0, 1, 2, 9] {
        on_devices(&format!("tril({k})"), &triangle(&x, 2, 3, 4, k, false), &[2, 3, 4], |d| {
            t32(d, &x, &[2, 3, 4]).tril(k)
        });
        on_devices(&format!("triu({k})"), &triangle(&x, 2, 3, 4, k, true), &[2, 3, 4], |d| {
            t32(d, &x, &[2, 3, 4]).triu(k)
        });
    }
}

#[test]
fn tril_triu_gradients_and_errors() {
    gradcheck("tril", &vals64(12, 4), &[3, 4], |x| x.tril(1));
    gradcheck("triu", &vals64(12, 5), &[4, 3], |x| x.triu(-1));
    let x = t32(&Device::cpu(), &[1.0, 2.0, 3.0], &[3]);
    err_names(x.tril(0), "tril", "[3]");
    err_names(x.triu(0), "triu", "[3]");
}

// ---- var / std ----

/// PyTorch's variance of rows of length `n` (`x` is `[r, n]`).
fn row_var(x: &[f32], n: usize, correction: f64) -> Vec<f32> {
    x.chunks(n)
        .map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let ss: f64 = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum();
            (ss / (n as f64 - correction).max(0.0)) as f32
        })
        .collect()
}

#[test]
fn var_and_std_match_pytorch() {
    let x = common::rand_vec(15, 6, -3.0, 3.0);
    for c in [0.0, 1.0, 2.5] {
        let v = row_var(&x, 5, c);
        on_devices(&format!("var(c={c})"), &v, &[3], |d| t32(d, &x, &[3, 5]).var(&[-1], c, false));
        let s: Vec<f32> = v.iter().map(|v| v.sqrt()).collect();
        on_devices(&format!("std(c={c})"), &s, &[3, 1], |d| t32(d, &x, &[3, 5]).std(&[1], c, true));
    }
    on_devices("var over all", &row_var(&x, 15, 1.0), &[], |d| t32(d, &x, &[3, 5]).var(&[], 1.0, false));
    // Columns: the transpose's rows.
    let xt: Vec<f32> = (0..15).map(|e| x[(e % 3) * 5 + e / 3]).collect();
    on_devices("var over dim 0", &row_var(&xt, 3, 1.0), &[5], |d| t32(d, &x, &[3, 5]).var(&[0], 1.0, false));
    // One element with correction 1: 0 / 0, NaN as in PyTorch.
    let one = t32(&Device::cpu(), &[2.0], &[1]).var(&[0], 1.0, false).unwrap();
    assert!(one.item::<f32>().unwrap().is_nan());
}

#[test]
fn var_std_gradients_and_errors() {
    gradcheck("var", &vals64(12, 7), &[3, 4], |x| x.var(&[1], 1.0, false));
    gradcheck("std", &vals64(12, 8), &[3, 4], |x| x.std(&[0], 0.0, true));
    let dev = Device::cpu();
    err_names(t32(&dev, &[1.0; 4], &[2, 2]).var(&[2], 1.0, false), "var", "[2, 2]");
    err_names(Tensor::from_slice(&[1i32, 2], [2], &dev).unwrap().std(&[0], 1.0, false), "std", "i32");
}

// ---- logsumexp ----

#[test]
fn logsumexp_matches_pytorch_including_infinite_rows() {
    let inf = f32::INFINITY;
    let x = vec![1.0f32, 2.0, 3.0, 100.0, 101.0, 99.0, -inf, -inf, -inf, -inf, 0.5, inf];
    let want: Vec<f32> = x
        .chunks(3)
        .map(|r| {
            let m = r.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
            let m = if m.is_infinite() { 0.0 } else { m };
            (m + r.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()) as f32
        })
        .collect();
    assert_eq!(want[2], -inf);
    assert_eq!(want[3], inf);
    on_devices("logsumexp", &want, &[4], |d| t32(d, &x, &[4, 3]).logsumexp(&[1], false));
    on_devices("logsumexp keepdim", &want, &[4, 1], |d| t32(d, &x, &[4, 3]).logsumexp(&[-1], true));
}

#[test]
fn logsumexp_gradient_and_errors() {
    gradcheck("logsumexp", &vals64(12, 9), &[3, 4], |x| x.logsumexp(&[1], false));
    gradcheck("logsumexp all", &vals64(6, 10), &[2, 3], |x| x.logsumexp(&[], true));
    let dev = Device::cpu();
    err_names(t32(&dev, &[1.0; 4], &[2, 2]).logsumexp(&[-3], false), "logsumexp", "[2, 2]");
    err_names(Tensor::from_slice(&[1i32, 2], [2], &dev).unwrap().logsumexp(&[0], false), "logsumexp", "i32");
}

// ---- repeat ----

#[test]
fn repeat_matches_pytorch() {
    let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    // torch.tensor([[1,2,3],[4,5,6]]).repeat(2, 1, 2): out[a][i][j] = x[i][j % 3].
    let want: Vec<f32> = (0..2 * 2 * 6).map(|e| x[((e / 6) % 2) * 3 + (e % 6) % 3]).collect();
    on_devices("repeat", &want, &[2, 2, 6], |d| t32(d, &x, &[2, 3]).repeat(&[2, 1, 2]));
    let want: Vec<f32> = (0..12).map(|e| x[e % 6]).collect();
    on_devices("repeat rows", &want, &[4, 3], |d| t32(d, &x, &[2, 3]).repeat(&[2, 1]));
}

#[test]
fn repeat_gradient_and_errors() {
    gradcheck("repeat", &vals64(6, 11), &[2, 3], |x| x.repeat(&[2, 3, 1]));
    err_names(t32(&Device::cpu(), &[1.0; 6], &[2, 3]).repeat(&[2]), "repeat", "[2, 3]");
}

// ---- linspace ----

#[test]
fn linspace_matches_pytorch_with_exact_ends() {
    for (start, end, steps) in [(0.0f64, 1.0f64, 5usize), (-3.0, 7.3, 11), (2.5, -1.0, 4), (0.1, 0.7, 7)] {
        let step = (end - start) / (steps - 1) as f64;
        let want: Vec<f32> = (0..steps)
            .map(|i| if i < steps / 2 { start + i as f64 * step } else { end - (steps - 1 - i) as f64 * step } as f32)
            .collect();
        on_devices(&format!("linspace({start}, {end}, {steps})"), &want, &[steps], |d| {
            Tensor::linspace(start, end, steps, DType::F32, d)
        });
        let got = Tensor::linspace(start, end, steps, DType::F32, &Device::cpu()).unwrap().to_vec::<f32>().unwrap();
        assert_eq!((got[0], got[steps - 1]), (start as f32, end as f32), "ends are exact");
    }
    let dev = Device::cpu();
    assert_eq!(Tensor::linspace(4.0, 9.0, 1, DType::F32, &dev).unwrap().to_vec::<f32>().unwrap(), vec![4.0]);
    assert_eq!(Tensor::linspace(4.0, 9.0, 0, DType::F32, &dev).unwrap().dims(), &[0]);
    let e = Tensor::linspace(0.0, 1.0, 3, DType::I32, &dev).expect_err("an error").to_string();
    assert!(e.contains("linspace") && e.contains("i32"), "{e}");
    let e = Tensor::linspace(0.0, f64::NAN, 3, DType::F32, &dev).expect_err("an error").to_string();
    assert!(e.contains("linspace") && e.contains("NaN"), "{e}");
}

// ---- gather_torch ----

#[test]
fn gather_torch_matches_pytorch() {
    let x = common::rand_vec(24, 12, -1.0, 1.0); // [2, 3, 4]
    let idx = [2i32, 0, 1, -1, 0, 0, 2, 1]; // [2, 2, 2] along dim 1
    let want: Vec<f32> = (0..8)
        .map(|e| {
            let (a, c) = (e / 4, e % 2);
            let i = idx[e].rem_euclid(3) as usize;
            x[a * 12 + i * 4 + c]
        })
        .collect();
    on_devices("gather_torch dim 1", &want, &[2, 2, 2], |d| {
        t32(d, &x, &[2, 3, 4]).gather_torch(1, &Tensor::from_slice(&idx, [2, 2, 2], d)?)
    });
    let idx0 = [1i32, 0, 1, 1, 0, 1]; // [1, 2, 3] along dim 0
    let want: Vec<f32> = (0..6).map(|e| x[idx0[e] as usize * 12 + (e / 3) * 4 + e % 3]).collect();
    on_devices("gather_torch dim 0", &want, &[1, 2, 3], |d| {
        t32(d, &x, &[2, 3, 4]).gather_torch(0, &Tensor::from_slice(&idx0, [1, 2, 3], d)?)
    });
}

#[test]
fn gather_torch_gradient_and_errors() {
    let idx = [0i32, 2, 2, 1, 0, 0];
    gradcheck("gather_torch", &vals64(12, 13), &[3, 4], |x| {
        x.gather_torch(0, &Tensor::from_slice(&idx, [2, 3], x.device())?)
    });
    let dev = Device::cpu();
    let x = t32(&dev, &[1.0; 6], &[2, 3]);
    err_names(x.gather_torch(0, &Tensor::from_slice(&[0i32; 3], [3], &dev).unwrap()), "gather_torch", "[3]");
    err_names(x.gather_torch(0, &Tensor::from_slice(&[0i32; 8], [2, 4], &dev).unwrap()), "gather_torch", "[2, 4]");
    err_names(x.gather_torch(0, &t32(&dev, &[0.0; 6], &[2, 3])), "gather_torch", "f32");
    err_names(x.gather_torch(2, &Tensor::from_slice(&[0i32; 6], [2, 3], &dev).unwrap()), "gather_torch", "[2, 3]");
    let bad = x.gather_torch(0, &Tensor::from_slice(&[0i32, 5, 0], [1, 3], &dev).unwrap()).unwrap();
    let e = bad.to_vec::<f32>().expect_err("an index outside the dim fails at the barrier").to_string();
    assert!(e.contains("index 5") && e.contains("size 2"), "{e}");
}

#[test]
fn repeat_by_zero_is_empty_and_gather_torch_takes_i64_indices() {
    // 64-bit indices are narrowed on the CPU fallback on wgpu, which other
    // tests' fallback counts must not see.
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        let x = t32(&dev, &[1.0, 2.0, 3.0], &[3]);
        assert_eq!(x.repeat(&[0, 2]).unwrap().dims(), &[0, 6], "on {}", dev.name());
        let idx = Tensor::from_slice(&[2i64, -3, 1], [3], &dev).unwrap();
        assert_eq!(x.gather_torch(0, &idx).unwrap().to_vec::<f32>().unwrap(), vec![3.0, 1.0, 2.0], "on {}", dev.name());
    }
}

/// A function of one tensor, the subject of a gradient check.
type UnaryFn = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

/// The f32 gradient of `sum(f(x) * w)` on `dev`.
fn grad_f32(dev: &Device, x: &[f32], shape: &[usize], f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Vec<f32> {
    let leaf = t32(dev, x, shape).requires_grad_(true).unwrap();
    let out = f(&leaf).unwrap();
    let w = t32(dev, &common::rand_vec(out.numel(), 98, 0.5, 1.5), out.dims());
    out.mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
    leaf.grad().expect("a gradient").to_vec::<f32>().unwrap()
}

#[test]
fn f32_gradients_agree_across_devices_without_fallback() {
    let idx = [0i32, 2, 2, 1, 0, 0];
    let cases: Vec<(&str, UnaryFn)> = vec![
        ("masked_fill", Box::new(|x| x.masked_fill(&x.gt_scalar(0.0)?, 1.0))),
        ("tril", Box::new(|x| x.tril(0))),
        ("var", Box::new(|x| x.var(&[1], 1.0, false))),
        ("std", Box::new(|x| x.std(&[0], 1.0, true))),
        ("logsumexp", Box::new(|x| x.logsumexp(&[1], false))),
        ("repeat", Box::new(|x| x.repeat(&[2, 1, 3]))),
        ("gather_torch", Box::new(move |x| x.gather_torch(0, &Tensor::from_slice(&idx, [2, 3], x.device())?))),
    ];
    let x = common::rand_vec(12, 14, -2.0, 2.0);
    let _lock = common::metrics_lock();
    for (name, f) in &cases {
        let want = grad_f32(&Device::cpu(), &x, &[3, 4], f.as_ref());
        for dev in common::devices() {
            lazuli::metrics::reset();
            let got = grad_f32(&dev, &x, &[3, 4], f.as_ref());
            common::assert_close(&got, &want, 1e-5, 1e-5, &format!("{name} gradient on {}", dev.name()));
            assert_eq!(
                lazuli::metrics::counter("FallbackOps"),
                0,
                "{name} on {}: {}",
                dev.name(),
                lazuli::metrics::report()
            );
        }
    }
}
