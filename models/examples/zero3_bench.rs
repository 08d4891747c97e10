//! Peak resident memory per rank of training a Llama-style model folder at each ZeRO stage
//! (`scripts/zero3_memory_bench.py` runs it for stages 0 to 3 on 1, 2 and 4 processes and
//! prints the table of BENCHMARKS.md).
//!
//! `zero3_bench --make DIR` writes the model (default: hidden 512, 12 layers, 8 heads, 2
//! key/value heads, SwiGLU 1408, vocab 8000: 42 M parameters, f32) as a Hugging Face folder.
//! Started by `accelerate-rs launch` (`--zero-stage S`), each rank loads the folder (stage 3:
//! `from_pretrained_sharded`, reading only its slices; below: `from_pretrained`, every rank
//! the whole model), prepares AdamW, trains `--warmup` + `--steps` steps on random tokens
//! (every block checkpointed below stage 3 too, so that every stage runs in the same memory
//! regime: stage 3 always recomputes its blocks) and prints one line:
//!
//!     rank=R world=N stage=S start=B base=B load_peak=B train_peak=B step_ms=T tokens_per_s=X
//!
//! with `start` the resident set when the program starts, `base` once the accelerator is
//! built (the collective's buffers), `load_peak` the peak (`VmHWM`) after loading and
//! `train_peak` at the end, in bytes; on a GPU also ` device_peak=B`, the high-water mark of
//! the device's memory pool (`scripts/gpu-smoke.sh` step 16). `ACCELERATE_RS_OFFLOAD_OPTIMIZER=1`
//! at stage 3 keeps the shards' masters and optimizer state in host memory.
//!
//!     cargo build --release -p accelerate-rs-models --example zero3_bench -p accelerate-rs-cli
//!     target/release/examples/zero3_bench --make /tmp/llama-42m
//!     target/release/accelerate-rs launch --cpu -n 4 --zero-stage 3 \
//!         target/release/examples/zero3_bench --model /tmp/llama-42m

use std::path::PathBuf;
use std::time::Instant;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::Accelerator;
use accelerate_rs_models::{LlamaConfig, LlamaForCausalLm};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "common/llama_shape.rs"]
mod llama_shape;
use llama_shape::LlamaShape;

#[derive(Parser, Debug)]
struct Args {
    /// Write the model folder here and exit.
    #[arg(long)]
    make: Option<PathBuf>,
    /// The model folder to train.
    #[arg(long)]
    model: Option<PathBuf>,
    #[command(flatten)]
    shape: LlamaShape,
    /// Layers of the model `--make` writes (the shape's `--layers` is ignored there).
    #[arg(long, default_value_t = 12)]
    make_layers: usize,
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Sequences per rank per step.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 3)]
    steps: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
}

/// A size line (`VmHWM:`, `VmRSS:`) of `/proc/self/status`, in bytes.
fn status_bytes(key: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .with_context(|| format!("no {key} in /proc/self/status"))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .with_context(|| format!("{key} without a value"))?
        .parse()?;
    Ok(kb * 1024)
}

fn make(args: &Args, dir: &PathBuf) -> Result<()> {
    let shape = LlamaShape {
        layers: args.make_layers,
        ..args.shape.clone()
    };
    let json = shape.config_json(args.seq.max(512));
    let config = LlamaConfig::from_json(std::path::Path::new("<zero3_bench>"), &json)?;
    let model = LlamaForCausalLm::from_config(&config, &Device::Cpu, DType::F32)?;
    model.save_pretrained(dir)?;
    let n: usize = model
        .varmap()
        .all_vars()
        .iter()
        .map(|v| v.elem_count())
        .sum();
    println!("wrote {} ({n} parameters)", dir.display());
    Ok(())
}

