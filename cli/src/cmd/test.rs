//! `accelerate-rs test`: a built-in multi-process sanity check. It launches this same binary as N
//! workers (hidden `test-worker` subcommand) that exercise every collective, the distributed
//! sampler and a few DDP steps against a single-process reference, and ends with one line saying
//! that it passed or what failed.

use std::path::PathBuf;

use candle_core::{DType, Device, DeviceLocation, Tensor, Var};
use candle_nn::Optimizer;
use clap::Args;
use half::{bf16, f16};

use accelerate_rs::collective::{Buffer, BufferMut, Collective, NcclCollective};
use accelerate_rs::optim::{Sgd, SgdConfig};
use accelerate_rs::ReduceOp;
use accelerate_rs::{
    Accelerator, ConfigFile, DataLoader, DistributedSampler, Error, Result, TensorDataset,
    WrapPolicy,
};

use crate::launch::{launch, LaunchOptions};

/// Arguments of `accelerate-rs test`.
#[derive(Debug, Args)]
pub(crate) struct TestArgs {
    /// Number of worker processes (default: the config file's num_processes, else 2).
    #[arg(short = 'n', long, value_name = "N")]
    num_processes: Option<usize>,
    /// Config file to read instead of the default one.
    #[arg(long, value_name = "PATH")]
    config_file: Option<PathBuf>,
    /// Run on the CPU even when GPUs are present (also `use_cpu = true` in the config).
    #[arg(long)]
    cpu: bool,
    /// Check DP instead: one process driving N replicas, one thread each (GPUs, or CPU replicas
    /// with --cpu or without GPUs).
    #[arg(long, value_name = "N")]
    dp: Option<usize>,
}

/// Runs the check (under the launcher, or in this process for DP) and prints the verdict.
pub(crate) fn run(args: TestArgs) -> crate::Result<()> {
    let getenv = |k: &str| std::env::var(k).ok();
    let (cfg, _) = ConfigFile::load_located(args.config_file.as_deref(), &getenv)?;
    let cpu = args.cpu || cfg.use_cpu == Some(true) || accelerate_rs::config::gpus_seen() == 0;
    let kind = if cpu { "CPU" } else { "GPU" };
    let (what, res) = match args.dp {
        Some(replicas) => {
            println!("accelerate-rs test: DP, {replicas} {kind} replica(s) in one process: collectives, sampler, DDP steps");
            let res = Accelerator::builder()
                .cpu(cpu)
                .data_parallel(replicas)
                .run(|acc| run_checks(&acc))
                .map(|_| ())
                .map_err(crate::Error::from);
            (format!("{replicas} DP replica(s)"), res)
        }
        None => {
            let n = args.num_processes.or(cfg.num_processes).unwrap_or(2);
            let exe = std::env::current_exe().map_err(|e| Error::Io {
                context: "cannot locate the accelerate-rs executable".into(),
                path: PathBuf::from("/proc/self/exe"),
                source: e,
            })?;
            println!("accelerate-rs test: {n} {kind} process(es): collectives, sampler, DDP steps");
            let res = launch(&LaunchOptions {
                num_processes: n,
                cpu,
                program: exe.to_string_lossy().into_owned(),
                args: vec!["test-worker".into()],
                ..LaunchOptions::default()
            });
            (format!("{n} process(es)"), res)
        }
    };
    match res {
        Ok(()) => {
            println!("accelerate-rs test: PASSED on {what}");
            Ok(())
        }
        Err(e) => {
            println!("accelerate-rs test: FAILED: {e} (see the lines above)");
            Err(e)
        }
    }
}

/// One worker process of the check.
pub(crate) fn worker() -> Result<()> {
    run_checks(&Accelerator::new()?)
}

