//! Compilation glue: from a verified graph to a [`WgpuExecutable`]. The
//! fusion planner cuts the graph into kernels; each is lowered to WGSL
//! (in the form the autotuner picked where it tunes, size-independent
//! forms for a graph seen at other sizes), windowed for tensors beyond
//! one binding ([`crate::window`]), made generic over sizes where its
//! family has seen other sizes ([`crate::generic`]), and given a pipeline
//! ([`crate::pipeline`]). A plan with generic kernels whose sizes recur
//! gets static ones later, compiled off the step's path
//! (`Compiler::compile_static`, see [`crate::tier`]). A size variant
//! keeps the earlier executable's kernels whose nodes it did not change
//! (`WgpuExecutable::unchanged`). Each phase is
//! timed (`CompileFusion`, `CompileLower`, `CompileGeneric`,
//! `CompileBuild`). The compile-side caches (pipelines, the
//! autotuner's winners, size families) live here, apart from the device
//! context; which graph was compiled before at other sizes is the
//! executor's to remember (`CompileHints::earlier`).

use crate::autotune::{self, KeyCandidates, TuneJob, Tuner, Tuning, Waiting};
use crate::binds::BindCache;
use crate::codegen::{self, FixedSizes, LowerError, LowerLimits, MatmulForm, Schedule, Wgsl};
use crate::context::Context;
use crate::generic::{Families, Member, SizeChanges};
use crate::pipeline::{PipelineEntry, Pipelines, Prepared};
use crate::tier::Tier;
use crate::uniforms::Sections;
use crate::window::KernelWindows;
use lazuli_executor::platform::Instant;
use lazuli_executor::{metrics, BackendError, CompileHints, Executable, KernelInfo, LaunchCost};
use lazuli_ir::fusion::{self, FusionLimits, FusionPlan, Kernel};
use lazuli_ir::{Node, NodeId, Op, VerifiedGraph};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// The compile side of a backend: limits, forms and caches.
pub(crate) struct Compiler {
    /// What the fusion planner may do on this adapter.
    pub fusion: FusionLimits,
    /// What lowering may do: the kernel forms, workgroup memory.
    pub lower: LowerLimits,
    pub pipelines: Pipelines,
    /// Bounded autotuning of kernel forms.
    pub tuner: Tuner,
    /// Families of kernels generic over sizes.
    pub families: Families,
    /// Fault injection (tests): kernels whose name contains it compute a
    /// wrong value.
    fault_kernel: Option<String>,
}

impl Compiler {
    /// A compiler with these limits and caches.
    pub fn new(
        fusion: FusionLimits,
        lower: LowerLimits,
        pipelines: Pipelines,
        tuner: Tuner,
        families: Families,
        fault_kernel: Option<String>,
    ) -> Compiler {
        Compiler { fusion, lower, pipelines, tuner, families, fault_kernel }
    }

