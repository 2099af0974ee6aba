//! Tensors beyond one storage binding (issue 15): a tensor larger than the
//! adapter's `max_storage_buffer_binding_size` is one buffer bound in
//! windows (`lazuli_wgpu::window`), and every kernel family reaches it.
//!
//! Two kinds of tests, each under both kernel-form profiles:
//! - *Real sizes*: tensors of 156 to 512 MiB on devices whose binding
//!   window is clamped to lavapipe's 128 MiB (so any adapter windows
//!   them): `x * 2` and a full `sum` of 512 MiB, matmuls with a 300 MiB
//!   operand and a 160 MiB output, softmax and layer-norm rows, an
//!   embedding gather from a 160 MiB table and the scatter-add of its
//!   gradient, upload and readback of 160 MiB. Data is computed on the
//!   device from `iota` where possible (no host copy), chosen so that sums
//!   are exact, and checked against a host computation: every element
//!   where that is cheap, else rows and columns on both sides of every
//!   window boundary.
//! - *Beyond one dispatch dimension*: elementwise chains of more vectors
//!   than 65535 workgroups hold, one vec4 (or, at an odd count, one
//!   element) per invocation in the GPU form, so dispatched in two
//!   dimensions, checked on every element.
//! - *Windowed twins*: the same kernel families on small tensors with
//!   60 KiB windows (`WgpuDeviceOptions::binding_window`; not a power of
//!   two, as on NVIDIA), compared with the CPU reference: many shapes and
//!   forms in milliseconds (convolutions included, a split one too).
//! - *With multi-tensor kernels and cached bind groups*: windowed updates
//!   joined with small ones in one multi-tensor kernel (or split by the
//!   binding limit, windows counted) create no bind groups after warm-up
//!   and match the CPU every step; a gather from a windowed table binds
//!   its windows and error slot through the plan's cached bind groups, an
//!   index out of range on a later run is the typed error, and the run
//!   after it is right.
//! - *Fused attention*: forward and gradients with windowed q, k, v, mask
//!   and output gradient (13 KiB windows), the per-row and the tiled form,
//!   against the CPU; a part whose windows exceed one kernel's bindings is
//!   `BackendError::TooLarge`.
//!
//! Every device is clamped to lavapipe's limits (its 128 MiB binding for
//! the real sizes, its 32 storage buffers per stage everywhere), so each
//! test splits kernels and refuses too many windows on any adapter as it
//! does on lavapipe.
//!
//! Memory: lavapipe's device memory is host RAM. One test holds at most
//! about 1.1 GiB (the 512 MiB test: its result on the device and on the
//! host); a lock runs the tests of this file one at a time, and the
//! devices keep no idle buffers, so the process never holds more than one
//! test's worth. Wall time on a 2-core box: a few seconds per test.

mod common;
use lazuli::ir::{PoolAttrs, PoolKind};
use lazuli::prelude::*;
use lazuli::wgpu::forms::KernelForms;
use lazuli::{metrics, BackendError, ExecError, WgpuDeviceOptions};
use std::sync::{Mutex, MutexGuard};

/// lavapipe's storage binding limit, the window of the real-size tests.
const WINDOW: u64 = 128 << 20;

/// lavapipe's storage buffers per shader stage (kernels bind one fewer:
/// one is kept for the sizes of generic kernels). Every device of this
/// file is clamped to it, so kernels split, and refuse to run for too
/// many windows, on any adapter exactly as on lavapipe (a GPU allows far
/// more bindings).
const STORAGE_BUFFERS: u32 = 32;

const F: DType = DType::F32;

/// Serializes the tests of this file (peak memory), and the metrics
/// counters they assert.
fn big() -> (MutexGuard<'static, ()>, MutexGuard<'static, ()>) {
    static LOCK: Mutex<()> = Mutex::new(());
    (LOCK.lock().unwrap_or_else(|e| e.into_inner()), common::metrics_lock())
}

/// A wgpu device per kernel-form profile, binding at most `window` bytes
/// per storage binding and [`STORAGE_BUFFERS`] per stage, keeping no idle
/// buffers; empty without an adapter (unless one is required).
fn devices(window: u64) -> Vec<(&'static str, Device)> {
    if common::wgpu().is_none() {
        return Vec::new();
    }
    [("software", KernelForms::software()), ("gpu", KernelForms::gpu())]
        .into_iter()
        .map(|(name, forms)| {
            let opts = WgpuDeviceOptions {
                kernel_forms: Some(forms),
                binding_window: Some(window),
                max_storage_buffers: Some(STORAGE_BUFFERS),
                pool_max_free_bytes: Some(0),
                ..Default::default()
            };
            (name, Device::wgpu_with(opts).expect("a second device on the adapter"))
        })
        .collect()
}

/// `((i * a + k * b) mod m - m / 2) * scale` at `[i, k]` of a 2-d shape,
/// computed on the device: small dyadic values whose products and sums
/// are exact in f32.
fn pattern(dev: &Device, dims: [usize; 2], a: i32, b: i32, m: i32, scale: f32) -> Tensor {
    let i = Tensor::iota(dims, 0, DType::I32, dev).unwrap().mul_scalar(a).unwrap();
    let k = Tensor::iota(dims, 1, DType::I32, dev).unwrap().mul_scalar(b).unwrap();
    i.add(&k).unwrap().rem_scalar(m).unwrap().sub_scalar(m / 2).unwrap().cast(F).unwrap().mul_scalar(scale).unwrap()
}

