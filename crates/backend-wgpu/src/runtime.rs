//! The backend proper: [`WgpuBackend`] ties the device context
//! ([`crate::context`]), the compile side ([`crate::compile`]), execution
//! ([`crate::execute`]), transfers ([`crate::transfer`]) and profiling
//! ([`crate::profile`]) together behind `lazuli_executor::Backend`.

use crate::autotune::{self, Tuner};
use crate::codegen::{LowerLimits, ReduceForm};
use crate::compile::{Compiler, WgpuExecutable};
use crate::context::Context;
use crate::diskcache::DiskCache;
use crate::generic::{self, Families};
use crate::options::{kernel_forms, WgpuOptions};
use crate::pipeline::Pipelines;
use crate::pool::{Pool, PoolStats};
use crate::profile::Profiler;
use lazuli_executor::{Backend, BackendError, BackendKind, Buffer, CompileHints, Executable};
use lazuli_ir::fusion::FusionLimits;
use lazuli_ir::{Node, ScalarValue, ValueType, VerifiedGraph};
use std::sync::Arc;

/// The wgpu backend.
#[derive(Clone)]
pub struct WgpuBackend {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Context,
    compiler: Compiler,
    profiler: Profiler,
}

impl WgpuBackend {
    /// Opens an adapter and device. Fails with `BackendError::Device` when
    /// no adapter matches.
    pub fn new(options: WgpuOptions) -> Result<WgpuBackend, BackendError> {
        let opened = Context::open(&options)?;
        let (ctx, info, limits) = (opened.context, opened.info, opened.limits);
        let max_sb = opened.max_storage_buffers;
        let forms = kernel_forms(&options, info.device_type);
        let adapter_id = format!(
            "{} vendor {:x} device {:x} {:?} {} {}",
            info.name, info.vendor, info.device, info.backend, info.driver, info.driver_info
        );
        let cache_dir = options.cache_dir.clone().unwrap_or_else(autotune::cache_dir);
        // Everything that changes lowering salts the disk cache's keys
        // besides the adapter and the build.
        let disk = DiskCache::open(
            cache_dir.as_deref(),
            &format!("{adapter_id} limits {limits:?} forms {forms:?} sb {max_sb}"),
            options.cache_max_bytes,
        )
        .map(Arc::new);
        let fusion = FusionLimits {
            // One storage buffer per kernel is kept for the sizes of
            // generic kernels (see `crate::generic`).
            max_storage_buffers: max_sb.saturating_sub(1).max(3),
            matmul_epilogue: true,
            inline_outputs: true,
            // Row kernels cooperate through workgroup memory: the GPU form
            // of reductions.
            row_kernels: forms.reduce == ReduceForm::Cooperative,
            // Independent elementwise kernels share a dispatch.
            multi_tensor: options
                .multi_tensor
                .unwrap_or_else(|| std::env::var("LAZULI_MULTI_TENSOR").map_or(true, |v| v != "0")),
            window_elements: ctx.windows.elements(),
            ..FusionLimits::default()
        };
        let lower = LowerLimits {
            forms,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            ..LowerLimits::default()
        };
        let mut tuner = Tuner::new(
            autotune::enabled(options.autotune, info.device_type == wgpu::DeviceType::Cpu),
            &adapter_id,
            disk.clone(),
        );
        tuner.min_flops = options.autotune_min_flops.unwrap_or(autotune::MIN_FLOPS);
        let compiler = Compiler::new(
            fusion,
            lower,
            Pipelines::new(&ctx.device, options.pipeline_cache_size.unwrap_or(1024), disk),
            tuner,
            Families::new(generic::enabled(options.generic_sizes), 4096),
            options.fault_kernel.clone(),
        );
        Ok(WgpuBackend { inner: Arc::new(Inner { ctx, compiler, profiler: Profiler::default() }) })
    }

    /// The fusion limits this backend plans with.
    pub fn fusion_limits(&self) -> FusionLimits {
        self.inner.compiler.fusion
    }

