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

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use super::ring::Ring;
use super::wire::OpHeader;
use crate::collective::{finish_mean, reduce_into, reduce_last, Buffer, ElemType, ReduceOp};
use crate::error::{Error, Result};
use crate::settings::{env, Transport};

const MAGIC: u64 = u64::from_le_bytes(*b"ACRSshm1");
const PAGE: usize = 4096;
/// Bytes of control per rank: `state` on its own cache line, then two 64-byte header lines.
const CTRL_STRIDE: usize = 256;
/// Offsets in the first page.
const OFF_MAGIC: usize = 0;
const OFF_TOKEN: usize = 8;
const OFF_WORLD: usize = 16;
const OFF_CAP: usize = 24;
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
fn slot_cap(world: usize) -> usize {
    (SLOTS_BUDGET / (2 * world.max(1))).clamp(MIN_SLOT_CAP, SLOT_CAP) / PAGE * PAGE
}

fn data_offset(world: usize) -> usize {
    (PAGE + world * CTRL_STRIDE).div_ceil(PAGE) * PAGE
}

fn segment_len(world: usize, cap: usize) -> usize {
    data_offset(world) + 2 * world * cap
}

/// This host's identity: hostname and boot id (empty boot id when unknown).
fn host_identity() -> (String, String) {
    let mut name = [0u8; 256];
    // SAFETY: `name` is valid for writes of `name.len()` bytes, the most gethostname writes.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let host = match rc {
        0 => String::from_utf8(name[..end].to_vec()).unwrap_or_default(),
        _ => String::new(),
    };
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    (host, boot)
}

fn gather_strings(ring: &mut Ring, mine: &str) -> Result<Vec<String>> {
    Ok(ring
        .all_gather(Buffer::from(mine.as_bytes()))?
        .iter()
        .map(|b| String::from_utf8_lossy(b.bytes()).into_owned())
        .collect())
}

