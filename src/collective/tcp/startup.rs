//! Forming a TCP group, step by step: check the options, host the rendezvous store (rank 0),
//! meet the peers through it and connect the ring (each connection opening with a handshake that
//! carries the run's secret).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::ring::Ring;
use super::store::{StoreClient, StoreServer};
use super::wire::{self, Hello, Role};
use crate::error::{Error, Result};
use crate::settings::{env, Transport};

/// Where and how to form a TCP group.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Address of rank 0 (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`).
    pub master_port: u16,
    /// The run's secret (`ACCELERATE_RS_SECRET`); empty means unauthenticated.
    pub secret: Vec<u8>,
    /// Timeout of every collective, and of forming the group.
    pub timeout: Duration,
    /// Data path for `all_reduce` and `broadcast`; `None` reads `ACCELERATE_RS_TRANSPORT`
    /// (default `auto`).
    pub transport: Option<Transport>,
}

/// The options checked (a rank in the world, a secret within the limit), and the data path they
/// ask for (never `mpi`, which is not the TCP collective's).
pub(super) fn check_options(opts: &TcpOptions) -> Result<Transport> {
    let (rank, world) = (opts.rank, opts.world_size);
    if world == 0 || rank >= world {
        return Err(Error::invalid(
            "rank",
            format!("rank {rank} is not in a world of size {world}"),
        ));
    }
    if opts.secret.len() > wire::MAX_SECRET {
        return Err(Error::invalid(
            "secret",
            format!(
                "{} bytes is over the {}-byte limit",
                opts.secret.len(),
                wire::MAX_SECRET
            ),
        ));
    }
    let mode = match opts.transport {
        Some(t) => t,
        None => Transport::from_env()?,
    };
    if mode == Transport::Mpi {
        return Err(Error::invalid(
            "transport",
            "`mpi` is not a data path of the TCP collective: use `MpiCollective` (the \
             accelerator does so by itself when the transport is `mpi`)",
        ));
    }
    Ok(mode)
}

/// Rank 0's rendezvous store on `master` (the socket `accelerate-rs launch` handed over, or one
/// bound here).
pub(super) fn host_store(opts: &TcpOptions, master: &str) -> Result<StoreServer> {
    let rank = opts.rank;
    let resolved = master
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Error::Rendezvous {
            rank,
            addr: master.to_string(),
            reason: "MASTER_ADDR does not resolve to an address".into(),
            source: None,
        })?;
    let bind = bind_addr_for(resolved);
    let listener = match inherited_listener(opts.master_port) {
        Some(l) => Ok(l),
        None => TcpListener::bind(bind),
    };
    listener.and_then(|l| StoreServer::start(l, opts.secret.clone(), rank)).map_err(|e| {
        let reason = if e.kind() == io::ErrorKind::AddrInUse {
            format!("port {} is already in use on this machine (another run?); choose another MASTER_PORT, or let `accelerate-rs launch` pick a free one", opts.master_port)
        } else {
            format!("cannot host the rendezvous store on {bind}")
        };
        Error::Rendezvous {
            rank,
            addr: master.to_string(),
            reason,
            source: Some(e),
        }
    })
}

/// Meets the peers through the store at `master` and connects the ring: publishes this rank's
/// listening address, connects to the next rank (handshake, then its acknowledgement) and
/// accepts the previous one.
pub(super) fn form_ring(opts: &TcpOptions, master: &str, deadline: Instant) -> Result<Ring> {
    let (rank, world) = (opts.rank, opts.world_size);
    let mut client =
        StoreClient::connect(master, rank, world, &opts.secret, opts.timeout, deadline)?;
    let local_ip = client.local_addr()?.ip();
    let listener = TcpListener::bind((local_ip, 0)).map_err(|e| Error::Rendezvous {
        rank,
        addr: format!("{local_ip}:0"),
        reason: "cannot listen for peer connections".into(),
        source: Some(e),
    })?;
    let my_addr = listener
        .local_addr()
        .map_err(|e| Error::Rendezvous {
            rank,
            addr: format!("{local_ip}:0"),
            reason: "cannot read the listener's address".into(),
            source: Some(e),
        })?
        .to_string();
    client.set(&format!("peer/{rank}"), my_addr.as_bytes())?;
    let (next_rank, prev_rank) = ((rank + 1) % world, (rank + world - 1) % world);
    let next_addr = client.get(&format!("peer/{next_rank}"), deadline)?;
    let next_addr = String::from_utf8_lossy(&next_addr).into_owned();
    let hello = Hello {
        role: Role::Peer,
        rank: rank as u32,
        world: world as u32,
        secret: opts.secret.clone(),
    };
    let mut next = connect_peer(&next_addr, rank, next_rank, deadline, opts.timeout)?;
    next.write_all(&hello.encode())
        .map_err(|e| peer_setup_err(rank, &next_addr, "sending the handshake failed", e))?;
    let prev = accept_peer(
        &listener,
        rank,
        prev_rank,
        world,
        &opts.secret,
        (deadline, opts.timeout),
    )?;
    drop(listener);
    // The next rank acknowledges our handshake once it has accepted it.
    next.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100)),
    ))
    .map_err(|e| peer_setup_err(rank, &next_addr, "socket setup failed", e))?;
    let mut ack = [0u8; 1];
    next.read_exact(&mut ack).map_err(|e| {
        peer_setup_err(
            rank,
            &next_addr,
            &format!("rank {next_rank} did not accept our handshake (different ACCELERATE_RS_SECRET, WORLD_SIZE or accelerate-rs version?)"),
            e,
        )
    })?;
    let ring = Ring::new(rank, world, opts.timeout, next, prev)
        .map_err(|e| peer_setup_err(rank, &next_addr, "socket setup failed", e))?;
    log::debug!("rank {rank}: ring formed (next {next_addr})");
    Ok(ring)
}

