//! Counting SIGINT / SIGTERM / SIGHUP sent to the launcher, so the supervisor can stop its workers
//! gracefully on the first one and at once on the second.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::sys::signal::Signal;
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};

/// Counts the termination signals the launcher receives while it is installed.
pub(crate) struct SignalWatch {
    count: Arc<AtomicUsize>,
    first: Arc<AtomicI32>,
    running: Option<(Handle, JoinHandle<()>)>,
}

impl SignalWatch {
    /// Installs handlers for SIGINT, SIGTERM and SIGHUP (a closed terminal or a dropped ssh
    /// session stops the workers like SIGTERM). If that fails the launcher still works, only
    /// without forwarding those signals (a warning is logged).
    pub(crate) fn install() -> Self {
        let count = Arc::new(AtomicUsize::new(0));
        let first = Arc::new(AtomicI32::new(0));
        let running = match Signals::new([SIGINT, SIGTERM, SIGHUP]) {
            Ok(mut signals) => {
                let handle = signals.handle();
                let (c, f) = (Arc::clone(&count), Arc::clone(&first));
                let thread = std::thread::Builder::new()
                    .name("launch-signals".into())
                    .spawn(move || {
                        for sig in signals.forever() {
                            let _ = f.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                            c.fetch_add(1, Ordering::SeqCst);
                        }
                    });
                match thread {
                    Ok(thread) => Some((handle, thread)),
                    Err(e) => {
                        handle.close();
                        log::warn!("launch: cannot watch SIGINT/SIGTERM/SIGHUP: {e}");
                        None
                    }
                }
            }
            Err(e) => {
                log::warn!("launch: cannot watch SIGINT/SIGTERM/SIGHUP: {e}");
                None
            }
        };
        SignalWatch {
            count,
            first,
            running,
        }
    }

    /// How many SIGINT/SIGTERM/SIGHUP have arrived so far.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// The first signal received, with its name, if any.
    pub(crate) fn first(&self) -> Option<(i32, String)> {
        match self.first.load(Ordering::SeqCst) {
            0 => None,
            n => Some((n, signal_name(n))),
        }
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        if let Some((handle, thread)) = self.running.take() {
            handle.close();
            let _ = thread.join();
        }
    }
}

/// `SIGKILL`, `SIGTERM`, ... or `signal N` for numbers nix does not know.
pub(crate) fn signal_name(n: i32) -> String {
    Signal::try_from(n).map_or_else(|_| format!("signal {n}"), |s| s.as_str().to_string())
}
