//! Matmul kernels, batched, with a fused elementwise epilogue: the tiled
//! workgroup-memory form, its split-K variant (two passes: partial
//! products over ranges of K into scratch, then their sum through the
//! epilogue, for products with too few output tiles to fill a GPU) and
//! the barrier-free register-blocked form.
//!
//! The tiled form loads every operand layout along its contiguous axis
//! (row-major, transposed views, transposed views of reshaped inputs,
//! batched and broadcast) and transposes it into one k-major
//! workgroup-memory layout, so its inner loop is the same for all; its
//! loads are clamped into the operands and its stores guarded, which
//! [`trusted`] turns into a shader module without runtime checks.

use super::common::*;
use super::{ceil_div, LowerLimits, MatmulForm, MatmulTile, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, NodeId, Op, Shape, VerifiedGraph};
use std::fmt::Write as _;

/// Most output rows one matmul invocation computes (register blocking),
/// for outputs of at least [`MATMUL_LARGE_M`] rows.
pub const MATMUL_ROWS: u64 = 16;

/// Most output rows per invocation below [`MATMUL_LARGE_M`] rows and
/// [`MATMUL_LARGE_WORK`] multiply-adds, and in kernels generic over
/// sizes. Half the register block of large outputs: small products have
/// little work to amortize a block of 16 rows over,
/// more invocations suit GPUs there (occupancy, parallelism), and the
/// code is far cheaper to compile (llvmpipe JITs a 16-row block of the
/// small GPT's matmuls in 0.3-2.0 s, an 8-row block in 0.25-0.65 s).
pub const MATMUL_SMALL_ROWS: u64 = 8;

/// Output rows from which the register block takes [`MATMUL_ROWS`].
pub const MATMUL_LARGE_M: u64 = 128;

/// Multiply-adds (per batch entry) from which the register block takes
/// [`MATMUL_ROWS`] whatever M: a weight gradient (`[64, 1024] x
/// [1024, 64]`) has work enough to amortize the bigger block.
pub const MATMUL_LARGE_WORK: u64 = 1 << 22;

/// The largest output tile (square) of one workgroup of the tiled (GPU)
/// matmul; each of its 256 invocations then computes 8 x 8 outputs.
pub const MATMUL_TILE: u64 = 128;

/// Depth of the k-slices the tiled matmul stages in workgroup memory.
pub const MATMUL_TILE_K: u64 = 8;

/// Workgroup tiles a tiled matmul should have before a larger tile is
/// chosen (about one wave on a large GPU: 132 SMs on an H100).
pub const MATMUL_MIN_TILES: u64 = 120;

/// Workgroups a split-K matmul aims for: about two waves of an H100
/// (132 SMs), so that every SM has a second workgroup to switch to.
pub const MATMUL_SPLIT_TARGET: u64 = 264;

/// Least depth of K one part of a split-K matmul walks: below it the
/// second pass (reading every partial) costs more than the parallelism
/// gains.
pub const MATMUL_SPLIT_MIN_DEPTH: u64 = 128;

/// Least K a matmul splits: shorter products are cheap per output, and
/// a second pass over their partials would cost about what it saves.
pub const MATMUL_SPLIT_MIN_K: u64 = 1024;

/// Most 32-bit partials a split-K matmul writes (128 MiB, WebGPU's
/// default storage binding limit: scratch is never windowed).
pub const MATMUL_SPLIT_MAX_SCRATCH: u64 = 1 << 25;

/// The K ranges of an f32 tiled matmul of `tiles` workgroup tiles (all
/// batch entries) and `outputs` elements over depth `kk`: 1 (no split)
/// unless the tiles are under one wave ([`MATMUL_MIN_TILES`]) and K is
/// at least [`MATMUL_SPLIT_MIN_K`]; then as many as bring the workgroups
/// to [`MATMUL_SPLIT_TARGET`], each at least [`MATMUL_SPLIT_MIN_DEPTH`]
/// deep. Every part but the last walks [`split_chunk`] of K; the last
/// the rest.
pub fn split_parts(tiles: u64, outputs: u64, kk: u64) -> u64 {
    if tiles == 0 || tiles >= MATMUL_MIN_TILES || kk < MATMUL_SPLIT_MIN_K {
        return 1;
    }
    let want = MATMUL_SPLIT_TARGET.div_ceil(tiles).min(kk / MATMUL_SPLIT_MIN_DEPTH);
    let want = want.min(MATMUL_SPLIT_MAX_SCRATCH / outputs.max(1));
    if want < 2 {
        return 1;
    }
    // Ranges are whole k-slices: rounding the range up may need fewer.
    kk.div_ceil(split_chunk(kk, want))
}

/// Depth of K of each part (but the last) when `kk` is split in `parts`:
/// a multiple of [`MATMUL_TILE_K`].
pub fn split_chunk(kk: u64, parts: u64) -> u64 {
    kk.div_ceil(parts.max(1)).next_multiple_of(MATMUL_TILE_K)
}

/// Bytes of workgroup memory the tiled matmul declares for `tile`
/// (two buffers of A and B slices).
pub fn tiled_workgroup_bytes(tile: MatmulTile) -> u64 {
    2 * MATMUL_TILE_K * (tile.bm as u64 + tile.bn as u64) * 4
}

/// The product a matmul kernel computes, read from its graph once: every
/// form's writer, the form rules and the tuner's key read it from here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulProblem {
    /// The product node.
    pub node: NodeId,
    /// Its operands, `A [.., M, K]` and `B [.., K, N]` (as the product
    /// reads them: views included).
    pub a: NodeId,
    /// See [`MatmulProblem::a`].
    pub b: NodeId,
    /// Output rows.
    pub m: u64,
    /// Output columns.
    pub n: u64,
    /// Depth.
    pub k: u64,
    /// The output's batch dims.
    pub batch: Shape,
    /// A's and B's batch dims (broadcast against `batch`).
    pub a_batch: Shape,
    /// See [`MatmulProblem::a_batch`].
    pub b_batch: Shape,
    /// The product's dtype, and its operands'.
    pub dtype: DType,
    /// See [`MatmulProblem::dtype`].
    pub a_dtype: DType,
    /// See [`MatmulProblem::dtype`].
    pub b_dtype: DType,
}

impl MatmulProblem {
    /// The product of matmul kernel `k` of `g`; `None` for other kernels.
    pub fn of(k: &Kernel, g: &VerifiedGraph) -> Option<MatmulProblem> {
        let node = k.matmul_node(g)?;
        let rn = g.node(node);
        let (a, b) = (rn.inputs[0], rn.inputs[1]);
        let (an, bn) = (g.node(a), g.node(b));
        let r = rn.shape.rank();
        let lead = |s: &Shape| Shape::new(&s.dims()[..s.rank() - 2]);
        Some(MatmulProblem {
            node,
            a,
            b,
            m: rn.shape.dims()[r - 2] as u64,
            n: rn.shape.dims()[r - 1] as u64,
            k: an.shape.dims()[an.shape.rank() - 1] as u64,
            batch: lead(&rn.shape),
            a_batch: lead(&an.shape),
            b_batch: lead(&bn.shape),
            dtype: rn.dtype,
            a_dtype: an.dtype,
            b_dtype: bn.dtype,
        })
    }

    /// Batch entries of the output (1 for a plain product).
    pub fn batches(&self) -> u64 {
        self.batch.numel() as u64
    }

    /// WGSL of A's batch entry for the output's batch index `bi`.
    pub(super) fn a_entry(&self) -> String {
        bcast_index("bi", &self.batch, &self.a_batch)
    }

    /// WGSL of B's batch entry for the output's batch index `bi`.
    pub(super) fn b_entry(&self) -> String {
        bcast_index("bi", &self.batch, &self.b_batch)
    }

    /// Workgroup tiles of `bm` x `bn` outputs over every batch entry.
    fn tiles(&self, bm: u64, bn: u64) -> u64 {
        self.batches() * self.m.div_ceil(bm) * self.n.div_ceil(bn)
    }
}

