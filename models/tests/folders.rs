//! Hugging Face folders: what `save_pretrained` writes loads back identically (here; in
//! `transformers` with `scripts/hf_reference.py check`), with `config.json`'s keys kept, tied
//! weights written once, sharding, and dtype conversion both ways.

mod common;

use accelerate_rs::Parameters;
use accelerate_rs_models::{AutoModel, Config, LlamaConfig, LlamaForCausalLm};
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
        let fresh_names: Vec<(String, Vec<usize>)> =
            AutoModel::from_config(&config, &Device::Cpu, DType::F32)
                .unwrap()
                .varmap()
                .named_parameters()
                .into_iter()
                .map(|(n, v)| (n, v.dims().to_vec()))
                .collect();
        if name == "llama" {
            // The typed configuration, and the typed model from it.
            let c: &LlamaConfig = config.get().unwrap();
            let typed = LlamaForCausalLm::from_config(c, &Device::Cpu, DType::F32).unwrap();
            assert_eq!(typed.varmap().all_vars().len(), fresh_names.len());
        }
        let want: Vec<(String, Vec<usize>)> = trained
            .varmap()
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (n, v.dims().to_vec()))
            .collect();
        assert_eq!(fresh_names, want, "{name}");
    }
}

/// Mixed precision: the f32 model keeps the masters, `with_parameters` builds the same
/// architecture over `prepare_mixed`'s bf16 working copies (logits within bf16's precision of
/// the f32 model's, training mode carried over), a backward step through it moves the masters,
/// and bad parameter maps are errors that name the problem and leave the map as it was.
#[test]
fn with_parameters_runs_every_architecture_on_mixed_precision_working_copies() {
    use accelerate_rs::optim::AdamW;
    use accelerate_rs::{Accelerator, DataLoader, MixedPrecision, TensorDataset};
    for name in ARCHS {
        let accelerator = Accelerator::builder()
            .rank(0)
            .world_size(1)
            .cpu(true)
            .mixed_precision(MixedPrecision::Bf16)
            .build()
            .unwrap();
        let g = golden(name);
        let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);
        let mut model =
            AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        model.train(true);
        let loader = DataLoader::new(TensorDataset::new(vec![ids.clone()]).unwrap(), 1);
        let opt = AdamW::new_lr(model.varmap().all_vars(), 1e-3).unwrap();
        let (mut opt, _, work) = accelerator
            .prepare_mixed(model.varmap(), opt, loader)
            .unwrap();
        let half = model.with_parameters(&work).unwrap();
        assert!(half.is_training(), "{name}");
        assert!(half
            .varmap()
            .all_vars()
            .iter()
            .all(|v| v.dtype() == DType::BF16));
        let want = model.forward(ids, Some(mask)).unwrap();
        let got = half.forward(ids, Some(mask)).unwrap();
        let d = rel_diff(&got, &want);
        // bf16 keeps 8 bits of mantissa; wrong or fresh weights would differ by ~100%.
        assert!(d < 0.1, "{name}: bf16 logits differ by {d} (relative)");

        let first = model.varmap().named_parameters()[0].clone();
        let before = first.1.as_tensor().copy().unwrap();
        let loss = half.loss_with_mask(ids, Some(mask), labels).unwrap();
        assert!(
            opt.backward_step(&loss).unwrap(),
            "{name}: the step was skipped"
        );
        let moved = rel_diff(first.1.as_tensor(), &before);
        assert!(moved > 0.0, "{name}: master `{}` did not move", first.0);
        // The working copies follow the masters.
        let copy = work.data().lock().unwrap()[&first.0].as_tensor().clone();
        let cast = first.1.as_tensor().to_dtype(DType::BF16).unwrap();
        assert_eq!(rel_diff(&copy, &cast), 0.0, "{name}");
    }

    // A map without one of the parameters.
    let model = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    let partial = candle_nn::VarMap::new();
    let mut names = Vec::new();
    for (n, v) in model.varmap().named_parameters() {
        names.push(n.clone());
        if n != "model.norm.weight" {
            partial.data().lock().unwrap().insert(n, v);
        }
    }
    let e = model.with_parameters(&partial).unwrap_err().to_string();
    assert!(
        e.contains("lack 1") && e.contains("model.norm.weight"),
        "{e}"
    );
    assert_eq!(
        partial.all_vars().len(),
        names.len() - 1,
        "the map was changed"
    );
    // Mixed dtypes, and an empty map.
    let mixed = candle_nn::VarMap::new();
    for (i, (n, v)) in model.varmap().named_parameters().into_iter().enumerate() {
        let v = if i == 0 {
            candle_core::Var::from_tensor(&v.as_tensor().to_dtype(DType::BF16).unwrap()).unwrap()
        } else {
            v
        };
        mixed.data().lock().unwrap().insert(n, v);
    }
    let e = model.with_parameters(&mixed).unwrap_err().to_string();
    assert!(e.contains("mix dtypes"), "{e}");
    let e = model
        .with_parameters(&candle_nn::VarMap::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty"), "{e}");
}
