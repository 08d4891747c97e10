//! Finding the largest batch size that fits in memory:
//! [`Accelerator::find_executable_batch_size`](crate::Accelerator::find_executable_batch_size)
//! (Hugging Face Accelerate's name), its options ([`BatchSizeSearch`]) and the agreement
//! protocol that keeps the ranks' collectives in step when only some of them run out of memory.
//!
//! ## What it does
//!
//! The training closure runs with a batch size, starting from `start`. When it fails with
//! [`Error::OutOfMemory`] on any rank, every rank learns it, the attempt is abandoned on every
//! rank, and all of them run the closure again with half the size (Accelerate's rule), in the
//! same processes. What the attempt prepared (models registered with `prepare`, pending
//! gradient accumulation) is forgotten before the retry; what was prepared before the search
//! stays. Build the model, optimizer and loader inside the closure, so that each attempt starts
//! afresh and the failed one's memory is freed.
//!
//! ## The protocol (several ranks)
//!
//! Running out of memory is asymmetric: one rank fails in its forward pass while the others
//! finish theirs and enter the gradient all-reduce, where they would wait for the failed rank
//! forever (or, with a mismatched call, garble the exchange). So, while an attempt is
//! *probing*, every collective call on the accelerator's communicator (the gradient buckets,
//! ZeRO's gathers, `gather`/`reduce`/`barrier` of the user, checkpoint agreement, ...) first
//! runs an *agreement*: one all-reduce with [`ReduceOp::Min`] of one `f64`, the rank's vote:
//!
//! | vote | value |
//! |---|---|
//! | failed with another error | `rank` |
//! | out of memory, proposes `next` | `W + next * W + rank` |
//! | healthy at batch size `b` | `W + b * W + rank` |
//!
//! (`W` the world size; every value is an integer below 2^53, exact in an `f64`.) A rank that
//! fails leaves the closure, and the search votes for it from outside the closure: its vote is
//! the very next collective it runs, and it matches whichever agreement its healthy peers are
//! at, because every collective they run starts with one. The minimum decides, identically on
//! every rank: `b` everywhere (all healthy: the collective runs), a smaller size (the lowest
//! failing rank ran out of memory: every rank abandons the attempt and retries with `next`), or
//! a rank (it failed otherwise: every rank stops, naming it). A healthy rank learns the verdict
//! from the collective it was calling, which returns [`Error::PeerOutOfMemory`] (or
//! [`Error::PeerFailed`]); the closure returns it with `?`, and every later collective of the
//! abandoned attempt returns it again without communicating. When the closure returns on every
//! rank, one last agreement confirms that no rank failed after the last collective.
//!
//! The probing lasts for the first [`probe_steps`](BatchSizeSearch::probe_steps) optimizer
//! sync steps of each attempt, whole (default [`BatchSizeSearch::DEFAULT_PROBE_STEPS`]: the
//! first step allocates the optimizer state, the second runs at the steady-state peak): it ends
//! with the agreement before the next step's gradient averaging, which every rank reaches (or
//! votes in from the search, having failed before it), so all of them stop probing at the same
//! collective. With [`probe_every_step`](BatchSizeSearch::probe_every_step) it lasts for the
//! whole attempt. After the
//! probing, collectives run as usual (no extra latency) and running out of memory is a fatal
//! [`Error::OutOfMemory`] naming the rank, returned at once: no rank waits for an agreement
//! that will not come. The failing rank's process ends with it, and its peers' collectives fail
//! naming it (at once on TCP and shared memory; through the collective timeout on NCCL).
//!
//! A collective that itself fails during the probing (a peer vanished, a mismatched call, an
//! invalid argument) leaves the ranks out of step: no agreement follows, and the error is
//! returned as it is.
//!
//! Rules for the closure: return errors at once (`?`); every rank must call the search with the
//! same `start` (checked: one more small collective before the first attempt).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use candle_core::Tensor;

use crate::collective::{Buffer, BufferMut, Collective, Gate, OwnedBuffer, ReduceOp};
use crate::error::{Error, Result};

/// The largest batch size a search may start from: votes stay exact in an `f64`.
const MAX_START: usize = 1 << 28;

/// How [`Accelerator::find_executable_batch_size_with`](crate::Accelerator::find_executable_batch_size_with)
/// searches: the first size, the smallest size allowed, and how long each attempt probes.
///
/// ```
/// use accelerate_rs::BatchSizeSearch;
/// let search = BatchSizeSearch::new(128).min_batch_size(8).probe_steps(2);
/// assert_eq!((search.start(), search.min(), search.probe()), (128, 8, Some(2)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSizeSearch {
    start: usize,
    min: usize,
    probe: Option<usize>,
}

