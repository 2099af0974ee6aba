//! Unit tests of every op on small hand-computed cases, run through the
//! public `Backend` interface on verified graphs.

use super::*;
use half::{bf16, f16};
use lazuli_executor::Backend;
use lazuli_ir::{
    ArgReduceOp, BinaryOp, ConvAttrs, DType, Graph, NodeId, Op, PadMode, PoolAttrs, PoolKind, RandomDist, ReduceOp,
    Shape, UnaryOp,
};

/// A graph under construction with its input buffers.
struct T {
    g: Graph,
    inputs: Vec<Buffer>,
    scalars: Vec<ScalarValue>,
}

impl T {
    fn new() -> T {
        T { g: Graph::new(), inputs: vec![], scalars: vec![] }
    }

    fn input(&mut self, data: CpuData, dims: &[usize]) -> NodeId {
        let ty = ValueType::new(dims, data.dtype());
        self.inputs.push(CpuBackend::buffer(data, ty.clone()));
        self.g.param(ty)
    }

    fn scalar(&mut self, v: ScalarValue, dt: DType) -> NodeId {
        self.scalars.push(v.cast(dt));
        self.g.scalar(dt)
    }

    fn op(&mut self, op: Op, args: &[NodeId]) -> NodeId {
        self.g.push(op, args).unwrap()
    }

    fn try_run(mut self, outs: &[NodeId]) -> Result<Vec<CpuData>, BackendError> {
        self.g.outputs = outs.to_vec();
        let be = CpuBackend::new();
        let exe = be.compile(&self.g.verify().unwrap())?;
        let bufs = be.execute(exe.as_ref(), self.inputs, &self.scalars)?;
        Ok(bufs.iter().map(|b| CpuBackend::data(b).unwrap().clone()).collect())
    }

    fn run1(self, out: NodeId) -> CpuData {
        self.try_run(&[out]).unwrap().remove(0)
    }
}

/// Applies one op to the given inputs.
fn eval(op: Op, ins: &[(CpuData, &[usize])]) -> CpuData {
    let mut t = T::new();
    let ids: Vec<NodeId> = ins.iter().map(|(d, s)| t.input(d.clone(), s)).collect();
    let o = t.op(op, &ids);
    t.run1(o)
}

fn f32s(v: &[f32]) -> CpuData {
    CpuData::F32(v.to_vec())
}
fn i32s(v: &[i32]) -> CpuData {
    CpuData::I32(v.to_vec())
}
fn bools(v: &[u8]) -> CpuData {
    CpuData::Bool(v.to_vec())
}

/// Float values of any float data, widened.
fn floats(d: &CpuData) -> Vec<f64> {
    match d {
        CpuData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
        CpuData::F32(v) => v.iter().map(|&x| x as f64).collect(),
        CpuData::F64(v) => v.clone(),
        other => panic!("not float: {other:?}"),
    }
}

/// Asserts closeness, with NaN equal to NaN.
fn close(d: &CpuData, want: &[f64], tol: f64) {
    let got = floats(d);
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{got:?} vs {want:?}");
    }
}

fn bin(op: BinaryOp, a: CpuData, sa: &[usize], b: CpuData, sb: &[usize]) -> CpuData {
    eval(Op::Binary(op), &[(a, sa), (b, sb)])
}

fn un(op: UnaryOp, a: CpuData) -> CpuData {
    let n = a.len();
    eval(Op::Unary(op), &[(a, &[n])])
}

#[test]
fn backend_identity_and_bytes() {
    let be = CpuBackend::new();
    assert_eq!(be.kind(), BackendKind::Cpu);
    assert_eq!(be.name(), "cpu");
    let ty = ValueType::new([2], DType::F32);
    let buf = be.upload(&[0, 0, 128, 63, 0, 0, 0, 64], &ty).unwrap();
    assert_eq!(CpuBackend::data(&buf), Some(&f32s(&[1.0, 2.0])));
    assert_eq!(be.download(&buf).unwrap(), vec![0, 0, 128, 63, 0, 0, 0, 64]);
    assert!(be.upload(&[0; 7], &ty).is_err());
    let mut g = Graph::new();
    let x = g.param(ty.clone());
    let y = g.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
    g.outputs.push(y);
    let node = g.node(y).clone();
    assert!(be.supports(&node, &[g.node(x)]));
    let exe = be.compile(&g.verify().unwrap()).unwrap();
    assert_eq!(exe.kernel_count(), 1);
    assert!(exe.kernel_sources().is_empty());
    // Wrong inputs are errors, not panics.
    assert!(be.execute(exe.as_ref(), vec![], &[]).is_err());
    let wrong = CpuBackend::buffer(i32s(&[1, 2]), ValueType::new([2], DType::I32));
    assert!(be.execute(exe.as_ref(), vec![wrong], &[]).is_err());
}

#[test]
fn binary_broadcasts_both_ways() {
    let a = f32s(&[1.0, 2.0]);
    let b = f32s(&[10.0, 20.0, 30.0]);
    let r = bin(BinaryOp::Add, a.clone(), &[2, 1], b.clone(), &[3]);
    assert_eq!(r, f32s(&[11.0, 21.0, 31.0, 12.0, 22.0, 32.0]));
    let r = bin(BinaryOp::Sub, b, &[3], a, &[2, 1]);
    assert_eq!(r, f32s(&[9.0, 19.0, 29.0, 8.0, 18.0, 28.0]));
    let r = bin(BinaryOp::Mul, f32s(&[2.0]), &[], f32s(&[1.0, 2.0, 3.0]), &[3]);
    assert_eq!(r, f32s(&[2.0, 4.0, 6.0]));
    let r = bin(BinaryOp::Div, f32s(&[1.0, 2.0, 3.0]), &[3, 1, 1], f32s(&[2.0, 4.0]), &[1, 2]);
    assert_eq!(r, f32s(&[0.5, 0.25, 1.0, 0.5, 1.5, 0.75]));
    // Zero-size broadcast.
    let r = bin(BinaryOp::Add, f32s(&[]), &[0, 3], f32s(&[1.0, 2.0, 3.0]), &[3]);
    assert_eq!(r, f32s(&[]));
}

#[test]
fn integer_arithmetic_edges() {
    let r = bin(BinaryOp::Add, CpuData::I8(vec![127, -128]), &[2], CpuData::I8(vec![1, -1]), &[2]);
    assert_eq!(r, CpuData::I8(vec![-128, 127]));
    let r = bin(BinaryOp::Sub, CpuData::U8(vec![0]), &[1], CpuData::U8(vec![1]), &[1]);
    assert_eq!(r, CpuData::U8(vec![255]));
    let r = bin(BinaryOp::Mul, CpuData::U32(vec![1 << 31]), &[1], CpuData::U32(vec![2]), &[1]);
    assert_eq!(r, CpuData::U32(vec![0]));
    let a = i32s(&[7, -7, 7, -7, 5, i32::MIN]);
    let b = i32s(&[2, 2, -2, -2, 0, -1]);
    assert_eq!(bin(BinaryOp::Div, a.clone(), &[6], b.clone(), &[6]), i32s(&[3, -3, -3, 3, 0, i32::MIN]));
    assert_eq!(bin(BinaryOp::Mod, a.clone(), &[6], b.clone(), &[6]), i32s(&[1, 1, -1, -1, 0, 0]));
    assert_eq!(bin(BinaryOp::Rem, a, &[6], b, &[6]), i32s(&[1, -1, 1, -1, 0, 0]));
    let r = bin(BinaryOp::Pow, i32s(&[2, 2, -1, -1, 1, 0, 3]), &[7], i32s(&[10, -1, -3, -4, -7, 0, 3]), &[7]);
    assert_eq!(r, i32s(&[1024, 0, -1, 1, 1, 1, 27]));
    let r = bin(BinaryOp::Pow, CpuData::I64(vec![3]), &[1], CpuData::I64(vec![40]), &[1]);
    assert_eq!(r, CpuData::I64(vec![3i64.wrapping_pow(40)]));
    let r = bin(BinaryOp::Maximum, CpuData::U16(vec![1, 9]), &[2], CpuData::U16(vec![5, 2]), &[2]);
    assert_eq!(r, CpuData::U16(vec![5, 9]));
    assert_eq!(un(UnaryOp::Neg, CpuData::I8(vec![-128, 5])), CpuData::I8(vec![-128, -5]));
    assert_eq!(un(UnaryOp::Abs, CpuData::I8(vec![-128, -5])), CpuData::I8(vec![-128, 5]));
    assert_eq!(un(UnaryOp::Sign, i32s(&[-4, 0, 9])), i32s(&[-1, 0, 1]));
    assert_eq!(un(UnaryOp::Relu, i32s(&[-4, 0, 9])), i32s(&[0, 0, 9]));
}

