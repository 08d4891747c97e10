//! Causal self-attention at growing context lengths on the CPU: `nn::flash_attention` (tiled,
//! memory linear in T) against `nn::scaled_dot_product_attention` (one fused op that keeps the
//! `heads × T × T` attention weights) and Candle's composed ops (`softmax(q kᵀ · scale + mask) v`,
//! what a model without `accelerate_rs::nn` runs). Batch 1, 4 heads of 64, f32.
//!
//! Each point (op, T) runs in a process of its own (this binary again): the inputs are made,
//! then one warm-up forward + backward, then the timed runs; the peak memory is the most bytes
//! allocated at once above what the process held with its inputs (a counting global
//! allocator), and the resident peak (`VmHWM`, reset after the inputs exist) with glibc told to
//! give large blocks back at once (`MALLOC_MMAP_THRESHOLD_=65536`), so both measure what the op
//! holds, not what glibc keeps.
//!
//!     cargo bench --bench attention                     # T = 512 .. 8192
//!     cargo bench --bench attention -- --quick          # T = 512 .. 2048, fewer runs
//!     cargo bench --bench attention -- --max-composed 4096  # skip composed above 4096

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use accelerate_rs::nn::{
    flash_attention, scaled_dot_product_attention, AttentionOptions, FlashAttentionOptions,
};
use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var, D};

const CHILD: &str = "ACCEL_ATTENTION_BENCH_RUN";
const HEADS: usize = 4;
const HEAD_DIM: usize = 64;

/// The system allocator, counting the bytes live and their peak.
struct Counting;
static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call forwards to the system allocator with the caller's arguments unchanged;
// the counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on as is.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size() as u64, Relaxed) + l.size() as u64;
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as u64, Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The resident peak of this process (`VmHWM`), in bytes.
fn resident_peak() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The composed attention: Candle's ops, causal mask as `-inf`.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
    let t = q.dim(2)?;
    let scores = (q.matmul(&k.t()?)? / (HEAD_DIM as f64).sqrt())?;
    let pos = Tensor::arange(0u32, t as u32, q.device())?;
    let visible = pos
        .reshape((1, t))?
        .broadcast_le(&pos.reshape((t, 1))?)?
        .broadcast_as(scores.shape())?;
    let neg = Tensor::full(f32::NEG_INFINITY, scores.shape(), q.device())?;
    let p = candle_nn::ops::softmax(&visible.where_cond(&scores, &neg)?, D::Minus1)?;
    p.matmul(v)
}

fn run_op(op: &str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    Ok(match op {
        "flash" => flash_attention(q, k, v, &FlashAttentionOptions::default().causal(true))?,
        "fused" => {
            scaled_dot_product_attention(q, k, v, &AttentionOptions::default().causal(true))?
        }
        "composed" => composed(q, k, v)?,
        other => bail!("unknown op {other}"),
    })
}

/// One point in this process: prints `fwd_ms both_ms peak_bytes resident_bytes`.
fn child(spec: &str) -> Result<()> {
    let (op, rest) = spec.split_once(':').context("spec op:t:reps")?;
    let (t, reps) = rest.split_once(':').context("spec op:t:reps")?;
    let (t, reps): (usize, usize) = (t.parse()?, reps.parse()?);
    let dev = Device::Cpu;
    let shape = (1, HEADS, t, HEAD_DIM);
    let var = || -> Result<Var> { Ok(Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev)?)?) };
    let (q, k, v) = (var()?, var()?, var()?);
    let w = Tensor::randn(0f32, 1.0, shape, &dev)?;
    let step = || -> Result<()> {
        let y = run_op(op, q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let grads = (y * &w)?.sum_all()?.backward()?;
        anyhow::ensure!(grads.get(q.as_tensor()).is_some(), "no gradient");
        Ok(())
    };
    // The memory of one forward + backward, above the inputs.
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    // Reset the resident peak to the current resident size.
    std::fs::write("/proc/self/clear_refs", "5").ok();
    let rss0 = resident_peak();
    step()?;
    let peak = PEAK.load(Relaxed) - base;
    let resident = resident_peak().saturating_sub(rss0);
    let mut fwd = 0f64;
    let mut both = 0f64;
    for _ in 0..reps {
        let t0 = Instant::now();
        drop(run_op(op, q.as_tensor(), k.as_tensor(), v.as_tensor())?);
        fwd += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        step()?;
        both += t0.elapsed().as_secs_f64();
    }
    let ms = |s: f64| s * 1e3 / reps as f64;
    println!("{} {} {peak} {resident}", ms(fwd), ms(both));
    Ok(())
}

fn main() -> Result<()> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let max_composed = args
        .iter()
        .position(|a| a == "--max-composed")
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse::<usize>())
        .transpose()?
        .unwrap_or(usize::MAX);
    let lengths: &[usize] = if quick {
        &[512, 1024, 2048]
    } else {
        &[512, 1024, 2048, 4096, 8192]
    };
    println!(
        "causal self-attention, batch 1, {HEADS} heads of {HEAD_DIM}, f32, forward + backward; \
         peak = most bytes allocated at once above the inputs (resident peak in brackets)"
    );
    println!(
        "| T | flash fwd ms | flash fwd+bwd ms | flash peak MiB | fused fwd ms | fused fwd+bwd ms | fused peak MiB | composed fwd ms | composed fwd+bwd ms | composed peak MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &t in lengths {
        let reps = match (quick, t) {
            (true, _) => 2,
            (_, t) if t <= 1024 => 10,
            (_, t) if t <= 2048 => 5,
            _ => 3,
        };
        let mut row = format!("| {t} |");
        for op in ["flash", "fused", "composed"] {
            if op == "composed" && t > max_composed {
                row.push_str(" (skipped) | | |");
                continue;
            }
            let out = Command::new(std::env::current_exe()?)
                .env(CHILD, format!("{op}:{t}:{reps}"))
                .env("MALLOC_MMAP_THRESHOLD_", "65536")
                .output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                bail!(
                    "{op} at T = {t} failed: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let v: Vec<f64> = text
                .split_whitespace()
                .map(|x| x.parse())
                .collect::<Result<_, _>>()
                .context("bad child output")?;
            let mib = |b: f64| b / (1u64 << 20) as f64;
            row.push_str(&format!(
                " {:.1} | {:.1} | {:.1} ({:.0}) |",
                v[0],
                v[1],
                mib(v[2]),
                mib(v[3])
            ));
        }
        println!("{row}");
    }
    Ok(())
}