/// The host value of [`pattern`] at `[i, k]`.
fn pattern_at(i: usize, k: usize, a: i32, b: i32, m: i32, scale: f32) -> f32 {
    (((i as i64 * a as i64 + k as i64 * b as i64) % m as i64) as i32 - m / 2) as f32 * scale
}

/// Indices `0..n` every `step`, plus both sides of every multiple of
/// `boundary` and the last one.
fn probes(n: usize, step: usize, boundary: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).step_by(step).collect();
    for b in (boundary..n).step_by(boundary.max(1)) {
        v.extend([b - 1, b]);
    }
    v.push(n - 1);
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn x_times_2_and_the_full_sum_of_a_512_mib_tensor_run_on_the_device() {
    let _l = big();
    for (forms, dev) in devices(WINDOW) {
        // 2^27 f32: x[b, r, 0] = b + 1, every other element 0, so every
        // partial sum is an integer below 2^24 (exact) and each of the four
        // windows holds different values.
        let shape = [128usize, 1024, 1024];
        let blk = Tensor::iota(shape, 0, F, &dev).unwrap().add_scalar(1.0).unwrap();
        let first = Tensor::iota(shape, 2, DType::I32, &dev).unwrap().eq_scalar(0).unwrap().cast(F).unwrap();
        let x = blk.mul(&first).unwrap();
        x.sync().unwrap();
        let (fallbacks, windowed) = (metrics::counter("FallbackOps"), metrics::counter("WindowedKernels"));
        let y = x.mul_scalar(2.0).unwrap();
        let s = x.sum(&[], false).unwrap();
        lazuli::sync(&[&y, &s]).unwrap();
        drop((x, blk, first));
        assert_eq!(s.item::<f32>().unwrap(), 1024.0 * (1..=128).sum::<i32>() as f32, "{forms}: sum");
        // Bytes, converted while checked: no second 512 MiB copy.
        let bytes = y.to_bytes().unwrap();
        assert_eq!(bytes.len(), 4 << 27);
        for (i, b) in bytes.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            let want = if i % 1024 == 0 { 2.0 * ((i >> 20) + 1) as f32 } else { 0.0 };
            assert!(got == want, "{forms}: y[{i}] = {got}, want {want}");
        }
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: x * 2 and sum ran on the device");
        assert!(metrics::counter("WindowedKernels") >= windowed + 2, "{forms}: both kernels were windowed");
    }
}

#[test]
fn matmul_with_a_300_mib_operand_and_a_160_mib_output() {
    let _l = big();
    let check =
        |what: &str, got: &[f32], rows: &[usize], cols: &[usize], n: usize, want: &dyn Fn(usize, usize) -> f32| {
            for &i in rows {
                for &j in cols {
                    assert_eq!(got[i * n + j], want(i, j), "{what}: [{i}, {j}]");
                }
            }
        };
    for (forms, dev) in devices(WINDOW) {
        let fallbacks = metrics::counter("FallbackOps");
        // A of 300 MiB: [307200, 256] @ [256, 8].
        let (m, k, n) = (307_200, 256, 8);
        let a = pattern(&dev, [m, k], 7, 3, 17, 0.25);
        a.sync().unwrap();
        let b = pattern(&dev, [k, n], 5, 1, 9, 0.5);
        let c = a.matmul(&b).unwrap().to_vec::<f32>().unwrap();
        drop(a);
        let want = |i: usize, j: usize| {
            (0..k).map(|q| pattern_at(i, q, 7, 3, 17, 0.25) * pattern_at(q, j, 5, 1, 9, 0.5)).sum::<f32>()
        };
        // A window holds 2^25 / 256 = 131072 rows of A.
        check(&format!("{forms}: big A"), &c, &probes(m, 97, 131_072), &(0..n).collect::<Vec<_>>(), n, &want);
        // B of 300 MiB: [4, 64] @ [64, 1228800].
        let (m, k, n) = (4, 64, 1_228_800);
        let a = pattern(&dev, [m, k], 3, 5, 13, 0.5);
        let b = pattern(&dev, [k, n], 1, 7, 11, 0.25);
        b.sync().unwrap();
        let c = a.matmul(&b).unwrap().to_vec::<f32>().unwrap();
        drop(b);
        let want = |i: usize, j: usize| {
            (0..k).map(|q| pattern_at(i, q, 3, 5, 13, 0.5) * pattern_at(q, j, 1, 7, 11, 0.25)).sum::<f32>()
        };
        // Windows of B cut its rows at multiples of 2^25 elements.
        let cols: Vec<usize> = probes(n, 101, 1 << 25).into_iter().chain((1..3).map(|r| (r << 25) % n)).collect();
        check(&format!("{forms}: big B"), &c, &(0..m).collect::<Vec<_>>(), &cols, n, &want);
        // A 160 MiB output, with a bias epilogue: [327680, 16] @ [16, 128] + bias.
        let (m, k, n) = (327_680, 16, 128);
        let a = pattern(&dev, [m, k], 5, 3, 19, 0.5);
        let b = pattern(&dev, [k, n], 3, 1, 7, 0.25);
        let bias = pattern(&dev, [1, n], 1, 1, 5, 1.0);
        let c = a.matmul(&b).unwrap().add(&bias).unwrap().to_vec::<f32>().unwrap();
        let want = |i: usize, j: usize| {
            (0..k).map(|q| pattern_at(i, q, 5, 3, 19, 0.5) * pattern_at(q, j, 3, 1, 7, 0.25)).sum::<f32>()
                + pattern_at(0, j, 1, 1, 5, 1.0)
        };
        // A window holds 2^25 / 128 = 262144 rows of C.
        check(&format!("{forms}: big C"), &c, &probes(m, 61, 262_144), &(0..n).collect::<Vec<_>>(), n, &want);
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: every matmul ran on the device");
    }
}

