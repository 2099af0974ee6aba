//! The backend proper: device setup, compile (plan, lower, window,
//! validate, cache pipelines), execute (one command encoder per plan, one
//! submit, wait), upload and download in the canonical host byte format
//! (in chunks of at most `TRANSFER_CHUNK` bytes, so staging memory stays
//! bounded for tensors of any size). Tensors beyond one storage binding
//! are bound in windows (see [`crate::window`]).

use crate::adapter;
use crate::autotune::{self, Tuner};
use crate::binds::{self, BindCache, Binding};
use crate::codegen::{self, KernelForms, LowerError, LowerLimits, MatmulForm, ReduceForm, RowsForm, Wgsl};
use crate::diskcache::DiskCache;
use crate::generic::{self, Families};
use crate::pipeline::{PipelineCache, PipelineEntry};
use crate::pool::{self, Pool, PoolOptions, PoolStats, WgpuStorage};
use crate::validate::validate_wgsl;
use crate::window::{self, KernelWindows, Windows};
use lazuli_executor::{metrics, Backend, BackendError, BackendKind, Buffer, CompileHints, Executable, IndexError};
use lazuli_ir::fusion::{self, FusionLimits, FusionPlan, Kernel, KernelKind};
use lazuli_ir::{DType, Node, NodeId, Op, ScalarValue, ValueType, VerifiedGraph};
use std::any::Any;
use std::collections::HashMap;
use std::sync::Arc;
use wgpu::BufferUsages;

/// Options of [`WgpuBackend::new`].
#[derive(Clone, Debug, Default)]
pub struct WgpuOptions {
    /// Clamp of the storage buffers per kernel (planner and device limit);
    /// tests use it to force splitting.
    pub max_storage_buffers: Option<u32>,
    /// Clamp of the bytes one storage binding covers (tests): tensors
    /// larger than this are bound in windows of at most this many bytes
    /// (see [`crate::window`]), as tensors beyond the adapter's binding
    /// limit always are. Lets tests prove windowed kernels on small
    /// tensors.
    pub binding_window: Option<u64>,
    /// Substring of the adapter name to pick (else `WGPU_ADAPTER_NAME`,
    /// else the best adapter by type).
    pub adapter_name: Option<String>,
    /// Most bytes of freed buffers the buffer pool keeps for reuse. Else
    /// `LAZULI_POOL_BYTES` (a byte count; an invalid value is ignored with
    /// a warning), else derived from the adapter by
    /// [`pool::default_max_idle_bytes`]: 256 MiB on a software adapter,
    /// `4 x max_buffer_size` clamped to 8..128 GiB on a GPU, where the
    /// cache is released when an allocation fails instead.
    pub pool_max_free_bytes: Option<u64>,
    /// Most bytes of device buffers this backend holds at once (in use
    /// plus cached). Else `LAZULI_DEVICE_MEMORY_BYTES`, else no cap but the
    /// device's. An allocation over it releases cached buffers; if that is
    /// not enough it fails with `BackendError::OutOfMemory`.
    pub memory_budget: Option<u64>,
    /// Most cached pipelines (default 1024).
    pub pipeline_cache_size: Option<usize>,
    /// The kernel-form profile: `Some(KernelForms::gpu())` or
    /// `Some(KernelForms::software())` (or any mix) forces it on any
    /// adapter; by default the adapter type picks (software adapters the
    /// software profile, others the GPU one), and the environment variable
    /// `LAZULI_KERNEL_FORMS=gpu|software` overrides that default. Tests use
    /// it to prove every form on lavapipe.
    pub kernel_forms: Option<KernelForms>,
    /// Forces row-wise kernels (softmax, and reductions) to split rows
    /// over cooperating invocations (true) or not (false), on top of the
    /// profile.
    pub cooperative_rows: Option<bool>,
    /// Forces the tiled, workgroup-memory matmul (true: tile by shape) or
    /// the barrier-free register-blocked one (false), on top of the
    /// profile.
    pub tiled_matmul: Option<bool>,
    /// Whether to time candidate kernel forms on the adapter the first
    /// time a kernel is seen (see [`crate::autotune`]); default: on for
    /// GPUs, off for software adapters, `LAZULI_AUTOTUNE` overrides.
    pub autotune: Option<bool>,
    /// Where the autotuning results persist (default
    /// [`crate::autotune::cache_dir`]; `Some(None)`: nowhere).
    /// Also where the persistent compile cache lives (see
    /// [`crate::diskcache`]).
    pub cache_dir: Option<Option<std::path::PathBuf>>,
    /// Bound of the persistent compile cache in bytes (default
    /// `LAZULI_CACHE_MAX_BYTES`, else [`crate::diskcache::DEFAULT_MAX_BYTES`]).
    pub cache_max_bytes: Option<u64>,
    /// Whether kernels of graphs that differ only in sizes share generic
    /// pipelines (see [`crate::generic`]); default on,
    /// `LAZULI_GENERIC_SIZES=0` turns it off.
    pub generic_sizes: Option<bool>,
    /// Whether independent elementwise kernels of different shapes share
    /// one multi-tensor dispatch (see `lazuli_ir::fusion::multi`); default
    /// on, `LAZULI_MULTI_TENSOR=0` turns it off.
    pub multi_tensor: Option<bool>,
    /// Fault injection (tests only): kernels whose name contains this
    /// string compute a wrong value, for proving that shadow validation
    /// catches and names them.
    pub fault_kernel: Option<String>,
}

/// The wgpu backend.
#[derive(Clone)]
pub struct WgpuBackend {
    inner: Arc<Inner>,
}

struct Inner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    name: String,
    pool: Arc<Pool>,
    pipelines: PipelineCache,
    fusion: FusionLimits,
    lower: LowerLimits,
    /// Bytes between the error slots of one execution (the adapter's
    /// `min_storage_buffer_offset_alignment`, at least a slot's size).
    slot_stride: u64,
    /// How tensors beyond one binding are bound.
    windows: Windows,
    /// The largest buffer (`max_buffer_size`, a multiple of 4).
    max_buffer: u64,
    /// Loop iterations one invocation may run, where the adapter caps them
    /// silently (llvmpipe: [`codegen::LLVMPIPE_LOOP_BUDGET`]); `None` on GPUs.
    loop_budget: Option<u64>,
    /// The device has `TIMESTAMP_QUERY` (per-kernel GPU times).
    timestamps: bool,
    /// Per-kernel GPU times `(kernel, ms)` collected while profiling.
    profile: std::sync::Mutex<Option<Vec<(String, f64)>>>,
    fault_kernel: Option<String>,
    /// Bounded autotuning of kernel forms.
    tuner: Tuner,
    /// Families of kernels generic over sizes.
    families: Families,
    /// The last graph compiled per structure (`Graph::shape_free_hash`),
    /// and whether it compiled generic: the other sizes a size variant's
    /// kernels are compared against.
    earlier_sizes: std::sync::Mutex<lru::LruCache<u64, (VerifiedGraph, bool)>>,
    /// The persistent compile cache (see [`crate::diskcache`]).
    disk: Option<DiskCache>,
    /// The driver's pipeline cache, loaded from and saved to `disk`.
    driver_cache: Option<wgpu::PipelineCache>,
    /// Checksum of the driver cache blob last loaded or saved (an
    /// unchanged blob, e.g. lavapipe's always-empty one, is not written
    /// again).
    driver_saved: std::sync::atomic::AtomicU64,
}

/// Structures whose last compiled graph the backend keeps (see
/// `Inner::earlier_sizes`).
const EARLIER_SIZES: usize = 64;

/// Kind of the driver pipeline cache entry in the disk cache.
const DRIVER_CACHE: &str = "pipelines";

