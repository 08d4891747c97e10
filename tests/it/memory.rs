//! `estimate-memory`'s prediction (`accelerate_rs::memory`) against the measured peak memory of
//! training a Llama-style model built with `accelerate_rs::nn` on the CPU, with and without
//! activation checkpointing: within 20%. Each run is a process of its own (this test binary
//! again, restricted to [`worker_entry`]), its peak resident size (`VmHWM`, reset once warm)
//! above what it held before the model existed, with glibc giving large blocks back at once
//! (`MALLOC_MMAP_THRESHOLD_=65536`; the prediction does not count what an allocator keeps for
//! reuse). `cargo bench --bench memory` prints the same comparison at larger sizes.

use std::process::{Command, Stdio};

use crate::common::llama::{train_and_measure, LlamaRun, Measured};
use accelerate_rs::memory::{estimate, ModelSpec, Plan};
use accelerate_rs::MixedPrecision;

const RUN_VAR: &str = "ACCEL_MEMORY_TEST_RUN";

fn measure(r: &LlamaRun) -> Measured {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "memory::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RUN_VAR, r.encode())
        .env("MALLOC_MMAP_THRESHOLD_", "65536")
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    Measured::parse(&text).unwrap_or_else(|| panic!("no measurement in:\n{text}"))
}

#[test]
fn predicted_peaks_are_within_20_percent_of_measured_ones() {
    let base = LlamaRun {
        hidden: 256,
        intermediate: 688,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        vocab: 4096,
        batch: 2,
        seq: 128,
        checkpoint: false,
        bf16: false,
        steps: 2,
    };
    let runs = [
        base,
        LlamaRun {
            checkpoint: true,
            ..base
        },
        LlamaRun { bf16: true, ..base },
    ];
    let mut report = Vec::new();
    for r in runs {
        let m = measure(&r);
        let spec = ModelSpec::from_architecture(r.architecture());
        let plan = Plan {
            precision: if r.bf16 {
                MixedPrecision::Bf16
            } else {
                MixedPrecision::No
            },
            batch_size: r.batch,
            seq_len: r.seq,
            checkpointing: r.checkpoint,
            // The test model composes its head: Linear, then nn::cross_entropy.
            fused_head: false,
            ..Plan::default()
        };
        let predicted = estimate(&spec, &plan).unwrap().total() as f64;
        let measured = m.peak.saturating_sub(m.baseline) as f64;
        report.push(format!(
            "ckpt {} bf16 {}: predicted {:.1} MiB, measured {:.1} MiB",
            r.checkpoint,
            r.bf16,
            predicted / 1048576.0,
            measured / 1048576.0
        ));
        let ratio = predicted / measured;
        assert!((0.8..=1.2).contains(&ratio), "{report:?}");
    }
}

/// Entry point of the measuring processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(run) = std::env::var(RUN_VAR) else {
        return;
    };
    let r = LlamaRun::decode(&run).unwrap();
    let m = train_and_measure(&r, &|| {}).unwrap();
    println!("{}", m.line());
}