#[test]
fn float_binary_nan_and_mod() {
    let nan = f32::NAN;
    let r = bin(BinaryOp::Maximum, f32s(&[nan, 1.0, 3.0]), &[3], f32s(&[1.0, nan, 2.0]), &[3]);
    close(&r, &[f64::NAN, f64::NAN, 3.0], 0.0);
    let r = bin(BinaryOp::Minimum, f32s(&[nan, 1.0, 3.0]), &[3], f32s(&[1.0, nan, 2.0]), &[3]);
    close(&r, &[f64::NAN, f64::NAN, 2.0], 0.0);
    let r = bin(BinaryOp::Mod, f32s(&[-7.0, 7.0, 5.5]), &[3], f32s(&[3.0, -3.0, 2.0]), &[3]);
    close(&r, &[2.0, -2.0, 1.5], 0.0);
    let r = bin(BinaryOp::Rem, f32s(&[-7.0, 7.0]), &[2], f32s(&[3.0, -3.0]), &[2]);
    close(&r, &[-1.0, 1.0], 0.0);
    let r = bin(BinaryOp::Pow, CpuData::F64(vec![2.0, 4.0]), &[2], CpuData::F64(vec![-1.0, 0.5]), &[2]);
    close(&r, &[0.5, 2.0], 0.0);
    let r = bin(BinaryOp::Div, f32s(&[1.0, -1.0, 0.0]), &[3], f32s(&[0.0, 0.0, 0.0]), &[3]);
    close(&r, &[f64::INFINITY, f64::NEG_INFINITY, f64::NAN], 0.0);
    let h = |v: f32| f16::from_f32(v);
    let r = bin(BinaryOp::Add, CpuData::F16(vec![h(1.0)]), &[1], CpuData::F16(vec![h(0.5)]), &[1]);
    assert_eq!(r, CpuData::F16(vec![h(1.5)]));
}

#[test]
fn comparisons_and_logic() {
    let a = f32s(&[1.0, 2.0, f32::NAN]);
    let b = f32s(&[2.0, 2.0, f32::NAN]);
    let cases = [
        (BinaryOp::Eq, [0, 1, 0]),
        (BinaryOp::Ne, [1, 0, 1]),
        (BinaryOp::Lt, [1, 0, 0]),
        (BinaryOp::Le, [1, 1, 0]),
        (BinaryOp::Gt, [0, 0, 0]),
        (BinaryOp::Ge, [0, 1, 0]),
    ];
    for (op, want) in cases {
        assert_eq!(bin(op, a.clone(), &[3], b.clone(), &[3]), bools(&want), "{op:?}");
    }
    assert_eq!(bin(BinaryOp::Lt, i32s(&[-1, 5]), &[2, 1], i32s(&[0]), &[1]), bools(&[1, 0]));
    let p = bools(&[0, 0, 1, 1]);
    let q = bools(&[0, 1, 0, 1]);
    assert_eq!(bin(BinaryOp::And, p.clone(), &[4], q.clone(), &[4]), bools(&[0, 0, 0, 1]));
    assert_eq!(bin(BinaryOp::Or, p.clone(), &[4], q.clone(), &[4]), bools(&[0, 1, 1, 1]));
    assert_eq!(bin(BinaryOp::Xor, p.clone(), &[4], q.clone(), &[4]), bools(&[0, 1, 1, 0]));
    assert_eq!(bin(BinaryOp::Eq, p.clone(), &[4], q, &[4]), bools(&[1, 0, 0, 1]));
    assert_eq!(un(UnaryOp::Not, p), bools(&[1, 1, 0, 0]));
}

#[test]
fn float_unary_functions() {
    use UnaryOp::*;
    let x = [-1.0f64, 0.0, 0.5, 2.0];
    let d = CpuData::F64(x.to_vec());
    let ref_gelu = |v: f64| 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt()));
    type Case = (UnaryOp, fn(f64) -> f64);
    let cases: [Case; 14] = [
        (Exp, f64::exp),
        (Sigmoid, |v| 1.0 / (1.0 + (-v).exp())),
        (Tanh, f64::tanh),
        (Erf, libm::erf),
        (Sin, f64::sin),
        (Cos, f64::cos),
        (Floor, f64::floor),
        (Ceil, f64::ceil),
        (Neg, |v| -v),
        (Abs, f64::abs),
        (Relu, |v| v.max(0.0)),
        (Sign, f64::signum),
        (Gelu, |v| 0.5 * v * (1.0 + libm::erf(v / 2f64.sqrt()))),
        (GeluTanh, |v| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v.powi(3))).tanh())),
    ];
    for (op, f) in cases {
        let want: Vec<f64> = x.iter().map(|&v| if op == Sign && v == 0.0 { 0.0 } else { f(v) }).collect();
        close(&un(op, d.clone()), &want, 1e-15);
    }
    close(&un(Gelu, f32s(&[1.0])), &[0.8413447460685429], 1e-7);
    close(&un(GeluTanh, f32s(&[1.0])), &[0.8411919906082768], 1e-7);
    assert!((ref_gelu(-10.0) - floats(&un(Gelu, CpuData::F64(vec![-10.0])))[0]).abs() < 1e-20);
    close(&un(Log, f32s(&[1.0, 0.0, -1.0])), &[0.0, f64::NEG_INFINITY, f64::NAN], 0.0);
    close(&un(Sqrt, f32s(&[4.0])), &[2.0], 0.0);
    close(&un(Rsqrt, f32s(&[4.0])), &[0.5], 0.0);
    close(&un(Reciprocal, f32s(&[4.0, 0.0])), &[0.25, f64::INFINITY], 0.0);
    close(&un(Round, f32s(&[0.5, 1.5, 2.5, -0.5, -1.5, 2.4])), &[0.0, 2.0, 2.0, -0.0, -2.0, 2.0], 0.0);
    close(&un(Sign, f32s(&[f32::NAN, -3.0, 0.0])), &[f64::NAN, -1.0, 0.0], 0.0);
    assert_eq!(un(IsNan, f32s(&[f32::NAN, 1.0, f32::INFINITY])), bools(&[1, 0, 0]));
    assert_eq!(un(IsInf, f32s(&[f32::NAN, 1.0, f32::NEG_INFINITY])), bools(&[0, 0, 1]));
    let h = CpuData::F16(vec![f16::from_f32(1.0)]);
    close(&un(Exp, h), &[f16::from_f64(std::f64::consts::E).to_f64()], 0.0);
}

/// Every float unary and binary op agrees with the `f64` reference of
/// `lazuli_ir::semantics`: exactly on f64 and wherever f32 is computed in
/// f64 and rounded, within a few ulp on the vectorized f32 fast paths.
#[test]
fn float_ops_follow_the_reference() {
    use lazuli_ir::semantics::{float_binary, float_unary, FloatUnary};
    let xs: Vec<f64> = [-30.0, -3.5, -1.0, -0.25, -0.0, 0.0, 0.5, 1.0, 2.0, 7.25, 40.0, f64::INFINITY, f64::NAN]
        .into_iter()
        .chain((-40..40).map(|k| k as f64 * 0.37))
        .collect();
    let fast = [UnaryOp::Exp, UnaryOp::Tanh, UnaryOp::Sigmoid, UnaryOp::Erf, UnaryOp::Gelu];
    for &op in UnaryOp::ALL {
        let Some(FloatUnary::Map(f)) = float_unary(op) else { continue };
        let want: Vec<f64> = xs.iter().map(|&x| f(x)).collect();
        close(&un(op, CpuData::F64(xs.clone())), &want, 0.0);
        let x32: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
        let want32: Vec<f64> = x32.iter().map(|&x| f(x as f64) as f32 as f64).collect();
        let tol = if fast.contains(&op) { 1e-6 } else { 0.0 };
        close(&un(op, f32s(&x32)), &want32, tol);
    }
    let n = xs.len();
    let ys: Vec<f64> = xs.iter().rev().copied().collect();
    for &op in BinaryOp::ALL {
        let Some(f) = float_binary(op) else { continue };
        let want: Vec<f64> = xs.iter().zip(&ys).map(|(&x, &y)| f(x, y)).collect();
        close(&bin(op, CpuData::F64(xs.clone()), &[n], CpuData::F64(ys.clone()), &[n]), &want, 0.0);
        let (x32, y32): (Vec<f32>, Vec<f32>) = xs.iter().zip(&ys).map(|(&x, &y)| (x as f32, y as f32)).unzip();
        let want32: Vec<f64> = x32.iter().zip(&y32).map(|(&x, &y)| f(x as f64, y as f64) as f32 as f64).collect();
        close(&bin(op, f32s(&x32), &[n], f32s(&y32), &[n]), &want32, 0.0);
    }
}

