//! Movement kernels: permute, expand, strided slice (negative steps),
//! concat, pad (constant / reflect / edge), gather and scatter-add.
//!
//! Permute, expand, slice and pad are all one gather through
//! per-dimension offset tables (`layout::take_tables`): output coordinate
//! `j` of dim `d` reads source offset `tables[d][j]`. Reshape needs no
//! kernel: the executor shares the operand's storage.

use crate::elem::Num;
use crate::layout::{split_axis, strides, take_tables, FILL};
use crate::memory::Memory;
use crate::storage::{each_all, same_all, same_num2, CpuData};
use lazuli_executor::{BackendError, IndexError};
use lazuli_ir::PadMode;

/// `out.dims[i] = dims[perm[i]]`.
pub(crate) fn permute(mem: &Memory, x: &CpuData, dims: &[usize], perm: &[usize]) -> Result<CpuData, BackendError> {
    Ok(same_all!(x, v => crate::layout::permute(mem, v, dims, perm)?.into_owned()))
}

/// Broadcasts `x` of shape `dims` to `out` (numpy rules).
pub(crate) fn expand(mem: &Memory, x: &CpuData, dims: &[usize], out: &[usize]) -> Result<CpuData, BackendError> {
    let s = crate::layout::broadcast_strides(dims, out);
    let tables = out.iter().zip(&s).map(|(&n, &st)| mem.collect(n, |j| j * st)).collect::<Result<Vec<_>, _>>()?;
    Ok(same_all!(x, v => take_tables(mem, v, &tables, None)?))
}

/// Strided slice: dim `d` of the output takes `starts[d] + j * steps[d]`.
pub(crate) fn slice(
    mem: &Memory,
    x: &CpuData,
    dims: &[usize],
    starts: &[i64],
    steps: &[i64],
    lens: &[usize],
) -> Result<CpuData, BackendError> {
    let s = strides(dims);
    let tables = (0..dims.len())
        .map(|d| mem.collect(lens[d], |j| (starts[d] + j as i64 * steps[d]) as usize * s[d]))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(same_all!(x, v => take_tables(mem, v, &tables, None)?))
}

