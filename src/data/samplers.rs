//! Custom [`Sampler`]s: [`WeightedSampler`] (weighted sampling with replacement) and
//! [`LengthGroupedSampler`] (batches of similar lengths for variable-length sequences).
//!
//! Both only decide the epoch's global order; a [`DistributedSampler`](super::DistributedSampler)
//! (or a [`DataLoader`](super::DataLoader) given one with
//! [`with_sampler`](super::DataLoader::with_sampler)) shards it, so every rank yields the same
//! number of batches.

use std::cmp::Reverse;
use std::sync::Arc;

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::seq::SliceRandom;

use super::sampler::{epoch_rng, Sampler};
use crate::error::{Error, Result};

/// Weighted sampling with replacement (PyTorch's `WeightedRandomSampler`): each epoch draws
/// `num_samples` dataset indices, index `i` with probability `weights[i] / sum(weights)`.
///
/// The draws are seeded by `seed + epoch` (ChaCha8), so they are the same on every rank and differ
/// between epochs. Sharded by a [`DistributedSampler`](super::DistributedSampler), rank `r` takes
/// the `r`-th slice of each global batch of draws.
///
/// ```
/// # use accelerate_rs::{DataLoader, TensorDataset, WeightedSampler};
/// # use candle_core::{Device, Tensor};
/// # fn main() -> accelerate_rs::Result<()> {
/// let x = Tensor::arange(0f32, 4.0, &Device::Cpu)?;
/// // Sample 3 is drawn three times as often as each other one; 8 draws per epoch.
/// let sampler = WeightedSampler::new(vec![1.0, 1.0, 1.0, 3.0], 8)?.seed(7);
/// let loader = DataLoader::new(TensorDataset::new(vec![x])?, 4).with_sampler(sampler);
/// assert_eq!(loader.len(), 2);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct WeightedSampler {
    distribution: WeightedIndex<f64>,
    len: usize,
    num_weights: usize,
    seed: u64,
}

impl WeightedSampler {
    /// Draws `num_samples` indices per epoch from `0..weights.len()`, with replacement.
    ///
    /// Fails, naming the offending value, if `weights` is empty, a weight is negative or not
    /// finite, all weights are 0, or `num_samples` is 0.
    pub fn new(weights: Vec<f64>, num_samples: usize) -> Result<Self> {
        if weights.is_empty() {
            return Err(Error::invalid(
                "weights",
                "WeightedSampler needs one weight per dataset sample; got none",
            ));
        }
        if let Some((i, w)) = weights
            .iter()
            .enumerate()
            .find(|(_, w)| !w.is_finite() || **w < 0.0)
        {
            return Err(Error::invalid(
                "weights",
                format!("weight {i} is {w}; every weight must be finite and >= 0"),
            ));
        }
        if weights.iter().all(|&w| w == 0.0) {
            return Err(Error::invalid(
                "weights",
                format!(
                    "all {} weights are 0: no sample could be drawn",
                    weights.len()
                ),
            ));
        }
        if num_samples == 0 {
            return Err(Error::invalid(
                "num_samples",
                "num_samples is 0; an epoch must draw at least one sample",
            ));
        }
        let distribution = WeightedIndex::new(&weights)
            .map_err(|e| Error::invalid("weights", format!("unusable weights: {e}")))?;
        Ok(WeightedSampler {
            distribution,
            len: num_samples,
            num_weights: weights.len(),
            seed: 0,
        })
    }

    /// The base seed of the draws (0 by default); epoch `e` draws with `seed + e`.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The number of weights (the dataset length the sampler describes).
    pub fn num_weights(&self) -> usize {
        self.num_weights
    }
}

impl Sampler for WeightedSampler {
    fn len(&self) -> usize {
        self.len
    }

    fn order(&self, epoch: u64, _global_batch_size: usize) -> Vec<usize> {
        let mut rng = epoch_rng(self.seed, epoch);
        (0..self.len)
            .map(|_| self.distribution.sample(&mut rng))
            .collect()
    }
}

/// Length-grouped batching for variable-length sequences (like Hugging Face's
/// `LengthGroupedSampler`): each global batch holds samples of similar lengths, so padding them
/// to a common length wastes little, and the order of the batches is shuffled each epoch.
///
/// Each epoch (seeded by `seed + epoch`, the same on every rank): the indices are shuffled, cut
/// into groups of `group_factor` global batches (default 50), each group is sorted by
/// decreasing length (stable), the result is cut into global batches, and the order of the full
/// global batches is shuffled (a partial last one stays last, so padding stays at the tail).
/// Sharded by a [`DistributedSampler`](super::DistributedSampler), rank `r` takes the `r`-th
/// slice of each global batch: every rank gets the same number of batches, each of similar
/// lengths.
#[derive(Debug, Clone)]
pub struct LengthGroupedSampler {
    lengths: Arc<[usize]>,
    seed: u64,
    group_factor: usize,
}

impl LengthGroupedSampler {
    /// Groups by `lengths`: `lengths[i]` is the length of sample `i` (e.g. its number of tokens).
    ///
    /// Fails if `lengths` is empty.
    pub fn new(lengths: Vec<usize>) -> Result<Self> {
        if lengths.is_empty() {
            return Err(Error::invalid(
                "lengths",
                "LengthGroupedSampler needs one length per dataset sample; got none",
            ));
        }
        Ok(LengthGroupedSampler {
            lengths: lengths.into(),
            seed: 0,
            group_factor: 50,
        })
    }

    /// The base seed (0 by default); epoch `e` uses `seed + e`.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// How many global batches are sorted together (default 50): larger groups give batches of
    /// closer lengths but less randomness. Fails if `group_factor` is 0.
    pub fn group_factor(mut self, group_factor: usize) -> Result<Self> {
        if group_factor == 0 {
            return Err(Error::invalid(
                "group_factor",
                "group_factor is 0; it must be at least 1 (global batches sorted together)",
            ));
        }
        self.group_factor = group_factor;
        Ok(self)
    }

    /// The sample lengths.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }
}

impl Sampler for LengthGroupedSampler {
    fn len(&self) -> usize {
        self.lengths.len()
    }

    fn order(&self, epoch: u64, global_batch_size: usize) -> Vec<usize> {
        let mut rng = epoch_rng(self.seed, epoch);
        let mut order: Vec<usize> = (0..self.lengths.len()).collect();
        order.shuffle(&mut rng);
        let batch = global_batch_size.max(1);
        let group = batch.saturating_mul(self.group_factor);
        for chunk in order.chunks_mut(group) {
            chunk.sort_by_key(|&i| Reverse(self.lengths[i]));
        }
        let full = order.len() / batch;
        let mut batches: Vec<usize> = (0..full).collect();
        batches.shuffle(&mut rng);
        let mut out = Vec::with_capacity(order.len());
        for b in batches {
            out.extend_from_slice(&order[b * batch..(b + 1) * batch]);
        }
        out.extend_from_slice(&order[full * batch..]);
        out
    }
}
