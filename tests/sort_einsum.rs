//! `sort`, `argsort`, `topk` and `einsum`: values and indices against
//! naive references computed here (PyTorch's stable order, NaN largest),
//! on the CPU and on wgpu with no fallback op in f32; gradients against
//! central finite differences in f64 on the CPU; and errors naming the op.

mod common;

use lazuli::prelude::*;
use lazuli::{no_grad, Result};

fn t32(dev: &Device, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape.to_vec(), dev).unwrap()
}

/// Runs `f` on every device and checks its f32 and i32 results, with no op
/// falling back to the CPU.
#[track_caller]
fn on_devices(what: &str, want: (&[f32], &[i32]), shape: &[usize], f: impl Fn(&Device) -> Result<(Tensor, Tensor)>) {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        lazuli::metrics::reset();
        let (v, i) = f(&dev).unwrap();
        assert_eq!(v.dims(), shape, "{what} on {}: shape", dev.name());
        assert_eq!(i.dims(), shape, "{what} on {}: index shape", dev.name());
        assert_eq!(i.dtype(), DType::I32, "{what}: index dtype");
        common::assert_close(&v.to_vec::<f32>().unwrap(), want.0, 0.0, 0.0, &format!("{what} on {}", dev.name()));
        assert_eq!(i.to_vec::<i32>().unwrap(), want.1, "{what} on {}: indices", dev.name());
        assert_eq!(
            lazuli::metrics::counter("FallbackOps"),
            0,
            "{what} on {}: {}",
            dev.name(),
            lazuli::metrics::report()
        );
    }
}

/// PyTorch's stable sort of each row of `[rows, n]` (NaN largest): values,
/// then indices, keeping the first `k` of each row.
fn reference(x: &[f32], n: usize, k: usize, descending: bool) -> (Vec<f32>, Vec<i32>) {
    let key = |a: f32, b: f32| {
        let o = match (a.is_nan(), b.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => a.partial_cmp(&b).unwrap(),
        };
        if descending {
            o.reverse()
        } else {
            o
        }
    };
    let (mut vals, mut idx) = (Vec::new(), Vec::new());
    for row in x.chunks(n) {
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| key(row[a], row[b])); // stable
        for &o in &order[..k] {
            vals.push(row[o]);
            idx.push(o as i32);
        }
    }
    (vals, idx)
}

/// `[a, b]` -> `[b, a]` of a row-major matrix.
fn transpose<T: Copy>(x: &[T], a: usize, b: usize) -> Vec<T> {
    (0..a * b).map(|e| x[(e % a) * b + e / a]).collect()
}

/// Values with many ties (a few distinct levels).
fn tied(n: usize, seed: u64) -> Vec<f32> {
    common::rand_vec(n, seed, 0.0, 5.0).into_iter().map(|v| v.floor() - 2.0).collect()
}

// ---- sort / argsort / topk ----

#[test]
fn sort_is_stable_along_the_last_axis_both_ways() {
    let x = tied(3 * 17, 1);
    for descending in [false, true] {
        let (v, i) = reference(&x, 17, 17, descending);
        on_devices(&format!("sort descending={descending}"), (&v, &i), &[3, 17], |d| {
            t32(d, &x, &[3, 17]).sort(-1, descending)
        });
    }
}

#[test]
fn sort_along_axis_zero_and_argsort_of_integers() {
    // [5, 4] sorted along axis 0 is the transpose of sorting [4, 5]'s rows.
    let x = tied(20, 2);
    let (v, i) = reference(&transpose(&x, 5, 4), 5, 5, true);
    let (v, i) = (transpose(&v, 4, 5), transpose(&i, 4, 5));
    on_devices("sort axis 0", (&v, &i), &[5, 4], |d| t32(d, &x, &[5, 4]).sort(0, true));
    for dev in common::devices() {
        let xi: Vec<i32> = x.iter().map(|&v| v as i32).collect();
        let t = Tensor::from_slice(&xi, [5, 4], &dev).unwrap();
        assert_eq!(t.argsort(0, true).unwrap().to_vec::<i32>().unwrap(), i, "argsort i32 on {}", dev.name());
        let b = t.gt_scalar(0).unwrap();
        let (_, bi) =
            reference(&transpose(&x.iter().map(|&v| (v > 0.0) as u8 as f32).collect::<Vec<_>>(), 5, 4), 5, 5, false);
        assert_eq!(b.argsort(0, false).unwrap().to_vec::<i32>().unwrap(), transpose(&bi, 4, 5), "bool argsort");
    }
}

