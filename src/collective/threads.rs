//! Several ranks as threads of one process, meeting in shared memory.
//!
//! Each operation is a rendezvous: every rank deposits its contribution, the last one to arrive
//! opens the gate, every rank computes its result from all contributions (in rank order, so all
//! ranks get bit-identical results), and the slots are cleared once all have read them.
//!
//! `all_reduce`, `reduce_scatter` and `all_gather_into` copy nothing in: the rendezvous
//! exchanges the addresses of the ranks' own buffers, then each rank reduces its share
//! ([`chunk_range`](super::chunk_range)) straight from the others' buffers into its own (phase
//! 1), and copies the other shares from their owners' buffers (phase 2), all ranks in parallel.
//! A gate after each phase keeps every buffer alive and unchanged while others read it: once
//! the addresses are exchanged, a rank returns only when every other rank has passed the gate
//! or left the group (its communicator dropped), never on a timeout.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::{
    check_reducible, check_root, chunk_range, finish_mean, reduce_into, AlignedBytes, Buffer,
    BufferMut, Collective, ElemType, OwnedBuffer, ReduceOp,
};
use crate::error::{Error, Result};

/// Yields (lock released) before a wait falls back to the condition variable.
const SPINS: u32 = 200;

/// Creates the ranks of an in-process group.
#[derive(Debug)]
pub struct ThreadGroup;

