//! f16 and bf16 storage: a source rewrite after lowering.
//!
//! Code generators treat `f16` and `bf16` values as `f32` in registers:
//! every kernel family computes them in f32 (reductions, softmax and
//! matmul accumulate in f32 as for f32 tensors) and only the storage
//! declarations name the dtype: `array<f16>` / `array<vec4<f16>>` and the
//! placeholders `array<bf16>` / `array<vec4<bf16>>`. [`rewrite_source`] then makes
//! every access of such a binding convert, on the same contract as the
//! window rewrite ([`crate::window`]: a binding is only indexed, `NAME[i]`
//! as a value or `NAME[i] = v;` as a statement): a read `NAME[i]` becomes
//! `ld_NAME(i)` returning f32 (or `vec4<f32>`), a write becomes
//! `st_NAME(i, v);` rounding to the stored dtype. Kernels without such a
//! binding are returned byte-identical.
//!
//! Storage forms ([`HalfStorage`]):
//! - native f16 (GPUs with `wgpu::Features::SHADER_F16`; on a software
//!   adapter only when forced, since llvmpipe runs it slower than packed):
//!   `enable f16;`
//!   heads the kernel, the binding stays `array<f16>`, reads convert with
//!   `f32(..)` and writes with `f16(..)` (the WGSL conversion; round to
//!   nearest even on the adapters we checked).
//! - packed (bf16 always; f16 without `SHADER_F16`, on software adapters,
//!   or when forced with `LAZULI_F16_PACKED=1`): two elements per `u32`, element `2k` in the
//!   low half. bf16 unpacks by a shift (`bits << 16`) and packs with round
//!   to nearest even (NaN kept, made quiet); packed f16 uses
//!   `unpack2x16float` / `pack2x16float`. A vec4 binding is
//!   `array<vec2<u32>>`: each invocation owns both words it writes. A
//!   scalar binding that is written is `array<atomic<u32>>`: two
//!   invocations may own the two halves of one word, so a store clears its
//!   half with `atomicAnd` and sets it with `atomicOr` (each touches only
//!   its own 16 bits, so the two orders give the same word); reads of it
//!   use `atomicLoad`.
//!
//! Arithmetic is f32 between loads and stores, as PyTorch's compiled
//! (inductor) kernels do for f16 and bf16: a fused chain rounds once, at
//! its store, and at every explicit cast to or from f16 or bf16 (codegen
//! rounds there, so a cast's result is that of a value of the dtype). The CPU backend rounds after every op, so the two agree within
//! a rounding per fused op (tests compare with dtype-appropriate
//! tolerances).
//!
//! Rejected alternative: emitting the conversions in every kernel
//! family's format strings would touch each family's loads and stores; the
//! rewrite, like the window rewrite, keeps families unaware of storage.

use crate::wgsl_text::{self, StorageDecl};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use thiserror::Error;

/// How f16 tensors are stored on the device (bf16 is always packed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HalfStorage {
    /// `array<f16>` with `enable f16;` (needs `SHADER_F16`).
    Native,
    /// Two f16 per `u32`, converted by `unpack2x16float`/`pack2x16float`.
    #[default]
    Packed,
}

/// Why a kernel's half-precision bindings cannot be rewritten: a use that
/// breaks the contract of the module documentation. A bug of codegen,
/// reported as a typed error rather than a wrong kernel.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum HalfError {
    /// A half-precision binding used other than by `NAME[i]` or
    /// `NAME[i] = v;`.
    #[error("{dtype} binding {name} is used other than by index ({context:?})")]
    Access {
        /// The binding.
        name: String,
        /// `f16` or `bf16`.
        dtype: &'static str,
        /// The source around the use.
        context: String,
    },
}

/// One rewritten binding: its dtype, lanes (1 or 4) and form.
#[derive(Clone, Copy)]
struct Half {
    bf16: bool,
    vec4: bool,
    packed: bool,
    writable: bool,
}

impl Half {
    fn dtype(&self) -> &'static str {
        if self.bf16 {
            "bf16"
        } else {
            "f16"
        }
    }
}

