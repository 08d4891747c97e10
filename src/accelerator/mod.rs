//! [`Accelerator`]: the object a training script creates first. It knows the process's place in the
//! run, owns the collective, prepares the model, optimizer and data loader, and averages
//! gradients in [`backward`](Accelerator::backward).

pub mod dp;
pub mod ops;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};
use candle_nn::Optimizer;

use crate::accumulate::Accumulation;
use crate::collective::{Collective, NcclCollective, SingleProcess, TcpCollective, TcpOptions};
use crate::config::MixedPrecision;
use crate::data::{Batch, DataLoader};
use crate::error::{Error, Result};
use crate::mixed_precision::MixedPrecisionOptimizer;
use crate::optimizer::AcceleratedOptimizer;
use crate::params::{ParamSet, Parameters};
use crate::state::{DistributedType, Overrides, ProcessState};

/// State shared by the accelerator and the objects it prepares.
pub(crate) struct Shared {
    pub(crate) state: ProcessState,
    pub(crate) collective: Arc<dyn Collective>,
    params: Mutex<Option<Arc<ParamSet>>>,
    /// Gradient accumulation state (see [`crate::accumulate`]).
    pub(crate) accum: Mutex<Accumulation>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("state", &self.state)
            .field("collective", &self.collective.backend())
            .finish()
    }
}

impl Shared {
    pub(crate) fn params(&self) -> Option<Arc<ParamSet>> {
        self.params
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        let mut grads = loss.backward()?;
        if self.collective.world_size() > 1 {
            self.average(&mut grads)?;
        }
        Ok(grads)
    }

    fn average(&self, grads: &mut GradStore) -> Result<()> {
        let params = self.params().ok_or_else(|| {
            Error::invalid(
                "backward",
                format!(
                    "rank {}: no model was prepared; call `accelerator.prepare(&varmap, optimizer, loader)` (or `prepare_model`) before `backward` so gradients can be averaged across the {} ranks",
                    self.state.rank(),
                    self.collective.world_size()
                ),
            )
        })?;
        params.average_gradients(self.collective.as_ref(), grads)
    }
}

/// Sets up an [`Accelerator`]. Every setting follows one precedence: a builder call beats the
/// environment variable, which beats the config file, which beats the default (see the table in
/// the crate documentation).
#[derive(Default)]
pub struct AcceleratorBuilder {
    o: Overrides,
    collective: Option<Arc<dyn Collective>>,
}

impl std::fmt::Debug for AcceleratorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceleratorBuilder")
            .field("overrides", &self.o)
            .finish()
    }
}

