//! Streaming datasets: [`IterableDataset`] (records read in order, no random access, unknown
//! length), [`TextLines`] over line-oriented text files or a directory of shard files, and the
//! [`StreamingLoader`] that shards them across ranks with a resumable [`SamplePosition`].

use std::fs::File;
use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use super::dataset::stack_fields;
use super::sampler::{epoch_rng, last_batch_len, validate_shard, validate_split};
use super::threads::Threads;
use super::{Batch, EvenBatches};
use crate::error::{Error, Result};

/// Where an epoch stands, in **global samples**: how many records of the epoch's stream (all
/// ranks together) were consumed. The same on every rank, and independent of the world size, so
/// a run saved at one world size resumes at another without skipping or repeating a sample.
///
/// Serializable (e.g. with `serde_json`) to keep in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
pub struct SamplePosition {
    /// The epoch.
    pub epoch: u64,
    /// Records of the epoch's stream already consumed (by all ranks together).
    pub samples: u64,
}

/// A dataset read as a stream of records, in order: no random access, length unknown until the
/// end (line-oriented text, a directory of shard files, a network stream).
///
/// Reading ([`records`](Self::records)) must be cheap and deterministic: every rank reads the
/// whole stream in the same order and [`decode`](Self::decode)s only its own records.
pub trait IterableDataset: Send + Sync {
    /// One raw record (e.g. a line of text), cheap to read and to skip.
    type Record: Clone + Send + 'static;

    /// The records of `epoch`, in order, the same on every rank. May depend on the epoch (e.g.
    /// a seeded shuffle of the shard files). A read error ends the stream.
    fn records(&self, epoch: u64) -> Result<RecordStream<Self::Record>>;

    /// Decodes a record into a sample: one tensor per field (e.g. `[tokens, label]`). Samples of
    /// a batch are stacked along a new dim 0, so their fields must have equal shapes.
    fn decode(&self, record: &Self::Record) -> Result<Vec<Tensor>>;
}

/// The record iterator returned by [`IterableDataset::records`].
pub type RecordStream<R> = Box<dyn Iterator<Item = Result<R>> + Send>;

impl<D: IterableDataset + ?Sized> IterableDataset for Arc<D> {
    type Record = D::Record;

    fn records(&self, epoch: u64) -> Result<RecordStream<Self::Record>> {
        (**self).records(epoch)
    }

    fn decode(&self, record: &Self::Record) -> Result<Vec<Tensor>> {
        (**self).decode(record)
    }
}

/// One line of a [`TextLines`] dataset, with where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextLine {
    /// The file.
    pub path: Arc<Path>,
    /// The line number in the file, from 1.
    pub number: usize,
    /// The line, without its line ending.
    pub text: String,
}

/// Line-oriented text files read as one stream: the lines of the first file, then of the next,
/// and so on (e.g. JSON-lines or CSV shards). Each line is a record, parsed into a sample by a
/// closure; a parse error names the file and line.
///
/// ```no_run
/// # use accelerate_rs::{StreamingLoader, TextLines};
/// # use accelerate_rs::Error;
/// # use candle_core::{Device, Tensor};
/// # fn main() -> accelerate_rs::Result<()> {
/// // Every file of data/shards/, in name order; each line "x1,x2,label".
/// let lines = TextLines::from_dir("data/shards", |line: &str| {
///     let v: Vec<f32> = line
///         .split(',')
///         .map(|s| s.trim().parse::<f32>().map_err(|e| Error::data(e.to_string())))
///         .collect::<Result<_, _>>()?;
///     Ok(vec![Tensor::new(&v[..2], &Device::Cpu)?, Tensor::new(v[2] as u32, &Device::Cpu)?])
/// })?;
/// let loader = StreamingLoader::new(lines, 32).shard(0, 1)?;
/// for batch in loader.iter()? {
///     let batch = batch?;
///     # let _ = batch;
/// }
/// # Ok(()) }
/// ```
pub struct TextLines<F> {
    files: Vec<PathBuf>,
    shuffle_seed: Option<u64>,
    skip_empty: bool,
    parse: F,
}

