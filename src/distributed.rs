//! Data-parallel training across processes on MPI (cargo feature `mpi`):
//! the `lazuli-distributed` crate's [`ProcessGroup`], [`DataParallel`] and
//! [`DistributedSampler`], plus the facade's wiring of a rank to its
//! device ([`device_for`]) and to a module's parameters
//! ([`data_parallel`]).
//!
//! ```no_run
//! use lazuli::distributed::{data_parallel, device_for, ProcessGroup};
//! use lazuli::nn::{Linear, Module, ModuleExt};
//! use lazuli::optim::{Optimizer, Sgd};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let group = ProcessGroup::init()?; // world size 1 without mpirun
//! let dev = device_for(&group)?;
//! let model = Linear::new(4, 2, &dev)?;
//! let mut dp = data_parallel(group, &model)?; // rank 0's values everywhere
//! let mut opt = Sgd::new(model.parameters(), 0.1);
//! let x = lazuli::Tensor::ones([8, 4], lazuli::DType::F32, &dev)?; // this rank's shard
//! model.forward(&x)?.sum(&[0, 1], false)?.backward()?;
//! dp.reduce_in_graph()?; // the all-reduce becomes part of the step
//! opt.step()?;
//! dev.mark_step()?; // runs the step; all-reduces overlap the backward pass
//! # Ok(()) }
//! ```

use crate::device::DeviceExt;
use crate::nn::{Module, ModuleExt};
use crate::{BackendError, Device, WgpuDeviceOptions};
pub use lazuli_distributed::{
    DataParallel, DistError, DistOptions, DistributedSampler, PendingReduce, ProcessGroup, ReduceStats, Transport,
};
use lazuli_executor::config;

/// This rank's device: `LAZULI_DEVICE=cpu` gives the CPU backend;
/// otherwise the wgpu adapter of the best type whose index is the rank's
/// local rank (modulo the number of such adapters), so the ranks of one
/// machine spread over its GPUs; without an adapter (and without
/// `LAZULI_DEVICE=wgpu`, which makes that an error) the CPU backend.
pub fn device_for(group: &ProcessGroup) -> Result<Device, BackendError> {
    config::check(&config::process)?;
    let wgpu =
        || Device::wgpu_with(WgpuDeviceOptions { adapter_index: Some(group.local_rank()), ..Default::default() });
    match config::choice(&config::process, "LAZULI_DEVICE")? {
        Some("cpu") => Ok(Device::cpu()),
        Some(_) => wgpu(),
        None => wgpu().or_else(|e| {
            if group.rank() == 0 {
                eprintln!("lazuli: no usable wgpu adapter ({e}); using the CPU backend");
            }
            Ok(Device::cpu())
        }),
    }
}

/// [`DataParallel`] over `module`'s named parameters: checks that every
/// rank has the same ones and broadcasts rank 0's values.
pub fn data_parallel(group: ProcessGroup, module: &(impl Module + ?Sized)) -> Result<DataParallel, DistError> {
    DataParallel::new(group, module.named_parameters())
}
