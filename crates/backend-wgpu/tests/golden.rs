//! Golden snapshots of generated WGSL: a fixed set of graphs is planned and
//! lowered under each kernel-form profile ([`LowerLimits::software`],
//! [`LowerLimits::gpu`]) and the sources are compared with the files in
//! `tests/golden/`. A change to code generation therefore shows up in
//! review as a diff of these files, and a refactor that must not change
//! generated code is proven not to. Besides the plain sources, the files
//! pin windows and size families: `windowed_*` kernels bind tensors as
//! several windows (lowered with `LowerLimits::windows`, see
//! `codegen::access`), `generic_*` kernels are
//! the members of a size family whose literals were read from the sizes
//! buffer (`Families::specialize` after `Families::observe`); the row
//! graphs are snapshotted a third time, `*.gpu_subgroups`, with the GPU
//! profile on a device with subgroups (`LowerLimits::subgroups`);
//! `half_*` kernels store f16 (native and packed) and bf16
//! (`codegen::access`), and
//! the f16 MLP once more with the tensor-core matmul,
//! `*.gpu_cooperative_matrix` (`LowerLimits::cooperative_matrix`).
//!
//! Lowering is pure (no device), so these tests run everywhere. After an
//! intended change, regenerate with `LAZULI_BLESS=1 cargo test -p
//! lazuli-wgpu --test golden` and review the diff.

use lazuli_ir::fusion::{self, FusionLimits};
use lazuli_ir::{
    ArgReduceOp, AttentionAttrs, AttentionMask, AttentionPart, BinaryOp, ConvAttrs, DType, Graph, NodeId, Op,
    PoolAttrs, PoolKind, RandomDist, ReduceOp, ScalarValue, Shape, UnaryOp, ValueType,
};
use lazuli_wgpu::codegen::window::Windows;
use lazuli_wgpu::codegen::{lower, FixedSizes, LowerLimits, Wgsl};
use lazuli_wgpu::rewrite::size_families::Families;
use std::path::PathBuf;

fn push(g: &mut Graph, op: Op, ins: &[NodeId]) -> NodeId {
    g.push(op, ins).unwrap()
}

fn bin(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
    push(g, Op::Binary(op), &[a, b])
}

fn un(g: &mut Graph, op: UnaryOp, a: NodeId) -> NodeId {
    push(g, Op::Unary(op), &[a])
}

fn f32p(g: &mut Graph, dims: &[usize]) -> NodeId {
    g.param(ValueType::new(dims.to_vec(), DType::F32))
}

fn reduce(g: &mut Graph, op: ReduceOp, x: NodeId, axes: &[usize], keepdim: bool) -> NodeId {
    push(g, Op::Reduce { op, axes: axes.to_vec(), keepdim }, &[x])
}

