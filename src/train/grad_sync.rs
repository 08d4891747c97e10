//! [`GradSync`]: the gradient engine. It owns everything between `loss.backward()` and the
//! optimizer: the registered parameters, the micro-step counter and the local sums of gradient
//! accumulation, the averaging across ranks (the one place that asks whether there is more than
//! one rank), clipping and flushing. [`AcceleratedOptimizer`](crate::AcceleratedOptimizer),
//! [`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer) and
//! [`Accelerator::backward`](crate::Accelerator::backward) all go through it. Where it stands on
//! a gradient's way from the loss to the parameters: ARCHITECTURE.md, "The path of one gradient".
//!
//! ## Gradient accumulation
//!
//! With `N = gradient_accumulation_steps` (builder
//! [`gradient_accumulation_steps`](crate::AcceleratorBuilder::gradient_accumulation_steps) >
//! `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS` > config key `gradient_accumulation_steps` > 1),
//! every backward is a *micro-step*:
//!
//! - the loss is scaled by `1/N` and its gradients (of the registered parameters) are added to a
//!   local store kept by the engine; nothing is sent to other ranks and no gradients are handed
//!   out (`None`);
//! - every `N`-th micro-step, or a micro-step told it is the last of the loader
//!   ([`backward_batch`](crate::Accelerator::backward_batch) /
//!   [`backward_step_batch`](crate::AcceleratedOptimizer::backward_step_batch) with a batch whose
//!   [`is_last`](crate::Batch::is_last) is true), is a *sync step*: the accumulated sums are
//!   averaged across ranks (one collective per bucket) and handed out (`Some`) to the optimizer,
//!   which steps only then. A short cycle of `k < N` micro-steps is rescaled by `N/k`, so its gradient is the
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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::settings::{MissingGradients, NonFinite, ProcessState};
use crate::tracking::timing::{Phase, PhaseClock};
use crate::train::batch_size::Probe;
use crate::train::clip;
use crate::train::params::ParamSet;
use crate::train::reducer::Reducer;
use crate::train::token_weights::{self, TokenLoss, TokenTally};
use crate::train::zero3;

/// What [`GradSync::registration`] gives back: the registered parameters and sharded model.
pub(crate) type Registration = (Option<Arc<ParamSet>>, Option<Arc<zero3::Inner>>);

/// The accumulation state of one engine.
#[derive(Debug)]
struct Accumulation {
    /// Micro-steps accumulated in the current cycle.
    micro: usize,
    /// Local sums of the registered parameters' gradients (already scaled by `1/N`).
    pending: GradStore,
    /// Whether the last micro-step was a sync step.
    synced: bool,
    /// The cycle's token count when its losses are token-weighted.
    tokens: TokenTally,
}

impl Default for Accumulation {
    fn default() -> Self {
        Accumulation {
            micro: 0,
            pending: GradStore::default(),
            synced: true,
            tokens: TokenTally::default(),
        }
    }
}

/// The gradient engine of one accelerator (see [the module](self)). Shared (`Arc`) by the
/// accelerator and the optimizers it prepares.
pub(crate) struct GradSync {
    collective: Arc<dyn Collective>,
    /// `N`, micro-steps per optimizer step.
    steps: usize,
    bucket_cap_bytes: usize,
    overlap: bool,
    /// What the first sync step does about parameters without a gradient.
    missing: MissingGradients,
    /// Whether that check has run (it runs once).
    checked: AtomicBool,
    /// What a step with non-finite gradients does.
    nonfinite: NonFinite,
    /// Optimizer steps checked so far (for the non-finite check's messages).
    checked_steps: AtomicU64,
    /// Whether the gradients of the coming step were already found finite (fp16 loss scaling
    /// checks them itself): the non-finite check then reads nothing back.
    known_finite: AtomicBool,
    /// Whether the same-data check of the first sync step has run (it runs once).
    data_checked: AtomicBool,
    /// ZeRO stage: 0, 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too).
    zero_stage: usize,
    /// Registered parameters averaged as wholes (every parameter below stage 3; at stage 3 the
    /// replicated ones, such as LoRA adapters over a sharded base).
    params: Mutex<Option<Arc<ParamSet>>>,
    /// Moves the registered parameters' gradients and values across ranks (its buffers belong
    /// to the registered set: a new registration gets a new reducer).
    reducer: Mutex<Option<Arc<Reducer>>>,
    /// Stage 3: the sharded model, whose units reduce-scatter their own gradients.
    sharded: Mutex<Option<Arc<zero3::Inner>>>,
    accum: Mutex<Accumulation>,
    /// Bytes of gradient buckets handed to the collective so far (see
    /// [`reduced_bytes`](Self::reduced_bytes)).
    reduced: AtomicU64,
    /// Time spent in backward, communication and the optimizer (for `StepTimer`).
    clock: Arc<PhaseClock>,
    /// The batch-size search's attempt state: told of every sync step.
    probe: Arc<Probe>,
}

