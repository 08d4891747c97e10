//! Mixed precision: the optimizer that keeps f32 masters for bf16/f16 working copies.

use crate::optim::{OptimizerState, StateShard, StatefulOptimizer};
use candle_core::backprop::GradStore;
use candle_core::Device;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, VarMap};

use crate::data::Batch;
use crate::error::{Error, Result};
use crate::settings::MixedPrecision;
use crate::train::loss_scaler::{take_saved, LossScaler, SCALER_CLEAN, SCALER_SCALE};
use crate::train::optimizer::{AcceleratedOptimizer, TrainOptimizer};
use crate::train::params::Parameters;
use crate::train::token_weights::TokenLoss;

/// The optimizer returned by [`Accelerator::prepare_mixed`](crate::Accelerator::prepare_mixed):
/// f32 master weights, half-precision working copies.
///
/// Mixed precision: compute in bf16 or f16, keep f32 *master* weights on the optimizer side.
///
/// [`Accelerator::prepare_mixed`](crate::Accelerator::prepare_mixed) takes the model's `VarMap`
/// built in **f32** (the masters), the optimizer built on those f32 variables, and the loader. It
/// prepares the masters exactly like [`prepare`](crate::Accelerator::prepare) (verified across
/// ranks, rank 0's values broadcast), then creates a second `VarMap` of *working copies*: one
/// variable per master, same name, cast to the compute dtype (bf16 or f16). Build the model a
/// second time from the working copies and run forward and backward with it:
///
/// ```
/// use accelerate_rs::{Accelerator, DataLoader, MixedPrecision, TensorDataset};
/// use candle_core::{DType, Module, Tensor};
/// use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let accelerator = Accelerator::builder().mixed_precision(MixedPrecision::Bf16).build()?;
///     let device = accelerator.device().clone();
///     let x = Tensor::randn(0f32, 1.0, (64, 4), &device)?;
///     let y = x.sum_keepdim(1)?;
///
///     let master = VarMap::new(); // f32 masters
///     linear(4, 1, VarBuilder::from_varmap(&master, DType::F32, &device).pp("fc"))?;
///     let opt = SGD::new(master.all_vars(), 0.05)?;
///     let loader = DataLoader::new(TensorDataset::new(vec![x, y])?, 16);
///     let (mut opt, mut loader, work) = accelerator.prepare_mixed(&master, opt, loader)?;
///     let dtype = opt.compute_dtype(); // bf16
///     let model = linear(4, 1, VarBuilder::from_varmap(&work, dtype, &device).pp("fc"))?;
///
///     for batch in loader.iter()? {
///         let batch = batch?;
///         let out = model.forward(&batch[0].to_dtype(dtype)?)?.to_dtype(DType::F32)?;
///         opt.backward_step(&loss::mse(&out, &batch[1])?)?;
///     }
///     Ok(())
/// }
/// ```
///
/// Each [`backward_step`](MixedPrecisionOptimizer::backward_step):
///
/// 1. (f16 only) multiplies the loss by the current loss scale, runs backward through the working
///    copies;
/// 2. casts every working copy's gradient to f32 (and divides it by the loss scale), keyed by its
///    master;
/// 3. averages these f32 gradients across ranks (the usual bucketed all-reduce);
/// 4. (f16 only) if any averaged gradient holds an inf or NaN, the step is **skipped** on every
///    rank alike (they all see the same averaged gradients; under ZeRO stage 2, where each rank
///    holds only its slices, one all-reduce of an overflow flag makes them agree), the scale is multiplied by 0.5 and the
///    skip is counted ([`skipped_steps`](MixedPrecisionOptimizer::skipped_steps)); after
///    [`growth_interval`](LossScaler::growth_interval) (2000) clean steps in a row the scale is
///    doubled. The initial scale is 2^16;
/// 5. clips (if set) and steps the wrapped optimizer on the f32 masters;
/// 6. copies the masters back into the working copies (cast to the compute dtype), so the working
///    copies always equal the masters cast.
///
/// bf16 has f32's exponent range and needs no loss scaling ([`loss_scale`] is 1).
/// With [`MixedPrecision::No`] the working `VarMap` *is* the master `VarMap` and every call is
/// forwarded to [`AcceleratedOptimizer`]: exactly the behaviour of `prepare`.
///
/// The mode is `ACCELERATE_RS_MIXED_PRECISION` / config `mixed_precision` / the builder's
/// [`mixed_precision`](crate::AcceleratorBuilder::mixed_precision) (see
/// [`ProcessState::mixed_precision`](crate::ProcessState::mixed_precision)).
///
/// Mixed precision adds only the cast to f32 and the loss scaling: accumulation, averaging,
/// clipping and flushing are the gradient engine's, as for [`AcceleratedOptimizer`].
///
/// Gradient accumulation (`N > 1`) works with bf16/f16: f32 gradients are summed locally and the
/// masters step on sync steps.
///
/// [`loss_scale`]: MixedPrecisionOptimizer::loss_scale
pub struct MixedPrecisionOptimizer<O> {
    inner: AcceleratedOptimizer<O>,
    mode: MixedPrecision,
    /// `(master, working copy)` in name order; empty for [`MixedPrecision::No`].
    pairs: Vec<(Var, Var)>,
    work: VarMap,
    scaler: Option<LossScaler>,
    skipped: u64,
}