impl<F> TextLines<F>
where
    F: Fn(&str) -> Result<Vec<Tensor>> + Send + Sync,
{
    /// The lines of `files`, in that order. Fails if `files` is empty (a missing or unreadable
    /// file is an error, naming it, when the stream reaches it).
    pub fn new(files: Vec<PathBuf>, parse: F) -> Result<Self> {
        if files.is_empty() {
            return Err(Error::invalid(
                "files",
                "TextLines needs at least one file; got none",
            ));
        }
        Ok(TextLines {
            files,
            shuffle_seed: None,
            skip_empty: false,
            parse,
        })
    }

    /// The lines of every regular file directly in `dir` (not in subdirectories, and not the
    /// hidden ones whose names start with `.`), in file-name order: a directory of shards. Fails,
    /// naming the directory, if it cannot be read or holds no such file.
    pub fn from_dir(dir: impl AsRef<Path>, parse: F) -> Result<Self> {
        let dir = dir.as_ref();
        let entries = std::fs::read_dir(dir).map_err(|e| {
            Error::data(format!(
                "cannot read the shard directory {}: {e}",
                dir.display()
            ))
        })?;
        let mut files = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| {
                Error::data(format!(
                    "cannot list the shard directory {}: {e}",
                    dir.display()
                ))
            })?;
            let path = entry.path();
            let hidden = entry.file_name().to_string_lossy().starts_with('.');
            if !hidden && path.is_file() {
                files.push(path);
            }
        }
        files.sort();
        if files.is_empty() {
            return Err(Error::data(format!(
                "the shard directory {} holds no files",
                dir.display()
            )));
        }
        Self::new(files, parse)
    }

    /// Reads the files in a different order each epoch: a permutation seeded by `seed + epoch`,
    /// the same on every rank (the lines within a file keep their order).
    pub fn shuffle_files(mut self, seed: u64) -> Self {
        self.shuffle_seed = Some(seed);
        self
    }

    /// Skips lines that are empty or only whitespace (they are not records, so they take no
    /// position).
    pub fn skip_empty_lines(mut self, skip: bool) -> Self {
        self.skip_empty = skip;
        self
    }

    /// The files, in their unshuffled order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The files in the order `epoch` reads them.
    pub fn files_for_epoch(&self, epoch: u64) -> Vec<PathBuf> {
        let mut files = self.files.clone();
        if let Some(seed) = self.shuffle_seed {
            files.shuffle(&mut epoch_rng(seed, epoch));
        }
        files
    }
}

impl<F> std::fmt::Debug for TextLines<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextLines")
            .field("files", &self.files)
            .field("shuffle_seed", &self.shuffle_seed)
            .field("skip_empty", &self.skip_empty)
            .finish()
    }
}

impl<F> IterableDataset for TextLines<F>
where
    F: Fn(&str) -> Result<Vec<Tensor>> + Send + Sync,
{
    type Record = TextLine;

    fn records(&self, epoch: u64) -> Result<RecordStream<TextLine>> {
        Ok(Box::new(LineReader {
            files: self.files_for_epoch(epoch).into_iter(),
            current: None,
            skip_empty: self.skip_empty,
            failed: false,
        }))
    }

    fn decode(&self, record: &TextLine) -> Result<Vec<Tensor>> {
        (self.parse)(&record.text).map_err(|e| {
            Error::data(format!(
                "{}:{}: cannot parse the line: {e}",
                record.path.display(),
                record.number
            ))
        })
    }
}

/// Reads the lines of files one after the other; ends after the first error.
struct LineReader {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<(Arc<Path>, Lines<BufReader<File>>, usize)>,
    skip_empty: bool,
    failed: bool,
}

impl Iterator for LineReader {
    type Item = Result<TextLine>;

    fn next(&mut self) -> Option<Result<TextLine>> {
        if self.failed {
            return None;
        }
        loop {
            if let Some((path, lines, number)) = &mut self.current {
                match lines.next() {
                    Some(Ok(text)) => {
                        *number += 1;
                        if self.skip_empty && text.trim().is_empty() {
                            continue;
                        }
                        return Some(Ok(TextLine {
                            path: Arc::clone(path),
                            number: *number,
                            text,
                        }));
                    }
                    Some(Err(e)) => {
                        self.failed = true;
                        return Some(Err(Error::data(format!(
                            "{}:{}: cannot read the line: {e}",
                            path.display(),
                            *number + 1
                        ))));
                    }
                    None => self.current = None,
                }
            }
            let path = self.files.next()?;
            match File::open(&path) {
                Ok(file) => {
                    self.current = Some((Arc::from(path), BufReader::new(file).lines(), 0));
                }
                Err(e) => {
                    self.failed = true;
                    return Some(Err(Error::data(format!(
                        "cannot open the data file {}: {e}",
                        path.display()
                    ))));
                }
            }
        }
    }
}

