//! The matmul kernels against the CPU reference over every operand layout:
//! both operands row-major or transposed views, transposed views of
//! reshaped inputs (a Linear layer's weight gradient over flattened
//! tokens), batched and broadcast batches, M, N and K that are not
//! multiples of any tile, a fused epilogue, and split K; in both
//! kernel-form profiles, so the GPU forms (the tiled matmul, its trusted
//! modules and split-K) are proven on whatever adapter runs the tests.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;

fn f32s(dev: &Device, dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_slice(&common::rand_vec(n, seed, -1.0, 1.0), dims.to_vec(), dev).unwrap()
}

/// How an operand reaches the product.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Stored as the product reads it.
    Rows,
    /// Stored with its last two dims swapped, read through a transpose.
    Transposed,
    /// Stored as `[2, rows / 2, cols]` transposed: reshaped to 2-D, then
    /// transposed (2-D operands with an even leading dim only).
    ReshapedTransposed,
}

/// One product: batch dims of A and of B (they broadcast), M, K, N, the
/// layouts of A and B, and whether `relu(0.5 y + bias)` is fused.
#[derive(Clone, Copy, Debug)]
struct Case {
    ba: &'static [usize],
    bb: &'static [usize],
    mkn: (usize, usize, usize),
    la: Layout,
    lb: Layout,
    epilogue: bool,
}

/// The operand `[batch.., rows, cols]` in `layout`, from seed `seed`.
fn operand(dev: &Device, batch: &[usize], rows: usize, cols: usize, layout: Layout, seed: u64) -> Tensor {
    let dims = |r: usize, c: usize| [batch, &[r, c]].concat();
    match layout {
        Layout::Rows => f32s(dev, &dims(rows, cols), seed),
        Layout::Transposed => f32s(dev, &dims(cols, rows), seed).transpose(-2, -1).unwrap(),
        Layout::ReshapedTransposed => {
            assert!(batch.is_empty() && cols.is_multiple_of(2), "2-D, even K");
            f32s(dev, &[2, cols / 2, rows], seed).reshape([cols, rows]).unwrap().t().unwrap()
        }
    }
}

/// The case's result on `dev`, and the names of its kernels.
fn run(dev: &Device, c: &Case) -> (Vec<f32>, Vec<String>) {
    let (m, k, n) = c.mkn;
    let a = operand(dev, c.ba, m, k, c.la, 1);
    let b = operand(dev, c.bb, k, n, c.lb, 2);
    let mut y = a.matmul(&b).unwrap();
    if c.epilogue {
        let bias = f32s(dev, &[n], 3);
        let half = Tensor::scalar(0.5f32, DType::F32, dev);
        y = y.mul(&half).unwrap().add(&bias).unwrap().relu().unwrap();
    }
    let names = lazuli::debug::backend_code(&[&y]).unwrap().into_iter().map(|(n, _)| n).collect();
    (y.to_vec::<f32>().unwrap(), names)
}

fn cases() -> Vec<Case> {
    use Layout::*;
    let layouts = [(Rows, Rows), (Transposed, Rows), (Rows, Transposed), (Transposed, Transposed)];
    let mut v = Vec::new();
    // Sizes off every tile (64, 128) and vec4 boundary, K from 1 to 1000;
    // each takes the four layout pairs in turn, with and without epilogue.
    let sizes: [(usize, usize, usize); 14] = [
        (1, 1, 1),
        (7, 3, 63),
        (63, 17, 65),
        (65, 64, 127),
        (127, 9, 129),
        (129, 200, 200),
        (200, 1, 7),
        (64, 1000, 64),
        (128, 8, 128),
        (33, 255, 96),
        (96, 33, 33),
        (129, 129, 1),
        (40, 512, 44),
        (256, 24, 65),
    ];
    for (i, &mkn) in sizes.iter().enumerate() {
        for (j, &(la, lb)) in layouts.iter().enumerate() {
            v.push(Case { ba: &[], bb: &[], mkn, la, lb, epilogue: (i + j) % 2 == 0 });
        }
    }
    // Transposed views of reshaped inputs (weight gradients over tokens).
    for (mkn, lb) in [((64, 96, 72), Rows), ((65, 130, 63), Rows), ((128, 64, 128), Transposed)] {
        v.push(Case { ba: &[], bb: &[], mkn, la: ReshapedTransposed, lb, epilogue: false });
    }
    v.push(Case { ba: &[], bb: &[], mkn: (96, 200, 64), la: Rows, lb: ReshapedTransposed, epilogue: true });
    // Batched, and broadcast batches (either side, and both ways at once).
    type Batched = (&'static [usize], &'static [usize], (usize, usize, usize));
    let batched: [Batched; 5] = [
        (&[3], &[3], (65, 40, 33)),
        (&[2, 3], &[], (64, 32, 129)),
        (&[], &[4], (33, 20, 64)),
        (&[2, 1], &[1, 3], (40, 36, 72)),
        (&[5], &[1], (7, 129, 65)),
    ];
    for (i, &(ba, bb, mkn)) in batched.iter().enumerate() {
        let (la, lb) = layouts[i % 4];
        v.push(Case { ba, bb, mkn, la, lb, epilogue: i % 2 == 1 });
    }
    v
}

