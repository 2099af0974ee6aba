//! The pipeline cache: compute pipelines keyed by the hash of the whole
//! WGSL source and entry point (the bind group layout follows from the
//! source), bounded LRU.

use lazuli_executor::metrics;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};

/// A compute pipeline with its bind group layout.
#[derive(Debug)]
pub struct PipelineEntry {
    /// The pipeline.
    pub pipeline: wgpu::ComputePipeline,
    /// Layout of bind group 0.
    pub layout: wgpu::BindGroupLayout,
    /// Layout of bind group 1, the dynamic sizes of a kernel generic over
    /// sizes (see [`crate::generic`]); `None` for a static kernel.
    pub dims_layout: Option<wgpu::BindGroupLayout>,
}

/// Bounded cache of pipelines.
pub struct PipelineCache {
    map: Mutex<lru::LruCache<u64, Arc<PipelineEntry>>>,
}

impl PipelineCache {
    /// A cache holding up to `cap` pipelines.
    pub fn new(cap: usize) -> PipelineCache {
        let cap = NonZeroUsize::new(cap.max(1)).expect("non-zero");
        PipelineCache { map: Mutex::new(lru::LruCache::new(cap)) }
    }

    /// The cache key of a source and entry point.
    pub fn key(source: &str, entry: &str) -> u64 {
        lazuli_ir::stable_hash(&(source, entry))
    }

    /// The cached pipeline for the key, if any.
    pub fn get(&self, key: u64) -> Option<Arc<PipelineEntry>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned()
    }

    /// Caches a pipeline made elsewhere (counted as `PipelinesCreated`).
    pub fn insert(&self, key: u64, entry: Arc<PipelineEntry>) {
        metrics::inc("PipelinesCreated", 1);
        self.map.lock().unwrap_or_else(|e| e.into_inner()).put(key, entry);
    }

    /// Number of cached pipelines.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
