//! The life of one NCCL communicator, apart from NCCL itself: the watchdog that waits for it
//! (its creation, each operation, its finalization), how it is closed, and the checks made
//! before a tensor is handed to it.
//!
//! `nccl.rs` drives real communicators through [`CommHandle`]; the tests here drive fakes, so
//! every decision (a creation that never completes, an asynchronous network error, finalize or
//! abort, a tensor on the wrong GPU) is checked on the CPU.
//!
//! - **Waiting** ([`wait`]): polls `ncclCommGetAsyncError` (and, for an operation, whether the
//!   work queued on the GPU is done) until done. An asynchronous error (a network failure with
//!   every process alive) fails at once, naming the rank, the operation and NCCL's error; a host
//!   peer that is gone fails within [`PEER_CHECK`]; past the deadline the error names the rank
//!   and the operation (no peer is guessed: NCCL does not say which one it waits for), with what
//!   to check (`NCCL_SOCKET_IFNAME`, `NCCL_DEBUG`).
//! - **Closing** ([`close`]): after a run that finished ([`Outcome::Finished`]), a barrier with
//!   every rank (so that no rank tears its communicator down while a peer's last operation may
//!   still need it), then `ncclCommFinalize` (this rank's outstanding work flushed, waited for
//!   with the watchdog) and `ncclCommDestroy`. Dropped without being told how the run ended
//!   ([`Outcome::Dropped`]): finalize and destroy without the barrier. After a failure
//!   ([`Outcome::Failed`]), or when a step of the orderly close fails: `ncclCommAbort`.

use std::time::{Duration, Instant};

use candle_core::DeviceLocation;

use crate::error::{Error, Result};

/// How often the host collective's peers are checked while NCCL is waited for.
pub(crate) const PEER_CHECK: Duration = Duration::from_millis(50);

/// What to check when a communicator's creation does not complete.
pub(crate) const INIT_HINT: &str = "every rank must reach it, and on several machines NCCL must reach the others over the network: set NCCL_SOCKET_IFNAME to the interface the machines share (e.g. NCCL_SOCKET_IFNAME=eth0, or ^docker0,lo to exclude some) and NCCL_DEBUG=INFO to see which interfaces and transports NCCL tried";

/// What to check when an operation does not complete.
pub(crate) const OP_HINT: &str = "no rank reported an error: a rank may be stuck before this operation or calling another one, or the network is stalled; NCCL_DEBUG=INFO shows NCCL's view";

/// What to check when finalization does not complete.
pub(crate) const FINALIZE_HINT: &str =
    "a peer may have stopped before its last operation completed; NCCL_DEBUG=INFO shows NCCL's view";

/// What `ncclCommGetAsyncError` says about a communicator.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum CommState {
    /// Nothing pending and no error.
    Ready,
    /// A creation, finalization or non-blocking call is still in progress.
    Pending,
    /// NCCL reported an error: its name and NCCL's last message.
    Failed(String),
}

/// The name of an `ncclResult_t` value.
pub(crate) fn result_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "an unknown NCCL result",
    }
}

/// The state a raw `ncclCommGetAsyncError` result stands for; `last_error` is NCCL's last
/// message (`ncclGetLastError`), asked for only on an error.
pub(crate) fn state_of(code: u32, last_error: impl FnOnce() -> String) -> CommState {
    match code {
        0 => CommState::Ready,
        7 => CommState::Pending,
        other => {
            let last = last_error();
            let name = result_name(other);
            CommState::Failed(if last.trim().is_empty() {
                format!("{name} ({other})")
            } else {
                format!("{name} ({other}): {}", last.trim())
            })
        }
    }
}

/// The calls the watchdog and [`close`] make on one communicator: a real NCCL communicator in
/// `nccl.rs`, fakes in the tests.
pub(crate) trait CommHandle {
    /// `ncclCommGetAsyncError`.
    fn state(&self) -> CommState;
    /// `ncclCommFinalize` (it may leave the state [`CommState::Pending`] for a while).
    fn finalize(&self) -> std::result::Result<(), String>;
    /// `ncclCommDestroy`, after a finalization that completed.
    fn destroy(&self) -> std::result::Result<(), String>;
    /// `ncclCommAbort`.
    fn abort(&self) -> std::result::Result<(), String>;
}

