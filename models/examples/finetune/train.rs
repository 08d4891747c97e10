//! The fine-tuning example's training: the optimizer, loader and trackers prepared, and the loop.

use std::time::Instant;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::scheduler::{Cosine, Schedule, WarmupDecay};
use accelerate_rs::tracking::{self, HParams, StepTimer, Trackers};
use accelerate_rs::{
    AcceleratedOptimizer, Accelerator, Batch, DataLoader, MixedPrecision, MixedPrecisionOptimizer,
    ReduceOp, TensorDataset, TokenLoss, TrainOptimizer,
};
use accelerate_rs_models::AutoModel;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;

use crate::chat;
use crate::data::{evaluate, inputs_and_labels, Data};
use crate::samples::Samples;
use crate::Args;

/// The prepared optimizer: plain, or stepping f32 masters from half-precision gradients.
pub(crate) enum Opt {
    Plain(AcceleratedOptimizer<AdamW>),
    Mixed(MixedPrecisionOptimizer<AdamW>),
}

impl Opt {
    /// One micro-step (the optimizer steps at the end of an accumulation cycle, or at the
    /// loader's last batch).
    fn backward_step(&mut self, loss: &Tensor, batch: &Batch) -> accelerate_rs::Result<()> {
        match self {
            Opt::Plain(o) => o.backward_step_batch(loss, batch),
            Opt::Mixed(o) => o.backward_step_batch(loss, batch).map(drop),
        }
    }

    /// One token-weighted micro-step.
    fn backward_step_tokens(
        &mut self,
        loss: &TokenLoss,
        batch: &Batch,
    ) -> accelerate_rs::Result<()> {
        match self {
            Opt::Plain(o) => o.backward_step_tokens_batch(loss, batch),
            Opt::Mixed(o) => o.backward_step_tokens_batch(loss, batch).map(drop),
        }
    }
}

impl TrainOptimizer for Opt {
    fn lr(&self) -> f64 {
        match self {
            Opt::Plain(o) => o.lr(),
            Opt::Mixed(o) => o.lr(),
        }
    }

    fn set_lr(&mut self, lr: f64) {
        match self {
            Opt::Plain(o) => o.set_lr(lr),
            Opt::Mixed(o) => o.set_lr(lr),
        }
    }
}

/// The learning rate of each optimizer step: `--warmup-steps` of linear warmup, then `--lr`
/// (`constant`) or a cosine decay to `--min-lr` at `--max-steps`.
fn schedule(args: &Args) -> Result<Schedule<WarmupDecay<Cosine>>> {
    let end = match args.lr_schedule.as_str() {
        "constant" => args.lr,
        "cosine" => args.min_lr,
        other => bail!("--lr-schedule {other}: expected constant or cosine"),
    };
    let total = args.max_steps.max(args.warmup_steps + 1);
    Ok(Schedule::new(WarmupDecay::<Cosine>::new(
        args.lr,
        args.warmup_steps,
        total,
        end,
    )?))
}

/// A prepared run: the optimizer, the loader, and under full mixed-precision fine-tuning the
/// model over the working copies (`model` keeps the f32 masters).
pub(crate) struct Run {
    opt: Opt,
    loader: DataLoader,
    working: Option<AutoModel>,
    timer: StepTimer,
    trackers: Option<Trackers>,
    schedule: Schedule<WarmupDecay<Cosine>>,
    samples: Option<Samples>,
}

