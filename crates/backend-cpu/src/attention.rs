//! Fused scaled dot-product attention (`Op::Attention`): the reference
//! semantics written on the op, computed block by block.
//!
//! One call computes every requested part of one attention problem (the
//! parts of a kernel share their operands): per batch slice and block of
//! [`BLOCK_Q`] queries, the scores `Q_blk K^T` (a block of queries against
//! every key, never the whole `[t_q, t_k]` matrix) go through the `gemm`
//! crate, then the masked softmax row by row, then `P V` (forward) or
//! `dP = dO V^T`, `dS = P * (dP - delta)`, `dQ = dS K s`, `dK += dS^T Q s`,
//! `dV += P^T dO` (backward, FlashAttention-2's equations, with `P`
//! recomputed from the given log-sum-exp). Causal blocks stop at the last
//! key their queries can see. Batch slices run on the rayon pool; a
//! problem with fewer slices than threads lets each product split itself
//! instead. f32 computes in f32, f64 in f64, f16 and bf16 widened to f32.

use crate::matmul::{gemm_strided, Dims, Strided};
use crate::memory::Memory;
use crate::storage::CpuData;
use half::{bf16, f16};
use lazuli_executor::BackendError;
use lazuli_ir::{AttentionMask, AttentionPart, DType, Graph, NodeId, Op};
use rayon::prelude::*;
use std::borrow::Cow;

/// Queries per block: the score block is `BLOCK_Q x t_k`.
pub(crate) const BLOCK_Q: usize = 64;

/// Products with fewer multiply-adds than this stay on one thread.
const PAR_FLOPS: usize = 1 << 21;

/// Computes the attention parts `outputs` (nodes of `graph` sharing their
/// operands and attributes) from the operands' data `arg(k)`.
pub(crate) fn attention<'a>(
    mem: &Memory,
    graph: &Graph,
    outputs: &[NodeId],
    arg: &dyn Fn(usize) -> &'a CpuData,
) -> Result<Vec<CpuData>, BackendError> {
    let first = graph.node(outputs[0]);
    let Op::Attention { attrs, .. } = first.op else { unreachable!("attention step of a non-attention node") };
    let parts: Vec<AttentionPart> = outputs
        .iter()
        .map(|&o| match graph.node(o).op {
            Op::Attention { part, .. } => part,
            _ => unreachable!("attention step of a non-attention node"),
        })
        .collect();
    let dims = |k: usize| graph.node(first.inputs[k]).shape.dims().to_vec();
    let (qd, kd, vd) = (dims(0), dims(1), dims(2));
    let nf = attrs.forward_operands();
    let tq = qd[qd.len() - 2];
    let d = qd[qd.len() - 1];
    let tk = kd[kd.len() - 2];
    let dv = vd[vd.len() - 1];
    // Batch dims: those of any output, less its trailing one or two.
    let out_dims = first.shape.dims();
    let lead = if parts[0] == AttentionPart::LogSumExp { 1 } else { 2 };
    let batch = out_dims[..out_dims.len() - lead].to_vec();
    let offsets = |shape: &[usize], tail: usize| -> Result<Vec<usize>, BackendError> {
        let r = shape.len();
        // A mask may have fewer dims than two: pad to [.., 1, 1].
        let lead_dims: Vec<usize> = if r >= 2 { shape[..r - 2].to_vec() } else { Vec::new() };
        let st = crate::layout::broadcast_strides(&lead_dims, &batch);
        let mut v = mem.vec(batch.iter().product())?;
        // One offset per batch slice (one slice when there is no batch).
        crate::layout::walk(&batch, [&st], |[o]| v.push(o * tail));
        Ok(v)
    };
    let mut p = Problem {
        tq,
        tk,
        d,
        dv,
        causal: attrs.causal,
        q_off: offsets(&qd, tq * d)?,
        k_off: offsets(&kd, tk * d)?,
        v_off: offsets(&vd, tk * dv)?,
        m_off: Vec::new(),
        m_rs: 0,
        m_cs: 0,
        scale: scalar_f64(arg(3)),
    };
    if attrs.mask != AttentionMask::None {
        let md = dims(4);
        let r = md.len();
        let at = |back: usize| if r >= back { md[r - back] } else { 1 };
        let (mt, ms) = (at(2), at(1));
        p.m_off = offsets(&md, mt * ms)?;
        p.m_rs = if mt == 1 { 0 } else { ms };
        p.m_cs = if ms == 1 { 0 } else { 1 };
    }
    let nb = p.q_off.len();
    let grad = |k: usize| parts.iter().any(|x| x.is_grad()).then(|| arg(nf + k));
    let (go, lse, delta) = (grad(0), grad(1), grad(2));
    let mask = (attrs.mask != AttentionMask::None).then(|| arg(4));
    let want = Want {
        o: parts.contains(&AttentionPart::Out),
        lse: parts.contains(&AttentionPart::LogSumExp),
        dq: parts.contains(&AttentionPart::GradQ),
        dk: parts.contains(&AttentionPart::GradK),
        dv: parts.contains(&AttentionPart::GradV),
    };
    let dtype = first.dtype;
    let results = match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            let r = solve::<f32>(mem, &p, nb, [arg(0), arg(1), arg(2)], mask, [go, lse, delta], want)?;
            match dtype {
                DType::F32 => r.try_into_data(|v| Ok(CpuData::F32(v)))?,
                DType::F16 => r.try_into_data(|v| Ok(CpuData::F16(mem.collect(v.len(), |i| f16::from_f32(v[i]))?)))?,
                _ => r.try_into_data(|v| Ok(CpuData::BF16(mem.collect(v.len(), |i| bf16::from_f32(v[i]))?)))?,
            }
        }
        DType::F64 => {
            let r = solve::<f64>(mem, &p, nb, [arg(0), arg(1), arg(2)], mask, [go, lse, delta], want)?;
            r.try_into_data(|v| Ok(CpuData::F64(v)))?
        }
        _ => unreachable!("attention operands share one float dtype in a verified graph"),
    };
    let out: Vec<CpuData> = parts
        .iter()
        .map(|part| {
            let i = match part {
                AttentionPart::Out => 0,
                AttentionPart::LogSumExp => 1,
                AttentionPart::GradQ => 2,
                AttentionPart::GradK => 3,
                AttentionPart::GradV => 4,
            };
            results[i].clone().expect("every requested part is computed")
        })
        .collect();
    debug_assert!(out.iter().all(|o| o.dtype() == dtype));
    Ok(out)
}

