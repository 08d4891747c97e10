//! Names of the environment variables accelerate-rs reads and the launcher sets (every one of
//! them, in this one place).
//!
//! The torchrun names are read first, then SLURM's, then Open MPI's; see the precedence table in the
//! crate documentation.

/// Global rank of this process (torchrun).
pub const RANK: &str = "RANK";
/// Number of processes in the whole run (torchrun).
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of this process on its machine (torchrun).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on this machine (torchrun).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Address of the machine hosting rank 0 and the rendezvous store (torchrun).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of the rendezvous store (torchrun).
pub const MASTER_PORT: &str = "MASTER_PORT";

/// This machine's index among the machines of the run (torchrun's name; set by the launcher).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// This machine's index among the machines of the run (accelerate-rs's name).
pub const NODE_RANK: &str = "ACCELERATE_RS_NODE_RANK";
/// Number of machines of the run.
pub const NUM_NODES: &str = "ACCELERATE_RS_NUM_MACHINES";

/// SLURM: global rank.
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// SLURM: number of tasks (world size).
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// SLURM: rank on the node.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// SLURM: number of tasks on this node.
pub const SLURM_NTASKS_PER_NODE: &str = "SLURM_NTASKS_PER_NODE";

/// Open MPI: global rank.
pub const OMPI_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// Open MPI: world size.
pub const OMPI_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// Open MPI: rank on the node.
pub const OMPI_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// Open MPI: processes on the node.
pub const OMPI_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";

/// Per-run secret carried in every connection handshake (set by `accelerate-rs launch`).
pub const SECRET: &str = "ACCELERATE_RS_SECRET";
/// Force CPU even when GPUs are present (`1`/`true`/`yes`, `0`/`false`/`no`).
pub const USE_CPU: &str = "ACCELERATE_RS_USE_CPU";
/// Timeout of every collective, in seconds (float allowed).
pub const TIMEOUT_SECS: &str = "ACCELERATE_RS_TIMEOUT_SECS";
/// Gradient bucket cap in MiB.
pub const BUCKET_CAP_MB: &str = "ACCELERATE_RS_BUCKET_CAP_MB";
/// Whether optimizers use their fused in-place kernels (`0` turns them off for optimizers created
/// afterwards; default on). See [`crate::optim`].
pub const FUSED_OPTIM: &str = "ACCELERATE_RS_FUSED_OPTIM";
/// The release threshold, in MiB, of each GPU's memory pool (freed memory above it goes back to
/// the system at synchronizations); unset keeps all of it in the pool, as PyTorch's caching
/// allocator does. See [`crate::gpu`].
pub const CUDA_POOL_RELEASE_MB: &str = "ACCELERATE_RS_CUDA_POOL_RELEASE_MB";
/// Whether `accelerate_rs::nn`'s CUDA kernels are used in a build with the `cuda` feature
/// (`0` turns them off; default on). See [`crate::nn`].
pub const NN_CUDA: &str = "ACCELERATE_RS_NN_CUDA";
/// Whether `accelerate_rs::nn::flash_attention` runs its CUDA kernel on a GPU (`1` turns it on;
/// default off: correct, but slower than Candle's composed attention at training sizes, see
/// BENCHMARKS.md). Only with [`NN_CUDA`] on. See [`crate::nn`].
pub const NN_CUDA_FLASH: &str = "ACCELERATE_RS_NN_CUDA_FLASH";
/// Whether the trial CUDA kernels run on a GPU (`1` turns them on; default off): kernels checked
/// on the CPU's emulation of CUDA but not yet on a GPU, each on by default once
/// `scripts/gpu-smoke.sh` has proven it. Now: the embedding lookup's gradient (`nn::embedding`,
/// only with [`NN_CUDA`] on) and the gradients' finiteness check before an optimizer step.
pub const CUDA_TRIAL: &str = "ACCELERATE_RS_CUDA_TRIAL";
/// Whether CPU gradient buckets are all-reduced on a communication thread while the next bucket
/// is flattened (`0` turns it off; default on). Read when an accelerator is built.
pub const OVERLAP: &str = "ACCELERATE_RS_OVERLAP";
/// Whether to tune glibc's allocator for training (`1`/`0`; default on), see
/// [`crate::allocator`].
pub const TUNE_MALLOC: &str = "ACCELERATE_RS_TUNE_MALLOC";
/// Mixed precision mode: `no`, `bf16` or `fp16`.
pub const MIXED_PRECISION: &str = "ACCELERATE_RS_MIXED_PRECISION";
/// Gradient accumulation steps.
pub const GRADIENT_ACCUMULATION_STEPS: &str = "ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS";
/// DP: number of model replicas this one process drives, one thread each (`1` = no DP).
pub const DATA_PARALLEL: &str = "ACCELERATE_RS_DATA_PARALLEL";
/// Path of the config file (overrides the platform default location).
pub const CONFIG_FILE: &str = "ACCELERATE_RS_CONFIG_FILE";
/// Debug mode (a flag, default off): `gather`, `reduce` and `broadcast` first check that every
/// rank passes a tensor of the same shape and dtype, listing every rank's shape when not. Read
/// when an accelerator is built.
pub const DEBUG: &str = "ACCELERATE_RS_DEBUG";
/// Data path of multi-process CPU `all_reduce` and `broadcast`: `auto` (default: shared memory
/// when every rank is on the same host, else TCP), `tcp`, or `shm` (an error on several hosts).
pub const TRANSPORT: &str = "ACCELERATE_RS_TRANSPORT";
/// What the first optimizer step does when registered parameters received no gradient: `warn`
/// (default), `error` or `off` (see [`MissingGradients`](crate::MissingGradients)).
pub const MISSING_GRADIENTS: &str = "ACCELERATE_RS_MISSING_GRADIENTS";
/// What an optimizer step does when the gradients turn non-finite: `error` (default), `warn`,
/// `skip-step` or `off` (see [`NonFinite`](crate::NonFinite)).
pub const NONFINITE: &str = "ACCELERATE_RS_NONFINITE";
/// ZeRO-style sharding stage: `0` (default, every rank holds everything), `1` (optimizer state
/// sharded), `2` (gradients too) or `3` (parameters too).
pub const ZERO_STAGE: &str = "ACCELERATE_RS_ZERO_STAGE";
/// ZeRO stage 3: keep the optimizer state, f32 masters and f32 gradients of each rank's shards
/// in host memory and step them there (`1`/`0`; default off).
pub const OFFLOAD_OPTIMIZER: &str = "ACCELERATE_RS_OFFLOAD_OPTIMIZER";
/// Whether the data loaders' batch size is the global one, split across the ranks (`1`/`0`;
/// default off: the batch size is per rank).
pub const SPLIT_BATCHES: &str = "ACCELERATE_RS_SPLIT_BATCHES";
/// How many processes a program started on its own runs as: with `N > 1`, building the
/// accelerator starts `N` workers of the program (same arguments, each with the launcher's
/// variables) and supervises them instead of training itself. Ignored in a process a launcher
/// started (`RANK` set). Default 1.
pub const NUM_PROCESSES: &str = "ACCELERATE_RS_NUM_PROCESSES";
/// How many times the launcher restarted the worker group (0 on the first run).
pub const RESTART_COUNT: &str = "ACCELERATE_RS_RESTART_COUNT";
/// Set by `accelerate-rs launch` for rank 0 only: the number of an inherited file descriptor
/// holding the rendezvous store's listening socket, already bound to `MASTER_PORT` by the
/// launcher (so that no other run can take the port between its check and rank 0's bind).
pub const STORE_FD: &str = "ACCELERATE_RS_STORE_FD";

