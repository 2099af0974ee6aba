//! Fused attention kernels (`Op::Attention`): the forward (output and
//! log-sum-exp), the query gradient, and the key and value gradients,
//! none of which writes the `[t_q, t_k]` scores anywhere.
//!
//! Three kernels, FlashAttention-2's split: the forward walks the keys for
//! a block of queries with an online softmax; the query gradient walks the
//! keys for a block of queries (`P` recomputed from the forward's
//! log-sum-exp, `dS = P * (dP - delta)`, `dQ += dS K`); the key and value
//! gradients walk the queries for a block of keys (`dV += P^T dO`,
//! `dK += dS^T Q`). Each output element is owned by one invocation, so
//! nothing needs atomics.
//!
//! Two forms ([`AttentionForm`]):
//! - `Tiled` (GPUs), forward: the flash forward ([`FlashPlan`]), as
//!   FlashAttention-2 does it: a workgroup per (batch slice, block of
//!   [`FlashTile::br`] queries), the query block staged once in workgroup
//!   memory; per tile of [`FlashTile::bc`] keys, the key and value tiles
//!   staged with vec4 loads (adjacent lanes on adjacent vec4s of a row),
//!   each invocation's 4 x 4 block of scores and its output block in
//!   registers, the online softmax's row maxima combined through a small
//!   array, the probabilities written once to workgroup memory; four
//!   barriers per tile; the output and log-sum-exp written once at the end.
//!   Causal kernels walk only the tiles their block sees, heaviest blocks
//!   first, and mask only the tiles crossing the diagonal or the last key.
//!   The plan is the largest of [`FLASH_TILES`] whose memory (which grows
//!   with the head dim) fits the adapter's limit; heads too wide for any
//!   take the slice-staged kernel below.
//! - `Tiled` (GPUs), gradients, and forwards too wide for a flash tile: a
//!   workgroup owns [`AttnTile::br`] rows (queries, or
//!   keys for the key/value gradients) and walks the other side in tiles
//!   of [`AttnTile::bc`]. Each invocation holds a 4 x 4 block of the
//!   tile's scores in registers; score blocks are dot products of operand
//!   slices staged in workgroup memory ([`AttnTile::dk`] deep, transposed
//!   so every read is a vec4: 2 reads per 16 multiply-adds); the
//!   probabilities go to workgroup memory once, and each invocation
//!   accumulates a 4-row x vec4 block of every 64-wide (`bc`-wide) column
//!   chunk of the output against staged value chunks. Row maxima of the
//!   online softmax combine through the probability tile's memory. Loads are
//!   coalesced (adjacent lanes, adjacent elements of a row). Causal
//!   kernels skip the tiles a block cannot see. The tile is the largest of
//!   [`TILES`] whose workgroup memory fits the adapter's limit.
//! - `PerRow` (llvmpipe): one invocation per row walks the other side one
//!   element at a time, with its row and accumulators in vec4 registers
//!   and the head-dim code written out straight: no workgroup memory, no
//!   barriers, one loop (the walk, trip count about the walked length,
//!   under llvmpipe's loop budget). A workgroup's rows share their batch
//!   slice and walk in step, so the walked rows' loads are uniform.
//!   Rows wider than [`PER_ROW_REGISTER_CHUNKS`] vec4s take the tiled
//!   kernel, which measured faster on llvmpipe there too.
//!
//! On llvmpipe neither form beats the unfused composition's
//! register-blocked matmuls at every size (BENCHMARKS.md has the figures);
//! the tiled form is the one meant for GPUs.
//!
//! Semantics are those of `Op::Attention`: causally removed keys weigh
//! exactly 0; a row whose keys are all removed has a NaN output, a
//! log-sum-exp of `-inf`, and NaN probabilities in the gradients; NaN
//! scores propagate (the maxima use `max_nan`); infinities are tested
//! through bit patterns, which no driver folds away.

use super::common::*;
use super::{AttentionForm, Binding, LowerLimits, Writer};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{AttentionMask, AttentionPart, DType, NodeId, Op, Shape, VerifiedGraph};
use std::fmt::Write as _;

/// A tile of the tiled (GPU) form: `br` rows per workgroup, the other side
/// walked `bc` at a time, dot products staged `dk` deep. A workgroup has
/// `br / 4 * bc / 4` invocations; output chunks are `bc` columns wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnTile {
    /// Rows (queries, or keys for the key/value gradients) per workgroup.
    pub br: u64,
    /// Columns (keys, or queries) per tile of the walk; also the width of
    /// the output column chunks.
    pub bc: u64,
    /// Depth of the operand slices of the score dot products.
    pub dk: u64,
}

/// The tiles of the tiled form, largest first: 256 invocations over a
/// 64 x 64 score tile (32 KiB of workgroup memory), 128 over 64 x 32
/// (20 KiB), 64 over 32 x 32 (8 KiB, within WebGPU's 16 KiB minimum).
pub const TILES: [AttnTile; 3] =
    [AttnTile { br: 64, bc: 64, dk: 32 }, AttnTile { br: 64, bc: 32, dk: 32 }, AttnTile { br: 32, bc: 32, dk: 16 }];

impl AttnTile {
    /// Invocations per workgroup.
    pub fn lanes(self) -> u64 {
        self.br / 4 * (self.bc / 4)
    }

    /// vec4 elements of the staging array: the two operand slices of a
    /// dot product, or one column chunk of a value operand.
    fn staging(self) -> u64 {
        (self.dk * (self.br + self.bc) / 4).max(self.bc * self.bc / 4)
    }

    /// Bytes of workgroup memory the kernels declare for this tile:
    /// staging and the probability tile (which also holds the row
    /// partials of the online softmax between barriers: `lanes <= bc *
    /// br / 4`).
    pub fn workgroup_bytes(self) -> u64 {
        16 * (self.staging() + self.bc * self.br / 4)
    }
}

/// The tile under `limits`: the largest of [`TILES`] that fits the
/// adapter's workgroup memory, `None` when none does.
pub fn choose_tile(limits: &LowerLimits) -> Option<AttnTile> {
    TILES.iter().copied().find(|t| t.workgroup_bytes() <= limits.workgroup_storage as u64)
}

/// Which of the three kernels an attention kernel is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// Output and/or log-sum-exp.
    Forward,
    /// The query gradient.
    GradQ,
    /// The key and/or value gradients.
    GradKv,
}

/// The operands and sizes of an attention kernel.
struct Attn {
    pass: Pass,
    causal: bool,
    mask_kind: AttentionMask,
    q: NodeId,
    k: NodeId,
    v: NodeId,
    scale: NodeId,
    mask: Option<NodeId>,
    /// dO, log-sum-exp, delta (gradient passes).
    go: Option<NodeId>,
    lse: Option<NodeId>,
    delta: Option<NodeId>,
    /// Output slot of each part this kernel writes.
    out: Vec<(AttentionPart, usize)>,
    tq: u64,
    tk: u64,
    d: u64,
    dv: u64,
    /// Batch slices.
    nb: u64,
    /// WGSL expressions of each operand's slice index for batch index `bi`.
    qbi: String,
    kbi: String,
    vbi: String,
    mbi: String,
    /// Mask: elements per slice, strides along queries and keys.
    m_slice: u64,
    m_rs: u64,
    m_cs: u64,
}

impl Attn {
    fn new(k: &Kernel, g: &VerifiedGraph) -> Attn {
        let root = g.node(k.root());
        let Op::Attention { attrs, .. } = root.op else { unreachable!("attention kernel of a non-attention root") };
        let out: Vec<(AttentionPart, usize)> = k
            .outputs
            .iter()
            .enumerate()
            .map(|(slot, &o)| match g.node(o).op {
                Op::Attention { part, .. } => (part, slot),
                _ => unreachable!("attention kernels output attention parts"),
            })
            .collect();
        let part0 = out[0].0;
        let pass = match part0 {
            AttentionPart::Out | AttentionPart::LogSumExp => Pass::Forward,
            AttentionPart::GradQ => Pass::GradQ,
            AttentionPart::GradK | AttentionPart::GradV => Pass::GradKv,
        };
        let ins = &root.inputs;
        let nf = attrs.forward_operands();
        let dims = |id: NodeId| g.node(id).shape.dims().to_vec();
        let (qd, kd, vd) = (dims(ins[0]), dims(ins[1]), dims(ins[2]));
        let (tq, d) = (qd[qd.len() - 2] as u64, qd[qd.len() - 1] as u64);
        let tk = kd[kd.len() - 2] as u64;
        let dv = vd[vd.len() - 1] as u64;
        let od = root.shape.dims();
        let lead = if part0 == AttentionPart::LogSumExp { 1 } else { 2 };
        let batch = Shape::new(&od[..od.len() - lead]);
        let slice = |s: &[usize]| Shape::new(if s.len() >= 2 { &s[..s.len() - 2] } else { &[][..] });
        let mask = (attrs.mask != AttentionMask::None).then(|| ins[4]);
        let (mut m_slice, mut m_rs, mut m_cs, mut mbi) = (0, 0, 0, "0u".to_string());
        if let Some(m) = mask {
            let md = dims(m);
            let r = md.len();
            let at = |back: usize| if r >= back { md[r - back] as u64 } else { 1 };
            let (mt, ms) = (at(2), at(1));
            m_slice = mt * ms;
            m_rs = if mt == 1 { 0 } else { ms };
            m_cs = if ms == 1 { 0 } else { 1 };
            mbi = bcast_index("bi", &batch, &slice(&md));
        }
        let grad = |i: usize| pass.ne(&Pass::Forward).then(|| ins[nf + i]);
        Attn {
            pass,
            causal: attrs.causal,
            mask_kind: attrs.mask,
            q: ins[0],
            k: ins[1],
            v: ins[2],
            scale: ins[3],
            mask,
            go: grad(0),
            lse: grad(1),
            delta: grad(2),
            out,
            tq,
            tk,
            d,
            dv,
            nb: batch.numel() as u64,
            qbi: bcast_index("bi", &batch, &slice(&qd)),
            kbi: bcast_index("bi", &batch, &slice(&kd)),
            vbi: bcast_index("bi", &batch, &slice(&vd)),
            mbi,
            m_slice,
            m_rs,
            m_cs,
        }
    }

