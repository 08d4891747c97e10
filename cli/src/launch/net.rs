//! The launcher's own helpers around the environment contract ([`accelerate_rs::env::CommonEnv`]):
//! the per-run secret, the rendezvous port, threads per worker, shell quoting for `--dry-run`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};

/// Loopback address the rendezvous store listens on for a single-machine launch.
pub(crate) const LOOPBACK: &str = "127.0.0.1";

/// Threads per worker: the machine's parallelism split evenly, at least one.
pub(crate) fn threads_per_worker(num_processes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / num_processes.max(1)).max(1)
}

/// A fresh per-launch secret: 32 random bytes from rand's OS-seeded generator, as 64 hex digits.
pub(crate) fn new_secret() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Binds the rendezvous store's listening socket for `master_addr:port` (port 0: a free port)
/// on the address rank 0 would bind: the loopback address itself for a local run, every
/// interface otherwise (the rule `TcpCollective` follows). The launcher keeps it and hands it to
/// rank 0, so that nothing can take the port between the check and rank 0's start.
pub(crate) fn bind_store(master_addr: &str, port: u16) -> std::io::Result<TcpListener> {
    let master = (master_addr, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{master_addr} resolves to no address")))?;
    let bind = if master.ip().is_loopback() {
        master
    } else if master.is_ipv4() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
    } else {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port)
    };
    TcpListener::bind(bind)
}

/// `s` quoted for a POSIX shell when it needs to be (for `--dry-run`).
pub(crate) fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_is_64_hex_and_fresh() {
        let a = new_secret();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_secret());
    }

    #[test]
    fn threads_are_at_least_one() {
        assert_eq!(threads_per_worker(usize::MAX), 1);
        assert!(threads_per_worker(1) >= 1);
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("abc-1"), "abc-1");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn a_listened_port_is_busy() {
        let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(bind_store(LOOPBACK, port).is_err());
        drop(l);
        let free = bind_store(LOOPBACK, 0).unwrap();
        assert!(free.local_addr().unwrap().ip().is_loopback());
    }
}
