//! Helpers of the model tests: the committed fixtures and their golden files, and tensor
//! comparisons.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

/// The fixtures `scripts/hf_reference.py fixtures` writes, one per architecture.
pub const ARCHS: &[&str] = &[
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

/// The folder of fixture `name`: under `ACCELERATE_RS_MODELS_FIXTURES` when set (a test binary
/// run away from its source tree, as `scripts/gpu-smoke.sh` does), else under this crate's
/// `tests/fixtures`.
pub fn fixture(name: &str) -> PathBuf {
    let root = std::env::var_os("ACCELERATE_RS_MODELS_FIXTURES").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
        PathBuf::from,
    );
    root.join(name)
}

/// The golden tensors of fixture `name`.
pub fn golden(name: &str) -> HashMap<String, Tensor> {
    golden_on(name, &Device::Cpu)
}

/// The golden tensors of fixture `name`, on `device`.
pub fn golden_on(name: &str, device: &Device) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("golden.safetensors"), device).unwrap()
}

/// The device of the parity tests: the CPU, or with `ACCELERATE_RS_TEST_DEVICE=cuda` (or
/// `cuda:N`) a GPU of a `cuda` build (`scripts/gpu-smoke.sh` runs them so).
pub fn test_device() -> Device {
    match std::env::var("ACCELERATE_RS_TEST_DEVICE").as_deref() {
        Err(_) | Ok("") | Ok("cpu") => Device::Cpu,
        Ok(gpu) => {
            let ordinal = match gpu.strip_prefix("cuda") {
                Some("") => 0,
                Some(n) => n
                    .strip_prefix(':')
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("ACCELERATE_RS_TEST_DEVICE={gpu}: not cuda:N")),
                None => panic!("ACCELERATE_RS_TEST_DEVICE={gpu}: use cpu, cuda or cuda:N"),
            };
            accelerate_rs::gpu::device(ordinal).unwrap()
        }
    }
}

/// `max |t|` (f32).
pub fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// `max |a - b| / max |b|`: the largest difference relative to the reference's scale.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F32).unwrap();
    let b = b.to_dtype(DType::F32).unwrap();
    max_abs(&(&a - &b).unwrap()) / max_abs(&b).max(1e-12)
}

/// The reference script's AdamW (`torch.optim.AdamW` with its defaults and weight decay 0.01).
pub fn adamw_params() -> accelerate_rs::optim::ParamsAdamW {
    accelerate_rs::optim::ParamsAdamW {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// A copy of fixture `name` in a fresh temporary folder (to damage).
pub fn copy_fixture(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join(name);
    std::fs::create_dir(&dst).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    (tmp, dst)
}

/// A copy of fixture `name` whose config turns every dropout to 0.1.
pub fn with_dropout(name: &str) -> (Option<tempfile::TempDir>, std::path::PathBuf) {
    let (tmp, dir) = copy_fixture(name);
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let map = config.as_object_mut().unwrap();
    for key in [
        "attention_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
    ] {
        if map.contains_key(key) {
            map.insert(key.into(), 0.1.into());
        }
    }
    std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
    (Some(tmp), dir)
}
