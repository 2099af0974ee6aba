//! The persistent compile cache (`LAZULI_CACHE_DIR`): a second device on
//! the same directory validates no kernel again and reuses the driver's
//! pipeline cache; corrupt, truncated and foreign entries are ignored
//! with `DiskCacheBad` and results stay right; concurrent writers leave a
//! valid cache. Every test uses its own directory under the temp dir.

mod common;
use lazuli::metrics;
use lazuli::prelude::*;
use std::path::{Path, PathBuf};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lazuli-disk-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A fresh wgpu device caching under `d`, or None without an adapter.
fn device(d: &Path) -> Option<Device> {
    common::wgpu()?;
    let opts = lazuli::WgpuDeviceOptions { cache_dir: Some(Some(d.to_path_buf())), ..Default::default() };
    Some(Device::wgpu_with(opts).expect("a wgpu device"))
}

/// A few kernels of different kinds: matmul, a row softmax, elementwise.
fn program(dev: &Device) -> Vec<f32> {
    let a = Tensor::from_slice(&common::rand_vec(24 * 16, 3, -1.0, 1.0), [24, 16], dev).unwrap();
    let b = Tensor::from_slice(&common::rand_vec(16 * 8, 4, -1.0, 1.0), [16, 8], dev).unwrap();
    let y = a.matmul(&b).unwrap();
    let y = lazuli::nn::softmax(&y, -1).unwrap();
    let y = ((y * 3.0).unwrap() + 0.25).unwrap().tanh().unwrap();
    y.to_vec::<f32>().unwrap()
}

fn entries(d: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(d)
        .map(|rd| rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "lzc")).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn second_device_parses_and_validates_nothing_and_agrees() {
    let _g = common::metrics_lock();
    let d = dir("second");
    let Some(first) = device(&d) else { return };
    let n0 = metrics::counter("NagaValidations");
    let want = program(&first);
    assert!(metrics::counter("NagaValidations") > n0, "the first device validates its kernels");
    drop(first);
    assert!(!entries(&d).is_empty(), "the first device wrote entries");
    let second = device(&d).expect("a second device");
    let (n1, h1, b1) =
        (metrics::counter("NagaValidations"), metrics::counter("DiskCacheHit"), metrics::counter("DiskCacheBad"));
    let read = metrics::counter("NagaModulesRead");
    let got = program(&second);
    assert_eq!(metrics::counter("NagaValidations") - n1, 0, "the second device validated a kernel again");
    assert!(metrics::counter("NagaModulesRead") > read, "the second device parsed its kernels again");
    // `lazuli info` says what the cache holds.
    let report = second.configuration();
    let row = report.settings.iter().find(|s| s.variable == "LAZULI_CACHE_DIR").expect("a cache row");
    assert!(row.value.contains(" entries, ") && row.value.contains("naga "), "{}", row.value);
    assert!(metrics::counter("DiskCacheHit") > h1, "the second device had no disk hits");
    assert_eq!(metrics::counter("DiskCacheBad") - b1, 0);
    assert_eq!(got, want, "same kernels, same results");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn corrupt_truncated_and_foreign_entries_are_ignored() {
    let _g = common::metrics_lock();
    let d = dir("bad");
    let Some(first) = device(&d) else { return };
    let want = program(&first);
    drop(first);
    let files = entries(&d);
    assert!(files.len() >= 2, "entries written: {files:?}");
    type Mangle = fn(&mut Vec<u8>);
    let mangles: [(&str, Mangle); 4] = [
        ("flipped byte", |b| *b.last_mut().expect("payload") ^= 0x55),
        ("truncated", |b| b.truncate(b.len() / 2)),
        ("another build or adapter", |b| b[8] ^= 1),
        ("another format", |b| b[4] = 0xee),
    ];
    for (what, mangle) in mangles {
        // A clean cache, then every entry mangled.
        let fresh = device(&d).expect("a device");
        program(&fresh);
        drop(fresh);
        for f in entries(&d) {
            let mut bytes = std::fs::read(&f).expect("an entry");
            mangle(&mut bytes);
            std::fs::write(&f, &bytes).expect("rewritten");
        }
        let b0 = metrics::counter("DiskCacheBad");
        let n0 = metrics::counter("NagaValidations");
        let dev = device(&d).expect("a device");
        let got = program(&dev);
        assert!(metrics::counter("DiskCacheBad") > b0, "{what}: not detected");
        assert!(metrics::counter("NagaValidations") > n0, "{what}: a bad mark skipped validation");
        assert_eq!(got, want, "{what}: result changed");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn concurrent_writers_leave_a_valid_cache() {
    let _g = common::metrics_lock();
    let d = dir("concurrent");
    if common::wgpu().is_none() {
        return;
    }
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3).map(|_| s.spawn(|| program(&device(&d).expect("a device")))).collect();
        hs.into_iter().map(|h| h.join().expect("a writer thread")).collect()
    });
    assert!(results.windows(2).all(|w| w[0] == w[1]));
    let leftovers: Vec<_> = std::fs::read_dir(&d)
        .expect("the dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    let b0 = metrics::counter("DiskCacheBad");
    let n0 = metrics::counter("NagaValidations");
    let got = program(&device(&d).expect("a device"));
    assert_eq!(metrics::counter("DiskCacheBad") - b0, 0, "a writer left a bad entry");
    assert_eq!(metrics::counter("NagaValidations") - n0, 0);
    assert_eq!(got, results[0]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn off_when_the_dir_is_none() {
    let _g = common::metrics_lock();
    if common::wgpu().is_none() {
        return;
    }
    let opts = lazuli::WgpuDeviceOptions { cache_dir: Some(None), ..Default::default() };
    let dev = Device::wgpu_with(opts).expect("a device");
    let (h, m, w) =
        (metrics::counter("DiskCacheHit"), metrics::counter("DiskCacheMiss"), metrics::counter("DiskCacheWrite"));
    program(&dev);
    assert_eq!(metrics::counter("DiskCacheHit") - h, 0);
    assert_eq!(metrics::counter("DiskCacheMiss") - m, 0);
    assert_eq!(metrics::counter("DiskCacheWrite") - w, 0);
}
