//! The cost model behind the roofline of `lazuli bench --profile`: what
//! each launch of a compiled kernel does, computed once when the kernel
//! compiles (nothing is counted while it runs). A launch's bytes are the
//! kernel's input and output tensors, each counted once at 4 bytes an
//! element (every dtype this backend stores is 32-bit; lifted scalars
//! travel in the uniform buffer and count nothing), as if every value
//! were read or written exactly once: reads a kernel repeats (a matmul's
//! tiles, a broadcast operand) are the caches' business, so achieved
//! bandwidth above the memory's means the caches served them. FLOPs
//! follow the graph, not the generated code: one per output element of an
//! elementwise node (`Unary`, `Binary`, `Where`); one per input element of
//! a reduction, arg-reduction or cumulative sum; five per element of a
//! softmax (max, subtract, exp, sum, divide); `2 * M * N * K` for a
//! matmul; `2 * out * (C / groups) * kh * kw` for a convolution; one per
//! window element per output of a pooling (per gradient element of its
//! gradient); one per source element of a scatter-add; views, casts,
//! gathers, constants and random numbers count none. An attention kernel
//! counts its products once for all the parts it writes, dense (a causal
//! mask does not halve them): the scores `q k^T` always, `P V` for the
//! output, `dO V^T` for the query or key gradient, `dS k` for the query
//! gradient, `dS^T q` for the key gradient and `P^T dO` for the value
//! gradient, each `2 * t_q * t_k * width` per batch. A two-pass kernel's
//! first pass is charged the kernel's FLOPs and its inputs (an epilogue's
//! own inputs included) plus the scratch it writes; the second pass one
//! addition per scratch element and the scratch it reads plus the outputs.
//! Workgroups are those the launch dispatches (`dispatch_size`), padding
//! of a 2-D grid included.

use crate::codegen::Wgsl;
use crate::device::context::dispatch_size;
use lazuli_executor::LaunchCost;
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{AttentionPart, NodeId, Op, VerifiedGraph};

/// Bytes per element of every tensor this backend stores.
const ELEMENT_BYTES: u64 = 4;

/// The launches of kernel `k` of `graph`, named `name` and lowered as
/// `wgsl`: its first pass (where it has one) and the kernel proper.
pub(crate) fn launches(k: &Kernel, graph: &VerifiedGraph, name: &str, wgsl: &Wgsl) -> (Option<LaunchCost>, LaunchCost) {
    let flops = kernel_flops(k, graph);
    let tensor_bytes = |ids: &[NodeId]| -> u64 {
        ids.iter()
            .map(|id| graph.node(*id))
            .filter(|n| !matches!(n.op, Op::ScalarParam(_) | Op::Constant(..)))
            .map(|n| n.shape.numel() as u64 * ELEMENT_BYTES)
            .sum()
    };
    let (inputs, outputs) = (tensor_bytes(&k.inputs), tensor_bytes(&k.outputs));
    let main = |flops: u64, bytes: u64| LaunchCost {
        name: name.to_string(),
        flops,
        bytes,
        workgroups: workgroups(wgsl.invocations, wgsl.workgroup_size),
    };
    match &wgsl.pre {
        Some(pre) => {
            let scratch = pre.scratch;
            let first = LaunchCost {
                name: format!("{name}_pass1"),
                flops,
                bytes: inputs + scratch * ELEMENT_BYTES,
                workgroups: workgroups(pre.invocations, pre.workgroup_size),
            };
            (Some(first), main(scratch, scratch * ELEMENT_BYTES + outputs))
        }
        None => (None, main(flops, inputs + outputs)),
    }
}

/// Workgroups a launch of `invocations` in workgroups of `size`
/// dispatches.
fn workgroups(invocations: u64, size: u32) -> u64 {
    if invocations == 0 {
        return 0;
    }
    let (x, y) = dispatch_size(invocations, size);
    x as u64 * y as u64
}

/// FLOPs of kernel `k` by the model in the module doc: every node it
/// evaluates or writes, once, its attention parts together.
fn kernel_flops(k: &Kernel, graph: &VerifiedGraph) -> u64 {
    let mut nodes: Vec<NodeId> = k.inline.iter().chain(&k.outputs).copied().collect();
    nodes.sort();
    nodes.dedup();
    let mut parts = Vec::new();
    let mut total = 0u64;
    for id in nodes {
        match graph.node(id).op {
            Op::Attention { part, .. } => parts.push((id, part)),
            _ => total = total.saturating_add(node_flops(graph, id)),
        }
    }
    if let Some(&(first, _)) = parts.first() {
        let parts: Vec<AttentionPart> = parts.iter().map(|p| p.1).collect();
        total = total.saturating_add(attention_flops(graph, first, &parts));
    }
    total
}