/// Softmax and layer norm of `row` in f64.
fn softmax_and_norm(row: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let x: Vec<f64> = row.iter().map(|&v| v as f64).collect();
    let max = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = x.iter().map(|v| (v - max).exp()).collect();
    let s: f64 = e.iter().sum();
    let mean = x.iter().sum::<f64>() / x.len() as f64;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / x.len() as f64;
    (e.iter().map(|v| v / s).collect(), x.iter().map(|v| (v - mean) / (var + 1e-5).sqrt()).collect())
}

#[test]
fn softmax_and_layer_norm_rows_of_a_156_mib_tensor() {
    let _l = big();
    let (rows, len) = (40_000usize, 1024usize);
    for (forms, dev) in devices(WINDOW) {
        let fallbacks = metrics::counter("FallbackOps");
        let x = pattern(&dev, [rows, len], 3, 7, 23, 0.125);
        x.sync().unwrap();
        let sm = x.softmax(-1).unwrap();
        let mean = x.mean(&[1], true).unwrap();
        let d = x.sub(&mean).unwrap();
        let var = d.mul(&d).unwrap().mean(&[1], true).unwrap();
        let ln = d.mul(&var.add_scalar(1e-5).unwrap().rsqrt().unwrap()).unwrap();
        lazuli::sync(&[&sm, &ln]).unwrap();
        drop((x, mean, d, var));
        // Every row was written: its softmax sums to 1 (read through the
        // windows by a reduction).
        let sums = sm.sum(&[1], false).unwrap().to_vec::<f32>().unwrap();
        for (r, s) in sums.iter().enumerate() {
            assert!((s - 1.0).abs() < 1e-4, "{forms}: softmax row {r} sums to {s}");
        }
        // A window holds 2^25 / 1024 = 32768 rows.
        for r in [0, 1, 32_767, 32_768, 32_769, rows - 1] {
            let row: Vec<f32> = (0..len).map(|c| pattern_at(r, c, 3, 7, 23, 0.125)).collect();
            let (want_sm, want_ln) = softmax_and_norm(&row);
            let got_sm = sm.narrow(0, r, 1).unwrap().to_vec::<f32>().unwrap();
            let got_ln = ln.narrow(0, r, 1).unwrap().to_vec::<f32>().unwrap();
            for c in 0..len {
                let (g, w) = (got_sm[c] as f64, want_sm[c]);
                assert!((g - w).abs() <= 1e-6 + 1e-4 * w.abs(), "{forms}: softmax [{r}, {c}] = {g}, want {w}");
                let (g, w) = (got_ln[c] as f64, want_ln[c]);
                assert!((g - w).abs() <= 1e-4 + 1e-4 * w.abs(), "{forms}: layer norm [{r}, {c}] = {g}, want {w}");
            }
        }
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: rows ran on the device");
    }
}

#[test]
fn embedding_rows_and_their_gradient_on_a_160_mib_table() {
    let _l = big();
    let (vocab, dim) = (40_960usize, 1024usize);
    for (forms, dev) in devices(WINDOW) {
        let (fallbacks, windowed) = (metrics::counter("FallbackOps"), metrics::counter("WindowedKernels"));
        let table = pattern(&dev, [vocab, dim], 1, 3, 29, 0.5);
        table.sync().unwrap();
        // A window holds 2^25 / 1024 = 32768 rows.
        let ids = [0i32, 1, 32_767, 32_768, 40_959, -2, 32_768];
        let idx = Tensor::from_slice(&ids, [ids.len()], &dev).unwrap();
        let rows = table.gather(0, &idx).unwrap().mul_scalar(2.0).unwrap();
        // The gradient's shape of update: the rows added back into a
        // table-sized tensor (a 160 MiB output).
        let back = table.scatter_add(0, &idx, &rows).unwrap();
        lazuli::sync(&[&rows, &back]).unwrap();
        let e = rows.to_vec::<f32>().unwrap();
        for (j, &id) in ids.iter().enumerate() {
            let r = id.rem_euclid(vocab as i32) as usize;
            for c in 0..dim {
                assert_eq!(e[j * dim + c], 2.0 * pattern_at(r, c, 1, 3, 29, 0.5), "{forms}: row {id}, column {c}");
            }
        }
        for r in [0usize, 1, 2, 32_766, 32_767, 32_768, 32_769, 40_958, 40_959] {
            let hits = ids.iter().filter(|&&id| id.rem_euclid(vocab as i32) as usize == r).count() as f32;
            let got = back.narrow(0, r, 1).unwrap().to_vec::<f32>().unwrap();
            for (c, &g) in got.iter().enumerate() {
                let want = pattern_at(r, c, 1, 3, 29, 0.5) * (1.0 + 2.0 * hits);
                assert_eq!(g, want, "{forms}: scattered row {r}, column {c}");
            }
        }
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: gather and scatter-add ran on the device");
        assert!(metrics::counter("WindowedKernels") >= windowed + 2, "{forms}: both were windowed");
    }
}

