//! Hugging Face folders: what `save_pretrained` writes loads back identically (here; in
//! `transformers` with `scripts/hf_reference.py check`), with `config.json`'s keys kept, tied
//! weights written once, sharding, and dtype conversion both ways.

mod common;

use accelerate_rs::Parameters;
use accelerate_rs_models::{AutoModel, Config, LlamaForCausalLm};
use candle_core::{DType, Device};
use common::{fixture, golden, rel_diff, ARCHS};

#[test]
fn saved_folders_load_back_with_the_same_logits_and_config() {
    for name in ARCHS {
        let g = golden(name);
        let model = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("nested").join(name);
        model.save_pretrained(&out).unwrap();
        let back = AutoModel::from_pretrained(&out, &Device::Cpu, DType::F32).unwrap();
        let (ids, mask) = (&g["input_ids"], &g["attention_mask"]);
        let a = model.forward(ids, Some(mask)).unwrap();
        let b = back.forward(ids, Some(mask)).unwrap();
        assert_eq!(rel_diff(&a, &b), 0.0, "{name}");

        // The same tensor names as transformers wrote (tied weights once).
        let names = |dir: &std::path::Path| {
            let mut n: Vec<String> =
                candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
                    .unwrap()
                    .into_keys()
                    .collect();
            n.sort();
            n
        };
        assert_eq!(names(&out), names(&fixture(name)), "{name}");

        // config.json: every key of the original, with the same values (but `dtype`).
        let read = |dir: &std::path::Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap()
        };
        let (orig, saved) = (read(&fixture(name)), read(&out));
        for (k, v) in orig.as_object().unwrap() {
            assert_eq!(saved.get(k), Some(v), "{name}: config key `{k}`");
        }
        assert_eq!(
            Config::from_file(&out).unwrap().model_type(),
            orig["model_type"].as_str().unwrap()
        );
    }
}

#[test]
fn bf16_checkpoints_load_into_f32_and_the_reverse() {
    let g = golden("llama");
    let (ids, mask) = (&g["input_ids"], &g["attention_mask"]);
    let half =
        LlamaForCausalLm::from_pretrained(fixture("llama"), &Device::Cpu, DType::BF16).unwrap();
    assert!(half
        .varmap()
        .named_parameters()
        .iter()
        .all(|(_, v)| v.dtype() == DType::BF16));
    assert_eq!(half.dtype(), DType::BF16);
    let logits = half.forward(ids, Some(mask)).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    let d = rel_diff(&logits, &g["logits"]);
    assert!(d < 0.05, "bf16 logits differ by {d}");

    // Saved in bf16 (the file and config.json say so), loaded into f32.
    let tmp = tempfile::tempdir().unwrap();
    half.save_pretrained(tmp.path()).unwrap();
    let file =
        candle_core::safetensors::load(tmp.path().join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(file.values().all(|t| t.dtype() == DType::BF16));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["dtype"], "bfloat16");
    let full = LlamaForCausalLm::from_pretrained(tmp.path(), &Device::Cpu, DType::F32).unwrap();
    let d = rel_diff(
        &full.forward(ids, Some(mask)).unwrap(),
        &logits.to_dtype(DType::F32).unwrap(),
    );
    assert!(d < 0.05, "{d}");
}

#[test]
fn from_config_builds_the_checkpoint_names_with_fresh_weights() {
    for name in ["llama", "gpt2", "bert_mlm", "bert_cls"] {
        let config = Config::from_file(fixture(name)).unwrap();
        let trained = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        let fresh_names: Vec<(String, Vec<usize>)> = match &config {
            Config::Llama(c) => LlamaForCausalLm::from_config(c, &Device::Cpu, DType::F32)
                .unwrap()
                .varmap()
                .named_parameters()
                .into_iter()
                .map(|(n, v)| (n, v.dims().to_vec()))
                .collect(),
            Config::Gpt2(c) => {
                accelerate_rs_models::Gpt2LmHeadModel::from_config(c, &Device::Cpu, DType::F32)
                    .unwrap()
                    .varmap()
                    .named_parameters()
                    .into_iter()
                    .map(|(n, v)| (n, v.dims().to_vec()))
                    .collect()
            }
            Config::Bert(c) if name == "bert_mlm" => {
                accelerate_rs_models::BertForMaskedLm::from_config(c, &Device::Cpu, DType::F32)
                    .unwrap()
                    .varmap()
                    .named_parameters()
                    .into_iter()
                    .map(|(n, v)| (n, v.dims().to_vec()))
                    .collect()
            }
            Config::Bert(c) => accelerate_rs_models::BertForSequenceClassification::from_config(
                c,
                &Device::Cpu,
                DType::F32,
            )
            .unwrap()
            .varmap()
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (n, v.dims().to_vec()))
            .collect(),
            _ => unreachable!(),
        };
        let want: Vec<(String, Vec<usize>)> = trained
            .varmap()
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (n, v.dims().to_vec()))
            .collect();
        assert_eq!(fresh_names, want, "{name}");
    }
}
