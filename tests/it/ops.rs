//! The user collectives of `accelerate_rs::ops`: in-process ranks over the threads backend, and one
//! real multi-process run under `accelerate-rs launch` (re-running this test binary: `ops_worker`
//! does nothing unless `ACCEL_TEST_ROLE` is set).

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::in_process;
use accelerate_rs::ReduceOp;
use accelerate_rs::{Accelerator, DataLoader, Error, TensorDataset};
use candle_core::{DType, Device, Tensor};
use rand::RngCore;

/// A dataset of the values `0..n` (one f32 field).
fn values(n: usize) -> TensorDataset {
    let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
    TensorDataset::new(vec![Tensor::new(v, &Device::Cpu).unwrap()]).unwrap()
}

/// One epoch of `n` values in batches of `batch` per rank: (gather_for_metrics, gather) outputs
/// concatenated over the batches, and the loader's total padding.
fn epoch(
    acc: &Accelerator,
    n: usize,
    batch: usize,
) -> accelerate_rs::Result<(Vec<f32>, Vec<f32>, usize)> {
    let loader = acc.prepare_data_loader(DataLoader::new(values(n), batch).shuffle(true))?;
    let (mut metrics, mut plain) = (Vec::new(), Vec::new());
    for b in loader.iter()? {
        let b = b?;
        metrics.extend(acc.gather_for_metrics(&b[0], &b)?.to_vec1::<f32>()?);
        plain.extend(acc.gather(&b[0])?.to_vec1::<f32>()?);
    }
    Ok((metrics, plain, loader.total_padding()))
}

fn sorted(mut v: Vec<f32>) -> Vec<f32> {
    v.sort_by(f32::total_cmp);
    v
}

fn range(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

/// Checks one epoch's results: every sample exactly once, plain gather has the duplicates.
fn check_epoch(world: usize, n: usize, (metrics, plain, padding): &(Vec<f32>, Vec<f32>, usize)) {
    assert_eq!(
        sorted(metrics.clone()),
        range(n),
        "world {world}, {n} samples"
    );
    assert_eq!(plain.len(), n + padding, "world {world}, {n} samples");
    if *padding > 0 {
        assert_ne!(sorted(plain.clone()), range(n));
    }
}

#[test]
fn gather_for_metrics_counts_every_sample_once_in_process() {
    // (world, samples): 9 over 2 and 4 ranks and 10 over 3 pad the last batch; 9 over 3 does not.
    for (world, n, padded) in [(2, 9, true), (3, 9, false), (3, 10, true), (4, 9, true)] {
        let results = in_process(world, move |acc| epoch(&acc, n, 2).unwrap());
        for r in &results {
            check_epoch(world, n, r);
            assert_eq!(r.2 > 0, padded, "world {world}, {n} samples");
            assert_eq!(r.0, results[0].0, "every rank gets the same result");
        }
    }
}

#[test]
fn batch_global_padding_is_zero_except_in_the_last_batch() {
    let results = in_process(2, |acc| {
        let loader = acc
            .prepare_data_loader(DataLoader::new(values(9), 2))
            .unwrap();
        loader
            .iter()
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                (b.is_last(), b.padding(), b.global_padding())
            })
            .collect::<Vec<_>>()
    });
    // 9 samples, 2 ranks, batch 2: global batches of 4, 4, 2 positions; position 9 is padding.
    assert_eq!(results[0], vec![(false, 0, 0), (false, 0, 0), (true, 0, 1)]);
    assert_eq!(results[1], vec![(false, 0, 0), (false, 0, 0), (true, 1, 1)]);
}

