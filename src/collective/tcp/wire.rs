//! The wire protocol: connection handshake, store frames and collective headers.
//!
//! Every connection (to the rendezvous store or between peers) starts with a [`Hello`]:
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `ACRS` |
//! | 2 | protocol version (little endian) |
//! | 1 | role: 1 = store client, 2 = peer |
//! | 1 | reserved (0) |
//! | 4 | rank |
//! | 4 | world size |
//! | 2 | secret length (at most [`MAX_SECRET`]) |
//! | n | secret |
//!
//! Every length or count read from a socket is checked against a bound before anything is
//! allocated; a connection that breaks a bound, has the wrong magic, version or secret is dropped
//! and logged, and the run goes on. The whole handshake has one deadline (not one per read), so a
//! client that trickles bytes cannot hold a connection open.
//!
//! The store answers a handshake with one status byte: [`STATUS_OK`], or before hanging up
//! [`STATUS_BUSY`] (too many connections: retry), [`STATUS_WRONG_SECRET`] (the store belongs to
//! another run, or the ranks were given different secrets) or [`STATUS_VERSION`] (another
//! protocol version). Garbage gets no answer.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

/// Magic bytes that open every connection.
pub const MAGIC: [u8; 4] = *b"ACRS";
/// Protocol version; both ends must agree.
pub const VERSION: u16 = 2;
/// Longest secret accepted, in bytes.
pub const MAX_SECRET: usize = 256;
/// Longest store key, in bytes.
pub const MAX_KEY: usize = 1024;
/// Largest store value, in bytes.
pub const MAX_VALUE: usize = 1 << 20;
/// Largest block one rank may contribute to an all-gather, in bytes (64 GiB).
pub const MAX_GATHER_BYTES: u64 = 1 << 36;

/// Who opens a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A rank talking to the rendezvous store.
    StoreClient = 1,
    /// A rank connecting to its ring neighbour.
    Peer = 2,
}

/// The first frame of every connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Who is connecting.
    pub role: Role,
    /// The connecting rank.
    pub rank: u32,
    /// The world size it believes in.
    pub world: u32,
    /// The per-run secret.
    pub secret: Vec<u8>,
}

impl Hello {
    /// Serialises the frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(18 + self.secret.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.push(self.role as u8);
        b.push(0);
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&(self.secret.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.secret);
        b
    }

    /// Reads and validates a frame. The error says why the caller drops the connection (and,
    /// through [`HelloError::status`], what to answer first).
    pub fn read_checked(r: &mut impl Read, secret: &[u8]) -> Result<Hello, HelloError> {
        let mut head = [0u8; 18];
        r.read_exact(&mut head)
            .map_err(|e| HelloError::Incomplete(e.to_string()))?;
        if head[0..4] != MAGIC {
            return Err(HelloError::NotAccelerate([
                head[0], head[1], head[2], head[3],
            ]));
        }
        let version = u16::from_le_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(HelloError::Version(version));
        }
        let role = match head[6] {
            1 => Role::StoreClient,
            2 => Role::Peer,
            other => return Err(HelloError::Role(other)),
        };
        let rank = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let world = u32::from_le_bytes([head[12], head[13], head[14], head[15]]);
        let len = u16::from_le_bytes([head[16], head[17]]) as usize;
        if len > MAX_SECRET {
            return Err(HelloError::SecretTooLong(len));
        }
        let mut got = vec![0u8; len];
        r.read_exact(&mut got)
            .map_err(|e| HelloError::Incomplete(e.to_string()))?;
        if !constant_time_eq(&got, secret) {
            return Err(HelloError::WrongSecret);
        }
        Ok(Hello {
            role,
            rank,
            world,
            secret: got,
        })
    }
}

/// Why a handshake was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloError {
    /// The connection ended, failed or ran out of time before a whole frame arrived.
    Incomplete(String),
    /// The first bytes are not accelerate-rs's magic.
    NotAccelerate([u8; 4]),
    /// Another protocol version.
    Version(u16),
    /// An unknown role byte.
    Role(u8),
    /// A secret longer than [`MAX_SECRET`].
    SecretTooLong(usize),
    /// A secret different from this run's.
    WrongSecret,
}

