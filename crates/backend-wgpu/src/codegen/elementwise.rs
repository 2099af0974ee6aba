//! Elementwise kernels in straight-line form: vec4 loads and stores, one
//! value function per node applied per lane (see [`straight_line_width`]).
//! The GPU form gives each invocation one vector, adjacent lanes on
//! adjacent 16-byte addresses, over a 1-D or 2-D dispatch, and strides
//! over the grid only where that grid would not fit (see [`gpu_steps`]);
//! the software form gives each invocation consecutive vectors. The
//! indexed form (one invocation per output index, views as index math)
//! is `Writer::main_body`'s `KernelKind::Elementwise` arm.

use super::common::*;
use super::{LowerError, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{DType, NodeId, Op, VerifiedGraph};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

/// Vectors each invocation of a large straight-line elementwise kernel
/// handles (consecutive ones: on lavapipe, fewer and longer invocations
/// beat one vector per invocation).
pub const STRAIGHT_LINE_STEPS: u64 = 16;

/// Workgroups a dispatch may have in each dimension: WebGPU's default
/// `maxComputeWorkgroupsPerDimension`, which every adapter meets and
/// `crate::device::context::dispatch_size` spreads workgroups over (x up to it,
/// then rows of y).
pub const MAX_GROUPS_PER_DIMENSION: u64 = 65535;

/// Vectors each invocation of the GPU form handles, for `vectors` vectors
/// and at most `max_groups` workgroups per dimension: 1 (one vector per
/// invocation) while that grid fits, else the fewest grid-stride steps
/// that make it fit. A grid fits when its workgroups of
/// [`WORKGROUP_SIZE`] fill a 1-D dispatch of up to `max_groups`, or a 2-D
/// one of `max_groups` columns and up to `max_groups` rows, and every
/// invocation it launches has a u32 index (`main` computes
/// `t = gid.x + gid.y * nwg.x * WORKGROUP_SIZE`, so the launched
/// invocations, the last row counted whole, must not pass 2^32). With
/// the real limit ([`MAX_GROUPS_PER_DIMENSION`]) that is 65535 x 256
/// workgroups, 4294901760 invocations: every vec4 kernel (at most 2^30
/// vectors) takes one vector per invocation, and only a scalar-width
/// kernel of more elements strides. A pure function of its arguments, so
/// its boundary is testable with a small `max_groups`.
pub fn gpu_steps(vectors: u64, max_groups: u64) -> u64 {
    let size = WORKGROUP_SIZE as u64;
    // Workgroups whose launched invocations all have a u32 index.
    let indexable = (1u64 << 32) / size;
    let max_groups = max_groups.max(1);
    let groups = if max_groups >= indexable { indexable } else { max_groups * max_groups.min(indexable / max_groups) };
    vectors.div_ceil(groups * size).max(1)
}

/// Whether elementwise kernel `k` can be written in straight-line form, and
/// with which vector width (4 when the element count allows, else 1): every
/// value is either full-size (read or computed at the output's own linear
/// index: elementwise ops over same-size operands, reshapes and no-op
/// expands) or a single element (broadcast, evaluated once), or an
/// inlined reduction of the output's size (one call of its value function
/// per element, width 1), whose operands only its loop reads, through
/// value functions. Anything with index math (permutes, slices, pads,
/// concats, iota, partial broadcasts) keeps the indexed form.
pub fn straight_line_width(k: &Kernel, g: &VerifiedGraph) -> Option<u32> {
    if k.kind != KernelKind::Elementwise {
        return None;
    }
    let n = g.node(k.root()).shape.numel();
    if n <= 1 {
        return None;
    }
    let size_ok = |id: NodeId| matches!(g.node(id).shape.numel(), m if m == n || m == 1);
    // What only inlined reductions read is evaluated in their loops by
    // value functions: never full-size, so never a lane of the line.
    let prologue = reduction_prologue(k, g);
    let reduced = |id: NodeId| matches!(g.node(id).op, Op::Reduce { .. });
    let in_main =
        |id: NodeId| k.inline.iter().any(|&u| !prologue.contains(&u) && !reduced(u) && g.node(u).inputs.contains(&id));
    for &id in k.inputs.iter().chain(&k.inline).filter(|id| prologue.contains(id)) {
        let m = g.node(id).shape.numel();
        if m == n || (m != 1 && (in_main(id) || k.outputs.contains(&id))) {
            return None;
        }
    }
    if !k.inputs.iter().all(|&i| size_ok(i) || prologue.contains(&i)) {
        return None;
    }
    for &id in &k.inline {
        let node = g.node(id);
        let m = node.shape.numel();
        if prologue.contains(&id) {
            continue;
        }
        if reduced(id) {
            // An inlined reduction: one call of its value function per
            // element of the line.
            if m != n {
                return None;
            }
            continue;
        }
        if m == 1 {
            if !node.inputs.iter().all(|&o| g.node(o).shape.numel() == 1) {
                return None;
            }
            continue;
        }
        let elementwise =
            matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Reshape(_) | Op::Expand(_));
        if m != n || !elementwise || !node.inputs.iter().all(|&o| size_ok(o)) {
            return None;
        }
    }
    // An inlined reduction loops in every invocation that uses it: one
    // element per invocation keeps as many loops in flight as its own
    // kernel would have, adjacent lanes on adjacent outputs.
    let reduces = k.inline.iter().any(|&id| reduced(id));
    Some(if n.is_multiple_of(4) && !reduces { 4 } else { 1 })
}

