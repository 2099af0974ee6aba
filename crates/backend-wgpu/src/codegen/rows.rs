//! Row kernels: softmax and log-softmax along one axis.

use super::common::*;
use super::{LowerLimits, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{Op, VerifiedGraph};
use std::fmt::Write as _;

/// Most invocations that share one row in the cooperative form (one
/// workgroup).
pub const ROW_MAX_LANES: u64 = 256;

/// Most units (elements, or vec4s) one invocation holds in registers in
/// the cooperative form; longer rows take the online two-pass path.
pub const ROW_MAX_CACHED: u64 = 16;

/// Whether softmax kernel `k` reads and writes its rows as vec4: rows
/// contiguous (the last axis) with a length divisible by 4, the operand
/// read straight from a buffer, and, in the per-row form, two passes of
/// len / 4 iterations within llvmpipe's loop budget.
pub(super) fn vector_rows(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> bool {
    let rn = g.node(k.root());
    let Op::Softmax { axis, .. } = rn.op else { return false };
    let x = &g.node(rn.inputs[0]).shape;
    k.kind == KernelKind::Softmax
        && !limits.generic
        && (!limits.forms.rows.per_row() || (x.dims()[axis] as u64) / 2 <= LLVMPIPE_LOOP_BUDGET)
        && axis + 1 == x.rank()
        && x.dims()[axis].is_multiple_of(4)
        && x.dims()[axis] > 0
        && k.inputs.len() == 1
        && k.inputs[0] == rn.inputs[0]
}

/// Lanes per row in the cooperative form for a row of `units` units: a
/// power of two, enough that each lane holds at most [`ROW_MAX_CACHED`] / 2
/// units where possible, at most [`ROW_MAX_LANES`].
pub fn row_lanes(units: u64) -> u64 {
    units.div_ceil(ROW_MAX_CACHED / 2).max(1).next_power_of_two().min(ROW_MAX_LANES)
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
        self.use_helper(Helper::MaxNan);
        self.use_helper(Helper::InfF);
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
        let Op::Softmax { axis, log } = &rn.op else { unreachable!() };
        let x = g.node(rn.inputs[0]);
        let len = x.shape.dims()[*axis] as u64;
        let rows = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
        // One invocation per row runs three passes of `len`
        // iterations; longer rows go cooperative even on llvmpipe
        // (its loop budget, `LLVMPIPE_LOOP_BUDGET`).
        if self.limits.forms.rows.per_row() && 3 * len <= LLVMPIPE_LOOP_BUDGET {
            let invocations = rows;
            let (base, stride, _) = line(&x.shape, *axis);
            self.use_helper(Helper::MaxNan);
            self.use_helper(Helper::InfF);
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
        let vec = vector_rows(k, g, &self.limits);
        self.softmax_cooperative(k, vec, b)
    }

    /// The cooperative softmax (see [`super::RowsForm::Cooperative`]): `P` lanes
    /// per row ([`row_lanes`]), `256 / P` rows per workgroup; lane `i` of a
    /// row takes units `i, i + P, ...`, so the lanes of a subgroup read
    /// one contiguous block per step. Rows of at most `P` x
    /// [`ROW_MAX_CACHED`] units are held in registers: the input is read
    /// once and the output written once. Longer rows keep a running max
    /// and rescaled sum per lane (online softmax), combine the pairs in a
    /// tree, and read the row a second time to write it. With `vec` a
    /// unit is a vec4 (see [`vector_rows`]). Returns the invocation count.
    fn softmax_cooperative(&mut self, k: &Kernel, vec: bool, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::Softmax { axis, log } = rn.op else { unreachable!("softmax kernel") };
        let x = g.node(rn.inputs[0]);
        let len = x.shape.dims()[axis] as u64;
        let rows = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
        let units = if vec { len / 4 } else { len };
        let lanes = row_lanes(units);
        let rows_per_group = WORKGROUP_SIZE as u64 / lanes;
        let per_lane = units.div_ceil(lanes);
        let cached = per_lane <= ROW_MAX_CACHED;
        self.cooperative = Some(if cached { "f32" } else { "vec2<f32>" });
        self.use_helper(Helper::MaxNan);
        self.use_helper(Helper::InfF);
        let xi = x_id(rn);
        let (base, stride, _) = line(&x.shape, axis);
        // Unit `j` of row `t`: its load, its max and exp-sum terms, and
        // its store of value expression `e` (over `v`, a unit).
        let ut = if vec { "vec4<f32>" } else { "f32" };
        let load =
            |j: &str| if vec { format!("in0[t * {units}u + {j}]") } else { format!("n{xi}(base + ({j}) * {stride}u)") };
        let umax = |v: &str| {
            if vec {
                format!("max_nan(max_nan({v}.x, {v}.y), max_nan({v}.z, {v}.w))")
            } else {
                v.to_string()
            }
        };
        let usum = |v: &str| {
            if vec {
                format!("dot(exp({v} - vec4<f32>(mx)), vec4<f32>(1.0))")
            } else {
                format!("exp({v} - mx)")
            }
        };
        let write = |v: &str| {
            let m = if vec { "vec4<f32>(mx)" } else { "mx" };
            if log {
                let l = if vec { "vec4<f32>(lsm)" } else { "lsm" };
                format!("({v} - {m}) - {l}")
            } else {
                format!("exp({v} - {m}) * rsm")
            }
        };
        let dst =
            |j: &str| if vec { format!("out0[t * {units}u + {j}]") } else { format!("out0[base + ({j}) * {stride}u]") };
        let fin = if log { "let lsm = log(sm);" } else { "let rsm = 1.0 / sm;" };
        let _ = writeln!(
            b,
            "    let t = (wid.x + wid.y * nwg.x) * {rows_per_group}u + lid / {lanes}u;\n    let tid = lid % {lanes}u;\n    let first = lid - tid;\n    let valid = t < {rows}u;\n    let base = {base};"
        );
        // A tree over the row's lanes in `red`, combining `a` and `b`.
        let tree = |comb: &str| {
            format!(
                "    workgroupBarrier();\n    for (var h = {}u; h > 0u; h = h >> 1u) {{\n        if (tid < h) {{\n            let a = red[lid];\n            let b = red[lid + h];\n            red[lid] = {comb};\n        }}\n        workgroupBarrier();\n    }}\n",
                lanes / 2
            )
        };
        if cached {
            // Units past the row end stay -inf and are skipped below.
            let exact = units.is_multiple_of(lanes);
            let cond =
                |e: u64| if exact { "valid".to_string() } else { format!("valid && tid + {}u < {units}u", e * lanes) };
            for e in 0..per_lane {
                let _ = writeln!(
                    b,
                    "    var v{e} = {ut}(-inf_f());\n    if ({}) {{\n        v{e} = {};\n    }}",
                    cond(e),
                    load(&format!("tid + {}u", e * lanes))
                );
            }
            b.push_str("    var acc = -inf_f();\n");
            for e in 0..per_lane {
                let _ = writeln!(b, "    acc = max_nan(acc, {});", umax(&format!("v{e}")));
            }
            let _ = write!(
                b,
                "    red[lid] = acc;\n{}    let mx = red[first];\n    workgroupBarrier();\n    acc = 0.0;\n",
                tree("max_nan(a, b)")
            );
            for e in 0..per_lane {
                let _ = writeln!(b, "    if ({}) {{\n        acc = acc + {};\n    }}", cond(e), usum(&format!("v{e}")));
            }
            let _ = write!(b, "    red[lid] = acc;\n{}    let sm = red[first];\n    {fin}\n", tree("a + b"));
            for e in 0..per_lane {
                let _ = writeln!(
                    b,
                    "    if ({}) {{\n        {} = {};\n    }}",
                    cond(e),
                    dst(&format!("tid + {}u", e * lanes)),
                    write(&format!("v{e}"))
                );
            }
        } else {
            // Online: a running max `m` and a sum `s` rescaled whenever the
            // max grows; nothing is added while the max is still -inf.
            let each = format!("for (var j = tid; j < {units}u; j = j + {lanes}u) {{");
            let term = if vec { "dot(exp(v - vec4<f32>(mn)), vec4<f32>(1.0))" } else { "exp(v - mn)" };
            let _ = writeln!(
                b,
                "    var m = -inf_f();\n    var s = 0.0;\n    if (valid) {{\n        {each}\n            let v = {};\n            let mn = max_nan(m, {});\n            if (mn > -inf_f()) {{\n                s = s * exp(m - mn) + {term};\n            }}\n            m = mn;\n        }}\n    }}\n    red[lid] = vec2<f32>(m, s);",
                load("j"),
                umax("v")
            );
            // Pairs (max, sum) combine; a pair with sum 0 adds nothing.
            let _ = write!(
                b,
                "{}    let mx = red[first].x;\n    let sm = red[first].y;\n    {fin}\n    if (valid) {{\n        {each}\n            let v = {};\n            {} = {};\n        }}\n    }}\n",
                tree("vec2<f32>(max_nan(a.x, b.x), select(0.0, a.y * exp(a.x - max_nan(a.x, b.x)), a.y > 0.0) + select(0.0, b.y * exp(b.x - max_nan(a.x, b.x)), b.y > 0.0))"),
                load("j"),
                dst("j"),
                write("v")
            );
        }
        rows.div_ceil(rows_per_group) * WORKGROUP_SIZE as u64
    }
}
