//! Fault injection for tests of shadow validation: kernels whose name
//! contains [`crate::WgpuOptions::fault_kernel`] get a deliberately wrong
//! store (element 0 of their first output is perturbed), so a test can
//! prove that `LAZULI_VALIDATE=cpu` catches a wrong kernel and names it.
//! Never set outside tests. The output's declaration is found by the
//! shared parser of generated WGSL ([`crate::rewrite::wgsl_text`]).

use crate::rewrite::wgsl_text;

/// Appends a perturbation of `out0[0]` to the end of the entry point (the
/// last function of a generated source). A source whose first output is
/// not one whole `read_write` array binding `out0` (a windowed one is
/// `out0_w0`, ...) is returned unchanged.
pub(crate) fn perturb(source: &str) -> String {
    let decls = wgsl_text::storage_decls(source);
    let out0 = decls.iter().flatten().find(|d| d.name == "out0" && d.access == "read_write");
    let Some(elem) = out0.and_then(|d| d.elem()) else { return source.to_string() };
    let change = match elem {
        "f32" => "out0[0] = out0[0] + 1.0;",
        "i32" => "out0[0] = out0[0] + 1i;",
        "vec4<f32>" => "out0[0] = out0[0] + vec4<f32>(1.0);",
        "vec4<i32>" => "out0[0] = out0[0] + vec4<i32>(1i);",
        "vec4<u32>" => "out0[0] = out0[0] ^ vec4<u32>(1u);",
        _ => "out0[0] = out0[0] ^ 1u;",
    };
    let Some(end) = source.trim_end().strip_suffix('}') else { return source.to_string() };
    format!("{end}    if (t == 0u) {{\n        {change}\n    }}\n}}\n")
}

#[cfg(test)]
mod tests {
    use super::perturb;

    const SRC: &str = "@group(0) @binding(1) var<storage, read> in0: array<ELEM>;\n@group(0) @binding(2) var<storage, read_write> out0: array<ELEM>;\n\n@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n    let t = gid.x;\n    out0[t] = in0[t];\n}\n";

    #[test]
    fn the_first_output_gets_a_wrong_store_of_its_element_type() {
        let tail = |elem: &str| {
            let src = SRC.replace("ELEM", elem);
            let out = perturb(&src);
            assert_eq!(&out[..src.len() - 2], &src[..src.len() - 2], "{out}");
            out[src.len() - 2..].to_string()
        };
        assert_eq!(tail("f32"), "    if (t == 0u) {\n        out0[0] = out0[0] + 1.0;\n    }\n}\n");
        assert_eq!(tail("i32"), "    if (t == 0u) {\n        out0[0] = out0[0] + 1i;\n    }\n}\n");
        assert_eq!(tail("u32"), "    if (t == 0u) {\n        out0[0] = out0[0] ^ 1u;\n    }\n}\n");
        assert_eq!(tail("vec4<f32>"), "    if (t == 0u) {\n        out0[0] = out0[0] + vec4<f32>(1.0);\n    }\n}\n");
        assert_eq!(tail("vec4<u32>"), "    if (t == 0u) {\n        out0[0] = out0[0] ^ vec4<u32>(1u);\n    }\n}\n");
        crate::validate_wgsl(&perturb(&SRC.replace("ELEM", "vec4<i32>"))).unwrap();
    }

    #[test]
    fn a_kernel_without_a_whole_first_output_is_left_alone() {
        // A windowed output is bound as `out0_w0`, ...: nothing to perturb.
        let windowed = SRC
            .replace("ELEM", "f32")
            .replace("out0: array<f32>", "out0_w0: array<f32>")
            .replace("out0[t]", "out0_w0[t]");
        assert_eq!(perturb(&windowed), windowed);
    }
}
