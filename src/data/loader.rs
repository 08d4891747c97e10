//! [`DataLoader`]: batches of a [`Dataset`] for this rank, on a device, with prefetching.

use std::sync::Arc;

use candle_core::Device;

use super::iter::BatchPlan;
use super::sampler::{validate_shard, validate_split};
use super::{BatchIter, Dataset, DistributedSampler, EvenBatches, SamplePosition, Sampler};
use crate::error::{Error, Result};

/// Iterates a [`Dataset`] in batches for one rank, following a [`DistributedSampler`] plan.
///
/// **The batch size is per process** by default: with `N` processes a global batch holds
/// `N * batch_size` samples and an epoch takes `N` times fewer optimizer steps. For a fixed global
/// batch at any world size (the same optimization trajectory), set
/// [`split_batches`](Self::split_batches): `batch_size` is then global and each rank takes
/// `batch_size / N` samples of it.
///
/// ```no_run
/// # use accelerate_rs::{DataLoader, TensorDataset};
/// # use candle_core::{Device, Tensor};
/// # fn main() -> accelerate_rs::Result<()> {
/// let x = Tensor::zeros((100, 8), candle_core::DType::F32, &Device::Cpu)?;
/// let y = Tensor::zeros(100, candle_core::DType::U32, &Device::Cpu)?;
/// let loader = DataLoader::new(TensorDataset::new(vec![x, y])?, 16).shuffle(true).seed(42);
/// for batch in loader.iter()? {
///     let batch = batch?;
///     let (xs, ys) = (&batch[0], &batch[1]);
///     # let _ = (xs, ys);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DataLoader {
    dataset: Arc<dyn Dataset>,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    even_batches: EvenBatches,
    split_batches: bool,
    custom: Option<Arc<dyn Sampler>>,
    device: Device,
    prefetch: usize,
    num_workers: usize,
    epoch: u64,
    rank: usize,
    world: usize,
    /// `(epoch, batches_done)` set by [`DataLoader::resume_at`].
    resume: Option<(u64, usize)>,
    /// Set by [`DataLoader::resume_from`].
    sample_resume: Option<SamplePosition>,
}

impl DataLoader {
    /// A loader over `dataset` in batches of `batch_size` (per rank): unshuffled, on the CPU,
    /// prefetching 2 batches, single process.
    pub fn new(dataset: impl Dataset + 'static, batch_size: usize) -> Self {
        Self::from_arc(Arc::new(dataset), batch_size)
    }

    /// Like [`new`](Self::new), for a dataset already shared.
    pub fn from_arc(dataset: Arc<dyn Dataset>, batch_size: usize) -> Self {
        DataLoader {
            dataset,
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            even_batches: EvenBatches::Pad,
            split_batches: false,
            custom: None,
            device: Device::Cpu,
            prefetch: 2,
            num_workers: 1,
            epoch: 0,
            rank: 0,
            world: 1,
            resume: None,
            sample_resume: None,
        }
    }

    /// Shuffle each epoch (the same order on every rank for the same seed and epoch).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The base seed of the shuffle.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the partial last batch (on every rank).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// How to handle a dataset that does not split evenly across ranks.
    pub fn even_batches(mut self, even_batches: EvenBatches) -> Self {
        self.even_batches = even_batches;
        self
    }

    /// Accelerate's `split_batches`: `batch_size` is the *global* batch size, split evenly across
    /// the processes (each rank takes `batch_size / world_size` samples of every global batch),
    /// so the global batches, and the optimization trajectory, are the same at any world size.
    /// With [`EvenBatches::Pad`] (the default) the last global batch is padded to the full
    /// `batch_size` from the start of the epoch's order ([`Batch::global_padding`](super::Batch::global_padding)
    /// says how many); with `drop_last` it is dropped; with [`EvenBatches::Drop`] it is cut to a
    /// multiple of the world size (then only that last batch depends on the world size).
    ///
    /// [`shard`](Self::shard) and [`iter`](Self::iter) fail if `batch_size` does not divide by
    /// the world size.
    pub fn split_batches(mut self, split_batches: bool) -> Self {
        self.split_batches = split_batches;
        self
    }

    /// Uses a custom [`Sampler`] ([`WeightedSampler`](super::WeightedSampler),
    /// [`LengthGroupedSampler`](super::LengthGroupedSampler), or your own) for each epoch's
    /// global order; sharding, padding and resuming work as with the default order.
    /// [`shuffle`](Self::shuffle) and [`seed`](Self::seed) are then ignored (the sampler has its
    /// own seed). [`iter`](Self::iter) fails if the order holds an index past the dataset.
    pub fn with_sampler(self, sampler: impl Sampler + 'static) -> Self {
        self.with_shared_sampler(Arc::new(sampler))
    }

