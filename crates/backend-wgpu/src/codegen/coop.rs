//! The tensor-core matmul: f16 products through cooperative matrices
//! (wgpu's experimental `wgpu_cooperative_matrix` WGSL extension, Vulkan's
//! `VK_KHR_cooperative_matrix`), f16 operands multiplied with f32
//! accumulation, the fused epilogue applied at the store as in the other
//! matmul forms.
//!
//! Chosen by a rule, never by default on an adapter without it
//! ([`LowerLimits::cooperative_matrix`] is true only where the device was
//! opened with the feature, `SHADER_F16` and `SUBGROUP`, advertises a
//! 16 x 16 x 16 configuration of f16 A/B and f32 C/R, and runs subgroups of
//! exactly [`COOP_SUBGROUP`] lanes — NVIDIA's warps): f16 x f16 products at
//! fixed sizes (see [`eligible`]). Every other product, and every product
//! on adapters without the feature (lavapipe among them), keeps the f32
//! forms of [`super::matmul`].
//!
//! The kernel: a workgroup owns a `bm` x `bn` output tile ([`CoopTile`]);
//! its subgroups form a grid, each owning `fr` x `fc` fragments of 16 x 16
//! outputs held as `coop_mat16x16<f32, C>` accumulators. Per k-slice of
//! [`COOP_BK`], every invocation loads its share of the A and B slices
//! (adjacent lanes on adjacent k of A and adjacent n of B: coalesced for
//! row-major operands), converts them to f16 and stores them to workgroup
//! memory (rows padded by 8 halves against bank conflicts, every fragment
//! row 16-byte aligned); after a barrier each subgroup loads its A and B
//! fragments (`coopLoadT`, row-major) and multiplies-adds them into its
//! accumulators. Out-of-range rows, columns and k load as zero (clamped
//! index, `select`). At the end each accumulator goes through a 16 x 16 f32
//! staging area of its subgroup in workgroup memory (`coopStoreT`), from
//! which the subgroup's lanes apply the epilogue and store every in-range
//! element.
//!
//! Lavapipe has no cooperative matrices, so on this project's CI the form
//! is proven by naga validation of every tile and layout
//! (`tests/golden.rs`, the unit tests below) and by a differential test
//! that runs wherever an adapter has the feature (`tests/half_dtypes.rs`
//! says so when it does not).

use super::matmul::MatmulProblem;
use super::{LowerLimits, Writer};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::DType;
use std::fmt::Write as _;

/// Lanes of the subgroups the form is written for (NVIDIA's warp); the
/// device rule requires `subgroup_min_size == subgroup_max_size` equal to it.
pub const COOP_SUBGROUP: u64 = 32;

/// Side of one cooperative-matrix fragment (`coop_mat16x16`).
pub const COOP_FRAGMENT: u64 = 16;

/// Depth of the k-slices staged in workgroup memory.
pub const COOP_BK: u64 = 32;

/// Halves of padding after every staged row (16 bytes: fragment rows stay
/// 16-byte aligned, consecutive rows start in different banks).
const PAD: u64 = 8;

/// A workgroup's tile in the cooperative form: a grid of `sr` x `sc`
/// subgroups, each owning `fr` x `fc` fragments of 16 x 16 outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CoopTile {
    /// Subgroups along M.
    pub sr: u8,
    /// Subgroups along N.
    pub sc: u8,
    /// Fragments per subgroup along M.
    pub fr: u8,
    /// Fragments per subgroup along N.
    pub fc: u8,
}

impl CoopTile {
    /// 128 x 128 outputs: 8 subgroups (4 x 2), each 32 x 64 (2 x 4
    /// fragments, 8 accumulators): large products.
    pub const LARGE: CoopTile = CoopTile { sr: 4, sc: 2, fr: 2, fc: 4 };
    /// 64 x 64 outputs: 4 subgroups (2 x 2), each 32 x 32: products whose
    /// large tiles would not fill a GPU.
    pub const SMALL: CoopTile = CoopTile { sr: 2, sc: 2, fr: 2, fc: 2 };
    /// Every tile, largest first.
    pub const ALL: [CoopTile; 2] = [CoopTile::LARGE, CoopTile::SMALL];

    /// Output rows of the tile.
    pub fn bm(self) -> u64 {
        self.sr as u64 * self.fr as u64 * COOP_FRAGMENT
    }

