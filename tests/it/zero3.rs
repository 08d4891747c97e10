//! ZeRO stage 3 on a plain model (the tiny MLP of `common::tiny`, one unit per layer): the same
//! parameters as stage 0 after K steps (AdamW with decay groups and clipping, SGD with momentum,
//! gradient accumulation, bf16 mixed precision) on 1 to 4 in-process ranks; each rank keeps
//! about 1/N of the parameters and of the optimizer state; bad uses are clear errors.

use std::collections::HashMap;
use std::sync::Arc;

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN, IN};
use accelerate_rs::collective::Collective;
use accelerate_rs::optim::{AdamW, Sgd, SgdConfig};
use accelerate_rs::{Accelerator, DataLoader, ShardedModel, WrapPolicy};
use candle_core::{DType, Module, Tensor, Var};
use candle_nn::{loss, Linear, Optimizer, ParamsAdamW, VarBuilder};

const STEPS: usize = 5;
const BATCH: usize = 4;

#[derive(Clone, Copy, Debug)]
pub(crate) enum Opt {
    AdamW,
    Sgd,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Run {
    pub(crate) opt: Opt,
    pub(crate) clip: Option<f64>,
    /// Mixed precision (bf16 or fp16, the accelerator's): every rank starts from the same values.
    pub(crate) bf16: bool,
}

pub(crate) fn layer(
    vb: &VarBuilder,
    name: &str,
    i: usize,
    o: usize,
) -> candle_core::Result<Linear> {
    let vb = vb.pp(name);
    Ok(Linear::new(
        vb.get((o, i), "weight")?,
        Some(vb.get(o, "bias")?),
    ))
}

/// The tiny MLP through a sharded model: one unit per layer.
pub(crate) fn sharded_forward(m: &ShardedModel, x: &Tensor) -> accelerate_rs::Result<Tensor> {
    let x = x.to_dtype(m.compute_dtype())?;
    let h = m.run("fc1", &x, |vb, x| {
        layer(&vb, "fc1", IN, HIDDEN)?.forward(x)?.relu()
    })?;
    let classes = crate::common::tiny::CLASSES;
    let y = m.run("fc2", &h, move |vb, x| {
        layer(&vb, "fc2", HIDDEN, classes)?.forward(x)
    })?;
    Ok(y.to_dtype(DType::F32)?)
}

pub(crate) fn optimizer(run: Run, p: &[(String, Var)]) -> Either {
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let biases: Vec<Var> = p
        .iter()
        .filter(|(n, _)| n.ends_with("bias"))
        .map(|(_, v)| v.clone())
        .collect();
    match run.opt {
        Opt::AdamW => {
            let cfg = ParamsAdamW {
                lr: 0.01,
                weight_decay: 0.1,
                ..Default::default()
            };
            Either::A(AdamW::new(vars, cfg).unwrap().no_weight_decay_on(&biases))
        }
        Opt::Sgd => {
            let cfg = SgdConfig::new(0.05).momentum(0.9).weight_decay(0.01);
            Either::S(Sgd::new(vars, cfg).unwrap())
        }
    }
}

pub(crate) enum Either {
    A(AdamW),
    S(Sgd),
}

/// `STEPS` optimizer steps at the accelerator's stage: stage 3 through `prepare_sharded`, else
/// the plain `prepare`. Returns the final parameters (whole) and this rank's state bytes.
pub(crate) fn train(acc: &Accelerator, run: Run) -> (HashMap<String, Tensor>, usize) {
    let p = params(
        0.1 * acc.rank() as f32 * f32::from(u8::from(!run.bf16)),
        HIDDEN,
    );
    let n = acc.gradient_accumulation_steps();
    let loader = DataLoader::new(dataset(acc.world_size() * BATCH * STEPS * n), BATCH);
    macro_rules! go {
        ($opt:expr) => {{
            let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
            let (mut opt, loader, model) = acc.prepare_sharded(&p, &policy, $opt, loader).unwrap();
            opt.set_clip_grad_norm(run.clip);
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = sharded_forward(&model, &b[0]).unwrap();
                let l = loss::cross_entropy(&out, &b[1]).unwrap();
                opt.backward_step_batch(&l, &b).unwrap();
            }
            assert_eq!(model.is_sharded(), acc.state().zero_stage() == 3);
            let full: HashMap<String, Tensor> =
                model.full_parameters().unwrap().into_iter().collect();
            (full, opt.inner().state_bytes())
        }};
    }
    match optimizer(run, &p) {
        Either::A(o) => go!(o),
        Either::S(o) => go!(o),
    }
}

