//! `lazuli-executor`: lazy tensors, sync, the compile cache, asynchronous
//! scheduling, device barriers, metrics and the object-safe [`Backend`]
//! trait.
//!
//! Data flow of one sync: ops on a [`Tensor`] record immutable lazy nodes
//! (`lazy`); a sync point traces the pending nodes into one arena graph
//! (`trace`), looks its structural hash up in the device's compile cache or
//! optimizes, partitions (native / CPU fallback) and compiles it (`plan`),
//! installs placeholders and hands the plan to the device worker
//! (`device`), which fills them; reading a value waits on its cell.
//!
//! Architecture invariants: the executor knows backends only through
//! [`Backend`]; only the executor decides when to sync; backends never see a
//! lazy tensor.

mod ahead;
pub mod autocast;
pub mod autograd;
pub mod backend;
mod collective;
mod compile_cache;
mod compose;
pub mod config;
pub mod debug;
mod device;
mod einsum;
mod element;
pub mod error;
mod explain;
mod fault;
mod lazy;
pub mod metrics;
mod ops;
mod optimize;
mod plan;
pub mod platform;
mod print;
mod random;
mod site;
mod sort;
mod tensor;
pub mod timeline;
mod trace;
pub mod trace_summary;
mod validate;
pub mod warn;

pub use ahead::DEPTH as COMPILE_AHEAD_DEPTH;
pub use autograd::{checkpoint, is_grad_enabled, no_grad, set_grad_enabled, NoGradGuard};
pub use backend::{
    Backend, BackendError, BackendKind, Buffer, CompileHints, DeviceStorage, Executable, IndexError, KernelInfo,
    LaunchCost,
};
pub use collective::{Collective, CollectiveError, PendingCollective};
pub use device::{Device, DeviceSettings, RngState};
pub use einsum::einsum;
pub use element::{from_bytes, read_scalar, scalar_bytes, to_bytes, Element};
pub use error::{ExecError, Result};
pub use explain::CompileEntry;
pub use ops::{ReshapeDims, TensorIndex};
pub use print::PrintOptions;
pub use random::{splitmix64, HostRng};
pub use site::CallSite;
pub use sort::{SORT_MAX_ROW, TOPK_SELECT_MAX_K};
pub use tensor::{sync, sync_async, Tensor, TensorState};