#[test]
fn upload_and_readback_of_160_mib() {
    let _l = big();
    let n = 40usize << 20;
    let data: Vec<f32> = (0..n).map(|i| ((i * 31) % 1021) as f32 - 510.0).collect();
    let flags: Vec<bool> = (0..n).map(|i| (i * 7) % 3 == 0).collect();
    for (forms, dev) in devices(WINDOW) {
        let x = Tensor::from_slice(&data, [n], &dev).unwrap();
        let y = x.mul_scalar(-1.5).unwrap().to_vec::<f32>().unwrap();
        drop(x);
        for (i, (&got, &v)) in y.iter().zip(&data).enumerate() {
            assert!(got == v * -1.5, "{forms}: element {i}: {got}, want {}", v * -1.5);
        }
        drop(y);
        // Bools: one byte on the host, 32 bits on the device.
        let b = Tensor::from_slice(&flags, [n], &dev).unwrap();
        let nb = b.logical_not().unwrap().to_vec::<bool>().unwrap();
        assert!(nb.iter().zip(&flags).all(|(a, b)| *a != *b), "{forms}: bools");
    }
}

/// Elementwise kernels whose one-vector-per-invocation grid needs more
/// workgroups than one dispatch dimension holds (65535 of 256
/// invocations): the GPU form dispatches them in two dimensions
/// (`lazuli_wgpu::codegen::elementwise::gpu_steps`), the software form
/// strides over consecutive vectors; both match the host on every
/// element. A 256 MiB vec4 kernel of 16387 x 4096 elements (16780288
/// vectors, 65548 workgroups: a full row and a partial second, windowed)
/// and a 64 MiB scalar-width one of 65535 * 256 + 3 elements (65536
/// workgroups, one invocation in the second row).
#[test]
fn elementwise_kernels_beyond_one_dispatch_dimension_match_the_host() {
    let _l = big();
    let lanes = 65535 * 256;
    for (forms, dev) in devices(WINDOW) {
        let dims = [16387usize, 4096];
        assert!(dims[0] * dims[1] / 4 > lanes);
        let x = pattern(&dev, dims, 1, 3, 61, 0.25);
        x.sync().unwrap();
        let fallbacks = metrics::counter("FallbackOps");
        let y = x.mul_scalar(2.0).unwrap().add_scalar(1.0).unwrap().abs().unwrap();
        y.sync().unwrap();
        drop(x);
        let bytes = y.to_bytes().unwrap();
        drop(y);
        assert_eq!(bytes.len(), 4 * dims[0] * dims[1]);
        for (e, b) in bytes.chunks_exact(4).enumerate() {
            let got = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            let want = (pattern_at(e / dims[1], e % dims[1], 1, 3, 61, 0.25) * 2.0 + 1.0).abs();
            assert!(got == want, "{forms}: vec4 y[{e}] = {got}, want {want}");
        }
        drop(bytes);
        // An odd count: scalar width, one element per invocation.
        let n = lanes + 3;
        let x = Tensor::iota([n], 0, DType::I32, &dev).unwrap().rem_scalar(1001).unwrap().cast(F).unwrap();
        x.sync().unwrap();
        let y = x.mul_scalar(-0.5).unwrap().add_scalar(3.0).unwrap().to_vec::<f32>().unwrap();
        drop(x);
        assert_eq!(y.len(), n);
        for (e, &got) in y.iter().enumerate() {
            let want = (e % 1001) as f32 * -0.5 + 3.0;
            assert!(got == want, "{forms}: scalar y[{e}] = {got}, want {want}");
        }
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: both chains ran on the device");
    }
}

/// The backend error inside `e`.
fn backend_error(e: &ExecError) -> Option<&BackendError> {
    match e {
        ExecError::Backend { source, .. } => Some(source),
        ExecError::Failed { cause, .. } | ExecError::Poisoned { cause, .. } => backend_error(cause),
        _ => None,
    }
}

#[test]
fn a_kernel_needing_more_bindings_than_the_adapter_has_is_a_typed_error() {
    let _l = big();
    // 256-byte windows: a [4096] f32 tensor is 64 windows, and `exp` binds
    // it twice (input and output): more bindings than the devices' 31 per
    // kernel (lavapipe's, forced on any adapter), and nothing to split.
    for (forms, dev) in devices(256) {
        let x = Tensor::from_slice(&common::rand_vec(4096, 3, -1.0, 1.0), [4096], &dev).unwrap();
        let err = x.exp().unwrap().to_vec::<f32>().expect_err("too many windows");
        match backend_error(&err) {
            Some(BackendError::TooLarge { op, bytes, limit_name, .. }) => {
                assert!(op.contains("exp") && op.contains("128 storage bindings"), "{forms}: {err}");
                assert_eq!(*bytes, 2 * 4096 * 4, "{forms}: {err}");
                assert!(limit_name.contains("storage bindings"), "{forms}: {err}");
            }
            _ => panic!("{forms}: expected TooLarge, got {err:?}"),
        }
        // The device is fine afterwards, windows included.
        let y = Tensor::from_slice(&common::rand_vec(100, 4, -1.0, 1.0), [100], &dev).unwrap();
        let got = y.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, common::rand_vec(100, 4, -1.0, 1.0).iter().map(|v| v * 2.0).collect::<Vec<_>>(), "{forms}");
    }
}

