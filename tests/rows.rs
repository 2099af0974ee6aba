//! Row kernels against the CPU reference: softmax, log-softmax, row
//! reductions (sum, mean, max over the last axis) and layer norm forward
//! and backward, at row lengths around every boundary of the cooperative
//! forms (1, 3, 4, 5, 63, 64, 65, the register bound and beyond it,
//! lengths not a multiple of 4), with NaN and -inf rows, on the GPU
//! profile with subgroups on and off (and the software profile), so that
//! lavapipe proves the held-row kernels, the subgroup combine and the
//! workgroup-memory tree. The kernels of the subgroup device are checked
//! to use subgroup shuffles where the adapter has them (it reports
//! `LAZULI_SUBGROUPS` on), and those of the other device never to.

mod common;

use lazuli::prelude::*;
use lazuli::Result;

/// Row lengths around the boundaries: lanes (powers of two), vec4
/// alignment, the most a lane holds in registers and past it (softmax:
/// `ROW_MAX_CACHED` = 16 units of 256 lanes, 4096 elements or 16384 as
/// vec4; fused row kernels: `ROWS_MAX_HELD` = 32 elements of 256 lanes,
/// 8192).
const LENGTHS: &[usize] =
    &[1, 3, 4, 5, 8, 63, 64, 65, 127, 256, 1000, 1024, 4095, 4096, 4100, 5003, 8191, 8192, 8193, 8196, 16384, 16388];

/// The wgpu devices under test, named: the GPU profile with subgroups
/// (where the adapter has them) and without, and the software profile.
fn devices() -> Vec<(&'static str, Device)> {
    if common::wgpu().is_none() {
        return Vec::new();
    }
    let with = |forms: lazuli::wgpu::forms::KernelForms, subgroups: bool| {
        let opts =
            lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), subgroups: Some(subgroups), ..Default::default() };
        Device::wgpu_with(opts).expect("a wgpu device")
    };
    vec![
        ("gpu forms, subgroups", with(lazuli::wgpu::forms::KernelForms::gpu(), true)),
        ("gpu forms, no subgroups", with(lazuli::wgpu::forms::KernelForms::gpu(), false)),
        ("software forms", with(lazuli::wgpu::forms::KernelForms::software(), true)),
    ]
}

/// Rows of `len` values in [-3, 3) with special rows: row 1 all -inf, row
/// 2 with a NaN, row 3 with a -inf among finite values, row 4 with +inf.
fn data(rows: usize, len: usize, seed: u64, special: bool) -> Vec<f32> {
    let mut x = common::rand_vec(rows * len, seed, -3.0, 3.0);
    if special && rows >= 5 {
        x[len..2 * len].fill(f32::NEG_INFINITY);
        x[2 * len + len / 2] = f32::NAN;
        x[3 * len + len / 3] = f32::NEG_INFINITY;
        x[4 * len + len - 1] = f32::INFINITY;
    }
    x
}

