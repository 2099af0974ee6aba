//! Naga validation of generated WGSL: every source is parsed and validated
//! before a pipeline is created from it, so a codegen bug surfaces as a
//! `BackendError::Compile` carrying the source instead of a driver crash.

use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Parses and validates `source`; the error message includes the
/// diagnostic with its location. Subgroup operations are allowed: a
/// kernel uses them only where the device was opened with
/// `wgpu::Features::SUBGROUP` (`LowerLimits::subgroups`).
pub fn validate_wgsl(source: &str) -> Result<(), String> {
    parse_and_validate(source).map(|_| ())
}

/// [`validate_wgsl`], returning the parsed module: what a pipeline is
/// created from (see `crate::pipeline`), so the source is parsed once.
pub fn parse_and_validate(source: &str) -> Result<naga::Module, String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    // Subgroup operations only where the device has them (row kernels);
    // f16 is emitted only for adapters with `SHADER_F16`; `pack2x16float`
    // needs `DownlevelFlags::SHADER_F16_IN_F32` (every Vulkan, Metal, D3D12
    // and WebGPU device): see `crate::codegen::access`; cooperative matrices only
    // where the device runs them (`codegen::coop`).
    Validator::new(
        ValidationFlags::all(),
        Capabilities::SUBGROUP
            | Capabilities::SHADER_FLOAT16
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | Capabilities::COOPERATIVE_MATRIX,
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(source))?;
    Ok(module)
}

/// When `LAZULI_WGSL_LOG_DIR` is set, writes every generated source there
/// as `<hash>.wgsl` (before validation), so a test run can prove that every
/// source it produced validates (see `tests/naga_log.rs`).
pub fn log_source(source: &str) {
    let Some(dir) = lazuli_executor::config::path(&lazuli_executor::config::process, "LAZULI_WGSL_LOG_DIR") else {
        return;
    };
    let dir = dir.as_path();
    let hash = lazuli_ir::stable_hash(source);
    let path = dir.join(format!("{hash:016x}.wgsl"));
    if path.exists() {
        return;
    }
    let result = std::fs::create_dir_all(dir).and_then(|_| {
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = dir.join(format!("{hash:016x}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, source)?;
        std::fs::rename(&tmp, &path)
    });
    if let Err(e) = result {
        tracing::warn!(error = %e, "LAZULI_WGSL_LOG_DIR: could not log a WGSL source");
    }
}
