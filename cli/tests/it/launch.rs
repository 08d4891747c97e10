//! End-to-end tests of `accelerate-rs launch` with real worker processes (`sh -c` scripts).

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs_cli::launch::{launch, LaunchOptions};
use accelerate_rs_cli::Error;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::free_port;

/// The launcher binary, with a clean logging / thread-count environment.
pub(crate) fn launcher() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_accelerate-rs"));
    for var in [
        "RUST_LOG",
        "RAYON_NUM_THREADS",
        "OMP_NUM_THREADS",
        "ACCELERATE_RS_USE_CPU",
        "ACCELERATE_RS_SECRET",
        "ACCELERATE_RS_CONFIG_FILE",
        "CUDA_VISIBLE_DEVICES",
    ] {
        cmd.env_remove(var);
    }
    // No user config file may leak into the tests.
    cmd.env("XDG_CONFIG_HOME", "/nonexistent/accelerate-rs-test-config");
    cmd.stdin(Stdio::null());
    cmd
}

/// `accelerate-rs launch <args>`; returns its output and how long it ran.
pub(crate) fn run_launch(args: &[&str]) -> (Output, Duration) {
    run_launch_env(args, &[])
}

/// [`run_launch`] with extra variables in the launcher's environment.
pub(crate) fn run_launch_env(args: &[&str], vars: &[(&str, &str)]) -> (Output, Duration) {
    let start = Instant::now();
    let out = launcher()
        .arg("launch")
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .expect("run the launcher");
    (out, start.elapsed())
}

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Lines of `stdout` grouped by rank (prefix removed); panics on a line without a prefix.
pub(crate) fn by_rank(stdout: &str) -> HashMap<usize, Vec<String>> {
    let mut map: HashMap<usize, Vec<String>> = HashMap::new();
    for line in stdout.lines() {
        let rest = line
            .strip_prefix("[rank ")
            .unwrap_or_else(|| panic!("line without prefix: {line:?}"));
        let (rank, content) = rest
            .split_once("] ")
            .unwrap_or_else(|| panic!("bad prefix: {line:?}"));
        let rank: usize = rank
            .parse()
            .unwrap_or_else(|_| panic!("bad rank: {line:?}"));
        map.entry(rank).or_default().push(content.to_string());
    }
    map
}

/// Parses `KEY=VALUE` words of a worker's line.
pub(crate) fn kv(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(crate) fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

/// Reads the pid files `pid.<rank>` the workers wrote into `dir`.
pub(crate) fn read_pids(dir: &Path, ranks: &[usize]) -> Vec<i32> {
    ranks
        .iter()
        .map(|r| {
            let s = std::fs::read_to_string(dir.join(format!("pid.{r}"))).expect("pid file");
            s.trim().parse().expect("pid")
        })
        .collect()
}

/// Kills leftover workers if an assertion failed before they were checked.
struct KillOnDrop(Vec<i32>);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

pub(crate) const PRINT_ENV: &str = "echo R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE \
    A=$MASTER_ADDR P=$MASTER_PORT S=$ACCELERATE_RS_SECRET C=${ACCELERATE_RS_USE_CPU:-unset} \
    RC=$ACCELERATE_RS_RESTART_COUNT T=$RAYON_NUM_THREADS O=$OMP_NUM_THREADS";

#[test]
fn workers_get_the_torchrun_environment_and_prefixed_output() {
    let (out, _) = run_launch(&["--cpu", "-n", "3", "sh", "-c", PRINT_ENV]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines.len(), 3);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / 3).max(1).to_string();
    let mut ports = Vec::new();
    let mut secrets = Vec::new();
    for rank in 0..3 {
        assert_eq!(lines[&rank].len(), 1, "rank {rank}: {:?}", lines[&rank]);
        let v = kv(&lines[&rank][0]);
        assert_eq!(v["R"], rank.to_string());
        assert_eq!(v["L"], rank.to_string());
        assert_eq!(v["W"], "3");
        assert_eq!(v["LW"], "3");
        assert_eq!(v["A"], "127.0.0.1");
        assert_eq!(v["C"], "1");
        assert_eq!(v["RC"], "0");
        assert_eq!(v["T"], threads);
        assert_eq!(v["O"], threads);
        let port: u16 = v["P"].parse().expect("port");
        assert_ne!(port, 0);
        ports.push(port);
        let secret = v["S"].clone();
        assert_eq!(secret.len(), 64, "{secret}");
        assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{secret}");
        secrets.push(secret);
    }
    assert!(ports.iter().all(|p| *p == ports[0]), "{ports:?}");
    assert!(secrets.iter().all(|s| *s == secrets[0]));

    // A second launch gets a fresh secret; without --cpu the variable is not set.
    let (out, _) = run_launch(&["-n", "1", "sh", "-c", PRINT_ENV]);
    let v = kv(&by_rank(&text(&out.stdout))[&0][0]);
    assert_ne!(v["S"], secrets[0]);
    assert_eq!(v["C"], "unset");
}

