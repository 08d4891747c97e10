//! Two `accelerate-rs launch` instances on loopback acting as two machines
//! (`--num-machines 2 --machine-rank 0/1`) form ONE 4-rank world and run real DDP training.
//!
//! The workers re-run this test binary: `multinode_worker` does nothing unless
//! `ACCEL_MULTINODE_ROLE` is set.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::{Accelerator, Error};
use candle_core::{Device, Tensor};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::common::tiny::{max_abs_diff, params, reference, snapshot, train, HIDDEN};
use crate::common::{exit_worker, free_port};

const B: usize = 4; // per-rank batch
const K: usize = 5; // SGD steps
const WORLD: usize = 4;
const SECRET: &str = "multinode-test-secret-0123456789abcdef";

fn env_usize(var: &str) -> accelerate_rs::Result<usize> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::invalid(var, "unset or not a number"))
}

fn worker() -> accelerate_rs::Result<()> {
    let acc = Accelerator::new()?;
    let (rank, world) = (acc.rank(), acc.world_size());
    if world != WORLD || rank != env_usize("RANK")? || acc.local_rank() != env_usize("LOCAL_RANK")?
    {
        return Err(Error::invalid(
            "world",
            format!("rank {rank} of {world}, local rank {}", acc.local_rank()),
        ));
    }
    println!(
        "multinode rank={rank} world={world} local={} node={}",
        acc.local_rank(),
        env_usize("ACCELERATE_RS_NODE_RANK")?
    );
    let p = params(rank as f32 * 0.25, HIDDEN);
    // The data set has WORLD * B * K rows (world == WORLD was checked above).
    train(&acc, &p, B, K)?;
    let dir = std::env::var("ACCEL_MULTINODE_OUT").map_err(|_| Error::invalid("OUT", "unset"))?;
    let out = Path::new(&dir).join(format!("rank_{rank}.safetensors"));
    candle_core::safetensors::save(&snapshot(&p), out)?;
    acc.wait_for_everyone()?;
    Ok(())
}

#[test]
fn multinode_worker() {
    if std::env::var("ACCEL_MULTINODE_ROLE").is_err() {
        return;
    }
    exit_worker(worker());
}

/// Starts the launcher of "machine" `machine_rank`.
fn start_machine(machine_rank: usize, port: u16, out: &Path) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(crate::common::launcher());
    for var in [
        "RUST_LOG",
        "RAYON_NUM_THREADS",
        "OMP_NUM_THREADS",
        "ACCELERATE_RS_CONFIG_FILE",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("XDG_CONFIG_HOME", "/nonexistent/accelerate-rs-test-config")
        .env("ACCELERATE_RS_SECRET", SECRET)
        .env("ACCEL_MULTINODE_ROLE", "train")
        .env("ACCEL_MULTINODE_OUT", out)
        .args(["launch", "--cpu", "-n", "2", "--num-machines", "2"])
        .args(["--machine-rank", &machine_rank.to_string()])
        .args(["--main-process-ip", "127.0.0.1"])
        .args(["--main-process-port", &port.to_string()])
        .args(["--collective-timeout-secs", "30", "--"])
        .arg(exe)
        .args([
            "--exact",
            "multinode::multinode_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn().expect("start a launcher")
}

/// Waits for both launchers (SIGTERM, then SIGKILL, to any still running after `limit`: the
/// launcher stops its own workers on SIGTERM).
fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let start = Instant::now();
    let pids: Vec<Pid> = children
        .iter()
        .map(|c| Pid::from_raw(i32::try_from(c.id()).unwrap()))
        .collect();
    let watchdog = std::thread::spawn(move || {
        while start.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(50));
            if pids.iter().all(|p| kill(*p, None).is_err()) {
                return;
            }
        }
        for p in &pids {
            let _ = kill(*p, Signal::SIGTERM);
        }
        std::thread::sleep(Duration::from_secs(4));
        for p in &pids {
            let _ = kill(*p, Signal::SIGKILL);
        }
    });
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for a launcher"))
        .collect();
    // The watchdog notices that both are gone (reaped pids fail `kill(pid, 0)`).
    let _ = watchdog.join();
    assert!(
        start.elapsed() < limit,
        "the launchers ran past {limit:?}: {}",
        describe(&outputs)
    );
    outputs
}

fn describe(outputs: &[Output]) -> String {
    outputs
        .iter()
        .enumerate()
        .map(|(m, o)| {
            format!(
                "--- machine {m}: {}\nstdout:\n{}\nstderr:\n{}\n",
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .collect()
}

/// Runs the two launchers (`machine1_first`: machine 1's starts a second before machine 0's)
/// and checks one 4-rank world trained to the single-process reference.
fn two_machines(machine1_first: bool) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let children = if machine1_first {
        let m1 = start_machine(1, port, dir.path());
        std::thread::sleep(Duration::from_secs(1));
        let m0 = start_machine(0, port, dir.path());
        vec![m0, m1]
    } else {
        vec![
            start_machine(0, port, dir.path()),
            start_machine(1, port, dir.path()),
        ]
    };
    let outputs = wait_all(children, Duration::from_secs(40));
    let all = describe(&outputs);
    for o in &outputs {
        assert!(o.status.success(), "a launcher failed:\n{all}");
    }
    // Each machine ran its two ranks: 0, 1 on machine 0 and 2, 3 on machine 1.
    for (m, o) in outputs.iter().enumerate() {
        let stdout = String::from_utf8_lossy(&o.stdout);
        for local in 0..2 {
            let rank = 2 * m + local;
            let want = format!("multinode rank={rank} world=4 local={local} node={m}");
            let prefix = format!("[rank {rank}] ");
            assert!(
                stdout
                    .lines()
                    .any(|l| l.starts_with(&prefix) && l.ends_with(&want)),
                "missing {want:?} from rank {rank}:\n{all}"
            );
        }
    }
    let results: Vec<HashMap<String, Tensor>> = (0..WORLD)
        .map(|r| {
            candle_core::safetensors::load(
                dir.path().join(format!("rank_{r}.safetensors")),
                &Device::Cpu,
            )
            .unwrap_or_else(|e| panic!("rank {r} wrote no parameters ({e}):\n{all}"))
        })
        .collect();
    for (r, p) in results.iter().enumerate() {
        assert_eq!(
            max_abs_diff(p, &results[0]),
            0.0,
            "rank {r} differs from rank 0"
        );
    }
    let single = reference(WORLD * B, K);
    let diff = max_abs_diff(&results[0], &single);
    assert!(diff <= 1e-5, "max abs diff to the reference {diff}");
    // Training moved the parameters, so the comparison means something.
    assert!(max_abs_diff(&snapshot(&params(0.0, HIDDEN)), &single) > 1e-3);
}

#[test]
fn two_launchers_on_loopback_form_one_4_rank_world_matching_the_reference() {
    two_machines(false);
}

#[test]
fn machine_1_started_before_machine_0_still_joins() {
    two_machines(true);
}
