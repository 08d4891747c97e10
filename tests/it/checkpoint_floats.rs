//! Checkpoints keep every float exactly: learning rates that serde_json's default float parser
//! brought back one ULP off (which made the first manifest format refuse sound checkpoints on
//! resume) are saved by two real processes, and a second launch resumes from the newest one with
//! the same bits.
//!
//! The workers re-run this test binary under `accelerate-rs launch --cpu -n 2`:
//! `floats_worker` does nothing unless `ACCEL_TEST_ROLE` is set.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use accelerate_rs::checkpoint::{
    latest_checkpoint, verify_checkpoint, CheckpointParts, Checkpointable, LoadTargets,
};
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, Error};
use candle_core::Var;
use candle_nn::Optimizer;
use proptest::prelude::*;

use crate::common::exit_worker;
use crate::common::tiny::{dataset, forward, params, HIDDEN};

/// Learning rates of a warmup-cosine schedule that came back one ULP off through serde_json
/// without `float_roundtrip` (found by scanning 20,000 schedule values;
/// checked: each comes back as its neighbour, e.g. `0.00010999999999999999` -> `0.00011`).
const RATES: [f64; 4] = [
    0.00038289406344429013,
    0.00010999999999999999,
    0.0009999989009131665,
    0.0009999977569665963,
];

fn root() -> accelerate_rs::Result<PathBuf> {
    std::env::var("ACCEL_TEST_ROOT")
        .map(PathBuf::from)
        .map_err(|_| Error::invalid("ACCEL_TEST_ROOT", "unset"))
}

/// `save`: one optimizer step and one checkpoint per rate (keeping 2), then exit.
/// `resume`: load the newest checkpoint and check its step and learning rate, bit for bit.
fn worker(role: &str) -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let root = root()?;
    let p = params(0.5, HIDDEN);
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = acc.prepare_optimizer(AdamW::new_lr(vars, 0.01)?);
    acc.prepare_model(&p)?;
    match role {
        "save" => {
            let data = dataset(8);
            let x = data.tensors()[0].narrow(0, 0, 4)?;
            let y = data.tensors()[1].narrow(0, 0, 4)?;
            for (step, lr) in RATES.iter().enumerate() {
                opt.set_learning_rate(*lr);
                let loss = candle_nn::loss::cross_entropy(&forward(&p, &x)?, &y)?;
                opt.backward_step(&loss)?;
                let parts = CheckpointParts::new(&p)
                    .optimizer(&opt)
                    .step(step as u64 + 1);
                acc.save_state_auto(&root, &parts, 2)?;
            }
            Ok(())
        }
        "resume" => {
            let dir = latest_checkpoint(&root)?
                .ok_or_else(|| Error::invalid("checkpoints", "none found"))?;
            let m = acc.load_state(&dir, &p, Some(&mut opt))?;
            let want = RATES[RATES.len() - 1];
            let saved = m.optimizer.map(|o| o.lr).unwrap_or(f64::NAN);
            if m.step != RATES.len() as u64
                || saved.to_bits() != want.to_bits()
                || opt.learning_rate().to_bits() != want.to_bits()
            {
                return Err(Error::invalid(
                    "resume",
                    format!(
                        "{}: step {} lr {saved:e} (optimizer {:e}), expected step {} lr {want:e}",
                        dir.display(),
                        m.step,
                        opt.learning_rate(),
                        RATES.len()
                    ),
                ));
            }
            acc.print(format!("resumed {} exactly", dir.display()));
            Ok(())
        }
        other => Err(Error::invalid("ACCEL_TEST_ROLE", other.to_string())),
    }
}

#[test]
fn floats_worker() {
    let Ok(role) = std::env::var("ACCEL_TEST_ROLE") else {
        return;
    };
    exit_worker(worker(&role));
}

fn launch(role: &str, root: &Path) -> String {
    let res = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "checkpoint_floats::floats_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_ROLE", role)
        .env("ACCEL_TEST_ROOT", root)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(res.status.success(), "launch {role} failed:\n{text}");
    text
}