    /// Output columns of the tile.
    pub fn bn(self) -> u64 {
        self.sc as u64 * self.fc as u64 * COOP_FRAGMENT
    }

    /// Invocations of a workgroup.
    pub fn lanes(self) -> u64 {
        self.sr as u64 * self.sc as u64 * COOP_SUBGROUP
    }

    /// Bytes of workgroup memory: the A and B slices in f16 and one 16 x 16
    /// f32 staging area per subgroup.
    pub fn workgroup_bytes(self) -> u64 {
        let a = self.bm() * (COOP_BK + PAD) * 2;
        let b = COOP_BK * (self.bn() + PAD) * 2;
        let staging = self.sr as u64 * self.sc as u64 * COOP_FRAGMENT * COOP_FRAGMENT * 4;
        a + b + staging
    }
}

/// Whether the product `p` may take the cooperative form under
/// `limits`: the device can run it, sizes are fixed (not a generic
/// kernel), both operands are f16, and the output has at least one
/// fragment's worth of rows and columns (narrower products keep the
/// register-blocked form, as in f32).
pub fn eligible(p: &MatmulProblem, limits: &LowerLimits) -> bool {
    limits.cooperative_matrix
        && !limits.generic
        && p.a_dtype == DType::F16
        && p.b_dtype == DType::F16
        && p.m >= COOP_FRAGMENT
        && p.n >= COOP_FRAGMENT
        && CoopTile::SMALL.workgroup_bytes() <= limits.workgroup_storage as u64
}

/// The tile for the product `p`: the large one where it gives at least
/// `min_tiles` workgroups (about one wave) and fits the workgroup memory,
/// else the small one.
pub fn choose_tile(p: &MatmulProblem, limits: &LowerLimits, min_tiles: u64) -> CoopTile {
    let t = CoopTile::LARGE;
    let tiles = p.batches() * p.m.div_ceil(t.bm()) * p.n.div_ceil(t.bn());
    if tiles >= min_tiles && t.workgroup_bytes() <= limits.workgroup_storage as u64 {
        t
    } else {
        CoopTile::SMALL
    }
}

