//! Same-host shared-memory data path of [`TcpCollective`](super::TcpCollective), like NCCL's SHM
//! transport.
//!
//! When every rank runs on one machine (same hostname and boot id, all-gathered over the TCP ring
//! at connect time), `all_reduce` and `broadcast` move their data through one shared segment
//! instead of the sockets. The TCP ring stays: it forms the group, carries `all_gather` and
//! `barrier`, and its sockets tell a waiting rank that a peer died.
//!
//! ## Segment
//!
//! Rank 0 creates an anonymous memory file (`memfd_create`; where that is not available, a file
//! under `/dev/shm` or the temp dir that it unlinks before anyone else can know its name),
//! reserves its space (so that a running-out tmpfs is an error at connect time, not a `SIGBUS`
//! later), maps it and sends `/proc/<its pid>/fd/<fd>` over TCP; every rank opens that, maps it
//! and checks a random token; once all have mapped it (a TCP all-gather), rank 0 closes its file.
//! The segment never has a name in the file system, so a crash at any moment leaves nothing
//! behind: the memory goes with the last process that maps it.
//! Agreeing on the transport and setting the segment up is `segment.rs`'s; this file owns the
//! mapped segment ([`Shm`]) and the collectives through it.
//!
//! | offset | content |
//! |---|---|
//! | 0 | magic, token, world size, slot capacity |
//! | 64 | abort word: who gave up, about whom, why |
//! | 4096 + 256 r | rank r's control: `state` (own cache line), then one 4-word operation header per buffer set |
//! | data | rank r's two slots (buffer sets 0 and 1) of `cap` bytes each (1 MiB up to 16 ranks, down to 256 KiB for more) |
//!
//! ## Protocol
//!
//! Buffers are processed in chunks of at most `cap` bytes; chunk number `g` (counted over the life
//! of the communicator, the same on every rank) uses buffer set `g % 2`. Each rank's `state` only
//! grows: `2g + 1` = "my chunk `g` and its header are in my slot", `2g + 2` = "my share of chunk
//! `g` is reduced in my slot".
//!
//! 1. Every rank writes its chunk (broadcast: only the root) and header into its slot of set
//!    `g % 2`, then publishes `2g + 1`.
//! 2. Every rank waits until every `state >= 2g + 1` and compares the headers: a different
//!    operation, sequence number, element type, count or root is an [`Error::Mismatch`].
//! 3. Small buffers: every rank folds all slots into its own buffer in rank order (identical bits
//!    everywhere). Large buffers: rank `i` reduces the `i`-th `1/n` of the chunk across all slots
//!    into its own slot, publishes `2g + 2`, and every rank copies each share out once its owner
//!    has published it (reduce-scatter + all-gather through memory). Broadcast: copy from the
//!    root's slot.
//!
//! Step 2 of chunk `g + 1` proves that every rank has finished chunk `g`, so a slot of set `g % 2`
//! is never overwritten (at chunk `g + 2`) while someone still reads it.
//!
//! ## Waiting and failures
//!
//! A wait spins briefly, then yields, then sleeps in short naps, so that more ranks than cores
//! still progress. Every wait has the collective's deadline ([`Error::Timeout`] naming the rank
//! waited for). Every couple of milliseconds it also peeks at the ring's sockets: a closed one is
//! a dead peer ([`Error::Peer`]), bytes from the previous rank mean it started a TCP collective
//! while this rank is in a shared-memory one ([`Error::Mismatch`]). A rank that fails writes the
//! abort word, so the ranks waiting on it fail at once instead of at their next socket check.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use super::ring::Ring;
use super::wire::OpHeader;
use crate::collective::{finish_mean, reduce_into, reduce_last, ElemType, ReduceOp};
use crate::error::{Error, Result};

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"ACRSshm1");
const PAGE: usize = 4096;
/// Bytes of control per rank: `state` on its own cache line, then two 64-byte header lines.
const CTRL_STRIDE: usize = 256;
/// Offsets in the first page.
pub(super) const OFF_MAGIC: usize = 0;
pub(super) const OFF_TOKEN: usize = 8;
pub(super) const OFF_WORLD: usize = 16;
pub(super) const OFF_CAP: usize = 24;
const OFF_ABORT: usize = 64;

