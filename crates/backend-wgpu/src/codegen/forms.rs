//! The kernel forms: for each kernel family, the ways its kernels can be
//! written ([`KernelForms`] holds one choice per family, [`KernelForms::gpu`]
//! and [`KernelForms::software`] are the two profiles). Every field-less
//! form enum has `ALL`, and [`MatmulForm::CANDIDATES`] lists the concrete
//! matmul forms, so that a new form is one variant here plus the compile
//! errors it causes where forms are matched.

/// The form of each kernel family. Adapters differ: llvmpipe runs each
/// invocation as a CPU loop over SIMD lanes and splits every workgroup
/// barrier into coroutine steps, so it wants long straight-line
/// invocations and no barriers; a GPU wants adjacent lanes on adjacent
/// addresses, many independent workgroups and reuse through workgroup
/// memory and registers. [`KernelForms::gpu`] and
/// [`KernelForms::software`] are the two profiles; the backend picks one
/// from the adapter type, and tests force either on any adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelForms {
    /// Straight-line elementwise kernels.
    pub elementwise: ElementwiseForm,
    /// Reductions (`Op::Reduce`).
    pub reduce: ReduceForm,
    /// Softmax and log-softmax rows.
    pub rows: RowsForm,
    /// Matmul.
    pub matmul: MatmulForm,
    /// Scatter-add.
    pub scatter: ScatterForm,
    /// Fused attention.
    pub attention: AttentionForm,
    /// 2-d convolution.
    pub conv: ConvForm,
}

impl KernelForms {
    /// The GPU profile.
    pub fn gpu() -> KernelForms {
        KernelForms {
            elementwise: ElementwiseForm::GridStride,
            reduce: ReduceForm::Cooperative,
            rows: RowsForm::Cooperative,
            matmul: MatmulForm::ByShape,
            scatter: ScatterForm::RowOwner,
            attention: AttentionForm::Tiled,
            conv: ConvForm::Tiled,
        }
    }

    /// The software-adapter profile.
    pub fn software() -> KernelForms {
        KernelForms {
            elementwise: ElementwiseForm::Consecutive,
            reduce: ReduceForm::PerOutput,
            rows: RowsForm::PerRow,
            matmul: MatmulForm::RegisterBlocked,
            scatter: ScatterForm::PerColumns,
            attention: AttentionForm::PerRow,
            conv: ConvForm::Direct,
        }
    }
}

/// How a straight-line elementwise kernel spreads vectors over invocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementwiseForm {
    /// Each invocation takes consecutive vectors (up to
    /// [`super::STRAIGHT_LINE_STEPS`]): long invocations, right for llvmpipe,
    /// uncoalesced on a GPU (neighbouring lanes 256 bytes apart).
    Consecutive,
    /// One vector per invocation, adjacent lanes on adjacent vec4s (a
    /// subgroup reads one contiguous block per instruction) over a 1-D or
    /// 2-D dispatch; a grid-stride loop, in every step of which adjacent
    /// lanes take adjacent vec4s, only where the grid of one vector per
    /// invocation would not fit the dispatch limits or the u32 invocation
    /// index (see [`super::elementwise::gpu_steps`]).
    GridStride,
}

impl ElementwiseForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [ElementwiseForm] = &[ElementwiseForm::Consecutive, ElementwiseForm::GridStride];

    /// True when adjacent lanes take adjacent vectors (in every step,
    /// where there are several).
    pub fn grid_stride(self) -> bool {
        match self {
            ElementwiseForm::Consecutive => false,
            ElementwiseForm::GridStride => true,
        }
    }
}

/// How reductions spread their work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceForm {
    /// One invocation per output (few long reductions get a workgroup per
    /// output): no barriers, right for llvmpipe.
    PerOutput,
    /// Outputs whose reduced elements are contiguous get a group of lanes
    /// each, striding over the row together (coalesced) and combining
    /// through a tree in workgroup memory; reductions over leading axes
    /// put adjacent lanes on adjacent outputs and split the reduced range
    /// over lane slices.
    Cooperative,
}

