//! The schedule of one kernel: every decision its lowering takes, made
//! once, as a value, before any text is written.
//!
//! [`schedule`] reads a planned kernel and the limits and decides how the
//! kernel is written: its family's plan (the matmul's product, concrete
//! form and operand layouts, a reduction's passes, a row kernel's lanes,
//! the attention tile, ...), which bindings are vec4, how `main` is
//! entered (an invocation per index, a cooperative workgroup, a workgroup
//! of given lanes, the subgroup and cooperative-matrix builtins), whether
//! the kernel runs in two passes and what the first writes, whether its
//! indices are proven in bounds (`trusted`) and whether it binds an error
//! slot. [`super::lower_scheduled`] then only writes text from it.
//!
//! The compile side decides from the schedule too, before lowering: the
//! autotuner keys a product by its problem ([`Schedule::tuning_key`]) and
//! times the schedule's alternatives ([`Schedule::candidate_forms`]); the
//! split-K binding check counts the schedule's bindings. A matmul's form
//! is decided here and nowhere else (`matmul::resolve_form` has this one
//! caller).
//!
//! Rejected alternative: lowering with given limits and reading decisions
//! back from the generated source or from flags the families set on the
//! writer as they write (what the compiler did before): every question
//! the compile side asked (the tuner's key, the bindings of a split) cost
//! a lowering, and the assembler depended on side effects of the body.

use super::attention::AttnPlan;
use super::common::{is_half, storage_ty};
use super::conv::{conv_plan, ConvPlan};
use super::matmul::MatmulPlan;
use super::quant::{QuantKind, QuantPlan};
use super::reduce::{acc_ty, reduce_plan, ReducePlan};
use super::rows::{rows_layout, RowsLayout, SoftmaxPlan};
use super::{
    check_lowerable, multi, straight_line_width, Binding, Bindings, KernelForms, LowerError, LowerLimits, MatmulForm,
    ScatterForm, WORKGROUP_SIZE,
};
use crate::codegen::window::KernelWindows;
use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{NodeId, Op, VerifiedGraph};

/// Every decision of one kernel's lowering (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The limits it was decided under.
    pub limits: LowerLimits,
    /// The family's plan.
    pub family: Family,
    /// The kernel has no output element (and checks no index): it is
    /// never dispatched and its body is empty.
    pub empty: bool,
    /// Per kernel input, in order: bound as `vec4` in the kernel proper
    /// (its first pass where it has two).
    pub vector_inputs: Vec<bool>,
    /// Per kernel input: read in `main` by the straight-line or vector-row
    /// code, so no value function reads it.
    pub in_main: Vec<bool>,
    /// The outputs are bound as `vec4`.
    pub vector_outputs: bool,
    /// How `main` is entered.
    pub entry: Entry,
    /// One pass, or two (see [`Passes`]).
    pub passes: Passes,
    /// Every index of the source is proven in bounds (see
    /// `super::Wgsl::trusted`).
    pub trusted: bool,
    /// The kernel checks indices and binds an error slot (see
    /// [`super::index`]).
    pub error_slot: bool,
    /// The storage bindings of the pass the family's body writes first
    /// (the kernel, or its first pass where it has two), with their
    /// storage: native, half-precision or windowed (see [`super::access`]).
    pub main: Bindings,
    /// The storage bindings of the kernel proper where a first pass runs
    /// before it.
    pub second: Option<Bindings>,
}

/// A kernel family's plan (the part of the schedule its writer reads).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Family {
    /// Straight-line elementwise code of `width` lanes per vector (see
    /// [`straight_line_width`]).
    Straight {
        /// 4 (vec4) or 1.
        width: u32,
    },
    /// A multi-tensor kernel (see [`multi`]).
    Multi(multi::MultiPlan),
    /// Code per output index with no decision of its own: indexed
    /// elementwise kernels, concat parts, random numbers,
    /// arg-reductions, cumulative sums, gathers, pooling.
    Indexed,
    /// A reduction.
    Reduce(ReducePlan),
    /// A softmax.
    Softmax(SoftmaxPlan),
    /// A fused row kernel.
    Rows(RowsLayout),
    /// A matmul.
    Matmul(MatmulPlan),
    /// A scatter-add in the limits' form.
    Scatter(ScatterForm),
    /// Fused attention.
    Attention(AttnPlan),
    /// A convolution.
    Conv(ConvPlan),
    /// A quantized weight's dequantization or product (see
    /// [`super::quant`]).
    Quant(QuantPlan),
}

