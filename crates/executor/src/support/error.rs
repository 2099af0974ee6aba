//! Executor errors ([`ExecError`]): IR errors at record time, backend errors
//! raised at barriers, and misuse of the API (wrong dtype read, mixed devices).
//!
//! An error always names the computation it is about: a backend failure
//! carries the graph hash and the sync point that submitted it; reading a
//! value whose computation failed is [`ExecError::Failed`] around that
//! failure; a computation that needs an earlier failed value is
//! [`ExecError::Poisoned`], which says so in those words.

use crate::BackendError;
use lazuli_ir::{DType, IrError, Shape};
use thiserror::Error;

/// An error returned by the executor. Errors raised inside an asynchronous
/// execution are stored and returned by the next barrier on that device.
#[derive(Debug, Clone, Error)]
pub enum ExecError {
    /// A bad shape, axis or dtype found when an op was recorded.
    #[error(transparent)]
    Ir(#[from] IrError),
    /// A backend failed while compiling or running a graph.
    #[error("{context}: {source}")]
    Backend {
        /// What the executor was doing (e.g. "executing graph 1a2b.. (3 kernels), synced by to_vec at src/main.rs:10").
        context: String,
        /// The backend's error.
        #[source]
        source: BackendError,
    },
    /// A value was read with the wrong element type.
    #[error("{op}: tensor has dtype {actual} and shape {shape}, cannot read it as {expected}")]
    ReadDType {
        /// The reading call.
        op: String,
        /// The tensor's dtype.
        actual: DType,
        /// The requested dtype.
        expected: DType,
        /// The tensor's shape.
        shape: Shape,
    },
    /// Host data does not fit the requested shape.
    #[error("{op}: {len} values cannot fill shape {shape} ({numel} elements)")]
    DataLength {
        /// The creating call.
        op: String,
        /// Values given.
        len: usize,
        /// Shape requested.
        shape: Shape,
        /// Its element count.
        numel: usize,
    },
    /// Operands live on different devices.
    #[error("{op}: operands live on different devices ({a} and {b})")]
    DeviceMismatch {
        /// The op.
        op: String,
        /// First device.
        a: String,
        /// Second device.
        b: String,
    },
    /// A value was read whose own computation failed; `cause` is that
    /// failure, naming the graph and the sync point that computed it.
    #[error("{op}: computing the value failed: {cause}")]
    Failed {
        /// The reading call.
        op: String,
        /// The failure of the computation that was to produce the value.
        cause: Box<ExecError>,
    },
    /// A computation depends on a value whose computation failed earlier:
    /// it was not run. `cause` is the earlier failure, naming its own graph
    /// and sync point.
    #[error("{op}: depends on a value whose computation failed earlier: {cause}")]
    Poisoned {
        /// The syncing or reading call (or the execution) of the dependent
        /// computation.
        op: String,
        /// The earlier failure.
        cause: Box<ExecError>,
    },
    /// Shadow validation (`LAZULI_VALIDATE=cpu`, [`crate::Device::set_validate`])
    /// found a kernel whose outputs disagree with the CPU reference backend.
    #[error("shadow validation: kernel {kernel} disagrees with the CPU reference\n{report}")]
    Validation {
        /// The first disagreeing kernel (or segment, for backends that do
        /// not list their kernels).
        kernel: String,
        /// Where and by how much, the kernel's IR nodes with their source
        /// locations, and its generated source.
        report: String,
    },
    /// A malformed `LAZULI_*` configuration value (see [`crate::config`]):
    /// a device created with one fails every compilation with it.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A failure outside the engine met by a library helper built on it
    /// (reading or writing a file, a malformed file), kept with its cause.
    #[error("{op}: {source}")]
    External {
        /// The helper (e.g. "serialize").
        op: String,
        /// The cause.
        #[source]
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A misuse of the API that is not a shape or dtype problem.
    #[error("{op}: {detail}")]
    Invalid {
        /// The call.
        op: String,
        /// What is wrong.
        detail: String,
    },
}

/// Result alias of the executor.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;
