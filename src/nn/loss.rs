//! Losses: [`cross_entropy`] and [`cross_entropy_with`] (class indices
//! on the last dim, `ignore_index`, label smoothing and a [`Reduction`],
//! set through [`CrossEntropyOptions`]), [`mse`], and PyTorch's other
//! common losses under its names and defaults:
//! [`binary_cross_entropy_with_logits`], [`l1_loss`], [`smooth_l1_loss`],
//! [`huber_loss`], [`nll_loss`] and [`kl_div`]. Every loss is a
//! composition of public tensor ops (the engine has no loss op), so
//! autodiff and every backend come for free; misuse is an `Invalid` error
//! naming the loss, the shapes and the caller's location.

use super::embedding::one_hot;
use super::{invalid, invalid_at};
use crate::{BackendKind, DType, ExecError, Result, Tensor, TensorState};
use std::panic::Location;

/// How a loss combines its per-element values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The mean over the elements that count (PyTorch's default).
    #[default]
    Mean,
    /// The sum.
    Sum,
    /// No reduction: one value per element.
    None,
    /// The sum divided by the batch size (the first dim): [`kl_div`] only,
    /// where it gives the true KL divergence per sample; every other loss
    /// rejects it.
    BatchMean,
}

/// Options of [`cross_entropy_with`]; the default is plain mean
/// cross-entropy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CrossEntropyOptions {
    /// Targets equal to this value contribute nothing, and the mean is
    /// taken over the others (PyTorch's `ignore_index`, often -100 or a
    /// padding token).
    pub ignore_index: Option<i64>,
    /// Label smoothing `eps` in `[0, 1]`: the target distribution is
    /// `(1 - eps) * one_hot + eps / classes`.
    pub label_smoothing: f64,
    /// How per-element losses combine.
    pub reduction: Reduction,
}

/// Mean cross-entropy of `logits` (`[.., classes]`, float, any leading
/// dims) against integer class `labels` (`[..]`):
/// `-mean log_softmax(logits)[.., labels[..]]`. See [`cross_entropy_with`]
/// for `ignore_index`, label smoothing, other reductions and 64-bit labels.
#[track_caller]
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, labels, &CrossEntropyOptions::default())
}

