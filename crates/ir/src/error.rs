//! IR errors: a bad shape, axis or dtype found when a node is made.

use crate::{DType, Shape};
use thiserror::Error;

/// An error found while recording or verifying IR. Every variant names the
/// op and the shapes or dtypes involved, so the message alone explains it.
#[derive(Clone, Error, PartialEq)]
pub enum IrError {
    /// Operand shapes do not broadcast.
    #[error("{op}: shapes {lhs} and {rhs} do not broadcast")]
    Broadcast {
        /// The op.
        op: String,
        /// Left shape.
        lhs: Shape,
        /// Right shape.
        rhs: Shape,
    },
    /// Operand dtypes do not agree or are not allowed for the op.
    #[error("{op}: dtype mismatch: {detail} (got {got})")]
    DType {
        /// The op.
        op: String,
        /// What was expected.
        detail: String,
        /// The operand dtypes, comma separated.
        got: String,
    },
    /// An axis outside the operand's rank.
    #[error("{op}: axis {axis} is out of range for shape {shape} (rank {rank})")]
    Axis {
        /// The op.
        op: String,
        /// The axis as given.
        axis: isize,
        /// The operand shape.
        shape: Shape,
        /// Its rank.
        rank: usize,
    },
    /// Any other shape error; the message says what was expected.
    #[error("{op}: {detail}")]
    Shape {
        /// The op.
        op: String,
        /// What is wrong, with the shapes involved.
        detail: String,
    },
    /// Wrong number of operands for an op.
    #[error("{op}: expected {expected} operands, got {got}")]
    Arity {
        /// The op.
        op: String,
        /// Expected operand count (as text: "2", "at least 1").
        expected: String,
        /// Given operand count.
        got: usize,
    },
    /// A graph failed verification (a bug in a pass or in graph building).
    #[error("graph verification failed at node {node}: {detail}")]
    Verify {
        /// The node index.
        node: usize,
        /// What is wrong.
        detail: String,
    },
}

/// `Debug` prints the message (what `?` out of `main` shows), not the
/// fields: every variant's message names the op, shapes and dtypes.
impl std::fmt::Debug for IrError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl IrError {
    pub(crate) fn shape(op: &str, detail: impl Into<String>) -> IrError {
        IrError::Shape { op: op.to_string(), detail: detail.into() }
    }

    pub(crate) fn dtype(op: &str, detail: impl Into<String>, got: &[DType]) -> IrError {
        let got = got.iter().map(|d| d.name()).collect::<Vec<_>>().join(", ");
        IrError::DType { op: op.to_string(), detail: detail.into(), got }
    }
}
