//! Checkpoints: save_state / load_state / save_state_auto / latest_checkpoint / save_model, and
//! mid-epoch resume through `DataLoader::resume_at`.
//!
//! The multi-process tests re-run this test binary as the workers under
//! `accelerate-rs launch --cpu -n 2`: `checkpoint_worker` does nothing unless `ACCEL_TEST_ROLE`
//! is set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use accelerate_rs::checkpoint::{latest_checkpoint, CheckpointParts};
use accelerate_rs::checkpoint::{read_manifest, LoaderPosition};
use accelerate_rs::optim::AdamW;
use accelerate_rs::scheduler::{LinearWarmupCosine, Schedule};
use accelerate_rs::{Accelerator, DataLoader, Error};
use candle_core::{Device, Tensor, Var};
use candle_nn::loss;

use crate::common::exit_worker;
use crate::common::single;
use crate::common::tiny::{dataset, forward, params, snapshot, HIDDEN};

const B: usize = 4; // per-rank batch
const ROWS: usize = 40; // 5 global batches of 8 per epoch
const EPOCHS: u64 = 3;
const TOTAL: u64 = 15; // optimizer steps in all
const CKPT_AT: u64 = 7; // epoch 1, after its 2nd batch: mid-epoch

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Train all steps without stopping.
    Full,
    /// Train up to `CKPT_AT`, checkpoint, stop.
    FirstHalf,
    /// Resume from the latest checkpoint and finish.
    Resume,
}

fn env_path(var: &str) -> accelerate_rs::Result<PathBuf> {
    std::env::var(var)
        .map(PathBuf::from)
        .map_err(|_| Error::invalid(var, "unset"))
}

/// Trains the tiny model with AdamW, a warmup-cosine schedule and a shuffled loader over several
/// epochs; in `Full` and `Resume` mode the main process saves the final parameters to `out`.
fn train(acc: &Accelerator, mode: Mode, root: &Path, out: &Path) -> accelerate_rs::Result<()> {
    let p = params(acc.rank() as f32 * 0.25, HIDDEN);
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let opt = AdamW::new_lr(vars, 0.01)?;
    let loader = DataLoader::new(dataset(ROWS), B).shuffle(true).seed(7);
    let (mut opt, mut loader) = acc.prepare(&p, opt, loader)?;
    let mut sched = Schedule::new(LinearWarmupCosine::new(0.01, 3, TOTAL, 0.001)?);
    let mut step = 0u64;
    let mut first_epoch = 0;
    if mode == Mode::Resume {
        let dir = latest_checkpoint(root)?
            .ok_or_else(|| Error::invalid("checkpoint root", "no checkpoint to resume"))?;
        let m = acc.load_state(&dir, &p, Some(&mut opt))?;
        step = m.step;
        sched.set_step(m.schedule_step.unwrap_or(step));
        let pos = m
            .loader
            .ok_or_else(|| Error::invalid("manifest", "no loader position"))?;
        loader.resume_at(pos.epoch, pos.batches_done);
        first_epoch = pos.epoch;
    }
    for epoch in first_epoch..EPOCHS {
        loader.set_epoch(epoch);
        for b in loader.iter()? {
            let b = b?;
            sched.step(&mut opt);
            let loss = loss::cross_entropy(&forward(&p, &b[0])?, &b[1])?;
            opt.backward_step(&loss)?;
            step += 1;
            if mode == Mode::FirstHalf && step == CKPT_AT {
                let parts = CheckpointParts::new(&p)
                    .optimizer(&opt)
                    .schedule_step(sched.current_step())
                    .loader(LoaderPosition {
                        epoch,
                        batches_done: b.index() + 1,
                    })
                    .step(step)
                    .extra("note", "mid-epoch");
                acc.save_state_auto(root, &parts, 2)?;
                return Ok(());
            }
        }
    }
    if step != TOTAL {
        return Err(Error::invalid(
            "steps",
            format!("{step} instead of {TOTAL}"),
        ));
    }
    acc.save_model(out, &p)
}

