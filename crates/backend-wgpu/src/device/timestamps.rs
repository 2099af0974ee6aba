//! Timestamp readback: resolved timestamp pairs (begin and end of a pass)
//! mapped once the work that fills them is done ([`map_intervals`],
//! [`mapped_intervals`]), each mapping noting when the device was seen
//! done (the timeline's anchor), and the timestamps of an overlapped
//! execution kept until a later wait collects them ([`PendingTimes`]).
//! The profiler ([`crate::device::profile`]), the timeline (`Context::collect_times`)
//! and the autotuner share it. Below the device context: it reads the
//! device's queue and name, nothing of the context.

use lazuli_executor::platform::Instant;
use lazuli_executor::BackendError;

/// A device error naming the device `name`, as the context words them.
fn device_err(name: &str, message: impl ToString) -> BackendError {
    BackendError::Device { device: name.to_string(), message: message.to_string() }
}

/// The timestamps of an execution collected after it returned (see
/// [`crate::device::context::Context::collect_times`]): its launches' names and
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
/// when it did; `read` is unmapped again (`name` and `queue`: the
/// device's, see `crate::device::context::Context`).
pub(crate) fn mapped_intervals(
    (name, queue): (&str, &wgpu::Queue),
    read: &wgpu::Buffer,
    pairs: usize,
    mapped: Mapped,
) -> Result<(Vec<(f64, f64)>, Instant), BackendError> {
    let bytes = pairs as u64 * 16;
    let (outcome, done) = mapped;
    outcome.map_err(|e| device_err(name, e))?;
    // Nanoseconds per tick.
    let period = queue.get_timestamp_period() as f64;
    let times: Vec<(f64, f64)> = {
        let view = read.get_mapped_range(0..bytes).map_err(|e| device_err(name, e))?;
        bytemuck::cast_slice::<u8, u64>(&view)
            .chunks_exact(2)
            .map(|t| (t[0] as f64 * period / 1e3, t[1].max(t[0]) as f64 * period / 1e3))
            .collect()
    };
    read.unmap();
    Ok((times, done))
}
