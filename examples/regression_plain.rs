//! A plain Candle regression loop that slices its own batches: the starting point of the
//! README's conversion (`examples/regression.rs` is the same program, data-parallel). Its
//! initial weights come from Candle's unseeded CPU generator: every run starts elsewhere.
//!
//!     cargo run --release --example regression_plain
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};

fn main() -> Result<()> {
    let device = Device::Cpu;
    let (x, y) = data(&device)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let model = linear(8, 1, vb.pp("fc"))?;
    println!("initial weights {:?}", model.weight().to_vec2::<f32>()?);
    let mut opt = SGD::new(varmap.all_vars(), 0.05)?;
    let bs = 64;
    let n = x.dim(0)? / bs;
    for epoch in 0..10 {
        let mut total = 0f32;
        for i in 0..n {
            let (xb, yb) = (x.narrow(0, i * bs, bs)?, y.narrow(0, i * bs, bs)?);
            let loss = loss::mse(&model.forward(&xb)?, &yb)?;
            opt.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
        }
        println!("epoch {epoch} loss {:.6}", total / n as f32);
    }
    println!("weights {:?}", model.weight().to_vec2::<f32>()?);
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
