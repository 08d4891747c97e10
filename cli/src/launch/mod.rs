//! `accelerate-rs launch`: start N worker processes on this machine (one machine of a
//! possibly multi-machine run) with the torchrun environment, forward their output line by line
//! with a `[rank i]` prefix, stop the whole group as soon as one worker fails or the launcher is
//! interrupted, and optionally restart the group.
//!
//! # Environment of the workers
//!
//! Local worker `i` on machine `r` of `M` machines with `N` processes each gets `RANK = r × N + i`,
//! `WORLD_SIZE = M × N`, `LOCAL_RANK = i`, `LOCAL_WORLD_SIZE = N`, `GROUP_RANK` and
//! `ACCELERATE_RS_NODE_RANK` = `r`, `ACCELERATE_RS_NUM_MACHINES = M`, `MASTER_ADDR` (the
//! `main_process_ip`, `127.0.0.1` on a single machine without one), `MASTER_PORT`,
//! `ACCELERATE_RS_SECRET`, `ACCELERATE_RS_RESTART_COUNT` (the attempt, 0 first),
//! `ACCELERATE_RS_USE_CPU=1` with [`LaunchOptions::cpu`], `CUDA_VISIBLE_DEVICES` from
//! [`LaunchOptions::gpu_ids`] (unless `all`), `ACCELERATE_RS_MIXED_PRECISION`,
//! `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`, `ACCELERATE_RS_TIMEOUT_SECS` and
//! `ACCELERATE_RS_BUCKET_CAP_MB` when set, and `RAYON_NUM_THREADS` / `OMP_NUM_THREADS` = the
//! machine's cores divided by N (at least 1) unless the launcher's own environment sets them.
//!
//! # Secret and port
//!
//! On a single machine the secret is the launcher's own `ACCELERATE_RS_SECRET` if exported,
//! else a fresh random one per launch. With several machines it must be the same everywhere,
//! so it is taken from `ACCELERATE_RS_SECRET` and the launch fails if that is unset.
//!
//! On a single machine, no port (or port 0) means a free port is picked for every attempt; a
//! port that is given but busy (something listens on it) is replaced by a free one, with a
//! warning. With several machines the port must be given, and machine rank 0, which hosts the
//! rendezvous store, fails with an error naming the port if it is busy. The machine that hosts
//! rank 0 binds the store's socket itself and hands it to rank 0 (inherited, named by
//! `ACCELERATE_RS_STORE_FD`), so checking the port and taking it are one step: two launches given
//! the same port cannot both get it.
//!
//! # Configuration
//!
//! [`LaunchOptions::from_config`] turns a [`ConfigFile`](accelerate_rs::ConfigFile) into options; the command line then
//! overrides every value given as a flag (flag > config file > default).
//!
//! # Failures and restarts
//!
//! Each worker has a waiter thread blocked in `wait()` that reports its exit with the instant it
//! was seen, so the rank that failed *first* is blamed even when the others fail milliseconds
//! later because their collectives broke. The launcher then stops the others (SIGTERM to each
//! process group, SIGKILL after [`LaunchOptions::grace_period`]), prints the failed rank, its
//! status and its last 20 lines of output, and with [`LaunchOptions::max_restarts`] `K` starts
//! the whole group again, up to `K` times. Ctrl-C (SIGINT), SIGTERM or SIGHUP (a closed
//! terminal, a dropped ssh session) stops the workers and is never followed by a restart; a
//! second signal SIGKILLs them at once. On Linux every worker also gets SIGKILL if the launcher
//! dies without stopping them (SIGKILL, the OOM killer): the parent-death signal is set in the
//! worker before `exec`, and a worker whose launcher died before that exits at once. A restart gets a fresh
//! free port on a single machine unless a port was given. With several machines each launcher
//! restarts its own group: a failure on one machine breaks the collectives of the others, so
//! every launcher restarts (each counting its own restarts) and the groups meet again at the
//! same port. [`LaunchOptions::monitor_interval`] is how often signals are checked; exits are
//! seen as they happen.
//!
//! # Output
//!
//! Worker lines are printed whole, prefixed with `[rank i]` (global rank). With
//! [`LaunchOptions::tee`] or a [`LaunchOptions::log_dir`] each rank's lines are also written,
//! unprefixed, to `<dir>/rank_<i>.stdout.log` and `<dir>/rank_<i>.stderr.log` (truncated at the
//! start of the launch, appended to by restarts); `--tee` alone uses
//! `./accelerate-rs-logs/<unix time>-<pid>`. [`LaunchOptions::quiet`] silences the launcher's own
//! notices and warnings (not errors, not worker output). [`LaunchOptions::dry_run`] prints every
//! worker's command line and environment additions (the secret as `<redacted>`) and starts
//! nothing.

mod blame;
mod net;
mod options;
mod output;
mod plan;
mod run;
mod signals;
mod supervise;
mod workers;

pub use options::{LaunchOptions, DEFAULT_GRACE_PERIOD, DEFAULT_MONITOR_INTERVAL, MAX_PROCESSES};
pub use run::launch;
