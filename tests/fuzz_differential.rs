//! Differential fuzzing: random graphs of 10–60 ops over the whole op set
//! (unary, binary with broadcasting, where, cast, reductions with keepdim,
//! arg-reductions, softmax, cumsum, matmul, reshape, permute, expand,
//! slices with negative steps, concat, pad, gather, scatter-add,
//! mid-program syncs, trips through f16 and bf16: a cast, one op of each
//! family wgpu runs on them, a cast back) on random shapes (size-1, zero-size and odd dims)
//! run on the wgpu device and on the CPU reference device, outputs
//! compared. Cases alternate between the wgpu kernel forms of software
//! adapters and those of GPUs (forced with `KernelForms`; every other GPU
//! case with the tiled matmul forced on every shape), so every form is
//! fuzzed on any adapter. A third property runs each program at three
//! base shapes, so graphs that differ only in sizes go through the
//! kernels generic over sizes (size variants, widenings, reuse), and a
//! fourth at four base shapes whose dims keep a step, on devices that
//! compile sizes ahead (`Device::set_compile_ahead`), so later sizes run
//! plans compiled on the compile-ahead thread (measured: about one per
//! case).
//!
//! A program is a *choice sequence* (Hypothesis-style): a base shape, a
//! data seed and a list of steps of four small numbers. An interpreter
//! turns each step into an op valid for the values at hand (axes taken
//! modulo the rank, partners chosen among values whose shapes broadcast),
//! so every sequence is a valid program and proptest shrinks by dropping
//! steps and lowering numbers.
//!
//! Numerics: the interpreter tracks, per value, a bound on its magnitude,
//! whether it is *exact* (a dyadic rational both backends must compute
//! bit-for-bit: views, neg/abs/relu, max/min, add/sub/sum/matmul of exact
//! values with few fraction bits) and how many rounded ops lie on its
//! longest path. Discontinuous ops (floor, sign, comparisons, argmax, casts
//! to int) only take exact operands, so a 1-ulp difference never flips
//! them; domains are kept safe (clamp before exp/pow, `|x| + 0.5` before
//! log/sqrt/div). Exact values must match exactly; rounded ones within a
//! tolerance that grows with their rounded depth and bound.
//!
//! A second property runs programs over larger base shapes (two dims of
//! 33 or 65) on wgpu devices that bind storage in 8 KiB windows
//! (`WgpuDeviceOptions::binding_window`, see `lazuli_wgpu::window`), as
//! tensors beyond the adapter's binding limit always are: most values
//! then span several windows. A program one of whose kernels would need
//! more storage bindings than the devices have (lavapipe's limit, forced
//! on any adapter) is refused with
//! `BackendError::TooLarge` (a typed error, allowed) and discarded;
//! proptest fails if it discards too many.
//!
//! `LAZULI_FUZZ_CASES=N` runs N cases (default 500; a 32nd as many
//! windowed ones). Failures shrink and
//! are persisted in `tests/fuzz_differential.proptest-regressions` (replayed
//! first on every run); explicit regression tests for bugs found live at
//! the end of this file.

mod common;
use lazuli::ir::{ArgReduceOp, PadMode, ReduceOp};
use lazuli::prelude::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use std::sync::OnceLock;

/// Rounded f32 ops one rounding of f16 and of bf16 counts as (2^13 and
/// 2^16 f32 ulps, scaled to the tolerance's 2e-5 per rounded op).
const HALF_DEPTH: (u32, u32) = (16, 128);

/// Largest rounded depth a value carries: beyond it the tolerance
/// (`2e-5 * depth * bound`) no longer checks anything, and a cap keeps
/// the depth arithmetic from overflowing.
const MAX_DEPTH: u32 = 1 << 20;

/// A depth's error (`1 + depth` units at one bound) in units of another
/// bound `factor` times smaller, rounded up, at most [`MAX_DEPTH`].
fn carry(depth: u32, factor: f64) -> u32 {
    let units = (1 + depth.min(MAX_DEPTH)) as f64 * factor;
    if units.is_nan() {
        MAX_DEPTH
    } else {
        units.ceil().clamp(0.0, MAX_DEPTH as f64) as u32
    }
}

/// Most elements of one value of a program (see `Interp::push`).
const MAX_VALUE_ELEMENTS: usize = 1 << 20;

/// One step of a program: what to do (`op`) and three free choices.
#[derive(Clone, Copy, Debug)]
struct Step {
    op: u8,
    a: u8,
    b: u8,
    c: u8,
}

/// A random program: base shape, data seed and steps.
#[derive(Clone, Debug)]
struct Program {
    dims: Vec<usize>,
    seed: u64,
    steps: Vec<Step>,
}

/// A value of the program on both devices, with what the interpreter
/// knows about it.
#[derive(Clone)]
struct Val {
    cpu: Tensor,
    gpu: Tensor,
    /// |x| <= bound (infinite when unknown).
    bound: f64,
    /// Fraction bits of an exact value; None once rounded.
    frac: Option<u32>,
    /// Rounded ops on the longest path to this value.
    depth: u32,
}

impl Val {
    fn dtype(&self) -> DType {
        self.cpu.dtype()
    }
    fn dims(&self) -> &[usize] {
        self.cpu.dims()
    }
    fn exact(&self) -> bool {
        self.frac.is_some()
    }
}

/// Fraction bits of a result, if it is still exact: it must fit in f32's
/// 24-bit significand with one bit to spare.
/// The rounded depth an inexact reduction of `n` terms adds: 1, plus one
/// per doubling past 256 terms. Backends accumulate in different orders
/// (the CPU's gemm in blocks, a GPU form in a few long running sums), and
/// the difference of two orders grows with the length: a dot product of
/// 35937 equal-sized f32 terms differed by 7e-5 relative between them,
/// within the worst-case bound of about `n * 2^-24` but past a tolerance
/// that ignores `n`.
fn reduction_depth(n: usize) -> u32 {
    1 + (n / 256).checked_ilog2().unwrap_or(0)
}

fn exact_frac(frac: Option<u32>, bound: f64) -> Option<u32> {
    let f = frac?;
    let int_bits = (bound + 1.0).log2().ceil();
    (bound.is_finite() && f as f64 + int_bits <= 22.0).then_some(f)
}

fn both_frac(a: &Val, b: &Val) -> Option<u32> {
    Some(a.frac?.max(b.frac?))
}

struct Interp {
    cpu: Device,
    gpu: Device,
    pool: Vec<Val>,
    /// Ops applied, for failure messages.
    log: Vec<String>,
    /// The first failed mid-program sync on the wgpu device.
    gpu_sync: Option<lazuli::ExecError>,
}

type Res = lazuli::Result<Tensor>;

