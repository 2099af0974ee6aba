//! One buffer-access layer: how a kernel's storage bindings are declared,
//! loaded and stored, from each binding's storage description.
//!
//! Every kernel family reads and writes its tensors through
//! [`Binding::load`] and [`Binding::store`] (the writer's `ld`, `st`,
//! `open_store` and `close_store`), never with a format string of its
//! own, and the assembler declares the bindings and their access helpers
//! from the same descriptions ([`Bindings`]). A binding's [`Storage`]
//! says how its elements lie in memory:
//!
//! - [`Storage::Native`]: 32-bit elements (`f32`, `i32`, `u32`, and bools
//!   as `u32`), scalars or vec4, accessed as `NAME[i]` and
//!   `NAME[i] = v;`.
//! - [`Storage::Half`]: f16 and bf16 tensors, 16 bits an element,
//!   computed in f32 registers (reductions, softmax and matmul accumulate
//!   in f32 as for f32 tensors). A read is `ld_NAME(i)` returning `f32`
//!   (or `vec4<f32>`), a write `st_NAME(i, v);` rounding to the stored
//!   dtype. Native f16 (GPUs with `wgpu::Features::SHADER_F16`; on a
//!   software adapter only when forced, since llvmpipe runs it slower than
//!   packed) declares `array<f16>` and converts with `f32(..)` and
//!   `f16(..)` (the WGSL conversion; round to nearest even on the adapters
//!   we checked), under `enable f16;`. Packed storage (bf16 always; f16
//!   without `SHADER_F16`, on software adapters, or when forced with
//!   `LAZULI_F16_PACKED=1`) puts two elements in a `u32`, element `2k` in
//!   the low half: bf16 unpacks by a shift (`bits << 16`) and packs with
//!   round to nearest even (NaN kept, made quiet), packed f16 uses
//!   `unpack2x16float` / `pack2x16float`. A vec4 binding is
//!   `array<vec2<u32>>`: each invocation owns both words it writes. A
//!   scalar binding that is written is `array<atomic<u32>>`: two
//!   invocations may own the two halves of one word, so a store clears its
//!   half with `atomicAnd` and sets it with `atomicOr` (each touches only
//!   its own 16 bits, so the two orders give the same word); reads of it
//!   use `atomicLoad`. Arithmetic is f32 between loads and stores, as
//!   PyTorch's compiled (inductor) kernels do for f16 and bf16: a fused
//!   chain rounds once, at its store, and at every explicit cast to or from
//!   f16 or bf16 (codegen rounds there, so a cast's result is that of a
//!   value of the dtype). The CPU backend rounds after every op, so the two
//!   agree within a rounding per fused op.
//! - [`Storage::Windowed`]: a tensor beyond one storage binding (see
//!   [`crate::codegen::window`]), bound as consecutive windows `NAME_w0`,
//!   `NAME_w1`, ... (the later bindings renumbered), reached through
//!   `ld_NAME(i)` and `st_NAME(i, v);`, which pick the window by dividing
//!   the index by a constant (a shift where the window is a power of two,
//!   as on lavapipe) and the offset inside it. The arithmetic is exact:
//!   indices are u32 element (or vec4) indices, windows hold a whole
//!   number of them, and a tensor has at most `u32::MAX` elements.
//! - [`Storage::Bytes`]: a `u8` tensor (quantized weight blocks, see
//!   [`crate::codegen::quant`]), four bytes to a `u32` (byte `4k + j` in
//!   bits `8j` of word `k`, as uploaded). Written a whole word at a time
//!   (`st_NAME(w, word)`: a gather of embedding rows, each invocation
//!   owning its word); read by byte offset:
//!   `ld_NAME(o)` the byte, `ldh_NAME(o)` the little-endian u16 at an even
//!   offset (GGML blocks have even sizes, so a u16 never straddles a
//!   word), `ldf_NAME(o)` that u16 as an f16 widened to f32 by integer
//!   arithmetic (`f16_bits`: exact, subnormals included, where
//!   `unpack2x16float` may flush them).
//!
//! A kernel whose bindings are all native is written exactly as before the
//! layer existed, and the others exactly as the text rewrites that came
//! before it (`halves`, `window`) wrote them: the helpers follow the last
//! storage declaration. `enable` lines are derived from what was emitted
//! (the assembler's `enables`), as naga's and CubeCL's writers do. A new
//! storage kind is one more [`Storage`] variant with its declaration and
//! its load helper here (the bytes of quantized weights were); no family
//! changes.
//!
//! Rejected alternative: families writing `NAME[i]` and a text rewrite
//! after lowering turning those accesses into helper calls (what the
//! `halves` and `window` modules did): every rewrite re-tokenized every
//! kernel that needed it, the contract ("a binding is only indexed") was
//! checked at run time rather than by construction, and a new storage
//! kind meant a third rewrite composed with the other two.

