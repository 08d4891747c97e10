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
#[path = "life_tests.rs"]
mod tests;