/// Batches an [`IterableDataset`] for one rank: equal step counts on every rank, no
/// collectives, and a resumable [`SamplePosition`].
///
/// # How a stream is sharded
///
/// Every rank reads the *whole* record stream, in the same order, and decodes only its own
/// records: global position `p` (the `p`-th record of the epoch) belongs to global batch
/// `p / G` (`G = batch_size * world_size`, or `batch_size` with `split_batches`), and rank `r`
/// takes the `r`-th slice of `G / world_size` positions of each global batch, exactly like the
/// map-style [`DistributedSampler`](super::DistributedSampler). Reading a record (a line) is cheap
/// next to decoding it into tensors, so the cost of reading everything is small, and in exchange:
///
/// - **No collectives, no hang on uneven inputs.** Each rank reads one global batch ahead, so every
///   rank sees the end of the stream at the same global batch and stops after the same number of
///   steps, however unevenly the records are spread over the files.
/// - **The same batches as the map-style loader.** The last, partial global batch of `L` records
///   follows the same rules: with [`EvenBatches::Pad`] (default) each rank gets `ceil(L / w)`
///   records, padded by cycling from the start of the epoch (the padding sits at the global
///   tail; [`Batch::global_padding`](super::Batch::global_padding) counts it); with
///   [`EvenBatches::Drop`] each gets `floor(L / w)` and at most `w - 1` records are dropped;
///   `drop_last` drops the partial global batch (unless it is full after padding);
///   `split_batches` pads it to the full global batch (Pad) or drops it (`drop_last`).
/// - **Resume at any world size, sample-exact.** The position is the number of global samples
///   consumed ([`SamplePosition`]), which does not depend on the world size: resuming skips
///   exactly those records and regroups the rest for the new world size.
///
/// `batch_size` is per rank, or global with [`split_batches`](Self::split_batches).
pub struct StreamingLoader<D: IterableDataset> {
    dataset: Arc<D>,
    batch_size: usize,
    drop_last: bool,
    even_batches: EvenBatches,
    split_batches: bool,
    device: Device,
    prefetch: usize,
    num_workers: usize,
    epoch: u64,
    rank: usize,
    world: usize,
    resume: Option<SamplePosition>,
}

impl<D: IterableDataset> Clone for StreamingLoader<D> {
    fn clone(&self) -> Self {
        StreamingLoader {
            dataset: Arc::clone(&self.dataset),
            batch_size: self.batch_size,
            drop_last: self.drop_last,
            even_batches: self.even_batches,
            split_batches: self.split_batches,
            device: self.device.clone(),
            prefetch: self.prefetch,
            num_workers: self.num_workers,
            epoch: self.epoch,
            rank: self.rank,
            world: self.world,
            resume: self.resume,
        }
    }
}

