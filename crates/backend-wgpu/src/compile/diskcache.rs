//! The persistent compile cache: what lets a second process skip work the
//! first one did. It lives in the cache directory
//! ([`crate::compile::autotune::cache_dir`]: `LAZULI_CACHE_DIR`, empty turns it
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
//! each hit). The bound counts what entries take on disk, whole blocks
//! of [`BLOCK`] bytes (a 40-byte entry takes a block), and holds entries
//! of every build and adapter that wrote there: those of older builds are
//! the least recently used and go first. What the directory holds is
//! learnt by a scan on a thread of its own, started by the process's
//! first write (timer `DiskCacheScan`): never on the path of the
//! device's creation (a directory of thousands of entries takes tens of
//! milliseconds to list), and not at all in a process that only reads,
//! which cannot grow the directory. Writes before the scan ends are
//! counted, and the bound is applied once it ends. The scan also deletes
//! temporary files an interrupted write left behind (older than
//! [`STALE_TEMP`]). Counters:
//! `DiskCacheHit`, `DiskCacheMiss`, `DiskCacheBad`, `DiskCacheWrite`,
//! `DiskCacheWriteFailed` (only the first failure is warned),
//! `DiskCacheEvicted`.

use lazuli_executor::metrics;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

/// Format version of the entry files.
pub const FORMAT: u32 = 1;

/// Default bound of the directory's entries, in bytes on disk.
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;

/// The unit file systems give files in: an entry takes its length
/// rounded up to whole blocks on disk, and the bound counts that.
pub const BLOCK: u64 = 4096;

/// A temporary file older than this was left by a write that never
/// finished (a write takes milliseconds): the scan deletes it.
pub const STALE_TEMP: Duration = Duration::from_secs(3600);

/// Prefix of the temporary files writes rename into place.
const TEMP_PREFIX: &str = ".tmp-";

/// What an entry of `len` bytes takes on disk: whole [`BLOCK`]s.
fn footprint(len: u64) -> u64 {
    len.div_ceil(BLOCK).max(1) * BLOCK
}

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
    /// What the directory's entries take on disk, shared with the scan.
    usage: Arc<Usage>,
    /// The scan of the directory, started by the first write.
    scan: Mutex<Scan>,
    /// Writes that failed: the first is warned, the others logged at
    /// debug level (a read-only directory fails every write).
    write_failures: AtomicU64,
}

/// Where the scan of a cache's directory stands.
#[derive(Debug)]
enum Scan {
    NotStarted,
    Running(std::thread::JoinHandle<()>),
    Done,
}

