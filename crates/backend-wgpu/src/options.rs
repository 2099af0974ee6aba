//! The options of the wgpu backend ([`WgpuOptions`]) and how they
//! resolve: against the environment ([`WgpuOptions::resolve`], the one
//! place this backend reads its `LAZULI_*` variables, through
//! `lazuli_executor::config`) and against the adapter (the kernel-form
//! profile, [`kernel_forms`]).

use crate::codegen::{KernelForms, MatmulForm, ReduceForm, RowsForm};
use lazuli_executor::config::{self, ConfigError, Lookup, Source};

/// Options of [`crate::WgpuBackend::new`].
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
    /// Without a name: the `n`-th (modulo their number) of the adapters of
    /// the best device type, in the order wgpu lists them. Data-parallel
    /// training gives each rank of a machine its own GPU with the rank's
    /// local index.
    pub adapter_index: Option<usize>,
    /// Most bytes of freed buffers the buffer pool keeps for reuse. Else
    /// `LAZULI_POOL_BYTES` (a decimal byte count; a malformed value fails
    /// [`crate::WgpuBackend::new`]), else derived from the adapter by
    /// [`crate::pool::default_max_idle_bytes`]: 256 MiB on a software adapter,
    /// `4 x max_buffer_size` clamped to 8..128 GiB on a GPU, where the
    /// cache is released when an allocation fails instead.
    pub pool_max_free_bytes: Option<u64>,
    /// Most bytes of device buffers this backend holds at once (in use
    /// plus cached). Else `LAZULI_DEVICE_MEMORY_BYTES` (a decimal byte
    /// count), else no cap but the
    /// device's. An allocation over it releases cached buffers; if that is
    /// not enough it fails with `BackendError::OutOfMemory`.
    pub memory_budget: Option<u64>,
    /// Most cached pipelines (default 1024).
    pub pipeline_cache_size: Option<usize>,
    /// The kernel-form profile: `Some(KernelForms::gpu())` or
    /// `Some(KernelForms::software())` (or any mix) forces it on any
    /// adapter; by default the adapter type picks (software adapters the
    /// software profile, others the GPU one), and the environment variable
    /// `LAZULI_KERNEL_FORMS=gpu|software` overrides that default (any
    /// other value fails [`crate::WgpuBackend::new`]). Tests use
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
    /// Whether to time candidate kernel forms on the adapter (compiled
    /// off the steps' path from the second execution of a plan with a
    /// large enough matmul, timed at a later plan boundary, see
    /// [`crate::autotune`]); default: on for GPUs, off for software
    /// adapters, `LAZULI_AUTOTUNE` (a flag: `1`, `0`, `true`, `false`,
    /// `on`, `off`) overrides.
    pub autotune: Option<bool>,
    /// Least work (floating-point operations, `2 * M * N * K`) of a
    /// matmul worth tuning (default [`crate::autotune::MIN_FLOPS`], else
    /// `LAZULI_AUTOTUNE_MIN_FLOPS`; tests lower it to tune small
    /// products).
    pub autotune_min_flops: Option<u64>,
    /// Where the autotuning results persist (else `LAZULI_CACHE_DIR`, empty
    /// meaning nowhere, else [`crate::autotune::cache_dir`]; `Some(None)`:
    /// nowhere).
    /// Also where the persistent compile cache lives (see
    /// [`crate::diskcache`]).
    pub cache_dir: Option<Option<std::path::PathBuf>>,
    /// Bound of the persistent compile cache in bytes on disk, each
    /// entry counted in whole blocks (else `LAZULI_CACHE_MAX_BYTES`, a
    /// decimal byte count, else [`crate::diskcache::DEFAULT_MAX_BYTES`]).
    pub cache_max_bytes: Option<u64>,
    /// Whether kernels of graphs that differ only in sizes share generic
    /// pipelines (see [`crate::generic`]); default on, the flag
    /// `LAZULI_GENERIC_SIZES` overrides.
    pub generic_sizes: Option<bool>,
    /// Executions of a plan with kernels generic over sizes after which
    /// they are compiled static in the background and swapped in (see
    /// [`crate::tier`]); else `LAZULI_SPECIALIZE_AFTER` (a positive
    /// integer), else [`crate::tier::SPECIALIZE_AFTER`] on GPUs and never
    /// on software adapters (whose kernels run on the cores the compile
    /// would take). `Some(0)`: never.
    pub specialize_after: Option<u64>,
    /// Whether independent elementwise kernels of different shapes share
    /// one multi-tensor dispatch (see `lazuli_ir::fusion::multi`); default
    /// on, the flag `LAZULI_MULTI_TENSOR` overrides.
    pub multi_tensor: Option<bool>,
    /// Whether a reduction of at most
    /// [`crate::codegen::INLINE_REDUCTION_LEN`] elements per output whose
    /// elements one kernel reads once each runs as a loop inside that
    /// kernel (see `lazuli_ir::fusion::FusionLimits::inline_reductions`);
    /// default on, the flag `LAZULI_INLINE_REDUCTIONS` overrides.
    pub inline_reductions: Option<bool>,
    /// Whether row kernels (softmax, layer norm, row reductions) combine
    /// the lanes sharing a row with subgroup operations where the adapter
    /// has `wgpu::Features::SUBGROUP` (default on; the flag
    /// `LAZULI_SUBGROUPS` overrides); off, or without the feature, they
    /// combine through workgroup-memory trees.
    pub subgroups: Option<bool>,
    /// Threads creating the pipelines of one plan and lowering the
    /// generic kernels of a size variant (else
    /// `LAZULI_COMPILE_THREADS`, a positive integer, else the machine's
    /// cores, at most 8).
    pub compile_threads: Option<usize>,
    /// Whether kernels whose generator proves every index in bounds (the
    /// tiled matmul) get shader modules without wgpu's runtime checks
    /// (bounds clamps, loop bounding, division guards; see
    /// `crate::pipeline`). Default on (never on wasm32); the flag
    /// `LAZULI_TRUSTED_SHADERS` overrides: `0` keeps every module checked.
    pub trusted_shaders: Option<bool>,
    /// Whether an execution returns once its commands are submitted and
    /// the execution before it has finished, so that the next one is
    /// encoded and submitted while the GPU still runs this one (at most
    /// two on the queue; default on, natively; the flag
    /// `LAZULI_OVERLAP_SUBMIT` overrides: `0` waits for each execution).
    /// Executions whose results need a readback to check (index errors)
    /// or whose times are profiled always wait (the timeline's are
    /// collected by a later wait).
    pub overlap_submit: Option<bool>,
    /// Launches the first submission of a streamed execution holds (0:
    /// never stream). An execution of more than twice as many launches
    /// that starts while none of the device's executions is in flight
    /// (the GPU idle: a loop that waits every step) is submitted in
    /// pieces as it is encoded, `n` launches first, then `2n`, `4n`, ...,
    /// so that the GPU runs the first kernels while the host encodes the
    /// rest. Default [`crate::STREAM_FIRST_LAUNCHES`]; the flag
    /// `LAZULI_STREAM_SUBMIT=0` submits every execution in one piece.
    /// Tests set 1 to stream every plan of three launches or more.
    pub stream_submit: Option<u64>,
    /// Store f16 tensors packed two per `u32` (true) or natively as
    /// `array<f16>` where the adapter has `SHADER_F16` (false); else
    /// `LAZULI_F16_PACKED`, else native on GPUs with the feature and packed
    /// on software adapters, where llvmpipe runs native f16 slower (see
    /// `crate::codegen::access`). Tests force both forms on lavapipe.
    pub f16_packed: Option<bool>,
    /// Whether f16 products run on tensor cores through cooperative
    /// matrices where the adapter runs them as `codegen::coop` needs
    /// (default on; the flag `LAZULI_COOPERATIVE_MATRIX` overrides: `0`
    /// keeps every product on the f32-compute forms and the experimental
    /// feature unrequested).
    pub cooperative_matrix: Option<bool>,
    /// Fault injection (tests only): kernels whose name contains this
    /// string compute a wrong value, for proving that shadow validation
    /// catches and names them.
    pub fault_kernel: Option<String>,
}

