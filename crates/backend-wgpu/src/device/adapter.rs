//! Adapter selection. Honours wgpu's environment conventions
//! (`WGPU_BACKEND`, `WGPU_ADAPTER_NAME`, `WGPU_POWER_PREF`) and accepts
//! software adapters (lavapipe / llvmpipe), which is what CI runs on.
//!
//! Headless quiet: the Vulkan loader's implicit `VK_LAYER_MESA_device_select`
//! layer connects to the Wayland compositor whenever an instance enables
//! `VK_KHR_wayland_surface` (wgpu enables every surface extension the
//! driver offers), and libwayland prints "error: XDG_RUNTIME_DIR is invalid
//! or not set in the environment." to stderr when no compositor socket can
//! be named. Lazuli never presents to a window, so where libwayland cannot
//! reach a compositor anyway (no `WAYLAND_SOCKET`, no absolute
//! `WAYLAND_DISPLAY`, `XDG_RUNTIME_DIR` unset or relative) the Vulkan
//! instance is created without that one extension, through wgpu-hal, and
//! nothing is printed; the other backends come from an ordinary wgpu
//! instance beside it. Rejected alternatives: setting `NODEVICE_SELECT` or
//! `XDG_RUNTIME_DIR` in the process environment (visible to the whole
//! program and its children), redirecting stderr (loses other output).

use wgpu::{Adapter, Backends, DeviceType, Instance, InstanceDescriptor, PowerPreference};

/// The wgpu instances adapters come from: usually one, two when the
/// Vulkan backend has its own quiet instance (see the module docs).
pub struct Instances {
    list: Vec<Instance>,
}

impl Instances {
    /// Every adapter of every instance, Vulkan's first.
    pub fn adapters(&self) -> Vec<Adapter> {
        let backends = Backends::from_env().unwrap_or(Backends::all());
        self.list.iter().flat_map(|i| pollster::block_on(i.enumerate_adapters(backends))).collect()
    }
}

/// The instance descriptor for `backends`, from the environment.
fn descriptor(backends: Backends) -> InstanceDescriptor {
    let mut d = InstanceDescriptor::new_without_display_handle_from_env();
    d.backends = backends;
    // Where the native API reports a memory budget (D3D12, Vulkan with
    // VK_EXT_memory_budget), buffer creation near it fails with a clean
    // out-of-memory error, which the buffer pool answers by releasing
    // its cache and retrying, instead of the device being lost.
    d.memory_budget_thresholds =
        wgpu::MemoryBudgetThresholds { for_resource_creation: Some(95), for_device_loss: None };
    d
}

/// Creates the instances for the backends named by `WGPU_BACKEND` (all
/// backends when unset).
pub fn instance() -> Instances {
    let backends = Backends::from_env().unwrap_or(Backends::all());
    if backends.contains(Backends::VULKAN) && !wayland_reachable(&|k| std::env::var_os(k)) {
        if let Some(vk) = quiet_vulkan(&descriptor(Backends::VULKAN)) {
            let mut list = vec![vk];
            let rest = backends - Backends::VULKAN;
            if !rest.is_empty() {
                list.push(Instance::new(descriptor(rest)));
            }
            return Instances { list };
        }
    }
    Instances { list: vec![Instance::new(descriptor(backends))] }
}

