//! The life of one NCCL communicator, apart from NCCL itself: the watchdog that waits for it
//! (its creation, each operation, its finalization), how it is closed, and the checks made
//! before a tensor is handed to it.
//!
//! `nccl.rs` drives real communicators through [`CommHandle`]; the tests here drive fakes, so
//! every decision (a creation that never completes, an asynchronous network error, finalize or
//! abort, a tensor on the wrong GPU or stream, an allocation that fails) is checked on the CPU.
//!
//! - **Waiting** ([`wait`]): polls `ncclCommGetAsyncError` (and, for an operation, whether the
//!   work queued on the GPU is done) until done. An asynchronous error (a network failure with
//!   every process alive) fails at once, naming the rank, the operation and NCCL's error; a host
//!   peer that is gone fails within [`PEER_CHECK`]; past the deadline the error names the rank
//!   and the operation (no peer is guessed: NCCL does not say which one it waits for), with what
//!   to check (`NCCL_SOCKET_IFNAME`, `NCCL_DEBUG`).
//! - **Running an operation** ([`GuardedComm::run`]): validation and every allocation first,
//!   then the gate, then the NCCL calls (which allocate nothing), then the wait. Running out of
//!   memory is an ordinary error that leaves the communicator usable; a failure once something
//!   is queued aborts it.
//! - **Closing** ([`close`]): after a run that finished ([`Outcome::Finished`]), a barrier with
//!   every rank (so that no rank tears its communicator down while a peer's last operation may
//!   still need it), then `ncclCommFinalize` (this rank's outstanding work flushed, waited for
//!   with the watchdog) and `ncclCommDestroy`. Dropped without being told how the run ended
//!   ([`Outcome::Dropped`]): finalize and destroy without the barrier. After a failure
//!   ([`Outcome::Failed`]), or when a step of the orderly close fails: `ncclCommAbort`.

