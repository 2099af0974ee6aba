//! Execution of a compiled plan: the execution's buffers (parameters, the
//! pool buffers of materialized nodes, the uniform of lifted scalars,
//! scratch of two-pass kernels, error slots of index-checking kernels),
//! its bind groups (cached per plan while its buffers recur, see
//! [`crate::device::binds`]), the encoding of every launch into one compute pass
//! (one pass per launch with timestamps while profiling), one submission
//! (or, for a long execution started with the GPU idle, one per piece of
//! 8, 16, 32, ... launches as they are encoded: [`stream_pieces`]) and
//! one wait, then the errors the device or a kernel reported. The
//! wait is for the execution before this one where executions overlap
//! (natively, by default: `Context::overlap`), so that the GPU runs this
//! one while the next is encoded: at most two are on the queue.
//!
//! Error slots are zeroed first in the submission and copied to a
//! readback buffer at its end, mapped by the same wait: a bad index costs
//! no extra round trip (see `codegen::index`).

use crate::compile::executable::{Bound, CompiledKernel, WgpuExecutable};
use crate::device::binds::{self, BindCache, Binding};
use crate::device::context::{device_err, dispatch_size, Context, READBACK, STORAGE, UNIFORM};
use crate::device::platform::Scope;
use crate::device::pool::WgpuStorage;
use crate::device::profile::Profiler;
use crate::device::timestamps::{map_intervals, mapped_intervals, PendingTimes};
use crate::device::transfer::{early_copies, EarlyCopy, OutputOf};
use crate::device::uniforms::Sections;
use lazuli_executor::{metrics, timeline, BackendError, Buffer, IndexError, LaunchCost};
use lazuli_ir::fusion::Kernel;
use lazuli_ir::{DType, NodeId, Op, ScalarValue, VerifiedGraph};
use std::sync::MutexGuard;

