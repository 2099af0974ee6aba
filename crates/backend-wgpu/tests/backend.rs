//! End-to-end tests of the wgpu backend on whatever adapter is present
//! (lavapipe in CI). Without an adapter they print a message and pass,
//! unless `LAZULI_REQUIRE_ADAPTER=1`.

use lazuli_executor::{metrics, Backend};
use lazuli_ir::{
    ArgReduceOp, BinaryOp, DType, Graph, NodeId, Op, PadMode, RandomDist, ReduceOp, ScalarValue, UnaryOp, ValueType,
};
use lazuli_wgpu::codegen::{KernelForms, MatmulForm, MatmulTile};
use lazuli_wgpu::{validate_wgsl, WgpuBackend, WgpuOptions};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Tests share global metrics and a slow software device: run one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn backend_with(opts: WgpuOptions) -> Option<WgpuBackend> {
    match WgpuBackend::new(opts) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("LAZULI_REQUIRE_ADAPTER").as_deref() == Ok("1") {
                panic!("no wgpu adapter but LAZULI_REQUIRE_ADAPTER=1: {e}");
            }
            eprintln!("skipping: no wgpu adapter ({e})");
            None
        }
    }
}

/// A backend whose kernel forms are the software profile changed by `f`.
fn backend_forms(f: impl FnOnce(&mut KernelForms)) -> Option<WgpuBackend> {
    let mut forms = KernelForms::software();
    f(&mut forms);
    backend_with(WgpuOptions { kernel_forms: Some(forms), ..Default::default() })
}

/// Every matmul form, forced in turn; split-K forced with part counts
/// that divide some K and not others (recounted in k-slices of 8; a
/// short K keeps one pass).
fn matmul_forms() -> Vec<MatmulForm> {
    let t = |bm, bn| MatmulForm::Tiled(MatmulTile { bm, bn });
    let split = |bm, bn, parts| MatmulForm::SplitK { tile: MatmulTile { bm, bn }, parts };
    vec![
        MatmulForm::RegisterBlocked,
        t(64, 64),
        t(128, 128),
        t(128, 64),
        t(64, 128),
        split(64, 64, 2),
        split(128, 64, 5),
        MatmulForm::ByShape,
    ]
}

fn backend() -> Option<WgpuBackend> {
    static B: OnceLock<Option<WgpuBackend>> = OnceLock::new();
    B.get_or_init(|| backend_with(WgpuOptions::default())).clone()
}

enum Data {
    F(Vec<f32>),
    I(Vec<i32>),
    /// Bytes (a quantized weight).
    B(Vec<u8>),
}

fn bytes(d: &Data) -> Vec<u8> {
    match d {
        Data::F(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::I(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::B(v) => v.clone(),
    }
}

/// Compiles and runs `g` with `inputs` (one per param) and `scalars`,
/// validating every generated source; returns raw output bytes.
fn run_on(b: &WgpuBackend, g: Graph, inputs: &[Data], scalars: &[ScalarValue]) -> Vec<Vec<u8>> {
    let params = g.params.clone();
    let v = g.verify().expect("valid graph");
    let exe = b.compile(&v).expect("compile");
    for (name, src) in exe.kernel_sources() {
        validate_wgsl(&src).unwrap_or_else(|e| panic!("{name}: {e}\n{src}"));
    }
    let bufs = inputs.iter().zip(&params).map(|(d, ty)| b.upload(&bytes(d), ty).expect("upload")).collect();
    let outs = b.execute(exe.as_ref(), bufs, scalars).expect("execute");
    outs.iter().map(|o| b.download(o).expect("download")).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "got {got:?} want {want:?}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || (a - b).abs() <= tol * (1.0 + b.abs());
        assert!(ok, "element {i}: got {a}, want {b}\n got {got:?}\nwant {want:?}");
    }
}

fn push(g: &mut Graph, op: Op, ins: &[NodeId]) -> NodeId {
    g.push(op, ins).unwrap()
}

fn bin(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
    push(g, Op::Binary(op), &[a, b])
}

fn seq(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

#[test]
fn w1_is_one_kernel_and_correct() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([4, 5], DType::F32));
    let s: Vec<NodeId> = (0..4).map(|_| g.scalar(DType::F32)).collect();
    let t = bin(&mut g, BinaryOp::Mul, x, s[0]);
    let t = bin(&mut g, BinaryOp::Add, t, s[1]);
    let t = push(&mut g, Op::Unary(UnaryOp::Relu), &[t]);
    let t = bin(&mut g, BinaryOp::Sub, t, s[2]);
    let t = push(&mut g, Op::Unary(UnaryOp::Tanh), &[t]);
    let y = bin(&mut g, BinaryOp::Mul, t, s[3]);
    g.outputs.push(y);
    let xs: Vec<f32> = (0..20).map(|i| i as f32 / 10.0 - 1.0).collect();
    let sc = [1.5, 0.5, 0.25, 2.0].map(ScalarValue::Float);
    let before = metrics::counter("KernelLaunches");
    let out = run_on(&b, g, &[Data::F(xs.clone())], &sc);
    assert_eq!(metrics::counter("KernelLaunches") - before, 1);
    let want: Vec<f32> = xs.iter().map(|x| ((x * 1.5 + 0.5f32).max(0.0) - 0.25).tanh() * 2.0).collect();
    close(&f32s(&out[0]), &want, 1e-5);
}

#[test]
fn twelve_inputs_with_eight_buffers() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { max_storage_buffers: Some(8), ..Default::default() }) else { return };
    let mut g = Graph::new();
    let xs: Vec<NodeId> = (0..12).map(|_| g.param(ValueType::new([3, 4], DType::F32))).collect();
    let mut acc = xs[0];
    for &x in &xs[1..] {
        acc = bin(&mut g, BinaryOp::Add, acc, x);
    }
    g.outputs.push(acc);
    let v = g.clone().verify().unwrap();
    let exe = b.compile(&v).unwrap();
    assert!(exe.kernel_count() >= 2);
    let data: Vec<Data> = (0..12).map(|k| Data::F((0..12).map(|i| (i * 100 + k) as f32).collect())).collect();
    let out = run_on(&b, g, &data, &[]);
    let want: Vec<f32> = (0..12).map(|i| (0..12).map(|k| (i * 100 + k) as f32).sum()).collect();
    close(&f32s(&out[0]), &want, 0.0);
}

#[test]
fn wide_concat_with_eight_buffers() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { max_storage_buffers: Some(8), ..Default::default() }) else { return };
    let mut g = Graph::new();
    let xs: Vec<NodeId> = (0..10).map(|_| g.param(ValueType::new([2, 1], DType::F32))).collect();
    let c = push(&mut g, Op::Concat { axis: 1 }, &xs);
    let n = push(&mut g, Op::Unary(UnaryOp::Neg), &[c]);
    g.outputs.push(n);
    let data: Vec<Data> = (0..10).map(|k| Data::F(vec![k as f32, 10.0 + k as f32])).collect();
    let out = run_on(&b, g, &data, &[]);
    let want: Vec<f32> = (0..2).flat_map(|r| (0..10).map(move |k| -((r * 10 + k) as f32))).collect();
    close(&f32s(&out[0]), &want, 0.0);
}

#[test]
fn scalar_change_reuses_pipeline() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let build = || {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([7], DType::F32));
        let s = g.scalar(DType::F32);
        let y = bin(&mut g, BinaryOp::Mul, x, s);
        let y = push(&mut g, Op::Unary(UnaryOp::Sin), &[y]);
        g.outputs.push(y);
        g
    };
    let xs = seq(7);
    let out = run_on(&b, build(), &[Data::F(xs.clone())], &[ScalarValue::Float(0.37)]);
    close(&f32s(&out[0]), &xs.iter().map(|x| (x * 0.37).sin()).collect::<Vec<_>>(), 1e-5);
    let before = metrics::counter("PipelinesCreated");
    let out = run_on(&b, build(), &[Data::F(xs.clone())], &[ScalarValue::Float(0.91)]);
    assert_eq!(metrics::counter("PipelinesCreated"), before);
    close(&f32s(&out[0]), &xs.iter().map(|x| (x * 0.91).sin()).collect::<Vec<_>>(), 1e-5);
}

#[test]
fn large_elementwise_and_pool_reuse() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let n = 1 << 20;
    let build = || {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([n], DType::F32));
        let one = push(&mut g, Op::Constant(ScalarValue::Float(1.0), DType::F32), &[]);
        let y = bin(&mut g, BinaryOp::Add, x, one);
        let y = bin(&mut g, BinaryOp::Mul, y, y);
        g.outputs.push(y);
        g
    };
    let xs = seq(n).iter().map(|v| v / n as f32).collect::<Vec<_>>();
    let out = f32s(&run_on(&b, build(), &[Data::F(xs.clone())], &[])[0]);
    for i in [0, 1, 12345, n / 2, n - 1] {
        let w = (xs[i] + 1.0) * (xs[i] + 1.0);
        assert!((out[i] - w).abs() < 1e-5, "{i}: {} vs {w}", out[i]);
    }
    let allocs = metrics::counter("WgpuBufferAllocations");
    let _ = run_on(&b, build(), &[Data::F(xs)], &[]);
    assert_eq!(metrics::counter("WgpuBufferAllocations"), allocs, "a repeated run must reuse pooled buffers");
}

#[test]
fn zero_size_launches_nothing() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([0, 3], DType::F32));
    let y = push(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let s = push(&mut g, Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[y]);
    g.outputs.push(y);
    g.outputs.push(s);
    let before = metrics::counter("KernelLaunches");
    let out = run_on(&b, g, &[Data::F(vec![])], &[]);
    assert!(out[0].is_empty());
    assert_eq!(f32s(&out[1]), vec![0.0; 3]);
    assert_eq!(metrics::counter("KernelLaunches") - before, 1, "only the reduce (3 outputs) launches");
}

