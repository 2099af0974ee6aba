//! The persistent compile cache: what lets a second process skip work the
//! first one did. It lives in the cache directory
//! ([`crate::autotune::cache_dir`]: `LAZULI_CACHE_DIR`, empty turns it
//! off) as one file per entry, `<kind>-<key hex>.lzc`, and holds
//!
//! - `naga`: per kernel source (WGSL and entry point), its naga module
//!   as parsed and validated (naga's IR in its serde layout, encoded with
//!   `postcard`; naga's version is pinned and in the build id), so the
//!   same source is neither parsed nor validated again: wgpu makes its
//!   shader module from the stored one;
//! - `pipelines`: the driver's pipeline cache (wgpu `PipelineCache`,
//!   where the adapter has `Features::PIPELINE_CACHE`), loaded at device
//!   creation so pipelines rebuild from the driver's cache.
//!
//! Invariant: an entry never applies where it was not made. Every key is
//! salted with the adapter (name, vendor, device, backend, driver, driver
//! info), the Lazuli version and the build id (`LAZULI_BUILD_ID`, a hash
//! of the backend's and the IR's sources computed by `build.rs`), and
//! every file carries a magic number, the format version, its full key
//! and the length and checksum of its payload. A file that does not
//! match (corrupt, truncated, another build or adapter) is ignored with a
//! warning and counted as `DiskCacheBad`.
//!
//! The cache is best-effort: IO errors never fail a computation. Writes
//! go to a temporary file renamed into place, so concurrent processes
//! never see a partial entry, and the directory is kept under
//! `LAZULI_CACHE_MAX_BYTES` (default [`DEFAULT_MAX_BYTES`]) by deleting
//! the least recently used entries (by modification time, refreshed on
//! each hit). Counters: `DiskCacheHit`, `DiskCacheMiss`, `DiskCacheBad`,
//! `DiskCacheWrite`, `DiskCacheEvicted`.

use lazuli_executor::metrics;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Format version of the entry files.
pub const FORMAT: u32 = 1;

/// Default bound of the directory's entries, in bytes.
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;

const MAGIC: &[u8; 4] = b"LZC\x01";
const HEADER: usize = 4 + 4 + 8 + 8 + 8;
const EXT: &str = "lzc";

/// The build id: a hash of the sources that decide generated kernels.
pub fn build_id() -> &'static str {
    env!("LAZULI_BUILD_ID")
}

/// A driver pipeline cache on `device`, started from `data` (a blob of
/// an earlier [`wgpu::PipelineCache::get_data`]) when given.
#[allow(unsafe_code)]
pub fn driver_cache(device: &wgpu::Device, data: Option<&[u8]>) -> wgpu::PipelineCache {
    // SAFETY: `data` comes from `PipelineCache::get_data` on an adapter
    // with the same identity and driver: its disk cache key is salted with
    // both and the entry's checksum matched. wgpu checks its own header
    // besides, and `fallback` turns an unusable blob into an empty cache.
    unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor { label: Some("lazuli"), data, fallback: true })
    }
}

/// Why an entry was not read.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The entry's path.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// The file is not a valid entry for this key.
    #[error("{path}: {reason}")]
    Invalid {
        /// The entry's path.
        path: PathBuf,
        /// What did not match.
        reason: &'static str,
    },
}

/// The checksum of payloads and the hash of keys: the project's stable
/// hash, identical across runs of one build (every key is salted with the
/// build id, so no entry is read by another build).
pub fn checksum(parts: &[&[u8]]) -> u64 {
    lazuli_ir::stable_hash(&parts)
}

/// The persistent cache of one backend.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    salt: String,
    max_bytes: u64,
    /// Bytes the directory's entries hold, as of the last scan plus what
    /// this process wrote since (an overestimate where writes replaced
    /// entries); the directory is scanned again only when it passes
    /// `max_bytes`.
    bytes: std::sync::atomic::AtomicU64,
}

