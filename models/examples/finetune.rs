//! Fine-tunes a Hugging Face model folder on a plain-text file, data-parallel with
//! accelerate-rs, and saves a folder `transformers` loads.
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

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::tracking::{self, HParams};
use accelerate_rs::{
    AcceleratedOptimizer, Accelerator, DataLoader, MixedPrecision, MixedPrecisionOptimizer,
    ReduceOp, TensorDataset,
};
use accelerate_rs_models::{
    encode_corpus, load_tokenizer, AutoModel, Config, Inputs, Mixtral, Task, IGNORE_INDEX,
};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use clap::Parser;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Parser, Debug)]
#[command(about = "Fine-tune a Hugging Face model folder on a text file with accelerate-rs")]
struct Args {
    /// A Hugging Face model folder (config.json, model.safetensors or a sharded index,
    /// tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The training text (plain UTF-8).
    #[arg(long)]
    train: PathBuf,
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

/// The model's inputs and labels for windows `ids` `[B, T]` whose dataset indices are `index`:
/// the windows themselves for a causal LM (shifted in `loss`); for a masked LM, each token
/// replaced by `mask_id` with probability `p` (the same positions for a window on any number
/// of processes: drawn from the seed and the window's index), labels -100 elsewhere.
fn inputs_and_labels(
    task: Task,
    ids: &Tensor,
    index: &Tensor,
    mask_id: Option<u32>,
    p: f64,
    seed: u64,
) -> Result<(Tensor, Tensor)> {
    if task != Task::MaskedLm {
        return Ok((ids.clone(), ids.to_dtype(DType::I64)?));
    }
    let mask_id = mask_id.context("a masked LM needs a mask token")?;
    let rows = ids.to_vec2::<u32>()?;
    let index = index.to_vec1::<u32>()?;
    let (mut input, mut labels) = (Vec::new(), Vec::new());
    for (row, &i) in rows.iter().zip(&index) {
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u64));
        for &tok in row {
            if rng.random::<f64>() < p {
                input.push(mask_id);
                labels.push(tok as i64);
            } else {
                input.push(tok);
                labels.push(IGNORE_INDEX);
            }
        }
    }
    let shape = ids.dims2()?;
    Ok((
        Tensor::from_vec(input, shape, ids.device())?,
        Tensor::from_vec(labels, shape, ids.device())?,
    ))
}

/// A count that must be at least 1 (clap's parser for `--seq-len` and `--batch-size`).
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Non-overlapping windows of `t` tokens: `[N, t]` and their indices `[N]`.
fn windows(tokens: &[u32], t: usize, limit: usize) -> Result<(Tensor, Tensor)> {
    let mut n = tokens.len() / t;
    if limit > 0 {
        n = n.min(limit);
    }
    if n == 0 {
        bail!(
            "{} tokens make no window of {t}: use a longer text or a shorter --seq-len",
            tokens.len()
        );
    }
    let ids = Tensor::from_slice(&tokens[..n * t], (n, t), &Device::Cpu)?;
    let index = Tensor::arange(0u32, n as u32, &Device::Cpu)?;
    Ok((ids, index))
}

