//! What the tensor API and the runtime both use: configuration from the
//! environment (`config`), errors (`error`), process-wide metrics
//! (`metrics`), warnings about the program (`warn`), the timeline and
//! reading it back (`timeline`, `trace_summary`), and what differs in a
//! browser tab (`platform`).

pub mod config;
pub mod error;
pub mod metrics;
pub mod platform;
pub mod timeline;
pub mod trace_summary;
pub mod warn;
