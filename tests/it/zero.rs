//! ZeRO-style sharding: stages 1 and 2 give the same parameters as stage 0 after K steps (AdamW
//! and SGD with momentum, with clipping and gradient accumulation), in-process ranks and real
//! processes; each rank keeps about 1/N of the optimizer state (and at stage 2 of the
//! gradients); bad settings and unshardable optimizers are clear errors.
//!
//! The multi-process test re-runs this test binary as the workers: `zero::worker_entry` does
//! nothing unless `ACCEL_ZERO_ROLE` is set.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN};
use accelerate_rs::checkpoint::CheckpointParts;
use accelerate_rs::collective::Collective;
use accelerate_rs::optim::{AdamW, Sgd, SgdConfig};
use accelerate_rs::{Accelerator, DataLoader};
use candle_core::{Tensor, Var};
use candle_nn::{loss, Optimizer, ParamsAdamW};

const ROLE_VAR: &str = "ACCEL_ZERO_ROLE";
const STEPS: usize = 6;
const BATCH: usize = 4;

#[derive(Clone, Copy, Debug)]
enum Opt {
    AdamW,
    Sgd,
}

#[derive(Clone, Copy, Debug)]
struct Run {
    opt: Opt,
    clip: Option<f64>,
}

/// `STEPS` optimizer steps through `acc` (accumulating its micro-steps); the final parameters
/// and the optimizer state this rank holds, in bytes.
fn train(acc: &Accelerator, run: Run) -> accelerate_rs::Result<(HashMap<String, Tensor>, usize)> {
    let p = params(0.1 * acc.rank() as f32, HIDDEN);
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let n = acc.gradient_accumulation_steps();
    let loader = DataLoader::new(dataset(acc.world_size() * BATCH * STEPS * n), BATCH);
    let bytes = match run.opt {
        Opt::AdamW => {
            let cfg = ParamsAdamW {
                lr: 0.01,
                weight_decay: 0.1,
                ..Default::default()
            };
            let (mut opt, loader) = acc.prepare(&p, AdamW::new(vars, cfg)?, loader)?;
            opt.set_clip_grad_norm(run.clip);
            for b in loader.iter()? {
                let b = b?;
                let l = loss::cross_entropy(&forward(&p, &b[0])?, &b[1])?;
                opt.backward_step_batch(&l, &b)?;
            }
            opt.inner().state_bytes()
        }
        Opt::Sgd => {
            let cfg = SgdConfig::new(0.05).momentum(0.9).weight_decay(0.01);
            let (mut opt, loader) = acc.prepare(&p, Sgd::new(vars, cfg)?, loader)?;
            opt.set_clip_grad_norm(run.clip);
            for b in loader.iter()? {
                let b = b?;
                let l = loss::cross_entropy(&forward(&p, &b[0])?, &b[1])?;
                opt.backward_step_batch(&l, &b)?;
            }
            opt.inner().state_bytes()
        }
    };
    Ok((snapshot(&p), bytes))
}

/// `world` in-process ranks at `stage`: rank 0's parameters and every rank's state bytes.
fn in_process(
    world: usize,
    stage: usize,
    accumulate: usize,
    run: Run,
) -> (HashMap<String, Tensor>, Vec<usize>) {
    let out = crate::common::in_process_with(
        world,
        move |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(stage)
                .gradient_accumulation_steps(accumulate)
        },
        move |acc| train(&acc, run).unwrap(),
    );
    let bytes = out.iter().map(|(_, b)| *b).collect();
    (out.into_iter().next().unwrap().0, bytes)
}

#[test]
fn stages_1_and_2_match_stage_0_in_process() {
    for run in [
        Run {
            opt: Opt::AdamW,
            clip: None,
        },
        Run {
            opt: Opt::AdamW,
            clip: Some(0.05),
        },
        Run {
            opt: Opt::Sgd,
            clip: Some(0.05),
        },
    ] {
        for world in [2, 3] {
            for accumulate in [1, 2] {
                let (base, base_bytes) = in_process(world, 0, accumulate, run);
                for stage in [1, 2] {
                    let (got, bytes) = in_process(world, stage, accumulate, run);
                    let d = max_abs_diff(&base, &got);
                    assert!(
                        d < 1e-5,
                        "{run:?} world {world} accumulate {accumulate} stage {stage}: {d}"
                    );
                    // Each rank holds its slice of the state: the slices add up to the whole.
                    assert_eq!(bytes.iter().sum::<usize>(), base_bytes[0], "{run:?}");
                    let most = *bytes.iter().max().unwrap() as f64;
                    assert!(
                        most <= base_bytes[0] as f64 / world as f64 + 64.0,
                        "{run:?} world {world} stage {stage}: {bytes:?} of {}",
                        base_bytes[0]
                    );
                }
            }
        }
    }
}

