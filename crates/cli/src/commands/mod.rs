//! One module per `lazuli` command: its options (`Args`, a clap derive:
//! the doc comments are the `--help` text) and its `run`. Options several
//! commands share ([`DeviceChoice`], [`DevicesChoice`]) are here.

pub mod bench;
pub mod completions;
pub mod conformance;
pub mod demo;
pub mod dump;
pub mod generate;
pub mod info;
pub mod run;
pub mod trace;

use lazuli::prelude::*;
use lazuli::DeviceKind;

/// `--device cpu|wgpu` of a command that runs on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// The CPU reference backend.
    Cpu,
    /// The wgpu backend on the default adapter (`WGPU_BACKEND`,
    /// `WGPU_ADAPTER_NAME` choose it).
    Wgpu,
}

/// The device `choice` names, else `Device::default()` (`LAZULI_DEVICE`,
/// or wgpu where an adapter exists).
pub fn open_device(choice: Option<DeviceChoice>) -> Result<Device, String> {
    match choice {
        None => Ok(Device::default()),
        Some(DeviceChoice::Cpu) => Device::of_kind(DeviceKind::Cpu).map_err(|e| e.to_string()),
        Some(DeviceChoice::Wgpu) => Device::of_kind(DeviceKind::Wgpu).map_err(|e| e.to_string()),
    }
}

/// [`open_device`] with why that device: the option, or what
/// `Device::default()` chose and why.
pub fn open_device_and_reason(choice: Option<DeviceChoice>) -> Result<(Device, String), String> {
    match choice {
        None => match Device::default_choice() {
            Ok((d, chosen)) => Ok((d, format!("the default: {}", chosen.reason))),
            Err(e) => Err(e.to_string()),
        },
        Some(c) => {
            let reason = format!("--device {}", if c == DeviceChoice::Cpu { "cpu" } else { "wgpu" });
            open_device(Some(c)).map(|d| (d, reason))
        }
    }
}

/// `--device cpu|wgpu|all` of a command that compares devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DevicesChoice {
    /// The CPU reference backend only.
    Cpu,
    /// The wgpu backend only.
    Wgpu,
    /// Both.
    #[default]
    All,
}

impl DevicesChoice {
    /// Whether the CPU device is among the chosen.
    pub fn cpu(self) -> bool {
        self != DevicesChoice::Wgpu
    }

    /// Whether the wgpu device is among the chosen.
    pub fn wgpu(self) -> bool {
        self != DevicesChoice::Cpu
    }
}
