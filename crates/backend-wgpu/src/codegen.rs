//! Lowering of one planned kernel ([`Kernel`]) to WGSL: a pure,
//! deterministic function of the kernel, the verified graph and the limits.
//!
//! Every inlined node becomes a function `nK(i: u32) -> T` returning its
//! value at row-major linear index `i` of its own shape; views are index
//! math on that argument, so nothing is materialized. Materialized inputs
//! are storage buffers read by the same kind of function. Binding 0 is the
//! uniform of lifted scalars (`P.sK`, plus `P.z`, always 0, used to build
//! NaN and infinity at run time); inputs follow in the kernel's order, then
//! outputs. Bools are `bool` in registers and one `u32` per element in
//! buffers. Shapes are baked in as constants; scalars never are.
//!
//! Elementwise kernels that need no index math (see
//! [`straight_line_width`]) are written in straight-line form instead: vec4
//! loads, one value function per node applied per lane (the same
//! expressions as the indexed form), vec4 stores, several vectors per
//! invocation. Softmax and matmul have their own loop structures (see
//! `main_body`).

use lazuli_ir::fusion::{Kernel, KernelKind};
use lazuli_ir::{
    ArgReduceOp, BinaryOp, DType, NodeId, Op, PadMode, RandomDist, ReduceOp, ScalarValue, Shape, UnaryOp, VerifiedGraph,
};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use thiserror::Error;

/// Invocations per workgroup of every generated kernel.
pub const WORKGROUP_SIZE: u32 = 256;

/// Limits that shape generated code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowerLimits {
    /// Largest element count one tensor may have (indices are u32).
    pub max_elements: u64,
    /// Whether row-wise kernels (softmax) split a row over several
    /// invocations that combine through workgroup memory. Right for GPUs;
    /// on a software adapter (lavapipe) a workgroup barrier costs more than
    /// it saves, so one invocation walks each row.
    pub cooperative_rows: bool,
    /// Whether matmul stages operand tiles in workgroup memory (the GPU
    /// form, [`MATMUL_TILE`]) instead of the barrier-free register-blocked
    /// form that suits llvmpipe (measured there: tiled 3x slower).
    pub tiled_matmul: bool,
}

impl Default for LowerLimits {
    fn default() -> Self {
        LowerLimits::gpu()
    }
}

impl LowerLimits {
    /// The forms a GPU adapter selects.
    pub fn gpu() -> LowerLimits {
        LowerLimits { max_elements: u32::MAX as u64, cooperative_rows: true, tiled_matmul: true }
    }