/// The fixed set of graphs: (name, graph).
fn graphs() -> Vec<(&'static str, Graph)> {
    let mut out = Vec::new();
    // W1's chain: straight-line elementwise.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[4096, 4096]);
        let s: Vec<NodeId> = (0..4).map(|_| g.scalar(DType::F32)).collect();
        let t = bin(&mut g, BinaryOp::Mul, x, s[0]);
        let t = bin(&mut g, BinaryOp::Add, t, s[1]);
        let t = un(&mut g, UnaryOp::Relu, t);
        let t = bin(&mut g, BinaryOp::Sub, t, s[2]);
        let t = un(&mut g, UnaryOp::Tanh, t);
        let y = bin(&mut g, BinaryOp::Mul, t, s[3]);
        g.outputs.push(y);
        out.push(("w1_chain", g));
    }
    // Small odd-sized elementwise with a broadcast row: straight-line width 1.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[7, 3]);
        let c = push(&mut g, Op::Constant(ScalarValue::Float(0.5), DType::F32), &[]);
        let y = bin(&mut g, BinaryOp::Mul, x, c);
        let y = un(&mut g, UnaryOp::Exp, y);
        g.outputs.push(y);
        out.push(("elementwise_odd", g));
    }
    // Indexed elementwise: a transpose plus a broadcast row, bool output.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[64, 48]);
        let r = f32p(&mut g, &[64]);
        let t = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
        let y = bin(&mut g, BinaryOp::Add, t, r);
        let z = push(&mut g, Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]);
        let m = bin(&mut g, BinaryOp::Gt, y, z);
        g.outputs.push(y);
        g.outputs.push(m);
        out.push(("elementwise_indexed", g));
    }
    // Row sums: long rows (G5-like, small), short rows, column sums.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[128, 4096]);
        let y = reduce(&mut g, ReduceOp::Sum, x, &[1], false);
        g.outputs.push(y);
        out.push(("reduce_rows_long", g));
    }
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[1000, 37]);
        let e = un(&mut g, UnaryOp::Exp, x);
        let y = reduce(&mut g, ReduceOp::Max, e, &[1], true);
        g.outputs.push(y);
        out.push(("reduce_rows_short", g));
    }
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[256, 100]);
        let y = reduce(&mut g, ReduceOp::Mean, x, &[0], false);
        g.outputs.push(y);
        out.push(("reduce_columns", g));
    }
    // Column sums of a large matrix (a bias gradient).
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[4096, 1024]);
        let y = reduce(&mut g, ReduceOp::Sum, x, &[0], false);
        g.outputs.push(y);
        out.push(("reduce_columns_large", g));
    }
    // A full reduction of a long vector.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[1 << 20]);
        let y = reduce(&mut g, ReduceOp::Sum, x, &[0], false);
        g.outputs.push(y);
        out.push(("reduce_full", g));
    }
    // Arg-reduce and cumsum.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[32, 100]);
        let a =
            push(&mut g, Op::ArgReduce { op: ArgReduceOp::ArgMax, axis: 1, keepdim: false, select_last: false }, &[x]);
        let c = push(&mut g, Op::CumSum { axis: 1, exclusive: false, reverse: false }, &[x]);
        g.outputs.push(a);
        g.outputs.push(c);
        out.push(("argmax_cumsum", g));
    }
    // Softmax and log-softmax over the last dim.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[256, 1024]);
        let y = push(&mut g, Op::Softmax { axis: 1, log: false }, &[x]);
        g.outputs.push(y);
        out.push(("softmax_rows", g));
    }
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[33, 10]);
        let s = g.scalar(DType::F32);
        let xs = bin(&mut g, BinaryOp::Mul, x, s);
        let y = push(&mut g, Op::Softmax { axis: 1, log: true }, &[xs]);
        g.outputs.push(y);
        out.push(("log_softmax_prologue", g));
    }
    // Softmax over a non-trailing axis.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[16, 40, 8]);
        let y = push(&mut g, Op::Softmax { axis: 1, log: false }, &[x]);
        g.outputs.push(y);
        out.push(("softmax_middle_axis", g));
    }
    // Layer norm as composed by `nn::layer_norm`.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[512, 1024]);
        let w = f32p(&mut g, &[1024]);
        let b = f32p(&mut g, &[1024]);
        let mu = reduce(&mut g, ReduceOp::Mean, x, &[1], true);
        let xc = bin(&mut g, BinaryOp::Sub, x, mu);
        let sq = bin(&mut g, BinaryOp::Mul, xc, xc);
        let var = reduce(&mut g, ReduceOp::Mean, sq, &[1], true);
        let eps = g.scalar(DType::F32);
        let ve = bin(&mut g, BinaryOp::Add, var, eps);
        let r = un(&mut g, UnaryOp::Rsqrt, ve);
        let y = bin(&mut g, BinaryOp::Mul, xc, r);
        let y = bin(&mut g, BinaryOp::Mul, y, w);
        let y = bin(&mut g, BinaryOp::Add, y, b);
        g.outputs.push(y);
        out.push(("layer_norm", g));
    }
    // Matmul with a bias + relu epilogue (a Linear layer).
    {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[256, 64]);
        let w = f32p(&mut g, &[64, 256]);
        let bias = f32p(&mut g, &[256]);
        let m = push(&mut g, Op::MatMul, &[a, w]);
        let y = bin(&mut g, BinaryOp::Add, m, bias);
        let y = un(&mut g, UnaryOp::Relu, y);
        g.outputs.push(y);
        out.push(("matmul_bias_relu", g));
    }
    // A narrow product (the digits demo's logits, N = 10) with its bias:
    // the GPU rule's one-row invocations against the software profile's
    // 8-row blocks.
    {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[64, 256]);
        let b = f32p(&mut g, &[256, 10]);
        let bias = f32p(&mut g, &[10]);
        let m = push(&mut g, Op::MatMul, &[a, b]);
        let y = bin(&mut g, BinaryOp::Add, m, bias);
        g.outputs.push(y);
        out.push(("matmul_narrow", g));
    }
    // Square matmul (W2/G2-like, small) and one with odd sizes.
    {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[1024, 1024]);
        let b = f32p(&mut g, &[1024, 1024]);
        let m = push(&mut g, Op::MatMul, &[a, b]);
        g.outputs.push(m);
        out.push(("matmul_square", g));
    }
    {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[37, 29]);
        let b = f32p(&mut g, &[29, 53]);
        let m = push(&mut g, Op::MatMul, &[a, b]);
        g.outputs.push(m);
        out.push(("matmul_odd", g));
    }
    // A weight gradient of G8 (x^T dy over 4096 tokens, 256 x 256 out):
    // split over K on GPUs, the epilogue (scaling and accumulation into an
    // earlier gradient, an input) in the second pass.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[4096, 256]);
        let dy = f32p(&mut g, &[4096, 256]);
        let prev = f32p(&mut g, &[256, 256]);
        let s = g.scalar(DType::F32);
        let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
        let gw = push(&mut g, Op::MatMul, &[xt, dy]);
        let gw = bin(&mut g, BinaryOp::Mul, gw, s);
        let gw = bin(&mut g, BinaryOp::Add, gw, prev);
        g.outputs.push(gw);
        out.push(("matmul_split_k", g));
    }
    // Transposed operands (the backward of a Linear) and a batched matmul.
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[256, 64]);
        let gy = f32p(&mut g, &[256, 128]);
        let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
        let gw = push(&mut g, Op::MatMul, &[xt, gy]);
        let w = f32p(&mut g, &[64, 128]);
        let wt = push(&mut g, Op::Permute(vec![1, 0]), &[w]);
        let gx = push(&mut g, Op::MatMul, &[gy, wt]);
        g.outputs.push(gw);
        g.outputs.push(gx);
        out.push(("matmul_transposed", g));
    }
    // Transposed views of reshaped inputs (a weight gradient over flattened
    // tokens, read as vec4 by the tiled form) and of an odd-sized one (M
    // = 63: element-wise loads with adjacent lanes along M).
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[2, 64, 64]);
        let gy = f32p(&mut g, &[128, 96]);
        let x2 = push(&mut g, Op::Reshape(Shape::new([128, 64])), &[x]);
        let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x2]);
        let gw = push(&mut g, Op::MatMul, &[xt, gy]);
        let z = f32p(&mut g, &[2, 20, 63]);
        let z2 = push(&mut g, Op::Reshape(Shape::new([40, 63])), &[z]);
        let zt = push(&mut g, Op::Permute(vec![1, 0]), &[z2]);
        let gz2 = f32p(&mut g, &[40, 96]);
        let gz = push(&mut g, Op::MatMul, &[zt, gz2]);
        g.outputs.push(gw);
        g.outputs.push(gz);
        out.push(("matmul_reshaped_transposed", g));
    }
    {
        let mut g = Graph::new();
        let q = f32p(&mut g, &[4, 64, 32]);
        let k = f32p(&mut g, &[4, 32, 64]);
        let m = push(&mut g, Op::MatMul, &[q, k]);
        g.outputs.push(m);
        out.push(("matmul_batched", g));
    }
    // Random, concat, iota: the other kernel kinds.
    {
        let mut g = Graph::new();
        let k0 = g.scalar(DType::U32);
        let k1 = g.scalar(DType::U32);
        let r = push(&mut g, Op::Random { shape: Shape::new([64, 8]), dist: RandomDist::Normal }, &[k0, k1]);
        let x = f32p(&mut g, &[64, 4]);
        let c = push(&mut g, Op::Concat { axis: 1 }, &[r, x]);
        g.outputs.push(c);
        out.push(("random_concat", g));
    }
    // An embedding lookup and its gradient: a checked gather and a
    // scatter-add into zeros (GPT-like rows of 64).
    {
        let mut g = Graph::new();
        let table = f32p(&mut g, &[1000, 64]);
        let ids = g.param(ValueType::new([4, 32], DType::I32));
        let e = push(&mut g, Op::Gather { axis: 0 }, &[table, ids]);
        let gy = f32p(&mut g, &[4, 32, 64]);
        let z = push(&mut g, Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]);
        let zeros = push(&mut g, Op::Expand(Shape::new([1000, 64])), &[z]);
        let gt = push(&mut g, Op::ScatterAdd { axis: 0 }, &[zeros, ids, gy]);
        g.outputs.push(e);
        g.outputs.push(gt);
        out.push(("embedding_gather_scatter", g));
    }
    // Max and average pooling (3x3, stride 2, padding 1) and their
    // gradients (a LeNet/ResNet-like layer).
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[8, 16, 28, 28]);
        let max = PoolAttrs::new(PoolKind::Max, &[3, 3]).with_strides(&[2, 2]).with_padding(&[1, 1]);
        let avg = PoolAttrs { kind: PoolKind::Avg { count_include_pad: false }, ..max.clone() };
        let ym = push(&mut g, Op::Pool(max.clone()), &[x]);
        let ya = push(&mut g, Op::Pool(avg.clone()), &[x]);
        let gy = f32p(&mut g, &[8, 16, 14, 14]);
        let gm = push(&mut g, Op::PoolGrad(max), &[x, gy]);
        let ga = push(&mut g, Op::PoolGrad(avg), &[x, gy]);
        g.outputs.extend([ym, ya, gm, ga]);
        out.push(("pool_and_grad", g));
    }
    // Independent updates of several shapes: one multi-tensor kernel with
    // a vec4 segment, an odd-sized one, an indexed one (a broadcast row)
    // and an empty one.
    {
        let mut g = Graph::new();
        let lr = g.scalar(DType::F32);
        for dims in [&[64, 64][..], &[7], &[3, 5], &[0]] {
            let p = f32p(&mut g, dims);
            let gr = f32p(&mut g, dims);
            let gr = if dims == [3, 5] {
                let row = f32p(&mut g, &[5]);
                bin(&mut g, BinaryOp::Mul, gr, row)
            } else {
                gr
            };
            let step = bin(&mut g, BinaryOp::Mul, gr, lr);
            let y = bin(&mut g, BinaryOp::Sub, p, step);
            g.outputs.push(y);
        }
        out.push(("multi_tensor", g));
    }
    out.push(("attention_train", attention_graph(AttentionMask::Additive, true)));
    // A grouped, strided, padded convolution with a bias and relu
    // epilogue (a ResNet-like layer).
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[2, 8, 15, 15]);
        let w = f32p(&mut g, &[12, 4, 3, 3]);
        let attrs = ConvAttrs { strides: [2, 2], pads: [1, 1, 1, 1], dilations: [1, 1], groups: 2 };
        let y = push(&mut g, Op::Conv2d(attrs), &[x, w]);
        let bias = f32p(&mut g, &[12, 1, 1]);
        let y = bin(&mut g, BinaryOp::Add, y, bias);
        let y = un(&mut g, UnaryOp::Relu, y);
        g.outputs.push(y);
        out.push(("conv_bias_relu", g));
    }
    // LLM decoding: a Q4_0 matrix-vector product (a byte-stored weight,
    // 10 rows: not a multiple of a workgroup's 4) and the Q6_K
    // dequantization of an embedding row (`codegen::quant`).
    {
        use lazuli_ir::quant::QuantFormat;
        let mut g = Graph::new();
        let x = f32p(&mut g, &[1, 64]);
        let w = g.param(ValueType::new([10, QuantFormat::Q4_0.row_bytes(64).unwrap()], DType::U8));
        let y = push(&mut g, Op::QuantMatMul(QuantFormat::Q4_0), &[x, w]);
        let e = g.param(ValueType::new([1, QuantFormat::Q6K.row_bytes(256).unwrap()], DType::U8));
        let d = push(&mut g, Op::Dequantize(QuantFormat::Q6K), &[e]);
        g.outputs.extend([y, d]);
        out.push(("quant_matvec_dequantize", g));
    }
    // The KV cache: a write at a lifted position, then prefix attention
    // over it with grouped-query heads (`codegen::cache`).
    {
        let mut g = Graph::new();
        let cache = f32p(&mut g, &[1, 2, 16, 8]);
        let k = f32p(&mut g, &[1, 2, 1, 8]);
        let q = f32p(&mut g, &[1, 4, 1, 8]);
        let pos = g.scalar(DType::I32);
        let kc = push(&mut g, Op::WriteAt { axis: 2 }, &[cache, k, pos]);
        let scale = g.scalar(DType::F32);
        let y = push(&mut g, Op::PrefixAttention, &[q, kc, kc, scale, pos]);
        g.outputs.extend([kc, y]);
        out.push(("kv_cache_decode", g));
    }
    out
}

