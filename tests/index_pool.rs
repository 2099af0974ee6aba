//! Gather, scatter-add and pooling (forward and gradient) on wgpu against
//! the CPU reference, in both kernel-form profiles: every axis, negative
//! and repeated indices, u32 and 2-d indices, size-1 and zero-size dims,
//! several index chunks and row blocks for the GPU scatter-add; strides,
//! padding, dilation, ceil mode and both average divisors for pooling.
//! An index out of range is an error at the barrier naming the op, the
//! index and the dim, and the device computes the next graph correctly;
//! none of these ops falls back to the CPU on wgpu.

mod common;
use lazuli::ir::{PoolAttrs, PoolKind};
use lazuli::metrics;
use lazuli::prelude::*;
use lazuli::{BackendError, ExecError};

fn f32s(dev: &Device, dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = common::rand_vec(n, seed, -3.0, 3.0).into_iter().map(|x| (x * 8.0).round() / 8.0).collect();
    Tensor::from_slice(&v, dims.to_vec(), dev).unwrap()
}

fn i32s(dev: &Device, v: &[i32], dims: &[usize]) -> Tensor {
    Tensor::from_slice(v, dims.to_vec(), dev).unwrap()
}

/// Indices in `-n..n` (both ends, repeats), `count` of them.
fn idx(n: usize, count: usize, seed: u64) -> Vec<i32> {
    common::rand_vec(count, seed, 0.0, 1.0).into_iter().map(|u| (u * 2.0 * n as f32) as i32 - n as i32).collect()
}

type Build = Box<dyn Fn(&Device) -> lazuli::Result<Tensor>>;

fn gather_case(dims: &'static [usize], axis: usize, count: &'static [usize], seed: u64) -> (String, Build) {
    let name = format!("gather {dims:?} axis {axis} by {count:?}");
    let f = move |dev: &Device| {
        let x = f32s(dev, dims, seed);
        let m: usize = count.iter().product();
        let ix = i32s(dev, &idx(dims[axis], m, seed + 7), count);
        x.gather(axis as isize, &ix)
    };
    (name, Box::new(f))
}

fn scatter_case(dims: &'static [usize], axis: usize, count: &'static [usize], seed: u64) -> (String, Build) {
    let name = format!("scatter_add {dims:?} axis {axis} by {count:?}");
    let f = move |dev: &Device| {
        let base = f32s(dev, dims, seed);
        let m: usize = count.iter().product();
        let ix = i32s(dev, &idx(dims[axis], m, seed + 7), count);
        let mut sd = dims[..axis].to_vec();
        sd.extend_from_slice(count);
        sd.extend_from_slice(&dims[axis + 1..]);
        base.scatter_add(axis as isize, &ix, &f32s(dev, &sd, seed + 3))
    };
    (name, Box::new(f))
}

fn pool_attrs(
    kind: PoolKind,
    k: &[usize],
    s: &[usize],
    pads: (&[usize], &[usize]),
    dil: &[usize],
    ceil: bool,
) -> PoolAttrs {
    PoolAttrs {
        kind,
        kernel: k.to_vec(),
        strides: s.to_vec(),
        pads_begin: pads.0.to_vec(),
        pads_end: pads.1.to_vec(),
        dilations: dil.to_vec(),
        ceil_mode: ceil,
    }
}

/// Pooling attribute sets over 1, 2 and 3 spatial dims with input dims
/// they fit.
fn pool_configs() -> Vec<(Vec<usize>, PoolAttrs)> {
    let max = PoolKind::Max;
    let avg = PoolKind::Avg { count_include_pad: false };
    let avg_pad = PoolKind::Avg { count_include_pad: true };
    let mut v = Vec::new();
    for kind in [max, avg, avg_pad] {
        v.push((vec![2, 3, 8, 8], pool_attrs(kind, &[2, 2], &[2, 2], (&[0, 0], &[0, 0]), &[1, 1], false)));
        v.push((vec![1, 2, 7, 9], pool_attrs(kind, &[3, 3], &[2, 2], (&[1, 1], &[1, 1]), &[1, 1], false)));
        v.push((vec![2, 1, 9, 6], pool_attrs(kind, &[3, 2], &[2, 1], (&[1, 0], &[0, 1]), &[2, 1], true)));
        v.push((vec![1, 3, 11], pool_attrs(kind, &[4], &[3], (&[2], &[1]), &[1], true)));
        v.push((
            vec![1, 2, 4, 5, 6],
            pool_attrs(kind, &[2, 3, 2], &[1, 2, 2], (&[1, 1, 0], &[0, 1, 1]), &[1, 1, 2], false),
        ));
        // Windows entirely inside the padding (kernel 1, pad 1).
        v.push((vec![1, 1, 3, 3], pool_attrs(kind, &[1, 1], &[1, 1], (&[1, 1], &[1, 1]), &[1, 1], false)));
        // Size-1 dims and a window over the whole input.
        v.push((vec![3, 1, 1, 5], pool_attrs(kind, &[1, 5], &[1, 1], (&[0, 0], &[0, 0]), &[1, 1], false)));
    }
    v
}