impl Interp {
    /// Applies `f` on both devices. Record-time errors must agree.
    fn apply(&mut self, what: &str, args: &[&Val], f: impl Fn(&[&Tensor]) -> Res) -> Option<(Tensor, Tensor)> {
        let c: Vec<&Tensor> = args.iter().map(|v| &v.cpu).collect();
        let g: Vec<&Tensor> = args.iter().map(|v| &v.gpu).collect();
        let shapes: Vec<String> = args.iter().map(|v| format!("{}{}", v.dtype(), v.cpu.shape())).collect();
        let (rc, rg) = (f(&c), f(&g));
        match (rc, rg) {
            (Ok(c), Ok(g)) => {
                assert_eq!(c.ty(), g.ty(), "{what}: result types differ");
                self.log.push(format!("{what}({}) -> {}{}", shapes.join(", "), c.dtype(), c.shape()));
                Some((c, g))
            }
            (Err(a), Err(b)) => {
                assert_eq!(a.to_string(), b.to_string(), "{what}: record-time errors differ");
                None
            }
            (a, b) => panic!("{what}: one device accepted, the other refused: {:?} / {:?}", a.err(), b.err()),
        }
    }

    fn push(&mut self, t: Option<(Tensor, Tensor)>, bound: f64, frac: Option<u32>, depth: u32) -> Option<Val> {
        let (cpu, gpu) = t?;
        // Values past a few MiB are dropped unused (never synced, so
        // never run): a chance matmul or expand of large operands (one
        // seed in a few thousand made [33, 1430, 1430], over lavapipe's
        // 128 MiB binding) would otherwise test the device's size limit
        // instead of the kernels, and take minutes to shrink.
        if cpu.numel() > MAX_VALUE_ELEMENTS {
            self.log.push(format!("(dropped: {} elements)", cpu.numel()));
            return None;
        }
        let frac = if cpu.dtype() == DType::F32 { exact_frac(frac, bound) } else { frac };
        let v = Val { cpu, gpu, bound, frac, depth };
        assert!(v.dtype() == DType::F32 || v.exact(), "non-float values must be exact");
        self.pool.push(v.clone());
        Some(v)
    }

    /// `a` cast to f16 or bf16, one op there (scale and add, tanh, a sum
    /// or softmax over the last axis, or a matmul with its transpose:
    /// each kernel family that runs these dtypes on wgpu), and cast back
    /// to f32. The CPU rounds every op to the dtype, wgpu once per fused
    /// chain: each rounding of the dtype counts as `HALF_DEPTH` rounded
    /// f32 ops in the tolerance.
    fn half_trip(&mut self, a: &Val, s: Step) {
        let x = self.tame(a, 32.0);
        let (to, r) = if s.b.is_multiple_of(2) { (DType::F16, HALF_DEPTH.0) } else { (DType::BF16, HALF_DEPTH.1) };
        let rank = x.dims().len();
        let n = x.dims().last().copied().unwrap_or(1);
        let kind = s.c % 5;
        if rank == 0 && kind >= 2 {
            return;
        }
        let t = self.apply(&format!("{to}_trip{kind}"), &[&x], |v| {
            let h = v[0].cast(to)?;
            let y = match kind {
                0 => h.mul_scalar(0.75)?.add(&h)?,
                1 => h.tanh()?,
                2 => h.sum(&[-1], true)?,
                3 => h.softmax(-1)?,
                _ => {
                    // The last two axes swapped.
                    let p: Vec<isize> = (0..rank)
                        .map(|d| if rank > 1 && d + 2 >= rank { (2 * rank - 3 - d) as isize } else { d as isize })
                        .collect();
                    h.matmul(&h.permute(&p)?)?
                }
            };
            y.cast(DType::F32)
        });
        let (bound, extra) = match kind {
            0 => (x.bound * 1.75, 0),
            1 | 3 => (1.0, 0),
            2 => (x.bound * n.max(1) as f64, reduction_depth(n)),
            _ => (x.bound * x.bound * n.max(1) as f64, reduction_depth(n)),
        };
        self.push(t, bound, None, x.depth + 3 * r + extra);
    }

    /// Picks an operand, mostly among the latest values (deep chains).
    fn pick(&self, k: u8) -> Val {
        let n = self.pool.len();
        let k = k as usize;
        if k < 192 {
            self.pool[n - 1 - (k % n.min(4))].clone()
        } else {
            self.pool[k % n].clone()
        }
    }

    /// A float version of `v`, clamped to `[-lim, lim]` when its bound is larger.
    fn float(&mut self, v: &Val, lim: f64) -> Val {
        let mut v = v.clone();
        if v.dtype() != DType::F32 {
            let t = self.apply("cast_f32", &[&v], |x| x[0].cast(DType::F32)).expect("cast to f32");
            let bound = if v.dtype() == DType::Bool { 1.0 } else { v.bound };
            v = Val { cpu: t.0, gpu: t.1, bound, frac: Some(v.frac.unwrap_or(0)), depth: v.depth };
        }
        self.tame(&v, lim)
    }

    /// `v` clamped to `[-lim, lim]` when its bound is larger (dtype kept).
    /// An element inside the range keeps its absolute error, which was
    /// counted at the larger bound: the depth carries it to the new bound
    /// (as the smooth unary ops carry theirs). Not doing so let an f16
    /// trip's one-ulp disagreement at bound 14, clamped to 8 and squared
    /// twice by `x xᵀ`, exceed the tolerance by 2x.
    fn tame(&mut self, v: &Val, lim: f64) -> Val {
        if v.bound <= lim {
            return v.clone();
        }
        let t = self.apply("clamp", &[v], |x| x[0].clamp(Some(-lim), Some(lim))).expect("clamp");
        let depth = if v.exact() { v.depth } else { carry(v.depth, v.bound / lim).saturating_sub(1).max(v.depth) };
        Val { cpu: t.0, gpu: t.1, bound: lim, frac: v.frac, depth }
    }

    /// A partner for a binary op with `a`: a value of the same dtype whose
    /// shape broadcasts with `a`'s, or a fresh scalar.
    fn partner(&mut self, a: &Val, k: u8) -> Val {
        let cands: Vec<Val> = self
            .pool
            .iter()
            .filter(|v| v.dtype() == a.dtype() && v.cpu.shape().broadcast(a.cpu.shape()).is_some())
            .cloned()
            .collect();
        if k % 5 == 4 || cands.is_empty() {
            // A scalar: special values are baked, others lifted.
            let vals = [0.0f32, 1.0, -1.0, 0.75, 2.5, -1.25];
            let x = vals[k as usize % vals.len()];
            let (c, g) = (Tensor::scalar(x, a.dtype(), &self.cpu), Tensor::scalar(x, a.dtype(), &self.gpu));
            return Val { cpu: c, gpu: g, bound: x.abs().ceil() as f64, frac: Some(2), depth: 0 };
        }
        cands[(k / 5) as usize % cands.len()].clone()
    }

