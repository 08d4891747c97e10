//! Gradient accumulation and gradient clipping.
//!
//! With `N = gradient_accumulation_steps` (builder
//! [`gradient_accumulation_steps`](crate::AcceleratorBuilder::gradient_accumulation_steps) >
//! `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS` > config key `gradient_accumulation_steps` > 1),
//! every backward is a *micro-step*:
//!
//! - the loss is scaled by `1/N` and its gradients (of the registered parameters) are added to a
//!   local store kept by the [`Accelerator`](crate::Accelerator); nothing is sent to other ranks;
//! - every `N`-th micro-step, or a micro-step told it is the last of the loader
//!   ([`backward_batch`](crate::Accelerator::backward_batch) /
//!   [`backward_step_batch`](crate::AcceleratedOptimizer::backward_step_batch) with a batch whose
//!   [`is_last`](crate::Batch::is_last) is true), is a *sync step*: the accumulated sums are
//!   averaged across ranks (one collective per bucket) and handed to the optimizer, which steps
//!   only then. A short cycle of `k < N` micro-steps is rescaled by `N/k`, so its gradient is the
//!   mean over the micro-batches actually seen;
//! - [`sync_gradients`](crate::Accelerator::sync_gradients) (also
//!   [`is_sync_step`](crate::AcceleratedOptimizer::is_sync_step)) tells whether the last
//!   micro-step was a sync step: step learning-rate schedulers, log and clip only then.
//!
//! Pending micro-steps left at the end of a loop that did not pass the batch can be synced with
//! [`AcceleratedOptimizer::flush`](crate::AcceleratedOptimizer::flush) (or
//! [`Accelerator::flush_gradients`](crate::Accelerator::flush_gradients)); every rank must call
//! it. With `N = 1` every backward is a sync step and nothing changes. With one process the
//! semantics are the same, minus the communication.

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use crate::accelerator::Shared;
use crate::error::{Error, Result};
use crate::params::ParamSet;

/// The accumulation state of one accelerator.
#[derive(Debug)]
pub(crate) struct Accumulation {
    /// Micro-steps accumulated in the current cycle.
    micro: usize,
    /// Local sums of the registered parameters' gradients (already scaled by `1/N`).
    pending: GradStore,
    /// Whether the last micro-step was a sync step.
    synced: bool,
}

impl Default for Accumulation {
    fn default() -> Self {
        Accumulation {
            micro: 0,
            pending: GradStore::default(),
            synced: true,
        }
    }
}

impl Shared {
    fn accumulation(&self) -> std::sync::MutexGuard<'_, Accumulation> {
        self.accum.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the last micro-step was a sync step (true before the first one).
    pub(crate) fn sync_gradients(&self) -> bool {
        self.accumulation().synced
    }

    /// Micro-steps accumulated and not yet synced.
    pub(crate) fn pending_micro_steps(&self) -> usize {
        self.accumulation().micro
    }

    /// One micro-step (see the module documentation); `end` forces a sync step.
    pub(crate) fn backward_micro(&self, loss: &Tensor, end: bool) -> Result<GradStore> {
        let n = self.state.gradient_accumulation_steps();
        if n == 1 {
            let grads = self.backward(loss)?;
            self.accumulation().synced = true;
            return Ok(grads);
        }
        let params = self.require_params("backward")?;
        let grads = (loss / n as f64)?.backward()?;
        self.accumulate(&params, grads, end)
    }

    /// Adds one micro-step's gradients of the registered parameters (already divided by N) to
    /// the local sums; at a sync step (the N-th micro-step, or `end`) returns the sums averaged
    /// across ranks, otherwise this rank's partial sums. Used by [`Self::backward_micro`] and by
    /// mixed precision, whose gradients come from the half-precision working copies.
    pub(crate) fn accumulate(
        &self,
        params: &ParamSet,
        grads: GradStore,
        end: bool,
    ) -> Result<GradStore> {
        let n = self.state.gradient_accumulation_steps();
        let mut acc = self.accumulation();
        let previous = std::mem::take(&mut acc.pending);
        let mut summed = GradStore::default();
        for v in params.vars() {
            let t = v.as_tensor();
            let sum = match (previous.get(t), grads.get(t)) {
                (Some(a), Some(b)) => (a + b)?,
                (Some(a), None) => a.clone(),
                (None, Some(b)) => b.clone(),
                (None, None) => continue,
            };
            summed.insert(t, sum);
        }
        acc.micro += 1;
        if acc.micro < n && !end {
            acc.synced = false;
            let local = params.copy_grads(&summed);
            acc.pending = summed;
            return Ok(local);
        }
        let k = std::mem::take(&mut acc.micro);
        acc.synced = true;
        drop(acc);
        self.finish_cycle(params, summed, k, n)
    }

    /// Syncs the pending micro-steps now, if any.
    pub(crate) fn flush(&self) -> Result<Option<GradStore>> {
        let n = self.state.gradient_accumulation_steps();
        let mut acc = self.accumulation();
        if acc.micro == 0 {
            return Ok(None);
        }
        let k = std::mem::take(&mut acc.micro);
        let summed = std::mem::take(&mut acc.pending);
        acc.synced = true;
        drop(acc);
        let params = self.require_params("flush")?;
        self.finish_cycle(&params, summed, k, n).map(Some)
    }

    /// Rescales a short cycle by `n/k` and averages across ranks.
    fn finish_cycle(
        &self,
        params: &ParamSet,
        mut grads: GradStore,
        k: usize,
        n: usize,
    ) -> Result<GradStore> {
        if k < n {
            params.scale_grads(&mut grads, n as f64 / k as f64)?;
        }
        if self.collective.world_size() > 1 {
            params.average_gradients(self.collective.as_ref(), &mut grads)?;
        }
        Ok(grads)
    }

    /// The registered parameters, or an error naming `what` if no model was prepared.
    pub(crate) fn require_params(&self, what: &str) -> Result<std::sync::Arc<ParamSet>> {
        self.params().ok_or_else(|| {
            Error::invalid(
                what,
                format!(
                    "rank {}: no model was prepared; call `accelerator.prepare(&varmap, optimizer, loader)` (or `prepare_model`) first, so the gradients to accumulate, average or clip are known",
                    self.state.rank()
                ),
            )
        })
    }

    /// See [`Accelerator::clip_grad_norm`](crate::Accelerator::clip_grad_norm).
    pub(crate) fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        check_positive("max_norm", max_norm)?;
        let params = self.require_params("clip_grad_norm")?;
        let norm = params.grad_norm(grads)?;
        if self.sync_gradients() && norm > max_norm {
            params.scale_grads(grads, max_norm / (norm + 1e-6))?;
        }
        Ok(norm)
    }

    /// See [`Accelerator::clip_grad_value`](crate::Accelerator::clip_grad_value).
    pub(crate) fn clip_grad_value(&self, grads: &mut GradStore, clip: f64) -> Result<()> {
        check_positive("clip", clip)?;
        let params = self.require_params("clip_grad_value")?;
        if self.sync_gradients() {
            params.clamp_grads(grads, clip)?;
        }
        Ok(())
    }
}

fn check_positive(what: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            what,
            format!("must be a finite number above 0, got {v}"),
        ))
    }
}
