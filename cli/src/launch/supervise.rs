//! The monitor loop: collect worker exits from the waiter threads in the order they happened,
//! and stop all workers when one fails or the launcher is interrupted (SIGTERM to each group,
//! SIGKILL after the grace period or on a second signal).

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::signals::SignalWatch;
use super::workers::{describe, Exit, Worker};

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
    /// The launcher got SIGINT/SIGTERM/SIGHUP; the workers were stopped.
    Interrupted {
        signo: i32,
        signal: String,
        stopped: usize,
    },
    /// Waiting on a worker failed; the others were stopped.
    WaitFailed { rank: usize, source: std::io::Error },
}

/// Records `exit` on its worker.
fn record(workers: &mut [Worker], exit: &Exit) {
    if let Some(w) = workers.get_mut(exit.index) {
        w.status = Some(match &exit.status {
            Ok(s) => Ok(*s),
            Err(e) => Err(e.to_string()),
        });
    }
}

/// Runs until every worker exited 0, one failed, or the launcher was interrupted; `tick` is how
/// often the launcher's signals are checked. Every worker has exited when this returns.
///
/// When several workers end close together, the one whose exit was seen first (by its waiter
/// thread's clock) is blamed, not the one with the lowest rank.
pub(crate) fn supervise(
    workers: &mut [Worker],
    exits: &Receiver<Exit>,
    signals: &SignalWatch,
    grace: Duration,
    tick: Duration,
) -> Outcome {
    loop {
        if let Some((signo, signal)) = signals.first() {
            log::info!("launch: received {signal}; stopping the workers");
            let stopped = stop_all(workers, exits, signals, grace, tick);
            return Outcome::Interrupted {
                signo,
                signal,
                stopped,
            };
        }
        if workers.iter().all(|w| !w.running()) {
            return Outcome::Success;
        }
        let first = match exits.recv_timeout(tick) {
            Ok(exit) => exit,
            Err(RecvTimeoutError::Timeout) => continue,
            // Every waiter is gone without reporting: nothing left to watch.
            Err(RecvTimeoutError::Disconnected) => return Outcome::Success,
        };
        // Take every exit already reported too, and look at them in the order they happened.
        let mut batch = vec![first];
        batch.extend(exits.try_iter());
        batch.sort_by_key(|e| e.at);
        for exit in &batch {
            record(workers, exit);
        }
        let failure = batch
            .into_iter()
            .find(|e| !matches!(&e.status, Ok(s) if s.success()));
        let Some(exit) = failure else {
            continue;
        };
        let (rank, pid) = workers
            .get(exit.index)
            .map_or((exit.index, 0), |w| (w.rank, w.pid()));
        match exit.status {
            Ok(status) => {
                let (code, status) = describe(status);
                log::info!("launch: rank {rank} (pid {pid}) {status}; stopping the others");
                let stopped = stop_all(workers, exits, signals, grace, tick);
                return Outcome::Failed {
                    rank,
                    pid,
                    code,
                    status,
                    stopped,
                };
            }
            Err(source) => {
                stop_all(workers, exits, signals, grace, tick);
                return Outcome::WaitFailed { rank, source };
            }
        }
    }
}

/// SIGTERMs (then SIGCONTs, for stopped ones) every running worker's group, waits up to `grace` (less if another signal reaches
/// the launcher), SIGKILLs the groups still alive and waits for every exit. Returns how many
/// workers were running when it was called.
pub(crate) fn stop_all(
    workers: &mut [Worker],
    exits: &Receiver<Exit>,
    signals: &SignalWatch,
    grace: Duration,
    tick: Duration,
) -> usize {
    let stopped = workers.iter().filter(|w| w.running()).count();
    let signals_seen = signals.count();
    for w in workers.iter() {
        w.signal_group(Signal::SIGTERM);
        // A stopped (SIGSTOP, Ctrl-Z) worker only acts on SIGTERM once it runs again.
        w.signal_group(Signal::SIGCONT);
    }
    let deadline = Instant::now()
        .checked_add(grace)
        .unwrap_or_else(Instant::now);
    let step = tick.min(Duration::from_millis(50));
    while workers.iter().any(Worker::running) {
        if signals.count() > signals_seen {
            log::info!("launch: signal received again; killing the workers now");
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        match exits.recv_timeout(step.min(deadline - now)) {
            Ok(exit) => record(workers, &exit),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return stopped,
        }
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
    while workers.iter().any(Worker::running) {
        match exits.recv() {
            Ok(exit) => record(workers, &exit),
            Err(_) => break,
        }
    }
    stopped
}
