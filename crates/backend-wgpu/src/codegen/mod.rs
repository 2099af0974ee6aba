//! Lowering of one planned kernel ([`Kernel`]) to WGSL: a pure,
//! deterministic function of the kernel, the verified graph and the limits,
//! in two stages. [`schedule()`] decides everything first, as a value (the
//! family's plan: a matmul's product, form and operand layouts, a
//! reduction's passes, a row kernel's lanes; which bindings are vec4; how
//! `main` is entered; the passes and their scratch; whether the source is
//! trusted); [`lower_scheduled`] then writes the text from that
//! [`Schedule`] and decides nothing. [`lower`] is the two in a row.
//!
//! Every inlined node becomes a function `nK(i: u32) -> T` returning its
//! value at row-major linear index `i` of its own shape; views are index
//! math on that argument, so nothing is materialized. Materialized inputs
//! are storage buffers read by the same kind of function. Binding 0 is the
//! uniform of the lifted scalars the kernel reads (`P.sK`, numbered in the
//! kernel's own order, [`Wgsl::scalars`], so that a kernel's source does
//! not depend on the other scalars of its graph; plus `P.z`, always 0,
//! used to build NaN and infinity at run time); inputs follow in the
//! kernel's order, then outputs. Bools are `bool` in registers and one `u32` per element in
//! buffers. Shapes are baked in as constants; scalars never are.
//!
//! Elementwise kernels that need no index math (see
//! [`straight_line_width`]) are written in straight-line form instead: vec4
//! loads, one value function per node applied per lane (the same
//! expressions as the indexed form), vec4 stores; one vector per
//! invocation in the GPU form, several consecutive ones in the software
//! form (see [`elementwise`]). Softmax and matmul have their own loop structures (see
//! `main_body`).
//!
//! One module per kernel family: [`elementwise`], [`reduce`] (reductions,
//! arg-reductions, cumulative sums), [`rows`] (softmax and log-softmax,
//! the fused row kernels, and the combine of a row's lanes: subgroup
//! shuffles where [`LowerLimits::subgroups`], else a workgroup tree),
//! [`matmul`], [`attention`] (fused attention, forward and backward),
//! [`index`] (gather and scatter-add, which check their indices and report
//! one out of range through an error slot), [`pool`] (pooling and its
//! gradient), [`quant`] (quantized weights: dequantization and the
//! matrix-vector product, read through the byte storage of [`access`])
//! and [`cache`] (the KV cache's write and prefix attention); [`multi`] writes multi-tensor kernels from the elementwise
//! forms; `common` holds the type, literal and index helpers and the WGSL
//! helper functions they share (a typed `Helper` each). [`forms`] holds
//! the kernel forms each family can be written in ([`KernelForms`]);
//! [`mod@schedule`] the decisions of one kernel ([`Schedule`]).

use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{BinaryOp, DType, NodeId, Op, PadMode, RandomDist, UnaryOp, VerifiedGraph};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use thiserror::Error;

pub mod access;
pub mod attention;
pub mod cache;
mod common;
pub mod conv;
pub mod coop;
pub mod elementwise;
pub mod forms;
pub mod index;
pub mod matmul;
pub mod multi;
pub mod pool;
pub mod quant;
pub mod reduce;
pub mod rows;
pub mod schedule;
pub mod window;

use crate::codegen::window::{KernelWindows, Windows};
pub use access::{Binding, Bindings, HalfStorage, Storage};
use common::*;
pub use common::{is_half, LLVMPIPE_LOOP_BUDGET};
pub use elementwise::{straight_line_width, STRAIGHT_LINE_STEPS};
pub use forms::{
    AttentionForm, ConvForm, ElementwiseForm, KernelForms, MatmulForm, MatmulTile, ReduceForm, RowsForm, ScatterForm,
};
pub use matmul::{MatmulPlan, MatmulProblem, MATMUL_LANES, MATMUL_ROWS, MATMUL_TILE, MATMUL_TILE_K};
pub use reduce::{
    reduce_lanes, INLINE_REDUCTION_LEN, REDUCE_COOPERATIVE_LEN, REDUCE_COOPERATIVE_OUTPUTS, REDUCE_UNROLL,
};
pub use rows::{row_lanes, rows_layout, RowsLayout, ROWS_MAX_HELD, ROW_MAX_CACHED, ROW_MAX_LANES};
pub use schedule::{schedule, Entry, Family, Passes, Schedule};

/// Invocations per workgroup of every generated kernel.
pub const WORKGROUP_SIZE: u32 = 256;

/// Limits that shape generated code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowerLimits {
    /// Largest element count one tensor may have (indices are u32).
    pub max_elements: u64,
    /// Which form each kernel family is written in.
    pub forms: KernelForms,
    /// Bytes of workgroup memory one kernel may declare (the adapter's
    /// `max_compute_workgroup_storage_size`; 16384 is WebGPU's minimum).
    pub workgroup_storage: u32,
    /// Sizes vary from call to call (`CompileHints::sizes_vary`): choose
    /// forms that do not depend on them, so that the sources of every size
    /// share one generic kernel (see `crate::rewrite::size_families`): no vec4 paths that
    /// need a size divisible by 4, and matmul layouts from coarse
    /// power-of-two buckets, except along the sizes `fixed` names.
    pub generic: bool,
    /// In a kernel generic over sizes, the sizes that stay the same
    /// across the sizes seen so far (a growing sequence changes the rows
    /// of a product, not its columns or depth): forms may depend on those
    /// as in a static kernel (vec4 loads and stores, unrolled depth,
    /// narrow-output layouts). Set per kernel by the compiler; ignored
    /// where `generic` is false. Sound whatever it says: a size that
    /// later changes changes the source's skeleton, which starts a family
    /// of its own (see `crate::rewrite::size_families`).
    pub fixed: FixedSizes,
    /// The device has subgroup operations and they are on
    /// (`WgpuOptions::subgroups`): row kernels combine the lanes of a row
    /// with them (see [`rows`]): their `main` takes the subgroup builtins.
    /// The source differs, so every cache keyed by source (pipelines, the
    /// disk cache's naga modules) tells the two apart. (No `enable
    /// subgroups;` directive: naga 30 rejects it and takes subgroup
    /// operations without it, as wgpu's native backends do; a browser,
    /// which would need it, never gets subgroup kernels, see
    /// `WgpuBackend`'s setup.)
    pub subgroups: bool,
    /// How f16 tensors are stored: natively where the adapter has
    /// `SHADER_F16`, else packed in `u32` (see [`access`]).
    pub f16: HalfStorage,
    /// How tensors beyond one storage binding are bound: the adapter's
    /// windows (see [`crate::codegen::window`] and [`access`]);
    /// [`Windows::UNBOUNDED`] binds every tensor whole.
    pub windows: Windows,
    /// The device runs cooperative matrices the way [`coop`] writes them
    /// (the feature, `SHADER_F16`, `SUBGROUP`, a 16 x 16 x 16 f16 -> f32
    /// configuration, subgroups of exactly [`coop::COOP_SUBGROUP`] lanes):
    /// f16 products take the tensor-core form.
    pub cooperative_matrix: bool,
}

