//! The launcher's side of the self-launch (see the module documentation of `spawn`): start the
//! copies, watch them, stop them all on a failure or a signal, exit with the right code.

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::output;
use crate::error::{Error, Result};
use crate::settings::env;
use crate::settings::worker_env::{CommonEnv, EnvSpec};
use crate::settings::SelfLaunch;

/// Time stopped workers get between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// How often the parent looks at signals while waiting for exits.
const TICK: Duration = Duration::from_millis(50);

/// SIGINT / SIGTERM / SIGHUP received by the parent: how many, and the first one.
static SIGNALS: AtomicUsize = AtomicUsize::new(0);
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomics: async-signal-safe.
    let _ = FIRST_SIGNAL.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// Counts SIGINT, SIGTERM and SIGHUP from now on instead of dying of them.
fn watch_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: `action` is fully initialised (zeroed, then its handler and an empty mask set);
        // the handler only touches atomics, which is async-signal-safe. A failure leaves that
        // signal's default action, which is logged.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            action.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            log::warn!(
                "self-launch: cannot handle signal {sig}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// One worker (its index is its rank): its process id (also its process group) and, once seen,
/// its exit.
struct Worker {
    pid: u32,
    status: Option<ExitStatus>,
}

impl Worker {
    /// Sends `sig` to the worker's process group while it runs.
    fn signal(&self, sig: libc::c_int) {
        if self.status.is_some() {
            return;
        }
        if let Ok(pgid) = libc::pid_t::try_from(self.pid) {
            // SAFETY: killpg only sends a signal; the group is the worker's own (it was started
            // with process_group(0)) and still exists, since its leader has not been reaped.
            unsafe { libc::killpg(pgid, sig) };
        }
    }
}

/// The exit code to propagate for `status` and how to say it.
fn describe(status: ExitStatus) -> (i32, String) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, format!("exited with code {code}")),
        (None, Some(sig)) => (128 + sig, format!("was killed by signal {sig}")),
        _ => (1, status.to_string()),
    }
}

/// Runs `plan.processes` workers of this program to the end, then exits the process with their
/// status (see the module documentation). Returns only when they cannot be started.
pub(crate) fn run(plan: &SelfLaunch) -> Result<std::convert::Infallible> {
    let n = plan.processes;
    let exe = std::env::current_exe().map_err(|source| Error::Spawn {
        rank: 0,
        program: "the current executable".into(),
        source,
    })?;
    let program = exe.display().to_string();
    let spawn_err = |rank: usize| {
        let program = program.clone();
        move |source| Error::Spawn {
            rank,
            program,
            source,
        }
    };
    // Rank 0 inherits the store's socket, bound here: nothing can take the port in between.
    let store = TcpListener::bind(("127.0.0.1", 0)).map_err(spawn_err(0))?;
    let port = store.local_addr().map_err(spawn_err(0))?.port();
    let common = worker_env(plan, port);
    announce(plan, &program);
    watch_signals();
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut out = output::Output::default();
    let (tx, rx) = channel();
    let mut workers = Vec::with_capacity(n);
    for rank in 0..n {
        let started = spawn(&exe, &args, &common, rank, (rank == 0).then_some(&store))
            .and_then(|child| watch(rank, child, &mut out, &tx));
        match started {
            Ok(pid) => workers.push(Worker { pid, status: None }),
            Err(source) => {
                stop(&mut workers, &rx, Duration::ZERO);
                return Err(spawn_err(rank)(source));
            }
        }
    }
    let code = supervise(&mut workers, &rx, out);
    drop(store);
    std::process::exit(code)
}

