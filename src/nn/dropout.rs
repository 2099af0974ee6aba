//! Inverted dropout: the functional [`dropout`] and the [`Dropout`]
//! module, which drops only in training mode.

use super::{Mode, Module};
use crate::{Result, Tensor};

/// Inverted dropout with the device RNG (see [`Tensor::dropout`]).
#[track_caller]
pub fn dropout(x: &Tensor, p: f64, training: bool) -> Result<Tensor> {
    x.dropout(p, training)
}

/// Dropout as a module; active in training mode ([`ModuleExt::train`](super::ModuleExt::train),
/// the default), a pass-through in evaluation mode ([`ModuleExt::eval`](super::ModuleExt::eval)).
#[derive(Clone, Debug)]
pub struct Dropout {
    /// Probability of zeroing an element.
    pub p: f64,
    training: Mode,
}

impl Dropout {
    /// Dropout with probability `p`, in training mode.
    pub fn new(p: f64) -> Dropout {
        Dropout { p, training: Mode::new(true) }
    }

    /// True in training mode.
    pub fn is_training(&self) -> bool {
        self.training.get()
    }
}

impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dropout(self.p, self.training.get())
    }

    fn set_own_training(&self, training: bool) {
        self.training.set(training)
    }
}