impl Inner {
    /// Saves the driver's pipeline cache in the disk cache when its blob
    /// changed since it was last loaded or saved.
    fn save_driver_cache(&self) {
        let (Some(disk), Some(cache)) = (&self.disk, &self.driver_cache) else { return };
        if let Some(data) = cache.get_data() {
            let sum = crate::diskcache::checksum(&[&data]);
            if self.driver_saved.swap(sum, std::sync::atomic::Ordering::Relaxed) != sum {
                disk.put(DRIVER_CACHE, b"", &data);
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.save_driver_cache();
    }
}

const STORAGE: BufferUsages = BufferUsages::STORAGE.union(BufferUsages::COPY_SRC).union(BufferUsages::COPY_DST);
const UNIFORM: BufferUsages = BufferUsages::UNIFORM.union(BufferUsages::COPY_DST);
const READBACK: BufferUsages = BufferUsages::MAP_READ.union(BufferUsages::COPY_DST);

/// Bytes of one error slot: the claim flag and the index's bits (see
/// `codegen::index`).
const ERROR_SLOT_BYTES: u64 = 8;

/// Bytes one step of an upload or readback moves: bounds the staging
/// memory of a transfer (host-visible memory; on lavapipe, host RAM) to
/// one chunk, whatever the tensor's size.
const TRANSFER_CHUNK: u64 = 64 << 20;

/// The kernel forms for `options` on an adapter of type `device_type`
/// (see [`WgpuOptions::kernel_forms`]).
pub fn kernel_forms(options: &WgpuOptions, device_type: wgpu::DeviceType) -> KernelForms {
    let software = device_type == wgpu::DeviceType::Cpu;
    let mut forms = options.kernel_forms.unwrap_or_else(|| match std::env::var("LAZULI_KERNEL_FORMS").as_deref() {
        Ok("gpu") => KernelForms::gpu(),
        Ok("software") => KernelForms::software(),
        _ if software => KernelForms::software(),
        _ => KernelForms::gpu(),
    });
    if let Some(c) = options.cooperative_rows {
        forms.rows = if c { RowsForm::Cooperative } else { RowsForm::PerRow };
        forms.reduce = if c { ReduceForm::Cooperative } else { ReduceForm::PerOutput };
    }
    if let Some(t) = options.tiled_matmul {
        forms.matmul = if t { MatmulForm::ByShape } else { MatmulForm::RegisterBlocked };
    }
    forms
}

fn device_err(name: &str, message: impl ToString) -> BackendError {
    BackendError::Device { device: name.to_string(), message: message.to_string() }
}

impl WgpuBackend {
    /// Opens an adapter and device. Fails with `BackendError::Device` when
    /// no adapter matches.
    pub fn new(options: WgpuOptions) -> Result<WgpuBackend, BackendError> {
        let inst = adapter::instance();
        let a = adapter::select(&inst, options.adapter_name.as_deref())
            .ok_or_else(|| device_err("wgpu", "no adapter found"))?;
        let info = a.get_info();
        let name = format!("wgpu: {} ({:?}, {:?})", info.name, info.backend, info.device_type);
        let limits = a.limits();
        let (device, queue) = pollster::block_on(a.request_device(&wgpu::DeviceDescriptor {
            label: Some("lazuli"),
            required_features: a.features() & (wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::PIPELINE_CACHE),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| device_err(&name, e))?;
        let log_name = name.clone();
        device.on_uncaptured_error(Arc::new(move |e| {
            tracing::error!(device = %log_name, "uncaptured wgpu error: {e}");
        }));
        // Every binding of a kernel sits in one bind group: the uniform of
        // lifted scalars beside the storage buffers.
        let mut max_sb = (limits.max_storage_buffers_per_shader_stage as usize)
            .min((limits.max_bindings_per_bind_group as usize).saturating_sub(1));
        if let Some(m) = options.max_storage_buffers {
            max_sb = max_sb.min(m as usize);
        }
        let max_binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
        let windows = Windows::new(max_binding, limits.min_storage_buffer_offset_alignment, options.binding_window);
        let pool = Pool::new(
            device.clone(),
            PoolOptions {
                max_idle_bytes: options
                    .pool_max_free_bytes
                    .or_else(|| pool::env_bytes("LAZULI_POOL_BYTES"))
                    .unwrap_or_else(|| pool::default_max_idle_bytes(info.device_type, limits.max_buffer_size)),
                memory_budget: options.memory_budget.or_else(|| pool::env_bytes("LAZULI_DEVICE_MEMORY_BYTES")),
                max_buffer_size: limits.max_buffer_size,
                max_storage_binding: max_binding,
                device_name: name.clone(),
            },
        );
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
        );
        let mut driver_loaded = 0;
        let driver_cache = match &disk {
            Some(d) if device.features().contains(wgpu::Features::PIPELINE_CACHE) => {
                let data = d.get(DRIVER_CACHE, b"");
                driver_loaded = data.as_deref().map_or(0, |b| crate::diskcache::checksum(&[b]));
                Some(crate::diskcache::driver_cache(&device, data.as_deref()))
            }
            _ => None,
        };
        Ok(WgpuBackend {
            inner: Arc::new(Inner {
                device,
                queue,
                name,
                pool,
                pipelines: PipelineCache::new(options.pipeline_cache_size.unwrap_or(1024)),
                fusion: FusionLimits {
                    // One storage buffer per kernel is kept for the sizes
                    // of generic kernels (see `crate::generic`).
                    max_storage_buffers: max_sb.saturating_sub(1).max(3),
                    matmul_epilogue: true,
                    inline_outputs: true,
                    // Row kernels cooperate through workgroup memory: the
                    // GPU form of reductions.
                    row_kernels: forms.reduce == ReduceForm::Cooperative,
                    // Independent elementwise kernels share a dispatch.
                    multi_tensor: options
                        .multi_tensor
                        .unwrap_or_else(|| std::env::var("LAZULI_MULTI_TENSOR").map_or(true, |v| v != "0")),
                    window_elements: windows.elements(),
                    ..FusionLimits::default()
                },
                lower: LowerLimits {
                    forms,
                    workgroup_storage: limits.max_compute_workgroup_storage_size,
                    ..LowerLimits::default()
                },
                slot_stride: (limits.min_storage_buffer_offset_alignment as u64).max(ERROR_SLOT_BYTES),
                windows,
                max_buffer: limits.max_buffer_size & !3,
                loop_budget: (info.device_type == wgpu::DeviceType::Cpu).then_some(codegen::LLVMPIPE_LOOP_BUDGET),
                timestamps: a.features().contains(wgpu::Features::TIMESTAMP_QUERY),
                profile: std::sync::Mutex::new(None),
                fault_kernel: options.fault_kernel.clone(),
                families: Families::new(generic::enabled(options.generic_sizes), 4096),
                earlier_sizes: std::sync::Mutex::new(lru::LruCache::new(
                    std::num::NonZeroUsize::new(EARLIER_SIZES).expect("non-zero"),
                )),
                tuner: Tuner::new(
                    autotune::enabled(options.autotune, info.device_type == wgpu::DeviceType::Cpu),
                    &adapter_id,
                    cache_dir.as_deref(),
                ),
                disk,
                driver_cache,
                driver_saved: std::sync::atomic::AtomicU64::new(driver_loaded),
            }),
        })
    }

    /// The fusion limits this backend plans with.
    pub fn fusion_limits(&self) -> FusionLimits {
        self.inner.fusion
    }

    /// Idle bytes in the buffer pool.
    pub fn pool_free_bytes(&self) -> u64 {
        self.inner.pool.free_bytes()
    }

    /// Bytes of the buffer pool in use and idle.
    pub fn pool_stats(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    /// The buffer pool (for tests and tools that allocate directly).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.inner.pool
    }

    /// Number of cached pipelines.
    pub fn cached_pipelines(&self) -> usize {
        self.inner.pipelines.len()
    }

    /// Whether the adapter is a software rasterizer (llvmpipe / lavapipe,
    /// wgpu's `DeviceType::Cpu`).
    pub fn is_software(&self) -> bool {
        self.inner.loop_budget.is_some()
    }

    /// Whether this adapter can time kernels (wgpu `TIMESTAMP_QUERY`).
    pub fn supports_profiling(&self) -> bool {
        self.inner.timestamps
    }

    /// Starts (or stops) collecting per-kernel GPU times: while on, every
    /// kernel runs in its own compute pass with timestamp queries. Returns
    /// false (and collects nothing) when the adapter cannot time kernels.
    pub fn set_profiling(&self, on: bool) -> bool {
        let mut p = self.inner.profile.lock().unwrap_or_else(|e| e.into_inner());
        *p = (on && self.inner.timestamps).then(Vec::new);
        p.is_some()
    }

    /// The per-kernel GPU times `(kernel name, ms)` collected since the
    /// last call, in launch order.
    pub fn take_profile(&self) -> Vec<(String, f64)> {
        self.inner.profile.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn profiling(&self) -> bool {
        self.inner.profile.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn record_profile(&self, read: &wgpu::Buffer, names: &[&str]) -> Result<(), BackendError> {
        let times = self.read_timestamps(read, names.len())?;
        let mut p = self.inner.profile.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = p.as_mut() {
            p.extend(names.iter().zip(times).map(|(name, ms)| (name.to_string(), ms)));
        }
        Ok(())
    }

    /// Maps the first `pairs` resolved timestamp pairs (begin and end of a
    /// pass) of `read` after the device is done and returns each pair's
    /// time in ms.
    fn read_timestamps(&self, read: &wgpu::Buffer, pairs: usize) -> Result<Vec<f64>, BackendError> {
        let bytes = pairs as u64 * 16;
        let (tx, rx) = std::sync::mpsc::channel();
        read.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv().map_err(|e| device_err(&self.inner.name, e))?.map_err(|e| device_err(&self.inner.name, e))?;
        let period = self.inner.queue.get_timestamp_period() as f64;
        let times: Vec<f64> = {
            let view = read.get_mapped_range(0..bytes).map_err(|e| device_err(&self.inner.name, e))?;
            bytemuck::cast_slice::<u8, u64>(&view)
                .chunks_exact(2)
                .map(|t| t[1].saturating_sub(t[0]) as f64 * period / 1e6)
                .collect()
        };
        read.unmap();
        Ok(times)
    }

    /// A bind group of `layout` binding `bufs` whole, in binding order.
    fn bind_group(&self, layout: &wgpu::BindGroupLayout, bufs: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        binds::create_whole(&self.inner.device, layout, bufs)
    }

    /// The bindings of bind group 0 of a launch: the uniform, then each
    /// storage buffer of `storage` whole or, where `windows` says so, as
    /// that many windows (see [`crate::window`]), then the error slot at
    /// byte `offset` of a buffer, if any.
    fn bindings<'b>(
        &self,
        uniform: &'b WgpuStorage,
        storage: &[&'b WgpuStorage],
        windows: &[u32],
        slot: Option<(&'b WgpuStorage, u64)>,
    ) -> Vec<Binding<'b>> {
        debug_assert_eq!(storage.len(), windows.len());
        let mut out = Vec::with_capacity(storage.len() + 2);
        out.push(Binding::whole(uniform));
        for (&b, &w) in storage.iter().zip(windows) {
            if w <= 1 {
                out.push(Binding::whole(b));
                continue;
            }
            for (offset, size) in self.inner.windows.ranges(b.buffer().size(), w) {
                out.push(Binding { storage: b, offset, size });
            }
        }
        if let Some((storage, offset)) = slot {
            out.push(Binding { storage, offset, size: ERROR_SLOT_BYTES });
        }
        out
    }

    /// Bind group 1 of a generic kernel: a small storage buffer holding
    /// its dynamic sizes `dims`, made once per compiled kernel.
    fn dims_group(&self, layout: &wgpu::BindGroupLayout, dims: &[u32]) -> wgpu::BindGroup {
        use wgpu::util::DeviceExt as _;
        let buffer = self.inner.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lazuli sizes"),
            contents: bytemuck::cast_slice(dims),
            usage: BufferUsages::STORAGE,
        });
        self.bind_group(layout, &[&buffer])
    }

    /// The uniform buffer of a launch: `P.z` (0), then one 32-bit word per
    /// lifted scalar of `dtypes` (`values`, or zeros when `None`), padded
    /// to 16 bytes.
    fn uniform(&self, dtypes: &[DType], values: Option<&[ScalarValue]>) -> Result<WgpuStorage, BackendError> {
        let words = uniform_words(dtypes, values);
        let uniform = self.inner.pool.acquire(words.len() as u64 * 4, UNIFORM)?;
        self.inner.queue.write_buffer(uniform.buffer(), 0, bytemuck::cast_slice(&words));
        Ok(uniform)
    }

    /// The wgpu device (for hand-written baseline kernels).
    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    /// The wgpu queue (for hand-written baseline kernels).
    pub fn wgpu_queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    /// Creates the pipeline of `k` (validated first), with bind group 1
    /// for its dynamic sizes when it is generic.
    /// `key` is its [`PipelineCache::key`], which also names its naga mark
    /// in the disk cache.
    fn create_pipeline(&self, k: &Prepared, key: u64) -> Result<PipelineEntry, BackendError> {
        let name = k.name.as_str();
        crate::validate::log_source(&k.source);
        let started = std::time::Instant::now();
        // A source that passed naga in an earlier process of this build
        // (the key hashes the source and entry point) is not validated
        // again; wgpu still validates it when it makes the module.
        let mark = key.to_le_bytes();
        let known = self.inner.disk.as_ref().is_some_and(|d| d.get("naga", &mark).is_some());
        if !known {
            metrics::inc("NagaValidations", 1);
            validate_wgsl(&k.source).map_err(|m| BackendError::Compile {
                kernel: name.to_string(),
                message: format!("{m}\n{}", k.source),
            })?;
            if let Some(d) = &self.inner.disk {
                d.put("naga", &mark, b"valid");
            }
        }
        metrics::record_time("CompileNaga", started.elapsed());
        let started = std::time::Instant::now();
        let dev = &self.inner.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = dev.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(k.source.as_str().into()),
        });
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let uniform = |binding: u32| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let mut entries = vec![uniform(0)];
        for i in 0..k.inputs {
            entries.push(storage(1 + i as u32, true));
        }
        for i in 0..k.outputs {
            entries.push(storage((1 + k.inputs + i) as u32, false));
        }
        if k.error_slot {
            entries.push(storage((1 + k.inputs + k.outputs) as u32, false));
        }
        let layout =
            dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(name), entries: &entries });
        let dims_layout = (!k.dims.is_empty()).then(|| {
            dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(name),
                entries: &[storage(0, true)],
            })
        });
        let pl = dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(name),
            bind_group_layouts: &[Some(&layout), dims_layout.as_ref()],
            immediate_size: 0,
        });
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some(k.entry),
            // Every generated kernel writes its workgroup memory before it
            // reads it (tree buffers, matmul tiles), so the zero-fill wgpu
            // inserts by default is pure cost.
            compilation_options: wgpu::PipelineCompilationOptions {
                zero_initialize_workgroup_memory: false,
                ..Default::default()
            },
            cache: self.inner.driver_cache.as_ref(),
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(BackendError::Compile { kernel: name.to_string(), message: format!("{e}\n{}", k.source) });
        }
        metrics::record_time("CompilePipeline", started.elapsed());
        Ok(PipelineEntry { pipeline, layout, dims_layout })
    }

    /// Pipelines for `kernels`, from the cache or created (validated
    /// first), the missing ones on several threads at once.
    fn pipelines(&self, kernels: &[Prepared]) -> Result<Vec<Arc<PipelineEntry>>, BackendError> {
        let keys: Vec<u64> = kernels.iter().map(|k| PipelineCache::key(&k.source, k.entry)).collect();
        let mut found: HashMap<u64, Arc<PipelineEntry>> = HashMap::new();
        // One creation per distinct missing source.
        let mut missing: Vec<usize> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, &key) in keys.iter().enumerate() {
            if !seen.insert(key) {
                continue;
            }
            match self.inner.pipelines.get(key) {
                Some(p) => {
                    found.insert(key, p);
                }
                None => missing.push(i),
            }
        }
        let threads = compile_threads().min(missing.len());
        let created: Vec<Result<PipelineEntry, BackendError>> = if threads <= 1 {
            missing.iter().map(|&i| self.create_pipeline(&kernels[i], keys[i])).collect()
        } else {
            let next = std::sync::atomic::AtomicUsize::new(0);
            let slots: Vec<std::sync::Mutex<Option<Result<PipelineEntry, BackendError>>>> =
                missing.iter().map(|_| std::sync::Mutex::new(None)).collect();
            std::thread::scope(|scope| {
                for _ in 0..threads {
                    scope.spawn(|| loop {
                        let j = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&i) = missing.get(j) else { break };
                        let made = self.create_pipeline(&kernels[i], keys[i]);
                        *slots[j].lock().unwrap_or_else(|e| e.into_inner()) = Some(made);
                    });
                }
            });
            slots
                .into_iter()
                .map(|s| {
                    s.into_inner().unwrap_or_else(|e| e.into_inner()).unwrap_or_else(|| {
                        Err(BackendError::Execution("a pipeline-creation thread stopped early".into()))
                    })
                })
                .collect()
        };
        for (&i, made) in missing.iter().zip(created) {
            let entry = Arc::new(made?);
            self.inner.pipelines.insert(keys[i], entry.clone());
            found.insert(keys[i], entry);
        }
        if !missing.is_empty() {
            // Saved at once: a process may end without dropping its
            // device.
            self.inner.save_driver_cache();
        }
        Ok(keys.iter().map(|k| found[k].clone()).collect())
    }

    fn storage<'b>(&self, b: &'b Buffer) -> Result<&'b WgpuStorage, BackendError> {
        b.storage
            .as_any()
            .downcast_ref::<WgpuStorage>()
            .ok_or_else(|| BackendError::Execution(format!("buffer of {} is not a wgpu buffer", b.kind)))
    }

    /// A pool buffer for a value of type `ty`, preferring the buffers of
    /// ids `prefer` (see [`Pool::acquire_preferring`]); `what` names the
    /// value in errors (made only then: this runs for every node of every
    /// execution).
    fn new_buffer(
        &self,
        ty: &ValueType,
        prefer: &[u64],
        what: impl FnOnce() -> String,
    ) -> Result<Buffer, BackendError> {
        let bytes = (ty.shape.numel() as u64).saturating_mul(4).max(4);
        if bytes > self.inner.max_buffer {
            return Err(BackendError::TooLarge {
                op: what(),
                bytes,
                limit: self.inner.max_buffer,
                limit_name: "the device's largest buffer (max_buffer_size)".into(),
            });
        }
        let st = self.inner.pool.acquire_preferring(bytes, STORAGE, prefer)?;
        Ok(Buffer { storage: Arc::new(st), ty: ty.clone(), kind: BackendKind::Wgpu })
    }

    /// An empty host vector with room for `n` elements (upload and
    /// readback staging on the host side); a refused allocation is
    /// `OutOfMemory`, never an abort.
    fn host_vec<T>(&self, n: usize, what: &str) -> Result<Vec<T>, BackendError> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory {
            bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            in_use: self.inner.pool.stats().in_use_bytes,
            device: format!("{}: the host allocator refused the {what} staging vector", self.inner.name),
        })?;
        Ok(v)
    }

    fn lower(&self, k: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Wgsl, BackendError> {
        codegen::lower(k, graph, limits).map_err(|e| match e {
            LowerError::Unsupported { op, dtype } => {
                BackendError::Unsupported { backend: self.inner.name.clone(), op, dtype }
            }
            LowerError::TooLarge { op, elements } => BackendError::TooLarge {
                op,
                bytes: elements.saturating_mul(4),
                limit: limits.max_elements * 4,
                limit_name: "what kernels index with u32 element indices".into(),
            },
        })
    }

    /// The graph last compiled with the structure of `graph` but other
    /// sizes, when it compiled static (a generic one's sources are already
    /// members of their families); remembers `graph` as the structure's
    /// last, compiled generic or not.
    fn earlier_sizes(&self, graph: &VerifiedGraph, generic: bool) -> Option<VerifiedGraph> {
        let mut seen = self.inner.earlier_sizes.lock().unwrap_or_else(|e| e.into_inner());
        let before = seen.put(graph.shape_free_hash(), (graph.clone(), generic));
        before.filter(|(b, was_generic)| !was_generic && **b != **graph).map(|(b, _)| b)
    }

    /// Lowers `earlier` (a graph of the structure about to compile, at
    /// other sizes) in the size-independent forms and records its sources
    /// in their families without compiling them (`Families::observe`):
    /// the new size's kernels then turn every literal that differs between
    /// the two sizes dynamic in one widening, rather than compiling as
    /// static first members of new families and widening at the next size.
    /// A kernel that does not lower, or whose tensors need windows, is
    /// skipped; the real compile reports its own errors.
    fn observe_sizes(&self, earlier: &VerifiedGraph) {
        let plan = fusion::plan(earlier, &self.inner.fusion);
        let limits = LowerLimits { generic: true, ..self.inner.lower };
        for k in &plan.kernels {
            let Ok(wgsl) = self.lower(k, earlier, &limits) else { continue };
            if KernelWindows::of(k, earlier, &wgsl, &self.inner.windows).is_windowed() {
                continue; // its source would be rewritten; leave it static
            }
            self.inner.families.observe(&wgsl.source, wgsl.entry);
            if let Some(pre) = &wgsl.pre {
                self.inner.families.observe(&pre.source, pre.entry);
            }
        }
    }

    /// Windows kernel `k` (named `name`), lowered as `wgsl`, for its
    /// tensors beyond one binding (see [`crate::window`]): rewrites the
    /// source and binding counts where needed. A kernel needing more
    /// storage bindings than the adapter allows, or whose source cannot
    /// be windowed, is `BackendError::TooLarge` naming its op, its bytes
    /// and the limit.
    fn window(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        name: &str,
        wgsl: &mut Wgsl,
    ) -> Result<KernelWindows, BackendError> {
        let w = self.inner.windows;
        let kw = KernelWindows::of(k, graph, wgsl, &w);
        if !kw.is_windowed() {
            return Ok(kw);
        }
        let ids = k.inputs.iter().chain(&k.outputs);
        let bytes: u64 = ids.clone().map(|id| graph.node(*id).shape.numel() as u64 * 4).sum();
        let largest = ids.max_by_key(|id| graph.node(**id).shape.numel()).expect("a kernel has an output");
        let op = format!("{} (kernel {name})", graph.node(*largest).op.name());
        let max = self.inner.fusion.max_storage_buffers;
        // The error slot of a kernel that checks indices is a binding too.
        let bindings = kw.bindings() + wgsl.error_slot as usize;
        if bindings > max {
            return Err(BackendError::TooLarge {
                op: format!("{op}, {bindings} storage bindings in windows of {} bytes", w.bytes()),
                bytes,
                limit: max as u64 * w.bytes(),
                limit_name: format!("what one kernel can bind ({max} storage bindings)"),
            });
        }
        window::apply(wgsl, &kw, &w).map_err(|e| BackendError::TooLarge {
            op: format!("{op}: this kernel cannot be windowed ({e})"),
            bytes,
            limit: w.bytes(),
            limit_name: "one storage binding".into(),
        })?;
        metrics::inc("WindowedKernels", 1);
        Ok(kw)
    }

    /// A validated pipeline for `wgsl` as it is (no generic sizes), from
    /// the pipeline cache or created.
    fn pipeline_for(&self, name: &str, wgsl: &Wgsl) -> Result<Arc<PipelineEntry>, BackendError> {
        let k = Prepared::fixed(name.to_string(), wgsl);
        Ok(self.pipelines(std::slice::from_ref(&k))?.remove(0))
    }

    /// The lowering limits for kernel `k`: the backend's, with the matmul
    /// form the tuner picked where tuning is on (see [`crate::autotune`]).
    fn tuned_limits(&self, k: &Kernel, graph: &VerifiedGraph, name: &str) -> Result<LowerLimits, BackendError> {
        let base = self.inner.lower;
        let tuner = &self.inner.tuner;
        if k.kind != KernelKind::MatMul || !tuner.enabled() || base.forms.matmul != MatmulForm::ByShape {
            return Ok(base);
        }
        // Candidates are timed on whole-buffer bindings: a kernel with
        // windowed tensors keeps the form its shape asks for.
        let w = self.inner.windows;
        if k.inputs.iter().chain(&k.outputs).any(|id| w.count(graph.node(*id).shape.numel() as u64) > 1) {
            return Ok(base);
        }
        let with = |form: MatmulForm| {
            let mut l = base;
            l.forms.matmul = form;
            l
        };
        let key = tuner.key("matmul", &self.lower(k, graph, &base)?.source);
        if let Some(form) = tuner.known(key) {
            return Ok(with(form));
        }
        if !tuner.budget_left() {
            return Ok(base);
        }
        let start = std::time::Instant::now();
        let mut measuring = std::time::Duration::ZERO;
        let mut best: Option<(f64, MatmulForm)> = None;
        for form in codegen::matmul::candidates(k, graph) {
            if best.is_some() && measuring >= autotune::KEY_BUDGET {
                break;
            }
            let limits = with(form);
            if codegen::matmul::resolve_form(k, graph, &limits) != form {
                continue; // not available on this adapter (workgroup memory)
            }
            let wgsl = self.lower(k, graph, &limits)?;
            let pipeline = self.pipeline_for(&format!("{name} tune {form:?}"), &wgsl)?;
            let t = std::time::Instant::now();
            let ms = self.time_kernel(k, graph, &wgsl, &pipeline);
            measuring += t.elapsed();
            metrics::inc("AutotuneRuns", 1);
            match ms {
                Ok(ms) => {
                    tracing::debug!(kernel = name, ?form, ms, "autotune candidate");
                    if best.is_none_or(|(b, _)| ms < b) {
                        best = Some((ms, form));
                    }
                }
                Err(e) => tracing::warn!(kernel = name, ?form, "autotune candidate failed: {e}"),
            }
        }
        match best {
            Some((_, form)) => {
                tuner.record(key, form, start.elapsed());
                Ok(with(form))
            }
            None => {
                tuner.spend(start.elapsed());
                Ok(base)
            }
        }
    }

    /// The GPU time in ms of one run of kernel `k` lowered as `wgsl`, on
    /// scratch buffers (contents irrelevant to a matmul's speed): the
    /// fastest of [`autotune::RUNS`] runs after a warm-up, from timestamp
    /// queries where the adapter has them, else wall time to a device wait.
    fn time_kernel(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        wgsl: &Wgsl,
        pipeline: &PipelineEntry,
    ) -> Result<f64, BackendError> {
        let dev = &self.inner.device;
        let uniform = self.uniform(&graph.scalars, None)?;
        let mut scratch = Vec::new();
        for &id in k.inputs.iter().chain(&k.outputs) {
            let bytes = (graph.node(id).shape.numel() as u64 * 4).max(4);
            scratch.push(self.inner.pool.acquire(bytes, STORAGE)?);
        }
        let mut bufs = vec![uniform.buffer()];
        bufs.extend(scratch.iter().map(|b| b.buffer()));
        let bg = self.bind_group(&pipeline.layout, &bufs);
        let (x, y) = dispatch_size(wgsl.invocations, wgsl.workgroup_size);
        let runs = autotune::RUNS + 1;
        let mut best = f64::INFINITY;
        if self.inner.timestamps {
            let n = 2 * runs as u32;
            let set = dev.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("lazuli autotune"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            });
            let resolve =
                self.inner.pool.acquire(n as u64 * 8, BufferUsages::QUERY_RESOLVE | BufferUsages::COPY_SRC)?;
            let read = self.inner.pool.acquire(n as u64 * 8, READBACK)?;
            let mut enc = dev.create_command_encoder(&Default::default());
            for r in 0..runs as u32 {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(2 * r),
                        end_of_pass_write_index: Some(2 * r + 1),
                    }),
                });
                pass.set_pipeline(&pipeline.pipeline);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(x, y, 1);
            }
            enc.resolve_query_set(&set, 0..n, resolve.buffer(), 0);
            enc.copy_buffer_to_buffer(resolve.buffer(), 0, read.buffer(), 0, n as u64 * 8);
            self.inner.queue.submit([enc.finish()]);
            // Run 0 is the warm-up.
            best = self.read_timestamps(read.buffer(), runs)?.into_iter().skip(1).fold(f64::INFINITY, f64::min);
        } else {
            for r in 0..runs {
                let t = std::time::Instant::now();
                let mut enc = dev.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline.pipeline);
                    pass.set_bind_group(0, &bg, &[]);
                    pass.dispatch_workgroups(x, y, 1);
                }
                self.inner.queue.submit([enc.finish()]);
                self.wait()?;
                if r > 0 {
                    best = best.min(t.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        Ok(best)
    }

    fn wait(&self) -> Result<(), BackendError> {
        self.inner
            .device
            .poll(wgpu::PollType::Wait { submission_index: None, timeout: None })
            .map(|_| ())
            .map_err(|e| device_err(&self.inner.name, e))
    }
}

