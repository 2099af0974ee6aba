//! Tensors beyond one storage binding: window planning.
//!
//! An adapter binds at most `max_storage_buffer_binding_size` bytes of a
//! buffer to one shader variable (128 MiB on lavapipe, 2 GiB - 1 through
//! wgpu on NVIDIA), while a buffer may be far larger
//! (`max_buffer_size`: 2 GiB on lavapipe, up to 2^52 on NVIDIA). A tensor
//! of more bytes than one binding is therefore stored as one buffer, like
//! any other (the pool serves storage requests up to `max_buffer_size`),
//! and bound as several *windows*: consecutive ranges of
//! [`Windows::bytes`] bytes (the binding limit rounded down to a multiple
//! of 256 bytes and of `min_storage_buffer_offset_alignment`), each a
//! binding of its own at an aligned offset ([`Windows::ranges`]).
//!
//! Kernels reach the windows through a source rewrite ([`split`]) applied
//! after lowering (on the crate's one tokenizer of generated WGSL, the
//! private `wgsl_text` module, which the size families and fault
//! injection use too), so the code generators never see windows: a windowed
//! binding `in0` becomes `in0_w0`, `in0_w1`, ... (bindings renumbered), a
//! read `in0[e]` becomes `ld_in0(e)` and a write `out0[e] = v;` becomes
//! `st_out0(e, v);`, where `ld_`/`st_` pick the window by dividing the
//! index by a constant (a shift where the window is a power of two, as on
//! lavapipe) and the offset inside it. The arithmetic is exact because
//! indices are u32 element (or vec4) indices, windows hold a whole number
//! of them, and a tensor has at most `u32::MAX` elements (beyond that,
//! lowering refuses it). Every kernel family works this way unchanged:
//! elementwise chains, copies, reductions, softmax and norm rows, matmul
//! operands and outputs, gathers, concats, fused attention.
//!
//! What it costs: nothing for a kernel whose tensors each fit one binding
//! (one window is all a binding holds). Its source is not rewritten
//! (byte-identical WGSL), its bindings are whole buffers and its dispatch
//! is the same. A windowed kernel pays a division by a constant and a
//! branch per window per access of a windowed tensor: uniform across a
//! GPU subgroup except at a window's edge, but on llvmpipe, which runs
//! lanes in SIMD and masks branches, windowed kernels run 1.3-4x slower
//! and windowed register-blocked matmuls compile several times slower.
//!
//! Limits: each window is a storage binding, counted against the
//! adapter's bindings per shader stage. The fusion planner counts them
//! (`FusionLimits::window_elements`), so it splits kernels that would need
//! too many; a single node whose windows alone exceed the limit, a tensor
//! over `max_buffer_size`, and one over `u32::MAX` elements are
//! `BackendError::TooLarge` naming the op, the size and the limit.
//!
//! The contract for kernel generators (checked by [`split`], which
//! refuses anything else with [`SplitError`], a typed error at compile
//! time, never a wrong kernel): storage bindings are declared one per
//! line as `@group(0) @binding(N) var<storage, ACCESS> NAME: array<T>;`
//! with `N` = 1, 2, ... in kernel order (inputs, then outputs), `T` a
//! 32-bit scalar or a vector of them, then any other storage bindings
//! (the error slot of kernels that check indices, any type), which are
//! renumbered and never windowed; an array binding is only ever indexed:
//! `NAME[index]` as a value (followed by anything but an assignment) or
//! `NAME[index] = value;` as a whole statement. No pointers to bindings,
//! no `arrayLength`, no compound assignment, no assignment to a
//! component (`NAME[i].x = v`).
//!
//! Rejected alternatives: chunked dispatches with a base index and
//! dynamic binding offsets would keep one binding per tensor, but every
//! kernel form would need a per-dispatch base in its index math, and
//! kernels that read a tensor at data-dependent or strided positions (a
//! matmul's B operand, an embedding table, a transpose) cannot be cut
//! into independent chunks at all. Binding arrays
//! (`binding_array<array<f32>>`) would index windows directly but need
//! native-only features many adapters lack.

use lazuli_ir::fusion::Kernel;
use lazuli_ir::VerifiedGraph;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use thiserror::Error;

use crate::codegen::{Passes, Wgsl};
use crate::wgsl_text::{self, StorageDecl};

/// The smallest window: also the smallest size class of the pool, so
/// window offsets are multiples of every offset alignment wgpu allows.
pub const MIN_WINDOW_BYTES: u64 = 256;

/// How tensors beyond one binding are bound: windows of [`Windows::bytes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Windows {
    bytes: u64,
}

