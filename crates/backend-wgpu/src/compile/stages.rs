//! The stages of a compile that need no device, in the order a compile
//! runs them: the fusion plan, each kernel's mode (kept, static or
//! generic over sizes), its schedule (the tuner's winner looked up by
//! the schedule's problem, the split-K binding check), its text, the
//! finishing touches (the windows' binding check, test fault injection,
//! the launches' costs) and its size family. [`crate::compile::Compiler`]
//! runs them and then builds the pipelines, the one stage that needs the
//! device; the tuner's candidates and the second tier's static kernels
//! reuse the schedule, lower and finish stages.
//!
//! Each stage is a method of [`Stages`] over values (the graph, the plan,
//! the modes, the schedules), unit-tested without an adapter.
//!
//! The one lowering that does not follow a schedule stage: a kernel of a
//! graph seen at other sizes that does not align node for node with the
//! earlier one finds its family's forms by its source's skeleton
//! ([`Stages::modes`]). A family is defined by its skeleton (the source with
//! its size literals blanked, see [`crate::rewrite::size_families`]), so the key is that
//! text.
//!
//! Rejected alternative: keying a size family's remembered forms by the
//! kernel's structure rather than its skeleton, which would spare that
//! lowering: two kernels of one structure may lower to different
//! skeletons (a size crossing a layout bucket) and two of different
//! structure to one, so the lookup would no longer find exactly the
//! family the kernel joins.

use crate::codegen::window::KernelWindows;
use crate::codegen::{self, FixedSizes, LowerError, LowerLimits, MatmulForm, Schedule, Wgsl};
use crate::compile::autotune::{self, Tuner, Tuning};
use crate::compile::executable::{CompiledKernel, WgpuExecutable};
use crate::compile::pipeline::Prepared;
use crate::compile::threads::Workers;
use crate::rewrite::size_families::{Families, Member, SizeChanges};
use lazuli_executor::{metrics, BackendError, LaunchCost};
use lazuli_ir::fusion::{self, FusionLimits, FusionPlan, Kernel};
use lazuli_ir::VerifiedGraph;
use std::sync::Arc;

/// The device-free compile stages and what they read: limits, the tuner's
/// winners, the size families.
pub(crate) struct Stages {
    /// The backend's name, for typed errors.
    pub backend: String,
    /// What the fusion planner may do on this adapter.
    pub fusion: FusionLimits,
    /// What lowering may do: the kernel forms, workgroup memory, windows.
    pub lower: LowerLimits,
    /// Bounded autotuning of kernel forms.
    pub tuner: Tuner,
    /// Families of kernels generic over sizes.
    pub families: Families,
    /// The compile threads (shared with pipeline creation).
    pub workers: Arc<Workers>,
    /// Fault injection (tests): kernels whose name contains it compute a
    /// wrong value.
    pub fault_kernel: Option<String>,
}

/// What a compile knows of its structure's compile at other sizes (see
/// `CompileHints`): whether kernels whose sizes vary compile generic,
/// the earlier graph and executable, what changed since.
pub(crate) struct Variant<'a> {
    /// Kernels whose sizes vary compile generic over them
    /// (`CompileHints::sizes_vary`, size families on).
    pub generic: bool,
    /// The executable of this structure compiled last at other sizes.
    pub earlier: Option<&'a WgpuExecutable>,
    /// The sizes that differ from it, where its graph aligns node for
    /// node (see [`SizeChanges`]); otherwise each kernel's forms are found
    /// by skeleton.
    pub changes: Option<SizeChanges>,
    /// The structure's first size variant: its static predecessor's
    /// sources join their families first, and each kernel's forms are
    /// remembered.
    pub first: bool,
}

impl<'a> Variant<'a> {
    /// The variant of `graph` against `earlier` (a compile of its
    /// structure at other sizes) where `sizes_vary` and size families are
    /// on (`families`).
    pub fn of(graph: &VerifiedGraph, sizes_vary: bool, families: bool, earlier: Option<&'a WgpuExecutable>) -> Self {
        let generic = sizes_vary && families;
        let changes = earlier.filter(|_| generic).and_then(|e| SizeChanges::between(graph, &e.graph));
        let first = generic && earlier.is_some_and(|e| !e.generic && *e.graph != **graph);
        Variant { generic, earlier, changes, first }
    }