impl ThreadGroup {
    /// `world_size` communicators, one per rank; move each into its own thread. Every operation
    /// waits at most `timeout` for the other ranks.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world_size: usize, timeout: Duration) -> Result<Vec<ThreadCollective>> {
        if world_size == 0 {
            return Err(Error::invalid(
                "world size",
                "a thread group needs at least 1 rank",
            ));
        }
        let shared = Arc::new(Shared {
            n: world_size,
            timeout,
            state: Mutex::new(State {
                collecting: true,
                slots: (0..world_size).map(|_| None).collect(),
                arrived: 0,
                read: 0,
                departed: vec![false; world_size],
                broken: None,
                gate_arrived: 0,
                gate_gen: 0,
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadCollective {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }
}

/// One rank of a [`ThreadGroup`].
#[derive(Debug)]
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    n: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Clone, Debug, PartialEq)]
struct OpDesc {
    op: &'static str,
    elem: ElemType,
    /// Element count, for operations that need equal sizes.
    count: Option<usize>,
    /// Root or reduce op.
    aux: u64,
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.count {
            Some(c) => write!(f, "{}({} x {c}, {})", self.op, self.elem, self.aux),
            None => write!(f, "{}({})", self.op, self.elem),
        }
    }
}

#[derive(Debug)]
struct State {
    /// True while ranks are depositing; false while they read the results.
    collecting: bool,
    slots: Vec<Option<(OpDesc, AlignedBytes)>>,
    arrived: usize,
    read: usize,
    departed: Vec<bool>,
    broken: Option<String>,
    /// Ranks waiting at the current gate of a direct operation.
    gate_arrived: usize,
    /// Gates opened so far.
    gate_gen: u64,
}

impl ThreadCollective {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in another rank's thread must not take this one down with it: the state is
        // still consistent because every mutation completes under the lock.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits for a change of the state (or the deadline): first a few short yields with the
    /// lock released (the other ranks are usually microseconds away, and a condition variable
    /// wake-up costs tens of them), then the condition variable. `spins` counts the yields of
    /// the caller's current wait. Returns whether the deadline passed.
    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, State>,
        deadline: Instant,
        spins: &mut u32,
    ) -> (MutexGuard<'a, State>, bool) {
        if *spins < SPINS {
            *spins += 1;
            drop(st);
            std::thread::yield_now();
            return (self.lock(), false);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let (st, res) = self
            .shared
            .cv
            .wait_timeout(st, left)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (st, res.timed_out() && Instant::now() >= deadline)
    }

    fn fail(&self, st: &mut State, err: Error) -> Error {
        if st.broken.is_none() {
            st.broken = Some(err.to_string());
        }
        self.shared.cv.notify_all();
        err
    }

    /// One operation: wait for the previous one to be read by everyone, deposit this rank's
    /// slot, wait for every rank's, check they agree and `compute` the result; the last rank to
    /// read clears the slots.
    fn rendezvous<R>(
        &self,
        desc: OpDesc,
        data: AlignedBytes,
        compute: impl FnOnce(&[Option<(OpDesc, AlignedBytes)>]) -> Result<R>,
    ) -> Result<R> {
        let n = self.shared.n;
        let op = desc.op;
        let deadline = crate::settings::limits::deadline_after(self.shared.timeout);
        let mut spins = 0;
        let st = self.lock();
        let mut st = self.await_previous(st, op, deadline, &mut spins)?;
        st.slots[self.rank] = Some((desc, data));
        st.arrived += 1;
        if st.arrived == n {
            st.collecting = false;
            self.shared.cv.notify_all();
        }
        let mut st = self.await_everyone(st, op, deadline, &mut spins)?;
        let result = match mismatch(&st.slots) {
            Some(detail) => Err(Error::Mismatch {
                rank: self.rank,
                op: op.into(),
                detail,
            }),
            None => compute(&st.slots),
        };
        if let Err(e) = &result {
            if st.broken.is_none() {
                st.broken = Some(e.to_string());
            }
        }
        st.read += 1;
        if st.read == n {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.arrived = 0;
            st.read = 0;
            st.collecting = true;
            self.shared.cv.notify_all();
        }
        result
    }

    /// Waits until the previous operation's results have been read by everyone (the group
    /// collects again), or fails: the group is broken, or the deadline passed.
    fn await_previous<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        deadline: Instant,
        spins: &mut u32,
    ) -> Result<MutexGuard<'a, State>> {
        while !st.collecting {
            if let Some(first) = &st.broken {
                return Err(self.broken(op, first));
            }
            let (g, timed_out) = self.wait(st, deadline, spins);
            st = g;
            if timed_out && !st.collecting {
                let err = Error::Timeout {
                    rank: self.rank,
                    peer: self.first_missing(&st).unwrap_or(self.rank),
                    op: op.into(),
                    timeout: self.shared.timeout,
                };
                return Err(self.fail(&mut st, err));
            }
        }
        if let Some(first) = &st.broken {
            return Err(self.broken(op, first));
        }
        Ok(st)
    }

    /// Waits until every rank has deposited its slot, or fails: the group is broken, a rank left
    /// without depositing, or the deadline passed.
    fn await_everyone<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        deadline: Instant,
        spins: &mut u32,
    ) -> Result<MutexGuard<'a, State>> {
        let n = self.shared.n;
        while st.collecting {
            if let Some(first) = &st.broken {
                let err = self.broken(op, first);
                return Err(err);
            }
            if let Some(peer) = (0..n).find(|&r| st.departed[r] && st.slots[r].is_none()) {
                let err = Error::Peer {
                    rank: self.rank,
                    peer,
                    op: op.into(),
                    reason: "that rank left the group (its communicator was dropped)".into(),
                    source: None,
                };
                return Err(self.fail(&mut st, err));
            }
            let (g, timed_out) = self.wait(st, deadline, spins);
            st = g;
            if timed_out && st.collecting {
                let err = Error::Timeout {
                    rank: self.rank,
                    peer: self.first_missing(&st).unwrap_or(self.rank),
                    op: op.into(),
                    timeout: self.shared.timeout,
                };
                return Err(self.fail(&mut st, err));
            }
        }
        Ok(st)
    }

    /// Waits until every other rank has reached this gate or left the group. Never times out:
    /// it is only used once every rank has committed to the operation, and other ranks may be
    /// reading this rank's buffer until they pass it. A rank that left is reported (after the
    /// live ones arrived).
    fn gate(&self, op: &str) -> Result<()> {
        let n = self.shared.n;
        let mut st = self.lock();
        let gen = st.gate_gen;
        let mut spins = 0;
        st.gate_arrived += 1;
        if st.gate_arrived == n {
            st.gate_arrived = 0;
            st.gate_gen += 1;
            self.shared.cv.notify_all();
            return Ok(());
        }
        loop {
            if st.gate_gen != gen {
                return Ok(());
            }
            let gone = st.departed.iter().filter(|&&d| d).count();
            if gone > 0 && st.gate_arrived + gone >= n {
                let peer = st.departed.iter().position(|&d| d).unwrap_or(self.rank);
                let err = Error::Peer {
                    rank: self.rank,
                    peer,
                    op: op.into(),
                    reason: "that rank left the group (its communicator was dropped)".into(),
                    source: None,
                };
                return Err(self.fail(&mut st, err));
            }
            if spins < SPINS {
                spins += 1;
                drop(st);
                std::thread::yield_now();
                st = self.lock();
                continue;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, Duration::from_millis(500))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// A direct operation on `bytes` (see [the module](self)): exchanges the buffers' addresses,
    /// then with `reduce` reduces this rank's share from every buffer into this one (phase 1)
    /// and with `gather` copies every other share from its owner (phase 2), a gate after each.
    fn direct(
        &self,
        desc: OpDesc,
        bytes: &mut [u8],
        reduce: Option<ReduceOp>,
        gather: bool,
    ) -> Result<()> {
        let (n, me) = (self.shared.n, self.rank);
        let (op, elem) = (desc.op, desc.elem);
        let esize = elem.size();
        let len = bytes.len();
        // From here on this rank touches its buffer only through `base`, like the others do.
        let base = bytes.as_mut_ptr();
        let mut mine = AlignedBytes::zeroed(8);
        mine.as_mut()
            .copy_from_slice(&(base as usize as u64).to_le_bytes());
        let addrs: Vec<usize> = self.rendezvous(desc, mine, |slots| {
            (0..n)
                .map(|r| {
                    let b = slot(slots, r)?.as_ref();
                    let mut word = [0u8; 8];
                    word.copy_from_slice(b.get(..8).unwrap_or(&[0; 8]));
                    Ok(u64::from_le_bytes(word) as usize)
                })
                .collect()
        })?;
        // Every rank passed the same length (the rendezvous compared the counts).
        let share = |r: usize| {
            let c = chunk_range(len / esize, n, r);
            c.start * esize..c.end * esize
        };
        let mut result = Ok(());
        if let Some(rop) = reduce {
            let own = share(me);
            // SAFETY: `base` is this rank's buffer of `len` bytes, borrowed mutably for this
            // whole call; `own` lies within it. In phase 1 only this rank writes share `me` of
            // any buffer, and it only reads share `me` of the others', which their owners do not
            // write in this phase; every buffer stays alive and unmoved until its owner passes
            // the gate below, which it does only after every other rank arrived there (or left
            // the group, after which it reads nothing).
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(own.start), own.len()) };
            let acc = rop.accumulating();
            for r in (0..n).filter(|&r| r != me) {
                // SAFETY: see above; rank `r`'s buffer has the same length `len`.
                let src = unsafe {
                    std::slice::from_raw_parts((addrs[r] as *const u8).add(own.start), own.len())
                };
                if let Err(e) = reduce_into(elem, acc, dst, src) {
                    result = Err(e);
                    break;
                }
            }
            if result.is_ok() && rop == ReduceOp::Mean {
                result = finish_mean(elem, dst, n);
            }
            self.gate(op)?;
        }
        if gather {
            for r in (0..n).filter(|&r| r != me) {
                let theirs = share(r);
                // SAFETY: in phase 2 each rank writes only the shares of its own buffer that it
                // does not own and reads only the share each other rank owns in that rank's
                // buffer, which nobody writes in this phase; the buffers stay alive until their
                // owners pass the gate below (see phase 1).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (addrs[r] as *const u8).add(theirs.start),
                        base.add(theirs.start),
                        theirs.len(),
                    );
                }
            }
            self.gate(op)?;
        }
        result
    }

    fn first_missing(&self, st: &State) -> Option<usize> {
        (0..self.shared.n).find(|&r| st.slots[r].is_none())
    }

    fn broken(&self, op: &str, first: &str) -> Error {
        Error::Broken {
            rank: self.rank,
            op: op.into(),
            first: first.into(),
        }
    }
}