/// The mean held-out loss over every held-out window (each process takes every
/// `world_size`-th window; the sums are reduced), weighted by the tokens predicted.
fn evaluate(
    accelerator: &Accelerator,
    model: &AutoModel,
    task: Task,
    val: &(Tensor, Tensor),
    args: &Args,
    mask_id: Option<u32>,
) -> Result<f64> {
    let device = accelerator.device();
    let n = val.0.dim(0)?;
    let mine: Vec<u32> = (accelerator.rank()..n)
        .step_by(accelerator.world_size())
        .map(|i| i as u32)
        .collect();
    let (mut sum, mut count) = (0f64, 0f64);
    for chunk in mine.chunks(args.batch_size.max(1)) {
        let idx = Tensor::new(chunk, &Device::Cpu)?;
        let ids = val.0.index_select(&idx, 0)?;
        let index = val.1.index_select(&idx, 0)?;
        // Held-out masks from their own seed.
        let (x, y) = inputs_and_labels(
            task,
            &ids,
            &index,
            mask_id,
            args.mlm_probability,
            args.seed ^ 0xEEEE,
        )?;
        let predicted = match task {
            Task::CausalLm => (ids.dim(0)? * (ids.dim(1)? - 1)) as f64,
            _ => y
                .ge(0i64)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()? as f64,
        };
        if predicted == 0.0 {
            continue;
        }
        let loss = model.loss(&x.to_device(device)?, &y.to_device(device)?)?;
        sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * predicted;
        count += predicted;
    }
    let totals = accelerator.reduce(&Tensor::new(&[sum, count], device)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    if totals[1] == 0.0 {
        bail!("no held-out token to evaluate: raise --eval-fraction");
    }
    Ok(totals[0] / totals[1])
}

fn main() -> Result<()> {
    let args = Args::parse();
    let accelerator = Accelerator::new()?;
    accelerator.set_seed(args.seed)?;
    let device = accelerator.device().clone();

    let mut dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    let lora = args.lora_r.is_some() || args.adapter.is_some();
    if args.merge.is_some() && !lora {
        bail!("--merge writes merged LoRA adapters: it needs --lora-r or --adapter");
    }
    check_outputs(&args)?;
    let mixed = accelerator.state().mixed_precision();
    if mixed != MixedPrecision::No {
        if dtype != DType::F32 {
            bail!(
                "--dtype {} and mixed precision {mixed} both set the compute dtype: keep one",
                args.dtype
            );
        }
        if lora {
            // The frozen base in the compute dtype, the adapters in f32.
            dtype = mixed.compute_dtype();
        }
    } else if dtype == DType::F16 && !lora {
        bail!(
            "--dtype f16 would train the weights themselves in f16, where AdamW's updates \
             underflow and the loss diverges: use mixed precision fp16 (`launch \
             --mixed-precision fp16`: f32 masters, f16 compute, loss scaling), bf16, or \
             --lora-r with an f16 base"
        );
    }
    let mut model = load_model(&args, &device, dtype)?;
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
    let task = model.task();
    if task == Task::SequenceClassification {
        bail!(
            "{}: a sequence classifier needs labelled examples; this example trains language \
             models (causal or masked) on plain text",
            args.model.display()
        );
    }
    let tokenizer = load_tokenizer(&args.model)?;
    let mask_id = ["<mask>", "[MASK]"]
        .iter()
        .find_map(|t| tokenizer.token_to_id(t));
    if task == Task::MaskedLm && mask_id.is_none() {
        bail!(
            "{}: the tokenizer has no <mask> or [MASK] token",
            args.model.display()
        );
    }
    let text = accelerate_rs::files::read_to_string_bounded(
        &args.train,
        accelerate_rs::files::MAX_TEXT_BYTES,
    )?;
    let tokens = encode_corpus(&tokenizer, &text)?;
    let vocab = model.config_json()["vocab_size"].as_u64().unwrap_or(0) as usize;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        bail!("the tokenizer gives id {bad}, outside the model's vocabulary of {vocab}");
    }
    if !(0.0..1.0).contains(&args.eval_fraction) {
        bail!(
            "--eval-fraction must be in [0, 1), got {}",
            args.eval_fraction
        );
    }
    let split = tokens.len() - (tokens.len() as f64 * args.eval_fraction) as usize;
    let train = windows(&tokens[..split], args.seq_len, 0)?;
    let val = windows(&tokens[split..], args.seq_len, args.eval_windows)?;
    let count =
        |m: &candle_nn::VarMap| -> usize { m.all_vars().iter().map(|v| v.elem_count()).sum() };
    let n_params = count(model.varmap());
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
        "{}: {} ({} parameters, {trained}{}), {} processes; {} tokens: {} training windows, \
         {} held out, {} tokens each",
        args.model.display(),
        model.model_type(),
        n_params,
        if args.checkpoint_activations {
            ", activation checkpointing"
        } else {
            ""
        },
        accelerator.world_size(),
        tokens.len(),
        train.0.dim(0)?,
        val.0.dim(0)?,
        args.seq_len
    ));

    let before = evaluate(&accelerator, &model, task, &val, &args, mask_id)?;
    accelerator.print(format!("held-out loss before: {before:.4}"));
    print_expert_load(&accelerator, &model, &val, "before")?;

    // With LoRA, the adapters only: the frozen base is neither stepped nor all-reduced.
    let opt = AdamW::new(
        model.trainable_parameters().all_vars(),
        ParamsAdamW {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..Default::default()
        },
    )?;
    let loader = DataLoader::new(TensorDataset::new(vec![train.0, train.1])?, args.batch_size)
        .shuffle(true)
        .seed(args.seed)
        .drop_last(true);
    model.train(true);
    // Full fine-tuning in mixed precision: `model` keeps the f32 masters, `working` (its
    // parameters the working copies in the compute dtype) runs forward and backward.
    let full_mixed = mixed != MixedPrecision::No && model.lora_config().is_none();
    let (mut opt, mut loader, working) = if full_mixed {
        let (opt, loader, work) = accelerator.prepare_mixed(model.varmap(), opt, loader)?;
        (Opt::Mixed(opt), loader, Some(model.with_parameters(&work)?))
    } else {
        // The separate calls: LoRA under mixed precision is meant (f32 adapters over a base in
        // the compute dtype), and `prepare` would warn that it does not apply the mode.
        accelerator.prepare_model(model.trainable_parameters())?;
        let opt = Opt::Plain(accelerator.prepare_optimizer(opt));
        (opt, accelerator.prepare_data_loader(loader)?, None)
    };
    if mixed != MixedPrecision::No {
        accelerator.print(format!(
            "mixed precision {mixed}: {}",
            if full_mixed {
                "f32 masters, working copies in the compute dtype"
            } else {
                "the base in the compute dtype, the adapters in f32"
            }
        ));
    }
    let trained = working.as_ref().unwrap_or(&model);
    // Each step's time by phase and its throughput (model FLOPs: see `flops_per_token`).
    let tokens_per_step = (loader.local_batch_size() * args.seq_len) as u64;
    let mut timer = accelerator
        .step_timer()
        .tokens_per_step(tokens_per_step)
        .flops_per_step(model.flops_per_token(args.seq_len) * tokens_per_step as f64);
    let mut trackers = match &args.log_dir {
        Some(dir) => {
            let mut t = tracking::trackers(&accelerator)
                .jsonl(dir.join("metrics.jsonl"))?
                .tensorboard(dir.join("tensorboard"))?;
            t.log_hparams(
                &HParams::of_run(&accelerator)
                    .set("model", args.model.display().to_string())
                    .set("model_type", model.model_type().to_string())
                    .set("lr", args.lr)
                    .set("weight_decay", args.weight_decay)
                    .set("batch_size", args.batch_size)
                    .set("seq_len", args.seq_len)
                    .set("max_steps", args.max_steps)
                    .set("lora_r", args.lora_r.unwrap_or(0))
                    .set("checkpoint_activations", args.checkpoint_activations)
                    .set("dtype", args.dtype.clone())
                    .set("seed", args.seed),
            )?;
            Some(t)
        }
        None => None,
    };
    let start = Instant::now();
    let (mut step, mut epoch) = (0u64, 0u64);
    let (mut window_loss, mut window_n) = (0f64, 0usize);
    'train: loop {
        loader.set_epoch(epoch);
        let mut any = false;
        for batch in loader.iter()? {
            let batch = batch?;
            any = true;
            let (x, y) = inputs_and_labels(
                task,
                &batch[0].to_device(&Device::Cpu)?,
                &batch[1].to_device(&Device::Cpu)?,
                mask_id,
                args.mlm_probability,
                args.seed.wrapping_add(epoch),
            )?;
            timer.start();
            let loss = trained.loss(&x.to_device(&device)?, &y.to_device(&device)?)?;
            opt.backward_step(&loss)?;
            let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let times = timer.stop()?;
            window_loss += value;
            window_n += 1;
            step += 1;
            if let Some(t) = trackers.as_mut() {
                let mut metrics = times.metrics();
                metrics.push(("loss", value));
                t.log(&metrics, step)?;
            }
            if step % args.log_every == 0 || step == args.max_steps {
                let mean = accelerator.average(window_loss / window_n as f64)?;
                accelerator.print(format!(
                    "step {step:4}/{} epoch {epoch} training loss {mean:.4}; step {times}",
                    args.max_steps
                ));
                (window_loss, window_n) = (0.0, 0);
            }
            if step >= args.max_steps {
                break 'train;
            }
        }
        if !any {
            bail!("no training batch: fewer windows than --batch-size times the processes");
        }
        epoch += 1;
    }
    if let Opt::Mixed(o) = &opt {
        if o.skipped_steps() > 0 {
            accelerator.print(format!(
                "fp16: {} steps skipped for overflowing gradients (loss scale now {})",
                o.skipped_steps(),
                o.loss_scale()
            ));
        }
    }
    drop(working);
    model.train(false);
    let secs = start.elapsed().as_secs_f64();
    let after = evaluate(&accelerator, &model, task, &val, &args, mask_id)?;
    accelerator.print(format!(
        "trained {step} steps in {secs:.1} s; held-out loss {before:.4} -> {after:.4}"
    ));
    print_expert_load(&accelerator, &model, &val, "after")?;
    if accelerator.world_size() > 1 && step > 0 {
        // With LoRA only the adapters' gradients travel (the frozen base has none).
        accelerator.print(format!(
            "gradient all-reduce: {} bytes per step from this rank",
            accelerator.gradient_bytes_reduced() / step
        ));
    }

    if model.lora_config().is_none() {
        // Every rank calls it; the main process writes config.json and the weights.
        accelerator.save_model_with_config(
            &args.output,
            model.varmap(),
            &model.config_json(),
            accelerate_rs_models::DEFAULT_MAX_SHARD_BYTES,
        )?;
    }
    // The main process writes the rest; every rank learns whether it could.
    let saved = if accelerator.is_main_process() {
        save_main(&args, &mut model, task, &val, mask_id, &device)
    } else {
        Ok(())
    };
    let failed = f64::from(u8::from(saved.is_err()));
    let failed = accelerator.reduce(&Tensor::new(&[failed], &device)?, ReduceOp::Sum)?;
    saved?;
    if failed.to_vec1::<f64>()?[0] > 0.0 {
        bail!("the main process could not save {}", args.output.display());
    }
    accelerator.wait_for_everyone()?;
    Ok(())
}

