//! Fused elementwise loops: a group of elementwise and view nodes compiled
//! into one [`FusedLoop`] that computes every output element through the
//! whole chain without materializing intermediates.
//!
//! The loop runs over the output's linear index in blocks of [`BLOCK`]
//! elements. For each block, every instruction is one call of a
//! monomorphic block kernel ([`crate::elementwise`]) over small scratch
//! registers that stay in L1/L2; dispatch costs one indirect call per
//! instruction per block, never per element. Operands are resolved per
//! block without copying where possible: a contiguous input is a subslice
//! of its buffer, a broadcast scalar is a splat, and any other strided view
//! (broadcast, permute, slice) is gathered by a strided outer loop with a
//! contiguous inner run. Outputs are written in place. Large loops split
//! their blocks over the rayon pool; small ones stay on the calling thread.
//!
//! Memory traffic of a large loop is one read of each input and one write
//! of each output: intermediates live in the block registers, loops writing
//! [`STREAM_BYTES`] or more stage each output block in a register and copy
//! it out with streaming stores ([`crate::stream`]: no read of the
//! destination lines, no cache pollution), and each contiguous input's
//! next block is prefetched while the current one computes. On W1 (a
//! 6-op chain over 64 MiB, 2 cores) this took the loop from 29 ms to
//! 12 ms, about 0.55x memcpy, together with the AVX2 block kernels of
//! [`crate::elementwise`]; what is left is compute (mostly `tanh`'s
//! rational function and its division) in series with the memory phases.
//!
//! What fuses: `Unary`, `Binary`, `Where`, `Cast` whose shapes have the
//! loop's element count (so they share its linear index), views
//! (`Reshape`, `Permute`, `Expand`, `Slice`) of inputs and leaves, and
//! leaves (constants, lifted scalars, iota). Anything else makes
//! [`FusedLoop::compile`] return `None` and the caller interprets the group
//! node by node.

use crate::elementwise::{self, BlockFn, Operand};
use crate::layout::View;
use crate::memory::Memory;
use crate::storage::{data, each_all, CpuData};
use crate::stream;
use lazuli_executor::BackendError;
use lazuli_executor::DeviceStorage;
use lazuli_ir::{DType, Graph, NodeId, Op, ScalarValue};
use rayon::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Elements per block: a few KiB per register, so a chain's registers fit
/// in L1/L2 while the per-block dispatch is amortized.
const BLOCK: usize = 2048;

/// Loops with fewer element-instructions than this run on one thread.
const PAR_WORK: usize = 1 << 17;

/// Loops writing at least this many bytes write them with streaming
/// (non-temporal) stores: outputs this large leave the caches anyway, and
/// streaming stores skip reading each destination line before writing it
/// (a third of an elementwise loop's memory traffic).
const STREAM_BYTES: usize = 16 << 20;

/// A compiled fused elementwise loop.
pub(crate) struct FusedLoop {
    /// Elements per output.
    n: usize,
    slots: Vec<Slot>,
    insts: Vec<Inst>,
    /// Output nodes and their dtypes, in order.
    outputs: Vec<(NodeId, DType)>,
    /// Buffers read: materialized nodes or data owned by the loop (iota).
    sources: Vec<Source>,
    owned: Vec<CpuData>,
    /// Physical scratch registers.
    nregs: usize,
    /// The ops of its compute instructions, in order (for profiles).
    ops: Vec<&'static str>,
}

enum Source {
    Node(NodeId),
    Owned(usize),
}

/// How a value is found for one block.
#[derive(Clone, Copy, Debug)]
enum Slot {
    /// Elements `offset + i` of a source (`size`-byte elements).
    Contig { src: usize, offset: usize, size: usize },
    /// Element `offset` of a source, for every `i`.
    Splat { src: usize, offset: usize, size: usize },
    /// Lifted scalar `index`, converted to `dtype`.
    Scalar { index: usize, dtype: DType },
    /// A baked constant.
    Const([u8; 8]),
    /// A scratch register (virtual until allocation, then physical).
    Reg { reg: usize, size: usize },
    /// The block's chunk of output `k`.
    Out { k: usize, size: usize },
}

enum Inst {
    Compute { f: BlockFn, args: Vec<usize>, dst: usize },
    Gather { src: usize, view: View, dst: usize },
    Copy { arg: usize, dst: usize },
}

