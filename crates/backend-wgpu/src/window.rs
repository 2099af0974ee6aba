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
//! Kernels reach the windows through the buffer-access layer
//! (`codegen::access`): lowering knows each binding's windows from the
//! limits (`LowerLimits::windows`), declares a windowed binding `in0` as
//! `in0_w0`, `in0_w1`, ... (the bindings after it renumbered), and reads
//! and writes it through `ld_in0(e)` and `st_out0(e, v);`, which pick the
//! window by dividing the index by a constant (a shift where the window
//! is a power of two, as on lavapipe) and the offset inside it. The
//! arithmetic is exact because indices are u32 element (or vec4)
//! indices, windows hold a whole number of them, and a tensor has at most
//! `u32::MAX` elements (beyond that, lowering refuses it). Every kernel
//! family works this way without knowing windows: elementwise chains,
//! copies, reductions, softmax and norm rows, matmul operands and outputs,
//! gathers, concats, fused attention. This module plans the windows:
//! their size ([`Windows`]) and each kernel's counts ([`KernelWindows`]).
//!
//! What it costs: nothing for a kernel whose tensors each fit one binding
//! (one window is all a binding holds). Its source is what it was before
//! windows existed (byte-identical WGSL), its bindings are whole buffers
//! and its dispatch is the same. A windowed kernel pays a division by a constant and a
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

use crate::codegen::{Passes, Wgsl};

/// The smallest window: also the smallest size class of the pool, so
/// window offsets are multiples of every offset alignment wgpu allows.
pub const MIN_WINDOW_BYTES: u64 = 256;

/// How tensors beyond one binding are bound: windows of [`Windows::bytes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Windows {
    bytes: u64,
}

impl Windows {
    /// Windows no tensor fills: every value is bound whole (the limits
    /// of lowering without an adapter, as the golden snapshots and unit
    /// tests lower).
    pub const UNBOUNDED: Windows = Windows { bytes: u64::MAX / MIN_WINDOW_BYTES * MIN_WINDOW_BYTES };

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