/// What a check found when it did not fail.
enum Outcome {
    /// It ran and passed.
    Passed,
    /// It ran and passed; the note says how (e.g. which path the tensors took).
    PassedVia(String),
    /// It did not apply here; the reason says why. Printed as `skipped`, never as `ok`.
    Skipped(&'static str),
}

/// One named check run by every worker.
type Check = fn(&Accelerator) -> Result<Outcome>;

/// Runs every check (so all ranks call the same collectives even when one check fails locally),
/// then agrees with the others on the verdict.
fn run_checks(acc: &Accelerator) -> Result<()> {
    let c = acc.collective().as_ref();
    let checks: [(&str, Check); 11] = [
        (
            "all_reduce (sum, mean, max; f32, f64, f16, bf16)",
            check_all_reduce,
        ),
        ("broadcast from every root", check_broadcast),
        ("all_gather with uneven sizes, barrier", check_all_gather),
        ("distributed sampler", check_sampler),
        ("DDP steps equal a single-process reference", check_ddp),
        (
            "GPU tensors: all_reduce, broadcast, all_gather, reduce_scatter, all_gather_into (f32, bf16, f16)",
            check_gpu_tensors,
        ),
        (
            "fused AdamW and SGD kernels equal the tensor-op chain on this device",
            check_fused_optimizers,
        ),
        (
            "GPU setup: event tracking off (one stream), the memory pool keeps freed memory",
            check_gpu_setup,
        ),
        (
            "fp16 loss scaling: an overflow on the last rank only skips the step on every rank",
            check_fp16_overflow,
        ),
        (
            "find_executable_batch_size: the last rank runs out of memory, every rank retries (Min vote)",
            check_batch_size_search,
        ),
        (
            "non-finite gradients (NaN, +inf, -inf in f32, bf16, f16) stop the step",
            check_nonfinite,
        ),
    ];
    let mut failed = Vec::new();
    for (name, check) in checks {
        match check(acc) {
            Ok(Outcome::Passed) => acc.print(format!("ok: {name}")),
            Ok(Outcome::PassedVia(how)) => acc.print(format!("ok: {name} ({how})")),
            Ok(Outcome::Skipped(why)) => acc.print(format!("skipped: {name} ({why})")),
            Err(e) => {
                eprintln!("rank {}: FAILED: {name}: {e}", acc.rank());
                failed.push(name);
            }
        }
    }
    // Agree on the verdict so that every rank exits the same way.
    let mut flag = [failed.len() as f32];
    c.all_reduce(BufferMut::from(&mut flag[..]), ReduceOp::Max)?;
    if flag[0] > 0.0 {
        return Err(Error::Mismatch {
            rank: acc.rank(),
            op: "accelerate-rs test".into(),
            detail: if failed.is_empty() {
                "a check failed on another rank".into()
            } else {
                format!("failed here: {}", failed.join("; "))
            },
        });
    }
    Ok(())
}

/// See [`super::test_train::fp16_overflow_on_one_rank`].
fn check_fp16_overflow(acc: &Accelerator) -> Result<Outcome> {
    Ok(match super::test_train::fp16_overflow_on_one_rank(acc)? {
        Some(how) => Outcome::PassedVia(how),
        None => Outcome::Skipped(
            "mixed precision is not fp16: ACCELERATE_RS_MIXED_PRECISION=fp16 runs it",
        ),
    })
}

/// See [`super::test_train::batch_size_search`].
fn check_batch_size_search(acc: &Accelerator) -> Result<Outcome> {
    Ok(Outcome::PassedVia(super::test_train::batch_size_search(
        acc,
    )?))
}

/// See [`super::test_train::nonfinite_detection`].
fn check_nonfinite(acc: &Accelerator) -> Result<Outcome> {
    Ok(match super::test_train::nonfinite_detection(acc)? {
        Some(how) => Outcome::PassedVia(how),
        None => Outcome::Skipped("`nonfinite` is not `error`"),
    })
}

/// The shapes of the parameters the fused-optimizer check steps.
const FUSED_SHAPES: [&[usize]; 3] = [&[300, 257], &[300], &[7, 13]];

/// 100 AdamW steps and 50 SGD (momentum, Nesterov, weight decay) steps on this rank's device,
/// fused and unfused, from the same start with the same gradients: the results must agree.
fn check_fused_optimizers(acc: &Accelerator) -> Result<Outcome> {
    use accelerate_rs::optim::cuda_kernel_launches;
    let device = acc.device();
    let launched_before = cuda_kernel_launches();
    let shapes = FUSED_SHAPES;
    fused_matches_unfused(device, &shapes)?;
    if !device.is_cuda() {
        return Ok(Outcome::Passed);
    }
    let mut half_report = String::new();
    // bf16 and f16: the CUDA kernels against the CPU's fused kernels (the same f32 arithmetic
    // and rounding), 20 AdamW and 20 SGD steps from the same start.
    for (dtype, tol) in [(DType::BF16, 1e-2f32), (DType::F16, 2e-3)] {
        let d = half_precision_steps(device, dtype, &shapes)?;
        if d > tol {
            return Err(fail(format!(
                "{dtype:?}: the fused CUDA kernels and the CPU's differ by {d} (tolerance {tol})"
            )));
        }
        half_report.push_str(&format!(", {dtype:?} vs CPU max diff {d}"));
    }
    // Both sides agreeing proves nothing if the fused side fell back to tensor ops.
    let launched = cuda_kernel_launches() - launched_before;
    let want = (100 + 50 + 2 * (20 + 20)) * shapes.len() as u64;
    if launched < want {
        return Err(fail(format!(
            "the fused CUDA kernels did not run: {launched} launches for {want} parameter updates (see the warning above: NVRTC or module loading failed)"
        )));
    }
    Ok(Outcome::PassedVia(format!(
        "{launched} fused CUDA kernel launches{half_report}"
    )))
}

/// Parameters of `shapes` on `device` (`k` picks the values).
fn fused_start(device: &Device, shapes: &[&[usize]], k: usize) -> Result<Vec<Var>> {
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            let v: Vec<f32> = (0..n).map(|j| value(i + k, j) as f32 * 0.1).collect();
            Ok(Var::from_tensor(&Tensor::from_vec(v, *s, device)?)?)
        })
        .collect()
}