/// Runs `exe` on `inputs` (its parameters) with the lifted `scalars`;
/// returns its outputs, or the first error of the execution.
pub(crate) fn execute(
    ctx: &Context,
    profiler: &Profiler,
    exe: &WgpuExecutable,
    inputs: Vec<Buffer>,
    scalars: &[ScalarValue],
) -> Result<Vec<Buffer>, BackendError> {
    let g = &exe.graph;
    if inputs.len() != g.params.len() || scalars.len() != g.scalars.len() {
        return Err(BackendError::Execution(format!(
            "expected {} inputs and {} scalars, got {} and {}",
            g.params.len(),
            g.scalars.len(),
            inputs.len(),
            scalars.len()
        )));
    }
    // The plan's cached bind groups and allocation history; while another
    // thread executes the same plan and holds them, this execution binds
    // afresh.
    let (kernels, sections) = exe.current();
    let mut cache = exe.binds.try_lock().ok();
    let allocating = timeline::span("Allocate");
    let (uniform, values) = allocate(ctx, exe, &mut cache, &inputs, &sections, scalars)?;
    drop(allocating);
    let value = |id: NodeId| exe.slot.get(id.index()).and_then(|&s| values.get(s as usize));
    let dev = &ctx.device;
    let oom = Scope::push(dev, wgpu::ErrorFilter::OutOfMemory);
    let val = Scope::push(dev, wgpu::ErrorFilter::Validation);
    let mut encoding = timeline::span("Encode");
    let mut enc = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("lazuli") });
    let slots = ErrorSlots::new(ctx, exe, &kernels, &mut cache, &mut enc)?;
    // Scratch buffers of two-pass kernels live until the wait below.
    let mut scratch = Vec::new();
    let counts: Vec<u64> = kernels.iter().map(CompiledKernel::launches).collect();
    let total: u64 = counts.iter().sum();
    // Timestamps per launch while profiling or recording the timeline.
    let profiling = profiler.on();
    let timed = profiling || timeline::enabled();
    let queries = (ctx.timestamps && timed && total > 0).then(|| Queries::new(dev, total as usize));
    // With the GPU idle, a long execution streams: its first launches
    // run while the host encodes the rest.
    let pieces = stream_pieces(&counts, if ctx.stream_first > 0 && ctx.idle() { ctx.stream_first } else { 0 });
    let mut work: Vec<Launch> = Vec::with_capacity(total as usize);
    let mut launched = 0;
    for (p, kernels_of) in pieces.iter().enumerate() {
        let from = work.len();
        let state = (&uniform, &*sections);
        launches(ctx, exe, &kernels, kernels_of.clone(), &mut cache, state, &value, &slots, &mut scratch, &mut work)?;
        launched += encode(&mut enc, &work[from..], from, queries.as_ref());
        if p + 1 == pieces.len() {
            break;
        }
        // A piece before the last: submitted now, the rest encoded after.
        let fresh = dev.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("lazuli") });
        let commands = std::mem::replace(&mut enc, fresh).finish();
        drop(encoding);
        let submitting = timeline::span("QueueSubmit");
        ctx.queue.submit([commands]);
        drop(submitting);
        metrics::inc("StreamedSubmits", 1);
        encoding = timeline::span("Encode");
    }
    if let Some(q) = &queries {
        q.resolve(&mut enc);
    }
    slots.copy_back(&mut enc);
    // The outputs this execution made, and their early copies.
    let made: Vec<Option<&Buffer>> = g
        .outputs
        .iter()
        .map(|o| match exe.slot.get(o.index()).and_then(|&s| exe.buffers.get(s as usize)) {
            Some(Bound::Node(_)) => value(*o),
            _ => None,
        })
        .collect();
    let run = exe.outputs_read.start();
    let copies = early_copies(ctx, &exe.outputs_read, run, &made, &mut enc)?;
    drop(cache);
    let commands = enc.finish();
    drop(encoding);
    let submitting = timeline::span("QueueSubmit");
    let submission = ctx.queue.submit([commands]);
    ctx.submitted();
    for (index, (out, copy)) in made.iter().zip(copies).enumerate() {
        if let Some(b) = out {
            let early = copy.map(|(staging, len)| EarlyCopy { staging, len, submission: submission.clone() });
            let read = exe.outputs_read.clone();
            ctx.storage(b)?.set_output(OutputOf { read, index, run, early: std::sync::Mutex::new(early) });
        }
    }
    // Where the thread cannot wait (the web), the slots are read when
    // their mapping settles and a claimed one is reported later.
    #[cfg(target_arch = "wasm32")]
    let slots = slots.check_later(ctx, g, &exe.plan.kernels);
    let rx = slots.map();
    // Timestamps are mapped by the wait that sees the execution done.
    let timestamps = queries.as_ref().map(|q| map_intervals(&q.read, work.len()));
    drop(submitting);
    let waiting = timeline::span("Wait");
    // Overlapping, this execution returns once the one before it has
    // finished, and keeps the GPU busy while the next is encoded; one
    // whose error slots or profiled times are read after it waits for
    // itself. (Its buffers may go back to the pool meanwhile: wgpu orders
    // the next submission's writes after this one's reads.) The
    // timeline's timestamps are collected by a later wait.
    let overlap = ctx.overlap && rx.is_none() && !profiling;
    let (queries, timestamps) = match (queries, timestamps) {
        (Some(q), Some(mapping)) if overlap => {
            let names = work.iter().map(Launch::name).collect();
            ctx.time_later(PendingTimes { names, read: q.read, mapping, _queries: (q.set, q.resolve) });
            (None, None)
        }
        other => other,
    };
    let waited = if overlap { ctx.overlap_with(Some(submission)) } else { ctx.wait_all() };
    drop(waiting);
    // The first claimed slot, in kernel order, as (kernel, index bits).
    let claimed = match rx {
        Some(rx) if waited.is_ok() => slots.claimed(ctx, rx)?,
        _ => None,
    };
    let val_err = val.pop();
    let oom_err = oom.pop();
    metrics::inc("KernelLaunches", launched);
    if let Some(e) = oom_err {
        // Give the cache back so that the next execution can succeed.
        ctx.pool.release_idle();
        return Err(BackendError::OutOfMemory {
            bytes: 0,
            in_use: ctx.pool.stats().in_use_bytes,
            device: format!("{}: {e}", ctx.name),
        });
    }
    if let Some(e) = val_err {
        return Err(BackendError::Execution(e.to_string()));
    }
    waited?;
    let intervals = match (&queries, timestamps) {
        (Some(q), Some(mapping)) => {
            let names: Vec<String> = work.iter().map(Launch::name).collect();
            let mapped = mapping.recv().map_err(|e| device_err(&ctx.name, e))?;
            let (intervals, done) = mapped_intervals((&ctx.name, &ctx.queue), &q.read, names.len(), mapped)?;
            ctx.place_times(&names, &intervals, done);
            Some(intervals)
        }
        _ => None,
    };
    if profiling {
        let costs: Vec<&LaunchCost> = work.iter().map(Launch::cost).collect();
        profiler.record(&costs, intervals.as_deref());
    }
    drop(work);
    drop(uniform);
    scratch.into_iter().rev().for_each(drop);
    drop(slots);
    let outputs = match claimed {
        Some((kernel, bits)) => Err(index_error(g, &exe.plan.kernels[kernel], bits)),
        None => g
            .outputs
            .iter()
            .map(|o| value(*o).cloned().ok_or_else(|| BackendError::Execution(format!("output {o} was not computed"))))
            .collect(),
    };
    values.into_iter().rev().for_each(drop);
    outputs
}

