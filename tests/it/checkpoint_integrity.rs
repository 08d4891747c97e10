//! Checkpoints that were damaged or are being written by someone else: checksums catch flipped
//! bytes, replaced, zeroed and truncated files and an edited manifest, naming the file; resuming
//! falls back to the newest sound checkpoint; NaN parameters are refused; old checkpoints
//! without checksums still load; rotation never leaves a half-deleted checkpoint under its name;
//! a second process saving into a folder another run holds is told who holds it; write failures
//! are write errors on every rank.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_rs::checkpoint::{
    latest_checkpoint, verify_checkpoint, CheckpointParts, LOCK_FILE, MANIFEST_FILE, MODEL_FILE,
    OPTIMIZER_FILE,
};
use accelerate_rs::collective::Collective;
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, Error};
use candle_core::Var;

use crate::common::single;
use crate::common::tiny::{params, HIDDEN};

fn filled(v: f32) -> Vec<(String, Var)> {
    params(0.0, HIDDEN)
        .into_iter()
        .map(|(n, var)| {
            let t = (var.as_tensor().zeros_like().unwrap() + v as f64).unwrap();
            (n, Var::from_tensor(&t).unwrap())
        })
        .collect()
}

fn first(p: &[(String, Var)]) -> f32 {
    p[0].1
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()[0]
}

fn opt_of(p: &[(String, Var)]) -> AdamW {
    AdamW::new_lr(p.iter().map(|(_, v)| v.clone()).collect(), 0.1).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn flip_byte(path: &Path, from_end: u64) {
    let mut b = std::fs::read(path).unwrap();
    let i = b.len() - from_end as usize;
    b[i] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

/// Loads `dir` into fresh parameters; the error, if any (the parameters must then be
/// unchanged).
fn load(dir: &Path) -> Result<f32, Error> {
    let q = filled(-1.0);
    let mut opt = opt_of(&q);
    let with_opt = accelerate_rs::checkpoint::read_manifest(dir)
        .map(|m| m.optimizer.is_some())
        .unwrap_or(true);
    let r = if with_opt {
        single().load_state(dir, &q, Some(&mut opt))
    } else {
        single().load_state(dir, &q, None)
    };
    if r.is_err() {
        assert_eq!(first(&q), -1.0, "a failed load changed the parameters");
    }
    r.map(|_| first(&q))
}

fn assert_corrupt(err: Error, file: &str, what: &str) {
    match &err {
        Error::CheckpointCorrupt { path, .. } => {
            assert!(
                path.ends_with(file),
                "{what}: names {}, not {file}: {err}",
                path.display()
            )
        }
        other => panic!("{what}: expected CheckpointCorrupt naming {file}, got {other}"),
    }
}

#[test]
fn damaged_files_and_an_edited_manifest_are_caught_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single();
    let p = filled(2.0);
    let mut opt = opt_of(&p);
    let g = p[0].1.as_tensor().ones_like().unwrap();
    let mut grads = candle_core::backprop::GradStore::default();
    grads.insert(p[0].1.as_tensor(), g);
    candle_nn::Optimizer::step(&mut opt, &grads).unwrap();
    let good = dir.path().join("good");
    acc.save_state(&good, &CheckpointParts::new(&p).optimizer(&opt).step(1))
        .unwrap();
    let older = dir.path().join("older");
    acc.save_state(
        &older,
        &CheckpointParts::new(&filled(5.0)).optimizer(&opt).step(0),
    )
    .unwrap();
    assert!(load(&good).is_ok());
    verify_checkpoint(&good).unwrap();

    type Damage = Box<dyn Fn(&Path)>;
    let older_model = older.join(MODEL_FILE);
    let cases: Vec<(&str, &str, Damage)> = vec![
        (
            "flipped byte in the model",
            MODEL_FILE,
            Box::new(|d: &Path| flip_byte(&d.join(MODEL_FILE), 3)),
        ),
        (
            "flipped byte in the optimizer state",
            OPTIMIZER_FILE,
            Box::new(|d: &Path| flip_byte(&d.join(OPTIMIZER_FILE), 5)),
        ),
        (
            "zeroed model",
            MODEL_FILE,
            Box::new(|d: &Path| {
                let n = std::fs::metadata(d.join(MODEL_FILE)).unwrap().len();
                std::fs::write(d.join(MODEL_FILE), vec![0u8; n as usize]).unwrap();
            }),
        ),
        (
            "truncated model",
            MODEL_FILE,
            Box::new(|d: &Path| {
                let b = std::fs::read(d.join(MODEL_FILE)).unwrap();
                std::fs::write(d.join(MODEL_FILE), &b[..b.len() / 2]).unwrap();
            }),
        ),
        (
            "model of an older checkpoint",
            MODEL_FILE,
            Box::new(move |d: &Path| {
                std::fs::copy(&older_model, d.join(MODEL_FILE)).unwrap();
            }),
        ),
        (
            "edited step",
            MANIFEST_FILE,
            Box::new(|d: &Path| {
                let m = std::fs::read_to_string(d.join(MANIFEST_FILE)).unwrap();
                assert!(m.contains("\"step\": 1,"));
                std::fs::write(
                    d.join(MANIFEST_FILE),
                    m.replacen("\"step\": 1,", "\"step\": 9,", 1),
                )
                .unwrap();
            }),
        ),
        (
            "missing optimizer file",
            OPTIMIZER_FILE,
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join(OPTIMIZER_FILE)).unwrap();
            }),
        ),
    ];
    for (i, (what, file, damage)) in cases.iter().enumerate() {
        let d = dir.path().join(format!("case{i}"));
        copy_dir(&good, &d);
        damage(&d);
        assert_corrupt(load(&d).unwrap_err(), file, what);
        assert_corrupt(verify_checkpoint(&d).unwrap_err(), file, what);
    }
}

