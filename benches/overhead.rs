//! Wrapper overhead and DDP throughput of accelerate-rs on the CPU.
//!
//!     cargo bench --bench overhead              # full run
//!     cargo bench --bench overhead -- --quick   # fewer steps
//!     cargo bench --features cuda --bench overhead -- --gpu   # section 1 on GPU 0
//!     cargo bench --bench overhead -- --model transformer  # section 1 on transformer_lm's model
//!     cargo bench --bench overhead -- --ddp-only  # section 2 only, plus `RESULT-DDP` lines
//!                                                 # (read by scripts/pytorch_ddp_bench.py)
//!     cargo bench --bench overhead -- --ddp-only --model transformer [--ddp-runs N]
//!                     # section 2 on transformer_lm's model (AdamW, clip 1.0, fused
//!                     # cross-entropy; read by scripts/pytorch_lm_bench.py)
//!     cargo bench --features cuda --bench overhead -- --lm-gpu [--lm-steps N]
//!                     # transformer_lm's training step on GPU 0, nn's composed ops and CUDA
//!                     # kernels (`RESULT-LM-GPU` lines; read by pytorch_lm_bench.py --gpu)
//!
//! Model: MLP 784-1024-1024-10 (ReLU; `accelerate_rs::nn` layers), f32, batch 64 per process,
//! cross-entropy, on synthetic random data generated from a fixed seed (identical in every variant and process). With
//! `--model transformer`, section 1 times `examples/transformer_lm`'s model instead (vocab 8000,
//! d_model 256, 8 heads, 4 layers, ReLU MLP 1024 wide as in the and PyTorch's
//! `nn.TransformerEncoderLayer`, sequences of 128 tokens, batch 8, random token ids). Section 1
//! steps with SGD (lr 0.01), section 2 with AdamW (lr 1e-3, accelerate-rs's fused one).
//!
//! 1. **Wrapper overhead at world size 1**: the same training step as a plain Candle loop and
//!    through accelerate-rs (`Accelerator::builder().build()`, `prepare`, `backward_step`), timed
//!    in alternating blocks so that drift (thermal, other load) hits every variant alike. With
//!    `--gpu` the plain loops run on accelerate-rs's device for GPU 0 and, as a fourth variant, on
//!    a `Device::new_cuda(0)` of their own (Candle as most users write it).
//! 2. **2-process DDP throughput**: the bench re-executes itself as the workers of a 1-process and
//!    a 2-process run (`RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`/`ACCELERATE_RS_SECRET`, one
//!    Rayon thread each, a free port picked per run); rank 0 prints `RESULT ...` on stdout.

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_rs::{nn, Accelerator, DataLoader, TensorDataset};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{loss, Optimizer, VarBuilder, VarMap, SGD};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `--lm-gpu`.
#[path = "overhead/lm_gpu.rs"]
mod lm_gpu;

/// The transformer of `examples/transformer_lm` (section 1 with `--model transformer`).
#[allow(dead_code)]
#[path = "../examples/transformer_lm/model.rs"]
mod lm;

const INPUT: usize = 784;
const HIDDEN: usize = 1024;
const CLASSES: usize = 10;
const BATCH: usize = 64;
const LR: f64 = 0.01;
/// Section 2's AdamW learning rate (the workload: AdamW with Candle's other defaults).
const ADAMW_LR: f64 = 1e-3;
const DATA_SEED: u64 = 0x5eed;
const WEIGHT_SEED: u64 = 0x3e16;
/// Timed all-reduces of a gradient-sized buffer per DDP worker run.
const ALLREDUCE_REPS: usize = 10;

/// Section 1's model: the MLP (the default) or `--model transformer`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Workload {
    Mlp,
    Transformer,
}

/// The transformer workload's shape (the Transformer LM).
const LM_VOCAB: usize = 8000;
const LM_SEQ: usize = 128;
const LM_BATCH: usize = 8;

impl Workload {
    fn batch(self) -> usize {
        match self {
            Workload::Mlp => BATCH,
            Workload::Transformer => LM_BATCH,
        }
    }

