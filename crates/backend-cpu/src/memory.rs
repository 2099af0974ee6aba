//! Host memory of the CPU backend: every allocation whose size follows a
//! tensor's (outputs, uploads, and the scratch copies and offset tables of
//! the kernels) goes through [`Memory`], which can refuse it.
//!
//! A request is refused, as [`BackendError::OutOfMemory`] naming the bytes
//! asked, the bytes in use and the device, in two ways:
//!
//! - *Budget*: the bytes of live tensor storage plus the request would
//!   exceed the memory budget ([`crate::CpuOptions::memory_budget`], which
//!   falls back to `LAZULI_CPU_MEMORY_BYTES`, else the host's physical
//!   memory plus swap: what could ever be committed). The pool of freed vectors is released
//!   first, so the budget counts only what is in use.
//! - *Allocator*: the host allocator refused the request (`try_reserve`
//!   or a fallible zeroed allocation), as it does for sizes beyond the
//!   address space or, under heuristic overcommit, beyond RAM plus swap.
//!
//! Either way nothing aborts: the error reaches the barrier of the value
//! being computed and the backend stays usable. Rejected alternative: a
//! probe allocation before each step followed by the kernels' own
//! infallible ones. The real allocation could still fail after the probe
//! succeeded, and kernels allocate scratch the probe would not know of.
//!
//! Storage made here ([`Memory::track`]) counts its bytes as in use until
//! dropped ([`Memory::in_use`], the backend's `bytes_in_use` gauge);
//! vectors of [`Memory::POOL_MIN_BYTES`] or more then go back to a pool,
//! by dtype and length, for reuse by every later request of the same dtype
//! and length ([`Memory::take`], and [`Memory::vec`], [`Memory::zeroed`],
//! [`Memory::collect`], so that what the pool takes in it also gives out:
//! otherwise the outputs those allocate sit idle there up to its bound,
//! +55 MB of peak RSS on a 95M-parameter GGUF model's generation): a
//! steady training step finds every output it writes whole there, and
//! neither zeroes nor faults in fresh pages. A hit is not checked against
//! the budget (its bytes were counted when first allocated).
//! Fixed-size scratch (a fused loop's block registers) is not counted and
//! allocates normally.

use crate::storage::{CpuData, CpuStorage};
use half::{bf16, f16};
use lazuli_executor::BackendError;
use lazuli_ir::DType;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The host memory of one CPU backend: budget, bytes in use, and the pool
/// of freed large vectors.
#[derive(Debug)]
pub(crate) struct Memory {
    /// Most bytes of live storage; `u64::MAX` when unlimited.
    budget: u64,
    /// What set the budget, for errors ("a memory budget of N bytes").
    limited_by: String,
    in_use: AtomicU64,
    peak: AtomicU64,
    /// Bytes in `free`, readable without its lock (every request reads it).
    pooled: AtomicU64,
    free: Mutex<Pool>,
}

/// Freed vectors by dtype and length.
#[derive(Debug, Default)]
struct Pool {
    by_size: HashMap<(DType, usize), Vec<CpuData>>,
}

impl Pool {
    fn take(&mut self, key: (DType, usize)) -> Option<CpuData> {
        self.by_size.get_mut(&key)?.pop()
    }

    /// Drops vectors, the largest first, until at most `max` bytes remain
    /// of `pooled`; returns what remains. (A steady loop's pool does not
    /// grow: each step takes back what the step before released.)
    fn shrink(&mut self, mut pooled: usize, max: usize) -> usize {
        while pooled > max {
            let largest =
                self.by_size.iter().filter(|(_, b)| !b.is_empty()).max_by_key(|((dt, n), _)| n * dt.size_bytes());
            let Some((&key, _)) = largest else { break };
            if let Some(d) = self.by_size.get_mut(&key).and_then(Vec::pop) {
                pooled -= byte_len(&d);
            }
        }
        pooled
    }

    fn clear(&mut self) {
        self.by_size.clear();
    }
}

