//! `overhead --lm-gpu`: transformer_lm's training step on one GPU, for
//! `scripts/pytorch_lm_bench.py --gpu` (a module of benches/overhead.rs, whose model, data and
//! statistics it uses).

use std::time::Instant;

use accelerate_rs::{nn, Accelerator};
use anyhow::{bail, Result};
use candle_core::DType;

use super::{
    build_workload, loader_of, mean, median, ms, workload_data, Workload, ADAMW_LR, LM_BATCH,
    LM_SEQ,
};

/// Untimed steps before `--lm-gpu`'s timed ones.
const LM_GPU_WARMUP: usize = 10;

/// transformer_lm's model (the transformer workload) trained on GPU 0 the way a user of
/// accelerate-rs writes it: `Accelerator`, `prepare`, the fused AdamW (lr 1e-3), clipping at norm
/// 1.0, `linear_cross_entropy`, batches of 8 x 128 random tokens from a DataLoader on the device;
/// `steps` timed steps (each ends with a device synchronization) after 10 untimed ones. Once
/// with `accelerate_rs::nn`'s composed ops and, in a `cuda` build, once with its CUDA
/// kernels, each on a fresh accelerator and model. Prints a table and, per variant,
/// `RESULT-LM-GPU variant=<composed|kernels> ms_mean=.. ms_median=.. tokens_per_s=.. loss=..`.
pub(super) fn lm_gpu(steps: usize, on_cpu: bool) -> Result<()> {
    let mut variants = vec![("composed", false)];
    if nn::CUDA_KERNELS_BUILT {
        variants.push(("kernels", true));
    }
    println!(
        "accelerate-rs on one GPU: {}, AdamW lr {ADAMW_LR} (fused), clip 1.0, {steps} timed steps after {LM_GPU_WARMUP}",
        Workload::Transformer.describe()
    );
    let mut rows = Vec::new();
    for (name, kernels) in variants {
        nn::set_cuda_kernels(kernels);
        let accelerator = Accelerator::builder().cpu(on_cpu).build()?;
        if !on_cpu && !accelerator.device().is_cuda() {
            bail!("--lm-gpu needs a GPU: build with --features cuda and run where one is visible");
        }
        let device = accelerator.device().clone();
        let samples = LM_BATCH * (LM_GPU_WARMUP + steps);
        let (x, y) = workload_data(Workload::Transformer, samples, &device)?;
        let (varmap, model) = build_workload(Workload::Transformer, &device)?;
        let opt = accelerate_rs::optim::AdamW::new_lr(varmap.all_vars(), ADAMW_LR)?;
        let (mut opt, loader) = accelerator.prepare(&varmap, opt, loader_of(&x, &y, LM_BATCH)?)?;
        opt.set_clip_grad_norm(Some(1.0));
        let mut times = Vec::with_capacity(steps);
        let mut last = None;
        device.synchronize()?;
        for (step, batch) in loader.iter()?.enumerate() {
            let start = Instant::now();
            let batch = batch?;
            let loss = model.loss(&batch[0], &batch[1])?;
            opt.backward_step(&loss)?;
            device.synchronize()?;
            if step >= LM_GPU_WARMUP {
                times.push(ms(start.elapsed()));
            }
            last = Some(loss);
        }
        let loss = match last {
            Some(l) => l.to_dtype(DType::F32)?.to_scalar::<f32>()?,
            None => bail!("no step ran"),
        };
        if !loss.is_finite() || times.len() != steps {
            bail!("{name}: {} timed steps, last loss {loss}", times.len());
        }
        let (m, md) = (mean(&times), median(&times));
        let tokens = (LM_BATCH * LM_SEQ) as f64 * 1e3 / m;
        println!(
            "RESULT-LM-GPU variant={name} ms_mean={m:.3} ms_median={md:.3} tokens_per_s={tokens:.0} loss={loss:.4}"
        );
        rows.push((name, m, md, tokens));
    }
    nn::set_cuda_kernels(true);
    println!();
    println!("| accelerate-rs, nn ops | ms/step mean | ms/step median | tokens/s |");
    println!("|---|---:|---:|---:|");
    for (name, m, md, t) in rows {
        println!("| {name} | {m:.2} | {md:.2} | {t:.0} |");
    }
    Ok(())
}
