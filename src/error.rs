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
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Env {
        /// The variable's name.
        var: String,
        /// The value found.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },

    /// The config file cannot be read or holds a bad key or value.
    #[error("config file {}: {}{reason}", path.display(), key.as_deref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
    Config {
        /// The file.
        path: PathBuf,
        /// The offending key, when one is to blame.
        key: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// A builder call, flag or function argument is invalid.
    #[error("invalid {name}: {reason}")]
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
    #[error("data: {reason}")]
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

    /// A launcher worker failed.
    #[error("launch: rank {rank} (pid {pid}) failed: {status}")]
    WorkerFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// Exit code to propagate (the worker's code, or 128 + signal).
        code: i32,
        /// Human readable exit status.
        status: String,
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
    #[error("checkpoint file {} is corrupt: {reason}", path.display())]
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

    /// Another run holds the checkpoint directory (two runs saving into one folder would
    /// overwrite and rotate away each other's checkpoints).
    #[error("checkpoint directory {} is in use by another run ({holder}); give this run its own directory", path.display())]
    CheckpointLocked {
        /// The directory.
        path: std::path::PathBuf,
        /// Who holds it: pid, host and start time, as the holder wrote them.
        holder: String,
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

    /// An error from Candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// The launcher received SIGINT or SIGTERM and stopped its workers.
    #[error("launch: interrupted by {signal}; stopped {stopped} worker(s)")]
    Interrupted {
        /// The signal received (`SIGINT` or `SIGTERM`).
        signal: String,
        /// Exit code to propagate: 128 + the signal number (130 for SIGINT).
        code: i32,
        /// How many workers were still running and had to be stopped.
        stopped: usize,
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
/// `forward` or a user's closure): the message is kept, wrapped as a Candle error.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
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
