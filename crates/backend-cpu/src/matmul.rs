//! Batched matrix multiplication `[.., m, k] @ [.., k, n]` with broadcast
//! batch dims.
//!
//! f32 and f64 go through the `gemm` crate's packed SIMD GEMM (f32
//! accumulation for f32; the kernels use FMA where the CPU has it, so sums
//! are reassociated and contracted, never widened); f16 and bf16 are widened to f32,
//! multiplied there and rounded back; integers use plain wrapping loops
//! (i-p-j order, contiguous inner loop). Large products run on the rayon
//! pool: batches split by matrix, a single matrix inside the GEMM (the
//! integer loops by row panels).
//!
//! Measured on 2 cores (1024³ f32): `gemm` on the rayon pool 10–11 ms,
//! `matrixmultiply` with its `threading` feature 12.7 ms, `matrixmultiply`
//! split into row panels over rayon 22 ms.

use crate::elem::Num;
use crate::layout::{broadcast_strides, walk, View};
use crate::memory::Memory;
use crate::storage::CpuData;
use half::{bf16, f16};
use lazuli_executor::BackendError;
use rayon::prelude::*;

/// Multiplies `a` (shape `sa`) by `b` (shape `sb`) into shape `out`.
pub(crate) fn matmul(
    mem: &Memory,
    a: &CpuData,
    sa: &[usize],
    b: &CpuData,
    sb: &[usize],
    out: &[usize],
) -> Result<CpuData, BackendError> {
    let r = out.len();
    let (m, n) = (out[r - 2], out[r - 1]);
    let k = sa[sa.len() - 1];
    let batch = &out[..r - 2];
    let ta = broadcast_strides(&sa[..sa.len() - 2], batch);
    let tb = broadcast_strides(&sb[..sb.len() - 2], batch);
    let mut pairs = mem.vec(batch.iter().product())?;
    walk(batch, [&ta, &tb], |[i, j]| pairs.push((i * m * k, j * k * n)));
    let dims = Dims { m, k, n };
    Ok(match (a, b) {
        (CpuData::F32(x), CpuData::F32(y)) if k > 0 => {
            // GEMM with beta = 0 writes every element: a pooled buffer will do.
            let CpuData::F32(c) = mem.take(lazuli_ir::DType::F32, pairs.len() * m * n)? else {
                unreachable!("the pool returns the dtype asked for")
            };
            CpuData::F32(batched_into(x, y, &pairs, dims, gemm_f32, c))
        }
        (CpuData::F32(x), CpuData::F32(y)) => CpuData::F32(batched(mem, x, y, &pairs, dims, gemm_f32)?),
        (CpuData::F64(x), CpuData::F64(y)) => CpuData::F64(batched(mem, x, y, &pairs, dims, gemm_f64)?),
        (CpuData::F16(x), CpuData::F16(y)) => {
            let xf = mem.collect(x.len(), |i| x[i].to_f32())?;
            let yf = mem.collect(y.len(), |i| y[i].to_f32())?;
            let c = batched(mem, &xf, &yf, &pairs, dims, gemm_f32)?;
            CpuData::F16(mem.collect(c.len(), |i| f16::from_f32(c[i]))?)
        }
        (CpuData::BF16(x), CpuData::BF16(y)) => {
            let xf = mem.collect(x.len(), |i| x[i].to_f32())?;
            let yf = mem.collect(y.len(), |i| y[i].to_f32())?;
            let c = batched(mem, &xf, &yf, &pairs, dims, gemm_f32)?;
            CpuData::BF16(mem.collect(c.len(), |i| bf16::from_f32(c[i]))?)
        }
        _ => crate::storage::same_all2!(a, b, x, y => batched(mem, x, y, &pairs, dims, gemm_loops)?),
    })
}

/// Whether a product may read an operand through `view` in place: every
/// stride non-negative, and the matrix dims (the last two) stepping
/// through memory where they have more than one element (the `gemm` crate
/// takes any such strides, so a transposed, sliced or broadcast operand
/// needs no copy).
pub(crate) fn readable_in_place(view: &View) -> bool {
    let r = view.dims.len();
    r >= 2
        && view.offset >= 0
        && view.strides.iter().all(|&s| s >= 0)
        && (r - 2..r).all(|d| view.dims[d] <= 1 || view.strides[d] > 0)
}