    /// Compiles `graph`; with `hints.sizes_vary` (and generic sizes on),
    /// every kernel with a size that differs from the executable compiled
    /// last at other sizes (`hints.earlier`) is lowered in forms that do
    /// not depend on the sizes that differ and compiled generic over all
    /// its sizes at once (see [`crate::generic`]); the others compile as
    /// static kernels, as the earlier executable did. That executable,
    /// when it compiled static, has its kernels observed by their
    /// families first.
    pub fn compile(
        &self,
        ctx: &Context,
        graph: &VerifiedGraph,
        hints: CompileHints<'_>,
    ) -> Result<WgpuExecutable, BackendError> {
        if let Some(n) = graph.nodes().iter().find(|n| n.op.is_collective()) {
            // The executor runs collectives in segments of their own.
            return Err(BackendError::Unsupported { backend: "wgpu".into(), op: n.op.name(), dtype: n.dtype });
        }
        let generic = hints.sizes_vary && self.families.enabled();
        let earlier = hints.earlier.and_then(|e| e.as_any().downcast_ref::<WgpuExecutable>());
        // What changed since the executable of this structure at other
        // sizes; where there is none, or it does not align node for node
        // (the optimizer removed a node at one of the sizes), each
        // kernel's forms are looked up by skeleton.
        let changes = earlier.filter(|_| generic).and_then(|e| SizeChanges::between(graph, &e.graph));
        // Kernels that merge only because their shapes are equal at these
        // sizes stay apart (see `fusion::plan_sized_like`).
        let planning = Instant::now();
        let plan =
            fusion::plan_sized_like(graph, &self.fusion, earlier.filter(|_| changes.is_some()).map(|e| &*e.graph));
        metrics::record_time("CompileFusion", planning.elapsed());
        let lowering = Instant::now();
        // The structure's first size variant: its static predecessor's
        // sources join their families first, and each kernel's forms are
        // remembered.
        let first_variant = generic && earlier.is_some_and(|e| !e.generic && *e.graph != **graph);
        if let (true, Some(earlier), Some(changes)) = (first_variant, earlier, &changes) {
            self.observe_sizes(ctx, earlier, changes);
        }
        // A size variant's generic kernels (of a graph that aligns with
        // the earlier one) lower on the compile threads at once: lowering
        // is a pure function of the kernel, and most of what a variant
        // costs. What each one's loop turn below would lower, in order.
        let mut generic_lowered: Vec<Option<Result<Wgsl, BackendError>>> = match &changes {
            Some(changes) => self.pipelines.workers().map(&plan.kernels, |k| {
                let fixed = changes.kernel(k, graph)?;
                Some(self.lower_kernel(ctx, k, graph, &LowerLimits { generic: true, fixed, ..self.lower }))
            }),
            None => Vec::new(),
        };
        // Kernels over nodes exactly as the earlier executable had them
        // keep its compiled kernels.
        let earlier_kernels = earlier.map(WgpuExecutable::current_kernels);
        let mut kept: Vec<Option<CompiledKernel>> = match (earlier, &earlier_kernels) {
            (Some(earlier), Some(kernels)) => {
                plan.kernels.iter().enumerate().map(|(i, k)| earlier.unchanged(i, k, graph, kernels)).collect()
            }
            _ => Vec::new(),
        };
        let mut lowered = Vec::with_capacity(plan.kernels.len());
        // Per kernel lowered, its index in the plan.
        let mut lowered_at = Vec::with_capacity(plan.kernels.len());
        let mut untuned = Vec::new();
        for (i, k) in plan.kernels.iter().enumerate() {
            let name = format!("k{i}_{:?}_{}", k.kind, graph.node(k.root()).op.name());
            let lower = |limits: &LowerLimits| self.lower_kernel(ctx, k, graph, limits);
            let varying = LowerLimits { generic: true, fixed: FixedSizes::NONE, ..self.lower };
            // `None`: a static kernel; else generic, keeping these sizes.
            let (fixed, lowered_varying) = match &changes {
                _ if !generic => (None, None),
                Some(changes) => {
                    let fixed = changes.kernel(k, graph);
                    if first_variant {
                        if let Ok(w) = lower(&varying) {
                            self.families.remember_forms(&w.source, w.entry, fixed);
                        }
                    }
                    (fixed, None)
                }
                None => {
                    let w = lower(&varying)?;
                    match self.families.forms(&w.source, w.entry) {
                        Some(fixed) => (fixed, None),
                        None => (Some(FixedSizes::NONE), Some(w)),
                    }
                }
            };
            if let Some(Some(kernel)) = kept.get(i) {
                self.check_kept(ctx, k, graph, kernel);
                metrics::inc("KernelsKept", 1);
                continue;
            }
            let wgsl = match (fixed, lowered_varying) {
                (Some(_), Some(w)) => w,
                // Tuning a form per size would defeat sharing it.
                (Some(fixed), None) => match generic_lowered.get_mut(i).and_then(Option::take) {
                    Some(wgsl) => wgsl?,
                    None => lower(&LowerLimits { generic: true, fixed, ..self.lower })?,
                },
                (None, _) => {
                    let (wgsl, pending) = self.lower_static(ctx, k, graph)?;
                    if pending {
                        untuned.push(i);
                    }
                    wgsl
                }
            };
            metrics::inc("KernelsLowered", 1);
            lowered.push(self.finish(ctx, k, graph, name, wgsl)?);
            lowered_at.push(i);
        }
        metrics::record_time("CompileLower", lowering.elapsed());
        // A size variant's kernels read their sizes against the earlier
        // variant's (see `Families::specialize`).
        let like: Vec<Option<&CompiledKernel>> = match earlier_kernels.as_deref() {
            Some(kernels) if generic => lowered_at.iter().map(|&i| kernels.get(i)).collect(),
            _ => Vec::new(),
        };
        let specializing = Instant::now();
        let (prepared, members) = self.prepare(&lowered, &like);
        metrics::record_time("CompileGeneric", specializing.elapsed());
        let building = Instant::now();
        let mut built = self.assemble(ctx, lowered, prepared, members, true)?.into_iter();
        metrics::record_time("CompileBuild", building.elapsed());
        let kernels = (0..plan.kernels.len())
            .map(|i| match kept.get_mut(i).and_then(Option::take) {
                Some(kernel) => kernel,
                None => built.next().expect("one compiled kernel per kernel lowered"),
            })
            .collect();
        Ok(WgpuExecutable::new(graph, plan, kernels, generic, untuned, ctx.uniform_align))
    }

    /// At a plan boundary, before an execution of `exe`, for its kernels
    /// waiting for the tuner (see [`crate::autotune`]): from its second
    /// execution on (a plan that repeats), returns the job compiling
    /// their candidates, which the caller runs off this thread; once
    /// compiled, times them here, keys within
    /// [`autotune::BOUNDARY_BUDGET`], and swaps each winner in. A failure
    /// to tune is a warning: the kernels keep their forms.
    pub fn tune_at_boundary(&self, ctx: &Context, exe: &WgpuExecutable) -> Option<TuneJob> {
        if exe.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0 {
            return None;
        }
        let mut waiting = exe.waiting.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *waiting {
            Waiting::Compiling | Waiting::Abandoned => None,
            Waiting::Ready(ready) => {
                self.time_ready(ctx, exe, ready);
                if ready.is_empty() {
                    *waiting = Waiting::Idle;
                }
                None
            }
            Waiting::Idle => {
                let untuned = exe.untuned.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if untuned.is_empty() {
                    return None;
                }
                if !self.tuner.budget_left() {
                    exe.untuned.lock().unwrap_or_else(|e| e.into_inner()).clear();
                    *waiting = Waiting::Abandoned;
                    return None;
                }
                drop(waiting);
                let current = exe.current_kernels();
                let kernels =
                    untuned.iter().map(|&i| (i, exe.plan.kernels[i].clone(), current[i].name.clone())).collect();
                Some(TuneJob::new(exe.graph.clone(), kernels, exe.waiting.clone()))
            }
        }
    }