#[test]
fn broadcasting_both_ways() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let a = g.param(ValueType::new([3, 1], DType::F32));
    let c = g.param(ValueType::new([1, 4], DType::F32));
    let d = g.param(ValueType::new([4], DType::F32));
    let s = bin(&mut g, BinaryOp::Sub, a, c);
    let t = bin(&mut g, BinaryOp::Mul, d, s);
    g.outputs.push(t);
    let out = run_on(
        &b,
        g,
        &[Data::F(vec![1.0, 2.0, 3.0]), Data::F(vec![10.0, 20.0, 30.0, 40.0]), Data::F(vec![1.0, -1.0, 2.0, 0.5])],
        &[],
    );
    let mut want = vec![];
    for i in 0..3 {
        for j in 0..4 {
            want.push([1.0, -1.0, 2.0, 0.5][j] * ((i + 1) as f32 - 10.0 * (j + 1) as f32));
        }
    }
    close(&f32s(&out[0]), &want, 0.0);
}

#[test]
fn reductions_over_axes() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([2, 3, 4], DType::F32));
    let r = |g: &mut Graph, op, axes: Vec<usize>, keepdim| push(g, Op::Reduce { op, axes, keepdim }, &[x]);
    let s1 = r(&mut g, ReduceOp::Sum, vec![1], false);
    let s02 = r(&mut g, ReduceOp::Sum, vec![0, 2], true);
    let mx = r(&mut g, ReduceOp::Max, vec![2], false);
    let mean = r(&mut g, ReduceOp::Mean, vec![0, 1, 2], false);
    let mn = r(&mut g, ReduceOp::Min, vec![0], false);
    let am = push(&mut g, Op::ArgReduce { op: ArgReduceOp::ArgMax, axis: 1, keepdim: false, select_last: false }, &[x]);
    g.outputs.extend([s1, s02, mx, mean, mn, am]);
    // Values with a non-monotone pattern so argmax is not trivial.
    let xs: Vec<f32> = (0..24).map(|i| ((i * 7) % 11) as f32).collect();
    let at = |i: usize, j: usize, k: usize| xs[i * 12 + j * 4 + k];
    let out = run_on(&b, g, &[Data::F(xs.clone())], &[]);
    let want_s1: Vec<f32> = (0..2).flat_map(|i| (0..4).map(move |k| (0..3).map(|j| at(i, j, k)).sum())).collect();
    close(&f32s(&out[0]), &want_s1, 0.0);
    let want_s02: Vec<f32> = (0..3).map(|j| (0..2).flat_map(|i| (0..4).map(move |k| at(i, j, k))).sum()).collect();
    close(&f32s(&out[1]), &want_s02, 0.0);
    let want_mx: Vec<f32> =
        (0..2).flat_map(|i| (0..3).map(move |j| (0..4).map(|k| at(i, j, k)).fold(f32::MIN, f32::max))).collect();
    close(&f32s(&out[2]), &want_mx, 0.0);
    close(&f32s(&out[3]), &[xs.iter().sum::<f32>() / 24.0], 1e-6);
    let want_mn: Vec<f32> = (0..12).map(|jk| xs[jk].min(xs[12 + jk])).collect();
    close(&f32s(&out[4]), &want_mn, 0.0);
    let want_am: Vec<i32> = (0..2)
        .flat_map(|i| {
            (0..4).map(move |k| {
                let mut best = 0;
                for j in 1..3 {
                    if at(i, j, k) > at(i, best, k) {
                        best = j;
                    }
                }
                best as i32
            })
        })
        .collect();
    assert_eq!(i32s(&out[5]), want_am);
}

#[test]
fn reduce_fuses_prologue_and_propagates_nan() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([2, 3], DType::F32));
    let e = push(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let t = push(&mut g, Op::Permute(vec![1, 0]), &[e]);
    let s = push(&mut g, Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[t]);
    let m = push(&mut g, Op::Reduce { op: ReduceOp::Max, axes: vec![1], keepdim: false }, &[x]);
    g.outputs.extend([s, m]);
    let xs = vec![0.0, 1.0, 2.0, f32::NAN, -1.0, 0.5];
    let out = run_on(&b, g, &[Data::F(xs.clone())], &[]);
    close(&f32s(&out[0]), &[1.0 + 1f32.exp() + 2f32.exp(), f32::NAN], 1e-5);
    close(&f32s(&out[1]), &[2.0, f32::NAN], 0.0);
}

#[test]
fn matmul_batched_broadcast_and_transposed() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let a = g.param(ValueType::new([2, 1, 2, 3], DType::F32));
    let bt = g.param(ValueType::new([3, 4, 3], DType::F32)); // [batch 3, n=4, k=3]
    let bv = push(&mut g, Op::Permute(vec![0, 2, 1]), &[bt]);
    let m = push(&mut g, Op::MatMul, &[a, bv]);
    g.outputs.push(m);
    let av: Vec<f32> = (0..12).map(|i| i as f32 - 5.0).collect();
    let bvv: Vec<f32> = (0..36).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
    let v = g.clone().verify().unwrap();
    assert_eq!(b.compile(&v).unwrap().kernel_count(), 1);
    let out = f32s(&run_on(&b, g, &[Data::F(av.clone()), Data::F(bvv.clone())], &[])[0]);
    let mut want = vec![];
    for p in 0..2 {
        for q in 0..3 {
            for i in 0..2 {
                for j in 0..4 {
                    let mut acc = 0.0;
                    for k in 0..3 {
                        acc += av[p * 6 + i * 3 + k] * bvv[q * 12 + j * 3 + k];
                    }
                    want.push(acc);
                }
            }
        }
    }
    close(&out, &want, 0.0);
}

#[test]
fn views_permute_slice_expand_concat_pad() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([2, 3], DType::F32));
    let p = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
    let sl = push(&mut g, Op::Slice { starts: vec![1, 2], steps: vec![1, -1], lens: vec![1, 3] }, &[x]);
    let col = push(&mut g, Op::Slice { starts: vec![0, 0], steps: vec![1, 2], lens: vec![2, 2] }, &[x]);
    let r = push(&mut g, Op::Reshape(vec![2, 1, 3].into()), &[x]);
    let e = push(&mut g, Op::Expand(vec![2, 2, 3].into()), &[r]);
    let c = push(&mut g, Op::Concat { axis: 1 }, &[x, col]);
    let nine = g.scalar(DType::F32);
    let pc = push(&mut g, Op::Pad { before: vec![1, 0], after: vec![0, 2], mode: PadMode::Constant }, &[x, nine]);
    let pr = push(&mut g, Op::Pad { before: vec![0, 2], after: vec![1, 1], mode: PadMode::Reflect }, &[x]);
    let pe = push(&mut g, Op::Pad { before: vec![1, 1], after: vec![0, 0], mode: PadMode::Edge }, &[x]);
    g.outputs.extend([p, sl, e, c, pc, pr, pe]);
    let out = run_on(&b, g, &[Data::F(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0])], &[ScalarValue::Float(9.0)]);
    let o: Vec<Vec<f32>> = out.iter().map(|v| f32s(v)).collect();
    assert_eq!(o[0], vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(o[1], vec![5.0, 4.0, 3.0]);
    assert_eq!(o[2], vec![0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 3.0, 4.0, 5.0]);
    assert_eq!(o[3], vec![0.0, 1.0, 2.0, 0.0, 2.0, 3.0, 4.0, 5.0, 3.0, 5.0]);
    assert_eq!(o[4], vec![9.0, 9.0, 9.0, 9.0, 9.0, 0.0, 1.0, 2.0, 9.0, 9.0, 3.0, 4.0, 5.0, 9.0, 9.0]);
    // Reflect: rows [r0, r1, r0], cols [2,1,0,1,2,1].
    let refl = |r: [f32; 3]| vec![r[2], r[1], r[0], r[1], r[2], r[1]];
    let mut want = refl([0.0, 1.0, 2.0]);
    want.extend(refl([3.0, 4.0, 5.0]));
    want.extend(refl([0.0, 1.0, 2.0]));
    assert_eq!(o[5], want);
    assert_eq!(o[6], vec![0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 1.0, 2.0, 3.0, 3.0, 4.0, 5.0]);
}

#[test]
fn softmax_cumsum_gather() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([2, 3], DType::F32));
    let idx = g.param(ValueType::new([2], DType::I32));
    let sm = push(&mut g, Op::Softmax { axis: 1, log: false }, &[x]);
    let lsm = push(&mut g, Op::Softmax { axis: 0, log: true }, &[x]);
    let cs = push(&mut g, Op::CumSum { axis: 1, exclusive: false, reverse: false }, &[x]);
    let csr = push(&mut g, Op::CumSum { axis: 1, exclusive: true, reverse: true }, &[x]);
    let ga = push(&mut g, Op::Gather { axis: 1 }, &[x, idx]);
    g.outputs.extend([sm, lsm, cs, csr, ga]);
    let xs = vec![1.0, 2.0, 3.0, -1.0, 0.0, 4.0];
    let out = run_on(&b, g, &[Data::F(xs.clone()), Data::I(vec![-1, 0])], &[]);
    let mut want = vec![];
    for r in 0..2 {
        let row = &xs[r * 3..r * 3 + 3];
        let m = row.iter().cloned().fold(f32::MIN, f32::max);
        let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
        want.extend(row.iter().map(|v| (v - m).exp() / s));
    }
    close(&f32s(&out[0]), &want, 1e-6);
    let mut want = vec![0.0; 6];
    for c in 0..3 {
        let (a, d) = (xs[c], xs[3 + c]);
        let m = a.max(d);
        let l = ((a - m).exp() + (d - m).exp()).ln();
        want[c] = a - m - l;
        want[3 + c] = d - m - l;
    }
    close(&f32s(&out[1]), &want, 1e-6);
    close(&f32s(&out[2]), &[1.0, 3.0, 6.0, -1.0, -1.0, 3.0], 0.0);
    close(&f32s(&out[3]), &[5.0, 3.0, 0.0, 4.0, 4.0, 0.0], 0.0);
    close(&f32s(&out[4]), &[3.0, 1.0, 4.0, -1.0], 0.0);
}

