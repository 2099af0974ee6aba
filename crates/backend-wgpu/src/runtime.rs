//! The backend proper: [`WgpuBackend`] ties the device context
//! (`context`), the compile side ([`crate::compile`]), execution
//! (`execute`), transfers (`transfer`) and profiling
//! (`profile`) together behind `lazuli_executor::Backend`.

use crate::codegen::{KernelForms, LowerLimits, ReduceForm};
use crate::compile::autotune::{self, Tuner};
use crate::compile::diskcache::DiskCache;
use crate::compile::executable::WgpuExecutable;
use crate::compile::pipeline::Pipelines;
use crate::compile::stages::Stages;
use crate::compile::threads::Workers;
use crate::compile::Compiler;
use crate::device::context::Context;
use crate::device::pool::{Pool, PoolStats};
use crate::device::profile::{LaunchSample, Profiler};
use crate::options::{kernel_forms, WgpuOptions};
use crate::rewrite::size_families::{self, Families};
use lazuli_executor::config::{self, Setting, Source};
use lazuli_executor::platform::{Instant, LocalFuture};
use lazuli_executor::{metrics, Backend, BackendError, BackendKind, Buffer, CompileHints, Executable};
use lazuli_ir::fusion::FusionLimits;
use lazuli_ir::{Node, ScalarValue, ValueType, VerifiedGraph};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The wgpu backend.
#[derive(Clone)]
pub struct WgpuBackend {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Context,
    compiler: Compiler,
    profiler: Profiler,
    /// The effective values of this backend's configuration variables.
    settings: Vec<Setting>,
    /// Executions after which a plan's generic kernels are compiled
    /// static (see [`crate::compile::specialize`]); `None`: never.
    specialize_after: Option<u64>,
    /// The threads compiling off the steps' path (static kernels, the
    /// tuner's candidates), not yet joined.
    background: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Set while a device on this backend is dropped: the background
    /// compiles stop before their next kernel.
    cancel: AtomicBool,
}

impl WgpuBackend {
    /// Opens an adapter and device. Fails with `BackendError::Device` when
    /// no adapter matches, and with `BackendError::Config` naming the
    /// variable when a `LAZULI_*` variable an unset option falls back to
    /// is malformed (see [`WgpuOptions::resolve`]). Blocks while the
    /// device opens: in a browser tab it is `BackendError::WouldBlock`
    /// (use [`WgpuBackend::new_async`]).
    pub fn new(options: WgpuOptions) -> Result<WgpuBackend, BackendError> {
        let started = Instant::now();
        let (options, sources) = options.resolve(&config::process)?;
        let opened = Context::open(&options)?;
        Ok(WgpuBackend::opened(options, &sources, opened, started))
    }

    /// [`WgpuBackend::new`] without blocking: in a browser tab, the
    /// browser's WebGPU adapter (see `platform`); natively the
    /// same as `new`.
    pub async fn new_async(options: WgpuOptions) -> Result<WgpuBackend, BackendError> {
        let started = Instant::now();
        let (options, sources) = options.resolve(&config::process)?;
        let opened = Context::open_async(&options).await?;
        Ok(WgpuBackend::opened(options, &sources, opened, started))
    }