/// The same training through the plain `prepare` at stage 0 (the reference).
fn train_plain(acc: &Accelerator, run: Run) -> HashMap<String, Tensor> {
    let p = params(0.1 * acc.rank() as f32, HIDDEN);
    let n = acc.gradient_accumulation_steps();
    let loader = DataLoader::new(dataset(acc.world_size() * BATCH * STEPS * n), BATCH);
    macro_rules! go {
        ($opt:expr) => {{
            let (mut opt, loader) = acc.prepare(&p, $opt, loader).unwrap();
            opt.set_clip_grad_norm(run.clip);
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let l = loss::cross_entropy(&forward(&p, &b[0]).unwrap(), &b[1]).unwrap();
                opt.backward_step_batch(&l, &b).unwrap();
            }
        }};
    }
    match optimizer(run, &p) {
        Either::A(o) => go!(o),
        Either::S(o) => go!(o),
    }
    snapshot(&p)
}

fn in_process<R: Send + 'static>(
    world: usize,
    stage: usize,
    accumulate: usize,
    f: impl Fn(Accelerator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    crate::common::in_process_with(
        world,
        move |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(stage)
                .gradient_accumulation_steps(accumulate)
        },
        f,
    )
}

#[test]
fn stage_3_matches_stage_0_on_1_to_4_ranks() {
    let runs = [
        Run {
            opt: Opt::AdamW,
            clip: Some(0.05),
            bf16: false,
        },
        Run {
            opt: Opt::Sgd,
            clip: None,
            bf16: false,
        },
    ];
    for run in runs {
        for world in 1..=4 {
            for accumulate in [1, 2] {
                let base = in_process(world, 0, accumulate, move |a| train_plain(&a, run));
                let got = in_process(world, 3, accumulate, move |a| train(&a, run));
                let d = max_abs_diff(&base[0], &got[0].0);
                eprintln!("{run:?} world {world} accumulate {accumulate}: {d}");
                assert!(
                    d < 1e-6,
                    "{run:?} world {world} accumulate {accumulate}: {d}"
                );
                // Every rank ends with the same whole model.
                for (r, (other, _)) in got.iter().enumerate().skip(1) {
                    assert_eq!(max_abs_diff(&got[0].0, other), 0.0, "rank {r}");
                }
                // The prepare_sharded script below stage 3 is the plain one.
                let same = in_process(world, 0, accumulate, move |a| train(&a, run));
                let d0 = max_abs_diff(&base[0], &same[0].0);
                assert_eq!(
                    d0, 0.0,
                    "{run:?} world {world}: stage-0 prepare_sharded {d0}"
                );
                if world > 1 && matches!(run.opt, Opt::AdamW) {
                    let whole = same[0].1;
                    let parts: usize = got.iter().map(|(_, b)| b).sum();
                    assert_eq!(parts, whole, "the ranks' states add up to the whole");
                    for (_, b) in &got {
                        assert!(*b <= whole / world + 16, "{b} of {whole} on {world} ranks");
                    }
                }
            }
        }
    }
}

/// `gradient_bytes_reduced` counts the units' reduce-scatters at stage 3: every gradient and
/// one presence flag per parameter, once per step, as stage 0's buckets do.
#[test]
fn stage_3_counts_the_bytes_its_units_reduce() {
    let run = Run {
        opt: Opt::AdamW,
        clip: None,
        bf16: false,
    };
    let plain = in_process(2, 0, 1, move |a| {
        train_plain(&a, run);
        a.gradient_bytes_reduced()
    });
    let sharded = in_process(2, 3, 1, move |a| {
        train(&a, run);
        a.gradient_bytes_reduced()
    });
    assert!(plain[0] > 0);
    assert_eq!(sharded, plain, "bytes reduced at stage 3 and at stage 0");
    let alone = in_process(1, 3, 1, move |a| {
        train(&a, run);
        a.gradient_bytes_reduced()
    });
    assert_eq!(alone, vec![0], "nothing is reduced by a rank alone");
}

