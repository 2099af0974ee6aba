//! `GroupCollective`: the executor's [`Collective`] on a process group's
//! communication thread, which runs the all-reduce nodes that
//! [`DataParallel::reduce_in_graph`](crate::DataParallel::reduce_in_graph)
//! records into the step.
//!
//! Each all-reduce carries one extra element, this rank's failure flag
//! (`2^rank`, so the sum names the lowest failing rank; ranks from 23 on
//! share `2^23`): a rank whose plan failed before the all-reduce still
//! joins it with zeros and its flag, and every rank's wait then fails with
//! the failing rank's number, at the device's next barrier. A wait is
//! bounded by the group's timeout ([`DistOptions::timeout`](crate::DistOptions)).
//! The thread times the MPI call itself; the device's worker times its
//! waits: their totals ([`InGraphTotals`]) say how much of the all-reduce
//! time the rest of the step hid.

use crate::group::{Link, LinkPending};
use lazuli_executor::{Collective, CollectiveError, PendingCollective};
use lazuli_ir::CollectiveOp;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the in-graph all-reduces cost since the totals were last taken.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct InGraphTotals {
    /// All-reduces waited for.
    pub reduces: usize,
    /// Gradient bytes contributed.
    pub bytes: u64,
    /// Time the communication thread spent in MPI.
    pub reduce: Duration,
    /// Time the device's worker waited for results.
    pub wait: Duration,
}

/// The [`Collective`] a [`DataParallel`](crate::DataParallel) registers on
/// its parameters' device.
pub(crate) struct GroupCollective {
    pub link: Link,
    pub totals: Arc<Mutex<InGraphTotals>>,
}

const OP: &str = "in-graph all-reduce of gradients";

/// Ranks from this one on share one flag bit.
const FLAG_BITS: usize = 23;

impl GroupCollective {
    /// The flag value rank `rank` contributes when it failed.
    fn flag(rank: usize) -> f32 {
        (1u32 << rank.min(FLAG_BITS)) as f32
    }

    /// Starts the all-reduce of `data` and the flag (shared by the
    /// executor's collective segments and a rank that abandons its step).
    pub fn start(
        &self,
        bucket: u32,
        op: CollectiveOp,
        mut data: Vec<f32>,
        failed: bool,
    ) -> Result<Pending, CollectiveError> {
        let n = data.len();
        if data.try_reserve_exact(1).is_err() {
            return Err(CollectiveError::new(format!("cannot allocate the {n}-element all-reduce bucket {bucket}")));
        }
        data.push(if failed { GroupCollective::flag(self.link.rank) } else { 0.0 });
        let inner = self.link.start_sum(OP, data).map_err(|e| CollectiveError::new(e.to_string()))?;
        Ok(Pending {
            inner,
            bucket,
            op,
            failed,
            world: self.link.world_size,
            bytes: 4 * n as u64,
            totals: self.totals.clone(),
        })
    }
}

impl Collective for GroupCollective {
    fn start_all_reduce(
        &self,
        bucket: u32,
        op: CollectiveOp,
        data: Vec<f32>,
        failed: bool,
    ) -> Result<Box<dyn PendingCollective>, CollectiveError> {
        Ok(Box::new(self.start(bucket, op, data, failed)?))
    }
}

/// An all-reduce of the step in flight.
pub(crate) struct Pending {
    inner: LinkPending,
    bucket: u32,
    op: CollectiveOp,
    failed: bool,
    world: usize,
    bytes: u64,
    totals: Arc<Mutex<InGraphTotals>>,
}

impl Pending {
    /// [`PendingCollective::wait`].
    pub fn wait_result(self) -> Result<Vec<f32>, CollectiveError> {
        let started = Instant::now();
        let result = self.inner.wait();
        let waited = started.elapsed();
        let (mut sum, reduce) = result.map_err(|e| CollectiveError::new(e.to_string()))?;
        {
            let mut t = self.totals.lock().unwrap_or_else(|e| e.into_inner());
            t.reduces += 1;
            t.bytes += self.bytes;
            t.reduce += reduce;
            t.wait += waited;
        }
        let flags = sum.pop().unwrap_or(0.0);
        if flags > 0.5 {
            let lowest = (flags.round() as u32).trailing_zeros() as usize;
            let who = if lowest >= FLAG_BITS {
                format!("a rank from {FLAG_BITS} on, of {}", self.world)
            } else {
                format!("rank {lowest} of {}", self.world)
            };
            let mine = if self.failed { " (this rank's own error is reported with it)" } else { "" };
            return Err(CollectiveError::new(format!(
                "{who} failed before this all-reduce (bucket {}); its error is reported on that rank{mine}",
                self.bucket
            )));
        }
        if self.op == CollectiveOp::Mean && self.world > 1 {
            let scale = 1.0 / self.world as f32;
            sum.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(sum)
    }
}

impl PendingCollective for Pending {
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CollectiveError> {
        (*self).wait_result()
    }
}
