//! `lazuli-cpu`: the CPU reference backend. Every op of the IR in plain
//! Rust, over every dtype, with the exact semantics written on the `Op`
//! variants; the fallback for nodes a GPU backend cannot run, the oracle of
//! differential tests, and the default when no adapter exists.
//!
//! It is also an engine: [`CpuBackend::compile`] turns a verified graph
//! into a program of fused elementwise loops (blocked, vectorizable,
//! split over a rayon pool when large) and interpreted nodes ([`exec`]);
//! [`CpuBackend::execute`] runs it, freeing each intermediate after its
//! last use. Reductions, softmax and matmul have contiguous fast paths;
//! attention is fused (blocks of queries against all keys through the
//! `gemm` crate, every requested part of one problem in one pass). Storage is [`CpuStorage`]: typed
//! vectors per dtype ([`CpuData`]). A large execution runs on a worker
//! pool that the `gemm` crate shares, a small one serially on the calling
//! thread (`threads`, [`CpuOptions::threads`]); each step can be profiled
//! (`Backend::set_profiling`) and traced (`LAZULI_TRACE`).
//!
//! Every allocation that grows with a tensor comes from the backend's
//! `memory` (a budget, a count of the bytes in use, a pool of freed
//! vectors) and can fail: a tensor too large for the host, or over
//! [`CpuOptions::memory_budget`], is a [`BackendError::OutOfMemory`], never
//! an abort.
//!
//! Architecture invariant: nothing here panics on data. A bad gather index
//! or a mismatched input is a [`BackendError`]; only a broken internal
//! contract (an unverified graph) may panic.

mod attention;
mod cache;
mod conv;
mod elem;
mod elementwise;
pub mod exec;
mod fastmath;
mod fused;
mod layout;
mod matmul;
mod memory;
mod movement;
mod profile;
mod quant;
mod quant_dot;
mod reduce;
mod source;
mod storage;
mod stream;
mod threads;

pub use exec::CpuExecutable;
pub use matmul::sgemm;
pub use storage::{CpuData, CpuStorage};

use lazuli_executor::config::{self, Setting, Source};
use lazuli_executor::{Backend, BackendError, BackendKind, Buffer, Executable, LaunchSample};
use lazuli_ir::{Node, ScalarValue, ValueType, VerifiedGraph};
use std::sync::Arc;

/// Options of a [`CpuBackend`].
#[derive(Clone, Debug, Default)]
pub struct CpuOptions {
    /// Most bytes of live tensor storage; a computation needing more fails
    /// with [`BackendError::OutOfMemory`]. `None`: `LAZULI_CPU_MEMORY_BYTES`
    /// (a decimal byte count), else the host's physical memory plus swap.
    /// `Some(u64::MAX)`: no budget (the host allocator alone refuses).
    pub memory_budget: Option<u64>,
    /// Most threads the kernels run on (at most the host's cores; 1: every
    /// execution on the device's worker thread). `None`:
    /// `LAZULI_CPU_THREADS`, else the host's cores. Backends asking for
    /// the same count share one pool, which the GEMM uses too.
    pub threads: Option<usize>,
}

/// Where each of [`CpuOptions`]' values came from.
#[derive(Clone, Copy, Debug)]
pub struct CpuSources {
    /// Of [`CpuOptions::memory_budget`].
    pub memory_budget: Source,
    /// Of [`CpuOptions::threads`].
    pub threads: Source,
}

impl CpuOptions {
    /// These options with the environment's fallbacks applied (the one
    /// place this backend reads its variables), and where each value came
    /// from; a malformed value is the error.
    pub fn resolve(&self, lookup: config::Lookup<'_>) -> Result<(CpuOptions, CpuSources), config::ConfigError> {
        let budget = config::bytes(lookup, "LAZULI_CPU_MEMORY_BYTES")?;
        let threads = config::count(lookup, "LAZULI_CPU_THREADS")?;
        let sources = CpuSources {
            memory_budget: Source::of(self.memory_budget.is_some(), budget.is_some()),
            threads: Source::of(self.threads.is_some(), threads.is_some()),
        };
        Ok((CpuOptions { memory_budget: self.memory_budget.or(budget), threads: self.threads.or(threads) }, sources))
    }
}

/// The CPU reference backend.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    /// Budget, bytes in use, and large freed outputs reused by later
    /// executions.
    memory: Arc<memory::Memory>,
    /// The worker pool and the threading policy.
    threads: threads::Threads,
    /// Launches collected while profiling.
    profiler: Arc<profile::Profiler>,
    /// Where the options came from.
    sources: CpuSources,
}

