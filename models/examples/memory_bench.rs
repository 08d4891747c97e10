//! Peak memory and step time of training a Llama-style model (default hidden 512, 4 layers,
//! 8 heads, 2 key/value heads, SwiGLU 1408, vocab 8000, sequences of 512, batch 8; f32, AdamW,
//! one process), in four configurations: full fine-tuning (`plain`), full fine-tuning with
//! activation checkpointing (`ckpt`), LoRA r=8 on every linear layer of the blocks (`lora`),
//! and both (`lora-ckpt`).
//!
//! Each measurement is a child process (this program with `--child CONFIG`) that builds the
//! model, trains `--warmup` + `--steps` steps on random tokens and reports its peak resident
//! set (`VmHWM` of `/proc/self/status`), what it held before the model existed (`VmRSS`), and
//! the median step time; the table puts `accelerate-rs estimate-memory`'s prediction
//! (`accelerate_rs::memory::estimate`) beside the peak above that start. The parent runs `--rounds`
//! rounds, each over every configuration in a rotated order (so that a loaded machine affects
//! them alike), and prints a Markdown table: medians with the spread (min–max) over the rounds.
//!
//! On a GPU (a `cuda` build on a machine with one) the peak is the GPU memory pool's high-water
//! mark (`accelerate_rs::gpu::pool_memory`, PyTorch's `max_memory_allocated`), from 0 at the
//! start, and the step time waits for the device.
//!
//! `--find-batch-size START` instead runs `Accelerator::find_executable_batch_size` from batch
//! size START, one training step per attempt, and prints the sizes tried and the out-of-memory
//! retries: on a GPU a START too big for it proves that CUDA's allocation failures become
//! retries; on the CPU, `ACCELERATE_RS_TEST_MEMORY_LIMIT` simulates the limit.
//!
//!     cargo build --release -p accelerate-rs-models --example memory_bench
//!     target/release/examples/memory_bench --rounds 3
//!     ACCELERATE_RS_TEST_MEMORY_LIMIT=1GiB target/release/examples/memory_bench --find-batch-size 64

use std::process::Command;
use std::time::Instant;

use accelerate_rs::memory::{estimate, Lora, ModelSpec, Plan};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, BatchSizeSearch};
use accelerate_rs_models::{LlamaConfig, LlamaForCausalLm};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[path = "common/llama_shape.rs"]
mod llama_shape;
use llama_shape::LlamaShape;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const CONFIGS: &[&str] = &["plain", "ckpt", "lora", "lora-ckpt"];

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Rounds over the configurations.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Timed steps per measurement.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// The configurations to measure, comma-separated (plain, ckpt, lora, lora-ckpt).
    #[arg(long, default_value = "plain,ckpt,lora,lora-ckpt")]
    configs: String,
    #[command(flatten)]
    model: LlamaShape,
    #[arg(long, default_value_t = 512)]
    seq: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// LoRA's rank (alpha = 2 r), on q, k, v, o, gate, up and down projections.
    #[arg(long, default_value_t = 8)]
    lora_r: usize,
    /// Run `find_executable_batch_size` from this batch size instead of the table.
    #[arg(long)]
    find_batch_size: Option<usize>,
    /// Internal: measure one configuration in this process.
    #[arg(long)]
    child: Option<String>,
}

/// LoRA's target modules here: every linear layer of the blocks.
const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// What `accelerate-rs estimate-memory` predicts for `config`, in bytes.
fn predicted(args: &Args, config: &str) -> Result<u64> {
    let path = std::path::Path::new("<memory_bench>");
    let llama = LlamaConfig::from_json(path, &args.model.config_json(args.seq))?;
    let spec = ModelSpec::from_architecture(LlamaForCausalLm::memory_architecture(&llama)?);
    let plan = Plan {
        lora: config.starts_with("lora").then(|| Lora {
            r: args.lora_r,
            targets: TARGETS.iter().map(|t| t.to_string()).collect(),
        }),
        batch_size: args.batch,
        seq_len: args.seq,
        checkpointing: config.ends_with("ckpt"),
        ..Plan::default()
    };
    Ok(estimate(&spec, &plan)?.total())
}

/// `VmHWM` (peak resident set) of this process, in bytes.
fn peak_rss() -> Result<u64> {
    status_bytes("VmHWM:")
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

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// What is measured: the process's resident set, or the GPU's memory pool.
fn memory_kind(device: &Device) -> &'static str {
    if device.is_cuda() {
        "gpu"
    } else {
        "rss"
    }
}

/// Bytes held now (`VmRSS`, or the GPU pool's bytes in use).
fn held(device: &Device) -> Result<u64> {
    if device.is_cuda() {
        Ok(accelerate_rs::gpu::pool_memory(device)?.in_use)
    } else {
        status_bytes("VmRSS:")
    }
}