/// Whether libwayland's `wl_display_connect(NULL)` can name a compositor
/// socket in this environment (`env` reads a variable). Where it cannot,
/// it prints the XDG_RUNTIME_DIR error and fails.
fn wayland_reachable(env: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> bool {
    let absolute = |k: &str| env(k).is_some_and(|v| v.to_string_lossy().starts_with('/'));
    env("WAYLAND_SOCKET").is_some() || absolute("WAYLAND_DISPLAY") || absolute("XDG_RUNTIME_DIR")
}

/// A Vulkan-only instance without `VK_KHR_wayland_surface`, or `None`
/// when Vulkan cannot be initialized (then the ordinary instance is used).
// wgpu-hal's instance creation is `unsafe`: the descriptor must be valid
// (it is built the way wgpu-core builds it) and the callback must not
// remove what wgpu relies on. The one extension removed is used only by
// `create_surface_from_wayland`, which checks the enabled list and
// returns an error without it; Lazuli creates no surfaces.
#[allow(unsafe_code)]
fn quiet_vulkan(desc: &InstanceDescriptor) -> Option<Instance> {
    use wgpu::hal;
    let hal_desc = hal::InstanceDescriptor {
        name: "lazuli",
        flags: desc.flags,
        memory_budget_thresholds: desc.memory_budget_thresholds,
        backend_options: desc.backend_options.clone(),
        telemetry: None,
        display: None,
    };
    let drop_wayland: Box<hal::vulkan::CreateInstanceCallback> = Box::new(|args| {
        args.extensions.retain(|e| e.to_bytes() != b"VK_KHR_wayland_surface");
    });
    // SAFETY: see the comment on the function.
    let raw = unsafe { hal::vulkan::Instance::init_with_callback(&hal_desc, Some(drop_wayland)) };
    match raw {
        // SAFETY: `raw` is a freshly created, valid Vulkan instance that
        // nothing else owns.
        Ok(raw) => Some(unsafe { Instance::from_hal::<hal::api::Vulkan>(raw) }),
        Err(e) => {
            tracing::debug!("no quiet Vulkan instance ({e}); using wgpu's");
            None
        }
    }
}

/// One line per adapter: `name (backend, device type)`.
pub fn list_adapters() -> Vec<String> {
    instance().adapters().iter().map(describe).collect()
}

/// `name (backend, device type)` of an adapter.
pub fn describe(a: &Adapter) -> String {
    let info = a.get_info();
    format!("{} ({:?}, {:?})", info.name, info.backend, info.device_type)
}

/// Picks an adapter: the first whose name contains `name` (or
/// `WGPU_ADAPTER_NAME`), case-insensitively; otherwise the best by device
/// type under `WGPU_POWER_PREF` (discrete first, software last); with
/// `index`, the `index`-th (modulo their number) of the adapters of that
/// best type, in wgpu's order.
pub fn select(inst: &Instances, name: Option<&str>, index: Option<usize>) -> Option<Adapter> {
    let adapters = inst.adapters();
    let env_name = std::env::var("WGPU_ADAPTER_NAME").ok();
    if let Some(want) = name.map(str::to_string).or(env_name) {
        let want = want.to_lowercase();
        return adapters.into_iter().find(|a| a.get_info().name.to_lowercase().contains(&want));
    }
    let pref = PowerPreference::from_env().unwrap_or(PowerPreference::None);
    let rank = |a: &Adapter| -> u8 {
        match (a.get_info().device_type, pref) {
            (DeviceType::IntegratedGpu, PowerPreference::LowPower) => 0,
            (DeviceType::DiscreteGpu, _) => 1,
            (DeviceType::IntegratedGpu, _) => 2,
            (DeviceType::VirtualGpu, _) => 3,
            (DeviceType::Cpu, _) => 4,
            (DeviceType::Other, _) => 5,
        }
    };
    let best = adapters.iter().map(rank).min()?;
    let mut of_best: Vec<Adapter> = adapters.into_iter().filter(|a| rank(a) == best).collect();
    let i = index.unwrap_or(0) % of_best.len();
    Some(of_best.swap_remove(i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn wayland_is_reachable_only_where_libwayland_can_name_a_socket() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
        };
        assert!(!wayland_reachable(&env(&[])));
        assert!(!wayland_reachable(&env(&[("XDG_RUNTIME_DIR", "run/user")])));
        assert!(!wayland_reachable(&env(&[("WAYLAND_DISPLAY", "wayland-0")])));
        assert!(wayland_reachable(&env(&[("XDG_RUNTIME_DIR", "/run/user/1000")])));
        assert!(wayland_reachable(&env(&[("WAYLAND_DISPLAY", "/tmp/wl.sock")])));
        assert!(wayland_reachable(&env(&[("WAYLAND_SOCKET", "3")])));
    }
}