impl Windows {
    /// The windows of an adapter whose storage bindings hold at most
    /// `max_binding` bytes, at offsets aligned to `alignment`; `clamp`
    /// (tests) asks for smaller windows. The window is the largest
    /// multiple of [`MIN_WINDOW_BYTES`] and `alignment` within both (at
    /// least one such multiple), so a value that fits one binding is
    /// never windowed.
    pub fn new(max_binding: u64, alignment: u32, clamp: Option<u64>) -> Windows {
        let limit = clamp.map_or(max_binding, |c| c.min(max_binding));
        let unit = MIN_WINDOW_BYTES.max(alignment as u64).next_power_of_two();
        Windows { bytes: (limit / unit * unit).max(unit) }
    }

    /// Bytes of one window.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// 32-bit elements of one window (every device dtype is stored as 32
    /// bits per element).
    pub fn elements(&self) -> u64 {
        self.bytes / 4
    }

    /// Windows of a value of `elements` 32-bit elements: 1 when it fits
    /// one window (bound whole, as always), else one per window it
    /// touches.
    pub fn count(&self, elements: u64) -> u32 {
        let n = elements.saturating_mul(4).div_ceil(self.bytes).max(1);
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// `(offset, size)` of each of the `count` windows of a buffer of
    /// `buffer_size` bytes holding a windowed value: consecutive windows
    /// of [`Windows::bytes`], the last one up to the buffer's end (at most
    /// one window), so reads just past the value stay inside the buffer
    /// exactly as with a whole-buffer binding.
    pub fn ranges(&self, buffer_size: u64, count: u32) -> Vec<(u64, u64)> {
        (0..count as u64)
            .map(|k| {
                let offset = k * self.bytes;
                debug_assert!(offset < buffer_size, "window {k} beyond a buffer of {buffer_size} bytes");
                (offset, self.bytes.min(buffer_size.saturating_sub(offset)) & !3)
            })
            .collect()
    }
}

/// The windows of every storage binding of one lowered kernel, in binding
/// order (inputs, then outputs), for the kernel and, when it has one, its
/// first pass (see `Wgsl::pre`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelWindows {
    /// Windows per storage binding of the kernel proper.
    pub main: Vec<u32>,
    /// Windows per storage binding of the first pass (empty without one).
    pub pre: Vec<u32>,
}

impl KernelWindows {
    /// The windows of `kernel` of `graph`, lowered as `wgsl`. A two-pass
    /// kernel's first pass binds the inputs and the scratch partials, its
    /// second the scratch and the outputs (the inputs, then the scratch,
    /// then the outputs where `Wgsl::binds_inputs`); scratch holds at most
    /// a few partials per output and is never windowed.
    pub fn of(kernel: &Kernel, graph: &VerifiedGraph, wgsl: &Wgsl, windows: &Windows) -> KernelWindows {
        KernelWindows::counted(kernel, graph, wgsl.pre.is_some(), wgsl.binds_inputs, windows)
    }

    /// The windows of `kernel` of `graph` scheduled in `passes` (see
    /// [`crate::codegen::Schedule`]), before it is lowered: what
    /// [`KernelWindows::of`] finds in its lowering.
    pub fn scheduled(kernel: &Kernel, graph: &VerifiedGraph, passes: Passes, windows: &Windows) -> KernelWindows {
        KernelWindows::counted(kernel, graph, passes.two(), passes.binds_inputs(), windows)
    }

    /// The windows of `kernel` of `graph`, in two passes where `two`, its
    /// second binding the inputs too where `binds_inputs`.
    fn counted(
        kernel: &Kernel,
        graph: &VerifiedGraph,
        two: bool,
        binds_inputs: bool,
        windows: &Windows,
    ) -> KernelWindows {
        let count = |id: &lazuli_ir::NodeId| windows.count(graph.node(*id).shape.numel() as u64);
        let inputs = kernel.inputs.iter().map(count);
        let outputs = kernel.outputs.iter().map(count);
        match (two, binds_inputs) {
            (false, _) => KernelWindows { main: inputs.chain(outputs).collect(), pre: Vec::new() },
            (true, true) => KernelWindows {
                main: inputs.clone().chain(std::iter::once(1)).chain(outputs).collect(),
                pre: inputs.chain(std::iter::once(1)).collect(),
            },
            (true, false) => KernelWindows {
                main: std::iter::once(1).chain(outputs).collect(),
                pre: inputs.chain(std::iter::once(1)).collect(),
            },
        }
    }

