//! [`Accelerator`]: the process's place in the run, its collective and gradient engine, and
//! what prepares the model, optimizer and data loader and hands out averaged gradients. Its
//! other methods are grouped by purpose in the sibling files (constructors in `builder.rs`,
//! user collectives in `ops.rs`, checkpoints in `checkpoint.rs`, ...).

use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use candle_nn::Optimizer;

use crate::collective::Collective;
use crate::data::{Batch, DataLoader};
use crate::error::Result;
use crate::settings::{DistributedType, ProcessState};
use crate::train::batch_size::{Probe, ProbedCollective};
use crate::train::grad_sync::GradSync;
use crate::train::mixed_precision::MixedPrecisionOptimizer;
use crate::train::optimizer::AcceleratedOptimizer;
use crate::train::params::Parameters;
use crate::train::token_weights::TokenLoss;

/// The entry point of a distributed training script.
///
/// ```no_run
/// # fn main() -> accelerate_rs::Result<()> {
/// let accelerator = accelerate_rs::Accelerator::new()?;
/// println!("rank {} of {}", accelerator.rank(), accelerator.world_size());
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Accelerator {
    pub(super) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(super) struct Inner {
    pub(super) state: ProcessState,
    /// The backend's communicator wrapped by the batch-size search's agreement
    /// ([`find_executable_batch_size`](Accelerator::find_executable_batch_size)): what every
    /// collective of the accelerator, its gradient engine and its users goes through.
    pub(super) collective: Arc<dyn Collective>,
    /// The batch-size search's attempt state (it holds the backend's communicator itself).
    pub(super) probe: Arc<Probe>,
    pub(super) grads: Arc<GradSync>,
    /// The seed of [`Accelerator::set_seed`] (0 until it is called), for `var_builder`.
    pub(super) seed: std::sync::atomic::AtomicU64,
}

/// The settings of the run, for what takes `impl AsRef<ProcessState>`
/// ([`tracking::trackers`](crate::tracking::trackers), ...).
impl AsRef<ProcessState> for Accelerator {
    fn as_ref(&self) -> &ProcessState {
        self.state()
    }
}

impl Accelerator {
    /// The one constructor: an accelerator for a resolved state and a connected collective
    /// (used by [`AcceleratorBuilder::build`] and by every DP replica).
    pub(crate) fn from_parts(state: ProcessState, collective: Arc<dyn Collective>) -> Self {
        if state.tune_malloc() {
            crate::allocator::tune();
        }
        log::debug!(
            "rank {}: {} with {} rank(s), backend {}",
            state.rank(),
            state.distributed_type(),
            state.world_size(),
            collective.backend()
        );
        let probe = Probe::install(collective);
        let collective: Arc<dyn Collective> = Arc::new(ProbedCollective::new(probe.clone()));
        let grads = Arc::new(GradSync::new(collective.clone(), &state, probe.clone()));
        Accelerator {
            inner: Arc::new(Inner {
                state,
                collective,
                probe,
                grads,
                seed: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// This process's state and settings.
    pub fn state(&self) -> &ProcessState {
        &self.inner.state
    }
    /// Global rank.
    pub fn rank(&self) -> usize {
        self.inner.state.rank()
    }
    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.inner.state.local_rank()
    }
    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.inner.state.world_size()
    }
    /// The device to create the model and tensors on.
    pub fn device(&self) -> &Device {
        self.inner.state.device()
    }
    /// How the run is distributed.
    pub fn distributed_type(&self) -> DistributedType {
        self.inner.state.distributed_type()
    }
    /// Whether this is rank 0 (the one that should print, log and save).
    pub fn is_main_process(&self) -> bool {
        self.inner.state.is_main_process()
    }
    /// Whether this is local rank 0 (once per machine).
    pub fn is_local_main_process(&self) -> bool {
        self.inner.state.is_local_main_process()
    }
    /// The collective used between ranks.
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.inner.collective
    }

    /// A [`VarBuilder`](candle_nn::VarBuilder) for creating the model in `varmap` on this
    /// process's device, like `VarBuilder::from_varmap(varmap, dtype, accelerator.device())`
    /// but reproducible: every new variable is drawn from the seed of
    /// [`set_seed`](Self::set_seed) (0 when it was not called) and the variable's name (see
    /// [`seeded_var_builder`](crate::seeded_var_builder)). The same seed gives the same initial
    /// weights in every run, at any world size and whatever the order the layers are created in
    /// (Candle's CPU initialisers are unseeded).
    ///
    /// ```
    /// # fn main() -> accelerate_rs::Result<()> {
    /// use candle_core::DType;
    /// use candle_nn::{linear, VarMap};
    /// let acc = accelerate_rs::Accelerator::builder().cpu(true).build()?;
    /// acc.set_seed(42)?;
    /// let varmap = VarMap::new();
    /// let model = linear(8, 1, acc.var_builder(&varmap, DType::F32).pp("fc"))?;
    /// # let _ = model;
    /// # Ok(()) }
    /// ```
    pub fn var_builder(
        &self,
        varmap: &candle_nn::VarMap,
        dtype: candle_core::DType,
    ) -> candle_nn::VarBuilder<'static> {
        let seed = self.inner.seed.load(std::sync::atomic::Ordering::Relaxed);
        crate::train::init::seeded_var_builder(varmap, seed, dtype, self.device())
    }

    /// Prepares the three pieces of a training loop: checks that every rank has the same
    /// parameters and gives them rank 0's values, wraps the optimizer, and shards the loader so
    /// each rank sees its own part of every global batch.
    ///
    /// The parameters train in the dtype they were made in. When a mixed-precision mode is set
    /// it warns once: [`prepare_mixed`](Self::prepare_mixed) is what applies the mode (the
    /// separate `prepare_model`, `prepare_optimizer` and `prepare_data_loader` do not warn,
    /// e.g. for LoRA adapters in f32 over a base loaded in the compute dtype).
    pub fn prepare<P: Parameters + ?Sized, O: Optimizer>(
        &self,
        model: &P,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(AcceleratedOptimizer<O>, DataLoader)> {
        self.warn_unmixed("prepare");
        self.prepare_parts(model, optimizer, loader)
    }

    /// [`prepare`](Self::prepare)'s work, without its mixed-precision notice.
    fn prepare_parts<P: Parameters + ?Sized, O: Optimizer>(
        &self,
        model: &P,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(AcceleratedOptimizer<O>, DataLoader)> {
        self.prepare_model(model)?;
        Ok((
            AcceleratedOptimizer::new(optimizer, self.inner.grads.clone()),
            self.prepare_data_loader(loader)?,
        ))
    }

    /// Mixed precision is set but `call` prepares without it: says so once per process, on the
    /// main process (the parameters then train in the dtype they were made in).
    fn warn_unmixed(&self, call: &str) {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let mode = self.inner.state.mixed_precision();
        if mode == crate::settings::MixedPrecision::No
            || !self.is_main_process()
            || WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        crate::logging::warn_always(format_args!(
            "mixed precision {mode} is set (ACCELERATE_RS_MIXED_PRECISION, `launch --mixed-precision`, the config file or the builder), but `{call}` trains the parameters in the dtype they were made in; `prepare_mixed` keeps f32 masters and gives {:?} working copies to build the model from",
            mode.compute_dtype()
        ));
    }

    /// [`prepare`](Self::prepare) for mixed precision (the mode of
    /// [`ProcessState::mixed_precision`]): `model` holds the f32 master weights and `optimizer`
    /// steps them; returns the optimizer, the loader and a `VarMap` of working copies in the
    /// compute dtype to build the model from (see [`MixedPrecisionOptimizer`]). With
    /// [`MixedPrecision::No`](crate::MixedPrecision::No) it is `prepare` and the `VarMap` is `model`'s variables.
    pub fn prepare_mixed<P: Parameters + ?Sized, O: Optimizer + 'static>(
        &self,
        model: &P,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(MixedPrecisionOptimizer<O>, DataLoader, candle_nn::VarMap)> {
        let (opt, loader) = self.prepare_parts(model, optimizer, loader)?;
        let mode = self.inner.state.mixed_precision();
        let opt = MixedPrecisionOptimizer::new(opt, mode, model)?;
        let work = opt.working_vars().clone();
        Ok((opt, loader, work))
    }

    /// Registers a model's parameters (adding to any registered before), verifies them across
    /// ranks and broadcasts rank 0's values.
    pub fn prepare_model<P: Parameters + ?Sized>(&self, model: &P) -> Result<()> {
        let set = self.inner.grads.register(model.named_parameters())?;
        log::debug!(
            "rank {}: prepared {} parameters in {} bucket(s)",
            self.rank(),
            set.len(),
            set.num_buckets()
        );
        Ok(())
    }

    /// Wraps an optimizer (see [`AcceleratedOptimizer`]).
    pub fn prepare_optimizer<O: Optimizer>(&self, optimizer: O) -> AcceleratedOptimizer<O> {
        AcceleratedOptimizer::new(optimizer, self.inner.grads.clone())
    }

    /// Shards a loader for this rank and moves its batches to this process's device.
    pub fn prepare_data_loader(&self, loader: DataLoader) -> Result<DataLoader> {
        let loader = if self.inner.state.split_batches() {
            loader.split_batches(true)
        } else {
            loader
        };
        Ok(loader
            .shard(self.rank(), self.world_size())?
            .device(self.device()))
    }

    /// [`prepare_data_loader`](Self::prepare_data_loader) for a streaming dataset: shards a
    /// [`StreamingLoader`](crate::StreamingLoader) for this rank (every rank reads the stream, each decodes its own
    /// records, all take the same number of steps), applies the `split_batches` setting and moves
    /// its batches to this process's device.
    pub fn prepare_streaming_loader<D: crate::data::IterableDataset + 'static>(
        &self,
        loader: crate::data::StreamingLoader<D>,
    ) -> Result<crate::data::StreamingLoader<D>> {
        let loader = if self.inner.state.split_batches() {
            loader.split_batches(true)
        } else {
            loader
        };
        Ok(loader
            .shard(self.rank(), self.world_size())?
            .device(self.device()))
    }

    /// Runs `loss.backward()` and averages the gradients across ranks (bucketed, one collective
    /// per bucket). With one process it is exactly `loss.backward()`.
    ///
    /// Returns `Some(gradients)` on a sync step and `None` otherwise: without gradient
    /// accumulation every call is a sync step. With gradient accumulation
    /// (`N = gradient_accumulation_steps > 1`) each call is one micro-step: the loss is scaled by
    /// `1/N` and the gradients are summed locally, nothing is communicated and `None` is
    /// returned, since partial sums must not be applied. Every `N`-th call (or, with
    /// [`backward_batch`](Self::backward_batch), the loader's last batch) is a sync step: the
    /// accumulated sums, averaged across ranks, are returned. A short cycle of `k < N`
    /// micro-steps is rescaled by `N/k`, so its gradient is the mean over the micro-batches seen.
    /// [`sync_gradients`](Self::sync_gradients) tells afterwards which kind of step it was: step
    /// learning-rate schedulers, log and clip only on sync steps. Pending micro-steps left at the
    /// end of a loop are synced by [`flush_gradients`](Self::flush_gradients) (every rank must
    /// call it).
    ///
    /// With several processes on the CPU, the averaged gradients are views into reusable flat
    /// buffers (one per bucket, as in PyTorch DDP): they stay valid until the next averaging
    /// `backward` of this accelerator, which overwrites them. Copy a gradient (`Tensor::copy`) to
    /// keep it longer.
    pub fn backward(&self, loss: &Tensor) -> Result<Option<GradStore>> {
        self.inner.grads.backward(loss, false)
    }

    /// [`backward`](Self::backward) that also makes the micro-step a sync step when `batch` is
    /// the loader's last ([`Batch::is_last`]), so a partial accumulation cycle at the end of an
    /// epoch is applied rather than carried into the next epoch.
    pub fn backward_batch(&self, loss: &Tensor, batch: &Batch) -> Result<Option<GradStore>> {
        self.inner.grads.backward(loss, batch.is_last())
    }

    /// [`backward`](Self::backward) for a token-weighted loss ([`TokenLoss`]:
    /// the micro-batch's loss summed over its target tokens, and their count): the gradients of
    /// the sums are accumulated, and a sync step returns their total divided by the number of
    /// target tokens of the whole step — every micro-batch on every rank, one all-reduce of the
    /// count — so the step's gradient is the mean over its tokens, as if one process had run the
    /// whole batch, however unevenly the tokens fall into micro-batches and ranks (Accelerate's
    /// recipe for causal language models). The micro-steps of one optimizer step must all be
    /// token-weighted or all not.
    pub fn backward_tokens(&self, loss: &TokenLoss) -> Result<Option<GradStore>> {
        self.inner.grads.backward_tokens(loss, false)
    }

    /// [`backward_tokens`](Self::backward_tokens) that also makes the micro-step a sync step
    /// when `batch` is the loader's last.
    pub fn backward_tokens_batch(
        &self,
        loss: &TokenLoss,
        batch: &Batch,
    ) -> Result<Option<GradStore>> {
        self.inner.grads.backward_tokens(loss, batch.is_last())
    }

    /// Syncs pending micro-steps now: returns their gradients averaged across ranks (rescaled
    /// to a mean over the micro-steps seen), or `None` when nothing is pending (then nothing is
    /// communicated). All ranks must call it at the same point.
    pub fn flush_gradients(&self) -> Result<Option<GradStore>> {
        self.inner.grads.flush()
    }

    /// Whether the last micro-step was a sync step, i.e. the gradients were averaged across ranks
    /// and the optimizer stepped (true before the first backward and always when `N = 1`). Step
    /// schedulers, clip and log only when it is true.
    pub fn sync_gradients(&self) -> bool {
        self.inner.grads.sync_gradients()
    }

    /// Bytes of gradients this rank has sent through the gradient all-reduce (or ZeRO-2's
    /// reduce-scatter) so far: per sync step, every bucket of the prepared parameters (their
    /// gradients and one presence flag each, in the parameters' dtype). 0 with one process.
    /// With LoRA, only the adapters are prepared, and this is what they cost. At ZeRO stage 3,
    /// also every unit's reduce-scatter (its gradients and presence flags), once per backward
    /// pass.
    pub fn gradient_bytes_reduced(&self) -> u64 {
        self.inner.grads.reduced_bytes()
    }

    /// The number of micro-steps per optimizer step (`N`).
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.inner.state.gradient_accumulation_steps()
    }

    /// Micro-steps accumulated since the last sync step.
    pub fn pending_micro_steps(&self) -> usize {
        self.inner.grads.pending_micro_steps()
    }

    /// Clips gradients by their global L2 norm over all registered parameters (those of
    /// [`prepare_model`](Self::prepare_model)) and returns that norm (before clipping). Pass the
    /// gradients of a sync step: they are already averaged, so every rank computes the same norm
    /// and scales alike. When the norm exceeds `max_norm`, every gradient is multiplied by
    /// `max_norm / (norm + 1e-6)`. After a non-sync micro-step the gradients are left alone and
    /// the returned norm is that of this rank's local partial sums.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        self.inner.grads.clip_grad_norm(grads, max_norm)
    }

    /// Clamps every registered parameter's gradient to `[-clip, clip]` (left alone after a
    /// non-sync micro-step, like [`clip_grad_norm`](Self::clip_grad_norm)).
    pub fn clip_grad_value(&self, grads: &mut GradStore, clip: f64) -> Result<()> {
        self.inner.grads.clip_grad_value(grads, clip)
    }

    /// Averages gradients computed elsewhere across ranks, in place.
    pub fn reduce_gradients(&self, grads: &mut GradStore) -> Result<()> {
        self.inner.grads.average(grads)
    }

    /// A [`StepTimer`](crate::tracking::StepTimer) for this accelerator's steps: forward,
    /// backward, communication, optimizer and data time, tokens/s and FLOP/s, as metrics for
    /// [`tracking`](crate::tracking)'s trackers.
    pub fn step_timer(&self) -> crate::tracking::StepTimer {
        crate::tracking::StepTimer::new(
            Arc::clone(self.inner.grads.clock()),
            self.world_size(),
            self.device(),
        )
    }

    /// Prints a line on the main process only (other ranks print nothing).
    pub fn print(&self, line: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{line}");
        }
    }

    /// Returns once every rank has reached this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.inner.collective.barrier()
    }
}