/// Bytes of one slot (per rank, per buffer set): the chunk size, for up to 16 ranks.
const SLOT_CAP: usize = 1 << 20;
/// Smallest slot, for many ranks.
const MIN_SLOT_CAP: usize = 256 * 1024;
/// The slots of all ranks together stay within this (with at least `MIN_SLOT_CAP` each), so that
/// a small `/dev/shm` (64 MiB in a default Docker container) still holds the segment.
const SLOTS_BUDGET: usize = 32 << 20;
/// Up to this many bytes, every rank folds all slots itself (one synchronisation per chunk);
/// above, the chunk is reduce-scattered (two synchronisations, each rank reduces `1/n`).
const DIRECT_MAX: usize = 32 * 1024;

/// Spin this long before yielding.
const SPIN_FOR: Duration = Duration::from_micros(3);
/// Yield until this long, then sleep.
const YIELD_FOR: Duration = Duration::from_millis(2);
/// Longest nap.
const MAX_NAP: Duration = Duration::from_micros(500);
/// How often a wait peeks at the sockets and checks the deadline.
const PROBE_EVERY: Duration = Duration::from_millis(2);

/// Why a rank gave up, stored in the abort word so the others can say.
const WHY_FAILED: u64 = 1;
const WHY_PEER_GONE: u64 = 2;
const WHY_MISMATCH: u64 = 3;
const WHY_TIMEOUT: u64 = 4;

/// One rank's mapping of the segment.
pub(crate) struct Shm {
    map: MmapRaw,
    rank: usize,
    world: usize,
    cap: usize,
    data_off: usize,
    /// Chunks processed so far (the same on every rank).
    gen: u64,
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("cap", &self.cap)
            .field("gen", &self.gen)
            .finish()
    }
}

/// Slot size for `world` ranks: a multiple of the page size.
pub(super) fn slot_cap(world: usize) -> usize {
    (SLOTS_BUDGET / (2 * world.max(1))).clamp(MIN_SLOT_CAP, SLOT_CAP) / PAGE * PAGE
}

fn data_offset(world: usize) -> usize {
    (PAGE + world * CTRL_STRIDE).div_ceil(PAGE) * PAGE
}

pub(super) fn segment_len(world: usize, cap: usize) -> usize {
    data_offset(world) + 2 * world * cap
}

/// What one collective does with each chunk.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// All-reduce, every rank folds every slot.
    ReduceDirect(ReduceOp),
    /// All-reduce, reduce-scatter then copy out.
    ReduceScatter(ReduceOp),
    /// Broadcast from a root.
    Broadcast(usize),
    /// Reduce-scatter: each rank reduces only its share of the whole buffer
    /// ([`chunk_range`](crate::collective::chunk_range), in elements of `count`).
    ScatterReduce(ReduceOp, usize),
    /// All-gather into one buffer: each rank publishes its share of the whole buffer of `count`
    /// elements and copies the others'.
    GatherInto(usize),
}

impl Shm {
    pub(super) fn new(map: MmapRaw, rank: usize, world: usize, cap: usize) -> Self {
        Shm {
            map,
            rank,
            world,
            cap,
            data_off: data_offset(world),
            gen: 0,
        }
    }