/// Cross-entropy of `logits` (`[.., classes]`, float) against integer
/// class `labels` (`[..]`, the leading dims of `logits`), with an optional
/// ignored target value, label smoothing and a reduction. The classes are
/// the last dim (so a `[batch, time, vocab]` language-model output needs
/// no transpose; PyTorch puts them at dim 1).
///
/// Per element, with `p = log_softmax(logits)`:
/// `loss = -(1 - eps) * p[label] - eps * mean_c p[c]`, zero where the
/// label is `ignore_index`; `Mean` divides the sum by the number of
/// elements not ignored (NaN when every element is ignored, like
/// PyTorch). It is written as log-softmax times a one-hot mask (`iota ==
/// labels`), so it needs no gather (whose out-of-range check would make a
/// bad label an error) and its gradient is `(softmax - target) / count`. A label outside
/// `0..classes` that is not ignored matches no class: only its smoothing
/// term counts.
///
/// WGSL has 32-bit integers only, so on a device whose main backend is not
/// the CPU, i64 and u64 labels (PyTorch's default is i64) that hold host
/// data (from [`Tensor::from_slice`], the usual batch) are narrowed to i32
/// on the host, once per call, so the one-hot's iota and comparison run on
/// the device and not on the CPU fallback. The answer is the CPU's: a
/// label outside the i32 range becomes a negative value other than
/// `ignore_index`, so it still matches no class and is still not ignored
/// (wrapping it could match a class). Pending or device-resident 64-bit
/// labels, and an `ignore_index` outside the i32 range, keep the 64-bit
/// path, whose ops are counted as fallback ops.
#[track_caller]
pub fn cross_entropy_with(logits: &Tensor, labels: &Tensor, opts: &CrossEntropyOptions) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let logits = &crate::amp::float32(logits)?;
    let op = "cross_entropy";
    if logits.rank() == 0 || labels.dims() != &logits.dims()[..logits.rank() - 1] {
        return Err(invalid(
            op,
            format!(
                "expected logits [.., classes] and labels of their leading dims [..], got {} and {}",
                logits.shape(),
                labels.shape()
            ),
        ));
    }
    if !logits.dtype().is_float() || !labels.dtype().is_int() {
        return Err(invalid(
            op,
            format!("expected float logits and integer labels, got {} and {}", logits.dtype(), labels.dtype()),
        ));
    }
    let eps = opts.label_smoothing;
    if !(0.0..=1.0).contains(&eps) {
        return Err(invalid(op, format!("label_smoothing must be in [0, 1], got {eps}")));
    }
    let labels = &narrow_labels(labels, opts.ignore_index)?;
    let (dt, dev) = (logits.dtype(), logits.device());
    let c = logits.dims()[logits.rank() - 1];
    let logp = logits.log_softmax(-1)?;
    let mask = one_hot(labels, c, dt)?;
    let mut loss = logp.mul(&mask)?.sum(&[-1], false)?.neg()?;
    if eps > 0.0 {
        let smooth = logp.mean(&[-1], false)?.neg()?;
        loss = loss.mul(&Tensor::scalar(1.0 - eps, dt, dev))?.add(&smooth.mul(&Tensor::scalar(eps, dt, dev))?)?;
    }
    let valid = match opts.ignore_index {
        Some(ignore) => {
            let ld = labels.dtype();
            let bits = 8 * ld.size_bytes() as u32;
            let (lo, hi) = if ld.is_unsigned_int() {
                (0i128, (1i128 << bits) - 1)
            } else {
                (-(1i128 << (bits - 1)), (1i128 << (bits - 1)) - 1)
            };
            // A value the labels cannot hold ignores nothing.
            let keep = if (lo..=hi).contains(&(ignore as i128)) {
                labels.ne(&Tensor::scalar(ignore, labels.dtype(), dev))?
            } else {
                Tensor::full(labels.shape().clone(), true, DType::Bool, dev)?
            };
            loss = keep.where_(&loss, &Tensor::scalar(0.0, dt, dev))?;
            Some(keep)
        }
        None => None,
    };
    match opts.reduction {
        Reduction::None => Ok(loss),
        Reduction::Sum => loss.sum(&[], false),
        Reduction::BatchMean => Err(batch_mean_error(op, Location::caller())),
        Reduction::Mean => match valid {
            None => loss.mean(&[], false),
            Some(keep) => loss.sum(&[], false)?.div(&keep.cast(dt)?.sum(&[], false)?),
        },
    }
}

/// `labels` as i32 where they are 64-bit host data on a device whose main
/// backend is not the CPU (see [`cross_entropy_with`]); otherwise unchanged.
/// Reading host data is no barrier: nothing is computed or waited for.
fn narrow_labels(labels: &Tensor, ignore: Option<i64>) -> Result<Tensor> {
    let dev = labels.device();
    let wide = matches!(labels.dtype(), DType::I64 | DType::U64);
    let ignore = match ignore.map(i32::try_from) {
        None => None,
        Some(Ok(i)) => Some(i),
        Some(Err(_)) => return Ok(labels.clone()),
    };
    if !wide || dev.kind() == BackendKind::Cpu || labels.state() != TensorState::HostData {
        return Ok(labels.clone());
    }
    // Classes are `0..classes`, so a negative value matches none; it must
    // also not be the ignored one.
    let no_class = if ignore == Some(-1) { -2 } else { -1 };
    let narrow = |v: i128| i32::try_from(v).unwrap_or(no_class);
    let values: Vec<i32> = match labels.dtype() {
        DType::I64 => labels.to_vec::<i64>()?.into_iter().map(|v| narrow(v.into())).collect(),
        _ => labels.to_vec::<u64>()?.into_iter().map(|v| narrow(v.into())).collect(),
    };
    Tensor::from_slice(&values, labels.shape().clone(), dev)
}

