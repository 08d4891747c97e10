//! Fine-tunes a Hugging Face model folder on a plain-text file or on conversations,
//! data-parallel with accelerate-rs, and saves a folder `transformers` loads.
//!
//! Conversations: `--train FILE.jsonl` whose rows hold `messages` (`{"role", "content"}`
//! lists) or `prompt`/`completion` (detected from the first row; anything else is plain text)
//! are rendered with the folder's chat template (`chat_template.jinja` or `tokenizer_config.json`)
//! and labelled on the assistant's tokens (`--train-on-everything`: on every token); examples
//! longer than `--seq-len` are truncated (counted and printed). Each example is a row, padded,
//! or with `--pack` examples are packed into rows of `--seq-len` tokens without padding
//! (position ids restarting per example, block-diagonal attention). The held-out loss is the
//! assistant-token loss of `--eval FILE.jsonl` (else of the last `--eval-fraction` of the
//! conversations). The training loss is token-weighted: the mean over every target token of
//! the step, all micro-batches (`--gradient-accumulation N`) and all processes. With `--eval`,
//! the first `--eval-samples` held-out conversations (default 2) are also answered greedily (at
//! most `--eval-max-new-tokens` tokens) before and after training and every `--eval-every`
//! steps: generation is split across the processes and gathered once per prompt; the main
//! process prints the answers and, with `--log-dir`, appends them to `samples.jsonl` beside
//! `metrics.jsonl` (which gets `eval_loss` and `eval_sample_match`, the share of answers equal
//! to their reference). At ZeRO stage 3 (sharded parameters do not generate) a note says they
//! are skipped.
//!
//!     cargo run --release -- launch --cpu -n 2 target/release/examples/finetune \
//!         --model models/examples/tiny-llama --train data/chat_tiny.jsonl \
//!         --eval data/chat_tiny_eval.jsonl --pack --seq-len 128 --batch-size 4 \
//!         --gradient-accumulation 2 --warmup-steps 10 --lr-schedule cosine --max-steps 60 \
//!         --output runs/tiny-chat
//!
//! Any folder of a supported architecture that `save_pretrained` wrote, with its
//! `tokenizer.json`: the decoders (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3, Mixtral and the
//! Qwen MoEs, GPT-2) learn the next token; BERT (masked-LM) learns masked tokens (15% of the
//! tokens replaced by the tokenizer's mask token). `--init-seed N` trains from scratch instead:
//! fresh weights drawn from the seed (the folder needs only `config.json` and the tokenizer). For
//! a mixture of experts the tokens each expert takes on the held-out text are printed before and
//! after training. The text is
//! tokenized once, cut into windows of `--seq-len` tokens, the last `--eval-fraction` of it held
//! out; the held-out loss is printed before and after training.
//!
//!     cargo build --release -p accelerate-rs-models --example finetune
//!     target/release/examples/finetune --model models/examples/tiny-llama \
//!         --train data/corpus.txt --max-steps 100 --output runs/tiny-llama-ft
//!     cargo run --release -- launch --cpu -n 2 target/release/examples/finetune \
//!         --model models/examples/tiny-llama --train data/corpus.txt --output runs/ft2
//!
//! `--lora-r R` trains LoRA adapters of rank R only (the base frozen; PEFT's default targets
//! for the architecture unless `--lora-targets` names them); `--output` then holds a PEFT
//! adapter folder (`PeftModel.from_pretrained(base, OUTPUT)` loads it), and `--merge DIR` also
//! writes the adapters merged into a plain Hugging Face folder. `--checkpoint-activations`
//! recomputes each block's activations in the backward pass instead of keeping them.
//! `--dtype bf16` keeps the model in bf16 (LoRA adapters still train in f32).
//! `--load-in-4bit` (with `--lora-r` or `--adapter`: QLoRA) holds the frozen base's linear
//! layers in 4 bits (NF4 with double quantization, bitsandbytes' format: quantized on load from
//! a float folder, or read from a `transformers` 4-bit folder), the rest of the model in the
//! compute dtype; `--merge` then writes the adapters merged into the dequantized base.
//!
//! Mixed precision (`accelerate-rs launch --mixed-precision bf16|fp16`, or
//! `ACCELERATE_RS_MIXED_PRECISION`): full fine-tuning keeps f32 masters (stepped, evaluated and
//! saved) and runs forward and backward on working copies in the compute dtype (fp16 with
//! dynamic loss scaling), through `Accelerator::prepare_mixed` and `AutoModel::with_parameters`;
//! with `--lora-r` the base is loaded in the compute dtype and the adapters train in f32.
//!
//!     cargo run --release -- launch --cpu -n 2 --mixed-precision bf16 \
//!         target/release/examples/finetune --model models/examples/tiny-llama \
//!         --train data/corpus.txt --output runs/ft-bf16
//!
//!     target/release/examples/finetune --model models/examples/tiny-llama \
//!         --train data/corpus.txt --lora-r 8 --checkpoint-activations \
//!         --output runs/tiny-llama-adapter --merge runs/tiny-llama-merged
//!
//! `--batch-size` is per process; under `ACCELERATE_RS_SPLIT_BATCHES=1` (or the launcher's
//! `--split-batches`) it is the global batch, split across the processes, so one process and N
//! processes follow the same trajectory. `--probe FILE` writes a few held-out windows and the
//! logits of the trained model, for `python scripts/hf_reference.py check OUTPUT --probe FILE`
//! (with LoRA: `check-adapter OUTPUT --base MODEL --probe FILE`, or `check MERGED --probe FILE`).

