//! Block-quantized weight formats ([`QuantFormat`]): their block layouts
//! and the one reference dequantization every backend and test agrees with.
//!
//! A quantized weight is stored as its raw blocks, row by row, in a `u8`
//! tensor of shape `[rows, row_bytes]` (exactly the bytes a GGUF file holds
//! for a row-major `[rows, cols]` tensor: `cols / block_len` blocks of
//! `block_bytes` each). Only three ops read it: [`crate::Op::Dequantize`]
//! (rows to f32), [`crate::Op::QuantMatMul`] (`x @ W^T`, dequantizing inside
//! the product) and [`crate::Op::Gather`] over rows (an embedding lookup,
//! then `Dequantize`). The facade's `QTensor` carries the format and the
//! logical shape and offers nothing else, so arithmetic on the bytes cannot
//! be written by accident.
//!
//! Rejected alternative: block dtypes (`DType::Q4_0` ...). A dtype has a
//! size per element; a block format has none (Q4_K is 4.5 bits), so every
//! place that computes `numel * size_bytes` (uploads, pools, windows,
//! transfers, cost models, both backends' storage enums) would need a
//! special case, and every `match` over `DType` a variant whose only
//! answer is "unsupported". Bytes plus an op attribute keep the format
//! where it matters (the ops that decode it) and leave the rest untouched.
//!
//! The formulas are llama.cpp's (`ggml-quants.c`, `dequantize_row_*`),
//! evaluated in the same f32 order, so a decoded value is bit-identical to
//! what llama.cpp and the `gguf` Python package compute.

use half::f16;

/// A block-quantized (or 16-bit) weight format of GGML.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantFormat {
    /// 32 values: an f16 scale and 32 signed bytes (`d * q`); 34 bytes.
    Q8_0,
    /// 32 values: an f16 scale and 32 nibbles (`d * (q - 8)`); 18 bytes.
    Q4_0,
    /// 32 values: an f16 scale, 32 high bits and 32 nibbles
    /// (`d * (q - 16)`, `q` of 5 bits); 22 bytes.
    Q5_0,
    /// 256 values in 8 sub-blocks of 32: f16 scale and min, 6-bit
    /// sub-block scales and mins, 4-bit values (`d * sc * q - dmin * m`);
    /// 144 bytes.
    Q4K,
    /// 256 values in 16 sub-blocks of 16: 6-bit values (low nibbles and
    /// high pairs), signed 8-bit sub-block scales, an f16 scale
    /// (`d * sc * (q - 32)`); 210 bytes.
    Q6K,
    /// IEEE half precision, one value per "block" (2 bytes).
    F16,
    /// bfloat16, one value per "block" (2 bytes).
    BF16,
}

impl QuantFormat {
    /// Every format, in declaration order.
    pub const ALL: [QuantFormat; 7] = [
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q5_0,
        QuantFormat::Q4K,
        QuantFormat::Q6K,
        QuantFormat::F16,
        QuantFormat::BF16,
    ];