/// Mean squared error over all elements (PyTorch's `mse_loss`). `pred`
/// and `target` must have the same shape and float dtype: PyTorch warns
/// where they differ and broadcasts (a `[4, 1]` prediction against a `[4]`
/// target compares every prediction with every target), Lazuli refuses,
/// naming both shapes; broadcast on purpose with [`Tensor::expand`].
#[track_caller]
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let pred = &crate::amp::float32(pred)?;
    let target = &crate::amp::float32(target)?;
    check_pair("mse", pred, target, true, Location::caller())?;
    let d = pred.sub(target)?;
    d.mul(&d)?.mean(&[], false)
}

/// The error of a loss given [`Reduction::BatchMean`], which only
/// [`kl_div`] takes.
fn batch_mean_error(op: &str, at: &Location<'_>) -> ExecError {
    invalid_at(op, "reduction BatchMean is for kl_div only; use Mean, Sum or None".into(), at)
}

/// Checks that `input` is float and that `target` has its dtype and
/// broadcasts with it (or, when `same_shape`, has its shape exactly, as
/// PyTorch demands of some losses).
fn check_pair(op: &str, input: &Tensor, target: &Tensor, same_shape: bool, at: &Location<'_>) -> Result<()> {
    if !input.dtype().is_float() || target.dtype() != input.dtype() {
        return Err(invalid_at(
            op,
            format!(
                "expected a float input and a target of its dtype, got {}{} and {}{}",
                input.dtype(),
                input.shape(),
                target.dtype(),
                target.shape()
            ),
            at,
        ));
    }
    if same_shape && input.shape() != target.shape() {
        let broadcast = match input.shape().broadcast(target.shape()) {
            Some(s) if s == *input.shape() => {
                format!("the target would be repeated over the input's {s} (PyTorch warns here); ")
            }
            Some(s) => {
                format!("broadcasting them gives a {s} result, every input against every target, a classic bug; ")
            }
            None => String::new(),
        };
        let fix = if input.numel() == target.numel() {
            format!("reshape one to the other's shape (target.reshape({})?)", input.shape())
        } else {
            format!("give the target the input's shape (target.expand({})? broadcasts it on purpose)", input.shape())
        };
        return Err(invalid_at(
            op,
            format!("input {} and target {} differ in shape: {broadcast}{fix}", input.shape(), target.shape()),
            at,
        ));
    }
    if !same_shape && input.shape().broadcast(target.shape()).is_none() {
        return Err(invalid_at(
            op,
            format!("expected input and target of shapes that broadcast, got {} and {}", input.shape(), target.shape()),
            at,
        ));
    }
    Ok(())
}

/// Combines per-element `loss` values by `reduction` (`Mean` over all of
/// them); [`Reduction::BatchMean`] is an error naming `op`.
fn reduce(op: &str, loss: Tensor, reduction: Reduction, at: &Location<'_>) -> Result<Tensor> {
    match reduction {
        Reduction::None => Ok(loss),
        Reduction::Sum => loss.sum(&[], false),
        Reduction::Mean => loss.mean(&[], false),
        Reduction::BatchMean => Err(batch_mean_error(op, at)),
    }
}

/// Options of [`binary_cross_entropy_with_logits`]; the default is the
/// plain mean, like PyTorch's.
#[derive(Clone, Debug, Default)]
pub struct BceWithLogitsOptions {
    /// A per-element rescaling weight that broadcasts to the input
    /// (PyTorch's `weight`).
    pub weight: Option<Tensor>,
    /// The weight of the positive term, one per class on the last dim
    /// (`[classes]`) or anything that broadcasts to the input (PyTorch's
    /// `pos_weight`): above 1 it raises recall, below 1 precision.
    pub pos_weight: Option<Tensor>,
    /// How per-element losses combine.
    pub reduction: Reduction,
}