/// One wait: who waits, for what, how long, and what to check if it takes too long.
#[derive(Clone, Debug)]
pub(crate) struct Wait<'a> {
    /// This rank.
    pub(crate) rank: usize,
    /// The operation (`nccl init`, `all_reduce`, ...).
    pub(crate) op: &'a str,
    /// The longest wait.
    pub(crate) timeout: Duration,
    /// What to check when the wait times out.
    pub(crate) hint: &'a str,
}

/// Waits until the communicator is [`CommState::Ready`] and `done()` is true, polling its
/// asynchronous error all along and `check_peers` every [`PEER_CHECK`]. Fails at once on an
/// NCCL error or a host peer that is gone, and after `w.timeout` with an error naming the rank,
/// the operation and `w.hint`.
pub(crate) fn wait(
    w: &Wait<'_>,
    comm: &dyn CommHandle,
    done: &mut dyn FnMut() -> Result<bool>,
    check_peers: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let mut last_check = start;
    loop {
        match comm.state() {
            CommState::Failed(why) => {
                return Err(Error::Nccl {
                    rank: w.rank,
                    op: w.op.into(),
                    reason: format!(
                        "NCCL reported {why} (a network or peer failure; NCCL_DEBUG=WARN prints NCCL's own account)"
                    ),
                })
            }
            CommState::Ready => {
                if done()? {
                    return Ok(());
                }
            }
            CommState::Pending => {}
        }
        let now = Instant::now();
        if now.duration_since(last_check) >= PEER_CHECK {
            check_peers().map_err(|e| Error::Peer {
                rank: w.rank,
                peer: match &e {
                    Error::Peer { peer, .. } | Error::Timeout { peer, .. } => *peer,
                    _ => w.rank,
                },
                op: w.op.into(),
                reason: format!("a peer is gone while NCCL waits: {e}"),
                source: None,
            })?;
            last_check = now;
        }
        let waited = now.duration_since(start);
        if waited >= w.timeout {
            return Err(Error::Nccl {
                rank: w.rank,
                op: w.op.into(),
                reason: format!("did not complete within {:?}; {}", w.timeout, w.hint),
            });
        }
        pause(waited);
    }
}

/// Spins briefly (operations of a training step take microseconds to milliseconds), then
/// sleeps a little longer the longer the wait.
fn pause(waited: Duration) {
    if waited < Duration::from_millis(2) {
        std::thread::yield_now();
    } else if waited < Duration::from_millis(100) {
        std::thread::sleep(Duration::from_micros(200));
    } else {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How the run ended for one communicator, which decides how it is closed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// The run finished on this rank ([`Collective::set_run_outcome`] told so): close together
    /// with the other ranks (barrier, finalize, destroy).
    ///
    /// [`Collective::set_run_outcome`]: super::Collective::set_run_outcome
    Finished,
    /// Nothing failed here, but how the run ended was not told (an accelerator dropped outside
    /// `AcceleratorBuilder::run`): finalize and destroy without waiting for the other ranks,
    /// since a barrier would keep a rank whose own code failed waiting for peers that wait for it.
    Dropped,
    /// An operation failed, the thread is panicking or the run returned an error: abort.
    Failed(String),
}

/// The outcome of a communicator being closed: `broken` is its first failure (if any),
/// `panicking` whether the closing thread unwinds, `told` what the run said about its end.
pub(crate) fn outcome(broken: Option<String>, panicking: bool, told: Option<bool>) -> Outcome {
    if let Some(first) = broken {
        return Outcome::Failed(format!("an operation failed: {first}"));
    }
    if panicking {
        return Outcome::Failed("the thread is panicking".into());
    }
    match told {
        Some(true) => Outcome::Finished,
        Some(false) => Outcome::Failed("the run returned an error".into()),
        None => Outcome::Dropped,
    }
}

/// How a communicator was closed.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Closed {
    /// Finalized and destroyed (after a barrier with every rank when `together`).
    Finalized {
        /// Whether a barrier with every rank came first.
        together: bool,
    },
    /// Aborted, and why.
    Aborted(String),
}