    /// Whether the kernel needs `dP = dO V^T` (the query and key
    /// gradients do; the value gradient alone does not).
    fn needs_dp(&self) -> bool {
        self.pass == Pass::GradQ || self.slot(AttentionPart::GradK).is_some()
    }

    fn slot(&self, part: AttentionPart) -> Option<usize> {
        self.out.iter().find(|(p, _)| *p == part).map(|&(_, s)| s)
    }

    /// Rows the kernel's invocations (or workgroups) own, and the length
    /// of the side they walk.
    fn rows_and_walk(&self) -> (u64, u64) {
        match self.pass {
            Pass::GradKv => (self.tk, self.tq),
            _ => (self.tq, self.tk),
        }
    }

    /// `let` statements of the slice bases of every operand for batch
    /// index `bi`, indented by `ind`.
    fn bases(&self, ind: &str) -> String {
        let (tq, tk, d, dv) = (self.tq, self.tk, self.d, self.dv);
        let mut s = format!(
            "{ind}let qb = ({}) * {}u;\n{ind}let kb = ({}) * {}u;\n{ind}let vb = ({}) * {}u;\n",
            self.qbi,
            tq * d,
            self.kbi,
            tk * d,
            self.vbi,
            tk * dv
        );
        if self.mask.is_some() {
            let _ = writeln!(s, "{ind}let mb = ({}) * {}u;", self.mbi, self.m_slice);
        }
        if self.pass != Pass::Forward {
            let _ = writeln!(s, "{ind}let gb = bi * {}u;\n{ind}let rb = bi * {tq}u;", tq * dv);
        }
        s
    }

    /// For a `Keep` mask: whether key `j` stays for query `i` (a bool
    /// expression); the gradient of a removed key's score is 0.
    fn keep(&self, i: &str, j: &str) -> Option<String> {
        let m = self.mask.filter(|_| self.mask_kind == AttentionMask::Keep)?;
        Some(format!("n{}(mb + ({i}) * {}u + ({j}) * {}u)", m.0, self.m_rs, self.m_cs))
    }

    /// The masked, scaled score of query `i` and key `j` (u32
    /// expressions, in range) from the raw dot product `x`: `x * sc`, plus
    /// the additive mask, or `-inf` where a keep mask is false.
    fn score(&self, x: &str, i: &str, j: &str) -> String {
        let Some(m) = self.mask else { return format!("{x} * sc") };
        let at = format!("n{}(mb + ({i}) * {}u + ({j}) * {}u)", m.0, self.m_rs, self.m_cs);
        match self.mask_kind {
            AttentionMask::Keep => format!("select(-inf_f(), {x} * sc, {at})"),
            AttentionMask::Additive => format!("{x} * sc + {at}"),
            AttentionMask::None => unreachable!("a mask operand with no mask kind"),
        }
    }
}

/// Most vec4 chunks (of the head dim plus the value dim) the per-row form
/// holds in registers, its head-dim code written out straight; wider rows
/// take the tiled form on every adapter whose workgroup memory holds a
/// tile (all but the smallest).
pub const PER_ROW_REGISTER_CHUNKS: u64 = 16;

/// Whether the per-row form suits head dim `d` and value dim `dv` (see
/// [`PER_ROW_REGISTER_CHUNKS`]).
pub fn per_row_in_registers(d: u64, dv: u64) -> bool {
    d.div_ceil(4) + dv.div_ceil(4) <= PER_ROW_REGISTER_CHUNKS
}

/// A tile of the flash forward (see [`FlashPlan`]): `br` queries per
/// workgroup, keys walked `bc` at a time; each invocation holds a 4 x 4
/// block of the tile's scores, so a workgroup has `br / 4 * bc / 4`
/// invocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashTile {
    /// Queries per workgroup.
    pub br: u64,
    /// Keys per tile of the walk.
    pub bc: u64,
}

/// The tiles of the flash forward, largest first (each also tried with
/// the value tile sharing the key tile's memory, see
/// [`FlashPlan::v_in_k`]). Every plan runs on lavapipe's 32 KiB at some
/// head dim, so the differential tests prove each one; a 64 x 64 tile
/// (256 invocations) would fit 48 KiB only at head dims up to 32, and
/// nowhere on lavapipe.
pub const FLASH_TILES: [FlashTile; 2] = [FlashTile { br: 64, bc: 32 }, FlashTile { br: 32, bc: 32 }];

/// `n` rounded up to an odd number: row strides (in vec4s) of workgroup
/// arrays whose rows adjacent lanes read, so that they hit different
/// banks.
fn odd(n: u64) -> u64 {
    n | 1
}

impl FlashTile {
    /// Invocations per workgroup.
    pub fn lanes(self) -> u64 {
        self.br / 4 * (self.bc / 4)
    }

    /// Row stride (vec4s) of the staged value tile: every invocation
    /// reads the same number of vec4 columns (`tc + c * bc/4`), the ones
    /// past `dv` are zeros.
    fn v_stride(self, dv: u64) -> u64 {
        (dv.div_ceil(4).div_ceil(self.bc / 4) * (self.bc / 4)).max(1)
    }

    /// Bytes of workgroup memory of the forward with head dim `d`, value
    /// dim `dv`, with or without the output (`out`), the value tile in
    /// its own array or in the key tile's (`v_in_k`): the query block
    /// (staged once), the key (and value) tile, the probability tile and
    /// the row partials.
    pub fn workgroup_bytes(self, d: u64, dv: u64, out: bool, v_in_k: bool) -> u64 {
        let qs = odd(d.div_ceil(4));
        let (q, k) = (self.br * qs, self.bc * qs);
        let v = if out { self.bc * self.v_stride(dv) } else { 0 };
        let kv = if v_in_k { k.max(v) } else { k + v };
        let rs = odd(self.br / 4);
        let p = if out { self.bc * rs } else { 0 };
        16 * (q + kv + p + self.bc / 4 * rs)
    }
}

/// How the flash forward is written for one kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashPlan {
    /// The tile.
    pub tile: FlashTile,
    /// The value tile is staged into the key tile's memory once the scores
    /// are computed (one array less; its loads are not overlapped with
    /// the score products).
    pub v_in_k: bool,
}

/// The flash forward's plan for a forward pass with head dim `d`, value
/// dim `dv` (writing the output when `out`) under `workgroup_storage`
/// bytes: the largest of [`FLASH_TILES`] that fits, its value tile apart
/// if that fits too; `None` when no tile fits (wide heads: the
/// slice-staged tiled form takes them).
pub fn flash_plan_for(d: u64, dv: u64, out: bool, workgroup_storage: u64) -> Option<FlashPlan> {
    FLASH_TILES.iter().find_map(|&tile| {
        [false, true]
            .into_iter()
            .find(|&v_in_k| tile.workgroup_bytes(d, dv, out, v_in_k) <= workgroup_storage)
            .map(|v_in_k| FlashPlan { tile, v_in_k })
    })
}

/// The flash plan of attention kernel `k` under `limits`: forward
/// kernels in the tiled form whose tile fits.
fn flash_plan(a: &Attn, limits: &LowerLimits) -> Option<FlashPlan> {
    if limits.forms.attention != AttentionForm::Tiled || a.pass != Pass::Forward {
        return None;
    }
    flash_plan_for(a.d, a.dv, a.slot(AttentionPart::Out).is_some(), limits.workgroup_storage as u64)
}

/// The operands of attention kernel `k` that the flash forward reads as
/// vec4s (bound as `array<vec4<f32>>`): q, k and v where they are f32
/// kernel inputs whose rows are a multiple of 4 wide, in kernels that
/// are not generic over sizes.
fn flash_vec4_operands(a: &Attn, k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> Vec<NodeId> {
    if limits.generic {
        return Vec::new();
    }
    [(a.q, a.d), (a.k, a.d), (a.v, a.dv)]
        .into_iter()
        .filter(|&(id, w)| w > 0 && w.is_multiple_of(4) && k.inputs.contains(&id) && g.node(id).dtype == DType::F32)
        .map(|(id, _)| id)
        .collect()
}

/// How an attention kernel is written, decided by the schedule (see
/// [`super::Schedule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttnPlan {
    /// The flash forward, reading `vecs` (kernel inputs) as vec4s.
    Flash {
        /// Its tile and memory plan.
        plan: FlashPlan,
        /// The operands read as vec4s.
        vecs: Vec<NodeId>,
    },
    /// The slice-staged tiled form.
    Tiled(AttnTile),
    /// The per-row form, `lanes` rows per workgroup.
    PerRow {
        /// Rows per workgroup.
        lanes: u64,
    },
}

impl AttnPlan {
    /// The plan of attention kernel `k` of `g` under `limits`.
    pub(super) fn new(k: &Kernel, g: &VerifiedGraph, limits: &LowerLimits) -> AttnPlan {
        let a = Attn::new(k, g);
        if let Some(plan) = flash_plan(&a, limits) {
            return AttnPlan::Flash { plan, vecs: flash_vec4_operands(&a, k, g, limits) };
        }
        match (limits.forms.attention, choose_tile(limits)) {
            (AttentionForm::Tiled, Some(tile)) => AttnPlan::Tiled(tile),
            // Rows too wide for registers: the tiled kernel is also the
            // faster one on llvmpipe (A1 at [2, 4, 256, 64], causal,
            // alternating builds: forward 48-52 ms against 98-132 ms
            // per-row, forward + backward 248-264 against 384-391 ms).
            (AttentionForm::PerRow, Some(tile)) if !per_row_in_registers(a.d, a.dv) => AttnPlan::Tiled(tile),
            (AttentionForm::Tiled, None) | (AttentionForm::PerRow, _) => {
                // A workgroup takes `lanes` rows of one batch slice (see
                // `Writer::attention_per_row`).
                let (rows, _) = a.rows_and_walk();
                AttnPlan::PerRow { lanes: rows.next_power_of_two().clamp(8, 64) }
            }
        }
    }

