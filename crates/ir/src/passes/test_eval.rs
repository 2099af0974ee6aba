//! A tiny test-only evaluator, so pass tests can show that a rewritten
//! graph computes exactly what the original did.
//!
//! Values are plain `Vec<f64>` in row-major order with numpy broadcasting.
//! Floats are rounded to their dtype after every op; integers are computed
//! in `i128` and wrapped to their width, independently of the folding
//! code; bools are 0 or 1. It covers the leaves, the elementwise ops and
//! the views that the pass tests use, and panics on anything else.

use crate::{BinaryOp, DType, Graph, Op, UnaryOp, ValueType};

/// A dense value: shape and row-major elements.
#[derive(Clone, Debug)]
pub(crate) struct Value {
    shape: Vec<usize>,
    data: Vec<f64>,
}

/// Number of nodes whose op satisfies `pred`.
pub(crate) fn count_ops(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.nodes().iter().filter(|n| pred(&n.op)).count()
}

/// Evaluates `a` and `b` (which share their parameter and scalar tables)
/// on several pseudo-random inputs, including inf, NaN, -0.0 and integer
/// extremes, and asserts that every output is bit-for-bit the same.
pub(crate) fn assert_same_results(a: &Graph, b: &Graph) {
    if let Err(msg) = same_results(a, b) {
        panic!("{msg}\nbefore:\n{}after:\n{}", a.to_text(), b.to_text());
    }
}

/// The comparison behind [`assert_same_results`]: `Err` describes the
/// first output that differs.
pub(crate) fn same_results(a: &Graph, b: &Graph) -> Result<(), String> {
    assert_eq!(a.params, b.params, "parameter tables differ");
    assert_eq!(a.scalars, b.scalars, "scalar tables differ");
    assert_eq!(a.outputs.len(), b.outputs.len(), "output counts differ");
    for seed in 1..=4u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let params: Vec<Value> = a.params.iter().map(|t| random_value(t, seed, &mut rng)).collect();
        let scalars: Vec<f64> =
            a.scalars.iter().map(|&d| random_value(&ValueType::new([], d), seed, &mut rng).data[0]).collect();
        let ra = eval(a, &params, &scalars);
        let rb = eval(b, &params, &scalars);
        for (k, (x, y)) in ra.iter().zip(&rb).enumerate() {
            if x.shape != y.shape {
                return Err(format!("output {k}: shapes {:?} and {:?} differ", x.shape, y.shape));
            }
            let same =
                x.data.iter().zip(&y.data).all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
            if !same {
                return Err(format!("output {k} differs (seed {seed}):\n{:?}\n{:?}", x.data, y.data));
            }
        }
    }
    Ok(())
}