/// A small MLP step in `dtype` (f16 or bf16): a matmul with bias and
/// relu epilogue, a log-softmax over rows, a sum over rows and a cast to
/// f32 and back: each family wgpu runs these dtypes in, through the
/// access layer's half-precision storage (`lazuli_wgpu::codegen::access`).
fn half_graph(dtype: DType) -> Graph {
    let mut g = Graph::new();
    let x = g.param(ValueType::new(vec![64, 32], dtype));
    let w = g.param(ValueType::new(vec![32, 48], dtype));
    let b = g.param(ValueType::new(vec![48], dtype));
    let h = push(&mut g, Op::MatMul, &[x, w]);
    let h = bin(&mut g, BinaryOp::Add, h, b);
    let h = un(&mut g, UnaryOp::Relu, h);
    let l = push(&mut g, Op::Softmax { axis: 1, log: true }, &[h]);
    let s = reduce(&mut g, ReduceOp::Sum, h, &[1], false);
    let f = push(&mut g, Op::Cast(DType::F32), &[s]);
    let c = push(&mut g, Op::Constant(ScalarValue::Float(0.1), DType::F32), &[]);
    let f = bin(&mut g, BinaryOp::Mul, f, c);
    let back = push(&mut g, Op::Cast(dtype), &[f]);
    g.outputs.extend([l, back, f]);
    g
}

