//! `lazuli info`: the wgpu adapters this machine offers and the device
//! `Device::default()` picks.

use lazuli::prelude::*;

/// Lists the adapters and names the default device.
pub fn run() -> Result<(), String> {
    let adapters = lazuli::adapters();
    println!("wgpu adapters ({}):", adapters.len());
    for a in &adapters {
        println!("  {a}");
    }
    let dev = Device::default();
    println!("default device: {}", dev.name());
    Ok(())
}
