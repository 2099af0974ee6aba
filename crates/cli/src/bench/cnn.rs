//! L1: the CNN demo's training step ([`CnnStep`]): the digits demo's
//! LeNet-style model ([`lazuli_models::digits::LeNet`]) on a fixed batch of 64
//! 8x8 images, cross-entropy, SGD with the demo's settings (lr 0.05,
//! Nesterov momentum 0.9, weight decay 1e-4). Images are
//! `uniform_data(64 * 64, 31)`, labels `i * 7 mod 10`, so the JAX twin
//! (`scripts/jax_twin.py`) trains on the same batch.

use super::uniform_data;
use lazuli::nn::{self, Module, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::{Device, Result, Tensor};
use lazuli_models::digits::LeNet;

/// Images per step.
pub const CNN_BATCH: usize = 64;

/// The model, its optimizer and the batch of an L1 step.
pub struct CnnStep {
    model: LeNet,
    opt: Sgd,
    x: Tensor,
    labels: Tensor,
}

impl CnnStep {
    /// The model (seeded), optimizer and batch on `dev`.
    pub fn new(dev: &Device) -> Result<CnnStep> {
        dev.manual_seed(31);
        let model = LeNet::new(dev)?;
        let opt = Sgd::new(model.parameters(), 0.05).momentum(0.9).nesterov(true).weight_decay(1e-4);
        let x = Tensor::from_slice(&uniform_data(CNN_BATCH * 64, 31), [CNN_BATCH, 64], dev)?;
        let labels: Vec<i32> = (0..CNN_BATCH).map(|i| (i * 7 % 10) as i32).collect();
        let labels = Tensor::from_slice(&labels, [CNN_BATCH], dev)?;
        dev.mark_step()?;
        dev.wait()?;
        Ok(CnnStep { model, opt, x, labels })
    }

    /// One training step: forward, cross-entropy, backward, SGD,
    /// `mark_step`, wait.
    pub fn step(&mut self) -> Result<()> {
        self.opt.zero_grad();
        let loss = nn::cross_entropy(&self.model.forward(&self.x)?, &self.labels)?;
        loss.backward()?;
        self.opt.step()?;
        let dev = self.x.device().clone();
        dev.mark_step()?;
        dev.wait()
    }
}
