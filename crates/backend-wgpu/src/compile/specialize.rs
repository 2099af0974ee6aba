//! Sizes that recur get static kernels: the second tier of a plan
//! compiled generic over sizes.
//!
//! A size variant compiles at once and creates no pipeline because its
//! kernels are generic over sizes ([`crate::rewrite::size_families`]): they read their
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
//! first compile's would be ([`crate::compile::autotune`]). Counted as
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

use crate::compile::executable::{Recompile, StaticKernels, WgpuExecutable};
use crate::compile::upgrade::{Adopted, Due, Job};
use lazuli_executor::metrics;

/// Executions of a plan with generic kernels after which they are
/// compiled static (see the module documentation): a size that came
/// back this often is a steady state, and a few dozen pipelines compiled
/// in the background are repaid by the steps that follow.
pub const SPECIALIZE_AFTER: u64 = 32;

/// A compile of a plan's static kernels, off the steps' path (see
/// [`crate::compile::upgrade`]): its generic kernels, handed to the compiling
/// thread; [`crate::compile::upgrade::Job::finish`] hands the static kernels back.
pub(crate) type Specialization = Job<StaticKernels, Recompile>;

/// At a plan boundary, before an execution of `exe` (whose `runs`
/// executions started before this one): swaps its static kernels in where
/// they are ready; returns the kernels to compile static where it has
/// generic ones and reached `after` executions (the caller starts the
/// compile, off this thread). `after`: `None` never specializes.
pub(crate) fn at_boundary(exe: &WgpuExecutable, runs: u64, after: Option<u64>) -> Option<Specialization> {
    exe.tier.at_boundary(
        |ready| {
            let StaticKernels { kernels, untuned } = std::mem::replace(ready, StaticKernels::none());
            metrics::inc("SpecializedPlans", 1);
            metrics::inc("SpecializedKernels", kernels.len() as u64);
            for (ki, kernel) in kernels {
                exe.replace_kernel(ki, kernel);
            }
            exe.await_tuning(&untuned);
            Adopted::All
        },
        || {
            if after.is_none_or(|n| runs < n) {
                return Due::NotYet;
            }
            let generic: Vec<usize> =
                exe.current_kernels().iter().enumerate().filter(|(_, c)| c.is_generic()).map(|(i, _)| i).collect();
            if generic.is_empty() {
                Due::Never
            } else {
                Due::Start(exe.recompile(generic))
            }
        },
    )
}
