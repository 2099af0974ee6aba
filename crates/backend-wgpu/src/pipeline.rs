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

    /// The cached pipeline for the key, or one made by `make` (which must
    /// create it; counted as `PipelinesCreated`).
    pub fn get_or_create<E>(
        &self,
        key: u64,
        make: impl FnOnce() -> Result<PipelineEntry, E>,
    ) -> Result<Arc<PipelineEntry>, E> {
        if let Some(p) = self.map.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(p.clone());
        }
        let p = Arc::new(make()?);
        metrics::inc("PipelinesCreated", 1);
        self.map.lock().unwrap_or_else(|e| e.into_inner()).put(key, p.clone());
        Ok(p)
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