/// A compiled plan: the graph, its kernels and their pipelines.
pub struct WgpuExecutable {
    graph: VerifiedGraph,
    plan: FusionPlan,
    kernels: Vec<CompiledKernel>,
    /// The buffers of an execution, in order: parameters, then every
    /// materialized node.
    buffers: Vec<Bound>,
    /// Per node, its index in `buffers` (`u32::MAX`: none).
    slot: Vec<u32>,
    /// Bind groups and buffer history, reused across executions.
    binds: std::sync::Mutex<BindCache>,
}

/// Where a buffer of an execution comes from.
#[derive(Clone, Copy, Debug)]
enum Bound {
    /// Input (graph parameter) `i`.
    Input(usize),
    /// A node the plan materializes, in a buffer from the pool.
    Node(NodeId),
}

struct CompiledKernel {
    name: String,
    wgsl: Wgsl,
    pipeline: Arc<PipelineEntry>,
    /// Bind group 1 of a generic pipeline: this kernel's sizes.
    dims: Option<wgpu::BindGroup>,
    /// The pipeline of `wgsl.pre`, the first pass, if any, and its sizes.
    pre: Option<(Arc<PipelineEntry>, Option<wgpu::BindGroup>)>,
    /// Windows of each storage buffer of both passes (see
    /// [`crate::window`]).
    windows: KernelWindows,
}

