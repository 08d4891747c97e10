//! The worker processes: spawning each in its own process group, polling, signalling groups.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::output::{Forwarder, Stream};
use super::signals::signal_name;
use super::worker_env::CommonEnv;
use crate::error::{Error, Result};

/// One running (or finished) worker.
pub(crate) struct Worker {
    /// Its rank.
    pub(crate) rank: usize,
    child: Child,
    /// Its exit status once reaped.
    pub(crate) status: Option<ExitStatus>,
}

impl Worker {
    /// Its process id (also its process group id).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has not been reaped yet.
    pub(crate) fn running(&self) -> bool {
        self.status.is_none()
    }

    /// Reaps it if it has exited; returns the status the first time it is seen.
    pub(crate) fn poll(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.status.is_some() {
            return Ok(None);
        }
        let status = self.child.try_wait()?;
        self.status = status;
        Ok(status)
    }

    /// Blocks until it exits (call after SIGKILL).
    pub(crate) fn reap(&mut self) {
        if self.status.is_none() {
            match self.child.wait() {
                Ok(status) => self.status = Some(status),
                Err(e) => log::warn!("launch: waiting for rank {} failed: {e}", self.rank),
            }
        }
    }

    /// Sends `sig` to its whole process group, if it is still running.
    pub(crate) fn signal_group(&self, sig: Signal) {
        if !self.running() {
            return;
        }
        let Ok(pgid) = i32::try_from(self.pid()) else {
            return;
        };
        match killpg(Pid::from_raw(pgid), sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => log::warn!(
                "launch: sending {sig} to rank {} (pid {pgid}) failed: {e}",
                self.rank
            ),
        }
    }
}

/// Exit code to propagate and a human readable description of `status`:
/// the worker's code, or 128 + signal number when a signal killed it.
pub(crate) fn describe(status: ExitStatus) -> (i32, String) {
    if let Some(code) = status.code() {
        (code, format!("exited with code {code}"))
    } else if let Some(sig) = status.signal() {
        (128 + sig, format!("killed by signal {}", signal_name(sig)))
    } else {
        (1, status.to_string())
    }
}

/// Starts `num_processes` workers running `program args`, each in its own process group with
/// its rank's environment, stdout and stderr forwarded through `output`. If one cannot be
/// started, those already running are killed and reaped.
pub(crate) fn spawn_all(
    num_processes: usize,
    program: &str,
    args: &[String],
    env: &CommonEnv,
    output: &mut Forwarder,
) -> Result<Vec<Worker>> {
    let mut workers: Vec<Worker> = Vec::with_capacity(num_processes);
    for rank in 0..num_processes {
        match spawn_one(rank, program, args, env, output) {
            Ok(worker) => {
                log::debug!("launch: started rank {rank} (pid {})", worker.pid());
                workers.push(worker);
            }
            Err(source) => {
                for w in &workers {
                    w.signal_group(Signal::SIGKILL);
                }
                for w in &mut workers {
                    w.reap();
                }
                return Err(Error::Spawn {
                    rank,
                    program: program.to_string(),
                    source,
                });
            }
        }
    }
    Ok(workers)
}

fn spawn_one(
    rank: usize,
    program: &str,
    args: &[String],
    env: &CommonEnv,
    output: &mut Forwarder,
) -> std::io::Result<Worker> {
    let mut child = Command::new(program)
        .args(args)
        .envs(env.for_rank(rank))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()?;
    let pipes = (child.stdout.take(), child.stderr.take());
    let mut worker = Worker {
        rank,
        child,
        status: None,
    };
    let attached = (|| {
        if let Some(out) = pipes.0 {
            output.attach(rank, Stream::Stdout, out)?;
        }
        if let Some(err) = pipes.1 {
            output.attach(rank, Stream::Stderr, err)?;
        }
        Ok(())
    })();
    if let Err(e) = attached {
        worker.signal_group(Signal::SIGKILL);
        worker.reap();
        return Err(e);
    }
    Ok(worker)
}
