//! The device context: the adapter and device opened for a backend, its
//! queue, the buffer pool and the limits every other part reads (binding
//! windows, error-slot stride, largest buffer, llvmpipe's loop budget,
//! timestamp support), with the small device-side helpers they share:
//! waiting, pool buffers for values and uniforms, and bind groups.
//!
//! Nothing here compiles or caches kernels (see [`crate::compile`]); the
//! context is what both compiling and executing stand on.

use crate::codegen;
use crate::codegen::window::Windows;
use crate::device::binds::{self, Binding};
use crate::device::platform::{self, Deferred};
use crate::device::pool::{self, Pool, PoolOptions, WgpuStorage};
use crate::device::timestamps::{mapped_intervals, PendingTimes};
use crate::options::WgpuOptions;
use lazuli_executor::platform::Instant;
use lazuli_executor::{BackendError, BackendKind, Buffer};
use lazuli_ir::{DType, ScalarValue, ValueType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use wgpu::BufferUsages;

/// Usage of every value buffer: bound as storage, copied from and to.
pub(crate) const STORAGE: BufferUsages =
    BufferUsages::STORAGE.union(BufferUsages::COPY_SRC).union(BufferUsages::COPY_DST);
/// Uniform buffers whose last contents [`Context::write_uniform`]
/// remembers before it forgets them all.
const UNIFORMS_HELD: usize = 4096;

/// Usage of the uniform buffer of lifted scalars.
pub(crate) const UNIFORM: BufferUsages = BufferUsages::UNIFORM.union(BufferUsages::COPY_DST);
/// Usage of a readback (staging) buffer.
pub(crate) const READBACK: BufferUsages = BufferUsages::MAP_READ.union(BufferUsages::COPY_DST);

/// Bytes of one error slot: the claim flag and the index's bits (see
/// `codegen::index`).
pub(crate) const ERROR_SLOT_BYTES: u64 = 8;

/// The device of a backend and the limits derived from its adapter.
pub(crate) struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    /// `wgpu: <adapter> (<backend>, <type>)`, as errors name the device.
    pub name: String,
    pub pool: Arc<Pool>,
    /// Bytes between the error slots of one execution (the adapter's
    /// `min_storage_buffer_offset_alignment`, at least a slot's size).
    pub slot_stride: u64,
    /// Bytes between the sections of an execution's uniform (the
    /// adapter's `min_uniform_buffer_offset_alignment`; see
    /// [`crate::device::uniforms`]).
    pub uniform_align: u64,
    /// How tensors beyond one binding are bound.
    pub windows: Windows,
    /// The largest buffer (`max_buffer_size`, a multiple of 4).
    pub max_buffer: u64,
    /// Loop iterations one invocation may run, where the adapter caps them
    /// silently (llvmpipe: [`codegen::LLVMPIPE_LOOP_BUDGET`]); `None` on GPUs.
    pub loop_budget: Option<u64>,
    /// The device has `TIMESTAMP_QUERY` (per-kernel GPU times) and the
    /// platform can read them back (not on the web: see
    /// [`crate::device::platform`]).
    pub timestamps: bool,
    /// The device was opened with `wgpu::Features::SUBGROUP` (the adapter
    /// has it): kernels may `enable subgroups;`.
    pub subgroups: bool,
    /// The device has `SHADER_F16` (requested wherever the adapter offers
    /// it): f16 tensors may be stored as `array<f16>` ([`crate::codegen::access`]).
    pub shader_f16: bool,
    /// The device runs the cooperative-matrix matmul as
    /// [`codegen::coop`] writes it: see [`cooperative_matrix_ok`].
    pub cooperative_matrix: bool,
    /// The first asynchronous device error not reported yet (the web's
    /// uncaptured errors, lost device, index errors found late).
    pub deferred: Deferred,
    /// Executions overlap (natively; `WgpuOptions::overlap_submit`): one
    /// returns once submitted and the one before it has finished.
    pub overlap: bool,
    /// Launches the first submission of a streamed execution holds (0:
    /// executions are submitted in one piece; see
    /// [`crate::execute`] and `WgpuOptions::stream_submit`).
    pub stream_first: u64,
    /// What each uniform buffer (by id) was last written with (see
    /// [`Context::write_uniform`]).
    uniforms_held: std::sync::Mutex<std::collections::HashMap<u64, Box<[u32]>>>,
    /// Executions submitted, and the last one seen finished (see
    /// [`Context::submitted`]).
    executions: (AtomicU64, Arc<AtomicU64>),
    /// The submission of the last execution that returned before it
    /// finished, if any.
    in_flight: std::sync::Mutex<Option<wgpu::SubmissionIndex>>,
    /// Timestamps of executions that returned before they finished,
    /// placed on the timeline once a wait sees them done
    /// ([`Context::collect_times`]).
    pending_times: std::sync::Mutex<Vec<PendingTimes>>,
    /// This device's clock on the timeline (see
    /// [`lazuli_executor::timeline::gpu_execution`]).
    clock: u64,
}