/// Evaluates every output of `g`.
pub(crate) fn eval(g: &Graph, params: &[Value], scalars: &[f64]) -> Vec<Value> {
    let mut vals: Vec<Value> = Vec::with_capacity(g.len());
    for n in g.nodes() {
        let args: Vec<&Value> = n.inputs.iter().map(|i| &vals[i.index()]).collect();
        let in_dtype = n.inputs.first().map(|i| g.node(*i).dtype);
        let shape = n.shape.dims().to_vec();
        let numel = n.shape.numel();
        let data: Vec<f64> = match &n.op {
            Op::Parameter(i) => params[*i as usize].data.clone(),
            Op::ScalarParam(i) => vec![scalars[*i as usize]],
            Op::Constant(v, d) => vec![v.cast(*d).as_f64()],
            Op::Unary(u) => args[0].data.iter().map(|&x| unary(*u, x, n.dtype)).collect(),
            Op::Binary(b) => {
                let d = in_dtype.unwrap();
                (0..numel)
                    .map(|k| {
                        let p = args[0].data[bcast(&shape, &args[0].shape, k)];
                        let q = args[1].data[bcast(&shape, &args[1].shape, k)];
                        binary(*b, p, q, d)
                    })
                    .collect()
            }
            Op::Where => (0..numel)
                .map(|k| {
                    let c = args[0].data[bcast(&shape, &args[0].shape, k)];
                    let arg = if c != 0.0 { args[1] } else { args[2] };
                    arg.data[bcast(&shape, &arg.shape, k)]
                })
                .collect(),
            Op::Cast(to) => args[0].data.iter().map(|&x| cast(x, in_dtype.unwrap(), *to)).collect(),
            Op::Reshape(_) => args[0].data.clone(),
            Op::Expand(_) => (0..numel).map(|k| args[0].data[bcast(&shape, &args[0].shape, k)]).collect(),
            Op::Permute(perm) => {
                let in_strides = strides(&args[0].shape);
                (0..numel)
                    .map(|k| {
                        let idx = unravel(&shape, k);
                        let src: usize = perm.iter().enumerate().map(|(i, &p)| idx[i] * in_strides[p]).sum();
                        args[0].data[src]
                    })
                    .collect()
            }
            Op::Slice { starts, steps, .. } => {
                let in_strides = strides(&args[0].shape);
                (0..numel)
                    .map(|k| {
                        let idx = unravel(&shape, k);
                        let src: i64 =
                            (0..idx.len()).map(|d| (starts[d] + idx[d] as i64 * steps[d]) * in_strides[d] as i64).sum();
                        args[0].data[src as usize]
                    })
                    .collect()
            }
            Op::ScatterAdd { axis } => {
                let (base, idx, src) = (args[0], args[1], args[2]);
                let len = base.shape[*axis];
                let inner: usize = base.shape[axis + 1..].iter().product();
                let outer: usize = base.shape[..*axis].iter().product();
                let m = idx.data.len();
                let mut out = base.data.clone();
                for o in 0..outer {
                    for (j, &i) in idx.data.iter().enumerate() {
                        let r = if i < 0.0 { i + len as f64 } else { i };
                        assert!(r >= 0.0 && r < len as f64, "test evaluator: scatter_add index {i} out of range");
                        for c in 0..inner {
                            let at = (o * len + r as usize) * inner + c;
                            out[at] = fit(n.dtype, out[at] + src.data[(o * m + j) * inner + c]);
                        }
                    }
                }
                out
            }
            other => panic!("test evaluator does not support {other:?}"),
        };
        assert_eq!(data.len(), numel, "{} produced the wrong element count", n.op.name());
        vals.push(Value { shape, data });
    }
    g.outputs.iter().map(|o| vals[o.index()].clone()).collect()
}

/// Rounds a float to `d` or wraps an integer to `d`'s width.
fn fit(d: DType, v: f64) -> f64 {
    match d {
        DType::F32 => v as f32 as f64,
        DType::F16 => crate::f16_from_f64(v).to_f64(),
        DType::BF16 => crate::bf16_from_f64(v).to_f64(),
        DType::F64 => v,
        DType::Bool => (v != 0.0) as u8 as f64,
        _ => wrap(d, v as i128),
    }
}

fn wrap(d: DType, v: i128) -> f64 {
    match d {
        DType::I8 => v as i8 as f64,
        DType::I16 => v as i16 as f64,
        DType::I32 => v as i32 as f64,
        DType::I64 => v as i64 as f64,
        DType::U8 => v as u8 as f64,
        DType::U16 => v as u16 as f64,
        DType::U32 => v as u32 as f64,
        DType::U64 => v as u64 as f64,
        other => panic!("wrap to {other}"),
    }
}

fn unary(u: UnaryOp, x: f64, d: DType) -> f64 {
    let r = match u {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Relu => {
            if x < 0.0 {
                0.0
            } else {
                x
            }
        }
        UnaryOp::Not => (x == 0.0) as u8 as f64,
        UnaryOp::IsNan => x.is_nan() as u8 as f64,
        other => panic!("test evaluator does not support {other:?}"),
    };
    fit(d, r)
}

