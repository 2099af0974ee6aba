//! Row kernels: softmax and log-softmax along one axis, and the fused row
//! kernels of the GPU profile ([`KernelKind::Rows`]: layer norm forward
//! and backward, reductions sharing a prologue).
//!
//! In the cooperative forms a group of `lanes` invocations shares a row
//! (lane `tid` takes elements `tid, tid + lanes, ...`, so a subgroup reads
//! one contiguous block per step). Rows that fit ([`ROW_MAX_CACHED`]
//! units per lane in softmax, [`ROWS_MAX_HELD`] elements in a fused row
//! kernel; vec4 units where the row length is a multiple of 4) are read
//! from memory once into named registers (`v0`, `v1`, ...: constant indices after unrolling,
//! never a dynamically indexed local array, which NVIDIA puts in local
//! memory); every phase (max, sum, mean, variance, the outputs) works on
//! those registers. Longer rows keep a multi-pass path that reads the row
//! once per phase.
//!
//! The lanes of a row combine their partial values (`Writer::row_combine`)
//! with subgroup shuffles where the device has subgroups
//! ([`LowerLimits::subgroups`]): a butterfly of `subgroupShuffleXor` over
//! the row's lanes within a subgroup, then, for rows wider than a
//! subgroup, one value per subgroup through workgroup memory (two
//! barriers). The lanes are numbered by subgroup (`sid * ssz + sii`), so
//! the lanes of a row never straddle subgroups whatever the adapter's
//! mapping of invocations; a workgroup whose subgroups are not all full
//! with a power-of-two size (checked at run time, uniformly through
//! `workgroupUniformLoad`) takes the workgroup-memory tree instead, as do
//! devices without subgroups. The subgroup size is never assumed.
//! Shuffles, not `subgroupAdd`/`subgroupMax`, so that every combine keeps
//! the reference's semantics (NaN-propagating max, the online softmax's
//! pairs).

use super::common::*;
use super::{LowerError, LowerLimits, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{DType, NodeId, Op, VerifiedGraph};
use std::collections::HashMap;
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
        && limits.fixed_sizes().row
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

/// The units a cooperative row kernel lays its lanes out for: the row's
/// own where its length is `fixed`, else the power of two at or above it
/// and at least [`ROW_GENERIC_MIN_UNITS`] (as generic matmuls take the
/// layout of 64 rows or columns): a kernel generic over the row length
/// then serves every length of that bucket with one source, lanes past
/// the row's end masked, so a context growing up to 64 tokens needs one
/// generic softmax, not one per length.
pub fn layout_units(units: u64, fixed: bool) -> u64 {
    if fixed {
        units
    } else {
        units.next_power_of_two().max(ROW_GENERIC_MIN_UNITS)
    }
}

/// The smallest bucket a varying row length is laid out for (see
/// [`layout_units`]).
pub const ROW_GENERIC_MIN_UNITS: u64 = 64;

/// How a softmax kernel is written, decided by the schedule (see
/// [`super::Schedule`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftmaxPlan {
    /// One invocation per row in vec4 (the per-row form, see
    /// [`vector_rows`]).
    Vec4Rows,
    /// One invocation per row, three passes.
    PerRow,
    /// A group of `lanes` invocations per row, units of vec4 where `vec`;
    /// rows held in registers where `cached` (see
    /// `Writer::softmax_cooperative`).
    Cooperative {
        /// Units are vec4s.
        vec: bool,
        /// Invocations per row.
        lanes: u64,
        /// The row is held in registers.
        cached: bool,
    },
}

