//! Matmul kernels, batched, with a fused elementwise epilogue: the tiled
//! workgroup-memory form and the barrier-free register-blocked form.

use super::common::*;
use super::{Writer, WORKGROUP_SIZE};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, NodeId, Op, Shape, VerifiedGraph};
use std::fmt::Write as _;

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
pub(super) fn matmul_shape(k: &Kernel, g: &VerifiedGraph) -> MatMulShape {
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

impl Writer<'_> {
    /// Matmul in the GPU form: a workgroup of 16 x 16 invocations owns a
    /// [`MATMUL_TILE`]-square output tile; per k-slice of
    /// [`MATMUL_TILE_K`] it stages the A and B tiles in workgroup memory
    /// (operands read through their value functions, so views and partial
    /// tiles need no special case: out-of-range elements load as zero),
    /// then every invocation accumulates a 4 x 4 register block. The
    /// epilogue, if any, is applied at the store. Returns the invocation
    /// count.
    pub(super) fn matmul_tiled(&mut self, k: &Kernel, b: &mut String) -> u64 {
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
    pub(super) fn matmul(&mut self, k: &Kernel, b: &mut String) -> u64 {
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
}