/// Graphs whose tensors are bound as several windows: (name, graph, bytes
/// of one window). Each kernel kind's accesses go through the window
/// rewrite: vec4 and scalar elementwise accesses (a multi-tensor kernel),
/// a reduction (two passes on GPUs), a checked gather with an error slot,
/// matmul operands.
fn windowed_graphs() -> Vec<(&'static str, Graph, u64)> {
    let mut out = Vec::new();
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[64, 48]);
        let r = f32p(&mut g, &[64]);
        let t = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
        let y = bin(&mut g, BinaryOp::Add, t, r);
        let y = un(&mut g, UnaryOp::Exp, y);
        g.outputs.push(y);
        let s = un(&mut g, UnaryOp::Tanh, x);
        g.outputs.push(s);
        out.push(("elementwise", g, 2048));
    }
    {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[(1 << 20) - 5]);
        let y = reduce(&mut g, ReduceOp::Sum, x, &[0], false);
        g.outputs.push(y);
        out.push(("reduce_full", g, 1 << 20));
    }
    {
        let mut g = Graph::new();
        let table = f32p(&mut g, &[100, 16]);
        let ids = g.param(ValueType::new([4, 8], DType::I32));
        let e = push(&mut g, Op::Gather { axis: 0 }, &[table, ids]);
        g.outputs.push(e);
        out.push(("gather", g, 2048));
    }
    {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[37, 29]);
        let b = f32p(&mut g, &[29, 53]);
        let m = push(&mut g, Op::MatMul, &[a, b]);
        g.outputs.push(m);
        out.push(("matmul", g, 2048));
    }
    {
        // Split over K on GPUs: operands windowed in the first pass, the
        // epilogue's input in the second.
        let mut g = Graph::new();
        let x = f32p(&mut g, &[1024, 64]);
        let dy = f32p(&mut g, &[1024, 64]);
        let prev = f32p(&mut g, &[64, 64]);
        let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
        let gw = push(&mut g, Op::MatMul, &[xt, dy]);
        let gw = bin(&mut g, BinaryOp::Add, gw, prev);
        g.outputs.push(gw);
        out.push(("matmul_split_k", g, 65536));
    }
    out
}