/// The nodes and inputs of kernel `k` that its inlined reductions read
/// (see `lazuli_ir::fusion::FusionLimits::inline_reductions`), through
/// the inlined nodes between: evaluated inside the reductions' loops.
fn reduction_prologue(k: &Kernel, g: &VerifiedGraph) -> BTreeSet<NodeId> {
    let inline: BTreeSet<NodeId> = k.inline.iter().copied().collect();
    let mut stack: Vec<NodeId> = k
        .inline
        .iter()
        .filter(|&&id| matches!(g.node(id).op, Op::Reduce { .. }))
        .map(|&id| g.node(id).inputs[0])
        .collect();
    let mut seen = BTreeSet::new();
    while let Some(x) = stack.pop() {
        if seen.insert(x) && inline.contains(&x) {
            stack.extend(g.node(x).inputs.iter().copied());
        }
    }
    seen
}

impl Writer<'_> {
    /// Straight-line form of an elementwise kernel (see
    /// [`straight_line_width`]): in the GPU form every invocation handles
    /// one vector of `width` elements (a grid-stride loop of
    /// [`gpu_steps`] steps beyond the largest grid), in the software form
    /// up to [`STRAIGHT_LINE_STEPS`] consecutive vectors; full-size inputs are loaded once per vector, each node is one call
    /// of a value function per lane (`vK(operands) -> T`, the same
    /// expressions as the indexed form, so semantics are shared), and
    /// single-element nodes are evaluated once, before any loop. Returns
    /// the statements of `main` and the invocation count.
    pub(super) fn straight_line(&mut self, k: &Kernel, width: u32) -> Result<(String, u64), LowerError> {
        const LANES: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        let n = g.node(k.root()).shape.numel();
        let full = |id: NodeId| g.node(id).shape.numel() == n;
        let vectors = n as u64 / width as u64;
        let grid_stride = self.limits.forms.elementwise.grid_stride();
        let steps = match grid_stride {
            true => gpu_steps(vectors, MAX_GROUPS_PER_DIMENSION),
            false if vectors >= STRAIGHT_LINE_STEPS * WORKGROUP_SIZE as u64 * 16 => STRAIGHT_LINE_STEPS,
            false => 1,
        };
        let invocations = vectors.div_ceil(steps);
        // The GPU form with one vector per invocation has no loop: vector
        // `t`, adjacent lanes on adjacent vectors (`main` has returned
        // for `t` past the last). Otherwise a loop of `steps`:
        // consecutive, invocation `t` takes vectors `t * steps + q`;
        // grid-stride, step `q` of every invocation covers one contiguous
        // block, adjacent lanes on adjacent vectors.
        let looped = !grid_stride || steps > 1;
        let index = if grid_stride { format!("t + q * {invocations}u") } else { format!("t * {steps}u + q") };
        let ind = if looped { "        " } else { "    " };
        let lanes = width as usize;
        // Lane expressions of every value available in the loop body.
        let mut lane: HashMap<NodeId, Vec<String>> = HashMap::new();
        // Inlined reductions and what they read are value functions
        // (`reduction_prologue`), one call per element.
        let prologue = reduction_prologue(k, g);
        let reduced = |id: NodeId| matches!(g.node(id).op, Op::Reduce { .. });
        let per_lane = |id: NodeId| full(id) && !prologue.contains(&id) && !reduced(id);
        for &id in &k.inline {
            if !per_lane(id) {
                // Through `value_fn`: a node of no element (a concat over
                // an empty axis that an inlined reduction reads) is a stub,
                // never index math dividing by a literal 0u.
                self.value_fn(id)?;
            }
        }
        let mut b = String::new();
        for &id in k.inputs.iter().chain(&k.inline) {
            let used = k.inline.iter().any(|&u| per_lane(u) && g.node(u).inputs.contains(&id));
            if !full(id) && used {
                let _ = writeln!(b, "    let h{0} = n{0}(0u);", id.0);
                lane.insert(id, vec![format!("h{}", id.0); lanes]);
            }
        }
        if looped {
            let _ = writeln!(
                b,
                "    for (var q = 0u; q < {steps}u; q = q + 1u) {{\n        let j = {index};\n        if (j >= {vectors}u) {{\n            break;\n        }}"
            );
        } else {
            b.push_str("    let j = t;\n");
        }
        for (slot, &id) in k.inputs.iter().enumerate() {
            if !full(id) {
                continue;
            }
            let d = g.node(id).dtype;
            let _ = writeln!(b, "{ind}let x{} = {};", id.0, self.input(slot).load("j"));
            let vals = (0..lanes)
                .map(|c| {
                    let v = if width == 4 { format!("x{}.{}", id.0, LANES[c]) } else { format!("x{}", id.0) };
                    if d == DType::Bool {
                        format!("({v} != 0u)")
                    } else {
                        v
                    }
                })
                .collect();
            lane.insert(id, vals);
        }
        for &id in &k.inline {
            if !full(id) || prologue.contains(&id) {
                continue;
            }
            let node = g.node(id);
            let ops = &node.inputs;
            let d = |k: usize| g.node(ops[k]).dtype;
            if reduced(id) {
                // Element `j` of the line (width 1: see
                // `straight_line_width`).
                debug_assert_eq!(width, 1, "an inlined reduction is written one element per step");
                let _ = writeln!(b, "{ind}let r{0}_0 = n{0}(j);", id.0);
                lane.insert(id, vec![format!("r{}_0", id.0)]);
                continue;
            }
            let (params, expr) = match &node.op {
                Op::Reshape(_) | Op::Expand(_) => {
                    let v = lane[&ops[0]].clone();
                    lane.insert(id, v);
                    continue;
                }
                Op::Unary(u) => (format!("x: {}", ty(d(0))), self.unary(*u, d(0))?),
                Op::Cast(to) => (format!("x: {}", ty(d(0))), self.cast(d(0), *to)),
                Op::Binary(op) => (format!("a: {}, b: {}", ty(d(0)), ty(d(1))), self.binary(*op, d(0))?),
                Op::Where => (format!("c: bool, a: {}, b: {}", ty(d(1)), ty(d(2))), "select(b, a, c)".to_string()),
                Op::Parameter(_)
                | Op::Constant(..)
                | Op::ScalarParam(_)
                | Op::Iota { .. }
                | Op::Random { .. }
                | Op::Reduce { .. }
                | Op::ArgReduce { .. }
                | Op::CumSum { .. }
                | Op::Softmax { .. }
                | Op::MatMul
                | Op::Permute(_)
                | Op::Slice { .. }
                | Op::Concat { .. }
                | Op::Pad { .. }
                | Op::Gather { .. }
                | Op::ScatterAdd { .. }
                | Op::Conv2d(_)
                | Op::Pool(_)
                | Op::PoolGrad(_)
                | Op::Attention { .. }
                | Op::AllReduce { .. }
                | Op::Dequantize(_)
                | Op::QuantMatMul(_)
                | Op::WriteAt { .. }
                | Op::PrefixAttention => unreachable!("straight_line_width admits only elementwise ops"),
            };
            if self.defined.insert(('v', id.0)) {
                let _ =
                    writeln!(self.funcs, "fn v{}({params}) -> {} {{\n    return {expr};\n}}\n", id.0, ty(node.dtype));
            }
            let vals: Vec<String> = (0..lanes)
                .map(|c| {
                    let args: Vec<&str> = ops.iter().map(|o| lane[o][c].as_str()).collect();
                    let _ = writeln!(b, "{ind}let r{0}_{c} = v{0}({1});", id.0, args.join(", "));
                    format!("r{}_{c}", id.0)
                })
                .collect();
            lane.insert(id, vals);
        }
        for (slot, &o) in k.outputs.iter().enumerate() {
            let d = g.node(o).dtype;
            let vals: Vec<String> = lane[&o].iter().map(|v| store(d, v)).collect();
            let out = self.output(slot);
            if width == 4 {
                let _ = writeln!(
                    b,
                    "{ind}{}",
                    out.store("j", &format!("vec4<{}>({})", storage_reg_ty(d), vals.join(", ")))
                );
            } else {
                let _ = writeln!(b, "{ind}{}", out.store("j", &vals[0]));
            }
        }
        if looped {
            b.push_str("    }\n");
        }
        Ok((b, invocations))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the real limit, every vec4 kernel takes one vector per
    /// invocation, in one dimension up to 65535 workgroups and in two
    /// beyond; only past 65535 x 256 workgroups (the u32 invocation index)
    /// does a scalar-width kernel stride.
    #[test]
    fn gpu_form_takes_one_vector_per_invocation_while_the_grid_fits() {
        let m = MAX_GROUPS_PER_DIMENSION;
        let lanes = WORKGROUP_SIZE as u64;
        // W1: 4096 x 4096 f32, 2^22 vectors, 16384 workgroups in one row.
        assert_eq!(gpu_steps(1 << 22, m), 1);
        // 64M elements: one row of 65535 workgroups is just too small.
        assert_eq!(gpu_steps(m * lanes, m), 1);
        assert_eq!(gpu_steps(m * lanes + 1, m), 1);
        // The largest vec4 kernel (2^32 elements).
        assert_eq!(gpu_steps(1 << 30, m), 1);
        // Scalar width: 256 rows of 65535 workgroups fill the u32 index.
        let fit = m * lanes * 256;
        assert_eq!(fit, 4_294_901_760);
        assert_eq!(gpu_steps(fit, m), 1);
        assert_eq!(gpu_steps(fit + 1, m), 2);
        assert_eq!(gpu_steps(u32::MAX as u64, m), 2);
        assert_eq!(gpu_steps(1, m), 1);
        assert_eq!(gpu_steps(0, m), 1);
    }

    /// At a small limit the boundary is where the grid stops fitting: `m`
    /// workgroups per dimension hold `m * m` workgroups of invocations,
    /// one vector each; one vector more needs two steps, and the steps
    /// grow with the vectors so that `ceil(vectors / steps)` invocations
    /// always fit.
    #[test]
    fn gpu_form_strides_only_beyond_the_grid() {
        let lanes = WORKGROUP_SIZE as u64;
        for m in [1u64, 2, 3, 7, 64] {
            let cap = m * m * lanes;
            assert_eq!(gpu_steps(cap, m), 1, "m = {m}");
            assert_eq!(gpu_steps(cap + 1, m), 2, "m = {m}");
            assert_eq!(gpu_steps(2 * cap, m), 2, "m = {m}");
            assert_eq!(gpu_steps(2 * cap + 1, m), 3, "m = {m}");
            for vectors in [1, cap - 1, cap + 1, 5 * cap + 3, 1000 * cap] {
                let steps = gpu_steps(vectors, m);
                let groups = vectors.div_ceil(steps).div_ceil(lanes);
                assert!(groups <= m * m, "m = {m}, {vectors} vectors: {groups} workgroups");
                // The fewest steps: one fewer would not fit.
                if steps > 1 {
                    assert!(vectors.div_ceil(steps - 1).div_ceil(lanes) > m * m, "m = {m}, {vectors} vectors");
                }
            }
        }
        // A limit at or beyond the u32 index's 2^24 workgroups: one row.
        assert_eq!(gpu_steps(1 << 32, 1 << 24), 1);
        assert_eq!(gpu_steps((1 << 32) + 1, 1 << 30), 2);
    }
}