#[test]
fn thread_variables_set_by_the_user_are_kept() {
    let out = launcher()
        .env("RAYON_NUM_THREADS", "7")
        .args(["launch", "-n", "2", "sh", "-c", PRINT_ENV])
        .output()
        .expect("run");
    assert!(out.status.success());
    let lines = by_rank(&text(&out.stdout));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for rank in 0..2 {
        let v = kv(&lines[&rank][0]);
        assert_eq!(v["T"], "7");
        assert_eq!(v["O"], (cores / 2).max(1).to_string());
    }
}

#[test]
fn main_process_port_is_passed_through() {
    let port = free_port().to_string();
    let (out, _) = run_launch(&[
        "--main-process-port",
        &port,
        "-n",
        "2",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    for rank in 0..2 {
        assert_eq!(lines[&rank], [format!("P={port}")]);
    }
}

#[test]
fn program_arguments_with_hyphens_and_double_dash_reach_the_worker() {
    let (out, _) = run_launch(&[
        "-n",
        "1",
        "--",
        "sh",
        "-c",
        "echo \"$@\"",
        "sh",
        "--epochs",
        "3",
        "--cpu",
        "-n",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] --epochs 3 --cpu -n\n");
}

#[test]
fn heavy_output_is_never_interleaved_mid_line() {
    const LINES: usize = 2000;
    // Every rank writes LINES long lines to stdout (and every 4th also to stderr) as fast as it
    // can; the payload is the rank's digit repeated, so a torn line would show.
    let script = format!(
        "pad=$(printf '%0400d' 0 | tr 0 $RANK); i=0; while [ $i -lt {LINES} ]; do \
         echo \"r$RANK l$i $pad\"; \
         if [ $((i % 4)) -eq 0 ]; then echo \"e$RANK l$i $pad\" >&2; fi; \
         i=$((i+1)); done; printf 'tail'"
    );
    let (out, elapsed) = run_launch(&["-n", "4", "sh", "-c", &script]);
    assert!(out.status.success(), "stderr tail: {}", text(&out.stderr));
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let pad = |r: usize| r.to_string().repeat(400);

    let stdout = by_rank(&text(&out.stdout));
    assert_eq!(stdout.len(), 4);
    for rank in 0..4 {
        let lines = &stdout[&rank];
        assert_eq!(lines.len(), LINES + 1, "rank {rank}");
        for (i, line) in lines[..LINES].iter().enumerate() {
            assert_eq!(*line, format!("r{rank} l{i} {}", pad(rank)), "rank {rank}");
        }
        assert_eq!(lines[LINES], "tail");
    }

    // The launcher's own notices (no GPU on this machine) are not worker lines.
    let stderr: String = text(&out.stderr)
        .lines()
        .filter(|l| !l.starts_with("accelerate-rs: "))
        .map(|l| format!("{l}\n"))
        .collect();
    let stderr = by_rank(&stderr);
    for rank in 0..4 {
        let lines = &stderr[&rank];
        assert_eq!(lines.len(), LINES / 4, "rank {rank}");
        for (j, line) in lines.iter().enumerate() {
            assert_eq!(*line, format!("e{rank} l{} {}", 4 * j, pad(rank)));
        }
    }
}

#[test]
fn failing_worker_stops_the_others_and_its_code_is_propagated() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Rank 1 waits until ranks 0 and 2 are sleeping, then fails with code 3.
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
        if [ \"$RANK\" = 1 ]; then \
          while [ ! -f \"$0/pid.0\" ] || [ ! -f \"$0/pid.2\" ]; do sleep 0.02; done; exit 3; \
        fi; exec sleep 60";
    let dir_arg = dir.path().to_str().expect("utf-8 tempdir");
    let (out, elapsed) = run_launch(&["-n", "3", "sh", "-c", script, dir_arg]);
    let pids = read_pids(dir.path(), &[0, 2]);
    let _guard = KillOnDrop(pids.clone());
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert!(stderr.contains("rank 1"), "{stderr}");
    assert!(stderr.contains("exited with code 3"), "{stderr}");
    assert!(stderr.contains("stopped 2 other worker(s)"), "{stderr}");
    for pid in pids {
        assert!(!alive(pid), "worker {pid} is still running");
    }
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "if [ \"$RANK\" = 0 ]; then \
          while [ ! -f \"$0/pid.1\" ]; do sleep 0.02; done; exit 5; \
        fi; trap '' TERM; echo $$ > \"$0/pid.1.tmp\" && mv \"$0/pid.1.tmp\" \"$0/pid.1\"; \
        exec sleep 60";
    let dir_arg = dir.path().to_str().expect("utf-8 tempdir");
    let (out, elapsed) = run_launch(&[
        "--grace-period",
        "1",
        "-n",
        "2",
        "sh",
        "-c",
        script,
        dir_arg,
    ]);
    let pids = read_pids(dir.path(), &[1]);
    let _guard = KillOnDrop(pids.clone());
    assert_eq!(out.status.code(), Some(5), "stderr: {}", text(&out.stderr));
    assert!(elapsed >= Duration::from_secs(1), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert!(!alive(pids[0]), "worker ignoring SIGTERM is still running");
}

#[test]
fn worker_killed_by_a_signal_gives_128_plus_signal() {
    let script = "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; exec sleep 60";
    let (out, elapsed) = run_launch(&["-n", "2", "sh", "-c", script]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(137), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert!(stderr.contains("rank 1"), "{stderr}");
    assert!(stderr.contains("SIGKILL"), "{stderr}");
}

#[test]
fn all_workers_succeeding_gives_exit_0_even_when_some_finish_early() {
    let script = "if [ \"$RANK\" = 0 ]; then exit 0; fi; sleep 0.3; echo done $RANK";
    let (out, _) = run_launch(&["-n", "3", "sh", "-c", script]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines[&1], ["done 1"]);
    assert_eq!(lines[&2], ["done 2"]);
    assert!(!lines.contains_key(&0));
}

#[test]
fn sigint_to_the_launcher_stops_workers_and_exits_130() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    interrupt(dir.path(), script, &[Signal::SIGINT], 130, "SIGINT");
}

#[test]
fn second_signal_kills_workers_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "trap '' TERM; \
                  echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    // Grace period 30 s: only the second signal can end this quickly.
    let elapsed = interrupt(
        dir.path(),
        script,
        &[Signal::SIGTERM, Signal::SIGINT],
        143,
        "SIGTERM",
    );
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
}

#[test]
fn sighup_to_the_launcher_stops_workers_like_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    interrupt(dir.path(), script, &[Signal::SIGHUP], 129, "SIGHUP");
}

#[test]
fn a_stopped_worker_is_torn_down_without_waiting_the_grace_period() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Rank 1 stops rank 0's process group (SIGSTOP), then fails; the launcher must not wait the
    // 20 s grace period for a SIGTERM the stopped rank 0 cannot act on. Rank 0 handles SIGTERM
    // (as a program that saves its state would): a stopped process only runs its handler once
    // continued. (A stopped process without a handler is killed by SIGTERM at once.)
    let script = "if [ $RANK = 0 ]; then \
                    trap 'exit 0' TERM; \
                    echo $$ > \"$0/pid.0.tmp\" && mv \"$0/pid.0.tmp\" \"$0/pid.0\"; \
                    while :; do sleep 0.1; done; \
                  fi; \
                  while [ ! -f \"$0/pid.0\" ]; do sleep 0.05; done; \
                  kill -STOP -$(cat \"$0/pid.0\"); exit 3";
    let (out, elapsed) = run_with_limit(
        launcher()
            .args([
                "launch",
                "--grace-period",
                "20",
                "-n",
                "2",
                "sh",
                "-c",
                script,
            ])
            .arg(dir.path()),
        Duration::from_secs(40),
    );
    let pids = read_pids(dir.path(), &[0]);
    let _guard = KillOnDrop(pids.clone());
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        elapsed < Duration::from_secs(10),
        "the launcher took {elapsed:?} to stop a SIGSTOPped worker"
    );
    assert!(!running(pids[0]), "the stopped worker is still there");
}

