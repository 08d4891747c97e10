//! Optimizer step time: accelerate-rs's fused in-place optimizers against Candle's.
//!
//!     cargo bench --bench optimizer              # full run
//!     cargo bench --bench optimizer -- --quick   # fewer steps
//!     cargo bench --bench optimizer -- --default-allocator   # without the allocator tuning
//!
//! Parameters: the MLP 784-1024-1024-10 (1,863,690 f32 in 6 tensors), with fixed random
//! gradients. One compute thread (`RAYON_NUM_THREADS=1`, unless already set), as in a DDP worker
//! on a 2-core machine, and the allocator settings an `Accelerator` applies
//! (`accelerate_rs::allocator::tune`). Variants run in alternating blocks so that drift hits them
//! alike.

use std::time::Instant;

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

const SHAPES: [&[usize]; 6] = [
    &[1024, 784],
    &[1024],
    &[1024, 1024],
    &[1024],
    &[10, 1024],
    &[10],
];

fn mlp_vars() -> Result<Vec<Var>> {
    SHAPES
        .iter()
        .map(|s| Ok(Var::randn(0f32, 0.02, *s, &Device::Cpu)?))
        .collect()
}

fn grads_for(vars: &[Var]) -> Result<GradStore> {
    let mut g = GradStore::default();
    for v in vars {
        g.insert(
            v.as_tensor(),
            Tensor::randn(0f32, 1e-3, v.shape(), &Device::Cpu)?,
        );
    }
    Ok(g)
}

trait Stepper {
    fn name(&self) -> &'static str;
    fn step(&mut self) -> Result<()>;
}

struct Run<O> {
    name: &'static str,
    opt: O,
    grads: GradStore,
}

impl<O: Optimizer> Stepper for Run<O> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn step(&mut self) -> Result<()> {
        Ok(self.opt.step(&self.grads)?)
    }
}

fn run<O: Optimizer + 'static>(
    name: &'static str,
    make: impl Fn(Vec<Var>) -> Result<O>,
) -> Result<Box<dyn Stepper>> {
    let vars = mlp_vars()?;
    let grads = grads_for(&vars)?;
    Ok(Box::new(Run {
        name,
        opt: make(vars)?,
        grads,
    }))
}

fn main() -> Result<()> {
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Before anything touches Rayon or Candle's thread count.
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_default();
    // The allocator settings an `Accelerator` applies, for every variant alike.
    // `--default-allocator`: glibc's defaults instead (what a program without an Accelerator gets).
    let default_allocator = std::env::args().skip(1).any(|a| a == "--default-allocator");
    let tuned = !default_allocator && accelerate_rs::allocator::tune();
    let (warmup, block, rounds) = if quick { (2, 5, 2) } else { (5, 10, 6) };
    let adamw = ParamsAdamW {
        lr: 1e-3,
        ..ParamsAdamW::default()
    };
    let mut variants: Vec<Box<dyn Stepper>> = vec![
        run("candle_nn::AdamW", |v| {
            Ok(candle_nn::AdamW::new(v, adamw.clone())?)
        })?,
        run("accelerate_rs::optim::AdamW (fused)", |v| {
            Ok(accelerate_rs::optim::AdamW::new(v, adamw.clone())?)
        })?,
        run("candle_nn::SGD", |v| Ok(candle_nn::SGD::new(v, 0.01)?))?,
        run("accelerate_rs::optim::Sgd (fused)", |v| {
            Ok(accelerate_rs::optim::Sgd::new(
                v,
                accelerate_rs::optim::SgdConfig::new(0.01),
            )?)
        })?,
        run(
            "accelerate_rs::optim::Sgd momentum 0.9, Nesterov (fused)",
            |v| {
                Ok(accelerate_rs::optim::Sgd::new(
                    v,
                    accelerate_rs::optim::SgdConfig::new(0.01)
                        .momentum(0.9)
                        .nesterov(true),
                )?)
            },
        )?,
    ];
    let params: usize = SHAPES.iter().map(|s| s.iter().product::<usize>()).sum();
    println!(
        "## Optimizer step on the MLP 784-1024-1024-10 ({params} f32 parameters, {:.2} MB), \
         RAYON_NUM_THREADS={threads}, allocator tuned: {tuned}{}",
        (params * DType::F32.size_in_bytes()) as f64 / 1e6,
        if quick { " (--quick)" } else { "" }
    );
    for v in variants.iter_mut() {
        for _ in 0..warmup {
            v.step()?;
        }
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for k in 0..variants.len() {
            let i = (k + round) % variants.len();
            for _ in 0..block {
                let t = Instant::now();
                variants[i].step()?;
                times[i].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    let median = |xs: &[f64]| {
        let mut s = xs.to_vec();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let candle_adamw = median(&times[0]);
    let candle_sgd = median(&times[2]);
    println!();
    println!(
        "| optimizer | steps | ms/step mean | ms/step median | speed-up vs Candle's (median) |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (i, v) in variants.iter().enumerate() {
        // Candle has no momentum: the last variant has no counterpart.
        let speedup = match i {
            0 | 1 => format!("{:.1}x", candle_adamw / median(&times[i])),
            2 | 3 => format!("{:.1}x", candle_sgd / median(&times[i])),
            _ => "-".to_string(),
        };
        println!(
            "| {} | {} | {:.2} | {:.2} | {speedup} |",
            v.name(),
            times[i].len(),
            mean(&times[i]),
            median(&times[i]),
        );
    }
    Ok(())
}