/// Binary cross-entropy of `input` logits against `target` probabilities
/// of the same shape, with the sigmoid folded in so that it stays finite
/// and exact for large `|input|` (PyTorch's
/// `binary_cross_entropy_with_logits`). Per element, with `p` the
/// `pos_weight` (1 when absent) and `w` the `weight` (1 when absent):
/// `w * ((1 - y) * x + (1 + (p - 1) * y) * softplus(-x))`, which without
/// `pos_weight` is `max(x, 0) - x * y + log1p(exp(-|x|))`; `softplus(-x)`
/// is [`Tensor::logaddexp`] of `-x` and 0, which never overflows.
#[track_caller]
pub fn binary_cross_entropy_with_logits(
    input: &Tensor,
    target: &Tensor,
    opts: &BceWithLogitsOptions,
) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let input = &crate::amp::float32(input)?;
    let target = &crate::amp::float32(target)?;
    let (op, at) = ("binary_cross_entropy_with_logits", Location::caller());
    check_pair(op, input, target, true, at)?;
    for (name, w) in [("weight", &opts.weight), ("pos_weight", &opts.pos_weight)] {
        if let Some(w) = w {
            let fits = w.shape().broadcast(input.shape()).is_some_and(|s| s == *input.shape());
            if w.dtype() != input.dtype() || !fits {
                return Err(invalid_at(
                    op,
                    format!(
                        "{name} must have the input's dtype and broadcast to its shape, got {}{} for input {}{}",
                        w.dtype(),
                        w.shape(),
                        input.dtype(),
                        input.shape()
                    ),
                    at,
                ));
            }
        }
    }
    if opts.reduction == Reduction::BatchMean {
        return Err(batch_mean_error(op, at));
    }
    let softplus_neg = input.neg()?.logaddexp_scalar(0.0)?;
    let negative = target.neg()?.add_scalar(1.0)?.mul(input)?;
    let positive = match &opts.pos_weight {
        None => softplus_neg,
        Some(p) => p.sub_scalar(1.0)?.mul(target)?.add_scalar(1.0)?.mul(&softplus_neg)?,
    };
    let mut loss = negative.add(&positive)?;
    if let Some(w) = &opts.weight {
        loss = loss.mul(w)?;
    }
    reduce(op, loss, opts.reduction, at)
}

/// Mean absolute error `|input - target|` (PyTorch's `l1_loss`): `input`
/// and `target` must have the same shape, as [`mse`] says.
#[track_caller]
pub fn l1_loss(input: &Tensor, target: &Tensor, reduction: Reduction) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let input = &crate::amp::float32(input)?;
    let target = &crate::amp::float32(target)?;
    let (op, at) = ("l1_loss", Location::caller());
    check_pair(op, input, target, true, at)?;
    if reduction == Reduction::BatchMean {
        return Err(batch_mean_error(op, at));
    }
    reduce(op, input.sub(target)?.abs()?, reduction, at)
}

/// The loss that is quadratic below `threshold` and linear above it, as
/// `scale * (0.5 d^2 / threshold)` below and `scale * (|d| - 0.5
/// threshold)` above, with `d = input - target`; `threshold` 0 gives
/// `scale * |d|`.
fn quadratic_then_linear(
    op: &str,
    input: &Tensor,
    target: &Tensor,
    threshold: f64,
    scale: f64,
    reduction: Reduction,
    at: &Location<'_>,
) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let input = &crate::amp::float32(input)?;
    let target = &crate::amp::float32(target)?;
    check_pair(op, input, target, true, at)?;
    if reduction == Reduction::BatchMean {
        return Err(batch_mean_error(op, at));
    }
    let d = input.sub(target)?;
    let ad = d.abs()?;
    let loss = if threshold == 0.0 {
        ad
    } else {
        let quadratic = d.mul(&d)?.mul_scalar(0.5 * scale / threshold)?;
        let linear = ad.sub_scalar(0.5 * threshold)?.mul_scalar(scale)?;
        ad.lt_scalar(threshold)?.where_(&quadratic, &linear)?
    };
    reduce(op, loss, reduction, at)
}