/// bf16 mixed precision: stage 0's `prepare_mixed` (bf16 working copies, f32 masters) against
/// stage 3 (f32 shards, units gathered in bf16).
#[test]
fn bf16_mixed_precision_at_stage_3_matches_stage_0() {
    let run = Run {
        opt: Opt::AdamW,
        clip: Some(0.05),
        bf16: true,
    };
    for world in [2, 3] {
        let mixed = |stage: usize| {
            move |c: Arc<dyn Collective>| {
                Accelerator::builder()
                    .collective(c)
                    .zero_stage(stage)
                    .mixed_precision(accelerate_rs::MixedPrecision::Bf16)
            }
        };
        let base = crate::common::in_process_with(world, mixed(0), move |acc| {
            let p = params(0.0, HIDDEN);
            let loader = DataLoader::new(dataset(acc.world_size() * BATCH * STEPS), BATCH);
            let Either::A(opt) = optimizer(run, &p) else {
                unreachable!()
            };
            let (mut opt, loader, work) = acc.prepare_mixed(&p, opt, loader).unwrap();
            opt.set_clip_grad_norm(run.clip);
            let wp: Vec<(String, Var)> = p
                .iter()
                .map(|(k, _)| (k.clone(), work.data().lock().unwrap()[k].clone()))
                .collect();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = forward(&wp, &b[0].to_dtype(DType::BF16).unwrap()).unwrap();
                let l = loss::cross_entropy(&out.to_dtype(DType::F32).unwrap(), &b[1]).unwrap();
                opt.backward_step(&l).unwrap();
            }
            snapshot(&p)
        });
        let got = crate::common::in_process_with(world, mixed(3), move |acc| train(&acc, run));
        let d = max_abs_diff(&base[0], &got[0].0);
        assert!(d < 1e-6, "bf16 world {world}: {d}");
    }
}

/// What stage 3 refuses, and how it says so.
#[test]
fn stage_3_errors_name_what_is_wrong() {
    let errs = in_process(2, 3, 1, |acc| {
        let p = params(0.0, HIDDEN);
        let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
        let loader = || DataLoader::new(dataset(16), 4);
        let mut out = Vec::new();
        // The plain prepare at stage 3.
        let e = acc
            .prepare(&p, AdamW::new_lr(vars.clone(), 0.1).unwrap(), loader())
            .unwrap_err();
        out.push(e.to_string());
        // Candle's own optimizer cannot step shards.
        let sgd = candle_nn::SGD::new(vars.clone(), 0.1).unwrap();
        let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
        let e = acc.prepare_sharded(&p, &policy, sgd, loader()).unwrap_err();
        out.push(e.to_string());
        // A prefix that matches nothing.
        let bad = WrapPolicy::prefixes(["fc3"]);
        let opt = AdamW::new_lr(vars.clone(), 0.1).unwrap();
        out.push(
            acc.prepare_sharded(&p, &bad, opt, loader())
                .unwrap_err()
                .to_string(),
        );
        // A block asking for a parameter of another unit, and an unknown unit.
        let opt = AdamW::new_lr(vars, 0.1).unwrap();
        let (_, _, model) = acc.prepare_sharded(&p, &policy, opt, loader()).unwrap();
        let x = Tensor::zeros((2, IN), DType::F32, &candle_core::Device::Cpu).unwrap();
        let e = model
            .run("fc1", &x, |vb, x| layer(&vb, "fc2", HIDDEN, 4)?.forward(x))
            .unwrap_err();
        out.push(e.to_string());
        out.push(model.gather("fc9").err().unwrap().to_string());
        out
    });
    for e in errs {
        assert!(e[0].contains("prepare_sharded"), "{}", e[0]);
        assert!(
            e[1].contains("optim::AdamW") && e[1].contains("stage 3"),
            "{}",
            e[1]
        );
        assert!(
            e[2].contains("`fc3`") && e[2].contains("matches no parameter"),
            "{}",
            e[2]
        );
        assert!(
            e[3].contains("`fc1`") && e[3].contains("fc2.weight"),
            "{}",
            e[3]
        );
        assert!(e[4].contains("`fc9`") && e[4].contains("`fc1`"), "{}", e[4]);
    }
}

