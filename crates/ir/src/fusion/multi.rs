//! Multi-tensor (horizontal) kernels: independent elementwise kernels of
//! any shapes joined into one dispatch, as PyTorch's fused/foreach
//! optimizers update every parameter in one kernel. A training step ends
//! with one small elementwise update per parameter tensor (and the moment
//! buffers of Adam beside it); dispatching each alone costs a launch per
//! tensor and leaves a GPU mostly idle, since each is tiny.
//!
//! A [`KernelKind::MultiTensor`] kernel is an ordinary [`Kernel`] whose
//! outputs are grouped by shape, contiguous per shape, the group lengths
//! recorded ([`Kernel::segment_lens`]; a size variant keeps apart shapes
//! equal only at its sizes, see `plan_sized_like`): each group is a
//! *segment* ([`Kernel::segments`]), evaluated exactly as an
//! [`KernelKind::Elementwise`] kernel over its own shape would be. A
//! backend lays the segments' invocations end to end and each invocation
//! finds its segment by offset, so within a segment adjacent invocations
//! still touch adjacent elements.
//!
//! The pass (`merge`) is generic: it joins any two elementwise or
//! multi-tensor kernels that do not depend on each other, whatever they
//! compute, when the joined kernel binds at most the buffer limit (a
//! value beyond one binding counting once per window, as everywhere in
//! the planner) and covers at most [`MAX_JOINED_ELEMENTS`] elements. A kernel
//! moves later (to its partner's place) when nothing in between reads what
//! it writes, or its partner moves earlier when nothing in between writes
//! what the partner reads; every other kernel keeps its place, so the plan
//! stays a valid order. Segments of one shape share an iteration (what
//! `merge_siblings` does for kernels of one shape); a joined kernel of a
//! single shape stays an elementwise kernel.
//!
//! Other kernel kinds (reductions, matmul, row kernels, attention parts,
//! and the gathers and scatter-adds whose error slot is a binding of its
//! own) do not join:
//! a segment is an elementwise evaluation, one invocation range per output
//! shape. A kind can join once its lowering can run as a function of a
//! segment-local invocation index with no workgroup barrier (or with
//! segments aligned to whole workgroups) and the planner knows its
//! invocation count; see the backend's multi-tensor lowering.

use super::{Budget, Kernel, KernelKind};
use crate::{Graph, NodeId, Shape};
use std::collections::BTreeSet;

/// Most elements a joined kernel covers, over all its segments (each
/// output shape once). A backend lays the segments' invocations end to end
/// and indexes them with 32 bits; each form runs at most one invocation
/// per element, so this leaves room for the alignment of every segment.
pub const MAX_JOINED_ELEMENTS: u64 = 1 << 31;

impl Kernel {
    /// The segments of this kernel, each an elementwise kernel over one
    /// output shape: for a [`KernelKind::MultiTensor`] kernel its outputs
    /// in the groups the planner made ([`Kernel::segment_lens`], else
    /// grouped by shape, in order), each with the inlined nodes and
    /// inputs its outputs reach; for any other kernel the kernel itself.
    pub fn segments(&self, graph: &Graph) -> Vec<Kernel> {
        if self.kind != KernelKind::MultiTensor {
            return vec![self.clone()];
        }
        let inline: BTreeSet<NodeId> = self.inline.iter().copied().collect();
        let inputs: BTreeSet<NodeId> = self.inputs.iter().copied().collect();
        let groups = if self.segment_lens.is_empty() {
            group_by_shape(graph, &self.outputs, None)
        } else {
            let mut rest = &self.outputs[..];
            let mut groups = Vec::with_capacity(self.segment_lens.len());
            for &len in &self.segment_lens {
                let (group, after) = rest.split_at(len);
                groups.push(group.to_vec());
                rest = after;
            }
            debug_assert!(rest.is_empty(), "segment lengths cover every output");
            groups
        };
        let mut out = Vec::new();
        for outputs in groups {
            let mut members = BTreeSet::new();
            let mut ins = BTreeSet::new();
            let mut stack: Vec<NodeId> = Vec::new();
            for &o in &outputs {
                if inline.contains(&o) && members.insert(o) {
                    stack.push(o);
                }
            }
            while let Some(x) = stack.pop() {
                for &op in &graph.node(x).inputs {
                    if inline.contains(&op) {
                        if members.insert(op) {
                            stack.push(op);
                        }
                    } else {
                        debug_assert!(inputs.contains(&op), "operand {op} of {x} is neither inlined nor an input");
                        ins.insert(op);
                    }
                }
            }
            out.push(Kernel {
                kind: KernelKind::Elementwise,
                outputs,
                inputs: ins.into_iter().collect(),
                inline: members.into_iter().collect(),
                segment_lens: Vec::new(),
            });
        }
        out
    }
}

