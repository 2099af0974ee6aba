//! The caching buffer allocator. Every device buffer of the backend comes
//! from [`Pool::acquire`]; a [`WgpuStorage`] returns its buffer to the pool
//! when dropped (when the last `Buffer` clone goes away), so a steady loop
//! reuses buffers instead of allocating (and having wgpu zero-fill) new
//! ones every iteration.
//!
//! - *Size classes* ([`size_class`]): powers of two up to 1 MiB; above it
//!   eight classes per doubling, so rounding wastes at most 12.5%. Idle
//!   buffers are kept in a `BTreeMap` keyed by (usage bits, size); a request
//!   takes an idle buffer of its exact class, else the smallest idle one at
//!   most twice the request ([`reuse_limit`]).
//! - *Idle budget* ([`PoolOptions::max_idle_bytes`], chosen by
//!   [`default_max_idle_bytes`]): how many bytes of freed buffers the pool
//!   keeps for reuse. Small on software adapters, effectively unbounded on
//!   GPUs, where the cache is released when an allocation fails instead.
//! - *Memory budget* ([`PoolOptions::memory_budget`], optional): a cap on
//!   the bytes the pool holds (in use plus idle). A request over it first
//!   evicts idle buffers; if the bytes in use alone leave no room, it fails
//!   with [`BackendError::OutOfMemory`].
//! - *Allocation failure*: buffers are created inside wgpu error scopes.
//!   When the device is out of memory, the pool releases every idle
//!   buffer, waits for the device to free them and retries once; a second
//!   failure is [`BackendError::OutOfMemory`] naming the bytes asked, the
//!   bytes in use and the device (any other wgpu error is
//!   `BackendError::Device`). The device stays usable. Requests over the
//!   device's buffer limits are `BackendError::TooLarge` before any call
//!   into wgpu.
//! - *Storage beyond one binding*: storage requests may be as large as
//!   `max_buffer_size`; those over `max_storage_buffer_binding_size` are
//!   bound in windows (see [`crate::codegen::window`]). A request that fits one
//!   binding always gets a buffer that does too (rounded and reused
//!   buffers stay within the binding limit), so it is bound whole.
//! - *Identity*: every buffer the pool creates gets an id no other buffer
//!   of the process ever has ([`WgpuStorage::id`]), kept while the buffer
//!   is idle and reused. Bind groups cached by the runtime are keyed by
//!   these ids (with the offset and size of each range bound). A buffer the pool lets go (evicted, or over the idle
//!   budget) is destroyed at once, so a cached bind group still naming it
//!   keeps no memory alive (and, its id never coming back, is never used
//!   again).
//!
//! Counters: `WgpuBufferAllocations` (real device allocations only),
//! `WgpuPoolReuse` (requests served from the cache), `WgpuPoolEvictions`
//! (idle buffers released for a budget or after a failed allocation).
//! [`Pool::stats`] gives the bytes in use and idle.

use crate::device::platform::Scope;
use lazuli_executor::{metrics, BackendError, DeviceStorage};
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The id of the next buffer any pool creates (see [`WgpuStorage::id`]).
static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Smallest size class in bytes.
pub const MIN_CLASS: u64 = 256;

/// Up to this size classes are powers of two; above it, eight per doubling.
pub const POW2_CLASSES_UP_TO: u64 = 1 << 20;

/// Idle bytes kept on a software adapter, whose "device memory" is the
/// host RAM every other process needs too.
pub const SOFTWARE_IDLE_BYTES: u64 = 256 << 20;

/// Lower and upper clamp of the idle budget on a GPU.
pub const GPU_IDLE_BYTES: (u64, u64) = (8 << 30, 128 << 30);

/// The size class holding `bytes`: a power of two up to
/// [`POW2_CLASSES_UP_TO`], above it the next multiple of an eighth of the
/// power of two below `bytes` (eight classes per doubling, at most 12.5%
/// rounding waste). Rejected alternative: multiples of an eighth of the
/// power of two *above* `bytes`, which wastes up to 25% just above a power
/// of two.
pub fn size_class(bytes: u64) -> u64 {
    let b = bytes.max(MIN_CLASS);
    if b <= POW2_CLASSES_UP_TO || b.is_power_of_two() {
        return b.next_power_of_two();
    }
    let step = (b.next_power_of_two() >> 1) / 8;
    b.div_ceil(step) * step
}

/// Largest idle buffer a request of `bytes` may take when its exact class
/// has none: twice the request, and never less than its own class.
pub fn reuse_limit(bytes: u64) -> u64 {
    size_class(bytes).max(bytes.saturating_mul(2))
}

