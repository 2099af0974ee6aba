//! The small workloads W1–W5 of `docs/workloads.md`, sized for a 2-core box:
//! each one's inputs (uploaded outside any timed loop) and one iteration
//! (record, sync, wait), and the MLP training step W4 shares with G7.

use super::uniform_data;
use lazuli::nn::{self, Module, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::{Device, Result, Tensor};

/// The sizes of an MLP training step: input [batch, input] ->
/// Linear(input, hidden) -> ReLU -> Linear(hidden, classes) ->
/// cross-entropy with labels `i * 7 mod classes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpSizes {
    /// Rows of the input.
    pub batch: usize,
    /// Input features.
    pub input: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Output classes.
    pub classes: usize,
}

impl MlpSizes {
    /// W4: batch 256, 64 -> 256 -> 10.
    pub const W4: MlpSizes = MlpSizes { batch: 256, input: 64, hidden: 256, classes: 10 };
    /// G7: batch 4096, 1024 -> 4096 -> 1024.
    pub const G7: MlpSizes = MlpSizes { batch: 4096, input: 1024, hidden: 4096, classes: 1024 };

    /// FLOPs of one step as `docs/workloads.md` counts them: 2 per multiply-add
    /// of the two matmuls, three times (forward, and the two products of
    /// each backward matmul).
    pub fn flops(self) -> f64 {
        6.0 * self.batch as f64 * (self.input * self.hidden + self.hidden * self.classes) as f64
    }
}

/// W1's chain: `tanh(relu(x * 1.5 + 0.5) - 0.25) * 2.0`.
pub fn w1_chain(x: &Tensor) -> Result<Tensor> {
    x.mul_scalar(1.5)?.add_scalar(0.5)?.relu()?.sub_scalar(0.25)?.tanh()?.mul_scalar(2.0)
}

/// W1's input on `dev`, already on the device.
pub fn w1_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(4096 * 4096, 1), [4096, 4096], dev)?;
    // Upload outside the timed loop.
    x.relu()?.sum(&[], false)?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W1 iteration: record, sync, wait.
pub fn w1_step(x: &Tensor) -> Result<()> {
    w1_chain(x)?.sync()?;
    x.device().wait()
}

/// The W2 operands (f32 [1024, 1024] each), on the device.
pub fn w2_inputs(dev: &Device) -> Result<(Tensor, Tensor)> {
    let a = Tensor::from_slice(&uniform_data(1024 * 1024, 2), [1024, 1024], dev)?;
    let b = Tensor::from_slice(&uniform_data(1024 * 1024, 3), [1024, 1024], dev)?;
    a.add(&b)?.sync()?;
    dev.wait()?;
    Ok((a, b))
}

/// One W2 iteration.
pub fn w2_step(a: &Tensor, b: &Tensor) -> Result<()> {
    a.matmul(b)?.sync()?;
    a.device().wait()
}

/// The W3 input (f32 [4096, 1024]), on the device.
pub fn w3_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(4096 * 1024, 4), [4096, 1024], dev)?;
    x.relu()?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W3 iteration.
pub fn w3_step(x: &Tensor) -> Result<()> {
    x.softmax(-1)?.sync()?;
    x.device().wait()
}

/// The model, optimizer and data of an MLP training step (W4, G7).
pub struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    opt: Sgd,
    x: Tensor,
    labels: Tensor,
}

impl Mlp {
    /// Linear(64, 256) -> ReLU -> Linear(256, 10), SGD lr 0.1, input
    /// `[256, 64]`, integer labels `[256]`.
    pub fn new(dev: &Device) -> Result<Mlp> {
        Mlp::with_sizes(dev, MlpSizes::W4, 0.1, 5)
    }

    /// Linear(input, hidden) -> ReLU -> Linear(hidden, classes), SGD with
    /// learning rate `lr`, input [batch, input] uniform in [-1, 1] (from
    /// `seed`), integer labels `i * 7 mod classes`.
    pub fn with_sizes(dev: &Device, sizes: MlpSizes, lr: f64, seed: u64) -> Result<Mlp> {
        let MlpSizes { batch, input, hidden, classes } = sizes;
        let l1 = nn::Linear::new(input, hidden, dev)?;
        let l2 = nn::Linear::new(hidden, classes, dev)?;
        let mut params = l1.parameters();
        params.extend(l2.parameters());
        let opt = Sgd::new(params, lr);
        let x = Tensor::from_slice(&uniform_data(batch * input, seed), [batch, input], dev)?;
        let labels: Vec<i32> = (0..batch).map(|i| (i * 7 % classes) as i32).collect();
        let labels = Tensor::from_slice(&labels, [batch], dev)?;
        Ok(Mlp { l1, l2, opt, x, labels })
    }

    /// One training step: forward, cross-entropy, backward, SGD update,
    /// `mark_step`, wait. Returns the (lazy, now computed) loss.
    pub fn step(&mut self) -> Result<Tensor> {
        self.opt.zero_grad();
        let h = nn::relu(&self.l1.forward(&self.x)?)?;
        let logits = self.l2.forward(&h)?;
        let loss = nn::cross_entropy(&logits, &self.labels)?;
        loss.backward()?;
        self.opt.step()?;
        let dev = self.x.device().clone();
        dev.mark_step()?;
        dev.wait()?;
        Ok(loss)
    }
}

/// The W5 input (f32 `[1024]`).
pub fn w5_input(dev: &Device) -> Result<Tensor> {
    let x = Tensor::from_slice(&uniform_data(1024, 6), [1024], dev)?;
    x.relu()?.sync()?;
    dev.wait()?;
    Ok(x)
}

/// One W5 iteration: 100 times `x = x * 1.0001 + 0.0001`, sync, wait.
pub fn w5_step(x: &Tensor) -> Result<Tensor> {
    let mut y = x.clone();
    for _ in 0..100 {
        y = y.mul_scalar(1.0001)?.add_scalar(0.0001)?;
    }
    y.sync()?;
    x.device().wait()?;
    Ok(y)
}