    /// Whether any binding of either pass is windowed.
    pub fn is_windowed(&self) -> bool {
        self.main.iter().chain(&self.pre).any(|&w| w > 1)
    }

    /// Storage bindings of the pass that needs the most.
    pub fn bindings(&self) -> usize {
        let sum = |v: &[u32]| v.iter().map(|&w| w as usize).sum::<usize>();
        sum(&self.main).max(sum(&self.pre))
    }
}

/// Rewrites `wgsl` (and its first pass) for the windows of `kw`: sources
/// through [`split`], binding counts to the windows. Unchanged when
/// nothing is windowed.
pub fn apply(wgsl: &mut Wgsl, kw: &KernelWindows, windows: &Windows) -> Result<(), SplitError> {
    if !kw.is_windowed() {
        return Ok(());
    }
    if let Some(pre) = wgsl.pre.as_deref_mut() {
        rewrite_pass(pre, &kw.pre, windows)?;
    }
    rewrite_pass(wgsl, &kw.main, windows)
}

fn rewrite_pass(w: &mut Wgsl, counts: &[u32], windows: &Windows) -> Result<(), SplitError> {
    debug_assert_eq!(counts.len(), w.inputs + w.outputs);
    w.source = split(&w.source, counts, windows.bytes)?;
    let (ins, outs) = counts.split_at(w.inputs);
    w.inputs = ins.iter().map(|&c| c as usize).sum();
    w.outputs = outs.iter().map(|&c| c as usize).sum();
    Ok(())
}

/// Why a source cannot be windowed: it breaks the contract in the module
/// documentation. Reported as `BackendError::TooLarge` (the tensor does
/// not fit one binding and this kernel cannot use windows).
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum SplitError {
    /// The storage declarations are not `array` bindings 1..=n, one per
    /// line, as many as there are window counts, followed only by
    /// bindings of other types.
    #[error("storage bindings are not declared as array bindings 1..={expected} (then others), one per line")]
    Layout {
        /// Bindings expected.
        expected: usize,
    },
    /// An element type other than a 32-bit scalar or vector.
    #[error("binding {name} holds {elem}, not 32-bit scalars or vectors")]
    Element {
        /// The binding.
        name: String,
        /// Its element type.
        elem: String,
    },
    /// A windowed binding used other than by `NAME[i]` or `NAME[i] = v;`.
    #[error("binding {name} is used other than by index ({context:?})")]
    Access {
        /// The binding.
        name: String,
        /// The source around the use.
        context: String,
    },
}

/// Bytes of one element of a binding's array type, for 32-bit scalars and
/// vectors.
fn elem_bytes(elem: &str) -> Option<u64> {
    match elem {
        "f32" | "i32" | "u32" => Some(4),
        _ => {
            let (lanes, inner) = elem.strip_prefix("vec")?.split_once('<')?;
            let inner = inner.strip_suffix('>')?;
            let lanes: u64 = lanes.parse().ok()?;
            (matches!(inner, "f32" | "i32" | "u32") && (2..=4).contains(&lanes))
                .then_some(4 * lanes.next_power_of_two())
        }
    }
}

/// How one windowed binding is addressed.
struct Split {
    windows: u32,
    /// Array elements per window.
    per: u64,
}

/// Rewrites `source` so that storage binding `k + 1` is bound as
/// `windows[k]` windows of `window_bytes` bytes (see the module
/// documentation). With every count 1 the source is returned unchanged.
pub fn split(source: &str, windows: &[u32], window_bytes: u64) -> Result<String, SplitError> {
    if windows.iter().all(|&w| w <= 1) {
        return Ok(source.to_string());
    }
    debug_assert!(window_bytes.is_multiple_of(MIN_WINDOW_BYTES));
    let layout = || SplitError::Layout { expected: windows.len() };
    // Every storage declaration, bindings 1, 2, ... in order: the arrays
    // the counts are for, then any others (an error slot).
    let mut decls: Vec<StorageDecl> = Vec::new();
    for decl in wgsl_text::storage_decls(source) {
        let d = decl.map_err(|_| layout())?;
        let arrays_done = decls.last().is_some_and(|last| last.elem().is_none());
        if d.binding as usize != decls.len() + 1 || (d.elem().is_some() && arrays_done) {
            return Err(layout());
        }
        decls.push(d);
    }
    if decls.iter().filter(|d| d.elem().is_some()).count() != windows.len() {
        return Err(layout());
    }
    let mut split_of: BTreeMap<&str, Split> = BTreeMap::new();
    for (d, &w) in decls.iter().zip(windows) {
        let elem = d.elem().expect("arrays come first");
        if w > 1 {
            let eb = elem_bytes(elem).ok_or_else(|| SplitError::Element { name: d.name.clone(), elem: elem.into() })?;
            split_of.insert(&d.name, Split { windows: w, per: window_bytes / eb });
        }
    }
    // Each declaration in place, renumbered, windows expanded; the
    // helpers after the last one; accesses rewritten everywhere else.
    let mut out = String::with_capacity(source.len() * 2);
    let mut helpers: Vec<String> = Vec::new();
    let mut binding = 1u32;
    let mut pos = 0;
    for d in &decls {
        out.push_str(&rewrite(&source[pos..d.line.start], &split_of)?);
        pos = d.line.end;
        let Some(s) = split_of.get(d.name.as_str()) else {
            out.push_str(&d.render(binding, &d.name));
            binding += 1;
            continue;
        };
        for k in 0..s.windows {
            out.push_str(&d.render(binding, &format!("{}_w{k}", d.name)));
            binding += 1;
        }
        let elem = d.elem().expect("windowed bindings are arrays");
        helpers.extend(window_fns(&d.name, elem, s, d.access == "read_write"));
    }
    out.push('\n');
    out.push_str(&helpers.join("\n"));
    out.push_str(&rewrite(&source[pos..], &split_of)?);
    Ok(out)
}

