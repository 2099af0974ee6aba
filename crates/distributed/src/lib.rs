//! Data-parallel training for Lazuli across processes, on MPI.
//!
//! A [`ProcessGroup`] is the set of processes (ranks) of one job: built
//! from the MPI environment when the program runs under `mpirun` or
//! `srun` (cargo feature `mpi`, rsmpi over the system's Open MPI or
//! MPICH), else a group of one so that the same program runs alone.
//! [`DataParallel`] keeps a model's parameters equal on every rank: it
//! checks that every rank holds the same parameter names, shapes and
//! dtypes, broadcasts rank 0's values, and averages the gradients across
//! ranks in buckets before the optimizer runs. [`DistributedSampler`]
//! gives each rank its shard of each epoch's permutation.
//!
//! Collectives stage tensors through the host: every MPI call is made by
//! one communication thread that the group owns, and the calling thread
//! waits for each result with a deadline ([`DistOptions::timeout`]), so a
//! rank that fails or stalls makes its peers fail with an error within a
//! bounded time instead of hanging.

mod collective;
mod error;
mod group;
mod parallel;
mod sampler;

pub use error::DistError;
pub use group::{DistOptions, PendingReduce, ProcessGroup, Transport};
pub use parallel::{DataParallel, ReduceStats, FIRST_BUCKET_BYTES};
pub use sampler::DistributedSampler;