/// A kernel ready for pipeline creation: the source to compile (generic
/// over sizes or not) and the values of its dynamic sizes.
struct Prepared {
    name: String,
    source: String,
    entry: &'static str,
    inputs: usize,
    outputs: usize,
    /// Binds an error slot after its outputs.
    error_slot: bool,
    /// Values of the uniform `LZD` (empty: a static kernel).
    dims: Vec<u32>,
}

impl Prepared {
    /// `wgsl` as it is.
    fn fixed(name: String, wgsl: &Wgsl) -> Prepared {
        Prepared {
            name,
            source: wgsl.source.clone(),
            entry: wgsl.entry,
            inputs: wgsl.inputs,
            outputs: wgsl.outputs,
            error_slot: wgsl.error_slot,
            dims: Vec::new(),
        }
    }
}

/// Threads creating the pipelines of one plan: the machine's cores, at
/// most 8, or `LAZULI_COMPILE_THREADS`.
fn compile_threads() -> usize {
    std::env::var("LAZULI_COMPILE_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(8))
        .max(1)
}

/// One dispatch of an execution.
struct Launch<'a> {
    kernel: &'a CompiledKernel,
    /// The first pass of a two-pass kernel.
    first_pass: bool,
    pipeline: &'a wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    /// Bind group 1 of a generic pipeline.
    dims: Option<&'a wgpu::BindGroup>,
    groups: (u32, u32),
}