fn cases() -> Vec<(String, Build)> {
    let mut v: Vec<(String, Build)> = vec![
        gather_case(&[5, 4, 3], 0, &[7], 1),
        gather_case(&[5, 4, 3], 1, &[2, 3], 2),
        gather_case(&[5, 4, 3], 2, &[4], 3),
        gather_case(&[5, 4, 3], 1, &[], 4),
        gather_case(&[1, 1], 0, &[3], 5),
        gather_case(&[6, 1], 1, &[0], 6),
        gather_case(&[0, 4], 1, &[3], 7),
        gather_case(&[300, 70], 0, &[257], 8),
        scatter_case(&[5, 4, 3], 0, &[9], 11),
        scatter_case(&[5, 4, 3], 1, &[2, 3], 12),
        scatter_case(&[5, 4, 3], 2, &[5], 13),
        scatter_case(&[5, 4, 3], 2, &[], 14),
        scatter_case(&[1, 1], 0, &[4], 15),
        scatter_case(&[3, 0, 2], 0, &[2], 16),
        scatter_case(&[3, 2], 1, &[0], 17),
        // GPU form: several row blocks (one lane per row), several index
        // chunks, rows wider than a workgroup.
        scatter_case(&[300], 0, &[600], 18),
        scatter_case(&[40, 300], 0, &[530], 19),
        scatter_case(&[2, 70, 3], 1, &[3, 100], 20),
    ];
    v.push((
        "gather u32 indices of i32 data".into(),
        Box::new(|dev: &Device| {
            let x = i32s(dev, &(0..24).collect::<Vec<_>>(), &[4, 6]);
            x.gather(1, &Tensor::from_slice(&[5u32, 0, 5, 2], [4], dev)?)
        }),
    ));
    v.push((
        "gather bool data".into(),
        Box::new(|dev: &Device| f32s(dev, &[6, 2], 30).gt_scalar(0.0)?.gather(0, &i32s(dev, &[-1, 0, 3], &[3]))),
    ));
    v.push((
        "scatter_add i32 with u32 indices".into(),
        Box::new(|dev: &Device| {
            let base = i32s(dev, &[1, 2, 3, 4, 5, 6], &[2, 3]);
            let src = i32s(dev, &[10, 20, 30, 40, 50, 60, 70, 80], &[2, 4]);
            base.scatter_add(1, &Tensor::from_slice(&[2u32, 0, 2, 2], [4], dev)?, &src)
        }),
    ));
    v.push((
        "embedding lookup and gradient shape".into(),
        Box::new(|dev: &Device| {
            let table = f32s(dev, &[50, 16], 40);
            let ids = i32s(dev, &idx(50, 24, 41), &[4, 6]);
            let e = table.gather(0, &ids)?;
            // The embedding gradient: rows of e scattered back into the table.
            Tensor::zeros([50, 16], DType::F32, dev)?.scatter_add(0, &ids, &e.mul_scalar(0.5)?)
        }),
    ));
    for (i, (dims, p)) in pool_configs().into_iter().enumerate() {
        let name = format!("pool {dims:?} {p:?}");
        let d = dims.clone();
        let pp = p.clone();
        v.push((name.clone(), Box::new(move |dev: &Device| f32s(dev, &d, 50 + i as u64).pool(pp.clone()))));
        let pp = p.clone();
        let d = dims.clone();
        v.push((
            format!("grad {name}"),
            Box::new(move |dev: &Device| {
                let x = f32s(dev, &d, 50 + i as u64);
                let y = x.pool(pp.clone())?;
                let g = f32s(dev, y.dims(), 90 + i as u64);
                x.pool_grad(&g, pp.clone())
            }),
        ));
    }
    v.push((
        "max pool i32".into(),
        Box::new(|dev: &Device| {
            let x = f32s(dev, &[2, 2, 5, 5], 60).mul_scalar(100.0)?.cast(DType::I32)?;
            x.pool(pool_attrs(PoolKind::Max, &[3, 3], &[2, 2], (&[1, 1], &[1, 1]), &[1, 1], true))
        }),
    ));
    v.push((
        "max pool and gradient with NaN, ties and -inf".into(),
        Box::new(|dev: &Device| {
            let nan = f32::NAN;
            let ninf = f32::NEG_INFINITY;
            let x =
                Tensor::from_slice(&[1.0, 1.0, nan, 2.0, ninf, ninf, 0.0, 3.0, 3.0, nan, nan, 1.0], [1, 1, 12], dev)?;
            let p = pool_attrs(PoolKind::Max, &[3], &[1], (&[1], &[1]), &[1], false);
            let y = x.pool(p.clone())?;
            let g = Tensor::from_slice(&(1..=12).map(|i| i as f32).collect::<Vec<_>>(), [1, 1, 12], dev)?;
            Tensor::concat(&[&y, &x.pool_grad(&g, p)?], 2)
        }),
    ));
    v
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_scalars().unwrap().iter().map(|s| s.as_f64()).collect()
}