/// bf16 mixed precision: the f32 masters are what gets sharded; 2 in-process ranks.
fn mixed(stage: usize) -> HashMap<String, Tensor> {
    let out = crate::common::in_process_with(
        2,
        move |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(stage)
                .mixed_precision(accelerate_rs::MixedPrecision::Bf16)
        },
        |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(2 * BATCH * STEPS), BATCH);
            let opt = AdamW::new_lr(vars, 0.01).unwrap();
            let (mut opt, loader, work) = acc.prepare_mixed(&p, opt, loader).unwrap();
            let dtype = opt.compute_dtype();
            let wp: Vec<(String, Var)> = p
                .iter()
                .map(|(k, _)| (k.clone(), work.data().lock().unwrap()[k].clone()))
                .collect();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = forward(&wp, &b[0].to_dtype(dtype).unwrap()).unwrap();
                let l = loss::cross_entropy(&out.to_dtype(candle_core::DType::F32).unwrap(), &b[1])
                    .unwrap();
                opt.backward_step(&l).unwrap();
            }
            snapshot(&p)
        },
    );
    out.into_iter().next().unwrap()
}

#[test]
fn mixed_precision_shards_the_f32_masters() {
    let base = mixed(0);
    for stage in [1, 2] {
        let d = max_abs_diff(&base, &mixed(stage));
        assert!(d < 1e-5, "bf16 stage {stage} differs from stage 0 by {d}");
    }
}

#[test]
fn world_size_one_and_unshardable_optimizers() {
    // Alone, sharding changes nothing.
    let run = Run {
        opt: Opt::AdamW,
        clip: Some(0.05),
    };
    let (a, _) = in_process(1, 0, 1, run);
    let (b, _) = in_process(1, 2, 1, run);
    assert_eq!(max_abs_diff(&a, &b), 0.0);
    // Candle's own optimizers cannot be cut into slices: the first step says so.
    let errs = crate::common::in_process_with(
        2,
        |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(1),
        |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(16), 4);
            let (mut opt, loader) = acc
                .prepare(&p, candle_nn::SGD::new(vars, 0.1).unwrap(), loader)
                .unwrap();
            let b = loader.iter().unwrap().next().unwrap().unwrap();
            let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
            opt.backward_step(&l).unwrap_err().to_string()
        },
    );
    for e in errs {
        assert!(
            e.contains("zero_stage") && e.contains("optim::AdamW"),
            "{e}"
        );
    }
    let e = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .zero_stage(4)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("zero_stage") && e.contains("0, 1, 2 or 3"),
        "{e}"
    );
}

fn launch(stage: usize, out: &std::path::Path) -> String {
    let mut cmd = Command::new(crate::common::launcher());
    cmd.args(["launch", "--cpu", "-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "zero::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, out)
        .env("ACCELERATE_RS_ZERO_STAGE", stage.to_string())
        .env("ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS", "2")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let o = cmd.output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(60));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "stage {stage}:\n{text}");
    text
}

#[test]
fn two_processes_at_every_stage_end_with_the_same_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    for stage in 0..=2 {
        let path = dir.path().join(format!("stage{stage}.safetensors"));
        let text = launch(stage, &path);
        let bytes: Vec<usize> = text
            .lines()
            .filter_map(|l| l.split("state_bytes=").nth(1))
            .map(|v| v.trim().parse().unwrap())
            .collect();
        assert_eq!(bytes.len(), 2, "{text}");
        let got = candle_core::safetensors::load(&path, &candle_core::Device::Cpu).unwrap();
        results.push((got, bytes));
    }
    let (base, base_bytes) = &results[0];
    for (stage, (got, bytes)) in results.iter().enumerate().skip(1) {
        let d = max_abs_diff(base, got);
        assert!(d < 1e-5, "stage {stage} differs from stage 0 by {d}");
        for b in bytes {
            assert!(
                (*b as f64) <= 0.55 * base_bytes[0] as f64,
                "stage {stage}: {b} bytes of state on a rank, stage 0 {}",
                base_bytes[0]
            );
        }
    }
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(out) = std::env::var(ROLE_VAR) else {
        return;
    };
    let result = Accelerator::new().and_then(|acc| {
        let (p, bytes) = train(
            &acc,
            Run {
                opt: Opt::AdamW,
                clip: Some(0.05),
            },
        )?;
        println!("state_bytes={bytes}");
        if acc.is_main_process() {
            candle_core::safetensors::save(&p, &out)?;
        }
        Ok(())
    });
    crate::common::exit_worker(result)
}

