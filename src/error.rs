//! The crate's typed error. Every variant names what went wrong: the rank, the peer, the operation,
//! the file, the key or the parameter, so that a failure in a distributed run can be traced from the
//! one line a user sees.

use std::path::PathBuf;
use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in accelerate-rs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An environment variable holds a value that cannot be used.
    #[error(
        "environment variable {var}={:?} is invalid: {}",
        excerpt(value, EXCERPT_NAME_BYTES),
        excerpt(reason, EXCERPT_REASON_BYTES)
    )]
    Env {
        /// The variable's name.
        var: String,
        /// The value found.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },

    /// The config file cannot be read or holds a bad key or value.
    #[error("config file {}: {}{}", path.display(), key.as_deref().map(|k| format!("key `{}`: ", excerpt(k, EXCERPT_NAME_BYTES))).unwrap_or_default(), excerpt(reason, EXCERPT_REASON_BYTES))]
    Config {
        /// The file.
        path: PathBuf,
        /// The offending key, when one is to blame.
        key: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// A builder call, flag or function argument is invalid.
    #[error("invalid {name}: {}", excerpt(reason, EXCERPT_REASON_BYTES))]
    InvalidArgument {
        /// The argument's name.
        name: String,
        /// Why it is invalid.
        reason: String,
    },

    /// Setting up the rendezvous store or the peer connections failed.
    #[error("rank {rank}: rendezvous at {addr} failed: {reason}")]
    Rendezvous {
        /// This process's rank.
        rank: usize,
        /// The address involved (store or peer).
        addr: String,
        /// What happened.
        reason: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },

    /// A collective failed because a peer went away or sent something invalid.
    #[error("rank {rank}: {op} failed talking to rank {peer}: {reason}")]
    Peer {
        /// This process's rank.
        rank: usize,
        /// The rank on the other end.
        peer: usize,
        /// The collective operation (`all_reduce`, `broadcast`, ...).
        op: String,
        /// What happened.
        reason: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },

    /// A collective did not complete within the configured timeout.
    #[error("rank {rank}: {op} timed out after {timeout:?} waiting for rank {peer}")]
    Timeout {
        /// This process's rank.
        rank: usize,
        /// The rank that did not answer.
        peer: usize,
        /// The collective operation.
        op: String,
        /// The timeout in force.
        timeout: Duration,
    },

    /// An NCCL communicator failed or stalled: its creation did not complete in time, NCCL
    /// reported an asynchronous error (a network or peer failure), an operation did not finish
    /// within the collective timeout, or a tensor was on another GPU than the communicator's.
    #[error("rank {rank}: {op} over NCCL: {reason}")]
    Nccl {
        /// This process's rank.
        rank: usize,
        /// The operation (`nccl init`, `all_reduce`, `nccl finalize`, ...).
        op: String,
        /// What happened, and what to look at.
        reason: String,
    },

    /// Ranks called different collectives, or the same one with different sizes or dtypes.
    #[error("rank {rank}: {op}: ranks disagree: {detail}")]
    Mismatch {
        /// This process's rank.
        rank: usize,
        /// The collective operation.
        op: String,
        /// What differs, naming the ranks.
        detail: String,
    },

    /// A model parameter differs between ranks (name, shape or dtype).
    #[error("rank {rank}: parameter `{param}` differs between ranks: rank {rank_a} has {a}, rank {rank_b} has {b}")]
    ParamMismatch {
        /// This process's rank.
        rank: usize,
        /// The first mismatching parameter, in name order.
        param: String,
        /// The reference rank (0).
        rank_a: usize,
        /// What the reference rank holds.
        a: String,
        /// The first rank that differs.
        rank_b: usize,
        /// What that rank holds.
        b: String,
    },

    /// The communicator failed earlier and can no longer be used.
    #[error("rank {rank}: {op}: the communicator is unusable after an earlier failure: {first}")]
    Broken {
        /// This process's rank.
        rank: usize,
        /// The operation that was attempted.
        op: String,
        /// The first failure.
        first: String,
    },

    /// An operation was asked of a dtype it does not support.
    #[error("{op}: unsupported dtype {dtype}")]
    UnsupportedDType {
        /// The operation.
        op: String,
        /// The dtype given.
        dtype: String,
    },

    /// The dataset or data loader was misused or produced bad data.
    #[error("data: {}", excerpt(reason, EXCERPT_REASON_BYTES))]
    Data {
        /// What is wrong.
        reason: String,
    },

    /// A file could not be read or written.
    #[error("{context} {}", path.display())]
    Io {
        /// What was being done.
        context: String,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A launcher worker could not be started.
    #[error("launch: could not start rank {rank} (`{program}`)")]
    Spawn {
        /// The worker's rank.
        rank: usize,
        /// The program.
        program: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// Asked for something this build does not have (e.g. CUDA).
    #[error("{what} is not available: {reason}")]
    NotAvailable {
        /// The feature.
        what: String,
        /// Why, and how to get it.
        reason: String,
    },

    /// Registered trainable parameters received no gradient on any rank at the first optimizer
    /// step, with the `missing_gradients` setting at `error`
    /// ([`MissingGradients`](crate::MissingGradients)).
    #[error("rank {rank}: {report}")]
    MissingGradients {
        /// This process's rank.
        rank: usize,
        /// The parameters without a gradient, by name.
        params: Vec<String>,
        /// The report: how many, grouped by prefix, and the likely cause.
        report: String,
    },

    /// A checkpoint file does not match what its manifest recorded when it was written (flipped
    /// bytes, a file replaced or truncated, an edited manifest).
    #[error("checkpoint file {} is corrupt: {}", path.display(), excerpt(reason, EXCERPT_REASON_BYTES))]
    CheckpointCorrupt {
        /// The damaged file.
        path: std::path::PathBuf,
        /// What does not match.
        reason: String,
    },

    /// Writing a checkpoint (or a model file) failed: the file system refused, or the main
    /// process that writes failed (then the other ranks get this error naming the path).
    #[error("could not write checkpoint {}: {reason}", path.display())]
    CheckpointWrite {
        /// The file or directory being written.
        path: std::path::PathBuf,
        /// What failed.
        reason: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },

    /// A model's files (its safetensors weights, a sharded checkpoint's index, its
    /// `config.json`) cannot be read or written, or do not fit the model: the file and, when one
    /// is to blame, the tensor.
    #[error("model file {}: {}{}", path.display(), tensor.as_deref().map(|t| format!("tensor `{}`: ", excerpt(t, EXCERPT_NAME_BYTES))).unwrap_or_default(), excerpt(reason, EXCERPT_REASON_BYTES))]
    ModelFile {
        /// The file (or folder).
        path: std::path::PathBuf,
        /// The tensor, when one is to blame.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },

    /// A file handed to the run (a training text, a tokenizer, a JSON file of a model folder)
    /// cannot be read as one: it is not a regular file (a folder, a FIFO, a device, a link that
    /// leads nowhere), it is over the size its reader accepts, or it is not the text or JSON
    /// expected (see [`files`](crate::files)).
    #[error("file {}: {}", path.display(), excerpt(reason, EXCERPT_REASON_BYTES))]
    InputFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
        /// The underlying I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },

    /// The averaged gradients of an optimizer step hold a NaN or an infinity, with the
    /// `nonfinite` setting at `error` (the default, see [`NonFinite`](crate::NonFinite)).
    #[error("rank {rank}: optimizer step {step}: the gradient of `{param}` holds {detail}; the loss or the gradients turned non-finite (a learning rate too high, a bad batch, an epsilon of 0 or below in the model's configuration?). Nothing was stepped; set `nonfinite` to `skip-step` (ACCELERATE_RS_NONFINITE=skip-step) to skip such steps instead")]
    NonFinite {
        /// This process's rank.
        rank: usize,
        /// The optimizer step (1 for the first) whose gradients were checked.
        step: u64,
        /// The first parameter (in name order) whose gradient is not finite.
        param: String,
        /// What its gradient holds (`3 NaN and 0 infinite values of 4096`).
        detail: String,
    },

    /// An output folder cannot receive what a run would save there (checked before the run
    /// trains, see [`check_output_dir`](crate::checkpoint::check_output_dir)).
    #[error("output folder {}: {}", path.display(), excerpt(reason, EXCERPT_REASON_BYTES))]
    OutputFolder {
        /// The folder.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A 4-bit quantized weight ([`quant`](crate::quant)) cannot be read from the tensors
    /// given: the tensor to blame (missing, of the wrong dtype or size, a malformed quant state)
    /// and what is wrong.
    #[error(
        "4-bit weight: tensor `{}`: {}",
        excerpt(tensor, EXCERPT_NAME_BYTES),
        excerpt(reason, EXCERPT_REASON_BYTES)
    )]
    Quantized {
        /// The tensor's full name (`model.layers.0.mlp.up_proj.weight.absmax`).
        tensor: String,
        /// What is wrong.
        reason: String,
    },

    /// Another run holds the checkpoint directory (two runs saving into one folder would
    /// overwrite and rotate away each other's checkpoints).
    #[error("checkpoint directory {} is in use by another run ({holder}); give this run its own directory", path.display())]
    CheckpointLocked {
        /// The directory.
        path: std::path::PathBuf,
        /// Who holds it: pid, host and start time, as the holder wrote them.
        holder: String,
    },

    /// Resuming found checkpoints under a folder, but none of them is sound: rather than start
    /// over from step 0 (losing the run), this error lists each one and why it was refused.
    /// To start fresh on purpose, move them out of the folder (or catch this variant).
    #[error("no sound checkpoint to resume from in {}: {}; refusing to start over from step 0 (to start fresh on purpose, move these checkpoints out of the folder)", root.display(), refused.iter().map(|(p, why)| format!("{} ({why})", p.display())).collect::<Vec<_>>().join("; "))]
    NoSoundCheckpoint {
        /// The folder searched.
        root: std::path::PathBuf,
        /// Each complete checkpoint found, newest first, and why it was refused.
        refused: Vec<(std::path::PathBuf, String)>,
    },

    /// Something accelerate-rs itself should never get wrong failed (a serialization of its own
    /// data, a broken invariant): an internal failure, not a usage error. Please report it.
    #[error("internal error while {what}: {reason}")]
    Internal {
        /// What accelerate-rs was doing.
        what: String,
        /// What failed.
        reason: String,
    },

    /// A thread of accelerate-rs itself panicked (e.g. the communication thread that reduces
    /// gradient buckets): an internal failure, not a usage error.
    #[error("rank {rank}: {thread} panicked: {message}")]
    ThreadPanicked {
        /// This process's rank.
        rank: usize,
        /// Which thread.
        thread: String,
        /// The panic message.
        message: String,
    },

    /// A DP replica failed ([`AcceleratorBuilder::run`](crate::AcceleratorBuilder::run)): which
    /// one, and its error or panic. Match it directly; no downcasting needed.
    #[error(transparent)]
    Replica(Box<ReplicaFailure>),

    /// A DP replica's thread ended without an error and without a result (an internal failure).
    #[error("DP replica {replica} of {replicas} returned no result")]
    ReplicaMissing {
        /// The replica's index.
        replica: usize,
        /// How many replicas the run had.
        replicas: usize,
    },

    /// An error from Candle (other than running out of device memory, which converts to
    /// [`Error::OutOfMemory`]).
    #[error(transparent)]
    Candle(candle_core::Error),

    /// A device ran out of memory: an allocation of Candle's CUDA backend failed
    /// (`CUDA_ERROR_OUT_OF_MEMORY`, or cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`), or the simulated
    /// limit of tests ([`env::TEST_MEMORY_LIMIT`](crate::env::TEST_MEMORY_LIMIT)) was exceeded.
    /// [`Accelerator::find_executable_batch_size`](crate::Accelerator::find_executable_batch_size)
    /// retries with a smaller batch on it. (On the CPU, a failed allocation aborts the process
    /// before anything can be returned.)
    #[error("{}out of memory on {device}{}{}: {detail}",
        rank.map(|r| format!("rank {r}: ")).unwrap_or_default(),
        requested.map(|b| format!(" (asked for {})", human_bytes(b))).unwrap_or_default(),
        limit.map(|b| format!(", limit {}", human_bytes(b))).unwrap_or_default())]
    OutOfMemory {
        /// The rank that ran out, when known (an error converted from Candle's does not know
        /// it; `find_executable_batch_size` fills it in).
        rank: Option<usize>,
        /// The device: `cuda:0`, `cpu`, or `cuda` when Candle's error does not say which.
        device: String,
        /// Bytes the failed allocation asked for, when known.
        requested: Option<u64>,
        /// The memory limit in force, when known (the simulated limit of tests).
        limit: Option<u64>,
        /// What failed: Candle's message, or what the simulated limit counted.
        detail: String,
    },

    /// Another rank ran out of memory while
    /// [`find_executable_batch_size`](crate::Accelerator::find_executable_batch_size) was
    /// probing: every rank learned it from the same agreement collective, and the search
    /// retries with the next smaller size. A training closure sees it from a collective (say
    /// `backward_step`) and should return it (`?`).
    #[error("rank {rank}: rank {peer} ran out of memory at batch size {batch_size}; every rank retries with batch size {next_batch_size}")]
    PeerOutOfMemory {
        /// This process's rank.
        rank: usize,
        /// The rank that ran out of memory (the lowest, if several did).
        peer: usize,
        /// The batch size of the abandoned attempt.
        batch_size: usize,
        /// The batch size every rank tries next.
        next_batch_size: usize,
    },

    /// Another rank failed with an error other than running out of memory while
    /// [`find_executable_batch_size`](crate::Accelerator::find_executable_batch_size) was
    /// probing; every rank stops instead of waiting for it. That rank's own error is in its
    /// output.
    #[error("rank {rank}: rank {peer} failed at batch size {batch_size} while the batch size was being probed (its own output has the error); every rank stops")]
    PeerFailed {
        /// This process's rank.
        rank: usize,
        /// The rank that failed (the lowest, if several did).
        peer: usize,
        /// The batch size of the attempt.
        batch_size: usize,
    },

    /// [`find_executable_batch_size`](crate::Accelerator::find_executable_batch_size) ran out of
    /// memory at every batch size down to the smallest allowed.
    #[error("rank {rank}: no executable batch size: out of memory at every batch size tried ({}), the last time on rank {oom_rank}; the smallest allowed is {min_batch_size}", tried.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(", "))]
    NoExecutableBatchSize {
        /// This process's rank.
        rank: usize,
        /// The batch sizes tried, in order.
        tried: Vec<usize>,
        /// The rank that ran out of memory at the last size tried.
        oom_rank: usize,
        /// The smallest batch size the search was allowed to try.
        min_batch_size: usize,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Data`].
    pub fn data(reason: impl Into<String>) -> Self {
        Error::Data {
            reason: reason.into(),
        }
    }
}

/// Lets `?` carry our errors through functions that return Candle's `Result` (e.g. a model's
/// `forward` or a user's closure): the message is kept, wrapped as a Candle error. An
/// [`Error::OutOfMemory`] stays typed: converted back (`?` into our `Result`) it is again an
/// `Error::OutOfMemory`, so `find_executable_batch_size` sees it through a model's `forward`.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            oom @ Error::OutOfMemory { .. } => candle_core::Error::WrappedContext {
                context: oom.to_string(),
                wrapped: Box::new(oom),
            },
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Candle's errors, with running out of device memory recognized as [`Error::OutOfMemory`]:
/// CUDA's `CUDA_ERROR_OUT_OF_MEMORY` and cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED` (typed on
/// `cuda` builds, by their names in the message otherwise), and our own out-of-memory errors
/// carried through Candle's `Result`.
impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        if let Some(oom) = carried_out_of_memory(&e) {
            return oom;
        }
        if let Some(what) = cuda_out_of_memory(&e) {
            return Error::OutOfMemory {
                rank: None,
                device: "cuda".into(),
                requested: None,
                limit: None,
                detail: what,
            };
        }
        Error::Candle(e)
    }
}

/// The error inside Candle's wrappers (backtrace, context, path).
fn innermost(mut e: &candle_core::Error) -> &candle_core::Error {
    loop {
        e = match e {
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => inner,
            _ => return e,
        };
    }
}

/// Our [`Error::OutOfMemory`] carried through Candle's `Result` (see `From<Error>`), rebuilt.
fn carried_out_of_memory(e: &candle_core::Error) -> Option<Error> {
    let candle_core::Error::WrappedContext { wrapped, .. } = innermost(e) else {
        return None;
    };
    match wrapped.downcast_ref::<Error>() {
        Some(Error::OutOfMemory {
            rank,
            device,
            requested,
            limit,
            detail,
        }) => Some(Error::OutOfMemory {
            rank: *rank,
            device: device.clone(),
            requested: *requested,
            limit: *limit,
            detail: detail.clone(),
        }),
        _ => None,
    }
}

/// The names of CUDA's out-of-memory failures, as cudarc prints them.
const CUDA_OOM_NAMES: [&str; 2] = ["CUDA_ERROR_OUT_OF_MEMORY", "CUBLAS_STATUS_ALLOC_FAILED"];

/// Candle's message of a CUDA allocation failure, or `None` for any other error.
fn cuda_out_of_memory(e: &candle_core::Error) -> Option<String> {
    let inner = innermost(e);
    let candle_core::Error::Cuda(source) = inner else {
        return None;
    };
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::CudaError;
        use cudarc::driver::{sys::CUresult, DriverError};
        let driver_oom = |d: &DriverError| d.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY;
        match source.downcast_ref::<CudaError>() {
            Some(CudaError::Cuda(d)) | Some(CudaError::Load { cuda: d, .. }) if driver_oom(d) => {
                return Some(inner.to_string())
            }
            _ => {}
        }
    }
    // cuBLAS's and other wrapped failures (and every failure on builds without `cuda`, where
    // Candle's error can only come from elsewhere): by name.
    let text = source.to_string();
    CUDA_OOM_NAMES
        .iter()
        .any(|name| text.contains(name))
        .then_some(text)
}

/// The most bytes of a name (a key, a tensor, a field, a variable's value) an error message of
/// either crate shows ([`excerpt`]).
pub const EXCERPT_NAME_BYTES: usize = 256;
/// The most bytes of a reason an error message of either crate shows ([`excerpt`]).
pub const EXCERPT_REASON_BYTES: usize = 2048;

/// `text` as an error message shows it: whole when it has at most `limit` bytes, else its
/// first three quarters of `limit` and its last quarter (cut at characters) around the count of
/// bytes left out. A value a file quotes (a 1 MiB string where a number belongs, a role as long
/// as a line) then cannot bury the terminal or a log under one line, and what the message says
/// after the value (what was expected) is kept; the error's fields keep the whole text.
pub fn excerpt(text: &str, limit: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= limit {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut head = limit * 3 / 4;
    while !text.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = text.len() - limit / 4;
    while !text.is_char_boundary(tail) {
        tail += 1;
    }
    std::borrow::Cow::Owned(format!(
        "{} … [{} bytes left out] … {}",
        &text[..head],
        tail - head,
        &text[tail..]
    ))
}

/// `1.5 GiB (1610612736 bytes)`.
pub(crate) fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} bytes")
    } else {
        format!("{v:.1} {} ({b} bytes)", UNITS[u])
    }
}

