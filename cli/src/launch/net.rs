//! The launcher's own helpers around the environment contract ([`accelerate_rs::env::CommonEnv`]):
//! the per-run secret, the rendezvous port, threads per worker, shell quoting for `--dry-run`.

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;

use accelerate_rs::{Error, Result};

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

/// A currently free loopback port: bind port 0, read what the OS chose, release it.
pub(crate) fn free_port() -> Result<u16> {
    let io_err = |source| Error::Io {
        context: "launch: could not find a free port for the rendezvous store at".to_string(),
        path: PathBuf::from(format!("{LOOPBACK}:0")),
        source,
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io_err)?;
    let port = listener.local_addr().map_err(io_err)?.port();
    Ok(port)
}

/// Whether `port` can be bound right now on every interface (so on loopback too). A port some
/// process listens on, on any address, cannot.
pub(crate) fn port_is_free(port: u16) -> bool {
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok()
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
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(!port_is_free(port));
        drop(l);
    }
}