impl Writer<'_> {
    /// Matmul kernel `k` in the cooperative form with `tile` (see the
    /// module documentation); appends `main`'s statements to `b` and
    /// returns the invocation count.
    pub(super) fn matmul_coop(&mut self, k: &Kernel, tile: CoopTile, b: &mut String) -> u64 {
        let sched = self.s;
        let pr = &sched.matmul().problem;
        let (na, nb) = (pr.a.0, pr.b.0);
        let (m, nn, kk) = (pr.m, pr.n, pr.k);
        let (ai, bi) = (pr.a_entry(), pr.b_entry());
        let (bm, bnn, lanes) = (tile.bm(), tile.bn(), tile.lanes());
        let (fr, fc) = (tile.fr as u64, tile.fc as u64);
        let (sa_stride, sb_stride) = (COOP_BK + PAD, bnn + PAD);
        let (mbs, nbs) = (m.div_ceil(bm), nn.div_ceil(bnn));
        let per_batch = mbs * nbs;
        let groups = pr.batches() * per_batch;
        let nsub = tile.sr as u64 * tile.sc as u64;
        let frag = COOP_FRAGMENT * COOP_FRAGMENT;
        let _ = writeln!(
            self.shared,
            "var<workgroup> sa: array<f16, {}>;\nvar<workgroup> sb: array<f16, {}>;\nvar<workgroup> so: array<f32, {}>;\n",
            bm * sa_stride,
            COOP_BK * sb_stride,
            nsub * frag
        );
        let _ = writeln!(
            b,
            "    let gi = wid.x + wid.y * nwg.x;\n{}    let cb = gi % {nbs}u;\n    let rb = (gi / {nbs}u) % {mbs}u;\n    let bi = gi / {per_batch}u;\n    let row0 = rb * {bm}u;\n    let col0 = cb * {bnn}u;\n    let abase = ({ai}) * {}u;\n    let bbase = ({bi}) * {}u;\n    let sr = (sid / {}u) * {}u;\n    let sc = (sid % {}u) * {}u;",
            // Workgroup-uniform: a return here keeps barriers uniform.
            if groups > 65535 { format!("    if (gi >= {groups}u) {{\n        return;\n    }}\n") } else { String::new() },
            m * kk,
            kk * nn,
            tile.sc,
            fr * COOP_FRAGMENT,
            tile.sc,
            fc * COOP_FRAGMENT,
        );
        for i in 0..fr {
            for j in 0..fc {
                let _ = writeln!(b, "    var c{i}_{j} = coop_mat16x16<f32, C>();");
            }
        }
        let ntiles = kk.div_ceil(COOP_BK);
        let (a_loads, b_loads) = (bm * COOP_BK / lanes, COOP_BK * bnn / lanes);
        let _ = writeln!(
            b,
            "    for (var kt = 0u; kt < {ntiles}u; kt = kt + 1u) {{\n        let k0 = kt * {COOP_BK}u;\n        for (var i = 0u; i < {a_loads}u; i = i + 1u) {{\n            let e = lid + i * {lanes}u;\n            let r = e / {COOP_BK}u;\n            let c = e % {COOP_BK}u;\n            let v = n{na}(abase + min(row0 + r, {}u) * {kk}u + min(k0 + c, {}u));\n            sa[r * {sa_stride}u + c] = f16(select(0.0, f32(v), row0 + r < {m}u && k0 + c < {kk}u));\n        }}\n        for (var i = 0u; i < {b_loads}u; i = i + 1u) {{\n            let e = lid + i * {lanes}u;\n            let r = e / {bnn}u;\n            let c = e % {bnn}u;\n            let v = n{nb}(bbase + min(k0 + r, {}u) * {nn}u + min(col0 + c, {}u));\n            sb[r * {sb_stride}u + c] = f16(select(0.0, f32(v), k0 + r < {kk}u && col0 + c < {nn}u));\n        }}\n        workgroupBarrier();",
            m - 1,
            kk.max(1) - 1,
            kk.max(1) - 1,
            nn - 1,
        );
        for ks in (0..COOP_BK).step_by(COOP_FRAGMENT as usize) {
            let _ = writeln!(b, "        {{");
            for i in 0..fr {
                let _ = writeln!(
                    b,
                    "            let a{i} = coopLoadT<coop_mat16x16<f16, A>>(&sa[(sr + {}u) * {sa_stride}u + {ks}u], {sa_stride}u);",
                    i * COOP_FRAGMENT
                );
            }
            for j in 0..fc {
                let _ = writeln!(
                    b,
                    "            let b{j} = coopLoadT<coop_mat16x16<f16, B>>(&sb[{}u + sc + {}u], {sb_stride}u);",
                    ks * sb_stride,
                    j * COOP_FRAGMENT
                );
            }
            for i in 0..fr {
                for j in 0..fc {
                    let _ = writeln!(b, "            c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});");
                }
            }
            let _ = writeln!(b, "        }}");
        }
        let _ = writeln!(
            b,
            "        workgroupBarrier();\n    }}\n    let obase = bi * {}u;\n    let so0 = sid * {frag}u;",
            m * nn
        );
        // Each accumulator through the subgroup's staging area: the
        // subgroup's lanes apply the epilogue to 8 elements each.
        for i in 0..fr {
            for j in 0..fc {
                let _ = writeln!(
                    b,
                    "    coopStoreT(c{i}_{j}, &so[so0], {COOP_FRAGMENT}u);\n    workgroupBarrier();\n    for (var e = sii; e < {frag}u; e = e + {COOP_SUBGROUP}u) {{\n        let gr = row0 + sr + {}u + e / {COOP_FRAGMENT}u;\n        let gc = col0 + sc + {}u + e % {COOP_FRAGMENT}u;\n        let acc = so[so0 + e];\n        if (gr < {m}u && gc < {nn}u) {{\n            let idx = obase + gr * {nn}u + gc;",
                    i * COOP_FRAGMENT,
                    j * COOP_FRAGMENT
                );
                for (sl, &o) in k.outputs.iter().enumerate() {
                    let _ = writeln!(
                        b,
                        "            {}",
                        self.output(sl).store("idx", &self.epilogue_store(o, "idx", "acc"))
                    );
                }
                let _ = writeln!(b, "        }}\n    }}\n    workgroupBarrier();");
            }
        }
        groups * lanes
    }
}

