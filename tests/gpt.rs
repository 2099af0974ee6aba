//! The G8 GPT training step (`lazuli_models::gpt::Gpt`) on every backend, at a
//! tiny size: the training loop compiles nothing after its first step
//! (per-device compile counters: AdamW's moments are zeros made before the
//! first update, so every step has the first step's graph), the loss falls, the attention is causal
//! (a later token never changes an earlier position's logits), and CPU and
//! wgpu agree on the losses.

mod common;

use lazuli::nn::Module;
use lazuli::prelude::*;
use lazuli_models::gpt::{Gpt, GptModel, GptSizes};

const STEPS: usize = 8;

/// The losses of `STEPS` training steps on `dev`, and the compiles each
/// step caused.
fn train(dev: &Device) -> (Vec<f32>, Vec<u64>) {
    let mut gpt = Gpt::new(dev, GptSizes::TINY).unwrap();
    assert_eq!(gpt.model.parameters().len(), GptSizes::TINY.parameter_tensors());
    let mut losses = Vec::new();
    let mut compiles = Vec::new();
    for _ in 0..STEPS {
        let before = dev.compile_counts().0;
        let (loss, _) = gpt.step().unwrap();
        compiles.push(dev.compile_counts().0 - before);
        losses.push(loss.item::<f32>().unwrap());
    }
    (losses, compiles)
}

#[test]
fn gpt_training_compiles_nothing_after_step_one_and_learns() {
    let mut all = Vec::new();
    for dev in common::devices() {
        let (losses, compiles) = train(&dev);
        assert!(compiles[0] >= 1, "{}: step 1 compiles: {compiles:?}", dev.name());
        assert!(compiles[1..].iter().all(|&c| c == 0), "{}: compiles per step {compiles:?}", dev.name());
        assert!(losses.iter().all(|l| l.is_finite()), "{}: {losses:?}", dev.name());
        // AdamW at lr 3e-4 over 8 steps on one fixed batch: a small but
        // steady fall.
        assert!(losses[STEPS - 1] < losses[0], "{}: {losses:?}", dev.name());
        all.push((dev.name(), losses));
    }
    if let [(_, cpu), (name, other)] = &all[..] {
        common::assert_close(other, cpu, 1e-3, 1e-4, &format!("losses on {name} against cpu"));
    }
}

#[test]
fn gpt_attention_is_causal() {
    let s = GptSizes::TINY;
    let n = s.batch * s.context;
    for dev in common::devices() {
        dev.manual_seed(3);
        let model = GptModel::new(s, &dev).unwrap();
        let ids: Vec<i32> = (0..n as i32).map(|i| (i * 5) % s.vocab as i32).collect();
        // The last token of the first sequence changes.
        let mut changed = ids.clone();
        changed[s.context - 1] = (changed[s.context - 1] + 1) % s.vocab as i32;
        let logits = |ids: &[i32]| {
            let ids = Tensor::from_slice(ids, [n], &dev).unwrap();
            lazuli::no_grad(|| model.forward(&ids)).unwrap().to_vec::<f32>().unwrap()
        };
        let (a, b) = (logits(&ids), logits(&changed));
        let v = s.vocab;
        let earlier = (s.context - 1) * v;
        common::assert_close(&b[..earlier], &a[..earlier], 1e-5, 1e-5, "positions before the change");
        let last = &a[earlier..earlier + v];
        assert!(last.iter().zip(&b[earlier..earlier + v]).any(|(x, y)| x != y), "the changed position");
        common::assert_close(&b[s.context * v..], &a[s.context * v..], 1e-5, 1e-5, "other sequences");
    }
}