/// The element types codegen writes for half-precision bindings.
fn parse_elem(elem: &str) -> Option<(bool, bool)> {
    match elem {
        "f16" => Some((false, false)),
        "vec4<f16>" => Some((false, true)),
        "bf16" => Some((true, false)),
        "vec4<bf16>" => Some((true, true)),
        _ => None,
    }
}

/// True when `source` declares an f16 or bf16 storage binding.
pub fn uses_halves(source: &str) -> bool {
    // Every such declaration's type ends in `f16>` (`array<f16>`,
    // `array<vec4<bf16>>`): one substring search rules most kernels out
    // without splitting the source into lines.
    source.contains("f16>")
        && wgsl_text::storage_decls(source)
            .iter()
            .any(|d| d.as_ref().ok().and_then(|d| d.elem()).and_then(parse_elem).is_some())
}

/// Rewrites `source` so its f16/bf16 bindings are stored as `f16` says
/// (see the module documentation); unchanged without such bindings.
pub fn rewrite_source(source: &str, f16: HalfStorage) -> Result<String, HalfError> {
    let decls: Vec<StorageDecl> = wgsl_text::storage_decls(source).into_iter().filter_map(Result::ok).collect();
    let mut halves: BTreeMap<String, Half> = BTreeMap::new();
    for d in &decls {
        if let Some((bf16, vec4)) = d.elem().and_then(parse_elem) {
            let packed = bf16 || f16 == HalfStorage::Packed;
            halves.insert(d.name.clone(), Half { bf16, vec4, packed, writable: d.access == "read_write" });
        }
    }
    if halves.is_empty() {
        return Ok(source.to_string());
    }
    let native = halves.values().any(|h| !h.packed);
    let mut out = String::with_capacity(source.len() + 2048);
    // Once: a kernel that computes in f16 itself (the tensor-core matmul)
    // enables it already.
    if native && !source.starts_with("enable f16;") {
        out.push_str("enable f16;\n");
    }
    let mut pos = 0;
    let mut helpers = String::new();
    let mut needs_bf16 = false;
    // Every declaration in place (halves retyped), the helpers after the
    // last one, so the declarations stay one block as codegen wrote them.
    for d in &decls {
        out.push_str(&rewrite(&source[pos..d.line.start], &halves)?);
        pos = d.line.end;
        let Some(h) = halves.get(&d.name) else {
            out.push_str(&source[d.line.clone()]);
            continue;
        };
        let ty = match (h.packed, h.vec4, h.writable) {
            (false, false, _) => "array<f16>",
            (false, true, _) => "array<vec4<f16>>",
            (true, true, _) => "array<vec2<u32>>",
            (true, false, true) => "array<atomic<u32>>",
            (true, false, false) => "array<u32>",
        };
        out.push_str(&StorageDecl { ty: ty.to_string(), ..d.clone() }.render(d.binding, &d.name));
        needs_bf16 |= h.bf16;
        helpers.push_str(&access_fns(&d.name, h));
    }
    out.push('\n');
    if needs_bf16 {
        out.push_str(BF16_FNS);
    }
    out.push_str(&helpers);
    out.push_str(&rewrite(&source[pos..], &halves)?);
    Ok(out)
}

/// bf16 conversions: unpack by a shift; pack rounding to nearest even,
/// NaN kept (quieted) rather than rounded into infinity.
const BF16_FNS: &str = "fn bf16_unpack(h: u32) -> f32 {\n    return bitcast<f32>(h << 16u);\n}\n\nfn bf16_pack(v: f32) -> u32 {\n    let x = bitcast<u32>(v);\n    if ((x & 0x7fffffffu) > 0x7f800000u) {\n        return (x >> 16u) | 0x40u;\n    }\n    return (x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u;\n}\n\n";

/// A conversion written as WGSL: the expression of an argument's.
type Conv = fn(&str) -> String;

