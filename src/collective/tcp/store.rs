//! The rendezvous store: a key/value server hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`, with a
//! blocking "wait for key" read. Ranks publish their peer addresses through it.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::wire::{self, DeadlineReader, Hello, Role};
use crate::error::{Error, Result};

/// How long a fresh connection may take to send its whole handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most keys the store holds (bounds the memory an authenticated client can claim).
const MAX_KEYS: usize = 1 << 16;
/// Most authenticated connections served at once; more are turned away with
/// [`wire::STATUS_BUSY`] (bounds the threads that clients knowing the secret can take).
const MAX_CONNECTIONS: usize = 512;
/// Most connections in their handshake at once, and per remote address. When a new connection
/// would exceed either, the oldest handshake (of that address, else of the address with the most)
/// is dropped: a real rank sends its handshake at once and is done in milliseconds, so connections
/// that send nothing or trickle bytes cannot keep it out.
const MAX_HANDSHAKES: usize = 256;
const MAX_HANDSHAKES_PER_ADDR: usize = 64;

type Map = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// The connections still in their handshake, oldest first, by remote address.
#[derive(Default)]
struct Handshakes {
    next_id: u64,
    total: usize,
    by_addr: HashMap<IpAddr, VecDeque<(u64, TcpStream)>>,
}

impl Handshakes {
    /// Registers a new connection (a clone of its socket, to drop it if it must make room) and
    /// returns its id plus the address of a handshake dropped to make room, if one was.
    fn admit(&mut self, ip: IpAddr, stream: TcpStream) -> (u64, Option<SocketAddr>) {
        let full_here = self
            .by_addr
            .get(&ip)
            .is_some_and(|q| q.len() >= MAX_HANDSHAKES_PER_ADDR);
        let victim = if full_here {
            Some(ip)
        } else if self.total >= MAX_HANDSHAKES {
            self.by_addr
                .iter()
                .max_by_key(|(_, q)| q.len())
                .map(|(a, _)| *a)
        } else {
            None
        };
        let dropped = victim.and_then(|a| self.evict_oldest(a));
        let id = self.next_id;
        self.next_id += 1;
        self.by_addr.entry(ip).or_default().push_back((id, stream));
        self.total += 1;
        (id, dropped)
    }

    /// Drops the oldest handshake of `ip`: tells it to retry, then shuts its socket, which ends
    /// the read its thread is blocked in.
    fn evict_oldest(&mut self, ip: IpAddr) -> Option<SocketAddr> {
        let q = self.by_addr.get_mut(&ip)?;
        let (_, s) = q.pop_front()?;
        if q.is_empty() {
            self.by_addr.remove(&ip);
        }
        self.total -= 1;
        let _ = (&s).write_all(&[wire::STATUS_BUSY]);
        let _ = s.shutdown(Shutdown::Both);
        s.peer_addr().ok()
    }

    /// Removes connection `id` once its handshake ended; false when it was dropped to make room.
    fn finish(&mut self, ip: IpAddr, id: u64) -> bool {
        let Some(q) = self.by_addr.get_mut(&ip) else {
            return false;
        };
        let Some(pos) = q.iter().position(|(i, _)| *i == id) else {
            return false;
        };
        q.remove(pos);
        if q.is_empty() {
            self.by_addr.remove(&ip);
        }
        self.total -= 1;
        true
    }
}

/// What the connection threads share.
struct Shared {
    map: Map,
    secret: Vec<u8>,
    rank: usize,
    handshakes: Mutex<Handshakes>,
    /// Authenticated connections being served.
    live: AtomicUsize,
}

impl Shared {
    fn handshakes(&self) -> std::sync::MutexGuard<'_, Handshakes> {
        self.handshakes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The server side, owned by rank 0. Dropping it stops accepting connections.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Serves on `listener` in background threads.
    pub(crate) fn start(listener: TcpListener, secret: Vec<u8>, rank: usize) -> io::Result<Self> {
        listener.set_nonblocking(false)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            map: Arc::new((Mutex::new(HashMap::new()), Condvar::new())),
            secret,
            rank,
            handshakes: Mutex::new(Handshakes::default()),
            live: AtomicUsize::new(0),
        });
        let stop2 = stop.clone();
        std::thread::Builder::new()
            .name("accelerate-rs-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    accept(stream, &shared);
                }
            })?;
        Ok(StoreServer { addr, stop })
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Registers a fresh connection as a handshake (dropping the oldest one if there is no room)
/// and serves it in its own thread.
fn accept(stream: TcpStream, shared: &Arc<Shared>) {
    let rank = shared.rank;
    let (Ok(peer), Ok(clone)) = (stream.peer_addr(), stream.try_clone()) else {
        return;
    };
    let (id, dropped) = shared.handshakes().admit(peer.ip(), clone);
    if let Some(old) = dropped {
        wire::warn_rejected(format_args!("rank {rank}: rendezvous store: dropped connection from {old}: too many connections still in their handshake (made room for {peer})"));
    }
    let shared2 = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("accelerate-rs-store-conn".into())
        .spawn(move || serve(stream, peer, id, &shared2));
    if let Err(e) = spawned {
        shared.handshakes().finish(peer.ip(), id);
        log::warn!("rank {rank}: rendezvous store: cannot serve a connection from {peer}: {e}");
    }
}