/// Two checking kernels in one execution: the error slot of each is its
/// own, the first kernel's report wins, and running the same executable
/// again with good indices succeeds (the slots are zeroed per execution).
#[test]
fn index_errors_are_reported_per_execution() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([3, 4], DType::F32));
    let i0 = g.param(ValueType::new([2], DType::I32));
    let i1 = g.param(ValueType::new([2], DType::I32));
    let g0 = push(&mut g, Op::Gather { axis: 1 }, &[x, i0]);
    let s1 = push(&mut g, Op::ScatterAdd { axis: 1 }, &[x, i1, g0]);
    g.outputs.extend([g0, s1]);
    let params = g.params.clone();
    let exe = b.compile(&g.verify().unwrap()).unwrap();
    let run = |ix0: &[i32], ix1: &[i32]| {
        let data = [Data::F((0..12).map(|v| v as f32).collect()), Data::I(ix0.to_vec()), Data::I(ix1.to_vec())];
        let bufs = data.iter().zip(&params).map(|(d, ty)| b.upload(&bytes(d), ty).unwrap()).collect();
        b.execute(exe.as_ref(), bufs, &[])
    };
    let err = |r: Result<Vec<lazuli_executor::Buffer>, lazuli_executor::BackendError>| match r {
        Err(lazuli_executor::BackendError::IndexOutOfRange(e)) => {
            (e.op, e.index, e.axis, e.size, e.shape.dims().to_vec())
        }
        other => panic!("expected an index error, got {:?}", other.map(|v| v.len())),
    };
    assert_eq!(err(run(&[0, -7], &[9, 0])), ("gather".into(), -7, 1, 4, vec![3, 4]));
    assert_eq!(err(run(&[0, 1], &[1, 4])), ("scatter_add".into(), 4, 1, 4, vec![3, 4]));
    let outs = run(&[3, -4], &[-1, 1]).expect("good indices");
    let got: Vec<Vec<f32>> = outs.iter().map(|o| f32s(&b.download(o).unwrap())).collect();
    assert_eq!(got[0], vec![3.0, 0.0, 7.0, 4.0, 11.0, 8.0]);
    assert_eq!(got[1], vec![0.0, 1.0, 2.0, 6.0, 4.0, 9.0, 6.0, 14.0, 8.0, 17.0, 10.0, 22.0]);
}

#[test]
fn integer_bool_semantics() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let a = g.param(ValueType::new([6], DType::I32));
    let c = g.param(ValueType::new([6], DType::I32));
    let f = g.param(ValueType::new([6], DType::F32));
    let div = bin(&mut g, BinaryOp::Div, a, c);
    let md = bin(&mut g, BinaryOp::Mod, a, c);
    let rm = bin(&mut g, BinaryOp::Rem, a, c);
    let lt = bin(&mut g, BinaryOp::Lt, a, c);
    let ci = push(&mut g, Op::Cast(DType::I32), &[f]);
    let rd = push(&mut g, Op::Unary(UnaryOp::Round), &[f]);
    let zero = push(&mut g, Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]);
    let mx = bin(&mut g, BinaryOp::Maximum, f, zero);
    let w = push(&mut g, Op::Where, &[lt, f, zero]);
    let nb = push(&mut g, Op::Unary(UnaryOp::Not), &[lt]);
    g.outputs.extend([div, md, rm, lt, ci, rd, mx, w, nb]);
    let av = vec![7, -7, 7, -7, 5, 3];
    let cv = vec![2, 2, -2, -2, 0, 9];
    let fv = vec![2.5, -3.5, f32::NAN, 3e10, -3e10, 0.5];
    let out = run_on(&b, g, &[Data::I(av), Data::I(cv), Data::F(fv.clone())], &[]);
    assert_eq!(i32s(&out[0]), vec![3, -3, -3, 3, 0, 0]);
    assert_eq!(i32s(&out[1]), vec![1, 1, -1, -1, 0, 3]);
    assert_eq!(i32s(&out[2]), vec![1, -1, 1, -1, 0, 3]);
    assert_eq!(out[3], vec![0, 1, 0, 1, 0, 1]);
    assert_eq!(i32s(&out[4]), vec![2, -3, 0, i32::MAX, i32::MIN, 0]);
    close(&f32s(&out[5]), &[2.0, -4.0, f32::NAN, 3e10, -3e10, 0.0], 0.0);
    close(&f32s(&out[6]), &[2.5, 0.0, f32::NAN, 3e10, 0.0, 0.5], 0.0);
    close(&f32s(&out[7]), &[0.0, -3.5, 0.0, 3e10, 0.0, 0.5], 0.0);
    assert_eq!(out[8], vec![1, 0, 1, 0, 1, 0]);
}

#[test]
fn unary_float_functions() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let x = g.param(ValueType::new([5], DType::F32));
    let ops = [UnaryOp::Gelu, UnaryOp::Erf, UnaryOp::Sigmoid, UnaryOp::Sign, UnaryOp::GeluTanh];
    for u in ops {
        let y = push(&mut g, Op::Unary(u), &[x]);
        g.outputs.push(y);
    }
    let two = g.scalar(DType::F32);
    let p = bin(&mut g, BinaryOp::Pow, x, two);
    g.outputs.push(p);
    let xs = vec![-2.0, -0.5, 0.0, 0.7, 3.0];
    let out = run_on(&b, g, &[Data::F(xs.clone())], &[ScalarValue::Float(3.0)]);
    // erf reference values (at -2, -0.5, 0, 0.7, 3).
    let e = vec![-0.995_322_3_f32, -0.520_499_9, 0.0, 0.677_801_2, 0.999_977_9];
    close(&f32s(&out[1]), &e, 1e-6);
    // gelu(x) = x/2 (1 + erf(x / sqrt 2)); erf at x / sqrt 2 for x = -2, 0.7.
    let g = f32s(&out[0]);
    close(&[g[0], g[2], g[3]], &[-0.045_500_26, 0.0, 0.530_625_5], 1e-5);
    close(&f32s(&out[2]), &xs.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect::<Vec<_>>(), 1e-6);
    close(&f32s(&out[3]), &[-1.0, -1.0, 0.0, 1.0, 1.0], 0.0);
    close(&f32s(&out[5]), &xs.iter().map(|v| v * v * v).collect::<Vec<_>>(), 1e-5);
}

#[test]
fn random_uniform_matches_philox() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let mut g = Graph::new();
    let seed = g.scalar(DType::U32);
    let step = g.scalar(DType::U32);
    let r = push(&mut g, Op::Random { shape: vec![37].into(), dist: RandomDist::Uniform }, &[seed, step]);
    let n = push(&mut g, Op::Random { shape: vec![10].into(), dist: RandomDist::Normal }, &[seed, step]);
    g.outputs.extend([r, n]);
    let out = run_on(&b, g, &[], &[ScalarValue::UInt(1234), ScalarValue::UInt(7)]);
    let got = f32s(&out[0]);
    for (i, v) in got.iter().enumerate() {
        assert_eq!(v.to_bits(), lazuli_ir::philox::uniform_f32(1234, 7, i as u64).to_bits(), "element {i}");
    }
    let want: Vec<f32> = (0..10).map(|i| lazuli_ir::philox::normal_f32(1234, 7, i)).collect();
    close(&f32s(&out[1]), &want, 1e-5);
}

#[test]
fn bool_round_trip_and_unsupported_dtypes() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let ty = ValueType::new([5], DType::Bool);
    let buf = b.upload(&[1, 0, 0, 1, 1], &ty).unwrap();
    assert_eq!(b.download(&buf).unwrap(), vec![1, 0, 0, 1, 1]);
    let mut g = Graph::new();
    let x = g.param(ValueType::new([2], DType::F64));
    let y = push(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let (xn, yn) = (g.node(x).clone(), g.node(y).clone());
    assert!(!b.supports(&yn, &[&xn]));
    assert!(b.name().starts_with("wgpu: "));
    assert!(!lazuli_wgpu::list_adapters().is_empty());
}

fn softmax_ref(xs: &[f32], rows: usize, len: usize, log: bool) -> Vec<f32> {
    let mut want = Vec::new();
    for r in 0..rows {
        let row = &xs[r * len..(r + 1) * len];
        let m = row.iter().cloned().fold(f32::MIN, f32::max);
        let s: f32 = row.iter().map(|v| (v - m).exp()).sum();
        want.extend(row.iter().map(|v| if log { v - m - s.ln() } else { (v - m).exp() / s }));
    }
    want
}

