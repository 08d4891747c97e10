//! The crate's typed error: every variant names the file, key or input to blame.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong loading, building or saving a model, or reading a tokenizer.
///
/// The computations themselves (`forward`, `loss`) return Candle's result, as Candle's modules
/// do; their errors name the input that is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `config.json` cannot be read, or a key is missing, of the wrong type or has a value this
    /// crate does not support (an unknown `model_type`, a RoPE scaling it does not implement).
    #[error("config file {}: {}{reason}", path.display(), key.as_deref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
    Config {
        /// The file (or `<memory>` for a configuration built in code).
        path: PathBuf,
        /// The offending key (dotted for nested ones), when one is to blame.
        key: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// A `tokenizer.json` cannot be read, or a text cannot be encoded.
    #[error("tokenizer {}: {reason}", path.display())]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// Downloading from the Hugging Face Hub failed (`hub` feature).
    #[error("Hugging Face Hub, repository `{repo}`: {reason}")]
    Hub {
        /// The repository id (`owner/name`).
        repo: String,
        /// What went wrong.
        reason: String,
    },

    /// From accelerate-rs: reading or writing weight files (`Error::ModelFile` names the file
    /// and the tensor), I/O.
    #[error(transparent)]
    Accelerate(#[from] accelerate_rs::Error),

    /// From Candle (building the parameters, a computation).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// A [`Error::Config`] for `path`, naming `key`.
    pub(crate) fn config(
        path: impl Into<PathBuf>,
        key: Option<&str>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Config {
            path: path.into(),
            key: key.map(str::to_string),
            reason: reason.into(),
        }
    }
}

/// Lets `?` carry this crate's errors through functions returning Candle's result (a training
/// step's closure): the message is kept.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Lets `?` carry this crate's errors through functions returning accelerate-rs's result (the
/// closure of `Accelerator::find_executable_batch_size`, which builds the model): an
/// accelerate-rs error comes back as it was, Candle's as accelerate-rs converts it (running out
/// of GPU memory becomes `Error::OutOfMemory`, which the search retries), the others wrapped with
/// their message.
impl From<Error> for accelerate_rs::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Accelerate(a) => a,
            other => accelerate_rs::Error::from(candle_core::Error::from(other)),
        }
    }
}
