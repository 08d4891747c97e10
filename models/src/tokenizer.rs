//! `tokenizer.json` through the `tokenizers` crate (pure Rust here: its regex engine is
//! `fancy-regex`, no C library).
//!
//! Every call into the library runs on another thread (a [`Worker`]'s kept one, or one of its
//! own) under a time limit ([`TOKENIZE_GRACE`] plus a second per [`TOKENIZE_BYTES_PER_SECOND`]
//! bytes of text): a
//! `tokenizer.json`'s regular expressions are code from the folder, and a backtracking pattern
//! can spend hours on one long line (fancy-regex's step limit only ends the exponential ones).
//! Past the limit the call returns an error naming the file's patterns; its thread is left to
//! end on its own (nothing can stop it), busy on one core until then.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

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
///
/// The functions of this crate that call the tokenizer ([`encode_text`], [`encode_corpus`],
/// [`decode_ids`], [`ChatEncoder`](crate::chat::ChatEncoder), which keeps one thread for its
/// calls) run each call on another thread under a time limit: [`TOKENIZE_GRACE`] plus a second
/// per [`TOKENIZE_BYTES_PER_SECOND`] bytes of text. A file's regular expressions are code from
/// the folder, and a backtracking one can spend hours on a long line; past the limit the call
/// is an error naming the patterns, and its thread, which nothing can stop, ends on its own.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let given = path.as_ref();
    let path = tokenizer_path(given);
    // A link to nothing is read below, and said to be one.
    if !crate::config::present(&path) {
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
    // Only a panic or the time limit fails the load: a tokenizer may refuse the probe's text
    // with an error of its own (a closed vocabulary without an unknown token), which the real
    // text will tell.
    let shared = Arc::new(tokenizer);
    let probe = limited(
        &shared,
        "encode and decode a probe text",
        PROBE.len(),
        |tokenizer| {
            Ok(tokenizer
                .encode(PROBE, false)
                .map(|encoding| tokenizer.decode(encoding.get_ids(), false)))
        },
    );
    match probe {
        // The probe's thread let go of its copy before it answered.
        Ok(_) => Ok(Arc::try_unwrap(shared).unwrap_or_else(|shared| (*shared).clone())),
        Err(reason) => Err(Error::Tokenizer { path, reason }),
    }
}

/// The time any call into the `tokenizers` library may take, plus a second per
/// [`TOKENIZE_BYTES_PER_SECOND`] bytes of its text. Real tokenizers encode megabytes a second
/// on one core, a debug build over 100 KiB.
pub const TOKENIZE_GRACE: Duration = Duration::from_secs(10);

/// The slowest rate, in bytes a second, a text may be tokenized at beyond
/// [`TOKENIZE_GRACE`].
pub const TOKENIZE_BYTES_PER_SECOND: usize = 64 * 1024;

/// The time limit of a call on a text of `bytes` bytes.
fn time_limit(bytes: usize) -> Duration {
    TOKENIZE_GRACE + Duration::from_secs_f64(bytes as f64 / TOKENIZE_BYTES_PER_SECOND as f64)
}

/// `f(tokenizer)`, a call on a text of `bytes` bytes, on a thread of its own within the time
/// limit of such a call, with its panics caught as [`call`] catches them. Past the limit the
/// error names the tokenizer's regular expressions and the thread is left behind, to end on
/// its own.
pub(crate) fn limited<T: Send + 'static>(
    tokenizer: &Arc<Tokenizer>,
    what: &str,
    bytes: usize,
    f: impl FnOnce(&Tokenizer) -> tokenizers::Result<T> + Send + 'static,
) -> std::result::Result<T, String> {
    within(tokenizer, what, bytes, time_limit(bytes), f)
}

/// [`limited`] given `limit`.
fn within<T: Send + 'static>(
    tokenizer: &Arc<Tokenizer>,
    what: &str,
    bytes: usize,
    limit: Duration,
    f: impl FnOnce(&Tokenizer) -> tokenizers::Result<T> + Send + 'static,
) -> std::result::Result<T, String> {
    let (answer, answered) = mpsc::sync_channel(1);
    let shared = Arc::clone(tokenizer);
    let doing = what.to_string();
    std::thread::Builder::new()
        .name("tokenizer".into())
        .spawn(move || {
            let result = call(&doing, || f(&shared));
            // Let go of the tokenizer before answering, so the caller holds the only copy again.
            drop(shared);
            // The caller may have stopped waiting (past the limit): nobody to tell.
            let _ = answer.send(result);
        })
        .map_err(|e| format!("could not start a thread to {what}: {e}"))?;
    answer_of(answered.recv_timeout(limit), tokenizer, what, bytes, limit)
}

