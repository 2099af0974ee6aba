//! Pipelines: creation (naga parses and validates the source first; the
//! shader module is made from that naga module, then the bind group
//! layouts and compute pipeline, with the driver's pipeline cache), the
//! pipeline cache keyed by the hash of the whole WGSL source and entry
//! point (the bind group layout follows from the source, bounded LRU),
//! and the persistent side of both: each source's naga module and the
//! driver cache blob in the disk cache ([`crate::compile::diskcache`]), so a later
//! process neither parses nor validates a kernel it has seen.
//!
//! The missing pipelines of a plan are created on several threads at
//! once (`LAZULI_COMPILE_THREADS`, default the machine's cores, at most 8;
//! a pool made once per backend, the private `threads` module).
//!
//! Trusted modules: a kernel whose generator proves every index in
//! bounds ([`crate::codegen::Wgsl::trusted`]: the tiled matmul) is created
//! with `create_shader_module_trusted` and
//! `ShaderRuntimeChecks::unchecked()`: naga then emits no index clamps on
//! storage and workgroup arrays, no loop-bounding counters and no guards
//! on integer division. Natively only, with the switch on
//! (`WgpuOptions::trusted_shaders`, `LAZULI_TRUSTED_SHADERS`); on wasm32
//! the browser's WebGPU checks every module anyway. Every other kernel
//! keeps a checked module. The pipeline key includes whether the module
//! is trusted.

use crate::compile::diskcache::{self, DiskCache};
use crate::compile::validate::parse_and_validate;
use crate::device::context::Context;
use crate::device::platform::{self, Scope};
use lazuli_executor::platform::Instant;
use lazuli_executor::{metrics, BackendError};
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A compute pipeline with its bind group layout.
#[derive(Debug)]
pub struct PipelineEntry {
    /// The pipeline.
    pub pipeline: wgpu::ComputePipeline,
    /// Layout of bind group 0.
    pub layout: wgpu::BindGroupLayout,
    /// Layout of bind group 1, the dynamic sizes of a kernel generic over
    /// sizes (see [`crate::rewrite::size_families`]); `None` for a static kernel.
    pub dims_layout: Option<wgpu::BindGroupLayout>,
}

/// Bounded cache of pipelines.
pub struct PipelineCache {
    map: Mutex<lru::LruCache<u64, Arc<PipelineEntry>>>,
}

impl PipelineCache {
    /// A cache holding up to `cap` pipelines.
    pub fn new(cap: usize) -> PipelineCache {
        let cap = NonZeroUsize::new(cap.max(1)).expect("non-zero");
        PipelineCache { map: Mutex::new(lru::LruCache::new(cap)) }
    }

    /// The cache key of a source and entry point, and whether its module
    /// is created trusted (unchecked).
    pub fn key(source: &str, entry: &str, trusted: bool) -> u64 {
        if trusted {
            lazuli_ir::stable_hash(&(source, entry, "trusted"))
        } else {
            lazuli_ir::stable_hash(&(source, entry))
        }
    }

    /// The cached pipeline for the key, if any.
    pub fn get(&self, key: u64) -> Option<Arc<PipelineEntry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }

    /// Caches a pipeline made elsewhere (counted as `PipelinesCreated`).
    pub fn insert(&self, key: u64, entry: Arc<PipelineEntry>) {
        metrics::inc("PipelinesCreated", 1);
        self.map.lock().unwrap_or_else(|e| e.into_inner()).put(key, entry);
    }

    /// Number of cached pipelines.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A kernel ready for pipeline creation: the source to compile (generic
/// over sizes or not) and the values of its dynamic sizes.
pub(crate) struct Prepared {
    pub name: String,
    pub source: String,
    pub entry: &'static str,
    pub inputs: usize,
    pub outputs: usize,
    /// Binds an error slot after its outputs.
    pub error_slot: bool,
    /// Values of the sizes buffer `LZD` (empty: a static kernel).
    pub dims: Vec<u32>,
    /// The source is proven in bounds (see [`crate::codegen::Wgsl::trusted`]):
    /// its module may be created unchecked where [`Pipelines`] allows it.
    pub trusted: bool,
}