impl Inst {
    fn dst(&self) -> usize {
        match self {
            Inst::Compute { dst, .. } | Inst::Gather { dst, .. } | Inst::Copy { dst, .. } => *dst,
        }
    }

    fn reads(&self) -> &[usize] {
        match self {
            Inst::Compute { args, .. } => args,
            Inst::Copy { arg, .. } => std::slice::from_ref(arg),
            Inst::Gather { .. } => &[],
        }
    }
}

/// A node's value while compiling.
#[derive(Clone)]
enum Val {
    /// One value for every element (a splat slot).
    Leaf(usize),
    /// A view of a source buffer.
    View { src: usize, view: View, size: usize },
    /// A computed slot with the loop's element count.
    Slot(usize),
}

struct Builder<'g> {
    graph: &'g Graph,
    mem: &'g Memory,
    n: usize,
    slots: Vec<Slot>,
    insts: Vec<Inst>,
    sources: Vec<Source>,
    owned: Vec<CpuData>,
    source_of: HashMap<NodeId, usize>,
    view_slots: HashMap<(usize, View), usize>,
    vregs: usize,
    ops: Vec<&'static str>,
}

impl FusedLoop {
    /// Compiles the nodes of `members` (topologically sorted) that the
    /// `outputs` need into one loop. Operands outside `members` are read
    /// from their materialized buffers. `None` if some needed node cannot
    /// be fused or the outputs differ in element count.
    pub(crate) fn compile(graph: &Graph, members: &[NodeId], outputs: &[NodeId], mem: &Memory) -> Option<FusedLoop> {
        let n = graph.node(outputs[0]).shape.numel();
        if outputs.iter().any(|o| graph.node(*o).shape.numel() != n) {
            return None;
        }
        // Members the outputs reach.
        let member: HashSet<NodeId> = members.iter().copied().collect();
        let mut needed: HashSet<NodeId> = HashSet::new();
        let mut stack: Vec<NodeId> = outputs.to_vec();
        while let Some(x) = stack.pop() {
            if member.contains(&x) && needed.insert(x) {
                stack.extend(graph.node(x).inputs.iter().copied());
            }
        }
        let mut b = Builder {
            graph,
            mem,
            n,
            slots: Vec::new(),
            insts: Vec::new(),
            sources: Vec::new(),
            owned: Vec::new(),
            source_of: HashMap::new(),
            view_slots: HashMap::new(),
            vregs: 0,
            ops: Vec::new(),
        };
        let mut vals: HashMap<NodeId, Val> = HashMap::new();
        for &id in members.iter().filter(|x| needed.contains(x)) {
            let v = b.node(id, &mut vals)?;
            vals.insert(id, v);
        }
        let mut outs = Vec::new();
        for (k, &o) in outputs.iter().enumerate() {
            let node = graph.node(o);
            let size = node.dtype.size_bytes();
            let v = match vals.get(&o) {
                Some(v) => v.clone(),
                None => b.input(o),
            };
            match v {
                Val::Slot(s) if matches!(b.slots[s], Slot::Reg { .. }) => {
                    // Write the producing instruction's result in place.
                    b.slots[s] = Slot::Out { k, size };
                }
                v => {
                    let dst = b.slots.len();
                    b.slots.push(Slot::Out { k, size });
                    match v {
                        Val::View { src, view, .. } => {
                            let view = view.expand(node.shape.dims()).collapse();
                            match b.classify(src, &view, size) {
                                Some(arg) => b.insts.push(Inst::Copy { arg, dst }),
                                None => b.insts.push(Inst::Gather { src, view, dst }),
                            }
                        }
                        Val::Leaf(arg) | Val::Slot(arg) => b.insts.push(Inst::Copy { arg, dst }),
                    }
                }
            }
            outs.push((o, node.dtype));
        }
        let nregs = b.allocate();
        Some(FusedLoop {
            n,
            slots: b.slots,
            insts: b.insts,
            outputs: outs,
            sources: b.sources,
            owned: b.owned,
            nregs,
            ops: b.ops,
        })
    }

    /// The materialized nodes this loop reads.
    pub(crate) fn reads(&self) -> Vec<NodeId> {
        self.sources
            .iter()
            .filter_map(|s| match s {
                Source::Node(id) => Some(*id),
                Source::Owned(_) => None,
            })
            .collect()
    }

