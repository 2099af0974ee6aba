//! Counter-based random numbers: Philox-4x32-10 and the mapping from its
//! output words to `Op::Random` element values.
//!
//! These are pure functions, the single definition of what `Op::Random`
//! produces. Element `i` of a random tensor uses the 128-bit counter
//! `[i / 4 (low word), (i / 4) >> 32, 0, 0]`, the key `[seed, step]` and
//! output lane `i % 4`; the uniform value is `(bits >> 8) * 2^-24`, in
//! `[0, 1)`. Normals use Box-Muller over the uniforms of the element pair
//! `2 * (i / 2)`, `2 * (i / 2) + 1`.
//!
//! Every backend must port this module bit for bit (the wgpu backend does so
//! in WGSL): uniforms are bit-identical across backends; normals agree to
//! about 1e-6, since WGSL's `log`, `sqrt`, `cos` and `sin` are not
//! correctly rounded.

/// First round multiplier.
pub const M0: u32 = 0xD251_1F53;
/// Second round multiplier.
pub const M1: u32 = 0xCD9E_8D57;
/// Key schedule increment of key word 0 (golden ratio).
pub const W0: u32 = 0x9E37_79B9;
/// Key schedule increment of key word 1 (sqrt(3) - 1).
pub const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(M0, c[0]);
    let (hi1, lo1) = mulhilo(M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox-4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as
/// easy as 1, 2, 3", SC 2011), as in Random123.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for r in 0..10 {
        if r > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        c = round(c, k);
    }
    c
}

/// The raw 32 random bits of element `i` under key `[seed_word, step_word]`.
pub fn bits(seed_word: u32, step_word: u32, i: u64) -> u32 {
    let block = i / 4;
    let out = philox4x32_10([block as u32, (block >> 32) as u32, 0, 0], [seed_word, step_word]);
    out[(i % 4) as usize]
}

/// Uniform value of element `i`, in `[0, 1)`: the top 24 bits times 2^-24.
pub fn uniform_f32(seed_word: u32, step_word: u32, i: u64) -> f32 {
    (bits(seed_word, step_word, i) >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Standard normal value of element `i` (Box-Muller, computed in f32):
/// `u1 = 1 - uniform(2 * (i / 2))` in `(0, 1]`, `u2 = uniform(2 * (i / 2) + 1)`,
/// `r = sqrt(-2 ln u1)`; even elements take `r cos(2 pi u2)`, odd ones
/// `r sin(2 pi u2)`.
pub fn normal_f32(seed_word: u32, step_word: u32, i: u64) -> f32 {
    let base = i & !1;
    let u1 = 1.0 - uniform_f32(seed_word, step_word, base);
    let u2 = uniform_f32(seed_word, step_word, base + 1);
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = 2.0 * std::f32::consts::PI * u2;
    if i & 1 == 0 {
        r * theta.cos()
    } else {
        r * theta.sin()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        // Random123 kat_vectors: pi digits.
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_in_range_and_lanes() {
        let out = philox4x32_10([1, 0, 0, 0], [7, 3]);
        for (lane, word) in out.iter().enumerate() {
            let u = uniform_f32(7, 3, 4 + lane as u64);
            assert_eq!(u, (word >> 8) as f32 / 16_777_216.0);
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn normal_moments() {
        let n = 20_000u64;
        let xs: Vec<f32> = (0..n).map(|i| normal_f32(42, 0, i)).collect();
        assert!(xs.iter().all(|x| x.is_finite()));
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "{mean} {var}");
    }
}