/// The idle budget when neither `WgpuOptions::pool_max_free_bytes` nor
/// `LAZULI_POOL_BYTES` sets one.
///
/// The rule: on a software adapter ([`wgpu::DeviceType::Cpu`]: device
/// memory is host RAM) keep [`SOFTWARE_IDLE_BYTES`]; on a GPU keep
/// `4 x max_buffer_size`, clamped to [`GPU_IDLE_BYTES`] (8 GiB to
/// 128 GiB).
///
/// Why: on a GPU the memory belongs to this process, and a small fixed cap
/// makes every tensor above it a fresh, zero-filled allocation each
/// iteration (5-8x slower for large tensors). Like PyTorch's CUDA caching
/// allocator, the pool therefore keeps what it freed and gives the cache
/// back only when an allocation fails (see [`Pool::acquire`]); the upper
/// clamp only guards against adapters reporting a near-infinite
/// `max_buffer_size` (NVIDIA on Vulkan reports up to 2^52). wgpu 30 does
/// not tell how much memory a device has: adapter limits give only the
/// largest single buffer, and `Device::generate_allocator_report` reports
/// what wgpu itself has allocated (and is `None` on several backends), not
/// the capacity, so neither can size the budget.
pub fn default_max_idle_bytes(device_type: wgpu::DeviceType, max_buffer_size: u64) -> u64 {
    if device_type == wgpu::DeviceType::Cpu {
        SOFTWARE_IDLE_BYTES
    } else {
        max_buffer_size.saturating_mul(4).clamp(GPU_IDLE_BYTES.0, GPU_IDLE_BYTES.1)
    }
}

/// What a [`Pool`] is allowed to hold and create.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    /// Most bytes of idle buffers kept for reuse.
    pub max_idle_bytes: u64,
    /// Most bytes held in all (in use plus idle); `None`: no cap but the
    /// device's own.
    pub memory_budget: Option<u64>,
    /// The device's largest buffer (`Limits::max_buffer_size`).
    pub max_buffer_size: u64,
    /// The largest buffer bound whole as storage
    /// (`Limits::max_storage_buffer_binding_size`, at most
    /// `max_buffer_size`): a storage request up to it never gets a buffer
    /// above it; larger ones (bound in windows) may be up to
    /// `max_buffer_size`.
    pub max_storage_binding: u64,
    /// The device name, for errors.
    pub device_name: String,
}

/// Bytes held by a [`Pool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes of buffers handed out and not yet returned.
    pub in_use_bytes: u64,
    /// Bytes of idle buffers kept for reuse.
    pub idle_bytes: u64,
    /// Most bytes in use at once so far.
    pub peak_in_use_bytes: u64,
}

/// Pool of device buffers.
#[derive(Debug)]
pub struct Pool {
    device: wgpu::Device,
    options: PoolOptions,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Idle buffers and their ids by (usage bits, buffer size); no empty
    /// vectors.
    free: BTreeMap<(u32, u64), Vec<(wgpu::Buffer, u64)>>,
    /// The key in `free` of every idle buffer, by id.
    idle: HashMap<u64, (u32, u64)>,
    stats: PoolStats,
}

impl State {
    /// Takes the smallest idle buffer of `usage` whose size is in
    /// `lo..=hi`.
    fn take(&mut self, usage: u32, lo: u64, hi: u64) -> Option<(wgpu::Buffer, u64)> {
        let key = *self.free.range((usage, lo)..=(usage, hi)).next()?.0;
        let list = self.free.get_mut(&key).expect("key just found");
        let buffer = list.pop().expect("no empty lists");
        if list.is_empty() {
            self.free.remove(&key);
        }
        self.idle.remove(&buffer.1);
        self.stats.idle_bytes -= key.1;
        Some(buffer)
    }

    /// Takes the idle buffer `id` if it has `usage` and a size in
    /// `lo..=hi`.
    fn take_id(&mut self, id: u64, usage: u32, lo: u64, hi: u64) -> Option<(wgpu::Buffer, u64)> {
        let key = *self.idle.get(&id)?;
        if key.0 != usage || key.1 < lo || key.1 > hi {
            return None;
        }
        let list = self.free.get_mut(&key).expect("idle buffers are listed");
        let at = list.iter().position(|(_, i)| *i == id).expect("idle buffers are listed");
        let buffer = list.swap_remove(at);
        if list.is_empty() {
            self.free.remove(&key);
        }
        self.idle.remove(&id);
        self.stats.idle_bytes -= key.1;
        Some(buffer)
    }