/// Closes `comm` as `outcome` asks (see [the module](self)); never fails: whatever goes wrong
/// in the orderly close ends in an abort, and a failed abort is logged.
pub(crate) fn close(
    comm: &dyn CommHandle,
    outcome: Outcome,
    rank: usize,
    timeout: Duration,
    barrier: &mut dyn FnMut() -> Result<()>,
    check_peers: &mut dyn FnMut() -> Result<()>,
) -> Closed {
    let why = match outcome {
        Outcome::Failed(why) => why,
        Outcome::Finished | Outcome::Dropped => {
            let together = outcome == Outcome::Finished;
            match finalize(comm, together, rank, timeout, barrier, check_peers) {
                Ok(()) => return Closed::Finalized { together },
                Err(e) => format!("the orderly close failed: {e}"),
            }
        }
    };
    if let Err(e) = comm.abort() {
        log::warn!("rank {rank}: aborting the NCCL communicator failed ({e}); ignored at teardown");
    }
    Closed::Aborted(why)
}

/// Barrier (when `together`), `ncclCommFinalize` waited for with the watchdog, `ncclCommDestroy`.
fn finalize(
    comm: &dyn CommHandle,
    together: bool,
    rank: usize,
    timeout: Duration,
    barrier: &mut dyn FnMut() -> Result<()>,
    check_peers: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let nccl = |op: &str, reason: String| Error::Nccl {
        rank,
        op: op.into(),
        reason,
    };
    if together {
        barrier()?;
    }
    comm.finalize().map_err(|e| nccl("nccl finalize", e))?;
    let w = Wait {
        rank,
        op: "nccl finalize",
        timeout,
        hint: FINALIZE_HINT,
    };
    wait(&w, comm, &mut || Ok(true), check_peers)?;
    comm.destroy().map_err(|e| nccl("nccl destroy", e))
}