/// The plan's bind cache, when this execution holds it.
type Cache<'e> = Option<MutexGuard<'e, BindCache>>;

/// The pool buffer for allocation `slot` of the plan's history (see
/// [`BindCache::preferred`]): the one it had last time where it is idle.
fn acquire(
    ctx: &Context,
    cache: &mut Cache,
    slot: usize,
    bytes: u64,
    usage: wgpu::BufferUsages,
) -> Result<WgpuStorage, BackendError> {
    let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(slot));
    let buf = ctx.pool.acquire_preferring(bytes, usage, prefer)?;
    if let Some(c) = cache.as_mut() {
        c.record(slot, buf.id());
    }
    Ok(buf)
}

/// The uniform of lifted scalars, in `sections` (written before the
/// submission that reads it: `queue.write_buffer` is ordered before the
/// next submit) and
/// the execution's buffers: parameters, then every materialized node in
/// order, each node asking for the buffers it had before. The
/// intermediates go back to the pool in reverse order at the end, so even
/// without that history the pool (last in, first out) would hand the same
/// buffers to the same nodes next time.
fn allocate(
    ctx: &Context,
    exe: &WgpuExecutable,
    cache: &mut Cache,
    inputs: &[Buffer],
    sections: &Sections,
    scalars: &[ScalarValue],
) -> Result<(WgpuStorage, Vec<Buffer>), BackendError> {
    let g = &exe.graph;
    let words = sections.words(&g.scalars, scalars);
    let uniform = acquire(ctx, cache, exe.buffers.len(), words.len() as u64 * 4, UNIFORM)?;
    ctx.write_uniform(&uniform, &words);
    let mut values: Vec<Buffer> = Vec::with_capacity(exe.buffers.len());
    for (slot, b) in exe.buffers.iter().enumerate() {
        values.push(match *b {
            Bound::Input(i) => inputs[i].clone(),
            Bound::Node(m) => {
                let prefer = cache.as_ref().map_or(&[][..], |c| c.preferred(slot));
                let buf = ctx.new_buffer(&g.node(m).ty(), prefer, || g.node(m).op.name())?;
                if let Some(c) = cache.as_mut() {
                    c.record(slot, ctx.storage(&buf)?.id());
                }
                buf
            }
        });
    }
    Ok((uniform, values))
}

/// The error slots of an execution's index-checking kernels, one each.
struct ErrorSlots {
    /// Kernel indices of the checking kernels, ascending.
    checking: Vec<usize>,
    stride: u64,
    /// The bound slots buffer and its readback copy; none when no kernel
    /// checks.
    buffers: Option<(WgpuStorage, WgpuStorage)>,
}

