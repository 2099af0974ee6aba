//! Pooling (`Op::Pool`, N-d max and average over `[N, C, spatial...]`)
//! and its input gradient (`Op::PoolGrad`).
//!
//! The forward kernel is one invocation per output element walking its
//! window (padding never wins a max; a window with no element in range
//! gives the dtype's lowest value, or NaN for an average without the
//! padding in its divisor, as on the CPU). The gradient is one invocation
//! per input element that gathers from the windows covering it (those
//! whose tap `k` lands on it, in window order): an average window gives
//! `g / divisor` (its divisor in closed form), a max window gives its whole
//! `g` when its first maximum in scan order (the first NaN when there is
//! one) is this tap, found by rescanning the window. Each element is
//! written once, by its owner: no atomics, no scatter, deterministic.
//!
//! One form for every adapter, as in PyTorch's CUDA pooling kernels:
//! adjacent lanes take adjacent positions of the last spatial dim (reads
//! `stride` apart, served by the cache where windows overlap), and a
//! window walk is short, so llvmpipe gets straight invocations too.
//! Rejected alternative for the gradient: scattering each window's share
//! from an output-sized kernel, which needs float atomics where windows
//! overlap (nondeterministic sums) or one pass per kernel offset.

use super::common::*;
use super::Writer;
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, Op, PoolAttrs, PoolKind, Shape};
use std::fmt::Write as _;

/// Loop iterations one invocation of a pooling kernel (`grad`: of its
/// gradient) runs, for llvmpipe's loop budget.
pub fn pool_loop_iterations(p: &PoolAttrs, grad: bool) -> u64 {
    // Saturating: a pool over zero elements may have any window.
    let taps = p.kernel.iter().fold(1u64, |a, &k| a.saturating_mul(k as u64));
    match (grad, p.kind) {
        (false, _) | (true, PoolKind::Avg { .. }) => taps,
        (true, PoolKind::Max) => taps.saturating_add(taps.saturating_mul(taps)),
    }
}

/// Per-dim data of a window walk.
struct Dims {
    nsp: usize,
    input: Shape,
    output: Shape,
    kernel: Shape,
    in_plane: u64,
    out_plane: u64,
}

fn dims(p: &PoolAttrs, x: &Shape, y: &Shape) -> Dims {
    let input = Shape::new(&x.dims()[2..]);
    let output = Shape::new(&y.dims()[2..]);
    Dims {
        nsp: p.kernel.len(),
        in_plane: input.numel() as u64,
        out_plane: output.numel() as u64,
        kernel: Shape::new(p.kernel.clone()),
        input,
        output,
    }
}

