//! [`ChatDataset`]: JSONL conversations as tokenized, labelled examples, streamed, with a
//! length bound (truncate or skip, counted), for the `StreamingLoader` or a hand-written loop.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use accelerate_rs::{IterableDataset, RecordStream};
use candle_core::{Device, Tensor};

use super::encoder::{example_error, ChatEncoder, ChatExample};
use super::reader::{ConversationReader, DEFAULT_MAX_LINE_BYTES};
use crate::error::{ChatErrorKind, Error, Result};
use crate::layers::IGNORE_INDEX;

/// What to do with an example longer than the dataset's `max_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlong {
    /// Keep its first `max_len` tokens (counted in [`ChatStats::truncated`]); an example whose
    /// every labelled token is cut away is skipped instead (counted in
    /// [`ChatStats::skipped`]).
    #[default]
    Truncate,
    /// Leave it out (counted in [`ChatStats::skipped`]).
    Skip,
}

/// The counts of one pass over a [`ChatDataset`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChatStats {
    /// Conversations read.
    pub rows: u64,
    /// Examples yielded.
    pub examples: u64,
    /// Examples yielded truncated to `max_len` tokens.
    pub truncated: u64,
    /// Conversations left out for their length.
    pub skipped: u64,
    /// The longest example seen, in tokens, before truncation.
    pub longest: usize,
}

/// Conversations from JSONL files ([`ConversationReader`]'s formats), rendered with the
/// model's chat template, tokenized and labelled by a [`ChatEncoder`], one row at a time:
/// examples of at most `max_len` tokens (longer ones truncated or skipped, [`Overlong`], and
/// counted: [`stats`](Self::stats), and a warning in the log at the end of each pass).
///
/// Use it in a loop of your own ([`examples`](Self::examples): [`ChatExample`]s of any length
/// up to `max_len`), or with `accelerate_rs::StreamingLoader` (it is an [`IterableDataset`]): a
/// sample is then three tensors of `max_len`, right-padded: `input_ids` (u32, the pad token),
/// `labels` (i64, -100 on padding) and `attention_mask` (u32, 1 on tokens, 0 on padding),
/// for `model.loss_with_mask(input_ids, Some(attention_mask), labels)`.
///
/// Each record the loader reads is an encoded example (every rank renders and tokenizes every
/// row, and keeps its own share): the examples must be known to count and skip the over-long
/// ones the same way on every rank.
///
/// ```no_run
/// use accelerate_rs::StreamingLoader;
/// use accelerate_rs_models::chat::{ChatDataset, ChatEncoder, Overlong};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let encoder = ChatEncoder::from_folder("my-instruct-model")?;
/// let data = ChatDataset::new(vec!["train.jsonl".into()], encoder, 512)?.overlong(Overlong::Skip);
/// let loader = StreamingLoader::new(data, 8).shard(0, 1)?;
/// for batch in loader.iter()? {
///     let batch = batch?; // [input_ids, labels, attention_mask], each [8, 512]
///     # let _ = batch;
/// }
/// println!("{:?}", loader.dataset().stats()); // rows, examples, truncated, skipped
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct ChatDataset {
    files: Vec<PathBuf>,
    encoder: Arc<ChatEncoder>,
    max_len: usize,
    overlong: Overlong,
    pad_id: u32,
    max_line_bytes: usize,
    stats: Arc<Mutex<ChatStats>>,
}

impl ChatDataset {
    /// The conversations of `files` (read in order), encoded by `encoder`, at most `max_len`
    /// tokens each. The padding id is the folder's `pad_token`, else its `eos_token`, else 0.
    /// Fails if `files` is empty or `max_len` is 0.
    pub fn new(files: Vec<PathBuf>, encoder: ChatEncoder, max_len: usize) -> Result<Self> {
        Self::from_arc(files, Arc::new(encoder), max_len)
    }

    /// Like [`new`](Self::new), with an encoder already shared.
    pub fn from_arc(
        files: Vec<PathBuf>,
        encoder: Arc<ChatEncoder>,
        max_len: usize,
    ) -> Result<Self> {
        if max_len == 0 {
            return Err(Error::Accelerate(accelerate_rs::Error::invalid(
                "max_len",
                "a chat dataset's max_len is 0 tokens; it must be at least 1",
            )));
        }
        ConversationReader::new(files.clone())?;
        let pad_id = encoder
            .special_token_id("pad_token")
            .or_else(|| encoder.special_token_id("eos_token"))
            .unwrap_or(0);
        Ok(ChatDataset {
            files,
            encoder,
            max_len,
            overlong: Overlong::Truncate,
            pad_id,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            stats: Arc::new(Mutex::new(ChatStats::default())),
        })
    }

    /// What to do with an over-long example (default [`Overlong::Truncate`]).
    pub fn overlong(mut self, overlong: Overlong) -> Self {
        self.overlong = overlong;
        self
    }

    /// The token id of the padding (the samples' tail; its labels are -100 and its mask 0).
    pub fn pad_id(mut self, id: u32) -> Self {
        self.pad_id = id;
        self
    }

    /// The longest line accepted ([`ConversationReader::max_line_bytes`]).
    pub fn max_line_bytes(mut self, bytes: usize) -> Self {
        self.max_line_bytes = bytes;
        self
    }

    /// The files.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The encoder.
    pub fn encoder(&self) -> &ChatEncoder {
        &self.encoder
    }

