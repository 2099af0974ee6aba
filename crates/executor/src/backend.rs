//! The object-safe [`Backend`] trait through which the executor drives a
//! device, and the types that cross it: [`Buffer`], [`Executable`],
//! [`BackendError`].
//!
//! A backend receives verified graphs (fused subgraphs, never lazy tensors),
//! compiles them once into an [`Executable`], and runs that executable on
//! input buffers. Everything about kernels, pipelines and memory stays
//! inside the backend.
//!
//! Host byte format ("canonical bytes"): elements in row-major order, little
//! endian, `dtype.size_bytes()` each; bool is one byte, 0 or 1.

use crate::platform::LocalFuture;
use lazuli_ir::{DType, Node, ScalarValue, ValueType, VerifiedGraph};
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use thiserror::Error;

/// Which family a backend belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU reference backend.
    Cpu,
    /// The wgpu (WGSL) backend.
    Wgpu,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
        })
    }
}

/// Storage owned by a backend. Backends downcast through `as_any`.
pub trait DeviceStorage: Send + Sync + fmt::Debug + 'static {
    /// For downcasting to the backend's concrete storage type.
    fn as_any(&self) -> &dyn Any;
    /// Size in bytes of the allocation (may exceed the tensor's bytes).
    fn byte_size(&self) -> usize;
    /// For writing into a uniquely held (donated) buffer in place: the
    /// concrete storage, mutably. `None` (the default) where a backend
    /// does not write in place.
    fn as_any_mut(&mut self) -> Option<&mut dyn Any> {
        None
    }
}

/// A tensor's data on one backend: shared, immutable storage plus its type.
/// Cloning is cheap. Dropping the last clone returns the storage to its
/// backend's pool (the storage's own `Drop` does that).
#[derive(Clone, Debug)]
pub struct Buffer {
    /// The backend's storage.
    pub storage: Arc<dyn DeviceStorage>,
    /// Shape and dtype of the tensor it holds.
    pub ty: ValueType,
    /// Which backend family owns it.
    pub kind: BackendKind,
}

impl Buffer {
    /// Bytes of tensor data in the canonical host format.
    pub fn host_bytes(&self) -> usize {
        self.ty.shape.numel() * self.ty.dtype.size_bytes()
    }

    /// True if no other clone of this buffer exists, so a backend may
    /// write the result of an elementwise op into it (buffer donation).
    pub fn is_unique(&self) -> bool {
        Arc::strong_count(&self.storage) == 1
    }
}

/// A compiled graph, ready to run many times.
pub trait Executable: Send + Sync + 'static {
    /// For downcasting to the backend's concrete type.
    fn as_any(&self) -> &dyn Any;
    /// How many kernel launches one execution performs.
    fn kernel_count(&self) -> usize;
    /// The generated source of each kernel, as (name, source); empty for
    /// backends without generated code.
    fn kernel_sources(&self) -> Vec<(String, String)>;
    /// Each kernel with the graph nodes it evaluates and writes, in launch
    /// order, for shadow validation (`LAZULI_VALIDATE=cpu`) to compare
    /// every kernel's outputs with the reference. Empty (the default) makes
    /// validation compare whole segments instead.
    fn kernels(&self) -> Vec<KernelInfo> {
        Vec::new()
    }
    /// The cost model's figures for each launch of one execution, in
    /// launch order (a two-pass kernel's first pass before it), computed
    /// when the graph compiled; empty (the default) for backends without
    /// a cost model. Profiles pair them with measured times (a roofline).
    fn launch_costs(&self) -> Vec<LaunchCost> {
        Vec::new()
    }
}

/// What one kernel launch costs by a backend's model, for a roofline:
/// the work and the traffic one launch does, whatever its time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LaunchCost {
    /// The launch's name in profiles, e.g. `k2_MatMul_matmul` or
    /// `k4_Reduce_sum_pass1` for the first pass of a two-pass kernel.
    pub name: String,
    /// Arithmetic operations, by the backend's model (a multiply-add is
    /// two).
    pub flops: u64,
    /// Bytes read and written in device memory: each tensor the launch
    /// reads or writes, counted once.
    pub bytes: u64,
    /// Workgroups (or the backend's unit of parallel work) launched.
    pub workgroups: u64,
}

/// One profiled kernel launch (see [`Backend::set_profiling`]): its cost
/// by the backend's model (computed when the kernel compiled), its time
/// and, on the CPU backend, the threads it ran on.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchSample {
    /// The launch's name, FLOPs, bytes and workgroups.
    pub cost: LaunchCost,
    /// Its time in ms (GPU time on a GPU, wall time on the CPU backend);
    /// `None` where the device cannot time kernels.
    pub ms: Option<f64>,
    /// Threads the launch ran on (CPU backend); `None` where the backend
    /// does not say (a GPU's parallelism is its workgroups).
    pub threads: Option<u32>,
    /// CPU time in ms of the thread that ran the launch (CPU backend, where
    /// the platform tells): unlike wall time, not inflated where other
    /// processes preempt it; a launch split over threads counts the
    /// calling thread's share only.
    pub cpu_ms: Option<f64>,
}

