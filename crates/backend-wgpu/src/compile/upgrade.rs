//! One background upgrade of a compiled plan: compile something better on
//! a thread of its own, adopt it at a plan boundary.
//!
//! Two things replace a plan's kernels after it compiled, and both follow
//! the same four states: the autotuner (its candidate forms compiled, then
//! timed and the winners swapped in, see [`crate::compile::autotune`]) and the
//! second tier (static kernels for a plan generic over sizes whose sizes
//! recur, see [`crate::compile::specialize`]). An [`Upgrade`] is that state machine,
//! written once: [`Stage::Idle`] (nothing in flight), [`Stage::Compiling`]
//! (a [`Job`] is out on a background thread), [`Stage::Ready`] (what the
//! job made, waiting for the next plan boundary), [`Stage::Closed`]
//! (nothing more will come). At each plan boundary
//! ([`Upgrade::at_boundary`]) what is ready is adopted (all of it, or,
//! where adopting is metered, part of it and the rest at the next
//! boundaries), or, when idle, a job is started if one is due. The job
//! hands its result back with [`Job::finish`]; a job dropped unfinished
//! (its thread did not start, or panicked) closes the upgrade, so the plan
//! keeps what it has, never waits for a compile that will not come.
//!
//! The upgrade is parked on the executable it upgrades (see
//! [`crate::compile::executable`]); the executions in flight keep the kernels they
//! started with, and adopting changes which pipelines the next execution
//! binds, never a buffer.
//!
//! Rejected alternative: one state enum per user (`Waiting` for the tuner,
//! `Tier` for specialization), each with its own job type and drop guard,
//! as before: the same transitions written twice, and two places to get a
//! subtle one (a panicking compile must not leave a plan waiting) right.

use lazuli_executor::BackendError;
use std::sync::{Arc, Mutex, MutexGuard};

/// Where an upgrade stands (see the module documentation).
pub(crate) enum Stage<R> {
    /// Nothing compiling; a job may start at the next boundary.
    Idle,
    /// A job is compiling, off the steps' path.
    Compiling,
    /// What the job made, adopted at the next boundary.
    Ready(R),
    /// Nothing more will come: done, given up, or never needed.
    Closed,
}

/// One upgrade of a plan: its [`Stage`], shared with the job in flight.
pub(crate) struct Upgrade<R> {
    stage: Arc<Mutex<Stage<R>>>,
    /// Where adopting everything that was ready leaves it: idle again (the
    /// tuner: kernels may come to wait for it later) or closed (the tier:
    /// a plan is specialized once).
    after_adopting: fn() -> Stage<R>,
}

/// What a due check at an idle boundary decides (see
/// [`Upgrade::at_boundary`]).
pub(crate) enum Due<P> {
    /// Start a job on `P`.
    Start(P),
    /// Not yet: stay idle.
    NotYet,
    /// Never: close the upgrade.
    Never,
}

/// What adopting what was ready leaves (see [`Upgrade::at_boundary`]).
pub(crate) enum Adopted {
    /// All of it: the upgrade moves on (idle or closed, as made).
    All,
    /// Some of it: the rest waits for the boundaries that follow.
    Part,
}

impl<R> Upgrade<R> {
    /// An upgrade that starts idle where `open`, else closed; adopting
    /// everything leaves it idle again where `reopens`, else closed.
    pub fn new(open: bool, reopens: bool) -> Upgrade<R> {
        let stage = if open { Stage::Idle } else { Stage::Closed };
        let after_adopting: fn() -> Stage<R> = if reopens { || Stage::Idle } else { || Stage::Closed };
        Upgrade { stage: Arc::new(Mutex::new(stage)), after_adopting }
    }

    fn lock(&self) -> MutexGuard<'_, Stage<R>> {
        lock(&self.stage)
    }

    /// At a plan boundary: adopts what is ready (`adopt`, which may take
    /// part of it and leave the rest for later boundaries), or, when
    /// idle, asks `due` whether a job should start and returns it (the
    /// caller runs it off this thread; the upgrade is compiling until the
    /// job finishes or is dropped). Nothing happens while a job is
    /// compiling or once closed.
    pub fn at_boundary<P>(
        &self,
        adopt: impl FnOnce(&mut R) -> Adopted,
        due: impl FnOnce() -> Due<P>,
    ) -> Option<Job<R, P>> {
        let mut stage = self.lock();
        match &mut *stage {
            Stage::Compiling | Stage::Closed => None,
            Stage::Ready(ready) => {
                match adopt(ready) {
                    Adopted::All => *stage = (self.after_adopting)(),
                    Adopted::Part => {}
                }
                None
            }
            Stage::Idle => match due() {
                Due::Start(input) => {
                    *stage = Stage::Compiling;
                    Some(Job { input, stage: self.stage.clone() })
                }
                Due::NotYet => None,
                Due::Never => {
                    *stage = Stage::Closed;
                    None
                }
            },
        }
    }

    /// Whether a job is compiling.
    #[cfg(test)]
    pub fn compiling(&self) -> bool {
        matches!(*self.lock(), Stage::Compiling)
    }

    /// Whether nothing more will come.
    #[cfg(test)]
    pub fn closed(&self) -> bool {
        matches!(*self.lock(), Stage::Closed)
    }
}