    fn describe(self) -> String {
        match self {
            Workload::Mlp => format!(
                "MLP {INPUT}-{HIDDEN}-{HIDDEN}-{CLASSES} (ReLU), f32, batch {BATCH}/process"
            ),
            Workload::Transformer => format!(
                "transformer_lm (vocab {LM_VOCAB}, d_model 256, 8 heads, 4 layers, ReLU, seq {LM_SEQ}), f32, batch {LM_BATCH}/process"
            ),
        }
    }
}

/// Set in the children: the role the process plays.
const ROLE_ENV: &str = "ACCELERATE_RS_BENCH_OVERHEAD_ROLE";
const ROLE_WORKER: &str = "ddp-worker";

/// How much to measure.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Untimed steps per variant before the first timed block.
    warmup: usize,
    /// Timed steps per block.
    steps: usize,
    /// Timed blocks per variant (section 1).
    rounds: usize,
    /// Timed steps per worker run (section 2).
    ddp_steps: usize,
    /// Runs per world size (section 2).
    ddp_runs: usize,
}

impl Plan {
    /// Timed steps per worker run: a transformer step takes about 25x an MLP step.
    fn ddp_steps_for(self, workload: Workload) -> usize {
        match workload {
            Workload::Mlp => self.ddp_steps,
            Workload::Transformer => (self.ddp_steps / 5).max(5),
        }
    }

    /// Untimed steps per worker run.
    fn warmup_for(self, workload: Workload) -> usize {
        match workload {
            Workload::Mlp => self.warmup,
            Workload::Transformer => self.warmup.min(5),
        }
    }

    fn new(quick: bool) -> Self {
        if quick {
            Plan {
                warmup: 3,
                steps: 10,
                rounds: 2,
                ddp_steps: 20,
                ddp_runs: 1,
            }
        } else {
            Plan {
                warmup: 15,
                steps: 20,
                rounds: 16,
                ddp_steps: 100,
                ddp_runs: 3,
            }
        }
    }
}

