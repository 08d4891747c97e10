//! The optimizer wrapper returned by [`Accelerator::prepare`](crate::Accelerator::prepare), and
//! [`TrainOptimizer`], the part that every optimizer shares with both wrappers.

use crate::optim::{OptimizerState, StateShard, StatefulOptimizer};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::Tensor;
use candle_nn::Optimizer;

use crate::data::Batch;
use crate::error::Result;
use crate::train::grad_sync::{Clipping, GradSync};
use crate::train::loss_scaler::{take_saved, SCALER_CLEAN, SCALER_SCALE};
use crate::train::token_weights::TokenLoss;

/// The learning rate of an optimizer, as a schedule ([`Schedule`](crate::scheduler::Schedule))
/// sets it: implemented by every Candle [`Optimizer`] (so by [`optim::AdamW`](crate::optim::AdamW)
/// and [`optim::Sgd`](crate::optim::Sgd)) and by both wrappers, [`AcceleratedOptimizer`] and
/// [`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer). The wrappers also share
/// clipping (`set_clip_grad_norm`, `set_clip_grad_value`, `last_grad_norm`) and checkpoints
/// ([`StatefulOptimizer`](crate::optim::StatefulOptimizer)).
pub trait TrainOptimizer {
    /// The learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate.
    fn set_lr(&mut self, lr: f64);
}

impl<O: Optimizer> TrainOptimizer for O {
    fn lr(&self) -> f64 {
        self.learning_rate()
    }
    fn set_lr(&mut self, lr: f64) {
        self.set_learning_rate(lr)
    }
}

impl<O: Optimizer> TrainOptimizer for AcceleratedOptimizer<O> {
    fn lr(&self) -> f64 {
        self.inner.learning_rate()
    }
    fn set_lr(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }
}

/// Wraps a Candle optimizer so that a plain training loop stays unchanged:
/// [`backward_step`](AcceleratedOptimizer::backward_step) runs backward, averages the gradients
/// across ranks and steps, exactly where the loop used to call `Optimizer::backward_step`.
///
/// With gradient accumulation (`N > 1`, see [`Accelerator::backward`](crate::Accelerator::backward)) each call is a micro-step and
/// the wrapped optimizer steps only on sync steps; use
/// [`backward_step_batch`](Self::backward_step_batch) so the loader's last batch syncs, and
/// [`is_sync_step`](Self::is_sync_step) to step schedulers. Optional clipping
/// ([`set_clip_grad_norm`](Self::set_clip_grad_norm),
/// [`set_clip_grad_value`](Self::set_clip_grad_value)) is applied in every step that applies
/// gradients, after they were averaged.
#[derive(Debug)]
pub struct AcceleratedOptimizer<O> {
    inner: O,
    grads: Arc<GradSync>,
    clip: Clipping,
    last_norm: Option<f64>,
    /// ZeRO: whether the wrapped optimizer was cut down to this rank's slices.
    sharded: bool,
}

/// ZeRO-3: moves `opt` onto the units' shards (`params`: every parameter of the sharded model
/// with this rank's pieces), when it is one of the optimizers that can be sharded.
pub(crate) fn rebase_optimizer<O: Optimizer + 'static>(
    opt: &mut O,
    params: &[crate::optim::ParamPieces],
) -> Result<()> {
    let any = opt as &mut dyn std::any::Any;
    if let Some(adamw) = any.downcast_mut::<crate::optim::AdamW>() {
        return adamw.rebase(params);
    }
    if let Some(sgd) = any.downcast_mut::<crate::optim::Sgd>() {
        return sgd.rebase(params);
    }
    Err(crate::error::Error::invalid(
        "zero_stage",
        format!(
            "stage 3 steps the parameters' shards with `accelerate_rs::optim::AdamW` or `accelerate_rs::optim::Sgd`, not `{}`",
            std::any::type_name::<O>()
        ),
    ))
}

/// ZeRO: cuts `opt` down to this rank's `shards`, when it is one of the optimizers that can be
/// sharded.
fn shard_optimizer<O: Optimizer + 'static>(
    opt: &mut O,
    shards: &[crate::optim::Shard],
) -> Result<()> {
    let any = opt as &mut dyn std::any::Any;
    if let Some(adamw) = any.downcast_mut::<crate::optim::AdamW>() {
        return adamw.shard(shards);
    }
    if let Some(sgd) = any.downcast_mut::<crate::optim::Sgd>() {
        return sgd.shard(shards);
    }
    Err(crate::error::Error::invalid(
        "zero_stage",
        format!(
            "sharding the optimizer state needs `accelerate_rs::optim::AdamW` or `accelerate_rs::optim::Sgd`, not `{}` (it keeps state for every parameter and cannot be cut into slices)",
            std::any::type_name::<O>()
        ),
    ))
}

