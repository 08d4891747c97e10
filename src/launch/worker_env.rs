//! The environment every worker is started with (torchrun names plus accelerate-rs's own), the
//! per-run secret and the rendezvous port.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::config::MixedPrecision;
use crate::env;

/// Loopback address the rendezvous store listens on for a single-machine launch.
pub(crate) const LOOPBACK: &str = "127.0.0.1";
/// This machine's index among the machines of the run (torchrun's name).
pub(crate) const GROUP_RANK: &str = "GROUP_RANK";
/// This machine's index among the machines of the run (accelerate-rs's name).
pub(crate) const NODE_RANK: &str = "ACCELERATE_RS_NODE_RANK";
/// Number of machines of the run.
pub(crate) const NUM_NODES: &str = "ACCELERATE_RS_NUM_MACHINES";

/// Everything the environment of one attempt depends on.
pub(crate) struct EnvSpec {
    /// Processes on this machine.
    pub(crate) local_world_size: usize,
    /// Number of machines.
    pub(crate) num_machines: usize,
    /// This machine's index.
    pub(crate) machine_rank: usize,
    /// Address of the machine running rank 0.
    pub(crate) master_addr: String,
    /// Port of the rendezvous store.
    pub(crate) port: u16,
    /// The per-run secret.
    pub(crate) secret: String,
    /// Attempt number (0 on the first run).
    pub(crate) restart_count: usize,
    /// Force CPU.
    pub(crate) cpu: bool,
    /// Threads per worker.
    pub(crate) threads: usize,
    /// `CUDA_VISIBLE_DEVICES` to set (`None`: leave the launcher's own value).
    pub(crate) gpu_ids: Option<String>,
    /// Mixed precision mode to export.
    pub(crate) mixed_precision: Option<MixedPrecision>,
    /// Gradient accumulation steps to export.
    pub(crate) gradient_accumulation_steps: Option<usize>,
    /// Collective timeout to export, in seconds.
    pub(crate) timeout_secs: Option<f64>,
    /// Gradient bucket cap to export, in MiB.
    pub(crate) bucket_cap_mb: Option<f64>,
}

/// Variables shared by every rank of one launch.
pub(crate) struct CommonEnv {
    vars: Vec<(&'static str, String)>,
    local_world_size: usize,
    machine_rank: usize,
}

impl CommonEnv {
    /// Builds the shared variables. `already_set` tells whether the launcher's own environment
    /// holds a variable (the thread-count variables are then inherited unchanged).
    pub(crate) fn new(spec: &EnvSpec, already_set: impl Fn(&str) -> bool) -> Self {
        let world_size = spec.local_world_size * spec.num_machines;
        let mut vars = vec![
            (env::WORLD_SIZE, world_size.to_string()),
            (env::LOCAL_WORLD_SIZE, spec.local_world_size.to_string()),
            (env::MASTER_ADDR, spec.master_addr.clone()),
            (env::MASTER_PORT, spec.port.to_string()),
            (env::SECRET, spec.secret.clone()),
            (env::RESTART_COUNT, spec.restart_count.to_string()),
            (GROUP_RANK, spec.machine_rank.to_string()),
            (NODE_RANK, spec.machine_rank.to_string()),
            (NUM_NODES, spec.num_machines.to_string()),
        ];
        if spec.cpu {
            vars.push((env::USE_CPU, "1".to_string()));
        }
        if let Some(ids) = &spec.gpu_ids {
            vars.push((env::CUDA_VISIBLE_DEVICES, ids.clone()));
        }
        if let Some(mp) = spec.mixed_precision {
            vars.push((env::MIXED_PRECISION, mp.as_str().to_string()));
        }
        if let Some(n) = spec.gradient_accumulation_steps {
            vars.push((env::GRADIENT_ACCUMULATION_STEPS, n.to_string()));
        }
        if let Some(t) = spec.timeout_secs {
            vars.push((env::TIMEOUT_SECS, t.to_string()));
        }
        if let Some(b) = spec.bucket_cap_mb {
            vars.push((env::BUCKET_CAP_MB, b.to_string()));
        }
        for var in [env::RAYON_NUM_THREADS, env::OMP_NUM_THREADS] {
            if !already_set(var) {
                vars.push((var, spec.threads.to_string()));
            }
        }
        CommonEnv {
            vars,
            local_world_size: spec.local_world_size,
            machine_rank: spec.machine_rank,
        }
    }

    /// The global rank of local rank `local_rank` on this machine.
    pub(crate) fn global_rank(&self, local_rank: usize) -> usize {
        self.machine_rank * self.local_world_size + local_rank
    }

    /// The full set of variables for one local rank (RANK and LOCAL_RANK first, then the
    /// shared ones).
    pub(crate) fn for_rank(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        let mut vars = vec![
            (env::RANK, self.global_rank(local_rank).to_string()),
            (env::LOCAL_RANK, local_rank.to_string()),
        ];
        vars.extend(self.vars.iter().cloned());
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

    fn spec() -> EnvSpec {
        EnvSpec {
            local_world_size: 2,
            num_machines: 1,
            machine_rank: 0,
            master_addr: LOOPBACK.into(),
            port: 1234,
            secret: "s".into(),
            restart_count: 0,
            cpu: true,
            threads: 3,
            gpu_ids: None,
            mixed_precision: None,
            gradient_accumulation_steps: None,
            timeout_secs: None,
            bucket_cap_mb: None,
        }
    }

    #[test]
    fn secret_is_64_hex_and_fresh() {
        let a = new_secret();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_secret());
    }

    #[test]
    fn thread_vars_respect_the_launcher_environment() {
        let e = CommonEnv::new(&spec(), |v| v == env::OMP_NUM_THREADS);
        let vars = e.for_rank(1);
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(env::RAYON_NUM_THREADS).as_deref(), Some("3"));
        assert_eq!(get(env::OMP_NUM_THREADS), None);
        assert_eq!(get(env::USE_CPU).as_deref(), Some("1"));
        assert_eq!(get(env::RANK).as_deref(), Some("1"));
        assert_eq!(get(env::MASTER_PORT).as_deref(), Some("1234"));
        assert_eq!(get(env::MIXED_PRECISION), None);
        assert_eq!(get(env::CUDA_VISIBLE_DEVICES), None);
    }

    #[test]
    fn multi_machine_ranks_are_offset_by_the_machine_rank() {
        let e = CommonEnv::new(
            &EnvSpec {
                num_machines: 3,
                machine_rank: 2,
                mixed_precision: Some(MixedPrecision::Bf16),
                gpu_ids: Some("0,1".into()),
                ..spec()
            },
            |_| false,
        );
        let vars = e.for_rank(1);
        let get = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        assert_eq!(get(env::RANK).as_deref(), Some("5"));
        assert_eq!(get(env::LOCAL_RANK).as_deref(), Some("1"));
        assert_eq!(get(env::WORLD_SIZE).as_deref(), Some("6"));
        assert_eq!(get(env::LOCAL_WORLD_SIZE).as_deref(), Some("2"));
        assert_eq!(get(NODE_RANK).as_deref(), Some("2"));
        assert_eq!(get(env::MIXED_PRECISION).as_deref(), Some("bf16"));
        assert_eq!(get(env::CUDA_VISIBLE_DEVICES).as_deref(), Some("0,1"));
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