impl ErrorSlots {
    /// Slots for the checking kernels of `exe`, zeroed first in `enc`.
    fn new(
        ctx: &Context,
        exe: &WgpuExecutable,
        kernels: &[CompiledKernel],
        cache: &mut Cache,
        enc: &mut wgpu::CommandEncoder,
    ) -> Result<ErrorSlots, BackendError> {
        let checking: Vec<usize> =
            (0..kernels.len()).filter(|&i| kernels[i].wgsl.error_slot && kernels[i].wgsl.invocations > 0).collect();
        let stride = ctx.slot_stride;
        let bytes = checking.len() as u64 * stride;
        let buffers = if checking.is_empty() {
            None
        } else {
            // The slots buffer is bound, so it comes through the plan's
            // allocation history like every buffer it binds (after the
            // scratch of each kernel): a steady loop gets it back, and with
            // it the bind groups of its checking kernels.
            let device_slots = acquire(ctx, cache, exe.buffers.len() + 1 + kernels.len(), bytes, STORAGE)?;
            // Never bound: any idle readback buffer will do.
            let read = ctx.pool.acquire(bytes, READBACK)?;
            enc.clear_buffer(device_slots.buffer(), 0, Some(bytes));
            Some((device_slots, read))
        };
        Ok(ErrorSlots { checking, stride, buffers })
    }

    fn bytes(&self) -> u64 {
        self.checking.len() as u64 * self.stride
    }

    /// The slot of kernel `ki`, if it checks indices: a buffer and offset.
    fn of(&self, ki: usize) -> Option<(&WgpuStorage, u64)> {
        match (&self.buffers, self.checking.binary_search(&ki)) {
            (Some((device_slots, _)), Ok(j)) => Some((device_slots, j as u64 * self.stride)),
            _ => None,
        }
    }

    /// Copies the slots to the readback buffer at the end of `enc`.
    fn copy_back(&self, enc: &mut wgpu::CommandEncoder) {
        if let Some((device_slots, read)) = &self.buffers {
            enc.copy_buffer_to_buffer(device_slots.buffer(), 0, read.buffer(), 0, self.bytes());
        }
    }

    /// On the web: moves the readback buffer into a task that reads the
    /// slots once their mapping settles and reports the first claimed
    /// one as the device's deferred error (see [`crate::device::platform`]).
    #[cfg(target_arch = "wasm32")]
    fn check_later(mut self, ctx: &Context, g: &VerifiedGraph, kernels: &[Kernel]) -> ErrorSlots {
        let Some((_, read)) = self.buffers.take() else { return self };
        let found: Vec<(IndexError, bool)> =
            self.checking.iter().map(|&k| index_error_template(g, &kernels[k])).collect();
        let (bytes, step, deferred) = (self.bytes(), (self.stride / 4) as usize, ctx.deferred.clone());
        deferred.begin();
        crate::device::platform::spawn(async move {
            let claimed = match crate::device::platform::map_read(read.buffer(), bytes).await {
                Ok(()) => {
                    let claimed = read.buffer().get_mapped_range(0..bytes).ok().and_then(|view| {
                        let words: &[u32] = bytemuck::cast_slice(&view);
                        (0..found.len()).find(|&j| words[j * step] != 0).map(|j| (j, words[j * step + 1]))
                    });
                    read.buffer().unmap();
                    claimed
                }
                Err(_) => None,
            };
            if let Some((j, bits)) = claimed {
                deferred.report(with_index(found[j].clone(), bits));
            }
            deferred.end();
        });
        self
    }

    /// Maps the readback buffer after the submission (the wait completes
    /// it); the receiver gets the mapping's result.
    fn map(&self) -> Option<std::sync::mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>> {
        let (_, read) = self.buffers.as_ref()?;
        let (tx, rx) = std::sync::mpsc::channel();
        read.buffer().map_async(wgpu::MapMode::Read, 0..self.bytes(), move |r| {
            let _ = tx.send(r);
        });
        Some(rx)
    }

    /// The first claimed slot, in kernel order, as (kernel, index bits),
    /// after the wait; the readback buffer is unmapped before it returns.
    fn claimed(
        &self,
        ctx: &Context,
        rx: std::sync::mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
    ) -> Result<Option<(usize, u32)>, BackendError> {
        let Some((_, read)) = &self.buffers else { return Ok(None) };
        let mapped = rx.recv().map_err(|e| device_err(&ctx.name, e))?.map_err(|e| device_err(&ctx.name, e));
        let found = mapped.and_then(|()| {
            let view = read.buffer().get_mapped_range(0..self.bytes()).map_err(|e| device_err(&ctx.name, e))?;
            let words: &[u32] = bytemuck::cast_slice(&view);
            let step = (self.stride / 4) as usize;
            Ok((0..self.checking.len())
                .find(|&j| words[j * step] != 0)
                .map(|j| (self.checking[j], words[j * step + 1])))
        });
        read.buffer().unmap();
        found
    }
}