impl Launch<'_> {
    /// The launch's name in profiles.
    fn name(&self) -> String {
        if self.first_pass {
            format!("{}_pass1", self.kernel.name)
        } else {
            self.kernel.name.clone()
        }
    }
}

/// The 2-D dispatch size for `invocations` in workgroups of `size`.
fn dispatch_size(invocations: u64, size: u32) -> (u32, u32) {
    let groups = invocations.div_ceil(size.max(1) as u64);
    let (x, y) = if groups > 65535 { (65535, groups.div_ceil(65535)) } else { (groups, 1) };
    (x as u32, y as u32)
}

impl WgpuExecutable {
    /// The fusion plan.
    pub fn plan(&self) -> &FusionPlan {
        &self.plan
    }
}

impl Executable for WgpuExecutable {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn kernel_count(&self) -> usize {
        self.kernels.iter().filter(|k| k.wgsl.invocations > 0).count()
    }
    fn kernel_sources(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        for k in &self.kernels {
            if let Some(p) = &k.wgsl.pre {
                v.push((format!("{}_pass1", k.name), p.source.clone()));
            }
            v.push((k.name.clone(), k.wgsl.source.clone()));
        }
        v
    }
    fn kernels(&self) -> Vec<lazuli_executor::KernelInfo> {
        self.kernels
            .iter()
            .zip(&self.plan.kernels)
            .map(|(c, k)| {
                let mut nodes: Vec<NodeId> = k.inline.iter().chain(&k.outputs).copied().collect();
                nodes.sort();
                nodes.dedup();
                lazuli_executor::KernelInfo {
                    name: c.name.clone(),
                    source: c.wgsl.source.clone(),
                    nodes,
                    outputs: k.outputs.clone(),
                }
            })
            .collect()
    }
}

