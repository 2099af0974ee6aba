//! Helpers shared by every kernel family: WGSL types of dtypes, literals,
//! row-major index math, and the WGSL helper functions ([`Helper`]:
//! NaN-aware max/min, tanh, erf, pow, casts, Philox) that kernels request
//! through `Writer::use_helper`.

use lazuli_ir::{DType, ScalarValue, Shape};

/// WGSL register type of a dtype (f16 and bf16 compute in f32: see
/// [`super::access`]).
pub(super) fn ty(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "f32",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::Bool => "bool",
        _ => "u32",
    }
}

/// The scalar a binding of dtype `d` stores (see [`super::access::Binding`]):
/// `f16` and `bf16` bindings are declared and accessed as their storage
/// says ([`super::access::Storage::Half`]).
pub(super) fn storage_ty(d: DType) -> &'static str {
    match d {
        DType::Bool => "u32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        DType::U8 => "u8",
        other => ty(other),
    }
}

/// The type of a value written to or read from a binding of dtype `d`
/// in the kernel's text: f32 for f16 and bf16, which the access layer
/// converts ([`super::access`]).
pub(super) fn storage_reg_ty(d: DType) -> &'static str {
    match d {
        DType::Bool => "u32",
        other => ty(other),
    }
}

/// True for the dtypes stored in 16 bits and computed in f32.
pub fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// The dtype a value of `d` has in registers (f16 and bf16 are f32).
pub(super) fn reg(d: DType) -> DType {
    if is_half(d) {
        DType::F32
    } else {
        d
    }
}

pub(super) fn store(d: DType, v: &str) -> String {
    if d == DType::Bool {
        format!("select(0u, 1u, {v})")
    } else {
        v.to_string()
    }
}

/// Row-major strides as u64.
pub(super) fn strides(s: &Shape) -> Vec<u64> {
    s.strides().into_iter().map(|x| x as u64).collect()
}

/// A tree over each group of lanes in the workgroup array `red`: every
/// lane stores its `acc`, then for `h` = `half`, `half / 2`, .., 1 lane
/// `tid` of a group (below `h`) combines `red[lid]` and `red[lid + h]`
/// (as `acc` and `v`), a barrier after each step; the group's first lane
/// then holds its result. Lines indented by `ind`.
pub(super) fn lane_tree(ind: &str, half: u64, tid: &str, combine: &str) -> String {
    format!(
        "{ind}red[lid] = acc;\n{ind}workgroupBarrier();\n{ind}for (var h = {half}u; h > 0u; h = h >> 1u) {{\n{ind}    if ({tid} < h) {{\n{ind}        let acc = red[lid];\n{ind}        let v = red[lid + h];\n{ind}        red[lid] = {combine};\n{ind}    }}\n{ind}    workgroupBarrier();\n{ind}}}\n"
    )
}

/// WGSL expression for coordinate `d` of linear index `var` in `shape`.
pub(super) fn coord(var: &str, shape: &Shape, d: usize) -> String {
    let st = strides(shape);
    let dim = shape.dims()[d] as u64;
    // An empty shape has no coordinates to compute (and a zero dim or
    // stride would be a division by zero, which naga rejects).
    if dim == 1 || shape.numel() == 0 {
        return "0u".into();
    }
    let q = if st[d] == 1 { var.to_string() } else { format!("({var} / {}u)", st[d]) };
    if d == 0 {
        q
    } else {
        format!("({q} % {dim}u)")
    }
}

/// Sum of `terms` as a u32 expression.
pub(super) fn sum(terms: Vec<String>) -> String {
    if terms.is_empty() {
        "0u".into()
    } else {
        terms.join(" + ")
    }
}

/// Index into `from` (broadcasting to `to`, numpy rules) for linear index
/// `var` of `to`.
pub(super) fn bcast_index(var: &str, to: &Shape, from: &Shape) -> String {
    if to == from {
        return var.to_string();
    }
    let off = to.rank() - from.rank();
    let fs = strides(from);
    let mut terms = Vec::new();
    for (j, &fd) in from.dims().iter().enumerate() {
        if fd == 1 {
            continue;
        }
        let c = coord(var, to, j + off);
        terms.push(if fs[j] == 1 { c } else { format!("{c} * {}u", fs[j]) });
    }
    sum(terms)
}

