//! [`OnnxError`]: everything loading or running an ONNX model can report,
//! each naming the node, tensor or input it is about.

use crate::ExecError;
use thiserror::Error;

/// One node Lazuli cannot run, as [`OnnxError::Unsupported`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported {
    /// The node's name (or `#index` when it has none).
    pub node: String,
    /// The operator's domain (`""` is the default domain).
    pub domain: String,
    /// The operator type.
    pub op: String,
    /// The opset of the operator's domain the model imports.
    pub opset: i64,
    /// What is not supported (the operator, an attribute value, an input).
    pub reason: String,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let domain = if self.domain.is_empty() { "ai.onnx" } else { &self.domain };
        write!(f, "node {:?}: {domain}::{} (opset {}): {}", self.node, self.op, self.opset, self.reason)
    }
}

/// An error loading or running an ONNX model.
#[derive(Debug, Error)]
pub enum OnnxError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are not a valid ONNX protobuf (truncated, corrupted).
    #[error("not a valid ONNX model: {0}")]
    Decode(#[from] prost::DecodeError),
    /// A tensor (initializer, constant, attribute) is malformed: its data
    /// does not match its dims, its dims overflow, its external data is
    /// out of range or outside the model's folder.
    #[error("tensor {tensor:?}: {detail}")]
    Tensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        detail: String,
    },
    /// The graph is malformed: a cycle, a missing input, a duplicate
    /// output name, a node whose attributes break the operator's rules.
    #[error("invalid model: {0}")]
    Invalid(String),
    /// Nodes Lazuli cannot run, all listed at load.
    #[error("{} unsupported node(s):\n  {}", .0.len(), .0.iter().map(|u| u.to_string()).collect::<Vec<_>>().join("\n  "))]
    Unsupported(Vec<Unsupported>),
    /// An input given to `run` does not match the model.
    #[error("input {name:?}: {detail}")]
    Input {
        /// The input's name.
        name: String,
        /// What is wrong.
        detail: String,
    },
    /// A node failed while its ops were recorded (shapes that do not fit,
    /// a shape input that depends on tensor data...).
    #[error("node {node:?} ({op}): {detail}")]
    Node {
        /// The node's name.
        node: String,
        /// The operator type.
        op: String,
        /// What went wrong.
        detail: String,
    },
    /// The engine failed (a device error, at a sync).
    #[error(transparent)]
    Exec(#[from] ExecError),
}