fn bind_addr_for(master: SocketAddr) -> SocketAddr {
    // Bind exactly the loopback address when the run is local; otherwise listen on every
    // interface, since MASTER_ADDR may name this machine by an address it cannot bind directly.
    if master.ip().is_loopback() {
        master
    } else {
        let any = match master.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        SocketAddr::new(any, master.port())
    }
}

/// The store's listening socket `accelerate-rs launch` bound to `port` and handed to this process
/// ([`env::STORE_FD`]), taken at most once per process. `None` (after a warning if the variable
/// names something else) when there is none.
fn inherited_listener(port: u16) -> Option<TcpListener> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let fd = crate::settings::runtime::store_fd()?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        return None;
    }
    // SAFETY: the launcher passed this descriptor to this process for exactly this use, and the
    // flag above makes sure it is owned once. If it is not a socket bound to `port`, ownership is
    // given back (`into_raw_fd`) without closing it.
    let listener = unsafe { TcpListener::from_raw_fd(fd) };
    match listener.local_addr() {
        Ok(a) if a.port() == port => {
            // Not for this process's own children.
            // SAFETY: the descriptor is open (owned by `listener`) and F_SETFD only changes its
            // flags.
            if unsafe {
                libc::fcntl(
                    std::os::fd::AsRawFd::as_raw_fd(&listener),
                    libc::F_SETFD,
                    libc::FD_CLOEXEC,
                )
            } < 0
            {
                log::debug!(
                    "cannot set close-on-exec on the inherited store socket: {}",
                    std::io::Error::last_os_error()
                );
            }
            Some(listener)
        }
        other => {
            let _ = listener.into_raw_fd();
            log::warn!(
                "{}={fd} is not the store's socket on port {port} ({other:?}); binding the port instead",
                env::STORE_FD
            );
            None
        }
    }
}

fn peer_setup_err(rank: usize, addr: &str, reason: &str, e: io::Error) -> Error {
    Error::Rendezvous {
        rank,
        addr: addr.to_string(),
        reason: reason.to_string(),
        source: Some(e),
    }
}

/// Connects to rank `peer` at `addr`, retrying until `deadline` (`timeout` after start-up began;
/// running out of it is an [`Error::Timeout`], which [`TcpCollective::connect`] calls too short
/// when it is).
fn connect_peer(
    addr: &str,
    rank: usize,
    peer: usize,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream> {
    let sock: SocketAddr = addr.parse().map_err(|_| Error::Rendezvous {
        rank,
        addr: addr.to_string(),
        reason: format!("rank {peer} published an invalid address"),
        source: None,
    })?;
    loop {
        match TcpStream::connect_timeout(&sock, Duration::from_secs(2)) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| peer_setup_err(rank, addr, "socket setup failed", e))?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::Timeout {
                    rank,
                    peer,
                    op: format!("connecting to rank {peer} at {addr} (last error: {e})"),
                    timeout,
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Accepts connections until the previous rank's valid handshake arrives; anything else is logged
/// and dropped.
fn accept_peer(
    listener: &TcpListener,
    rank: usize,
    prev: usize,
    world: usize,
    secret: &[u8],
    (deadline, timeout): (Instant, Duration),
) -> Result<TcpStream> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    listener
        .set_nonblocking(true)
        .map_err(|e| peer_setup_err(rank, &addr, "socket setup failed", e))?;
    loop {
        match listener.accept() {
            Ok((mut s, from)) => {
                if let Err(e) = s.set_nonblocking(false) {
                    log::warn!("rank {rank}: dropped connection from {from}: {e}");
                    continue;
                }
                // One deadline for the whole handshake: a sender trickling bytes cannot hold
                // the (sequential) accept loop.
                let until = Instant::now() + Duration::from_secs(10);
                match Hello::read_checked(&mut wire::DeadlineReader::new(&s, until), secret) {
                    Ok(h) if h.role == Role::Peer && h.rank as usize == prev && h.world as usize == world => {
                        s.write_all(&[0]).map_err(|e| {
                            peer_setup_err(rank, &from.to_string(), "acknowledging the handshake failed", e)
                        })?;
                        return Ok(s);
                    }
                    Ok(h) => wire::warn_rejected(format_args!(
                        "rank {rank}: rejected connection from {from}: it says it is rank {} of {} ({:?}); expected rank {prev} of {world}",
                        h.rank, h.world, h.role
                    )),
                    Err(reason) => {
                        wire::warn_rejected(format_args!("rank {rank}: rejected connection from {from}: {reason}"))
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        rank,
                        peer: prev,
                        op: format!("accepting rank {prev}'s connection on {addr}"),
                        timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => log::warn!("rank {rank}: accept failed: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Running out of start-up time while meeting the peers is a timeout (which `connect` calls
    /// too short for a tiny collective timeout), not an unexplained "never connected": on a busy
    /// machine the store can answer within a microsecond and the peers not.
    #[test]
    fn meeting_the_peers_past_the_deadline_is_a_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tiny = Duration::from_micros(1);
        let past = Instant::now();
        let e = accept_peer(&listener, 1, 0, 2, b"s", (past, tiny)).unwrap_err();
        assert!(
            matches!(&e, Error::Timeout { rank: 1, peer: 0, timeout, .. } if *timeout == tiny),
            "{e}"
        );
        drop(listener);
        let e = connect_peer(&addr, 0, 1, past, tiny).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Timeout {
                    rank: 0,
                    peer: 1,
                    ..
                }
            ),
            "{e}"
        );
    }
}
