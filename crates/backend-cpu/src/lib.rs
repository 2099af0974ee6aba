//! `lazuli-cpu`: the CPU reference backend. Every op of the IR in plain
//! Rust, over every dtype, with the exact semantics written on the `Op`
//! variants; the fallback for nodes a GPU backend cannot run, the oracle of
//! differential tests, and the default when no adapter exists.
//!
//! It is also an engine: [`CpuBackend::compile`] turns a verified graph
//! into a program of fused elementwise loops (blocked, vectorizable,
//! split over a rayon pool when large) and interpreted nodes ([`exec`]);
//! [`CpuBackend::execute`] runs it, freeing each intermediate after its
//! last use. Reductions, softmax and matmul have contiguous fast paths. Storage is [`CpuStorage`]: typed
//! vectors per dtype ([`CpuData`]).
//!
//! Architecture invariant: nothing here panics on data. A bad gather index
//! or a mismatched input is a [`BackendError`]; only a broken internal
//! contract (an unverified graph) may panic.

mod conv;
mod elem;
mod elementwise;
pub mod exec;
mod fastmath;
mod fused;
mod layout;
mod matmul;
mod movement;
mod reduce;
mod source;
mod storage;
mod stream;

pub use exec::CpuExecutable;
pub use storage::{CpuData, CpuStorage};

use lazuli_executor::{Backend, BackendError, BackendKind, Buffer, Executable};
use lazuli_ir::{Node, ScalarValue, ValueType, VerifiedGraph};
use std::sync::Arc;

/// The CPU reference backend.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    /// Large freed outputs, reused by later executions.
    pool: Arc<storage::BufferPool>,
}

impl CpuBackend {
    /// A CPU backend.
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// Wraps typed data in a [`Buffer`] of type `ty` (the data's dtype and
    /// length must match `ty`).
    pub fn buffer(data: CpuData, ty: ValueType) -> Buffer {
        debug_assert_eq!(data.dtype(), ty.dtype);
        debug_assert_eq!(data.len(), ty.shape.numel());
        Buffer { storage: Arc::new(CpuStorage::new(data)), ty, kind: BackendKind::Cpu }
    }

    /// The typed data of a CPU buffer, or `None` if another backend owns it.
    pub fn data(buffer: &Buffer) -> Option<&CpuData> {
        buffer.storage.as_any().downcast_ref::<CpuStorage>().map(|s| &s.data)
    }
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn name(&self) -> String {
        "cpu".into()
    }

    fn supports(&self, _node: &Node, _inputs: &[&Node]) -> bool {
        true
    }

    fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError> {
        let want = ty.shape.numel() * ty.dtype.size_bytes();
        if bytes.len() != want {
            return Err(BackendError::Execution(format!(
                "upload: {} bytes given for {}{} ({want} bytes)",
                bytes.len(),
                ty.dtype,
                ty.shape
            )));
        }
        Ok(CpuBackend::buffer(CpuData::from_bytes(bytes, ty.dtype)?, ty.clone()))
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        let data = CpuBackend::data(buffer).ok_or_else(|| {
            BackendError::Execution(format!("download: a {} buffer was passed to the cpu backend", buffer.kind))
        })?;
        Ok(data.to_bytes())
    }

    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError> {
        Ok(Arc::new(CpuExecutable::with_pool(graph.clone(), self.pool.clone())))
    }

    fn execute(
        &self,
        exe: &dyn Executable,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
    ) -> Result<Vec<Buffer>, BackendError> {
        let exe = exe.as_any().downcast_ref::<CpuExecutable>().ok_or_else(|| {
            BackendError::Execution("execute: the executable was not compiled by the cpu backend".into())
        })?;
        exe.run(inputs, scalars)
    }
}

#[cfg(test)]
mod tests;