fn main() -> Result<()> {
    // Cargo passes `--bench` (and maybe a filter); only `--quick` means something here.
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    // `--gpu`: section 1 on GPU 0 (needs a build with `--features cuda`); section 2 is skipped.
    let gpu = std::env::args().skip(1).any(|a| a == "--gpu");
    let ddp_only = std::env::args().skip(1).any(|a| a == "--ddp-only");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workload = match args.iter().position(|a| a == "--model") {
        None => Workload::Mlp,
        Some(i) => match args.get(i + 1).map(String::as_str) {
            Some("mlp") => Workload::Mlp,
            Some("transformer") => Workload::Transformer,
            other => bail!("--model {other:?}: expected mlp or transformer"),
        },
    };
    let mut plan = Plan::new(quick);
    // `--ddp-runs N`: section 2's runs per world size (scripts alternate their own rounds).
    if let Some(i) = args.iter().position(|a| a == "--ddp-runs") {
        plan.ddp_runs = match args.get(i + 1).map(|v| v.parse::<usize>()) {
            Some(Ok(n)) if n > 0 => n,
            _ => bail!("--ddp-runs needs a positive number of runs"),
        };
    }
    if std::env::var(ROLE_ENV).as_deref() == Ok(ROLE_WORKER) {
        return worker(plan, workload);
    }
    if args.iter().any(|a| a == "--lm-gpu") {
        let steps = match args.iter().position(|a| a == "--lm-steps") {
            None => 50,
            Some(i) => match args.get(i + 1).map(|v| v.parse::<usize>()) {
                Some(Ok(n)) if n > 0 => n,
                _ => bail!("--lm-steps needs a positive number of steps"),
            },
        };
        // `--lm-on-cpu`: the same loop on the CPU, to check the harness without a GPU.
        return lm_gpu::lm_gpu(steps, args.iter().any(|a| a == "--lm-on-cpu"));
    }
    if ddp_only {
        println!("load average before: {}", load_average());
        ddp_throughput(plan, workload)?;
        println!("load average after: {}", load_average());
        return Ok(());
    }
    println!(
        "accelerate-rs overhead bench: {}, SGD lr {LR}, synthetic data{}",
        workload.describe(),
        if quick { " (--quick)" } else { "" }
    );
    println!(
        "warm-up {} steps, {} timed blocks of {} steps per variant",
        plan.warmup, plan.rounds, plan.steps
    );
    println!("load average before: {}", load_average());
    println!();
    let device = if gpu {
        // The process's one device (and stream) for GPU 0: the Accelerator built below gets this
        // very device, so the raw and wrapped variants compute on the same GPU stream with no
        // device-to-device copies between them.
        accelerate_rs::gpu::device(0)?
    } else {
        Device::Cpu
    };
    wrapper_overhead(plan, &device, workload)?;
    if !gpu && workload == Workload::Mlp {
        println!();
        ddp_throughput(plan, Workload::Mlp)?;
    }
    println!();
    println!("load average after: {}", load_average());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Model and data

/// The MLP with `accelerate_rs::nn`'s layers (an import change from `candle_nn`'s: the same
/// constructors, variables and results; one fused op per layer and a one-pass ReLU backward).
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
    fc3: nn::Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Mlp {
            fc1: nn::linear(INPUT, HIDDEN, vb.pp("fc1"))?,
            fc2: nn::linear(HIDDEN, HIDDEN, vb.pp("fc2"))?,
            fc3: nn::linear(HIDDEN, CLASSES, vb.pp("fc3"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let xs = nn::relu(&self.fc1.forward(xs)?)?;
        let xs = nn::relu(&self.fc2.forward(&xs)?)?;
        self.fc3.forward(&xs)
    }
}

/// The transformer as a `Module` from token ids `[B, T]` to logits `[B, T, vocab]`.
struct Lm(lm::TransformerLm);

impl Module for Lm {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(ids)
    }
}

/// A workload's model with the training loss as its user writes it with accelerate-rs (section
/// 2): `accelerate_rs::nn::cross_entropy` for the MLP; the transformer's output layer and cross-entropy
/// fused by `accelerate_rs::nn::linear_cross_entropy`.
trait Trainable: Module {
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor>;
}

impl Trainable for Mlp {
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        nn::cross_entropy(&self.forward(x)?, y)
    }
}

impl Trainable for Lm {
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        self.0.loss(x, y)
    }
}

/// One training step's loss: cross-entropy of the logits (rows of the last dimension) against
/// the (flattened) targets, in plain Candle.
fn step_loss(model: &dyn Module, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let logits = model.forward(x)?;
    let logits = match logits.rank() {
        3 => logits.flatten_to(1)?,
        _ => logits,
    };
    loss::cross_entropy(&logits, &y.flatten_all()?)
}

/// The workload's model with deterministic weights.
fn build_workload(workload: Workload, device: &Device) -> Result<(VarMap, Box<dyn Trainable>)> {
    match workload {
        Workload::Mlp => {
            let (varmap, model) = build_model(device)?;
            Ok((varmap, Box::new(model)))
        }
        Workload::Transformer => {
            let varmap = VarMap::new();
            let cfg = lm::Config {
                vocab_size: LM_VOCAB,
                seq_len: LM_SEQ,
                d_model: 256,
                heads: 8,
                layers: 4,
                tie_weights: false,
                activation: lm::Activation::Relu,
            };
            let model =
                lm::TransformerLm::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, device))?;
            init_deterministic(&varmap, device)?;
            Ok((varmap, Box::new(Lm(model))))
        }
    }
}

/// A model with deterministic weights (the same in every variant and process).
fn build_model(device: &Device) -> Result<(VarMap, Mlp)> {
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    init_deterministic(&varmap, device)?;
    Ok((varmap, model))
}

