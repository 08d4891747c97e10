//! The digits MLP trained data-parallel with accelerate-rs: the same program runs on one process
//! or many. Compare with `examples/digits_plain/main.rs` (the README shows the diff).
//!
//!     cargo run --release --example digits                       # one process
//!     accelerate-rs launch --cpu -n 2 target/release/examples/digits   # two processes
//!     cargo run --release --example digits -- --mixed-precision bf16    # bf16 compute, f32 masters
mod data;

use accelerate_rs::{Accelerator, DataLoader, MixedPrecision, TensorDataset};
use anyhow::{bail, Result};
use candle_core::{DType, Module};
use candle_nn::{loss, AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use clap::Parser;

#[derive(clap::Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: data::Args,
    /// Mixed precision: `bf16` or `fp16` compute with f32 master weights (`--dtype` stays f32),
    /// or `no`. Unset: `ACCELERATE_RS_MIXED_PRECISION` / the config file.
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
}

fn main() -> Result<()> {
    let Cli {
        args,
        mixed_precision,
    } = Cli::parse();
    let mut builder = Accelerator::builder();
    if let Some(mp) = mixed_precision {
        builder = builder.mixed_precision(mp);
    }
    let accelerator = builder.build()?;
    let mixed = accelerator.state().mixed_precision() != MixedPrecision::No;
    if mixed && args.dtype != DType::F32 {
        bail!("--mixed-precision keeps f32 master weights: leave --dtype at f32");
    }
    let device = accelerator.device().clone();
    let (train, test) = data::load(&args.data, args.seed, &device, args.dtype)?;

    // The model is built in `--dtype` (the master weights); with mixed precision it is built a
    // second time from the half-precision working copies returned by `prepare_mixed`.
    let varmap = VarMap::new();
    let model = data::Mlp::new(VarBuilder::from_varmap(&varmap, args.dtype, &device))?;
    let opt = AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: args.lr,
            ..Default::default()
        },
    )?;
    let loader = DataLoader::new(TensorDataset::new(vec![train.x, train.y])?, args.batch_size)
        .shuffle(true)
        .seed(args.seed);
    let (mut opt, mut loader, work) = accelerator.prepare_mixed(&varmap, opt, loader)?;
    let dtype = opt.compute_dtype();
    let model = if mixed {
        data::Mlp::new(VarBuilder::from_varmap(&work, dtype, &device))?
    } else {
        model
    };
    let test = data::Split {
        x: test.x.to_dtype(if mixed { dtype } else { args.dtype })?,
        y: test.y,
    };

    for epoch in 0..args.epochs {
        loader.set_epoch(epoch);
        let mut sum_loss = 0f32;
        for batch in loader.iter()? {
            let batch = batch?;
            let x = if mixed {
                batch[0].to_dtype(dtype)?
            } else {
                batch[0].clone()
            };
            let logits = model.forward(&x)?;
            let logits = if mixed {
                logits.to_dtype(DType::F32)?
            } else {
                logits
            };
            let loss = loss::cross_entropy(&logits, &batch[1])?;
            opt.backward_step(&loss)?;
            sum_loss += loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        }
        let acc = data::accuracy(&model, &test)?;
        accelerator.print(format!(
            "epoch {epoch:3} loss {:.4} test accuracy {acc:.4}",
            sum_loss / loader.len() as f32
        ));
    }
    let acc = data::accuracy(&model, &test)?;
    accelerator.print(format!("final test accuracy {acc:.4}"));
    data::check(acc, &args)
}