/// The concrete form of the product `p` under `limits`: `ByShape`
/// resolved by [`choose_form`] (by [`choose_generic_form`] in kernels
/// generic over sizes, which never split K), a split-K form's parts
/// recounted in whole k-slices (the tiled form where that leaves one
/// part, or where the product is not f32 at fixed sizes), and a tile that
/// needs more workgroup memory than the adapter has replaced by the
/// 64 x 64 one. Called by the schedule alone ([`super::schedule`]): one
/// place decides a matmul's form, everything else reads it there.
pub(super) fn resolve_form(p: &MatmulProblem, limits: &LowerLimits) -> MatmulForm {
    // f16 products on tensor cores where the device runs them (by the
    // rule, or forced); forced elsewhere, the rule's f32-compute form.
    if super::coop::eligible(p, limits) {
        match limits.forms.matmul {
            MatmulForm::ByShape => {
                return MatmulForm::Cooperative(super::coop::choose_tile(p, limits, MATMUL_MIN_TILES));
            }
            MatmulForm::Cooperative(t) if t.workgroup_bytes() <= limits.workgroup_storage as u64 => {
                return MatmulForm::Cooperative(t);
            }
            _ => {}
        }
    }
    let form = match limits.forms.matmul {
        MatmulForm::ByShape | MatmulForm::Cooperative(_) if limits.generic => choose_generic_form(p),
        MatmulForm::ByShape | MatmulForm::Cooperative(_) => choose_form(p),
        f @ (MatmulForm::RegisterBlocked | MatmulForm::Tiled(_) | MatmulForm::SplitK { .. }) => f,
    };
    const SMALL: MatmulTile = MatmulTile { bm: 64, bn: 64 };
    // A split (forced, or from the rule) only of f32 at fixed sizes, into
    // ranges of whole k-slices that each hold some of K.
    let form = match form {
        MatmulForm::SplitK { tile, parts } => {
            let kk = p.k;
            let parts = if kk == 0 { 1 } else { kk.div_ceil(split_chunk(kk, parts as u64)) };
            if parts > 1 && p.dtype == DType::F32 && !limits.generic {
                MatmulForm::SplitK { tile, parts: parts as u32 }
            } else {
                MatmulForm::Tiled(tile)
            }
        }
        f => f,
    };
    match form {
        MatmulForm::Tiled(t) if tiled_workgroup_bytes(t) > limits.workgroup_storage as u64 => MatmulForm::Tiled(SMALL),
        MatmulForm::SplitK { tile, parts } if tiled_workgroup_bytes(tile) > limits.workgroup_storage as u64 => {
            MatmulForm::SplitK { tile: SMALL, parts }
        }
        f @ (MatmulForm::RegisterBlocked | MatmulForm::Tiled(_) | MatmulForm::SplitK { .. }) => f,
        MatmulForm::ByShape | MatmulForm::Cooperative(_) => unreachable!("the rules above choose an f32-compute form"),
    }
}

/// How a matmul kernel is written, decided once by the schedule (see
/// [`super::Schedule`]): its product, its concrete form, and, in the
/// f32-compute forms, the layout of its operands and outputs (vec4 loads,
/// transposed reads, the register block).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatmulPlan {
    /// The product.
    pub problem: MatmulProblem,
    /// The concrete form ([`resolve_form`]: never `ByShape`).
    pub form: MatmulForm,
    /// The layout; `None` in the cooperative form, which reads its
    /// operands element by element.
    layout: Option<MatMulShape>,
}

impl MatmulPlan {
    /// The plan of matmul kernel `k` of `g` under `limits`.
    pub(super) fn new(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> MatmulPlan {
        let problem = MatmulProblem::of(k, g).expect("matmul kernel");
        let form = resolve_form(&problem, limits);
        let layout = (!matches!(form, MatmulForm::Cooperative(_))).then(|| matmul_shape(k, g, limits, &problem, form));
        MatmulPlan { problem, form, layout }
    }

    /// The layout of an f32-compute form.
    pub(super) fn layout(&self) -> &MatMulShape {
        self.layout.as_ref().expect("the layout of an f32-compute matmul form")
    }

    /// Whether kernel input `id` is bound as vec4 (an aligned operand,
    /// straight or transposed).
    pub(super) fn vector_input(&self, id: NodeId) -> bool {
        self.layout.as_ref().is_some_and(|p| [p.a_vec, p.b_vec, p.a_t, p.b_t].contains(&Some(id)))
    }

    /// Whether the outputs are bound as vec4.
    pub(super) fn vector_output(&self) -> bool {
        self.layout.as_ref().is_some_and(|p| p.out_vec)
    }

    /// What the tuner keys this product on, besides its adapter and
    /// profile: the problem's sizes and dtypes and how each operand and
    /// the output are laid out (see [`super::Schedule::tuning_key`]).
    pub(super) fn key_parts(&self, k: &Kernel, g: &VerifiedGraph) -> (Vec<u64>, [DType; 3], [bool; 7], usize) {
        let p = &self.problem;
        let mut sizes = vec![p.m, p.n, p.k];
        for s in [&p.batch, &p.a_batch, &p.b_batch] {
            sizes.push(s.rank() as u64);
            sizes.extend(s.dims().iter().map(|&d| d as u64));
        }
        let l = self.layout.as_ref();
        let layouts = [
            l.is_some_and(|p| p.a_vec.is_some()),
            l.is_some_and(|p| p.a_t.is_some()),
            l.is_some_and(|p| p.b_vec.is_some()),
            l.is_some_and(|p| p.b_t.is_some()),
            l.is_some_and(|p| p.out_vec),
            rows_contiguous(k, g, p.a),
            rows_contiguous(k, g, p.b),
        ];
        (sizes, [p.dtype, p.a_dtype, p.b_dtype], layouts, k.outputs.len())
    }
}

/// The static rule for GPUs: narrow outputs (M or N under 32) use the
/// register-blocked form, where a 64-wide tile would mostly idle; others
/// the largest tile (128, then 128 x 64 or 64 x 128, then 64) that still
/// gives [`MATMUL_MIN_TILES`] workgroups, so small matmuls keep every SM
/// busy and large ones get 8 x 8 register blocks. An f32 product whose
/// tiles stay under [`MATMUL_SPLIT_TARGET`] workgroups and whose K is long
/// (a weight gradient `x^T dy` over thousands of tokens) splits K
/// ([`split_parts`]). Autotuning, where enabled, measures the one-pass
/// candidates instead ([`candidates`]).
pub fn choose_form(p: &MatmulProblem) -> MatmulForm {
    let (m, n) = (p.m, p.n);
    if m < 32 || n < 32 {
        return MatmulForm::RegisterBlocked;
    }
    let tile = MatmulTile::ALL[..3]
        .iter()
        .copied()
        .find(|t| p.tiles(t.bm as u64, t.bn as u64) >= MATMUL_MIN_TILES)
        .unwrap_or(MatmulTile::ALL[3]);
    let parts = if p.dtype == DType::F32 {
        split_parts(p.tiles(tile.bm as u64, tile.bn as u64), p.batches() * m * n, p.k)
    } else {
        1
    };
    if parts > 1 {
        MatmulForm::SplitK { tile, parts: parts as u32 }
    } else {
        MatmulForm::Tiled(tile)
    }
}

/// Workgroups the first (or only) pass of the product `p` launches in
/// the tiled forms, and `None` in the register-blocked form; for
/// plans and tests.
pub fn tiled_workgroups(p: &MatmulProblem, form: MatmulForm) -> Option<u64> {
    match form {
        MatmulForm::Tiled(t) => Some(p.tiles(t.bm as u64, t.bn as u64)),
        MatmulForm::SplitK { tile, parts } => Some(p.tiles(tile.bm as u64, tile.bn as u64) * parts as u64),
        MatmulForm::Cooperative(t) => Some(p.tiles(t.bm(), t.bn())),
        MatmulForm::RegisterBlocked | MatmulForm::ByShape => None,
    }
}

/// The rule for kernels generic over sizes: the register-blocked form
/// below 128 rows or columns (rounded up to powers of two), else the
/// 64 x 64 tile, so that a varying size changes the form only at those
/// coarse bounds.
pub fn choose_generic_form(p: &MatmulProblem) -> MatmulForm {
    if p.m.next_power_of_two() < 128 || p.n.next_power_of_two() < 128 {
        MatmulForm::RegisterBlocked
    } else {
        MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 })
    }
}

/// The forms autotuning times for the product `p` (the static choice
/// first). A split-K choice is no candidate: the tuner times one pass,
/// and kernels the rule splits are not tuned (see
/// [`super::Schedule::tunable_matmul`]).
pub fn candidates(p: &MatmulProblem) -> Vec<MatmulForm> {
    let mut v: Vec<MatmulForm> =
        Some(choose_form(p)).filter(|f| !matches!(f, MatmulForm::SplitK { .. })).into_iter().collect();
    for &f in MatmulForm::CANDIDATES {
        if !v.contains(&f) {
            v.push(f);
        }
    }
    v
}

/// `x` with the inlined reshapes of kernel `k` above it peeled off: the
/// kernel input they view, where they lead to one (a reshape keeps the
/// flat order, so the input is read at the same flat index), else `x`.
fn reshape_source(k: &Kernel, g: &VerifiedGraph, x: NodeId) -> NodeId {
    let mut y = x;
    while k.inline.contains(&y) && matches!(g.node(y).op, Op::Reshape(_)) {
        y = g.node(y).inputs[0];
    }
    if k.inputs.contains(&y) {
        y
    } else {
        x
    }
}

/// Whether matmul operand `x` of kernel `k` is an inlined permute that
/// brings its source's innermost (contiguous) axis to the second-to-last
/// place: a transposed view, whose elements are adjacent along the
/// operand's rows (M of A, K of B) rather than along its last axis. The
/// tiled form's element-wise tile loads then put adjacent lanes along the
/// rows, so that their global reads stay coalesced.
fn rows_contiguous(k: &Kernel, g: &VerifiedGraph, x: NodeId) -> bool {
    let xn = g.node(x);
    let Op::Permute(perm) = &xn.op else { return false };
    let r = perm.len();
    r >= 2 && k.inline.contains(&x) && perm[r - 2] == r - 1
}

