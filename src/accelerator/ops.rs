//! Collectives for users, as methods on [`Accelerator`] (Hugging Face Accelerate's names):
//!
//! | method | what every rank gets |
//! |---|---|
//! | [`gather`](Accelerator::gather) | all ranks' tensors concatenated on dim 0, in rank order |
//! | [`gather_for_metrics`](Accelerator::gather_for_metrics) | the same, without the padding duplicates of the last uneven batch |
//! | [`reduce`](Accelerator::reduce) | the element-wise sum, mean, max or min |
//! | [`broadcast`](Accelerator::broadcast) | the root's tensor |
//! | [`pad_across_processes`](Accelerator::pad_across_processes) | its tensor padded to the largest size across ranks |
//! | [`main_process_first`](Accelerator::main_process_first) | runs a closure after the main process ran it |
//! | [`split_between_processes`](Accelerator::split_between_processes) | its contiguous share of a list |
//! | [`set_seed`](Accelerator::set_seed) | seeded device RNG and an RNG identical on every rank |
//! | [`debug_shapes`](Accelerator::debug_shapes) | an error listing every rank's shape when they differ |
//!
//! Every method that communicates must be called by every rank, in the same order. With one
//! process they return at once without communicating. With `ACCELERATE_RS_DEBUG=1`
//! ([`env::DEBUG`](crate::env::DEBUG)) `gather`, `reduce` and `broadcast` first check the ranks'
//! shapes with [`debug_shapes`](Accelerator::debug_shapes) (one extra small collective each).
//!
//! ```
//! use accelerate_rs::{Accelerator, ReduceOp};
//! use candle_core::Tensor;
//! # fn main() -> accelerate_rs::Result<()> {
//! let acc = Accelerator::builder().rank(0).world_size(1).build()?;
//! let correct = Tensor::new(&[3f32], acc.device())?;
//! let total = acc.reduce(&correct, ReduceOp::Sum)?; // summed over ranks
//! assert_eq!(total.to_vec1::<f32>()?, vec![3.0]);
//! assert_eq!(acc.split_between_processes(&[1, 2, 3]), vec![1, 2, 3]);
//! # Ok(()) }
//! ```

use std::ops::Range;