impl Default for Memory {
    fn default() -> Memory {
        Memory::new(None)
    }
}

impl Memory {
    /// Vectors smaller than this are not pooled (the allocator's own free
    /// lists serve them as well).
    const POOL_MIN_BYTES: usize = 4 << 10;
    /// Most bytes kept in the pool: the most bytes ever in use at once
    /// (what a steady loop can take back), at least `POOL_FLOOR_BYTES`,
    /// at most this.
    const POOL_MAX_BYTES: usize = 512 << 20;
    /// See `POOL_MAX_BYTES`.
    const POOL_FLOOR_BYTES: usize = 16 << 20;

    /// Host memory with `budget` bytes for live storage; `None` takes the
    /// host's physical memory plus swap (unlimited where that is unknown).
    /// The environment's fallback is applied before, by
    /// [`crate::CpuOptions::resolve`].
    pub(crate) fn new(budget: Option<u64>) -> Memory {
        let (budget, limited_by) = match budget {
            Some(b) => (b, format!("a memory budget of {b} bytes")),
            None => match physical_bytes() {
                Some(b) => (b, format!("{b} bytes of physical memory and swap")),
                None => (u64::MAX, "no memory budget".into()),
            },
        };
        Memory {
            budget,
            limited_by,
            in_use: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            pooled: AtomicU64::new(0),
            free: Mutex::default(),
        }
    }

