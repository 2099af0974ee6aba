//! Reductions (`Op::Reduce`), arg-reductions and cumulative sums.

use super::common::*;
use super::{LowerLimits, SecondPass, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{ArgReduceOp, DType, NodeId, Op, ReduceOp, Shape, VerifiedGraph};
use std::fmt::Write as _;

/// Reductions at least this long with at most
/// [`REDUCE_COOPERATIVE_OUTPUTS`] outputs use one workgroup per output.
pub const REDUCE_COOPERATIVE_LEN: u64 = 4096;

/// See [`REDUCE_COOPERATIVE_LEN`].
pub const REDUCE_COOPERATIVE_OUTPUTS: u64 = 256;

/// Elements a reduction loop handles per iteration (unrolled).
pub const REDUCE_UNROLL: u64 = 8;

/// Most elements per output of a reduction evaluated inside the kernel
/// that consumes it (`FusionLimits::inline_reductions`): a loop of at most
/// this many loads, [`REDUCE_UNROLL`] in flight at a time, in the
/// invocation that uses the value. The form a reduction of its own would
/// take at such sizes for strided elements (a bias gradient over a batch
/// of 64) is the same loop in an invocation per output, so inlining it
/// saves a dispatch and a buffer and costs the GPU nothing more.
pub const INLINE_REDUCTION_LEN: u64 = 64;

/// Reductions with at most this many outputs and at least
/// [`TWO_PASS_MIN_LEN`] elements each run in two passes on GPUs.
pub const TWO_PASS_MAX_OUTPUTS: u64 = 64;

/// See [`TWO_PASS_MAX_OUTPUTS`].
pub const TWO_PASS_MIN_LEN: u64 = 1 << 16;

/// Elements one first-pass workgroup reduces (at least).
pub const TWO_PASS_CHUNK: u64 = 8192;

/// Parts each output of a two-pass reduction is split into (1: one
/// pass): enough workgroups to fill a large GPU, each with at least
/// [`TWO_PASS_CHUNK`] elements, at most 1024 partials per output.
pub fn two_pass_parts(outputs: u64, len: u64) -> u64 {
    if outputs > TWO_PASS_MAX_OUTPUTS || len < TWO_PASS_MIN_LEN {
        return 1;
    }
    (len / TWO_PASS_CHUNK).clamp(2, 1024)
}

/// Invocations a GPU should have in flight for a reduction before its
/// reduced range is split (about two waves of a large GPU).
pub const COLUMN_TARGET_INVOCATIONS: u64 = 1 << 18;

/// Parts each output of a reduction over strided elements is split into
/// (1: one pass): when one invocation per output leaves a large GPU
/// mostly idle and each output has many elements, enough parts to reach
/// [`COLUMN_TARGET_INVOCATIONS`] (a bias gradient over [4096, 1024]: 256
/// parts of 16 rows, 1024 workgroups, four per SM of an H100), each of
/// at least [`COLUMN_MIN_PART`] elements, and enough that no part's loop
/// exceeds half of llvmpipe's loop budget ([`LLVMPIPE_LOOP_BUDGET`];
/// only tensors beyond one binding have such long columns).
pub fn column_parts(outputs: u64, len: u64) -> u64 {
    if outputs >= COLUMN_TARGET_INVOCATIONS || outputs * len < 1 << 22 || len < 128 {
        return 1;
    }
    (COLUMN_TARGET_INVOCATIONS / outputs)
        .clamp(2, (len / COLUMN_MIN_PART).min(1024))
        .max(len.div_ceil(LLVMPIPE_LOOP_BUDGET / 2))
}

/// Fewest elements of one part of a split column reduction (see
/// [`column_parts`]): two unrolled steps of [`REDUCE_UNROLL`].
pub const COLUMN_MIN_PART: u64 = 2 * REDUCE_UNROLL;

/// Whether a reduction of `len` elements per output, written with one
/// workgroup per output, would loop past half of llvmpipe's loop budget
/// ([`LLVMPIPE_LOOP_BUDGET`]) in each invocation; such reductions (of
/// tensors beyond one binding) run in two passes in every form.
pub fn beyond_one_workgroup(len: u64) -> bool {
    len / (WORKGROUP_SIZE as u64 * REDUCE_UNROLL) > LLVMPIPE_LOOP_BUDGET / 2
}

/// Whether reduction kernel `k` reads its rows as vec4 in the cooperative
/// form: one trailing axis of a length divisible by 4 reduced straight
/// from the kernel's one input (no prologue), f32, i32 or u32, the row length fixed.
pub fn vector_reduce(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> bool {
    let rn = g.node(k.root());
    let Op::Reduce { axes, .. } = &rn.op else { return false };
    let x = g.node(rn.inputs[0]);
    let len = x.shape.dims().last().copied().unwrap_or(0) as u64;
    k.kind == KernelKind::Reduce
        && limits.forms.reduce.cooperative()
        && limits.fixed_sizes().row
        && axes.len() == 1
        && axes[0] + 1 == x.shape.rank()
        && len > 4
        && len.is_multiple_of(4)
        && matches!(x.dtype, DType::F32 | DType::I32 | DType::U32)
        && k.inputs.len() == 1
        && k.inputs[0] == rn.inputs[0]
        && two_pass_parts(rn.shape.numel() as u64, len) == 1
}

/// The offset in a reduction's operand (of shape `x`, reduced over
/// `axes`) of the first element of output `var` (a WGSL expression of the
/// output's linear index).
fn reduced_base(x: &Shape, axes: &[usize], var: &str) -> String {
    let xs = strides(x);
    let kept: Vec<usize> = (0..x.rank()).filter(|d| !axes.contains(d)).collect();
    let kshape = Shape::new(kept.iter().map(|&d| x.dims()[d]).collect::<Vec<_>>());
    sum((0..kept.len())
        .filter(|&j| kshape.dims()[j] != 1)
        .map(|j| format!("{} * {}u", coord(var, &kshape, j), xs[kept[j]]))
        .collect())
}

/// The offset of reduced element `r` from an output's first element in
/// a reduction's operand (of shape `x`, reduced over `axes`), and whether
/// the axes are the trailing dims in order (one contiguous run: the
/// offset is `r` itself).
fn reduced_offset(x: &Shape, axes: &[usize]) -> (bool, String) {
    let rank = x.rank();
    let trailing = axes.iter().enumerate().all(|(j, &a)| a + axes.len() == rank + j);
    if trailing {
        return (true, "r".to_string());
    }
    let xs = strides(x);
    let rshape = Shape::new(axes.iter().map(|&d| x.dims()[d]).collect::<Vec<_>>());
    let off = sum((0..axes.len())
        .filter(|&j| rshape.dims()[j] != 1)
        .map(|j| format!("{} * {}u", coord("r", &rshape, j), xs[axes[j]]))
        .collect());
    (false, off)
}

/// Elements per output of the longest reduction inlined into kernel `k`'s
/// prologue (`FusionLimits::inline_reductions`); 1 when none is.
fn inlined_extent(k: &Kernel, g: &VerifiedGraph) -> u64 {
    k.inline
        .iter()
        .filter(|&&id| matches!(g.node(id).op, Op::Reduce { .. }))
        .map(|&id| reduced_len(g, id))
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Elements reduction `id` combines per output.
fn reduced_len(g: &VerifiedGraph, id: NodeId) -> u64 {
    let n = g.node(id);
    (g.node(n.inputs[0]).shape.numel() / n.shape.numel().max(1)) as u64
}

/// [`REDUCE_UNROLL`] steps of a reduction loop, lines indented by `ind`:
/// step `q` combines element `r0 + q * stride` (`load`, an expression of
/// `r`) into `acc`.
fn unrolled_steps(ind: &str, r0: &str, stride: u64, load: &str, combine: &str) -> String {
    (0..REDUCE_UNROLL)
        .map(|q| {
            format!(
                "{ind}{{\n{ind}    let r = {r0} + {}u;\n{ind}    let v = {load};\n{ind}    acc = {combine};\n{ind}}}\n",
                q * stride
            )
        })
        .collect()
}

/// The serial form of a reduction of `len` elements for one output, as
/// statements of a function body: `base`, `acc` from `init`, the unrolled
/// loop, then the remainder loop where `len` leaves one (or always, with
/// `remainder`), leaving the result in `acc`.
fn serial_reduce(base: &str, acc_ty: &str, init: &str, load: &str, combine: &str, len: u64, remainder: bool) -> String {
    let u = REDUCE_UNROLL;
    let main = len / u * u;
    let mut b = format!(
        "    let base = {base};\n    var acc: {acc_ty} = {init};\n    for (var r0 = 0u; r0 < {main}u; r0 = r0 + {u}u) {{\n{}    }}\n",
        unrolled_steps("        ", "r0", 1, load, combine)
    );
    if main < len || remainder {
        let _ = writeln!(
            b,
            "    for (var r = {main}u; r < {len}u; r = r + 1u) {{\n        let v = {load};\n        acc = {combine};\n    }}"
        );
    }
    b
}

/// Invocations per output in the cooperative form for rows of `len`
/// contiguous elements: a power of two giving each at least two unrolled
/// steps ([`REDUCE_UNROLL`]) where the row allows, at most one workgroup.
pub fn reduce_lanes(len: u64) -> u64 {
    len.div_ceil(2 * REDUCE_UNROLL).max(1).next_power_of_two().min(WORKGROUP_SIZE as u64)
}

/// How a reduction kernel is written, decided by the schedule (see
/// [`super::Schedule`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReducePlan {
    /// Strided elements of many outputs (sums over leading axes): an
    /// invocation per (output, part) of `parts`, then a second pass.
    Columns {
        /// Parts of each output's elements.
        parts: u64,
    },
    /// Few long reductions: a workgroup per (output, part) of `parts`,
    /// then a second pass.
    TwoPass {
        /// Parts of each output's elements.
        parts: u64,
    },
    /// Contiguous rows on a GPU: `lanes` invocations per output, the row
    /// read as vec4 where `vec` (see [`vector_reduce`]).
    Rows {
        /// The row is read as vec4.
        vec: bool,
        /// Invocations per output.
        lanes: u64,
    },
    /// A workgroup per output.
    Workgroup,
    /// An invocation per output.
    Serial,
}

/// The plan of reduction kernel `k` of `g` under `limits`.
pub(super) fn reduce_plan(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> ReducePlan {
    let rn = g.node(k.root());
    let Op::Reduce { axes, .. } = &rn.op else { unreachable!("a reduction kernel") };
    let x = g.node(rn.inputs[0]);
    let len = axes.iter().map(|&d| x.shape.dims()[d] as u64).product::<u64>();
    let outputs = rn.shape.numel() as u64;
    let (trailing, _) = reduced_offset(&x.shape, axes);
    let u = REDUCE_UNROLL;
    let cooperative_form = limits.forms.reduce.cooperative();
    let parts = two_pass_parts(outputs, len);
    let column_parts = column_parts(outputs, len);
    if cooperative_form && !trailing && column_parts > 1 {
        ReducePlan::Columns { parts: column_parts }
    } else if parts > 1 && (cooperative_form || beyond_one_workgroup(len)) {
        ReducePlan::TwoPass { parts }
    } else if cooperative_form && trailing && len > 1 {
        let vec = vector_reduce(k, g, limits);
        let units = if vec { len / 4 } else { len };
        // An inlined reduction in the prologue (a loss's sum over
        // classes under its mean over the batch) loops per element:
        // lanes for the loads of both, at most one per element.
        let lanes = reduce_lanes(units.saturating_mul(inlined_extent(k, g)))
            .min(units.next_power_of_two().min(WORKGROUP_SIZE as u64));
        ReducePlan::Rows { vec, lanes }
    } else if (len >= REDUCE_COOPERATIVE_LEN && outputs <= REDUCE_COOPERATIVE_OUTPUTS)
        || len / u > LLVMPIPE_LOOP_BUDGET / 2
    {
        ReducePlan::Workgroup
    } else {
        ReducePlan::Serial
    }
}

/// The accumulator type of a reduction of `d` values (see
/// `Writer::reduce_parts`).
pub(super) fn acc_ty(d: DType) -> &'static str {
    if d == DType::Bool {
        "u32"
    } else {
        ty(d)
    }
}

impl Writer<'_> {
    /// A reduction (`Op::Reduce`).
    /// Appends the statements of `main` to `b`; returns the invocation
    /// count.
    pub(super) fn reduce_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let mut invocations: u64;
        let Op::Reduce { op, axes, .. } = &rn.op else { unreachable!() };
        let x = g.node(rn.inputs[0]);
        invocations = rn.shape.numel() as u64;
        let rshape = Shape::new(axes.iter().map(|&d| x.shape.dims()[d]).collect::<Vec<_>>());
        let base_of = |var: &str| reduced_base(&x.shape, axes, var);
        let base = base_of("t");
        let (_, off) = reduced_offset(&x.shape, axes);
        let d = x.dtype;
        let (acc_ty, init, combine, fin) = self.reduce_parts(*op, d, rshape.numel());
        let load = if d == DType::Bool {
            format!("select(0u, 1u, n{}(base + {off}))", x_id(rn))
        } else {
            format!("n{}(base + {off})", x_id(rn))
        };
        let len = rshape.numel() as u64;
        let outputs = invocations;
        let u = REDUCE_UNROLL;
        // `REDUCE_UNROLL` elements per loop iteration, then the
        // remainder: keeps trip counts far below the llvmpipe loop
        // budget (`LLVMPIPE_LOOP_BUDGET`).
        let step = |ind: &str, r0: &str, stride: u64| unrolled_steps(ind, r0, stride, &load, &combine);
        match self.s.reduce() {
            ReducePlan::Columns { parts } => {
                // Many outputs over strided elements (sums over leading axes,
                // such as bias gradients): one invocation per (output, part),
                // adjacent lanes on adjacent outputs (coalesced), each summing
                // one chunk of its output's elements, `REDUCE_UNROLL` loads
                // per step (independent, so they are in flight together);
                // pass 2 reduces the parts, in order (deterministic).
                let chunk = len.div_ceil(parts);
                invocations = outputs * parts;
                let obase = base_of("o");
                let _ = writeln!(
                b,
                "    let o = t % {outputs}u;\n    let p = t / {outputs}u;\n    let base = {obase};\n    var acc: {acc_ty} = {init};\n    let hi = min(p * {chunk}u + {chunk}u, {len}u);\n    var r0 = p * {chunk}u;\n    while (r0 + {u}u <= hi) {{\n{}        r0 = r0 + {u}u;\n    }}\n    for (var r = r0; r < hi; r = r + 1u) {{\n        let v = {load};\n        acc = {combine};\n    }}\n    {}",
                step("        ", "r0", 1),
                self.output(0).store(&format!("o * {parts}u + p"), "acc")
            );
                self.second = Some(self.second_pass(outputs, parts, acc_ty, &init, &combine, &fin));
            }
            ReducePlan::TwoPass { parts } => {
                // Few long reductions on a GPU (or too long for one workgroup
                // per output on llvmpipe): pass 1 gives every (output,
                // part) pair a workgroup that reduces one chunk of the output's
                // elements into a partial; pass 2 (a kernel of its own, see
                // `SecondPass`) reduces each output's `parts` partials with a
                // group of lanes and applies the final step (mean).
                let wg = WORKGROUP_SIZE as u64;
                let chunk = len.div_ceil(parts);
                invocations = outputs * parts * wg;
                let _ = writeln!(
                b,
                "    let gi = wid.x + wid.y * nwg.x;\n    let t = gi / {parts}u;\n    let valid = t < {outputs}u;\n    let base = {base};\n    var acc: {acc_ty} = {init};\n    if (valid) {{\n        let lo = (gi % {parts}u) * {chunk}u;\n        let hi = min(lo + {chunk}u, {len}u);\n        for (var r = lo + lid; r < hi; r = r + {wg}u) {{\n            let v = {load};\n            acc = {combine};\n        }}\n    }}\n{}    if (valid && lid == 0u) {{\n        {}\n    }}",
                lane_tree("    ", wg / 2, "lid", &combine),
                self.output(0).store("gi", "red[0]")
            );
                self.second = Some(self.second_pass(outputs, parts, acc_ty, &init, &combine, &fin));
            }
            ReducePlan::Rows { vec, lanes } => {
                // Contiguous rows on a GPU: `lanes` invocations per output
                // stride over its row together (adjacent lanes, adjacent
                // addresses), `256 / lanes` outputs per workgroup, then the
                // row's lanes combine (`Writer::row_combine`: subgroup
                // shuffles where the device has them, else a tree in
                // workgroup memory). Each element is read once.
                // Rows read straight from the input with a length divisible
                // by 4 are read as vec4 (see `vector_reduce`); the lanes
                // cover an inlined reduction's loads too (see `reduce_plan`).
                let units = if vec { len / 4 } else { len };
                let per_group = WORKGROUP_SIZE as u64 / lanes;
                invocations = outputs.div_ceil(per_group) * WORKGROUP_SIZE as u64;
                let main = units / (lanes * u) * (lanes * u);
                let head = self.row_prologue(lanes, outputs);
                if vec {
                    // Unit `r` of the row: four elements, combined in order.
                    let in0 = self.input(0);
                    let unit = |ind: &str, r: &str| {
                        let mut s =
                            format!("{ind}{{\n{ind}    let x4 = {};\n", in0.load(&format!("t * {units}u + {r}")));
                        for c in ["x", "y", "z", "w"] {
                            let _ = writeln!(
                                s,
                                "{ind}    {{\n{ind}        let v = x4.{c};\n{ind}        acc = {combine};\n{ind}    }}"
                            );
                        }
                        s.push_str(&format!("{ind}}}\n"));
                        s
                    };
                    let steps: String = (0..u).map(|q| unit("            ", &format!("r0 + {}u", q * lanes))).collect();
                    let _ = write!(
                    b,
                    "{head}    var acc: {acc_ty} = {init};\n    if (valid) {{\n        for (var r0 = tid; r0 < {main}u; r0 = r0 + {}u) {{\n{steps}        }}\n        for (var r = {main}u + tid; r < {units}u; r = r + {lanes}u) {{\n{}        }}\n    }}\n",
                    lanes * u,
                    unit("            ", "r")
                );
                    b.push_str(&self.row_combine("    ", lanes, &combine));
                    let _ = writeln!(
                        b,
                        "    if (valid && tid == 0u) {{\n        {}\n    }}",
                        self.output(0).store("t", &fin)
                    );
                    return invocations;
                }
                let _ = write!(
                b,
                "{head}    let base = {base};\n    var acc: {acc_ty} = {init};\n    if (valid) {{\n        for (var r0 = tid; r0 < {main}u; r0 = r0 + {}u) {{\n{}        }}\n        for (var r = {main}u + tid; r < {len}u; r = r + {lanes}u) {{\n            let v = {load};\n            acc = {combine};\n        }}\n    }}\n",
                lanes * u,
                step("            ", "r0", lanes)
            );
                b.push_str(&self.row_combine("    ", lanes, &combine));
                let _ =
                    writeln!(b, "    if (valid && tid == 0u) {{\n        {}\n    }}", self.output(0).store("t", &fin));
            }
            ReducePlan::Workgroup => {
                // Few long reductions: one workgroup per output, its
                // invocations striding over the reduced elements, then
                // a tree in workgroup memory (8 barriers in all, so
                // cheap on llvmpipe too, where a single invocation per
                // output would use one SIMD lane of one core).
                let wg = WORKGROUP_SIZE as u64;
                invocations = outputs * wg;
                let main = len / (wg * u) * (wg * u);
                let _ = write!(
                b,
                "    let t = wid.x + wid.y * nwg.x;\n    let valid = t < {outputs}u;\n    let base = {base};\n    var acc: {acc_ty} = {init};\n    if (valid) {{\n        for (var r0 = lid; r0 < {main}u; r0 = r0 + {}u) {{\n{}        }}\n        for (var r = {main}u + lid; r < {len}u; r = r + {wg}u) {{\n            let v = {load};\n            acc = {combine};\n        }}\n    }}\n",
                wg * u,
                step("            ", "r0", wg)
            );
                b.push_str(&lane_tree("    ", wg / 2, "lid", &combine));
                let _ = writeln!(
                    b,
                    "    if (valid && lid == 0u) {{\n        let acc = red[0];\n        {}\n    }}",
                    self.output(0).store("t", &fin)
                );
            }
            ReducePlan::Serial => {
                b.push_str(&serial_reduce(&base, acc_ty, &init, &load, &combine, len, false));
                let _ = writeln!(b, "    {}", self.output(0).store("t", &fin));
            }
        }
        invocations
    }

    /// The body of the value function `nK(i)` of reduction `id` inlined
    /// into its consumer's kernel (see
    /// `lazuli_ir::fusion::FusionLimits::inline_reductions`): the serial
    /// form of [`Writer::reduce_kernel`] for output `i`, its operand read
    /// through its own value function, returning the result.
    pub(super) fn inlined_reduce_body(&mut self, id: NodeId) -> String {
        let g = self.g;
        let rn = g.node(id);
        let Op::Reduce { op, axes, .. } = &rn.op else { unreachable!("an inlined reduction") };
        let x = g.node(rn.inputs[0]);
        let len = reduced_len(g, id);
        let (acc_ty, init, combine, fin) = self.reduce_parts(*op, x.dtype, len as usize);
        let base = reduced_base(&x.shape, axes, "i");
        let (_, off) = reduced_offset(&x.shape, axes);
        let load = format!("n{}(base + {off})", x_id(rn));
        // A kernel generic over sizes keeps the remainder loop at every
        // size, so that its source differs only in literals.
        let mut b =
            serial_reduce(&base, acc_ty, &init, &load, &combine, len, self.limits.generic).trim_start().to_string();
        let _ = write!(b, "    return {fin};");
        b
    }

    /// The second pass of a two-pass reduction: `lanes` invocations per
    /// output reduce its `parts` contiguous partials (binding `in0`) and
    /// apply the final step.
    pub(super) fn second_pass(
        &self,
        outputs: u64,
        parts: u64,
        acc_ty: &'static str,
        init: &str,
        combine: &str,
        fin: &str,
    ) -> SecondPass {
        let wg = WORKGROUP_SIZE as u64;
        let lanes = reduce_lanes(parts);
        let per_group = wg / lanes;
        let pass2 = self.pass2();
        let body = format!(
            "    let t = (wid.x + wid.y * nwg.x) * {per_group}u + lid / {lanes}u;\n    let tid = lid % {lanes}u;\n    let valid = t < {outputs}u;\n    var acc: {acc_ty} = {init};\n    if (valid) {{\n        for (var r = tid; r < {parts}u; r = r + {lanes}u) {{\n            let v = {};\n            acc = {combine};\n        }}\n    }}\n{}    if (valid && tid == 0u) {{\n        let acc = red[lid];\n        {}\n    }}\n",
            pass2.inputs[0].load(&format!("t * {parts}u + r")),
            lane_tree("    ", lanes / 2, "tid", combine),
            pass2.outputs[0].store("t", fin)
        );
        SecondPass { body, invocations: outputs.div_ceil(per_group) * wg, scratch: outputs * parts }
    }

    /// An arg-reduction: one invocation per output line.
    /// Appends the statements of `main` to `b`; returns the invocation
    /// count.
    pub(super) fn arg_reduce_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::ArgReduce { op, axis, select_last, .. } = &rn.op else { unreachable!() };
        let x = g.node(rn.inputs[0]);
        let invocations = rn.shape.numel() as u64;
        let (base, stride, len) = line(&x.shape, *axis);
        let cmp = if *op == ArgReduceOp::ArgMax { ">" } else { "<" };
        let f = reg(x.dtype) == DType::F32;
        let conv = if x.dtype == DType::Bool { "select(0u, 1u, " } else { "(" };
        let mut better = format!("v {cmp} best");
        if *select_last {
            better = format!("{better} || v == best");
        }
        if f {
            self.use_helper(Helper::IsNanF);
            better = if *select_last {
                format!("isnan_f(v) || (!isnan_f(best) && ({better}))")
            } else {
                format!("!isnan_f(best) && (isnan_f(v) || {better})")
            };
        }
        let head = format!("for (var j = 1u; j < {len}u; j = j + 1u) {{");
        let _ = writeln!(
            b,
            "    let base = {base};\n    var best = {conv}n{x}(base));\n    var bi = 0u;\n    {head}\n        let v = {conv}n{x}(base + j * {stride}u));\n        if ({better}) {{\n            best = v;\n            bi = j;\n        }}\n    }}\n    {}",
            self.output(0).store("t", "i32(bi)"),
            x = x_id(rn)
        );
        invocations
    }

    /// A cumulative sum: one invocation per line.
    /// Appends the statements of `main` to `b`; returns the invocation
    /// count.
    pub(super) fn cumsum_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::CumSum { axis, exclusive, reverse } = &rn.op else { unreachable!() };
        let x = g.node(rn.inputs[0]);
        let len = x.shape.dims()[*axis] as u64;
        let invocations = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
        let (base, stride, _) = line(&x.shape, *axis);
        let jj = if *reverse { format!("({len}u - 1u - q)") } else { "q".into() };
        let head = format!("for (var q = 0u; q < {len}u; q = q + 1u) {{");
        let store = self.output(0).store("idx", "acc");
        let (pre, post) = if *exclusive {
            (format!("{store}\n        acc = acc + v;"), "")
        } else {
            (format!("acc = acc + v;\n        {store}"), "")
        };
        let _ = writeln!(
            b,
            "    let base = {base};\n    var acc: {} = {};\n    {head}\n        let idx = base + {jj} * {stride}u;\n        let v = n{}(idx);\n        {pre}{post}\n    }}",
            ty(rn.dtype),
            zero(rn.dtype),
            x_id(rn)
        );
        invocations
    }

    /// (accumulator type, init, combine expression over `acc` and `v`,
    /// final value stored) of a reduction.
    pub(super) fn reduce_parts(
        &mut self,
        op: ReduceOp,
        d: DType,
        count: usize,
    ) -> (&'static str, String, String, String) {
        let f = reg(d) == DType::F32;
        if d == DType::Bool {
            let (init, comb) = match op {
                ReduceOp::Max => ("0u", "max(acc, v)"),
                ReduceOp::Min => ("1u", "min(acc, v)"),
                ReduceOp::Sum | ReduceOp::Mean => ("0u", "max(acc, v)"),
                ReduceOp::Prod => ("1u", "min(acc, v)"),
            };
            return ("u32", init.into(), comb.into(), "acc".into());
        }
        let t = ty(d);
        match op {
            ReduceOp::Sum => (t, zero(d).into(), "acc + v".into(), "acc".into()),
            ReduceOp::Mean => (t, zero(d).into(), "acc + v".into(), format!("acc / f32({count}u)")),
            ReduceOp::Prod => (t, one(d).into(), "acc * v".into(), "acc".into()),
            ReduceOp::Max | ReduceOp::Min => {
                let is_max = op == ReduceOp::Max;
                let init = match (reg(d), is_max) {
                    (DType::F32, true) => {
                        self.use_helper(Helper::InfF);
                        "-inf_f()".to_string()
                    }
                    (DType::F32, false) => {
                        self.use_helper(Helper::InfF);
                        "inf_f()".to_string()
                    }
                    (DType::I32, true) => int_lit(i32::MIN),
                    (DType::I32, false) => int_lit(i32::MAX),
                    (_, true) => "0u".into(),
                    (_, false) => "4294967295u".into(),
                };
                let comb = if f {
                    let h = if is_max { Helper::MaxNan } else { Helper::MinNan };
                    self.use_helper(h);
                    format!("{}(acc, v)", h.name())
                } else if is_max {
                    "max(acc, v)".into()
                } else {
                    "min(acc, v)".into()
                };
                (t, init, comb, "acc".into())
            }
        }
    }
}