/// Whether the tiled matmul of kernel `k` (first pass of split-K
/// included) is proven in bounds at every index, so that its shader
/// module may skip wgpu's runtime checks (see [`super::Wgsl::trusted`]):
/// sizes fixed and nonzero, every node of the kernel f32 (no integer
/// division by data, no booleans), and every inlined node a reshape,
/// permute, expand, constant, lifted scalar (a uniform field), unary or
/// binary op or the product itself,
/// whose value functions only decode in-range indices by nonzero
/// constants. The tiled form clamps every global load index (rows,
/// columns and k) into its operand and masks out-of-range k with a
/// `select` (both sides in bounds), guards every store, indexes its
/// workgroup arrays with constants plus lane ids below the tile, and
/// bounds every loop by a constant. `form` is the product's concrete
/// form (see [`resolve_form`]).
pub fn trusted(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits, form: MatmulForm) -> bool {
    let Some(p) = MatmulProblem::of(k, g) else { return false };
    let sizes_ok = g.node(p.node).shape.numel() > 0 && p.k > 0;
    let f32_only = k.inputs.iter().chain(&k.inline).chain(&k.outputs).all(|&x| g.node(x).dtype == DType::F32);
    let ops_ok = k.inline.iter().chain(&k.outputs).all(|&x| {
        matches!(
            g.node(x).op,
            Op::MatMul
                | Op::Reshape(_)
                | Op::Permute(_)
                | Op::Expand(_)
                | Op::Constant(..)
                | Op::ScalarParam(_)
                | Op::Unary(_)
                | Op::Binary(_)
        )
    });
    !limits.generic
        && sizes_ok
        && f32_only
        && ops_ok
        && matches!(form, MatmulForm::Tiled(_) | MatmulForm::SplitK { .. })
}

/// Most invocations per matmul workgroup.
pub const MATMUL_LANES: u64 = 128;

/// Invocations the GPU rule gives a narrow register-blocked product (N
/// of 32 or less) before it blocks rows (see `matmul_shape`): about one
/// per lane of 64 SMs.
pub const MATMUL_NARROW_INVOCATIONS: u64 = 8192;

/// Most invocations per workgroup of a narrow product under the GPU rule.
pub const MATMUL_NARROW_LANES: u64 = 64;

/// The layout of a matmul kernel (see `Writer::matmul`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MatMulShape {
    /// Output rows per invocation.
    pub(super) rows: u64,
    /// vec4 column groups per invocation.
    pub(super) vecs: u64,
    /// Invocations per workgroup.
    pub(super) lanes: u64,
    /// Invocations of a workgroup along rows (`lanes / row_lanes` along
    /// columns). 1 unless N is narrow: then lanes also split rows, and
    /// loads of A are no longer workgroup-uniform.
    pub(super) row_lanes: u64,
    /// The A operand when it is read as vec4 along k (a kernel input,
    /// K divisible by 4).
    pub(super) a_vec: Option<NodeId>,
    /// When A is an inlined transpose (last two dims swapped) of kernel
    /// input `src` and M is divisible by 4: `src`, read as vec4 along m
    /// (4 consecutive rows of A at one k).
    pub(super) a_t: Option<NodeId>,
    /// When B is an inlined transpose of kernel input `src` and K is
    /// divisible by 4: `src`, read as vec4 along k (one column of B).
    pub(super) b_t: Option<NodeId>,
    /// The B operand when it is read as vec4 along n (a kernel input,
    /// N divisible by 4).
    pub(super) b_vec: Option<NodeId>,
    /// Whether the output is written as vec4 (N divisible by 4).
    pub(super) out_vec: bool,
}

/// Chooses the layout of matmul kernel `k`: each invocation computes
/// `rows` x `4 * vecs` outputs; one workgroup covers `rows` rows and
/// `lanes * 4 * vecs` columns, so loads of A are uniform across the
/// workgroup (one load broadcast to all lanes on llvmpipe) and loads of B
/// are vec4 per lane where aligned.
pub(super) fn matmul_shape(
    k: &Kernel,
    g: &VerifiedGraph,
    limits: &LowerLimits,
    p: &MatmulProblem,
    form: MatmulForm,
) -> MatMulShape {
    let generic = limits.generic;
    let fixed = limits.fixed_sizes();
    // The tiled forms also read operands that are inlined reshapes of a
    // kernel input (flat order unchanged) as vectors; the register-blocked
    // form (llvmpipe's) keeps its layouts as they were.
    let tiled = !generic && !matches!(form, MatmulForm::RegisterBlocked);
    let source = |x: NodeId| if tiled { reshape_source(k, g, x) } else { x };
    let (m, n, kk) = (p.m, p.n, p.k);
    // Vectors along a size only where it is fixed (a varying size is not
    // always a multiple of 4).
    let vec_ok = |id: NodeId, dim: u64, dim_fixed: bool| {
        dim_fixed && k.inputs.contains(&id) && g.node(id).dtype != DType::Bool && dim.is_multiple_of(4) && dim > 0
    };
    let vec_src = |x: NodeId, dim: u64, dim_fixed: bool| Some(source(x)).filter(|&id| vec_ok(id, dim, dim_fixed));
    // Wide outputs: the workgroup shares its rows, lanes split columns.
    // Narrow ones (fewer than 8 lanes' worth of columns): each lane takes
    // all (or most) columns and lanes split rows too. The layout follows
    // M and N rounded up to powers of two (blocks past the edge clamp
    // their loads and skip their stores), so that sizes in one bucket
    // share a generic kernel (see `crate::generic`).
    // Generic kernels take the layout of the largest small bucket along
    // the sizes that vary (at least 64 rows or columns), and follow the
    // sizes that stay fixed.
    let mq = if fixed.m { m.next_power_of_two() } else { m.next_power_of_two().max(64) };
    let nq = if fixed.n { n.next_power_of_two() } else { n.next_power_of_two().max(64) };
    let large = mq >= MATMUL_LARGE_M || m.saturating_mul(n).saturating_mul(kk) >= MATMUL_LARGE_WORK;
    // The GPU profile's rule choosing the register-blocked form (not a
    // form forced on it, as autotuning's candidates and the software
    // profile are; the tiled forms take their own tiles).
    let gpu_rule = limits.forms.matmul == MatmulForm::ByShape && matches!(form, MatmulForm::RegisterBlocked);
    let row_cap = if !generic && large { MATMUL_ROWS } else { MATMUL_SMALL_ROWS };
    // A generic kernel's layout does not follow the batch (which may
    // vary, as in a partial last batch): it spreads as for one entry.
    let batch = if generic { 1 } else { p.batches().max(1) };
    // Under the GPU rule, rows per invocation halve (down to one) until
    // the product has [`MATMUL_NARROW_INVOCATIONS`] (see below).
    let spread = |mut rows: u64, col_lanes: u64| {
        while gpu_rule && rows > 1 && batch * mq.div_ceil(rows) * col_lanes < MATMUL_NARROW_INVOCATIONS {
            rows /= 2;
        }
        rows
    };
    let (rows, vecs, lanes, row_lanes) = if nq >= 64 {
        // Wide outputs of few rows (a batch of a few tokens through a
        // projection) take the same spread under the GPU rule: lanes split
        // the columns, and each invocation walks K for fewer rows.
        let vecs = 2;
        let col_lanes = nq.div_ceil(4 * vecs);
        (spread(mq.clamp(1, row_cap), col_lanes), vecs, col_lanes.next_multiple_of(8).min(MATMUL_LANES), 1)
    } else if gpu_rule {
        // The GPU rule's narrow products (a layer's logits, their weight
        // gradient): few outputs over a long K. Fewer rows per invocation,
        // down to one, until the product has
        // [`MATMUL_NARROW_INVOCATIONS`]: a GPU runs them all at once, so
        // an invocation's serial walk of K sets the kernel's time (the
        // digits demo's `[64, 256] x [256, 10]` was 16 invocations of 8
        // rows, 30 µs on an H200), and a small block is also far less
        // code for the driver to compile. Lanes split rows in workgroups
        // of up to 64 (two warps; 8 left a warp three quarters idle).
        let vecs = if nq <= 12 { nq.div_ceil(4).max(1) } else { 2 };
        let col_lanes = nq.div_ceil(4 * vecs).max(1);
        let rows = spread(mq.clamp(1, 8), col_lanes);
        let row_lanes = (MATMUL_NARROW_LANES / col_lanes).min(mq.div_ceil(rows)).max(1);
        (rows, vecs, col_lanes * row_lanes, row_lanes)
    } else {
        let vecs = if nq <= 12 { nq.div_ceil(4).max(1) } else { 2 };
        let col_lanes = nq.div_ceil(4 * vecs).max(1);
        let rows = mq.clamp(1, 8);
        let row_lanes = 8u64.div_ceil(col_lanes).min(mq.div_ceil(rows)).max(1);
        (rows, vecs, col_lanes * row_lanes, row_lanes)
    };
    // An inlined transpose of a kernel input, read straight from it.
    let transposed = |x: NodeId, dim: u64, dim_fixed: bool| {
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
        let src = source(xn.inputs[0]);
        (swapped
            && dim_fixed
            && k.inline.contains(&x)
            && k.inputs.contains(&src)
            && g.node(src).dtype != DType::Bool
            && dim.is_multiple_of(4)
            && dim > 0)
            .then_some(src)
    };
    // Four rows of A^T are one vec4 load; fewer rows read it by element
    // (adjacent lanes on adjacent rows: still coalesced).
    let a_t = transposed(p.a, m, fixed.m).filter(|_| rows.is_multiple_of(4));
    let b_t = transposed(p.b, kk, fixed.k);
    MatMulShape {
        rows,
        vecs,
        lanes,
        row_lanes,
        a_t,
        b_t,
        a_vec: vec_src(p.a, kk, fixed.k),
        b_vec: vec_src(p.b, n, fixed.n),
        out_vec: fixed.n && n.is_multiple_of(4),
    }
}

