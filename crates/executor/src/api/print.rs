//! Readable tensor printing in PyTorch's style: `Display` and `Debug` of a
//! [`Tensor`] read its value through the normal barrier (a pending tensor
//! is computed, then printed) and write
//! `tensor([[1.0000, 2.0000], ..], shape=[2, 2], dtype=f32, device=cpu)`
//! (with `, requires_grad=True` at the end for a tensor that does).
//!
//! Floats print as PyTorch prints them: integral values as `1.`, others
//! with `precision` decimals (4 by default; `{:.2}` sets it), in
//! scientific notation (`1.0000e-05`) when the finite non-zero magnitudes
//! span more than 1000x or leave `[1e-4, 1e8]`; every element of one
//! tensor has the same width. A tensor of more than `threshold` elements
//! (1000) is summarized: each dim longer than `2 * edge_items` shows its
//! first and last 3 and `...` between; only those elements are read from
//! the device (the summary is sliced lazily before the barrier), so
//! printing a large tensor moves little data. `{:#}` prints every element.
//! Rows wrap at `line_width` columns (80). A tensor whose computation
//! failed prints `tensor(<error: ..>, ..)` with the error: printing never
//! panics. Debug prints the same text, as PyTorch's `repr` does; the
//! metadata alone is in [`Tensor::shape`], [`Tensor::dtype`] and
//! [`Tensor::state`] without a barrier.

use crate::{no_grad, Result, Tensor};
use lazuli_ir::ScalarValue;
use std::fmt;

/// How [`Tensor::format`] prints: PyTorch's `set_printoptions` fields and
/// defaults, per call rather than process-wide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrintOptions {
    /// Digits after the decimal point of floats (PyTorch: 4).
    pub precision: usize,
    /// Summarize tensors of more elements than this (PyTorch: 1000).
    pub threshold: usize,
    /// Elements shown at each end of a summarized dim (PyTorch: 3).
    pub edge_items: usize,
    /// Columns before a row wraps (PyTorch: 80).
    pub line_width: usize,
    /// Force scientific notation on (`Some(true)`) or off; `None` decides
    /// from the values as PyTorch does.
    pub sci_mode: Option<bool>,
}

impl Default for PrintOptions {
    fn default() -> Self {
        PrintOptions { precision: 4, threshold: 1000, edge_items: 3, line_width: 80, sci_mode: None }
    }
}

impl Tensor {
    /// The tensor as PyTorch prints it, with `options` (see the module
    /// documentation); reads the value (a barrier), and prints a failed
    /// computation's error in place of the values.
    #[track_caller]
    pub fn format(&self, options: &PrintOptions) -> String {
        let body = match self.print_body(options) {
            Ok(b) => b,
            Err(e) => format!("<error: {e}>"),
        };
        let grad = if self.requires_grad() { ", requires_grad=True" } else { "" };
        format!("tensor({body}, shape={}, dtype={}, device={}{grad})", self.shape(), self.dtype(), self.device().name())
    }

    #[track_caller]
    fn print_body(&self, o: &PrintOptions) -> Result<String> {
        if self.numel() == 0 {
            return Ok("[]".into());
        }
        let edge = o.edge_items.max(1);
        let summarize = self.numel() > o.threshold;
        let cut: Vec<bool> = self.dims().iter().map(|&d| summarize && d > 2 * edge).collect();
        // Only the shown elements are read: each cut dim keeps its ends.
        let shown = no_grad(|| -> Result<Tensor> {
            let mut t = self.detach();
            for (d, &c) in cut.iter().enumerate() {
                if c {
                    let size = self.dims()[d];
                    let head = t.narrow(d as isize, 0, edge)?;
                    let tail = t.narrow(d as isize, size - edge, edge)?;
                    t = Tensor::concat(&[&head, &tail], d as isize)?;
                }
            }
            Ok(t)
        })?;
        let values = shown.to_scalars()?;
        let texts = element_texts(&values, o);
        let width = texts.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut out = String::new();
        if shown.rank() == 0 {
            out.push_str(&texts[0]);
        } else {
            let layout = Layout { texts: &texts, width, edge, line_width: o.line_width };
            layout.block(&mut out, shown.dims(), &cut, 0, "tensor(".len());
        }
        Ok(out)
    }
}

