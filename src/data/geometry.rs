//! The batch geometry shared by the [`DataLoader`](super::DataLoader), the
//! [`StreamingLoader`](super::StreamingLoader) and the [`DistributedSampler`](super::DistributedSampler):
//! the batch size as set, whether it is global (`split_batches`), this rank and the world size,
//! and what happens to the epoch's last, partial global batch (`drop_last`, [`EvenBatches`]);
//! with the arithmetic they share: the per-rank and global batch sizes, the per-rank length of
//! the last batch, and this rank's batches of an epoch.

use crate::error::{Error, Result};

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

/// How one rank's batches are cut out of an epoch's global positions.
///
/// Positions are split into global batches of `G = batch_size * world` (or `G = batch_size`
/// with `split_batches`); rank `r` takes the `r`-th slice of `G / world` of each. The last global
/// batch, of `L < G` positions, is split by [`last_len`](Self::last_len).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchGeometry {
    /// The batch size as set: per rank, or global with `split_batches`.
    pub(crate) batch_size: usize,
    /// Whether `batch_size` is the global batch size.
    pub(crate) split_batches: bool,
    /// Whether a partial last global batch is dropped.
    pub(crate) drop_last: bool,
    /// How a last global batch that does not split evenly across ranks is handled.
    pub(crate) even_batches: EvenBatches,
    /// This rank.
    pub(crate) rank: usize,
    /// The number of processes.
    pub(crate) world: usize,
}

impl BatchGeometry {
    /// Batches of `batch_size` on a single process, the last one padded and kept.
    pub(crate) fn new(batch_size: usize) -> Self {
        BatchGeometry {
            batch_size,
            split_batches: false,
            drop_last: false,
            even_batches: EvenBatches::Pad,
            rank: 0,
            world: 1,
        }
    }

    /// The same geometry for `rank` out of `world` processes, checked by
    /// [`validate_shard`].
    pub(crate) fn sharded(self, rank: usize, world: usize) -> Result<Self> {
        validate_shard(rank, world)?;
        Ok(BatchGeometry {
            rank,
            world,
            ..self
        })
    }

    /// Checks the rank against the world size, and that a global batch splits evenly across
    /// the ranks (`split_batches`).
    pub(crate) fn validate(&self) -> Result<()> {
        validate_shard(self.rank, self.world)?;
        validate_split(self.split_batches, self.batch_size, self.world)
    }

    /// The number of samples in this rank's full batches: `batch_size`, or
    /// `batch_size / world` with `split_batches`.
    pub(crate) fn local_batch_size(&self) -> usize {
        if self.split_batches {
            self.batch_size / self.world.max(1)
        } else {
            self.batch_size
        }
    }

    /// The number of samples in a full global batch (all ranks together).
    pub(crate) fn global_batch_size(&self) -> usize {
        self.local_batch_size() * self.world
    }

    /// Per-rank length of the epoch's last, partial global batch of `remaining` positions
    /// (`0 < remaining < global batch size`); 0 when it is dropped.
    ///
    /// Without `split_batches`, [`EvenBatches::Pad`] gives each rank `ceil(remaining / world)`
    /// positions (kept with `drop_last` only when that is a full batch) and [`EvenBatches::Drop`]
    /// `floor(remaining / world)`. With `split_batches`, `Pad` pads the global batch to its full
    /// size (so it is the same at every world size), `Drop` cuts it to a multiple of the world
    /// size, and `drop_last` drops it.
    pub(crate) fn last_len(&self, remaining: usize) -> usize {
        let (world, local) = (self.world, self.local_batch_size());
        match (self.split_batches, self.even_batches) {
            _ if remaining == 0 || world == 0 => 0,
            (true, _) if self.drop_last => 0,
            (true, EvenBatches::Pad) => local,
            (_, EvenBatches::Drop) if self.drop_last => 0,
            (_, EvenBatches::Drop) => remaining / world,
            (false, EvenBatches::Pad) => {
                let per_rank = remaining.div_ceil(world);
                if per_rank < local && self.drop_last {
                    0
                } else {
                    per_rank
                }
            }
        }
    }

    /// This rank's slice `from..to` of a global batch in which every rank takes `per_rank`
    /// positions (relative to the global batch's start).
    pub(crate) fn slice(&self, per_rank: usize) -> (usize, usize) {
        let from = self.rank * per_rank;
        (from, from + per_rank)
    }

    /// This rank's batches of an epoch of `n` positions whose first `start` were consumed
    /// already (a resume position), as ranges of global positions. The geometry must be valid
    /// ([`validate`](Self::validate)) and the batch size not 0.
    pub(crate) fn plan(&self, start: usize, n: usize) -> Vec<PlannedBatch> {
        let b = self.local_batch_size();
        let g = self.global_batch_size();
        let rest = n.saturating_sub(start);
        let full = rest / g;
        let mut plan: Vec<PlannedBatch> = (0..full)
            .map(|k| PlannedBatch {
                start: start + k * g + self.slice(b).0,
                len: b,
            })
            .collect();
        let last = self.last_len(rest % g);
        if last > 0 {
            plan.push(PlannedBatch {
                start: start + full * g + self.slice(last).0,
                len: last,
            });
        }
        plan
    }

    /// The global positions of the global batch that holds this rank's `batch` (every rank's
    /// batch of it has the same length, rank `r`'s starting `r` lengths after its start).
    pub(crate) fn global_span(&self, batch: &PlannedBatch) -> (usize, usize) {
        let start = batch.start - self.rank * batch.len;
        (start, start + self.world * batch.len)
    }

    /// Padding positions across all ranks in an epoch of `n` positions from `start` (all in
    /// the last global batch, at its tail). The geometry must be valid and the batch size not 0.
    pub(crate) fn total_padding(&self, start: usize, n: usize) -> usize {
        let rest = n.saturating_sub(start);
        let g = self.global_batch_size();
        let last = self.last_len(rest % g);
        (start + rest / g * g + last * self.world).saturating_sub(n)
    }
}

/// Checks that a global batch of `batch_size` splits evenly across `num_replicas` ranks.
fn validate_split(split_batches: bool, batch_size: usize, num_replicas: usize) -> Result<()> {
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
