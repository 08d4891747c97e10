//! [`Threads`]: background threads that each feed a channel, stopped and joined when dropped
//! (the [`DataLoader`](super::DataLoader)'s workers, the
//! [`StreamingLoader`](super::StreamingLoader)'s reader and decoders).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::error::{Error, Result};

/// Threads, the channels they fill (`receivers[k]` is fed by the `k`-th thread started with
/// one) and the flag that asks them to stop. Dropping it sets the flag, closes the channels
/// (waking threads blocked on a full one) and joins every thread.
pub(super) struct Threads<T> {
    receivers: Vec<Receiver<T>>,
    stop: Arc<AtomicBool>,
    handles: Vec<JoinHandle<()>>,
    /// What the threads are, for errors and the warning about a panicked one.
    what: &'static str,
}

impl<T> Threads<T> {
    /// No threads yet; `what` names them ("data loader worker").
    pub(super) fn new(what: &'static str) -> Self {
        Threads {
            receivers: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            handles: Vec::new(),
            what,
        }
    }

    /// The flag a thread checks between items: set when the iterator is dropped.
    pub(super) fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// Starts thread `name` running `body`, which feeds `receiver`'s channel (if any). On an
    /// error, the threads started so far are stopped when `self` is dropped.
    pub(super) fn spawn(
        &mut self,
        name: String,
        receiver: Option<Receiver<T>>,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(body)
            .map_err(|e| {
                Error::data(format!("could not start {} thread {name}: {e}", self.what))
            })?;
        self.handles.push(handle);
        self.receivers.extend(receiver);
        Ok(())
    }

    /// The number of channels.
    pub(super) fn channels(&self) -> usize {
        self.receivers.len()
    }

    /// The next item of channel `k`; `None` if there is no such channel or its thread is gone
    /// (it panicked, or stopped without sending).
    pub(super) fn recv(&self, k: usize) -> Option<T> {
        self.receivers.get(k)?.recv().ok()
    }
}

impl<T> Drop for Threads<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.receivers.clear();
        for handle in self.handles.drain(..) {
            if handle.join().is_err() {
                log::warn!("a {} thread panicked", self.what);
            }
        }
    }
}
