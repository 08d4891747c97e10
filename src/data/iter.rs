//! [`BatchIter`]: the iterator over one epoch of a [`DataLoader`](super::DataLoader), synchronous
//! or with a background prefetch thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use candle_core::{Device, Tensor};

use super::{Batch, Dataset};
use crate::{Error, Result};

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
/// With prefetching, a background thread builds batches ahead; dropping the iterator stops it
/// (waiting at most for the batch it is building).
pub struct BatchIter {
    inner: Inner,
    next_index: usize,
    num_batches: usize,
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
    receiver: Option<Receiver<Result<Batch>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Closing the channel wakes a producer blocked on a full channel.
        drop(self.receiver.take());
        if let Some(handle) = self.handle.take() {
            if handle.join().is_err() {
                log::warn!("data loader prefetch thread panicked");
            }
        }
    }
}

impl BatchIter {
    /// The iterator over `plans`, skipping the first `first` batches (indices keep counting from
    /// 0, so the first batch yielded has index `first`).
    pub(crate) fn starting_at(
        dataset: Arc<dyn Dataset>,
        device: Device,
        plans: Vec<BatchPlan>,
        prefetch: usize,
        first: usize,
    ) -> Result<Self> {
        let num_batches = plans.len();
        let first = first.min(num_batches);
        let inner = if prefetch == 0 || num_batches == first {
            Inner::Sync {
                dataset,
                device,
                plans,
            }
        } else {
            let (sender, receiver) = sync_channel(prefetch);
            let stop = Arc::new(AtomicBool::new(false));
            let stop_flag = Arc::clone(&stop);
            let handle = std::thread::Builder::new()
                .name("accelerate-data-prefetch".into())
                .spawn(move || {
                    for (index, plan) in plans.iter().enumerate().skip(first) {
                        if stop_flag.load(Ordering::Relaxed) {
                            return;
                        }
                        let item = build(dataset.as_ref(), &device, plan, index, num_batches);
                        let failed = item.is_err();
                        if sender.send(item).is_err() || failed {
                            // The iterator is gone, or the epoch ends with this error.
                            return;
                        }
                    }
                })
                .map_err(|e| Error::data(format!("could not start the prefetch thread: {e}")))?;
            log::debug!("data loader: prefetching {prefetch} of {num_batches} batches");
            Inner::Prefetch(Prefetcher {
                receiver: Some(receiver),
                stop,
                handle: Some(handle),
            })
        };
        Ok(BatchIter {
            inner,
            next_index: first,
            num_batches,
            done: false,
        })
    }

    /// The number of batches in the epoch.
    pub fn num_batches(&self) -> usize {
        self.num_batches
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
                index,
                self.num_batches,
            ),
            Inner::Prefetch(p) => match p.receiver.as_ref().map(|r| r.recv()) {
                Some(Ok(item)) => item,
                _ => Err(Error::data(format!(
                    "the prefetch thread stopped before batch {index} of {} (it panicked)",
                    self.num_batches
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