#[test]
fn nan_sorts_as_the_largest_value() {
    let x = [1.0f32, f32::NAN, -1.0, f32::NAN, 0.0, -0.0, f32::INFINITY, 2.0];
    for descending in [false, true] {
        let (v, i) = reference(&x, 8, 8, descending);
        on_devices(&format!("sort with NaN descending={descending}"), (&v, &i), &[8], |d| {
            t32(d, &x, &[8]).sort(0, descending)
        });
    }
    let (v, i) = reference(&x, 8, 3, true);
    on_devices("topk with NaN", (&v, &i), &[3], |d| t32(d, &x, &[8]).topk(3, 0, true));
}

#[test]
fn topk_largest_and_smallest() {
    let x = tied(4 * 9, 3);
    for largest in [true, false] {
        let (v, i) = reference(&x, 9, 4, largest);
        on_devices(&format!("topk largest={largest}"), (&v, &i), &[4, 4], |d| t32(d, &x, &[4, 9]).topk(4, 1, largest));
    }
    // Along a middle axis of [2, 9, 3]: the reference sorts [2, 3, 9].
    let x = common::rand_vec(54, 4, -1.0, 1.0);
    let moved: Vec<f32> = (0..54).map(|e| x[(e / 27) * 27 + (e % 9) * 3 + (e / 9) % 3]).collect();
    let (v, i) = reference(&moved, 9, 2, true);
    let back = |w: &[f32]| -> Vec<f32> { (0..12).map(|e| w[(e / 6) * 6 + (e % 3) * 2 + (e / 3) % 2]).collect() };
    let vi: Vec<f32> = i.iter().map(|&i| i as f32).collect();
    let (v, i): (Vec<f32>, Vec<i32>) = (back(&v), back(&vi).into_iter().map(|i| i as i32).collect());
    on_devices("topk middle axis", (&v, &i), &[2, 2, 3], |d| t32(d, &x, &[2, 9, 3]).topk(2, 1, true));
}

#[test]
fn long_rows_and_many_rows_are_chunked() {
    // 4100^2 > 2^24: the ranks are counted in several chunks of one row;
    // 3000 rows of 100 are grouped.
    let dev = Device::cpu();
    for (rows, n) in [(1usize, 4100usize), (3000, 100)] {
        let x = tied(rows * n, 5);
        let (v, i) = reference(&x, n, n, false);
        let (sv, si) = t32(&dev, &x, &[rows, n]).sort(1, false).unwrap();
        assert_eq!(sv.to_vec::<f32>().unwrap(), v, "values of {rows} rows of {n}");
        assert_eq!(si.to_vec::<i32>().unwrap(), i, "indices of {rows} rows of {n}");
    }
}