/// Refuses a CUDA tensor on another GPU than the communicator's (`want`, an ordinal among this
/// process's visible GPUs): NCCL would read or write memory of the wrong device.
pub(crate) fn check_ordinal(rank: usize, op: &str, want: usize, got: DeviceLocation) -> Result<()> {
    match got {
        DeviceLocation::Cuda { gpu_id } if gpu_id != want => Err(Error::Nccl {
            rank,
            op: op.into(),
            reason: format!(
                "the tensor is on GPU {gpu_id}, but this rank's NCCL communicator drives GPU {want}; move it there first (`tensor.to_device(accelerator.device())`)"
            ),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A fake communicator: its states in turn (the last one repeats), and every close call made.
    struct Fake {
        states: RefCell<Vec<CommState>>,
        calls: RefCell<Vec<&'static str>>,
        finalize_fails: bool,
    }

    impl Fake {
        fn new(states: Vec<CommState>) -> Self {
            Fake {
                states: RefCell::new(states),
                calls: RefCell::new(Vec::new()),
                finalize_fails: false,
            }
        }
        fn calls(&self) -> Vec<&'static str> {
            self.calls.borrow().clone()
        }
    }

    impl CommHandle for Fake {
        fn state(&self) -> CommState {
            let mut s = self.states.borrow_mut();
            if s.len() > 1 {
                s.remove(0)
            } else {
                s[0].clone()
            }
        }
        fn finalize(&self) -> std::result::Result<(), String> {
            self.calls.borrow_mut().push("finalize");
            if self.finalize_fails {
                Err("ncclInternalError".into())
            } else {
                Ok(())
            }
        }
        fn destroy(&self) -> std::result::Result<(), String> {
            self.calls.borrow_mut().push("destroy");
            Ok(())
        }
        fn abort(&self) -> std::result::Result<(), String> {
            self.calls.borrow_mut().push("abort");
            Ok(())
        }
    }

    fn w(op: &str, ms: u64) -> Wait<'_> {
        Wait {
            rank: 3,
            op,
            timeout: Duration::from_millis(ms),
            hint: INIT_HINT,
        }
    }

    #[test]
    fn an_init_that_never_completes_fires_the_watchdog_naming_the_rank() {
        let comm = Fake::new(vec![CommState::Pending]);
        let start = Instant::now();
        let mut peers = 0;
        let e = wait(&w("nccl init", 300), &comm, &mut || Ok(true), &mut || {
            peers += 1;
            Ok(())
        })
        .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(300));
        assert!(start.elapsed() < Duration::from_secs(5));
        let text = e.to_string();
        assert!(matches!(e, Error::Nccl { rank: 3, .. }), "{e:?}");
        assert!(text.starts_with("rank 3: nccl init over NCCL"), "{text}");
        assert!(text.contains("did not complete within 300ms"), "{text}");
        assert!(text.contains("NCCL_SOCKET_IFNAME"), "{text}");
        assert!(text.contains("NCCL_DEBUG=INFO"), "{text}");
        // The peers were checked on the way (every 50 ms).
        assert!(peers >= 3, "{peers}");
    }

    #[test]
    fn an_init_that_completes_returns_once_ready() {
        let comm = Fake::new(vec![
            CommState::Pending,
            CommState::Pending,
            CommState::Ready,
        ]);
        wait(&w("nccl init", 5_000), &comm, &mut || Ok(true), &mut || {
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn an_async_error_fails_at_once_naming_rank_op_and_nccl_error() {
        let failed = state_of(6, || "socket closed by peer 10.0.0.2".into());
        let comm = Fake::new(vec![CommState::Ready, failed]);
        let start = Instant::now();
        // The GPU work never completes: only the asynchronous error can end the wait early.
        let e = wait(
            &w("all_reduce", 60_000),
            &comm,
            &mut || Ok(false),
            &mut || Ok(()),
        )
        .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        let text = e.to_string();
        assert!(text.starts_with("rank 3: all_reduce over NCCL"), "{text}");
        assert!(
            text.contains("ncclRemoteError (6): socket closed by peer 10.0.0.2"),
            "{text}"
        );
    }

    #[test]
    fn a_gone_host_peer_fails_the_wait_naming_the_peer() {
        let comm = Fake::new(vec![CommState::Pending]);
        let e = wait(
            &w("nccl init", 60_000),
            &comm,
            &mut || Ok(true),
            &mut || {
                Err(Error::Peer {
                    rank: 3,
                    peer: 1,
                    op: "check_peers".into(),
                    reason: "connection closed".into(),
                    source: None,
                })
            },
        )
        .unwrap_err();
        match e {
            Error::Peer { rank, peer, op, .. } => {
                assert_eq!((rank, peer, op.as_str()), (3, 1, "nccl init"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn states_and_result_names() {
        assert_eq!(state_of(0, || unreachable!()), CommState::Ready);
        assert_eq!(state_of(7, || unreachable!()), CommState::Pending);
        assert_eq!(
            state_of(2, String::new),
            CommState::Failed("ncclSystemError (2)".into())
        );
        assert_eq!(result_name(8), "ncclTimeout");
        assert_eq!(result_name(99), "an unknown NCCL result");
    }

    #[test]
    fn the_outcome_follows_the_run() {
        assert_eq!(outcome(None, false, Some(true)), Outcome::Finished);
        assert_eq!(outcome(None, false, None), Outcome::Dropped);
        assert!(matches!(
            outcome(None, false, Some(false)),
            Outcome::Failed(_)
        ));
        assert!(matches!(
            outcome(None, true, Some(true)),
            Outcome::Failed(_)
        ));
        let o = outcome(Some("all_reduce timed out".into()), false, Some(true));
        assert_eq!(
            o,
            Outcome::Failed("an operation failed: all_reduce timed out".into())
        );
    }

    fn close_with(comm: &Fake, outcome: Outcome, barrier_ok: bool) -> (Closed, usize) {
        let mut barriers = 0;
        let closed = close(
            comm,
            outcome,
            0,
            Duration::from_secs(5),
            &mut || {
                barriers += 1;
                if barrier_ok {
                    Ok(())
                } else {
                    Err(Error::Peer {
                        rank: 0,
                        peer: 1,
                        op: "barrier".into(),
                        reason: "rank 1 is gone".into(),
                        source: None,
                    })
                }
            },
            &mut || Ok(()),
        );
        (closed, barriers)
    }

    #[test]
    fn a_finished_run_closes_together_and_never_aborts() {
        let comm = Fake::new(vec![CommState::Pending, CommState::Ready]);
        let (closed, barriers) = close_with(&comm, Outcome::Finished, true);
        assert_eq!(closed, Closed::Finalized { together: true });
        assert_eq!(barriers, 1);
        assert_eq!(comm.calls(), ["finalize", "destroy"]);
    }

    #[test]
    fn a_dropped_communicator_finalizes_without_a_barrier() {
        let comm = Fake::new(vec![CommState::Ready]);
        let (closed, barriers) = close_with(&comm, Outcome::Dropped, true);
        assert_eq!(closed, Closed::Finalized { together: false });
        assert_eq!(barriers, 0);
        assert_eq!(comm.calls(), ["finalize", "destroy"]);
    }

    #[test]
    fn a_failed_run_aborts_without_a_barrier_or_finalize() {
        let comm = Fake::new(vec![CommState::Ready]);
        let (closed, barriers) = close_with(&comm, Outcome::Failed("boom".into()), true);
        assert_eq!(closed, Closed::Aborted("boom".into()));
        assert_eq!(barriers, 0);
        assert_eq!(comm.calls(), ["abort"]);
    }

    #[test]
    fn a_failing_step_of_the_orderly_close_ends_in_an_abort() {
        // The barrier fails (a peer is gone): abort, no finalize.
        let comm = Fake::new(vec![CommState::Ready]);
        let (closed, _) = close_with(&comm, Outcome::Finished, false);
        assert!(
            matches!(&closed, Closed::Aborted(w) if w.contains("rank 1 is gone")),
            "{closed:?}"
        );
        assert_eq!(comm.calls(), ["abort"]);
        // Finalize fails.
        let mut comm = Fake::new(vec![CommState::Ready]);
        comm.finalize_fails = true;
        let (closed, _) = close_with(&comm, Outcome::Finished, true);
        assert!(
            matches!(&closed, Closed::Aborted(w) if w.contains("nccl finalize")),
            "{closed:?}"
        );
        assert_eq!(comm.calls(), ["finalize", "abort"]);
        // Finalize reports an asynchronous error while flushing.
        let comm = Fake::new(vec![state_of(6, String::new)]);
        let (closed, _) = close_with(&comm, Outcome::Finished, true);
        assert!(
            matches!(&closed, Closed::Aborted(w) if w.contains("ncclRemoteError")),
            "{closed:?}"
        );
        assert_eq!(comm.calls(), ["finalize", "abort"]);
    }

    #[test]
    fn a_tensor_on_another_gpu_is_refused() {
        let e = check_ordinal(1, "all_reduce", 1, DeviceLocation::Cuda { gpu_id: 0 }).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("rank 1: all_reduce over NCCL"), "{text}");
        assert!(
            text.contains("on GPU 0") && text.contains("drives GPU 1"),
            "{text}"
        );
        check_ordinal(1, "all_reduce", 1, DeviceLocation::Cuda { gpu_id: 1 }).unwrap();
        check_ordinal(1, "all_reduce", 1, DeviceLocation::Cpu).unwrap();
    }
}