impl DiskCache {
    /// The cache under `dir` for entries salted with `salt` (the adapter's
    /// identity; the version and build id are added), or `None` when
    /// `dir` is `None` or cannot be created (warned).
    pub fn open(dir: Option<&Path>, salt: &str, max_bytes: Option<u64>) -> Option<DiskCache> {
        let dir = dir?;
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::warn!("compile cache off: cannot create {}: {e}", dir.display());
            return None;
        }
        let max_bytes = max_bytes.unwrap_or(DEFAULT_MAX_BYTES);
        let cache = DiskCache {
            dir: dir.to_path_buf(),
            salt: format!("{salt} lazuli {} build {}", env!("CARGO_PKG_VERSION"), build_id()),
            max_bytes,
            bytes: std::sync::atomic::AtomicU64::new(0),
        };
        cache.bytes.store(cache.entries().iter().map(|e| e.1).sum(), std::sync::atomic::Ordering::Relaxed);
        Some(cache)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The full key of `(kind, key)`: salted with adapter and build.
    fn full_key(&self, kind: &str, key: &[u8]) -> u64 {
        checksum(&[self.salt.as_bytes(), kind.as_bytes(), key])
    }

    fn path(&self, kind: &str, full: u64) -> PathBuf {
        self.dir.join(format!("{kind}-{full:016x}.{EXT}"))
    }

