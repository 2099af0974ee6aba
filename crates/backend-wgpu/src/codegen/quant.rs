//! Quantized weights in WGSL: `Op::Dequantize` and `Op::QuantMatMul`
//! reading GGML blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K, F16, BF16) from a
//! `u8` binding stored as bytes ([`super::access::Storage::Bytes`]).
//!
//! The schedule decides the kernel as a value first ([`QuantPlan`]: the
//! format, the weight's rows and row bytes, the product's activation rows
//! and depth, rows per workgroup); this module then writes it. Every
//! weight access goes through the binding's helpers (`ld_NAME` a byte,
//! `ldh_NAME` a little-endian u16, `ldf_NAME` an f16 scale as f32), never
//! a format string of the family's own.
//!
//! Decoding (`qv(o, j)`: value `j` of the block at byte `o`) follows the
//! IR's reference (`lazuli_ir::quant`, llama.cpp's `dequantize_row_*`)
//! operation for operation in f32, so a dequantized value is the
//! reference's bit for bit (f16 scales are widened exactly by integer
//! arithmetic, subnormals included, not by `unpack2x16float`, which an
//! adapter may flush).
//!
//! The product (`x [.., m, k] @ dequantize(w [n, row_bytes])^T`) is a
//! matrix-vector kernel per activation row, the shape of decoding one
//! token, which memory bandwidth bounds: a workgroup of [`QUANT_LANES`]
//! lanes computes [`QUANT_ROWS`] output columns (weight rows) of one
//! activation row; lane `l` takes the 32-value units `l, l + lanes, ...`
//! of the depth, so adjacent lanes read adjacent blocks of a weight row
//! (coalesced), each activation value is loaded once per workgroup and
//! used for its [`QUANT_ROWS`] weight rows, and each weight byte is read
//! once per activation row. The lanes' partial sums are combined by a
//! tree in workgroup memory. Several activation rows (prefill) run the
//! same kernel, one workgroup row per activation row.
//!
//! Rejected alternative: dequantizing the weight to an f32 buffer and
//! running the f32 matmul: it writes and reads back 4 bytes per value
//! where the quantized product reads 0.56 (Q4_0) to 1.06 (Q8_0).

use super::access::Binding;
use super::{ceil_div, Writer};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::quant::QuantFormat;
use lazuli_ir::{Op, VerifiedGraph};
use std::fmt::Write as _;

/// Lanes of a quantized matrix-vector workgroup.
pub const QUANT_LANES: u32 = 64;

/// Weight rows (output columns) one quantized matrix-vector workgroup
/// computes, sharing each activation load.
pub const QUANT_ROWS: u32 = 4;

/// Values of one unit of work of a lane (a Q8_0/Q4_0/Q5_0 block, a
/// 32-value sub-block of the K-quants, 32 f16/bf16 values).
pub const QUANT_UNIT: u64 = 32;

/// The decisions of a quantized kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantPlan {
    /// The weight's block format.
    pub format: QuantFormat,
    /// Bytes of a weight row.
    pub row_bytes: u64,
    /// Values of a weight row (the depth of the product).
    pub cols: u64,
    /// What the kernel computes.
    pub kind: QuantKind,
}

/// The two quantized kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantKind {
    /// Every value of the weight, one invocation per value.
    Dequantize {
        /// Values in all.
        values: u64,
    },
    /// `x @ w^T` in the matrix-vector form (see the module
    /// documentation).
    MatVec {
        /// Activation rows (every leading dim of `x` flattened).
        m: u64,
        /// Weight rows (output columns).
        n: u64,
        /// Weight rows per workgroup.
        rows: u32,
        /// Lanes per workgroup.
        lanes: u32,
    },
}

impl QuantPlan {
    /// The plan of a `Quant` kernel rooted at `root` of `g`.
    pub fn new(g: &VerifiedGraph, kernel: &Kernel) -> QuantPlan {
        let rn = g.node(kernel.root());
        match rn.op {
            Op::Dequantize(format) => {
                let w = g.node(rn.inputs[0]);
                let row_bytes = *w.shape.dims().last().expect("a weight of rank >= 1") as u64;
                let cols = *rn.shape.dims().last().expect("rank >= 1") as u64;
                QuantPlan { format, row_bytes, cols, kind: QuantKind::Dequantize { values: rn.shape.numel() as u64 } }
            }
            Op::QuantMatMul(format) => {
                let w = g.node(rn.inputs[1]);
                let (n, row_bytes) = (w.shape.dims()[0] as u64, w.shape.dims()[1] as u64);
                let x = g.node(rn.inputs[0]);
                let cols = *x.shape.dims().last().expect("x of rank >= 2") as u64;
                let m = x.shape.numel() as u64 / cols.max(1);
                QuantPlan {
                    format,
                    row_bytes,
                    cols,
                    kind: QuantKind::MatVec { m, n, rows: QUANT_ROWS, lanes: QUANT_LANES },
                }
            }
            ref other => unreachable!("a quantized kernel rooted at {}", other.name()),
        }
    }