impl<D: IterableDataset + 'static> StreamingLoader<D> {
    /// A loader over `dataset` in batches of `batch_size` (per rank): on the CPU, prefetching 2
    /// batches in a background thread, single process.
    pub fn new(dataset: D, batch_size: usize) -> Self {
        Self::from_arc(Arc::new(dataset), batch_size)
    }

    /// Like [`new`](Self::new), for a dataset already shared.
    pub fn from_arc(dataset: Arc<D>, batch_size: usize) -> Self {
        StreamingLoader {
            dataset,
            batch_size,
            drop_last: false,
            even_batches: EvenBatches::Pad,
            split_batches: false,
            device: Device::Cpu,
            prefetch: 2,
            num_workers: 1,
            epoch: 0,
            rank: 0,
            world: 1,
            resume: None,
        }
    }

    /// Drop the last, partial global batch (unless padding made it full).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// How to handle a last global batch that does not split evenly across ranks.
    pub fn even_batches(mut self, even_batches: EvenBatches) -> Self {
        self.even_batches = even_batches;
        self
    }

    /// `batch_size` is the global batch size, split evenly across ranks (see
    /// [`DataLoader::split_batches`](super::DataLoader::split_batches)).
    pub fn split_batches(mut self, split_batches: bool) -> Self {
        self.split_batches = split_batches;
        self
    }

    /// The device batches are moved to.
    pub fn device(mut self, device: &Device) -> Self {
        self.device = device.clone();
        self
    }

    /// How many batches are read and decoded ahead in the background (default 2; split across
    /// [`num_workers`](Self::num_workers), at least 1 each); 0 does it in `next`, on the calling
    /// thread.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// The number of background threads decoding batches (default 1). With `n > 1`, one thread
    /// reads the records (cheap) and groups them into batches, and worker `k` decodes batches
    /// `k, k + n, ...` ([`IterableDataset::decode`] runs in parallel: tokenizing, parsing); the
    /// batches are yielded in order, so they are exactly those of one worker. 0 decodes in
    /// `next`, on the calling thread (as does [`prefetch`](Self::prefetch)`(0)`).
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Make this the loader of `rank` out of `world_size` processes.
    ///
    /// Fails if `world_size == 0` or `rank >= world_size`, or, with
    /// [`split_batches`](Self::split_batches), if the batch size does not divide by `world_size`.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Result<Self> {
        validate_shard(rank, world_size)?;
        validate_split(self.split_batches, self.batch_size, world_size)?;
        self.rank = rank;
        self.world = world_size;
        Ok(self)
    }

    /// Sets the epoch (passed to [`IterableDataset::records`]). Moving to an epoch other than
    /// the one given to [`resume_from`](Self::resume_from) drops the resume position.
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.resume.is_some_and(|p| p.epoch != epoch) {
            self.resume = None;
        }
        self.epoch = epoch;
    }

    /// Resumes at `position` (from [`StreamIter::position`], typically saved in a checkpoint):
    /// sets the epoch, and [`iter`](Self::iter) then skips the epoch's first `position.samples`
    /// records and batches the rest, at this loader's world size and batch size, which may differ
    /// from the saved run's. Later epochs start from their beginning.
    pub fn resume_from(&mut self, position: SamplePosition) {
        self.epoch = position.epoch;
        self.resume = Some(position);
    }

    /// Forgets the position set by [`resume_from`](Self::resume_from).
    pub fn clear_resume(&mut self) {
        self.resume = None;
    }

    /// Where [`iter`](Self::iter) starts: the resume position for the current epoch, or its
    /// start.
    pub fn start_position(&self) -> SamplePosition {
        match self.resume {
            Some(p) if p.epoch == self.epoch => p,
            _ => SamplePosition {
                epoch: self.epoch,
                samples: 0,
            },
        }
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The batch size as set (per rank, or global with [`split_batches`](Self::split_batches)).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The number of records in this rank's full batches.
    pub fn local_batch_size(&self) -> usize {
        if self.split_batches {
            self.batch_size / self.world.max(1)
        } else {
            self.batch_size
        }
    }

    /// The number of records in a full global batch (all ranks together).
    pub fn global_batch_size(&self) -> usize {
        self.local_batch_size() * self.world
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<D> {
        &self.dataset
    }

    /// Iterates the current epoch's batches for this rank, from the
    /// [`start_position`](Self::start_position).
    ///
    /// Fails if the batch size is 0, or (with [`split_batches`](Self::split_batches)) does not
    /// divide by the world size, or the dataset cannot open its stream. Read and decode errors,
    /// and a resume position past the end of the stream, are yielded as `Err` items and end the
    /// epoch.
    pub fn iter(&self) -> Result<StreamIter> {
        if self.batch_size == 0 {
            return Err(Error::invalid(
                "batch_size",
                "the streaming loader's batch_size is 0; it must be at least 1",
            ));
        }
        validate_shard(self.rank, self.world)?;
        validate_split(self.split_batches, self.batch_size, self.world)?;
        let start = self.start_position();
        let records = self.dataset.records(self.epoch)?;
        let engine = Engine {
            dataset: Arc::clone(&self.dataset),
            records,
            device: self.device.clone(),
            rank: self.rank,
            world: self.world,
            local: self.local_batch_size(),
            global: self.global_batch_size(),
            split_batches: self.split_batches,
            even_batches: self.even_batches,
            drop_last: self.drop_last,
            epoch: self.epoch,
            skip: start.samples,
            first: Vec::new(),
            read: 0,
            current: None,
            index: 0,
            done: false,
        };
        let inner = match (self.prefetch, self.num_workers) {
            (0, _) | (_, 0) => StreamInner::Sync(Box::new(engine)),
            (prefetch, workers) => StreamInner::Workers(Workers::start(
                engine,
                workers,
                prefetch.div_ceil(workers).max(1),
            )?),
        };
        Ok(StreamIter {
            inner,
            position: start,
            done: false,
        })
    }
}

impl<D: IterableDataset> std::fmt::Debug for StreamingLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamingLoader")
            .field("batch_size", &self.batch_size)
            .field("drop_last", &self.drop_last)
            .field("even_batches", &self.even_batches)
            .field("split_batches", &self.split_batches)
            .field("device", &self.device.location())
            .field("prefetch", &self.prefetch)
            .field("num_workers", &self.num_workers)
            .field("epoch", &self.epoch)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("resume", &self.resume)
            .finish()
    }
}