/// Softmax in every form the generator has: vec4 rows (length divisible by
/// 4, operand straight from a buffer), scalar rows (odd length, or a fused
/// prologue), and rows split over cooperating invocations (the GPU form,
/// forced here), each for softmax and log-softmax.
#[test]
fn softmax_all_forms() {
    let _s = serial();
    for coop in [false, true] {
        let Some(b) = backend_with(WgpuOptions { cooperative_rows: Some(coop), ..Default::default() }) else { return };
        // Long rows: past the llvmpipe loop budget for one invocation per row.
        for (rows, len) in [(5, 8), (3, 7), (70, 300), (2, 30001), (1, 140000)] {
            for log in [false, true] {
                let xs: Vec<f32> = (0..rows * len).map(|i| ((i * 37 % 101) as f32) / 25.0 - 2.0).collect();
                let mut g = Graph::new();
                let x = g.param(ValueType::new([rows, len], DType::F32));
                let sm = push(&mut g, Op::Softmax { axis: 1, log }, &[x]);
                let two = push(&mut g, Op::Constant(ScalarValue::Float(2.0), DType::F32), &[]);
                let x2 = bin(&mut g, BinaryOp::Mul, x, two);
                let sm2 = push(&mut g, Op::Softmax { axis: 1, log }, &[x2]);
                g.outputs.extend([sm, sm2]);
                let out = run_on(&b, g, &[Data::F(xs.clone())], &[]);
                close(&f32s(&out[0]), &softmax_ref(&xs, rows, len, log), 1e-5);
                let doubled: Vec<f32> = xs.iter().map(|v| v * 2.0).collect();
                close(&f32s(&out[1]), &softmax_ref(&doubled, rows, len, log), 1e-5);
            }
        }
    }
}

/// The straight-line elementwise form: vec4 and scalar widths, a one-element
/// input broadcast, bool outputs, where and casts.
#[test]
fn straight_line_elementwise_forms() {
    let _s = serial();
    let Some(b) = backend() else { return };
    for n in [8usize, 10, 4096 * 9] {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([n], DType::F32));
        let s = g.param(ValueType::new([1], DType::F32));
        let y = bin(&mut g, BinaryOp::Mul, x, s);
        let gt = bin(&mut g, BinaryOp::Gt, y, x);
        let z = push(&mut g, Op::Where, &[gt, y, x]);
        let zi = push(&mut g, Op::Cast(DType::I32), &[z]);
        g.outputs.extend([gt, z, zi]);
        let xs: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.5).collect();
        let out = run_on(&b, g, &[Data::F(xs.clone()), Data::F(vec![-2.0])], &[]);
        let gt_want: Vec<u8> = xs.iter().map(|v| (v * -2.0 > *v) as u8).collect();
        assert_eq!(out[0], gt_want);
        let z_want: Vec<f32> = xs.iter().map(|v| if v * -2.0 > *v { v * -2.0 } else { *v }).collect();
        close(&f32s(&out[1]), &z_want, 0.0);
        assert_eq!(i32s(&out[2]), z_want.iter().map(|v| *v as i32).collect::<Vec<_>>());
    }
}

/// An indexed (non-straight-line) elementwise kernel over more than
/// 65535 * 256 elements: the dispatch becomes two-dimensional.
#[test]
fn indexed_elementwise_beyond_65535_workgroups() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let (r, c) = (4100usize, 4100usize);
    assert!((r * c) as u64 > 65535 * 256);
    let mut g = Graph::new();
    let x = g.param(ValueType::new([r, c], DType::F32));
    let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
    let y = bin(&mut g, BinaryOp::Add, x, xt);
    g.outputs.push(y);
    let xs: Vec<f32> = (0..r * c).map(|i| (i % 1009) as f32).collect();
    let out = f32s(&run_on(&b, g, &[Data::F(xs.clone())], &[])[0]);
    for (i, j) in [(0, 0), (1, 2), (4099, 17), (2048, 4099), (4099, 4099)] {
        assert_eq!(out[i * c + j], xs[i * c + j] + xs[j * c + i], "({i}, {j})");
    }
}

/// Register-blocked matmul with sizes that leave partial blocks.
#[test]
fn matmul_partial_blocks() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let (bt, m, k, n) = (2usize, 13usize, 9usize, 11usize);
    let mut g = Graph::new();
    let a = g.param(ValueType::new([bt, m, k], DType::F32));
    let w = g.param(ValueType::new([k, n], DType::F32));
    let y = push(&mut g, Op::MatMul, &[a, w]);
    g.outputs.push(y);
    let av: Vec<f32> = (0..bt * m * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let wv: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.5).collect();
    let out = f32s(&run_on(&b, g, &[Data::F(av.clone()), Data::F(wv.clone())], &[])[0]);
    let mut want = vec![0.0f32; bt * m * n];
    for p in 0..bt {
        for i in 0..m {
            for j in 0..n {
                want[(p * m + i) * n + j] = (0..k).map(|q| av[(p * m + i) * k + q] * wv[q * n + j]).sum();
            }
        }
    }
    close(&out, &want, 1e-6);
}

/// Online softmax must not turn leading -inf values into NaN.
#[test]
fn softmax_leading_neg_infinity() {
    let _s = serial();
    for coop in [false, true] {
        let Some(b) = backend_with(WgpuOptions { cooperative_rows: Some(coop), ..Default::default() }) else { return };
        let ni = f32::NEG_INFINITY;
        // Short rows (held in registers when cooperative) and a long row
        // (the online path), each starting with -inf values.
        let long: Vec<f32> = (0..9000).map(|i| if i < 5000 { ni } else { (i % 7) as f32 * 0.25 }).collect();
        let short = vec![ni, ni, ni, ni, 1.0, 2.0, 3.0, 4.0, 0.5, ni, 1.5, ni, ni, ni, ni, 2.5];
        for (rows, len, xs) in [(2, 8, short), (1, 9000, long)] {
            for log in [false, true] {
                let mut g = Graph::new();
                let x = g.param(ValueType::new([rows, len], DType::F32));
                let sm = push(&mut g, Op::Softmax { axis: 1, log }, &[x]);
                g.outputs.push(sm);
                let out = f32s(&run_on(&b, g, &[Data::F(xs.clone())], &[])[0]);
                for (got, want) in out.iter().zip(softmax_ref(&xs, rows, len, log)) {
                    assert!(
                        got == &want || (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "coop {coop}: got {got}, want {want}"
                    );
                }
            }
        }
    }
}

/// Every matmul layout (wide and narrow outputs, vec4 and scalar operand
/// reads, transposed operands read straight from their source, batches,
/// partial blocks) with and without a fused epilogue `relu(a @ b * 0.5 +
/// bias)`, which must stay one kernel.
#[test]
fn matmul_layouts_and_epilogue() {
    let _s = serial();
    for form in matmul_forms() {
        let Some(b) = backend_forms(|f| f.matmul = form) else { return };
        matmul_layouts_on(&b, form);
    }
}

fn matmul_layouts_on(b: &WgpuBackend, form: MatmulForm) {
    let shapes = [
        (1, 1, 1, 1),
        (1, 5, 8, 3),
        (1, 13, 12, 70),
        (2, 20, 4, 64),
        (1, 64, 256, 10),
        (1, 17, 9, 130),
        (2, 33, 16, 12),
        (1, 8, 7, 200),
    ];
    for &(bt, m, k, n) in &shapes {
        for (ta, tb, epi) in [(false, false, false), (true, true, false), (false, true, true), (true, false, true)] {
            let mut g = Graph::new();
            let ad = if ta { vec![bt, k, m] } else { vec![bt, m, k] };
            let bd = if tb { vec![n, k] } else { vec![k, n] };
            let a = g.param(ValueType::new(ad, DType::F32));
            let w = g.param(ValueType::new(bd, DType::F32));
            let bias = g.param(ValueType::new([n], DType::F32));
            let av = if ta { push(&mut g, Op::Permute(vec![0, 2, 1]), &[a]) } else { a };
            let wv = if tb { push(&mut g, Op::Permute(vec![1, 0]), &[w]) } else { w };
            let mut y = push(&mut g, Op::MatMul, &[av, wv]);
            if epi {
                let half = push(&mut g, Op::Constant(ScalarValue::Float(0.5), DType::F32), &[]);
                y = bin(&mut g, BinaryOp::Mul, y, half);
                let be = push(&mut g, Op::Expand(vec![bt, m, n].into()), &[bias]);
                y = bin(&mut g, BinaryOp::Add, y, be);
                y = push(&mut g, Op::Unary(UnaryOp::Relu), &[y]);
            }
            g.outputs.push(y);
            let v = g.clone().verify().unwrap();
            let exe = b.compile(&v).unwrap();
            assert_eq!(exe.kernel_count(), 1, "{bt}x{m}x{k}x{n} {ta} {tb} {epi}");
            if form != MatmulForm::ByShape {
                let tiled = matches!(form, MatmulForm::Tiled(_) | MatmulForm::SplitK { .. });
                assert_eq!(exe.kernel_sources()[0].1.contains("workgroupBarrier"), tiled, "{form:?}");
                // Split where K holds more than one k-slice of 8.
                let split = matches!(form, MatmulForm::SplitK { .. }) && k > 8;
                assert_eq!(exe.kernel_sources().len(), 1 + split as usize, "{form:?} {bt}x{m}x{k}x{n}");
            }
            let adata: Vec<f32> = (0..bt * m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let bdata: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 9) as f32 * 0.5 - 2.0).collect();
            let biasd: Vec<f32> = (0..n).map(|i| (i % 3) as f32 - 1.0).collect();
            let out =
                f32s(&run_on(b, g, &[Data::F(adata.clone()), Data::F(bdata.clone()), Data::F(biasd.clone())], &[])[0]);
            let aat = |p: usize, i: usize, q: usize| {
                if ta {
                    adata[(p * k + q) * m + i]
                } else {
                    adata[(p * m + i) * k + q]
                }
            };
            let bat = |q: usize, j: usize| if tb { bdata[j * k + q] } else { bdata[q * n + j] };
            let mut want = vec![0.0f32; bt * m * n];
            for p in 0..bt {
                for i in 0..m {
                    for j in 0..n {
                        let mut s: f32 = (0..k).map(|q| aat(p, i, q) * bat(q, j)).sum();
                        if epi {
                            s = (s * 0.5 + biasd[j]).max(0.0);
                        }
                        want[(p * m + i) * n + j] = s;
                    }
                }
            }
            close(&out, &want, 1e-3);
        }
    }
}