pub(super) fn float_lit(v: f64) -> String {
    let f = v as f32;
    if f.is_nan() {
        "nan_f()".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "inf_f()".into()
        } else {
            "(-inf_f())".into()
        }
    } else if f == 0.0 {
        // Opaque to the driver (P.z is always 0): a literal zero lets
        // drivers that assume no Inf/NaN fold x * 0 -> 0 and x / 0 -> 0
        // (seen on lavapipe), breaking IEEE results for Inf/NaN inputs.
        format!("bitcast<f32>({}u | P.z)", f.to_bits())
    } else {
        format!("bitcast<f32>({}u)", f.to_bits())
    }
}

pub(super) fn int_lit(v: i32) -> String {
    if v == i32::MIN {
        "(-2147483647i - 1i)".into()
    } else if v < 0 {
        format!("({v}i)")
    } else {
        format!("{v}i")
    }
}

pub(super) fn constant(v: ScalarValue, d: DType) -> String {
    match d {
        DType::F32 => float_lit(v.as_f64()),
        DType::F16 | DType::BF16 => float_lit(v.cast(d).as_f64()),
        DType::I32 => int_lit(v.as_i64() as i32),
        DType::U32 => format!("{}u", v.as_u64() as u32),
        _ => format!("{}", v.as_bool()),
    }
}

pub(super) fn zero(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "0.0",
        DType::I32 => "0i",
        DType::U32 => "0u",
        _ => "false",
    }
}

/// Loop iterations one invocation may run on llvmpipe: gallivm (Mesa
/// 22.3) counts every loop iteration of an invocation, all loops together,
/// and silently leaves the loop after 65535 (measured: two loops of 40000
/// ran 65534 in all; a sum over 16M elements summed 65535 of them). Loops
/// whose trip count could exceed it are unrolled or spread over more
/// invocations; see [`super::REDUCE_UNROLL`].
pub const LLVMPIPE_LOOP_BUDGET: u64 = 65535;

pub(super) fn one(d: DType) -> &'static str {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => "1.0",
        DType::I32 => "1i",
        DType::U32 => "1u",
        _ => "true",
    }
}

pub(super) fn x_id(n: &lazuli_ir::Node) -> u32 {
    n.inputs[0].0
}

/// For one invocation `t` per line along `axis` of `shape`: the WGSL
/// expression of the line's base index, the axis stride and length.
pub(super) fn line(shape: &Shape, axis: usize) -> (String, u64, u64) {
    let inner: u64 = shape.dims()[axis + 1..].iter().product::<usize>() as u64;
    let len = shape.dims()[axis] as u64;
    let base = format!("(t / {inner}u) * {}u + t % {inner}u", len * inner);
    (base, inner, len)
}

/// A WGSL helper function kernels call, written once into a kernel's
/// source when a writer asks for it (`Writer::use_helper`) with the
/// helpers it calls ([`Helper::needs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Helper {
    /// `isnan_f(x: f32) -> bool`, by the bit pattern (drivers may fold `x != x`).
    IsNanF,
    /// `isinf_f(x: f32) -> bool`, by the bit pattern.
    IsInfF,
    /// `isninf_f(x: f32) -> bool`: `x` is negative infinity.
    IsNegInfF,
    /// `isninf4(x: vec4<f32>) -> vec4<bool>`: lanes that are negative infinity.
    IsNegInf4,
    /// `nan_f() -> f32`: a NaN built at run time.
    NanF,
    /// `inf_f() -> f32`: infinity built at run time.
    InfF,
    /// `max_nan(a, b)`: f32 maximum propagating NaN.
    MaxNan,
    /// `min_nan(a, b)`: f32 minimum propagating NaN.
    MinNan,
    /// `relu_f(x)`: f32 relu keeping NaN.
    ReluF,
    /// `sign_f(x)`: f32 sign keeping NaN.
    SignF,
    /// `tanh_f(x)`: f32 tanh, clamped against overflow, keeping NaN.
    TanhF,
    /// `erf_f(x)`: f32 error function (Abramowitz & Stegun 7.1.26).
    ErfF,
    /// `pow_f(a, b)`: f32 power with C's special cases and negative bases.
    PowF,
    /// `pow_i(a, b)`: wrapping i32 power (negative exponents as the IR says).
    PowI,
    /// `pow_u(a, b)`: wrapping u32 power.
    PowU,
    /// `mod_f(a, b)`: floored f32 modulo.
    ModF,
    /// `mod_i(a, b)`: floored i32 modulo (0 for `b == 0`).
    ModI,
    /// `cast_f2i(x)`: f32 to i32, truncating and saturating, NaN to 0.
    CastF2I,
    /// `cast_f2u(x)`: f32 to u32, truncating and saturating, NaN to 0.
    CastF2U,
    /// `philox(counter, key)` and `mulhilo`: Philox-4x32-10.
    Philox,
    /// `random_u(key, i)`: uniform f32 in [0, 1) of counter `i`.
    RandomU,
    /// `logaddexp_f(a, b)`: f32 `log(e^a + e^b)` without overflow.
    LogAddExpF,
}