fn lock(map: &Map) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
    map.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves one connection; any protocol violation drops it with a log line.
fn serve(stream: TcpStream, peer: SocketAddr, id: u64, shared: &Shared) {
    let rank = shared.rank;
    match handshake(&stream, peer, id, shared) {
        Ok(()) => {
            let res = serve_requests(&stream, &shared.map);
            shared.live.fetch_sub(1, Ordering::SeqCst);
            if let Err(reason) = res {
                if reason.kind() != io::ErrorKind::UnexpectedEof {
                    log::warn!(
                        "rank {rank}: rendezvous store: dropped connection from {peer}: {reason}"
                    );
                }
            }
        }
        Err(Some(reason)) => wire::warn_rejected(format_args!(
            "rank {rank}: rendezvous store: dropped connection from {peer}: {reason}"
        )),
        Err(None) => {}
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads and answers the handshake within [`HANDSHAKE_TIMEOUT`]. `Err(None)`: the connection was
/// dropped to make room (already logged).
fn handshake(
    stream: &TcpStream,
    peer: SocketAddr,
    id: u64,
    shared: &Shared,
) -> std::result::Result<(), Option<String>> {
    let read = Hello::read_checked(
        &mut DeadlineReader::new(stream, Instant::now() + HANDSHAKE_TIMEOUT),
        &shared.secret,
    );
    // Out of the handshake list first, so that nothing else writes to the socket.
    if !shared.handshakes().finish(peer.ip(), id) {
        return Err(None);
    }
    let mut w = stream;
    let hello = match read {
        Ok(h) => h,
        Err(e) => {
            if let Some(status) = e.status() {
                let _ = w.write_all(&[status]);
            }
            return Err(Some(e.to_string()));
        }
    };
    if hello.role != Role::StoreClient {
        return Err(Some(format!(
            "rank {} connected to the store as a peer",
            hello.rank
        )));
    }
    if shared.live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        shared.live.fetch_sub(1, Ordering::SeqCst);
        let _ = w.write_all(&[wire::STATUS_BUSY]);
        return Err(Some(format!(
            "already serving {MAX_CONNECTIONS} connections (rank {} was told to retry)",
            hello.rank
        )));
    }
    let ok = stream
        .set_read_timeout(None)
        .and_then(|()| w.write_all(&[wire::STATUS_OK]));
    if let Err(e) = ok {
        shared.live.fetch_sub(1, Ordering::SeqCst);
        return Err(Some(format!("cannot acknowledge the handshake: {e}")));
    }
    Ok(())
}

fn serve_requests(stream: &TcpStream, map: &Map) -> io::Result<()> {
    let mut r = BufReader::new(stream);
    let mut w = BufWriter::new(stream);
    loop {
        let mut op = [0u8; 1];
        match r.read_exact(&mut op) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            other => other?,
        }
        let key = wire::read_bounded(&mut r, wire::MAX_KEY, "key")?;
        let key = String::from_utf8(key)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))?;
        match op[0] {
            wire::STORE_SET => {
                let value = wire::read_bounded(&mut r, wire::MAX_VALUE, "value")?;
                let mut m = lock(map);
                if m.len() >= MAX_KEYS && !m.contains_key(&key) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("store is full ({MAX_KEYS} keys)"),
                    ));
                }
                m.insert(key, value);
                map.1.notify_all();
                drop(m);
                w.write_all(&[wire::STATUS_OK])?;
                wire::write_bytes(&mut w, &[])?;
            }
            wire::STORE_GET => {
                let mut t = [0u8; 8];
                r.read_exact(&mut t)?;
                // At most a day: a client cannot park a thread forever.
                let wait = Duration::from_millis(u64::from_le_bytes(t).min(86_400_000));
                let deadline = crate::settings::limits::deadline_after(wait);
                let mut m = lock(map);
                let value = loop {
                    if let Some(v) = m.get(&key) {
                        break Some(v.clone());
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break None;
                    }
                    m = map
                        .1
                        .wait_timeout(m, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                };
                drop(m);
                match value {
                    Some(v) => {
                        w.write_all(&[wire::STATUS_OK])?;
                        wire::write_bytes(&mut w, &v)?;
                    }
                    None => {
                        w.write_all(&[wire::STATUS_TIMEOUT])?;
                        wire::write_bytes(&mut w, &[])?;
                    }
                }
            }
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown request code {other}"),
                ))
            }
        }
        w.flush()?;
    }
}

