//! `lazuli-executor`: lazy tensors, sync, the compile cache, asynchronous
//! scheduling, device barriers, metrics and the object-safe [`Backend`]
//! trait.
//!
//! Three rooms, by owner: `api` (the tensor API a program calls: the
//! `Tensor` handle, its ops and compositions, autograd, autocast,
//! printing, the recording form `lazy`), `runtime` (what a sync runs:
//! `trace`, the compile cache, `optimize`, `plan`, `compile_ahead`,
//! `explain`, the shadow run of `LAZULI_VALIDATE`, collectives, the
//! device and its worker) and `support` (configuration, errors, metrics,
//! the timeline, platform differences); `backend` is the contract between
//! the executor and a device.
//!
//! Data flow of one sync: ops on a [`Tensor`] record immutable lazy nodes
//! (`api::lazy`); a sync point traces the pending nodes into one arena
//! graph (`runtime::trace`), looks its structural hash up in the device's
//! compile cache or optimizes, partitions (native / CPU fallback) and
//! compiles it (`runtime::plan`), installs placeholders and hands the plan
//! to the device worker (`runtime::device`), which fills them; reading a
//! value waits on its cell.
//!
//! Architecture invariants: the executor knows backends only through
//! [`Backend`]; only the executor decides when to sync; backends never see a
//! lazy tensor.

mod api;
pub mod backend;
mod runtime;
mod support;

pub use api::{autocast, autograd, debug};
pub use support::{config, error, metrics, platform, timeline, trace_summary, warn};

pub use api::autograd::{checkpoint, is_grad_enabled, no_grad, set_grad_enabled, NoGradGuard};
pub use api::einsum::einsum;
pub use api::element::{from_bytes, read_scalar, scalar_bytes, to_bytes, Element};
pub use api::ops::{ReshapeDims, TensorIndex};
pub use api::print::PrintOptions;
pub use api::random::{splitmix64, HostRng};
pub use api::site::CallSite;
pub use api::sort::{SORT_MAX_ROW, TOPK_SELECT_MAX_K};
pub use api::tensor::{sync, sync_async, Tensor, TensorState};
pub use backend::{
    Backend, BackendError, BackendKind, Buffer, CompileHints, DeviceStorage, Executable, IndexError, KernelInfo,
    LaunchCost, LaunchSample,
};
pub use runtime::collective::{Collective, CollectiveError, PendingCollective};
pub use runtime::compile_ahead::DEPTH as COMPILE_AHEAD_DEPTH;
pub use runtime::device::{Device, DeviceSettings, RngState};
pub use runtime::explain::CompileEntry;
pub use support::error::{ExecError, Result};