/// Size families: (name, the graph at an earlier size, at a later one).
/// The later graph's kernels are lowered in generic mode after the
/// earlier's are observed, so every literal that differs is read from the
/// sizes buffer.
fn generic_graphs() -> Vec<(&'static str, Graph, Graph)> {
    let softmax = |rows: usize, cols: usize| {
        let mut g = Graph::new();
        let x = f32p(&mut g, &[rows, cols]);
        let s = g.scalar(DType::F32);
        let xs = bin(&mut g, BinaryOp::Mul, x, s);
        let y = push(&mut g, Op::Softmax { axis: 1, log: true }, &[xs]);
        g.outputs.push(y);
        g
    };
    let linear = |batch: usize| {
        let mut g = Graph::new();
        let a = f32p(&mut g, &[batch, 64]);
        let w = f32p(&mut g, &[64, 96]);
        let bias = f32p(&mut g, &[96]);
        let m = push(&mut g, Op::MatMul, &[a, w]);
        let y = bin(&mut g, BinaryOp::Add, m, bias);
        let y = un(&mut g, UnaryOp::Relu, y);
        let r = reduce(&mut g, ReduceOp::Sum, y, &[0], false);
        g.outputs.push(y);
        g.outputs.push(r);
        g
    };
    vec![("log_softmax", softmax(33, 10), softmax(40, 10)), ("linear", linear(24), linear(29))]
}

/// Fused attention's training graph (as autograd records it): the output
/// and, over the same operands, the log-sum-exp, delta and the three
/// gradients; q read through a transpose, a mask of `mask`'s kind.
fn attention_graph(mask: AttentionMask, causal: bool) -> Graph {
    attention_graph_dims(mask, causal, 24, 20)
}