fn worker(role: &str) -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let root = env_path("ACCEL_TEST_ROOT")?;
    let out = env_path("ACCEL_TEST_OUT")?;
    match role {
        "full" => train(&acc, Mode::Full, &root, &out),
        "first_half" => train(&acc, Mode::FirstHalf, &root, &out),
        "resume" => train(&acc, Mode::Resume, &root, &out),
        // Attempt 0 checkpoints and then dies; the launcher restarts every rank, which resume.
        "restart" => {
            let attempt: usize = std::env::var(accelerate_rs::env::RESTART_COUNT)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if attempt == 0 {
                train(&acc, Mode::FirstHalf, &root, &out)?;
                std::process::exit(17);
            }
            train(&acc, Mode::Resume, &root, &out)
        }
        other => Err(Error::invalid("ACCEL_TEST_ROLE", other.to_string())),
    }
}

#[test]
fn checkpoint_worker() {
    let Ok(role) = std::env::var("ACCEL_TEST_ROLE") else {
        return;
    };
    exit_worker(worker(&role));
}

fn launch(role: &str, root: &Path, out: &Path, extra: &[&str]) {
    let exe = std::env::current_exe().unwrap();
    let res = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", "2"])
        .args(extra)
        .arg(exe)
        .args([
            "--exact",
            "checkpoint::checkpoint_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_ROLE", role)
        .env("ACCEL_TEST_ROOT", root)
        .env("ACCEL_TEST_OUT", out)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "launch {role} failed:\n{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

fn bits(path: &Path) -> HashMap<String, Vec<u32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (k, v.into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

#[test]
fn two_process_resume_mid_epoch_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpts");
    let full = dir.path().join("full.safetensors");
    let resumed = dir.path().join("resumed.safetensors");
    launch("full", &root.join("unused"), &full, &[]);
    launch("first_half", &root, &resumed, &[]);
    let latest = latest_checkpoint(&root).unwrap().unwrap();
    assert_eq!(latest, root.join("checkpoint_0"));
    let m = read_manifest(&latest).unwrap();
    assert_eq!(m.step, CKPT_AT);
    assert_eq!(m.world_size, 2);
    assert_eq!(
        m.loader,
        Some(LoaderPosition {
            epoch: 1,
            batches_done: 2
        })
    );
    assert_eq!(m.optimizer.as_ref().unwrap().step, CKPT_AT);
    assert_eq!(m.extra["note"], "mid-epoch");
    assert!(!resumed.exists());
    launch("resume", &root, &resumed, &[]);
    let (a, b) = (bits(&full), bits(&resumed));
    assert_eq!(a.len(), 4);
    assert!(
        a == b,
        "resumed parameters differ from the uninterrupted run"
    );
    // Training moved the parameters.
    let init = snapshot(&params(0.0, HIDDEN));
    let w = init["fc1.weight"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let w: Vec<u32> = w.into_iter().map(f32::to_bits).collect();
    assert_ne!(a["fc1.weight"], w);
}

#[test]
fn killed_run_restarted_by_the_launcher_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.safetensors");
    let restarted = dir.path().join("restarted.safetensors");
    launch("full", &dir.path().join("unused"), &full, &[]);
    let root = dir.path().join("ckpts");
    launch("restart", &root, &restarted, &["--max-restarts", "1"]);
    assert!(bits(&full) == bits(&restarted));
}

// ---- single process ----

/// Named parameters with every value `v`.
fn filled(v: f32) -> Vec<(String, Var)> {
    params(0.0, HIDDEN)
        .into_iter()
        .map(|(n, var)| {
            let t = (var.as_tensor().zeros_like().unwrap() + v as f64).unwrap();
            (n, Var::from_tensor(&t).unwrap())
        })
        .collect()
}

fn value_of(p: &[(String, Var)]) -> f32 {
    p[0].1
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0]
}

#[test]
fn save_and_load_round_trip_with_optimizer() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let p = params(0.0, HIDDEN);
    let mut opt = AdamW::new_lr(p.iter().map(|(_, v)| v.clone()).collect(), 0.05).unwrap();
    let d = dataset(8);
    let l = loss::cross_entropy(&forward(&p, &d.tensors()[0]).unwrap(), &d.tensors()[1]).unwrap();
    candle_nn::Optimizer::backward_step(&mut opt, &l).unwrap();
    let ck = dir.path().join("ck");
    acc.save_state(&ck, &CheckpointParts::new(&p).optimizer(&opt).step(1))
        .unwrap();
    // Saving again over it replaces it atomically and leaves no `.old` or `.tmp-*`.
    acc.save_state(&ck, &CheckpointParts::new(&p).optimizer(&opt).step(2))
        .unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != accelerate_rs::checkpoint::LOCK_FILE)
        .collect();
    assert_eq!(names, vec!["ck".to_string()]);

    let q = filled(0.0);
    let mut opt2 = AdamW::new_lr(q.iter().map(|(_, v)| v.clone()).collect(), 0.9).unwrap();
    let m = acc.load_state(&ck, &q, Some(&mut opt2)).unwrap();
    assert_eq!(m.step, 2);
    assert_eq!(opt2.step_count(), 1);
    assert_eq!(opt2.state().unwrap().lr, 0.05);
    for ((_, a), (_, b)) in p.iter().zip(&q) {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
    }
    for ((_, a), (_, b)) in opt
        .state()
        .unwrap()
        .tensors
        .iter()
        .zip(&opt2.state().unwrap().tensors)
    {
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, b);
    }
}

