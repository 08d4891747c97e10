//! prepare / backward end to end: real processes under `accelerate-rs launch`, and in-process
//! ranks over the threads backend.
//!
//! The multi-process tests re-run this test binary as the workers: `ddp_worker` does nothing
//! unless `ACCEL_TEST_ROLE` is set.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use accelerate_rs::{Accelerator, Error};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::loss;

use crate::common::tiny::{
    dataset, forward, max_abs_diff, params, reference, snapshot, train, HIDDEN,
};
use crate::common::{exit_worker, in_process};

const B: usize = 8; // per-rank batch
const K: usize = 6; // SGD steps

fn worker(role: &str) -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let rank = acc.rank();
    match role {
        "equivalence" => {
            let p = params(rank as f32 * 0.25, HIDDEN);
            train(&acc, &p, B, K)?;
            if acc.is_main_process() {
                let out = std::env::var("ACCEL_TEST_OUT")
                    .map_err(|_| Error::invalid("ACCEL_TEST_OUT", "unset"))?;
                candle_core::safetensors::save(&snapshot(&p), out)?;
            }
            Ok(())
        }
        "mismatch" => {
            let p = params(0.0, if rank == 1 { HIDDEN + 1 } else { HIDDEN });
            train(&acc, &p, B, K)
        }
        other => Err(Error::invalid("ACCEL_TEST_ROLE", other.to_string())),
    }
}

#[test]
fn ddp_worker() {
    let Ok(role) = std::env::var("ACCEL_TEST_ROLE") else {
        return;
    };
    exit_worker(worker(&role));
}

fn launch(n: usize, role: &str, out: Option<&Path>) -> std::process::Output {
    launch_with(n, role, out, &[])
}

fn launch_with(
    n: usize,
    role: &str,
    out: Option<&Path>,
    envs: &[(&str, &str)],
) -> std::process::Output {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(crate::common::launcher());
    cmd.envs(envs.iter().copied());
    cmd.args(["launch", "--cpu", "-n", &n.to_string()])
        .arg(exe)
        .args([
            "--exact",
            "ddp::ddp_worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCEL_TEST_ROLE", role);
    if let Some(out) = out {
        cmd.env("ACCEL_TEST_OUT", out);
    }
    cmd.output().unwrap()
}

#[test]
fn two_processes_with_batch_b_equal_one_process_with_batch_2b() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("params.safetensors");
    let res = launch(2, "equivalence", Some(&out));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    assert!(res.status.success(), "launch failed:\n{text}");
    let ddp = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    let single = reference(2 * B, K);
    let diff = max_abs_diff(&ddp, &single);
    assert!(diff <= 1e-5, "max abs diff {diff}");
    // And training moved the parameters, so the comparison means something.
    let init = snapshot(&params(0.0, HIDDEN));
    assert!(max_abs_diff(&init, &single) > 1e-3);
}

/// Every parameter in its own bucket (so the communication thread reduces one bucket while the
/// next is flattened), over shared memory and over TCP, with 3 processes: still the reference.
#[test]
fn many_buckets_with_overlap_over_either_transport_equal_one_process() {
    for transport in ["shm", "tcp"] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("params.safetensors");
        let envs = [
            ("ACCELERATE_RS_BUCKET_CAP_MB", "0.00001"),
            ("ACCELERATE_RS_OVERLAP", "1"),
            ("ACCELERATE_RS_TRANSPORT", transport),
        ];
        let res = launch_with(3, "equivalence", Some(&out), &envs);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&res.stdout),
            String::from_utf8_lossy(&res.stderr)
        );
        assert!(res.status.success(), "{transport}: launch failed:\n{text}");
        let ddp = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
        let diff = max_abs_diff(&ddp, &reference(3 * B, K));
        assert!(diff <= 1e-5, "{transport}: max abs diff {diff}");
    }
}

#[test]
fn mismatched_parameter_shapes_fail_every_rank_naming_the_parameter() {
    let res = launch(2, "mismatch", None);
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success(), "launch should fail:\n{err}");
    assert!(err.contains("parameter `fc1.bias`"), "{err}");
    assert!(
        err.contains("rank 0 has F32[16]") && err.contains("rank 1 has F32[17]"),
        "{err}"
    );
    // Both ranks report it (neither hangs waiting for the other).
    assert!(
        err.contains("[rank 0] worker failed") || err.contains("[rank 1] worker failed"),
        "{err}"
    );
}

#[test]
fn in_process_ranks_match_the_reference_and_each_other() {
    let results = in_process(2, |acc| {
        let p = params(acc.rank() as f32, HIDDEN);
        train(&acc, &p, B, K).unwrap();
        snapshot(&p)
    });
    let single = reference(2 * B, K);
    for r in &results {
        assert!(max_abs_diff(r, &single) <= 1e-5);
        assert_eq!(
            max_abs_diff(r, &results[0]),
            0.0,
            "replicas must be bit-identical"
        );
    }
}

#[test]
fn backward_before_prepare_is_an_error_not_a_silent_local_step() {
    let errs = in_process(2, |acc| {
        let p = params(0.0, HIDDEN);
        let d = dataset(4);
        let loss =
            loss::cross_entropy(&forward(&p, &d.tensors()[0]).unwrap(), &d.tensors()[1]).unwrap();
        acc.backward(&loss).unwrap_err().to_string()
    });
    for e in errs {
        assert!(e.contains("prepare"), "{e}");
    }
}

#[test]
fn parameters_unused_on_some_ranks_still_get_averaged_gradients() {
    let results = in_process(3, |acc| {
        let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap()).unwrap();
        let u = Var::from_tensor(&Tensor::new(&[5.0f32], &Device::Cpu).unwrap()).unwrap();
        let never = Var::from_tensor(&Tensor::new(&[7.0f32], &Device::Cpu).unwrap()).unwrap();
        let named = vec![
            ("w".to_string(), w.clone()),
            ("u".to_string(), u.clone()),
            ("never".to_string(), never.clone()),
        ];
        acc.prepare_model(&named).unwrap();
        // Only rank 0 uses `u`; nobody uses `never`.
        let mut loss = (w.as_tensor() * (acc.rank() as f64 + 1.0))
            .unwrap()
            .sum_all()
            .unwrap();
        if acc.rank() == 0 {
            loss = (loss + u.as_tensor().sum_all().unwrap() * 3.0).unwrap();
        }
        let grads = acc.backward(&loss).unwrap().unwrap();
        (
            grads.get(w.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            grads
                .get(u.as_tensor())
                .map(|g| g.to_vec1::<f32>().unwrap()),
            grads.get(never.as_tensor()).is_none(),
        )
    });
    for (w, u, never_absent) in results {
        assert_eq!(w, vec![2.0, 2.0]); // mean of 1, 2, 3
        assert_eq!(u, Some(vec![1.0])); // (3 + 0 + 0) / 3
        assert!(never_absent);
    }
}

#[test]
fn world_size_one_backward_is_plain_backward() {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .build()
        .unwrap();
    assert_eq!(acc.collective().backend(), "single");
    let p = params(0.0, HIDDEN);
    let d = dataset(4);
    let loss =
        loss::cross_entropy(&forward(&p, &d.tensors()[0]).unwrap(), &d.tensors()[1]).unwrap();
    let a = acc.backward(&loss).unwrap().unwrap();
    let b = loss.backward().unwrap();
    for (_, v) in &p {
        let (ga, gb) = (a.get(v.as_tensor()).unwrap(), b.get(v.as_tensor()).unwrap());
        assert_eq!(
            ga.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            gb.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
    let _ = DType::F32;
}
