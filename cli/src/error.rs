//! The command line's error: the library's [`accelerate_rs::Error`], the models crate's, and the
//! two ways a launch
//! ends that only the launcher has (a worker failed, a signal stopped the run), each with the
//! exit code the launcher passes on.

/// Result alias of the command line.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the command line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the library: invalid options ([`accelerate_rs::Error::InvalidArgument`]
    /// naming the flag), a file ([`accelerate_rs::Error::Io`]), a worker that could not be
    /// started ([`accelerate_rs::Error::Spawn`]), a failed check, ...
    #[error(transparent)]
    Library(#[from] accelerate_rs::Error),

    /// An error of the models crate: a `config.json` `estimate-memory` cannot read (naming the
    /// file and the key), an architecture it does not know.
    #[error(transparent)]
    Models(#[from] accelerate_rs_models::Error),

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

    /// The launcher received SIGINT, SIGTERM or SIGHUP and stopped its workers.
    #[error("launch: interrupted by {signal}; stopped {stopped} worker(s)")]
    Interrupted {
        /// The signal received (`SIGINT`, `SIGTERM` or `SIGHUP`).
        signal: String,
        /// Exit code to propagate: 128 + the signal number (130 for SIGINT).
        code: i32,
        /// How many workers were still running and had to be stopped.
        stopped: usize,
    },
}
