//! Compilation: from a verified graph to a [`WgpuExecutable`], as named
//! stages, and the background upgrades of a compiled plan.
//!
//! `Compiler::compile` runs the stages in order: the plan (the fusion
//! planner cuts the graph into kernels), each kernel's mode (kept from
//! the structure's earlier compile at other sizes, static, or generic
//! over the sizes that vary), its schedule (the tuner's known winner,
//! looked up by the schedule's problem; the split-K binding check), its
//! text, the finishing touches (windows' binding check, test fault
//! injection, costs) and its size family ([`crate::rewrite::size_families`]): the
//! device-free stages of `crate::compile::stages`; then the build, the pipelines
//! ([`crate::compile::pipeline`]). Each phase is timed (`CompileFusion`,
//! `CompileLower`, `CompileGeneric`, `CompileBuild`).
//!
//! After a plan compiled, two upgrades replace some of its kernels between
//! executions, both through the one mechanism of `crate::compile::upgrade`: the
//! tuner's candidates (`Compiler::tune_at_boundary`,
//! `Compiler::compile_candidates`, see [`crate::compile::autotune`]) and the
//! second tier's static kernels (`Compiler::compile_static`, see
//! [`crate::compile::specialize`]). The compile-side caches (pipelines, the autotuner's
//! winners, size families) live here, apart from the device context;
//! which graph was compiled before at other sizes is the executor's to
//! remember (`CompileHints::earlier`).

pub mod autotune;
pub(crate) mod cost;
pub mod diskcache;
pub mod executable;
pub mod pipeline;
pub mod specialize;
pub(crate) mod stages;
pub(crate) mod threads;
pub(crate) mod upgrade;
pub mod validate;

use crate::codegen;
use crate::compile::executable::{Candidates, CompiledKernel, Recompile, StaticKernels, WgpuExecutable};
use crate::compile::pipeline::{Pipelines, Prepared};
use crate::compile::stages::{kernel_name, Lowered, Mode, Stages, Variant};
use crate::compile::upgrade::{Adopted, Due};
use crate::device::context::Context;
use crate::rewrite::size_families::Member;
use autotune::TuneJob;
use lazuli_executor::platform::Instant;
use lazuli_executor::{metrics, BackendError, CompileHints};
use lazuli_ir::{DType, Node, Op, VerifiedGraph};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The compile side of a backend: the device-free stages with their
/// limits and caches ([`Stages`]), and the pipelines.
pub(crate) struct Compiler {
    /// The stages that need no device.
    pub stages: Stages,
    /// Pipeline creation and its caches.
    pub pipelines: Pipelines,
}