    /// Loop iterations of one invocation (the unit loop of the product
    /// times the values of a unit): what llvmpipe's loop budget bounds.
    pub fn loop_iterations(format: QuantFormat, cols: u64) -> u64 {
        let _ = format;
        // Per unit: the activations' loop and each row's value loop.
        cols.div_ceil(QUANT_UNIT).div_ceil(QUANT_LANES as u64) * QUANT_UNIT * (1 + QUANT_ROWS as u64)
    }
}

/// `qv(o, j)`: value `j` of the block of `format` at byte `o` of weight
/// binding `w`, in the reference's f32 operations; with the exact f16
/// widening `f16_bits` where the binding's `ldf_` helper uses it.
fn decoder(format: QuantFormat, w: &str) -> String {
    let body = match format {
        QuantFormat::Q8_0 => format!(
            "    let d = ldf_{w}(o);\n    let q = i32(ld_{w}(o + 2u + j) << 24u) >> 24u;\n    return d * f32(q);\n"
        ),
        QuantFormat::Q4_0 => format!(
            "    let d = ldf_{w}(o);\n    let b = ld_{w}(o + 2u + (j & 15u));\n    let q = i32(select(b & 15u, b >> 4u, j >= 16u)) - 8;\n    return d * f32(q);\n"
        ),
        QuantFormat::Q5_0 => format!(
            "    let d = ldf_{w}(o);\n    let qh = ldh_{w}(o + 2u) | (ldh_{w}(o + 4u) << 16u);\n    let l = j & 15u;\n    let b = ld_{w}(o + 6u + l);\n    let lo = select(b & 15u, b >> 4u, j >= 16u);\n    let h = select(((qh >> l) << 4u) & 16u, (qh >> (l + 12u)) & 16u, j >= 16u);\n    return f32(i32(lo | h) - 16) * d;\n"
        ),
        QuantFormat::Q4K => format!(
            "    let d = ldf_{w}(o);\n    let dmin = ldf_{w}(o + 2u);\n    let chunk = j >> 6u;\n    let hi = (j >> 5u) & 1u;\n    let l = j & 31u;\n    let is = 2u * chunk + hi;\n    var sc: u32;\n    var m: u32;\n    if (is < 4u) {{\n        sc = ld_{w}(o + 4u + is) & 63u;\n        m = ld_{w}(o + 8u + is) & 63u;\n    }} else {{\n        let c = ld_{w}(o + 8u + is);\n        sc = (c & 15u) | ((ld_{w}(o + is) >> 6u) << 4u);\n        m = (c >> 4u) | ((ld_{w}(o + 4u + is) >> 6u) << 4u);\n    }}\n    let d1 = d * f32(sc);\n    let m1 = dmin * f32(m);\n    let b = ld_{w}(o + 16u + chunk * 32u + l);\n    let q = select(b & 15u, b >> 4u, hi == 1u);\n    return d1 * f32(q) - m1;\n"
        ),
        QuantFormat::Q6K => format!(
            "    let d = ldf_{w}(o + 208u);\n    let half = j >> 7u;\n    let quarter = (j >> 5u) & 3u;\n    let l = j & 31u;\n    let ql = ld_{w}(o + 64u * half + l + 32u * (quarter & 1u));\n    let qh = ld_{w}(o + 128u + 32u * half + l);\n    let lo = select(ql & 15u, ql >> 4u, quarter >= 2u);\n    let q = i32(lo | (((qh >> (2u * quarter)) & 3u) << 4u)) - 32;\n    let s = i32(ld_{w}(o + 192u + 8u * half + (l >> 4u) + 2u * quarter) << 24u) >> 24u;\n    return (d * f32(s)) * f32(q);\n"
        ),
        QuantFormat::F16 => format!("    return ldf_{w}(o + 2u * j);\n"),
        QuantFormat::BF16 => format!("    return bitcast<f32>(ldh_{w}(o + 2u * j) << 16u);\n"),
    };
    format!("fn qv(o: u32, j: u32) -> f32 {{\n{body}}}\n\n")
}

