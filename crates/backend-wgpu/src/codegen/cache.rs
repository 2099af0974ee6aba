//! The KV cache's ops in WGSL: `Op::WriteAt` (an update written into a
//! cache at a position that is data) and `Op::PrefixAttention` (each query
//! over its visible prefix of the cache, grouped-query heads).
//!
//! Positions are read from the kernel's `pos` operand (a lifted scalar or
//! one per leading row), so every position runs the same pipeline. A
//! position whose update or queries do not fit the cache is reported
//! through the error slot (see [`super::index`]): the execution then fails
//! with `BackendError::IndexOutOfRange`, as the CPU backend's, never a
//! clamp; the elements of such a row are the base's (write) or 0
//! (attention).
//!
//! `WriteAt` writes its whole output, one invocation per element: the
//! update's where the element lies in the written range, the base's
//! elsewhere (not in place: the output is a buffer of its own).
//! `PrefixAttention` is one invocation per query row: the scores'
//! maximum over the visible keys first, then the exponentials' sum and
//! the weighted values, in the CPU reference's order (max, then
//! `exp(s - max)` summed and applied, one division at the end), so the
//! work grows with the prefix, never with the cache's length.

use super::common::*;
use super::Writer;
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, Node, Op};
use std::fmt::Write as _;

/// Loop iterations of one invocation of the prefix attention kernel over
/// a cache of `s` positions with keys of `d` and values of `dv` values
/// (both passes over the keys, at most every position visible): what
/// llvmpipe's loop budget bounds.
pub fn prefix_attention_iterations(s: u64, d: u64, dv: u64) -> u64 {
    s.saturating_mul(2 * d + dv + 2).saturating_add(dv)
}

/// The position of row `row` (a WGSL `u32` expression) of a `pos`
/// operand: `(raw, ok)` statements reading it into `raw`, and a `u32`
/// `p` valid where `ok` holds (`0 <= raw <= last`).
fn position(pos: &Node, id: u32, row: &str, last: i64, ind: &str) -> String {
    let at = if pos.shape.rank() == 0 { "0u".to_string() } else { row.to_string() };
    match pos.dtype {
        // No position fits (more queries than the cache holds).
        _ if last < 0 => format!(
            "{ind}let raw = n{id}({at});\n{ind}let ok = false;\n{ind}let p = 0u;\n{ind}lz_report({});\n",
            if pos.dtype == DType::I32 { "bitcast<u32>(raw)" } else { "raw" }
        ),
        DType::I32 => format!(
            "{ind}let raw = n{id}({at});\n{ind}let ok = raw >= 0i && raw <= {last}i;\n{ind}let p = select(0u, u32(raw), ok);\n{ind}if (!ok) {{\n{ind}    lz_report(bitcast<u32>(raw));\n{ind}}}\n"
        ),
        _ => format!(
            "{ind}let raw = n{id}({at});\n{ind}let ok = raw <= {last}u;\n{ind}let p = select(0u, raw, ok);\n{ind}if (!ok) {{\n{ind}    lz_report(raw);\n{ind}}}\n"
        ),
    }
}

impl Writer<'_> {
    /// `base` with `update` written at `pos` along the axis: one
    /// invocation per output element. Returns the invocations.
    pub(super) fn write_at_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::WriteAt { axis } = rn.op else { unreachable!("a write_at kernel") };
        let (base, update, pos) = (rn.inputs[0], rn.inputs[1], rn.inputs[2]);
        let bd = rn.shape.dims();
        let (bn, un) = (bd[axis] as u64, g.node(update).shape.dims()[axis] as u64);
        let inner = bd[axis + 1..].iter().product::<usize>() as u64;
        // Outer indices per position (one position per row of dim 0).
        let per_row = if axis == 0 { 1 } else { bd[1..axis].iter().product::<usize>().max(1) as u64 };
        let check = position(g.node(pos), pos.0, &format!("o / {per_row}u"), bn as i64 - un as i64, "    ");
        let _ = write!(
            b,
            "    let r = t % {inner}u;\n    let a = (t / {inner}u) % {bn}u;\n    let o = t / {}u;\n{check}    var v = n{}(t);\n    if (ok && a >= p && a < p + {un}u) {{\n        v = n{}((o * {un}u + a - p) * {inner}u + r);\n    }}\n    {}\n",
            (bn * inner).max(1),
            base.0,
            update.0,
            self.output(0).store("t", &store(rn.dtype, "v"))
        );
        rn.shape.numel() as u64
    }

    /// Causal attention of each query row over its visible prefix: one
    /// invocation per `(row, head, query)`. Returns the invocations.
    pub(super) fn prefix_attention_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let [q, kk, v, scale, pos] = [0, 1, 2, 3, 4].map(|i| rn.inputs[i]);
        let qd = g.node(q).shape.dims();
        let kd = g.node(kk).shape.dims();
        let (h, t, d) = (qd[1] as u64, qd[2] as u64, qd[3] as u64);
        let (gh, s) = (kd[1] as u64, kd[2] as u64);
        let dv = g.node(v).shape.dims()[3] as u64;
        let group = h / gh.max(1);
        let check = position(g.node(pos), pos.0, "bb", s as i64 - t as i64, "    ");
        let out = self.output(0);
        let zero_row = out.store(&format!("t * {dv}u + e"), "0.0");
        let dot = format!(
            "            var dot = 0.0;\n            for (var c = 0u; c < {d}u; c = c + 1u) {{\n                dot = dot + n{}(t * {d}u + c) * n{}((kv + j) * {d}u + c);\n            }}\n            let sj = dot * sc;\n",
            q.0, kk.0
        );
        let _ = write!(
            b,
            "    let i = t % {t}u;\n    let bh = t / {t}u;\n    let hh = bh % {h}u;\n    let bb = bh / {h}u;\n{check}    if (!ok) {{\n        for (var e = 0u; e < {dv}u; e = e + 1u) {{\n            {zero_row}\n        }}\n        return;\n    }}\n    let kv = (bb * {gh}u + hh / {group}u) * {s}u;\n    let sc = n{}(0u);\n    let visible = p + i + 1u;\n    var mx = bitcast<f32>(0xff800000u);\n    for (var j = 0u; j < visible; j = j + 1u) {{\n{dot}            if (sj > mx) {{\n                mx = sj;\n            }}\n    }}\n    var sum = 0.0;\n    var acc: array<f32, {dv}>;\n    for (var e = 0u; e < {dv}u; e = e + 1u) {{\n        acc[e] = 0.0;\n    }}\n    for (var j = 0u; j < visible; j = j + 1u) {{\n{dot}            let w = exp(sj - mx);\n            sum = sum + w;\n            for (var e = 0u; e < {dv}u; e = e + 1u) {{\n                acc[e] = acc[e] + w * n{}((kv + j) * {dv}u + e);\n            }}\n    }}\n    for (var e = 0u; e < {dv}u; e = e + 1u) {{\n        {}\n    }}\n",
            scale.0,
            v.0,
            out.store(&format!("t * {dv}u + e"), "acc[e] / sum")
        );
        (rn.shape.numel() as u64).checked_div(dv).unwrap_or(0)
    }
}