#[test]
fn an_absurd_number_of_processes_is_rejected_naming_the_flag() {
    // --dry-run: were it accepted, nothing would be started anyway.
    let (out, _) = run_launch(&["--dry-run", "-n", "100000", "true"]);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "-n 100000 was accepted");
    assert!(
        err.contains("--num-processes") && err.contains("100000") && err.contains("1024"),
        "{err}"
    );
}

/// Whether `pid` is running: a zombie (exited, not reaped yet) is not.
pub(crate) fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

#[test]
fn workers_die_with_a_launcher_killed_by_sigkill() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The workers ignore SIGTERM and SIGHUP: only the parent-death signal can end them.
    let script = "trap '' TERM HUP; \
                  echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    let mut child = launcher()
        .args(["launch", "-n", "3", "sh", "-c", script])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the launcher");
    let launcher_pid = i32::try_from(child.id()).expect("pid");
    let _launcher_guard = KillOnDrop(vec![launcher_pid]);
    wait_for_files(dir.path(), &["pid.0", "pid.1", "pid.2"]);
    let pids = read_pids(dir.path(), &[0, 1, 2]);
    let _guard = KillOnDrop(pids.clone());
    kill(Pid::from_raw(launcher_pid), Signal::SIGKILL).expect("kill the launcher");
    child.wait().expect("reap the launcher");
    let killed = Instant::now();
    while pids.iter().any(|&p| running(p)) && killed.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let orphans: Vec<i32> = pids.iter().copied().filter(|&p| running(p)).collect();
    assert!(
        orphans.is_empty(),
        "workers {orphans:?} still run 5 s after their launcher was killed with SIGKILL"
    );
}