impl BatchSizeSearch {
    /// Sync steps probed per attempt unless told otherwise: the first step allocates the
    /// optimizer state, the second runs at the steady-state peak, the third is a margin.
    pub const DEFAULT_PROBE_STEPS: usize = 3;

    /// Start at `start`, halve on every out-of-memory error down to 1, and probe the first
    /// [`DEFAULT_PROBE_STEPS`](Self::DEFAULT_PROBE_STEPS) sync steps of each attempt.
    pub fn new(start: usize) -> Self {
        BatchSizeSearch {
            start,
            min: 1,
            probe: Some(Self::DEFAULT_PROBE_STEPS),
        }
    }

    /// The smallest batch size to try (default 1): running out of memory below it ends the
    /// search with [`Error::NoExecutableBatchSize`].
    pub fn min_batch_size(mut self, min: usize) -> Self {
        self.min = min;
        self
    }

    /// Probe the first `steps` optimizer sync steps of each attempt (at least 1): running out of
    /// memory there retries with a smaller batch; afterwards it is fatal.
    pub fn probe_steps(mut self, steps: usize) -> Self {
        self.probe = Some(steps);
        self
    }

    /// Probe for the whole attempt (Accelerate's behaviour: running out of memory at any point
    /// retries), at the price of one small agreement collective before every collective.
    pub fn probe_every_step(mut self) -> Self {
        self.probe = None;
        self
    }

    /// The first batch size tried.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The smallest batch size tried.
    pub fn min(&self) -> usize {
        self.min
    }

    /// Sync steps probed per attempt; `None`: the whole attempt.
    pub fn probe(&self) -> Option<usize> {
        self.probe
    }

    /// Checks the options against each other and the world size.
    fn check(&self, world: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid("find_executable_batch_size", reason));
        if self.start == 0 || self.start > MAX_START {
            return bad(format!(
                "the starting batch size must be from 1 to {MAX_START}, got {}",
                self.start
            ));
        }
        if self.min == 0 || self.min > self.start {
            return bad(format!(
                "the smallest batch size must be from 1 to the starting size {}, got {}",
                self.start, self.min
            ));
        }
        if self.probe == Some(0) {
            return bad("probe_steps must be at least 1 (or use probe_every_step)".into());
        }
        if (self.start as u128 + 2) * world as u128 >= 1u128 << 53 {
            return bad(format!(
                "a starting batch size of {} over {world} ranks is too large to vote on",
                self.start
            ));
        }
        Ok(())
    }
}

/// A rank's vote in an agreement (see [the module](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vote {
    /// Healthy at the attempt's batch size.
    Healthy,
    /// Ran out of memory; proposes this size next.
    OutOfMemory(usize),
    /// Failed otherwise.
    Failed,
}

/// What an agreement decided, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Every rank is healthy.
    Continue,
    /// `rank` (the lowest such) ran out of memory: retry with `next`.
    OutOfMemory { rank: usize, next: usize },
    /// `rank` (the lowest such) failed otherwise: stop.
    Failed { rank: usize },
}

impl Verdict {
    /// The error a rank that did not fail itself returns for this verdict.
    fn error_for(self, rank: usize, batch_size: usize) -> Option<Error> {
        match self {
            Verdict::Continue => None,
            Verdict::OutOfMemory { rank: peer, next } => Some(Error::PeerOutOfMemory {
                rank,
                peer,
                batch_size,
                next_batch_size: next,
            }),
            Verdict::Failed { rank: peer } => Some(Error::PeerFailed {
                rank,
                peer,
                batch_size,
            }),
        }
    }
}

fn encode(vote: Vote, batch_size: usize, rank: usize, world: usize) -> f64 {
    let (w, r) = (world as u64, rank as u64);
    let v = match vote {
        Vote::Failed => r,
        Vote::OutOfMemory(next) => w + next as u64 * w + r,
        Vote::Healthy => w + batch_size as u64 * w + r,
    };
    v as f64
}

