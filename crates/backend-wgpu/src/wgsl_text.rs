//! The one tokenizer of generated WGSL: what the rewrites applied after
//! lowering know about WGSL's text.
//!
//! Three passes edit a kernel's source after codegen wrote it: windows
//! ([`crate::window`]: storage declarations become one per window, array
//! accesses calls of window helpers), size families ([`crate::generic`]:
//! node-derived names renumbered, integer literals read from a sizes
//! buffer) and fault injection in tests ([`crate::fault`]: a wrong store
//! appended to the entry point). They share this module's [`Lexer`]
//! (comments, identifiers, numbers, whitespace, any other character
//! alone), its bracket matching ([`group_end`], [`statement_end`]) and
//! its parser of storage declarations ([`StorageDecl`]), so the lexical
//! rules are written once: a comment hides what it contains from every
//! pass, a number such as `1e-5` or `0x1fu` is one token in every pass,
//! and a declaration has one syntax.
//!
//! The input is always codegen's own output, never user text: the lexer
//! knows the subset of WGSL codegen writes (ASCII code, `//` comments
//! only); anything else is lexed character by character and copied
//! unchanged.
//!
//! Rejected alternative: emitting the windowed and fault-injected forms
//! from codegen directly (every array access through an accessor that
//! knows its windows) would remove the rewrites, but every kernel family
//! writes its accesses with its own format strings, so each family would
//! carry the window logic. The rewrite keeps codegen unaware of windows;
//! the size-family widening compares two generated sources, which is a
//! text operation whatever codegen does.

use std::fmt::Write as _;
use std::ops::Range;

/// What a [`Token`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A line comment, `//` up to (not including) the end of its line.
    Comment,
    /// An identifier or keyword: a letter or `_`, then letters, digits
    /// and `_`.
    Ident,
    /// A number: a digit, then letters, digits, `.` and the sign of a
    /// decimal exponent (`12u`, `0x1fu`, `1.5e-3`, `2.0f`).
    Number,
    /// A run of whitespace.
    Space,
    /// Any other character (punctuation, an operator's bytes one at a
    /// time).
    Punct,
}

/// One token: its kind and byte range in the lexed text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Token {
    /// What it is.
    pub kind: Kind,
    /// First byte.
    pub start: usize,
    /// One past the last byte.
    pub end: usize,
}

/// The tokens of a text, in order; [`Lexer::seek`] skips ahead (past a
/// group a pass does not look into).
pub(crate) struct Lexer<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Lexer<'a> {
    /// A lexer at the start of `text`.
    pub fn new(text: &'a str) -> Lexer<'a> {
        Lexer { text, pos: 0 }
    }

    /// Skips spaces and punctuation other than `@` and `/` (which may
    /// start an attribute or a comment): the next token, if any, is then an
    /// identifier, a number, an attribute or a comment, or that `/` alone.
    /// For scans that look only at those; a byte-wise loop, far cheaper
    /// than a token per space and bracket.
    pub fn skip_plain(&mut self) {
        let b = self.text.as_bytes();
        while self.pos < b.len() && !matches!(b[self.pos], b'@' | b'/') && !is_ident(b[self.pos]) {
            self.pos += 1;
        }
        // Only ASCII bytes stop the loop, so `pos` is a character boundary.
    }

    /// Continues from byte `pos` (at most the text's length), which must
    /// start a token: the end of a token or of a group.
    pub fn seek(&mut self, pos: usize) {
        debug_assert!(pos >= self.pos, "the lexer only moves forward");
        debug_assert!(self.text.is_char_boundary(pos.min(self.text.len())), "seek to {pos}: inside a character");
        self.pos = pos.min(self.text.len());
    }
}

