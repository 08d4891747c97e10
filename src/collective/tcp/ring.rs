//! The ring: one non-blocking connection to the next rank and one from the previous rank, driven
//! by `poll(2)` so that sending, receiving and reducing overlap and large buffers stream through in
//! segments.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::wire::{self, op, OpHeader, HEADER_LEN};
use crate::collective::{
    finish_mean, reduce_into, AlignedBytes, Buffer, BufferMut, ElemType, OwnedBuffer, ReduceOp,
};
use crate::error::{Error, Result};

/// Received data is reduced in segments of this many bytes while the rest is still arriving.
const SEGMENT: usize = 256 * 1024;

#[derive(Debug)]
pub(crate) struct Ring {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) timeout: Duration,
    next: TcpStream,
    prev: TcpStream,
    seq: u64,
    broken: Option<String>,
    scratch: AlignedBytes,
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges.
fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.start < b.start {
        let (l, r) = buf.split_at_mut(b.start);
        (&l[a], &mut r[..b.end - b.start])
    } else {
        let (l, r) = buf.split_at_mut(a.start);
        (&r[..a.end - a.start], &mut l[b])
    }
}

impl Ring {
    pub(crate) fn new(
        rank: usize,
        world: usize,
        timeout: Duration,
        next: TcpStream,
        prev: TcpStream,
    ) -> io::Result<Self> {
        for s in [&next, &prev] {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
        }
        Ok(Ring {
            rank,
            world,
            timeout,
            next,
            prev,
            seq: 0,
            broken: None,
            scratch: AlignedBytes::default(),
        })
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.world
    }
    fn prev_rank(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Runs one collective; on failure the ring is poisoned and both sockets are shut down so the
    /// neighbours fail promptly too (and theirs, around the ring).
    pub(crate) fn run<T>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Self, Instant) -> Result<T>,
    ) -> Result<T> {
        if let Some(first) = &self.broken {
            return Err(Error::Broken {
                rank: self.rank,
                op: name.into(),
                first: first.clone(),
            });
        }
        let deadline = crate::settings::limits::deadline_after(self.timeout);
        let res = f(self, deadline);
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
            let _ = self.next.shutdown(Shutdown::Both);
            let _ = self.prev.shutdown(Shutdown::Both);
        }
        res
    }

    fn send_err(&self, name: &str, e: io::Error) -> Error {
        Error::Peer {
            rank: self.rank,
            peer: self.next_rank(),
            op: name.into(),
            reason: "connection lost while sending (did that process exit or crash?)".into(),
            source: Some(e),
        }
    }

    fn recv_err(&self, name: &str, e: Option<io::Error>) -> Error {
        Error::Peer {
            rank: self.rank,
            peer: self.prev_rank(),
            op: name.into(),
            reason: match &e {
                None => "connection closed by the peer (did that process exit or crash?)".into(),
                Some(_) => {
                    "connection lost while receiving (did that process exit or crash?)".into()
                }
            },
            source: e,
        }
    }

    fn write_some(&mut self, name: &str, data: &[u8]) -> Result<usize> {
        loop {
            match self.next.write(data) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.send_err(name, e)),
            }
        }
    }

    fn read_some(&mut self, name: &str, into: &mut [u8]) -> Result<usize> {
        loop {
            match self.prev.read(into) {
                Ok(0) => return Err(self.recv_err(name, None)),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.recv_err(name, Some(e))),
            }
        }
    }

    /// Blocks until the next socket is writable (`w`) or the previous one readable (`r`).
    fn wait(&self, name: &str, w: bool, r: bool, deadline: Instant) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                rank: self.rank,
                peer: if r {
                    self.prev_rank()
                } else {
                    self.next_rank()
                },
                op: name.into(),
                timeout: self.timeout,
            });
        }
        // Wake at least once a second to re-check the deadline.
        let ms = (deadline - now).as_millis().clamp(1, 1000) as u16;
        let pollfd = |fd: &TcpStream, events| libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        let mut fds = Vec::with_capacity(2);
        if w {
            fds.push(pollfd(&self.next, libc::POLLOUT));
        }
        if r {
            fds.push(pollfd(&self.prev, libc::POLLIN));
        }
        // SAFETY: `fds` points to `fds.len()` initialised `pollfd`s that live across the call, and
        // their descriptors belong to `self.next` / `self.prev`, open for as long as `self` is.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, i32::from(ms)) };
        let e = io::Error::last_os_error();
        if rc >= 0 || e.kind() == io::ErrorKind::Interrupted {
            return Ok(());
        }
        Err(Error::Peer {
            rank: self.rank,
            peer: self.prev_rank(),
            op: name.into(),
            reason: "poll failed".into(),
            source: Some(e),
        })
    }

    /// The reduce half of a ring schedule over `bytes` cut into `chunk(i)` byte ranges: the
    /// world size minus one steps, step `s` sending chunk `steps(s).0` and adding what arrives
    /// into chunk `steps(s).1` (sums for `Mean`; the caller divides). The scratch buffer is kept
    /// for the next call, also when a step fails.
    #[allow(clippy::too_many_arguments)]
    fn reduce_steps(
        &mut self,
        name: &str,
        deadline: Instant,
        bytes: &mut [u8],
        elem: ElemType,
        rop: ReduceOp,
        chunk: &dyn Fn(usize) -> Range<usize>,
        steps: impl Fn(usize) -> (usize, usize),
    ) -> Result<()> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let sum_op = rop.accumulating();
        let mut res = Ok(());
        for s in 0..self.world - 1 {
            let (si, ri) = steps(s);
            let (send, dest) = split_pair(bytes, chunk(si), chunk(ri));
            scratch.resize(dest.len());
            res = self.exchange(
                name,
                deadline,
                send,
                scratch.as_mut(),
                elem.size(),
                |d, off| reduce_into(elem, sum_op, &mut dest[off..off + d.len()], d),
            );
            if res.is_err() {
                break;
            }
        }
        self.scratch = scratch;
        res
    }

    /// Sends `send` to the next rank while receiving exactly `recv.len()` bytes from the previous
    /// one. `on_data(bytes, offset)` sees the received bytes in element-aligned segments as they
    /// complete, so reduction overlaps the transfer.
    fn exchange(
        &mut self,
        name: &str,
        deadline: Instant,
        send: &[u8],
        recv: &mut [u8],
        elem_size: usize,
        mut on_data: impl FnMut(&[u8], usize) -> Result<()>,
    ) -> Result<()> {
        let (mut sent, mut got, mut delivered) = (0usize, 0usize, 0usize);
        loop {
            while sent < send.len() {
                let n = self.write_some(name, &send[sent..])?;
                if n == 0 {
                    break;
                }
                sent += n;
            }
            while got < recv.len() {
                let n = self.read_some(name, &mut recv[got..])?;
                if n == 0 {
                    break;
                }
                got += n;
            }
            let ready = got - got % elem_size;
            if ready > delivered && (ready - delivered >= SEGMENT || ready == recv.len()) {
                on_data(&recv[delivered..ready], delivered)?;
                delivered = ready;
            }
            let (w, r) = (sent < send.len(), got < recv.len());
            if !w && !r {
                return Ok(());
            }
            self.wait(name, w, r, deadline)?;
        }
    }

    /// Exchanges operation headers with the neighbours and checks that the previous rank is
    /// running the same collective.
    fn begin(&mut self, deadline: Instant, mine: OpHeader, check_count: bool) -> Result<()> {
        let name = op::name(mine.op);
        let mut theirs = [0u8; HEADER_LEN];
        self.exchange(
            name,
            deadline,
            &mine.encode(),
            &mut theirs,
            1,
            |_, _| Ok(()),
        )?;
        let Some(h) = OpHeader::decode(&theirs) else {
            return Err(Error::Peer {
                rank: self.rank,
                peer: self.prev_rank(),
                op: name.into(),
                reason: "received bytes that are not an operation header (protocol desync)".into(),
                source: None,
            });
        };
        let same = h.op == mine.op
            && h.elem == mine.elem
            && h.seq == mine.seq
            && h.aux == mine.aux
            && (!check_count || h.count == mine.count);
        if !same {
            return Err(Error::Mismatch {
                rank: self.rank,
                op: name.into(),
                detail: format!(
                    "rank {} called {} but rank {} called {}",
                    self.rank,
                    mine.describe(),
                    self.prev_rank(),
                    h.describe()
                ),
            });
        }
        Ok(())
    }

    /// The header of this rank's next collective (advances the sequence number).
    pub(crate) fn header(&mut self, code: u8, elem: ElemType, count: usize, aux: u64) -> OpHeader {
        self.seq += 1;
        OpHeader {
            op: code,
            elem: elem.code(),
            seq: self.seq,
            count: count as u64,
            aux,
        }
    }

    /// Checks without blocking that both neighbours' connections are still open.
    pub(crate) fn check_peers(&self) -> Result<()> {
        if let Some(first) = &self.broken {
            return Err(Error::Broken {
                rank: self.rank,
                op: "check_peers".into(),
                first: first.clone(),
            });
        }
        for (sock, peer) in [
            (&self.next, self.next_rank()),
            (&self.prev, self.prev_rank()),
        ] {
            let mut b = [0u8; 1];
            let gone = match sock.peek(&mut b) {
                // Data waiting means the neighbour already started its next operation.
                Ok(n) => (n == 0).then_some(None),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    None
                }
                Err(e) => Some(Some(e)),
            };
            if let Some(source) = gone {
                return Err(Error::Peer {
                    rank: self.rank,
                    peer,
                    op: "check_peers".into(),
                    reason: "connection closed (did that process exit or crash?)".into(),
                    source,
                });
            }
        }
        Ok(())
    }

    /// For waits that are not on the sockets (the shared-memory transport, running `mine`):
    /// checks without blocking that both neighbours' connections are open and that the previous
    /// rank has not started a TCP collective, which this rank is not running.
    pub(crate) fn probe(&self, name: &str, mine: &OpHeader) -> Result<()> {
        for (sock, peer, is_prev) in [
            (&self.next, self.next_rank(), false),
            (&self.prev, self.prev_rank(), true),
        ] {
            let mut b = [0u8; HEADER_LEN];
            match sock.peek(&mut b) {
                Ok(0) => {
                    return Err(Error::Peer {
                        rank: self.rank,
                        peer,
                        op: name.into(),
                        reason: "connection closed (did that process exit or crash?)".into(),
                        source: None,
                    })
                }
                Ok(n) if is_prev => {
                    let theirs = (n == HEADER_LEN)
                        .then(|| OpHeader::decode(&b))
                        .flatten()
                        .map_or_else(|| "a TCP collective".to_string(), |h| h.describe());
                    return Err(Error::Mismatch {
                        rank: self.rank,
                        op: name.into(),
                        detail: format!(
                            "rank {} called {} but rank {peer} called {theirs}",
                            self.rank,
                            mine.describe()
                        ),
                    });
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    return Err(Error::Peer {
                        rank: self.rank,
                        peer,
                        op: name.into(),
                        reason: "connection lost (did that process exit or crash?)".into(),
                        source: Some(e),
                    })
                }
            }
        }
        Ok(())
    }

    /// Ring all-reduce: reduce-scatter then all-gather over `world` chunks.
    pub(crate) fn all_reduce(&mut self, mut buf: BufferMut<'_>, rop: ReduceOp) -> Result<()> {
        let elem = buf.elem();
        let esize = elem.size();
        let count = buf.len();
        let h = self.header(op::ALL_REDUCE, elem, count, rop.code() as u64);
        self.run("all_reduce", |ring, deadline| {
            ring.begin(deadline, h, true)?;
            let n = ring.world;
            let r = ring.rank;
            let bound = |i: usize| ((i as u128 * count as u128 / n as u128) as usize) * esize;
            let chunk = |i: usize| bound(i)..bound(i + 1);
            let bytes = buf.bytes_mut();
            let steps = |s: usize| ((r + n - s) % n, (r + 2 * n - s - 1) % n);
            ring.reduce_steps("all_reduce", deadline, bytes, elem, rop, &chunk, steps)?;
            if rop == ReduceOp::Mean {
                finish_mean(elem, &mut bytes[chunk((r + 1) % n)], n)?;
            }
            for s in 0..n - 1 {
                let (si, ri) = ((r + 1 + n - s) % n, (r + n - s) % n);
                let (send, dest) = split_pair(bytes, chunk(si), chunk(ri));
                ring.exchange("all_reduce", deadline, send, dest, esize, |_, _| Ok(()))?;
            }
            Ok(())
        })
    }

    /// Ring reduce-scatter: the first half of [`all_reduce`](Self::all_reduce), its schedule
    /// shifted by one so that rank `r` ends with chunk `r` (see
    /// [`chunk_range`](crate::collective::chunk_range)).
    pub(crate) fn reduce_scatter(&mut self, mut buf: BufferMut<'_>, rop: ReduceOp) -> Result<()> {
        let elem = buf.elem();
        let esize = elem.size();
        let count = buf.len();
        let h = self.header(op::REDUCE_SCATTER, elem, count, rop.code() as u64);
        self.run("reduce_scatter", |ring, deadline| {
            ring.begin(deadline, h, true)?;
            let (n, r) = (ring.world, ring.rank);
            let chunk = |i: usize| {
                let c = crate::collective::chunk_range(count, n, i);
                c.start * esize..c.end * esize
            };
            let bytes = buf.bytes_mut();
            // Step s: send the partial sum of chunk r - s - 1, receive and add chunk r - s - 2;
            // the last chunk received and completed is chunk r.
            let steps = |s: usize| ((r + 2 * n - s - 1) % n, (r + 2 * n - s - 2) % n);
            ring.reduce_steps("reduce_scatter", deadline, bytes, elem, rop, &chunk, steps)?;
            if rop == ReduceOp::Mean {
                finish_mean(elem, &mut bytes[chunk(r)], n)?;
            }
            Ok(())
        })
    }

    /// Ring all-gather into one buffer: the second half of [`all_reduce`](Self::all_reduce), each
    /// rank starting from its own chunk.
    pub(crate) fn all_gather_into(&mut self, mut buf: BufferMut<'_>) -> Result<()> {
        let elem = buf.elem();
        let esize = elem.size();
        let count = buf.len();
        let h = self.header(op::ALL_GATHER_INTO, elem, count, 0);
        self.run("all_gather_into", |ring, deadline| {
            ring.begin(deadline, h, true)?;
            let (n, r) = (ring.world, ring.rank);
            let chunk = |i: usize| {
                let c = crate::collective::chunk_range(count, n, i);
                c.start * esize..c.end * esize
            };
            let bytes = buf.bytes_mut();
            for s in 0..n - 1 {
                // Step s: pass on chunk r - s (my own first), receive chunk r - s - 1.
                let (si, ri) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
                let (send, dest) = split_pair(bytes, chunk(si), chunk(ri));
                ring.exchange(
                    "all_gather_into",
                    deadline,
                    send,
                    dest,
                    esize,
                    |_, _| Ok(()),
                )?;
            }
            Ok(())
        })
    }

    /// Pipelined broadcast along the ring, starting at `root`.
    pub(crate) fn broadcast(&mut self, mut buf: BufferMut<'_>, root: usize) -> Result<()> {
        let h = self.header(op::BROADCAST, buf.elem(), buf.len(), root as u64);
        self.run("broadcast", |ring, deadline| {
            ring.begin(deadline, h, true)?;
            let n = ring.world;
            let pos = (ring.rank + n - root) % n;
            let bytes = buf.bytes_mut();
            let name = "broadcast";
            if pos == 0 {
                return ring.exchange(name, deadline, bytes, &mut [], 1, |_, _| Ok(()));
            }
            if pos == n - 1 {
                return ring.exchange(name, deadline, &[], bytes, 1, |_, _| Ok(()));
            }
            // Relay: forward what has arrived while the rest is still coming in.
            let len = bytes.len();
            let (mut got, mut sent) = (0usize, 0usize);
            while sent < len {
                while got < len {
                    let k = ring.read_some(name, &mut bytes[got..])?;
                    if k == 0 {
                        break;
                    }
                    got += k;
                }
                while sent < got {
                    let k = ring.write_some(name, &bytes[sent..got])?;
                    if k == 0 {
                        break;
                    }
                    sent += k;
                }
                if sent < len {
                    ring.wait(name, sent < got, got < len, deadline)?;
                }
            }
            Ok(())
        })
    }

    /// Ring all-gather of blocks whose sizes may differ: sizes first, then the data.
    pub(crate) fn all_gather(&mut self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        let elem = buf.elem();
        let h = self.header(op::ALL_GATHER, elem, 0, 0);
        self.run("all_gather", |ring, deadline| {
            ring.begin(deadline, h, false)?;
            let (n, r) = (ring.world, ring.rank);
            let name = "all_gather";
            let mut lens = vec![0u64; n];
            lens[r] = buf.bytes().len() as u64;
            for s in 0..n - 1 {
                let (si, ri) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
                let out = lens[si].to_le_bytes();
                let mut inc = [0u8; 8];
                ring.exchange(name, deadline, &out, &mut inc, 8, |_, _| Ok(()))?;
                lens[ri] = u64::from_le_bytes(inc);
            }
            let total: u128 = lens.iter().map(|&l| l as u128).sum();
            for (k, &l) in lens.iter().enumerate() {
                if l > wire::MAX_GATHER_BYTES
                    || l % elem.size() as u64 != 0
                    || total > wire::MAX_GATHER_BYTES as u128
                {
                    return Err(Error::Peer {
                        rank: r,
                        peer: ring.prev_rank(),
                        op: name.into(),
                        reason: format!(
                            "announced {l} bytes for rank {k}'s block ({total} in all): not a whole number of {elem} or over the {}-byte limit",
                            wire::MAX_GATHER_BYTES
                        ),
                        source: None,
                    });
                }
            }
            let mut blocks: Vec<AlignedBytes> = lens
                .iter()
                .enumerate()
                .map(|(k, &l)| {
                    if k == r {
                        AlignedBytes::copy_from(buf.bytes())
                    } else {
                        AlignedBytes::zeroed(l as usize)
                    }
                })
                .collect();
            for s in 0..n - 1 {
                let (si, ri) = ((r + n - s) % n, (r + 2 * n - s - 1) % n);
                let mut into = std::mem::take(&mut blocks[ri]);
                let res = ring.exchange(name, deadline, blocks[si].as_ref(), into.as_mut(), 1, |_, _| {
                    Ok(())
                });
                blocks[ri] = into;
                res?;
            }
            Ok(blocks
                .into_iter()
                .map(|b| OwnedBuffer::new(b, elem))
                .collect())
        })
    }

    /// Header exchange plus `world - 2` token passes: after `world - 1` ring steps every rank
    /// knows that every other rank has arrived.
    pub(crate) fn barrier(&mut self) -> Result<()> {
        let h = self.header(op::BARRIER, ElemType::U8, 0, 0);
        self.run("barrier", |ring, deadline| {
            ring.begin(deadline, h, true)?;
            for _ in 0..ring.world.saturating_sub(2) {
                let mut tok = [0u8; 1];
                ring.exchange("barrier", deadline, &[1], &mut tok, 1, |_, _| Ok(()))?;
            }
            Ok(())
        })
    }
}