fn decode(m: f64, batch_size: usize, world: usize, me: usize) -> Result<Verdict> {
    let w = world as u64;
    // Every vote is a non-negative integer below 2^53, and so is their minimum.
    if !(m.is_finite() && m >= 0.0 && m.fract() == 0.0 && m < 9_007_199_254_740_992.0) {
        return Err(Error::Internal {
            what: format!("rank {me}: deciding a batch-size agreement"),
            reason: format!("the minimum vote {m} is not one any rank can cast"),
        });
    }
    let m = m as u64;
    if m < w {
        return Ok(Verdict::Failed { rank: m as usize });
    }
    let (size, rank) = ((m - w) / w, ((m - w) % w) as usize);
    match (size as usize).cmp(&batch_size) {
        std::cmp::Ordering::Equal => Ok(Verdict::Continue),
        std::cmp::Ordering::Less => Ok(Verdict::OutOfMemory {
            rank,
            next: size as usize,
        }),
        std::cmp::Ordering::Greater => Err(Error::Mismatch {
            rank: me,
            op: "find_executable_batch_size".into(),
            detail: format!(
                "rank {rank} is at batch size {size}, this rank at {batch_size}: the ranks are not running the same search"
            ),
        }),
    }
}

/// One agreement: this rank's vote against everyone's, over `c` itself (never the probed
/// wrapper).
fn agree(c: &dyn Collective, vote: Vote, batch_size: usize) -> Result<Verdict> {
    let (me, world) = (c.rank(), c.world_size());
    let mut v = [encode(vote, batch_size, me, world)];
    c.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Min)?;
    decode(v[0], batch_size, world, me)
}

/// The state of an attempt, shared by the probed collective, the gradient engine (which tells
/// it of sync steps) and the search.
#[derive(Debug)]
pub(crate) struct Probe {
    /// The backend's communicator: the agreements run on it.
    raw: Arc<dyn Collective>,
    /// Fast path of every collective: whether to agree first (an attempt is probing and the
    /// world has more than one rank).
    agreeing: AtomicBool,
    state: Mutex<ProbeState>,
}

#[derive(Debug, Default)]
struct ProbeState {
    /// Whether a search is running an attempt.
    running: bool,
    /// The attempt's batch size.
    batch_size: usize,
    /// Sync steps left to probe; `None`: the whole attempt.
    steps_left: Option<usize>,
    /// Whether the attempt is still probing.
    probing: bool,
    /// The last probed sync step is done: the probing ends with the agreement before the next
    /// gradient averaging.
    closing: bool,
    /// What an agreement inside the attempt decided, when it abandoned the attempt.
    verdict: Option<Verdict>,
    /// A collective failed after its agreement: the ranks are out of step.
    broken: bool,
}