    /// The longest example, in tokens (the length of a loader's samples).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The counts of the latest pass (so far, while it runs).
    pub fn stats(&self) -> ChatStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A pass over the files: the examples in order. The first error (naming the file, line
    /// and field) ends it; so does a pass in which every conversation was too long (an error
    /// rather than no data).
    pub fn examples(&self) -> Result<ChatExamples> {
        let reader =
            ConversationReader::new(self.files.clone())?.max_line_bytes(self.max_line_bytes);
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = ChatStats::default();
        let label = match self.files.as_slice() {
            [one] => one.display().to_string(),
            many => format!(
                "{} ... ({} files)",
                many.first()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                many.len()
            ),
        };
        Ok(ChatExamples {
            label,
            reader,
            encoder: Arc::clone(&self.encoder),
            max_len: self.max_len,
            overlong: self.overlong,
            stats: ChatStats::default(),
            shared: Arc::clone(&self.stats),
            done: false,
        })
    }

    /// The tensors of one example: `[input_ids, labels, attention_mask]`, each `[max_len]`.
    pub fn to_tensors(&self, example: &ChatExample, device: &Device) -> Result<Vec<Tensor>> {
        let n = example.len();
        if n > self.max_len {
            return Err(example_error(
                example,
                format!(
                    "an example of {n} tokens does not fit the dataset's max_len of {} tokens",
                    self.max_len
                ),
            ));
        }
        let pad = self.max_len - n;
        let mut ids = example.input_ids.clone();
        ids.resize(self.max_len, self.pad_id);
        let mut labels = example.labels.clone();
        labels.resize(self.max_len, IGNORE_INDEX);
        let mask: Vec<u32> = std::iter::repeat_n(1, n)
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        Ok(vec![
            Tensor::from_vec(ids, self.max_len, device)?,
            Tensor::from_vec(labels, self.max_len, device)?,
            Tensor::from_vec(mask, self.max_len, device)?,
        ])
    }
}

impl IterableDataset for ChatDataset {
    type Record = Arc<ChatExample>;

    fn records(&self, _epoch: u64) -> accelerate_rs::Result<RecordStream<Arc<ChatExample>>> {
        let examples = self.examples()?;
        Ok(Box::new(examples.map(|item| {
            item.map(Arc::new).map_err(accelerate_rs::Error::from)
        })))
    }

    fn decode(&self, record: &Arc<ChatExample>) -> accelerate_rs::Result<Vec<Tensor>> {
        Ok(self.to_tensors(record, &Device::Cpu)?)
    }
}

/// One pass over a [`ChatDataset`]: its examples, in order ([`ChatDataset::examples`]).
#[derive(Debug)]
pub struct ChatExamples {
    /// The files, for messages.
    label: String,
    reader: ConversationReader,
    encoder: Arc<ChatEncoder>,
    max_len: usize,
    overlong: Overlong,
    stats: ChatStats,
    shared: Arc<Mutex<ChatStats>>,
    done: bool,
}

impl ChatExamples {
    /// The counts of this pass so far.
    pub fn stats(&self) -> ChatStats {
        self.stats
    }

    fn publish(&self) {
        *self.shared.lock().unwrap_or_else(|e| e.into_inner()) = self.stats;
    }

    /// The end of the pass: a warning with the counts, an error if every row was too long.
    fn finish(&mut self) -> Option<Result<ChatExample>> {
        self.done = true;
        self.publish();
        let s = self.stats;
        if s.truncated > 0 || s.skipped > 0 {
            log::warn!(
                "chat data {}: of {} conversations, {} truncated and {} skipped for being longer \
                 than {} tokens (the longest has {})",
                self.label,
                s.rows,
                s.truncated,
                s.skipped,
                self.max_len,
                s.longest
            );
        }
        if s.examples == 0 && s.rows > 0 {
            return Some(Err(Error::Chat {
                kind: ChatErrorKind::NoTarget,
                path: PathBuf::from(&self.label),
                line: None,
                field: None,
                reason: format!(
                    "all {} conversations were skipped for being longer than max_len {} tokens \
                     (the longest has {}): raise max_len, or truncate",
                    s.rows, self.max_len, s.longest
                ),
            }));
        }
        None
    }

    /// Applies the length policy: `None` when the example is left out.
    fn fit(&mut self, mut example: ChatExample) -> Option<ChatExample> {
        let n = example.len();
        self.stats.longest = self.stats.longest.max(n);
        if n <= self.max_len {
            return Some(example);
        }
        match self.overlong {
            Overlong::Skip => {
                self.stats.skipped += 1;
                None
            }
            Overlong::Truncate => {
                example.truncate(self.max_len);
                if example.num_targets() == 0 {
                    self.stats.skipped += 1;
                    None
                } else {
                    self.stats.truncated += 1;
                    Some(example)
                }
            }
        }
    }
}

impl Iterator for ChatExamples {
    type Item = Result<ChatExample>;

    fn next(&mut self) -> Option<Result<ChatExample>> {
        if self.done {
            return None;
        }
        loop {
            let conversation = match self.reader.next() {
                None => return self.finish(),
                Some(Err(e)) => {
                    self.done = true;
                    self.publish();
                    return Some(Err(e));
                }
                Some(Ok(c)) => c,
            };
            self.stats.rows += 1;
            let example = match self.encoder.encode(&conversation) {
                Ok(example) => example,
                Err(e) => {
                    self.done = true;
                    self.publish();
                    return Some(Err(e));
                }
            };
            if let Some(example) = self.fit(example) {
                self.stats.examples += 1;
                self.publish();
                return Some(Ok(example));
            }
        }
    }
}
