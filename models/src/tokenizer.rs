//! `tokenizer.json` through the `tokenizers` crate (pure Rust here: its regex engine is
//! `fancy-regex`, no C library).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

pub use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// The tokenizer file of a model folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Reads `tokenizer.json`: the file, or the one in a model folder. The error names the file.
///
/// The file's own `padding` and `truncation` settings are dropped, as `transformers` drops them
/// for every call that does not ask for padding or truncation: kept, a `truncation` block (many
/// saved tokenizers have `max_length: 512`) would cut every line of a corpus and every
/// conversation short without a word, and a fixed padding length would pad every text to it
/// (a hostile 10^10 aborts the process on the allocation). Cut and pad with the loaders'
/// lengths instead.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let given = path.as_ref();
    let path = tokenizer_path(given);
    if !path.exists() {
        let hint = if given.exists() {
            String::new()
        } else {
            crate::config::missing_hint(given)
        };
        return Err(Error::Tokenizer {
            path,
            reason: format!(
                "no such file (a Hugging Face tokenizer folder holds tokenizer.json){hint}"
            ),
        });
    }
    let bytes =
        accelerate_rs::files::read_bounded(&path, accelerate_rs::files::MAX_TOKENIZER_BYTES)?;
    let mut tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| Error::Tokenizer {
        reason: format!("could not read it: {e}"),
        path: path.clone(),
    })?;
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(None)
        .map_err(|e| Error::Tokenizer {
            reason: format!("could not turn its truncation off: {e}"),
            path: path.clone(),
        })?;
    // Only a panic fails the load: a tokenizer may refuse the probe's text with an error of its
    // own (a closed vocabulary without an unknown token), which the real text will tell.
    let probe = unpanicked("encode and decode a probe text", || {
        tokenizer
            .encode(PROBE, false)
            .map(|encoding| tokenizer.decode(encoding.get_ids(), false))
    });
    match probe {
        Ok(_) => Ok(tokenizer),
        Err(reason) => Err(Error::Tokenizer { path, reason }),
    }
}

/// The text a tokenizer encodes and decodes once when it is loaded: letters, accents, digits,
/// punctuation, spaces and line breaks.
const PROBE: &str = "Hello, world! Héllo 123 \t\n  naïve 日本 ok.\n";

/// A call into the `tokenizers` library with its panics caught (some settings of a hostile
/// `tokenizer.json` make it index out of bounds): `Err` says what failed to happen, with the
/// library's error or panic message.
pub(crate) fn call<T>(
    what: &str,
    f: impl FnOnce() -> tokenizers::Result<T>,
) -> std::result::Result<T, String> {
    unpanicked(what, f)?.map_err(|e| format!("could not {what}: {e}"))
}

/// `f()`, or the message of its panic.
fn unpanicked<T>(what: &str, f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    // Unwind safety: on a panic the partial result is dropped and an error returned; these
    // calls only read the tokenizer, so nothing is left half-changed.
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".to_string());
        format!(
            "the tokenizers library failed to {what} (it panicked: {message}): the \
             tokenizer.json holds settings it cannot run"
        )
    })
}

fn tokenizer_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(TOKENIZER_FILE)
    } else {
        path.to_path_buf()
    }
}

/// The text of `ids` (`skip_special`: without the special tokens), as
/// `Tokenizer::decode` gives it, with a panic of the `tokenizers` library (a hostile
/// `tokenizer.json`) turned into an error.
pub fn decode_ids(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> Result<String> {
    call("decode the ids", || tokenizer.decode(ids, skip_special)).map_err(|reason| {
        Error::Tokenizer {
            path: PathBuf::from("<tokenizer>"),
            reason,
        }
    })
}

/// The token ids of `text`, without special tokens (for a running corpus that is cut into
/// windows afterwards). Lines are encoded in parallel, each with its line break, and the ids
/// joined in order.
pub fn encode_corpus(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let lines: Vec<String> = text.split_inclusive('\n').map(str::to_string).collect();
    let encodings =
        call("encode the text", || tokenizer.encode_batch(lines, false)).map_err(|reason| {
            Error::Tokenizer {
                path: PathBuf::from("<tokenizer>"),
                reason,
            }
        })?;
    Ok(encodings
        .iter()
        .flat_map(|e| e.get_ids().iter().copied())
        .collect())
}