/// `ld_NAME(i)` (and `st_NAME(i, v)` for a writable binding) of one half
/// binding.
fn access_fns(name: &str, h: &Half) -> String {
    let mut s = String::new();
    let (reg, lanes) = if h.vec4 { ("vec4<f32>", 4) } else { ("f32", 1) };
    if !h.packed {
        let st = if lanes == 4 { "vec4<f16>" } else { "f16" };
        let _ = writeln!(s, "fn ld_{name}(i: u32) -> {reg} {{\n    return {reg}({name}[i]);\n}}\n");
        if h.writable {
            let _ = writeln!(s, "fn st_{name}(i: u32, v: {reg}) {{\n    {name}[i] = {st}(v);\n}}\n");
        }
        return s;
    }
    // 16 bits of element to f32, f32 to 16 bits.
    let (un, pk): (Conv, Conv) = if h.bf16 {
        (|b| format!("bf16_unpack({b})"), |v| format!("bf16_pack({v})"))
    } else {
        (|b| format!("unpack2x16float({b}).x"), |v| format!("(pack2x16float(vec2<f32>({v}, 0.0)) & 0xffffu)"))
    };
    if h.vec4 {
        let _ = writeln!(
            s,
            "fn ld_{name}(i: u32) -> vec4<f32> {{\n    let w = {name}[i];\n    return vec4<f32>({}, {}, {}, {});\n}}\n",
            un("(w.x & 0xffffu)"),
            un("(w.x >> 16u)"),
            un("(w.y & 0xffffu)"),
            un("(w.y >> 16u)")
        );
        if h.writable {
            let _ = writeln!(
                s,
                "fn st_{name}(i: u32, v: vec4<f32>) {{\n    {name}[i] = vec2<u32>({} | ({} << 16u), {} | ({} << 16u));\n}}\n",
                pk("v.x"),
                pk("v.y"),
                pk("v.z"),
                pk("v.w")
            );
        }
    } else if h.writable {
        let _ = writeln!(
            s,
            "fn ld_{name}(i: u32) -> f32 {{\n    let w = atomicLoad(&{name}[i >> 1u]);\n    return {};\n}}\n",
            un("((w >> ((i & 1u) * 16u)) & 0xffffu)")
        );
        let _ = writeln!(
            s,
            "fn st_{name}(i: u32, v: f32) {{\n    let s = (i & 1u) * 16u;\n    atomicAnd(&{name}[i >> 1u], ~(0xffffu << s));\n    atomicOr(&{name}[i >> 1u], {} << s);\n}}\n",
            pk("v")
        );
    } else {
        let _ = writeln!(
            s,
            "fn ld_{name}(i: u32) -> f32 {{\n    let w = {name}[i >> 1u];\n    return {};\n}}\n",
            un("((w >> ((i & 1u) * 16u)) & 0xffffu)")
        );
    }
    s
}

/// Rewrites the accesses of half bindings in `text` (code between
/// declarations); comments are copied as they are.
fn rewrite(text: &str, halves: &BTreeMap<String, Half>) -> Result<String, HalfError> {
    wgsl_text::rewrite_indexed(text, &|name| halves.contains_key(name), &|name, context| HalfError::Access {
        name: name.to_string(),
        dtype: halves[name].dtype(),
        context: context.to_string(),
    })
}

/// `round_bf16(v)`: an f32 register value rounded to bf16 precision
/// (nearest even; NaN and infinities kept), for explicit casts.
pub(crate) const ROUND_BF16: &str = "fn round_bf16(v: f32) -> f32 {\n    let x = bitcast<u32>(v);\n    if ((x & 0x7fffffffu) > 0x7f800000u) {\n        return v;\n    }\n    return bitcast<f32>(((x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u) << 16u);\n}\n";