impl SoftmaxPlan {
    /// The plan of softmax kernel `k` of `g` under `limits`.
    pub(super) fn new(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> SoftmaxPlan {
        let vec = vector_rows(k, g, limits);
        let per_row = limits.forms.rows.per_row();
        if vec && per_row {
            return SoftmaxPlan::Vec4Rows;
        }
        let rn = g.node(k.root());
        let Op::Softmax { axis, .. } = rn.op else { unreachable!("softmax kernel") };
        let len = g.node(rn.inputs[0]).shape.dims()[axis] as u64;
        // One invocation per row runs three passes of `len` iterations;
        // longer rows go cooperative even on llvmpipe (its loop budget,
        // `LLVMPIPE_LOOP_BUDGET`).
        if per_row && 3 * len <= LLVMPIPE_LOOP_BUDGET {
            return SoftmaxPlan::PerRow;
        }
        let units = if vec { len / 4 } else { len };
        // A row length that varies (a kernel generic over it) is laid out
        // by its power-of-two bucket: every length of the bucket then has
        // this source, the length itself read at run time.
        let layout_units = layout_units(units, limits.fixed_sizes().row);
        let lanes = row_lanes(layout_units);
        SoftmaxPlan::Cooperative { vec, lanes, cached: layout_units.div_ceil(lanes) <= ROW_MAX_CACHED }
    }

    /// Whether the kernel's input and output are bound as vec4.
    pub(super) fn vec4(self) -> bool {
        matches!(self, SoftmaxPlan::Vec4Rows | SoftmaxPlan::Cooperative { vec: true, .. })
    }
}

impl Writer<'_> {
    /// The start of a cooperative row kernel's `main` with `lanes` lanes
    /// per row and `256 / lanes` rows per workgroup, `rows` rows in all:
    /// defines `f` (the invocation's slot: `lid`, or with subgroups
    /// `sid * ssz + sii` where every subgroup of the workgroup is full and
    /// of a power-of-two size), `tid` (its lane in the row), `t` (its row),
    /// `valid` (`t` is a row) and, with subgroups, `sgm` (0: the tree,
    /// 1: rows within a subgroup, 2: rows of several subgroups), uniform
    /// over the workgroup.
    pub(super) fn row_prologue(&mut self, lanes: u64, rows: u64) -> String {
        let per_group = WORKGROUP_SIZE as u64 / lanes;
        let mut b = String::new();
        if self.s.subgroups() {
            debug_assert!(lanes > 1, "subgroups combine the lanes of a row");
            let _ = writeln!(self.decls, "var<workgroup> sgmode: u32;\n");
            let _ = writeln!(
                b,
                "    if (lid == 0u) {{\n        let full = nsg * ssz == {WORKGROUP_SIZE}u && (ssz & (ssz - 1u)) == 0u;\n        sgmode = select(0u, select(2u, 1u, {lanes}u <= ssz), full);\n    }}\n    let sgm = workgroupUniformLoad(&sgmode);\n    let f = select(lid, sid * ssz + sii, sgm != 0u);"
            );
        } else {
            b.push_str("    let f = lid;\n");
        }
        let _ = writeln!(
            b,
            "    let t = (wid.x + wid.y * nwg.x) * {per_group}u + f / {lanes}u;\n    let tid = f % {lanes}u;\n    let valid = t < {rows}u;"
        );
        b
    }

