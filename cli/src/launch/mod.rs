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
//! [`LaunchOptions::from_config`] turns a [`ConfigFile`] into options; the command line then
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
mod output;
mod signals;
mod supervise;
mod workers;

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;
use std::time::Duration;

use accelerate_rs::env::{CommonEnv, EnvSpec};
use accelerate_rs::limits;
use accelerate_rs::{env, ConfigFile, Error, MixedPrecision, Result};
use supervise::Outcome;

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
fn notice(opts: &LaunchOptions, msg: &str) {
    if !opts.quiet {
        eprintln!("accelerate-rs: {msg}");
    }
}

/// How many GPUs the workers can use, for the no-GPU notice: this build's count when it has CUDA,
/// else the NVIDIA driver's (`/proc/driver/nvidia/gpus`; a launcher built without CUDA may start
/// workers built with it), none when `CUDA_VISIBLE_DEVICES` hides them all. `None` when this
/// cannot be told (not Linux).
fn gpus_for_workers() -> Option<usize> {
    let hidden = std::env::var(env::CUDA_VISIBLE_DEVICES)
        .is_ok_and(|v| v.trim().is_empty() || v.trim() == "-1");
    if hidden {
        return Some(0);
    }
    if accelerate_rs::config::cuda_built() {
        return Some(accelerate_rs::config::gpus_seen());
    }
    if !cfg!(target_os = "linux") {
        return None;
    }
    Some(
        std::fs::read_dir("/proc/driver/nvidia/gpus")
            .map(|d| d.count())
            .unwrap_or(0),
    )
}

/// The notice of a launch without `--cpu` on a machine without GPUs: the workers then run on
/// the CPU, which the user may not expect.
fn no_gpu_notice(opts: &LaunchOptions) -> Option<String> {
    if opts.cpu || opts.gpu_ids.is_some() || gpus_for_workers() != Some(0) {
        return None;
    }
    Some(format!(
        "no GPU found on this machine{}: the {} worker(s) will run on the CPU; pass --cpu to say so (and silence this notice)",
        std::env::var(env::CUDA_VISIBLE_DEVICES)
            .map(|v| format!(" ({}={v})", env::CUDA_VISIBLE_DEVICES))
            .unwrap_or_default(),
        opts.num_processes
    ))
}

/// The validated, fixed parts of a launch.
struct Plan {
    master_addr: String,
    secret: String,
    gpu_ids: Option<String>,
    log_dir: Option<PathBuf>,
}