/// A rank's connection to the store.

#[derive(Debug)]
pub(crate) struct StoreClient {
    stream: TcpStream,
    rank: usize,
    addr: String,
    /// The collective timeout, which also bounds start-up (for error messages).
    timeout: Duration,
}

/// A collective timeout below this is called too short when start-up runs out of time.
const SHORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `timeout` is too short for start-up (see [`startup_hint`]).
pub(crate) fn is_short(timeout: Duration) -> bool {
    timeout < SHORT_TIMEOUT
}

/// What to add to a start-up error caused by running out of `timeout`: the timeout, and a hint
/// when it is too short for processes to start and meet.
pub(crate) fn startup_hint(timeout: Duration) -> String {
    if timeout < SHORT_TIMEOUT {
        format!(
            "the collective timeout of {timeout:?}, which also bounds start-up, is too short for \
             the ranks to start and meet: raise --collective-timeout-secs / \
             ACCELERATE_RS_TIMEOUT_SECS / collective_timeout_secs"
        )
    } else {
        format!("waited the collective timeout of {timeout:?}")
    }
}

/// A rendezvous error of `rank` about the store at `addr`.
fn store_err(rank: usize, addr: &str, reason: String, source: Option<io::Error>) -> Error {
    Error::Rendezvous {
        rank,
        addr: addr.to_string(),
        reason,
        source,
    }
}

/// Connects to the store at `addr`, retrying until `deadline` (rank 0 may not be up yet); the
/// error past it says what to check.
fn wait_for_store(
    addr: &str,
    rank: usize,
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last_log = Instant::now();
    loop {
        let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                return Err(store_err(
                    rank,
                    addr,
                    "cannot resolve the address".into(),
                    Some(e),
                ))
            }
        };
        let mut last_err = None;
        for a in &resolved {
            match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                Ok(s) => return Ok(s),
                Err(e) => last_err = Some(e),
            }
        }
        if Instant::now() >= deadline {
            let reason = if timeout < SHORT_TIMEOUT {
                format!(
                    "rank 0's rendezvous store was not up yet when time ran out: {}",
                    startup_hint(timeout)
                )
            } else {
                format!("rank 0's rendezvous store did not come up in time ({}; is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?)", startup_hint(timeout))
            };
            return Err(store_err(rank, addr, reason, last_err));
        }
        if last_log.elapsed() > Duration::from_secs(30) {
            log::info!("rank {rank}: still waiting for the rendezvous store at {addr}");
            last_log = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `hello` on `stream` and reads the store's answer: `true` accepted, `false` busy, an
/// error naming the reason otherwise.
fn client_handshake(
    stream: &TcpStream,
    addr: &str,
    rank: usize,
    hello: &Hello,
    deadline: Instant,
) -> Result<bool> {
    let fail = |reason: String, source: Option<io::Error>| store_err(rank, addr, reason, source);
    let io = |e: io::Error| fail("handshake failed".into(), Some(e));
    stream.set_nodelay(true).map_err(io)?;
    let mut stream = stream;
    stream.write_all(&hello.encode()).map_err(io)?;
    stream
        .set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1)),
        ))
        .map_err(io)?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(|e| {
        fail(
            "the store closed the connection during the handshake without an answer (is MASTER_ADDR:MASTER_PORT rank 0's store, running the same accelerate-rs version?)".into(),
            Some(e),
        )
    })?;
    match status[0] {
        wire::STATUS_OK => {}
        wire::STATUS_BUSY => return Ok(false),
        wire::STATUS_WRONG_SECRET => return Err(fail(
            "this store belongs to another run: it rejected this run's secret (did two runs get the same MASTER_PORT? every rank of one run needs the same ACCELERATE_RS_SECRET)".into(),
            None,
        )),
        wire::STATUS_VERSION => return Err(fail(
            format!("rank 0 runs another accelerate-rs version (this rank speaks protocol version {})", wire::VERSION),
            None,
        )),
        other => return Err(fail(
            format!("the store answered the handshake with unknown status {other}"),
            None,
        )),
    }
    stream.set_read_timeout(None).map_err(io)?;
    Ok(true)
}