/// The gradients of step `step` for `vars`, the same for every optimizer compared.
fn fused_grads(
    vars: &[Var],
    step: usize,
    device: &Device,
) -> Result<candle_core::backprop::GradStore> {
    let mut g = candle_core::backprop::GradStore::default();
    for (i, v) in vars.iter().enumerate() {
        let n = v.elem_count();
        let x: Vec<f32> = (0..n)
            .map(|j| value(step + i, j * 7 + step) as f32 * 0.01)
            .collect();
        g.insert(v.as_tensor(), Tensor::from_vec(x, v.shape(), device)?);
    }
    Ok(g)
}

/// The largest difference between two sets of parameters.
fn max_diff(a: &[Var], b: &[Var]) -> Result<f32> {
    let mut d = 0f32;
    for (x, y) in a.iter().zip(b) {
        let m = (x.as_tensor() - y.as_tensor())?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        d = d.max(m);
    }
    Ok(d)
}

/// 100 AdamW and 50 SGD steps, fused and unfused, on `device`: within 1e-5 of each other.
fn fused_matches_unfused(device: &Device, shapes: &[&[usize]]) -> Result<()> {
    use accelerate_rs::optim::AdamW;
    let (a, b) = (
        fused_start(device, shapes, 0)?,
        fused_start(device, shapes, 0)?,
    );
    let mut fused = AdamW::new_lr(a.clone(), 1e-2)?;
    let mut chain = AdamW::new_lr(b.clone(), 1e-2)?;
    chain.set_fused(false);
    for step in 0..100 {
        fused.step(&fused_grads(&a, step, device)?)?;
        chain.step(&fused_grads(&b, step, device)?)?;
    }
    let d = max_diff(&a, &b)?;
    if d > 1e-5 {
        return Err(fail(format!(
            "AdamW on {device:?}: fused and unfused differ by {d} after 100 steps"
        )));
    }
    let config = SgdConfig::new(0.05)
        .momentum(0.9)
        .nesterov(true)
        .weight_decay(1e-3);
    let (a, b) = (
        fused_start(device, shapes, 1)?,
        fused_start(device, shapes, 1)?,
    );
    let mut fused = Sgd::new(a.clone(), config.clone())?;
    let mut chain = Sgd::new(b.clone(), config)?;
    chain.set_fused(false);
    for step in 0..50 {
        fused.step(&fused_grads(&a, step, device)?)?;
        chain.step(&fused_grads(&b, step, device)?)?;
    }
    let d = max_diff(&a, &b)?;
    if d > 1e-5 {
        return Err(fail(format!(
            "Sgd on {device:?}: fused and unfused differ by {d} after 50 steps"
        )));
    }
    Ok(())
}

