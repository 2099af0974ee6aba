//! Publishes a hash of this crate's sources and manifest to the build
//! scripts of the crates that depend on it (`links = "lazuli_ir"`: they
//! read it as `DEP_LAZULI_IR_SOURCE_HASH`). lazuli-wgpu's build id mixes
//! it in: the IR's passes and fusion planning decide the kernels it
//! generates, so its persistent kernel cache of one build must never be
//! read by a build on other IR code. Only this crate's own files are read,
//! so the packaged crate builds the same.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "toml") {
            out.push(p);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let mut all = Vec::new();
    for d in [root.join("src"), root.join("Cargo.toml")] {
        println!("cargo:rerun-if-changed={}", d.display());
        if d.is_dir() {
            files(&d, &mut all);
        } else {
            all.push(d);
        }
    }
    all.sort();
    // FNV-1a over each file's path relative to the crate and its bytes.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in &all {
        let rel = f.strip_prefix(&root).unwrap_or(f);
        eat(rel.to_string_lossy().as_bytes());
        eat(&[0]);
        eat(&std::fs::read(f).unwrap_or_default());
        eat(&[0]);
    }
    println!("cargo:source_hash={h:016x}");
}