impl Run {
    /// AdamW over what trains (the adapters with LoRA: the frozen base is neither stepped nor
    /// all-reduced), the shuffled windows, mixed precision as the accelerator says, the step
    /// timer and, with `--log-dir`, the trackers.
    pub(crate) fn prepare(
        accelerator: &Accelerator,
        args: &Args,
        model: &mut AutoModel,
        data: &Data,
    ) -> Result<Self> {
        // At ZeRO stage 3 without LoRA, an optimizer over no variables: it is moved onto the
        // shards by `prepare_sharded_optimizer`.
        let vars = match model.sharded_parameters() {
            Some(_) if model.lora_config().is_none() => Vec::new(),
            _ => model.trainable_parameters().all_vars(),
        };
        let opt = AdamW::new(
            vars,
            ParamsAdamW {
                lr: args.lr,
                weight_decay: args.weight_decay,
                ..Default::default()
            },
        )?;
        let (ids, index) = data.train.clone();
        let loader = DataLoader::new(TensorDataset::new(vec![ids, index])?, args.batch_size)
            .shuffle(true)
            .seed(args.seed)
            .drop_last(true);
        model.train(true);
        let mixed = accelerator.state().mixed_precision();
        let lora = model.lora_config().is_some();
        let sharded = model.sharded_parameters().cloned();
        let full_mixed = mixed != MixedPrecision::No && !lora && sharded.is_none();
        let (opt, loader, working) = if let (Some(s), false) = (&sharded, lora) {
            // ZeRO-3: the optimizer steps this rank's shards (under mixed precision they are the
            // f32 masters; the units are gathered in the compute dtype).
            let opt = accelerator.prepare_sharded_optimizer(s, opt)?;
            (
                Opt::Plain(opt),
                accelerator.prepare_data_loader(loader)?,
                None,
            )
        } else if full_mixed {
            let (opt, loader, work) = accelerator.prepare_mixed(model.varmap(), opt, loader)?;
            (Opt::Mixed(opt), loader, Some(model.with_parameters(&work)?))
        } else {
            // The separate calls: LoRA under mixed precision is meant (f32 adapters over a base
            // in the compute dtype), and `prepare` would warn that it does not apply the mode.
            accelerator.prepare_model(model.trainable_parameters())?;
            let opt = Opt::Plain(accelerator.prepare_optimizer(opt));
            (opt, accelerator.prepare_data_loader(loader)?, None)
        };
        if mixed != MixedPrecision::No {
            accelerator.print(format!(
                "mixed precision {mixed}: {}",
                if full_mixed {
                    "f32 masters, working copies in the compute dtype"
                } else if sharded.is_some() && !lora {
                    "f32 master shards, each unit gathered in the compute dtype"
                } else {
                    "the base in the compute dtype, the adapters in f32"
                }
            ));
        }
        // Each step's time by phase and its throughput (model FLOPs: see `flops_per_token`).
        let tokens_per_step = (loader.local_batch_size() * args.seq_len) as u64;
        let timer = accelerator
            .step_timer()
            .tokens_per_step(tokens_per_step)
            .flops_per_step(model.flops_per_token(args.seq_len) * tokens_per_step as f64);
        let trackers = args.log_dir.as_ref();
        Ok(Run {
            opt,
            loader,
            working,
            timer,
            trackers: trackers
                .map(|d| trackers_in(accelerator, args, model, d))
                .transpose()?,
            schedule: schedule(args)?,
            samples: Samples::load(accelerator, args, model, data.chat.is_some())?,
        })
    }

    /// The held-out loss at optimizer step `step` (logged to the trackers as `eval_loss`) and,
    /// for conversations with `--eval`, the samples: every rank calls it, with `model` in
    /// evaluation mode.
    pub(crate) fn evaluate(
        &mut self,
        accelerator: &Accelerator,
        args: &Args,
        model: &AutoModel,
        data: &Data,
        step: u64,
    ) -> Result<f64> {
        let loss = evaluate(accelerator, model, data, args)?;
        if let Some(t) = self.trackers.as_mut() {
            t.log(&[("eval_loss", loss)], step)?;
        }
        if let Some(samples) = self.samples.as_mut() {
            samples.run(accelerator, model, step, self.trackers.as_mut())?;
        }
        Ok(loss)
    }

    /// `--max-steps` optimizer steps over as many epochs as it takes, printing the training
    /// loss every `--log-every` steps; returns the steps taken and the seconds they took.
    pub(crate) fn train(
        &mut self,
        accelerator: &Accelerator,
        args: &Args,
        model: &mut AutoModel,
        data: &Data,
    ) -> Result<(u64, f64)> {
        let start = Instant::now();
        let (mut step, mut epoch) = (0u64, 0u64);
        // The losses since the last line: (sum, count) of micro-batch means, or for
        // conversations of token losses (reduced over the processes when printed).
        let mut window = (0f64, 0f64);
        while step < args.max_steps {
            self.loader.set_epoch(epoch);
            let before = step;
            for batch in self.loader.iter()? {
                let batch = batch?;
                if accelerator.pending_micro_steps() == 0 {
                    self.schedule.step(&mut self.opt);
                }
                let value = self.step(accelerator, args, model, data, &batch, epoch, step + 1)?;
                window = (window.0 + value.0, window.1 + value.1);
                if !accelerator.sync_gradients() {
                    continue;
                }
                step += 1;
                if step % args.log_every == 0 || step == args.max_steps {
                    let mean = window_mean(accelerator, data, window)?;
                    accelerator.print(format!(
                        "step {step:4}/{} epoch {epoch} training loss {mean:.4}; step {}",
                        args.max_steps, value.2
                    ));
                    window = (0.0, 0.0);
                }
                if step >= args.max_steps {
                    break;
                }
                if args.eval_every > 0 && step % args.eval_every == 0 {
                    model.train(false);
                    let loss = self.evaluate(accelerator, args, model, data, step)?;
                    model.train(true);
                    accelerator.print(format!("step {step:4} held-out loss {loss:.4}"));
                }
            }
            if step == before {
                bail!("no training batch: fewer windows than --batch-size times the processes");
            }
            epoch += 1;
        }
        if let Opt::Mixed(o) = &self.opt {
            if o.skipped_steps() > 0 {
                accelerator.print(format!(
                    "fp16: {} steps skipped for overflowing gradients (loss scale now {})",
                    o.skipped_steps(),
                    o.loss_scale()
                ));
            }
        }
        Ok((step, start.elapsed().as_secs_f64()))
    }

