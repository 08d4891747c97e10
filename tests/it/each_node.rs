//! `save_on_each_node`: two "machines" on loopback (two launchers, `--num-machines 2`), each with
//! its own working directory standing for its own disk. With the option every machine's local
//! main process writes the checkpoint into its own directory and every rank resumes from its
//! machine's copy; without it only machine 0 has one.
//!
//! The workers re-run this test binary: `each_node::worker_entry` does nothing unless
//! `ACCEL_EACH_NODE` is set.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::checkpoint::{latest_checkpoint, CheckpointParts};
use accelerate_rs::Accelerator;

use crate::common::tiny::{params, snapshot, HIDDEN};

fn worker(each: bool) -> accelerate_rs::Result<()> {
    let acc = Accelerator::new()?;
    let p = params(0.25, HIDDEN);
    acc.prepare_model(&p)?;
    // A relative path: each machine's own disk (its working directory).
    acc.save_state_auto(
        "ckpts",
        &CheckpointParts::new(&p).save_on_each_node(each).step(3),
        0,
    )?;
    if each {
        let q = params(9.0, HIDDEN);
        let dir = latest_checkpoint("ckpts")?.ok_or_else(|| {
            accelerate_rs::Error::invalid(
                "ckpts",
                format!("rank {}: no checkpoint on this machine", acc.rank()),
            )
        })?;
        let m = acc.load_state(&dir, &q, None)?;
        let same = snapshot(&p).iter().all(|(k, v)| {
            (v - &snapshot(&q)[k])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                == 0.0
        });
        println!(
            "rank {} resumed step {} from its machine's copy: {same}",
            acc.rank(),
            m.step
        );
    }
    Ok(())
}

fn machine(rank: usize, port: u16, dir: &Path, each: bool) -> std::process::Child {
    Command::new(crate::common::launcher())
        .env_remove("RUST_LOG")
        .env("XDG_CONFIG_HOME", "/nonexistent/accelerate-rs-test-config")
        .env("ACCELERATE_RS_SECRET", "each-node-test")
        .env("ACCEL_EACH_NODE", if each { "1" } else { "0" })
        .args(["launch", "--cpu", "-n", "2", "--num-machines", "2"])
        .args(["--machine-rank", &rank.to_string()])
        .args([
            "--main-process-ip",
            "127.0.0.1",
            "--main-process-port",
            &port.to_string(),
        ])
        .args(["--collective-timeout-secs", "30", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "each_node::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn run(each: bool) -> (tempfile::TempDir, tempfile::TempDir, String) {
    let (d0, d1) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let port = crate::common::free_port();
    let start = Instant::now();
    let kids = [
        machine(0, port, d0.path(), each),
        machine(1, port, d1.path(), each),
    ];
    let outs: Vec<Output> = kids
        .into_iter()
        .map(|k| k.wait_with_output().unwrap())
        .collect();
    assert!(start.elapsed() < Duration::from_secs(60));
    let text: String = outs
        .iter()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .collect();
    assert!(outs.iter().all(|o| o.status.success()), "{text}");
    (d0, d1, text)
}

#[test]
fn every_machine_writes_and_resumes_from_its_own_copy() {
    let (d0, d1, text) = run(true);
    for d in [&d0, &d1] {
        assert!(
            d.path().join("ckpts/checkpoint_0/manifest.json").is_file(),
            "{text}"
        );
    }
    assert_eq!(
        text.matches("from its machine's copy: true").count(),
        4,
        "{text}"
    );
    // Without the option only machine 0 writes.
    let (d0, d1, text) = run(false);
    assert!(
        d0.path().join("ckpts/checkpoint_0/manifest.json").is_file(),
        "{text}"
    );
    assert!(!d1.path().join("ckpts").exists(), "{text}");
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(each) = std::env::var("ACCEL_EACH_NODE") else {
        return;
    };
    crate::common::exit_worker(worker(each == "1"))
}