#[test]
fn reduce_broadcast_gather_values() {
    let results = in_process(3, |acc| {
        let r = acc.rank() as f32;
        let t = Tensor::new(&[r, 10.0 * r], &Device::Cpu).unwrap();
        let sum = acc.reduce(&t, ReduceOp::Sum).unwrap();
        let mean = acc.reduce(&t, ReduceOp::Mean).unwrap();
        let max = acc.reduce(&t, ReduceOp::Max).unwrap();
        let b = acc.broadcast(&t, 2).unwrap();
        // Ragged first dims: rank r sends r + 1 rows of 2.
        let rows = Tensor::full(r, (acc.rank() + 1, 2), &Device::Cpu).unwrap();
        let g = acc.gather(&rows).unwrap();
        let scalar = acc.gather(&Tensor::new(r, &Device::Cpu).unwrap()).unwrap();
        let bad_root = acc.broadcast(&t, 3).unwrap_err().to_string();
        (
            sum.to_vec1::<f32>().unwrap(),
            mean.to_vec1::<f32>().unwrap(),
            max.to_vec1::<f32>().unwrap(),
            b.to_vec1::<f32>().unwrap(),
            g.to_vec2::<f32>().unwrap(),
            scalar.to_vec1::<f32>().unwrap(),
            bad_root,
        )
    });
    for (sum, mean, max, b, g, scalar, bad_root) in results {
        assert_eq!(sum, vec![3.0, 30.0]);
        assert_eq!(mean, vec![1.0, 10.0]);
        assert_eq!(max, vec![2.0, 20.0]);
        assert_eq!(b, vec![2.0, 20.0]);
        let expect: Vec<Vec<f32>> = [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
            .iter()
            .map(|&v| vec![v, v])
            .collect();
        assert_eq!(g, expect);
        assert_eq!(scalar, vec![0.0, 1.0, 2.0]);
        assert!(bad_root.contains("root 3"), "{bad_root}");
    }
}

#[test]
fn world_size_one_short_circuits() {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let t = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    assert_eq!(
        acc.reduce(&t, ReduceOp::Mean)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(
        acc.gather(&t).unwrap().to_vec1::<f32>().unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(
        acc.broadcast(&t, 0).unwrap().to_vec1::<f32>().unwrap(),
        vec![1.0, 2.0]
    );
    assert!(acc.broadcast(&t, 1).is_err());
    assert_eq!(
        acc.pad_across_processes(&t, 0, 0.0, false).unwrap().dims(),
        &[2]
    );
    assert!(acc.pad_across_processes(&t, 1, 0.0, false).is_err());
    acc.debug_shapes("test", &t).unwrap();
    assert_eq!(acc.main_process_first(|| 7).unwrap(), 7);
    let (metrics, _, padding) = epoch(&acc, 9, 2).unwrap();
    assert_eq!((sorted(metrics), padding), (range(9), 0));
}

#[test]
fn pad_across_processes_pads_to_the_longest() {
    let results = in_process(3, |acc| {
        let len = acc.rank() + 1;
        let t = Tensor::ones((2, len), DType::F32, &Device::Cpu).unwrap();
        let end = acc.pad_across_processes(&t, 1, -1.0, false).unwrap();
        let first = acc.pad_across_processes(&t, 1, -1.0, true).unwrap();
        // Dim 0 is the same everywhere: nothing to pad.
        let same = acc.pad_across_processes(&t, 0, -1.0, false).unwrap();
        // A dim that does not exist on rank 2 fails on every rank, naming the ranks.
        let u = if acc.rank() == 2 {
            Tensor::ones(3, DType::F32, &Device::Cpu).unwrap()
        } else {
            t.clone()
        };
        let err = acc
            .pad_across_processes(&u, 1, 0.0, false)
            .unwrap_err()
            .to_string();
        (
            end.to_vec2::<f32>().unwrap(),
            first.to_vec2::<f32>().unwrap(),
            same.dims().to_vec(),
            err,
        )
    });
    for (r, (end, first, same, err)) in results.into_iter().enumerate() {
        let ones = r + 1;
        let row_end: Vec<f32> = (0..3).map(|i| if i < ones { 1.0 } else { -1.0 }).collect();
        let row_first: Vec<f32> = (0..3)
            .map(|i| if i >= 3 - ones { 1.0 } else { -1.0 })
            .collect();
        assert_eq!(end, vec![row_end.clone(), row_end]);
        assert_eq!(first, vec![row_first.clone(), row_first]);
        assert_eq!(same, vec![2, ones]);
        assert!(err.contains("pad_across_processes"), "{err}");
        assert!(err.contains("rank 2: 1 dims (dim out of range)"), "{err}");
    }
}

#[test]
fn main_process_first_runs_main_before_the_others() {
    let cache = Arc::new(AtomicBool::new(false));
    let c = cache.clone();
    let results = in_process(3, move |acc| {
        let c = c.clone();
        let main = acc.is_main_process();
        acc.main_process_first(move || {
            if main {
                // Give the others a chance to run early, were the barrier missing.
                std::thread::sleep(Duration::from_millis(200));
                c.store(true, Ordering::SeqCst);
                true
            } else {
                c.load(Ordering::SeqCst)
            }
        })
        .unwrap()
    });
    assert_eq!(results, vec![true, true, true]);
    assert!(cache.load(Ordering::SeqCst));

    let seen = Arc::new(AtomicBool::new(false));
    let s = seen.clone();
    let results = in_process(2, move |acc| {
        let s = s.clone();
        let local_main = acc.is_local_main_process();
        acc.local_main_process_first(move || {
            if local_main {
                std::thread::sleep(Duration::from_millis(100));
                s.store(true, Ordering::SeqCst);
            }
            s.load(Ordering::SeqCst)
        })
        .unwrap()
    });
    assert_eq!(results, vec![true, true]);
}

#[test]
fn split_between_processes_for_worlds_one_to_five() {
    for world in 1..=5 {
        for n in [0usize, 1, 3, 4, 7, 10, 11] {
            let items: Vec<usize> = (0..n).collect();
            let shares = in_process(world, {
                let items = items.clone();
                move |acc| {
                    (
                        acc.split_between_processes(&items),
                        acc.split_between_processes_padded(&items),
                    )
                }
            });
            let sizes: Vec<usize> = shares.iter().map(|s| s.0.len()).collect();
            let (lo, hi) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "world {world}, {n} items: {sizes:?}");
            assert!(
                sizes.windows(2).all(|w| w[0] >= w[1]),
                "larger shares first: {sizes:?}"
            );
            let joined: Vec<usize> = shares.iter().flat_map(|s| s.0.clone()).collect();
            assert_eq!(joined, items, "world {world}, {n} items");

            let want = n.div_ceil(world);
            for (share, (padded, pad)) in &shares {
                if n == 0 {
                    assert!(padded.is_empty() && *pad == 0);
                    continue;
                }
                assert_eq!(padded.len(), want, "world {world}, {n} items");
                assert_eq!(&padded[..share.len()], &share[..]);
                assert_eq!(*pad, want - share.len());
                let last = *share.last().unwrap_or(&items[n - 1]);
                assert!(padded[share.len()..].iter().all(|&x| x == last));
            }
        }
    }
}

#[test]
fn debug_shapes_error_lists_every_rank() {
    let errs = in_process(3, |acc| {
        let t = Tensor::zeros((2, 3 + acc.rank()), DType::F32, &Device::Cpu).unwrap();
        let same = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        acc.debug_shapes("agree", &same).unwrap();
        acc.debug_shapes("reduce", &t).unwrap_err()
    });
    for (r, e) in errs.into_iter().enumerate() {
        match &e {
            Error::Mismatch { rank, op, detail } => {
                assert_eq!(*rank, r);
                assert_eq!(op, "reduce");
                assert_eq!(
                    detail,
                    "rank 0: [2, 3] f32, rank 1: [2, 4] f32, rank 2: [2, 5] f32"
                );
            }
            other => panic!("expected Mismatch, got {other}"),
        }
    }
}

#[test]
fn set_seed_gives_the_same_rng_on_every_rank() {
    let draws = in_process(3, |acc| {
        let mut rng = acc.set_seed(42).unwrap();
        (0..4).map(|_| rng.next_u64()).collect::<Vec<_>>()
    });
    assert!(draws.iter().all(|d| d == &draws[0]));
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    let mut other = acc.set_seed(43).unwrap();
    assert_ne!(other.next_u64(), draws[0][0]);
}

/// The multi-process worker: `ACCELERATE_RS_DEBUG=1` is set, so `gather` checks shapes first.
fn worker() -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let world = acc.world_size();
    for n in [9, 10] {
        let (metrics, plain, padding) = epoch(&acc, n, 2)?;
        if sorted(metrics.clone()) != range(n) || plain.len() != n + padding {
            return Err(Error::invalid(
                "gather_for_metrics",
                format!(
                    "rank {}: {n} samples over {world} ranks gave {metrics:?} (plain {plain:?})",
                    acc.rank()
                ),
            ));
        }
    }
    // Debug mode: mismatched shapes fail `reduce` on every rank, listing every rank's shape.
    let t = Tensor::zeros(2 + acc.rank(), DType::F32, acc.device())?;
    match acc.reduce(&t, ReduceOp::Sum) {
        Err(Error::Mismatch { detail, .. })
            if detail == "rank 0: [2] f32, rank 1: [3] f32, rank 2: [4] f32" => {}
        other => {
            return Err(Error::invalid(
                "debug mode",
                format!(
                    "rank {}: expected a shape mismatch, got {other:?}",
                    acc.rank()
                ),
            ))
        }
    }
    println!("ops worker rank {} ok", acc.rank());
    Ok(())
}

#[test]
fn ops_worker() {
    if std::env::var("ACCEL_TEST_ROLE").is_err() {
        return;
    }
    match worker() {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("worker failed: {e}");
            std::process::exit(1);
        }
    }
}

#[test]
fn gather_for_metrics_across_three_processes() {
    let exe = std::env::current_exe().unwrap();
    let res = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", "3"])
        .arg(exe)
        .args([
            "--exact",
            "ops::ops_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_ROLE", "ops")
        .env("ACCELERATE_RS_DEBUG", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(res.status.success(), "launch failed:\n{text}");
    for r in 0..3 {
        assert!(text.contains(&format!("ops worker rank {r} ok")), "{text}");
    }
}