    fn step(&mut self, s: Step) {
        let a = self.pick(s.a);
        let op = s.op % 22;
        match op {
            // Exact unary ops, on any numeric value.
            0 => {
                let v = if a.dtype() == DType::Bool { self.float(&a, 64.0) } else { a };
                let (name, f): (&str, fn(&Tensor) -> Res) = match s.b % 3 {
                    0 => ("neg", Tensor::neg),
                    1 => ("abs", Tensor::abs),
                    _ => ("relu", Tensor::relu),
                };
                let t = self.apply(name, &[&v], |x| f(x[0]));
                self.push(t, v.bound, v.frac, v.depth);
            }
            // Smooth rounded unary ops.
            1 => {
                let v = self.float(&a, 8.0);
                let (name, f, bound): (&str, fn(&Tensor) -> Res, f64) = match s.b % 8 {
                    0 => ("exp", Tensor::exp, v.bound.exp()),
                    1 => ("tanh", Tensor::tanh, 1.0),
                    2 => ("sigmoid", Tensor::sigmoid, 1.0),
                    3 => ("sin", Tensor::sin, 1.0),
                    4 => ("cos", Tensor::cos, 1.0),
                    5 => ("gelu", Tensor::gelu, v.bound),
                    6 => ("gelu_tanh", Tensor::gelu_tanh, v.bound),
                    _ => ("erf", Tensor::erf, 1.0),
                };
                let t = self.apply(name, &[&v], |x| f(x[0]));
                // The input's absolute error (its depth at its bound) passes
                // through the op's slope (at most e^bound for exp, 1.13
                // for erf, less for the others), plus one rounding: in
                // depth units at the output's bound. Not doing so hid
                // nothing in f32, but an f16 trip's one-ulp disagreement
                // (4e-3 at 5) reaching cos(x) exceeded a bound-1 tolerance.
                let slope = if name == "exp" { bound } else { 1.13 };
                let carried = carry(v.depth, slope * v.bound.max(1.0) / bound.max(1.0));
                self.push(t, bound, None, carried + 1);
            }
            // Domain-restricted unary ops on |x| + 0.5.
            2 => {
                let v = self.float(&a, 64.0);
                // With each op's steepest slope on `|x| + 0.5` (at 0.5).
                let (name, f, bound, slope): (&str, fn(&Tensor) -> Res, f64, f64) = match s.b % 4 {
                    0 => ("log", Tensor::log, (v.bound + 0.5).ln().abs().max(0.7), 2.0),
                    1 => ("sqrt", Tensor::sqrt, (v.bound + 0.5).sqrt(), 0.71),
                    2 => ("rsqrt", Tensor::rsqrt, 1.5, 1.42),
                    _ => ("reciprocal", Tensor::reciprocal, 2.0, 4.0),
                };
                let t = self.apply(name, &[&v], |x| f(&x[0].abs()?.add_scalar(0.5)?));
                // The input's absolute error through the slope, plus one
                // rounding (as the smooth ops): an f16 trip's one-ulp flip
                // through `1 / (|x| + 0.5)` exceeded a bound-2 tolerance.
                let carried = carry(v.depth, slope * v.bound.max(1.0) / bound.max(1.0));
                self.push(t, bound, None, carried.max(v.depth) + 1);
            }
            // Discontinuous unary ops: exact operands only.
            3 => {
                if !a.exact() || a.dtype() == DType::Bool {
                    return;
                }
                let v = a;
                let (name, f): (&str, fn(&Tensor) -> Res) = match (v.dtype(), s.b % 4) {
                    (DType::I32, _) => ("sign", Tensor::sign),
                    (_, 0) => ("floor", Tensor::floor),
                    (_, 1) => ("ceil", Tensor::ceil),
                    (_, 2) => ("round", Tensor::round),
                    _ => ("sign", Tensor::sign),
                };
                let t = self.apply(name, &[&v], |x| f(x[0]));
                self.push(t, v.bound + 1.0, Some(0), v.depth);
            }
            // Binary arithmetic with broadcasting.
            4 => {
                let x = if a.dtype() == DType::Bool { self.float(&a, 64.0) } else { a.clone() };
                let lim = if x.dtype() == DType::I32 { 1000.0 } else { 64.0 };
                let x = self.tame(&x, lim);
                let y = self.partner(&x, s.c);
                let y = self.tame(&y, lim);
                let depth = x.depth.max(y.depth);
                let (name, f): (&str, fn(&Tensor, &Tensor) -> Res) = match s.b % 5 {
                    0 => ("add", Tensor::add),
                    1 => ("sub", Tensor::sub),
                    2 => ("mul", Tensor::mul),
                    3 => ("maximum", Tensor::maximum),
                    _ => ("minimum", Tensor::minimum),
                };
                let (bound, frac, rounded) = match name {
                    "add" | "sub" => (x.bound + y.bound, both_frac(&x, &y), false),
                    "mul" => (x.bound * y.bound, x.frac.zip(y.frac).map(|(p, q)| p + q), false),
                    _ => (x.bound.max(y.bound), both_frac(&x, &y), false),
                };
                let frac = if x.dtype() == DType::I32 { Some(0) } else { frac };
                let d = depth + (rounded || exact_frac(frac, bound).is_none()) as u32;
                let t = self.apply(name, &[&x, &y], |v| f(v[0], v[1]));
                self.push(t, bound, frac, d);
            }
            // Division and power on safe domains, and logaddexp.
            5 => {
                let x = self.float(&a, 16.0);
                let y = self.partner(&x, s.c);
                let y = self.float(&y, 16.0);
                let depth = x.depth.max(y.depth) + 1;
                if s.b % 3 == 2 {
                    // Everywhere defined: |logaddexp(x, y)| <= max(|x|, |y|) + ln 2.
                    let t = self.apply("logaddexp", &[&x, &y], |v| v[0].logaddexp(v[1]));
                    self.push(t, x.bound.max(y.bound) + 1.0, None, depth);
                } else if s.b.is_multiple_of(2) {
                    let t = self.apply("div", &[&x, &y], |v| v[0].div(&v[1].abs()?.add_scalar(0.5)?));
                    self.push(t, x.bound * 2.0, None, depth);
                } else {
                    let t = self.apply("pow", &[&x, &y], |v| {
                        let base = v[0].abs()?.add_scalar(0.5)?.clamp(None, Some(4.0))?;
                        base.pow(&v[1].clamp(Some(-2.0), Some(2.0))?)
                    });
                    self.push(t, 16.0, None, depth);
                }
            }
            // Comparison (exact operands) feeding where.
            6 => {
                let x = if a.dtype() == DType::Bool { self.float(&a, 64.0) } else { a.clone() };
                let y = self.partner(&x, s.c);
                let cond = if x.exact() && y.exact() {
                    let (name, f): (&str, fn(&Tensor, &Tensor) -> Res) = match s.b % 6 {
                        0 => ("eq", Tensor::eq),
                        1 => ("ne", Tensor::ne),
                        2 => ("lt", Tensor::lt),
                        3 => ("le", Tensor::le),
                        4 => ("gt", Tensor::gt),
                        _ => ("ge", Tensor::ge),
                    };
                    let t = self.apply(name, &[&x, &y], |v| f(v[0], v[1]));
                    self.push(t, 1.0, Some(0), 0)
                } else {
                    self.pool.iter().rev().find(|v| v.dtype() == DType::Bool).cloned()
                };
                let Some(cond) = cond else { return };
                if s.b.is_multiple_of(3) {
                    // Logical ops on bools.
                    let other = self.partner(&cond, s.c);
                    let (name, f): (&str, fn(&Tensor, &Tensor) -> Res) = match s.c % 3 {
                        0 => ("logical_and", Tensor::logical_and),
                        1 => ("logical_or", Tensor::logical_or),
                        _ => ("logical_xor", Tensor::logical_xor),
                    };
                    let t = self.apply(name, &[&cond, &other], |v| f(v[0], v[1]));
                    self.push(t, 1.0, Some(0), 0);
                    return;
                }
                let p = self.partner(&x, s.b);
                let t = self.apply("where", &[&cond, &x, &p], |v| v[0].where_(v[1], v[2]));
                self.push(t, x.bound.max(p.bound), both_frac(&x, &p), x.depth.max(p.depth));
            }
            // Casts: f32 <-> i32 (exact values only), bool -> f32/i32; a
            // rounded f32 value takes a trip through f16 or bf16 instead.
            7 => {
                if !a.exact() {
                    if a.dtype() == DType::F32 {
                        self.half_trip(&a, s);
                    }
                    return;
                }
                let to = match (a.dtype(), s.b % 2) {
                    (DType::F32, _) if a.bound < 1e6 => DType::I32,
                    (DType::F32, _) => return,
                    (_, 0) => DType::F32,
                    (DType::Bool, _) => DType::I32,
                    _ => DType::Bool,
                };
                let bound = if to == DType::Bool { 1.0 } else { a.bound };
                let t = self.apply(&format!("cast_{to}"), &[&a], |x| x[0].cast(to));
                self.push(t, bound, Some(0).max(if to == DType::F32 { a.frac } else { Some(0) }), a.depth);
            }
            // Reductions with keepdim.
            8 => {
                let x = if a.dtype() == DType::Bool { self.float(&a, 64.0) } else { a.clone() };
                if x.dims().is_empty() {
                    return;
                }
                let rank = x.dims().len();
                let mut axes: Vec<isize> = (0..rank as isize).filter(|i| (s.c >> i) & 1 == 1).collect();
                if axes.is_empty() {
                    axes.push((s.c as usize % rank) as isize - if s.c & 8 != 0 { rank as isize } else { 0 });
                }
                let keep = s.b & 16 != 0;
                let n: usize = axes.iter().map(|&ax| x.dims()[(ax.rem_euclid(rank as isize)) as usize]).product();
                let op = match (x.dtype(), s.b % 5) {
                    (_, 0) => ReduceOp::Sum,
                    (DType::F32, 1) if n > 0 => ReduceOp::Mean,
                    (_, 2) => ReduceOp::Max,
                    (_, 3) => ReduceOp::Min,
                    (DType::F32, 4) => ReduceOp::Prod,
                    _ => ReduceOp::Sum,
                };
                let x = match op {
                    ReduceOp::Prod => self.float(&x, 1.0),
                    ReduceOp::Sum | ReduceOp::Mean if x.dtype() == DType::F32 => self.float(&x, 64.0),
                    ReduceOp::Sum => self.tame(&x, 1000.0),
                    _ => x,
                };
                let (bound, frac, rounded) = match op {
                    ReduceOp::Sum => (x.bound * n.max(1) as f64, x.frac, false),
                    ReduceOp::Mean => (x.bound, None, true),
                    ReduceOp::Prod => (1.0, None, true),
                    // Max/min over an empty axis give the identity (±inf for floats).
                    _ if n == 0 => (f64::INFINITY, x.frac, false),
                    _ => (x.bound, x.frac, false),
                };
                let frac = if x.dtype() == DType::I32 { Some(0) } else { frac };
                let depth = x.depth + (rounded || exact_frac(frac, bound).is_none()) as u32 * reduction_depth(n);
                let t = self.apply(&format!("reduce_{}", op.name()), &[&x], |v| v[0].reduce_axes(op, &axes, keep));
                self.push(t, bound, frac, depth);
            }
            // Arg-reductions (exact operands).
            9 => {
                if !a.exact() || a.dims().is_empty() || a.dtype() == DType::Bool {
                    return;
                }
                let rank = a.dims().len() as isize;
                let axis = (s.c as isize % rank) - if s.c & 8 != 0 { rank } else { 0 };
                let op = if s.b.is_multiple_of(2) { ArgReduceOp::ArgMax } else { ArgReduceOp::ArgMin };
                let (keep, last) = (s.b & 2 != 0, s.b & 4 != 0);
                let t = self.apply("arg_reduce", &[&a], |v| v[0].arg_reduce(op, axis, keep, last));
                let n = a.dims()[axis.rem_euclid(rank) as usize] as f64;
                self.push(t, n, Some(0), a.depth);
            }
            // Softmax / log-softmax.
            10 => {
                let x = self.float(&a, 16.0);
                if x.dims().is_empty() {
                    return;
                }
                let rank = x.dims().len() as isize;
                let axis = (s.c as isize % rank) - if s.c & 8 != 0 { rank } else { 0 };
                let log = s.b.is_multiple_of(2);
                let t = self.apply("softmax", &[&x], |v| if log { v[0].log_softmax(axis) } else { v[0].softmax(axis) });
                let bound = if log { 2.0 * x.bound + 8.0 } else { 1.0 };
                self.push(t, bound, None, x.depth + 1);
            }
            // Matmul.
            11 => {
                let x = if a.dtype() == DType::Bool { self.float(&a, 8.0) } else { a.clone() };
                let lim = if x.dtype() == DType::I32 { 30.0 } else { 8.0 };
                let x = self.tame(&x, lim);
                if x.dims().len() < 2 && s.b.is_multiple_of(2) {
                    return;
                }
                let k = *x.dims().last().unwrap_or(&1);
                // A partner whose second-to-last dim is k (and batch dims
                // broadcast), or x's own transpose.
                let cand = self
                    .pool
                    .iter()
                    .filter(|v| {
                        let d = v.dims();
                        v.dtype() == x.dtype()
                            && d.len() >= 2
                            && d[d.len() - 2] == k
                            && v.bound <= lim
                            && Shape::new(&d[..d.len() - 2])
                                .broadcast(&Shape::new(&x.dims()[..x.dims().len().saturating_sub(2)]))
                                .is_some()
                    })
                    .nth(s.c as usize % 3)
                    .cloned();
                let (t, n) = match cand {
                    Some(y) if !s.c.is_multiple_of(4) => {
                        let t = self.apply("matmul", &[&x, &y], |v| v[0].matmul(v[1]));
                        (t.map(|t| (t, y.frac, y.bound, y.depth)), k)
                    }
                    _ => {
                        let left = s.c.is_multiple_of(2);
                        let t = self.apply("matmul_self_t", &[&x], |v| {
                            if left {
                                v[0].matmul(&v[0].t()?)
                            } else {
                                v[0].t()?.matmul(v[0])
                            }
                        });
                        // The summed length: k for x x^T; for x^T x the
                        // rows, except that a vector's transpose is itself
                        // (a dot product over all of it).
                        let rows = x.dims().len().checked_sub(2).map(|i| x.dims()[i]);
                        let n = if left { k } else { rows.unwrap_or(k) };
                        (t.map(|t| (t, x.frac, x.bound, x.depth)), n)
                    }
                };
                let Some((t, yfrac, ybound, ydepth)) = t else { return };
                let bound = x.bound * ybound * n.max(1) as f64;
                let frac = if x.dtype() == DType::I32 { Some(0) } else { x.frac.zip(yfrac).map(|(p, q)| p + q) };
                let inexact = exact_frac(frac, bound).is_none();
                let depth = x.depth.max(ydepth) + inexact as u32 * reduction_depth(n);
                self.push(Some(t), bound, frac, depth);
            }
            // Reshape: flatten, split or merge.
            12 => {
                let d = a.dims().to_vec();
                let numel: usize = d.iter().product();
                let target: Vec<isize> = match s.b % 4 {
                    0 => vec![-1],
                    1 if d.len() >= 2 => {
                        let mut t: Vec<isize> = d[..d.len() - 2].iter().map(|&x| x as isize).collect();
                        t.push((d[d.len() - 2] * d[d.len() - 1]) as isize);
                        t
                    }
                    2 => {
                        let mut t: Vec<isize> = vec![1];
                        t.extend(d.iter().map(|&x| x as isize));
                        t
                    }
                    _ => {
                        // Split the element count by a small divisor.
                        let f =
                            [2usize, 3, 5].into_iter().find(|f| numel > 0 && numel.is_multiple_of(*f) && numel > *f);
                        match f {
                            Some(f) => vec![f as isize, -1],
                            None => vec![numel as isize, 1],
                        }
                    }
                };
                if target.len() > 4 {
                    return;
                }
                let t = self.apply("reshape", &[&a], |v| v[0].reshape(&target));
                self.push(t, a.bound, a.frac, a.depth);
            }
            // Permute.
            13 => {
                let r = a.dims().len();
                if r < 2 {
                    return;
                }
                let mut perm: Vec<isize> = (0..r as isize).collect();
                let mut k = s.c as usize;
                for i in (1..r).rev() {
                    perm.swap(i, k % (i + 1));
                    k /= i + 1;
                }
                if s.b.is_multiple_of(2) {
                    perm[0] -= r as isize;
                }
                let t = self.apply("permute", &[&a], |v| v[0].permute(&perm));
                self.push(t, a.bound, a.frac, a.depth);
            }
            // Expand: size-1 dims grow, or a new leading dim.
            14 => {
                let mut d = a.dims().to_vec();
                let grow = [2usize, 3, 1, 4][s.c as usize % 4];
                if d.contains(&1) && s.b.is_multiple_of(2) {
                    for x in d.iter_mut().filter(|x| **x == 1) {
                        *x = grow;
                    }
                } else if d.len() < 4 {
                    d.insert(0, grow);
                } else {
                    return;
                }
                let t = self.apply("expand", &[&a], |v| v[0].expand(d.clone()));
                self.push(t, a.bound, a.frac, a.depth);
            }
            // Python-style slice, negative steps included.
            15 => {
                let r = a.dims().len();
                if r == 0 {
                    return;
                }
                let axis = (s.c as usize % r) as isize;
                let n = a.dims()[axis as usize] as i64;
                let step = [1i64, 2, -1, -2, 3, -3][s.b as usize % 6];
                let start = (s.c as i64 / 4) % (n + 2) - 1;
                let end = if step > 0 { n - (s.b as i64 / 8) % 3 } else { -n - 1 + (s.b as i64 / 8) % 3 };
                let t = self.apply("slice", &[&a], |v| v[0].slice(axis, start, end, step));
                self.push(t, a.bound, a.frac, a.depth);
            }
            // Concat with a partner of the same shape outside the axis.
            16 => {
                let r = a.dims().len();
                if r == 0 {
                    return;
                }
                let axis = s.c as usize % r;
                let same = |v: &Val| {
                    v.dtype() == a.dtype()
                        && v.dims().len() == r
                        && (0..r).all(|d| d == axis || v.dims()[d] == a.dims()[d])
                };
                let others: Vec<Val> = self.pool.iter().filter(|v| same(v)).cloned().collect();
                let b = others[s.b as usize % others.len()].clone();
                let three = s.b.is_multiple_of(3);
                let ax = axis as isize - if s.b.is_multiple_of(2) { r as isize } else { 0 };
                let t = self.apply("concat", &[&a, &b], |v| {
                    if three {
                        Tensor::concat(&[v[0], v[1], v[0]], ax)
                    } else {
                        Tensor::concat(&[v[0], v[1]], ax)
                    }
                });
                self.push(t, a.bound.max(b.bound), a.frac.zip(b.frac).map(|(p, q)| p.max(q)), a.depth.max(b.depth));
            }
            // Pad: constant, reflect or edge.
            17 => {
                let r = a.dims().len();
                if r == 0 || a.dtype() == DType::Bool {
                    return;
                }
                let pads: Vec<(usize, usize)> =
                    (0..r).map(|d| (((s.c >> d) & 1) as usize * (1 + d % 2), ((s.b >> d) & 1) as usize * 2)).collect();
                let mode = [PadMode::Constant, PadMode::Reflect, PadMode::Edge][s.b as usize % 3];
                let t = self.apply("pad", &[&a], |v| match mode {
                    PadMode::Constant => v[0].pad(&pads, 1.5),
                    m => v[0].pad_mode(&pads, m),
                });
                self.push(t, a.bound.max(1.5), a.frac.map(|f| f.max(1)), a.depth);
            }
            // Gather with in-range indices (negative ones included), or a
            // scatter-add of the gathered rows.
            18 => {
                let r = a.dims().len();
                if r == 0 {
                    return;
                }
                let axis = s.c as usize % r;
                let n = a.dims()[axis];
                if n == 0 {
                    return;
                }
                let len = [1usize, 3, 5, 0][s.b as usize % 4];
                let idx: Vec<i32> = (0..len)
                    .map(|i| {
                        let k = ((s.b as usize + 7 * i) % (2 * n)) as i32;
                        k - n as i32
                    })
                    .collect();
                let shape: Vec<usize> = if s.b & 4 != 0 && len > 0 { vec![len, 1] } else { vec![len] };
                if r - 1 + shape.len() > 4 {
                    return;
                }
                if s.b & 8 != 0 && a.dtype() != DType::Bool {
                    // Scatter-add of the gathered rows back into the value:
                    // repeated indices sum (in index order on both devices).
                    let t = self.apply("scatter_add", &[&a], |v| {
                        let i = Tensor::from_slice(&idx, shape.clone(), v[0].device())?;
                        v[0].scatter_add(axis as isize, &i, &v[0].gather(axis as isize, &i)?)
                    });
                    let bound = a.bound * (1 + len) as f64;
                    let depth = a.depth + exact_frac(a.frac, bound).is_none() as u32;
                    self.push(t, bound, a.frac, depth);
                    return;
                }
                let t = self.apply("gather", &[&a], |v| {
                    let i = Tensor::from_slice(&idx, shape.clone(), v[0].device())?;
                    v[0].gather(axis as isize, &i)
                });
                self.push(t, a.bound, a.frac, a.depth);
            }
            // Cumulative sum.
            19 => {
                let x = if a.dtype() == DType::Bool { self.float(&a, 64.0) } else { a.clone() };
                let lim = if x.dtype() == DType::I32 { 1000.0 } else { 64.0 };
                let x = self.tame(&x, lim);
                let r = x.dims().len();
                if r == 0 {
                    return;
                }
                let axis = (s.c as usize % r) as isize;
                let n = x.dims()[axis as usize];
                let (excl, rev) = (s.b & 1 != 0, s.b & 2 != 0);
                let t = self.apply("cumsum", &[&x], |v| v[0].cumsum(axis, excl, rev));
                let bound = x.bound * n.max(1) as f64;
                let depth = x.depth + exact_frac(x.frac, bound).is_none() as u32 * reduction_depth(n);
                self.push(t, bound, x.frac, depth);
            }
            // Integer arithmetic on exact values: div, rem, modulo by a nonzero divisor.
            20 => {
                if !a.exact() || a.dtype() == DType::Bool || a.bound > 1e6 {
                    return;
                }
                let x = if a.dtype() == DType::F32 {
                    match self.apply("cast_i32", &[&a], |v| v[0].cast(DType::I32)) {
                        Some((c, g)) => Val { cpu: c, gpu: g, bound: a.bound, frac: Some(0), depth: a.depth },
                        None => return,
                    }
                } else {
                    a
                };
                let y = self.partner(&x, s.c);
                let y = if y.exact() && y.bound <= 1000.0 { y } else { x.clone() };
                let (name, f): (&str, fn(&Tensor, &Tensor) -> Res) = match s.b % 3 {
                    0 => ("div", Tensor::div),
                    1 => ("rem", Tensor::rem),
                    _ => ("modulo", Tensor::modulo),
                };
                let t = self.apply(name, &[&x, &y], |v| {
                    let d = v[1].abs()?.add_scalar(1)?;
                    let d = if s.c.is_multiple_of(2) { d.neg()? } else { d };
                    f(v[0], &d)
                });
                self.push(t, x.bound, Some(0), x.depth);
            }
            // A sync point in the middle: the value is materialized and
            // later ops read it as data.
            _ => {
                lazuli::sync(&[&a.cpu]).expect("sync on cpu");
                if let Err(e) = lazuli::sync(&[&a.gpu]) {
                    self.gpu_sync.get_or_insert(e);
                }
                self.log.push(format!("sync({}{})", a.dtype(), a.cpu.shape()));
            }
        }
    }
}