/// The GPU profile's split-K matmul, forced on this adapter by the
/// profile's rule: weight gradients `x^T dy` as autograd records them
/// (one of G8's shapes scaled to 64 x 64 over 2048 tokens), K not
/// divisible by the part count, a batched product, and a fused epilogue
/// reading inputs (a bias row and an earlier gradient) with an
/// activation; each against a reference computed here.
#[test]
fn split_k_matmul_matches_the_cpu() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { kernel_forms: Some(KernelForms::gpu()), ..Default::default() }) else {
        return;
    };
    // (batch, tokens K, m, n, epilogue)
    for &(bt, kk, m, n, epi) in
        &[(1, 2048, 64, 64, false), (1, 1100, 64, 96, true), (2, 1024, 40, 64, true), (1, 4096, 36, 33, false)]
    {
        let names = split_case(&b, bt, kk, m, n, epi);
        assert!(names[0].ends_with("_pass1"), "not split: {names:?}");
    }
}

/// Split-K where tensors are bound in windows (both passes rewritten),
/// and where the second pass's extra scratch binding would exceed the
/// adapter's storage bindings: then the product runs in one pass.
#[test]
fn split_k_matmul_windowed_and_at_the_binding_limit() {
    let _s = serial();
    let windowed =
        WgpuOptions { kernel_forms: Some(KernelForms::gpu()), binding_window: Some(64 << 10), ..Default::default() };
    let Some(b) = backend_with(windowed) else { return };
    let before = metrics::counter("WindowedKernels");
    let names = split_case(&b, 1, 1024, 64, 64, true);
    assert!(names[0].ends_with("_pass1"), "not split: {names:?}");
    assert!(metrics::counter("WindowedKernels") > before, "nothing windowed");
    // Four inputs and one output where kernels bind five (the device's
    // six less the one the planner keeps free): a sixth, the scratch, is
    // one too many.
    let tight =
        WgpuOptions { kernel_forms: Some(KernelForms::gpu()), max_storage_buffers: Some(6), ..Default::default() };
    let Some(b) = backend_with(tight) else { return };
    let names = split_case(&b, 1, 2048, 64, 64, true);
    assert_eq!(names.len(), 1, "split past the binding limit: {names:?}");
}

/// A split-K product that is an output itself besides an epilogue of it
/// (the planner decides which kernels store which).
#[test]
fn split_k_product_as_an_output_and_into_an_epilogue() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { kernel_forms: Some(KernelForms::gpu()), ..Default::default() }) else {
        return;
    };
    let (kk, m, n) = (2048, 64, 36);
    let mut g = Graph::new();
    let x = g.param(ValueType::new([kk, m], DType::F32));
    let dy = g.param(ValueType::new([kk, n], DType::F32));
    let bias = g.param(ValueType::new([n], DType::F32));
    let xt = push(&mut g, Op::Permute(vec![1, 0]), &[x]);
    let mm = push(&mut g, Op::MatMul, &[xt, dy]);
    let y = bin(&mut g, BinaryOp::Add, mm, bias);
    let y = push(&mut g, Op::Unary(UnaryOp::Relu), &[y]);
    g.outputs.push(mm);
    g.outputs.push(y);
    let v = g.clone().verify().unwrap();
    let names: Vec<String> = b.compile(&v).unwrap().kernel_sources().into_iter().map(|(n, _)| n).collect();
    // The planner may store the product from its own kernel; it is split.
    assert!(names[0].ends_with("_pass1"), "{names:?}");
    let xd: Vec<f32> = (0..kk * m).map(|i| ((i * 3) % 17) as f32 * 0.125 - 1.0).collect();
    let dyd: Vec<f32> = (0..kk * n).map(|i| ((i * 7) % 5) as f32 * 0.25 - 0.5).collect();
    let biasd: Vec<f32> = (0..n).map(|i| i as f32 - 18.0).collect();
    let outs = run_on(&b, g, &[Data::F(xd.clone()), Data::F(dyd.clone()), Data::F(biasd.clone())], &[]);
    let mut want_mm = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            want_mm[i * n + j] = (0..kk).map(|q| xd[q * m + i] as f64 * dyd[q * n + j] as f64).sum::<f64>() as f32;
        }
    }
    let want_y: Vec<f32> = want_mm.iter().enumerate().map(|(e, v)| (v + biasd[e % n]).max(0.0)).collect();
    close(&f32s(&outs[0]), &want_mm, 1e-4);
    close(&f32s(&outs[1]), &want_y, 1e-4);
}

/// Runs the weight gradient `x^T dy` (x [bt, kk, m], dy [bt, kk,
/// n]) on `b`, with `epi`: `tanh(. + bias) + prev`; checks it against a
/// reference computed here and returns the kernel names.
fn split_case(b: &WgpuBackend, bt: usize, kk: usize, m: usize, n: usize, epi: bool) -> Vec<String> {
    let mut g = Graph::new();
    let x = g.param(ValueType::new([bt, kk, m], DType::F32));
    let dy = g.param(ValueType::new([bt, kk, n], DType::F32));
    let bias = g.param(ValueType::new([n], DType::F32));
    let prev = g.param(ValueType::new([bt, m, n], DType::F32));
    let xt = push(&mut g, Op::Permute(vec![0, 2, 1]), &[x]);
    let mut y = push(&mut g, Op::MatMul, &[xt, dy]);
    if epi {
        let be = push(&mut g, Op::Expand(vec![bt, m, n].into()), &[bias]);
        y = bin(&mut g, BinaryOp::Add, y, be);
        y = push(&mut g, Op::Unary(UnaryOp::Tanh), &[y]);
        y = bin(&mut g, BinaryOp::Add, y, prev);
    }
    g.outputs.push(y);
    let v = g.clone().verify().unwrap();
    let exe = b.compile(&v).unwrap();
    let names: Vec<String> = exe.kernel_sources().into_iter().map(|(n, _)| n).collect();
    assert_eq!(exe.kernel_count(), 1, "{names:?}");
    let xd: Vec<f32> = (0..bt * kk * m).map(|i| ((i * 7) % 13) as f32 * 0.125 - 0.75).collect();
    let dyd: Vec<f32> = (0..bt * kk * n).map(|i| ((i * 5) % 11) as f32 * 0.0625 - 0.3).collect();
    let biasd: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
    let prevd: Vec<f32> = (0..bt * m * n).map(|i| (i % 7) as f32 * 0.25).collect();
    let inputs = [Data::F(xd.clone()), Data::F(dyd.clone()), Data::F(biasd.clone()), Data::F(prevd.clone())];
    let out = f32s(&run_on(b, g, &inputs, &[])[0]);
    let mut want = vec![0.0f32; bt * m * n];
    for p in 0..bt {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for q in 0..kk {
                    s += xd[(p * kk + q) * m + i] as f64 * dyd[(p * kk + q) * n + j] as f64;
                }
                let mut s = s as f32;
                if epi {
                    s = (s + biasd[j]).tanh() + prevd[(p * m + i) * n + j];
                }
                want[(p * m + i) * n + j] = s;
            }
        }
    }
    close(&out, &want, 1e-4);
    names
}

/// Long reductions in both forms (one workgroup per output with a tree,
/// and one invocation per output), with remainders after the unrolled
/// loop and more than 65535 elements per output: llvmpipe leaves any loop
/// after 65535 iterations of one invocation, so these would come out short.
#[test]
fn long_reductions_both_forms() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let cases: [(Vec<usize>, Vec<usize>, ReduceOp); 6] = [
        (vec![3, 100003], vec![1], ReduceOp::Sum),
        // Many strided outputs: split into parts on GPUs.
        (vec![4100, 1030], vec![0], ReduceOp::Mean),
        (vec![100, 5003], vec![1], ReduceOp::Sum),
        (vec![600001], vec![0], ReduceOp::Max),
        (vec![5001, 3], vec![0], ReduceOp::Mean),
        (vec![2, 300, 301], vec![1, 2], ReduceOp::Sum),
    ];
    for (shape, axes, op) in cases {
        let n: usize = shape.iter().product();
        let mut g = Graph::new();
        let x = g.param(ValueType::new(shape.clone(), DType::F32));
        let sq = bin(&mut g, BinaryOp::Mul, x, x);
        let r = push(&mut g, Op::Reduce { op, axes: axes.clone(), keepdim: false }, &[sq]);
        g.outputs.push(r);
        let xs: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
        let out = f32s(&run_on(&b, g, &[Data::F(xs.clone())], &[])[0]);
        // Reference in f64: outputs over the kept dims, row-major.
        let rank = shape.len();
        let kept: Vec<usize> = (0..rank).filter(|d| !axes.contains(d)).collect();
        let outs: usize = kept.iter().map(|&d| shape[d]).product();
        let mut acc = vec![if op == ReduceOp::Max { f64::NEG_INFINITY } else { 0.0 }; outs];
        let mut count = vec![0usize; outs];
        for (i, &v) in xs.iter().enumerate() {
            let mut rem = i;
            let mut coords = vec![0; rank];
            for d in (0..rank).rev() {
                coords[d] = rem % shape[d];
                rem /= shape[d];
            }
            let o = kept.iter().fold(0, |o, &d| o * shape[d] + coords[d]);
            let v = (v * v) as f64;
            acc[o] = if op == ReduceOp::Max { acc[o].max(v) } else { acc[o] + v };
            count[o] += 1;
        }
        let want: Vec<f32> = acc
            .iter()
            .zip(&count)
            .map(|(&a, &c)| if op == ReduceOp::Mean { (a / c as f64) as f32 } else { a as f32 })
            .collect();
        close(&out, &want, 1e-4);
    }
}

