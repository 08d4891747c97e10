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
//! `accelerate-rs launch --cpu -n 4 ./train` for four, or as `ACCELERATE_RS_NUM_PROCESSES=4
//! ./train` (no launcher to build: see [`AcceleratorBuilder::processes`]).
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
//! **The `DataLoader` batch size is per process**: on `N` processes every optimizer step
//! averages `N` batches, so the global batch grows with `N`. For a fixed global batch (the same
//! trajectory at any world size) turn on [`split_batches`](AcceleratorBuilder::split_batches)
//! (`ACCELERATE_RS_SPLIT_BATCHES=1`, config key `split_batches`). A loop that slices its own
//! batches takes its rank's rows with [`Accelerator::shard_rows`] (or indices with
//! [`Accelerator::shard_range`]); [`Accelerator::average`] gives a number (a loss) averaged over
//! all ranks for printing.
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
//! | processes a program started on its own runs as (the self-launch; ignored under a launcher) | [`processes`](AcceleratorBuilder::processes) | `ACCELERATE_RS_NUM_PROCESSES` | - (the config's `num_processes` is `accelerate-rs launch`'s) | 1 |
//! | mixed precision (used by [`prepare_mixed`](Accelerator::prepare_mixed)) | [`mixed_precision`](AcceleratorBuilder::mixed_precision) | `ACCELERATE_RS_MIXED_PRECISION` | `mixed_precision` | `no` |
//! | gradient accumulation | [`gradient_accumulation_steps`](AcceleratorBuilder::gradient_accumulation_steps) | `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS` | `gradient_accumulation_steps` | 1 |
//! | config file | [`config_file`](AcceleratorBuilder::config_file) | `ACCELERATE_RS_CONFIG_FILE` | - | platform config dir |
//! | CPU collective transport (several processes) | [`transport`](AcceleratorBuilder::transport) | `ACCELERATE_RS_TRANSPORT`: `auto`, `tcp` or `shm` | `transport` | `auto`: shared memory when every rank is on one host, else TCP |
//! | Global batch split across ranks | [`split_batches`](AcceleratorBuilder::split_batches) | `ACCELERATE_RS_SPLIT_BATCHES` | `split_batches` | off: the batch size is per rank |
//! | ZeRO sharding stage | [`zero_stage`](AcceleratorBuilder::zero_stage) | `ACCELERATE_RS_ZERO_STAGE`: 0, 1, 2 or 3 | `zero_stage` | 0 |
//! | Parameters without a gradient at the first step | [`missing_gradients`](AcceleratorBuilder::missing_gradients) | `ACCELERATE_RS_MISSING_GRADIENTS`: `warn`, `error` or `off` | `missing_gradients` | `warn`: one warning on the main process naming them |
//! | Gradients that turn NaN or infinite | [`nonfinite`](AcceleratorBuilder::nonfinite) | `ACCELERATE_RS_NONFINITE`: `error`, `warn`, `skip-step` or `off` | `nonfinite` | `error`: every rank stops, naming the step, the rank and the parameter |
//! | reduce CPU gradient buckets on a communication thread while the next is flattened | - | `ACCELERATE_RS_OVERLAP`: `1` or `0` | - | on |
//! | fused optimizer kernels ([`optim`]) | [`AdamW::set_fused`](optim::AdamW::set_fused), [`Sgd::set_fused`](optim::Sgd::set_fused) | `ACCELERATE_RS_FUSED_OPTIM`: `1` or `0` | - | on |
//! | check shapes across ranks before `gather`, `reduce`, `broadcast` | - | `ACCELERATE_RS_DEBUG`: `1` or `0` | - | off |
//! | simulated device-memory limit (tests of [`find_executable_batch_size`](Accelerator::find_executable_batch_size) on the CPU) | - | [`ACCELERATE_RS_TEST_MEMORY_LIMIT`](env::TEST_MEMORY_LIMIT): bytes, e.g. `512MiB` | - | none |

