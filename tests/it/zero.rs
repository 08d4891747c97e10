//! ZeRO-style sharding: stages 1 and 2 give the same parameters as stage 0 after K steps (AdamW
//! and SGD with momentum, with clipping and gradient accumulation), in-process ranks and real
//! processes; each rank keeps about 1/N of the optimizer state (and at stage 2 of the
//! gradients); bad settings and unshardable optimizers are clear errors.
//!
//! The multi-process test re-runs this test binary as the workers: `zero::worker_entry` does
//! nothing unless `ACCEL_ZERO_ROLE` is set.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN};
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
        .zero_stage(3)
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("zero_stage") && e.contains("0, 1 or 2"), "{e}");
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

/// `STEPS` AdamW steps at `stage` on 2 in-process ranks, then a checkpoint into `dir` (every
/// rank calls `save_state`); rank 0's parameters.
fn train_and_save(stage: usize, dir: std::path::PathBuf) -> HashMap<String, Tensor> {
    let out = crate::common::in_process_with(
        2,
        move |c: Arc<dyn Collective>| Accelerator::builder().collective(c).zero_stage(stage),
        move |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let loader = DataLoader::new(dataset(2 * BATCH * STEPS), BATCH);
            let (mut opt, loader) = acc
                .prepare(&p, AdamW::new_lr(vars, 0.01).unwrap(), loader)
                .unwrap();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step(&l).unwrap();
            }
            assert_eq!(opt.is_sharded(), stage > 0);
            acc.save_state(
                &dir,
                &accelerate_rs::checkpoint::CheckpointParts::new(&p).optimizer(&opt),
            )
            .unwrap();
            snapshot(&p)
        },
    );
    out.into_iter().next().unwrap()
}

#[test]
fn a_sharded_optimizer_saves_the_whole_state_loadable_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let (d0, d1) = (dir.path().join("stage0"), dir.path().join("stage1"));
    let p0 = train_and_save(0, d0.clone());
    let p1 = train_and_save(1, d1.clone());
    assert!(max_abs_diff(&p0, &p1) < 1e-5);
    // The stage-1 checkpoint holds the same (whole) optimizer state as the stage-0 one.
    let dev = candle_core::Device::Cpu;
    let s0 = candle_core::safetensors::load(d0.join("optimizer.safetensors"), &dev).unwrap();
    let s1 = candle_core::safetensors::load(d1.join("optimizer.safetensors"), &dev).unwrap();
    assert_eq!(s0.len(), s1.len());
    assert!(max_abs_diff(&s0, &s1) < 1e-6, "{}", max_abs_diff(&s0, &s1));
    // And it loads into one unsharded process.
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let q = params(5.0, HIDDEN);
    let mut opt = AdamW::new_lr(q.iter().map(|(_, v)| v.clone()).collect(), 0.01).unwrap();
    acc.load_state(&d1, &q, Some(&mut opt)).unwrap();
    assert!(max_abs_diff(&snapshot(&q), &p1) == 0.0);
    assert_eq!(opt.step_count(), STEPS as u64);
}