/// 20 AdamW and 20 SGD (momentum, Nesterov, weight decay) steps in `dtype` with the fused kernels
/// on `device` and on the CPU, from the same start with the same gradients; the largest
/// difference of the parameters.
fn half_precision_steps(device: &Device, dtype: DType, shapes: &[&[usize]]) -> Result<f32> {
    use accelerate_rs::optim::AdamW;
    let start = |dev: &Device| -> Result<Vec<Var>> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n).map(|j| value(i + 3, j) as f32 * 0.1).collect();
                let t = Tensor::from_vec(v, *s, dev)?.to_dtype(dtype)?;
                Ok(Var::from_tensor(&t)?)
            })
            .collect()
    };
    let grads = |vars: &[Var], step: usize| -> Result<candle_core::backprop::GradStore> {
        let mut g = candle_core::backprop::GradStore::default();
        for (i, v) in vars.iter().enumerate() {
            let n = v.elem_count();
            let x: Vec<f32> = (0..n)
                .map(|j| value(step + i, j * 5 + step) as f32 * 0.01)
                .collect();
            let t = Tensor::from_vec(x, v.shape(), v.device())?.to_dtype(dtype)?;
            g.insert(v.as_tensor(), t);
        }
        Ok(g)
    };
    let diff = |a: &[Var], b: &[Var]| -> Result<f32> {
        let mut d = 0f32;
        for (x, y) in a.iter().zip(b) {
            let x = x
                .as_tensor()
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?;
            let y = y.as_tensor().to_dtype(DType::F32)?;
            d = d.max((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
        }
        Ok(d)
    };
    let (gpu, cpu) = (start(device)?, start(&Device::Cpu)?);
    let mut on_gpu = AdamW::new_lr(gpu.clone(), 1e-2)?;
    let mut on_cpu = AdamW::new_lr(cpu.clone(), 1e-2)?;
    for step in 0..20 {
        on_gpu.step(&grads(&gpu, step)?)?;
        on_cpu.step(&grads(&cpu, step)?)?;
    }
    let adam = diff(&gpu, &cpu)?;
    let config = SgdConfig::new(0.05)
        .momentum(0.9)
        .nesterov(true)
        .weight_decay(1e-3);
    let (gpu, cpu) = (start(device)?, start(&Device::Cpu)?);
    let mut on_gpu = Sgd::new(gpu.clone(), config.clone())?;
    let mut on_cpu = Sgd::new(cpu.clone(), config)?;
    for step in 0..20 {
        on_gpu.step(&grads(&gpu, step)?)?;
        on_cpu.step(&grads(&cpu, step)?)?;
    }
    Ok(adam.max(diff(&gpu, &cpu)?))
}

fn value(rank: usize, i: usize) -> f64 {
    ((rank * 5 + i * 3) % 13) as f64 - 6.0
}

fn fail(what: String) -> Error {
    Error::Data { reason: what }
}

fn check_all_reduce(acc: &Accelerator) -> Result<Outcome> {
    let c = acc.collective().as_ref();
    let (rank, n) = (acc.rank(), acc.world_size());
    let len = 2 * n + 1;
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min] {
        let want: Vec<f64> = (0..len)
            .map(|i| {
                let vals = (0..n).map(|r| value(r, i));
                match op {
                    ReduceOp::Sum => vals.sum(),
                    ReduceOp::Mean => vals.sum::<f64>() / n as f64,
                    ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                    ReduceOp::Min => vals.fold(f64::MAX, f64::min),
                }
            })
            .collect();
        let check = |got: Vec<f64>, ty: &str, tol: f64| -> Result<()> {
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                if (g - w).abs() > tol * (1.0 + w.abs()) {
                    return Err(fail(format!("{ty} {op:?} [{i}]: got {g}, want {w}")));
                }
            }
            Ok(())
        };
        let mut a: Vec<f32> = (0..len).map(|i| value(rank, i) as f32).collect();
        c.all_reduce(BufferMut::from(&mut a[..]), op)?;
        check(a.iter().map(|&x| x as f64).collect(), "f32", 1e-6)?;
        let mut b: Vec<f64> = (0..len).map(|i| value(rank, i)).collect();
        c.all_reduce(BufferMut::from(&mut b[..]), op)?;
        check(b, "f64", 1e-12)?;
        let mut h: Vec<f16> = (0..len).map(|i| f16::from_f64(value(rank, i))).collect();
        c.all_reduce(BufferMut::from(&mut h[..]), op)?;
        check(h.iter().map(|x| x.to_f64()).collect(), "f16", 1e-3)?;
        let mut z: Vec<bf16> = (0..len).map(|i| bf16::from_f64(value(rank, i))).collect();
        c.all_reduce(BufferMut::from(&mut z[..]), op)?;
        check(z.iter().map(|x| x.to_f64()).collect(), "bf16", 8e-3)?;
    }
    Ok(Outcome::Passed)
}