//! | GPU memory pool release threshold ([`gpu`]) | - | `ACCELERATE_RS_CUDA_POOL_RELEASE_MB` | - | unset: freed GPU memory stays in the pool |
//! | `nn`'s CUDA kernels (build feature `cuda`) | [`nn::set_cuda_kernels`] | `ACCELERATE_RS_NN_CUDA`: `1` or `0` | - | on when built with `cuda` |
//! | `nn::flash_attention`'s CUDA kernel (slower than the composed attention at training sizes) | - | [`ACCELERATE_RS_NN_CUDA_FLASH`](env::NN_CUDA_FLASH): `1` or `0` | - | off |
//! | trial CUDA kernels (checked on an emulation of CUDA, not yet on a GPU: the embedding's gradient, the gradients' finiteness check) | - | [`ACCELERATE_RS_CUDA_TRIAL`](env::CUDA_TRIAL): `1` or `0` | - | off |
//!
//! The launcher families are not mixed: the first of torchrun, SLURM, Open MPI whose rank
//! variable is set provides rank, world size and local rank. Inconsistent values (a rank not below
//! the world size, a world size without a rank, a missing `MASTER_ADDR`, a number that does not
//! parse) are errors naming the variable and its value. Every variable is parsed strictly: a
//! flag takes `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`, and anything else (say
//! `ACCELERATE_RS_OVERLAP=yes-please`) is an error naming the variable and the value, never a
//! silent "on". An empty value counts as unset.
//!
//! ## What is public
//!
//! Each type has one path. At the root: [`Accelerator`] and [`AcceleratorBuilder`] (with DP,
//! user collectives such as `gather`/`reduce`/`broadcast`, and `save_state`/`load_state` as its
//! methods), the optimizer wrappers [`AcceleratedOptimizer`] and [`MixedPrecisionOptimizer`]
//! (with [`LossScaler`] and the [`TrainOptimizer`] trait they share with every Candle optimizer),
//! [`Parameters`], the data types ([`DataLoader`], [`Dataset`], [`TensorDataset`],
//! [`DistributedSampler`], [`Batch`], [`BatchIter`], [`EvenBatches`]), the settings
//! ([`ProcessState`], [`DistributedType`], [`MixedPrecision`], [`Transport`], [`ConfigFile`]),
//! [`ReduceOp`], [`seeded_var_builder`] (reproducible initial weights, also
//! [`Accelerator::var_builder`]), [`BatchSizeSearch`] (the options of
//! [`find_executable_batch_size`](Accelerator::find_executable_batch_size), which retries a
//! training closure with smaller batches when a rank runs out of memory, every rank agreeing),
//! and the typed [`Error`] (with [`ReplicaFailure`]). The modules:
//!
//! - [`checkpoint`]: the checkpoint format ([`checkpoint::CheckpointParts`],
//!   [`optim::StatefulOptimizer`], [`checkpoint::latest_checkpoint`], the manifest); saved
//!   and loaded with [`Accelerator::save_state`] / [`Accelerator::load_state`]. Also model
//!   weights alone: [`checkpoint::load_weights`] reads a single or sharded safetensors
//!   checkpoint (Hugging Face's layout) into any `VarMap`, all or nothing;
//!   [`checkpoint::write_model_folder`] writes one. LoRA adapters as PEFT adapter folders:
//!   [`checkpoint::save_adapter`], [`checkpoint::load_adapter`],
//!   [`checkpoint::read_adapter_config`].
//! - [`collective`]: the [`Collective`](collective::Collective) trait and its backends (single
//!   process, TCP ring with a same-host shared-memory data path, in-process threads, NCCL).
//! - [`optim`]: [`optim::AdamW`] and [`optim::Sgd`] (momentum, Nesterov, weight decay) with
//!   their state exposed for checkpoints ([`optim::OptimizerState`]), updating parameters with
//!   fused in-place kernels on the CPU and on CUDA.
//! - [`scheduler`]: learning-rate schedules ([`scheduler::LrScheduler`], warmup + cosine or
//!   linear decay) and the [`scheduler::Schedule`] driver, stepped once per optimizer step.
//! - [`tracking`]: metric trackers (JSON Lines, TensorBoard) written by the main process only,
//!   the run's hyperparameters ([`HParams`](tracking::HParams)), a per-step time breakdown
//!   ([`StepTimer`](tracking::StepTimer), from [`Accelerator::step_timer`]), and a main-process
//!   [`Progress`](tracking::Progress) bar; [`logging`]: `env_logger` set-up
//!   with a `[rank N]` prefix on each line.
//! - [`env`](mod@env): the name of every environment variable, and the launcher's environment
//!   contract ([`env::CommonEnv`]); [`config`]: the settings' defaults; [`gpu`]: GPU discovery.
//! - [`allocator`]: glibc allocator tuning for training loops (applied by [`Accelerator`]).
//! - [`memory`]: memory planning, what `accelerate-rs estimate-memory` prints: per rank, the
//!   parameters, gradients, optimizer state, f32 masters and activations of a model read from
//!   its `config.json` and safetensors headers, for a precision, ZeRO stage, LoRA rank and batch.
//! - [`nn`]: differentiable fused layers with `candle_nn`'s signatures (LayerNorm, RMSNorm,
//!   softmax, cross-entropy, GELU, ReLU, SiLU, Linear, RoPE: `rope`, `rope_i`, `rope_thd`) and
//!   fusions Candle has no counterpart for: [`nn::swiglu`],
//!   [`nn::scaled_dot_product_attention`] / [`nn::packed_self_attention`] (the whole attention
//!   as one op), [`nn::causal_softmax`] and [`nn::linear_cross_entropy`] (a language model's
//!   head and loss). Activation recomputation ([`nn::recompute`]), dropout that checkpointing
//!   replays ([`nn::dropout`]), and LoRA adapters on `nn::Linear` layers ([`nn::LoraLinear`],
//!   [`nn::LoraConfig`]: PEFT's settings) whose frozen base stays out of the optimizer and the
//!   gradient all-reduce ([`Accelerator::gradient_bytes_reduced`] counts what is sent).
//!
//! The `accelerate-rs` command line and its launcher are the separate `accelerate-rs-cli` crate
//! (`cli/` in the repository), so that this library pulls in no clap, nix or signal-hook.
//!
//! ## Design: floors
//!
//! A module imports only its own floor or the floors below: settings (`src/settings/`, every
//! setting resolved once), then the machinery (`collective/`, `data/`, `optim/`, `nn/`,
//! `train/` with the gradient engine, `weights/` for Hugging Face model folders, `checkpoint/`
//! for the training state), then the facade (`src/accelerator/`: [`Accelerator`], its builder,
//! DP replicas, the user collectives and the checkpoint methods), then this front door.
//! `python3 scripts/layers.py` measures the floors from the imports: 8 today (0 `error`,
//! `cuda_ptx`, `readback`; ...; 3 `train`; 4 `weights`; 5 `checkpoint`; 6 `accelerator`; 7 this
//! file), with no circle between modules or between files.
//!
//! How a gradient travels from `loss` to the parameters (through [`Accelerator::backward`] or an
//! optimizer wrapper's `backward_step`, the gradient engine, the reducer and the optimizer
//! wrapper) is told once, in the section "The path of one gradient" of `ARCHITECTURE.md` at the
//! root of the repository.
#![deny(missing_docs)]
#![deny(rustdoc::broken_intra_doc_links)]