#[cfg(test)]
mod tests {
    use super::super::{lower, matmul, schedule, KernelForms, LowerLimits, MatmulForm};
    use super::*;
    use lazuli_ir::VerifiedGraph;

    /// The form the schedule decides for kernel `k` of `v` under `limits`.
    fn form(k: &Kernel, v: &VerifiedGraph, limits: &LowerLimits) -> MatmulForm {
        schedule(k, v, limits).unwrap().matmul().form
    }

    /// The product of matmul kernel `k` of `v`.
    fn problem(k: &Kernel, v: &VerifiedGraph) -> MatmulProblem {
        MatmulProblem::of(k, v).unwrap()
    }
    use super::super::HalfStorage;
    use lazuli_ir::fusion::{self, FusionLimits};
    use lazuli_ir::{BinaryOp, Graph, Op, UnaryOp, ValueType};

    /// The one kernel of an f16 product `a [.., m, k] @ b [.., k, n]` (A
    /// and B transposed views where asked), with `relu(y + bias)` in f16
    /// as epilogue where `epilogue`, the output f16 or cast to f32.
    fn product(
        batch: &[usize],
        (m, k, n): (usize, usize, usize),
        (ta, tb): (bool, bool),
        epilogue: bool,
        out: DType,
    ) -> (VerifiedGraph, Kernel) {
        let mut g = Graph::new();
        let dims = |r: usize, c: usize| [batch, &[r, c]].concat();
        let swap = || {
            let r = batch.len() + 2;
            let mut p: Vec<usize> = (0..r).collect();
            p.swap(r - 2, r - 1);
            p
        };
        let a = if ta {
            let x = g.param(ValueType::new(dims(k, m), DType::F16));
            g.push(Op::Permute(swap()), &[x]).unwrap()
        } else {
            g.param(ValueType::new(dims(m, k), DType::F16))
        };
        let b = if tb {
            let x = g.param(ValueType::new(dims(n, k), DType::F16));
            g.push(Op::Permute(swap()), &[x]).unwrap()
        } else {
            g.param(ValueType::new(dims(k, n), DType::F16))
        };
        let mut y = g.push(Op::MatMul, &[a, b]).unwrap();
        if epilogue {
            let bias = g.param(ValueType::new([n], DType::F16));
            y = g.push(Op::Binary(BinaryOp::Add), &[y, bias]).unwrap();
            y = g.push(Op::Unary(UnaryOp::Relu), &[y]).unwrap();
        }
        if out != DType::F16 {
            y = g.push(Op::Cast(out), &[y]).unwrap();
        }
        g.outputs.push(y);
        matmul::tests::one_kernel(g)
    }

    /// A device that runs cooperative matrices (an H100's 48 KiB of
    /// workgroup memory), f16 stored as `storage`.
    fn coop_limits(storage: HalfStorage) -> LowerLimits {
        LowerLimits { cooperative_matrix: true, workgroup_storage: 49152, f16: storage, ..LowerLimits::gpu() }
    }