/// `ld_NAME(i)` (and `st_NAME(i, v)` for a writable binding): window
/// `i / per`, element `i - w * per` inside it.
fn window_fns(name: &str, elem: &str, s: &Split, writable: bool) -> Vec<String> {
    let (per, last) = (s.per, s.windows - 1);
    let head = format!("    let w = i / {per}u;\n    let o = i - w * {per}u;\n");
    let mut ld = format!("fn ld_{name}(i: u32) -> {elem} {{\n{head}");
    for k in 0..last {
        let _ = write!(ld, "    if (w == {k}u) {{\n        return {name}_w{k}[o];\n    }}\n");
    }
    let _ = writeln!(ld, "    return {name}_w{last}[o];\n}}");
    let mut fns = vec![ld];
    if writable {
        let mut st = format!("fn st_{name}(i: u32, v: {elem}) {{\n{head}");
        for k in 0..last {
            let _ = write!(st, "    if (w == {k}u) {{\n        {name}_w{k}[o] = v;\n        return;\n    }}\n");
        }
        let _ = writeln!(st, "    {name}_w{last}[o] = v;\n}}");
        fns.push(st);
    }
    fns
}

/// Rewrites the accesses of windowed bindings in `text` (code between
/// declarations); comments are copied as they are.
fn rewrite(text: &str, split_of: &BTreeMap<&str, Split>) -> Result<String, SplitError> {
    wgsl_text::rewrite_indexed(text, &|name| split_of.contains_key(name), &|name, context| SplitError::Access {
        name: name.to_string(),
        context: context.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = "// generated by lazuli-wgpu\nstruct Params {\n    z: u32,\n}\n\n@group(0) @binding(0) var<uniform> P: Params;\n@group(0) @binding(1) var<storage, read> in0: array<vec4<f32>>;\n@group(0) @binding(2) var<storage, read> in1: array<f32>;\n@group(0) @binding(3) var<storage, read_write> out0: array<f32>;\n\nfn n3(i: u32) -> f32 {\n    return in1[i];\n}\n\n@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n    let t = gid.x;\n    // in0 is read as vectors\n    let x = in0[t >> 2u][t & 3u] + n3(t);\n    out0[t] = x * in0[min(t, 3u)].y;\n    out0[t + 1u] = out0[t] * 2.0;\n}\n";

    #[test]
    fn windows_are_powers_of_two_within_the_binding_limit() {
        assert_eq!(Windows::new(128 << 20, 16, None).bytes(), 128 << 20);
        assert_eq!(Windows::new((1 << 31) - 1, 64, None).bytes(), (1 << 31) - 256);
        assert_eq!(Windows::new((1 << 31) - 1, 1024, None).bytes(), (1 << 31) - 1024);
        assert_eq!(Windows::new(128 << 20, 16, Some(5000)).bytes(), 4864);
        assert_eq!(Windows::new(128 << 20, 16, Some(1)).bytes(), MIN_WINDOW_BYTES);
        assert_eq!(Windows::new(128 << 20, 1024, Some(1)).bytes(), 1024);
        let w = Windows::new(1 << 12, 16, None);
        assert_eq!((w.count(0), w.count(1024), w.count(1025), w.count(4096)), (1, 1, 2, 4));
        assert_eq!(w.ranges(5 << 10, 2), vec![(0, 4096), (4096, 1024)]);
        assert_eq!(w.ranges(16 << 10, 2), vec![(0, 4096), (4096, 4096)]);
    }

    #[test]
    fn nothing_windowed_leaves_the_source_byte_identical() {
        assert_eq!(split(SRC, &[1, 1, 1], 256).unwrap(), SRC);
    }

    #[test]
    fn windowed_bindings_are_renumbered_and_accessed_through_helpers() {
        let s = split(SRC, &[2, 1, 3], 256).unwrap();
        assert!(s.contains("@group(0) @binding(1) var<storage, read> in0_w0: array<vec4<f32>>;\n@group(0) @binding(2) var<storage, read> in0_w1: array<vec4<f32>>;\n@group(0) @binding(3) var<storage, read> in1: array<f32>;\n@group(0) @binding(4) var<storage, read_write> out0_w0: array<f32>;\n"), "{s}");
        assert!(s.contains("@binding(6) var<storage, read_write> out0_w2"), "{s}");
        // 256-byte windows: 16 vec4s, 64 f32s.
        assert!(s.contains("fn ld_in0(i: u32) -> vec4<f32> {\n    let w = i / 16u;\n    let o = i - w * 16u;"), "{s}");
        assert!(s.contains("fn st_out0(i: u32, v: f32) {\n    let w = i / 64u;\n    let o = i - w * 64u;"), "{s}");
        assert!(s.contains("return in1[i];"), "unwindowed bindings untouched: {s}");
        assert!(s.contains("let x = ld_in0(t >> 2u)[t & 3u] + n3(t);"), "{s}");
        assert!(s.contains("st_out0(t, x * ld_in0(min(t, 3u)).y);"), "{s}");
        assert!(s.contains("st_out0(t + 1u, ld_out0(t) * 2.0);"), "{s}");
        assert!(s.contains("// in0 is read as vectors"), "comments are copied: {s}");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
    }

    #[test]
    fn an_error_slot_after_the_arrays_is_renumbered_and_kept() {
        let src = SRC.replace(
            "@group(0) @binding(3) var<storage, read_write> out0: array<f32>;\n",
            "@group(0) @binding(3) var<storage, read_write> out0: array<f32>;\nstruct LzErr {\n    claimed: atomic<u32>,\n    value: u32,\n}\n\n@group(0) @binding(4) var<storage, read_write> LZE: LzErr;\n\nfn lz_report(v: u32) {\n    if (atomicExchange(&LZE.claimed, 1u) == 0u) {\n        LZE.value = v;\n    }\n}\n",
        );
        crate::validate_wgsl(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
        let s = split(&src, &[1, 2, 3], 256).unwrap();
        assert!(s.contains("@group(0) @binding(7) var<storage, read_write> LZE: LzErr;"), "{s}");
        assert!(s.contains("atomicExchange(&LZE.claimed, 1u)"), "{s}");
        crate::validate_wgsl(&s).unwrap_or_else(|e| panic!("{e}\n{s}"));
        // An array binding after another kind is outside the contract.
        let late = src.replace(
            "@group(0) @binding(4) var<storage, read_write> LZE: LzErr;\n",
            "@group(0) @binding(4) var<storage, read_write> LZE: LzErr;\n@group(0) @binding(5) var<storage, read> in9: array<f32>;\n",
        );
        assert!(matches!(split(&late, &[1, 2, 3, 2], 256), Err(SplitError::Layout { .. })));
    }

    #[test]
    fn uses_other_than_by_index_are_refused() {
        let bad = |body: &str| {
            let src = SRC.replace("    out0[t + 1u] = out0[t] * 2.0;\n", body);
            split(&src, &[1, 1, 2], 256)
        };
        assert!(matches!(bad("    let n = arrayLength(&out0);\n"), Err(SplitError::Access { .. })));
        assert!(matches!(bad("    out0[t] += 1.0;\n"), Err(SplitError::Access { .. })));
        assert!(bad("    out0[t] <= 1.0;\n").is_ok(), "a comparison is a load");
        assert!(matches!(bad("    out0[t] <<= 1u;\n"), Err(SplitError::Access { .. })));
        assert!(matches!(bad("    out0[t].x = 1.0;\n"), Err(SplitError::Access { .. })));
        let src = SRC.replace("out0: array<f32>", "out0: array<f16>");
        assert!(matches!(split(&src, &[1, 1, 2], 256), Err(SplitError::Element { .. })));
        assert!(matches!(split(SRC, &[1, 2], 256), Err(SplitError::Layout { .. })));
    }
}
