//! Index arithmetic shared by the kernels: broadcast strides, a strided
//! walk over an output shape, gathers through per-dimension offset
//! tables (the engine of every view op), and [`View`], a strided view of
//! a buffer that fused loops and products read in place.
//!
//! Loops run an odometer over the outer dimensions and a tight loop over
//! the innermost one, so no per-element allocation or division happens.

use crate::memory::Memory;
use lazuli_executor::BackendError;
use std::borrow::Cow;

/// A strided view of a buffer, in elements.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct View {
    /// Size of each dimension.
    pub dims: Vec<usize>,
    /// Step of each dimension in the buffer (0: broadcast).
    pub strides: Vec<isize>,
    /// Element where index zero lies.
    pub offset: isize,
}

impl View {
    pub(crate) fn contiguous(dims: &[usize]) -> View {
        let mut strides = vec![0isize; dims.len()];
        let mut acc = 1isize;
        for d in (0..dims.len()).rev() {
            strides[d] = acc;
            acc *= dims[d] as isize;
        }
        View { dims: dims.to_vec(), strides, offset: 0 }
    }

    pub(crate) fn is_row_major(&self) -> bool {
        let c = self.collapse();
        c.dims.is_empty() || (c.dims.len() == 1 && c.strides[0] == 1)
    }

    pub(crate) fn reshape(&self, dims: &[usize]) -> Option<View> {
        self.is_row_major().then(|| View { offset: self.offset, ..View::contiguous(dims) })
    }

