//! ONNX conformance: run the ONNX backend node tests (converted to JSON in
//! `shared/conformance/onnx`) against Lazuli.
//!
//! [`case`] parses the files into typed cases; [`map`] lowers one ONNX node
//! onto Lazuli ops through the public [`crate::Tensor`] API (composites
//! where ONNX has no single Lazuli op), answering a typed "unsupported:
//! reason" for what Lazuli cannot express; [`runner`] runs every case on
//! each device, compares with the suite's tolerances and prints the per-op
//! table that `tests/conformance.rs` and `lazuli conformance` show.
//!
//! The mapping lives here, outside the engine: no engine code knows about
//! ONNX.

pub mod case;
pub mod map;
pub mod runner;

pub use case::{load_dir, load_file, Attr, Case, CaseError, OpFile, TensorData};
pub use map::{dtype_from_onnx, einsum, lower, MapError, SUPPORTED_OPS};
pub use runner::{default_dir, run_case, run_dir, run_files, tolerance, CaseResult, Counts, Outcome, Report};