/// The peak since the start (`VmHWM`, or the GPU pool's high-water mark once the queued work
/// is done).
fn peak(device: &Device) -> Result<u64> {
    if device.is_cuda() {
        device.synchronize()?;
        Ok(accelerate_rs::gpu::pool_memory(device)?.peak)
    } else {
        peak_rss()
    }
}

/// `steps` training steps of a fresh model (LoRA and checkpointing as `config` says) at batch
/// size `batch`: the median step and forward times in ms and the trainable parameter count.
fn train(
    args: &Args,
    accelerator: &Accelerator,
    config: &str,
    batch: usize,
    warmup: usize,
    steps: usize,
) -> accelerate_rs::Result<(f64, f64, usize)> {
    let (lora, ckpt) = match config {
        "plain" => (false, false),
        "ckpt" => (false, true),
        "lora" => (true, false),
        "lora-ckpt" => (true, true),
        other => {
            return Err(accelerate_rs::Error::invalid(
                "configuration",
                format!("unknown configuration `{other}` (one of {CONFIGS:?})"),
            ))
        }
    };
    let device = accelerator.device().clone();
    let json = args.model.config_json(args.seq);
    let config = LlamaConfig::from_json(std::path::Path::new("<memory_bench>"), &json)?;
    let mut model = LlamaForCausalLm::from_config(&config, &device, DType::F32)?;
    if lora {
        model.add_lora(
            &LoraConfig::new(args.lora_r, 2.0 * args.lora_r as f64).target_modules(TARGETS),
        )?;
    }
    model.set_gradient_checkpointing(ckpt);
    model.train(true);
    let trainable = model.trainable_parameters();
    let n_trainable: usize = trainable.all_vars().iter().map(|v| v.elem_count()).sum();
    accelerator.prepare_model(trainable)?;
    let opt = AdamW::new_lr(trainable.all_vars(), 1e-4)?;
    let mut opt = accelerator.prepare_optimizer(opt);

    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut next_batch = || -> accelerate_rs::Result<Tensor> {
        let ids: Vec<u32> = (0..batch * args.seq)
            .map(|_| rng.random_range(0..args.model.vocab as u32))
            .collect();
        Ok(Tensor::from_vec(ids, (batch, args.seq), &device)?)
    };
    let (mut times, mut forward) = (Vec::new(), Vec::new());
    for step in 0..warmup + steps {
        let ids = next_batch()?;
        let labels = ids.to_dtype(DType::I64)?;
        device.synchronize()?;
        let start = Instant::now();
        let loss = model.loss(&ids, &labels)?;
        device.synchronize()?;
        let fwd = start.elapsed().as_secs_f64() * 1e3;
        opt.backward_step(&loss)?;
        device.synchronize()?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if step >= warmup {
            times.push(ms);
            forward.push(fwd);
        }
    }
    Ok((median(&mut times), median(&mut forward), n_trainable))
}

/// One configuration in this process: prints
/// `RESULT peak_bytes step_ms trainable_params forward_ms start_bytes rss|gpu`.
fn child(args: &Args, config: &str) -> Result<()> {
    let accelerator = Accelerator::builder().rank(0).world_size(1).build()?;
    let device = accelerator.device().clone();
    if device.is_cuda() {
        accelerate_rs::gpu::reset_peak_memory(&device)?;
    }
    // What the process holds before the model exists (the program, its libraries).
    let start = held(&device)?;
    let (ms, fwd, n_trainable) = train(
        args,
        &accelerator,
        config,
        args.batch,
        args.warmup,
        args.steps,
    )?;
    println!(
        "RESULT {} {ms:.1} {n_trainable} {fwd:.1} {start} {}",
        peak(&device)?,
        memory_kind(&device)
    );
    Ok(())
}

/// `--find-batch-size`: the search from `start`, one full-model training step per attempt.
fn find_batch_size(args: &Args, start: usize) -> Result<()> {
    let accelerator = Accelerator::new()?;
    let mut tried = Vec::new();
    let search = BatchSizeSearch::new(start).probe_steps(1);
    let (used, ms) = accelerator.find_executable_batch_size_with(search, |b| {
        tried.push(b);
        let (ms, _, _) = train(args, &accelerator, "plain", b, 0, 1)?;
        Ok((b, ms))
    })?;
    let device = accelerator.device();
    let peak = if device.is_cuda() {
        let bytes = accelerate_rs::gpu::pool_memory(device)?.peak;
        format!(
            ", GPU pool peak {:.1} GiB",
            bytes as f64 / (1u64 << 30) as f64
        )
    } else {
        String::new()
    };
    accelerator.print(format!(
        "find_executable_batch_size on {device:?}: started at {start}, tried {tried:?}; out-of-memory retries: {}; ran at batch size {used} (seq {}, one step in {ms:.0} ms{peak})",
        tried.len() - 1,
        args.seq
    ));
    Ok(())
}