fn gpu_dtype(d: DType) -> bool {
    codegen::dtype_supported(d)
}

impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn name(&self) -> String {
        self.inner.name.clone()
    }

    fn supports(&self, node: &Node, inputs: &[&Node]) -> bool {
        // On a software adapter that silently caps loop iterations, kernels
        // that walk one line per invocation would return wrong values for
        // lines longer than the cap: such nodes run on the CPU fallback.
        let within_budget = match self.inner.loop_budget {
            None => true,
            Some(budget) => {
                let along = |axis: usize| inputs.first().map_or(0, |x| x.shape.dims()[axis] as u64);
                match &node.op {
                    Op::ArgReduce { axis, .. } | Op::CumSum { axis, .. } | Op::Softmax { axis, .. } => {
                        along(*axis) <= budget
                    }
                    Op::MatMul => {
                        inputs.first().and_then(|a| a.shape.dims().last()).is_none_or(|&k| k as u64 <= budget)
                    }
                    Op::ScatterAdd { axis } => {
                        let m = inputs.get(1).map_or(0, |i| i.shape.numel() as u64);
                        let inner = node.shape.dims()[axis + 1..].iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
                        codegen::index::scatter_loop_iterations(self.inner.lower.forms.scatter, m, inner) <= budget
                    }
                    Op::Pool(p) => codegen::pool::pool_loop_iterations(p, false) <= budget,
                    Op::PoolGrad(p) => codegen::pool::pool_loop_iterations(p, true) <= budget,
                    Op::Conv2d(_) => inputs
                        .get(1)
                        .is_none_or(|w| codegen::conv::loop_iterations(self.inner.lower.forms.conv, node, w) <= budget),
                    Op::Attention { .. } => {
                        codegen::attention::within_loop_budget(node, inputs, self.inner.lower.forms.attention, budget)
                    }
                    _ => true,
                }
            }
        };
        // An attention part binds all its operands but the cheap leaves;
        // one that needs more buffers than a kernel may bind (a masked
        // gradient on an adapter with WebGPU's minimum of 8) cannot be
        // split, so it runs on the fallback. Counted without windows: a
        // tensor's size never sends a node elsewhere, and a part whose
        // windows exceed the limit is `BackendError::TooLarge` at compile
        // time like any kernel's (see `WgpuBackend::window`).
        let fits = !matches!(node.op, Op::Attention { .. })
            || inputs
                .iter()
                .filter(|n| !matches!(n.op, Op::Constant(..) | Op::ScalarParam(_) | Op::Iota { .. }))
                .count()
                < self.inner.fusion.max_storage_buffers;
        within_budget && fits && codegen::node_supported(node) && inputs.iter().all(|n| gpu_dtype(n.dtype))
    }

    fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError> {
        if !gpu_dtype(ty.dtype) {
            return Err(BackendError::Unsupported { backend: self.name(), op: "upload".into(), dtype: ty.dtype });
        }
        let n = ty.shape.numel();
        debug_assert_eq!(bytes.len(), n * ty.dtype.size_bytes());
        let buf = self.new_buffer(ty, &[], || "upload".into())?;
        let st = self.storage(&buf)?;
        // In chunks, each written and submitted before the next, so the
        // staging copy wgpu makes stays one chunk.
        let step = TRANSFER_CHUNK as usize / 4;
        let chunks = n.div_ceil(step);
        for c in 0..chunks {
            let (lo, hi) = (c * step, ((c + 1) * step).min(n));
            let offset = lo as u64 * 4;
            if ty.dtype == DType::Bool {
                let mut words = self.host_vec::<u32>(hi - lo, "upload")?;
                words.extend(bytes[lo..hi].iter().map(|&b| (b != 0) as u32));
                self.inner.queue.write_buffer(st.buffer(), offset, bytemuck::cast_slice(&words));
            } else {
                self.inner.queue.write_buffer(st.buffer(), offset, &bytes[lo * 4..hi * 4]);
            }
            if chunks > 1 {
                self.inner.queue.submit([]);
                self.wait()?;
            }
        }
        Ok(buf)
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        let n = buffer.ty.shape.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        let st = self.storage(buffer)?;
        let bytes = n as u64 * 4;
        // The host copy first: if the host cannot hold it, no device work
        // is wasted.
        let mut out = self.host_vec::<u8>(n * buffer.ty.dtype.size_bytes(), "readback")?;
        // Through one staging buffer of at most `TRANSFER_CHUNK` bytes,
        // a chunk at a time.
        let chunk = bytes.min(TRANSFER_CHUNK);
        let staging = self.inner.pool.acquire(chunk, READBACK)?;
        let mut offset = 0;
        while offset < bytes {
            let len = chunk.min(bytes - offset);
            let mut enc = self.inner.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(st.buffer(), offset, staging.buffer(), 0, len);
            self.inner.queue.submit([enc.finish()]);
            let (tx, rx) = std::sync::mpsc::channel();
            staging.buffer().map_async(wgpu::MapMode::Read, 0..len, move |r| {
                let _ = tx.send(r);
            });
            self.wait()?;
            rx.recv().map_err(|e| device_err(&self.inner.name, e))?.map_err(|e| device_err(&self.inner.name, e))?;
            {
                let view = staging.buffer().get_mapped_range(0..len).map_err(|e| device_err(&self.inner.name, e))?;
                if buffer.ty.dtype == DType::Bool {
                    let words: &[u32] = bytemuck::cast_slice(&view);
                    out.extend(words.iter().map(|&w| (w != 0) as u8));
                } else {
                    out.extend_from_slice(&view);
                }
            }
            staging.buffer().unmap();
            offset += len;
        }
        Ok(out)
    }

    fn compile(&self, graph: &VerifiedGraph) -> Result<Arc<dyn Executable>, BackendError> {
        self.compile_with(graph, CompileHints::default())
    }

    /// Compiles `graph`; with `hints.sizes_vary` (and generic sizes on),
    /// every kernel is lowered in size-independent forms and compiled
    /// generic over all its sizes at once (see [`crate::generic`]).
    fn compile_with(&self, graph: &VerifiedGraph, hints: CompileHints) -> Result<Arc<dyn Executable>, BackendError> {
        let started = std::time::Instant::now();
        let generic = hints.sizes_vary && self.inner.families.enabled();
        if self.inner.families.enabled() {
            if let Some(earlier) = self.earlier_sizes(graph, generic).filter(|_| generic) {
                self.observe_sizes(&earlier);
            }
        }
        let plan = fusion::plan(graph, &self.inner.fusion);
        let mut lowered = Vec::with_capacity(plan.kernels.len());
        for (i, k) in plan.kernels.iter().enumerate() {
            let name = format!("k{i}_{:?}_{}", k.kind, graph.node(k.root()).op.name());
            let limits = if generic {
                // Tuning a form per size would defeat sharing it.
                LowerLimits { generic: true, ..self.inner.lower }
            } else {
                self.tuned_limits(k, graph, &name)?
            };
            let mut wgsl = self.lower(k, graph, &limits)?;
            metrics::inc("KernelsLowered", 1);
            let windows = self.window(k, graph, &name, &mut wgsl)?;
            if self.inner.fault_kernel.as_deref().is_some_and(|f| name.contains(f)) {
                wgsl.source = crate::fault::perturb(&wgsl.source);
            }
            lowered.push((name, wgsl, windows));
        }
        // Each source (and first pass) generic over sizes where its family
        // has seen other sizes.
        let mut prepared = Vec::new();
        for (name, wgsl, _) in &lowered {
            for (name, w) in
                std::iter::once((name.clone(), wgsl)).chain(wgsl.pre.as_deref().map(|p| (format!("{name}_pass1"), p)))
            {
                let s = self.inner.families.specialize(&w.source, w.entry);
                prepared.push(Prepared {
                    name,
                    source: s.source,
                    entry: w.entry,
                    inputs: w.inputs,
                    outputs: w.outputs,
                    error_slot: w.error_slot,
                    dims: s.dims,
                });
            }
        }
        metrics::record_time("CompileLower", started.elapsed());
        let pipelines = self.pipelines(&prepared)?;
        let mut compiled = prepared.iter().zip(pipelines).map(|(p, pipeline)| {
            let dims = pipeline.dims_layout.as_ref().map(|layout| self.dims_group(layout, &p.dims));
            (pipeline, dims)
        });
        let mut kernels = Vec::with_capacity(lowered.len());
        for (name, wgsl, windows) in lowered {
            let (pipeline, dims) = compiled.next().expect("one pipeline per prepared kernel");
            let pre = if wgsl.pre.is_some() { compiled.next() } else { None };
            kernels.push(CompiledKernel { name, wgsl, pipeline, dims, pre, windows });
        }
        let mut buffers = Vec::new();
        let mut slot = vec![u32::MAX; graph.len()];
        for id in graph.ids() {
            if let Op::Parameter(i) = graph.node(id).op {
                slot[id.index()] = buffers.len() as u32;
                buffers.push(Bound::Input(i as usize));
            }
        }
        for &m in &plan.materialized {
            if slot[m.index()] == u32::MAX {
                slot[m.index()] = buffers.len() as u32;
                buffers.push(Bound::Node(m));
            }
        }
        let binds = std::sync::Mutex::new(BindCache::default());
        Ok(Arc::new(WgpuExecutable { graph: graph.clone(), plan, kernels, buffers, slot, binds }))
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
        let g = &exe.graph;
        if inputs.len() != g.params.len() || scalars.len() != g.scalars.len() {
            return Err(BackendError::Execution(format!(
                "expected {} inputs and {} scalars, got {} and {}",
                g.params.len(),
                g.scalars.len(),
                inputs.len(),
                scalars.len()
            )));
        }
        // The plan's cached bind groups and allocation history; while
        // another thread executes the same plan and holds them, this
        // execution binds afresh.
        let mut cache = exe.binds.try_lock().ok();
        // The uniform of lifted scalars, written before the submission that
        // reads it (`queue.write_buffer` is ordered before the next submit).
        let words = uniform_words(&g.scalars, Some(scalars));
        let uniform_slot = exe.buffers.len();
        let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(uniform_slot));
        let uniform = self.inner.pool.acquire_preferring(words.len() as u64 * 4, UNIFORM, prefer)?;
        if let Some(c) = cache.as_mut() {
            c.record(uniform_slot, uniform.id());
        }
        self.inner.queue.write_buffer(uniform.buffer(), 0, bytemuck::cast_slice(&words));
        // The execution's buffers: parameters, then every materialized
        // node in order, each node asking for the buffers it had before.
        // The intermediates go back to the pool in reverse order at the
        // end, so even without that history the pool (last in, first out)
        // would hand the same buffers to the same nodes next time.
        let mut values: Vec<Buffer> = Vec::with_capacity(exe.buffers.len());
        for (slot, b) in exe.buffers.iter().enumerate() {
            values.push(match *b {
                Bound::Input(i) => inputs[i].clone(),
                Bound::Node(m) => {
                    let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(slot));
                    let buf = self.new_buffer(&g.node(m).ty(), prefer, || g.node(m).op.name())?;
                    if let Some(c) = cache.as_mut() {
                        c.record(slot, self.storage(&buf)?.id());
                    }
                    buf
                }
            });
        }
        let value = |id: NodeId| exe.slot.get(id.index()).and_then(|&s| values.get(s as usize));
        let dev = &self.inner.device;
        let oom = dev.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("lazuli") });
        // Error slots of the kernels that check indices, one each, zeroed
        // first in this submission and copied to a readback buffer at its
        // end, which is mapped by the same wait as the execution: a bad
        // index costs no extra round trip (see `codegen::index`).
        let checking: Vec<usize> = (0..exe.kernels.len())
            .filter(|&i| exe.kernels[i].wgsl.error_slot && exe.kernels[i].wgsl.invocations > 0)
            .collect();
        let stride = self.inner.slot_stride;
        let slot_bytes = checking.len() as u64 * stride;
        let slots = if checking.is_empty() {
            None
        } else {
            // The slots buffer is bound, so it comes through the plan's
            // allocation history like every buffer it binds (after the
            // scratch of each kernel): a steady loop gets it back, and with
            // it the bind groups of its checking kernels.
            let at = uniform_slot + 1 + exe.kernels.len();
            let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(at));
            let device_slots = self.inner.pool.acquire_preferring(slot_bytes, STORAGE, prefer)?;
            if let Some(c) = cache.as_mut() {
                c.record(at, device_slots.id());
            }
            // Never bound: any idle readback buffer will do.
            let read = self.inner.pool.acquire(slot_bytes, READBACK)?;
            enc.clear_buffer(device_slots.buffer(), 0, Some(slot_bytes));
            Some((device_slots, read))
        };
        let mut launches = 0u64;
        // Bind groups first, then encoding: one pass for the whole plan, or
        // one pass per kernel with timestamps while profiling.
        let mut work: Vec<Launch> = Vec::with_capacity(exe.kernels.len());
        // Scratch buffers of two-pass kernels live until the wait below.
        let mut scratch = Vec::new();
        // Bind group 0 of launch `launch` (a kernel's first pass is launch
        // `2 * ki`, the kernel proper `2 * ki + 1`): from the plan's cache,
        // keyed by every range bound, or made afresh without it.
        let bind = |cache: &mut Option<std::sync::MutexGuard<BindCache>>,
                    launch: usize,
                    layout: &wgpu::BindGroupLayout,
                    bindings: &[Binding]| match cache {
            Some(c) => c.get(launch, dev, layout, bindings),
            None => binds::create(dev, layout, bindings),
        };
        for (ki, (k, kernel)) in exe.kernels.iter().zip(&exe.plan.kernels).enumerate() {
            if k.wgsl.invocations == 0 {
                continue;
            }
            // The kernel's error slot, if it checks indices.
            let error_slot = match (&slots, checking.binary_search(&ki)) {
                (Some((device_slots, _)), Ok(j)) => Some((device_slots, j as u64 * stride)),
                _ => None,
            };
            let buffer = |id: &NodeId| -> Result<&WgpuStorage, BackendError> {
                let b = value(*id)
                    .ok_or_else(|| BackendError::Execution(format!("no buffer for node {id} needed by {}", k.name)))?;
                self.storage(b)
            };
            match (&k.wgsl.pre, &k.pre) {
                (Some(pre), Some((pre_pipeline, pre_dims))) => {
                    // Pass 1 reads the inputs into scratch; pass 2 reads
                    // the scratch and writes the outputs.
                    debug_assert!(error_slot.is_none(), "two-pass kernels check no indices");
                    // Scratch allocations come after the buffers in the
                    // plan's allocation history.
                    let at = uniform_slot + 1 + ki;
                    let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(at));
                    let s = self.inner.pool.acquire_preferring(pre.scratch.max(1) * 4, STORAGE, prefer)?;
                    if let Some(c) = cache.as_mut() {
                        c.record(at, s.id());
                    }
                    let mut first: Vec<&WgpuStorage> = Vec::with_capacity(kernel.inputs.len() + 1);
                    for id in &kernel.inputs {
                        first.push(buffer(id)?);
                    }
                    first.push(&s);
                    let bindings = self.bindings(&uniform, &first, &k.windows.pre, None);
                    work.push(Launch {
                        kernel: k,
                        first_pass: true,
                        pipeline: &pre_pipeline.pipeline,
                        bind_group: bind(&mut cache, 2 * ki, &pre_pipeline.layout, &bindings),
                        dims: pre_dims.as_ref(),
                        groups: dispatch_size(pre.invocations, pre.workgroup_size),
                    });
                    let mut second: Vec<&WgpuStorage> = Vec::with_capacity(kernel.outputs.len() + 1);
                    second.push(&s);
                    for id in &kernel.outputs {
                        second.push(buffer(id)?);
                    }
                    let bindings = self.bindings(&uniform, &second, &k.windows.main, None);
                    work.push(Launch {
                        kernel: k,
                        first_pass: false,
                        pipeline: &k.pipeline.pipeline,
                        bind_group: bind(&mut cache, 2 * ki + 1, &k.pipeline.layout, &bindings),
                        dims: k.dims.as_ref(),
                        groups: dispatch_size(k.wgsl.invocations, k.wgsl.workgroup_size),
                    });
                    scratch.push(s);
                }
                _ => {
                    let mut bufs: Vec<&WgpuStorage> = Vec::with_capacity(kernel.inputs.len() + kernel.outputs.len());
                    for id in kernel.inputs.iter().chain(&kernel.outputs) {
                        bufs.push(buffer(id)?);
                    }
                    let bindings = self.bindings(&uniform, &bufs, &k.windows.main, error_slot);
                    work.push(Launch {
                        kernel: k,
                        first_pass: false,
                        pipeline: &k.pipeline.pipeline,
                        bind_group: bind(&mut cache, 2 * ki + 1, &k.pipeline.layout, &bindings),
                        dims: k.dims.as_ref(),
                        groups: dispatch_size(k.wgsl.invocations, k.wgsl.workgroup_size),
                    });
                }
            }
        }
        let profiling = self.inner.timestamps && self.profiling() && !work.is_empty();
        let queries = profiling.then(|| {
            let n = 2 * work.len() as u64;
            let set = dev.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("lazuli profile"),
                ty: wgpu::QueryType::Timestamp,
                count: n as u32,
            });
            let resolve = dev.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lazuli profile resolve"),
                size: n * 8,
                usage: BufferUsages::QUERY_RESOLVE | BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let read = dev.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lazuli profile read"),
                size: n * 8,
                usage: READBACK,
                mapped_at_creation: false,
            });
            (set, resolve, read)
        });
        if let Some((set, _, _)) = &queries {
            for (i, l) in work.iter().enumerate() {
                let name = l.name();
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(&name),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: set,
                        beginning_of_pass_write_index: Some(2 * i as u32),
                        end_of_pass_write_index: Some(2 * i as u32 + 1),
                    }),
                });
                pass.set_pipeline(l.pipeline);
                pass.set_bind_group(0, &l.bind_group, &[]);
                if let Some(dims) = l.dims {
                    pass.set_bind_group(1, dims, &[]);
                }
                pass.dispatch_workgroups(l.groups.0, l.groups.1, 1);
                launches += 1;
            }
        } else {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for l in &work {
                pass.set_pipeline(l.pipeline);
                pass.set_bind_group(0, &l.bind_group, &[]);
                if let Some(dims) = l.dims {
                    pass.set_bind_group(1, dims, &[]);
                }
                pass.dispatch_workgroups(l.groups.0, l.groups.1, 1);
                launches += 1;
            }
        }
        if let Some((set, resolve, read)) = &queries {
            let n = 2 * work.len() as u32;
            enc.resolve_query_set(set, 0..n, resolve, 0);
            enc.copy_buffer_to_buffer(resolve, 0, read, 0, n as u64 * 8);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        if let Some((device_slots, read)) = &slots {
            enc.copy_buffer_to_buffer(device_slots.buffer(), 0, read.buffer(), 0, slot_bytes);
        }
        drop(cache);
        self.inner.queue.submit([enc.finish()]);
        if let Some((_, read)) = &slots {
            read.buffer().map_async(wgpu::MapMode::Read, 0..slot_bytes, move |r| {
                let _ = tx.send(r);
            });
        }
        let waited = self.wait();
        // The first claimed slot, in kernel order, as (kernel, index bits);
        // the readback buffer is unmapped before anything returns.
        let claimed = match &slots {
            Some((_, read)) if waited.is_ok() => {
                let mapped = rx
                    .recv()
                    .map_err(|e| device_err(&self.inner.name, e))?
                    .map_err(|e| device_err(&self.inner.name, e));
                let found = mapped.and_then(|()| {
                    let view =
                        read.buffer().get_mapped_range(0..slot_bytes).map_err(|e| device_err(&self.inner.name, e))?;
                    let words: &[u32] = bytemuck::cast_slice(&view);
                    let step = (stride / 4) as usize;
                    Ok((0..checking.len()).find(|&j| words[j * step] != 0).map(|j| (checking[j], words[j * step + 1])))
                });
                read.buffer().unmap();
                found?
            }
            _ => None,
        };
        let val_err = pollster::block_on(val.pop());
        let oom_err = pollster::block_on(oom.pop());
        metrics::inc("KernelLaunches", launches);
        if let Some(e) = oom_err {
            // Give the cache back so that the next execution can succeed.
            self.inner.pool.release_idle();
            return Err(BackendError::OutOfMemory {
                bytes: 0,
                in_use: self.inner.pool.stats().in_use_bytes,
                device: format!("{}: {e}", self.inner.name),
            });
        }
        if let Some(e) = val_err {
            return Err(BackendError::Execution(e.to_string()));
        }
        waited?;
        if let Some((_, _, read)) = &queries {
            let names: Vec<String> = work.iter().map(Launch::name).collect();
            self.record_profile(read, &names.iter().map(String::as_str).collect::<Vec<_>>())?;
        }
        drop(work);
        drop(uniform);
        scratch.into_iter().rev().for_each(drop);
        drop(slots);
        let outputs = match claimed {
            Some((kernel, bits)) => Err(index_error(g, &exe.plan.kernels[kernel], bits)),
            None => g
                .outputs
                .iter()
                .map(|o| {
                    value(*o).cloned().ok_or_else(|| BackendError::Execution(format!("output {o} was not computed")))
                })
                .collect(),
        };
        values.into_iter().rev().for_each(drop);
        outputs
    }

    fn pool_bytes(&self) -> u64 {
        self.inner.pool.bytes()
    }

    fn bytes_in_use(&self) -> u64 {
        self.inner.pool.stats().in_use_bytes
    }
}