/// `cpu`, `cuda:0`, `metal:0`: a device as error messages name it.
pub(crate) fn device_label(d: &candle_core::Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

impl Error {
    /// Whether this is [`Error::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }

    /// An [`Error::OutOfMemory`] without a rank gets `rank`, and one on an unnamed CUDA device
    /// gets `device`'s name; any other error is returned as it is.
    pub(crate) fn on_rank(self, rank: usize, device: &candle_core::Device) -> Error {
        match self {
            Error::OutOfMemory {
                rank: r,
                device: d,
                requested,
                limit,
                detail,
            } => Error::OutOfMemory {
                rank: r.or(Some(rank)),
                device: if d == "cuda" && device.is_cuda() {
                    device_label(device)
                } else {
                    d
                },
                requested,
                limit,
                detail,
            },
            other => other,
        }
    }
}

/// A DP replica that failed, returned as [`Error::Replica`] by
/// [`run`](crate::AcceleratorBuilder::run).
#[derive(Debug)]
pub struct ReplicaFailure {
    /// The replica's index (its rank).
    pub replica: usize,
    /// How many replicas the run had.
    pub replicas: usize,
    /// What happened: the closure's error, or the panic message.
    pub cause: ReplicaCause,
}

/// Why a DP replica failed.
#[derive(Debug)]
pub enum ReplicaCause {
    /// The replica (or its setup) returned this error.
    Error(Error),
    /// The replica's thread panicked with this message.
    Panic(String),
}

impl std::fmt::Display for ReplicaFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (i, n) = (self.replica, self.replicas);
        match &self.cause {
            ReplicaCause::Error(e) => write!(f, "DP replica {i} of {n} failed: {e}"),
            ReplicaCause::Panic(m) => write!(f, "DP replica {i} of {n} panicked: {m}"),
        }
    }
}