/// FLOPs of node `id` (not an attention part).
pub(crate) fn node_flops(graph: &VerifiedGraph, id: NodeId) -> u64 {
    let n = graph.node(id);
    let out = n.shape.numel() as u64;
    let operand = |i: usize| n.inputs.get(i).map(|&x| graph.node(x));
    let numel = |i: usize| operand(i).map_or(0, |x| x.shape.numel() as u64);
    match &n.op {
        Op::Unary(_) | Op::Binary(_) | Op::Where => out,
        Op::Reduce { .. } | Op::ArgReduce { .. } | Op::CumSum { .. } => numel(0),
        Op::Softmax { .. } => 5 * out,
        Op::MatMul => {
            let inner = operand(0).and_then(|a| a.shape.dims().last().copied()).unwrap_or(0) as u64;
            2u64.saturating_mul(out).saturating_mul(inner)
        }
        Op::Conv2d(_) => {
            // Weights `[O, C/g, kh, kw]`: each output sums `C/g * kh * kw`
            // products.
            let per_output = operand(1).map_or(0, |w| {
                let o = w.shape.dims().first().copied().unwrap_or(1).max(1);
                (w.shape.numel() / o) as u64
            });
            2u64.saturating_mul(out).saturating_mul(per_output)
        }
        Op::Pool(p) => out.saturating_mul(p.kernel.iter().product::<usize>() as u64),
        Op::PoolGrad(p) => numel(1).saturating_mul(p.kernel.iter().product::<usize>() as u64),
        Op::ScatterAdd { .. } => numel(2),
        _ => 0,
    }
}