fn check_broadcast(acc: &Accelerator) -> Result<Outcome> {
    let c = acc.collective().as_ref();
    for root in 0..acc.world_size() {
        let mut v: Vec<f32> = (0..7).map(|i| value(acc.rank(), i) as f32).collect();
        c.broadcast(BufferMut::from(&mut v[..]), root)?;
        let want: Vec<f32> = (0..7).map(|i| value(root, i) as f32).collect();
        if v != want {
            return Err(fail(format!("from root {root}: got {v:?}, want {want:?}")));
        }
    }
    Ok(Outcome::Passed)
}

fn check_all_gather(acc: &Accelerator) -> Result<Outcome> {
    let c = acc.collective().as_ref();
    let mine: Vec<f64> = (0..acc.rank() + 1).map(|i| value(acc.rank(), i)).collect();
    let all = c.all_gather(Buffer::from(&mine[..]))?;
    for (r, b) in all.iter().enumerate() {
        let want: Vec<f64> = (0..r + 1).map(|i| value(r, i)).collect();
        if b.as_slice::<f64>()? != want.as_slice() {
            return Err(fail(format!("block of rank {r} is wrong")));
        }
    }
    c.barrier().map(|()| Outcome::Passed)
}

/// Every rank's batches, gathered: equal counts, every index present, extras only as padding.
fn check_sampler(acc: &Accelerator) -> Result<Outcome> {
    let c = acc.collective().as_ref();
    let (n, batch) = (10 * acc.world_size() + 3, 4);
    let mut sampler = DistributedSampler::new(n, batch)
        .shuffle(true)
        .seed(7)
        .shard(acc.rank(), acc.world_size())?;
    sampler.set_epoch(3);
    let batches = sampler.batches()?;
    let flat: Vec<f64> = batches.iter().flatten().map(|&i| i as f64).collect();
    let counts = c.all_gather(Buffer::from(&[batches.len() as f64][..]))?;
    let all = c.all_gather(Buffer::from(&flat[..]))?;
    let counts: Vec<f64> = counts
        .iter()
        .map(|b| b.as_slice::<f64>().map(|s| s[0]))
        .collect::<Result<_>>()?;
    if counts.iter().any(|&k| k != counts[0]) {
        return Err(fail(format!(
            "ranks yield different batch counts: {counts:?}"
        )));
    }
    let mut seen = vec![0usize; n];
    for b in &all {
        for &i in b.as_slice::<f64>()? {
            seen[i as usize] += 1;
        }
    }
    if let Some(missing) = seen.iter().position(|&k| k == 0) {
        return Err(fail(format!("index {missing} is never yielded")));
    }
    let extra: usize = seen.iter().map(|&k| k - 1).sum();
    if extra != sampler.total_padding() {
        return Err(fail(format!(
            "{extra} duplicated samples but {} reported as padding",
            sampler.total_padding()
        )));
    }
    Ok(Outcome::Passed)
}