/// A matmul whose result feeds two elementwise consumers (`relu(h)` and
/// the bool mask `h > 0`, as in an MLP's forward and ReLU backward) writes
/// both from one kernel, in both matmul forms.
#[test]
fn matmul_epilogue_with_two_outputs() {
    let _s = serial();
    for form in matmul_forms() {
        let Some(b) = backend_forms(|f| f.matmul = form) else { return };
        for (m, k, n) in [(9, 5, 12), (33, 8, 70), (4, 3, 10), (130, 20, 129)] {
            let mut g = Graph::new();
            let a = g.param(ValueType::new([m, k], DType::F32));
            let w = g.param(ValueType::new([k, n], DType::F32));
            let bias = g.param(ValueType::new([n], DType::F32));
            let mm = push(&mut g, Op::MatMul, &[a, w]);
            let be = push(&mut g, Op::Expand(vec![m, n].into()), &[bias]);
            let h = bin(&mut g, BinaryOp::Add, mm, be);
            let relu = push(&mut g, Op::Unary(UnaryOp::Relu), &[h]);
            let zero = push(&mut g, Op::Constant(ScalarValue::Float(0.0), DType::F32), &[]);
            let mask = bin(&mut g, BinaryOp::Gt, h, zero);
            g.outputs.extend([relu, mask]);
            let v = g.clone().verify().unwrap();
            assert_eq!(b.compile(&v).unwrap().kernel_count(), 1, "{m}x{k}x{n} {form:?}");
            let ad: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let wd: Vec<f32> = (0..k * n).map(|i| ((i * 5) % 9) as f32 * 0.5 - 2.0).collect();
            let bd: Vec<f32> = (0..n).map(|i| (i % 3) as f32 - 1.0).collect();
            let out = run_on(&b, g, &[Data::F(ad.clone()), Data::F(wd.clone()), Data::F(bd.clone())], &[]);
            let mut want_relu = vec![0.0f32; m * n];
            let mut want_mask = vec![0i32; m * n];
            for i in 0..m {
                for j in 0..n {
                    let s: f32 = (0..k).map(|q| ad[i * k + q] * wd[q * n + j]).sum::<f32>() + bd[j];
                    want_relu[i * n + j] = s.max(0.0);
                    want_mask[i * n + j] = (s > 0.0) as i32;
                }
            }
            close(&f32s(&out[0]), &want_relu, 1e-5);
            assert_eq!(out[1].iter().map(|&x| x as i32).collect::<Vec<_>>(), want_mask);
        }
    }
}

/// Row kernels (GPU profile): layer norm as `nn::layer_norm` composes it,
/// and a softmax written by hand (max, exp, sum, divide), each one kernel;
/// also with the mean needed as a graph output (then written by a kernel
/// of its own).
#[test]
fn row_kernels_layer_norm_and_handwritten_softmax() {
    let _s = serial();
    let Some(b) = backend_forms(|f| *f = KernelForms::gpu()) else { return };
    for (rows, len, mean_out) in [(37usize, 1000usize, false), (5, 3, true), (300, 64, false)] {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([rows, len], DType::F32));
        let w = g.param(ValueType::new([len], DType::F32));
        let bias = g.param(ValueType::new([len], DType::F32));
        let red = |g: &mut Graph, op, v| push(g, Op::Reduce { op, axes: vec![1], keepdim: true }, &[v]);
        let mu = red(&mut g, ReduceOp::Mean, x);
        let xc = bin(&mut g, BinaryOp::Sub, x, mu);
        let sq = bin(&mut g, BinaryOp::Mul, xc, xc);
        let var = red(&mut g, ReduceOp::Mean, sq);
        let eps = push(&mut g, Op::Constant(ScalarValue::Float(1e-5), DType::F32), &[]);
        let ve = bin(&mut g, BinaryOp::Add, var, eps);
        let r = push(&mut g, Op::Unary(UnaryOp::Rsqrt), &[ve]);
        let y = bin(&mut g, BinaryOp::Mul, xc, r);
        let y = bin(&mut g, BinaryOp::Mul, y, w);
        let y = bin(&mut g, BinaryOp::Add, y, bias);
        let mx = red(&mut g, ReduceOp::Max, x);
        let e = bin(&mut g, BinaryOp::Sub, x, mx);
        let e = push(&mut g, Op::Unary(UnaryOp::Exp), &[e]);
        let s = red(&mut g, ReduceOp::Sum, e);
        let sm = bin(&mut g, BinaryOp::Div, e, s);
        g.outputs.extend([y, sm]);
        if mean_out {
            g.outputs.push(mu);
        }
        let v = g.clone().verify().unwrap();
        let exe = b.compile(&v).unwrap();
        let want_kernels = if mean_out { 3 } else { 2 };
        assert_eq!(
            exe.kernel_count(),
            want_kernels,
            "{rows}x{len}: {:?}",
            exe.kernel_sources().iter().map(|k| &k.0).collect::<Vec<_>>()
        );
        let xs: Vec<f32> = (0..rows * len).map(|i| ((i * 37 % 101) as f32) / 20.0 - 2.5).collect();
        let ws: Vec<f32> = (0..len).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let bs: Vec<f32> = (0..len).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
        let out = run_on(&b, g, &[Data::F(xs.clone()), Data::F(ws.clone()), Data::F(bs.clone())], &[]);
        let (mut want_y, mut want_sm, mut want_mu) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let row: Vec<f64> = xs[r * len..(r + 1) * len].iter().map(|&v| v as f64).collect();
            let m = row.iter().sum::<f64>() / len as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / len as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            want_mu.push(m as f32);
            want_y.extend((0..len).map(|j| ((row[j] - m) * inv * ws[j] as f64 + bs[j] as f64) as f32));
            let mx = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let tot: f64 = row.iter().map(|v| (v - mx).exp()).sum();
            want_sm.extend(row.iter().map(|v| ((v - mx).exp() / tot) as f32));
        }
        close(&f32s(&out[0]), &want_y, 2e-5);
        close(&f32s(&out[1]), &want_sm, 2e-5);
        if mean_out {
            close(&f32s(&out[2]), &want_mu, 1e-5);
        }
    }
}

/// Row kernels (GPU profile): the layer-norm input gradient as autograd
/// writes it, two row sums where the second reads the first through an
/// expand along the row, is one kernel and matches a float64 reference.
#[test]
fn row_kernels_fold_row_sums_broadcast_by_expand() {
    let _s = serial();
    let Some(b) = backend_forms(|f| *f = KernelForms::gpu()) else { return };
    for (rows, len) in [(37usize, 1000usize), (5, 3), (300, 64)] {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([rows, len], DType::F32));
        let dy = g.param(ValueType::new([rows, len], DType::F32));
        let rstd = g.param(ValueType::new([rows, 1], DType::F32));
        let sum = |g: &mut Graph, v| push(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: true }, &[v]);
        let expand = |g: &mut Graph, v| push(g, Op::Expand(lazuli_ir::Shape::new([rows, len])), &[v]);
        let dyx = bin(&mut g, BinaryOp::Mul, dy, x);
        let s1 = sum(&mut g, dyx);
        let t = bin(&mut g, BinaryOp::Mul, s1, rstd);
        let te = expand(&mut g, t);
        let a = bin(&mut g, BinaryOp::Mul, dy, rstd);
        let c = bin(&mut g, BinaryOp::Mul, te, x);
        let y = bin(&mut g, BinaryOp::Add, a, c);
        let ny = push(&mut g, Op::Unary(UnaryOp::Neg), &[y]);
        let s2 = sum(&mut g, ny);
        let s2e = expand(&mut g, s2);
        let out = bin(&mut g, BinaryOp::Add, y, s2e);
        g.outputs.push(out);
        let exe = b.compile(&g.clone().verify().unwrap()).unwrap();
        assert_eq!(exe.kernel_count(), 1, "{rows}x{len}: {:?}", exe.kernel_sources());
        let xs: Vec<f32> = (0..rows * len).map(|i| ((i * 37 % 101) as f32) / 40.0 - 1.25).collect();
        let dys: Vec<f32> = (0..rows * len).map(|i| ((i * 13 % 29) as f32) / 10.0 - 1.4).collect();
        let rs: Vec<f32> = (0..rows).map(|r| 0.5 + (r % 7) as f32 * 0.125).collect();
        let got = run_on(&b, g, &[Data::F(xs.clone()), Data::F(dys.clone()), Data::F(rs.clone())], &[]);
        let mut want = Vec::new();
        for r in 0..rows {
            let (xr, dr, rr) = (&xs[r * len..(r + 1) * len], &dys[r * len..(r + 1) * len], rs[r] as f64);
            let s1: f64 = xr.iter().zip(dr).map(|(&x, &d)| x as f64 * d as f64).sum();
            let y: Vec<f64> = xr.iter().zip(dr).map(|(&x, &d)| d as f64 * rr + s1 * rr * x as f64).collect();
            let s2: f64 = -y.iter().sum::<f64>();
            want.extend(y.iter().map(|v| (v + s2) as f32));
        }
        close(&f32s(&got[0]), &want, 1e-3);
    }
}