    /// Its ops for a profile's kernel name: the first four, then how
    /// many more (`mul_add_tanh`, `mul_add_exp_div_and_3`); `copy` for a
    /// loop of views alone.
    pub(crate) fn describe(&self) -> String {
        let mut s = self.ops.iter().take(4).copied().collect::<Vec<_>>().join("_");
        if self.ops.len() > 4 {
            s += &format!("_and_{}", self.ops.len() - 4);
        }
        if s.is_empty() {
            s = "copy".into();
        }
        s
    }

    /// FLOPs of one run: one per element per compute instruction.
    pub(crate) fn flops(&self) -> u64 {
        (self.n * self.ops.len()) as u64
    }

    /// The nodes this loop writes, in order.
    pub(crate) fn writes(&self) -> Vec<NodeId> {
        self.outputs.iter().map(|(o, _)| *o).collect()
    }

    /// Runs the loop; `vals` holds the materialized node values.
    pub(crate) fn run(
        &self,
        vals: &[Option<Arc<dyn DeviceStorage>>],
        scalars: &[ScalarValue],
        mem: &Memory,
    ) -> Result<Vec<CpuData>, BackendError> {
        let srcs: Vec<&[u8]> = self
            .sources
            .iter()
            .map(|s| match s {
                Source::Node(id) => bytes(data(vals[id.index()].as_ref().expect("sources are computed first"))),
                Source::Owned(i) => bytes(&self.owned[*i]),
            })
            .collect();
        let splats: Vec<[u8; 8]> = self
            .slots
            .iter()
            .map(|s| match *s {
                Slot::Splat { src, offset, size } => {
                    let mut b = [0u8; 8];
                    b[..size].copy_from_slice(&srcs[src][offset * size..(offset + 1) * size]);
                    b
                }
                Slot::Scalar { index, dtype } => elementwise::scalar_bytes(scalars[index], dtype),
                Slot::Const(b) => b,
                _ => [0; 8],
            })
            .collect();
        let mut outs = self.outputs.iter().map(|(_, dt)| mem.take(*dt, self.n)).collect::<Result<Vec<_>, _>>()?;
        if self.n == 0 {
            return Ok(outs);
        }
        let sizes: Vec<usize> = self.outputs.iter().map(|(_, dt)| dt.size_bytes()).collect();
        let out_bytes: usize = sizes.iter().map(|s| s * self.n).sum();
        let stream = out_bytes >= STREAM_BYTES;
        // Large loops fetch each contiguous input's next block ahead.
        let ahead: Vec<(usize, usize, usize)> = if stream {
            self.slots
                .iter()
                .filter_map(|s| match *s {
                    Slot::Contig { src, offset, size } => Some((src, offset, size)),
                    _ => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        let ctx = Ctx { lp: self, srcs: &srcs, splats: &splats, stream, ahead: &ahead };
        let bufs: Vec<&mut [u8]> = outs.iter_mut().map(bytes_mut).collect();
        let nblocks = self.n.div_ceil(BLOCK);
        let work = self.n * self.insts.len().max(1);
        let threads = crate::threads::available();
        if work < PAR_WORK || nblocks < 2 || threads < 2 {
            let mut regs = self.registers();
            ctx.run_part(0, self.n, bufs, &mut regs);
            stream::fence();
            return Ok(outs);
        }
        crate::threads::note(threads);
        let parts = nblocks.min(threads * 4);
        let per = nblocks.div_ceil(parts) * BLOCK;
        let mut jobs = Vec::with_capacity(parts);
        let mut rest = bufs;
        let mut start = 0;
        while start < self.n {
            let end = (start + per).min(self.n);
            let mut mine = Vec::with_capacity(rest.len());
            let mut next = Vec::with_capacity(rest.len());
            for (buf, size) in rest.into_iter().zip(&sizes) {
                let (a, b) = buf.split_at_mut((end - start) * size);
                mine.push(a);
                next.push(b);
            }
            rest = next;
            jobs.push((start, end, mine));
            start = end;
        }
        jobs.into_par_iter().for_each_init(
            || self.registers(),
            |regs, (s, e, bufs)| {
                ctx.run_part(s, e, bufs, regs);
                // Streaming stores are weakly ordered: complete them before
                // the part counts as done.
                stream::fence();
            },
        );
        Ok(outs)
    }

    /// Scratch registers, then one staging register per output (used
    /// when outputs are written with streaming stores).
    fn registers(&self) -> Vec<Vec<u64>> {
        vec![vec![0u64; BLOCK.min(self.n)]; self.nregs + self.outputs.len()]
    }
}

/// What one execution of a loop shares between threads.
struct Ctx<'a> {
    lp: &'a FusedLoop,
    srcs: &'a [&'a [u8]],
    splats: &'a [[u8; 8]],
    /// Write outputs through staging registers and streaming stores.
    stream: bool,
    /// Contiguous inputs `(source, offset, size)` to prefetch.
    ahead: &'a [(usize, usize, usize)],
}

impl Ctx<'_> {
    /// Computes elements `start..end`; `outs` are the outputs' chunks.
    fn run_part(&self, start: usize, end: usize, mut outs: Vec<&mut [u8]>, regs: &mut [Vec<u64>]) {
        let mut i0 = start;
        while i0 < end {
            let len = BLOCK.min(end - i0);
            let next = (i0 + len)..(i0 + 2 * len).min(end);
            for &(src, offset, size) in self.ahead {
                stream::prefetch(&self.srcs[src][(offset + next.start) * size..(offset + next.end) * size]);
            }
            for inst in &self.lp.insts {
                let dst = inst.dst();
                // Take the destination out so operands can borrow the rest.
                let (mut reg, mut out): (Vec<u64>, &mut [u8]) = (Vec::new(), &mut []);
                let d: &mut [u8] = match self.lp.slots[dst] {
                    Slot::Reg { reg: r, size } => {
                        reg = std::mem::take(&mut regs[r]);
                        &mut bytemuck::cast_slice_mut(&mut reg)[..len * size]
                    }
                    Slot::Out { k, size } if self.stream => {
                        reg = std::mem::take(&mut regs[self.lp.nregs + k]);
                        &mut bytemuck::cast_slice_mut(&mut reg)[..len * size]
                    }
                    Slot::Out { k, size } => {
                        out = std::mem::take(&mut outs[k]);
                        let at = (i0 - start) * size;
                        &mut out[at..at + len * size]
                    }
                    _ => unreachable!("instructions write registers or outputs"),
                };
                match inst {
                    Inst::Compute { f, args, .. } => {
                        let mut ops = [Operand::Splat([0; 8]); 3];
                        for (o, &a) in ops.iter_mut().zip(args) {
                            *o = self.operand(a, i0, len, start, regs, &outs);
                        }
                        f(&ops[..args.len()], d);
                    }
                    Inst::Copy { arg, .. } => {
                        let size = slot_size(&self.lp.slots[dst]);
                        elementwise::copy(self.operand(*arg, i0, len, start, regs, &outs), d, size);
                    }
                    Inst::Gather { src, view, .. } => {
                        let size = slot_size(&self.lp.slots[dst]);
                        gather(self.srcs[*src], view, i0, d, size);
                    }
                }
                match self.lp.slots[dst] {
                    Slot::Reg { reg: r, .. } => regs[r] = reg,
                    Slot::Out { k, size } if self.stream => {
                        let at = (i0 - start) * size;
                        stream::copy(&bytemuck::cast_slice(&reg)[..len * size], &mut outs[k][at..at + len * size]);
                        regs[self.lp.nregs + k] = reg;
                    }
                    Slot::Out { k, .. } => outs[k] = out,
                    _ => {}
                }
            }
            i0 += len;
        }
    }

