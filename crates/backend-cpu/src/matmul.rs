//! Batched matrix multiplication `[.., m, k] @ [.., k, n]` with broadcast
//! batch dims.
//!
//! f32 and f64 go through `matrixmultiply`'s packed GEMM (f32 accumulation
//! for f32); f16 is widened to f32, multiplied there and rounded back;
//! integers use plain wrapping loops (i-p-j order, contiguous inner loop).
//! Large products run on the rayon pool: batches split by matrix, a single
//! matrix by row panels.

use crate::elem::Num;
use crate::layout::{broadcast_strides, walk};
use crate::storage::{BufferPool, CpuData};
use half::f16;
use rayon::prelude::*;

/// Multiplies `a` (shape `sa`) by `b` (shape `sb`) into shape `out`.
pub(crate) fn matmul(
    a: &CpuData,
    sa: &[usize],
    b: &CpuData,
    sb: &[usize],
    out: &[usize],
    pool: &BufferPool,
) -> CpuData {
    let r = out.len();
    let (m, n) = (out[r - 2], out[r - 1]);
    let k = sa[sa.len() - 1];
    let batch = &out[..r - 2];
    let ta = broadcast_strides(&sa[..sa.len() - 2], batch);
    let tb = broadcast_strides(&sb[..sb.len() - 2], batch);
    let mut pairs = Vec::new();
    walk(batch, [&ta, &tb], |[i, j]| pairs.push((i * m * k, j * k * n)));
    let dims = Dims { m, k, n };
    match (a, b) {
        (CpuData::F32(x), CpuData::F32(y)) if k > 0 => {
            // GEMM with beta = 0 writes every element: a pooled buffer will do.
            let CpuData::F32(c) = pool.take(lazuli_ir::DType::F32, pairs.len() * m * n) else {
                unreachable!("the pool returns the dtype asked for")
            };
            CpuData::F32(batched_into(x, y, &pairs, dims, gemm_f32, c))
        }
        (CpuData::F32(x), CpuData::F32(y)) => CpuData::F32(batched(x, y, &pairs, dims, gemm_f32)),
        (CpuData::F64(x), CpuData::F64(y)) => CpuData::F64(batched(x, y, &pairs, dims, gemm_f64)),
        (CpuData::F16(x), CpuData::F16(y)) => {
            let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            let yf: Vec<f32> = y.iter().map(|v| v.to_f32()).collect();
            let c = batched(&xf, &yf, &pairs, dims, gemm_f32);
            CpuData::F16(c.into_iter().map(f16::from_f32).collect())
        }
        _ => crate::storage::same_all2!(a, b, x, y => batched(x, y, &pairs, dims, gemm_loops)),
    }
}

/// Matrix sizes of one product.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    k: usize,
    n: usize,
}

/// Products with fewer multiply-adds than this run on one thread.
const PAR_FLOPS: usize = 1 << 21;

fn batched<T: Num>(
    a: &[T],
    b: &[T],
    pairs: &[(usize, usize)],
    d: Dims,
    gemm: fn(&[T], &[T], &mut [T], Dims),
) -> Vec<T> {
    batched_into(a, b, pairs, d, gemm, vec![T::ZERO; pairs.len() * d.m * d.n])
}

/// Like `batched`, into `out` (zeros unless the GEMM overwrites every
/// element and `k > 0`).
fn batched_into<T: Num>(
    a: &[T],
    b: &[T],
    pairs: &[(usize, usize)],
    d: Dims,
    gemm: fn(&[T], &[T], &mut [T], Dims),
    mut out: Vec<T>,
) -> Vec<T> {
    let mn = d.m * d.n;
    if mn == 0 || d.k == 0 {
        return out;
    }
    let threads = rayon::current_num_threads();
    let flops = pairs.len() * mn * d.k;
    if threads < 2 || flops < PAR_FLOPS {
        for (c, &(ia, ib)) in out.chunks_exact_mut(mn).zip(pairs) {
            gemm(&a[ia..ia + d.m * d.k], &b[ib..ib + d.k * d.n], c, d);
        }
    } else if pairs.len() >= threads {
        out.par_chunks_exact_mut(mn).zip(pairs).for_each(|(c, &(ia, ib))| {
            gemm(&a[ia..ia + d.m * d.k], &b[ib..ib + d.k * d.n], c, d);
        });
    } else {
        // Few large products: split each into row panels, one per thread
        // (each panel packs its own copy of B; cheap next to the product).
        let rows = d.m.div_ceil(threads * 2).max(1);
        for (c, &(ia, ib)) in out.chunks_exact_mut(mn).zip(pairs) {
            let a = &a[ia..ia + d.m * d.k];
            let b = &b[ib..ib + d.k * d.n];
            c.par_chunks_mut(rows * d.n).enumerate().for_each(|(p, c)| {
                let m = c.len() / d.n;
                let r0 = p * rows;
                gemm(&a[r0 * d.k..(r0 + m) * d.k], b, c, Dims { m, ..d });
            });
        }
    }
    out
}

fn gemm_loops<T: Num>(a: &[T], b: &[T], c: &mut [T], d: Dims) {
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

// `matrixmultiply`'s GEMM entry points take raw pointers with strides; the
// slices are exactly `m*k`, `k*n` and `m*n` long (checked by the asserts),
// which is the whole contract.
#[allow(unsafe_code)]
fn gemm_f32(a: &[f32], b: &[f32], c: &mut [f32], d: Dims) {
    assert!(a.len() == d.m * d.k && b.len() == d.k * d.n && c.len() == d.m * d.n);
    // SAFETY: row-major strides within the bounds asserted above.
    unsafe {
        matrixmultiply::sgemm(
            d.m,
            d.k,
            d.n,
            1.0,
            a.as_ptr(),
            d.k as isize,
            1,
            b.as_ptr(),
            d.n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            d.n as isize,
            1,
        );
    }
}

// See `gemm_f32`.
#[allow(unsafe_code)]
fn gemm_f64(a: &[f64], b: &[f64], c: &mut [f64], d: Dims) {
    assert!(a.len() == d.m * d.k && b.len() == d.k * d.n && c.len() == d.m * d.n);
    // SAFETY: row-major strides within the bounds asserted above.
    unsafe {
        matrixmultiply::dgemm(
            d.m,
            d.k,
            d.n,
            1.0,
            a.as_ptr(),
            d.k as isize,
            1,
            b.as_ptr(),
            d.n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            d.n as isize,
            1,
        );
    }
}
