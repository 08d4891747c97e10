//! Reads of tensors into host memory on the training path, counted. On a GPU each one waits for
//! the device to finish the work queued before it (a host synchronization), so the library keeps
//! them few, known and documented (ARCHITECTURE.md, "Host reads per step"): every such read the
//! library makes goes through [`counted`], and [`host_reads`] tells how many happened so far in
//! this process, on any device (on the CPU a read costs nothing, but the count is the same, so
//! the CPU tests hold the GPU path to its budget).

use std::sync::atomic::{AtomicU64, Ordering};

static READS: AtomicU64 = AtomicU64::new(0);

/// How many tensor reads into host memory the library has made in this process (every device,
/// every thread): take the difference around a training step to count that step's host
/// synchronizations. Reads made by user code (`loss.to_scalar()`) are not counted.
pub fn host_reads() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// Counts one read made elsewhere (the GPU path of a function whose CPU path reads host memory
/// directly, counted the same so that the CPU tests hold the GPU path to its budget).
pub(crate) fn note() {
    READS.fetch_add(1, Ordering::Relaxed);
}

/// Runs the read `f`, counting it.
pub(crate) fn counted<T>(f: impl FnOnce() -> candle_core::Result<T>) -> candle_core::Result<T> {
    READS.fetch_add(1, Ordering::Relaxed);
    f()
}