impl AcceleratorBuilder {
    /// Force the CPU even when GPUs are present.
    pub fn cpu(mut self, cpu: bool) -> Self {
        self.o.cpu = Some(cpu);
        self
    }
    /// Timeout of every collective (default 30 minutes).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.o.timeout = Some(timeout);
        self
    }
    /// Gradient bucket cap in MiB (default 25).
    pub fn bucket_cap_mb(mut self, mb: f64) -> Self {
        self.o.bucket_cap_mb = Some(mb);
        self
    }
    /// The data path between processes on the CPU (default [`Transport::Auto`]: shared memory
    /// when every rank is on one host, else TCP).
    ///
    /// [`Transport::Auto`]: crate::collective::Transport::Auto
    pub fn transport(mut self, transport: crate::collective::Transport) -> Self {
        self.o.transport = Some(transport);
        self
    }
    /// Whether to tune glibc's allocator for training (default true; see
    /// [`crate::allocator`]).
    pub fn tune_malloc(mut self, on: bool) -> Self {
        self.o.tune_malloc = Some(on);
        self
    }
    /// Gradient accumulation steps (instead of `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`;
    /// default 1, 0 is rejected by [`build`](Self::build)); see [`crate::accumulate`].
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.o.gradient_accumulation_steps = Some(steps);
        self
    }
    /// Mixed precision (instead of `ACCELERATE_RS_MIXED_PRECISION`), used by
    /// [`Accelerator::prepare_mixed`]; see [`crate::mixed_precision`].
    pub fn mixed_precision(mut self, mode: MixedPrecision) -> Self {
        self.o.mixed_precision = Some(mode);
        self
    }
    /// Read this config file instead of the default one.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.o.config_file = Some(path.into());
        self
    }
    /// This process's rank (instead of `RANK`).
    pub fn rank(mut self, rank: usize) -> Self {
        self.o.rank = Some(rank);
        self
    }
    /// Number of processes (instead of `WORLD_SIZE`).
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.o.world_size = Some(world_size);
        self
    }
    /// Rank on this machine (instead of `LOCAL_RANK`).
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.o.local_rank = Some(local_rank);
        self
    }
    /// Address of rank 0 (instead of `MASTER_ADDR`).
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.o.master_addr = Some(addr.into());
        self
    }
    /// Rendezvous port (instead of `MASTER_PORT`).
    pub fn master_port(mut self, port: u16) -> Self {
        self.o.master_port = Some(port);
        self
    }
    /// The run's secret (instead of `ACCELERATE_RS_SECRET`).
    pub fn secret(mut self, secret: impl Into<String>) -> Self {
        self.o.secret = Some(secret.into());
        self
    }
    /// Use an existing collective (e.g. one rank of a [`ThreadGroup`](crate::collective::ThreadGroup));
    /// rank and world size are taken from it and no connection is made.
    pub fn collective(mut self, collective: Arc<dyn Collective>) -> Self {
        self.o.rank = Some(collective.rank());
        self.o.world_size = Some(collective.world_size());
        self.o.local_rank = Some(collective.rank());
        self.o.local_world_size = Some(collective.world_size());
        self.o.external_collective = true;
        self.collective = Some(collective);
        self
    }

    /// DP: this process drives `replicas` model replicas, one thread each: GPUs `0..replicas`, or
    /// CPU replicas with [`cpu(true)`](Self::cpu) (instead of `ACCELERATE_RS_DATA_PARALLEL`;
    /// 1 = no DP). Start them with [`run`](Self::run); see [`crate::dp`].
    pub fn data_parallel(mut self, replicas: usize) -> Self {
        self.o.data_parallel = Some(replicas);
        self
    }

    /// Runs `f` once per replica, each with its own [`Accelerator`] (DP, see [`crate::dp`]), or
    /// exactly once on the calling thread (every other mode). Results come back in replica order.
    /// If any replica fails (error or panic), returns the first failure, naming the replica; the
    /// other replicas do not hang, their collectives fail once the failed replica's is dropped.
    pub fn run<R, F>(self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(Accelerator) -> Result<R> + Send + Sync,
    {
        crate::dp::run(self.o, self.collective, &|k| std::env::var(k).ok(), f)
    }

    /// A builder from resolved-later parts (used by [`crate::dp`] for each replica).
    pub(crate) fn from_parts(o: Overrides, collective: Option<Arc<dyn Collective>>) -> Self {
        AcceleratorBuilder { o, collective }
    }

    /// Resolves the settings and joins the run (for several processes: waits until every rank
    /// has connected, up to the timeout).
    pub fn build(self) -> Result<Accelerator> {
        self.build_with(&|k| std::env::var(k).ok())
    }

    /// [`build`](Self::build) reading the environment through `getenv`.
    pub(crate) fn build_with(self, getenv: &dyn Fn(&str) -> Option<String>) -> Result<Accelerator> {
        let state = ProcessState::resolve(&self.o, getenv)?;
        if state.tune_malloc() {
            crate::allocator::tune();
        }
        let tcp = || TcpOptions {
            rank: state.rank(),
            world_size: state.world_size(),
            master_addr: state.master_addr().unwrap_or("127.0.0.1").to_string(),
            master_port: state.master_port(),
            secret: state.secret().to_vec(),
            timeout: state.timeout(),
            transport: Some(state.transport()),
        };
        let external = self.collective.is_some();
        let collective: Arc<dyn Collective> = match self.collective {
            Some(c) => c,
            None if state.world_size() == 1 => Arc::new(SingleProcess),
            None if state.distributed_type() == DistributedType::Ddp => {
                Arc::new(NcclCollective::connect(&tcp(), state.device())?)
            }
            None => Arc::new(TcpCollective::connect(&tcp())?),
        };
        if !external
            && state.world_size() > 1
            && state.secret().is_empty()
            && state.is_main_process()
        {
            log::warn!("ACCELERATE_RS_SECRET is not set: connections between ranks are not authenticated (`accelerate-rs launch` sets it)");
        }
        log::debug!(
            "rank {}: {} with {} rank(s), backend {}",
            state.rank(),
            state.distributed_type(),
            state.world_size(),
            collective.backend()
        );
        Ok(Accelerator {
            shared: Arc::new(Shared {
                state,
                collective,
                params: Mutex::new(None),
                accum: Mutex::new(Accumulation::default()),
            }),
        })
    }
}

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
    shared: Arc<Shared>,
}

