//! The per-rank batch plan: which dataset indices each rank reads, batch by batch, in an epoch.
//!
//! The semantics follow PyTorch's `DistributedSampler` combined with Accelerate's `even_batches`:
//! every rank yields the same number of batches, and concatenating the ranks' batches rank-major
//! for each global batch gives the epoch's global order, so padding always sits at the global tail.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// What to do when the dataset does not split evenly across processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvenBatches {
    /// Pad by cycling from the start of the epoch's order, so that every rank gets
    /// `ceil(len / num_replicas)` samples (Accelerate's `even_batches=True`).
    #[default]
    Pad,
    /// Drop the tail, so that every rank gets `floor(len / num_replicas)` samples and no sample is
    /// duplicated.
    Drop,
}

/// One planned batch: a contiguous range of global positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedBatch {
    /// First global position.
    pub(crate) start: usize,
    /// Number of positions.
    pub(crate) len: usize,
}

/// The per-rank batch plan (`DistributedSampler` semantics).
///
/// Let `n = len`, `w = num_replicas`, `B = batch_size`. With [`EvenBatches::Pad`] each rank gets
/// `m = ceil(n / w)` samples and global position `p` holds `order[p % n]`; with
/// [`EvenBatches::Drop`] each rank gets `m = floor(n / w)` samples. Positions are split into global
/// batches of `B * w`; rank `r` takes the `r`-th slice of `B` of each, and a partial last global
/// batch of `L = m % B` positions per rank is split the same way (or dropped with `drop_last`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    batch_size: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
    even_batches: EvenBatches,
}

impl DistributedSampler {
    /// A single-replica, unshuffled sampler over `len` samples in batches of `batch_size`.
    pub fn new(len: usize, batch_size: usize) -> Self {
        DistributedSampler {
            len,
            batch_size,
            num_replicas: 1,
            rank: 0,
            shuffle: false,
            seed: 0,
            epoch: 0,
            drop_last: false,
            even_batches: EvenBatches::Pad,
        }
    }

    /// Shuffle the order each epoch (seeded by `seed + epoch`, identical on every rank).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The base seed of the shuffle.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Drop the partial last batch on every rank.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// How to handle a dataset that does not split evenly across ranks.
    pub fn even_batches(mut self, even_batches: EvenBatches) -> Self {
        self.even_batches = even_batches;
        self
    }

    /// Make this the sampler of `rank` out of `num_replicas` processes.
    ///
    /// Fails if `num_replicas == 0` or `rank >= num_replicas`.
    pub fn shard(mut self, rank: usize, num_replicas: usize) -> Result<Self> {
        validate_shard(rank, num_replicas)?;
        self.rank = rank;
        self.num_replicas = num_replicas;
        Ok(self)
    }

    /// Sets rank and world size already validated by the caller.
    pub(crate) fn with_shard_unchecked(mut self, rank: usize, num_replicas: usize) -> Self {
        self.rank = rank;
        self.num_replicas = num_replicas;
        self
    }

    /// Set the epoch; with shuffling on, each epoch gets a different order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of samples in the dataset.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the dataset is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The per-rank batch size.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// The epoch's global order of dataset indices (`0..len`, or its seeded permutation), the same
    /// on every rank.
    pub fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            order.shuffle(&mut rng);
        }
        order
    }

    /// This rank's batches of dataset indices, in order.
    ///
    /// Fails if the dataset is empty, the batch size is 0, or (with [`EvenBatches::Drop`]) the
    /// dataset is smaller than the number of processes.
    pub fn batches(&self) -> Result<Vec<Vec<usize>>> {
        self.validate()?;
        let order = self.order();
        let n = self.len;
        Ok(self
            .plan()
            .into_iter()
            .map(|b| (b.start..b.start + b.len).map(|p| order[p % n]).collect())
            .collect())
    }

    /// The number of batches this rank yields per epoch (0 where [`batches`](Self::batches) fails).
    pub fn num_batches(&self) -> usize {
        self.plan().len()
    }

    /// How many samples in this rank's last yielded batch are padding duplicates.
    pub fn padding_in_last_batch(&self) -> usize {
        self.plan().last().map(|b| self.padding_of(b)).unwrap_or(0)
    }

    /// Padding samples across all ranks, counting only batches actually yielded. All of it sits in
    /// the last global batch, at its tail.
    pub fn total_padding(&self) -> usize {
        if self.len == 0 || self.batch_size == 0 || self.num_replicas == 0 {
            return 0;
        }
        let (m, _) = self.per_rank();
        let full = m / self.batch_size;
        let partial = m % self.batch_size;
        let end = if partial > 0 && !self.drop_last {
            m * self.num_replicas
        } else {
            full * self.batch_size * self.num_replicas
        };
        end.saturating_sub(self.len)
    }

    /// Checks that a plan can be made.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.len == 0 {
            return Err(Error::data(
                "the dataset is empty (len 0): nothing to sample",
            ));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid(
                "batch_size",
                "batch_size is 0; it must be at least 1",
            ));
        }
        validate_shard(self.rank, self.num_replicas)?;
        if self.even_batches == EvenBatches::Drop && self.len < self.num_replicas {
            return Err(Error::data(format!(
                "the dataset ({} samples) is smaller than the number of processes ({}); \
                 with EvenBatches::Drop no rank would get a sample (use EvenBatches::Pad)",
                self.len, self.num_replicas
            )));
        }
        Ok(())
    }

    /// Samples per rank and the total number of positions.
    fn per_rank(&self) -> (usize, usize) {
        let (n, w) = (self.len, self.num_replicas);
        let m = match self.even_batches {
            EvenBatches::Pad => n.div_ceil(w),
            EvenBatches::Drop => n / w,
        };
        (m, m * w)
    }

    /// This rank's batches as ranges of global positions (empty where no plan can be made).
    pub(crate) fn plan(&self) -> Vec<PlannedBatch> {
        if self.validate().is_err() {
            return Vec::new();
        }
        let (b, w, r) = (self.batch_size, self.num_replicas, self.rank);
        let (m, _) = self.per_rank();
        let full = m / b;
        let partial = m % b;
        let mut plan: Vec<PlannedBatch> = (0..full)
            .map(|g| PlannedBatch {
                start: g * b * w + r * b,
                len: b,
            })
            .collect();
        if partial > 0 && !self.drop_last {
            plan.push(PlannedBatch {
                start: full * b * w + r * partial,
                len: partial,
            });
        }
        plan
    }

    /// How many positions of a planned batch are padding.
    pub(crate) fn padding_of(&self, batch: &PlannedBatch) -> usize {
        let end = batch.start + batch.len;
        end.saturating_sub(batch.start.max(self.len))
    }
}

/// Checks a (rank, world size) pair.
pub(crate) fn validate_shard(rank: usize, num_replicas: usize) -> Result<()> {
    if num_replicas == 0 {
        return Err(Error::invalid(
            "num_replicas",
            format!("num_replicas is 0 (rank {rank}); it must be at least 1"),
        ));
    }
    if rank >= num_replicas {
        return Err(Error::invalid(
            "rank",
            format!("rank {rank} is out of range for num_replicas {num_replicas} (must be < {num_replicas})"),
        ));
    }
    Ok(())
}