/// [`attention_graph`] with head dim `d` and value dim `dv`.
fn attention_graph_dims(mask: AttentionMask, causal: bool, d: usize, dv: usize) -> Graph {
    let mut g = Graph::new();
    let qp = f32p(&mut g, &[2, d, 40]);
    let q = push(&mut g, Op::Permute(vec![0, 2, 1]), &[qp]);
    let k = f32p(&mut g, &[2, 56, d]);
    let v = f32p(&mut g, &[2, 56, dv]);
    let s = g.scalar(DType::F32);
    let mut fwd = vec![q, k, v, s];
    match mask {
        AttentionMask::None => {}
        AttentionMask::Additive => fwd.push(f32p(&mut g, &[40, 56])),
        AttentionMask::Keep => fwd.push(g.param(ValueType::new([2, 1, 56], DType::Bool))),
    }
    let attrs = AttentionAttrs { causal, mask };
    let o = push(&mut g, Op::Attention { attrs, part: AttentionPart::Out }, &fwd);
    let lse = push(&mut g, Op::Attention { attrs, part: AttentionPart::LogSumExp }, &fwd);
    let go = f32p(&mut g, &[2, 40, dv]);
    let prod = bin(&mut g, BinaryOp::Mul, go, o);
    let delta = reduce(&mut g, ReduceOp::Sum, prod, &[2], false);
    let mut ins = fwd.clone();
    ins.extend([go, lse, delta]);
    g.outputs.push(o);
    for part in [AttentionPart::GradQ, AttentionPart::GradK, AttentionPart::GradV] {
        let x = push(&mut g, Op::Attention { attrs, part }, &ins);
        g.outputs.push(x);
    }
    g
}

/// Every attention tile and form lowers to valid WGSL for every mask kind,
/// causal or not, and in generic mode: the tiles an adapter with more
/// workgroup memory than the golden profiles' 16 KiB would pick included,
/// and every plan of the flash forward (each tile, with the value tile
/// apart and in the key tile's memory) at head dims that pick them on
/// adapters with 32 KiB (lavapipe) and 48 KiB (NVIDIA).
#[test]
fn attention_lowers_for_every_tile_and_form() {
    use lazuli_wgpu::codegen::attention::{flash_plan_for, FLASH_TILES, TILES};
    for (d, dv) in [(24, 20), (64, 64), (128, 128), (3, 5)] {
        for mask in [AttentionMask::None, AttentionMask::Additive, AttentionMask::Keep] {
            for causal in [false, true] {
                let v = attention_graph_dims(mask, causal, d, dv).verify().unwrap();
                let fl = FusionLimits { max_storage_buffers: 16, ..FusionLimits::default() };
                let plan = fusion::plan(&v, &fl);
                // No tile fits 0 bytes of workgroup memory: both profiles
                // fall back to the per-row form.
                let mut limits = vec![
                    LowerLimits::software(),
                    LowerLimits { generic: true, ..LowerLimits::software() },
                    LowerLimits { workgroup_storage: 0, ..LowerLimits::gpu() },
                    LowerLimits { workgroup_storage: 32768, ..LowerLimits::gpu() },
                    LowerLimits { workgroup_storage: 49152, ..LowerLimits::gpu() },
                ];
                let mut storages: Vec<u64> = TILES.iter().map(|t| t.workgroup_bytes()).collect();
                for t in FLASH_TILES {
                    for v_in_k in [false, true] {
                        storages.push(t.workgroup_bytes(d as u64, dv as u64, true, v_in_k));
                    }
                }
                for storage in storages {
                    let storage = storage as u32;
                    limits.push(LowerLimits { workgroup_storage: storage, ..LowerLimits::gpu() });
                    limits.push(LowerLimits { workgroup_storage: storage, generic: true, ..LowerLimits::gpu() });
                }
                for l in &limits {
                    for k in &plan.kernels {
                        let w = lower(k, &v, l).unwrap();
                        lazuli_wgpu::validate_wgsl(&w.source)
                            .unwrap_or_else(|e| panic!("{mask:?} causal {causal} {l:?}: {e}\n{}", w.source));
                        if k.kind == fusion::KernelKind::Attention {
                            let parts: Vec<AttentionPart> = k
                                .outputs
                                .iter()
                                .map(|&o| match v.node(o).op {
                                    Op::Attention { part, .. } => part,
                                    _ => unreachable!("attention kernels output attention parts"),
                                })
                                .collect();
                            let forward =
                                parts.iter().any(|p| matches!(p, AttentionPart::Out | AttentionPart::LogSumExp));
                            let tiled_form = l.forms.attention == lazuli_wgpu::codegen::AttentionForm::Tiled;
                            let out = parts.contains(&AttentionPart::Out);
                            let flash = tiled_form
                                && forward
                                && flash_plan_for(d as u64, dv as u64, out, l.workgroup_storage as u64).is_some();
                            // The per-row form's rows too wide for registers take the tiled form.
                            let wide = !lazuli_wgpu::codegen::attention::per_row_in_registers(d as u64, dv as u64);
                            let tiled = !flash
                                && (tiled_form || wide)
                                && l.workgroup_storage as u64 >= TILES[2].workgroup_bytes();
                            assert_eq!(w.source.contains("var<workgroup> fm"), flash, "flash form under {l:?}");
                            assert_eq!(w.source.contains("var<workgroup> sp"), tiled, "tiled form under {l:?}");
                        }
                    }
                }
            }
        }
    }
}

