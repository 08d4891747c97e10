//! DP: one process, several model replicas, one thread each (`AcceleratorBuilder::run`), with
//! CPU replicas over the in-process threads backend.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use accelerate_rs::ReduceOp;
use accelerate_rs::TensorDataset;
use accelerate_rs::{Accelerator, AcceleratorBuilder, DataLoader, DistributedType, Error};
use candle_core::{Device, Tensor, Var};

use crate::common::tiny::{max_abs_diff, params, reference, snapshot, train, HIDDEN};

const B: usize = 8; // per-replica batch
const K: usize = 6; // SGD steps

fn dp(replicas: usize) -> AcceleratorBuilder {
    Accelerator::builder()
        .cpu(true)
        .data_parallel(replicas)
        .timeout(Duration::from_secs(60))
}

#[test]
fn each_replica_gets_its_own_accelerator_and_thread() {
    let out = dp(3)
        .run(|acc| {
            Ok((
                acc.rank(),
                acc.local_rank(),
                acc.world_size(),
                acc.distributed_type(),
                acc.is_main_process(),
                matches!(acc.device(), Device::Cpu),
                acc.collective().backend(),
                std::thread::current().name().map(str::to_string),
            ))
        })
        .unwrap();
    assert_eq!(out.len(), 3);
    for (i, r) in out.into_iter().enumerate() {
        assert_eq!(
            r,
            (
                i,
                i,
                3,
                DistributedType::Dp,
                i == 0,
                true,
                "threads",
                Some(format!("accelerate-rs-replica-{i}"))
            )
        );
    }
}

#[test]
fn replicas_get_disjoint_slices_of_every_global_batch() {
    const R: usize = 3;
    const PER: usize = 4;
    const STEPS: usize = 5;
    let n = R * PER * STEPS;
    let out = dp(R)
        .run(|acc| {
            let idx = Tensor::arange(0f32, n as f32, &Device::Cpu)?;
            let loader =
                acc.prepare_data_loader(DataLoader::new(TensorDataset::new(vec![idx])?, PER))?;
            let c = acc.collective();
            let mut steps = Vec::new();
            for b in loader.iter()? {
                let mine = b?[0].clone();
                let all = c.all_gather_tensor(&mine)?.to_vec1::<f32>()?;
                steps.push((mine.to_vec1::<f32>()?, all));
            }
            // Equal batch counts: every replica reports how many batches it saw.
            let counts = c
                .all_gather_tensor(&Tensor::new(&[steps.len() as f32], &Device::Cpu)?)?
                .to_vec1::<f32>()?;
            Ok((steps, counts))
        })
        .unwrap();
    let mut seen = BTreeSet::new();
    for (r, (steps, counts)) in out.iter().enumerate() {
        assert_eq!(counts, &vec![STEPS as f32; R], "replica {r}");
        assert_eq!(steps.len(), STEPS, "replica {r}");
        for (s, (mine, all)) in steps.iter().enumerate() {
            assert_eq!(mine.len(), PER, "replica {r} step {s}");
            // The gathered global batch is the replicas' slices in replica order, all distinct.
            assert_eq!(all.len(), R * PER);
            assert_eq!(&all[r * PER..(r + 1) * PER], &mine[..]);
            let distinct: BTreeSet<u32> = all.iter().map(|&v| v as u32).collect();
            assert_eq!(distinct.len(), R * PER, "step {s}: {all:?}");
            // Every replica saw the same global batch.
            assert_eq!(all, &out[0].0[s].1);
            seen.extend(mine.iter().map(|&v| v as u32));
        }
    }
    assert_eq!(seen, (0..n as u32).collect::<BTreeSet<_>>());
}

#[test]
fn gradients_are_averaged_across_replicas() {
    let out = dp(3)
        .run(|acc| {
            let w = Var::new(&[1.0f32, 2.0, 3.0], &Device::Cpu)?;
            acc.prepare_model(&vec![("w".to_string(), w.clone())])?;
            // Replica r's gradient is (r + 1) * [1, 4, 9]... made replica-dependent and nonlinear.
            let scale = acc.rank() as f64 + 1.0;
            let loss = ((w.as_tensor().sqr()? * scale)?.sum_all()? * 0.5)?;
            let grads = acc
                .backward(&loss)?
                .ok_or_else(|| Error::invalid("grads", "not a sync step"))?;
            let g = grads
                .get(w.as_tensor())
                .ok_or_else(|| Error::invalid("grad", "missing"))?;
            Ok(g.to_vec1::<f32>()?)
        })
        .unwrap();
    // d/dw of 0.5 * s * w^2 = s * w; mean of s over 1, 2, 3 is 2.
    for g in out {
        assert_eq!(g, vec![2.0, 4.0, 6.0]);
    }
}

#[test]
fn replicas_are_bit_identical_after_k_steps() {
    let out = dp(3)
        .run(|acc| {
            let p = params(acc.rank() as f32 * 0.5, HIDDEN);
            train(&acc, &p, B, K)?;
            Ok(snapshot(&p))
        })
        .unwrap();
    for (r, s) in out.iter().enumerate() {
        assert_eq!(max_abs_diff(s, &out[0]), 0.0, "replica {r} differs");
    }
    // Training moved the parameters, so the comparison means something.
    assert!(max_abs_diff(&snapshot(&params(0.0, HIDDEN)), &out[0]) > 1e-3);
}