    /// Combines `acc` over the `lanes` lanes of each row with `combine` (an
    /// expression over `acc` and `v`, commutative), leaving the row's value
    /// in `acc` in every lane (bit-identical in all of them). With
    /// subgroups (see [`Writer::row_prologue`]): a butterfly of
    /// `subgroupShuffleXor` over the row's lanes (all of a subgroup's lanes
    /// where the row is wider), then for rows wider than a subgroup one
    /// value per subgroup through `red` and two barriers; otherwise, or
    /// where the run-time check failed, a tree in `red`. Called in uniform
    /// control flow (barriers); `red`'s element type is `acc`'s.
    pub(super) fn row_combine(&self, ind: &str, lanes: u64, combine: &str) -> String {
        if lanes <= 1 {
            return String::new();
        }
        let tree = format!(
            "{ind}red[f] = acc;\n{ind}workgroupBarrier();\n{ind}for (var h = {}u; h > 0u; h = h >> 1u) {{\n{ind}    if (tid < h) {{\n{ind}        let acc = red[f];\n{ind}        let v = red[f + h];\n{ind}        red[f] = {combine};\n{ind}    }}\n{ind}    workgroupBarrier();\n{ind}}}\n{ind}acc = red[f - tid];\n{ind}workgroupBarrier();\n",
            lanes / 2
        );
        if !self.s.subgroups() {
            return tree;
        }
        let i2 = format!("{ind}    ");
        let tree = tree.lines().map(|l| format!("    {l}\n")).collect::<String>();
        format!(
            "{ind}if (sgm != 0u) {{\n{i2}for (var h = 1u; h < min({lanes}u, ssz); h = h << 1u) {{\n{i2}    let v = subgroupShuffleXor(acc, h);\n{i2}    acc = {combine};\n{i2}}}\n{i2}if (sgm == 2u) {{\n{i2}    if (sii == 0u) {{\n{i2}        red[sid] = acc;\n{i2}    }}\n{i2}    workgroupBarrier();\n{i2}    let first = (f / {lanes}u) * ({lanes}u / ssz);\n{i2}    acc = red[first];\n{i2}    for (var q = 1u; q < {lanes}u / ssz; q = q + 1u) {{\n{i2}        let v = red[first + q];\n{i2}        acc = {combine};\n{i2}    }}\n{i2}    workgroupBarrier();\n{i2}}}\n{ind}}} else {{\n{tree}{ind}}}\n"
        )
    }

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
        let load = self.input(0).load("b + j");
        let b = format!(
            "    let b = t * {len4}u;\n    var m = -inf_f();\n    var s = 0.0;\n    {head}\n        let v = {load};\n        let mn = max_nan(m, max_nan(max_nan(v.x, v.y), max_nan(v.z, v.w)));\n        if (mn > -inf_f()) {{\n            let e = exp(v - vec4<f32>(mn));\n            s = s * exp(m - mn) + ((e.x + e.y) + (e.z + e.w));\n        }}\n        m = mn;\n    }}\n    {fin}\n    {head}\n        let v = {load};\n        {}\n    }}\n",
            self.output(0).store("b + j", out)
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
        let plan = self.s.softmax();
        if plan == SoftmaxPlan::PerRow {
            let invocations = rows;
            let (base, stride, _) = line(&x.shape, *axis);
            self.use_helper(Helper::MaxNan);
            self.use_helper(Helper::InfF);
            let xi = x_id(rn);
            // Softmax stores exp(v - m) in the second pass and
            // scales it in the third (one exp per element).
            let out0 = self.output(0);
            let (second, third) = if *log {
                (String::new(), format!("let v = n{xi}(idx);\n        {}", out0.store("idx", "v - m - ls")))
            } else {
                (
                    format!("\n        {}", out0.store("idx", "e")),
                    out0.store("idx", &format!("{} * r", out0.load("idx"))),
                )
            };
            let fin = if *log { "let ls = log(s);" } else { "let r = 1.0 / s;" };
            let head = format!("for (var j = 0u; j < {len}u; j = j + 1u) {{");
            let _ = writeln!(
                b,
                "    let base = {base};\n    var m = -inf_f();\n    {head}\n        m = max_nan(m, n{xi}(base + j * {stride}u));\n    }}\n    var s = 0.0;\n    {head}\n        let idx = base + j * {stride}u;\n        let e = exp(n{xi}(idx) - m);\n        s = s + e;{second}\n    }}\n    {fin}\n    {head}\n        let idx = base + j * {stride}u;\n        {third}\n    }}"
            );
            return invocations;
        }
        let SoftmaxPlan::Cooperative { vec, lanes, cached } = plan else { unreachable!("the cooperative softmax") };
        self.softmax_cooperative(k, (vec, lanes, cached), b)
    }

