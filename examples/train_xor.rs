//! Training in Lazuli's habits: a model of `nn` layers with
//! `#[derive(Module)]`, AdamW, and one `mark_step` per step, so that each
//! step (forward, backward, update) is one graph, compiled once. The
//! trained weights are saved for `examples/inference.rs`.

use lazuli::nn::{self, Linear, Module, ModuleExt};
use lazuli::optim::{AdamW, Optimizer};
use lazuli::prelude::*;

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(dev: &Device) -> lazuli::Result<Mlp> {
        Ok(Mlp { fc1: Linear::new(2, 16, dev)?, fc2: Linear::new(16, 2, dev)? })
    }

    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

fn main() -> lazuli::Result<()> {
    let dev = Device::default(); // a GPU if there is one, else the CPU backend
    dev.manual_seed(0);
    let x = Tensor::from_slice(&[0f32, 0., 0., 1., 1., 0., 1., 1.], [4, 2], &dev)?;
    let y = Tensor::from_slice(&[0i32, 1, 1, 0], [4], &dev)?; // class indices
    let model = Mlp::new(&dev)?;
    let mut opt = AdamW::new(model.parameters(), 0.05);
    for step in 0..200 {
        opt.zero_grad();
        let loss = nn::cross_entropy(&model.forward(&x)?, &y)?;
        loss.backward()?; // more lazy IR, fused with the forward pass
        opt.step()?; // in-place parameter updates
        dev.mark_step()?; // one sync: forward + backward + update
        if step % 50 == 0 {
            println!("step {step:3}: loss {:.4}", loss.item::<f32>()?);
        }
    }
    model.eval();
    let pred = lazuli::no_grad(|| model.forward(&x)?.argmax(-1, false))?;
    println!("predictions {:?} (want [0, 1, 1, 0])", pred.to_vec::<i32>()?);
    let path = std::env::temp_dir().join("lazuli-xor.safetensors");
    model.save_state_dict(&path)?;
    println!("weights saved to {}", path.display());
    println!("compiles (uncached, cached): {:?}", dev.compile_counts());
    Ok(())
}
