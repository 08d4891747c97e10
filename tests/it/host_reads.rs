//! Host reads per optimizer step (ARCHITECTURE.md, "Host reads per step"): every read of a
//! tensor into host memory the library makes on the training path is counted
//! (`accelerate_rs::host_reads`), and a step makes exactly the documented number, so that none
//! creeps back. On a GPU each is a host synchronization; the CPU runs the same code and counts
//! the same.
//!
//! The counter is process-wide and tests run in parallel threads: every count here is taken in a
//! child process (this test binary run again with a role), alone.

use std::process::Command;

use accelerate_rs::optim::{AdamW, Sgd, SgdConfig};
use accelerate_rs::{
    Accelerator, DataLoader, LossScaler, MixedPrecision, NonFinite, TensorDataset,
};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap};

const ROLE: &str = "ACCEL_HOST_READS_ROLE";

fn data() -> (Tensor, Tensor) {
    let x = Tensor::arange(0f32, 64.0, &Device::Cpu)
        .unwrap()
        .reshape((16, 4))
        .unwrap()
        .affine(0.01, 0.0)
        .unwrap();
    let y = x.sum_keepdim(1).unwrap();
    (x, y)
}

/// The library's reads of each of `micro` micro-steps of a 4 → 1 linear regression.
fn counts(acc: &Accelerator, micro: usize, clip: Option<f64>, fused_loss: bool) -> Vec<u64> {
    let varmap = VarMap::new();
    let fc = linear(4, 1, acc.var_builder(&varmap, DType::F32).pp("fc")).unwrap();
    let (x, y) = data();
    acc.prepare_model(&varmap).unwrap();
    let mut opt = acc.prepare_optimizer(AdamW::new_lr(varmap.all_vars(), 1e-3).unwrap());
    opt.set_clip_grad_norm(clip);
    let targets = Tensor::zeros(16, DType::U32, &Device::Cpu).unwrap();
    let mut out = Vec::new();
    for _ in 0..micro {
        let before = accelerate_rs::host_reads();
        let pred = fc.forward(&x).unwrap();
        let l = if fused_loss {
            accelerate_rs::nn::cross_entropy(&pred.broadcast_as((16, 1)).unwrap(), &targets)
                .unwrap()
        } else {
            loss::mse(&pred, &y).unwrap()
        };
        opt.backward_step(&l).unwrap();
        out.push(accelerate_rs::host_reads() - before);
    }
    out
}

/// fp16 mixed precision: the loss scaler's finite check is the step's only read.
fn fp16_counts() -> Vec<u64> {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .mixed_precision(MixedPrecision::Fp16)
        .build()
        .unwrap();
    let master = VarMap::new();
    linear(
        4,
        1,
        VarBuilder::from_varmap(&master, DType::F32, &Device::Cpu).pp("fc"),
    )
    .unwrap();
    let (x, y) = data();
    let loader = DataLoader::new(TensorDataset::new(vec![x, y]).unwrap(), 4);
    let opt = Sgd::new(master.all_vars(), SgdConfig::new(0.01)).unwrap();
    let (mut opt, loader, work) = acc.prepare_mixed(&master, opt, loader).unwrap();
    opt.set_loss_scaler(LossScaler::new(64.0));
    let fc = linear(
        4,
        1,
        VarBuilder::from_varmap(&work, DType::F16, &Device::Cpu).pp("fc"),
    )
    .unwrap();
    let mut out = Vec::new();
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        let before = accelerate_rs::host_reads();
        let p = fc.forward(&batch[0].to_dtype(DType::F16).unwrap()).unwrap();
        let l = loss::mse(&p.to_dtype(DType::F32).unwrap(), &batch[1]).unwrap();
        assert!(opt.backward_step(&l).unwrap());
        out.push(accelerate_rs::host_reads() - before);
    }
    out
}

fn single(accumulate: usize, nonfinite: NonFinite) -> Accelerator {
    Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .gradient_accumulation_steps(accumulate)
        .nonfinite(nonfinite)
        .build()
        .unwrap()
}

/// Runs one counting role in a child process and returns what it printed.
fn in_child(role: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "host_reads::role_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{role}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The harness prints the test's name on the same line as the test's own output.
    let at = text
        .find("counts [")
        .unwrap_or_else(|| panic!("{role}: no counts in {text}"));
    let rest = &text[at + "counts ".len()..];
    rest[..rest.find(']').map_or(rest.len(), |i| i + 1)].to_string()
}

/// The child's side: one role, its counts on a line of their own.
#[test]
fn role_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let counts = match role.as_str() {
        "plain" => counts(&single(1, NonFinite::Error), 3, None, false),
        "clip" => counts(&single(1, NonFinite::Error), 3, Some(1.0), false),
        "off" => counts(&single(1, NonFinite::Off), 3, None, false),
        "accumulate" => counts(&single(2, NonFinite::Error), 4, None, false),
        "fused-loss" => counts(&single(1, NonFinite::Error), 2, None, true),
        "fp16" => fp16_counts(),
        other => panic!("unknown role {other}"),
    };
    println!("counts {counts:?}");
}

#[test]
fn a_step_makes_the_documented_host_reads() {
    // The non-finite check of each optimizer step: one read.
    assert_eq!(in_child("plain"), "[1, 1, 1]");
    // Clipping by norm reads the norm, and the non-finite check uses it: still one.
    assert_eq!(in_child("clip"), "[1, 1, 1]");
    // Without the check, nothing.
    assert_eq!(in_child("off"), "[0, 0, 0]");
    // Accumulation: the micro-steps between syncs read nothing.
    assert_eq!(in_child("accumulate"), "[0, 1, 0, 1]");
    // The fused cross-entropy reads its targets (checked against the classes) and, in the
    // backward pass, the upstream gradient: two more.
    assert_eq!(in_child("fused-loss"), "[3, 3]");
    // fp16: the loss scaler's overflow check; the non-finite check trusts it.
    assert_eq!(in_child("fp16"), "[1, 1, 1, 1]");
}
