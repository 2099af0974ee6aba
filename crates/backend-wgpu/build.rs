//! Computes `LAZULI_BUILD_ID`, a hash of the sources that decide what the
//! backend generates (this crate's, and `lazuli-ir`'s through the hash its
//! build script publishes, `DEP_LAZULI_IR_SOURCE_HASH`) and of this
//! crate's manifest (which pins naga, whose IR the cache stores), so the
//! persistent kernel cache of one build is never read by another (see
//! `src/diskcache.rs`). Only this crate's own files are read, so the
//! packaged crate builds the same.

use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "wgsl" || x == "toml") {
            out.push(p);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let dirs = [root.join("src"), root.join("Cargo.toml")];
    let mut all = Vec::new();
    for d in &dirs {
        println!("cargo:rerun-if-changed={}", d.display());
        if d.is_dir() {
            files(d, &mut all);
        } else {
            all.push(d.clone());
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
    println!("cargo:rerun-if-env-changed=DEP_LAZULI_IR_SOURCE_HASH");
    eat(std::env::var("DEP_LAZULI_IR_SOURCE_HASH").unwrap_or_default().as_bytes());
    eat(&[0]);
    for f in &all {
        let rel = f.strip_prefix(&root).unwrap_or(f);
        eat(rel.to_string_lossy().as_bytes());
        eat(&[0]);
        eat(&std::fs::read(f).unwrap_or_default());
        eat(&[0]);
    }
    println!("cargo:rustc-env=LAZULI_BUILD_ID={h:016x}");
}