impl<O: Optimizer> AcceleratedOptimizer<O> {
    pub(crate) fn new(inner: O, grads: Arc<GradSync>) -> Self {
        AcceleratedOptimizer {
            inner,
            grads,
            clip: Clipping::default(),
            last_norm: None,
            sharded: false,
        }
    }

    /// ZeRO-3: a wrapper around an optimizer already moved onto the units' shards.
    pub(crate) fn new_sharded(inner: O, grads: Arc<GradSync>) -> Self {
        AcceleratedOptimizer {
            sharded: true,
            ..Self::new(inner, grads)
        }
    }

    /// The gradient engine this optimizer steps from.
    pub(crate) fn engine(&self) -> &GradSync {
        &self.grads
    }

    /// Whether the wrapped optimizer holds only this rank's slices of the state (ZeRO).
    pub fn is_sharded(&self) -> bool {
        self.sharded
    }
}

impl<O: Optimizer + 'static> AcceleratedOptimizer<O> {
    /// Steps the wrapped optimizer on gradients ready to apply; under ZeRO it steps only this
    /// rank's slices (cutting the optimizer down on the first step) and then gathers the
    /// parameters from their owners.
    fn apply(&mut self, grads: &GradStore) -> Result<()> {
        // Stage 3: the optimizer was moved onto the units' shards when it was prepared (or it
        // steps parameters replicated beside them whole); nothing is gathered after the step.
        if self.grads.zero_stage() == 0 {
            return Ok(self.inner.step(grads)?);
        }
        if self.grads.zero_stage() >= 3 {
            self.inner.step(grads)?;
            return self.grads.after_sharded_step();
        }
        if !self.sharded {
            let shards = self.grads.shards()?;
            shard_optimizer(&mut self.inner, &shards)?;
            self.sharded = true;
        }
        self.inner.step(grads)?;
        self.grads.gather_params()
    }

    /// Applies gradients that are already averaged (from
    /// [`Accelerator::backward`](crate::Accelerator::backward)), clipped first if clipping was
    /// set. Does nothing when the last micro-step was not a sync step (gradient accumulation),
    /// so `let grads = accelerator.backward(&loss)?; opt.step(&grads)?;` is right for any `N`.
    pub fn step(&mut self, grads: &GradStore) -> Result<()> {
        if !self.grads.sync_gradients() {
            return Ok(());
        }
        let clock = std::sync::Arc::clone(self.grads.clock());
        clock.measure(crate::tracking::timing::Phase::Optimizer, || {
            // ZeRO-3 under fp16: an overflow on any rank skips the step on every rank.
            if !self.grads.loss_scale_verdict(grads)? {
                return Ok(());
            }
            match self.grads.clipped(grads, self.clip)? {
                None => {
                    if self.grads.check_finite(grads, None)? {
                        self.apply(grads)?;
                    }
                    Ok(())
                }
                Some((clipped, norm)) => {
                    if norm.is_some() {
                        self.last_norm = norm;
                    }
                    if self.grads.check_finite(&clipped, norm)? {
                        self.apply(&clipped)?;
                    }
                    Ok(())
                }
            }
        })
    }

    /// `backward` (with the gradients averaged across ranks) followed by [`step`](Self::step).
    /// With gradient accumulation: one micro-step, stepping only on sync steps.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        self.micro_step(loss, false).map(drop)
    }

    /// [`backward_step`](Self::backward_step) that also syncs and steps when `batch` is the
    /// loader's last ([`Batch::is_last`]), so a partial accumulation cycle is applied at the end
    /// of every epoch. The loop to write with gradient accumulation.
    pub fn backward_step_batch(&mut self, loss: &Tensor, batch: &Batch) -> Result<()> {
        self.micro_step(loss, batch.is_last()).map(drop)
    }

    /// [`backward_step`](Self::backward_step) for a token-weighted loss: the micro-batch's loss
    /// summed over its target tokens and their count. The optimizer steps on the mean over every
    /// target token of all the step's micro-batches on all ranks (one more all-reduce, of the
    /// count, per step), as one process would on the whole batch; see
    /// [`TokenLoss`]. The micro-steps of one optimizer step must all be
    /// token-weighted or all not.
    pub fn backward_step_tokens(&mut self, loss: &TokenLoss) -> Result<()> {
        self.micro_step_tokens(loss, false).map(drop)
    }

    /// [`backward_step_tokens`](Self::backward_step_tokens) that also syncs and steps when
    /// `batch` is the loader's last.
    pub fn backward_step_tokens_batch(&mut self, loss: &TokenLoss, batch: &Batch) -> Result<()> {
        self.micro_step_tokens(loss, batch.is_last()).map(drop)
    }

    /// One token-weighted micro-step; returns whether it stepped.
    pub(crate) fn micro_step_tokens(&mut self, loss: &TokenLoss, end: bool) -> Result<bool> {
        match self.grads.backward_tokens(loss, end)? {
            Some(grads) => self.step(&grads).map(|()| true),
            None => Ok(false),
        }
    }

    /// One micro-step; returns whether it stepped.
    pub(crate) fn micro_step(&mut self, loss: &Tensor, end: bool) -> Result<bool> {
        match self.grads.backward(loss, end)? {
            Some(grads) => self.step(&grads).map(|()| true),
            None => Ok(false),
        }
    }

    /// Syncs and applies pending micro-steps now (e.g. after a loop that used
    /// [`backward_step`](Self::backward_step) over a loader whose length is not a multiple of
    /// `N`). Returns whether it stepped; with nothing pending it communicates nothing. All ranks
    /// must call it at the same point.
    pub fn flush(&mut self) -> Result<bool> {
        match self.grads.flush()? {
            Some(grads) => self.step(&grads).map(|()| true),
            None => Ok(false),
        }
    }
}

