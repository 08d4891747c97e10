//! The environment every worker is started with (torchrun names plus accelerate-rs's own).

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;

use crate::env;
use crate::error::{Error, Result};

/// Loopback address the rendezvous store listens on for a single-machine launch.
pub(crate) const LOOPBACK: &str = "127.0.0.1";

/// Variables shared by every rank of one launch.
pub(crate) struct CommonEnv {
    vars: Vec<(&'static str, String)>,
}

impl CommonEnv {
    /// Builds the shared variables. `already_set` tells whether the launcher's own environment
    /// holds a variable (the thread-count variables are then inherited unchanged).
    pub(crate) fn new(
        world_size: usize,
        port: u16,
        cpu: bool,
        secret: String,
        threads: usize,
        already_set: impl Fn(&str) -> bool,
    ) -> Self {
        let mut vars = vec![
            (env::WORLD_SIZE, world_size.to_string()),
            (env::LOCAL_WORLD_SIZE, world_size.to_string()),
            (env::MASTER_ADDR, LOOPBACK.to_string()),
            (env::MASTER_PORT, port.to_string()),
            (env::SECRET, secret),
            (env::RESTART_COUNT, "0".to_string()),
        ];
        if cpu {
            vars.push((env::USE_CPU, "1".to_string()));
        }
        for var in [env::RAYON_NUM_THREADS, env::OMP_NUM_THREADS] {
            if !already_set(var) {
                vars.push((var, threads.to_string()));
            }
        }
        CommonEnv { vars }
    }

    /// The full set of variables for one rank (shared ones plus RANK and LOCAL_RANK).
    pub(crate) fn for_rank(&self, rank: usize) -> Vec<(&'static str, String)> {
        let mut vars = self.vars.clone();
        vars.push((env::RANK, rank.to_string()));
        vars.push((env::LOCAL_RANK, rank.to_string()));
        vars
    }
}

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
    fn thread_vars_respect_the_launcher_environment() {
        let e = CommonEnv::new(2, 1234, true, "s".into(), 3, |v| v == env::OMP_NUM_THREADS);
        let vars = e.for_rank(1);
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(env::RAYON_NUM_THREADS).as_deref(), Some("3"));
        assert_eq!(get(env::OMP_NUM_THREADS), None);
        assert_eq!(get(env::USE_CPU).as_deref(), Some("1"));
        assert_eq!(get(env::RANK).as_deref(), Some("1"));
        assert_eq!(get(env::MASTER_PORT).as_deref(), Some("1234"));
    }

    #[test]
    fn threads_are_at_least_one() {
        assert_eq!(threads_per_worker(usize::MAX), 1);
        assert!(threads_per_worker(1) >= 1);
    }
}
