//! `lazuli-ir`: the intermediate representation of Lazuli.
//!
//! Element types ([`DType`]), shapes ([`Shape`]), the closed op set ([`Op`])
//! with type inference, the arena [`Graph`] with typed [`NodeId`]s,
//! structural hashing, verification ([`VerifiedGraph`]), text and DOT
//! dumps, optimization passes ([`passes`]) and fusion planning
//! ([`fusion`]).
//!
//! Architecture invariant: this crate knows nothing of wgpu, threads or IO.

mod dtype;
mod error;
pub mod fusion;
mod graph;
mod hash;
mod op;
pub mod passes;
pub mod philox;
pub mod quant;
pub mod semantics;
mod shape;

pub use dtype::{bf16_from_f64, f16_from_f64, DType, ScalarValue};
pub use error::IrError;
pub use graph::{describe, Graph, Node, NodeId, VerifiedGraph};
pub use hash::{stable_hash, StableHasher};
pub use op::{
    reduced_shape, ArgReduceOp, AttentionAttrs, AttentionMask, AttentionPart, BinaryOp, CollectiveOp, ConvAttrs, Op,
    OpKind, PadMode, PoolAttrs, PoolKind, RandomDist, ReduceOp, UnaryOp, ValueType,
};
pub use quant::QuantFormat;
pub use shape::Shape;
