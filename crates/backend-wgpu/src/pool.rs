//! The buffer pool: buffers bucketed by usage and power-of-two size class,
//! bounded in the free bytes it keeps. A [`WgpuStorage`] returns its buffer
//! to the pool when dropped (when the last `Buffer` clone goes away), so a
//! steady loop reuses buffers instead of allocating.

use lazuli_executor::{metrics, DeviceStorage};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Smallest size class in bytes.
pub const MIN_CLASS: u64 = 256;

/// Pool of device buffers.
#[derive(Debug)]
pub struct Pool {
    device: wgpu::Device,
    state: Mutex<State>,
    max_free_bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    free: HashMap<(u32, u64), Vec<wgpu::Buffer>>,
    free_bytes: u64,
    live_bytes: u64,
}

/// The size class holding `bytes`.
pub fn size_class(bytes: u64) -> u64 {
    bytes.max(MIN_CLASS).next_power_of_two()
}

impl Pool {
    /// A pool keeping at most `max_free_bytes` of idle buffers.
    pub fn new(device: wgpu::Device, max_free_bytes: u64) -> Arc<Pool> {
        Arc::new(Pool { device, state: Mutex::new(State::default()), max_free_bytes })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of at least `bytes` bytes with `usage`, reused if possible.
    pub fn acquire(self: &Arc<Self>, bytes: u64, usage: wgpu::BufferUsages) -> WgpuStorage {
        let class = size_class(bytes);
        let key = (usage.bits(), class);
        let reused = {
            let mut st = self.lock();
            let b = st.free.get_mut(&key).and_then(Vec::pop);
            if b.is_some() {
                st.free_bytes -= class;
            }
            st.live_bytes += class;
            b
        };
        let buffer = reused.unwrap_or_else(|| {
            metrics::inc("WgpuBufferAllocations", 1);
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("lazuli"),
                size: class,
                usage,
                mapped_at_creation: false,
            })
        });
        WgpuStorage { buffer: Some(buffer), class, usage, pool: self.clone() }
    }

    fn release(&self, buffer: wgpu::Buffer, usage: wgpu::BufferUsages, class: u64) {
        let mut st = self.lock();
        st.live_bytes -= class;
        if st.free_bytes + class <= self.max_free_bytes {
            st.free_bytes += class;
            st.free.entry((usage.bits(), class)).or_default().push(buffer);
        }
    }

    /// Bytes held: idle plus in use.
    pub fn bytes(&self) -> u64 {
        let st = self.lock();
        st.free_bytes + st.live_bytes
    }

    /// Bytes of idle buffers.
    pub fn free_bytes(&self) -> u64 {
        self.lock().free_bytes
    }
}

/// A pooled device buffer; returns to its pool on drop.
#[derive(Debug)]
pub struct WgpuStorage {
    buffer: Option<wgpu::Buffer>,
    class: u64,
    usage: wgpu::BufferUsages,
    pool: Arc<Pool>,
}

impl WgpuStorage {
    /// The wgpu buffer.
    pub fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("present until drop")
    }
}

impl Drop for WgpuStorage {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            self.pool.release(b, self.usage, self.class);
        }
    }
}

impl DeviceStorage for WgpuStorage {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn byte_size(&self) -> usize {
        self.class as usize
    }
}