// Windowed twins: every kernel family on small tensors bound in 60 KiB
// windows (15360 f32), against the CPU reference.

type Build = fn(&[Tensor]) -> lazuli::Result<Tensor>;

/// A twin: its name, input shapes and dtypes, and the program.
type Twin = (&'static str, Vec<(Vec<usize>, DType)>, Build);

/// Cases: name, input shapes (f32, i32 where named), the program. Every
/// case has a tensor of 2 to 6 windows of 15360 elements.
fn twins() -> Vec<Twin> {
    let f = |d: &[usize]| (d.to_vec(), F);
    vec![
        ("elementwise vec4", vec![f(&[64, 600]), f(&[600])], |x| x[0].mul(&x[1])?.add_scalar(0.5)?.tanh()),
        ("elementwise odd", vec![f(&[40_001])], |x| x[0].exp()?.sub_scalar(1.0)),
        ("materialized operand", vec![f(&[96, 400])], |x| {
            let a = x[0].relu()?;
            lazuli::sync(&[&a])?;
            a.add(&x[0].neg()?)
        }),
        ("transpose", vec![f(&[150, 240])], |x| x[0].t()?.mul_scalar(3.0)),
        ("slice and pad", vec![f(&[120, 300])], |x| x[0].slice(1, 290, 3, -2)?.pad(&[(2, 3), (1, 0)], 0.5)),
        ("concat", vec![f(&[60, 300]), f(&[90, 300]), f(&[50, 300])], |x| Tensor::concat(&[&x[0], &x[1], &x[2]], 0)),
        ("bool output", vec![f(&[40_000])], |x| x[0].gt_scalar(0.0)?.logical_not()),
        ("i32 arithmetic", vec![(vec![100, 400], DType::I32)], |x| x[0].mul_scalar(3)?.rem_scalar(7)),
        ("iota", vec![f(&[1])], |x| Tensor::iota([160, 200], 1, F, x[0].device())?.add(&x[0])),
        ("full sum", vec![f(&[70_000])], |x| x[0].sum(&[], false)),
        ("row sums", vec![f(&[60, 1000])], |x| x[0].sum(&[1], false)),
        ("column means", vec![f(&[1000, 60])], |x| x[0].mean(&[0], true)),
        ("middle max", vec![f(&[20, 300, 10])], |x| x[0].max(&[1], false)),
        ("argmax", vec![f(&[40, 1000])], |x| x[0].argmax(1, false)),
        ("cumsum", vec![f(&[30, 1000])], |x| x[0].cumsum(1, false, false)),
        ("softmax rows", vec![f(&[60, 1000])], |x| x[0].softmax(-1)),
        ("log softmax middle", vec![f(&[10, 500, 6])], |x| x[0].log_softmax(1)),
        ("layer norm", vec![f(&[50, 800])], |x| {
            let d = x[0].sub(&x[0].mean(&[1], true)?)?;
            d.mul(&d.mul(&d)?.mean(&[1], true)?.add_scalar(1e-5)?.rsqrt()?)
        }),
        // One windowed operand or output each (llvmpipe compiles windowed
        // register-blocked matmuls slowly).
        ("matmul, A windowed", vec![f(&[400, 48]), f(&[48, 40])], |x| x[0].matmul(&x[1])),
        ("matmul epilogue, B windowed", vec![f(&[40, 48]), f(&[48, 400]), f(&[400])], |x| {
            x[0].matmul(&x[1])?.add(&x[2])?.relu()
        }),
        ("matmul transposed, output windowed", vec![f(&[130, 16]), f(&[130, 16])], |x| x[0].matmul(&x[1].t()?)),
        ("batched matmul", vec![f(&[4, 100, 48]), f(&[4, 48, 40])], |x| x[0].matmul(&x[1])),
        ("random", vec![f(&[1])], |x| Tensor::rand([60_000], F, x[0].device())?.add(&x[0])),
        ("gather", vec![f(&[300, 200])], |x| {
            let ids = Tensor::from_slice(&[0i32, 76, 77, 153, 299, -1, 77], [7], x[0].device())?;
            x[0].gather(0, &ids)?.add_scalar(1.0)
        }),
        ("scatter-add", vec![f(&[300, 200]), f(&[5, 200])], |x| {
            let ids = Tensor::from_slice(&[76i32, 77, 76, 299, 0], [5], x[0].device())?;
            x[0].scatter_add(0, &ids, &x[1])
        }),
        ("conv2d, input and output windowed", vec![f(&[2, 3, 60, 60]), f(&[8, 3, 3, 3])], |x| {
            x[0].conv2d(&x[1], lazuli::ir::ConvAttrs { pads: [1; 4], ..Default::default() })
        }),
        // Few positions and a long reduction: split into parts added by a
        // second pass; the weight is windowed too.
        ("conv2d, split reduction", vec![f(&[1, 32, 30, 30]), f(&[4, 32, 28, 28])], |x| {
            x[0].conv2d(&x[1], lazuli::ir::ConvAttrs::default())
        }),
        ("max pool", vec![f(&[2, 8, 60, 60])], |x| x[0].pool(PoolAttrs::new(PoolKind::Max, &[2, 2]))),
        ("avg pool gradient", vec![f(&[2, 8, 60, 60]), f(&[2, 8, 20, 20])], |x| {
            x[0].pool_grad(&x[1], PoolAttrs::new(PoolKind::Avg { count_include_pad: true }, &[3, 3]))
        }),
    ]
}

fn input(dev: &Device, k: usize, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v = common::rand_vec(n, 41 + k as u64, -2.0, 2.0);
    match dtype {
        DType::I32 => Tensor::from_slice(&v.iter().map(|x| (x * 8.0) as i32).collect::<Vec<_>>(), shape.to_vec(), dev),
        _ => Tensor::from_slice(&v, shape.to_vec(), dev),
    }
    .unwrap()
}

#[test]
fn windowed_twins_of_every_kernel_family_match_the_cpu() {
    let _l = big();
    let cpu = Device::cpu();
    for (forms, dev) in devices(60 << 10) {
        for (name, shapes, build) in twins() {
            let run = |d: &Device| {
                if name == "random" {
                    d.manual_seed(7);
                }
                let xs: Vec<Tensor> = shapes.iter().enumerate().map(|(k, (s, t))| input(d, k, s, *t)).collect();
                let y = build(&xs).unwrap_or_else(|e| panic!("{forms} {name}: {e}"));
                let v = y.to_scalars().unwrap_or_else(|e| panic!("{forms} {name}: {e}"));
                (v.iter().map(|s| s.as_f64()).collect::<Vec<_>>(), y.dims().to_vec())
            };
            let (windowed, fallbacks) = (metrics::counter("WindowedKernels"), metrics::counter("FallbackOps"));
            let (got, gdims) = run(&dev);
            assert!(metrics::counter("WindowedKernels") > windowed, "{forms} {name}: nothing was windowed");
            assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms} {name}: ran on the device");
            let (want, wdims) = run(&cpu);
            assert_eq!(gdims, wdims, "{forms} {name}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{forms} {name}: element {i}: {g}, want {w}");
            }
        }
    }
}