/// `a @ b` into shape `out` (`[.., m, n]`, broadcast batch dims) for f32
/// or f64 operands read in place through their views `va` (`[.., m, k]`)
/// and `vb` (`[.., k, n]`) of the buffers `a` and `b` (see
/// [`readable_in_place`]), each product one `gemm` call on strided
/// operands.
pub(crate) fn matmul_views(
    mem: &Memory,
    a: &CpuData,
    va: &View,
    b: &CpuData,
    vb: &View,
    out: &[usize],
) -> Result<CpuData, BackendError> {
    Ok(match (a, b) {
        (CpuData::F32(x), CpuData::F32(y)) => {
            let CpuData::F32(c) = mem.take(lazuli_ir::DType::F32, out.iter().product())? else {
                unreachable!("the pool returns the dtype asked for")
            };
            CpuData::F32(strided_products(x, va, y, vb, out, c, 1.0))
        }
        (CpuData::F64(x), CpuData::F64(y)) => {
            let CpuData::F64(c) = mem.take(lazuli_ir::DType::F64, out.iter().product())? else {
                unreachable!("the pool returns the dtype asked for")
            };
            CpuData::F64(strided_products(x, va, y, vb, out, c, 1.0))
        }
        _ => unreachable!("strided products are planned for f32 and f64 only"),
    })
}

/// [`matmul_views`] on typed data; `c` has the output's length and any
/// contents.
fn strided_products<T: Num + Copy + 'static>(
    a: &[T],
    va: &View,
    b: &[T],
    vb: &View,
    out: &[usize],
    mut c: Vec<T>,
    one: T,
) -> Vec<T> {
    let r = out.len();
    let (m, n) = (out[r - 2], out[r - 1]);
    let k = va.dims[va.dims.len() - 1];
    let d = Dims { m, k, n };
    if m * n == 0 {
        return c;
    }
    if k == 0 {
        c.fill(T::ZERO);
        return c;
    }
    let batch = &out[..r - 2];
    let with = |v: &View, rows: usize, cols: usize| {
        let mut dims = batch.to_vec();
        dims.extend([rows, cols]);
        v.expand(&dims)
    };
    let (va, vb) = (with(va, m, k), with(vb, k, n));
    let batch_strides = |v: &View| v.strides[..r - 2].iter().map(|&s| s as usize).collect::<Vec<_>>();
    let (sa, sb) = (batch_strides(&va), batch_strides(&vb));
    let mut offsets = Vec::with_capacity(batch.iter().product());
    walk(batch, [&sa, &sb], |[i, j]| offsets.push((va.offset as usize + i, vb.offset as usize + j)));
    /// The matrix of view `v` (rank `r`) at element `off` of `data`.
    fn matrix<'a, T>(v: &View, data: &'a [T], off: usize, r: usize) -> Strided<'a, T> {
        Strided { data: &data[off..], rs: v.strides[r - 2] as usize, cs: v.strides[r - 1] as usize }
    }
    let one_product = |(cm, &(oa, ob)): (&mut [T], &(usize, usize)), threads: usize| {
        gemm_strided(matrix(&va, a, oa, r), matrix(&vb, b, ob, r), cm, d, false, threads, one)
    };
    let threads = crate::threads::available();
    let flops = offsets.len() * m * n * k;
    if threads < 2 || flops < PAR_FLOPS {
        c.chunks_exact_mut(m * n).zip(&offsets).for_each(|p| one_product(p, 1));
    } else if offsets.len() >= threads {
        crate::threads::note(threads);
        c.par_chunks_exact_mut(m * n).zip(&offsets).for_each(|p| one_product(p, 1));
    } else {
        c.chunks_exact_mut(m * n).zip(&offsets).for_each(|p| one_product(p, threads));
    }
    c
}

/// Matrix sizes of one product: `[m, k] @ [k, n]`.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    /// Rows of the product.
    pub m: usize,
    /// The reduced dimension.
    pub k: usize,
    /// Columns of the product.
    pub n: usize,
}

/// Products with fewer multiply-adds than this run on one thread.
pub(crate) const PAR_FLOPS: usize = 1 << 21;

/// Element types with a packed SIMD GEMM (`gemm` crate).
pub(crate) trait GemmFloat: Num + bytemuck::Zeroable {
    /// `c = a @ b^T` for `a` (`m x k`, rows `lda` apart), `b` (`n x k`,
    /// rows `ldb` apart) and row-major `c` (`m x n`, every element
    /// written), without copying, on up to `threads` threads.
    #[allow(clippy::too_many_arguments)] // Operands with their strides, sizes and threads: the BLAS contract.
    fn gemm_bt(a: &[Self], lda: usize, b: &[Self], ldb: usize, c: &mut [Self], d: Dims, threads: usize);
}