    /// The backend on an opened device; `started`: when opening began
    /// (the whole is timed as `DeviceOpen`).
    fn opened(
        options: WgpuOptions,
        sources: &[(&'static str, Source)],
        opened: crate::device::context::Opened,
        started: Instant,
    ) -> WgpuBackend {
        let (ctx, info, limits) = (opened.context, opened.info, opened.limits);
        let max_sb = opened.max_storage_buffers;
        let forms = kernel_forms(&options, info.device_type);
        // Subgroup operations where the device has them, unless turned
        // off (`WgpuOptions::subgroups`); never in a browser
        // (`platform::SUBGROUPS`).
        let subgroups = ctx.subgroups && crate::device::platform::SUBGROUPS && options.subgroups.unwrap_or(true);
        // Tensor cores for f16 products where the device runs the
        // cooperative form (the device was opened with the feature only
        // where the option allowed it).
        let cooperative_matrix = ctx.cooperative_matrix && options.cooperative_matrix.unwrap_or(true);
        let software = info.device_type == wgpu::DeviceType::Cpu;
        let adapter_id = format!(
            "{} vendor {:x} device {:x} {:?} {} {}",
            info.name, info.vendor, info.device, info.backend, info.driver, info.driver_info
        );
        // No file system in a browser tab: caches stay in memory there.
        let cache_dir = options
            .cache_dir
            .clone()
            .unwrap_or_else(autotune::cache_dir)
            .filter(|_| crate::device::platform::DISK_CACHE);
        // Everything that changes lowering salts the disk cache's keys
        // besides the adapter and the build.
        let disk = DiskCache::open(
            cache_dir.as_deref(),
            &format!("{adapter_id} limits {limits:?} forms {forms:?} sb {max_sb} subgroups {subgroups} coop {cooperative_matrix}"),
            options.cache_max_bytes,
        )
        .map(Arc::new);
        let fusion = FusionLimits {
            // One storage buffer per kernel is kept for the sizes of
            // generic kernels (see `crate::rewrite::size_families`).
            max_storage_buffers: max_sb.saturating_sub(1).max(3),
            matmul_epilogue: true,
            inline_outputs: true,
            // Row kernels cooperate through workgroup memory: the GPU form
            // of reductions.
            row_kernels: forms.reduce == ReduceForm::Cooperative,
            // Independent elementwise kernels share a dispatch.
            multi_tensor: options.multi_tensor.unwrap_or(true),
            window_elements: ctx.windows.elements(),
            // Small reductions are loops inside their consumers, which
            // join multi-tensor kernels where warps of other segments skip
            // the loops (GPUs), not where every lane batch runs them
            // masked (llvmpipe).
            inline_reductions: if options.inline_reductions.unwrap_or(true) {
                crate::codegen::INLINE_REDUCTION_LEN
            } else {
                0
            },
            join_inlined_reductions: forms.reduce == ReduceForm::Cooperative,
            ..FusionLimits::default()
        };
        // f16 natively where the device has SHADER_F16 and is a GPU,
        // packed in u32 elsewhere: llvmpipe runs native f16 slower than
        // packed (BENCHMARKS.md, "f16 and bf16"); the option forces either.
        let f16 = if ctx.shader_f16 && !options.f16_packed.unwrap_or(software) {
            crate::codegen::HalfStorage::Native
        } else {
            crate::codegen::HalfStorage::Packed
        };
        let lower = LowerLimits {
            f16,
            cooperative_matrix,
            forms,
            workgroup_storage: limits.max_compute_workgroup_storage_size,
            subgroups,
            windows: ctx.windows,
            ..LowerLimits::default()
        };
        // Tuning times candidates by reading results back synchronously.
        let tune = crate::device::platform::CAN_BLOCK && autotune::enabled(options.autotune, software);
        let mut tuner = Tuner::new(tune, &adapter_id, disk.clone());
        tuner.min_flops = options.autotune_min_flops.unwrap_or(autotune::MIN_FLOPS);
        let workers = Arc::new(Workers::for_compiles(options.compile_threads));
        let compiler = Compiler {
            stages: Stages {
                backend: ctx.name.clone(),
                fusion,
                lower,
                tuner,
                families: Families::new(size_families::enabled(options.generic_sizes), 4096),
                workers: workers.clone(),
                fault_kernel: options.fault_kernel.clone(),
            },
            pipelines: Pipelines::new(
                &ctx.device,
                options.pipeline_cache_size.unwrap_or(1024),
                disk,
                workers,
                options.trusted_shaders.unwrap_or(true),
            ),
        };
        // Static kernels compile on a thread of their own, so not where
        // there are none (the browser), nor by default on a software
        // adapter, whose kernels run on the cores that thread would take.
        let default_after = if software { 0 } else { crate::compile::specialize::SPECIALIZE_AFTER };
        let specialize_after = match options.specialize_after.unwrap_or(default_after) {
            0 => None,
            n => crate::device::platform::THREADS.then_some(n),
        };
        let settings =
            effective_settings(&options, sources, &ctx, &compiler, software, cache_dir.as_deref(), specialize_after);
        metrics::record_time("DeviceOpen", started.elapsed());
        WgpuBackend {
            inner: Arc::new(Inner {
                ctx,
                compiler,
                profiler: Profiler::default(),
                settings,
                specialize_after,
                background: Mutex::new(Vec::new()),
                cancel: AtomicBool::new(false),
            }),
        }
    }

    /// At a plan boundary before an execution of `exe`: swaps in its
    /// static kernels where they are ready, or starts compiling them on a
    /// thread of their own where its generic kernels are due (see
    /// [`crate::compile::specialize`]).
    fn specialize(&self, exe: &WgpuExecutable) {
        // Off (and so never where there are no threads): nothing to swap
        // in either, so no lock on the step's path.
        if self.inner.specialize_after.is_none() {
            return;
        }
        let Some(job) = crate::compile::specialize::at_boundary(exe, exe.runs(), self.inner.specialize_after) else {
            return;
        };
        self.in_background("lazuli-specialize", move |inner| {
            let compiled = inner.compiler.compile_static(&inner.ctx, &job.input, &inner.cancel);
            job.finish(compiled, "compiling static kernels for recurring sizes");
        });
    }

    /// At a plan boundary before an execution of `exe`: times the tuner's
    /// candidates for its kernels where they are compiled, or starts
    /// compiling them on a thread of their own (see [`crate::compile::autotune`]).
    fn tune(&self, exe: &WgpuExecutable) {
        let Some(job) = self.inner.compiler.tune_at_boundary(&self.inner.ctx, exe) else { return };
        self.in_background("lazuli-autotune", move |inner| {
            let compiled = inner.compiler.compile_candidates(&inner.ctx, &job.input, &inner.cancel);
            job.finish(compiled, "compiling autotune candidates");
        });
    }

    /// Runs `work` on a thread named `name`, joined when a device on this
    /// backend is dropped (see [`WgpuBackend::await_background`]); a
    /// thread that cannot start is a warning (the job, dropped, leaves its
    /// plan as it is).
    fn in_background(&self, name: &str, work: impl FnOnce(&Inner) + Send + 'static) {
        let inner = self.inner.clone();
        match std::thread::Builder::new().name(name.into()).spawn(move || work(&inner)) {
            Ok(handle) => {
                let mut background = self.inner.background.lock().unwrap_or_else(|e| e.into_inner());
                background.retain(|h| !h.is_finished());
                background.push(handle);
            }
            Err(e) => tracing::warn!("could not start a background compile ({name}): {e}"),
        }
    }

    /// Waits for the compiles running off the steps' path to finish: a
    /// plan's static kernels for recurring sizes ([`crate::compile::specialize`]) and
    /// the tuner's candidates ([`crate::compile::autotune`]). What they made takes
    /// effect at each plan's next execution. For tests, and for
    /// benchmarks that want a settled engine before they time.
    pub fn await_background(&self) {
        let handles = std::mem::take(&mut *self.inner.background.lock().unwrap_or_else(|e| e.into_inner()));
        for h in handles {
            let _ = h.join();
        }
    }

    /// Stops the background compiles (each before its next kernel) and
    /// waits for them.
    fn stop_background(&self) {
        let handles = std::mem::take(&mut *self.inner.background.lock().unwrap_or_else(|e| e.into_inner()));
        if handles.is_empty() {
            return;
        }
        self.inner.cancel.store(true, Ordering::Relaxed);
        for h in handles {
            let _ = h.join();
        }
        self.inner.cancel.store(false, Ordering::Relaxed);
    }

    /// The fusion limits this backend plans with.
    pub fn fusion_limits(&self) -> FusionLimits {
        self.inner.compiler.stages.fusion
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

    /// Starts (or stops) collecting every kernel launch with its cost
    /// (FLOPs, bytes, workgroups) and, where the adapter can time kernels
    /// ([`WgpuBackend::supports_profiling`]), its GPU time: while on, every
    /// kernel then runs in its own compute pass with timestamp queries.
    /// Returns whether launches are timed.
    pub fn set_profiling(&self, on: bool) -> bool {
        self.inner.profiler.set(on) && self.inner.ctx.timestamps
    }

    /// The launches collected since the last call, in launch order.
    pub fn take_profile(&self) -> Vec<LaunchSample> {
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

/// The effective values of the backend's configuration variables, with
/// their sources (`sources` from [`WgpuOptions::resolve`]; a value left to
/// the default says what chose it).
fn effective_settings(
    options: &WgpuOptions,
    sources: &[(&'static str, Source)],
    ctx: &Context,
    compiler: &Compiler,
    software: bool,
    cache_dir: Option<&std::path::Path>,
    specialize_after: Option<u64>,
) -> Vec<Setting> {
    let source = |name| sources.iter().find(|(n, _)| *n == name).map_or(Source::Default, |s| s.1);
    let on_off = |b: bool| if b { "on" } else { "off" };
    let adapter = if software { "software adapter" } else { "GPU" };
    let forms = compiler.stages.lower.forms;
    let profile = if forms == KernelForms::gpu() {
        "gpu".to_string()
    } else if forms == KernelForms::software() {
        "software".to_string()
    } else {
        format!("{forms:?}")
    };
    let by_default = |value: String, name| match source(name) {
        Source::Default => format!("{value} ({adapter})"),
        _ => value,
    };
    let pool = ctx.pool.options();
    // Forcing one form from code (`cooperative_rows`, `tiled_matmul`)
    // changes the profile too.
    let forms_source = match options.cooperative_rows.or(options.tiled_matmul) {
        Some(_) => Source::Code,
        None => source("LAZULI_KERNEL_FORMS"),
    };
    let profile = match forms_source {
        Source::Default => format!("{profile} ({adapter})"),
        _ => profile,
    };
    vec![
        Setting::new("LAZULI_KERNEL_FORMS", profile, forms_source),
        Setting::new(
            "LAZULI_AUTOTUNE",
            by_default(on_off(compiler.stages.tuner.enabled()).to_string(), "LAZULI_AUTOTUNE"),
            source("LAZULI_AUTOTUNE"),
        ),
        Setting::new("LAZULI_AUTOTUNE_MIN_FLOPS", compiler.stages.tuner.min_flops, source("LAZULI_AUTOTUNE_MIN_FLOPS")),
        Setting::new(
            "LAZULI_CACHE_DIR",
            cache_dir.map_or("off".to_string(), |d| d.display().to_string()),
            source("LAZULI_CACHE_DIR"),
        ),
        Setting::new(
            "LAZULI_CACHE_MAX_BYTES",
            options.cache_max_bytes.unwrap_or(crate::compile::diskcache::DEFAULT_MAX_BYTES),
            source("LAZULI_CACHE_MAX_BYTES"),
        ),
        Setting::new(
            "LAZULI_POOL_BYTES",
            by_default(pool.max_idle_bytes.to_string(), "LAZULI_POOL_BYTES"),
            source("LAZULI_POOL_BYTES"),
        ),
        Setting::new(
            "LAZULI_DEVICE_MEMORY_BYTES",
            pool.memory_budget.map_or("none".to_string(), |b| b.to_string()),
            source("LAZULI_DEVICE_MEMORY_BYTES"),
        ),
        Setting::new("LAZULI_MULTI_TENSOR", on_off(compiler.stages.fusion.multi_tensor), source("LAZULI_MULTI_TENSOR")),
        Setting::new(
            "LAZULI_INLINE_REDUCTIONS",
            on_off(compiler.stages.fusion.inline_reductions > 0),
            source("LAZULI_INLINE_REDUCTIONS"),
        ),
        Setting::new("LAZULI_OVERLAP_SUBMIT", on_off(ctx.overlap), source("LAZULI_OVERLAP_SUBMIT")),
        Setting::new(
            "LAZULI_STREAM_SUBMIT",
            match ctx.stream_first {
                0 => "off".to_string(),
                n => format!("on ({n}, {}, {}, ... launches per submission)", 2 * n, 4 * n),
            },
            source("LAZULI_STREAM_SUBMIT"),
        ),
        Setting::new(
            "LAZULI_SUBGROUPS",
            match (compiler.stages.lower.subgroups, ctx.subgroups) {
                (true, _) => "on".to_string(),
                (false, true) => "off".to_string(),
                (false, false) => "off (the adapter has none)".to_string(),
            },
            source("LAZULI_SUBGROUPS"),
        ),
        Setting::new(
            "LAZULI_GENERIC_SIZES",
            on_off(compiler.stages.families.enabled()),
            source("LAZULI_GENERIC_SIZES"),
        ),
        Setting::new("LAZULI_TRUSTED_SHADERS", on_off(compiler.pipelines.trusted()), source("LAZULI_TRUSTED_SHADERS")),
        Setting::new(
            "LAZULI_SPECIALIZE_AFTER",
            match specialize_after {
                Some(n) => n.to_string(),
                None if !crate::device::platform::THREADS => "never (no threads here)".to_string(),
                None if software && options.specialize_after.is_none() => "never (software adapter)".to_string(),
                None => "never".to_string(),
            },
            source("LAZULI_SPECIALIZE_AFTER"),
        ),
        Setting::new(
            "LAZULI_COMPILE_THREADS",
            compiler.pipelines.workers().threads(),
            source("LAZULI_COMPILE_THREADS"),
        ),
        Setting::new(
            "LAZULI_F16_PACKED",
            match compiler.stages.lower.f16 {
                crate::codegen::HalfStorage::Native => "off (native f16: the adapter has SHADER_F16)",
                crate::codegen::HalfStorage::Packed if ctx.shader_f16 && software => "on (software adapter)",
                crate::codegen::HalfStorage::Packed if ctx.shader_f16 => "on",
                crate::codegen::HalfStorage::Packed => "on (the adapter lacks SHADER_F16)",
            },
            source("LAZULI_F16_PACKED"),
        ),
        Setting::new(
            "LAZULI_COOPERATIVE_MATRIX",
            match (compiler.stages.lower.cooperative_matrix, ctx.cooperative_matrix) {
                (true, _) => "on",
                (false, true) => "off",
                (false, false) => "off (the adapter has no cooperative matrices as the tensor-core form needs)",
            },
            source("LAZULI_COOPERATIVE_MATRIX"),
        ),
    ]
}

impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn name(&self) -> String {
        self.inner.ctx.name.clone()
    }

    /// The settings, with what the persistent cache holds now (a scan of
    /// its directory, so only when asked: `lazuli info`).
    fn settings(&self) -> Vec<Setting> {
        let mut settings = self.inner.settings.clone();
        if let Some(disk) = self.inner.compiler.pipelines.disk() {
            if let Some(s) = settings.iter_mut().find(|s| s.variable == "LAZULI_CACHE_DIR") {
                s.value = format!("{} ({})", s.value, disk.contents());
            }
        }
        settings
    }

    fn set_profiling(&self, on: bool) -> bool {
        WgpuBackend::set_profiling(self, on)
    }

    fn take_profile(&self) -> Vec<LaunchSample> {
        WgpuBackend::take_profile(self)
    }

    fn supports(&self, node: &Node, inputs: &[&Node]) -> bool {
        self.inner.compiler.supports(&self.inner.ctx, node, inputs)
    }

    /// On a GPU: its kernels leave the host's cores idle. Not on a
    /// software adapter, whose kernels run on those cores.
    fn compiles_ahead(&self) -> bool {
        crate::device::platform::THREADS && !self.is_software()
    }

    fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError> {
        if !crate::codegen::dtype_stored(ty.dtype) {
            return Err(BackendError::Unsupported { backend: self.name(), op: "upload".into(), dtype: ty.dtype });
        }
        self.inner.ctx.upload(bytes, ty)
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        if !crate::device::platform::CAN_BLOCK {
            return Err(BackendError::WouldBlock {
                op: "reading a tensor".into(),
                device: self.name(),
                instead: "Tensor::to_vec_async (a CPU fallback segment cannot read GPU data in a tab: its ops \
                          need the CPU backend's device, or a form the GPU runs)"
                    .into(),
            });
        }
        self.inner.ctx.download(buffer)
    }

    fn download_async<'a>(&'a self, buffer: &'a Buffer) -> LocalFuture<'a, Result<Vec<u8>, BackendError>> {
        #[cfg(target_arch = "wasm32")]
        return Box::pin(crate::device::transfer::download_async(&self.inner.ctx, buffer));
        #[cfg(not(target_arch = "wasm32"))]
        Box::pin(std::future::ready(self.download(buffer)))
    }

    fn finish(&self) -> Result<(), BackendError> {
        if !crate::device::platform::CAN_BLOCK {
            return Err(BackendError::WouldBlock {
                op: "Device::wait".into(),
                device: self.name(),
                instead: "Device::wait_async".into(),
            });
        }
        // Natively, the last execution may still run (see
        // `WgpuOptions::overlap_submit`).
        #[cfg(not(target_arch = "wasm32"))]
        self.inner.ctx.settle()?;
        self.inner.ctx.deferred.take()
    }

    fn finish_async(&self) -> LocalFuture<'_, Result<(), BackendError>> {
        #[cfg(target_arch = "wasm32")]
        return Box::pin(crate::device::transfer::finish_async(&self.inner.ctx));
        #[cfg(not(target_arch = "wasm32"))]
        Box::pin(std::future::ready(self.finish()))
    }

    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError> {
        self.compile_with(graph, CompileHints::default())
    }

    /// Compiles `graph`; with `hints.sizes_vary` (and generic sizes on),
    /// kernels whose sizes differ from the earlier executable are lowered
    /// in forms independent of those sizes and compiled generic over all
    /// their sizes at once (see [`crate::rewrite::size_families`], `Compiler::compile`).
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
        // before this execution (see `crate::compile::autotune`), and generic
        // kernels by static ones (see `crate::compile::specialize`).
        self.specialize(exe);
        self.tune(exe);
        crate::execute::execute(&self.inner.ctx, &self.inner.profiler, exe, inputs, scalars)
    }

    fn persist_caches(&self) {
        // A device on this backend is being dropped: no compile of its
        // outlives it (see `crate::compile::specialize`).
        self.stop_background();
        self.inner.compiler.pipelines.flush();
    }

    fn pool_bytes(&self) -> u64 {
        self.inner.ctx.pool.bytes()
    }

    fn bytes_in_use(&self) -> u64 {
        self.inner.ctx.pool.stats().in_use_bytes
    }
}