impl Prepared {
    /// `wgsl` as it is.
    pub fn fixed(name: String, wgsl: &crate::codegen::Wgsl) -> Prepared {
        Prepared {
            name,
            source: wgsl.source.clone(),
            entry: wgsl.entry,
            inputs: wgsl.inputs,
            outputs: wgsl.outputs,
            error_slot: wgsl.error_slot,
            dims: Vec::new(),
            trusted: wgsl.trusted,
        }
    }
}

/// Kind of the disk cache's entries holding a kernel's naga module.
const MODULE_KIND: &str = "naga";

/// Kind of the driver pipeline cache entry in the disk cache.
const DRIVER_CACHE: &str = "pipelines";

/// The pipelines of a backend: the in-memory cache, and the persistent
/// compile cache with the driver's pipeline cache it loads and saves.
pub(crate) struct Pipelines {
    cache: PipelineCache,
    /// The persistent compile cache (see [`crate::compile::diskcache`]).
    disk: Option<Arc<DiskCache>>,
    /// The driver's pipeline cache, loaded from and saved to `disk`.
    driver_cache: Option<wgpu::PipelineCache>,
    /// Checksum of the driver cache blob last loaded or saved (an
    /// unchanged blob, e.g. lavapipe's always-empty one, is not written
    /// again).
    driver_saved: AtomicU64,
    /// When the driver cache was last saved (or loaded), while pipelines
    /// made since are not saved yet: `None` when nothing is pending.
    unsaved_since: Mutex<Option<Instant>>,
    /// When the driver cache was last saved or loaded.
    last_save: Mutex<Instant>,
    /// The compile threads: they create the pipelines of one plan.
    workers: Arc<crate::compile::threads::Workers>,
    /// Whether kernels proven in bounds get unchecked (trusted) modules:
    /// the switch, and never on wasm32 (see the module doc).
    trusted: bool,
}

/// Least time between two saves of the driver cache while pipelines keep
/// being made (each save fetches, checksums and writes the whole blob);
/// what is left unsaved is saved at the next batch after it, at
/// `Pipelines::flush`, or when the backend is dropped.
pub const DRIVER_SAVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