    /// Values per block.
    pub fn block_len(self) -> usize {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q6K => 256,
            QuantFormat::F16 | QuantFormat::BF16 => 1,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q4K => 144,
            QuantFormat::Q6K => 210,
            QuantFormat::F16 | QuantFormat::BF16 => 2,
        }
    }

    /// Lowercase name as GGML writes it (`q8_0`, `q4_k`, `f16` ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q5_0 => "q5_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q6K => "q6_k",
            QuantFormat::F16 => "f16",
            QuantFormat::BF16 => "bf16",
        }
    }

    /// Parses a name produced by [`QuantFormat::name`] (case-insensitive).
    pub fn from_name(name: &str) -> Option<QuantFormat> {
        QuantFormat::ALL.into_iter().find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of a row of `cols` values, or `None` when `cols` is not a
    /// whole number of blocks (or the size overflows).
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_len()) {
            return None;
        }
        (cols / self.block_len()).checked_mul(self.block_bytes())
    }

    /// Values in a row of `row_bytes` bytes, or `None` when it is not a
    /// whole number of blocks.
    pub fn row_len(self, row_bytes: usize) -> Option<usize> {
        if !row_bytes.is_multiple_of(self.block_bytes()) {
            return None;
        }
        (row_bytes / self.block_bytes()).checked_mul(self.block_len())
    }

    /// Decodes one block (`block_bytes` bytes) into `out` (`block_len`
    /// values), bit-identical to llama.cpp's `dequantize_row_*`.
    ///
    /// # Panics
    /// If `block` or `out` has the wrong length (a caller bug: rows are
    /// checked to be whole blocks when the graph is typed).
    pub fn dequantize_block(self, block: &[u8], out: &mut [f32]) {
        assert_eq!(block.len(), self.block_bytes(), "{} block", self.name());
        assert_eq!(out.len(), self.block_len(), "{} block", self.name());
        match self {
            QuantFormat::Q8_0 => {
                let d = half_at(block, 0);
                for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                    *o = d * f32::from(q as i8);
                }
            }
            QuantFormat::Q4_0 => {
                let d = half_at(block, 0);
                let qs = &block[2..18];
                for j in 0..16 {
                    out[j] = d * f32::from((qs[j] & 0x0F) as i8 - 8);
                    out[j + 16] = d * f32::from((qs[j] >> 4) as i8 - 8);
                }
            }
            QuantFormat::Q5_0 => {
                let d = half_at(block, 0);
                let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                let qs = &block[6..22];
                for j in 0..16 {
                    let h0 = (((qh >> j) << 4) & 0x10) as u8;
                    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                    let x0 = ((qs[j] & 0x0F) | h0) as i32 - 16;
                    let x1 = ((qs[j] >> 4) | h1) as i32 - 16;
                    out[j] = x0 as f32 * d;
                    out[j + 16] = x1 as f32 * d;
                }
            }
            QuantFormat::Q4K => {
                let d = half_at(block, 0);
                let dmin = half_at(block, 2);
                let scales = &block[4..16];
                let qs = &block[16..144];
                for (chunk, (q, y)) in qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * chunk, scales);
                    let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
                    let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
                    let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
                    for l in 0..32 {
                        y[l] = d1 * f32::from(q[l] & 0x0F) - m1;
                        y[l + 32] = d2 * f32::from(q[l] >> 4) - m2;
                    }
                }
            }
            QuantFormat::Q6K => {
                let (ql, rest) = block.split_at(128);
                let (qh, rest) = rest.split_at(64);
                let (sc, d) = rest.split_at(16);
                let d = f16::from_le_bytes([d[0], d[1]]).to_f32();
                for half in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
                    let y = &mut out[128 * half..128 * half + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                        let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                        let s = |k: usize| d * f32::from(sc[is + k] as i8);
                        y[l] = s(0) * f32::from(q1);
                        y[l + 32] = s(2) * f32::from(q2);
                        y[l + 64] = s(4) * f32::from(q3);
                        y[l + 96] = s(6) * f32::from(q4);
                    }
                }
            }
            QuantFormat::F16 => out[0] = f16::from_le_bytes([block[0], block[1]]).to_f32(),
            QuantFormat::BF16 => out[0] = half::bf16::from_le_bytes([block[0], block[1]]).to_f32(),
        }
    }

    /// Decodes a row of whole blocks into `out` (`row_len(row.len())`
    /// values).
    ///
    /// # Panics
    /// If the lengths do not match (see [`QuantFormat::dequantize_block`]).
    pub fn dequantize_row(self, row: &[u8], out: &mut [f32]) {
        match self {
            // One value per block: a plain conversion loop.
            QuantFormat::F16 => {
                assert_eq!(row.len(), 2 * out.len(), "f16 row");
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            QuantFormat::BF16 => {
                assert_eq!(row.len(), 2 * out.len(), "bf16 row");
                for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            _ => {
                assert_eq!(Some(out.len()), self.row_len(row.len()), "{} row", self.name());
                for (b, o) in row.chunks_exact(self.block_bytes()).zip(out.chunks_exact_mut(self.block_len())) {
                    self.dequantize_block(b, o);
                }
            }
        }
    }

    /// Quantizes a row of values (a whole number of blocks) into `out`,
    /// for the formats with a simple reference quantizer (Q8_0, Q4_0, F16,
    /// BF16), bit-identical to llama.cpp's `quantize_row_*_ref` and the
    /// `gguf` package's `quantize`. `None` for the K-quants and Q5_0.
    ///
    /// # Panics
    /// If the lengths do not match.
    pub fn quantize_row(self, row: &[f32], out: &mut [u8]) -> Option<()> {
        assert_eq!(Some(out.len()), self.row_bytes(row.len()), "{} row", self.name());
        match self {
            QuantFormat::Q8_0 => {
                for (x, b) in row.chunks_exact(32).zip(out.chunks_exact_mut(34)) {
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    for (q, &v) in b[2..].iter_mut().zip(x) {
                        *q = (v * id).round() as i8 as u8;
                    }
                }
            }
            QuantFormat::Q4_0 => {
                for (x, b) in row.chunks_exact(32).zip(out.chunks_exact_mut(18)) {
                    // The value of largest magnitude, sign kept.
                    let (mut amax, mut max) = (0f32, 0f32);
                    for &v in x {
                        if amax < v.abs() {
                            amax = v.abs();
                            max = v;
                        }
                    }
                    let d = max / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    b[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    let q = |v: f32| ((v * id + 8.5) as i32).min(15) as u8;
                    for j in 0..16 {
                        b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
                    }
                }
            }
            QuantFormat::F16 => {
                for (v, b) in row.iter().zip(out.chunks_exact_mut(2)) {
                    b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            QuantFormat::BF16 => {
                for (v, b) in row.iter().zip(out.chunks_exact_mut(2)) {
                    b.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
                }
            }
            QuantFormat::Q5_0 | QuantFormat::Q4K | QuantFormat::Q6K => return None,
        }
        Some(())
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The little-endian f16 at `at`, widened.
fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([block[at], block[at + 1]]).to_f32()
}

/// Scale and min of sub-block `j` of a Q4_K block (llama.cpp's
/// `get_scale_min_k4`): 6 bits each, packed in 12 bytes. Public so the
/// backends' kernels unpack the scales by this one definition.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trips_within_a_step() {
        let row: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) / 7.0).collect();
        let mut bytes = vec![0u8; QuantFormat::Q8_0.row_bytes(64).unwrap()];
        QuantFormat::Q8_0.quantize_row(&row, &mut bytes).unwrap();
        let mut back = vec![0f32; 64];
        QuantFormat::Q8_0.dequantize_row(&bytes, &mut back);
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in row.iter().zip(&back) {
            assert!((a - b).abs() <= amax / 127.0, "{a} vs {b}");
        }
    }

    #[test]
    fn q4_0_round_trips_within_a_step() {
        let row: Vec<f32> = (0..32).map(|i| ((i * 7) % 32) as f32 - 16.0).collect();
        let mut bytes = vec![0u8; 18];
        QuantFormat::Q4_0.quantize_row(&row, &mut bytes).unwrap();
        let mut back = vec![0f32; 32];
        QuantFormat::Q4_0.dequantize_row(&bytes, &mut back);
        for (a, b) in row.iter().zip(&back) {
            assert!((a - b).abs() <= 16.0 / 8.0, "{a} vs {b}");
        }
        // The extreme value is exact (it defines the scale).
        assert_eq!(back[row.iter().position(|&v| v == -16.0).unwrap()], -16.0);
    }

    #[test]
    fn row_sizes_need_whole_blocks() {
        assert_eq!(QuantFormat::Q4K.row_bytes(512), Some(288));
        assert_eq!(QuantFormat::Q4K.row_bytes(100), None);
        assert_eq!(QuantFormat::Q6K.row_len(420), Some(512));
        assert_eq!(QuantFormat::Q8_0.row_len(35), None);
        assert_eq!(QuantFormat::from_name("Q4_K"), Some(QuantFormat::Q4K));
    }

    #[test]
    fn llm_ops_check_their_operands() {
        use crate::{DType, Op, ValueType};
        let t = |d: &[usize], dt| ValueType::new(d.to_vec(), dt);
        let (f, u, i) = (DType::F32, DType::U8, DType::I32);
        let w = t(&[8, 36], u);
        let mm = |x: ValueType, w: ValueType| Op::QuantMatMul(QuantFormat::Q4_0).infer(&[x, w], &[], &[]);
        assert_eq!(mm(t(&[2, 3, 64], f), w.clone()).unwrap(), t(&[2, 3, 8], f));
        assert!(mm(t(&[2, 63], f), w.clone()).is_err());
        assert!(mm(t(&[2, 64], f), t(&[8, 64], f)).is_err());
        let e = mm(t(&[2, 64], f), t(&[8, 35], u)).unwrap_err();
        assert!(e.to_string().contains("whole q4_0 blocks"), "{e}");
        assert_eq!(Op::Dequantize(QuantFormat::Q4_0).infer(&[w], &[], &[]).unwrap(), t(&[8, 64], f));
        let write = |b: &[usize], up: &[usize], pos: &[usize]| {
            Op::WriteAt { axis: 2 }.infer(&[t(b, f), t(up, f), t(pos, i)], &[], &[])
        };
        assert_eq!(write(&[1, 2, 8, 4], &[1, 2, 3, 4], &[]).unwrap(), t(&[1, 2, 8, 4], f));
        assert!(write(&[2, 2, 8, 4], &[2, 2, 1, 4], &[2]).is_ok());
        assert!(write(&[1, 2, 8, 4], &[1, 2, 3, 4], &[2]).is_err());
        assert!(write(&[1, 2, 8, 4], &[1, 2, 9, 4], &[]).is_err());
        assert!(write(&[1, 2, 8, 4], &[1, 3, 1, 4], &[]).is_err());
        let attend = |q: &[usize], k: &[usize]| {
            Op::PrefixAttention.infer(&[t(q, f), t(k, f), t(k, f), t(&[], f), t(&[], i)], &[], &[])
        };
        assert_eq!(attend(&[1, 4, 3, 8], &[1, 2, 16, 8]).unwrap(), t(&[1, 4, 3, 8], f));
        assert!(attend(&[1, 3, 3, 8], &[1, 2, 16, 8]).is_err());
        assert!(attend(&[1, 4, 3, 4], &[1, 2, 16, 8]).is_err());
    }

    #[test]
    fn q4_k_scale_min_unpacking() {
        // Sub-blocks 4..8 take their high bits from the first 8 bytes.
        let mut s = [0u8; 12];
        s[0] = 0b1100_0001; // sc0 = 1, high bits of sc4 = 3
        s[4] = 0b0100_0010; // m0 = 2, high bits of m4 = 1
        s[8] = 0x5A; // low nibbles: sc4 = 0xA, m4 = 0x5
        assert_eq!(scale_min_k4(0, &s), (1, 2));
        assert_eq!(scale_min_k4(4, &s), (0xA | (3 << 4), 0x5 | (1 << 4)));
    }
}
