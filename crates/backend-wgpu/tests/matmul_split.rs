//! The split-K rule of the GPU matmul (`codegen::matmul::choose_form`):
//! pure checks of the forms and workgroup counts it gives, no device.
//! The kernels' results are checked on an adapter in `backend.rs`
//! (`split_k_matmul_matches_the_cpu`, `matmul_layouts_and_epilogue`).

use lazuli_ir::fusion::{self, FusionLimits, Kernel};
use lazuli_ir::{DType, Graph, Op, ValueType, VerifiedGraph};
use lazuli_wgpu::codegen::matmul::{tiled_workgroups, MATMUL_SPLIT_TARGET};
use lazuli_wgpu::codegen::{lower, schedule, LowerLimits, MatmulForm, MatmulProblem, MatmulTile};

/// The form the schedule decides for kernel `k` of `v` under `limits`.
fn resolve_form(k: &Kernel, v: &VerifiedGraph, limits: &LowerLimits) -> MatmulForm {
    schedule(k, v, limits).unwrap().matmul_form().expect("a matmul kernel")
}

/// `x^T dy` as autograd records a weight gradient: x [tokens, m],
/// dy [tokens, n], output [m, n]; its one kernel.
fn weight_gradient(tokens: usize, m: usize, n: usize) -> (VerifiedGraph, Kernel) {
    let mut g = Graph::new();
    let x = g.param(ValueType::new([tokens, m], DType::F32));
    let dy = g.param(ValueType::new([tokens, n], DType::F32));
    let xt = g.push(Op::Permute(vec![1, 0]), &[x]).unwrap();
    let gw = g.push(Op::MatMul, &[xt, dy]).unwrap();
    g.outputs.push(gw);
    one_kernel(g)
}

fn one_kernel(g: Graph) -> (VerifiedGraph, Kernel) {
    let v = g.verify().unwrap();
    let fl = FusionLimits { matmul_epilogue: true, ..FusionLimits::default() };
    let mut plan = fusion::plan(&v, &fl);
    assert_eq!(plan.kernels.len(), 1);
    let k = plan.kernels.remove(0);
    (v, k)
}

/// G8's sixteen weight gradients (n_embd 256, 4096 tokens: attention
/// projections 256 x 768 and 256 x 256, MLP 256 x 1024 and 1024 x 256)
/// launch at least two waves of an H100 (264 workgroups) split over K,
/// where the one-pass tiles made 16 to 64.
#[test]
fn g8_weight_gradients_split_to_two_waves() {
    let gpu = LowerLimits::gpu();
    let mut report = Vec::new();
    for (m, n, before) in [(256, 256, 16), (256, 768, 48), (256, 1024, 64), (1024, 256, 64)] {
        let (v, k) = weight_gradient(4096, m, n);
        let form = resolve_form(&k, &v, &gpu);
        let MatmulForm::SplitK { tile, parts } = form else { panic!("{m}x{n}: {form:?}") };
        let problem = MatmulProblem::of(&k, &v).unwrap();
        assert_eq!(tiled_workgroups(&problem, MatmulForm::Tiled(tile)), Some(before), "{m}x{n}");
        let after = tiled_workgroups(&problem, form).unwrap();
        assert!(after >= MATMUL_SPLIT_TARGET, "{m}x{n}: {after} workgroups");
        // Each part walks a decent depth of K.
        assert!(4096 / parts as u64 >= 128, "{m}x{n}: {parts} parts");
        let w = lower(&k, &v, &gpu).unwrap();
        let pre = w.pre.as_deref().expect("two passes");
        assert_eq!(pre.invocations, after * 256, "{m}x{n}");
        assert_eq!(pre.scratch, parts as u64 * (m * n) as u64);
        assert!(w.binds_inputs);
        report.push(format!("{m}x{n}: {before} -> {after} workgroups ({tile:?}, {parts} parts)"));
    }
    eprintln!("{}", report.join("\n"));
}

/// Products that already fill the GPU, short ones, narrow ones, integer
/// ones and kernels generic over sizes keep their one-pass form.
#[test]
fn split_only_where_it_pays() {
    let gpu = LowerLimits::gpu();
    let square = {
        let mut g = Graph::new();
        let a = g.param(ValueType::new([2048, 2048], DType::F32));
        let b = g.param(ValueType::new([2048, 2048], DType::F32));
        let y = g.push(Op::MatMul, &[a, b]).unwrap();
        g.outputs.push(y);
        one_kernel(g)
    };
    assert_eq!(resolve_form(&square.1, &square.0, &gpu), MatmulForm::Tiled(MatmulTile { bm: 128, bn: 128 }));
    let one_pass = |(v, k): (VerifiedGraph, Kernel), limits: &LowerLimits| {
        let f = resolve_form(&k, &v, limits);
        assert!(!matches!(f, MatmulForm::SplitK { .. }), "{f:?}");
        assert!(lower(&k, &v, limits).unwrap().pre.is_none());
    };
    // K too short to be worth a second pass.
    one_pass(weight_gradient(512, 256, 256), &gpu);
    // Enough tiles already (1024 x 1024: 128 tiles of 128 x 64).
    one_pass(weight_gradient(4096, 1024, 1024), &gpu);
    // Narrow: the register-blocked form.
    one_pass(weight_gradient(4096, 16, 256), &gpu);
    // Sizes that vary, and the software profile.
    one_pass(weight_gradient(4096, 256, 256), &LowerLimits { generic: true, ..gpu });
    one_pass(weight_gradient(4096, 256, 256), &LowerLimits::software());
    // Integers are never split, even when forced.
    let int = {
        let mut g = Graph::new();
        let a = g.param(ValueType::new([64, 4096], DType::I32));
        let b = g.param(ValueType::new([4096, 64], DType::I32));
        let y = g.push(Op::MatMul, &[a, b]).unwrap();
        g.outputs.push(y);
        one_kernel(g)
    };
    let forced = LowerLimits {
        forms: lazuli_wgpu::codegen::KernelForms {
            matmul: MatmulForm::SplitK { tile: MatmulTile { bm: 64, bn: 64 }, parts: 8 },
            ..lazuli_wgpu::codegen::KernelForms::gpu()
        },
        ..gpu
    };
    one_pass(int, &forced);
}

/// A forced part count is recounted in whole k-slices of 8: parts that
/// would start past K are dropped, one part is the tiled form.
#[test]
fn forced_parts_are_recounted() {
    let force = |parts| LowerLimits {
        forms: lazuli_wgpu::codegen::KernelForms {
            matmul: MatmulForm::SplitK { tile: MatmulTile { bm: 64, bn: 64 }, parts },
            ..lazuli_wgpu::codegen::KernelForms::gpu()
        },
        ..LowerLimits::gpu()
    };
    let t = MatmulTile { bm: 64, bn: 64 };
    let (v, k) = weight_gradient(20, 64, 64);
    // 20 = 8 + 8 + 4: three parts at most.
    assert_eq!(resolve_form(&k, &v, &force(2)), MatmulForm::SplitK { tile: t, parts: 2 });
    assert_eq!(resolve_form(&k, &v, &force(5)), MatmulForm::SplitK { tile: t, parts: 3 });
    let (v, k) = weight_gradient(8, 64, 64);
    assert_eq!(resolve_form(&k, &v, &force(4)), MatmulForm::Tiled(t));
}