    /// The forms a software adapter (llvmpipe) selects.
    pub fn software() -> LowerLimits {
        LowerLimits { cooperative_rows: false, tiled_matmul: false, ..LowerLimits::gpu() }
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

/// True for the dtypes this generator handles.
pub fn dtype_supported(d: DType) -> bool {
    matches!(d, DType::F32 | DType::I32 | DType::U32 | DType::Bool)
}

/// True for the ops this generator handles (dtypes checked separately).
pub fn op_supported(op: &Op) -> bool {
    !matches!(op, Op::Conv2d(_) | Op::Pool(_))
}

/// Lowers `kernel` of `graph` to WGSL.
pub fn lower(kernel: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Wgsl, LowerError> {
    let mut w = Writer {
        g: graph,
        helpers: BTreeSet::new(),
        funcs: String::new(),
        cooperative: None,
        workgroup: None,
        shared: String::new(),
        limits: *limits,
    };
    for &id in kernel.inputs.iter().chain(&kernel.inline).chain(&kernel.outputs) {
        let n = graph.node(id);
        if !dtype_supported(n.dtype) || !op_supported(&n.op) {
            return Err(LowerError::Unsupported { op: n.op.name(), dtype: n.dtype });
        }
        if n.shape.numel() as u64 > limits.max_elements {
            return Err(LowerError::TooLarge { op: n.op.name(), elements: n.shape.numel() as u64 });
        }
    }
    let root = kernel.root();
    let concat_part_root = matches!(kernel.kind, KernelKind::ConcatPart { .. }).then_some(root);
    let width = straight_line_width(kernel, graph);
    let root_numel = graph.node(root).shape.numel();
    // Whether input `id` is read as one vector per invocation step.
    let row_vec = vector_rows(kernel, graph, limits);
    let mm = (kernel.kind == KernelKind::MatMul && !limits.tiled_matmul).then(|| matmul_shape(kernel, graph));
    let mm_vec = |id: NodeId| {
        mm.as_ref()
            .is_some_and(|p| p.a_vec == Some(id) || p.b_vec == Some(id) || p.a_t == Some(id) || p.b_t == Some(id))
    };
    let vector_input = |id: NodeId| {
        (width == Some(4) && graph.node(id).shape.numel() == root_numel)
            || (row_vec && kernel.inputs[0] == id)
            || mm_vec(id)
    };
    let vector_output = width == Some(4) || row_vec || mm.as_ref().is_some_and(|p| p.out_vec);
    for (k, &id) in kernel.inputs.iter().enumerate() {
        let n = graph.node(id);
        if (width.is_some() && n.shape.numel() == root_numel) || row_vec {
            // Read in `main` by the straight-line or vector-row path.
            continue;
        }
        let load = if n.dtype == DType::Bool {
            format!("in{k}[i] != 0u")
        } else if mm_vec(id) {
            // Bound as vectors for the matmul loop; views read lanes.
            format!("in{k}[i >> 2u][i & 3u]")
        } else {
            format!("in{k}[i]")
        };
        let _ = writeln!(w.funcs, "fn n{}(i: u32) -> {} {{\n    return {load};\n}}\n", id.0, ty(n.dtype));
    }
    let (body, invocations) = match width {
        // No output elements: never dispatched, and its index math would
        // divide by a zero dim, which naga rejects (reliability finding 1).
        _ if root_numel == 0 => (String::new(), 0),
        Some(width) => w.straight_line(kernel, width)?,
        None if row_vec => w.softmax_rows_vec4(kernel),
        None => {
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
                    w.node_fn(id, Some((mmn, &dependent)))?;
                }
            }
            for &id in &kernel.inline {
                if Some(id) == concat_part_root || Some(id) == mm_node || dependent.contains(&id) {
                    continue;
                }
                // A zero-size node is never evaluated; a stub stands in for
                // index math that would divide by zero (finding 1).
                let n = graph.node(id);
                if n.shape.numel() == 0 {
                    let _ = writeln!(
                        w.funcs,
                        "fn n{}(i: u32) -> {} {{\n    return {};\n}}\n",
                        id.0,
                        ty(n.dtype),
                        zero(n.dtype)
                    );
                    continue;
                }
                w.node_fn(id, None)?;
            }
            w.main_body(kernel)?
        }
    };
    // Assemble.
    let mut s = String::new();
    s.push_str("// generated by lazuli-wgpu\n");
    s.push_str("struct Params {\n    z: u32,\n");
    for (k, d) in graph.scalars.iter().enumerate() {
        let _ = writeln!(s, "    s{k}: {},", storage_ty(*d));
    }
    s.push_str("}\n\n@group(0) @binding(0) var<uniform> P: Params;\n");
    for (k, &id) in kernel.inputs.iter().enumerate() {
        let d = graph.node(id).dtype;
        let elem = if vector_input(id) { format!("vec4<{}>", storage_ty(d)) } else { storage_ty(d).to_string() };
        let _ = writeln!(s, "@group(0) @binding({}) var<storage, read> in{k}: array<{elem}>;", k + 1);
    }
    for (k, &id) in kernel.outputs.iter().enumerate() {
        let d = graph.node(id).dtype;
        let elem = if vector_output { format!("vec4<{}>", storage_ty(d)) } else { storage_ty(d).to_string() };
        let _ = writeln!(
            s,
            "@group(0) @binding({}) var<storage, read_write> out{k}: array<{elem}>;",
            kernel.inputs.len() + 1 + k
        );
    }
    s.push('\n');
    for h in &w.helpers {
        s.push_str(helper_source(h));
        s.push('\n');
    }
    s.push_str(&w.funcs);
    if let Some(lanes) = w.workgroup {
        // Kernels written per workgroup (matmul): `main` derives `t`.
        s.push_str(&w.shared);
        let _ = write!(
            s,
            "@compute @workgroup_size({lanes})\nfn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n{body}}}\n"
        );
    } else if let Some(shared) = w.cooperative {
        // Cooperative kernels: invocations work together through
        // workgroup memory and barriers, so none may return early.
        let _ = write!(
            s,
            "var<workgroup> red: array<{shared}, {WORKGROUP_SIZE}>;\n\n@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n{body}}}\n"
        );
    } else {
        let _ = write!(
            s,
            "@compute @workgroup_size({WORKGROUP_SIZE})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n    let t = gid.x + gid.y * nwg.x * {WORKGROUP_SIZE}u;\n    if (t >= {invocations}u) {{\n        return;\n    }}\n{body}}}\n"
        );
    }
    Ok(Wgsl {
        source: s,
        entry: "main",
        invocations,
        inputs: kernel.inputs.len(),
        outputs: kernel.outputs.len(),
        workgroup_size: w.workgroup.unwrap_or(WORKGROUP_SIZE),
    })
}

/// Whether softmax kernel `k` walks its rows with vec4 loads and stores:
/// one invocation per row (no cooperative rows), rows contiguous with a
/// length divisible by 4, and the operand read straight from a buffer.
fn vector_rows(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> bool {
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

/// Most output rows one matmul invocation computes (register blocking).
pub const MATMUL_ROWS: u64 = 16;

/// Output tile (square) of one workgroup of the tiled (GPU) matmul; each of
/// its 256 invocations computes a 4 x 4 block.
pub const MATMUL_TILE: u64 = 64;

/// Depth of the k-slices the tiled matmul stages in workgroup memory.
pub const MATMUL_TILE_K: u64 = 16;

/// Most invocations per matmul workgroup.
pub const MATMUL_LANES: u64 = 128;

/// The layout of a matmul kernel (see `Writer::matmul`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct MatMulShape {
    /// Output rows per invocation.
    rows: u64,
    /// vec4 column groups per invocation.
    vecs: u64,
    /// Invocations per workgroup.
    lanes: u64,
    /// Invocations of a workgroup along rows (`lanes / row_lanes` along
    /// columns). 1 unless N is narrow: then lanes also split rows, and
    /// loads of A are no longer workgroup-uniform.
    row_lanes: u64,
    /// The A operand when it is read as vec4 along k (a kernel input,
    /// K divisible by 4).
    a_vec: Option<NodeId>,
    /// When A is an inlined transpose (last two dims swapped) of kernel
    /// input `src` and M is divisible by 4: `src`, read as vec4 along m
    /// (4 consecutive rows of A at one k).
    a_t: Option<NodeId>,
    /// When B is an inlined transpose of kernel input `src` and K is
    /// divisible by 4: `src`, read as vec4 along k (one column of B).
    b_t: Option<NodeId>,
    /// The B operand when it is read as vec4 along n (a kernel input,
    /// N divisible by 4).
    b_vec: Option<NodeId>,
    /// Whether the output is written as vec4 (N divisible by 4).
    out_vec: bool,
}

/// Chooses the layout of matmul kernel `k`: each invocation computes
/// `rows` x `4 * vecs` outputs; one workgroup covers `rows` rows and
/// `lanes * 4 * vecs` columns, so loads of A are uniform across the
/// workgroup (one load broadcast to all lanes on llvmpipe) and loads of B
/// are vec4 per lane where aligned.
fn matmul_shape(k: &Kernel, g: &VerifiedGraph) -> MatMulShape {
    let rn = g.node(k.matmul_node(g).expect("matmul kernel"));
    let r = rn.shape.rank();
    let (m, n) = (rn.shape.dims()[r - 2] as u64, rn.shape.dims()[r - 1] as u64);
    let a = g.node(rn.inputs[0]);
    let kk = a.shape.dims()[a.shape.rank() - 1] as u64;
    let vec_ok = |id: NodeId, dim: u64| {
        k.inputs.contains(&id) && g.node(id).dtype != DType::Bool && dim.is_multiple_of(4) && dim > 0
    };
    // Wide outputs: the workgroup shares its rows, lanes split columns.
    // Narrow ones (fewer than 8 lanes' worth of columns): each lane takes
    // all (or most) columns and lanes split rows too.
    let (rows, vecs, lanes, row_lanes) = if n >= 64 {
        let vecs = 2;
        (m.clamp(1, MATMUL_ROWS), vecs, n.div_ceil(4 * vecs).next_multiple_of(8).min(MATMUL_LANES), 1)
    } else {
        let vecs = if n <= 12 { n.div_ceil(4).max(1) } else { 2 };
        let col_lanes = n.div_ceil(4 * vecs).max(1);
        let rows = m.clamp(1, 8);
        let row_lanes = 8u64.div_ceil(col_lanes).min(m.div_ceil(rows)).max(1);
        (rows, vecs, col_lanes * row_lanes, row_lanes)
    };
    // An inlined transpose of a kernel input, read straight from it.
    let transposed = |x: NodeId, dim: u64| {
        let xn = g.node(x);
        let Op::Permute(perm) = &xn.op else { return None };
        let r = perm.len();
        let swapped = (0..r).all(|d| {
            perm[d]
                == if d + 2 == r {
                    r - 1
                } else if d + 1 == r {
                    r - 2
                } else {
                    d
                }
        });
        let src = xn.inputs[0];
        (swapped
            && k.inline.contains(&x)
            && k.inputs.contains(&src)
            && g.node(src).dtype != DType::Bool
            && dim.is_multiple_of(4)
            && dim > 0)
            .then_some(src)
    };
    let a_t = transposed(rn.inputs[0], m);
    let b_t = transposed(rn.inputs[1], kk);
    MatMulShape {
        rows,
        vecs,
        lanes,
        row_lanes,
        a_t,
        b_t,
        a_vec: vec_ok(rn.inputs[0], kk).then_some(rn.inputs[0]),
        b_vec: vec_ok(rn.inputs[1], n).then_some(rn.inputs[1]),
        out_vec: n.is_multiple_of(4),
    }
}

/// Reductions at least this long with at most
/// [`REDUCE_COOPERATIVE_OUTPUTS`] outputs use one workgroup per output.
pub const REDUCE_COOPERATIVE_LEN: u64 = 4096;

/// See [`REDUCE_COOPERATIVE_LEN`].
pub const REDUCE_COOPERATIVE_OUTPUTS: u64 = 256;

/// Elements a reduction loop handles per iteration (unrolled).
pub const REDUCE_UNROLL: u64 = 8;

/// Invocations that share one softmax row (at most; fewer for short rows).
pub const SOFTMAX_THREADS_PER_ROW: u64 = 64;

/// Vectors each invocation of a large straight-line elementwise kernel
/// handles (consecutive ones: on lavapipe, fewer and longer invocations
/// beat one vector per invocation).
pub const STRAIGHT_LINE_STEPS: u64 = 16;

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

struct Writer<'a> {
    g: &'a VerifiedGraph,
    helpers: BTreeSet<&'static str>,
    funcs: String,
    /// Set by cooperative kernels: the element type of the workgroup
    /// array `red`; `main` then has no early return.
    cooperative: Option<&'static str>,
    /// Set by kernels written per workgroup (matmul): the workgroup size;
    /// `main` gets `lid`, `wid`, `nwg` and the body defines `t`.
    workgroup: Option<u32>,
    /// Workgroup-memory declarations of kernels written per workgroup.
    shared: String,
    limits: LowerLimits,
}

/// WGSL register type of a dtype.
fn ty(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::Bool => "bool",
        _ => "u32",
    }
}

