//! Tests of `life.rs` over fake communicators: the watchdog, refusals after a peer died, close,
//! prepare-gate-queue-wait.

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

/// The error `check_peers` gives once rank 1's connection is closed.
fn rank_1_gone() -> Error {
    Error::Peer {
        rank: 3,
        peer: 1,
        op: "check_peers".into(),
        reason: "connection closed".into(),
        source: None,
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
fn an_nccl_error_from_a_dead_peer_names_it() {
    // `kill -9` of rank 1: NCCL reports a remote error without a rank; the host collective
    // notices the closed connection a moment later and names it.
    let comm = Fake::new(vec![state_of(6, || "socket closed".into())]);
    let mut checks = 0;
    let e = wait(
        &w("all_reduce", 60_000),
        &comm,
        &mut || Ok(false),
        &mut || {
            checks += 1;
            if checks < 3 {
                Ok(())
            } else {
                Err(rank_1_gone())
            }
        },
    )
    .unwrap_err();
    match &e {
        Error::Peer {
            rank,
            peer,
            op,
            reason,
            ..
        } => {
            assert_eq!((*rank, *peer, op.as_str()), (3, 1, "all_reduce"));
            assert!(
                reason.contains("ncclRemoteError (6): socket closed"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(e.to_string().contains("talking to rank 1"), "{e}");
}

#[test]
fn a_call_refused_after_a_peer_died_names_the_peer() {
    // What the GPU run of `kill -9` showed: the next all_reduce is refused at once with
    // ncclRemoteError, before any wait; the error must name rank 1, not this rank.
    let refusal = || Error::Nccl {
        rank: 3,
        op: "all_reduce".into(),
        reason: "NCCL error: ncclRemoteError".into(),
    };
    for state in [state_of(6, || "socket closed".into()), CommState::Ready] {
        let comm = Fake::new(vec![state]);
        let mut checks = 0;
        let e = refused(&w("all_reduce", 60_000), &comm, refusal(), &mut || {
            checks += 1;
            if checks < 3 {
                Ok(())
            } else {
                Err(rank_1_gone())
            }
        });
        match &e {
            Error::Peer { rank, peer, op, .. } => {
                assert_eq!((*rank, *peer, op.as_str()), (3, 1, "all_reduce"));
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("talking to rank 1"), "{e}");
    }
    // No peer found gone within the second: NCCL's error, naming no peer.
    let comm = Fake::new(vec![state_of(6, || "socket closed".into())]);
    let start = Instant::now();
    let e = refused(&w("all_reduce", 60_000), &comm, refusal(), &mut || Ok(()));
    assert!(start.elapsed() < Duration::from_secs(3));
    assert!(matches!(e, Error::Nccl { rank: 3, .. }), "{e:?}");
    // Any other refusal (a wrong argument) is returned as it is, without waiting.
    let comm = Fake::new(vec![CommState::Ready]);
    let other = Error::Nccl {
        rank: 3,
        op: "all_reduce".into(),
        reason: "NCCL error: ncclInvalidArgument".into(),
    };
    let e = refused(&w("all_reduce", 60_000), &comm, other, &mut || {
        Err(rank_1_gone())
    });
    assert!(e.to_string().contains("ncclInvalidArgument"), "{e}");
}

#[test]
fn a_gone_host_peer_fails_the_wait_naming_the_peer() {
    let comm = Fake::new(vec![CommState::Pending]);
    let e = wait(
        &w("nccl init", 60_000),
        &comm,
        &mut || Ok(true),
        &mut || Err(rank_1_gone()),
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

fn place(ordinal: usize, stream: usize) -> Option<StreamPlace> {
    Some(StreamPlace { ordinal, stream })
}

#[test]
fn a_tensor_on_another_gpu_is_refused() {
    let want = StreamPlace {
        ordinal: 1,
        stream: 0x5000,
    };
    let e = check_place(1, "all_reduce", want, place(0, 0x5000)).unwrap_err();
    let text = e.to_string();
    assert!(text.starts_with("rank 1: all_reduce over NCCL"), "{text}");
    assert!(
        text.contains("on GPU 0") && text.contains("drives GPU 1"),
        "{text}"
    );
    check_place(1, "all_reduce", want, place(1, 0x5000)).unwrap();
    check_place(1, "all_reduce", want, None).unwrap();
}

#[test]
fn a_tensor_on_the_same_gpu_but_another_stream_is_refused_naming_the_operation() {
    // The communicator's own stream, and a user's `Device::new_cuda(1)`: the same GPU, the
    // per-thread default stream (`CU_STREAM_PER_THREAD`, handle 0x2).
    let want = StreamPlace {
        ordinal: 1,
        stream: 0x7f00_1234,
    };
    let e = check_place(3, "broadcast", want, place(1, 0x2)).unwrap_err();
    assert!(matches!(e, Error::Nccl { rank: 3, .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.starts_with("rank 3: broadcast over NCCL"), "{text}");
    assert!(
        text.contains("another Candle device")
            && text.contains("stream 0x2")
            && text.contains("0x7f001234")
            && text.contains("accelerator.device()"),
        "{text}"
    );
}

/// A fake communicator for [`GuardedComm`]: records what is done to it (in a log shared
/// with the test, which outlives it), and records an abort when dropped.
struct Queued {
    log: std::rc::Rc<RefCell<Vec<&'static str>>>,
}

impl CommHandle for Queued {
    fn state(&self) -> CommState {
        CommState::Ready
    }
    fn finalize(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn destroy(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn abort(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.log.borrow_mut().push("aborted");
    }
}

fn oom_on_cuda() -> Error {
    Error::OutOfMemory {
        rank: None,
        device: "cuda".into(),
        requested: Some(1 << 30),
        limit: None,
        detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
    }
}

/// One operation whose output allocation fails (`alloc_fails`) or whose queueing fails
/// (`queue_fails`), through the gate `gate`.
fn one_op(
    c: &GuardedComm<Queued>,
    log: &std::rc::Rc<RefCell<Vec<&'static str>>>,
    alloc_fails: bool,
    queue_fails: bool,
    gate: impl FnOnce(Option<&Error>) -> Result<()>,
) -> Result<Vec<f32>> {
    c.run(
        2,
        "all_reduce",
        || {
            log.borrow_mut().push("allocate");
            if alloc_fails {
                Err(oom_on_cuda())
            } else {
                Ok(vec![0.0f32; 4])
            }
        },
        gate,
        |_, out| {
            assert_eq!(out.len(), 4, "the outputs exist before anything is queued");
            log.borrow_mut().push("queue");
            if queue_fails {
                Err(Error::Nccl {
                    rank: 2,
                    op: "all_reduce".into(),
                    reason: "ncclInvalidUsage".into(),
                })
            } else {
                Ok(())
            }
        },
        |_| {
            log.borrow_mut().push("wait");
            Ok(())
        },
    )
}

#[test]
fn running_out_of_memory_for_the_outputs_queues_nothing_and_keeps_the_communicator() {
    let log = std::rc::Rc::new(RefCell::new(Vec::new()));
    let c = GuardedComm::new(Queued { log: log.clone() });
    let mut told = None;
    let e = one_op(&c, &log, true, false, |f| {
        told = Some(f.map(|e| e.is_out_of_memory()));
        Ok(())
    })
    .unwrap_err();
    // The gate heard of the failure; the error is an ordinary out-of-memory error, naming
    // the rank and the operation, that a batch-size search retries.
    assert_eq!(told, Some(Some(true)));
    assert!(e.is_out_of_memory(), "{e:?}");
    let text = e.to_string();
    assert!(text.starts_with("rank 2: out of memory on cuda"), "{text}");
    assert!(
        text.contains("all_reduce over NCCL, before anything was queued"),
        "{text}"
    );
    assert_eq!(*log.borrow(), ["allocate"]);
    assert_eq!(c.first_failure(), None);
    // The communicator still works.
    let out = one_op(&c, &log, false, false, |f| {
        assert!(f.is_none());
        Ok(())
    })
    .unwrap();
    assert_eq!(out.len(), 4);
    assert_eq!(*log.borrow(), ["allocate", "allocate", "queue", "wait"]);
}

#[test]
fn a_peer_that_ran_out_stops_this_rank_at_the_gate_before_anything_is_queued() {
    let log = std::rc::Rc::new(RefCell::new(Vec::new()));
    let c = GuardedComm::new(Queued { log: log.clone() });
    let e = one_op(&c, &log, false, false, |f| {
        assert!(f.is_none());
        Err(Error::PeerOutOfMemory {
            rank: 2,
            peer: 0,
            batch_size: 8,
            next_batch_size: 4,
        })
    })
    .unwrap_err();
    assert!(matches!(e, Error::PeerOutOfMemory { peer: 0, .. }), "{e:?}");
    assert_eq!(*log.borrow(), ["allocate"]);
    assert_eq!(c.first_failure(), None);
}

#[test]
fn a_failure_once_queued_aborts_the_communicator_for_good() {
    let log = std::rc::Rc::new(RefCell::new(Vec::new()));
    let c = GuardedComm::new(Queued { log: log.clone() });
    let e = one_op(&c, &log, false, true, |_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Nccl { rank: 2, .. }), "{e:?}");
    assert_eq!(*log.borrow(), ["allocate", "queue", "aborted"]);
    let e = one_op(&c, &log, false, false, |_| Ok(())).unwrap_err();
    match e {
        Error::Broken { rank: 2, first, .. } => assert!(first.contains("ncclInvalidUsage")),
        other => panic!("{other:?}"),
    }
    // Nothing more was prepared or queued.
    assert_eq!(*log.borrow(), ["allocate", "queue", "aborted"]);
}