use std::time::{Duration, Instant};

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
            CommState::Failed(why) => return Err(failed(w, &why, check_peers)),
            CommState::Ready => {
                if done()? {
                    return Ok(());
                }
            }
            CommState::Pending => {}
        }
        let now = Instant::now();
        if now.duration_since(last_check) >= PEER_CHECK {
            check_peers().map_err(|e| gone(w, &e, "a peer is gone while NCCL waits"))?;
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

/// How long an NCCL error waits for the host collective to name a peer that is gone.
pub(crate) const NAME_THE_PEER: Duration = Duration::from_secs(1);

/// The error of a call NCCL refused to queue (`e`). Once a peer has died, NCCL refuses every
/// further call of the communicator with its asynchronous error (a remote or system error,
/// naming no rank): then, as for a failed wait, the host collective's peers are checked and a
/// peer found gone is named. Any other refusal is `e` as it is.
pub(crate) fn refused(
    w: &Wait<'_>,
    comm: &dyn CommHandle,
    e: Error,
    check_peers: &mut dyn FnMut() -> Result<()>,
) -> Error {
    match comm.state() {
        CommState::Failed(why) => failed(w, &why, check_peers),
        _ => {
            let text = e.to_string();
            if text.contains("ncclRemoteError") || text.contains("ncclSystemError") {
                failed(w, &text, check_peers)
            } else {
                e
            }
        }
    }
}

/// The error of a wait that `e` (from `check_peers`) says a peer is gone from, naming it.
fn gone(w: &Wait<'_>, e: &Error, what: &str) -> Error {
    Error::Peer {
        rank: w.rank,
        peer: match e {
            Error::Peer { peer, .. } | Error::Timeout { peer, .. } => *peer,
            _ => w.rank,
        },
        op: w.op.into(),
        reason: format!("{what}: {e}"),
        source: None,
    }
}

/// The error of a wait NCCL failed (`why`). A peer process that died (`kill -9`, a crash) shows
/// in NCCL as a remote or system error that does not say which rank it was; the host collective
/// knows, so its peers are checked for up to [`NAME_THE_PEER`] and a peer found gone is named
/// (with NCCL's report). Otherwise the error is NCCL's.
fn failed(w: &Wait<'_>, why: &str, check_peers: &mut dyn FnMut() -> Result<()>) -> Error {
    let start = Instant::now();
    loop {
        if let Err(e) = check_peers() {
            return gone(w, &e, &format!("NCCL reported {why}, and a peer is gone"));
        }
        if start.elapsed() >= NAME_THE_PEER {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Error::Nccl {
        rank: w.rank,
        op: w.op.into(),
        reason: format!(
            "NCCL reported {why} (a network or peer failure; NCCL_DEBUG=WARN prints NCCL's own account)"
        ),
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

/// Where a CUDA tensor's work runs: its GPU (an ordinal among this process's visible GPUs) and
/// the CUDA stream its Candle device queues everything on (the stream's handle, as a number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamPlace {
    /// The GPU's ordinal.
    pub(crate) ordinal: usize,
    /// The stream's handle (`CUstream`) as an address.
    pub(crate) stream: usize,
}

/// Refuses a tensor NCCL cannot use safely, before anything is queued; `want` is where the
/// communicator works, `got` where the tensor's device does (`None`: not a CUDA tensor, left to
/// the host path).
///
/// - **Another GPU**: NCCL would read or write memory of the wrong device.
/// - **The same GPU, another stream**: a tensor made on another Candle device of that GPU (a
///   user's own `Device::new_cuda(0)`, which queues on the calling thread's default stream).
///   NCCL runs on the communicator's stream and would read the tensor without waiting for the
///   kernels still writing it on the other one: a data race, and cudarc's cross-stream
///   tracking does not help (it is off on the crate's devices, see `settings::gpu`, and the
///   other device never entered cudarc's multi-stream mode).
///
/// Refused rather than ordered (an event recorded on the tensor's stream, the communicator's
/// stream made to wait for it): ordering the input is not enough. The output would belong to
/// the tensor's device too (Candle ties storage to a device), so it would be allocated and later
/// freed and read on the other stream, each needing ordering of its own that nothing else in
/// the crate provides; Candle refuses to mix the two devices in any operation anyway, so such a
/// tensor cannot meet the model's tensors; and the refusal costs nothing on the path of every
/// correct call, where ordering would cost an event per tensor. The error says how to get the
/// tensor onto the accelerator's device.
pub(crate) fn check_place(
    rank: usize,
    op: &str,
    want: StreamPlace,
    got: Option<StreamPlace>,
) -> Result<()> {
    let Some(got) = got else {
        return Ok(());
    };
    let reason = if got.ordinal != want.ordinal {
        format!(
            "the tensor is on GPU {}, but this rank's NCCL communicator drives GPU {}; move it there first (`tensor.to_device(accelerator.device())`)",
            got.ordinal, want.ordinal
        )
    } else if got.stream != want.stream {
        format!(
            "the tensor is on GPU {} but was made on another Candle device of it (a `Device::new_cuda` of your own?), whose work runs on CUDA stream {:#x}, not on this rank's stream {:#x} where NCCL runs: NCCL would read it before that stream's kernels are done with it. Make it on `accelerator.device()`, or copy it there through host memory (`t.to_device(&Device::Cpu)?.to_device(accelerator.device())`; a direct `to_device` between the two devices is not ordered either)",
            got.ordinal, got.stream, want.stream
        )
    } else {
        return Ok(());
    };
    Err(Error::Nccl {
        rank,
        op: op.into(),
        reason,
    })
}

/// One rank's NCCL communicator behind its lock, with its first failure: how every operation
/// is run (see [`GuardedComm::run`]). `C` is a real communicator in `nccl.rs`, a fake in the
/// tests; dropping a `C` aborts it (a real one aborts in its `Drop` unless it was closed).
pub(crate) struct GuardedComm<C> {
    comm: std::sync::Mutex<Option<C>>,
    broken: std::sync::Mutex<Option<String>>,
}

impl<C: CommHandle> GuardedComm<C> {
    /// A communicator that works.
    pub(crate) fn new(comm: C) -> Self {
        GuardedComm {
            comm: std::sync::Mutex::new(Some(comm)),
            broken: std::sync::Mutex::new(None),
        }
    }

    /// The first failure of an operation, once one failed.
    pub(crate) fn first_failure(&self) -> Option<String> {
        self.broken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes the communicator out, to close it; later operations fail with [`Error::Broken`].
    pub(crate) fn take(&self) -> Option<C> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Runs one operation in three phases:
    ///
    /// 1. `prepare` (validation, input copies, **every output buffer allocated**), then `gate`
    ///    with how it went (see [`Gate`](super::Gate)). A failure here, this rank's or one the
    ///    gate reports, is returned as it is (an out-of-memory error names the rank and the
    ///    operation): nothing was queued, so the communicator stays usable and a batch-size
    ///    search can retry.
    /// 2. `queue` on the communicator (under its lock), which allocates nothing.
    /// 3. `wait` for it (the watchdog).
    ///
    /// A failure in 2 or 3 is NCCL's or a peer's: the communicator is dropped (aborted, which
    /// unblocks NCCL kernels still waiting for a peer that will never come) and every later
    /// operation fails with [`Error::Broken`] naming the first failure.
    pub(crate) fn run<O>(
        &self,
        rank: usize,
        op: &str,
        prepare: impl FnOnce() -> Result<O>,
        gate: impl FnOnce(Option<&Error>) -> Result<()>,
        queue: impl FnOnce(&C, &O) -> Result<()>,
        wait: impl FnOnce(&C) -> Result<()>,
    ) -> Result<O> {
        if let Some(first) = self.first_failure() {
            return Err(Error::Broken {
                rank,
                op: op.into(),
                first,
            });
        }
        let prepared = prepare().map_err(|e| while_preparing(e, rank, op));
        let passed = gate(prepared.as_ref().err());
        let out = prepared?;
        passed?;
        let mut guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        let res = match guard.as_ref() {
            Some(comm) => queue(comm, &out).and_then(|()| wait(comm)),
            None => Err(Error::Broken {
                rank,
                op: op.into(),
                first: "the NCCL communicator was aborted".into(),
            }),
        };
        if let Err(e) = &res {
            drop(guard.take());
            self.broken
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| e.to_string());
        }
        res.map(|()| out)
    }
}

/// A failure while preparing `op`: running out of memory names the rank and says that nothing
/// was queued; any other error is returned as it is.
fn while_preparing(e: Error, rank: usize, op: &str) -> Error {
    match e {
        Error::OutOfMemory {
            rank: r,
            device,
            requested,
            limit,
            detail,
        } => Error::OutOfMemory {
            rank: r.or(Some(rank)),
            device,
            requested,
            limit,
            detail: format!(
                "{detail} (allocating the buffers of {op} over NCCL, before anything was queued: the communicator is intact)"
            ),
        },
        other => other,
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
                    Err(Error::Peer {
                        rank: 3,
                        peer: 1,
                        op: "check_peers".into(),
                        reason: "connection closed".into(),
                        source: None,
                    })
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
}