    /// Idle bytes in the buffer pool.
    pub fn pool_free_bytes(&self) -> u64 {
        self.inner.ctx.pool.free_bytes()
    }

    /// Bytes of the buffer pool in use and idle.
    pub fn pool_stats(&self) -> PoolStats {
        self.inner.ctx.pool.stats()
    }

    /// The buffer pool (for tests and tools that allocate directly).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.inner.ctx.pool
    }

    /// Number of cached pipelines.
    pub fn cached_pipelines(&self) -> usize {
        self.inner.compiler.pipelines.len()
    }

    /// Whether the adapter is a software rasterizer (llvmpipe / lavapipe,
    /// wgpu's `DeviceType::Cpu`).
    pub fn is_software(&self) -> bool {
        self.inner.ctx.loop_budget.is_some()
    }

    /// Whether this adapter can time kernels (wgpu `TIMESTAMP_QUERY`).
    pub fn supports_profiling(&self) -> bool {
        self.inner.ctx.timestamps
    }

    /// Starts (or stops) collecting per-kernel GPU times: while on, every
    /// kernel runs in its own compute pass with timestamp queries. Returns
    /// false (and collects nothing) when the adapter cannot time kernels.
    pub fn set_profiling(&self, on: bool) -> bool {
        self.inner.profiler.set(on, self.inner.ctx.timestamps)
    }

    /// The per-kernel GPU times `(kernel name, ms)` collected since the
    /// last call, in launch order.
    pub fn take_profile(&self) -> Vec<(String, f64)> {
        self.inner.profiler.take()
    }

    /// The wgpu device (for hand-written baseline kernels).
    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.inner.ctx.device
    }

    /// The wgpu queue (for hand-written baseline kernels).
    pub fn wgpu_queue(&self) -> &wgpu::Queue {
        &self.inner.ctx.queue
    }
}

impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn name(&self) -> String {
        self.inner.ctx.name.clone()
    }

    fn supports(&self, node: &Node, inputs: &[&Node]) -> bool {
        self.inner.compiler.supports(&self.inner.ctx, node, inputs)
    }

    fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError> {
        if !crate::codegen::dtype_supported(ty.dtype) {
            return Err(BackendError::Unsupported { backend: self.name(), op: "upload".into(), dtype: ty.dtype });
        }
        self.inner.ctx.upload(bytes, ty)
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        self.inner.ctx.download(buffer)
    }

    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError> {
        self.compile_with(graph, CompileHints::default())
    }

    /// Compiles `graph`; with `hints.sizes_vary` (and generic sizes on),
    /// every kernel is lowered in size-independent forms and compiled
    /// generic over all its sizes at once (see [`crate::generic`]).
    fn compile_with(
        &self,
        graph: &VerifiedGraph,
        hints: CompileHints<'_>,
    ) -> Result<Arc<dyn Executable>, BackendError> {
        Ok(Arc::new(self.inner.compiler.compile(&self.inner.ctx, graph, hints)?))
    }

    fn execute(
        &self,
        exe: &dyn Executable,
        inputs: Vec<Buffer>,
        scalars: &[ScalarValue],
    ) -> Result<Vec<Buffer>, BackendError> {
        let exe = exe
            .as_any()
            .downcast_ref::<WgpuExecutable>()
            .ok_or_else(|| BackendError::Execution("executable of another backend".into()))?;
        // A plan boundary: a kernel waiting for the tuner may be replaced
        // before this execution (see `crate::autotune`).
        self.inner.compiler.tune_pending(&self.inner.ctx, exe);
        crate::execute::execute(&self.inner.ctx, &self.inner.profiler, exe, inputs, scalars)
    }

    fn persist_caches(&self) {
        self.inner.compiler.pipelines.flush();
    }

    fn pool_bytes(&self) -> u64 {
        self.inner.ctx.pool.bytes()
    }

    fn bytes_in_use(&self) -> u64 {
        self.inner.ctx.pool.stats().in_use_bytes
    }
}
