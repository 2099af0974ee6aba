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
//! unsupported) and `Gather`, which the executor runs on the CPU fallback
//! because a kernel cannot report an out-of-range index.
//!
//! Kernel forms: elementwise kernels whose values are all full-size or
//! single elements are straight-line code over vec4 loads and
//! stores, several vectors per invocation; others evaluate per output index
//! (views as index math), with a two-dimensional dispatch beyond 65535
//! workgroups. Softmax is one kernel: rows split over cooperating
//! invocations with workgroup tree reductions on GPUs, one invocation per
//! row (online max and sum, vec4 accesses) on software adapters. Matmul is
//! batched and fuses its elementwise epilogue (bias, activation, scaling,
//! masks; several outputs): on GPUs 64 x 64 tiles staged in workgroup
//! memory, on software adapters a barrier-free form with register blocks of
//! up to 16 x 8, workgroup-uniform rows of A and vec4 operand reads
//! (`LowerLimits::tiled_matmul`). Few long reductions use one workgroup per
//! output with a tree in workgroup memory, the rest one invocation per
//! output (loops unrolled); arg-reductions and cumulative sums use one
//! invocation per output line. Loop trip counts stay under llvmpipe's
//! per-invocation loop budget ([`codegen::LLVMPIPE_LOOP_BUDGET`]).
//! [`baseline`] runs hand-written WGSL on the same device for benchmarks;
//! per-kernel GPU times come from timestamp queries
//! ([`WgpuBackend::set_profiling`]).
//!
//! Architecture invariant: this crate never sees a lazy tensor; it gets
//! verified graphs and buffers through `lazuli_executor::Backend`.

pub mod adapter;
pub mod baseline;
pub mod codegen;
mod fault;
pub mod pipeline;
pub mod pool;
pub mod runtime;
pub mod validate;

pub use adapter::list_adapters;
pub use runtime::{WgpuBackend, WgpuExecutable, WgpuOptions};
pub use validate::validate_wgsl;
