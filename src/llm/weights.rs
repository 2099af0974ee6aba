//! Weights that stay quantized: [`QTensor`] (a matrix of GGML blocks, its
//! format and logical shape), [`quantize`] for models built in Lazuli, and
//! [`Weight`], a layer's matrix either dense (f32) or quantized.
//!
//! A `QTensor` holds its blocks as a `u8 [rows, row_bytes]` device tensor
//! (see `lazuli_ir::quant` for why bytes and not a block dtype) and offers
//! only what a quantized matrix supports: the product `x @ W^T`
//! (`Op::QuantMatMul`, dequantizing inside the product), row lookup (an
//! embedding: `Gather` of rows, then `Op::Dequantize`) and an explicit
//! [`QTensor::dequantize`]. Arithmetic on the bytes cannot be written
//! through it.

use crate::ir::{Op, QuantFormat, ValueType};
use crate::{DType, Device, ExecError, Result, Tensor};

/// A matrix of block-quantized rows (see the module doc).
#[derive(Clone, Debug)]
pub struct QTensor {
    bytes: Tensor,
    format: QuantFormat,
    rows: usize,
    cols: usize,
}

fn invalid(op: &str, detail: String) -> ExecError {
    ExecError::Invalid { op: op.into(), detail }
}

impl QTensor {
    /// A `[rows, cols]` matrix from its blocks as GGUF stores them (rows
    /// of `cols / block_len` blocks, row-major).
    pub fn from_blocks(
        bytes: Vec<u8>,
        format: QuantFormat,
        rows: usize,
        cols: usize,
        device: &Device,
    ) -> Result<QTensor> {
        let row_bytes = format.row_bytes(cols).ok_or_else(|| {
            invalid(
                "QTensor::from_blocks",
                format!("{cols} columns are not whole {format} blocks of {}", format.block_len()),
            )
        })?;
        if rows.checked_mul(row_bytes) != Some(bytes.len()) {
            return Err(invalid(
                "QTensor::from_blocks",
                format!("{} bytes for {rows} rows of {row_bytes} bytes ({format} [{rows}, {cols}])", bytes.len()),
            ));
        }
        let bytes = Tensor::from_bytes(bytes, ValueType::new(vec![rows, row_bytes], DType::U8), device)?;
        Ok(QTensor { bytes, format, rows, cols })
    }

    /// The format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// The logical shape `[rows, cols]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// Bytes of the blocks (what the matrix occupies on its device).
    pub fn storage_bytes(&self) -> usize {
        self.bytes.numel()
    }

    /// The blocks, `u8 [rows, row_bytes]`.
    pub fn blocks(&self) -> &Tensor {
        &self.bytes
    }

    /// The matrix in f32 (an explicit widening: the products never need it).
    pub fn dequantize(&self) -> Result<Tensor> {
        Tensor::record(Op::Dequantize(self.format), &[&self.bytes])
    }

    /// `x @ W^T` for `x` f32 `[.., k]` (`k` = `cols`): `[.., rows]`.
    pub fn matmul_t(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() >= 2 {
            return Tensor::record(Op::QuantMatMul(self.format), &[x, &self.bytes]);
        }
        let x2 = x.unsqueeze(0)?;
        Tensor::record(Op::QuantMatMul(self.format), &[&x2, &self.bytes])?.squeeze(&[0])
    }

    /// Rows `ids` (any integer tensor), dequantized: `[ids.., cols]` f32.
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        Tensor::record(Op::Dequantize(self.format), &[&self.bytes.gather(0, ids)?])
    }
}

/// Quantizes a 2-d float tensor `[rows, cols]` (`cols` a whole number of
/// blocks) to `format`: Q8_0 and Q4_0 (llama.cpp's reference quantizers,
/// bit for bit), F16 or BF16. Reads the tensor to the host; the result
/// lives on the same device. The K-quants need llama.cpp's importance
/// search and are read from files only.
pub fn quantize(t: &Tensor, format: QuantFormat) -> Result<QTensor> {
    if t.rank() != 2 || !t.dtype().is_float() {
        return Err(invalid("quantize", format!("expected a 2-d float tensor, got {}{}", t.dtype(), t.shape())));
    }
    let [rows, cols] = [t.dims()[0], t.dims()[1]];
    let row_bytes = format.row_bytes(cols).ok_or_else(|| {
        invalid("quantize", format!("{cols} columns are not whole {format} blocks of {}", format.block_len()))
    })?;
    let values = t.cast(DType::F32)?.to_vec::<f32>()?;
    let mut bytes = vec![0u8; rows * row_bytes];
    for (row, out) in values.chunks_exact(cols.max(1)).zip(bytes.chunks_exact_mut(row_bytes.max(1))) {
        format.quantize_row(row, out).ok_or_else(|| {
            invalid("quantize", format!("{format} has no reference quantizer here (Q8_0, Q4_0, F16, BF16 do)"))
        })?;
    }
    QTensor::from_blocks(bytes, format, rows, cols, t.device())
}

/// A layer's `[out, in]` matrix: dense f32 (held transposed, `[in, out]`,
/// so the product reads it as it lies) or quantized.
#[derive(Clone, Debug)]
pub enum Weight {
    /// f32, stored `[in, out]`.
    Dense(Tensor),
    /// Quantized blocks, `[out, in]` as GGUF stores them.
    Quant(QTensor),
}

impl Weight {
    /// A dense weight from its `[out, in]` f32 values.
    pub fn dense(values: &[f32], out: usize, inp: usize, device: &Device) -> Result<Weight> {
        let w = Tensor::from_slice(values, [out, inp], device)?;
        // Transposed once, here, and materialized on the device.
        let t = w.t()?.contiguous_copy()?;
        Ok(Weight::Dense(t))
    }

    /// `x @ W^T`: `[.., in]` to `[.., out]`.
    pub fn linear(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(wt) => x.matmul(wt),
            Weight::Quant(q) => q.matmul_t(x),
        }
    }

    /// Rows `ids` of the `[out, in]` matrix (an embedding table), f32.
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(wt) => wt.t()?.gather(0, ids),
            Weight::Quant(q) => q.rows(ids),
        }
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Weight::Dense(wt) => [wt.dims()[1], wt.dims()[0]],
            Weight::Quant(q) => q.dims(),
        }
    }

    /// Bytes it occupies on its device.
    pub fn storage_bytes(&self) -> usize {
        match self {
            Weight::Dense(wt) => wt.numel() * 4,
            Weight::Quant(q) => q.storage_bytes(),
        }
    }

    /// Its storage format name (`f32`, `q4_0`, ...).
    pub fn format_name(&self) -> &'static str {
        match self {
            Weight::Dense(_) => "f32",
            Weight::Quant(q) => q.format().name(),
        }
    }
}

/// Helpers on tensors the loaders need.
trait ContiguousCopy {
    /// The tensor computed now and held as device data (a view becomes
    /// its own buffer).
    fn contiguous_copy(&self) -> Result<Tensor>;
}

impl ContiguousCopy for Tensor {
    fn contiguous_copy(&self) -> Result<Tensor> {
        let bytes = self.to_bytes()?;
        Tensor::from_bytes(bytes, self.ty().clone(), self.device())
    }
}