/// The answer of a call on a text of `bytes` bytes whose thread was waited for `limit`: its
/// result, or the error of a call past its time limit (naming the tokenizer's regular
/// expressions) or of a thread that ended without answering.
fn answer_of<T>(
    received: std::result::Result<std::result::Result<T, String>, mpsc::RecvTimeoutError>,
    tokenizer: &Tokenizer,
    what: &str,
    bytes: usize,
    limit: Duration,
) -> std::result::Result<T, String> {
    match received {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!(
            "could not {what} within its time limit: a text of {bytes} bytes took more than \
             {:.1} s ({} s, plus 1 s per {} KiB); the tokenizer's regular expressions may \
             backtrack on it{} (real ones encode megabytes a second); the call goes on in the \
             background until it ends",
            limit.as_secs_f64(),
            TOKENIZE_GRACE.as_secs(),
            TOKENIZE_BYTES_PER_SECOND / 1024,
            patterns(tokenizer),
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(format!(
            "the thread that was to {what} ended without an answer"
        )),
    }
}

/// A call for a [`Worker`]'s thread.
type Job = Box<dyn FnOnce(&Tokenizer) + Send>;

/// A tokenizer with a thread kept for its calls, for an owner that makes one call per row of a
/// dataset ([`ChatEncoder`](crate::chat::ChatEncoder)): starting a thread costs about 50 µs,
/// as much as tokenizing a short conversation. Every call still has its own time limit, as
/// [`limited`]'s; past it the thread is given up (it ends once its call does) and the next call
/// starts another. A call made while another is in progress (the owner shared between threads)
/// runs on a thread of its own, as [`limited`] runs it.
#[derive(Debug)]
pub(crate) struct Worker {
    tokenizer: Arc<Tokenizer>,
    /// The kept thread's queue; `None` before the first call and after a call past its limit.
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
}

impl Worker {
    pub(crate) fn new(tokenizer: Tokenizer) -> Worker {
        Worker {
            tokenizer: Arc::new(tokenizer),
            jobs: Mutex::new(None),
        }
    }

    pub(crate) fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// [`limited`] on the kept thread.
    pub(crate) fn limited<T: Send + 'static>(
        &self,
        what: &str,
        bytes: usize,
        f: impl FnOnce(&Tokenizer) -> tokenizers::Result<T> + Send + 'static,
    ) -> std::result::Result<T, String> {
        self.within(what, bytes, time_limit(bytes), f)
    }

    /// [`Worker::limited`] given `limit`.
    fn within<T: Send + 'static>(
        &self,
        what: &str,
        bytes: usize,
        limit: Duration,
        f: impl FnOnce(&Tokenizer) -> tokenizers::Result<T> + Send + 'static,
    ) -> std::result::Result<T, String> {
        // Busy (another thread's call is in progress): a thread of its own, so that no call
        // waits behind another and every time limit is the call's own.
        let Ok(mut kept) = self.jobs.try_lock() else {
            return within(&self.tokenizer, what, bytes, limit, f);
        };
        let (answer, answered) = mpsc::sync_channel(1);
        let doing = what.to_string();
        let job: Job = Box::new(move |tokenizer| {
            // The caller may have stopped waiting (past the limit): nobody to tell.
            let _ = answer.send(call(&doing, || f(tokenizer)));
        });
        let jobs = match kept.take() {
            Some(jobs) => jobs,
            None => self.start()?,
        };
        // The kept thread cannot end while its queue is held (its calls' panics are caught),
        // but if it did, the call comes back and goes to a new one.
        let jobs = match jobs.send(job) {
            Ok(()) => jobs,
            Err(mpsc::SendError(job)) => {
                let fresh = self.start()?;
                fresh
                    .send(job)
                    .map_err(|_| format!("the thread that was to {what} ended before its call"))?;
                fresh
            }
        };
        let received = answered.recv_timeout(limit);
        // Kept only after an answer: past the limit the thread is busy for good, and dropping
        // its queue lets it end once its call does.
        if received.is_ok() {
            *kept = Some(jobs);
        }
        answer_of(received, &self.tokenizer, what, bytes, limit)
    }

    /// A new thread that runs the calls sent to it, until its queue is dropped.
    fn start(&self) -> std::result::Result<mpsc::Sender<Job>, String> {
        let (jobs, taken) = mpsc::channel::<Job>();
        let shared = Arc::clone(&self.tokenizer);
        std::thread::Builder::new()
            .name("tokenizer".into())
            .spawn(move || {
                for job in taken {
                    job(&shared);
                }
            })
            .map_err(|e| format!("could not start a thread for the tokenizer: {e}"))?;
        Ok(jobs)
    }
}