impl<O: Optimizer> AcceleratedOptimizer<O> {
    /// Whether the last micro-step was a sync step (the wrapped optimizer stepped); always true
    /// without gradient accumulation. Step learning-rate schedulers only when it is true.
    pub fn is_sync_step(&self) -> bool {
        self.grads.sync_gradients()
    }

    /// Clip gradients to this global L2 norm (see
    /// [`Accelerator::clip_grad_norm`](crate::Accelerator::clip_grad_norm)) in every step;
    /// `None` turns it off. The norm is read back with [`last_grad_norm`](Self::last_grad_norm).
    pub fn set_clip_grad_norm(&mut self, max_norm: Option<f64>) {
        self.clip.norm = max_norm;
    }

    /// Clamp every gradient to `[-clip, clip]` in every step (after norm clipping, if set);
    /// `None` turns it off.
    pub fn set_clip_grad_value(&mut self, clip: Option<f64>) {
        self.clip.value = clip;
    }

    /// The global gradient norm (before clipping) of the last step that clipped by norm.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_norm
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

/// A ZeRO-sharded optimizer's [`optimizer_state`](StatefulOptimizer::optimizer_state) is
/// gathered from every rank into the unsharded layout (every rank must take it:
/// [`state_needs_every_rank`](StatefulOptimizer::state_needs_every_rank)); its
/// [`optimizer_state_shard`](StatefulOptimizer::optimizer_state_shard) is this rank's slices,
/// which checkpoints write one file per rank.
///
/// At ZeRO stage 3 under fp16 the sharded model's loss scale and clean-step count are saved too
/// (the scalar tensors `loss_scaler.scale` and `loss_scaler.clean_steps`, with rank 0's
/// slices), so a resumed run scales as the uninterrupted one.
impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for AcceleratedOptimizer<O> {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        let mut state = self.inner().optimizer_state()?;
        if self.is_sharded() {
            // Each element is one rank's; the others hold zeros there.
            let c = self.engine().collective();
            for (_, t) in state.tensors.iter_mut() {
                *t = c.all_reduce_tensor(t, crate::collective::ReduceOp::Sum)?;
            }
        }
        for (name, value) in self.scale_state() {
            let t = Tensor::new(value, &candle_core::Device::Cpu)?;
            state.tensors.push((name.into(), t));
        }
        Ok(state)
    }
    fn state_needs_every_rank(&self) -> bool {
        self.is_sharded()
    }
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        if !self.is_sharded() {
            return Ok(None);
        }
        let Some(mut shard) = self.inner().optimizer_state_shard()? else {
            return Ok(None);
        };
        let rank0 = self.engine().collective().rank() == 0;
        for (name, value) in self.scale_state() {
            shard.layout.push((name.into(), Vec::new()));
            if rank0 {
                let t = Tensor::new(&[value], &candle_core::Device::Cpu)?;
                shard.pieces.push((name.into(), 0, t));
            }
        }
        Ok(Some(shard))
    }
    fn load_optimizer_state(&mut self, mut state: OptimizerState) -> Result<()> {
        let saved = take_saved(&mut state)?;
        self.inner_mut().load_optimizer_state(state)?;
        if let (Some(s), Some((scale, clean))) = (self.grads.sharded(), saved) {
            s.restore_scale(scale, clean);
        }
        Ok(())
    }
}

impl<O> AcceleratedOptimizer<O> {
    /// ZeRO-3 under fp16: the loss scale's state to checkpoint, by name (empty otherwise).
    fn scale_state(&self) -> Vec<(&'static str, f64)> {
        match self.grads.sharded().and_then(|s| s.scale_state()) {
            Some((scale, clean)) => vec![(SCALER_SCALE, scale), (SCALER_CLEAN, clean as f64)],
            None => Vec::new(),
        }
    }
}
