//! Random mutations of tiny model folders (their `config.json` values and their safetensors
//! headers) never abort, panic or hang the loader: every load ends, within seconds, with a model
//! or an error. Runs each load on a thread with a time limit; an abort would end the test
//! process, a panic fails the property.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device};
use proptest::prelude::*;

/// Loads `dir` on another thread: `Ok(true)` loaded, `Ok(false)` an error, `Err` a panic or a
/// hang.
fn load_ends(dir: &Path) -> Result<bool, String> {
    let dir = dir.to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(|| {
            AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).is_ok()
        });
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(loaded)) => Ok(loaded),
        Ok(Err(_)) => Err("the loader panicked".into()),
        Err(_) => Err("the loader did not return within 30 s".into()),
    }
}

/// Values a hostile or careless `config.json` holds.
fn value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1)),
        Just(json!(3)),
        Just(json!(7)),
        Just(json!(1u64 << 31)),
        Just(json!(1u64 << 40)),
        Just(json!(u64::MAX)),
        Just(json!(1e300)),
        Just(json!(-1e-9)),
        Just(json!(0.5)),
        Just(json!(null)),
        Just(json!("x")),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        any::<i64>().prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| json!(v)),
    ]
}

const KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
    "model_type",
    "architectures",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "type_vocab_size",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn config_mutations_never_abort_or_hang(
        arch in prop::sample::select(vec!["llama", "gpt2", "bert_mlm", "qwen2"]),
        edits in prop::collection::vec((prop::sample::select(KEYS.to_vec()), value()), 1..4),
    ) {
        let (_tmp, dir) = common::copy_fixture(arch);
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (key, v) in &edits {
            config[*key] = v.clone();
        }
        std::fs::write(&path, config.to_string()).unwrap();
        load_ends(&dir).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn header_mutations_never_abort_or_hang(
        arch in prop::sample::select(vec!["llama", "gpt2"]),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let (_tmp, dir) = common::copy_fixture(arch);
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, b) in &flips {
            // Mostly the length and the JSON header, where a flip changes what is claimed.
            let i = at.index(header.min(bytes.len()));
            bytes[i] ^= b | 1;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        std::fs::write(&path, &bytes).unwrap();
        let loaded = load_ends(&dir).map_err(TestCaseError::fail)?;
        // A flip inside the header can leave a valid file only by luck; a truncated one never.
        prop_assert!(!(loaded && cut.is_some()), "a truncated file loaded");
    }
}
