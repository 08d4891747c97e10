//! Logging set-up for training scripts: [`log`](https://docs.rs/log) records, printed by
//! `env_logger` to stderr with the process's rank in front of each line.
//!
//! Call [`init`] once at the top of `main`, then use the `log` macros:
//!
//! ```no_run
//! use accelerate_rs::{logging, Accelerator};
//!
//! fn main() -> accelerate_rs::Result<()> {
//!     let accelerator = Accelerator::new()?;
//!     logging::init(Some(accelerator.rank()));
//!     log::info!("training on {} processes", accelerator.world_size());
//!     // [rank 0] 2025-01-01T12:00:00Z INFO  train: training on 4 processes
//!     Ok(())
//! }
//! ```
//!
//! `logging::init(None)` takes the rank from the `RANK` variable that `accelerate-rs launch` (and
//! torchrun) sets, so it can be called before the [`Accelerator`](crate::Accelerator) exists; with
//! no `RANK` the prefix is left out. The level comes from `RUST_LOG` (`RUST_LOG=debug`,
//! `RUST_LOG=accelerate_rs=debug,info`, ...), `info` when unset.

use std::io::Write;

/// Installs an `env_logger` logger whose lines start with `[rank N]`.
///
/// The rank is `rank` if given, else the `RANK` environment variable if it holds a number, else
/// there is no prefix. The filter is `RUST_LOG`, defaulting to `info`. Only the first call in a
/// process installs a logger (the `log` crate allows one); later calls, or a call after another
/// logger was installed, do nothing and never panic. Returns whether this call installed it.
pub fn init(rank: Option<usize>) -> bool {
    let rank = rank.or_else(|| {
        crate::settings::parse::process_env::<usize>(crate::settings::env::RANK).unwrap_or_else(
            |e| {
                eprintln!("warning: {e}; log lines get no rank prefix");
                None
            },
        )
    });
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    builder.format(move |buf, record| {
        let prefix = rank.map(|r| format!("[rank {r}] ")).unwrap_or_default();
        writeln!(
            buf,
            "{prefix}{} {:<5} {}: {}",
            buf.timestamp(),
            record.level(),
            record.target(),
            record.args()
        )
    });
    builder.try_init().is_ok()
}

/// A warning that must be seen even when the program set up no logging (security-relevant or
/// data-losing events): through `log` at warn level when a logger takes it, else on stderr.
pub(crate) fn warn_always(msg: std::fmt::Arguments<'_>) {
    if log::log_enabled!(log::Level::Warn) {
        log::warn!("{msg}");
    } else {
        eprintln!("accelerate-rs: warning: {msg}");
    }
}