/// Smooth L1 loss (PyTorch's `smooth_l1_loss`, default `beta` 1.0): with
/// `d = input - target`, `0.5 d^2 / beta` where `|d| < beta` and
/// `|d| - 0.5 beta` elsewhere; `beta` 0 is the L1 loss. `beta` must be
/// finite and non-negative; `input` and `target` must have the same
/// shape, as [`mse`] says.
#[track_caller]
pub fn smooth_l1_loss(input: &Tensor, target: &Tensor, beta: f64, reduction: Reduction) -> Result<Tensor> {
    let (op, at) = ("smooth_l1_loss", Location::caller());
    if !(beta.is_finite() && beta >= 0.0) {
        return Err(invalid_at(op, format!("beta must be finite and non-negative, got {beta}"), at));
    }
    quadratic_then_linear(op, input, target, beta, 1.0, reduction, at)
}

/// Huber loss (PyTorch's `huber_loss`, default `delta` 1.0): with `d =
/// input - target`, `0.5 d^2` where `|d| < delta` and `delta * (|d| - 0.5
/// delta)` elsewhere; it is `delta` times [`smooth_l1_loss`] with `beta =
/// delta`. `delta` must be finite and positive; `input` and `target`
/// must have the same shape, as [`mse`] says.
#[track_caller]
pub fn huber_loss(input: &Tensor, target: &Tensor, delta: f64, reduction: Reduction) -> Result<Tensor> {
    let (op, at) = ("huber_loss", Location::caller());
    if !(delta.is_finite() && delta > 0.0) {
        return Err(invalid_at(op, format!("delta must be finite and positive, got {delta}"), at));
    }
    quadratic_then_linear(op, input, target, delta, delta, reduction, at)
}

/// Options of [`nll_loss`]; the default is PyTorch's (no class weights,
/// `ignore_index` -100, mean).
#[derive(Clone, Debug)]
pub struct NllLossOptions {
    /// One weight per class (`[classes]`, the input's dtype).
    pub weight: Option<Tensor>,
    /// Targets equal to this value contribute nothing, to the sum or to
    /// the mean's denominator.
    pub ignore_index: i64,
    /// How per-element losses combine.
    pub reduction: Reduction,
}

impl Default for NllLossOptions {
    fn default() -> Self {
        NllLossOptions { weight: None, ignore_index: -100, reduction: Reduction::Mean }
    }
}