impl Compiler {
    /// Compiles `graph`; with `hints.sizes_vary` (and generic sizes on),
    /// every kernel with a size that differs from the executable compiled
    /// last at other sizes (`hints.earlier`) is lowered in forms that do
    /// not depend on the sizes that differ and compiled generic over all
    /// its sizes at once (see [`crate::rewrite::size_families`]); the others compile as
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
        let stages = &self.stages;
        let earlier = hints.earlier.and_then(|e| e.as_any().downcast_ref::<WgpuExecutable>());
        let variant = Variant::of(graph, hints.sizes_vary, stages.families.enabled(), earlier);
        // Plan.
        let planning = Instant::now();
        let plan = stages.plan(graph, &variant);
        metrics::record_time("CompileFusion", planning.elapsed());
        let lowering = Instant::now();
        if let (true, Some(earlier), Some(changes)) = (variant.first, earlier, &variant.changes) {
            stages.observe_sizes(&earlier.graph, &earlier.plan, changes);
        }
        // Each kernel's mode: kernels over nodes exactly as the earlier
        // executable had them keep its compiled kernels.
        let earlier_kernels = earlier.map(WgpuExecutable::current_kernels);
        let kept: Vec<Option<CompiledKernel>> = match (earlier, &earlier_kernels) {
            (Some(earlier), Some(kernels)) => {
                plan.kernels.iter().enumerate().map(|(i, k)| earlier.unchanged(i, k, graph, kernels)).collect()
            }
            _ => Vec::new(),
        };
        let mut modes = stages.modes(graph, &plan, &variant, kept)?;
        // Schedule and lower.
        let texts = stages.lower_kernels(graph, &plan, &mut modes, &variant)?;
        let mut kept: Vec<Option<CompiledKernel>> =
            modes.into_iter().map(|m| if let Mode::Kept(k) = m { Some(*k) } else { None }).collect();
        // Finish: windows, fault injection, costs.
        let mut lowered = Vec::with_capacity(plan.kernels.len());
        // Per kernel lowered, its index in the plan.
        let mut lowered_at = Vec::with_capacity(plan.kernels.len());
        let mut untuned = Vec::new();
        for (i, (k, text)) in plan.kernels.iter().zip(texts).enumerate() {
            let Some((wgsl, pending)) = text else { continue };
            if pending {
                untuned.push(i);
            }
            lowered.push(stages.finish(k, graph, kernel_name(i, k, graph), wgsl)?);
            lowered_at.push(i);
        }
        metrics::record_time("CompileLower", lowering.elapsed());
        // Size families: a size variant's kernels read their sizes against
        // the earlier variant's (see `Families::specialize`).
        let like: Vec<Option<&CompiledKernel>> = match earlier_kernels.as_deref() {
            Some(kernels) if variant.generic => lowered_at.iter().map(|&i| kernels.get(i)).collect(),
            _ => Vec::new(),
        };
        let specializing = Instant::now();
        let (prepared, members) = stages.prepare(&lowered, &like);
        metrics::record_time("CompileGeneric", specializing.elapsed());
        // Build.
        let building = Instant::now();
        let mut built = self.assemble(ctx, lowered, prepared, members, true)?.into_iter();
        metrics::record_time("CompileBuild", building.elapsed());
        let kernels = (0..plan.kernels.len())
            .map(|i| match kept.get_mut(i).and_then(Option::take) {
                Some(kernel) => kernel,
                None => built.next().expect("one compiled kernel per kernel lowered"),
            })
            .collect();
        Ok(WgpuExecutable::new(graph, plan, kernels, variant.generic, untuned, ctx.uniform_align))
    }

    /// Compiled kernels for finished sources, after
    /// [`Stages::prepare`]: the pipelines of `prepared` (created where
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

    /// At a plan boundary, before an execution of `exe`, for its kernels
    /// waiting for the tuner (see [`crate::compile::autotune`]): from its second
    /// execution on (a plan that repeats), returns the job compiling
    /// their candidates, which the caller runs off this thread; once
    /// compiled, times them here, keys within
    /// [`autotune::BOUNDARY_BUDGET`], and swaps each winner in. A failure
    /// to tune is a warning: the kernels keep their forms.
    pub fn tune_at_boundary(&self, ctx: &Context, exe: &WgpuExecutable) -> Option<TuneJob> {
        if exe.start_run() == 0 {
            return None;
        }
        exe.tuning.at_boundary(
            |ready| self.time_ready(ctx, exe, ready),
            || {
                let untuned = exe.untuned().clone();
                if untuned.is_empty() {
                    return Due::NotYet;
                }
                if !self.stages.tuner.budget_left() {
                    exe.untuned().clear();
                    return Due::Never;
                }
                Due::Start(exe.recompile(untuned))
            },
        )
    }

    /// The candidates of `job`'s kernels compiled (their pipelines on
    /// threads of the job's own), grouped by tuning key; a key whose
    /// winner is known by now gets that form alone. `None` where
    /// `cancelled` turned true (checked before each kernel). Runs off the
    /// steps' path; its time counts against the tuner's process budget.
    pub(crate) fn compile_candidates(
        &self,
        ctx: &Context,
        job: &Recompile,
        cancelled: &AtomicBool,
    ) -> Result<Option<VecDeque<Candidates>>, BackendError> {
        let stages = &self.stages;
        let start = Instant::now();
        let graph = &job.graph;
        let mut keys: Vec<Candidates> = Vec::new();
        // Per lowered candidate: its key's entry, its form's index there.
        let mut lowered = Vec::new();
        let mut places = Vec::new();
        for (i, k, name) in &job.kernels {
            if cancelled.load(Ordering::Relaxed) {
                return Ok(None);
            }
            // The rule's schedule keys the kernel and lists its
            // alternatives: nothing is lowered to learn either.
            let base = stages.schedule_as_is(k, graph, &stages.lower)?;
            let Some(problem) = base.tuning_key(k, graph) else { continue };
            let key = stages.tuner.key(problem);
            let entry = match keys.iter().position(|c| c.key == key) {
                Some(e) => e,
                None => {
                    let (forms, known) = match stages.tuner.known(key) {
                        Some(form) => (vec![form], true),
                        None => (autotune::candidate_forms(k, graph, &base), false),
                    };
                    let forms = forms.into_iter().map(|f| (f, Vec::new())).collect();
                    let rule = base.matmul_form().expect("a matmul schedule");
                    keys.push(Candidates { key, rule, kernels: Vec::new(), forms, known });
                    keys.len() - 1
                }
            };
            keys[entry].kernels.push(*i);
            for f in 0..keys[entry].forms.len() {
                let form = keys[entry].forms[f].0;
                let wgsl = stages.lower_kernel(k, graph, &autotune::with_form(stages.lower, form))?;
                lowered.push(stages.finish(k, graph, name.clone(), wgsl)?);
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
        let threads = (stages.workers.threads() / 2).max(1);
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
        stages.tuner.spend(spent);
        Ok(Some(keys.into()))
    }

    /// Times the first keys of `ready` (of `exe`) within
    /// [`autotune::BOUNDARY_BUDGET`] (at least one) and swaps each winner
    /// in where it is not the form the kernels run; all of `ready` is
    /// adopted once every key is timed.
    fn time_ready(&self, ctx: &Context, exe: &WgpuExecutable, ready: &mut VecDeque<Candidates>) -> Adopted {
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
                        return Adopted::Part;
                    }
                    settled = true;
                }
                let name = exe.current_kernels()[ki].name.clone();
                autotune::time_candidates(ctx, &self.stages.tuner, (k, graph, &name), c)
            };
            let c = ready.pop_front().expect("a front key");
            exe.untuned().retain(|i| !c.kernels.contains(i));
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
        if ready.is_empty() {
            Adopted::All
        } else {
            Adopted::Part
        }
    }

    /// The kernels of `job` compiled as static kernels, as a first compile
    /// at these sizes makes them (the tuner's known winner, else the
    /// rule's form; no size family), their pipelines created on the
    /// calling thread: the second tier of a plan generic over sizes (see
    /// [`crate::compile::specialize`]). Returns them by index, and the indices of those
    /// waiting for the tuner; `None` where `cancelled` turned true before
    /// the last one (checked before each kernel).
    pub fn compile_static(
        &self,
        ctx: &Context,
        job: &Recompile,
        cancelled: &AtomicBool,
    ) -> Result<Option<StaticKernels>, BackendError> {
        let _span = lazuli_executor::timeline::span("CompileStatic");
        let stages = &self.stages;
        let mut compiled = StaticKernels::none();
        for (i, k, name) in &job.kernels {
            if cancelled.load(Ordering::Relaxed) {
                return Ok(None);
            }
            let (wgsl, pending) = stages.lower_static(k, &job.graph)?;
            if pending {
                compiled.untuned.push(*i);
            }
            let lowered = stages.finish(k, &job.graph, name.clone(), wgsl)?;
            let prepared: Vec<Prepared> = lowered.passes().map(|(name, w, _)| Prepared::fixed(name, w)).collect();
            let members = vec![None; prepared.len()].into_iter();
            let built = self.assemble(ctx, vec![lowered], prepared, members, false)?;
            compiled.kernels.extend(built.into_iter().map(|kernel| (*i, kernel)));
        }
        Ok(Some(compiled))
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
        // time like any kernel's (see `Stages::finish`).
        let fits = !matches!(node.op, Op::Attention { .. })
            || inputs
                .iter()
                .filter(|n| !matches!(n.op, Op::Constant(..) | Op::ScalarParam(_) | Op::Iota { .. }))
                .count()
                < self.stages.fusion.max_storage_buffers;
        // f16 and bf16 operands only for the ops proven on them, and only
        // within one storage binding (windows address 32-bit elements).
        let halves_ok = || {
            let halves = || std::iter::once(node).chain(inputs.iter().copied()).filter(|n| codegen::is_half(n.dtype));
            halves().next().is_none()
                || (codegen::half_op_supported(&node.op)
                    && halves().all(|n| n.shape.numel() as u64 <= ctx.windows.elements()))
        };
        // A `u8` operand only as a quantized weight, within one binding
        // (four bytes to a word; a byte binding is never windowed).
        let operand_ok = |(k, n): (usize, &&Node)| {
            codegen::dtype_supported(n.dtype)
                || (n.dtype == DType::U8
                    && codegen::reads_bytes(&node.op, k)
                    && (n.shape.numel() as u64).div_ceil(4) <= ctx.windows.elements())
        };
        // The KV cache's ops on an empty result stay on the fallback
        // (which checks their positions all the same).
        let cache_ok = !matches!(node.op, Op::WriteAt { .. } | Op::PrefixAttention) || node.shape.numel() > 0;
        self.within_loop_budget(ctx, node, inputs)
            && fits
            && cache_ok
            && codegen::node_supported(node)
            && inputs.iter().enumerate().all(operand_ok)
            && halves_ok()
    }

    /// On a software adapter that silently caps loop iterations, kernels
    /// that walk one line per invocation would return wrong values for
    /// lines longer than the cap: such nodes run on the CPU fallback.
    fn within_loop_budget(&self, ctx: &Context, node: &Node, inputs: &[&Node]) -> bool {
        let Some(budget) = ctx.loop_budget else { return true };
        let forms = &self.stages.lower.forms;
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
            Op::QuantMatMul(format) => codegen::quant::QuantPlan::loop_iterations(*format, node_cols(inputs)) <= budget,
            Op::PrefixAttention => {
                let dim = |k: usize, a: usize| inputs.get(k).map_or(0, |n| n.shape.dims()[a] as u64);
                codegen::cache::prefix_attention_iterations(dim(1, 2), dim(1, 3), dim(2, 3)) <= budget
            }
            _ => true,
        }
    }
}

/// The depth of a quantized product: the last dim of its activations.
fn node_cols(inputs: &[&Node]) -> u64 {
    inputs.first().and_then(|x| x.shape.dims().last()).map_or(0, |&k| k as u64)
}