    /// Invocations per workgroup.
    pub(super) fn lanes(&self) -> u64 {
        match self {
            AttnPlan::Flash { plan, .. } => plan.tile.lanes(),
            AttnPlan::Tiled(tile) => tile.lanes(),
            AttnPlan::PerRow { lanes } => *lanes,
        }
    }

    /// The kernel inputs read as vec4s.
    pub(super) fn vector_inputs(&self) -> &[NodeId] {
        match self {
            AttnPlan::Flash { vecs, .. } => vecs,
            AttnPlan::Tiled(_) | AttnPlan::PerRow { .. } => &[],
        }
    }
}

/// Loop trips of the flash forward per workgroup, under llvmpipe's loop
/// budget: the query staging once, then per tile the key and value
/// staging loops, the score product (at most `d / 4` steps), the row
/// maxima (`bc / 4`) and the product with the values (`bc / 4` steps of
/// 4 keys); the row sums once.
fn flash_trips(plan: FlashPlan, tk: u64, d: u64, dv: u64) -> u64 {
    let FlashTile { br, bc } = plan.tile;
    let lanes = plan.tile.lanes();
    let (d4, v4) = (d.div_ceil(4), plan.tile.v_stride(dv));
    let tile = (bc * d4).div_ceil(lanes) + (bc * v4).div_ceil(lanes) + d4 + bc / 4 + bc / 4 + 1;
    (br * d4).div_ceil(lanes) + tk.div_ceil(bc) * tile + bc / 4
}

