//! # accelerate-rs
//!
//! Data-parallel training for [Candle](https://github.com/huggingface/candle) on many CPUs or
//! GPUs, without rewriting the training loop: Hugging Face Accelerate + PyTorch DDP + torchrun,
//! in Rust.
//!
//! A plain Candle loop becomes a distributed one with a handful of lines: create an
//! [`Accelerator`], build the model on [`Accelerator::device`], and hand model, optimizer and
//! [`DataLoader`] to [`Accelerator::prepare`]. `opt.backward_step(&loss)` then averages the
//! gradients across ranks before stepping. Run it as is for one process, or under
//! `accelerate-rs launch --cpu -n 4 ./train` for four.
//!
//! ```
//! use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
//! use candle_core::{DType, Module, Tensor};
//! use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let accelerator = Accelerator::new()?;
//!     let device = accelerator.device().clone();
//!     let x = Tensor::randn(0f32, 1.0, (64, 4), &device)?;
//!     let y = x.sum_keepdim(1)?;
//!
//!     let varmap = VarMap::new();
//!     let model = linear(4, 1, VarBuilder::from_varmap(&varmap, DType::F32, &device).pp("fc"))?;
//!     let opt = SGD::new(varmap.all_vars(), 0.05)?;
//!     let loader = DataLoader::new(TensorDataset::new(vec![x, y])?, 16).shuffle(true);
//!     let (mut opt, mut loader) = accelerator.prepare(&varmap, opt, loader)?;
//!
//!     for epoch in 0..30 {
//!         loader.set_epoch(epoch);
//!         for batch in loader.iter()? {
//!             let batch = batch?;
//!             let loss = loss::mse(&model.forward(&batch[0])?, &batch[1])?;
//!             opt.backward_step(&loss)?;
//!         }
//!     }
//!     Ok(())
//! }
//! ```
//!
//! ## Settings and their precedence
//!
//! Every setting is resolved the same way: **builder call > environment variable > config file >
//! default**. The config file is `ACCELERATE_RS_CONFIG_FILE` if set, else
//! `<config dir>/accelerate-rs/default_config.toml` (e.g. `~/.config/...` on Linux).
//!
//! | setting | builder | environment | config key | default |
//! |---|---|---|---|---|
//! | rank | [`rank`](AcceleratorBuilder::rank) | `RANK`, else `SLURM_PROCID`, else `OMPI_COMM_WORLD_RANK` | - | 0 |
//! | world size | [`world_size`](AcceleratorBuilder::world_size) | `WORLD_SIZE` / `SLURM_NTASKS` / `OMPI_COMM_WORLD_SIZE` | - | 1 |
//! | local rank | [`local_rank`](AcceleratorBuilder::local_rank) | `LOCAL_RANK` / `SLURM_LOCALID` / `OMPI_COMM_WORLD_LOCAL_RANK` | - | the rank |
//! | local world size | - | `LOCAL_WORLD_SIZE` / `SLURM_NTASKS_PER_NODE` / `OMPI_COMM_WORLD_LOCAL_SIZE` | - | the world size |
//! | rank 0's address | [`master_addr`](AcceleratorBuilder::master_addr) | `MASTER_ADDR` | `main_process_ip` | required when world size > 1 |
//! | rendezvous port | [`master_port`](AcceleratorBuilder::master_port) | `MASTER_PORT` | `main_process_port` | 29500 |
//! | run secret | [`secret`](AcceleratorBuilder::secret) | `ACCELERATE_RS_SECRET` | - | none (unauthenticated, warned) |
//! | collective timeout | [`timeout`](AcceleratorBuilder::timeout) | `ACCELERATE_RS_TIMEOUT_SECS` | `collective_timeout_secs` | 1800 s |
//! | gradient bucket cap | [`bucket_cap_mb`](AcceleratorBuilder::bucket_cap_mb) | `ACCELERATE_RS_BUCKET_CAP_MB` | `bucket_cap_mb` | 25 MiB |
//! | allocator tuning ([`allocator`]) | [`tune_malloc`](AcceleratorBuilder::tune_malloc) | `ACCELERATE_RS_TUNE_MALLOC` | `tune_malloc` | on |
//! | force CPU | [`cpu`](AcceleratorBuilder::cpu) | `ACCELERATE_RS_USE_CPU` | `use_cpu` | unset: GPUs when built with `cuda` and present, else CPU |
//! | DP replicas | [`data_parallel`](AcceleratorBuilder::data_parallel) | `ACCELERATE_RS_DATA_PARALLEL` | - | 1 (no DP) |
//! | mixed precision (used by [`prepare_mixed`](Accelerator::prepare_mixed)) | [`mixed_precision`](AcceleratorBuilder::mixed_precision) | `ACCELERATE_RS_MIXED_PRECISION` | `mixed_precision` | `no` |
//! | gradient accumulation | [`gradient_accumulation_steps`](AcceleratorBuilder::gradient_accumulation_steps) | `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS` | `gradient_accumulation_steps` | 1 |
//! | config file | [`config_file`](AcceleratorBuilder::config_file) | `ACCELERATE_RS_CONFIG_FILE` | - | platform config dir |
//! | CPU collective transport (several processes) | [`transport`](AcceleratorBuilder::transport) | `ACCELERATE_RS_TRANSPORT`: `auto`, `tcp` or `shm` | `transport` | `auto`: shared memory when every rank is on one host, else TCP |
//! | reduce CPU gradient buckets on a communication thread while the next is flattened | - | `ACCELERATE_RS_OVERLAP`: `1` or `0` | - | on |
//! | fused optimizer kernels ([`optim`]) | [`AdamW::set_fused`](optim::AdamW::set_fused), [`Sgd::set_fused`](optim::Sgd::set_fused) | `ACCELERATE_RS_FUSED_OPTIM`: `1` or `0` | - | on |
//!
//! The launcher families are not mixed: the first of torchrun, SLURM, Open MPI whose rank
//! variable is set provides rank, world size and local rank. Inconsistent values (a rank not below
//! the world size, a world size without a rank, a missing `MASTER_ADDR`, a number that does not
//! parse) are errors naming the variable and its value.
//!
//! ## Modules
//!
//! - [`accelerator`]: [`Accelerator`] and its builder; `prepare`, `backward`.
//! - [`accumulate`]: gradient accumulation (micro-steps, sync steps) and gradient clipping.
//! - [`mixed_precision`]: bf16/f16 compute with f32 master weights and f16 loss scaling
//!   ([`Accelerator::prepare_mixed`]).
//! - [`checkpoint`]: `save_state` / `load_state` / `save_model` on [`Accelerator`], atomic
//!   checkpoint directories with rotation ([`checkpoint::latest_checkpoint`]), and mid-epoch
//!   resume ([`DataLoader::resume_at`]).
//! - [`collective`]: the [`Collective`] trait and its backends (single
//!   process, TCP ring with a same-host shared-memory data path, in-process threads).
//! - [`ops`]: collectives for users on [`Accelerator`]: `gather`, `gather_for_metrics`, `reduce`,
//!   `broadcast`, `pad_across_processes`, `main_process_first`, `split_between_processes`,
//!   `set_seed`, `debug_shapes`.
//! - [`dp`]: DP, one process driving several model replicas, one thread each ([`AcceleratorBuilder::run`]).
//! - [`data`]: [`Dataset`], [`TensorDataset`], [`DistributedSampler`], [`DataLoader`].
//! - [`launch`]: the launcher behind `accelerate-rs launch`; [`cli`]: the `accelerate-rs` command.
//! - [`config`], [`state`], [`env`](mod@env): settings, their sources and the variable names.
//! - [`gpu`]: GPU discovery (`gpu_stub.rs` in a build without the `cuda` feature).
//! - [`optim`]: [`optim::AdamW`] and [`optim::Sgd`] (momentum, Nesterov, weight decay) with
//!   their state exposed for checkpoints ([`optim::OptimizerState`]), updating parameters with
//!   fused in-place kernels on the CPU and on CUDA.
//! - [`allocator`]: glibc allocator tuning for training loops (applied by [`Accelerator`]).
//! - [`scheduler`]: learning-rate schedules ([`scheduler::LrScheduler`], warmup + cosine or
//!   linear decay) and the [`scheduler::Schedule`] driver, stepped once per optimizer step.
//! - [`error`]: the typed [`Error`].
//! - [`tracking`]: metric trackers (JSON Lines, TensorBoard) written by the main process only,
//!   and a main-process [`Progress`](tracking::Progress) bar.
//! - [`logging`]: `env_logger` set-up with a `[rank N]` prefix on each line.
#![deny(missing_docs)]

mod accelerator;
pub mod allocator;
pub mod cli;
pub mod collective;
pub mod data;
pub mod error;
mod inplace;
pub mod launch;
pub mod logging;
pub mod optim;
mod placement;
mod settings;
pub mod tracking;
mod train;

pub use settings::{config, env, gpu, state};
pub use train::{checkpoint, mixed_precision, optimizer, params, scheduler};

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use checkpoint::{latest_checkpoint, CheckpointParts, LoaderPosition, StatefulOptimizer};
pub use collective::{Collective, ReduceOp};
pub use config::{ConfigFile, MixedPrecision};
pub use data::{Batch, DataLoader, Dataset, DistributedSampler, EvenBatches, TensorDataset};
pub use error::{Error, ReplicaCause, ReplicaFailure, Result};
pub use mixed_precision::{LossScaler, MixedPrecisionOptimizer};
pub use optimizer::{AcceleratedOptimizer, TrainOptimizer};
pub use params::Parameters;
pub use settings::Transport;
pub use state::{DistributedType, ProcessState};