impl Writer<'_> {
    /// Matmul in the tiled GPU form: a workgroup of 16 x 16 invocations
    /// owns a `tile.bm` x `tile.bn` output tile; per k-slice of
    /// [`MATMUL_TILE_K`] it stages the A slice (k-major, so one vec4 holds
    /// four rows) and the B slice in workgroup memory, double-buffered: the
    /// next slice is loaded from global memory into registers while the
    /// current one is multiplied, then stored to the other buffer, so one
    /// barrier per slice suffices. Each invocation accumulates
    /// `bm / 16` x `bn / 16` outputs in registers, as 4 x 4 blocks spaced
    /// 64 apart so its workgroup-memory reads are vec4 and conflict-free.
    /// Aligned operands (see [`MatMulShape`]) are loaded as vec4, straight or
    /// transposed; others through their value functions (views, partial
    /// tiles), adjacent lanes along the operand's contiguous axis (see
    /// [`rows_contiguous`]), so every layout's global reads coalesce and
    /// the inner loop is the same for all. Out-of-range k loads clamped
    /// and masked to zero (no mask where K is a multiple of the slice);
    /// out-of-range rows and columns load clamped and are not stored. The epilogue, if any, is applied at
    /// the store. Returns the invocation count.
    ///
    /// With `parts` > 1 (split-K) this is the first pass: workgroup `gi`
    /// walks the `gi / (tiles of all batch entries)`-th range of K
    /// ([`split_chunk`] deep) and stores its raw partial products to
    /// scratch laid out `[parts, batch, M, N]` (f32, as `out0`); the
    /// second pass ([`Writer::matmul_split_sum`]) sums them.
    pub(super) fn matmul_tiled(&mut self, k: &Kernel, tile: MatmulTile, parts: u64, b: &mut String) -> u64 {
        let sched = self.s;
        let plan = sched.matmul();
        let (pr, p) = (&plan.problem, plan.layout());
        let rn_id = pr.node;
        let (m, nn, kk) = (pr.m, pr.n, pr.k);
        let (ai, bi) = (pr.a_entry(), pr.b_entry());
        let (bm, bnn, bk) = (tile.bm as u64, tile.bn as u64, MATMUL_TILE_K);
        let (rm, rnb) = (bm / 64, bnn / 64);
        let Grid { mb, nb, mbs, nbs, per_batch } = Grid::of(m, nn, bm, bnn, &self.limits);
        debug_assert!(parts == 1 || (!self.limits.generic && pr.dtype == DType::F32), "split-K: fixed sizes, f32");
        let split = parts > 1;
        let groups = parts * pr.batches() * mb * nb;
        let lanes = WORKGROUP_SIZE as u64;
        // Split-K: the batch index wraps, the part is the slowest index.
        let (bi_expr, kbase) = if split {
            let chunk = split_chunk(kk, parts);
            let nbatch = pr.batches();
            (
                format!("(gi / {per_batch}) % {nbatch}u"),
                format!("    let kbase = (gi / {}u) * {chunk}u;\n    let ntiles = (min(kbase + {chunk}u, {kk}u) - kbase + {}u) / {bk}u;\n", (mb * nb).max(1) * nbatch, bk - 1),
            )
        } else {
            (format!("gi / {per_batch}"), String::new())
        };
        let t_ty = ty(pr.dtype);
        let v_ty = format!("vec4<{t_ty}>");
        let z = zero(pr.dtype);
        let zv = format!("{v_ty}({z})");
        let (sa_len, sb_len) = (2 * bk * bm / 4, 2 * bk * bnn / 4);
        let _ = writeln!(
            self.shared,
            "var<workgroup> sa: array<{v_ty}, {sa_len}>;\nvar<workgroup> sb: array<{v_ty}, {sb_len}>;\n"
        );
        let _ = writeln!(
            b,
            "    let gi = wid.x + wid.y * nwg.x;\n    let t = gi * {lanes}u + lid;\n{}    let cb = gi % {nbs};\n    let rb = (gi / {nbs}) % {mbs};\n    let bi = {bi_expr};\n{kbase}    let row0 = rb * {bm}u;\n    let col0 = cb * {bnn}u;\n    let tr = lid / 16u;\n    let tc = lid % 16u;\n    let abase = ({ai}) * {}u;\n    let bbase = ({bi}) * {}u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 { format!("    if (gi >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            m * kk,
            kk * nn,
        );
        let (bm4, bn4) = (bm / 4, bnn / 4);
        let lay = TileLayout { m, nn, kk, bm, bnn, bk, t_ty, v_ty: v_ty.clone(), z, zv: zv.clone() };
        let slice = self.tile_slices(k, pr, p, &lay);
        let SliceCode { decl, load, stores } = slice;
        b.push_str(&decl);
        for q in 0..rm {
            for i in 0..4 {
                for pp in 0..rnb {
                    let _ = writeln!(b, "    var c{q}_{i}_{pp} = {zv};");
                }
            }
        }
        let k_varies = !self.limits.fixed_sizes().k;
        let ntiles = if split { "ntiles".to_string() } else { ceil_div(kk, bk, k_varies) };
        let k_first = if split { "kbase" } else { "0u" };
        let k_next = if split { "kbase + " } else { "" };
        let fma = reg(pr.dtype) == DType::F32;
        // Prologue: slice 0 into buffer 0.
        let _ = writeln!(b, "    {{\n        let k0 = {k_first};\n{load}    }}\n    {{\n        let nb0 = 0u;\n{stores}    }}\n    workgroupBarrier();");
        let _ = writeln!(b, "    for (var kt = 0u; kt < {ntiles}; kt = kt + 1u) {{\n        let cur = (kt % 2u) * {bk}u;\n        let more = kt + 1u < {ntiles};\n        if (more) {{\n            let k0 = {k_next}(kt + 1u) * {bk}u;\n{}        }}", indent(&load, 4));
        for q in 0..bk {
            let _ = writeln!(
                b,
                "        {{\n            let ka = (cur + {q}u) * {bm4}u;\n            let kb = (cur + {q}u) * {bn4}u;"
            );
            for qq in 0..rm {
                let _ = writeln!(b, "            let a{qq} = sa[ka + {}u + tr];", qq * 16);
            }
            for pp in 0..rnb {
                let _ = writeln!(b, "            let b{pp} = sb[kb + {}u + tc];", pp * 16);
            }
            for qq in 0..rm {
                for i in 0..4 {
                    for pp in 0..rnb {
                        let c = format!("c{qq}_{i}_{pp}");
                        let lane = ["x", "y", "z", "w"][i as usize];
                        if fma {
                            let _ = writeln!(b, "            {c} = fma(vec4<f32>(a{qq}.{lane}), b{pp}, {c});");
                        } else {
                            let _ = writeln!(b, "            {c} = {c} + {v_ty}(a{qq}.{lane}) * b{pp};");
                        }
                    }
                }
            }
            b.push_str("        }\n");
        }
        let _ = writeln!(b, "        if (more) {{\n            let nb0 = {bk}u - cur;\n{}        }}\n        workgroupBarrier();\n    }}", indent(&stores, 4));
        if split {
            // Partials of range `gi / tiles` of batch entry `bi`.
            let _ = writeln!(b, "    let obase = (gi / {}u) * {}u;", (mb * nb).max(1), m * nn);
        } else {
            let _ = writeln!(b, "    let obase = bi * {}u;", m * nn);
        }
        // Pass 1 of split-K stores raw partials to its one output.
        let outputs: &[NodeId] = if split { &[rn_id] } else { &k.outputs };
        self.tile_stores(outputs, p.out_vec, (rm, rnb), (m, nn), b);
        groups * lanes
    }

    /// The loads of one k-slice `k0` of both operands of the tiled matmul
    /// into registers (`pa*`, `pb*`), and the stores of those registers
    /// into buffer `nb0` of workgroup memory (see [`SliceCode`]): A as
    /// `sa[(buf * BK + k) * bm/4 + m/4][m % 4]`, B as
    /// `sb[(buf * BK + k) * bn/4 + n/4][n % 4]`, each read as vectors where
    /// its layout allows (straight or transposed).
    fn tile_slices(&self, k: &Kernel, pr: &MatmulProblem, p: &MatMulShape, lay: &TileLayout) -> SliceCode {
        let (na, nbid) = (pr.a.0, pr.b.0);
        let TileLayout { m, nn, kk, bm, bnn, bk, t_ty, ref v_ty, z, ref zv } = *lay;
        let slot = |id: NodeId| k.inputs.iter().position(|&x| x == id).expect("vector operand is an input");
        let mut slice = SliceCode::default();
        let (bm4, bn4) = (bm / 4, bnn / 4);
        // Rows of A and columns of B past the edge load clamped (their
        // products land in outputs that are never stored). K divisible by
        // the slice depth: every slice lies inside K, so its loads need
        // neither a clamp nor a mask along k; otherwise k is clamped into
        // the operand (every load in bounds) and the value past K masked
        // to zero with a `select`, no branch.
        let k_exact = kk > 0 && kk.is_multiple_of(bk);
        let kidx = |e: &str, last: u64| if k_exact { format!("({e})") } else { format!("min({e}, {last}u)") };
        let kmask =
            |zero: &str, v: String, k: &str| if k_exact { v } else { format!("select({zero}, {v}, {k} < {kk}u)") };
        // A: sa[(buf * BK + k) * bm/4 + m/4][m % 4].
        if let Some(id) = p.a_vec {
            // vec4 along k from row-major A; stored transposed.
            let src = slot(id);
            slice.add(
                "pa",
                bm * bk / 4,
                v_ty,
                &format!("let am = l / {}u;\n                let ak = (l % {}u) * 4u;", bk / 4, bk / 4),
                &kmask(zv, self.input(src).load(&format!("(abase + min(row0 + am, {}u) * {kk}u + {}) / 4u", m - 1, kidx("k0 + ak", kk - 4))), "k0 + ak"),
                &format!("let ai = (nb0 + ak) * {bm4}u + am / 4u;\n                sa[ai][am % 4u] = {{reg}}.x;\n                sa[ai + {bm4}u][am % 4u] = {{reg}}.y;\n                sa[ai + {}u][am % 4u] = {{reg}}.z;\n                sa[ai + {}u][am % 4u] = {{reg}}.w;", 2 * bm4, 3 * bm4),
            );
        } else if let Some(id) = p.a_t {
            // A = transpose of `src` [.., K, M]: vec4 along m, stored as is.
            let src = slot(id);
            slice.add(
                "pa",
                bm * bk / 4,
                v_ty,
                &format!("let ak = l / {bm4}u;\n                let am = (l % {bm4}u) * 4u;"),
                &kmask(
                    zv,
                    self.input(src).load(&format!(
                        "(abase + {} * {m}u + min(row0 + am, {}u)) / 4u",
                        kidx("k0 + ak", kk.max(1) - 1),
                        m - 4
                    )),
                    "k0 + ak",
                ),
                &format!("sa[(nb0 + ak) * {bm4}u + am / 4u] = {{reg}};"),
            );
        } else {
            // Adjacent lanes along the operand's contiguous axis: k for
            // a row-major view, m for a transposed one.
            let decode = if rows_contiguous(k, self.g, pr.a) {
                format!("let ak = l / {bm}u;\n                let am = l % {bm}u;")
            } else {
                format!("let am = l / {bk}u;\n                let ak = l % {bk}u;")
            };
            slice.add(
                "pa",
                bm * bk,
                t_ty,
                &decode,
                &kmask(
                    z,
                    format!("n{na}(abase + min(row0 + am, {}u) * {kk}u + {})", m - 1, kidx("k0 + ak", kk.max(1) - 1)),
                    "k0 + ak",
                ),
                &format!("sa[(nb0 + ak) * {bm4}u + am / 4u][am % 4u] = {{reg}};"),
            );
        }
        // B: sb[(buf * BK + k) * bn/4 + n/4][n % 4].
        if let Some(id) = p.b_vec {
            let src = slot(id);
            slice.add(
                "pb",
                bnn * bk / 4,
                v_ty,
                &format!("let bk = l / {bn4}u;\n                let bn = (l % {bn4}u) * 4u;"),
                &kmask(
                    zv,
                    self.input(src).load(&format!(
                        "(bbase + {} * {nn}u + min(col0 + bn, {}u)) / 4u",
                        kidx("k0 + bk", kk.max(1) - 1),
                        nn - 4
                    )),
                    "k0 + bk",
                ),
                &format!("sb[(nb0 + bk) * {bn4}u + bn / 4u] = {{reg}};"),
            );
        } else if let Some(id) = p.b_t {
            // B = transpose of `src` [.., N, K]: vec4 along k, stored transposed.
            let src = slot(id);
            slice.add(
                "pb",
                bnn * bk / 4,
                v_ty,
                &format!("let bn = l / {}u;\n                let bk = (l % {}u) * 4u;", bk / 4, bk / 4),
                &kmask(zv, self.input(src).load(&format!("(bbase + min(col0 + bn, {}u) * {kk}u + {}) / 4u", nn - 1, kidx("k0 + bk", kk - 4))), "k0 + bk"),
                &format!("let bi2 = (nb0 + bk) * {bn4}u + bn / 4u;\n                sb[bi2][bn % 4u] = {{reg}}.x;\n                sb[bi2 + {bn4}u][bn % 4u] = {{reg}}.y;\n                sb[bi2 + {}u][bn % 4u] = {{reg}}.z;\n                sb[bi2 + {}u][bn % 4u] = {{reg}}.w;", 2 * bn4, 3 * bn4),
            );
        } else {
            // Adjacent lanes along k where B is a transposed view.
            let decode = if rows_contiguous(k, self.g, pr.b) {
                format!("let bn = l / {bk}u;\n                let bk = l % {bk}u;")
            } else {
                format!("let bk = l / {bnn}u;\n                let bn = l % {bnn}u;")
            };
            slice.add(
                "pb",
                bnn * bk,
                t_ty,
                &decode,
                &kmask(
                    z,
                    format!(
                        "n{nbid}(bbase + {} * {nn}u + min(col0 + bn, {}u))",
                        kidx("k0 + bk", kk.max(1) - 1),
                        nn - 1
                    ),
                    "k0 + bk",
                ),
                &format!("sb[(nb0 + bk) * {bn4}u + bn / 4u][bn % 4u] = {{reg}};"),
            );
        }
        slice
    }

    /// The stores of the tiled matmul's register block to `outputs`
    /// (through each output's epilogue function `eK`, the product itself
    /// as it is): `blocks` is the block's (row, column) count of 4x4
    /// vec4 groups, `(m, n)` the product's shape; `out_vec` stores whole
    /// vec4s where N allows.
    fn tile_stores(
        &self,
        outputs: &[NodeId],
        out_vec: bool,
        (rm, rnb): (u64, u64),
        (m, nn): (u64, u64),
        b: &mut String,
    ) {
        let g = self.g;
        const LANE: [&str; 4] = ["x", "y", "z", "w"];
        for q in 0..rm {
            for i in 0..4 {
                let row = format!("row0 + {}u + tr * 4u", q * 64 + i);
                for pp in 0..rnb {
                    let col = format!("col0 + {}u + tc * 4u", pp * 64);
                    if out_vec {
                        let _ = writeln!(b, "    if ({row} < {m}u && {col} < {nn}u) {{");
                        for (sl, &o) in outputs.iter().enumerate() {
                            let out = self.output(sl);
                            b.push_str("        ");
                            out.open_store(b, format_args!("(obase + ({row}) * {nn}u + {col}) / 4u"));
                            let _ = write!(b, "vec4<{}>(", storage_reg_ty(g.node(o).dtype));
                            for (c, lane) in LANE.iter().enumerate() {
                                if c > 0 {
                                    b.push_str(", ");
                                }
                                self.write_epilogue_store(
                                    b,
                                    o,
                                    format_args!("obase + ({row}) * {nn}u + {col} + {c}u"),
                                    format_args!("c{q}_{i}_{pp}.{lane}"),
                                );
                            }
                            b.push(')');
                            out.close_store(b);
                            b.push('\n');
                        }
                        b.push_str("    }\n");
                    } else {
                        for (c, lane) in LANE.iter().enumerate() {
                            let _ = writeln!(b, "    if ({row} < {m}u && {col} + {c}u < {nn}u) {{");
                            for (sl, &o) in outputs.iter().enumerate() {
                                let out = self.output(sl);
                                b.push_str("        ");
                                out.open_store(b, format_args!("obase + ({row}) * {nn}u + {col} + {c}u"));
                                self.write_epilogue_store(
                                    b,
                                    o,
                                    format_args!("obase + ({row}) * {nn}u + {col} + {c}u"),
                                    format_args!("c{q}_{i}_{pp}.{lane}"),
                                );
                                out.close_store(b);
                                b.push('\n');
                            }
                            b.push_str("    }\n");
                        }
                    }
                }
            }
        }
    }

    /// The second pass of a split-K matmul (see [`Writer::matmul_tiled`]):
    /// invocation `t` sums the `parts` partials of its output element
    /// (a vec4 of them where N is divisible by 4) from the scratch `scr`
    /// in range order, then stores every output through the epilogue as
    /// the one-pass kernel does. Returns the body, its invocation count,
    /// the scratch elements (f32) and whether scratch is read as vec4.
    pub(super) fn matmul_split_sum(&mut self, k: &Kernel, parts: u64) -> SplitSum {
        const LANE: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        let sched = self.s;
        let plan = sched.matmul();
        let p = plan.layout();
        let total = g.node(plan.problem.node).shape.numel() as u64;
        let value = |o: NodeId, idx: String, acc: String| self.epilogue_store(o, &idx, &acc);
        let mut b = String::new();
        let (invocations, acc0) = if p.out_vec { (total / 4, "vec4<f32>(0.0)") } else { (total, "0.0") };
        let pass2 = self.pass2();
        let scratch = pass2.scratch.as_ref().expect("split-K's second pass reads scratch");
        let _ = writeln!(
            b,
            "    var acc = {acc0};\n    for (var s = 0u; s < {parts}u; s = s + 1u) {{\n        acc = acc + {};\n    }}",
            scratch.load(&format!("s * {invocations}u + t"))
        );
        for (sl, &o) in k.outputs.iter().enumerate() {
            let od = g.node(o).dtype;
            let out = &pass2.outputs[sl];
            if p.out_vec {
                let vals: Vec<String> = LANE
                    .iter()
                    .enumerate()
                    .map(|(c, lane)| value(o, format!("t * 4u + {c}u"), format!("acc.{lane}")))
                    .collect();
                let _ = writeln!(
                    b,
                    "    {}",
                    out.store("t", &format!("vec4<{}>({})", storage_reg_ty(od), vals.join(", ")))
                );
            } else {
                let _ = writeln!(b, "    {}", out.store("t", &value(o, "t".into(), "acc".into())));
            }
        }
        SplitSum { body: b, invocations, scratch: parts * total }
    }

    /// Matmul, written per workgroup (see [`matmul_shape`]): register
    /// blocks of `rows` x `4 * vecs` outputs per invocation, A read once
    /// per workgroup-uniform row (vec4 along k when aligned), B read as
    /// vec4 rows where aligned, 4 k-steps unrolled when K allows. Edge
    /// blocks clamp their loads and skip their stores. No workgroup memory
    /// or barriers: on llvmpipe they cost more than they save (a shared
    /// tiled variant measured 3x slower there). Appends the statements of
    /// `main` to `b`; returns the invocation count.
    pub(super) fn matmul(&mut self, k: &Kernel, b: &mut String) -> u64 {
        const LANE: [&str; 4] = ["x", "y", "z", "w"];
        let sched = self.s;
        let plan = sched.matmul();
        let (pr, p) = (&plan.problem, plan.layout());
        let (m, nn, kk) = (pr.m, pr.n, pr.k);
        let (ai, bi) = (pr.a_entry(), pr.b_entry());
        let (rows, vecs, lanes, lr) = (p.rows, p.vecs, p.lanes, p.row_lanes);
        let lc = lanes / lr;
        let cols = 4 * vecs;
        let Grid { mb, nb, mbs, nbs, per_batch } = Grid::of(m, nn, rows * lr, lc * cols, &self.limits);
        let groups = pr.batches() * mb * nb;
        let slot = |id: NodeId| k.inputs.iter().position(|&x| x == id).expect("vector operand is an input");
        let (na, nbid) = (pr.a.0, pr.b.0);
        let t_ty = ty(pr.dtype);
        let fma = reg(pr.dtype) == DType::F32;
        let _ = writeln!(
            b,
            "    let gi = wid.x + wid.y * nwg.x;\n    let t = gi * {lanes}u + lid;\n{}    let cb = gi % {nbs};\n    let rb = (gi / {nbs}) % {mbs};\n    let bi = gi / {per_batch};\n    let r0 = (rb * {lr}u + lid / {lc}u) * {rows}u;\n    let col0 = cb * {}u + (lid % {lc}u) * {cols}u;\n    let abase = ({ai}) * {}u;\n    let bbase = ({bi}) * {}u;",
            // Only a 2-D dispatch has padding groups. Lanes past the last
            // column stay (no divergent return): their loads are clamped
            // and their stores skipped, and llvmpipe keeps loads unmasked.
            if groups > 65535 { format!("    if (gi >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
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
                let _ = writeln!(b, "    var c{i}_{v} = vec4<{t_ty}>({});", zero(pr.dtype));
            }
        }
        let ku = if kk.is_multiple_of(4) && self.limits.fixed_sizes().k { 4 } else { 1 };
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
                        "        let at{q}_{j} = {};",
                        self.input(slot(id))
                            .load(&format!("(abase + (k + {q}u) * {m}u) / 4u + min(r0 / 4u + {j}u, {}u)", m / 4 - 1))
                    );
                }
            }
        }
        for i in 0..rows {
            if p.a_t.is_some() {
                av.push((0..ku).map(|q| format!("at{q}_{}.{}", i / 4, LANE[(i % 4) as usize])).collect());
            } else if let Some(id) = p.a_vec {
                let _ =
                    writeln!(b, "        let a{i} = {};", self.input(slot(id)).load(&format!("ar{i} / 4u + k / 4u")));
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
                let _ = writeln!(
                    b,
                    "        let bt{j} = {};",
                    self.input(slot(id)).load(&format!("(bbase + bc{j} * {kk}u + k) / 4u"))
                );
            }
        }
        for q in 0..ku {
            let _ = writeln!(b, "        {{\n            let kb = (k + {q}u) * {nn}u;");
            for v in 0..vecs {
                if p.b_t.is_some() {
                    let l: Vec<String> = (0..4).map(|c| format!("bt{}.{}", 4 * v + c, LANE[q as usize])).collect();
                    let _ = writeln!(b, "            let b{v} = vec4<{t_ty}>({});", l.join(", "));
                } else if let Some(id) = p.b_vec {
                    let _ = writeln!(
                        b,
                        "            let b{v} = {};",
                        self.input(slot(id)).load(&format!("bc{v} + kb / 4u"))
                    );
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
        let _ = writeln!(b, "    let obase = bi * {}u;", m * nn);
        self.register_block_stores(&k.outputs, p.out_vec, (rows, vecs), (m, nn), b);
        groups * lanes
    }

    /// The value output `o` stores for the product's accumulator `acc` at
    /// output index `idx`: the accumulator itself for the product, else
    /// its epilogue function `eO(index, accumulator)`.
    pub(super) fn epilogue_store(&self, o: NodeId, idx: &str, acc: &str) -> String {
        let mut s = String::new();
        self.write_epilogue_store(&mut s, o, format_args!("{idx}"), format_args!("{acc}"));
        s
    }

    /// [`Writer::epilogue_store`] written straight into `b`: the stores
    /// of a register block are most of a product kernel's text, and
    /// lowering them again is most of what a size variant costs, so they
    /// make no string per lane. Bools are stored as `u32`, as
    /// [`store`] writes them.
    fn write_epilogue_store(&self, b: &mut String, o: NodeId, idx: std::fmt::Arguments, acc: std::fmt::Arguments) {
        let n = self.g.node(o);
        let bool_store = n.dtype == DType::Bool;
        if bool_store {
            b.push_str("select(0u, 1u, ");
        }
        if n.op == Op::MatMul {
            let _ = b.write_fmt(acc);
        } else {
            let _ = write!(b, "e{}({idx}, {acc})", o.0);
        }
        if bool_store {
            b.push(')');
        }
    }

    /// The stores of the register-blocked matmul's accumulators
    /// `c{row}_{vec}` to `outputs` through each output's epilogue function
    /// (the product itself as it is): `block` is (rows, vec4 columns) per
    /// invocation, `(m, n)` the product's shape; `out_vec` stores whole
    /// vec4s where N allows.
    fn register_block_stores(
        &self,
        outputs: &[NodeId],
        out_vec: bool,
        (rows, vecs): (u64, u64),
        (m, nn): (u64, u64),
        b: &mut String,
    ) {
        const LANE: [&str; 4] = ["x", "y", "z", "w"];
        let g = self.g;
        for i in 0..rows {
            for v in 0..vecs {
                if out_vec {
                    let _ = writeln!(b, "    if (r0 + {i}u < {m}u && col0 / 4u + {v}u < {}u) {{", nn / 4);
                    for (slot, &o) in outputs.iter().enumerate() {
                        let out = self.output(slot);
                        b.push_str("        ");
                        out.open_store(b, format_args!("(obase + (r0 + {i}u) * {nn}u) / 4u + col0 / 4u + {v}u"));
                        let _ = write!(b, "vec4<{}>(", storage_reg_ty(g.node(o).dtype));
                        for (c, lane) in LANE.iter().enumerate() {
                            if c > 0 {
                                b.push_str(", ");
                            }
                            let col = 4 * v;
                            self.write_epilogue_store(
                                b,
                                o,
                                format_args!("obase + (r0 + {i}u) * {nn}u + col0 + {col}u + {c}u"),
                                format_args!("c{i}_{v}.{lane}"),
                            );
                        }
                        b.push(')');
                        out.close_store(b);
                        b.push('\n');
                    }
                    b.push_str("    }\n");
                } else {
                    for (c, lane) in LANE.iter().enumerate() {
                        let col = 4 * v + c as u64;
                        let _ = writeln!(b, "    if (r0 + {i}u < {m}u && col0 + {col}u < {nn}u) {{");
                        for (slot, &o) in outputs.iter().enumerate() {
                            let out = self.output(slot);
                            b.push_str("        ");
                            out.open_store(b, format_args!("obase + (r0 + {i}u) * {nn}u + col0 + {col}u"));
                            self.write_epilogue_store(
                                b,
                                o,
                                format_args!("obase + (r0 + {i}u) * {nn}u + col0 + {col}u"),
                                format_args!("c{i}_{v}.{lane}"),
                            );
                            out.close_store(b);
                            b.push('\n');
                        }
                        b.push_str("    }\n");
                    }
                }
            }
        }
    }
}

/// The second pass of a split-K matmul, written by
/// [`Writer::matmul_split_sum`].
pub(super) struct SplitSum {
    /// Statements of `main`, with `t` the invocation.
    pub(super) body: String,
    /// Invocations: one per output element, or per vec4 of them.
    pub(super) invocations: u64,
    /// f32 partials the first pass writes: parts x outputs.
    pub(super) scratch: u64,
}

/// `s` with every line indented by `n` more spaces.
fn indent(s: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    s.lines().map(|l| if l.is_empty() { "\n".to_string() } else { format!("{pad}{l}\n") }).collect()
}

/// The tile geometry and types the tiled matmul's slice code is written
/// for (see [`Writer::tile_slices`]).
struct TileLayout {
    m: u64,
    nn: u64,
    kk: u64,
    bm: u64,
    bnn: u64,
    bk: u64,
    t_ty: &'static str,
    v_ty: String,
    z: &'static str,
    zv: String,
}

/// The code moving one operand's k-slice into workgroup memory in the
/// tiled matmul, split so that loads and stores can sit on either side of
/// the multiply (double buffering): register declarations, loads of slice
/// `k0` into the registers, stores of the registers into buffer `nb0`.
#[derive(Default)]
struct SliceCode {
    decl: String,
    load: String,
    stores: String,
}

impl SliceCode {
    /// Adds `count` copies spread over the workgroup's lanes: copy `l` =
    /// `lid + 256 e` goes through register `{name}{e}` of type `ty`;
    /// `index` decodes `l` into tile coordinates, `value` is the load, and
    /// `store` the statements writing `{reg}` into workgroup memory.
    fn add(&mut self, name: &str, count: u64, ty: &str, index: &str, value: &str, store: &str) {
        let lanes = WORKGROUP_SIZE as u64;
        for e in 0..count.div_ceil(lanes) {
            let reg = format!("{name}{e}");
            let _ = writeln!(self.decl, "    var {reg}: {ty};");
            let bodies = [
                (
                    &mut self.load,
                    format!(
                        "{index}
                {reg} = {value};"
                    ),
                ),
                (
                    &mut self.stores,
                    format!(
                        "{index}
                {}",
                        store.replace("{reg}", &reg)
                    ),
                ),
            ];
            // The last round is partial unless the lanes divide `count`.
            let partial = !count.is_multiple_of(lanes) && (e + 1) * lanes > count;
            for (out, body) in bodies {
                let l = format!("lid + {}u", e * lanes);
                if partial {
                    let _ = writeln!(
                        out,
                        "        {{
            let l = {l};
            if (l < {count}u) {{
                {body}
            }}
        }}"
                    );
                } else {
                    let _ = writeln!(
                        out,
                        "        {{
            let l = {l};
            {body}
        }}"
                    );
                }
            }
        }
    }
}

