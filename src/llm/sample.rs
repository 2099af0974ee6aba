//! Sampling on the device: the next token of each sequence chosen from its
//! logits inside the step's graph, so that only the chosen ids (`i32
//! [b]`) cross to the host.
//!
//! In order: repetition penalty (CTRL's, as llama.cpp and Hugging Face
//! apply it: a seen token's positive logit divided by the penalty, a
//! negative one multiplied), then greedy (`argmax`, the first of ties) or
//! temperature, top-k, top-p and a draw. Top-k and top-p keep the tokens
//! at or above a threshold found by bisection (a fixed number of masked
//! counts or sums over the row: no sort, so a 150k vocabulary costs a few
//! passes, and the graph is the same every step); ties at the threshold
//! are all kept. The draw inverts the cumulative distribution at a
//! uniform number from the counter-based Philox generator keyed by the
//! seed and the step (lifted scalars): the same seed gives the same
//! numbers on every backend.

use crate::ir::{Op, RandomDist};
use crate::{DType, Device, Result, ScalarValue, Tensor};

/// How the next token is chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// Take the most likely token (ignores the fields below but the
    /// repetition penalty).
    pub greedy: bool,
    /// Logits are divided by it (> 0).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to `top_p`
    /// (1: all).
    pub top_p: f32,
    /// CTRL's repetition penalty over the tokens seen so far (1: none).
    pub repetition_penalty: f32,
}

impl Default for Sampling {
    /// Greedy.
    fn default() -> Sampling {
        Sampling { greedy: true, temperature: 1.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0 }
    }
}

/// Bisection steps of the top-k and top-p thresholds: the bracket
/// shrinks to 2^-24 of its width, below f32's resolution of the values.
const BISECT: usize = 24;

/// The tokens seen per sequence and the draw counter.
#[derive(Debug)]
pub(crate) struct SamplerState {
    /// f32 `[b, vocab]`: 1 where the token was seen.
    pub seen: Tensor,
    /// Draws so far (the Philox step key).
    pub draws: u32,
    /// The seed (the Philox key).
    pub seed: u32,
}

impl SamplerState {
    pub fn new(batch: usize, vocab: usize, seed: u64, device: &Device) -> Result<SamplerState> {
        let seen = Tensor::zeros([batch, vocab], DType::F32, device)?;
        seen.sync()?;
        Ok(SamplerState { seen, draws: 0, seed: (seed ^ (seed >> 32)) as u32 })
    }

    /// Marks `ids` (i32 `[b, n]`) seen.
    pub fn observe(&mut self, ids: &Tensor) -> Result<()> {
        let [b, vocab] = [self.seen.dims()[0], self.seen.dims()[1]];
        let n = ids.dims()[1];
        let iota = Tensor::iota([b, 1, vocab], 2, DType::I32, ids.device())?;
        let hit = iota.eq(&ids.reshape([b, n, 1])?)?.cast(DType::F32)?.max(&[1], false)?;
        let seen = self.seen.maximum(&hit)?;
        self.seen.assign(&seen)
    }
}

/// The next token of each row of `logits` (f32 `[b, vocab]`): i32 `[b]`.
/// Records the draw in `state` (its `seen` mask is updated with the
/// chosen ids).
pub(crate) fn sample(logits: &Tensor, s: &Sampling, state: &mut SamplerState) -> Result<Tensor> {
    let device = logits.device();
    let [b, vocab] = [logits.dims()[0], logits.dims()[1]];
    let mut l = logits.clone();
    if s.repetition_penalty != 1.0 {
        let p = s.repetition_penalty;
        let penalized = Tensor::where_(&l.gt_scalar(0.0)?, &l.div_scalar(p)?, &l.mul_scalar(p)?)?;
        l = Tensor::where_(&state.seen.gt_scalar(0.0)?, &penalized, &l)?;
    }
    let ids = if s.greedy || s.temperature <= 0.0 {
        l.argmax(-1, false)?
    } else {
        l = l.div_scalar(s.temperature)?;
        let neg_inf = Tensor::scalar(f32::NEG_INFINITY, DType::F32, device);
        if s.top_k > 0 && s.top_k < vocab {
            let keep = threshold(&l, l.min(&[-1], true)?, l.max(&[-1], true)?, |mid| {
                // Enough tokens at or above mid: the threshold may rise.
                l.ge(mid)?.cast(DType::F32)?.sum(&[-1], true)?.ge_scalar(s.top_k as f32)
            })?;
            l = Tensor::where_(&l.ge(&keep)?, &l, &neg_inf)?;
        }
        let mut p = l.softmax(-1)?;
        if s.top_p < 1.0 {
            let zero = p.min(&[-1], true)?.mul_scalar(0.0)?;
            let keep = threshold(&p, zero, p.max(&[-1], true)?, |mid| {
                // The mass at or above mid still reaches top_p.
                Tensor::where_(&p.ge(mid)?, &p, &p.mul_scalar(0.0)?)?.sum(&[-1], true)?.ge_scalar(s.top_p)
            })?;
            p = Tensor::where_(&p.ge(&keep)?, &p, &p.mul_scalar(0.0)?)?;
        }
        let cdf = p.cumsum(-1, false, false)?;
        let total = cdf.narrow(-1, vocab - 1, 1)?;
        let u = uniform(b, state, device)?.reshape([b, 1])?.mul(&total)?;
        // The first index whose cumulative mass exceeds u.
        let below = cdf.le(&u)?.cast(DType::I32)?.sum(&[-1], false)?;
        below.minimum_scalar((vocab - 1) as i32)?
    };
    let ids = ids.cast(DType::I32)?;
    state.observe(&ids.reshape([b, 1])?)?;
    Ok(ids)
}

/// The largest value `t` in `[lo, hi]` (per row, keepdim) with
/// `ok(t)` true, by bisection; `ok(lo)` must hold.
fn threshold(x: &Tensor, lo: Tensor, hi: Tensor, ok: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let _ = x;
    let (mut lo, mut hi) = (lo, hi);
    for _ in 0..BISECT {
        let mid = lo.add(&hi)?.mul_scalar(0.5)?;
        let good = ok(&mid)?;
        lo = Tensor::where_(&good, &mid, &lo)?;
        hi = Tensor::where_(&good, &hi, &mid)?;
    }
    // hi may satisfy ok too (ties at the top): prefer it.
    let good = ok(&hi)?;
    Tensor::where_(&good, &hi, &lo)
}

/// `b` uniform numbers in [0, 1) from Philox keyed by the seed and the
/// draw count (both lifted: a new draw compiles nothing).
fn uniform(b: usize, state: &mut SamplerState, device: &Device) -> Result<Tensor> {
    let k0 = Tensor::lifted_scalar(ScalarValue::from(state.seed), DType::U32, device);
    let k1 = Tensor::lifted_scalar(ScalarValue::from(state.draws), DType::U32, device);
    state.draws = state.draws.wrapping_add(1);
    Tensor::record(Op::Random { shape: vec![b].into(), dist: RandomDist::Uniform }, &[&k0, &k1])
}