/// Helpers are written in the order of their names, the order of the
/// string-keyed helpers this enum replaced, so that the generated WGSL
/// (pinned by the golden tests) is unchanged.
impl Ord for Helper {
    fn cmp(&self, other: &Helper) -> std::cmp::Ordering {
        self.name().cmp(other.name())
    }
}

impl PartialOrd for Helper {
    fn partial_cmp(&self, other: &Helper) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Helper {
    /// Every helper.
    #[cfg(test)]
    pub(super) const ALL: &'static [Helper] = &[
        Helper::IsNanF,
        Helper::IsInfF,
        Helper::IsNegInfF,
        Helper::IsNegInf4,
        Helper::NanF,
        Helper::InfF,
        Helper::MaxNan,
        Helper::MinNan,
        Helper::ReluF,
        Helper::SignF,
        Helper::TanhF,
        Helper::ErfF,
        Helper::PowF,
        Helper::PowI,
        Helper::PowU,
        Helper::ModF,
        Helper::ModI,
        Helper::CastF2I,
        Helper::CastF2U,
        Helper::Philox,
        Helper::RandomU,
        Helper::LogAddExpF,
    ];

    /// The name of the (first) WGSL function the helper defines.
    pub(super) fn name(self) -> &'static str {
        match self {
            Helper::IsNanF => "isnan_f",
            Helper::IsInfF => "isinf_f",
            Helper::IsNegInfF => "isninf_f",
            Helper::IsNegInf4 => "isninf4",
            Helper::NanF => "nan_f",
            Helper::InfF => "inf_f",
            Helper::MaxNan => "max_nan",
            Helper::MinNan => "min_nan",
            Helper::ReluF => "relu_f",
            Helper::SignF => "sign_f",
            Helper::TanhF => "tanh_f",
            Helper::ErfF => "erf_f",
            Helper::PowF => "pow_f",
            Helper::PowI => "pow_i",
            Helper::PowU => "pow_u",
            Helper::ModF => "mod_f",
            Helper::ModI => "mod_i",
            Helper::CastF2I => "cast_f2i",
            Helper::CastF2U => "cast_f2u",
            Helper::Philox => "philox",
            Helper::RandomU => "random_u",
            Helper::LogAddExpF => "logaddexp_f",
        }
    }

    /// The helpers this one calls.
    pub(super) fn needs(self) -> &'static [Helper] {
        match self {
            Helper::MaxNan => &[Helper::IsNanF],
            Helper::MinNan => &[Helper::IsNanF],
            Helper::ReluF => &[Helper::IsNanF],
            Helper::SignF => &[Helper::IsNanF],
            Helper::TanhF => &[Helper::IsNanF],
            Helper::PowF => &[Helper::NanF, Helper::InfF],
            Helper::CastF2I => &[Helper::IsNanF],
            Helper::CastF2U => &[Helper::IsNanF],
            Helper::RandomU => &[Helper::Philox],
            Helper::LogAddExpF => &[Helper::IsNanF, Helper::IsInfF],
            Helper::IsNanF
            | Helper::IsInfF
            | Helper::IsNegInfF
            | Helper::IsNegInf4
            | Helper::NanF
            | Helper::InfF
            | Helper::ErfF
            | Helper::PowI
            | Helper::PowU
            | Helper::ModF
            | Helper::ModI
            | Helper::Philox => &[],
        }
    }

    /// The WGSL source of the helper.
    pub(super) fn source(self) -> &'static str {
        match self {
            Helper::IsNanF => "fn isnan_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;\n}\n",
            Helper::IsInfF => "fn isinf_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;\n}\n",
            Helper::IsNegInfF => "fn isninf_f(x: f32) -> bool {\n    return bitcast<u32>(x) == 0xff800000u;\n}\n",
            Helper::IsNegInf4 => "fn isninf4(x: vec4<f32>) -> vec4<bool> {\n    return bitcast<vec4<u32>>(x) == vec4<u32>(0xff800000u);\n}\n",
            Helper::NanF => "fn nan_f() -> f32 {\n    return bitcast<f32>(0x7fc00000u | P.z);\n}\n",
            Helper::InfF => "fn inf_f() -> f32 {\n    return bitcast<f32>(0x7f800000u | P.z);\n}\n",
            Helper::MaxNan => "fn max_nan(a: f32, b: f32) -> f32 {\n    return select(max(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
            Helper::MinNan => "fn min_nan(a: f32, b: f32) -> f32 {\n    return select(min(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
            Helper::ReluF => "fn relu_f(x: f32) -> f32 {\n    return select(max(x, 0.0), x, isnan_f(x));\n}\n",
            Helper::SignF => "fn sign_f(x: f32) -> f32 {\n    return select(sign(x), x, isnan_f(x));\n}\n",
            Helper::TanhF => "fn tanh_f(x: f32) -> f32 {\n    return select(tanh(clamp(x, -15.0, 15.0)), x, isnan_f(x));\n}\n",
            Helper::ErfF => concat!(
                "fn erf_f(x: f32) -> f32 {\n",
                "    // Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7).\n",
                "    let ax = abs(x);\n",
                "    let t = 1.0 / (1.0 + 0.3275911 * ax);\n",
                "    let p = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;\n",
                "    let y = 1.0 - p * exp(-ax * ax);\n",
                "    return select(y, -y, x < 0.0);\n",
                "}\n"
            ),
            Helper::PowF => concat!(
                "fn pow_f(a: f32, b: f32) -> f32 {\n",
                "    if (b == 0.0) {\n        return 1.0;\n    }\n",
                "    if (a == 0.0) {\n        return select(0.0, inf_f(), b < 0.0);\n    }\n",
                "    let r = pow(abs(a), b);\n",
                "    if (a < 0.0) {\n",
                "        if (floor(b) != b) {\n            return nan_f();\n        }\n",
                "        if (abs(b) < 16777216.0 && (i32(abs(b)) & 1i) == 1i) {\n            return -r;\n        }\n",
                "    }\n",
                "    return r;\n",
                "}\n"
            ),
            Helper::PowI => concat!(
                "fn pow_i(a: i32, b: i32) -> i32 {\n",
                "    if (b < 0i) {\n",
                "        if (a == 1i) {\n            return 1i;\n        }\n",
                "        if (a == -1i) {\n            return select(-1i, 1i, (b & 1i) == 0i);\n        }\n",
                "        return 0i;\n",
                "    }\n",
                "    var r = 1i;\n    var base = a;\n    var e = u32(b);\n",
                "    while (e > 0u) {\n        if ((e & 1u) == 1u) {\n            r = r * base;\n        }\n        base = base * base;\n        e = e >> 1u;\n    }\n",
                "    return r;\n",
                "}\n"
            ),
            Helper::PowU => concat!(
                "fn pow_u(a: u32, b: u32) -> u32 {\n",
                "    var r = 1u;\n    var base = a;\n    var e = b;\n",
                "    while (e > 0u) {\n        if ((e & 1u) == 1u) {\n            r = r * base;\n        }\n        base = base * base;\n        e = e >> 1u;\n    }\n",
                "    return r;\n",
                "}\n"
            ),
            Helper::ModF => concat!(
                "fn mod_f(a: f32, b: f32) -> f32 {\n",
                "    let r = a % b;\n",
                "    return select(r, r + b, r != 0.0 && ((r < 0.0) != (b < 0.0)));\n",
                "}\n"
            ),
            Helper::ModI => concat!(
                "fn mod_i(a: i32, b: i32) -> i32 {\n",
                "    if (b == 0i) {\n        return 0i;\n    }\n",
                "    let r = a % b;\n",
                "    return select(r, r + b, r != 0i && ((r < 0i) != (b < 0i)));\n",
                "}\n"
            ),
            Helper::CastF2I => concat!(
                "fn cast_f2i(x: f32) -> i32 {\n",
                "    if (isnan_f(x)) {\n        return 0i;\n    }\n",
                "    if (x >= 2147483648.0) {\n        return 2147483647i;\n    }\n",
                "    if (x <= -2147483648.0) {\n        return -2147483647i - 1i;\n    }\n",
                "    return i32(x);\n",
                "}\n"
            ),
            Helper::CastF2U => concat!(
                "fn cast_f2u(x: f32) -> u32 {\n",
                "    if (isnan_f(x) || x <= 0.0) {\n        return 0u;\n    }\n",
                "    if (x >= 4294967296.0) {\n        return 4294967295u;\n    }\n",
                "    return u32(x);\n",
                "}\n"
            ),
            Helper::Philox => concat!(
                "fn mulhilo(a: u32, b: u32) -> vec2<u32> {\n",
                "    let a0 = a & 0xffffu;\n    let a1 = a >> 16u;\n    let b0 = b & 0xffffu;\n    let b1 = b >> 16u;\n",
                "    let p00 = a0 * b0;\n    let p01 = a0 * b1;\n    let p10 = a1 * b0;\n    let p11 = a1 * b1;\n",
                "    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);\n",
                "    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);\n",
                "    return vec2<u32>(hi, a * b);\n",
                "}\n\n",
                "fn philox(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {\n",
                "    var c = counter;\n    var k = key;\n",
                "    for (var r = 0u; r < 10u; r = r + 1u) {\n",
                "        if (r > 0u) {\n            k = k + vec2<u32>(0x9E3779B9u, 0xBB67AE85u);\n        }\n",
                "        let m0 = mulhilo(0xD2511F53u, c.x);\n",
                "        let m1 = mulhilo(0xCD9E8D57u, c.z);\n",
                "        c = vec4<u32>(m1.x ^ c.y ^ k.x, m1.y, m0.x ^ c.w ^ k.y, m0.y);\n",
                "    }\n",
                "    return c;\n",
                "}\n"
            ),
            Helper::RandomU => concat!(
                "fn random_u(key: vec2<u32>, i: u32) -> f32 {\n",
                "    let o = philox(vec4<u32>(i / 4u, 0u, 0u, 0u), key);\n",
                "    let bits = o[i % 4u];\n",
                "    return f32(bits >> 8u) * (1.0 / 16777216.0);\n",
                "}\n"
            ),
            // log1p(x) for x = e^-|a - b| in [0, 1] without cancellation
            // (Goldberg's `log(u) * x / (u - 1)`, exact where `1 + x` rounds
            // to 1); equal infinities give themselves and NaN propagates,
            // tested through the bit patterns (drivers may assume no NaN).
            Helper::LogAddExpF => concat!(
                "fn logaddexp_f(a: f32, b: f32) -> f32 {\n",
                "    if (isnan_f(a) || isnan_f(b)) {\n        return a + b;\n    }\n",
                "    if (isinf_f(a) && a == b) {\n        return a;\n    }\n",
                "    let x = exp(-abs(a - b));\n",
                "    let u = 1.0 + x;\n",
                "    let l = select(log(u) * (x / (u - 1.0)), x, u == 1.0);\n",
                "    return max(a, b) + l;\n",
                "}\n"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Helper::ALL` holds every helper: the match is exhaustive, so a new
    /// helper fails to compile here until it is numbered, and the count
    /// must then equal `ALL`'s length.
    #[test]
    fn helper_list_is_complete() {
        let index = |h: Helper| -> usize {
            match h {
                Helper::IsNanF => 0,
                Helper::IsInfF => 1,
                Helper::IsNegInfF => 2,
                Helper::IsNegInf4 => 3,
                Helper::NanF => 4,
                Helper::InfF => 5,
                Helper::MaxNan => 6,
                Helper::MinNan => 7,
                Helper::ReluF => 8,
                Helper::SignF => 9,
                Helper::TanhF => 10,
                Helper::ErfF => 11,
                Helper::PowF => 12,
                Helper::PowI => 13,
                Helper::PowU => 14,
                Helper::ModF => 15,
                Helper::ModI => 16,
                Helper::CastF2I => 17,
                Helper::CastF2U => 18,
                Helper::Philox => 19,
                Helper::RandomU => 20,
                Helper::LogAddExpF => 21,
            }
        };
        assert_eq!(Helper::ALL.len(), 22);
        for (k, &h) in Helper::ALL.iter().enumerate() {
            assert_eq!(index(h), k, "{h:?}");
        }
    }

    #[test]
    fn every_helper_defines_its_name_and_needs_exist() {
        for &h in Helper::ALL {
            assert!(h.source().contains(&format!("fn {}(", h.name())), "{h:?}");
            for n in h.needs() {
                assert!(h.source().contains(&format!("{}(", n.name())), "{h:?} calls {n:?}");
            }
        }
    }
}