/// The workgroup grid of a matmul kernel: blocks of `bm` x `bn` outputs
/// over an `m` x `n` output, as numbers (the dispatch) and as WGSL (see
/// [`ceil_div`]: expressions of the sizes in a generic kernel).
struct Grid {
    /// Row and column blocks.
    mb: u64,
    nb: u64,
    /// The same in WGSL.
    mbs: String,
    nbs: String,
    /// Workgroups per batch entry (at least 1) in WGSL.
    per_batch: String,
}

impl Grid {
    fn of(m: u64, n: u64, bm: u64, bn: u64, limits: &LowerLimits) -> Grid {
        let fixed = limits.fixed_sizes();
        let (mb, nb) = (m.div_ceil(bm), n.div_ceil(bn));
        let (mbs, nbs) = (ceil_div(m, bm, !fixed.m), ceil_div(n, bn, !fixed.n));
        let per_batch =
            if fixed.m && fixed.n { format!("{}u", (mb * nb).max(1)) } else { format!("max({mbs} * {nbs}, 1u)") };
        Grid { mb, nb, mbs, nbs, per_batch }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::{lower, KernelForms, LowerLimits, MatmulForm, MatmulTile};
    use super::*;
    use lazuli_ir::fusion::{self, FusionLimits};
    use lazuli_ir::{BinaryOp, Graph, PadMode, ScalarValue, UnaryOp, ValueType};

    /// Operand A of a test product: row-major, a transposed view, or a
    /// transposed view of a reshaped input (a 3-D activation flattened to
    /// tokens, as a Linear layer's weight gradient reads it).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Layout {
        Rows,
        Transposed,
        ReshapedTransposed,
    }

