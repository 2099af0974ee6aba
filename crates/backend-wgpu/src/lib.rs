//! `lazuli-wgpu`: the wgpu backend of Lazuli.
//!
//! Pipeline: [`lazuli_ir::fusion::plan`] cuts a verified graph into kernels;
//! [`codegen::lower`] writes each as WGSL (deterministically, shapes baked
//! in, lifted scalars in a uniform buffer); [`validate::validate_wgsl`]
//! checks it with naga before a pipeline is created; pipelines are cached
//! by the hash of their source ([`pipeline`]); buffers come from a bounded,
//! size-bucketed pool ([`pool`]); one execution encodes all kernels into
//! one command encoder, submits and waits ([`runtime`]).
//!
//! Supported dtypes: `f32`, `i32`, `u32` and `bool` (one `u32` per element
//! on the device; upload and download convert to one-byte bools). Nodes of
//! any other dtype (`f16`, `f64`, `i64`, the narrow integers) are reported
//! unsupported and run on the CPU fallback.
//!
//! Supported ops: every op except `Conv2d` and `Pool` (reported
//! unsupported). Reductions, arg-reductions, softmax and cumulative sums
//! use one invocation per output element or line; matmul uses one
//! invocation per output element looping over K.
//!
//! Architecture invariant: this crate never sees a lazy tensor; it gets
//! verified graphs and buffers through `lazuli_executor::Backend`.

pub mod adapter;
pub mod codegen;
pub mod pipeline;
pub mod pool;
pub mod runtime;
pub mod validate;

pub use adapter::list_adapters;
pub use runtime::{WgpuBackend, WgpuExecutable, WgpuOptions};
pub use validate::validate_wgsl;