/// WGSL buffer element type of a dtype.
fn storage_ty(d: DType) -> &'static str {
    match d {
        DType::Bool => "u32",
        other => ty(other),
    }
}

fn store(d: DType, v: &str) -> String {
    if d == DType::Bool {
        format!("select(0u, 1u, {v})")
    } else {
        v.to_string()
    }
}

/// Row-major strides as u64.
fn strides(s: &Shape) -> Vec<u64> {
    s.strides().into_iter().map(|x| x as u64).collect()
}

/// WGSL expression for coordinate `d` of linear index `var` in `shape`.
fn coord(var: &str, shape: &Shape, d: usize) -> String {
    let st = strides(shape);
    let dim = shape.dims()[d] as u64;
    // An empty shape has no coordinates to compute (and a zero dim or
    // stride would be a division by zero, which naga rejects).
    if dim == 1 || shape.numel() == 0 {
        return "0u".into();
    }
    let q = if st[d] == 1 { var.to_string() } else { format!("({var} / {}u)", st[d]) };
    if d == 0 {
        q
    } else {
        format!("({q} % {dim}u)")
    }
}

/// Sum of `terms` as a u32 expression.
fn sum(terms: Vec<String>) -> String {
    if terms.is_empty() {
        "0u".into()
    } else {
        terms.join(" + ")
    }
}

/// Index into `from` (broadcasting to `to`, numpy rules) for linear index
/// `var` of `to`.
fn bcast_index(var: &str, to: &Shape, from: &Shape) -> String {
    if to == from {
        return var.to_string();
    }
    let off = to.rank() - from.rank();
    let fs = strides(from);
    let mut terms = Vec::new();
    for (j, &fd) in from.dims().iter().enumerate() {
        if fd == 1 {
            continue;
        }
        let c = coord(var, to, j + off);
        terms.push(if fs[j] == 1 { c } else { format!("{c} * {}u", fs[j]) });
    }
    sum(terms)
}

fn float_lit(v: f64) -> String {
    let f = v as f32;
    if f.is_nan() {
        "nan_f()".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "inf_f()".into()
        } else {
            "(-inf_f())".into()
        }
    } else if f == 0.0 {
        // Opaque to the driver (P.z is always 0): a literal zero lets
        // drivers that assume no Inf/NaN fold x * 0 -> 0 and x / 0 -> 0
        // (seen on lavapipe), breaking IEEE results for Inf/NaN inputs.
        format!("bitcast<f32>({}u | P.z)", f.to_bits())
    } else {
        format!("bitcast<f32>({}u)", f.to_bits())
    }
}

fn int_lit(v: i32) -> String {
    if v == i32::MIN {
        "(-2147483647i - 1i)".into()
    } else if v < 0 {
        format!("({v}i)")
    } else {
        format!("{v}i")
    }
}

fn constant(v: ScalarValue, d: DType) -> String {
    match d {
        DType::F32 => float_lit(v.as_f64()),
        DType::I32 => int_lit(v.as_i64() as i32),
        DType::U32 => format!("{}u", v.as_u64() as u32),
        _ => format!("{}", v.as_bool()),
    }
}

fn zero(d: DType) -> &'static str {
    match d {
        DType::F32 => "0.0",
        DType::I32 => "0i",
        DType::U32 => "0u",
        _ => "false",
    }
}

