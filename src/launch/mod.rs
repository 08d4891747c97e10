//! `accelerate-rs launch`: start N local worker processes with the torchrun environment, forward
//! their output line by line with a `[rank i]` prefix, and stop the whole group as soon as one
//! worker fails or the launcher is interrupted.
//!
//! Every worker gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`
//! (`127.0.0.1`), `MASTER_PORT`, a fresh per-launch `ACCELERATE_RS_SECRET` (64 hex digits),
//! `ACCELERATE_RS_RESTART_COUNT=0`, `ACCELERATE_RS_USE_CPU=1` with [`LaunchOptions::cpu`], and
//! `RAYON_NUM_THREADS` / `OMP_NUM_THREADS` = the machine's cores divided by the number of workers
//! (at least 1) unless the launcher's own environment already sets them.

mod output;
mod signals;
mod supervise;
mod worker_env;
mod workers;

use std::time::Duration;

use crate::error::{Error, Result};
use supervise::Outcome;
use worker_env::CommonEnv;

/// Default delay between SIGTERM and SIGKILL when stopping workers.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(3);

/// What to launch and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Number of worker processes (at least 1).
    pub num_processes: usize,
    /// Force the workers onto the CPU (sets `ACCELERATE_RS_USE_CPU=1`).
    pub cpu: bool,
    /// Port of the rendezvous store; `None` or `Some(0)` picks a free loopback port.
    pub main_process_port: Option<u16>,
    /// The program every worker runs.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    pub grace_period: Duration,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            num_processes: 1,
            cpu: false,
            main_process_port: None,
            program: String::new(),
            args: Vec::new(),
            grace_period: DEFAULT_GRACE_PERIOD,
        }
    }
}

/// Runs `opts.num_processes` workers of `opts.program` to completion.
///
/// Each worker runs in its own process group with stdin closed; its stdout and stderr lines are
/// printed on the launcher's stdout and stderr prefixed with `[rank i] `. A worker exiting 0
/// early is fine. When one exits non-zero or is killed by a signal, every other worker's group
/// gets SIGTERM, then SIGKILL after [`LaunchOptions::grace_period`]; a message naming the rank
/// is printed to stderr and [`Error::WorkerFailed`] is returned with the exit code to propagate
/// (the worker's code, or 128 + signal). A SIGINT or SIGTERM to the launcher stops the workers
/// the same way (a second one SIGKILLs them at once) and returns [`Error::Interrupted`]
/// (code 130 for SIGINT). While this runs, SIGINT and SIGTERM are handled by the launcher
/// (the handlers stay installed, inert, afterwards).
///
/// # Errors
/// [`Error::InvalidArgument`] for 0 processes or an empty program, [`Error::Io`] when no free
/// port can be found, [`Error::Spawn`] when a worker cannot be started (the ones already started
/// are killed), [`Error::WorkerFailed`] and [`Error::Interrupted`] as above.
pub fn launch(opts: &LaunchOptions) -> Result<()> {
    if opts.num_processes == 0 {
        return Err(Error::invalid(
            "--num-processes",
            "must be at least 1, got 0",
        ));
    }
    if opts.program.is_empty() {
        return Err(Error::invalid("PROGRAM", "no program to launch was given"));
    }
    let port = match opts.main_process_port {
        Some(port) if port != 0 => port,
        _ => worker_env::free_port()?,
    };
    let env = CommonEnv::new(
        opts.num_processes,
        port,
        opts.cpu,
        worker_env::new_secret(),
        worker_env::threads_per_worker(opts.num_processes),
        |var| std::env::var_os(var).is_some(),
    );
    log::info!(
        "launch: starting {} worker(s) of `{}`, rendezvous at {}:{port}",
        opts.num_processes,
        opts.program,
        worker_env::LOOPBACK
    );

    let signals = signals::SignalWatch::install();
    let mut output = output::Forwarder::start().map_err(|source| Error::Spawn {
        rank: 0,
        program: opts.program.clone(),
        source,
    })?;
    let spawned = workers::spawn_all(
        opts.num_processes,
        &opts.program,
        &opts.args,
        &env,
        &mut output,
    );
    let mut workers = match spawned {
        Ok(workers) => workers,
        Err(e) => {
            output.finish(opts.grace_period);
            return Err(e);
        }
    };
    let outcome = supervise::supervise(&mut workers, &signals, opts.grace_period);
    output.finish(opts.grace_period.max(Duration::from_secs(1)));
    drop(signals);

    match outcome {
        Outcome::Success => Ok(()),
        Outcome::Failed {
            rank,
            pid,
            code,
            status,
            stopped,
        } => {
            eprintln!(
                "accelerate-rs: rank {rank} (pid {pid}) {status}; stopped {stopped} other worker(s)"
            );
            Err(Error::WorkerFailed {
                rank,
                pid,
                code,
                status,
            })
        }
        Outcome::Interrupted {
            signo,
            signal,
            stopped,
        } => {
            eprintln!("accelerate-rs: received {signal}; stopped {stopped} worker(s)");
            Err(Error::Interrupted {
                signal,
                code: 128 + signo,
                stopped,
            })
        }
        Outcome::WaitFailed { rank, source } => Err(Error::Io {
            context: format!("launch: waiting for rank {rank} failed; stopped all workers of"),
            path: opts.program.clone().into(),
            source,
        }),
    }
}
