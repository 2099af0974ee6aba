//! The KV-cache kernels: `Op::WriteAt` (an update written at positions
//! read from data, in place where the executor donated the base) and
//! `Op::PrefixAttention` (causal attention of new queries over the valid
//! prefix of a cache, grouped-query heads).
//!
//! Positions are data, so every decoding step runs the same program; a
//! position whose update or queries do not fit the cache is
//! [`BackendError::IndexOutOfRange`], never clamped. Attention walks only
//! the keys a query may see (`0..=pos + i`): the work of a step grows with
//! the prefix, not with the cache's length.

use crate::memory::Memory;
use crate::storage::{each_all, CpuData};
use half::{bf16, f16};
use lazuli_executor::{BackendError, IndexError};
use rayon::prelude::*;

/// Queries times keys under which attention runs on the calling thread.
const PAR_WORK: usize = 1 << 15;

/// The positions operand as integers: one (rank 0) or one per row.
pub(crate) fn positions(pos: &CpuData) -> Vec<i128> {
    each_all!(pos, v => v.iter().map(|&x| crate::elem::Elem::to_cv(x).as_i128()).collect())
}

/// The out-of-range error of a position `p` for `len` items along `axis`
/// of a cache of `dims`.
fn out_of_range(op: &str, p: i128, len: usize, axis: usize, dims: &[usize]) -> BackendError {
    BackendError::IndexOutOfRange(Box::new(IndexError {
        op: format!("{op} (writing or reading {len} positions)"),
        index: p,
        axis,
        size: dims[axis],
        shape: lazuli_ir::Shape::new(dims),
    }))
}

/// Writes `update` (`ud`) into `base` (`bd`) at `pos` along `axis`, in
/// place. Every position is checked before anything is written.
pub(crate) fn write_at(
    base: &mut CpuData,
    bd: &[usize],
    update: &CpuData,
    ud: &[usize],
    pos: &[i128],
    axis: usize,
) -> Result<(), BackendError> {
    let size = base.dtype().size_bytes();
    let inner: usize = bd[axis + 1..].iter().product::<usize>() * size;
    let outer: usize = bd[..axis].iter().product();
    let (bn, un) = (bd[axis], ud[axis]);
    // Outer indices per row of dim 0 (when positions are per row).
    let per_row = if axis == 0 { 1 } else { bd[1..axis].iter().product::<usize>().max(1) };
    for &p in pos {
        if p < 0 || p + un as i128 > bn as i128 {
            return Err(out_of_range("write_at", p, un, axis, bd));
        }
    }
    let dst: &mut [u8] = each_all!(base, v => bytemuck::cast_slice_mut(v.as_mut_slice()));
    let src: &[u8] = each_all!(update, v => bytemuck::cast_slice(v.as_slice()));
    for o in 0..outer {
        let p = if pos.len() == 1 { pos[0] } else { pos[o / per_row] } as usize;
        let (from, to) = (o * un * inner, (o * bn + p) * inner);
        dst[to..to + un * inner].copy_from_slice(&src[from..from + un * inner]);
    }
    Ok(())
}

/// A float type attention accumulates in.
trait Acc: Copy + Send + Sync + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> {
    const ZERO: Self;
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
}

impl Acc for f32 {
    const ZERO: f32 = 0.0;
    const NEG_INF: f32 = f32::NEG_INFINITY;
    fn exp(self) -> f32 {
        f32::exp(self)
    }
    fn sub(self, o: f32) -> f32 {
        self - o
    }
    fn div(self, o: f32) -> f32 {
        self / o
    }
}

impl Acc for f64 {
    const ZERO: f64 = 0.0;
    const NEG_INF: f64 = f64::NEG_INFINITY;
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    fn sub(self, o: f64) -> f64 {
        self - o
    }
    fn div(self, o: f64) -> f64 {
        self / o
    }
}

/// Sizes of one prefix attention.
#[derive(Clone, Copy)]
struct AttnDims {
    b: usize,
    h: usize,
    t: usize,
    d: usize,
    g: usize,
    s: usize,
    dv: usize,
}

/// `softmax(q k^T * scale) v` over each query's visible prefix (see the
/// module doc). `qd`, `kd`, `vd` are `[b, h, t, d]`, `[b, g, s, d]`,
/// `[b, g, s, dv]`.
#[allow(clippy::too_many_arguments)] // Three operands with their shapes, the scale, the positions.
pub(crate) fn prefix_attention(
    mem: &Memory,
    q: &CpuData,
    qd: &[usize],
    k: &CpuData,
    kd: &[usize],
    v: &CpuData,
    vd: &[usize],
    scale: &CpuData,
    pos: &[i128],
) -> Result<CpuData, BackendError> {
    let dims = AttnDims { b: qd[0], h: qd[1], t: qd[2], d: qd[3], g: kd[1], s: kd[2], dv: vd[3] };
    for &p in pos {
        if p < 0 || p + dims.t as i128 > dims.s as i128 {
            return Err(out_of_range("prefix_attention", p, dims.t, 2, kd));
        }
    }
    let widen = |x: &[f16]| mem.collect(x.len(), |i| x[i].to_f32());
    let widen_b = |x: &[bf16]| mem.collect(x.len(), |i| x[i].to_f32());
    Ok(match (q, k, v, scale) {
        (CpuData::F32(q), CpuData::F32(k), CpuData::F32(v), CpuData::F32(sc)) => {
            CpuData::F32(attend(mem, q, k, v, sc[0], pos, dims)?)
        }
        (CpuData::F64(q), CpuData::F64(k), CpuData::F64(v), CpuData::F64(sc)) => {
            CpuData::F64(attend(mem, q, k, v, sc[0], pos, dims)?)
        }
        (CpuData::F16(q), CpuData::F16(k), CpuData::F16(v), CpuData::F16(sc)) => {
            let o = attend(mem, &widen(q)?, &widen(k)?, &widen(v)?, sc[0].to_f32(), pos, dims)?;
            CpuData::F16(mem.collect(o.len(), |i| f16::from_f32(o[i]))?)
        }
        (CpuData::BF16(q), CpuData::BF16(k), CpuData::BF16(v), CpuData::BF16(sc)) => {
            let o = attend(mem, &widen_b(q)?, &widen_b(k)?, &widen_b(v)?, sc[0].to_f32(), pos, dims)?;
            CpuData::BF16(mem.collect(o.len(), |i| bf16::from_f32(o[i]))?)
        }
        _ => unreachable!("one float dtype in a verified prefix_attention"),
    })
}