/// What a cache directory's entries take on disk, as far as this process
/// knows: the scan's total plus what this process wrote since (an
/// overestimate where writes replaced entries, or the scan saw a write);
/// the directory is scanned again only when it passes the bound.
#[derive(Debug, Default)]
struct Usage {
    bytes: AtomicU64,
    /// The first scan has ended: the total covers the whole directory.
    known: AtomicBool,
    /// An eviction is running (another one would only repeat it).
    evicting: AtomicBool,
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
        Some(DiskCache {
            dir: dir.to_path_buf(),
            salt: format!("{salt} lazuli {} build {}", env!("CARGO_PKG_VERSION"), build_id()),
            max_bytes,
            usage: Arc::new(Usage::default()),
            scan: Mutex::new(Scan::NotStarted),
            write_failures: AtomicU64::new(0),
        })
    }

    /// Starts the scan of the directory on a thread of its own, once
    /// (see the module's documentation).
    fn start_scan(&self) {
        let mut scan = self.scan.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(*scan, Scan::NotStarted) {
            return;
        }
        let (dir, usage, max_bytes) = (self.dir.clone(), self.usage.clone(), self.max_bytes);
        *scan = match std::thread::Builder::new()
            .name("lazuli-cache-scan".into())
            .spawn(move || first_scan(&dir, max_bytes, &usage))
        {
            Ok(running) => Scan::Running(running),
            Err(_) => {
                // No thread to be had: scan here rather than never.
                first_scan(&self.dir, self.max_bytes, &self.usage);
                Scan::Done
            }
        };
    }

    /// Starts the scan if no write has, and waits for it: the bound is
    /// applied when this returns (tests).
    pub fn wait_for_scan(&self) {
        self.start_scan();
        let scan = std::mem::replace(&mut *self.scan.lock().unwrap_or_else(|e| e.into_inner()), Scan::Done);
        if let Scan::Running(running) = scan {
            let _ = running.join();
        }
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
    /// failures are counted (`DiskCacheWriteFailed`) and the first is
    /// warned, never returned.
    pub fn put(&self, kind: &str, key: &[u8], data: &[u8]) {
        let full = self.full_key(kind, key);
        let path = self.path(kind, full);
        match write_entry(&self.dir, &path, full, data) {
            Ok(()) => {
                metrics::inc("DiskCacheWrite", 1);
                self.start_scan();
                let written = footprint((HEADER + data.len()) as u64);
                let total = self.usage.bytes.fetch_add(written, Ordering::Relaxed) + written;
                // Until the first scan ends the total is partial; the scan
                // applies the bound when it does.
                if total > self.max_bytes && self.usage.known.load(Ordering::Acquire) {
                    evict(&self.dir, self.max_bytes, &self.usage);
                }
            }
            Err(e) => {
                metrics::inc("DiskCacheWriteFailed", 1);
                if self.write_failures.fetch_add(1, Ordering::Relaxed) == 0 {
                    tracing::warn!(
                        "compile cache: cannot write {}: {e} (later failures are logged at debug level; \
                         LAZULI_CACHE_DIR= turns the cache off)",
                        path.display()
                    );
                } else {
                    tracing::debug!("compile cache: cannot write {}: {e}", path.display());
                }
            }
        }
    }

    /// What the directory holds, for `lazuli info`: its entries (of
    /// every build and adapter that wrote there) and their bytes, in all
    /// (and on disk, what the bound counts) and per kind, as in `43
    /// entries, 2.3 MiB, 2.4 MiB on disk: autotune 1 (1 KiB), naga 41
    /// (246 KiB), pipelines 1 (2.1 MiB)`. The size of `pipelines`, the
    /// driver's pipeline cache, says whether the driver keeps compiled
    /// code in it (lavapipe keeps only a header).
    pub fn contents(&self) -> String {
        let size = |b: u64| match b {
            b if b < 1 << 20 => format!("{:.0} KiB", b as f64 / 1024.0),
            b => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        };
        let entries = entries(&self.dir);
        let mut kinds = std::collections::BTreeMap::<String, (usize, u64)>::new();
        for (_, len, path) in &entries {
            let name = path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let kind = name.rsplit_once('-').map_or(name.as_str(), |(kind, _)| kind);
            let k = kinds.entry(kind.to_string()).or_default();
            *k = (k.0 + 1, k.1 + len);
        }
        let on_disk = entries.iter().map(|e| footprint(e.1)).sum();
        let mut text = format!(
            "{} entries, {}, {} on disk",
            entries.len(),
            size(entries.iter().map(|e| e.1).sum()),
            size(on_disk)
        );
        for (i, (kind, (n, bytes))) in kinds.iter().enumerate() {
            text.push_str(if i == 0 { ": " } else { ", " });
            text.push_str(&format!("{kind} {n} ({})", size(*bytes)));
        }
        text
    }
}

/// The directory's entries: modification time, length, path.
fn entries(dir: &Path) -> Vec<(SystemTime, u64, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    rd.flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == EXT))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some((m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path()))
        })
        .collect()
}

/// The scan a cache starts at its first write: deletes temporary files older
/// than [`STALE_TEMP`], adds what the entries take on disk to `usage`
/// (writes made meanwhile are already in it) and applies the bound.
fn first_scan(dir: &Path, max_bytes: u64, usage: &Usage) {
    let started = lazuli_executor::platform::Instant::now();
    let now = SystemTime::now();
    // One listing: entries counted, stale temporaries deleted.
    let mut on_disk = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = e.path();
        let Ok(meta) = e.metadata() else { continue };
        if path.extension().is_some_and(|x| x == EXT) {
            on_disk += footprint(meta.len());
        } else if e.file_name().to_string_lossy().starts_with(TEMP_PREFIX)
            && meta.modified().is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age > STALE_TEMP))
        {
            let _ = std::fs::remove_file(path);
        }
    }
    let total = usage.bytes.fetch_add(on_disk, Ordering::Relaxed) + on_disk;
    usage.known.store(true, Ordering::Release);
    if total > max_bytes {
        evict(dir, max_bytes, usage);
    }
    metrics::record_time("DiskCacheScan", started.elapsed());
}

