//! Kernels generic over sizes: the "automatic dynamic" step between
//! lowering and pipeline creation.
//!
//! Codegen bakes sizes into WGSL as integer literals (`52u`, `(-3i)`), which
//! gives the driver constant divisors and trip counts, the fastest code.
//! Two graphs that differ only in sizes therefore lower to sources that
//! differ only in those literals. A *family* is the set of sources with the
//! same *skeleton*: the source with every replaceable integer literal
//! blanked. Replaceable means a suffixed (`u` or `i`) integer literal
//! outside the places WGSL requires a constant (array sizes, attributes,
//! `const` declarations, `case` selectors, comments). Tokens are those of
//! the crate's one tokenizer of generated WGSL (the private `wgsl_text`
//! module, shared with windows and fault injection).
//!
//! Sources are first put in a canonical form: the names codegen derives
//! from node ids (`n144`, `e37`, `x9`) are renumbered in order of first
//! appearance, so kernels that differ only in node numbering (the same
//! layer twice in one model; a graph where a node upstream was optimized
//! away at one size) are one source and one pipeline.
//!
//! The first source of a family compiles as it is. When a later member
//! differs in some literal values, those positions become *dynamic*: the
//! kernel is compiled once more with them read from a small buffer
//! (`@group(1) @binding(0) var<storage, read> LZD: array<u32>`), and every
//! later member whose other literals match runs that pipeline with its own
//! values in its own buffer, compiling nothing. A storage buffer, not a
//! uniform: lavapipe specializes shaders on the values of small uniform
//! buffers that bound loops (Mesa's uniform inlining), which would compile
//! the kernel again for every size, at run time. A member that differs in a
//! literal still baked widens the family again, so positions only ever
//! turn dynamic and a family stabilizes after a few members. To make that
//! one widening, the runtime lowers the previous graph of the same
//! structure too and records its sources with [`Families::observe`]
//! before the first size variant compiles, so every literal that differs
//! between the two sizes turns dynamic at once; and codegen writes values
//! derived from sizes in generic kernels as expressions of the sizes
//! (`((13u + 15u) / 16u)`, not `1u`), so a quotient that happens to be
//! equal for the first two sizes cannot widen the family later. A growing
//! sequence length or a partial last batch compiles a handful of
//! pipelines instead of one set per size, while sizes that never change
//! stay constants.
//!
//! A size variant's kernels are first read against the same kernels of
//! the variant compiled before ([`Member`]): where a source differs from
//! its predecessor's only in the digits of its replaceable literals and
//! its values fit the family, the values are read in one comparison of
//! the text between the literals and the family's generic source (kept
//! with the family) is reused, with no scan, no renumbering and no
//! rewrite. Anything else (a literal that must widen the family, other
//! text) takes the scan above; debug builds check every read against it.
//!
//! This is sound by construction: the generic source is the member's own
//! source with some literals replaced by loads of the same values, so a
//! member run through the generic pipeline computes exactly what its own
//! source computes. Dispatch sizes, scratch sizes and every other
//! per-instance number stay with the member's lowering. Structural
//! differences the codegen derives from sizes (the vec4 path when a size is
//! a multiple of 4, the matmul tile, register-cached or online softmax,
//! llvmpipe's loop splitting) change the skeleton, so they start their own
//! family: the forms stay what the sizes ask for.

use crate::codegen::FixedSizes;
use crate::wgsl_text::{self, Kind, Lexer};
use lazuli_executor::metrics;
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{Graph, NodeId, Op, StableHasher};
use std::fmt::Write as _;
use std::hash::BuildHasherDefault;
use std::num::NonZeroUsize;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Which sizes differ between a graph and the graph of the same structure
/// compiled before it at other sizes: per node, a mask of the axes whose
/// lengths differ. Kernels whose nodes all keep their sizes compile as
/// static kernels (the earlier graph's pipelines serve them), and kernels
/// generic over sizes keep the forms of the sizes that stay fixed (see
/// [`crate::codegen::LowerLimits::fixed`]). A growing sequence changes the
/// rows of the projections, not their widths; a partial last batch leaves
/// the optimizer's update kernels untouched.
///
/// Only a guide to forms: whatever it says, a generic kernel's source is
/// its own lowering with literals made dynamic, and a form that changes
/// with a size starts a family of its own.
pub(crate) struct SizeChanges {
    /// Per node, bit `a` set where axis `a` differs (axes from 64 on
    /// always count as differing).
    changed: Vec<u64>,
}

