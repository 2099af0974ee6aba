//! The options of the wgpu backend ([`WgpuOptions`]) and how they
//! resolve against the adapter: the kernel-form profile
//! ([`kernel_forms`]) and the switches that fall back to `LAZULI_*`
//! environment variables when code leaves them unset.

use crate::codegen::{KernelForms, MatmulForm, ReduceForm, RowsForm};

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
    /// Whether to time candidate kernel forms on the adapter (before the
    /// second execution of a plan with a large enough matmul, see
    /// [`crate::autotune`]); default: on for GPUs, off for software
    /// adapters, `LAZULI_AUTOTUNE` overrides.
    pub autotune: Option<bool>,
    /// Least work (floating-point operations, `2 * M * N * K`) of a
    /// matmul worth tuning (default [`crate::autotune::MIN_FLOPS`]; tests
    /// lower it to tune small products).
    pub autotune_min_flops: Option<u64>,
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
