//! The monitor loop: watch the workers, and stop all of them when one fails or the launcher is
//! interrupted (SIGTERM to each group, SIGKILL after the grace period or on a second signal).

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::signals::SignalWatch;
use super::workers::{describe, Worker};

/// How often the workers are polled.
const POLL: Duration = Duration::from_millis(20);

/// How a group of workers ended.
pub(crate) enum Outcome {
    /// Every worker exited 0.
    Success,
    /// A worker failed first; the others were stopped.
    Failed {
        rank: usize,
        pid: u32,
        code: i32,
        status: String,
        stopped: usize,
    },
    /// The launcher got SIGINT/SIGTERM; the workers were stopped.
    Interrupted {
        signo: i32,
        signal: String,
        stopped: usize,
    },
    /// Waiting on a worker failed; the others were stopped.
    WaitFailed { rank: usize, source: std::io::Error },
}

/// Runs until every worker exited 0, one failed, or the launcher was interrupted. Every
/// worker has been reaped when this returns.
pub(crate) fn supervise(workers: &mut [Worker], signals: &SignalWatch, grace: Duration) -> Outcome {
    loop {
        if let Some((signo, signal)) = signals.first() {
            log::info!("launch: received {signal}; stopping the workers");
            let stopped = stop_all(workers, signals, grace);
            return Outcome::Interrupted {
                signo,
                signal,
                stopped,
            };
        }
        for i in 0..workers.len() {
            let polled = workers[i].poll();
            let (rank, pid) = (workers[i].rank, workers[i].pid());
            match polled {
                Ok(Some(status)) if status.success() => {
                    log::debug!("launch: rank {rank} (pid {pid}) exited with code 0");
                }
                Ok(Some(status)) => {
                    let (code, status) = describe(status);
                    log::info!("launch: rank {rank} (pid {pid}) {status}; stopping the others");
                    let stopped = stop_all(workers, signals, grace);
                    return Outcome::Failed {
                        rank,
                        pid,
                        code,
                        status,
                        stopped,
                    };
                }
                Ok(None) => {}
                Err(source) => {
                    stop_all(workers, signals, grace);
                    return Outcome::WaitFailed { rank, source };
                }
            }
        }
        if workers.iter().all(|w| !w.running()) {
            return Outcome::Success;
        }
        std::thread::sleep(POLL);
    }
}

/// SIGTERMs every running worker's group, waits up to `grace` (less if another signal reaches
/// the launcher), SIGKILLs the groups still alive and reaps everyone. Returns how many workers
/// were running when it was called.
fn stop_all(workers: &mut [Worker], signals: &SignalWatch, grace: Duration) -> usize {
    let stopped = workers.iter().filter(|w| w.running()).count();
    let signals_seen = signals.count();
    for w in workers.iter() {
        w.signal_group(Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        for w in workers.iter_mut() {
            if let Err(e) = w.poll() {
                log::warn!("launch: waiting for rank {} failed: {e}", w.rank);
            }
        }
        if workers.iter().all(|w| !w.running()) {
            break;
        }
        if signals.count() > signals_seen {
            log::info!("launch: signal received again; killing the workers now");
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(POLL);
    }
    for w in workers.iter() {
        if w.running() {
            log::info!(
                "launch: rank {} (pid {}) still running; sending SIGKILL",
                w.rank,
                w.pid()
            );
        }
        w.signal_group(Signal::SIGKILL);
    }
    for w in workers.iter_mut() {
        w.reap();
    }
    stopped
}
