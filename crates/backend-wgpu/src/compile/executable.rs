//! A compiled plan and its kernels: what an execution runs, and the
//! upgrades waiting to replace some of its kernels between executions.
//!
//! [`WgpuExecutable`] holds the verified graph, its fusion plan, the
//! compiled kernels (swapped whole between executions: an execution holds
//! on to the kernels it started with), the buffers an execution binds,
//! and two background upgrades (`crate::compile::upgrade`): the tuner's
//! candidates (`Candidates`, timed and swapped in by
//! [`crate::compile::autotune`]) and the second tier's static kernels
//! (`StaticKernels`, see [`crate::compile::specialize`]). A leaf of the compile side:
//! it knows nothing of the compiler, the tuner or the tier, which all
//! read and upgrade it.

use crate::codegen::window::KernelWindows;
use crate::codegen::{MatmulForm, Wgsl};
use crate::compile::pipeline::PipelineEntry;
use crate::compile::upgrade::Upgrade;
use crate::device::binds::BindCache;
use crate::device::uniforms::Sections;
use crate::rewrite::size_families::Member;
use lazuli_executor::{Executable, KernelInfo, LaunchCost};
use lazuli_ir::fusion::{FusionPlan, Kernel};
use lazuli_ir::{NodeId, Op, VerifiedGraph};
use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// A compiled plan: the graph, its kernels and their pipelines.
pub struct WgpuExecutable {
    pub(crate) graph: VerifiedGraph,
    pub(crate) plan: FusionPlan,
    /// The compiled kernels, one per kernel of `plan`, and the sections
    /// of the uniform their launches bind (a function of the kernels,
    /// kept with them so that no execution computes it again); a kernel
    /// an upgrade replaces is swapped between executions
    /// ([`WgpuExecutable::replace_kernel`]).
    kernels: RwLock<(Arc<[CompiledKernel]>, Arc<Sections>)>,
    /// The adapter's `min_uniform_buffer_offset_alignment` (see
    /// [`crate::device::uniforms`]).
    uniform_align: u64,
    /// Kernels still waiting for the tuner (indices into `kernels`).
    untuned: Mutex<Vec<usize>>,
    /// Where their candidates stand (see [`crate::compile::autotune`]).
    pub(crate) tuning: Upgrade<VecDeque<Candidates>>,
    /// Executions started.
    runs: AtomicU64,
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
    /// [`crate::compile::specialize`]).
    pub(crate) tier: Upgrade<StaticKernels>,
    /// Which outputs were read, and by which execution: the executions
    /// after copy them early (see [`crate::device::transfer::early_copies`]).
    pub(crate) outputs_read: Arc<crate::device::transfer::OutputsRead>,
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
    /// [`crate::codegen::window`]).
    pub windows: KernelWindows,
    /// The cost of one launch of the first pass, if any (see
    /// [`crate::compile::cost`]), computed at compile time.
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
    pub(crate) fn new(
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
        // A plan with generic kernels may get static ones, once; the
        // tuner may take kernels again after each round.
        let tier = Upgrade::new(kernels.iter().any(CompiledKernel::is_generic), false);
        WgpuExecutable {
            graph: graph.clone(),
            plan,
            kernels: RwLock::new(with_sections(kernels.into(), uniform_align)),
            uniform_align,
            untuned: Mutex::new(untuned),
            tuning: Upgrade::new(true, true),
            runs: Default::default(),
            buffers,
            slot,
            binds,
            generic,
            tier,
            outputs_read: Arc::new(crate::device::transfer::OutputsRead::new(graph.outputs.len())),
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
    pub(crate) fn unchanged(
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
        let waiting = || self.untuned().contains(&i);
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
    /// boundaries that follow, see [`crate::compile::autotune`]).
    pub(crate) fn await_tuning(&self, indices: &[usize]) {
        self.untuned().extend_from_slice(indices);
    }

    /// The kernels waiting for the tuner (indices into the kernels).
    pub(crate) fn untuned(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.untuned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Executions started.
    pub(crate) fn runs(&self) -> u64 {
        self.runs.load(Ordering::Relaxed)
    }

    /// Counts an execution starting; returns the executions started
    /// before it.
    pub(crate) fn start_run(&self) -> u64 {
        self.runs.fetch_add(1, Ordering::Relaxed)
    }

    /// Kernels `indices` of this plan, to compile again off the steps'
    /// path (each with its index and name).
    pub(crate) fn recompile(&self, indices: impl IntoIterator<Item = usize>) -> Recompile {
        let current = self.current_kernels();
        let kernels = indices.into_iter().map(|i| (i, self.plan.kernels[i].clone(), current[i].name.clone())).collect();
        Recompile { graph: self.graph.clone(), kernels }
    }

    /// Replaces kernel `ki` (a tuned form, or a static kernel for a
    /// generic one, see [`crate::compile::specialize`]), dropping the bind groups made
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

/// Kernels of an executable to compile again on a background thread (the
/// tuner's candidates, the second tier's static kernels): its graph, and
/// each kernel with its index in the plan and its name.
pub(crate) struct Recompile {
    /// The executable's graph.
    pub graph: VerifiedGraph,
    /// Each kernel: its index in the plan, the kernel and its name.
    pub kernels: Vec<(usize, Kernel, String)>,
}

/// One tuning key's candidates in one executable, compiled (what the
/// tuner's upgrade holds ready, see [`crate::compile::autotune`]).
pub(crate) struct Candidates {
    /// The key (see `crate::compile::autotune::Tuner::key`).
    pub key: u64,
    /// The form the rule gives the key's kernels (the one they run until
    /// a winner replaces it).
    pub rule: MatmulForm,
    /// The executable's kernels (indices) with this key: the same
    /// problem, so one measurement decides them all.
    pub kernels: Vec<usize>,
    /// Each candidate form with its compiled kernel for each of
    /// `kernels`, the rule's choice first; where the winner was known
    /// by the time the candidates were compiled (another executable or
    /// process tuned the key), that form alone.
    pub forms: Vec<(MatmulForm, Vec<CompiledKernel>)>,
    /// Whether `forms` is a known winner (nothing to time).
    pub known: bool,
}

/// A plan's static kernels for its generic ones (what the second tier's
/// upgrade holds ready, see [`crate::compile::specialize`]): each by its index in the
/// plan, and the indices of those the tuner is to measure (as a first
/// compile's would be).
pub(crate) struct StaticKernels {
    /// The kernels, by index.
    pub kernels: Vec<(usize, CompiledKernel)>,
    /// Those waiting for the tuner.
    pub untuned: Vec<usize>,
}

impl StaticKernels {
    /// No kernels.
    pub fn none() -> StaticKernels {
        StaticKernels { kernels: Vec::new(), untuned: Vec::new() }
    }
}