/// Sets every variable of `varmap` (in name order) from a fixed seed, uniform in
/// ±1/sqrt(fan-in).
fn init_deterministic(varmap: &VarMap, device: &Device) -> Result<()> {
    let mut vars: Vec<_> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow!("VarMap lock poisoned"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = ChaCha8Rng::seed_from_u64(WEIGHT_SEED);
    for (_, var) in vars {
        let fan_in = *var.dims().last().unwrap_or(&1);
        let bound = 1.0 / (fan_in as f32).sqrt();
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        var.set(&Tensor::from_vec(values, var.shape(), device)?)?;
    }
    Ok(())
}

/// Section 1's data: `samples` examples of the workload from a fixed seed.
fn workload_data(workload: Workload, samples: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    match workload {
        Workload::Mlp => synthetic_data(samples, device),
        Workload::Transformer => {
            let mut rng = ChaCha8Rng::seed_from_u64(DATA_SEED);
            let mut ids = |n: usize| -> Vec<u32> {
                (0..n)
                    .map(|_| rng.random_range(0..LM_VOCAB as u32))
                    .collect()
            };
            let x = ids(samples * LM_SEQ);
            let y = ids(samples * LM_SEQ);
            Ok((
                Tensor::from_vec(x, (samples, LM_SEQ), device)?,
                Tensor::from_vec(y, (samples, LM_SEQ), device)?,
            ))
        }
    }
}

/// `samples` random inputs in [-1, 1) and labels in 0..10, from a fixed seed.
fn synthetic_data(samples: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(DATA_SEED);
    let x: Vec<f32> = (0..samples * INPUT)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let y: Vec<u32> = (0..samples)
        .map(|_| rng.random_range(0..CLASSES as u32))
        .collect();
    Ok((
        Tensor::from_vec(x, (samples, INPUT), device)?,
        Tensor::from_vec(y, samples, device)?,
    ))
}

fn loader_of(x: &Tensor, y: &Tensor, batch: usize) -> Result<DataLoader> {
    Ok(
        DataLoader::new(TensorDataset::new(vec![x.clone(), y.clone()])?, batch)
            .shuffle(true)
            .seed(DATA_SEED)
            // Batches on the data's device (a loader's default is the CPU).
            .device(x.device()),
    )
}

// ---------------------------------------------------------------------------------------------
// Statistics

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `/proc/loadavg`'s first three fields (other work on the machine skews every number here).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// 1. Wrapper overhead at world size 1

/// One way of running the training step; `run` does `n` steps and returns their times in ms.
trait Variant {
    fn name(&self) -> &'static str;
    fn run(&mut self, n: usize) -> Result<Vec<f64>>;
}

/// Plain Candle: `candle_nn::SGD`, batches pre-sliced from the data (no DataLoader).
struct RawSliced {
    name: &'static str,
    model: Box<dyn Trainable>,
    opt: SGD,
    batches: Vec<(Tensor, Tensor)>,
    next: usize,
}

impl Variant for RawSliced {
    fn name(&self) -> &'static str {
        self.name
    }
    fn run(&mut self, n: usize) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let start = Instant::now();
            let (x, y) = &self.batches[self.next % self.batches.len()];
            self.next += 1;
            let loss = step_loss(self.model.as_ref(), x, y)?;
            self.opt.backward_step(&loss)?;
            loss.device().synchronize()?;
            times.push(ms(start.elapsed()));
        }
        Ok(times)
    }
}

/// The times of up to `n` steps over `loader` (then its next epoch is set): each the loss of
/// `model` on a batch and `step` on it (the backward pass and the update).
fn timed_epoch(
    loader: &mut DataLoader,
    model: &dyn Trainable,
    n: usize,
    mut step: impl FnMut(&Tensor) -> Result<()>,
) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(n);
    let mut start = Instant::now();
    for batch in loader.iter()?.take(n) {
        let batch = batch?;
        let loss = step_loss(model, &batch[0], &batch[1])?;
        step(&loss)?;
        loss.device().synchronize()?;
        let now = Instant::now();
        times.push(ms(now - start));
        start = now;
    }
    loader.set_epoch(loader.epoch() + 1);
    Ok(times)
}

/// Plain Candle: `candle_nn::SGD` over an unprepared accelerate-rs DataLoader (as in
/// `examples/digits_plain`).
struct RawLoader {
    model: Box<dyn Trainable>,
    opt: SGD,
    loader: DataLoader,
}

