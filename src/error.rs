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
