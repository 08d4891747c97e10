//! [`Progress`]: a progress bar shown by the main process only.

use std::borrow::Cow;
use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::settings::ProcessState;

const TEMPLATE: &str =
    "{bar:40.cyan/blue} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}";

/// A progress bar ([`indicatif`]) drawn on stdout by the main process only.
///
/// It is hidden on every other rank (so N processes do not draw N bars over each other) and,
/// on the main process, when stdout is not a terminal (a log file, a pipe) unless
/// [`forced`](Progress::forced). A hidden bar still counts, so [`position`](Progress::position)
/// is right everywhere; all methods take `&self`.
#[derive(Debug, Clone)]
pub struct Progress {
    bar: ProgressBar,
    main: bool,
}

impl Progress {
    /// A bar of `len` steps, shown only if `is_main` (pass [`Accelerator::is_main_process`](crate::Accelerator::is_main_process)) and
    /// stdout is a terminal.
    pub fn new(len: u64, is_main: bool) -> Self {
        let target = if is_main && std::io::stdout().is_terminal() {
            ProgressDrawTarget::stdout()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(len), target);
        let style = ProgressStyle::with_template(TEMPLATE)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        bar.set_style(style);
        Progress { bar, main: is_main }
    }

    /// A bar of `len` steps for this process: shown on the main process (rank 0) only.
    /// Takes `&accelerator` (or its [`ProcessState`]).
    pub fn for_accelerator(run: impl AsRef<ProcessState>, len: u64) -> Self {
        Self::new(len, run.as_ref().is_main_process())
    }

    /// Draws the bar on the main process even when stdout is not a terminal (e.g. under a
    /// launcher that pipes output). Other ranks stay hidden.
    pub fn forced(self) -> Self {
        if self.main {
            self.bar
                .set_draw_target(ProgressDrawTarget::term_like(Box::new(
                    console::Term::buffered_stdout(),
                )));
        }
        self
    }

    /// Whether the bar is drawn.
    pub fn is_hidden(&self) -> bool {
        self.bar.is_hidden()
    }

    /// Advances the bar by `delta` steps.
    pub fn inc(&self, delta: u64) {
        self.bar.inc(delta);
    }

    /// The number of steps done so far.
    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// Sets the text shown after the bar (e.g. the current loss).
    pub fn set_message(&self, msg: impl Into<Cow<'static, str>>) {
        self.bar.set_message(msg);
    }

    /// Stops the bar, leaving its last state on screen.
    pub fn finish(&self) {
        self.bar.finish();
    }

    /// The underlying [`indicatif::ProgressBar`], for anything not wrapped here.
    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }
}
