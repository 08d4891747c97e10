//! Data loading: the [`Dataset`] trait, the in-memory [`TensorDataset`], the per-rank batch plan
//! ([`DistributedSampler`]) and the [`DataLoader`] that turns them into batches on a device, with
//! background prefetching.
//!
//! Every rank yields the same number of batches; with [`EvenBatches::Pad`] (the default) the last
//! global batch is padded by cycling from the start of the epoch's order, and the padding always
//! sits at the global tail, so dropping the last [`DataLoader::total_padding`] rows of a gathered
//! last batch recovers exactly the dataset.

mod batch;
mod dataset;
mod iter;
mod loader;
mod sampler;
mod samplers;

pub use batch::Batch;
pub use dataset::{Dataset, TensorDataset};
pub use iter::BatchIter;
pub use loader::DataLoader;
pub use sampler::{DistributedSampler, EvenBatches, Sampler};
pub use samplers::{LengthGroupedSampler, WeightedSampler};
