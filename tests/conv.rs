//! 2-d convolution on wgpu against the CPU reference, in both kernel-form
//! profiles (the direct form and the tiled implicit GEMM): strides,
//! asymmetric padding, dilation, groups (depthwise included), batch 1 and
//! more, odd sizes, 1x1 kernels, kernels as large as the padded input,
//! channel counts around the tiles' edges (1, 15, 16, 17, 33, 70), and
//! the input and weight gradients, which the autograd writes as more
//! convolutions over permuted and flipped views (weight gradients with a
//! long reduction split into parts). A CNN training step runs
//! with no node on the CPU fallback.

mod common;
use lazuli::ir::ConvAttrs;
use lazuli::metrics;
use lazuli::prelude::*;

fn f32s(dev: &Device, dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_slice(&common::rand_vec(n, seed, -1.0, 1.0), dims.to_vec(), dev).unwrap()
}

/// One convolution case: input dims, weight dims and attributes.
struct Case {
    x: [usize; 4],
    w: [usize; 4],
    attrs: ConvAttrs,
}

fn case(
    x: [usize; 4],
    w: [usize; 4],
    strides: [usize; 2],
    pads: [usize; 4],
    dilations: [usize; 2],
    groups: usize,
) -> Case {
    Case { x, w, attrs: ConvAttrs { strides, pads, dilations, groups } }
}

