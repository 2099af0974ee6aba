//! The uniform of lifted scalars an execution binds, in sections.
//!
//! A kernel declares only the graph's scalars it reads, in its own order
//! (`P.s0`, `P.s1`, ...; [`Wgsl::scalars`] names them by graph index), so
//! the same kernel in two plans whose graphs lift other scalars (the
//! first optimizer step and the later ones, a training step and its
//! evaluation) is one source and one pipeline. An execution therefore
//! writes one uniform buffer holding a *section* per distinct list of
//! scalars among its kernels and first passes: `P.z` (always 0), then
//! those scalars' 32-bit words, padded to 16 bytes, each section at an
//! offset aligned as uniform bindings require; each launch binds its
//! kernel's section. The first section, `[0]`, serves every kernel that
//! reads no scalar. The layout is a function of the kernels alone, so a
//! steady loop binds the same ranges every step and its bind groups are
//! reused (see [`crate::device::binds`]).

use crate::codegen::Wgsl;
use lazuli_ir::{DType, ScalarValue};

/// The sections of one execution's uniform buffer.
#[derive(Debug)]
pub(crate) struct Sections {
    /// Each section's scalars (graph indices), its offset and its size in
    /// bytes; the first has none.
    sections: Vec<(Vec<usize>, u64, u64)>,
    /// Bytes of the whole buffer.
    bytes: u64,
}

impl Sections {
    /// The sections for `kernels` (each with its first pass, if any),
    /// every one at a multiple of `align` bytes (the adapter's
    /// `min_uniform_buffer_offset_alignment`).
    pub fn of<'a>(kernels: impl IntoIterator<Item = &'a Wgsl>, align: u64) -> Sections {
        let align = align.max(16);
        let mut sections: Vec<(Vec<usize>, u64, u64)> = vec![(Vec::new(), 0, 16)];
        let mut bytes: u64 = 16;
        for w in kernels {
            for list in std::iter::once(&w.scalars).chain(w.pre.as_ref().map(|p| &p.scalars)) {
                if sections.iter().any(|(s, ..)| s == list) {
                    continue;
                }
                let offset = bytes.next_multiple_of(align);
                let size = section_bytes(list.len());
                sections.push((list.clone(), offset, size));
                bytes = offset + size;
            }
        }
        Sections { sections, bytes }
    }

    /// The range (offset, size) of the section holding `scalars`.
    ///
    /// # Panics
    /// If no section holds them: every kernel of the execution was given
    /// to [`Sections::of`].
    pub fn range(&self, scalars: &[usize]) -> (u64, u64) {
        let (_, offset, size) =
            self.sections.iter().find(|(s, ..)| s == scalars).expect("every kernel's scalars have a section");
        (*offset, *size)
    }

    /// The buffer's words: each section's `P.z` and scalar values of
    /// `dtypes` (the graph's scalars), zeros between sections.
    pub fn words(&self, dtypes: &[DType], values: &[ScalarValue]) -> Vec<u32> {
        let mut words = vec![0u32; (self.bytes / 4) as usize];
        for (list, offset, _) in &self.sections {
            let s = section(list.iter().map(|&i| scalar_word(dtypes[i], &values[i])));
            let at = (*offset / 4) as usize;
            words[at..at + s.len()].copy_from_slice(&s);
        }
        words
    }
}

/// Bytes of a uniform section of `scalars` scalars: `P.z` and one word
/// each, padded to 16 bytes (the length of [`section`]'s words).
pub(crate) fn section_bytes(scalars: usize) -> u64 {
    ((1 + scalars) as u64 * 4).next_multiple_of(16)
}

/// The words of one section: `P.z` (0), then `scalars` (see
/// [`scalar_word`]), padded to 16 bytes.
pub(crate) fn section(scalars: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut words = vec![0];
    words.extend(scalars);
    words.resize(section_bytes(words.len() - 1) as usize / 4, 0);
    words
}

/// The 32-bit word of a lifted scalar `value` of dtype `d` in a uniform.
pub(crate) fn scalar_word(d: DType, value: &ScalarValue) -> u32 {
    match d {
        DType::F32 => (value.as_f64() as f32).to_bits(),
        // f16 and bf16 scalars are f32 in registers (values already
        // rounded to their dtype by the executor).
        DType::F16 | DType::BF16 => (value.cast(d).as_f64() as f32).to_bits(),
        DType::I32 => value.as_i64() as i32 as u32,
        DType::Bool => value.as_bool() as u32,
        _ => value.as_u64() as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(scalars: &[usize], pre: Option<&[usize]>) -> Wgsl {
        Wgsl {
            source: String::new(),
            entry: "main",
            invocations: 1,
            inputs: 0,
            outputs: 0,
            workgroup_size: 1,
            pre: pre.map(|p| Box::new(kernel(p, None))),
            scratch: 0,
            binds_inputs: false,
            error_slot: false,
            trusted: false,
            generic_form: false,
            scalars: scalars.to_vec(),
        }
    }

    #[test]
    fn kernels_with_the_same_scalars_share_a_section_at_an_aligned_offset() {
        let ks = [kernel(&[], None), kernel(&[3, 1], None), kernel(&[1, 3], Some(&[3, 1])), kernel(&[], Some(&[2]))];
        let s = Sections::of(&ks, 256);
        assert_eq!(s.range(&[]), (0, 16));
        assert_eq!(s.range(&[3, 1]), (256, 16));
        assert_eq!(s.range(&[1, 3]), (512, 16));
        assert_eq!(s.range(&[2]), (768, 16));
        assert_eq!(s.bytes, 784);
        let dtypes = [DType::F32, DType::I32, DType::F32, DType::Bool];
        let values = [ScalarValue::Float(0.5), ScalarValue::Int(-2), ScalarValue::Float(4.0), ScalarValue::Bool(true)];
        let w = s.words(&dtypes, &values);
        assert_eq!(&w[64..68], &[0, 1, (-2i32) as u32, 0], "P.z, then s0 = scalar 3, s1 = scalar 1");
        assert_eq!(&w[128..131], &[0, (-2i32) as u32, 1]);
        assert_eq!(&w[192..194], &[0, 4.0f32.to_bits()]);
        assert!(w[..4].iter().all(|&x| x == 0));
    }

    #[test]
    fn a_section_of_five_scalars_takes_two_rows_of_16_bytes() {
        let ks = [kernel(&[0, 1, 2, 3, 4], None)];
        let s = Sections::of(&ks, 16);
        assert_eq!(s.range(&[0, 1, 2, 3, 4]), (16, 32));
        assert_eq!(s.bytes, 48);
    }
}