impl<O: std::fmt::Debug> std::fmt::Debug for MixedPrecisionOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MixedPrecisionOptimizer")
            .field("inner", &self.inner)
            .field("mode", &self.mode)
            .field("parameters", &self.pairs.len())
            .field("scaler", &self.scaler)
            .field("skipped", &self.skipped)
            .finish()
    }
}

impl<O: Optimizer> MixedPrecisionOptimizer<O> {
    /// Builds the working copies of `masters` (already prepared) for `mode`.
    pub(crate) fn new<P: Parameters + ?Sized>(
        inner: AcceleratedOptimizer<O>,
        mode: MixedPrecision,
        masters: &P,
    ) -> Result<Self> {
        let mut named = masters.named_parameters();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let work = VarMap::new();
        let mut pairs = Vec::new();
        if mode == MixedPrecision::No {
            let mut data = work.data().lock().unwrap_or_else(|p| p.into_inner());
            for (name, v) in named {
                data.insert(name, v);
            }
        } else {
            let dtype = mode.compute_dtype();
            let mut data = work.data().lock().unwrap_or_else(|p| p.into_inner());
            for (name, master) in named {
                if master.dtype() != DType::F32 {
                    return Err(Error::invalid(
                        "mixed precision",
                        format!(
                            "master parameter `{name}` is {:?}; build the model in f32 (the working copies are made in {dtype:?})",
                            master.dtype()
                        ),
                    ));
                }
                let copy = Var::from_tensor(&master.as_tensor().to_dtype(dtype)?)?;
                data.insert(name, copy.clone());
                pairs.push((master, copy));
            }
        }
        let scaler = (mode == MixedPrecision::Fp16).then(LossScaler::default);
        Ok(MixedPrecisionOptimizer {
            inner,
            mode,
            pairs,
            work,
            scaler,
            skipped: 0,
        })
    }

    /// The mixed-precision mode.
    pub fn mode(&self) -> MixedPrecision {
        self.mode
    }

    /// The dtype of the working copies (f32 for [`MixedPrecision::No`]); build the model and cast
    /// its inputs to it.
    pub fn compute_dtype(&self) -> DType {
        self.mode.compute_dtype()
    }

    /// The working copies, by name (the masters themselves for [`MixedPrecision::No`]).
    pub fn working_vars(&self) -> &VarMap {
        &self.work
    }

    /// The current loss scale (1 unless f16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// The loss scaler (f16 only).
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// The loss scaler, mutable (f16 only; checkpoints).
    pub(crate) fn loss_scaler_mut(&mut self) -> Option<&mut LossScaler> {
        self.scaler.as_mut()
    }

    /// Replaces the loss scaler (f16 only; ignored otherwise).
    pub fn set_loss_scaler(&mut self, scaler: LossScaler) {
        if self.scaler.is_some() {
            self.scaler = Some(scaler);
        }
    }

    /// Steps skipped because a gradient was inf or NaN (f16).
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }
}