mod chat;
mod data;
mod outputs;
mod samples;
mod train;

use std::path::PathBuf;

use accelerate_rs::nn::LoraConfig;
use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::{Accelerator, MixedPrecision};
use accelerate_rs_models::{AutoModel, Config, Inputs, Mixtral};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use clap::Parser;

use data::Data;
use train::Run;

#[derive(Parser, Debug)]
#[command(about = "Fine-tune a Hugging Face model folder on a text file with accelerate-rs")]
pub(crate) struct Args {
    /// A Hugging Face model folder (config.json, model.safetensors or a sharded index,
    /// tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The training text (plain UTF-8), or conversations (JSONL rows with `messages`, or with
    /// `prompt` and `completion`).
    #[arg(long)]
    train: PathBuf,
    /// Held-out conversations (JSONL): the assistant-token loss before and after training.
    #[arg(long)]
    eval: Option<PathBuf>,
    /// Conversations: pack examples into rows of `--seq-len` tokens (no padding but at the end;
    /// each example attends to itself only) instead of one padded example per row.
    #[arg(long)]
    pack: bool,
    /// Conversations: labels on every token, not only the assistant's.
    #[arg(long)]
    train_on_everything: bool,
    /// Micro-batches per optimizer step (instead of `ACCELERATE_RS_GRADIENT_ACCUMULATION_STEPS`).
    #[arg(long, value_parser = at_least_one)]
    gradient_accumulation: Option<usize>,
    /// Optimizer steps of linear warmup from 0 to `--lr`.
    #[arg(long, default_value_t = 0)]
    warmup_steps: u64,
    /// After the warmup: `constant` (`--lr`) or `cosine` (decay to `--min-lr` at `--max-steps`).
    #[arg(long, default_value = "constant")]
    lr_schedule: String,
    /// The learning rate `cosine` ends at.
    #[arg(long, default_value_t = 0.0)]
    min_lr: f64,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    max_steps: u64,
    /// Tokens per window.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    seq_len: usize,
    /// Windows per batch, per process (the global batch with split batches).
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    batch_size: usize,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Where the fine-tuned folder goes (config.json, weights, tokenizer files); with
    /// `--lora-r`, the PEFT adapter folder (adapter_config.json, adapter_model.safetensors).
    #[arg(long)]
    output: PathBuf,
    /// Train LoRA adapters of this rank only (the base frozen) instead of every parameter.
    #[arg(long)]
    lora_r: Option<usize>,
    /// Continue training the PEFT adapter folder DIR (its `adapter_config.json` sets the rank,
    /// alpha and targets; every field and tensor is checked) instead of new adapters.
    #[arg(long, conflicts_with_all = ["lora_r", "lora_alpha", "lora_targets", "rslora"])]
    adapter: Option<PathBuf>,
    /// Write into `--output` (and `--merge`, `--probe`) even when they already hold files:
    /// without it, a run refuses a non-empty output folder rather than replace a user's files.
    #[arg(long)]
    overwrite: bool,
    /// LoRA's alpha (the update is scaled by alpha / r); default 2 r.
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Dropout on the LoRA adapters' input.
    #[arg(long, default_value_t = 0.0)]
    lora_dropout: f64,
    /// The layers that get adapters, comma-separated module names (`q_proj,v_proj`) or
    /// `all-linear`; default: PEFT's default for the architecture.
    #[arg(long)]
    lora_targets: Option<String>,
    /// rsLoRA scaling (alpha / sqrt(r)).
    #[arg(long)]
    rslora: bool,
    /// With `--lora-r`: also write the adapters merged into the weights, as a plain Hugging
    /// Face folder (with the tokenizer files), here.
    #[arg(long)]
    merge: Option<PathBuf>,
    /// Activation checkpointing: recompute every block's activations in the backward pass.
    #[arg(long)]
    checkpoint_activations: bool,
    /// The model's dtype: f32, bf16 or f16 (LoRA adapters train in f32 either way).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// The share of the text held out for evaluation (its end).
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    /// Conversations with `--eval`: the first N held-out conversations are answered greedily
    /// (each process generates its share) and the answers printed and logged
    /// (`samples.jsonl` in `--log-dir`) at the start and the end of training, and every
    /// `--eval-every` steps; 0: none.
    #[arg(long, default_value_t = 2)]
    eval_samples: usize,
    /// The tokens each sample may generate at most.
    #[arg(long, default_value_t = 32)]
    eval_max_new_tokens: usize,
    /// Also evaluate (the held-out loss, and the samples) every K optimizer steps during
    /// training; 0: only at the start and the end.
    #[arg(long, default_value_t = 0)]
    eval_every: u64,
    /// At most this many held-out windows are evaluated (0: all).
    #[arg(long, default_value_t = 256)]
    eval_windows: usize,
    /// The share of tokens masked for a masked LM.
    #[arg(long, default_value_t = 0.15)]
    mlm_probability: f64,
    /// Print the training loss every N steps.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    log_every: u64,
    /// Seed of the data order, the masks, the dropout and the LoRA adapters' initial values.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// QLoRA: hold the frozen base's linear layers in 4 bits (NF4, double quantization) and
    /// train LoRA adapters over it (needs `--lora-r` or `--adapter`).
    #[arg(long, conflicts_with = "init_seed")]
    load_in_4bit: bool,
    /// Also write held-out inputs and the trained model's logits to this file.
    #[arg(long)]
    probe: Option<PathBuf>,
    /// Train from scratch: fresh weights drawn from this seed (each from `(seed, parameter
    /// name)`: the same on every process) instead of the folder's; the folder then needs only
    /// its `config.json` and tokenizer.
    #[arg(long, conflicts_with = "adapter")]
    init_seed: Option<u64>,
    /// Where the main process writes `metrics.jsonl` and TensorBoard event files: the run's
    /// settings and hyperparameters once, then every step's loss, time by phase, tokens/s and
    /// FLOP/s. None: printed only.
    #[arg(long)]
    log_dir: Option<PathBuf>,
}