impl Writer<'_> {
    /// Statements defining `p{d}` (i32), the input position of tap `tap`
    /// of the window at output coordinates `o{d}` (u32), and `ok`, whether
    /// every one lies in the input. Lines indented by `ind`.
    fn tap_positions(&self, p: &PoolAttrs, w: &Dims, tap: &str, ind: &str) -> String {
        let mut s = String::new();
        let mut ok = Vec::new();
        for d in 0..w.nsp {
            let _ = writeln!(
                s,
                "{ind}let p{d} = i32(o{d} * {}u + {} * {}u) - {};",
                p.strides[d],
                coord(tap, &w.kernel, d),
                p.dilations[d],
                int_lit(p.pads_begin[d] as i32)
            );
            ok.push(format!("p{d} >= 0i && p{d} < {}", int_lit(w.input.dims()[d] as i32)));
        }
        let _ = writeln!(s, "{ind}let ok = {};", ok.join(" && "));
        s
    }

    /// The input offset (within the plane) of the positions `p{d}`.
    fn tap_offset(&self, w: &Dims) -> String {
        let st = strides(&w.input);
        sum((0..w.nsp).map(|d| format!("u32(p{d}) * {}u", st[d])).collect())
    }

    /// A pooling kernel: one invocation per output element. Appends the
    /// statements of `main` to `b`; returns the invocation count.
    pub(super) fn pool_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::Pool(p) = &rn.op else { unreachable!("pool kernel of a {}", rn.op.name()) };
        let x = rn.inputs[0];
        let w = dims(p, &g.node(x).shape, &rn.shape);
        let d = rn.dtype;
        let taps = w.kernel.numel();
        let _ = writeln!(b, "    let plane = t / {}u;\n    let q = t % {}u;", w.out_plane, w.out_plane);
        for dd in 0..w.nsp {
            let _ = writeln!(b, "    let o{dd} = {};", coord("q", &w.output, dd));
        }
        let (init, combine) = match (p.kind, d) {
            (PoolKind::Max, DType::F32 | DType::F16 | DType::BF16) => {
                self.use_helper(Helper::MaxNan);
                self.use_helper(Helper::InfF);
                ("(-inf_f())".to_string(), "max_nan(acc, v)")
            }
            (PoolKind::Max, DType::I32) => (int_lit(i32::MIN), "max(acc, v)"),
            (PoolKind::Max, _) => ("0u".to_string(), "max(acc, v)"),
            (PoolKind::Avg { .. }, _) => ("0.0".to_string(), "acc + v"),
        };
        let _ = writeln!(b, "    var acc: {} = {init};\n    var count = 0u;\n    var padded = 0u;", ty(d));
        let _ = write!(
            b,
            "    for (var k = 0u; k < {taps}u; k = k + 1u) {{\n{}",
            self.tap_positions(p, &w, "k", "        ")
        );
        let _ = write!(
            b,
            "        if (ok) {{\n            let v = n{}(plane * {}u + {});\n            acc = {combine};\n            count = count + 1u;\n        }}\n",
            x.0,
            w.in_plane,
            self.tap_offset(&w)
        );
        if p.kind == (PoolKind::Avg { count_include_pad: true }) {
            let inside: Vec<String> = (0..w.nsp)
                .map(|dd| format!("p{dd} < {}", int_lit((w.input.dims()[dd] + p.pads_end[dd]) as i32)))
                .collect();
            let _ =
                writeln!(b, "        if ({}) {{\n            padded = padded + 1u;\n        }}", inside.join(" && "));
        }
        b.push_str("    }\n");
        match p.kind {
            PoolKind::Max => {
                let _ = writeln!(b, "    {}", self.output(0).store("t", "acc"));
            }
            PoolKind::Avg { count_include_pad } => {
                self.use_helper(Helper::NanF);
                let div = if count_include_pad { "padded" } else { "count" };
                let _ = writeln!(
                    b,
                    "    {}",
                    self.output(0).store("t", &format!("select(acc / f32({div}), nan_f(), {div} == 0u)"))
                );
            }
        }
        rn.shape.numel() as u64
    }

    /// A pooling gradient: one invocation per input element gathering
    /// from the windows that cover it. Appends the statements of `main` to
    /// `b`; returns the invocation count.
    pub(super) fn pool_grad_kernel(&mut self, k: &Kernel, b: &mut String) -> u64 {
        let g = self.g;
        let rn = g.node(k.root());
        let Op::PoolGrad(p) = &rn.op else { unreachable!("pool gradient kernel of a {}", rn.op.name()) };
        let (x, gr) = (rn.inputs[0], rn.inputs[1]);
        let w = dims(p, &rn.shape, &g.node(gr).shape);
        let taps = w.kernel.numel();
        let ost = strides(&w.output);
        let _ = writeln!(b, "    let plane = t / {}u;\n    let q = t % {}u;", w.in_plane, w.in_plane);
        for d in 0..w.nsp {
            let _ = writeln!(b, "    let i{d} = i32({});", coord("q", &w.input, d));
        }
        // Tap `k` of window `o` lands on `i` when `o * stride = i + pad -
        // k * dilation`; walking `k` downwards visits the windows in
        // order, as the CPU reference sums them.
        let _ = writeln!(
            b,
            "    var acc = 0.0;\n    for (var kr = 0u; kr < {taps}u; kr = kr + 1u) {{\n        let k = {}u - kr;",
            taps - 1
        );
        let mut cover = Vec::new();
        for d in 0..w.nsp {
            let s = int_lit(p.strides[d] as i32);
            let _ = writeln!(
                b,
                "        let w{d} = i{d} + {} - i32({} * {}u);",
                int_lit(p.pads_begin[d] as i32),
                coord("k", &w.kernel, d),
                p.dilations[d]
            );
            cover
                .push(format!("w{d} >= 0i && w{d} % {s} == 0i && w{d} / {s} < {}", int_lit(w.output.dims()[d] as i32)));
        }
        let _ = writeln!(b, "        if ({}) {{", cover.join(" && "));
        for d in 0..w.nsp {
            let _ = writeln!(b, "            let o{d} = u32(w{d} / {});", int_lit(p.strides[d] as i32));
        }
        let gi = sum((0..w.nsp).map(|d| format!("o{d} * {}u", ost[d])).collect());
        let _ = writeln!(b, "            let gv = n{}(plane * {}u + {gi});", gr.0, w.out_plane);
        match p.kind {
            PoolKind::Max => {
                self.use_helper(Helper::IsNanF);
                let _ = write!(
                    b,
                    "            var first = 0u;\n            var best = 0.0;\n            var found = false;\n            for (var kk = 0u; kk < {taps}u; kk = kk + 1u) {{\n{}",
                    self.tap_positions(p, &w, "kk", "                ")
                );
                let _ = write!(
                    b,
                    "                if (ok) {{\n                    let v = n{}(plane * {}u + {});\n                    if (!found || (!isnan_f(best) && (isnan_f(v) || v > best))) {{\n                        found = true;\n                        first = kk;\n                        best = v;\n                    }}\n                }}\n            }}\n            if (first == k) {{\n                acc = acc + gv;\n            }}\n",
                    x.0,
                    w.in_plane,
                    self.tap_offset(&w)
                );
            }
            PoolKind::Avg { count_include_pad } => {
                let mut counts = Vec::new();
                for d in 0..w.nsp {
                    let (kd, dil) = (p.kernel[d] as i32, p.dilations[d] as i32);
                    let n = w.input.dims()[d] as i32;
                    let _ = writeln!(
                        b,
                        "            let s{d} = i32(o{d} * {}u) - {};",
                        p.strides[d],
                        int_lit(p.pads_begin[d] as i32)
                    );
                    // Taps of the window's dim `d` inside the padded input
                    // (start + j * dilation < n + pad_end: the window never
                    // starts beyond it) or inside the input.
                    let c = match (count_include_pad, dil) {
                        (true, 0) => int_lit(kd),
                        (true, _) => format!(
                            "min({}, ({} - s{d} + {}) / {})",
                            int_lit(kd),
                            int_lit(n + p.pads_end[d] as i32),
                            int_lit(dil - 1),
                            int_lit(dil)
                        ),
                        (false, 0) => format!("select(0i, {}, s{d} >= 0i && s{d} < {})", int_lit(kd), int_lit(n)),
                        (false, _) => format!(
                            "max(min({}, select(0i, ({} - s{d} + {}) / {}, s{d} < {})) - select(0i, (-s{d} + {}) / {}, s{d} < 0i), 0i)",
                            int_lit(kd),
                            int_lit(n),
                            int_lit(dil - 1),
                            int_lit(dil),
                            int_lit(n),
                            int_lit(dil - 1),
                            int_lit(dil)
                        ),
                    };
                    counts.push(format!("f32({c})"));
                }
                let _ = writeln!(b, "            acc = acc + gv / ({});", counts.join(" * "));
            }
        }
        let _ = writeln!(b, "        }}\n    }}\n    {}", self.output(0).store("t", "acc"));
        rn.shape.numel() as u64
    }
}