impl Iterator for Lexer<'_> {
    type Item = Token;

    fn next(&mut self) -> Option<Token> {
        let b = self.text.as_bytes();
        let start = self.pos;
        let &c = b.get(start)?;
        let end_while =
            |from: usize, keep: &dyn Fn(usize) -> bool| (from..b.len()).find(|&k| !keep(k)).unwrap_or(b.len());
        let (kind, end) = if c == b'/' && b.get(start + 1) == Some(&b'/') {
            (Kind::Comment, end_while(start, &|k| b[k] != b'\n'))
        } else if c.is_ascii_alphabetic() || c == b'_' {
            (Kind::Ident, end_while(start, &|k| is_ident(b[k])))
        } else if c.is_ascii_digit() {
            let hex = c == b'0' && b.get(start + 1).is_some_and(|&x| x == b'x' || x == b'X');
            let exponent_sign = |k: usize| !hex && matches!(b[k], b'+' | b'-') && matches!(b[k - 1], b'e' | b'E');
            (Kind::Number, end_while(start, &|k| is_ident(b[k]) || b[k] == b'.' || exponent_sign(k)))
        } else if c.is_ascii_whitespace() {
            (Kind::Space, end_while(start, &|k| b[k].is_ascii_whitespace()))
        } else {
            // One character: a byte of ASCII, all bytes of any other.
            (Kind::Punct, (start + 1..=b.len()).find(|&k| self.text.is_char_boundary(k)).unwrap_or(b.len()))
        };
        self.pos = end;
        Some(Token { kind, start, end })
    }
}

/// Whether `b` may continue an identifier.
pub(crate) fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// One past the bracket closing the one opening at `open`: for `(` and
/// `[` the two kinds nest together (`a[f(i)]`), for `<` only angle
/// brackets count (`array<vec4<f32>, 4u>`). `None` when it never closes.
pub(crate) fn group_end(b: &[u8], open: usize) -> Option<usize> {
    debug_assert!(matches!(b[open], b'(' | b'[' | b'<'), "a group opens with a bracket");
    let angle = b[open] == b'<';
    let mut depth = 0usize;
    for (k, &c) in b.iter().enumerate().skip(open) {
        let (opens, closes) =
            if angle { (c == b'<', c == b'>') } else { (matches!(c, b'[' | b'('), matches!(c, b']' | b')')) };
        if opens {
            depth += 1;
        } else if closes {
            depth -= 1;
            if depth == 0 {
                return Some(k + 1);
            }
        }
    }
    None
}

/// One past the first `stop` byte at or after `from`; the text's end
/// without one.
pub(crate) fn through(b: &[u8], from: usize, stop: u8) -> usize {
    b[from..].iter().position(|&c| c == stop).map_or(b.len(), |p| from + p + 1)
}

/// Index of the `;` ending the statement whose remaining text starts at
/// `from`, outside brackets; `None` without one.
pub(crate) fn statement_end(b: &[u8], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &c) in b.iter().enumerate().skip(from) {
        match c {
            b'[' | b'(' => depth += 1,
            b']' | b')' => depth -= 1,
            b';' if depth == 0 => return Some(k),
            _ => {}
        }
    }
    None
}

/// Where `b[at..]`, after spaces, is an assignment `=` (not `==`): the
/// index of the `=`.
pub(crate) fn assignment_at(b: &[u8], mut at: usize) -> Option<usize> {
    while at < b.len() && b[at] == b' ' {
        at += 1;
    }
    (b.get(at) == Some(&b'=') && b.get(at + 1) != Some(&b'=')).then_some(at)
}

/// Whether `b[at..]`, after spaces, starts a compound assignment or an
/// increment (`+=`, `<<=`, `++`, ...).
pub(crate) fn compound_assignment_at(b: &[u8], mut at: usize) -> bool {
    while at < b.len() && b[at] == b' ' {
        at += 1;
    }
    let rest = &b[at..];
    [&b"+="[..], b"-=", b"*=", b"/=", b"%=", b"&=", b"|=", b"^=", b"<<=", b">>=", b"++", b"--"]
        .iter()
        .any(|p| rest.starts_with(p))
}

/// The text around `range` of `text` (up to `before` bytes before it and
/// `after` after it, widened to whole characters), for messages.
pub(crate) fn excerpt(text: &str, range: Range<usize>, before: usize, after: usize) -> &str {
    let mut start = range.start.saturating_sub(before);
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = range.end.saturating_add(after).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    &text[start..end]
}