/// A batch and the position after its global batch.
type Step = Result<(Batch, SamplePosition)>;

/// The per-rank batching state machine over one epoch's record stream.
struct Engine<D: IterableDataset> {
    dataset: Arc<D>,
    records: RecordStream<D::Record>,
    device: Device,
    rank: usize,
    world: usize,
    local: usize,
    global: usize,
    split_batches: bool,
    even_batches: EvenBatches,
    drop_last: bool,
    epoch: u64,
    /// Records to skip at the start (the resume position).
    skip: u64,
    /// The epoch's first `global` records, for padding.
    first: Vec<D::Record>,
    /// Records read so far (the global position of the next one).
    read: u64,
    /// The next global batch's records and its first position (read one batch ahead).
    current: Option<(Vec<D::Record>, u64)>,
    /// The next batch's index.
    index: usize,
    done: bool,
}

impl<D: IterableDataset> Engine<D> {
    /// Reads the next record, keeping the epoch's first global batch for padding.
    fn read_one(&mut self) -> Result<Option<D::Record>> {
        match self.records.next() {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok(record)) => {
                if self.first.len() < self.global {
                    self.first.push(record.clone());
                }
                self.read += 1;
                Ok(Some(record))
            }
        }
    }

    /// Reads up to one global batch of records.
    fn read_chunk(&mut self) -> Result<(Vec<D::Record>, u64)> {
        let start = self.read;
        let mut chunk = Vec::with_capacity(self.global);
        while chunk.len() < self.global {
            match self.read_one()? {
                Some(record) => chunk.push(record),
                None => break,
            }
        }
        Ok((chunk, start))
    }

    /// Skips the resume position's records and reads the first global batch.
    fn begin(&mut self) -> Result<()> {
        while self.read < self.skip {
            if self.read_one()?.is_none() {
                return Err(Error::data(format!(
                    "the resume position ({} samples into epoch {}) is past the end of the \
                     epoch's stream ({} records): was it saved for another dataset?",
                    self.skip, self.epoch, self.read
                )));
            }
        }
        // Batch indices count the global batches before the resume position.
        self.index = usize::try_from(self.skip / self.global as u64).unwrap_or(usize::MAX);
        self.current = Some(self.read_chunk()?);
        Ok(())
    }

    /// Per-rank length of a last global batch of `remaining` records (0: dropped).
    fn last_len(&self, remaining: usize) -> usize {
        last_batch_len(
            remaining,
            self.world,
            self.local,
            self.split_batches,
            self.even_batches,
            self.drop_last,
        )
    }

    /// This rank's records (chunk-relative positions `from..to`, moved out of the global batch's
    /// `chunk`) of the next batch, to decode; `after` is the global position after the global
    /// batch.
    fn job(
        &self,
        chunk: Vec<D::Record>,
        start: u64,
        (from, to): (usize, usize),
        last: bool,
        after: u64,
    ) -> Job<D::Record> {
        let len = chunk.len();
        let total = start + len as u64;
        let mut samples: Vec<(u64, Option<D::Record>)> = chunk
            .into_iter()
            .enumerate()
            .skip(from)
            .take(to.saturating_sub(from))
            .map(|(q, record)| (start + q as u64, Some(record)))
            .collect();
        // Padding past the stream's end: cycle from the start of the epoch.
        let padding = to.saturating_sub(from + samples.len());
        for q in to - padding..to {
            let position = start + q as u64;
            let record = usize::try_from(position % total.max(1))
                .ok()
                .and_then(|p| self.first.get(p));
            samples.push((position, record.cloned()));
        }
        Job {
            samples,
            index: self.index,
            padding,
            global_padding: ((to - from) * self.world).saturating_sub(len),
            // The number of batches is unknown ahead: a lower bound until the last batch.
            num_batches: self.index + if last { 1 } else { 2 },
            position: SamplePosition {
                epoch: self.epoch,
                samples: after,
            },
        }
    }

    /// The next batch to decode, or the error that ends the epoch.
    fn next_job(&mut self) -> Option<Result<Job<D::Record>>> {
        if self.done {
            return None;
        }
        if self.current.is_none() {
            if let Err(e) = self.begin() {
                self.done = true;
                return Some(Err(e));
            }
        }
        let (chunk, start) = self.current.take()?;
        let result = if chunk.len() == self.global {
            // A full global batch; read the next one to know whether this is the last.
            match self.read_chunk() {
                Err(e) => Err(e),
                Ok(next) => {
                    let last = next.0.is_empty()
                        || (next.0.len() < self.global && self.last_len(next.0.len()) == 0);
                    let from = self.rank * self.local;
                    let after = start + self.global as u64;
                    let job = self.job(chunk, start, (from, from + self.local), last, after);
                    self.current = Some(next);
                    if last {
                        self.done = true;
                    }
                    Ok(job)
                }
            }
        } else {
            self.done = true;
            let per_rank = self.last_len(chunk.len());
            if per_rank == 0 {
                return None;
            }
            let from = self.rank * per_rank;
            let after = start + chunk.len() as u64;
            Ok(self.job(chunk, start, (from, from + per_rank), true, after))
        };
        self.index += 1;
        if result.is_err() {
            self.done = true;
        }
        Some(result)
    }
}

