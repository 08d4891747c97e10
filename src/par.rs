//! Rayon loops that stay on the calling thread when Rayon's pool has one thread.
//!
//! The launcher gives each of N processes on a machine `RAYON_NUM_THREADS` = cores / N, so on a
//! machine with as many processes as cores every pool has one thread. A parallel loop called
//! from a thread outside the pool (the training loop's own) then still hands its work to that
//! one pool thread and sleeps until it is done: two wake-ups per op, and the data the op reads
//! was written on another core whenever the scheduler put the pool thread there. Unsplit, the
//! loop runs where it was called, the same work in the same order: 1-4% of a Qwen3 CPU training
//! step with two processes on two cores, 0-2% with one (BENCHMARKS.md, "Kernels on the caller's
//! thread").

use rayon::iter::{IndexedParallelIterator, MinLen};

/// The least number of items a Rayon job takes: all of them when the pool has one thread (no
/// split, so the loop runs on the calling thread), else one (Rayon's default).
fn min_len() -> usize {
    if rayon::current_num_threads() > 1 {
        1
    } else {
        usize::MAX
    }
}

/// [`inline_when_single`](Inline::inline_when_single) for every indexed parallel iterator.
pub(crate) trait Inline: IndexedParallelIterator + Sized {
    /// This iterator, split as usual when Rayon's pool has several threads and not at all when it
    /// has one: then it runs on the calling thread, never handed to the pool.
    fn inline_when_single(self) -> MinLen<Self> {
        self.with_min_len(min_len())
    }
}

impl<I: IndexedParallelIterator> Inline for I {}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;
    use std::thread::{self, ThreadId};

    /// The threads that ran the 64 items of a loop called from a fresh thread outside any pool,
    /// split at `min` items, and that fresh thread.
    fn threads_of_a_loop(min: usize) -> (Vec<ThreadId>, Option<ThreadId>) {
        thread::scope(|s| {
            s.spawn(|| {
                let ran: Vec<ThreadId> = (0..64)
                    .into_par_iter()
                    .with_min_len(min)
                    .map(|_| thread::current().id())
                    .collect();
                (ran, Some(thread::current().id()))
            })
            .join()
            .unwrap_or_default()
        })
    }

    #[test]
    fn an_unsplit_loop_runs_on_the_calling_thread_and_only_a_one_thread_pool_asks_for_it() {
        let (unsplit, caller) = threads_of_a_loop(usize::MAX);
        assert_eq!(unsplit.len(), 64);
        assert!(unsplit.iter().all(|t| Some(*t) == caller));
        // Rayon's default: the loop is handed to the pool, its caller waits.
        let (split, caller) = threads_of_a_loop(1);
        assert!(split.iter().all(|t| Some(*t) != caller));
        let pool = |n| rayon::ThreadPoolBuilder::new().num_threads(n).build();
        let (Ok(one), Ok(two)) = (pool(1), pool(2)) else {
            panic!("cannot build a thread pool");
        };
        assert_eq!(one.install(min_len), usize::MAX);
        assert_eq!(two.install(min_len), 1);
    }
}