    /// A first compile of its structure (nothing earlier).
    #[cfg(test)]
    pub fn first_compile(generic: bool) -> Variant<'static> {
        Variant { generic, earlier: None, changes: None, first: false }
    }
}

/// How one kernel of a plan compiles (the per-kernel mode stage).
pub(crate) enum Mode {
    /// The earlier executable's kernel, kept as it is (see
    /// [`WgpuExecutable::unchanged`]).
    Kept(Box<CompiledKernel>),
    /// A static kernel: the tuner's known winner, else the rule's form.
    Static,
    /// Generic over sizes, keeping `fixed` as constants; `lowered`: its
    /// source where finding its family's forms lowered it already in
    /// these forms.
    Generic {
        /// The sizes kept fixed.
        fixed: FixedSizes,
        /// Its source, lowered already.
        lowered: Option<Wgsl>,
    },
}

/// A kernel lowered and finished, before its pipelines exist.
pub(crate) struct Lowered {
    /// Its name, `k<index>_<kind>_<op>`.
    pub name: String,
    /// Its source(s).
    pub wgsl: Wgsl,
    /// The windows of its bindings (see [`crate::codegen::window`]).
    pub windows: KernelWindows,
    /// The cost of the first pass, if any (see [`crate::compile::cost`]).
    pub pre_cost: Option<LaunchCost>,
    /// The cost of the kernel proper.
    pub cost: LaunchCost,
}

impl Lowered {
    /// What gets a pipeline, in the order the build stage takes: the
    /// kernel (pass 0), then its first pass where it has one (pass 1,
    /// named `<kernel>_pass1`).
    pub fn passes(&self) -> impl Iterator<Item = (String, &Wgsl, usize)> {
        let pre = self.wgsl.pre.as_deref().map(|p| (format!("{}_pass1", self.name), p, 1));
        std::iter::once((self.name.clone(), &self.wgsl, 0)).chain(pre)
    }
}

/// The name of kernel `i` of a plan of `graph`.
pub(crate) fn kernel_name(i: usize, k: &Kernel, graph: &VerifiedGraph) -> String {
    format!("k{i}_{:?}_{}", k.kind, graph.node(k.root()).op.name())
}

impl Stages {
    /// Stage 1, the plan: `graph` cut into kernels. Kernels that merge
    /// only because their shapes are equal at these sizes stay apart in a
    /// size variant (see `fusion::plan_sized_like`).
    pub fn plan(&self, graph: &VerifiedGraph, variant: &Variant) -> FusionPlan {
        let like = variant.earlier.filter(|_| variant.changes.is_some()).map(|e| &*e.graph);
        fusion::plan_sized_like(graph, &self.fusion, like)
    }

    /// Stage 2, each kernel's mode: kept where the earlier executable has
    /// it over nodes exactly as they are now (`kept`, per kernel), static
    /// where nothing varies, else generic keeping the sizes that stay
    /// (from the size changes where the graphs align, else from the
    /// forms the kernel's family remembered, found by its skeleton). In a
    /// structure's first size variant each kernel's forms are remembered
    /// (kept ones too).
    pub fn modes(
        &self,
        graph: &VerifiedGraph,
        plan: &FusionPlan,
        variant: &Variant,
        mut kept: Vec<Option<CompiledKernel>>,
    ) -> Result<Vec<Mode>, BackendError> {
        let varying = LowerLimits { generic: true, fixed: FixedSizes::NONE, ..self.lower };
        let mut modes = Vec::with_capacity(plan.kernels.len());
        for (i, k) in plan.kernels.iter().enumerate() {
            let mode = match &variant.changes {
                _ if !variant.generic => Mode::Static,
                Some(changes) => {
                    let fixed = changes.kernel(k, graph);
                    if variant.first {
                        if let Ok(w) = self.lower_kernel(k, graph, &varying) {
                            self.families.remember_forms(&w.source, w.entry, fixed);
                        }
                    }
                    fixed.map_or(Mode::Static, |fixed| Mode::Generic { fixed, lowered: None })
                }
                None => {
                    // The family's key is the source's skeleton.
                    let w = self.lower_kernel(k, graph, &varying)?;
                    match self.families.forms(&w.source, w.entry) {
                        Some(Some(fixed)) => Mode::Generic { fixed, lowered: None },
                        Some(None) => Mode::Static,
                        None => Mode::Generic { fixed: FixedSizes::NONE, lowered: Some(w) },
                    }
                }
            };
            modes.push(match kept.get_mut(i).and_then(Option::take) {
                Some(kernel) => {
                    self.check_kept(k, graph, &kernel);
                    metrics::inc("KernelsKept", 1);
                    Mode::Kept(Box::new(kernel))
                }
                None => mode,
            });
        }
        Ok(modes)
    }