/// Pads `x`; `value` is the rank-0 fill operand for `PadMode::Constant`.
pub(crate) fn pad(
    mem: &Memory,
    x: &CpuData,
    dims: &[usize],
    before: &[usize],
    after: &[usize],
    mode: PadMode,
    value: Option<&CpuData>,
) -> Result<CpuData, BackendError> {
    let s = strides(dims);
    let tables = (0..dims.len())
        .map(|d| {
            let n = dims[d] as i64;
            mem.collect(dims[d] + before[d] + after[d], |j| {
                let i = j as i64 - before[d] as i64;
                let src = match mode {
                    PadMode::Constant if i < 0 || i >= n => return FILL,
                    PadMode::Constant => i,
                    PadMode::Edge => i.clamp(0, n - 1),
                    // Verified: pads are smaller than the dim, so one reflection suffices.
                    PadMode::Reflect if i < 0 => -i,
                    PadMode::Reflect if i >= n => 2 * (n - 1) - i,
                    PadMode::Reflect => i,
                };
                src as usize * s[d]
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(match value {
        Some(val) => crate::storage::same_all2!(x, val, v, f => take_tables(mem, v, &tables, Some(f[0]))?),
        None => same_all!(x, v => take_tables(mem, v, &tables, None)?),
    })
}

/// Joins `parts` (with shapes `shapes`) along `axis`.
pub(crate) fn concat(
    mem: &Memory,
    parts: &[&CpuData],
    shapes: &[&[usize]],
    axis: usize,
) -> Result<CpuData, BackendError> {
    let outer: usize = shapes[0][..axis].iter().product();
    let chunks: Vec<usize> = shapes.iter().map(|s| s[axis..].iter().product()).collect();
    let total: usize = chunks.iter().sum::<usize>() * outer;
    fn typed<T: Copy + 'static>(
        mem: &Memory,
        parts: Vec<&[T]>,
        chunks: &[usize],
        outer: usize,
        total: usize,
    ) -> Result<Vec<T>, BackendError> {
        let mut out = mem.vec(total)?;
        for o in 0..outer {
            for (p, &c) in parts.iter().zip(chunks) {
                out.extend_from_slice(&p[o * c..(o + 1) * c]);
            }
        }
        Ok(out)
    }
    macro_rules! go {
        ($var:ident) => {{
            let ps: Vec<_> = parts
                .iter()
                .map(|p| match p {
                    CpuData::$var(v) => v.as_slice(),
                    _ => unreachable!("concat operands share a dtype in a verified graph"),
                })
                .collect();
            CpuData::$var(typed(mem, ps, &chunks, outer, total)?)
        }};
    }
    Ok(match parts[0] {
        CpuData::Bool(_) => go!(Bool),
        CpuData::I8(_) => go!(I8),
        CpuData::I16(_) => go!(I16),
        CpuData::I32(_) => go!(I32),
        CpuData::I64(_) => go!(I64),
        CpuData::U8(_) => go!(U8),
        CpuData::U16(_) => go!(U16),
        CpuData::U32(_) => go!(U32),
        CpuData::U64(_) => go!(U64),
        CpuData::F16(_) => go!(F16),
        CpuData::BF16(_) => go!(BF16),
        CpuData::F32(_) => go!(F32),
        CpuData::F64(_) => go!(F64),
    })
}

/// `data.take(indices, axis)`. Negative indices count from the end; an
/// index outside `-n..n` is a [`BackendError::IndexOutOfRange`] naming it.
pub(crate) fn gather(
    mem: &Memory,
    data: &CpuData,
    dims: &[usize],
    axis: usize,
    indices: &CpuData,
) -> Result<CpuData, BackendError> {
    let rows = rows_of("gather", mem, indices, dims, axis)?;
    if data.is_empty() {
        // No row to take (every index was checked): the output is empty
        // too, and the dims around `axis` may be huge.
        return Ok(same_all!(data, v => v.clone()));
    }
    let (outer, n, inner) = split_axis(dims, axis);
    fn typed<T: Copy + 'static>(
        mem: &Memory,
        v: &[T],
        rows: &[usize],
        outer: usize,
        n: usize,
        inner: usize,
    ) -> Result<Vec<T>, BackendError> {
        let mut out = mem.vec(outer * rows.len() * inner)?;
        for o in 0..outer {
            for &r in rows {
                let start = (o * n + r) * inner;
                out.extend_from_slice(&v[start..start + inner]);
            }
        }
        Ok(out)
    }
    Ok(same_all!(data, v => typed(mem, v, &rows, outer, n, inner)?))
}

/// `base` with `src[o, j, i]` added at `[o, indices[j], i]` along `axis`,
/// in index order (so repeated indices sum in the order they appear).
/// Every index is checked, even when no element moves.
pub(crate) fn scatter_add(
    mem: &Memory,
    base: &CpuData,
    dims: &[usize],
    axis: usize,
    indices: &CpuData,
    src: &CpuData,
) -> Result<CpuData, BackendError> {
    let rows = rows_of("scatter_add", mem, indices, dims, axis)?;
    if base.is_empty() {
        // Every index was checked; nothing to add to (the dims around
        // `axis` may be huge).
        return Ok(same_all!(base, v => v.clone()));
    }
    let (outer, n, inner) = split_axis(dims, axis);
    fn typed<T: Num>(
        mem: &Memory,
        base: &[T],
        src: &[T],
        rows: &[usize],
        outer: usize,
        n: usize,
        inner: usize,
    ) -> Result<Vec<T>, BackendError> {
        let mut out = mem.vec(base.len())?;
        out.extend_from_slice(base);
        let m = rows.len();
        for o in 0..outer {
            for (j, &r) in rows.iter().enumerate() {
                let dst = &mut out[(o * n + r) * inner..(o * n + r + 1) * inner];
                let s = &src[(o * m + j) * inner..(o * m + j + 1) * inner];
                for (d, &x) in dst.iter_mut().zip(s) {
                    *d = T::add(*d, x);
                }
            }
        }
        Ok(out)
    }
    Ok(same_num2!(base, src, b, s => typed(mem, b, s, &rows, outer, n, inner)?))
}

/// The rows of dim `axis` of `dims` that `indices` name, counted from the
/// end for negative indices; the first index outside `-n..n` is an error.
fn rows_of(op: &str, mem: &Memory, indices: &CpuData, dims: &[usize], axis: usize) -> Result<Vec<usize>, BackendError> {
    let n = dims[axis];
    let idx: Vec<i128> = each_all!(indices, v => mem.collect(v.len(), |k| crate::elem::Elem::to_cv(v[k]).as_i128())?);
    let mut rows = mem.vec(idx.len())?;
    for &i in &idx {
        let j = if i < 0 { i + n as i128 } else { i };
        if j < 0 || j >= n as i128 {
            return Err(BackendError::IndexOutOfRange(Box::new(IndexError {
                op: op.into(),
                index: i,
                axis,
                size: n,
                shape: lazuli_ir::Shape::new(dims),
            })));
        }
        rows.push(j as usize);
    }
    Ok(rows)
}
