//! `examples/regression_plain.rs` made data-parallel (the README shows the diff): the same
//! initial weights (seeded by `var_builder`) and the same samples per step at any number of
//! processes, so 2 or 4 processes follow the 1-process run.
//!
//!     ACCELERATE_RS_NUM_PROCESSES=2 cargo run --release --example regression
//!     accelerate-rs launch --cpu -n 2 target/release/examples/regression
use accelerate_rs::Accelerator;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Optimizer, VarMap, SGD};

fn main() -> Result<()> {
    let acc = Accelerator::new()?;
    let device = Device::Cpu;
    let (x, y) = data(&device)?;
    let (x, y) = (acc.shard_rows(&x)?, acc.shard_rows(&y)?);
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap, DType::F32);
    let model = linear(8, 1, vb.pp("fc"))?;
    println!("initial weights {:?}", model.weight().to_vec2::<f32>()?);
    acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(SGD::new(varmap.all_vars(), 0.05)?);
    let bs = acc.local_batch_size(64);
    let n = x.dim(0)? / bs;
    for epoch in 0..10 {
        let mut total = 0f32;
        for i in 0..n {
            let (xb, yb) = (x.narrow(0, i * bs, bs)?, y.narrow(0, i * bs, bs)?);
            let loss = loss::mse(&model.forward(&xb)?, &yb)?;
            opt.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
        }
        let loss = acc.average(total / n as f32)?;
        acc.print(format!("epoch {epoch} loss {loss:.6}"));
    }
    acc.print(format!("weights {:?}", model.weight().to_vec2::<f32>()?));
    Ok(())
}

/// 1024 deterministic samples of 8 features; the target is a fixed linear function plus 0.5.
fn data(device: &Device) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = (0..1024 * 8)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let x = Tensor::from_vec(x, (1024, 8), device)?;
    let w = Tensor::new(
        &[[0.5f32], [-1.0], [2.0], [0.0], [1.5], [-0.5], [0.25], [1.0]],
        device,
    )?;
    Ok((x.clone(), (x.matmul(&w)? + 0.5)?))
}