/// `outputs` grouped by shape, groups in order of first appearance and
/// each group in the given order. With `earlier` (a size variant's graph
/// at the sizes before, aligned node for node), outputs of one shape
/// share a group only where their shapes were equal there too: shapes
/// equal only at these sizes keep their own segments, so the kernel
/// keeps the structure it has at other sizes.
fn group_by_shape(graph: &Graph, outputs: &[NodeId], earlier: Option<&Graph>) -> Vec<Vec<NodeId>> {
    let mut groups: Vec<(&Shape, Option<&Shape>, Vec<NodeId>)> = Vec::new();
    for &o in outputs {
        let shape = &graph.node(o).shape;
        let before = earlier.map(|e| &e.node(o).shape);
        match groups.iter_mut().find(|(s, b, _)| *s == shape && *b == before) {
            Some((_, _, v)) => v.push(o),
            None => groups.push((shape, before, vec![o])),
        }
    }
    groups.into_iter().map(|(_, _, v)| v).collect()
}

/// Whether kernel `k` may join a multi-tensor kernel. None of these kinds
/// checks indices, so a joined kernel binds no error slot. A kernel with
/// an inlined reduction (`FusionLimits::inline_reductions`) joins only
/// with `reductions` (`FusionLimits::join_inlined_reductions`): on
/// lavapipe such a segment made the demo's multi-tensor update 3.5x
/// slower (BENCHMARKS.md, "Small reductions inside their consumers"),
/// while apart it is faster than the reduction and update it replaces.
fn joinable(graph: &Graph, k: &Kernel, reductions: bool) -> bool {
    let ok = matches!(k.kind, KernelKind::Elementwise | KernelKind::MultiTensor)
        && (reductions || !super::inlines_reduction(graph, k));
    debug_assert!(!(ok && k.kind.checks_indices()));
    ok
}

/// `a` and `b` as one kernel: outputs grouped by shape (segments
/// contiguous, their lengths recorded; `earlier`: see
/// [`group_by_shape`]), inputs and inlined nodes united.
fn join(graph: &Graph, a: &Kernel, b: &Kernel, earlier: Option<&Graph>) -> Kernel {
    let all: Vec<NodeId> = a.outputs.iter().chain(&b.outputs).copied().collect();
    let groups = group_by_shape(graph, &all, earlier);
    let kind = if groups.len() > 1 { KernelKind::MultiTensor } else { KernelKind::Elementwise };
    let inputs: BTreeSet<NodeId> = a.inputs.iter().chain(&b.inputs).copied().collect();
    let inline: BTreeSet<NodeId> = a.inline.iter().chain(&b.inline).copied().collect();
    let segment_lens = if kind == KernelKind::MultiTensor { groups.iter().map(Vec::len).collect() } else { Vec::new() };
    Kernel {
        kind,
        outputs: groups.into_iter().flatten().collect(),
        inputs: inputs.into_iter().collect(),
        inline: inline.into_iter().collect(),
        segment_lens,
    }
}