impl SizeChanges {
    /// The sizes that differ between `now` and `earlier`, two graphs of
    /// one structure, if they align node for node (same ops and ranks:
    /// the optimizer may have removed a node at one of the sizes).
    pub fn between(now: &Graph, earlier: &Graph) -> Option<SizeChanges> {
        let (a, b) = (now.nodes(), earlier.nodes());
        let aligned = a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| x.op.label() == y.op.label() && x.shape.rank() == y.shape.rank());
        let mask = |x: &[usize], y: &[usize]| {
            x.iter()
                .zip(y)
                .enumerate()
                .fold(0u64, |m, (i, (p, q))| if p != q || i >= 64 { m | 1 << i.min(63) } else { m })
        };
        aligned.then(|| SizeChanges {
            changed: a.iter().zip(b).map(|(x, y)| mask(x.shape.dims(), y.shape.dims())).collect(),
        })
    }

    /// Whether axis `axis` of node `id` differs.
    fn varies(&self, id: NodeId, axis: usize) -> bool {
        axis >= 64 || self.changed[id.index()] & (1 << axis) != 0
    }

    /// Whether any size of node `id` differs.
    fn node_varies(&self, id: NodeId) -> bool {
        self.changed[id.index()] != 0
    }

    /// For kernel `k` of `graph`: `None` where none of its nodes changes
    /// size (it compiles static), else the sizes its generic form may keep
    /// fixed.
    pub fn kernel(&self, k: &Kernel, graph: &Graph) -> Option<FixedSizes> {
        let nodes = || k.inputs.iter().chain(&k.inline).chain(&k.outputs).copied();
        if !nodes().any(|id| self.node_varies(id)) {
            return None;
        }
        let last_fixed = |id: NodeId| {
            let rank = graph.node(id).shape.rank();
            rank == 0 || !self.varies(id, rank - 1)
        };
        let root = graph.node(k.root());
        let mut fixed = FixedSizes {
            row: last_fixed(k.root())
                && match root.op {
                    Op::Reduce { .. } | Op::Softmax { .. } | Op::ArgReduce { .. } => {
                        root.inputs.first().is_none_or(|&x| last_fixed(x))
                    }
                    _ => true,
                },
            ..FixedSizes::NONE
        };
        if let Some(mm) = k.matmul_node(graph) {
            let r = graph.node(mm).shape.rank();
            let a = graph.node(mm).inputs[0];
            let ra = graph.node(a).shape.rank();
            fixed.m = !self.varies(mm, r - 2);
            fixed.n = !self.varies(mm, r - 1);
            fixed.k = !self.varies(a, ra - 1);
        }
        Some(fixed)
    }
}

/// Name of the storage buffer holding a generic kernel's dynamic values.
pub const DIMS_VAR: &str = "LZD";

/// The directive heading kernels that store f16 natively.
const ENABLE_F16: &str = "enable f16;\n";

/// A replaceable integer literal of a source.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Literal {
    /// Byte range in the canonical source.
    start: usize,
    end: usize,
    /// Byte range in the source as lowered (before renumbering).
    raw: Range<usize>,
    /// Its bits (i32 literals as two's complement).
    value: u32,
    /// `true` for `i32` (`5i`), `false` for `u32` (`5u`).
    signed: bool,
}

/// A source in canonical form, split into its skeleton and replaceable
/// literals.
#[derive(Clone, Debug)]
pub struct Scanned {
    /// The source with its node names renumbered (see [`scan`]).
    canonical: String,
    skeleton: String,
    literals: Vec<Literal>,
}

/// Prefixes of the names codegen derives from graph node ids (`n12`,
/// `e12`, `x12`): [`scan`] renumbers them.
const NODE_NAME_PREFIXES: &[u8] = b"nex";

/// Parses an integer literal token (`12u`, `0x1fu`, `7i`); `None` for
/// floats, abstract integers and anything else.
fn int_literal(token: &str) -> Option<(u32, bool)> {
    let (body, signed) =
        if let Some(b) = token.strip_suffix('u') { (b, false) } else { (token.strip_suffix('i')?, true) };
    let value = if let Some(hex) = body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
        u32::from_str_radix(hex, 16).ok()?
    } else if !body.is_empty() && body.bytes().all(|b| b.is_ascii_digit()) {
        body.parse::<u32>().ok()?
    } else {
        return None;
    };
    if signed && value > i32::MAX as u32 {
        return None;
    }
    Some((value, signed))
}

/// Whether `name` is a node-derived name: a prefix of
/// [`NODE_NAME_PREFIXES`] and decimal digits.
fn is_node_name(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() > 1 && NODE_NAME_PREFIXES.contains(&b[0]) && b[1..].iter().all(u8::is_ascii_digit)
}