impl Writer<'_> {
    /// The flash forward (FlashAttention-2's): a workgroup per (batch
    /// slice, block of `br` queries), the block staged once in workgroup
    /// memory; per tile of `bc` keys: the key (and value) tile staged with
    /// coalesced vec4 loads, each invocation's 4 x 4 score block in
    /// registers, the online softmax's row maxima combined through
    /// workgroup memory, the probabilities written there once and the
    /// output block (4 rows x a vec4 of every `bc`-wide chunk of the value
    /// dim) accumulated and rescaled in registers; the output and the
    /// log-sum-exp written once at the end. Four barriers per tile. An
    /// invocation's rows and keys are strided (`tr + r * br/4`, `tc + e *
    /// bc/4`), so the lanes of a warp read adjacent rows of the staged
    /// tiles, whose odd row strides put them in different banks. Causal
    /// kernels walk only the tiles a block sees, heaviest blocks first, and
    /// mask only the tiles that cross the diagonal or the last key.
    fn attention_flash(&mut self, a: &Attn, k: &Kernel, plan: FlashPlan, b: &mut String) -> u64 {
        let FlashPlan { tile, v_in_k } = plan;
        let FlashTile { br, bc } = tile;
        let (tq, tk, d, dv) = (a.tq, a.tk, a.d, a.dv);
        let lanes = tile.lanes();
        let (r4, c4) = (br / 4, bc / 4);
        let d4 = d.div_ceil(4);
        let qs = odd(d4);
        let rs = odd(r4);
        let vs = tile.v_stride(dv);
        let so = a.slot(AttentionPart::Out);
        let nch = if so.is_some() { vs / c4 } else { 0 };
        let nrb = tq.div_ceil(br);
        let groups = a.nb * nrb;
        self.use_helper(Helper::IsNegInfF);
        self.use_helper(Helper::IsNegInf4);
        let sched = self.s;
        let vecs = sched.attention().vector_inputs();
        let slot = |id: NodeId| k.inputs.iter().position(|&x| x == id).filter(|_| vecs.contains(&id));
        for (id, w) in [(a.q, d), (a.k, d), (a.v, dv)] {
            if slot(id).is_none() {
                self.row_loader(id, w);
            }
        }
        // vec4 chunk `p` of row `row` (in range) of operand `id`, `w` wide,
        // whose slice starts at `base`.
        let load = |id: NodeId, base: &str, row: &str, w: u64, p: &str| match slot(id) {
            Some(s) => sched.main.inputs[s].load(&format!("({base} + ({row}) * {w}u) / 4u + {p}")),
            None => format!("ld{}({base} + ({row}) * {w}u, {p})", id.0),
        };
        let kv_len = if v_in_k { (bc * qs).max(bc * vs) } else { bc * qs };
        let _ = writeln!(self.shared, "var<workgroup> fq: array<vec4<f32>, {}>;", br * qs);
        let _ = writeln!(self.shared, "var<workgroup> fk: array<vec4<f32>, {kv_len}>;");
        let fv = if v_in_k { "fk" } else { "fv" };
        if so.is_some() {
            if !v_in_k {
                let _ = writeln!(self.shared, "var<workgroup> fv: array<vec4<f32>, {}>;", bc * vs);
            }
            let _ = writeln!(self.shared, "var<workgroup> fp: array<vec4<f32>, {}>;", bc * rs);
        }
        let _ = writeln!(self.shared, "var<workgroup> fm: array<vec4<f32>, {}>;\n", c4 * rs);
        let ind = "    ";
        let i2 = "        ";
        let i3 = "            ";
        // Causal: the blocks with the most tiles first (block index
        // reversed, the slowest-varying); otherwise neighbouring
        // workgroups share their keys.
        let order = if a.causal {
            format!("{ind}let bi = gi % {nb}u;\n{ind}let row0 = ({nrb}u - 1u - gi / {nb}u) * {br}u;", nb = a.nb)
        } else {
            format!("{ind}let bi = gi / {nrb}u;\n{ind}let row0 = (gi % {nrb}u) * {br}u;")
        };
        let _ = writeln!(
            b,
            "{ind}let gi = wid.x + wid.y * nwg.x;\n{}{order}\n{ind}let tr = lid / {c4}u;\n{ind}let tc = lid % {c4}u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 {
                format!("{ind}if (gi >= {groups}u) {{\n{ind}    return;\n{ind}}}\n")
            } else {
                String::new()
            }
        );
        b.push_str(&a.bases(ind));
        let _ = writeln!(b, "{ind}let sc = n{}(0u);", a.scale.0);
        // Rows of this invocation: row0 + tr + r * br/4, clamped for loads.
        for r in 0..4 {
            let _ = writeln!(
                b,
                "{ind}let ri{r} = row0 + tr + {}u;\n{ind}let rc{r} = min(ri{r}, {}u);\n{ind}let qr{r} = (tr + {}u) * {qs}u;",
                r * r4,
                tq.max(1) - 1,
                r * r4
            );
        }
        for e in 0..4 {
            let _ = writeln!(b, "{ind}let kr{e} = (tc + {}u) * {qs}u;", e * c4);
        }
        // The query block, once: element e is (row e / (d/4), chunk e % (d/4)),
        // adjacent lanes on adjacent chunks of a row.
        if d4 > 0 {
            let _ = writeln!(
                b,
                "{ind}for (var e = lid; e < {}u; e = e + {lanes}u) {{\n{i2}let rr = e / {d4}u;\n{i2}let pp = e % {d4}u;\n{i2}fq[rr * {qs}u + pp] = select(vec4<f32>(0.0), {}, row0 + rr < {tq}u);\n{ind}}}",
                br * d4,
                load(a.q, "qb", &format!("min(row0 + rr, {}u)", tq.max(1) - 1), d, "pp")
            );
        }
        for c in 0..nch {
            for r in 0..4 {
                let _ = writeln!(b, "{ind}var acc_o{r}_{c} = vec4<f32>(0.0);");
            }
        }
        let _ = writeln!(b, "{ind}var m = vec4<f32>(-inf_f());\n{ind}var l = vec4<f32>(0.0);");
        // The walk: a causal block stops after its last row's key.
        let end = if a.causal { format!("min({tk}u, row0 + {br}u)") } else { format!("{tk}u") };
        let _ = writeln!(b, "{ind}for (var c0 = 0u; c0 < {end}; c0 = c0 + {bc}u) {{");
        // Stage: a tile's row `rr` (zeros past the last key), chunk `pp`.
        // `chunks` vec4s of each row of the tile (those past the operand's
        // width are zeros); its row `rr` past the last key is zeros.
        let stage = |b: &mut String, arr: &str, id: NodeId, base: &str, w: u64, stride: u64, chunks: u64| {
            let w4 = w.div_ceil(4);
            if w4 == 0 {
                return;
            }
            let (pp, live) = if chunks > w4 {
                (format!("min(pp, {}u)", w4 - 1), format!("c0 + rr < {tk}u && pp < {w4}u"))
            } else {
                ("pp".to_string(), format!("c0 + rr < {tk}u"))
            };
            let value = load(id, base, &format!("min(c0 + rr, {}u)", tk.max(1) - 1), w, &pp);
            let _ = writeln!(
                b,
                "{i2}for (var e = lid; e < {}u; e = e + {lanes}u) {{\n{i3}let rr = e / {chunks}u;\n{i3}let pp = e % {chunks}u;\n{i3}{arr}[rr * {stride}u + pp] = select(vec4<f32>(0.0), {value}, {live});\n{i2}}}",
                bc * chunks
            );
        };
        let _ = writeln!(b, "{i2}workgroupBarrier();");
        stage(b, "fk", a.k, "kb", d, qs, d4);
        if so.is_some() && !v_in_k {
            stage(b, "fv", a.v, "vb", dv, vs, vs);
        }
        let _ = writeln!(b, "{i2}workgroupBarrier();");
        // Scores: 4 x 4 dot products over the head dim, a vec4 of depth at
        // a time (16 vec4 multiply-adds per 8 reads).
        for r in 0..4 {
            let _ = writeln!(b, "{i2}var s{r} = vec4<f32>(0.0);");
        }
        if d4 > 0 {
            // Unrolled by up to 4 in the source: naga bounds every loop
            // with a counter of its own, which may keep a driver from
            // unrolling it.
            let us = [4, 2, 1].into_iter().find(|u| d4.is_multiple_of(*u)).unwrap_or(1);
            let _ = writeln!(b, "{i2}for (var p = 0u; p < {d4}u; p = p + {us}u) {{");
            for u in 0..us {
                let _ = writeln!(b, "{i3}{{");
                for r in 0..4 {
                    let _ = writeln!(b, "{i3}    let q{r} = fq[qr{r} + p + {u}u];");
                }
                for e in 0..4 {
                    let _ = writeln!(b, "{i3}    let k{e} = fk[kr{e} + p + {u}u];");
                }
                for r in 0..4 {
                    for l in LANE {
                        let _ = writeln!(
                            b,
                            "{i3}    s{r} = fma(vec4<f32>(q{r}.{l}), vec4<f32>(k0.{l}, k1.{l}, k2.{l}, k3.{l}), s{r});"
                        );
                    }
                }
                let _ = writeln!(b, "{i3}}}");
            }
            let _ = writeln!(b, "{i2}}}");
        }
        // Keys of this invocation: c0 + tc + e * bc/4.
        let _ = writeln!(
            b,
            "{i2}let cv = vec4<u32>(c0 + tc) + vec4<u32>(0u, {}u, {}u, {}u);\n{i2}let cc = min(cv, vec4<u32>({}u));",
            c4,
            2 * c4,
            3 * c4,
            tk.max(1) - 1
        );
        for r in 0..4 {
            let sc: Vec<String> =
                LANE.iter().map(|l| a.score(&format!("s{r}.{l}"), &format!("rc{r}"), &format!("cc.{l}"))).collect();
            let _ = writeln!(b, "{i2}var x{r} = vec4<f32>({});", sc.join(", "));
        }
        // Only tiles past the last key or across the diagonal mask.
        let full =
            if a.causal { format!("c0 + {bc}u <= min({tk}u, row0 + 1u)") } else { format!("c0 + {bc}u <= {tk}u") };
        let _ = writeln!(b, "{i2}if (!({full})) {{");
        for r in 0..4 {
            let causal = if a.causal { format!(" & (cv <= vec4<u32>(ri{r}))") } else { String::new() };
            let _ = writeln!(b, "{i3}x{r} = select(vec4<f32>(-inf_f()), x{r}, (cv < vec4<u32>({tk}u)){causal});");
        }
        let _ = writeln!(b, "{i2}}}");
        // Row maxima: this invocation's, then over the row's invocations.
        let mx = |r: usize| format!("max_nan(max_nan(x{r}.x, x{r}.y), max_nan(x{r}.z, x{r}.w))");
        let _ = writeln!(
            b,
            "{i2}fm[tc * {rs}u + tr] = vec4<f32>({}, {}, {}, {});\n{i2}workgroupBarrier();\n{i2}var mt = m;\n{i2}for (var u = 0u; u < {c4}u; u = u + 1u) {{\n{i3}let pm = fm[u * {rs}u + tr];\n{i3}mt = vec4<f32>(max_nan(mt.x, pm.x), max_nan(mt.y, pm.y), max_nan(mt.z, pm.z), max_nan(mt.w, pm.w));\n{i2}}}\n{i2}let al = select(exp(m - mt), vec4<f32>(1.0), isninf4(mt));",
            mx(0),
            mx(1),
            mx(2),
            mx(3)
        );
        for (r, lane) in LANE.iter().enumerate() {
            let _ = writeln!(
                b,
                "{i2}let p{r} = select(exp(x{r} - vec4<f32>(mt.{lane})), vec4<f32>(0.0), isninf4(x{r}) | vec4<bool>(isninf_f(mt.{lane})));"
            );
        }
        let _ = writeln!(
            b,
            "{i2}l = l * al + vec4<f32>(dot(p0, vec4<f32>(1.0)), dot(p1, vec4<f32>(1.0)), dot(p2, vec4<f32>(1.0)), dot(p3, vec4<f32>(1.0)));\n{i2}m = mt;"
        );
        if so.is_some() {
            for c in 0..nch {
                for (r, lane) in LANE.iter().enumerate() {
                    let _ = writeln!(b, "{i2}acc_o{r}_{c} = acc_o{r}_{c} * al.{lane};");
                }
            }
            // P transposed: fp[key * rs + tr] holds this invocation's rows.
            for (e, l) in LANE.iter().enumerate() {
                let _ = writeln!(
                    b,
                    "{i2}fp[(tc + {}u) * {rs}u + tr] = vec4<f32>(p0.{l}, p1.{l}, p2.{l}, p3.{l});",
                    e as u64 * c4
                );
            }
            if v_in_k {
                // Every score is computed (the barrier above): the key
                // tile's memory takes the values.
                stage(b, "fk", a.v, "vb", dv, vs, vs);
            }
            // Unrolled by 4 in the source (`bc` is a multiple of 4).
            let _ = writeln!(b, "{i2}workgroupBarrier();\n{i2}for (var j = 0u; j < {bc}u; j = j + 4u) {{");
            for u in 0..4 {
                let _ = writeln!(
                    b,
                    "{i3}{{\n{i3}    let pv = fp[(j + {u}u) * {rs}u + tr];\n{i3}    let vr = (j + {u}u) * {vs}u + tc;"
                );
                for c in 0..nch {
                    let _ = writeln!(b, "{i3}    let xv{c} = {fv}[vr + {}u];", c * c4);
                    for (r, lane) in LANE.iter().enumerate() {
                        let _ = writeln!(b, "{i3}    acc_o{r}_{c} = fma(vec4<f32>(pv.{lane}), xv{c}, acc_o{r}_{c});");
                    }
                }
                let _ = writeln!(b, "{i3}}}");
            }
            let _ = writeln!(b, "{i2}}}");
        }
        let _ = writeln!(b, "{ind}}}");
        // The row sums over the row's invocations; the stores.
        let _ = writeln!(
            b,
            "{ind}workgroupBarrier();\n{ind}fm[tc * {rs}u + tr] = l;\n{ind}workgroupBarrier();\n{ind}var lt = vec4<f32>(0.0);\n{ind}for (var u = 0u; u < {c4}u; u = u + 1u) {{\n{i2}lt = lt + fm[u * {rs}u + tr];\n{ind}}}\n{ind}let obase = bi * {tq}u;"
        );
        let dead = if tk == 0 { "vec4<bool>(false)" } else { "isninf4(m)" };
        let _ = writeln!(b, "{ind}let dead = {dead};\n{ind}let rl = select(1.0 / lt, vec4<f32>(0.0), isninf4(m));");
        if let Some(s) = a.slot(AttentionPart::LogSumExp) {
            for (r, lane) in LANE.iter().enumerate() {
                let _ = writeln!(
                    b,
                    "{ind}if (tc == 0u && ri{r} < {tq}u) {{\n{i2}{}\n{ind}}}",
                    self.output(s).store(
                        &format!("obase + ri{r}"),
                        &format!("select(m.{lane} + log(lt.{lane}), -inf_f(), isninf_f(m.{lane}))")
                    )
                );
            }
        }
        if let Some(s) = so {
            for c in 0..nch {
                for (r, lane) in LANE.iter().enumerate() {
                    let _ = writeln!(b, "{ind}if (ri{r} < {tq}u) {{");
                    for (e, comp) in LANE.iter().enumerate() {
                        let col = format!("(tc + {}u) * 4u + {e}u", c * c4);
                        let _ = writeln!(
                            b,
                            "{i2}if ({col} < {dv}u) {{\n{i3}{}\n{i2}}}",
                            self.output(s).store(
                                &format!("(obase + ri{r}) * {dv}u + {col}"),
                                &format!("select(acc_o{r}_{c}.{comp} * rl.{lane}, nan_f(), dead.{lane})")
                            )
                        );
                    }
                    let _ = writeln!(b, "{ind}}}");
                }
            }
        }
        groups * lanes
    }
}

/// vec4 component names.
const LANE: [&str; 4] = ["x", "y", "z", "w"];

