//! [`DataLoader`]: batches of a [`Dataset`] for this rank, on a device, with prefetching.

use std::sync::Arc;

use candle_core::Device;

use super::iter::BatchPlan;
use super::sampler::validate_shard;
use super::{BatchIter, Dataset, DistributedSampler, EvenBatches};
use crate::{Error, Result};

/// Iterates a [`Dataset`] in batches for one rank, following a [`DistributedSampler`] plan.
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
    device: Device,
    prefetch: usize,
    epoch: u64,
    rank: usize,
    world: usize,
    /// `(epoch, batches_done)` set by [`DataLoader::resume_at`].
    resume: Option<(u64, usize)>,
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
            device: Device::Cpu,
            prefetch: 2,
            epoch: 0,
            rank: 0,
            world: 1,
            resume: None,
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

    /// The device batches are moved to.
    pub fn device(mut self, device: &Device) -> Self {
        self.device = device.clone();
        self
    }

    /// How many batches a background thread builds ahead; 0 builds them synchronously in `next`.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Make this the loader of `rank` out of `world_size` processes.
    ///
    /// Fails if `world_size == 0` or `rank >= world_size`.
    pub fn shard(mut self, rank: usize, world_size: usize) -> Result<Self> {
        validate_shard(rank, world_size)?;
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
    pub fn resume_at(&mut self, epoch: u64, batches_done: usize) {
        self.epoch = epoch;
        self.resume = Some((epoch, batches_done));
    }

    /// Forgets the position set by [`resume_at`](Self::resume_at).
    pub fn clear_resume(&mut self) {
        self.resume = None;
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

    /// The per-rank batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
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
            .with_shard_unchecked(self.rank, self.world);
        sampler.set_epoch(self.epoch);
        sampler
    }

    /// Iterates the current epoch's batches for this rank.
    ///
    /// Fails if the batch size is 0, the dataset is empty, or (with [`EvenBatches::Drop`]) the
    /// dataset is smaller than the number of processes. Errors from the dataset are yielded as
    /// `Err` items and end the epoch.
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
            self.skipped_batches(),
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
            .field("device", &self.device.location())
            .field("prefetch", &self.prefetch)
            .field("epoch", &self.epoch)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("resume", &self.resume)
            .finish()
    }
}
