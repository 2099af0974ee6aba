//! What the executor does differently in a browser tab (`wasm32`), in one
//! place.
//!
//! A browser tab's main thread has no threads to spawn and must never
//! block: a blocked tab freezes, and the work it waits for (a WebGPU
//! buffer mapping, say) only completes when control returns to the event
//! loop. So on `wasm32` the device runs every plan on the syncing caller
//! (no worker thread: [`WORKER_THREAD`] is false), backends submit work
//! without waiting for it, and reading a value goes through the `_async`
//! reads (`Tensor::to_vec_async`, `Device::wait_async`, `sync_async`),
//! which yield to the event loop while the device works. A blocking read
//! that would have to wait returns `BackendError::WouldBlock` naming the
//! asynchronous form instead of hanging the tab.
//!
//! `std::time::Instant` panics on `wasm32-unknown-unknown`; [`Instant`] is
//! the one clock every crate uses (`web-time`'s on the web, std's
//! elsewhere). A tab has no environment either: listing it panics there,
//! so [`env_names`] is empty (single variables read as unset).

use std::future::Future;
use std::pin::Pin;

/// The monotonic clock of timers, spans and metrics.
#[cfg(not(target_arch = "wasm32"))]
pub use std::time::Instant;
/// The monotonic clock of timers, spans and metrics.
#[cfg(target_arch = "wasm32")]
pub use web_time::Instant;

/// True where the device runs plans on a worker thread of its own; false
/// in a browser tab, where the syncing caller runs them (and backends do
/// not wait for the device there).
pub const WORKER_THREAD: bool = cfg!(not(target_arch = "wasm32"));

/// True on targets where a thread may block on the device (a barrier, a
/// buffer mapping); false in a browser tab.
pub const CAN_BLOCK: bool = cfg!(not(target_arch = "wasm32"));

/// A boxed future that need not be `Send` (WebGPU's futures are not), as
/// the asynchronous methods of the object-safe `Backend` trait return.
pub type LocalFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The names of the process environment's variables (none in a browser
/// tab, where `std::env::vars_os` panics).
pub fn env_names() -> Vec<String> {
    #[cfg(not(target_arch = "wasm32"))]
    return std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()).collect();
    #[cfg(target_arch = "wasm32")]
    Vec::new()
}
