//! Lazuli: a lazy tensor engine for Rust on wgpu.
//!
//! Tensor ops are recorded lazily into an IR graph. At a sync point
//! (reading a value, [`sync`], [`Device::mark_step`]) the graph is hashed,
//! optimized, fused into compute kernels cached by graph hash, and run
//! asynchronously; ops the GPU backend cannot run go to a CPU fallback.
//! PyTorch's names work (`nn::Linear`, `optim::AdamW`, `cross_entropy`,
//! `state_dict`, `to_device`), with three habits of a lazy engine:
//!
//! - **Every op returns `Result`**: a wrong shape is an error at the line
//!   that recorded the op, naming the op (or layer) and the shapes.
//! - **A loop that carries values across iterations marks its step**: call
//!   [`Device::mark_step`] once per training step (the optimizer's
//!   `step()` does it for a loop that does not), so that each step is one
//!   graph compiled once. Reading a value (`item`, `to_vec`) is a sync
//!   point too.
//! - **[`Device::default()`](DeviceExt::default)** is the fastest real
//!   device: a hardware GPU adapter if there is one, else the CPU backend
//!   (`LAZULI_DEVICE=cpu|wgpu` chooses).
//!
//! # Quick example
//!
//! ```
//! use lazuli::prelude::*;
//!
//! fn main() -> lazuli::Result<()> {
//!     let dev = Device::default();
//!     let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0], [2, 2], &dev)?;
//!     let y = ((&x * 1.5)? + 0.5)?.relu()?.tanh()?; // recorded, nothing runs yet
//!     let s = y.sum(&[1], false)?;
//!     lazuli::sync(&[&y, &s])?; // one graph, fused kernels
//!     println!("{:?} {:?}", y.to_vec::<f32>()?, s.to_vec::<f32>()?);
//!     Ok(())
//! }
//! ```
//!
//! # Training
//!
//! A model is a struct of layers with `#[derive(Module)]`; its parameters
//! go to an optimizer; each step is forward, `backward`, `step` and one
//! [`Device::mark_step`]:
//!
//! ```
//! use lazuli::nn::{self, Linear, Module, ModuleExt};
//! use lazuli::optim::{AdamW, Optimizer};
//! use lazuli::prelude::*;
//!
//! #[derive(Module)]
//! struct Mlp {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! impl Mlp {
//!     fn forward(&self, x: &Tensor) -> lazuli::Result<Tensor> {
//!         self.fc2.forward(&self.fc1.forward(x)?.relu()?)
//!     }
//! }
//!
//! fn main() -> lazuli::Result<()> {
//!     let dev = Device::default();
//!     dev.manual_seed(0);
//!     let model = Mlp { fc1: Linear::new(2, 16, &dev)?, fc2: Linear::new(16, 1, &dev)? };
//!     let mut opt = AdamW::new(model.parameters(), 0.05);
//!     let x = Tensor::from_slice(&[0f32, 0., 0., 1., 1., 0., 1., 1.], [4, 2], &dev)?;
//!     let y = Tensor::from_slice(&[0f32, 1., 1., 0.], [4, 1], &dev)?; // the prediction's shape
//!     for step in 0..200 {
//!         opt.zero_grad();
//!         let loss = nn::mse(&model.forward(&x)?, &y)?;
//!         loss.backward()?;
//!         opt.step()?;
//!         dev.mark_step()?; // forward + backward + update: one graph, compiled once
//!         if step % 50 == 0 {
//!             println!("step {step}: loss {:.4}", loss.item::<f32>()?);
//!         }
//!     }
//!     model.save_state_dict(std::env::temp_dir().join("lazuli-doc-mlp.safetensors"))?;
//!     Ok(())
//! }
//! ```
//!
//! # Inference
//!
//! Evaluation mode (dropout off, batch norm on its running statistics),
//! no gradient tracking, and one read per batch; the layers' parameters
//! were computed once (the first sync materializes them), so each forward
//! runs the model's kernels only:
//!
//! ```
//! use lazuli::nn::{self, Module, ModuleExt};
//! use lazuli::prelude::*;
//!
//! fn main() -> lazuli::Result<()> {
//!     let dev = Device::default();
//!     let model = nn::Sequential::new()
//!         .add(nn::Linear::new(4, 8, &dev)?)
//!         .add(nn::Activation::Relu)
//!         .add(nn::Linear::new(8, 3, &dev)?);
//!     // model.load_state_dict("model.safetensors")?; // trained weights
//!     model.eval();
//!     for batch in 0..3 {
//!         let x = Tensor::from_slice(&[batch as f32; 8], [2, 4], &dev)?;
//!         let classes = lazuli::no_grad(|| model.forward(&x)?.argmax(-1, false))?;
//!         println!("batch {batch}: {:?}", classes.to_vec::<i32>()?); // argmax gives i32
//!     }
//!     Ok(())
//! }
//! ```
//!
//! # Where things are
//!
//! - Tensors and devices: [`Tensor`] (ops, reads, [`Tensor::to_device`]),
//!   [`Device`] with [`DeviceExt`] (`Device::default()`, `cpu()`,
//!   `wgpu()`), [`sync`], [`DType`], [`Shape`]; [`prelude`] has them.
//! - Models: [`nn`] (the [`Module`](nn::Module) trait and its derive,
//!   layers, losses), [`optim`] (SGD, Adam, AdamW, schedulers),
//!   [`autograd`] and [`no_grad`], [`amp`] (mixed precision).
//! - Data and files: [`data`] (`DataLoader`), [`serialize`]
//!   (safetensors), [`checkpoint`] (resumable training), [`onnx`].
//! - Seeing what runs: [`metrics`] (counters, timers, the report),
//!   [`debug`] (IR, DOT, generated kernels), [`timeline`] (Chrome
//!   traces), [`warn`] (the warnings given), [`forms`] (the wgpu kernel
//!   forms, for tuning and tests).
//! - Errors: every call returns [`Result`], whose [`ExecError`] prints as
//!   a readable chain with `{}` and `{:?}` alike (so `?` out of `main`
//!   shows the message).
//!
//! This crate is the facade: it wires the backends (`lazuli-cpu`,
//! `lazuli-wgpu`) to the executor and re-exports the public API: tensors
//! and devices at the root, [`nn`], [`optim`], [`data`], [`serialize`],
//! [`checkpoint`], [`amp`], `distributed` (cargo feature `mpi`), [`onnx`]
//! and the wgpu backend's settings in [`wgpu`]. It carries no tools: the
//! `lazuli` command (demo, benchmarks, conformance runs, trace reports) is
//! the `lazuli-cli` crate, the demo's and benchmarks' models are
//! `lazuli-models`.