/// One kernel of an [`Executable`], as shadow validation sees it.
#[derive(Clone, Debug)]
pub struct KernelInfo {
    /// The kernel name, e.g. `k2_MatMul_matmul`.
    pub name: String,
    /// Its generated source.
    pub source: String,
    /// Nodes of the compiled graph it evaluates (its fused prologue and
    /// root), in topological order.
    pub nodes: Vec<lazuli_ir::NodeId>,
    /// Nodes of the compiled graph it writes to buffers.
    pub outputs: Vec<lazuli_ir::NodeId>,
}

/// Errors a backend reports: only what a caller cannot foresee.
#[derive(Clone, Error)]
pub enum BackendError {
    /// A malformed `LAZULI_*` configuration value met while creating the
    /// backend (see [`crate::config`]).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The device (or its configured memory budget) had no room for an
    /// allocation, even after the backend released its cached buffers.
    #[error("out of memory allocating {bytes} bytes on {device} ({in_use} bytes in use)")]
    OutOfMemory {
        /// Requested size (0 when the device reported running out while
        /// executing, not allocating).
        bytes: u64,
        /// Bytes of the backend's buffers in use at the time.
        in_use: u64,
        /// Device name, with what limited it (the driver's message, or the
        /// configured budget).
        device: String,
    },
    /// The device was lost or reported an internal error.
    #[error("device error on {device}: {message}")]
    Device {
        /// Device name.
        device: String,
        /// What the driver said.
        message: String,
    },
    /// A collective of the step (an all-reduce) failed on this rank or a
    /// peer, or no [`crate::Collective`] is registered on the device.
    #[error("{op} (bucket {bucket}): {source}")]
    Collective {
        /// The op (`all_reduce_mean`, ...).
        op: String,
        /// Its bucket tag.
        bucket: u32,
        /// What went wrong.
        #[source]
        source: crate::CollectiveError,
    },
    /// The backend cannot run a node (the executor routes such nodes to
    /// the CPU fallback, so users see this only if that is impossible).
    #[error("{backend} does not support {op} on {dtype}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// The op.
        op: String,
        /// The dtype.
        dtype: DType,
    },
    /// A tensor (or the tensors one kernel binds) is larger than a limit
    /// of the device or of the generated code: the device's largest
    /// buffer, the storage bindings one kernel may use, or u32 element
    /// indexing.
    #[error("{op}: {bytes} bytes exceed {limit_name} of {limit} bytes")]
    TooLarge {
        /// The op (or kernel) that needed it.
        op: String,
        /// Needed size.
        bytes: u64,
        /// The limit.
        limit: u64,
        /// Which limit, in words (e.g. "the device's largest buffer
        /// (max_buffer_size)").
        limit_name: String,
    },
    /// Generated code failed validation or compilation (always a bug in
    /// code generation; the message includes the source location).
    #[error("compiling kernel {kernel} failed: {message}")]
    Compile {
        /// The kernel name.
        kernel: String,
        /// Validator or driver message.
        message: String,
    },
    /// An index read from data (gather, scatter-add) lies outside the
    /// dimension it indexes: outside `-size..size`, negative indices
    /// counting from the end. Raised at the barrier of the computation; no
    /// value is clamped. (Boxed: it is the largest variant.)
    #[error("{0}")]
    IndexOutOfRange(Box<IndexError>),
    /// An execution failed for another reason.
    #[error("execution failed: {0}")]
    Execution(String),
    /// The call would have to block until the device is done, which this
    /// platform cannot do (a browser tab's thread: see
    /// [`crate::platform`]); the asynchronous form named does the same
    /// without blocking.
    #[error("{op} would block on {device}, which cannot wait here (a browser tab); use {instead}")]
    WouldBlock {
        /// The blocking call.
        op: String,
        /// Device name.
        device: String,
        /// The asynchronous call to use instead.
        instead: String,
    },
}

/// The details of [`BackendError::IndexOutOfRange`].
#[derive(Clone, PartialEq, Eq, Error)]
#[error("{op}: index {index} is out of range for axis {axis} of size {size} (data shape {shape})")]
pub struct IndexError {
    /// The op (`gather`, `scatter_add`).
    pub op: String,
    /// The offending index as given (before counting from the end).
    pub index: i128,
    /// The indexed axis of the data.
    pub axis: usize,
    /// The size of that axis.
    pub size: usize,
    /// The shape of the indexed data.
    pub shape: lazuli_ir::Shape,
}

/// What the executor knows about a graph it hands to
/// [`Backend::compile_with`].
#[derive(Clone, Copy, Default)]
pub struct CompileHints<'a> {
    /// A graph of the same structure was compiled before with other sizes
    /// (same [`lazuli_ir::Graph::shape_free_hash`]): sizes vary from call to
    /// call, so kernels should not depend on them (see the wgpu backend's
    /// generic kernels).
    pub sizes_vary: bool,
    /// The executable this backend compiled last for the same segment
    /// structure at other sizes, when `sizes_vary` (the executor's compile
    /// cache is the one place that remembers it): a backend may read how
    /// it compiled that one instead of keeping a map of its own.
    pub earlier: Option<&'a dyn Executable>,
}

