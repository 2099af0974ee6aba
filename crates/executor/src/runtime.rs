//! What a sync runs: `trace` (the pending lazy nodes into one arena
//! graph), the device's `compile_cache`, `optimize` (the passes on a
//! miss), `plan` (partition into native, CPU-fallback and collective
//! segments, compile, run), `compile_ahead` (size variants compiled on
//! threads of their own), `explain` (why a graph recompiled), the shadow
//! run of `LAZULI_VALIDATE` (`shadow`, `shadow_run`), `collective` (the
//! all-reduces a plan starts), `fault` (test fault injection) and
//! `device` (the device, its worker thread, barriers and errors).

pub(crate) mod collective;
pub(crate) mod compile_ahead;
pub(crate) mod compile_cache;
pub(crate) mod device;
pub(crate) mod explain;
pub(crate) mod fault;
pub(crate) mod optimize;
pub(crate) mod plan;
pub(crate) mod shadow;
pub(crate) mod shadow_run;
pub(crate) mod trace;