    /// The one kernel of `a [.., m, k] @ b [.., k, n]` (operands in the
    /// given layouts, B never reshaped), with `relu(0.5 y + bias)` as
    /// epilogue where `epilogue`.
    fn product(
        batch: &[usize],
        (m, k, n): (usize, usize, usize),
        la: Layout,
        tb: bool,
        epilogue: bool,
    ) -> (VerifiedGraph, Kernel) {
        let mut g = Graph::new();
        let dims = |lead: &[usize], r: usize, c: usize| [lead, &[r, c]].concat();
        let swap = |r: usize| {
            let mut p: Vec<usize> = (0..r).collect();
            p.swap(r - 2, r - 1);
            p
        };
        let a = match la {
            Layout::Rows => g.param(ValueType::new(dims(batch, m, k), DType::F32)),
            Layout::Transposed => {
                let x = g.param(ValueType::new(dims(batch, k, m), DType::F32));
                g.push(Op::Permute(swap(batch.len() + 2)), &[x]).unwrap()
            }
            Layout::ReshapedTransposed => {
                assert!(batch.is_empty() && k.is_multiple_of(2));
                let x = g.param(ValueType::new([2, k / 2, m], DType::F32));
                let x2 = g.push(Op::Reshape(Shape::new([k, m])), &[x]).unwrap();
                g.push(Op::Permute(vec![1, 0]), &[x2]).unwrap()
            }
        };
        let b = if tb {
            let x = g.param(ValueType::new(dims(batch, n, k), DType::F32));
            g.push(Op::Permute(swap(batch.len() + 2)), &[x]).unwrap()
        } else {
            g.param(ValueType::new(dims(batch, k, n), DType::F32))
        };
        let mut y = g.push(Op::MatMul, &[a, b]).unwrap();
        if epilogue {
            let bias = g.param(ValueType::new([n], DType::F32));
            // A lifted scalar (as `Tensor::scalar` records 0.5) and a constant.
            let half = g.scalar(DType::F32);
            let one = g.push(Op::Constant(ScalarValue::Float(1.0), DType::F32), &[]).unwrap();
            y = g.push(Op::Binary(BinaryOp::Mul), &[y, half]).unwrap();
            y = g.push(Op::Binary(BinaryOp::Mul), &[y, one]).unwrap();
            y = g.push(Op::Binary(BinaryOp::Add), &[y, bias]).unwrap();
            y = g.push(Op::Unary(UnaryOp::Relu), &[y]).unwrap();
        }
        g.outputs.push(y);
        one_kernel(g)
    }

