//! Resume at a different world size, sample-exact: a run checkpointed mid-epoch on 4 processes
//! resumes on 2 (and one on 2 resumes on 3) and sees exactly the samples of the epoch it had not
//! reached, each once: the position is saved in global samples
//! (`CheckpointParts::samples`, `DataLoader::resume_from`), not in per-rank batches.
//!
//! The workers re-run this test binary under `accelerate-rs launch`: `elastic::worker_entry`
//! does nothing unless `ACCEL_ELASTIC_ROOT` is set.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use accelerate_rs::checkpoint::{latest_checkpoint, read_manifest, CheckpointParts};
use accelerate_rs::{Accelerator, DataLoader, Error, TensorDataset};
use candle_core::{Device, Tensor};

use crate::common::tiny::{params, HIDDEN};

const ROOT_VAR: &str = "ACCEL_ELASTIC_ROOT";
const SAMPLES: usize = 48;
const BATCH: usize = 2; // per rank

/// Phase 1 (`stop_after = Some(k)`): k batches of epoch 0, checkpoint, stop. Phase 2: resume
/// from the checkpoint and finish the epoch. Every sample id seen is printed as `seen <id>`.
fn worker(root: &Path, stop_after: Option<usize>) -> accelerate_rs::Result<()> {
    let acc = Accelerator::new()?;
    let p = params(0.0, HIDDEN);
    acc.prepare_model(&p)?;
    let ids = Tensor::arange(0u32, SAMPLES as u32, &Device::Cpu)?;
    let loader = DataLoader::new(TensorDataset::new(vec![ids])?, BATCH)
        .shuffle(true)
        .seed(11);
    let mut loader = acc.prepare_data_loader(loader)?;
    if stop_after.is_none() {
        let dir =
            latest_checkpoint(root)?.ok_or_else(|| Error::invalid("root", "no checkpoint"))?;
        let m = acc.load_state(&dir, &p, None)?;
        let pos = m
            .samples
            .ok_or_else(|| Error::invalid("manifest", "no sample position"))?;
        println!("resuming at {} samples", pos.samples);
        loader.resume_from(pos);
    }
    let mut done = 0;
    for b in loader.iter()? {
        let b = b?;
        for id in b[0].to_vec1::<u32>()? {
            println!("seen {id}");
        }
        done += 1;
        if Some(done) == stop_after {
            let parts = CheckpointParts::new(&p).samples(loader.sample_position(done));
            acc.save_state_auto(root, &parts, 0)?;
            return Ok(());
        }
    }
    Ok(())
}

fn launch(n: usize, root: &Path, stop_after: Option<usize>) -> BTreeMap<u32, usize> {
    let mut cmd = Command::new(crate::common::launcher());
    cmd.args(["launch", "--cpu", "-n", &n.to_string()])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "elastic::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROOT_VAR, root)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    if let Some(k) = stop_after {
        cmd.env("ACCEL_ELASTIC_STOP", k.to_string());
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{n} processes:\n{text}");
    let mut seen = BTreeMap::new();
    for id in text.lines().filter_map(|l| l.split("seen ").nth(1)) {
        *seen.entry(id.trim().parse::<u32>().unwrap()).or_insert(0) += 1;
    }
    seen
}

fn resume_elsewhere(before: usize, after: usize, stop_after: usize) {
    let dir = tempfile::tempdir().unwrap();
    let first = launch(before, dir.path(), Some(stop_after));
    assert_eq!(first.values().sum::<usize>(), before * BATCH * stop_after);
    let m = read_manifest(latest_checkpoint(dir.path()).unwrap().unwrap()).unwrap();
    assert_eq!(
        m.samples.unwrap().samples as usize,
        before * BATCH * stop_after
    );
    let second = launch(after, dir.path(), None);
    // Together: every sample of the epoch exactly once.
    let mut all = first.clone();
    for (id, k) in &second {
        assert!(
            !first.contains_key(id),
            "sample {id} seen again after resuming {before} -> {after}"
        );
        *all.entry(*id).or_insert(0) += k;
    }
    assert_eq!(all.len(), SAMPLES, "{before} -> {after}: {all:?}");
    assert!(
        all.values().all(|&k| k == 1),
        "{before} -> {after}: {all:?}"
    );
}

#[test]
fn a_checkpoint_from_4_processes_resumes_on_2_seeing_each_unseen_sample_once() {
    resume_elsewhere(4, 2, 3);
}

#[test]
fn a_checkpoint_from_2_processes_resumes_on_3_seeing_each_unseen_sample_once() {
    resume_elsewhere(2, 3, 3);
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(root) = std::env::var(ROOT_VAR) else {
        return;
    };
    let stop = std::env::var("ACCEL_ELASTIC_STOP")
        .ok()
        .map(|s| s.parse().unwrap());
    crate::common::exit_worker(worker(Path::new(&root), stop))
}
