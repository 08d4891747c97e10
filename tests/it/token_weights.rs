//! Token-weighted losses ([`TokenLoss`]): with gradient accumulation on 1, 2 and 4 real processes
//! under `accelerate-rs launch`, micro-batches of uneven token counts (different sequence
//! lengths, prompt and padding labels of -100, one micro-batch with no target at all) give the
//! gradient of one big batch — the mean over every target token of the step — through
//! `Accelerator::backward_tokens` and `AcceleratedOptimizer::backward_step_tokens_batch`, while
//! the per-micro-batch mean loss of `backward` does not.
//!
//! The test re-runs this test binary as the workers: `token_weights_worker` does nothing unless
//! `ACCEL_TEST_ROLE` is set.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use accelerate_rs::{
    Accelerator, Batch, DataLoader, Error, MixedPrecision, TensorDataset, TokenLoss,
};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarMap, SGD};

use crate::common::{exit_worker, in_process_with};

const IN: usize = 6;
const CLASSES: usize = 5;
/// Sequences per step, two per micro-batch: 8 micro-batches, `8 / world` per rank.
const SEQS: usize = 16;
const IGNORE: i64 = -100;

/// Sequence `s`: its length, features `[len, IN]` and labels (the first tokens are a prompt,
/// labelled -100; sequences 6 and 7 have no target at all, so micro-batch 3 has none).
fn sequence(s: usize) -> (usize, Vec<f32>, Vec<i64>) {
    let len = [3, 17, 5, 9, 1, 12, 4, 2, 20, 7, 11, 2, 6, 14, 8, 3][s];
    let x = (0..len * IN)
        .map(|i| (((i * 37 + s * 101) % 89) as f32 / 89.0 - 0.5) * 2.0)
        .collect();
    let prompt = if s == 6 || s == 7 { len } else { s % 3 };
    let y = (0..len)
        .map(|t| {
            if t < prompt {
                IGNORE
            } else {
                ((t * 3 + s) % CLASSES) as i64
            }
        })
        .collect();
    (len, x, y)
}

/// Micro-batch `g` (sequences `2g` and `2g + 1`), padded to its longer sequence with label -100:
/// `([2, T, IN], [2, T])`.
fn micro_batch(g: usize) -> (Tensor, Tensor) {
    let seqs = [sequence(2 * g), sequence(2 * g + 1)];
    let t = seqs.iter().map(|s| s.0).max().unwrap_or(0);
    let (mut x, mut y) = (vec![0f32; 2 * t * IN], vec![IGNORE; 2 * t]);
    for (i, (len, sx, sy)) in seqs.iter().enumerate() {
        x[i * t * IN..(i * t + len) * IN].copy_from_slice(sx);
        y[i * t..i * t + len].copy_from_slice(sy);
    }
    let dev = Device::Cpu;
    (
        Tensor::from_vec(x, (2, t, IN), &dev).unwrap(),
        Tensor::from_vec(y, (2, t), &dev).unwrap(),
    )
}

fn params() -> Vec<(String, Var)> {
    let mk = |n: usize, salt: usize| {
        (0..n)
            .map(|i| (((i * 13 + salt) % 23) as f32 / 23.0 - 0.5) * 0.8)
            .collect::<Vec<_>>()
    };
    let dev = Device::Cpu;
    let w = Tensor::from_vec(mk(IN * CLASSES, 1), (IN, CLASSES), &dev).unwrap();
    let b = Tensor::from_vec(mk(CLASSES, 5), CLASSES, &dev).unwrap();
    vec![
        ("w".into(), Var::from_tensor(&w).unwrap()),
        ("b".into(), Var::from_tensor(&b).unwrap()),
    ]
}

/// Logits `[.., CLASSES]` of features `[.., IN]`.
fn logits(p: &[(String, Var)], x: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let rows = x.reshape(((), IN))?.matmul(p[0].1.as_tensor())?;
    let out = rows.broadcast_add(p[1].1.as_tensor())?;
    out.reshape([&dims[..dims.len() - 1], &[CLASSES]].concat())
}