/// Integer elementwise ops agree with the wrapping `i64` / `u64`
/// reference wherever it defines a result (narrow types wrap like it).
#[test]
fn integer_ops_follow_the_reference() {
    use lazuli_ir::semantics::{int_binary, int_unary, uint_binary, uint_unary};
    let xs: Vec<i32> = vec![i32::MIN, -300, -7, -2, -1, 0, 1, 2, 3, 7, 255, i32::MAX];
    let ys: Vec<i32> = xs.iter().rev().copied().collect();
    let n = xs.len();
    let ints = |d: &CpuData| -> Vec<i64> {
        match d {
            CpuData::I32(v) => v.iter().map(|&x| x as i64).collect(),
            CpuData::U8(v) => v.iter().map(|&x| x as i64).collect(),
            other => panic!("not an integer: {other:?}"),
        }
    };
    for &op in BinaryOp::ALL {
        // Arithmetic ops only (comparisons and logical ops give bools).
        if int_binary(op, 1, 1).is_none() {
            continue;
        }
        let got = ints(&bin(op, i32s(&xs), &[n], i32s(&ys), &[n]));
        let (a, b): (Vec<u8>, Vec<u8>) = xs.iter().zip(&ys).map(|(&x, &y)| (x as u8, y as u8)).unzip();
        let got8 = ints(&bin(op, CpuData::U8(a.clone()), &[n], CpuData::U8(b.clone()), &[n]));
        for k in 0..n {
            if let Some(want) = int_binary(op, xs[k] as i64, ys[k] as i64) {
                assert_eq!(got[k], want as i32 as i64, "{op:?}({}, {})", xs[k], ys[k]);
            }
            if let Some(want) = uint_binary(op, a[k] as u64, b[k] as u64) {
                assert_eq!(got8[k], want as u8 as i64, "u8 {op:?}({}, {})", a[k], b[k]);
            }
        }
    }
    for &op in UnaryOp::ALL {
        if int_unary(op, 1).is_none() {
            continue;
        }
        let got = ints(&un(op, i32s(&xs)));
        for k in 0..n {
            assert_eq!(got[k], int_unary(op, xs[k] as i64).unwrap() as i32 as i64, "{op:?}({})", xs[k]);
        }
        if uint_unary(op, 1).is_some() {
            let a: Vec<u8> = xs.iter().map(|&x| x as u8).collect();
            let got = ints(&un(op, CpuData::U8(a.clone())));
            for k in 0..n {
                assert_eq!(got[k], uint_unary(op, a[k] as u64).unwrap() as u8 as i64, "u8 {op:?}({})", a[k]);
            }
        }
    }
}

#[test]
fn casts() {
    let cast = |d: CpuData, dt: DType| {
        let n = d.len();
        eval(Op::Cast(dt), &[(d, &[n])])
    };
    let x = f32s(&[-2.9, 2.9, 1e20, -1e20, f32::NAN, 0.0]);
    assert_eq!(cast(x.clone(), DType::I32), i32s(&[-2, 2, i32::MAX, i32::MIN, 0, 0]));
    assert_eq!(cast(x.clone(), DType::U8), CpuData::U8(vec![0, 2, 255, 0, 0, 0]));
    assert_eq!(cast(x, DType::Bool), bools(&[1, 1, 1, 1, 1, 0]));
    assert_eq!(cast(bools(&[1, 0]), DType::F32), f32s(&[1.0, 0.0]));
    assert_eq!(cast(CpuData::U8(vec![200]), DType::I8), CpuData::I8(vec![-56]));
    assert_eq!(cast(CpuData::I32(vec![-1]), DType::U64), CpuData::U64(vec![u64::MAX]));
    assert_eq!(cast(i32s(&[0, 7]), DType::Bool), bools(&[0, 1]));
    assert_eq!(cast(f32s(&[1.5]), DType::F16), CpuData::F16(vec![f16::from_f32(1.5)]));
    assert_eq!(cast(CpuData::F16(vec![f16::from_f32(-3.75)]), DType::I16), CpuData::I16(vec![-3]));
    assert_eq!(cast(f32s(&[1.0]), DType::F32), f32s(&[1.0]));
}

#[test]
fn where_broadcasts_three_ways() {
    let r = eval(Op::Where, &[(bools(&[1, 0]), &[2, 1]), (f32s(&[1.0, 2.0, 3.0]), &[3]), (f32s(&[-1.0]), &[])]);
    assert_eq!(r, f32s(&[1.0, 2.0, 3.0, -1.0, -1.0, -1.0]));
    let r = eval(Op::Where, &[(bools(&[1, 0]), &[2]), (i32s(&[1, 2]), &[2]), (i32s(&[3, 4]), &[2])]);
    assert_eq!(r, i32s(&[1, 4]));
}

fn red(op: ReduceOp, d: CpuData, dims: &[usize], axes: &[usize], keepdim: bool) -> CpuData {
    eval(Op::Reduce { op, axes: axes.to_vec(), keepdim }, &[(d, dims)])
}

#[test]
fn reductions() {
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(red(ReduceOp::Sum, x.clone(), &[2, 3], &[1], false), f32s(&[6.0, 15.0]));
    assert_eq!(red(ReduceOp::Sum, x.clone(), &[2, 3], &[0], true), f32s(&[5.0, 7.0, 9.0]));
    assert_eq!(red(ReduceOp::Sum, x.clone(), &[2, 3], &[0, 1], false), f32s(&[21.0]));
    assert_eq!(red(ReduceOp::Mean, x.clone(), &[2, 3], &[1], false), f32s(&[2.0, 5.0]));
    assert_eq!(red(ReduceOp::Max, x.clone(), &[2, 3], &[0], false), f32s(&[4.0, 5.0, 6.0]));
    assert_eq!(red(ReduceOp::Min, x.clone(), &[2, 3], &[1], false), f32s(&[1.0, 4.0]));
    assert_eq!(red(ReduceOp::Prod, x, &[2, 3], &[1], false), f32s(&[6.0, 120.0]));
    // Middle axis of a rank-3 tensor.
    let y = i32s(&(0..12).collect::<Vec<_>>());
    assert_eq!(red(ReduceOp::Sum, y, &[2, 3, 2], &[1], false), i32s(&[6, 9, 24, 27]));
    // Integer wrap-around.
    assert_eq!(red(ReduceOp::Sum, CpuData::U8(vec![200, 100]), &[2], &[0], false), CpuData::U8(vec![44]));
    // NaN propagates through max and min.
    close(&red(ReduceOp::Max, f32s(&[1.0, f32::NAN, 3.0]), &[3], &[0], false), &[f64::NAN], 0.0);
    close(&red(ReduceOp::Min, f32s(&[1.0, f32::NAN, 3.0]), &[3], &[0], false), &[f64::NAN], 0.0);
    // Empty reductions.
    let e = f32s(&[]);
    assert_eq!(red(ReduceOp::Sum, e.clone(), &[0, 2], &[0], false), f32s(&[0.0, 0.0]));
    assert_eq!(red(ReduceOp::Prod, e.clone(), &[0, 2], &[0], false), f32s(&[1.0, 1.0]));
    close(&red(ReduceOp::Mean, e.clone(), &[0, 2], &[0], false), &[f64::NAN, f64::NAN], 0.0);
    close(&red(ReduceOp::Max, e.clone(), &[0, 2], &[0], true), &[f64::NEG_INFINITY; 2], 0.0);
    close(&red(ReduceOp::Min, e.clone(), &[0, 2], &[0], false), &[f64::INFINITY; 2], 0.0);
    assert_eq!(red(ReduceOp::Sum, e, &[2, 0], &[0], false), f32s(&[]));
    assert_eq!(red(ReduceOp::Max, i32s(&[]), &[0], &[0], false), i32s(&[i32::MIN]));
    assert_eq!(red(ReduceOp::Min, CpuData::U8(vec![]), &[0], &[0], false), CpuData::U8(vec![255]));
    // Bool max = any, min = all.
    let b = bools(&[0, 1, 0, 0]);
    assert_eq!(red(ReduceOp::Max, b.clone(), &[2, 2], &[1], false), bools(&[1, 0]));
    assert_eq!(red(ReduceOp::Min, b, &[2, 2], &[1], false), bools(&[0, 0]));
    assert_eq!(red(ReduceOp::Min, bools(&[]), &[0], &[0], false), bools(&[1]));
    // A rank-0 reduction over no axes is the identity.
    assert_eq!(red(ReduceOp::Sum, f32s(&[3.0]), &[], &[], false), f32s(&[3.0]));
}

fn arg(op: ArgReduceOp, d: CpuData, dims: &[usize], axis: usize, select_last: bool) -> CpuData {
    eval(Op::ArgReduce { op, axis, keepdim: false, select_last }, &[(d, dims)])
}

#[test]
fn arg_reductions() {
    let x = f32s(&[1.0, 3.0, 3.0, 0.0, 0.0, 2.0]);
    assert_eq!(arg(ArgReduceOp::ArgMax, x.clone(), &[6], 0, false), i32s(&[1]));
    assert_eq!(arg(ArgReduceOp::ArgMax, x.clone(), &[6], 0, true), i32s(&[2]));
    assert_eq!(arg(ArgReduceOp::ArgMin, x.clone(), &[6], 0, false), i32s(&[3]));
    assert_eq!(arg(ArgReduceOp::ArgMin, x.clone(), &[6], 0, true), i32s(&[4]));
    assert_eq!(arg(ArgReduceOp::ArgMax, x.clone(), &[2, 3], 1, false), i32s(&[1, 2]));
    assert_eq!(arg(ArgReduceOp::ArgMax, x, &[2, 3], 0, false), i32s(&[0, 0, 0]));
    let n = f32s(&[1.0, f32::NAN, 5.0, f32::NAN]);
    assert_eq!(arg(ArgReduceOp::ArgMax, n.clone(), &[4], 0, false), i32s(&[1]));
    assert_eq!(arg(ArgReduceOp::ArgMin, n.clone(), &[4], 0, false), i32s(&[1]));
    assert_eq!(arg(ArgReduceOp::ArgMax, n, &[4], 0, true), i32s(&[3]));
    assert_eq!(arg(ArgReduceOp::ArgMin, CpuData::U8(vec![3, 1, 1]), &[3], 0, false), i32s(&[1]));
    let k = eval(
        Op::ArgReduce { op: ArgReduceOp::ArgMax, axis: 1, keepdim: true, select_last: false },
        &[(i32s(&[1, 5, 9, 2]), &[2, 2])],
    );
    assert_eq!(k, i32s(&[1, 0]));
}