#[test]
fn topk_of_rows_longer_than_a_sort_selects() {
    // A vocabulary-sized row: beyond SORT_MAX_ROW, topk selects in k rounds.
    let n = lazuli::SORT_MAX_ROW + 3616;
    let mut x = tied(2 * n, 8);
    for (i, v) in x.iter_mut().enumerate() {
        if i % 977 == 5 {
            *v = f32::NAN;
        } else if i % 1231 == 7 {
            *v = if i % 2 == 0 { f32::INFINITY } else { f32::NEG_INFINITY };
        }
    }
    for largest in [true, false] {
        let (v, i) = reference(&x, n, 40, largest);
        on_devices(&format!("long topk largest={largest}"), (&v, &i), &[2, 40], |d| {
            t32(d, &x, &[2, n]).topk(40, 1, largest)
        });
    }
    // Integers, along axis 0.
    let dev = Device::cpu();
    let xi: Vec<i32> = x.iter().map(|v| if v.is_finite() { *v as i32 } else { 7 }).collect();
    let xf: Vec<f32> = xi.iter().map(|&v| v as f32).collect();
    let (_, want) = reference(&xf[..n], n, 3, false);
    let t = Tensor::from_slice(&xi[..n], [n, 1], &dev).unwrap();
    assert_eq!(t.topk(3, 0, false).unwrap().1.to_vec::<i32>().unwrap(), want);
    let long = t32(&dev, &x[..n], &[n]);
    let msg = long.topk(lazuli::TOPK_SELECT_MAX_K + 1, 0, true).unwrap_err().to_string();
    assert!(msg.contains("topk") && msg.contains(&lazuli::TOPK_SELECT_MAX_K.to_string()), "{msg}");
    assert!(long.sort(0, false).is_err());
}

#[test]
fn sort_and_topk_gradients_scatter_through_the_indices() {
    let dev = Device::cpu();
    let x: Vec<f64> = common::rand_vec(12, 6, -2.0, 2.0).into_iter().map(f64::from).collect();
    let w: Vec<f64> = (0..12).map(|i| 0.5 + i as f64).collect();
    for case in 0..3 {
        let loss = |t: &Tensor| -> Result<Tensor> {
            let out = match case {
                0 => t.sort(1, false)?.0,
                1 => t.sort(0, true)?.0,
                _ => t.topk(2, 1, true)?.0,
            };
            let w = Tensor::from_slice(&w[..out.numel()], out.shape().clone(), &dev)?;
            out.mul(&w)?.sum(&[], false)
        };
        let leaf = Tensor::from_slice(&x, [3, 4], &dev).unwrap().requires_grad_(true).unwrap();
        loss(&leaf).unwrap().backward().unwrap();
        let analytic = leaf.grad().unwrap().to_vec::<f64>().unwrap();
        let eval =
            |v: &[f64]| no_grad(|| loss(&Tensor::from_slice(v, [3, 4], &dev).unwrap()).unwrap().item::<f64>().unwrap());
        for (j, &a) in analytic.iter().enumerate() {
            let mut v = x.clone();
            v[j] += 1e-6;
            let up = eval(&v);
            v[j] -= 2e-6;
            let numeric = (up - eval(&v)) / 2e-6;
            assert!((a - numeric).abs() <= 1e-5, "case {case}: element {j}: analytic {a}, numeric {numeric}");
        }
    }
    // f32 gradients agree across devices, with no fallback.
    let x = common::rand_vec(12, 7, -2.0, 2.0);
    let grads: Vec<Vec<f32>> = common::devices()
        .iter()
        .map(|d| {
            let leaf = t32(d, &x, &[3, 4]).requires_grad_(true).unwrap();
            let (v, _) = leaf.topk(3, 1, false).unwrap();
            v.mul(&v).unwrap().sum(&[], false).unwrap().backward().unwrap();
            leaf.grad().unwrap().to_vec::<f32>().unwrap()
        })
        .collect();
    for g in &grads[1..] {
        common::assert_close(g, &grads[0], 1e-6, 1e-6, "topk gradient across devices");
    }
}

