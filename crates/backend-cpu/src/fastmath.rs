//! Branch-free f32 `exp`, `tanh`, `sigmoid`, `erf` and `gelu` over slices, written so the
//! compiler vectorizes the loops (Cephes-style range reduction and
//! polynomials, selects instead of branches).
//!
//! Each function first computes every element with the fast formula on a
//! clamped input, then fixes up the rare elements outside the formula's
//! range (NaN, overflow, denormal results) with the `f64` reference
//! definition ([`lazuli_ir::semantics`]), so edge cases match the
//! reference exactly. Inside the range
//! the results are within a few ulp of the correctly rounded value
//! (checked against `f64` in the tests below).
//!
//! Rejected alternative: evaluating in `f64` through libm, as the
//! reference did. It is exact but costs a scalar call per element, which
//! made transcendental chains compute-bound instead of memory-bound.

use lazuli_ir::semantics::{float_unary, FloatUnary};
use lazuli_ir::UnaryOp;

/// The `f64` reference of a float function ([`lazuli_ir::semantics`]).
pub(crate) fn reference(op: UnaryOp) -> fn(f64) -> f64 {
    match float_unary(op) {
        Some(FloatUnary::Map(f)) => f,
        other => unreachable!("{op:?} has no float reference: {other:?}"),
    }
}

/// `exp` is evaluated by the fast path for inputs in this range.
const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;

/// e^x for x in [EXP_LO, EXP_HI] (no range checks).
#[inline(always)]
fn exp_core(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Round to nearest by the 1.5 * 2^23 trick: plain adds and integer
    // ops, so the loop vectorizes (`round` would be a libm call without
    // SSE4.1, and `as i32` a saturating scalar conversion). The low bits of
    // `t` hold n exactly.
    const MAGIC: f32 = 12_582_912.0;
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let r = x - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n by building the exponent bits (n is in -126..=127 here).
    let scale = f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    y * scale
}

/// Defines `pub(crate) fn $name(x, out)` calling `$generic`, compiled a
/// second time for AVX2 and chosen at run time when the CPU has it (twice
/// the lanes of the SSE2 baseline; no FMA, so results are identical).
macro_rules! dispatch {
    ($(#[$m:meta])* $name:ident => $generic:ident) => {
        $(#[$m])*
        pub(crate) fn $name(x: &[f32], out: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                #[target_feature(enable = "avx2")]
                fn avx2(x: &[f32], out: &mut [f32]) {
                    $generic(x, out)
                }
                // SAFETY: the CPU supports AVX2 (checked just above), the
                // only precondition of a `target_feature` function.
                #[allow(unsafe_code)]
                return unsafe { avx2(x, out) };
            }
            $generic(x, out)
        }
    };
}

dispatch!(
    /// `out[i] = exp(x[i])`.
    exp => exp_generic
);
dispatch!(
    /// `out[i] = tanh(x[i])`.
    tanh => tanh_generic
);
dispatch!(
    /// `out[i] = 1 / (1 + exp(-x[i]))`.
    sigmoid => sigmoid_generic
);
dispatch!(
    /// `out[i] = erf(x[i])`.
    erf => erf_generic
);
dispatch!(
    /// `out[i] = x[i] / 2 * erfc(-x[i] / sqrt(2))` (GELU, erf form).
    gelu => gelu_generic
);

/// `x[i] = exp(x[i])` in place, through [`exp`] over a stack block at a
/// time (no allocation).
pub(crate) fn exp_in_place(x: &mut [f32]) {
    let mut tmp = [0f32; 256];
    for c in x.chunks_mut(tmp.len()) {
        let t = &mut tmp[..c.len()];
        t.copy_from_slice(c);
        exp(t, c);
    }
}

#[inline(always)]
fn exp_generic(x: &[f32], out: &mut [f32]) {
    let mut outside = false;
    for (o, &v) in out.iter_mut().zip(x) {
        outside |= !(EXP_LO..=EXP_HI).contains(&v);
        *o = exp_core(v.clamp(EXP_LO, EXP_HI));
    }
    if outside {
        fix(x, out, |v| !(EXP_LO..=EXP_HI).contains(&v), reference(UnaryOp::Exp));
    }
}

#[inline(always)]
fn tanh_generic(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = tanh_core(v);
    }
    if x.iter().fold(false, |a, v| a | v.is_nan()) {
        fix(x, out, f32::is_nan, reference(UnaryOp::Tanh));
    }
}

/// tanh as a [13/6] rational function of x on |x| <= 7.9 (Eigen's
/// `generic_fast_tanh_float` coefficients); beyond that tanh rounds to
/// +-1 in f32 anyway. One division, no exp.
#[inline(always)]
fn tanh_core(v: f32) -> f32 {
    let x = v.clamp(-7.905_311, 7.905_311);
    let x2 = x * x;
    let mut p = -2.760_768_5e-16f32;
    p = p * x2 + 2.000_188e-13;
    p = p * x2 - 8.604_672e-11;
    p = p * x2 + 5.122_297e-8;
    p = p * x2 + 1.485_722_4e-5;
    p = p * x2 + 6.372_619_3e-4;
    p = p * x2 + 4.893_524_6e-3;
    let mut q = 1.198_258_4e-6f32;
    q = q * x2 + 1.185_347e-4;
    q = q * x2 + 2.268_434_6e-3;
    q = q * x2 + 4.893_525e-3;
    let y = x * p / q;
    // Tiny |x|: tanh(x) rounds to x.
    if v.abs() < 4e-4 {
        v
    } else {
        y
    }
}