#[test]
fn cumsum_variants() {
    let cs = |d: CpuData, dims: &[usize], axis, exclusive, reverse| {
        eval(Op::CumSum { axis, exclusive, reverse }, &[(d, dims)])
    };
    let x = i32s(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(cs(x.clone(), &[2, 3], 1, false, false), i32s(&[1, 3, 6, 4, 9, 15]));
    assert_eq!(cs(x.clone(), &[2, 3], 1, true, false), i32s(&[0, 1, 3, 0, 4, 9]));
    assert_eq!(cs(x.clone(), &[2, 3], 1, false, true), i32s(&[6, 5, 3, 15, 11, 6]));
    assert_eq!(cs(x.clone(), &[2, 3], 1, true, true), i32s(&[5, 3, 0, 11, 6, 0]));
    assert_eq!(cs(x, &[2, 3], 0, false, false), i32s(&[1, 2, 3, 5, 7, 9]));
    assert_eq!(cs(f32s(&[0.5, 0.25]), &[2], 0, false, false), f32s(&[0.5, 0.75]));
}

#[test]
fn softmax_and_log_softmax() {
    let x = f32s(&[1.0, 2.0, 3.0, 1000.0, 1000.0, 1000.0]);
    let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| v.exp()).collect();
    let s: f64 = e.iter().sum();
    let third = 1.0 / 3.0;
    let r = eval(Op::Softmax { axis: 1, log: false }, &[(x.clone(), &[2, 3])]);
    close(&r, &[e[0] / s, e[1] / s, e[2] / s, third, third, third], 1e-7);
    let r = eval(Op::Softmax { axis: 1, log: true }, &[(x.clone(), &[2, 3])]);
    let l: Vec<f64> = e.iter().map(|v| (v / s).ln()).collect();
    close(&r, &[l[0], l[1], l[2], third.ln(), third.ln(), third.ln()], 1e-6);
    let r = eval(Op::Softmax { axis: 0, log: false }, &[(f32s(&[0.0, 0.0, 0.0, 0.0]), &[2, 2])]);
    close(&r, &[0.5; 4], 0.0);
}

fn naive_matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    c
}

#[test]
fn matmul_all_kinds() {
    let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
    let want = naive_matmul(&a, &b, 2, 3, 2);
    let to32 = |v: &[f64]| f32s(&v.iter().map(|&x| x as f32).collect::<Vec<_>>());
    close(&eval(Op::MatMul, &[(to32(&a), &[2, 3]), (to32(&b), &[3, 2])]), &want, 0.0);
    close(&eval(Op::MatMul, &[(CpuData::F64(a.to_vec()), &[2, 3]), (CpuData::F64(b.to_vec()), &[3, 2])]), &want, 0.0);
    let h = |v: &[f64]| CpuData::F16(v.iter().map(|&x| f16::from_f64(x)).collect());
    close(&eval(Op::MatMul, &[(h(&a), &[2, 3]), (h(&b), &[3, 2])]), &want, 0.0);
    let ai: Vec<i32> = a.iter().map(|&x| x as i32).collect();
    let bi: Vec<i32> = b.iter().map(|&x| x as i32).collect();
    let r = eval(Op::MatMul, &[(i32s(&ai), &[2, 3]), (i32s(&bi), &[3, 2])]);
    assert_eq!(r, i32s(&want.iter().map(|&x| x as i32).collect::<Vec<_>>()));
    // Batch broadcast: [2, 1, 2, 3] @ [3, 3, 2] -> [2, 3, 2, 2].
    let av: Vec<f64> = (0..12).map(|x| x as f64).collect();
    let bv: Vec<f64> = (0..18).map(|x| (x as f64) * 0.5 - 3.0).collect();
    let r = eval(Op::MatMul, &[(to32(&av), &[2, 1, 2, 3]), (to32(&bv), &[3, 3, 2])]);
    let mut want = vec![];
    for i in 0..2 {
        for j in 0..3 {
            want.extend(naive_matmul(&av[i * 6..i * 6 + 6], &bv[j * 6..j * 6 + 6], 2, 3, 2));
        }
    }
    close(&r, &want, 1e-6);
    // k = 0 gives zeros; m = 0 gives an empty result.
    assert_eq!(eval(Op::MatMul, &[(f32s(&[]), &[2, 0]), (f32s(&[]), &[0, 2])]), f32s(&[0.0; 4]));
    assert_eq!(eval(Op::MatMul, &[(f32s(&[]), &[0, 3]), (to32(&b), &[3, 2])]), f32s(&[]));
    // Integer wrap-around.
    let r = eval(Op::MatMul, &[(CpuData::I8(vec![100, 100]), &[1, 2]), (CpuData::I8(vec![2, 1]), &[2, 1])]);
    assert_eq!(r, CpuData::I8(vec![44]));
}

/// Products whose operands are transposes, slices (reversed ones too)
/// and broadcasts of inputs read them in place, with the results of the
/// materialized operands; the transposes make no copy loop.
#[test]
fn products_read_views_of_their_operands_in_place() {
    let vals =
        |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + seed * 13) % 17) as f32 / 4.0 - 2.0).collect() };
    let at = |v: &[f32], cols: usize, r: usize, c: usize| v[r * cols + c] as f64;
    // a^T @ b^T: a [4, 3], b [5, 4] -> [3, 5].
    let (a, b) = (vals(12, 1), vals(20, 2));
    let mut t = T::new();
    let (x, y) = (t.input(f32s(&a), &[4, 3]), t.input(f32s(&b), &[5, 4]));
    let (xt, yt) = (t.op(Op::Permute(vec![1, 0]), &[x]), t.op(Op::Permute(vec![1, 0]), &[y]));
    let o = t.op(Op::MatMul, &[xt, yt]);
    t.g.outputs = vec![o];
    let be = CpuBackend::new();
    let exe = be.compile(&t.g.verify().unwrap()).unwrap();
    assert_eq!(exe.as_any().downcast_ref::<CpuExecutable>().unwrap().fused_loops(), 0, "no copy of a transpose");
    let r = be.execute(exe.as_ref(), t.inputs, &[]).unwrap();
    let want: Vec<f64> = (0..15).map(|e| (0..4).map(|p| at(&a, 3, p, e / 5) * at(&b, 4, e % 5, p)).sum()).collect();
    close(CpuBackend::data(&r[0]).unwrap(), &want, 1e-6);

    // A broadcast batch and a strided slice: a [1, 3, 8] sliced to every
    // other column from 1 ([1, 3, 4]) and broadcast to [2, 3, 4], times
    // b [2, 4, 2].
    let (a, b) = (vals(24, 3), vals(16, 4));
    let mut t = T::new();
    let (x, y) = (t.input(f32s(&a), &[1, 3, 8]), t.input(f32s(&b), &[2, 4, 2]));
    let xs = t.op(Op::Slice { starts: vec![0, 0, 1], steps: vec![1, 1, 2], lens: vec![1, 3, 4] }, &[x]);
    let xe = t.op(Op::Expand(Shape::new([2, 3, 4])), &[xs]);
    let o = t.op(Op::MatMul, &[xe, y]);
    let got = t.run1(o);
    let mut want = vec![];
    for bi in 0..2 {
        for i in 0..3 {
            for j in 0..2 {
                want.push((0..4).map(|p| at(&a, 8, i, 1 + 2 * p) * b[bi * 8 + p * 2 + j] as f64).sum());
            }
        }
    }
    close(&got, &want, 1e-6);

    // A reversed slice (negative strides) takes the copying path, same
    // answer: a [3, 4] with its rows reversed, times b [4, 2], in f64.
    let (a, b) = (vals(12, 5), vals(8, 6));
    let mut t = T::new();
    let f64s = |v: &[f32]| CpuData::F64(v.iter().map(|&x| x as f64).collect());
    let (x, y) = (t.input(f64s(&a), &[3, 4]), t.input(f64s(&b), &[4, 2]));
    let xr = t.op(Op::Slice { starts: vec![2, 0], steps: vec![-1, 1], lens: vec![3, 4] }, &[x]);
    let o = t.op(Op::MatMul, &[xr, y]);
    let got = t.run1(o);
    let want: Vec<f64> = (0..6).map(|e| (0..4).map(|p| at(&a, 4, 2 - e / 2, p) * at(&b, 2, p, e % 2)).sum()).collect();
    close(&got, &want, 1e-12);
}