impl ReduceForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [ReduceForm] = &[ReduceForm::PerOutput, ReduceForm::Cooperative];

    /// True when groups of lanes share an output through workgroup memory.
    pub fn cooperative(self) -> bool {
        match self {
            ReduceForm::PerOutput => false,
            ReduceForm::Cooperative => true,
        }
    }
}

/// How softmax rows are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowsForm {
    /// One invocation per row (online max and sum, vec4 where aligned).
    PerRow,
    /// A group of lanes per row striding over it together; rows that fit
    /// are held in registers, so the input is read once.
    Cooperative,
}

impl RowsForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [RowsForm] = &[RowsForm::PerRow, RowsForm::Cooperative];

    /// True when one invocation computes a whole row.
    pub fn per_row(self) -> bool {
        match self {
            RowsForm::PerRow => true,
            RowsForm::Cooperative => false,
        }
    }
}

/// How a scatter-add spreads its work (see [`super::index`]); both forms give
/// each output element one owner that adds in index order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScatterForm {
    /// One invocation per (output row, [`super::index::SCATTER_COLUMNS`]
    /// columns), scanning the whole index list with no barrier: right for
    /// llvmpipe.
    PerColumns,
    /// A workgroup per block of output rows, lanes across each row
    /// (coalesced), the index list staged through workgroup memory a chunk
    /// at a time and chunks with no index in the block skipped.
    RowOwner,
}

impl ScatterForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [ScatterForm] = &[ScatterForm::PerColumns, ScatterForm::RowOwner];
}

/// The matmul form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulForm {
    /// Barrier-free register blocks with workgroup-uniform rows of A
    /// (llvmpipe's form; also a candidate on GPUs).
    RegisterBlocked,
    /// Operand tiles double-buffered in workgroup memory.
    Tiled(MatmulTile),
    /// The tiled form with K split into `parts` ranges, each computed by
    /// its own workgroups into a scratch buffer; a second pass sums the
    /// partials and applies the epilogue (see
    /// [`super::matmul::split_parts`]). Its part count depends on the
    /// shape, so it is no member of [`MatmulForm::CANDIDATES`]: only the
    /// GPU rule chooses it.
    SplitK {
        /// The workgroup tile of the first pass.
        tile: MatmulTile,
        /// Ranges of K, each at least [`super::matmul::MATMUL_SPLIT_MIN_DEPTH`]
        /// deep.
        parts: u32,
    },
    /// f16 products on tensor cores through cooperative matrices (see
    /// [`super::coop`]): only where [`super::LowerLimits::cooperative_matrix`]
    /// holds and both operands are f16; forced elsewhere it resolves to
    /// the rule's f32-compute form. No autotuning candidate.
    Cooperative(super::coop::CoopTile),
    /// Chosen from the shape by [`super::matmul::choose_form`] (and
    /// [`super::matmul::coop_eligible`] products by the cooperative form).
    ByShape,
}

impl MatmulForm {
    /// The concrete forms, every tile first, largest first: the forms
    /// autotuning times (`super::matmul::candidates`) and a kernel can be
    /// lowered in (`ByShape` resolves to one of them).
    pub const CANDIDATES: &'static [MatmulForm] = &[
        MatmulForm::Tiled(MatmulTile::ALL[0]),
        MatmulForm::Tiled(MatmulTile::ALL[1]),
        MatmulForm::Tiled(MatmulTile::ALL[2]),
        MatmulForm::Tiled(MatmulTile::ALL[3]),
        MatmulForm::RegisterBlocked,
    ];
}