/// One dispatch of an execution.
struct Launch<'a> {
    kernel: &'a CompiledKernel,
    /// The first pass of a two-pass kernel.
    first_pass: bool,
    pipeline: &'a wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    /// Bind group 1 of a generic pipeline.
    dims: Option<&'a wgpu::BindGroup>,
    groups: (u32, u32),
}

impl Launch<'_> {
    /// The launch's name in profiles.
    fn name(&self) -> String {
        if self.first_pass {
            format!("{}_pass1", self.kernel.name)
        } else {
            self.kernel.name.clone()
        }
    }

    /// The launch's cost, computed when its kernel compiled.
    fn cost(&self) -> &LaunchCost {
        match (&self.kernel.pre_cost, self.first_pass) {
            (Some(pre), true) => pre,
            _ => &self.kernel.cost,
        }
    }
}

/// Bind group 0 of launch `launch` (a kernel's first pass is launch
/// `2 * ki`, the kernel proper `2 * ki + 1`): from the plan's cache, keyed
/// by every range bound, or made afresh without it.
fn bind(
    ctx: &Context,
    cache: &mut Cache,
    launch: usize,
    layout: &wgpu::BindGroupLayout,
    bindings: &[Binding],
) -> wgpu::BindGroup {
    match cache {
        Some(c) => c.get(launch, &ctx.device, layout, bindings),
        None => binds::create(&ctx.device, layout, bindings),
    }
}

/// Launches the first piece of a streamed execution holds by default
/// (see `WgpuOptions::stream_submit`): enough to start the GPU on a few
/// kernels (about their encoding's time on a GPU's host) without a
/// submission per kernel.
pub const STREAM_FIRST_LAUNCHES: u64 = 8;

/// The kernels (by index) of each submission of an execution whose
/// kernels launch `counts[i]` times: all in one unless `first` is nonzero
/// and they launch more than `2 * first` times; then pieces of at least
/// `first`, `2 * first`, `4 * first`, ... launches and the rest, so that
/// submissions grow as the queue fills (one per doubling) and the GPU,
/// idle at the start, gets its first kernels after `first` are encoded.
fn stream_pieces(counts: &[u64], first: u64) -> Vec<std::ops::Range<usize>> {
    let total: u64 = counts.iter().sum();
    if first == 0 || total <= 2 * first {
        return std::iter::once(0..counts.len()).collect();
    }
    let mut pieces = Vec::new();
    let (mut start, mut have, mut want) = (0, 0, first);
    for (i, &n) in counts.iter().enumerate() {
        have += n;
        if have >= want && i + 1 < counts.len() {
            pieces.push(start..i + 1);
            (start, have, want) = (i + 1, 0, want * 2);
        }
    }
    pieces.push(start..counts.len());
    pieces
}