fn plan(opts: &LaunchOptions) -> Result<Plan> {
    if opts.num_processes == 0 {
        return Err(Error::invalid(
            "--num-processes",
            "must be at least 1, got 0",
        ));
    }
    if opts.num_processes > MAX_PROCESSES {
        return Err(Error::invalid(
            "--num-processes",
            format!(
                "{} is more than the {MAX_PROCESSES} worker processes one machine can run \
                 (one per GPU, or a few per CPU socket, is typical)",
                opts.num_processes
            ),
        ));
    }
    if opts.num_machines == 0 || opts.num_machines > limits::MAX_MACHINES {
        return Err(Error::invalid(
            "--num-machines",
            format!(
                "must be from 1 to {}, got {}",
                limits::MAX_MACHINES,
                opts.num_machines
            ),
        ));
    }
    if opts.max_restarts > limits::MAX_RESTARTS {
        return Err(Error::invalid(
            "--max-restarts",
            format!(
                "must be from 0 to {}, got {}",
                limits::MAX_RESTARTS,
                opts.max_restarts
            ),
        ));
    }
    if opts.machine_rank >= opts.num_machines {
        return Err(Error::invalid(
            "--machine-rank",
            format!(
                "{} is not below --num-machines {}",
                opts.machine_rank, opts.num_machines
            ),
        ));
    }
    if opts.program.is_empty() {
        return Err(Error::invalid("PROGRAM", "no program to launch was given"));
    }
    if let Some(n) = opts.gradient_accumulation_steps {
        if n == 0 || n > limits::MAX_ACCUMULATION_STEPS {
            return Err(Error::invalid(
                "--gradient-accumulation-steps",
                format!(
                    "must be from 1 to {}, got {n}",
                    limits::MAX_ACCUMULATION_STEPS
                ),
            ));
        }
    }
    if opts.collective_timeout.is_some_and(|t| t.is_zero()) {
        return Err(Error::invalid(
            "--collective-timeout-secs",
            "must be longer than zero",
        ));
    }
    let multi = opts.num_machines > 1;
    let ip = opts
        .main_process_ip
        .as_deref()
        .map(str::trim)
        .filter(|ip| !ip.is_empty());
    let master_addr = match ip {
        Some(ip) => ip.to_string(),
        None if multi => {
            return Err(Error::invalid(
                "--main-process-ip",
                format!(
                    "required with --num-machines {}: the address of machine rank 0, the same on \
                     every machine",
                    opts.num_machines
                ),
            ))
        }
        None => net::LOOPBACK.to_string(),
    };
    if multi && opts.main_process_port.unwrap_or(0) == 0 {
        return Err(Error::invalid(
            "--main-process-port",
            format!(
                "required with --num-machines {}: every machine must use the same rendezvous port \
                 (give it as --main-process-port or main_process_port in the config file)",
                opts.num_machines
            ),
        ));
    }
    let own = std::env::var(env::SECRET).ok().filter(|s| !s.is_empty());
    let secret = match own {
        Some(s) => s,
        None if multi => {
            return Err(Error::invalid(
                env::SECRET,
                format!(
                    "not set; with --num-machines {} every machine must use the same secret: \
                     export the same ACCELERATE_RS_SECRET on every machine before launching \
                     (e.g. the output of `openssl rand -hex 32`)",
                    opts.num_machines
                ),
            ))
        }
        None => net::new_secret(),
    };
    let gpu_ids = match opts.gpu_ids.as_deref().map(str::trim) {
        None | Some("all") => None,
        Some(ids) => {
            let parsed: Option<Vec<usize>> =
                ids.split(',').map(|p| p.trim().parse().ok()).collect();
            match parsed {
                Some(list) if !list.is_empty() => Some(
                    list.iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                _ => {
                    return Err(Error::invalid(
                        "--gpu-ids",
                        format!(
                        "expected `all` or comma-separated GPU indices such as 0,1, got {ids:?}"
                    ),
                    ))
                }
            }
        }
    };
    let log_dir = match (&opts.log_dir, opts.tee) {
        (Some(dir), _) => Some(dir.clone()),
        (None, true) => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            Some(Path::new("accelerate-rs-logs").join(format!("{secs}-{}", std::process::id())))
        }
        (None, false) => None,
    };
    Ok(Plan {
        master_addr,
        secret,
        gpu_ids,
        log_dir,
    })
}

/// The port of one attempt (see the module documentation) and, on the machine that hosts rank
/// 0, the store's socket already bound to it (checking the port and taking it are one step: two
/// launches given the same port cannot both get it).
fn reserve_port(opts: &LaunchOptions, plan: &Plan) -> Result<(u16, Option<TcpListener>)> {
    let given = opts.main_process_port.filter(|p| *p != 0);
    let bind = |port: u16| net::bind_store(&plan.master_addr, port);
    let bound = |l: TcpListener| -> Result<(u16, Option<TcpListener>)> {
        let port = l.local_addr().map_err(|source| Error::Io {
            context: "launch: cannot read the port of the rendezvous socket bound on".to_string(),
            path: PathBuf::from(&plan.master_addr),
            source,
        })?;
        Ok((port.port(), Some(l)))
    };
    let free = || {
        bind(0).map_err(|source| Error::Io {
            context: "launch: could not find a free port for the rendezvous store at".to_string(),
            path: PathBuf::from(format!("{}:0", plan.master_addr)),
            source,
        })
    };
    match given {
        None => bound(free()?),
        Some(port) if opts.machine_rank != 0 => Ok((port, None)),
        Some(port) => match bind(port) {
            Ok(l) => bound(l),
            Err(e) if opts.num_machines == 1 => {
                let (free_port, l) = bound(free()?)?;
                notice(
                    opts,
                    &format!(
                        "warning: --main-process-port {port} is already in use on this machine \
                         ({e}); using free port {free_port} instead"
                    ),
                );
                Ok((free_port, l))
            }
            Err(e) => Err(Error::invalid(
                "--main-process-port",
                format!(
                    "port {port} cannot be bound on this machine ({e}), which is machine rank 0 \
                     and must host the rendezvous store on it: stop what uses port {port} or \
                     pick another port (the same on every machine)"
                ),
            )),
        },
    }
}

fn env_spec(opts: &LaunchOptions, plan: &Plan, port: u16, restart_count: usize) -> EnvSpec {
    EnvSpec {
        local_world_size: opts.num_processes,
        num_machines: opts.num_machines,
        machine_rank: opts.machine_rank,
        master_addr: plan.master_addr.clone(),
        port,
        secret: plan.secret.clone(),
        restart_count,
        cpu: opts.cpu,
        threads: net::threads_per_worker(opts.num_processes),
        gpu_ids: plan.gpu_ids.clone(),
        mixed_precision: opts.mixed_precision,
        gradient_accumulation_steps: opts.gradient_accumulation_steps,
        timeout_secs: opts.collective_timeout.map(|t| t.as_secs_f64()),
        bucket_cap_mb: opts.bucket_cap_mb,
        zero_stage: opts.zero_stage,
        offload_optimizer: opts.offload_optimizer,
    }
}