/// FLOPs of an attention kernel writing `parts`, whose node `id` has the
/// operands `q [.., t_q, d]`, `k [.., t_k, d]`, `v [.., t_k, d_v]`.
fn attention_flops(graph: &VerifiedGraph, id: NodeId, parts: &[AttentionPart]) -> u64 {
    let n = graph.node(id);
    let dims = |i: usize| n.inputs.get(i).map_or(&[][..], |&x| graph.node(x).shape.dims());
    let last2 = |d: &[usize]| -> (u64, u64) {
        match d {
            [.., a, b] => (*a as u64, *b as u64),
            _ => (1, 1),
        }
    };
    let ((tq, d), (tk, _), (_, dv)) = (last2(dims(0)), last2(dims(1)), last2(dims(2)));
    // The broadcast batch: the largest of the operands' batches.
    let batch = (0..3).map(|i| dims(i).iter().rev().skip(2).product::<usize>() as u64).max().unwrap_or(1);
    let has = |p: AttentionPart| parts.contains(&p);
    let mut widths = d; // the scores
    if has(AttentionPart::Out) {
        widths += dv;
    }
    if has(AttentionPart::GradQ) || has(AttentionPart::GradK) {
        widths += dv; // dP = dO V^T
    }
    if has(AttentionPart::GradQ) {
        widths += d;
    }
    if has(AttentionPart::GradK) {
        widths += d;
    }
    if has(AttentionPart::GradV) {
        widths += dv;
    }
    2u64.saturating_mul(batch).saturating_mul(tq).saturating_mul(tk).saturating_mul(widths)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::{lower, LowerLimits};
    use lazuli_ir::fusion::{self, FusionLimits};
    use lazuli_ir::{BinaryOp, DType, Graph, ReduceOp, UnaryOp, ValueType};

    /// Each kernel of `g` (planned with matmul epilogues, as the runtime
    /// plans) lowered under `limits`, with its launches' costs.
    fn lowered(g: Graph, limits: &LowerLimits) -> Vec<(Wgsl, Vec<LaunchCost>)> {
        let g = g.verify().unwrap();
        let plan = fusion::plan(&g, &FusionLimits { matmul_epilogue: true, ..FusionLimits::default() });
        let mut out = Vec::new();
        for (i, k) in plan.kernels.iter().enumerate() {
            let wgsl = lower(k, &g, limits).unwrap();
            let (pre, main) = launches(k, &g, &format!("k{i}"), &wgsl);
            out.push((wgsl, pre.into_iter().chain([main]).collect()));
        }
        out
    }

    /// The launches' costs of `g` under `limits`.
    fn costs(g: Graph, limits: &LowerLimits) -> Vec<LaunchCost> {
        lowered(g, limits).into_iter().flat_map(|(_, c)| c).collect()
    }

    fn cost(name: &str, flops: u64, bytes: u64, workgroups: u64) -> LaunchCost {
        LaunchCost { name: name.into(), flops, bytes, workgroups }
    }

    fn f32p(g: &mut Graph, dims: &[usize]) -> NodeId {
        g.param(ValueType::new(dims.to_vec(), DType::F32))
    }

    #[test]
    fn a_matmul_with_a_bias_costs_its_product_its_epilogue_and_its_four_tensors() {
        let mut g = Graph::new();
        let (x, w, b) = (f32p(&mut g, &[256, 64]), f32p(&mut g, &[64, 128]), f32p(&mut g, &[128]));
        let y = g.push(Op::MatMul, &[x, w]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Add), &[y, b]).unwrap();
        g.outputs.push(y);
        // 2 * M * N * K for the product, one per output for the bias.
        let flops = 2 * 256 * 128 * 64 + 256 * 128;
        // x, w, b and y, once each.
        let bytes = (256 * 64 + 64 * 128 + 128 + 256 * 128) * 4;
        // GPU form: 64x64 output tiles, a workgroup each (4 x 2).
        assert_eq!(costs(g.clone(), &LowerLimits::gpu()), [cost("k0", flops, bytes, 8)]);
        // Software form: 16 outputs per invocation, 128 invocations a
        // workgroup (32768 / 16 / 128).
        assert_eq!(costs(g, &LowerLimits::software()), [cost("k0", flops, bytes, 16)]);
    }

    #[test]
    fn an_elementwise_chain_costs_one_flop_per_element_per_node() {
        let n = 71_680_000u64;
        let mut g = Graph::new();
        let x = f32p(&mut g, &[n as usize]);
        let s = g.scalar(DType::F32);
        let t = g.push(Op::Binary(BinaryOp::Mul), &[x, s]).unwrap();
        let t = g.push(Op::Unary(UnaryOp::Exp), &[t]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Add), &[t, x]).unwrap();
        g.outputs.push(y);
        for limits in [LowerLimits::gpu(), LowerLimits::software()] {
            let kernels = lowered(g.clone(), &limits);
            let [(wgsl, launches)] = &kernels[..] else { panic!("one kernel: {kernels:?}") };
            // Three nodes of n elements; x read and y written once (x is
            // read twice by the graph, once by the kernel; the lifted
            // scalar is in the uniform buffer).
            // What the launch dispatches: beyond 65535 workgroups a 2-D
            // grid, its last row padded.
            let (gx, gy) = crate::device::context::dispatch_size(wgsl.invocations, wgsl.workgroup_size);
            let groups = gx as u64 * gy as u64;
            assert_eq!(launches[..], [cost("k0", 3 * n, 2 * 4 * n, groups)]);
            // Every form covers at least a vec4 per invocation.
            assert!(groups > 0 && groups <= n / 4 / 256 + 65535, "{groups}");
        }
    }

    #[test]
    fn a_two_pass_reduction_charges_each_pass_its_own_work_and_traffic() {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[4, 65536]);
        let y = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[x]).unwrap();
        g.outputs.push(y);
        let (input, output) = (4 * 65536 * 4, 4 * 4);
        // GPU form: few long rows run in two passes, 8 partial sums a row
        // in 32 workgroups of 256 lanes, then one workgroup adding the 32
        // partials into the 4 sums.
        assert_eq!(
            costs(g.clone(), &LowerLimits::gpu()),
            [cost("k0_pass1", 4 * 65536, input + 32 * 4, 32), cost("k0", 32, 32 * 4 + output, 1)]
        );
        // Software form: one pass, 256 invocations a row in workgroups of
        // 256.
        assert_eq!(costs(g, &LowerLimits::software()), [cost("k0", 4 * 65536, input + output, 4)]);
    }

    /// The row workloads at their benchmark sizes (G4 softmax, G5 row
    /// sum, G6 layer norm, a bias gradient's column sum), planned with row
    /// kernels as the GPU profile is: each tensor moves once (the held
    /// rows read their input once, so the model's bytes are the kernels'
    /// own), and the workgroups are those the GPU forms launch.
    #[test]
    fn row_workloads_move_each_element_once_in_the_workgroups_of_their_layout() {
        let rows_plan = |g: Graph| -> Vec<LaunchCost> {
            let g = g.verify().unwrap();
            let fl = FusionLimits { row_kernels: true, inline_outputs: true, ..FusionLimits::default() };
            let plan = fusion::plan(&g, &fl);
            let mut out = Vec::new();
            for (i, k) in plan.kernels.iter().enumerate() {
                let wgsl = lower(k, &g, &LowerLimits { subgroups: true, ..LowerLimits::gpu() }).unwrap();
                let (pre, main) = launches(k, &g, &format!("k{i}"), &wgsl);
                out.extend(pre.into_iter().chain([main]));
            }
            out
        };
        let reduce = |g: &mut Graph, op, x, axis: usize| {
            g.push(Op::Reduce { op, axes: vec![axis], keepdim: true }, &[x]).unwrap()
        };
        // G4: 128 lanes of 8 vec4s per row, 2 rows a workgroup.
        let mut g = Graph::new();
        let x = f32p(&mut g, &[16384, 4096]);
        let y = g.push(Op::Softmax { axis: 1, log: false }, &[x]).unwrap();
        g.outputs.push(y);
        let c = rows_plan(g);
        assert_eq!((c.len(), c[0].bytes, c[0].workgroups), (1, 2 * 16384 * 4096 * 4, 8192), "{c:?}");
        // G5: read as vec4, 64 lanes of 16 vec4s per row, 4 rows a
        // workgroup.
        let mut g = Graph::new();
        let x = f32p(&mut g, &[16384, 4096]);
        let y = reduce(&mut g, ReduceOp::Sum, x, 1);
        g.outputs.push(y);
        assert_eq!(rows_plan(g), [cost("k0", 16384 * 4096, (16384 * 4096 + 16384) * 4, 4096)]);
        // G6: one row kernel, 32 lanes of 8 vec4s per row, 8 rows a
        // workgroup; x, the weight, the bias and y once each.
        let mut g = Graph::new();
        let (n, c) = (16384usize, 1024usize);
        let x = f32p(&mut g, &[n, c]);
        let w = f32p(&mut g, &[c]);
        let b = f32p(&mut g, &[c]);
        let mu = reduce(&mut g, ReduceOp::Mean, x, 1);
        let xc = g.push(Op::Binary(BinaryOp::Sub), &[x, mu]).unwrap();
        let sq = g.push(Op::Binary(BinaryOp::Mul), &[xc, xc]).unwrap();
        let var = reduce(&mut g, ReduceOp::Mean, sq, 1);
        let eps = g.scalar(DType::F32);
        let ve = g.push(Op::Binary(BinaryOp::Add), &[var, eps]).unwrap();
        let r = g.push(Op::Unary(UnaryOp::Rsqrt), &[ve]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Mul), &[xc, r]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Mul), &[y, w]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Add), &[y, b]).unwrap();
        g.outputs.push(y);
        let k = rows_plan(g);
        assert_eq!(k.len(), 1, "{k:?}");
        assert_eq!((k[0].bytes, k[0].workgroups), (((2 * n * c + 2 * c) * 4) as u64, 2048), "{k:?}");
        // A bias gradient: 256 parts of 16 rows (1024 workgroups, about
        // four per SM of an H100), then 16 lanes adding each column's
        // 256 partials (64 workgroups).
        let mut g = Graph::new();
        let x = f32p(&mut g, &[4096, 1024]);
        let y = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[x]).unwrap();
        g.outputs.push(y);
        let scratch = 1024 * 256;
        assert_eq!(
            rows_plan(g),
            [
                cost("k0_pass1", 4096 * 1024, (4096 * 1024 + scratch) * 4, 1024),
                cost("k0", scratch, (scratch + 1024) * 4, 64)
            ]
        );
    }

    #[test]
    fn workgroups_count_a_two_dimensional_grid_with_its_padding() {
        assert_eq!(workgroups(0, 256), 0);
        assert_eq!(workgroups(1000, 256), 4);
        // 73243 groups exceed 65535 in x: the grid is 65535 x 2.
        assert_eq!(workgroups(73_243 * 256, 256), 131_070);
    }

    #[test]
    fn attention_counts_each_product_of_the_parts_it_writes_once() {
        let mut g = Graph::new();
        let (b, t, d) = (2usize, 16usize, 8usize);
        let q = f32p(&mut g, &[b, t, d]);
        let k = f32p(&mut g, &[b, t, d]);
        let v = f32p(&mut g, &[b, t, d]);
        let scale = g.scalar(DType::F32);
        let attrs = lazuli_ir::AttentionAttrs::default();
        let out = g.push(Op::Attention { attrs, part: AttentionPart::Out }, &[q, k, v, scale]).unwrap();
        g.outputs.push(out);
        let g = g.verify().unwrap();
        let pairs = (b * t * t) as u64;
        let d = d as u64;
        assert_eq!(attention_flops(&g, out, &[AttentionPart::Out, AttentionPart::LogSumExp]), 2 * pairs * 2 * d);
        assert_eq!(attention_flops(&g, out, &[AttentionPart::LogSumExp]), 2 * pairs * d);
        assert_eq!(attention_flops(&g, out, &[AttentionPart::GradQ]), 2 * pairs * 3 * d);
        assert_eq!(attention_flops(&g, out, &[AttentionPart::GradK, AttentionPart::GradV]), 2 * pairs * 4 * d);
    }
}
