//! Fault injection for tests of shadow validation: kernels whose name
//! contains [`crate::WgpuOptions::fault_kernel`] get a deliberately wrong
//! store (element 0 of their first output is perturbed), so a test can
//! prove that `LAZULI_VALIDATE=cpu` catches a wrong kernel and names it.
//! Never set outside tests.

/// Appends a perturbation of `out0[0]` to the end of the entry point.
pub(crate) fn perturb(source: &str) -> String {
    let decl = "var<storage, read_write> out0: array<";
    let Some(start) = source.find(decl).map(|i| i + decl.len()) else { return source.to_string() };
    let elem = &source[start..source[start..].find('>').map_or(start, |e| start + e)];
    let change = match elem {
        "f32" => "out0[0] = out0[0] + 1.0;",
        "i32" => "out0[0] = out0[0] + 1i;",
        "vec4<f32" => "out0[0] = out0[0] + vec4<f32>(1.0);",
        "vec4<i32" => "out0[0] = out0[0] + vec4<i32>(1i);",
        "vec4<u32" => "out0[0] = out0[0] ^ vec4<u32>(1u);",
        _ => "out0[0] = out0[0] ^ 1u;",
    };
    let Some(end) = source.trim_end().strip_suffix('}') else { return source.to_string() };
    format!("{end}    if (t == 0u) {{\n        {change}\n    }}\n}}\n")
}