/// Sizes a kernel generic over sizes may treat as constants (see
/// [`LowerLimits::fixed`]); all `false` (the default) treats every size
/// as varying.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FixedSizes {
    /// A product's output rows (M).
    pub m: bool,
    /// A product's output columns (N).
    pub n: bool,
    /// A product's depth (K).
    pub k: bool,
    /// The length of the rows of a row, softmax or reduction kernel (the
    /// last axis of its root, or of the operand it reduces).
    pub row: bool,
}

impl FixedSizes {
    /// Every size varies.
    pub const NONE: FixedSizes = FixedSizes { m: false, n: false, k: false, row: false };
    /// Every size fixed.
    pub const ALL: FixedSizes = FixedSizes { m: true, n: true, k: true, row: true };
}

impl Default for LowerLimits {
    fn default() -> Self {
        LowerLimits::gpu()
    }
}

impl LowerLimits {
    /// The sizes a kernel lowered under these limits may treat as
    /// constants: all in a static kernel, [`LowerLimits::fixed`] in a
    /// generic one.
    pub fn fixed_sizes(&self) -> FixedSizes {
        if self.generic {
            self.fixed
        } else {
            FixedSizes::ALL
        }
    }

    /// The forms a GPU adapter selects, with WebGPU's minimum limits.
    pub fn gpu() -> LowerLimits {
        LowerLimits {
            max_elements: u32::MAX as u64,
            forms: KernelForms::gpu(),
            workgroup_storage: 16384,
            generic: false,
            fixed: FixedSizes::NONE,
            subgroups: false,
            f16: HalfStorage::Packed,
            windows: Windows::UNBOUNDED,
            cooperative_matrix: false,
        }
    }

    /// The forms a software adapter (llvmpipe) selects.
    pub fn software() -> LowerLimits {
        LowerLimits { forms: KernelForms::software(), ..LowerLimits::gpu() }
    }
}

/// A lowered kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Wgsl {
    /// The full WGSL source.
    pub source: String,
    /// The entry point.
    pub entry: &'static str,
    /// Invocations the kernel needs (one per output element, row, ...).
    pub invocations: u64,
    /// Storage buffers read (bindings `1..=inputs`).
    pub inputs: usize,
    /// Storage buffers written (after the inputs).
    pub outputs: usize,
    /// Invocations per workgroup (`invocations` is a multiple of it when
    /// the kernel is written per workgroup).
    pub workgroup_size: u32,
    /// A first pass run before this kernel (long reductions with few
    /// outputs, see [`reduce`]; split-K matmuls, see [`matmul`]): it
    /// reads the kernel's inputs and writes `scratch` 32-bit partial
    /// results to a scratch buffer, which this kernel then reads as its
    /// only input (binding 1), or after the kernel's inputs where
    /// [`Wgsl::binds_inputs`].
    pub pre: Option<Box<Wgsl>>,
    /// 32-bit elements of scratch this kernel writes (a first pass), else 0.
    pub scratch: u64,
    /// With `pre`: this pass binds the kernel's inputs too (bindings
    /// `1..=n`, as the first pass does), then the scratch, then the
    /// outputs, for an epilogue that reads inputs (split-K matmul, see
    /// [`matmul`]); otherwise the scratch is its only input.
    pub binds_inputs: bool,
    /// The kernel checks indices and binds an error slot after its
    /// outputs (see [`index`]).
    pub error_slot: bool,
    /// The generator proves every index of this source in bounds (clamped
    /// loads, guarded stores, workgroup arrays indexed by constants plus
    /// lane ids, divisions by nonzero constants, loops bounded by
    /// constants), so its module may be created without runtime checks
    /// (see [`matmul::trusted`] and `crate::compile::pipeline`). Only the tiled
    /// matmul at fixed sizes (and split-K's first pass) sets it; a later
    /// rewrite (windows, size families, fault injection) clears it.
    pub trusted: bool,
    /// Lowered in the forms of a kernel generic over sizes
    /// ([`LowerLimits::generic`]), not those its sizes ask for.
    pub generic_form: bool,
    /// The graph's lifted scalars this source reads, by graph index, in
    /// the order of its `Params` members (`P.s0`, `P.s1`, ...): a kernel
    /// declares only its own scalars, so the same kernel in two plans
    /// with other scalars is the same source (one pipeline); the
    /// execution binds it a uniform holding these (see `crate::execute`).
    pub scalars: Vec<usize>,
}

impl Wgsl {
    /// The windows of its bindings (kernel `kernel` of `graph`, lowered as
    /// this source under `windows`; see [`crate::codegen::window`]).
    pub fn windows(&self, kernel: &Kernel, graph: &VerifiedGraph, windows: &Windows) -> KernelWindows {
        KernelWindows::of(kernel, graph, (self.pre.is_some(), self.binds_inputs), windows)
    }
}

/// Why a kernel cannot be lowered.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum LowerError {
    /// An op or dtype the generator does not handle.
    #[error("wgsl codegen does not support {op} on {dtype}")]
    Unsupported {
        /// The op.
        op: String,
        /// The dtype.
        dtype: DType,
    },
    /// A tensor too large for u32 indexing.
    #[error("{op}: {elements} elements exceed the u32 index range")]
    TooLarge {
        /// The op.
        op: String,
        /// Element count.
        elements: u64,
    },
}

/// True for the dtypes this generator handles: f32, i32, u32, bool, and
/// f16 and bf16 (stored in 16 bits, computed in f32: [`access`]).
pub fn dtype_supported(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I32 | DType::U32 | DType::Bool | DType::F16 | DType::BF16)
}

/// True for the nodes this generator handles: supported dtypes, and
/// convolutions in f32 only (their kernels accumulate in f32). Nodes of
/// f16 or bf16 are limited to the families proven on them (elementwise,
/// views, reductions, softmax, matmul); the others run on the CPU
/// fallback.
pub fn node_supported(node: &lazuli_ir::Node) -> bool {
    // A collective is no kernel: the executor runs it (stage, MPI, upload).
    !node.op.is_collective()
        && (dtype_supported(node.dtype) || (node.dtype == DType::U8 && matches!(node.op, Op::Gather { .. })))
        && (!matches!(node.op, Op::Conv2d(_)) || matches!(node.dtype, DType::F32 | DType::F16 | DType::BF16))
        && (!is_half(node.dtype) || half_op_supported(&node.op))
}