/// The words of a uniform buffer of lifted scalars: `P.z` (0), then one
/// 32-bit word per lifted scalar of `dtypes` (`values`, or zeros when
/// `None`), padded to 16 bytes.
fn uniform_words(dtypes: &[DType], values: Option<&[ScalarValue]>) -> Vec<u32> {
    let mut words: Vec<u32> = Vec::with_capacity(dtypes.len() + 4);
    words.push(0);
    for (k, d) in dtypes.iter().enumerate() {
        words.push(values.map_or(0, |vs| match d {
            DType::F32 => (vs[k].as_f64() as f32).to_bits(),
            DType::I32 => vs[k].as_i64() as i32 as u32,
            DType::Bool => vs[k].as_bool() as u32,
            _ => vs[k].as_u64() as u32,
        }));
    }
    while !words.len().is_multiple_of(4) {
        words.push(0);
    }
    words
}

/// The error of an index out of range that kernel `k` (a gather or a
/// scatter-add) reported: `bits` are the index as its kernel read it.
fn index_error(g: &VerifiedGraph, k: &Kernel, bits: u32) -> BackendError {
    let root = g.node(k.root());
    let axis = match root.op {
        Op::Gather { axis } | Op::ScatterAdd { axis } => axis,
        _ => unreachable!("only gathers and scatter-adds check indices"),
    };
    let data = g.node(root.inputs[0]);
    let index = match g.node(root.inputs[1]).dtype {
        DType::I32 => bits as i32 as i128,
        _ => bits as i128,
    };
    BackendError::IndexOutOfRange(Box::new(IndexError {
        op: root.op.name(),
        index,
        axis,
        size: data.shape.dims()[axis],
        shape: data.shape.clone(),
    }))
}
