//! Losses: [`cross_entropy`] and [`cross_entropy_with`] (class indices
//! on the last dim, `ignore_index`, label smoothing and a [`Reduction`],
//! set through [`CrossEntropyOptions`]) and [`mse`].

use super::embedding::one_hot;
use super::invalid;
use crate::{DType, Result, Tensor};

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
/// for `ignore_index`, label smoothing and other reductions.
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
pub fn cross_entropy_with(logits: &Tensor, labels: &Tensor, opts: &CrossEntropyOptions) -> Result<Tensor> {
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
        Reduction::Mean => match valid {
            None => loss.mean(&[], false),
            Some(keep) => loss.sum(&[], false)?.div(&keep.cast(dt)?.sum(&[], false)?),
        },
    }
}

/// Mean squared error over all elements (`target` broadcasts to `pred`).
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = pred.sub(target)?;
    d.mul(&d)?.mean(&[], false)
}