impl Pipelines {
    /// The persistent compile cache, where there is one.
    pub fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_deref()
    }

    /// Pipelines of `device`, at most `cap` cached in memory, the driver
    /// cache loaded from `disk` where the device has `PIPELINE_CACHE`.
    /// Creates pipelines on `workers`, the backend's compile threads.
    /// Kernels proven in bounds get trusted modules where `trusted` (and
    /// [`platform::TRUSTED_SHADERS`]).
    pub(crate) fn new(
        device: &wgpu::Device,
        cap: usize,
        disk: Option<Arc<DiskCache>>,
        workers: Arc<crate::compile::threads::Workers>,
        trusted: bool,
    ) -> Pipelines {
        let mut loaded = 0;
        let driver_cache = match &disk {
            Some(d) if device.features().contains(wgpu::Features::PIPELINE_CACHE) => {
                let data = d.get(DRIVER_CACHE, b"");
                loaded = data.as_deref().map_or(0, |b| diskcache::checksum(&[b]));
                Some(diskcache::driver_cache(device, data.as_deref()))
            }
            _ => None,
        };
        Pipelines {
            cache: PipelineCache::new(cap),
            disk,
            driver_cache,
            driver_saved: AtomicU64::new(loaded),
            unsaved_since: Mutex::new(None),
            last_save: Mutex::new(Instant::now()),
            workers,
            trusted: trusted && platform::TRUSTED_SHADERS,
        }
    }

    /// The compile threads: they create the pipelines of one plan (and
    /// lower a size variant's kernels, see `Compiler::compile`).
    pub(crate) fn workers(&self) -> &crate::compile::threads::Workers {
        &self.workers
    }

    /// Whether kernels proven in bounds get trusted modules here.
    pub fn trusted(&self) -> bool {
        self.trusted
    }

    /// Whether kernel `k`'s module is created trusted (unchecked).
    pub fn trusts(&self, k: &Prepared) -> bool {
        self.trusted && k.trusted
    }

    /// Number of cached pipelines.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Saves the driver cache now if new pipelines are not saved yet.
    pub fn flush(&self) {
        if self.unsaved_since.lock().unwrap_or_else(|e| e.into_inner()).take().is_some() {
            self.save_driver_cache();
        }
    }

    /// Notes new pipelines: the driver cache is saved at once when the
    /// last save is [`DRIVER_SAVE_INTERVAL`] old (the first batch of a
    /// process: its device creation), else later.
    fn created(&self) {
        if self.driver_cache.is_none() {
            return;
        }
        self.unsaved_since.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Instant::now);
        let due = self.last_save.lock().unwrap_or_else(|e| e.into_inner()).elapsed() >= DRIVER_SAVE_INTERVAL
            || self.driver_saved.load(Ordering::Relaxed) == 0;
        if due {
            self.flush();
        }
    }

    /// Saves the driver's pipeline cache in the disk cache when its blob
    /// changed since it was last loaded or saved.
    fn save_driver_cache(&self) {
        *self.last_save.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        let _span = lazuli_executor::timeline::span("SaveDriverCache");
        let (Some(disk), Some(cache)) = (&self.disk, &self.driver_cache) else { return };
        if let Some(data) = cache.get_data() {
            let sum = diskcache::checksum(&[&data]);
            if self.driver_saved.swap(sum, Ordering::Relaxed) != sum {
                disk.put(DRIVER_CACHE, b"", &data);
            }
        }
    }

    /// Pipelines for `kernels`, from the cache or created (validated
    /// first), the missing ones on the compile threads at once where
    /// `parallel`, else on the calling thread (a background compile that
    /// must not hold the threads a step's compile may need).
    pub fn get_or_create(
        &self,
        ctx: &Context,
        kernels: &[Prepared],
        parallel: bool,
    ) -> Result<Vec<Arc<PipelineEntry>>, BackendError> {
        let keys: Vec<u64> = kernels.iter().map(|k| PipelineCache::key(&k.source, k.entry, self.trusts(k))).collect();
        let mut found: HashMap<u64, Arc<PipelineEntry>> = HashMap::new();
        // One creation per distinct missing source.
        let mut missing: Vec<usize> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (i, &key) in keys.iter().enumerate() {
            if !seen.insert(key) {
                continue;
            }
            match self.cache.get(key) {
                Some(p) => {
                    found.insert(key, p);
                }
                None => missing.push(i),
            }
        }
        let create = |&i: &usize| self.create(ctx, &kernels[i], keys[i]);
        let created: Vec<_> =
            if parallel { self.workers.map(&missing, create) } else { missing.iter().map(create).collect() };
        for (&i, made) in missing.iter().zip(created) {
            let entry = Arc::new(made?);
            self.cache.insert(keys[i], entry.clone());
            found.insert(keys[i], entry);
        }
        if !missing.is_empty() {
            self.created();
        }
        Ok(keys.iter().map(|k| found[k].clone()).collect())
    }

    /// Creates the pipeline of `k` (validated first), with bind group 1
    /// for its dynamic sizes when it is generic. `key` is its
    /// [`PipelineCache::key`], which also names its naga module in the disk
    /// cache.
    fn create(&self, ctx: &Context, k: &Prepared, key: u64) -> Result<PipelineEntry, BackendError> {
        let name = k.name.as_str();
        tracing::debug!(kernel = name, generic = !k.dims.is_empty(), "creating a pipeline");
        crate::compile::validate::log_source(&k.source);
        let started = Instant::now();
        let module = stored_or_parsed(self.disk.as_deref(), k, key)?;
        metrics::record_time_of("CompileNaga", Some(name), started.elapsed());
        let started = Instant::now();
        let dev = &ctx.device;
        let scope = Scope::push(dev, wgpu::ErrorFilter::Validation);
        let desc =
            wgpu::ShaderModuleDescriptor { label: Some(name), source: platform::shader_source(&k.source, module) };
        let module = if self.trusts(k) {
            metrics::inc("TrustedModules", 1);
            tracing::debug!(kernel = name, "trusted shader module (no runtime checks)");
            // SAFETY: the generator proved every index of this source in
            // bounds, every loop bounded by a constant and every integer
            // divisor a nonzero constant (`codegen::matmul::trusted`), and
            // no rewrite touched it since (`Wgsl::trusted` is cleared by
            // windows, size families and fault injection); naga validated
            // it above.
            #[allow(unsafe_code)]
            unsafe {
                dev.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            dev.create_shader_module(desc)
        };
        let (layout, dims_layout) = layouts(dev, k);
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
            cache: self.driver_cache.as_ref(),
        });
        if let Some(e) = scope.pop() {
            return Err(BackendError::Compile { kernel: name.to_string(), message: format!("{e}\n{}", k.source) });
        }
        metrics::record_time_of("CompilePipeline", Some(name), started.elapsed());
        Ok(PipelineEntry { pipeline, layout, dims_layout })
    }
}