impl Variant for RawLoader {
    fn name(&self) -> &'static str {
        "candle, DataLoader"
    }
    fn run(&mut self, n: usize) -> Result<Vec<f64>> {
        let opt = &mut self.opt;
        timed_epoch(&mut self.loader, self.model.as_ref(), n, |loss| {
            Ok(opt.backward_step(loss)?)
        })
    }
}

/// accelerate-rs: `Accelerator`, `prepare`, `AcceleratedOptimizer::backward_step`.
struct Accelerated {
    _accelerator: Accelerator,
    model: Box<dyn Trainable>,
    opt: accelerate_rs::AcceleratedOptimizer<SGD>,
    loader: DataLoader,
}

impl Variant for Accelerated {
    fn name(&self) -> &'static str {
        "accelerate-rs (prepare + backward_step)"
    }
    fn run(&mut self, n: usize) -> Result<Vec<f64>> {
        let opt = &mut self.opt;
        timed_epoch(&mut self.loader, self.model.as_ref(), n, |loss| {
            Ok(opt.backward_step(loss)?)
        })
    }
}

fn wrapper_overhead(plan: Plan, device: &Device, workload: Workload) -> Result<()> {
    let batch = workload.batch();
    let device = device.clone();
    // One epoch covers the longest block, so a block never straddles two epochs.
    let samples = batch * plan.steps.max(plan.warmup);
    let (x, y) = workload_data(workload, samples, &device)?;

    let sliced = |name: &'static str, device: &Device| -> Result<RawSliced> {
        let (varmap, model) = build_workload(workload, device)?;
        let opt = SGD::new(varmap.all_vars(), LR)?;
        let (x, y) = (x.to_device(device)?, y.to_device(device)?);
        let batches = (0..samples / batch)
            .map(|i| {
                Ok((
                    x.narrow(0, i * batch, batch)?,
                    y.narrow(0, i * batch, batch)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RawSliced {
            name,
            model,
            opt,
            batches,
            next: 0,
        })
    };
    let raw_sliced = sliced("candle, pre-sliced batches", &device)?;
    let raw_loader = {
        let (varmap, model) = build_workload(workload, &device)?;
        let opt = SGD::new(varmap.all_vars(), LR)?;
        RawLoader {
            model,
            opt,
            loader: loader_of(&x, &y, batch)?,
        }
    };
    let accelerated = {
        let accelerator = Accelerator::builder().build()?;
        if accelerator.world_size() != 1 {
            bail!(
                "section 1 needs world size 1, the environment says {} (unset RANK/WORLD_SIZE)",
                accelerator.world_size()
            );
        }
        let (varmap, model) = build_workload(workload, accelerator.device())?;
        let opt = SGD::new(varmap.all_vars(), LR)?;
        let (opt, loader) = accelerator.prepare(&varmap, opt, loader_of(&x, &y, batch)?)?;
        Accelerated {
            _accelerator: accelerator,
            model,
            opt,
            loader,
        }
    };
    let mut variants: Vec<Box<dyn Variant>> = vec![
        Box::new(raw_sliced),
        Box::new(raw_loader),
        Box::new(accelerated),
    ];
    // On a GPU, also plain Candle as most users write it: `Device::new_cuda(0)` (the per-thread
    // default stream, no cross-stream event tracking), pre-sliced batches. The variants above
    // share accelerate-rs's device (its own stream, event tracking off), so this is the baseline
    // that shows what that device costs or saves.
    if device.is_cuda() {
        let own = Device::new_cuda(0)?;
        variants.push(Box::new(sliced(
            "candle, Device::new_cuda(0), pre-sliced",
            &own,
        )?));
    }

    for v in variants.iter_mut() {
        v.run(plan.warmup)?;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut block_means: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    for round in 0..plan.rounds {
        // Rotate the order so that no variant always runs first or last.
        for k in 0..variants.len() {
            let i = (round + k) % variants.len();
            let t = variants[i].run(plan.steps)?;
            block_means[i].push(mean(&t));
            times[i].extend(t);
        }
    }

    println!(
        "## 1. Wrapper overhead, world size 1 (this process, {} Rayon threads)",
        candle_core::utils::get_num_threads()
    );
    println!();
    println!(
        "| variant | steps | ms/step mean | ms/step median | block means min..max | vs candle+DataLoader (mean / median) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let (base_mean, base_median) = (mean(&times[1]), median(&times[1]));
    for (i, v) in variants.iter().enumerate() {
        let (m, md) = (mean(&times[i]), median(&times[i]));
        let lo = block_means[i].iter().copied().fold(f64::INFINITY, f64::min);
        let hi = block_means[i].iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {} | {m:.2} | {md:.2} | {lo:.2}..{hi:.2} | {:+.2}% / {:+.2}% |",
            v.name(),
            times[i].len(),
            (m / base_mean - 1.0) * 100.0,
            (md / base_median - 1.0) * 100.0,
        );
    }
    let (acc_mean, acc_median) = (mean(&times[2]), median(&times[2]));
    let (sl_mean, sl_median) = (mean(&times[0]), median(&times[0]));
    println!();
    println!(
        "overhead of accelerate-rs vs the same loop in plain Candle (both with DataLoader): {:+.2}% (mean), {:+.2}% (median)",
        (acc_mean / base_mean - 1.0) * 100.0,
        (acc_median / base_median - 1.0) * 100.0
    );
    println!(
        "overhead of accelerate-rs vs plain Candle with pre-sliced batches: {:+.2}% (mean), {:+.2}% (median)",
        (acc_mean / sl_mean - 1.0) * 100.0,
        (acc_median / sl_median - 1.0) * 100.0
    );
    // Paired per round (the blocks of one round ran back to back), so slow drift cancels.
    let paired = |base: usize| -> Vec<f64> {
        block_means[2]
            .iter()
            .zip(&block_means[base])
            .map(|(a, b)| (a / b - 1.0) * 100.0)
            .collect()
    };
    if variants.len() > 3 {
        let (nc_mean, nc_median) = (mean(&times[3]), median(&times[3]));
        println!(
            "overhead of accelerate-rs vs plain Candle on Device::new_cuda(0), pre-sliced: {:+.2}% (mean), {:+.2}% (median); paired per round {:+.2}%",
            (acc_mean / nc_mean - 1.0) * 100.0,
            (acc_median / nc_median - 1.0) * 100.0,
            median(&paired(3))
        );
    }
    let (vs_loader, vs_sliced) = (paired(1), paired(0));
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:+.1}%..{hi:+.1}%")
    };
    println!(
        "paired per round (median of {} block-mean ratios): vs candle+DataLoader {:+.2}% (rounds {}), vs pre-sliced {:+.2}% (rounds {})",
        vs_loader.len(),
        median(&vs_loader),
        spread(&vs_loader),
        median(&vs_sliced),
        spread(&vs_sliced)
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. DDP throughput: parent

/// What rank 0 of one run reported.
#[derive(Debug, Clone, Copy)]
struct RunResult {
    mean_ms: f64,
    median_ms: f64,
    /// Mean time of the forward pass, of `backward` (with the gradient all-reduce) and of the
    /// optimizer step.
    forward_ms: f64,
    backward_ms: f64,
    step_ms: f64,
    /// Median time of one all-reduce of all the gradients (0 for one process).
    allreduce_ms: f64,
    grad_elems: f64,
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding an ephemeral port")?;
    Ok(listener.local_addr()?.port())
}

fn random_secret() -> String {
    let mut rng = rand::rng();
    (0..32)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

/// Runs `world` worker processes (this executable, one Rayon thread each) and returns rank 0's
/// result.
fn run_workers(world: usize, quick: bool, workload: Workload) -> Result<RunResult> {
    let exe = std::env::current_exe().context("locating the bench executable")?;
    let port = free_port()?;
    let secret = random_secret();
    let mut children: Vec<Child> = Vec::with_capacity(world);
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        if quick {
            cmd.arg("--quick");
        }
        if workload == Workload::Transformer {
            cmd.args(["--model", "transformer"]);
        }
        cmd.env(ROLE_ENV, ROLE_WORKER)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("ACCELERATE_RS_SECRET", &secret)
            .env("ACCELERATE_RS_TIMEOUT_SECS", "300")
            .env("RAYON_NUM_THREADS", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                kill_all(&mut children);
                return Err(e).context("spawning a worker");
            }
        }
    }
    let mut outputs = Vec::with_capacity(world);
    let mut failure = None;
    for (rank, child) in children.iter_mut().enumerate() {
        let mut out = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout.read_to_string(&mut out)?;
        }
        let status = child.wait()?;
        if !status.success() && failure.is_none() {
            failure = Some(format!(
                "worker rank {rank} of {world} exited with {status}"
            ));
        }
        outputs.push(out);
    }
    if let Some(f) = failure {
        bail!("{f}");
    }
    parse_result(&outputs[0]).with_context(|| format!("rank 0 printed: {:?}", outputs[0]))
}

fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn parse_result(stdout: &str) -> Result<RunResult> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .ok_or_else(|| anyhow!("no RESULT line"))?;
    let field = |key: &str| -> Result<f64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .ok_or_else(|| anyhow!("no {key} in {line:?}"))?
            .parse::<f64>()
            .with_context(|| format!("parsing {key} in {line:?}"))
    };
    Ok(RunResult {
        mean_ms: field("ms_per_step")?,
        median_ms: field("median_ms")?,
        forward_ms: field("forward_ms")?,
        backward_ms: field("backward_ms")?,
        step_ms: field("step_ms")?,
        allreduce_ms: field("allreduce_ms")?,
        grad_elems: field("grad_elems")?,
    })
}

