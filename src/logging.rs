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

/// The last lines of a process's output, as a launcher shows them again when the process fails,
/// keeping the process's error line even when later lines (a `RUST_BACKTRACE=1` backtrace, a
/// long panic report) have pushed it out of the tail.
///
/// An error line is one that starts with `Error:` (what `main` returning `Err` prints) or
/// `error:`, or that holds `panicked at`; it is kept with the lines that follow it (the message
/// of a panic, anyhow's `Caused by:` list) up to a backtrace or 8 lines. The last error seen is
/// kept. Used by the self-launch ([`AcceleratorBuilder::processes`](crate::AcceleratorBuilder::processes))
/// and by `accelerate-rs launch`.
///
/// ```
/// use accelerate_rs::logging::LastLines;
///
/// let mut tail = LastLines::new(3);
/// tail.push("step 1");
/// tail.push("Error: shard 7 is truncated");
/// tail.push("");
/// tail.push("Stack backtrace:");
/// for i in 0..40 {
///     tail.push(&format!("  {i}: std::rt::lang_start"));
/// }
/// let lines = tail.lines();
/// assert_eq!(lines[0], "Error: shard 7 is truncated");
/// assert_eq!(lines.len(), 1 + 1 + 3); // the error, a "skipped" marker, the last 3 lines
/// ```
#[derive(Clone, Debug)]
pub struct LastLines {
    cap: usize,
    tail: std::collections::VecDeque<String>,
    /// Lines pushed so far.
    seen: u64,
    /// The last error block: the number of lines seen before it, and its lines.
    error: Option<(u64, Vec<String>)>,
    /// Whether the error block is still taking lines.
    open: bool,
}

/// The most lines an error block keeps.
const ERROR_BLOCK: usize = 8;

impl LastLines {
    /// Keeps the last `cap` lines (at least 1) and the last error block.
    pub fn new(cap: usize) -> Self {
        LastLines {
            cap: cap.max(1),
            tail: std::collections::VecDeque::new(),
            seen: 0,
            error: None,
            open: false,
        }
    }

    /// Whether `line` starts an error block.
    fn is_error(line: &str) -> bool {
        let t = line.trim_start();
        t.starts_with("Error:") || t.starts_with("error:") || line.contains("panicked at")
    }

    /// Whether `line` ends an error block (and is not part of it).
    fn ends_error(line: &str) -> bool {
        let t = line.trim_start().to_ascii_lowercase();
        t.starts_with("stack backtrace:") || t.starts_with("note: run with `rust_backtrace")
    }

    /// Records one line (without its newline).
    pub fn push(&mut self, line: &str) {
        if Self::is_error(line) {
            self.error = Some((self.seen, vec![line.to_string()]));
            self.open = true;
        } else if self.open {
            match &mut self.error {
                Some((_, block)) if block.len() < ERROR_BLOCK && !Self::ends_error(line) => {
                    block.push(line.to_string());
                }
                _ => self.open = false,
            }
        }
        if self.tail.len() == self.cap {
            self.tail.pop_front();
        }
        self.tail.push_back(line.to_string());
        self.seen += 1;
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.seen == 0
    }

    /// The lines to show: the last error block when it is no longer (wholly) in the tail,
    /// followed by a `... (N lines) ...` marker for the lines between, then the tail.
    pub fn lines(&self) -> Vec<String> {
        let first_in_tail = self.seen - self.tail.len() as u64;
        let mut out = Vec::with_capacity(self.tail.len() + ERROR_BLOCK + 1);
        if let Some((at, block)) = &self.error {
            if *at < first_in_tail {
                let mut block = block.clone();
                while block.last().is_some_and(|l| l.trim().is_empty()) {
                    block.pop();
                }
                let end = at + block.len() as u64;
                // Only the part of the block before the tail; the rest is in the tail.
                let keep = (block.len() as u64).min(first_in_tail - at) as usize;
                out.extend(block.into_iter().take(keep));
                let skipped = first_in_tail.saturating_sub(end);
                if skipped > 0 {
                    out.push(format!("... ({skipped} more line(s)) ..."));
                }
            }
        }
        out.extend(self.tail.iter().cloned());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::LastLines;

    fn push_all(t: &mut LastLines, lines: &[&str]) {
        for l in lines {
            t.push(l);
        }
    }

    #[test]
    fn a_backtrace_does_not_push_out_the_error_line() {
        let mut t = LastLines::new(5);
        push_all(
            &mut t,
            &[
                "epoch 3",
                "Error: data: shard 7 is truncated",
                "",
                "Caused by:",
                "    unexpected end of file",
                "",
                "Stack backtrace:",
            ],
        );
        for i in 0..30 {
            t.push(&format!("  {i}: frame"));
        }
        let lines = t.lines();
        assert_eq!(
            &lines[..5],
            [
                "Error: data: shard 7 is truncated",
                "",
                "Caused by:",
                "    unexpected end of file",
                "... (27 more line(s)) ...",
            ]
        );
        assert_eq!(lines[5..], t.tail.iter().cloned().collect::<Vec<_>>()[..]);
        assert_eq!(lines.len(), 10);
    }

    #[test]
    fn an_error_still_in_the_tail_is_not_repeated() {
        let mut t = LastLines::new(20);
        push_all(&mut t, &["a", "Error: boom", "b"]);
        assert_eq!(t.lines(), ["a", "Error: boom", "b"]);
        // Half of the block scrolled out: only that half is shown before the tail.
        let mut t = LastLines::new(2);
        push_all(
            &mut t,
            &[
                "thread 'main' panicked at src/main.rs:3:5:",
                "index out of bounds",
                "x",
                "y",
            ],
        );
        assert_eq!(
            t.lines(),
            [
                "thread 'main' panicked at src/main.rs:3:5:",
                "index out of bounds",
                "x",
                "y"
            ]
        );
        let mut t = LastLines::new(2);
        push_all(&mut t, &["p", "q", "r"]);
        assert_eq!(t.lines(), ["q", "r"]);
        assert!(LastLines::new(3).is_empty() && LastLines::new(3).lines().is_empty());
    }
}