    /// Bytes of live storage made by this memory.
    pub(crate) fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::Relaxed)
    }

    /// Most bytes in use at once so far.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Bytes of freed vectors kept for reuse.
    pub(crate) fn pooled(&self) -> u64 {
        self.pooled.load(Ordering::Relaxed)
    }

    /// The budget (`u64::MAX`: none).
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// An empty vector with room for `n` elements, or the typed error: a
    /// pooled vector of `T` and length `n` when there is one (see
    /// [`Memory::reuse`]), else a fresh one.
    pub(crate) fn vec<T: 'static>(&self, n: usize) -> Result<Vec<T>, BackendError> {
        if let Some(mut v) = self.reuse::<T>(n) {
            v.clear();
            return Ok(v);
        }
        let bytes = bytes_of::<T>(n);
        self.admit(bytes)?;
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| self.refused(bytes))?;
        Ok(v)
    }

    /// An empty vector with room for `n` elements for a copy leaving the
    /// backend (a readback): not tensor storage, so not held to the budget
    /// (a full device can still be read); only the host allocator can
    /// refuse it.
    pub(crate) fn host_vec<T>(&self, n: usize) -> Result<Vec<T>, BackendError> {
        let mut v = Vec::new();
        v.try_reserve_exact(n).map_err(|_| self.refused(bytes_of::<T>(n)))?;
        Ok(v)
    }

    /// `n` zero elements (zeroed pages from the OS for large vectors), or
    /// the typed error.
    pub(crate) fn zeroed<T: bytemuck::Zeroable + 'static>(&self, n: usize) -> Result<Vec<T>, BackendError> {
        if let Some(mut v) = self.reuse::<T>(n) {
            v.fill_with(T::zeroed);
            return Ok(v);
        }
        let bytes = bytes_of::<T>(n);
        self.admit(bytes)?;
        bytemuck::allocation::try_zeroed_vec(n).map_err(|()| self.refused(bytes))
    }

    /// `n` elements `f(0) .. f(n - 1)`, or the typed error.
    pub(crate) fn collect<T: 'static>(&self, n: usize, f: impl FnMut(usize) -> T) -> Result<Vec<T>, BackendError> {
        let mut v = self.vec(n)?;
        v.extend((0..n).map(f));
        Ok(v)
    }

    /// `n` elements of `dtype` whose contents are unspecified (zeros when
    /// fresh, a freed vector's values when reused): the caller overwrites
    /// every element.
    pub(crate) fn take(&self, dtype: DType, n: usize) -> Result<CpuData, BackendError> {
        match self.pop(dtype, n) {
            Some(d) => Ok(d),
            None => self.zeros(dtype, n),
        }
    }

    /// A pooled vector of `T` with `n` elements (its values unspecified),
    /// if the pool holds one. Every tensor-sized allocation looks here, not
    /// only [`Memory::take`]: storage made by [`Memory::vec`] or
    /// [`Memory::zeroed`] comes back to the pool when dropped, and a pool
    /// fed by releases that only `take` drew on kept whatever those
    /// allocations freed (the quantized products' outputs, a language
    /// model's prefill rows) idle up to its bound, tens of MB above the
    /// live bytes.
    fn reuse<T: 'static>(&self, n: usize) -> Option<Vec<T>> {
        let dtype = dtype_of::<T>()?;
        // A u8 vector may have held bools or bytes: either serves.
        let d = self.pop(dtype, n).or_else(|| if dtype == DType::U8 { self.pop(DType::Bool, n) } else { None })?;
        into_vec(d)
    }

    /// The pooled vector of `dtype` and length `n`, taken out of the pool,
    /// if it holds one (the one lookup of [`Memory::take`] and
    /// [`Memory::reuse`]; sizes under `POOL_MIN_BYTES` are never pooled).
    fn pop(&self, dtype: DType, n: usize) -> Option<CpuData> {
        if n.saturating_mul(dtype.size_bytes()) < Self::POOL_MIN_BYTES || self.pooled() == 0 {
            return None;
        }
        let d = self.lock_free().take((dtype, n))?;
        self.pooled.fetch_sub(byte_len(&d) as u64, Ordering::Relaxed);
        Some(d)
    }

    /// `n` zeros of `dtype`.
    pub(crate) fn zeros(&self, dtype: DType, n: usize) -> Result<CpuData, BackendError> {
        Ok(match dtype {
            DType::Bool => CpuData::Bool(self.zeroed(n)?),
            DType::I8 => CpuData::I8(self.zeroed(n)?),
            DType::I16 => CpuData::I16(self.zeroed(n)?),
            DType::I32 => CpuData::I32(self.zeroed(n)?),
            DType::I64 => CpuData::I64(self.zeroed(n)?),
            DType::U8 => CpuData::U8(self.zeroed(n)?),
            DType::U16 => CpuData::U16(self.zeroed(n)?),
            DType::U32 => CpuData::U32(self.zeroed(n)?),
            DType::U64 => CpuData::U64(self.zeroed(n)?),
            DType::F16 => CpuData::F16(self.zeroed::<f16>(n)?),
            DType::BF16 => CpuData::BF16(self.zeroed::<bf16>(n)?),
            DType::F32 => CpuData::F32(self.zeroed(n)?),
            DType::F64 => CpuData::F64(self.zeroed(n)?),
        })
    }

    /// Storage for `data`, counted as in use until dropped, when its vector
    /// comes back to this memory's pool.
    pub(crate) fn track(self: &Arc<Self>, data: CpuData) -> CpuStorage {
        let bytes = byte_len(&data) as u64;
        let now = self.in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        CpuStorage::tracked(data, self)
    }

    /// Called by tracked storage when dropped.
    pub(crate) fn release(&self, data: CpuData) {
        let bytes = byte_len(&data);
        self.in_use.fetch_sub(bytes as u64, Ordering::Relaxed);
        if !(Self::POOL_MIN_BYTES..=Self::POOL_MAX_BYTES).contains(&bytes) {
            return;
        }
        let mut free = self.lock_free();
        let pooled = self.pooled.load(Ordering::Relaxed) as usize + bytes;
        let key = (data.dtype(), data.len());
        free.by_size.entry(key).or_default().push(data);
        // Drop vectors until the pool fits its budget.
        let max = (self.peak() as usize).clamp(Self::POOL_FLOOR_BYTES, Self::POOL_MAX_BYTES);
        let pooled = free.shrink(pooled, max);
        self.pooled.store(pooled as u64, Ordering::Relaxed);
    }

    /// Checks a request of `bytes` against the budget, releasing the pool
    /// of freed vectors if that makes room.
    fn admit(&self, bytes: u64) -> Result<(), BackendError> {
        if self.budget == u64::MAX {
            return Ok(());
        }
        let fits = |held: u64| self.in_use().saturating_add(held).saturating_add(bytes) <= self.budget;
        if fits(0) {
            if !fits(self.pooled()) {
                self.release_pool();
            }
            return Ok(());
        }
        self.release_pool();
        Err(BackendError::OutOfMemory { bytes, in_use: self.in_use(), device: format!("cpu with {}", self.limited_by) })
    }

    /// The error for a request the host allocator refused; the pool is
    /// released so that the next request has what it held.
    fn refused(&self, bytes: u64) -> BackendError {
        self.release_pool();
        BackendError::OutOfMemory {
            bytes,
            in_use: self.in_use(),
            device: "cpu: the host allocator refused the request".into(),
        }
    }

    /// Frees every pooled vector.
    fn release_pool(&self) {
        let mut free = self.lock_free();
        free.clear();
        self.pooled.store(0, Ordering::Relaxed);
    }

    /// The pool's lock; `pooled` changes only while it is held.
    fn lock_free(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The dtype whose [`CpuData`] variant holds a `Vec<T>` (`u8`: U8, also
/// Bool's variant), if any.
fn dtype_of<T: 'static>() -> Option<DType> {
    use std::any::TypeId;
    let t = TypeId::of::<T>();
    let table = [
        (TypeId::of::<u8>(), DType::U8),
        (TypeId::of::<i8>(), DType::I8),
        (TypeId::of::<i16>(), DType::I16),
        (TypeId::of::<i32>(), DType::I32),
        (TypeId::of::<i64>(), DType::I64),
        (TypeId::of::<u16>(), DType::U16),
        (TypeId::of::<u32>(), DType::U32),
        (TypeId::of::<u64>(), DType::U64),
        (TypeId::of::<f16>(), DType::F16),
        (TypeId::of::<bf16>(), DType::BF16),
        (TypeId::of::<f32>(), DType::F32),
        (TypeId::of::<f64>(), DType::F64),
    ];
    table.iter().find(|(id, _)| *id == t).map(|(_, d)| *d)
}

/// The vector inside `d` as a `Vec<T>`, if that is its element type.
fn into_vec<T: 'static>(d: CpuData) -> Option<Vec<T>> {
    let any: Box<dyn std::any::Any> = match d {
        CpuData::Bool(v) | CpuData::U8(v) => Box::new(v),
        CpuData::I8(v) => Box::new(v),
        CpuData::I16(v) => Box::new(v),
        CpuData::I32(v) => Box::new(v),
        CpuData::I64(v) => Box::new(v),
        CpuData::U16(v) => Box::new(v),
        CpuData::U32(v) => Box::new(v),
        CpuData::U64(v) => Box::new(v),
        CpuData::F16(v) => Box::new(v),
        CpuData::BF16(v) => Box::new(v),
        CpuData::F32(v) => Box::new(v),
        CpuData::F64(v) => Box::new(v),
    };
    any.downcast::<Vec<T>>().ok().map(|b| *b)
}