/// One process, no accelerate-rs: the mean cross-entropy over every target token of the 16
/// sequences, and its gradients.
fn reference() -> HashMap<String, Tensor> {
    let p = params();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for s in 0..SEQS {
        let (len, sx, sy) = sequence(s);
        for t in 0..len {
            if sy[t] != IGNORE {
                x.extend_from_slice(&sx[t * IN..(t + 1) * IN]);
                y.push(sy[t] as u32);
            }
        }
    }
    let n = y.len();
    let x = Tensor::from_vec(x, (n, IN), &Device::Cpu).unwrap();
    let y = Tensor::from_vec(y, n, &Device::Cpu).unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits(&p, &x).unwrap(), &y).unwrap();
    let g = loss.backward().unwrap();
    p.iter()
        .map(|(k, v)| (k.clone(), g.get(v.as_tensor()).unwrap().clone()))
        .collect()
}

/// Copies of the gradients of `p` (they are views into reusable buffers).
fn grads_of(
    p: &[(String, Var)],
    g: &candle_core::backprop::GradStore,
    tag: &str,
) -> accelerate_rs::Result<Vec<(String, Tensor)>> {
    p.iter()
        .map(|(k, v)| {
            let t = g
                .get(v.as_tensor())
                .ok_or_else(|| Error::invalid(k.clone(), "no gradient"))?;
            Ok((format!("{tag}.{k}"), t.copy()?))
        })
        .collect()
}

/// The micro-batches of this rank, in order: `rank, rank + world, ...`.
fn mine(acc: &Accelerator) -> Vec<usize> {
    (acc.rank()..SEQS / 2).step_by(acc.world_size()).collect()
}

/// The step's gradients from token-weighted losses (`token`) and from per-micro-batch means
/// (`mean`), then one SGD step (lr 1) of token-weighted losses through the optimizer wrapper
/// (`step`, the parameters after it).
fn worker() -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let p = params();
    acc.prepare_model(&p)?;
    let mut out = Vec::new();
    let batches = mine(&acc);
    for tag in ["token", "mean"] {
        let mut synced = None;
        for (i, &g) in batches.iter().enumerate() {
            let (x, y) = micro_batch(g);
            let loss = TokenLoss::cross_entropy(&logits(&p, &x)?, &y, Some(IGNORE))?;
            let grads = match tag {
                "token" => acc.backward_tokens(&loss)?,
                // A loop's mean (0, not NaN, for the micro-batch without targets).
                _ => acc.backward(&(loss.sum() / loss.tokens().max(1) as f64)?)?,
            };
            if grads.is_some() != (i + 1 == batches.len()) {
                return Err(Error::invalid("sync", format!("micro-step {i} of {tag}")));
            }
            synced = grads;
        }
        let grads = synced.ok_or_else(|| Error::invalid("sync", "no sync step"))?;
        out.extend(grads_of(&p, &grads, tag)?);
    }
    let vars = p.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = acc.prepare_optimizer(SGD::new(vars, 1.0)?);
    for (i, &g) in batches.iter().enumerate() {
        let (x, y) = micro_batch(g);
        let loss = TokenLoss::cross_entropy(&logits(&p, &x)?, &y, Some(IGNORE))?;
        // The last micro-batch is the loader's last: it syncs even if N were larger.
        let batch = Batch::new(vec![x, y], i, 0, batches.len());
        opt.backward_step_tokens_batch(&loss, &batch)?;
    }
    for (k, v) in &p {
        out.push((format!("step.{k}"), v.as_tensor().copy()?));
    }
    if acc.is_main_process() {
        let path = std::env::var("ACCEL_TEST_OUT")
            .map_err(|_| Error::invalid("ACCEL_TEST_OUT", "unset"))?;
        let out: HashMap<String, Tensor> = out.into_iter().collect();
        candle_core::safetensors::save(&out, path)?;
    }
    Ok(())
}