#[test]
fn views() {
    let x = i32s(&[0, 1, 2, 3, 4, 5]);
    // Reshape shares storage; output is the same elements.
    assert_eq!(eval(Op::Reshape(Shape::new([3, 2])), &[(x.clone(), &[2, 3])]), x);
    assert_eq!(eval(Op::Permute(vec![1, 0]), &[(x.clone(), &[2, 3])]), i32s(&[0, 3, 1, 4, 2, 5]));
    let y = i32s(&(0..24).collect::<Vec<_>>());
    let p = eval(Op::Permute(vec![2, 0, 1]), &[(y, &[2, 3, 4])]);
    let CpuData::I32(pv) = &p else { panic!() };
    assert_eq!(&pv[..6], &[0, 4, 8, 12, 16, 20]);
    assert_eq!(
        eval(Op::Expand(Shape::new([2, 2, 3])), &[(i32s(&[1, 2, 3]), &[1, 3])]),
        i32s(&[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3])
    );
    assert_eq!(eval(Op::Expand(Shape::new([2, 2])), &[(i32s(&[7, 8]), &[2, 1])]), i32s(&[7, 7, 8, 8]));
    let sl = |starts: Vec<i64>, steps: Vec<i64>, lens: Vec<usize>| {
        eval(Op::Slice { starts, steps, lens }, &[(x.clone(), &[2, 3])])
    };
    assert_eq!(sl(vec![0, 2], vec![1, -1], vec![2, 3]), i32s(&[2, 1, 0, 5, 4, 3]));
    assert_eq!(sl(vec![1, 2], vec![-1, -2], vec![2, 2]), i32s(&[5, 3, 2, 0]));
    assert_eq!(sl(vec![1, 0], vec![1, 1], vec![1, 2]), i32s(&[3, 4]));
    assert_eq!(sl(vec![0, 0], vec![1, 1], vec![2, 0]), i32s(&[]));
}

#[test]
fn concat_and_pad() {
    let r =
        eval(Op::Concat { axis: 1 }, &[(i32s(&[1, 2, 3, 4]), &[2, 2]), (i32s(&[5, 6]), &[2, 1]), (i32s(&[]), &[2, 0])]);
    assert_eq!(r, i32s(&[1, 2, 5, 3, 4, 6]));
    let r = eval(Op::Concat { axis: 0 }, &[(bools(&[1]), &[1]), (bools(&[0, 1]), &[2])]);
    assert_eq!(r, bools(&[1, 0, 1]));
    // Constant pad with a value operand.
    let mut t = T::new();
    let x = t.input(i32s(&[1, 2, 3, 4]), &[2, 2]);
    let v = t.op(Op::Constant(ScalarValue::Int(-1), DType::I32), &[]);
    let p = t.op(Op::Pad { before: vec![1, 0], after: vec![0, 1], mode: PadMode::Constant }, &[x, v]);
    assert_eq!(t.run1(p), i32s(&[-1, -1, -1, 1, 2, -1, 3, 4, -1]));
    let pad1 = |mode, b, a| eval(Op::Pad { before: vec![b], after: vec![a], mode }, &[(i32s(&[1, 2, 3]), &[3])]);
    assert_eq!(pad1(PadMode::Reflect, 2, 2), i32s(&[3, 2, 1, 2, 3, 2, 1]));
    assert_eq!(pad1(PadMode::Edge, 2, 1), i32s(&[1, 1, 1, 2, 3, 3]));
    // Constant padding of an empty dim.
    let mut t = T::new();
    let x = t.input(f32s(&[]), &[0]);
    let v = t.scalar(ScalarValue::Float(2.5), DType::F32);
    let p = t.op(Op::Pad { before: vec![1], after: vec![1], mode: PadMode::Constant }, &[x, v]);
    assert_eq!(t.run1(p), f32s(&[2.5, 2.5]));
}