    pub(crate) fn permute(&self, perm: &[usize]) -> View {
        View {
            dims: perm.iter().map(|&p| self.dims[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }

    /// Numpy broadcast to `out` (right-aligned; size-1 dims get stride 0).
    pub(crate) fn expand(&self, out: &[usize]) -> View {
        let off = out.len() - self.dims.len();
        let strides = (0..out.len())
            .map(|i| if i < off || self.dims[i - off] == 1 { 0 } else { self.strides[i - off] })
            .collect();
        View { dims: out.to_vec(), strides, offset: self.offset }
    }

    pub(crate) fn slice(&self, starts: &[i64], steps: &[i64], lens: &[usize]) -> View {
        let mut offset = self.offset;
        for d in 0..self.dims.len() {
            if lens[d] > 0 {
                offset += starts[d] as isize * self.strides[d];
            }
        }
        let strides = (0..self.dims.len()).map(|d| self.strides[d] * steps[d] as isize).collect();
        View { dims: lens.to_vec(), strides, offset }
    }

    /// Drops size-1 dims and merges adjacent dims that step uniformly.
    pub(crate) fn collapse(&self) -> View {
        let mut dims: Vec<usize> = Vec::new();
        let mut strides: Vec<isize> = Vec::new();
        for (&d, &s) in self.dims.iter().zip(&self.strides) {
            if d == 1 {
                continue;
            }
            match (dims.last_mut(), strides.last_mut()) {
                (Some(ld), Some(ls)) if *ls == s * d as isize => {
                    *ld *= d;
                    *ls = s;
                }
                _ => {
                    dims.push(d);
                    strides.push(s);
                }
            }
        }
        View { dims, strides, offset: self.offset }
    }
}

/// Offset-table entry meaning "no source element: use the fill value".
pub(crate) const FILL: usize = usize::MAX;

/// Row-major strides of `dims`.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![0; dims.len()];
    let mut acc = 1;
    for (i, d) in dims.iter().enumerate().rev() {
        s[i] = acc;
        acc *= *d;
    }
    s
}

/// Strides of `src` read as a tensor of shape `out` under numpy
/// broadcasting: right-aligned, 0 where `src` has size 1 (or is missing).
pub(crate) fn broadcast_strides(src: &[usize], out: &[usize]) -> Vec<usize> {
    let s = strides(src);
    let off = out.len() - src.len();
    (0..out.len()).map(|i| if i < off || src[i - off] == 1 { 0 } else { s[i - off] }).collect()
}

/// Calls `f` with the `K` operand offsets of every element of an output of
/// shape `dims`, in row-major order. `strides[k]` are operand `k`'s strides
/// (one per output dim).
#[inline]
pub(crate) fn walk<const K: usize>(dims: &[usize], strides: [&[usize]; K], mut f: impl FnMut([usize; K])) {
    if dims.contains(&0) {
        return;
    }
    let r = dims.len();
    if r == 0 {
        f([0; K]);
        return;
    }
    let last = dims[r - 1];
    let ls: [usize; K] = std::array::from_fn(|k| strides[k][r - 1]);
    let mut idx = vec![0usize; r - 1];
    let mut base = [0usize; K];
    loop {
        let mut o = base;
        for _ in 0..last {
            f(o);
            for k in 0..K {
                o[k] += ls[k];
            }
        }
        let mut d = r - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            for k in 0..K {
                base[k] += strides[k][d];
            }
            if idx[d] < dims[d] {
                break;
            }
            for k in 0..K {
                base[k] -= strides[k][d] * dims[d];
            }
            idx[d] = 0;
        }
    }
}

/// Builds a tensor whose element at coordinates `c` is
/// `src[sum_d tables[d][c[d]]]`, or `fill` when any entry is [`FILL`].
/// The output shape is given by the table lengths.
pub(crate) fn take_tables<T: Copy + 'static>(
    mem: &Memory,
    src: &[T],
    tables: &[Vec<usize>],
    fill: Option<T>,
) -> Result<Vec<T>, BackendError> {
    let n: usize = tables.iter().map(|t| t.len()).product();
    let mut out = mem.vec(n)?;
    if n == 0 {
        return Ok(out);
    }
    let r = tables.len();
    if r == 0 {
        out.push(src[0]);
        return Ok(out);
    }
    let inner = &tables[r - 1];
    let runs = inner_runs(inner);
    let mut idx = vec![0usize; r - 1];
    loop {
        let mut base = 0usize;
        let mut filled = false;
        for d in 0..r - 1 {
            let t = tables[d][idx[d]];
            if t == FILL {
                filled = true;
                break;
            }
            base += t;
        }
        if filled {
            let v = fill.expect("FILL entries come with a fill value");
            out.extend(std::iter::repeat_n(v, inner.len()));
        } else if let Some(runs) = &runs {
            for run in runs {
                match *run {
                    Run::Copy { at, len } => out.extend_from_slice(&src[base + at..base + at + len]),
                    Run::Splat { at, len } => out.extend(std::iter::repeat_n(src[base + at], len)),
                    Run::Fill { len } => {
                        out.extend(std::iter::repeat_n(fill.expect("FILL entries come with a fill value"), len))
                    }
                }
            }
        } else if let Some(v) = fill {
            out.extend(inner.iter().map(|&t| if t == FILL { v } else { src[base + t] }));
        } else {
            out.extend(inner.iter().map(|&t| src[base + t]));
        }
        let mut d = r - 1;
        loop {
            if d == 0 {
                return Ok(out);
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < tables[d].len() {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// A stretch of an inner offset table that moves as one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Run {
    /// `len` consecutive source elements from offset `at` (a `memcpy`).
    Copy { at: usize, len: usize },
    /// The source element at offset `at`, `len` times (a broadcast).
    Splat { at: usize, len: usize },
    /// `len` fill values (a constant pad).
    Fill { len: usize },
}

/// Cuts an inner offset table into [`Run`]s when they are long enough
/// (at least [`MIN_RUN`] entries on average) for block copies to beat the
/// per-element gather: the contiguous rows of a pad, a slice, a permute
/// that keeps the last dim and a broadcast along the last dim. `None` for
/// tables that jump at almost every entry (a transpose's inner dim).
fn inner_runs(table: &[usize]) -> Option<Vec<Run>> {
    let n = table.len();
    let mut runs = Vec::new();
    let mut j = 0;
    while j < n {
        let at = table[j];
        let mut e = j + 1;
        let run = if at == FILL {
            while e < n && table[e] == FILL {
                e += 1;
            }
            Run::Fill { len: e - j }
        } else if e < n && table[e] == at {
            while e < n && table[e] == at {
                e += 1;
            }
            Run::Splat { at, len: e - j }
        } else {
            while e < n && table[e] != FILL && table[e] == table[e - 1].wrapping_add(1) {
                e += 1;
            }
            Run::Copy { at, len: e - j }
        };
        runs.push(run);
        if runs.len() * MIN_RUN > n {
            return None;
        }
        j = e;
    }
    Some(runs)
}

/// The shortest average [`Run`] worth a block copy.
const MIN_RUN: usize = 8;

/// Splits `dims` around `axis` into (outer, len, inner) element counts.
pub(crate) fn split_axis(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = dims[..axis].iter().product();
    let inner = dims[axis + 1..].iter().product();
    (outer, dims[axis], inner)
}

/// Permutes `src` (of shape `dims`) so that `out.dims[i] = dims[perm[i]]`.
/// The identity permutation borrows `src`.
pub(crate) fn permute<'a, T: Copy + 'static>(
    mem: &Memory,
    src: &'a [T],
    dims: &[usize],
    perm: &[usize],
) -> Result<Cow<'a, [T]>, BackendError> {
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(Cow::Borrowed(src));
    }
    let s = strides(dims);
    let tables = perm.iter().map(|&p| mem.collect(dims[p], |j| j * s[p])).collect::<Result<Vec<_>, _>>()?;
    Ok(Cow::Owned(take_tables(mem, src, &tables, None)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_broadcast_offsets() {
        let out = [2, 3];
        let a = broadcast_strides(&[2, 1], &out);
        let b = broadcast_strides(&[3], &out);
        let mut seen = vec![];
        walk(&out, [&a, &b], |[i, j]| seen.push((i, j)));
        assert_eq!(seen, vec![(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    }

    #[test]
    fn inner_runs_cut_pads_slices_and_broadcasts() {
        let mut pad = vec![FILL; 3];
        pad.extend(10..30);
        pad.extend([FILL; 5]);
        assert_eq!(
            inner_runs(&pad),
            Some(vec![Run::Fill { len: 3 }, Run::Copy { at: 10, len: 20 }, Run::Fill { len: 5 }])
        );
        assert_eq!(inner_runs(&[4; 16]), Some(vec![Run::Splat { at: 4, len: 16 }]));
        // Two contiguous rows back to back (a slice of a wider row), then a
        // broadcast: three runs of 8.
        let mut t: Vec<usize> = (0..8).chain(100..108).collect();
        t.extend([7; 8]);
        assert_eq!(
            inner_runs(&t),
            Some(vec![Run::Copy { at: 0, len: 8 }, Run::Copy { at: 100, len: 8 }, Run::Splat { at: 7, len: 8 }])
        );
        // A transpose's inner dim jumps every entry: gathered element by element.
        assert_eq!(inner_runs(&(0..32).map(|j| j * 5).collect::<Vec<_>>()), None);
        assert_eq!(inner_runs(&[]), Some(vec![]));
    }

    /// Every run shape against the per-element gather it replaces, with
    /// odd sizes, fills on every side and an empty dim.
    #[test]
    fn take_tables_runs_match_the_gather() {
        let mem = Memory::default();
        let src: Vec<i32> = (0..1000).collect();
        let naive = |tables: &[Vec<usize>], fill: i32| -> Vec<i32> {
            let mut out = vec![];
            let dims: Vec<usize> = tables.iter().map(|t| t.len()).collect();
            let n: usize = dims.iter().product();
            for mut lin in 0..n {
                let mut off = 0usize;
                let mut filled = false;
                for d in (0..dims.len()).rev() {
                    let t = tables[d][lin % dims[d]];
                    lin /= dims[d];
                    if t == FILL {
                        filled = true;
                    } else {
                        off += t;
                    }
                }
                out.push(if filled { fill } else { src[off] });
            }
            out
        };
        let mut pad_inner = vec![FILL; 2];
        pad_inner.extend(0..13);
        pad_inner.extend([FILL; 9]);
        let cases: Vec<Vec<Vec<usize>>> = vec![
            vec![vec![FILL, 0, 13, 26, FILL], pad_inner.clone()],
            vec![(0..7).map(|i| i * 40).collect(), (3..20).collect()],
            vec![(0..5).map(|i| i * 3).collect(), vec![2; 11]],
            vec![(0..3).map(|i| i * 100).collect(), (0..9).map(|j| j * 7).collect()],
            vec![vec![], (0..9).collect()],
            vec![(0..4).map(|i| i * 50).collect(), vec![]],
        ];
        for tables in cases {
            let got = take_tables(&mem, &src, &tables, Some(-1)).unwrap();
            assert_eq!(got, naive(&tables, -1), "tables {tables:?}");
            if !tables.iter().flatten().any(|&t| t == FILL) {
                assert_eq!(take_tables(&mem, &src, &tables, None).unwrap(), naive(&tables, -1));
            }
        }
    }

    #[test]
    fn permute_transposes() {
        let x = [0, 1, 2, 3, 4, 5];
        assert_eq!(*permute(&Memory::default(), &x, &[2, 3], &[1, 0]).unwrap(), [0, 3, 1, 4, 2, 5]);
    }
}
