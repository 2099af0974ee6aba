//! `einsum`: Einstein summation with PyTorch's (and numpy's) spec syntax,
//! lowered to the public ops: permutes and reshapes around one batched
//! matmul per pair of operands, and sums for indices that appear in one
//! operand only. No IR op of its own, so every backend runs it natively
//! and autograd differentiates it through the ops it records.
//!
//! A spec is `"ij,jk->ik"`: one term of ASCII letters per operand, and
//! after `->` the output's letters; without `->` the output is every letter
//! that appears exactly once, in alphabetical order (implicit mode).
//! Spaces are ignored. Operands are contracted left to right: for each
//! pair, the letters both hold and something later needs are batch dims,
//! those only one holds stay, and those both hold and nothing later needs
//! are summed by the matmul (a pair with nothing to sum, an outer or
//! elementwise product, is a broadcast multiply instead). A letter of
//! size 1 in one operand broadcasts to its size in the others, as in
//! PyTorch. Not supported, each a clear error: a letter repeated within
//! one term (a diagonal, `ii->i`), an ellipsis (`...`), and sizes of one
//! letter that differ where neither is 1.

use crate::{ExecError, Result, Tensor};
use lazuli_ir::{IrError, Shape};
use std::panic::Location;

impl Tensor {
    /// Einstein summation over `operands` as `spec` says (PyTorch's
    /// `torch.einsum`; see the module documentation for the syntax and the
    /// limits): `einsum("bij,bjk->bik", &[&a, &b])` is a batched matmul,
    /// `einsum("ij->ji", &[&a])` a transpose, `einsum("i,i->", ..)` a dot
    /// product. Lowered to permutes, reshapes, batched matmuls and sums,
    /// so it is differentiable and needs the dtypes those ops take.
    #[track_caller]
    pub fn einsum(spec: &str, operands: &[&Tensor]) -> Result<Tensor> {
        einsum_at(spec, operands, Location::caller())
    }
}

/// [`Tensor::einsum`] as a free function, with PyTorch's argument order.
#[track_caller]
pub fn einsum(spec: &str, operands: &[&Tensor]) -> Result<Tensor> {
    einsum_at(spec, operands, Location::caller())
}

fn einsum_at(spec: &str, operands: &[&Tensor], at: &'static Location<'static>) -> Result<Tensor> {
    let shapes = || operands.iter().map(|t| t.shape().to_string()).collect::<Vec<_>>().join(", ");
    let fail = |detail: String| {
        ExecError::ir(
            IrError::Shape {
                op: "einsum".into(),
                detail: format!("spec {spec:?} with operand shapes [{}]: {detail}", shapes()),
            },
            at,
        )
    };
    let spec_clean: String = spec.chars().filter(|c| !c.is_whitespace()).collect();
    if spec_clean.contains("...") {
        return Err(fail("ellipsis (...) is not supported; name every dim with a letter".into()));
    }
    let (lhs, rhs) = match spec_clean.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (spec_clean.as_str(), None),
    };
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    if terms.len() != operands.len() {
        return Err(fail(format!("{} terms but {} operands", terms.len(), operands.len())));
    }
    let mut sizes: Vec<(char, usize)> = Vec::new();
    for (term, t) in terms.iter().zip(operands) {
        if let Some(c) = term.iter().find(|c| !c.is_ascii_alphabetic()) {
            return Err(fail(format!("{c:?} is not a letter")));
        }
        if term.len() != t.rank() {
            return Err(fail(format!(
                "term {:?} has {} letters for rank {}",
                String::from_iter(term),
                term.len(),
                t.rank()
            )));
        }
        for (i, &c) in term.iter().enumerate() {
            if term[..i].contains(&c) {
                return Err(fail(format!(
                    "letter {c:?} repeats within term {:?} (diagonals are not supported)",
                    String::from_iter(term)
                )));
            }
            let d = t.dims()[i];
            match sizes.iter_mut().find(|(l, _)| *l == c) {
                Some((_, s)) if *s != d && *s != 1 && d != 1 => {
                    return Err(fail(format!(
                        "letter {c:?} stands for sizes {s} and {d} (only a size of 1 broadcasts)"
                    )));
                }
                Some((_, s)) => *s = (*s).max(d),
                None => sizes.push((c, d)),
            }
        }
    }
    let output: Vec<char> = match rhs {
        Some(r) => {
            let out: Vec<char> = r.chars().collect();
            for (i, &c) in out.iter().enumerate() {
                if !c.is_ascii_alphabetic() {
                    return Err(fail(format!("{c:?} is not a letter")));
                }
                if out[..i].contains(&c) {
                    return Err(fail(format!("output letter {c:?} repeats")));
                }
                if !sizes.iter().any(|(l, _)| *l == c) {
                    return Err(fail(format!("output letter {c:?} is in no operand")));
                }
            }
            out
        }
        None => {
            let mut once: Vec<char> = sizes
                .iter()
                .map(|&(c, _)| c)
                .filter(|&c| terms.iter().flatten().filter(|&&l| l == c).count() == 1)
                .collect();
            once.sort_unstable();
            once
        }
    };
    if operands.is_empty() {
        return Err(fail("needs at least one operand".into()));
    }
    // A letter of size 1 in one operand broadcasts to its size elsewhere.
    let size_of = |c: &char| sizes.iter().find(|(l, _)| l == c).map_or(1, |&(_, s)| s);
    let expanded: Vec<Tensor> = terms
        .iter()
        .zip(operands)
        .map(|(term, t)| {
            let dims: Vec<usize> = term.iter().map(size_of).collect();
            if dims == t.dims() {
                Ok((*t).clone())
            } else {
                t.expand(Shape::from(dims))
            }
        })
        .collect::<Result<_>>()?;
    let operands: Vec<&Tensor> = expanded.iter().collect();
    // Contract left to right; `needed(k)` is what the output and the
    // operands after `k` hold.
    let needed = |k: usize| -> Vec<char> {
        let mut v = output.clone();
        v.extend(terms[k + 1..].iter().flatten());
        v
    };
    let mut acc = sum_unneeded(operands[0], &terms[0], |c| needed(0).contains(&c))?;
    for k in 1..operands.len() {
        let later = needed(k);
        let (a, a_letters) = acc;
        let (b, b_letters) = sum_unneeded(operands[k], &terms[k], |c| later.contains(&c) || a_letters.contains(&c))?;
        // `a` may still hold letters only it has that nothing needs.
        let (a, a_letters) = sum_unneeded(&a, &a_letters, |c| later.contains(&c) || b_letters.contains(&c))?;
        acc = contract(&a, &a_letters, &b, &b_letters, &later)?;
    }
    let (t, letters) = acc;
    let (t, letters) = sum_unneeded(&t, &letters, |c| output.contains(&c))?;
    let perm: Vec<isize> = output
        .iter()
        .map(|c| letters.iter().position(|l| l == c).expect("every output letter survives") as isize)
        .collect();
    if perm.iter().enumerate().all(|(i, &p)| i as isize == p) {
        Ok(t)
    } else {
        t.permute(&perm)
    }
}