/// A count that must be at least 1 (clap's parser for `--seq-len` and `--batch-size`).
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let accelerator = match args.gradient_accumulation {
        Some(n) => Accelerator::builder()
            .gradient_accumulation_steps(n)
            .build()?,
        None => Accelerator::new()?,
    };
    accelerator.set_seed(args.seed)?;
    let dtype = compute_dtype(&args, &accelerator)?;
    outputs::check_outputs(&args)?;
    let mut model = load_model(&args, &accelerator, dtype)?;
    let data = Data::load(&accelerator, &args, &model)?;
    describe(&accelerator, &args, &model, &data)?;

    let mut run = Run::prepare(&accelerator, &args, &mut model, &data)?;
    model.train(false);
    let before = run.evaluate(&accelerator, &args, &model, &data, 0)?;
    accelerator.print(format!("held-out loss before: {before:.4}"));
    print_expert_load(&accelerator, &model, &data.val, "before")?;
    model.train(true);
    let (steps, secs) = run.train(&accelerator, &args, &mut model, &data)?;
    model.train(false);
    let after = run.evaluate(&accelerator, &args, &model, &data, steps)?;
    accelerator.print(format!(
        "trained {steps} steps in {secs:.1} s; held-out loss {before:.4} -> {after:.4}"
    ));
    print_expert_load(&accelerator, &model, &data.val, "after")?;
    if accelerator.world_size() > 1 && steps > 0 {
        // With LoRA only the adapters' gradients travel (the frozen base has none).
        accelerator.print(format!(
            "gradient all-reduce: {} bytes per step from this rank",
            accelerator.gradient_bytes_reduced() / steps
        ));
    }
    outputs::save(&accelerator, &args, &mut model, &data)
}