/// The model: the folder's weights, or with `--init-seed` fresh ones drawn from the seed.
fn load_model(args: &Args, device: &Device, dtype: DType) -> Result<AutoModel> {
    Ok(match args.init_seed {
        Some(seed) => {
            let config = Config::from_file(&args.model)?;
            AutoModel::from_config_seeded(&config, seed, device, dtype)?
        }
        None => AutoModel::from_pretrained(&args.model, device, dtype)?,
    })
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

/// The prepared optimizer: plain, or stepping f32 masters from half-precision gradients.
enum Opt {
    Plain(AcceleratedOptimizer<AdamW>),
    Mixed(MixedPrecisionOptimizer<AdamW>),
}

impl Opt {
    fn backward_step(&mut self, loss: &Tensor) -> accelerate_rs::Result<()> {
        match self {
            Opt::Plain(o) => o.backward_step(loss),
            Opt::Mixed(o) => o.backward_step(loss).map(drop),
        }
    }
}

/// What the main process writes after training: the PEFT adapter folder (with LoRA; the
/// weights are written by every rank's `save_model_with_config` otherwise), the tokenizer files,
/// the probe, and the merged folder.
fn save_main(
    args: &Args,
    model: &mut AutoModel,
    task: Task,
    val: &(Tensor, Tensor),
    mask_id: Option<u32>,
    device: &Device,
) -> Result<()> {
    if model.lora_config().is_some() {
        model.save_adapter(&args.output)?;
    } else {
        copy_tokenizer(&args.model, &args.output)?;
    }
    if let Some(path) = &args.probe {
        let rows = val.0.dim(0)?.min(2);
        let ids = val.0.narrow(0, 0, rows)?;
        let index = val.1.narrow(0, 0, rows)?;
        let (x, _) =
            inputs_and_labels(task, &ids, &index, mask_id, args.mlm_probability, args.seed)?;
        let logits = model.forward(&x.to_device(device)?, None)?;
        let probe: HashMap<String, Tensor> = [
            ("input_ids".to_string(), x.to_dtype(DType::I64)?),
            ("logits".to_string(), logits.to_device(&Device::Cpu)?),
        ]
        .into_iter()
        .collect();
        candle_core::safetensors::save(&probe, path)?;
    }
    println!("saved {}", args.output.display());
    if let Some(dir) = &args.merge {
        model.merge_lora()?;
        model.save_pretrained(dir)?;
        copy_tokenizer(&args.model, dir)?;
        println!("saved the merged model {}", dir.display());
    }
    Ok(())
}

/// Copies the tokenizer files of the model folder `model` into `dir` (nothing to do when `dir`
/// is that folder: a file copied onto itself would be emptied).
fn copy_tokenizer(model: &std::path::Path, dir: &std::path::Path) -> Result<()> {
    if let (Ok(from), Ok(to)) = (model.canonicalize(), dir.canonicalize()) {
        if from == to {
            return Ok(());
        }
    }
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        let src = model.join(file);
        if src.is_file() {
            std::fs::copy(&src, dir.join(file))
                .with_context(|| format!("copying {}", src.display()))?;
        }
    }
    Ok(())
}