/// What opening a device tells the compile side about the adapter.
pub(crate) struct Opened {
    pub context: Context,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Storage buffers one kernel may bind (the adapter's limit, one
    /// binding kept for the uniform, clamped by the options).
    pub max_storage_buffers: usize,
}

/// What a backend asks of the device: timestamps, the driver's pipeline
/// cache, f16 in shaders and subgroup operations (where kernels may use
/// them: [`platform::SUBGROUPS`]) where offered, cooperative matrices where
/// the adapter runs them as [`codegen::coop`] needs and `coop` allows
/// (`WgpuOptions::cooperative_matrix`), every limit the adapter has.
fn device_descriptor(a: &wgpu::Adapter, coop: bool) -> wgpu::DeviceDescriptor<'static> {
    let subgroups = if platform::SUBGROUPS { wgpu::Features::SUBGROUP } else { wgpu::Features::empty() };
    let coop = coop && cooperative_matrix_ok(a, a.features());
    let coop_feature = if coop { wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX } else { wgpu::Features::empty() };
    wgpu::DeviceDescriptor {
        label: Some("lazuli"),
        required_features: a.features()
            & (wgpu::Features::TIMESTAMP_QUERY
                | wgpu::Features::PIPELINE_CACHE
                | wgpu::Features::SHADER_F16
                | subgroups
                | coop_feature),
        required_limits: a.limits(),
        // SAFETY: wgpu's experimental features may hide bugs of wgpu
        // itself; the one asked for (cooperative matrices) is used only by
        // `codegen::coop`'s kernels, which naga validates before a pipeline
        // is made, and only where the adapter advertises the configuration
        // they use. `LAZULI_COOPERATIVE_MATRIX=0` keeps it off.
        experimental_features: if coop {
            #[allow(unsafe_code)]
            unsafe {
                wgpu::ExperimentalFeatures::enabled()
            }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        },
        ..Default::default()
    }
}

/// Whether adapter `a`, with features `features` (the adapter's, or the
/// device's once opened), runs [`codegen::coop`]'s kernels: cooperative
/// matrices, `SHADER_F16` and `SUBGROUP` (the kernels read the subgroup id),
/// a 16 x 16 x 16 configuration of f16 A/B and f32 C/R, and subgroups of
/// exactly [`codegen::coop::COOP_SUBGROUP`] lanes (the tile assigns work by
/// subgroup, NVIDIA's warps). Never on the web (a native-only feature).
pub(crate) fn cooperative_matrix_ok(a: &wgpu::Adapter, features: wgpu::Features) -> bool {
    use wgpu::CooperativeScalarType as T;
    let needed =
        wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX | wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP;
    if !platform::SUBGROUPS || !features.contains(needed) {
        return false;
    }
    let info = a.get_info();
    let lanes = codegen::coop::COOP_SUBGROUP as u32;
    let side = codegen::coop::COOP_FRAGMENT as u32;
    info.subgroup_min_size == lanes
        && info.subgroup_max_size == lanes
        && a.cooperative_matrix_properties().iter().any(|p| {
            p.m_size == side && p.n_size == side && p.k_size == side && p.ab_type == T::F16 && p.cr_type == T::F32
        })
}

