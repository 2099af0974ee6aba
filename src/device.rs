//! Device construction: wires the CPU and wgpu backends to executor
//! devices. `Device::default()` picks the fastest real device: a hardware
//! GPU adapter if there is one, else the CPU backend (a software adapter
//! such as lavapipe runs the same kernels on the host's cores, 10-16x
//! slower than the CPU backend for small models, so it is used only when
//! asked for: `LAZULI_DEVICE=wgpu`, or `Device::wgpu()`).

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

/// What [`DeviceExt::default`] chose, and why, in words (what `lazuli
/// info` and the first line of `lazuli demo` print).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefaultChoice {
    /// The backend chosen.
    pub kind: DeviceKind,
    /// Why, e.g. "a hardware GPU adapter: NVIDIA ... (Vulkan, DiscreteGpu)"
    /// or "no hardware GPU adapter ...".
    pub reason: String,
}

/// Device constructors, as an extension trait of [`Device`] (in the
/// prelude): `Device::default()`, `Device::cpu()`, `Device::wgpu()`.
pub trait DeviceExt: Sized {
    /// The fastest real device: a wgpu device on a hardware GPU adapter
    /// (discrete, integrated or virtual; the one wgpu's conventions pick:
    /// `WGPU_BACKEND`, `WGPU_POWER_PREF`) if there is one, else the CPU
    /// backend, also where the only adapter is a software one (lavapipe,
    /// llvmpipe, SwiftShader), which is slower than the CPU backend.
    /// `LAZULI_DEVICE=cpu|wgpu` chooses instead (`wgpu`: the default
    /// adapter, software ones included). The choice and its reason are
    /// logged at info level ([`DeviceExt::default_choice`] gives them);
    /// asking for wgpu where none opens warns and gives the CPU backend.
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
    /// [`DeviceExt::try_default`] with what it chose and why.
    fn default_choice() -> Result<(Self, DefaultChoice), BackendError>;
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
        Device::default_choice().map(|(d, _)| d)
    }

    fn default_choice() -> Result<(Device, DefaultChoice), BackendError> {
        config::check(&config::process)?;
        let cpu = |reason: String| (Device::cpu(), DefaultChoice { kind: DeviceKind::Cpu, reason });
        let wgpu = |d: Device, reason: String| (d, DefaultChoice { kind: DeviceKind::Wgpu, reason });
        let (device, choice) = match config::choice(&config::process, "LAZULI_DEVICE")? {
            Some("cpu") => cpu("LAZULI_DEVICE=cpu".into()),
            Some(_) => match Device::wgpu() {
                Ok(d) => wgpu(d, "LAZULI_DEVICE=wgpu".into()),
                Err(e) => {
                    lazuli_executor::warn::once(
                        "LAZULI_DEVICE=wgpu without an adapter",
                        &format!("LAZULI_DEVICE=wgpu, but no wgpu adapter opened ({e}); using the CPU backend"),
                    );
                    cpu(format!("LAZULI_DEVICE=wgpu, but no wgpu adapter opened ({e})"))
                }
            },
            None => match hardware_adapter() {
                Some(adapter) => match Device::wgpu() {
                    Ok(d) => wgpu(d, format!("a hardware GPU adapter: {adapter}")),
                    Err(e) => cpu(format!("the hardware GPU adapter {adapter} did not open ({e})")),
                },
                None => cpu("no hardware GPU adapter (a software adapter such as lavapipe is slower than the CPU \
                     backend; LAZULI_DEVICE=wgpu uses it)"
                    .into()),
            },
        };
        tracing::info!(device = %device.name(), reason = %choice.reason, "Device::default()");
        Ok((device, choice))
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

/// The adapter the wgpu backend would open by default, described, when it
/// is a GPU (discrete, integrated or virtual), not a software rasterizer.
/// (In a browser tab there is none to open without waiting: see
/// [`wgpu_async`].)
#[cfg(target_arch = "wasm32")]
fn hardware_adapter() -> Option<String> {
    None
}

/// The adapter the wgpu backend would open by default, described, when it
/// is a GPU (discrete, integrated or virtual), not a software rasterizer.
#[cfg(not(target_arch = "wasm32"))]
fn hardware_adapter() -> Option<String> {
    let adapter = lazuli_wgpu::adapter::select(&lazuli_wgpu::adapter::instance(), None, None)?;
    let hardware = matches!(
        adapter.get_info().device_type,
        wgpu::DeviceType::DiscreteGpu | wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::VirtualGpu
    );
    hardware.then(|| lazuli_wgpu::adapter::describe(&adapter))
}

/// Every wgpu adapter visible to this process, described in one line each.
pub fn adapters() -> Vec<String> {
    lazuli_wgpu::list_adapters()
}

pub use lazuli_cpu::CpuOptions as CpuDeviceOptions;
pub use lazuli_wgpu::WgpuOptions as WgpuDeviceOptions;