/// The wgpu devices of one run: one per kernel-form profile, and the GPU
/// profile with the tiled matmul forced on every shape (by shape, the
/// small products fuzz cases make take the register-blocked form).
type Devices = (Device, Device, Device, Device);

/// The GPU profile with the tiled matmul (64 x 64 tiles) whatever the shape.
fn tiled_matmul() -> lazuli::wgpu::forms::KernelForms {
    lazuli::wgpu::forms::KernelForms {
        matmul: lazuli::wgpu::forms::MatmulForm::Tiled(lazuli::wgpu::forms::MatmulTile { bm: 64, bn: 64 }),
        ..lazuli::wgpu::forms::KernelForms::gpu()
    }
}

/// The devices cases run on (made once for the whole run, so the compile
/// and pipeline caches help): the CPU reference and three wgpu devices,
/// one with each kernel-form profile and one with the GPU profile's tiled
/// matmul forced ([`tiled_matmul`]).
fn devices() -> Option<&'static Devices> {
    static DEVS: OnceLock<Option<Devices>> = OnceLock::new();
    DEVS.get_or_init(|| {
        let with = |forms: lazuli::wgpu::forms::KernelForms| {
            let opts = lazuli::WgpuDeviceOptions { kernel_forms: Some(forms), ..Default::default() };
            let dev = Device::wgpu_with(opts).ok()?;
            // Sizes that keep a step are compiled ahead (see
            // `stepped_program`), on any adapter.
            dev.set_compile_ahead(true);
            Some(dev)
        };
        common::wgpu()?;
        Some((
            Device::cpu(),
            with(lazuli::wgpu::forms::KernelForms::software())?,
            with(lazuli::wgpu::forms::KernelForms::gpu())?,
            with(tiled_matmul())?,
        ))
    })
    .as_ref()
}

