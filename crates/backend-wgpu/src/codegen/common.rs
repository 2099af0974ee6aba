//! Helpers shared by every kernel family: WGSL types of dtypes, literals,
//! row-major index math, and the source of the WGSL helper functions
//! (NaN-aware max/min, tanh, erf, pow, casts, Philox) that kernels request
//! through `Writer::use_helper`.

use lazuli_ir::{DType, ScalarValue, Shape};

/// WGSL register type of a dtype.
pub(super) fn ty(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::I32 => "i32",
        DType::U32 => "u32",
        DType::Bool => "bool",
        _ => "u32",
    }
}

/// WGSL buffer element type of a dtype.
pub(super) fn storage_ty(d: DType) -> &'static str {
    match d {
        DType::Bool => "u32",
        other => ty(other),
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
        DType::I32 => int_lit(v.as_i64() as i32),
        DType::U32 => format!("{}u", v.as_u64() as u32),
        _ => format!("{}", v.as_bool()),
    }
}

pub(super) fn zero(d: DType) -> &'static str {
    match d {
        DType::F32 => "0.0",
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
/// invocations; see [`REDUCE_UNROLL`].
pub const LLVMPIPE_LOOP_BUDGET: u64 = 65535;

pub(super) fn one(d: DType) -> &'static str {
    match d {
        DType::F32 => "1.0",
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

pub(super) fn helper_source(name: &str) -> &'static str {
    match name {
        "isnan_f" => "fn isnan_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;\n}\n",
        "isinf_f" => "fn isinf_f(x: f32) -> bool {\n    return (bitcast<u32>(x) & 0x7fffffffu) == 0x7f800000u;\n}\n",
        "isninf_f" => "fn isninf_f(x: f32) -> bool {\n    return bitcast<u32>(x) == 0xff800000u;\n}\n",
        "isninf4" => "fn isninf4(x: vec4<f32>) -> vec4<bool> {\n    return bitcast<vec4<u32>>(x) == vec4<u32>(0xff800000u);\n}\n",
        "nan_f" => "fn nan_f() -> f32 {\n    return bitcast<f32>(0x7fc00000u | P.z);\n}\n",
        "inf_f" => "fn inf_f() -> f32 {\n    return bitcast<f32>(0x7f800000u | P.z);\n}\n",
        "max_nan" => "fn max_nan(a: f32, b: f32) -> f32 {\n    return select(max(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
        "min_nan" => "fn min_nan(a: f32, b: f32) -> f32 {\n    return select(min(a, b), a + b, isnan_f(a) || isnan_f(b));\n}\n",
        "relu_f" => "fn relu_f(x: f32) -> f32 {\n    return select(max(x, 0.0), x, isnan_f(x));\n}\n",
        "sign_f" => "fn sign_f(x: f32) -> f32 {\n    return select(sign(x), x, isnan_f(x));\n}\n",
        "tanh_f" => "fn tanh_f(x: f32) -> f32 {\n    return select(tanh(clamp(x, -15.0, 15.0)), x, isnan_f(x));\n}\n",
        "erf_f" => concat!(
            "fn erf_f(x: f32) -> f32 {\n",
            "    // Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7).\n",
            "    let ax = abs(x);\n",
            "    let t = 1.0 / (1.0 + 0.3275911 * ax);\n",
            "    let p = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;\n",
            "    let y = 1.0 - p * exp(-ax * ax);\n",
            "    return select(y, -y, x < 0.0);\n",
            "}\n"
        ),
        "pow_f" => concat!(
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
        "pow_i" => concat!(
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
        "pow_u" => concat!(
            "fn pow_u(a: u32, b: u32) -> u32 {\n",
            "    var r = 1u;\n    var base = a;\n    var e = b;\n",
            "    while (e > 0u) {\n        if ((e & 1u) == 1u) {\n            r = r * base;\n        }\n        base = base * base;\n        e = e >> 1u;\n    }\n",
            "    return r;\n",
            "}\n"
        ),
        "mod_f" => concat!(
            "fn mod_f(a: f32, b: f32) -> f32 {\n",
            "    let r = a % b;\n",
            "    return select(r, r + b, r != 0.0 && ((r < 0.0) != (b < 0.0)));\n",
            "}\n"
        ),
        "mod_i" => concat!(
            "fn mod_i(a: i32, b: i32) -> i32 {\n",
            "    if (b == 0i) {\n        return 0i;\n    }\n",
            "    let r = a % b;\n",
            "    return select(r, r + b, r != 0i && ((r < 0i) != (b < 0i)));\n",
            "}\n"
        ),
        "cast_f2i" => concat!(
            "fn cast_f2i(x: f32) -> i32 {\n",
            "    if (isnan_f(x)) {\n        return 0i;\n    }\n",
            "    if (x >= 2147483648.0) {\n        return 2147483647i;\n    }\n",
            "    if (x <= -2147483648.0) {\n        return -2147483647i - 1i;\n    }\n",
            "    return i32(x);\n",
            "}\n"
        ),
        "cast_f2u" => concat!(
            "fn cast_f2u(x: f32) -> u32 {\n",
            "    if (isnan_f(x) || x <= 0.0) {\n        return 0u;\n    }\n",
            "    if (x >= 4294967296.0) {\n        return 4294967295u;\n    }\n",
            "    return u32(x);\n",
            "}\n"
        ),
        "philox" => concat!(
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
        "random_u" => concat!(
            "fn random_u(key: vec2<u32>, i: u32) -> f32 {\n",
            "    let o = philox(vec4<u32>(i / 4u, 0u, 0u, 0u), key);\n",
            "    let bits = o[i % 4u];\n",
            "    return f32(bits >> 8u) * (1.0 / 16777216.0);\n",
            "}\n"
        ),
        _ => unreachable!("unknown helper {name}"),
    }
}