impl StoreClient {
    /// Connects to `addr`, retrying until `deadline` (`timeout` from the start of the group's
    /// set-up) while the server is not up yet or busy.
    pub(crate) fn connect(
        addr: &str,
        rank: usize,
        world: usize,
        secret: &[u8],
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Self> {
        let mut turned_away = 0usize;
        loop {
            if let Some(client) = Self::try_connect(addr, rank, world, secret, timeout, deadline)? {
                return Ok(client);
            }
            turned_away += 1;
            if Instant::now() >= deadline {
                return Err(Error::Rendezvous {
                    rank,
                    addr: addr.to_string(),
                    reason: format!("rank 0's rendezvous store turned this rank away {turned_away} time(s) because it was serving too many connections (a flood of connections to MASTER_PORT?)"),
                    source: None,
                });
            }
            log::debug!("rank {rank}: the rendezvous store at {addr} is busy; retrying");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One connection and handshake; `Ok(None)` when the store says it is busy.
    fn try_connect(
        addr: &str,
        rank: usize,
        world: usize,
        secret: &[u8],
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Option<Self>> {
        let stream = wait_for_store(addr, rank, timeout, deadline)?;
        let hello = Hello {
            role: Role::StoreClient,
            rank: rank as u32,
            world: world as u32,
            secret: secret.to_vec(),
        };
        if !client_handshake(&stream, addr, rank, &hello, deadline)? {
            return Ok(None);
        }
        Ok(Some(StoreClient {
            stream,
            rank,
            addr: addr.to_string(),
            timeout,
        }))
    }

    /// The local address of the connection: the interface that reaches rank 0, which is the one
    /// to offer peers.
    pub(crate) fn local_addr(&self) -> Result<SocketAddr> {
        self.stream
            .local_addr()
            .map_err(|e| self.err("cannot read the local address", e))
    }

    fn err(&self, reason: &str, e: io::Error) -> Error {
        Error::Rendezvous {
            rank: self.rank,
            addr: self.addr.clone(),
            reason: reason.to_string(),
            source: Some(e),
        }
    }

    /// Stores `value` under `key`.
    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut frame = vec![wire::STORE_SET];
        let write = (|| {
            wire::write_bytes(&mut frame, key.as_bytes())?;
            wire::write_bytes(&mut frame, value)?;
            (&self.stream).write_all(&frame)?;
            let mut status = [0u8; 1];
            (&self.stream).read_exact(&mut status)?;
            wire::read_bounded(&mut &self.stream, wire::MAX_VALUE, "reply")
        })();
        write
            .map(|_| ())
            .map_err(|e| self.err(&format!("store set `{key}` failed"), e))
    }

    /// Waits until `key` exists (or `deadline` passes) and returns its value.
    pub(crate) fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let mut frame = vec![wire::STORE_GET];
        let res = (|| {
            wire::write_bytes(&mut frame, key.as_bytes())?;
            frame.extend_from_slice(&(wait.as_millis() as u64).to_le_bytes());
            (&self.stream).write_all(&frame)?;
            // The server answers at its deadline; allow a margin for the network.
            self.stream
                .set_read_timeout(Some(wait + Duration::from_secs(30)))?;
            let mut status = [0u8; 1];
            (&self.stream).read_exact(&mut status)?;
            let v = wire::read_bounded(&mut &self.stream, wire::MAX_VALUE, "value")?;
            Ok::<_, io::Error>((status[0], v))
        })();
        match res {
            Ok((wire::STATUS_OK, v)) => Ok(v),
            Ok(_) => Err(Error::Rendezvous {
                rank: self.rank,
                addr: self.addr.clone(),
                reason: format!(
                    "key `{key}` did not appear within {wait:?} (did every rank start? {})",
                    startup_hint(self.timeout)
                ),
                source: None,
            }),
            Err(e) => Err(self.err(&format!("store get `{key}` failed"), e)),
        }
    }
}
