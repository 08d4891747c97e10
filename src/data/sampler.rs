//! The per-rank batch plan: which dataset indices each rank reads, batch by batch, in an epoch.
//!
//! The semantics follow PyTorch's `DistributedSampler` combined with Accelerate's `even_batches`:
//! every rank yields the same number of batches, and concatenating the ranks' batches rank-major
//! for each global batch gives the epoch's global order, so padding always sits at the global tail.

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// A custom epoch order for a [`DistributedSampler`] (and so a
/// [`DataLoader`](super::DataLoader)): which dataset indices an epoch visits, in which order.
///
/// The sampler only decides the *global* order; sharding stays the [`DistributedSampler`]'s job,
/// so a custom sampler keeps every guarantee of the default one: every rank yields the same
/// number of batches, rank `r` takes the `r`-th slice of each global batch, and padding (from the
/// start of the order) sits at the global tail. For that, [`order`](Sampler::order) must return
/// the same vector on every rank: it may depend only on its arguments and the sampler's own
/// settings (seed them; never use an unseeded or per-rank generator).
///
/// [`WeightedSampler`](super::WeightedSampler) and [`LengthGroupedSampler`](super::LengthGroupedSampler) implement it.
pub trait Sampler: Send + Sync + std::fmt::Debug {
    /// The number of samples an epoch visits (the length of every [`order`](Sampler::order)).
    fn len(&self) -> usize;

    /// Whether an epoch visits no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The global order of `epoch`: [`len`](Sampler::len) dataset indices (repeats allowed), the
    /// same on every rank. `global_batch_size` is the number of samples in one global batch (all
    /// ranks together), for samplers that arrange samples by batch.
    fn order(&self, epoch: u64, global_batch_size: usize) -> Vec<usize>;
}

/// A seeded generator for `epoch`, the same on every rank.
pub(crate) fn epoch_rng(seed: u64, epoch: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch))
}

/// Per-rank length of the epoch's last, partial global batch of `remaining` positions
/// (`0 < remaining < global batch size`); 0 when it is dropped.
///
/// `local` is the per-rank batch size. Without `split_batches`, [`EvenBatches::Pad`] gives each
/// rank `ceil(remaining / world)` positions (kept with `drop_last` only when that is a full
/// batch) and [`EvenBatches::Drop`] `floor(remaining / world)`. With `split_batches`, `Pad` pads
/// the global batch to its full size (so it is the same at every world size), `Drop` cuts it to a
/// multiple of the world size, and `drop_last` drops it.
pub(crate) fn last_batch_len(
    remaining: usize,
    world: usize,
    local: usize,
    split_batches: bool,
    even_batches: EvenBatches,
    drop_last: bool,
) -> usize {
    match (split_batches, even_batches) {
        _ if remaining == 0 || world == 0 => 0,
        (true, _) if drop_last => 0,
        (true, EvenBatches::Pad) => local,
        (_, EvenBatches::Drop) if drop_last => 0,
        (_, EvenBatches::Drop) => remaining / world,
        (false, EvenBatches::Pad) => {
            let per_rank = remaining.div_ceil(world);
            if per_rank < local && drop_last {
                0
            } else {
                per_rank
            }
        }
    }
}

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
/// Let `n = len` (or the custom [`Sampler`]'s length), `w = num_replicas`, `B = batch_size`.
/// Global position `p` holds `order[p % n]`. Positions are split into global batches of `G = B * w`
/// (or `G = B` with [`split_batches`](Self::split_batches)); rank `r` takes the `r`-th slice of
/// `G / w` of each. The last global batch, of `L = n % G` positions, is split the same way: with
/// [`EvenBatches::Pad`] each rank gets `ceil(L / w)` positions (padding past `n`), with
/// [`EvenBatches::Drop`] `floor(L / w)`; with `drop_last` it is dropped unless it is full.
/// Equivalently, with `Pad` every rank gets `m = ceil(n / w)` samples and with `Drop`
/// `m = floor(n / w)`. With `split_batches` and `Pad`, the last global batch is padded to the full
/// `G` instead, so that the global batches are the same at every world size.
#[derive(Debug, Clone)]
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
    split_batches: bool,
    custom: Option<Arc<dyn Sampler>>,
    /// Global positions already consumed (a resume position in samples).
    start: usize,
}