    /// The cooperative softmax (see [`super::RowsForm::Cooperative`]): `P` lanes
    /// per row ([`row_lanes`]), `256 / P` rows per workgroup; lane `i` of a
    /// row takes units `i, i + P, ...`, so the lanes of a subgroup read
    /// one contiguous block per step. Rows of at most `P` x
    /// [`ROW_MAX_CACHED`] units are held in registers: the input is read
    /// once and the output written once (softmax keeps each element's exp
    /// in its register: one exp per element). Longer rows keep a running max
    /// and rescaled sum per lane (online softmax), combine the pairs
    /// ([`Writer::row_combine`]), and read the row a second time to write it. With `vec` a
    /// unit is a vec4 (see [`vector_rows`]). Returns the invocation count.
    fn softmax_cooperative(&mut self, k: &Kernel, (vec, lanes, cached): (bool, u64, bool), b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::Softmax { axis, log } = rn.op else { unreachable!("softmax kernel") };
        let x = g.node(rn.inputs[0]);
        let len = x.shape.dims()[axis] as u64;
        let rows = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
        let units = if vec { len / 4 } else { len };
        // A row length that varies (a kernel generic over it) is laid out
        // by its power-of-two bucket: every length of the bucket then has
        // this source, the length itself read at run time.
        let fixed = self.limits.fixed_sizes().row;
        let layout_units = layout_units(units, fixed);
        let rows_per_group = WORKGROUP_SIZE as u64 / lanes;
        let per_lane = layout_units.div_ceil(lanes);
        self.use_helper(Helper::MaxNan);
        self.use_helper(Helper::InfF);
        let xi = x_id(rn);
        let (base, stride, _) = line(&x.shape, axis);
        // Unit `j` of row `t`: its load, its max and exp-sum terms, and
        // its store of value expression `e` (over `v`, a unit).
        let ut = if vec { "vec4<f32>" } else { "f32" };
        let (in0, out0) = (self.input(0), self.output(0));
        let load = |j: &str| {
            if vec {
                in0.load(&format!("t * {units}u + {j}"))
            } else {
                format!("n{xi}(base + ({j}) * {stride}u)")
            }
        };
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
        // The statement storing value `v` to unit `j`.
        let store = |j: &str, v: &str| {
            if vec {
                out0.store(&format!("t * {units}u + {j}"), v)
            } else {
                out0.store(&format!("base + ({j}) * {stride}u"), v)
            }
        };
        let head = self.row_prologue(lanes, rows);
        let _ = writeln!(b, "{head}    let base = {base};");
        let fin = if log { "let lsm = log(sm);" } else { "let rsm = 1.0 / sm;" };
        if cached {
            // Units past the row end stay -inf and are skipped below.
            let exact = fixed && units.is_multiple_of(lanes);
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
            b.push_str(&self.row_combine("    ", lanes, "max_nan(acc, v)"));
            b.push_str("    let mx = acc;\n    acc = 0.0;\n");
            // Softmax keeps each exp in its register (one exp per
            // element); log-softmax writes from the inputs.
            let m = if vec { "vec4<f32>(mx)" } else { "mx" };
            for e in 0..per_lane {
                if log {
                    let _ =
                        writeln!(b, "    if ({}) {{\n        acc = acc + {};\n    }}", cond(e), usum(&format!("v{e}")));
                } else {
                    let term = if vec { format!("dot(v{e}, vec4<f32>(1.0))") } else { format!("v{e}") };
                    let _ = writeln!(
                        b,
                        "    v{e} = exp(v{e} - {m});\n    if ({}) {{\n        acc = acc + {term};\n    }}",
                        cond(e)
                    );
                }
            }
            b.push_str(&self.row_combine("    ", lanes, "acc + v"));
            let _ = writeln!(b, "    let sm = acc;\n    {fin}");
            for e in 0..per_lane {
                let value = if log { write(&format!("v{e}")) } else { format!("v{e} * rsm") };
                let _ = writeln!(
                    b,
                    "    if ({}) {{\n        {}\n    }}",
                    cond(e),
                    store(&format!("tid + {}u", e * lanes), &value),
                );
            }
        } else {
            // Online: a running max `m` and a sum `s` rescaled whenever the
            // max grows; nothing is added while the max is still -inf.
            let each = format!("for (var j = tid; j < {units}u; j = j + {lanes}u) {{");
            let term = if vec { "dot(exp(v - vec4<f32>(mn)), vec4<f32>(1.0))" } else { "exp(v - mn)" };
            let _ = writeln!(
                b,
                "    var m = -inf_f();\n    var s = 0.0;\n    if (valid) {{\n        {each}\n            let v = {};\n            let mn = max_nan(m, {});\n            if (mn > -inf_f()) {{\n                s = s * exp(m - mn) + {term};\n            }}\n            m = mn;\n        }}\n    }}\n    var acc = vec2<f32>(m, s);",
                load("j"),
                umax("v")
            );
            // Pairs (max, sum) combine; a pair with sum 0 adds nothing.
            b.push_str(&self.row_combine("    ", lanes, "vec2<f32>(max_nan(acc.x, v.x), select(0.0, acc.y * exp(acc.x - max_nan(acc.x, v.x)), acc.y > 0.0) + select(0.0, v.y * exp(v.x - max_nan(acc.x, v.x)), v.y > 0.0))"));
            let _ = write!(
                b,
                "    let mx = acc.x;\n    let sm = acc.y;\n    {fin}\n    if (valid) {{\n        {each}\n            let v = {};\n            {}\n        }}\n    }}\n",
                load("j"),
                store("j", &write("v"))
            );
        }
        rows.div_ceil(rows_per_group) * WORKGROUP_SIZE as u64
    }
}