/// The sizes and operand layout of one attention problem.
struct Problem {
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
    causal: bool,
    /// Per batch slice: element offset of the slice in q, k, v, the mask.
    q_off: Vec<usize>,
    k_off: Vec<usize>,
    v_off: Vec<usize>,
    m_off: Vec<usize>,
    /// Mask strides along queries and keys (0 where it broadcasts).
    m_rs: usize,
    m_cs: usize,
    scale: f64,
}

impl Problem {
    /// Keys query `i` can see at all: all of them, or `0..=i` when causal.
    fn keys(&self, i: usize) -> usize {
        if self.causal {
            (i + 1).min(self.tk)
        } else {
            self.tk
        }
    }
}

/// Which parts to compute.
#[derive(Clone, Copy)]
struct Want {
    o: bool,
    lse: bool,
    dq: bool,
    dk: bool,
    dv: bool,
}

impl Want {
    fn grads(self) -> bool {
        self.dq || self.dk || self.dv
    }
}

/// A mask as the computation reads it.
#[derive(Clone, Copy)]
enum Mask<'a, T> {
    /// Added to the scaled scores.
    Add(&'a [T]),
    /// Nonzero where a key stays.
    Keep(&'a [u8]),
}

/// `x` in the computation's precision: borrowed when it already is,
/// else converted (f16 and bf16 widened).
fn as_real<'a, T: Real>(mem: &Memory, x: &'a CpuData) -> Result<Cow<'a, [T]>, BackendError> {
    if let Some(v) = T::view(x) {
        return Ok(Cow::Borrowed(v));
    }
    Ok(Cow::Owned(match x {
        CpuData::F32(v) => mem.collect(v.len(), |i| T::from_f64(v[i] as f64))?,
        CpuData::F64(v) => mem.collect(v.len(), |i| T::from_f64(v[i]))?,
        CpuData::F16(v) => mem.collect(v.len(), |i| T::from_f64(v[i].to_f64()))?,
        CpuData::BF16(v) => mem.collect(v.len(), |i| T::from_f64(v[i].to_f64()))?,
        _ => unreachable!("attention operands are floats in a verified graph"),
    }))
}