/// The speed settings of this rank's GPU took: cudarc's cross-stream event tracking is off and
/// the default memory pool's release threshold is what `gpu::device` set.
fn check_gpu_setup(acc: &Accelerator) -> Result<Outcome> {
    let device = acc.device();
    if !device.is_cuda() {
        return Ok(Outcome::Skipped("this rank runs on the CPU"));
    }
    let setup = accelerate_rs::gpu::device_setup(device)?;
    if setup.event_tracking {
        return Err(fail(
            "cudarc's event tracking is on: every op pays for cross-stream events".into(),
        ));
    }
    let Some(threshold) = setup.pool_release_threshold else {
        return Ok(Outcome::PassedVia(
            "event tracking off; this GPU has no memory pool".into(),
        ));
    };
    let want = accelerate_rs::gpu::expected_pool_release_threshold()?;
    if threshold != want {
        return Err(fail(format!(
            "the memory pool's release threshold is {threshold} bytes, want {want}"
        )));
    }
    Ok(Outcome::PassedVia(format!(
        "event tracking off; pool release threshold {}",
        if threshold == u64::MAX {
            "unlimited".to_string()
        } else {
            format!("{threshold} bytes")
        }
    )))
}

/// all_reduce / broadcast / all_gather of GPU tensors in f32, bf16 and f16 through this run's
/// collective: NCCL, or the host when ranks share a GPU. At world size 1 (where the accelerator
/// never calls NCCL) through a one-rank NCCL communicator made for the check with
/// [`NcclCollective::force_calls`], so NCCL really runs; the call count proves it.
fn check_gpu_tensors(acc: &Accelerator) -> Result<Outcome> {
    let device = acc.device();
    let DeviceLocation::Cuda { gpu_id } = device.location() else {
        return Ok(Outcome::Skipped("this rank runs on the CPU"));
    };
    let own = if acc.world_size() == 1 {
        let one = NcclCollective::group(&[gpu_id], acc.state().timeout())?
            .pop()
            .map(|(_, c)| c.force_calls())
            .ok_or_else(|| fail("no NCCL communicator was created".into()))?;
        Some(one)
    } else {
        None
    };
    let c: &dyn Collective = match &own {
        Some(one) => one,
        None => acc.collective().as_ref(),
    };
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    // One NCCL call per all_reduce, plus a broadcast, all_gather, reduce_scatter and
    // all_gather_into.
    let mut calls_per_dtype = 0;
    for dtype in dtypes {
        calls_per_dtype = gpu_all_reduces(c, device, dtype)? + 4;
        gpu_broadcast_and_gather(c, device, dtype)?;
        gpu_zero_pair(c, device, dtype)?;
    }
    if let Some(own) = &own {
        let calls = own.nccl_calls();
        let want = dtypes.len() as u64 * calls_per_dtype;
        if calls != want {
            return Err(fail(format!(
                "{calls} operations went through NCCL, want {want}"
            )));
        }
        return Ok(Outcome::PassedVia(format!(
            "{calls} NCCL calls on a one-rank communicator"
        )));
    }
    Ok(Outcome::PassedVia(format!("through {}", c.backend())))
}

/// Every reduction of GPU tensors of `dtype` through `c`, checked; returns how many calls.
fn gpu_all_reduces(c: &dyn Collective, device: &Device, dtype: DType) -> Result<u64> {
    let (rank, n) = (c.rank(), c.world_size());
    let t = Tensor::new(&[rank as f32 + 1.0; 5], device)?.to_dtype(dtype)?;
    let sum: f32 = (1..=n).map(|r| r as f32).sum();
    let reductions = [
        (ReduceOp::Sum, sum),
        (ReduceOp::Mean, sum / n as f32),
        (ReduceOp::Max, n as f32),
        (ReduceOp::Min, 1.0),
    ];
    for (op, want) in reductions {
        let out = c.all_reduce_tensor(&t, op)?;
        let got = out.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if !out.device().is_cuda()
            || got
                .iter()
                .any(|g| (g - want).abs() > 1e-2 * want.abs().max(1.0))
        {
            return Err(fail(format!(
                "all_reduce {dtype:?} {op:?}: got {got:?} on {:?}, want {want} on the GPU",
                out.device()
            )));
        }
    }
    Ok(reductions.len() as u64)
}

