//! Peak resident memory of a LoRA training step over a 4-bit (NF4) base against the same step
//! over a bf16 base, on the CPU, with `accelerate-rs estimate-memory`'s figures beside them.
//!
//! The parent writes a Llama-style model (default hidden 1024, 8 layers, 16 heads, SwiGLU 2816,
//! vocab 8000; seeded weights) as a bf16 Hugging Face folder, then runs one child process per
//! base (this program with `--child bf16|4bit`): the child loads the folder (bf16:
//! `from_pretrained`; 4bit: `from_pretrained_4bit` with NF4 and double quantization, bf16
//! compute), adds LoRA adapters of rank 8 on every linear layer (f32), turns activation
//! checkpointing on, resets the kernel's high-water mark (`/proc/self/clear_refs`, so that
//! loading does not count) and trains `--steps` AdamW steps on random tokens; it reports the
//! peak resident set of the steps (`VmHWM`) and what was resident before them. The estimate is
//! `memory::estimate` / `memory::estimate_4bit` for the same model, bf16 compute, LoRA on
//! every linear layer, checkpointing.
//!
//!     cargo build --release -p accelerate-rs-models --example qlora_memory
//!     target/release/examples/qlora_memory

use std::process::Command;

use accelerate_rs::memory::{estimate, estimate_4bit, Lora, Plan};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::MixedPrecision;
use accelerate_rs_models::{AutoModel, LlamaConfig, LlamaForCausalLm};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Width of the residual stream.
    #[arg(long, default_value_t = 1024)]
    hidden: usize,
    /// Blocks.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Tokens per sequence (batch 1).
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Training steps measured.
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// The model folder (written by the parent).
    #[arg(long, hide = true)]
    folder: Option<std::path::PathBuf>,
    /// Run one measurement (bf16 or 4bit) and print it.
    #[arg(long, hide = true)]
    child: Option<String>,
}

const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// A `VmXXX:` line of `/proc/self/status`, in bytes.
fn status_bytes(key: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .with_context(|| format!("no {key} in /proc/self/status"))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("malformed status line")?
        .parse()?;
    Ok(kb * 1024)
}

fn config(args: &Args) -> Result<LlamaConfig> {
    let json = serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 / 4,
        "num_hidden_layers": args.layers, "num_attention_heads": args.hidden / 64,
        "num_key_value_heads": args.hidden / 64, "vocab_size": 8000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    });
    Ok(LlamaConfig::from_json(
        std::path::Path::new("<memory>"),
        &json,
    )?)
}

fn child(args: &Args, base: &str) -> Result<()> {
    let dir = args.folder.as_ref().context("--folder")?;
    let dev = Device::Cpu;
    let mut model = match base {
        "bf16" => AutoModel::from_pretrained(dir, &dev, DType::BF16)?,
        "4bit" => AutoModel::from_pretrained_4bit(dir, &dev, DType::BF16, &Quant4bitConfig::nf4())?,
        other => bail!("--child {other}: bf16 or 4bit"),
    };
    model.add_lora(&LoraConfig::new(8, 16.0).target_modules(TARGETS))?;
    model.set_gradient_checkpointing(true);
    model.train(true);
    let params = ParamsAdamW {
        lr: 1e-4,
        ..Default::default()
    };
    let mut opt = AdamW::new(model.trainable_parameters().all_vars(), params)?;
    let ids = Tensor::rand(0f32, 7999.0, (1, args.seq_len), &dev)?.to_dtype(DType::U32)?;
    let labels = ids.to_dtype(DType::I64)?;
    let before = status_bytes("VmRSS:")?;
    // Reset the peak resident set to the current one: loading does not count.
    std::fs::write("/proc/self/clear_refs", "5")?;
    for _ in 0..args.steps {
        let loss = model.loss(&ids, &labels)?;
        opt.step(&accelerate_rs::nn::backward(&loss)?)?;
    }
    println!("{base} {before} {}", status_bytes("VmHWM:")?);
    Ok(())
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(base) = &args.child {
        return child(&args, base);
    }
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("model");
    LlamaForCausalLm::from_config_seeded(&config(&args)?, 0, &Device::Cpu, DType::BF16)?
        .save_pretrained(&dir)?;
    let spec = accelerate_rs_models::model_spec(&dir)?;
    let plan = Plan {
        precision: MixedPrecision::Bf16,
        lora: Some(Lora {
            r: 8,
            targets: TARGETS.iter().map(|s| s.to_string()).collect(),
        }),
        seq_len: args.seq_len,
        checkpointing: true,
        ..Plan::default()
    };
    println!("| base | resident before the steps | peak of the steps | peak above start | estimate-memory: parameters | estimate-memory: total (ckpt) |");
    println!("|---|---|---|---|---|---|");
    for base in ["bf16", "4bit"] {
        let out = Command::new(std::env::current_exe()?)
            .args(["--child", base, "--folder"])
            .arg(&dir)
            .args(["--seq-len", &args.seq_len.to_string()])
            .args(["--steps", &args.steps.to_string()])
            .output()?;
        if !out.status.success() {
            bail!("{base}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let nums: Vec<u64> = text
            .split_whitespace()
            .skip(1)
            .filter_map(|s| s.parse().ok())
            .collect();
        let [before, peak] = nums[..] else {
            bail!("{base}: unexpected output {text}");
        };
        let est = match base {
            "4bit" => estimate_4bit(&spec, &plan, 64, true)?,
            _ => estimate(&spec, &plan)?,
        };
        println!(
            "| {base} | {} | {} | {} | {} | {} |",
            gib(before),
            gib(peak),
            gib(peak.saturating_sub(before)),
            gib(est.parameters),
            gib(est.total())
        );
    }
    Ok(())
}
