//! A small decoder-only Transformer language model trained data-parallel with accelerate-rs, with
//! the pieces of a real training loop: gradient accumulation, AdamW with decoupled weight decay
//! (matrices only), linear warmup + cosine decay, gradient clipping, a JSON Lines metrics log,
//! loss and tokens/s every few steps, and a held-out evaluation loss at the end.
//!
//! Character-level, on `data/corpus.txt` (this repository's own documentation; see
//! `data/README.md`). Build in release, then run on one process or under the launcher:
//!
//!     cargo build --release --example transformer_lm
//!     target/release/examples/transformer_lm                                   # one process
//!     cargo run --release -- launch --cpu -n 2 target/release/examples/transformer_lm
//!
//! `--help` lists the flags (architecture: `--layers 4 --d-model 256 --heads 8 --seq-len 128`).
//! The defaults (100 steps of 2 x 8 x 128 characters) take about 2 minutes on 2 CPU cores in
//! release, the training loss falling from about ln(vocab) = 4.7 to about 2.7; metrics go to
//! `runs/transformer_lm/metrics.jsonl` and TensorBoard's `runs/transformer_lm/tensorboard`
//! (`--log-dir`): the run's settings and hyperparameters once (TensorBoard's HPARAMS tab), the
//! loss, and every step's time by phase (data, forward, backward, communication, optimizer) with
//! tokens/s and achieved FLOP/s. Add `--grad-accum N` (or the launcher's
//! `--gradient-accumulation-steps N`) to accumulate gradients over N micro-batches.
mod data;
mod model;

use std::time::Instant;

use accelerate_rs::checkpoint::{latest_checkpoint, CheckpointParts, LoadTargets};
use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::scheduler::{LinearWarmupCosine, Schedule};
use accelerate_rs::tracking::HParams;
use accelerate_rs::{tracking, Accelerator, Parameters, ReduceOp, StreamingLoader};
use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use clap::Parser;

use data::{Args, CharWindows};
use model::{Config, TransformerLm};

