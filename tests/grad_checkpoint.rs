//! Gradient checkpointing (`autograd::checkpoint`): the segment is
//! recorded again in backward, and the gradients (into the inputs and into
//! the parameters the segment uses) equal those of the plain segment, bit
//! for bit, with dropout inside (the recomputation replays the RNG), with
//! the forward materialized before backward, nested, on the CPU backend
//! and on wgpu (no fallback in f32).

mod common;

use lazuli::autograd::checkpoint;
use lazuli::nn::{self, Module, ModuleExt};
use lazuli::{sync, DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Linear, GELU, dropout, Linear: parameters and random draws inside.
#[derive(Clone)]
struct Block {
    a: nn::Linear,
    b: nn::Linear,
}

impl Block {
    fn new(dev: &Device) -> Block {
        Block { a: nn::Linear::new(6, 16, dev).unwrap(), b: nn::Linear::new(16, 6, dev).unwrap() }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.a.forward(x)?.gelu()?.dropout(0.3, true)?;
        self.b.forward(&h)?.add(x)
    }

    fn params(&self) -> Vec<Tensor> {
        let mut v = self.a.parameters();
        v.extend(self.b.parameters());
        v
    }
}

/// Every gradient's bits: the input's, then each parameter's.
fn grads(x: &Tensor, blocks: &[Block]) -> Vec<Vec<u32>> {
    let mut v = vec![x.grad().unwrap().to_vec::<f32>().unwrap()];
    v.extend(blocks.iter().flat_map(Block::params).map(|p| p.grad().unwrap().to_vec::<f32>().unwrap()));
    v.into_iter().map(|g| g.into_iter().map(f32::to_bits).collect()).collect()
}

/// Two blocks and a loss, each block checkpointed or not; `sync_between`
/// materializes the forward before backward.
fn run(dev: &Device, checkpointed: bool, sync_between: bool, calls: &Arc<AtomicUsize>) -> (u32, Vec<Vec<u32>>) {
    dev.manual_seed(3);
    let blocks = [Block::new(dev), Block::new(dev)];
    let x =
        Tensor::from_slice(&common::rand_vec(4 * 6, 8, -1.0, 1.0), [4, 6], dev).unwrap().requires_grad_(true).unwrap();
    let mut h = x.clone();
    for b in &blocks {
        h = if checkpointed {
            let (b, calls) = (b.clone(), calls.clone());
            checkpoint(
                move |xs| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    b.forward(&xs[0])
                },
                &[h],
            )
            .unwrap()
        } else {
            b.forward(&h).unwrap()
        };
    }
    let loss = h.mul(&h).unwrap().mean(&[], false).unwrap();
    if sync_between {
        sync(&[&loss]).unwrap();
    }
    loss.backward().unwrap();
    (loss.item::<f32>().unwrap().to_bits(), grads(&x, &blocks))
}

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    let _lock = common::metrics_lock();
    for dev in common::devices() {
        lazuli::metrics::reset();
        let calls = Arc::new(AtomicUsize::new(0));
        let plain = run(&dev, false, false, &calls);
        assert_eq!(calls.load(Ordering::Relaxed), 0);
        for sync_between in [false, true] {
            let calls = Arc::new(AtomicUsize::new(0));
            let got = run(&dev, true, sync_between, &calls);
            assert_eq!(calls.load(Ordering::Relaxed), 4, "{dev:?}: each block forward, then recomputed in backward");
            assert_eq!(got, plain, "{dev:?}: checkpointed (sync between: {sync_between}) vs plain");
        }
        assert_eq!(lazuli::metrics::counter("FallbackOps"), 0, "{dev:?}: {}", lazuli::metrics::report());
    }
}

#[test]
fn checkpoint_keeps_no_record_of_the_inside_and_nests() {
    let dev = <Device as lazuli::DeviceExt>::cpu();
    let w = Tensor::from_slice(&[0.5f32, -1.5, 2.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], [3], &dev).unwrap().requires_grad_(true).unwrap();
    let segment = {
        let w = w.clone();
        move |xs: &[Tensor]| xs[0].mul(&w)?.tanh()?.mul(&xs[1])
    };
    let y = checkpoint(segment.clone(), &[x.clone(), x.clone()]).unwrap();
    assert_eq!(y.grad_fn_name().as_deref(), Some("checkpoint"));
    // Nested: an outer checkpoint around an inner one.
    let inner = segment.clone();
    let z = checkpoint(
        move |xs| checkpoint(inner.clone(), &[xs[0].clone(), xs[0].clone()])?.exp(),
        std::slice::from_ref(&x),
    )
    .unwrap();
    let loss = y.sum(&[], false).unwrap().add(&z.sum(&[], false).unwrap()).unwrap();
    loss.backward().unwrap();
    let (gx, gw) = (x.grad().unwrap().to_vec::<f32>().unwrap(), w.grad().unwrap().to_vec::<f32>().unwrap());
    // The same without checkpointing.
    x.zero_grad();
    w.zero_grad();
    let y = segment(&[x.clone(), x.clone()]).unwrap();
    let z = segment(&[x.clone(), x.clone()]).unwrap().exp().unwrap();
    y.sum(&[], false).unwrap().add(&z.sum(&[], false).unwrap()).unwrap().backward().unwrap();
    common::assert_close(&gx, &x.grad().unwrap().to_vec::<f32>().unwrap(), 1e-6, 0.0, "input gradient");
    common::assert_close(&gw, &w.grad().unwrap().to_vec::<f32>().unwrap(), 1e-6, 0.0, "weight gradient");
    // Under no_grad, or with nothing requiring grad, it is the plain call.
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = {
        let calls = calls.clone();
        move |xs: &[Tensor]| {
            calls.fetch_add(1, Ordering::Relaxed);
            xs[0].exp()
        }
    };
    let y = lazuli::no_grad(|| checkpoint(counted.clone(), std::slice::from_ref(&x))).unwrap();
    assert!(!y.requires_grad());
    let c = Tensor::ones([3], DType::F32, &dev).unwrap();
    assert!(!checkpoint(counted, &[c]).unwrap().requires_grad());
    assert_eq!(calls.load(Ordering::Relaxed), 2);
}

#[test]
fn a_segment_that_changes_between_forward_and_backward_is_an_error() {
    let dev = <Device as lazuli::DeviceExt>::cpu();
    let x = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev).unwrap().requires_grad_(true).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = checkpoint(
        move |xs| {
            // The second call (the recomputation) returns another shape.
            if c.fetch_add(1, Ordering::Relaxed) == 0 {
                xs[0].exp()
            } else {
                xs[0].sum(&[], false)
            }
        },
        std::slice::from_ref(&x),
    )
    .unwrap();
    let e = y.sum(&[], false).unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("checkpoint") && e.contains("deterministic"), "{e}");
    // A segment's own error surfaces from the call.
    assert!(checkpoint(|xs| xs[0].reshape([3]), &[x]).is_err());
}
