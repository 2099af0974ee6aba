//! The device side: the adapter and device a backend opened, and what
//! running on it takes. `context` holds the device, its queue, the buffer
//! pool and the limits everything reads; below it `platform` (what
//! differs on the browser's WebGPU), [`pool`] (the caching buffer
//! allocator), [`binds`] (bind groups and the allocation history) and
//! `timestamps` (the readback of resolved timestamp pairs); above it
//! `uniforms` (the lifted scalars an execution binds), `transfer`
//! (uploads and readbacks) and `profile` (per-launch profiles).
//!
//! Nothing here compiles or caches kernels ([`crate::compile`], which
//! stands on the device side) nor runs a compiled plan (`crate::execute`,
//! above both).

// Native adapter enumeration (the web has one adapter, asked for
// asynchronously: see `platform`).
#[cfg(not(target_arch = "wasm32"))]
pub mod adapter;
pub mod binds;
pub(crate) mod context;
pub(crate) mod platform;
pub mod pool;
pub(crate) mod profile;
pub(crate) mod timestamps;
pub(crate) mod transfer;
pub(crate) mod uniforms;
