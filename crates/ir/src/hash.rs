//! Stable structural hashing: a small FxHash-style hasher so that node and
//! graph hashes are cheap and identical across runs of one build.

use std::hash::{Hash, Hasher};

/// A fast, deterministic, non-cryptographic 64-bit hasher (FxHash mixing
/// with a final avalanche), used for node and graph hashes.
#[derive(Clone, Copy, Debug, Default)]
pub struct StableHasher {
    state: u64,
}

const K: u64 = 0xf135_7aea_2e62_a9c5;

impl StableHasher {
    /// A hasher with the fixed initial state.
    pub fn new() -> StableHasher {
        StableHasher { state: 0x243f_6a88_85a3_08d3 }
    }

    #[inline]
    fn add(&mut self, word: u64) {
        self.state = (self.state.rotate_left(26) ^ word).wrapping_mul(K);
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        // splitmix64 finalizer: spreads every input bit over the output.
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("chunk of 8")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut buf = [0u8; 8];
            buf[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(buf) ^ ((rest.len() as u64) << 59));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }

    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

/// Hashes any `Hash` value with [`StableHasher`].
pub fn stable_hash<T: Hash + ?Sized>(value: &T) -> u64 {
    let mut h = StableHasher::new();
    value.hash(&mut h);
    h.finish()
}
