//! Streaming (non-temporal) stores for large outputs.
//!
//! An ordinary store to a line that is not in the cache first reads the
//! line from memory ("read for ownership"), so a loop that writes a large
//! output moves its bytes twice. Streaming stores write whole lines
//! straight to memory: an elementwise loop then moves only its input and
//! output once each. They are weakly ordered, so a writer calls [`fence`]
//! before others may read what it wrote.

/// Copies `src` to `dst` (same length), with streaming stores where the
/// CPU has them.
#[inline]
pub(crate) fn copy(src: &[u8], dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Unaligned head, up to the first 16-byte boundary of `dst`.
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let (s, d) = (&src[head..], &mut dst[head..]);
        let body = d.len() / 16 * 16;
        for (sc, dc) in s[..body].chunks_exact(16).zip(d[..body].chunks_exact_mut(16)) {
            // SAFETY: both chunks are 16 bytes long, `dc` is 16-byte
            // aligned (it starts at the aligned head plus a multiple of 16)
            // and SSE2 is part of the x86_64 baseline.
            #[allow(unsafe_code)]
            unsafe {
                let v = _mm_loadu_si128(sc.as_ptr().cast::<__m128i>());
                _mm_stream_si128(dc.as_mut_ptr().cast::<__m128i>(), v);
            }
        }
        d[body..].copy_from_slice(&s[body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders this thread's earlier streaming stores before its later stores.
#[inline]
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no preconditions (SSE, part of the baseline).
    #[allow(unsafe_code)]
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}

/// Asks for the cache lines of `bytes` to be loaded ahead of use.
#[inline]
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch is a hint that never faults; the address is
        // inside `bytes`.
        #[allow(unsafe_code)]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast::<i8>());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}
