//! Per-kernel GPU times from timestamp queries: the profiler a backend
//! collects into while profiling is on (every kernel then runs in a
//! compute pass of its own with begin and end timestamps, as it does
//! while the timeline records; each launch is collected with its cost by
//! the model of [`crate::cost`], and without a time where the adapter
//! has no timestamp queries), the readback of resolved timestamp pairs
//! that the profiler, the timeline and the autotuner share (each mapping
//! notes when the device was seen done, the timeline's anchor), and the
//! timestamps of an overlapped execution kept until a later wait
//! collects them ([`PendingTimes`]).

use crate::context::{device_err, Context};
use lazuli_executor::platform::Instant;
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

/// The timestamps of an execution collected after it returned (see
/// [`crate::context::Context::collect_times`]): its launches' names and
/// the buffers its queries resolve into, kept until their mapping
/// settles.
pub(crate) struct PendingTimes {
    /// The launches' names, in order.
    pub names: Vec<String>,
    /// The readback buffer the timestamps are copied to.
    pub read: wgpu::Buffer,
    /// Its mapping, requested right after the submission.
    pub mapping: Mapping,
    /// The query set and resolve buffer, alive until the read completes.
    pub _queries: (wgpu::QuerySet, wgpu::Buffer),
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
    Ok(mapped_intervals(ctx, read, pairs, mapping.recv().map_err(|e| device_err(&ctx.name, e))?)?.0)
}

/// Asks for the first `pairs` timestamp pairs of `read` to be mapped once
/// the work that fills them is done: issued right after the submission,
/// the wait that sees the work finish completes the mapping (no second
/// round trip) and notes when it did.
pub(crate) fn map_intervals(read: &wgpu::Buffer, pairs: usize) -> Mapping {
    let (tx, rx) = std::sync::mpsc::channel();
    read.map_async(wgpu::MapMode::Read, 0..pairs as u64 * 16, move |r| {
        let _ = tx.send((r, Instant::now()));
    });
    rx
}

/// A [`map_intervals`] request: its outcome, and the host time when the
/// device was seen done (an upper bound of the last timestamp's host
/// time).
pub(crate) type Mapping = std::sync::mpsc::Receiver<Mapped>;

/// What a [`Mapping`] receives.
pub(crate) type Mapped = (Result<(), wgpu::BufferAsyncError>, Instant);

/// The intervals [`map_intervals`] asked for once `mapped` arrived, and
/// when it did; `read` is unmapped again.
pub(crate) fn mapped_intervals(
    ctx: &Context,
    read: &wgpu::Buffer,
    pairs: usize,
    mapped: Mapped,
) -> Result<(Vec<(f64, f64)>, Instant), BackendError> {
    let bytes = pairs as u64 * 16;
    let (outcome, done) = mapped;
    outcome.map_err(|e| device_err(&ctx.name, e))?;
    // Nanoseconds per tick.
    let period = ctx.queue.get_timestamp_period() as f64;
    let times: Vec<(f64, f64)> = {
        let view = read.get_mapped_range(0..bytes).map_err(|e| device_err(&ctx.name, e))?;
        bytemuck::cast_slice::<u8, u64>(&view)
            .chunks_exact(2)
            .map(|t| (t[0] as f64 * period / 1e3, t[1].max(t[0]) as f64 * period / 1e3))
            .collect()
    };
    read.unmap();
    Ok((times, done))
}