fn profiles() -> Vec<(&'static str, LowerLimits)> {
    vec![("software", LowerLimits::software()), ("gpu", LowerLimits::gpu())]
}

/// The fusion limits the snapshots plan under (those of the runtime).
fn fusion_limits(limits: &LowerLimits) -> FusionLimits {
    FusionLimits {
        matmul_epilogue: true,
        inline_outputs: true,
        row_kernels: limits.forms.reduce == lazuli_wgpu::codegen::ReduceForm::Cooperative,
        multi_tensor: true,
        ..FusionLimits::default()
    }
}

/// The plan and every kernel's WGSL of `g` under `limits`, as one text.
fn render(g: Graph, limits: &LowerLimits) -> String {
    render_with(g, limits, &fusion_limits(limits), |_, _, _| {})
}

/// The plan and every kernel's WGSL of `g` under `limits` and `fl`, each
/// kernel passed through `post` (with its index) after lowering.
fn render_with(
    g: Graph,
    limits: &LowerLimits,
    fl: &FusionLimits,
    mut post: impl FnMut(usize, &fusion::Kernel, &mut Wgsl),
) -> String {
    let v = g.verify().expect("valid graph");
    let plan = fusion::plan(&v, fl);
    let mut s = format!("// plan\n{}", plan.to_text().lines().map(|l| format!("// {l}\n")).collect::<String>());
    for (i, k) in plan.kernels.iter().enumerate() {
        let mut w = lower(k, &v, limits).unwrap_or_else(|e| panic!("kernel {i}: {e}"));
        post(i, k, &mut w);
        if let Some(p) = &w.pre {
            lazuli_wgpu::validate_wgsl(&p.source).unwrap_or_else(|e| panic!("kernel {i} pass 1: {e}\n{}", p.source));
            s.push_str(&format!(
                "\n// kernel {i} pass 1: {} invocations, workgroup {}, {} scratch elements\n{}",
                p.invocations, p.workgroup_size, p.scratch, p.source
            ));
        }
        lazuli_wgpu::validate_wgsl(&w.source).unwrap_or_else(|e| panic!("kernel {i}: {e}\n{}", w.source));
        s.push_str(&format!(
            "\n// kernel {i}: {:?}, {} invocations, workgroup {}\n{}",
            k.kind, w.invocations, w.workgroup_size, w.source
        ));
    }
    s
}

/// The windowed form of `g`: planned with windows of `window_bytes`
/// counted and lowered with those windows, as the runtime does, with each
/// kernel's window counts in a header.
fn render_windowed(g: Graph, window_bytes: u64, limits: &LowerLimits) -> String {
    let windows = Windows::new(128 << 20, 16, Some(window_bytes));
    let limits = LowerLimits { windows, ..*limits };
    let fl = FusionLimits { max_storage_buffers: 30, window_elements: windows.elements(), ..fusion_limits(&limits) };
    let v = g.clone().verify().expect("valid graph");
    let mut counts = Vec::new();
    let mut windowed = false;
    let text = render_with(g, &limits, &fl, |i, k, w| {
        let kw = w.windows(k, &v, &windows);
        assert!(kw.bindings() <= fl.max_storage_buffers, "kernel {i}: {kw:?}");
        windowed |= kw.is_windowed();
        counts.push(format!("// kernel {i} windows: main {:?}, first pass {:?}\n", kw.main, kw.pre));
    });
    assert!(windowed, "nothing windowed:\n{text}");
    format!("{}{text}", counts.concat())
}

/// The generic form of a family: `earlier`'s kernels observed, then
/// `later`'s specialized, each source (and first pass) with its sizes.
fn render_generic(earlier: Graph, later: Graph, limits: &LowerLimits) -> String {
    let limits = LowerLimits { generic: true, ..*limits };
    render_generic_with(earlier, later, &limits)
}

