//! Transfers between the host and the device in the canonical host byte
//! format: uploads and readbacks in chunks of at most [`TRANSFER_CHUNK`]
//! bytes, so staging memory stays bounded for tensors of any size; bools
//! are one byte on the host and one `u32` on the device, f16 and bf16 two
//! to a word, `u8` (quantized weight blocks) four to a word.
//!
//! Early copies: an execution copies each output of its plan that was
//! read from one of the [`EARLY_BEHIND`] executions before (and, in a
//! plan's first [`EARLY_BEHIND`] executions, its scalar outputs) into
//! readback buffers at the end of its own submission ([`early_copies`]).
//! Reading such an output then waits for that execution only and submits
//! nothing: a training loop that reads step N's loss while steps N + 1
//! and N + 2 are on the queue neither waits for them nor takes the queue
//! from the thread encoding them.

use crate::device::context::{device_err, Context, READBACK};
use crate::device::pool::WgpuStorage;
use lazuli_executor::{timeline, BackendError, Buffer};
use lazuli_ir::{DType, ValueType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Outputs of at most this many bytes (a scalar, a few elements) are
/// copied early by an executable's first [`EARLY_BEHIND`] executions (see
/// [`OutputsRead`]) whether or not they were read before.
pub(crate) const EARLY_SMALL: u64 = 16;

/// How far behind the newest execution a loop may read and still find
/// early copies: one step behind keeps one step queued behind the one
/// running, two behind keeps the GPU fed while the host records the next
/// step (the queue holds two executions, so three covers both).
pub(crate) const EARLY_BEHIND: u64 = 3;

/// Most bytes one execution copies early.
pub(crate) const EARLY_BUDGET: u64 = 64 << 20;

/// Which outputs of an executable were read, and when.
#[derive(Debug, Default)]
pub(crate) struct OutputsRead {
    /// Executions started (the first is 1).
    runs: AtomicU64,
    /// Per output, the last execution whose value of it was read (0:
    /// none).
    read_at: Box<[AtomicU64]>,
}

impl OutputsRead {
    /// The reads of an executable with `outputs` outputs.
    pub fn new(outputs: usize) -> OutputsRead {
        OutputsRead { runs: AtomicU64::new(0), read_at: (0..outputs).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Counts an execution starting; returns its number.
    pub fn start(&self) -> u64 {
        self.runs.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether execution `run` copies output `i` of `len` bytes early:
    /// an output read from one of the [`EARLY_BEHIND`] executions before
    /// (a loop that reads one step behind reads execution `run - 1`'s
    /// value after `run` has started, two behind `run - 2`'s), and in the
    /// first [`EARLY_BEHIND`] executions, before any read could tell, a
    /// scalar. So an output nobody reads costs at most [`EARLY_BEHIND`]
    /// copies.
    fn wanted(&self, run: u64, i: usize, len: u64) -> bool {
        (run <= EARLY_BEHIND && len <= EARLY_SMALL)
            || self.read_at.get(i).is_some_and(|r| {
                let at = r.load(Ordering::Relaxed);
                at != 0 && at + EARLY_BEHIND >= run
            })
    }
}

/// The execution output a buffer holds.
#[derive(Debug)]
pub(crate) struct OutputOf {
    /// The executable's reads.
    pub read: Arc<OutputsRead>,
    /// Which output.
    pub index: usize,
    /// Of which execution ([`OutputsRead::start`]'s number).
    pub run: u64,
    /// The copy its execution made, until the first read takes it.
    pub early: Mutex<Option<EarlyCopy>>,
}

/// A copy of an output made at the end of its execution's submission.
#[derive(Debug)]
pub(crate) struct EarlyCopy {
    /// The readback buffer holding the copy.
    pub staging: WgpuStorage,
    /// Device bytes copied.
    pub len: u64,
    /// The execution's submission, which the copy ends.
    pub submission: wgpu::SubmissionIndex,
}

/// Bytes one step of an upload or readback moves: bounds the staging
/// memory of a transfer (host-visible memory; on lavapipe, host RAM) to
/// one chunk, whatever the tensor's size.
pub(crate) const TRANSFER_CHUNK: u64 = 64 << 20;

impl Context {
    /// A new device buffer holding `bytes`, a value of type `ty` in the
    /// host format (the dtype must be one the device stores).
    pub fn upload(&self, bytes: &[u8], ty: &ValueType) -> Result<Buffer, BackendError> {
        let _span = timeline::span("Upload");
        let n = ty.shape.numel();
        debug_assert_eq!(bytes.len(), n * ty.dtype.size_bytes());
        let buf = self.new_buffer(ty, &[], || "upload".into())?;
        let st = self.storage(&buf)?;
        if matches!(ty.dtype, DType::F16 | DType::BF16 | DType::U8) {
            // 16-bit elements (or bytes: quantized weight blocks), the host
            // layout as it is (element 2k in the low half of word k, byte
            // 4k + j in bits 8j of word k: little endian), padded to whole
            // words.
            for (c, chunk) in bytes.chunks(TRANSFER_CHUNK as usize).enumerate() {
                let offset = c as u64 * TRANSFER_CHUNK;
                if chunk.len() % 4 == 0 {
                    self.queue.write_buffer(st.buffer(), offset, chunk);
                } else {
                    let mut padded = self.host_vec::<u8>(chunk.len().next_multiple_of(4), "upload")?;
                    padded.extend_from_slice(chunk);
                    padded.resize(chunk.len().next_multiple_of(4), 0);
                    self.queue.write_buffer(st.buffer(), offset, &padded);
                }
                if bytes.len() > TRANSFER_CHUNK as usize {
                    self.queue.submit([]);
                    self.wait()?;
                }
            }
            return Ok(buf);
        }
        // In chunks, each written and submitted before the next, so the
        // staging copy wgpu makes stays one chunk.
        let step = TRANSFER_CHUNK as usize / 4;
        let chunks = n.div_ceil(step);
        for c in 0..chunks {
            let (lo, hi) = (c * step, ((c + 1) * step).min(n));
            let offset = lo as u64 * 4;
            if ty.dtype == DType::Bool {
                let mut words = self.host_vec::<u32>(hi - lo, "upload")?;
                words.extend(bytes[lo..hi].iter().map(|&b| (b != 0) as u32));
                self.queue.write_buffer(st.buffer(), offset, bytemuck::cast_slice(&words));
            } else {
                self.queue.write_buffer(st.buffer(), offset, &bytes[lo * 4..hi * 4]);
            }
            if chunks > 1 {
                self.queue.submit([]);
                self.wait()?;
            }
        }
        Ok(buf)
    }

    /// The value of `buffer` in the host format, read back after all
    /// submitted work, or from the early copy its execution made (see the
    /// module documentation) once that execution is done.
    pub fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        let _span = timeline::span("Readback");
        let n = buffer.ty.shape.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        let st = self.storage(buffer)?;
        // Whole words (f16 and bf16 are 2 bytes each, padded to a word).
        let bytes = crate::device::context::device_bytes(&buffer.ty);
        // The host copy first: if the host cannot hold it, no device work
        // is wasted.
        let mut out = self.host_vec::<u8>(n * buffer.ty.dtype.size_bytes(), "readback")?;
        let early = st.output::<OutputOf>().and_then(|o| {
            if let Some(at) = o.read.read_at.get(o.index) {
                at.fetch_max(o.run, Ordering::Relaxed);
            }
            o.early.lock().unwrap_or_else(|e| e.into_inner()).take()
        });
        let dtype = buffer.ty.dtype;
        if let Some(EarlyCopy { staging, len, submission }) = early.filter(|c| c.len == bytes) {
            // Its execution's copy: wait for that execution only.
            let wait =
                || crate::device::platform::wait_for(&self.device, submission).map_err(|e| device_err(&self.name, e));
            self.read_mapped(staging.buffer(), len, wait, &mut out, dtype)?;
            lazuli_executor::metrics::inc("EarlyReadbacks", 1);
        } else {
            // Through one staging buffer of at most `TRANSFER_CHUNK`
            // bytes, a chunk at a time.
            let chunk = bytes.min(TRANSFER_CHUNK);
            let staging = self.pool.acquire(chunk, READBACK)?;
            let mut offset = 0;
            while offset < bytes {
                let len = chunk.min(bytes - offset);
                self.submit_chunk_copy(st.buffer(), offset, staging.buffer(), len);
                self.read_mapped(staging.buffer(), len, || self.wait(), &mut out, dtype)?;
                offset += len;
            }
        }
        // The padding of a half-precision or byte tensor's last word.
        out.truncate(n * dtype.size_bytes());
        Ok(out)
    }

    /// Submits a copy of `len` bytes of `from`, from byte `offset`, to the
    /// start of `staging`: one chunk of a readback (native and in the
    /// browser, [`download_async`]).
    pub(crate) fn submit_chunk_copy(&self, from: &wgpu::Buffer, offset: u64, staging: &wgpu::Buffer, len: u64) {
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(from, offset, staging, 0, len);
        self.queue.submit([enc.finish()]);
    }

    /// Appends the first `len` bytes of readback buffer `staging` to `out`
    /// in the host format, mapped once `wait` has seen the copy into it
    /// done; `staging` is unmapped again.
    fn read_mapped(
        &self,
        staging: &wgpu::Buffer,
        len: u64,
        wait: impl FnOnce() -> Result<(), BackendError>,
        out: &mut Vec<u8>,
        dtype: DType,
    ) -> Result<(), BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, 0..len, move |r| {
            let _ = tx.send(r);
        });
        wait()?;
        rx.recv().map_err(|e| device_err(&self.name, e))?.map_err(|e| device_err(&self.name, e))?;
        {
            let view = staging.get_mapped_range(0..len).map_err(|e| device_err(&self.name, e))?;
            decode(out, &view, dtype);
        }
        staging.unmap();
        Ok(())
    }
}

/// The early copies of execution `run`'s outputs (see the module
/// documentation), encoded into `enc` after its kernels: for each output
/// `outputs[i]` (`None`: not a buffer this execution made) that
/// [`OutputsRead`] wants, a readback buffer and the bytes copied, within
/// [`EARLY_BUDGET`]. Only where the thread can wait (not on the web).
pub(crate) fn early_copies(
    ctx: &Context,
    read: &OutputsRead,
    run: u64,
    outputs: &[Option<&Buffer>],
    enc: &mut wgpu::CommandEncoder,
) -> Result<Vec<Option<(WgpuStorage, u64)>>, BackendError> {
    let mut budget = EARLY_BUDGET;
    let mut copies = Vec::with_capacity(outputs.len());
    for (i, out) in outputs.iter().enumerate() {
        let copy = match out {
            Some(b) if crate::device::platform::CAN_BLOCK => {
                let len = crate::device::context::device_bytes(&b.ty);
                if read.wanted(run, i, len) && len > 0 && len <= budget.min(TRANSFER_CHUNK) {
                    budget -= len;
                    let staging = ctx.pool.acquire(len, READBACK)?;
                    enc.copy_buffer_to_buffer(ctx.storage(b)?.buffer(), 0, staging.buffer(), 0, len);
                    Some((staging, len))
                } else {
                    None
                }
            }
            _ => None,
        };
        copies.push(copy);
    }
    Ok(copies)
}

/// Appends the device words of `view` to `out` in the host format (bools
/// are one `u32` on the device, one byte on the host; f16 and bf16 keep
/// their 2 bytes, the caller drops the padding of the last word).
pub(crate) fn decode(out: &mut Vec<u8>, view: &[u8], dtype: DType) {
    if dtype == DType::Bool {
        let words: &[u32] = bytemuck::cast_slice(view);
        out.extend(words.iter().map(|&w| (w != 0) as u8));
    } else {
        out.extend_from_slice(view);
    }
}

/// Waits (without blocking) until the device has finished the work
/// submitted so far; then the first deferred error, if any.
#[cfg(target_arch = "wasm32")]
pub(crate) async fn finish_async(ctx: &Context) -> Result<(), BackendError> {
    let (send, recv) = crate::device::platform::oneshot();
    ctx.queue.on_submitted_work_done(move || send(()));
    recv.await;
    ctx.deferred.settled().await
}

/// The value of `buffer` in the host format, read back after all
/// submitted work without blocking (a chunk at a time, as
/// `Context::download` does); a deferred device error found meanwhile is
/// returned instead.
#[cfg(target_arch = "wasm32")]
pub(crate) async fn download_async(ctx: &Context, buffer: &lazuli_executor::Buffer) -> Result<Vec<u8>, BackendError> {
    let n = buffer.ty.shape.numel();
    let st = ctx.storage(buffer)?;
    let bytes = crate::device::context::device_bytes(&buffer.ty);
    let mut out = ctx.host_vec::<u8>(n * buffer.ty.dtype.size_bytes(), "readback")?;
    let chunk = bytes.clamp(4, TRANSFER_CHUNK);
    let staging = ctx.pool.acquire(chunk, READBACK)?;
    let mut offset = 0;
    while offset < bytes {
        let len = chunk.min(bytes - offset);
        ctx.submit_chunk_copy(st.buffer(), offset, staging.buffer(), len);
        crate::device::platform::map_read(staging.buffer(), len).await.map_err(|e| device_err(&ctx.name, e))?;
        let viewed = staging
            .buffer()
            .get_mapped_range(0..len)
            .map(|view| decode(&mut out, &view, buffer.ty.dtype))
            .map_err(|e| device_err(&ctx.name, e));
        // Unmapped before any return: the staging buffer goes back to the
        // pool.
        staging.buffer().unmap();
        viewed?;
        // An error found by an earlier execution's checks (their mappings
        // settled before this one) is this read's answer.
        ctx.deferred.settled().await?;
        offset += len;
    }
    out.truncate(n * buffer.ty.dtype.size_bytes());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_copied_early_when_scalar_or_read_from_the_three_executions_before() {
        let read = OutputsRead::new(2);
        let big = 1 << 20;
        // Nothing read yet: only the scalar, and only in the first three
        // executions.
        assert_eq!(read.start(), 1);
        assert!(read.wanted(1, 0, 4) && !read.wanted(1, 1, big));
        assert_eq!(read.start(), 2);
        assert!(read.wanted(2, 0, 4) && !read.wanted(2, 1, big) && read.wanted(3, 0, 4));
        assert!(!read.wanted(4, 0, 4));
        // Execution 1's value of output 1 is read (while execution 2
        // runs): executions 3 and 4 copy it. Execution 2's value is read
        // too: 5 copies it, 6 would only after another read. An output
        // never read, beyond a scalar's size, is never copied.
        read.read_at[1].fetch_max(1, Ordering::Relaxed);
        assert!(read.wanted(3, 1, big) && read.wanted(4, 1, big) && !read.wanted(5, 1, big));
        read.read_at[1].fetch_max(2, Ordering::Relaxed);
        assert!(read.wanted(5, 1, big) && !read.wanted(6, 1, big) && !read.wanted(1, 0, 20));
        // A scalar read two steps behind (execution 2's, read once 4 has
        // started) stays copied.
        read.read_at[0].fetch_max(2, Ordering::Relaxed);
        assert!(read.wanted(4, 0, 4) && read.wanted(5, 0, 4) && !read.wanted(6, 0, 4));
    }
}