#[test]
fn sort_errors_name_the_op_shape_and_caller() {
    let dev = Device::cpu();
    let x = t32(&dev, &[0.0; 6], &[2, 3]);
    let msg = x.topk(4, 1, true).unwrap_err().to_string();
    assert!(msg.contains("topk") && msg.contains("[2, 3]") && msg.contains("sort_einsum.rs"), "{msg}");
    let msg = x.sort(2, false).unwrap_err().to_string();
    assert!(msg.contains("sort"), "{msg}");
    let long = Tensor::zeros([2, lazuli::SORT_MAX_ROW + 1], DType::F32, &dev).unwrap();
    let msg = long.argsort(-1, false).unwrap_err().to_string();
    assert!(msg.contains("argsort") && msg.contains(&format!("{}", lazuli::SORT_MAX_ROW)), "{msg}");
    // Empty axes and k = 0 give empty results.
    let (v, i) = x.topk(0, 1, true).unwrap();
    assert_eq!((v.dims(), i.dims()), (&[2usize, 0][..], &[2usize, 0][..]));
    assert!(v.to_vec::<f32>().unwrap().is_empty());
}

// ---- einsum ----

/// Einstein summation by looping over every assignment of the letters.
fn naive_einsum(spec: &str, inputs: &[(&[f64], &[usize])]) -> (Vec<f64>, Vec<usize>) {
    let (lhs, out) = spec.split_once("->").unwrap();
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    let out: Vec<char> = out.chars().collect();
    let mut letters: Vec<(char, usize)> = Vec::new();
    for (term, (_, dims)) in terms.iter().zip(inputs) {
        for (c, &d) in term.iter().zip(dims.iter()) {
            if !letters.iter().any(|(l, _)| l == c) {
                letters.push((*c, d));
            }
        }
    }
    for (term, (_, dims)) in terms.iter().zip(inputs) {
        for (c, &d) in term.iter().zip(dims.iter()) {
            let e = letters.iter_mut().find(|(l, _)| l == c).unwrap();
            e.1 = e.1.max(d); // a size of 1 broadcasts
        }
    }
    let size = |c: char| letters.iter().find(|(l, _)| *l == c).unwrap().1;
    let out_dims: Vec<usize> = out.iter().map(|&c| size(c)).collect();
    let mut result = vec![0.0; out_dims.iter().product()];
    let total: usize = letters.iter().map(|(_, d)| d).product();
    for mut e in 0..total {
        let mut val = vec![0usize; letters.len()];
        for (i, (_, d)) in letters.iter().enumerate().rev() {
            val[i] = e % d;
            e /= d;
        }
        let at = |c: char| val[letters.iter().position(|(l, _)| *l == c).unwrap()];
        let flat = |term: &[char], dims: &[usize]| {
            term.iter().zip(dims).fold(0, |acc, (&c, &d)| acc * d + if d == 1 { 0 } else { at(c) })
        };
        let prod: f64 = terms.iter().zip(inputs).map(|(t, (data, dims))| data[flat(t, dims)]).product();
        result[flat(&out, &out_dims)] += prod;
    }
    (result, out_dims)
}

const SPECS: &[(&str, &[&[usize]])] = &[
    ("ij,jk->ik", &[&[3, 4], &[4, 5]]),
    ("bij,bjk->bik", &[&[2, 3, 4], &[2, 4, 5]]),
    ("bhqd,bhkd->bhqk", &[&[2, 2, 3, 4], &[2, 2, 5, 4]]),
    ("ij->ji", &[&[3, 4]]),
    ("ij->", &[&[3, 4]]),
    ("i,i->", &[&[5], &[5]]),
    ("ij,j->i", &[&[3, 4], &[4]]),
    ("i,j->ij", &[&[3], &[4]]),
    ("bi,bj->bij", &[&[2, 3], &[2, 4]]),
    ("ij,jk,kl->li", &[&[2, 3], &[3, 4], &[4, 2]]),
    ("abc,cd->dba", &[&[2, 3, 4], &[4, 2]]),
    ("ijk,j->k", &[&[2, 3, 4], &[3]]),
    ("ij,ij->ij", &[&[3, 4], &[3, 4]]),
    ("bi,bj,b->bji", &[&[2, 3], &[2, 4], &[2]]),
    ("bij,bjk->bik", &[&[1, 3, 4], &[2, 4, 5]]),
    ("ij,j->ij", &[&[3, 1], &[4]]),
];

