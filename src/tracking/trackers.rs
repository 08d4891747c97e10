//! [`Trackers`]: a set of trackers that logs on the main process only.

use std::path::Path;

use super::hparams::HParams;
use super::jsonl::JsonlTracker;
use super::tensorboard::TensorBoardTracker;
use super::tracker::Tracker;
use crate::error::Result;
use crate::settings::ProcessState;

/// A set of trackers; [`log`](Tracker::log) and [`flush`](Tracker::flush) fan out to every member.
///
/// A set made for a non-main process ([`Trackers::for_process`]`(false)`) is inert: adding to it
/// constructs nothing (the `jsonl`, `tensorboard` and [`add_with`](Trackers::add_with) builders
/// do not even create the tracker, so no file appears), and logging does nothing.
pub struct Trackers {
    active: bool,
    members: Vec<Box<dyn Tracker>>,
}

impl Default for Trackers {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Trackers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trackers")
            .field("active", &self.active)
            .field("members", &self.members.len())
            .finish()
    }
}

impl Trackers {
    /// An active, empty set (for a single-process program).
    pub fn new() -> Self {
        Self::for_process(true)
    }

    /// An empty set that is active only when `is_main` is true; pass
    /// [`Accelerator::is_main_process`](crate::Accelerator::is_main_process). See [`trackers`].
    pub fn for_process(is_main: bool) -> Self {
        Trackers {
            active: is_main,
            members: Vec::new(),
        }
    }

    /// Whether this set records anything (true on the main process).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// How many trackers the set holds (always 0 on a non-main process).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the set holds no tracker.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Adds a [`JsonlTracker`] writing to `path`; on a non-main process, does nothing.
    pub fn jsonl(self, path: impl AsRef<Path>) -> Result<Self> {
        self.add_with(|| JsonlTracker::create(path))
    }

    /// Adds a [`TensorBoardTracker`] writing an event file into `dir`; on a non-main process,
    /// does nothing.
    pub fn tensorboard(self, dir: impl AsRef<Path>) -> Result<Self> {
        self.add_with(|| TensorBoardTracker::create(dir))
    }

    /// Adds the tracker `make` builds; `make` is called on the main process only, so a tracker
    /// that creates files (or connects somewhere) does so only there.
    pub fn add_with<T, F>(mut self, make: F) -> Result<Self>
    where
        T: Tracker + 'static,
        F: FnOnce() -> Result<T>,
    {
        if self.active {
            self.members.push(Box::new(make()?));
        }
        Ok(self)
    }

    /// Adds an already built tracker. On a non-main process it is dropped unused; prefer
    /// [`add_with`](Trackers::add_with) there, so that it is not built at all.
    pub fn with_tracker(mut self, tracker: impl Tracker + 'static) -> Self {
        if self.active {
            self.members.push(Box::new(tracker));
        }
        self
    }
}

impl Trackers {
    /// Logs to every member (nothing on a non-main process); all are tried even if one fails,
    /// and the first error is returned. Same as [`Tracker::log`], without importing the trait.
    pub fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<()> {
        self.each(|t| t.log(metrics, step))
    }

    /// Flushes every member; all are tried even if one fails, and the first error is returned.
    /// Same as [`Tracker::flush`], without importing the trait.
    pub fn flush(&mut self) -> Result<()> {
        self.each(|t| t.flush())
    }

    /// Records the run's settings and hyperparameters with every member (nothing on a non-main
    /// process): once per run, e.g. `trackers.log_hparams(&HParams::of_run(&accelerator).set("lr",
    /// 3e-4))`. JSON Lines writes one `{"time":..,"hparams":{..}}` line, TensorBoard its hparams
    /// plugin's session-start record (the HPARAMS tab). Same as [`Tracker::log_hparams`].
    pub fn log_hparams(&mut self, hparams: &HParams) -> Result<()> {
        self.each(|t| t.log_hparams(hparams))
    }

    /// Calls `f` on every member; all are tried, the first error is returned.
    fn each(&mut self, mut f: impl FnMut(&mut dyn Tracker) -> Result<()>) -> Result<()> {
        let mut first = Ok(());
        for t in &mut self.members {
            if let Err(e) = f(t.as_mut()) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

impl Tracker for Trackers {
    fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<()> {
        Trackers::log(self, metrics, step)
    }

    fn flush(&mut self) -> Result<()> {
        Trackers::flush(self)
    }

    fn log_hparams(&mut self, hparams: &HParams) -> Result<()> {
        Trackers::log_hparams(self, hparams)
    }
}

/// An empty [`Trackers`] set for this process: active on the main process (rank 0), inert on every
/// other rank. Same as `Trackers::for_process(accelerator.is_main_process())`; takes
/// `&accelerator` (or its [`ProcessState`]).
pub fn trackers(run: impl AsRef<ProcessState>) -> Trackers {
    Trackers::for_process(run.as_ref().is_main_process())
}
