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
//!     cargo build --release -p accelerate-rs-models --example memory_bench
//!     target/release/examples/memory_bench --rounds 3

use std::process::Command;
use std::time::Instant;

use accelerate_rs::memory::{estimate, Lora, ModelSpec, Plan};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::AdamW;
use accelerate_rs::Accelerator;
use accelerate_rs_models::{LlamaConfig, LlamaForCausalLm};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use clap::Parser;
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
    #[arg(long, default_value_t = 8000)]
    vocab: usize,
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    #[arg(long, default_value_t = 1408)]
    intermediate: usize,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 512)]
    seq: usize,
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// LoRA's rank (alpha = 2 r), on q, k, v, o, gate, up and down projections.
    #[arg(long, default_value_t = 8)]
    lora_r: usize,
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

/// The model's `config.json`.
fn model_json(args: &Args) -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": args.seq,
        "tie_word_embeddings": false,
    })
}

/// What `accelerate-rs estimate-memory` predicts for `config`, in bytes.
fn predicted(args: &Args, config: &str) -> Result<u64> {
    let path = std::path::Path::new("<memory_bench>");
    let spec = ModelSpec::from_config(&model_json(args), path)?;
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

/// One configuration in this process: prints
/// `RESULT peak_bytes step_ms trainable_params forward_ms start_bytes`.
fn child(args: &Args, config: &str) -> Result<()> {
    // What the process holds before the model exists (the program, its libraries).
    let start = status_bytes("VmRSS:")?;
    let (lora, ckpt) = match config {
        "plain" => (false, false),
        "ckpt" => (false, true),
        "lora" => (true, false),
        "lora-ckpt" => (true, true),
        other => bail!("unknown configuration `{other}` (one of {CONFIGS:?})"),
    };
    let accelerator = Accelerator::builder().rank(0).world_size(1).build()?;
    let device = accelerator.device().clone();
    let json = model_json(args);
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
    let mut batch = || -> Result<Tensor> {
        let ids: Vec<u32> = (0..args.batch * args.seq)
            .map(|_| rng.random_range(0..args.vocab as u32))
            .collect();
        Ok(Tensor::from_vec(ids, (args.batch, args.seq), &device)?)
    };
    let (mut times, mut forward) = (Vec::new(), Vec::new());
    for step in 0..args.warmup + args.steps {
        let ids = batch()?;
        let labels = ids.to_dtype(DType::I64)?;
        let start = Instant::now();
        let loss = model.loss(&ids, &labels)?;
        let fwd = start.elapsed().as_secs_f64() * 1e3;
        opt.backward_step(&loss)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if step >= args.warmup {
            times.push(ms);
            forward.push(fwd);
        }
    }
    println!(
        "RESULT {} {:.1} {n_trainable} {:.1} {start}",
        peak_rss()?,
        median(&mut times),
        median(&mut forward)
    );
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
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab, args.batch, args.seq, args.rounds, args.steps
    );
    println!();
    println!("| configuration | trainable parameters | peak RSS (MiB), median (min–max) | above the start (MiB) | estimate-memory (MiB) | estimate / above the start | step time (ms), median (min–max) |");
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
        let mut peak: Vec<f64> = results[ia]
            .peaks
            .iter()
            .zip(&results[ib].peaks)
            .map(|(x, y)| x / y)
            .collect();
        let mut time: Vec<f64> = results[ia]
            .times
            .iter()
            .zip(&results[ib].times)
            .map(|(x, y)| x / y)
            .collect();
        println!(
            "{a} / {b}: peak x{:.2} (rounds: {}), step time x{:.2} (rounds: {})",
            median(&mut peak.clone()),
            peak.iter_mut()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
            median(&mut time.clone()),
            time.iter_mut()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    Ok(())
}