fn operands(dims: &[&[usize]], seed: u64) -> Vec<Vec<f64>> {
    dims.iter()
        .enumerate()
        .map(|(i, d)| {
            let n = d.iter().product();
            common::rand_vec(n, seed + i as u64, -1.0, 1.0).into_iter().map(f64::from).collect()
        })
        .collect()
}

#[test]
fn einsum_matches_a_naive_reference() {
    let _lock = common::metrics_lock();
    for &(spec, dims) in SPECS {
        let data = operands(dims, 11);
        let inputs: Vec<(&[f64], &[usize])> = data.iter().map(|v| v.as_slice()).zip(dims.iter().copied()).collect();
        let (want, want_dims) = naive_einsum(spec, &inputs);
        let want: Vec<f32> = want.into_iter().map(|v| v as f32).collect();
        for dev in common::devices() {
            lazuli::metrics::reset();
            let ts: Vec<Tensor> = data
                .iter()
                .zip(dims)
                .map(|(v, d)| t32(&dev, &v.iter().map(|&x| x as f32).collect::<Vec<_>>(), d))
                .collect();
            let refs: Vec<&Tensor> = ts.iter().collect();
            let out = lazuli::einsum(spec, &refs).unwrap();
            assert_eq!(out.dims(), want_dims, "{spec} on {}: shape", dev.name());
            common::assert_close(
                &out.to_vec::<f32>().unwrap(),
                &want,
                1e-5,
                1e-5,
                &format!("{spec} on {}", dev.name()),
            );
            assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{spec} on {}", dev.name());
        }
    }
    // Implicit output: the letters seen once, in alphabetical order.
    let dev = Device::cpu();
    let a = t32(&dev, &common::rand_vec(6, 1, -1.0, 1.0), &[2, 3]);
    let b = t32(&dev, &common::rand_vec(12, 2, -1.0, 1.0), &[3, 4]);
    let implicit = Tensor::einsum("ij,jk", &[&a, &b]).unwrap();
    let explicit = Tensor::einsum("ij, jk -> ik", &[&a, &b]).unwrap();
    assert_eq!(implicit.to_vec::<f32>().unwrap(), explicit.to_vec::<f32>().unwrap());
    assert_eq!(Tensor::einsum("ba", &[&a]).unwrap().dims(), &[3, 2], "implicit ba is ab: a transpose");
}

#[test]
fn einsum_gradients_match_finite_differences() {
    let dev = Device::cpu();
    for &(spec, dims) in SPECS {
        let data = operands(dims, 21);
        for wrt in 0..dims.len() {
            let loss = |x: &[f64]| -> Result<(Tensor, Tensor)> {
                let leaf = Tensor::from_slice(x, dims[wrt].to_vec(), &dev)?.requires_grad_(true)?;
                let ts: Vec<Tensor> = data
                    .iter()
                    .zip(dims)
                    .enumerate()
                    .map(
                        |(i, (v, d))| if i == wrt { Ok(leaf.clone()) } else { Tensor::from_slice(v, d.to_vec(), &dev) },
                    )
                    .collect::<Result<_>>()?;
                let out = lazuli::einsum(spec, &ts.iter().collect::<Vec<_>>())?;
                let w: Vec<f64> = (0..out.numel()).map(|i| 0.3 + 0.1 * i as f64).collect();
                Ok((out.mul(&Tensor::from_slice(&w, out.shape().clone(), &dev)?)?.sum(&[], false)?, leaf))
            };
            let (l, leaf) = loss(&data[wrt]).unwrap();
            l.backward().unwrap();
            let analytic = leaf.grad().unwrap().to_vec::<f64>().unwrap();
            for (j, &a) in analytic.iter().enumerate() {
                let mut v = data[wrt].clone();
                v[j] += 1e-6;
                let up = no_grad(|| loss(&v).unwrap().0.item::<f64>().unwrap());
                v[j] -= 2e-6;
                let down = no_grad(|| loss(&v).unwrap().0.item::<f64>().unwrap());
                let numeric = (up - down) / 2e-6;
                assert!(
                    (a - numeric).abs() <= 1e-6 + 1e-5 * numeric.abs(),
                    "{spec} d/d operand {wrt}[{j}]: {a} vs {numeric}"
                );
            }
        }
    }
}