fn check_equivalence(replicas: usize) {
    let out = dp(replicas)
        .run(|acc| {
            // Replicas other than 0 start elsewhere: prepare must broadcast replica 0's values.
            let p = params(acc.rank() as f32, HIDDEN);
            train(&acc, &p, B, K)?;
            Ok(snapshot(&p))
        })
        .unwrap();
    assert_eq!(out.len(), replicas);
    let single = reference(replicas * B, K);
    for (r, s) in out.iter().enumerate() {
        let diff = max_abs_diff(s, &single);
        assert!(diff <= 1e-5, "replica {r}: max abs diff {diff}");
    }
    assert!(max_abs_diff(&snapshot(&params(0.0, HIDDEN)), &single) > 1e-3);
}

#[test]
fn two_replicas_with_batch_b_equal_one_with_batch_2b() {
    check_equivalence(2);
}

#[test]
fn three_replicas_with_batch_b_equal_one_with_batch_3b() {
    check_equivalence(3);
}

#[test]
fn without_dp_run_calls_f_once_on_the_calling_thread() {
    let caller = std::thread::current().id();
    for builder in [
        Accelerator::builder().cpu(true).data_parallel(1),
        Accelerator::builder().cpu(true).world_size(1).rank(0),
    ] {
        let calls = AtomicUsize::new(0);
        let out = builder
            .run(|acc| {
                calls.fetch_add(1, Ordering::SeqCst);
                assert_eq!(std::thread::current().id(), caller);
                Ok((acc.world_size(), acc.distributed_type()))
            })
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(out, vec![(1, DistributedType::No)]);
    }
}

/// Replicas other than `bad` keep all-reducing; `bad` fails after a few rounds.
fn run_with_a_failing_replica(bad: usize, panic: bool) -> (String, Duration) {
    let start = Instant::now();
    let err = dp(3)
        .run(|acc| {
            let c = acc.collective();
            for round in 0..1000 {
                if acc.rank() == bad && round == 3 {
                    if panic {
                        panic!("replica exploded on purpose");
                    }
                    return Err(Error::invalid("test", "boom on purpose"));
                }
                let mut v = [1.0f32; 16];
                c.all_reduce((&mut v[..]).into(), ReduceOp::Sum)?;
            }
            Ok(())
        })
        .unwrap_err();
    (err.to_string(), start.elapsed())
}

#[test]
fn a_replica_returning_an_error_fails_run_naming_it_without_hanging() {
    let (e, took) = run_with_a_failing_replica(1, false);
    assert!(e.contains("DP replica 1 of 3 failed"), "{e}");
    assert!(e.contains("boom on purpose"), "{e}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn a_panicking_replica_fails_run_naming_it_without_hanging() {
    let (e, took) = run_with_a_failing_replica(2, true);
    assert!(e.contains("DP replica 2 of 3 panicked"), "{e}");
    assert!(e.contains("replica exploded on purpose"), "{e}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

#[test]
fn a_replica_failing_in_prepare_names_the_replica() {
    let err = dp(2)
        .run(|acc| {
            // Replica 1 disagrees on a shape: prepare fails on every replica, none hangs.
            let p = if acc.rank() == 1 {
                vec![("w".to_string(), Var::new(&[1.0f32, 2.0], &Device::Cpu)?)]
            } else {
                vec![("w".to_string(), Var::new(&[1.0f32], &Device::Cpu)?)]
            };
            acc.prepare_model(&p)
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("DP replica"), "{err}");
    assert!(err.contains("parameter `w`"), "{err}");
}

#[test]
#[allow(unexpected_cfgs)] // the `cuda` feature arrives with the NCCL backend
fn dp_on_gpus_is_not_available_in_a_cpu_build() {
    if cfg!(feature = "cuda") {
        return;
    }
    let calls = AtomicUsize::new(0);
    let err = Accelerator::builder()
        .cpu(false)
        .data_parallel(2)
        .run(|_| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    match &err {
        Error::NotAvailable { what, reason } => {
            assert_eq!(what, "CUDA");
            assert!(reason.contains("without the `cuda` feature"), "{reason}");
            assert!(reason.contains(".cpu(true)"), "{reason}");
        }
        other => panic!("expected NotAvailable, got {other:?}"),
    }
}

#[test]
fn dp_with_several_processes_is_an_error() {
    let err = dp(2)
        .world_size(2)
        .rank(0)
        .run(|_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("one process"), "{err}");
    assert!(err.contains("launch -n"), "{err}");
}

#[test]
fn build_refuses_dp_and_points_to_run() {
    let err = dp(2).build().unwrap_err().to_string();
    assert!(err.contains("AcceleratorBuilder::run"), "{err}");
    let err = dp(0).run(|_| Ok(())).unwrap_err().to_string();
    assert!(err.contains("data_parallel"), "{err}");
}

/// Re-run by `the_environment_variable_asks_for_dp` with `ACCELERATE_RS_DATA_PARALLEL` set;
/// does nothing otherwise.
#[test]
fn dp_env_child() {
    if std::env::var("ACCEL_TEST_DP_CHILD").is_err() {
        return;
    }
    let out = Accelerator::builder()
        .run(|acc| Ok((acc.rank(), acc.world_size(), acc.distributed_type())))
        .unwrap();
    println!("DP-CHILD {out:?}");
}

#[test]
fn the_environment_variable_asks_for_dp() {
    let res = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "dp::dp_env_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_DP_CHILD", "1")
        .env("ACCELERATE_RS_DATA_PARALLEL", "3")
        .env("ACCELERATE_RS_USE_CPU", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{text}");
    assert!(
        text.contains("DP-CHILD [(0, 3, Dp), (1, 3, Dp), (2, 3, Dp)]"),
        "{text}"
    );
}