#[test]
fn gather_scatter_and_pooling_match_the_cpu_reference() {
    let devs = common::wgpu_profiles();
    if devs.is_empty() {
        return;
    }
    let cpu = Device::cpu();
    let cases = cases();
    let mut failures = Vec::new();
    for (name, build) in &cases {
        let want = build(&cpu).unwrap_or_else(|e| panic!("{name}: cpu failed: {e}"));
        let wv = values(&want);
        for (form, dev) in &devs {
            let got = match build(dev).and_then(|t| t.to_scalars().map(|v| (t, v))) {
                Ok((t, v)) => (t, v.iter().map(|s| s.as_f64()).collect::<Vec<_>>()),
                Err(e) => {
                    failures.push(format!("{name} ({form}): {e}"));
                    continue;
                }
            };
            if got.0.shape() != want.shape() || got.0.dtype() != want.dtype() {
                failures.push(format!(
                    "{name} ({form}): type {}{} vs {}{}",
                    got.0.dtype(),
                    got.0.shape(),
                    want.dtype(),
                    want.shape()
                ));
                continue;
            }
            let bad = got.1.iter().zip(&wv).enumerate().find(|(_, (g, w))| {
                !((g.is_nan() && w.is_nan()) || g == w || (*g - *w).abs() <= 1e-5 + 1e-5 * w.abs())
            });
            if let Some((i, (g, w))) = bad {
                failures.push(format!("{name} ({form}): element {i}: wgpu {g} vs cpu {w}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// The backend error inside `e`, through failed and poisoned values.
fn backend_error(e: &ExecError) -> Option<&BackendError> {
    match e {
        ExecError::Backend { source, .. } => Some(source),
        ExecError::Failed { cause, .. } | ExecError::Poisoned { cause, .. } => backend_error(cause),
        _ => None,
    }
}

/// Reading `t` fails with an index out of range naming `op`, `index`,
/// `axis` and `size`.
#[track_caller]
fn assert_out_of_range(t: &Tensor, op: &str, index: i128, axis: usize, size: usize, what: &str) {
    let e = t.to_vec::<f32>().expect_err(what);
    match backend_error(&e) {
        Some(BackendError::IndexOutOfRange(ie)) => {
            assert_eq!((ie.op.as_str(), ie.index, ie.axis, ie.size), (op, index, axis, size), "{what}: {e}");
        }
        _ => panic!("{what}: expected an index out of range, got {e}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(op) && msg.contains(&index.to_string()) && msg.contains(&format!("size {size}")), "{msg}");
}

#[test]
fn an_index_out_of_range_is_an_error_at_the_barrier_and_the_device_recovers() {
    let mut devs = common::wgpu_profiles();
    devs.push(("cpu", Device::cpu()));
    for (form, dev) in &devs {
        let x = f32s(dev, &[4, 3], 1);
        let what = |s: &str| format!("{s} ({form})");
        // Too large, too negative, u32, along a later axis.
        assert_out_of_range(&x.gather(0, &i32s(dev, &[0, 4, 1], &[3])).unwrap(), "gather", 4, 0, 4, &what("gather 4"));
        assert_out_of_range(&x.gather(0, &i32s(dev, &[-5], &[1])).unwrap(), "gather", -5, 0, 4, &what("gather -5"));
        let u = Tensor::from_slice(&[2u32, 3], [2], dev).unwrap();
        assert_out_of_range(&x.gather(1, &u).unwrap(), "gather", 3, 1, 3, &what("gather u32 3"));
        // An empty output still checks its indices (outer dim 0).
        let empty = f32s(dev, &[0, 3], 2);
        assert_out_of_range(
            &empty.gather(1, &i32s(dev, &[7], &[1])).unwrap(),
            "gather",
            7,
            1,
            3,
            &what("empty gather"),
        );
        // Scatter-add: a bad index among repeated good ones, and with no
        // element to move (inner dim 0).
        let ix = i32s(dev, &[1, 1, -9, 0], &[4]);
        let s = x.scatter_add(0, &ix, &f32s(dev, &[4, 3], 3)).unwrap();
        assert_out_of_range(&s, "scatter_add", -9, 0, 4, &what("scatter_add -9"));
        let s = f32s(dev, &[2, 0], 4).scatter_add(0, &i32s(dev, &[2], &[1]), &f32s(dev, &[1, 0], 5)).unwrap();
        assert_out_of_range(&s, "scatter_add", 2, 0, 2, &what("empty scatter_add"));
        // 64-bit indices are never narrowed: 2^32 + 1 would be 1 in 32 bits.
        let big = Tensor::from_slice(&[1i64, (1i64 << 32) + 1], [2], dev).unwrap();
        assert_out_of_range(&x.gather(0, &big).unwrap(), "gather", (1i128 << 32) + 1, 0, 4, &what("gather i64"));
        let big = Tensor::from_slice(&[-(1i64 << 40)], [1], dev).unwrap();
        let s = x.scatter_add(0, &big, &f32s(dev, &[1, 3], 6)).unwrap();
        // On a GPU device the 64-bit check is the conversion's (a gather
        // over the same axis); on the CPU the scatter-add's own.
        let op = if *form == "cpu" { "scatter_add" } else { "gather" };
        assert_out_of_range(&s, op, -(1i128 << 40), 0, 4, &what("scatter_add i64"));
        // The device is fine: the same graphs with good indices compute
        // the right values, and nothing failed is left to report.
        dev.wait().unwrap();
        let good = x.gather(0, &i32s(dev, &[3, -1, 0], &[3])).unwrap().to_vec::<f32>().unwrap();
        let xv = x.to_vec::<f32>().unwrap();
        let want: Vec<f32> = [3usize, 3, 0].iter().flat_map(|&r| xv[r * 3..r * 3 + 3].to_vec()).collect();
        assert_eq!(good, want, "{form}");
        let idx64 = Tensor::from_slice(&[-1i64, 2], [2], dev).unwrap();
        let good = x.gather(0, &idx64).unwrap().to_vec::<f32>().unwrap();
        let want: Vec<f32> = [3usize, 2].iter().flat_map(|&r| xv[r * 3..r * 3 + 3].to_vec()).collect();
        assert_eq!(good, want, "{form}");
        let ones = Tensor::ones([2, 3], DType::F32, dev).unwrap();
        let s = x.scatter_add(0, &i32s(dev, &[1, 1], &[2]), &ones).unwrap().to_vec::<f32>().unwrap();
        let mut want = xv.clone();
        for v in &mut want[3..6] {
            *v += 2.0;
        }
        assert_eq!(s, want, "{form}");
    }
}

#[test]
fn gather_scatter_and_pooling_run_natively_on_wgpu() {
    let Some(dev) = common::wgpu() else { return };
    let _lock = common::metrics_lock();
    metrics::reset();
    // An embedding, a max and an average pool, and their gradients, in one
    // training-like step.
    let table = f32s(&dev, &[30, 8], 1).requires_grad_(true).unwrap();
    let ids = i32s(&dev, &idx(30, 12, 2), &[2, 6]);
    let e = table.gather(0, &ids).unwrap().reshape([2, 1, 6, 8]).unwrap();
    let p1 = e.pool(PoolAttrs::new(PoolKind::Max, &[3, 3]).with_strides(&[1, 2]).with_padding(&[1, 1])).unwrap();
    let p2 = e.pool(PoolAttrs::new(PoolKind::Avg { count_include_pad: false }, &[2, 2])).unwrap();
    let loss = p1.sum(&[], false).unwrap().add(&p2.mul(&p2).unwrap().sum(&[], false).unwrap()).unwrap();
    loss.backward().unwrap();
    let g = table.grad().unwrap();
    lazuli::sync(&[&loss, &g]).unwrap();
    g.to_vec::<f32>().unwrap();
    for op in ["gather", "scatter_add", "max_pool", "avg_pool", "max_pool_grad", "avg_pool_grad"] {
        assert_eq!(metrics::counter(&format!("Fallback::{op}")), 0, "{op} fell back:\n{}", metrics::report());
    }
    assert_eq!(metrics::counter("FallbackOps"), 0, "{}", metrics::report());
}
