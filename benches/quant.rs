//! The 4-bit linear layer (`nn::Linear4bit`, NF4 with double quantization) against `nn::Linear`
//! over the same weight in f32, both frozen (the input gradient only, as a QLoRA/LoRA base), and
//! with a rank-16 LoRA adapter on each (`Linear4bit::forward_with_lora` against
//! `Lora::forward_with_base`): forward, and forward + backward, milliseconds, timed in
//! alternating blocks in one run; and the bytes each layer's weight holds. Also the time to
//! quantize each weight.
//!
//!     cargo bench --bench quant
//!     cargo bench --bench quant -- --quick
//!     cargo bench --bench quant -- --quick 1024   # only the shapes whose names contain this

use std::time::Instant;

use accelerate_rs::nn::{Linear, Linear4bit, Lora};
use accelerate_rs::quant::{Quant4bitConfig, Weight4bit};
use anyhow::Result;
use candle_core::{Device, Module, Tensor, Var};

type Op = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor>>;

/// Mean milliseconds of forward, and of forward + backward, over `reps` runs.
fn time(op: &Op, x: &Var, reps: usize) -> Result<(f64, f64)> {
    let (mut fwd, mut both) = (0f64, 0f64);
    for _ in 0..reps {
        let t = Instant::now();
        let _y = op(x.as_tensor())?;
        fwd += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let y = op(x.as_tensor())?;
        let _g = y.sum_all()?.backward()?;
        both += t.elapsed().as_secs_f64();
    }
    Ok((fwd * 1e3 / reps as f64, both * 1e3 / reps as f64))
}

/// Times `a` and `b` on `x` in alternating blocks: `((fwd, both) of a, (fwd, both) of b)`.
fn race(a: &Op, b: &Op, x: &Var, reps: usize) -> Result<((f64, f64), (f64, f64))> {
    let blocks = 2;
    let (mut ta, mut tb) = ((0f64, 0f64), (0f64, 0f64));
    // One warm-up run each.
    time(a, x, 1)?;
    time(b, x, 1)?;
    for _ in 0..blocks {
        let (f, w) = time(a, x, reps / blocks)?;
        ta = (ta.0 + f / blocks as f64, ta.1 + w / blocks as f64);
        let (f, w) = time(b, x, reps / blocks)?;
        tb = (tb.0 + f / blocks as f64, tb.1 + w / blocks as f64);
    }
    Ok((ta, tb))
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn main() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let reps = if quick { 4 } else { 20 };
    let dev = Device::Cpu;
    // (rows, in, out): a 1024-wide projection, a Llama-7B-shaped MLP layer (4096 -> 11008) on
    // a short batch, and a 4096 x 4096 projection on one sequence of 512 tokens.
    let shapes = [(512, 1024, 1024), (128, 4096, 11008), (512, 4096, 4096)];
    println!(
        "{:<28} {:>10} {:>10} {:>12} {:>12} {:>10} {:>10} {:>9}",
        "layer (rows x in -> out)",
        "f32 fwd",
        "4bit fwd",
        "f32 fwd+bwd",
        "4bit fwd+bwd",
        "f32 MiB",
        "4bit MiB",
        "quant ms"
    );
    for (rows, k, n) in shapes {
        let name = format!("{rows}x{k}->{n}");
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? * (1.0 / (k as f64).sqrt()))?;
        let t = Instant::now();
        let q = Weight4bit::quantize(&w, &Quant4bitConfig::nf4())?;
        let quant_ms = t.elapsed().as_secs_f64() * 1e3;
        let q4 = Linear4bit::new(q, None)?;
        let (f32_bytes, q_bytes) = (n * k * 4, q4.nbytes());
        let dense = Linear::new(w.detach(), None);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (rows, k), &dev)?)?;
        let a = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (16, k), &dev)? * 0.01)?)?;
        let b = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (n, 16), &dev)? * 0.01)?)?;
        let lora = Lora::from_tensors(a.as_tensor().clone(), b.as_tensor().clone(), 2.0, 0.0)?;
        let (d1, q1) = (dense.clone(), q4.clone());
        let plain: (Op, Op) = (
            Box::new(move |x| d1.forward(x)),
            Box::new(move |x| q1.forward(x)),
        );
        let (l1, l2, wd) = (lora.clone(), lora, dense.weight().clone());
        let with_lora: (Op, Op) = (
            Box::new(move |x| l1.forward_with_base(x, &wd, None, true)),
            Box::new(move |x| q4.forward_with_lora(x, &l2, true)),
        );
        for (label, (f, g)) in [("", plain), (" +LoRA r16", with_lora)] {
            let ((df, db), (qf, qb)) = race(&f, &g, &x, reps)?;
            println!(
                "{:<28} {df:>10.2} {qf:>10.2} {db:>12.2} {qb:>12.2} {:>10.2} {:>10.2} {quant_ms:>9.1}",
                format!("{name}{label}"),
                mib(f32_bytes),
                mib(q_bytes),
            );
        }
    }
    println!("(milliseconds, mean of {reps} runs in alternating blocks; MiB of the weight held)");
    Ok(())
}