/// True for the dtypes a wgpu device stores: those kernels compute in
/// ([`dtype_supported`]) and `u8` (quantized weight blocks, four bytes
/// to a word, read only by the quantized kernels: [`access::Storage::Bytes`]).
pub fn dtype_stored(d: DType) -> bool {
    dtype_supported(d) || d == DType::U8
}

/// Whether operand `k` of `op` may be a `u8` tensor on the device: the
/// weight of [`Op::Dequantize`] and [`Op::QuantMatMul`], the data of a
/// gather (an embedding's quantized rows).
pub fn reads_bytes(op: &Op, k: usize) -> bool {
    matches!((op, k), (Op::Dequantize(_), 0) | (Op::QuantMatMul(_), 1) | (Op::Gather { .. }, 0))
}

/// The ops whose kernels are proven on f16 and bf16 operands and outputs.
pub fn half_op_supported(op: &Op) -> bool {
    matches!(
        op,
        Op::Parameter(_)
            | Op::Constant(..)
            | Op::ScalarParam(_)
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Where
            | Op::Cast(_)
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Expand(_)
            | Op::Slice { .. }
            | Op::Concat { .. }
            | Op::Pad { .. }
            | Op::Gather { .. }
            | Op::ScatterAdd { .. }
            | Op::Pool(_)
            | Op::PoolGrad(_)
            | Op::Conv2d(_)
            | Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::MatMul
            | Op::Attention { .. }
    )
}

/// Fails when a node of `kernel` has no WGSL lowering or more elements
/// than kernels index.
fn check_lowerable(kernel: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<(), LowerError> {
    for &id in kernel.inputs.iter().chain(&kernel.inline).chain(&kernel.outputs) {
        let n = graph.node(id);
        // A `u8` input (a quantized weight, wherever it was made) is only
        // bytes to the kernel: read through its byte binding.
        let bytes = n.dtype == DType::U8 && kernel.inputs.contains(&id);
        if !bytes && !node_supported(n) {
            return Err(LowerError::Unsupported { op: n.op.name(), dtype: n.dtype });
        }
        if n.shape.numel() as u64 > limits.max_elements {
            return Err(LowerError::TooLarge { op: n.op.name(), elements: n.shape.numel() as u64 });
        }
    }
    Ok(())
}

/// Lowers `kernel` of `graph` to WGSL under `limits`: its schedule
/// ([`schedule()`]), then the text written from it ([`lower_scheduled`]).
pub fn lower(kernel: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Wgsl, LowerError> {
    lower_scheduled(kernel, graph, &schedule(kernel, graph, limits)?)
}

/// Writes `kernel` of `graph` as WGSL from its schedule `s` (decided by
/// [`schedule()`] for this kernel): every storage binding accessed as its
/// storage says (native, f16 or bf16, windowed: see [`access`]).
pub fn lower_scheduled(kernel: &Kernel, graph: &VerifiedGraph, s: &Schedule) -> Result<Wgsl, LowerError> {
    let mut wgsl = write(kernel, graph, s)?;
    let mut pass = Some(&mut wgsl);
    while let Some(w) = pass {
        w.generic_form = s.limits.generic;
        pass = w.pre.as_deref_mut();
    }
    Ok(wgsl)
}

/// The passes of `kernel` of `graph` written from its schedule `sched`.
fn write(kernel: &Kernel, graph: &VerifiedGraph, sched: &Schedule) -> Result<Wgsl, LowerError> {
    let mut w = Writer {
        g: graph,
        s: sched,
        helpers: BTreeSet::new(),
        funcs: String::new(),
        shared: String::new(),
        limits: sched.limits,
        second: None,
        decls: String::new(),
        slots: None,
        defined: BTreeSet::new(),
        split: None,
        scalars: Vec::new(),
    };
    if kernel.kind == KernelKind::MultiTensor {
        return w.multi_tensor(kernel);
    }
    let root = kernel.root();
    let concat_part_root = matches!(kernel.kind, KernelKind::ConcatPart { .. }).then_some(root);
    let in_main = |id: NodeId| kernel.inputs.iter().position(|&x| x == id).is_some_and(|k| sched.in_main[k]);
    let vector_input = |id: NodeId| kernel.inputs.iter().position(|&x| x == id).is_some_and(|k| sched.vector_inputs[k]);
    w.input_fns(kernel, &in_main, &vector_input);
    let (body, invocations) = match &sched.family {
        // No output elements: never dispatched, and its index math would
        // divide by a zero dim, which naga rejects (reliability finding 1).
        _ if sched.empty => (String::new(), 0),
        Family::Straight { width } => w.straight_line(kernel, *width)?,
        Family::Softmax(rows::SoftmaxPlan::Vec4Rows) => w.softmax_rows_vec4(kernel),
        _ => {
            w.value_fns(kernel, concat_part_root)?;
            w.main_body(kernel)?
        }
    };
    // Assemble.
    let main = &sched.main;
    let mut s = String::from(enables(sched.entry, main));
    s.push_str("// generated by lazuli-wgpu\n");
    s.push_str(&params_header(graph, &w.scalars));
    s.push_str(&main.declare_inputs());
    s.push_str(&main.declare_rest());
    if sched.error_slot {
        let (head, tail) = index::error_slot_source(main.error_binding());
        s.push_str(&head);
        s.push_str(&main.helpers());
        s.push_str(tail);
    } else {
        s.push_str(&main.helpers());
    }
    let split = w.split.take();
    debug_assert_eq!(split.is_some(), matches!(sched.passes, Passes::SplitK { .. }), "split-K as scheduled");
    debug_assert_eq!(w.second.is_some(), matches!(sched.passes, Passes::Partials { .. }), "two passes as scheduled");
    s.push('\n');
    for h in &w.helpers {
        s.push_str(h.source());
        s.push('\n');
    }
    s.push_str(&w.decls);
    s.push_str(&w.funcs);
    s.push_str(&w.main_entry(&body, invocations));
    let (inputs, outputs) = main.counts();
    let first = Wgsl {
        source: s,
        entry: "main",
        invocations,
        inputs,
        outputs,
        workgroup_size: sched.entry.workgroup_size(),
        pre: None,
        scratch: 0,
        error_slot: sched.error_slot,
        binds_inputs: false,
        trusted: sched.trusted,
        generic_form: false,
        scalars: w.scalars.clone(),
    };
    if let Some(sp) = split {
        return Ok(w.split_k_second_pass(sp, first));
    }
    let Some(second) = w.second.take() else { return Ok(first) };
    let Passes::Partials { acc, .. } = sched.passes else { unreachable!("two passes as scheduled") };
    let bindings = w.pass2();
    // Two passes: the kernel proper is the second; the first feeds it.
    let mut s = String::from(enables(Entry::PerIndex, bindings));
    s.push_str("// generated by lazuli-wgpu (second pass)\n");
    // The second pass calls no value function: it reads no scalar.
    s.push_str(&params_header(graph, &[]));
    s.push_str(&bindings.declare_inputs());
    s.push_str(&bindings.declare_rest());
    s.push_str(&bindings.helpers());
    s.push('\n');
    for h in &w.helpers {
        s.push_str(h.source());
        s.push('\n');
    }
    s.push_str(&cooperative_main(acc, &second.body, false));
    let (inputs, outputs) = bindings.counts();
    Ok(Wgsl {
        source: s,
        entry: "main",
        invocations: second.invocations,
        inputs,
        outputs,
        workgroup_size: WORKGROUP_SIZE,
        pre: Some(Box::new(Wgsl { scratch: second.scratch, ..first })),
        scratch: 0,
        error_slot: false,
        binds_inputs: false,
        trusted: false,
        generic_form: false,
        scalars: Vec::new(),
    })
}

/// The `enable` directives a source needs, from what it binds and how its
/// `main` is entered: f16 where a binding stores native f16 or the kernel
/// multiplies f16 cooperative matrices, and the cooperative-matrix
/// extension for the latter.
fn enables(entry: Entry, bindings: &Bindings) -> &'static str {
    match (entry, bindings.native_f16()) {
        (Entry::Workgroup { cooperative_matrix: true, .. }, _) => "enable f16;\nenable wgpu_cooperative_matrix;\n",
        (_, true) => "enable f16;\n",
        _ => "",
    }
}

impl<'a> Writer<'a> {
    /// Input binding `k` of the kernel being written (a segment's input
    /// `k` in a multi-tensor kernel), in the pass its body writes first.
    fn input(&self, k: usize) -> &'a Binding {
        let s: &'a Schedule = self.s;
        &s.main.inputs[self.slots.as_ref().map_or(k, |sl| sl.input(k))]
    }

    /// Output binding `j` of the kernel being written (of the segment in
    /// a multi-tensor kernel), in the pass its body writes first.
    fn output(&self, j: usize) -> &'a Binding {
        let s: &'a Schedule = self.s;
        &s.main.outputs[self.slots.as_ref().map_or(0, |sl| sl.out_base()) + j]
    }

    /// The bindings of the kernel proper of a kernel scheduled in two
    /// passes (the first pass's are [`Writer::input`] and
    /// [`Writer::output`]).
    fn pass2(&self) -> &'a Bindings {
        let s: &'a Schedule = self.s;
        s.second.as_ref().expect("a kernel scheduled in two passes")
    }
}