fn lock(m: &Mutex<ProbeState>) -> MutexGuard<'_, ProbeState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Probe {
    /// The attempt state of an accelerator whose backend communicator is `raw`, installed as
    /// `raw`'s [`Gate`] (held weakly there: the probe owns `raw`, not the other way round).
    pub(crate) fn install(raw: Arc<dyn Collective>) -> Arc<Self> {
        let probe = Arc::new(Probe {
            raw,
            agreeing: AtomicBool::new(false),
            state: Mutex::new(ProbeState::default()),
        });
        let gate: Weak<dyn Gate> = Arc::downgrade(&probe) as Weak<Probe>;
        probe.raw.add_gate(gate);
        probe
    }

    /// The backend's communicator.
    fn raw(&self) -> &dyn Collective {
        self.raw.as_ref()
    }

    /// Starts an attempt at `batch_size`.
    fn begin(&self, batch_size: usize, steps: Option<usize>) {
        let mut s = lock(&self.state);
        *s = ProbeState {
            running: true,
            batch_size,
            steps_left: steps,
            probing: true,
            closing: false,
            verdict: None,
            broken: false,
        };
        self.agreeing
            .store(self.raw.world_size() > 1, Ordering::Release);
    }

    /// Ends the attempt: (still probing, the verdict of an agreement inside it, broken).
    fn end(&self) -> (bool, Option<Verdict>, bool) {
        self.agreeing.store(false, Ordering::Release);
        let mut s = lock(&self.state);
        s.running = false;
        (s.probing, s.verdict.take(), s.broken)
    }

    /// Called by the gradient engine after each sync step (gradients averaged on every rank):
    /// after the last probed one, the probing is closing.
    pub(crate) fn sync_step_done(&self) {
        let mut s = lock(&self.state);
        if !s.running || !s.probing {
            return;
        }
        if let Some(n) = s.steps_left.as_mut() {
            *n = n.saturating_sub(1);
            s.closing = *n == 0;
        }
    }

    /// Called by the gradient engine before each gradient averaging: when the probing is
    /// closing, one last agreement (every rank is here, or failed before and votes from the
    /// search), then no more. So the last probed step is probed whole, its optimizer step and
    /// everything up to the next averaging included.
    pub(crate) fn sync_step_starting(&self) -> Result<()> {
        {
            let s = lock(&self.state);
            if !(s.running && s.probing && s.closing) {
                return Ok(());
            }
        }
        self.before()?;
        lock(&self.state).probing = false;
        self.agreeing.store(false, Ordering::Release);
        Ok(())
    }

    /// Before a collective of the probed communicator: the agreement (see [the module](self)).
    fn before(&self) -> Result<()> {
        self.agree_now(None)
    }

    /// One agreement while probing, this rank's vote from `failure`: healthy (`None`), out of
    /// memory, or failed otherwise.
    fn agree_now(&self, failure: Option<&Error>) -> Result<()> {
        if !self.agreeing.load(Ordering::Acquire) {
            return Ok(());
        }
        let me = self.raw.rank();
        let b = {
            let s = lock(&self.state);
            if !s.probing {
                return Ok(());
            }
            if let Some(e) = s.verdict.and_then(|v| v.error_for(me, s.batch_size)) {
                return Err(e);
            }
            if s.broken {
                return Err(Error::Broken {
                    rank: me,
                    op: "a collective while probing the batch size".into(),
                    first: "an earlier collective of this attempt failed".into(),
                });
            }
            s.batch_size
        };
        let vote = match failure {
            None => Vote::Healthy,
            Some(e) if e.is_out_of_memory() => Vote::OutOfMemory(b / 2),
            Some(_) => Vote::Failed,
        };
        let verdict = match agree(self.raw(), vote, b) {
            Ok(v) => v,
            Err(e) => {
                lock(&self.state).broken = true;
                return Err(e);
            }
        };
        match verdict.error_for(me, b) {
            None => Ok(()),
            Some(e) => {
                lock(&self.state).verdict = Some(verdict);
                Err(e)
            }
        }
    }

    /// After a collective of the probed communicator: a failure while probing leaves the
    /// ranks out of step, unless an agreement inside the collective (its [`Gate`]) decided it:
    /// then every rank returned from the same collective without communicating.
    fn after<T>(&self, r: Result<T>) -> Result<T> {
        if r.is_err() && self.agreeing.load(Ordering::Acquire) {
            let mut s = lock(&self.state);
            if s.verdict.is_none() {
                s.broken = true;
            }
        }
        r
    }
}

/// The backend's gate (see [`Collective::add_gate`]): while probing, a second agreement inside
/// each collective that allocates device memory before communicating (NCCL's outputs), after the
/// allocation and before anything is sent. A rank whose allocation failed votes out of memory
/// there, so every rank abandons the attempt together and retries smaller, as when it runs out
/// anywhere else; outside the probing it lets everything through.
impl Gate for Probe {
    fn pass(&self, _op: &str, failure: Option<&Error>) -> Result<()> {
        self.agree_now(failure)
    }
}

/// The accelerator's communicator: the backend's, with the agreement of [`Probe`] before every
/// collective while a batch-size search probes (an atomic load otherwise). It forwards every
/// method of [`Collective`] to the backend's own (checked by
/// [`check_wrapper`](crate::collective::forwarding::check_wrapper) in the tests): a method left
/// to a host fallback here once turned NCCL's batched gradient all-reduce into one NCCL group
/// and one host wait per bucket.
#[derive(Debug)]
pub(crate) struct ProbedCollective {
    probe: Arc<Probe>,
}

impl ProbedCollective {
    /// The backend's communicator of `probe`, probed by it.
    pub(crate) fn new(probe: Arc<Probe>) -> Self {
        ProbedCollective { probe }
    }

    fn run<T>(&self, f: impl FnOnce(&dyn Collective) -> Result<T>) -> Result<T> {
        self.probe.before()?;
        self.probe.after(f(self.probe.raw()))
    }
}