/// A broadcast from rank 0 and an all_gather of rows of different counts, on the GPU, checked.
fn gpu_broadcast_and_gather(c: &dyn Collective, device: &Device, dtype: DType) -> Result<()> {
    let (rank, n) = (c.rank(), c.world_size());
    let b = c.broadcast_tensor(
        &Tensor::new(&[rank as f32 + 7.0; 3], device)?.to_dtype(dtype)?,
        0,
    )?;
    let got = b.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if got != vec![7.0; 3] || !b.device().is_cuda() {
        return Err(fail(format!(
            "broadcast {dtype:?} from rank 0: got {got:?} on {:?}",
            b.device()
        )));
    }
    let rows = Tensor::full(rank as f32, (rank + 1, 2), device)?.to_dtype(dtype)?;
    let g = c.all_gather_tensor(&rows)?;
    let want: Vec<f32> = (0..n)
        .flat_map(|r| std::iter::repeat_n(r as f32, 2 * (r + 1)))
        .collect();
    let got = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if g.dims() != [want.len() / 2, 2] || got != want || !g.device().is_cuda() {
        return Err(fail(format!(
            "all_gather {dtype:?}: got {:?} {got:?} on {:?}, want {want:?}",
            g.dims(),
            g.device()
        )));
    }
    Ok(())
}

/// ZeRO's pair (reduce_scatter, then all_gather_into) on an odd length, on the GPU, checked.
fn gpu_zero_pair(c: &dyn Collective, device: &Device, dtype: DType) -> Result<()> {
    let (rank, n) = (c.rank(), c.world_size());
    // ZeRO's pair on an odd length: element i is (rank + 1) * (i + 1) on every rank.
    let len = 7;
    let x: Vec<f32> = (0..len).map(|i| ((rank + 1) * (i + 1)) as f32).collect();
    let x = Tensor::new(x.as_slice(), device)?.to_dtype(dtype)?;
    let mine = c.reduce_scatter_tensor(&x, ReduceOp::Sum)?;
    let own = accelerate_rs::collective::chunk_range(len, n, rank);
    let total: usize = (1..=n).sum();
    let want: Vec<f32> = own.clone().map(|i| (total * (i + 1)) as f32).collect();
    let got = mine.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if got != want || !mine.device().is_cuda() {
        return Err(fail(format!(
            "reduce_scatter {dtype:?} of {len} elements: rank {rank} got {got:?} on {:?}, want {want:?}",
            mine.device()
        )));
    }
    // Each rank fills its own chunk with its rank (the rest is garbage the gather replaces).
    let mut v = vec![-1f32; len];
    for e in &mut v[own] {
        *e = rank as f32;
    }
    let all = c.all_gather_into_tensor(&Tensor::new(v.as_slice(), device)?.to_dtype(dtype)?)?;
    let want: Vec<f32> = (0..len)
        .map(|i| {
            (0..n)
                .find(|&r| accelerate_rs::collective::chunk_range(len, n, r).contains(&i))
                .unwrap_or(usize::MAX) as f32
        })
        .collect();
    let got = all.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    if got != want || !all.device().is_cuda() {
        return Err(fail(format!(
            "all_gather_into {dtype:?} of {len} elements: got {got:?} on {:?}, want {want:?}",
            all.device()
        )));
    }
    Ok(())
}

const B: usize = 4;
const STEPS: usize = 3;
const LR: f64 = 0.05;

fn regression_data(n: usize, device: &Device) -> Result<TensorDataset> {
    let x: Vec<f32> = (0..n * 3)
        .map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.5)
        .collect();
    let x = Tensor::from_vec(x, (n, 3), device)?;
    let y = (x.sum_keepdim(1)? * 2.0)?;
    TensorDataset::new(vec![x, y])
}

fn weights(offset: f32, device: &Device) -> Result<Vec<(String, Var)>> {
    let w = Tensor::new(&[[0.1f32], [-0.2], [0.3]], device)?;
    Ok(vec![
        ("w".to_string(), Var::from_tensor(&(w + offset as f64)?)?),
        ("b".to_string(), Var::zeros(1, DType::F32, device)?),
    ])
}