#[test]
fn token_weights_worker() {
    if std::env::var("ACCEL_TEST_ROLE").as_deref() != Ok("token-weights") {
        return;
    }
    exit_worker(worker());
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn token_weighted_accumulation_on_1_2_and_4_processes_equals_one_big_batch() {
    let want = reference();
    let start: HashMap<String, Tensor> = params()
        .into_iter()
        .map(|(k, v)| (k, v.as_tensor().clone()))
        .collect();
    let exe = std::env::current_exe().unwrap();
    for world in [1usize, 2, 4] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grads.safetensors");
        let res = Command::new(crate::common::launcher())
            .args(["launch", "--cpu", "-n", &world.to_string()])
            .arg(&exe)
            .args([
                "--exact",
                "token_weights::token_weights_worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("ACCEL_TEST_ROLE", "token-weights")
            .env("ACCEL_TEST_OUT", &path)
            .env(
                "ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS",
                (SEQS / 2 / world).to_string(),
            )
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        );
        assert!(res.status.success(), "{world} process(es):\n{text}");
        let got = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        for k in ["w", "b"] {
            let token = max_diff(&got[&format!("token.{k}")], &want[k]);
            assert!(
                token < 1e-6,
                "{world} process(es), {k}: token-weighted off by {token}"
            );
            // SGD with lr 1: the parameters moved by exactly the reference gradient.
            let moved = (&start[k] - &want[k]).unwrap();
            let step = max_diff(&got[&format!("step.{k}")], &moved);
            assert!(step < 1e-6, "{world} process(es), {k}: step off by {step}");
            // Today's per-micro-batch mean is not the mean over the step's tokens.
            let mean = max_diff(&got[&format!("mean.{k}")], &want[k]);
            assert!(
                mean > 1e-3,
                "{world} process(es), {k}: mean loss off by only {mean}"
            );
        }
        assert_eq!(got[&"token.w".to_string()].dtype(), DType::F32);
    }
}

/// The parameters after one SGD step (lr 1) from the reference gradient.
fn stepped() -> HashMap<String, Tensor> {
    let want = reference();
    params()
        .into_iter()
        .map(|(k, v)| {
            let moved = (v.as_tensor() - &want[&k]).unwrap();
            (k, moved)
        })
        .collect()
}

/// ZeRO stage 2 (each rank keeps a slice of the averaged gradients) on 2 in-process ranks: the
/// token weighting happens before the reduce-scatter, so the step is still one big batch's.
#[test]
fn token_weighting_holds_under_zero_stage_2() {
    let want = stepped();
    let results = in_process_with(
        2,
        |c| {
            Accelerator::builder()
                .collective(c)
                .gradient_accumulation_steps(SEQS / 4)
                .zero_stage(2)
        },
        |acc| {
            let p = params();
            let vars = p.iter().map(|(_, v)| v.clone()).collect();
            acc.prepare_model(&p).unwrap();
            let sgd = accelerate_rs::optim::Sgd::new(vars, 1.0.into()).unwrap();
            let mut opt = acc.prepare_optimizer(sgd);
            for g in mine(&acc) {
                let (x, y) = micro_batch(g);
                let loss = TokenLoss::cross_entropy(&logits(&p, &x).unwrap(), &y, Some(IGNORE));
                opt.backward_step_tokens(&loss.unwrap()).unwrap();
            }
            assert!(opt.is_sync_step() && opt.is_sharded());
            p.iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().copy().unwrap()))
                .collect::<HashMap<_, _>>()
        },
    );
    for got in results {
        for k in ["w", "b"] {
            let d = max_diff(&got[k], &want[k]);
            assert!(d < 1e-6, "{k}: off by {d}");
        }
    }
}