    /// The candidates of `job`'s kernels compiled (their pipelines on
    /// threads of the job's own), grouped by tuning key; a key whose
    /// winner is known by now gets that form alone. `None` where
    /// `cancelled` turned true (checked before each kernel). Runs off the
    /// steps' path; its time counts against the tuner's process budget.
    pub(crate) fn compile_candidates(
        &self,
        ctx: &Context,
        job: &TuneJob,
        cancelled: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<VecDeque<KeyCandidates>>, BackendError> {
        let start = Instant::now();
        let graph = &job.graph;
        let mut keys: Vec<KeyCandidates> = Vec::new();
        // Per lowered candidate: its key's entry, its form's index there.
        let mut lowered = Vec::new();
        let mut places = Vec::new();
        for (i, k, name) in &job.kernels {
            if cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(None);
            }
            let lower = |limits: &LowerLimits| self.lower_kernel(ctx, k, graph, limits);
            // The rule's schedule keys the kernel and lists its
            // alternatives: nothing is lowered to learn either.
            let base = self.schedule_as_is(ctx, k, graph, &self.lower)?;
            let Some(problem) = base.tuning_key(k, graph) else { continue };
            let key = self.tuner.key(problem);
            let entry = match keys.iter().position(|c| c.key == key) {
                Some(e) => e,
                None => {
                    let (forms, known) = match self.tuner.known(key) {
                        Some(form) => (vec![form], true),
                        None => (autotune::candidate_forms(k, graph, &base), false),
                    };
                    let forms = forms.into_iter().map(|f| (f, Vec::new())).collect();
                    let rule = base.matmul_form().expect("a matmul schedule");
                    keys.push(KeyCandidates { key, rule, kernels: Vec::new(), forms, known });
                    keys.len() - 1
                }
            };
            keys[entry].kernels.push(*i);
            for f in 0..keys[entry].forms.len() {
                let form = keys[entry].forms[f].0;
                let wgsl = lower(&autotune::with_form(self.lower, form))?;
                lowered.push(self.finish(ctx, k, graph, name.clone(), wgsl)?);
                places.push((entry, f));
            }
        }
        // Static pipelines, as a first compile at these sizes makes them
        // (no size family), created in parallel on threads of this job's
        // own: the compile threads stay free for the steps' compiles.
        let prepared: Vec<Prepared> = lowered
            .iter()
            .flat_map(|l| l.passes().map(|(name, w, _)| Prepared::fixed(name, w)).collect::<Vec<_>>())
            .collect();
        let threads = (self.pipelines.workers().threads() / 2).max(1);
        std::thread::scope(|scope| {
            let parts: Vec<_> = prepared
                .chunks(prepared.len().div_ceil(threads).max(1))
                .map(|part| scope.spawn(move || self.pipelines.get_or_create(ctx, part, false)))
                .collect();
            parts.into_iter().try_for_each(|p| p.join().unwrap_or_else(|e| std::panic::resume_unwind(e)).map(drop))
        })?;
        // Every pipeline is made: this only assembles the kernels.
        let members = vec![None; prepared.len()].into_iter();
        let built = self.assemble(ctx, lowered, prepared, members, false)?;
        for (kernel, (entry, f)) in built.into_iter().zip(places) {
            keys[entry].forms[f].1.push(kernel);
        }
        let spent = start.elapsed();
        metrics::record_time("AutotuneCompile", spent);
        self.tuner.spend(spent);
        Ok(Some(keys.into()))
    }

    /// Times the first keys of `ready` (of `exe`) within
    /// [`autotune::BOUNDARY_BUDGET`] (at least one) and swaps each winner
    /// in where it is not the form the kernels run.
    fn time_ready(&self, ctx: &Context, exe: &WgpuExecutable, ready: &mut VecDeque<KeyCandidates>) {
        let start = Instant::now();
        let mut settled = false;
        while let Some(c) = ready.front() {
            if settled && start.elapsed() >= autotune::BOUNDARY_BUDGET {
                break;
            }
            let ki = c.kernels[0];
            let (k, graph) = (&exe.plan.kernels[ki], &exe.graph);
            let won = if c.known {
                Some(0)
            } else {
                if !settled {
                    // Nothing else runs while the candidates are timed: the
                    // execution that returned before finishing (see
                    // `Context::overlap`) ends first.
                    if let Err(e) = ctx.settle() {
                        tracing::warn!("autotuning postponed: {e}");
                        return;
                    }
                    settled = true;
                }
                let name = exe.current_kernels()[ki].name.clone();
                autotune::time_candidates(ctx, &self.tuner, (k, graph, &name), c)
            };
            let c = ready.pop_front().expect("a front key");
            exe.untuned.lock().unwrap_or_else(|e| e.into_inner()).retain(|i| !c.kernels.contains(i));
            let Some(w) = won else { continue };
            let (form, kernels) = c.forms.into_iter().nth(w).expect("the winner is a candidate");
            if form == c.rule {
                continue;
            }
            for (&ki, kernel) in c.kernels.iter().zip(kernels) {
                exe.replace_kernel(ki, kernel);
                metrics::inc("AutotuneSwaps", 1);
            }
        }
    }