impl<O: Optimizer + 'static> MixedPrecisionOptimizer<O> {
    /// Backward through the working copies, f32 gradients averaged across ranks, step of the
    /// masters, masters copied back (see [`MixedPrecisionOptimizer`]). Returns whether it stepped (false
    /// when an f16 step was skipped, or on a non-sync micro-step of gradient accumulation).
    ///
    /// With gradient accumulation (N > 1) each call is one micro-step: the f32 gradients are
    /// summed locally and the masters step every N-th call; use
    /// [`backward_step_batch`](Self::backward_step_batch) so that the loader's last batch also
    /// syncs, or call [`flush`](Self::flush) after the loop.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<bool> {
        self.micro_step(loss, false)
    }

    /// [`backward_step`](Self::backward_step) that also syncs on the loader's last batch.
    pub fn backward_step_batch(&mut self, loss: &Tensor, batch: &Batch) -> Result<bool> {
        self.micro_step(loss, batch.is_last())
    }

    /// [`backward_step`](Self::backward_step) for a token-weighted loss ([`TokenLoss`]: the
    /// micro-batch's loss summed over its target tokens, and their count): the step's gradient is
    /// the mean over every target token of the step on every rank, as
    /// [`AcceleratedOptimizer::backward_step_tokens`] gives. The half-precision backward pass
    /// runs on the sum divided by this micro-batch's own count (a mean's magnitude, for f16's
    /// range), undone on the f32 gradients.
    pub fn backward_step_tokens(&mut self, loss: &TokenLoss) -> Result<bool> {
        self.micro_step_tokens(loss, false)
    }

    /// [`backward_step_tokens`](Self::backward_step_tokens) that also syncs on the loader's last
    /// batch.
    pub fn backward_step_tokens_batch(&mut self, loss: &TokenLoss, batch: &Batch) -> Result<bool> {
        self.micro_step_tokens(loss, batch.is_last())
    }

    /// One token-weighted micro-step (see [`backward_step_tokens`](Self::backward_step_tokens)).
    fn micro_step_tokens(&mut self, loss: &TokenLoss, end: bool) -> Result<bool> {
        if self.mode == MixedPrecision::No {
            return self.inner.micro_step_tokens(loss, end);
        }
        let per = loss.tokens().max(1) as f64;
        let grads = self.master_grads(loss.sum(), 1.0 / per)?;
        let mut scaled = GradStore::default();
        for (master, _) in &self.pairs {
            if let Some(g) = grads.get(master.as_tensor()) {
                scaled.insert(master.as_tensor(), g.affine(per, 0.0)?);
            }
        }
        let engine = self.inner.engine();
        match engine.accumulate_weighted(scaled, Some(loss.tokens()), end)? {
            Some(averaged) => self.apply(averaged),
            None => Ok(false),
        }
    }

    /// Steps with the micro-steps accumulated so far, if any (the end of a loader that was not
    /// iterated with [`backward_step_batch`](Self::backward_step_batch)). Returns whether it
    /// stepped.
    pub fn flush(&mut self) -> Result<bool> {
        if self.mode == MixedPrecision::No {
            return self.inner.flush();
        }
        match self.inner.engine().flush()? {
            Some(grads) => self.apply(grads),
            None => Ok(false),
        }
    }

    /// One micro-step: backward through the working copies with the loss scaled by the loss
    /// scale and `1/N`, f32 gradients of the masters handed to the gradient engine, and the
    /// sync step ([`apply`](Self::apply)) when the engine returns averaged gradients.
    fn micro_step(&mut self, loss: &Tensor, end: bool) -> Result<bool> {
        if self.mode == MixedPrecision::No {
            return self.inner.micro_step(loss, end);
        }
        let n = self.inner.engine().steps();
        let grads = self.master_grads(loss, 1.0 / n as f64)?;
        match self.inner.engine().accumulate(grads, end)? {
            Some(averaged) => self.apply(averaged),
            None => Ok(false),
        }
    }

    /// The f32 gradients of the masters for `factor · loss`: backward through the working copies
    /// with the loss scale folded into the factor, the scale undone in f32.
    fn master_grads(&self, loss: &Tensor, factor: f64) -> Result<GradStore> {
        let scale = self.loss_scale();
        // The loss scale (f16) and the factor folded into one multiplication.
        let factor = scale * factor;
        let scaled = if factor == 1.0 {
            loss.clone()
        } else {
            loss.affine(factor, 0.0)?
        };
        let half = crate::nn::backward(&scaled)?;
        let mut grads = GradStore::default();
        for (master, copy) in &self.pairs {
            if let Some(g) = half.get(copy.as_tensor()) {
                let mut g = g.to_dtype(DType::F32)?;
                if scale != 1.0 {
                    g = g.affine(1.0 / scale, 0.0)?;
                }
                grads.insert(master.as_tensor(), g);
            }
        }
        Ok(grads)
    }

    /// The sync step on gradients already averaged across ranks: overflow check (f16), step of
    /// the masters, copy back into the working copies.
    fn apply(&mut self, grads: GradStore) -> Result<bool> {
        if let Some(scaler) = self.scaler.as_mut() {
            // Under ZeRO stage 2 each rank holds only its slices of the averaged gradients: the
            // engine makes every rank reach the overflow verdict of the whole model.
            let engine = self.inner.engine();
            let clean = engine.agree_all_finite(all_finite(&self.pairs, &grads)?)?;
            scaler.update(clean);
            if !clean {
                self.skipped += 1;
                log::debug!(
                    "rank {}: f16 gradients overflowed; step skipped, loss scale now {}",
                    self.inner.engine().rank(),
                    scaler.scale()
                );
                return Ok(false);
            }
            // Found finite on every rank: the step's own non-finite check need not read again.
            self.inner.engine().mark_finite();
        }
        self.inner.step(&grads)?;
        self.sync_working_copies()?;
        Ok(true)
    }
}