impl Writer<'_> {
    /// Writes the attention kernel `k` into `b`; returns the invocation
    /// count.
    pub(super) fn attention_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let a = Attn::new(k, self.g);
        self.use_helper(Helper::InfF);
        self.use_helper(Helper::NanF);
        self.use_helper(Helper::MaxNan);
        let sched = self.s;
        match sched.attention() {
            AttnPlan::Flash { plan, .. } => self.attention_flash(&a, k, *plan, b),
            AttnPlan::Tiled(tile) => self.attention_tiled(&a, *tile, b),
            AttnPlan::PerRow { lanes } => self.attention_per_row(&a, *lanes, b),
        }
    }

    /// The per-row form (see the module doc), its rows and accumulators in
    /// registers (see [`per_row_in_registers`]): one named vec4 per chunk, the head-dim
    /// code written out straight, each walked row's chunks read once.
    /// Measured on llvmpipe (key/value gradient, head dim 16): 30 ms a
    /// run against 119 ms with the accumulators in the output row, and a
    /// shorter compile; dynamically indexed private arrays took 3.3 s to
    /// compile. The walk is the only loop; it is uniform over the
    /// workgroup (rows of one slice; causally removed pairs masked per
    /// invocation), so the walked rows' loads are too.
    fn attention_per_row(&mut self, a: &Attn, lanes: u64, b: &mut String) -> u64 {
        let (tq, tk, d, dv) = (a.tq, a.tk, a.d, a.dv);
        let (rows, _) = a.rows_and_walk();
        let (dc, vc) = (d.div_ceil(4), dv.div_ceil(4));
        let ind = "    ";
        let i2 = "        ";
        let i3 = "            ";
        // A workgroup takes `lanes` rows of one batch slice, so the slice
        // and the walked row are the same for all its invocations: loads of
        // the walked rows are uniform (llvmpipe loads them once for all
        // lanes, as the register-blocked matmul's rows of A).
        let gps = rows.div_ceil(lanes);
        let groups = a.nb * gps;
        let _ = writeln!(
            b,
            "{ind}let gi = wid.x + wid.y * nwg.x;\n{}{ind}let bi = gi / {gps}u;\n{ind}let r0 = (gi % {gps}u) * {lanes}u;\n{ind}let live = r0 + lid < {rows}u;\n{ind}let r = min(r0 + lid, {}u);\n{ind}let t = bi * {rows}u + r;",
            if groups > 65535 { format!("{ind}if (gi >= {groups}u) {{\n{ind}    return;\n{ind}}}\n") } else { String::new() },
            rows.max(1) - 1
        );
        b.push_str(&a.bases(ind));
        let _ = writeln!(b, "{ind}let sc = n{}(0u);", a.scale.0);
        self.use_helper(Helper::IsNegInfF);
        self.row_loader(a.q, d);
        self.row_loader(a.k, d);
        self.row_loader(a.v, dv);
        if let Some(go) = a.go {
            self.row_loader(go, dv);
        }
        let (each, store) = (per_row_each, per_row_store);
        let (nq, nk, nv) = (a.q.0, a.k.0, a.v.0);
        let dot = "dot(x4, vec4<f32>(1.0))";
        match a.pass {
            Pass::Forward => {
                let so = a.slot(AttentionPart::Out);
                b.push_str(&each(ind, dc, &|c| format!("let q{c} = ld{nq}(qb + r * {d}u, {c}u);")));
                if so.is_some() {
                    b.push_str(&each(ind, vc, &|c| format!("var o{c} = vec4<f32>(0.0);")));
                }
                let n = if a.causal { format!("min(r0 + {lanes}u, {tk}u)") } else { format!("{tk}u") };
                let _ = writeln!(
                    b,
                    "{ind}var m = -inf_f();\n{ind}var l = 0.0;\n{ind}for (var j = 0u; j < {n}; j = j + 1u) {{\n{i2}let kr = kb + j * {d}u;\n{i2}var x4 = vec4<f32>(0.0);"
                );
                b.push_str(&each(i2, dc, &|c| format!("x4 = fma(q{c}, ld{nk}(kr, {c}u), x4);")));
                let _ = writeln!(
                    b,
                    "{i2}let s = {};\n{i2}let mn = max_nan(m, s);\n{i2}if (!isninf_f(mn)) {{\n{i3}let al = select(exp(m - mn), 0.0, isninf_f(m));\n{i3}let p = select(exp(s - mn), 0.0, isninf_f(s));\n{i3}l = l * al + p;",
                    // A key past this row's causal limit is removed.
                    if a.causal {
                        format!("select(-inf_f(), {}, j <= r)", a.score(dot, "r", "j"))
                    } else {
                        a.score(dot, "r", "j")
                    }
                );
                if so.is_some() {
                    let _ = writeln!(b, "{i3}let vr = vb + j * {dv}u;");
                    b.push_str(&each(i3, vc, &|c| format!("o{c} = fma(vec4<f32>(p), ld{nv}(vr, {c}u), o{c} * al);")));
                }
                let _ = writeln!(b, "{i2}}}\n{i2}m = mn;\n{ind}}}");
                if let Some(s) = so {
                    // A row whose keys are all removed: NaN output; no
                    // keys at all (t_k = 0): output 0.
                    let dead = if tk == 0 { "false" } else { "isninf_f(m)" };
                    let _ = writeln!(b, "{ind}let dead = {dead};\n{ind}let rl = select(1.0 / l, 0.0, isninf_f(m));");
                    b.push_str(&store(ind, self.output(s), "o", dv, &|x| format!("select({x} * rl, nan_f(), dead)")));
                }
                if let Some(s) = a.slot(AttentionPart::LogSumExp) {
                    let _ = writeln!(
                        b,
                        "{ind}if (live) {{\n{i2}{}\n{ind}}}",
                        self.output(s).store("t", "select(m + log(l), -inf_f(), isninf_f(m))")
                    );
                }
            }
            Pass::GradQ => {
                let (ngo, nl, nd) = (a.go.expect("grad").0, a.lse.expect("grad").0, a.delta.expect("grad").0);
                let s = a.slot(AttentionPart::GradQ).expect("grad q kernel");
                b.push_str(&each(ind, dc, &|c| format!("let q{c} = ld{nq}(qb + r * {d}u, {c}u);")));
                b.push_str(&each(ind, vc, &|c| format!("let g{c} = ld{ngo}(gb + r * {dv}u, {c}u);")));
                b.push_str(&each(ind, dc, &|c| format!("var dq{c} = vec4<f32>(0.0);")));
                let n = if a.causal { format!("min(r0 + {lanes}u, {tk}u)") } else { format!("{tk}u") };
                let _ = writeln!(
                    b,
                    "{ind}let lse = n{nl}(rb + r);\n{ind}let dl = n{nd}(rb + r);\n{ind}for (var j = 0u; j < {n}; j = j + 1u) {{\n{i2}let kr = kb + j * {d}u;\n{i2}let vr = vb + j * {dv}u;\n{i2}var x4 = vec4<f32>(0.0);\n{i2}var dp4 = vec4<f32>(0.0);"
                );
                b.push_str(&each(i2, dc, &|c| format!("let k{c} = ld{nk}(kr, {c}u);\n{i2}x4 = fma(q{c}, k{c}, x4);")));
                b.push_str(&each(i2, vc, &|c| format!("dp4 = fma(g{c}, ld{nv}(vr, {c}u), dp4);")));
                let _ = writeln!(
                    b,
                    "{i2}let s = {};\n{i2}let p = select(exp(s - lse), nan_f(), isninf_f(lse));\n{i2}let ds = vec4<f32>({});",
                    a.score(dot, "r", "j"),
                    causal_zero(a.causal, "j <= r", &keep_zero(a.keep("r", "j"), "p * (dot(dp4, vec4<f32>(1.0)) - dl) * sc"))
                );
                b.push_str(&each(i2, dc, &|c| format!("dq{c} = fma(ds, k{c}, dq{c});")));
                let _ = writeln!(b, "{ind}}}");
                b.push_str(&store(ind, self.output(s), "dq", d, &|x| x));
            }
            Pass::GradKv => {
                let (ngo, nl, nd) = (a.go.expect("grad").0, a.lse.expect("grad").0, a.delta.expect("grad").0);
                let (sk, sv) = (a.slot(AttentionPart::GradK), a.slot(AttentionPart::GradV));
                b.push_str(&each(ind, dc, &|c| format!("let k{c} = ld{nk}(kb + r * {d}u, {c}u);")));
                if sk.is_some() {
                    b.push_str(&each(ind, vc, &|c| format!("let v{c} = ld{nv}(vb + r * {dv}u, {c}u);")));
                    b.push_str(&each(ind, dc, &|c| format!("var dk{c} = vec4<f32>(0.0);")));
                }
                if sv.is_some() {
                    b.push_str(&each(ind, vc, &|c| format!("var dv{c} = vec4<f32>(0.0);")));
                }
                // Queries that see key r: all, or i >= r when causal (from
                // the workgroup's first key on, the others masked).
                let start = if a.causal { "r0" } else { "0u" };
                let _ = writeln!(
                    b,
                    "{ind}for (var i = {start}; i < {tq}u; i = i + 1u) {{\n{i2}let qr = qb + i * {d}u;\n{i2}let gr = gb + i * {dv}u;\n{i2}let lse = n{nl}(rb + i);\n{i2}var x4 = vec4<f32>(0.0);\n{i2}var dp4 = vec4<f32>(0.0);"
                );
                b.push_str(&each(i2, dc, &|c| format!("let q{c} = ld{nq}(qr, {c}u);\n{i2}x4 = fma(q{c}, k{c}, x4);")));
                let _ = writeln!(
                    b,
                    "{i2}let s = {};\n{i2}let p = {};",
                    a.score(dot, "i", "r"),
                    causal_zero(a.causal, "i >= r", "select(exp(s - lse), nan_f(), isninf_f(lse))")
                );
                // One pass over dO: dV += p dO, dP = dO . v.
                for c in 0..vc {
                    let _ = writeln!(b, "{i2}let g{c} = ld{ngo}(gr, {c}u);");
                    if sv.is_some() {
                        let _ = writeln!(b, "{i2}dv{c} = fma(vec4<f32>(p), g{c}, dv{c});");
                    }
                    if sk.is_some() {
                        let _ = writeln!(b, "{i2}dp4 = fma(g{c}, v{c}, dp4);");
                    }
                }
                if sk.is_some() {
                    let ds = format!("p * (dot(dp4, vec4<f32>(1.0)) - n{nd}(rb + i)) * sc");
                    let ds = causal_zero(a.causal, "i >= r", &keep_zero(a.keep("i", "r"), &ds));
                    let _ = writeln!(b, "{i2}let ds = vec4<f32>({ds});");
                    b.push_str(&each(i2, dc, &|c| format!("dk{c} = fma(ds, q{c}, dk{c});")));
                }
                let _ = writeln!(b, "{ind}}}");
                if let Some(s) = sk {
                    b.push_str(&store(ind, self.output(s), "dk", d, &|x| x));
                }
                if let Some(s) = sv {
                    b.push_str(&store(ind, self.output(s), "dv", dv, &|x| x));
                }
            }
        }
        groups * lanes
    }

    /// Declares `ldN(base, c)`: vec4 chunk `c` of the row at `base` of
    /// operand N (`width` wide; zeros past it).
    fn row_loader(&mut self, id: NodeId, width: u64) {
        if width == 0 || self.funcs.contains(&format!("fn ld{}(", id.0)) {
            return;
        }
        let comps: Vec<String> = (0..4)
            .map(|e| {
                if width.is_multiple_of(4) {
                    // Chunks lie inside the row: plain loads.
                    format!("n{}(base + c * 4u + {e}u)", id.0)
                } else {
                    format!(
                        "select(0.0, n{}(base + min(c * 4u + {e}u, {}u)), c * 4u + {e}u < {width}u)",
                        id.0,
                        width - 1
                    )
                }
            })
            .collect();
        let _ = writeln!(
            self.funcs,
            "fn ld{}(base: u32, c: u32) -> vec4<f32> {{\n    return vec4<f32>({});\n}}\n",
            id.0,
            comps.join(", ")
        );
    }

    /// The tiled form (see the module doc).
    fn attention_tiled(&mut self, a: &Attn, tile: AttnTile, b: &mut String) -> u64 {
        let AttnTile { br, bc, .. } = tile;
        let (tk, d, dv) = (a.tk, a.d, a.dv);
        let (rows, walk) = a.rows_and_walk();
        let lanes = tile.lanes();
        let (r4, c4) = (br / 4, bc / 4);
        let nrb = rows.div_ceil(br);
        let groups = a.nb * nrb;
        self.use_helper(Helper::IsNegInfF);
        self.use_helper(Helper::IsNegInf4);
        let _ = writeln!(
            self.shared,
            "var<workgroup> sh: array<vec4<f32>, {}>;\nvar<workgroup> sp: array<vec4<f32>, {}>;\n",
            tile.staging(),
            bc * r4
        );
        let ind = "    ";
        let _ = writeln!(
            b,
            "{ind}let gi = wid.x + wid.y * nwg.x;\n{ind}let t = gi * {lanes}u + lid;\n{}{ind}let bi = gi / {nrb}u;\n{ind}let row0 = (gi % {nrb}u) * {br}u;\n{ind}let tr = lid / {c4}u;\n{ind}let tc = lid % {c4}u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 { format!("{ind}if (gi >= {groups}u) {{\n{ind}    return;\n{ind}}}\n") } else { String::new() }
        );
        b.push_str(&a.bases(ind));
        let _ = writeln!(b, "{ind}let sc = n{}(0u);", a.scale.0);
        // Rows of this invocation: row0 + 4 tr + (0..4), clamped for loads.
        for r in 0..4 {
            let _ = writeln!(
                b,
                "{ind}let ri{r} = row0 + tr * 4u + {r}u;\n{ind}let rc{r} = min(ri{r}, {}u);",
                rows.max(1) - 1
            );
        }
        let _ = writeln!(b, "{ind}let riv = vec4<u32>(ri0, ri1, ri2, ri3);");
        // Output column chunks of width bc: accumulators acc{r}_{c}.
        let width = |part: AttentionPart| match part {
            AttentionPart::Out | AttentionPart::GradV => dv,
            AttentionPart::LogSumExp | AttentionPart::GradQ | AttentionPart::GradK => d,
        };
        let acc_parts: Vec<AttentionPart> = match a.pass {
            Pass::Forward => a.slot(AttentionPart::Out).map(|_| AttentionPart::Out).into_iter().collect(),
            Pass::GradQ => vec![AttentionPart::GradQ],
            Pass::GradKv => {
                [AttentionPart::GradV, AttentionPart::GradK].into_iter().filter(|&p| a.slot(p).is_some()).collect()
            }
        };
        for &p in &acc_parts {
            for c in 0..width(p).div_ceil(bc) {
                for r in 0..4 {
                    let _ = writeln!(b, "{ind}var {}{r}_{c} = vec4<f32>(0.0);", acc_name(p));
                }
            }
        }
        let i2 = "        ";
        // Per-row statistics.
        match a.pass {
            Pass::Forward => {
                let _ = writeln!(b, "{ind}var m = vec4<f32>(-inf_f());\n{ind}var l = vec4<f32>(0.0);");
            }
            Pass::GradQ => {
                let (nl, nd) = (a.lse.expect("grad").0, a.delta.expect("grad").0);
                let _ = writeln!(
                    b,
                    "{ind}let lsev = vec4<f32>(n{nl}(rb + rc0), n{nl}(rb + rc1), n{nl}(rb + rc2), n{nl}(rb + rc3));\n{ind}let dlv = vec4<f32>(n{nd}(rb + rc0), n{nd}(rb + rc1), n{nd}(rb + rc2), n{nd}(rb + rc3));"
                );
            }
            Pass::GradKv => {}
        }
        // The walk over tiles of the other side.
        let (start, end) = match (a.pass, a.causal) {
            // Queries see keys j <= i: a block of queries stops at its last row.
            (Pass::Forward | Pass::GradQ, true) => ("0u".to_string(), format!("min({walk}u, row0 + {br}u)")),
            // A block of keys is seen from the query tile holding row0 on.
            (Pass::GradKv, true) => (format!("(row0 / {bc}u) * {bc}u"), format!("{walk}u")),
            _ => ("0u".to_string(), format!("{walk}u")),
        };
        let _ = writeln!(b, "{ind}for (var c0 = {start}; c0 < {end}; c0 = c0 + {bc}u) {{");
        // Columns of this invocation: c0 + 4 tc + (0..4).
        let _ = writeln!(
            b,
            "{i2}let cv = vec4<u32>(c0 + tc * 4u) + vec4<u32>(0u, 1u, 2u, 3u);\n{i2}let cc = min(cv, vec4<u32>({}u));",
            walk.max(1) - 1
        );
        // Score blocks: S (rows x columns) and, for gradients, dP.
        let (own_q, own_k) = match a.pass {
            Pass::GradKv => ((a.k, "kb"), (a.q, "qb")),
            _ => ((a.q, "qb"), (a.k, "kb")),
        };
        let (own_rows, walk_rows) = (rows, walk);
        self.attn_dot(b, tile, "s", own_q, own_k, d, own_rows, walk_rows);
        if a.needs_dp() {
            let go = (a.go.expect("grad"), "gb");
            let (own, other) = match a.pass {
                Pass::GradKv => ((a.v, "vb"), go),
                _ => (go, (a.v, "vb")),
            };
            self.attn_dot(b, tile, "dp", own, other, dv, own_rows, walk_rows);
        }
        attn_masked_scores(a, walk, b);
        match a.pass {
            Pass::Forward => self.attn_forward_tile(a, tile, b),
            _ => self.attn_grad_tile(a, tile, b),
        }
        let _ = writeln!(b, "{ind}}}");
        // Stores.
        let _ = writeln!(b, "{ind}let obase = bi * {rows}u;");
        if a.pass == Pass::Forward {
            // Sum the per-invocation partial sums of each row.
            let _ = writeln!(b, "{ind}workgroupBarrier();\n{ind}sp[tc * {r4}u + tr] = l;\n{ind}workgroupBarrier();\n{ind}var lt = vec4<f32>(0.0);\n{ind}for (var u = 0u; u < {c4}u; u = u + 1u) {{\n{i2}lt = lt + sp[u * {r4}u + tr];\n{ind}}}");
            let dead = if tk == 0 { "vec4<bool>(false)".to_string() } else { "isninf4(m)".to_string() };
            let _ = writeln!(b, "{ind}let dead = {dead};\n{ind}let rl = select(1.0 / lt, vec4<f32>(0.0), isninf4(m));");
            if let Some(s) = a.slot(AttentionPart::LogSumExp) {
                for (r, lane) in LANE.iter().enumerate() {
                    let _ = writeln!(
                        b,
                        "{ind}if (tc == 0u && ri{r} < {rows}u) {{\n{i2}{}\n{ind}}}",
                        self.output(s).store(
                            &format!("obase + ri{r}"),
                            &format!("select(m.{lane} + log(lt.{lane}), -inf_f(), isninf_f(m.{lane}))")
                        )
                    );
                }
            }
        }
        for &p in &acc_parts {
            let s = a.slot(p).expect("accumulated part is an output");
            let w = width(p);
            for c in 0..w.div_ceil(bc) {
                for (r, lane) in LANE.iter().enumerate() {
                    for (e, comp) in LANE.iter().enumerate() {
                        let col = format!("{}u + tc * 4u + {e}u", c * bc);
                        let v = if p == AttentionPart::Out {
                            format!("select(acc_o{r}_{c}.{comp} * rl.{lane}, nan_f(), dead.{lane})")
                        } else {
                            format!("{}{r}_{c}.{comp}", acc_name(p))
                        };
                        let _ = writeln!(
                            b,
                            "{ind}if (ri{r} < {rows}u && {col} < {w}u) {{\n{i2}{}\n{ind}}}",
                            self.output(s).store(&format!("(obase + ri{r}) * {w}u + {col}"), &v)
                        );
                    }
                }
            }
        }
        groups * lanes
    }

    /// One tile of the forward: online softmax update and `O += P V`.
    fn attn_forward_tile(&mut self, a: &Attn, tile: AttnTile, b: &mut String) {
        let AttnTile { br, bc, .. } = tile;
        let (r4, c4) = (br / 4, bc / 4);
        let i2 = "        ";
        // Row maxima: per invocation, then over the row's invocations.
        // Without dot-product slices (head dim 0) no barrier has passed
        // since the previous tile read the row partials in `sp`.
        if a.d == 0 {
            let _ = writeln!(b, "{i2}workgroupBarrier();");
        }
        let _ = writeln!(
            b,
            "{i2}sp[tc * {r4}u + tr] = vec4<f32>(max_nan(max_nan(x0.x, x0.y), max_nan(x0.z, x0.w)), max_nan(max_nan(x1.x, x1.y), max_nan(x1.z, x1.w)), max_nan(max_nan(x2.x, x2.y), max_nan(x2.z, x2.w)), max_nan(max_nan(x3.x, x3.y), max_nan(x3.z, x3.w)));\n{i2}workgroupBarrier();\n{i2}var mt = m;\n{i2}for (var u = 0u; u < {c4}u; u = u + 1u) {{\n{i2}    let pm = sp[u * {r4}u + tr];\n{i2}    mt = vec4<f32>(max_nan(mt.x, pm.x), max_nan(mt.y, pm.y), max_nan(mt.z, pm.z), max_nan(mt.w, pm.w));\n{i2}}}\n{i2}let al = select(exp(m - mt), vec4<f32>(1.0), isninf4(mt));"
        );
        for (r, lane) in LANE.iter().enumerate() {
            let _ = writeln!(
                b,
                "{i2}let p{r} = select(exp(x{r} - vec4<f32>(mt.{lane})), vec4<f32>(0.0), isninf4(x{r}) | vec4<bool>(isninf_f(mt.{lane})));"
            );
        }
        let _ = writeln!(
            b,
            "{i2}l = l * al + vec4<f32>(dot(p0, vec4<f32>(1.0)), dot(p1, vec4<f32>(1.0)), dot(p2, vec4<f32>(1.0)), dot(p3, vec4<f32>(1.0)));\n{i2}m = mt;"
        );
        if a.slot(AttentionPart::Out).is_some() {
            for c in 0..a.dv.div_ceil(bc) {
                for (r, lane) in LANE.iter().enumerate() {
                    let _ = writeln!(b, "{i2}acc_o{r}_{c} = acc_o{r}_{c} * al.{lane};");
                }
            }
            self.attn_store_p(b, tile, "p");
            self.attn_accumulate(b, tile, "acc_o", (a.v, "vb"), a.dv, a.tk);
        }
    }

    /// One tile of a gradient kernel: `P`, `dS`, and the accumulations.
    fn attn_grad_tile(&mut self, a: &Attn, tile: AttnTile, b: &mut String) {
        let i2 = "        ";
        let nl = a.lse.expect("grad").0;
        let nd = a.delta.expect("grad").0;
        // The log-sum-exp and delta of each score's query.
        let (lse, delta): (Vec<String>, Vec<String>) = match a.pass {
            Pass::GradKv => {
                let _ = writeln!(
                    b,
                    "{i2}let lsev = vec4<f32>(n{nl}(rb + cc.x), n{nl}(rb + cc.y), n{nl}(rb + cc.z), n{nl}(rb + cc.w));\n{i2}let dlv = vec4<f32>(n{nd}(rb + cc.x), n{nd}(rb + cc.y), n{nd}(rb + cc.z), n{nd}(rb + cc.w));"
                );
                ((0..4).map(|_| "lsev".to_string()).collect(), (0..4).map(|_| "dlv".to_string()).collect())
            }
            _ => (
                LANE.iter().map(|l| format!("vec4<f32>(lsev.{l})")).collect(),
                LANE.iter().map(|l| format!("vec4<f32>(dlv.{l})")).collect(),
            ),
        };
        for r in 0..4 {
            let _ = writeln!(
                b,
                "{i2}let p{r} = select(select(exp(x{r} - {l}), vec4<f32>(nan_f()), isninf4({l})), vec4<f32>(0.0), !ok{r});",
                l = lse[r]
            );
            if a.needs_dp() {
                // dS: 0 where causally removed, outside the problem, or
                // removed by a keep mask.
                let keep: Vec<String> = LANE
                    .iter()
                    .filter_map(|c| match a.pass {
                        Pass::GradKv => a.keep(&format!("cc.{c}"), &format!("rc{r}")),
                        _ => a.keep(&format!("rc{r}"), &format!("cc.{c}")),
                    })
                    .collect();
                let live =
                    if keep.is_empty() { format!("ok{r}") } else { format!("ok{r} & vec4<bool>({})", keep.join(", ")) };
                let _ = writeln!(
                    b,
                    "{i2}let g{r} = select(p{r} * (dp{r} - {dl}) * sc, vec4<f32>(0.0), !({live}));",
                    dl = delta[r]
                );
            }
        }
        match a.pass {
            Pass::GradQ => {
                self.attn_store_p(b, tile, "g");
                self.attn_accumulate(b, tile, "acc_dq", (a.k, "kb"), a.d, a.tk);
            }
            _ => {
                if a.slot(AttentionPart::GradV).is_some() {
                    self.attn_store_p(b, tile, "p");
                    self.attn_accumulate(b, tile, "acc_dv", (a.go.expect("grad"), "gb"), a.dv, a.tq);
                }
                if a.slot(AttentionPart::GradK).is_some() {
                    self.attn_store_p(b, tile, "g");
                    self.attn_accumulate(b, tile, "acc_dk", (a.q, "qb"), a.d, a.tq);
                }
            }
        }
    }

    /// Score block `{name}{r}` (vec4 over this invocation's 4 columns, for
    /// each of its 4 rows) = dot products over `width` of the owned rows of
    /// operand `own` (rows clamped below `own_rows`) and the tile's rows of
    /// `other` (below `walk_rows`), staged `dk` deep (at most the width) in
    /// workgroup memory,
    /// transposed: `sh[d * br/4 + r/4]` holds rows `r..r+4` of the owned
    /// slice at depth `d`, `sh[dk * br/4 + d * bc/4 + c/4]` those of the
    /// tile. A barrier precedes every staging, so earlier readers of `sh`
    /// (and of `sp`) are done.
    #[allow(clippy::too_many_arguments)] // The tile, the block's name, both operands and their extents.
    fn attn_dot(
        &mut self,
        b: &mut String,
        tile: AttnTile,
        name: &str,
        own: (NodeId, &str),
        other: (NodeId, &str),
        width: u64,
        own_rows: u64,
        walk_rows: u64,
    ) {
        let AttnTile { br, bc, .. } = tile;
        // Slices no deeper than the head dim (rounded to 4, so every
        // lane still stages the same number of elements): a small head
        // dim stages and multiplies no zeros.
        let dk = tile.dk.min(width.next_multiple_of(4));
        let (r4, c4, lanes) = (br / 4, bc / 4, tile.lanes());
        let i2 = "        ";
        let i3 = "            ";
        for r in 0..4 {
            let _ = writeln!(b, "{i2}var {name}{r} = vec4<f32>(0.0);");
        }
        if width == 0 {
            return;
        }
        let _ = writeln!(b, "{i2}for (var d0 = 0u; d0 < {width}u; d0 = d0 + {dk}u) {{\n{i3}workgroupBarrier();");
        // Stage: element e of a slice is (row e / dk, depth e % dk), so
        // adjacent lanes read adjacent elements of a row.
        // Every tile's slice sizes are multiples of its lane count
        // (asserted below), so each lane stages the same number of
        // elements: a loop the driver unrolls on GPUs, short code on
        // llvmpipe.
        let stage = |b: &mut String,
                     (id, base): (NodeId, &str),
                     nrows: u64,
                     row0: &str,
                     count: u64,
                     off: u64,
                     q4: u64| {
            debug_assert!(count.is_multiple_of(lanes));
            let _ = writeln!(
                b,
                "{i3}for (var e = lid; e < {count}u; e = e + {lanes}u) {{\n{i3}    let rr = e / {dk}u;\n{i3}    let dd = e % {dk}u;\n{i3}    let gr = {row0} + rr;\n{i3}    let gd = d0 + dd;\n{i3}    sh[{off}u + dd * {q4}u + rr / 4u][rr % 4u] = select(0.0, n{}({base} + min(gr, {}u) * {width}u + min(gd, {}u)), gr < {nrows}u && gd < {width}u);\n{i3}}}",
                id.0,
                nrows.max(1) - 1,
                width - 1
            );
        };
        stage(b, own, own_rows, "row0", br * dk, 0, r4);
        stage(b, other, walk_rows, "c0", bc * dk, dk * r4, c4);
        let _ = writeln!(
            b,
            "{i3}workgroupBarrier();\n{i3}for (var dd = 0u; dd < {dk}u; dd = dd + 1u) {{\n{i3}    let av = sh[dd * {r4}u + tr];\n{i3}    let bv = sh[{}u + dd * {c4}u + tc];",
            dk * r4
        );
        for (r, lane) in LANE.iter().enumerate() {
            let _ = writeln!(b, "{i3}    {name}{r} = fma(vec4<f32>(av.{lane}), bv, {name}{r});");
        }
        let _ = writeln!(b, "{i3}}}\n{i2}}}");
    }

    /// Writes `{name}0..3` (vec4 over this invocation's columns, one per
    /// row) to `sp` transposed: `sp[c * br/4 + r/4]` holds rows `r..r+4`
    /// of column `c`. The barrier first lets the previous readers of `sp`
    /// finish.
    fn attn_store_p(&mut self, b: &mut String, tile: AttnTile, name: &str) {
        let r4 = tile.br / 4;
        let i2 = "        ";
        let _ = writeln!(b, "{i2}workgroupBarrier();");
        for (e, comp) in LANE.iter().enumerate() {
            let _ = writeln!(
                b,
                "{i2}sp[(tc * 4u + {e}u) * {r4}u + tr] = vec4<f32>({name}0.{comp}, {name}1.{comp}, {name}2.{comp}, {name}3.{comp});"
            );
        }
    }

    /// `{acc}{r}_{c} += sum_j sp[j][rows] * X[c0 + j][chunk c]` for every
    /// `bc`-wide column chunk `c` of `x` (`width` columns, rows below
    /// `nrows`), staged chunk by chunk in `sh` (row-major: `sh[j * bc/4 +
    /// w/4]`); this invocation takes vec4 column `tc` of each chunk.
    fn attn_accumulate(
        &mut self,
        b: &mut String,
        tile: AttnTile,
        acc: &str,
        x: (NodeId, &str),
        width: u64,
        nrows: u64,
    ) {
        let AttnTile { br, bc, .. } = tile;
        let (r4, c4, lanes) = (br / 4, bc / 4, tile.lanes());
        let i2 = "        ";
        let i3 = "            ";
        let (id, base) = x;
        let count = bc * bc;
        for c in 0..width.div_ceil(bc) {
            let _ = writeln!(b, "{i2}workgroupBarrier();");
            debug_assert!(count.is_multiple_of(lanes));
            let _ = writeln!(
                b,
                "{i2}for (var e = lid; e < {count}u; e = e + {lanes}u) {{\n{i3}let rr = e / {bc}u;\n{i3}let ww = e % {bc}u;\n{i3}let gr = c0 + rr;\n{i3}let gw = {}u + ww;\n{i3}sh[rr * {c4}u + ww / 4u][ww % 4u] = select(0.0, n{}({base} + min(gr, {}u) * {width}u + min(gw, {}u)), gr < {nrows}u && gw < {width}u);\n{i2}}}",
                c * bc,
                id.0,
                nrows.max(1) - 1,
                width - 1
            );
            // A constant trip count: GPU drivers unroll it; written rolled,
            // it stays short for llvmpipe.
            let _ = writeln!(
                b,
                "{i2}workgroupBarrier();\n{i2}for (var j = 0u; j < {bc}u; j = j + 1u) {{\n{i3}let pv = sp[j * {r4}u + tr];\n{i3}let xv = sh[j * {c4}u + tc];"
            );
            for (r, lane) in LANE.iter().enumerate() {
                let _ = writeln!(b, "{i3}{acc}{r}_{c} = fma(vec4<f32>(pv.{lane}), xv, {acc}{r}_{c});");
            }
            let _ = writeln!(b, "{i2}}}");
        }
    }
}

