//! Bind groups of a compiled plan, made once and reused across its
//! executions (`BindCache`).
//!
//! A bind group names the buffer ranges of one launch (`Binding`): the
//! kernel's section of the uniform of lifted scalars (the `uniforms`
//! module), then the kernel's inputs and outputs (or a
//! two-pass kernel's scratch), each whole or, for a tensor beyond one
//! storage binding, as several windows at their offsets (see
//! [`crate::codegen::window`]), then the error slot of a kernel that checks indices
//! (8 bytes at the kernel's offset into the execution's slots buffer).
//! Making one per launch per execution costs host time on every
//! step of a training loop, where the same plan runs over and over on the
//! same few buffers (the buffer pool hands the same buffers back each
//! step). So each compiled plan keeps:
//!
//! - per launch, the last [`GROUPS_PER_LAUNCH`] bind groups made, keyed by
//!   what each binding binds, in binding order: the [`WgpuStorage::id`] of
//!   its buffer, its offset and its size;
//! - per buffer the plan allocates (materialized nodes, the uniform buffer
//!   of lifted scalars, scratch, the error slots), the ids
//!   of the buffers it had in its last [`HISTORY`] executions: the plan
//!   asks the pool for those first ([`Pool::acquire_preferring`]), so the
//!   same nodes get the same buffers again and the bind groups match. (The
//!   pool alone would not: buffers freed between executions, such as a
//!   parameter replaced by its update, rotate through its free lists.) Three
//!   cover an updated value, whose new buffer cannot be its old one (still
//!   being read) and, while the host records a step or two ahead of the
//!   device, not the one before either (still held by a queued step): it
//!   cycles through three. So the
//!   uniform buffer is in effect made once per plan, and only its contents
//!   change (`queue.write_buffer` of the execution's scalar values), while
//!   the pool still counts it against the memory budget as before and may
//!   reclaim it between executions.
//!
//! Why this is safe when buffers are donated, pooled, freed and reused: a
//! bind group binds ranges of physical buffers by binding slot, exactly as
//! a fresh one for the same ranges would; what a buffer holds this time
//! does not enter it. The key holds every range whole (id, offset, size),
//! so two windows of one buffer, or two error slots of one slots buffer,
//! never share a group. Pool ids identify physical buffers and are never
//! reused, so a key cannot alias: a buffer freed to the pool and handed out
//! again keeps its id (and the cached group still binds exactly it), and a
//! buffer the pool destroys takes its id with it (no later key matches the
//! groups naming it; they wait, inert, to be evicted).
//!
//! Counters: `WgpuBindGroupsCreated`, `WgpuBindGroupsReused`.

#[cfg(doc)]
use crate::device::pool::Pool;
use crate::device::pool::WgpuStorage;
use lazuli_executor::metrics;

/// Bind groups kept per launch of a plan (the most recently used ones).
/// A training loop alternates between few buffer sets (a parameter and its
/// replacement swap buffers every step), but a tensor made outside the
/// plan each step (a batch's labels, uploaded) takes whichever idle buffer
/// of its size class the pool has, and small tensors share one class: in
/// the digits demo such a binding rotates over up to 5 buffers, and a
/// launch with several of them over their combinations. With 4 groups the
/// demo made 5.1 bind groups a step, with 16 1.9 (one of them the loss's,
/// a new buffer every step because the loop keeps each step's loss).
/// Finding a group is a scan of short keys, far cheaper than making one.
pub const GROUPS_PER_LAUNCH: usize = 16;

/// Buffer ids remembered per allocation of a plan (see the module doc).
/// With two, the digits demo (recording two steps ahead) made 1.6 bind
/// groups a step in its steady state on lavapipe; with three 0.8, most of
/// them its loss's (the loop keeps every step's loss of an epoch, so each
/// takes a new buffer).
pub const HISTORY: usize = 3;

/// What a bind group binds: [`Binding::key`] of each binding, in order.
type Key = Box<[[u64; 3]]>;