/// fp16 at stage 3: f32 shards, units gathered in f16, the loss scaled by the sharded model's
/// dynamic loss scale and divided out of each unit's gradients before its reduce-scatter. Ends
/// where stage 0's `prepare_mixed` (f16 working copies, `MixedPrecisionOptimizer`'s scaler)
/// does, on 2 and 3 ranks.
#[test]
fn fp16_mixed_precision_at_stage_3_matches_stage_0() {
    let run = Run {
        opt: Opt::AdamW,
        clip: Some(0.05),
        bf16: true,
    };
    let fp16 = |stage: usize| {
        move |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(stage)
                .mixed_precision(accelerate_rs::MixedPrecision::Fp16)
        }
    };
    for world in [2, 3] {
        let base = crate::common::in_process_with(world, fp16(0), move |acc| {
            let p = params(0.0, HIDDEN);
            let loader = DataLoader::new(dataset(acc.world_size() * BATCH * STEPS), BATCH);
            let Either::A(opt) = optimizer(run, &p) else {
                unreachable!()
            };
            let (mut opt, loader, work) = acc.prepare_mixed(&p, opt, loader).unwrap();
            opt.set_clip_grad_norm(run.clip);
            let wp: Vec<(String, Var)> = p
                .iter()
                .map(|(k, _)| (k.clone(), work.data().lock().unwrap()[k].clone()))
                .collect();
            for b in loader.iter().unwrap() {
                let b = b.unwrap();
                let out = forward(&wp, &b[0].to_dtype(DType::F16).unwrap()).unwrap();
                let l = loss::cross_entropy(&out.to_dtype(DType::F32).unwrap(), &b[1]).unwrap();
                opt.backward_step(&l).unwrap();
            }
            assert_eq!(opt.skipped_steps(), 0);
            snapshot(&p)
        });
        let got = crate::common::in_process_with(world, fp16(3), move |acc| train(&acc, run));
        let d = max_abs_diff(&base[0], &got[0].0);
        assert!(d < 1e-6, "fp16 world {world}: {d}");
    }
}

/// fp16 at stage 3: an overflow in one rank's gradients only (its loss blown up to infinity)
/// skips the step on every rank and halves the loss scale everywhere; the parameters stay as
/// they were, and the next, finite step steps every rank together. The scale and its clean-step
/// count are part of the optimizer's checkpointed state.
#[test]
fn an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_at_stage_3() {
    use accelerate_rs::optim::StatefulOptimizer;
    let fp16 = |c: Arc<dyn Collective>| {
        Accelerator::builder()
            .collective(c)
            .zero_stage(3)
            .mixed_precision(accelerate_rs::MixedPrecision::Fp16)
    };
    let out = crate::common::in_process_with(3, fp16, |acc| {
        let p = params(0.0, HIDDEN);
        let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
        let opt = AdamW::new_lr(vars, 0.01).unwrap();
        let loader = DataLoader::new(dataset(acc.world_size() * BATCH * 2), BATCH);
        let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
        let (mut opt, loader, model) = acc.prepare_sharded(&p, &policy, opt, loader).unwrap();
        let start = model.loss_scale().unwrap();
        let batches: Vec<_> = loader.iter().unwrap().map(|b| b.unwrap()).collect();
        let mut seen = Vec::new();
        let before: HashMap<String, Tensor> =
            model.full_parameters().unwrap().into_iter().collect();
        for (i, b) in batches.iter().enumerate() {
            let out = sharded_forward(&model, &b[0]).unwrap();
            let mut l = loss::cross_entropy(&out, &b[1]).unwrap();
            if i == 0 && acc.rank() == 2 {
                // f16's largest value is 65504: this rank's scaled gradients overflow.
                l = (l * 1e30).unwrap();
            }
            opt.backward_step(&l).unwrap();
            let now: HashMap<String, Tensor> =
                model.full_parameters().unwrap().into_iter().collect();
            seen.push((
                model.loss_scale().unwrap(),
                model.skipped_steps(),
                max_abs_diff(&before, &now),
            ));
        }
        let state = opt.optimizer_state().unwrap();
        let saved: Vec<String> = state
            .tensors
            .iter()
            .map(|(n, _)| n.clone())
            .filter(|n| n.starts_with("loss_scaler"))
            .collect();
        (start, seen, saved)
    });
    for (rank, (start, seen, saved)) in out.into_iter().enumerate() {
        assert_eq!(
            seen[0].0,
            start / 2.0,
            "rank {rank}: the scale after the overflow"
        );
        assert_eq!(seen[0].1, 1, "rank {rank}: one skipped step");
        assert_eq!(
            seen[0].2, 0.0,
            "rank {rank}: the skipped step moved the parameters"
        );
        assert_eq!(seen[1].1, 1, "rank {rank}: the next step was skipped too");
        assert!(seen[1].2 > 0.0, "rank {rank}: the next step did not step");
        assert_eq!(
            saved,
            ["loss_scaler.scale", "loss_scaler.clean_steps"],
            "rank {rank}"
        );
    }
}