impl Accelerator {
    /// Reads the environment and the config file and joins the run.
    pub fn new() -> Result<Self> {
        Self::builder().build()
    }

    /// A builder to override settings in code.
    pub fn builder() -> AcceleratorBuilder {
        AcceleratorBuilder::default()
    }

    /// This process's state and settings.
    pub fn state(&self) -> &ProcessState {
        &self.shared.state
    }
    /// Global rank.
    pub fn rank(&self) -> usize {
        self.shared.state.rank()
    }
    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.shared.state.local_rank()
    }
    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.shared.state.world_size()
    }
    /// The device to create the model and tensors on.
    pub fn device(&self) -> &Device {
        self.shared.state.device()
    }
    /// How the run is distributed.
    pub fn distributed_type(&self) -> DistributedType {
        self.shared.state.distributed_type()
    }
    /// Whether this is rank 0 (the one that should print, log and save).
    pub fn is_main_process(&self) -> bool {
        self.shared.state.is_main_process()
    }
    /// Whether this is local rank 0 (once per machine).
    pub fn is_local_main_process(&self) -> bool {
        self.shared.state.is_local_main_process()
    }
    /// The collective used between ranks.
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.shared.collective
    }

    /// Prepares the three pieces of a training loop: checks that every rank has the same
    /// parameters and gives them rank 0's values, wraps the optimizer, and shards the loader so
    /// each rank sees its own part of every global batch.
    pub fn prepare<P: Parameters + ?Sized, O: Optimizer>(
        &self,
        model: &P,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(AcceleratedOptimizer<O>, DataLoader)> {
        self.prepare_model(model)?;
        Ok((
            self.prepare_optimizer(optimizer),
            self.prepare_data_loader(loader)?,
        ))
    }

    /// [`prepare`](Self::prepare) for mixed precision (the mode of
    /// [`ProcessState::mixed_precision`]): `model` holds the f32 master weights and `optimizer`
    /// steps them; returns the optimizer, the loader and a `VarMap` of working copies in the
    /// compute dtype to build the model from (see [`crate::mixed_precision`]). With
    /// [`MixedPrecision::No`] it is `prepare` and the `VarMap` is `model`'s variables.
    pub fn prepare_mixed<P: Parameters + ?Sized, O: Optimizer>(
        &self,
        model: &P,
        optimizer: O,
        loader: DataLoader,
    ) -> Result<(MixedPrecisionOptimizer<O>, DataLoader, candle_nn::VarMap)> {
        let (opt, loader) = self.prepare(model, optimizer, loader)?;
        let mode = self.shared.state.mixed_precision();
        let opt = MixedPrecisionOptimizer::new(opt, self.shared.clone(), mode, model)?;
        let work = opt.working_vars().clone();
        Ok((opt, loader, work))
    }

    /// Registers a model's parameters (adding to any registered before), verifies them across
    /// ranks and broadcasts rank 0's values.
    pub fn prepare_model<P: Parameters + ?Sized>(&self, model: &P) -> Result<()> {
        let mut named = model.named_parameters();
        if named.is_empty() {
            return Err(Error::invalid(
                "model",
                "it has no parameters; create them through the VarMap before calling prepare",
            ));
        }
        if let Some(old) = self.shared.params() {
            named.extend(old.named());
        }
        let set = ParamSet::new(named, self.shared.state.bucket_cap_bytes())?;
        let c = self.shared.collective.as_ref();
        set.verify(c)?;
        set.broadcast_from_main(c)?;
        log::debug!(
            "rank {}: prepared {} parameters in {} bucket(s)",
            self.rank(),
            set.len(),
            set.num_buckets()
        );
        *self.shared.params.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(set));
        Ok(())
    }

    /// Wraps an optimizer (see [`AcceleratedOptimizer`]).
    pub fn prepare_optimizer<O: Optimizer>(&self, optimizer: O) -> AcceleratedOptimizer<O> {
        AcceleratedOptimizer::new(optimizer, self.shared.clone())
    }

    /// Shards a loader for this rank and moves its batches to this process's device.
    pub fn prepare_data_loader(&self, loader: DataLoader) -> Result<DataLoader> {
        Ok(loader
            .shard(self.rank(), self.world_size())?
            .device(self.device()))
    }

    /// Runs `loss.backward()` and averages the gradients across ranks (bucketed, one collective
    /// per bucket). With one process it is exactly `loss.backward()`.
    ///
    /// With gradient accumulation (`N > 1`, see [`crate::accumulate`]) this is one micro-step:
    /// the loss is scaled by `1/N` and the gradients are summed locally. On a sync step (every
    /// `N`-th call) the returned store holds the accumulated gradients averaged across ranks; on
    /// the other calls it holds this rank's local partial sums, which are not to be applied
    /// ([`AcceleratedOptimizer::step`] skips them by itself; check
    /// [`sync_gradients`](Self::sync_gradients) before doing anything else with them). Use
    /// [`backward_batch`](Self::backward_batch) so the loader's last batch syncs too.
    ///
    /// With several processes on the CPU, the averaged gradients are views into reusable flat
    /// buffers (one per bucket, as in PyTorch DDP): they stay valid until the next averaging
    /// `backward` of this accelerator, which overwrites them. Copy a gradient (`Tensor::copy`) to
    /// keep it longer.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        self.shared.backward_micro(loss, false)
    }

    /// [`backward`](Self::backward) that also makes the micro-step a sync step when `batch` is
    /// the loader's last ([`Batch::is_last`]), so a partial accumulation cycle at the end of an
    /// epoch is applied rather than carried into the next epoch.
    pub fn backward_batch(&self, loss: &Tensor, batch: &Batch) -> Result<GradStore> {
        self.shared.backward_micro(loss, batch.is_last())
    }

    /// Syncs pending micro-steps now: returns their gradients averaged across ranks (rescaled
    /// to a mean over the micro-steps seen), or `None` when nothing is pending (then nothing is
    /// communicated). All ranks must call it at the same point.
    pub fn flush_gradients(&self) -> Result<Option<GradStore>> {
        self.shared.flush()
    }

    /// Whether the last micro-step was a sync step, i.e. the gradients were averaged across ranks
    /// and the optimizer stepped (true before the first backward and always when `N = 1`). Step
    /// schedulers, clip and log only when it is true.
    pub fn sync_gradients(&self) -> bool {
        self.shared.sync_gradients()
    }

    /// The number of micro-steps per optimizer step (`N`).
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.shared.state.gradient_accumulation_steps()
    }

    /// Micro-steps accumulated since the last sync step.
    pub fn pending_micro_steps(&self) -> usize {
        self.shared.pending_micro_steps()
    }

    /// Clips gradients by their global L2 norm over all registered parameters (those of
    /// [`prepare_model`](Self::prepare_model)) and returns that norm (before clipping). Pass the
    /// gradients of a sync step: they are already averaged, so every rank computes the same norm
    /// and scales alike. When the norm exceeds `max_norm`, every gradient is multiplied by
    /// `max_norm / (norm + 1e-6)`. After a non-sync micro-step the gradients are left alone and
    /// the returned norm is that of this rank's local partial sums.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        self.shared.clip_grad_norm(grads, max_norm)
    }

    /// Clamps every registered parameter's gradient to `[-clip, clip]` (left alone after a
    /// non-sync micro-step, like [`clip_grad_norm`](Self::clip_grad_norm)).
    pub fn clip_grad_value(&self, grads: &mut GradStore, clip: f64) -> Result<()> {
        self.shared.clip_grad_value(grads, clip)
    }

    /// Averages gradients computed elsewhere across ranks, in place.
    pub fn reduce_gradients(&self, grads: &mut GradStore) -> Result<()> {
        if self.world_size() == 1 {
            return Ok(());
        }
        self.shared.average(grads)
    }

    /// Prints a line on the main process only (other ranks print nothing).
    pub fn print(&self, line: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{line}");
        }
    }

    /// Returns once every rank has reached this point.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.shared.collective.barrier()
    }
}
