//! `lazuli info`: the wgpu adapters this machine offers, the device
//! `Device::default()` picks and why, and the effective configuration (each
//! `LAZULI_*` variable's value and where it came from).

use lazuli::prelude::*;

/// Lists the adapters, names the default device and prints the
/// configuration; a malformed variable is the error.
pub fn run() -> Result<(), String> {
    let adapters = lazuli::adapters();
    println!("wgpu adapters ({}):", adapters.len());
    for a in &adapters {
        println!("  {a}");
    }
    // A malformed variable still lists the configuration, then fails.
    let (dev, why) = match Device::default_choice() {
        Ok((dev, choice)) => (dev, choice.reason),
        Err(e) => (Device::default(), e.to_string()),
    };
    println!("default device: {} ({why})", dev.name());
    let config = dev.configuration();
    println!("{config}");
    config.check().map_err(|e| e.to_string())
}