fn inputs(it: &mut Interp, dims: &[usize], seed: u64) {
    let numel: usize = dims.iter().product();
    let quarter = |n: usize, seed: u64| -> Vec<f32> {
        common::rand_vec(n, seed, -3.0, 3.0).into_iter().map(|x| (x * 4.0).round() / 4.0).collect()
    };
    let add = |it: &mut Interp, cpu: Tensor, gpu: Tensor, bound: f64, frac: u32| {
        it.log.push(format!("input {}{}", cpu.dtype(), cpu.shape()));
        it.pool.push(Val { cpu, gpu, bound, frac: Some(frac), depth: 0 });
    };
    let f32s = |d: &Device, v: &[f32], s: &[usize]| Tensor::from_slice(v, s.to_vec(), d).expect("input");
    // x0: the base shape.
    let v = quarter(numel, seed);
    add(it, f32s(&it.cpu, &v, dims), f32s(&it.gpu, &v, dims), 3.0, 2);
    // x1: some dims set to 1 (broadcasts against x0).
    let bd: Vec<usize> = dims.iter().enumerate().map(|(i, &d)| if (seed >> i) & 1 == 1 { 1 } else { d }).collect();
    let v = quarter(bd.iter().product(), seed + 1);
    add(it, f32s(&it.cpu, &v, &bd), f32s(&it.gpu, &v, &bd), 3.0, 2);
    // x2: the last dim only.
    let last = [*dims.last().expect("rank >= 1")];
    let v = quarter(last[0], seed + 2);
    add(it, f32s(&it.cpu, &v, &last), f32s(&it.gpu, &v, &last), 3.0, 2);
    // x3: i32 of the base shape, with ties.
    let v: Vec<i32> = quarter(numel, seed + 3).into_iter().map(|x| x.round() as i32).collect();
    let (c, g) = (
        Tensor::from_slice(&v, dims.to_vec(), &it.cpu).expect("input"),
        Tensor::from_slice(&v, dims.to_vec(), &it.gpu).expect("input"),
    );
    add(it, c, g, 3.0, 0);
    // x4: bool of the broadcast shape.
    let v: Vec<bool> = quarter(bd.iter().product(), seed + 4).into_iter().map(|x| x > 0.0).collect();
    let (c, g) = (
        Tensor::from_slice(&v, bd.clone(), &it.cpu).expect("input"),
        Tensor::from_slice(&v, bd.clone(), &it.gpu).expect("input"),
    );
    add(it, c, g, 1.0, 0);
    // x5: a rank-0 data tensor.
    let v = [quarter(1, seed + 5)[0]];
    add(it, f32s(&it.cpu, &v, &[]), f32s(&it.gpu, &v, &[]), 3.0, 2);
}

