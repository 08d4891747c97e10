//! Bad model folders: every error names the file and the tensor or key, and nothing is loaded
//! half-way.

mod common;

use std::collections::HashMap;
use std::path::Path;

use accelerate_rs_models::{AutoModel, Config, Error, LlamaForCausalLm};
use candle_core::{DType, Device, Tensor};
use common::copy_fixture;

fn tensors(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn write(dir: &Path, t: &HashMap<String, Tensor>) {
    candle_core::safetensors::save(t, dir.join("model.safetensors")).unwrap();
}

/// The `ModelFile` error inside, checked to name `file` and `tensor`; its message.
fn model_file(e: Error, file: &str, tensor: &str) -> String {
    let msg = e.to_string();
    match e {
        Error::Accelerate(accelerate_rs::Error::ModelFile {
            path, tensor: t, ..
        }) => {
            assert!(path.ends_with(file), "{msg}: expected the file {file}");
            assert_eq!(t.as_deref(), Some(tensor), "{msg}");
        }
        other => panic!("expected a ModelFile error, got {other:?}"),
    }
    assert!(msg.contains(tensor), "{msg}");
    msg
}

fn config_err(e: Error, key: &str) -> String {
    let msg = e.to_string();
    match &e {
        Error::Config { path, key: k, .. } => {
            assert!(path.ends_with("config.json"), "{msg}");
            assert_eq!(k.as_deref(), Some(key), "{msg}");
        }
        other => panic!("expected a Config error, got {other:?}"),
    }
    msg
}

fn load(dir: &Path) -> Result<AutoModel, Error> {
    AutoModel::from_pretrained(dir, &Device::Cpu, DType::F32)
}

#[test]
fn missing_tensor() {
    let (_tmp, dir) = copy_fixture("llama");
    let mut t = tensors(&dir);
    t.remove("model.layers.1.mlp.up_proj.weight").unwrap();
    write(&dir, &t);
    let msg = model_file(
        load(&dir).unwrap_err(),
        "model.safetensors",
        "model.layers.1.mlp.up_proj.weight",
    );
    assert!(msg.contains("missing"), "{msg}");
}

#[test]
fn mis_shaped_tensor() {
    let (_tmp, dir) = copy_fixture("gpt2");
    let mut t = tensors(&dir);
    // Conv1D's [in, out] transposed: the classic mistake.
    let w = t["transformer.h.0.mlp.c_fc.weight"]
        .t()
        .unwrap()
        .contiguous()
        .unwrap();
    t.insert("transformer.h.0.mlp.c_fc.weight".into(), w);
    write(&dir, &t);
    let msg = model_file(
        load(&dir).unwrap_err(),
        "model.safetensors",
        "transformer.h.0.mlp.c_fc.weight",
    );
    assert!(
        msg.contains("[64, 16]") && msg.contains("[16, 64]"),
        "{msg}"
    );
}

#[test]
fn unexpected_tensor() {
    let (_tmp, dir) = copy_fixture("bert_cls");
    let mut t = tensors(&dir);
    t.insert(
        "bert.encoder.layer.2.output.dense.weight".into(),
        Tensor::zeros((16, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    write(&dir, &t);
    let msg = model_file(
        load(&dir).unwrap_err(),
        "model.safetensors",
        "bert.encoder.layer.2.output.dense.weight",
    );
    assert!(msg.contains("unexpected"), "{msg}");
}

#[test]
fn truncated_shard_of_a_sharded_checkpoint() {
    let (_tmp, dir) = copy_fixture("qwen2");
    let model = LlamaForCausalLm::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    let sharded = dir.parent().unwrap().join("sharded");
    model.save_pretrained_sharded(&sharded, 8 << 10).unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sharded.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut shards: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    shards.sort();
    shards.dedup();
    assert!(shards.len() >= 3, "{shards:?}");
    // The sharded copy loads...
    let back = LlamaForCausalLm::from_pretrained(&sharded, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(
        back.varmap().all_vars().len(),
        model.varmap().all_vars().len()
    );
    // ...until its second shard loses its last bytes.
    let path = sharded.join(&shards[1]);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
    let e = LlamaForCausalLm::from_pretrained(&sharded, &Device::Cpu, DType::F32).unwrap_err();
    let msg = e.to_string();
    let Error::Accelerate(accelerate_rs::Error::ModelFile {
        path: p, tensor, ..
    }) = e
    else {
        panic!("{msg}");
    };
    assert!(p.ends_with(&shards[1]), "{msg}");
    let tensor = tensor.unwrap();
    assert_eq!(
        index["weight_map"][&tensor].as_str(),
        Some(shards[1].as_str())
    );
    assert!(msg.contains("truncated"), "{msg}");
    // A shard named by the index but absent.
    std::fs::remove_file(&path).unwrap();
    let msg = LlamaForCausalLm::from_pretrained(&sharded, &Device::Cpu, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(msg.contains(&shards[1]) && msg.contains("missing"), "{msg}");
    assert!(msg.contains("model.safetensors.index.json"), "{msg}");
}

/// A copy of the llama fixture whose `model_type` is `falcon` (not supported).
fn falcon_fixture() -> (tempfile::TempDir, std::path::PathBuf) {
    let (tmp, dir) = copy_fixture("llama");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"model_type\": \"llama\"", "\"model_type\": \"falcon\"");
    std::fs::write(&path, text).unwrap();
    (tmp, dir)
}

#[test]
fn unknown_model_type_names_the_file_and_the_value() {
    let (_tmp, dir) = falcon_fixture();
    let msg = config_err(load(&dir).unwrap_err(), "model_type");
    assert!(msg.contains("falcon") && msg.contains("llama"), "{msg}");
    let msg = config_err(Config::from_file(&dir).unwrap_err(), "model_type");
    assert!(msg.contains("falcon"), "{msg}");
}

/// A copy of fixture `name` with its `config.json` edited by `f`.
fn edit(
    name: &str,
    f: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>),
) -> (tempfile::TempDir, std::path::PathBuf) {
    let (tmp, dir) = copy_fixture(name);
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    (tmp, dir)
}

/// A value quoted from the file (a 1 MiB string where a number belongs, a 1 MiB RoPE type) is
/// cut in the message, which stays a line a terminal shows; each RoPE number out of range is
/// named by its own key.
#[test]
fn values_a_file_quotes_are_cut_and_rope_numbers_named_by_key() {
    let huge = "A".repeat(1 << 20);
    let (_t, dir) = edit("llama", &|m| {
        m.insert("hidden_size".into(), huge.clone().into());
    });
    let msg = config_err(load(&dir).unwrap_err(), "hidden_size");
    assert!(
        msg.len() < 4096 && msg.contains("bytes left out]") && msg.contains("expected"),
        "{} bytes",
        msg.len()
    );
    let (_t, dir) = edit("llama", &|m| {
        m["rope_parameters"]["rope_type"] = huge.clone().into();
    });
    let msg = config_err(load(&dir).unwrap_err(), "rope_parameters.rope_type");
    assert!(
        msg.len() < 4096 && msg.contains("AAAA") && msg.contains("supported: default"),
        "{} bytes",
        msg.len()
    );

    for (key, value) in [
        ("factor", -1.0),
        ("low_freq_factor", 0.0),
        ("original_max_position_embeddings", -128.0),
        ("high_freq_factor", 0.5),
        ("rope_theta", -1.0),
    ] {
        let (_t, dir) = edit("llama", &|m| {
            m["rope_parameters"][key] = value.into();
        });
        let msg = config_err(load(&dir).unwrap_err(), &format!("rope_parameters.{key}"));
        assert!(msg.contains(&value.to_string()), "{msg}");
    }
    // transformers 4's top-level `rope_theta`, without any scaling.
    let (_t, dir) = edit("llama", &|m| {
        m.remove("rope_parameters");
        m.insert("rope_theta".into(), 0.0.into());
    });
    config_err(load(&dir).unwrap_err(), "rope_theta");
}

#[test]
fn missing_and_mistyped_keys_are_named() {
    let (_t, dir) = edit("llama", &|m| {
        m.remove("hidden_size");
    });
    let msg = config_err(load(&dir).unwrap_err(), "hidden_size");
    assert!(msg.contains("missing"), "{msg}");

    let (_t, dir) = edit("gpt2", &|m| {
        m.insert("n_head".into(), "two".into());
    });
    config_err(load(&dir).unwrap_err(), "n_head");

    let (_t, dir) = edit("llama", &|m| {
        m["rope_parameters"]["rope_type"] = "yarn".into();
    });
    let msg = config_err(load(&dir).unwrap_err(), "rope_parameters.rope_type");
    assert!(msg.contains("yarn"), "{msg}");

    let (_t, dir) = edit("llama", &|m| {
        m["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("factor");
    });
    config_err(load(&dir).unwrap_err(), "rope_parameters.factor");

    let (_t, dir) = edit("bert_mlm", &|m| {
        m.insert("hidden_act".into(), "quick_gelu".into());
    });
    let msg = config_err(load(&dir).unwrap_err(), "hidden_act");
    assert!(msg.contains("quick_gelu"), "{msg}");

    let (_t, dir) = edit("qwen2", &|m| {
        m.insert("num_key_value_heads".into(), 3.into());
    });
    config_err(load(&dir).unwrap_err(), "num_key_value_heads");

    let (_t, dir) = edit("bert_cls", &|m| {
        m.insert(
            "architectures".into(),
            serde_json::json!(["BertForTokenClassification"]),
        );
    });
    let msg = config_err(load(&dir).unwrap_err(), "architectures");
    assert!(msg.contains("BertForTokenClassification"), "{msg}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let model =
        AutoModel::from_pretrained(common::fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    let dev = Device::Cpu;
    let ids = Tensor::new(&[[1u32, 2, 64]], &dev).unwrap(); // 64 is outside the vocabulary
    let msg = model.forward(&ids, None).unwrap_err().to_string();
    assert!(msg.contains("64") && msg.contains("input_ids"), "{msg}");
    let ids = Tensor::new(&[[1u32, 2, 3]], &dev).unwrap();
    let mask = Tensor::new(&[[1u32, 1]], &dev).unwrap();
    let msg = model.forward(&ids, Some(&mask)).unwrap_err().to_string();
    assert!(msg.contains("attention_mask"), "{msg}");
    let labels = Tensor::new(&[[1f32, 2.0, 3.0]], &dev).unwrap();
    let msg = model.loss(&ids, &labels).unwrap_err().to_string();
    assert!(msg.contains("labels"), "{msg}");
    let gpt2 =
        AutoModel::from_pretrained(common::fixture("gpt2"), &Device::Cpu, DType::F32).unwrap();
    let long = Tensor::zeros((1, 17), DType::U32, &dev).unwrap();
    let msg = gpt2.forward(&long, None).unwrap_err().to_string();
    assert!(msg.contains("n_positions"), "{msg}");
}

/// `?` carries this crate's errors into accelerate-rs's result (a `find_executable_batch_size`
/// closure that builds the model): a config error keeps its message, accelerate-rs's errors
/// come back as they were, and a CUDA allocation failure in Candle becomes the out-of-memory
/// error that the search retries.
#[test]
fn errors_convert_into_accelerate_rs_errors_keeping_out_of_memory() {
    let (_tmp, dir) = falcon_fixture();
    let config = load(&dir).unwrap_err();
    let want = config.to_string();
    let got = accelerate_rs::Error::from(config);
    assert!(!got.is_out_of_memory());
    assert!(got.to_string().contains(&want), "{got} lost {want}");

    let inner = accelerate_rs::Error::invalid("batch", "too small");
    let want = inner.to_string();
    let back = accelerate_rs::Error::from(Error::Accelerate(inner));
    assert!(
        matches!(back, accelerate_rs::Error::InvalidArgument { .. }),
        "{back:?}"
    );
    assert_eq!(back.to_string(), want);

    let cuda = candle_core::Error::Cuda(Box::new(std::io::Error::other(
        "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
    )));
    let oom = accelerate_rs::Error::from(Error::Candle(cuda));
    assert!(oom.is_out_of_memory(), "{oom:?}");
}

/// A Hugging Face Hub id where a folder is expected: the error says how to download it; a
/// missing local path gets no such advice.
#[test]
fn a_hub_id_is_answered_with_how_to_download_it() {
    let e = AutoModel::from_pretrained("HuggingFaceTB/SmolLM2-135M", &Device::Cpu, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("huggingface-cli download HuggingFaceTB/SmolLM2-135M --local-dir")
            && e.contains("hub::download"),
        "{e}"
    );
    let e = accelerate_rs_models::load_tokenizer("HuggingFaceTB/SmolLM2-135M")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("huggingface-cli download HuggingFaceTB/SmolLM2-135M"),
        "{e}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-model");
    let e = AutoModel::from_pretrained(&missing, &Device::Cpu, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no-model") && !e.contains("huggingface-cli"),
        "{e}"
    );
}