/// Fault injection for tests: the main process exits (code 3) right after writing the named
/// checkpoint file, as if killed mid-save. Not for production use.
pub const TEST_CRASH_AFTER: &str = "ACCELERATE_RS_TEST_CRASH_AFTER";

/// Fault injection for tests: a simulated device-memory limit, in bytes (`1048576`, or with a
/// binary suffix: `64KiB`, `512MiB`, `2GiB`). When set, [`nn::backward`](crate::nn::backward)
/// (the backward pass of the accelerator and of the optimizer wrappers) fails with
/// [`Error::OutOfMemory`](crate::Error::OutOfMemory) when the tensors held by the loss's graph
/// (the activations kept for the backward pass, views counted in full) exceed it, as an
/// allocation on a full GPU would: the memory grows with the batch, so
/// [`find_executable_batch_size`](crate::Accelerator::find_executable_batch_size) can be tested
/// on the CPU. Read once per process. Not for production use.
pub const TEST_MEMORY_LIMIT: &str = "ACCELERATE_RS_TEST_MEMORY_LIMIT";

/// GPUs visible to CUDA programs.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// Rayon's thread-count variable (Candle's CPU kernels honour it).
pub const RAYON_NUM_THREADS: &str = "RAYON_NUM_THREADS";
/// OpenMP's thread-count variable.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";

/// ` (CUDA_VISIBLE_DEVICES=...)` when the variable is set, for error messages about GPUs.
pub(crate) fn cuda_visible_devices_note() -> String {
    std::env::var(CUDA_VISIBLE_DEVICES)
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
        .unwrap_or_default()
}