use super::{LowerError, LowerLimits};
use crate::codegen::window::Windows;
use lazuli_ir::{NodeId, VerifiedGraph};
use std::fmt::Write as _;

/// How f16 tensors are stored on the device (bf16 is always packed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HalfStorage {
    /// `array<f16>` with `enable f16;` (needs `SHADER_F16`).
    Native,
    /// Two f16 per `u32`, converted by `unpack2x16float`/`pack2x16float`.
    #[default]
    Packed,
}

/// How one storage binding holds its elements (see the module
/// documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Storage {
    /// 32-bit elements, accessed as they are.
    Native,
    /// f16 or bf16 elements, 16 bits each: native `f16` (`packed` false,
    /// f16 only) or two to a `u32`.
    Half {
        /// bf16 rather than f16.
        bf16: bool,
        /// Two elements to a `u32`.
        packed: bool,
    },
    /// Bound as `windows` consecutive windows of `per` array elements
    /// each.
    Windowed {
        /// Bindings.
        windows: u32,
        /// Array elements (scalars or vectors) per window.
        per: u64,
    },
    /// A `u8` tensor (quantized weight blocks): four bytes to a `u32`,
    /// little endian, the stream padded to a word; read only, through
    /// `ld_NAME(o)` (the byte at byte offset `o`), `ldh_NAME(o)` (the
    /// little-endian u16 at even byte offset `o`) and `ldf_NAME(o)` (that
    /// u16 as an f16, widened to f32 exactly, subnormals included).
    Bytes,
}

/// One storage binding of a kernel pass: its variable, element type,
/// access and storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The variable: `in0`, `out1`, `scr`.
    pub name: String,
    /// The element's scalar type as stored: `f32`, `i32`, `u32` (bools),
    /// `f16` or `bf16`.
    pub scalar: &'static str,
    /// Elements are vec4s of `scalar`.
    pub vec4: bool,
    /// `read_write` (outputs, and scratch a first pass writes) rather than
    /// `read`.
    pub writable: bool,
    /// How the elements lie in memory.
    pub storage: Storage,
}

impl Binding {
    /// The binding named `name` of a tensor stored as `scalar` (a
    /// `codegen::common::storage_ty`: `f32`, `i32`, `u32`, `f16`, `bf16`)
    /// with `elements` 32-bit elements (as the planner counts them), bound
    /// as `vec4` where asked, f16 stored as `f16` says and windowed as
    /// `windows` says. A half-precision tensor is never windowed (the
    /// planner keeps those beyond one binding on the CPU fallback): `None`
    /// for one that would need windows.
    pub fn tensor(
        name: String,
        scalar: &'static str,
        vec4: bool,
        writable: bool,
        elements: u64,
        (f16, windows): (HalfStorage, &Windows),
    ) -> Option<Binding> {
        if scalar == "u8" {
            // Bytes: 4 to a word. Never windowed (the planner keeps a
            // weight beyond one binding on the CPU fallback).
            return (!vec4 && windows.count(elements.div_ceil(4)) <= 1).then_some(Binding {
                name,
                scalar,
                vec4,
                writable,
                storage: Storage::Bytes,
            });
        }
        let count = windows.count(elements);
        let storage = if matches!(scalar, "f16" | "bf16") {
            if count > 1 {
                return None;
            }
            let bf16 = scalar == "bf16";
            Storage::Half { bf16, packed: bf16 || f16 == HalfStorage::Packed }
        } else if count > 1 {
            let elem_bytes = if vec4 { 16 } else { 4 };
            Storage::Windowed { windows: count, per: windows.bytes() / elem_bytes }
        } else {
            Storage::Native
        };
        Some(Binding { name, scalar, vec4, writable, storage })
    }