    /// The payload stored for `(kind, key)`, if a valid entry exists
    /// (counted as a hit or a miss; an invalid one is warned and counted
    /// as `DiskCacheBad`).
    pub fn get(&self, kind: &str, key: &[u8]) -> Option<Vec<u8>> {
        let full = self.full_key(kind, key);
        let path = self.path(kind, full);
        match read_entry(&path, full) {
            Ok(Some(data)) => {
                metrics::inc("DiskCacheHit", 1);
                // Refresh the entry's age for eviction; best-effort.
                if let Ok(f) = std::fs::File::options().append(true).open(&path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                Some(data)
            }
            Ok(None) => {
                metrics::inc("DiskCacheMiss", 1);
                None
            }
            Err(e) => {
                tracing::warn!("compile cache: ignoring an invalid entry: {e}");
                metrics::inc("DiskCacheBad", 1);
                metrics::inc("DiskCacheMiss", 1);
                // A bad entry is replaced by the next write; remove it now
                // so it is not read again.
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Stores `data` for `(kind, key)` (counted as `DiskCacheWrite`);
    /// failures are warned, never returned.
    pub fn put(&self, kind: &str, key: &[u8], data: &[u8]) {
        let full = self.full_key(kind, key);
        let path = self.path(kind, full);
        match write_entry(&self.dir, &path, full, data) {
            Ok(()) => {
                metrics::inc("DiskCacheWrite", 1);
                let written = (HEADER + data.len()) as u64;
                if self.bytes.fetch_add(written, std::sync::atomic::Ordering::Relaxed) + written > self.max_bytes {
                    self.evict();
                }
            }
            Err(e) => tracing::warn!("compile cache: cannot write {}: {e}", path.display()),
        }
    }

    /// What the directory holds, for `lazuli info`: its entries (of
    /// every build and adapter that wrote there) and their bytes, in all
    /// and per kind, as in `43 entries, 2.3 MiB: autotune 1 (1 KiB), naga
    /// 41 (246 KiB), pipelines 1 (2.1 MiB)`. The size of `pipelines`, the
    /// driver's pipeline cache, says whether the driver keeps compiled
    /// code in it (lavapipe keeps only a header).
    pub fn contents(&self) -> String {
        let size = |b: u64| match b {
            b if b < 1 << 20 => format!("{:.0} KiB", b as f64 / 1024.0),
            b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        };
        let entries = self.entries();
        let mut kinds = std::collections::BTreeMap::<String, (usize, u64)>::new();
        for (_, len, path) in &entries {
            let name = path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let kind = name.rsplit_once('-').map_or(name.as_str(), |(kind, _)| kind);
            let k = kinds.entry(kind.to_string()).or_default();
            *k = (k.0 + 1, k.1 + len);
        }
        let mut text = format!("{} entries, {}", entries.len(), size(entries.iter().map(|e| e.1).sum()));
        for (i, (kind, (n, bytes))) in kinds.iter().enumerate() {
            text.push_str(if i == 0 { ": " } else { ", " });
            text.push_str(&format!("{kind} {n} ({})", size(*bytes)));
        }
        text
    }

    /// The directory's entries: modification time, length, path.
    fn entries(&self) -> Vec<(std::time::SystemTime, u64, PathBuf)> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        rd.flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == EXT))
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                Some((m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path()))
            })
            .collect()
    }

    /// Deletes the least recently used entries while the directory holds
    /// more than the bound (down to three quarters of it), from a fresh
    /// scan (other processes write here too).
    fn evict(&self) {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        if total > self.max_bytes {
            entries.sort();
            let target = self.max_bytes / 4 * 3;
            for (_, len, path) in entries {
                if total <= target {
                    break;
                }
                if std::fs::remove_file(&path).is_ok() {
                    metrics::inc("DiskCacheEvicted", 1);
                }
                total = total.saturating_sub(len);
            }
        }
        self.bytes.store(total, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Reads the entry at `path` for full key `full`: `Ok(None)` when there
/// is none.
fn read_entry(path: &Path, full: u64) -> Result<Option<Vec<u8>>, EntryError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(EntryError::Io { path: path.to_path_buf(), source }),
    };
    let bad = |reason| Err(EntryError::Invalid { path: path.to_path_buf(), reason });
    if bytes.len() < HEADER {
        return bad("truncated header");
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
    if &bytes[0..4] != MAGIC {
        return bad("not a Lazuli cache entry");
    }
    if u32::from_le_bytes(bytes[4..8].try_into().unwrap_or([0; 4])) != FORMAT {
        return bad("another format version");
    }
    if word(8) != full {
        return bad("another key (adapter, build or kernel)");
    }
    let len = word(16);
    let payload = &bytes[HEADER..];
    if payload.len() as u64 != len {
        return bad("truncated or extended payload");
    }
    if checksum(&[payload]) != word(24) {
        return bad("checksum mismatch");
    }
    Ok(Some(payload.to_vec()))
}

/// Writes an entry atomically: a temporary file in `dir` renamed to
/// `path`.
fn write_entry(dir: &Path, path: &Path, full: u64, data: &[u8]) -> std::io::Result<()> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".tmp-{}-{seq}-{full:016x}", std::process::id()));
    let mut bytes = Vec::with_capacity(HEADER + data.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&FORMAT.to_le_bytes());
    bytes.extend_from_slice(&full.to_le_bytes());
    bytes.extend_from_slice(&(data.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&checksum(&[data]).to_le_bytes());
    bytes.extend_from_slice(data);
    let written = (|| {
        // No fsync: a file a crash leaves short or empty fails its length
        // or checksum check and is ignored. The file is closed before the
        // rename.
        std::fs::File::create(&tmp)?.write_all(&bytes)?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lazuli-diskcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trip_and_salt() {
        let d = tmp("rt");
        let a = DiskCache::open(Some(&d), "adapter A", None).expect("opens");
        assert_eq!(a.get("k", b"x"), None);
        a.put("k", b"x", b"payload");
        assert_eq!(a.get("k", b"x").as_deref(), Some(&b"payload"[..]));
        let b = DiskCache::open(Some(&d), "adapter B", None).expect("opens");
        assert_eq!(b.get("k", b"x"), None, "another adapter never reads A's entry");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn corrupt_truncated_and_foreign_entries_are_ignored() {
        let d = tmp("bad");
        let c = DiskCache::open(Some(&d), "adapter", None).expect("opens");
        let full = c.full_key("k", b"x");
        let path = c.path("k", full);
        for (what, mangle) in [
            (
                "flipped payload byte",
                Box::new(|b: &mut Vec<u8>| *b.last_mut().expect("payload") ^= 1) as Box<dyn Fn(&mut Vec<u8>)>,
            ),
            ("truncated", Box::new(|b: &mut Vec<u8>| b.truncate(b.len() - 3))),
            ("truncated header", Box::new(|b: &mut Vec<u8>| b.truncate(10))),
            ("foreign key", Box::new(|b: &mut Vec<u8>| b[8] ^= 1)),
            ("format", Box::new(|b: &mut Vec<u8>| b[4] = 9)),
        ] {
            c.put("k", b"x", b"some payload");
            let mut bytes = std::fs::read(&path).expect("written");
            mangle(&mut bytes);
            std::fs::write(&path, &bytes).expect("rewritten");
            assert!(read_entry(&path, full).is_err(), "{what} detected");
            assert_eq!(c.get("k", b"x"), None, "{what} ignored");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn eviction_keeps_the_bound() {
        let d = tmp("evict");
        let c = DiskCache::open(Some(&d), "adapter", Some(10_000)).expect("opens");
        for i in 0..50u32 {
            c.put("k", &i.to_le_bytes(), &[7u8; 1000]);
        }
        let total: u64 = std::fs::read_dir(&d).expect("dir").flatten().map(|e| e.metadata().expect("meta").len()).sum();
        assert!(total <= 10_000, "{total} bytes over the bound");
        assert!(c.get("k", &49u32.to_le_bytes()).is_some(), "the newest entry stays");
        let _ = std::fs::remove_dir_all(&d);
    }
}