impl std::error::Error for ReplicaFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.cause {
            ReplicaCause::Error(e) => Some(e),
            ReplicaCause::Panic(_) => None,
        }
    }
}

impl From<ReplicaFailure> for Error {
    fn from(f: ReplicaFailure) -> Self {
        Error::Replica(Box::new(f))
    }
}

/// The message of a panic payload (`&str` or `String`), for errors that report a panic.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic payload that is not a string)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for a cudarc error inside `candle_core::Error::Cuda`, printing as cudarc does.
    #[derive(Debug)]
    struct Printed(&'static str);
    impl std::fmt::Display for Printed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for Printed {}

    fn cuda(text: &'static str) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(Printed(text)))
    }

    /// A value quoted whole from a file is cut in the message, at a character, with the count
    /// of bytes left out; the field keeps it whole.
    #[test]
    fn long_values_are_cut_in_messages_and_kept_in_fields() {
        let huge = "é".repeat(1 << 19);
        let e = Error::Config {
            path: "c.toml".into(),
            key: Some(huge.clone()),
            reason: format!("expected a number, got {huge}; what the key is for"),
        };
        let msg = e.to_string();
        assert!(
            msg.len() < EXCERPT_NAME_BYTES + EXCERPT_REASON_BYTES + 200,
            "{} bytes",
            msg.len()
        );
        assert!(
            msg.starts_with("config file c.toml: key `éé"),
            "{}",
            &msg[..40]
        );
        assert!(msg.contains("expected a number, got éé"));
        let left_out = huge.len() - EXCERPT_NAME_BYTES;
        assert!(msg.contains(&format!("é … [{left_out} bytes left out] … éé")));
        assert!(
            msg.ends_with("éé; what the key is for"),
            "{}",
            &msg[msg.len() - 40..]
        );
        match e {
            Error::Config { key, .. } => assert_eq!(key.as_deref(), Some(huge.as_str())),
            other => panic!("{other}"),
        }
        assert_eq!(excerpt("short", 8), "short");
        assert_eq!(excerpt("abcdefghij", 8), "abcdef … [2 bytes left out] … ij");
        assert_eq!(excerpt("ééé", 3), "é … [4 bytes left out] … ");
        let e = Error::ModelFile {
            path: "m.safetensors".into(),
            tensor: Some("t".repeat(10_000)),
            reason: "missing".into(),
            source: None,
        };
        assert!(e.to_string().len() < 400, "{e}");
    }

    #[test]
    fn cuda_allocation_failures_become_out_of_memory_through_candles_wrappers() {
        for text in [
            r#"DriverError(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")"#,
            "CublasError(CUBLAS_STATUS_ALLOC_FAILED)",
        ] {
            for e in [
                cuda(text),
                cuda(text).context("in a matmul"),
                candle_core::Error::WithBacktrace {
                    inner: Box::new(cuda(text)),
                    backtrace: Box::new(std::backtrace::Backtrace::disabled()),
                },
            ] {
                match Error::from(e) {
                    Error::OutOfMemory {
                        rank: None,
                        device,
                        requested: None,
                        limit: None,
                        detail,
                    } => {
                        assert_eq!(device, "cuda");
                        assert_eq!(detail, text);
                    }
                    other => panic!("{text}: {other}"),
                }
            }
        }
        // Other CUDA failures stay Candle errors.
        let e = Error::from(cuda(
            r#"DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access")"#,
        ));
        assert!(matches!(e, Error::Candle(_)), "{e}");
        let e = Error::from(candle_core::Error::Msg("out of memory".into()));
        assert!(matches!(e, Error::Candle(_)), "{e}");
    }

    #[test]
    fn out_of_memory_stays_typed_through_candles_result() {
        let oom = Error::OutOfMemory {
            rank: None,
            device: "cpu".into(),
            requested: Some(3 << 30),
            limit: Some(1 << 30),
            detail: "simulated".into(),
        };
        let text = oom.to_string();
        assert_eq!(
            text,
            "out of memory on cpu (asked for 3.0 GiB (3221225472 bytes)), limit 1.0 GiB (1073741824 bytes): simulated"
        );
        // Through a model's `forward` (Candle's `Result`) and back, with Candle's context on top.
        let through = candle_core::Error::from(oom).context("block 3");
        assert!(through.to_string().contains(&text), "{through}");
        let back = Error::from(through).on_rank(2, &candle_core::Device::Cpu);
        assert_eq!(back.to_string(), format!("rank 2: {text}"));
        assert!(back.is_out_of_memory());
        // Other errors keep their message only (as before).
        let other = Error::from(candle_core::Error::from(Error::data("bad row")));
        assert!(matches!(other, Error::Candle(_)) && other.to_string().contains("bad row"));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn typed_driver_out_of_memory_is_recognized() {
        use candle_core::cuda_backend::CudaError;
        use cudarc::driver::{sys::CUresult, DriverError};
        let e = candle_core::Error::Cuda(Box::new(CudaError::Cuda(DriverError(
            CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        ))));
        assert!(Error::from(e).is_out_of_memory());
        let e = candle_core::Error::Cuda(Box::new(CudaError::Cuda(DriverError(
            CUresult::CUDA_ERROR_INVALID_VALUE,
        ))));
        assert!(!Error::from(e).is_out_of_memory());
    }
}