/// The launcher's environment contract for the `plan.processes` copies: one machine, the store
/// on `port` of the loopback, the plan's secret (or a fresh one), the cores shared out.
fn worker_env(plan: &SelfLaunch, port: u16) -> CommonEnv {
    let n = plan.processes;
    let secret = plan.secret.clone().unwrap_or_else(|| {
        let bytes: [u8; 32] = rand::random();
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    });
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    CommonEnv::new(
        &EnvSpec {
            local_world_size: n,
            num_machines: 1,
            machine_rank: 0,
            master_addr: "127.0.0.1".into(),
            port,
            secret,
            restart_count: 0,
            cpu: plan.use_cpu == Some(true),
            threads: (cores / n).max(1),
            gpu_ids: None,
            mixed_precision: None,
            gradient_accumulation_steps: None,
            timeout_secs: None,
            bucket_cap_mb: None,
            zero_stage: None,
            offload_optimizer: None,
        },
        crate::settings::runtime::process_var_is_set,
    )
}

/// Tells the user what starts (and that it runs on the CPU when a CUDA build finds no GPU).
fn announce(plan: &SelfLaunch, program: &str) {
    let n = plan.processes;
    eprintln!(
        "accelerate-rs: starting {n} processes of {program} ({}={n} or `processes({n})`); each line is prefixed with its rank",
        env::NUM_PROCESSES
    );
    if plan.use_cpu != Some(true)
        && crate::settings::gpu::BUILT_WITH_CUDA
        && crate::settings::gpu::device_count().unwrap_or(0) == 0
    {
        eprintln!(
            "accelerate-rs: no GPU found{}: the {n} processes run on the CPU (say so with {}=1 or `.cpu(true)` to silence this)",
            env::cuda_visible_devices_note(),
            env::USE_CPU
        );
    }
}

/// Hands a started worker's output pipes to `out` and waits for it on a thread of its own, which
/// sends its exit to `tx`; returns its process id.
fn watch(
    rank: usize,
    mut child: Child,
    out: &mut output::Output,
    tx: &std::sync::mpsc::Sender<Exit>,
) -> std::io::Result<u32> {
    let pid = child.id();
    let pipes = (child.stdout.take(), child.stderr.take());
    if let Some(p) = pipes.0 {
        out.attach(rank, true, p)?;
    }
    if let Some(p) = pipes.1 {
        out.attach(rank, false, p)?;
    }
    let tx = tx.clone();
    std::thread::Builder::new()
        .name(format!("accelerate-rs-wait-{rank}"))
        .spawn(move || {
            let status = child.wait();
            let _ = tx.send((rank, status, Instant::now()));
        })?;
    Ok(pid)
}

