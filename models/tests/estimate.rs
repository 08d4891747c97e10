//! What `estimate-memory` reads through this crate (`model_spec`): every architecture's folder
//! gives its architecture (sizes, activations per token, default LoRA targets) and its
//! parameters, and the parameters the architecture describes from `config.json` alone are the
//! ones its weight files hold; bad configurations are errors naming the file and the key.

mod common;

use std::path::Path;

use accelerate_rs::memory::{estimate, Lora, ModelSpec, Plan, TensorSource};
use accelerate_rs_models::{model_spec, AutoModel, Config};
use candle_core::{DType, Device};
use common::{copy_fixture, fixture, ARCHS};

#[test]
fn every_architecture_describes_its_parameters_and_activations() {
    for name in ARCHS {
        let dir = fixture(name);
        let spec = model_spec(&dir).unwrap();
        assert!(
            matches!(spec.tensors_from, TensorSource::Safetensors { .. }),
            "{name}"
        );
        let arch = spec.architecture.clone().unwrap();
        let config = Config::from_file(&dir).unwrap();
        assert_eq!(arch.name, config.model_type(), "{name}");
        // From config.json alone: the same parameters as the file holds, and as the model has.
        let alone = ModelSpec::from_architecture(arch.clone());
        assert_eq!(alone.parameter_count(), spec.parameter_count(), "{name}");
        let model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
        let n: usize = model
            .varmap()
            .all_vars()
            .iter()
            .map(|v| v.elem_count())
            .sum();
        assert_eq!(alone.parameter_count(), n as u64, "{name}");
        assert_eq!(
            model.memory_architecture().unwrap(),
            arch,
            "{name}: the loaded model describes itself as its folder does"
        );
        assert!(arch.block_elements > arch.hidden as u64, "{name}");
        let e = estimate(
            &spec,
            &Plan {
                seq_len: 8,
                ..Plan::default()
            },
        )
        .unwrap();
        assert!(e.activations.is_some_and(|a| a.kept > 0), "{name}");
        // LoRA on peft's default targets, where peft has some.
        let lora = Plan {
            lora: Some(Lora {
                r: 2,
                targets: vec![],
            }),
            ..Plan::default()
        };
        match estimate(&spec, &lora) {
            Ok(e) => assert!(e.lora_layers > 0, "{name}"),
            Err(err) => {
                assert!(arch.default_lora_targets.is_empty(), "{name}: {err}");
                assert!(err.to_string().contains("name the target modules"), "{err}");
            }
        }
    }
}

#[test]
fn a_config_alone_and_bad_configs() {
    let (_tmp, dir) = copy_fixture("llama");
    let config = dir.join("config.json");
    let spec = model_spec(&config).unwrap();
    assert_eq!(spec.tensors_from, TensorSource::Config);
    assert_eq!(spec.architecture.unwrap().name, "llama");
    // Without its weights, the folder counts from config.json.
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::remove_file(dir.join("golden.safetensors")).unwrap();
    let spec = model_spec(&dir).unwrap();
    assert_eq!(spec.tensors_from, TensorSource::Config);

    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        f(&mut json);
        std::fs::write(&config, json.to_string()).unwrap();
    };
    edit(&|j| {
        j.as_object_mut().unwrap().remove("hidden_size");
    });
    let e = model_spec(&config).unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("hidden_size"),
        "{e}"
    );
    edit(&|j| j["hidden_size"] = serde_json::json!(16));
    edit(&|j| j["num_key_value_heads"] = serde_json::json!(3));
    let e = model_spec(&config).unwrap_err().to_string();
    assert!(e.contains("num_key_value_heads"), "{e}");
    edit(&|j| j["model_type"] = serde_json::json!("t5"));
    let e = model_spec(&config).unwrap_err().to_string();
    assert!(
        e.contains("\"t5\"") && e.contains("not an architecture the estimate knows"),
        "{e}"
    );
    // An unknown model_type in a folder with weights: counted, architecture unknown.
    let (_tmp2, other) = copy_fixture("gpt2");
    let path = other.join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"gpt2\"", "\"t5\"");
    std::fs::write(&path, text).unwrap();
    let spec = model_spec(&other).unwrap();
    assert!(spec.architecture.is_none());
    assert_eq!(spec.unknown_model_type.as_deref(), Some("\"t5\""));
    assert!(spec.parameter_count() > 0);
    let e = model_spec(Path::new("/no/such/model"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/no/such/model"), "{e}");
}