impl Writer<'_> {
    fn use_helper(&mut self, h: &'static str) {
        self.helpers.insert(h);
        // Dependencies between helpers.
        match h {
            "max_nan" | "min_nan" | "tanh_f" | "relu_f" | "sign_f" | "cast_f2i" | "cast_f2u" => {
                self.helpers.insert("isnan_f");
            }
            "pow_f" => {
                self.helpers.insert("nan_f");
                self.helpers.insert("inf_f");
            }
            "random_u" => {
                self.helpers.insert("philox");
            }
            _ => {}
        }
    }

    /// Writes the value function of inlined node `id`: `nK(i)`, or with
    /// `epi = Some((matmul, dependents))` the epilogue form `eK(i, mm)`,
    /// where the matmul's value is `mm` and dependents are evaluated at the
    /// same index (the planner guarantees they are same-shape elementwise).
    fn node_fn(&mut self, id: NodeId, epi: Option<(NodeId, &BTreeSet<NodeId>)>) -> Result<(), LowerError> {
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
                    self.use_helper(if c.contains("nan") { "nan_f" } else { "inf_f" });
                }
                format!("return {c};")
            }
            Op::ScalarParam(k) => {
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
            other => {
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
        let f = d == DType::F32;
        let unsupported = || LowerError::Unsupported { op: u.name().into(), dtype: d };
        Ok(match u {
            Neg => "-x".into(),
            Abs if d == DType::U32 => "x".into(),
            Abs => "abs(x)".into(),
            Exp if f => "exp(x)".into(),
            Log if f => "log(x)".into(),
            Sqrt if f => "sqrt(x)".into(),
            Rsqrt if f => "inverseSqrt(x)".into(),
            Reciprocal if f => "1.0 / x".into(),
            Relu if f => {
                self.use_helper("relu_f");
                "relu_f(x)".into()
            }
            Relu if d == DType::I32 => "max(x, 0i)".into(),
            Relu => "x".into(),
            Sigmoid if f => "1.0 / (1.0 + exp(-x))".into(),
            Tanh if f => {
                self.use_helper("tanh_f");
                "tanh_f(x)".into()
            }
            Gelu if f => {
                self.use_helper("erf_f");
                "0.5 * x * (1.0 + erf_f(x * 0.70710678118654752))".into()
            }
            GeluTanh if f => {
                self.use_helper("tanh_f");
                "0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)))".into()
            }
            Erf if f => {
                self.use_helper("erf_f");
                "erf_f(x)".into()
            }
            Sin if f => "sin(x)".into(),
            Cos if f => "cos(x)".into(),
            Floor if f => "floor(x)".into(),
            Ceil if f => "ceil(x)".into(),
            Round if f => "round(x)".into(),
            Sign if f => {
                self.use_helper("sign_f");
                "sign_f(x)".into()
            }
            Sign if d == DType::I32 => "sign(x)".into(),
            Sign => "select(0u, 1u, x != 0u)".into(),
            Not => "!x".into(),
            IsNan if f => {
                self.use_helper("isnan_f");
                "isnan_f(x)".into()
            }
            IsInf if f => {
                self.use_helper("isinf_f");
                "isinf_f(x)".into()
            }
            _ => return Err(unsupported()),
        })
    }

    fn binary(&mut self, b: BinaryOp, d: DType) -> Result<String, LowerError> {
        use BinaryOp::*;
        let f = d == DType::F32;
        let z = zero(d);
        // WGSL lets drivers assume there is no NaN, and lavapipe folds
        // `x != x` to false. Float comparisons therefore test NaN through
        // the bit pattern (`isnan_f`), which no driver can fold away:
        // ordered comparisons and `==` are false with a NaN operand, `!=`
        // is true.
        if f && b.is_comparison() {
            self.use_helper("isnan_f");
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
                self.use_helper("pow_f");
                "pow_f(a, b)".into()
            }
            Pow if d == DType::I32 => {
                self.use_helper("pow_i");
                "pow_i(a, b)".into()
            }
            Pow => {
                self.use_helper("pow_u");
                "pow_u(a, b)".into()
            }
            Maximum if f => {
                self.use_helper("max_nan");
                "max_nan(a, b)".into()
            }
            Minimum if f => {
                self.use_helper("min_nan");
                "min_nan(a, b)".into()
            }
            Maximum => "max(a, b)".into(),
            Minimum => "min(a, b)".into(),
            Mod if f => {
                self.use_helper("mod_f");
                "mod_f(a, b)".into()
            }
            Mod if d == DType::I32 => {
                self.use_helper("mod_i");
                "mod_i(a, b)".into()
            }
            Mod | Rem if d == DType::U32 => "select(a % b, 0u, b == 0u)".into(),
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
            _ => return Err(LowerError::Unsupported { op: b.name().into(), dtype: d }),
        })
    }

    fn cast(&mut self, from: DType, to: DType) -> String {
        if from == to {
            return "x".into();
        }
        match (from, to) {
            (DType::Bool, t) => format!("select({}, {}, x)", zero(t), one(t)),
            (f, DType::Bool) => format!("x != {}", zero(f)),
            (DType::F32, DType::I32) => {
                self.use_helper("cast_f2i");
                "cast_f2i(x)".into()
            }
            (DType::F32, DType::U32) => {
                self.use_helper("cast_f2u");
                "cast_f2u(x)".into()
            }
            (DType::I32, DType::U32) => "bitcast<u32>(x)".into(),
            (DType::U32, DType::I32) => "bitcast<i32>(x)".into(),
            (_, t) => format!("{}(x)", ty(t)),
        }
    }

    /// Straight-line form of an elementwise kernel (see
    /// [`straight_line_width`]): every invocation handles up to
    /// [`STRAIGHT_LINE_STEPS`] consecutive vectors of `width` elements;
    /// full-size inputs are loaded once per vector, each node is one call
    /// of a value function per lane (`vK(operands) -> T`, the same
    /// expressions as the indexed form, so semantics are shared), and
    /// single-element nodes are evaluated once, before the loop. Returns
    /// the statements of `main` and the invocation count.
    fn straight_line(&mut self, k: &Kernel, width: u32) -> Result<(String, u64), LowerError> {
        const LANES: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        let n = g.node(k.root()).shape.numel();
        let full = |id: NodeId| g.node(id).shape.numel() == n;
        let vectors = n as u64 / width as u64;
        let steps = if vectors >= STRAIGHT_LINE_STEPS * WORKGROUP_SIZE as u64 * 16 { STRAIGHT_LINE_STEPS } else { 1 };
        let invocations = vectors.div_ceil(steps);
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
            "    for (var q = 0u; q < {steps}u; q = q + 1u) {{\n        let j = t * {steps}u + q;\n        if (j >= {vectors}u) {{\n            break;\n        }}"
        );
        for (slot, &id) in k.inputs.iter().enumerate() {
            if !full(id) {
                continue;
            }
            let d = g.node(id).dtype;
            let _ = writeln!(b, "        let x{} = in{slot}[j];", id.0);
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
                _ => unreachable!("straight_line_width admits only elementwise ops"),
            };
            let _ = writeln!(self.funcs, "fn v{}({params}) -> {} {{\n    return {expr};\n}}\n", id.0, ty(node.dtype));
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
            if width == 4 {
                let _ = writeln!(b, "        out{slot}[j] = vec4<{}>({});", storage_ty(d), vals.join(", "));
            } else {
                let _ = writeln!(b, "        out{slot}[j] = {};", vals[0]);
            }
        }
        b.push_str("    }\n");
        Ok((b, invocations))
    }

    /// Softmax with one invocation per row and vec4 accesses (see
    /// [`vector_rows`]): one pass for the max and the sum (online), one
    /// pass writing; two reads and one write per element.
    fn softmax_rows_vec4(&mut self, k: &Kernel) -> (String, u64) {
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

    /// The statements of `main` (after the bounds check on `t`) and the
    /// invocation count.
    fn main_body(&mut self, k: &Kernel) -> Result<(String, u64), LowerError> {
        let g = self.g;
        let root = k.root();
        let rn = g.node(root);
        let mut b = String::new();
        let mut invocations: u64;
        match k.kind {
            KernelKind::Elementwise => {
                invocations = rn.shape.numel() as u64;
                for (j, &o) in k.outputs.iter().enumerate() {
                    let d = g.node(o).dtype;
                    let _ = writeln!(b, "    out{j}[t] = {};", store(d, &format!("n{}(t)", o.0)));
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
                    "    var v: {};\n    {sel}\n    let dst = (t / {}u) * {}u + (((t / {inner}u) % {dl}u) + {off}u) * {inner}u + t % {inner}u;\n    out0[dst] = {};",
                    ty(rn.dtype),
                    (dl * inner).max(1),
                    total * inner,
                    store(rn.dtype, "v")
                );
            }
            KernelKind::Reduce => {
                let Op::Reduce { op, axes, .. } = &rn.op else { unreachable!() };
                let x = g.node(rn.inputs[0]);
                invocations = rn.shape.numel() as u64;
                let xs = strides(&x.shape);
                let kept: Vec<usize> = (0..x.shape.rank()).filter(|d| !axes.contains(d)).collect();
                let kshape = Shape::new(kept.iter().map(|&d| x.shape.dims()[d]).collect::<Vec<_>>());
                let rshape = Shape::new(axes.iter().map(|&d| x.shape.dims()[d]).collect::<Vec<_>>());
                let base = sum((0..kept.len())
                    .filter(|&j| kshape.dims()[j] != 1)
                    .map(|j| format!("{} * {}u", coord("t", &kshape, j), xs[kept[j]]))
                    .collect());
                // Reduced axes that are the trailing dims, in order, are
                // one contiguous run: the offset is `r` itself.
                let rank = x.shape.rank();
                let trailing = axes.iter().enumerate().all(|(j, &a)| a + axes.len() == rank + j);
                let off = if trailing {
                    "r".to_string()
                } else {
                    sum((0..axes.len())
                        .filter(|&j| rshape.dims()[j] != 1)
                        .map(|j| format!("{} * {}u", coord("r", &rshape, j), xs[axes[j]]))
                        .collect())
                };
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
                let step = |ind: &str, r0: &str, stride: u64| {
                    (0..u)
                        .map(|q| {
                            format!(
                                "{ind}{{\n{ind}    let r = {r0} + {}u;\n{ind}    let v = {load};\n{ind}    acc = {combine};\n{ind}}}\n",
                                q * stride
                            )
                        })
                        .collect::<String>()
                };
                let cooperative = (len >= REDUCE_COOPERATIVE_LEN && outputs <= REDUCE_COOPERATIVE_OUTPUTS)
                    || len / u > LLVMPIPE_LOOP_BUDGET / 2;
                if cooperative {
                    // Few long reductions: one workgroup per output, its
                    // invocations striding over the reduced elements, then
                    // a tree in workgroup memory (8 barriers in all, so
                    // cheap on llvmpipe too, where a single invocation per
                    // output would use one SIMD lane of one core).
                    let wg = WORKGROUP_SIZE as u64;
                    invocations = outputs * wg;
                    self.cooperative = Some(acc_ty);
                    let main = len / (wg * u) * (wg * u);
                    let _ = write!(
                        b,
                        "    let t = wid.x + wid.y * nwg.x;\n    let valid = t < {outputs}u;\n    let base = {base};\n    var acc: {acc_ty} = {init};\n    if (valid) {{\n        for (var r0 = lid; r0 < {main}u; r0 = r0 + {}u) {{\n{}        }}\n        for (var r = {main}u + lid; r < {len}u; r = r + {wg}u) {{\n            let v = {load};\n            acc = {combine};\n        }}\n    }}\n",
                        wg * u,
                        step("            ", "r0", wg)
                    );
                    let _ = writeln!(
                        b,
                        "    red[lid] = acc;\n    workgroupBarrier();\n    for (var h = {}u; h > 0u; h = h >> 1u) {{\n        if (lid < h) {{\n            let acc = red[lid];\n            let v = red[lid + h];\n            red[lid] = {combine};\n        }}\n        workgroupBarrier();\n    }}\n    if (valid && lid == 0u) {{\n        let acc = red[0];\n        out0[t] = {fin};\n    }}",
                        wg / 2
                    );
                } else {
                    let main = len / u * u;
                    let _ = write!(
                        b,
                        "    let base = {base};\n    var acc: {acc_ty} = {init};\n    for (var r0 = 0u; r0 < {main}u; r0 = r0 + {u}u) {{\n{}    }}\n",
                        step("        ", "r0", 1)
                    );
                    if main < len {
                        let _ = writeln!(
                            b,
                            "    for (var r = {main}u; r < {len}u; r = r + 1u) {{\n        let v = {load};\n        acc = {combine};\n    }}"
                        );
                    }
                    let _ = writeln!(b, "    out0[t] = {fin};");
                }
            }
            KernelKind::ArgReduce => {
                let Op::ArgReduce { op, axis, select_last, .. } = &rn.op else { unreachable!() };
                let x = g.node(rn.inputs[0]);
                invocations = rn.shape.numel() as u64;
                let (base, stride, len) = line(&x.shape, *axis);
                let cmp = if *op == ArgReduceOp::ArgMax { ">" } else { "<" };
                let f = x.dtype == DType::F32;
                let conv = if x.dtype == DType::Bool { "select(0u, 1u, " } else { "(" };
                let mut better = format!("v {cmp} best");
                if *select_last {
                    better = format!("{better} || v == best");
                }
                if f {
                    self.use_helper("isnan_f");
                    better = if *select_last {
                        format!("isnan_f(v) || (!isnan_f(best) && ({better}))")
                    } else {
                        format!("!isnan_f(best) && (isnan_f(v) || {better})")
                    };
                }
                let head = format!("for (var j = 1u; j < {len}u; j = j + 1u) {{");
                let _ = writeln!(
                    b,
                    "    let base = {base};\n    var best = {conv}n{x}(base));\n    var bi = 0u;\n    {head}\n        let v = {conv}n{x}(base + j * {stride}u));\n        if ({better}) {{\n            best = v;\n            bi = j;\n        }}\n    }}\n    out0[t] = i32(bi);",
                    x = x_id(rn)
                );
            }
            KernelKind::Softmax => {
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
                    return Ok((b, invocations));
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
            }
            KernelKind::CumSum => {
                let Op::CumSum { axis, exclusive, reverse } = &rn.op else { unreachable!() };
                let x = g.node(rn.inputs[0]);
                let len = x.shape.dims()[*axis] as u64;
                invocations = (x.shape.numel() as u64).checked_div(len).unwrap_or(0);
                let (base, stride, _) = line(&x.shape, *axis);
                let jj = if *reverse { format!("({len}u - 1u - q)") } else { "q".into() };
                let head = format!("for (var q = 0u; q < {len}u; q = q + 1u) {{");
                let (pre, post) = if *exclusive {
                    ("out0[idx] = acc;\n        acc = acc + v;", "")
                } else {
                    ("acc = acc + v;\n        out0[idx] = acc;", "")
                };
                let _ = writeln!(
                    b,
                    "    let base = {base};\n    var acc: {} = {};\n    {head}\n        let idx = base + {jj} * {stride}u;\n        let v = n{}(idx);\n        {pre}{post}\n    }}",
                    ty(rn.dtype),
                    zero(rn.dtype),
                    x_id(rn)
                );
            }
            KernelKind::MatMul => {
                invocations =
                    if self.limits.tiled_matmul { self.matmul_tiled(k, &mut b) } else { self.matmul(k, &mut b) };
            }
            KernelKind::Gather => {
                let Op::Gather { axis } = &rn.op else { unreachable!() };
                let (x, ix) = (g.node(rn.inputs[0]), g.node(rn.inputs[1]));
                invocations = rn.shape.numel() as u64;
                let inner: u64 = x.shape.dims()[axis + 1..].iter().product::<usize>() as u64;
                let dim = x.shape.dims()[*axis] as i64;
                let ni = (ix.shape.numel() as u64).max(1);
                let load_idx = if ix.dtype == DType::U32 {
                    format!("i32(min(n{}(j), {}u))", rn.inputs[1].0, dim.max(1) - 1)
                } else {
                    format!("n{}(j)", rn.inputs[1].0)
                };
                let _ = writeln!(
                    b,
                    "    let ii = t % {inner}u;\n    let j = (t / {inner}u) % {ni}u;\n    let o = t / {};\n    var ix = {load_idx};\n    if (ix < 0i) {{\n        ix = ix + {dim}i;\n    }}\n    ix = clamp(ix, 0i, {});\n    out0[t] = {};",
                    (inner * ni).max(1),
                    (dim - 1).max(0),
                    store(rn.dtype, &format!("n{}(o * {}u + u32(ix) * {inner}u + ii)", rn.inputs[0].0, dim as u64 * inner))
                );
            }
            KernelKind::Random => {
                let Op::Random { dist, .. } = &rn.op else { unreachable!() };
                invocations = rn.shape.numel() as u64;
                self.use_helper("random_u");
                let key = format!("vec2<u32>(n{}(0u), n{}(0u))", rn.inputs[0].0, rn.inputs[1].0);
                match dist {
                    RandomDist::Uniform => {
                        let _ = writeln!(b, "    out0[t] = random_u({key}, t);");
                    }
                    RandomDist::Normal => {
                        let _ = writeln!(
                            b,
                            "    let key = {key};\n    let base = t & 0xfffffffeu;\n    let u1 = 1.0 - random_u(key, base);\n    let u2 = random_u(key, base + 1u);\n    let r = sqrt(-2.0 * log(u1));\n    let th = 6.2831855 * u2;\n    out0[t] = select(r * sin(th), r * cos(th), (t & 1u) == 0u);"
                        );
                    }
                }
            }
            KernelKind::Conv2d | KernelKind::Pool => {
                return Err(LowerError::Unsupported { op: rn.op.name(), dtype: rn.dtype });
            }
        }
        Ok((b, invocations))
    }

    /// Matmul in the GPU form: a workgroup of 16 x 16 invocations owns a
    /// [`MATMUL_TILE`]-square output tile; per k-slice of
    /// [`MATMUL_TILE_K`] it stages the A and B tiles in workgroup memory
    /// (operands read through their value functions, so views and partial
    /// tiles need no special case: out-of-range elements load as zero),
    /// then every invocation accumulates a 4 x 4 register block. The
    /// epilogue, if any, is applied at the store. Returns the invocation
    /// count.
    fn matmul_tiled(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.matmul_node(g).expect("matmul kernel"));
        let (a, bn) = (g.node(rn.inputs[0]), g.node(rn.inputs[1]));
        let r = rn.shape.rank();
        let (m, nn) = (rn.shape.dims()[r - 2] as u64, rn.shape.dims()[r - 1] as u64);
        let kk = a.shape.dims()[a.shape.rank() - 1] as u64;
        let batch = Shape::new(&rn.shape.dims()[..r - 2]);
        let ai = bcast_index("bi", &batch, &Shape::new(&a.shape.dims()[..a.shape.rank() - 2]));
        let bi = bcast_index("bi", &batch, &Shape::new(&bn.shape.dims()[..bn.shape.rank() - 2]));
        let (tile, tk) = (MATMUL_TILE, MATMUL_TILE_K);
        let (mb, nb) = (m.div_ceil(tile), nn.div_ceil(tile));
        let groups = batch.numel() as u64 * mb * nb;
        let lanes = WORKGROUP_SIZE as u64;
        self.workgroup = Some(WORKGROUP_SIZE);
        let (t_ty, z) = (ty(rn.dtype), zero(rn.dtype));
        let _ = writeln!(
            self.shared,
            "var<workgroup> ta: array<{t_ty}, {}>;\nvar<workgroup> tb: array<{t_ty}, {}>;\n",
            tile * tk,
            tile * tk
        );
        let (na, nbid) = (rn.inputs[0].0, rn.inputs[1].0);
        let _ = writeln!(
            b,
            "    let gi = wid.x + wid.y * nwg.x;\n    let t = gi * {lanes}u + lid;\n{}    let cb = gi % {nb}u;\n    let rb = (gi / {nb}u) % {mb}u;\n    let bi = gi / {}u;\n    let row0 = rb * {tile}u;\n    let col0 = cb * {tile}u;\n    let tr = lid / 16u;\n    let tc = lid % 16u;\n    let abase = ({ai}) * {}u;\n    let bbase = ({bi}) * {}u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 { format!("    if (gi >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            (mb * nb).max(1),
            m * kk,
            kk * nn
        );
        for i in 0..4 {
            for j in 0..4 {
                let _ = writeln!(b, "    var c{i}_{j}: {t_ty} = {z};");
            }
        }
        let head = format!("for (var k0 = 0u; k0 < {kk}u; k0 = k0 + {tk}u) {{");
        let _ = writeln!(b, "    {head}");
        for e in 0..(tile * tk) / lanes {
            let _ = writeln!(
                b,
                "        {{\n            let l = lid + {}u;\n            let am = l / {tk}u;\n            let ak = l % {tk}u;\n            let gr = row0 + am;\n            let gk = k0 + ak;\n            ta[ak * {tile}u + am] = select({z}, n{na}(abase + min(gr, {}u) * {kk}u + min(gk, {}u)), gr < {m}u && gk < {kk}u);\n            let bk = k0 + l / {tile}u;\n            let bc = col0 + l % {tile}u;\n            tb[l] = select({z}, n{nbid}(bbase + min(bk, {}u) * {nn}u + min(bc, {}u)), bk < {kk}u && bc < {nn}u);\n        }}",
                e * lanes,
                m - 1,
                kk.max(1) - 1,
                kk.max(1) - 1,
                nn - 1
            );
        }
        let _ = writeln!(b, "        workgroupBarrier();\n        for (var q = 0u; q < {tk}u; q = q + 1u) {{");
        for i in 0..4 {
            let _ = writeln!(b, "            let a{i} = ta[q * {tile}u + tr * 4u + {i}u];");
        }
        for j in 0..4 {
            let _ = writeln!(b, "            let b{j} = tb[q * {tile}u + tc * 4u + {j}u];");
        }
        for i in 0..4 {
            for j in 0..4 {
                let _ = writeln!(b, "            c{i}_{j} = c{i}_{j} + a{i} * b{j};");
            }
        }
        let _ = writeln!(b, "        }}\n        workgroupBarrier();\n    }}");
        let _ = writeln!(b, "    let obase = bi * {};", m * nn);
        for i in 0..4 {
            for j in 0..4 {
                let idx = format!("obase + (row0 + tr * 4u + {i}u) * {nn}u + col0 + tc * 4u + {j}u");
                let acc = format!("c{i}_{j}");
                let _ = writeln!(b, "    if (row0 + tr * 4u + {i}u < {m}u && col0 + tc * 4u + {j}u < {nn}u) {{");
                for (slot, &o) in k.outputs.iter().enumerate() {
                    let v = if g.node(o).op == Op::MatMul {
                        store(g.node(o).dtype, &acc)
                    } else {
                        store(g.node(o).dtype, &format!("e{}({idx}, {acc})", o.0))
                    };
                    let _ = writeln!(b, "        out{slot}[{idx}] = {v};");
                }
                b.push_str("    }\n");
            }
        }
        groups * lanes
    }

    /// Matmul, written per workgroup (see [`matmul_shape`]): register
    /// blocks of `rows` x `4 * vecs` outputs per invocation, A read once
    /// per workgroup-uniform row (vec4 along k when aligned), B read as
    /// vec4 rows where aligned, 4 k-steps unrolled when K allows. Edge
    /// blocks clamp their loads and skip their stores. No workgroup memory
    /// or barriers: on llvmpipe they cost more than they save (a shared
    /// tiled variant measured 3x slower there). Appends the statements of
    /// `main` to `b`; returns the invocation count.
    fn matmul(&mut self, k: &Kernel, b: &mut String) -> u64 {
        const LANE: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        let rn = g.node(k.matmul_node(g).expect("matmul kernel"));
        let p = matmul_shape(k, g);
        // With an epilogue each output `o` stores `eO(index, accumulator)`.
        let value = |o: NodeId, idx: String, acc: String| {
            let od = g.node(o).dtype;
            if g.node(o).op == Op::MatMul {
                store(od, &acc)
            } else {
                store(od, &format!("e{}({idx}, {acc})", o.0))
            }
        };
        let (a, bn) = (g.node(rn.inputs[0]), g.node(rn.inputs[1]));
        let r = rn.shape.rank();
        let (m, nn) = (rn.shape.dims()[r - 2] as u64, rn.shape.dims()[r - 1] as u64);
        let kk = a.shape.dims()[a.shape.rank() - 1] as u64;
        let batch = Shape::new(&rn.shape.dims()[..r - 2]);
        let ai = bcast_index("bi", &batch, &Shape::new(&a.shape.dims()[..a.shape.rank() - 2]));
        let bi = bcast_index("bi", &batch, &Shape::new(&bn.shape.dims()[..bn.shape.rank() - 2]));
        let (rows, vecs, lanes, lr) = (p.rows, p.vecs, p.lanes, p.row_lanes);
        let lc = lanes / lr;
        let cols = 4 * vecs;
        let (mb, nb) = (m.div_ceil(rows * lr), nn.div_ceil(lc * cols));
        let groups = batch.numel() as u64 * mb * nb;
        self.workgroup = Some(lanes as u32);
        let slot = |id: NodeId| k.inputs.iter().position(|&x| x == id).expect("vector operand is an input");
        let (na, nbid) = (rn.inputs[0].0, rn.inputs[1].0);
        let t_ty = ty(rn.dtype);
        let fma = rn.dtype == DType::F32;
        let _ = writeln!(
            b,
            "    let gi = wid.x + wid.y * nwg.x;\n    let t = gi * {lanes}u + lid;\n{}    let cb = gi % {nb}u;\n    let rb = (gi / {nb}u) % {mb}u;\n    let bi = gi / {}u;\n    let r0 = (rb * {lr}u + lid / {lc}u) * {rows}u;\n    let col0 = cb * {}u + (lid % {lc}u) * {cols}u;\n    let abase = ({ai}) * {}u;\n    let bbase = ({bi}) * {}u;",
            // Only a 2-D dispatch has padding groups. Lanes past the last
            // column stay (no divergent return): their loads are clamped
            // and their stores skipped, and llvmpipe keeps loads unmasked.
            if groups > 65535 { format!("    if (gi >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            (mb * nb).max(1),
            lc * cols,
            m * kk,
            kk * nn
        );
        for i in 0..rows {
            let _ = writeln!(b, "    let ar{i} = abase + min(r0 + {i}u, {}u) * {kk}u;", m - 1);
        }
        if p.b_t.is_some() {
            for j in 0..cols {
                let _ = writeln!(b, "    let bc{j} = min(col0 + {j}u, {}u);", nn - 1);
            }
        } else if p.b_vec.is_some() {
            for v in 0..vecs {
                let _ = writeln!(b, "    let bc{v} = bbase / 4u + min(col0 / 4u + {v}u, {}u);", nn / 4 - 1);
            }
        } else {
            for j in 0..cols {
                let _ = writeln!(b, "    let bc{j} = bbase + min(col0 + {j}u, {}u);", nn - 1);
            }
        }
        for i in 0..rows {
            for v in 0..vecs {
                let _ = writeln!(b, "    var c{i}_{v} = vec4<{t_ty}>({});", zero(rn.dtype));
            }
        }
        let ku = if kk.is_multiple_of(4) { 4 } else { 1 };
        let head = format!("for (var k = 0u; k < {kk}u; k = k + {ku}u) {{");
        let _ = writeln!(b, "    {head}");
        // A values per row and k-step.
        let mut av: Vec<Vec<String>> = Vec::new();
        if let Some(id) = p.a_t {
            // Rows r0.. of A at k are consecutive in the transposed source.
            for q in 0..ku {
                for j in 0..rows / 4 {
                    let _ = writeln!(
                        b,
                        "        let at{q}_{j} = in{}[(abase + (k + {q}u) * {m}u) / 4u + min(r0 / 4u + {j}u, {}u)];",
                        slot(id),
                        m / 4 - 1
                    );
                }
            }
        }
        for i in 0..rows {
            if p.a_t.is_some() {
                av.push((0..ku).map(|q| format!("at{q}_{}.{}", i / 4, LANE[(i % 4) as usize])).collect());
            } else if let Some(id) = p.a_vec {
                let _ = writeln!(b, "        let a{i} = in{}[ar{i} / 4u + k / 4u];", slot(id));
                av.push((0..ku).map(|q| format!("a{i}.{}", LANE[q as usize])).collect());
            } else {
                let mut row = Vec::new();
                for q in 0..ku {
                    let _ = writeln!(b, "        let a{i}_{q} = n{na}(ar{i} + k + {q}u);");
                    row.push(format!("a{i}_{q}"));
                }
                av.push(row);
            }
        }
        if let Some(id) = p.b_t {
            // Column j of B at k..k+4 is consecutive in the source.
            for j in 0..cols {
                let _ = writeln!(b, "        let bt{j} = in{}[(bbase + bc{j} * {kk}u + k) / 4u];", slot(id));
            }
        }
        for q in 0..ku {
            let _ = writeln!(b, "        {{\n            let kb = (k + {q}u) * {nn}u;");
            for v in 0..vecs {
                if p.b_t.is_some() {
                    let l: Vec<String> = (0..4).map(|c| format!("bt{}.{}", 4 * v + c, LANE[q as usize])).collect();
                    let _ = writeln!(b, "            let b{v} = vec4<{t_ty}>({});", l.join(", "));
                } else if let Some(id) = p.b_vec {
                    let _ = writeln!(b, "            let b{v} = in{}[bc{v} + kb / 4u];", slot(id));
                } else {
                    let l: Vec<String> = (0..4).map(|c| format!("n{nbid}(bc{} + kb)", 4 * v + c)).collect();
                    let _ = writeln!(b, "            let b{v} = vec4<{t_ty}>({});", l.join(", "));
                }
            }
            for (i, row) in av.iter().enumerate() {
                for v in 0..vecs {
                    let x = &row[q as usize];
                    if fma {
                        let _ = writeln!(b, "            c{i}_{v} = fma(vec4<f32>({x}), b{v}, c{i}_{v});");
                    } else {
                        let _ = writeln!(b, "            c{i}_{v} = c{i}_{v} + vec4<{t_ty}>({x}) * b{v};");
                    }
                }
            }
            b.push_str("        }\n");
        }
        let _ = writeln!(b, "    }}");
        let _ = writeln!(b, "    let obase = bi * {};", m * nn);
        for i in 0..rows {
            for v in 0..vecs {
                if p.out_vec {
                    let idx = format!("obase + (r0 + {i}u) * {nn}u + col0 + {}u", 4 * v);
                    let _ = writeln!(b, "    if (r0 + {i}u < {m}u && col0 / 4u + {v}u < {}u) {{", nn / 4);
                    for (slot, &o) in k.outputs.iter().enumerate() {
                        let vals: Vec<String> = LANE
                            .iter()
                            .enumerate()
                            .map(|(c, lane)| value(o, format!("{idx} + {c}u"), format!("c{i}_{v}.{lane}")))
                            .collect();
                        let _ = writeln!(
                            b,
                            "        out{slot}[(obase + (r0 + {i}u) * {nn}u) / 4u + col0 / 4u + {v}u] = vec4<{}>({});",
                            storage_ty(g.node(o).dtype),
                            vals.join(", ")
                        );
                    }
                    b.push_str("    }\n");
                } else {
                    for (c, lane) in LANE.iter().enumerate() {
                        let col = 4 * v + c as u64;
                        let idx = format!("obase + (r0 + {i}u) * {nn}u + col0 + {col}u");
                        let _ = writeln!(b, "    if (r0 + {i}u < {m}u && col0 + {col}u < {nn}u) {{");
                        for (slot, &o) in k.outputs.iter().enumerate() {
                            let _ = writeln!(
                                b,
                                "        out{slot}[{idx}] = {};",
                                value(o, idx.clone(), format!("c{i}_{v}.{lane}"))
                            );
                        }
                        b.push_str("    }\n");
                    }
                }
            }
        }
        groups * lanes
    }

    /// (accumulator type, init, combine expression over `acc` and `v`,
    /// final value stored) of a reduction.
    fn reduce_parts(&mut self, op: ReduceOp, d: DType, count: usize) -> (&'static str, String, String, String) {
        let f = d == DType::F32;
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
                let init = match (d, is_max) {
                    (DType::F32, true) => {
                        self.use_helper("inf_f");
                        "-inf_f()".to_string()
                    }
                    (DType::F32, false) => {
                        self.use_helper("inf_f");
                        "inf_f()".to_string()
                    }
                    (DType::I32, true) => int_lit(i32::MIN),
                    (DType::I32, false) => int_lit(i32::MAX),
                    (_, true) => "0u".into(),
                    (_, false) => "4294967295u".into(),
                };
                let comb = if f {
                    let h = if is_max { "max_nan" } else { "min_nan" };
                    self.use_helper(h);
                    format!("{h}(acc, v)")
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

/// Loop iterations one invocation may run on llvmpipe: gallivm (Mesa
/// 22.3) counts every loop iteration of an invocation, all loops together,
/// and silently leaves the loop after 65535 (measured: two loops of 40000
/// ran 65534 in all; a sum over 16M elements summed 65535 of them). Loops
/// whose trip count could exceed it are unrolled or spread over more
/// invocations; see [`REDUCE_UNROLL`].
pub const LLVMPIPE_LOOP_BUDGET: u64 = 65535;

fn one(d: DType) -> &'static str {
    match d {
        DType::F32 => "1.0",
        DType::I32 => "1i",
        DType::U32 => "1u",
        _ => "true",
    }
}

fn x_id(n: &lazuli_ir::Node) -> u32 {
    n.inputs[0].0
}

/// For one invocation `t` per line along `axis` of `shape`: the WGSL
/// expression of the line's base index, the axis stride and length.
fn line(shape: &Shape, axis: usize) -> (String, u64, u64) {
    let inner: u64 = shape.dims()[axis + 1..].iter().product::<usize>() as u64;
    let len = shape.dims()[axis] as u64;
    let base = format!("(t / {inner}u) * {}u + t % {inner}u", len * inner);
    (base, inner, len)
}

fn helper_source(name: &str) -> &'static str {
    match name {
        "isnan_f" => "fn isnan_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;\n}\n",
        "isinf_f" => "fn isinf_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;\n}\n",
        "nan_f" => "fn nan_f() -> f32 {\n    return bitcast<f32>(0x7fc00000u | P.z);\n}\n",
        "inf_f" => "fn inf_f() -> f32 {\n    return bitcast<f32>(0x7f800000u | P.z);\n}\n",
        "max_nan" => "fn max_nan(a: f32, b: f32) -> f32 {\n    return select(max(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
        "min_nan" => "fn min_nan(a: f32, b: f32) -> f32 {\n    return select(min(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
        "relu_f" => "fn relu_f(x: f32) -> f32 {\n    return select(max(x, 0.0), x, isnan_f(x));\n}\n",
        "sign_f" => "fn sign_f(x: f32) -> f32 {\n    return select(sign(x), x, isnan_f(x));\n}\n",
        "tanh_f" => "fn tanh_f(x: f32) -> f32 {\n    return select(tanh(clamp(x, -15.0, 15.0)), x, isnan_f(x));\n}\n",
        "erf_f" => concat!(
            "fn erf_f(x: f32) -> f32 {\n",
            "    // Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7).\n",
            "    let ax = abs(x);\n",
            "    let t = 1.0 / (1.0 + 0.3275911 * ax);\n",
            "    let p = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;\n",
            "    let y = 1.0 - p * exp(-ax * ax);\n",
            "    return select(y, -y, x < 0.0);\n",
            "}\n"
        ),
        "pow_f" => concat!(
            "fn pow_f(a: f32, b: f32) -> f32 {\n",
            "    if (b == 0.0) {\n        return 1.0;\n    }\n",
            "    if (a == 0.0) {\n        return select(0.0, inf_f(), b < 0.0);\n    }\n",
            "    let r = pow(abs(a), b);\n",
            "    if (a < 0.0) {\n",
            "        if (floor(b) != b) {\n            return nan_f();\n        }\n",
            "        if (abs(b) < 16777216.0 && (i32(abs(b)) & 1i) == 1i) {\n            return -r;\n        }\n",
            "    }\n",
            "    return r;\n",
            "}\n"
        ),
        "pow_i" => concat!(
            "fn pow_i(a: i32, b: i32) -> i32 {\n",
            "    if (b < 0i) {\n",
            "        if (a == 1i) {\n            return 1i;\n        }\n",
            "        if (a == -1i) {\n            return select(-1i, 1i, (b & 1i) == 0i);\n        }\n",
            "        return 0i;\n",
            "    }\n",
            "    var r = 1i;\n    var base = a;\n    var e = u32(b);\n",
            "    while (e > 0u) {\n        if ((e & 1u) == 1u) {\n            r = r * base;\n        }\n        base = base * base;\n        e = e >> 1u;\n    }\n",
            "    return r;\n",
            "}\n"
        ),
        "pow_u" => concat!(
            "fn pow_u(a: u32, b: u32) -> u32 {\n",
            "    var r = 1u;\n    var base = a;\n    var e = b;\n",
            "    while (e > 0u) {\n        if ((e & 1u) == 1u) {\n            r = r * base;\n        }\n        base = base * base;\n        e = e >> 1u;\n    }\n",
            "    return r;\n",
            "}\n"
        ),
        "mod_f" => concat!(
            "fn mod_f(a: f32, b: f32) -> f32 {\n",
            "    let r = a % b;\n",
            "    return select(r, r + b, r != 0.0 && ((r < 0.0) != (b < 0.0)));\n",
            "}\n"
        ),
        "mod_i" => concat!(
            "fn mod_i(a: i32, b: i32) -> i32 {\n",
            "    if (b == 0i) {\n        return 0i;\n    }\n",
            "    let r = a % b;\n",
            "    return select(r, r + b, r != 0i && ((r < 0i) != (b < 0i)));\n",
            "}\n"
        ),
        "cast_f2i" => concat!(
            "fn cast_f2i(x: f32) -> i32 {\n",
            "    if (isnan_f(x)) {\n        return 0i;\n    }\n",
            "    if (x >= 2147483648.0) {\n        return 2147483647i;\n    }\n",
            "    if (x <= -2147483648.0) {\n        return -2147483647i - 1i;\n    }\n",
            "    return i32(x);\n",
            "}\n"
        ),
        "cast_f2u" => concat!(
            "fn cast_f2u(x: f32) -> u32 {\n",
            "    if (isnan_f(x) || x <= 0.0) {\n        return 0u;\n    }\n",
            "    if (x >= 4294967296.0) {\n        return 4294967295u;\n    }\n",
            "    return u32(x);\n",
            "}\n"
        ),
        "philox" => concat!(
            "fn mulhilo(a: u32, b: u32) -> vec2<u32> {\n",
            "    let a0 = a & 0xffffu;\n    let a1 = a >> 16u;\n    let b0 = b & 0xffffu;\n    let b1 = b >> 16u;\n",
            "    let p00 = a0 * b0;\n    let p01 = a0 * b1;\n    let p10 = a1 * b0;\n    let p11 = a1 * b1;\n",
            "    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);\n",
            "    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);\n",
            "    return vec2<u32>(hi, a * b);\n",
            "}\n\n",
            "fn philox(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {\n",
            "    var c = counter;\n    var k = key;\n",
            "    for (var r = 0u; r < 10u; r = r + 1u) {\n",
            "        if (r > 0u) {\n            k = k + vec2<u32>(0x9E3779B9u, 0xBB67AE85u);\n        }\n",
            "        let m0 = mulhilo(0xD2511F53u, c.x);\n",
            "        let m1 = mulhilo(0xCD9E8D57u, c.z);\n",
            "        c = vec4<u32>(m1.x ^ c.y ^ k.x, m1.y, m0.x ^ c.w ^ k.y, m0.y);\n",
            "    }\n",
            "    return c;\n",
            "}\n"
        ),
        "random_u" => concat!(
            "fn random_u(key: vec2<u32>, i: u32) -> f32 {\n",
            "    let o = philox(vec4<u32>(i / 4u, 0u, 0u, 0u), key);\n",
            "    let bits = o[i % 4u];\n",
            "    return f32(bits >> 8u) * (1.0 / 16777216.0);\n",
            "}\n"
        ),
        _ => unreachable!("unknown helper {name}"),
    }
}