/// The regular expressions of a tokenizer, as `: key = "pattern", ...` (keys of its JSON),
/// or nothing when it has none (or cannot be written out).
fn patterns(tokenizer: &Tokenizer) -> String {
    fn walk(value: &serde_json::Value, key: &str, found: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let path = if key.is_empty() {
                        k.clone()
                    } else {
                        format!("{key}.{k}")
                    };
                    match (k.as_str(), v) {
                        ("Regex", serde_json::Value::String(pattern)) => found.push(format!(
                            "{path} = {:?}",
                            accelerate_rs::files::excerpt(pattern, 200)
                        )),
                        _ => walk(v, &path, found),
                    }
                }
            }
            serde_json::Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    walk(v, &format!("{key}[{i}]"), found);
                }
            }
            _ => {}
        }
    }
    let Ok(json) = tokenizer
        .to_string(false)
        .map_err(|e| e.to_string())
        .and_then(|text| serde_json::from_str(&text).map_err(|e| e.to_string()))
    else {
        return String::new();
    };
    let mut found = Vec::new();
    walk(&json, "", &mut found);
    if found.is_empty() {
        String::new()
    } else {
        format!(": {}", found.join(", "))
    }
}

/// The text a tokenizer encodes and decodes once when it is loaded: letters, accents, digits,
/// punctuation, spaces and line breaks.
const PROBE: &str = "Hello, world! Héllo 123 \t\n  naïve 日本 ok.\n";

