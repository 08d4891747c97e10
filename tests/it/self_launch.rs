//! The self-launch (`ACCELERATE_RS_NUM_PROCESSES=N`, `AcceleratorBuilder::processes`): a program
//! started on its own runs as N real processes, no launcher binary involved.
//!
//! The program is this test binary itself: the tests start it on `self_launch::worker_entry`
//! (which does nothing unless `ACCEL_SELF_LAUNCH` is set), that process becomes the parent of N
//! copies of itself, and each copy runs `worker_entry` again as a worker.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::{Accelerator, ReduceOp};
use candle_core::Tensor;

const ON: &str = "ACCEL_SELF_LAUNCH";
/// The rank that fails (exit code 7, after an `Error:` line and a long "backtrace").
const FAIL_RANK: &str = "ACCEL_SELF_LAUNCH_FAIL";
/// The ranks sleep this long before finishing (to be interrupted or killed meanwhile).
const SLEEP: &str = "ACCEL_SELF_LAUNCH_SLEEP";
/// Directory the workers write `pid.<rank>` into.
const PIDS: &str = "ACCEL_SELF_LAUNCH_PIDS";

#[test]
fn worker_entry() {
    if std::env::var_os(ON).is_none() {
        return;
    }
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    if let Some(dir) = std::env::var_os(PIDS) {
        let dir = std::path::PathBuf::from(dir);
        std::fs::write(
            dir.join(format!("pid.{}", acc.rank())),
            std::process::id().to_string(),
        )
        .unwrap();
    }
    let one = Tensor::new(&[1f32 + acc.rank() as f32], acc.device()).unwrap();
    let sum = acc
        .reduce(&one, ReduceOp::Sum)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0];
    println!(
        "worker rank={} world={} local={} sum={sum}",
        acc.rank(),
        acc.world_size(),
        acc.local_rank()
    );
    if let Ok(secs) = std::env::var(SLEEP) {
        std::thread::sleep(Duration::from_secs(secs.parse().unwrap()));
    }
    if std::env::var(FAIL_RANK).ok() == Some(acc.rank().to_string()) {
        eprintln!("Error: rank {} cannot read its shard", acc.rank());
        eprintln!("\nStack backtrace:");
        for i in 0..40 {
            eprintln!("  {i}: some::frame::of::the::backtrace");
        }
        std::process::exit(7);
    }
    // The others wait for the failed rank in a collective: they fail or are stopped.
    acc.wait_for_everyone().unwrap();
}

/// This test binary started on `worker_entry` with `N` processes asked for.
fn parent(n: usize) -> Command {
    let mut cmd = test_parent("self_launch::worker_entry", n);
    cmd.env(ON, "1");
    cmd
}

/// This test binary started on the test `entry` (module-qualified) with `N` processes asked for
/// through `ACCELERATE_RS_NUM_PROCESSES`: it becomes the parent of `N` copies of itself.
pub(crate) fn test_parent(entry: &str, n: usize) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", entry, "--nocapture", "--test-threads=1"])
        .env("ACCELERATE_RS_NUM_PROCESSES", n.to_string())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("RUST_LOG")
        .env_remove("ACCELERATE_RS_SECRET")
        .stdin(Stdio::null());
    cmd
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn two_and_three_processes_run_with_prefixed_lines() {
    for n in [2usize, 3] {
        let out = parent(n).output().unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{n} processes:\n{stdout}\n{stderr}");
        let total: usize = (1..=n).sum();
        // (The test harness prints `test ... ` before the worker's line, on the same line.)
        for rank in 0..n {
            let want = format!("worker rank={rank} world={n} local={rank} sum={total}");
            let prefix = format!("[rank {rank}] ");
            assert!(
                stdout
                    .lines()
                    .any(|l| l.starts_with(&prefix) && l.ends_with(&want)),
                "{n} processes, no {want:?} from rank {rank} in:\n{stdout}"
            );
        }
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.contains("worker rank="))
                .count(),
            n,
            "{stdout}"
        );
        assert!(
            stderr.contains(&format!("starting {n} processes")),
            "{stderr}"
        );
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_its_code_and_error_line_come_back() {
    let start = Instant::now();
    let out = parent(3).env(FAIL_RANK, "1").output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(7), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("rank 1 (pid") && stderr.contains("exited with code 7"),
        "{stderr}"
    );
    // The error line is reprinted although 40 backtrace lines followed it.
    let report = stderr
        .split("last lines of rank 1's output:")
        .nth(1)
        .unwrap_or_else(|| panic!("no report in:\n{stderr}"));
    assert!(
        report.contains("[rank 1] Error: rank 1 cannot read its shard"),
        "{report}"
    );
    assert!(report.contains("more line(s)"), "{report}");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}

fn read_pids(dir: &std::path::Path, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pids: Vec<i32> = (0..n)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("pid.{r}"))).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if pids.len() == n {
            return pids;
        }
        assert!(Instant::now() < deadline, "workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn gone(pid: i32) -> bool {
    // Reaped by their parent (or by init once orphaned): no such process, or a zombie.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

fn wait_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !pids.iter().all(|&p| gone(p)) {
        assert!(Instant::now() < deadline, "workers still alive: {pids:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn ctrl_c_stops_the_workers_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let child = parent(2)
        .env(SLEEP, "120")
        .env(PIDS, dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pids = read_pids(dir.path(), 2);
    let parent_pid = i32::try_from(child.id()).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(parent_pid),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_gone(&pids);
}

#[test]
fn workers_die_with_a_parent_killed_by_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = parent(2)
        .env(SLEEP, "120")
        .env(PIDS, dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pids = read_pids(dir.path(), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    wait_gone(&pids);
}