    /// The binding of node `id` of `g` named `name`, stored as `scalar`
    /// (see [`Binding::tensor`]) under `limits`' f16 storage and windows;
    /// a half-precision tensor that would need windows is an unsupported
    /// case (the planner keeps those on the CPU fallback).
    pub(super) fn of_node(
        g: &VerifiedGraph,
        limits: &LowerLimits,
        (name, scalar, id): (String, &'static str, NodeId),
        vec4: bool,
        writable: bool,
    ) -> Result<Binding, LowerError> {
        let n = g.node(id);
        Binding::tensor(name, scalar, vec4, writable, n.shape.numel() as u64, (limits.f16, &limits.windows)).ok_or_else(
            || LowerError::Unsupported {
                op: format!("{} ({scalar} beyond one storage binding)", n.op.name()),
                dtype: n.dtype,
            },
        )
    }

    /// A binding of 32-bit elements of `scalar` that is never windowed or
    /// converted (scratch partials).
    pub fn native(name: String, scalar: &'static str, vec4: bool, writable: bool) -> Binding {
        Binding { name, scalar, vec4, writable, storage: Storage::Native }
    }

    /// The element type as declared by a native binding (`vec4<f32>`).
    fn elem(&self) -> String {
        if self.vec4 {
            format!("vec4<{}>", self.scalar)
        } else {
            self.scalar.to_string()
        }
    }

    /// Whether accesses go through `ld_NAME` and `st_NAME`.
    fn through_helpers(&self) -> bool {
        !matches!(self.storage, Storage::Native)
    }

    /// Writes a load of array element `index` (a vec4 where the binding
    /// is one): `NAME[index]`, or `ld_NAME(index)`.
    pub fn load_into(&self, out: &mut String, index: std::fmt::Arguments) {
        if self.through_helpers() {
            let _ = write!(out, "ld_{}({index})", self.name);
        } else {
            let _ = write!(out, "{}[{index}]", self.name);
        }
    }

    /// A load of array element `index` (see [`Binding::load_into`]).
    pub fn load(&self, index: &str) -> String {
        // Pieces pushed, not formatted: lowering makes one per access.
        let mut s = String::with_capacity(self.name.len() + index.len() + 5);
        if self.through_helpers() {
            s.push_str("ld_");
            s.push_str(&self.name);
            s.push('(');
            s.push_str(index);
            s.push(')');
        } else {
            s.push_str(&self.name);
            s.push('[');
            s.push_str(index);
            s.push(']');
        }
        s
    }

    /// Writes the start of a store to array element `index`, which the
    /// value and [`Binding::close_store`] complete: `NAME[index] = `, or
    /// `st_NAME(index, `.
    pub fn open_store(&self, out: &mut String, index: std::fmt::Arguments) {
        if self.through_helpers() {
            let _ = write!(out, "st_{}({index}, ", self.name);
        } else {
            let _ = write!(out, "{}[{index}] = ", self.name);
        }
    }

    /// Writes the end of a store [`Binding::open_store`] started.
    pub fn close_store(&self, out: &mut String) {
        out.push_str(if self.through_helpers() { ");" } else { ";" });
    }

    /// The statement storing `value` to array element `index`:
    /// `NAME[index] = value;`, or `st_NAME(index, value);`.
    pub fn store(&self, index: &str, value: &str) -> String {
        let mut s = String::with_capacity(self.name.len() + index.len() + value.len() + 8);
        if self.through_helpers() {
            s.push_str("st_");
            s.push_str(&self.name);
            s.push('(');
            s.push_str(index);
            s.push_str(", ");
        } else {
            s.push_str(&self.name);
            s.push('[');
            s.push_str(index);
            s.push_str("] = ");
        }
        s.push_str(value);
        self.close_store(&mut s);
        s
    }

    /// Storage bindings it takes (its windows).
    pub fn count(&self) -> u32 {
        match self.storage {
            Storage::Windowed { windows, .. } => windows,
            Storage::Native | Storage::Half { .. } | Storage::Bytes => 1,
        }
    }

    /// The declaration lines of the binding, from binding `first` on
    /// (one per window).
    fn declare(&self, out: &mut String, first: u32) {
        let access = if self.writable { "read_write" } else { "read" };
        // The array type, as three pieces around the scalar.
        let (open, scalar, close) = match self.storage {
            Storage::Native | Storage::Windowed { .. } if self.vec4 => ("array<vec4<", self.scalar, ">>"),
            Storage::Native | Storage::Windowed { .. } => ("array<", self.scalar, ">"),
            Storage::Bytes => ("array<", "u32", ">"),
            Storage::Half { packed: false, .. } if self.vec4 => ("array<vec4<", "f16", ">>"),
            Storage::Half { packed: false, .. } => ("array<", "f16", ">"),
            Storage::Half { packed: true, .. } => match (self.vec4, self.writable) {
                (true, _) => ("array<vec2<", "u32", ">>"),
                (false, true) => ("array<atomic<", "u32", ">>"),
                (false, false) => ("array<", "u32", ">"),
            },
        };
        match self.storage {
            Storage::Windowed { windows, .. } => {
                for k in 0..windows {
                    let _ = writeln!(
                        out,
                        "@group(0) @binding({}) var<storage, {access}> {}_w{k}: {open}{scalar}{close};",
                        first + k,
                        self.name
                    );
                }
            }
            Storage::Native | Storage::Half { .. } | Storage::Bytes => {
                let _ = writeln!(
                    out,
                    "@group(0) @binding({first}) var<storage, {access}> {}: {open}{scalar}{close};",
                    self.name
                );
            }
        }
    }

    /// `ld_NAME(i)` (and `st_NAME(i, v)` where writable) of a windowed
    /// binding: window `i / per`, element `i - w * per` inside it.
    fn window_fns(&self) -> Vec<String> {
        let Storage::Windowed { windows, per } = self.storage else { return Vec::new() };
        let (name, elem, last) = (&self.name, self.elem(), windows - 1);
        let head = format!("    let w = i / {per}u;\n    let o = i - w * {per}u;\n");
        let mut ld = format!("fn ld_{name}(i: u32) -> {elem} {{\n{head}");
        for k in 0..last {
            let _ = write!(ld, "    if (w == {k}u) {{\n        return {name}_w{k}[o];\n    }}\n");
        }
        let _ = writeln!(ld, "    return {name}_w{last}[o];\n}}");
        let mut fns = vec![ld];
        if self.writable {
            let mut st = format!("fn st_{name}(i: u32, v: {elem}) {{\n{head}");
            for k in 0..last {
                let _ = write!(st, "    if (w == {k}u) {{\n        {name}_w{k}[o] = v;\n        return;\n    }}\n");
            }
            let _ = writeln!(st, "    {name}_w{last}[o] = v;\n}}");
            fns.push(st);
        }
        fns
    }

    /// `ld_NAME(o)`, `ldh_NAME(o)` and `ldf_NAME(o)` of a byte binding
    /// (see [`Storage::Bytes`]).
    fn byte_fns(&self) -> String {
        let Storage::Bytes = self.storage else { return String::new() };
        let name = &self.name;
        if self.writable {
            // Written a word at a time (`st_NAME(w, word)`), by the
            // invocation that owns the word.
            return format!("fn st_{name}(w: u32, v: u32) {{\n    {name}[w] = v;\n}}\n\n");
        }
        format!(
            "fn ld_{name}(o: u32) -> u32 {{\n    return ({name}[o >> 2u] >> ((o & 3u) * 8u)) & 0xffu;\n}}\n\nfn ldh_{name}(o: u32) -> u32 {{\n    return ({name}[o >> 2u] >> ((o & 2u) * 8u)) & 0xffffu;\n}}\n\nfn ldf_{name}(o: u32) -> f32 {{\n    return f16_bits(ldh_{name}(o));\n}}\n\n"
        )
    }

    /// `ld_NAME(i)` (and `st_NAME(i, v)` where writable) of a
    /// half-precision binding.
    fn half_fns(&self) -> String {
        let Storage::Half { bf16, packed } = self.storage else { return String::new() };
        let name = &self.name;
        let mut s = String::new();
        let (reg, lanes) = if self.vec4 { ("vec4<f32>", 4) } else { ("f32", 1) };
        if !packed {
            let st = if lanes == 4 { "vec4<f16>" } else { "f16" };
            let _ = writeln!(s, "fn ld_{name}(i: u32) -> {reg} {{\n    return {reg}({name}[i]);\n}}\n");
            if self.writable {
                let _ = writeln!(s, "fn st_{name}(i: u32, v: {reg}) {{\n    {name}[i] = {st}(v);\n}}\n");
            }
            return s;
        }
        // 16 bits of element to f32, f32 to 16 bits.
        let (un, pk): (Conv, Conv) = if bf16 {
            (|b| format!("bf16_unpack({b})"), |v| format!("bf16_pack({v})"))
        } else {
            (|b| format!("unpack2x16float({b}).x"), |v| format!("(pack2x16float(vec2<f32>({v}, 0.0)) & 0xffffu)"))
        };
        if self.vec4 {
            let _ = writeln!(
                s,
                "fn ld_{name}(i: u32) -> vec4<f32> {{\n    let w = {name}[i];\n    return vec4<f32>({}, {}, {}, {});\n}}\n",
                un("(w.x & 0xffffu)"),
                un("(w.x >> 16u)"),
                un("(w.y & 0xffffu)"),
                un("(w.y >> 16u)")
            );
            if self.writable {
                let _ = writeln!(
                    s,
                    "fn st_{name}(i: u32, v: vec4<f32>) {{\n    {name}[i] = vec2<u32>({} | ({} << 16u), {} | ({} << 16u));\n}}\n",
                    pk("v.x"),
                    pk("v.y"),
                    pk("v.z"),
                    pk("v.w")
                );
            }
        } else if self.writable {
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
}

/// A conversion written as WGSL: the expression of an argument's.
type Conv = fn(&str) -> String;

/// bf16 conversions: unpack by a shift; pack rounding to nearest even,
/// NaN kept (quieted) rather than rounded into infinity.
const BF16_FNS: &str = "fn bf16_unpack(h: u32) -> f32 {\n    return bitcast<f32>(h << 16u);\n}\n\nfn bf16_pack(v: f32) -> u32 {\n    let x = bitcast<u32>(v);\n    if ((x & 0x7fffffffu) > 0x7f800000u) {\n        return (x >> 16u) | 0x40u;\n    }\n    return (x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u;\n}\n\n";

/// `f16_bits(h)`: the f16 of bits `h` widened to f32 exactly, by integer
/// arithmetic (subnormals included, which `unpack2x16float` may flush).
const F16_BITS_FN: &str = "fn f16_bits(h: u32) -> f32 {\n    let s = (h & 0x8000u) << 16u;\n    let e = (h >> 10u) & 31u;\n    let m = h & 0x3ffu;\n    if (e == 0u) {\n        return bitcast<f32>(s | bitcast<u32>(ldexp(f32(m), -24)));\n    }\n    if (e == 31u) {\n        return bitcast<f32>(s | 0x7f800000u | (m << 13u));\n    }\n    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));\n}\n\n";

/// `round_bf16(v)`: an f32 register value rounded to bf16 precision
/// (nearest even; NaN and infinities kept), for explicit casts.
pub(crate) const ROUND_BF16: &str = "fn round_bf16(v: f32) -> f32 {\n    let x = bitcast<u32>(v);\n    if ((x & 0x7fffffffu) > 0x7f800000u) {\n        return v;\n    }\n    return bitcast<f32>(((x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u) << 16u);\n}\n";

/// `round_f16(v)`: an f32 register value rounded to f16 precision, through
/// `pack2x16float` (needs no `enable f16;`, so any kernel may cast).
pub(crate) const ROUND_F16: &str =
    "fn round_f16(v: f32) -> f32 {\n    return unpack2x16float(pack2x16float(vec2<f32>(v, 0.0))).x;\n}\n";

/// The storage bindings of one kernel pass, in binding order: inputs,
/// the scratch a split-K matmul's second pass reads, outputs, and the
/// error slot of a kernel that checks indices (bound last, never an
/// array).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bindings {
    /// `in0`, `in1`, ...
    pub inputs: Vec<Binding>,
    /// `scr`, between inputs and outputs.
    pub scratch: Option<Binding>,
    /// `out0`, `out1`, ...
    pub outputs: Vec<Binding>,
    /// The error slot `LZE` follows (see `super::index`).
    pub error_slot: bool,
}

impl Bindings {
    /// Every array binding, in binding order.
    fn arrays(&self) -> impl Iterator<Item = &Binding> {
        self.inputs.iter().chain(&self.scratch).chain(&self.outputs)
    }

    /// Whether any binding is stored as native f16 (the source then
    /// enables f16).
    pub fn native_f16(&self) -> bool {
        self.arrays().any(|b| matches!(b.storage, Storage::Half { packed: false, .. }))
    }

    /// Whether any binding is windowed.
    pub fn windowed(&self) -> bool {
        self.arrays().any(|b| matches!(b.storage, Storage::Windowed { .. }))
    }

    /// Storage bindings of the inputs (with the scratch) and of the
    /// outputs, windows counted: what the pipeline's layout binds.
    pub fn counts(&self) -> (usize, usize) {
        let sum = |v: &mut dyn Iterator<Item = &Binding>| v.map(|b| b.count() as usize).sum::<usize>();
        (sum(&mut self.inputs.iter().chain(&self.scratch)), sum(&mut self.outputs.iter()))
    }

    /// Windows per array binding, in binding order (see
    /// [`crate::codegen::window::KernelWindows`]).
    pub fn window_counts(&self) -> Vec<u32> {
        self.arrays().map(Binding::count).collect()
    }

    /// The declaration lines of the inputs (from binding 1).
    pub fn declare_inputs(&self) -> String {
        let mut s = String::new();
        let mut at = 1;
        for b in &self.inputs {
            b.declare(&mut s, at);
            at += b.count();
        }
        s
    }

    /// The declaration lines of the scratch and the outputs, after the
    /// inputs' bindings.
    pub fn declare_rest(&self) -> String {
        let mut s = String::new();
        let mut at = 1 + self.inputs.iter().map(Binding::count).sum::<u32>();
        for b in self.scratch.iter().chain(&self.outputs) {
            b.declare(&mut s, at);
            at += b.count();
        }
        s
    }

    /// The binding of the error slot, after every array binding.
    pub fn error_binding(&self) -> u32 {
        1 + self.arrays().map(Binding::count).sum::<u32>()
    }

    /// The access helpers that follow the last storage declaration: a
    /// blank line, the window helpers, then the half-precision ones
    /// (the bf16 conversions first where a binding is bf16); nothing
    /// where every binding is native.
    pub fn helpers(&self) -> String {
        let windows: Vec<String> = self.arrays().flat_map(Binding::window_fns).collect();
        let halves: String = self.arrays().map(Binding::half_fns).collect();
        let bytes: String = self.arrays().map(Binding::byte_fns).collect();
        let bf16 = self.arrays().any(|b| matches!(b.storage, Storage::Half { bf16: true, .. }));
        if windows.is_empty() && halves.is_empty() && bytes.is_empty() {
            return String::new();
        }
        let mut s = String::from("\n");
        if !windows.is_empty() {
            s.push_str(&windows.join("\n"));
            if !halves.is_empty() {
                s.push('\n');
            }
        }
        if bf16 {
            s.push_str(BF16_FNS);
        }
        s.push_str(&halves);
        if !bytes.is_empty() {
            s.push_str(F16_BITS_FN);
            s.push_str(&bytes);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel reading `in0` (vec4) and `in1`, writing `out0` and `out1`,
    /// through `b`'s accesses, as the assembler lays a source out.
    fn source(b: &Bindings, error_slot: bool) -> String {
        let (in0, in1) = (&b.inputs[0], &b.inputs[1]);
        let (out0, out1) = (&b.outputs[0], &b.outputs[1]);
        let mut s = String::new();
        if b.native_f16() {
            s.push_str("enable f16;\n");
        }
        s.push_str("struct Params {\n    z: u32,\n}\n\n@group(0) @binding(0) var<uniform> P: Params;\n");
        s.push_str(&b.declare_inputs());
        s.push_str(&b.declare_rest());
        if error_slot {
            let (head, tail) = ("struct LzErr {\n    claimed: atomic<u32>,\n    value: u32,\n}\n\n", "\nfn lz_report(v: u32) {\n    if (atomicExchange(&LZE.claimed, 1u) == 0u) {\n        LZE.value = v;\n    }\n}\n");
            s.push_str(head);
            s.push_str(&format!("@group(0) @binding({}) var<storage, read_write> LZE: LzErr;\n", b.error_binding()));
            s.push_str(&b.helpers());
            s.push_str(tail);
        } else {
            s.push_str(&b.helpers());
        }
        s.push_str(&format!("\nfn n3(i: u32) -> f32 {{\n    return {};\n}}\n\n", in1.load("i")));
        s.push_str("@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n    let t = gid.x;\n");
        s.push_str(&format!("    let x = {}[t & 3u] + n3(t);\n", in0.load("t >> 2u")));
        s.push_str(&format!("    {}\n", out0.store("t", &format!("x * {}.y", in0.load("min(t, 3u)")))));
        s.push_str(&format!("    {}\n", out1.store("t", &format!("{} * 2.0", out0.load("t")))));
        s.push_str("}\n");
        s
    }

    fn bindings(kinds: [(&'static str, bool, u64); 4], f16: HalfStorage, windows: &Windows) -> Bindings {
        let b = |k: usize, name: &str, writable: bool| {
            let (scalar, vec4, elements) = kinds[k];
            Binding::tensor(name.into(), scalar, vec4, writable, elements, (f16, windows)).unwrap()
        };
        Bindings {
            inputs: vec![b(0, "in0", false), b(1, "in1", false)],
            scratch: None,
            outputs: vec![b(2, "out0", true), b(3, "out1", true)],
            error_slot: false,
        }
    }

    /// Native bindings are indexed as they are: the layer writes exactly
    /// what a kernel without it wrote.
    #[test]
    fn native_bindings_are_indexed() {
        let b = bindings(
            [("f32", true, 64), ("f32", false, 64), ("f32", false, 64), ("f32", false, 64)],
            HalfStorage::Native,
            &Windows::UNBOUNDED,
        );
        assert_eq!(b.helpers(), "");
        let s = source(&b, false);
        assert!(s.contains("@group(0) @binding(1) var<storage, read> in0: array<vec4<f32>>;"), "{s}");
        assert!(s.contains("let x = in0[t >> 2u][t & 3u] + n3(t);"), "{s}");
        assert!(s.contains("out0[t] = x * in0[min(t, 3u)].y;\n    out1[t] = out0[t] * 2.0;"), "{s}");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
    }

    /// f16 and bf16 bindings go through conversion helpers, in both f16
    /// storages: native f16 enables f16, bf16 is packed (a written scalar
    /// binding as atomics), f32 bindings stay indexed; every form passes
    /// naga.
    #[test]
    fn half_precision_accesses_go_through_helpers() {
        let kinds = [("f16", true, 64), ("bf16", false, 64), ("bf16", false, 64), ("f32", false, 64)];
        let s = source(&bindings(kinds, HalfStorage::Native, &Windows::UNBOUNDED), false);
        assert!(s.starts_with("enable f16;\n"), "{s}");
        assert!(s.contains("var<storage, read> in0: array<vec4<f16>>;"), "{s}");
        assert!(s.contains("var<storage, read> in1: array<u32>;"), "{s}");
        assert!(s.contains("var<storage, read_write> out0: array<atomic<u32>>;"), "{s}");
        assert!(s.contains("var<storage, read_write> out1: array<f32>;"), "f32 untouched: {s}");
        assert!(s.contains("return ld_in1(i);"), "{s}");
        assert!(s.contains("let x = ld_in0(t >> 2u)[t & 3u] + n3(t);"), "{s}");
        assert!(s.contains("st_out0(t, x * ld_in0(min(t, 3u)).y);"), "{s}");
        assert!(s.contains("out1[t] = ld_out0(t) * 2.0;"), "{s}");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
        let p = source(&bindings(kinds, HalfStorage::Packed, &Windows::UNBOUNDED), false);
        assert!(!p.contains("enable f16"), "{p}");
        assert!(p.contains("var<storage, read> in0: array<vec2<u32>>;"), "{p}");
        assert!(p.contains("unpack2x16float((w.x & 0xffffu)).x"), "{p}");
        crate::validate_wgsl(&p).unwrap_or_else(|e| panic!("{e}\n{p}"));
        // vec4 outputs of both dtypes, both storages.
        for (scalar, f16) in [("f16", HalfStorage::Native), ("f16", HalfStorage::Packed), ("bf16", HalfStorage::Packed)]
        {
            let mut b = bindings(kinds, f16, &Windows::UNBOUNDED);
            b.outputs[0] = Binding::tensor("out0".into(), scalar, true, true, 64, (f16, &Windows::UNBOUNDED)).unwrap();
            let mut s = String::from(if b.native_f16() { "enable f16;\n" } else { "" });
            s.push_str(&b.declare_inputs());
            s.push_str(&b.declare_rest());
            s.push_str(&b.helpers());
            s.push_str(&format!("fn f(t: u32) {{\n    {}\n}}\n", b.outputs[0].store("t", "vec4<f32>(1.0)")));
            s.push_str(ROUND_BF16);
            s.push_str(ROUND_F16);
            crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{scalar} {f16:?}: {e}\n{s}"));
        }
        assert_eq!(
            Binding::tensor(
                "in0".into(),
                "f16",
                false,
                false,
                1 << 20,
                (HalfStorage::Native, &Windows::new(1 << 12, 16, None))
            ),
            None,
            "f16 is never windowed"
        );
    }

    /// A `u8` binding is bytes, four to a word, read through byte, u16
    /// and f16-scale helpers (naga accepts them); never vec4 or windowed.
    #[test]
    fn byte_bindings_load_bytes_halves_and_scales() {
        let t = |writable: bool, vec4: bool, elements: u64, windows: &Windows| {
            Binding::tensor("in0".into(), "u8", vec4, writable, elements, (HalfStorage::Packed, windows))
        };
        let b = t(false, false, 18, &Windows::UNBOUNDED).unwrap();
        assert_eq!(b.storage, Storage::Bytes);
        assert!(t(true, false, 18, &Windows::UNBOUNDED).is_some(), "written by words");
        assert_eq!(t(false, true, 18, &Windows::UNBOUNDED), None, "as vec4");
        // 256-byte windows: 1024 bytes would need 4 of them.
        let small = Windows::new(128 << 20, 16, Some(256));
        assert_eq!(t(false, false, 1024, &small), None, "windowed");
        assert!(t(false, false, 256, &small).is_some(), "one window of words");
        let bs = Bindings { inputs: vec![b], ..Default::default() };
        let mut s = bs.declare_inputs();
        assert!(s.contains("@group(0) @binding(1) var<storage, read> in0: array<u32>;"), "{s}");
        s.push_str(&bs.helpers());
        s.push_str("fn f(o: u32) -> f32 {\n    return f32(ld_in0(o + 2u)) * ldf_in0(o) + f32(ldh_in0(o + 4u));\n}\n");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
    }

    /// A windowed binding is one binding per window (those after it
    /// renumbered, the error slot last) reached through helpers that pick
    /// the window by division; unwindowed ones stay indexed.
    #[test]
    fn windowed_bindings_are_renumbered_and_accessed_through_helpers() {
        // 256-byte windows: 16 vec4s, 64 f32s.
        let windows = Windows::new(128 << 20, 16, Some(256));
        let b = Bindings {
            error_slot: true,
            ..bindings(
                [("f32", true, 128), ("f32", false, 64), ("f32", false, 192), ("f32", false, 64)],
                HalfStorage::Native,
                &windows,
            )
        };
        assert_eq!(b.window_counts(), [2, 1, 3, 1]);
        assert_eq!(b.counts(), (3, 4));
        assert_eq!(b.error_binding(), 8);
        let s = source(&b, true);
        assert!(s.contains("@group(0) @binding(1) var<storage, read> in0_w0: array<vec4<f32>>;\n@group(0) @binding(2) var<storage, read> in0_w1: array<vec4<f32>>;\n@group(0) @binding(3) var<storage, read> in1: array<f32>;\n@group(0) @binding(4) var<storage, read_write> out0_w0: array<f32>;\n"), "{s}");
        assert!(s.contains("@binding(6) var<storage, read_write> out0_w2"), "{s}");
        assert!(s.contains("@group(0) @binding(8) var<storage, read_write> LZE: LzErr;"), "{s}");
        assert!(s.contains("fn ld_in0(i: u32) -> vec4<f32> {\n    let w = i / 16u;\n    let o = i - w * 16u;"), "{s}");
        assert!(s.contains("fn st_out0(i: u32, v: f32) {\n    let w = i / 64u;\n    let o = i - w * 64u;"), "{s}");
        assert!(s.contains("return in1[i];"), "unwindowed bindings untouched: {s}");
        assert!(s.contains("let x = ld_in0(t >> 2u)[t & 3u] + n3(t);"), "{s}");
        assert!(s.contains("st_out0(t, x * ld_in0(min(t, 3u)).y);"), "{s}");
        assert!(s.contains("out1[t] = ld_out0(t) * 2.0;"), "{s}");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
    }
}