// Windows together with multi-tensor kernels, cached bind groups and
// error slots: devices with 60 KiB windows that keep idle buffers, so a
// plan's buffers (and with them its bind groups) recur from step to step.

/// A wgpu device per kernel-form profile with 60 KiB windows and the
/// default buffer pool; `max_storage_buffers` clamps the bindings of one
/// kernel ([`STORAGE_BUFFERS`] without it).
fn cached_devices(max_storage_buffers: Option<u32>) -> Vec<(&'static str, Device)> {
    if common::wgpu().is_none() {
        return Vec::new();
    }
    [("software", KernelForms::software()), ("gpu", KernelForms::gpu())]
        .into_iter()
        .map(|(name, forms)| {
            let opts = WgpuDeviceOptions {
                kernel_forms: Some(forms),
                binding_window: Some(60 << 10),
                max_storage_buffers: Some(max_storage_buffers.unwrap_or(STORAGE_BUFFERS)),
                ..Default::default()
            };
            (name, Device::wgpu_with(opts).expect("a second device on the adapter"))
        })
        .collect()
}

/// SGD steps `p -= g * lr` (`lr` new every step) on a parameter of 3
/// windows and two small ones: the updates share one multi-tensor kernel
/// (windowed: its source is rewritten like any kernel's) or, with at most
/// 12 storage buffers per stage (11 per kernel), the windowed update's 9
/// bindings keep it apart from the small ones, which still join. Either
/// way a steady loop creates no bind groups after warm-up (the windows'
/// offsets and sizes in their keys) and matches the CPU every step.
#[test]
fn windowed_multi_tensor_updates_reuse_their_bind_groups() {
    let _l = big();
    let shapes: [&[usize]; 3] = [&[64, 600], &[7], &[33, 10]];
    let init = |dev: &Device| -> Vec<(Tensor, Tensor)> {
        shapes
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let n: usize = s.iter().product();
                let p = Tensor::from_slice(&common::rand_vec(n, 60 + k as u64, -1.0, 1.0), s.to_vec(), dev).unwrap();
                let g = Tensor::from_slice(&common::rand_vec(n, 70 + k as u64, -1.0, 1.0), s.to_vec(), dev).unwrap();
                (p, g)
            })
            .collect()
    };
    let step = |params: &[(Tensor, Tensor)], s: usize| {
        for (p, g) in params {
            p.sub_(&g.mul_scalar(0.1 + 0.01 * s as f64).unwrap()).unwrap();
        }
    };
    let cpu = Device::cpu();
    let want: Vec<Vec<Vec<f32>>> = {
        let params = init(&cpu);
        (0..8)
            .map(|s| {
                step(&params, s);
                params.iter().map(|(p, _)| p.to_vec::<f32>().unwrap()).collect()
            })
            .collect()
    };
    for (max, launches_per_step) in [(None, 1), (Some(12), 2)] {
        for (forms, dev) in cached_devices(max) {
            let what = format!("{forms}, max {max:?}");
            let params = init(&dev);
            dev.wait().unwrap();
            let windowed = metrics::counter("WindowedKernels");
            let mut created = Vec::new();
            for (s, want) in want.iter().enumerate() {
                step(&params, s);
                if s == 0 {
                    let refs: Vec<&Tensor> = params.iter().map(|(p, _)| p).collect();
                    let code = lazuli::debug::backend_code(&refs).unwrap();
                    assert_eq!(code.len(), launches_per_step as usize, "{what}: {code:?}");
                    let multi =
                        code.iter().find(|(name, _)| name.contains("MultiTensor")).expect("a multi-tensor kernel");
                    assert_eq!(
                        multi.1.contains("fn ld_in"),
                        max.is_none(),
                        "{what}: windowed only when joined:\n{}",
                        multi.1
                    );
                }
                let (c0, l0) = (metrics::counter("WgpuBindGroupsCreated"), metrics::counter("KernelLaunches"));
                dev.mark_step().unwrap();
                dev.wait().unwrap();
                created.push(metrics::counter("WgpuBindGroupsCreated") - c0);
                assert_eq!(metrics::counter("KernelLaunches") - l0, launches_per_step, "{what}: step {s}");
                for (k, ((p, _), w)) in params.iter().zip(want).enumerate() {
                    common::assert_close(&p.to_vec::<f32>().unwrap(), w, 1e-6, 1e-6, &format!("{what}: step {s} p{k}"));
                }
            }
            assert!(metrics::counter("WindowedKernels") > windowed, "{what}: the update was windowed");
            assert!(created[4..].iter().all(|&c| c == 0), "{what}: bind groups created per step: {created:?}");
        }
    }
}