/// `wgpu: <adapter> (<backend>, <type>)` (a browser may keep the name to
/// itself: then "unnamed adapter").
fn describe(a: &wgpu::Adapter) -> String {
    let info = a.get_info();
    let name = if info.name.is_empty() { "unnamed adapter" } else { &info.name };
    format!("wgpu: {name} ({:?}, {:?})", info.backend, info.device_type)
}

/// A `BackendError::Device` of device `name`.
pub(crate) fn device_err(name: &str, message: impl ToString) -> BackendError {
    BackendError::Device { device: name.to_string(), message: message.to_string() }
}

impl Context {
    /// Opens an adapter and device for `options` (resolved against the
    /// environment: see [`WgpuOptions::resolve`]), blocking. Fails with
    /// `BackendError::Device` when no adapter matches, and with
    /// `BackendError::WouldBlock` where the platform cannot block (use
    /// [`Context::open_async`]).
    pub fn open(options: &WgpuOptions) -> Result<Opened, BackendError> {
        #[cfg(not(target_arch = "wasm32"))]
        {
            let inst = crate::device::adapter::instance();
            let a = crate::device::adapter::select(&inst, options.adapter_name.as_deref(), options.adapter_index)
                .ok_or_else(|| device_err("wgpu", "no adapter found"))?;
            let (device, queue) =
                platform::request_device(&a, &device_descriptor(&a, options.cooperative_matrix.unwrap_or(true)))
                    .map_err(|e| device_err(&describe(&a), e))?;
            Ok(Context::with_device(options, &a, device, queue))
        }
        #[cfg(target_arch = "wasm32")]
        {
            let _ = options;
            Err(BackendError::WouldBlock {
                op: "WgpuBackend::new".into(),
                device: "wgpu".into(),
                instead: "WgpuBackend::new_async".into(),
            })
        }
    }

    /// [`Context::open`] without blocking: on the web, the browser's
    /// WebGPU adapter (`BackendError::Device` naming what is missing
    /// when the browser offers none); natively the blocking open.
    pub async fn open_async(options: &WgpuOptions) -> Result<Opened, BackendError> {
        #[cfg(not(target_arch = "wasm32"))]
        return Context::open(options);
        #[cfg(target_arch = "wasm32")]
        {
            let a = platform::web_adapter().await.ok_or_else(|| {
                device_err("wgpu", "the browser offers no WebGPU adapter (is WebGPU enabled? navigator.gpu)")
            })?;
            let (device, queue) =
                a.request_device(&device_descriptor(&a, false)).await.map_err(|e| device_err(&describe(&a), e))?;
            Ok(Context::with_device(options, &a, device, queue))
        }
    }