impl GemmFloat for f32 {
    fn gemm_bt(a: &[f32], lda: usize, b: &[f32], ldb: usize, c: &mut [f32], d: Dims, threads: usize) {
        packed_strided(a, lda, b, ldb, true, c, d, threads, 0.0, 1.0)
    }
}

impl GemmFloat for f64 {
    fn gemm_bt(a: &[f64], lda: usize, b: &[f64], ldb: usize, c: &mut [f64], d: Dims, threads: usize) {
        packed_strided(a, lda, b, ldb, true, c, d, threads, 0.0, 1.0)
    }
}

/// `c = a @ b` through the `gemm` crate, as matmul does: the
/// baseline that benchmarks compare convolution against (`lazuli bench`).
/// `a` is `m x k`, `b` is `k x n`, `c` is `m x n`, all row-major; it runs
/// on the rayon pool when the product is large.
pub fn sgemm(a: &[f32], b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
    let threads = if m * k * n >= PAR_FLOPS { crate::threads::available() } else { 1 };
    gemm_f32(a, b, c, Dims { m, k, n }, threads)
}

fn batched<T: Num>(
    mem: &Memory,
    a: &[T],
    b: &[T],
    pairs: &[(usize, usize)],
    d: Dims,
    gemm: Gemm<T>,
) -> Result<Vec<T>, BackendError> {
    Ok(batched_into(a, b, pairs, d, gemm, mem.zeroed(pairs.len() * d.m * d.n)?))
}

/// A GEMM kernel: `c = a @ b` for one product, on up to `threads` threads.
type Gemm<T> = fn(&[T], &[T], &mut [T], Dims, usize);

/// Like `batched`, into `out` (zeros unless the GEMM overwrites every
/// element and `k > 0`).
fn batched_into<T: Num>(a: &[T], b: &[T], pairs: &[(usize, usize)], d: Dims, gemm: Gemm<T>, mut out: Vec<T>) -> Vec<T> {
    let mn = d.m * d.n;
    if mn == 0 || d.k == 0 {
        return out;
    }
    let threads = crate::threads::available();
    let flops = pairs.len() * mn * d.k;
    let one = |(c, &(ia, ib)): (&mut [T], &(usize, usize)), threads: usize| {
        gemm(&a[ia..ia + d.m * d.k], &b[ib..ib + d.k * d.n], c, d, threads)
    };
    if threads < 2 || flops < PAR_FLOPS {
        out.chunks_exact_mut(mn).zip(pairs).for_each(|p| one(p, 1));
    } else if pairs.len() >= threads {
        crate::threads::note(threads);
        out.par_chunks_exact_mut(mn).zip(pairs).for_each(|p| one(p, 1));
    } else {
        // Few large products: each one splits itself over the pool.
        out.chunks_exact_mut(mn).zip(pairs).for_each(|p| one(p, threads));
    }
    out
}

fn gemm_loops<T: Num>(a: &[T], b: &[T], c: &mut [T], d: Dims, threads: usize) {
    if threads > 1 {
        crate::threads::note(threads);
        // Row panels, a few per thread.
        let rows = d.m.div_ceil(threads * 2).max(1);
        return c.par_chunks_mut(rows * d.n).enumerate().for_each(|(p, c)| {
            let m = c.len() / d.n;
            let r0 = p * rows;
            gemm_loops(&a[r0 * d.k..(r0 + m) * d.k], b, c, Dims { m, ..d }, 1)
        });
    }
    for i in 0..d.m {
        let crow = &mut c[i * d.n..(i + 1) * d.n];
        for p in 0..d.k {
            let av = a[i * d.k + p];
            let brow = &b[p * d.n..(p + 1) * d.n];
            for (cv, &bv) in crow.iter_mut().zip(brow) {
                *cv = T::add(*cv, T::mul(av, bv));
            }
        }
    }
}

fn gemm_f32(a: &[f32], b: &[f32], c: &mut [f32], d: Dims, threads: usize) {
    packed(a, b, c, d, threads, 0.0, 1.0)
}

fn gemm_f64(a: &[f64], b: &[f64], c: &mut [f64], d: Dims, threads: usize) {
    packed(a, b, c, d, threads, 0.0, 1.0)
}

/// `c = a @ b` (row-major, every element of `c` written) through the
/// `gemm` crate's packed, SIMD, cache-blocked kernels; with `threads > 1`
/// it splits the product over the rayon pool itself.
fn packed<T: Copy + 'static>(a: &[T], b: &[T], c: &mut [T], d: Dims, threads: usize, zero: T, one: T) {
    packed_strided(a, d.k, b, d.n, false, c, d, threads, zero, one)
}