/// Negative log-likelihood of log-probabilities `input` (`[.., classes]`,
/// float) at integer class `target`s (`[..]`, the leading dims of
/// `input`), PyTorch's `nll_loss` with the classes on the last dim like
/// [`cross_entropy_with`] (PyTorch puts them at dim 1; the two agree on
/// `[batch, classes]`). Per element `-w[t] * input[.., t]`, with `w` the
/// class weights (1 when absent); zero where the target is
/// `ignore_index`. `Mean` is PyTorch's weighted mean: the sum divided by
/// the sum of `w[t]` over the targets not ignored (NaN when that is zero,
/// like PyTorch). A target outside `0..classes` that is not ignored
/// matches no class and counts as weight 0 (PyTorch raises an error;
/// checking here would need a sync). 64-bit host targets on a device
/// whose main backend is not the CPU are narrowed to i32 as
/// [`cross_entropy_with`] does, so nothing runs on the CPU fallback.
#[track_caller]
pub fn nll_loss(input: &Tensor, target: &Tensor, opts: &NllLossOptions) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let input = &crate::amp::float32(input)?;
    let (op, at) = ("nll_loss", Location::caller());
    if input.rank() == 0 || target.dims() != &input.dims()[..input.rank() - 1] {
        return Err(invalid_at(
            op,
            format!(
                "expected input [.., classes] and target of its leading dims [..], got {} and {}",
                input.shape(),
                target.shape()
            ),
            at,
        ));
    }
    if !input.dtype().is_float() || !target.dtype().is_int() {
        return Err(invalid_at(
            op,
            format!("expected a float input and an integer target, got {} and {}", input.dtype(), target.dtype()),
            at,
        ));
    }
    let (dt, dev) = (input.dtype(), input.device());
    let c = input.dims()[input.rank() - 1];
    if let Some(w) = &opts.weight {
        if w.dims() != [c] || w.dtype() != dt {
            return Err(invalid_at(
                op,
                format!(
                    "weight must be [classes] of the input's dtype, got {}{} for input {}{}",
                    w.dtype(),
                    w.shape(),
                    dt,
                    input.shape()
                ),
                at,
            ));
        }
    }
    if opts.reduction == Reduction::BatchMean {
        return Err(batch_mean_error(op, at));
    }
    let target = &narrow_labels(target, Some(opts.ignore_index))?;
    let ld = target.dtype();
    let bits = 8 * ld.size_bytes() as u32;
    let hi = if ld.is_unsigned_int() { (1i128 << bits) - 1 } else { (1i128 << (bits - 1)) - 1 };
    let ignore = opts.ignore_index;
    // Selecting with a mask (not multiplying by a one-hot) keeps a -inf
    // log-probability of another class out of the sum.
    let mut mask = one_hot(target, c, DType::Bool)?;
    // An ignore_index outside `0..classes` matches no class, so only one
    // inside (a padding class, say) must be masked out.
    if ignore >= 0 && (ignore as u64) < c as u64 && i128::from(ignore) <= hi {
        let keep = target.ne(&Tensor::scalar(ignore, ld, dev))?;
        mask = mask.logical_and(&keep.unsqueeze(-1)?)?;
    }
    let zero = Tensor::scalar(0.0, dt, dev);
    let picked = mask.where_(input, &zero)?.sum(&[-1], false)?;
    let w = match &opts.weight {
        Some(weight) => mask.where_(weight, &zero)?.sum(&[-1], false)?,
        None => mask.cast(dt)?.sum(&[-1], false)?,
    };
    let loss = picked.mul(&w)?.neg()?;
    match opts.reduction {
        Reduction::Mean => loss.sum(&[], false)?.div(&w.sum(&[], false)?),
        r => reduce(op, loss, r, at),
    }
}

/// Kullback-Leibler divergence of `target` from the distribution whose
/// log-probabilities are `input` (PyTorch's `kl_div`; `input` and
/// `target` broadcast). Per element `target * (log(target) - input)`,
/// zero where `target` is 0 (PyTorch's `xlogy`), or with `log_target`
/// (the target given in log space too) `exp(target) * (target - input)`.
/// [`Reduction::BatchMean`] divides the sum by the first dim (the sum of a
/// rank-0 input), the true KL divergence per sample; `Mean`, PyTorch's
/// default, divides by the number of elements.
#[track_caller]
pub fn kl_div(input: &Tensor, target: &Tensor, reduction: Reduction, log_target: bool) -> Result<Tensor> {
    // Autocast: all of its arithmetic in f32 (PyTorch's f32 list).
    let input = &crate::amp::float32(input)?;
    let target = &crate::amp::float32(target)?;
    let (op, at) = ("kl_div", Location::caller());
    check_pair(op, input, target, false, at)?;
    let loss = if log_target {
        target.exp()?.mul(&target.sub(input)?)?
    } else {
        // log(1) stands in for log(0): the product is 0 either way, and
        // the gradient stays finite (no 0 * -inf).
        let (dt, dev) = (target.dtype(), target.device());
        let safe = target.eq_scalar(0.0)?.where_(&Tensor::scalar(1.0, dt, dev), target)?;
        target.mul(&safe.log()?.sub(input)?)?
    };
    match reduction {
        Reduction::BatchMean => {
            let sum = loss.sum(&[], false)?;
            match input.dims().first() {
                Some(&batch) => sum.div_scalar(batch as f64),
                None => Ok(sum),
            }
        }
        r => reduce(op, loss, r, at),
    }
}