/// A call into the `tokenizers` library with its panics caught (some settings of a hostile
/// `tokenizer.json` make it index out of bounds): `Err` says what failed to happen, with the
/// library's error or panic message.
fn call<T>(
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
///
/// The call copies the tokenizer for its thread (tens of milliseconds for a vocabulary of
/// 150,000); [`ChatEncoder::decode`](crate::chat::ChatEncoder::decode) shares its own.
pub fn decode_ids(tokenizer: &Tokenizer, ids: &[u32], skip_special: bool) -> Result<String> {
    decode_on(&Worker::new(tokenizer.clone()), ids, skip_special)
}

/// [`decode_ids`] on `worker`'s kept thread.
pub(crate) fn decode_on(worker: &Worker, ids: &[u32], skip_special: bool) -> Result<String> {
    let ids = ids.to_vec();
    // A decoder's `Replace` can hold a pattern too; the text is about 4 bytes a token.
    let bytes = ids.len().saturating_mul(4);
    worker
        .limited("decode the ids", bytes, move |tokenizer| {
            tokenizer.decode(&ids, skip_special)
        })
        .map_err(|reason| Error::Tokenizer {
            path: PathBuf::from("<tokenizer>"),
            reason,
        })
}

/// The token ids of `text` as `Tokenizer::encode(text, add_special_tokens)` gives them (a
/// prompt: `add_special_tokens` puts BOS and the like around it, as `tokenizer(text)` does in
/// `transformers`), within the time limit of every call into the `tokenizers` library and with
/// its panics turned into an error.
pub fn encode_text(
    tokenizer: &Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>> {
    let owned = text.to_string();
    limited(
        &Arc::new(tokenizer.clone()),
        "encode the text",
        text.len(),
        move |tokenizer| {
            let encoding = tokenizer.encode(owned, add_special_tokens)?;
            Ok(encoding.get_ids().to_vec())
        },
    )
    .map_err(|reason| Error::Tokenizer {
        path: PathBuf::from("<tokenizer>"),
        reason,
    })
}

/// The token ids of `text`, without special tokens (for a running corpus that is cut into
/// windows afterwards). Lines are encoded in parallel, each with its line break, and the ids
/// joined in order.
pub fn encode_corpus(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    encode_corpus_within(tokenizer, text, time_limit(text.len()))
}

/// [`encode_corpus`] given `limit`.
fn encode_corpus_within(tokenizer: &Tokenizer, text: &str, limit: Duration) -> Result<Vec<u32>> {
    let lines: Vec<String> = text.split_inclusive('\n').map(str::to_string).collect();
    within(
        &Arc::new(tokenizer.clone()),
        "encode the text",
        text.len(),
        limit,
        move |tokenizer| {
            let encodings = tokenizer.encode_batch(lines, false)?;
            Ok(encodings
                .iter()
                .flat_map(|e| e.get_ids().iter().copied())
                .collect())
        },
    )
    .map_err(|reason| Error::Tokenizer {
        path: PathBuf::from("<tokenizer>"),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny Llama's tokenizer with a backtracking `Split` in front of its pre-tokenizer:
    /// on a run of `a`s every position costs a little under fancy-regex's step limit.
    fn backtracking() -> Tokenizer {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny-llama/tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let byte_level = json["pre_tokenizer"].clone();
        json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?=(a|aa)*c)a"}, "behavior": "Isolated",
             "invert": false},
            byte_level,
        ]});
        Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn a_call_past_its_time_limit_is_an_error_naming_the_patterns() {
        let tokenizer = backtracking();
        let text = "a".repeat(4000);
        let start = std::time::Instant::now();
        let err = encode_corpus_within(&tokenizer, &text, Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert!(err.contains("within its time limit"), "{err}");
        assert!(err.contains("4000 bytes"), "{err}");
        assert!(
            err.contains(r#"pre_tokenizer.pretokenizers[0].pattern.Regex = "(?=(a|aa)*c)a""#),
            "{err}"
        );
        // The same tokenizer on a text without the pattern's trap, in time.
        let ids = encode_corpus_within(&tokenizer, "Hello b\n", Duration::from_secs(60)).unwrap();
        assert!(!ids.is_empty());
    }

    /// The thread the call runs on.
    fn thread_of(worker: &Worker) -> std::thread::ThreadId {
        worker
            .within("tell its thread", 0, Duration::from_secs(60), |_| {
                Ok(std::thread::current().id())
            })
            .unwrap()
    }

    #[test]
    fn a_worker_keeps_its_thread_and_gives_it_up_past_a_time_limit() {
        let worker = Worker::new(backtracking());
        let kept = thread_of(&worker);
        assert_ne!(kept, std::thread::current().id());
        for _ in 0..3 {
            assert_eq!(thread_of(&worker), kept);
        }
        let text = "a".repeat(4000);
        let err = worker
            .within("encode", text.len(), Duration::from_millis(50), move |t| {
                t.encode(text, false).map(|e| e.len())
            })
            .unwrap_err();
        assert!(err.contains("within its time limit"), "{err}");
        // The late call keeps its thread busy: the next one runs on another, in time.
        let fresh = thread_of(&worker);
        assert_ne!(fresh, kept);
        let ids = worker
            .limited("encode", 8, |t| {
                t.encode("Hello b\n", false).map(|e| e.len())
            })
            .unwrap();
        assert!(ids > 0);
        assert_eq!(thread_of(&worker), fresh);
    }

    #[test]
    fn a_call_while_the_worker_is_busy_runs_on_a_thread_of_its_own() {
        let worker = Arc::new(Worker::new(backtracking()));
        let (started, has_started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let busy = {
            let worker = Arc::clone(&worker);
            std::thread::spawn(move || {
                worker
                    .within("wait", 0, Duration::from_secs(60), move |_| {
                        started.send(std::thread::current().id()).unwrap();
                        released.recv().unwrap();
                        Ok(())
                    })
                    .unwrap()
            })
        };
        let kept = has_started.recv().unwrap();
        // The kept thread is blocked in the first call: this one must not wait behind it.
        let other = thread_of(&worker);
        assert_ne!(other, kept);
        release.send(()).unwrap();
        busy.join().unwrap();
        assert_eq!(thread_of(&worker), kept);
    }

    #[test]
    fn the_limit_grows_with_the_text() {
        assert_eq!(time_limit(0), TOKENIZE_GRACE);
        assert_eq!(
            time_limit(2 * TOKENIZE_BYTES_PER_SECOND),
            TOKENIZE_GRACE + Duration::from_secs(2)
        );
    }
}