/// Equal settings and the same custom [`Sampler`] object (compared by pointer).
impl PartialEq for DistributedSampler {
    fn eq(&self, other: &Self) -> bool {
        let same_custom = match (&self.custom, &other.custom) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        same_custom
            && self.len == other.len
            && self.batch_size == other.batch_size
            && self.num_replicas == other.num_replicas
            && self.rank == other.rank
            && self.shuffle == other.shuffle
            && self.seed == other.seed
            && self.epoch == other.epoch
            && self.drop_last == other.drop_last
            && self.even_batches == other.even_batches
            && self.split_batches == other.split_batches
            && self.start == other.start
    }
}

impl Eq for DistributedSampler {}

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
            split_batches: false,
            custom: None,
            start: 0,
        }
    }

    /// Starts the epoch after its first `samples` global positions (a resume position counted in
    /// samples, e.g. [`SamplePosition::samples`](super::SamplePosition::samples)): the rest of
    /// the epoch's order is batched for this sampler's world size and batch size, which may
    /// differ from the run that consumed the first `samples`, so that every sample not yet seen
    /// is seen exactly once (padding still cycles from the start of the order). At or past the
    /// epoch's end there is no batch.
    pub fn start_at(mut self, samples: usize) -> Self {
        self.start = samples;
        self
    }

    /// The global positions skipped at the start of the epoch ([`start_at`](Self::start_at)).
    pub fn start(&self) -> usize {
        self.start
    }

    /// Accelerate's `split_batches`: `batch_size` is the *global* batch size, and each rank takes
    /// `batch_size / num_replicas` samples of every global batch. The global batches (and so the
    /// optimization trajectory) are then the same at any world size; with [`EvenBatches::Pad`]
    /// the last one is padded to the full `batch_size` (from the start of the epoch's order).
    /// [`batches`](Self::batches) fails if `batch_size` does not divide by `num_replicas`.
    pub fn split_batches(mut self, split_batches: bool) -> Self {
        self.split_batches = split_batches;
        self
    }

    /// Uses a custom [`Sampler`] for the epoch's global order instead of `0..len` (or its
    /// shuffle): e.g. a [`WeightedSampler`](super::WeightedSampler) or a [`LengthGroupedSampler`](super::LengthGroupedSampler). The sampling then
    /// ignores [`shuffle`](Self::shuffle) and [`seed`](Self::seed) (the sampler has its own) and
    /// covers the sampler's [`len`](Sampler::len) positions; `len` given to
    /// [`new`](Self::new) remains the dataset's length, which every index of the order must be
    /// below.
    pub fn sampler(mut self, sampler: Arc<dyn Sampler>) -> Self {
        self.custom = Some(sampler);
        self
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

    /// The batch size as set: per rank, or global with [`split_batches`](Self::split_batches).
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The number of samples in each of this rank's full batches: `batch_size`, or
    /// `batch_size / num_replicas` with [`split_batches`](Self::split_batches).
    pub fn local_batch_size(&self) -> usize {
        if self.split_batches {
            self.batch_size / self.num_replicas.max(1)
        } else {
            self.batch_size
        }
    }

    /// The number of samples in a full global batch (all ranks together): `batch_size *
    /// num_replicas`, or `batch_size` with [`split_batches`](Self::split_batches).
    pub fn global_batch_size(&self) -> usize {
        self.local_batch_size() * self.num_replicas
    }

    /// Whether `batch_size` is the global batch size ([`split_batches`](Self::split_batches)).
    pub fn is_split_batches(&self) -> bool {
        self.split_batches
    }

    /// The number of positions an epoch covers before padding or dropping: the dataset's length,
    /// or the custom [`Sampler`]'s.
    pub fn samples_per_epoch(&self) -> usize {
        match &self.custom {
            Some(sampler) => sampler.len(),
            None => self.len,
        }
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// The epoch's global order of dataset indices (`0..len`, its seeded permutation, or the
    /// custom [`Sampler`]'s order), the same on every rank.
    pub fn order(&self) -> Vec<usize> {
        if let Some(sampler) = &self.custom {
            return sampler.order(self.epoch, self.global_batch_size());
        }
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut epoch_rng(self.seed, self.epoch));
        }
        order
    }

    /// This rank's batches of dataset indices, in order.
    ///
    /// Fails if the dataset is empty, the batch size is 0, or (with [`EvenBatches::Drop`]) the
    /// dataset is smaller than the number of processes; with
    /// [`split_batches`](Self::split_batches) if the batch size does not divide by the number of
    /// processes; with a custom [`Sampler`] if its order does not have its stated length or
    /// holds an index past the dataset.
    pub fn batches(&self) -> Result<Vec<Vec<usize>>> {
        self.validate()?;
        let order = self.order();
        let n = self.samples_per_epoch();
        if order.len() != n {
            return Err(Error::data(format!(
                "the custom sampler's order for epoch {} has {} indices but its len() is {n}",
                self.epoch,
                order.len()
            )));
        }
        if let Some(&bad) = order.iter().find(|&&i| i >= self.len) {
            return Err(Error::data(format!(
                "the sampler's order holds index {bad}, out of range for a dataset of len {} \
                 (does the sampler describe this dataset?)",
                self.len
            )));
        }
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
        if self.validate().is_err() {
            return 0;
        }
        let n = self.samples_per_epoch();
        let rest = n.saturating_sub(self.start);
        let g = self.global_batch_size();
        let last = self.last_len(rest % g);
        (self.start + rest / g * g + last * self.num_replicas).saturating_sub(n)
    }

    /// Checks that a plan can be made.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.len == 0 {
            return Err(Error::data(
                "the dataset is empty (len 0): nothing to sample",
            ));
        }
        if self.custom.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(Error::data(
                "the custom sampler's len() is 0: an epoch would visit no sample",
            ));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid(
                "batch_size",
                "batch_size is 0; it must be at least 1",
            ));
        }
        validate_shard(self.rank, self.num_replicas)?;
        validate_split(self.split_batches, self.batch_size, self.num_replicas)?;
        let n = self.samples_per_epoch();
        if self.start > n {
            return Err(Error::data(format!(
                "the resume position ({} samples) is past the end of the epoch ({n} samples): \
                 was it saved for another dataset?",
                self.start
            )));
        }
        if self.even_batches == EvenBatches::Drop && n < self.num_replicas && self.start == 0 {
            return Err(Error::data(format!(
                "the dataset ({n} samples) is smaller than the number of processes ({}); \
                 with EvenBatches::Drop no rank would get a sample (use EvenBatches::Pad)",
                self.num_replicas
            )));
        }
        Ok(())
    }

    /// Per-rank length of the last, partial global batch of `remaining` positions.
    fn last_len(&self, remaining: usize) -> usize {
        last_batch_len(
            remaining,
            self.num_replicas,
            self.local_batch_size(),
            self.split_batches,
            self.even_batches,
            self.drop_last,
        )
    }

    /// This rank's batches as ranges of global positions (empty where no plan can be made).
    pub(crate) fn plan(&self) -> Vec<PlannedBatch> {
        if self.validate().is_err() {
            return Vec::new();
        }
        let (b, r) = (self.local_batch_size(), self.rank);
        let g = self.global_batch_size();
        let rest = self.samples_per_epoch().saturating_sub(self.start);
        let full = rest / g;
        let mut plan: Vec<PlannedBatch> = (0..full)
            .map(|k| PlannedBatch {
                start: self.start + k * g + r * b,
                len: b,
            })
            .collect();
        let last = self.last_len(rest % g);
        if last > 0 {
            plan.push(PlannedBatch {
                start: self.start + full * g + r * last,
                len: last,
            });
        }
        plan
    }

    /// How many positions of a planned batch are padding.
    pub(crate) fn padding_of(&self, batch: &PlannedBatch) -> usize {
        let end = batch.start + batch.len;
        end.saturating_sub(batch.start.max(self.samples_per_epoch()))
    }
}

/// Checks that a global batch of `batch_size` splits evenly across `num_replicas` ranks.
pub(crate) fn validate_split(
    split_batches: bool,
    batch_size: usize,
    num_replicas: usize,
) -> Result<()> {
    if split_batches && num_replicas > 0 && !batch_size.is_multiple_of(num_replicas) {
        return Err(Error::invalid(
            "batch_size",
            format!(
                "with split_batches the batch size is global and each of the {num_replicas} \
                 processes takes an equal share, but {batch_size} does not divide by \
                 {num_replicas}; use a multiple of {num_replicas}"
            ),
        ));
    }
    Ok(())
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
