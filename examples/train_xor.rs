//! Training with autodiff, `nn` and `optim`: a two-layer MLP learns XOR.
//! Each step (forward, backward, SGD update) is one graph, synced by
//! `mark_step`; after the second step nothing compiles.

use lazuli::nn::{self, Linear, Module};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::prelude::*;

fn main() -> lazuli::Result<()> {
    let dev = Device::default();
    dev.manual_seed(0);
    let x = Tensor::from_slice(&[0f32, 0., 0., 1., 1., 0., 1., 1.], [4, 2], &dev)?;
    let y = Tensor::from_slice(&[0i32, 1, 1, 0], [4], &dev)?;
    let (l1, l2) = (Linear::new(2, 16, &dev)?, Linear::new(16, 2, &dev)?);
    let mut params = l1.parameters();
    params.extend(l2.parameters());
    let mut opt = Sgd::new(params, 0.5).momentum(0.9);
    for step in 0..200 {
        opt.zero_grad();
        let logits = l2.forward(&nn::relu(&l1.forward(&x)?)?)?;
        let loss = nn::cross_entropy(&logits, &y)?;
        loss.backward()?; // more lazy IR, fused with the forward pass
        opt.step()?; // in-place parameter updates (Tensor::assign)
        dev.mark_step()?; // one sync: forward + backward + update
        if step % 50 == 0 {
            println!("step {step:3}: loss {:.4}", loss.item::<f32>()?);
        }
    }
    let pred = l2.forward(&nn::relu(&l1.forward(&x)?)?)?.argmax(-1, false)?;
    println!("predictions {:?} (want [0, 1, 1, 0])", pred.to_vec::<i32>()?);
    println!("compiles (uncached, cached) on this device: {:?}", dev.compile_counts());
    Ok(())
}