/// The model's dtype from `--dtype` and the accelerator's mixed precision, checked with the
/// rest of the flags that decide it.
fn compute_dtype(args: &Args, accelerator: &Accelerator) -> Result<DType> {
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    let lora = args.lora_r.is_some() || args.adapter.is_some();
    if args.merge.is_some() && !lora {
        bail!("--merge writes merged LoRA adapters: it needs --lora-r or --adapter");
    }
    if args.load_in_4bit && !lora {
        bail!(
            "--load-in-4bit: a 4-bit base is frozen (no gradient reaches its weights); train \
             LoRA adapters over it with --lora-r R (or --adapter DIR)"
        );
    }
    if args.load_in_4bit && accelerator.state().zero_stage() == 3 {
        bail!(
            "--load-in-4bit at ZeRO stage 3: a 4-bit base is not sharded; launch without \
             --zero-stage 3 (every process holds the 4-bit base, only the adapters are \
             all-reduced)"
        );
    }
    if args.merge.is_some() && accelerator.state().zero_stage() == 3 {
        bail!(
            "--merge at ZeRO stage 3: the base is sharded over the processes; save the adapters \
             (--output) and merge them on one process (--adapter OUTPUT --merge DIR without \
             --zero-stage 3)"
        );
    }
    let mixed = accelerator.state().mixed_precision();
    if mixed != MixedPrecision::No {
        if dtype != DType::F32 {
            bail!(
                "--dtype {} and mixed precision {mixed} both set the compute dtype: keep one",
                args.dtype
            );
        }
        // With LoRA the frozen base is in the compute dtype, the adapters in f32; without, the
        // model keeps f32 masters.
        return Ok(if lora { mixed.compute_dtype() } else { dtype });
    }
    if dtype == DType::F16 && !lora {
        bail!(
            "--dtype f16 would train the weights themselves in f16, where AdamW's updates \
             underflow and the loss diverges: use mixed precision fp16 (`launch \
             --mixed-precision fp16`: f32 masters, f16 compute, loss scaling), bf16, or \
             --lora-r with an f16 base"
        );
    }
    Ok(dtype)
}

