//! ZeRO-style sharding on 2 CPU processes: optimizer-state and gradient bytes per rank, peak
//! RSS and step time at stages 0, 1 and 2, on the MLP and on `examples/transformer_lm`'s model.
//!
//!     cargo bench --bench zero              # both models
//!     cargo bench --bench zero -- --quick   # fewer steps
//!
//! The bench re-executes itself as the 2 workers of each run (`RANK`, `WORLD_SIZE`, ... and
//! `ACCELERATE_RS_ZERO_STAGE`, one Rayon thread each); every rank prints
//! `RESULT-ZERO model=<name> world=2 stage=<s> optimizer_state_bytes_per_rank=<n>
//! grad_bytes_per_rank=<n> peak_rss_mb=<n> step_ms=<n>`, and the bench prints rank 0's line of
//! every run (the ranks' byte counts differ by at most one bucket element). Models: MLP
//! 784-1024-1024-10 (batch 64 per process) and the Transformer LM (vocab 8000, d_model 256, 8
//! heads, 4 layers, sequences of 128, batch 8 per process); AdamW (accelerate-rs's fused one),
//! lr 1e-3; synthetic data.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Instant;

use accelerate_rs::optim::AdamW;
use accelerate_rs::Accelerator;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, loss, Linear, VarBuilder, VarMap};

/// The transformer of `examples/transformer_lm`.
#[allow(dead_code)]
#[path = "../examples/transformer_lm/model.rs"]
mod lm;

const ROLE_ENV: &str = "ACCELERATE_RS_ZERO_BENCH_MODEL";
const WORLD: usize = 2;

struct Mlp(Linear, Linear, Linear);

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let xs = self.0.forward(xs)?.relu()?;
        let xs = self.1.forward(&xs)?.relu()?;
        self.2.forward(&xs)
    }
}

struct Lm(lm::TransformerLm);

impl Module for Lm {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.0.forward(ids)?;
        let (b, t, v) = logits.dims3()?;
        logits.reshape((b * t, v))
    }
}

/// The model, one batch of inputs and targets (targets flattened).
fn workload(name: &str, vb: VarBuilder) -> Result<(Box<dyn Module>, Tensor, Tensor)> {
    let dev = Device::Cpu;
    match name {
        "mlp" => {
            let m = Mlp(
                linear(784, 1024, vb.pp("fc1"))?,
                linear(1024, 1024, vb.pp("fc2"))?,
                linear(1024, 10, vb.pp("fc3"))?,
            );
            let x = Tensor::rand(-1f32, 1f32, (64, 784), &dev)?;
            let y: Vec<u32> = (0..64u32).map(|i| (i * 7) % 10).collect();
            let y = Tensor::from_vec(y, 64, &dev)?;
            Ok((Box::new(m), x, y))
        }
        "transformer_lm" => {
            let cfg = lm::Config {
                vocab_size: 8000,
                seq_len: 128,
                d_model: 256,
                heads: 8,
                layers: 4,
                tie_weights: false,
                activation: lm::Activation::Gelu,
            };
            let m = lm::TransformerLm::new(cfg, vb)?;
            let ids = |salt: u32| -> Result<Tensor> {
                let v: Vec<u32> = (0..8 * 128u32)
                    .map(|i| (i.wrapping_mul(2654435761u32) ^ salt) % 8000)
                    .collect();
                Ok(Tensor::from_vec(v, (8, 128), &dev)?)
            };
            Ok((Box::new(Lm(m)), ids(1)?, ids(7)?.flatten_all()?))
        }
        other => bail!("unknown model {other:?}"),
    }
}

/// Peak resident memory of this process (VmHWM), in MiB.
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn worker(model: &str, steps: usize) -> Result<()> {
    let acc = Accelerator::new()?;
    let varmap = VarMap::new();
    let (net, x, y) = workload(
        model,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    acc.prepare_model(&varmap)?;
    let mut opt = acc.prepare_optimizer(AdamW::new_lr(varmap.all_vars(), 1e-3)?);
    let mut grad_bytes = 0;
    let mut times = Vec::new();
    for i in 0..steps + 2 {
        let t = Instant::now();
        let l = loss::cross_entropy(&net.forward(&x)?, &y)?;
        let grads = acc
            .backward(&l)?
            .ok_or_else(|| anyhow!("no gradients handed out without accumulation"))?;
        grad_bytes = varmap
            .all_vars()
            .iter()
            .filter_map(|v| grads.get(v.as_tensor()))
            .map(|g| g.elem_count() * g.dtype().size_in_bytes())
            .sum::<usize>();
        opt.step(&grads)?;
        drop(grads);
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let step_ms = times.iter().sum::<f64>() / times.len().max(1) as f64;
    println!(
        "RESULT-ZERO model={model} world={} stage={} optimizer_state_bytes_per_rank={} grad_bytes_per_rank={grad_bytes} peak_rss_mb={:.0} step_ms={step_ms:.1}",
        acc.world_size(),
        acc.state().zero_stage(),
        opt.inner().state_bytes(),
        peak_rss_mb(),
    );
    Ok(())
}

fn run(model: &str, stage: usize, steps: usize) -> Result<String> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(&exe)
                .env(ROLE_ENV, model)
                .env("ZERO_BENCH_STEPS", steps.to_string())
                .env("ACCELERATE_RS_ZERO_STAGE", stage.to_string())
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", WORLD.to_string())
                .env("LOCAL_WORLD_SIZE", WORLD.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("ACCELERATE_RS_SECRET", format!("zero-bench-{port}"))
                .env("RAYON_NUM_THREADS", "1")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .context("spawning a worker")
        })
        .collect::<Result<_>>()?;
    let mut first = None;
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "rank {rank} of the {model} stage {stage} run failed: {}",
                out.status
            );
        }
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if rank == 0 {
            first = text
                .lines()
                .find(|l| l.starts_with("RESULT-ZERO"))
                .map(str::to_string);
        }
    }
    first.ok_or_else(|| anyhow!("rank 0 printed no RESULT-ZERO line"))
}

fn main() -> Result<()> {
    if let Ok(model) = std::env::var(ROLE_ENV) {
        let steps = std::env::var("ZERO_BENCH_STEPS")?.parse()?;
        return worker(&model, steps);
    }
    let quick = std::env::args().any(|a| a == "--quick");
    for (model, steps) in [
        ("mlp", if quick { 5 } else { 30 }),
        ("transformer_lm", if quick { 2 } else { 6 }),
    ] {
        for stage in 0..=2 {
            println!("{}", run(model, stage, steps)?);
        }
    }
    Ok(())
}