/// Row kernels (GPU profile): a layer norm whose centred value and
/// inverse deviation later kernels read (as training keeps them for the
/// backward) is one row kernel writing them too, the deviation once per
/// row; what the later kernels compute from them matches float64.
#[test]
fn row_kernels_write_values_later_kernels_read() {
    let _s = serial();
    let Some(b) = backend_forms(|f| *f = KernelForms::gpu()) else { return };
    for (rows, len) in [(37usize, 1000usize), (5, 3), (300, 64)] {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([rows, len], DType::F32));
        let w = g.param(ValueType::new([len], DType::F32));
        let mean = |g: &mut Graph, v| push(g, Op::Reduce { op: ReduceOp::Mean, axes: vec![1], keepdim: true }, &[v]);
        let col = |g: &mut Graph, v| push(g, Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[v]);
        let mu = mean(&mut g, x);
        let xc = bin(&mut g, BinaryOp::Sub, x, mu);
        let sq = bin(&mut g, BinaryOp::Mul, xc, xc);
        let var = mean(&mut g, sq);
        let eps = push(&mut g, Op::Constant(ScalarValue::Float(1e-5), DType::F32), &[]);
        let ve = bin(&mut g, BinaryOp::Add, var, eps);
        let rstd = push(&mut g, Op::Unary(UnaryOp::Rsqrt), &[ve]);
        let xhat = bin(&mut g, BinaryOp::Mul, xc, rstd);
        let y = bin(&mut g, BinaryOp::Mul, xhat, w);
        let p = bin(&mut g, BinaryOp::Mul, y, xc);
        let s0 = col(&mut g, p);
        let q = bin(&mut g, BinaryOp::Mul, y, rstd);
        let r0 = col(&mut g, q);
        g.outputs.extend([s0, r0]);
        let exe = b.compile(&g.clone().verify().unwrap()).unwrap();
        let names: Vec<String> = exe.kernel_sources().iter().map(|k| k.0.clone()).collect();
        assert_eq!(names.iter().filter(|n| n.contains("Rows")).count(), 1, "{rows}x{len}: {names:?}");
        assert!(!names.iter().any(|n| n.contains("reduce_mean")), "{rows}x{len}: {names:?}");
        let xs: Vec<f32> = (0..rows * len).map(|i| ((i * 37 % 101) as f32) / 20.0 - 2.5).collect();
        let ws: Vec<f32> = (0..len).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let got = run_on(&b, g, &[Data::F(xs.clone()), Data::F(ws.clone())], &[]);
        let (mut want_s, mut want_r) = (vec![0f64; len], vec![0f64; len]);
        for r in 0..rows {
            let row: Vec<f64> = xs[r * len..(r + 1) * len].iter().map(|&v| v as f64).collect();
            let m = row.iter().sum::<f64>() / len as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / len as f64;
            let inv = 1.0 / (var + 1e-5).sqrt();
            for j in 0..len {
                let y = (row[j] - m) * inv * ws[j] as f64;
                want_s[j] += y * (row[j] - m);
                want_r[j] += y * inv;
            }
        }
        let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<f32>>();
        close(&f32s(&got[0]), &f(want_s), 1e-3);
        close(&f32s(&got[1]), &f(want_r), 1e-3);
    }
}

/// The GPU gather kernel (which the executor does not select yet: it
/// cannot report an out-of-range index) reads an embedding table bound in
/// windows (`WgpuOptions::binding_window`, see `lazuli_wgpu::codegen::window`), as
/// a table beyond the adapter's binding limit always is; the rows it
/// gathers lie in different windows.
#[test]
fn gather_from_a_windowed_table() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { binding_window: Some(4 << 10), ..Default::default() }) else { return };
    let (rows, dim) = (300usize, 48usize);
    let mut g = Graph::new();
    let table = g.param(ValueType::new([rows, dim], DType::F32));
    let idx = g.param(ValueType::new([7], DType::I32));
    let ga = push(&mut g, Op::Gather { axis: 0 }, &[table, idx]);
    g.outputs.push(ga);
    let xs: Vec<f32> = (0..rows * dim).map(|i| i as f32 * 0.5).collect();
    // A window holds 1024 f32: rows 21 and 22 straddle the first edge.
    let ids = vec![0, 21, 22, 150, 299, -1, -300];
    let before = metrics::counter("WindowedKernels");
    let out = f32s(&run_on(&b, g, &[Data::F(xs.clone()), Data::I(ids.clone())], &[])[0]);
    assert!(metrics::counter("WindowedKernels") > before, "the table was windowed");
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            let r = id.rem_euclid(rows as i32) as usize;
            xs[r * dim..(r + 1) * dim].to_vec()
        })
        .collect();
    close(&out, &want, 0.0);
}

/// The profiler collects each launch with the cost its executable
/// computed at compile time (`Executable::launch_costs`), a split-K
/// product's first pass included, timed where the adapter has timestamp
/// queries; without profiling nothing is collected.
#[test]
fn profiled_launches_carry_their_compile_time_costs() {
    let _s = serial();
    let Some(b) = backend_with(WgpuOptions { kernel_forms: Some(KernelForms::gpu()), ..Default::default() }) else {
        return;
    };
    let (kk, m, n) = (2048, 64, 36);
    let mut g = Graph::new();
    let x = g.param(ValueType::new([m, kk], DType::F32));
    let w = g.param(ValueType::new([kk, n], DType::F32));
    let y = push(&mut g, Op::MatMul, &[x, w]);
    let y = push(&mut g, Op::Unary(UnaryOp::Relu), &[y]);
    g.outputs.push(y);
    let params = g.params.clone();
    let exe = b.compile(&g.verify().unwrap()).unwrap();
    let costs = exe.launch_costs();
    let names: Vec<String> = exe.kernel_sources().into_iter().map(|(n, _)| n).collect();
    assert_eq!(costs.iter().map(|c| c.name.clone()).collect::<Vec<_>>(), names);
    assert!(names[0].ends_with("_pass1"), "a long K with few tiles splits: {names:?}");
    // The product and its ReLU epilogue: 2 * M * N * K + M * N.
    let product = costs.iter().find(|c| c.flops >= 2 * (m * n * kk) as u64).expect("the product's launch");
    assert_eq!(product.flops, (2 * m * n * kk + m * n) as u64, "{costs:?}");
    assert!(costs.iter().all(|c| c.workgroups > 0 && c.bytes > 0), "{costs:?}");
    let run = || {
        let data = |ty: &ValueType| b.upload(&vec![0u8; ty.shape.numel() * 4], ty).unwrap();
        b.execute(exe.as_ref(), params.iter().map(data).collect(), &[]).unwrap();
    };
    run();
    assert!(b.take_profile().is_empty());
    let timed = b.set_profiling(true);
    assert_eq!(timed, b.supports_profiling());
    run();
    let samples = b.take_profile();
    b.set_profiling(false);
    assert_eq!(samples.iter().map(|s| s.cost.clone()).collect::<Vec<_>>(), costs);
    assert!(samples.iter().all(|s| s.ms.is_some() == timed), "{samples:?}");
}

/// Quantized weights (`lazuli_ir::quant`): random blocks of a format,
/// each scale a sane f16 (normals of both signs and some subnormals,
/// which the kernels widen exactly), `rows` rows of `cols` values.
fn quant_weight(format: lazuli_ir::quant::QuantFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    use lazuli_ir::quant::QuantFormat as F;
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let row_bytes = format.row_bytes(cols).unwrap();
    let mut w: Vec<u8> = (0..rows * row_bytes).map(|_| next() as u8).collect();
    // A half of bits: a normal of exponent -10..2 (or a subnormal one
    // time in eight), either sign.
    let half = |next: &mut dyn FnMut() -> u32| -> [u8; 2] {
        let r = next();
        let e = if r.is_multiple_of(8) { 0 } else { 5 + (r >> 3) % 12 };
        let bits = ((r >> 16) & 0x8000) | (e << 10) | (next() & 0x3ff);
        (bits as u16).to_le_bytes()
    };
    let scales: &[usize] = match format {
        F::Q8_0 | F::Q4_0 | F::Q5_0 => &[0],
        F::Q4K => &[0, 2],
        F::Q6K => &[208],
        F::F16 | F::BF16 => &[],
    };
    for block in w.chunks_exact_mut(format.block_bytes()) {
        for &at in scales {
            block[at..at + 2].copy_from_slice(&half(&mut next));
        }
        match format {
            F::F16 => block.copy_from_slice(&half(&mut next)),
            // bf16: exponent 120..136, either sign.
            F::BF16 => {
                let r = next();
                let bits = ((r >> 16) & 0x8000) | ((120 + r % 16) << 7) | ((r >> 8) & 0x7f);
                block.copy_from_slice(&(bits as u16).to_le_bytes());
            }
            _ => {}
        }
    }
    w
}