    /// Takes idle buffers, largest first, until at most `keep` idle bytes
    /// remain; the caller drops them (outside the lock).
    fn evict_to(&mut self, keep: u64) -> Vec<wgpu::Buffer> {
        let mut evicted = Vec::new();
        while self.stats.idle_bytes > keep {
            let Some(key) = self.free.keys().max_by_key(|k| k.1).copied() else { break };
            let list = self.free.get_mut(&key).expect("key just found");
            if let Some((b, id)) = list.pop() {
                self.idle.remove(&id);
                evicted.push(b);
            }
            if list.is_empty() {
                self.free.remove(&key);
            }
            self.stats.idle_bytes -= key.1;
        }
        evicted
    }
}

impl Pool {
    /// A pool creating buffers on `device` within `options`.
    pub fn new(device: wgpu::Device, options: PoolOptions) -> Arc<Pool> {
        Arc::new(Pool { device, options, state: Mutex::new(State::default()) })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The options this pool was made with.
    pub fn options(&self) -> &PoolOptions {
        &self.options
    }

    /// A buffer of at least `bytes` bytes with `usage`: an idle one of the
    /// request's class or at most [`reuse_limit`] bytes, else a new one of
    /// [`size_class`] bytes (never rounded above the device's limit, nor a
    /// storage request that fits one binding above the binding limit).
    ///
    /// Fails with `TooLarge` when `bytes` exceeds the largest buffer the
    /// device may create for `usage`, and with `OutOfMemory` when the
    /// memory budget or the device has no room even after every idle
    /// buffer was released.
    pub fn acquire(self: &Arc<Self>, bytes: u64, usage: wgpu::BufferUsages) -> Result<WgpuStorage, BackendError> {
        self.acquire_preferring(bytes, usage, &[])
    }

    /// [`Pool::acquire`], taking the first of the buffers `prefer` (by
    /// [`WgpuStorage::id`]) that is idle and fits, if any. A compiled plan
    /// asks for the buffers it had in its last executions, so that its
    /// cached bind groups (keyed by buffer ids) match again.
    pub fn acquire_preferring(
        self: &Arc<Self>,
        bytes: u64,
        usage: wgpu::BufferUsages,
        prefer: &[u64],
    ) -> Result<WgpuStorage, BackendError> {
        let limit = self.buffer_limit();
        if bytes > limit {
            return Err(BackendError::TooLarge {
                op: format!("allocating a {usage:?} buffer"),
                bytes,
                limit,
                limit_name: "the device's largest buffer (max_buffer_size)".into(),
            });
        }
        // A storage request that fits one binding stays within it.
        let cap = match usage.contains(wgpu::BufferUsages::STORAGE) && bytes <= self.binding_limit() {
            true => self.binding_limit(),
            false => limit,
        };
        let size = size_class(bytes).min(cap);
        let evicted = {
            let mut st = self.lock();
            let hi = reuse_limit(bytes).max(size).min(cap);
            let preferred = prefer.iter().find_map(|&id| st.take_id(id, usage.bits(), size, hi));
            if let Some((buffer, id)) = preferred.or_else(|| st.take(usage.bits(), size, hi)) {
                st.stats.in_use_bytes += buffer.size();
                st.stats.peak_in_use_bytes = st.stats.peak_in_use_bytes.max(st.stats.in_use_bytes);
                drop(st);
                metrics::inc("WgpuPoolReuse", 1);
                return Ok(self.wrap(buffer, id, usage));
            }
            let mut evicted = Vec::new();
            if let Some(budget) = self.options.memory_budget {
                let in_use = st.stats.in_use_bytes;
                let fits = in_use.saturating_add(size) <= budget;
                evicted = st.evict_to(if fits { budget - in_use - size } else { 0 });
                if !fits {
                    drop(st);
                    evicted_metric(&evicted);
                    drop(evicted);
                    return Err(BackendError::OutOfMemory {
                        bytes,
                        in_use,
                        device: format!("{} with a memory budget of {budget} bytes", self.options.device_name),
                    });
                }
            }
            // Reserve the bytes before allocating so that concurrent
            // requests see them against the budget.
            st.stats.in_use_bytes += size;
            st.stats.peak_in_use_bytes = st.stats.peak_in_use_bytes.max(st.stats.in_use_bytes);
            evicted
        };
        evicted_metric(&evicted);
        drop(evicted);
        let mut created = self.create(size, usage);
        if let Err(e @ wgpu::Error::OutOfMemory { .. }) = &created {
            tracing::warn!(
                device = %self.options.device_name,
                "allocating {size} bytes failed ({e}); releasing the buffer cache and retrying"
            );
            self.release_idle();
            // Dropped buffers are freed once the device has finished with
            // them.
            let _ = self.device.poll(wgpu::PollType::Wait { submission_index: None, timeout: None });
            created = self.create(size, usage);
        }
        match created {
            Ok(buffer) => Ok(self.wrap(buffer, NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed), usage)),
            Err(e) => {
                let in_use = {
                    let mut st = self.lock();
                    st.stats.in_use_bytes -= size;
                    st.stats.in_use_bytes
                };
                let device = &self.options.device_name;
                Err(match e {
                    wgpu::Error::OutOfMemory { .. } => {
                        BackendError::OutOfMemory { bytes, in_use, device: format!("{device}: {e}") }
                    }
                    _ => BackendError::Device {
                        device: device.clone(),
                        message: format!("creating a buffer of {size} bytes ({usage:?}): {e}"),
                    },
                })
            }
        }
    }