/// The naga module of `k`'s source, parsed and validated: read from the
/// disk cache where a process of this build parsed the same source (`key`
/// hashes the source and entry point) and stored its module
/// (`NagaModulesRead`), else parsed and validated here (`NagaValidations`)
/// and stored. Lexing and parsing WGSL is most of what naga costs (about
/// 1 ms of a kernel's pipeline on the 2-core box; reading the stored
/// module is some 20 times faster), and wgpu makes the shader module from
/// this one, so a source is parsed at most once per process and not at
/// all in a later one. wgpu still validates the module against the
/// device. A stored module that does not decode is a `DiskCacheBad`
/// warning; the source is parsed and stored again.
fn stored_or_parsed(disk: Option<&DiskCache>, k: &Prepared, key: u64) -> Result<naga::Module, BackendError> {
    let disk_key = key.to_le_bytes();
    if let Some(bytes) = disk.and_then(|d| d.get(MODULE_KIND, &disk_key)) {
        match postcard::from_bytes::<naga::Module>(&bytes) {
            Ok(module) => {
                metrics::inc("NagaModulesRead", 1);
                return Ok(module);
            }
            Err(e) => {
                metrics::inc("DiskCacheBad", 1);
                tracing::warn!(kernel = k.name, "a stored naga module does not decode ({e}); parsing its source");
            }
        }
    }
    metrics::inc("NagaValidations", 1);
    let module = parse_and_validate(&k.source)
        .map_err(|m| BackendError::Compile { kernel: k.name.clone(), message: format!("{m}\n{}", k.source) })?;
    if let Some(d) = disk {
        match postcard::to_allocvec(&module) {
            Ok(bytes) => d.put(MODULE_KIND, &disk_key, &bytes),
            Err(e) => tracing::warn!(kernel = k.name, "a naga module does not encode ({e}); not stored"),
        }
    }
    Ok(module)
}

impl Drop for Pipelines {
    fn drop(&mut self) {
        self.flush();
    }
}