/// Converts the operands to `T` and computes the parts `want`.
#[allow(clippy::too_many_arguments)] // The problem, its operands and what to compute.
fn solve<T: Real>(
    mem: &Memory,
    p: &Problem,
    nb: usize,
    qkv: [&CpuData; 3],
    mask: Option<&CpuData>,
    grads: [Option<&CpuData>; 3],
    want: Want,
) -> Result<Results<T>, BackendError> {
    let (q, k, v) = (as_real::<T>(mem, qkv[0])?, as_real::<T>(mem, qkv[1])?, as_real::<T>(mem, qkv[2])?);
    let add;
    let mask = match mask {
        None => None,
        Some(CpuData::Bool(keep)) => Some(Mask::Keep(&keep[..])),
        Some(m) => {
            add = as_real::<T>(mem, m)?;
            Some(Mask::Add(&add[..]))
        }
    };
    let g = match grads {
        [Some(go), Some(lse), Some(delta)] => Some([as_real::<T>(mem, go)?, as_real(mem, lse)?, as_real(mem, delta)?]),
        _ => None,
    };
    let ins =
        Inputs { q: &q, k: &k, v: &v, mask, grads: g.as_ref().map(|[go, lse, delta]| GradsRef { go, lse, delta }) };
    compute(mem, p, nb, &ins, want)
}

/// The extra operands of the gradient parts: `dO`, the log-sum-exp and
/// `delta = rowsum(dO * O)`.
#[derive(Clone, Copy)]
struct GradsRef<'a, T> {
    go: &'a [T],
    lse: &'a [T],
    delta: &'a [T],
}

/// The operands of one problem.
struct Inputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    mask: Option<Mask<'a, T>>,
    grads: Option<GradsRef<'a, T>>,
}

/// The float types the computation runs in.
trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + bytemuck::Zeroable
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    const NAN: Self;
    fn from_f64(x: f64) -> Self;
    /// `row[j] = exp(row[j] - shift)` for every `j` (f32: the vectorized
    /// [`crate::fastmath::exp`], not a libm call per element).
    fn exp_shifted(row: &mut [Self], shift: Self);
    fn ln(self) -> Self;
    fn is_nan(self) -> bool;
    /// The data as `Self` when it is stored so.
    fn view(x: &CpuData) -> Option<&[Self]>;
}