#[test]
fn every_layout_matches_the_cpu_in_both_profiles() {
    // Every test here holds the metrics lock: one counts trusted modules.
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let cases = cases();
    let want: Vec<Vec<f32>> = cases.iter().map(|c| run(&cpu, c).0).collect();
    for (profile, dev) in common::wgpu_profiles() {
        for (c, want) in cases.iter().zip(&want) {
            let (got, _) = run(&dev, c);
            // K up to 1000 of values in [-1, 1): sums of about +-20.
            common::assert_close(&got, want, 1e-4, 1e-4, &format!("{profile}: {c:?}"));
        }
    }
}

/// Weight gradients long enough in K to be split (GPU profile) over every
/// layout of their operands; the software profile never splits.
#[test]
fn split_k_over_every_layout_matches_the_cpu() {
    use Layout::*;
    let _g = common::metrics_lock();
    let cpu = Device::cpu();
    let cases = [
        Case { ba: &[], bb: &[], mkn: (64, 2048, 64), la: Transposed, lb: Rows, epilogue: false },
        Case { ba: &[], bb: &[], mkn: (65, 1100, 63), la: ReshapedTransposed, lb: Rows, epilogue: true },
        Case { ba: &[], bb: &[], mkn: (48, 1500, 40), la: Rows, lb: Transposed, epilogue: true },
        Case { ba: &[], bb: &[], mkn: (40, 1027, 72), la: Transposed, lb: Transposed, epilogue: false },
    ];
    for (profile, dev) in common::wgpu_profiles() {
        for c in &cases {
            let (got, names) = run(&dev, c);
            let (want, _) = run(&cpu, c);
            let split = names.iter().any(|n| n.ends_with("_pass1"));
            assert_eq!(split, profile == "gpu forms", "{profile} {c:?}: {names:?}");
            common::assert_close(&got, &want, 1e-4, 1e-4, &format!("{profile}: {c:?}"));
        }
    }
}

/// The GPU profile's tiled kernels get trusted (unchecked) modules, and
/// the same results come back with the switch off, where none is trusted.
#[test]
fn trusted_modules_only_where_switched_on() {
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let cpu = Device::cpu();
    let c = Case { ba: &[2], bb: &[], mkn: (65, 40, 129), la: Layout::Transposed, lb: Layout::Rows, epilogue: true };
    let (want, _) = run(&cpu, &c);
    for trusted in [true, false] {
        let opts = lazuli::WgpuDeviceOptions {
            kernel_forms: Some(lazuli::wgpu::forms::KernelForms::gpu()),
            trusted_shaders: Some(trusted),
            ..Default::default()
        };
        let dev = Device::wgpu_with(opts).unwrap();
        let before = metrics::counter("TrustedModules");
        let (got, _) = run(&dev, &c);
        let made = metrics::counter("TrustedModules") - before;
        assert_eq!(made > 0, trusted, "trusted modules made: {made}");
        common::assert_close(&got, &want, 1e-4, 1e-4, &format!("trusted {trusted}"));
    }
}