/// ZERO3_TRACE=1: the resident set and its peak after each phase, on stderr.
fn mark(rank: usize, what: &str) {
    if std::env::var_os("ZERO3_TRACE").is_none() {
        return;
    }
    let mib = |k: &str| status_bytes(k).unwrap_or(0) >> 20;
    let before = mib("VmRSS:");
    // What is live: glibc's free memory given back first.
    accelerate_rs::allocator::trim();
    eprintln!(
        "rank {rank}: {what}: rss {before} MiB (live {} MiB), peak {} MiB",
        mib("VmRSS:"),
        mib("VmHWM:")
    );
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.make {
        return make(&args, dir);
    }
    let dir = args.model.clone().context("--model DIR (or --make DIR)")?;
    let start = status_bytes("VmRSS:")?;
    let acc = Accelerator::new()?;
    let base = status_bytes("VmRSS:")?;
    let stage = acc.state().zero_stage();
    let cfg = ParamsAdamW {
        lr: 1e-4,
        ..ParamsAdamW::default()
    };
    let mut model = if stage == 3 {
        LlamaForCausalLm::from_pretrained_sharded(&dir, &acc, DType::F32)?
    } else {
        LlamaForCausalLm::from_pretrained(&dir, acc.device(), DType::F32)?
    };
    let load_peak = status_bytes("VmHWM:")?;
    model.train(true);
    model.set_gradient_checkpointing(true);
    let vocab = model.config().vocab_size as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(acc.rank() as u64);
    let mut batch = || -> Result<Tensor> {
        let ids: Vec<u32> = (0..args.batch * args.seq)
            .map(|_| rng.random_range(0..vocab))
            .collect();
        Ok(Tensor::from_vec(ids, (args.batch, args.seq), acc.device())?)
    };
    let mut times = Vec::new();
    let rank = acc.rank();
    let mark = |what: &str| mark(rank, what);
    mark("loaded");
    macro_rules! steps {
        ($opt:expr) => {
            for i in 0..args.warmup + args.steps {
                let ids = batch()?;
                let t = Instant::now();
                let loss = model.loss(&ids, &ids)?;
                mark("forward");
                let grads = acc.backward(&loss)?;
                mark("backward");
                drop(loss);
                mark("graph dropped");
                if let Some(grads) = grads {
                    $opt.step(&grads)?;
                }
                mark("step");
                if i >= args.warmup {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
        };
    }
    if stage == 3 {
        let s = model
            .sharded_parameters()
            .context("a sharded model")?
            .clone();
        let mut opt = acc.prepare_sharded_optimizer(&s, AdamW::new(Vec::new(), cfg)?)?;
        steps!(opt);
    } else {
        let opt = AdamW::new(model.varmap().all_vars(), cfg)?;
        acc.prepare_model(model.varmap())?;
        let mut opt = acc.prepare_optimizer(opt);
        steps!(opt);
    }
    let tokens = args.batch * args.seq * acc.world_size();
    report(&acc, stage, tokens, [start, base, load_peak], times)
}

/// One line per rank: the memory figures and the median step.
fn report(
    acc: &Accelerator,
    stage: usize,
    tokens: usize,
    memory: [u64; 3],
    mut times: Vec<f64>,
) -> Result<()> {
    let [start, base, load_peak] = memory;
    let train_peak = status_bytes("VmHWM:")?;
    times.sort_by(f64::total_cmp);
    let step = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let tokens = tokens as f64;
    // On a GPU: the device pool's high-water mark too (the peak of the training that matters).
    let device = if acc.device().is_cuda() {
        acc.device().synchronize()?;
        let peak = accelerate_rs::gpu::pool_memory(acc.device())?.peak;
        format!(" device_peak={peak}")
    } else {
        String::new()
    };
    println!(
        "rank={} world={} stage={stage} start={start} base={base} load_peak={load_peak} train_peak={train_peak} step_ms={:.0} tokens_per_s={:.0}{device}",
        acc.rank(),
        acc.world_size(),
        step * 1e3,
        tokens / step
    );
    Ok(())
}