/// A gather from a table of 4 windows, indices `base + k` with `k` a
/// lifted scalar, run as one cached plan with `k` = 3, 7, 40 (one index
/// out of range) and 11: the gather binds its windows and its error slot
/// through the plan's cached bind groups from the second run on, the bad
/// run is `IndexOutOfRange` naming the index, and the next good run
/// (slots zeroed again, same groups) is right.
#[test]
fn a_gather_error_slot_and_windows_through_cached_bind_groups() {
    let _l = big();
    let (rows, cols) = (300, 200);
    let data = common::rand_vec(rows * cols, 80, -2.0, 2.0);
    let base = [0i32, 76, 77, 153, 280, 5, 1];
    for (forms, dev) in cached_devices(None) {
        let table = Tensor::from_slice(&data, [rows, cols], &dev).unwrap();
        let base_t = Tensor::from_slice(&base, [base.len()], &dev).unwrap();
        let half = table.mul_scalar(0.5).unwrap();
        half.sync().unwrap();
        dev.wait().unwrap();
        let compiles = dev.compile_counts().0;
        for (run, k) in [3i32, 7, 40, 11].into_iter().enumerate() {
            let (c0, r0) = (metrics::counter("WgpuBindGroupsCreated"), metrics::counter("WgpuBindGroupsReused"));
            let ids = base_t.add_scalar(k).unwrap();
            // The gather, and a windowed elementwise kernel beside it.
            let y = table.gather(0, &ids).unwrap().add_scalar(1.0).unwrap();
            let z = table.mul_scalar(0.25).unwrap().add(&half).unwrap();
            lazuli::sync(&[&y, &z]).unwrap();
            let got = y.to_vec::<f32>();
            let zs = z.to_vec::<f32>();
            dev.wait().unwrap();
            let (created, reused) =
                (metrics::counter("WgpuBindGroupsCreated") - c0, metrics::counter("WgpuBindGroupsReused") - r0);
            if run > 0 {
                assert_eq!(created, 0, "{forms}: run {run} (k = {k}) made bind groups");
                assert!(reused >= 2, "{forms}: run {run} (k = {k}) reused {reused} bind groups");
            }
            if k == 40 {
                let e = got.expect_err("index 320 of 300");
                match backend_error(&e) {
                    Some(BackendError::IndexOutOfRange(ie)) => {
                        assert_eq!(
                            (ie.op.as_str(), ie.index, ie.axis, ie.size),
                            ("gather", 320, 0, rows),
                            "{forms}: {e}"
                        );
                    }
                    _ => panic!("{forms}: expected an index out of range, got {e}"),
                }
                continue;
            }
            let got = got.unwrap_or_else(|e| panic!("{forms}: k = {k}: {e}"));
            let want: Vec<f32> =
                base.iter().flat_map(|&b| data[(b + k) as usize * cols..][..cols].iter().map(|v| v + 1.0)).collect();
            assert_eq!(got, want, "{forms}: k = {k}");
            let want_z: Vec<f32> = data.iter().map(|v| v * 0.25 + v * 0.5).collect();
            common::assert_close(&zs.unwrap(), &want_z, 1e-6, 1e-6, &format!("{forms}: z, k = {k}"));
        }
        assert_eq!(dev.compile_counts().0, compiles + 1, "{forms}: one plan for every k");
    }
}

// Fused attention with windowed operands: its kernels read q, k, v, the
// mask and the backward's operands only as `inK[index]` and write only
// `outK[index] = value;`, so `window::split` rewrites them like any
// kernel; the fusion planner counts every window when it groups parts.

