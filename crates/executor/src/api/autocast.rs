//! Autocast (automatic mixed precision, PyTorch's `torch.autocast`): a
//! thread-local scope in which the ops that profit from a 16-bit float run
//! in it, and the ops that need range or precision run in f32.
//!
//! The scope is a setting of the recording thread, like [`crate::no_grad`]:
//! [`autocast`] runs a closure with it, [`AutocastGuard`] holds it until
//! dropped; scopes nest, and `autocast(None, ..)` turns it off inside.
//! Every op is recorded through `Tensor::record_at`, which asks
//! [`policy`] what the op's class is and casts operands before the op is
//! recorded; the casts are ordinary `Op::Cast` nodes, so autograd
//! differentiates through them: an f32 parameter used by a low-precision
//! matmul gets an f32 gradient (the cast's backward casts it back).
//!
//! The classes follow PyTorch's CUDA autocast lists:
//! - [`CastPolicy::Low`] (matmul, conv, attention; linear, bmm and einsum
//!   lower to matmul): float operands other than f64 are cast to the
//!   scope's dtype and the result is in it. The backends compute these in
//!   f32 and round the result (the CPU backend widens f16 to f32 for
//!   matmul, conv and attention; wgpu runs f16 through that fallback).
//! - [`CastPolicy::Float32`] (softmax, log-softmax, sum, mean, prod,
//!   cumsum, exp, log, rsqrt, reciprocal, pow): 16-bit float operands are
//!   cast to f32. Norms and losses are compositions; they call
//!   [`float32`] on their inputs so that all of their arithmetic is f32.
//! - [`CastPolicy::Promote`] (the other binary elementwise ops, `where`,
//!   concat, pad, scatter-add): float operands of different dtypes are
//!   cast to the widest (PyTorch's type promotion; outside a scope the IR
//!   requires equal dtypes and names the mismatch).
//! - [`CastPolicy::Keep`]: everything else runs in its operands' dtype.
//!
//! Backward runs with autocast off (each gradient rule sees the dtypes its
//! forward recorded), and a [`crate::checkpoint`]ed segment is recomputed
//! under the autocast setting it was recorded with.
//!
//! The scope's dtype is any 16-bit float ([`is_low_precision`]): f16 today,
//! bf16 when the IR has it, with no change here.

use crate::api::lazy::{LazyNode, NodeKind};
use crate::{ExecError, Result, Tensor};
use lazuli_ir::{AttentionPart, BinaryOp, DType, Op, ReduceOp, UnaryOp};
use std::cell::Cell;
use std::panic::Location;
use std::sync::Arc;

thread_local! {
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// A 16-bit float: a dtype autocast can target (f16, and bf16 once it
/// exists).
pub fn is_low_precision(dtype: DType) -> bool {
    dtype.is_float() && dtype.size_bytes() == 2
}

/// The dtype of the current thread's autocast scope, `None` outside one.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(Cell::get)
}

fn check(dtype: Option<DType>) -> Result<()> {
    match dtype {
        Some(d) if !is_low_precision(d) => Err(ExecError::Invalid {
            op: "autocast".into(),
            detail: format!("autocast needs a 16-bit float dtype (f16, bf16), got {d}"),
        }),
        _ => Ok(()),
    }
}

/// Sets (or with `None` clears) the current thread's autocast dtype;
/// returns the previous setting. A dtype that is not a 16-bit float is an
/// error and changes nothing.
pub fn set_autocast(dtype: Option<DType>) -> Result<Option<DType>> {
    check(dtype)?;
    Ok(AUTOCAST.with(|c| c.replace(dtype)))
}

/// Holds an autocast setting on this thread until dropped (then restores
/// the previous one). Guards nest.
#[must_use = "the previous autocast setting returns when the guard is dropped"]
pub struct AutocastGuard {
    previous: Option<DType>,
}

impl AutocastGuard {
    /// Autocast to `dtype` (a 16-bit float), or off with `None`.
    pub fn new(dtype: impl Into<Option<DType>>) -> Result<AutocastGuard> {
        Ok(AutocastGuard { previous: set_autocast(dtype.into())? })
    }

    /// Autocast off (backward, optimizer steps).
    pub fn disabled() -> AutocastGuard {
        AutocastGuard { previous: AUTOCAST.with(|c| c.replace(None)) }
    }

    /// A setting read back from [`autocast_dtype`], so already checked.
    pub(crate) fn restore(dtype: Option<DType>) -> AutocastGuard {
        AutocastGuard { previous: AUTOCAST.with(|c| c.replace(dtype)) }
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        AUTOCAST.with(|c| c.set(self.previous));
    }
}

/// Runs `f` with autocast to `dtype` (`None`: off) on this thread, then
/// restores the previous setting: `autocast(DType::F16, || model.forward(&x))`.
pub fn autocast<R>(dtype: impl Into<Option<DType>>, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let _guard = AutocastGuard::new(dtype)?;
    f()
}

/// What autocast does with an op's operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CastPolicy {
    /// Float operands (not f64) are cast to the scope's 16-bit dtype.
    Low,
    /// 16-bit float operands are cast to f32.
    Float32,
    /// Float operands of different dtypes are cast to the widest.
    Promote,
    /// Operands are left as they are.
    Keep,
}

/// The autocast class of `op` (see the module documentation).
pub fn policy(op: &Op) -> CastPolicy {
    match op {
        Op::MatMul | Op::Conv2d(_) | Op::Attention { part: AttentionPart::Out, .. } => CastPolicy::Low,
        Op::Softmax { .. }
        | Op::CumSum { .. }
        | Op::Reduce { op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Prod, .. }
        | Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Rsqrt | UnaryOp::Reciprocal)
        | Op::Binary(BinaryOp::Pow) => CastPolicy::Float32,
        Op::Binary(_) | Op::Where | Op::Concat { .. } | Op::Pad { .. } | Op::ScatterAdd { .. } => CastPolicy::Promote,
        _ => CastPolicy::Keep,
    }
}