#[test]
fn resume_falls_back_to_the_newest_sound_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let acc = single();
    for i in 0..3 {
        acc.save_state_auto(root, &CheckpointParts::new(&filled(i as f32)).step(i), 0)
            .unwrap();
    }
    assert_eq!(
        latest_checkpoint(root).unwrap().unwrap(),
        root.join("checkpoint_2")
    );
    flip_byte(&root.join("checkpoint_2").join(MODEL_FILE), 2);
    let latest = latest_checkpoint(root).unwrap().unwrap();
    assert_eq!(latest, root.join("checkpoint_1"));
    assert_eq!(load(&latest).unwrap(), 1.0);
    // The damaged one keeps its number: the next save does not overwrite it.
    let next = acc
        .save_state_auto(root, &CheckpointParts::new(&filled(7.0)).step(3), 0)
        .unwrap();
    assert_eq!(next, root.join("checkpoint_3"));
    for n in 0..=3 {
        flip_byte(&root.join(format!("checkpoint_{n}")).join(MODEL_FILE), 7);
    }
    // None is sound: an error listing all four, newest first, never a silent fresh start.
    match latest_checkpoint(root) {
        Err(Error::NoSoundCheckpoint { root: r, refused }) => {
            assert_eq!(r, root);
            let dirs: Vec<_> = refused.iter().map(|(p, _)| p.clone()).collect();
            let want: Vec<_> = (0..=3)
                .rev()
                .map(|n| root.join(format!("checkpoint_{n}")))
                .collect();
            assert_eq!(dirs, want);
            assert!(
                refused.iter().all(|(_, why)| why.contains(MODEL_FILE)),
                "{refused:?}"
            );
        }
        other => panic!("expected NoSoundCheckpoint, got {other:?}"),
    }
    let msg = latest_checkpoint(root).unwrap_err().to_string();
    assert!(
        msg.contains("checkpoint_3") && msg.contains("checkpoint_0") && msg.contains("start fresh"),
        "{msg}"
    );
}

#[test]
fn checkpoints_without_checksums_load_and_nan_parameters_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single();
    let old = dir.path().join("old");
    acc.save_state(&old, &CheckpointParts::new(&filled(3.0)).step(4))
        .unwrap();
    // As an accelerate-rs before checksums wrote it.
    let text = std::fs::read_to_string(old.join(MANIFEST_FILE)).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let obj = v.as_object_mut().unwrap();
    assert!(obj.remove("files").is_some() && obj.remove("manifest_crc32").is_some());
    std::fs::write(
        old.join(MANIFEST_FILE),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
    assert_eq!(load(&old).unwrap(), 3.0);

    let nan = dir.path().join("nan");
    acc.save_state(&nan, &CheckpointParts::new(&filled(f32::NAN)))
        .unwrap();
    let e = load(&nan).unwrap_err();
    assert_corrupt(e, MODEL_FILE, "NaN parameters");
    let e = load(&nan).unwrap_err().to_string();
    assert!(e.contains("NaN") && e.contains("fc1"), "{e}");
}

#[test]
fn an_interrupted_rotation_leaves_nothing_a_loader_reads() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let acc = single();
    acc.save_state_auto(root, &CheckpointParts::new(&filled(1.0)), 0)
        .unwrap();
    // What a crash in the middle of rotating `checkpoint_5` away leaves: the renamed directory,
    // partly deleted (its model file gone, the manifest still there).
    let doomed = root.join("checkpoint_5.deleting-4242");
    copy_dir(&root.join("checkpoint_0"), &doomed);
    std::fs::remove_file(doomed.join(MODEL_FILE)).unwrap();
    assert_eq!(
        latest_checkpoint(root).unwrap().unwrap(),
        root.join("checkpoint_0")
    );
    // The next save numbers after the real ones and sweeps the leftover away.
    let d = acc
        .save_state_auto(root, &CheckpointParts::new(&filled(2.0)), 1)
        .unwrap();
    assert_eq!(d, root.join("checkpoint_1"));
    let names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n != LOCK_FILE)
        .collect();
    assert_eq!(names, vec!["checkpoint_1".to_string()]);
}