/// ZeRO stage 3 (the parameters sharded, one unit): the token-weighted step on 2 ranks with
/// accumulation is one big batch's.
#[test]
fn token_weighting_holds_under_zero_stage_3() {
    let want = stepped();
    let results = in_process_with(
        2,
        |c| {
            Accelerator::builder()
                .collective(c)
                .gradient_accumulation_steps(SEQS / 4)
                .zero_stage(3)
        },
        |acc| {
            let p = params();
            let vars = p.iter().map(|(_, v)| v.clone()).collect();
            let sgd = accelerate_rs::optim::Sgd::new(vars, 1.0.into()).unwrap();
            let loader = accelerate_rs::DataLoader::new(
                accelerate_rs::TensorDataset::new(vec![
                    Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap()
                ])
                .unwrap(),
                1,
            );
            let policy = accelerate_rs::WrapPolicy::one_unit();
            let (mut opt, _, model) = acc.prepare_sharded(&p, &policy, sgd, loader).unwrap();
            let (wd, bd) = (p[0].1.dims().to_vec(), p[1].1.dims().to_vec());
            for g in mine(&acc) {
                let (x, y) = micro_batch(g);
                let (wd, bd) = (wd.clone(), bd.clone());
                let out = model
                    .run("", &x, move |vb, x| {
                        let w = vb.get(wd.clone(), "w")?;
                        let b = vb.get(bd.clone(), "b")?;
                        let dims = x.dims().to_vec();
                        let rows = x.reshape(((), IN))?.matmul(&w)?.broadcast_add(&b)?;
                        rows.reshape([&dims[..dims.len() - 1], &[CLASSES]].concat())
                    })
                    .unwrap();
                let loss = TokenLoss::cross_entropy(&out, &y, Some(IGNORE));
                opt.backward_step_tokens(&loss.unwrap()).unwrap();
            }
            assert!(opt.is_sync_step() && model.is_sharded());
            model
                .full_parameters()
                .unwrap()
                .into_iter()
                .collect::<HashMap<_, _>>()
        },
    );
    for got in results {
        for k in ["w", "b"] {
            let d = max_diff(&got[k], &want[k]);
            assert!(d < 1e-6, "{k}: off by {d}");
        }
    }
}

/// Mixed precision (bf16 and f16 working copies, f32 masters) on 2 in-process ranks: the masters
/// take one big batch's step, within the half types' rounding.
#[test]
fn token_weighting_holds_under_mixed_precision() {
    let want = stepped();
    for mode in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        let results = in_process_with(
            2,
            move |c| {
                Accelerator::builder()
                    .collective(c)
                    .gradient_accumulation_steps(SEQS / 4)
                    .mixed_precision(mode)
            },
            |acc| {
                let master = VarMap::new();
                for (k, v) in params() {
                    master
                        .get(
                            v.dims(),
                            &k,
                            candle_nn::Init::Const(0.0),
                            DType::F32,
                            &Device::Cpu,
                        )
                        .unwrap();
                    master.data().lock().unwrap()[&k]
                        .set(v.as_tensor())
                        .unwrap();
                }
                let sgd = SGD::new(master.all_vars(), 1.0).unwrap();
                let data =
                    TensorDataset::new(vec![Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap()]);
                let loader = DataLoader::new(data.unwrap(), 1);
                let (mut opt, _, work) = acc.prepare_mixed(&master, sgd, loader).unwrap();
                let dtype = opt.compute_dtype();
                let named = |m: &VarMap| {
                    let data = m.data().lock().unwrap();
                    ["w", "b"]
                        .map(|k| (k.to_string(), data[k].clone()))
                        .to_vec()
                };
                let p = named(&work);
                for g in mine(&acc) {
                    let (x, y) = micro_batch(g);
                    let out = logits(&p, &x.to_dtype(dtype).unwrap()).unwrap();
                    let out = out.to_dtype(DType::F32).unwrap();
                    let loss = TokenLoss::cross_entropy(&out, &y, Some(IGNORE)).unwrap();
                    opt.backward_step_tokens(&loss).unwrap();
                }
                assert!(opt.is_sync_step());
                named(&master)
                    .into_iter()
                    .map(|(k, v)| (k, v.as_tensor().copy().unwrap()))
                    .collect::<HashMap<_, _>>()
            },
        );
        for got in results {
            for k in ["w", "b"] {
                let d = max_diff(&got[k], &want[k]);
                assert!(d < 2e-2, "{mode:?} {k}: off by {d}");
            }
        }
    }
}