/// Whether `a` and `b` joined fit one kernel: its storage bindings within
/// `max` (windows counted) and its elements within
/// [`MAX_JOINED_ELEMENTS`].
fn joined_fits(graph: &Graph, a: &Kernel, b: &Kernel, max: &Budget, earlier: Option<&Graph>) -> bool {
    let inputs: BTreeSet<NodeId> = a.inputs.iter().chain(&b.inputs).copied().collect();
    if !max.fits(inputs.iter().chain(&a.outputs).chain(&b.outputs)) {
        return false;
    }
    let all: Vec<NodeId> = a.outputs.iter().chain(&b.outputs).copied().collect();
    let elements =
        group_by_shape(graph, &all, earlier).iter().map(|g| graph.node(g[0]).shape.numel() as u64).sum::<u64>();
    elements <= MAX_JOINED_ELEMENTS
}

/// Joins independent elementwise kernels of `kernels` (in execution order)
/// into multi-tensor kernels that fit `max` each (see the module doc). Greedy and deterministic: each kernel, in order,
/// joins the first later kernel it can move to (when nothing in between
/// reads its outputs), or pulls later kernels to its own place (when
/// nothing from its place on writes their inputs), until neither is
/// possible. Kernels with inlined reductions join only with `reductions`
/// (see [`joinable`]).
pub(super) fn merge(
    graph: &Graph,
    kernels: Vec<Kernel>,
    max: &Budget,
    earlier: Option<&Graph>,
    reductions: bool,
) -> Vec<Kernel> {
    let mut ks: Vec<Option<Kernel>> = kernels.into_iter().map(Some).collect();
    // The kernel writing each node, by position in `ks` (kept up to date
    // as kernels move).
    let mut writer: Vec<Option<usize>> = vec![None; graph.len()];
    for (c, k) in ks.iter().enumerate() {
        for o in k.iter().flat_map(|k| &k.outputs) {
            writer[o.index()] = Some(c);
        }
    }
    // The first kernel after `a` reading an output of the kernel at `a`.
    let first_reader = |ks: &[Option<Kernel>], a: usize| -> usize {
        let Some(ka) = &ks[a] else { return ks.len() };
        let outs: BTreeSet<NodeId> = ka.outputs.iter().copied().collect();
        (a + 1..ks.len())
            .find(|&c| ks[c].as_ref().is_some_and(|kc| kc.inputs.iter().any(|x| outs.contains(x))))
            .unwrap_or(ks.len())
    };
    for a in 0..ks.len() {
        if !ks[a].as_ref().is_some_and(|k| joinable(graph, k, reductions)) {
            continue;
        }
        let mut reader = first_reader(&ks, a);
        let mut b = a + 1;
        while b < ks.len() {
            let (Some(ka), Some(kb)) = (&ks[a], &ks[b]) else {
                b += 1;
                continue;
            };
            if !joinable(graph, kb, reductions) || !joined_fits(graph, ka, kb, max, earlier) {
                b += 1;
                continue;
            }
            // Move `a` to `b`: nothing in (a, b] reads what `a` writes
            // (`b` itself included: then they depend on each other).
            if b < reader {
                let joined = join(graph, ka, kb, earlier);
                for o in &joined.outputs {
                    writer[o.index()] = Some(b);
                }
                ks[b] = Some(joined);
                ks[a] = None;
                break;
            }
            // Move `b` to `a`: nothing in [a, b) writes what `b` reads.
            let last_writer = kb.inputs.iter().filter_map(|x| writer[x.index()]).filter(|&c| c < b).max();
            if last_writer.is_none_or(|c| c < a) {
                let joined = join(graph, ka, kb, earlier);
                for o in &joined.outputs {
                    writer[o.index()] = Some(a);
                }
                ks[a] = Some(joined);
                ks[b] = None;
                reader = first_reader(&ks, a);
            }
            b += 1;
        }
    }
    ks.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::super::{plan, FusionLimits, FusionPlan};
    use super::*;
    use crate::{BinaryOp, DType, Op, UnaryOp, ValueType};

    fn limits(max: usize) -> FusionLimits {
        FusionLimits { max_storage_buffers: max, multi_tensor: true, ..FusionLimits::default() }
    }

    /// `n` SGD-like updates `p - g * lr` of different shapes.
    fn updates(shapes: &[&[usize]]) -> (Graph, Vec<NodeId>) {
        let mut g = Graph::new();
        let lr = g.scalar(DType::F32);
        let mut outs = Vec::new();
        for s in shapes {
            let p = g.param(ValueType::new(s.to_vec(), DType::F32));
            let gr = g.param(ValueType::new(s.to_vec(), DType::F32));
            let step = g.push(Op::Binary(BinaryOp::Mul), &[gr, lr]).unwrap();
            let y = g.push(Op::Binary(BinaryOp::Sub), &[p, step]).unwrap();
            g.outputs.push(y);
            outs.push(y);
        }
        (g, outs)
    }

    #[test]
    fn a_size_variant_keeps_shapes_equal_only_at_its_sizes_in_segments_of_their_own() {
        use super::super::plan_sized_like;
        // Updates of [t, 8] and [t, t]: one shape at t = 8.
        let at = |t: usize| updates(&[&[t, 8], &[t, t], &[3]]).0;
        let (now, before) = (at(8), at(7));
        let alone = plan(&now, &limits(16));
        assert_eq!(alone.kernels.len(), 1, "{}", alone.to_text());
        assert_eq!(alone.kernels[0].segments(&now).len(), 2, "[8, 8] twice is one segment");
        let kept = plan_sized_like(&now, &limits(16), Some(&before));
        let k = &kept.kernels[0];
        assert_eq!((kept.kernels.len(), k.kind), (1, KernelKind::MultiTensor), "{}", kept.to_text());
        assert_eq!(k.segment_lens, [1, 1, 1]);
        let segments = k.segments(&now);
        assert_eq!(segments.iter().map(|s| s.outputs.len()).collect::<Vec<_>>(), [1, 1, 1]);
        // The same segments as at the sizes before.
        let earlier = plan(&before, &limits(16));
        assert_eq!(earlier.kernels[0].segment_lens, k.segment_lens);
        assert_eq!(earlier.kernels[0].outputs, k.outputs);
        check(&now, &kept, 16);
    }

    fn check(g: &Graph, p: &FusionPlan, max: usize) {
        let mut written = BTreeSet::new();
        for k in &p.kernels {
            assert!(k.storage_buffers() <= max, "{}", p.to_text());
            // Every input is a parameter or written by an earlier kernel.
            for x in &k.inputs {
                assert!(
                    matches!(g.node(*x).op, Op::Parameter(_)) || written.contains(x),
                    "{x} read before it is written:\n{}",
                    p.to_text()
                );
            }
            written.extend(k.outputs.iter().copied());
        }
        for o in &g.outputs {
            assert!(written.contains(o), "{o} never written:\n{}", p.to_text());
        }
    }

    #[test]
    fn independent_updates_of_any_shape_are_one_kernel() {
        let shapes: [&[usize]; 6] = [&[64, 64], &[64], &[192, 64], &[7], &[0], &[3, 5]];
        let (g, outs) = updates(&shapes);
        let p = plan(&g, &limits(64));
        assert_eq!(p.kernels.len(), 1, "{}", p.to_text());
        let k = &p.kernels[0];
        assert_eq!(k.kind, KernelKind::MultiTensor);
        let segs = k.segments(&g);
        assert_eq!(segs.len(), 6);
        for (s, o) in segs.iter().zip(&outs) {
            assert_eq!(s.outputs, vec![*o]);
            assert_eq!(s.inputs.len(), 2, "{s:?}");
            assert_eq!(s.kind, KernelKind::Elementwise);
        }
        check(&g, &p, 64);
        // Off: one kernel per shape.
        assert_eq!(plan(&g, &FusionLimits { max_storage_buffers: 64, ..FusionLimits::default() }).kernels.len(), 6);
        // Deterministic.
        assert_eq!(p, plan(&g, &limits(64)));
    }

    #[test]
    fn splits_only_at_the_buffer_limit() {
        let shapes: [&[usize]; 7] = [&[4, 4], &[5], &[6, 2], &[9], &[1], &[2, 2, 2], &[11]];
        let (g, _) = updates(&shapes);
        // Three buffers per update.
        for (max, kernels) in [(3, 7), (5, 7), (6, 4), (7, 4), (9, 3), (21, 1)] {
            let p = plan(&g, &limits(max));
            assert_eq!(p.kernels.len(), kernels, "max {max}:\n{}", p.to_text());
            check(&g, &p, max);
        }
    }

    /// Windows count against the limit as in every other kernel: with
    /// windows of 40 elements, the update of 100 elements binds 9 windows
    /// (3 per value) and joins only one 3-binding update within 12.
    #[test]
    fn windowed_values_count_once_per_window() {
        let shapes: [&[usize]; 3] = [&[100], &[5], &[6]];
        let (g, _) = updates(&shapes);
        assert_eq!(plan(&g, &limits(12)).kernels.len(), 1);
        let windowed = FusionLimits { window_elements: 40, ..limits(12) };
        let p = plan(&g, &windowed);
        assert_eq!(p.kernels.len(), 2, "{}", p.to_text());
        let budget = Budget { graph: &g, max: 12, window: 40 };
        for k in &p.kernels {
            assert!(budget.fits_kernel(k), "{}", p.to_text());
        }
        check(&g, &p, 12);
    }

    /// A joined kernel covers at most `MAX_JOINED_ELEMENTS` elements, so
    /// its invocations stay u32-indexable.
    #[test]
    fn joined_elements_are_bounded() {
        let shapes: [&[usize]; 3] = [&[1 << 30], &[1 << 15, 1 << 15], &[1 << 29, 2]];
        let (g, _) = updates(&shapes);
        let p = plan(&g, &limits(64));
        assert_eq!(p.kernels.len(), 2, "{}", p.to_text());
        for k in &p.kernels {
            let elements: u64 = k.segments(&g).iter().map(|s| g.node(s.root()).shape.numel() as u64).sum();
            assert!(elements <= MAX_JOINED_ELEMENTS, "{}", p.to_text());
        }
    }

    #[test]
    fn dependent_kernels_keep_their_order() {
        // a = exp(x) (shape [8]) is read by a reduction, whose result feeds
        // b = y * s (shape [3]); c = z + 1 (shape [5]) is independent.
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8], DType::F32));
        let y = g.param(ValueType::new([3], DType::F32));
        let z = g.param(ValueType::new([5], DType::F32));
        let a = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let s = g.push(Op::Reduce { op: crate::ReduceOp::Sum, axes: vec![0], keepdim: false }, &[a]).unwrap();
        let b = g.push(Op::Binary(BinaryOp::Mul), &[y, s]).unwrap();
        let one = g.scalar(DType::F32);
        let c = g.push(Op::Binary(BinaryOp::Add), &[z, one]).unwrap();
        let a2 = g.push(Op::Unary(UnaryOp::Neg), &[a]).unwrap();
        g.outputs.extend([a2, b, c]);
        let p = plan(&g, &limits(16));
        check(&g, &p, 16);
        // exp (with c pulled in), the reduction, then neg(a) and b together.
        assert_eq!(p.kernels.len(), 3, "{}", p.to_text());
        assert!(p.kernels.iter().any(|k| k.kind == KernelKind::Reduce));
        let reduce_at = p.kernels.iter().position(|k| k.kind == KernelKind::Reduce).unwrap();
        assert!(p.kernels[..reduce_at].iter().any(|k| k.outputs.contains(&a)), "{}", p.to_text());
        assert!(p.kernels[reduce_at + 1..].iter().any(|k| k.outputs.contains(&b)), "{}", p.to_text());
    }
}