impl Collective for ProbedCollective {
    fn rank(&self) -> usize {
        self.probe.raw().rank()
    }
    fn world_size(&self) -> usize {
        self.probe.raw().world_size()
    }
    fn backend(&self) -> &'static str {
        self.probe.raw().backend()
    }
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        self.run(|c| c.all_reduce(buf, op))
    }
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
        self.run(|c| c.broadcast(buf, root))
    }
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        self.run(|c| c.all_gather(buf))
    }
    fn barrier(&self) -> Result<()> {
        self.run(|c| c.barrier())
    }
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        self.run(|c| c.reduce_scatter(buf, op))
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
        self.run(|c| c.all_gather_into(buf))
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.run(|c| c.reduce_scatter_tensor(t, op))
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        self.run(|c| c.all_gather_into_tensor(t))
    }
    fn check_peers(&self) -> Result<()> {
        self.probe.raw().check_peers()
    }
    fn set_run_outcome(&self, finished: bool) {
        self.probe.raw().set_run_outcome(finished)
    }
    fn add_gate(&self, gate: Weak<dyn Gate>) {
        self.probe.raw().add_gate(gate)
    }
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.run(|c| c.all_reduce_tensor(t, op))
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        self.run(|c| c.all_reduce_tensors(ts, op))
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.run(|c| c.broadcast_tensor(t, root))
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        self.run(|c| c.all_gather_tensor(t))
    }
}

/// One attempt of a search; ends it when dropped (see [`Searcher::run`]).
struct Attempt<'a>(&'a Probe);

impl Attempt<'_> {
    fn end(self) -> (bool, Option<Verdict>, bool) {
        self.0.end()
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// What the search needs from the accelerator.
pub(crate) struct Searcher<'a> {
    /// The attempt state shared with the probed communicator and the gradient engine.
    pub(crate) probe: &'a Probe,
    /// The accelerator's device, for messages and to release cached memory after running out.
    pub(crate) device: &'a candle_core::Device,
    /// Called before each retry: forget what the failed attempt prepared.
    pub(crate) restart: &'a dyn Fn(),
}