/// A background compile of an [`Upgrade`]: its input, and the upgrade's
/// stage, which [`Job::finish`] sets (dropped unfinished, the upgrade
/// closes).
pub(crate) struct Job<R, P> {
    /// What to compile.
    pub input: P,
    stage: Arc<Mutex<Stage<R>>>,
}

impl<R, P> Job<R, P> {
    /// Hands the compile's result to the upgrade: ready for the next
    /// boundary, or, cancelled (`Ok(None)`: the backend is going away) or
    /// failed (a warning naming `what`), closed: the plan keeps what it
    /// has.
    pub fn finish(self, compiled: Result<Option<R>, BackendError>, what: &str) {
        let mut stage = lock(&self.stage);
        *stage = match compiled {
            Ok(Some(ready)) => Stage::Ready(ready),
            Ok(None) => Stage::Closed,
            Err(e) => {
                tracing::warn!("{what} failed, the plan keeps its kernels: {e}");
                Stage::Closed
            }
        };
    }
}

impl<R, P> Drop for Job<R, P> {
    /// A compile that never finished (its thread did not start, or
    /// panicked) closes the upgrade.
    fn drop(&mut self) {
        let mut stage = lock(&self.stage);
        if matches!(*stage, Stage::Compiling) {
            *stage = Stage::Closed;
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Idle, compiling, ready, adopted: once (closing) or again and again
    /// (reopening); part of what is ready stays for the next boundary.
    #[test]
    fn an_upgrade_compiles_once_and_is_adopted_at_a_boundary() {
        let up: Upgrade<Vec<u32>> = Upgrade::new(true, false);
        assert!(up.at_boundary(|_| Adopted::All, || Due::<()>::NotYet).is_none(), "not due yet");
        let job = up.at_boundary(|_| Adopted::All, || Due::Start(7)).expect("due");
        assert_eq!(job.input, 7);
        assert!(up.compiling());
        assert!(up.at_boundary(|_| unreachable!(), || Due::<()>::Start(())).is_none(), "one job at a time");
        job.finish(Ok(Some(vec![1, 2, 3])), "test");
        let mut seen = Vec::new();
        up.at_boundary(
            |r| {
                seen.push(r.remove(0));
                Adopted::Part
            },
            || Due::<()>::NotYet,
        );
        up.at_boundary(
            |r| {
                seen.append(r);
                Adopted::All
            },
            || Due::<()>::NotYet,
        );
        assert_eq!(seen, [1, 2, 3]);
        assert!(up.closed(), "a closing upgrade is done once adopted");
        let again: Upgrade<()> = Upgrade::new(true, true);
        again.at_boundary(|_| Adopted::All, || Due::Start(())).unwrap().finish(Ok(Some(())), "test");
        again.at_boundary(|_| Adopted::All, || Due::<()>::NotYet);
        assert!(again.at_boundary(|_| Adopted::All, || Due::Start(())).is_some(), "a reopening upgrade starts again");
    }

    /// A job dropped unfinished, cancelled or failed closes the upgrade:
    /// nothing waits for a compile that will not come.
    #[test]
    fn a_lost_job_closes_the_upgrade() {
        for end in 0..3 {
            let up: Upgrade<u32> = Upgrade::new(true, true);
            let job = up.at_boundary(|_| Adopted::All, || Due::Start(())).unwrap();
            match end {
                0 => drop(job),
                1 => job.finish(Ok(None), "test"),
                _ => job.finish(Err(BackendError::Execution("boom".into())), "test"),
            }
            assert!(up.closed(), "end {end}");
            assert!(up.at_boundary(|_| Adopted::All, || Due::Start(())).is_none());
        }
        let never: Upgrade<u32> = Upgrade::new(true, true);
        assert!(never.at_boundary(|_| Adopted::All, || Due::<()>::Never).is_none());
        assert!(never.closed());
        assert!(Upgrade::<u32>::new(false, true).closed());
    }
}