/// Rewrites every access of the bindings `is_target` names in `text` (code
/// between declarations; comments are copied as they are): a store
/// `NAME[i] = v;` becomes `st_NAME(i', v')` and a load `NAME[i]` becomes
/// `ld_NAME(i')`, where `i'` and `v'` are rewritten the same way. Any other
/// use of such a binding (bare, or a load followed by an assignment, as in
/// `NAME[i].x = v` or `NAME[i] += v`) is `access(name, context)`'s error,
/// `context` being the source around the use. The window and half-precision
/// rewrites share this contract.
pub(crate) fn rewrite_indexed<E>(
    text: &str,
    is_target: &dyn Fn(&str) -> bool,
    access: &dyn Fn(&str, &str) -> E,
) -> Result<String, E> {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut lexer = Lexer::new(text);
    while let Some(tok) = lexer.next() {
        let (i, j) = (tok.start, tok.end);
        let name = &text[i..j];
        if tok.kind != Kind::Ident || !is_target(name) {
            continue;
        }
        let err = || access(name, excerpt(text, i..j, 40, 40));
        if b.get(j) != Some(&b'[') {
            return Err(err());
        }
        let close = group_end(b, j).ok_or_else(err)?;
        let index = rewrite_indexed(&text[j + 1..close - 1], is_target, access)?;
        out.push_str(&text[copied..i]);
        let resume = if let Some(eq) = assignment_at(b, close) {
            // A store: `NAME[index] = value;`.
            let semi = statement_end(b, eq + 1).ok_or_else(err)?;
            let value = rewrite_indexed(text[eq + 1..semi].trim(), is_target, access)?;
            let _ = write!(out, "st_{name}({index}, {value})");
            semi
        } else {
            // A load; what follows must not make it an assignment target.
            let mut k = close;
            while k < b.len() && (b[k] == b'.' || b[k] == b'[' || is_ident(b[k])) {
                k = if b[k] == b'[' { group_end(b, k).ok_or_else(err)? } else { k + 1 };
            }
            if assignment_at(b, k).is_some() || compound_assignment_at(b, k) {
                return Err(err());
            }
            let _ = write!(out, "ld_{name}({index})");
            close
        };
        lexer.seek(resume);
        copied = resume;
    }
    out.push_str(&text[copied..]);
    Ok(out)
}

/// The prefix of every storage declaration codegen writes.
const STORAGE_PREFIX: &str = "@group(0) @binding(";

/// A storage declaration as codegen writes it, one per line:
/// `@group(0) @binding(N) var<storage, ACCESS> NAME: TYPE;`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StorageDecl {
    /// Byte range of its line in the source, newline included.
    pub line: Range<usize>,
    /// `N`.
    pub binding: u32,
    /// `read` or `read_write`.
    pub access: String,
    /// The variable.
    pub name: String,
    /// The declared type.
    pub ty: String,
}

impl StorageDecl {
    /// The element type of an `array<T>` binding; `None` for any other
    /// type (the error slot's struct).
    pub fn elem(&self) -> Option<&str> {
        self.ty.strip_prefix("array<")?.strip_suffix('>')
    }

    /// The declaration's line, renumbered to `binding` and renamed to
    /// `name`, newline included.
    pub fn render(&self, binding: u32, name: &str) -> String {
        format!("{STORAGE_PREFIX}{binding}) var<storage, {}> {name}: {};\n", self.access, self.ty)
    }
}

/// The group-0 storage declarations of `source`, in source order: each a
/// parsed [`StorageDecl`], or `Err` with the byte range of a line that
/// looks like one (it starts a group-0 binding and declares storage) but
/// is not written as codegen writes them.
pub(crate) fn storage_decls(source: &str) -> Vec<Result<StorageDecl, Range<usize>>> {
    let mut out = Vec::new();
    let mut at = 0;
    for line in source.split_inclusive('\n') {
        let range = at..at + line.len();
        at += line.len();
        if line.starts_with(STORAGE_PREFIX) && line.contains("var<storage") {
            out.push(parse_decl(line.trim_end(), range.clone()).ok_or(range));
        }
    }
    out
}

