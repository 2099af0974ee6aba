//! Multi-tensor kernels ([`KernelKind::MultiTensor`]): independent
//! elementwise segments, one per output shape, in one dispatch.
//!
//! Each segment is written exactly as an elementwise kernel of its own
//! would be (straight-line vec4 form where [`straight_line_width`] allows,
//! else the indexed form; the GPU or software form the limits pick), as a
//! function `sK(t)` of a segment-local invocation index, and `main` finds
//! the segment of its global index by offset with a binary search over
//! the segment starts. Segments start at multiples of [`SEGMENT_ALIGN`]
//! invocations, so no subgroup of a GPU straddles two segments, and
//! adjacent invocations of a segment touch adjacent elements, as in the
//! single kernel. Segments of no element get no invocations and no code
//! (their index math would divide by zero). In a kernel generic over
//! sizes the starts are `let`s computed from the segment sizes in `main`,
//! so a size that changes moves them without compiling again.
//!
//! Bindings: the kernel's inputs in order, then its outputs (segment by
//! segment). An input read as whole vectors by some segment is bound as
//! `vec4` and read element-wise elsewhere through `[i >> 2u][i & 3u]`.
//! Nodes shared by segments (lifted scalars, constants) get one value
//! function.

use super::common::*;
use super::{straight_line_width, Bindings, LowerError, LowerLimits, Wgsl, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{DType, NodeId, VerifiedGraph};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

/// Invocations a segment's start is aligned to: a multiple of every GPU's
/// subgroup width (32 or 64 lanes), so the branch to a segment is uniform
/// within a subgroup.
pub const SEGMENT_ALIGN: u64 = 64;

/// The bindings of a segment inside its multi-tensor kernel.
pub(super) struct Slots {
    /// The binding index (`inK`) of each of the segment's inputs.
    inputs: Vec<usize>,
    /// The binding index (`outK`) of the segment's first output; the others
    /// follow.
    out_base: usize,
}

impl Slots {
    /// The kernel's input binding of the segment's input `k`.
    pub(super) fn input(&self, k: usize) -> usize {
        self.inputs[k]
    }

    /// The kernel's output binding of the segment's first output.
    pub(super) fn out_base(&self) -> usize {
        self.out_base
    }
}

/// A segment with its form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Part {
    kernel: Kernel,
    /// Straight-line vector width, `None` for the indexed form.
    width: Option<u32>,
    numel: usize,
    out_base: usize,
}

/// How a multi-tensor kernel is written, decided by the schedule (see
/// [`super::Schedule`]): its segments with their forms, the inputs some
/// segment loads as whole vectors (bound as `vec4`) and the inputs some
/// segment reads through a value function.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultiPlan {
    parts: Vec<Part>,
    pub(super) vector_in: BTreeSet<NodeId>,
    accessed: BTreeSet<NodeId>,
}