/// `Op::Dequantize` and `Op::QuantMatMul` run as WGSL kernels (no
/// fallback: the wgpu backend alone, which has none) for every format:
/// dequantized values bit for bit the IR's reference (llama.cpp's
/// formulas), products within f32 summation order of the reference
/// product, for weight rows that are not a multiple of a workgroup's,
/// depths of one block and of several, one activation row and several;
/// every source passes naga and reads the weight through its byte
/// binding.
#[test]
fn quantized_weights_run_as_kernels() {
    use lazuli_ir::quant::QuantFormat;
    let _s = serial();
    let Some(b) = backend() else { return };
    for (fi, format) in QuantFormat::ALL.into_iter().enumerate() {
        let bl = format.block_len();
        // Depths: one block (or 40 values, not a whole unit), several.
        let depths = if bl == 1 { [40, 96] } else { [bl, bl * 3] };
        for (case, (&k, (n, lead))) in
            depths.iter().cycle().zip([(1usize, vec![1usize]), (7, vec![3]), (67, vec![2, 3])]).enumerate()
        {
            let seed = (fi * 10 + case) as u64;
            let w = quant_weight(format, n, k, seed);
            let row_bytes = format.row_bytes(k).unwrap();
            let mut reference = vec![0f32; n * k];
            for (row, out) in w.chunks_exact(row_bytes).zip(reference.chunks_exact_mut(k)) {
                format.dequantize_row(row, out);
            }
            let wty = ValueType::new([n, row_bytes], DType::U8);
            // Dequantize: exact.
            let mut g = Graph::new();
            let p = g.param(wty.clone());
            let d = push(&mut g, Op::Dequantize(format), &[p]);
            g.outputs.push(d);
            let v = g.clone().verify().unwrap();
            let exe = b.compile(&v).expect("compile");
            let srcs = exe.kernel_sources();
            assert!(srcs.iter().any(|(_, s)| s.contains("fn qv(")), "{format}: a quantized kernel\n{srcs:?}");
            let wb = b.upload(&w, &wty).expect("u8 upload");
            assert_eq!(b.download(&wb).unwrap(), w, "{format}: u8 round trip");
            let out = b.execute(exe.as_ref(), vec![wb.clone()], &[]).expect("execute");
            let got = f32s(&b.download(&out[0]).unwrap());
            for (i, (a, r)) in got.iter().zip(&reference).enumerate() {
                assert_eq!(a.to_bits(), r.to_bits(), "{format} [{n}, {k}] value {i}: {a} vs {r}");
            }
            // An embedding lookup: rows of the bytes gathered on the
            // device (a byte binding written by words), then dequantized.
            let ids: Vec<i32> = (0..5).map(|i| ((i * 3 + case) % n) as i32).collect();
            let mut g = Graph::new();
            let p = g.param(wty.clone());
            let ip = g.param(ValueType::new([5], DType::I32));
            let rows = push(&mut g, Op::Gather { axis: 0 }, &[p, ip]);
            let d = push(&mut g, Op::Dequantize(format), &[rows]);
            g.outputs.extend([rows, d]);
            let outs = run_on(&b, g, &[Data::B(w.clone()), Data::I(ids.clone())], &[]);
            let want_rows: Vec<u8> =
                ids.iter().flat_map(|&i| w[i as usize * row_bytes..][..row_bytes].to_vec()).collect();
            assert_eq!(outs[0], want_rows, "{format}: gathered bytes");
            let want: Vec<f32> = ids.iter().flat_map(|&i| reference[i as usize * k..][..k].to_vec()).collect();
            assert_eq!(f32s(&outs[1]), want, "{format}: gathered rows dequantized");
            // QuantMatMul: x [lead.., k] @ w^T.
            let m: usize = lead.iter().product();
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 + case * 11) % 23) as f32 / 11.0 - 1.0).collect();
            let mut dims = lead.clone();
            dims.push(k);
            let mut g = Graph::new();
            let xp = g.param(ValueType::new(dims, DType::F32));
            let wp = g.param(wty.clone());
            let y = push(&mut g, Op::QuantMatMul(format), &[xp, wp]);
            g.outputs.push(y);
            let outs = run_on(&b, g, &[Data::F(x.clone()), Data::B(w.clone())], &[]);
            let got = f32s(&outs[0]);
            assert_eq!(got.len(), m * n);
            for (i, a) in got.iter().enumerate() {
                let (r, c) = (i / n, i % n);
                let terms = (0..k).map(|j| x[r * k + j] as f64 * reference[c * k + j] as f64);
                let (want, mag) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                assert!(
                    (*a as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                    "{format} x {lead:?}x{k} @ [{n}, {k}]^T element {i}: {a} vs {want}"
                );
            }
        }
    }
}

/// `Op::WriteAt` and `Op::PrefixAttention` run as WGSL kernels against a
/// host reference (the CPU backend's loops): a write at one position and
/// at a position per row, attention with grouped-query heads over each
/// row's prefix, one query and several; a position that does not fit is
/// `IndexOutOfRange`, never a clamp.
#[test]
fn kv_cache_ops_run_as_kernels() {
    let _s = serial();
    let Some(b) = backend() else { return };
    let val =
        |n: usize, salt: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + salt * 3) % 13) as f32 / 6.5 - 1.0).collect() };
    // WriteAt: base [2, 3, 8, 4], update [2, 3, u, 4] along axis 2.
    let (bd, axis) = ([2usize, 3, 8, 4], 2);
    for (u, pos) in [(1usize, vec![5i32]), (3, vec![0, 5]), (2, vec![7])] {
        let ud = [2usize, 3, u, 4];
        let (base, upd) = (val(bd.iter().product(), 1), val(ud.iter().product(), 2));
        let mut g = Graph::new();
        let bp = g.param(ValueType::new(bd, DType::F32));
        let up = g.param(ValueType::new(ud, DType::F32));
        let pdims: Vec<usize> = if pos.len() == 1 { vec![] } else { vec![2] };
        let pp = g.param(ValueType::new(pdims, DType::I32));
        let y = push(&mut g, Op::WriteAt { axis }, &[bp, up, pp]);
        g.outputs.push(y);
        if pos.iter().any(|&p| p as usize + u > bd[axis]) {
            let v = g.verify().unwrap();
            let exe = b.compile(&v).expect("compile");
            let params = v.params.clone();
            let bufs = [Data::F(base), Data::F(upd), Data::I(pos)]
                .iter()
                .zip(&params)
                .map(|(d, ty)| b.upload(&bytes(d), ty).unwrap())
                .collect();
            let err = b.execute(exe.as_ref(), bufs, &[]).and_then(|o| b.download(&o[0])).unwrap_err();
            assert!(matches!(err, lazuli_executor::BackendError::IndexOutOfRange(_)), "{err}");
            assert!(err.to_string().contains("write_at"), "{err}");
            continue;
        }
        let got = f32s(&run_on(&b, g, &[Data::F(base.clone()), Data::F(upd.clone()), Data::I(pos.clone())], &[])[0]);
        let mut want = base.clone();
        for o in 0..6 {
            let p = pos[if pos.len() == 1 { 0 } else { o / 3 }] as usize;
            for a in 0..u {
                for r in 0..4 {
                    want[(o * 8 + p + a) * 4 + r] = upd[(o * u + a) * 4 + r];
                }
            }
        }
        assert_eq!(got, want, "write_at of {u} at {pos:?}");
    }
    // PrefixAttention: q [2, 4, t, 4], k [2, 2, 8, 4], v [2, 2, 8, 3].
    let (bb, h, gh, s, d, dv) = (2usize, 4usize, 2usize, 8usize, 4usize, 3usize);
    for (t, pos) in [(1usize, vec![6i32]), (3, vec![0, 5]), (2, vec![7])] {
        let (q, k, v) = (val(bb * h * t * d, 3), val(bb * gh * s * d, 4), val(bb * gh * s * dv, 5));
        let mut g = Graph::new();
        let qp = g.param(ValueType::new([bb, h, t, d], DType::F32));
        let kp = g.param(ValueType::new([bb, gh, s, d], DType::F32));
        let vp = g.param(ValueType::new([bb, gh, s, dv], DType::F32));
        let sc = push(&mut g, Op::Constant(ScalarValue::Float(0.5), DType::F32), &[]);
        let pdims: Vec<usize> = if pos.len() == 1 { vec![] } else { vec![bb] };
        let pp = g.param(ValueType::new(pdims, DType::I32));
        let y = push(&mut g, Op::PrefixAttention, &[qp, kp, vp, sc, pp]);
        g.outputs.push(y);
        let inputs = [Data::F(q.clone()), Data::F(k.clone()), Data::F(v.clone()), Data::I(pos.clone())];
        if pos.iter().any(|&p| p as usize + t > s) {
            let v = g.verify().unwrap();
            let exe = b.compile(&v).expect("compile");
            let params = v.params.clone();
            let bufs = inputs.iter().zip(&params).map(|(d, ty)| b.upload(&bytes(d), ty).unwrap()).collect();
            let err = b.execute(exe.as_ref(), bufs, &[]).and_then(|o| b.download(&o[0])).unwrap_err();
            assert!(err.to_string().contains("prefix_attention"), "{err}");
            continue;
        }
        let got = f32s(&run_on(&b, g, &inputs, &[])[0]);
        let mut want = vec![0f32; bb * h * t * dv];
        for r in 0..bb {
            let p = pos[if pos.len() == 1 { 0 } else { r }] as usize;
            for hh in 0..h {
                let kv = (r * gh + hh / (h / gh)) * s;
                for i in 0..t {
                    let qi = &q[((r * h + hh) * t + i) * d..][..d];
                    let scores: Vec<f32> = (0..=p + i)
                        .map(|j| qi.iter().zip(&k[(kv + j) * d..][..d]).map(|(a, c)| a * c).sum::<f32>() * 0.5)
                        .collect();
                    let mx = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let w: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
                    let sum: f32 = w.iter().sum();
                    for e in 0..dv {
                        let acc: f32 = w.iter().enumerate().map(|(j, wj)| wj * v[(kv + j) * dv + e]).sum();
                        want[((r * h + hh) * t + i) * dv + e] = acc / sum;
                    }
                }
            }
        }
        close(&got, &want, 1e-5);
    }
}