/// A parameter no rank gives a gradient (fc2's bias is never used): named at the first step.
#[test]
fn stage_3_names_a_parameter_without_a_gradient() {
    let missing = crate::common::in_process_with(
        2,
        |c: Arc<dyn Collective>| {
            Accelerator::builder()
                .collective(c)
                .zero_stage(3)
                .missing_gradients(accelerate_rs::MissingGradients::Error)
        },
        |acc| {
            let p = params(0.0, HIDDEN);
            let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
            let opt = AdamW::new_lr(vars, 0.1).unwrap();
            let loader = DataLoader::new(dataset(16), 4);
            let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
            let (mut opt, loader, model) = acc.prepare_sharded(&p, &policy, opt, loader).unwrap();
            let b = loader.iter().unwrap().next().unwrap().unwrap();
            let h = model
                .run("fc1", &b[0], |vb, x| {
                    layer(&vb, "fc1", IN, HIDDEN)?.forward(x)
                })
                .unwrap();
            let y = model
                .run("fc2", &h, |vb, x| {
                    x.matmul(&vb.get((4, HIDDEN), "fc2.weight")?.t()?)
                })
                .unwrap();
            let l = loss::cross_entropy(&y, &b[1]).unwrap();
            opt.backward_step(&l).unwrap_err().to_string()
        },
    );
    for e in missing {
        assert!(e.contains("fc2.bias") && !e.contains("fc2.weight"), "{e}");
    }
}

const ROLE_VAR: &str = "ACCEL_ZERO3_OUT";

/// The worker of [`stage_3_on_1_to_4_processes_matches_stage_0`]: trains at the stage the
/// launcher hands down (stage 3 through `prepare_sharded`, stage 0 the plain way) with
/// gradient accumulation 2; rank 0 writes the parameters. Does nothing in a normal test run.
#[test]
fn zero3_worker_entry() {
    let Ok(out) = std::env::var(ROLE_VAR) else {
        return;
    };
    let result = Accelerator::new().and_then(|acc| {
        let run = Run {
            opt: Opt::AdamW,
            clip: Some(0.05),
            bf16: false,
        };
        let p = if acc.state().zero_stage() == 3 {
            train(&acc, run).0
        } else {
            train_plain(&acc, run)
        };
        if acc.is_main_process() {
            candle_core::safetensors::save(&p, &out)?;
        }
        Ok(())
    });
    crate::common::exit_worker(result)
}