/// Starts 2 workers running `script`, sends `signals` to the launcher once they are up, and
/// checks the exit code, the message and that the workers are gone. Returns how long the
/// launcher took to exit after the first signal.
pub(crate) fn interrupt(
    dir: &Path,
    script: &str,
    signals: &[Signal],
    code: i32,
    name: &str,
) -> Duration {
    interrupt_with(&[], dir, script, signals, code, name).0
}

/// [`interrupt`] with extra launcher flags; also returns the launcher's stderr.
pub(crate) fn interrupt_with(
    flags: &[&str],
    dir: &Path,
    script: &str,
    signals: &[Signal],
    code: i32,
    name: &str,
) -> (Duration, String) {
    let mut child = launcher()
        .arg("launch")
        .args(flags)
        .args(["--grace-period", "30", "-n", "2", "sh", "-c", script])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the launcher");
    let launcher_pid = Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _launcher_guard = KillOnDrop(vec![launcher_pid.as_raw()]);
    let start = Instant::now();
    while !(dir.join("pid.0").exists() && dir.join("pid.1").exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "workers never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids = read_pids(dir, &[0, 1]);
    let _guard = KillOnDrop(pids.clone());
    let start = Instant::now();
    for (i, sig) in signals.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(300));
        }
        kill(launcher_pid, *sig).expect("signal the launcher");
    }
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "launcher did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("read stderr");
    }
    assert_eq!(status.code(), Some(code), "stderr: {stderr}");
    assert!(stderr.contains(name), "{stderr}");
    for pid in pids {
        assert!(!alive(pid), "worker {pid} is still running");
    }
    (elapsed, stderr)
}

#[test]
fn zero_processes_is_rejected_naming_the_flag() {
    let (out, _) = run_launch(&["-n", "0", "true"]);
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(stderr.contains("--num-processes"), "{stderr}");
}

