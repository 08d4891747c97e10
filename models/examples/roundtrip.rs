//! Writes, for every architecture's test fixture, a folder saved by accelerate-rs after three
//! AdamW steps (so the weights are this crate's, not the fixture's), with `probe.safetensors`
//! beside the weights: inputs and the logits accelerate-rs computes for them. Then
//! `scripts/hf_reference.py check` loads each folder in `transformers` and compares.
//!
//!     cargo run -p accelerate-rs-models --example roundtrip -- /tmp/roundtrip
//!     python scripts/hf_reference.py check /tmp/roundtrip/*
//!
//! The Llama folder is written in shards of 8 KiB (a `model.safetensors.index.json` for
//! `transformers` to follow).

use std::collections::HashMap;
use std::path::PathBuf;

use accelerate_rs::optim::{AdamW, ParamsAdamW};
use accelerate_rs_models::AutoModel;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;

const ARCHS: &[&str] = &[
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "gpt2",
    "bert_mlm",
    "bert_cls",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "phi3",
];

#[derive(clap::Parser)]
#[command(
    about = "Save every fixture architecture after 3 AdamW steps, with a probe for transformers"
)]
struct Args {
    /// The folder to write the model folders into (created; must be new or empty).
    out: PathBuf,
}

fn main() -> Result<()> {
    let out = <Args as clap::Parser>::parse().out;
    accelerate_rs::checkpoint::check_output_dir(&out, &[], false)?;
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for name in ARCHS {
        let dir = fixtures.join(name);
        let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
            .with_context(|| format!("{}", dir.display()))?;
        let get = |k: &str| -> Result<&Tensor> {
            golden
                .get(k)
                .with_context(|| format!("{name}: no `{k}` in golden.safetensors"))
        };
        let (ids, mask, labels) = (get("input_ids")?, get("attention_mask")?, get("labels")?);
        let mut model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32)?;
        model.train(true);
        let params = ParamsAdamW {
            lr: 1e-2,
            ..Default::default()
        };
        let mut opt = AdamW::new(model.varmap().all_vars(), params)?;
        for _ in 0..3 {
            let loss = model.loss_with_mask(ids, Some(mask), labels)?;
            opt.backward_step(&loss)?;
        }
        model.train(false);
        let target = out.join(name);
        if *name == "llama" {
            model.save_pretrained_sharded(&target, 8 << 10)?;
        } else {
            model.save_pretrained(&target)?;
        }
        let logits = model.forward(ids, Some(mask))?;
        let probe: HashMap<String, Tensor> = [
            ("input_ids".to_string(), ids.clone()),
            ("attention_mask".to_string(), mask.clone()),
            ("logits".to_string(), logits),
        ]
        .into_iter()
        .collect();
        candle_core::safetensors::save(&probe, target.join("probe.safetensors"))?;
        println!("{}: saved", target.display());
    }
    Ok(())
}