impl<D: IterableDataset> Iterator for Engine<D> {
    type Item = Step;

    fn next(&mut self) -> Option<Step> {
        let job = self.next_job()?;
        Some(job.and_then(|job| job.build(self.dataset.as_ref(), &self.device)))
    }
}

/// One batch's records, read and grouped by the [`Engine`], to be decoded (by the engine's
/// thread, or by one of [`StreamingLoader::num_workers`]'s workers).
struct Job<R> {
    /// Each sample's global position, and its record (`None`: no record kept for padding).
    samples: Vec<(u64, Option<R>)>,
    index: usize,
    padding: usize,
    global_padding: usize,
    num_batches: usize,
    /// The position after this batch's global batch.
    position: SamplePosition,
}

impl<R> Job<R> {
    /// Decodes the records, stacks them and moves the batch to `device`.
    fn build<D: IterableDataset<Record = R> + ?Sized>(self, dataset: &D, device: &Device) -> Step {
        let samples = self.samples.into_iter().map(|(position, record)| {
            let sample = match record {
                Some(record) => dataset.decode(&record),
                None => Err(Error::data(format!(
                    "no record kept for padding position {position}"
                ))),
            };
            (usize::try_from(position).unwrap_or(usize::MAX), sample)
        });
        let tensors = stack_fields(samples)?;
        let tensors = tensors
            .iter()
            .map(|t| t.to_device(device))
            .collect::<candle_core::Result<Vec<Tensor>>>()?;
        let batch = Batch::new(tensors, self.index, self.padding, self.num_batches)
            .with_global_padding(self.global_padding);
        Ok((batch, self.position))
    }
}

