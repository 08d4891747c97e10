//! `estimate-memory`'s prediction next to the measured peak memory of training a Llama-style
//! model built with `accelerate_rs::nn` (`tests/it/common/llama.rs`) on the CPU: each run in a
//! process of its own (this binary again), a few AdamW steps, then two peaks above what the
//! process held before the model existed: the bytes allocated and not yet freed (this binary
//! counts them in its global allocator), and the resident size (`VmHWM`, reset once the process
//! is warm), with glibc told to give large blocks back at once (`MALLOC_MMAP_THRESHOLD_=65536`)
//! so that it measures what the program holds rather than what glibc keeps for reuse.
//!
//!     cargo bench --bench memory                  # the table of BENCHMARKS.md
//!     cargo bench --bench memory -- --quick       # a smaller model
//!     cargo bench --bench memory -- --tuned-malloc # glibc as accelerate-rs tunes it (freed
//!                                                  # blocks kept for reuse: a higher resident peak)
//!
//! Prints one row per run: the prediction (states, activations, total), the measured peaks and
//! the ratio of the prediction to the resident peak, and the tensors the graph held (views
//! counted in full).

#[path = "../tests/it/common/llama.rs"]
#[allow(dead_code)]
mod llama;

use std::alloc::{GlobalAlloc, Layout, System};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use accelerate_rs::memory::{estimate, ModelSpec, Plan};
use accelerate_rs::MixedPrecision;
use anyhow::{bail, Context, Result};
use llama::{LlamaRun, Measured};

const CHILD: &str = "ACCEL_MEMORY_BENCH_RUN";

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

fn mib(b: u64) -> String {
    format!("{:.0}", b as f64 / (1u64 << 20) as f64)
}

fn child(run: &str) -> Result<()> {
    let r = LlamaRun::decode(run).context("bad run")?;
    let base = AtomicU64::new(0);
    let m = llama::train_and_measure(&r, &|| {
        let now = LIVE.load(Relaxed);
        base.store(now, Relaxed);
        PEAK.store(now, Relaxed);
    })?;
    println!("{}", m.line());
    println!("live {}", PEAK.load(Relaxed) - base.load(Relaxed));
    Ok(())
}

fn main() -> Result<()> {
    if let Ok(run) = std::env::var(CHILD) {
        return child(&run);
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let tuned = std::env::args().any(|a| a == "--tuned-malloc");
    let base = if quick {
        LlamaRun {
            hidden: 256,
            intermediate: 688,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            vocab: 4096,
            batch: 2,
            seq: 128,
            checkpoint: false,
            bf16: false,
            steps: 2,
        }
    } else {
        LlamaRun {
            hidden: 512,
            intermediate: 1376,
            layers: 6,
            heads: 8,
            kv_heads: 4,
            vocab: 8192,
            batch: 4,
            seq: 256,
            checkpoint: false,
            bf16: false,
            steps: 3,
        }
    };
    let runs = [
        base,
        LlamaRun {
            checkpoint: true,
            ..base
        },
        LlamaRun {
            seq: base.seq * 2,
            ..base
        },
        LlamaRun {
            seq: base.seq * 2,
            checkpoint: true,
            ..base
        },
        LlamaRun {
            vocab: base.vocab * 4,
            ..base
        },
        LlamaRun { bf16: true, ..base },
        LlamaRun {
            bf16: true,
            checkpoint: true,
            ..base
        },
    ];
    println!(
        "| model | batch x seq | precision | checkpointing | predicted: states | activations | total MiB | measured peak: allocated | resident MiB | predicted / resident | graph tensors MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in runs {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.env(CHILD, r.encode());
        if !tuned {
            cmd.env("MALLOC_MMAP_THRESHOLD_", "65536");
        }
        let out = cmd.output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "run {r:?} failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let m = Measured::parse(&text).context("no measurement")?;
        let live: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("live "))
            .and_then(|v| v.parse().ok())
            .context("no allocation count")?;
        let spec = ModelSpec::from_architecture(r.architecture());
        let plan = Plan {
            precision: if r.bf16 {
                MixedPrecision::Bf16
            } else {
                MixedPrecision::No
            },
            batch_size: r.batch,
            seq_len: r.seq,
            checkpointing: r.checkpoint,
            // The bench model composes its head: Linear, then nn::cross_entropy.
            fused_head: false,
            ..Plan::default()
        };
        let e = estimate(&spec, &plan)?;
        let act = e.activations.map_or(0, |a| a.kept + a.backward);
        let resident = m.peak.saturating_sub(m.baseline);
        println!(
            "| llama h{} i{} L{} heads {}/{} vocab {} ({:.1} M params) | {} x {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {} |",
            r.hidden,
            r.intermediate,
            r.layers,
            r.heads,
            r.kv_heads,
            r.vocab,
            spec.parameter_count() as f64 / 1e6,
            r.batch,
            r.seq,
            if r.bf16 { "bf16 mixed" } else { "fp32" },
            if r.checkpoint { "on" } else { "off" },
            mib(e.states()),
            mib(act),
            mib(e.total()),
            mib(live),
            mib(resident),
            e.total() as f64 / resident as f64,
            mib(m.graph),
        );
    }
    Ok(())
}