impl MultiPlan {
    /// The plan of multi-tensor kernel `kernel` of `g` under `limits`.
    pub(super) fn new(kernel: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> MultiPlan {
        let generic = limits.generic;
        let numel = |id: NodeId| g.node(id).shape.numel();
        let mut parts = Vec::new();
        let mut out_base = 0;
        for seg in kernel.segments(g) {
            debug_assert_eq!(seg.kind, KernelKind::Elementwise);
            let width = straight_line_width(&seg, g).map(|w| if generic { 1 } else { w });
            let n = numel(seg.root());
            let outputs = seg.outputs.len();
            parts.push(Part { kernel: seg, width, numel: n, out_base });
            out_base += outputs;
        }
        debug_assert_eq!(out_base, kernel.outputs.len(), "segments hold every output once, in order");
        // Inputs some segment loads as whole vectors, and inputs some
        // segment reads through a value function.
        let mut vector_in = BTreeSet::new();
        let mut accessed = BTreeSet::new();
        for p in parts.iter().filter(|p| p.numel > 0) {
            for &id in &p.kernel.inputs {
                match p.width {
                    Some(w) if numel(id) == p.numel => {
                        if w == 4 {
                            vector_in.insert(id);
                        }
                    }
                    _ => {
                        accessed.insert(id);
                    }
                }
            }
        }
        MultiPlan { parts, vector_in, accessed }
    }

    /// The kernel's storage bindings: its inputs (vec4 where some segment
    /// loads whole vectors), then its outputs segment by segment (vec4
    /// where the segment is written in vec4).
    pub(super) fn bindings(
        &self,
        kernel: &Kernel,
        g: &VerifiedGraph,
        limits: &LowerLimits,
    ) -> Result<Bindings, LowerError> {
        let tensor = |name: String, id: NodeId, vec4: bool, writable: bool| {
            super::schedule::tensor_binding(g, limits, (name, storage_ty(g.node(id).dtype), id), vec4, writable)
        };
        let inputs = kernel
            .inputs
            .iter()
            .enumerate()
            .map(|(k, &id)| tensor(format!("in{k}"), id, self.vector_in.contains(&id), false))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outputs = Vec::new();
        for p in &self.parts {
            for (j, &id) in p.kernel.outputs.iter().enumerate() {
                outputs.push(tensor(format!("out{}", p.out_base + j), id, p.width == Some(4) && p.numel > 0, true)?);
            }
        }
        Ok(Bindings { inputs, scratch: None, outputs, error_slot: false })
    }
}

impl Writer<'_> {
    /// Lowers a multi-tensor kernel (see the module doc).
    pub(super) fn multi_tensor(mut self, kernel: &Kernel) -> Result<Wgsl, LowerError> {
        let g = self.g;
        let generic = self.limits.generic;
        let sched = self.s;
        let MultiPlan { parts, vector_in, accessed } = sched.multi();
        let slot: HashMap<NodeId, usize> = kernel.inputs.iter().enumerate().map(|(k, &id)| (id, k)).collect();
        for &id in accessed {
            let k = slot[&id];
            let d = g.node(id).dtype;
            let input = &sched.main.inputs[k];
            let raw =
                if vector_in.contains(&id) { format!("{}[i & 3u]", input.load("i >> 2u")) } else { input.load("i") };
            let load = if d == DType::Bool { format!("{raw} != 0u") } else { raw };
            self.defined.insert(('n', id.0));
            let _ = writeln!(self.funcs, "fn n{}(i: u32) -> {} {{\n    return {load};\n}}\n", id.0, ty(d));
        }
        // One function per segment with elements, and its invocations.
        let mut segment_fns = String::new();
        // Segment starts as WGSL (`64u`; in a kernel generic over sizes a
        // `let` computed from the previous segment's size, so the sizes
        // are the literals that vary, not their aligned sums).
        let mut starts: Vec<(String, usize)> = Vec::new();
        let mut start_lets = String::new();
        let mut last: Option<(String, u64)> = None;
        let mut total = 0u64;
        for (s, p) in parts.iter().enumerate() {
            if p.numel == 0 {
                continue;
            }
            self.slots =
                Some(Slots { inputs: p.kernel.inputs.iter().map(|id| slot[id]).collect(), out_base: p.out_base });
            let (body, invocations) = match p.width {
                Some(width) => self.straight_line(&p.kernel, width)?,
                None => {
                    for &id in &p.kernel.inline {
                        self.value_fn(id)?;
                    }
                    self.main_body(&p.kernel)?
                }
            };
            self.slots = None;
            let start = total.next_multiple_of(SEGMENT_ALIGN);
            total = start + invocations;
            let at = if generic {
                let expr = match &last {
                    None => "0u".to_string(),
                    Some((prev, n)) => {
                        format!("({prev} + {n}u + {}u) / {SEGMENT_ALIGN}u * {SEGMENT_ALIGN}u", SEGMENT_ALIGN - 1)
                    }
                };
                let _ = writeln!(start_lets, "    let b{s} = {expr};");
                format!("b{s}")
            } else {
                format!("{start}u")
            };
            last = Some((at.clone(), invocations));
            starts.push((at, s));
            let _ = write!(
                segment_fns,
                "fn s{s}(t: u32) {{\n    if (t >= {invocations}u) {{\n        return;\n    }}\n{body}}}\n\n"
            );
        }
        // Assemble.
        let bindings = &sched.main;
        let mut src = String::from(super::enables(super::Entry::PerIndex, bindings));
        src.push_str("// generated by lazuli-wgpu (multi-tensor)\n");
        src.push_str(&super::params_header(g, &self.scalars));
        src.push_str(&bindings.declare_inputs());
        src.push_str(&bindings.declare_rest());
        src.push_str(&bindings.helpers());
        src.push('\n');
        for h in &self.helpers {
            src.push_str(h.source());
            src.push('\n');
        }
        src.push_str(&self.funcs);
        src.push_str(&segment_fns);
        let _ = write!(
            src,
            "@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    let t = gid.x + gid.y * nwg.x * {WORKGROUP_SIZE}u;\n{start_lets}    if (t >= {}) {{\n        return;\n    }}\n{}}}\n",
            match &last {
                Some((at, n)) if generic => format!("{at} + {n}u"),
                _ => format!("{total}u"),
            },
            dispatch_tree(&starts, 1)
        );
        let (inputs, outputs) = bindings.counts();
        Ok(Wgsl {
            source: src,
            entry: "main",
            invocations: total,
            inputs,
            outputs,
            workgroup_size: WORKGROUP_SIZE,
            pre: None,
            scratch: 0,
            trusted: false,
            error_slot: false,
            binds_inputs: false,
            generic_form: false,
            scalars: self.scalars.clone(),
        })
    }
}

/// Statements calling the segment of `t` among `starts` (segment start,
/// segment index; ascending): a binary search over the starts, so a
/// kernel of many segments costs a few comparisons per invocation.
fn dispatch_tree(starts: &[(String, usize)], depth: usize) -> String {
    let pad = "    ".repeat(depth);
    match starts {
        [] => String::new(),
        [(start, s)] => format!("{pad}s{s}(t - {start});\n"),
        _ => {
            let mid = starts.len() / 2;
            format!(
                "{pad}if (t < {}) {{\n{}{pad}}} else {{\n{}{pad}}}\n",
                starts[mid].0,
                dispatch_tree(&starts[..mid], depth + 1),
                dispatch_tree(&starts[mid..], depth + 1)
            )
        }
    }
}