/// Scans `source`: its canonical form, skeleton and replaceable literals.
///
/// The canonical form renames the node-derived names (`n144`, `e37`,
/// `x9`) to `n0`, `n1`, ... per prefix in order of first appearance. The
/// renaming is a bijection over all names of that form, so the canonical
/// source computes exactly what the source does; it makes the kernels of
/// two graphs that differ only in node numbering (a node removed upstream
/// at one size: a slice that covers its whole operand) one family.
pub fn scan(source: &str) -> Scanned {
    let bytes = source.as_bytes();
    let mut canonical = String::with_capacity(source.len());
    let mut skeleton = String::with_capacity(source.len());
    let mut literals = Vec::new();
    // Node names are short and never adversarial: the fast stable
    // hasher, not SipHash (this map is hit for every name of the source).
    let mut names: std::collections::HashMap<&str, String, BuildHasherDefault<StableHasher>> = Default::default();
    let mut counts = [0usize; NODE_NAME_PREFIXES.len()];
    let mut copied = 0usize;
    let mut lexer = Lexer::new(source);
    // Spaces and punctuation carry no literal or name: skipped byte-wise.
    while let Some(tok) = {
        lexer.skip_plain();
        lexer.next()
    } {
        let (start, end) = (tok.start, tok.end);
        let text = &source[start..end];
        match tok.kind {
            Kind::Punct if text == "@" => {
                // An attribute: its arguments must be constants.
                let Some(name) = lexer.next() else { break };
                if name.kind == Kind::Ident && bytes.get(name.end) == Some(&b'(') {
                    lexer.seek(wgsl_text::group_end(bytes, name.end).unwrap_or(bytes.len()));
                }
            }
            Kind::Ident => match text {
                // Array sizes are constants.
                "array" if bytes.get(end) == Some(&b'<') => {
                    lexer.seek(wgsl_text::group_end(bytes, end).unwrap_or(bytes.len()))
                }
                "const" => lexer.seek(wgsl_text::through(bytes, end, b';')),
                "case" => lexer.seek(wgsl_text::through(bytes, end, b':')),
                _ if is_node_name(text) => {
                    let renamed = names.entry(text).or_insert_with(|| {
                        let p = NODE_NAME_PREFIXES.iter().position(|&c| c == bytes[start]).expect("a prefix");
                        counts[p] += 1;
                        format!("{}{}", bytes[start] as char, counts[p] - 1)
                    });
                    canonical.push_str(&source[copied..start]);
                    skeleton.push_str(&source[copied..start]);
                    canonical.push_str(renamed);
                    skeleton.push_str(renamed);
                    copied = end;
                }
                _ => {}
            },
            Kind::Number => {
                if let Some((value, signed)) = int_literal(text) {
                    canonical.push_str(&source[copied..start]);
                    skeleton.push_str(&source[copied..start]);
                    let at = canonical.len();
                    canonical.push_str(text);
                    skeleton.push_str(if signed { "\u{1}i" } else { "\u{1}u" });
                    copied = end;
                    literals.push(Literal { start: at, end: canonical.len(), raw: start..end, value, signed });
                }
            }
            Kind::Comment | Kind::Space | Kind::Punct => {}
        }
    }
    canonical.push_str(&source[copied..]);
    skeleton.push_str(&source[copied..]);
    Scanned { canonical, skeleton, literals }
}

impl Scanned {
    /// The source with its node names renumbered: equal for kernels that
    /// differ only in node numbering (the same layer twice in a model).
    pub fn canonical(&self) -> &str {
        &self.canonical
    }

    /// The values of the replaceable literals, in source order.
    pub fn values(&self) -> Vec<u32> {
        self.literals.iter().map(|l| l.value).collect()
    }

    /// The hash of the skeleton and entry point: the family key.
    pub fn family_key(&self, entry: &str) -> u64 {
        lazuli_ir::stable_hash(&(&self.skeleton, entry))
    }

    /// The canonical source with each literal that has a slot
    /// (`slots[k]`) read from that slot of [`DIMS_VAR`]. Every member
    /// that fits a family's slots has the same one (see
    /// [`Family::generic`]).
    fn generic_source(&self, slots: &[Option<usize>]) -> String {
        let source = &self.canonical;
        // A directive (`enable f16;`, see `crate::codegen::access`) must stay first.
        let directive = if source.starts_with(ENABLE_F16) { ENABLE_F16 } else { "" };
        let mut out = String::with_capacity(source.len() + 64 + 8 * slots.len());
        out.push_str(directive);
        out.push_str("@group(1) @binding(0) var<storage, read> ");
        out.push_str(DIMS_VAR);
        out.push_str(": array<u32>;\n\n");
        let mut copied = directive.len();
        for (lit, slot) in self.literals.iter().zip(slots) {
            let Some(k) = *slot else { continue };
            out.push_str(&source[copied..lit.start]);
            if lit.signed {
                let _ = write!(out, "bitcast<i32>({DIMS_VAR}[{k}u])");
            } else {
                let _ = write!(out, "{DIMS_VAR}[{k}u]");
            }
            copied = lit.end;
        }
        out.push_str(&source[copied..]);
        out
    }

    /// The values of the slots `slots` gives this member's literals.
    fn slot_values(&self, slots: &[Option<usize>]) -> Vec<u32> {
        slot_values(slots, self.literals.iter().map(|l| l.value))
    }
}

/// The values of `LZD` for a member whose literals have `values`, in
/// order: each slot's value (positions sharing a slot hold equal ones).
fn slot_values(slots: &[Option<usize>], values: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let count = slots.iter().flatten().map(|&s| s + 1).max().unwrap_or(0);
    let mut out = vec![0; count];
    for (slot, value) in slots.iter().zip(values) {
        if let Some(k) = *slot {
            out[k] = value;
        }
    }
    out
}

/// What [`Families::specialize`] did with a source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The source compiles as it is, in canonical form (first of its
    /// family, a member equal to it, or generic sizes turned off).
    Static,
    /// A member of a generic family: runs its pipeline with its own values.
    Reused,
    /// A member that turned (more) literals of its family dynamic: a new
    /// generic pipeline.
    Widened,
}