fn binary(b: BinaryOp, p: f64, q: f64, d: DType) -> f64 {
    use BinaryOp::*;
    let flag = |c: bool| c as u8 as f64;
    match b {
        Eq => return flag(p == q),
        Ne => return flag(p != q),
        Lt => return flag(p < q),
        Le => return flag(p <= q),
        Gt => return flag(p > q),
        Ge => return flag(p >= q),
        And => return flag(p != 0.0 && q != 0.0),
        Or => return flag(p != 0.0 || q != 0.0),
        Xor => return flag((p != 0.0) != (q != 0.0)),
        _ => {}
    }
    if d.is_float() {
        let r = match b {
            Add => p + q,
            Sub => p - q,
            Mul => p * q,
            Div => p / q,
            Maximum | Minimum if p.is_nan() || q.is_nan() => f64::NAN,
            Maximum => p.max(q),
            Minimum => p.min(q),
            other => panic!("test evaluator does not support float {other:?}"),
        };
        return fit(d, r);
    }
    let (p, q) = (p as i128, q as i128);
    let r = match b {
        Add => p + q,
        Sub => p - q,
        Mul => p * q,
        Div if q == 0 => 0,
        Div => p / q,
        Maximum => p.max(q),
        Minimum => p.min(q),
        Rem => p % q,
        Mod => p.rem_euclid(q) + if q < 0 && p.rem_euclid(q) != 0 { q } else { 0 },
        other => panic!("test evaluator does not support integer {other:?}"),
    };
    wrap(d, r)
}

fn cast(x: f64, from: DType, to: DType) -> f64 {
    if to == DType::Bool || to.is_float() || !from.is_float() {
        return fit(to, x);
    }
    if x.is_nan() {
        return 0.0;
    }
    let (lo, hi) = match to {
        DType::I8 => (i8::MIN as f64, i8::MAX as f64),
        DType::I16 => (i16::MIN as f64, i16::MAX as f64),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        DType::U8 => (0.0, u8::MAX as f64),
        DType::U16 => (0.0, u16::MAX as f64),
        DType::U32 => (0.0, u32::MAX as f64),
        other => panic!("test evaluator does not cast to {other}"),
    };
    x.trunc().clamp(lo, hi)
}

/// Flat index into an operand of shape `from` broadcast to `to`.
fn bcast(to: &[usize], from: &[usize], k: usize) -> usize {
    let idx = unravel(to, k);
    let off = to.len() - from.len();
    let st = strides(from);
    (0..from.len()).map(|i| if from[i] == 1 { 0 } else { idx[off + i] * st[i] }).sum()
}

fn unravel(shape: &[usize], mut k: usize) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = k % shape[d];
        k /= shape[d];
    }
    idx
}

fn strides(shape: &[usize]) -> Vec<usize> {
    crate::Shape::new(shape).strides()
}

/// splitmix64: deterministic pseudo-random inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn pick(&mut self, options: &[f64]) -> f64 {
        options[(self.next() % options.len() as u64) as usize]
    }
}

/// Inputs of type `t`. Odd seeds walk through the special values in
/// order (so even a 4-element tensor meets inf and NaN on seed 3); even
/// seeds mix random values with specials.
fn random_value(t: &ValueType, seed: u64, rng: &mut Rng) -> Value {
    let special_f = [0.0, -0.0, 1.0, -1.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1e30, -2.5e-3];
    let special_i = [0.0, 1.0, -1.0, i32::MAX as f64, i32::MIN as f64, 7.0, -7.0];
    let walk = |options: &[f64], k: usize| options[(k + 4 * (seed as usize / 2)) % options.len()];
    let data = (0..t.shape.numel())
        .map(|k| {
            let r = rng.next();
            let v = match t.dtype {
                DType::Bool => (r & 1) as f64,
                d if d.is_float() && !seed.is_multiple_of(2) => walk(&special_f, k),
                d if d.is_float() && r.is_multiple_of(3) => rng.pick(&special_f),
                d if d.is_float() => ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 20.0,
                d if d.is_signed_int() && !seed.is_multiple_of(2) => walk(&special_i, k),
                d if d.is_signed_int() && r.is_multiple_of(3) => rng.pick(&special_i),
                _ => (r >> 32) as i32 as f64,
            };
            fit(t.dtype, v)
        })
        .collect();
    Value { shape: t.shape.dims().to_vec(), data }
}