/// Where each option with an environment fallback got its value: from
/// code, the environment or (left unset) the default, by variable.
pub type Sources = Vec<(&'static str, Source)>;

/// WebGPU's default `maxStorageBuffersPerShaderStage`: what every browser
/// adapter offers at least, and what a page gets without asking for more.
pub const WEBGPU_DEFAULT_STORAGE_BUFFERS: u32 = 8;

/// WebGPU's default `maxStorageBufferBindingSize` (128 MiB).
pub const WEBGPU_DEFAULT_BINDING_BYTES: u64 = 128 << 20;

impl WgpuOptions {
    /// Options that clamp the device to WebGPU's default limits (8
    /// storage buffers per shader stage, 128 MiB per storage binding):
    /// native tests prove with them that every graph also runs in a
    /// browser tab that asks for no more than the defaults.
    pub fn webgpu_default_limits() -> WgpuOptions {
        WgpuOptions {
            max_storage_buffers: Some(WEBGPU_DEFAULT_STORAGE_BUFFERS),
            binding_window: Some(WEBGPU_DEFAULT_BINDING_BYTES),
            ..WgpuOptions::default()
        }
    }

    /// These options with every unset one that has an environment
    /// fallback filled from `lookup`, and where each came from. A
    /// malformed value is the error, naming the variable.
    pub fn resolve(&self, lookup: Lookup<'_>) -> Result<(WgpuOptions, Sources), ConfigError> {
        let mut out = self.clone();
        let mut sources = Sources::new();
        let mut note = |name, code: bool, env: bool| sources.push((name, Source::of(code, env)));
        let forms = config::choice(lookup, "LAZULI_KERNEL_FORMS")?.map(|f| {
            if f == "software" {
                KernelForms::software()
            } else {
                KernelForms::gpu()
            }
        });
        note("LAZULI_KERNEL_FORMS", self.kernel_forms.is_some(), forms.is_some());
        out.kernel_forms = self.kernel_forms.or(forms);
        let autotune = config::flag(lookup, "LAZULI_AUTOTUNE")?;
        note("LAZULI_AUTOTUNE", self.autotune.is_some(), autotune.is_some());
        out.autotune = self.autotune.or(autotune);
        let min_flops = config::count(lookup, "LAZULI_AUTOTUNE_MIN_FLOPS")?;
        note("LAZULI_AUTOTUNE_MIN_FLOPS", self.autotune_min_flops.is_some(), min_flops.is_some());
        out.autotune_min_flops = self.autotune_min_flops.or(min_flops.map(|n| n as u64));
        let cache_dir = config::dir_or_off(lookup, "LAZULI_CACHE_DIR");
        note("LAZULI_CACHE_DIR", self.cache_dir.is_some(), cache_dir.is_some());
        out.cache_dir = self.cache_dir.clone().or(cache_dir);
        let bytes = |name| config::bytes(lookup, name);
        let cache_max = bytes("LAZULI_CACHE_MAX_BYTES")?;
        note("LAZULI_CACHE_MAX_BYTES", self.cache_max_bytes.is_some(), cache_max.is_some());
        out.cache_max_bytes = self.cache_max_bytes.or(cache_max);
        let pool = bytes("LAZULI_POOL_BYTES")?;
        note("LAZULI_POOL_BYTES", self.pool_max_free_bytes.is_some(), pool.is_some());
        out.pool_max_free_bytes = self.pool_max_free_bytes.or(pool);
        let budget = bytes("LAZULI_DEVICE_MEMORY_BYTES")?;
        note("LAZULI_DEVICE_MEMORY_BYTES", self.memory_budget.is_some(), budget.is_some());
        out.memory_budget = self.memory_budget.or(budget);
        let multi = config::flag(lookup, "LAZULI_MULTI_TENSOR")?;
        note("LAZULI_MULTI_TENSOR", self.multi_tensor.is_some(), multi.is_some());
        out.multi_tensor = self.multi_tensor.or(multi);
        let inline = config::flag(lookup, "LAZULI_INLINE_REDUCTIONS")?;
        note("LAZULI_INLINE_REDUCTIONS", self.inline_reductions.is_some(), inline.is_some());
        out.inline_reductions = self.inline_reductions.or(inline);
        let generic = config::flag(lookup, "LAZULI_GENERIC_SIZES")?;
        note("LAZULI_GENERIC_SIZES", self.generic_sizes.is_some(), generic.is_some());
        out.generic_sizes = self.generic_sizes.or(generic);
        let specialize = config::count(lookup, "LAZULI_SPECIALIZE_AFTER")?;
        note("LAZULI_SPECIALIZE_AFTER", self.specialize_after.is_some(), specialize.is_some());
        out.specialize_after = self.specialize_after.or(specialize.map(|n| n as u64));
        let trusted = config::flag(lookup, "LAZULI_TRUSTED_SHADERS")?;
        note("LAZULI_TRUSTED_SHADERS", self.trusted_shaders.is_some(), trusted.is_some());
        out.trusted_shaders = self.trusted_shaders.or(trusted);
        let overlap = config::flag(lookup, "LAZULI_OVERLAP_SUBMIT")?;
        note("LAZULI_OVERLAP_SUBMIT", self.overlap_submit.is_some(), overlap.is_some());
        out.overlap_submit = self.overlap_submit.or(overlap);
        let stream = config::flag(lookup, "LAZULI_STREAM_SUBMIT")?;
        note("LAZULI_STREAM_SUBMIT", self.stream_submit.is_some(), stream.is_some());
        out.stream_submit = self.stream_submit.or(stream.map(|on| if on { crate::STREAM_FIRST_LAUNCHES } else { 0 }));
        let subgroups = config::flag(lookup, "LAZULI_SUBGROUPS")?;
        note("LAZULI_SUBGROUPS", self.subgroups.is_some(), subgroups.is_some());
        out.subgroups = self.subgroups.or(subgroups);
        let threads = config::count(lookup, "LAZULI_COMPILE_THREADS")?;
        note("LAZULI_COMPILE_THREADS", self.compile_threads.is_some(), threads.is_some());
        out.compile_threads = self.compile_threads.or(threads);
        let packed = config::flag(lookup, "LAZULI_F16_PACKED")?;
        note("LAZULI_F16_PACKED", self.f16_packed.is_some(), packed.is_some());
        out.f16_packed = self.f16_packed.or(packed);
        let coop = config::flag(lookup, "LAZULI_COOPERATIVE_MATRIX")?;
        note("LAZULI_COOPERATIVE_MATRIX", self.cooperative_matrix.is_some(), coop.is_some());
        out.cooperative_matrix = self.cooperative_matrix.or(coop);
        Ok((out, sources))
    }
}

/// The kernel forms for `options` (resolved: see [`WgpuOptions::resolve`])
/// on an adapter of type `device_type` (see [`WgpuOptions::kernel_forms`]).
pub fn kernel_forms(options: &WgpuOptions, device_type: wgpu::DeviceType) -> KernelForms {
    let software = device_type == wgpu::DeviceType::Cpu;
    let mut forms = options.kernel_forms.unwrap_or(if software { KernelForms::software() } else { KernelForms::gpu() });
    if let Some(c) = options.cooperative_rows {
        forms.rows = if c { RowsForm::Cooperative } else { RowsForm::PerRow };
        forms.reduce = if c { ReduceForm::Cooperative } else { ReduceForm::PerOutput };
    }
    if let Some(t) = options.tiled_matmul {
        forms.matmul = if t { MatmulForm::ByShape } else { MatmulForm::RegisterBlocked };
    }
    forms
}