/// The launches of kernels `range` of `exe` in order, with their bind
/// groups, appended to `work`; scratch buffers of two-pass kernels are
/// pushed to `scratch`.
#[allow(clippy::too_many_arguments)] // One execution's state, passed explicitly rather than bundled for one call.
fn launches<'a, 'v>(
    ctx: &Context,
    exe: &WgpuExecutable,
    kernels: &'a [CompiledKernel],
    range: std::ops::Range<usize>,
    cache: &mut Cache,
    (uniform, sections): (&WgpuStorage, &Sections),
    value: &dyn Fn(NodeId) -> Option<&'v Buffer>,
    slots: &ErrorSlots,
    scratch: &mut Vec<WgpuStorage>,
    work: &mut Vec<Launch<'a>>,
) -> Result<(), BackendError> {
    // Each launch binds the uniform's section of its kernel's scalars.
    let section = |scalars: &[usize]| {
        let (offset, size) = sections.range(scalars);
        Binding { storage: uniform, offset, size }
    };
    for ((ki, k), kernel) in kernels.iter().enumerate().zip(&exe.plan.kernels).skip(range.start).take(range.len()) {
        if k.wgsl.invocations == 0 {
            continue;
        }
        let buffer = |id: &NodeId| -> Result<&WgpuStorage, BackendError> {
            let b = value(*id)
                .ok_or_else(|| BackendError::Execution(format!("no buffer for node {id} needed by {}", k.name)))?;
            ctx.storage(b)
        };
        let main = |bind_group: wgpu::BindGroup| Launch {
            kernel: k,
            first_pass: false,
            pipeline: &k.pipeline.pipeline,
            bind_group,
            dims: k.dims.as_ref(),
            groups: dispatch_size(k.wgsl.invocations, k.wgsl.workgroup_size),
        };
        match (&k.wgsl.pre, &k.pre) {
            (Some(pre), Some((pre_pipeline, pre_dims))) => {
                // Pass 1 reads the inputs into scratch; pass 2 reads the
                // scratch (after the inputs, see `Wgsl::binds_inputs`) and
                // writes the outputs.
                debug_assert!(slots.of(ki).is_none(), "two-pass kernels check no indices");
                // Scratch allocations come after the buffers in the plan's
                // allocation history.
                let s = acquire(ctx, cache, exe.buffers.len() + 1 + ki, pre.scratch.max(1) * 4, STORAGE)?;
                let mut first: Vec<&WgpuStorage> = Vec::with_capacity(kernel.inputs.len() + 1);
                for id in &kernel.inputs {
                    first.push(buffer(id)?);
                }
                first.push(&s);
                let bindings = ctx.bindings(section(&pre.scalars), &first, &k.windows.pre, None);
                work.push(Launch {
                    kernel: k,
                    first_pass: true,
                    pipeline: &pre_pipeline.pipeline,
                    bind_group: bind(ctx, cache, 2 * ki, &pre_pipeline.layout, &bindings),
                    dims: pre_dims.as_ref(),
                    groups: dispatch_size(pre.invocations, pre.workgroup_size),
                });
                let mut second: Vec<&WgpuStorage> = Vec::with_capacity(kernel.outputs.len() + 1);
                if k.wgsl.binds_inputs {
                    // Split-K: the epilogue reads inputs; they keep their
                    // bindings and the scratch follows them.
                    for id in &kernel.inputs {
                        second.push(buffer(id)?);
                    }
                }
                second.push(&s);
                for id in &kernel.outputs {
                    second.push(buffer(id)?);
                }
                let bindings = ctx.bindings(section(&k.wgsl.scalars), &second, &k.windows.main, None);
                work.push(main(bind(ctx, cache, 2 * ki + 1, &k.pipeline.layout, &bindings)));
                scratch.push(s);
            }
            _ => {
                let mut bufs: Vec<&WgpuStorage> = Vec::with_capacity(kernel.inputs.len() + kernel.outputs.len());
                for id in kernel.inputs.iter().chain(&kernel.outputs) {
                    bufs.push(buffer(id)?);
                }
                let bindings = ctx.bindings(section(&k.wgsl.scalars), &bufs, &k.windows.main, slots.of(ki));
                work.push(main(bind(ctx, cache, 2 * ki + 1, &k.pipeline.layout, &bindings)));
            }
        }
    }
    Ok(())
}

/// The timestamp queries of a profiled execution: a begin and an end per
/// launch, resolved and copied to a readback buffer.
struct Queries {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    count: u32,
}

impl Queries {
    fn new(dev: &wgpu::Device, launches: usize) -> Queries {
        let n = 2 * launches as u64;
        let set = dev.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("lazuli profile"),
            ty: wgpu::QueryType::Timestamp,
            count: n as u32,
        });
        let resolve = dev.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lazuli profile resolve"),
            size: n * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = dev.create_buffer(&wgpu::BufferDescriptor {
            label: Some("lazuli profile read"),
            size: n * 8,
            usage: READBACK,
            mapped_at_creation: false,
        });
        Queries { set, resolve, read, count: n as u32 }
    }

    fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        enc.resolve_query_set(&self.set, 0..self.count, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.read, 0, self.count as u64 * 8);
    }
}

