//! 2-d convolution (`Op::Conv2d`: `x [N, C, H, W]`, `w [O, C/groups, kh,
//! kw]` to `y [N, O, oh, ow]`; strides, asymmetric zero padding,
//! dilation, groups), forward. The backward passes are convolutions too
//! (the executor's autograd writes them over permuted and flipped views,
//! which the kernel reads in place through its prologue), so these
//! kernels carry a CNN's whole step.
//!
//! The convolution is a matrix product over an implicit im2col matrix:
//! per group, `M = N * oh * ow` output positions by `Og = O / groups`
//! output channels, reduced over `K = (C / groups) * kh * kw` taps. The
//! patch matrix is never written: each kernel gathers its elements from
//! `x` as it needs them (zero where a tap falls into the padding). Two
//! forms, selected by [`ConvForm`] from the adapter type:
//!
//! - [`ConvForm::Tiled`] (GPUs): a workgroup of 256 lanes owns a tile of
//!   64 positions by 16, 32 or 64 channels (the smallest that covers
//!   `Og`, so LeNet's 16 channels waste nothing). For each slice of 16
//!   taps the lanes stage the gathered patch slice and the weight slice in
//!   workgroup memory, then every lane accumulates 4 positions by 1-4
//!   channels in registers, reusing each staged value 16-64 times. Lanes
//!   are laid out with adjacent lanes on adjacent output positions, so the
//!   patch gathers read neighbouring input elements (`stride` apart) and
//!   the output stores are contiguous runs of a row; the weight slice is
//!   read along its contiguous tap axis and stored padded (row stride 17)
//!   so that neither its stores nor its reads conflict on banks. Groups
//!   and tiles are separate workgroups: `G * ceil(M / 64) * ceil(Og / BN)`
//!   of them.
//! - [`ConvForm::Direct`] (llvmpipe): a workgroup per block of up to 8
//!   output channels and a run of positions, each invocation computing 4
//!   positions by those channels while it walks channels, kernel rows and
//!   kernel columns (unrolled for kernels of up to 16 taps) with no
//!   barrier. llvmpipe runs an invocation as a CPU loop over SIMD lanes,
//!   splits a shader at every workgroup barrier, and loads a buffer
//!   element per lane even where all lanes read the same one, so what
//!   bounds a convolution there is loads per multiply-add: 12 loads feed
//!   32 multiply-adds per tap. Each loop's trip count is one of
//!   `C / groups`, `kh`, `kw`, under llvmpipe's loop-iteration cap (see
//!   [`loop_iterations`]).
//!
//! Both forms split the reduction when the output has too few workgroups
//! to fill the device and the taps are many, the shape of a weight
//! gradient (a handful of positions, a reduction over the whole batch and
//! image): each part writes partial sums to scratch and a second pass
//! adds them (the two-pass machinery of reductions; `split_parts`).
//!
//! Measured on llvmpipe (2 cores; BENCHMARKS.md): the direct form runs
//! C1 (`x [32, 32, 32, 32]`, 3x3, 64 channels, forward and backward) at
//! about 1 GFLOP/s, far below the CPU backend's im2col + gemm, because of
//! those per-lane loads, and the LeNet demo trains with no fallback at
//! about 55 ms per step (17 ms on the same machine when convolutions ran
//! on the CPU fallback). An im2col variant (patches and weights into
//! scratch, then a product reading vec4s) measured no faster there and
//! was dropped. The tiled form is written for GPUs and has not been timed
//! on one yet.
//!
//! Not here yet: a fused bias/activation epilogue.

use super::common::*;
use super::{ConvForm, Writer};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{ConvAttrs, Node, Op};
use std::fmt::Write as _;

/// Output positions per workgroup of the tiled form.
const TILE_M: u64 = 64;
/// Taps per staged slice of the tiled form.
const TILE_K: u64 = 16;
/// Output channels per invocation of the direct form, at most.
const DIRECT_CHANNELS: u64 = 8;
/// Output positions per invocation of the direct form.
const DIRECT_POSITIONS: u64 = 4;