fn main() -> Result<()> {
    let args = Args::parse();
    let mut builder = Accelerator::builder();
    if let Some(steps) = args.grad_accum {
        builder = builder.gradient_accumulation_steps(steps);
    }
    let accelerator = builder.build()?;
    accelerator.set_seed(args.seed)?;

    let corpus = data::load(&args)?;
    let cfg = Config {
        vocab_size: corpus.vocab.len(),
        seq_len: args.seq_len,
        d_model: args.d_model,
        heads: args.heads,
        layers: args.layers,
        tie_weights: args.tie_weights,
        activation: args.activation,
    };
    let varmap = VarMap::new();
    // Initial weights drawn from (--seed, parameter name): the same at any number of processes.
    let model = TransformerLm::new(cfg, accelerator.var_builder(&varmap, DType::F32))?;
    let n_params: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    accelerator.print(format!(
        "{} processes, vocab {}, {} training / {} held-out characters, {:.2}M parameters, \
         {} x {} sequences per micro-batch per process, {} micro-batches per step",
        accelerator.world_size(),
        cfg.vocab_size,
        corpus.train.len(),
        corpus.val.len(),
        n_params as f64 / 1e6,
        args.batch_size,
        args.seq_len,
        accelerator.gradient_accumulation_steps(),
    ));

    // AdamW with GPT-2's two parameter groups: weight decay on matrices and embeddings, none
    // on biases and norm gains. One optimizer, so that ZeRO can shard it.
    let vars: Vec<Var> = varmap
        .named_parameters()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let no_decay: Vec<Var> = vars.iter().filter(|v| v.rank() < 2).cloned().collect();
    let config = ParamsAdamW {
        lr: args.lr,
        weight_decay: args.weight_decay,
        beta2: 0.95,
        ..Default::default()
    };
    let opt = AdamW::new(vars, config)?.no_weight_decay_on(&no_decay);
    // The training windows as a stream, sharded across processes (each decodes its own).
    let windows = CharWindows::new(corpus.train.clone(), args.seq_len, args.seed)?;
    let mut loader =
        accelerator.prepare_streaming_loader(StreamingLoader::new(windows, args.batch_size))?;
    accelerator.prepare_model(&varmap)?;
    let mut opt = accelerator.prepare_optimizer(opt);
    let mixed = accelerator.state().mixed_precision();
    if mixed != accelerate_rs::MixedPrecision::No {
        accelerator.print(format!(
            "note: this example trains in f32; mixed precision {mixed} is not applied (see \
             `Accelerator::prepare_mixed`, and the fine-tuning example of accelerate-rs-models)"
        ));
    }
    if args.clip_grad_norm > 0.0 {
        opt.set_clip_grad_norm(Some(args.clip_grad_norm));
    }
    let mut schedule = Schedule::new(LinearWarmupCosine::new(
        args.lr,
        args.warmup_steps.min(args.max_steps),
        args.max_steps,
        args.lr * args.min_lr_ratio,
    )?);
    let mut trackers = tracking::trackers(&accelerator)
        .jsonl(args.log_dir.join("metrics.jsonl"))?
        .tensorboard(args.log_dir.join("tensorboard"))?;
    trackers.log_hparams(
        &HParams::of_run(&accelerator)
            .set("lr", args.lr)
            .set("weight_decay", args.weight_decay)
            .set("batch_size", args.batch_size)
            .set("seq_len", args.seq_len)
            .set("d_model", args.d_model)
            .set("heads", args.heads)
            .set("layers", args.layers)
            .set("parameters", n_params)
            .set("max_steps", args.max_steps)
            .set("seed", args.seed),
    )?;
    // Each optimizer step's time by phase, and its throughput, for the trackers.
    let tokens_per_step =
        args.batch_size * args.seq_len * accelerator.gradient_accumulation_steps();
    let mut timer = accelerator
        .step_timer()
        .tokens_per_step(tokens_per_step as u64)
        .flops_per_step(flops_per_token(&cfg, n_params) * tokens_per_step as f64);
    let mut timing = false;

    // Tokens per micro-step, all processes together.
    let tokens_per_micro = (args.batch_size * args.seq_len * accelerator.world_size()) as f64;
    let start = Instant::now();
    let mut step = 0u64;
    let mut epoch = 0;
    // Resume mid-epoch from the newest sound checkpoint: parameters, optimizer moments, the
    // schedule and the loader position in global samples (so a run saved on 4 processes
    // resumes on 2 without repeating or skipping a sample).
    let checkpoints = args.log_dir.join("checkpoints");
    let restarted = std::env::var(accelerate_rs::env::RESTART_COUNT).is_ok_and(|c| c != "0");
    if args.resume || restarted {
        let found = match latest_checkpoint(&checkpoints) {
            Err(accelerate_rs::Error::NoSoundCheckpoint { refused, .. }) if args.start_fresh => {
                accelerator.print(format!(
                    "--start-fresh: none of the {} checkpoint(s) in {} is sound; starting from step 0",
                    refused.len(),
                    checkpoints.display()
                ));
                None
            }
            found => found?,
        };
        if let Some(dir) = found {
            let targets = LoadTargets::new(&varmap)
                .optimizer(&mut opt)
                .state("schedule", &mut schedule);
            let m = accelerator.load_state_into(&dir, targets)?;
            step = m.step;
            if let Some(pos) = m.samples {
                loader.resume_from(pos);
                epoch = pos.epoch;
            }
            accelerator.print(format!("resumed from {} at step {step}", dir.display()));
        }
    }
    // The learning rate of the next optimizer step; the schedule advances on sync steps only.
    let mut lr = schedule.step(&mut opt);
    let (mut window_loss, mut window_micro) = (0f64, 0usize);
    let mut window_start = Instant::now();
    let (mut first_loss, mut last_loss) = (None, 0f64);
    'train: while step < args.max_steps {
        loader.set_epoch(epoch);
        // The stream's position (in global samples) is read after each batch for checkpoints.
        let mut batches = loader.iter()?;
        while let Some(batch) = batches.next() {
            let batch = batch?;
            if !timing {
                timer.start();
                timing = true;
            }
            // The output layer and the cross-entropy fused: see `TransformerLm::loss`.
            let loss = model.loss(&batch[0], &batch[1])?;
            opt.backward_step_batch(&loss, &batch)?;
            window_loss += loss.to_scalar::<f32>()? as f64;
            window_micro += 1;
            if !opt.is_sync_step() {
                continue;
            }
            // An optimizer step was taken, with learning rate `lr`.
            step += 1;
            let times = timer.stop()?;
            timing = false;
            trackers.log(&times.metrics(), step)?;
            if step.is_multiple_of(args.log_every) || step == 1 || step == args.max_steps {
                let elapsed = window_start.elapsed().as_secs_f64();
                let mean_loss = window_loss / window_micro as f64;
                let tokens_per_s = window_micro as f64 * tokens_per_micro / elapsed;
                first_loss.get_or_insert(mean_loss);
                last_loss = mean_loss;
                let grad_norm = opt.last_grad_norm().unwrap_or(f64::NAN);
                accelerator.print(format!(
                    "step {step:4}/{} epoch {epoch} loss {mean_loss:.4} lr {lr:.2e} \
                     grad norm {grad_norm:.3} {tokens_per_s:.0} tokens/s; last step {times}",
                    args.max_steps,
                ));
                trackers.log(
                    &[
                        ("loss", mean_loss),
                        ("lr", lr),
                        ("grad_norm", grad_norm),
                        ("tokens_per_s", tokens_per_s),
                    ],
                    step,
                )?;
                (window_loss, window_micro) = (0.0, 0);
                window_start = Instant::now();
            }
            if args.checkpoint_every > 0 && step.is_multiple_of(args.checkpoint_every) {
                let parts = CheckpointParts::new(&varmap)
                    .optimizer(&opt)
                    .state("schedule", &schedule)
                    .samples(batches.position())
                    .step(step);
                let dir =
                    accelerator.save_state_auto(&checkpoints, &parts, args.keep_checkpoints)?;
                accelerator.print(format!("saved {}", dir.display()));
            }
            if step >= args.max_steps {
                break 'train;
            }
            lr = schedule.step(&mut opt);
        }
        epoch += 1;
    }
    let train_secs = start.elapsed().as_secs_f64();

    let summary = format!(
        "trained {step} steps in {train_secs:.1} s; train loss {:.4} -> {last_loss:.4}",
        first_loss.unwrap_or(f64::NAN)
    );
    if corpus.val.is_empty() {
        accelerator.print(format!("{summary}; no held-out text (--val-fraction 0)"));
        trackers.log(&[("train_secs", train_secs)], step)?;
    } else {
        let eval_loss = evaluate(&accelerator, &model, &corpus.val, &args)?;
        accelerator.print(format!("{summary}; held-out loss {eval_loss:.4}"));
        trackers.log(
            &[("eval_loss", eval_loss), ("train_secs", train_secs)],
            step,
        )?;
    }
    trackers.flush()?;
    Ok(())
}