impl Real for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    const NAN: f32 = f32::NAN;
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    fn exp_shifted(row: &mut [f32], shift: f32) {
        for x in row.iter_mut() {
            *x -= shift;
        }
        crate::fastmath::exp_in_place(row);
    }
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn view(x: &CpuData) -> Option<&[f32]> {
        match x {
            CpuData::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Real for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    const NAN: f64 = f64::NAN;
    fn from_f64(x: f64) -> f64 {
        x
    }
    fn exp_shifted(row: &mut [f64], shift: f64) {
        for x in row.iter_mut() {
            *x = (*x - shift).exp();
        }
    }
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
    fn view(x: &CpuData) -> Option<&[f64]> {
        match x {
            CpuData::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// The rank-0 scale as f64.
fn scalar_f64(x: &CpuData) -> f64 {
    match x {
        CpuData::F32(v) => v[0] as f64,
        CpuData::F64(v) => v[0],
        CpuData::F16(v) => v[0].to_f64(),
        CpuData::BF16(v) => v[0].to_f64(),
        _ => unreachable!("the attention scale is a float in a verified graph"),
    }
}

/// The five parts, each computed when requested.
struct Results<T> {
    o: Option<Vec<T>>,
    lse: Option<Vec<T>>,
    dq: Option<Vec<T>>,
    dk: Option<Vec<T>>,
    dv: Option<Vec<T>>,
}

impl<T> Results<T> {
    fn try_into_data(
        self,
        f: impl Fn(Vec<T>) -> Result<CpuData, BackendError>,
    ) -> Result<[Option<CpuData>; 5], BackendError> {
        let g = |x: Option<Vec<T>>| x.map(&f).transpose();
        Ok([g(self.o)?, g(self.lse)?, g(self.dq)?, g(self.dk)?, g(self.dv)?])
    }
}

/// One batch slice's share of every output.
struct SliceOut<'a, T> {
    o: Option<&'a mut [T]>,
    lse: Option<&'a mut [T]>,
    dq: Option<&'a mut [T]>,
    dk: Option<&'a mut [T]>,
    dv: Option<&'a mut [T]>,
}

fn compute<T: Real>(
    mem: &Memory,
    p: &Problem,
    nb: usize,
    ins: &Inputs<'_, T>,
    want: Want,
) -> Result<Results<T>, BackendError> {
    let alloc = |on: bool, n: usize| -> Result<Option<Vec<T>>, BackendError> {
        on.then(|| mem.zeroed::<T>(nb * n)).transpose()
    };
    // The log-sum-exp is needed by the output's own normalization only;
    // it is computed whenever the forward runs.
    let mut r = Results {
        o: alloc(want.o, p.tq * p.dv)?,
        lse: alloc(want.lse, p.tq)?,
        dq: alloc(want.dq, p.tq * p.d)?,
        dk: alloc(want.dk, p.tk * p.d)?,
        dv: alloc(want.dv, p.tk * p.dv)?,
    };
    let mut o = chunks(&mut r.o, p.tq * p.dv, nb);
    let mut lse = chunks(&mut r.lse, p.tq, nb);
    let mut dq = chunks(&mut r.dq, p.tq * p.d, nb);
    let mut dk = chunks(&mut r.dk, p.tk * p.d, nb);
    let mut dv = chunks(&mut r.dv, p.tk * p.dv, nb);
    let slices: Vec<SliceOut<'_, T>> = (0..nb)
        .map(|b| SliceOut { o: o[b].take(), lse: lse[b].take(), dq: dq[b].take(), dk: dk[b].take(), dv: dv[b].take() })
        .collect();
    let threads = crate::threads::available();
    let flops = nb * p.tq * p.tk * (p.d + p.dv);
    let (outer, inner) = if flops < PAR_FLOPS || threads < 2 {
        (false, 1)
    } else if nb >= threads {
        (true, 1)
    } else {
        (false, threads)
    };
    let run = |(b, s): (usize, SliceOut<'_, T>)| slice(mem, p, b, ins, want, s, inner);
    if outer {
        crate::threads::note(threads);
        slices.into_par_iter().enumerate().try_for_each(run)?;
    } else {
        slices.into_iter().enumerate().try_for_each(run)?;
    }
    Ok(r)
}

/// `buf` split into `nb` slices of `n` elements (all `None` when the part
/// is not computed or empty).
fn chunks<T>(buf: &mut Option<Vec<T>>, n: usize, nb: usize) -> Vec<Option<&mut [T]>> {
    let mut v: Vec<Option<&mut [T]>> = Vec::with_capacity(nb);
    if let Some(b) = buf.as_mut().filter(|_| n > 0) {
        v.extend(b.chunks_mut(n).map(Some));
    }
    v.resize_with(nb, || None);
    v
}

/// One batch slice: every block of queries.
fn slice<T: Real>(
    mem: &Memory,
    p: &Problem,
    b: usize,
    ins: &Inputs<'_, T>,
    want: Want,
    mut out: SliceOut<'_, T>,
    threads: usize,
) -> Result<(), BackendError> {
    let (tq, tk, d) = (p.tq, p.tk, p.d);
    if tq == 0 {
        return Ok(());
    }
    let q = &ins.q[p.q_off[b]..];
    let k = &ins.k[p.k_off[b]..];
    let v = &ins.v[p.v_off[b]..];
    let scale = T::from_f64(p.scale);
    let bq = BLOCK_Q.min(tq);
    // Scores (then probabilities) and, for gradients, dP of one block.
    let mut s: Vec<T> = mem.vec(bq * tk)?;
    s.resize(bq * tk, T::ZERO);
    let mut dp: Vec<T> = if want.grads() { mem.vec(bq * tk)? } else { Vec::new() };
    dp.resize(if want.grads() { bq * tk } else { 0 }, T::ZERO);
    let forward = want.o || want.lse;
    for i0 in (0..tq).step_by(BLOCK_Q) {
        let rows = BLOCK_Q.min(tq - i0);
        // Keys any query of the block can see: the block's product width.
        let kw = p.keys(i0 + rows - 1);
        if kw > 0 {
            // s = Q_blk K^T over the visible keys (row stride kw).
            let qa = Strided { data: &q[i0 * d..], rs: d, cs: 1 };
            let kt = Strided { data: k, rs: 1, cs: d };
            gemm_strided(qa, kt, &mut s[..rows * kw], Dims { m: rows, k: d, n: kw }, false, threads, T::ONE);
            if d == 0 {
                s[..rows * kw].fill(T::ZERO);
            }
        }
        // Scale and mask in place: removed keys get -inf, past a row's
        // causal limit the value is never read.
        for ii in 0..rows {
            let i = i0 + ii;
            let row = &mut s[ii * kw..(ii + 1) * kw];
            for (j, x) in row.iter_mut().enumerate().take(p.keys(i)) {
                let mut val = *x * scale;
                if let Some(m) = ins.mask {
                    let at = p.m_off[b] + i * p.m_rs + j * p.m_cs;
                    match m {
                        Mask::Add(a) => val = val + a[at],
                        Mask::Keep(keep) => {
                            if keep[at] == 0 {
                                val = T::NEG_INF;
                            }
                        }
                    }
                }
                *x = val;
            }
        }
        if forward {
            forward_block(p, i0, rows, kw, &mut s, v, &mut out, threads);
        }
        if let Some(g) = ins.grads {
            let operands = BlockOperands { q, k, v, mask: ins.mask, grads: g };
            backward_block(p, b, i0, rows, kw, &mut s, &mut dp, &operands, &mut out, scale, threads);
        }
    }
    Ok(())
}

/// The forward of one block: softmax rows of `s` (masked scores, row
/// stride `kw`) into probabilities, the log-sum-exp, and `O = P V`.
#[allow(clippy::too_many_arguments)] // One block's coordinates, buffers and operands.
fn forward_block<T: Real>(
    p: &Problem,
    i0: usize,
    rows: usize,
    kw: usize,
    s: &mut [T],
    v: &[T],
    out: &mut SliceOut<'_, T>,
    threads: usize,
) {
    let dv = p.dv;
    // Per row: NaN output for a row whose keys are all removed (a row
    // without keys, t_k = 0, sums nothing: output 0).
    let mut dead = [false; BLOCK_Q];
    for ii in 0..rows {
        let i = i0 + ii;
        let n = p.keys(i);
        let row = &mut s[ii * kw..(ii + 1) * kw];
        let mut m = T::NEG_INF;
        let mut nan = false;
        for &x in &row[..n] {
            if x.is_nan() {
                nan = true;
            } else if x > m {
                m = x;
            }
        }
        let lse;
        if nan {
            row[..n].fill(T::NAN);
            lse = T::NAN;
        } else if m == T::NEG_INF {
            // Every key removed (or none exist).
            dead[ii] = n > 0;
            row[..n].fill(T::ZERO);
            lse = T::NEG_INF;
        } else {
            T::exp_shifted(&mut row[..n], m);
            let l = row[..n].iter().fold(T::ZERO, |l, &x| l + x);
            let r = T::ONE / l;
            for x in &mut row[..n] {
                *x = *x * r;
            }
            lse = m + l.ln();
        }
        row[n..].fill(T::ZERO);
        if let Some(o) = out.lse.as_deref_mut() {
            o[i] = lse;
        }
    }
    if let Some(o) = out.o.as_deref_mut() {
        let ob = &mut o[i0 * dv..(i0 + rows) * dv];
        if kw > 0 {
            let pa = Strided { data: &s[..], rs: kw, cs: 1 };
            let vb = Strided { data: v, rs: dv, cs: 1 };
            gemm_strided(pa, vb, ob, Dims { m: rows, k: kw, n: dv }, false, threads, T::ONE);
        }
        for (ii, &dead) in dead.iter().enumerate().take(rows) {
            if dead {
                ob[ii * dv..(ii + 1) * dv].fill(T::NAN);
            }
        }
    }
}

/// One batch slice's operands as the backward of a block reads them.
#[derive(Clone, Copy)]
struct BlockOperands<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    mask: Option<Mask<'a, T>>,
    grads: GradsRef<'a, T>,
}

/// The backward of one block from its masked scores `s` (row stride
/// `kw`): `P` from the log-sum-exp, `dP = dO V^T` into `dp`, `dS`, and the
/// three gradient products.
#[allow(clippy::too_many_arguments)] // One block's coordinates, buffers and operands.
fn backward_block<T: Real>(
    p: &Problem,
    b: usize,
    i0: usize,
    rows: usize,
    kw: usize,
    s: &mut [T],
    dp: &mut [T],
    ops: &BlockOperands<'_, T>,
    out: &mut SliceOut<'_, T>,
    scale: T,
    threads: usize,
) {
    if kw == 0 {
        return;
    }
    let BlockOperands { q, k, v, mask, grads: g } = *ops;
    let (tq, d, dv) = (p.tq, p.d, p.dv);
    let go = &g.go[b * tq * dv..];
    let lse = &g.lse[b * tq..];
    let delta = &g.delta[b * tq..];
    // P = exp(S - lse): exactly 0 past the causal limit; NaN for a row
    // whose log-sum-exp is -inf (every key removed).
    for ii in 0..rows {
        let i = i0 + ii;
        let n = p.keys(i);
        let l = lse[i];
        let row = &mut s[ii * kw..(ii + 1) * kw];
        if l == T::NEG_INF {
            row[..n].fill(T::NAN);
        } else {
            T::exp_shifted(&mut row[..n], l);
        }
        row[n..].fill(T::ZERO);
    }
    // dP = dO_blk V^T.
    let ga = Strided { data: &go[i0 * dv..], rs: dv, cs: 1 };
    let vt = Strided { data: v, rs: 1, cs: dv };
    gemm_strided(ga, vt, &mut dp[..rows * kw], Dims { m: rows, k: dv, n: kw }, false, threads, T::ONE);
    if dv == 0 {
        dp[..rows * kw].fill(T::ZERO);
    }
    if let Some(dvo) = out.dv.as_deref_mut() {
        // dV[..kw] += P^T dO_blk.
        let pt = Strided { data: &s[..], rs: 1, cs: kw };
        let gb = Strided { data: &go[i0 * dv..], rs: dv, cs: 1 };
        gemm_strided(pt, gb, &mut dvo[..kw * dv], Dims { m: kw, k: rows, n: dv }, true, threads, T::ONE);
    }
    // dS * scale, into dp: 0 past the causal limit and where a keep mask
    // removes the key (the composition's `where` passes no gradient there).
    for ii in 0..rows {
        let i = i0 + ii;
        let n = p.keys(i);
        let (pr, dr) = (&s[ii * kw..(ii + 1) * kw], &mut dp[ii * kw..(ii + 1) * kw]);
        for j in 0..n {
            dr[j] = pr[j] * (dr[j] - delta[i]) * scale;
        }
        if let Some(Mask::Keep(keep)) = mask {
            for (j, x) in dr.iter_mut().enumerate().take(n) {
                if keep[p.m_off[b] + i * p.m_rs + j * p.m_cs] == 0 {
                    *x = T::ZERO;
                }
            }
        }
        dr[n..].fill(T::ZERO);
    }
    if let Some(dqo) = out.dq.as_deref_mut() {
        let dsa = Strided { data: &dp[..], rs: kw, cs: 1 };
        let kb = Strided { data: k, rs: d, cs: 1 };
        gemm_strided(dsa, kb, &mut dqo[i0 * d..(i0 + rows) * d], Dims { m: rows, k: kw, n: d }, false, threads, T::ONE);
    }
    if let Some(dko) = out.dk.as_deref_mut() {
        let dst = Strided { data: &dp[..], rs: 1, cs: kw };
        let qb = Strided { data: &q[i0 * d..], rs: d, cs: 1 };
        gemm_strided(dst, qb, &mut dko[..kw * d], Dims { m: kw, k: rows, n: d }, true, threads, T::ONE);
    }
}