/// The source to compile for a kernel and the values of its dynamic
/// literals (empty for a static source, which binds no `LZD`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Specialized {
    /// WGSL to compile.
    pub source: String,
    /// Values of `LZD`, in order.
    pub dims: Vec<u32>,
    /// What happened.
    pub outcome: Outcome,
    /// For a member of a generic family: where its literals are in the
    /// source as lowered, so that the same kernel at the next size can be
    /// read against it without a scan (see [`Families::specialize`]).
    pub member: Option<Arc<Member>>,
}

/// A generic family's member as lowered: its family and where its
/// replaceable literals are in its source (kept with the compiled
/// kernel). The same kernel lowered at
/// other sizes differs from it only in those literals' digits, and is
/// read against it instead of scanned (`Member::values_of`).
#[derive(Debug, PartialEq, Eq)]
pub struct Member {
    /// The family's key.
    family: u64,
    /// The entry point (part of the family's key).
    entry: Box<str>,
    /// Byte ranges of the replaceable literals in `source`, and whether
    /// each is signed.
    literals: Vec<RawLiteral>,
}

/// Where a replaceable literal is in a source as lowered, and whether it
/// is signed.
type RawLiteral = (Range<usize>, bool);

impl Member {
    /// The literal values of `source` if it is this member's source
    /// (`was`) with other digits in its literals: every byte outside them equal, each
    /// literal an integer literal of the same signedness, and the
    /// positions of the literals in `source`.
    ///
    /// Such a source scans to the same skeleton (so the same family) and
    /// to literals at the same places: what makes a literal replaceable
    /// (not inside `array<...>`, an attribute, a `const`, a `case`), the
    /// node names and the renumbering are all decided by the bytes
    /// around the literals, which are equal, and the digits of an integer
    /// literal contain none of the brackets, `;` or `:` that end the
    /// regions a scan skips. The token before a literal ends where it did
    /// (the bytes before are equal), and the literal's token ends at the
    /// same following byte, which ended a number before.
    fn values_of(&self, was: &str, source: &str) -> Option<(Vec<u32>, Vec<RawLiteral>)> {
        let (old, new) = (was.as_bytes(), source.as_bytes());
        let mut values = Vec::with_capacity(self.literals.len());
        let mut ranges = Vec::with_capacity(self.literals.len());
        let (mut o, mut n) = (0usize, 0usize);
        for (lit, signed) in &self.literals {
            let between = &old[o..lit.start];
            if new.get(n..n + between.len())? != between {
                return None;
            }
            n += between.len();
            let token = Lexer::new(&source[n..]).next()?;
            if token.kind != Kind::Number {
                return None;
            }
            let end = n + token.end;
            let (value, is_signed) = int_literal(&source[n..end])?;
            if is_signed != *signed {
                return None;
            }
            values.push(value);
            ranges.push((n..end, *signed));
            (o, n) = (lit.end, end);
        }
        (old[o..] == new[n..]).then_some((values, ranges))
    }
}

struct Family {
    skeleton: String,
    /// Literal values of the first member; positions without a slot are
    /// the same in every member.
    values: Vec<u32>,
    /// The `LZD` slot of each dynamic position. Dynamic positions that
    /// held equal values in every member so far share a slot (a size used
    /// in many places is one load the driver can keep in a register); a
    /// member where they differ splits the slot.
    slots: Vec<Option<usize>>,
    /// The generic source of the current slots, once a member needed it:
    /// the same for every member that fits them (the skeleton, the baked
    /// values and the loads are all the family's), so later members copy
    /// it instead of rewriting their own. Cleared when the family widens.
    generic: Option<String>,
}

impl Family {
    /// Whether `values` fit the current slots: baked positions equal and
    /// positions of one slot equal to each other.
    fn fits(&self, values: &[u32]) -> bool {
        let mut slot_value: Vec<Option<u32>> = Vec::new();
        for ((slot, old), &new) in self.slots.iter().zip(&self.values).zip(values) {
            match *slot {
                None if *old != new => return false,
                None => {}
                Some(k) => {
                    if slot_value.len() <= k {
                        slot_value.resize(k + 1, None);
                    }
                    match slot_value[k] {
                        Some(v) if v != new => return false,
                        Some(_) => {}
                        None => slot_value[k] = Some(new),
                    }
                }
            }
        }
        true
    }

    /// Re-slots after a member that did not fit: positions that changed
    /// turn dynamic; slots split by the member's values.
    fn widen(&mut self, values: &[u32]) {
        let mut ids: std::collections::HashMap<(usize, u32, u32), usize> = std::collections::HashMap::new();
        for ((slot, &old), &new) in self.slots.iter_mut().zip(&self.values).zip(values) {
            let key = match *slot {
                Some(k) => (k, 0, new),
                None if old != new => (usize::MAX, old, new),
                None => continue,
            };
            let next = ids.len();
            *slot = Some(*ids.entry(key).or_insert(next));
        }
    }
}

/// The families seen by one backend (bounded, least recently used out).
pub struct Families {
    enabled: bool,
    map: Mutex<lru::LruCache<u64, Family>>,
    /// How kernels compiled at their structure's first size variant, by
    /// the skeleton of their lowering with every size varying: `None`
    /// static (none of its sizes changed), else the sizes kept fixed.
    /// A kernel whose graph no longer aligns with the earlier one (the
    /// optimizer removed a node at some size) finds its forms here.
    forms: Mutex<lru::LruCache<u64, Option<FixedSizes>>>,
}

