//! `lazuli-executor`: lazy tensors, sync, the compile cache, asynchronous
//! scheduling, device barriers, metrics and the object-safe [`Backend`]
//! trait.
//!
//! Architecture invariant: the executor knows backends only through
//! [`Backend`]; only the facade wires concrete backends together.

pub mod backend;
pub mod metrics;

pub use backend::{Backend, BackendError, BackendKind, Buffer, DeviceStorage, Executable};
