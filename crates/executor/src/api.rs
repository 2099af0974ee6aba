//! The tensor API a program calls: the [`Tensor`](tensor::Tensor) handle
//! (`tensor`), its op methods (`ops`) and the ops composed from them
//! (`compose`, `einsum`, `sort`, `random`), reverse-mode autodiff
//! (`autograd`), mixed precision (`autocast`), printing (`print`), host
//! element types (`element`), the call site ops are attributed to
//! (`site`), introspection without syncing (`debug`) and
//! the recording form of the IR that ops build (`lazy`). Everything here
//! records; nothing runs until the runtime (`crate::runtime`) syncs.

pub mod autocast;
pub mod autograd;
pub(crate) mod compose;
pub mod debug;
pub(crate) mod einsum;
pub(crate) mod element;
pub(crate) mod lazy;
pub(crate) mod ops;
pub(crate) mod print;
pub(crate) mod random;
pub(crate) mod site;
pub(crate) mod sort;
pub(crate) mod tensor;