/// The fused attention form (see [`super::attention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionForm {
    /// One invocation per row (query, or key for the key and value
    /// gradients) walking the other side with the row in registers: no
    /// barriers, right for llvmpipe.
    PerRow,
    /// A workgroup per block of rows; score tiles in registers, operand
    /// slices and probabilities in workgroup memory (the tile fitted to
    /// the adapter's limit; per-row when none fits). The forward is the
    /// flash kernel (the query block staged once, the output in
    /// registers) where a flash tile fits the head dim.
    Tiled,
}

impl AttentionForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [AttentionForm] = &[AttentionForm::PerRow, AttentionForm::Tiled];
}

/// The convolution form (see [`super::conv`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvForm {
    /// One invocation per output position and block of channels, three
    /// nested loops over the taps, no barriers: right for llvmpipe.
    Direct,
    /// Implicit GEMM: a workgroup per tile of positions and channels, patch
    /// and weight slices staged in workgroup memory.
    Tiled,
}

impl ConvForm {
    /// Every form, in declaration order (an exhaustive match below keeps
    /// the list complete).
    pub const ALL: &'static [ConvForm] = &[ConvForm::Direct, ConvForm::Tiled];
}

/// Tile of the tiled matmul: a workgroup of 16 x 16 invocations computes a
/// `4 * rows` x `4 * cols` block per invocation... see [`super::matmul`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulTile {
    /// Output rows of the workgroup tile (64 or 128).
    pub bm: u32,
    /// Output columns of the workgroup tile (64 or 128).
    pub bn: u32,
}

impl MatmulTile {
    /// Every tile the tiled matmul is written for, largest first.
    pub const ALL: [MatmulTile; 4] = [
        MatmulTile { bm: 128, bn: 128 },
        MatmulTile { bm: 128, bn: 64 },
        MatmulTile { bm: 64, bn: 128 },
        MatmulTile { bm: 64, bn: 64 },
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ALL` of each field-less form enum holds every variant: the match
    /// is exhaustive, so a new variant fails to compile here until it is
    /// counted, and the count must then equal `ALL`'s length.
    #[test]
    fn form_lists_are_complete() {
        fn count<T: Copy>(all: &[T], index: fn(T) -> usize, n: usize) {
            assert_eq!(all.len(), n);
            for (k, &f) in all.iter().enumerate() {
                assert_eq!(index(f), k);
            }
        }
        count(
            ElementwiseForm::ALL,
            |f| match f {
                ElementwiseForm::Consecutive => 0,
                ElementwiseForm::GridStride => 1,
            },
            2,
        );
        count(
            ReduceForm::ALL,
            |f| match f {
                ReduceForm::PerOutput => 0,
                ReduceForm::Cooperative => 1,
            },
            2,
        );
        count(
            RowsForm::ALL,
            |f| match f {
                RowsForm::PerRow => 0,
                RowsForm::Cooperative => 1,
            },
            2,
        );
        count(
            ScatterForm::ALL,
            |f| match f {
                ScatterForm::PerColumns => 0,
                ScatterForm::RowOwner => 1,
            },
            2,
        );
        count(
            AttentionForm::ALL,
            |f| match f {
                AttentionForm::PerRow => 0,
                AttentionForm::Tiled => 1,
            },
            2,
        );
        count(
            ConvForm::ALL,
            |f| match f {
                ConvForm::Direct => 0,
                ConvForm::Tiled => 1,
            },
            2,
        );
        // Every concrete matmul form is a candidate: each tile and the
        // register-blocked form; `ByShape` is a rule, not a form.
        for f in MatmulForm::CANDIDATES {
            match f {
                MatmulForm::Tiled(t) => assert!(MatmulTile::ALL.contains(t)),
                MatmulForm::RegisterBlocked => {}
                MatmulForm::SplitK { .. } => panic!("SplitK depends on the shape: no static candidate"),
                MatmulForm::Cooperative(_) => panic!("Cooperative depends on the device: no candidate"),
                MatmulForm::ByShape => panic!("ByShape is no candidate"),
            }
        }
        assert_eq!(MatmulForm::CANDIDATES.len(), MatmulTile::ALL.len() + 1);
    }
}
