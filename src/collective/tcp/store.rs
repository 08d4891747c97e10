//! The rendezvous store: a key/value server hosted by rank 0 at `MASTER_ADDR:MASTER_PORT`, with a
//! blocking "wait for key" read. Ranks publish their peer addresses through it.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::wire::{self, Hello, Role};
use crate::error::{Error, Result};

/// How long a fresh connection may take to send its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most keys the store holds (bounds the memory an authenticated client can claim).
const MAX_KEYS: usize = 1 << 16;
/// Most connections served at once; more are closed at once (bounds the threads a flood of
/// connections to `MASTER_PORT` can take).
const MAX_CONNECTIONS: usize = 512;

type Map = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// The server side, owned by rank 0. Dropping it stops accepting connections.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Binds `bind` and serves in background threads.
    pub(crate) fn start(bind: SocketAddr, secret: Vec<u8>, rank: usize) -> io::Result<Self> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let map: Map = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let secret = Arc::new(secret);
        let stop2 = stop.clone();
        let live = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("accelerate-rs-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    if live.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                        let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                        log::warn!("rank {rank}: rendezvous store: dropped connection from {from}: already serving {MAX_CONNECTIONS} connections");
                        continue;
                    }
                    live.fetch_add(1, Ordering::SeqCst);
                    let (map, secret, live2) = (map.clone(), secret.clone(), live.clone());
                    let spawned = std::thread::Builder::new()
                        .name("accelerate-rs-store-conn".into())
                        .spawn(move || {
                            serve(stream, &map, &secret, rank);
                            live2.fetch_sub(1, Ordering::SeqCst);
                        });
                    if let Err(e) = spawned {
                        live.fetch_sub(1, Ordering::SeqCst);
                        log::warn!("rank {rank}: rendezvous store: cannot serve a connection: {e}");
                    }
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

fn lock(map: &Map) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
    map.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves one connection; any protocol violation drops it with a log line.
fn serve(stream: TcpStream, map: &Map, secret: &[u8], rank: usize) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    if let Err(reason) = serve_inner(&stream, map, secret) {
        if reason.kind() != io::ErrorKind::UnexpectedEof {
            log::warn!("rank {rank}: rendezvous store: dropped connection from {peer}: {reason}");
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_inner(stream: &TcpStream, map: &Map, secret: &[u8]) -> io::Result<()> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut r = BufReader::new(stream);
    let mut w = BufWriter::new(stream);
    let hello = Hello::read_checked(&mut r, secret)
        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
    if hello.role != Role::StoreClient {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rank {} connected to the store as a peer", hello.rank),
        ));
    }
    w.write_all(&[wire::STATUS_OK])?;
    w.flush()?;
    stream.set_read_timeout(None)?;
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
                let deadline = Instant::now() + wait;
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
}

impl StoreClient {
    /// Connects to `addr`, retrying until `deadline` while the server is not up yet.
    pub(crate) fn connect(
        addr: &str,
        rank: usize,
        world: usize,
        secret: &[u8],
        deadline: Instant,
    ) -> Result<Self> {
        let fail = |reason: String, source: Option<io::Error>| Error::Rendezvous {
            rank,
            addr: addr.to_string(),
            reason,
            source,
        };
        let mut last_log = Instant::now();
        let stream = loop {
            let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => return Err(fail("cannot resolve the address".into(), Some(e))),
            };
            let mut last_err = None;
            let mut connected = None;
            for a in &resolved {
                match TcpStream::connect_timeout(a, Duration::from_secs(2)) {
                    Ok(s) => {
                        connected = Some(s);
                        break;
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            if let Some(s) = connected {
                break s;
            }
            if Instant::now() >= deadline {
                return Err(fail(
                    "rank 0's rendezvous store did not come up in time (is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?)".into(),
                    last_err,
                ));
            }
            if last_log.elapsed() > Duration::from_secs(30) {
                log::info!("rank {rank}: still waiting for the rendezvous store at {addr}");
                last_log = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let io = |e: io::Error| fail("handshake failed".into(), Some(e));
        stream.set_nodelay(true).map_err(io)?;
        let hello = Hello {
            role: Role::StoreClient,
            rank: rank as u32,
            world: world as u32,
            secret: secret.to_vec(),
        };
        (&stream).write_all(&hello.encode()).map_err(io)?;
        stream
            .set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_secs(1)),
            ))
            .map_err(io)?;
        let mut status = [0u8; 1];
        (&stream).read_exact(&mut status).map_err(|e| {
            fail(
                "the store closed the connection during the handshake (different ACCELERATE_RS_SECRET or accelerate-rs version than rank 0?)".into(),
                Some(e),
            )
        })?;
        stream.set_read_timeout(None).map_err(io)?;
        Ok(StoreClient {
            stream,
            rank,
            addr: addr.to_string(),
        })
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
                    "key `{key}` did not appear within {wait:?} (did every rank start?)"
                ),
                source: None,
            }),
            Err(e) => Err(self.err(&format!("store get `{key}` failed"), e)),
        }
    }
}
