//! The crate's typed error: every variant names the file, key or input to blame.

use std::path::PathBuf;

use accelerate_rs::files::{excerpt, EXCERPT_NAME_BYTES, EXCERPT_REASON_BYTES};

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
    #[error("config file {}: {}{}", path.display(), key.as_deref().map(|k| format!("key `{}`: ", excerpt(k, EXCERPT_NAME_BYTES))).unwrap_or_default(), excerpt(reason, EXCERPT_REASON_BYTES))]
    Config {
        /// The file (or `<memory>` for a configuration built in code).
        path: PathBuf,
        /// The offending key (dotted for nested ones), when one is to blame.
        key: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// A `tokenizer.json` cannot be read, or a text cannot be encoded.
    #[error("tokenizer {}: {}", path.display(), excerpt(reason, EXCERPT_REASON_BYTES))]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// A conversation (a row of a JSONL file, or one built in code) cannot be read, rendered
    /// with the chat template or tokenized: names the file, the line (from 1) and the field
    /// (`messages[2].role`) when they are known; [`ChatErrorKind`] says what went wrong.
    #[error("{}: {}{}", chat_location(path, *line), field.as_deref().map(|f| format!("field `{}`: ", excerpt(f, EXCERPT_NAME_BYTES))).unwrap_or_default(), excerpt(reason, EXCERPT_REASON_BYTES))]
    Chat {
        /// What went wrong.
        kind: ChatErrorKind,
        /// The JSONL file (`<memory>` for a conversation built in code).
        path: PathBuf,
        /// The line of the file, from 1.
        line: Option<usize>,
        /// The offending field of the row (`messages[1].content`, `completion`).
        field: Option<String>,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// A model folder has no chat template, or its template (or `tokenizer_config.json`)
    /// cannot be read or compiled.
    #[error("chat template {}: {}", path.display(), excerpt(reason, EXCERPT_REASON_BYTES))]
    ChatTemplate {
        /// The file (`chat_template.jinja`, `tokenizer_config.json`) or folder.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// Generation cannot start or go on: a setting of `GenerationConfig` out of range, no prompt
    /// or an empty one, a model that does not generate, logits no token can be picked from (NaN,
    /// +inf, all -inf) (names the parameter or the prompt).
    #[error(
        "generate: `{}`: {}",
        excerpt(what, EXCERPT_NAME_BYTES),
        excerpt(reason, EXCERPT_REASON_BYTES)
    )]
    Generation {
        /// The parameter (`top_p`) or prompt (`prompts[1]`) to blame.
        what: String,
        /// What is wrong and what was expected.
        reason: String,
    },

    /// Downloading from the Hugging Face Hub failed (`hub` feature).
    #[error(
        "Hugging Face Hub, repository `{}`: {}",
        excerpt(repo, EXCERPT_NAME_BYTES),
        excerpt(reason, EXCERPT_REASON_BYTES)
    )]
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

/// What is wrong with a conversation ([`Error::Chat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ChatErrorKind {
    /// A file cannot be opened or read.
    Io,
    /// A line is longer than the reader's bound (`max_line_bytes`).
    LineTooLong,
    /// A line is not JSON (or not UTF-8).
    InvalidJson,
    /// A required field is missing (or `null`).
    MissingField,
    /// A field has the wrong JSON type (or `messages` and `prompt` are both given).
    WrongType,
    /// A message's role is not `system`, `user`, `assistant` or `tool`.
    UnknownRole,
    /// A conversation has no assistant message: nothing to learn from it.
    NoAssistantTurn,
    /// A file holds no conversation.
    EmptyFile,
    /// The chat template failed to render the conversation (e.g. its `raise_exception`).
    Render,
    /// The tokenizer failed on the rendered text.
    Tokenize,
    /// The template renders the conversation's prefixes inconsistently, so the assistant's
    /// tokens cannot be found by prefixes (see the `chat` module docs).
    InconsistentPrefixes,
    /// A conversation gives no token to learn (the assistant's tokens are empty, or all of them
    /// were cut by truncation).
    NoTarget,
}

/// `file:line`, or the file alone.
fn chat_location(path: &std::path::Path, line: Option<usize>) -> String {
    match line {
        Some(line) => format!("{}:{line}", path.display()),
        None => path.display().to_string(),
    }
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