/// Floating-point operations per trained token, forward and backward: 6 per parameter (a
/// multiply-add forward, two backward; the embedding lookups are counted too, a small
/// overestimate) plus attention's score and value products, 12 x layers x seq_len x d_model
/// (all of them, although the causal mask makes half unnecessary), as in the PaLM paper's
/// appendix B.
fn flops_per_token(cfg: &Config, n_params: usize) -> f64 {
    6.0 * n_params as f64 + 12.0 * (cfg.layers * cfg.seq_len * cfg.d_model) as f64
}

/// The mean next-token loss over the held-out windows (at most `--eval-batches` batches), each
/// process taking every `world_size`-th window and the sums reduced across processes.
fn evaluate(
    accelerator: &Accelerator,
    model: &TransformerLm,
    val: &[u32],
    args: &Args,
) -> Result<f64> {
    let device = accelerator.device();
    let limit = (args.eval_batches > 0).then_some(args.eval_batches * args.batch_size);
    let (x, y) = data::windows(val, args.seq_len, limit, device)?;
    let n = x.dim(0)?;
    let mine: Vec<u32> = (accelerator.rank()..n)
        .step_by(accelerator.world_size())
        .map(|i| i as u32)
        .collect();
    let (mut sum, mut count) = (0f64, 0f64);
    for chunk in mine.chunks(args.batch_size) {
        let idx = Tensor::new(chunk, device)?;
        let (xb, yb) = (x.index_select(&idx, 0)?, y.index_select(&idx, 0)?);
        let loss = model.loss(&xb, &yb)?;
        let tokens = yb.elem_count() as f64;
        sum += loss.to_scalar::<f32>()? as f64 * tokens;
        count += tokens;
    }
    let totals = accelerator.reduce(&Tensor::new(&[sum, count], device)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    Ok(totals[0] / totals[1])
}