    /// Like [`with_sampler`](Self::with_sampler), for a sampler already shared.
    pub fn with_shared_sampler(mut self, sampler: Arc<dyn Sampler>) -> Self {
        self.custom = Some(sampler);
        self
    }

    /// The number of background threads building batches (default 1). With `n > 1`, worker `k`
    /// builds batches `k, k + n, ...` and they are yielded in the plan's order, so the batches
    /// are exactly those of one worker, in the same order; the work in
    /// [`Dataset::get_batch`](super::Dataset::get_batch) runs in parallel. 0 builds batches in
    /// `next`, on the calling thread (as does [`prefetch`](Self::prefetch)`(0)`).
    pub fn num_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// The device batches are moved to: the CPU unless set, whatever device the dataset's
    /// tensors are on ([`Accelerator::prepare`](crate::Accelerator::prepare) sets the process's
    /// device; an unprepared loader over GPU data needs `.device(...)`).
    pub fn device(mut self, device: &Device) -> Self {
        self.device = device.clone();
        self
    }

    /// How many batches the background threads build ahead (default 2; split across
    /// [`num_workers`](Self::num_workers), at least 1 each); 0 builds them synchronously in
    /// `next`.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
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

    /// Set the epoch; with shuffling on, each epoch gets a different order. Moving to an epoch
    /// other than the one given to [`resume_at`](Self::resume_at) drops the resume position.
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.resume.is_some_and(|(e, _)| e != epoch) {
            self.resume = None;
        }
        if self.sample_resume.is_some_and(|p| p.epoch != epoch) {
            self.sample_resume = None;
        }
        self.epoch = epoch;
    }

    /// Resumes in the middle of an epoch (e.g. from a checkpoint's
    /// [`LoaderPosition`](crate::checkpoint::LoaderPosition)): sets the epoch to `epoch`, and
    /// [`iter`](Self::iter) for that epoch then skips its first `batches_done` batches, in the
    /// same order as an uninterrupted run (same seed, same shard). The yielded batches keep their
    /// indices within the epoch ([`Batch::index`](super::Batch::index), `is_last`). Later
    /// epochs start from their first batch: [`set_epoch`](Self::set_epoch) with another epoch,
    /// or [`clear_resume`](Self::clear_resume), drops the position. `batches_done` at or past
    /// the epoch's length gives an empty epoch.
    ///
    /// The position is in this rank's batches, so it is only right for the same world size and
    /// batch size; [`resume_from`](Self::resume_from) takes a position in samples that works at
    /// any. The two replace each other.
    pub fn resume_at(&mut self, epoch: u64, batches_done: usize) {
        self.epoch = epoch;
        self.resume = Some((epoch, batches_done));
        self.sample_resume = None;
    }

    /// Resumes in the middle of an epoch at a position counted in **global samples** (from
    /// [`sample_position`](Self::sample_position), saved in a checkpoint): sets the epoch, and
    /// [`iter`](Self::iter) for that epoch skips the first `position.samples` positions of the
    /// epoch's global order and batches the rest for this loader's world size and batch size,
    /// which may differ from the saved run's: every sample the saved run had not reached is seen
    /// exactly once (plus the usual padding at the tail). The order itself must not depend on the
    /// world size: true of the default order (shuffled or not) and of
    /// [`WeightedSampler`](super::WeightedSampler), not of
    /// [`LengthGroupedSampler`](super::LengthGroupedSampler), whose groups follow the global
    /// batch size. Batch indices continue from `position.samples / global_batch_size`.
    pub fn resume_from(&mut self, position: SamplePosition) {
        self.epoch = position.epoch;
        self.sample_resume = Some(position);
        self.resume = None;
    }

    /// The position in global samples after this rank's first `batches_done` batches of the
    /// current epoch (counting from the resume point, if any): the same on every rank, and what
    /// [`resume_from`](Self::resume_from) takes. Capped at the epoch's end.
    pub fn sample_position(&self, batches_done: usize) -> SamplePosition {
        let sampler = self.sampler();
        let n = sampler.samples_per_epoch();
        let plan = sampler.plan();
        let samples = match plan.get(batches_done.saturating_sub(1)) {
            _ if batches_done == 0 => sampler.start(),
            // Global batches are rank-major: the global batch ends where the last rank's ends.
            Some(b) => {
                let global_start = b.start - sampler.rank() * b.len;
                global_start + b.len * sampler.num_replicas()
            }
            None => n,
        };
        SamplePosition {
            epoch: self.epoch,
            samples: samples.min(n) as u64,
        }
    }

    /// Forgets the position set by [`resume_at`](Self::resume_at) or
    /// [`resume_from`](Self::resume_from).
    pub fn clear_resume(&mut self) {
        self.resume = None;
        self.sample_resume = None;
    }

    /// The batches [`iter`](Self::iter) skips at the start of the current epoch (0 unless
    /// [`resume_at`](Self::resume_at) was called for this epoch).
    pub fn skipped_batches(&self) -> usize {
        match self.resume {
            Some((e, k)) if e == self.epoch => k,
            _ => 0,
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

    /// The number of processes the dataset is split across.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The batch size as set: per rank, or global with [`split_batches`](Self::split_batches).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The number of samples in this rank's full batches: `batch_size`, or
    /// `batch_size / world_size` with [`split_batches`](Self::split_batches).
    pub fn local_batch_size(&self) -> usize {
        self.sampler().local_batch_size()
    }

    /// The number of samples in a full global batch (all ranks together).
    pub fn global_batch_size(&self) -> usize {
        self.sampler().global_batch_size()
    }

    /// Whether `batch_size` is the global batch size ([`split_batches`](Self::split_batches)).
    pub fn is_split_batches(&self) -> bool {
        self.split_batches
    }

    /// The number of background threads building batches.
    pub fn workers(&self) -> usize {
        self.num_workers
    }

    /// Whether batches are shuffled.
    pub fn is_shuffled(&self) -> bool {
        self.shuffle
    }

    /// The device batches are moved to.
    pub fn target_device(&self) -> &Device {
        &self.device
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// The number of batches this rank yields per epoch (0 where [`iter`](Self::iter) would fail).
    pub fn num_batches(&self) -> usize {
        self.sampler().num_batches()
    }

    /// Same as [`num_batches`](Self::num_batches).
    pub fn len(&self) -> usize {
        self.num_batches()
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.num_batches() == 0
    }

    /// How many samples in this rank's last batch are padding duplicates.
    pub fn padding_in_last_batch(&self) -> usize {
        self.sampler().padding_in_last_batch()
    }

    /// Padding samples across all ranks in an epoch (all in the last global batch).
    pub fn total_padding(&self) -> usize {
        self.sampler().total_padding()
    }

    /// The batch plan of this rank for the current epoch.
    pub fn sampler(&self) -> DistributedSampler {
        let mut sampler = DistributedSampler::new(self.dataset.len(), self.batch_size)
            .shuffle(self.shuffle)
            .seed(self.seed)
            .drop_last(self.drop_last)
            .even_batches(self.even_batches)
            .split_batches(self.split_batches)
            .with_shard_unchecked(self.rank, self.world);
        if let Some(custom) = &self.custom {
            sampler = sampler.sampler(Arc::clone(custom));
        }
        if let Some(p) = self.sample_resume.filter(|p| p.epoch == self.epoch) {
            sampler = sampler.start_at(usize::try_from(p.samples).unwrap_or(usize::MAX));
        }
        sampler.set_epoch(self.epoch);
        sampler
    }

    /// Iterates the current epoch's batches for this rank.
    ///
    /// Fails if the batch size is 0, the dataset is empty, (with [`EvenBatches::Drop`]) the
    /// dataset is smaller than the number of processes, (with
    /// [`split_batches`](Self::split_batches)) the batch size does not divide by the number of
    /// processes, or a custom sampler's order is out of range. Errors from the dataset are
    /// yielded as `Err` items and end the epoch.
    pub fn iter(&self) -> Result<BatchIter> {
        if self.batch_size == 0 {
            return Err(Error::invalid(
                "batch_size",
                "the data loader's batch_size is 0; it must be at least 1",
            ));
        }
        if self.dataset.is_empty() {
            return Err(Error::data(
                "the data loader's dataset is empty (len 0): nothing to iterate",
            ));
        }
        let sampler = self.sampler();
        let batches = sampler.batches()?;
        let plans = batches
            .into_iter()
            .zip(sampler.plan())
            .map(|(indices, planned)| {
                // Every rank's batch of this global batch has the same length, and rank r's starts
                // r lengths after the global batch's start; padding is what lies past the dataset.
                let start = planned.start - sampler.rank() * planned.len;
                let end = start + sampler.num_replicas() * planned.len;
                BatchPlan {
                    indices,
                    padding: sampler.padding_of(&planned),
                    global_padding: end.saturating_sub(start.max(sampler.len())),
                }
            })
            .collect();
        BatchIter::starting_at(
            Arc::clone(&self.dataset),
            self.device.clone(),
            plans,
            self.prefetch,
            self.num_workers,
            self.skipped_batches(),
            sampler.start() / sampler.global_batch_size().max(1),
        )
    }
}

impl std::fmt::Debug for DataLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("len", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("shuffle", &self.shuffle)
            .field("seed", &self.seed)
            .field("drop_last", &self.drop_last)
            .field("even_batches", &self.even_batches)
            .field("split_batches", &self.split_batches)
            .field("sampler", &self.custom)
            .field("device", &self.device.location())
            .field("prefetch", &self.prefetch)
            .field("num_workers", &self.num_workers)
            .field("epoch", &self.epoch)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("resume", &self.resume)
            .field("sample_resume", &self.sample_resume)
            .finish()
    }
}
