//! The accelerate-rs side of `scripts/pytorch_hf_bench.py`: a Llama-style
//! `LlamaForCausalLm` (default hidden 512, 4 layers, 8 heads, 2 key/value heads, vocab 8000,
//! SwiGLU 1408), or with `--family qwen3` a Qwen3 of the same shape (q/k norms, `head_dim`
//! hidden / heads), trained on random tokens (sequences of 256, batch 4 per process) with AdamW,
//! timed per step (`--dtype bf16` and the shape flags for `pytorch_hf_bench.py --gpu`, on the GPU
//! a `cuda` build picks). Run it under the launcher; rank 0 prints one line
//! `RESULT-DDP world=W ms_mean=... ms_median=... samples_per_s=...`.
//!
//!     cargo build --release -p accelerate-rs-models --example hf_bench
//!     cargo run --release -- launch --cpu -n 2 target/release/examples/hf_bench --steps 10

use std::time::Instant;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::Accelerator;
use accelerate_rs_models::{AutoModel, Config};
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_nn::Optimizer;
use clap::Parser;

#[path = "common/llama_shape.rs"]
mod llama_shape;
use llama_shape::LlamaShape;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 10)]
    steps: usize,
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[command(flatten)]
    model: LlamaShape,
    #[arg(long, default_value_t = 256)]
    seq: usize,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// `llama` or `qwen3`.
    #[arg(long, default_value = "llama")]
    family: String,
    /// The parameters' (and so the compute's) dtype: `f32` or `bf16` (the GPU table's).
    #[arg(long, default_value = "f32")]
    dtype: String,
}

/// The model of `args` (family, shape, dtype) on `device`.
fn build(args: &Args, device: &candle_core::Device) -> Result<AutoModel> {
    let mut json = args.model.config_json(args.seq);
    match args.family.as_str() {
        "llama" => {}
        "qwen3" => {
            json["model_type"] = "qwen3".into();
            json["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
            json["head_dim"] = (args.model.hidden / args.model.heads).into();
        }
        other => anyhow::bail!("--family {other}: llama or qwen3"),
    }
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => anyhow::bail!("--dtype {other}: f32 or bf16"),
    };
    let config = Config::from_json(std::path::Path::new("<hf_bench>"), &json)?;
    Ok(AutoModel::from_config(&config, device, dtype)?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.steps > 0,
        "--steps 0: at least one timed step is needed"
    );
    let accelerator = Accelerator::new()?;
    let device = accelerator.device().clone();
    let model = build(&args, &device)?;
    let opt = AdamW::new(
        model.varmap().all_vars(),
        ParamsAdamW {
            lr: 1e-3,
            ..Default::default()
        },
    )?;
    accelerator.prepare_model(model.varmap())?;
    let mut opt = accelerator.prepare_optimizer(opt);

    let mut rng = ChaCha8Rng::seed_from_u64(0x5EED + accelerator.rank() as u64);
    let mut timed = Timed::default();
    let mut timer = accelerator.step_timer();
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            accelerator.wait_for_everyone()?;
        }
        let ids: Vec<u32> = (0..args.batch * args.seq)
            .map(|_| rng.random_range(0..args.model.vocab as u32))
            .collect();
        let ids = Tensor::from_vec(ids, (args.batch, args.seq), &device)?;
        let labels = ids.to_dtype(DType::I64)?;
        // A GPU queues its work: the step is timed from an idle device to an idle device.
        device.synchronize()?;
        timer.start();
        let start = Instant::now();
        let loss = model.loss(&ids, &labels)?;
        device.synchronize()?;
        let forward = start.elapsed().as_secs_f64() * 1e3;
        opt.backward_step(&loss)?;
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let split = timer.stop()?;
        if step >= args.warmup {
            let split = [split.backward, split.communication, split.optimizer];
            for (sum, d) in timed.phases.iter_mut().zip(split) {
                *sum += d.as_secs_f64() * 1e3 / args.steps as f64;
            }
            timed.steps.push(ms);
            timed.forwards.push(forward);
        }
    }
    report(&accelerator, &args, &timed)
}

/// The timed steps of one process.
#[derive(Default)]
struct Timed {
    /// Milliseconds of each step.
    steps: Vec<f64>,
    /// Milliseconds of each step's forward pass.
    forwards: Vec<f64>,
    /// Mean milliseconds of the engine's backward, communication and optimizer phases.
    phases: [f64; 3],
}

/// Rank 0 prints the BREAKDOWN and RESULT-DDP lines (the mean step over all ranks).
fn report(accelerator: &Accelerator, args: &Args, timed: &Timed) -> Result<()> {
    let mean_of = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mean = mean_of(&timed.steps);
    let mut sorted = timed.steps.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let world = accelerator.world_size();
    let mean_all = accelerator.average(mean)?;
    // On a GPU: the device pool's high-water mark (what the step needs at this size).
    let device = accelerator.device();
    let peak = if device.is_cuda() {
        let peak = accelerate_rs::gpu::pool_memory(device)?.peak;
        format!(" device_peak={peak}")
    } else {
        String::new()
    };
    if accelerator.is_main_process() {
        let forward = mean_of(&timed.forwards);
        let [backward, communication, optimizer] = timed.phases;
        println!(
            "BREAKDOWN forward_ms={forward:.2} backward_and_step_ms={:.2} (backward_ms=\
             {backward:.2} communication_ms={communication:.2} optimizer_ms={optimizer:.2})",
            mean - forward
        );
        println!(
            "RESULT-DDP world={world} ms_mean={mean_all:.4} ms_median={median:.4} samples_per_s={:.4}{peak}",
            (world * args.batch) as f64 * 1e3 / mean_all
        );
    }
    Ok(())
}
