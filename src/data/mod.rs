//! Data loading: the [`Dataset`] trait, the in-memory [`TensorDataset`], the per-rank batch plan
//! ([`DistributedSampler`], with custom [`Sampler`]s such as [`WeightedSampler`] and
//! [`LengthGroupedSampler`]) and the [`DataLoader`] that turns them into batches on a device, with
//! background workers; and for streams without random access (text files, a directory of
//! shards), the [`IterableDataset`] trait, [`TextLines`] and the [`StreamingLoader`], resumable at
//! a [`SamplePosition`] counted in global samples.
//!
//! The batch size is per process unless `split_batches` is set: with `N` processes a global
//! batch holds `N * batch_size` samples.
//!
//! Every rank yields the same number of batches; with [`EvenBatches::Pad`] (the default) the last
//! global batch is padded by cycling from the start of the epoch's order, and the padding always
//! sits at the global tail, so dropping the last [`DataLoader::total_padding`] rows of a gathered
//! last batch recovers exactly the dataset.

mod batch;
mod dataset;
mod geometry;
mod iter;
mod loader;
mod sampler;
mod samplers;
mod stream;
mod threads;

pub use batch::Batch;
pub use dataset::{Dataset, TensorDataset};
pub use geometry::EvenBatches;
pub use iter::BatchIter;
pub use loader::DataLoader;
pub use sampler::{DistributedSampler, Sampler};
pub use samplers::{LengthGroupedSampler, WeightedSampler};
pub use stream::{
    IterableDataset, RecordStream, SamplePosition, StreamIter, StreamingLoader, TextLine, TextLines,
};