    fn operand<'b>(
        &'b self,
        s: usize,
        i0: usize,
        len: usize,
        start: usize,
        regs: &'b [Vec<u64>],
        outs: &'b [&mut [u8]],
    ) -> Operand<'b> {
        match self.lp.slots[s] {
            Slot::Contig { src, offset, size } => Operand::Slice(&self.srcs[src][(offset + i0) * size..][..len * size]),
            Slot::Reg { reg, size } => Operand::Slice(&bytemuck::cast_slice(&regs[reg])[..len * size]),
            Slot::Out { k, size } if self.stream => {
                Operand::Slice(&bytemuck::cast_slice(&regs[self.lp.nregs + k])[..len * size])
            }
            Slot::Out { k, size } => Operand::Slice(&outs[k][(i0 - start) * size..][..len * size]),
            Slot::Splat { .. } | Slot::Scalar { .. } | Slot::Const(_) => Operand::Splat(self.splats[s]),
        }
    }
}

fn slot_size(s: &Slot) -> usize {
    match *s {
        Slot::Contig { size, .. } | Slot::Splat { size, .. } | Slot::Reg { size, .. } | Slot::Out { size, .. } => size,
        Slot::Scalar { dtype, .. } => dtype.size_bytes(),
        Slot::Const(_) => 8,
    }
}

