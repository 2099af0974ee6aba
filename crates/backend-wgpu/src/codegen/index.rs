//! Kernels that read indices from data: gather (`Op::Gather`) and
//! scatter-add (`Op::ScatterAdd`).
//!
//! Every index is checked against the size of the dim it indexes
//! (negative ones count from the end). An index out of range is reported
//! through the kernel's error slot, `LZE` (the storage binding after the
//! outputs): the first invocation to find one claims the slot with an
//! atomic exchange and stores the index's bits, and the element it was
//! computing is written as 0; nothing is read out of bounds and nothing is
//! clamped. The runtime gives each checking kernel of an execution its own
//! slot, reads them all back after the execution's wait and turns a
//! claimed one into `BackendError::IndexOutOfRange`, so a bad index costs
//! no extra host round trip and the device stays usable. A kernel whose
//! output is empty still checks its indices, with one invocation per
//! index.
//!
//! Gather is one invocation per output element (adjacent lanes on adjacent
//! elements of a gathered row), the same on every adapter. Scatter-add has
//! two forms ([`ScatterForm`]), both deterministic: each output element is
//! owned by one invocation, which adds the matching rows of `src` in index
//! order, so repeated indices sum in the order the CPU reference sums them
//! and every run gives the same bits.
//!
//! Rejected alternative for GPUs: one invocation per `src` element adding
//! into the output with float atomics (compare-exchange loops, since WGSL
//! has no float atomic add). That does O(m * inner) work where the owner
//! form scans the index list once per output row, but its sums depend on
//! scheduling (run-to-run differences in training), and contended rows
//! (frequent tokens) serialize on the loop. The owner form stages the index
//! list in workgroup memory and skips a staged chunk with one flag test
//! when no index in it falls into the workgroup's rows, which keeps the
//! scan cheap for a large vocabulary.

use super::common::*;
use super::{ScatterForm, Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, NodeId, Op};
use std::fmt::Write as _;

/// Output columns one invocation of the software scatter-add form owns
/// (unrolled, so that llvmpipe's loop budget is spent on the index scan
/// only).
pub const SCATTER_COLUMNS: u64 = 16;

/// The declaration of the error slot at `binding`, and the reporting
/// function (see the module documentation), which follows the access
/// helpers of the kernel's bindings (`super::access`).
pub(super) fn error_slot_source(binding: u32) -> (String, &'static str) {
    (
        format!(
            "struct LzErr {{\n    claimed: atomic<u32>,\n    value: u32,\n}}\n\n@group(0) @binding({binding}) var<storage, read_write> LZE: LzErr;\n"
        ),
        "\nfn lz_report(v: u32) {\n    if (atomicExchange(&LZE.claimed, 1u) == 0u) {\n        LZE.value = v;\n    }\n}\n",
    )
}

/// Loop iterations one invocation of a scatter-add kernel may run at
/// worst (every index naming its row), for llvmpipe's loop budget.
pub fn scatter_loop_iterations(form: ScatterForm, m: u64, inner: u64) -> u64 {
    match form {
        ScatterForm::PerColumns => m,
        ScatterForm::RowOwner => {
            // Saturating: a scatter-add over zero elements may have any sizes.
            let per_row = inner.div_ceil(scatter_lanes(inner));
            m.div_ceil(WORKGROUP_SIZE as u64).saturating_add(m).saturating_add(m.saturating_mul(per_row)) + per_row
        }
    }
}

/// Lanes per output row in the GPU scatter-add form: a power of two
/// covering the row, at most a workgroup (rows of one element get one
/// lane each, 256 rows per workgroup).
pub fn scatter_lanes(inner: u64) -> u64 {
    inner.max(1).next_power_of_two().min(WORKGROUP_SIZE as u64)
}