/// `t` in f32 inside an autocast scope when it is a 16-bit float, else
/// `t` itself: what norms and losses apply to their inputs.
#[track_caller]
pub fn float32(t: &Tensor) -> Result<Tensor> {
    if autocast_dtype().is_some() && is_low_precision(t.dtype()) {
        t.cast(DType::F32)
    } else {
        Ok(t.clone())
    }
}

/// An op's operands after autocast's casts, and its trailing scalar node.
pub(crate) type CastOperands = (Vec<Tensor>, Option<Arc<LazyNode>>);

/// The operands (and trailing scalar node) of `op` as autocast casts them,
/// or `None` when nothing changes (outside a scope, nearly always).
pub(crate) fn apply(
    op: &Op,
    operands: &[&Tensor],
    scalar: Option<&Arc<LazyNode>>,
    location: &'static Location<'static>,
) -> Result<Option<CastOperands>> {
    let Some(low) = autocast_dtype() else { return Ok(None) };
    let target = |d: DType| -> Option<DType> {
        match policy(op) {
            CastPolicy::Low => (d.is_float() && d != DType::F64 && d != low).then_some(low),
            CastPolicy::Float32 => is_low_precision(d).then_some(DType::F32),
            CastPolicy::Promote => {
                let widest = promoted(operands)?;
                (d.is_float() && d != widest).then_some(widest)
            }
            CastPolicy::Keep => None,
        }
    };
    if operands.iter().all(|t| target(t.dtype()).is_none()) {
        return Ok(None);
    }
    let cast = operands
        .iter()
        .map(|t| match target(t.dtype()) {
            Some(d) => Tensor::record_at(t.device(), Op::Cast(d), &[t], None, location),
            None => Ok((*t).clone()),
        })
        .collect::<Result<Vec<_>>>()?;
    // A scalar operand has its tensor operand's dtype (the `x * 0.5`
    // methods): it follows that operand.
    let scalar = match (scalar, cast.first()) {
        (Some(s), Some(first)) if s.ty.dtype != first.dtype() => Some(retype_scalar(s, first.dtype(), location)),
        (s, _) => s.cloned(),
    };
    Ok(Some((cast, scalar)))
}

/// The float dtype the float operands promote to: the widest, and f32 when
/// two different floats share the widest size (f16 with bf16, as PyTorch
/// promotes them); `None` without float operands.
fn promoted(operands: &[&Tensor]) -> Option<DType> {
    let floats = || operands.iter().map(|t| t.dtype()).filter(|d| d.is_float());
    let widest = floats().max_by_key(|d| d.size_bytes())?;
    let tie = floats().any(|d| d != widest && d.size_bytes() == widest.size_bytes());
    Some(if tie { DType::F32 } else { widest })
}

fn retype_scalar(s: &Arc<LazyNode>, dtype: DType, location: &'static Location<'static>) -> Arc<LazyNode> {
    match &s.kind {
        NodeKind::Scalar(v) => Tensor::lifted_node(*v, dtype, location),
        NodeKind::Op(Op::Constant(v, _)) => Tensor::scalar_node(*v, dtype, location),
        // A scalar operand is made by `Tensor::scalar_node` only.
        _ => unreachable!("a scalar operand is a scalar or constant node"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lazuli_ir::ConvAttrs;

    #[test]
    fn policy_follows_the_pytorch_lists() {
        assert_eq!(policy(&Op::MatMul), CastPolicy::Low);
        assert_eq!(policy(&Op::Conv2d(ConvAttrs::default())), CastPolicy::Low);
        assert_eq!(policy(&Op::Softmax { axis: 0, log: true }), CastPolicy::Float32);
        assert_eq!(policy(&Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }), CastPolicy::Float32);
        assert_eq!(policy(&Op::Reduce { op: ReduceOp::Max, axes: vec![0], keepdim: false }), CastPolicy::Keep);
        assert_eq!(policy(&Op::Unary(UnaryOp::Exp)), CastPolicy::Float32);
        assert_eq!(policy(&Op::Unary(UnaryOp::Relu)), CastPolicy::Keep);
        assert_eq!(policy(&Op::Binary(BinaryOp::Add)), CastPolicy::Promote);
        assert_eq!(policy(&Op::Binary(BinaryOp::Pow)), CastPolicy::Float32);
        assert_eq!(policy(&Op::Cast(DType::F16)), CastPolicy::Keep);
    }

    #[test]
    fn guards_nest_and_only_16_bit_floats_are_accepted() {
        assert_eq!(autocast_dtype(), None);
        {
            let _a = AutocastGuard::new(DType::F16).unwrap();
            assert_eq!(autocast_dtype(), Some(DType::F16));
            {
                let _b = AutocastGuard::new(None).unwrap();
                assert_eq!(autocast_dtype(), None);
            }
            assert_eq!(autocast_dtype(), Some(DType::F16));
            let e = AutocastGuard::new(DType::F32).err().expect("f32 is not a low-precision dtype");
            assert!(e.to_string().contains("f32"), "{e}");
            assert_eq!(autocast_dtype(), Some(DType::F16));
        }
        assert_eq!(autocast_dtype(), None);
        assert!(is_low_precision(DType::F16) && !is_low_precision(DType::I16) && !is_low_precision(DType::F32));
    }
}