/// The devices of the windowed property: the CPU reference and two wgpu
/// devices binding 8 KiB windows, one per kernel-form profile, with
/// lavapipe's 32 storage buffers per stage on any adapter (so the same
/// programs split or are refused everywhere), and subgroups off: the row
/// kernels' workgroup-memory combine is fuzzed here, their subgroup
/// combine by [`devices`] (where the adapter has subgroups).
fn windowed_devices() -> Option<&'static Devices> {
    static DEVS: OnceLock<Option<Devices>> = OnceLock::new();
    DEVS.get_or_init(|| {
        let with = |forms: lazuli::wgpu::forms::KernelForms| {
            let opts = lazuli::WgpuDeviceOptions {
                kernel_forms: Some(forms),
                binding_window: Some(8 << 10),
                max_storage_buffers: Some(32),
                subgroups: Some(false),
                ..Default::default()
            };
            Device::wgpu_with(opts).ok()
        };
        common::wgpu()?;
        Some((
            Device::cpu(),
            with(lazuli::wgpu::forms::KernelForms::software())?,
            with(lazuli::wgpu::forms::KernelForms::gpu())?,
            with(tiled_matmul())?,
        ))
    })
    .as_ref()
}

/// Whether `e` is a backend's `TooLarge`.
fn too_large(e: &lazuli::ExecError) -> bool {
    match e {
        lazuli::ExecError::Backend { source, .. } => matches!(source, lazuli::BackendError::TooLarge { .. }),
        lazuli::ExecError::Failed { cause, .. } | lazuli::ExecError::Poisoned { cause, .. } => too_large(cause),
        _ => false,
    }
}