/// Entry point of the lock-holding process; does nothing in a normal test run.
#[test]
fn lock_holder_worker() {
    let Ok(root) = std::env::var("ACCEL_TEST_LOCK_ROOT") else {
        return;
    };
    single()
        .save_state_auto(&root, &CheckpointParts::new(&filled(1.0)), 0)
        .unwrap();
    println!("saved");
    std::thread::sleep(Duration::from_secs(60));
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_second_run_saving_into_the_same_folder_is_told_who_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let root: PathBuf = dir.path().join("shared");
    let child = Kill(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "checkpoint_integrity::lock_holder_worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("ACCEL_TEST_LOCK_ROOT", &root)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while latest_checkpoint(&root).unwrap().is_none() {
        assert!(Instant::now() < deadline, "the holder never saved");
        std::thread::sleep(Duration::from_millis(20));
    }
    let err = single()
        .save_state_auto(&root, &CheckpointParts::new(&filled(2.0)), 0)
        .unwrap_err();
    match &err {
        Error::CheckpointLocked { holder, .. } => {
            assert!(holder.contains(&format!("pid {pid}")), "{err}")
        }
        other => panic!("expected CheckpointLocked, got {other}"),
    }
    // Its checkpoint is untouched, and once it is gone (killed: no clean-up) the folder is free.
    assert_eq!(
        latest_checkpoint(&root).unwrap().unwrap(),
        root.join("checkpoint_0")
    );
    drop(child);
    single()
        .save_state_auto(&root, &CheckpointParts::new(&filled(2.0)), 0)
        .unwrap();
    assert_eq!(
        latest_checkpoint(&root).unwrap().unwrap(),
        root.join("checkpoint_1")
    );
}

#[test]
fn write_failures_are_write_errors_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    // A model file under a "folder" that is a file: the file system refuses (a missing folder
    // is created).
    let blocker = dir.path().join("blocker");
    std::fs::write(&blocker, b"x").unwrap();
    let bad = blocker.join("model.safetensors");
    match single().save_model(&bad, &filled(1.0)).unwrap_err() {
        Error::ModelFile { path, source, .. } => {
            assert!(path.starts_with(dir.path()));
            assert!(source.is_some());
        }
        other => panic!("expected ModelFile, got {other}"),
    }
    // Two ranks, and the checkpoint root is a file: rank 0 fails to create it, rank 1 is told
    // that rank 0 failed (neither calls it an invalid checkpoint).
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let results = crate::common::in_process_with(
        2,
        |c: Arc<dyn Collective>| Accelerator::builder().collective(c),
        move |acc| {
            acc.save_state_auto(&file, &CheckpointParts::new(&filled(1.0)), 0)
                .unwrap_err()
        },
    );
    assert!(matches!(results[0], Error::Io { .. }), "{}", results[0]);
    match &results[1] {
        Error::CheckpointWrite { reason, .. } => assert!(reason.contains("rank 0"), "{reason}"),
        other => panic!("rank 1: expected CheckpointWrite, got {other}"),
    }
    for r in &results {
        assert!(!matches!(r, Error::InvalidArgument { .. }), "{r}");
    }
}

#[test]
fn save_model_sharded_writes_hugging_face_shards_and_index_loadable_with_var_builder() {
    let dir = tempfile::tempdir().unwrap();
    let p = params(0.3, HIDDEN);
    let out = dir.path().join("model");
    // fc1.weight is 16 x 8 f32 = 512 bytes: shards of at most 600 bytes hold one big tensor each.
    single().save_model_sharded(&out, &p, 600).unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), p.len());
    let total: u64 = p.iter().map(|(_, v)| (v.elem_count() * 4) as u64).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    let mut files: Vec<PathBuf> = map
        .values()
        .map(|f| out.join(f.as_str().unwrap()))
        .collect();
    files.sort();
    files.dedup();
    assert!(files.len() > 1, "{files:?}");
    assert!(files[0].ends_with(format!("model-00001-of-{:05}.safetensors", files.len())));
    // SAFETY: the files were written above and nothing modifies them while they are mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &files,
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
    }
    .unwrap();
    for (name, var) in &p {
        let got = vb.get(var.dims(), name).unwrap();
        let diff = (got - var.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
    // Everything in one shard: a single model.safetensors, no index (as Hugging Face does).
    let one = dir.path().join("one");
    single().save_model_sharded(&one, &p, 1 << 30).unwrap();
    let names: Vec<String> = std::fs::read_dir(&one)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec!["model.safetensors".to_string()]);
    assert!(single()
        .save_model_sharded(dir.path().join("zero"), &p, 0)
        .is_err());
}
