//! The device side: the adapter and device a backend opened, and what
//! executing on it takes. `context` holds the device, its queue, the
//! buffer pool and the limits everything reads; below it `platform`
//! (what differs on the browser's WebGPU), [`pool`] (the caching buffer
//! allocator), [`binds`] (bind groups and the allocation history) and
//! `timestamps` (the readback of resolved timestamp pairs); above it
//! `execute` (one execution: bindings, one compute pass, one submit),
//! `uniforms` (the lifted scalars an execution binds), `transfer`
//! (uploads and readbacks) and `profile` (per-launch profiles).
//!
//! Nothing here compiles or caches kernels ([`crate::compile`]); the
//! device side reads compiled plans ([`crate::compile::executable`]) and
//! runs them.

// Native adapter enumeration (the web has one adapter, asked for
// asynchronously: see `platform`).
#[cfg(not(target_arch = "wasm32"))]
pub mod adapter;
pub mod binds;
pub(crate) mod context;
pub(crate) mod execute;
pub(crate) mod platform;
pub mod pool;
pub(crate) mod profile;
pub(crate) mod timestamps;
pub(crate) mod transfer;
pub(crate) mod uniforms;