    /// The context of an opened device.
    fn with_device(options: &WgpuOptions, a: &wgpu::Adapter, device: wgpu::Device, queue: wgpu::Queue) -> Opened {
        let info = a.get_info();
        let name = describe(a);
        let limits = a.limits();
        let deferred = Deferred::default();
        let (log_name, sink) = (name.clone(), deferred.clone());
        device.on_uncaptured_error(Arc::new(move |e| {
            tracing::error!(device = %log_name, "uncaptured wgpu error: {e}");
            // Only the web leaves errors uncaptured on purpose (natively
            // every operation that can fail is inside an error scope).
            if !platform::CAN_BLOCK {
                sink.report(match e {
                    wgpu::Error::OutOfMemory { .. } => {
                        BackendError::OutOfMemory { bytes: 0, in_use: 0, device: format!("{log_name}: {e}") }
                    }
                    _ => device_err(&log_name, e),
                });
            }
        }));
        if !platform::CAN_BLOCK {
            let (lost_name, sink) = (name.clone(), deferred.clone());
            device.set_device_lost_callback(move |reason, message| {
                sink.report(device_err(&lost_name, format!("the device was lost ({reason:?}): {message}")));
            });
        }
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
                    .unwrap_or_else(|| pool::default_max_idle_bytes(info.device_type, limits.max_buffer_size)),
                memory_budget: options.memory_budget,
                max_buffer_size: limits.max_buffer_size,
                max_storage_binding: max_binding,
                device_name: name.clone(),
            },
        );
        let subgroups = device.features().contains(wgpu::Features::SUBGROUP);
        let shader_f16 = device.features().contains(wgpu::Features::SHADER_F16);
        let cooperative_matrix = cooperative_matrix_ok(a, device.features());
        let context = Context {
            device,
            queue,
            name,
            pool,
            slot_stride: (limits.min_storage_buffer_offset_alignment as u64).max(ERROR_SLOT_BYTES),
            uniform_align: (limits.min_uniform_buffer_offset_alignment as u64).max(16),
            windows,
            max_buffer: limits.max_buffer_size & !3,
            loop_budget: (info.device_type == wgpu::DeviceType::Cpu).then_some(codegen::LLVMPIPE_LOOP_BUDGET),
            timestamps: platform::CAN_BLOCK && a.features().contains(wgpu::Features::TIMESTAMP_QUERY),
            subgroups,
            shader_f16,
            cooperative_matrix,
            deferred,
            overlap: platform::CAN_BLOCK && options.overlap_submit.unwrap_or(true),
            stream_first: options.stream_submit.unwrap_or(crate::STREAM_FIRST_LAUNCHES),
            uniforms_held: Default::default(),
            executions: Default::default(),
            in_flight: Default::default(),
            pending_times: Default::default(),
            clock: {
                static CLOCKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                CLOCKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
        };
        Opened { context, info, limits, max_storage_buffers: max_sb }
    }

    /// Waits until the device has finished all submitted work (on the web
    /// returns at once: see [`crate::device::platform`]).
    pub fn wait(&self) -> Result<(), BackendError> {
        platform::wait(&self.device).map_err(|e| device_err(&self.name, e))
    }

    /// Records `index` as the submission of an execution that returned
    /// before finishing (`None`: the last one was waited for) and waits
    /// for the one recorded before, if any: that one finishes while
    /// `index` keeps the GPU busy (natively; see [`Context::overlap`]).
    pub fn overlap_with(&self, index: Option<wgpu::SubmissionIndex>) -> Result<(), BackendError> {
        let earlier = std::mem::replace(&mut *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()), index);
        let waited = match earlier {
            Some(earlier) => platform::wait_for(&self.device, earlier).map_err(|e| device_err(&self.name, e)),
            None => Ok(()),
        };
        self.collect_times();
        waited
    }

    /// Counts an execution's last submission, just made: it is seen
    /// finished ([`Context::idle`]) once a poll of the device (any wait)
    /// runs the callback registered here. Nothing is counted where
    /// executions never stream (only a streamed execution asks).
    pub fn submitted(&self) {
        if self.stream_first == 0 {
            return;
        }
        let n = self.executions.0.fetch_add(1, Ordering::Relaxed) + 1;
        let finished = self.executions.1.clone();
        self.queue.on_submitted_work_done(move || {
            finished.fetch_max(n, Ordering::Relaxed);
        });
    }

    /// Whether every execution submitted so far was seen finished: the
    /// GPU has none of this device's kernels queued, as in a loop that
    /// waits for (or reads) each step before recording the next.
    pub fn idle(&self) -> bool {
        self.executions.1.load(Ordering::Relaxed) >= self.executions.0.load(Ordering::Relaxed)
    }

    /// Keeps an execution's timestamps to collect later: they are placed
    /// on the timeline after the first wait that sees it done, so the
    /// timeline never makes an execution wait for itself.
    pub(crate) fn time_later(&self, times: PendingTimes) {
        self.pending_times.lock().unwrap_or_else(|e| e.into_inner()).push(times);
    }

    /// Places on the timeline the timestamps of every execution a wait
    /// has seen done (see [`Context::time_later`]); a read that failed
    /// drops its execution's intervals.
    pub(crate) fn collect_times(&self) {
        let mut pending = self.pending_times.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|p| match p.mapping.try_recv() {
            Ok(mapped) => {
                if let Ok((intervals, done)) =
                    mapped_intervals((&self.name, &self.queue), &p.read, p.names.len(), mapped)
                {
                    self.place_times(&p.names, &intervals, done);
                }
                false
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => true,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => false,
        });
    }

    /// Places one execution's kernels `names`, timed over `intervals` and
    /// seen done at `done`, on the timeline.
    pub(crate) fn place_times(&self, names: &[String], intervals: &[(f64, f64)], done: Instant) {
        lazuli_executor::timeline::gpu_execution(self.clock, names, intervals, done);
    }

    /// Waits for the execution still running after it returned, if any
    /// (before timing kernels, and at `Device::wait`).
    pub fn settle(&self) -> Result<(), BackendError> {
        let running = self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).take();
        let waited = match running {
            Some(_) => self.wait(),
            None => Ok(()),
        };
        self.collect_times();
        waited
    }

    /// Waits for every submission, the execution still running included
    /// (an execution that does not overlap the next).
    pub fn wait_all(&self) -> Result<(), BackendError> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner()).take();
        let waited = self.wait();
        self.collect_times();
        waited
    }

    /// The wgpu storage of `b`, which must be this backend's.
    pub fn storage<'b>(&self, b: &'b Buffer) -> Result<&'b WgpuStorage, BackendError> {
        b.storage
            .as_any()
            .downcast_ref::<WgpuStorage>()
            .ok_or_else(|| BackendError::Execution(format!("buffer of {} is not a wgpu buffer", b.kind)))
    }

    /// A pool buffer for a value of type `ty`, preferring the buffers of
    /// ids `prefer` (see [`Pool::acquire_preferring`]); `what` names the
    /// value in errors (made only then: this runs for every node of every
    /// execution).
    pub fn new_buffer(
        &self,
        ty: &ValueType,
        prefer: &[u64],
        what: impl FnOnce() -> String,
    ) -> Result<Buffer, BackendError> {
        let bytes = device_bytes(ty);
        if bytes > self.max_buffer {
            return Err(BackendError::TooLarge {
                op: what(),
                bytes,
                limit: self.max_buffer,
                limit_name: "the device's largest buffer (max_buffer_size)".into(),
            });
        }
        let st = self.pool.acquire_preferring(bytes, STORAGE, prefer)?;
        Ok(Buffer { storage: Arc::new(st), ty: ty.clone(), kind: BackendKind::Wgpu })
    }

    /// An empty host vector with room for `n` elements (upload and
    /// readback staging on the host side); a refused allocation is
    /// `OutOfMemory`, never an abort.
    pub fn host_vec<T>(&self, n: usize, what: &str) -> Result<Vec<T>, BackendError> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory {
            bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            in_use: self.pool.stats().in_use_bytes,
            device: format!("{}: the host allocator refused the {what} staging vector", self.name),
        })?;
        Ok(v)
    }

    /// The uniform buffer of a launch of a kernel reading the lifted
    /// scalars `dtypes` (its `Wgsl::scalars`, in order): `P.z` (0), then
    /// one 32-bit word each (`values`, or zeros when `None`), padded to 16
    /// bytes.
    pub fn uniform(&self, dtypes: &[DType], values: Option<&[ScalarValue]>) -> Result<WgpuStorage, BackendError> {
        let words = crate::device::uniforms::section(
            dtypes
                .iter()
                .enumerate()
                .map(|(k, &d)| values.map_or(0, |vs| crate::device::uniforms::scalar_word(d, &vs[k]))),
        );
        let uniform = self.pool.acquire(words.len() as u64 * 4, UNIFORM)?;
        self.write_uniform(&uniform, &words);
        Ok(uniform)
    }

    /// Writes `words` at the start of uniform buffer `u`, unless its last
    /// write (every uniform write goes through here) was the same words: a
    /// plan whose lifted scalars keep their values from one execution to
    /// the next (a learning rate, a momentum) gets its uniform buffer back
    /// (`BindCache`'s history) and skips a staging copy per execution
    /// (`UniformWritesSkipped`). A write not yet submitted is not missed:
    /// it goes out with the next submission, before whatever reads it.
    pub fn write_uniform(&self, u: &WgpuStorage, words: &[u32]) {
        {
            let mut held = self.uniforms_held.lock().unwrap_or_else(|e| e.into_inner());
            if held.get(&u.id()).is_some_and(|w| **w == *words) {
                drop(held);
                lazuli_executor::metrics::inc("UniformWritesSkipped", 1);
                return;
            }
            // Ids are never reused: entries of destroyed buffers only
            // take room, so the map is emptied when it grows large.
            if held.len() >= UNIFORMS_HELD {
                held.clear();
            }
            held.insert(u.id(), words.into());
        }
        self.queue.write_buffer(u.buffer(), 0, bytemuck::cast_slice(words));
    }

    /// A bind group of `layout` binding `bufs` whole, in binding order.
    pub fn bind_group(&self, layout: &wgpu::BindGroupLayout, bufs: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        binds::create_whole(&self.device, layout, bufs)
    }

    /// The bindings of bind group 0 of a launch: the uniform, then each
    /// storage buffer of `storage` whole or, where `windows` says so, as
    /// that many windows (see [`crate::codegen::window`]), then the error slot at
    /// byte `offset` of a buffer, if any.
    pub fn bindings<'b>(
        &self,
        uniform: Binding<'b>,
        storage: &[&'b WgpuStorage],
        windows: &[u32],
        slot: Option<(&'b WgpuStorage, u64)>,
    ) -> Vec<Binding<'b>> {
        debug_assert_eq!(storage.len(), windows.len());
        let mut out = Vec::with_capacity(storage.len() + 2);
        out.push(uniform);
        for (&b, &w) in storage.iter().zip(windows) {
            if w <= 1 {
                out.push(Binding::whole(b));
                continue;
            }
            for (offset, size) in self.windows.ranges(b.buffer().size(), w) {
                out.push(Binding { storage: b, offset, size });
            }
        }
        if let Some((storage, offset)) = slot {
            out.push(Binding { storage, offset, size: ERROR_SLOT_BYTES });
        }
        out
    }

    /// Bind group 1 of each generic kernel of one compile, made once per
    /// compiled kernel: `(layout, dims)` per kernel, its dynamic sizes.
    /// All of them share one storage buffer, each kernel's sizes at an
    /// offset aligned as storage bindings require (`slot_stride`): one
    /// buffer per size variant rather than one per kernel.
    pub fn dims_groups(&self, kernels: &[(&wgpu::BindGroupLayout, &[u32])]) -> Vec<wgpu::BindGroup> {
        use wgpu::util::DeviceExt as _;
        if kernels.is_empty() {
            return Vec::new();
        }
        let mut words: Vec<u32> = Vec::new();
        let mut ranges = Vec::with_capacity(kernels.len());
        let align_words = (self.slot_stride / 4) as usize;
        for (_, dims) in kernels {
            let start = words.len().next_multiple_of(align_words);
            words.resize(start, 0);
            words.extend_from_slice(dims);
            ranges.push((start as u64 * 4, dims.len() as u64 * 4));
        }
        let buffer = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("lazuli sizes"),
            contents: bytemuck::cast_slice(&words),
            usage: BufferUsages::STORAGE,
        });
        kernels
            .iter()
            .zip(ranges)
            .map(|((layout, _), (offset, size))| {
                lazuli_executor::metrics::inc("WgpuBindGroupsCreated", 1);
                let resource = wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &buffer,
                    offset,
                    size: std::num::NonZeroU64::new(size),
                });
                self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout,
                    entries: &[wgpu::BindGroupEntry { binding: 0, resource }],
                })
            })
            .collect()
    }
}

/// Bytes of the device buffer of a value of type `ty`: 4 per element,
/// except f16 and bf16 (2, the total rounded up to whole `u32` words; see
/// `crate::codegen::access`); at least 4.
pub(crate) fn device_bytes(ty: &ValueType) -> u64 {
    let n = ty.shape.numel() as u64;
    let bytes = if ty.dtype == DType::U8 {
        n.next_multiple_of(4)
    } else if matches!(ty.dtype, DType::F16 | DType::BF16) {
        n.saturating_mul(2).next_multiple_of(4)
    } else {
        n.saturating_mul(4)
    };
    bytes.max(4)
}

/// The 2-D dispatch size for `invocations` in workgroups of `size`.
pub(crate) fn dispatch_size(invocations: u64, size: u32) -> (u32, u32) {
    let groups = invocations.div_ceil(size.max(1) as u64);
    let (x, y) = if groups > 65535 { (65535, groups.div_ceil(65535)) } else { (groups, 1) };
    (x as u32, y as u32)
}