/// One configuration's measurements over the rounds.
#[derive(Clone, Default)]
struct Measured {
    /// Peak resident sets, bytes.
    peaks: Vec<f64>,
    /// Median step times, ms.
    times: Vec<f64>,
    /// Trainable parameters.
    trainable: u64,
    /// Peaks above what the process held at its start, bytes.
    above: Vec<f64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(config) = &args.child {
        return child(&args, config);
    }
    if let Some(start) = args.find_batch_size {
        return find_batch_size(&args, start);
    }
    let configs: Vec<String> = args
        .configs
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    if let Some(bad) = configs.iter().find(|c| !CONFIGS.contains(&c.as_str())) {
        bail!("--configs: unknown configuration `{bad}` (one of {CONFIGS:?})");
    }
    let exe = std::env::current_exe()?;
    let mut results = vec![Measured::default(); configs.len()];
    let mut kind = String::new();
    for round in 0..args.rounds {
        for k in 0..configs.len() {
            let i = (round + k) % configs.len();
            let out = Command::new(&exe)
                .args(std::env::args().skip(1))
                .arg("--child")
                .arg(&configs[i])
                .output()
                .with_context(|| format!("running {}", exe.display()))?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            let Some(line) = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
                bail!(
                    "{}: no result (exit {:?}): {}",
                    configs[i],
                    out.status.code(),
                    String::from_utf8_lossy(&out.stderr)
                );
            };
            let f: Vec<&str> = line.split_whitespace().collect();
            let (peak, ms, n): (f64, f64, u64) = (f[0].parse()?, f[1].parse()?, f[2].parse()?);
            let start: f64 = f.get(4).context("no start size in the result")?.parse()?;
            kind = f
                .get(5)
                .context("no memory kind in the result")?
                .to_string();
            eprintln!(
                "round {round} {:>9}: peak {:7.1} MiB, step {:8.1} ms (forward {} ms)",
                configs[i],
                peak / (1 << 20) as f64,
                ms,
                f.get(3).unwrap_or(&"?")
            );
            results[i].peaks.push(peak);
            results[i].times.push(ms);
            results[i].trainable = n;
            results[i].above.push(peak - start);
        }
    }
    println!(
        "Llama-style: hidden {}, {} layers, {} heads ({} KV), SwiGLU {}, vocab {}; batch {} x seq {}; f32, AdamW; {} rounds of {} timed steps",
        args.model.hidden, args.model.layers, args.model.heads, args.model.kv_heads, args.model.intermediate, args.model.vocab, args.batch, args.seq, args.rounds, args.steps
    );
    println!();
    let peak_name = match kind.as_str() {
        "gpu" => "peak GPU memory (pool)",
        _ => "peak RSS",
    };
    println!("| configuration | trainable parameters | {peak_name} (MiB), median (min–max) | above the start (MiB) | estimate-memory (MiB) | estimate / above the start | step time (ms), median (min–max) |");
    println!("|---|---|---|---|---|---|---|");
    let spread = |v: &[f64], scale: f64| {
        let mut v: Vec<f64> = v.iter().map(|x| x * scale).collect();
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{:.0} ({:.0}–{:.0})", median(&mut v), lo, hi)
    };
    let mib = 1.0 / (1 << 20) as f64;
    for (c, r) in configs.iter().zip(&results) {
        let (peaks, times, n, above) = (&r.peaks, &r.times, r.trainable, &r.above);
        let predicted = predicted(&args, c)? as f64 * mib;
        let above_median = median(&mut above.iter().map(|x| x * mib).collect::<Vec<_>>());
        println!(
            "| {c} | {n} | {} | {} | {predicted:.0} | {:.2} | {} |",
            spread(peaks, mib),
            spread(above, mib),
            predicted / above_median,
            spread(times, 1.0)
        );
    }
    // Ratios per round (the same round's neighbours), against `plain` / `lora`.
    let pairs = [("ckpt", "plain"), ("lora-ckpt", "lora"), ("lora", "plain")];
    println!();
    for (a, b) in pairs {
        let (Some(ia), Some(ib)) = (
            configs.iter().position(|c| c == a),
            configs.iter().position(|c| c == b),
        ) else {
            continue;
        };
        // Per round, `a`'s figure over `b`'s: their median and the list.
        let ratios = |x: &[f64], y: &[f64]| {
            let mut r: Vec<f64> = x.iter().zip(y).map(|(x, y)| x / y).collect();
            let list: Vec<String> = r.iter().map(|r| format!("{r:.2}")).collect();
            (median(&mut r), list.join(", "))
        };
        let (peak, peaks) = ratios(&results[ia].peaks, &results[ib].peaks);
        let (time, times) = ratios(&results[ia].times, &results[ib].times);
        println!(
            "{a} / {b}: peak x{peak:.2} (rounds: {peaks}), step time x{time:.2} (rounds: {times})"
        );
    }
    Ok(())
}
