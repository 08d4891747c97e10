//! Experiment trackers: write training metrics to a JSON Lines file or a TensorBoard event file,
//! from the main process only.
//!
//! Every tracker implements [`Tracker`]; a [`Trackers`] set fans each [`log`](Tracker::log) call
//! out to all of its members. Build the set with [`trackers`] (or [`Trackers::for_process`]) so
//! that only the main process (rank 0) creates files and writes to them: on every other rank the
//! set stays empty, the trackers are never constructed and logging is a no-op, so the training
//! loop can call it unconditionally.
//!
//! ```no_run
//! use accelerate_rs::tracking::{self, progress::Progress};
//! use accelerate_rs::Accelerator;
//!
//! fn main() -> accelerate_rs::Result<()> {
//!     let accelerator = Accelerator::new()?;
//!     let mut trackers = tracking::trackers(&accelerator)
//!         .jsonl("runs/exp1/metrics.jsonl")?
//!         .tensorboard("runs/exp1")?;
//!     let progress = Progress::for_accelerator(&accelerator, 100);
//!     for step in 0..100u64 {
//!         let loss = 1.0 / (step + 1) as f64;
//!         trackers.log(&[("loss", loss), ("lr", 0.01)], step)?;
//!         progress.set_message(format!("loss {loss:.4}"));
//!         progress.inc(1);
//!     }
//!     progress.finish();
//!     trackers.flush()
//! }
//! ```

mod hparams;
pub mod jsonl;
pub mod progress;
pub mod tensorboard;
pub(crate) mod timing;
mod tracker;
mod trackers;

pub use hparams::{HParamValue, HParams};
pub use jsonl::JsonlTracker;
pub use progress::Progress;
pub use tensorboard::TensorBoardTracker;
pub use timing::{StepTimer, StepTimes};
pub use tracker::Tracker;
pub(crate) use tracker::{create_dir, unix_time};
pub use trackers::{trackers, Trackers};
