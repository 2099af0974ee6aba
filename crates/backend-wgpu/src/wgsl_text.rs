//! The one tokenizer of generated WGSL: what the passes that edit a
//! kernel's text after lowering know about WGSL's text.
//!
//! Two passes edit generated text: size families ([`crate::generic`]:
//! node-derived names renumbered, integer literals read from a sizes
//! buffer; inherently a comparison of two generated sources) and fault
//! injection in tests ([`crate::fault`]: a wrong store appended to the
//! entry point). They share this module's [`Lexer`] (comments,
//! identifiers, numbers, whitespace, any other character alone), its
//! bracket matching ([`group_end`]) and its parser of storage
//! declarations ([`StorageDecl`]), so the lexical rules are written once:
//! a comment hides what it contains from every pass, a number such as
//! `1e-5` or `0x1fu` is one token in every pass, and a declaration has one
//! syntax.
//!
//! The input is always codegen's own output, never user text: the lexer
//! knows the subset of WGSL codegen writes (ASCII code, `//` comments
//! only); anything else is lexed character by character and copied
//! unchanged.
//!
//! Windows and f16/bf16 storage are no text pass: lowering writes their
//! accesses through the buffer-access layer (`codegen::access`), which
//! replaced the rewrites that turned `NAME[i]` into helper calls after the
//! fact.

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
    fn groups_and_statements() {
        let b = b"a[f(i)] = g(b[1], 2); c[(i]";
        assert_eq!(group_end(b, 1), Some(7));
        assert_eq!(group_end(b, 23), None);
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
        assert_eq!(&src[d.line.clone()], "@group(0) @binding(1) var<storage, read> in0: array<vec4<f32>>;\n");
        let e = decls[1].clone().unwrap();
        assert_eq!((e.name.as_str(), e.elem()), ("LZE", None));
        assert!(decls[2].is_err(), "not written as codegen writes declarations");
    }
}