/// Prints what [`launch`] would start (for `--dry-run`).
fn print_dry_run(opts: &LaunchOptions, env: &CommonEnv, port: u16, master: &str) {
    let mut text = format!(
        "dry run: {} worker(s) on machine {} of {}, rendezvous at {master}:{port}; nothing is \
         started\n",
        opts.num_processes, opts.machine_rank, opts.num_machines
    );
    let command: Vec<String> = std::iter::once(&opts.program)
        .chain(&opts.args)
        .map(|a| net::shell_quote(a))
        .collect();
    for local in 0..opts.num_processes {
        text.push_str(&format!(
            "rank {} (local rank {local}):\n",
            env.global_rank(local)
        ));
        for (k, v) in env.for_rank(local) {
            let v = if k == env::SECRET {
                "<redacted>".to_string()
            } else {
                net::shell_quote(&v)
            };
            text.push_str(&format!("  {k}={v}\n"));
        }
        text.push_str(&format!("  command: {}\n", command.join(" ")));
    }
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// Runs `opts.num_processes` workers of `opts.program` to completion (restarting the group up
/// to [`LaunchOptions::max_restarts`] times); see the module documentation for the details.
///
/// Each worker runs in its own process group with stdin closed. A worker exiting 0 early is
/// fine. When one exits non-zero or is killed by a signal, every other worker's group gets
/// SIGTERM, then SIGKILL after [`LaunchOptions::grace_period`]; the rank that failed first, its
/// status and its last lines of output are printed to stderr, and (once no restart is left)
/// [`Error::WorkerFailed`](crate::Error::WorkerFailed) is returned with the exit code to propagate (the worker's code, or
/// 128 + signal). A SIGINT, SIGTERM or SIGHUP to the launcher stops the workers the same way (a
/// second one SIGKILLs them at once) and returns [`Error::Interrupted`](crate::Error::Interrupted) (code 130 for SIGINT,
/// 129 for SIGHUP). On Linux the workers get SIGKILL when the thread that called this exits, so
/// call it from a thread that outlives the launch (the main thread, typically). While
/// this runs, SIGINT, SIGTERM and SIGHUP are handled by the launcher (the handlers stay installed,
/// inert, afterwards).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the flag for invalid options (0 processes, a machine rank
/// not below the number of machines, a missing `--main-process-ip` / `--main-process-port` or
/// `ACCELERATE_RS_SECRET` with several machines, a busy port on machine rank 0, bad GPU ids, an
/// empty program), [`Error::Io`] when no free port can be found or a log file cannot be
/// created, [`Error::Spawn`] when a worker cannot be started (the ones already started are
/// killed), all as [`crate::Error::Library`]; [`crate::Error::WorkerFailed`] and
/// [`crate::Error::Interrupted`] as above.
pub fn launch(opts: &LaunchOptions) -> crate::Result<()> {
    let plan = plan(opts)?;
    if opts.dry_run {
        let (port, _store) = reserve_port(opts, &plan)?;
        let env = CommonEnv::new(&env_spec(opts, &plan, port, 0), |var| {
            std::env::var_os(var).is_some()
        });
        print_dry_run(opts, &env, port, &plan.master_addr);
        return Ok(());
    }
    if let Some(msg) = no_gpu_notice(opts) {
        notice(opts, &msg);
    }
    if let Some(dir) = &plan.log_dir {
        notice(
            opts,
            &format!("writing each rank's output to {}", dir.display()),
        );
    }
    let signals = signals::SignalWatch::install();
    let tick = opts.monitor_interval.max(Duration::from_millis(1));
    let mut attempt = 0;
    loop {
        // Held until the attempt ends; a restart reserves again.
        let (port, store) = reserve_port(opts, &plan)?;
        let env = CommonEnv::new(&env_spec(opts, &plan, port, attempt), |var| {
            std::env::var_os(var).is_some()
        });
        log::info!(
            "launch: attempt {attempt}: starting {} worker(s) of `{}`, rendezvous at {}:{port}",
            opts.num_processes,
            opts.program,
            plan.master_addr
        );
        let outcome = run_group(opts, &plan, &env, store.as_ref(), attempt, &signals, tick)?;
        drop(store);
        let (rank, pid, code, status) = match outcome {
            Outcome::Success => return Ok(()),
            Outcome::Failed {
                rank,
                pid,
                code,
                status,
                ..
            } => (rank, pid, code, status),
            Outcome::Interrupted {
                signo,
                signal,
                stopped,
            } => {
                eprintln!("accelerate-rs: received {signal}; stopped {stopped} worker(s)");
                return Err(crate::Error::Interrupted {
                    signal,
                    code: 128 + signo,
                    stopped,
                });
            }
            Outcome::WaitFailed { rank, source } => {
                return Err(Error::Io {
                    context: format!(
                        "launch: waiting for rank {rank} failed; stopped all workers of"
                    ),
                    path: opts.program.clone().into(),
                    source,
                }
                .into())
            }
        };
        if attempt >= opts.max_restarts || signals.first().is_some() {
            if opts.max_restarts > 0 {
                eprintln!(
                    "accelerate-rs: giving up after {attempt} restart(s) (--max-restarts {})",
                    opts.max_restarts
                );
            }
            return Err(crate::Error::WorkerFailed {
                rank,
                pid,
                code,
                status,
            });
        }
        attempt += 1;
        notice(
            opts,
            &format!(
                "restarting the worker group after rank {rank} {status} (restart {attempt} of {})",
                opts.max_restarts
            ),
        );
    }
}

/// Runs one attempt: starts the group, supervises it, reports a failure with its last lines.
fn run_group(
    opts: &LaunchOptions,
    plan: &Plan,
    env: &CommonEnv,
    store: Option<&TcpListener>,
    attempt: usize,
    signals: &signals::SignalWatch,
    tick: Duration,
) -> Result<Outcome> {
    let logs = match &plan.log_dir {
        Some(dir) => {
            let ranks = (0..opts.num_processes).map(|i| env.global_rank(i));
            output::open_logs(dir, ranks, attempt > 0).map_err(|source| Error::Io {
                context: "launch: cannot create the per-rank log files in".to_string(),
                path: dir.clone(),
                source,
            })?
        }
        None => Default::default(),
    };
    let mut output = output::Forwarder::start(logs).map_err(|source| Error::Spawn {
        rank: env.global_rank(0),
        program: opts.program.clone(),
        source,
    })?;
    let (tx, rx) = channel();
    let mut workers = Vec::with_capacity(opts.num_processes);
    let spawned = workers::spawn_all(opts, env, store, &mut output, &tx, &mut workers);
    if let Err(e) = spawned {
        supervise::stop_all(&mut workers, &rx, signals, Duration::ZERO, tick);
        output.finish(opts.grace_period);
        return Err(e);
    }
    let mut outcome = supervise::supervise(&mut workers, &rx, signals, opts.grace_period, tick);
    let tails = output.finish(opts.grace_period.max(Duration::from_secs(1)));
    // The rank seen failing first may have failed because of another one: blame the rank whose
    // own output shows the real error.
    let mut first_note = String::new();
    if let Outcome::Failed {
        rank,
        pid,
        code,
        status,
        ..
    } = &mut outcome
    {
        let failed: Vec<usize> = workers
            .iter()
            .filter(|w| matches!(&w.status, Some(Ok(s)) if !s.success()))
            .map(|w| w.rank)
            .collect();
        let culprit = blame::blame(*rank, &failed, &tails);
        if culprit != *rank {
            if let Some(w) = workers.iter().find(|w| w.rank == culprit) {
                if let Some(Ok(s)) = &w.status {
                    let (c, st) = workers::describe(*s);
                    first_note = format!(
                        "accelerate-rs: (rank {rank} exited first, {status}, because its collective with the others failed)\n"
                    );
                    *rank = culprit;
                    *pid = w.pid();
                    *code = c;
                    *status = st;
                }
            }
        }
    }
    if let Outcome::Failed {
        rank,
        pid,
        status,
        stopped,
        ..
    } = &outcome
    {
        let mut report = format!(
            "accelerate-rs: rank {rank} (pid {pid}) {status}; stopped {stopped} other worker(s)\n{first_note}"
        );
        match tails.get(rank).filter(|t| !t.is_empty()) {
            Some(tail) => {
                report.push_str(&format!(
                    "accelerate-rs: last {} line(s) of rank {rank}'s output:\n",
                    tail.len()
                ));
                for line in tail {
                    report.push_str(&format!("  [rank {rank}] {line}\n"));
                }
            }
            None => report.push_str(&format!("accelerate-rs: rank {rank} printed nothing\n")),
        }
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(report.as_bytes()).and_then(|()| err.flush());
    }
    Ok(outcome)
}
