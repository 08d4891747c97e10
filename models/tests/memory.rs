//! `estimate-memory`'s prediction (`accelerate_rs::memory::estimate`) against the measured peak
//! of training `LlamaForCausalLm` on the CPU with LoRA adapters (r = 8 on every linear layer of
//! the blocks, `all-linear`; the base frozen), with and without activation checkpointing, and of full
//! fine-tuning: within 20%. Each run is a process of its own (this test binary again, restricted
//! to [`worker_entry`]); what is measured is its peak resident set (`VmHWM`) above what it held
//! before the model existed, with glibc giving large blocks back at once
//! (`MALLOC_MMAP_THRESHOLD_=65536`: the prediction does not count what an allocator keeps for
//! reuse). `memory_bench` prints the same comparison at larger sizes (BENCHMARKS.md).

use std::path::Path;
use std::process::{Command, Stdio};

use accelerate_rs::memory::{estimate, Lora, ModelSpec, Plan};
use accelerate_rs::nn::LoraConfig;
use accelerate_rs::optim::AdamW;
use accelerate_rs::Accelerator;
use accelerate_rs_models::{LlamaConfig, LlamaForCausalLm};
use candle_core::{DType, Device, Tensor};

const RUN_VAR: &str = "ACCEL_MODELS_MEMORY_RUN";
const R: usize = 8;
const BATCH: usize = 2;
const SEQ: usize = 256;

fn config_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQ,
        "tie_word_embeddings": false,
    })
}

/// A line of `/proc/self/status` (`VmHWM:`, `VmRSS:`), in bytes.
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// Two training steps of the configuration `lora` / `ckpt` in this process; prints
/// `MEASURED start peak`.
fn train(lora: bool, ckpt: bool) -> accelerate_rs::Result<()> {
    let acc = Accelerator::builder()
        .rank(0)
        .world_size(1)
        .cpu(true)
        .build()?;
    // The process itself, which the estimate does not count: the thread pool and the matrix
    // product's packing buffers exist before the model does.
    let w = candle_core::Var::new(&[[0.5f32; 256]; 256], &Device::Cpu)?;
    let x = Tensor::ones((BATCH * SEQ, 256), DType::F32, &Device::Cpu)?;
    x.matmul(w.as_tensor())?.sum_all()?.backward()?;
    drop((w, x));
    let start = status_bytes("VmRSS:");
    let config = LlamaConfig::from_json(Path::new("<memory test>"), &config_json())?;
    let mut model = LlamaForCausalLm::from_config(&config, &Device::Cpu, DType::F32)?;
    if lora {
        model.add_lora(&LoraConfig::new(R, 2.0 * R as f64).all_linear().seed(1))?;
    }
    model.set_gradient_checkpointing(ckpt);
    model.train(true);
    let trainable = model.trainable_parameters();
    acc.prepare_model(trainable)?;
    let mut opt = acc.prepare_optimizer(AdamW::new_lr(trainable.all_vars(), 1e-4)?);
    for step in 0..2u32 {
        let ids: Vec<u32> = (0..(BATCH * SEQ) as u32)
            .map(|i| (i * 7919 + step * 31) % 4096)
            .collect();
        let ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu)?;
        let labels = ids.to_dtype(DType::I64)?;
        opt.backward_step(&model.loss(&ids, &labels)?)?;
    }
    println!("MEASURED {start} {}", status_bytes("VmHWM:"));
    Ok(())
}

/// The peak above the start, measured in a process of its own.
fn measure(lora: bool, ckpt: bool) -> f64 {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "worker_entry", "--nocapture", "--test-threads=1"])
        .env(RUN_VAR, format!("{lora} {ckpt}"))
        .env("MALLOC_MMAP_THRESHOLD_", "65536")
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let line = text
        .lines()
        .find_map(|l| l.split_once("MEASURED ").map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no measurement in:\n{text}"));
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    v[1].saturating_sub(v[0]) as f64
}

#[test]
fn lora_and_checkpointing_peaks_are_within_20_percent_of_the_estimate() {
    let spec = ModelSpec::from_architecture(
        LlamaForCausalLm::memory_architecture(
            &LlamaConfig::from_json(Path::new("<memory test>"), &config_json()).unwrap(),
        )
        .unwrap(),
    );
    let mut report = Vec::new();
    for (lora, ckpt) in [(true, false), (true, true), (false, false)] {
        let plan = Plan {
            lora: lora.then(|| Lora {
                r: R,
                targets: vec!["all-linear".into()],
            }),
            batch_size: BATCH,
            seq_len: SEQ,
            checkpointing: ckpt,
            // The models' `loss` is the fused output layer + cross-entropy.
            fused_head: true,
            ..Plan::default()
        };
        let predicted = estimate(&spec, &plan).unwrap().total() as f64;
        let measured = measure(lora, ckpt);
        report.push(format!(
            "lora {lora} ckpt {ckpt}: predicted {:.1} MiB, measured {:.1} MiB ({:.2})",
            predicted / 1048576.0,
            measured / 1048576.0,
            predicted / measured
        ));
        println!("{}", report.last().unwrap());
        assert!((0.8..=1.2).contains(&(predicted / measured)), "{report:#?}");
    }
}

/// Entry point of the measuring processes; does nothing in a normal test run.
#[test]
fn worker_entry() {
    let Ok(run) = std::env::var(RUN_VAR) else {
        return;
    };
    let mut words = run.split_whitespace().map(|w| w == "true");
    let (lora, ckpt) = (words.next().unwrap(), words.next().unwrap());
    if let Err(e) = train(lora, ckpt) {
        eprintln!("Error: {e}");
        std::process::exit(1);
    }
}