/// Parses one declaration line (without its newline).
fn parse_decl(line: &str, range: Range<usize>) -> Option<StorageDecl> {
    let rest = line.strip_prefix(STORAGE_PREFIX)?;
    let (n, rest) = rest.split_once(") var<storage, ")?;
    let (access, rest) = rest.split_once("> ")?;
    let (name, ty) = rest.split_once(": ")?;
    let ty = ty.strip_suffix(';')?;
    Some(StorageDecl {
        line: range,
        binding: n.parse().ok()?,
        access: access.to_string(),
        name: name.to_string(),
        ty: ty.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(text: &str) -> Vec<(Kind, &str)> {
        Lexer::new(text).map(|t| (t.kind, &text[t.start..t.end])).collect()
    }

    #[test]
    fn the_lexer_splits_comments_names_and_numbers() {
        use Kind::*;
        assert_eq!(
            tokens("let x1 = in0[t]*1.5e-3 + 0x1fu; // in0[t]\n_a-2i"),
            [
                (Ident, "let"),
                (Space, " "),
                (Ident, "x1"),
                (Space, " "),
                (Punct, "="),
                (Space, " "),
                (Ident, "in0"),
                (Punct, "["),
                (Ident, "t"),
                (Punct, "]"),
                (Punct, "*"),
                (Number, "1.5e-3"),
                (Space, " "),
                (Punct, "+"),
                (Space, " "),
                (Number, "0x1fu"),
                (Punct, ";"),
                (Space, " "),
                (Comment, "// in0[t]"),
                (Space, "\n"),
                (Ident, "_a"),
                (Punct, "-"),
                (Number, "2i"),
            ]
        );
        // A hex number's `e` is a digit, not an exponent.
        assert_eq!(tokens("0x1e-5"), [(Number, "0x1e"), (Punct, "-"), (Number, "5")]);
        // Characters beyond ASCII are whole tokens, so every token is a
        // slice of the text.
        assert_eq!(tokens("a→b"), [(Ident, "a"), (Punct, "→"), (Ident, "b")]);
        let mut lx = Lexer::new("array<vec4<f32>, 4u> x");
        assert_eq!(lx.next().map(|t| t.end), Some(5));
        lx.seek(group_end(b"array<vec4<f32>, 4u> x", 5).unwrap());
        assert_eq!(lx.map(|t| t.kind).collect::<Vec<_>>(), [Space, Ident]);
    }

    #[test]
    fn tokens_tile_the_text() {
        let texts =
            ["", "//", "fn f() {\n    // é and 0x1p4\n    return 1.5e+3f * x[2u] - -4i;\n}", "a→1e- @ \t\r\n0Xffu_z"];
        for text in texts {
            let mut at = 0;
            for t in Lexer::new(text) {
                assert!(t.start == at && t.end > t.start, "{text:?}: {t:?} after {at}");
                at = t.end;
            }
            assert_eq!(at, text.len(), "{text:?}");
        }
    }

    #[test]
    fn groups_statements_and_assignments() {
        let b = b"a[f(i)] = g(b[1], 2); c[(i]";
        assert_eq!(group_end(b, 1), Some(7));
        assert_eq!(group_end(b, 23), None);
        assert_eq!(statement_end(b, 9), Some(20));
        assert_eq!(assignment_at(b, 7), Some(8));
        assert_eq!(assignment_at(b"x == 1", 1), None);
        assert!(compound_assignment_at(b"x  <<= 1", 1) && !compound_assignment_at(b"x <= 1", 1));
        assert_eq!(through(b, 0, b';'), 21);
        assert_eq!(through(b, 21, b';'), b.len());
        assert_eq!(excerpt("abcdef", 2..3, 1, 2), "bcde");
        assert_eq!(excerpt("abcdef", 0..6, 10, 10), "abcdef");
        assert_eq!(excerpt("→x→", 3..4, 1, 1), "→x→", "whole characters");
    }

    #[test]
    fn storage_declarations_parse_as_codegen_writes_them() {
        let src = "@group(0) @binding(0) var<uniform> P: Params;\n@group(0) @binding(1) var<storage, read> in0: array<vec4<f32>>;\n@group(0) @binding(2) var<storage, read_write> LZE: LzErr;\n@group(0) @binding(3) var<storage,read> x: array<f32>;\n";
        let decls = storage_decls(src);
        assert_eq!(decls.len(), 3);
        let d = decls[0].clone().unwrap();
        assert_eq!((d.binding, d.access.as_str(), d.name.as_str(), d.elem()), (1, "read", "in0", Some("vec4<f32>")));
        assert_eq!(&src[d.line.clone()], d.render(1, "in0"));
        assert_eq!(d.render(4, "in0_w2"), "@group(0) @binding(4) var<storage, read> in0_w2: array<vec4<f32>>;\n");
        let e = decls[1].clone().unwrap();
        assert_eq!((e.name.as_str(), e.elem()), ("LZE", None));
        assert!(decls[2].is_err(), "not written as codegen writes declarations");
    }
}