#[test]
fn crash_mid_save_falls_back_to_the_last_complete_checkpoint() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let p = filled(1.0);
    acc.save_state_auto(root, &CheckpointParts::new(&p).step(1), 0)
        .unwrap();
    // A save killed after the model file: a partial tmp dir, never renamed.
    let partial = root.join("checkpoint_1.tmp-99999");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("model.safetensors"), b"garbage").unwrap();
    // And a final-looking directory without a manifest (never produced by save, but be safe).
    std::fs::create_dir_all(root.join("checkpoint_2")).unwrap();
    let latest = latest_checkpoint(root).unwrap().unwrap();
    assert_eq!(latest, root.join("checkpoint_0"));
    let q = filled(0.0);
    let m = acc.load_state(&latest, &q, None).unwrap();
    assert_eq!(m.step, 1);
    assert_eq!(value_of(&q), 1.0);

    // A crash between the two renames of a save over an existing dir: only `<dir>.old` is left.
    let ck = root.join("fixed");
    acc.save_state(&ck, &CheckpointParts::new(&p).step(5))
        .unwrap();
    std::fs::rename(&ck, root.join("fixed.old")).unwrap();
    let q = filled(0.0);
    assert_eq!(acc.load_state(&ck, &q, None).unwrap().step, 5);
    assert_eq!(value_of(&q), 1.0);
    let err = acc
        .load_state(root.join("nothing"), &q, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("manifest.json is missing"), "{err}");
}

#[test]
fn crash_hook_in_a_real_process_leaves_the_previous_checkpoint() {
    // The worker is this binary: first a complete checkpoint, then one that dies mid-save.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpts");
    let exe = std::env::current_exe().unwrap();
    let run = |crash: Option<&str>| {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--exact",
            "checkpoint::single_save_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_SINGLE_ROOT", &root);
        if let Some(f) = crash {
            cmd.env("ACCELERATE_RS_TEST_CRASH_AFTER", f);
        }
        cmd.status().unwrap()
    };
    assert!(run(None).success());
    let status = run(Some("optimizer.safetensors"));
    assert_eq!(status.code(), Some(3));
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert_eq!(leftovers.len(), 1, "the killed save leaves its tmp dir");
    let latest = latest_checkpoint(&root).unwrap().unwrap();
    assert_eq!(latest, root.join("checkpoint_0"));
    let q = filled(0.0);
    let vars: Vec<Var> = q.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = AdamW::new_lr(vars, 0.1).unwrap();
    single().load_state(&latest, &q, Some(&mut opt)).unwrap();
    assert_eq!(value_of(&q), 2.0);
    // The next auto save cleans the leftover up and takes the next number.
    assert!(run(None).success());
    assert_eq!(
        latest_checkpoint(&root).unwrap().unwrap(),
        root.join("checkpoint_1")
    );
    assert!(!std::fs::read_dir(&root).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".tmp-")));
}

#[test]
fn single_save_worker() {
    let Ok(root) = std::env::var("ACCEL_TEST_SINGLE_ROOT") else {
        return;
    };
    let p = filled(2.0);
    let opt = AdamW::new_lr(p.iter().map(|(_, v)| v.clone()).collect(), 0.1).unwrap();
    single()
        .save_state_auto(&root, &CheckpointParts::new(&p).optimizer(&opt), 0)
        .unwrap();
}