/// Runs a program on both devices and compares the outputs.
fn run(p: &Program) -> Result<(), String> {
    let Some(devs) = devices() else { return Ok(()) };
    run_on(p, devs, false).map(|_| ())
}

/// Runs a program on the CPU and one of the wgpu devices of `devs` and
/// compares the outputs; `Ok(false)` when `windowed` and the wgpu device
/// refused a kernel as too large for its bindings.
fn run_on(p: &Program, devs: &Devices, windowed: bool) -> Result<bool, String> {
    let (cpu, software, gpu_forms, tiled) = devs;
    let (gpu, forms) = match p.seed % 4 {
        0 | 2 => (software, "software"),
        1 => (gpu_forms, "gpu"),
        _ => (tiled, "gpu, tiled matmul forced"),
    };
    let mut it = Interp {
        cpu: cpu.clone(),
        gpu: gpu.clone(),
        pool: Vec::new(),
        log: vec![format!("kernel forms: {forms}")],
        gpu_sync: None,
    };
    inputs(&mut it, &p.dims, p.seed);
    let n_inputs = it.pool.len();
    for s in &p.steps {
        it.step(*s);
    }
    match it.gpu_sync.take() {
        Some(e) if windowed && too_large(&e) => return Ok(false),
        Some(e) => return Err(format!("wgpu sync: {e}\nprogram:\n{}", it.log.join("\n"))),
        None => {}
    }
    // Outputs: the last three values and every fifth earlier one.
    let mut outs: Vec<Val> = it.pool[n_inputs..].iter().rev().take(3).cloned().collect();
    outs.extend(it.pool[n_inputs..].iter().step_by(5).cloned());
    if outs.is_empty() {
        return Ok(true);
    }
    lazuli::sync(&outs.iter().map(|v| &v.cpu).collect::<Vec<_>>())
        .map_err(|e| format!("cpu sync: {e}\nprogram:\n{}", it.log.join("\n")))?;
    match lazuli::sync(&outs.iter().map(|v| &v.gpu).collect::<Vec<_>>()) {
        Err(e) if windowed && too_large(&e) => return Ok(false),
        r => r.map_err(|e| format!("wgpu sync: {e}\nprogram:\n{}", it.log.join("\n")))?,
    }
    for (k, v) in outs.iter().enumerate() {
        let want = v.cpu.to_scalars().map_err(|e| format!("cpu read: {e}\nprogram:\n{}", it.log.join("\n")))?;
        let got = match v.gpu.to_scalars() {
            Err(e) if windowed && too_large(&e) => return Ok(false),
            r => r.map_err(|e| format!("wgpu read: {e}\nprogram:\n{}", it.log.join("\n")))?,
        };
        let tol = if v.exact() { 0.0 } else { 2e-5 * (1 + v.depth) as f64 * v.bound.clamp(1.0, 1e6) };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (g, w) = (g.as_f64(), w.as_f64());
            let ok = (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol + 1e-5 * w.abs() * v.depth as f64;
            if !ok {
                return Err(format!(
                    "output {k} ({}{}, exact: {}, rounded depth {}, bound {}): element {i}: wgpu {g}, cpu {w} (tolerance {tol})\nprogram:\n{}",
                    v.dtype(),
                    v.cpu.shape(),
                    v.exact(),
                    v.depth,
                    v.bound,
                    it.log.join("\n")
                ));
            }
        }
    }
    Ok(true)
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => Just(1usize),
        3 => Just(2usize),
        3 => Just(3usize),
        2 => Just(5usize),
        2 => Just(7usize),
        1 => Just(0usize),
        1 => Just(33usize),
    ]
}

fn program() -> impl Strategy<Value = Program> {
    let step = (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(op, a, b, c)| Step { op, a, b, c });
    (prop::collection::vec(dim(), 1..=3), any::<u64>(), prop::collection::vec(step, 10..=60))
        .prop_map(|(dims, seed, steps)| Program { dims, seed, steps })
}

/// Programs for the windowed property: base shapes whose values span a
/// few 8 KiB windows.
fn windowed_program() -> impl Strategy<Value = Program> {
    let dim = prop_oneof![Just(33usize), Just(65usize)];
    let step = (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(op, a, b, c)| Step { op, a, b, c });
    (prop::collection::vec(dim, 2..=2), any::<u64>(), prop::collection::vec(step, 10..=40))
        .prop_map(|(dims, seed, steps)| Program { dims, seed, steps })
}

/// A program to run at three base shapes of one rank: dims of at least 2,
/// so that the size-1 pattern of the broadcast input (set by the seed) and
/// with it the graph's structure stay the same across the three.
fn sized_program() -> impl Strategy<Value = (Program, [Vec<usize>; 2])> {
    let dim = || prop_oneof![Just(2usize), Just(3usize), Just(5usize), Just(7usize), Just(12usize), Just(17usize)];
    let step = (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(op, a, b, c)| Step { op, a, b, c });
    (1..=3usize).prop_flat_map(move |rank| {
        (
            prop::collection::vec(dim(), rank),
            prop::collection::vec(dim(), rank),
            prop::collection::vec(dim(), rank),
            any::<u64>(),
            prop::collection::vec(step.clone(), 10..=40),
        )
            .prop_map(|(a, b, c, seed, steps)| (Program { dims: a, seed, steps }, [b, c]))
    })
}

/// A program to run at four base shapes whose dims keep one step each
/// (`a`, `a + d`, `a + 2d`, `a + 3d`; a step may be 0), so that the
/// graphs' sizes keep a step too where the program's view attributes
/// follow the dims (the compile-ahead thread, see `lazuli_executor`'s
/// `ahead`, then compiles the last one or two ahead).
fn stepped_program() -> impl Strategy<Value = (Program, Vec<usize>)> {
    let dim = || prop_oneof![Just(2usize), Just(3usize), Just(5usize), Just(8usize)];
    let delta = || prop_oneof![Just(0usize), Just(1usize), Just(2usize), Just(3usize)];
    let step = (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()).prop_map(|(op, a, b, c)| Step { op, a, b, c });
    (1..=3usize).prop_flat_map(move |rank| {
        (
            prop::collection::vec(dim(), rank),
            prop::collection::vec(delta(), rank),
            any::<u64>(),
            prop::collection::vec(step.clone(), 10..=40),
        )
            .prop_map(|(dims, deltas, seed, steps)| (Program { dims, seed, steps }, deltas))
    })
}

