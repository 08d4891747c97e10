//! [`Batch`]: one batch yielded by a [`DataLoader`](super::DataLoader).

use std::ops::Deref;

use candle_core::Tensor;

/// One batch: one tensor per field, stacked along dim 0, plus where it sits in the epoch.
///
/// Derefs to `[Tensor]`, so `&batch[0]` is the first field.
#[derive(Debug, Clone)]
pub struct Batch {
    tensors: Vec<Tensor>,
    index: usize,
    padding: usize,
    global_padding: usize,
    num_batches: usize,
}

impl Batch {
    /// Assembles a batch (used by the loader; public for custom loops and tests).
    ///
    /// The [`global_padding`](Self::global_padding) starts equal to `padding` (right for a single
    /// process); set it with [`with_global_padding`](Self::with_global_padding) for several.
    pub fn new(tensors: Vec<Tensor>, index: usize, padding: usize, num_batches: usize) -> Self {
        Batch {
            tensors,
            index,
            padding,
            global_padding: padding,
            num_batches,
        }
    }

    /// Sets how many samples of the whole global batch (all ranks together) are padding.
    pub fn with_global_padding(mut self, global_padding: usize) -> Self {
        self.global_padding = global_padding;
        self
    }

    /// The batch number in the epoch (0-based).
    pub fn index(&self) -> usize {
        self.index
    }

    /// How many samples of this batch (on this rank) are padding duplicates.
    pub fn padding(&self) -> usize {
        self.padding
    }

    /// How many samples of this batch's global batch (this batch on every rank, concatenated in
    /// rank order) are padding duplicates. They sit at the global batch's tail, so dropping the last
    /// `global_padding()` rows of a gathered tensor counts every sample exactly once (what
    /// [`Accelerator::gather_for_metrics`](crate::Accelerator::gather_for_metrics) does). The same on
    /// every rank; non-zero only in the epoch's last global batch.
    pub fn global_padding(&self) -> usize {
        self.global_padding
    }

    /// The number of batches this rank yields in the epoch. From a
    /// [`StreamingLoader`](super::StreamingLoader), whose epoch length is unknown ahead, it is a
    /// lower bound (`index + 2`) until the last batch, where it is exact; [`is_last`](Self::is_last)
    /// is always exact.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Whether this is the epoch's last batch.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.num_batches
    }

    /// The tensors, one per field.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// Takes the tensors out.
    pub fn into_tensors(self) -> Vec<Tensor> {
        self.tensors
    }
}

impl Deref for Batch {
    type Target = [Tensor];

    fn deref(&self) -> &[Tensor] {
        &self.tensors
    }
}