#[test]
fn missing_program_is_reported_by_name() {
    let (out, _) = run_launch(&["-n", "2", "/nonexistent/accelerate-rs-worker"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("/nonexistent/accelerate-rs-worker"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 0"), "{stderr}");
}

#[test]
fn library_api_reports_the_first_failed_rank() {
    let opts = LaunchOptions {
        num_processes: 2,
        program: "sh".into(),
        args: vec![
            "-c".into(),
            "if [ \"$RANK\" = 1 ]; then exit 4; fi; exec sleep 60".into(),
        ],
        grace_period: Duration::from_secs(1),
        ..LaunchOptions::default()
    };
    match launch(&opts) {
        Err(Error::WorkerFailed {
            rank, code, status, ..
        }) => {
            assert_eq!((rank, code), (1, 4));
            assert_eq!(status, "exited with code 4");
        }
        other => panic!("expected WorkerFailed, got {other:?}"),
    }

    let bad = LaunchOptions {
        num_processes: 0,
        program: "true".into(),
        ..LaunchOptions::default()
    };
    match launch(&bad) {
        Err(Error::Library(accelerate_rs::Error::InvalidArgument { name, .. })) => {
            assert_eq!(name, "--num-processes")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(launch(&LaunchOptions {
        program: "true".into(),
        ..LaunchOptions::default()
    })
    .is_ok());
}

/// Starts the launcher with `args` (stdout/stderr piped), waits for it at most `limit`, killing
/// it (and `extra` pids) on timeout; returns its output and how long it ran.
pub(crate) fn run_with_limit(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let start = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the launcher");
    let pid = i32::try_from(child.id()).expect("pid");
    let _guard = KillOnDrop(vec![pid]);
    // Read the pipes in threads so a chatty launcher never blocks.
    let mut out_pipe = child.stdout.take().expect("stdout");
    let mut err_pipe = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out_pipe, &mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err_pipe, &mut v);
        v
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("launcher still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    let stdout = out_t.join().expect("stdout reader");
    let stderr = err_t.join().expect("stderr reader");
    (
        Output {
            status,
            stdout,
            stderr,
        },
        elapsed,
    )
}

pub(crate) fn wait_for_files(dir: &Path, names: &[&str]) {
    let start = Instant::now();
    while !names.iter().all(|n| dir.join(n).exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "workers never wrote {names:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_rank_that_failed_first_is_blamed_not_the_lowest() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Rank 2 fails with 7 once everyone is up; ranks 0 and 1 notice within ~10 ms and exit 1
    // a few ms later, as if their collective had broken. Polling the ranks in order every
    // 20 ms would usually see ranks 0 and 2 dead together and blame rank 0.
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
        if [ \"$RANK\" = 2 ]; then \
          while [ ! -f \"$0/pid.0\" ] || [ ! -f \"$0/pid.1\" ]; do sleep 0.01; done; \
          : > \"$0/dying\"; exit 7; \
        fi; \
        while [ ! -f \"$0/dying\" ]; do sleep 0.01; done; sleep 0.005; exit 1";
    let dir_arg = dir.path().to_str().expect("utf-8 tempdir");
    for _ in 0..3 {
        let _ = std::fs::remove_file(dir.path().join("dying"));
        for r in 0..3 {
            let _ = std::fs::remove_file(dir.path().join(format!("pid.{r}")));
        }
        let (out, _) = run_with_limit(
            launcher().args(["launch", "-n", "3", "sh", "-c", script, dir_arg]),
            Duration::from_secs(15),
        );
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(7), "stderr: {stderr}");
        assert!(
            stderr.contains("rank 2 (pid") && stderr.contains("exited with code 7"),
            "{stderr}"
        );
        assert!(!stderr.contains("rank 0 (pid"), "{stderr}");
    }
}

#[test]
fn a_worker_killed_with_sigkill_takes_the_group_down_within_5_seconds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    let mut child = launcher()
        .args(["launch", "-n", "3", "sh", "-c", script])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the launcher");
    let _launcher_guard = KillOnDrop(vec![i32::try_from(child.id()).expect("pid")]);
    wait_for_files(dir.path(), &["pid.0", "pid.1", "pid.2"]);
    let pids = read_pids(dir.path(), &[0, 1, 2]);
    let _guard = KillOnDrop(pids.clone());
    let start = Instant::now();
    kill(Pid::from_raw(pids[1]), Signal::SIGKILL).expect("kill rank 1");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "launcher still running 5 s after the SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        std::io::Read::read_to_string(&mut pipe, &mut stderr).expect("read stderr");
    }
    assert_eq!(status.code(), Some(137), "stderr: {stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGKILL"),
        "{stderr}"
    );
    for pid in [pids[0], pids[2]] {
        assert!(!alive(pid), "worker {pid} is still running");
    }
}