/// Most elements of a row one lane of a fused row kernel
/// ([`KernelKind::Rows`]) holds in registers: rows of up to
/// `ROW_MAX_LANES * ROWS_MAX_HELD` elements (8192) are read once.
pub const ROWS_MAX_HELD: u64 = 32;

/// How a fused row kernel is laid out (see `Writer::rows_kernel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsLayout {
    /// Lanes per row.
    pub lanes: u64,
    /// The row is held in registers (read once).
    pub held: bool,
    /// Held, and the inputs and outputs of the row's size are bound and
    /// accessed as vec4: the row length is a multiple of 4, every output
    /// has the row's size (no per-row output) and the row length is fixed.
    pub vec4: bool,
}

/// The layout of row kernel `k`: vec4 where [`RowsLayout::vec4`] allows,
/// [`row_lanes`] lanes of the row's units (elements, or vec4s) where a
/// lane then holds at most [`ROWS_MAX_HELD`] elements, else
/// [`super::reduce::reduce_lanes`] lanes and a pass per phase.
pub fn rows_layout(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> RowsLayout {
    let shape = &g.node(k.root()).shape;
    let len = shape.dims().last().copied().unwrap_or(1) as u64;
    let n = shape.numel() as u64;
    let all_full = k.outputs.iter().all(|&o| g.node(o).shape.numel() as u64 == n);
    let fixed = limits.fixed_sizes().row;
    let w = if fixed && len > 0 && len.is_multiple_of(4) && all_full { 4 } else { 1 };
    let units = layout_units(len / w, fixed);
    let lanes = row_lanes(units);
    if units.div_ceil(lanes) * w <= ROWS_MAX_HELD {
        return RowsLayout { lanes, held: true, vec4: w == 4 };
    }
    RowsLayout { lanes: super::reduce::reduce_lanes(layout_units(len, fixed)), held: false, vec4: false }
}

impl Writer<'_> {
    /// A fused row kernel ([`KernelKind::Rows`]): `lanes` invocations per
    /// row of the output shape, `256 / lanes` rows per workgroup (see
    /// [`rows_layout`]). Each inlined reduction, in order, combines its
    /// operand's row ([`Writer::row_combine`]) into a private `rvK` that
    /// every lane of the row holds and the reduction's value function
    /// returns; then the outputs are written along the row (an output of
    /// the row shape, one value per row, once by the row's first lane).
    /// The operand of a later reduction may use an earlier one (layer
    /// norm's variance its mean).
    ///
    /// A held row is read once: each input of the row's size is loaded
    /// into registers (`xK_e`, unit `tid + e * lanes` of the row, a vec4 in
    /// the vec4 layout), and every node of the row's size computed from
    /// them is a value function applied per element (`vK(operands)`, the
    /// expressions of the indexed form) into `rK_s`. Other values (a
    /// broadcast weight, a per-row value, a view with index math) are
    /// their index functions at the element. Rows too long to hold read
    /// their operand in each phase.
    pub(super) fn rows_kernel(&mut self, k: &Kernel, b: &mut String) -> Result<u64, LowerError> {
        let g = self.g;
        let shape = &g.node(k.root()).shape;
        let len = shape.dims()[shape.rank() - 1] as u64;
        let n = shape.numel() as u64;
        let rows = n.checked_div(len).unwrap_or(0);
        let RowsLayout { lanes, held, vec4 } = self.s.rows_layout();
        let w = if vec4 { 4 } else { 1 };
        let units = len / w;
        let fixed = self.limits.fixed_sizes().row;
        let per_group = WORKGROUP_SIZE as u64 / lanes;
        let per_lane = layout_units(units, fixed).div_ceil(lanes);
        let head = self.row_prologue(lanes, rows);
        let _ = writeln!(b, "{head}    let base = t * {len}u;");
        // Unit `e` of this lane: whether it is in the row; element slot
        // `s` is lane `s % w` of unit `s / w`.
        let exact = fixed && units.is_multiple_of(lanes);
        let cond =
            |e: u64| if exact { "valid".to_string() } else { format!("valid && tid + {}u < {units}u", e * lanes) };
        let slots = per_lane * w;
        let mut lanes_of = Lanes { vals: HashMap::new(), held };
        if held {
            for s in 0..slots {
                let (e, c) = (s / w, s % w);
                let _ = writeln!(b, "    let i{s} = base + (tid + {}u) * {w}u + {c}u;", e * lanes);
            }
            // Every input of the row's size, read once.
            for (slot, &id) in k.inputs.iter().enumerate() {
                let d = g.node(id);
                if d.shape.numel() as u64 != n {
                    continue;
                }
                for e in 0..per_lane {
                    let (t, load) = if vec4 {
                        (
                            format!("vec4<{}>", storage_reg_ty(d.dtype)),
                            self.input(slot).load(&format!("t * {units}u + tid + {}u", e * lanes)),
                        )
                    } else {
                        (ty(d.dtype).to_string(), format!("n{}(i{e})", id.0))
                    };
                    let _ = writeln!(
                        b,
                        "    var x{0}_{e} = {t}();\n    if ({1}) {{\n        x{0}_{e} = {load};\n    }}",
                        id.0,
                        cond(e)
                    );
                    for c in 0..w {
                        let v = if !vec4 {
                            format!("x{}_{e}", id.0)
                        } else if d.dtype == DType::Bool {
                            format!("(x{}_{e}[{c}] != 0u)", id.0)
                        } else {
                            format!("x{}_{e}[{c}]", id.0)
                        };
                        lanes_of.vals.insert((id, e * w + c), v);
                    }
                }
            }
        }
        let mut slot = 0;
        for &id in &k.inline {
            let node = g.node(id);
            let Op::Reduce { op, .. } = node.op else { continue };
            let (_, init, combine, fin) = self.reduce_parts(op, DType::F32, len as usize);
            let _ = writeln!(self.decls, "var<private> rv{slot}: f32;\n");
            let _ = writeln!(self.funcs, "fn n{}(i: u32) -> f32 {{\n    return rv{slot};\n}}\n", id.0);
            let x = node.inputs[0];
            if held {
                let _ = writeln!(b, "    var acc{slot} = {init};");
                for s in 0..slots {
                    let v = self.lane_value(&mut lanes_of, k, n, x, s, b)?;
                    let _ = writeln!(
                        b,
                        "    if ({}) {{\n        let acc = acc{slot};\n        let v = {v};\n        acc{slot} = {combine};\n    }}",
                        cond(s / w)
                    );
                }
            } else {
                let _ = writeln!(
                    b,
                    "    var acc{slot} = {init};\n    if (valid) {{\n        for (var j = tid; j < {len}u; j = j + {lanes}u) {{\n            let acc = acc{slot};\n            let v = n{}(base + j);\n            acc{slot} = {combine};\n        }}\n    }}",
                    x.0
                );
            }
            let _ = write!(
                b,
                "    {{\n        var acc = acc{slot};\n{}        rv{slot} = {fin};\n    }}\n",
                self.row_combine("        ", lanes, &combine)
            );
            slot += 1;
        }
        // Outputs of the row's shape along the row; outputs of the row
        // shape (one value per row: the planner keeps them when later
        // kernels read them) once, by the row's first lane.
        let per_row = |id: &NodeId| g.node(*id).shape.numel() as u64 == rows && len != 1;
        if held {
            for e in 0..per_lane {
                let mut stores = Vec::new();
                for (o, &id) in k.outputs.iter().enumerate().filter(|(_, id)| !per_row(id)) {
                    let d = g.node(id).dtype;
                    let mut vals = Vec::new();
                    for c in 0..w {
                        let v = self.lane_value(&mut lanes_of, k, n, id, e * w + c, b)?;
                        vals.push(store(d, &v));
                    }
                    let out = self.output(o);
                    stores.push(if vec4 {
                        format!(
                            "        {}\n",
                            out.store(
                                &format!("t * {units}u + tid + {}u", e * lanes),
                                &format!("vec4<{}>({})", storage_reg_ty(d), vals.join(", "))
                            )
                        )
                    } else {
                        format!("        {}\n", out.store(&format!("i{e}"), &vals[0]))
                    });
                }
                if !stores.is_empty() {
                    let _ = writeln!(b, "    if ({}) {{\n{}    }}", cond(e), stores.concat());
                }
            }
            b.push_str("    if (valid) {\n");
        } else {
            let _ = writeln!(b, "    if (valid) {{\n        for (var j = tid; j < {len}u; j = j + {lanes}u) {{");
            for (o, &id) in k.outputs.iter().enumerate().filter(|(_, id)| !per_row(id)) {
                let _ = writeln!(
                    b,
                    "            {}",
                    self.output(o).store("base + j", &store(g.node(id).dtype, &format!("n{}(base + j)", id.0)))
                );
            }
            b.push_str("        }\n");
        }
        for (o, &id) in k.outputs.iter().enumerate().filter(|(_, id)| per_row(id)) {
            let _ = writeln!(
                b,
                "        if (tid == 0u) {{\n            {}\n        }}",
                self.output(o).store("t", &store(g.node(id).dtype, &format!("n{}(t)", id.0)))
            );
        }
        b.push_str("    }\n");
        Ok(rows.div_ceil(per_group) * WORKGROUP_SIZE as u64)
    }

    /// The value of node `id` at element slot `e` of this lane in a held
    /// row kernel (see [`Writer::rows_kernel`]): a register, a value
    /// function applied to its operands' values (written to `b` as `let
    /// rK_e` the first time, after everything it needs), or the node's
    /// index function at the element (`iE`). `n` is the row kernel's element count:
    /// nodes of that size share its linear index.
    fn lane_value(
        &mut self,
        lanes: &mut Lanes,
        k: &Kernel,
        n: u64,
        id: NodeId,
        e: u64,
        b: &mut String,
    ) -> Result<String, LowerError> {
        if let Some(v) = lanes.vals.get(&(id, e)) {
            return Ok(v.clone());
        }
        let g = self.g;
        let node = g.node(id);
        let call = format!("n{}(i{e})", id.0);
        let full = |x: NodeId| g.node(x).shape.numel() as u64 == n;
        if !lanes.held || !full(id) || !k.inline.contains(&id) {
            return Ok(call);
        }
        let ops = &node.inputs;
        let d = |j: usize| g.node(ops[j]).dtype;
        // An operand at this element: its lane value where it shares the
        // node's linear index, else its index function.
        let same = |j: usize| full(ops[j]) && g.node(ops[j]).shape == node.shape;
        let (params, expr, operand_ok): (String, String, Vec<bool>) = match &node.op {
            Op::Reshape(_) | Op::Expand(_) if full(ops[0]) => {
                let v = self.lane_value(lanes, k, n, ops[0], e, b)?;
                lanes.vals.insert((id, e), v.clone());
                return Ok(v);
            }
            Op::Unary(u) => (format!("x: {}", ty(d(0))), self.unary(*u, d(0))?, vec![true]),
            Op::Cast(to) => (format!("x: {}", ty(d(0))), self.cast(d(0), *to), vec![true]),
            Op::Binary(op) => {
                (format!("a: {}, b: {}", ty(d(0)), ty(d(1))), self.binary(*op, d(0))?, vec![same(0), same(1)])
            }
            Op::Where => (
                format!("c: bool, a: {}, b: {}", ty(d(1)), ty(d(2))),
                "select(b, a, c)".to_string(),
                vec![same(0), same(1), same(2)],
            ),
            _ => return Ok(call),
        };
        let mut args = Vec::new();
        for (j, &ok) in operand_ok.iter().enumerate() {
            args.push(if ok {
                self.lane_value(lanes, k, n, ops[j], e, b)?
            } else {
                format!("n{}({})", ops[j].0, bcast_index(&format!("i{e}"), &node.shape, &g.node(ops[j]).shape))
            });
        }
        if self.defined.insert(('v', id.0)) {
            let _ = writeln!(self.funcs, "fn v{}({params}) -> {} {{\n    return {expr};\n}}\n", id.0, ty(node.dtype));
        }
        let _ = writeln!(b, "    let r{0}_{e} = v{0}({1});", id.0, args.join(", "));
        let v = format!("r{}_{e}", id.0);
        lanes.vals.insert((id, e), v.clone());
        Ok(v)
    }
}

/// The values a held row kernel has at each of a lane's elements, by
/// (node, element).
struct Lanes {
    vals: HashMap<(NodeId, u64), String>,
    held: bool,
}