/// The bind group layouts of kernel `k`: group 0 (the uniform, its inputs
/// read-only, its outputs, its error slot), and group 1 (its sizes) when
/// it is generic.
fn layouts(dev: &wgpu::Device, k: &Prepared) -> (wgpu::BindGroupLayout, Option<wgpu::BindGroupLayout>) {
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
    let uniform = wgpu::BindGroupLayoutEntry {
        binding: 0,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    };
    let mut entries = vec![uniform];
    for i in 0..k.inputs {
        entries.push(storage(1 + i as u32, true));
    }
    for i in 0..k.outputs {
        entries.push(storage((1 + k.inputs + i) as u32, false));
    }
    if k.error_slot {
        entries.push(storage((1 + k.inputs + k.outputs) as u32, false));
    }
    let name = Some(k.name.as_str());
    let layout = dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: name, entries: &entries });
    let dims_layout = (!k.dims.is_empty()).then(|| {
        dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: name, entries: &[storage(0, true)] })
    });
    (layout, dims_layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `m` compiles to: two modules that write the same SPIR-V are
    /// the same kernel.
    fn spirv(m: &naga::Module) -> Vec<u32> {
        let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
            .validate(m)
            .expect("a valid module");
        naga::back::spv::write_vec(m, &info, &naga::back::spv::Options::default(), None).expect("SPIR-V")
    }

    /// A source is parsed and stored once, then read; a stored module that
    /// does not decode is parsed again and replaced.
    #[test]
    fn a_module_is_parsed_once_and_then_read() {
        let dir = std::env::temp_dir().join(format!("lazuli-naga-modules-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let disk = DiskCache::open(Some(&dir), "test adapter", None).expect("a cache");
        let source = "@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&y)) { y[gid.x] = tanh(max(x[gid.x], 0.0)); }
}
"
        .to_string();
        let k = Prepared {
            name: "w1".into(),
            source,
            entry: "main",
            inputs: 1,
            outputs: 1,
            error_slot: false,
            dims: Vec::new(),
            trusted: false,
        };
        let key = PipelineCache::key(&k.source, k.entry, false);
        let counts = || (metrics::counter("NagaValidations"), metrics::counter("NagaModulesRead"));
        let (v0, r0) = counts();
        let parsed = stored_or_parsed(Some(&disk), &k, key).expect("parses");
        let (v1, r1) = counts();
        assert!(v1 > v0 && r1 == r0, "the first call parses");
        let read = stored_or_parsed(Some(&disk), &k, key).expect("reads");
        assert!(counts().1 > r1, "the second call reads the stored module");
        assert_eq!(spirv(&read), spirv(&parsed));
        // An entry whose payload is intact but is no module.
        disk.put(MODULE_KIND, &key.to_le_bytes(), &[0xff; 7]);
        let bad = metrics::counter("DiskCacheBad");
        let again = stored_or_parsed(Some(&disk), &k, key).expect("parses again");
        assert!(metrics::counter("DiskCacheBad") > bad, "an undecodable module is reported");
        assert_eq!(spirv(&again), spirv(&parsed));
        let r2 = counts().1;
        stored_or_parsed(Some(&disk), &k, key).expect("reads");
        assert!(counts().1 > r2, "the module parsed again replaced the bad entry");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A module stored in the disk cache and read back is the module
    /// parsed: it validates and writes the same SPIR-V, for every golden
    /// kernel (every kernel kind, both form profiles).
    #[test]
    fn a_stored_module_reads_back_as_parsed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files: Vec<_> = [root.join("tests/golden")]
            .iter()
            .flat_map(|d| std::fs::read_dir(d).expect("a directory of WGSL").flatten().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
            .collect();
        files.sort();
        assert!(files.len() >= 20, "golden kernels found: {}", files.len());
        let mut kernels = 0;
        for f in files {
            let text = std::fs::read_to_string(&f).expect("a source");
            // A golden file is a plan, then its kernels (and first passes)
            // one after another, each under a header line naming its
            // invocations.
            let header = |l: &str| l.starts_with("// kernel ") && l.contains("invocations");
            let mut sources: Vec<String> = Vec::new();
            for line in text.lines() {
                if header(line) {
                    sources.push(String::new());
                }
                if let Some(s) = sources.last_mut() {
                    s.push_str(line);
                    s.push('\n');
                }
            }
            if sources.is_empty() {
                sources.push(text);
            }
            for (i, source) in sources.iter().enumerate() {
                let at = format!("{} (kernel {i})", f.display());
                let parsed = parse_and_validate(source).unwrap_or_else(|e| panic!("{at}: {e}"));
                let bytes = postcard::to_allocvec(&parsed).expect("encodes");
                let read: naga::Module = postcard::from_bytes(&bytes).expect("decodes");
                assert_eq!(spirv(&read), spirv(&parsed), "{at}: the stored module writes other SPIR-V");
                kernels += 1;
            }
        }
        assert!(kernels >= 100, "kernels compared: {kernels}");
    }
}