/// Decides the transport with the other ranks and, for shared memory, sets up the segment.
/// `Ok(None)`: use TCP.
pub(crate) fn setup(ring: &mut Ring, mode: Transport) -> Result<Option<Shm>> {
    let (rank, world) = (ring.rank, ring.world);
    let (host, boot) = host_identity();
    let infos = gather_strings(ring, &format!("{}\n{host}\n{boot}", mode.name()))?;
    let mut modes = Vec::with_capacity(world);
    let mut idents = Vec::with_capacity(world);
    for (r, info) in infos.iter().enumerate() {
        let mut parts = info.splitn(3, '\n');
        let m = parts
            .next()
            .and_then(Transport::parse)
            .ok_or_else(|| Error::Peer {
                rank,
                peer: r,
                op: "connect".into(),
                reason: format!("sent an invalid transport record {info:?}"),
                source: None,
            })?;
        modes.push(m);
        idents.push((
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        ));
    }
    let list = |f: &dyn Fn(usize) -> String| {
        (0..world)
            .map(|r| format!("rank {r}: {}", f(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let wants_tcp = modes.contains(&Transport::Tcp);
    let required = modes.contains(&Transport::Shm);
    if wants_tcp && required {
        return Err(Error::Env {
            var: env::TRANSPORT.into(),
            value: mode.name().into(),
            reason: format!(
                "ranks disagree on the transport ({}); set the same value everywhere",
                list(&|r| modes[r].name().to_string())
            ),
        });
    }
    if wants_tcp {
        return Ok(None);
    }
    let same_host = !idents[0].1.is_empty() && idents.iter().all(|i| *i == idents[0]);
    if !same_host {
        if required {
            return Err(Error::Env {
                var: env::TRANSPORT.into(),
                value: "shm".into(),
                reason: format!(
                    "shared memory needs every rank on one host, but they are on several ({}); use `auto` or `tcp`",
                    list(&|r| {
                        let (h, b) = &idents[r];
                        if b.is_empty() {
                            format!("{h} (boot id unknown)")
                        } else {
                            format!("{h} (boot {})", b.get(..8).unwrap_or(b))
                        }
                    })
                ),
            });
        }
        return Ok(None);
    }

    // Rank 0 creates the segment; the others learn its name, size and token.
    let cap = slot_cap(world);
    let len = segment_len(world, cap);
    // Rank 0 keeps its file open until every rank has opened its own.
    let mut file0: Option<File> = None;
    let mut created: Option<Shm> = None;
    let mut offer = String::new();
    if rank == 0 {
        match create_segment(world, cap, len) {
            Ok((file, map, token)) => {
                offer = format!(
                    "ok\n{token}\n/proc/{}/fd/{}",
                    std::process::id(),
                    file.as_raw_fd()
                );
                file0 = Some(file);
                created = Some(Shm::new(map, rank, world, cap));
            }
            Err(reason) => offer = format!("err\n{reason}"),
        }
    }
    let offers = gather_strings(ring, &offer)?;
    let offer0 = offers.first().map(String::as_str).unwrap_or("");
    let mut status = "ok".to_string();
    let mut shm = None;
    let mut where_ = String::new();
    match offer0.split_once('\n') {
        Some(("ok", rest)) => {
            let (token, path) = rest.split_once('\n').unwrap_or(("", ""));
            where_ = path.to_string();
            if rank == 0 {
                shm = created.take();
            } else {
                match open_segment(Path::new(path), token, world, cap, len) {
                    Ok(map) => shm = Some(Shm::new(map, rank, world, cap)),
                    Err(reason) => status = format!("err: {reason}"),
                }
            }
        }
        Some(("err", reason)) => status = format!("err: rank 0: {reason}"),
        _ => status = format!("err: rank 0 sent an invalid offer {offer0:?}"),
    }
    // Everyone has mapped it (or failed to) once this returns: rank 0 closes its file.
    let statuses = gather_strings(ring, &status)?;
    drop(file0);
    let failures: Vec<String> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.as_str() != "ok")
        .map(|(r, s)| format!("rank {r}: {}", s.trim_start_matches("err: ")))
        .collect();
    if !failures.is_empty() {
        let reason = format!(
            "cannot set up the shared-memory transport ({})",
            failures.join("; ")
        );
        if required {
            return Err(Error::Rendezvous {
                rank,
                addr: where_,
                reason,
                source: None,
            });
        }
        if rank == 0 {
            log::warn!("{reason}; using TCP");
        }
        return Ok(None);
    }
    Ok(shm)
}

/// Creates, sizes, reserves and maps a new segment that has no name in the file system; returns
/// its file (to share through `/proc/<pid>/fd`), the mapping and the token.
fn create_segment(
    world: usize,
    cap: usize,
    len: usize,
) -> std::result::Result<(File, MmapRaw, u64), String> {
    let token: u64 = rand::random::<u64>() | 1;
    let file = anonymous_file()?;
    let map = size_and_map(&file, len)
        .map_err(|e| format!("cannot size or map a {len}-byte shared-memory segment: {e}"))?;
    // SAFETY: the mapping is `len` bytes long and page aligned; the header words are 8-aligned
    // and within the first page; no other process can reach the file yet.
    unsafe {
        let base = map.as_mut_ptr();
        for (off, v) in [
            (OFF_TOKEN, token),
            (OFF_WORLD, world as u64),
            (OFF_CAP, cap as u64),
            (OFF_MAGIC, MAGIC),
        ] {
            (*(base.add(off) as *const AtomicU64)).store(v, Ordering::Release);
        }
    }
    Ok((file, map, token))
}

/// A new, empty shared-memory file without a name: a memfd, else a file created under
/// `/dev/shm` (or the temp dir) and unlinked at once.
fn anonymous_file() -> std::result::Result<File, String> {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a valid NUL-terminated string and the flags are valid memfd flags;
    // memfd_create only reads them.
    let fd = unsafe { libc::memfd_create(c"accelerate-rs-shm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        return Ok(unsafe { File::from_raw_fd(fd) });
    }
    let memfd_err = std::io::Error::last_os_error();
    let name = format!(
        "accelerate-rs-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    );
    let mut last_err = format!("memfd_create failed: {memfd_err}");
    for dir in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        if !dir.is_dir() {
            continue;
        }
        let path = dir.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path);
        match file {
            Ok(f) => {
                // Named for the moment between these two calls only.
                if let Err(e) = std::fs::remove_file(&path) {
                    last_err = format!("cannot unlink {}: {e}", path.display());
                    continue;
                }
                return Ok(f);
            }
            Err(e) => last_err = format!("{last_err}; cannot create {}: {e}", path.display()),
        }
    }
    Err(last_err)
}

fn size_and_map(file: &File, len: usize) -> std::io::Result<MmapRaw> {
    file.set_len(len as u64)?;
    // Reserve the pages now: on a full tmpfs, touching an unreserved page would be a SIGBUS.
    // SAFETY: `file` is an open descriptor for the whole call; posix_fallocate touches no memory
    // of ours.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 | libc::EOPNOTSUPP | libc::EINVAL => {}
        e => return Err(std::io::Error::from_raw_os_error(e)),
    }
    MmapRaw::map_raw(file)
}

/// Opens and maps rank 0's segment and checks that it is the one rank 0 created.
fn open_segment(
    path: &Path,
    token: &str,
    world: usize,
    cap: usize,
    len: usize,
) -> std::result::Result<MmapRaw, String> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            format!(
                "cannot open rank 0's segment {} (are the ranks in one PID namespace, run by one user?): {e}",
                path.display()
            )
        })?;
    let size = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .len();
    if size != len as u64 {
        return Err(format!(
            "{} is {size} bytes, expected {len}",
            path.display()
        ));
    }
    let map = MmapRaw::map_raw(&file).map_err(|e| format!("cannot map {}: {e}", path.display()))?;
    let want: u64 = token.parse().map_err(|_| format!("bad token {token:?}"))?;
    // SAFETY: the mapping is `len` bytes (checked above, more than one page) and page aligned;
    // the header words are 8-aligned and every process accesses them atomically.
    let word = |off: usize| unsafe {
        (*(map.as_mut_ptr().add(off) as *const AtomicU64)).load(Ordering::Acquire)
    };
    if word(OFF_MAGIC) != MAGIC
        || word(OFF_TOKEN) != want
        || word(OFF_WORLD) != world as u64
        || word(OFF_CAP) != cap as u64
    {
        return Err(format!(
            "{} is not the segment rank 0 created (different PID namespaces?)",
            path.display()
        ));
    }
    Ok(map)
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
    fn new(map: MmapRaw, rank: usize, world: usize, cap: usize) -> Self {
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

    /// One chunk of at most `cap` bytes.
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
        let (me, n) = (self.rank, self.world);
        // For the whole-buffer kinds: rank `r`'s share of this chunk, as a range within it.
        let esize = elem.size();
        let chunk_len = chunk.len();
        let share_here = |r: usize, count: usize| {
            let c = crate::collective::chunk_range(count, n, r);
            let (a, b) = (c.start * esize, c.end * esize);
            let (lo, hi) = (offset, offset + chunk_len);
            a.clamp(lo, hi) - lo..b.clamp(lo, hi) - lo
        };
        let g = self.gen;
        self.gen += 1;
        let set = (g % 2) as usize;
        let len = chunk.len();
        debug_assert!(len <= self.cap);

        // 1. Publish my chunk and header.
        let contributes = match kind {
            Kind::Broadcast(root) => root == me,
            _ => true,
        };
        if contributes {
            // SAFETY: my slot of this set is `cap >= len` bytes; nobody reads it until I publish
            // `2g + 1` below, and every rank finished reading it (chunk `g - 2`) before it
            // published `2(g - 1) + 1`, which I waited for. `chunk` is ordinary memory of this
            // process, so the two ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.slot(me, set), len) };
        }
        self.write_header(set, h);
        self.state(me).store(2 * g + 1, Ordering::Release);

        // 2. Wait for everyone and compare what they are doing.
        self.wait_all(ring, name, h, deadline, 2 * g + 1)?;
        for r in 0..n {
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

        // 3. Combine.
        let slot_ref = |r: usize, range: std::ops::Range<usize>| -> &[u8] {
            debug_assert!(range.end <= len);
            // SAFETY: `range` lies within the `len <= cap` bytes that rank `r` wrote into its
            // slot of this set for chunk `g` (every rank's header, hence `len`, was compared
            // above), and it published them (`2g + 1`, or `2g + 2` for reduced shares) before
            // this rank read them. Slots of this set are only written again at chunk `g + 2`,
            // after every rank, this one included, has published `2(g + 1) + 1`, i.e. after this
            // rank is done with them. In this process, a shared slice of slot bytes never
            // coexists with a mutable one of the same bytes.
            unsafe { std::slice::from_raw_parts(self.slot(r, set).add(range.start), range.len()) }
        };
        match kind {
            Kind::Broadcast(root) => {
                if root != me {
                    chunk.copy_from_slice(slot_ref(root, 0..len));
                }
            }
            Kind::ScatterReduce(rop, count) => {
                let mine = share_here(me, count);
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
            }
            Kind::GatherInto(count) => {
                for r in (0..n).filter(|&r| r != me) {
                    let theirs = share_here(r, count);
                    chunk[theirs.clone()].copy_from_slice(slot_ref(r, theirs));
                }
            }
            Kind::ReduceDirect(rop) => {
                // Fold in rank order on every rank, so that the results are bit-identical.
                if me != 0 {
                    chunk.copy_from_slice(slot_ref(0, 0..len));
                }
                for r in 1..n {
                    reduce_into(elem, acc_op(rop), chunk, slot_ref(r, 0..len))?;
                }
                if rop == ReduceOp::Mean {
                    finish_mean(elem, chunk, n)?;
                }
            }
            Kind::ReduceScatter(rop) => {
                let esize = elem.size();
                let count = len / esize;
                let bound = |i: usize| (i * count / n) * esize;
                let mine = bound(me)..bound(me + 1);
                {
                    // SAFETY: only this rank touches share `me` of any slot of this set during
                    // this step (every rank reduces its own share), and the others read it from
                    // my slot only after I publish `2g + 2`.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            self.slot(me, set).add(mine.start),
                            mine.len(),
                        )
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
            }
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
