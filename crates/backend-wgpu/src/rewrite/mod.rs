//! The two passes that edit a kernel's generated text, and the one
//! tokenizer they share (`wgsl_text`): size families
//! ([`size_families`]: kernels of graphs that differ only in sizes share
//! one source, their differing literals read from a sizes buffer;
//! inherently a comparison of two generated sources) and fault injection
//! for tests (`fault`). Every other form of a kernel (windows, f16 and
//! bf16 storage) is written by lowering itself, through
//! `codegen::access`.

pub(crate) mod fault;
pub mod size_families;
pub(crate) mod wgsl_text;
