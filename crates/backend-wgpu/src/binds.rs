//! Bind groups of a compiled plan, made once and reused across its
//! executions ([`BindCache`]).
//!
//! A bind group names the buffers of one launch: the uniform of lifted
//! scalars, then the kernel's inputs and outputs (or a two-pass kernel's
//! scratch). Making one per launch per execution costs host time on every
//! step of a training loop, where the same plan runs over and over on the
//! same few buffers (the buffer pool hands the same buffers back each
//! step). So each compiled plan keeps:
//!
//! - per launch, the last [`GROUPS_PER_LAUNCH`] bind groups made, keyed by
//!   the [`WgpuStorage::id`]s of the buffers bound, in binding order;
//! - per buffer the plan allocates (materialized nodes, the uniform buffer
//!   of lifted scalars, scratch), the ids
//!   of the buffers it had in its last [`HISTORY`] executions: the plan
//!   asks the pool for those first ([`Pool::acquire_preferring`]), so the
//!   same nodes get the same buffers again and the bind groups match. (The
//!   pool alone would not: buffers freed between executions, such as a
//!   parameter replaced by its update, rotate through its free lists.) Two
//!   cover the common case of an updated value, whose new buffer cannot be
//!   its old one (still being read) but can be the one before. So the
//!   uniform buffer is in effect made once per plan, and only its contents
//!   change (`queue.write_buffer` of the execution's scalar values), while
//!   the pool still counts it against the memory budget as before and may
//!   reclaim it between executions.
//!
//! Why this is safe when buffers are donated, pooled, freed and reused: a
//! bind group binds physical buffers, whole, by binding slot, exactly as a
//! fresh one for the same buffers would; what a buffer holds this time
//! does not enter it. Pool ids identify physical buffers and are never
//! reused, so a key cannot alias: a buffer freed to the pool and handed out
//! again keeps its id (and the cached group still binds exactly it), and a
//! buffer the pool destroys takes its id with it (no later key matches the
//! groups naming it; they wait, inert, to be evicted).
//!
//! Counters: `WgpuBindGroupsCreated`, `WgpuBindGroupsReused`.

#[cfg(doc)]
use crate::pool::Pool;
use crate::pool::WgpuStorage;
use lazuli_executor::metrics;

/// Bind groups kept per launch of a plan (the most recently used ones).
/// A training loop alternates between few buffer sets (a parameter and its
/// replacement swap buffers every step), so a few suffice; more would only
/// keep groups of buffers that are gone.
pub const GROUPS_PER_LAUNCH: usize = 4;

/// Buffer ids remembered per allocation of a plan (see the module doc).
pub const HISTORY: usize = 2;

/// The reusable binding state of one compiled plan.
#[derive(Default)]
pub(crate) struct BindCache {
    /// Per launch (in launch order: a two-pass kernel's first pass, then
    /// each kernel): bind groups by key, most recently used first.
    launches: Vec<Vec<(Box<[u64]>, wgpu::BindGroup)>>,
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

    /// The bind group of launch `launch` binding `bufs` (the uniform
    /// first), whole, in order: a cached one made for the same buffers,
    /// else a new one (cached, evicting the least recently used beyond
    /// [`GROUPS_PER_LAUNCH`]).
    pub fn get(
        &mut self,
        launch: usize,
        device: &wgpu::Device,
        layout: &wgpu::BindGroupLayout,
        bufs: &[&WgpuStorage],
    ) -> wgpu::BindGroup {
        if self.launches.len() <= launch {
            self.launches.resize_with(launch + 1, Vec::new);
        }
        let slot = &mut self.launches[launch];
        let same = |key: &[u64]| key.len() == bufs.len() && key.iter().zip(bufs).all(|(k, b)| *k == b.id());
        if let Some(i) = slot.iter().position(|(key, _)| same(key)) {
            slot[..=i].rotate_right(1);
            metrics::inc("WgpuBindGroupsReused", 1);
            return slot[0].1.clone();
        }
        let all: Vec<&wgpu::Buffer> = bufs.iter().map(|b| b.buffer()).collect();
        let group = create(device, layout, &all);
        slot.insert(0, (bufs.iter().map(|b| b.id()).collect(), group.clone()));
        slot.truncate(GROUPS_PER_LAUNCH);
        group
    }
}

/// A bind group of `layout` binding `bufs` whole, in binding order
/// (counted as `WgpuBindGroupsCreated`).
pub(crate) fn create(device: &wgpu::Device, layout: &wgpu::BindGroupLayout, bufs: &[&wgpu::Buffer]) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() })
        .collect();
    metrics::inc("WgpuBindGroupsCreated", 1);
    device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout, entries: &entries })
}