    /// Every tile over transposed and batched operands, odd sizes,
    /// epilogues and both f16 storages: the rule picks the cooperative
    /// form, and each source passes naga with the cooperative-matrix
    /// capability, declares its subgroup builtins and runs one workgroup
    /// per tile.
    #[test]
    fn cooperative_kernels_validate_for_every_tile_and_layout() {
        type Case = (&'static [usize], (usize, usize, usize));
        let cases: [Case; 5] = [
            (&[], (16, 16, 16)),
            (&[], (65, 40, 129)),
            (&[3], (64, 33, 200)),
            (&[], (1024, 256, 1024)),
            (&[], (17, 1, 31)),
        ];
        for (batch, mkn) in cases {
            for ta in [false, true] {
                for tb in [false, true] {
                    for (epi, out) in [(false, DType::F16), (true, DType::F16), (true, DType::F32)] {
                        let (v, k) = product(batch, mkn, (ta, tb), epi, out);
                        for storage in [HalfStorage::Native, HalfStorage::Packed] {
                            let by_rule = coop_limits(storage);
                            let rule_tile = choose_tile(&problem(&k, &v), &by_rule, matmul::MATMUL_MIN_TILES);
                            assert_eq!(form(&k, &v, &by_rule), MatmulForm::Cooperative(rule_tile));
                            for tile in CoopTile::ALL {
                                let limits = LowerLimits {
                                    forms: KernelForms { matmul: MatmulForm::Cooperative(tile), ..KernelForms::gpu() },
                                    ..by_rule
                                };
                                let what =
                                    format!("{batch:?} {mkn:?} ta={ta} tb={tb} epi={epi} {out} {storage:?} {tile:?}");
                                let w = lower(&k, &v, &limits).unwrap_or_else(|e| panic!("{what}: {e}"));
                                crate::validate::validate_wgsl(&w.source).unwrap_or_else(|e| panic!("{what}: {e}"));
                                assert!(w.source.starts_with("enable f16;"), "{what}");
                                assert!(w.source.contains("coopMultiplyAdd"), "{what}");
                                assert!(w.source.contains("@builtin(subgroup_id) sid"), "{what}");
                                assert_eq!(w.workgroup_size as u64, tile.lanes(), "{what}");
                                let (m, n) = (mkn.0 as u64, mkn.2 as u64);
                                let groups = batch.iter().product::<usize>() as u64
                                    * m.div_ceil(tile.bm())
                                    * n.div_ceil(tile.bn());
                                assert_eq!(w.invocations, groups * tile.lanes(), "{what}");
                                assert!(!w.trusted, "{what}: cooperative kernels keep runtime checks");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The form is never chosen where the device lacks it, for f32 or
    /// mixed products, for kernels generic over sizes or for outputs
    /// narrower than a fragment; forced there, it resolves to the f32
    /// rule's form.
    #[test]
    fn the_cooperative_form_only_where_the_device_and_the_product_allow() {
        let (v, k) = product(&[], (256, 64, 256), (false, false), false, DType::F16);
        let forced = |limits: LowerLimits| LowerLimits {
            forms: KernelForms { matmul: MatmulForm::Cooperative(CoopTile::LARGE), ..KernelForms::gpu() },
            ..limits
        };
        let coop = |limits: &LowerLimits| matches!(form(&k, &v, limits), MatmulForm::Cooperative(_));
        assert!(coop(&coop_limits(HalfStorage::Native)));
        assert!(coop(&forced(coop_limits(HalfStorage::Native))));
        // lavapipe, or the option off: the f32-compute forms.
        assert!(!coop(&LowerLimits { f16: HalfStorage::Native, ..LowerLimits::gpu() }));
        assert!(!coop(&forced(LowerLimits::gpu())));
        assert!(!lower(&k, &v, &forced(LowerLimits::gpu())).unwrap().source.contains("coop"));
        assert!(!coop(&LowerLimits { generic: true, ..coop_limits(HalfStorage::Native) }));
        // Too little workgroup memory for either tile.
        assert!(!coop(&LowerLimits { workgroup_storage: 8192, ..coop_limits(HalfStorage::Native) }));
        // The large tile only where it makes a wave of workgroups.
        let small = coop_limits(HalfStorage::Native);
        assert_eq!(choose_tile(&problem(&k, &v), &small, matmul::MATMUL_MIN_TILES), CoopTile::SMALL);
        let (v2, k2) = product(&[], (2048, 64, 2048), (false, false), false, DType::F16);
        assert_eq!(choose_tile(&problem(&k2, &v2), &small, matmul::MATMUL_MIN_TILES), CoopTile::LARGE);
        // f32 products and outputs narrower than a fragment.
        let f32_product = {
            let mut g = Graph::new();
            let a = g.param(ValueType::new([256, 64], DType::F32));
            let b = g.param(ValueType::new([64, 256], DType::F32));
            let y = g.push(Op::MatMul, &[a, b]).unwrap();
            g.outputs.push(y);
            let v = g.verify().unwrap();
            let mut plan = fusion::plan(&v, &FusionLimits::default());
            (v, plan.kernels.remove(0))
        };
        assert!(!eligible(&problem(&f32_product.1, &f32_product.0), &coop_limits(HalfStorage::Native)));
        let (v3, k3) = product(&[], (256, 64, 8), (false, false), false, DType::F16);
        assert!(!eligible(&problem(&k3, &v3), &coop_limits(HalfStorage::Native)));
        assert!(CoopTile::ALL.iter().all(|t| t.workgroup_bytes() <= 32768), "both tiles fit 32 KiB");
    }
}
