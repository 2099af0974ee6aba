//! Sizes that recur get static kernels: the second tier of a plan
//! compiled generic over sizes.
//!
//! A size variant compiles at once and creates no pipeline because its
//! kernels are generic over sizes ([`crate::generic`]): they read their
//! sizes from a buffer, in forms that hold at every size (no vec4 path
//! along a size that varies, the register-blocked product rather than
//! tiles, split-K or tensor cores, divisions by sizes rather than by
//! constants). That is the right trade for a size seen once; a size that
//! keeps coming back (a generation loop once its context is full, a
//! sequence length of a bucketed data set) would run those slower forms
//! on every step. So a plan with generic kernels that has started
//! [`WgpuOptions::specialize_after`](crate::WgpuOptions::specialize_after)
//! executions (default [`SPECIALIZE_AFTER`] on GPUs; never by default on
//! software adapters, whose kernels run on the very cores a background
//! compile would take) has its generic kernels compiled again as the
//! static kernels a first compile at its sizes would make (the rule's
//! forms, or the tuner's known winner), on a thread of their own: no
//! step waits for that compile. The executions
//! that start meanwhile run the generic kernels; the first one after the
//! compile finished swaps the static kernels in, at that plan boundary
//! (an execution in flight keeps the kernels it started with, see
//! `WgpuExecutable::current_kernels`); a static product the tuner times
//! and has no winner for is then measured at a later boundary, as a
//! first compile's would be ([`crate::autotune`]). Counted as
//! `SpecializedPlans` and `SpecializedKernels`; a compile that fails is a
//! warning and the plan keeps its generic kernels.
//!
//! Sound by construction: every form of a kernel computes the same
//! values up to float rounding (the order a form sums in; the
//! differential tests and the fuzzer prove every form against the CPU
//! reference), and the swap changes which pipelines the next execution
//! binds, never a buffer. Where there are no threads (the
//! browser), plans keep their generic kernels. A device being dropped
//! cancels its backend's compiles and waits for them (each stops before
//! its next kernel), so no compile outlives its device's drop nor runs
//! into the process's exit.

use crate::compile::{CompiledKernel, WgpuExecutable};
use lazuli_executor::metrics;
use lazuli_ir::fusion::Kernel;
use lazuli_ir::VerifiedGraph;
use std::sync::{Arc, Mutex};

/// Executions of a plan with generic kernels after which they are
/// compiled static (see the module documentation): a size that came
/// back this often is a steady state, and a few dozen pipelines compiled
/// in the background are repaid by the steps that follow.
pub const SPECIALIZE_AFTER: u64 = 32;

/// What compiling a plan's static kernels gives: each by its index in
/// the plan, and the indices of those waiting for the tuner (measured at
/// the plan boundaries after the swap, as a first compile's would be).
pub(crate) type Compiled = (Vec<(usize, CompiledKernel)>, Vec<usize>);

/// Where a plan stands on its way to static kernels.
#[derive(Default)]
pub(crate) enum Tier {
    /// Static already, specialized, or not to be (nothing to do).
    #[default]
    Settled,
    /// Has generic kernels, not yet run often enough.
    Generic,
    /// Its static kernels are being compiled.
    Compiling,
    /// Its static kernels, by index, to swap in at the next execution,
    /// and the indices of those the tuner is to measure.
    Ready(Vec<(usize, CompiledKernel)>, Vec<usize>),
}

/// The kernels of a plan to compile static, handed to the compiling
/// thread; [`Specialization::finish`] hands the result back to the plan
/// (dropped unfinished, it leaves the plan generic).
pub(crate) struct Specialization {
    /// The plan's graph.
    pub graph: VerifiedGraph,
    /// Each generic kernel: its index in the plan, its kernel and name.
    pub kernels: Vec<(usize, Kernel, String)>,
    tier: Arc<Mutex<Tier>>,
}

impl Specialization {
    /// Hands the compiled kernels to the plan (swapped in before its next
    /// execution); a failure leaves the plan generic, with a warning.
    /// `Ok(None)`: cancelled (the backend is going away).
    pub fn finish(&self, compiled: Result<Option<Compiled>, lazuli_executor::BackendError>) {
        let mut tier = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        *tier = match compiled {
            Ok(Some((kernels, untuned))) => Tier::Ready(kernels, untuned),
            Ok(None) => Tier::Settled,
            Err(e) => {
                tracing::warn!("compiling static kernels for recurring sizes failed, the plan stays generic: {e}");
                Tier::Settled
            }
        };
    }
}

impl Drop for Specialization {
    /// A compile that never finished (its thread did not start, or
    /// panicked) leaves the plan generic for good.
    fn drop(&mut self) {
        let mut tier = self.tier.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*tier, Tier::Compiling) {
            *tier = Tier::Settled;
        }
    }
}

/// At a plan boundary, before an execution of `exe` (whose `runs`
/// executions started before this one): swaps its static kernels in where
/// they are ready; returns the kernels to compile static where it has
/// generic ones and reached `after` executions (the caller starts the
/// compile, off this thread). `after`: `None` never specializes.
pub(crate) fn at_boundary(exe: &WgpuExecutable, runs: u64, after: Option<u64>) -> Option<Specialization> {
    let mut tier = exe.tier.lock().unwrap_or_else(|e| e.into_inner());
    match &mut *tier {
        Tier::Ready(kernels, untuned) => {
            let (kernels, untuned) = (std::mem::take(kernels), std::mem::take(untuned));
            *tier = Tier::Settled;
            drop(tier);
            metrics::inc("SpecializedPlans", 1);
            metrics::inc("SpecializedKernels", kernels.len() as u64);
            for (ki, kernel) in kernels {
                exe.replace_kernel(ki, kernel);
            }
            exe.await_tuning(&untuned);
            None
        }
        Tier::Generic if after.is_some_and(|n| runs >= n) => {
            let current = exe.current_kernels();
            let kernels: Vec<(usize, Kernel, String)> = current
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_generic())
                .map(|(i, c)| (i, exe.plan.kernels[i].clone(), c.name.clone()))
                .collect();
            if kernels.is_empty() {
                *tier = Tier::Settled;
                return None;
            }
            *tier = Tier::Compiling;
            Some(Specialization { graph: exe.graph.clone(), kernels, tier: exe.tier.clone() })
        }
        _ => None,
    }
}