/// Starts worker `rank`: this program with its arguments, the rank's environment, its own
/// process group, killed when this process dies; `store` is inherited by rank 0.
fn spawn(
    exe: &std::path::Path,
    args: &[std::ffi::OsString],
    common: &CommonEnv,
    rank: usize,
    store: Option<&TcpListener>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .envs(common.for_rank(rank))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let store_fd = store.map(AsRawFd::as_raw_fd);
    if let Some(fd) = store_fd {
        cmd.env(env::STORE_FD, fd.to_string());
    }
    let parent = std::process::id();
    // SAFETY: runs in the child between fork and exec, making only async-signal-safe system
    // calls (prctl, getppid, fcntl) and allocating nothing (errors are raw OS errors).
    unsafe {
        cmd.pre_exec(move || {
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the line above: the signal will never come.
                if u32::try_from(libc::getppid()).ok() != Some(parent) {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
            }
            #[cfg(not(target_os = "linux"))]
            let _ = parent;
            if let Some(fd) = store_fd {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd.spawn()
}

type Exit = (usize, std::io::Result<ExitStatus>, Instant);

/// `SIGINT`, `SIGTERM`, `SIGHUP` or `signal N`.
fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        n => format!("signal {n}"),
    }
}

/// Waits for the workers, then for their output; returns the exit code of the whole run after
/// reporting a failure or an interruption.
fn supervise(workers: &mut [Worker], rx: &Receiver<Exit>, out: output::Output) -> i32 {
    let (code, note, failed) = wait(workers, rx);
    // Every worker has exited: wait for the last lines they printed (a process a worker left
    // behind may hold a pipe open: not for long).
    let tails = out.finish(Duration::from_secs(1));
    let mut report = note;
    if let Some(rank) = failed {
        match tails
            .get(&rank)
            .map(|t| t.lines())
            .filter(|t| !t.is_empty())
        {
            None => report.push_str(&format!("accelerate-rs: rank {rank} printed nothing\n")),
            Some(tail) => {
                report.push_str(&format!(
                    "accelerate-rs: last lines of rank {rank}'s output:\n"
                ));
                for line in tail {
                    report.push_str(&format!("  [rank {rank}] {line}\n"));
                }
            }
        }
    }
    eprint!("{report}");
    code
}

/// Waits until every worker exited 0, one failed or this process got a signal (then stops the
/// others). Returns the exit code, the report's first line(s) and the rank that failed.
fn wait(workers: &mut [Worker], rx: &Receiver<Exit>) -> (i32, String, Option<usize>) {
    loop {
        if SIGNALS.load(Ordering::SeqCst) > 0 {
            let sig = FIRST_SIGNAL.load(Ordering::SeqCst);
            let stopped = stop(workers, rx, GRACE);
            let note = format!(
                "accelerate-rs: received {}; stopped {stopped} worker(s)\n",
                signal_name(sig)
            );
            return (128 + sig, note, None);
        }
        if workers.iter().all(|w| w.status.is_some()) {
            return (0, String::new(), None);
        }
        let (rank, status, _) = match rx.recv_timeout(TICK) {
            Ok(exit) => exit,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return (0, String::new(), None),
        };
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                let stopped = stop(workers, rx, GRACE);
                let note = format!(
                    "accelerate-rs: waiting for rank {rank} failed ({e}); stopped {stopped} worker(s)\n"
                );
                return (1, note, None);
            }
        };
        if let Some(w) = workers.get_mut(rank) {
            w.status = Some(status);
        }
        if status.success() {
            continue;
        }
        let (code, how) = describe(status);
        let pid = workers.get(rank).map_or(0, |w| w.pid);
        let stopped = stop(workers, rx, GRACE);
        let note = format!(
            "accelerate-rs: rank {rank} (pid {pid}) {how}; stopped {stopped} other worker(s)\n"
        );
        return (code, note, Some(rank));
    }
}

/// Stops every running worker: SIGTERM (and SIGCONT, for stopped ones) to its group, SIGKILL
/// after `grace` or a further signal to this process; waits for every exit. Returns how many were
/// running.
fn stop(workers: &mut [Worker], rx: &Receiver<Exit>, grace: Duration) -> usize {
    let running = workers.iter().filter(|w| w.status.is_none()).count();
    let signals = SIGNALS.load(Ordering::SeqCst);
    for w in workers.iter() {
        w.signal(libc::SIGTERM);
        w.signal(libc::SIGCONT);
    }
    let deadline = Instant::now() + grace;
    while workers.iter().any(|w| w.status.is_none())
        && Instant::now() < deadline
        && SIGNALS.load(Ordering::SeqCst) == signals
    {
        if let Ok(exit) = rx.recv_timeout(TICK) {
            record(workers, exit);
        }
    }
    for w in workers.iter() {
        w.signal(libc::SIGKILL);
    }
    while workers.iter().any(|w| w.status.is_none()) {
        match rx.recv() {
            Ok(exit) => record(workers, exit),
            Err(_) => break,
        }
    }
    running
}

/// Records a worker's exit; a worker whose wait failed counts as gone (code 1).
fn record(workers: &mut [Worker], (rank, status, _): Exit) {
    if let Some(w) = workers.get_mut(rank) {
        w.status = Some(status.unwrap_or_else(|_| ExitStatus::from_raw(1 << 8)));
    }
}