#[test]
fn einsum_errors_name_the_spec_and_the_caller() {
    let dev = Device::cpu();
    let a = t32(&dev, &[0.0; 6], &[2, 3]);
    let sq = t32(&dev, &[0.0; 9], &[3, 3]);
    for (spec, ops, also) in [
        ("ii->i", vec![&sq], "diagonal"),
        ("...ij->ij", vec![&a], "ellipsis"),
        ("ij,ij->i", vec![&a, &sq], "sizes"),
        ("ij,jk->ik", vec![&a], "operands"),
        ("ij->k", vec![&a], "no operand"),
        ("ijk->i", vec![&a], "rank"),
        ("ij->ii", vec![&a], "repeats"),
        ("i1->i", vec![&a], "letter"),
    ] {
        let msg = Tensor::einsum(spec, &ops).unwrap_err().to_string();
        assert!(msg.contains("einsum") && msg.contains(also) && msg.contains("sort_einsum.rs"), "{spec}: {msg}");
    }
}

// ---- printing ----

#[test]
fn tensors_print_as_pytorch_does() {
    for dev in common::devices() {
        let name = dev.name();
        let suffix = |shape: &str, dtype: &str| format!(", shape={shape}, dtype={dtype}, device={name})");
        let m = t32(&dev, &[1.0, 2.5, -3.25, 4.0, 0.5, 6.0], &[2, 3]);
        let want = format!(
            "tensor([[ 1.0000,  2.5000, -3.2500],\n        [ 4.0000,  0.5000,  6.0000]]{}",
            suffix("[2, 3]", "f32")
        );
        assert_eq!(m.to_string(), want, "on {name}");
        assert_eq!(format!("{m:?}"), want, "Debug is Display");
        let want2 =
            format!("tensor([[ 1.00,  2.50, -3.25],\n        [ 4.00,  0.50,  6.00]]{}", suffix("[2, 3]", "f32"));
        assert_eq!(format!("{m:.2}"), want2, "precision from the formatter");
        // Integral floats, a pending value, scientific notation, NaN and infinities.
        let pending = t32(&dev, &[1.0, 2.0, 3.0], &[3]).mul_scalar(2.0).unwrap();
        assert_eq!(pending.to_string(), format!("tensor([2., 4., 6.]{}", suffix("[3]", "f32")));
        let sci = t32(&dev, &[1e-5, 1.0, f32::NAN, f32::NEG_INFINITY], &[4]);
        assert_eq!(
            sci.to_string(),
            format!("tensor([1.0000e-05, 1.0000e+00,        nan,       -inf]{}", suffix("[4]", "f32"))
        );
        let ints = Tensor::from_slice(&[1i32, -20, 300], [3], &dev).unwrap();
        assert_eq!(ints.to_string(), format!("tensor([  1, -20, 300]{}", suffix("[3]", "i32")));
        assert_eq!(
            ints.gt_scalar(0).unwrap().to_string(),
            format!("tensor([ True, False,  True]{}", suffix("[3]", "bool"))
        );
        let leaf = t32(&dev, &[0.5], &[1]).requires_grad_(true).unwrap();
        let want = format!("tensor([0.5000], shape=[1], dtype=f32, device={name}, requires_grad=True)");
        assert_eq!(leaf.to_string(), want);
        let scalar = Tensor::scalar(1.5, DType::F32, &dev);
        assert_eq!(scalar.to_string(), format!("tensor(1.5000{}", suffix("[]", "f32")));
        let empty = Tensor::zeros([0, 3], DType::F32, &dev).unwrap();
        assert_eq!(empty.to_string(), format!("tensor([]{}", suffix("[0, 3]", "f32")));
        let cube = Tensor::arange(0.0, 8.0, 1.0, DType::I32, &dev).unwrap().reshape([2, 2, 2]).unwrap();
        assert_eq!(
            cube.to_string(),
            format!(
                "tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]]{}",
                suffix("[2, 2, 2]", "i32")
            )
        );
    }
}