#[test]
fn two_processes_resume_from_the_newest_checkpoint_with_exact_learning_rates() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpts");
    launch("save", &root);
    let newest = root.join(format!("checkpoint_{}", RATES.len() - 1));
    let m = verify_checkpoint(&newest).unwrap();
    assert_eq!(
        m.optimizer.unwrap().lr.to_bits(),
        RATES[RATES.len() - 1].to_bits()
    );
    // The older kept one verifies too (every rate above failed the first format's check).
    verify_checkpoint(root.join(format!("checkpoint_{}", RATES.len() - 2))).unwrap();
    let out = launch("resume", &root);
    assert!(out.contains("resumed") && out.contains("exactly"), "{out}");
    assert!(
        !out.contains("skipping") && !out.contains("refused"),
        "{out}"
    );
}

/// User state of f64s (what a training script registers with `CheckpointParts::state`).
#[derive(Default)]
struct Floats(Vec<f64>);

impl Checkpointable for Floats {
    fn checkpoint_state(&self) -> accelerate_rs::Result<serde_json::Value> {
        Ok(serde_json::json!({ "values": self.0 }))
    }
    fn restore_state(&mut self, state: &serde_json::Value) -> accelerate_rs::Result<()> {
        self.0 = serde_json::from_value(state["values"].clone())
            .map_err(|e| Error::invalid("floats", e.to_string()))?;
        Ok(())
    }
}

/// Finite f64s of every kind JSON can hold: subnormals, extremes, negative zero, rates as a
/// cosine schedule makes them (a few ULPs around), any bit pattern.
fn finite_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>()
            .prop_map(f64::from_bits)
            .prop_filter("finite", |x| x.is_finite()),
        (1u64..(1 << 52)).prop_map(f64::from_bits),
        (1u64..(1 << 52)).prop_map(|b| -f64::from_bits(b)),
        Just(f64::MAX),
        Just(f64::MIN),
        Just(f64::MIN_POSITIVE),
        Just(-0.0),
        (1u32..100_000, 1u32..100_000, -3i64..4).prop_map(|(a, b, ulps)| {
            let x = 1e-3 * 0.5 * (1.0 + (std::f64::consts::PI * a as f64 / (a + b) as f64).cos());
            f64::from_bits((x.to_bits() as i64 + ulps) as u64)
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Through the real save and load of a checkpoint: the optimizer's learning rate (manifest)
    /// and a user state's floats (`states.json`) come back bit for bit, and the checkpoint
    /// verifies.
    #[test]
    fn saved_floats_load_back_bit_for_bit(
        lr in finite_f64().prop_filter("a learning rate", |x| *x >= 0.0),
        values in proptest::collection::vec(finite_f64(), 1..24),
    ) {
        let acc = crate::common::single();
        // A folder of its own under the temporary one: a save locks the checkpoint's parent, and
        // another test run on this machine may be saving under /tmp at the same moment.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        let p = params(0.5, HIDDEN);
        let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
        let mut opt = AdamW::new_lr(vars.clone(), 0.01).unwrap();
        opt.set_learning_rate(lr);
        let state = Floats(values.clone());
        let parts = CheckpointParts::new(&p).optimizer(&opt).state("floats", &state).step(3);
        acc.save_state(&dir, &parts).unwrap();
        let m = verify_checkpoint(&dir).unwrap();
        prop_assert_eq!(m.optimizer.as_ref().map(|o| o.lr.to_bits()), Some(lr.to_bits()));

        let mut back = Floats::default();
        let mut opt2 = AdamW::new_lr(vars, 0.5).unwrap();
        let targets = LoadTargets::new(&p).optimizer(&mut opt2).state("floats", &mut back);
        acc.load_state_into(&dir, targets).unwrap();
        prop_assert_eq!(opt2.learning_rate().to_bits(), lr.to_bits());
        let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&back.0), bits(&values));
    }
}