impl Builder<'_> {
    fn input(&mut self, id: NodeId) -> Val {
        let node = self.graph.node(id);
        let src = *self.source_of.entry(id).or_insert_with(|| {
            self.sources.push(Source::Node(id));
            self.sources.len() - 1
        });
        Val::View { src, view: View::contiguous(node.shape.dims()), size: node.dtype.size_bytes() }
    }

    fn value(&mut self, id: NodeId, vals: &HashMap<NodeId, Val>) -> Val {
        match vals.get(&id) {
            Some(v) => v.clone(),
            None => self.input(id),
        }
    }

    fn node(&mut self, id: NodeId, vals: &mut HashMap<NodeId, Val>) -> Option<Val> {
        let node = self.graph.node(id);
        let dims = node.shape.dims();
        let arg = |k: usize, b: &mut Self| b.value(node.inputs[k], vals);
        Some(match &node.op {
            Op::Constant(v, dt) => {
                self.slots.push(Slot::Const(elementwise::scalar_bytes(*v, *dt)));
                Val::Leaf(self.slots.len() - 1)
            }
            Op::ScalarParam(i) => {
                self.slots.push(Slot::Scalar { index: *i as usize, dtype: node.dtype });
                Val::Leaf(self.slots.len() - 1)
            }
            Op::Iota { shape, axis, dtype } => {
                // An iota the memory cannot hold now is left to the
                // interpreter, which reports it when the loop runs.
                self.owned.push(crate::source::iota(self.mem, shape.dims(), *axis, *dtype).ok()?);
                self.sources.push(Source::Owned(self.owned.len() - 1));
                Val::View { src: self.sources.len() - 1, view: View::contiguous(dims), size: dtype.size_bytes() }
            }
            Op::Reshape(_) => match arg(0, self) {
                Val::View { src, view, size } => Val::View { src, view: view.reshape(dims)?, size },
                v => v,
            },
            Op::Permute(perm) => match arg(0, self) {
                Val::View { src, view, size } => Val::View { src, view: view.permute(perm), size },
                Val::Leaf(s) => Val::Leaf(s),
                Val::Slot(_) => return None,
            },
            Op::Expand(_) => match arg(0, self) {
                Val::View { src, view, size } => Val::View { src, view: view.expand(dims), size },
                Val::Slot(s) if node.shape.numel() == self.n => Val::Slot(s),
                Val::Leaf(s) => Val::Leaf(s),
                Val::Slot(_) => return None,
            },
            Op::Slice { starts, steps, lens } => match arg(0, self) {
                Val::View { src, view, size } => Val::View { src, view: view.slice(starts, steps, lens), size },
                Val::Leaf(s) => Val::Leaf(s),
                Val::Slot(_) => return None,
            },
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) => {
                if node.shape.numel() != self.n {
                    return None;
                }
                let mut args = Vec::with_capacity(node.inputs.len());
                let mut dts = Vec::with_capacity(node.inputs.len());
                for k in 0..node.inputs.len() {
                    let v = arg(k, self);
                    args.push(self.operand(v, dims)?);
                    dts.push(self.graph.node(node.inputs[k]).dtype);
                }
                let dst = self.vreg(node.dtype.size_bytes());
                self.insts.push(Inst::Compute { f: elementwise::build(&node.op, &dts), args, dst });
                self.ops.push(node.op.label());
                Val::Slot(dst)
            }
            // Everything else (a new op included) is left to the
            // interpreter, whose match over `Op` is exhaustive: never wrong.
            _ => return None,
        })
    }

    /// The slot an operand of a consumer of shape `dims` reads.
    fn operand(&mut self, v: Val, dims: &[usize]) -> Option<usize> {
        match v {
            Val::Leaf(s) | Val::Slot(s) => Some(s),
            Val::View { src, view, size } => {
                let view = view.expand(dims).collapse();
                if let Some(&s) = self.view_slots.get(&(src, view.clone())) {
                    return Some(s);
                }
                let s = match self.classify(src, &view, size) {
                    Some(s) => s,
                    None => {
                        let dst = self.vreg(size);
                        self.insts.push(Inst::Gather { src, view: view.clone(), dst });
                        dst
                    }
                };
                self.view_slots.insert((src, view), s);
                Some(s)
            }
        }
    }

    /// A splat or contiguous slot for a collapsed view, or `None` if it
    /// needs a gather.
    fn classify(&mut self, src: usize, view: &View, size: usize) -> Option<usize> {
        let offset = view.offset as usize;
        let slot = if view.dims.is_empty() || view.strides.iter().all(|&s| s == 0) {
            Slot::Splat { src, offset, size }
        } else if view.dims.len() == 1 && view.strides[0] == 1 {
            Slot::Contig { src, offset, size }
        } else {
            return None;
        };
        self.slots.push(slot);
        Some(self.slots.len() - 1)
    }

    fn vreg(&mut self, size: usize) -> usize {
        self.slots.push(Slot::Reg { reg: self.vregs, size });
        self.vregs += 1;
        self.slots.len() - 1
    }

    /// Maps virtual registers to physical ones by liveness; returns how
    /// many physical registers the loop needs.
    fn allocate(&mut self) -> usize {
        let mut last = vec![0usize; self.vregs];
        for (i, inst) in self.insts.iter().enumerate() {
            if let Slot::Reg { reg, .. } = self.slots[inst.dst()] {
                last[reg] = last[reg].max(i);
            }
            for &a in inst.reads() {
                if let Slot::Reg { reg, .. } = self.slots[a] {
                    last[reg] = i;
                }
            }
        }
        let mut phys = vec![usize::MAX; self.vregs];
        let mut free: Vec<usize> = Vec::new();
        let mut count = 0;
        let mut live: Vec<usize> = Vec::new();
        for i in 0..self.insts.len() {
            // Registers whose last read was before this instruction.
            live.retain(|&v| {
                if last[v] < i {
                    free.push(phys[v]);
                    false
                } else {
                    true
                }
            });
            if let Slot::Reg { reg, .. } = self.slots[self.insts[i].dst()] {
                phys[reg] = free.pop().unwrap_or_else(|| {
                    count += 1;
                    count - 1
                });
                live.push(reg);
            }
        }
        for s in &mut self.slots {
            if let Slot::Reg { reg, .. } = s {
                *reg = phys[*reg];
            }
        }
        count
    }
}