impl Default for CpuBackend {
    fn default() -> CpuBackend {
        CpuBackend::with_options(CpuOptions::default())
    }
}

impl CpuBackend {
    /// A CPU backend with default options.
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// A CPU backend with `options`, its fallbacks from the environment.
    /// A malformed `LAZULI_CPU_MEMORY_BYTES` is logged as an error and left
    /// out here; a device built on this backend (`Device::new` checks every
    /// variable) then fails every compilation naming it. Use
    /// [`CpuBackend::try_with_options`] to fail at once.
    pub fn with_options(options: CpuOptions) -> CpuBackend {
        CpuBackend::try_with_options(options.clone()).unwrap_or_else(|e| {
            tracing::error!("{e}");
            CpuBackend::build(options, CpuSources { memory_budget: Source::Code, threads: Source::Code })
        })
    }

    /// A CPU backend with `options`, its fallbacks from the environment; a
    /// malformed value is `BackendError::Config` naming the variable.
    pub fn try_with_options(options: CpuOptions) -> Result<CpuBackend, BackendError> {
        let (options, sources) = options.resolve(&config::process)?;
        Ok(CpuBackend::build(options, sources))
    }

    fn build(options: CpuOptions, mut sources: CpuSources) -> CpuBackend {
        if options.memory_budget.is_none() {
            sources.memory_budget = Source::Default;
        }
        if options.threads.is_none() {
            sources.threads = Source::Default;
        }
        CpuBackend {
            memory: Arc::new(memory::Memory::new(options.memory_budget)),
            threads: threads::Threads::new(options.threads),
            profiler: Arc::default(),
            sources,
        }
    }

    /// Threads the kernels may run on.
    pub fn threads(&self) -> usize {
        self.threads.count()
    }

    /// The memory budget in bytes (`u64::MAX`: none).
    pub fn memory_budget(&self) -> u64 {
        self.memory.budget()
    }

    /// Most bytes of tensor storage in use at once so far.
    pub fn peak_bytes_in_use(&self) -> u64 {
        self.memory.peak()
    }

    /// Wraps typed data in a [`Buffer`] of type `ty` (the data's dtype and
    /// length must match `ty`). The storage is counted in no backend's
    /// memory.
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

    fn settings(&self) -> Vec<Setting> {
        let budget = match (self.memory.budget(), self.sources.memory_budget) {
            (u64::MAX, _) => "none".to_string(),
            (b, Source::Default) => format!("{b} (physical memory plus swap)"),
            (b, _) => b.to_string(),
        };
        let threads = match self.sources.threads {
            Source::Default => format!("{} (the host's cores)", self.threads.count()),
            _ => self.threads.count().to_string(),
        };
        vec![
            Setting::new("LAZULI_CPU_MEMORY_BYTES", budget, self.sources.memory_budget),
            Setting::new("LAZULI_CPU_THREADS", threads, self.sources.threads),
        ]
    }

    /// Every launch (each fused loop, product, reduction, attention and
    /// interpreted node of an execution) is collected with its cost and
    /// its wall time; always timed.
    fn set_profiling(&self, on: bool) -> bool {
        self.profiler.set(on);
        true
    }

    fn take_profile(&self) -> Vec<LaunchSample> {
        self.profiler.take()
    }

    /// Every op but the collectives ([`lazuli_ir::Op::AllReduce`]), which
    /// the executor runs in segments of their own.
    fn supports(&self, node: &Node, _inputs: &[&Node]) -> bool {
        !node.op.is_collective()
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
        let data = CpuData::decode(&self.memory, bytes, ty.dtype)?;
        Ok(Buffer { storage: Arc::new(self.memory.track(data)), ty: ty.clone(), kind: BackendKind::Cpu })
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        let data = CpuBackend::data(buffer).ok_or_else(|| {
            BackendError::Execution(format!("download: a {} buffer was passed to the cpu backend", buffer.kind))
        })?;
        data.encode(&self.memory)
    }

    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError> {
        if let Some(n) = graph.nodes().iter().find(|n| n.op.is_collective()) {
            // Never an identity: a collective needs the executor's
            // registered `Collective`.
            return Err(BackendError::Unsupported { backend: self.name(), op: n.op.name(), dtype: n.dtype });
        }
        Ok(Arc::new(CpuExecutable::with_memory(graph.clone(), self.memory.clone())))
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
        self.threads.run(exe.parallel(), || exe.run_profiled(inputs, scalars, &self.profiler))
    }

    fn pool_bytes(&self) -> u64 {
        self.memory.in_use() + self.memory.pooled()
    }

    fn bytes_in_use(&self) -> u64 {
        self.memory.in_use()
    }
}

#[cfg(test)]
mod tests;