impl Searcher<'_> {
    /// Runs the search (see [the module](self)).
    pub(crate) fn run<T>(
        &self,
        search: BatchSizeSearch,
        mut f: impl FnMut(usize) -> Result<T>,
    ) -> Result<T> {
        let raw = self.probe.raw();
        let (me, world) = (raw.rank(), raw.world_size());
        search.check(world)?;
        if lock(&self.probe.state).running {
            return Err(Error::invalid(
                "find_executable_batch_size",
                format!("rank {me}: a search is already running on this accelerator (the closure must not start another)"),
            ));
        }
        if world > 1 {
            self.same_search_everywhere(search)?;
        }
        let mut b = search.start;
        let mut tried = Vec::new();
        loop {
            tried.push(b);
            self.probe.begin(b, search.probe);
            // Ends the attempt even when `f` panics (a DP replica's panic is caught and
            // reported), so the communicator does not go on agreeing.
            let attempt = Attempt(self.probe);
            let result = f(b);
            let (probing, verdict, broken) = attempt.end();
            let verdict = match verdict {
                _ if broken => return result.map_err(|e| e.on_rank(me, self.device)),
                Some(v) => v,
                None if !probing => return result.map_err(|e| e.on_rank(me, self.device)),
                None => self.vote(&result, b)?,
            };
            match verdict {
                Verdict::Continue => return result,
                Verdict::Failed { rank } => {
                    return match result {
                        Err(e) if rank == me => Err(e.on_rank(me, self.device)),
                        _ => Err(Error::PeerFailed {
                            rank: me,
                            peer: rank,
                            batch_size: b,
                        }),
                    }
                }
                Verdict::OutOfMemory { rank, next } => {
                    if let Err(e) = result {
                        if rank == me && e.is_out_of_memory() {
                            log::info!("{}", e.on_rank(me, self.device));
                        }
                    }
                    if next < search.min {
                        return Err(Error::NoExecutableBatchSize {
                            rank: me,
                            tried,
                            oom_rank: rank,
                            min_batch_size: search.min,
                        });
                    }
                    self.prepare_retry(rank, b, next);
                    b = next;
                }
            }
        }
    }

    /// The verdict of an attempt nothing decided during its run: this rank's vote on `result`,
    /// agreed with the other ranks (one collective) when there are any.
    fn vote<T>(&self, result: &Result<T>, b: usize) -> Result<Verdict> {
        let raw = self.probe.raw();
        let (me, world) = (raw.rank(), raw.world_size());
        let vote = match result {
            Ok(_) => Vote::Healthy,
            Err(e) if e.is_out_of_memory() => Vote::OutOfMemory(b / 2),
            Err(_) => Vote::Failed,
        };
        if world > 1 {
            return agree(raw, vote, b);
        }
        Ok(match vote {
            Vote::Healthy => Verdict::Continue,
            Vote::OutOfMemory(next) => Verdict::OutOfMemory { rank: me, next },
            Vote::Failed => Verdict::Failed { rank: me },
        })
    }

    /// Before retrying at `next` after `rank` ran out of memory at `b`: say so (rank 0), forget
    /// what the attempt prepared, and give the GPU pool's cached memory back.
    fn prepare_retry(&self, rank: usize, b: usize, next: usize) {
        let me = self.probe.raw().rank();
        if me == 0 {
            crate::logging::warn_always(format_args!(
                "find_executable_batch_size: rank {rank} ran out of memory at batch size {b}; every rank retries with batch size {next}"
            ));
        }
        (self.restart)();
        // The failed attempt's tensors are gone; what the GPU's pool kept of them goes back, so
        // that the smaller attempt can have it in any shape.
        if let Err(e) = crate::settings::gpu::release_cached_memory(self.device) {
            log::warn!("rank {me}: find_executable_batch_size: {e}");
        }
    }

    /// Every rank passes the same start and smallest size (one small collective).
    fn same_search_everywhere(&self, search: BatchSizeSearch) -> Result<()> {
        let (s, m) = (search.start as f64, search.min as f64);
        let mut v = [s, -s, m, -m];
        let raw = self.probe.raw();
        raw.all_reduce(BufferMut::from(&mut v[..]), ReduceOp::Min)?;
        if v[0] != -v[1] || v[2] != -v[3] {
            return Err(Error::Mismatch {
                rank: raw.rank(),
                op: "find_executable_batch_size".into(),
                detail: format!(
                    "the ranks passed different searches: starting batch sizes from {} to {}, smallest sizes from {} to {}; every rank must pass the same",
                    v[0], -v[1], v[2], -v[3]
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn votes_decode_to_the_same_verdict_everywhere() {
        for world in [1usize, 2, 3, 7] {
            for b in [1usize, 2, 37, 64, MAX_START] {
                let all = |votes: &[(usize, Vote)]| {
                    let m = votes
                        .iter()
                        .map(|&(r, v)| encode(v, b, r, world))
                        .fold(f64::INFINITY, f64::min);
                    decode(m, b, world, 0).unwrap()
                };
                let healthy: Vec<_> = (0..world).map(|r| (r, Vote::Healthy)).collect();
                assert_eq!(all(&healthy), Verdict::Continue);
                let mut oom = healthy.clone();
                oom[world - 1].1 = Vote::OutOfMemory(b / 2);
                assert_eq!(
                    all(&oom),
                    Verdict::OutOfMemory {
                        rank: world - 1,
                        next: b / 2
                    }
                );
                if world > 1 {
                    // The lowest failing rank is named; a failure beats running out of memory.
                    let mut two = oom.clone();
                    two[1].1 = Vote::OutOfMemory(b / 2);
                    assert_eq!(
                        all(&two),
                        Verdict::OutOfMemory {
                            rank: 1,
                            next: b / 2
                        }
                    );
                    two[world - 1].1 = Vote::Failed;
                    assert_eq!(all(&two), Verdict::Failed { rank: world - 1 });
                }
            }
        }
        assert!(decode(f64::NAN, 4, 2, 0).is_err());
        assert!(decode(0.5, 4, 2, 0).is_err());
        // A rank ahead of this one: not the same search.
        assert!(decode(encode(Vote::Healthy, 8, 1, 2), 4, 2, 0).is_err());
    }

    #[test]
    fn the_probed_collective_forwards_every_method() {
        crate::collective::forwarding::check_wrapper("ProbedCollective", |c| {
            Arc::new(ProbedCollective::new(Probe::install(c)))
        })
        .unwrap();
    }

    #[test]
    fn searches_are_checked() {
        assert!(BatchSizeSearch::new(0).check(1).is_err());
        assert!(BatchSizeSearch::new(4).min_batch_size(5).check(1).is_err());
        assert!(BatchSizeSearch::new(4).min_batch_size(0).check(1).is_err());
        assert!(BatchSizeSearch::new(4).probe_steps(0).check(1).is_err());
        assert!(BatchSizeSearch::new(MAX_START + 1).check(1).is_err());
        assert!(BatchSizeSearch::new(MAX_START).check(1 << 24).is_ok());
        assert!(BatchSizeSearch::new(4).probe_every_step().check(3).is_ok());
    }
}