/// Bytes of `n` elements of `T` (saturating: no allocation that large can
/// succeed anyway).
fn bytes_of<T>(n: usize) -> u64 {
    (n as u64).saturating_mul(std::mem::size_of::<T>() as u64)
}

fn byte_len(d: &CpuData) -> usize {
    d.len() * d.dtype().size_bytes()
}

/// Physical memory plus swap in bytes (`MemTotal + SwapTotal` of
/// `/proc/meminfo`), where the platform tells.
fn physical_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    };
    Some(field("MemTotal:")?.saturating_add(field("SwapTotal:").unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_refuses_requests_over_it_and_counts_live_storage() {
        let mem = Arc::new(Memory::new(Some(4096)));
        let a = mem.track(CpuData::F32(mem.zeroed(512).unwrap()));
        assert_eq!(mem.in_use(), 2048);
        let e = mem.vec::<f32>(600).unwrap_err().to_string();
        assert!(e.contains("out of memory allocating 2400 bytes") && e.contains("2048 bytes in use"), "{e}");
        assert!(e.contains("cpu with a memory budget of 4096 bytes"), "{e}");
        assert_eq!(mem.host_vec::<u8>(8192).unwrap().capacity(), 8192, "readback copies are outside the budget");
        drop(a);
        assert_eq!(mem.in_use(), 0);
        assert_eq!(mem.vec::<f32>(600).unwrap().capacity(), 600);
        assert_eq!(mem.peak(), 2048);
    }

    #[test]
    fn the_host_allocator_refusing_is_a_typed_error() {
        // 2^62 bytes: beyond any address space, whatever the overcommit.
        let mem = Memory::new(Some(u64::MAX));
        let e = mem.zeroed::<f32>(1 << 60).unwrap_err();
        let BackendError::OutOfMemory { bytes, device, .. } = &e else { panic!("{e:?}") };
        assert_eq!(*bytes, 1 << 62);
        assert!(device.contains("host allocator refused"), "{e}");
        assert!(mem.vec::<u8>(1 << 62).is_err());
    }

    #[test]
    fn the_pool_is_released_to_make_room() {
        let mem = Arc::new(Memory::new(Some(3 << 20)));
        drop(mem.track(mem.zeros(DType::U8, 2 << 20).unwrap()));
        assert_eq!((mem.in_use(), mem.pooled()), (0, 2 << 20));
        // 2 MiB pooled + 2 MiB asked exceeds 3 MiB: the pool goes.
        let v = mem.vec::<u8>(2 << 20).unwrap();
        assert_eq!((v.capacity(), mem.pooled()), (2 << 20, 0));
    }

    #[test]
    fn every_allocation_reuses_pooled_vectors_of_its_type_and_length() {
        // Storage made by `vec`/`zeroed` (not `take`) comes back to the
        // pool; the next such request of that type and length takes it back
        // instead of leaving it idle (the LLM's peak-RSS regression).
        let mem = Arc::new(Memory::new(None));
        let n = 4096;
        let mut v = mem.vec::<f32>(n).unwrap();
        v.extend((0..n).map(|i| i as f32));
        drop(mem.track(CpuData::F32(v)));
        assert_eq!(mem.pooled(), 4 * n as u64);
        let z = mem.zeroed::<f32>(n).unwrap();
        assert_eq!((z.len(), mem.pooled()), (n, 0));
        assert!(z.iter().all(|&x| x == 0.0), "a reused vector is zeroed");
        drop(mem.track(CpuData::F32(z)));
        let c = mem.collect(n, |i| i as f32 * 2.0).unwrap();
        assert_eq!((c.len(), c[n - 1], mem.pooled()), (n, (n - 1) as f32 * 2.0, 0));
        drop(mem.track(CpuData::F32(c)));
        // Another type or length does not take it; bools serve u8 requests.
        assert!(mem.vec::<i32>(n).unwrap().capacity() == n && mem.pooled() == 4 * n as u64);
        assert!(mem.vec::<f32>(n + 1).unwrap().capacity() == n + 1 && mem.pooled() == 4 * n as u64);
        drop(mem.track(CpuData::Bool(vec![1; 8192])));
        let b = mem.vec::<u8>(8192).unwrap();
        assert_eq!((b.len(), b.capacity(), mem.pooled()), (0, 8192, 4 * n as u64));
        // A steady loop of such allocations holds one vector, not one a step.
        for _ in 0..8 {
            drop(mem.track(CpuData::F32(mem.zeroed::<f32>(2 * n).unwrap())));
        }
        assert_eq!(mem.pooled(), 4 * n as u64 + 8 * n as u64);
    }

    #[test]
    fn physical_memory_is_known_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(physical_bytes().is_some_and(|b| b > 1 << 20));
        }
    }
}