/// `f` of the [rows, len] tensor `x` on `dev`, read back.
fn run(dev: &Device, x: &[f32], rows: usize, len: usize, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Vec<f32> {
    let t = Tensor::from_slice(x, [rows, len], dev).unwrap();
    f(&t).unwrap().to_vec::<f32>().unwrap()
}

type RowOp = (&'static str, Box<dyn Fn(&Tensor) -> Result<Tensor>>);

fn row_ops() -> Vec<RowOp> {
    vec![
        ("softmax", Box::new(|x: &Tensor| x.softmax(-1))),
        ("log_softmax", Box::new(|x: &Tensor| x.log_softmax(-1))),
        ("sum", Box::new(|x: &Tensor| x.sum(&[-1], false))),
        ("mean", Box::new(|x: &Tensor| x.mean(&[-1], true))),
        ("max", Box::new(|x: &Tensor| x.max(&[-1], false))),
        // A prologue fused into the row kernel (GPU profile).
        ("softmax of 2x+1", Box::new(|x: &Tensor| x.mul_scalar(2.0)?.add_scalar(1.0)?.softmax(-1))),
    ]
}

#[test]
fn row_kernels_match_the_cpu_at_every_boundary() {
    let devs = devices();
    let cpu = Device::cpu();
    let mut failures = Vec::new();
    for &len in LENGTHS {
        let rows = if len >= 4096 { 5 } else { 7 };
        for special in [false, true] {
            let x = data(rows, len, len as u64 * 3 + special as u64, special);
            for (name, f) in row_ops() {
                let want = run(&cpu, &x, rows, len, f.as_ref());
                for (dname, dev) in &devs {
                    // Known and older than these kernels: llvmpipe folds
                    // the software form's per-row `v - m` of a one-element
                    // all -inf row to 0 where the reference has -inf -
                    // -inf = NaN (WGSL lets drivers assume no infinities).
                    if *dname == "software forms" && name == "log_softmax" && len == 1 && special {
                        continue;
                    }
                    let got = run(dev, &x, rows, len, f.as_ref());
                    let what = format!("{name} of [{rows}, {len}] (special rows {special}) on {dname}");
                    if let Some(m) = mismatch(&got, &want, 2e-5, 2e-5 * (len as f32).sqrt()) {
                        failures.push(format!("{what}: {m}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// The first element where `got` and `want` differ by more than
/// `atol + rtol * |want|` (NaN equals NaN).
fn mismatch(got: &[f32], want: &[f32], rtol: f32, atol: f32) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} elements, want {}", got.len(), want.len()));
    }
    got.iter().zip(want).enumerate().find_map(|(i, (&g, &w))| {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= atol + rtol * w.abs();
        (!ok).then(|| format!("element {i}: got {g}, want {w}"))
    })
}

#[test]
fn layer_norm_forward_and_backward_match_the_cpu() {
    let devs = devices();
    let cpu = Device::cpu();
    for &len in LENGTHS.iter().filter(|&&l| l > 1) {
        let rows = 6;
        let x = data(rows, len, len as u64 + 11, false);
        let w = common::rand_vec(len, 5, 0.5, 1.5);
        let b = common::rand_vec(len, 6, -0.5, 0.5);
        let dy = common::rand_vec(rows * len, 7, -1.0, 1.0);
        let go = |dev: &Device| -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
            let xt = Tensor::from_slice(&x, [rows, len], dev).unwrap().requires_grad_(true).unwrap();
            let wt = Tensor::from_slice(&w, [len], dev).unwrap().requires_grad_(true).unwrap();
            let bt = Tensor::from_slice(&b, [len], dev).unwrap().requires_grad_(true).unwrap();
            let y = lazuli::nn::layer_norm(&xt, 1, Some(&wt), Some(&bt), 1e-5).unwrap();
            let d = Tensor::from_slice(&dy, [rows, len], dev).unwrap();
            y.mul(&d).unwrap().sum(&[], false).unwrap().backward().unwrap();
            let g = |t: &Tensor| t.grad().unwrap().to_vec::<f32>().unwrap();
            (y.to_vec::<f32>().unwrap(), g(&xt), g(&wt), g(&bt))
        };
        let want = go(&cpu);
        for (dname, dev) in &devs {
            let got = go(dev);
            let what = |p: &str| format!("layer norm {p} of [{rows}, {len}] on {dname}");
            common::assert_close(&got.0, &want.0, 1e-4, 1e-4, &what("output"));
            common::assert_close(&got.1, &want.1, 1e-3, 1e-3, &what("input gradient"));
            common::assert_close(&got.2, &want.2, 1e-3, 1e-3, &what("weight gradient"));
            common::assert_close(&got.3, &want.3, 1e-3, 1e-3, &what("bias gradient"));
        }
    }
}

/// The subgroup device's row kernels shuffle where the adapter has
/// subgroups (its configuration says `LAZULI_SUBGROUPS` on); the device
/// with subgroups off never does. Its kernels differ from the other
/// device's, so no cache keyed by source can mix them.
#[test]
fn subgroup_kernels_only_where_switched_on() {
    let devs = devices();
    for (dname, dev) in &devs[..devs.len().min(2)] {
        let on = dev
            .configuration()
            .settings
            .iter()
            .find(|s| s.variable == "LAZULI_SUBGROUPS")
            .map(|s| s.value.starts_with("on"))
            .expect("the wgpu backend reports LAZULI_SUBGROUPS");
        let x = Tensor::from_slice(&data(4, 1024, 1, false), [4, 1024], dev).unwrap();
        let y = lazuli::nn::layer_norm(&x, 1, None, None, 1e-5).unwrap();
        let s = x.softmax(-1).unwrap();
        let r = x.sum(&[-1], false).unwrap();
        for t in [&y, &s, &r] {
            let code = lazuli::debug::backend_code(&[t]).unwrap();
            let shuffles = code.iter().any(|(_, src)| src.contains("subgroupShuffleXor"));
            assert_eq!(shuffles, on, "{dname}: subgroup shuffles in {code:?}");
        }
        if *dname == "gpu forms, no subgroups" {
            assert!(!on, "subgroups switched off, yet reported on");
        }
    }
}

/// Column sums (the bias gradient: a sum over the leading axis) and large
/// row reductions against the CPU: at [4096, 1024], where the GPU form
/// splits the rows into parts of 16 and adds the parts in a second pass,
/// at odd shapes around the split's thresholds, over two leading axes, and
/// an i32 sum (exact); and row reductions of [1024, 4096] read as vec4.
#[test]
fn column_sums_and_large_row_reductions_match_the_cpu() {
    let devs = devices();
    let cpu = Device::cpu();
    type Case = (&'static str, Vec<usize>, Box<dyn Fn(&Tensor) -> Result<Tensor>>);
    let cases: Vec<Case> = vec![
        ("bias gradient", vec![4096, 1024], Box::new(|x: &Tensor| x.sum(&[0], false))),
        ("column mean", vec![4096, 1024], Box::new(|x: &Tensor| x.mean(&[0], true))),
        ("column max", vec![4099, 1023], Box::new(|x: &Tensor| x.max(&[0], false))),
        ("odd column sum", vec![333, 517], Box::new(|x: &Tensor| x.sum(&[0], false))),
        ("long odd columns", vec![20001, 211], Box::new(|x: &Tensor| x.sum(&[0], false))),
        ("two leading axes", vec![16, 256, 1024], Box::new(|x: &Tensor| x.sum(&[0, 1], false))),
        ("prologue column sum", vec![4096, 1024], Box::new(|x: &Tensor| x.mul(x)?.sum(&[0], false))),
        (
            "i32 column sum",
            vec![4096, 1024],
            Box::new(|x: &Tensor| x.mul_scalar(4.0)?.cast(DType::I32)?.sum(&[0], false)?.cast(DType::F32)),
        ),
        ("large row sum", vec![1024, 4096], Box::new(|x: &Tensor| x.sum(&[-1], false))),
        ("large row max", vec![1024, 4096], Box::new(|x: &Tensor| x.max(&[-1], true))),
    ];
    let mut failures = Vec::new();
    for (name, dims, f) in &cases {
        let n: usize = dims.iter().product();
        let x = common::rand_vec(n, n as u64, -1.0, 1.0);
        let eval =
            |dev: &Device| f(&Tensor::from_slice(&x, dims.clone(), dev).unwrap()).unwrap().to_vec::<f32>().unwrap();
        let want = eval(&cpu);
        let len = (n / want.len()) as f32;
        for (dname, dev) in &devs {
            if let Some(m) = mismatch(&eval(dev), &want, 1e-4, 1e-5 * len) {
                failures.push(format!("{name} {dims:?} on {dname}: {m}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

/// Layer norm's forward and backward row kernels hold their rows at
/// C = 1024 on the GPU profile: every row kernel (one with a per-row
/// value, `rv0`) reads its inputs once into registers and never walks the
/// row in a phase loop.
#[test]
fn layer_norm_row_kernels_read_each_row_once() {
    let devs = devices();
    let Some((_, dev)) = devs.first() else { return };
    let (rows, len) = (64, 1024);
    let x = Tensor::from_slice(&data(rows, len, 3, false), [rows, len], dev).unwrap().requires_grad_(true).unwrap();
    let w = Tensor::from_slice(&common::rand_vec(len, 4, 0.5, 1.5), [len], dev).unwrap().requires_grad_(true).unwrap();
    let y = lazuli::nn::layer_norm(&x, 1, Some(&w), None, 1e-5).unwrap();
    let dy = Tensor::from_slice(&common::rand_vec(rows * len, 5, -1.0, 1.0), [rows, len], dev).unwrap();
    y.mul(&dy).unwrap().sum(&[], false).unwrap().backward().unwrap();
    let gx = x.grad().unwrap();
    for (what, t) in [("forward", &y), ("input gradient", &gx)] {
        let code = lazuli::debug::backend_code(&[t]).unwrap();
        let row_kernels: Vec<&String> = code.iter().map(|(_, s)| s).filter(|s| s.contains("rv0")).collect();
        assert!(!row_kernels.is_empty(), "{what}: no row kernel in {code:?}");
        for s in row_kernels {
            assert!(s.contains("    var x") && !s.contains("for (var j = tid"), "{what}: a row kernel not held:\n{s}");
        }
    }
}
