//! Glue modules: [`Sequential`], which applies modules in order and names
//! their parameters by index, and [`Flatten`], which turns image features
//! into rows between a convolution stack and a linear layer.

use super::Module;
use crate::{Result, Tensor};

/// Modules applied in order; parameters are named `"{index}.{name}"`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module + Send + Sync>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends a module.
    #[allow(clippy::should_implement_trait)] // A builder method, not `std::ops::Add`.
    pub fn add(mut self, m: impl Module + Send + Sync + 'static) -> Sequential {
        self.layers.push(Box::new(m));
        self
    }

    /// Number of modules.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// True without modules.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward(&h)?;
        }
        Ok(h)
    }

    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.layers.iter().enumerate().map(|(i, l)| (i.to_string(), l.as_ref() as &dyn Module)).collect()
    }

    fn children_mut(&mut self) -> Vec<&mut dyn Module> {
        self.layers.iter_mut().map(|l| l.as_mut() as &mut dyn Module).collect()
    }
}

/// Flattens `[N, ...]` to `[N, rest]` (PyTorch's `nn.Flatten`), as a module
/// for [`Sequential`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

impl Module for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::CallSite::enter(std::panic::Location::caller());
        if x.rank() < 2 {
            return Ok(x.clone());
        }
        x.flatten(1, -1)
    }
}