fn mismatch(slots: &[Option<(OpDesc, AlignedBytes)>]) -> Option<String> {
    let first = slots.first()?.as_ref()?.0.clone();
    if slots
        .iter()
        .all(|s| s.as_ref().is_some_and(|(d, _)| *d == first))
    {
        return None;
    }
    let all: Vec<String> = slots
        .iter()
        .enumerate()
        .map(|(r, s)| match s {
            Some((d, _)) => format!("rank {r}: {d}"),
            None => format!("rank {r}: -"),
        })
        .collect();
    Some(all.join(", "))
}

fn slot(slots: &[Option<(OpDesc, AlignedBytes)>], r: usize) -> Result<&AlignedBytes> {
    slots
        .get(r)
        .and_then(|s| s.as_ref())
        .map(|(_, d)| d)
        .ok_or_else(|| Error::invalid("thread group", format!("rank {r} has no contribution")))
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.n
    }
    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_reduce(&self, mut buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        check_reducible(buf.elem(), op)?;
        if self.shared.n == 1 {
            return Ok(());
        }
        let desc = OpDesc {
            op: "all_reduce",
            elem: buf.elem(),
            count: Some(buf.len()),
            aux: op.code() as u64,
        };
        self.direct(desc, buf.bytes_mut(), Some(op), true)
    }

    fn reduce_scatter(&self, mut buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        check_reducible(buf.elem(), op)?;
        if self.shared.n == 1 {
            return Ok(());
        }
        let desc = OpDesc {
            op: "reduce_scatter",
            elem: buf.elem(),
            count: Some(buf.len()),
            aux: op.code() as u64,
        };
        self.direct(desc, buf.bytes_mut(), Some(op), false)
    }

    fn all_gather_into(&self, mut buf: BufferMut<'_>) -> Result<()> {
        if self.shared.n == 1 {
            return Ok(());
        }
        let desc = OpDesc {
            op: "all_gather_into",
            elem: buf.elem(),
            count: Some(buf.len()),
            aux: 0,
        };
        self.direct(desc, buf.bytes_mut(), None, true)
    }

    fn broadcast(&self, mut buf: BufferMut<'_>, root: usize) -> Result<()> {
        check_root(root, self.shared.n, self.rank)?;
        if self.shared.n == 1 {
            return Ok(());
        }
        let desc = OpDesc {
            op: "broadcast",
            elem: buf.elem(),
            count: Some(buf.len()),
            aux: root as u64,
        };
        let data = if self.rank == root {
            AlignedBytes::copy_from(buf.bytes())
        } else {
            AlignedBytes::default()
        };
        let me = self.rank;
        let out = buf.bytes_mut();
        self.rendezvous(desc, data, |slots| {
            if me != root {
                out.copy_from_slice(slot(slots, root)?.as_ref());
            }
            Ok(())
        })
    }

    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        let elem = buf.elem();
        if self.shared.n == 1 {
            return Ok(vec![OwnedBuffer::new(
                AlignedBytes::copy_from(buf.bytes()),
                elem,
            )]);
        }
        let desc = OpDesc {
            op: "all_gather",
            elem,
            count: None,
            aux: 0,
        };
        let n = self.shared.n;
        self.rendezvous(desc, AlignedBytes::copy_from(buf.bytes()), |slots| {
            (0..n)
                .map(|r| Ok(OwnedBuffer::new(slot(slots, r)?.clone(), elem)))
                .collect()
        })
    }

    fn barrier(&self) -> Result<()> {
        if self.shared.n == 1 {
            return Ok(());
        }
        let desc = OpDesc {
            op: "barrier",
            elem: ElemType::U8,
            count: Some(0),
            aux: 0,
        };
        self.rendezvous(desc, AlignedBytes::default(), |_| Ok(()))
    }

    fn check_peers(&self) -> Result<()> {
        let st = self.lock();
        if let Some(first) = &st.broken {
            return Err(self.broken("check_peers", first));
        }
        match st.departed.iter().position(|&d| d) {
            Some(peer) => Err(Error::Peer {
                rank: self.rank,
                peer,
                op: "check_peers".into(),
                reason: "that rank left the group (its communicator was dropped)".into(),
                source: None,
            }),
            None => Ok(()),
        }
    }
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::reduce_scatter_tensor(self, t, op)
    }
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_into_tensor(self, t)
    }
    fn set_run_outcome(&self, _finished: bool) {}
    fn add_gate(&self, _gate: std::sync::Weak<dyn super::Gate>) {}
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        super::fallback::all_reduce_tensor(self, t, op)
    }
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        super::fallback::all_reduce_tensors(self, ts, op)
    }
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::fallback::broadcast_tensor(self, t, root)
    }
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        super::fallback::all_gather_tensor(self, t)
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.departed[self.rank] = true;
        self.shared.cv.notify_all();
    }
}