/// `value`, or 0 where the causal condition `visible` is false (when
/// `causal`).
fn causal_zero(causal: bool, visible: &str, value: &str) -> String {
    if causal {
        format!("select(0.0, {value}, {visible})")
    } else {
        value.to_string()
    }
}

/// `value`, or 0 where the keep-mask expression `keep` is false.
fn keep_zero(keep: Option<String>, value: &str) -> String {
    match keep {
        Some(k) => format!("select(0.0, {value}, {k})"),
        None => value.to_string(),
    }
}

/// The accumulator prefix of a part.
fn acc_name(p: AttentionPart) -> &'static str {
    match p {
        AttentionPart::Out => "acc_o",
        AttentionPart::GradQ => "acc_dq",
        AttentionPart::GradK => "acc_dk",
        AttentionPart::GradV => "acc_dv",
        AttentionPart::LogSumExp => unreachable!("the log-sum-exp is not accumulated"),
    }
}

/// Whether the wgpu backend runs attention node `node` (operand types
/// `inputs`) in form `form` within llvmpipe's loop budget `budget`.
pub fn within_loop_budget(
    node: &lazuli_ir::Node,
    inputs: &[&lazuli_ir::Node],
    form: AttentionForm,
    budget: u64,
) -> bool {
    let Op::Attention { part, .. } = node.op else { return true };
    if inputs.len() < 3 || node.dtype != DType::F32 {
        return true;
    }
    let last2 = |n: &lazuli_ir::Node| {
        let d = n.shape.dims();
        (d[d.len() - 2] as u64, d[d.len() - 1] as u64)
    };
    let ((tq, d), (tk, _), (_, dv)) = (last2(inputs[0]), last2(inputs[1]), last2(inputs[2]));
    let walk = if matches!(part, AttentionPart::GradK | AttentionPart::GradV) { tq } else { tk };
    let trips = match form {
        AttentionForm::PerRow if per_row_in_registers(d, dv) => walk + 1,
        // The tiled form (per-row rows too wide for registers take it
        // too), per tile of the walk: two dot products, each a loop over
        // slices with a staging loop per operand and a `dk`-step multiply;
        // the row-max partials (`bc / 4` steps); two accumulations, each a
        // staging loop and a `bc`-step multiply per column chunk. Every
        // tile's loops are counted at its own sizes; the largest count
        // bounds whichever tile the adapter gets.
        _ => TILES
            .iter()
            .map(|t| {
                let lanes = t.lanes();
                let w = d.max(dv);
                let dot = w.div_ceil(t.dk) * (t.dk + (t.br + t.bc) * t.dk / lanes + 1);
                let acc = w.div_ceil(t.bc) * (t.bc + t.bc * t.bc / lanes);
                walk.div_ceil(t.bc) * (2 * dot + t.bc / 4 + 2 * acc + 1) + t.bc / 4
            })
            .max()
            .unwrap_or(0)
            // The flash forward (forward kernels of the tiled form), at
            // each of its tiles.
            .max(if matches!(part, AttentionPart::Out | AttentionPart::LogSumExp) {
                FLASH_TILES
                    .iter()
                    .map(|&tile| flash_trips(FlashPlan { tile, v_in_k: false }, tk, d, dv))
                    .max()
                    .unwrap_or(0)
            } else {
                0
            }),
    };
    trips <= budget
}