/// The model of `--model` in `dtype`, with new LoRA adapters (`--lora-r`) or the PEFT adapter
/// of `--adapter`, and activation checkpointing as asked.
/// At ZeRO stage 3 (`launch --zero-stage 3`) the parameters are sharded over the processes
/// from the start: each reads only its slices of the folder (or draws them from the seed).
fn load_model(args: &Args, accelerator: &Accelerator, dtype: DType) -> Result<AutoModel> {
    let device = accelerator.device();
    let sharded = accelerator.state().zero_stage() == 3;
    let mut model = match (args.init_seed, sharded) {
        (Some(seed), false) => {
            let config = Config::from_file(&args.model)?;
            AutoModel::from_config_seeded(&config, seed, device, dtype)?
        }
        (Some(seed), true) => {
            let config = Config::from_file(&args.model)?;
            AutoModel::from_config_sharded(&config, accelerator, dtype, seed)?
        }
        (None, false) if args.load_in_4bit => {
            AutoModel::from_pretrained_4bit(&args.model, device, dtype, &Quant4bitConfig::nf4())?
        }
        (None, false) => AutoModel::from_pretrained(&args.model, device, dtype)?,
        (None, true) => AutoModel::from_pretrained_sharded(&args.model, accelerator, dtype)?,
    };
    if let Some(r) = args.lora_r {
        let mut config = LoraConfig::new(r, args.lora_alpha.unwrap_or(2.0 * r as f64))
            .dropout(args.lora_dropout)
            .rslora(args.rslora)
            .seed(args.seed);
        match args.lora_targets.as_deref() {
            None => {}
            Some("all-linear") => config = config.all_linear(),
            Some(list) => config = config.target_modules(list.split(',').map(str::trim)),
        }
        model.add_lora(&config)?;
    }
    if let Some(dir) = &args.adapter {
        model.load_adapter(dir)?;
    }
    model.set_gradient_checkpointing(args.checkpoint_activations);
    Ok(model)
}

/// One line on the main process: the model, what trains, the processes and the data.
fn describe(accelerator: &Accelerator, args: &Args, model: &AutoModel, data: &Data) -> Result<()> {
    let count =
        |m: &candle_nn::VarMap| -> usize { m.all_vars().iter().map(|v| v.elem_count()).sum() };
    let parameters = match model.sharded_parameters() {
        Some(s) => format!(
            "{} parameters, sharded over the processes (ZeRO-3)",
            s.parameter_specs()
                .iter()
                .map(|p| p.shape.iter().product::<usize>())
                .sum::<usize>()
        ),
        None => format!("{} parameters", count(model.varmap())),
    };
    let parameters = match model.base_4bit_size() {
        Some((bytes, n)) => format!(
            "{parameters} + {n} in a 4-bit base of {:.1} MiB",
            bytes as f64 / (1 << 20) as f64
        ),
        None => parameters,
    };
    let trained = match model.lora_config() {
        Some(c) => format!(
            "LoRA r={} alpha={} on {:?}: {} trainable",
            c.r,
            c.alpha,
            c.target_modules,
            count(model.trainable_parameters())
        ),
        None => "all trainable".to_string(),
    };
    accelerator.print(format!(
        "{}: {} ({parameters}, {trained}{}), {} processes; {} tokens: {} training windows, \
         {} held out, {} tokens each",
        args.model.display(),
        model.model_type(),
        if args.checkpoint_activations {
            ", activation checkpointing"
        } else {
            ""
        },
        accelerator.world_size(),
        data.tokens,
        data.train.0.dim(0)?,
        data.val.0.dim(0)?,
        args.seq_len
    ));
    Ok(())
}

/// For a mixture of experts, the tokens each expert of each sparse layer takes on the held-out
/// windows (printed by the main process): the balance the load-balancing loss keeps.
fn print_expert_load(
    accelerator: &Accelerator,
    model: &AutoModel,
    val: &(Tensor, Tensor),
    when: &str,
) -> Result<()> {
    let Some(moe) = model.downcast_ref::<Mixtral>() else {
        return Ok(());
    };
    if model.sharded_parameters().is_some() {
        // The routers' statistics read the layers whole; at ZeRO stage 3 they are sharded.
        return Ok(());
    }
    let ids = val.0.to_device(accelerator.device())?;
    for (layer, load) in moe
        .layers()
        .expert_load(&Inputs::new(&ids))?
        .iter()
        .enumerate()
    {
        let total: usize = load.iter().sum();
        let fair = (total as f64 / load.len().max(1) as f64).max(1.0);
        let share = |n: Option<&usize>| n.copied().unwrap_or(0) as f64 / fair;
        accelerator.print(format!(
            "expert load {when} (held-out, sparse layer {layer}): {load:?} tokens; the busiest \
             expert takes {:.2}x its fair share, the idlest {:.2}x",
            share(load.iter().max()),
            share(load.iter().min())
        ));
    }
    Ok(())
}