#[test]
fn total_limit_keeps_the_newest() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    for i in 0..5 {
        let p = filled(i as f32);
        let d = acc
            .save_state_auto(root, &CheckpointParts::new(&p).step(i), 2)
            .unwrap();
        assert_eq!(d, root.join(format!("checkpoint_{i}")));
    }
    let mut names: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != accelerate_rs::checkpoint::LOCK_FILE)
        .collect();
    names.sort();
    assert_eq!(names, vec!["checkpoint_3", "checkpoint_4"]);
    let latest = latest_checkpoint(root).unwrap().unwrap();
    let q = filled(0.0);
    assert_eq!(acc.load_state(&latest, &q, None).unwrap().step, 4);
    assert_eq!(value_of(&q), 4.0);
    assert_eq!(latest_checkpoint(root.join("missing")).unwrap(), None);
}

#[test]
fn mismatched_shape_on_load_names_the_parameter_and_changes_nothing() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    acc.save_state(&ck, &CheckpointParts::new(&filled(1.0)))
        .unwrap();
    let wider: Vec<(String, Var)> = params(0.0, HIDDEN + 1);
    let before = value_of(&wider);
    let err = acc.load_state(&ck, &wider, None).unwrap_err().to_string();
    assert!(err.contains("parameter `fc1.bias`"), "{err}");
    assert!(err.contains("[16]") && err.contains("[17]"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
    assert_eq!(value_of(&wider), before);

    let mut fewer = filled(0.0);
    fewer.retain(|(n, _)| n != "fc2.bias");
    let err = acc.load_state(&ck, &fewer, None).unwrap_err().to_string();
    assert!(
        err.contains("`fc2.bias` is in the file but not in the model"),
        "{err}"
    );

    let mut more = filled(0.0);
    more.push((
        "extra.weight".into(),
        Var::from_tensor(&Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap())
            .unwrap(),
    ));
    let err = acc.load_state(&ck, &more, None).unwrap_err().to_string();
    assert!(err.contains("parameter `extra.weight` is missing"), "{err}");

    // An optimizer asked for, but none saved.
    let q = filled(0.0);
    let mut opt = AdamW::new_lr(q.iter().map(|(_, v)| v.clone()).collect(), 0.1).unwrap();
    let err = acc
        .load_state(&ck, &q, Some(&mut opt))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no optimizer state"), "{err}");
}

#[test]
fn save_model_writes_only_parameters() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    acc.save_model(&path, &filled(3.0)).unwrap();
    let t = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let mut names: Vec<_> = t.keys().cloned().collect();
    names.sort();
    assert_eq!(
        names,
        vec!["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn loader_resume_at_skips_the_first_batches_of_the_same_order() {
    for prefetch in [0, 2] {
        let mut loader = DataLoader::new(dataset(40), 4)
            .shuffle(true)
            .seed(3)
            .prefetch(prefetch)
            .shard(1, 2)
            .unwrap();
        let rows = |l: &DataLoader| -> Vec<(usize, Vec<f32>)> {
            l.iter()
                .unwrap()
                .map(|b| {
                    let b = b.unwrap();
                    (
                        b.index(),
                        b[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    )
                })
                .collect()
        };
        loader.set_epoch(2);
        let whole = rows(&loader);
        assert_eq!(whole.len(), 5);
        loader.set_epoch(0);
        loader.resume_at(2, 3);
        assert_eq!(loader.epoch(), 2);
        assert_eq!(loader.skipped_batches(), 3);
        let rest = rows(&loader);
        assert_eq!(rest, whole[3..].to_vec());
        // The same epoch set again keeps the position; the next epoch starts from 0.
        loader.set_epoch(2);
        assert_eq!(rows(&loader).len(), 2);
        loader.set_epoch(3);
        assert_eq!(loader.skipped_batches(), 0);
        assert_eq!(rows(&loader).len(), 5);
        // Past the end: an empty epoch.
        loader.resume_at(3, 9);
        assert_eq!(rows(&loader).len(), 0);
    }
}