fn ddp_only() -> bool {
    std::env::args().skip(1).any(|a| a == "--ddp-only")
}

/// The transport the workers use: `ACCELERATE_RS_TRANSPORT` if set, else the automatic choice.
fn transport_name() -> String {
    std::env::var("ACCELERATE_RS_TRANSPORT").unwrap_or_else(|_| "auto".to_string())
}

fn ddp_throughput(plan: Plan, workload: Workload) -> Result<()> {
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    let worlds = [1usize, 2];
    // Alternate 1- and 2-process runs so that drift hits both alike.
    let mut results: Vec<Vec<RunResult>> = vec![Vec::new(); worlds.len()];
    let runs = plan.ddp_runs;
    for _ in 0..runs {
        for (i, &w) in worlds.iter().enumerate() {
            results[i].push(run_workers(w, quick, workload)?);
        }
    }
    println!(
        "## 2. DDP throughput ({}; AdamW{}, separate processes, 1 Rayon thread each, on 127.0.0.1; {runs} run(s) per size, {} timed steps each after {} warm-up)",
        workload.describe(),
        if workload == Workload::Transformer { ", clip 1.0" } else { "" },
        plan.ddp_steps_for(workload),
        plan.warmup_for(workload)
    );
    println!();
    println!(
        "| processes | transport | ms/step mean | ms/step median | samples/s total | scaling efficiency | forward / backward+all-reduce / step, ms | all-reduce alone, ms |"
    );
    println!("|---:|---|---:|---:|---:|---:|---|---:|");
    let avg =
        |rs: &[RunResult], f: fn(&RunResult) -> f64| mean(&rs.iter().map(f).collect::<Vec<_>>());
    let batch = workload.batch();
    let single = batch as f64 * 1e3 / avg(&results[0], |r| r.mean_ms);
    for (&w, rs) in worlds.iter().zip(&results) {
        let m = avg(rs, |r| r.mean_ms);
        let md = median(&rs.iter().map(|r| r.median_ms).collect::<Vec<_>>());
        let sps = (w * batch) as f64 * 1e3 / m;
        let ar = median(&rs.iter().map(|r| r.allreduce_ms).collect::<Vec<_>>());
        let (ar, transport) = if w == 1 {
            ("-".to_string(), "-".to_string())
        } else {
            (format!("{ar:.2}"), transport_name())
        };
        println!(
            "| {w} | {transport} | {m:.2} | {md:.2} | {sps:.0} | {:.1}% | {:.2} / {:.2} / {:.2} | {ar} |",
            sps / (w as f64 * single) * 100.0,
            avg(rs, |r| r.forward_ms),
            avg(rs, |r| r.backward_ms),
            avg(rs, |r| r.step_ms),
        );
        if ddp_only() {
            println!(
                "RESULT-DDP world={w} ms_mean={m:.3} ms_median={md:.3} samples_per_s={sps:.1}"
            );
        }
    }
    println!();
    let elems = results[1].first().map(|r| r.grad_elems).unwrap_or(0.0);
    println!(
        "all-reduce alone: median of {ALLREDUCE_REPS} standalone in-place all_reduce(Mean) calls on {elems:.0} f32 ({:.2} MB, the gradient size), measured after the timed steps",
        elems * 4.0 / 1e6
    );
    println!(
        "samples/s = processes x {batch} / mean step time; efficiency = samples/s(N) / (N x samples/s(1))"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. DDP throughput: worker

fn worker(plan: Plan, workload: Workload) -> Result<()> {
    let accelerator = Accelerator::builder().cpu(true).build()?;
    let world = accelerator.world_size();
    let device = accelerator.device().clone();
    let (timed_steps, warmup) = (plan.ddp_steps_for(workload), plan.warmup_for(workload));
    // Each rank gets exactly `warmup + timed_steps` batches of its own in one epoch.
    let batch_size = workload.batch();
    let samples = world * batch_size * (warmup + timed_steps);
    let (x, y) = workload_data(workload, samples, &device)?;
    let (varmap, model) = build_workload(workload, &device)?;
    let opt = accelerate_rs::optim::AdamW::new_lr(varmap.all_vars(), ADAMW_LR)?;
    let (mut opt, loader) = accelerator.prepare(&varmap, opt, loader_of(&x, &y, batch_size)?)?;
    if workload == Workload::Transformer {
        opt.set_clip_grad_norm(Some(1.0));
    }

    let mut times = Vec::with_capacity(timed_steps);
    let (mut fwd, mut bwd, mut stp) = (Vec::new(), Vec::new(), Vec::new());
    let mut iter = loader.iter()?;
    for step in 0..warmup + timed_steps {
        if step == warmup {
            accelerator.collective().barrier()?;
        }
        let start = Instant::now();
        let batch = iter
            .next()
            .ok_or_else(|| anyhow!("the loader ran out of batches at step {step}"))??;
        // The step as a user of `accelerate_rs::nn` writes it (see `Trainable`).
        let loss = model.loss(&batch[0], &batch[1])?;
        let t1 = Instant::now();
        // `backward_step` split in its two halves, to time them.
        let grads = accelerator.backward(&loss)?;
        let t2 = Instant::now();
        if let Some(grads) = grads {
            opt.step(&grads)?;
        }
        if step >= warmup {
            times.push(ms(start.elapsed()));
            fwd.push(ms(t1 - start));
            bwd.push(ms(t2 - t1));
            stp.push(ms(t2.elapsed()));
        }
    }
    // Where the time goes: the all-reduce alone, in place on a reusable buffer the size of all
    // the gradients (what `backward` reduces each step; they fit one bucket at the default cap).
    let numel: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    let mut flat = vec![0f32; numel];
    let mut reduce_times = Vec::new();
    if world > 1 {
        let c = accelerator.collective();
        c.barrier()?;
        for rep in 0..ALLREDUCE_REPS + 2 {
            let start = Instant::now();
            c.all_reduce((&mut flat[..]).into(), accelerate_rs::ReduceOp::Mean)?;
            if rep >= 2 {
                reduce_times.push(ms(start.elapsed()));
            }
        }
    }
    if accelerator.is_main_process() {
        println!(
            "RESULT world={world} steps={} ms_per_step={:.4} median_ms={:.4} forward_ms={:.4} backward_ms={:.4} step_ms={:.4} allreduce_ms={:.4} grad_elems={numel}",
            times.len(),
            mean(&times),
            median(&times),
            mean(&fwd),
            mean(&bwd),
            mean(&stp),
            if reduce_times.is_empty() { 0.0 } else { median(&reduce_times) },
        );
    }
    accelerator.collective().barrier()?;
    Ok(())
}