/// Deletes the least recently used entries until the directory's entries
/// take at most three quarters of `max_bytes` on disk, when they take
/// more than `max_bytes`; `usage` then holds the total left.
fn evict(dir: &Path, max_bytes: u64, usage: &Usage) {
    if usage.evicting.swap(true, Ordering::Acquire) {
        return;
    }
    let mut entries = entries(dir);
    let mut total: u64 = entries.iter().map(|e| footprint(e.1)).sum();
    if total > max_bytes {
        entries.sort();
        let target = max_bytes / 4 * 3;
        for (_, len, path) in entries {
            if total <= target {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                metrics::inc("DiskCacheEvicted", 1);
            }
            total = total.saturating_sub(footprint(len));
        }
    }
    usage.bytes.store(total, Ordering::Relaxed);
    usage.evicting.store(false, Ordering::Release);
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
    let tmp = dir.join(format!("{TEMP_PREFIX}{}-{seq}-{full:016x}", std::process::id()));
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
        let scan_started = || !matches!(*a.scan.lock().expect("scan"), Scan::NotStarted);
        assert_eq!(a.get("k", b"x"), None);
        assert!(!scan_started(), "a cache that only reads never lists its directory");
        a.put("k", b"x", b"payload");
        assert!(scan_started(), "the first write starts the scan");
        assert_eq!(a.get("k", b"x").as_deref(), Some(&b"payload"[..]));
        let b = DiskCache::open(Some(&d), "adapter B", None).expect("opens");
        assert_eq!(b.get("k", b"x"), None, "another adapter never reads A's entry");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn writes_that_fail_are_counted_not_returned() {
        let d = tmp("ro");
        let c = DiskCache::open(Some(&d), "adapter", None).expect("opens");
        // The directory turns into a file: every write fails (a test run
        // as root cannot make a directory read-only).
        std::fs::remove_dir_all(&d).expect("removed");
        std::fs::write(&d, b"not a directory").expect("file");
        for i in 0..3u32 {
            c.put("k", &i.to_le_bytes(), b"payload");
        }
        assert_eq!(c.write_failures.load(Ordering::Relaxed), 3);
        assert_eq!(c.get("k", &0u32.to_le_bytes()), None);
        let _ = std::fs::remove_file(&d);
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
    fn eviction_keeps_the_bound_on_disk() {
        let d = tmp("evict");
        // Ten blocks: 136-byte entries take a block each on disk, so at
        // most ten stay (counting their lengths would keep all of them).
        let c = DiskCache::open(Some(&d), "adapter", Some(10 * BLOCK)).expect("opens");
        let count = || std::fs::read_dir(&d).expect("dir").flatten().count();
        for i in 0..25u32 {
            c.put("k", &i.to_le_bytes(), &[7u8; 100]);
        }
        // Writes before the scan ends are counted; the scan
        // applies the bound when it ends.
        c.wait_for_scan();
        assert!(count() <= 10, "{} entries over ten blocks after the scan", count());
        for i in 25..50u32 {
            c.put("k", &i.to_le_bytes(), &[7u8; 100]);
            assert!(count() <= 10, "{} entries over ten blocks", count());
        }
        assert!(c.get("k", &49u32.to_le_bytes()).is_some(), "the newest entry stays");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_full_directory_is_bounded_and_cleared_of_stale_temporaries_by_its_scan() {
        let d = tmp("open");
        let big = DiskCache::open(Some(&d), "old build", None).expect("opens");
        let hour_ago = SystemTime::now() - STALE_TEMP;
        for i in 0..30u32 {
            big.put("k", &i.to_le_bytes(), &[1u8; 10]);
            // Entry i was last used i seconds after an hour ago.
            let path = big.path("k", big.full_key("k", &i.to_le_bytes()));
            let f = std::fs::File::options().append(true).open(&path).expect("entry");
            f.set_modified(hour_ago + Duration::from_secs(u64::from(i))).expect("mtime");
        }
        big.wait_for_scan();
        let stale = d.join(format!("{TEMP_PREFIX}1-0-stale"));
        let fresh = d.join(format!("{TEMP_PREFIX}1-1-fresh"));
        for t in [&stale, &fresh] {
            std::fs::write(t, b"partial").expect("temporary");
        }
        std::fs::File::options()
            .append(true)
            .open(&stale)
            .and_then(|f| f.set_modified(hour_ago - Duration::from_secs(60)))
            .expect("mtime");
        let c = DiskCache::open(Some(&d), "new build", Some(8 * BLOCK)).expect("opens");
        c.wait_for_scan();
        let left: Vec<u32> =
            (0..30u32).filter(|i| big.path("k", big.full_key("k", &i.to_le_bytes())).exists()).collect();
        // Over eight blocks, the scan leaves three quarters: six, the most
        // recently used.
        assert_eq!(left, (24..30).collect::<Vec<_>>());
        assert!(!stale.exists(), "a temporary file an interrupted write left is deleted");
        assert!(fresh.exists(), "a temporary file being written stays");
        let _ = std::fs::remove_dir_all(&d);
    }
}
