//! The [`Tracker`] trait, and what every tracker shares (the clock, creating its folder).

use std::path::Path;

use super::hparams::HParams;
use crate::error::Result;

/// Something that records scalar metrics against a training step.
pub trait Tracker: Send {
    /// Records `metrics` (name, value) for `step`.
    fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<()>;

    /// Pushes everything recorded so far to durable storage.
    fn flush(&mut self) -> Result<()>;

    /// Records the run's settings and hyperparameters, once per run (see [`HParams`]). The
    /// default records nothing: a tracker that has no place for them may leave it out.
    fn log_hparams(&mut self, hparams: &HParams) -> Result<()> {
        let _ = hparams;
        Ok(())
    }
}

/// Seconds since the Unix epoch, as a float (0 if the clock is before 1970).
pub(crate) fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Creates the directory `dir` (and its parents), naming it on failure.
pub(crate) fn create_dir(dir: &Path) -> Result<()> {
    if dir.as_os_str().is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(|source| crate::error::Error::Io {
        context: "tracking: cannot create directory".into(),
        path: dir.to_path_buf(),
        source,
    })
}
