//! Collectives across processes, as the executor runs them.
//!
//! An [`lazuli_ir::Op::AllReduce`] node is no kernel: no backend supports
//! it, and the plan gives each one a segment of its own (`plan`). Running
//! that segment reads its operand to the host, *starts* the collective
//! through the [`Collective`] registered on the device
//! ([`crate::Device::set_collective`]) and goes on with the segments that
//! do not need its result; the first segment that reads it waits for the
//! [`PendingCollective`] and uploads the result. So communication runs
//! while the rest of the step (the rest of the backward pass) computes.
//!
//! A rank whose step failed before a collective still joins it, with
//! zeros and `failed` set, so that its peers never wait for it; an
//! implementation reports the failure to every rank (see
//! `lazuli-distributed`). The implementation decides how long a wait may
//! take: an error ([`CollectiveError`]) surfaces at the next barrier like
//! any asynchronous error.

use lazuli_ir::CollectiveOp;

/// Runs the collectives of recorded steps (object-safe; registered on a
/// device with [`crate::Device::set_collective`]). Every rank must start
/// the same collectives in the same order: the plan does, because every
/// rank compiles the same graph to the same plan.
pub trait Collective: Send + Sync {
    /// Starts `op` over every rank's `data` (this rank's f32 values of the
    /// all-reduce tagged `bucket`, the same length on every rank) and
    /// returns at once. With `failed`, this rank's step failed before the
    /// values existed: `data` is zeros, and the collective must still run
    /// so that no peer waits for this rank.
    fn start_all_reduce(
        &self,
        bucket: u32,
        op: CollectiveOp,
        data: Vec<f32>,
        failed: bool,
    ) -> Result<Box<dyn PendingCollective>, CollectiveError>;
}

/// A collective in flight.
pub trait PendingCollective: Send {
    /// The result, once every rank contributed; an implementation bounds
    /// the wait.
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError>;
}

/// A collective failed: a peer failed or stalled, or the transport broke.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct CollectiveError {
    /// What happened, for the user (names the rank or the timeout).
    pub message: String,
}

impl CollectiveError {
    /// An error with this message.
    pub fn new(message: impl Into<String>) -> CollectiveError {
        CollectiveError { message: message.into() }
    }
}

impl std::fmt::Debug for CollectiveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        crate::error::write_chain(f, self)
    }
}