/// q, k, v (and the gradient of `sum(O * w)`) of one attention problem:
/// q read through a head transpose (`[b, t_q, h, d]` permuted, the view
/// the planner inlines into every attention kernel), an additive mask.
fn attention_step(dev: &Device, b: usize, h: usize, tq: usize, tk: usize, d: usize, dv: usize) -> Vec<Tensor> {
    let leaf = |dims: Vec<usize>, seed: u64| {
        let n: usize = dims.iter().product();
        Tensor::from_slice(&common::rand_vec(n, seed, -1.0, 1.0), dims, dev).unwrap().requires_grad_(true).unwrap()
    };
    let qh = leaf(vec![b, tq, h, d], 91);
    let k = leaf(vec![b, h, tk, d], 92);
    let v = leaf(vec![b, h, tk, dv], 93);
    let mask = Tensor::from_slice(&common::rand_vec(tq * tk, 94, -2.0, 0.0), [tq, tk], dev).unwrap();
    let w = Tensor::from_slice(&common::rand_vec(b * h * tq * dv, 95, -1.0, 1.0), [b, h, tq, dv], dev).unwrap();
    let q = qh.permute(&[0, 2, 1, 3]).unwrap();
    let o = q.attention(&k, &v, 1.0 / (d as f64).sqrt(), true, Some(&mask)).unwrap();
    o.mul(&w).unwrap().sum(&[], false).unwrap().backward().unwrap();
    vec![o, qh.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()]
}

/// Causal attention with an additive mask, forward and gradients, with
/// 13 KiB windows (3328 f32: not a power of two, and rows of 24 and 40
/// cross window edges): q, k and the mask take 3 windows each, v, dO and
/// the output 5, so every attention kernel is windowed. In the software
/// profile the kernels are the per-row form (head + value dim of 16
/// vec4s), in the GPU profile the tiled one; all run on the device (no
/// fallback) and match the CPU. With 256-byte windows a single part
/// needs more bindings than a kernel may have: `BackendError::TooLarge`
/// naming the attention kernel, and the device stays usable.
#[test]
fn windowed_attention_forward_and_gradients_match_the_cpu() {
    let _l = big();
    let (b, h, tq, tk, d, dv) = (2, 2, 100, 90, 24, 40);
    let cpu = Device::cpu();
    let want: Vec<Vec<f32>> = attention_step(&cpu, b, h, tq, tk, d, dv).iter().map(|t| t.to_vec().unwrap()).collect();
    for (forms, dev) in devices(13 << 10) {
        let (windowed, fallbacks) = (metrics::counter("WindowedKernels"), metrics::counter("FallbackOps"));
        let got = attention_step(&dev, b, h, tq, tk, d, dv);
        let refs: Vec<&Tensor> = got.iter().collect();
        let code = lazuli::debug::backend_code(&refs).unwrap();
        let attention: Vec<&(String, String)> = code.iter().filter(|(name, _)| name.contains("Attention")).collect();
        // The forward with its log-sum-exp, the query gradient, the key
        // and value gradients (29 bindings in windows: within the 31 per
        // kernel of lavapipe that the devices force; fewer would split
        // them).
        assert!(attention.len() >= 3, "{forms}: {:?}", code.iter().map(|c| &c.0).collect::<Vec<_>>());
        for (name, src) in &attention {
            assert!(src.contains("fn ld_in") && src.contains("st_out"), "{forms}: {name} is not windowed:\n{src}");
            // The slice-staged tiled kernels, or the flash forward.
            let tiled = src.contains("var<workgroup> sp") || src.contains("var<workgroup> fm");
            assert_eq!(tiled, forms == "gpu", "{forms}: {name}: the profile's attention form");
        }
        lazuli::sync(&refs).unwrap();
        for (i, (t, w)) in got.iter().zip(&want).enumerate() {
            common::assert_close(&t.to_vec::<f32>().unwrap(), w, 2e-4, 2e-4, &format!("{forms}: value {i}"));
        }
        assert!(metrics::counter("WindowedKernels") >= windowed + attention.len() as u64, "{forms}: windowed");
        assert_eq!(metrics::counter("FallbackOps"), fallbacks, "{forms}: attention ran on the device");
    }
    // 256-byte windows: the forward alone binds q, k, v and the output in
    // 16 windows each, more than the 31 bindings per kernel the devices
    // force.
    for (forms, dev) in devices(256) {
        let r = |dims: [usize; 3], seed| Tensor::from_slice(&common::rand_vec(1024, seed, -1.0, 1.0), dims, &dev);
        let (q, k, v) = (r([1, 64, 16], 1).unwrap(), r([1, 64, 16], 2).unwrap(), r([1, 64, 16], 3).unwrap());
        let err = q.attention(&k, &v, 0.25, false, None).unwrap().to_vec::<f32>().expect_err("too many windows");
        match backend_error(&err) {
            Some(BackendError::TooLarge { op, limit_name, .. }) => {
                assert!(op.contains("attention") && op.contains("storage bindings"), "{forms}: {err}");
                assert!(limit_name.contains("storage bindings"), "{forms}: {err}");
            }
            _ => panic!("{forms}: expected TooLarge, got {err:?}"),
        }
        let y = Tensor::from_slice(&common::rand_vec(100, 4, -1.0, 1.0), [100], &dev).unwrap();
        let got = y.mul_scalar(2.0).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, common::rand_vec(100, 4, -1.0, 1.0).iter().map(|v| v * 2.0).collect::<Vec<_>>(), "{forms}");
    }
}