    /// Kernels `kernels` (index in their plan, kernel, name) of `graph`
    /// compiled as static kernels, as a first compile at these sizes
    /// makes them (the tuner's known winner, else the rule's form; no
    /// size family), their pipelines created on the calling thread: the
    /// second tier of a plan generic over sizes (see [`crate::tier`]).
    /// Returns them by index, and the indices of those waiting for the
    /// tuner; `None` where `cancelled` turned true before the last one
    /// (checked before each kernel).
    pub fn compile_static(
        &self,
        ctx: &Context,
        graph: &VerifiedGraph,
        kernels: &[(usize, Kernel, String)],
        cancelled: &std::sync::atomic::AtomicBool,
    ) -> Result<Option<crate::tier::Compiled>, BackendError> {
        let _span = lazuli_executor::timeline::span("CompileStatic");
        let mut compiled = Vec::with_capacity(kernels.len());
        let mut untuned = Vec::new();
        for (i, k, name) in kernels {
            if cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                return Ok(None);
            }
            let (wgsl, pending) = self.lower_static(ctx, k, graph)?;
            if pending {
                untuned.push(*i);
            }
            let lowered = self.finish(ctx, k, graph, name.clone(), wgsl)?;
            let prepared: Vec<Prepared> = lowered.passes().map(|(name, w, _)| Prepared::fixed(name, w)).collect();
            let members = vec![None; prepared.len()].into_iter();
            let built = self.assemble(ctx, vec![lowered], prepared, members, false)?;
            compiled.extend(built.into_iter().map(|kernel| (*i, kernel)));
        }
        Ok(Some((compiled, untuned)))
    }

    /// Kernel `k` of `graph` lowered as a static kernel: in the tuner's
    /// known winner where it has one, else in the rule's form, and
    /// whether it waits for the tuner (a tunable kernel without a
    /// winner; nothing is timed here). The tuner's key is the schedule's
    /// problem: the kernel is lowered once, in the form it runs.
    fn lower_static(&self, ctx: &Context, k: &Kernel, graph: &VerifiedGraph) -> Result<(Wgsl, bool), BackendError> {
        let base = self.schedule_as_is(ctx, k, graph, &self.lower)?;
        let (schedule, pending) = match autotune::lookup(ctx, &self.tuner, k, graph, &base) {
            Tuning::Known(form) => (self.schedule(ctx, k, graph, &autotune::with_form(self.lower, form))?, false),
            Tuning::Pending => (self.fit_bindings(ctx, k, graph, base)?, true),
            Tuning::Untuned => (self.fit_bindings(ctx, k, graph, base)?, false),
        };
        Ok((self.lower_scheduled(ctx, k, graph, &schedule)?, pending))
    }

    /// Kernel `k` lowered as `wgsl`, finished for pipeline creation:
    /// windowed for tensors beyond one binding, fault-injected where a
    /// test asks for it, and with its launches' costs (see
    /// [`crate::cost`]).
    fn finish(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        name: String,
        mut wgsl: Wgsl,
    ) -> Result<Lowered, BackendError> {
        let windows = self.window(ctx, k, graph, &name, &wgsl)?;
        let faulty = self.fault_kernel.as_deref().is_some_and(|f| name.contains(f));
        if faulty {
            wgsl.source = crate::fault::perturb(&wgsl.source);
            // Trust was proven for the source as lowered: a rewritten one
            // keeps its runtime checks (windowed sources never had trust,
            // see `codegen::Schedule::trusted`).
            wgsl.trusted = false;
            if let Some(p) = wgsl.pre.as_deref_mut() {
                p.trusted = false;
            }
        }
        let (pre_cost, cost) = crate::cost::launches(k, graph, &name, &wgsl);
        Ok(Lowered { name, wgsl, windows, pre_cost, cost })
    }

    /// Debug builds: a kept kernel (see [`WgpuExecutable::unchanged`]) is
    /// what lowering kernel `k` again would make, source for source.
    fn check_kept(&self, ctx: &Context, k: &Kernel, graph: &VerifiedGraph, kept: &CompiledKernel) {
        if cfg!(debug_assertions) {
            let again = self
                .lower_static(ctx, k, graph)
                .and_then(|(wgsl, _)| self.finish(ctx, k, graph, kept.name.clone(), wgsl));
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

    /// Compiled kernels for finished sources, after
    /// [`Compiler::prepare`]: the pipelines of `prepared` (created where
    /// missing, on the compile threads where `parallel`) and the size bind
    /// groups of its generic kernels, joined with `lowered` and `members`
    /// into kernels.
    fn assemble(
        &self,
        ctx: &Context,
        lowered: Vec<Lowered>,
        prepared: Vec<Prepared>,
        mut members: std::vec::IntoIter<Option<Arc<Member>>>,
        parallel: bool,
    ) -> Result<Vec<CompiledKernel>, BackendError> {
        let pipelines = self.pipelines.get_or_create(ctx, &prepared, parallel)?;
        let generic: Vec<(&wgpu::BindGroupLayout, &[u32])> = prepared
            .iter()
            .zip(&pipelines)
            .filter_map(|(p, pipeline)| Some((pipeline.dims_layout.as_ref()?, p.dims.as_slice())))
            .collect();
        let mut dims = ctx.dims_groups(&generic).into_iter();
        let mut compiled = pipelines.into_iter().map(|pipeline| {
            let dims = pipeline.dims_layout.is_some().then(|| dims.next().expect("one group per generic kernel"));
            (pipeline, dims)
        });
        let mut kernels = Vec::with_capacity(lowered.len());
        for Lowered { name, wgsl, windows, pre_cost, cost } in lowered {
            let (pipeline, dims) = compiled.next().expect("one pipeline per prepared kernel");
            let member = members.next().flatten();
            let pre = if wgsl.pre.is_some() { compiled.next() } else { None };
            let pre_member = if wgsl.pre.is_some() { members.next().flatten() } else { None };
            kernels.push(CompiledKernel {
                name,
                wgsl,
                pipeline,
                dims,
                pre,
                windows,
                pre_cost,
                cost,
                members: [member, pre_member],
            });
        }
        Ok(kernels)
    }

    /// Each lowered source (and first pass) ready for pipeline creation:
    /// generic over sizes where its family has seen other sizes; with
    /// each one's member of its family, if generic. `like`: per kernel of
    /// `lowered`, the same kernel of the structure compiled at other sizes
    /// (a size variant's predecessor), if any; empty where there is none.
    fn prepare(
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

    /// Kernel `k` of `graph` as WGSL with `limits` (its schedule, see
    /// [`Compiler::schedule`], then the text); lowering errors become the
    /// backend's typed errors.
    fn lower_kernel(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        limits: &LowerLimits,
    ) -> Result<Wgsl, BackendError> {
        let schedule = self.schedule(ctx, k, graph, limits)?;
        self.lower_scheduled(ctx, k, graph, &schedule)
    }

    /// The schedule of kernel `k` of `graph` under `limits` (see
    /// [`codegen::schedule`]), fitted to the adapter's bindings (see
    /// [`Compiler::fit_bindings`]).
    fn schedule(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        limits: &LowerLimits,
    ) -> Result<Schedule, BackendError> {
        let schedule = self.schedule_as_is(ctx, k, graph, limits)?;
        self.fit_bindings(ctx, k, graph, schedule)
    }

    /// The schedule of kernel `k` of `graph` under `limits`, as the
    /// limits give it.
    fn schedule_as_is(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        limits: &LowerLimits,
    ) -> Result<Schedule, BackendError> {
        codegen::schedule(k, graph, limits).map_err(|e| lower_error(ctx, limits, e))
    }

    /// `schedule` of kernel `k`, or, where it is a split-K product whose
    /// second pass binds the scratch besides the kernel's inputs and
    /// outputs and that (windowed) is more than a kernel may bind, the
    /// product in one pass: decided from the schedule's bindings, before
    /// anything is lowered.
    fn fit_bindings(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        schedule: Schedule,
    ) -> Result<Schedule, BackendError> {
        if schedule.passes.binds_inputs()
            && KernelWindows::scheduled(k, graph, schedule.passes, &ctx.windows).bindings()
                > self.fusion.max_storage_buffers
        {
            if let Some(MatmulForm::SplitK { tile, .. }) = schedule.matmul_form() {
                return self.schedule_as_is(
                    ctx,
                    k,
                    graph,
                    &autotune::with_form(schedule.limits, MatmulForm::Tiled(tile)),
                );
            }
        }
        Ok(schedule)
    }

    /// Kernel `k` of `graph` written from its schedule; lowering errors
    /// become the backend's typed errors.
    fn lower_scheduled(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        schedule: &Schedule,
    ) -> Result<Wgsl, BackendError> {
        codegen::lower_scheduled(k, graph, schedule).map_err(|e| lower_error(ctx, &schedule.limits, e))
    }

    /// Lowers the kernels of `earlier` (the executable of the structure
    /// about to compile, at other sizes, whose fusion plan is reused) in
    /// the forms the new size takes (independent of the sizes that differ,
    /// `changes`) and records their sources in their
    /// families without compiling them (`Families::observe`):
    /// the new size's kernels then turn every literal that differs between
    /// the two sizes dynamic in one widening, rather than compiling as
    /// static first members of new families and widening at the next size.
    /// A kernel that does not lower, or whose tensors need windows, is
    /// skipped; the real compile reports its own errors.
    fn observe_sizes(&self, ctx: &Context, earlier: &WgpuExecutable, changes: &SizeChanges) {
        let graph = &earlier.graph;
        for k in &earlier.plan.kernels {
            // Kernels whose sizes stay compile static, as they did.
            let Some(fixed) = changes.kernel(k, graph) else { continue };
            let limits = LowerLimits { generic: true, fixed, ..self.lower };
            let Ok(schedule) = self.schedule(ctx, k, graph, &limits) else { continue };
            if KernelWindows::scheduled(k, graph, schedule.passes, &ctx.windows).is_windowed() {
                continue; // its source would be rewritten; leave it static
            }
            let Ok(wgsl) = self.lower_scheduled(ctx, k, graph, &schedule) else { continue };
            self.families.observe(&wgsl.source, wgsl.entry);
            if let Some(pre) = &wgsl.pre {
                self.families.observe(&pre.source, pre.entry);
            }
        }
    }

    /// The windows of kernel `k` (named `name`), lowered as `wgsl`, for
    /// its tensors beyond one binding (see [`crate::window`]; lowering
    /// wrote their accesses, see [`codegen::access`]). A kernel needing
    /// more storage bindings than the adapter allows is
    /// `BackendError::TooLarge` naming its op, its bytes and the limit.
    fn window(
        &self,
        ctx: &Context,
        k: &Kernel,
        graph: &VerifiedGraph,
        name: &str,
        wgsl: &Wgsl,
    ) -> Result<KernelWindows, BackendError> {
        let w = ctx.windows;
        let kw = KernelWindows::of(k, graph, wgsl, &w);
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

    /// Whether `node` (with operands `inputs`) can run as a kernel on
    /// this adapter (see `Backend::supports`).
    pub fn supports(&self, ctx: &Context, node: &Node, inputs: &[&Node]) -> bool {
        // An attention part binds all its operands but the cheap leaves;
        // one that needs more buffers than a kernel may bind (a masked
        // gradient on an adapter with WebGPU's minimum of 8) cannot be
        // split, so it runs on the fallback. Counted without windows: a
        // tensor's size never sends a node elsewhere, and a part whose
        // windows exceed the limit is `BackendError::TooLarge` at compile
        // time like any kernel's (see `Compiler::window`).
        let fits = !matches!(node.op, Op::Attention { .. })
            || inputs
                .iter()
                .filter(|n| !matches!(n.op, Op::Constant(..) | Op::ScalarParam(_) | Op::Iota { .. }))
                .count()
                < self.fusion.max_storage_buffers;
        // f16 and bf16 operands only for the ops proven on them, and only
        // within one storage binding (windows address 32-bit elements).
        let halves_ok = || {
            let halves = || std::iter::once(node).chain(inputs.iter().copied()).filter(|n| codegen::is_half(n.dtype));
            halves().next().is_none()
                || (codegen::half_op_supported(&node.op)
                    && halves().all(|n| n.shape.numel() as u64 <= ctx.windows.elements()))
        };
        self.within_loop_budget(ctx, node, inputs)
            && fits
            && codegen::node_supported(node)
            && inputs.iter().all(|n| codegen::dtype_supported(n.dtype))
            && halves_ok()
    }

    /// On a software adapter that silently caps loop iterations, kernels
    /// that walk one line per invocation would return wrong values for
    /// lines longer than the cap: such nodes run on the CPU fallback.
    fn within_loop_budget(&self, ctx: &Context, node: &Node, inputs: &[&Node]) -> bool {
        let Some(budget) = ctx.loop_budget else { return true };
        let forms = &self.lower.forms;
        let along = |axis: usize| inputs.first().map_or(0, |x| x.shape.dims()[axis] as u64);
        match &node.op {
            Op::ArgReduce { axis, .. } | Op::CumSum { axis, .. } | Op::Softmax { axis, .. } => along(*axis) <= budget,
            Op::MatMul => inputs.first().and_then(|a| a.shape.dims().last()).is_none_or(|&k| k as u64 <= budget),
            Op::ScatterAdd { axis } => {
                let m = inputs.get(1).map_or(0, |i| i.shape.numel() as u64);
                let inner = node.shape.dims()[axis + 1..].iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
                codegen::index::scatter_loop_iterations(forms.scatter, m, inner) <= budget
            }
            Op::Pool(p) => codegen::pool::pool_loop_iterations(p, false) <= budget,
            Op::PoolGrad(p) => codegen::pool::pool_loop_iterations(p, true) <= budget,
            Op::Conv2d(_) => {
                inputs.get(1).is_none_or(|w| codegen::conv::loop_iterations(forms.conv, node, w) <= budget)
            }
            Op::Attention { .. } => codegen::attention::within_loop_budget(node, inputs, forms.attention, budget),
            _ => true,
        }
    }
}

/// A lowering error as the backend's typed error (`limits`: those the
/// kernel was lowered under).
fn lower_error(ctx: &Context, limits: &LowerLimits, e: LowerError) -> BackendError {
    match e {
        LowerError::Unsupported { op, dtype } => BackendError::Unsupported { backend: ctx.name.clone(), op, dtype },
        LowerError::TooLarge { op, elements } => BackendError::TooLarge {
            op,
            bytes: elements.saturating_mul(4),
            limit: limits.max_elements * 4,
            limit_name: "what kernels index with u32 element indices".into(),
        },
    }
}

/// A compiled plan: the graph, its kernels and their pipelines.
pub struct WgpuExecutable {
    pub(crate) graph: VerifiedGraph,
    pub(crate) plan: FusionPlan,
    /// The compiled kernels, one per kernel of `plan`, and the sections
    /// of the uniform their launches bind (a function of the kernels,
    /// kept with them so that no execution computes it again); a kernel
    /// the tuner replaces is swapped between executions (see
    /// [`Compiler::tune_at_boundary`]).
    kernels: std::sync::RwLock<(Arc<[CompiledKernel]>, Arc<Sections>)>,
    /// The adapter's `min_uniform_buffer_offset_alignment` (see
    /// [`crate::uniforms`]).
    uniform_align: u64,
    /// Kernels still waiting for the tuner (indices into `kernels`).
    untuned: Mutex<Vec<usize>>,
    /// Where their candidates stand (see [`crate::autotune`]).
    waiting: Arc<Mutex<Waiting>>,
    /// Executions started.
    runs: std::sync::atomic::AtomicU64,
    /// The buffers of an execution, in order: parameters, then every
    /// materialized node.
    pub(crate) buffers: Vec<Bound>,
    /// Per node, its index in `buffers` (`u32::MAX`: none).
    pub(crate) slot: Vec<u32>,
    /// Bind groups and buffer history, reused across executions.
    pub(crate) binds: Mutex<BindCache>,
    /// Compiled generic over sizes (a size variant's kernels).
    pub(crate) generic: bool,
    /// Where its generic kernels stand on their way to static ones (see
    /// [`crate::tier`]).
    pub(crate) tier: Arc<Mutex<Tier>>,
    /// Which outputs were read, and by which execution: the executions
    /// after copy them early (see [`crate::transfer::early_copies`]).
    pub(crate) outputs_read: Arc<crate::transfer::OutputsRead>,
}

/// `kernels` with the sections of the uniform their launches bind, at
/// offsets aligned to `align` bytes.
fn with_sections(kernels: Arc<[CompiledKernel]>, align: u64) -> (Arc<[CompiledKernel]>, Arc<Sections>) {
    let sections = Arc::new(Sections::of(kernels.iter().map(|k| &k.wgsl), align));
    (kernels, sections)
}

/// Where a buffer of an execution comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Bound {
    /// Input (graph parameter) `i`.
    Input(usize),
    /// A node the plan materializes, in a buffer from the pool.
    Node(NodeId),
}

/// A kernel lowered and finished, before its pipelines exist.
pub(crate) struct Lowered {
    name: String,
    wgsl: Wgsl,
    windows: KernelWindows,
    /// The cost of the first pass, if any (see [`crate::cost`]).
    pre_cost: Option<LaunchCost>,
    /// The cost of the kernel proper.
    cost: LaunchCost,
}

impl Lowered {
    /// What gets a pipeline, in the order [`Compiler::assemble`] takes:
    /// the kernel (pass 0), then its first pass where it has one (pass 1,
    /// named `<kernel>_pass1`).
    fn passes(&self) -> impl Iterator<Item = (String, &Wgsl, usize)> {
        let pre = self.wgsl.pre.as_deref().map(|p| (format!("{}_pass1", self.name), p, 1));
        std::iter::once((self.name.clone(), &self.wgsl, 0)).chain(pre)
    }
}

/// A kernel of a compiled plan.
#[derive(Clone)]
pub(crate) struct CompiledKernel {
    pub name: String,
    pub wgsl: Wgsl,
    pub pipeline: Arc<PipelineEntry>,
    /// Bind group 1 of a generic pipeline: this kernel's sizes.
    pub dims: Option<wgpu::BindGroup>,
    /// The pipeline of `wgsl.pre`, the first pass, if any, and its sizes.
    pub pre: Option<(Arc<PipelineEntry>, Option<wgpu::BindGroup>)>,
    /// Windows of each storage buffer of both passes (see
    /// [`crate::window`]).
    pub windows: KernelWindows,
    /// The cost of one launch of the first pass, if any (see
    /// [`crate::cost`]), computed at compile time.
    pub pre_cost: Option<LaunchCost>,
    /// The cost of one launch of the kernel proper.
    pub cost: LaunchCost,
    /// The kernel's and its first pass's members of their size families,
    /// where generic: the next size variant reads its sizes against them.
    pub members: [Option<Arc<Member>>; 2],
}

impl CompiledKernel {
    /// Dispatches one execution makes of it: none where it has no
    /// invocations, two for a two-pass kernel, else one.
    pub(crate) fn launches(&self) -> u64 {
        match (self.wgsl.invocations, &self.wgsl.pre, &self.pre) {
            (0, _, _) => 0,
            (_, Some(_), Some(_)) => 2,
            _ => 1,
        }
    }

    /// Whether it (or its first pass) reads its sizes from a buffer.
    pub(crate) fn is_generic(&self) -> bool {
        self.dims.is_some() || self.pre.as_ref().is_some_and(|(_, dims)| dims.is_some())
    }
}

impl WgpuExecutable {
    /// The plan of `graph` with its compiled `kernels`: the buffers of an
    /// execution are the parameters, then each node the plan materializes.
    fn new(
        graph: &VerifiedGraph,
        plan: FusionPlan,
        kernels: Vec<CompiledKernel>,
        generic: bool,
        untuned: Vec<usize>,
        uniform_align: u64,
    ) -> WgpuExecutable {
        let mut buffers = Vec::new();
        let mut slot = vec![u32::MAX; graph.len()];
        for id in graph.ids() {
            if let Op::Parameter(i) = graph.node(id).op {
                slot[id.index()] = buffers.len() as u32;
                buffers.push(Bound::Input(i as usize));
            }
        }
        for &m in &plan.materialized {
            if slot[m.index()] == u32::MAX {
                slot[m.index()] = buffers.len() as u32;
                buffers.push(Bound::Node(m));
            }
        }
        let binds = Mutex::new(BindCache::default());
        let tier = if kernels.iter().any(CompiledKernel::is_generic) { Tier::Generic } else { Tier::Settled };
        WgpuExecutable {
            graph: graph.clone(),
            plan,
            kernels: std::sync::RwLock::new(with_sections(kernels.into(), uniform_align)),
            uniform_align,
            untuned: Mutex::new(untuned),
            waiting: Default::default(),
            runs: Default::default(),
            buffers,
            slot,
            binds,
            generic,
            tier: Arc::new(Mutex::new(tier)),
            outputs_read: Arc::new(crate::transfer::OutputsRead::new(graph.outputs.len())),
        }
    }

    /// Kernel `i` of a plan of `graph`, `k`, as this executable compiled
    /// it (`kernels`: its kernels now), where nothing its lowering reads
    /// differs: this executable's kernel `i` is `k`, over nodes equal in
    /// op, attributes, type and operands (the graphs align node for node),
    /// lowered in static forms, compiled static and not waiting for the
    /// tuner. Lowering is a pure function of those nodes and the limits,
    /// so the kernel is what lowering `k` statically again would make (or
    /// the tuner's winner for it). A kernel in generic forms whose sizes
    /// stayed is lowered again, static, as before. A size variant keeps
    /// such kernels (the optimizer's update of a partial last batch, the
    /// layers a change of sizes does not reach), lowering and looking up
    /// nothing for them (`KernelsKept`) but, in a structure's first size
    /// variant, the record of their forms every kernel gets.
    fn unchanged(
        &self,
        i: usize,
        k: &Kernel,
        graph: &VerifiedGraph,
        kernels: &[CompiledKernel],
    ) -> Option<CompiledKernel> {
        let kernel = kernels.get(i).filter(|kernel| !kernel.is_generic() && !kernel.wgsl.generic_form)?;
        let same_nodes = || {
            graph.len() == self.graph.len()
                && k.inputs.iter().chain(&k.inline).chain(&k.outputs).all(|&id| graph.node(id) == self.graph.node(id))
        };
        let waiting = || self.untuned.lock().unwrap_or_else(|e| e.into_inner()).contains(&i);
        (self.plan.kernels.get(i) == Some(k) && same_nodes() && !waiting()).then(|| kernel.clone())
    }

    /// The compiled kernels as they are now (an execution holds on to
    /// them, so a kernel replaced meanwhile takes effect at the next one).
    pub(crate) fn current_kernels(&self) -> Arc<[CompiledKernel]> {
        self.current().0
    }

    /// The compiled kernels as they are now, with their uniform's
    /// sections.
    pub(crate) fn current(&self) -> (Arc<[CompiledKernel]>, Arc<Sections>) {
        self.kernels.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Queues kernels `indices` for the tuner (measured at the plan
    /// boundaries that follow, see [`Compiler::tune_at_boundary`]).
    pub(crate) fn await_tuning(&self, indices: &[usize]) {
        self.untuned.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(indices);
    }

    /// Executions started.
    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Replaces kernel `ki` (a tuned form, or a static kernel for a
    /// generic one, see [`crate::tier`]), dropping the bind groups made
    /// for the old one's layout.
    pub(crate) fn replace_kernel(&self, ki: usize, kernel: CompiledKernel) {
        let mut guard = self.kernels.write().unwrap_or_else(|e| e.into_inner());
        let mut kernels = guard.0.to_vec();
        kernels[ki] = kernel;
        *guard = with_sections(kernels.into(), self.uniform_align);
        let mut binds = self.binds.lock().unwrap_or_else(|e| e.into_inner());
        binds.forget_launch(2 * ki);
        binds.forget_launch(2 * ki + 1);
    }

    /// The fusion plan.
    pub fn plan(&self) -> &FusionPlan {
        &self.plan
    }
}

impl Executable for WgpuExecutable {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn kernel_count(&self) -> usize {
        self.current_kernels().iter().filter(|k| k.wgsl.invocations > 0).count()
    }
    fn kernel_sources(&self) -> Vec<(String, String)> {
        let mut v = Vec::new();
        for k in self.current_kernels().iter() {
            if let Some(p) = &k.wgsl.pre {
                v.push((format!("{}_pass1", k.name), p.source.clone()));
            }
            v.push((k.name.clone(), k.wgsl.source.clone()));
        }
        v
    }
    fn kernels(&self) -> Vec<KernelInfo> {
        self.current_kernels()
            .iter()
            .zip(&self.plan.kernels)
            .map(|(c, k)| {
                let mut nodes: Vec<NodeId> = k.inline.iter().chain(&k.outputs).copied().collect();
                nodes.sort();
                nodes.dedup();
                KernelInfo { name: c.name.clone(), source: c.wgsl.source.clone(), nodes, outputs: k.outputs.clone() }
            })
            .collect()
    }
    fn launch_costs(&self) -> Vec<LaunchCost> {
        let mut v = Vec::new();
        // The launches `execute` makes: none for a kernel without
        // invocations, a first pass before its kernel.
        for k in self.current_kernels().iter().filter(|k| k.wgsl.invocations > 0) {
            v.extend(k.pre_cost.clone());
            v.push(k.cost.clone());
        }
        v
    }
}