pub mod amp;
pub mod checkpoint;
pub mod data;
mod device;
#[cfg(feature = "mpi")]
pub mod distributed;
pub mod llm;
pub mod nn;
pub mod onnx;
pub mod optim;
pub mod serialize;
pub mod wgpu;

pub use device::{adapters, wgpu_async, CpuDeviceOptions, DefaultChoice, DeviceExt, DeviceKind, WgpuDeviceOptions};
pub use lazuli_executor::autograd;
pub use lazuli_executor::{
    debug, einsum, metrics, platform, sync, sync_async, timeline, trace_summary, warn, Backend, BackendError,
    BackendKind, CallSite, Collective, CollectiveError, Device, Element, ExecError, HostRng, IndexError,
    PendingCollective, PrintOptions, Result, RngState, Tensor, TensorState, COMPILE_AHEAD_DEPTH, SORT_MAX_ROW,
    TOPK_SELECT_MAX_K,
};
pub use lazuli_executor::{is_grad_enabled, no_grad, set_grad_enabled, NoGradGuard};
pub use lazuli_ir as ir;
pub use lazuli_ir::{DType, ScalarValue, Shape};
// The kernel forms at the crate root, as before `wgpu::forms` existed:
// kept so that code naming `lazuli::KernelForms` compiles, hidden from the
// docs (see CHANGELOG.md).
#[doc(hidden)]
pub use lazuli_wgpu::codegen::forms::*;
pub use lazuli_wgpu::validate_wgsl;

/// The kernel forms under the name an earlier change gave them
/// (`lazuli::forms`): kept so that code naming it compiles, hidden from
/// the docs; they are [`wgpu::forms`] (see CHANGELOG.md).
#[doc(hidden)]
pub use crate::wgpu::forms;

/// The names most programs need: `use lazuli::prelude::*;`.
pub mod prelude {
    pub use crate::nn::{Module, ModuleExt};
    pub use crate::{sync, DType, Device, DeviceExt, Shape, Tensor, TensorState};
}