/// On `world` in-process ranks at `stage`: loads the checkpoint `load` (if any) into the
/// prepared AdamW, takes `STEPS` steps, then saves a checkpoint into `save` (every rank calls
/// `save_state`); rank 0's parameters.
fn train_and_save(
    world: usize,
    stage: usize,
    load: Option<PathBuf>,
    save: PathBuf,
) -> HashMap<String, Tensor> {
    let out = crate::common::in_process_with(
        world,
        move |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(stage),
        move |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(world * BATCH * STEPS), BATCH);
            let (mut opt, loader) = acc
                .prepare(&p, AdamW::new_lr(vars, 0.01).unwrap(), loader)
                .unwrap();
            if let Some(dir) = &load {
                acc.load_state(dir, &p, Some(&mut opt)).unwrap();
            }
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step(&l).unwrap();
            }
            assert_eq!(opt.is_sharded(), stage > 0 && world > 1);
            acc.save_state(&save, &CheckpointParts::new(&p).optimizer(&opt))
                .unwrap();
            snapshot(&p)
        },
    );
    out.into_iter().next().unwrap()
}

/// The checkpoint in `dir` loaded into one unsharded process: its parameters and AdamW state.
fn load_unsharded(dir: &Path) -> (HashMap<String, Tensor>, HashMap<String, Tensor>, u64) {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let q = params(5.0, HIDDEN);
    let mut opt = AdamW::new_lr(q.iter().map(|(_, v)| v.clone()).collect(), 0.01).unwrap();
    acc.load_state(dir, &q, Some(&mut opt)).unwrap();
    let state = opt.state().unwrap().tensors.into_iter().collect();
    (snapshot(&q), state, opt.step_count())
}

fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len()
}

#[test]
fn each_rank_writes_its_shard_and_the_checkpoint_loads_unsharded() {
    let dir = tempfile::tempdir().unwrap();
    let (d0, d1) = (dir.path().join("stage0"), dir.path().join("stage1"));
    let p0 = train_and_save(2, 0, None, d0.clone());
    let p1 = train_and_save(2, 1, None, d1.clone());
    assert!(max_abs_diff(&p0, &p1) < 1e-5);
    // Stage 1: one file per rank, each about half the whole state; nothing staged is left.
    let whole = file_size(&d0.join("optimizer.safetensors"));
    assert!(!d1.join("optimizer.safetensors").exists());
    for r in 0..2 {
        let shard = file_size(&d1.join(format!("optimizer.rank-0000{r}-of-00002.safetensors")));
        assert!(
            (shard as f64) < 0.6 * whole as f64,
            "rank {r}'s file has {shard} bytes, the whole state {whole}"
        );
    }
    assert!(!dir.path().join("stage1.shards").exists());
    let manifest = accelerate_rs::checkpoint::verify_checkpoint(&d1).unwrap();
    assert_eq!(manifest.optimizer.as_ref().and_then(|m| m.shards), Some(2));
    // Loaded into one unsharded process, it is the stage-0 checkpoint's state.
    let (q0, s0, t0) = load_unsharded(&d0);
    let (q1, s1, t1) = load_unsharded(&d1);
    assert!(max_abs_diff(&q1, &p1) == 0.0);
    assert!(max_abs_diff(&q0, &p0) == 0.0);
    assert_eq!((t0, t1), (STEPS as u64, STEPS as u64));
    assert_eq!(s0.len(), s1.len());
    assert!(max_abs_diff(&s0, &s1) < 1e-6, "{}", max_abs_diff(&s0, &s1));
}

#[test]
fn a_checkpoint_of_3_sharded_ranks_continues_on_2_ranks_at_any_stage() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n);
    // The same training on 3 ranks, saved unsharded and at stage 1 (uneven slices: 3 ranks).
    let p0 = train_and_save(3, 0, None, d("w3s0"));
    let p1 = train_and_save(3, 1, None, d("w3s1"));
    assert!(max_abs_diff(&p0, &p1) < 1e-5);
    assert!(d("w3s1")
        .join("optimizer.rank-00002-of-00003.safetensors")
        .exists());
    let (_, s0, _) = load_unsharded(&d("w3s0"));
    let (_, s1, _) = load_unsharded(&d("w3s1"));
    assert!(max_abs_diff(&s0, &s1) < 1e-6, "{}", max_abs_diff(&s0, &s1));
    // Continued on 2 ranks: from the unsharded checkpoint at stage 0, and from the sharded one
    // at stages 0, 1 and 2 (re-cut into 2 ranks' slices at the first step).
    let reference = train_and_save(2, 0, Some(d("w3s0")), d("ref"));
    for stage in 0..3 {
        let got = train_and_save(2, stage, Some(d("w3s1")), d(&format!("w2s{stage}")));
        let diff = max_abs_diff(&reference, &got);
        assert!(diff < 1e-5, "stage {stage}: {diff}");
    }
    // Had the moments not been restored, the continuation would differ.
    let fresh = train_and_save(2, 0, None, d("fresh"));
    assert!(max_abs_diff(&reference, &fresh) > 1e-3);
}

