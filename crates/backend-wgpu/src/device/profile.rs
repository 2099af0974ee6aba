//! Per-kernel GPU times from timestamp queries: the profiler a backend
//! collects into while profiling is on (every kernel then runs in a
//! compute pass of its own with begin and end timestamps, as it does
//! while the timeline records; each launch is collected with its cost by
//! the model of [`crate::compile::cost`], and without a time where the adapter
//! has no timestamp queries), and the blocking read of resolved timestamp
//! pairs that the profiler and the autotuner share (over
//! [`crate::device::timestamps`]).

use crate::device::context::{device_err, Context};
use crate::device::timestamps::{map_intervals, mapped_intervals};
pub use lazuli_executor::LaunchSample;
use lazuli_executor::{BackendError, LaunchCost};
use std::sync::Mutex;

/// Collected launches, `None` while not profiling.
#[derive(Default)]
pub(crate) struct Profiler {
    samples: Mutex<Option<Vec<LaunchSample>>>,
}

impl Profiler {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Vec<LaunchSample>>> {
        self.samples.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts or stops collecting; returns whether it collects now.
    pub fn set(&self, on: bool) -> bool {
        let mut p = self.lock();
        *p = on.then(Vec::new);
        p.is_some()
    }

    /// Whether it collects.
    pub fn on(&self) -> bool {
        self.lock().is_some()
    }

    /// The launches collected since the last call, in launch order.
    pub fn take(&self) -> Vec<LaunchSample> {
        self.lock().as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Adds launches `costs` (in order) while collecting, with their GPU
    /// `intervals` in µs where they were timed.
    pub fn record(&self, costs: &[&LaunchCost], intervals: Option<&[(f64, f64)]>) {
        if let Some(p) = self.lock().as_mut() {
            p.extend(costs.iter().enumerate().map(|(i, cost)| LaunchSample {
                cost: (*cost).clone(),
                ms: intervals.and_then(|t| t.get(i)).map(|(begin, end)| (end - begin) / 1e3),
                threads: None,
                cpu_ms: None,
            }));
        }
    }
}

/// Maps the first `pairs` resolved timestamp pairs (begin and end of a
/// pass) of `read` after the device is done and returns each pair's time
/// in ms.
pub(crate) fn read_timestamps(ctx: &Context, read: &wgpu::Buffer, pairs: usize) -> Result<Vec<f64>, BackendError> {
    Ok(read_intervals(ctx, read, pairs)?.into_iter().map(|(begin, end)| (end - begin) / 1e3).collect())
}

/// Maps the first `pairs` resolved timestamp pairs of `read` after the
/// device is done and returns each pair's begin and end in µs of GPU time.
pub(crate) fn read_intervals(
    ctx: &Context,
    read: &wgpu::Buffer,
    pairs: usize,
) -> Result<Vec<(f64, f64)>, BackendError> {
    let mapping = map_intervals(read, pairs);
    ctx.wait()?;
    let mapped = mapping.recv().map_err(|e| device_err(&ctx.name, e))?;
    Ok(mapped_intervals((&ctx.name, &ctx.queue), read, pairs, mapped)?.0)
}