/// The reusable binding state of one compiled plan.
#[derive(Default)]
pub(crate) struct BindCache {
    /// Per launch (in launch order: a two-pass kernel's first pass, then
    /// each kernel): bind groups by key, most recently used first.
    launches: Vec<Vec<(Key, wgpu::BindGroup)>>,
    /// Per allocation, the ids of its last buffers, most recent first (0:
    /// none).
    history: Vec<[u64; HISTORY]>,
}

impl BindCache {
    /// The ids allocation `slot` had in the last executions, most recent
    /// first.
    pub fn preferred(&self, slot: usize) -> &[u64] {
        self.history.get(slot).map_or(&[], |h| &h[..])
    }

    /// Drops the bind groups of launch `launch` (its pipeline changed).
    pub fn forget_launch(&mut self, launch: usize) {
        if let Some(groups) = self.launches.get_mut(launch) {
            groups.clear();
        }
    }

    /// Notes that allocation `slot` got buffer `id` this time.
    pub fn record(&mut self, slot: usize, id: u64) {
        if self.history.len() <= slot {
            self.history.resize(slot + 1, [0; HISTORY]);
        }
        let h = &mut self.history[slot];
        let at = h.iter().position(|&x| x == id).unwrap_or(HISTORY - 1);
        h[..=at].rotate_right(1);
        h[0] = id;
    }

    /// The bind group of launch `launch` binding `bindings` (the uniform
    /// first) in order: a cached one made for the same ranges, else a new
    /// one (cached, evicting the least recently used beyond
    /// [`GROUPS_PER_LAUNCH`]).
    pub fn get(
        &mut self,
        launch: usize,
        device: &wgpu::Device,
        layout: &wgpu::BindGroupLayout,
        bindings: &[Binding],
    ) -> wgpu::BindGroup {
        if self.launches.len() <= launch {
            self.launches.resize_with(launch + 1, Vec::new);
        }
        let slot = &mut self.launches[launch];
        let same =
            |key: &[[u64; 3]]| key.len() == bindings.len() && key.iter().zip(bindings).all(|(k, b)| *k == b.key());
        if let Some(i) = slot.iter().position(|(key, _)| same(key)) {
            slot[..=i].rotate_right(1);
            metrics::inc("WgpuBindGroupsReused", 1);
            return slot[0].1.clone();
        }
        let group = create(device, layout, bindings);
        slot.insert(0, (bindings.iter().map(Binding::key).collect(), group.clone()));
        slot.truncate(GROUPS_PER_LAUNCH);
        group
    }
}

/// One binding of a launch: `size` bytes at `offset` of a pooled buffer
/// (the whole buffer, one window of it, or an error slot).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Binding<'a> {
    /// The buffer.
    pub storage: &'a WgpuStorage,
    /// Byte offset of the range.
    pub offset: u64,
    /// Bytes of the range.
    pub size: u64,
}

impl<'a> Binding<'a> {
    /// All of `storage`.
    pub fn whole(storage: &'a WgpuStorage) -> Binding<'a> {
        Binding { storage, offset: 0, size: storage.buffer().size() }
    }

    /// What identifies the range across executions: the buffer's id (never
    /// reused), the offset and the size.
    fn key(&self) -> [u64; 3] {
        [self.storage.id(), self.offset, self.size]
    }
}

/// A bind group of `layout` binding `bindings` in binding order (counted
/// as `WgpuBindGroupsCreated`).
pub(crate) fn create(device: &wgpu::Device, layout: &wgpu::BindGroupLayout, bindings: &[Binding]) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = bindings
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: b.storage.buffer(),
                offset: b.offset,
                size: wgpu::BufferSize::new(b.size),
            }),
        })
        .collect();
    metrics::inc("WgpuBindGroupsCreated", 1);
    device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
}

/// A bind group of `layout` binding `bufs` whole, in binding order, made
/// outside any plan's cache (the sizes of a generic kernel, autotuning's
/// operands; counted as `WgpuBindGroupsCreated`).
pub(crate) fn create_whole(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    bufs: &[&wgpu::Buffer],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    metrics::inc("WgpuBindGroupsCreated", 1);
    device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
}