/// Encodes `work`, launches `from..` of the execution, into `enc`: one
/// compute pass for all, or one pass per launch with timestamps when
/// `queries` is given. Returns the number of launches.
fn encode(enc: &mut wgpu::CommandEncoder, work: &[Launch], from: usize, queries: Option<&Queries>) -> u64 {
    let dispatch = |pass: &mut wgpu::ComputePass, l: &Launch| {
        pass.set_pipeline(l.pipeline);
        pass.set_bind_group(0, &l.bind_group, &[]);
        if let Some(dims) = l.dims {
            pass.set_bind_group(1, dims, &[]);
        }
        pass.dispatch_workgroups(l.groups.0, l.groups.1, 1);
    };
    match queries {
        Some(q) => {
            for (i, l) in work.iter().enumerate() {
                let i = from + i;
                let name = l.name();
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(&name),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &q.set,
                        beginning_of_pass_write_index: Some(2 * i as u32),
                        end_of_pass_write_index: Some(2 * i as u32 + 1),
                    }),
                });
                dispatch(&mut pass, l);
            }
        }
        None => {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None });
            for l in work {
                dispatch(&mut pass, l);
            }
        }
    }
    work.len() as u64
}

/// The error of an index out of range that kernel `k` (a gather, a
/// scatter-add, a KV cache write or prefix attention) reported: `bits` are the index as its kernel read it.
fn index_error(g: &VerifiedGraph, k: &Kernel, bits: u32) -> BackendError {
    with_index(index_error_template(g, k), bits)
}

/// The error of kernel `k`'s index check with its index left 0, and
/// whether the index is signed.
fn index_error_template(g: &VerifiedGraph, k: &Kernel) -> (IndexError, bool) {
    let root = g.node(k.root());
    // The KV cache's ops check a position: the one of a row whose update
    // (queries) do not fit, named as the CPU backend names it.
    let (axis, data, index, op) = match root.op {
        Op::Gather { axis } | Op::ScatterAdd { axis } => (axis, root.inputs[0], root.inputs[1], root.op.name()),
        Op::WriteAt { axis } => {
            let len = g.node(root.inputs[1]).shape.dims()[axis];
            (axis, root.inputs[0], root.inputs[2], format!("write_at (writing or reading {len} positions)"))
        }
        Op::PrefixAttention => {
            let len = g.node(root.inputs[0]).shape.dims()[2];
            (2, root.inputs[1], root.inputs[4], format!("prefix_attention (writing or reading {len} positions)"))
        }
        _ => unreachable!("only gathers, scatter-adds and the KV cache's ops check indices"),
    };
    let data = g.node(data);
    let signed = g.node(index).dtype == DType::I32;
    let error = IndexError { op, index: 0, axis, size: data.shape.dims()[axis], shape: data.shape.clone() };
    (error, signed)
}

/// The error of a template from [`index_error_template`] with the index
/// whose bits a slot holds.
fn with_index((mut error, signed): (IndexError, bool), bits: u32) -> BackendError {
    error.index = if signed { bits as i32 as i128 } else { bits as i128 };
    BackendError::IndexOutOfRange(Box::new(error))
}

#[cfg(test)]
mod tests {
    use super::stream_pieces;

    #[test]
    fn short_executions_and_streaming_off_submit_in_one_piece() {
        let one = |n: usize| std::iter::once(0..n).collect::<Vec<_>>();
        assert_eq!(stream_pieces(&[1; 16], 8), one(16));
        assert_eq!(stream_pieces(&[1; 100], 0), one(100));
        assert_eq!(stream_pieces(&[], 8), one(0));
    }

    #[test]
    fn pieces_double_and_hold_whole_kernels() {
        // 166 one-launch kernels (G8): 8, 16, 32, 64, then the rest.
        let sizes: Vec<usize> = stream_pieces(&[1; 166], 8).iter().map(|r| r.len()).collect();
        assert_eq!(sizes, [8, 16, 32, 64, 46]);
        // A two-pass kernel stays in one piece; a kernel without
        // invocations counts nothing.
        let pieces = stream_pieces(&[1, 2, 0, 1, 1, 1, 2, 1, 1], 1);
        assert_eq!(pieces, vec![0..1, 1..2, 2..7, 7..9]);
        // Every kernel in exactly one piece, in order.
        let flat: Vec<usize> = pieces.into_iter().flatten().collect();
        assert_eq!(flat, (0..9).collect::<Vec<_>>());
    }
}
