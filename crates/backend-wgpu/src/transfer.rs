//! Transfers between the host and the device in the canonical host byte
//! format: uploads and readbacks in chunks of at most [`TRANSFER_CHUNK`]
//! bytes, so staging memory stays bounded for tensors of any size; bools
//! are one byte on the host and one `u32` on the device.

use crate::context::{device_err, Context, READBACK};
use lazuli_executor::{timeline, BackendError, Buffer};
use lazuli_ir::{DType, ValueType};

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
        if matches!(ty.dtype, DType::F16 | DType::BF16) {
            // 16-bit elements, the host layout as it is (element 2k in the
            // low half of word k: little endian), padded to whole words.
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
    /// submitted work.
    pub fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, BackendError> {
        let _span = timeline::span("Readback");
        let n = buffer.ty.shape.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        let st = self.storage(buffer)?;
        // Whole words (f16 and bf16 are 2 bytes each, padded to a word).
        let bytes = crate::context::device_bytes(&buffer.ty);
        // The host copy first: if the host cannot hold it, no device work
        // is wasted.
        let mut out = self.host_vec::<u8>(n * buffer.ty.dtype.size_bytes(), "readback")?;
        // Through one staging buffer of at most `TRANSFER_CHUNK` bytes,
        // a chunk at a time.
        let chunk = bytes.min(TRANSFER_CHUNK);
        let staging = self.pool.acquire(chunk, READBACK)?;
        let mut offset = 0;
        while offset < bytes {
            let len = chunk.min(bytes - offset);
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(st.buffer(), offset, staging.buffer(), 0, len);
            self.queue.submit([enc.finish()]);
            let (tx, rx) = std::sync::mpsc::channel();
            staging.buffer().map_async(wgpu::MapMode::Read, 0..len, move |r| {
                let _ = tx.send(r);
            });
            self.wait()?;
            rx.recv().map_err(|e| device_err(&self.name, e))?.map_err(|e| device_err(&self.name, e))?;
            {
                let view = staging.buffer().get_mapped_range(0..len).map_err(|e| device_err(&self.name, e))?;
                decode(&mut out, &view, buffer.ty.dtype);
            }
            staging.buffer().unmap();
            offset += len;
        }
        // The padding of a half-precision tensor's last word.
        out.truncate(n * buffer.ty.dtype.size_bytes());
        Ok(out)
    }
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
