//! `DistError`: what a collective, a parameter check or the process group
//! reports.

use lazuli_executor::config::ConfigError;
use lazuli_executor::ExecError;
use std::time::Duration;

/// An error of distributed training.
#[derive(thiserror::Error)]
pub enum DistError {
    /// The ranks do not hold the same parameters (names, shapes, dtypes).
    /// Every rank reports it.
    #[error("data-parallel parameters differ between ranks: {detail}")]
    ParameterMismatch {
        /// The first rank that differs from rank 0.
        rank: usize,
        /// The first difference, naming the parameter, its dtype and shape on
        /// both ranks.
        detail: String,
    },
    /// A parameter whose dtype the gradient all-reduce does not handle.
    #[error("data-parallel parameter {name}: dtype {dtype} is not supported (f32 only)")]
    UnsupportedDType {
        /// The parameter's name.
        name: String,
        /// Its dtype.
        dtype: lazuli_ir::DType,
    },
    /// A rank failed before or during a collective; every rank reports it.
    #[error("rank {rank} of {world} failed during {op}: {message}")]
    RankFailed {
        /// The lowest failing rank.
        rank: usize,
        /// The number of ranks.
        world: usize,
        /// The collective step in which the failure became known.
        op: &'static str,
        /// The failing rank's error, as text.
        message: String,
    },
    /// A collective did not complete within the timeout: a peer is stalled
    /// or gone. The group is unusable afterwards.
    #[error("{op}: no result from every rank within {} s (LAZULI_DIST_TIMEOUT_SECS); a peer stalled or died", timeout.as_secs())]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The timeout it waited.
        timeout: Duration,
    },
    /// The group failed earlier (a timeout or a lost communication thread)
    /// and cannot run collectives any more.
    #[error("{op}: the process group failed earlier and can run no collective")]
    Broken {
        /// The collective asked for.
        op: &'static str,
    },
    /// The batch or dataset cannot be split between the ranks as asked.
    #[error("{op}: {detail}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// MPI could not be initialized (already initialized in this process, or
    /// the environment is not usable).
    #[error("MPI initialization: {0}")]
    Init(String),
    /// A malformed `LAZULI_DIST_*` variable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The engine failed on this rank.
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// `Debug` prints the message and its causes (what `?` out of `main`
/// shows); an engine error prints as it does on its own.
impl std::fmt::Debug for DistError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DistError::Exec(e) => std::fmt::Debug::fmt(e, f),
            other => lazuli_executor::error::write_chain(f, other),
        }
    }
}