/// How a kernel's `main` is entered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// One invocation per index `t` below the invocation count, returning
    /// early past it (workgroups of [`WORKGROUP_SIZE`]).
    PerIndex,
    /// A cooperative kernel of [`WORKGROUP_SIZE`] invocations with the
    /// workgroup array `red` of element type `red`; no early return, so
    /// every barrier stays uniform. With `subgroups` `main` takes the
    /// subgroup builtins (row kernels combining lanes by shuffles, see
    /// [`super::rows`]).
    Cooperative {
        /// `red`'s element type.
        red: &'static str,
        /// `main` takes the subgroup builtins.
        subgroups: bool,
    },
    /// Written per workgroup of `lanes` invocations (`lid`, `wid`, `nwg`;
    /// the body defines `t`). With `cooperative_matrix` the source enables
    /// f16 and `wgpu_cooperative_matrix` and `main` takes the subgroup id
    /// and lane builtins (the tensor-core matmul, see [`super::coop`]).
    Workgroup {
        /// Invocations per workgroup.
        lanes: u32,
        /// The cooperative-matrix matmul.
        cooperative_matrix: bool,
    },
}

impl Entry {
    /// Invocations per workgroup.
    pub fn workgroup_size(self) -> u32 {
        match self {
            Entry::PerIndex | Entry::Cooperative { .. } => WORKGROUP_SIZE,
            Entry::Workgroup { lanes, .. } => lanes,
        }
    }
}

/// Whether a kernel runs in one pass or two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passes {
    /// One kernel.
    One,
    /// A first pass writes `parts` partials of element type `acc` per
    /// output to scratch, which the kernel proper (the second pass)
    /// reads as its only input, combining them with a group of lanes per
    /// output and storing outputs of type `out`: long reductions with few
    /// outputs and split column reductions (see [`super::reduce`]), split
    /// convolutions (see [`super::conv`]).
    Partials {
        /// Partials per output.
        parts: u64,
        /// Element type of the partials.
        acc: &'static str,
        /// Element type of the second pass's output binding.
        out: &'static str,
    },
    /// A split-K matmul: the first pass writes `parts` ranges' partial
    /// products (f32) to scratch, the second sums them through the
    /// epilogue, binding the kernel's inputs too (see
    /// `super::Wgsl::binds_inputs`).
    SplitK {
        /// Ranges of K.
        parts: u64,
    },
}

impl Passes {
    /// Whether a first pass runs before the kernel proper.
    pub fn two(self) -> bool {
        !matches!(self, Passes::One)
    }

    /// Whether the kernel proper binds the kernel's inputs besides the
    /// scratch (split-K's epilogue reads them).
    pub fn binds_inputs(self) -> bool {
        matches!(self, Passes::SplitK { .. })
    }
}