    /// The one kernel of `g` (matmul epilogues fused), verified.
    pub(in crate::codegen) fn one_kernel(g: Graph) -> (VerifiedGraph, Kernel) {
        let v = g.verify().unwrap();
        let mut plan = fusion::plan(&v, &FusionLimits { matmul_epilogue: true, ..FusionLimits::default() });
        assert_eq!(plan.kernels.len(), 1, "one kernel");
        let k = plan.kernels.remove(0);
        (v, k)
    }

    /// Whether kernel `k` of `v` is trusted under `limits`, in the form
    /// the schedule decides.
    fn trusted_under(k: &Kernel, v: &VerifiedGraph, limits: &LowerLimits) -> bool {
        trusted(k, v, limits, MatmulPlan::new(k, v, limits).form)
    }

    fn forced(form: MatmulForm) -> LowerLimits {
        LowerLimits { forms: KernelForms { matmul: form, ..KernelForms::gpu() }, ..LowerLimits::gpu() }
    }

    /// Function-scope `var` arrays: a dynamically indexed one ends up in
    /// local memory on a GPU; the tiled form keeps its registers in named
    /// vec4s.
    fn local_arrays(source: &str) -> Vec<&str> {
        source.lines().filter(|l| l.trim_start().starts_with("var ") && l.contains("array<")).collect()
    }