/// The sizes of one convolution.
struct Geometry {
    n: u64,
    c: u64,
    h: u64,
    w: u64,
    o: u64,
    kh: u64,
    kw: u64,
    oh: u64,
    ow: u64,
    groups: u64,
    /// Input channels per group.
    cg: u64,
    /// Output channels per group.
    og: u64,
    attrs: ConvAttrs,
}

impl Geometry {
    fn of(node: &Node, x: &Node, w: &Node) -> Geometry {
        let Op::Conv2d(attrs) = &node.op else { unreachable!("conv kernel of a {}", node.op.name()) };
        let d = |n: &Node, i: usize| n.shape.dims()[i] as u64;
        let groups = attrs.groups as u64;
        Geometry {
            n: d(x, 0),
            c: d(x, 1),
            h: d(x, 2),
            w: d(x, 3),
            o: d(w, 0),
            kh: d(w, 2),
            kw: d(w, 3),
            oh: d(node, 2),
            ow: d(node, 3),
            groups,
            cg: d(x, 1) / groups.max(1),
            og: d(w, 0) / groups.max(1),
            attrs: attrs.clone(),
        }
    }

    /// Output positions per image.
    fn plane(&self) -> u64 {
        self.oh * self.ow
    }

    /// Taps per output channel.
    fn taps(&self) -> u64 {
        self.cg * self.kh * self.kw
    }
}

/// Channels per lane of the tiled form (`BN / 16`) for `og` output
/// channels per group.
fn tiled_channels(og: u64) -> u64 {
    og.div_ceil(16).next_power_of_two().clamp(1, 4)
}

/// The longest loop one invocation of a convolution of `form` runs, for
/// llvmpipe's loop-iteration cap (`node` is the conv, `w` its weight).
pub fn loop_iterations(form: ConvForm, node: &Node, w: &Node) -> u64 {
    if !matches!(node.op, Op::Conv2d(_)) {
        return 0;
    }
    let d = w.shape.dims();
    let (cg, kh, kw) = (d[1] as u64, d[2] as u64, d[3] as u64);
    match form {
        ConvForm::Direct => cg.max(kh).max(kw),
        ConvForm::Tiled => cg.saturating_mul(kh).saturating_mul(kw).div_ceil(TILE_K),
    }
}

/// How the direct form spreads one part of the reduction: channels per
/// invocation, channel blocks per group, lanes per workgroup, position
/// runs per block.
struct DirectLayout {
    ob: u64,
    blocks: u64,
    lanes: u64,
    mb: u64,
}

impl DirectLayout {
    fn of(geo: &Geometry) -> DirectLayout {
        let ob = geo.og.clamp(1, DIRECT_CHANNELS);
        let m = geo.n * geo.plane();
        let lanes = m.div_ceil(DIRECT_POSITIONS).next_power_of_two().clamp(32, super::WORKGROUP_SIZE as u64);
        DirectLayout { ob, blocks: geo.og.div_ceil(ob), lanes, mb: m.div_ceil(lanes * DIRECT_POSITIONS) }
    }

    /// Workgroups of one part.
    fn groups(&self, geo: &Geometry) -> u64 {
        geo.groups * self.blocks * self.mb
    }
}

/// How the tiled form spreads one part of the reduction: channels per
/// lane (`BN / 16`), position tiles, channel tiles per group.
struct TiledLayout {
    tn: u64,
    mb: u64,
    nb: u64,
}

impl TiledLayout {
    fn of(geo: &Geometry) -> TiledLayout {
        let tn = tiled_channels(geo.og);
        TiledLayout { tn, mb: (geo.n * geo.plane()).div_ceil(TILE_M), nb: geo.og.div_ceil(16 * tn) }
    }

    /// Workgroups of one part.
    fn groups(&self, geo: &Geometry) -> u64 {
        geo.groups * self.mb * self.nb
    }
}