/// `qdot(o, j0, cnt, xs)`: the sum over values `j0 .. j0 + cnt` of the
/// block of `format` at byte `o` of weight binding `w` (a unit of
/// [`QUANT_UNIT`] values; `cnt` below it only at the end of an f16/bf16
/// row) of each value times `xs[j - j0]`. Each value is the reference's
/// (`qv`'s) expression, its scales loaded once per unit.
fn unit_dot(format: QuantFormat, w: &str) -> String {
    let body = match format {
        QuantFormat::Q8_0 => format!(
            "    let d = ldf_{w}(o);\n    for (var j = 0u; j < 32u; j = j + 1u) {{\n        let q = i32(ld_{w}(o + 2u + j) << 24u) >> 24u;\n        s = s + (d * f32(q)) * xs[j];\n    }}\n"
        ),
        QuantFormat::Q4_0 => format!(
            "    let d = ldf_{w}(o);\n    for (var l = 0u; l < 16u; l = l + 1u) {{\n        let b = ld_{w}(o + 2u + l);\n        s = s + (d * f32(i32(b & 15u) - 8)) * xs[l];\n        s = s + (d * f32(i32(b >> 4u) - 8)) * xs[l + 16u];\n    }}\n"
        ),
        QuantFormat::Q5_0 => format!(
            "    let d = ldf_{w}(o);\n    let qh = ldh_{w}(o + 2u) | (ldh_{w}(o + 4u) << 16u);\n    for (var l = 0u; l < 16u; l = l + 1u) {{\n        let b = ld_{w}(o + 6u + l);\n        let x0 = i32((b & 15u) | (((qh >> l) << 4u) & 16u)) - 16;\n        let x1 = i32((b >> 4u) | ((qh >> (l + 12u)) & 16u)) - 16;\n        s = s + (f32(x0) * d) * xs[l];\n        s = s + (f32(x1) * d) * xs[l + 16u];\n    }}\n"
        ),
        QuantFormat::Q4K => format!(
            "    let is = j0 >> 5u;\n    let chunk = is >> 1u;\n    let hi = is & 1u;\n    var sc: u32;\n    var m: u32;\n    if (is < 4u) {{\n        sc = ld_{w}(o + 4u + is) & 63u;\n        m = ld_{w}(o + 8u + is) & 63u;\n    }} else {{\n        let c = ld_{w}(o + 8u + is);\n        sc = (c & 15u) | ((ld_{w}(o + is) >> 6u) << 4u);\n        m = (c >> 4u) | ((ld_{w}(o + 4u + is) >> 6u) << 4u);\n    }}\n    let d1 = ldf_{w}(o) * f32(sc);\n    let m1 = ldf_{w}(o + 2u) * f32(m);\n    for (var l = 0u; l < 32u; l = l + 1u) {{\n        let b = ld_{w}(o + 16u + chunk * 32u + l);\n        let q = select(b & 15u, b >> 4u, hi == 1u);\n        s = s + (d1 * f32(q) - m1) * xs[l];\n    }}\n"
        ),
        QuantFormat::Q6K => format!(
            "    let d = ldf_{w}(o + 208u);\n    let half = j0 >> 7u;\n    let quarter = (j0 >> 5u) & 3u;\n    let sa = o + 192u + 8u * half + 2u * quarter;\n    let s0 = d * f32(i32(ld_{w}(sa) << 24u) >> 24u);\n    let s1 = d * f32(i32(ld_{w}(sa + 1u) << 24u) >> 24u);\n    let qlo = o + 64u * half + 32u * (quarter & 1u);\n    let qho = o + 128u + 32u * half;\n    for (var l = 0u; l < 32u; l = l + 1u) {{\n        let ql = ld_{w}(qlo + l);\n        let lo = select(ql & 15u, ql >> 4u, quarter >= 2u);\n        let q = i32(lo | (((ld_{w}(qho + l) >> (2u * quarter)) & 3u) << 4u)) - 32;\n        s = s + (select(s0, s1, l >= 16u) * f32(q)) * xs[l];\n    }}\n"
        ),
        QuantFormat::F16 => format!(
            "    for (var j = 0u; j < cnt; j = j + 1u) {{\n        s = s + ldf_{w}(o + 2u * j) * xs[j];\n    }}\n"
        ),
        QuantFormat::BF16 => format!(
            "    for (var j = 0u; j < cnt; j = j + 1u) {{\n        s = s + bitcast<f32>(ldh_{w}(o + 2u * j) << 16u) * xs[j];\n    }}\n"
        ),
    };
    format!("fn qdot(o: u32, j0: u32, cnt: u32, xs: array<f32, {QUANT_UNIT}>) -> f32 {{\n    var s = 0.0;\n{body}    return s;\n}}\n\n")
}