/// `n` statements of the per-row attention form, one per chunk `c`, each
/// `f(c)` at indent `ind`.
fn per_row_each(ind: &str, n: u64, f: &dyn Fn(u64) -> String) -> String {
    (0..n).map(|c| format!("{ind}{}\n", f(c))).collect()
}

/// The per-row form's stores of chunks `{name}{c}` (through `value`) to
/// output `out`, `w` wide, for a live row.
fn per_row_store(ind: &str, out: &Binding, name: &str, w: u64, value: &dyn Fn(String) -> String) -> String {
    let mut s = format!("{ind}if (live) {{\n");
    for c in 0..w.div_ceil(4) {
        for (e, comp) in LANE.iter().enumerate() {
            let col = 4 * c + e as u64;
            if col < w {
                let _ = writeln!(
                    s,
                    "{ind}{}",
                    out.store(&format!("t * {w}u + {col}u"), &value(format!("{name}{c}.{comp}")))
                );
            }
        }
    }
    let _ = writeln!(s, "{ind}}}");
    s
}

/// The tiled attention's scores of one tile, scaled and masked (`x{r}`),
/// and `ok{r}`: inside the problem and not causally removed; `walk` is the
/// length of the walked side. (i, j) = (row, column), or (column, row)
/// for the key and value gradients.
fn attn_masked_scores(a: &Attn, walk: u64, b: &mut String) {
    let i2 = "        ";
    // Scores: scaled and masked; `ok`: inside the problem and not
    // causally removed. (i, j) = (row, column) or (column, row).
    for r in 0..4 {
        // (query, key) of lane `c` of this row's columns.
        let kv = a.pass == Pass::GradKv;
        let at = |c: &str| {
            if kv {
                (format!("cc.{c}"), format!("rc{r}"))
            } else {
                (format!("rc{r}"), format!("cc.{c}"))
            }
        };
        let causal = if kv { format!(" & (vec4<u32>(ri{r}) <= cv)") } else { format!(" & (cv <= vec4<u32>(ri{r}))") };
        let causal = if a.causal { causal } else { String::new() };
        let valid = format!("(cv < vec4<u32>({walk}u)){causal}");
        let sc: Vec<String> = LANE
            .iter()
            .map(|c| {
                let (i, j) = at(c);
                a.score(&format!("s{r}.{c}"), &i, &j)
            })
            .collect();
        let _ = writeln!(
            b,
            "{i2}let ok{r} = {valid};\n{i2}let x{r} = select(vec4<f32>(-inf_f()), vec4<f32>({}), ok{r});",
            sc.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flash plans at the limits that matter: NVIDIA's 48 KiB (A1 and
    /// G8 at head dim 64 get 64 x 32 tiles of 128 invocations), lavapipe's
    /// 32 KiB and WebGPU's 16 KiB minimum; every plan's memory fits its
    /// limit and heads too wide for any tile get none.
    #[test]
    fn flash_plans_fit_the_limits() {
        let plan = |d: u64, limit: u64| flash_plan_for(d, d, true, limit).map(|p| (p.tile.br, p.tile.bc, p.v_in_k));
        assert_eq!(plan(64, 49152), Some((64, 32, false)));
        assert_eq!(plan(32, 49152), Some((64, 32, false)));
        assert_eq!(plan(80, 49152), Some((64, 32, true)));
        assert_eq!(plan(48, 32768), Some((64, 32, true)));
        assert_eq!(plan(128, 49152), Some((32, 32, true)));
        assert_eq!(plan(64, 32768), Some((32, 32, false)));
        assert_eq!(plan(96, 32768), Some((32, 32, true)));
        assert_eq!(plan(32, 16384), Some((32, 32, true)));
        assert_eq!(plan(64, 16384), None);
        assert_eq!(plan(256, 49152), None);
        for d in 0..=160 {
            for limit in [16384, 32768, 49152, 65536] {
                if let Some(p) = flash_plan_for(d, d + 3, true, limit) {
                    assert!(p.tile.workgroup_bytes(d, d + 3, true, p.v_in_k) <= limit);
                    assert!(p.tile.lanes() <= 256);
                }
            }
        }
        // Without the output there is no value or probability tile.
        assert!(
            FLASH_TILES[0].workgroup_bytes(64, 64, false, false) < FLASH_TILES[0].workgroup_bytes(64, 64, true, false)
        );
    }
}
