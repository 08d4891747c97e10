//! The worker processes: spawning each in its own process group with a waiter thread that
//! blocks in `wait()` and reports the exit (with the instant it was seen) on a channel, and
//! signalling groups.

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::time::Instant;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::output::{Forwarder, Stream};
use super::signals::signal_name;
use super::LaunchOptions;
use accelerate_rs::env::CommonEnv;
use accelerate_rs::{Error, Result};

/// A worker's exit, as reported by its waiter thread.
pub(crate) struct Exit {
    /// Index of the worker in the group (its local rank).
    pub(crate) index: usize,
    /// What `wait()` returned.
    pub(crate) status: std::io::Result<ExitStatus>,
    /// When `wait()` returned: exits are ordered by this, not by arrival.
    pub(crate) at: Instant,
}

/// One running (or finished) worker.
pub(crate) struct Worker {
    /// Its global rank.
    pub(crate) rank: usize,
    pid: u32,
    /// Its exit status once its waiter reported it (`Err` text when waiting failed).
    pub(crate) status: Option<std::result::Result<ExitStatus, String>>,
}

impl Worker {
    /// Its process id (also its process group id).
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether its exit has not been reported yet.
    pub(crate) fn running(&self) -> bool {
        self.status.is_none()
    }

    /// Sends `sig` to its whole process group, if it is still running.
    pub(crate) fn signal_group(&self, sig: Signal) {
        if !self.running() {
            return;
        }
        let Ok(pgid) = i32::try_from(self.pid) else {
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

/// Makes the calling (forked, not yet exec'ed) worker get SIGKILL when the launcher dies, even by
/// SIGKILL, so that no worker outlives it as an orphan. The parent-death signal survives `exec`
/// (of a program that is not set-uid). If the launcher died between `fork` and this call, the
/// signal will never come: the worker's parent is then no longer `launcher`, and it exits instead
/// of running.
#[cfg(target_os = "linux")]
fn die_with_launcher(launcher: Pid) -> std::io::Result<()> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
    if nix::unistd::getppid() != launcher {
        return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
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

/// Starts `opts.num_processes` local workers running `opts.program` with `opts.args`, each in its own process group with its
/// rank's environment (global rank 0 also inherits `store`, the rendezvous socket), stdout and stderr forwarded through `output`, and a waiter thread that
/// sends its [`Exit`] on `exits`. They are pushed onto `workers`; if one cannot be started, the
/// error is returned and the workers already running are left in `workers` for the caller to
/// stop.
pub(crate) fn spawn_all(
    opts: &LaunchOptions,
    env: &CommonEnv,
    store: Option<&TcpListener>,
    output: &mut Forwarder,
    exits: &Sender<Exit>,
    workers: &mut Vec<Worker>,
) -> Result<()> {
    let program = &opts.program;
    for index in 0..opts.num_processes {
        let rank = env.global_rank(index);
        let store = store.filter(|_| rank == 0);
        match spawn_one(index, rank, opts, env, store, output, exits) {
            Ok(worker) => {
                log::debug!("launch: started rank {rank} (pid {})", worker.pid());
                workers.push(worker);
            }
            Err(source) => {
                return Err(Error::Spawn {
                    rank,
                    program: program.to_string(),
                    source,
                });
            }
        }
    }
    Ok(())
}

fn spawn_one(
    index: usize,
    rank: usize,
    opts: &LaunchOptions,
    env: &CommonEnv,
    store: Option<&TcpListener>,
    output: &mut Forwarder,
    exits: &Sender<Exit>,
) -> std::io::Result<Worker> {
    let mut cmd = Command::new(&opts.program);
    cmd.args(&opts.args)
        .envs(env.for_rank(index))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        let launcher = nix::unistd::getpid();
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it makes two system calls (prctl, getppid) and
        // allocates nothing (the error is a raw OS error).
        unsafe {
            cmd.pre_exec(move || die_with_launcher(launcher));
        }
    }
    if let Some(listener) = store {
        // Rank 0 inherits the store's socket (bound by the launcher) under the same number.
        let fd = listener.as_raw_fd();
        cmd.env(accelerate_rs::env::STORE_FD, fd.to_string());
        // SAFETY: runs in the child between fork and exec and only makes one async-signal-safe
        // system call (fcntl) on a descriptor the child inherited from the launcher; clearing
        // close-on-exec there does not affect the launcher's own descriptor table.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn()?;
    let pid = child.id();
    let pipes = (child.stdout.take(), child.stderr.take());
    let attached = (|| {
        if let Some(out) = pipes.0 {
            output.attach(rank, Stream::Stdout, out)?;
        }
        if let Some(err) = pipes.1 {
            output.attach(rank, Stream::Stderr, err)?;
        }
        Ok(())
    })();
    let tx = exits.clone();
    let waiter = attached.and_then(|()| {
        std::thread::Builder::new()
            .name(format!("launch-wait-rank{rank}"))
            .spawn(move || {
                let status = child.wait();
                let at = Instant::now();
                let _ = tx.send(Exit { index, status, at });
            })
    });
    if let Err(e) = waiter {
        // The child may still be ours to reap (the waiter never started).
        if let Ok(pgid) = i32::try_from(pid) {
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
        }
        return Err(e);
    }
    Ok(Worker {
        rank,
        pid,
        status: None,
    })
}