/// [`packed`] with the rows of `a` `lda` apart and `b` read as `k x n`
/// with rows `ldb` apart, or, when `b_transposed`, as the transpose of an
/// `n x k` matrix with rows `ldb` apart (the `gemm` crate takes any
/// strides, so nothing is copied).
// `gemm` takes raw pointers with strides; the asserts check that every
// index those strides reach lies inside the slices, which is the whole
// contract.
#[allow(unsafe_code)]
#[allow(clippy::too_many_arguments)] // Operands with their strides, sizes, threads and the two scalars of the BLAS contract.
fn packed_strided<T: Copy + 'static>(
    a: &[T],
    lda: usize,
    b: &[T],
    ldb: usize,
    b_transposed: bool,
    c: &mut [T],
    d: Dims,
    threads: usize,
    zero: T,
    one: T,
) {
    // The last element a strided matrix reaches: (rows - 1) * ld + cols.
    let reach = |rows: usize, cols: usize, ld: usize| if rows == 0 || cols == 0 { 0 } else { (rows - 1) * ld + cols };
    let (b_rows, b_cols) = if b_transposed { (d.n, d.k) } else { (d.k, d.n) };
    assert!(lda >= d.k && ldb >= b_cols && c.len() == d.m * d.n);
    assert!(reach(d.m, d.k, lda) <= a.len() && reach(b_rows, b_cols, ldb) <= b.len());
    // (column stride, row stride) of b as a k x n matrix.
    let (b_cs, b_rs) = if b_transposed { (ldb as isize, 1) } else { (1, ldb as isize) };
    let par = if threads > 1 {
        crate::threads::note(threads);
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every index the strides reach is within the slices (the
    // asserts above); `c` is row-major and does not alias `a` or `b`.
    // With `read_dst` false, `c = beta * a @ b` (alpha is ignored).
    unsafe {
        gemm::gemm(
            d.m,
            d.n,
            d.k,
            c.as_mut_ptr(),
            1,
            d.n as isize,
            false,
            a.as_ptr(),
            1,
            lda as isize,
            b.as_ptr(),
            b_cs,
            b_rs,
            zero,
            one,
            false,
            false,
            false,
            par,
        );
    }
}

/// A strided matrix operand of [`gemm_strided`]: elements `(r, c)` at
/// `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a, T> {
    /// The elements.
    pub data: &'a [T],
    /// Row stride in elements.
    pub rs: usize,
    /// Column stride in elements.
    pub cs: usize,
}

/// `c = a @ b`, or `c += a @ b` with `accumulate`, for `a` (`m x k`) and
/// `b` (`k x n`) of any strides and row-major `c` (`m x n`; left as it is
/// when `k = 0`), through the
/// `gemm` crate (f32 and f64), on up to `threads` threads. The fused
/// attention kernels use it for their block products (transposed
/// operands read in place, gradients accumulated across blocks).
// `gemm` takes raw pointers with strides; the asserts check that every
// index those strides reach lies inside the slices.
#[allow(unsafe_code)]
pub(crate) fn gemm_strided<T: Copy + 'static>(
    a: Strided<'_, T>,
    b: Strided<'_, T>,
    c: &mut [T],
    d: Dims,
    accumulate: bool,
    threads: usize,
    one: T,
) {
    if d.m == 0 || d.n == 0 {
        return;
    }
    let reach = |s: &Strided<'_, T>, rows: usize, cols: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * s.rs + (cols - 1) * s.cs + 1
        }
    };
    assert!(c.len() >= d.m * d.n && reach(&a, d.m, d.k) <= a.data.len() && reach(&b, d.k, d.n) <= b.data.len());
    if d.k == 0 {
        // An empty sum: callers start `c` from zeros.
        return;
    }
    let par = if threads > 1 {
        crate::threads::note(threads);
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every index the strides reach is within the slices (the
    // assert above); `c` is row-major with `m * n` elements and does not
    // alias `a` or `b` (it is a distinct `&mut`). With `read_dst`,
    // `c = 1 * c + 1 * a @ b`; without it `c = 1 * a @ b`.
    unsafe {
        gemm::gemm(
            d.m,
            d.n,
            d.k,
            c.as_mut_ptr(),
            1,
            d.n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            one,
            one,
            false,
            false,
            false,
            par,
        );
    }
}