    /// The atomic word at byte offset `off`.
    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.data_off);
        // SAFETY: `off` is 8-aligned and inside the control area of the mapping, which lives as
        // long as `self`; `AtomicU64` has the size and alignment of `u64`, and every process only
        // ever accesses these words through atomics.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    fn state(&self, r: usize) -> &AtomicU64 {
        self.word(PAGE + r * CTRL_STRIDE)
    }

    fn header_word(&self, r: usize, set: usize, i: usize) -> &AtomicU64 {
        self.word(PAGE + r * CTRL_STRIDE + 64 * (1 + set) + 8 * i)
    }

    fn write_header(&self, set: usize, h: &OpHeader) {
        let w = |i, v| {
            self.header_word(self.rank, set, i)
                .store(v, Ordering::Relaxed)
        };
        w(0, h.seq);
        w(1, h.op as u64 | (h.elem as u64) << 8);
        w(2, h.count);
        w(3, h.aux);
    }

    fn read_header(&self, r: usize, set: usize) -> OpHeader {
        let w = |i| self.header_word(r, set, i).load(Ordering::Relaxed);
        let opw = w(1);
        OpHeader {
            op: opw as u8,
            elem: (opw >> 8) as u8,
            seq: w(0),
            count: w(2),
            aux: w(3),
        }
    }

    /// Start of rank `r`'s slot of buffer set `set`.
    fn slot(&self, r: usize, set: usize) -> *mut u8 {
        let off = self.data_off + (2 * r + set) * self.cap;
        // SAFETY: `off + cap` is within the mapping (`segment_len`), so the pointer stays in
        // bounds.
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    /// Records the first failure for the other ranks (later ones are ignored).
    fn abort(&self, e: &Error) {
        let (why, about) = match e {
            Error::Peer { peer, .. } => (WHY_PEER_GONE, *peer),
            Error::Mismatch { .. } => (WHY_MISMATCH, self.rank),
            Error::Timeout { peer, .. } => (WHY_TIMEOUT, *peer),
            _ => (WHY_FAILED, self.rank),
        };
        let v =
            1 << 63 | why << 48 | (about as u64 & 0xff_ffff) << 24 | self.rank as u64 & 0xff_ffff;
        let _ = self
            .word(OFF_ABORT)
            .compare_exchange(0, v, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The failure another rank recorded, as this rank's error.
    pub(crate) fn check_abort(&self, name: &str) -> Result<()> {
        let v = self.word(OFF_ABORT).load(Ordering::Acquire);
        if v == 0 {
            return Ok(());
        }
        let (why, about, by) = (
            (v >> 48) & 0x7fff,
            ((v >> 24) & 0xff_ffff) as usize,
            (v & 0xff_ffff) as usize,
        );
        let (peer, reason) = match why {
            WHY_PEER_GONE if about != self.rank => (
                about,
                format!("rank {by} lost rank {about} (did that process exit or crash?)"),
            ),
            WHY_MISMATCH => (
                by,
                format!("rank {by} found that the ranks called different collectives"),
            ),
            WHY_TIMEOUT => (
                about,
                format!("rank {by} timed out waiting for rank {about}"),
            ),
            _ => (by, format!("rank {by} failed in a collective")),
        };
        Err(Error::Peer {
            rank: self.rank,
            peer,
            op: name.into(),
            reason: format!("{reason}; shared-memory transport aborted"),
            source: None,
        })
    }

    /// Waits until `pending()` names no rank, with the deadline, liveness checks and abort word.
    fn wait(
        &self,
        ring: &Ring,
        name: &str,
        mine: &OpHeader,
        deadline: Instant,
        mut pending: impl FnMut() -> Option<usize>,
    ) -> Result<()> {
        if pending().is_none() {
            return Ok(());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            for _ in 0..64 {
                if pending().is_none() {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            spins += 1;
            if spins.is_multiple_of(8) {
                self.check_abort(name)?;
            }
            if start.elapsed() >= SPIN_FOR {
                break;
            }
        }
        let mut next_probe = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            let Some(blocker) = pending() else {
                return Ok(());
            };
            self.check_abort(name)?;
            let now = Instant::now();
            if now >= next_probe {
                if let Err(e) = ring.probe(name, mine) {
                    // A peer that finished this collective may already have moved on or exited.
                    if pending().is_none() {
                        return Ok(());
                    }
                    // A rank that failed records why before closing its sockets: prefer that.
                    self.check_abort(name)?;
                    return Err(e);
                }
                if now >= deadline {
                    return Err(Error::Timeout {
                        rank: self.rank,
                        peer: blocker,
                        op: name.into(),
                        timeout: ring.timeout,
                    });
                }
                next_probe = now + PROBE_EVERY;
            }
            if now.duration_since(start) < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    /// Waits until every rank has published `value`; returns the first rank still short of it.
    fn wait_all(
        &self,
        ring: &Ring,
        name: &str,
        mine: &OpHeader,
        deadline: Instant,
        value: u64,
    ) -> Result<()> {
        let mut from = 0;
        self.wait(ring, name, mine, deadline, || {
            while from < self.world {
                if self.state(from).load(Ordering::Acquire) < value {
                    return Some(from);
                }
                from += 1;
            }
            None
        })
    }

    /// `all_reduce` of `bytes` (element type and count in `h`).
    pub(crate) fn all_reduce(
        &mut self,
        ring: &Ring,
        deadline: Instant,
        h: OpHeader,
        elem: ElemType,
        rop: ReduceOp,
        bytes: &mut [u8],
    ) -> Result<()> {
        let kind = if bytes.len() <= DIRECT_MAX {
            Kind::ReduceDirect(rop)
        } else {
            Kind::ReduceScatter(rop)
        };
        self.run(ring, "all_reduce", deadline, h, elem, kind, bytes)
    }

    /// `broadcast` of `bytes` from `root`.
    pub(crate) fn broadcast(
        &mut self,
        ring: &Ring,
        deadline: Instant,
        h: OpHeader,
        elem: ElemType,
        root: usize,
        bytes: &mut [u8],
    ) -> Result<()> {
        self.run(
            ring,
            "broadcast",
            deadline,
            h,
            elem,
            Kind::Broadcast(root),
            bytes,
        )
    }

    /// `reduce_scatter` of `bytes`: on return my share of them holds the reduction.
    pub(crate) fn reduce_scatter(
        &mut self,
        ring: &Ring,
        deadline: Instant,
        h: OpHeader,
        elem: ElemType,
        rop: ReduceOp,
        bytes: &mut [u8],
    ) -> Result<()> {
        let count = bytes.len() / elem.size();
        let kind = Kind::ScatterReduce(rop, count);
        self.run(ring, "reduce_scatter", deadline, h, elem, kind, bytes)
    }

    /// `all_gather_into` of `bytes`: every rank's share, from that rank.
    pub(crate) fn all_gather_into(
        &mut self,
        ring: &Ring,
        deadline: Instant,
        h: OpHeader,
        elem: ElemType,
        bytes: &mut [u8],
    ) -> Result<()> {
        let count = bytes.len() / elem.size();
        let kind = Kind::GatherInto(count);
        self.run(ring, "all_gather_into", deadline, h, elem, kind, bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        ring: &Ring,
        name: &str,
        deadline: Instant,
        h: OpHeader,
        elem: ElemType,
        kind: Kind,
        bytes: &mut [u8],
    ) -> Result<()> {
        let res = self.check_abort(name).and_then(|()| {
            let esize = elem.size();
            let per_chunk = (self.cap / esize) * esize;
            // At least one chunk, so that even empty buffers are checked against the others.
            let chunks = bytes.len().div_ceil(per_chunk).max(1);
            for c in 0..chunks {
                let lo = c * per_chunk;
                let hi = (lo + per_chunk).min(bytes.len());
                self.chunk(ring, name, deadline, &h, elem, kind, lo, &mut bytes[lo..hi])?;
            }
            Ok(())
        });
        if let Err(e) = &res {
            self.abort(e);
        }
        res
    }

    /// One chunk of at most `cap` bytes: publish it, check that every rank does the same, then
    /// combine the slots as `kind` says.
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &mut self,
        ring: &Ring,
        name: &str,
        deadline: Instant,
        h: &OpHeader,
        elem: ElemType,
        kind: Kind,
        offset: usize,
        chunk: &mut [u8],
    ) -> Result<()> {
        let g = self.gen;
        self.gen += 1;
        let set = (g % 2) as usize;
        debug_assert!(chunk.len() <= self.cap);
        self.publish(g, set, h, kind, chunk);
        self.wait_all(ring, name, h, deadline, 2 * g + 1)?;
        self.compare_headers(name, set, h)?;
        let len = chunk.len();
        match kind {
            Kind::Broadcast(root) => {
                if root != self.rank {
                    chunk.copy_from_slice(self.published(root, set, 0..len, len));
                }
                Ok(())
            }
            Kind::ReduceDirect(rop) => self.reduce_direct_chunk(set, elem, rop, chunk),
            Kind::ReduceScatter(rop) => {
                self.reduce_scatter_chunk(ring, name, deadline, h, elem, rop, g, chunk)
            }
            Kind::ScatterReduce(rop, count) => {
                let mine = self.share_in_chunk(self.rank, count, elem, offset, len);
                self.scatter_reduce_chunk(set, elem, rop, mine, chunk)
            }
            Kind::GatherInto(count) => {
                for r in (0..self.world).filter(|&r| r != self.rank) {
                    let theirs = self.share_in_chunk(r, count, elem, offset, len);
                    chunk[theirs.clone()].copy_from_slice(self.published(r, set, theirs, len));
                }
                Ok(())
            }
        }
    }

    /// Step 1 of chunk `g`: my chunk (unless a broadcast's non-root) and header into set `set`,
    /// then my state `2g + 1`.
    fn publish(&self, g: u64, set: usize, h: &OpHeader, kind: Kind, chunk: &[u8]) {
        let contributes = match kind {
            Kind::Broadcast(root) => root == self.rank,
            _ => true,
        };
        if contributes {
            // SAFETY: my slot of this set is `cap >= len` bytes; nobody reads it until I publish
            // `2g + 1` below, and every rank finished reading it (chunk `g - 2`) before it
            // published `2(g - 1) + 1`, which I waited for. `chunk` is ordinary memory of this
            // process, so the two ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    self.slot(self.rank, set),
                    chunk.len(),
                )
            };
        }
        self.write_header(set, h);
        self.state(self.rank).store(2 * g + 1, Ordering::Release);
    }

    /// Step 2: every rank's header of set `set` equals mine (the same collective, sizes and
    /// types), else a mismatch naming both calls.
    fn compare_headers(&self, name: &str, set: usize, h: &OpHeader) -> Result<()> {
        let me = self.rank;
        for r in 0..self.world {
            let theirs = self.read_header(r, set);
            if theirs != *h {
                return Err(Error::Mismatch {
                    rank: me,
                    op: name.into(),
                    detail: format!(
                        "rank {me} called {} but rank {r} called {}",
                        h.describe(),
                        theirs.describe()
                    ),
                });
            }
        }
        Ok(())
    }

    /// `range` of the bytes rank `r` published in its slot of set `set` for the current chunk
    /// (`len` bytes long).
    fn published(&self, r: usize, set: usize, range: std::ops::Range<usize>, len: usize) -> &[u8] {
        debug_assert!(range.end <= len && len <= self.cap);
        // SAFETY: `range` lies within the `len <= cap` bytes that rank `r` wrote into its slot of
        // this set for the current chunk `g` (every rank's header, hence `len`, was compared
        // before any caller reads), and it published them (`2g + 1`, or `2g + 2` for reduced
        // shares) before this rank read them. Slots of this set are only written again at chunk
        // `g + 2`, after every rank, this one included, has published `2(g + 1) + 1`, i.e. after
        // this rank is done with them. In this process, a shared slice of slot bytes never
        // coexists with a mutable one of the same bytes.
        unsafe { std::slice::from_raw_parts(self.slot(r, set).add(range.start), range.len()) }
    }

    /// For the whole-buffer kinds: rank `r`'s share of a buffer of `count` elements, as a range
    /// of bytes within the chunk of `len` bytes at byte `offset` (empty when outside it).
    fn share_in_chunk(
        &self,
        r: usize,
        count: usize,
        elem: ElemType,
        offset: usize,
        len: usize,
    ) -> std::ops::Range<usize> {
        let esize = elem.size();
        let c = crate::collective::chunk_range(count, self.world, r);
        let (a, b) = (c.start * esize, c.end * esize);
        let (lo, hi) = (offset, offset + len);
        a.clamp(lo, hi) - lo..b.clamp(lo, hi) - lo
    }

    /// Step 3 of an all-reduce where every rank folds every slot, in rank order on every rank so
    /// that the results are bit-identical.
    fn reduce_direct_chunk(
        &self,
        set: usize,
        elem: ElemType,
        rop: ReduceOp,
        chunk: &mut [u8],
    ) -> Result<()> {
        let (n, len) = (self.world, chunk.len());
        if self.rank != 0 {
            chunk.copy_from_slice(self.published(0, set, 0..len, len));
        }
        for r in 1..n {
            reduce_into(
                elem,
                acc_op(rop),
                chunk,
                self.published(r, set, 0..len, len),
            )?;
        }
        if rop == ReduceOp::Mean {
            finish_mean(elem, chunk, n)?;
        }
        Ok(())
    }

    /// Step 3 of a reduce-scatter: my share (`mine`, within the chunk) reduced over every rank's
    /// slot, in place.
    fn scatter_reduce_chunk(
        &self,
        set: usize,
        elem: ElemType,
        rop: ReduceOp,
        mine: std::ops::Range<usize>,
        chunk: &mut [u8],
    ) -> Result<()> {
        let (me, n, len) = (self.rank, self.world, chunk.len());
        let slot_ref = |r: usize, range: std::ops::Range<usize>| self.published(r, set, range, len);
        let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
        match others.split_last() {
            Some((&last, rest)) => {
                let dst = &mut chunk[mine.clone()];
                for &r in rest {
                    reduce_into(elem, acc_op(rop), dst, slot_ref(r, mine.clone()))?;
                }
                reduce_last(elem, rop, dst, slot_ref(last, mine.clone()), None, n)?;
            }
            None if rop == ReduceOp::Mean => finish_mean(elem, &mut chunk[mine], n)?,
            None => {}
        }
        Ok(())
    }

    /// Step 3 of an all-reduce by reduce-scatter: reduce my share into my own slot, publish
    /// `2g + 2`, then copy every other rank's reduced share out as it is published.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_chunk(
        &self,
        ring: &Ring,
        name: &str,
        deadline: Instant,
        h: &OpHeader,
        elem: ElemType,
        rop: ReduceOp,
        g: u64,
        chunk: &mut [u8],
    ) -> Result<()> {
        let (me, n, len) = (self.rank, self.world, chunk.len());
        let set = (g % 2) as usize;
        let slot_ref = |r: usize, range: std::ops::Range<usize>| self.published(r, set, range, len);
        let esize = elem.size();
        let count = len / esize;
        let bound = |i: usize| (i * count / n) * esize;
        let mine = bound(me)..bound(me + 1);
        {
            // SAFETY: only this rank touches share `me` of any slot of this set during this step
            // (every rank reduces its own share), and the others read it from my slot only after
            // I publish `2g + 2`.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(self.slot(me, set).add(mine.start), mine.len())
            };
            // The last peer's share, the mean's division and the copy out in one pass.
            let others: Vec<usize> = (0..n).filter(|&r| r != me).collect();
            match others.split_last() {
                Some((&last, rest)) => {
                    for &r in rest {
                        reduce_into(elem, acc_op(rop), dst, slot_ref(r, mine.clone()))?;
                    }
                    let out = Some(&mut chunk[mine.clone()]);
                    reduce_last(elem, rop, dst, slot_ref(last, mine.clone()), out, n)?;
                }
                None => {
                    if rop == ReduceOp::Mean {
                        finish_mean(elem, dst, n)?;
                    }
                    chunk[mine.clone()].copy_from_slice(dst);
                }
            }
        }
        self.state(me).store(2 * g + 2, Ordering::Release);
        for k in 1..n {
            let r = (me + k) % n;
            self.wait(ring, name, h, deadline, || {
                (self.state(r).load(Ordering::Acquire) < 2 * g + 2).then_some(r)
            })?;
            let share = bound(r)..bound(r + 1);
            chunk[share.clone()].copy_from_slice(slot_ref(r, share));
        }
        Ok(())
    }
}

/// The accumulating operation of a reduction (`Mean` sums, then divides once).
fn acc_op(rop: ReduceOp) -> ReduceOp {
    rop.accumulating()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_fits_and_is_aligned() {
        for world in [1, 2, 3, 4, 8, 16, 17, 64, 256, 1000] {
            let cap = slot_cap(world);
            assert!((MIN_SLOT_CAP..=SLOT_CAP).contains(&cap), "{world}: {cap}");
            assert_eq!(cap % PAGE, 0);
            let data = data_offset(world);
            assert_eq!(data % PAGE, 0);
            assert!(data >= PAGE + world * CTRL_STRIDE);
            assert_eq!(segment_len(world, cap), data + 2 * world * cap);
            if world <= 16 {
                assert_eq!(cap, SLOT_CAP);
            }
        }
    }
}
