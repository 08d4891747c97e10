//! [`Accelerator::find_executable_batch_size`]: retrying a training closure with smaller batches
//! when a device runs out of memory, every rank agreeing (the protocol is documented in
//! `src/train/batch_size.rs` and on [`BatchSizeSearch`]).

use super::Accelerator;
use crate::error::Result;
use crate::train::batch_size::{BatchSizeSearch, Searcher};

impl Accelerator {
    /// Hugging Face Accelerate's `find_executable_batch_size`: runs `f(batch_size)` from
    /// `start`, and when it fails with [`Error::OutOfMemory`](crate::Error::OutOfMemory) on any
    /// rank, runs it again on every rank with half the size, in the same processes, until it
    /// succeeds. Returns what `f` returned.
    ///
    /// Build the model, optimizer and loader inside `f` (so each attempt starts afresh) and
    /// return errors with `?`. Other ranks learn of a rank's failure from their next
    /// collective, which returns [`Error::PeerOutOfMemory`](crate::Error::PeerOutOfMemory):
    /// nobody waits for the failed rank. Every rank must call it with the same `start`.
    /// Running out of memory is retried during the first
    /// [`BatchSizeSearch::DEFAULT_PROBE_STEPS`] optimizer sync steps of
    /// each attempt and is fatal afterwards (see [`BatchSizeSearch`] for the options and the
    /// protocol). Below batch size 1 the search fails with
    /// [`Error::NoExecutableBatchSize`](crate::Error::NoExecutableBatchSize).
    ///
    /// ```
    /// use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
    /// use candle_core::{DType, Module, Tensor};
    /// use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};
    ///
    /// # fn main() -> accelerate_rs::Result<()> {
    /// let accelerator = Accelerator::builder().rank(0).world_size(1).build()?;
    /// let device = accelerator.device().clone();
    /// let x = Tensor::randn(0f32, 1.0, (64, 4), &device)?;
    /// let y = x.sum_keepdim(1)?;
    /// let used = accelerator.find_executable_batch_size(32, |batch_size| {
    ///     let varmap = VarMap::new();
    ///     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    ///     let model = linear(4, 1, vb.pp("fc"))?;
    ///     let opt = SGD::new(varmap.all_vars(), 0.05)?;
    ///     let loader = DataLoader::new(TensorDataset::new(vec![x.clone(), y.clone()])?, batch_size);
    ///     let (mut opt, loader) = accelerator.prepare(&varmap, opt, loader)?;
    ///     for batch in loader.iter()? {
    ///         let batch = batch?;
    ///         opt.backward_step(&loss::mse(&model.forward(&batch[0])?, &batch[1])?)?;
    ///     }
    ///     Ok(batch_size)
    /// })?;
    /// assert_eq!(used, 32);
    /// # Ok(()) }
    /// ```
    pub fn find_executable_batch_size<T>(
        &self,
        start: usize,
        f: impl FnMut(usize) -> Result<T>,
    ) -> Result<T> {
        self.find_executable_batch_size_with(BatchSizeSearch::new(start), f)
    }

    /// [`find_executable_batch_size`](Self::find_executable_batch_size) with options: the
    /// smallest size to try, and how long each attempt probes.
    pub fn find_executable_batch_size_with<T>(
        &self,
        search: BatchSizeSearch,
        f: impl FnMut(usize) -> Result<T>,
    ) -> Result<T> {
        let grads = &self.inner.grads;
        let before = grads.registration();
        let restart = move || grads.restart(before.clone());
        Searcher {
            probe: &self.inner.probe,
            device: self.device(),
            restart: &restart,
        }
        .run(search, f)
    }
}