#[test]
fn a_missing_or_damaged_shard_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    train_and_save(2, 1, None, ck.clone());
    let file = ck.join("optimizer.rank-00001-of-00002.safetensors");
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let q = params(0.0, HIDDEN);
    let mut opt = AdamW::new_lr(q.iter().map(|(_, v)| v.clone()).collect(), 0.01).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    let err = acc
        .load_state(&ck, &q, Some(&mut opt))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("optimizer.rank-00001-of-00002.safetensors"),
        "{err}"
    );
    let mut bad = bytes.clone();
    let n = bad.len();
    bad[n - 3] ^= 0x55;
    std::fs::write(&file, &bad).unwrap();
    let err = acc
        .load_state(&ck, &q, Some(&mut opt))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("optimizer.rank-00001-of-00002.safetensors"),
        "{err}"
    );
    assert_eq!(opt.step_count(), 0);
    std::fs::write(&file, &bytes).unwrap();
    acc.load_state(&ck, &q, Some(&mut opt)).unwrap();
    assert_eq!(opt.step_count(), STEPS as u64);
}

/// f16 mixed precision on 2 in-process ranks at `stage`: loads `load` (if any), trains, saves
/// into `save`; rank 0's (loss scale, parameters).
fn mixed_f16_save(
    stage: usize,
    load: Option<PathBuf>,
    save: PathBuf,
) -> (f64, HashMap<String, Tensor>) {
    let out = crate::common::in_process_with(
        2,
        move |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(stage)
                .mixed_precision(accelerate_rs::MixedPrecision::Fp16)
        },
        move |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(2 * BATCH * STEPS), BATCH);
            let opt = AdamW::new_lr(vars, 0.01).unwrap();
            let (mut opt, loader, work) = acc.prepare_mixed(&p, opt, loader).unwrap();
            if let Some(dir) = &load {
                acc.load_state(dir, &p, Some(&mut opt)).unwrap();
                opt.sync_working_copies().unwrap();
                let scale = opt.loss_scaler().map(|s| s.scale());
                return (scale.unwrap_or(0.0), snapshot(&p));
            }
            let dtype = opt.compute_dtype();
            let wp: Vec<(String, Var)> = p
                .iter()
                .map(|(k, _)| (k.clone(), work.data().lock().unwrap()[k].clone()))
                .collect();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = forward(&wp, &b[0].to_dtype(dtype).unwrap()).unwrap();
                let l = loss::cross_entropy(&out.to_dtype(candle_core::DType::F32).unwrap(), &b[1])
                    .unwrap();
                opt.backward_step(&l).unwrap();
            }
            acc.save_state(&save, &CheckpointParts::new(&p).optimizer(&opt))
                .unwrap();
            let scale = opt.loss_scaler().map(|s| s.scale());
            (scale.unwrap_or(0.0), snapshot(&p))
        },
    );
    out.into_iter().next().unwrap()
}

#[test]
fn a_sharded_f16_checkpoint_keeps_the_loss_scale() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("f16");
    let (scale, p) = mixed_f16_save(1, None, ck.clone());
    assert!(scale > 0.0);
    let m = accelerate_rs::checkpoint::verify_checkpoint(&ck).unwrap();
    let opt = m.optimizer.unwrap();
    assert_eq!(opt.shards, Some(2));
    assert!(opt.tensors.iter().any(|t| t == "loss_scaler.scale"));
    // Loaded on 2 ranks at stage 2: the same scale and masters.
    let (got, q) = mixed_f16_save(2, Some(ck), dir.path().join("unused"));
    assert_eq!(got, scale);
    assert!(max_abs_diff(&p, &q) == 0.0);
}

#[test]
fn a_users_folder_named_like_the_shard_stage_is_refused_not_removed() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ck");
    let stage = dir.path().join("ck.shards");
    std::fs::create_dir(&stage).unwrap();
    std::fs::write(stage.join("notes.txt"), b"mine").unwrap();
    let target = save.clone();
    let out = crate::common::in_process_with(
        2,
        |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(1),
        move |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(2 * BATCH), BATCH);
            let (mut opt, loader) = acc
                .prepare(&p, AdamW::new_lr(vars, 0.01).unwrap(), loader)
                .unwrap();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step(&l).unwrap();
            }
            assert!(opt.is_sharded());
            acc.save_state(&target, &CheckpointParts::new(&p).optimizer(&opt))
                .unwrap_err()
                .to_string()
        },
    );
    // Rank 0 says why; every rank names the folder.
    assert!(out[0].contains("notes.txt"), "{}", out[0]);
    for msg in out {
        assert!(msg.contains("ck.shards"), "{msg}");
    }
    assert_eq!(std::fs::read(stage.join("notes.txt")).unwrap(), b"mine");
    assert!(!save.exists());
}
