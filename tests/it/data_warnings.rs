//! The first hour's silent mistakes, said out loud by the main process: ranks that all train on
//! the same batches (the data was not sharded), a global batch that does not divide by the
//! number of processes, rows that `shard_rows` leaves out. Real processes (the self-launch of
//! this test binary on `data_warnings::worker_entry`, idle unless `ACCEL_DATA_WARN` is set).

use std::process::Output;

use accelerate_rs::{Accelerator, DataLoader, TensorDataset};
use candle_core::{DType, Module, Tensor};
use candle_nn::{linear, loss, Optimizer, VarMap, SGD};

use crate::self_launch::test_parent;

const MODE: &str = "ACCEL_DATA_WARN";

#[test]
fn worker_entry() {
    let Ok(mode) = std::env::var(MODE) else {
        return;
    };
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let dev = acc.device().clone();
    if mode.starts_with("mixed") {
        return mixed_worker(&acc, &mode);
    }
    let rows = if mode == "uneven" { 100 } else { 96 };
    let x: Vec<f32> = (0..rows * 4)
        .map(|i| ((i * 7 % 13) as f32) / 6.0 - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (rows, 4), &dev).unwrap();
    let y = x.sum_keepdim(1).unwrap();
    // "unsharded": every rank trains on all the rows, the mistake the check is for.
    let (x, y) = if mode == "unsharded" {
        (x, y)
    } else {
        (acc.shard_rows(&x).unwrap(), acc.shard_rows(&y).unwrap())
    };
    let varmap = VarMap::new();
    let model = linear(4, 1, acc.var_builder(&varmap, DType::F32).pp("fc")).unwrap();
    acc.prepare_model(&varmap).unwrap();
    let mut opt = acc.prepare_optimizer(SGD::new(varmap.all_vars(), 0.05).unwrap());
    let global = if mode == "uneven" { 50 } else { 48 };
    let bs = acc.local_batch_size(global);
    for i in 0..x.dim(0).unwrap() / bs {
        let (xb, yb) = (
            x.narrow(0, i * bs, bs).unwrap(),
            y.narrow(0, i * bs, bs).unwrap(),
        );
        let l = loss::mse(&model.forward(&xb).unwrap(), &yb).unwrap();
        opt.backward_step(&l).unwrap();
    }
    println!("done rank {}", acc.rank());
}

/// Under `ACCELERATE_RS_MIXED_PRECISION=bf16`: `prepare` twice ("mixed", which trains in f32
/// and is told so once), or `prepare_mixed` ("mixed-applied", which applies the mode).
fn mixed_worker(acc: &Accelerator, mode: &str) {
    let dev = acc.device().clone();
    // Each rank its own data (the same data everywhere has a warning of its own).
    let x = (Tensor::ones((8, 4), DType::F32, &dev).unwrap() * (acc.rank() + 1) as f64).unwrap();
    for i in 0..2 {
        // Two models, prepared one after the other.
        let name = format!("fc{i}");
        let varmap = VarMap::new();
        let model = linear(4, 1, acc.var_builder(&varmap, DType::F32).pp(&name)).unwrap();
        let loader = DataLoader::new(TensorDataset::new(vec![x.clone()]).unwrap(), 4);
        let opt = SGD::new(varmap.all_vars(), 0.05).unwrap();
        if mode == "mixed" {
            let (mut opt, _) = acc.prepare(&varmap, opt, loader).unwrap();
            opt.backward_step(&model.forward(&x).unwrap().sum_all().unwrap())
                .unwrap();
        } else {
            let (mut opt, _, work) = acc.prepare_mixed(&varmap, opt, loader).unwrap();
            let half = linear(4, 1, acc.var_builder(&work, DType::BF16).pp(&name)).unwrap();
            let out = half.forward(&x.to_dtype(DType::BF16).unwrap()).unwrap();
            opt.backward_step(&out.to_dtype(DType::F32).unwrap().sum_all().unwrap())
                .unwrap();
        }
    }
    println!("done rank {}", acc.rank());
}

fn run(mode: &str, n: usize) -> (Output, String) {
    let out = test_parent("data_warnings::worker_entry", n)
        .env(MODE, mode)
        .env(
            "ACCELERATE_RS_MIXED_PRECISION",
            if mode.starts_with("mixed") {
                "bf16"
            } else {
                "no"
            },
        )
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{mode} on {n}:\n{text}");
    (out, text)
}

#[test]
fn ranks_training_on_the_same_batches_are_told_once_by_the_main_process() {
    let (_, text) = run("unsharded", 2);
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("computed the same gradients"))
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].starts_with("[rank 0]"), "{text}");
    assert!(warnings[0].contains("all 2 ranks (0 to 1)"), "{text}");
    assert!(warnings[0].contains("shard_rows"), "{text}");
    // Sharded data: no warning, and nothing about sizes either (96 and 48 divide by 2 and 3).
    for n in [2, 3] {
        let (_, text) = run("sharded", n);
        assert!(
            !text.contains("accelerate-rs: warning"),
            "{n} processes:\n{text}"
        );
        assert_eq!(text.matches("done rank").count(), n, "{text}");
    }
}

#[test]
fn a_global_batch_that_does_not_divide_and_rows_left_out_are_warned_with_the_sizes() {
    let (_, text) = run("uneven", 3);
    let batch = text
        .lines()
        .find(|l| l.contains("local_batch_size:"))
        .unwrap_or_else(|| panic!("no batch warning in:\n{text}"));
    assert!(batch.starts_with("[rank 0]"), "{batch}");
    for part in [
        "global batch of 50 does not divide by 3 processes",
        "every rank takes 16 per step",
        "sees 48 samples instead of 50",
        "e.g. 48 or 51",
    ] {
        assert!(batch.contains(part), "{part:?} not in {batch}");
    }
    let rows = text
        .lines()
        .find(|l| l.contains("shard_rows:"))
        .unwrap_or_else(|| panic!("no rows warning in:\n{text}"));
    assert!(
        rows.contains("100 rows do not divide by 3 processes")
            && rows.contains("takes 33 rows")
            && rows.contains("last 1 row(s)"),
        "{rows}"
    );
    // Once each, although shard_rows was called for x and y.
    assert_eq!(text.matches("shard_rows:").count(), 1, "{text}");
    assert_eq!(text.matches("local_batch_size:").count(), 1, "{text}");
}

/// Mixed precision set but `prepare` used: the parameters train in f32, and the main process
/// says so once, naming `prepare_mixed`; `prepare_mixed` itself is silent.
#[test]
fn mixed_precision_that_prepare_does_not_apply_is_told_once() {
    let (_, text) = run("mixed", 2);
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("mixed precision bf16 is set"))
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].starts_with("[rank 0]"), "{text}");
    assert!(warnings[0].contains("prepare_mixed"), "{text}");
    let (_, text) = run("mixed-applied", 2);
    assert!(!text.contains("accelerate-rs: warning"), "{text}");
    assert_eq!(text.matches("done rank").count(), 2, "{text}");
}
