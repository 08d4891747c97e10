//! The fine-tuning example's training: the optimizer, loader and trackers prepared, and the loop.

use std::time::Instant;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs::tracking::{self, HParams, StepTimer, Trackers};
use accelerate_rs::{
    AcceleratedOptimizer, Accelerator, DataLoader, MixedPrecision, MixedPrecisionOptimizer,
    TensorDataset,
};
use accelerate_rs_models::AutoModel;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;

use crate::data::{inputs_and_labels, Data};
use crate::Args;

/// The prepared optimizer: plain, or stepping f32 masters from half-precision gradients.
pub(crate) enum Opt {
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

/// A prepared run: the optimizer, the loader, and under full mixed-precision fine-tuning the
/// model over the working copies (`model` keeps the f32 masters).
pub(crate) struct Run {
    opt: Opt,
    loader: DataLoader,
    working: Option<AutoModel>,
    timer: StepTimer,
    trackers: Option<Trackers>,
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
        let trackers = match &args.log_dir {
            Some(dir) => Some(trackers(accelerator, args, model, dir)?),
            None => None,
        };
        Ok(Run {
            opt,
            loader,
            working,
            timer,
            trackers,
        })
    }

    /// `--max-steps` optimizer steps over as many epochs as it takes, printing the training
    /// loss every `--log-every` steps; returns the steps taken and the seconds they took.
    pub(crate) fn train(
        mut self,
        accelerator: &Accelerator,
        args: &Args,
        model: &AutoModel,
        data: &Data,
    ) -> Result<(u64, f64)> {
        let start = Instant::now();
        let (mut step, mut epoch) = (0u64, 0u64);
        let mut window = (0f64, 0usize);
        while step < args.max_steps {
            self.loader.set_epoch(epoch);
            let before = step;
            for batch in self.loader.iter()? {
                let batch = batch?;
                step += 1;
                let value = self.step(accelerator, args, model, data, &batch, epoch, step)?;
                window = (window.0 + value.0, window.1 + 1);
                if step % args.log_every == 0 || step == args.max_steps {
                    let mean = accelerator.average(window.0 / window.1 as f64)?;
                    accelerator.print(format!(
                        "step {step:4}/{} epoch {epoch} training loss {mean:.4}; step {}",
                        args.max_steps, value.1
                    ));
                    window = (0.0, 0);
                }
                if step >= args.max_steps {
                    break;
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

    /// One optimizer step on `batch` (window ids and indices): its loss and its times.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        accelerator: &Accelerator,
        args: &Args,
        model: &AutoModel,
        data: &Data,
        batch: &[Tensor],
        epoch: u64,
        step: u64,
    ) -> Result<(f64, accelerate_rs::tracking::StepTimes)> {
        let device = accelerator.device();
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
        self.opt.backward_step(&loss)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let times = self.timer.stop()?;
        if let Some(t) = self.trackers.as_mut() {
            let mut metrics = times.metrics();
            metrics.push(("loss", value));
            t.log(&metrics, step)?;
        }
        Ok((value, times))
    }
}

/// The trackers of `--log-dir`: `metrics.jsonl` and TensorBoard, with the run's settings.
fn trackers(
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
            .set("seed", args.seed),
    )?;
    Ok(t)
}