impl Writer<'_> {
    /// Statements that read index `j` of node `idx` as `raw`, and define
    /// `ok` (in range for a dim of `dim`) and `row` (the row it names,
    /// counted from the end when negative, as u32; 0 when not ok),
    /// reporting an index out of range. Lines indented by `ind`.
    fn checked_index(&mut self, idx: NodeId, j: &str, dim: u64, ind: &str) -> String {
        debug_assert!(self.s.error_slot, "a kernel that checks indices has an error slot");
        let d = self.g.node(idx).dtype;
        if d == DType::U32 {
            format!(
                "{ind}let raw = n{}({j});\n{ind}let ok = raw < {dim}u;\n{ind}let row = select(0u, raw, ok);\n{ind}if (!ok) {{\n{ind}    lz_report(raw);\n{ind}}}\n",
                idx.0
            )
        } else {
            // In u32 arithmetic, so any dim below 2^32 works: `mag` is
            // `raw` for `raw >= 0` and `-raw - 1` (never overflowing) for
            // `raw < 0`, which is in range when below the dim too.
            format!(
                "{ind}let raw = n{}({j});\n{ind}let mag = select(u32(raw), u32(-(raw + 1i)), raw < 0i);\n{ind}let ok = mag < {dim}u;\n{ind}let row = select(0u, select(mag, {dim}u - 1u - mag, raw < 0i), ok);\n{ind}if (!ok) {{\n{ind}    lz_report(bitcast<u32>(raw));\n{ind}}}\n",
                idx.0
            )
        }
    }

    /// A gather: one invocation per output element (or per index, when
    /// the output is empty: then it only checks). Appends the statements
    /// of `main` to `b`; returns the invocation count.
    pub(super) fn gather_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::Gather { axis } = &rn.op else { unreachable!("gather kernel of a {}", rn.op.name()) };
        let (x, ix) = (g.node(rn.inputs[0]), rn.inputs[1]);
        let ni = g.node(ix).shape.numel() as u64;
        let dim = x.shape.dims()[*axis] as u64;
        if rn.shape.numel() == 0 {
            b.push_str(&self.checked_index(ix, "t", dim, "    "));
            return ni;
        }
        let inner: u64 = x.shape.dims()[axis + 1..].iter().product::<usize>() as u64;
        if rn.dtype == DType::U8 {
            return self.gather_bytes(k, (ix, ni, dim, inner), b);
        }
        let check = self.checked_index(ix, "j", dim, "    ");
        let _ = write!(
            b,
            "    let ii = t % {inner}u;\n    let j = (t / {inner}u) % {ni}u;\n    let o = t / {}u;\n{check}    var v = {};\n    if (ok) {{\n        v = n{}(o * {}u + row * {inner}u + ii);\n    }}\n    {}\n",
            (inner * ni).max(1),
            zero(rn.dtype),
            rn.inputs[0].0,
            dim * inner,
            self.output(0).store("t", &store(rn.dtype, "v"))
        );
        rn.shape.numel() as u64
    }

    /// A gather of `u8` data (rows of quantized weight blocks: an
    /// embedding lookup) into a byte binding: one invocation per output
    /// word, which gathers its four bytes (each index checked) and writes
    /// the word whole, so no two invocations share a word. Returns the
    /// invocation count.
    fn gather_bytes(&mut self, k: &Kernel, (ix, ni, dim, inner): (NodeId, u64, u64, u64), b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let numel = rn.shape.numel() as u64;
        let check = self.checked_index(ix, "j", dim, "            ");
        let _ = write!(
            b,
            "    var word = 0u;\n    for (var q = 0u; q < 4u; q = q + 1u) {{\n        let e = t * 4u + q;\n        if (e < {numel}u) {{\n            let ii = e % {inner}u;\n            let j = (e / {inner}u) % {ni}u;\n            let o = e / {}u;\n{check}            if (ok) {{\n                word = word | (n{}(o * {}u + row * {inner}u + ii) << (q * 8u));\n            }}\n        }}\n    }}\n    {}\n",
            (inner * ni).max(1),
            rn.inputs[0].0,
            dim * inner,
            self.output(0).store("t", "word")
        );
        numel.div_ceil(4)
    }

    /// A scatter-add in the form the limits ask for (see the module
    /// documentation). Appends the statements of `main` to `b`; returns
    /// the invocation count.
    pub(super) fn scatter_add_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::ScatterAdd { axis } = &rn.op else { unreachable!("scatter-add kernel of a {}", rn.op.name()) };
        let (base, ix, src) = (rn.inputs[0], rn.inputs[1], rn.inputs[2]);
        let dims = rn.shape.dims();
        let m = g.node(ix).shape.numel() as u64;
        let n = dims[*axis] as u64;
        if rn.shape.numel() == 0 {
            b.push_str(&self.checked_index(ix, "t", n, "    "));
            return m;
        }
        let outer: u64 = dims[..*axis].iter().product::<usize>() as u64;
        let inner: u64 = dims[axis + 1..].iter().product::<usize>() as u64;
        let d = rn.dtype;
        match self.limits.forms.scatter {
            ScatterForm::RowOwner => {
                let lanes = scatter_lanes(inner);
                let rows = WORKGROUP_SIZE as u64 / lanes;
                let blocks = n.div_ceil(rows);
                let groups = outer * blocks;
                let out0 = self.output(0);
                self.shared.push_str(&format!(
                    "var<workgroup> lz_rows: array<u32, {WORKGROUP_SIZE}>;\nvar<workgroup> lz_any: array<atomic<u32>, 2>;\n\n"
                ));
                let check = self.checked_index(ix, "j", n, "            ");
                // Workgroup-uniform control flow around every barrier:
                // the early return depends on the workgroup id only, the
                // chunk loop on constants.
                let _ = write!(
                    b,
                    "    let wg = wid.x + wid.y * nwg.x;
    if (wg >= {groups}u) {{
        return;
    }}
    let o = wg / {blocks}u;
    let lo = (wg % {blocks}u) * {rows}u;
    let r = lo + lid / {lanes}u;
    let lane = lid % {lanes}u;
    let live = r < {n}u;
    let dst = (o * {n}u + r) * {inner}u;
    if (live) {{
        for (var c = lane; c < {inner}u; c = c + {lanes}u) {{
            {copy}
        }}
    }}
    if (lid == 0u) {{
        atomicStore(&lz_any[0], 0u);
    }}
    for (var s = 0u; s < {m}u; s = s + {WORKGROUP_SIZE}u) {{
        // Two flags, alternating: one is reset while the other is read.
        let p = (s / {WORKGROUP_SIZE}u) & 1u;
        workgroupBarrier();
        let j = s + lid;
        var hit = 0xffffffffu;
        if (j < {m}u) {{
{check}            if (ok) {{
                hit = row;
            }}
        }}
        lz_rows[lid] = hit;
        if (hit - lo < {rows}u) {{
            atomicOr(&lz_any[p], 1u);
        }}
        workgroupBarrier();
        let any = atomicLoad(&lz_any[p]);
        if (lid == 0u) {{
            atomicStore(&lz_any[1u - p], 0u);
        }}
        if (live && any != 0u) {{
            let staged = min({WORKGROUP_SIZE}u, {m}u - s);
            for (var e = 0u; e < staged; e = e + 1u) {{
                if (lz_rows[e] == r) {{
                    let at = (o * {m}u + s + e) * {inner}u;
                    for (var c = lane; c < {inner}u; c = c + {lanes}u) {{
                        {add}
                    }}
                }}
            }}
        }}
    }}
",
                    copy = out0.store("dst + c", &format!("n{}(dst + c)", base.0)),
                    add = out0.store("dst + c", &format!("{} + n{}(at + c)", out0.load("dst + c"), src.0)),
                );
                groups * WORKGROUP_SIZE as u64
            }
            ScatterForm::PerColumns => {
                let cols = inner.min(SCATTER_COLUMNS);
                let parts = inner.div_ceil(cols);
                // Column `kk` of the last part may lie past the row's end.
                let ragged = parts * cols != inner;
                let guarded = |kk: u64, ind: &str, stmt: String| {
                    if ragged {
                        format!("{ind}if (c0 + {kk}u < {inner}u) {{\n{ind}    {stmt}\n{ind}}}\n")
                    } else {
                        format!("{ind}{stmt}\n")
                    }
                };
                let check = self.checked_index(ix, "j", n, "        ");
                let _ = write!(
                    b,
                    "    let part = t % {parts}u;\n    let r = (t / {parts}u) % {n}u;\n    let o = t / {}u;\n    let c0 = part * {cols}u;\n    let dst = (o * {n}u + r) * {inner}u + c0;\n",
                    parts * n
                );
                for kk in 0..cols {
                    let _ = writeln!(b, "    var a{kk} = {};", zero(d));
                    b.push_str(&guarded(kk, "    ", format!("a{kk} = n{}(dst + {kk}u);", base.0)));
                }
                let _ = write!(
                    b,
                    "    for (var j = 0u; j < {m}u; j = j + 1u) {{\n{check}        if (ok && row == r) {{\n            let at = (o * {m}u + j) * {inner}u + c0;\n"
                );
                for kk in 0..cols {
                    b.push_str(&guarded(kk, "            ", format!("a{kk} = a{kk} + n{}(at + {kk}u);", src.0)));
                }
                b.push_str("        }\n    }\n");
                for kk in 0..cols {
                    b.push_str(&guarded(kk, "    ", self.output(0).store(&format!("dst + {kk}u"), &format!("a{kk}"))));
                }
                outer * n * parts
            }
        }
    }
}
