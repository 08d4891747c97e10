//! Batch semantics: with `split_batches` (here through `ACCELERATE_RS_SPLIT_BATCHES`) the
//! loader's batch size is the global one, so 1, 2 and 4 processes take the same optimizer steps
//! on the same samples and end with the same parameters; without it the batch size is per rank.
//!
//! The workers re-run this test binary under `accelerate-rs launch`: `batching::worker_entry`
//! does nothing unless `ACCEL_BATCH_OUT` is set.

use std::collections::HashMap;
use std::process::{Command, Stdio};

use crate::common::tiny::{dataset, forward, max_abs_diff, params, snapshot, HIDDEN};
use accelerate_rs::{Accelerator, DataLoader};
use candle_core::{Tensor, Var};
use candle_nn::{loss, Optimizer, SGD};

const OUT_VAR: &str = "ACCEL_BATCH_OUT";

/// Two epochs of SGD over 64 shuffled samples in batches of 16; the optimizer steps taken.
fn train(acc: &Accelerator, p: &[(String, Var)]) -> accelerate_rs::Result<usize> {
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let loader = DataLoader::new(dataset(64), 16).shuffle(true).seed(3);
    let (mut opt, mut loader) = acc.prepare(p, SGD::new(vars, 0.1)?, loader)?;
    let mut steps = 0;
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        for b in loader.iter()? {
            let b = b?;
            opt.backward_step(&loss::cross_entropy(&forward(p, &b[0])?, &b[1])?)?;
            steps += 1;
        }
    }
    Ok(steps)
}

fn run(n: usize, split: bool) -> (HashMap<String, Tensor>, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("params.safetensors");
    let o = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", &n.to_string()])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "batching::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(OUT_VAR, &out)
        .env("ACCELERATE_RS_SPLIT_BATCHES", if split { "1" } else { "0" })
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{n} processes:\n{text}");
    (
        candle_core::safetensors::load(&out, &candle_core::Device::Cpu).unwrap(),
        text,
    )
}

#[test]
fn split_batches_gives_the_same_parameters_at_world_sizes_1_2_and_4() {
    let (one, text) = run(1, true);
    assert!(text.contains("steps=8"), "{text}");
    for n in [2, 4] {
        let (got, text) = run(n, true);
        assert!(text.contains("steps=8"), "{n} processes: {text}");
        let d = max_abs_diff(&one, &got);
        assert!(d < 1e-5, "{n} processes end {d} away from one process");
    }
    // Without it the batch is per rank: 2 processes take half the steps and end elsewhere.
    let (two, text) = run(2, false);
    assert!(text.contains("steps=4"), "{text}");
    assert!(max_abs_diff(&one, &two) > 1e-3);
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(out) = std::env::var(OUT_VAR) else {
        return;
    };
    let result = Accelerator::new().and_then(|acc| {
        let p = params(0.0, HIDDEN);
        let steps = train(&acc, &p)?;
        println!("steps={steps}");
        if acc.is_main_process() {
            candle_core::safetensors::save(&snapshot(&p), &out)?;
        }
        Ok(())
    });
    crate::common::exit_worker(result)
}
