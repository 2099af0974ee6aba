//! The models Lazuli's tools, browser page, examples and tests share; not
//! part of the library a program links (`lazuli`), which carries no demo
//! or benchmark code:
//!
//! - [`digits`]: the 8x8 digits dataset (shipped in `data/digits` of this
//!   crate), an MLP and a LeNet-style CNN, and the training loop behind
//!   `lazuli demo` and the browser page;
//! - [`gpt`]: the GPT training step of workload G8 (`lazuli bench G8`),
//!   also the model of the GPT example and of several tests;
//! - [`generate`]: greedy generation with a small GPT, a growing context
//!   beside a fixed window (`lazuli generate`).
//!
//! Rejected alternative: keeping them in the facade (`lazuli::train`,
//! `lazuli::bench::Gpt`, `lazuli::generate`), where they were: a user's
//! build compiled ~1,300 lines of demo code and the facade's API mixed
//! library types with a demo's configuration. Nor in the CLI crate: the
//! browser page (wasm32) and the facade's own tests and examples use them,
//! and none of those can link a command-line binary.

pub mod digits;
pub mod generate;
pub mod gpt;
