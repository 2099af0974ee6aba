//! The demo panels: the digits MLP trained in the tab (the settings of
//! `lazuli demo`: 64 -> 256 -> 10, batch 64, SGD lr 0.1 with Nesterov
//! momentum 0.9, weight decay 1e-4), and the fused-kernel example of
//! `lazuli demo --fused` with its generated WGSL.
//!
//! The training loop is `lazuli_models::digits::train_digits` with asynchronous
//! reads: each step is one `mark_step`, and the previous step's loss is
//! read with `item_async`, which yields to the browser (it repaints the
//! progress bar and the curve) while the device works.

use crate::{page, WebError};
use lazuli::nn::{cross_entropy, ModuleExt};
use lazuli::optim::{Optimizer, Sgd};
use lazuli::platform::Instant;
use lazuli::prelude::*;
use lazuli::HostRng;
use lazuli_models::digits::{Digits, Mlp, TrainConfig, DIGITS_CLASSES, DIGITS_FEATURES, DIGITS_TRAIN_ROWS};
use serde_json::json;

/// Trains for `epochs` epochs on `dev`, updating the page; returns the
/// summary the test driver checks.
pub async fn train(dev: &Device, epochs: usize) -> Result<serde_json::Value, WebError> {
    let data = Digits::embedded()?;
    let cfg = TrainConfig { epochs, ..TrainConfig::default() };
    dev.manual_seed(cfg.seed);
    let model = Mlp::new(DIGITS_FEATURES, cfg.hidden, DIGITS_CLASSES, dev)?;
    let mut opt =
        Sgd::new(model.parameters(), cfg.lr).momentum(cfg.momentum).nesterov(true).weight_decay(cfg.weight_decay);
    let b = cfg.batch_size;
    let steps_per_epoch = DIGITS_TRAIN_ROWS / b;
    let mut order: Vec<usize> = (0..DIGITS_TRAIN_ROWS).collect();
    // The host shuffle of `train_digits`.
    let mut rng = HostRng::new(cfg.seed ^ 0xD1_6175);
    let (mut xb, mut yb) = (vec![0f32; b * DIGITS_FEATURES], vec![0i32; b]);
    let mut curve: Vec<f32> = Vec::new();
    let mut step_ms: Vec<f64> = Vec::new();
    let started = Instant::now();
    page::set_text("status", "training");
    for epoch in 0..epochs {
        rng.shuffle(&mut order);
        let mut pending: Option<Tensor> = None;
        for s in 0..steps_per_epoch {
            let t0 = Instant::now();
            for (i, &row) in order[s * b..(s + 1) * b].iter().enumerate() {
                xb[i * DIGITS_FEATURES..(i + 1) * DIGITS_FEATURES]
                    .copy_from_slice(&data.images[row * DIGITS_FEATURES..(row + 1) * DIGITS_FEATURES]);
                yb[i] = data.labels[row] as i32;
            }
            let x = Tensor::from_slice(&xb, [b, DIGITS_FEATURES], dev)?;
            let y = Tensor::from_slice(&yb, [b], dev)?;
            let loss = cross_entropy(&model.forward(&x)?, &y)?;
            loss.backward()?;
            opt.step()?;
            opt.zero_grad();
            let loss = loss.detach();
            dev.mark_step()?;
            // The previous step's loss: one step stays in flight.
            if let Some(previous) = pending.replace(loss) {
                curve.push(previous.item_async::<f32>().await?);
            }
            step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        if let Some(last) = pending.take() {
            curve.push(last.item_async::<f32>().await?);
        }
        let done = epoch + 1;
        page::set_attr("progress", "value", &(done * 100 / epochs.max(1)).to_string());
        page::set_text("epoch", &format!("epoch {done}/{epochs}, loss {:.4}", curve.last().copied().unwrap_or(0.0)));
        page::draw_curve("loss", &curve);
    }
    dev.wait_async().await?;
    let train_seconds = started.elapsed().as_secs_f64();
    let test = accuracy(&model, &data, DIGITS_TRAIN_ROWS..data.len(), dev).await?;
    let median = median(&mut step_ms);
    page::set_text("accuracy", &format!("{:.2}%", test * 100.0));
    page::set_text("step-time", &format!("{median:.2} ms (median of {} steps)", step_ms.len()));
    page::set_text("status", "done");
    Ok(json!({
        "device": dev.name(),
        "epochs": epochs,
        "steps": step_ms.len(),
        "test_accuracy": test,
        "median_step_ms": median,
        "train_seconds": train_seconds,
        "final_loss": curve.last(),
        "cached_plans": dev.cached_plans(),
    }))
}

/// Accuracy of `model` on `rows` of `data`.
async fn accuracy(model: &Mlp, data: &Digits, rows: std::ops::Range<usize>, dev: &Device) -> Result<f64, WebError> {
    let n = rows.len();
    let x = Tensor::from_slice(&data.images[rows.start * DIGITS_FEATURES..rows.end * DIGITS_FEATURES], [n, 64], dev)?;
    let pred = lazuli::no_grad(|| model.forward(&x)?.argmax(-1, false))?;
    let pred = pred.to_vec_async::<i32>().await?;
    let correct = pred.iter().zip(&data.labels[rows]).filter(|(&p, &l)| p == l as i32).count();
    Ok(correct as f64 / n.max(1) as f64)
}

/// The fused-kernel example (`lazuli demo --fused`): `y = tanh(relu(x *
/// 1.5 + 0.5) - 0.25) * 2` and its row sums over `x: f32[1024, 1024]`,
/// one graph; shows its kernels' WGSL and values.
pub async fn fused(dev: &Device) -> Result<serde_json::Value, WebError> {
    let n = 1024usize;
    let data: Vec<f32> = (0..(n * n) as u64).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let x = Tensor::from_slice(&data, [n, n], dev)?;
    let y = (((&x * 1.5)? + 0.5)?.relu()? - 0.25)?.tanh()?.mul_scalar(2.0)?;
    let row_sums = y.sum(&[1], false)?;
    let code = lazuli::debug::backend_code(&[&y, &row_sums])?;
    let started = Instant::now();
    lazuli::sync(&[&y, &row_sums])?;
    let sums = row_sums.to_vec_async::<f32>().await?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let wgsl: String = code.iter().map(|(name, src)| format!("// ---- {name} ----\n{src}\n")).collect();
    page::set_text(
        "fused-summary",
        &format!(
            "y = tanh(relu(x * 1.5 + 0.5) - 0.25) * 2 and its row sums over x: f32[1024, 1024]: {} kernel(s), \
         {ms:.1} ms (compile included); row sums [0..4]: {:?}",
            code.len(),
            &sums[..4]
        ),
    );
    page::set_text("wgsl", &wgsl);
    Ok(json!({ "kernels": code.len(), "row_sums": &sums[..4], "wgsl_bytes": wgsl.len() }))
}

/// The median of `v` (sorted in place); 0 when empty.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