impl<O: Optimizer> MixedPrecisionOptimizer<O> {
    /// Copies the masters into the working copies (done after every step; call it after loading
    /// a checkpoint into the masters).
    pub fn sync_working_copies(&self) -> Result<()> {
        for (master, copy) in &self.pairs {
            copy.set(&master.as_tensor().to_dtype(copy.dtype())?)?;
        }
        Ok(())
    }

    /// Clip gradients (of the masters, after averaging) to this global L2 norm in every step.
    pub fn set_clip_grad_norm(&mut self, max_norm: Option<f64>) {
        self.inner.set_clip_grad_norm(max_norm)
    }

    /// Clamp every master gradient to `[-clip, clip]` in every step.
    pub fn set_clip_grad_value(&mut self, clip: Option<f64>) {
        self.inner.set_clip_grad_value(clip)
    }

    /// The global norm of the master gradients (before clipping) of the last step that clipped
    /// by norm.
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.inner.last_grad_norm()
    }

    /// Whether the last micro-step was a sync step (see
    /// [`AcceleratedOptimizer::is_sync_step`]).
    pub fn is_sync_step(&self) -> bool {
        self.inner.is_sync_step()
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    /// Sets the learning rate.
    pub fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr)
    }

    /// The wrapped [`AcceleratedOptimizer`] (stepping the masters).
    pub fn accelerated(&self) -> &AcceleratedOptimizer<O> {
        &self.inner
    }

    /// The wrapped [`AcceleratedOptimizer`], mutable.
    pub fn accelerated_mut(&mut self) -> &mut AcceleratedOptimizer<O> {
        &mut self.inner
    }
}

impl<O: Optimizer> TrainOptimizer for MixedPrecisionOptimizer<O> {
    fn lr(&self) -> f64 {
        self.inner.lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr)
    }
}

/// Whether every gradient of the masters is finite (one scalar read back).
fn all_finite(pairs: &[(Var, Var)], grads: &GradStore) -> Result<bool> {
    let mut sums = Vec::new();
    for (master, _) in pairs {
        if let Some(g) = grads.get(master.as_tensor()) {
            sums.push(g.sum_all()?);
        }
    }
    if sums.is_empty() {
        return Ok(true);
    }
    // inf - inf and NaN stay NaN, +-inf stays infinite: the total is finite iff all parts are
    // (or the f32 sum itself overflowed, which is treated as an overflow too).
    let total =
        crate::readback::counted(|| Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>())?;
    Ok(total.is_finite())
}

/// The state of the optimizer stepping the f32 masters; load the masters themselves with
/// [`Accelerator::load_state`](crate::Accelerator::load_state) and then call
/// [`sync_working_copies`](MixedPrecisionOptimizer::sync_working_copies).
///
/// With f16 the loss scaler's scale and clean-step count are saved too (as the scalar tensors
/// `loss_scaler.scale` and `loss_scaler.clean_steps`), so a resumed run scales as the
/// uninterrupted one.
impl<O: candle_nn::Optimizer + StatefulOptimizer> StatefulOptimizer for MixedPrecisionOptimizer<O> {
    fn state_needs_every_rank(&self) -> bool {
        self.accelerated().state_needs_every_rank()
    }
    /// The wrapped optimizer's slices; the loss scaler's scalars go with rank 0's.
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        let Some(mut shard) = self.accelerated().optimizer_state_shard()? else {
            return Ok(None);
        };
        if let Some(s) = self.loss_scaler() {
            let dev = Device::Cpu;
            let rank = self.accelerated().engine().collective().rank();
            for (name, value) in [
                (SCALER_SCALE, s.scale()),
                (SCALER_CLEAN, s.clean_steps() as f64),
            ] {
                shard.layout.push((name.into(), Vec::new()));
                if rank == 0 {
                    shard
                        .pieces
                        .push((name.into(), 0, Tensor::new(&[value], &dev)?));
                }
            }
        }
        Ok(Some(shard))
    }
    fn optimizer_state(&self) -> Result<OptimizerState> {
        let mut state = self.accelerated().optimizer_state()?;
        if let Some(s) = self.loss_scaler() {
            let dev = Device::Cpu;
            state
                .tensors
                .push((SCALER_SCALE.into(), Tensor::new(s.scale(), &dev)?));
            state.tensors.push((
                SCALER_CLEAN.into(),
                Tensor::new(s.clean_steps() as f64, &dev)?,
            ));
        }
        Ok(state)
    }
    fn load_optimizer_state(&mut self, mut state: OptimizerState) -> Result<()> {
        let saved = take_saved(&mut state)?;
        self.accelerated_mut().load_optimizer_state(state)?;
        if let (Some(scaler), Some((scale, clean))) = (self.loss_scaler_mut(), saved) {
            scaler.restore(scale, clean);
        }
        Ok(())
    }
}