    /// Stages 3 and 4 for every kernel not kept: its schedule and its
    /// text, with whether it waits for the tuner. A size variant's generic
    /// kernels (of a graph that aligns with the earlier one) lower on the
    /// compile threads at once: lowering is a pure function of the
    /// kernel, and most of what a variant costs; the others in order.
    pub fn lower_kernels(
        &self,
        graph: &VerifiedGraph,
        plan: &FusionPlan,
        modes: &mut [Mode],
        variant: &Variant,
    ) -> Result<Vec<Option<(Wgsl, bool)>>, BackendError> {
        let generic_limits = |fixed: FixedSizes| LowerLimits { generic: true, fixed, ..self.lower };
        let mut parallel: Vec<Option<Result<Wgsl, BackendError>>> = match &variant.changes {
            Some(_) => self.workers.map(&plan.kernels.iter().zip(&*modes).collect::<Vec<_>>(), |(k, mode)| {
                let Mode::Generic { fixed, lowered: None } = mode else { return None };
                Some(self.lower_kernel(k, graph, &generic_limits(*fixed)))
            }),
            None => Vec::new(),
        };
        let mut lowered = Vec::with_capacity(plan.kernels.len());
        for (i, (k, mode)) in plan.kernels.iter().zip(modes).enumerate() {
            let wgsl = match mode {
                Mode::Kept(_) => {
                    lowered.push(None);
                    continue;
                }
                Mode::Generic { lowered: w @ Some(_), .. } => (w.take().expect("lowered"), false),
                // Tuning a form per size would defeat sharing it.
                Mode::Generic { fixed, lowered: None } => match parallel.get_mut(i).and_then(Option::take) {
                    Some(wgsl) => (wgsl?, false),
                    None => (self.lower_kernel(k, graph, &generic_limits(*fixed))?, false),
                },
                Mode::Static => self.lower_static(k, graph)?,
            };
            metrics::inc("KernelsLowered", 1);
            lowered.push(Some(wgsl));
        }
        Ok(lowered)
    }

    /// Stage 3, a static kernel's schedule: in the tuner's known winner
    /// where it has one, else in the rule's form, and whether it waits for
    /// the tuner (a tunable kernel without a winner; nothing is timed
    /// here). The tuner's key is the schedule's problem, so nothing is
    /// lowered to learn it.
    pub fn schedule_static(&self, k: &Kernel, graph: &VerifiedGraph) -> Result<(Schedule, bool), BackendError> {
        let base = self.schedule_as_is(k, graph, &self.lower)?;
        Ok(match autotune::lookup(&self.tuner, k, graph, &base) {
            Tuning::Known(form) => (self.schedule(k, graph, &autotune::with_form(self.lower, form))?, false),
            Tuning::Pending => (self.fit_bindings(k, graph, base)?, true),
            Tuning::Untuned => (self.fit_bindings(k, graph, base)?, false),
        })
    }

    /// Stages 3 and 4 for a static kernel: [`Stages::schedule_static`],
    /// then its text, lowered once, in the form it runs.
    pub fn lower_static(&self, k: &Kernel, graph: &VerifiedGraph) -> Result<(Wgsl, bool), BackendError> {
        let (schedule, pending) = self.schedule_static(k, graph)?;
        Ok((self.lower_scheduled(k, graph, &schedule)?, pending))
    }