/// `t` (dims named by `letters`) summed over the letters `keep` rejects.
fn sum_unneeded(t: &Tensor, letters: &[char], keep: impl Fn(char) -> bool) -> Result<(Tensor, Vec<char>)> {
    let drop: Vec<isize> = (0..letters.len()).filter(|&i| !keep(letters[i])).map(|i| i as isize).collect();
    if drop.is_empty() {
        return Ok((t.clone(), letters.to_vec()));
    }
    let kept = letters.iter().copied().filter(|&c| keep(c)).collect();
    Ok((t.sum(&drop, false)?, kept))
}

/// `a` and `b` contracted over the letters both hold and `later` does not:
/// batch letters first, then `a`'s own, then `b`'s own.
fn contract(a: &Tensor, al: &[char], b: &Tensor, bl: &[char], later: &[char]) -> Result<(Tensor, Vec<char>)> {
    let batch: Vec<char> = al.iter().copied().filter(|c| bl.contains(c) && later.contains(c)).collect();
    let summed: Vec<char> = al.iter().copied().filter(|c| bl.contains(c) && !later.contains(c)).collect();
    let left: Vec<char> = al.iter().copied().filter(|c| !bl.contains(c)).collect();
    let right: Vec<char> = bl.iter().copied().filter(|c| !al.contains(c)).collect();
    let pos = |ls: &[char], c: &char| ls.iter().position(|l| l == c).expect("a letter of the operand") as isize;
    let size = |t: &Tensor, ls: &[char], group: &[char]| -> usize {
        group.iter().map(|c| t.dims()[pos(ls, c) as usize]).product()
    };
    let dims_of = |t: &Tensor, ls: &[char], group: &[char]| -> Vec<usize> {
        group.iter().map(|c| t.dims()[pos(ls, c) as usize]).collect()
    };
    let order = |ls: &[char], groups: [&[char]; 3]| -> Vec<isize> {
        groups.iter().flat_map(|g| g.iter().map(|c| pos(ls, c))).collect()
    };
    let (nb, nl, nc, nr) = (size(a, al, &batch), size(a, al, &left), size(a, al, &summed), size(b, bl, &right));
    let pa = a.permute(&order(al, [&batch, &left, &summed]))?.reshape_to([nb, nl, nc])?;
    let pb = b.permute(&order(bl, [&batch, &summed, &right]))?.reshape_to([nb, nc, nr])?;
    let mut dims = dims_of(a, al, &batch);
    dims.extend(dims_of(a, al, &left));
    dims.extend(dims_of(b, bl, &right));
    // Nothing summed: an outer product per batch, a broadcast multiply
    // rather than a matmul over a length of 1.
    let prod = if summed.is_empty() { pa.mul(&pb)? } else { pa.matmul(&pb)? };
    let out = prod.reshape_to(Shape::from(dims))?;
    let letters = batch.iter().chain(&left).chain(&right).copied().collect();
    Ok((out, letters))
}