impl Writer<'_> {
    /// The body of a quantized kernel planned as `plan`; returns its
    /// invocations.
    pub(super) fn quant_kernel(&mut self, k: &Kernel, plan: QuantPlan, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let weight_at = match plan.kind {
            QuantKind::Dequantize { .. } => 0,
            QuantKind::MatVec { .. } => 1,
        };
        let wk = k.inputs.iter().position(|&x| x == rn.inputs[weight_at]).expect("the weight is a kernel input");
        let w: &Binding = self.input(wk);
        let (bl, bb) = (plan.format.block_len() as u64, plan.format.block_bytes() as u64);
        let rb = plan.row_bytes;
        let out = self.output(0);
        match plan.kind {
            QuantKind::Dequantize { values } => {
                self.funcs.push_str(&decoder(plan.format, &w.name));
                let cols = plan.cols.max(1);
                let _ = writeln!(
                    b,
                    "    let row = t / {cols}u;\n    let c = t - row * {cols}u;\n    let blk = c / {bl}u;\n    {}",
                    out.store("t", &format!("qv(row * {rb}u + blk * {bb}u, c - blk * {bl}u)"))
                );
                values
            }
            QuantKind::MatVec { m, n, rows, lanes } => {
                self.funcs.push_str(&unit_dot(plan.format, &w.name));
                let x = rn.inputs[0].0;
                let kk = plan.cols;
                let units = kk.div_ceil(QUANT_UNIT);
                let groups_n = ceil_div(n, rows as u64, false);
                let _ = writeln!(self.shared, "var<workgroup> qred: array<f32, {}>;\n", rows * lanes);
                let _ = write!(
                    b,
                    "    let qg = wid.x + wid.y * nwg.x;\n    let qm = qg / {groups_n};\n    let qr0 = (qg - qm * {groups_n}) * {rows}u;\n"
                );
                for r in 0..rows {
                    let _ = writeln!(b, "    var acc{r} = 0.0;");
                }
                // A unit's activations into registers once (0 past the
                // end of an f16/bf16 row), then one unit of each row.
                let _ = write!(
                    b,
                    "    if (qm < {m}u) {{\n        for (var u = lid; u < {units}u; u = u + {lanes}u) {{\n            let c0 = u * {QUANT_UNIT}u;\n            let cnt = min({QUANT_UNIT}u, {kk}u - c0);\n            var xs: array<f32, {QUANT_UNIT}>;\n            for (var j = 0u; j < {QUANT_UNIT}u; j = j + 1u) {{\n                xs[j] = select(0.0, n{x}(qm * {kk}u + c0 + min(j, cnt - 1u)), j < cnt);\n            }}\n            let blk = c0 / {bl}u;\n            let j0 = c0 - blk * {bl}u;\n"
                );
                for r in 0..rows {
                    let _ = writeln!(
                        b,
                        "            if (qr0 + {r}u < {n}u) {{\n                acc{r} = acc{r} + qdot((qr0 + {r}u) * {rb}u + blk * {bb}u, j0, cnt, xs);\n            }}"
                    );
                }
                b.push_str("        }\n    }\n");
                for r in 0..rows {
                    let _ = writeln!(b, "    qred[{}u + lid] = acc{r};", r * lanes);
                }
                let _ = write!(
                    b,
                    "    workgroupBarrier();\n    for (var s = {}u; s > 0u; s = s >> 1u) {{\n        if (lid < s) {{\n",
                    lanes / 2
                );
                for r in 0..rows {
                    let at = r * lanes;
                    let _ = writeln!(b, "            qred[{at}u + lid] = qred[{at}u + lid] + qred[{at}u + lid + s];");
                }
                let _ = writeln!(
                    b,
                    "        }}\n        workgroupBarrier();\n    }}\n    if (lid < {rows}u && qm < {m}u && qr0 + lid < {n}u) {{\n        {}\n    }}",
                    out.store(&format!("qm * {n}u + qr0 + lid"), &format!("qred[lid * {lanes}u]"))
                );
                m * n.div_ceil(rows as u64) * lanes as u64
            }
        }
    }
}
