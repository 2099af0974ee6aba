//! The ONNX conformance suite: the ONNX backend node tests converted to
//! JSON (`shared/conformance/onnx`, or `LAZULI_CONFORMANCE_DIR`), each
//! case run as a one-node `lazuli::onnx::Model` (the path whole models
//! take) on the chosen devices. [`case`] parses the files, [`runner`]
//! runs the cases and prints the per-op table (`lazuli conformance`,
//! `tests/conformance.rs`).

pub mod case;
pub mod runner;

pub use case::{load_dir, load_file, Case, CaseError, OpFile, TensorData};
pub use runner::{default_dir, run_case, run_dir, run_files, tolerance, CaseResult, Counts, Outcome, Report};