/// Whether generic sizes are on: `option` if given (code, else
/// `LAZULI_GENERIC_SIZES`, resolved by `WgpuOptions::resolve`), else on;
/// off, every size compiles its own kernels.
pub fn enabled(option: Option<bool>) -> bool {
    option.unwrap_or(true)
}

impl Families {
    /// An empty set of families holding up to `cap` of them.
    pub fn new(enabled: bool, cap: usize) -> Families {
        let cap = NonZeroUsize::new(cap.max(1)).expect("non-zero");
        Families { enabled, map: Mutex::new(lru::LruCache::new(cap)), forms: Mutex::new(lru::LruCache::new(cap)) }
    }

    /// Remembers that the kernel whose lowering with every size varying
    /// is `source` (entry point `entry`) compiled with `fixed` (`None`:
    /// static) when sizes first varied.
    pub fn remember_forms(&self, source: &str, entry: &str, fixed: Option<FixedSizes>) {
        let key = scan(source).family_key(entry);
        self.forms.lock().unwrap_or_else(|e| e.into_inner()).put(key, fixed);
    }

    /// What [`Families::remember_forms`] recorded for the kernel whose
    /// lowering with every size varying is `source`, if anything.
    pub fn forms(&self, source: &str, entry: &str) -> Option<Option<FixedSizes>> {
        let key = scan(source).family_key(entry);
        self.forms.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied()
    }