#[test]
fn gather_indices() {
    let x = f32s(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let r = eval(Op::Gather { axis: 0 }, &[(x.clone(), &[3, 2]), (i32s(&[2, -3, -1]), &[3])]);
    assert_eq!(r, f32s(&[4.0, 5.0, 0.0, 1.0, 4.0, 5.0]));
    let r = eval(Op::Gather { axis: 1 }, &[(x.clone(), &[3, 2]), (CpuData::I64(vec![1, 0, 0, 1]), &[2, 2])]);
    assert_eq!(r, f32s(&[1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 2.0, 3.0, 5.0, 4.0, 4.0, 5.0]));
    let r = eval(Op::Gather { axis: 0 }, &[(x.clone(), &[6]), (CpuData::U8(vec![5]), &[])]);
    assert_eq!(r, f32s(&[5.0]));
    for bad in [3i32, -4] {
        let mut t = T::new();
        let d = t.input(x.clone(), &[3, 2]);
        let i = t.input(i32s(&[0, bad]), &[2]);
        let g = t.op(Op::Gather { axis: 0 }, &[d, i]);
        let msg = t.try_run(&[g]).unwrap_err().to_string();
        assert!(msg.contains("gather") && msg.contains(&bad.to_string()) && msg.contains("size 3"), "{msg}");
    }
    let mut t = T::new();
    let d = t.input(x, &[6]);
    let i = t.input(CpuData::U64(vec![u64::MAX]), &[1]);
    let g = t.op(Op::Gather { axis: 0 }, &[d, i]);
    assert!(t.try_run(&[g]).is_err());
}

#[test]
fn scatter_add_indices() {
    // index_add along axis 0 with a repeated and a negative index.
    let base = f32s(&[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    let src = f32s(&[10.0, 20.0, 30.0, 40.0, 50.0, 60.0]);
    let r =
        eval(Op::ScatterAdd { axis: 0 }, &[(base.clone(), &[3, 2]), (i32s(&[2, -1, 0]), &[3]), (src.clone(), &[3, 2])]);
    assert_eq!(r, f32s(&[51.0, 61.0, 1.0, 1.0, 41.0, 61.0]));
    // Along the last axis with 2-d indices, integers wrap.
    let r = eval(
        Op::ScatterAdd { axis: 1 },
        &[
            (i32s(&[0, 0, i32::MAX, 0, 0, 0]), &[2, 3]),
            (CpuData::I64(vec![2, 2, 0, 1]), &[2, 2]),
            (i32s(&[1, 2, 3, 4, 5, 6, 7, 8]), &[2, 2, 2]),
        ],
    );
    assert_eq!(r, i32s(&[3, 4, i32::MAX.wrapping_add(3), 7, 8, 11]));
    // Every index is checked, even when no element moves (inner dim 0).
    for (bad, dims, src_dims) in [(3i32, [3usize, 2], [1usize, 2]), (-4, [3, 0], [1, 0])] {
        let mut t = T::new();
        let b = t.input(f32s(&vec![0.0; dims.iter().product()]), &dims);
        let i = t.input(i32s(&[bad]), &[1]);
        let s = t.input(f32s(&vec![1.0; src_dims.iter().product()]), &src_dims);
        let o = t.op(Op::ScatterAdd { axis: 0 }, &[b, i, s]);
        match t.try_run(&[o]).unwrap_err() {
            BackendError::IndexOutOfRange(e) => {
                assert_eq!((e.op.as_str(), e.index, e.axis, e.size), ("scatter_add", bad as i128, 0, 3));
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn pool_gradients() {
    // 1-d max, k=3 s=1 pad 1: ties go to the first maximum, NaN wins, a
    // -inf window next to the padding picks the -inf, never the padding.
    let x = f32s(&[2.0, 2.0, 1.0, f32::NAN, 0.0, f32::NEG_INFINITY]);
    let g = f32s(&[1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0]);
    let p = pool_attrs(PoolKind::Max, 3, 1, 1, 1, false, 1);
    let r = eval(Op::PoolGrad(p), &[(x, &[1, 1, 6]), (g.clone(), &[1, 1, 6])]);
    // Windows: {pad,2,2}->0, {2,2,1}->0, {2,1,nan}->3, {1,nan,0}->3, {nan,0,-inf}->3, {0,-inf,pad}->4.
    assert_eq!(r, f32s(&[11.0, 0.0, 0.0, 11100.0, 100000.0, 0.0]));
    let x = f32s(&[f32::NEG_INFINITY, f32::NEG_INFINITY]);
    let p = pool_attrs(PoolKind::Max, 2, 2, 1, 1, false, 1);
    let r = eval(Op::PoolGrad(p), &[(x, &[1, 1, 2]), (f32s(&[1.0, 2.0]), &[1, 1, 2])]);
    assert_eq!(r, f32s(&[1.0, 2.0]));
    // Avg with and without the padding in the divisor; ceil mode clips the last window.
    let z = f32s(&[0.0; 5]);
    let g = f32s(&[6.0, 12.0, 18.0]);
    let p = pool_attrs(PoolKind::Avg { count_include_pad: false }, 2, 2, 0, 0, true, 1);
    let r = eval(Op::PoolGrad(p), &[(z.clone(), &[1, 1, 5]), (g.clone(), &[1, 1, 3])]);
    assert_eq!(r, f32s(&[3.0, 3.0, 6.0, 6.0, 18.0]));
    let p = pool_attrs(PoolKind::Avg { count_include_pad: true }, 2, 2, 1, 1, false, 1);
    let r = eval(Op::PoolGrad(p), &[(z, &[1, 1, 5]), (g, &[1, 1, 3])]);
    assert_eq!(r, f32s(&[3.0, 6.0, 6.0, 9.0, 9.0]));
}

/// The definition of conv2d: a direct loop over every output and tap, in
/// f64; also returns the output dims.
pub(crate) fn naive_conv(
    x: &[f64],
    xd: [usize; 4],
    w: &[f64],
    wd: [usize; 4],
    c: &ConvAttrs,
) -> (Vec<f64>, Vec<usize>) {
    let oh = (xd[2] + c.pads[0] + c.pads[2] - c.dilations[0] * (wd[2] - 1) - 1) / c.strides[0] + 1;
    let ow = (xd[3] + c.pads[1] + c.pads[3] - c.dilations[1] * (wd[3] - 1) - 1) / c.strides[1] + 1;
    let mut out = vec![];
    let opg = wd[0] / c.groups;
    for n in 0..xd[0] {
        for o in 0..wd[0] {
            for y in 0..oh {
                for xx in 0..ow {
                    let mut s = 0.0;
                    for cc in 0..wd[1] {
                        let ch = (o / opg) * wd[1] + cc;
                        for i in 0..wd[2] {
                            for j in 0..wd[3] {
                                let iy = (y * c.strides[0] + i * c.dilations[0]) as isize - c.pads[0] as isize;
                                let ix = (xx * c.strides[1] + j * c.dilations[1]) as isize - c.pads[1] as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < xd[2] && (ix as usize) < xd[3] {
                                    s += x[((n * xd[1] + ch) * xd[2] + iy as usize) * xd[3] + ix as usize]
                                        * w[((o * wd[1] + cc) * wd[2] + i) * wd[3] + j];
                                }
                            }
                        }
                    }
                    out.push(s);
                }
            }
        }
    }
    (out, vec![xd[0], wd[0], oh, ow])
}

#[test]
fn conv2d_cases() {
    // Hand-computed: 3x3 input, 2x2 ones kernel.
    let c = ConvAttrs { strides: [1, 1], pads: [0, 0, 0, 0], dilations: [1, 1], groups: 1 };
    let x = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    let r = eval(Op::Conv2d(c), &[(x, &[1, 1, 3, 3]), (f32s(&[1.0; 4]), &[1, 1, 2, 2])]);
    assert_eq!(r, f32s(&[12.0, 16.0, 24.0, 28.0]));
    let configs = [
        (ConvAttrs { strides: [2, 1], pads: [1, 0, 1, 2], dilations: [1, 1], groups: 1 }, [2, 2, 5, 4], [3, 2, 3, 2]),
        (ConvAttrs { strides: [1, 2], pads: [2, 1, 0, 1], dilations: [2, 1], groups: 2 }, [1, 4, 6, 5], [4, 2, 2, 3]),
        (ConvAttrs { strides: [1, 1], pads: [0, 0, 0, 0], dilations: [1, 1], groups: 3 }, [1, 3, 2, 2], [3, 1, 1, 1]),
    ];
    for (c, xd, wd) in configs {
        let xv: Vec<f64> = (0..xd.iter().product::<usize>()).map(|i| ((i * 7) % 11) as f64 - 5.0).collect();
        let wv: Vec<f64> = (0..wd.iter().product::<usize>()).map(|i| ((i * 5) % 7) as f64 * 0.25 - 0.5).collect();
        let (want, od) = naive_conv(&xv, xd, &wv, wd, &c);
        let r = eval(Op::Conv2d(c.clone()), &[(CpuData::F64(xv.clone()), &xd), (CpuData::F64(wv.clone()), &wd)]);
        close(&r, &want, 1e-12);
        let mut t = T::new();
        let a = t.input(f32s(&xv.iter().map(|&v| v as f32).collect::<Vec<_>>()), &xd);
        let b = t.input(f32s(&wv.iter().map(|&v| v as f32).collect::<Vec<_>>()), &wd);
        let o = t.op(Op::Conv2d(c), &[a, b]);
        assert_eq!(t.g.node(o).shape.dims(), &od[..]);
        close(&t.run1(o), &want, 1e-6);
    }
}

fn pool_attrs(kind: PoolKind, k: usize, s: usize, pb: usize, pe: usize, ceil: bool, nsp: usize) -> PoolAttrs {
    PoolAttrs {
        kind,
        kernel: vec![k; nsp],
        strides: vec![s; nsp],
        pads_begin: vec![pb; nsp],
        pads_end: vec![pe; nsp],
        dilations: vec![1; nsp],
        ceil_mode: ceil,
    }
}

#[test]
fn pooling() {
    let x = f32s(&[-1.0, -2.0, -3.0, -4.0]);
    // Max pool with padding: padding never wins even when all values are negative.
    let p = pool_attrs(PoolKind::Max, 2, 1, 1, 1, false, 2);
    let r = eval(Op::Pool(p), &[(x.clone(), &[1, 1, 2, 2])]);
    assert_eq!(r, f32s(&[-1.0, -1.0, -2.0, -1.0, -1.0, -2.0, -3.0, -3.0, -4.0]));
    // Average with and without the padding in the divisor.
    let y = f32s(&[1.0, 2.0, 3.0, 4.0]);
    let p = pool_attrs(PoolKind::Avg { count_include_pad: true }, 2, 2, 1, 1, false, 2);
    assert_eq!(eval(Op::Pool(p), &[(y.clone(), &[1, 1, 2, 2])]), f32s(&[0.25, 0.5, 0.75, 1.0]));
    let p = pool_attrs(PoolKind::Avg { count_include_pad: false }, 2, 2, 1, 1, false, 2);
    assert_eq!(eval(Op::Pool(p), &[(y.clone(), &[1, 1, 2, 2])]), f32s(&[1.0, 2.0, 3.0, 4.0]));
    // 1-d, ceil mode: [1..5] k=2 s=2 -> windows {1,2} {3,4} {5}.
    let z = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    let p = pool_attrs(PoolKind::Avg { count_include_pad: false }, 2, 2, 0, 0, true, 1);
    assert_eq!(eval(Op::Pool(p), &[(z.clone(), &[1, 1, 5])]), f32s(&[1.5, 3.5, 5.0]));
    let p = pool_attrs(PoolKind::Avg { count_include_pad: true }, 2, 2, 0, 0, true, 1);
    // The last window is clipped at the input end: it has one tap in range.
    assert_eq!(eval(Op::Pool(p), &[(z.clone(), &[1, 1, 5])]), f32s(&[1.5, 3.5, 5.0]));
    let p = pool_attrs(PoolKind::Max, 2, 2, 0, 0, false, 1);
    assert_eq!(eval(Op::Pool(p), &[(z, &[1, 1, 5])]), f32s(&[2.0, 4.0]));
    // Integer max pool over two channels; dilation 2.
    let mut p = pool_attrs(PoolKind::Max, 2, 1, 0, 0, false, 1);
    p.dilations = vec![2];
    let r = eval(Op::Pool(p), &[(i32s(&[1, 9, 3, 4, 0, 2]), &[1, 2, 3])]);
    assert_eq!(r, i32s(&[3, 4]));
    // NaN propagates through max.
    let p = pool_attrs(PoolKind::Max, 2, 2, 0, 0, false, 1);
    close(&eval(Op::Pool(p), &[(f32s(&[f32::NAN, 1.0]), &[1, 1, 2])]), &[f64::NAN], 0.0);
}

#[test]
fn leaves_iota_constant_scalar_random() {
    let mut t = T::new();
    let a = t.op(Op::Iota { shape: Shape::new([2, 3]), axis: 1, dtype: DType::F32 }, &[]);
    let b = t.op(Op::Iota { shape: Shape::new([2, 3]), axis: 0, dtype: DType::I64 }, &[]);
    let c = t.op(Op::Constant(ScalarValue::Float(-1.0), DType::F16), &[]);
    let d = t.scalar(ScalarValue::Float(0.37), DType::F32);
    let e = t.scalar(ScalarValue::Int(-3), DType::I8);
    let out = t.try_run(&[a, b, c, d, e]).unwrap();
    assert_eq!(out[0], f32s(&[0.0, 1.0, 2.0, 0.0, 1.0, 2.0]));
    assert_eq!(out[1], CpuData::I64(vec![0, 0, 0, 1, 1, 1]));
    assert_eq!(out[2], CpuData::F16(vec![f16::from_f32(-1.0)]));
    assert_eq!(out[3], f32s(&[0.37]));
    assert_eq!(out[4], CpuData::I8(vec![-3]));

    let mut t = T::new();
    let seed = t.scalar(ScalarValue::UInt(42), DType::U32);
    let step = t.op(Op::Constant(ScalarValue::UInt(7), DType::U32), &[]);
    let u = t.op(Op::Random { shape: Shape::new([3, 3]), dist: RandomDist::Uniform }, &[seed, step]);
    let n = t.op(Op::Random { shape: Shape::new([5]), dist: RandomDist::Normal }, &[seed, step]);
    let out = t.try_run(&[u, n]).unwrap();
    let want_u: Vec<f32> = (0..9).map(|i| lazuli_ir::philox::uniform_f32(42, 7, i)).collect();
    let want_n: Vec<f32> = (0..5).map(|i| lazuli_ir::philox::normal_f32(42, 7, i)).collect();
    assert_eq!(out[0], CpuData::F32(want_u));
    assert_eq!(out[1], CpuData::F32(want_n));
}

#[test]
fn chained_graph_frees_and_shares() {
    // ((x + 1) reshaped, transposed) summed, with x also an output.
    let mut t = T::new();
    let x = t.input(f32s(&[1.0, 2.0, 3.0, 4.0]), &[4]);
    let one = t.op(Op::Constant(ScalarValue::Float(1.0), DType::F32), &[]);
    let y = t.op(Op::Binary(BinaryOp::Add), &[x, one]);
    let r = t.op(Op::Reshape(Shape::new([2, 2])), &[y]);
    let p = t.op(Op::Permute(vec![1, 0]), &[r]);
    let s = t.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[p]);
    let out = t.try_run(&[s, x, r, s]).unwrap();
    assert_eq!(out[0], f32s(&[6.0, 8.0]));
    assert_eq!(out[1], f32s(&[1.0, 2.0, 3.0, 4.0]));
    assert_eq!(out[2], f32s(&[2.0, 3.0, 4.0, 5.0]));
    assert_eq!(out[3], out[0]);
}

#[test]
fn large_tensors_run_quickly() {
    let n = 1 << 20;
    let mut t = T::new();
    let x = t.input(f32s(&vec![1.0; n]), &[1024, 1024]);
    let y = t.input(f32s(&vec![2.0; 1024]), &[1024]);
    let z = t.op(Op::Binary(BinaryOp::Mul), &[x, y]);
    let e = t.op(Op::Unary(UnaryOp::Exp), &[z]);
    let p = t.op(Op::Permute(vec![1, 0]), &[e]);
    let s = t.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1], keepdim: false }, &[p]);
    let m = t.op(Op::MatMul, &[x, x]);
    let ms = t.op(Op::Reduce { op: ReduceOp::Max, axes: vec![0, 1], keepdim: false }, &[m]);
    let img = t.op(Op::Reshape(Shape::new([4, 16, 128, 128])), &[e]);
    let w = t.input(f32s(&vec![0.5; 16 * 16 * 9]), &[16, 16, 3, 3]);
    let c = ConvAttrs { strides: [1, 1], pads: [1, 1, 1, 1], dilations: [1, 1], groups: 1 };
    let conv = t.op(Op::Conv2d(c), &[img, w]);
    let pool = t.op(Op::Pool(pool_attrs(PoolKind::Max, 3, 2, 1, 1, false, 2)), &[conv]);
    let pm = t.op(Op::Reduce { op: ReduceOp::Min, axes: vec![0, 1, 2, 3], keepdim: false }, &[pool]);
    let start = std::time::Instant::now();
    let out = t.try_run(&[s, ms, pm]).unwrap();
    close(&out[0], &[(n as f64) * 2f64.exp()], 1e-6);
    assert_eq!(out[1], f32s(&[1024.0]));
    // Every pooled window reaches an interior conv output (9 taps of 16 channels).
    close(&out[2], &[16.0 * 9.0 * 0.5 * 2f64.exp()], 1e-6);
    assert!(start.elapsed().as_secs_f64() < 30.0, "{:?}", start.elapsed());
}

#[test]
fn large_fused_loop_streams_exact_outputs() {
    // Two outputs of a chain, one read again after it is written: large
    // enough for the parallel, streaming-store path, with an odd length so
    // the parts and blocks end unevenly.
    let n = (1 << 22) + 37;
    let xs: Vec<f32> = (0..n).map(|i| ((i * 7919) % 4001) as f32 * 5e-4 - 1.0).collect();
    let mut t = T::new();
    let x = t.input(f32s(&xs), &[n]);
    let a = t.op(Op::Constant(ScalarValue::Float(1.5), DType::F32), &[]);
    let b = t.op(Op::Constant(ScalarValue::Float(0.5), DType::F32), &[]);
    let xa = t.op(Op::Binary(BinaryOp::Mul), &[x, a]);
    let y = t.op(Op::Binary(BinaryOp::Add), &[xa, b]);
    let z = t.op(Op::Unary(UnaryOp::Tanh), &[y]);
    let out = t.try_run(&[y, z]).unwrap();
    let ys: Vec<f32> = xs.iter().map(|&v| v * 1.5 + 0.5).collect();
    let mut zs = vec![0.0f32; n];
    crate::fastmath::tanh(&ys, &mut zs);
    assert!(out[0] == f32s(&ys), "first output differs");
    assert!(out[1] == f32s(&zs), "second output differs");
}

#[test]
fn streaming_copy_any_alignment() {
    let src: Vec<u8> = (0..300u32).map(|i| (i * 31 % 251) as u8).collect();
    for off in 0..20 {
        for len in [0, 1, 15, 16, 17, 100, 255] {
            let mut dst = vec![0u8; 300];
            crate::stream::copy(&src[off..off + len], &mut dst[off..off + len]);
            crate::stream::fence();
            assert_eq!(&dst[off..off + len], &src[off..off + len]);
            assert!(dst[..off].iter().chain(&dst[off + len..]).all(|&b| b == 0));
        }
    }
}

#[test]
fn large_matmuls_match_naive() {
    // Sizes past the parallel threshold: one product split inside the
    // GEMM, and a batch split by product; f32, f64 and i32.
    let (m, k, n) = (67, 301, 129);
    let av: Vec<f64> = (0..2 * m * k).map(|i| ((i * 37) % 17) as f64 * 0.25 - 2.0).collect();
    let bv: Vec<f64> = (0..2 * k * n).map(|i| ((i * 11) % 13) as f64 * 0.5 - 3.0).collect();
    let mut want = naive_matmul(&av[..m * k], &bv[..k * n], m, k, n);
    want.extend(naive_matmul(&av[m * k..], &bv[k * n..], m, k, n));
    let to32 = |v: &[f64]| f32s(&v.iter().map(|&x| x as f32).collect::<Vec<_>>());
    for batch in [1, 2] {
        let (sa, sb) = ([batch, m, k], [batch, k, n]);
        let (a, b) = (&av[..batch * m * k], &bv[..batch * k * n]);
        let w = &want[..batch * m * n];
        // Quarter-integer inputs: every partial sum is exact in f32 too.
        close(&eval(Op::MatMul, &[(to32(a), &sa), (to32(b), &sb)]), w, 0.0);
        close(&eval(Op::MatMul, &[(CpuData::F64(a.to_vec()), &sa), (CpuData::F64(b.to_vec()), &sb)]), w, 0.0);
        let ai: Vec<i32> = a.iter().map(|&x| (x * 4.0) as i32).collect();
        let bi: Vec<i32> = b.iter().map(|&x| (x * 2.0) as i32).collect();
        let r = eval(Op::MatMul, &[(i32s(&ai), &sa), (i32s(&bi), &sb)]);
        assert_eq!(r, i32s(&w.iter().map(|&x| (x * 8.0) as i32).collect::<Vec<_>>()));
    }
}

/// Every kind of kernel allocates its output (and its scratch copies and
/// offset tables) from the backend's memory: over the budget each is a
/// typed out-of-memory error, and the run's values are freed after it.
#[test]
fn every_kernel_allocates_within_the_memory_budget() {
    const BUDGET: u64 = 64 << 10;
    let be = CpuBackend::with_options(CpuOptions { memory_budget: Some(BUDGET), ..CpuOptions::default() });
    assert_eq!(be.memory_budget(), BUDGET);
    // 2^15 f32 = 128 KiB: twice the budget. Inputs wrapped by
    // `CpuBackend::buffer` are counted nowhere, so only what the kernels
    // allocate meets the budget.
    let big = 1usize << 15;
    let ramp = |n: usize| f32s(&(0..n).map(|i| i as f32).collect::<Vec<_>>());
    type Build = fn(&mut T, usize, &dyn Fn(usize) -> CpuData) -> NodeId;
    let cases: [(&str, Build); 12] = [
        ("random", |t, n, _| {
            let seed = t.scalar(ScalarValue::UInt(1), DType::U32);
            t.op(Op::Random { shape: Shape::new([n]), dist: RandomDist::Uniform }, &[seed, seed])
        }),
        ("iota", |t, n, _| t.op(Op::Iota { shape: Shape::new([n]), axis: 0, dtype: DType::I32 }, &[])),
        ("fused expand", |t, n, r| {
            let x = t.input(r(1), &[1]);
            let e = t.op(Op::Expand(Shape::new([n])), &[x]);
            t.op(Op::Unary(UnaryOp::Exp), &[e])
        }),
        ("matmul", |t, n, r| {
            let (a, b) = (t.input(r(256), &[256, 1]), t.input(r(n / 256), &[1, n / 256]));
            t.op(Op::MatMul, &[a, b])
        }),
        ("concat", |t, n, r| {
            let x = t.input(r(n / 2), &[n / 2]);
            t.op(Op::Concat { axis: 0 }, &[x, x])
        }),
        ("pad", |t, n, r| {
            let x = t.input(r(4), &[4]);
            t.op(Op::Pad { before: vec![0], after: vec![n], mode: PadMode::Edge }, &[x])
        }),
        ("gather", |t, n, r| {
            let x = t.input(r(4), &[4]);
            let i = t.input(i32s(&vec![1; n]), &[n]);
            t.op(Op::Gather { axis: 0 }, &[x, i])
        }),
        ("cumsum", |t, n, r| {
            let x = t.input(r(n), &[n]);
            t.op(Op::CumSum { axis: 0, exclusive: false, reverse: false }, &[x])
        }),
        ("softmax", |t, n, r| {
            let x = t.input(r(n), &[n / 64, 64]);
            t.op(Op::Softmax { axis: 1, log: false }, &[x])
        }),
        ("reduce (scratch transpose)", |t, n, r| {
            let x = t.input(r(n), &[n / 64, 64]);
            t.op(Op::Reduce { op: ReduceOp::Max, axes: vec![0], keepdim: false }, &[x])
        }),
        ("slice", |t, n, r| {
            let x = t.input(r(n), &[n]);
            t.op(Op::Slice { starts: vec![n as i64 - 1], steps: vec![-1], lens: vec![n] }, &[x])
        }),
        ("conv2d", |t, n, r| {
            let x = t.input(r(n), &[1, 1, n / 128, 128]);
            let w = t.input(r(1), &[1, 1, 1, 1]);
            let c = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], groups: 1 };
            t.op(Op::Conv2d(c), &[x, w])
        }),
    ];
    for (name, build) in cases {
        let mut t = T::new();
        let out = build(&mut t, big, &ramp);
        t.g.outputs = vec![out];
        let exe = be.compile(&t.g.verify().unwrap()).unwrap();
        let e = be.execute(exe.as_ref(), t.inputs, &t.scalars).unwrap_err();
        let BackendError::OutOfMemory { bytes, in_use, device } = &e else { panic!("{name}: {e:?}") };
        assert!(*bytes + *in_use > BUDGET, "{name}: {e}");
        assert_eq!(device, "cpu with a memory budget of 65536 bytes", "{name}");
        assert_eq!(be.bytes_in_use(), 0, "{name}: the run's values are freed");
        // The same graph at a size that fits runs.
        let mut t = T::new();
        let out = build(&mut t, big / 16, &ramp);
        t.g.outputs = vec![out];
        let exe = be.compile(&t.g.verify().unwrap()).unwrap();
        let outs = be.execute(exe.as_ref(), t.inputs, &t.scalars).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(be.bytes_in_use() > 0, "{name}: the output is in use");
        drop(outs);
        assert_eq!(be.bytes_in_use(), 0, "{name}");
    }
    assert!(be.peak_bytes_in_use() <= BUDGET);
}

/// bf16 bit patterns of a cast from f32 bit patterns.
fn bf16_bits_of(f32_bits: &[u32]) -> Vec<u16> {
    let x = f32s(&f32_bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>());
    let n = x.len();
    match eval(Op::Cast(DType::BF16), &[(x, &[n])]) {
        CpuData::BF16(v) => v.iter().map(|h| h.to_bits()).collect(),
        other => panic!("cast to bf16 gave {other:?}"),
    }
}

/// f32 -> bf16 rounds to nearest, ties to even, as PyTorch's `.to(bfloat16)`:
/// ties, just-above-ties, NaN (a payload only in the low bits stays NaN,
/// never becomes inf), infinities, overflow to inf, subnormals, signs.
#[test]
fn bf16_cast_rounds_to_nearest_even() {
    let cases: [(u32, u16); 14] = [
        (0x3F80_0000, 0x3F80), // 1.0 exact
        (0x3F80_8000, 0x3F80), // 1 + 2^-8: tie, even stays down
        (0x3F81_8000, 0x3F82), // tie with an odd mantissa rounds up
        (0x3F80_8001, 0x3F81), // just above the tie rounds up
        (0x3F80_7FFF, 0x3F80), // just below the tie rounds down
        (0xBF80_8000, 0xBF80), // negative tie
        (0x7F80_0000, 0x7F80), // +inf
        (0xFF80_0000, 0xFF80), // -inf
        (0x7F7F_FFFF, 0x7F80), // f32::MAX rounds up to inf
        (0x0001_8000, 0x0002), // subnormal tie, odd: up
        (0x0000_8000, 0x0000), // subnormal tie, even: down to +0
        (0x8000_0000, 0x8000), // -0 keeps its sign
        (0x007F_FFFF, 0x0080), // largest f32 subnormal rounds to the smallest bf16 normal
        (0x0000_0001, 0x0000), // the smallest f32 subnormal flushes to +0 by rounding
    ];
    let got = bf16_bits_of(&cases.map(|c| c.0));
    for ((from, want), got) in cases.iter().zip(&got) {
        assert_eq!(*got, *want, "f32 bits {from:#010x}: got {got:#06x}, want {want:#06x}");
    }
    // NaNs stay NaN whatever their payload, with their sign.
    let nans = bf16_bits_of(&[0x7FC0_0000, 0x7F80_0001, 0xFF80_0001, 0x7FFF_FFFF]);
    for (i, b) in nans.iter().enumerate() {
        assert!(bf16::from_bits(*b).is_nan(), "NaN {i} became {b:#06x}");
    }
    assert_eq!(nans[2] & 0x8000, 0x8000, "the sign of a NaN survives");
    // bf16 -> f32 is exact (a shift).
    let back = eval(Op::Cast(DType::F32), &[(CpuData::BF16(vec![bf16::from_bits(0x3F81)]), &[1])]);
    assert_eq!(back, f32s(&[f32::from_bits(0x3F81_0000)]));
}

/// bf16 arithmetic computes in f32 and rounds once on store; reductions and
/// matmul accumulate in f32 or wider, so 512 products of 2^-8 sum to 2
/// (a bf16 accumulator would stall at 1).
#[test]
fn bf16_computes_in_f32_and_accumulates_wide() {
    let b = |v: &[f32]| CpuData::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect());
    let r = bin(BinaryOp::Add, b(&[1.0, 1.0, 3.0]), &[3], b(&[2f32.powi(-8), 3.0 * 2f32.powi(-8), 0.5]), &[3]);
    assert_eq!(r, b(&[1.0, 1.0 + 2f32.powi(-6), 3.5]));
    let r = bin(BinaryOp::Mul, b(&[3.0]), &[1], b(&[1.0 / 3.0]), &[1]);
    assert_eq!(r, CpuData::BF16(vec![bf16::from_f32(3.0 * bf16::from_f32(1.0 / 3.0).to_f32())]));
    let k = 512;
    let ones = b(&vec![1.0; k]);
    let small = b(&vec![2f32.powi(-8); k]);
    close(&eval(Op::MatMul, &[(ones, &[1, k]), (small.clone(), &[k, 1])]), &[2.0], 0.0);
    let sum = eval(Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdim: false }, &[(small, &[k])]);
    close(&sum, &[2.0], 0.0);
    // Exp rounds the f64 reference once.
    let r = un(UnaryOp::Exp, b(&[1.0]));
    close(&r, &[lazuli_ir::bf16_from_f64(std::f64::consts::E).to_f64()], 0.0);
}