impl std::fmt::Debug for GradSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradSync")
            .field("rank", &self.collective.rank())
            .field("world_size", &self.collective.world_size())
            .field("accumulation_steps", &self.steps)
            .field("parameters", &self.params().map_or(0, |p| p.len()))
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GradSync {
    /// An engine averaging over `collective` as `state` says: its micro-steps per optimizer step
    /// (`N`), gradient buckets of at most its bucket cap and, if it overlaps, CPU buckets reduced
    /// on a communication thread; its ZeRO stage; its `missing_gradients` (what the first sync
    /// step does about registered parameters that received no gradient on any rank) and its
    /// `nonfinite` (what a step with non-finite gradients does).
    pub(crate) fn new(
        collective: Arc<dyn Collective>,
        state: &ProcessState,
        probe: Arc<Probe>,
    ) -> Self {
        GradSync {
            collective,
            steps: state.gradient_accumulation_steps().max(1),
            bucket_cap_bytes: state.bucket_cap_bytes(),
            overlap: state.overlap(),
            missing: state.missing_gradients(),
            checked: AtomicBool::new(false),
            nonfinite: state.nonfinite(),
            checked_steps: AtomicU64::new(0),
            known_finite: AtomicBool::new(false),
            data_checked: AtomicBool::new(false),
            zero_stage: state.zero_stage(),
            params: Mutex::new(None),
            reducer: Mutex::new(None),
            sharded: Mutex::new(None),
            accum: Mutex::new(Accumulation::default()),
            reduced: AtomicU64::new(0),
            clock: Arc::default(),
            probe,
        }
    }

    /// The engine's phase clock, read by [`StepTimer`](crate::tracking::StepTimer).
    pub(crate) fn clock(&self) -> &Arc<PhaseClock> {
        &self.clock
    }

    /// The registered parameters (and sharded model), to hand back to
    /// [`restart`](Self::restart) later.
    pub(crate) fn registration(&self) -> Registration {
        (self.params(), self.sharded())
    }

    /// Starts over with `params` registered (what [`registration`](Self::registration) gave):
    /// what was registered since is forgotten (its buffers freed once nobody holds them), as are
    /// pending micro-steps, and the first sync step checks for missing gradients again. A
    /// batch-size search calls it before each retry.
    pub(crate) fn restart(&self, (params, sharded): Registration) {
        *lock(&self.reducer) = params.as_ref().map(|p| self.new_reducer(p));
        *lock(&self.params) = params;
        *lock(&self.sharded) = sharded;
        *lock(&self.accum) = Accumulation::default();
        self.checked.store(false, Ordering::Relaxed);
    }

    /// Whether this rank is alone, so that nothing needs to be verified, broadcast or averaged:
    /// the one world-size test of the gradient path.
    fn alone(&self) -> bool {
        self.collective.world_size() == 1
    }

    /// The number of micro-steps per optimizer step (`N`).
    pub(crate) fn steps(&self) -> usize {
        self.steps
    }

    /// This rank, for messages.
    pub(crate) fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// Registers parameters (adding to those registered before), verifies them across ranks and
    /// gives every rank rank 0's values. Returns the registered set. At stage 3 only parameters
    /// replicated beside a sharded model (LoRA adapters) are registered so.
    pub(crate) fn register(&self, mut named: Vec<(String, Var)>) -> Result<Arc<ParamSet>> {
        if self.zero_stage >= 3 && self.sharded().is_none() {
            return Err(Error::invalid(
                "zero_stage",
                "at stage 3 the parameters are sharded: prepare the model with `accelerator.prepare_sharded(&model, &policy, optimizer, loader)` (or `shard_model`); `prepare`/`prepare_model` register only parameters replicated beside a sharded model, such as LoRA adapters",
            ));
        }
        if named.is_empty() {
            return Err(Error::invalid(
                "model",
                "it has no parameters; create them through the VarMap before calling prepare",
            ));
        }
        if let Some(old) = self.params() {
            named.extend(old.named());
        }
        let set = ParamSet::new(named, self.bucket_cap_bytes)?;
        if !self.alone() {
            let c = self.collective.as_ref();
            set.verify(c)?;
            set.broadcast_from_main(c)?;
        }
        let set = Arc::new(set);
        *lock(&self.reducer) = Some(self.new_reducer(&set));
        *lock(&self.params) = Some(set.clone());
        Ok(set)
    }

    /// A reducer for `set`, its buffers fresh.
    fn new_reducer(&self, set: &ParamSet) -> Arc<Reducer> {
        Arc::new(Reducer::new(set.buckets().len(), self.overlap))
    }

    /// The reducer of the registered parameters (there is one whenever parameters are).
    fn reducer(&self) -> Result<Arc<Reducer>> {
        lock(&self.reducer).clone().ok_or_else(|| Error::Internal {
            what: "moving gradients across ranks".into(),
            reason: "parameters are registered without a reducer".into(),
        })
    }

    /// The registered parameters, if any.
    pub(crate) fn params(&self) -> Option<Arc<ParamSet>> {
        lock(&self.params).clone()
    }

    /// Stage 3: registers the sharded model (one per accelerator).
    pub(crate) fn register_sharded(&self, model: Arc<zero3::Inner>) -> Result<()> {
        let mut slot = lock(&self.sharded);
        if slot.is_some() {
            return Err(Error::invalid(
                "zero_stage",
                "a sharded model is already prepared on this accelerator (one per accelerator)",
            ));
        }
        *slot = Some(model);
        Ok(())
    }

    /// Stage 3, after the optimizer stepped the shards: offload refreshes the device copies.
    pub(crate) fn after_sharded_step(&self) -> Result<()> {
        match self.sharded() {
            Some(s) => s.after_step(),
            None => Ok(()),
        }
    }

    /// Stage 3: the sharded model, if one was prepared.
    pub(crate) fn sharded(&self) -> Option<Arc<zero3::Inner>> {
        lock(&self.sharded).clone()
    }

    /// The variables gradients are handed out for, by name: the registered parameters and, at
    /// stage 3, the units' shards. An error naming `what` when nothing was prepared.
    fn grad_vars(&self, what: &str) -> Result<Vec<(String, Var)>> {
        let sharded = self.sharded();
        let mut out = match (self.params(), &sharded) {
            (Some(p), _) => p.named(),
            (None, Some(_)) => Vec::new(),
            (None, None) => self.require_params(what)?.named(),
        };
        if let Some(s) = sharded {
            out.extend(s.shard_vars());
        }
        Ok(out)
    }

    fn vars_of(named: &[(String, Var)]) -> Vec<Var> {
        named.iter().map(|(_, v)| v.clone()).collect()
    }

    /// The registered parameters, or an error naming `what` if no model was prepared.
    pub(crate) fn require_params(&self, what: &str) -> Result<Arc<ParamSet>> {
        self.params().ok_or_else(|| {
            Error::invalid(
                what,
                format!(
                    "rank {}: no model was prepared; call `accelerator.prepare(&varmap, optimizer, loader)` (or `prepare_model`) first, so the gradients to accumulate, average across the {} rank(s) or clip are known",
                    self.rank(),
                    self.collective.world_size()
                ),
            )
        })
    }

    /// Whether the last micro-step was a sync step (true before the first one).
    pub(crate) fn sync_gradients(&self) -> bool {
        lock(&self.accum).synced
    }

    /// Micro-steps accumulated and not yet synced.
    pub(crate) fn pending_micro_steps(&self) -> usize {
        lock(&self.accum).micro
    }

    /// One micro-step from a loss (see [the module](self)); `end` forces a sync step. `Some`
    /// holds the gradients averaged across ranks, on sync steps only.
    pub(crate) fn backward(&self, loss: &Tensor, end: bool) -> Result<Option<GradStore>> {
        let grads = self.backward_pass(loss, 1.0 / self.steps as f64)?;
        self.accumulate(grads, end)
    }

    /// The gradients of `factor · loss` (`nn::backward`: `loss.backward()` plus the parameters
    /// inside checkpointed blocks); at stage 3 the held units reduce-scatter theirs, and under
    /// fp16 the loss is multiplied by the loss scale, divided out of the gradients again.
    fn backward_pass(&self, loss: &Tensor, factor: f64) -> Result<GradStore> {
        let sharded = self.sharded();
        let scale = sharded.as_ref().and_then(|s| s.loss_scale()).unwrap_or(1.0);
        if let Some(s) = &sharded {
            s.begin_backward(scale);
        }
        let factor = factor * scale;
        let grads = self.clock.measure(Phase::Backward, || {
            if factor == 1.0 {
                crate::nn::backward(loss)
            } else {
                crate::nn::backward(&(loss * factor)?)
            }
        })?;
        match &sharded {
            Some(s) => self.collect_sharded(s, &grads, scale),
            None => Ok(grads),
        }
    }

    /// Stage 3, after a backward pass: the held units reduce-scatter their gradients; returns
    /// the shards' gradients (averaged over the ranks) and the replicated parameters' (local),
    /// the fp16 loss `scale` divided out of both.
    pub(crate) fn collect_sharded(
        &self,
        sharded: &zero3::Inner,
        grads: &GradStore,
        scale: f64,
    ) -> Result<GradStore> {
        let mut out = self
            .clock
            .measure(Phase::Communication, || sharded.finish_backward(grads))?;
        if let Some(p) = self.params() {
            for v in p.vars() {
                if let Some(g) = grads.get(v.as_tensor()) {
                    let g = if scale == 1.0 {
                        g.clone()
                    } else {
                        g.affine(1.0 / scale, 0.0)?
                    };
                    out.insert(v.as_tensor(), g);
                }
            }
        }
        Ok(out)
    }

    /// Stage 3 under fp16, at a step: whether the step's gradients are finite on every rank (one
    /// flag all-reduced). The loss scale follows the verdict (halved after an overflow, whose
    /// step every rank skips); a finite verdict also answers the `nonfinite` check. True
    /// without a loss scale.
    pub(crate) fn loss_scale_verdict(&self, grads: &GradStore) -> Result<bool> {
        let Some(s) = self.sharded().filter(|s| s.loss_scale().is_some()) else {
            return Ok(true);
        };
        let named = self.grad_vars("fp16 loss scaling")?;
        let mine = clip::grads_finite(&Self::vars_of(&named), grads)?;
        let finite = if self.alone() {
            mine
        } else {
            let mut overflow = [if mine { 0f32 } else { 1f32 }];
            self.collective
                .all_reduce((&mut overflow[..]).into(), crate::collective::ReduceOp::Max)?;
            overflow[0] == 0.0
        };
        s.update_scale(finite);
        if finite {
            self.mark_finite();
        }
        Ok(finite)
    }

    /// One micro-step from a token-weighted loss ([`TokenLoss`]): the gradient of its sum,
    /// accumulated with its token count; a sync step averages the sums over every token of the
    /// step (see [`token_weights`]).
    pub(crate) fn backward_tokens(&self, loss: &TokenLoss, end: bool) -> Result<Option<GradStore>> {
        let grads = self.backward_pass(loss.sum(), 1.0)?;
        self.accumulate_weighted(grads, Some(loss.tokens()), end)
    }

    /// One micro-step from gradients already computed (and divided by `N`): with `N = 1` they
    /// are averaged at once; otherwise the registered parameters' gradients are added to the
    /// local sums, and at a sync step (the `N`-th micro-step, or `end`) the sums are averaged
    /// across ranks and returned. Mixed precision feeds its f32 gradients in here.
    pub(crate) fn accumulate(&self, grads: GradStore, end: bool) -> Result<Option<GradStore>> {
        self.accumulate_weighted(grads, None, end)
    }

    /// [`accumulate`](Self::accumulate) for the gradients of a loss sum over `tokens` target
    /// tokens (`Some`, see [`token_weights`]) or of a mean loss already divided by `N` (`None`).
    pub(crate) fn accumulate_weighted(
        &self,
        mut grads: GradStore,
        tokens: Option<u64>,
        end: bool,
    ) -> Result<Option<GradStore>> {
        if self.steps == 1 {
            lock(&self.accum).synced = true;
            if tokens.is_some() {
                return self.finish_cycle(grads, 1, tokens).map(Some);
            }
            self.average(&mut grads)?;
            return Ok(Some(grads));
        }
        let vars = Self::vars_of(&self.grad_vars("backward")?);
        let mut acc = lock(&self.accum);
        let micro = acc.micro;
        acc.tokens.add(tokens, micro, self.rank())?;
        let previous = std::mem::take(&mut acc.pending);
        let mut summed = GradStore::default();
        for v in &vars {
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
        if acc.micro < self.steps && !end {
            acc.synced = false;
            acc.pending = summed;
            return Ok(None);
        }
        let k = std::mem::take(&mut acc.micro);
        let tokens = acc.tokens.take();
        acc.synced = true;
        drop(acc);
        self.finish_cycle(summed, k, tokens).map(Some)
    }

    /// Syncs the pending micro-steps now, if any.
    pub(crate) fn flush(&self) -> Result<Option<GradStore>> {
        let mut acc = lock(&self.accum);
        if acc.micro == 0 {
            return Ok(None);
        }
        let k = std::mem::take(&mut acc.micro);
        let summed = std::mem::take(&mut acc.pending);
        let tokens = acc.tokens.take();
        acc.synced = true;
        drop(acc);
        self.finish_cycle(summed, k, tokens).map(Some)
    }

    /// Rescales a short cycle of `k < N` micro-steps by `N/k` (mean losses) or the sums of a
    /// token-weighted cycle by `W / C` (its `tokens` on this rank, `C` on all ranks), and
    /// averages across ranks.
    fn finish_cycle(
        &self,
        mut grads: GradStore,
        k: usize,
        tokens: Option<u64>,
    ) -> Result<GradStore> {
        if let Some(t) = tokens {
            let vars = Self::vars_of(&self.grad_vars("backward_tokens")?);
            let factor = token_weights::global_factor(self.collective(), t, self.alone())?;
            clip::scale_grads(&vars, &mut grads, factor)?;
        } else if k < self.steps {
            let vars = Self::vars_of(&self.grad_vars("flush")?);
            clip::scale_grads(&vars, &mut grads, self.steps as f64 / k as f64)?;
        }
        self.average(&mut grads)?;
        Ok(grads)
    }

    /// Replaces the registered parameters' gradients by their mean over the ranks (nothing to do
    /// on a rank that is alone).
    pub(crate) fn average(&self, grads: &mut GradStore) -> Result<()> {
        if let Some(sharded) = self.sharded() {
            return self.average_sharded(&sharded, self.params().as_deref(), grads);
        }
        let params = match self.params() {
            Some(p) => p,
            None if self.alone() => return Ok(()),
            None => self.require_params("backward")?,
        };
        self.average_with(&params, grads)
    }

    /// Stage 3's sync step: the shards' gradients were averaged by their units' reduce-scatter;
    /// the replicated parameters' are averaged here; then the frozen-parameter check.
    fn average_sharded(
        &self,
        sharded: &zero3::Inner,
        params: Option<&ParamSet>,
        grads: &mut GradStore,
    ) -> Result<()> {
        self.probe.sync_step_starting()?;
        if let (Some(p), false) = (params, self.alone()) {
            let c = self.collective.as_ref();
            self.reduced
                .fetch_add(p.reduced_bytes_per_sync(), Ordering::Relaxed);
            self.clock.measure(Phase::Communication, || {
                self.reducer()?.average_gradients(p, c, grads)
            })?;
        }
        self.probe.sync_step_done();
        let mut all: Vec<String> = sharded.parameter_names();
        if let Some(p) = params {
            all.extend(p.names().iter().cloned());
        }
        all.sort();
        self.check_missing(&all, || {
            let mut missing = sharded.take_missing();
            if let Some(p) = params {
                missing.extend(p.without_grad(grads));
            }
            missing
        })
    }

    /// Averages (with more than one rank), then, on the first sync step, looks for parameters
    /// that no rank gave a gradient (after averaging, a gradient is present when any rank had
    /// one, so every rank reaches the same verdict).
    fn average_with(&self, params: &ParamSet, grads: &mut GradStore) -> Result<()> {
        self.probe.sync_step_starting()?;
        // Marked done only once the check's collective went through on every rank: a batch-size
        // search can abort it on some ranks, and then every rank runs it again.
        if !self.alone() && !self.data_checked.load(Ordering::Relaxed) {
            self.check_same_data(params, grads)?;
            self.data_checked.store(true, Ordering::Relaxed);
        }
        let c = self.collective.as_ref();
        if !self.alone() {
            self.reduced
                .fetch_add(params.reduced_bytes_per_sync(), Ordering::Relaxed);
        }
        if self.zero_stage >= 2 && !self.alone() {
            let present = self.clock.measure(Phase::Communication, || {
                self.reducer()?.reduce_scatter_gradients(params, c, grads)
            })?;
            self.probe.sync_step_done();
            return self.check_missing(params.names(), || params.names_where_absent(&present));
        }
        if !self.alone() {
            self.clock.measure(Phase::Communication, || {
                self.reducer()?.average_gradients(params, c, grads)
            })?;
        }
        self.probe.sync_step_done();
        self.check_missing(params.names(), || params.without_grad(grads))
    }

    /// Bytes of gradient buckets (gradients and presence flags, in the parameters' dtype) this
    /// rank has handed to the collective's all-reduce (or reduce-scatter) since it was created,
    /// a sharded model's units included: nothing when alone.
    pub(crate) fn reduced_bytes(&self) -> u64 {
        let units = self.sharded().map_or(0, |s| s.reduced_bytes());
        self.reduced.load(Ordering::Relaxed) + units
    }

    /// Whether the gradients handed out at a sync step are only this rank's slices (ZeRO stage 2
    /// with more than one rank): then a verdict drawn from them (an f16 overflow) must be agreed
    /// on by every rank, see [`agree_all_finite`](Self::agree_all_finite).
    pub(crate) fn grads_sharded(&self) -> bool {
        self.zero_stage >= 2 && !self.alone()
    }

    /// One verdict for every rank from each rank's own `finite` (whether its gradients held no
    /// inf or NaN): true only if it is true on every rank. With whole gradients every rank saw the
    /// same averaged values and reached the same verdict, so nothing is sent; with sharded
    /// gradients (ZeRO stage 2) each rank saw only its slices, and one Max all-reduce of an
    /// overflow flag makes them agree, so that all skip or all step (otherwise their next
    /// collectives would stop matching).
    pub(crate) fn agree_all_finite(&self, finite: bool) -> Result<bool> {
        if !self.grads_sharded() {
            return Ok(finite);
        }
        let mut overflow = [if finite { 0f32 } else { 1f32 }];
        self.collective
            .all_reduce((&mut overflow[..]).into(), crate::collective::ReduceOp::Max)?;
        Ok(overflow[0] == 0.0)
    }

    /// The non-finite check of an optimizer step (the `nonfinite` setting): whether to step on
    /// `grads`, the averaged gradients (this rank's slices under ZeRO stage 2). `norm` is their
    /// global norm when clipping already computed it (then nothing more is computed); else one
    /// pass over the gradients and one scalar read. Every rank reaches the same verdict (whole
    /// gradients are the same on every rank; sliced ones are agreed on by one all-reduce). With
    /// a non-finite gradient: an error naming the step, the rank and the first parameter
    /// (`error`), a warning on the main process and a step (`warn`) or no step (`skip-step`).
    pub(crate) fn check_finite(&self, grads: &GradStore, norm: Option<f64>) -> Result<bool> {
        let step = self.checked_steps.fetch_add(1, Ordering::Relaxed) + 1;
        let known = self.known_finite.swap(false, Ordering::Relaxed);
        if self.nonfinite == NonFinite::Off || known {
            return Ok(true);
        }
        let Ok(named) = self.grad_vars("nonfinite") else {
            return Ok(true);
        };
        let finite = match norm {
            Some(n) => n.is_finite(),
            None => clip::grads_finite(&Self::vars_of(&named), grads)?,
        };
        if self.agree_all_finite(finite)? {
            return Ok(true);
        }
        let mut first = None;
        if let Some(p) = self.params() {
            for (name, v) in p.named() {
                if let Some(g) = grads.get(v.as_tensor()) {
                    if let Some(detail) = clip::non_finite(g)? {
                        first = Some((name, detail));
                        break;
                    }
                }
            }
        }
        if first.is_none() {
            if let Some(s) = self.sharded() {
                first = s.first_non_finite(grads)?;
            }
        }
        let (param, detail) = first.unwrap_or_else(|| {
            (
                "(another rank's slice)".to_string(),
                "non-finite values".to_string(),
            )
        });
        let rank = self.rank();
        let say = |what: &str| {
            if rank == 0 {
                crate::logging::warn_always(format_args!(
                    "optimizer step {step}: the gradient of `{param}` holds {detail}; {what} \
                     (nonfinite = {})",
                    self.nonfinite.as_str()
                ));
            }
        };
        match self.nonfinite {
            NonFinite::Warn => {
                say("stepping anyway");
                Ok(true)
            }
            NonFinite::SkipStep => {
                say("step skipped");
                Ok(false)
            }
            _ => Err(Error::NonFinite {
                rank,
                step,
                param,
                detail,
            }),
        }
    }

    /// Tells the next [`check_finite`](Self::check_finite) that its gradients were found finite
    /// already (by fp16 loss scaling, on every rank): it then reads nothing back.
    pub(crate) fn mark_finite(&self) {
        self.known_finite.store(true, Ordering::Relaxed);
    }

    /// The collective the gradients are averaged over.
    pub(crate) fn collective(&self) -> &dyn Collective {
        self.collective.as_ref()
    }

    /// The ZeRO stage (0 to 3).
    pub(crate) fn zero_stage(&self) -> usize {
        self.zero_stage
    }

    /// ZeRO: this rank's slices of the registered parameters (checked to be shardable).
    pub(crate) fn shards(&self) -> Result<Vec<crate::optim::Shard>> {
        let params = self.require_params("zero_stage")?;
        params.check_shardable()?;
        Ok(params.shards(self.collective.world_size(), self.rank()))
    }

    /// ZeRO: after each rank stepped its slices, gives every rank the whole model (stages 1
    /// and 2; at stage 3 the next forward gathers what it needs).
    pub(crate) fn gather_params(&self) -> Result<()> {
        if self.alone() || self.zero_stage >= 3 {
            return Ok(());
        }
        let params = self.require_params("zero_stage")?;
        self.clock.measure(Phase::Communication, || {
            self.reducer()?
                .gather_params(&params, self.collective.as_ref())
        })
    }

    /// The frozen-parameter check of the first sync step (see [`MissingGradients`]); `missing`
    /// lists the parameters no rank gave a gradient.
    fn check_missing(&self, all: &[String], missing: impl FnOnce() -> Vec<String>) -> Result<()> {
        if self.missing == MissingGradients::Off || self.checked.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        let missing = missing();
        if missing.is_empty() {
            return Ok(());
        }
        let report = crate::train::missing::report(&missing, all);
        match self.missing {
            MissingGradients::Error => Err(Error::MissingGradients {
                rank: self.rank(),
                params: missing,
                report,
            }),
            _ => {
                if self.rank() == 0 {
                    crate::logging::warn_always(format_args!("{report}"));
                }
                Ok(())
            }
        }
    }

    /// The forgot-to-shard check of the first sync step (several ranks only, every rank calls
    /// it, just before the gradients are averaged): ranks start from the same parameters, so
    /// identical local gradients on every rank mean identical batches. Compares a fingerprint of
    /// this rank's gradients (a weighted sum of the per-parameter sums) across ranks with one
    /// small all-reduce, and warns on the main process when they are all equal. Non-sync
    /// micro-steps still communicate nothing.
    fn check_same_data(&self, params: &ParamSet, grads: &GradStore) -> Result<()> {
        // The weighted sums on the gradients' device, read back once (once per device).
        let mut parts: Vec<Tensor> = Vec::new();
        for (i, v) in params.vars().iter().enumerate() {
            if let Some(g) = grads.get(v.as_tensor()) {
                let sum = g.sum_all()?.to_dtype(candle_core::DType::F64)?;
                parts.push(sum.affine((i + 1) as f64, 0.0)?);
            }
        }
        let one_device = parts
            .iter()
            .all(|p| p.device().same_device(parts[0].device()));
        let fp = if parts.is_empty() {
            0.0
        } else if one_device {
            crate::readback::counted(|| Tensor::stack(&parts, 0)?.sum_all()?.to_scalar::<f64>())?
        } else {
            let mut fp = 0f64;
            for p in &parts {
                fp += crate::readback::counted(|| p.to_scalar::<f64>())?;
            }
            fp
        };
        let finite = fp.is_finite();
        let fp = if finite { fp } else { 0.0 };
        // max(fp), max(-fp) = -min(fp), and whether any rank had a non-finite gradient.
        let mut v = [fp, -fp, if finite { 0.0 } else { 1.0 }];
        self.collective
            .all_reduce((&mut v[..]).into(), crate::collective::ReduceOp::Max)?;
        if v[2] == 0.0 && v[0] == -v[1] && self.rank() == 0 {
            crate::logging::warn_always(format_args!(
                "{}",
                crate::train::missing::same_data_report(self.collective.world_size())
            ));
        }
        Ok(())
    }

    /// Clips gradients by their global L2 norm over the registered parameters and returns the
    /// norm before clipping (see [`Accelerator::clip_grad_norm`](crate::Accelerator::clip_grad_norm)).
    pub(crate) fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        check_positive("max_norm", max_norm)?;
        let vars = Self::vars_of(&self.grad_vars("clip_grad_norm")?);
        let norm = if self.zero_stage >= 2 && !self.alone() && self.sync_gradients() {
            // Each rank holds only its slice of the averaged gradients: add the squares up;
            // parameters replicated beside a sharded model (the same on every rank) count once.
            let (sliced, whole) = match self.sharded() {
                Some(s) => {
                    let shards = Self::vars_of(&s.shard_vars());
                    let replicated = self.params().map(|p| p.vars().to_vec()).unwrap_or_default();
                    (shards, replicated)
                }
                None => (vars.clone(), Vec::new()),
            };
            let mut sq = [clip::grad_sq_sum(&sliced, grads)?];
            self.collective
                .all_reduce((&mut sq[..]).into(), crate::collective::ReduceOp::Sum)?;
            (sq[0] + clip::grad_sq_sum(&whole, grads)?).sqrt()
        } else {
            clip::grad_norm(&vars, grads)?
        };
        if self.sync_gradients() && norm > max_norm {
            clip::scale_grads(&vars, grads, max_norm / (norm + 1e-6))?;
        }
        Ok(norm)
    }

    /// Clamps every registered parameter's gradient to `[-clip, clip]`.
    pub(crate) fn clip_grad_value(&self, grads: &mut GradStore, clip: f64) -> Result<()> {
        check_positive("clip", clip)?;
        let vars = Self::vars_of(&self.grad_vars("clip_grad_value")?);
        if self.sync_gradients() {
            clip::clamp_grads(&vars, grads, clip)?;
        }
        Ok(())
    }

    /// Applies `clip` to a copy of `grads` (the registered parameters' gradients): norm first,
    /// then value. Returns the clipped gradients and the norm before clipping, when clipped by
    /// norm. `None` when there is nothing to clip.
    pub(crate) fn clipped(
        &self,
        grads: &GradStore,
        clip: Clipping,
    ) -> Result<Option<(GradStore, Option<f64>)>> {
        if clip.norm.is_none() && clip.value.is_none() {
            return Ok(None);
        }
        let vars = Self::vars_of(&self.grad_vars("gradient clipping")?);
        let mut grads = clip::copy_grads(&vars, grads);
        let norm = match clip.norm {
            Some(max) => Some(self.clip_grad_norm(&mut grads, max)?),
            None => None,
        };
        if let Some(v) = clip.value {
            self.clip_grad_value(&mut grads, v)?;
        }
        Ok(Some((grads, norm)))
    }
}

/// Clipping applied in every optimizer step (both off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Clipping {
    /// Global L2 norm to clip to.
    pub(crate) norm: Option<f64>,
    /// Value to clamp every gradient to.
    pub(crate) value: Option<f64>,
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
