//! The digits MLP trained data-parallel with accelerate-rs: the same program runs on one process
//! or many. Compare with `examples/digits_plain/main.rs` (the README shows the diff).
//!
//!     cargo run --release --example digits                       # one process
//!     accelerate-rs launch --cpu -n 2 target/release/examples/digits   # two processes
mod data;

use accelerate_rs::{seeded_var_builder, Accelerator, DataLoader, TensorDataset};
use anyhow::Result;
use candle_core::{DType, Module};
use candle_nn::{loss, AdamW, Optimizer, ParamsAdamW, VarMap};
use clap::Parser;

fn main() -> Result<()> {
    let args = data::Args::parse();
    let accelerator = Accelerator::new()?;
    let device = accelerator.device().clone();
    let (train, test) = data::load(args.data.as_deref(), args.seed, &device, args.dtype)?;

    let varmap = VarMap::new();
    let model = data::Mlp::new(seeded_var_builder(&varmap, args.seed, args.dtype, &device))?;
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
    let (mut opt, mut loader) = accelerator.prepare(&varmap, opt, loader)?;

    for epoch in 0..args.epochs {
        loader.set_epoch(epoch);
        let mut sum_loss = 0f32;
        for batch in loader.iter()? {
            let batch = batch?;
            let logits = model.forward(&batch[0])?;
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