/// What the run will write, checked before anything is loaded or trained: `--output` and
/// `--merge` are folders that can be written, neither the model's folder, the adapter's nor each
/// other, and empty or new unless `--overwrite`; `--probe` is a file outside every folder the
/// run reads or writes, and not an existing file unless `--overwrite`. Every rank checks (the
/// checks only read, and create missing parent folders), so all stop together.
fn check_outputs(args: &Args) -> Result<()> {
    use accelerate_rs::checkpoint::check_output_dir;
    let mut inputs: Vec<&std::path::Path> = vec![&args.model];
    if let Some(a) = &args.adapter {
        inputs.push(a);
    }
    check_output_dir(&args.output, &inputs, args.overwrite)?;
    let same = |a: &std::path::Path, b: &std::path::Path| {
        let abs = |p: &std::path::Path| std::path::absolute(p).unwrap_or(p.to_path_buf());
        abs(a) == abs(b)
    };
    if let Some(merge) = &args.merge {
        if same(merge, &args.output) {
            bail!(
                "--merge {} is the --output folder: the adapter and the merged model need two \
                 folders",
                merge.display()
            );
        }
        check_output_dir(merge, &inputs, args.overwrite)?;
    }
    if let Some(probe) = &args.probe {
        let abs = std::path::absolute(probe).unwrap_or(probe.clone());
        let mut folders: Vec<&std::path::Path> = inputs.clone();
        folders.push(&args.output);
        if let Some(m) = &args.merge {
            folders.push(m);
        }
        for folder in folders {
            let f = std::path::absolute(folder).unwrap_or(folder.to_path_buf());
            if abs.starts_with(&f) {
                bail!(
                    "--probe {} is inside {}, a folder this run reads or writes: put the probe \
                     elsewhere",
                    probe.display(),
                    folder.display()
                );
            }
        }
        if same(probe, &args.train) {
            bail!("--probe {} is the training text", probe.display());
        }
        match std::fs::symlink_metadata(probe) {
            Ok(m) if m.is_dir() => {
                bail!("--probe {} is a folder: it names a file", probe.display())
            }
            Ok(_) if !args.overwrite => bail!(
                "--probe {} exists: pass --overwrite to replace it, or name a new file",
                probe.display()
            ),
            _ => {}
        }
    }
    Ok(())
}