/// Largest scratch (partial sums) of a split convolution, in elements.
const SPLIT_SCRATCH: u64 = 1 << 22;

/// Parts the reduction over taps is split into: 1, unless the output has
/// too few workgroups to fill the device and the taps are many (the
/// weight gradient: a handful of positions, a reduction over the whole
/// batch and image). The direct form splits the input channels, the
/// tiled form the tap slices; a second pass adds the parts.
fn split_parts(form: ConvForm, geo: &Geometry) -> u64 {
    let taps = geo.taps();
    let numel = geo.n * geo.o * geo.plane();
    let (groups, want, limit) = match form {
        // llvmpipe: a few workgroups per core.
        ConvForm::Direct => (DirectLayout::of(geo).groups(geo), 16, geo.cg),
        // About one workgroup per SM of a large GPU.
        ConvForm::Tiled => (TiledLayout::of(geo).groups(geo), 128, taps.div_ceil(TILE_K)),
    };
    if groups == 0 || groups >= want || taps < 1024 || numel == 0 {
        return 1;
    }
    let parts = want.div_ceil(groups).min(taps / 256).min(limit).min(64).min(SPLIT_SCRATCH / numel);
    if parts < 2 {
        1
    } else {
        parts
    }
}

/// How a convolution kernel is written, decided by the schedule (see
/// [`super::Schedule`]): the parts its reduction is split into (a second
/// pass adds them where more than one) and its workgroup size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvPlan {
    /// Parts of the reduction over taps (see `split_parts`).
    pub parts: u64,
    /// Invocations per workgroup.
    pub lanes: u64,
}

/// The plan of convolution kernel `k` of `g` in `form`.
pub(super) fn conv_plan(k: &Kernel, g: &lazuli_ir::VerifiedGraph, form: ConvForm) -> ConvPlan {
    let rn = g.node(k.root());
    let geo = Geometry::of(rn, g.node(rn.inputs[0]), g.node(rn.inputs[1]));
    let lanes = match form {
        ConvForm::Direct => DirectLayout::of(&geo).lanes,
        ConvForm::Tiled => super::WORKGROUP_SIZE as u64,
    };
    ConvPlan { parts: split_parts(form, &geo), lanes }
}

