//! f16 + ZeRO stage 2 on 2 and 3 real processes (TCP over loopback): an overflow in one rank's
//! slice of the gradients only. Each rank holds only its slices of the averaged gradients, so
//! without an agreement the rank that sees the inf skips the step while the others step and
//! gather the parameters, and their collectives stop matching (a hang until the collective
//! timeout, or mismatched results). Every rank must skip that step, lower the scale alike, and
//! take the next clean step together.
//!
//! The workers are this test binary re-run under `accelerate-rs launch`:
//! `zero_overflow::worker_entry` does nothing unless `ACCEL_ZERO_OVERFLOW_ROLE` is set.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::optim::{Sgd, SgdConfig};
use accelerate_rs::{Accelerator, DataLoader, LossScaler, TensorDataset};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;

const ROLE_VAR: &str = "ACCEL_ZERO_OVERFLOW_ROLE";
/// Elements of each of the two parameters (`a`, then `b`, in one bucket).
const N: usize = 4;
const LR: f64 = 0.1;
/// The collective timeout of the workers: a mismatched run fails within it.
const COLLECTIVE_TIMEOUT_SECS: u64 = 15;
/// The whole launch, killed (a failure) past this.
const LIMIT: Duration = Duration::from_secs(90);

/// One worker: two f16 steps through `prepare_mixed` at ZeRO stage 2. Step 1 overflows in
/// element 0 of `a` only (rank 0's slice), step 2 is clean. Prints this rank's verdicts and
/// masters on one line.
fn worker() -> accelerate_rs::Result<()> {
    let acc = Accelerator::new()?;
    let dev = Device::Cpu;
    let p = vec![
        ("a".to_string(), Var::ones(N, DType::F32, &dev)?),
        ("b".to_string(), Var::ones(N, DType::F32, &dev)?),
    ];
    let vars: Vec<Var> = p.iter().map(|(_, v)| v.clone()).collect();
    let opt = Sgd::new(vars, SgdConfig::new(LR))?;
    let data = TensorDataset::new(vec![Tensor::zeros((4, 1), DType::F32, &dev)?])?;
    let (mut opt, _loader, work) = acc.prepare_mixed(&p, opt, DataLoader::new(data, 1))?;
    // Gradients of 1024 x weight: 1024 fits in f16, 1024 x 1e4 does not.
    opt.set_loss_scaler(LossScaler::new(1024.0));
    let (wa, wb) = {
        let w = work.data().lock().unwrap();
        (w["a"].as_tensor().clone(), w["b"].as_tensor().clone())
    };
    let loss = |first: f32| -> accelerate_rs::Result<Tensor> {
        let mut weights = vec![1f32; N];
        weights[0] = first;
        let w = Tensor::new(weights.as_slice(), &dev)?.to_dtype(DType::F16)?;
        let l =
            ((wa.mul(&w)?.sum_all()? + wb.affine(2.0, 0.0)?.sum_all()?)?).to_dtype(DType::F32)?;
        Ok(l)
    };
    let overflowed = !opt.backward_step(&loss(1e4)?)?;
    let after_skip = opt.loss_scale();
    let clean = opt.backward_step(&loss(1.0)?)?;
    let values = |name: &str| -> accelerate_rs::Result<String> {
        let v = &p.iter().find(|(k, _)| k == name).unwrap().1;
        let v = v.as_tensor().to_vec1::<f32>()?;
        Ok(v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(","))
    };
    println!(
        "overflow_result rank={} skipped_first={overflowed} stepped_second={clean} skipped={} scale_after_skip={after_skip} a={} b={}",
        acc.rank(),
        opt.skipped_steps(),
        values("a")?,
        values("b")?
    );
    Ok(())
}

/// Entry point of the worker processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    crate::common::exit_worker(worker())
}

/// Launches `world` workers and returns whether the launcher succeeded in time, with its output.
fn launch(world: usize) -> (bool, String) {
    let mut child = Command::new(crate::common::launcher())
        .args(["launch", "--cpu", "-n", &world.to_string()])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "zero_overflow::worker_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, "1")
        .env("ACCELERATE_RS_ZERO_STAGE", "2")
        .env("ACCELERATE_RS_MIXED_PRECISION", "fp16")
        .env("ACCELERATE_RS_TRANSPORT", "tcp")
        .env(
            "ACCELERATE_RS_TIMEOUT_SECS",
            COLLECTIVE_TIMEOUT_SECS.to_string(),
        )
        .env_remove("ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes on threads so that a chatty failure cannot block the launcher.
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = pipe(Box::new(child.stdout.take().unwrap()));
    let err = pipe(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + LIMIT;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() >= deadline {
            // SIGTERM: the launcher stops its workers; then make sure it is gone.
            let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            std::thread::sleep(Duration::from_secs(4));
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    (status.is_some_and(|s| s.success()), text)
}

#[test]
fn an_overflow_in_one_ranks_slice_skips_the_step_on_every_rank() {
    for world in [2, 3] {
        let (ok, text) = launch(world);
        assert!(
            ok,
            "{world} processes did not all succeed (limit {LIMIT:?}):\n{text}"
        );
        let mut lines: Vec<(usize, String)> = text
            .lines()
            .filter_map(|l| l.split("overflow_result ").nth(1))
            .map(|l| {
                let rank = l
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("rank="))
                    .unwrap()
                    .parse()
                    .unwrap();
                // Everything but the rank must be the same on every rank.
                let rest = l.split_once(' ').map_or("", |(_, r)| r).to_string();
                (rank, rest)
            })
            .collect();
        lines.sort();
        assert_eq!(lines.len(), world, "{text}");
        let (_, first) = &lines[0];
        for (rank, rest) in &lines {
            assert_eq!(rest, first, "rank {rank} disagrees with rank 0:\n{text}");
        }
        // One skip (the scale halved), one clean step of SGD on the masters.
        assert!(
            first.starts_with(
                "skipped_first=true stepped_second=true skipped=1 scale_after_skip=512 "
            ),
            "{first}"
        );
        for (name, want) in [("a", 1.0 - LR), ("b", 1.0 - 2.0 * LR)] {
            let got: Vec<f64> = first
                .split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .unwrap()
                .split(',')
                .map(|x| x.parse().unwrap())
                .collect();
            assert_eq!(got.len(), N, "{first}");
            assert!(
                got.iter().all(|x| (x - want).abs() < 1e-6),
                "`{name}` is {got:?}, want {want} after one step: {first}"
            );
        }
    }
}
