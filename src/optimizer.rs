//! The optimizer wrapper returned by [`Accelerator::prepare`](crate::Accelerator::prepare).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_nn::Optimizer;

use crate::accelerator::Shared;
use crate::error::Result;

/// Wraps a Candle optimizer so that a plain training loop stays unchanged:
/// [`backward_step`](AcceleratedOptimizer::backward_step) runs backward, averages the gradients
/// across ranks and steps, exactly where the loop used to call `Optimizer::backward_step`.
#[derive(Debug)]
pub struct AcceleratedOptimizer<O> {
    inner: O,
    shared: Arc<Shared>,
}

impl<O: Optimizer> AcceleratedOptimizer<O> {
    pub(crate) fn new(inner: O, shared: Arc<Shared>) -> Self {
        AcceleratedOptimizer { inner, shared }
    }

    /// Applies gradients that are already averaged (from
    /// [`Accelerator::backward`](crate::Accelerator::backward)).
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        Ok(self.inner.step(grads)?)
    }

    /// `backward` (with the gradients averaged across ranks) followed by [`step`](Self::step).
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = self.shared.backward(loss)?;
        self.step(&grads)
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    /// Sets the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutable.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Unwraps the optimizer.
    pub fn into_inner(self) -> O {
        self.inner
    }
}