/// Real processes through `accelerate-rs launch --zero-stage N` (TCP on loopback), 1 to 4 of
/// them: stage 3 ends with the parameters of stage 0 (AdamW, clipping, accumulation 2).
#[test]
fn stage_3_on_1_to_4_processes_matches_stage_0() {
    let dir = tempfile::tempdir().unwrap();
    let run = |world: usize, stage: usize| {
        let out = dir.path().join(format!("s{stage}-w{world}.safetensors"));
        let mut cmd = std::process::Command::new(crate::common::launcher());
        cmd.args(["launch", "--cpu", "-n", &world.to_string()])
            .args(["--zero-stage", &stage.to_string()])
            .args(["--gradient-accumulation-steps", "2"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "zero3::zero3_worker_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, &out)
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null());
        let start = std::time::Instant::now();
        let o = cmd.output().unwrap();
        assert!(start.elapsed() < std::time::Duration::from_secs(90));
        assert!(
            o.status.success(),
            "stage {stage} on {world}:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        candle_core::safetensors::load(&out, &candle_core::Device::Cpu).unwrap()
    };
    for world in 1..=4 {
        let d = max_abs_diff(&run(world, 0), &run(world, 3));
        assert!(d < 1e-6, "{world} processes: {d}");
    }
}

/// `find_executable_batch_size` at stage 3: one of 3 ranks runs out of memory inside a unit's
/// block, in its forward pass (batch 16) and in its recomputation during the backward pass
/// (batch 8); every rank agrees and retries, and the run at the size found (4) equals one
/// started there.
#[test]
fn find_executable_batch_size_retries_through_sharded_units() {
    use accelerate_rs::Error;
    use std::sync::atomic::{AtomicUsize, Ordering};
    fn attempt(acc: &Accelerator, bs: usize) -> accelerate_rs::Result<HashMap<String, Tensor>> {
        let p = params(0.0, HIDDEN);
        let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
        let opt = AdamW::new_lr(vars, 0.01)?;
        let loader = DataLoader::new(dataset(3 * 16 * 2), bs);
        let policy = WrapPolicy::prefixes(["fc1", "fc2"]);
        let (mut opt, loader, model) = acc.prepare_sharded(&p, &policy, opt, loader)?;
        let calls = Arc::new(AtomicUsize::new(0));
        let rank = acc.rank();
        for b in loader.iter()? {
            let b = b?;
            let h = model.run("fc1", &b[0], |vb, x| {
                layer(&vb, "fc1", IN, HIDDEN)?.forward(x)
            })?;
            let calls = calls.clone();
            let y = model.run("fc2", &h, move |vb, x| {
                let n = calls.fetch_add(1, Ordering::Relaxed);
                // Rank 1: out of memory in the forward pass at 16, in the recomputation (its
                // second call) at 8.
                if rank == 1 && (bs == 16 || (bs == 8 && n == 1)) {
                    return Err(Error::OutOfMemory {
                        rank: None,
                        device: "cpu".into(),
                        requested: Some(1 << 30),
                        limit: None,
                        detail: format!("injected at batch {bs}, call {n}"),
                    }
                    .into());
                }
                layer(&vb, "fc2", HIDDEN, crate::common::tiny::CLASSES)?.forward(x)
            })?;
            opt.backward_step(&loss::cross_entropy(&y, &b[1])?)?;
        }
        Ok(model.full_parameters()?.into_iter().collect())
    }
    let found = in_process(3, 3, 1, |acc| {
        let mut tried = Vec::new();
        let p = acc
            .find_executable_batch_size(16, |bs| {
                tried.push(bs);
                attempt(&acc, bs)
            })
            .unwrap();
        (tried, p)
    });
    let direct = in_process(3, 3, 1, |acc| attempt(&acc, 4).unwrap());
    for (tried, p) in &found {
        assert_eq!(tried, &[16, 8, 4]);
        assert_eq!(max_abs_diff(p, &direct[0]), 0.0);
    }
}

/// Offload (`offload_optimizer`): the shards (f32 masters), their gradients and AdamW's state in
/// host memory, the units gathered from a copy in the compute dtype refreshed after each step.
/// On the CPU both live in the same memory, so this checks the path: the same parameters as
/// without offload, bit for bit, in f32 and bf16; below stage 3 the setting is refused.
#[test]
fn offloaded_optimizer_state_trains_the_same() {
    let run = Run {
        opt: Opt::AdamW,
        clip: Some(0.05),
        bf16: false,
    };
    for mixed in [
        accelerate_rs::MixedPrecision::No,
        accelerate_rs::MixedPrecision::Bf16,
    ] {
        let go = |offload: bool| {
            crate::common::in_process_with(
                2,
                move |c: Arc<dyn Collective>| {
                    Accelerator::builder()
                        .collective(c)
                        .zero_stage(3)
                        .offload_optimizer(offload)
                        .mixed_precision(mixed)
                },
                move |acc| train(&acc, run).0,
            )
        };
        let d = max_abs_diff(&go(false)[0], &go(true)[0]);
        assert_eq!(d, 0.0, "{mixed:?}");
    }
    let e = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .zero_stage(2)
        .offload_optimizer(true)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("offload_optimizer") && e.contains("zero_stage is 2"),
        "{e}"
    );
}