fn cases() -> u32 {
    std::env::var("LAZULI_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(500)
}

proptest! {
    #![proptest_config(Config {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
        max_shrink_iters: 2000,
        ..Config::default()
    })]

    #[test]
    fn random_graphs_match_the_cpu_reference(p in program()) {
        if let Err(e) = run(&p) {
            prop_assert!(false, "{}", e);
        }
    }
}

proptest! {
    #![proptest_config(Config {
        cases: (cases() / 32).max(1),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
        max_shrink_iters: 2000,
        ..Config::default()
    })]

    #[test]
    fn random_graphs_on_windowed_bindings_match_the_cpu_reference(p in windowed_program()) {
        let Some(devs) = windowed_devices() else { return Ok(()) };
        match run_on(&p, devs, true) {
            Ok(ran) => prop_assume!(ran, "a kernel needs more storage bindings than the adapter has"),
            Err(e) => prop_assert!(false, "{}", e),
        }
    }
}

/// Elementwise ops the fuzzer never records, each with the reason: every
/// other op of `UnaryOp::ALL` and `BinaryOp::ALL` must be reached (see
/// `fuzzer_covers_every_elementwise_op`).
const NOT_FUZZED: &[(&str, &str)] = &[
    ("logical_not", "bool values come from comparisons; logical ops are fuzzed through and/or/xor"),
    ("isnan", "programs keep values finite, so the result would be constant"),
    ("isinf", "programs keep values finite, so the result would be constant"),
];

/// The fuzzer reaches every elementwise op (from the IR's `ALL` lists) but
/// those of [`NOT_FUZZED`]: programs of every step kind and many choices
/// are recorded on the CPU device alone (no adapter needed, nothing runs)
/// and the op names of their IR collected. A new op fails here until the
/// interpreter records it or it is declared in `NOT_FUZZED`.
#[test]
fn fuzzer_covers_every_elementwise_op() {
    use lazuli::ir::{BinaryOp, UnaryOp};
    let cpu = Device::cpu();
    let mut text = String::new();
    for seed in 0..4u64 {
        let mut it = Interp { cpu: cpu.clone(), gpu: cpu.clone(), pool: Vec::new(), log: Vec::new(), gpu_sync: None };
        inputs(&mut it, &[2, 3], seed);
        for op in 0..22u8 {
            for b in 0..24u8 {
                for c in [0u8, 1, 2, 5] {
                    // The sync step (the last kind) runs the program: skip it.
                    if op % 22 != 21 {
                        // Recent values, or any value (the exact inputs among them).
                        let a = if c.is_multiple_of(2) { b % 4 } else { 192 + b };
                        it.step(Step { op, a, b, c });
                    }
                    // Keep the pool small: the latest values and the inputs.
                    if it.pool.len() > 40 {
                        let dropped: Vec<Val> = it.pool.drain(6..30).collect();
                        text.push_str(&lazuli::debug::ir_text(&dropped.iter().map(|v| &v.cpu).collect::<Vec<_>>()));
                    }
                }
            }
        }
        let outs: Vec<&Tensor> = it.pool.iter().map(|v| &v.cpu).collect();
        text.push_str(&lazuli::debug::ir_text(&outs));
    }
    let names = UnaryOp::ALL.iter().map(|o| o.name()).chain(BinaryOp::ALL.iter().map(|o| o.name()));
    let missing: Vec<&str> =
        names.filter(|n| !NOT_FUZZED.iter().any(|(m, _)| m == n) && !text.contains(&format!(" = {n}("))).collect();
    assert!(missing.is_empty(), "elementwise ops the fuzzer never records: {missing:?}");
    for (n, _) in NOT_FUZZED {
        assert!(!text.contains(&format!(" = {n}(")), "{n} is fuzzed: drop it from NOT_FUZZED");
    }
}

// Regression tests for bugs the fuzzer found (see docs/reliability-findings.md).

/// Finding 1: a kernel over a zero-size operand broadcast against a size-1
/// dim lowered to WGSL dividing by the zero dim (`i % 0u`), which naga
/// rejects, so the whole sync failed to compile.
#[test]
fn zero_size_broadcast_compiles() {
    for d in common::devices() {
        let a = Tensor::from_slice(&[true], [1, 1], &d).unwrap();
        let b = Tensor::from_slice::<bool>(&[], [0], &d).unwrap();
        let x = a.logical_xor(&b).unwrap().cast(DType::F32).unwrap().neg().unwrap();
        assert_eq!(x.dims(), &[1, 0]);
        assert!(x.to_vec::<f32>().unwrap().is_empty(), "on {}", d.name());
        // The same through a reduction over the empty axis and a softmax.
        let y = Tensor::zeros([2, 0, 3], DType::F32, &d).unwrap().exp().unwrap();
        assert_eq!(y.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(), vec![0.0; 6]);
        assert!(y.softmax(1).unwrap().to_vec::<f32>().unwrap().is_empty());
        assert!(y.sum(&[0], false).unwrap().to_vec::<f32>().unwrap().is_empty());
    }
}

/// Finding 1b: a reduction over axes that are all empty indexed the
/// reduced block with `r / 0u` (same cause, in the reduction kernel).
#[test]
fn reduction_over_only_empty_axes_compiles() {
    for d in common::devices() {
        let x = Tensor::from_slice::<i32>(&[], [0, 0], &d).unwrap().neg().unwrap();
        assert_eq!(x.sum(&[], false).unwrap().item::<i32>().unwrap(), 0, "on {}", d.name());
        let y = Tensor::from_slice::<f32>(&[], [2, 0, 0], &d).unwrap().abs().unwrap();
        assert_eq!(y.sum(&[1, 2], true).unwrap().to_vec::<f32>().unwrap(), vec![0.0, 0.0]);
    }
}

proptest! {
    #![proptest_config(Config {
        cases: (cases() / 10).max(1),
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
        max_shrink_iters: 500,
        ..Config::default()
    })]

    /// Symbolic sizes: the same program at three base shapes on the same
    /// devices. Where the graphs differ only in sizes, the second compiles
    /// as a size variant of the first (kernels generic over sizes, see
    /// `lazuli_wgpu::generic`) and the third reuses those kernels with its
    /// own sizes; every size matches the CPU reference.
    #[test]
    fn random_graphs_at_several_sizes_match_the_cpu_reference((p, others) in sized_program()) {
        let [b, c] = others;
        for dims in [p.dims.clone(), b, c] {
            let sized = Program { dims: dims.clone(), ..p.clone() };
            if let Err(e) = run(&sized) {
                prop_assert!(false, "at base shape {dims:?}: {}", e);
            }
        }
    }

    /// Sizes compiled ahead: the same program at four base shapes whose
    /// dims keep a step, so the third and fourth may run plans compiled
    /// on the compile-ahead thread; every size matches the CPU reference.
    #[test]
    fn random_graphs_at_stepped_sizes_match_the_cpu_reference((p, deltas) in stepped_program()) {
        for k in 0..4 {
            let dims: Vec<usize> = p.dims.iter().zip(&deltas).map(|(a, d)| a + k * d).collect();
            let sized = Program { dims: dims.clone(), ..p.clone() };
            if let Err(e) = run(&sized) {
                prop_assert!(false, "at base shape {dims:?}: {}", e);
            }
        }
    }
}