impl Writer<'_> {
    /// The `Params` member (`P.sK`) of the graph's scalar `index`, given
    /// one at its first use.
    fn scalar_member(&mut self, index: usize) -> usize {
        self.scalars.iter().position(|&s| s == index).unwrap_or_else(|| {
            self.scalars.push(index);
            self.scalars.len() - 1
        })
    }

    /// `fn nK(i)` for each input of `kernel` not read in `main`
    /// (`in_main`), reading lanes of inputs bound as vectors (`vec4`).
    fn input_fns(&mut self, kernel: &Kernel, in_main: &dyn Fn(NodeId) -> bool, vec4: &dyn Fn(NodeId) -> bool) {
        for (k, &id) in kernel.inputs.iter().enumerate() {
            if in_main(id) {
                continue;
            }
            let n = self.g.node(id);
            // Bound as vectors (the matmul loop, a row kernel's vec4
            // layout): views read lanes.
            let input = self.input(k);
            let raw = if vec4(id) { format!("{}[i & 3u]", input.load("i >> 2u")) } else { input.load("i") };
            // Bools are one `u32` per element in buffers.
            let load = if n.dtype == DType::Bool { format!("{raw} != 0u") } else { raw };
            let _ = writeln!(self.funcs, "fn n{}(i: u32) -> {} {{\n    return {load};\n}}\n", id.0, ty(n.dtype));
        }
    }

    /// The value functions of a kernel written by `main_body`: the
    /// inlined nodes (a matmul epilogue as `eK(i, mm)` functions of the
    /// output index and accumulator), except the concat part's root and a
    /// row kernel's reductions (values of its rows).
    fn value_fns(&mut self, kernel: &Kernel, concat_part_root: Option<NodeId>) -> Result<(), LowerError> {
        let graph = self.g;
        let root = kernel.root();
        // A matmul epilogue: nodes depending on the matmul become
        // `eK(i, mm)` functions of the output index and accumulator.
        let mm_node = kernel.matmul_node(graph);
        let mut dependent: BTreeSet<NodeId> = BTreeSet::new();
        if let Some(mmn) = mm_node.filter(|&x| x != root) {
            let mut all: Vec<NodeId> = kernel.inline.iter().chain(&kernel.outputs).copied().collect();
            all.sort();
            all.dedup();
            for id in all {
                let n = graph.node(id);
                if n.inputs.iter().any(|o| *o == mmn || dependent.contains(o)) {
                    dependent.insert(id);
                }
            }
            for &id in &dependent {
                self.node_fn(id, Some((mmn, &dependent)))?;
            }
        }
        for &id in &kernel.inline {
            if Some(id) == concat_part_root || Some(id) == mm_node || dependent.contains(&id) {
                continue;
            }
            // A row kernel's reductions are values of its rows,
            // written by `rows_kernel`.
            if kernel.kind == KernelKind::Rows && matches!(graph.node(id).op, Op::Reduce { .. }) {
                continue;
            }
            self.value_fn(id)?;
        }
        Ok(())
    }

    /// The `main` entry point around `body`, by how the kernel is written:
    /// per workgroup (`t` derived in the body), cooperative (no early
    /// return), or an invocation per index below `invocations`.
    fn main_entry(&self, body: &str, invocations: u64) -> String {
        let mut s = String::new();
        if let Entry::Workgroup { lanes, cooperative_matrix } = self.s.entry {
            // Kernels written per workgroup (matmul): `main` derives `t`.
            s.push_str(&self.shared);
            let sg = if cooperative_matrix {
                ", @builtin(subgroup_id) sid: u32, @builtin(subgroup_invocation_id) sii: u32"
            } else {
                ""
            };
            let _ = write!(
                s,
                "@compute @workgroup_size({lanes})\nfn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>{sg}) {{\n{body}}}\n"
            );
        } else if let Entry::Cooperative { red, subgroups } = self.s.entry {
            // Cooperative kernels: invocations work together through
            // workgroup memory and barriers, so none may return early.
            s.push_str(&cooperative_main(red, body, subgroups));
        } else {
            let _ = write!(
                s,
                "@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    let t = gid.x + gid.y * nwg.x * {WORKGROUP_SIZE}u;\n    if (t >= {invocations}u) {{\n        return;\n    }}\n{body}}}\n"
            );
        }
        s
    }

    /// The split-K matmul's second pass (the sum of partials, with the
    /// epilogue), with `first` as its first pass: it binds the inputs as
    /// the first does, then the scratch, then the outputs.
    fn split_k_second_pass(&self, sp: matmul::SplitSum, first: Wgsl) -> Wgsl {
        let graph = self.g;
        let bindings = self.pass2();
        let mut s = String::from(enables(Entry::PerIndex, bindings));
        s.push_str("// generated by lazuli-wgpu (second pass)\n");
        s.push_str(&params_header(graph, &self.scalars));
        s.push_str(&bindings.declare_inputs());
        s.push_str(&bindings.declare_rest());
        s.push_str(&bindings.helpers());
        s.push('\n');
        for h in &self.helpers {
            s.push_str(h.source());
            s.push('\n');
        }
        s.push_str(&self.decls);
        s.push_str(&self.funcs);
        let _ = write!(
            s,
            "@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    let t = gid.x + gid.y * nwg.x * {WORKGROUP_SIZE}u;\n    if (t >= {}u) {{\n        return;\n    }}\n{}}}\n",
            sp.invocations, sp.body
        );
        let (inputs, outputs) = bindings.counts();
        Wgsl {
            source: s,
            entry: "main",
            invocations: sp.invocations,
            inputs,
            outputs,
            workgroup_size: WORKGROUP_SIZE,
            pre: Some(Box::new(Wgsl { scratch: sp.scratch, ..first })),
            scratch: 0,
            error_slot: false,
            binds_inputs: true,
            trusted: false,
            generic_form: false,
            scalars: self.scalars.clone(),
        }
    }
}

