//! Running a launch: the attempts of the worker group, restarted after a failure.

use std::io::Write;
use std::net::TcpListener;
use std::sync::mpsc::channel;
use std::time::Duration;

use accelerate_rs::env::CommonEnv;
use accelerate_rs::{Error, Result};

use super::options::{notice, LaunchOptions};
use super::output::Tails;
use super::plan::{env_spec, no_gpu_notice, plan, print_dry_run, reserve_port, Plan};
use super::supervise::{self, Outcome};
use super::workers;
use super::{blame, output, signals};

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
        return dry_run(opts, &plan);
    }
    announce(opts, &plan);
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
        let Some((rank, pid, code, status)) = failure_of(outcome, opts)? else {
            return Ok(());
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

/// `--dry-run`: prints what the launch would run (a port reserved and let go), starts nothing.
fn dry_run(opts: &LaunchOptions, plan: &Plan) -> crate::Result<()> {
    let (port, _store) = reserve_port(opts, plan)?;
    let env = CommonEnv::new(&env_spec(opts, plan, port, 0), |var| {
        std::env::var_os(var).is_some()
    });
    print_dry_run(opts, &env, port, &plan.master_addr);
    Ok(())
}

/// The notices before the first attempt: no GPU, where the output goes.
fn announce(opts: &LaunchOptions, plan: &Plan) {
    if let Some(msg) = no_gpu_notice(opts) {
        notice(opts, &msg);
    }
    if let Some(dir) = &plan.log_dir {
        notice(
            opts,
            &format!("writing each rank's output to {}", dir.display()),
        );
    }
}

/// A failed worker's rank, pid, exit code and status.
type Failure = (usize, u32, i32, String);

/// What an attempt's outcome means for the launch: `None` when every worker succeeded, the
/// failure to restart after or report, or the error that ends the launch at once (interrupted,
/// waiting failed).
fn failure_of(outcome: Outcome, opts: &LaunchOptions) -> crate::Result<Option<Failure>> {
    let failed = match outcome {
        Outcome::Success => return Ok(None),
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
                context: format!("launch: waiting for rank {rank} failed; stopped all workers of"),
                path: opts.program.clone().into(),
                source,
            }
            .into())
        }
    };
    Ok(Some(failed))
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
    let mut output = start_output(opts, plan, env, attempt)?;
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
    let first_note = blame_culprit(&mut outcome, &workers, &tails);
    report_failure(&outcome, &tails, &first_note);
    Ok(outcome)
}

/// The forwarder of the workers' output, writing each rank's to its log file too when the plan
/// has a log folder (appending on a restart).
fn start_output(
    opts: &LaunchOptions,
    plan: &Plan,
    env: &CommonEnv,
    attempt: usize,
) -> Result<output::Forwarder> {
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
    output::Forwarder::start(logs).map_err(|source| Error::Spawn {
        rank: env.global_rank(0),
        program: opts.program.clone(),
        source,
    })
}

/// The rank seen failing first may have failed because of another one: puts the rank whose own
/// output shows the real error in `outcome`, and returns the note saying so (empty when the
/// first rank is the culprit).
fn blame_culprit(outcome: &mut Outcome, workers: &[workers::Worker], tails: &Tails) -> String {
    let Outcome::Failed {
        rank,
        pid,
        code,
        status,
        ..
    } = outcome
    else {
        return String::new();
    };
    let failed: Vec<usize> = workers
        .iter()
        .filter(|w| matches!(&w.status, Some(Ok(s)) if !s.success()))
        .map(|w| w.rank)
        .collect();
    let culprit = blame::blame(*rank, &failed, tails);
    if culprit == *rank {
        return String::new();
    }
    let Some(w) = workers.iter().find(|w| w.rank == culprit) else {
        return String::new();
    };
    let Some(Ok(s)) = &w.status else {
        return String::new();
    };
    let (c, st) = workers::describe(*s);
    let note = format!(
        "accelerate-rs: (rank {rank} exited first, {status}, because its collective with the others failed)\n"
    );
    *rank = culprit;
    *pid = w.pid();
    *code = c;
    *status = st;
    note
}

/// A failure's report on stderr: the rank, its status, and its last lines of output.
fn report_failure(outcome: &Outcome, tails: &Tails, first_note: &str) {
    let Outcome::Failed {
        rank,
        pid,
        status,
        stopped,
        ..
    } = outcome
    else {
        return;
    };
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