impl HelloError {
    /// The status byte the store sends before hanging up, if any.
    pub fn status(&self) -> Option<u8> {
        match self {
            HelloError::WrongSecret => Some(STATUS_WRONG_SECRET),
            HelloError::Version(_) => Some(STATUS_VERSION),
            _ => None,
        }
    }
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::Incomplete(e) => write!(f, "incomplete handshake: {e}"),
            HelloError::NotAccelerate(m) => {
                write!(f, "not an accelerate-rs connection (magic {m:02x?})")
            }
            HelloError::Version(v) => {
                write!(f, "protocol version {v}, this build speaks {VERSION}")
            }
            HelloError::Role(r) => write!(f, "unknown role {r}"),
            HelloError::SecretTooLong(len) => write!(
                f,
                "secret of {len} bytes is over the {MAX_SECRET}-byte limit"
            ),
            HelloError::WrongSecret => write!(
                f,
                "wrong secret (another run, or ACCELERATE_RS_SECRET differs between ranks)"
            ),
        }
    }
}

impl std::error::Error for HelloError {}

/// Reports a connection that was refused or dropped (wrong secret, garbage, a flood): through
/// `log` at warn level when a logger takes it, else straight to stderr, so that a run whose
/// program set up no logging still shows them. After the first 16, only every power of two is
/// printed, with the running count, so that a flood cannot flood stderr too.
pub(crate) fn warn_rejected(msg: std::fmt::Arguments<'_>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed) + 1;
    if n > 16 && !n.is_power_of_two() {
        return;
    }
    let tally = if n > 16 {
        format!(" ({n} connections refused so far; the others are not shown)")
    } else {
        String::new()
    };
    if log::log_enabled!(log::Level::Warn) {
        log::warn!("{msg}{tally}");
    } else {
        eprintln!("accelerate-rs: warning: {msg}{tally}");
    }
}

/// Reads from a socket under one deadline for all reads together: each read waits at most until
/// `until`, then fails with [`io::ErrorKind::TimedOut`]. (A plain read timeout applies per read,
/// so a sender trickling one byte at a time would never time out.)
pub(crate) struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl<'a> DeadlineReader<'a> {
    /// Reads from `stream` until `until`.
    pub(crate) fn new(stream: &'a TcpStream, until: Instant) -> Self {
        DeadlineReader { stream, until }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake took too long",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        match self.stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake took too long",
            )),
            other => other,
        }
    }
}

/// Compares without an early exit, so timing does not reveal how much of a secret matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Store request codes.
pub const STORE_SET: u8 = 1;
/// Store request: wait for a key.
pub const STORE_GET: u8 = 2;

/// Store reply status: done.
pub const STATUS_OK: u8 = 0;
/// Store reply status: the key did not appear in time.
pub const STATUS_TIMEOUT: u8 = 1;
/// Handshake refused: the store serves too many connections right now; retry.
pub const STATUS_BUSY: u8 = 2;
/// Handshake refused: the secret is not this run's.
pub const STATUS_WRONG_SECRET: u8 = 3;
/// Handshake refused: another protocol version.
pub const STATUS_VERSION: u8 = 4;

/// Reads a `u32` length and checks it against `max` before allocating, then reads the bytes.
pub fn read_bounded(r: &mut impl Read, max: usize, what: &str) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} of {len} bytes is over the {max}-byte limit"),
        ));
    }
    let mut b = vec![0u8; len];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// Writes a `u32` length then the bytes.
pub fn write_bytes(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    let len = u32::try_from(b.len()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} bytes do not fit a frame", b.len()),
        )
    })?;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(b)
}

/// Operation codes carried in [`OpHeader`].
pub mod op {
    /// all_reduce
    pub const ALL_REDUCE: u8 = 1;
    /// broadcast
    pub const BROADCAST: u8 = 2;
    /// all_gather
    pub const ALL_GATHER: u8 = 3;
    /// barrier
    pub const BARRIER: u8 = 4;
    /// reduce_scatter
    pub const REDUCE_SCATTER: u8 = 5;
    /// all_gather_into
    pub const ALL_GATHER_INTO: u8 = 6;

    /// Name of an operation code.
    pub fn name(code: u8) -> &'static str {
        match code {
            ALL_REDUCE => "all_reduce",
            BROADCAST => "broadcast",
            ALL_GATHER => "all_gather",
            BARRIER => "barrier",
            REDUCE_SCATTER => "reduce_scatter",
            ALL_GATHER_INTO => "all_gather_into",
            _ => "unknown operation",
        }
    }
}

