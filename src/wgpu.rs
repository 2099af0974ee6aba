//! Settings of the wgpu backend a program may choose, apart from the
//! backend-neutral API at the crate's root:
//!
//! - [`forms`]: the kernel forms, the strategy each kernel family is
//!   generated with (`KernelForms`, and one enum per family), chosen by
//!   adapter type unless `WgpuDeviceOptions::kernel_forms` or
//!   `LAZULI_KERNEL_FORMS` says otherwise.

/// The kernel forms (`KernelForms` and one enum per kernel family), whole,
/// so that a new form needs no change here.
pub mod forms {
    pub use lazuli_wgpu::codegen::forms::*;
}