/// `round_f16(v)`: an f32 register value rounded to f16 precision, through
/// `pack2x16float` (needs no `enable f16;`, so any kernel may cast).
pub(crate) const ROUND_F16: &str =
    "fn round_f16(v: f32) -> f32 {\n    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;\n}\n";

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "// generated by lazuli-wgpu\nstruct Params {\n    z: u32,\n}\n\n@group(0) @binding(0) var<uniform> P: Params;\n@group(0) @binding(1) var<storage, read> in0: array<vec4<f16>>;\n@group(0) @binding(2) var<storage, read> in1: array<bf16>;\n@group(0) @binding(3) var<storage, read_write> out0: array<bf16>;\n@group(0) @binding(4) var<storage, read_write> out1: array<f32>;\n\nfn n3(i: u32) -> f32 {\n    return in1[i];\n}\n\n@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n    let t = gid.x;\n    // in0[t] is read as vectors\n    let x = in0[t >> 2u][t & 3u] + n3(t);\n    out0[t] = x * in0[min(t, 3u)].y;\n    out1[t] = out0[t] * 2.0;\n}\n";

    #[test]
    fn kernels_without_halves_are_byte_identical() {
        let f32_only = SRC.replace("vec4<f16>", "vec4<f32>").replace("bf16>", "f32>");
        assert!(!uses_halves(&f32_only));
        assert_eq!(rewrite_source(&f32_only, HalfStorage::Native).unwrap(), f32_only);
    }

    #[test]
    fn native_f16_and_packed_bf16_accesses_go_through_helpers() {
        let s = rewrite_source(SRC, HalfStorage::Native).unwrap();
        assert!(s.starts_with("enable f16;\n"), "{s}");
        assert!(s.contains("var<storage, read> in0: array<vec4<f16>>;"), "{s}");
        assert!(s.contains("var<storage, read> in1: array<u32>;"), "{s}");
        assert!(s.contains("var<storage, read_write> out0: array<atomic<u32>>;"), "{s}");
        assert!(s.contains("var<storage, read_write> out1: array<f32>;"), "f32 untouched: {s}");
        assert!(s.contains("return ld_in1(i);"), "{s}");
        assert!(s.contains("let x = ld_in0(t >> 2u)[t & 3u] + n3(t);"), "{s}");
        assert!(s.contains("st_out0(t, x * ld_in0(min(t, 3u)).y);"), "{s}");
        assert!(s.contains("out1[t] = ld_out0(t) * 2.0;"), "{s}");
        assert!(s.contains("// in0[t] is read as vectors"), "comments untouched: {s}");
        let p = rewrite_source(SRC, HalfStorage::Packed).unwrap();
        assert!(!p.contains("enable f16"), "{p}");
        assert!(p.contains("var<storage, read> in0: array<vec2<u32>>;"), "{p}");
        assert!(p.contains("unpack2x16float((w.x & 0xffffu)).x"), "{p}");
    }

    #[test]
    fn other_uses_are_typed_errors() {
        let bad = SRC.replace("out1[t] = out0[t] * 2.0;", "out0[t] += 1.0;");
        let e = rewrite_source(&bad, HalfStorage::Native).unwrap_err();
        assert!(matches!(e, HalfError::Access { dtype: "bf16", .. }), "{e}");
        let bad = SRC.replace("out1[t] = out0[t] * 2.0;", "let p = &out0;");
        assert!(rewrite_source(&bad, HalfStorage::Packed).is_err());
    }

    /// Every form of every helper passes naga validation.
    #[test]
    fn rewritten_kernels_validate() {
        for f16 in [HalfStorage::Native, HalfStorage::Packed] {
            let mut s = rewrite_source(SRC, f16).unwrap();
            s.push_str(ROUND_BF16);
            s.push_str(ROUND_F16);
            crate::validate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{f16:?}: {e}\n{s}"));
        }
        let out_vec = SRC.replace("out0: array<bf16>", "out0: array<vec4<bf16>>").replace(
            "    out0[t] = x * in0[min(t, 3u)].y;\n    out1[t] = out0[t] * 2.0;\n",
            "    out0[t] = vec4<f32>(x);\n    out1[t] = out0[t].z;\n",
        );
        for f16 in [HalfStorage::Native, HalfStorage::Packed] {
            let s = rewrite_source(&out_vec, f16).unwrap();
            crate::validate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{f16:?}: {e}\n{s}"));
            let f = out_vec.replace("vec4<bf16>", "vec4<f16>");
            let s = rewrite_source(&f, f16).unwrap();
            crate::validate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{f16:?}: {e}\n{s}"));
        }
    }
}
