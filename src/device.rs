//! Device construction: wires the CPU and wgpu backends to executor
//! devices. `Device::default()` picks a wgpu adapter if there is one, else
//! the CPU backend, and says which.

use lazuli_cpu::{CpuBackend, CpuOptions};
use lazuli_executor::{config, Backend, BackendError, Device};
use lazuli_wgpu::{WgpuBackend, WgpuOptions};
use std::sync::{Arc, OnceLock};

/// Which backend a device should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU reference backend.
    Cpu,
    /// The wgpu backend (any adapter, software ones included).
    Wgpu,
}

fn cpu_backend() -> Arc<dyn Backend> {
    static CPU: OnceLock<Arc<CpuBackend>> = OnceLock::new();
    CPU.get_or_init(|| Arc::new(CpuBackend::new())).clone()
}

fn default_wgpu() -> Result<Arc<dyn Backend>, BackendError> {
    static WGPU: OnceLock<Result<Arc<WgpuBackend>, BackendError>> = OnceLock::new();
    WGPU.get_or_init(|| WgpuBackend::new(WgpuOptions::default()).map(Arc::new)).clone().map(|b| b as Arc<dyn Backend>)
}

/// Device constructors, as an extension trait of [`Device`] (in the
/// prelude): `Device::default()`, `Device::cpu()`, `Device::wgpu()`.
pub trait DeviceExt: Sized {
    /// A wgpu device if an adapter exists, else the CPU backend. Set
    /// `LAZULI_DEVICE=cpu|wgpu` to choose. The choice is logged, and printed
    /// to stderr when falling back to the CPU.
    ///
    /// A malformed configuration variable (`LAZULI_DEVICE=gpu`, or one the
    /// wgpu backend reads) is printed to stderr and gives a CPU device
    /// that fails every compilation with [`lazuli_executor::ExecError::Config`]
    /// naming the variable (see [`Device::new`]); [`DeviceExt::try_default`]
    /// returns it instead.
    fn default() -> Self;
    /// [`DeviceExt::default`], failing with `BackendError::Config` on a
    /// malformed configuration variable instead of deferring the error.
    fn try_default() -> Result<Self, BackendError>;
    /// A device on the CPU reference backend (shared by all such devices,
    /// and the fallback of wgpu devices).
    fn cpu() -> Self;
    /// A device on a CPU backend of its own built with `options` (its own
    /// memory budget and bytes-in-use count).
    fn cpu_with(options: CpuOptions) -> Self;
    /// A device on the default wgpu adapter (shared by all such devices).
    fn wgpu() -> Result<Self, BackendError>;
    /// A device on a wgpu backend built with `options` (its own wgpu device).
    fn wgpu_with(options: WgpuOptions) -> Result<Self, BackendError>;
    /// A device of the given kind.
    fn of_kind(kind: DeviceKind) -> Result<Self, BackendError>;
}

impl DeviceExt for Device {
    fn default() -> Device {
        Device::try_default().unwrap_or_else(|e| {
            eprintln!("lazuli: {e}");
            Device::cpu()
        })
    }

    fn try_default() -> Result<Device, BackendError> {
        config::check(&config::process)?;
        match config::choice(&config::process, "LAZULI_DEVICE")? {
            Some("cpu") => return Ok(Device::cpu()),
            Some(_) => {
                if let Ok(d) = Device::wgpu() {
                    return Ok(d);
                }
            }
            None => {}
        }
        match Device::wgpu() {
            Ok(d) => {
                tracing::info!(device = %d.name(), "using the wgpu backend");
                Ok(d)
            }
            Err(e) => {
                eprintln!("lazuli: no usable wgpu adapter ({e}); using the CPU backend");
                Ok(Device::cpu())
            }
        }
    }

    fn cpu() -> Device {
        let cpu = cpu_backend();
        Device::new(cpu.clone(), cpu)
    }

    fn cpu_with(options: CpuOptions) -> Device {
        let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::with_options(options));
        Device::new(cpu.clone(), cpu)
    }

    fn wgpu() -> Result<Device, BackendError> {
        Ok(Device::new(default_wgpu()?, cpu_backend()))
    }

    fn wgpu_with(options: WgpuOptions) -> Result<Device, BackendError> {
        Ok(Device::new(Arc::new(WgpuBackend::new(options)?), cpu_backend()))
    }

    fn of_kind(kind: DeviceKind) -> Result<Device, BackendError> {
        match kind {
            DeviceKind::Cpu => Ok(Device::cpu()),
            DeviceKind::Wgpu => Device::wgpu(),
        }
    }
}

/// A device on a wgpu backend built with `options`, opened without
/// blocking: in a browser tab (wasm32) the browser's WebGPU adapter, where
/// [`DeviceExt::wgpu_with`] is `BackendError::WouldBlock`; natively the
/// same as `wgpu_with`.
pub async fn wgpu_async(options: WgpuOptions) -> Result<Device, BackendError> {
    Ok(Device::new(Arc::new(WgpuBackend::new_async(options).await?), cpu_backend()))
}

/// Every wgpu adapter visible to this process, described in one line each.
pub fn adapters() -> Vec<String> {
    lazuli_wgpu::list_adapters()
}

pub use lazuli_cpu::CpuOptions as CpuDeviceOptions;
pub use lazuli_wgpu::WgpuOptions as WgpuDeviceOptions;