fn cases() -> Vec<Case> {
    vec![
        // LeNet's two layers.
        case([4, 1, 8, 8], [16, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        case([4, 16, 4, 4], [32, 16, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        // Strides, asymmetric padding, dilation, odd sizes.
        case([2, 3, 11, 9], [5, 3, 3, 2], [2, 3], [0, 2, 1, 0], [1, 1], 1),
        case([1, 4, 13, 10], [17, 4, 3, 3], [1, 2], [2, 1, 0, 3], [2, 3], 1),
        // Groups and depthwise.
        case([2, 6, 7, 7], [9, 2, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 3),
        case([3, 8, 6, 5], [8, 1, 3, 3], [2, 1], [1, 0, 1, 2], [1, 1], 8),
        // 1x1 kernels, channel counts at and past the tile edges.
        case([2, 33, 5, 5], [70, 33, 1, 1], [1, 1], [0, 0, 0, 0], [1, 1], 1),
        case([1, 15, 9, 9], [15, 15, 1, 1], [2, 2], [0, 0, 0, 0], [1, 1], 1),
        // A kernel as large as the padded input (one output position).
        case([2, 2, 5, 4], [3, 2, 7, 6], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        // More positions than one workgroup tile, and a long tap axis.
        case([3, 20, 12, 12], [16, 20, 5, 5], [1, 1], [2, 2, 2, 2], [1, 1], 1),
        // Weight gradients with few positions and a long reduction over
        // the batch: split into parts added by a second pass.
        case([16, 2, 9, 9], [4, 2, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        case([40, 3, 10, 10], [5, 3, 2, 2], [2, 2], [0, 0, 0, 0], [1, 1], 1),
    ]
}

/// The convolution of `c` on `dev` and, with `grads`, the gradients of a
/// weighted sum of its output with respect to the input and the weight.
fn run(c: &Case, dev: &Device, seed: u64, grads: bool) -> Vec<Vec<f32>> {
    let x = f32s(dev, &c.x, seed).requires_grad_(grads).unwrap();
    let w = f32s(dev, &c.w, seed + 1).requires_grad_(grads).unwrap();
    let y = x.conv2d(&w, c.attrs.clone()).unwrap();
    let mut out = vec![y.to_vec::<f32>().unwrap()];
    if grads {
        let r = f32s(dev, y.dims(), seed + 2);
        y.mul(&r).unwrap().sum(&[], false).unwrap().backward().unwrap();
        out.push(x.grad().unwrap().to_vec::<f32>().unwrap());
        out.push(w.grad().unwrap().to_vec::<f32>().unwrap());
    }
    out
}

#[test]
fn conv2d_forward_and_gradients_match_the_cpu_in_both_profiles() {
    let cpu = Device::cpu();
    let devices = common::wgpu_profiles();
    for (i, c) in cases().iter().enumerate() {
        let want = run(c, &cpu, 10 * i as u64, true);
        for (profile, dev) in &devices {
            let got = run(c, dev, 10 * i as u64, true);
            for (part, (g, w)) in ["output", "input gradient", "weight gradient"].iter().zip(got.iter().zip(&want)) {
                let what = format!("{part} of conv x {:?} w {:?} {:?}, {profile}", c.x, c.w, c.attrs);
                common::assert_close(g, w, 1e-4, 1e-4, &what);
            }
        }
    }
}

#[test]
fn conv2d_reads_views_in_place_and_handles_an_empty_batch() {
    let cpu = Device::cpu();
    for (profile, dev) in common::wgpu_profiles() {
        let f = |d: &Device| {
            // A permuted input (channels and batch swapped) and a flipped,
            // transposed weight: the views the gradients read.
            let x = f32s(d, &[5, 1, 7, 6], 3).permute(&[1, 0, 2, 3]).unwrap();
            let w = f32s(d, &[5, 4, 3, 3], 4).narrow(3, 0, 3).unwrap().permute(&[1, 0, 2, 3]).unwrap();
            let attrs = ConvAttrs { pads: [1, 0, 1, 2], ..Default::default() };
            let y = x.conv2d(&w, attrs).unwrap();
            // An empty batch (a kernel larger than the input is an error
            // at record time, on every backend).
            let e = f32s(d, &[0, 2, 4, 4], 5).conv2d(&f32s(d, &[3, 2, 3, 3], 6), ConvAttrs::default()).unwrap();
            assert_eq!(e.dims(), &[0, 3, 2, 2]);
            let too_large = f32s(d, &[1, 2, 2, 2], 5).conv2d(&f32s(d, &[3, 2, 3, 3], 6), ConvAttrs::default());
            assert!(too_large.unwrap_err().to_string().contains("does not fit input"));
            (y.to_vec::<f32>().unwrap(), e.to_vec::<f32>().unwrap())
        };
        let (got, empty) = f(&dev);
        let (want, _) = f(&cpu);
        common::assert_close(&got, &want, 1e-4, 1e-4, &format!("conv of views, {profile}"));
        assert!(empty.is_empty());
    }
}

#[test]
fn a_cnn_training_step_runs_with_no_fallback_on_wgpu() {
    let _lock = common::metrics_lock();
    for (profile, dev) in common::wgpu_profiles() {
        metrics::reset();
        let x = f32s(&dev, &[8, 1, 8, 8], 1);
        let w1 = f32s(&dev, &[16, 1, 3, 3], 2).requires_grad_(true).unwrap();
        let w2 = f32s(&dev, &[32, 16, 3, 3], 3).requires_grad_(true).unwrap();
        let pad = ConvAttrs { pads: [1; 4], ..Default::default() };
        let pool = lazuli::ir::PoolAttrs::new(lazuli::ir::PoolKind::Max, &[2, 2]).with_strides(&[2, 2]);
        let h = x.conv2d(&w1, pad.clone()).unwrap().relu().unwrap().pool(pool.clone()).unwrap();
        let h = h.conv2d(&w2, pad).unwrap().relu().unwrap().pool(pool).unwrap();
        let loss = h.mul(&h).unwrap().sum(&[], false).unwrap();
        loss.backward().unwrap();
        let (g1, g2) = (w1.grad().unwrap(), w2.grad().unwrap());
        lazuli::sync(&[&loss, &g1, &g2]).unwrap();
        assert_eq!(metrics::counter("Fallback::conv2d"), 0, "{profile}:\n{}", metrics::report());
        assert_eq!(metrics::counter("FallbackOps"), 0, "{profile}:\n{}", metrics::report());
    }
}