/// The schedule of `kernel` of `graph` under `limits`; errors where a
/// node has no lowering or more elements than kernels index.
pub fn schedule(kernel: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Schedule, LowerError> {
    check_lowerable(kernel, graph, limits)?;
    let g = graph;
    let kind = kernel.kind;
    let root = kernel.root();
    let inputs = kernel.inputs.len();
    if kind == KernelKind::MultiTensor {
        let plan = multi::MultiPlan::new(kernel, g, limits);
        let vector_inputs = kernel.inputs.iter().map(|id| plan.vector_in.contains(id)).collect();
        let main = plan.bindings(kernel, g, limits)?;
        return Ok(Schedule {
            limits: *limits,
            family: Family::Multi(plan),
            empty: false,
            vector_inputs,
            in_main: vec![false; inputs],
            vector_outputs: false,
            entry: Entry::PerIndex,
            passes: Passes::One,
            trusted: false,
            error_slot: false,
            main,
            second: None,
        });
    }
    // Generic kernels keep the straight-line form but not vec4, which
    // holds only for sizes divisible by 4.
    let width = straight_line_width(kernel, g).map(|w| if limits.generic { 1 } else { w });
    // An attention kernel runs while any of its parts has elements (the
    // log-sum-exp beside an empty output, say).
    let root_numel = if kind == KernelKind::Attention {
        kernel.outputs.iter().map(|&o| g.node(o).shape.numel()).max().unwrap_or(0)
    } else {
        g.node(root).shape.numel()
    };
    // A kernel that checks indices runs even when its output is empty:
    // an index out of range is an error whether or not it moves anything.
    let checks_only = kind.checks_indices() && root_numel == 0 && g.node(g.node(root).inputs[1]).shape.numel() > 0;
    let empty = root_numel == 0 && !checks_only;
    let family = match kind {
        KernelKind::Elementwise => match width {
            Some(width) => Family::Straight { width },
            None => Family::Indexed,
        },
        KernelKind::ConcatPart { .. }
        | KernelKind::Random
        | KernelKind::ArgReduce
        | KernelKind::CumSum
        | KernelKind::Gather
        | KernelKind::Pool
        | KernelKind::PoolGrad => Family::Indexed,
        KernelKind::Reduce => Family::Reduce(reduce_plan(kernel, g, limits)),
        KernelKind::Softmax => Family::Softmax(SoftmaxPlan::new(kernel, g, limits)),
        KernelKind::Rows => Family::Rows(rows_layout(kernel, g, limits)),
        KernelKind::MatMul => Family::Matmul(MatmulPlan::new(kernel, g, limits)),
        KernelKind::ScatterAdd => Family::Scatter(limits.forms.scatter),
        KernelKind::Attention => Family::Attention(AttnPlan::new(kernel, g, limits)),
        KernelKind::Conv2d => Family::Conv(conv_plan(kernel, g, limits.forms.conv)),
        KernelKind::MultiTensor => unreachable!("scheduled above"),
        // The weight is read through its byte binding: a kernel input of
        // its own, and the product is the kernel's only output.
        KernelKind::Quant => {
            let n = g.node(root);
            let weight = n.inputs[usize::from(matches!(n.op, Op::QuantMatMul(_)))];
            if kernel.outputs != [root] || !kernel.inputs.contains(&weight) {
                return Err(LowerError::Unsupported {
                    op: format!("{} (a fused weight or output)", n.op.name()),
                    dtype: n.dtype,
                });
            }
            Family::Quant(QuantPlan::new(g, kernel))
        }
        // The KV cache's ops: per output element (write) or per query
        // row (attention), no decision of their own (see `super::cache`).
        KernelKind::Cache => Family::Indexed,
    };
    // Bindings read or written as vec4.
    let full = |id: NodeId| g.node(id).shape.numel() == root_numel;
    // A softmax row read as one vector per invocation step (see
    // `rows::vector_rows`).
    let row_vec = matches!(family, Family::Softmax(p) if p.vec4());
    let operand_vec = |id: NodeId| match &family {
        Family::Matmul(p) => p.vector_input(id),
        Family::Attention(p) => p.vector_inputs().contains(&id),
        _ => false,
    };
    // A held row kernel in the vec4 layout reads and writes everything of
    // the row's size as vectors (see `rows::rows_layout`).
    let rows_vec = matches!(family, Family::Rows(l) if l.vec4) && root_numel > 0;
    // A row reduction reading its input as vec4 (see
    // `reduce::vector_reduce`).
    let reduce_vec = matches!(family, Family::Reduce(ReducePlan::Rows { vec: true, .. }));
    let rows_vec_input = |id: NodeId| (rows_vec && full(id)) || (reduce_vec && kernel.inputs[0] == id);
    let vector_inputs: Vec<bool> = kernel
        .inputs
        .iter()
        .map(|&id| {
            (width == Some(4) && full(id))
                || (row_vec && kernel.inputs[0] == id)
                || operand_vec(id)
                || rows_vec_input(id)
        })
        .collect();
    let matmul_out_vec = matches!(&family, Family::Matmul(p) if p.vector_output());
    let vector_outputs = width == Some(4) || row_vec || matmul_out_vec || rows_vec;
    // Inputs read in `main` by the straight-line or vector-row path need
    // no function.
    let in_main = kernel.inputs.iter().map(|&id| (width.is_some() && full(id)) || row_vec).collect();
    let subgroups = |lanes: u64| limits.subgroups && lanes > 1;
    let root_node = g.node(root);
    let entry = match &family {
        _ if empty => Entry::PerIndex,
        Family::Straight { .. } | Family::Indexed | Family::Multi(_) => Entry::PerIndex,
        Family::Reduce(plan) => {
            let Op::Reduce { .. } = root_node.op else { unreachable!("a reduction kernel") };
            let red = acc_ty(g.node(root_node.inputs[0]).dtype);
            match *plan {
                ReducePlan::Columns { .. } | ReducePlan::Serial => Entry::PerIndex,
                ReducePlan::TwoPass { .. } | ReducePlan::Workgroup => Entry::Cooperative { red, subgroups: false },
                ReducePlan::Rows { lanes, .. } => Entry::Cooperative { red, subgroups: subgroups(lanes) },
            }
        }
        Family::Softmax(plan) => match *plan {
            SoftmaxPlan::Vec4Rows | SoftmaxPlan::PerRow => Entry::PerIndex,
            SoftmaxPlan::Cooperative { lanes, cached, .. } => {
                Entry::Cooperative { red: if cached { "f32" } else { "vec2<f32>" }, subgroups: subgroups(lanes) }
            }
        },
        Family::Rows(layout) => Entry::Cooperative { red: "f32", subgroups: subgroups(layout.lanes) },
        Family::Matmul(plan) => match plan.form {
            MatmulForm::Tiled(_) | MatmulForm::SplitK { .. } => {
                Entry::Workgroup { lanes: WORKGROUP_SIZE, cooperative_matrix: false }
            }
            MatmulForm::RegisterBlocked => {
                Entry::Workgroup { lanes: plan.layout().lanes as u32, cooperative_matrix: false }
            }
            MatmulForm::Cooperative(tile) => Entry::Workgroup { lanes: tile.lanes() as u32, cooperative_matrix: true },
            MatmulForm::ByShape => unreachable!("a resolved form"),
        },
        Family::Scatter(form) => match form {
            _ if root_numel == 0 => Entry::PerIndex,
            ScatterForm::RowOwner => Entry::Workgroup { lanes: WORKGROUP_SIZE, cooperative_matrix: false },
            ScatterForm::PerColumns => Entry::PerIndex,
        },
        Family::Attention(plan) => Entry::Workgroup { lanes: plan.lanes() as u32, cooperative_matrix: false },
        Family::Conv(plan) => Entry::Workgroup { lanes: plan.lanes as u32, cooperative_matrix: false },
        Family::Quant(plan) => match plan.kind {
            QuantKind::Dequantize { .. } => Entry::PerIndex,
            QuantKind::MatVec { lanes, .. } => Entry::Workgroup { lanes, cooperative_matrix: false },
        },
    };
    let passes = match &family {
        _ if empty => Passes::One,
        Family::Reduce(ReducePlan::Columns { parts } | ReducePlan::TwoPass { parts }) => {
            let red = acc_ty(g.node(root_node.inputs[0]).dtype);
            Passes::Partials { parts: *parts, acc: red, out: storage_ty(root_node.dtype) }
        }
        Family::Conv(plan) if plan.parts > 1 => Passes::Partials { parts: plan.parts, acc: "f32", out: "f32" },
        Family::Matmul(MatmulPlan { form: MatmulForm::SplitK { parts, .. }, .. }) => {
            Passes::SplitK { parts: *parts as u64 }
        }
        _ => Passes::One,
    };
    let error_slot = kind.checks_indices() && !empty;
    let (main, second) = bindings(kernel, g, limits, (&vector_inputs, vector_outputs), passes, error_slot)?;
    // A windowed source keeps its runtime checks: trust is proven for
    // whole-buffer bindings.
    let trusted = match &family {
        Family::Matmul(plan) if !empty => super::matmul::trusted(kernel, g, limits, plan.form),
        _ => false,
    } && !main.windowed()
        && !second.as_ref().is_some_and(Bindings::windowed);
    Ok(Schedule {
        limits: *limits,
        family,
        empty,
        vector_inputs,
        in_main,
        vector_outputs,
        entry,
        passes,
        trusted,
        error_slot,
        main,
        second,
    })
}

/// The storage bindings of the pass `kernel`'s body writes first and, in
/// two passes, of the kernel proper: inputs (vec4 as `vector_inputs`
/// says), outputs (vec4 where `vector_outputs`), a first pass's scratch
/// partials, the scratch a split-K matmul's second pass reads.
fn bindings(
    kernel: &Kernel,
    g: &VerifiedGraph,
    limits: &LowerLimits,
    (vector_inputs, vector_outputs): (&[bool], bool),
    passes: Passes,
    error_slot: bool,
) -> Result<(Bindings, Option<Bindings>), LowerError> {
    let tensor = |name: String, id: NodeId, vec4: bool, writable: bool| {
        Binding::of_node(g, limits, (name, storage_ty(g.node(id).dtype), id), vec4, writable)
    };
    let inputs = kernel
        .inputs
        .iter()
        .enumerate()
        .map(|(k, &id)| tensor(format!("in{k}"), id, vector_inputs[k], false))
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = |vec4: bool| {
        kernel
            .outputs
            .iter()
            .enumerate()
            .map(|(j, &id)| tensor(format!("out{j}"), id, vec4, true))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok(match passes {
        Passes::One => (Bindings { inputs, scratch: None, outputs: outputs(vector_outputs)?, error_slot }, None),
        Passes::Partials { acc, out, .. } => {
            // The first pass writes partials as its outputs: the
            // accumulator's type where the output is f16 or bf16.
            let partials = kernel
                .outputs
                .iter()
                .enumerate()
                .map(|(j, &id)| {
                    let d = g.node(id).dtype;
                    let scalar = if is_half(d) { acc } else { storage_ty(d) };
                    Binding::native(format!("out{j}"), scalar, vector_outputs, true)
                })
                .collect();
            let output = Binding::of_node(g, limits, ("out0".into(), out, kernel.outputs[0]), false, true)?;
            (
                Bindings { inputs, scratch: None, outputs: partials, error_slot: false },
                Some(Bindings {
                    inputs: vec![Binding::native("in0".into(), acc, false, false)],
                    scratch: None,
                    outputs: vec![output],
                    error_slot: false,
                }),
            )
        }
        Passes::SplitK { .. } => (
            Bindings {
                inputs: inputs.clone(),
                scratch: None,
                outputs: vec![Binding::native("out0".into(), "f32", vector_outputs, true)],
                error_slot: false,
            },
            Some(Bindings {
                inputs,
                scratch: Some(Binding::native("scr".into(), "f32", vector_outputs, false)),
                outputs: outputs(vector_outputs)?,
                error_slot: false,
            }),
        ),
    })
}

impl Schedule {
    /// The matmul plan of a matmul kernel.
    pub fn matmul(&self) -> &MatmulPlan {
        match &self.family {
            Family::Matmul(p) => p,
            other => unreachable!("a matmul plan, not {other:?}"),
        }
    }

    /// The plan of a reduction kernel.
    pub(super) fn reduce(&self) -> ReducePlan {
        match &self.family {
            Family::Reduce(p) => *p,
            other => unreachable!("a reduction plan, not {other:?}"),
        }
    }

    /// The plan of a softmax kernel.
    pub(super) fn softmax(&self) -> SoftmaxPlan {
        match &self.family {
            Family::Softmax(p) => *p,
            other => unreachable!("a softmax plan, not {other:?}"),
        }
    }

    /// The layout of a fused row kernel.
    pub(super) fn rows_layout(&self) -> RowsLayout {
        match &self.family {
            Family::Rows(l) => *l,
            other => unreachable!("a row kernel's layout, not {other:?}"),
        }
    }

    /// The plan of an attention kernel.
    pub(super) fn attention(&self) -> &AttnPlan {
        match &self.family {
            Family::Attention(p) => p,
            other => unreachable!("an attention plan, not {other:?}"),
        }
    }

    /// The plan of a convolution kernel.
    pub(super) fn conv(&self) -> ConvPlan {
        match &self.family {
            Family::Conv(p) => *p,
            other => unreachable!("a convolution plan, not {other:?}"),
        }
    }

    /// The plan of a quantized kernel.
    pub(super) fn quant(&self) -> QuantPlan {
        match &self.family {
            Family::Quant(p) => *p,
            other => unreachable!("a quantized kernel's plan, not {other:?}"),
        }
    }

    /// The plan of a multi-tensor kernel.
    pub(super) fn multi(&self) -> &multi::MultiPlan {
        match &self.family {
            Family::Multi(p) => p,
            other => unreachable!("a multi-tensor plan, not {other:?}"),
        }
    }

    /// Whether `main` takes the subgroup builtins (a row kernel combining
    /// its lanes by shuffles).
    pub(super) fn subgroups(&self) -> bool {
        matches!(self.entry, Entry::Cooperative { subgroups: true, .. })
    }

    /// The windows of the bindings of kernel `k` of `g` scheduled so (see
    /// [`crate::codegen::window`]): what its lowering binds.
    pub fn windows(&self, k: &Kernel, g: &VerifiedGraph) -> KernelWindows {
        KernelWindows::of(k, g, (self.passes.two(), self.passes.binds_inputs()), &self.limits.windows)
    }

    /// The concrete matmul form, for a matmul kernel.
    pub fn matmul_form(&self) -> Option<MatmulForm> {
        match &self.family {
            Family::Matmul(p) => Some(p.form),
            _ => None,
        }
    }

    /// What the autotuner keys matmul kernel `k` of `g` on (see
    /// `crate::compile::autotune::Tuner::key`): the problem (sizes, batch dims,
    /// dtypes), how its operands and outputs are laid out, its outputs'
    /// count and the limits it was scheduled under (the profile,
    /// workgroup memory, f16 storage); `None` for other kernels. Two
    /// kernels with the same key are one measurement: their candidates
    /// differ only in epilogues and node numbering.
    pub fn tuning_key(&self, k: &Kernel, g: &VerifiedGraph) -> Option<u64> {
        let Family::Matmul(plan) = &self.family else { return None };
        Some(lazuli_ir::stable_hash(&(plan.key_parts(k, g), self.limits)))
    }

    /// The matmul forms the autotuner times for matmul kernel `k` of `g`
    /// (scheduled as `self`, under limits that leave the form to the
    /// shape): the rule's one-pass choice first, then every candidate
    /// form that the schedule keeps as it is when forced (a tile that
    /// needs more workgroup memory than the adapter has is none).
    pub fn candidate_forms(&self, k: &Kernel, g: &VerifiedGraph) -> Vec<MatmulForm> {
        let Family::Matmul(plan) = &self.family else { return Vec::new() };
        super::matmul::candidates(&plan.problem)
            .into_iter()
            .filter(|&form| {
                let limits = LowerLimits { forms: KernelForms { matmul: form, ..self.limits.forms }, ..self.limits };
                schedule(k, g, &limits).is_ok_and(|s| s.matmul_form() == Some(form))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{lower, KernelForms, MatmulTile};
    use super::*;
    use lazuli_ir::fusion::{self, FusionLimits};
    use lazuli_ir::{BinaryOp, DType, Graph, ReduceOp, UnaryOp, ValueType};

    /// The kernels of `g` under the runtime's fusion limits.
    fn kernels(g: Graph) -> (VerifiedGraph, Vec<Kernel>) {
        let v = g.verify().unwrap();
        let fl = FusionLimits { matmul_epilogue: true, row_kernels: true, multi_tensor: true, ..Default::default() };
        let plan = fusion::plan(&v, &fl);
        (v, plan.kernels)
    }

    /// `a [m, k] @ b [k, n]` (A a transposed view where `ta`), with `y +
    /// bias` or `relu(y)` as epilogue.
    fn product((m, k, n): (usize, usize, usize), ta: bool, relu: bool) -> (VerifiedGraph, Kernel) {
        let mut g = Graph::new();
        let a = if ta {
            let x = g.param(ValueType::new([k, m], DType::F32));
            g.push(Op::Permute(vec![1, 0]), &[x]).unwrap()
        } else {
            g.param(ValueType::new([m, k], DType::F32))
        };
        let b = g.param(ValueType::new([k, n], DType::F32));
        let mut y = g.push(Op::MatMul, &[a, b]).unwrap();
        y = if relu {
            g.push(Op::Unary(UnaryOp::Relu), &[y]).unwrap()
        } else {
            let bias = g.param(ValueType::new([n], DType::F32));
            g.push(Op::Binary(BinaryOp::Add), &[y, bias]).unwrap()
        };
        g.outputs.push(y);
        let (v, mut ks) = kernels(g);
        assert_eq!(ks.len(), 1);
        (v, ks.remove(0))
    }

    /// The tuner's key is the product's: epilogues and node numbering do
    /// not change it; sizes, operand layouts and the profile do.
    #[test]
    fn the_tuning_key_is_the_problem() {
        let key = |(v, k): &(VerifiedGraph, Kernel), limits: &LowerLimits| {
            schedule(k, v, limits).unwrap().tuning_key(k, v).expect("a matmul")
        };
        let gpu = LowerLimits::gpu();
        let base = product((512, 256, 512), false, false);
        assert_eq!(key(&base, &gpu), key(&product((512, 256, 512), false, true), &gpu), "another epilogue");
        assert_ne!(key(&base, &gpu), key(&product((512, 256, 640), false, false), &gpu), "another N");
        assert_ne!(key(&base, &gpu), key(&product((512, 256, 512), true, false), &gpu), "A transposed");
        assert_ne!(key(&base, &gpu), key(&base, &LowerLimits { workgroup_storage: 32768, ..gpu }), "another adapter");
        let (v, ks) = kernels({
            let mut g = Graph::new();
            let x = g.param(ValueType::new([64, 64], DType::F32));
            let y = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
            g.outputs.push(y);
            g
        });
        assert_eq!(schedule(&ks[0], &v, &gpu).unwrap().tuning_key(&ks[0], &v), None, "not a product");
    }

    /// The candidates are the schedule's alternatives: the rule's one-pass
    /// choice first, then each tile the adapter's workgroup memory holds.
    #[test]
    fn candidates_are_the_forms_the_schedule_keeps() {
        let (v, k) = product((512, 256, 512), false, false);
        let gpu = LowerLimits::gpu();
        let forms = schedule(&k, &v, &gpu).unwrap().candidate_forms(&k, &v);
        assert_eq!(forms[0], schedule(&k, &v, &gpu).unwrap().matmul_form().unwrap());
        assert!(forms.contains(&MatmulForm::RegisterBlocked));
        assert!(forms.contains(&MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 })), "{forms:?}");
        // 8 KiB hold the 64 x 64 tile alone.
        let small = LowerLimits { workgroup_storage: 8192, ..gpu };
        let fewer = schedule(&k, &v, &small).unwrap().candidate_forms(&k, &v);
        assert!(fewer.contains(&MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 })), "{fewer:?}");
        assert!(!fewer.iter().any(|f| matches!(f, MatmulForm::Tiled(t) if t.bm == 128 || t.bn == 128)), "{fewer:?}");
    }

    /// What the schedule says is what lowering writes: the workgroup size,
    /// the passes, trust and the error slot, for every family under both
    /// profiles.
    #[test]
    fn lowering_follows_the_schedule() {
        let mut graphs = Vec::new();
        let mut g = Graph::new();
        let x = g.param(ValueType::new([512, 1024], DType::F32));
        let s = g.push(Op::Softmax { axis: 1, log: false }, &[x]).unwrap();
        let r = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[x]).unwrap();
        let c = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[x]).unwrap();
        g.outputs.extend([s, r, c]);
        graphs.push(g);
        let mut g = Graph::new();
        let x = g.param(ValueType::new([1 << 20], DType::F32));
        let r = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[x]).unwrap();
        g.outputs.push(r);
        graphs.push(g);
        let mut g = Graph::new();
        let x = g.param(ValueType::new([4096, 64], DType::F32));
        let dy = g.param(ValueType::new([4096, 256], DType::F32));
        let xt = g.push(Op::Permute(vec![1, 0]), &[x]).unwrap();
        let w = g.push(Op::MatMul, &[xt, dy]).unwrap();
        g.outputs.push(w);
        graphs.push(g);
        let mut forms = vec![LowerLimits::gpu(), LowerLimits::software()];
        forms.push(LowerLimits { subgroups: true, ..LowerLimits::gpu() });
        forms.push(LowerLimits {
            forms: KernelForms { matmul: MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 }), ..KernelForms::gpu() },
            ..LowerLimits::gpu()
        });
        let mut two_pass = 0;
        for g in graphs {
            let (v, ks) = kernels(g);
            for limits in &forms {
                for k in &ks {
                    let s = schedule(k, &v, limits).unwrap();
                    let w = lower(k, &v, limits).unwrap();
                    let first = w.pre.as_deref().unwrap_or(&w);
                    assert_eq!(first.workgroup_size, s.entry.workgroup_size(), "{k:?} {limits:?}");
                    assert_eq!(w.pre.is_some(), s.passes.two(), "{k:?} {limits:?}");
                    assert_eq!(w.binds_inputs, s.passes.binds_inputs(), "{k:?} {limits:?}");
                    assert_eq!(first.trusted, s.trusted, "{k:?} {limits:?}");
                    assert_eq!(first.error_slot, s.error_slot, "{k:?} {limits:?}");
                    two_pass += s.passes.two() as usize;
                }
            }
        }
        assert!(two_pass >= 3, "split-K and two-pass reductions are among the cases");
    }
}
