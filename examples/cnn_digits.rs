//! A CNN with batch norm trained on the 8x8 digits (`data/digits`), the
//! way a PyTorch user would write it: the model is a `#[derive(Module)]`
//! struct, batches come from a `DataLoader` (seeded shuffle per epoch,
//! the next batch prepared on a background thread while the device runs
//! the current step), `train()` / `eval()` switch the batch norms.
//!
//! ```text
//! cargo run --example cnn_digits               # 4 epochs
//! cargo run --example cnn_digits -- 1 DIR      # 1 epoch, digits from DIR
//! ```

use lazuli::data::{DataLoader, HostArray, TensorDataset};
use lazuli::nn::{self, Module, ModuleExt};
use lazuli::optim::{Adam, Optimizer};
use lazuli::prelude::*;
use lazuli_models::digits::{Digits, DIGITS_CLASSES, DIGITS_TRAIN_ROWS};

/// conv(1 -> 16) - BN - ReLU - pool, conv(16 -> 32) - BN - ReLU - pool,
/// flatten (32 x 2 x 2), linear (128 -> 10).
#[derive(Module)]
struct Cnn {
    conv1: nn::Conv2d,
    bn1: nn::BatchNorm2d,
    conv2: nn::Conv2d,
    bn2: nn::BatchNorm2d,
    fc: nn::Linear,
}

impl Cnn {
    fn new(dev: &Device) -> lazuli::Result<Cnn> {
        Ok(Cnn {
            conv1: nn::Conv2d::builder(1, 16, 3).padding(1).build(dev)?,
            bn1: nn::BatchNorm2d::new(16, dev)?,
            conv2: nn::Conv2d::builder(16, 32, 3).padding(1).build(dev)?,
            bn2: nn::BatchNorm2d::new(32, dev)?,
            fc: nn::Linear::new(128, DIGITS_CLASSES, dev)?,
        })
    }

    /// `x`: `[N, 64]` pixel rows; logits `[N, 10]`.
    fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
        let pool = nn::MaxPool2d::new(2);
        let x = x.reshape([-1, 1, 8, 8])?;
        let h = pool.forward(&self.bn1.forward(&self.conv1.forward(&x)?)?.relu()?)?;
        let h = pool.forward(&self.bn2.forward(&self.conv2.forward(&h)?)?.relu()?)?;
        self.fc.forward(&h.flatten(1, -1)?)
    }
}

/// Rows `rows` of the digits as a dataset of (image `[64]` f32, label i32).
fn dataset(d: &Digits, rows: std::ops::Range<usize>) -> lazuli::Result<TensorDataset> {
    let n = rows.len();
    let images = &d.images[rows.start * 64..rows.end * 64];
    let labels: Vec<i32> = d.labels[rows].iter().map(|&l| i32::from(l)).collect();
    TensorDataset::new(vec![HostArray::from_slice(images, &[n, 64])?, HostArray::from_slice(&labels, &[n])?])
}

fn main() -> lazuli::Result<()> {
    let mut args = std::env::args().skip(1);
    let epochs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(4);
    let dir = args.next().map(Into::into).unwrap_or_else(Digits::default_dir);
    let digits = Digits::load(&dir)
        .map_err(|e| lazuli::ExecError::Invalid { op: "cnn_digits".into(), detail: e.to_string() })?;
    let dev = Device::default();
    println!("device: {}, {} digits", dev.name(), digits.len());

    let train = DataLoader::new(dataset(&digits, 0..DIGITS_TRAIN_ROWS)?, 64, &dev)?.shuffle(7).drop_last(true);
    let test = DataLoader::new(dataset(&digits, DIGITS_TRAIN_ROWS..digits.len())?, 120, &dev)?;

    dev.manual_seed(0);
    let model = Cnn::new(&dev)?;
    let mut opt = Adam::new(model.parameters(), 3e-3);
    for epoch in 0..epochs {
        model.train();
        let mut last = 0.0;
        for batch in train.epoch(epoch)? {
            let b = batch?;
            opt.zero_grad();
            let loss = nn::cross_entropy(&model.forward(&b[0])?, &b[1])?;
            loss.backward()?;
            opt.step()?;
            dev.mark_step()?;
            last = loss.item::<f32>()?;
        }
        // Evaluation: the batch norms use their running statistics.
        model.eval();
        let (mut right, mut total) = (0usize, 0usize);
        for batch in test.epoch(0)? {
            let b = batch?;
            let pred = lazuli::no_grad(|| model.forward(&b[0])?.argmax(-1, false))?.to_vec::<i32>()?;
            let want = b[1].to_vec::<i32>()?;
            right += pred.iter().zip(&want).filter(|(p, w)| p == w).count();
            total += want.len();
        }
        println!("epoch {epoch}: last loss {last:.4}, test accuracy {:.3}", right as f64 / total as f64);
    }
    Ok(())
}