#[test]
fn large_tensors_are_summarized_and_long_rows_wrap() {
    let dev = Device::cpu();
    let big = Tensor::arange(0.0, 2000.0, 1.0, DType::I32, &dev).unwrap().reshape([40, 50]).unwrap();
    let text = big.to_string();
    let want = concat!(
        "tensor([[   0,    1,    2,  ...,   47,   48,   49],\n",
        "        [  50,   51,   52,  ...,   97,   98,   99],\n",
        "        [ 100,  101,  102,  ...,  147,  148,  149],\n",
        "        ...,\n",
        "        [1850, 1851, 1852,  ..., 1897, 1898, 1899],\n",
        "        [1900, 1901, 1902,  ..., 1947, 1948, 1949],\n",
        "        [1950, 1951, 1952,  ..., 1997, 1998, 1999]], shape=[40, 50], dtype=i32, device=cpu)",
    );
    assert_eq!(text, want);
    // `{:#}` prints every element; a row of 30 wraps.
    let full = format!("{big:#}");
    assert_eq!(full.matches(',').count(), 2000 - 1 + 4, "every element, then the suffix's four commas");
    let row = Tensor::arange(0.0, 30.0, 1.0, DType::F32, &dev).unwrap().mul_scalar(0.5).unwrap();
    let text = row.to_string();
    let first_line = text.lines().next().unwrap();
    assert!(first_line.len() <= 80 && text.lines().count() > 1, "{text}");
    let opts = lazuli::PrintOptions { threshold: 10, edge_items: 2, ..Default::default() };
    assert!(
        row.format(&opts).starts_with("tensor([ 0.0000,  0.5000,     ..., 14.0000, 14.5000]"),
        "{}",
        row.format(&opts)
    );
}

#[test]
fn a_failed_computation_prints_its_error() {
    for dev in common::devices() {
        let x = t32(&dev, &[1.0, 2.0, 3.0], &[3]);
        let bad = Tensor::from_slice(&[0i32, 7], [2], &dev).unwrap();
        let y = x.gather(0, &bad).unwrap();
        let text = y.to_string();
        assert!(text.starts_with("tensor(<error: ") && text.contains("shape=[2]"), "on {}: {text}", dev.name());
    }
}

/// Counting ranks fuses: the `[rows, n, n]` comparisons are the prologue
/// of one reduction and the position inverse another, so a sort of one
/// chunk is a handful of kernels (the two reductions and the values'
/// gather), not a materialized `n x n` intermediate.
#[test]
fn sort_is_a_few_fused_kernels_on_wgpu() {
    let _lock = common::metrics_lock();
    let Some(dev) = common::wgpu() else { return };
    let x = t32(&dev, &common::rand_vec(4 * 1024, 1, -1.0, 1.0), &[4, 1024]);
    let (v, i) = x.sort(-1, false).unwrap();
    lazuli::sync(&[&v, &i]).unwrap();
    dev.wait().unwrap();
    lazuli::metrics::reset();
    let (v, i) = x.sort(-1, false).unwrap();
    lazuli::sync(&[&v, &i]).unwrap();
    dev.wait().unwrap();
    let launches = lazuli::metrics::counter("KernelLaunches");
    assert!((2..=6).contains(&launches), "{launches} kernels: {}", lazuli::metrics::report());
    assert_eq!(lazuli::metrics::counter("FallbackOps"), 0);
}
