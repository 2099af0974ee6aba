//! The `lazuli` command line and the tools behind it, apart from the
//! library a program links (`lazuli`):
//!
//! - [`cli`]: the command line on `clap` ([`Cli`], one [`Command`] per
//!   command, with `--help` for each) and [`main`], which parses it, sets
//!   up logging and runs the command;
//! - [`commands`]: one module per command (`info`, `demo`, `dump`,
//!   `conformance`, `bench`, `generate`, `trace`, `completions`), each an
//!   `Args` struct and its `run`;
//! - [`conformance`]: the ONNX conformance suite's cases and runner
//!   (`lazuli conformance`, `tests/conformance.rs`);
//! - [`bench`]: the benchmark harness (the workloads of `docs/workloads.md`,
//!   their baselines with the hand-written WGSL kernels of `shaders/`, the
//!   per-kernel profile), used by `lazuli bench`, the criterion benches
//!   (`benches/workloads.rs`) and the kernel examples (`examples/`).
//!
//! The demo's, G8's and generation's models are `lazuli-models`'s, which
//! the browser page and the facade's tests and examples share.
//!
//! To add a command `lazuli NAME`: write `src/commands/NAME.rs` with a
//! `#[derive(clap::Args)] pub struct Args` (its fields' doc comments are
//! the `--help` text) and `pub fn run(args: Args) -> Result<(), String>`,
//! declare it in `src/commands/mod.rs`, and add a variant (its doc comment
//! is the command's one-line help) with its arm in `Command::run` in
//! `src/cli.rs`. The completion scripts follow by themselves.

pub mod bench;
pub mod cli;
pub mod commands;
pub mod conformance;

pub use cli::{main, Cli, Command};
