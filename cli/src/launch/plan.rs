//! The plan of a launch: its options checked, and the parts every attempt shares (rendezvous
//! address and port, secret, GPUs, log folder, the workers' environment).

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use accelerate_rs::env::{CommonEnv, EnvSpec};
use accelerate_rs::limits;
use accelerate_rs::{env, Error, Result};

use super::net;
use super::options::{notice, LaunchOptions, MAX_PROCESSES};

/// The validated, fixed parts of a launch.
pub(super) struct Plan {
    pub(super) master_addr: String,
    pub(super) secret: String,
    pub(super) gpu_ids: Option<String>,
    pub(super) log_dir: Option<PathBuf>,
}

/// Checks `opts` and fixes what every attempt of the launch shares: the rendezvous address, the
/// secret, the visible GPUs and the log folder.
pub(super) fn plan(opts: &LaunchOptions) -> Result<Plan> {
    check_counts(opts)?;
    Ok(Plan {
        master_addr: master_addr(opts)?,
        secret: secret(opts)?,
        gpu_ids: gpu_ids(opts)?,
        log_dir: log_dir(opts),
    })
}

/// The counts and numbers of `opts` within their ranges, and a program to run.
fn check_counts(opts: &LaunchOptions) -> Result<()> {
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
    Ok(())
}

/// Where the rendezvous store listens: `--main-process-ip`, required with several machines, or
/// loopback.
fn master_addr(opts: &LaunchOptions) -> Result<String> {
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
    Ok(master_addr)
}

/// The run's secret: `ACCELERATE_RS_SECRET`, required with several machines, or a new one.
fn secret(opts: &LaunchOptions) -> Result<String> {
    let multi = opts.num_machines > 1;
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
    Ok(secret)
}

/// `--gpu-ids` as the list `CUDA_VISIBLE_DEVICES` takes, or `None` for all.
fn gpu_ids(opts: &LaunchOptions) -> Result<Option<String>> {
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
    Ok(gpu_ids)
}

/// The folder of the per-rank log files: `--log-dir`, or a new one under
/// `accelerate-rs-logs/` with `--tee`.
fn log_dir(opts: &LaunchOptions) -> Option<PathBuf> {
    match (&opts.log_dir, opts.tee) {
        (Some(dir), _) => Some(dir.clone()),
        (None, true) => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            Some(Path::new("accelerate-rs-logs").join(format!("{secs}-{}", std::process::id())))
        }
        (None, false) => None,
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
pub(super) fn no_gpu_notice(opts: &LaunchOptions) -> Option<String> {
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

/// The port of one attempt (see the module documentation) and, on the machine that hosts rank
/// 0, the store's socket already bound to it (checking the port and taking it are one step: two
/// launches given the same port cannot both get it).
pub(super) fn reserve_port(
    opts: &LaunchOptions,
    plan: &Plan,
) -> Result<(u16, Option<TcpListener>)> {
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

pub(super) fn env_spec(
    opts: &LaunchOptions,
    plan: &Plan,
    port: u16,
    restart_count: usize,
) -> EnvSpec {
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
pub(super) fn print_dry_run(opts: &LaunchOptions, env: &CommonEnv, port: u16, master: &str) {
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