#[inline(always)]
fn sigmoid_generic(x: &[f32], out: &mut [f32]) {
    let mut outside = false;
    for (o, &v) in out.iter_mut().zip(x) {
        let m = -v;
        outside |= !(EXP_LO..=EXP_HI).contains(&m);
        *o = 1.0 / (1.0 + exp_core(m.clamp(EXP_LO, EXP_HI)));
    }
    if outside {
        fix(x, out, |v| !(EXP_LO..=EXP_HI).contains(&-v), reference(UnaryOp::Sigmoid));
    }
}

/// erf as a [13/8] rational function of x on |x| <= 4 (Eigen's
/// `generic_fast_erf_float` coefficients, from XLA); erf(4) rounds to 1
/// in f32, so larger inputs are clamped. Within 4.3e-7 of the f64 erf,
/// absolute and relative (the tests sweep it). One division, no exp.
#[inline(always)]
fn erf_core(v: f32) -> f32 {
    let x = v.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_4e-10f32;
    p = p * x2 + 2.770_681_5e-8;
    p = p * x2 - 2.101_024e-6;
    p = p * x2 - 5.692_506_2e-5;
    p = p * x2 - 7.349_906_4e-4;
    p = p * x2 - 2.954_6e-3;
    p = p * x2 - 1.609_603_3e-2;
    let mut q = -1.456_607_15e-5f32;
    q = q * x2 - 2.133_740_5e-4;
    q = q * x2 - 1.682_827e-3;
    q = q * x2 - 7.373_329_3e-3;
    q = q * x2 - 1.426_473_9e-2;
    x * p / q
}

#[inline(always)]
fn erf_generic(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = erf_core(v);
    }
    if x.iter().fold(false, |a, v| a | v.is_nan()) {
        fix(x, out, f32::is_nan, reference(UnaryOp::Erf));
    }
}

/// Below this, `1 + erf(x / sqrt(2))` loses too many bits to cancellation
/// for the fast GELU; those elements (and NaN) take the `f64` definition,
/// which uses `erfc`.
const GELU_LO: f32 = -1.0;

#[inline(always)]
fn gelu_generic(x: &[f32], out: &mut [f32]) {
    let mut outside = false;
    for (o, &v) in out.iter_mut().zip(x) {
        outside |= v.is_nan() || v < GELU_LO;
        *o = 0.5 * v * (1.0 + erf_core(v * std::f32::consts::FRAC_1_SQRT_2));
    }
    if outside {
        fix(x, out, |v| v.is_nan() || v < GELU_LO, reference(UnaryOp::Gelu));
    }
}

/// Recomputes the elements selected by `bad` with the `f64` definition.
#[cold]
fn fix(x: &[f32], out: &mut [f32], bad: impl Fn(f32) -> bool, f: impl Fn(f64) -> f64) {
    for (o, &v) in out.iter_mut().zip(x) {
        if bad(v) {
            *o = f(v as f64) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Vec<f32> {
        let mut v: Vec<f32> = (-200_000..=200_000).map(|i| i as f32 * 1e-4).collect();
        v.extend((-1000..=1000).map(|i| i as f32 * 0.1));
        v.extend([0.0, -0.0, 1e-30, -1e-30, 1e-8, f32::MIN_POSITIVE, 88.5, -87.5, -103.0, -104.0, 89.0, 1e30, -1e30]);
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        v
    }

    fn check(name: &str, f: fn(&[f32], &mut [f32]), r: fn(f64) -> f64, tol: f64) {
        let x = sweep();
        let mut y = vec![0.0f32; x.len()];
        f(&x, &mut y);
        for (&v, &got) in x.iter().zip(&y) {
            let want = r(v as f64) as f32;
            if want.is_nan() {
                assert!(got.is_nan(), "{name}({v}) = {got}, want NaN");
                continue;
            }
            if want == got {
                continue;
            }
            let rel = ((got as f64 - want as f64) / want as f64).abs();
            assert!(
                rel <= tol || (want.abs() < 1e-37 && got.abs() < 1e-37),
                "{name}({v}) = {got}, want {want} (rel {rel:e})"
            );
        }
    }

    #[test]
    fn exp_is_accurate() {
        check("exp", exp, reference(UnaryOp::Exp), 4e-7);
    }

    #[test]
    fn exp_in_place_matches_exp() {
        let x = sweep();
        let mut want = vec![0.0f32; x.len()];
        exp(&x, &mut want);
        // Lengths around the block size, and empty.
        for n in [0, 1, 255, 256, 257, 700, x.len()] {
            let mut got = x[..n].to_vec();
            exp_in_place(&mut got);
            for (i, (g, w)) in got.iter().zip(&want[..n]).enumerate() {
                assert!(g.to_bits() == w.to_bits(), "exp_in_place(x[{i}] = {}) = {g}, want {w}", x[i]);
            }
        }
    }

    #[test]
    fn tanh_is_accurate() {
        check("tanh", tanh, reference(UnaryOp::Tanh), 1e-6);
    }

    #[test]
    fn sigmoid_is_accurate() {
        check("sigmoid", sigmoid, reference(UnaryOp::Sigmoid), 4e-7);
    }

    #[test]
    fn erf_is_accurate() {
        check("erf", erf, reference(UnaryOp::Erf), 5e-7);
    }

    #[test]
    fn gelu_is_accurate() {
        check("gelu", gelu, reference(UnaryOp::Gelu), 1e-6);
    }
}
