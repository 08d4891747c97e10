//! End-to-end tests of `accelerate-rs launch` with real worker processes (`sh -c` scripts).

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::Error;
use accelerate_rs_cli::launch::{launch, LaunchOptions};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::free_port;

/// The launcher binary, with a clean logging / thread-count environment.
fn launcher() -> Command {
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
fn run_launch(args: &[&str]) -> (Output, Duration) {
    run_launch_env(args, &[])
}

/// [`run_launch`] with extra variables in the launcher's environment.
fn run_launch_env(args: &[&str], vars: &[(&str, &str)]) -> (Output, Duration) {
    let start = Instant::now();
    let out = launcher()
        .arg("launch")
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .expect("run the launcher");
    (out, start.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Lines of `stdout` grouped by rank (prefix removed); panics on a line without a prefix.
fn by_rank(stdout: &str) -> HashMap<usize, Vec<String>> {
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
fn kv(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn alive(pid: i32) -> bool {
    kill(Pid::from_raw(pid), None).is_ok()
}

/// Reads the pid files `pid.<rank>` the workers wrote into `dir`.
fn read_pids(dir: &Path, ranks: &[usize]) -> Vec<i32> {
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

const PRINT_ENV: &str = "echo R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE \
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
fn running(pid: i32) -> bool {
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
fn interrupt(dir: &Path, script: &str, signals: &[Signal], code: i32, name: &str) -> Duration {
    interrupt_with(&[], dir, script, signals, code, name).0
}

/// [`interrupt`] with extra launcher flags; also returns the launcher's stderr.
fn interrupt_with(
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
        Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "--num-processes"),
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
fn run_with_limit(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
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

fn wait_for_files(dir: &Path, names: &[&str]) {
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

#[test]
fn max_restarts_1_restarts_once_and_a_second_attempt_can_succeed() {
    // Rank 1 fails the first attempt only once rank 0 has printed its line (under load the
    // launcher could otherwise stop rank 0 before its shell ran `echo`).
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("rank0-started");
    let script = format!(
        "echo attempt=$ACCELERATE_RS_RESTART_COUNT port=$MASTER_PORT; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 0 ]; then touch '{f}'; fi; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then \
          i=0; while [ ! -e '{f}' ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi; \
        if [ \"$ACCELERATE_RS_RESTART_COUNT\" = 0 ]; then exec sleep 60; fi; exit 0",
        f = started.display()
    );
    let (out, elapsed) = run_with_limit(
        launcher().args([
            "launch",
            "--max-restarts",
            "1",
            "-n",
            "2",
            "sh",
            "-c",
            &script,
        ]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let lines = by_rank(&text(&out.stdout));
    for rank in 0..2 {
        let attempts: Vec<String> = lines[&rank]
            .iter()
            .map(|l| kv(l)["attempt"].clone())
            .collect();
        assert_eq!(attempts, ["0", "1"], "rank {rank}");
    }
    assert_eq!(
        stderr.matches("restarting the worker group").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("restart 1 of 1"), "{stderr}");
    assert!(
        stderr.contains("rank 1") && stderr.contains("exited with code 3"),
        "{stderr}"
    );
}

#[test]
fn max_restarts_1_gives_up_after_exactly_2_attempts() {
    let script = "echo attempt=$ACCELERATE_RS_RESTART_COUNT; \
        if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60";
    let (out, elapsed) = run_with_limit(
        launcher().args([
            "launch",
            "--max-restarts",
            "1",
            "-n",
            "2",
            "sh",
            "-c",
            script,
        ]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines[&1], ["attempt=0", "attempt=1"]);
    assert_eq!(
        stderr.matches("restarting the worker group").count(),
        1,
        "{stderr}"
    );
    assert_eq!(stderr.matches("exited with code 3;").count(), 2, "{stderr}");
    assert!(stderr.contains("giving up after 1 restart(s)"), "{stderr}");
}

#[test]
fn ctrl_c_is_never_followed_by_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = "echo $$ > \"$0/pid.$RANK.tmp\" && mv \"$0/pid.$RANK.tmp\" \"$0/pid.$RANK\"; \
                  exec sleep 60";
    let (_, stderr) = interrupt_with(
        &["--max-restarts", "3"],
        dir.path(),
        script,
        &[Signal::SIGINT],
        130,
        "SIGINT",
    );
    assert!(!stderr.contains("restarting"), "{stderr}");
}

#[test]
fn port_0_picks_a_free_port_and_a_busy_port_is_replaced_with_a_warning() {
    let (out, _) = run_launch(&[
        "--main-process-port",
        "0",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let p: u16 = kv(&by_rank(&text(&out.stdout))[&0][0])["P"]
        .parse()
        .expect("port");
    assert_ne!(p, 0);

    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port().to_string();
    let (out, _) = run_launch(&[
        "--main-process-port",
        &port,
        "-n",
        "2",
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "stderr: {stderr}");
    let lines = by_rank(&text(&out.stdout));
    let used = kv(&lines[&0][0])["P"].clone();
    assert_ne!(used, port);
    assert_eq!(kv(&lines[&1][0])["P"], used);
    assert!(
        stderr.contains("warning") && stderr.contains(&port) && stderr.contains(&used),
        "{stderr}"
    );

    // --quiet silences the warning but not the workers.
    let (out, _) = run_launch(&[
        "--quiet",
        "--main-process-port",
        &port,
        "sh",
        "-c",
        "echo P=$MASTER_PORT",
    ]);
    assert!(out.status.success());
    assert_eq!(text(&out.stderr), "");
    assert_ne!(kv(&by_rank(&text(&out.stdout))[&0][0])["P"], port);
    drop(busy);
}

#[test]
fn multi_machine_options_are_validated_naming_the_flag() {
    let busy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = busy.local_addr().expect("addr").port().to_string();
    let multi = |extra: &[&str], secret: Option<&str>| {
        let mut cmd = launcher();
        cmd.args(["launch", "--num-machines", "2", "-n", "1"])
            .args(extra)
            .args(["sh", "-c", "echo ran"]);
        if let Some(s) = secret {
            cmd.env("ACCELERATE_RS_SECRET", s);
        }
        let out = cmd.output().expect("run");
        assert!(!out.status.success(), "{extra:?} should fail");
        assert_eq!(text(&out.stdout), "", "{extra:?}: nothing may start");
        text(&out.stderr)
    };
    let ip = ["--main-process-ip", "127.0.0.1"];
    // Machine rank 0 with a busy port.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "0", "--main-process-port", &port],
        ]
        .concat(),
        Some("s3cret"),
    );
    assert!(
        err.contains(&format!("port {port}")) && err.contains("in use"),
        "{err}"
    );
    // No port.
    let err = multi(
        &[&ip[..], &["--machine-rank", "1"]].concat(),
        Some("s3cret"),
    );
    assert!(err.contains("--main-process-port"), "{err}");
    // No address.
    let err = multi(
        &["--machine-rank", "1", "--main-process-port", &port],
        Some("s"),
    );
    assert!(err.contains("--main-process-ip"), "{err}");
    // Machine rank out of range.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "2", "--main-process-port", &port],
        ]
        .concat(),
        Some("s"),
    );
    assert!(err.contains("--machine-rank"), "{err}");
    // No shared secret.
    let err = multi(
        &[
            &ip[..],
            &["--machine-rank", "1", "--main-process-port", &port],
        ]
        .concat(),
        None,
    );
    assert!(
        err.contains("export the same ACCELERATE_RS_SECRET on every machine"),
        "{err}"
    );
    drop(busy);
}

#[test]
fn dry_run_prints_every_worker_and_starts_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let marker = dir.path().join("created");
    let out = launcher()
        .env("ACCELERATE_RS_SECRET", "do-not-print-this-secret")
        .args([
            "launch",
            "--dry-run",
            "--cpu",
            "--mixed-precision",
            "bf16",
            "-n",
            "2",
            "sh",
            "-c",
        ])
        .arg(format!("touch {}", marker.display()))
        .output()
        .expect("run");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!marker.exists(), "the dry run started a worker");
    assert!(!stdout.contains("do-not-print-this-secret"), "{stdout}");
    assert_eq!(
        stdout.matches("ACCELERATE_RS_SECRET=<redacted>").count(),
        2,
        "{stdout}"
    );
    for needle in [
        "rank 0 (local rank 0)",
        "rank 1 (local rank 1)",
        "  RANK=0\n",
        "  RANK=1\n",
        "  WORLD_SIZE=2\n",
        "  LOCAL_WORLD_SIZE=2\n",
        "  MASTER_ADDR=127.0.0.1\n",
        "  ACCELERATE_RS_USE_CPU=1\n",
        "  ACCELERATE_RS_MIXED_PRECISION=bf16\n",
        "  command: sh -c 'touch ",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
}

const PRINT_SETTINGS: &str = "echo R=$RANK C=${ACCELERATE_RS_USE_CPU:-unset} \
    MP=${ACCELERATE_RS_MIXED_PRECISION:-unset} GA=${ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS:-unset} \
    TO=${ACCELERATE_RS_TIMEOUT_SECS:-unset} GPU=${CUDA_VISIBLE_DEVICES:-unset}";

#[test]
fn config_file_values_apply_and_flags_override_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("cfg.toml");
    std::fs::write(
        &cfg,
        "num_processes = 3\nuse_cpu = true\nmixed_precision = \"bf16\"\n\
         gradient_accumulation_steps = 4\ncollective_timeout_secs = 12.5\ngpu_ids = \"0,1\"\n",
    )
    .expect("write config");
    let cfg_arg = cfg.to_str().expect("utf-8 path");
    let (out, _) = run_launch(&["--config-file", cfg_arg, "sh", "-c", PRINT_SETTINGS]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines.len(), 3);
    let v = kv(&lines[&2][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("1", "bf16", "4", "12.5", "0,1")
    );

    // Through ACCELERATE_RS_CONFIG_FILE, with flags overriding.
    let out = launcher()
        .env("ACCELERATE_RS_CONFIG_FILE", &cfg)
        .args([
            "launch",
            "-n",
            "2",
            "--mixed-precision",
            "fp16",
            "--gradient-accumulation-steps",
            "2",
            "--collective-timeout-secs",
            "3",
            "--gpu-ids",
            "all",
            "sh",
            "-c",
            PRINT_SETTINGS,
        ])
        .output()
        .expect("run");
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let lines = by_rank(&text(&out.stdout));
    assert_eq!(lines.len(), 2);
    let v = kv(&lines[&1][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("1", "fp16", "2", "3", "unset")
    );

    // Without config or flags nothing extra is exported.
    let (out, _) = run_launch(&["sh", "-c", PRINT_SETTINGS]);
    let v = kv(&by_rank(&text(&out.stdout))[&0][0]);
    assert_eq!(
        (&*v["C"], &*v["MP"], &*v["GA"], &*v["TO"], &*v["GPU"]),
        ("unset", "unset", "unset", "unset", "unset")
    );
}

#[test]
fn a_malformed_config_file_is_reported_with_file_and_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (body, key) in [
        ("num_procs = 2\n", "num_procs"),
        ("num_processes = \"two\"\n", "num_processes"),
    ] {
        let cfg = dir.path().join("bad.toml");
        std::fs::write(&cfg, body).expect("write config");
        let (out, _) = run_launch(&[
            "--config-file",
            cfg.to_str().expect("utf-8"),
            "sh",
            "-c",
            "echo ran",
        ]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert_eq!(text(&out.stdout), "");
        assert!(stderr.contains(cfg.to_str().expect("utf-8")), "{stderr}");
        assert!(stderr.contains(key), "{stderr}");
    }
}

#[test]
fn tee_writes_per_rank_log_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path().join("logs");
    let script = "echo out $RANK a; echo err $RANK >&2; echo out $RANK b";
    let (out, _) = run_launch(&[
        "--tee",
        "--log-dir",
        logs.to_str().expect("utf-8"),
        "-n",
        "2",
        "sh",
        "-c",
        script,
    ]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    for rank in 0..2 {
        let read = |name: String| std::fs::read_to_string(logs.join(name)).expect("log file");
        assert_eq!(
            read(format!("rank_{rank}.stdout.log")),
            format!("out {rank} a\nout {rank} b\n")
        );
        assert_eq!(
            read(format!("rank_{rank}.stderr.log")),
            format!("err {rank}\n")
        );
    }
    // The terminal still gets everything.
    assert_eq!(by_rank(&text(&out.stdout))[&1], ["out 1 a", "out 1 b"]);

    // --tee alone: a default directory under the working directory, printed.
    let out = launcher()
        .current_dir(dir.path())
        .args(["launch", "--tee", "sh", "-c", "echo hello"])
        .output()
        .expect("run");
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("accelerate-rs-logs"), "{stderr}");
    let base = dir.path().join("accelerate-rs-logs");
    let run_dir = std::fs::read_dir(&base)
        .expect("default log dir")
        .next()
        .expect("one run")
        .expect("entry")
        .path();
    assert_eq!(
        std::fs::read_to_string(run_dir.join("rank_0.stdout.log")).expect("log"),
        "hello\n"
    );
}

#[test]
fn the_failing_ranks_last_lines_are_shown_again_at_the_end() {
    // Rank 1 prints 30 lines and fails; rank 0 keeps printing noise until it is stopped.
    let script = "if [ \"$RANK\" = 1 ]; then \
          i=0; while [ $i -lt 30 ]; do echo \"line $i\"; i=$((i+1)); done; \
          sleep 0.05; echo 'Traceback: boom' >&2; sleep 0.1; exit 2; \
        fi; while :; do echo noise; sleep 0.01; done";
    let (out, _) = run_with_limit(
        launcher().args(["launch", "-n", "2", "sh", "-c", script]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let (_, report) = stderr
        .split_once("last 20 line(s) of rank 1's output:")
        .unwrap_or_else(|| panic!("no tail in {stderr}"));
    let tail: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("  [rank 1] "))
        .collect();
    let expected: Vec<String> = (11..30)
        .map(|i| format!("line {i}"))
        .chain(["Traceback: boom".to_string()])
        .collect();
    assert_eq!(tail, expected, "{stderr}");
}

#[test]
fn the_error_line_is_reprinted_even_when_a_backtrace_follows_it() {
    // What `main` returning `Err` prints under RUST_BACKTRACE=1: the error, then a long trace.
    let script = "if [ \"$RANK\" = 1 ]; then \
          echo 'Error: data: shard 7 is truncated' >&2; echo '' >&2; \
          echo 'Stack backtrace:' >&2; i=0; while [ $i -lt 40 ]; do \
          echo \"  $i: std::rt::lang_start\" >&2; i=$((i+1)); done; exit 1; \
        fi; sleep 30";
    let (out, _) = run_with_limit(
        launcher().args(["launch", "-n", "2", "sh", "-c", script]),
        Duration::from_secs(15),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let (_, report) = stderr
        .split_once("of rank 1's output:")
        .unwrap_or_else(|| panic!("no tail in {stderr}"));
    let shown: Vec<&str> = report
        .lines()
        .filter_map(|l| l.strip_prefix("  [rank 1] "))
        .collect();
    assert_eq!(shown[0], "Error: data: shard 7 is truncated", "{stderr}");
    assert!(shown[1].contains("more line(s)"), "{stderr}");
    assert_eq!(shown.last().copied(), Some("  39: std::rt::lang_start"));
}

#[test]
fn a_launch_without_cpu_on_a_machine_without_gpus_says_it_runs_on_the_cpu() {
    let gpus = std::fs::read_dir("/proc/driver/nvidia/gpus").map_or(0, |d| d.count());
    if gpus > 0 {
        eprintln!("skipping: this machine has {gpus} GPU(s)");
        return;
    }
    let (out, _) = run_launch(&["-n", "2", "sh", "-c", "true"]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("no GPU found") && stderr.contains("2 worker(s) will run on the CPU"),
        "{stderr}"
    );
    assert!(stderr.contains("--cpu"), "{stderr}");
    // Hidden GPUs count as none, whatever the machine has.
    let (out, _) = run_launch_env(&["sh", "-c", "true"], &[("CUDA_VISIBLE_DEVICES", "")]);
    assert!(
        text(&out.stderr).contains("no GPU found"),
        "{}",
        text(&out.stderr)
    );
    // Said so, or --quiet: no notice.
    for flags in [&["--cpu"][..], &["--quiet"][..]] {
        let mut args = flags.to_vec();
        args.extend(["-n", "2", "sh", "-c", "true"]);
        let (out, _) = run_launch(&args);
        assert!(
            !text(&out.stderr).contains("no GPU"),
            "{flags:?}: {}",
            text(&out.stderr)
        );
    }
}

/// Every numeric flag of `launch`, given absurd values: a clear error naming the flag (or a
/// valid run of `--dry-run`), never a panic.
#[test]
fn absurd_numbers_in_every_flag_are_errors_not_panics() {
    let flags = [
        "-n",
        "--num-machines",
        "--machine-rank",
        "--main-process-port",
        "--gradient-accumulation-steps",
        "--collective-timeout-secs",
        "--max-restarts",
        "--monitor-interval",
        "--grace-period",
    ];
    let values = [
        "1e300",
        "1e19",
        "-1",
        "NaN",
        "inf",
        "18446744073709551616",
        "4294967296",
        "100000",
        "0",
        "",
        "abc",
    ];
    for flag in flags {
        for value in values {
            let out = launcher()
                .args(["launch", "--dry-run", "--cpu", flag, value, "true"])
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_ne!(out.status.code(), Some(101), "{flag} {value:?}: {stderr}");
            assert!(!stderr.contains("panicked"), "{flag} {value:?}: {stderr}");
            if !out.status.success() {
                let named = flag.trim_start_matches('-');
                assert!(
                    stderr.contains(named) || flag == "-n" && stderr.contains("num-processes"),
                    "{flag} {value:?}: the error does not name the flag: {stderr}"
                );
            }
        }
    }
}