    /// Every tile (and a split of K) over every operand layout, batched,
    /// broadcast, odd sizes and an epilogue: each source passes naga, holds
    /// no function-scope array, and is trusted exactly where the
    /// generator proves its indices (f32, fixed sizes).
    #[test]
    fn tiled_forms_validate_keep_registers_named_and_are_trusted() {
        let mut forms: Vec<MatmulForm> = MatmulTile::ALL.iter().map(|&t| MatmulForm::Tiled(t)).collect();
        forms.push(MatmulForm::SplitK { tile: MatmulTile { bm: 64, bn: 64 }, parts: 3 });
        type Case = (&'static [usize], (usize, usize, usize));
        let cases: [Case; 4] = [(&[], (65, 40, 129)), (&[], (7, 1, 63)), (&[2], (64, 36, 200)), (&[], (128, 24, 128))];
        for (batch, mkn) in cases {
            for la in [Layout::Rows, Layout::Transposed, Layout::ReshapedTransposed] {
                if la == Layout::ReshapedTransposed && (!batch.is_empty() || !mkn.1.is_multiple_of(2)) {
                    continue;
                }
                for (tb, epi) in [(false, false), (true, true), (false, true), (true, false)] {
                    let (v, k) = product(batch, mkn, la, tb, epi);
                    for &form in &forms {
                        let limits = forced(form);
                        let w = lower(&k, &v, &limits).unwrap();
                        let what = format!("{batch:?} {mkn:?} {la:?} tb={tb} epi={epi} {form:?}");
                        for src in std::iter::once(&w.source).chain(w.pre.as_ref().map(|p| &p.source)) {
                            crate::validate::validate_wgsl(src).unwrap_or_else(|e| panic!("{what}: {e}"));
                            assert!(local_arrays(src).is_empty(), "{what}: {:?}", local_arrays(src));
                        }
                        let split = w.pre.is_some();
                        // The tiled pass is trusted; the split's sum is not.
                        let tiled_pass = if split { w.pre.as_deref().unwrap() } else { &w };
                        assert!(tiled_pass.trusted, "{what}");
                        assert!(!split || !w.trusted, "{what}");
                        assert!(tiled_pass.source.contains("workgroupBarrier"), "{what}");
                    }
                    // The register-blocked form keeps checked modules.
                    assert!(!lower(&k, &v, &forced(MatmulForm::RegisterBlocked)).unwrap().trusted);
                }
            }
        }
    }

    /// The GPU rule spreads a narrow product (N of 32 or less) over invocations
    /// of few rows each until it has [`MATMUL_NARROW_INVOCATIONS`], in
    /// workgroups of up to [`MATMUL_NARROW_LANES`]; a product with that
    /// many row blocks already keeps 8 rows; the software profile keeps
    /// its 8-row blocks in workgroups of 8. Every source passes naga.
    #[test]
    fn gpu_rule_spreads_narrow_products_over_invocations() {
        let shape_of = |mkn, la, limits: &LowerLimits| {
            let (v, k) = product(&[], mkn, la, false, true);
            let w = lower(&k, &v, limits).unwrap();
            crate::validate::validate_wgsl(&w.source).unwrap_or_else(|e| panic!("{mkn:?} {la:?}: {e}"));
            let p = MatmulPlan::new(&k, &v, limits).layout().clone();
            (p.rows, p.lanes, p.a_t.is_some(), w.invocations, w.source.matches("fma(").count())
        };
        let (gpu, software) = (LowerLimits::gpu(), LowerLimits::software());
        // The digits demo's logits, [64, 256] x [256, 10]: 16 invocations
        // of 8 rows before; now one row each, 64 lanes to a workgroup.
        let (rows, lanes, _, invocations, fmas) = shape_of((64, 256, 10), Layout::Rows, &gpu);
        assert_eq!((rows, lanes, invocations), (1, 64, 128));
        let (rows, lanes, _, invocations, old_fmas) = shape_of((64, 256, 10), Layout::Rows, &software);
        assert_eq!((rows, lanes, invocations), (8, 8, 16));
        assert!(fmas * 4 <= old_fmas, "{fmas} fma against {old_fmas}: the kernel is smaller");
        // Its weight gradient reads a transposed view (A^T by element, not
        // vec4 along rows, with one row per invocation).
        let (rows, _, a_t, _, _) = shape_of((256, 64, 12), Layout::Transposed, &gpu);
        assert_eq!((rows, a_t), (1, false));
        let (rows, _, a_t, _, _) = shape_of((256, 64, 12), Layout::Transposed, &software);
        assert_eq!((rows, a_t), (8, true));
        // Rows in between, and a product with row blocks enough.
        assert_eq!(shape_of((6_000, 16, 16), Layout::Rows, &gpu).0, 2);
        assert_eq!(shape_of((12_000, 16, 16), Layout::Rows, &gpu).0, 4);
        assert_eq!(shape_of((70_000, 16, 10), Layout::Rows, &gpu).0, 8);
        // A wide product of few rows (16 tokens through a projection)
        // spreads its rows too.
        assert_eq!(shape_of((16, 256, 768), Layout::Rows, &gpu).0, 1);
        assert_eq!(shape_of((16, 256, 768), Layout::Rows, &software).0, 8);
        // A tiled product as narrow (N = 32) keeps its layout.
        let (rows, _, a_t, _, _) = shape_of((32, 64, 32), Layout::Transposed, &gpu);
        assert_eq!((rows, a_t), (8, true));
        // Forced (as autotuning's candidate), the form keeps its blocks.
        let forced_rb = forced(MatmulForm::RegisterBlocked);
        assert_eq!(shape_of((64, 256, 10), Layout::Rows, &forced_rb).0, 8);
    }

    /// Integer products, kernels generic over sizes, empty K and inlined
    /// views whose value functions may read past their source (padding)
    /// are not trusted.
    #[test]
    fn only_proven_kernels_are_trusted() {
        let tile = forced(MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 }));
        let (v, k) = product(&[], (64, 32, 64), Layout::Rows, false, false);
        assert!(trusted_under(&k, &v, &tile));
        assert!(!trusted_under(&k, &v, &LowerLimits { generic: true, ..tile }));
        assert!(!trusted_under(&k, &v, &LowerLimits::software()));
        let int = {
            let mut g = Graph::new();
            let a = g.param(ValueType::new([64, 32], DType::I32));
            let b = g.param(ValueType::new([32, 64], DType::I32));
            let y = g.push(Op::MatMul, &[a, b]).unwrap();
            g.outputs.push(y);
            one_kernel(g)
        };
        assert!(!trusted_under(&int.1, &int.0, &tile));
        assert!(!lower(&int.1, &int.0, &tile).unwrap().trusted);
        let empty_k = {
            let mut g = Graph::new();
            let a = g.param(ValueType::new([64, 0], DType::F32));
            let b = g.param(ValueType::new([0, 64], DType::F32));
            let y = g.push(Op::MatMul, &[a, b]).unwrap();
            g.outputs.push(y);
            one_kernel(g)
        };
        assert!(!trusted_under(&empty_k.1, &empty_k.0, &tile));
        let padded = {
            let mut g = Graph::new();
            let a = g.param(ValueType::new([64, 30], DType::F32));
            let zero = g.push(Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]).unwrap();
            let ap =
                g.push(Op::Pad { before: vec![0, 1], after: vec![0, 1], mode: PadMode::Constant }, &[a, zero]).unwrap();
            let b = g.param(ValueType::new([32, 64], DType::F32));
            let y = g.push(Op::MatMul, &[ap, b]).unwrap();
            g.outputs.push(y);
            one_kernel(g)
        };
        assert!(!trusted_under(&padded.1, &padded.0, &tile));
    }

    /// Global tile loads follow each operand's contiguous axis: a
    /// transposed view is read as vec4 along M (A) or K (B), through an
    /// inlined reshape too; one that cannot be (M not divisible by 4) is
    /// read element-wise with adjacent lanes along M.
    #[test]
    fn transposed_operands_load_along_their_contiguous_axis() {
        let tile = forced(MatmulForm::Tiled(MatmulTile { bm: 64, bn: 64 }));
        let (v, k) = product(&[], (64, 40, 64), Layout::ReshapedTransposed, true, false);
        let p = MatmulPlan::new(&k, &v, &tile).layout().clone();
        assert_eq!(p.a_t, Some(k.inputs[0]), "A^T of a reshaped input read as vec4 along M");
        assert_eq!(p.b_t, Some(k.inputs[1]), "B^T read as vec4 along K");
        // The software profile keeps its layouts: no look-through there.
        let soft = MatmulPlan::new(&k, &v, &LowerLimits::software()).layout().clone();
        assert_eq!(soft.a_t, None);
        // M = 63: element-wise, lanes along M (l % 64 is the row).
        let (v, k) = product(&[], (63, 40, 64), Layout::Transposed, false, false);
        let w = lower(&k, &v, &tile).unwrap();
        assert!(w.source.contains("let ak = l / 64u;\n                let am = l % 64u;"), "{}", w.source);
        // Row-major with K = 39 (no vec4): lanes along K.
        let (v, k) = product(&[], (63, 39, 64), Layout::Rows, false, false);
        let w = lower(&k, &v, &tile).unwrap();
        assert!(w.source.contains("let am = l / 8u;\n                let ak = l % 8u;"), "{}", w.source);
        // K = 39 with B^T: not vec4; element-wise with lanes along K.
        let (v, k) = product(&[], (64, 39, 64), Layout::Rows, true, false);
        let w = lower(&k, &v, &tile).unwrap();
        assert!(w.source.contains("let bn = l / 8u;\n                let bk = l % 8u;"), "{}", w.source);
    }
}
