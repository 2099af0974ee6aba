//! `lazuli-wgpu`: the wgpu backend of Lazuli.
//!
//! The crate is three rooms and the backend that ties them together:
//! [`codegen`] (a kernel to WGSL, pure: no device), [`compile`] (a graph
//! to a compiled plan: its stages, pipelines, caches, the tuner and the
//! second tier), [`device`] (the device a backend opened and executing on
//! it) and [`rewrite`] (the two passes that edit generated text);
//! [`runtime`] is the `Backend` implementation, [`options`] its options.
//!
//! Pipeline: [`lazuli_ir::fusion::plan`] cuts a verified graph into kernels;
//! [`codegen::schedule()`] decides how each is written and
//! [`codegen::lower_scheduled`] writes it as WGSL (deterministically,
//! shapes baked in, lifted scalars in a uniform buffer);
//! [`rewrite::size_families`] lets kernels of graphs that differ only in
//! sizes share one pipeline, reading the sizes that vary from a small
//! buffer, and a plan whose sizes recur gets static kernels again,
//! compiled in the background ([`compile::specialize`]);
//! [`validate_wgsl`] checks it with naga before a pipeline is created;
//! pipelines are cached by the hash of their source
//! ([`compile::pipeline`]); buffers come from a caching allocator sized to
//! the device ([`device::pool`]); one execution encodes all kernels into
//! one compute pass, submits and waits ([`runtime`]), with the bind groups
//! and uniform buffer of each compiled plan made once and reused while its
//! buffers recur ([`device::binds`]). Independent elementwise kernels of
//! any shapes share one multi-tensor dispatch ([`codegen::multi`]). A
//! tensor larger than one storage binding is one buffer bound as several
//! windows ([`codegen::window`]), which kernels reach through the one
//! buffer-access layer every family loads and stores through
//! ([`codegen::access`]).
//!
//! Supported dtypes: `f32`, `i32`, `u32` and `bool` (one `u32` per element
//! on the device; upload and download convert to one-byte bools), and `f16`
//! and `bf16` (2 bytes per element, computed in f32 registers:
//! [`codegen::access`])
//! for elementwise ops, views, reductions, softmax and matmul. Nodes of any
//! other dtype (`f64`, `i64`, the narrow integers), and the other ops of
//! f16/bf16, are reported unsupported and run on the CPU fallback.
//!
//! Supported ops: every op (`Conv2d` in f32, [`codegen::conv`]). Gather
//! and scatter-add check every index they read: a kernel that finds one
//! out of range claims its error slot (a small storage binding, one per
//! checking kernel of an execution, zeroed and read back within the
//! execution's one submission and wait), and the execution fails with
//! `BackendError::IndexOutOfRange` naming the op, the index and the dim,
//! never a clamped value ([`codegen::index`]). Pooling and its gradient
//! are kernels of their own ([`codegen::pool`]). Attention parts that
//! would bind more storage buffers than the adapter allows (a masked
//! gradient under WebGPU's minimum of 8) run on the CPU fallback.
//!
//! Kernel forms ([`codegen::KernelForms`]): every kernel family has a form
//! for GPUs and one for software adapters, picked from the adapter type
//! (forced with `WgpuOptions::kernel_forms` or `LAZULI_KERNEL_FORMS`, so
//! tests prove both on lavapipe). GPU forms put adjacent lanes on adjacent
//! addresses and reuse data in workgroup memory and registers:
//! one vec4 per invocation for elementwise code (a 2-D dispatch past
//! 65535 workgroups; grid-stride only past that grid); reductions over contiguous rows by a
//! group of lanes per row with a tree in workgroup memory; softmax rows
//! held in registers by a group of lanes (read once, written once), long
//! rows online in two passes; row kernels (layer norm and hand-written
//! softmax in one kernel: reductions over the last axis folded with their
//! row-wise consumers); matmul in 64/128-wide tiles double-buffered
//! in workgroup memory with 4x4 to 8x8 register blocks per invocation and
//! vec4 operand loads (straight or transposed), the tile chosen by shape or
//! by bounded autotuning ([`compile::autotune`]). Software forms suit llvmpipe, which
//! runs each invocation as a CPU loop and splits every barrier into
//! coroutine steps: several consecutive vec4s per invocation, one
//! invocation per output or row, a barrier-free register-blocked matmul.
//! Matmul is batched and fuses its elementwise epilogue (bias, activation,
//! scaling, masks; several outputs) in every form. Fused attention
//! (`Op::Attention`, [`codegen::attention`]) never writes the scores: on
//! GPUs a workgroup per block of 64 queries (keys, for the key and value
//! gradients) walks the other side in tiles, 4x4 score blocks per
//! invocation in registers, online softmax, operand slices and
//! probabilities in workgroup memory, the tile fitted to the adapter's
//! workgroup memory; on software adapters one invocation per row with the
//! row in registers for head dims up to 32, tiled above. Indexed elementwise
//! kernels evaluate per output index (views as index math), with a
//! two-dimensional dispatch beyond 65535 workgroups; arg-reductions and
//! cumulative sums use one invocation per output line. Scatter-add gives
//! every output element one owner adding in index order (deterministic):
//! on GPUs a workgroup per block of rows scanning the index list staged in
//! workgroup memory, on llvmpipe an invocation per row and 16 columns.
//! Loop trip counts
//! stay under llvmpipe's per-invocation loop budget
//! ([`codegen::LLVMPIPE_LOOP_BUDGET`]). Pipelines skip wgpu's zero-fill of
//! workgroup memory: every kernel writes it before reading it.
//! Per-kernel GPU times come from timestamp queries
//! ([`WgpuBackend::set_profiling`]).
//!
//! Architecture invariant: this crate never sees a lazy tensor; it gets
//! verified graphs and buffers through `lazuli_executor::Backend`.

pub mod codegen;
pub mod compile;
pub mod device;
mod execute;
pub mod options;
pub mod rewrite;
pub mod runtime;

pub use codegen::forms;
pub use compile::executable::WgpuExecutable;
pub use compile::validate::validate_wgsl;
#[cfg(not(target_arch = "wasm32"))]
pub use device::adapter::list_adapters;
#[cfg(target_arch = "wasm32")]
pub use device::platform::list_adapters;
pub use device::profile::LaunchSample;
pub use execute::STREAM_FIRST_LAUNCHES;
pub use options::{kernel_forms, WgpuOptions};
pub use runtime::WgpuBackend;