fn mse(p: &[(String, Var)], x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let pred = x
        .matmul(p[0].1.as_tensor())?
        .broadcast_add(p[1].1.as_tensor())?;
    Ok(candle_nn::loss::mse(&pred, y)?)
}

fn params_of(p: &[(String, Var)]) -> Result<Vec<f32>> {
    let mut out = p[0].1.as_tensor().flatten_all()?.to_vec1::<f32>()?;
    out.extend(p[1].1.as_tensor().to_vec1::<f32>()?);
    Ok(out)
}

/// Stage 3: the model through `prepare_sharded` as one unit, each rank holding only its slices of
/// the parameters, gathered for the forward and its recomputation; the trained values and
/// whether the optimizer holds only this rank's slices.
fn train_sharded(
    acc: &Accelerator,
    p: &[(String, Var)],
    opt: Sgd,
    loader: DataLoader,
) -> Result<(Vec<f32>, bool)> {
    let (mut opt, loader, model) = acc.prepare_sharded(p, &WrapPolicy::one_unit(), opt, loader)?;
    for batch in loader.iter()? {
        let batch = batch?;
        let pred = model.run("", &batch[0], |vb, x| {
            x.matmul(&vb.get((3, 1), "w")?)?
                .broadcast_add(&vb.get(1, "b")?)
        })?;
        opt.backward_step(&candle_nn::loss::mse(&pred, &batch[1])?)?;
    }
    let full: std::collections::HashMap<String, Tensor> =
        model.full_parameters()?.into_iter().collect();
    let mut got = full["w"].flatten_all()?.to_vec1::<f32>()?;
    got.extend(full["b"].to_vec1::<f32>()?);
    Ok((got, opt.is_sharded()))
}

/// DDP with per-rank batch B must equal plain SGD (momentum 0.9) with batch world × B, under
/// every ZeRO stage (`ACCELERATE_RS_ZERO_STAGE`: the optimizer then holds only this rank's slices
/// of the momentum and the parameters are gathered after each step; at stage 3 each rank holds
/// only its slices of the parameters too, gathered for the forward and its recomputation).
fn check_ddp(acc: &Accelerator) -> Result<Outcome> {
    let world = acc.world_size();
    let device = acc.device();
    let data = regression_data(world * B * STEPS, device)?;
    // Ranks start from different values: prepare must give them rank 0's.
    let p = weights(acc.rank() as f32, device)?;
    let config = SgdConfig::new(LR).momentum(0.9);
    let opt = Sgd::new(p.iter().map(|(_, v)| v.clone()).collect(), config.clone())?;
    let loader = DataLoader::new(data.clone(), B);
    let (got, sharded) = if acc.state().zero_stage() >= 3 {
        train_sharded(acc, &p, opt, loader)?
    } else {
        // Below stage 3 the plain path (it trains in f32 whatever the mixed-precision mode,
        // which `prepare` leaves to `prepare_mixed`).
        let (mut opt, loader) = acc.prepare(&p, opt, loader)?;
        for batch in loader.iter()? {
            let batch = batch?;
            opt.backward_step(&mse(&p, &batch[0], &batch[1])?)?;
        }
        (params_of(&p)?, opt.is_sharded())
    };

    let r = weights(0.0, device)?;
    let mut sgd = Sgd::new(r.iter().map(|(_, v)| v.clone()).collect(), config)?;
    // The reference batches on this rank's device (a loader's default is the CPU).
    for batch in DataLoader::new(data, world * B).device(device).iter()? {
        let batch = batch?;
        sgd.backward_step(&mse(&r, &batch[0], &batch[1])?)?;
    }
    let want = params_of(&r)?;
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    if diff > 1e-5 {
        return Err(fail(format!(
            "max abs diff {diff} between DDP ({got:?}) and the reference ({want:?})"
        )));
    }
    let all = acc.collective().all_gather(Buffer::from(&got[..]))?;
    if all.iter().any(|b| b.bytes() != all[0].bytes()) {
        return Err(fail("replicas differ after the steps".into()));
    }
    match acc.state().zero_stage() {
        0 => Ok(Outcome::Passed),
        stage => Ok(Outcome::PassedVia(format!(
            "zero_stage {stage}: sharded {sharded}"
        ))),
    }
}