    /// Releases every idle buffer (the device frees them once it has
    /// finished with them); returns how many bytes were idle.
    pub fn release_idle(&self) -> u64 {
        let (bytes, evicted) = {
            let mut st = self.lock();
            (st.stats.idle_bytes, st.evict_to(0))
        };
        evicted_metric(&evicted);
        bytes
    }

    /// Bytes held: idle plus in use.
    pub fn bytes(&self) -> u64 {
        let s = self.stats();
        s.idle_bytes + s.in_use_bytes
    }

    /// Bytes of idle buffers.
    pub fn free_bytes(&self) -> u64 {
        self.stats().idle_bytes
    }

    /// Bytes in use and idle.
    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    /// The largest buffer the device may create, a multiple of 4 (wgpu's
    /// copy alignment). Storage buffers over the binding limit are bound
    /// in windows, so every usage has the same limit.
    fn buffer_limit(&self) -> u64 {
        self.options.max_buffer_size & !3
    }

    /// The largest storage buffer bound whole, a multiple of 4.
    fn binding_limit(&self) -> u64 {
        self.options.max_storage_binding.min(self.options.max_buffer_size) & !3
    }

    /// Creates a buffer, reporting the device's out-of-memory, validation
    /// or internal error instead of leaving an invalid buffer behind.
    fn create(&self, size: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, wgpu::Error> {
        let _span = lazuli_executor::timeline::span("PoolCreateBuffer");
        let internal = Scope::push(&self.device, wgpu::ErrorFilter::Internal);
        let validation = Scope::push(&self.device, wgpu::ErrorFilter::Validation);
        let oom = Scope::push(&self.device, wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lazuli"),
            size,
            usage,
            mapped_at_creation: false,
        });
        let oom = oom.pop();
        let validation = validation.pop();
        let internal = internal.pop();
        match oom.or(validation).or(internal) {
            Some(e) => Err(e),
            None => {
                metrics::inc("WgpuBufferAllocations", 1);
                Ok(buffer)
            }
        }
    }

    fn wrap(self: &Arc<Self>, buffer: wgpu::Buffer, id: u64, usage: wgpu::BufferUsages) -> WgpuStorage {
        WgpuStorage { buffer: Some(buffer), id, usage, pool: self.clone(), output: Default::default() }
    }

    fn release(&self, buffer: wgpu::Buffer, id: u64, usage: wgpu::BufferUsages) {
        let size = buffer.size();
        let kept = {
            let mut st = self.lock();
            st.stats.in_use_bytes -= size;
            let keep = st.stats.idle_bytes + size <= self.options.max_idle_bytes;
            if keep {
                st.stats.idle_bytes += size;
                st.free.entry((usage.bits(), size)).or_default().push((buffer, id));
                st.idle.insert(id, (usage.bits(), size));
                None
            } else {
                Some(buffer)
            }
        };
        if let Some(b) = kept {
            b.destroy();
        }
    }
}

/// Counts buffers released from the cache and destroys them (the device
/// frees them once the work submitted before has finished).
fn evicted_metric(evicted: &[wgpu::Buffer]) {
    if !evicted.is_empty() {
        metrics::inc("WgpuPoolEvictions", evicted.len() as u64);
    }
    for b in evicted {
        b.destroy();
    }
}

