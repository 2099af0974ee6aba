//! Tensor shapes ([`Shape`]): dimension lists, element counts, strides and
//! numpy-style broadcasting.
//!
//! Shapes of up to four dims live inline, so cloning one (every recorded
//! op infers and stores a few) allocates nothing. Rejected alternative: a
//! fixed-rank array, which would cap the rank the engine supports.

use smallvec::SmallVec;
use std::fmt;

/// Dims held inline; more spill to the heap.
const INLINE_DIMS: usize = 4;

/// The dimensions of a tensor, outermost first. A rank-0 shape is a scalar.
/// Hashes, compares and prints exactly as the slice of its dims.
#[derive(Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Shape(SmallVec<[usize; INLINE_DIMS]>);

impl Clone for Shape {
    /// A copy of the dims in one block move (`SmallVec`'s own `Clone`
    /// goes element by element through an iterator, which shows in
    /// profiles of recording: a recorded op clones several shapes).
    fn clone(&self) -> Shape {
        Shape(SmallVec::from_slice(&self.0))
    }
}

impl Shape {
    /// A shape from dimension sizes.
    pub fn new(dims: impl AsRef<[usize]>) -> Shape {
        Shape(SmallVec::from_slice(dims.as_ref()))
    }

    /// The rank-0 shape.
    pub fn scalar() -> Shape {
        Shape(SmallVec::new())
    }

    /// The dims as a vector, to edit and make a new shape from.
    pub fn to_vec(&self) -> Vec<usize> {
        self.0.to_vec()
    }

    /// Dimension sizes.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar, 0 if any dimension is 0).
    /// Saturates at `usize::MAX` instead of overflowing: such a shape can
    /// never be materialized, and the executor refuses it at record time.
    pub fn numel(&self) -> usize {
        if self.0.contains(&0) {
            return 0;
        }
        self.0.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }

    /// Row-major (C order) strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.0.len()];
        let mut acc = 1;
        for (i, d) in self.0.iter().enumerate().rev() {
            strides[i] = acc;
            acc *= *d;
        }
        strides
    }

    /// Numpy broadcasting of two shapes; `None` if they are incompatible.
    pub fn broadcast(&self, other: &Shape) -> Option<Shape> {
        // The common cases of recording, without the loop: equal shapes,
        // and a rank-0 operand (`x * 0.5`).
        if self == other || other.rank() == 0 {
            return Some(self.clone());
        }
        if self.rank() == 0 {
            return Some(other.clone());
        }
        let rank = self.rank().max(other.rank());
        let mut out: SmallVec<[usize; INLINE_DIMS]> = smallvec::smallvec![0; rank];
        for (i, slot) in out.iter_mut().enumerate() {
            let a = dim_from_right(&self.0, rank - 1 - i);
            let b = dim_from_right(&other.0, rank - 1 - i);
            *slot = match (a, b) {
                (a, b) if a == b => a,
                (1, b) => b,
                (a, 1) => a,
                _ => return None,
            };
        }
        Some(Shape(out))
    }

    /// True if `self` can be broadcast to `target` (numpy rules, one way).
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        if self.rank() > target.rank() {
            return false;
        }
        let off = target.rank() - self.rank();
        self.0.iter().enumerate().all(|(i, &d)| d == 1 || d == target.0[off + i])
    }

    /// Resolves a possibly negative axis against this rank.
    pub fn axis(&self, axis: isize) -> Option<usize> {
        let r = self.rank() as isize;
        let a = if axis < 0 { axis + r } else { axis };
        (0..r).contains(&a).then_some(a as usize)
    }
}

fn dim_from_right(dims: &[usize], k: usize) -> usize {
    if k < dims.len() {
        dims[dims.len() - 1 - k]
    } else {
        1
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(SmallVec::from_vec(v))
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape::new(v)
    }
}

impl From<&Vec<usize>> for Shape {
    fn from(v: &Vec<usize>) -> Self {
        Shape::new(v)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape::new(v)
    }
}

/// `&[2, 3]`, the shape PyTorch users write (`[2, 3]` works too).
impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(v: &[usize; N]) -> Self {
        Shape::new(v)
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

impl FromIterator<usize> for Shape {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        Shape(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        let a = Shape::new([3, 1, 5]);
        let b = Shape::new([4, 1]);
        assert_eq!(a.broadcast(&b), Some(Shape::new([3, 4, 5])));
        assert_eq!(Shape::new([2]).broadcast(&Shape::new([3])), None);
        assert_eq!(Shape::new([0, 1]).broadcast(&Shape::new([1, 4])), Some(Shape::new([0, 4])));
        assert!(Shape::new([1, 5]).broadcasts_to(&Shape::new([2, 3, 5])));
        assert!(!Shape::new([2, 5]).broadcasts_to(&Shape::new([3, 5])));
    }

    #[test]
    fn inline_and_spilled_shapes_hash_and_compare_as_their_dims() {
        use crate::stable_hash;
        for dims in [vec![], vec![3], vec![2, 3, 4, 5], vec![2, 3, 4, 5, 6, 7]] {
            let s = Shape::from(dims.clone());
            assert_eq!(s.dims(), &dims[..]);
            assert_eq!(stable_hash(&s), stable_hash(&dims), "{dims:?}");
            assert_eq!(format!("{s:?}"), format!("Shape({dims:?})"));
            assert_eq!(Shape::new(&dims), s);
            assert_eq!(dims.iter().copied().collect::<Shape>(), s);
        }
        assert!(Shape::new([2, 3]) < Shape::new([2, 4]));
    }

    #[test]
    fn strides_and_numel() {
        let s = Shape::new([2, 3, 4]);
        assert_eq!(s.strides(), vec![12, 4, 1]);
        assert_eq!(s.numel(), 24);
        assert_eq!(Shape::scalar().numel(), 1);
        assert_eq!(s.axis(-1), Some(2));
        assert_eq!(s.axis(3), None);
    }
}
