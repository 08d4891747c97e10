//! [`AcceleratorBuilder`]: settings given in code, then [`build`](AcceleratorBuilder::build) (one
//! accelerator) or [`run`](AcceleratorBuilder::run) (one per DP replica).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::Accelerator;
use crate::collective::Collective;
use crate::error::Result;
use crate::settings::runtime::process_var;
use crate::settings::{
    MissingGradients, MixedPrecision, NonFinite, Overrides, ProcessState, Transport,
};

/// Sets up an [`Accelerator`]. Every setting follows one precedence: a builder call beats the
/// environment variable, which beats the config file, which beats the default (see the table in
/// the crate documentation).
#[derive(Default)]
pub struct AcceleratorBuilder {
    pub(super) o: Overrides,
    pub(super) collective: Option<Arc<dyn Collective>>,
}

impl std::fmt::Debug for AcceleratorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AcceleratorBuilder")
            .field("overrides", &self.o)
            .finish()
    }
}

/// Builder methods that each set one override: `/// docs` and `name: Type;` give
/// `pub fn name(mut self, value: Type) -> Self`, setting `self.o.name`.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Self {
                self.o.$name = Some(value);
                self
            }
        )*
    };
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
}

impl AcceleratorBuilder {
    setters! {
        /// Force the CPU even when GPUs are present.
        cpu: bool;
        /// Timeout of every collective (default 30 minutes).
        timeout: Duration;
        /// Gradient bucket cap in MiB (default 25).
        bucket_cap_mb: f64;
        /// The data path between processes on the CPU (default [`Transport::Auto`]: shared memory
        /// when every rank is on one host, else TCP).
        ///
        /// [`Transport::Auto`]: crate::Transport::Auto
        transport: Transport;
        /// What the first optimizer step does when registered parameters received no gradient
        /// (default [`MissingGradients::Warn`]: one warning on the main process naming them).
        missing_gradients: MissingGradients;
        /// What an optimizer step does when the averaged gradients hold a NaN or an infinity
        /// (default [`NonFinite::Error`]: every rank stops with an error naming the step, the
        /// rank and the parameter).
        nonfinite: NonFinite;
        /// Accelerate's `split_batches` for every loader this accelerator prepares: the loader's
        /// batch size is the *global* batch, split evenly across the ranks, so the optimization
        /// follows the same trajectory at any world size (default false: the batch size is per
        /// rank, and the global batch grows with the number of processes). Also
        /// `ACCELERATE_RS_SPLIT_BATCHES` and the config key `split_batches`.
        split_batches: bool;
        /// ZeRO-style sharding (default 0, none): at stage 1 each rank keeps the optimizer state of
        /// only its 1/N slice of the parameters, updates that slice and all-gathers the rest; at
        /// stage 2 the gradients are reduce-scattered and each rank keeps only its slice of them
        /// too. Needs [`optim::AdamW`](crate::optim::AdamW) or [`optim::Sgd`](crate::optim::Sgd)
        /// and CPU parameters.
        zero_stage: usize;
        /// ZeRO stage 3: keep the optimizer state, f32 masters and f32 gradients of this
        /// rank's shards in host memory and step them there with the CPU optimizer (instead of
        /// `ACCELERATE_RS_OFFLOAD_OPTIMIZER`, the config key `offload_optimizer`; default
        /// false). The device keeps the shards in the compute dtype for the gathers.
        offload_optimizer: bool;
        /// Whether to tune glibc's allocator for training (default true; see
        /// [`allocator`](crate::allocator)).
        tune_malloc: bool;
        /// Gradient accumulation steps (instead of `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`;
        /// default 1, 0 is rejected by [`build`](Self::build)); see
        /// [`Accelerator::backward`].
        gradient_accumulation_steps: usize;
        /// Mixed precision (instead of `ACCELERATE_RS_MIXED_PRECISION`), used by
        /// [`Accelerator::prepare_mixed`]; see [`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer).
        mixed_precision: MixedPrecision;
        /// Run this program as `n` processes when it is started on its own (instead of
        /// `ACCELERATE_RS_NUM_PROCESSES`; default 1): [`build`](Self::build) then starts `n` copies
        /// of the program (same executable, same arguments) with the launcher's variables, prints
        /// their lines prefixed with `[rank i]`, stops them all when one fails or on Ctrl-C, and
        /// exits with the failed rank's code; it does not return in this parent process. Each copy
        /// reaches the same `build` as a worker of the run and trains. Ignored in a process a
        /// launcher started (`accelerate-rs launch`, torchrun, SLURM, `mpirun`: `RANK` is set), so
        /// the same program still runs under them. Call it first thing in `main`: whatever runs
        /// before it runs in the parent too. Workers get no stdin.
        ///
        /// ```no_run
        /// # fn main() -> accelerate_rs::Result<()> {
        /// let accelerator = accelerate_rs::Accelerator::builder().processes(2).build()?;
        /// accelerator.print(format!("{} processes", accelerator.world_size()));
        /// # Ok(()) }
        /// ```
        processes: usize;
    }
    /// Read this config file instead of the default one.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.o.config_file = Some(path.into());
        self
    }
    setters! {
        /// This process's rank (instead of `RANK`).
        rank: usize;
        /// Number of processes (instead of `WORLD_SIZE`).
        world_size: usize;
        /// Rank on this machine (instead of `LOCAL_RANK`).
        local_rank: usize;
    }
    /// Address of rank 0 (instead of `MASTER_ADDR`).
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.o.master_addr = Some(addr.into());
        self
    }
    setters! {
        /// Rendezvous port (instead of `MASTER_PORT`).
        master_port: u16;
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

    setters! {
        /// DP: this process drives `replicas` model replicas, one thread each: GPUs `0..replicas`, or
        /// CPU replicas with [`cpu(true)`](Self::cpu) (instead of `ACCELERATE_RS_DATA_PARALLEL`;
        /// 1 = no DP). Start them with [`run`](Self::run).
        ///
        /// DP runs in one process; the closure given to `run` is an ordinary training loop, run once
        /// per replica with that replica's accelerator (rank = replica index, world size =
        /// `replicas`). `build()` refuses a DP request, since one accelerator cannot drive several
        /// replicas.
        data_parallel: usize;
    }

    /// Runs `f` once per replica, each with its own [`Accelerator`] (DP, see
    /// [`AcceleratorBuilder::data_parallel`]), or exactly once on the calling thread (every other
    /// mode). Results come back in replica order. If any replica fails (error or panic), returns
    /// [`Error::Replica`](crate::Error::Replica) naming the first one to fail; the other replicas do not hang, their
    /// collectives fail once the failed replica's is dropped.
    pub fn run<R, F>(self, f: F) -> Result<Vec<R>>
    where
        R: Send,
        F: Fn(Accelerator) -> Result<R> + Send + Sync,
    {
        self_launch(&self.o, &process_var)?;
        super::dp::run(self.o, self.collective, &process_var, f)
    }

    /// Resolves the settings and joins the run (for several processes: waits until every rank
    /// has connected, up to the timeout).
    pub fn build(self) -> Result<Accelerator> {
        self.build_with(&process_var)
    }

    /// [`build`](Self::build) reading the environment through `getenv`.
    pub(crate) fn build_with(self, getenv: &dyn Fn(&str) -> Option<String>) -> Result<Accelerator> {
        self_launch(&self.o, getenv)?;
        crate::settings::runtime::pin_cpu_threads();
        let state = ProcessState::resolve(&self.o, getenv)?;
        if state.data_parallel() > 1 {
            return Err(super::dp::needs_run(state.data_parallel()));
        }
        let collective = match self.collective {
            Some(c) => c,
            None => super::connect::connect(&state)?,
        };
        Ok(Accelerator::from_parts(state, collective))
    }
}

/// Becomes the launcher of this program's workers when [`AcceleratorBuilder::processes`] (or
/// `ACCELERATE_RS_NUM_PROCESSES`) asks for several and no launcher started this process: runs
/// them and exits. Returns when this process is to train itself.
fn self_launch(o: &Overrides, getenv: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    match crate::settings::self_launch(o, getenv)? {
        Some(plan) => match super::spawn::run(&plan)? {},
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::env;

    #[test]
    fn build_refuses_data_parallel_replicas_and_says_to_run() {
        // A private empty config file, so a developer's config cannot interfere.
        let cfg = tempfile::NamedTempFile::new().unwrap();
        let builder = AcceleratorBuilder {
            o: Overrides {
                config_file: Some(cfg.path().to_path_buf()),
                ..Overrides::default()
            },
            collective: None,
        };
        let getenv = |k: &str| (k == env::DATA_PARALLEL).then(|| "2".to_string());
        let e = builder.build_with(&getenv).unwrap_err().to_string();
        assert!(e.contains("run") && e.contains("data_parallel"), "{e}");
    }
}
