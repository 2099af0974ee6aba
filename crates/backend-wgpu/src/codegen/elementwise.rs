//! Elementwise kernels in straight-line form: vec4 loads and stores, one
//! value function per node applied per lane (see [`straight_line_width`]).
//! The indexed form (one invocation per output index, views as index math)
//! is `Writer::main_body`'s `KernelKind::Elementwise` arm.

use super::common::*;
use super::{LowerError, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{DType, NodeId, Op, VerifiedGraph};
use std::collections::HashMap;
use std::fmt::Write as _;

/// Vectors each invocation of a large straight-line elementwise kernel
/// handles (consecutive ones: on lavapipe, fewer and longer invocations
/// beat one vector per invocation).
pub const STRAIGHT_LINE_STEPS: u64 = 16;

/// Vectors each invocation of a large grid-stride elementwise kernel
/// handles (the GPU form): enough to amortize the index math and keep
/// the dispatch one-dimensional, while at least
/// [`GRID_STRIDE_MIN_GROUPS`] workgroups keep every SM busy.
pub const GRID_STRIDE_STEPS: u64 = 4;

/// See [`GRID_STRIDE_STEPS`].
pub const GRID_STRIDE_MIN_GROUPS: u64 = 2048;

/// Whether elementwise kernel `k` can be written in straight-line form, and
/// with which vector width (4 when the element count allows, else 1): every
/// value is either full-size (read or computed at the output's own linear
/// index: elementwise ops over same-size operands, reshapes and no-op
/// expands) or a single element (broadcast, evaluated once). Anything with
/// index math (permutes, slices, pads, concats, iota, partial broadcasts)
/// keeps the indexed form.
pub fn straight_line_width(k: &Kernel, g: &VerifiedGraph) -> Option<u32> {
    if k.kind != KernelKind::Elementwise {
        return None;
    }
    let n = g.node(k.root()).shape.numel();
    if n <= 1 {
        return None;
    }
    let size_ok = |id: NodeId| matches!(g.node(id).shape.numel(), m if m == n || m == 1);
    if !k.inputs.iter().all(|&i| size_ok(i)) {
        return None;
    }
    for &id in &k.inline {
        let node = g.node(id);
        let m = node.shape.numel();
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
    Some(if n.is_multiple_of(4) { 4 } else { 1 })
}

impl Writer<'_> {
    /// Straight-line form of an elementwise kernel (see
    /// [`straight_line_width`]): every invocation handles up to
    /// [`STRAIGHT_LINE_STEPS`] consecutive vectors of `width` elements;
    /// full-size inputs are loaded once per vector, each node is one call
    /// of a value function per lane (`vK(operands) -> T`, the same
    /// expressions as the indexed form, so semantics are shared), and
    /// single-element nodes are evaluated once, before the loop. Returns
    /// the statements of `main` and the invocation count.
    pub(super) fn straight_line(&mut self, k: &Kernel, width: u32) -> Result<(String, u64), LowerError> {
        const LANES: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        let n = g.node(k.root()).shape.numel();
        let full = |id: NodeId| g.node(id).shape.numel() == n;
        let vectors = n as u64 / width as u64;
        let grid_stride = self.limits.forms.elementwise.grid_stride();
        let steps = match grid_stride {
            true if vectors >= GRID_STRIDE_STEPS * WORKGROUP_SIZE as u64 * GRID_STRIDE_MIN_GROUPS => GRID_STRIDE_STEPS,
            false if vectors >= STRAIGHT_LINE_STEPS * WORKGROUP_SIZE as u64 * 16 => STRAIGHT_LINE_STEPS,
            _ => 1,
        };
        let invocations = vectors.div_ceil(steps);
        // Consecutive: invocation `t` takes vectors `t * steps + q`.
        // Grid-stride: step `q` of every invocation covers one contiguous
        // block, adjacent lanes on adjacent vectors.
        let index = if grid_stride { format!("t + q * {invocations}u") } else { format!("t * {steps}u + q") };
        let lanes = width as usize;
        // Lane expressions of every value available in the loop body.
        let mut lane: HashMap<NodeId, Vec<String>> = HashMap::new();
        for &id in &k.inline {
            if !full(id) {
                self.node_fn(id, None)?;
            }
        }
        let mut b = String::new();
        for &id in k.inputs.iter().chain(&k.inline) {
            let used = k.inline.iter().any(|&u| full(u) && g.node(u).inputs.contains(&id));
            if !full(id) && used {
                let _ = writeln!(b, "    let h{0} = n{0}(0u);", id.0);
                lane.insert(id, vec![format!("h{}", id.0); lanes]);
            }
        }
        let _ = writeln!(
            b,
            "    for (var q = 0u; q < {steps}u; q = q + 1u) {{\n        let j = {index};\n        if (j >= {vectors}u) {{\n            break;\n        }}"
        );
        for (slot, &id) in k.inputs.iter().enumerate() {
            if !full(id) {
                continue;
            }
            let d = g.node(id).dtype;
            let _ = writeln!(b, "        let x{} = {}[j];", id.0, self.input_name(slot));
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
            if !full(id) {
                continue;
            }
            let node = g.node(id);
            let ops = &node.inputs;
            let d = |k: usize| g.node(ops[k]).dtype;
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
                | Op::Attention { .. } => unreachable!("straight_line_width admits only elementwise ops"),
            };
            if self.defined.insert(('v', id.0)) {
                let _ =
                    writeln!(self.funcs, "fn v{}({params}) -> {} {{\n    return {expr};\n}}\n", id.0, ty(node.dtype));
            }
            let vals: Vec<String> = (0..lanes)
                .map(|c| {
                    let args: Vec<&str> = ops.iter().map(|o| lane[o][c].as_str()).collect();
                    let _ = writeln!(b, "        let r{0}_{c} = v{0}({1});", id.0, args.join(", "));
                    format!("r{}_{c}", id.0)
                })
                .collect();
            lane.insert(id, vals);
        }
        for (slot, &o) in k.outputs.iter().enumerate() {
            let d = g.node(o).dtype;
            let vals: Vec<String> = lane[&o].iter().map(|v| store(d, v)).collect();
            let out = self.output_name(slot);
            if width == 4 {
                let _ = writeln!(b, "        {out}[j] = vec4<{}>({});", storage_ty(d), vals.join(", "));
            } else {
                let _ = writeln!(b, "        {out}[j] = {};", vals[0]);
            }
        }
        b.push_str("    }\n");
        Ok((b, invocations))
    }
}
