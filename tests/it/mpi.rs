//! The MPI backend (`--features mpi`), under a real `mpirun`: the collective reference suites for
//! 1 to 5 ranks, and an accelerator that finds MPI by itself (no MASTER_ADDR) and trains like
//! the plain single-process reference.
//!
//! The workers are this test binary re-run by `mpirun`: `mpi::worker_entry` does nothing unless
//! `ACCEL_MPI_ROLE` is set.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::tiny;
use accelerate_rs::collective::{Collective, MpiCollective};
use accelerate_rs::Accelerator;

const ROLE_VAR: &str = "ACCEL_MPI_ROLE";

/// `mpirun -n <n>` running [`worker_entry`] in `role`; stdout and stderr together. Open MPI
/// needs to be told that running as root (CI containers) and more ranks than cores are fine.
fn mpirun(n: usize, role: &str) -> (bool, String) {
    let version = Command::new("mpirun")
        .arg("--version")
        .output()
        .expect("mpirun is not installed (Debian: openmpi-bin)");
    let open_mpi = String::from_utf8_lossy(&version.stdout).contains("Open MPI");
    let mut cmd = Command::new("mpirun");
    if open_mpi {
        cmd.args(["--allow-run-as-root", "--oversubscribe"]);
    }
    cmd.args(["-n", &n.to_string()])
        .args(["-x", ROLE_VAR, "-x", "RAYON_NUM_THREADS"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mpi::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, role)
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let child = cmd.spawn().unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(300));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn mpi_matches_reference_for_world_1_to_5() {
    for n in 1..=5 {
        let (ok, text) = mpirun(n, "suite");
        assert!(ok, "{n} ranks:\n{text}");
        assert_eq!(text.matches("suite passed").count(), n, "{text}");
    }
}

#[test]
fn accelerator_picks_mpi_under_mpirun_and_trains_like_the_reference() {
    let (ok, text) = mpirun(2, "train");
    assert!(ok, "{text}");
    assert_eq!(text.matches("backend=mpi trained").count(), 2, "{text}");
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    match role.as_str() {
        "suite" => {
            let c = MpiCollective::connect(None).unwrap();
            crate::collectives::full_suite(&c);
            crate::collectives::big_random_suite(&c);
            crate::collectives::scatter_gather_all_dtypes(&c);
            // Mismatched lengths are reported on every rank, not a hang.
            if c.world_size() > 1 {
                let mut v = vec![1f32; 3 + c.rank()];
                let e = c
                    .all_reduce((&mut v[..]).into(), accelerate_rs::ReduceOp::Sum)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("all_reduce") && e.contains("elements"), "{e}");
            }
            println!("rank {} suite passed", c.rank());
        }
        "train" => {
            let acc = Accelerator::new().unwrap();
            let (batch, steps) = (4, 5);
            let p = tiny::params(0.1 * acc.rank() as f32, tiny::HIDDEN);
            tiny::train(&acc, &p, batch, steps).unwrap();
            let want = tiny::reference(batch * acc.world_size(), steps);
            let d = tiny::max_abs_diff(&tiny::snapshot(&p), &want);
            assert!(d < 1e-5, "differs from the reference by {d}");
            println!("backend={} trained", acc.collective().backend());
        }
        other => panic!("unknown role {other}"),
    }
}