use candle_core::{Device, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::Accelerator;
use crate::collective::{check_root, Buffer, ReduceOp};
use crate::data::Batch;
use crate::error::{Error, Result};

/// The contiguous range of `n` items that `rank` of `world` gets: sizes differ by at most 1, the
/// first `n % world` ranks get one more.
fn split_range(n: usize, rank: usize, world: usize) -> Range<usize> {
    let world = world.max(1);
    let (base, extra) = (n / world, n % world);
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start.min(n)..(start + len).min(n)
}

/// `"[2, 3] f32"`.
fn describe(t: &Tensor) -> String {
    format!("{:?} {}", t.dims(), t.dtype().as_str())
}

impl Accelerator {
    /// Gathers a small UTF-8 string from every rank, in rank order.
    fn gather_strings(&self, s: &str) -> Result<Vec<String>> {
        let parts = self.collective().all_gather(Buffer::from(s.as_bytes()))?;
        Ok(parts
            .iter()
            .map(|p| String::from_utf8_lossy(p.bytes()).into_owned())
            .collect())
    }

    /// Gathers every rank's `key` and fails, listing every rank's `shown`, unless the keys agree.
    fn check_across_ranks(&self, op: &str, key: &str, shown: &str) -> Result<()> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let all = self.gather_strings(&format!("{key}\n{shown}"))?;
        let split = |s: &str| -> (String, String) {
            match s.split_once('\n') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (s.to_string(), s.to_string()),
            }
        };
        let all: Vec<(String, String)> = all.iter().map(|s| split(s)).collect();
        if all.iter().all(|(k, _)| k == key) {
            return Ok(());
        }
        let detail = all
            .iter()
            .enumerate()
            .map(|(r, (_, v))| format!("rank {r}: {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        Err(Error::Mismatch {
            rank: self.rank(),
            op: op.to_string(),
            detail,
        })
    }

    /// Checks that every rank passes a tensor of the same shape and dtype to the collective `op`;
    /// otherwise every rank gets [`Error::Mismatch`] listing every rank's shape, e.g.
    /// `rank 0: [2, 3] f32, rank 1: [2, 4] f32`. Every rank must call it (one small all-gather).
    ///
    /// `gather`, `reduce` and `broadcast` call it themselves when `ACCELERATE_RS_DEBUG=1` (for
    /// `gather`, the first dim may differ).
    pub fn debug_shapes(&self, op: &str, t: &Tensor) -> Result<()> {
        let shown = describe(t);
        self.check_across_ranks(op, &shown, &shown)
    }

    /// The debug-mode check of `gather`: all dims but the first, and the dtype.
    fn debug_gather_shapes(&self, t: &Tensor) -> Result<()> {
        let dims = t.dims();
        let key = format!(
            "{} {:?} {}",
            dims.len(),
            dims.get(1..).unwrap_or(&[]),
            t.dtype().as_str()
        );
        self.check_across_ranks("gather", &key, &describe(t))
    }

    /// Every rank's `t` concatenated on dim 0, in rank order, on every rank. The first dims may
    /// differ between ranks; the other dims and the dtype must match (the error lists every rank's
    /// shape otherwise). A scalar is gathered as `[1]`, giving `[world_size]`.
    pub fn gather(&self, t: &Tensor) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let t = if t.rank() == 0 {
            t.reshape(1)?
        } else {
            t.clone()
        };
        if self.state().debug() {
            self.debug_gather_shapes(&t)?;
        }
        self.collective().all_gather_tensor(&t)
    }

    /// [`gather`](Self::gather) for evaluation: drops the padding duplicates of the epoch's last
    /// uneven batch so that, over an epoch, every sample is counted exactly once.
    ///
    /// `t`'s dim 0 must be `batch`'s samples (e.g. predictions or labels of that batch). The
    /// loader pads the last global batch at its tail, so this drops the last
    /// [`batch.global_padding()`](Batch::global_padding) rows of the gathered tensor (none except in
    /// the last batch). A scalar is gathered to `[world_size]` and nothing is dropped.
    pub fn gather_for_metrics(&self, t: &Tensor, batch: &Batch) -> Result<Tensor> {
        let scalar = t.rank() == 0;
        let all = self.gather(t)?;
        let pad = batch.global_padding();
        if scalar || pad == 0 {
            return Ok(all);
        }
        let rows = all.dim(0)?;
        if pad > rows {
            return Err(Error::invalid(
                "gather_for_metrics tensor",
                format!(
                    "rank {}: gather_for_metrics: the gathered tensor has {rows} rows but batch {} holds {pad} padding samples across ranks; dim 0 must be the batch's samples",
                    self.rank(),
                    batch.index()
                ),
            ));
        }
        Ok(all.narrow(0, 0, rows - pad)?)
    }

    /// The element-wise sum, mean, max or min of every rank's `t`, on every rank (same shape and dtype
    /// everywhere; `u8`, `f16`, `bf16`, `f32`, `f64`).
    pub fn reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        if self.state().debug() {
            self.debug_shapes("reduce", t)?;
        }
        self.collective().all_reduce_tensor(t, op)
    }

    /// `root`'s `t` on every rank (same shape and dtype everywhere).
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        check_root(root, self.world_size(), self.rank())?;
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        if self.state().debug() {
            self.debug_shapes("broadcast", t)?;
        }
        self.collective().broadcast_tensor(t, root)
    }

    /// Pads dim `dim` of `t` with `pad_value` up to the largest size of that dim across ranks (at
    /// the end, or at the start with `pad_first`), so that tensors of different lengths (e.g.
    /// generated sequences) can then be [`gather`](Self::gather)ed. Every rank must pass a tensor
    /// with the same number of dims.
    pub fn pad_across_processes(
        &self,
        t: &Tensor,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        const OP: &str = "pad_across_processes";
        let ndims = t.rank();
        if self.world_size() == 1 {
            if dim >= ndims {
                return Err(Error::invalid(
                    "pad_across_processes dim",
                    format!(
                        "rank {}: {OP}: dim {dim} is out of range for a tensor of shape {:?}",
                        self.rank(),
                        t.dims()
                    ),
                ));
            }
            return Ok(t.clone());
        }
        // Every rank learns every rank's number of dims and size of `dim` before any fails, so
        // that they all fail together instead of leaving the others waiting.
        let size = t.dims().get(dim).copied();
        let mut meta = Vec::with_capacity(17);
        meta.push(u8::from(size.is_some()));
        meta.extend_from_slice(&(ndims as u64).to_le_bytes());
        meta.extend_from_slice(&(size.unwrap_or(0) as u64).to_le_bytes());
        let all = self.collective().all_gather(Buffer::from(&meta[..]))?;
        let read = |b: &[u8], at: usize| -> u64 {
            b.get(at..at + 8)
                .and_then(|s| s.try_into().ok())
                .map_or(0, u64::from_le_bytes)
        };
        let metas: Vec<(bool, u64, u64)> = all
            .iter()
            .map(|p| {
                let b = p.bytes();
                (b.first() == Some(&1), read(b, 1), read(b, 9))
            })
            .collect();
        if metas.iter().any(|&(ok, n, _)| !ok || n != ndims as u64) {
            let detail = metas
                .iter()
                .enumerate()
                .map(|(r, (ok, n, _))| {
                    let note = if *ok { "" } else { " (dim out of range)" };
                    format!("rank {r}: {n} dims{note}")
                })
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::Mismatch {
                rank: self.rank(),
                op: OP.to_string(),
                detail: format!(
                    "dim {dim} must exist on every rank with the same number of dims; got {detail}"
                ),
            });
        }
        let max = metas.iter().map(|m| m.2).max().unwrap_or(0) as usize;
        let own = size.unwrap_or(0);
        if max <= own {
            return Ok(t.clone());
        }
        let mut dims = t.dims().to_vec();
        dims[dim] = max - own;
        let pad = Tensor::full(pad_value, dims, t.device())?.to_dtype(t.dtype())?;
        let parts = if pad_first { [&pad, t] } else { [t, &pad] };
        Ok(Tensor::cat(&parts, dim)?)
    }

    /// Runs `f` on the main process first and on the other ranks once the main process has
    /// finished it (Accelerate's `main_process_first`): e.g. the main process downloads or
    /// preprocesses a dataset into a cache, the others then read the cache. One barrier, called by
    /// every rank: the main process after `f`, the others before it. A failing barrier (a rank gone,
    /// the timeout) is returned as the error; `f` is then not run on the non-main ranks.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        self.first(self.is_main_process(), f)
    }

    /// Like [`main_process_first`](Self::main_process_first), once per machine: local rank 0 runs
    /// `f` first, then the other ranks. The barrier spans all ranks, so every machine's other ranks
    /// wait for every machine's local main process.
    pub fn local_main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        self.first(self.is_local_main_process(), f)
    }

    fn first<R>(&self, leader: bool, f: impl FnOnce() -> R) -> Result<R> {
        if self.world_size() == 1 {
            return Ok(f());
        }
        if leader {
            let r = f();
            self.wait_for_everyone()?;
            Ok(r)
        } else {
            self.wait_for_everyone()?;
            Ok(f())
        }
    }

    /// This rank's contiguous share of `items`: shares follow rank order and their sizes differ by
    /// at most 1 (the first `len % world_size` ranks get one more). Concatenating every rank's share
    /// in rank order gives `items` back. Needs no communication.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items[split_range(items.len(), self.rank(), self.world_size())].to_vec()
    }

    /// The mean of `x` over all ranks, on every rank (every rank must call it): e.g. the loss
    /// each rank measured on its own batches, so the number printed is the run's, not rank 0's.
    /// With one process it is `x`.
    pub fn average(&self, x: impl Into<f64>) -> Result<f64> {
        let mut v = [x.into()];
        self.inner
            .collective
            .all_reduce((&mut v[..]).into(), ReduceOp::Mean)?;
        Ok(v[0])
    }

    /// The per-rank batch size for a global batch of `global` samples, for a loop that slices
    /// its own batches: `global / world_size` (at least 1), so that one step of all ranks
    /// together sees `global` samples, as one process with batch `global` does.
    ///
    /// When `global` does not divide by the number of processes (50 on 3 processes), a step
    /// sees fewer samples (48) and every epoch leaves more rows out than one process does: the
    /// main process warns once, with the sizes and what to do.
    ///
    /// ```
    /// # fn main() -> accelerate_rs::Result<()> {
    /// let acc = accelerate_rs::Accelerator::builder().cpu(true).build()?;
    /// let bs = acc.local_batch_size(64); // 64 on 1 process, 32 on 2, 16 on 4
    /// # assert_eq!(bs, 64);
    /// # Ok(()) }
    /// ```
    pub fn local_batch_size(&self, global: usize) -> usize {
        let w = self.world_size().max(1);
        let local = (global / w).max(1);
        if local * w != global && self.is_main_process() {
            warn_once(format!(
                "local_batch_size: the global batch of {global} does not divide by {w} processes: every rank takes {local} per step, so a step sees {} samples instead of {global}, and the rows past each rank's last full batch of {local} are dropped every epoch; pick a global batch that divides by {w} (e.g. {} or {}) or a number of processes that divides {global}",
                local * w,
                global / w * w,
                global.div_ceil(w) * w,
            ));
        }
        local
    }

    /// This rank's share of the indices `range`, for a loop that slices its own batches: every
    /// `world_size`-th index starting at this rank's (rank `r` takes `start + r`,
    /// `start + r + w`, ...), and the same count on every rank (`len / world_size`; the last
    /// `len % world_size` indices are left out, so every rank runs the same number of steps).
    /// Batch `i` of `bs` of this share, on every rank together, is batch `i` of `bs *
    /// world_size` of the whole range: the same samples, so a run on `N` processes with a
    /// per-rank batch `bs` follows the 1-process run with batch `bs * N`. Needs no communication.
    pub fn shard_range(&self, range: Range<usize>) -> std::iter::StepBy<Range<usize>> {
        let w = self.world_size().max(1);
        let usable = range.len() / w * w;
        (range.start + self.rank()..range.start + usable).step_by(w)
    }

    /// This rank's share of the rows (dim 0) of `t`, as [`shard_range`](Self::shard_range)
    /// picks them: rows `r, r + w, r + 2w, ...` (a copy), `rows / world_size` of them on every
    /// rank. One line turns a loop that slices `x.narrow(0, i * bs, bs)` itself into a
    /// data-parallel one: `let x = accelerator.shard_rows(&x)?;`. With one process it is `t`.
    ///
    /// When the rows do not divide by the number of processes, the main process warns once
    /// (naming the sizes) that the last `rows % world_size` rows are left out of every epoch.
    pub fn shard_rows(&self, t: &Tensor) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let n = t.dim(0)?;
        let w = self.world_size();
        if !n.is_multiple_of(w) && self.is_main_process() {
            warn_once(format!(
                "shard_rows: {n} rows do not divide by {w} processes: every rank takes {} rows and the last {} row(s) are left out of every epoch (use a row count that divides by {w}, or a DataLoader prepared with `accelerator.prepare`, which pads instead of dropping)",
                n / w,
                n % w
            ));
        }
        let idx: Vec<u32> = self
            .shard_range(0..n)
            .map(|i| {
                u32::try_from(i).map_err(|_| {
                    Error::invalid("shard_rows", format!("{n} rows is more than 2^32"))
                })
            })
            .collect::<Result<_>>()?;
        let idx = Tensor::from_vec(idx, self.shard_range(0..n).len(), t.device())?;
        Ok(t.index_select(&idx, 0)?)
    }

    /// Like [`split_between_processes`](Self::split_between_processes), but every rank gets the
    /// same count, `ceil(len / world_size)`: a shorter share is padded by repeating its last item
    /// (or the last item of `items` when the share is empty). Returns the share and how many of it,
    /// at its end, are padding (drop those after gathering results). Empty `items` give an empty
    /// share everywhere.
    pub fn split_between_processes_padded<T: Clone>(&self, items: &[T]) -> (Vec<T>, usize) {
        let world = self.world_size().max(1);
        let mut share = self.split_between_processes(items);
        let want = items.len().div_ceil(world);
        let pad = want - share.len();
        if let Some(last) = share.last().or(items.last()).cloned() {
            share.extend(std::iter::repeat_n(last, pad));
            (share, pad)
        } else {
            (share, 0)
        }
    }

    /// Seeds what can be seeded, with the same `seed` on every rank, and returns a
    /// [`ChaCha8Rng`] seeded from `seed` for your own initialisation: the same stream on every rank.
    ///
    /// - CUDA (and Metal): the device RNG behind `Tensor::randn`/`rand` is seeded with `seed`.
    /// - CPU: Candle's CPU RNG cannot be seeded, so `Tensor::randn` on the CPU differs from run to
    ///   run and between ranks; draw from the returned RNG instead (or rely on
    ///   [`prepare`](Self::prepare), which gives every rank rank 0's parameters).
    /// - [`nn::dropout`](crate::nn::dropout)'s stream on the calling thread
    ///   ([`nn::set_dropout_seed`](crate::nn::set_dropout_seed)): the same masks on every run.
    /// - Model weights: [`var_builder`](Self::var_builder) draws every new variable from
    ///   `(seed, its name)`, so the same seed gives the same initial weights on any device and
    ///   at any world size.
    ///
    /// It does not change the data order: the loader's shuffle is seeded by
    /// [`DataLoader::seed`](crate::DataLoader::seed), and a different order each epoch comes only
    /// from [`DataLoader::set_epoch`](crate::DataLoader::set_epoch).
    pub fn set_seed(&self, seed: u64) -> Result<ChaCha8Rng> {
        self.inner
            .seed
            .store(seed, std::sync::atomic::Ordering::Relaxed);
        let device = self.device();
        if !matches!(device, Device::Cpu) {
            device.set_seed(seed).map_err(|e| {
                Error::invalid(
                    "seed",
                    format!(
                        "rank {}: set_seed: seeding {:?} failed: {e}",
                        self.rank(),
                        device.location()
                    ),
                )
            })?;
        }
        crate::nn::set_dropout_seed(seed);
        Ok(ChaCha8Rng::seed_from_u64(seed))
    }
}

/// Prints `msg` as a warning the first time it is seen in this process.
fn warn_once(msg: String) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.contains(&msg) {
        crate::logging::warn_always(format_args!("{msg}"));
        seen.push(msg);
    }
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn split_range_covers_items_in_order() {
        for world in 1..6 {
            for n in 0..13 {
                let mut next = 0;
                for r in 0..world {
                    let range = split_range(n, r, world);
                    assert_eq!(range.start, next);
                    assert!(range.len() == n / world || range.len() == n / world + 1);
                    next = range.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