fn attend<T: Acc + 'static>(
    mem: &Memory,
    q: &[T],
    k: &[T],
    v: &[T],
    scale: T,
    pos: &[i128],
    n: AttnDims,
) -> Result<Vec<T>, BackendError> {
    let mut out = mem.vec(n.b * n.h * n.t * n.dv)?;
    out.resize(n.b * n.h * n.t * n.dv, T::ZERO);
    if out.is_empty() {
        return Ok(out);
    }
    let group = n.h / n.g;
    // One task per (row, head): its queries' outputs are contiguous.
    let head = |(bh, o): (usize, &mut [T])| {
        let (b, h) = (bh / n.h, bh % n.h);
        let p = if pos.len() == 1 { pos[0] } else { pos[b] } as usize;
        let kv = (b * n.g + h / group) * n.s;
        let mut scores: Vec<T> = Vec::with_capacity(p + n.t);
        for i in 0..n.t {
            let qi = &q[((bh * n.t) + i) * n.d..][..n.d];
            let visible = p + i + 1;
            scores.clear();
            let mut max = T::NEG_INF;
            for j in 0..visible {
                let kj = &k[(kv + j) * n.d..][..n.d];
                let mut acc = T::ZERO;
                for (a, c) in qi.iter().zip(kj) {
                    acc = acc + *a * *c;
                }
                let sj = acc * scale;
                if sj > max {
                    max = sj;
                }
                scores.push(sj);
            }
            let mut sum = T::ZERO;
            for s in scores.iter_mut() {
                *s = s.sub(max).exp();
                sum = sum + *s;
            }
            let oi = &mut o[i * n.dv..(i + 1) * n.dv];
            for (j, &w) in scores.iter().enumerate() {
                let vj = &v[(kv + j) * n.dv..][..n.dv];
                for (x, y) in oi.iter_mut().zip(vj) {
                    *x = *x + w * *y;
                }
            }
            for x in oi.iter_mut() {
                *x = x.div(sum);
            }
        }
    };
    let work = n.b * n.h * n.t * (pos.iter().copied().max().unwrap_or(0) as usize + n.t) * n.d;
    if work >= PAR_WORK {
        out.par_chunks_mut(n.t * n.dv).enumerate().for_each(head);
    } else {
        out.chunks_mut(n.t * n.dv).enumerate().for_each(head);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_at_checks_then_writes_rows_at_their_positions() {
        // base [2, 1, 4, 2], update [2, 1, 1, 2], positions per row.
        let mut base = CpuData::F32(vec![0.0; 16]);
        let update = CpuData::F32(vec![1.0, 2.0, 3.0, 4.0]);
        write_at(&mut base, &[2, 1, 4, 2], &update, &[2, 1, 1, 2], &[3, 1], 2).unwrap();
        let CpuData::F32(b) = &base else { panic!() };
        assert_eq!(b[6..8], [1.0, 2.0]);
        assert_eq!(b[8 + 2..8 + 4], [3.0, 4.0]);
        assert_eq!(b.iter().filter(|&&x| x != 0.0).count(), 4);
        let err = write_at(&mut base, &[2, 1, 4, 2], &update, &[2, 1, 1, 2], &[4, 0], 2).unwrap_err();
        assert!(matches!(err, BackendError::IndexOutOfRange(_)), "{err}");
    }

    #[test]
    fn prefix_attention_sees_only_the_prefix_and_groups_heads() {
        let mem = Memory::new(None);
        // b 1, h 2, t 1, d 1; g 1, s 4: the one query at position 1 sees keys 0 and 1.
        let q = CpuData::F32(vec![1.0, 2.0]);
        let k = CpuData::F32(vec![0.0, 1.0, 100.0, 100.0]);
        let v = CpuData::F32(vec![1.0, 3.0, 1e6, 1e6]);
        let out = prefix_attention(
            &mem,
            &q,
            &[1, 2, 1, 1],
            &k,
            &[1, 1, 4, 1],
            &v,
            &[1, 1, 4, 1],
            &CpuData::F32(vec![1.0]),
            &[1],
        )
        .unwrap();
        let CpuData::F32(o) = out else { panic!() };
        for (h, &qv) in [1.0f64, 2.0].iter().enumerate() {
            let (w0, w1) = (1.0, (qv).exp());
            let want = (w0 * 1.0 + w1 * 3.0) / (w0 + w1);
            assert!((f64::from(o[h]) - want).abs() < 1e-5, "head {h}: {} vs {want}", o[h]);
        }
    }
}