impl fmt::Display for Tensor {
    /// PyTorch's text of the value (see [`PrintOptions`]): `{:.N}` sets the
    /// precision, `{:#}` turns summarization off.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut o = PrintOptions::default();
        if let Some(p) = f.precision() {
            o.precision = p;
        }
        if f.alternate() {
            o.threshold = usize::MAX;
        }
        f.write_str(&self.format(&o))
    }
}

impl fmt::Debug for Tensor {
    /// The same text as `Display` (PyTorch's `repr` is its `str`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The elements' texts, before padding.
fn element_texts(values: &[ScalarValue], o: &PrintOptions) -> Vec<String> {
    let floats: Vec<f64> =
        values.iter().filter_map(|v| if let ScalarValue::Float(x) = v { Some(*x) } else { None }).collect();
    let finite: Vec<f64> = floats.iter().copied().filter(|x| x.is_finite()).collect();
    let integral = finite.iter().all(|x| x.fract() == 0.0);
    let mags: Vec<f64> = finite.iter().map(|x| x.abs()).filter(|&x| x > 0.0).collect();
    let (lo, hi) = mags.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &m| (lo.min(m), hi.max(m)));
    let sci = o.sci_mode.unwrap_or(if mags.is_empty() {
        false
    } else if integral {
        hi > 1e8
    } else {
        hi / lo > 1000.0 || hi > 1e8 || lo < 1e-4
    });
    values
        .iter()
        .map(|v| match *v {
            ScalarValue::Float(x) if x.is_nan() => "nan".into(),
            ScalarValue::Float(x) if x.is_infinite() => if x > 0.0 { "inf" } else { "-inf" }.into(),
            ScalarValue::Float(x) if sci => scientific(x, o.precision),
            ScalarValue::Float(x) if integral => format!("{x:.0}."),
            ScalarValue::Float(x) => format!("{x:.p$}", p = o.precision),
            ScalarValue::Int(i) => i.to_string(),
            ScalarValue::UInt(u) => u.to_string(),
            ScalarValue::Bool(b) => if b { "True" } else { "False" }.into(),
        })
        .collect()
}

/// `x` as `1.2345e-05`: a signed exponent of at least two digits, as
/// PyTorch (and C's `%e`) writes it.
fn scientific(x: f64, precision: usize) -> String {
    let s = format!("{x:.precision$e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// The padded texts of a (summarized) tensor and how to lay them out.
struct Layout<'a> {
    texts: &'a [String],
    width: usize,
    edge: usize,
    line_width: usize,
}

impl Layout<'_> {
    /// Writes the block of `dims` whose first element is `texts[start]`,
    /// opening at column `indent`.
    fn block(&self, out: &mut String, dims: &[usize], cut: &[bool], start: usize, indent: usize) {
        out.push('[');
        if dims.len() == 1 {
            let per_line = (self.line_width.saturating_sub(indent + 1) / (self.width + 2)).max(1);
            let mut items: Vec<String> =
                self.texts[start..start + dims[0]].iter().map(|s| format!("{s:>w$}", w = self.width)).collect();
            if cut[0] {
                items.insert(self.edge, format!("{:>w$}", "...", w = self.width));
            }
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    if i % per_line == 0 {
                        out.push('\n');
                        out.push_str(&" ".repeat(indent + 1));
                    } else {
                        out.push(' ');
                    }
                }
                out.push_str(item);
            }
        } else {
            let inner: usize = dims[1..].iter().product();
            let sep = format!(",{}{}", "\n".repeat(dims.len() - 1), " ".repeat(indent + 1));
            for i in 0..dims[0] {
                if i > 0 {
                    out.push_str(&sep);
                }
                if cut[0] && i == self.edge {
                    out.push_str("...");
                    out.push_str(&sep);
                }
                self.block(out, &dims[1..], &cut[1..], start + i * inner, indent + 1);
            }
        }
        out.push(']');
    }
}
