//! Lazuli: a lazy tensor engine for Rust on wgpu.
//!
//! Tensor ops are recorded lazily into an IR graph. At a sync point
//! (reading a value, [`sync`], [`Device::mark_step`]) the graph is hashed,
//! optimized, fused into WGSL compute kernels cached by graph hash, and run
//! asynchronously; ops the GPU backend cannot run go to a CPU fallback.
//!
//! ```no_run
//! use lazuli::prelude::*;
//! # fn main() -> lazuli::Result<()> {
//! let dev = Device::default();
//! let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0], [2, 2], &dev)?;
//! let y = ((&x * 1.5)? + 0.5)?.relu()?.tanh()?;
//! println!("{:?}", y.to_vec::<f32>()?);
//! # Ok(()) }
//! ```
//!
//! This crate is the facade: it wires the backends (`lazuli-cpu`,
//! `lazuli-wgpu`) to the executor and re-exports the public API.

pub mod amp;
pub mod bench;
pub mod checkpoint;
pub mod data;
mod device;
#[cfg(feature = "mpi")]
pub mod distributed;
pub mod generate;
pub mod llm;
pub mod nn;
pub mod onnx;
pub mod optim;
pub mod serialize;
pub mod train;

pub use device::{adapters, wgpu_async, CpuDeviceOptions, DeviceExt, DeviceKind, WgpuDeviceOptions};
pub use lazuli_executor::autograd;
pub use lazuli_executor::{
    debug, einsum, metrics, platform, sync, sync_async, timeline, trace_summary, Backend, BackendError, BackendKind,
    Collective, CollectiveError, Device, Element, ExecError, HostRng, IndexError, PendingCollective, PrintOptions,
    Result, RngState, Tensor, TensorState, COMPILE_AHEAD_DEPTH, SORT_MAX_ROW, TOPK_SELECT_MAX_K,
};
pub use lazuli_executor::{is_grad_enabled, no_grad, set_grad_enabled, NoGradGuard};
pub use lazuli_ir as ir;
pub use lazuli_ir::{DType, ScalarValue, Shape};
/// The kernel forms (`KernelForms` and one enum per kernel family), whole,
/// so that a new form needs no change here.
pub use lazuli_wgpu::codegen::forms::*;
pub use lazuli_wgpu::validate_wgsl;

/// The names most programs need: `use lazuli::prelude::*;`.
pub mod prelude {
    pub use crate::nn::{Module, ModuleExt};
    pub use crate::{sync, DType, Device, DeviceExt, Shape, Tensor, TensorState};
}