/// Copies elements `i0..i0 + dst.len() / size` of a collapsed strided view.
fn gather(src: &[u8], v: &View, i0: usize, dst: &mut [u8], size: usize) {
    match size {
        1 => gather_t::<u8>(src, v, i0, dst),
        2 => gather_t::<u16>(src, v, i0, dst),
        4 => gather_t::<u32>(src, v, i0, dst),
        _ => gather_t::<u64>(src, v, i0, dst),
    }
}

fn gather_t<T: bytemuck::Pod>(src: &[u8], v: &View, i0: usize, dst: &mut [u8]) {
    let src: &[T] = bytemuck::cast_slice(src);
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let r = v.dims.len();
    let mut idx = vec![0usize; r];
    let mut rem = i0;
    let mut pos = v.offset;
    for d in (0..r).rev() {
        idx[d] = rem % v.dims[d];
        rem /= v.dims[d];
        pos += idx[d] as isize * v.strides[d];
    }
    let (last, ls) = (v.dims[r - 1], v.strides[r - 1]);
    let mut k = 0;
    while k < dst.len() {
        let run = (last - idx[r - 1]).min(dst.len() - k);
        let out = &mut dst[k..k + run];
        match ls {
            1 => out.copy_from_slice(&src[pos as usize..pos as usize + run]),
            0 => out.fill(src[pos as usize]),
            _ => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = src[(pos + j as isize * ls) as usize];
                }
            }
        }
        k += run;
        pos += run as isize * ls;
        idx[r - 1] += run;
        let mut d = r - 1;
        while idx[d] == v.dims[d] && d > 0 {
            pos -= v.dims[d] as isize * v.strides[d];
            idx[d] = 0;
            d -= 1;
            idx[d] += 1;
            pos += v.strides[d];
        }
    }
}

fn bytes(d: &CpuData) -> &[u8] {
    each_all!(d, v => bytemuck::cast_slice(v.as_slice()))
}

fn bytes_mut(d: &mut CpuData) -> &mut [u8] {
    each_all!(d, v => bytemuck::cast_slice_mut(v.as_mut_slice()))
}
