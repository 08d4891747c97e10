//! [`LaunchOptions`]: what to launch and how, with its defaults.

use std::path::PathBuf;
use std::time::Duration;

use accelerate_rs::limits;
use accelerate_rs::{ConfigFile, MixedPrecision};

/// Default delay between SIGTERM and SIGKILL when stopping workers.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(3);
/// Most worker processes per machine (`--num-processes`).
pub const MAX_PROCESSES: usize = limits::MAX_PROCESSES;
/// Default interval at which the launcher checks for signals.
pub const DEFAULT_MONITOR_INTERVAL: Duration = Duration::from_millis(100);

/// What to launch and how. Build it with `..LaunchOptions::default()` or from a config file with
/// [`LaunchOptions::from_config`].
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchOptions {
    /// Number of worker processes on this machine (1 to [`MAX_PROCESSES`]).
    pub num_processes: usize,
    /// Force the workers onto the CPU (sets `ACCELERATE_RS_USE_CPU=1`).
    pub cpu: bool,
    /// Number of machines of the run (at least 1).
    pub num_machines: usize,
    /// This machine's index, below [`num_machines`](LaunchOptions::num_machines).
    pub machine_rank: usize,
    /// Address of machine rank 0 (`MASTER_ADDR`); required with several machines.
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous store; `None` or `Some(0)` picks a free port (single machine only).
    pub main_process_port: Option<u16>,
    /// GPUs made visible (`CUDA_VISIBLE_DEVICES`): `all` (or `None`) leaves it unset, else a
    /// comma-separated list of indices such as `0,1`.
    pub gpu_ids: Option<String>,
    /// Mixed precision mode exported as `ACCELERATE_RS_MIXED_PRECISION`.
    pub mixed_precision: Option<MixedPrecision>,
    /// Exported as `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`.
    pub gradient_accumulation_steps: Option<usize>,
    /// Collective timeout exported as `ACCELERATE_RS_TIMEOUT_SECS`.
    pub collective_timeout: Option<Duration>,
    /// Gradient bucket cap in MiB exported as `ACCELERATE_RS_BUCKET_CAP_MB`.
    pub bucket_cap_mb: Option<f64>,
    /// ZeRO stage (0 to 3) exported as `ACCELERATE_RS_ZERO_STAGE`.
    pub zero_stage: Option<usize>,
    /// ZeRO-3 offload exported as `ACCELERATE_RS_OFFLOAD_OPTIMIZER`.
    pub offload_optimizer: Option<bool>,
    /// How many times the whole group is restarted after a failure.
    pub max_restarts: usize,
    /// How often the monitor checks for signals (worker exits are seen at once).
    pub monitor_interval: Duration,
    /// The program every worker runs.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    pub grace_period: Duration,
    /// Also write each rank's output to log files (see [`log_dir`](LaunchOptions::log_dir)).
    pub tee: bool,
    /// Directory of the per-rank log files; setting it implies [`tee`](LaunchOptions::tee).
    pub log_dir: Option<PathBuf>,
    /// Print only errors from the launcher itself (worker output is still forwarded).
    pub quiet: bool,
    /// Print what would be started and start nothing.
    pub dry_run: bool,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            num_processes: 1,
            cpu: false,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: None,
            main_process_port: None,
            gpu_ids: None,
            mixed_precision: None,
            gradient_accumulation_steps: None,
            collective_timeout: None,
            bucket_cap_mb: None,
            zero_stage: None,
            offload_optimizer: None,
            max_restarts: 0,
            monitor_interval: DEFAULT_MONITOR_INTERVAL,
            program: String::new(),
            args: Vec::new(),
            grace_period: DEFAULT_GRACE_PERIOD,
            tee: false,
            log_dir: None,
            quiet: false,
            dry_run: false,
        }
    }
}

impl LaunchOptions {
    /// The defaults with every value `cfg` holds applied (the config file layer of
    /// flag > config file > default; the caller then applies the flags).
    pub fn from_config(cfg: &ConfigFile) -> Self {
        let d = LaunchOptions::default();
        LaunchOptions {
            num_processes: cfg.num_processes.unwrap_or(d.num_processes),
            cpu: cfg.use_cpu.unwrap_or(d.cpu),
            num_machines: cfg.num_machines.unwrap_or(d.num_machines),
            machine_rank: cfg.machine_rank.unwrap_or(d.machine_rank),
            main_process_ip: cfg.main_process_ip.clone(),
            main_process_port: cfg.main_process_port,
            gpu_ids: cfg.gpu_ids.clone(),
            mixed_precision: cfg.mixed_precision,
            gradient_accumulation_steps: cfg.gradient_accumulation_steps,
            collective_timeout: cfg
                .collective_timeout_secs
                .and_then(|s| Duration::try_from_secs_f64(s).ok()),
            bucket_cap_mb: cfg.bucket_cap_mb,
            zero_stage: cfg.zero_stage,
            offload_optimizer: cfg.offload_optimizer,
            max_restarts: cfg.max_restarts.unwrap_or(d.max_restarts),
            monitor_interval: cfg
                .monitor_interval_secs
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .unwrap_or(d.monitor_interval),
            ..d
        }
    }
}

/// Prints a launcher notice or warning to stderr unless quiet.
pub(super) fn notice(opts: &LaunchOptions, msg: &str) {
    if !opts.quiet {
        eprintln!("accelerate-rs: {msg}");
    }
}