/// [`render_generic`] under `limits` as given (generic, with the sizes
/// it keeps fixed).
fn render_generic_with(earlier: Graph, later: Graph, limits: &LowerLimits) -> String {
    let limits = *limits;
    let fl = fusion_limits(&limits);
    let families = Families::new(true, 64);
    let e = earlier.verify().expect("valid graph");
    for k in &fusion::plan(&e, &fl).kernels {
        let w = lower(k, &e, &limits).unwrap();
        for pass in std::iter::once(&w).chain(w.pre.as_deref()) {
            families.observe(&pass.source, pass.entry);
        }
    }
    let mut dims = Vec::new();
    let text = render_with(later, &limits, &fl, |i, _, w| {
        if let Some(p) = w.pre.as_deref_mut() {
            let s = families.specialize(&p.source, p.entry, None);
            dims.push(format!("// kernel {i} pass 1: {:?}, sizes {:?}\n", s.outcome, s.dims));
            p.source = s.source;
        }
        let s = families.specialize(&w.source, w.entry, None);
        dims.push(format!("// kernel {i}: {:?}, sizes {:?}\n", s.outcome, s.dims));
        w.source = s.source;
    });
    assert!(dims.iter().any(|d| d.contains("Widened")), "nothing generic:\n{text}");
    format!("{}{text}", dims.concat())
}

/// Every snapshot: (file stem, text).
fn snapshots() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (pname, limits) in profiles() {
        for (gname, g) in graphs() {
            out.push((format!("{gname}.{pname}"), render(g, &limits)));
        }
        for (gname, g, window_bytes) in windowed_graphs() {
            out.push((format!("windowed_{gname}.{pname}"), render_windowed(g, window_bytes, &limits)));
        }
        for (gname, earlier, later) in generic_graphs() {
            out.push((format!("generic_{gname}.{pname}"), render_generic(earlier, later, &limits)));
        }
        // The linear layer's batch varies, its width and depth stay: the
        // compiler keeps those fixed (`generic::SizeChanges`), so the
        // product keeps its vector loads, stores and unrolled depth.
        let (_, earlier, later) = generic_graphs().pop().expect("the linear family");
        let fixed = FixedSizes { m: false, n: true, k: true, row: true };
        let kept = LowerLimits { generic: true, fixed, ..limits };
        out.push((format!("generic_linear_fixed_width.{pname}"), render_generic_with(earlier, later, &kept)));
        let native = LowerLimits { f16: lazuli_wgpu::codegen::HalfStorage::Native, ..limits };
        out.push((format!("half_mlp_f16_native.{pname}"), render(half_graph(DType::F16), &native)));
        out.push((format!("half_mlp_f16_packed.{pname}"), render(half_graph(DType::F16), &limits)));
        out.push((format!("half_mlp_bf16.{pname}"), render(half_graph(DType::BF16), &limits)));
    }
    // The f16 MLP on a device with cooperative matrices (an NVIDIA GPU's
    // limits): its product takes the tensor-core form (`codegen::coop`).
    let coop = LowerLimits {
        cooperative_matrix: true,
        workgroup_storage: 49152,
        f16: lazuli_wgpu::codegen::HalfStorage::Native,
        ..LowerLimits::gpu()
    };
    out.push(("half_mlp_f16_native.gpu_cooperative_matrix".to_string(), render(half_graph(DType::F16), &coop)));
    // The row kernels again on a device with subgroups (the lanes of a
    // row combine by subgroup shuffles, see `codegen::rows`).
    let subgroups = LowerLimits { subgroups: true, ..LowerLimits::gpu() };
    for (gname, g) in graphs() {
        if ROW_GRAPHS.contains(&gname) {
            out.push((format!("{gname}.gpu_subgroups"), render(g, &subgroups)));
        }
    }
    out
}

/// The graphs whose GPU kernels are row kernels, snapshotted with
/// subgroups too.
const ROW_GRAPHS: &[&str] = &[
    "softmax_rows",
    "softmax_middle_axis",
    "log_softmax_prologue",
    "layer_norm",
    "reduce_rows_short",
    "reduce_rows_long",
];

#[test]
fn generated_wgsl_matches_golden_files() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let bless = std::env::var("LAZULI_BLESS").is_ok_and(|v| v == "1");
    let mut mismatches = Vec::new();
    for (stem, text) in snapshots() {
        let path = dir.join(format!("{stem}.wgsl"));
        if bless {
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        if want != text {
            let line = want.lines().zip(text.lines()).position(|(a, b)| a != b).unwrap_or(0) + 1;
            mismatches.push(format!("{} (first difference at line {line})", path.display()));
        }
    }
    assert!(
        mismatches.is_empty(),
        "generated WGSL differs from the golden files (rerun with LAZULI_BLESS=1 and review the diff):\n{}",
        mismatches.join("\n")
    );
}