/// `LAZULI_CPU_THREADS` sets the thread count unless code does; a
/// malformed value is the error; the pool never has more threads than
/// the host has cores.
#[test]
fn the_thread_count_comes_from_code_the_environment_or_the_cores() {
    use lazuli_executor::config::Source;
    let env = |v: &'static str| move |name: &str| (name == "LAZULI_CPU_THREADS").then(|| v.to_string());
    let (o, s) = CpuOptions::default().resolve(&env("3")).unwrap();
    assert_eq!((o.threads, s.threads), (Some(3), Source::Environment));
    let (o, s) = CpuOptions { threads: Some(1), ..CpuOptions::default() }.resolve(&env("3")).unwrap();
    assert_eq!((o.threads, s.threads), (Some(1), Source::Code));
    let e = CpuOptions::default().resolve(&env("many")).unwrap_err();
    assert_eq!(e.variable, "LAZULI_CPU_THREADS");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let one = CpuBackend::with_options(CpuOptions { threads: Some(1), ..CpuOptions::default() });
    let many = CpuBackend::with_options(CpuOptions { threads: Some(cores + 5), ..CpuOptions::default() });
    assert_eq!((one.threads(), many.threads()), (1, cores));
}

/// While profiling, every step of an execution is a launch with its name,
/// FLOPs, bytes, wall time, CPU time and threads; the executable's
/// `launch_costs` name the same steps; nothing is collected once off.
#[test]
fn profiling_collects_every_step_with_its_cost() {
    let mut t = T::new();
    let x = t.input(f32s(&[1.0; 12]), &[3, 4]);
    let w = t.input(f32s(&[0.5; 8]), &[4, 2]);
    let y = t.op(Op::MatMul, &[x, w]);
    let z = t.op(Op::Unary(UnaryOp::Tanh), &[y]);
    t.g.outputs = vec![z];
    let be = CpuBackend::new();
    let exe = be.compile(&t.g.verify().unwrap()).unwrap();
    let names: Vec<String> = exe.launch_costs().into_iter().map(|c| c.name).collect();
    assert_eq!(names, ["k0_matmul", "k1_fused_tanh"]);
    assert!(be.set_profiling(true), "the CPU backend times every launch");
    be.execute(exe.as_ref(), t.inputs.clone(), &[]).unwrap();
    let samples = be.take_profile();
    assert_eq!(samples.iter().map(|s| s.cost.name.as_str()).collect::<Vec<_>>(), names);
    // [3, 4] @ [4, 2]: 2 * 3 * 2 * 4 FLOPs; 48 + 32 bytes read, 24 written.
    assert_eq!((samples[0].cost.flops, samples[0].cost.bytes), (48, 104));
    assert_eq!((samples[1].cost.flops, samples[1].cost.bytes), (6, 48));
    assert!(samples.iter().all(|s| s.ms.is_some_and(|ms| ms >= 0.0) && s.threads == Some(1)));
    assert!(samples.iter().all(|s| s.cpu_ms.is_some() == cfg!(unix)));
    be.set_profiling(false);
    be.execute(exe.as_ref(), t.inputs, &[]).unwrap();
    assert!(be.take_profile().is_empty());
}