/// `n.div_ceil(d)` as a WGSL `u32` expression. A kernel generic over
/// sizes spells it out from `n` (`((13u + 15u) / 16u)`), so the literal
/// that varies is the size itself, which `crate::rewrite::size_families` turns dynamic at
/// the first size that differs; a baked quotient would stay equal across
/// nearby sizes (1 for 12 and 13 rows of 16) and compile the kernel again
/// at the first size where it moves.
pub(super) fn ceil_div(n: u64, d: u64, generic: bool) -> String {
    if generic {
        format!("(({n}u + {}u) / {d}u)", d - 1)
    } else {
        format!("{}u", n.div_ceil(d))
    }
}

/// The uniform of lifted scalars (`P.z`, always 0, then `P.sK`) and its
/// binding: member `sK` is the graph's scalar `scalars[K]` (see
/// [`Wgsl::scalars`]).
fn params_header(graph: &VerifiedGraph, scalars: &[usize]) -> String {
    let mut s = String::from("struct Params {\n    z: u32,\n");
    for (k, &index) in scalars.iter().enumerate() {
        // Lifted f16 and bf16 scalars are f32 words (see `crate::device::uniforms::scalar_word`).
        let _ = writeln!(s, "    s{k}: {},", storage_reg_ty(graph.scalars[index]));
    }
    s.push_str("}\n\n@group(0) @binding(0) var<uniform> P: Params;\n");
    s
}

/// `main` of a cooperative kernel: the workgroup array `red` of `shared`
/// elements, and `body` with `lid`, `wid` and `nwg` in scope (with
/// `subgroups`, also `sii`, `ssz`, `sid` and `nsg`: the subgroup
/// invocation id, subgroup size, subgroup id and subgroup count); no
/// early return, so every barrier stays uniform.
fn cooperative_main(shared: &str, body: &str, subgroups: bool) -> String {
    let sg = if subgroups {
        ", @builtin(subgroup_invocation_id) sii: u32, @builtin(subgroup_size) ssz: u32, @builtin(subgroup_id) sid: u32, @builtin(num_subgroups) nsg: u32"
    } else {
        ""
    };
    format!(
        "var<workgroup> red: array<{shared}, {WORKGROUP_SIZE}>;\n\n@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>{sg}) {{\n{body}}}\n"
    )
}

/// The writer of one kernel's text, from its schedule (`s`): what it
/// holds besides the schedule is text written so far.
struct Writer<'a> {
    g: &'a VerifiedGraph,
    /// The kernel's schedule: every decision the text follows.
    s: &'a Schedule,
    /// The graph's scalars the kernel reads so far, in the order of its
    /// `Params` members (see [`Wgsl::scalars`]).
    scalars: Vec<usize>,
    helpers: BTreeSet<Helper>,
    funcs: String,
    /// Workgroup-memory declarations of kernels written per workgroup.
    shared: String,
    /// `s.limits`.
    limits: LowerLimits,
    /// The body of the second pass of a kernel scheduled in two passes
    /// with partials ([`Passes::Partials`]): the main body is the first
    /// pass (see [`reduce`]).
    second: Option<SecondPass>,
    /// Module-scope declarations (private and workgroup variables) of
    /// kernels that need them besides `red` (row kernels).
    decls: String,
    /// Set while a segment of a multi-tensor kernel is written: the
    /// bindings its inputs and outputs have in the whole kernel.
    slots: Option<multi::Slots>,
    /// Value functions written so far, by prefix and node (`('n', 7)` is
    /// `n7`): segments of a multi-tensor kernel may share nodes, and each
    /// function is written once.
    defined: BTreeSet<(char, u32)>,
    /// The body of a split-K matmul's second pass ([`Passes::SplitK`]):
    /// the main body is the first pass, writing partials to scratch as
    /// `out0`; the second also binds the kernel's inputs (see
    /// [`Wgsl::binds_inputs`]).
    split: Option<matmul::SplitSum>,
}

/// The second pass of a two-pass reduction: a kernel reading the
/// `scratch` partials (binding 1) and writing the outputs (binding 2);
/// their element types are the schedule's ([`Passes::Partials`]).
struct SecondPass {
    body: String,
    invocations: u64,
    scratch: u64,
}