impl std::fmt::Debug for CompileHints<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileHints")
            .field("sizes_vary", &self.sizes_vary)
            .field("earlier", &self.earlier.map(|e| e.kernel_count()))
            .finish()
    }
}

/// A device backend. Object safe: the executor holds `Arc<dyn Backend>`.
pub trait Backend: Send + Sync + 'static {
    /// Family of this backend.
    fn kind(&self) -> BackendKind;

    /// Human-readable device name, e.g. "wgpu: llvmpipe (Vulkan, Cpu)".
    fn name(&self) -> String;

    /// True if this backend runs `node` (its op with its operand and
    /// result dtypes) natively. `inputs` are the operand nodes. Nodes for
    /// which this is false run on the CPU fallback.
    fn supports(&self, node: &Node, inputs: &[&Node]) -> bool;

    /// Copies canonical host bytes into a new buffer of type `ty`.
    fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError>;

    /// Reads a buffer back as canonical host bytes (blocking; where the
    /// platform cannot block, [`BackendError::WouldBlock`]).
    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError>;

    /// [`Backend::download`] without blocking the caller: the future
    /// yields while the device works (a browser tab's event loop runs
    /// meanwhile). By default the blocking download, done when polled.
    fn download_async<'a>(&'a self, buffer: &'a Buffer) -> LocalFuture<'a, Result<Vec<u8>, BackendError>> {
        Box::pin(std::future::ready(self.download(buffer)))
    }

    /// Waits until the device has finished all work submitted so far and
    /// returns an asynchronous device error found meanwhile. By default
    /// nothing: where [`Backend::execute`] returns after the device has
    /// finished, there is nothing left to wait for.
    fn finish(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// [`Backend::finish`] without blocking the caller.
    fn finish_async(&self) -> LocalFuture<'_, Result<(), BackendError>> {
        Box::pin(std::future::ready(self.finish()))
    }

    /// Compiles a verified graph whose nodes this backend all supports.
    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError>;

    /// [`Backend::compile`] with what the executor knows about the graph
    /// (by default ignored).
    fn compile_with(
        &self,
        graph: &VerifiedGraph,
        hints: CompileHints<'_>,
    ) -> Result<Arc<dyn Executable>, BackendError> {
        let _ = hints;
        self.compile(graph)
    }

    /// Whether compiling on a thread of its own while kernels run costs
    /// the running kernels nothing: true where they run on a device of
    /// their own (a GPU), so the host's other cores are idle meanwhile;
    /// false (the default) where they run on the host's cores (the CPU
    /// backend, a software adapter). The default of compiling size
    /// variants ahead of time (see `LAZULI_COMPILE_AHEAD`).
    fn compiles_ahead(&self) -> bool {
        false
    }

    /// Writes what the backend caches across processes (a driver's
    /// pipeline cache, say) that is not written yet; called when a device
    /// on it is dropped, off the hot path. By default nothing.
    fn persist_caches(&self) {}

    /// Runs `exe` on `inputs` (one per graph parameter, in order) and the
    /// lifted `scalars` (one per scalar slot, already cast to its dtype).
    /// Returns one buffer per graph output, in order, once the device has
    /// finished (the executor calls this from its worker thread; where
    /// there is none, see [`crate::platform`], a backend may return once
    /// the work is submitted, and [`Backend::finish_async`] waits for it). Inputs are
    /// passed by value so a backend may donate a uniquely held input buffer.
    fn execute(
        &self,
        exe: &dyn Executable,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
    ) -> Result<Vec<Buffer>, BackendError>;

    /// Bytes currently held by the backend's buffer pool (free + in use), for
    /// leak checks.
    fn pool_bytes(&self) -> u64;

    /// Bytes of the backend's buffers in use now (allocated and not yet
    /// freed or returned to a pool): the figure an
    /// [`BackendError::OutOfMemory`] reports as in use.
    fn bytes_in_use(&self) -> u64;

    /// The effective values of the configuration variables this backend
    /// reads, with their sources (see [`crate::config::Report`]); none by
    /// default.
    fn settings(&self) -> Vec<crate::config::Setting> {
        Vec::new()
    }

    /// Starts (or stops) collecting every kernel launch with its cost and,
    /// where the backend can time kernels, its time ([`LaunchSample`]);
    /// returns whether launches are timed. By default nothing is
    /// collected and launches are untimed.
    fn set_profiling(&self, on: bool) -> bool {
        let _ = on;
        false
    }

    /// The launches collected since the last call, in launch order (empty
    /// by default).
    fn take_profile(&self) -> Vec<LaunchSample> {
        Vec::new()
    }
}

impl std::fmt::Debug for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        crate::error::write_chain(f, self)
    }
}

impl std::fmt::Debug for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        crate::error::write_chain(f, self)
    }
}
