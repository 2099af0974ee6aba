//! Losses: [`cross_entropy`] and [`cross_entropy_with`] (class indices
//! on the last dim, `ignore_index`, label smoothing and a [`Reduction`],
//! set through [`CrossEntropyOptions`]) and [`mse`].

use super::embedding::one_hot;
use super::invalid;
use crate::{BackendKind, DType, Result, Tensor, TensorState};

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

/// Mean squared error over all elements (`target` broadcasts to `pred`).
pub fn mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = pred.sub(target)?;
    d.mul(&d)?.mean(&[], false)
}