/// The iterator over one epoch of a [`StreamingLoader`]: this rank's batches, in order. Yields
/// `Err` at most once, and then ends.
///
/// [`position`](Self::position) is the global position after the last batch yielded: save it to
/// resume there. [`Batch::is_last`] is exact (the loader reads one global batch ahead), but the
/// length of the epoch is unknown ahead: [`Batch::num_batches`] is a lower bound until the last
/// batch.
pub struct StreamIter {
    inner: StreamInner,
    position: SamplePosition,
    done: bool,
}

enum StreamInner {
    /// Read and decoded in `next`.
    Sync(Box<dyn Iterator<Item = Step> + Send>),
    /// Read and decoded ahead by background threads.
    Workers(Workers),
}

/// A reader thread grouping records into batch [`Job`]s and `n` workers decoding them: job `j`
/// goes to worker `j % n`, and the iterator takes batch `j` from that worker's channel.
struct Workers {
    /// One channel per worker; `None` marks the end of the epoch.
    threads: Threads<Option<Step>>,
    /// The batches taken so far (the next comes from worker `taken % n`).
    taken: usize,
}

impl Workers {
    /// Starts the reader thread and `workers` decoding threads over `engine`'s jobs, each
    /// worker with channels of `capacity`.
    fn start<D: IterableDataset + 'static>(
        mut engine: Engine<D>,
        workers: usize,
        capacity: usize,
    ) -> Result<Self> {
        let mut threads = Threads::new("streaming loader");
        // Declared after `threads`, so that on an error it is dropped first: the workers'
        // loops end and dropping `threads` can join them.
        let mut jobs = Vec::with_capacity(workers);
        for k in 0..workers {
            let (job_sender, job_receiver) =
                sync_channel::<Option<Result<Job<D::Record>>>>(capacity);
            let (sender, receiver) = sync_channel::<Option<Step>>(capacity);
            let (dataset, device) = (Arc::clone(&engine.dataset), engine.device.clone());
            let stop = threads.stop_flag();
            threads.spawn(
                format!("accelerate-stream-worker-{k}"),
                Some(receiver),
                move || {
                    for job in job_receiver {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let item =
                            job.map(|job| job.and_then(|j| j.build(dataset.as_ref(), &device)));
                        // The epoch ends here: with its last batch's successor, or an error.
                        let end = item.as_ref().is_none_or(|i| i.is_err());
                        if sender.send(item).is_err() || end {
                            return;
                        }
                    }
                },
            )?;
            jobs.push(job_sender);
        }
        let stop = threads.stop_flag();
        threads.spawn("accelerate-stream-reader".into(), None, move || {
            for j in 0.. {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let job = engine.next_job();
                let end = job.as_ref().is_none_or(|i| i.is_err());
                let Some(worker) = jobs.get(j % jobs.len().max(1)) else {
                    return;
                };
                if worker.send(job).is_err() || end {
                    return;
                }
            }
        })?;
        Ok(Workers { threads, taken: 0 })
    }

    /// The next batch, `None` at the end of the epoch.
    fn next(&mut self) -> Option<Step> {
        let k = self.taken % self.threads.channels().max(1);
        self.taken += 1;
        match self.threads.recv(k) {
            Some(item) => item,
            None => Some(Err(Error::data(format!(
                "streaming loader worker {k}, or the thread reading the records, stopped before \
                 the end of the epoch (it panicked)"
            )))),
        }
    }
}

impl StreamIter {
    /// The position after the last batch yielded (the start position before the first): every
    /// record before it was consumed by some rank. The same on every rank.
    pub fn position(&self) -> SamplePosition {
        self.position
    }
}

impl Iterator for StreamIter {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.done {
            return None;
        }
        let item = match &mut self.inner {
            StreamInner::Sync(engine) => engine.next(),
            StreamInner::Workers(workers) => workers.next(),
        };
        match item {
            None => {
                self.done = true;
                None
            }
            Some(Ok((batch, position))) => {
                self.position = position;
                Some(Ok(batch))
            }
            Some(Err(e)) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

impl std::fmt::Debug for StreamIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamIter")
            .field("position", &self.position)
            .field("prefetch", &!matches!(self.inner, StreamInner::Sync(_)))
            .field(
                "workers",
                &match &self.inner {
                    StreamInner::Workers(w) => w.threads.channels(),
                    StreamInner::Sync(_) => 0,
                },
            )
            .field("done", &self.done)
            .finish()
    }
}