    /// Whether generic sizes are on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The family of the scanned source (family key `key`), created
    /// with it as first member when new; `None` on a hash collision (a
    /// family of another skeleton under the same key).
    fn family<'a>(map: &'a mut lru::LruCache<u64, Family>, scanned: &Scanned, key: u64) -> Option<&'a mut Family> {
        if !map.contains(&key) {
            let values = scanned.values();
            let slots = vec![None; values.len()];
            map.put(key, Family { skeleton: scanned.skeleton.clone(), values, slots, generic: None });
        }
        let family = map.get_mut(&key).expect("present");
        // A hash collision: leave the family alone.
        (family.skeleton == scanned.skeleton && family.values.len() == scanned.literals.len()).then_some(family)
    }

    /// Records `source` as a member of its family without compiling it:
    /// the same kernel lowered for other sizes (an earlier graph of the
    /// same structure), so that the next [`Families::specialize`] of the
    /// family turns every position that differs dynamic at once instead of
    /// compiling the new member as a static first one and widening later.
    pub fn observe(&self, source: &str, entry: &str) {
        let scanned = scan(source);
        if self.enabled && !scanned.literals.is_empty() {
            let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
            Self::admit(&mut map, &scanned, entry, scanned.family_key(entry));
        }
    }

    /// The source to compile for `source` (entry point `entry`) and its
    /// dynamic values; see the module documentation. Counted as
    /// `GenericKernelReuse` and `GenericKernelWidened`.
    ///
    /// `like`: the same kernel's member at the sizes compiled before, if
    /// it was one, and its source as lowered. Where `source` has the same
    /// entry point, differs from it only in literal digits and fits the
    /// family's slots, its values are read against it
    /// (`Member::values_of`) and the family's generic source is reused:
    /// no scan, the same result (debug builds check it against a scan;
    /// counted as `GenericKernelScanSkipped` too).
    pub fn specialize(&self, source: &str, entry: &str, like: Option<(&Member, &str)>) -> Specialized {
        let like = like.filter(|(m, _)| self.enabled && *m.entry == *entry);
        if let Some(fast) = like.and_then(|(m, was)| self.reuse_like(m, was, source)) {
            if cfg!(debug_assertions) {
                let scanned = self.specialize_scanned(source, entry, false);
                debug_assert_eq!((&scanned.source, &scanned.dims), (&fast.source, &fast.dims), "read against a member");
            }
            metrics::inc("GenericKernelReuse", 1);
            metrics::inc("GenericKernelScanSkipped", 1);
            return fast;
        }
        self.specialize_scanned(source, entry, true)
    }

    /// [`Families::specialize`] for a source read against `like` (whose
    /// source was `was`), where it
    /// is a member that fits its family's slots and the family's generic
    /// source is known; `None` otherwise.
    fn reuse_like(&self, like: &Member, was: &str, source: &str) -> Option<Specialized> {
        let (values, literals) = like.values_of(was, source)?;
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let family = map.get(&like.family)?;
        if family.values.len() != values.len() || family.slots.iter().all(Option::is_none) || !family.fits(&values) {
            return None;
        }
        let generic = family.generic.clone()?;
        let dims = slot_values(&family.slots, values);
        let member = Member { family: like.family, entry: like.entry.clone(), literals };
        Some(Specialized { source: generic, dims, outcome: Outcome::Reused, member: Some(Arc::new(member)) })
    }

    /// [`Families::specialize`] by a scan of `source`; `count`: record
    /// the outcome in the metrics.
    fn specialize_scanned(&self, source: &str, entry: &str, count: bool) -> Specialized {
        let scanned = scan(source);
        let fixed = || Specialized {
            source: scanned.canonical.clone(),
            dims: Vec::new(),
            outcome: Outcome::Static,
            member: None,
        };
        if !self.enabled || scanned.literals.is_empty() {
            return fixed();
        }
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let key = scanned.family_key(entry);
        let Some((family, widened)) = Self::admit(&mut map, &scanned, entry, key) else { return fixed() };
        if family.slots.iter().all(Option::is_none) {
            return fixed();
        }
        let source_generic = family.generic.get_or_insert_with(|| scanned.generic_source(&family.slots)).clone();
        let dims = scanned.slot_values(&family.slots);
        let outcome = if widened { Outcome::Widened } else { Outcome::Reused };
        if count {
            metrics::inc(if widened { "GenericKernelWidened" } else { "GenericKernelReuse" }, 1);
        }
        let member = Member {
            family: key,
            entry: entry.into(),
            literals: scanned.literals.iter().map(|l| (l.raw.clone(), l.signed)).collect(),
        };
        Specialized { source: source_generic, dims, outcome, member: Some(Arc::new(member)) }
    }

    /// Makes the scanned source (entry point `entry`, family key `key`) a
    /// member of its family (see [`Families::family`]), widening the family where its literals do
    /// not fit; the family and whether it widened.
    fn admit<'a>(
        map: &'a mut lru::LruCache<u64, Family>,
        scanned: &Scanned,
        entry: &str,
        key: u64,
    ) -> Option<(&'a mut Family, bool)> {
        let family = Self::family(map, scanned, key)?;
        let values = scanned.values();
        if family.fits(&values) {
            return Some((family, false));
        }
        if tracing::enabled!(tracing::Level::DEBUG) {
            for (k, lit) in scanned.literals.iter().enumerate() {
                if family.slots[k].is_none() && family.values[k] != lit.value {
                    let text = &scanned.canonical;
                    let context = wgsl_text::excerpt(text, lit.start..lit.end, 40, 10);
                    tracing::debug!(entry, was = family.values[k], now = lit.value, context, "generic kernel widens");
                }
            }
        }
        family.widen(&values);
        family.generic = None;
        Some((family, true))
    }

    /// Number of families held.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when no family is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "struct Params {\n    z: u32,\n}\n@group(0) @binding(0) var<uniform> P: Params;\nvar<workgroup> red: array<f32, 256u>;\nconst K = 4u;\n// 7u in a comment\n@compute @workgroup_size(256)\nfn main(@builtin(global_invocation_id) g: vec3<u32>) {\n    let t = g.x;\n    if (t >= 48u) { return; }\n    let x = f32(t % 12u) * 1.5e-3 + bitcast<f32>(1065353216u);\n    let y = (-3i) + i32(0x10u);\n    switch t { case 1u: {} default: {} }\n}\n";

    #[test]
    fn scan_finds_only_replaceable_literals() {
        let s = scan(A);
        let found: Vec<&str> = s.literals.iter().map(|l| &A[l.start..l.end]).collect();
        assert_eq!(found, ["48u", "12u", "1065353216u", "3i", "0x10u"]);
        assert_eq!(s.values(), [48, 12, 1065353216, 3, 16]);
        assert!(s.skeleton.contains("array<f32, 256u>") && s.skeleton.contains("const K = 4u;"));
        assert!(s.skeleton.contains("case 1u:") && s.skeleton.contains("// 7u in a comment"));
    }

    #[test]
    fn members_share_a_generic_source_after_one_widening() {
        let fam = Families::new(true, 16);
        let first = fam.specialize(A, "main", None);
        assert_eq!((first.outcome, first.source.as_str()), (Outcome::Static, A));
        // The same source again stays static.
        assert_eq!(fam.specialize(A, "main", None).outcome, Outcome::Static);
        let b = A.replace("48u", "52u").replace("12u", "13u");
        let second = fam.specialize(&b, "main", None);
        assert_eq!(second.outcome, Outcome::Widened);
        assert_eq!(second.dims, [52, 13]);
        assert!(second.source.contains("if (t >= LZD[0u])") && second.source.contains("(t % LZD[1u])"));
        let c = A.replace("48u", "60u").replace("12u", "15u");
        let third = fam.specialize(&c, "main", None);
        assert_eq!(third.outcome, Outcome::Reused);
        assert_eq!(third.source, second.source);
        assert_eq!(third.dims, [60, 15]);
        // The first member, seen again, now runs generic too.
        assert_eq!(fam.specialize(A, "main", None).dims, [48, 12]);
        // A baked literal that differs widens again.
        let d = c.replace("(-3i)", "(-4i)");
        let fourth = fam.specialize(&d, "main", None);
        assert_eq!((fourth.outcome, fourth.dims.as_slice()), (Outcome::Widened, &[60, 15, 4][..]));
        assert!(fourth.source.contains("(-bitcast<i32>(LZD[2u]))"));
        crate::validate::validate_wgsl(&fourth.source).unwrap();
    }

    #[test]
    fn different_structure_is_another_family_and_off_means_static() {
        let fam = Families::new(true, 16);
        fam.specialize(A, "main", None);
        let other = A.replace("t % 12u", "t / 12u % 5u");
        assert_eq!(fam.specialize(&other, "main", None).outcome, Outcome::Static);
        assert_eq!(fam.len(), 2);
        let off = Families::new(false, 16);
        off.specialize(A, "main", None);
        let b = A.replace("48u", "52u");
        assert_eq!(
            off.specialize(&b, "main", None),
            Specialized { source: b.clone(), dims: vec![], outcome: Outcome::Static, member: None }
        );
    }

    #[test]
    fn equal_sizes_share_a_slot_until_they_differ() {
        let src = "fn f(i: u32) -> u32 {\n    return (i / 12u) % 12u + 7u;\n}\n";
        let fam = Families::new(true, 16);
        fam.specialize(src, "f", None);
        let b = fam.specialize(&src.replace("12u", "13u"), "f", None);
        assert_eq!(b.outcome, Outcome::Widened);
        assert!(b.source.contains("(i / LZD[0u]) % LZD[0u] + 7u"), "{}", b.source);
        assert_eq!(b.dims, [13]);
        let c = fam.specialize(&src.replace("12u", "20u"), "f", None);
        assert_eq!((c.outcome, c.dims.as_slice()), (Outcome::Reused, &[20][..]));
        // The two sizes part ways: the slot splits.
        let d = fam.specialize(&src.replacen("12u", "4u", 1).replace("12u", "6u"), "f", None);
        assert_eq!(d.outcome, Outcome::Widened);
        assert!(d.source.contains("(i / LZD[0u]) % LZD[1u] + 7u"), "{}", d.source);
        assert_eq!(d.dims, [4, 6]);
    }

    #[test]
    fn node_names_are_renumbered_so_renumbered_kernels_share_a_source() {
        let a = "fn n7(i: u32) -> f32 {\n    return in0[i];\n}\n\nfn e12(i: u32, mm: f32) -> f32 {\n    let x3 = n7(i);\n    return x3 + mm * f32(i % 12u);\n}\n\nfn main() {\n    let v = e12(0u, 1.0) + n7(1u) + exp2(1.0);\n}\n";
        let b = a.replace("n7", "n6").replace("e12", "e11").replace("x3", "x2");
        let (sa, sb) = (scan(a), scan(&b));
        assert_eq!(sa.canonical, sb.canonical);
        assert!(sa.canonical.contains("fn n0(i: u32)") && sa.canonical.contains("fn e0(i: u32, mm: f32)"));
        assert!(sa.canonical.contains("let x0 = n0(i);") && sa.canonical.contains("exp2(1.0)"));
        assert_eq!(sa.family_key("main"), sb.family_key("main"));
        crate::validate::validate_wgsl(&sa.canonical.replace("in0[i]", "f32(i)")).unwrap();
        // A renumbered member at other sizes reuses the generic source.
        let fam = Families::new(true, 16);
        let first = fam.specialize(a, "main", None);
        assert_eq!((first.outcome, first.source.as_str()), (Outcome::Static, sa.canonical.as_str()));
        let wide = fam.specialize(&a.replace("12u", "13u"), "main", None);
        assert_eq!(wide.outcome, Outcome::Widened);
        let again = fam.specialize(&b.replace("12u", "14u"), "main", None);
        assert_eq!((again.outcome, again.dims.as_slice()), (Outcome::Reused, &[14][..]));
        assert_eq!(again.source, wide.source);
    }

    #[test]
    fn an_observed_earlier_size_makes_the_first_variant_generic_in_every_differing_literal() {
        let src = "fn f(i: u32) -> u32 {\n    return (i / 12u) % 3u + 7u;\n}\n";
        let fam = Families::new(true, 16);
        fam.observe(src, "f");
        // Observing compiles nothing and counts nothing as a member.
        let b = fam.specialize(&src.replace("12u", "13u"), "f", None);
        assert_eq!((b.outcome, b.dims.as_slice()), (Outcome::Widened, &[13][..]));
        assert!(b.source.contains("(i / LZD[0u]) % 3u + 7u"), "{}", b.source);
        // Without the observation the same source is a static first member.
        let fresh = Families::new(true, 16);
        assert_eq!(fresh.specialize(&src.replace("12u", "13u"), "f", None).outcome, Outcome::Static);
        // Observing a source that fits changes nothing; off observes nothing.
        fam.observe(&src.replace("12u", "20u"), "f");
        assert_eq!(fam.specialize(&src.replace("12u", "21u"), "f", None).source, b.source);
        let off = Families::new(false, 16);
        off.observe(src, "f");
        assert!(off.is_empty());
    }

    #[test]
    fn a_member_at_other_sizes_is_read_against_the_earlier_one_without_a_scan() {
        let fam = Families::new(true, 16);
        let at = |n: u32, m: u32| A.replace("48u", &format!("{n}u")).replace("12u", &format!("{m}u"));
        fam.specialize(&at(48, 12), "main", None);
        let wide = fam.specialize(&at(52, 13), "main", None);
        assert_eq!(wide.outcome, Outcome::Widened);
        let first = fam.specialize(&at(60, 15), "main", None);
        assert_eq!(first.outcome, Outcome::Reused);
        let member = first.member.expect("a generic member");
        let was = at(60, 15);
        // Digits of other lengths: read against the member, the same
        // result as a scan, and a member for the next size.
        let later = at(1000, 7);
        let read = fam.reuse_like(&member, &was, &later).expect("same text between the literals");
        let scanned = fam.specialize_scanned(&later, "main", false);
        assert_eq!((&read.source, &read.dims, read.outcome), (&scanned.source, &scanned.dims, scanned.outcome));
        assert_eq!(read.dims, [1000, 7]);
        let next = read.member.expect("a member");
        assert_eq!(fam.reuse_like(&next, &later, &at(9, 1234)).map(|s| s.dims), Some(vec![9, 1234]));
        // Not read against it: other text between the literals, a literal
        // of the other signedness or no integer, a baked literal that
        // differs (the family must widen, which needs a scan), a renamed
        // node.
        for other in [
            later.replace("t % ", "t / "),
            later.replace("1000u", "1000i"),
            later.replace("1000u", "1000.0"),
            later.replace("(-3i)", "(-4i)"),
            later.replace("let t", "let n9 = 0u;\n    let t"),
            format!("{later}\n"),
        ] {
            assert!(fam.reuse_like(&next, &later, &other).is_none(), "{other}");
        }
        // Through `specialize`, which falls back to a scan where the
        // member does not apply: another entry point is another family.
        let elsewhere = fam.specialize(&at(9, 1234), "other", Some((&next, &later)));
        assert_eq!((elsewhere.outcome, elsewhere.member), (Outcome::Static, None));
        let widened = fam.specialize(&later.replace("(-3i)", "(-4i)"), "main", Some((&next, &later)));
        assert_eq!(widened.outcome, Outcome::Widened);
        let wider = widened.member.expect("a member");
        let was = later.replace("(-3i)", "(-4i)");
        assert_eq!(fam.specialize(&at(5, 6), "main", Some((&wider, &was))).dims, [5, 6, 3]);
    }

    #[test]
    fn floats_and_abstract_integers_are_not_literals() {
        let s =
            scan("fn f() -> f32 { let a = 1.0; let b = 2e5; let c = 3; let d = 1e-5; let e = 0x1p4; return 7.5f; }");
        assert!(s.literals.is_empty(), "{:?}", s.literals);
    }

    /// A growing sequence through a linear layer, beside an update of
    /// the weights that does not depend on it.
    fn linear(t: usize) -> Graph {
        use lazuli_ir::{BinaryOp, DType, ValueType};
        let mut g = Graph::new();
        let x = g.param(ValueType::new([t, 64], DType::F32));
        let w = g.param(ValueType::new([64, 192], DType::F32));
        let b = g.param(ValueType::new([192], DType::F32));
        let m = g.push(Op::MatMul, &[x, w]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Add), &[m, b]).unwrap();
        let s = g.push(Op::Softmax { axis: 0, log: false }, &[y]).unwrap();
        let w2 = g.push(Op::Binary(BinaryOp::Mul), &[w, w]).unwrap();
        g.outputs.extend([s, w2]);
        g
    }

    #[test]
    fn size_changes_keep_the_sizes_that_stay() {
        use lazuli_ir::fusion::{self, FusionLimits};
        let (now, earlier) = (linear(13), linear(12));
        let changes = SizeChanges::between(&now, &earlier).expect("one structure");
        let v = now.clone().verify().unwrap();
        let fl = FusionLimits { matmul_epilogue: true, ..FusionLimits::default() };
        let kernels = fusion::plan(&v, &fl).kernels;
        let of = |what: &str| {
            let k = kernels
                .iter()
                .find(|k| match what {
                    "MatMul" => k.matmul_node(&v).is_some(),
                    op => v.node(k.root()).op.name() == op,
                })
                .expect(what);
            changes.kernel(k, &now)
        };
        // The product's rows grow; its columns and depth stay.
        assert_eq!(of("MatMul"), Some(FixedSizes { m: false, n: true, k: true, row: true }));
        // Softmax along the growing axis: its last axis stays.
        assert_eq!(of("softmax"), Some(FixedSizes { row: true, ..FixedSizes::NONE }));
        // The weight update sees no size change: a static kernel.
        assert_eq!(of("mul"), None);
        // Graphs that do not align node for node give no changes.
        let mut other = linear(12);
        other.outputs.pop();
        let extra = other.push(Op::Binary(lazuli_ir::BinaryOp::Add), &[NodeId(1), NodeId(1)]).unwrap();
        other.outputs.push(extra);
        assert!(SizeChanges::between(&now, &other).is_none());
    }

    #[test]
    fn forms_are_remembered_by_skeleton() {
        let src = "fn f(i: u32) -> u32 {\n    return (i / 12u) % 3u;\n}\n";
        let fam = Families::new(true, 16);
        assert_eq!(fam.forms(src, "f"), None);
        let fixed = FixedSizes { n: true, ..FixedSizes::NONE };
        fam.remember_forms(src, "f", Some(fixed));
        // Another size of the same kernel finds them; another kernel not.
        assert_eq!(fam.forms(&src.replace("12u", "40u"), "f"), Some(Some(fixed)));
        assert_eq!(fam.forms(&src.replace("% 3u", "+ 3u"), "f"), None);
        fam.remember_forms(src, "f", None);
        assert_eq!(fam.forms(src, "f"), Some(None));
    }
}
