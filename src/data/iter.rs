//! [`BatchIter`]: the iterator over one epoch of a [`DataLoader`](super::DataLoader), synchronous
//! or with background worker threads.

use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::threads::Threads;
use super::{Batch, Dataset};
use crate::error::{Error, Result};

/// One planned batch: its dataset indices, how many of them are padding, and how many samples of
/// its global batch (all ranks) are padding.
#[derive(Debug, Clone)]
pub(crate) struct BatchPlan {
    pub(crate) indices: Vec<usize>,
    pub(crate) padding: usize,
    pub(crate) global_padding: usize,
}

/// Builds one batch on `device`.
fn build(
    dataset: &dyn Dataset,
    device: &Device,
    plan: &BatchPlan,
    index: usize,
    num_batches: usize,
) -> Result<Batch> {
    let tensors = dataset.get_batch(&plan.indices)?;
    let tensors = tensors
        .iter()
        .map(|t| t.to_device(device))
        .collect::<candle_core::Result<Vec<Tensor>>>()?;
    Ok(Batch::new(tensors, index, plan.padding, num_batches)
        .with_global_padding(plan.global_padding))
}

/// The iterator over one epoch of batches. Yields `Err` at most once, and then ends.
///
/// With prefetching, background worker threads build batches ahead: with `n` workers, worker `k`
/// builds the batches `k, k + n, k + 2n, ...` and the iterator takes them from the workers in
/// turn, so the order is the plan's whatever the number of workers. Dropping the iterator stops
/// them (waiting at most for the batches they are building).
pub struct BatchIter {
    inner: Inner,
    next_index: usize,
    num_batches: usize,
    /// Added to the plan's batch numbers in the yielded batches (batches before a resume point).
    offset: usize,
    done: bool,
}

enum Inner {
    Sync {
        dataset: Arc<dyn Dataset>,
        device: Device,
        plans: Vec<BatchPlan>,
    },
    Prefetch(Prefetcher),
}

struct Prefetcher {
    /// One channel per worker; batch `first + j` comes from worker `j % workers`.
    threads: Threads<Result<Batch>>,
    first: usize,
}

impl Prefetcher {
    /// Starts `workers` threads building the batches from `first` on, each with a channel of
    /// `capacity` batches.
    fn start(
        dataset: Arc<dyn Dataset>,
        device: Device,
        plans: Vec<BatchPlan>,
        workers: usize,
        capacity: usize,
        first: usize,
        offset: usize,
    ) -> Result<Self> {
        let num_batches = plans.len();
        let plans = Arc::new(plans);
        let mut threads = Threads::new("data loader worker");
        for worker in 0..workers {
            let (sender, receiver) = sync_channel(capacity);
            let (dataset, device, plans) =
                (Arc::clone(&dataset), device.clone(), Arc::clone(&plans));
            let stop = threads.stop_flag();
            // On an error, dropping `threads` stops and joins the workers started so far.
            threads.spawn(
                format!("accelerate-data-worker-{worker}"),
                Some(receiver),
                move || {
                    for index in (first + worker..num_batches).step_by(workers) {
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        let item = build(
                            dataset.as_ref(),
                            &device,
                            &plans[index],
                            index + offset,
                            num_batches + offset,
                        );
                        let failed = item.is_err();
                        if sender.send(item).is_err() || failed {
                            // The iterator is gone, or the epoch ends with this error.
                            return;
                        }
                    }
                },
            )?;
        }
        Ok(Prefetcher { threads, first })
    }

    /// Receives batch `index` from the worker that builds it.
    fn recv(&self, index: usize) -> Option<Result<Batch>> {
        let workers = self.threads.channels().max(1);
        self.threads
            .recv(index.saturating_sub(self.first) % workers)
    }
}

impl BatchIter {
    /// The iterator over `plans`, skipping the first `first` batches (indices keep counting from
    /// 0, so the first batch yielded has index `first`). With `prefetch == 0` or `workers == 0`
    /// the batches are built in `next`; otherwise `workers` threads build them, each holding up
    /// to `ceil(prefetch / workers)` (at least 1) finished batches.
    pub(crate) fn starting_at(
        dataset: Arc<dyn Dataset>,
        device: Device,
        plans: Vec<BatchPlan>,
        prefetch: usize,
        workers: usize,
        first: usize,
        offset: usize,
    ) -> Result<Self> {
        let num_batches = plans.len();
        let first = first.min(num_batches);
        let inner = if prefetch == 0 || workers == 0 || num_batches == first {
            Inner::Sync {
                dataset,
                device,
                plans,
            }
        } else {
            // More workers than batches would idle.
            let workers = workers.min(num_batches - first);
            let capacity = prefetch.div_ceil(workers).max(1);
            log::debug!(
                "data loader: {workers} worker(s) prefetching {capacity} each of {num_batches} batches"
            );
            Inner::Prefetch(Prefetcher::start(
                dataset, device, plans, workers, capacity, first, offset,
            )?)
        };
        Ok(BatchIter {
            inner,
            next_index: first,
            num_batches,
            offset,
            done: false,
        })
    }

    /// The number of batches in the epoch (counting those before a resume point).
    pub fn num_batches(&self) -> usize {
        self.num_batches + self.offset
    }

    fn remaining(&self) -> usize {
        if self.done {
            0
        } else {
            self.num_batches - self.next_index
        }
    }
}

impl Iterator for BatchIter {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.done || self.next_index >= self.num_batches {
            self.done = true;
            return None;
        }
        let index = self.next_index;
        let item = match &mut self.inner {
            Inner::Sync {
                dataset,
                device,
                plans,
            } => build(
                dataset.as_ref(),
                device,
                &plans[index],
                index + self.offset,
                self.num_batches + self.offset,
            ),
            Inner::Prefetch(p) => match p.recv(index) {
                Some(item) => item,
                None => Err(Error::data(format!(
                    "the data loader worker thread building batch {} of {} stopped \
                     (it panicked)",
                    index + self.offset,
                    self.num_batches + self.offset
                ))),
            },
        };
        self.next_index += 1;
        if item.is_err() {
            self.done = true;
        }
        Some(item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.remaining();
        (n, Some(n))
    }
}

/// Exact unless an error ends the epoch early (the error is the last item).
impl ExactSizeIterator for BatchIter {}

impl std::fmt::Debug for BatchIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchIter")
            .field("next_index", &self.next_index)
            .field("num_batches", &self.num_batches)
            .field("prefetch", &matches!(self.inner, Inner::Prefetch(_)))
            .field("done", &self.done)
            .finish()
    }
}