impl Writer<'_> {
    /// A convolution kernel in the form the limits select. Appends the
    /// statements of `main` to `b`; returns the invocation count.
    pub(super) fn conv_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let geo = Geometry::of(rn, g.node(rn.inputs[0]), g.node(rn.inputs[1]));
        let (x, w) = (rn.inputs[0].0, rn.inputs[1].0);
        let form = self.limits.forms.conv;
        let parts = self.s.conv().parts;
        let invocations = match form {
            ConvForm::Direct => self.conv_direct(&geo, x, w, parts, b),
            ConvForm::Tiled => self.conv_tiled(&geo, x, w, parts, b),
        };
        if parts > 1 {
            // This kernel wrote `parts` partial sums per output (output
            // index major); a second pass adds them up.
            let outputs = rn.shape.numel() as u64;
            self.second = Some(self.second_pass(outputs, parts, "f32", "0.0", "acc + v", "acc"));
        }
        invocations
    }

    /// Statements that set `iy`/`ix` (i32) to the input row/column that
    /// tap (`ki`, `kj`) of output position (`oy`, `ox`) reads.
    fn conv_rows(geo: &Geometry, ind: &str, axis: usize, out: &str, tap: &str, var: &str) -> String {
        let a = &geo.attrs;
        format!(
            "{ind}let {var} = i32({out} * {}u + {tap} * {}u) - {};\n",
            a.strides[axis],
            a.dilations[axis],
            int_lit(a.pads[axis] as i32)
        )
    }

    /// The direct form: a workgroup per block of up to
    /// [`DIRECT_CHANNELS`] output channels of one group and a run of
    /// output positions, [`DIRECT_POSITIONS`] positions per invocation
    /// (`lanes` apart). llvmpipe loads a buffer element per lane even
    /// where every lane reads the same one, so what bounds this form there
    /// is loads per multiply-add: each tap loads one input element per
    /// position and one weight per channel, for positions x channels
    /// multiply-adds. Input reads clamp their position and select zero in
    /// the padding, so no load is masked.
    fn conv_direct(&mut self, geo: &Geometry, x: u32, w: u32, parts: u64, b: &mut String) -> u64 {
        let layout = DirectLayout::of(geo);
        let DirectLayout { ob, blocks, lanes, mb } = layout;
        let (plane, m) = (geo.plane(), geo.n * geo.plane());
        let np = DIRECT_POSITIONS;
        let part_groups = layout.groups(geo);
        let groups = part_groups * parts;
        let (kh, kw, taps) = (geo.kh, geo.kw, geo.taps());
        let a = &geo.attrs;
        let cs = geo.cg.div_ceil(parts);
        let _ = write!(
            b,
            "    let ga = wid.x + wid.y * nwg.x;\n    let part = ga / {part_groups}u;\n    let gi = ga % {part_groups}u;\n    let t = ga * {lanes}u + lid;\n{}    let mbk = gi % {mb}u;\n    let blk = (gi / {mb}u) % {blocks}u;\n    let gg = gi / {}u;\n    let oc = blk * {ob}u;\n",
            // Workgroup-uniform: a return here is safe.
            if groups > 65535 { format!("    if (ga >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            mb * blocks,
        );
        for p in 0..np {
            let _ = write!(
                b,
                "    let pm{p} = mbk * {}u + lid + {}u;\n    let q{p} = min(pm{p}, {}u) % {plane}u;\n    let xb{p} = (min(pm{p}, {}u) / {plane}u * {}u + gg * {}u) * {}u;\n    let iy{p} = i32(q{p} / {}u * {}u) - {};\n    let ix{p} = i32(q{p} % {}u * {}u) - {};\n",
                lanes * np,
                p * lanes,
                m.max(1) - 1,
                m.max(1) - 1,
                geo.c,
                geo.cg,
                geo.h * geo.w,
                geo.ow,
                a.strides[0],
                int_lit(a.pads[0] as i32),
                geo.ow,
                a.strides[1],
                int_lit(a.pads[1] as i32),
            );
        }
        // Weight rows of the block's channels (the last block's missing
        // channels read the group's last row and are never stored).
        for j in 0..ob {
            let _ = writeln!(b, "    let w{j} = (gg * {}u + min(oc + {j}u, {}u)) * {taps}u;", geo.og, geo.og - 1);
        }
        for p in 0..np {
            for j in 0..ob {
                let _ = writeln!(b, "    var acc{p}_{j} = 0.0;");
            }
        }
        let _ = writeln!(
            b,
            "    for (var c = part * {cs}u; c < min(part * {cs}u + {cs}u, {}u); c = c + 1u) {{\n        let xc = c * {}u;\n        let wc = c * {}u;",
            geo.cg,
            geo.h * geo.w,
            kh * kw
        );
        // One tap: `ki`/`kj` are literals (unrolled) or loop variables.
        let tap = |b: &mut String, ind: &str, ki: &str, kj: &str| {
            let _ = writeln!(b, "{ind}let wt = wc + {ki} * {kw}u + {kj};");
            for j in 0..ob {
                let _ = writeln!(b, "{ind}let wv{j} = n{w}(w{j} + wt);");
            }
            for p in 0..np {
                let _ = write!(
                    b,
                    "{ind}let y{p} = iy{p} + i32({ki} * {dh}u);\n{ind}let x{p} = ix{p} + i32({kj} * {dw}u);\n{ind}let xv{p} = select(0.0, n{x}(xb{p} + xc + u32(clamp(y{p}, 0i, {hm})) * {}u + u32(clamp(x{p}, 0i, {wm}))), y{p} >= 0i && y{p} < {h} && x{p} >= 0i && x{p} < {wd});\n",
                    geo.w,
                    dh = a.dilations[0],
                    dw = a.dilations[1],
                    h = int_lit(geo.h as i32),
                    wd = int_lit(geo.w as i32),
                    hm = int_lit(geo.h.max(1) as i32 - 1),
                    wm = int_lit(geo.w.max(1) as i32 - 1),
                );
                for j in 0..ob {
                    let _ = writeln!(b, "{ind}acc{p}_{j} = fma(xv{p}, wv{j}, acc{p}_{j});");
                }
            }
        };
        if kh * kw <= 16 {
            for ki in 0..kh {
                for kj in 0..kw {
                    b.push_str("        {\n");
                    tap(b, "            ", &format!("{ki}u"), &format!("{kj}u"));
                    b.push_str("        }\n");
                }
            }
        } else {
            let _ = writeln!(
                b,
                "        for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{\n            for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{"
            );
            tap(b, "                ", "ki", "kj");
            b.push_str("            }\n        }\n");
        }
        b.push_str("    }\n");
        for p in 0..np {
            let _ = writeln!(
                b,
                "    if (pm{p} < {m}u) {{\n        let ob = (pm{p} / {plane}u * {}u + gg * {}u + oc) * {plane}u + q{p};",
                geo.o,
                geo.og
            );
            for j in 0..ob {
                let store = if parts > 1 {
                    self.output(0).store(&format!("(ob + {}u) * {parts}u + part", j * plane), &format!("acc{p}_{j}"))
                } else {
                    self.output(0).store(&format!("ob + {}u", j * plane), &format!("acc{p}_{j}"))
                };
                if geo.og.is_multiple_of(ob) {
                    let _ = writeln!(b, "        {store}");
                } else {
                    let _ = writeln!(b, "        if (oc + {j}u < {}u) {{\n            {store}\n        }}", geo.og);
                }
            }
            b.push_str("    }\n");
        }
        groups * lanes
    }

    /// The tiled form: a workgroup per 64 positions by `BN` channels of
    /// one group, patch and weight slices staged in workgroup memory.
    fn conv_tiled(&mut self, geo: &Geometry, x: u32, w: u32, parts: u64, b: &mut String) -> u64 {
        let layout = TiledLayout::of(geo);
        let TiledLayout { tn, mb, nb } = layout;
        let bn = 16 * tn;
        let (plane, m, taps) = (geo.plane(), geo.n * geo.plane(), geo.taps());
        let part_groups = layout.groups(geo);
        let groups = part_groups * parts;
        // Tap slices per part.
        let kchunk = taps.div_ceil(TILE_K).div_ceil(parts) * TILE_K;
        let lanes = super::WORKGROUP_SIZE as u64;
        let sb_row = TILE_K + 1;
        let _ = writeln!(
            self.shared,
            "var<workgroup> sa: array<f32, {}>;\nvar<workgroup> sb: array<f32, {}>;\n",
            TILE_K * TILE_M,
            bn * sb_row
        );
        let _ = writeln!(
            b,
            "    let ga = wid.x + wid.y * nwg.x;\n    let part = ga / {part_groups}u;\n    let gi = ga % {part_groups}u;\n    let t = ga * {lanes}u + lid;\n{}    let cb = gi % {nb}u;\n    let rb = (gi / {nb}u) % {mb}u;\n    let gg = gi / {}u;\n    let m0 = rb * {TILE_M}u;\n    let o0 = cb * {bn}u;\n    let lx = lid % 16u;\n    let ly = lid / 16u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 { format!("    if (ga >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            (mb * nb).max(1),
        );
        for i in 0..4 {
            for j in 0..tn {
                let _ = writeln!(b, "    var acc{i}_{j} = 0.0;");
            }
        }
        let ktaps = geo.kh * geo.kw;
        let _ = write!(
            b,
            "    for (var k0 = part * {kchunk}u; k0 < min(part * {kchunk}u + {kchunk}u, {taps}u); k0 = k0 + {TILE_K}u) {{\n        // The patch slice: sa[kk * {TILE_M} + mm], adjacent lanes on adjacent positions.\n        for (var r = 0u; r < {}u; r = r + 1u) {{\n            let e = lid + r * {lanes}u;\n            let kk = e / {TILE_M}u;\n            let mm = e % {TILE_M}u;\n            let pm = m0 + mm;\n            let k = k0 + kk;\n            var v = 0.0;\n            if (pm < {m}u && k < {taps}u) {{\n                let n = pm / {plane}u;\n                let q = pm % {plane}u;\n                let oy = q / {}u;\n                let ox = q % {}u;\n                let c = k / {ktaps}u;\n                let tap = k % {ktaps}u;\n                let ki = tap / {}u;\n                let kj = tap % {}u;\n{}{}                if (iy >= 0i && iy < {} && ix >= 0i && ix < {}) {{\n                    v = n{x}(((n * {}u + gg * {}u + c) * {}u + u32(iy)) * {}u + u32(ix));\n                }}\n            }}\n            sa[e] = v;\n        }}\n",
            TILE_K * TILE_M / lanes,
            geo.ow,
            geo.ow,
            geo.kw,
            geo.kw,
            Self::conv_rows(geo, "                ", 0, "oy", "ki", "iy"),
            Self::conv_rows(geo, "                ", 1, "ox", "kj", "ix"),
            int_lit(geo.h as i32),
            int_lit(geo.w as i32),
            geo.c,
            geo.cg,
            geo.h,
            geo.w,
        );
        // The weight slice, read along the contiguous tap axis and stored
        // with row stride 17: sb[nn * 17 + kk].
        let _ = write!(
            b,
            "        for (var r = 0u; r < {}u; r = r + 1u) {{\n            let e = lid + r * {lanes}u;\n            let kk = e % {TILE_K}u;\n            let nn = e / {TILE_K}u;\n            let k = k0 + kk;\n            var v = 0.0;\n            if (o0 + nn < {}u && k < {taps}u) {{\n                v = n{w}((gg * {}u + o0 + nn) * {taps}u + k);\n            }}\n            sb[nn * {sb_row}u + kk] = v;\n        }}\n        workgroupBarrier();\n        for (var kk = 0u; kk < {TILE_K}u; kk = kk + 1u) {{\n",
            TILE_K * bn / lanes,
            geo.og,
            geo.og,
        );
        for i in 0..4 {
            let _ = writeln!(b, "            let a{i} = sa[kk * {TILE_M}u + lx + {}u];", 16 * i);
        }
        for j in 0..tn {
            let _ = writeln!(b, "            let b{j} = sb[(ly + {}u) * {sb_row}u + kk];", 16 * j);
        }
        for i in 0..4 {
            for j in 0..tn {
                let _ = writeln!(b, "            acc{i}_{j} = fma(a{i}, b{j}, acc{i}_{j});");
            }
        }
        b.push_str("        }\n        workgroupBarrier();\n    }\n");
        for i in 0..4 {
            let _ = write!(
                b,
                "    let pm{i} = m0 + lx + {}u;\n    let base{i} = (pm{i} / {plane}u) * {}u * {plane}u + pm{i} % {plane}u;\n",
                16 * i,
                geo.o
            );
            for j in 0..tn {
                let at = if parts > 1 {
                    format!(
                        "(base{i} + (gg * {og}u + o0 + ly + {oj}u) * {plane}u) * {parts}u + part",
                        og = geo.og,
                        oj = 16 * j
                    )
                } else {
                    format!("base{i} + (gg * {og}u + o0 + ly + {oj}u) * {plane}u", og = geo.og, oj = 16 * j)
                };
                let _ = writeln!(
                    b,
                    "    if (pm{i} < {m}u && o0 + ly + {oj}u < {og}u) {{\n        {}\n    }}",
                    self.output(0).store(&at, &format!("acc{i}_{j}")),
                    oj = 16 * j,
                    og = geo.og
                );
            }
        }
        groups * lanes
    }
}