/// A pooled device buffer; returns to its pool on drop.
#[derive(Debug)]
pub struct WgpuStorage {
    buffer: Option<wgpu::Buffer>,
    /// Unique among every buffer any pool of the process created.
    id: u64,
    usage: wgpu::BufferUsages,
    pool: Arc<Pool>,
    /// Set once when an execution produced this buffer as an output: what
    /// it records about it (`crate::device::transfer::OutputOf`: which output, and
    /// a copy made early). Typed by its owner, not here: the allocator
    /// knows nothing of transfers.
    ///
    /// Rejected alternative: the field typed as `transfer::OutputOf`, as
    /// it was: the allocator then imported the transfers that import it
    /// (an early copy is itself a pool buffer), an import circle for one
    /// field.
    output: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
}

impl WgpuStorage {
    /// What an execution recorded about this buffer as its output, if an
    /// execution made it and it is a `T`.
    pub(crate) fn output<T: 'static>(&self) -> Option<&T> {
        self.output.get().and_then(|o| o.downcast_ref())
    }

    /// Records `output` about this buffer, an execution's output (at most
    /// once: a pool buffer holds one value).
    pub(crate) fn set_output<T: std::any::Any + Send + Sync>(&self, output: T) {
        let _ = self.output.set(Box::new(output));
    }

    /// The wgpu buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("present until drop")
    }

    /// The buffer's identity: unique among every buffer any pool of the
    /// process has created, the same each time the pool hands this buffer
    /// out again, and never given to another buffer (ids are not reused
    /// when a buffer is destroyed).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for WgpuStorage {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            self.pool.release(b, self.id, self.usage);
        }
    }
}

impl DeviceStorage for WgpuStorage {
    fn as_any(&self) -> &dyn Any {
        self
    }
    /// The buffer's real size: its size class, or an idle buffer up to
    /// twice the request that was reused.
    fn byte_size(&self) -> usize {
        self.buffer().size() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_classes_are_powers_of_two() {
        assert_eq!(size_class(0), MIN_CLASS);
        assert_eq!(size_class(1), MIN_CLASS);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1000), 1024);
        assert_eq!(size_class((1 << 20) - 4), 1 << 20);
        assert_eq!(size_class(1 << 20), 1 << 20);
    }

    #[test]
    fn large_classes_are_eighths_of_an_octave() {
        let mib = 1u64 << 20;
        assert_eq!(size_class(mib + 4), mib + mib / 8);
        assert_eq!(size_class(mib + mib / 8), mib + mib / 8);
        assert_eq!(size_class(mib + mib / 8 + 4), mib + mib / 4);
        assert_eq!(size_class(2 * mib - 4), 2 * mib);
        assert_eq!(size_class(2 * mib), 2 * mib);
        assert_eq!(size_class(3 * mib), 3 * mib);
        assert_eq!(size_class(300 * mib), 320 * mib);
        assert_eq!(size_class(1 << 30), 1 << 30);
        assert_eq!(size_class((1 << 30) + 1), (1 << 30) + (1 << 27));
    }

    #[test]
    fn classes_cover_the_request_and_waste_at_most_an_eighth_above_1_mib() {
        let mut b = 1u64;
        while b < 1 << 40 {
            for x in [b, b + 3, b * 3 / 2, b * 2 - 1] {
                let c = size_class(x);
                assert!(c >= x, "{x} -> {c}");
                assert_eq!(c, size_class(c), "classes are fixed points ({x} -> {c})");
                assert_eq!(c % MIN_CLASS, 0);
                if x > POW2_CLASSES_UP_TO {
                    assert!((c - x) * 8 <= x, "{x} -> {c} wastes more than 12.5%");
                }
            }
            b *= 2;
        }
    }

    #[test]
    fn reuse_limit_is_twice_the_request_at_least_its_class() {
        assert_eq!(reuse_limit(1), MIN_CLASS);
        assert_eq!(reuse_limit(1000), 2000);
        assert_eq!(reuse_limit(3 << 20), 6 << 20);
    }

    #[test]
    fn default_idle_budget_follows_the_adapter_type() {
        assert_eq!(default_max_idle_bytes(wgpu::DeviceType::Cpu, 1 << 31), SOFTWARE_IDLE_BYTES);
        assert_eq!(default_max_idle_bytes(wgpu::DeviceType::DiscreteGpu, 256 << 20), 8 << 30);
        assert_eq!(default_max_idle_bytes(wgpu::DeviceType::DiscreteGpu, 4 << 30), 16 << 30);
        assert_eq!(default_max_idle_bytes(wgpu::DeviceType::DiscreteGpu, 1 << 52), 128 << 30);
        assert_eq!(default_max_idle_bytes(wgpu::DeviceType::DiscreteGpu, u64::MAX), 128 << 30);
    }
}
