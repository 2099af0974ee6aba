//! Row kernels: softmax and log-softmax along one axis.

use super::common::*;
use super::{LowerLimits, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{Op, VerifiedGraph};
use std::fmt::Write as _;

/// Invocations that share one softmax row (at most; fewer for short rows).
pub const SOFTMAX_THREADS_PER_ROW: u64 = 64;

/// Whether softmax kernel `k` walks its rows with vec4 loads and stores:
/// one invocation per row (no cooperative rows), rows contiguous with a
/// length divisible by 4, and the operand read straight from a buffer.
pub(super) fn vector_rows(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> bool {
    let rn = g.node(k.root());
    let Op::Softmax { axis, .. } = rn.op else { return false };
    let x = &g.node(rn.inputs[0]).shape;
    k.kind == KernelKind::Softmax
        && !limits.cooperative_rows
        // Two passes of len / 4 iterations must fit the loop budget.
        && (x.dims()[axis] as u64) / 2 <= LLVMPIPE_LOOP_BUDGET
        && axis + 1 == x.rank()
        && x.dims()[axis].is_multiple_of(4)
        && k.inputs.len() == 1
        && k.inputs[0] == rn.inputs[0]
}

impl Writer<'_> {
    /// Softmax with one invocation per row and vec4 accesses (see
    /// [`vector_rows`]): one pass for the max and the sum (online), one
    /// pass writing; two reads and one write per element.
    pub(super) fn softmax_rows_vec4(&mut self, k: &Kernel) -> (String, u64) {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::Softmax { axis, log } = rn.op else { unreachable!("vector_rows checked the op") };
        let x = &g.node(rn.inputs[0]).shape;
        let len4 = x.dims()[axis] as u64 / 4;
        let rows = (x.numel() as u64).checked_div(len4 * 4).unwrap_or(0);
        self.use_helper("max_nan");
        self.use_helper("inf_f");
        let out = if log { "(v - vec4<f32>(m)) - vec4<f32>(ls)" } else { "exp(v - vec4<f32>(m)) * r" };
        let fin = if log { "let ls = log(s);" } else { "let r = 1.0 / s;" };
        // Pass 1 keeps a running max and a sum rescaled whenever the max
        // grows (online softmax); while the max is still -inf nothing is
        // added, so leading -inf values do not turn the sum into NaN.
        let head = format!("for (var j = 0u; j < {len4}u; j = j + 1u) {{");
        let b = format!(
            "    let b = t * {len4}u;\n    var m = -inf_f();\n    var s = 0.0;\n    {head}\n        let v = in0[b + j];\n        let mn = max_nan(m, max_nan(max_nan(v.x, v.y), max_nan(v.z, v.w)));\n        if (mn > -inf_f()) {{\n            let e = exp(v - vec4<f32>(mn));\n            s = s * exp(m - mn) + ((e.x + e.y) + (e.z + e.w));\n        }}\n        m = mn;\n    }}\n    {fin}\n    {head}\n        let v = in0[b + j];\n        out0[b + j] = {out};\n    }}\n"
        );
        (b, rows)
    }

    /// Softmax or log-softmax along one axis.
    /// Appends the statements of `main` to `b`; returns the invocation
    /// count.
    pub(super) fn softmax_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let invocations: u64;
        // One row block per workgroup: `T` invocations per row,
        // `256 / T` rows per workgroup; max and sum are tree
        // reductions in workgroup memory.
        let Op::Softmax { axis, log } = &rn.op else { unreachable!() };
        let x = g.node(rn.inputs[0]);
        let len = x.shape.dims()[*axis] as u64;
        let rows = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
        // One invocation per row runs three passes of `len`
        // iterations; longer rows go cooperative even on llvmpipe
        // (its loop budget, `LLVMPIPE_LOOP_BUDGET`).
        if !self.limits.cooperative_rows && 3 * len <= LLVMPIPE_LOOP_BUDGET {
            invocations = rows;
            let (base, stride, _) = line(&x.shape, *axis);
            self.use_helper("max_nan");
            self.use_helper("inf_f");
            let xi = x_id(rn);
            // Softmax stores exp(v - m) in the second pass and
            // scales it in the third (one exp per element).
            let (second, third) = if *log {
                ("", "let v = n{xi}(idx);\n        out0[idx] = v - m - ls;".replace("{xi}", &xi.to_string()))
            } else {
                ("\n        out0[idx] = e;", "out0[idx] = out0[idx] * r;".to_string())
            };
            let fin = if *log { "let ls = log(s);" } else { "let r = 1.0 / s;" };
            let head = format!("for (var j = 0u; j < {len}u; j = j + 1u) {{");
            let _ = writeln!(
                b,
                "    let base = {base};\n    var m = -inf_f();\n    {head}\n        m = max_nan(m, n{xi}(base + j * {stride}u));\n    }}\n    var s = 0.0;\n    {head}\n        let idx = base + j * {stride}u;\n        let e = exp(n{xi}(idx) - m);\n        s = s + e;{second}\n    }}\n    {fin}\n    {head}\n        let idx = base + j * {stride}u;\n        {third}\n    }}"
            );
            return invocations;
        }
        let per_row = len.next_power_of_two().clamp(1, SOFTMAX_THREADS_PER_ROW);
        let rows_per_group = WORKGROUP_SIZE as u64 / per_row;
        invocations = rows.div_ceil(rows_per_group) * WORKGROUP_SIZE as u64;
        self.cooperative = Some("f32");
        let (base, stride, _) = line(&x.shape, *axis);
        self.use_helper("max_nan");
        self.use_helper("inf_f");
        let write = if *log { "v - mx - log(sm)" } else { "exp(v - mx) / sm" };
        let xi = x_id(rn);
        let each = format!("for (var j = tid; j < {len}u; j = j + {per_row}u) {{");
        let tree = |comb: &str| {
            format!(
                "    red[lid] = acc;\n    workgroupBarrier();\n    for (var h = {}u; h > 0u; h = h >> 1u) {{\n        if (tid < h) {{\n            let a = red[lid];\n            let b = red[lid + h];\n            red[lid] = {comb};\n        }}\n        workgroupBarrier();\n    }}\n",
                per_row / 2
            )
        };
        let _ = writeln!(
            b,
            "    let t = (wid.x + wid.y * nwg.x) * {rows_per_group}u + lid / {per_row}u;\n    let tid = lid % {per_row}u;\n    let first = lid - tid;\n    let valid = t < {rows}u;\n    let base = {base};\n    var acc = -inf_f();\n    if (valid) {{\n        {each}\n            acc = max_nan(acc, n{xi}(base + j * {stride}u));\n        }}\n    }}\n{}    let mx = red[first];\n    workgroupBarrier();\n    acc = 0.0;\n    if (valid) {{\n        {each}\n            acc = acc + exp(n{xi}(base + j * {stride}u) - mx);\n        }}\n    }}\n{}    let sm = red[first];\n    if (valid) {{\n        {each}\n            let v = n{xi}(base + j * {stride}u);\n            out0[base + j * {stride}u] = {write};\n        }}\n    }}",
            tree("max_nan(a, b)"),
            tree("a + b")
        );
        invocations
    }
}