/// Sent to the next rank at the start of every collective so that ranks calling different
/// operations, sizes or element types are caught instead of exchanging garbage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpHeader {
    /// Operation code ([`op`]).
    pub op: u8,
    /// Element type code.
    pub elem: u8,
    /// Sequence number of the collective on this communicator.
    pub seq: u64,
    /// Element count (0 for all_gather, whose sizes may differ).
    pub count: u64,
    /// Root of a broadcast or code of a reduction.
    pub aux: u64,
}

/// Size of an encoded [`OpHeader`].
pub const HEADER_LEN: usize = 32;
const HEADER_MAGIC: [u8; 4] = *b"ACop";

impl OpHeader {
    /// Serialises the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&HEADER_MAGIC);
        b[4] = self.op;
        b[5] = self.elem;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Parses a header; `None` when the bytes are not one.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Option<Self> {
        if b[0..4] != HEADER_MAGIC {
            return None;
        }
        let u = |r: std::ops::Range<usize>| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[r]);
            u64::from_le_bytes(x)
        };
        Some(OpHeader {
            op: b[4],
            elem: b[5],
            seq: u(8..16),
            count: u(16..24),
            aux: u(24..32),
        })
    }

    /// Human readable form for mismatch reports.
    pub fn describe(&self) -> String {
        format!(
            "{} #{} (elem code {}, count {}, aux {})",
            op::name(self.op),
            self.seq,
            self.elem,
            self.count,
            self.aux
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handshake layout that `tests/it/faults.rs` writes by hand as a rogue client.
    #[test]
    fn hello_layout_is_pinned() {
        let bytes = Hello {
            role: Role::StoreClient,
            rank: 1,
            world: 3,
            secret: b"xy".to_vec(),
        }
        .encode();
        let mut want = b"ACRS".to_vec();
        want.extend_from_slice(&[2, 0, 1, 0, 1, 0, 0, 0, 3, 0, 0, 0, 2, 0]);
        want.extend_from_slice(b"xy");
        assert_eq!(bytes, want);
    }

    #[test]
    fn hello_round_trip_and_rejections() {
        let h = Hello {
            role: Role::Peer,
            rank: 3,
            world: 4,
            secret: b"s3cret".to_vec(),
        };
        let bytes = h.encode();
        assert_eq!(
            Hello::read_checked(&mut &bytes[..], b"s3cret"),
            Ok(h.clone())
        );
        let err = Hello::read_checked(&mut &bytes[..], b"other").unwrap_err();
        assert!(err.to_string().contains("wrong secret"), "{err}");
        assert_eq!(err.status(), Some(STATUS_WRONG_SECRET));
        let err = Hello::read_checked(&mut &b"GET / HTTP/1.1\r\n\r\n"[..], b"").unwrap_err();
        assert!(
            err.to_string().contains("not an accelerate-rs connection"),
            "{err}"
        );
        assert_eq!(err.status(), None);
        let mut long = bytes[..16].to_vec();
        long.extend_from_slice(&60000u16.to_le_bytes());
        let err = Hello::read_checked(&mut &long[..], b"").unwrap_err();
        assert!(err.to_string().contains("limit"), "{err}");
        let mut v2 = bytes.clone();
        v2[4] = 9;
        let err = Hello::read_checked(&mut &v2[..], b"s3cret").unwrap_err();
        assert!(err.to_string().contains("version 9"), "{err}");
        assert_eq!(err.status(), Some(STATUS_VERSION));
    }

    #[test]
    fn bounded_reads_refuse_before_allocating() {
        let mut frame = (u32::MAX).to_le_bytes().to_vec();
        frame.extend_from_slice(b"abc");
        let err = read_bounded(&mut &frame[..], MAX_VALUE, "value").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let mut ok = Vec::new();
        write_bytes(&mut ok, b"hello").unwrap();
        assert_eq!(read_bounded(&mut &ok[..], 5, "value").unwrap(), b"hello");
    }

    #[test]
    fn header_round_trip() {
        let h = OpHeader {
            op: op::BROADCAST,
            elem: 4,
            seq: 7,
            count: 1 << 40,
            aux: 2,
        };
        assert_eq!(OpHeader::decode(&h.encode()), Some(h));
        assert_eq!(OpHeader::decode(&[0u8; HEADER_LEN]), None);
    }
}
