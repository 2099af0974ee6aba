//! Adapter selection. Honours wgpu's environment conventions
//! (`WGPU_BACKEND`, `WGPU_ADAPTER_NAME`, `WGPU_POWER_PREF`) and accepts
//! software adapters (lavapipe / llvmpipe), which is what CI runs on.

use wgpu::{Adapter, Backends, DeviceType, Instance, InstanceDescriptor, PowerPreference};

/// Creates an instance for the backends named by `WGPU_BACKEND` (all
/// backends when unset).
pub fn instance() -> Instance {
    let backends = Backends::from_env().unwrap_or(Backends::all());
    Instance::new({
        let mut d = InstanceDescriptor::new_without_display_handle_from_env();
        d.backends = backends;
        // Where the native API reports a memory budget (D3D12, Vulkan with
        // VK_EXT_memory_budget), buffer creation near it fails with a clean
        // out-of-memory error, which the buffer pool answers by releasing
        // its cache and retrying, instead of the device being lost.
        d.memory_budget_thresholds =
            wgpu::MemoryBudgetThresholds { for_resource_creation: Some(95), for_device_loss: None };
        d
    })
}

/// One line per adapter: `name (backend, device type)`.
pub fn list_adapters() -> Vec<String> {
    let inst = instance();
    let backends = Backends::from_env().unwrap_or(Backends::all());
    pollster::block_on(inst.enumerate_adapters(backends)).iter().map(describe).collect()
}

/// `name (backend, device type)` of an adapter.
pub fn describe(a: &Adapter) -> String {
    let info = a.get_info();
    format!("{} ({:?}, {:?})", info.name, info.backend, info.device_type)
}

/// Picks an adapter: the first whose name contains `name` (or
/// `WGPU_ADAPTER_NAME`), case-insensitively; otherwise the best by device
/// type under `WGPU_POWER_PREF` (discrete first, software last).
pub fn select(inst: &Instance, name: Option<&str>) -> Option<Adapter> {
    let backends = Backends::from_env().unwrap_or(Backends::all());
    let adapters = pollster::block_on(inst.enumerate_adapters(backends));
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
    adapters.into_iter().min_by_key(rank)
}