impl Writer<'_> {
    /// Writes helper `h`, and the helpers it calls, into the kernel.
    fn use_helper(&mut self, h: Helper) {
        if self.helpers.insert(h) {
            for &n in h.needs() {
                self.use_helper(n);
            }
        }
    }

    /// Writes the value function `nK(i)` of inlined node `id`; for a node
    /// of no element, which is never evaluated, a stub standing in for
    /// index math that would divide by zero (reliability finding 1).
    fn value_fn(&mut self, id: NodeId) -> Result<(), LowerError> {
        let n = self.g.node(id);
        if n.shape.numel() > 0 {
            return self.node_fn(id, None);
        }
        if self.defined.insert(('n', id.0)) {
            let _ =
                writeln!(self.funcs, "fn n{}(i: u32) -> {} {{\n    return {};\n}}\n", id.0, ty(n.dtype), zero(n.dtype));
        }
        Ok(())
    }

    /// Writes the value function of inlined node `id`: `nK(i)`, or with
    /// `epi = Some((matmul, dependents))` the epilogue form `eK(i, mm)`,
    /// where the matmul's value is `mm` and dependents are evaluated at the
    /// same index (the planner guarantees they are same-shape elementwise).
    fn node_fn(&mut self, id: NodeId, epi: Option<(NodeId, &BTreeSet<NodeId>)>) -> Result<(), LowerError> {
        if !self.defined.insert((if epi.is_some() { 'e' } else { 'n' }, id.0)) {
            return Ok(());
        }
        let g = self.g;
        let n = g.node(id);
        let s = &n.shape;
        let inp = |k: usize| g.node(n.inputs[k]);
        let call = |k: usize, idx: &str| match epi {
            Some((mm, _)) if n.inputs[k] == mm => "mm".to_string(),
            Some((_, dep)) if dep.contains(&n.inputs[k]) => format!("e{}(i, mm)", n.inputs[k].0),
            _ => format!("n{}({idx})", n.inputs[k].0),
        };
        let body: String = match &n.op {
            Op::Parameter(_) => unreachable!("parameters are kernel inputs"),
            Op::Constant(v, d) => {
                let c = constant(*v, *d);
                if c.contains("_f()") {
                    self.use_helper(if c.contains("nan") { Helper::NanF } else { Helper::InfF });
                }
                format!("return {c};")
            }
            Op::ScalarParam(k) => {
                let k = self.scalar_member(*k as usize);
                if n.dtype == DType::Bool {
                    format!("return P.s{k} != 0u;")
                } else {
                    format!("return P.s{k};")
                }
            }
            Op::Iota { shape, axis, dtype } => {
                let c = coord("i", shape, *axis);
                format!("return {}({c});", ty(*dtype))
            }
            Op::Unary(u) => {
                let x = format!("let x = {};", call(0, "i"));
                let e = self.unary(*u, inp(0).dtype)?;
                format!("{x}\n    return {e};")
            }
            Op::Binary(b) => {
                let (a, bb) = (inp(0), inp(1));
                let ia = bcast_index("i", s, &a.shape);
                let ib = bcast_index("i", s, &bb.shape);
                let e = self.binary(*b, a.dtype)?;
                format!("let a = {};\n    let b = {};\n    return {e};", call(0, &ia), call(1, &ib))
            }
            Op::Where => {
                let idx: Vec<String> = (0..3).map(|k| bcast_index("i", s, &inp(k).shape)).collect();
                format!("return select({}, {}, {});", call(2, &idx[2]), call(1, &idx[1]), call(0, &idx[0]))
            }
            Op::Cast(to) => {
                let e = self.cast(inp(0).dtype, *to);
                format!("let x = {};\n    return {e};", call(0, "i"))
            }
            Op::Reshape(_) => format!("return {};", call(0, "i")),
            Op::Permute(perm) => {
                let ist = strides(&inp(0).shape);
                let terms = (0..s.rank())
                    .filter(|&d| s.dims()[d] != 1)
                    .map(|d| format!("{} * {}u", coord("i", s, d), ist[perm[d]]))
                    .collect();
                format!("return {};", call(0, &sum(terms)))
            }
            Op::Expand(_) => format!("return {};", call(0, &bcast_index("i", s, &inp(0).shape))),
            Op::Slice { starts, steps, .. } => {
                let ist = strides(&inp(0).shape);
                let mut terms = Vec::new();
                for d in 0..s.rank() {
                    let c = coord("i", s, d);
                    let pos = if steps[d] >= 0 {
                        format!("({}u + {c} * {}u)", starts[d], steps[d])
                    } else {
                        format!("({}u - {c} * {}u)", starts[d], -steps[d])
                    };
                    terms.push(format!("{pos} * {}u", ist[d]));
                }
                format!("return {};", call(0, &sum(terms)))
            }
            Op::Concat { axis } => self.concat_body(id, *axis, 0, n.inputs.len(), "i", "return"),
            Op::Pad { before, mode, .. } => {
                let x = &inp(0).shape;
                let ist = strides(x);
                let mut b = String::new();
                let mut terms = Vec::new();
                for d in 0..s.rank() {
                    let dim = x.dims()[d] as i64;
                    let _ = write!(b, "var j{d} = i32({}) - {}i;\n    ", coord("i", s, d), before[d]);
                    match mode {
                        PadMode::Constant => {
                            let _ = write!(
                                b,
                                "if (j{d} < 0i || j{d} >= {dim}i) {{\n        return {};\n    }}\n    ",
                                call(1, "0u")
                            );
                        }
                        PadMode::Reflect => {
                            let _ = write!(
                                b,
                                "if (j{d} < 0i) {{\n        j{d} = -j{d};\n    }}\n    if (j{d} >= {dim}i) {{\n        j{d} = {}i - j{d};\n    }}\n    ",
                                2 * (dim - 1)
                            );
                        }
                        PadMode::Edge => {
                            let _ = write!(b, "j{d} = clamp(j{d}, 0i, {}i);\n    ", (dim - 1).max(0));
                        }
                    }
                    terms.push(format!("u32(j{d}) * {}u", ist[d]));
                }
                let _ = write!(b, "return {};", call(0, &sum(terms)));
                b
            }
            // A small reduction inlined into its consumer (never an
            // epilogue's dependent: the planner keeps such kernels apart).
            Op::Reduce { .. } if epi.is_none() => self.inlined_reduce_body(id),
            // Ops with kernels of their own: never inlined as a value
            // function (the planner makes them kernel roots or inputs).
            other @ (Op::Random { .. }
            | Op::Reduce { .. }
            | Op::ArgReduce { .. }
            | Op::CumSum { .. }
            | Op::Softmax { .. }
            | Op::MatMul
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
            | Op::PrefixAttention) => {
                return Err(LowerError::Unsupported { op: other.name(), dtype: n.dtype });
            }
        };
        match epi {
            Some((mm, _)) => {
                let mt = ty(g.node(mm).dtype);
                let _ = writeln!(self.funcs, "fn e{}(i: u32, mm: {mt}) -> {} {{\n    {body}\n}}\n", id.0, ty(n.dtype));
            }
            None => {
                let _ = writeln!(self.funcs, "fn n{}(i: u32) -> {} {{\n    {body}\n}}\n", id.0, ty(n.dtype));
            }
        }
        Ok(())
    }

    /// Code selecting among concat operands `start..end` of node `id` for
    /// output linear index `var` (within the range's own domain when
    /// `start > 0` or `end < len`); `ret` is `return` or an assignment
    /// prefix such as `v =`.
    fn concat_body(&self, id: NodeId, axis: usize, start: usize, end: usize, var: &str, ret: &str) -> String {
        let g = self.g;
        let n = g.node(id);
        let inner: u64 = n.shape.dims()[axis + 1..].iter().product::<usize>() as u64;
        let lens: Vec<u64> = n.inputs[start..end].iter().map(|x| g.node(*x).shape.dims()[axis] as u64).collect();
        let dl: u64 = lens.iter().sum();
        let mut b = format!(
            "let c = ({var} / {inner}u) % {dl}u;\n    let o = {var} / {}u;\n    let ii = {var} % {inner}u;\n    ",
            (dl * inner).max(1)
        );
        let mut off = 0u64;
        let live: Vec<usize> = (0..lens.len()).filter(|&k| lens[k] > 0).collect();
        for (pos, &k) in live.iter().enumerate() {
            let len = lens[k];
            let idx = format!("o * {}u + (c - {off}u) * {inner}u + ii", len * inner);
            let v = format!("n{}({idx})", n.inputs[start + k].0);
            if pos + 1 == live.len() {
                if ret == "return" || pos == 0 {
                    let _ = write!(b, "{ret} {v};");
                } else {
                    let _ = write!(b, "{{\n        {ret} {v};\n    }}");
                }
            } else {
                let _ = write!(b, "if (c < {}u) {{\n        {ret} {v};\n    }}\n    ", off + len);
                if ret != "return" {
                    let _ = write!(b, "else ");
                }
            }
            off += len;
        }
        if live.is_empty() {
            let _ = write!(b, "{ret} {};", zero(n.dtype));
        }
        b
    }

    fn unary(&mut self, u: UnaryOp, d: DType) -> Result<String, LowerError> {
        use UnaryOp::*;
        let f = reg(d) == DType::F32;
        let unsupported = || LowerError::Unsupported { op: u.name().into(), dtype: d };
        Ok(match u {
            // Float functions on another dtype (which `Op::infer` rejects).
            Exp | Log | Sqrt | Rsqrt | Reciprocal | Sigmoid | Tanh | Gelu | GeluTanh | Erf | Sin | Cos | Floor
            | Ceil | Round | IsNan | IsInf
                if !f =>
            {
                return Err(unsupported())
            }
            Neg => "-x".into(),
            Abs if d == DType::U32 => "x".into(),
            Abs => "abs(x)".into(),
            Exp => "exp(x)".into(),
            Log => "log(x)".into(),
            Sqrt => "sqrt(x)".into(),
            Rsqrt => "inverseSqrt(x)".into(),
            Reciprocal => "1.0 / x".into(),
            Relu if f => {
                self.use_helper(Helper::ReluF);
                "relu_f(x)".into()
            }
            Relu if d == DType::I32 => "max(x, 0i)".into(),
            Relu => "x".into(),
            Sigmoid => "1.0 / (1.0 + exp(-x))".into(),
            Tanh => {
                self.use_helper(Helper::TanhF);
                "tanh_f(x)".into()
            }
            Gelu => {
                self.use_helper(Helper::ErfF);
                "0.5 * x * (1.0 + erf_f(x * 0.70710678118654752))".into()
            }
            GeluTanh => {
                self.use_helper(Helper::TanhF);
                "0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)))".into()
            }
            Erf => {
                self.use_helper(Helper::ErfF);
                "erf_f(x)".into()
            }
            Sin => "sin(x)".into(),
            Cos => "cos(x)".into(),
            Floor => "floor(x)".into(),
            Ceil => "ceil(x)".into(),
            Round => "round(x)".into(),
            Sign if f => {
                self.use_helper(Helper::SignF);
                "sign_f(x)".into()
            }
            Sign if d == DType::I32 => "sign(x)".into(),
            Sign => "select(0u, 1u, x != 0u)".into(),
            Not => "!x".into(),
            IsNan => {
                self.use_helper(Helper::IsNanF);
                "isnan_f(x)".into()
            }
            IsInf => {
                self.use_helper(Helper::IsInfF);
                "isinf_f(x)".into()
            }
        })
    }

    fn binary(&mut self, b: BinaryOp, d: DType) -> Result<String, LowerError> {
        use BinaryOp::*;
        let f = reg(d) == DType::F32;
        let z = zero(d);
        // WGSL lets drivers assume there is no NaN, and lavapipe folds
        // `x != x` to false. Float comparisons therefore test NaN through
        // the bit pattern (`isnan_f`), which no driver can fold away:
        // ordered comparisons and `==` are false with a NaN operand, `!=`
        // is true.
        if f && b.is_comparison() {
            self.use_helper(Helper::IsNanF);
        }
        let ordered = |op: &str| {
            if d == DType::Bool {
                format!("select(0u, 1u, a) {op} select(0u, 1u, b)")
            } else if f {
                format!("(a {op} b) && !(isnan_f(a) || isnan_f(b))")
            } else {
                format!("a {op} b")
            }
        };
        Ok(match b {
            Add => "a + b".into(),
            Sub => "a - b".into(),
            Mul => "a * b".into(),
            Div if f => "a / b".into(),
            Div => format!("select(a / b, {z}, b == {z})"),
            Pow if f => {
                self.use_helper(Helper::PowF);
                "pow_f(a, b)".into()
            }
            Pow if d == DType::I32 => {
                self.use_helper(Helper::PowI);
                "pow_i(a, b)".into()
            }
            Pow => {
                self.use_helper(Helper::PowU);
                "pow_u(a, b)".into()
            }
            Maximum if f => {
                self.use_helper(Helper::MaxNan);
                "max_nan(a, b)".into()
            }
            Minimum if f => {
                self.use_helper(Helper::MinNan);
                "min_nan(a, b)".into()
            }
            Maximum => "max(a, b)".into(),
            Minimum => "min(a, b)".into(),
            Mod if f => {
                self.use_helper(Helper::ModF);
                "mod_f(a, b)".into()
            }
            Mod | Rem if d == DType::U32 => "select(a % b, 0u, b == 0u)".into(),
            // I32, the one dtype left (`Op::infer` rejects bool).
            Mod => {
                self.use_helper(Helper::ModI);
                "mod_i(a, b)".into()
            }
            Rem if f => "a % b".into(),
            Rem => "select(a % b, 0i, b == 0i)".into(),
            Eq => ordered("=="),
            Ne if f => "(a != b) || isnan_f(a) || isnan_f(b)".into(),
            Ne => "a != b".into(),
            Lt => ordered("<"),
            Le => ordered("<="),
            Gt => ordered(">"),
            Ge => ordered(">="),
            And => "a && b".into(),
            Or => "a || b".into(),
            Xor => "a != b".into(),
            // Float only (`Op::infer` rejects other dtypes).
            LogAddExp => {
                self.use_helper(Helper::LogAddExpF);
                "logaddexp_f(a, b)".into()
            }
        })
    }

    /// The expression casting `x` from `from` to `to`.
    fn cast(&mut self, from: DType, to: DType) -> String {
        self.cast_of(from, to, "x")
    }

    /// The expression casting the value `x` (an expression) from `from`
    /// to `to`.
    fn cast_of(&mut self, from: DType, to: DType, x: &str) -> String {
        if from == to {
            return x.into();
        }
        // f16 and bf16 are f32 in registers: a cast to them rounds the
        // f32 value to their precision (the only rounding inside a fused
        // chain besides the store, see `access`).
        // A cast from them rounds its operand to their precision first (a
        // fused chain carries unrounded f32 values), so the result is that
        // of a value of the dtype, as on the CPU.
        if is_half(from) {
            let round = self.round_fn(from);
            return self.cast_of(DType::F32, to, &format!("{round}({x})"));
        }
        if is_half(to) {
            let x = self.cast_of(from, DType::F32, x);
            let name = self.round_fn(to);
            return format!("{name}({x})");
        }
        match (from, to) {
            (DType::Bool, t) => format!("select({}, {}, {x})", zero(t), one(t)),
            (f, DType::Bool) => format!("{x} != {}", zero(f)),
            (DType::F32, DType::I32) => {
                self.use_helper(Helper::CastF2I);
                format!("cast_f2i({x})")
            }
            (DType::F32, DType::U32) => {
                self.use_helper(Helper::CastF2U);
                format!("cast_f2u({x})")
            }
            (DType::I32, DType::U32) => format!("bitcast<u32>({x})"),
            (DType::U32, DType::I32) => format!("bitcast<i32>({x})"),
            (_, t) => format!("{}({x})", ty(t)),
        }
    }

    /// The name of the helper rounding an f32 value to `half`'s precision
    /// (f16 or bf16), written into the kernel once.
    fn round_fn(&mut self, half: DType) -> &'static str {
        let (key, name, src) = if half == DType::BF16 {
            (0, "round_bf16", access::ROUND_BF16)
        } else {
            (1, "round_f16", access::ROUND_F16)
        };
        if self.defined.insert(('r', key)) {
            self.funcs.push_str(src);
            self.funcs.push('\n');
        }
        name
    }

    /// The statements of `main` (after the bounds check on `t`) and the
    /// invocation count.
    fn main_body(&mut self, k: &Kernel) -> Result<(String, u64), LowerError> {
        let g = self.g;
        let root = k.root();
        let rn = g.node(root);
        let mut b = String::new();
        let invocations: u64;
        match k.kind {
            KernelKind::Elementwise => {
                invocations = rn.shape.numel() as u64;
                for (j, &o) in k.outputs.iter().enumerate() {
                    let d = g.node(o).dtype;
                    let _ = writeln!(b, "    {}", self.output(j).store("t", &store(d, &format!("n{}(t)", o.0))));
                }
            }
            KernelKind::ConcatPart { start, end } => {
                let Op::Concat { axis } = rn.op else { unreachable!("concat part of a non-concat") };
                let inner: u64 = rn.shape.dims()[axis + 1..].iter().product::<usize>() as u64;
                let outer: u64 = rn.shape.dims()[..axis].iter().product::<usize>() as u64;
                let len = |x: &NodeId| g.node(*x).shape.dims()[axis] as u64;
                let off: u64 = rn.inputs[..start].iter().map(len).sum();
                let dl: u64 = rn.inputs[start..end].iter().map(len).sum();
                let total = rn.shape.dims()[axis] as u64;
                invocations = outer * dl * inner;
                let sel = self.concat_body(root, axis, start, end, "t", "v =");
                let _ = writeln!(
                    b,
                    "    var v: {};\n    {sel}\n    let dst = (t / {}u) * {}u + (((t / {inner}u) % {dl}u) + {off}u) * {inner}u + t % {inner}u;\n    {}",
                    ty(rn.dtype),
                    (dl * inner).max(1),
                    total * inner,
                    self.output(0).store("dst", &store(rn.dtype, "v"))
                );
            }
            KernelKind::Reduce => invocations = self.reduce_kernel(k, &mut b),
            KernelKind::ArgReduce => invocations = self.arg_reduce_kernel(k, &mut b),
            KernelKind::Softmax => invocations = self.softmax_kernel(k, &mut b),
            KernelKind::CumSum => invocations = self.cumsum_kernel(k, &mut b),
            KernelKind::MatMul => {
                invocations = match self.s.matmul().form {
                    MatmulForm::Tiled(tile) => self.matmul_tiled(k, tile, 1, &mut b),
                    MatmulForm::SplitK { tile, parts } => {
                        let first = self.matmul_tiled(k, tile, parts as u64, &mut b);
                        self.split = Some(self.matmul_split_sum(k, parts as u64));
                        first
                    }
                    MatmulForm::RegisterBlocked => self.matmul(k, &mut b),
                    MatmulForm::Cooperative(tile) => self.matmul_coop(k, tile, &mut b),
                    MatmulForm::ByShape => unreachable!("the schedule holds a concrete form"),
                };
            }
            KernelKind::Gather => invocations = self.gather_kernel(k, &mut b),
            KernelKind::ScatterAdd => invocations = self.scatter_add_kernel(k, &mut b),
            KernelKind::Pool => invocations = self.pool_kernel(k, &mut b),
            KernelKind::PoolGrad => invocations = self.pool_grad_kernel(k, &mut b),
            KernelKind::Random => {
                let Op::Random { dist, .. } = &rn.op else { unreachable!() };
                invocations = rn.shape.numel() as u64;
                self.use_helper(Helper::RandomU);
                let key = format!("vec2<u32>(n{}(0u), n{}(0u))", rn.inputs[0].0, rn.inputs[1].0);
                match dist {
                    RandomDist::Uniform => {
                        let _ = writeln!(b, "    {}", self.output(0).store("t", &format!("random_u({key}, t)")));
                    }
                    RandomDist::Normal => {
                        let _ = writeln!(
                            b,
                            "    let key = {key};\n    let base = t & 0xfffffffeu;\n    let u1 = 1.0 - random_u(key, base);\n    let u2 = random_u(key, base + 1u);\n    let r = sqrt(-2.0 * log(u1));\n    let th = 6.2831855 * u2;\n    {}",
                            self.output(0).store("t", "select(r * sin(th), r * cos(th), (t & 1u) == 0u)")
                        );
                    }
                }
            }
            KernelKind::Rows => invocations = self.rows_kernel(k, &mut b)?,
            KernelKind::Attention => invocations = self.attention_kernel(k, &mut b),
            KernelKind::Conv2d => invocations = self.conv_kernel(k, &mut b),
            KernelKind::MultiTensor => unreachable!("multi-tensor kernels are lowered by `Writer::multi_tensor`"),
            KernelKind::Quant => invocations = self.quant_kernel(k, self.s.quant(), &mut b),
            KernelKind::Cache => {
                invocations = match rn.op {
                    Op::WriteAt { .. } => self.write_at_kernel(k, &mut b),
                    _ => self.prefix_attention_kernel(k, &mut b),
                }
            }
        }
        Ok((b, invocations))
    }
}
