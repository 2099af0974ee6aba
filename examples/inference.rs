//! Inference in Lazuli's habits: the trained weights loaded into the
//! model, evaluation mode, no gradient tracking, and one read per batch
//! (the read is the sync point). The layers' parameters are computed once,
//! so every batch runs the model's kernels only.

use lazuli::nn::{Linear, Module, ModuleExt};
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
    let dev = Device::default();
    let model = Mlp::new(&dev)?;
    let path = std::env::temp_dir().join("lazuli-xor.safetensors");
    if path.exists() {
        model.load_state_dict(&path)?; // what examples/train_xor.rs saved
    }
    model.eval(); // dropout off, batch norm on its running statistics
    let _no_grad = lazuli::NoGradGuard::new(); // no gradient bookkeeping
    for batch in [[0f32, 0., 1., 1.], [0., 1., 1., 0.], [1., 1., 0., 0.]] {
        let x = Tensor::from_slice(&batch, [2, 2], &dev)?;
        let classes = model.forward(&x)?.argmax(-1, false)?; // i32 indices
        println!("{batch:?} -> {:?}", classes.to_vec::<i32>()?);
    }
    println!("compiles (uncached, cached): {:?}", dev.compile_counts());
    Ok(())
}