    /// One micro-step on `batch` (window ids and indices): its loss as (sum, count) (a mean and
    /// 1; for conversations the summed token loss and its tokens) and its times.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        accelerator: &Accelerator,
        args: &Args,
        model: &AutoModel,
        data: &Data,
        batch: &Batch,
        epoch: u64,
        step: u64,
    ) -> Result<(f64, f64, accelerate_rs::tracking::StepTimes)> {
        let device = accelerator.device();
        if let Some(rows) = &data.chat {
            let index = batch[1].to_device(&Device::Cpu)?.to_vec1::<u32>()?;
            let b = chat::batch(&rows.train, &index, device)?;
            let trained = self.working.as_ref().unwrap_or(model);
            self.timer.start();
            let loss = chat::token_loss(trained, &b, rows.pack)?;
            self.opt.backward_step_tokens(&loss, batch)?;
            let sum = loss.sum().to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let times = self.timer.stop()?;
            self.log(step, sum / (loss.tokens().max(1) as f64), &times)?;
            return Ok((sum, loss.tokens() as f64, times));
        }
        let (x, y) = inputs_and_labels(
            data.task,
            &batch[0].to_device(&Device::Cpu)?,
            &batch[1].to_device(&Device::Cpu)?,
            data.mask_id,
            args.mlm_probability,
            args.seed.wrapping_add(epoch),
        )?;
        let trained = self.working.as_ref().unwrap_or(model);
        self.timer.start();
        let loss = trained.loss(&x.to_device(device)?, &y.to_device(device)?)?;
        self.opt.backward_step(&loss, batch)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let times = self.timer.stop()?;
        self.log(step, value, &times)?;
        Ok((value, 1.0, times))
    }

    /// The trackers' record of a micro-step.
    fn log(
        &mut self,
        step: u64,
        loss: f64,
        times: &accelerate_rs::tracking::StepTimes,
    ) -> Result<()> {
        if let Some(t) = self.trackers.as_mut() {
            let mut metrics = times.metrics();
            metrics.push(("loss", loss));
            metrics.push(("lr", self.opt.lr()));
            t.log(&metrics, step)?;
        }
        Ok(())
    }
}

/// The training loss of the steps since the last line: the mean of the micro-batch means
/// (averaged over the processes), or for conversations the token-weighted mean over every
/// process's tokens.
fn window_mean(accelerator: &Accelerator, data: &Data, (sum, count): (f64, f64)) -> Result<f64> {
    if data.chat.is_none() {
        return Ok(accelerator.average(sum / count.max(1.0))?);
    }
    let device = accelerator.device();
    let totals = accelerator.reduce(&Tensor::new(&[sum, count], device)?, ReduceOp::Sum)?;
    let totals = totals.to_vec1::<f64>()?;
    Ok(totals[0] / totals[1].max(1.0))
}

/// The trackers of `--log-dir`: `metrics.jsonl` and TensorBoard, with the run's settings.
fn trackers_in(
    accelerator: &Accelerator,
    args: &Args,
    model: &AutoModel,
    dir: &std::path::Path,
) -> Result<Trackers> {
    let mut t = tracking::trackers(accelerator)
        .jsonl(dir.join("metrics.jsonl"))?
        .tensorboard(dir.join("tensorboard"))?;
    t.log_hparams(
        &HParams::of_run(accelerator)
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
            .set("seed", args.seed)
            .set(
                "gradient_accumulation",
                accelerator.gradient_accumulation_steps(),
            )
            .set("warmup_steps", args.warmup_steps)
            .set("lr_schedule", args.lr_schedule.clone())
            .set("pack", args.pack)
            .set("train_on_everything", args.train_on_everything),
    )?;
    Ok(t)
}