mod accelerator;
pub mod allocator;
pub mod checkpoint;
pub mod collective;
#[cfg(feature = "cuda")]
mod cuda_ptx;
mod data;
mod error;
pub mod files;
mod inplace;
pub mod logging;
pub mod memory;
pub mod nn;
pub mod optim;
mod par;
pub mod quant;
mod readback;
mod settings;
pub mod tracking;
mod train;
pub mod weights;

pub use settings::{gpu, limits};

/// Names of the environment variables accelerate-rs reads and the launcher sets (every one of
/// them, in this one place), and the launcher's environment contract ([`EnvSpec`](env::EnvSpec),
/// [`CommonEnv`](env::CommonEnv)) that [`ProcessState`] reads back.
///
/// The torchrun names are read first, then SLURM's, then Open MPI's; see the precedence table
/// above.
pub mod env {
    pub use crate::settings::env::*;
    pub use crate::settings::worker_env::{CommonEnv, EnvSpec};
}
pub use train::scheduler;

/// Defaults of the settings, and what this build and machine offer (for the command line and
/// for config files written by programs).
pub mod config {
    pub use crate::settings::config::{
        cuda_built, default_num_processes, gpus_seen, DEFAULT_COLLECTIVE_TIMEOUT_SECS,
        DEFAULT_MAIN_PROCESS_PORT,
    };
    pub use crate::settings::defaults::{
        DEFAULT_BUCKET_CAP_MB, DEFAULT_MASTER_PORT, DEFAULT_TIMEOUT,
    };
}

pub use accelerator::{Accelerator, AcceleratorBuilder};
pub use collective::reduce::ReduceOp;
pub use data::{
    Batch, BatchIter, DataLoader, Dataset, DistributedSampler, EvenBatches, IterableDataset,
    LengthGroupedSampler, RecordStream, SamplePosition, Sampler, StreamIter, StreamingLoader,
    TensorDataset, TextLine, TextLines, WeightedSampler,
};
pub use error::{Error, ReplicaCause, ReplicaFailure, Result};
pub use readback::host_reads;
pub use settings::{
    ConfigFile, DistributedType, MissingGradients, MixedPrecision, NonFinite, ProcessState,
    Transport,
};
pub use train::batch_size::BatchSizeSearch;
pub use train::init::seeded_var_builder;
pub use train::loss_scaler::LossScaler;
pub use train::mixed_precision::MixedPrecisionOptimizer;
pub use train::optimizer::{AcceleratedOptimizer, TrainOptimizer};
pub use train::params::Parameters;
pub use train::shapes::{check_allocatable, shape_only_var_builder, spec_bytes, ParamShapes};
pub use train::token_weights::TokenLoss;
pub use train::zero3::{ShardSource, ShardedModel, WrapPolicy};