    /// Stage 3: the schedule of kernel `k` of `graph` under `limits` (see
    /// [`codegen::schedule`]), fitted to the adapter's bindings (see
    /// [`Stages::fit_bindings`]).
    pub fn schedule(&self, k: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Schedule, BackendError> {
        let schedule = self.schedule_as_is(k, graph, limits)?;
        self.fit_bindings(k, graph, schedule)
    }

    /// The schedule of kernel `k` of `graph` under `limits`, as the
    /// limits give it.
    pub fn schedule_as_is(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        limits: &LowerLimits,
    ) -> Result<Schedule, BackendError> {
        codegen::schedule(k, graph, limits).map_err(|e| self.lower_error(limits, e))
    }

    /// `schedule` of kernel `k`, or, where it is a split-K product whose
    /// second pass binds the scratch besides the kernel's inputs and
    /// outputs and that (windowed) is more than a kernel may bind, the
    /// product in one pass: decided from the schedule's bindings, before
    /// anything is lowered.
    pub fn fit_bindings(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        schedule: Schedule,
    ) -> Result<Schedule, BackendError> {
        if schedule.passes.binds_inputs() && schedule.windows(k, graph).bindings() > self.fusion.max_storage_buffers {
            if let Some(MatmulForm::SplitK { tile, .. }) = schedule.matmul_form() {
                return self.schedule_as_is(k, graph, &autotune::with_form(schedule.limits, MatmulForm::Tiled(tile)));
            }
        }
        Ok(schedule)
    }

    /// Stages 3 and 4: kernel `k` of `graph` as WGSL with `limits`.
    pub fn lower_kernel(&self, k: &Kernel, graph: &VerifiedGraph, limits: &LowerLimits) -> Result<Wgsl, BackendError> {
        let schedule = self.schedule(k, graph, limits)?;
        self.lower_scheduled(k, graph, &schedule)
    }

    /// Stage 4: kernel `k` of `graph` written from its schedule.
    pub fn lower_scheduled(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        schedule: &Schedule,
    ) -> Result<Wgsl, BackendError> {
        codegen::lower_scheduled(k, graph, schedule).map_err(|e| self.lower_error(&schedule.limits, e))
    }

    /// A lowering error as the backend's typed error (`limits`: those the
    /// kernel was lowered under).
    fn lower_error(&self, limits: &LowerLimits, e: LowerError) -> BackendError {
        match e {
            LowerError::Unsupported { op, dtype } => {
                BackendError::Unsupported { backend: self.backend.clone(), op, dtype }
            }
            LowerError::TooLarge { op, elements } => BackendError::TooLarge {
                op,
                bytes: elements.saturating_mul(4),
                limit: limits.max_elements * 4,
                limit_name: "what kernels index with u32 element indices".into(),
            },
        }
    }

    /// Stage 5, kernel `k` (named `name`) lowered as `wgsl`, finished for
    /// pipeline creation: its windows counted against what a kernel may
    /// bind, fault-injected where a test asks for it, and with its
    /// launches' costs (see [`crate::compile::cost`]).
    pub fn finish(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        name: String,
        mut wgsl: Wgsl,
    ) -> Result<Lowered, BackendError> {
        let windows = self.windows(k, graph, &name, &wgsl)?;
        let faulty = self.fault_kernel.as_deref().is_some_and(|f| name.contains(f));
        if faulty {
            wgsl.source = crate::rewrite::fault::perturb(&wgsl.source);
            // Trust was proven for the source as lowered: a changed one
            // keeps its runtime checks (windowed sources never had trust,
            // see `codegen::Schedule::trusted`).
            wgsl.trusted = false;
            if let Some(p) = wgsl.pre.as_deref_mut() {
                p.trusted = false;
            }
        }
        let (pre_cost, cost) = crate::compile::cost::launches(k, graph, &name, &wgsl);
        Ok(Lowered { name, wgsl, windows, pre_cost, cost })
    }

    /// The windows of kernel `k` (named `name`), lowered as `wgsl`, for
    /// its tensors beyond one binding (see [`crate::codegen::window`]; lowering
    /// wrote their accesses, see [`codegen::access`]). A kernel needing
    /// more storage bindings than the adapter allows is
    /// `BackendError::TooLarge` naming its op, its bytes and the limit.
    fn windows(
        &self,
        k: &Kernel,
        graph: &VerifiedGraph,
        name: &str,
        wgsl: &Wgsl,
    ) -> Result<KernelWindows, BackendError> {
        let w = self.lower.windows;
        let kw = wgsl.windows(k, graph, &w);
        if !kw.is_windowed() {
            return Ok(kw);
        }
        let ids = k.inputs.iter().chain(&k.outputs);
        let bytes: u64 = ids.clone().map(|id| graph.node(*id).shape.numel() as u64 * 4).sum();
        let largest = ids.max_by_key(|id| graph.node(**id).shape.numel()).expect("a kernel has an output");
        let op = format!("{} (kernel {name})", graph.node(*largest).op.name());
        let max = self.fusion.max_storage_buffers;
        // The error slot of a kernel that checks indices is a binding too.
        let bindings = kw.bindings() + wgsl.error_slot as usize;
        if bindings > max {
            return Err(BackendError::TooLarge {
                op: format!("{op}, {bindings} storage bindings in windows of {} bytes", w.bytes()),
                bytes,
                limit: max as u64 * w.bytes(),
                limit_name: format!("what one kernel can bind ({max} storage bindings)"),
            });
        }
        metrics::inc("WindowedKernels", 1);
        Ok(kw)
    }

    /// Stage 5, each lowered source (and first pass) ready for pipeline
    /// creation: generic over sizes where its family has seen other
    /// sizes; with each one's member of its family, if generic. `like`:
    /// per kernel of `lowered`, the same kernel of the structure compiled
    /// at other sizes (a size variant's predecessor), if any; empty where
    /// there is none.
    pub fn prepare(
        &self,
        lowered: &[Lowered],
        like: &[Option<&CompiledKernel>],
    ) -> (Vec<Prepared>, std::vec::IntoIter<Option<Arc<Member>>>) {
        let mut prepared = Vec::new();
        let mut members = Vec::new();
        for (i, kernel) in lowered.iter().enumerate() {
            let earlier = like.get(i).copied().flatten();
            for (name, w, pass) in kernel.passes() {
                let like = earlier.and_then(|e| {
                    let was = if pass == 0 { Some(&e.wgsl) } else { e.wgsl.pre.as_deref() };
                    Some((e.members[pass].as_deref()?, was?.source.as_str()))
                });
                let s = self.families.specialize(&w.source, w.entry, like);
                members.push(s.member);
                prepared.push(Prepared {
                    name,
                    source: s.source,
                    entry: w.entry,
                    inputs: w.inputs,
                    outputs: w.outputs,
                    error_slot: w.error_slot,
                    // A source made generic over sizes was not proven.
                    trusted: w.trusted && s.dims.is_empty(),
                    dims: s.dims,
                });
            }
        }
        (prepared, members.into_iter())
    }

    /// Lowers the kernels of `plan` of `graph` (the structure about to
    /// compile, at other sizes, whose fusion plan is reused) in the forms
    /// the new size takes (independent of the sizes that differ,
    /// `changes`) and records their sources in their families without
    /// compiling them (`Families::observe`): the new size's kernels then
    /// turn every literal that differs between the two sizes dynamic in
    /// one widening, rather than compiling as static first members of new
    /// families and widening at the next size. A kernel that does not
    /// lower, or whose tensors need windows, is skipped; the real compile
    /// reports its own errors. The size families compare two sources, so
    /// the earlier one is lowered again: inherently text work.
    pub fn observe_sizes(&self, graph: &VerifiedGraph, plan: &FusionPlan, changes: &SizeChanges) {
        for k in &plan.kernels {
            // Kernels whose sizes stay compile static, as they did.
            let Some(fixed) = changes.kernel(k, graph) else { continue };
            let limits = LowerLimits { generic: true, fixed, ..self.lower };
            let Ok(schedule) = self.schedule(k, graph, &limits) else { continue };
            if schedule.windows(k, graph).is_windowed() {
                continue; // its source would be rewritten; leave it static
            }
            let Ok(wgsl) = self.lower_scheduled(k, graph, &schedule) else { continue };
            self.families.observe(&wgsl.source, wgsl.entry);
            if let Some(pre) = &wgsl.pre {
                self.families.observe(&pre.source, pre.entry);
            }
        }
    }

    /// Debug builds: a kept kernel (see [`WgpuExecutable::unchanged`]) is
    /// what lowering kernel `k` again would make, source for source.
    fn check_kept(&self, k: &Kernel, graph: &VerifiedGraph, kept: &CompiledKernel) {
        if cfg!(debug_assertions) {
            let again =
                self.lower_static(k, graph).and_then(|(wgsl, _)| self.finish(k, graph, kept.name.clone(), wgsl));
            let again = again.unwrap_or_else(|e| panic!("kept kernel {} does not lower again: {e}", kept.name));
            assert_eq!(again.wgsl.source, kept.wgsl.source, "kept kernel {} differs from its lowering", kept.name);
            assert_eq!(
                again.wgsl.pre.map(|p| p.source),
                kept.wgsl.pre.as_ref().map(|p| p.source.clone()),
                "kept kernel {}'s first pass differs from its lowering",
                kept.name
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::window::Windows;
    use lazuli_ir::{BinaryOp, DType, Graph, Op, ReduceOp, UnaryOp, ValueType};

    /// Stages with the given limits, tuning off, size families on.
    fn stages(lower: LowerLimits, max_storage_buffers: usize) -> Stages {
        Stages {
            backend: "test".into(),
            fusion: FusionLimits { max_storage_buffers, matmul_epilogue: true, ..FusionLimits::default() },
            lower,
            tuner: Tuner::new(false, "test", None),
            families: Families::new(true, 64),
            workers: Arc::new(Workers::new(1)),
            fault_kernel: None,
        }
    }

    /// `relu(x [rows, 64] @ w [64, 32] + b)` and a row sum of `x`.
    fn graph(rows: usize) -> VerifiedGraph {
        let mut g = Graph::new();
        let x = g.param(ValueType::new([rows, 64], DType::F32));
        let w = g.param(ValueType::new([64, 32], DType::F32));
        let b = g.param(ValueType::new([32], DType::F32));
        let y = g.push(Op::MatMul, &[x, w]).unwrap();
        let y = g.push(Op::Binary(BinaryOp::Add), &[y, b]).unwrap();
        let y = g.push(Op::Unary(UnaryOp::Relu), &[y]).unwrap();
        let s = g.push(Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdim: false }, &[x]).unwrap();
        g.outputs.extend([y, s]);
        g.verify().unwrap()
    }

    /// A first compile plans, gives every kernel the static mode, lowers
    /// each once and finishes it with its costs; the same kernel lowered
    /// by its stages alone is the same source.
    #[test]
    fn a_first_compile_runs_every_stage_in_order() {
        let f = stages(LowerLimits::gpu(), 8);
        let g = graph(128);
        let variant = Variant::first_compile(false);
        let plan = f.plan(&g, &variant);
        assert_eq!(plan.kernels.len(), 2, "the product with its epilogue, the row sum");
        let modes = f.modes(&g, &plan, &variant, Vec::new()).unwrap();
        assert!(modes.iter().all(|m| matches!(m, Mode::Static)));
        let mut modes = modes;
        let texts = f.lower_kernels(&g, &plan, &mut modes, &variant).unwrap();
        for (i, (k, text)) in plan.kernels.iter().zip(texts).enumerate() {
            let (wgsl, pending) = text.expect("lowered");
            assert!(!pending, "tuning is off");
            assert_eq!(wgsl, codegen::lower(k, &g, &f.lower).unwrap(), "kernel {i}: the stages are one lowering");
            let done = f.finish(k, &g, kernel_name(i, k, &g), wgsl).unwrap();
            assert!(!done.windows.is_windowed());
            assert!(done.cost.flops > 0 || done.cost.bytes > 0, "kernel {i} has a cost");
        }
    }

    /// Where sizes vary and nothing earlier aligns, a kernel lowers in
    /// forms that hold at every size, and a family whose forms were
    /// remembered gives them to the next compile; a size variant of an
    /// aligned graph keeps the sizes that stayed (here the product's
    /// columns and depth) and lowers its generic kernels on the workers.
    #[test]
    fn size_variants_take_generic_modes() {
        let f = stages(LowerLimits::gpu(), 8);
        let g = graph(100);
        let variant = Variant::first_compile(true);
        let plan = f.plan(&g, &variant);
        let modes = f.modes(&g, &plan, &variant, Vec::new()).unwrap();
        let Mode::Generic { fixed, lowered: Some(w) } = &modes[0] else { panic!("generic, lowered already") };
        assert_eq!(*fixed, FixedSizes::NONE);
        assert!(w.generic_form);
        // The forms remembered for the family are found by its skeleton.
        let kept = FixedSizes { m: false, n: true, k: true, row: true };
        f.families.remember_forms(&w.source, w.entry, Some(kept));
        let modes = f.modes(&g, &plan, &variant, Vec::new()).unwrap();
        assert!(matches!(modes[0], Mode::Generic { fixed, lowered: None } if fixed == kept));
        // Aligned with an earlier graph at other rows: the changes say
        // what varies.
        let earlier = graph(64);
        let changes = SizeChanges::between(&g, &earlier).expect("aligned");
        let variant = Variant { generic: true, earlier: None, changes: Some(changes), first: false };
        let modes = f.modes(&g, &plan, &variant, Vec::new()).unwrap();
        let Mode::Generic { fixed, lowered: None } = modes[0] else { panic!("generic") };
        assert!(!fixed.m && fixed.n && fixed.k, "{fixed:?}");
        let mut modes = modes;
        let texts = f.lower_kernels(&g, &plan, &mut modes, &variant).unwrap();
        assert!(texts.iter().all(|t| t.as_ref().is_some_and(|(w, _)| w.generic_form)));
    }

    /// The split-K binding check runs on the schedule: a split product
    /// whose second pass would bind more than the adapter allows runs in
    /// one pass, before anything is lowered; a windowed kernel over the
    /// limit is a typed error at the finish.
    #[test]
    fn bindings_are_checked_from_the_schedule() {
        // x^T dy over 8192 tokens: the GPU rule splits K.
        let mut g = Graph::new();
        let x = g.param(ValueType::new([8192, 64], DType::F32));
        let dy = g.param(ValueType::new([8192, 64], DType::F32));
        let xt = g.push(Op::Permute(vec![1, 0]), &[x]).unwrap();
        let w = g.push(Op::MatMul, &[xt, dy]).unwrap();
        g.outputs.push(w);
        let g = g.verify().unwrap();
        let roomy = stages(LowerLimits::gpu(), 8);
        let k = &roomy.plan(&g, &Variant::first_compile(false)).kernels[0];
        let split = roomy.schedule(k, &g, &roomy.lower).unwrap();
        assert!(matches!(split.matmul_form(), Some(MatmulForm::SplitK { .. })), "{:?}", split.matmul_form());
        // Two inputs, the scratch and the output: four bindings.
        let tight = stages(LowerLimits::gpu(), 3);
        let one = tight.schedule(k, &g, &tight.lower).unwrap();
        assert!(matches!(one.matmul_form(), Some(MatmulForm::Tiled(_))), "{:?}", one.matmul_form());
        // 1 KiB windows: x alone needs 2048 bindings.
        let small = LowerLimits { windows: Windows::new(1 << 20, 16, Some(1024)), ..LowerLimits::gpu() };
        let windowed = stages(small, 8);
        let wgsl = windowed.lower_kernel(k, &g, &windowed.lower).unwrap();
        let err = windowed.finish(k, &g, "k0_MatMul_matmul".into(), wgsl).err().expect("too many bindings");
        assert!(matches!(err, BackendError::TooLarge { .. }), "{err}");
    }

    /// The size-family stage turns a source generic once its family saw
    /// another size, and leaves a first member static.
    #[test]
    fn the_size_family_stage_widens_observed_families() {
        let f = stages(LowerLimits::gpu(), 8);
        let limits = LowerLimits { generic: true, ..f.lower };
        let lowered = |rows: usize| {
            let g = graph(rows);
            let plan = f.plan(&g, &Variant::first_compile(true));
            let k = &plan.kernels[1];
            let wgsl = f.lower_kernel(k, &g, &limits).unwrap();
            f.finish(k, &g, kernel_name(1, k, &g), wgsl).unwrap()
        };
        let first = lowered(100);
        let (prepared, _) = f.prepare(std::slice::from_ref(&first), &[]);
        assert!(prepared[0].dims.is_empty(), "a family's first member is static");
        let second = lowered(60);
        let (prepared, members) = f.prepare(std::slice::from_ref(&second), &[]);
        assert!(!prepared[0].dims.is_empty(), "another size widens the family");
        assert!(members.into_iter().next().flatten().is_some());
    }
}
