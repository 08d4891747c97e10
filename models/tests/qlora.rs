//! QLoRA: the models on a 4-bit (NF4) base against `transformers` + bitsandbytes + `peft`, with
//! the golden files of `scripts/qlora_reference.py` (committed under
//! `tests/fixtures/llama_4bit`: the folder `transformers` saves for the tiny Llama loaded with
//! `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
//! bnb_4bit_use_double_quant=True)`, a PEFT adapter on it and the logits and gradients).
//! Tolerance: 1e-4 of the reference's scale for logits, loss and gradients (f32; the 4-bit
//! weights are bitsandbytes' bit for bit, the products' summation orders differ).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use accelerate_rs::collective::ThreadGroup;
use accelerate_rs::nn::{self, LoraConfig};
use accelerate_rs::optim::AdamW;
use accelerate_rs::quant::Quant4bitConfig;
use accelerate_rs::{Accelerator, MissingGradients, Parameters};
use accelerate_rs_models::{AutoModel, LlamaForCausalLm};
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use common::{adamw_params, fixture, golden, rel_diff};

const TOL: f32 = 1e-4;

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The tiny Llama quantized on load (NF4, double quantization, f32 compute).
fn quantized_on_load() -> AutoModel {
    AutoModel::from_pretrained_4bit(
        fixture("llama"),
        &Device::Cpu,
        DType::F32,
        &Quant4bitConfig::nf4(),
    )
    .unwrap()
}

fn logits(model: &AutoModel, g: &HashMap<String, Tensor>) -> Tensor {
    model
        .forward(&g["input_ids"], Some(&g["attention_mask"]))
        .unwrap()
}

#[test]
fn a_transformers_4bit_folder_and_quantizing_on_load_give_bitsandbytes_logits() {
    let g = golden("llama_4bit");
    // (b) the folder `transformers` saved, read as it is (its `quantization_config` seen).
    let read = AutoModel::from_pretrained(fixture("llama_4bit"), &Device::Cpu, DType::F32).unwrap();
    let d = rel_diff(&logits(&read, &g), &g["base.logits"]);
    assert!(d <= TOL, "read 4-bit folder: logits differ by {d:e}");
    // (a) the f32 folder quantized on load: bitsandbytes' bytes, so the same logits.
    let quant = quantized_on_load();
    let d = rel_diff(&logits(&quant, &g), &g["base.logits"]);
    assert!(d <= TOL, "quantized on load: logits differ by {d:e}");
    let llama: &LlamaForCausalLm = quant.downcast_ref().unwrap();
    let (bytes, elems) = llama.base_4bit_size().unwrap();
    assert_eq!(elems, 2 * (16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32));
    // Half a byte a weight, plus per layer the scales and the 1 KiB 8-bit map (which dominates
    // at these sizes): below f32's 4 bytes.
    assert!(
        bytes > elems / 2 && bytes < 4 * elems,
        "{bytes} bytes for {elems} 4-bit weights"
    );
    // The quantized weights are not parameters: embeddings, norms and the head are.
    let names: Vec<String> = quant
        .varmap()
        .data()
        .lock()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(names.len(), 2 + 2 * 2 + 1, "{names:?}");
    assert!(names.iter().all(|n| !n.contains("_proj")), "{names:?}");
}

#[test]
fn saving_a_4bit_model_writes_what_transformers_writes() {
    let dir = tempfile::tempdir().unwrap();
    quantized_on_load().save_pretrained(dir.path()).unwrap();
    let ours = tensors(&dir.path().join("model.safetensors"));
    let theirs = tensors(&fixture("llama_4bit").join("model.safetensors"));
    let mut names: Vec<&String> = theirs.keys().collect();
    names.sort();
    assert_eq!(ours.len(), theirs.len(), "tensor count");
    for name in names {
        let (a, b) = (&ours[name], &theirs[name]);
        assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()), "`{name}`");
        let (a, b) = (
            a.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
            b.flatten_all().unwrap().to_dtype(DType::F64).unwrap(),
        );
        assert_eq!(
            a.to_vec1::<f64>().unwrap(),
            b.to_vec1::<f64>().unwrap(),
            "`{name}` differs from transformers'"
        );
    }
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    let q = &config["quantization_config"];
    assert_eq!(q["bnb_4bit_quant_type"], "nf4");
    assert_eq!(q["bnb_4bit_use_double_quant"], true);
    // And it reads back as the same model.
    let back = AutoModel::from_pretrained(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let g = golden("llama_4bit");
    let (a, b) = (logits(&back, &g), logits(&quantized_on_load(), &g));
    assert_eq!(rel_diff(&a, &b), 0.0);
}

#[test]
fn a_peft_adapter_on_the_4bit_base_gives_peft_logits_loss_and_gradients() {
    let g = golden("llama_4bit");
    for checkpointing in [false, true] {
        let mut model = quantized_on_load();
        model
            .load_adapter(fixture("llama_4bit").join("adapter"))
            .unwrap();
        model.train(true);
        model.set_gradient_checkpointing(checkpointing);
        let d = rel_diff(&logits(&model, &g), &g["lora.logits"]);
        assert!(d <= TOL, "logits differ by {d:e}");
        let loss = model
            .loss_with_mask(&g["input_ids"], Some(&g["attention_mask"]), &g["labels"])
            .unwrap();
        let d = rel_diff(&loss.reshape(1).unwrap(), &g["lora.loss"]);
        assert!(d <= TOL, "loss differs by {d:e}");
        let grads = nn::backward(&loss).unwrap();
        let trainable = model.trainable_parameters().named_parameters();
        assert_eq!(trainable.len(), 28);
        for (name, var) in trainable {
            let got = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("`{name}` has no gradient"));
            let d = rel_diff(got, &g[&format!("grad.{name}")]);
            assert!(
                d <= TOL,
                "checkpointing {checkpointing}: `{name}`'s gradient: {d:e}"
            );
        }
        // The base gets none.
        for var in model.varmap().all_vars() {
            assert!(grads.get(var.as_tensor()).is_none());
        }
    }
}

#[test]
fn merging_into_the_dequantized_base_writes_a_plain_folder() {
    let g = golden("llama_4bit");
    let mut model = quantized_on_load();
    model
        .load_adapter(fixture("llama_4bit").join("adapter"))
        .unwrap();
    let adapted = logits(&model, &g);
    let dir = tempfile::tempdir().unwrap();
    model.save_adapter(dir.path().join("adapter")).unwrap();
    let saved = tensors(&dir.path().join("adapter/adapter_model.safetensors"));
    let peft = tensors(&fixture("llama_4bit").join("adapter/adapter_model.safetensors"));
    assert_eq!(saved.len(), peft.len());
    model.merge_lora().unwrap();
    assert!(model.lora_config().is_none());
    let d = rel_diff(&logits(&model, &g), &adapted);
    assert!(d <= TOL, "merged logits differ by {d:e}");
    model.save_pretrained(dir.path().join("merged")).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("merged/config.json")).unwrap())
            .unwrap();
    assert!(config.get("quantization_config").is_none(), "{config}");
    let files = tensors(&dir.path().join("merged/model.safetensors"));
    let q = &files["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!((q.dtype(), q.dims()), (DType::F32, &[16usize, 16][..]));
    let plain =
        AutoModel::from_pretrained(dir.path().join("merged"), &Device::Cpu, DType::F32).unwrap();
    assert_eq!(rel_diff(&logits(&plain, &g), &logits(&model, &g)), 0.0);
}

#[test]
fn what_a_4bit_base_cannot_do_is_an_error_naming_it() {
    // A quantization other than the folder's.
    let e = AutoModel::from_pretrained_4bit(
        fixture("llama_4bit"),
        &Device::Cpu,
        DType::F32,
        &Quant4bitConfig::fp4(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("quantization_config") && e.contains("nf4"),
        "{e}"
    );
    // A block size bitsandbytes does not take.
    let e = AutoModel::from_pretrained_4bit(
        fixture("llama"),
        &Device::Cpu,
        DType::F32,
        &Quant4bitConfig::nf4().blocksize(48),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("block size"), "{e}");
    // Mixed precision's working copies.
    let model = quantized_on_load();
    let e = model
        .with_parameters(model.varmap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-bit base"), "{e}");
    // ZeRO-3.
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let e = AutoModel::from_pretrained_sharded(fixture("llama_4bit"), &acc, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(e.contains("4-bit") && e.contains("ZeRO-3"), "{e}");
    // Another quantization method in config.json.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let text = std::fs::read_to_string(fixture("llama_4bit").join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"bitsandbytes\"", "\"gptq\""),
    )
    .unwrap();
    std::fs::copy(
        fixture("llama_4bit").join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let e = AutoModel::from_pretrained(dir, &Device::Cpu, DType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("quantization_config") && e.contains("gptq"),
        "{e}"
    );
}

/// Seeded adapters on two kinds of layers.
fn adapter_config() -> LoraConfig {
    LoraConfig::new(4, 8.0)
        .target_modules(["q_proj", "down_proj"])
        .seed(7)
}

/// Rank `rank` of `world`: 3 AdamW steps of fresh seeded adapters on the 4-bit base over its
/// share of the batch; the adapters afterwards and the bytes all-reduced.
fn train(acc: Accelerator) -> (HashMap<String, Tensor>, u64) {
    let g = golden("llama_4bit");
    let mut model = quantized_on_load();
    model.add_lora(&adapter_config()).unwrap();
    model.train(true);
    let ids = acc.shard_rows(&g["input_ids"]).unwrap();
    let labels = acc
        .shard_rows(&g["input_ids"].to_dtype(DType::I64).unwrap())
        .unwrap();
    let trainable = model.trainable_parameters();
    acc.prepare_model(trainable).unwrap();
    let mut opt = acc.prepare_optimizer(AdamW::new(trainable.all_vars(), adamw_params()).unwrap());
    for _ in 0..3 {
        let loss = model.loss(&ids, &labels).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    let after = trainable
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    (after, acc.gradient_bytes_reduced())
}

fn on_ranks(world: usize) -> Vec<(HashMap<String, Tensor>, u64)> {
    let handles: Vec<_> = ThreadGroup::new(world, Duration::from_secs(60))
        .unwrap()
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let acc = Accelerator::builder()
                    .collective(Arc::new(c))
                    .cpu(true)
                    .missing_gradients(MissingGradients::Error)
                    .build()
                    .unwrap();
                train(acc)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn two_ranks_train_adapters_on_a_4bit_base_as_one_and_all_reduce_only_them() {
    let one = on_ranks(1);
    let two = on_ranks(2);
    let (single, _) = &one[0];
    let start = {
        let mut m = quantized_on_load();
        m.add_lora(&adapter_config()).unwrap();
        m.trainable_parameters().named_parameters()
    };
    let adapter_elems: usize = start.iter().map(|(_, v)| v.elem_count()).sum();
    for (name, v) in &start {
        assert!(
            rel_diff(&single[name], v.as_tensor()) > 0.0,
            "`{name}` did not train"
        );
    }
    for (rank, (adapters, bytes)) in two.iter().enumerate() {
        for (name, t) in single {
            // The gradients' sums run in another order on two ranks; AdamW's first steps
            // magnify that to about 1e-5 of the adapters' scale.
            let d = rel_diff(&adapters[name], t);
            assert!(d <= 5e-5, "rank {rank}: `{name}` differs by {d:e}");
        }
        // Only the adapters' f32 gradients travel (3 steps; a presence flag per tensor aside).
        assert!(
            *bytes >= 3 * 4 * adapter_elems as u64 && *bytes < 3 * 4 * (adapter_elems as u64 + 64),
            "rank {rank}: {bytes} bytes all-reduced for {adapter_elems} adapter values"
        );
    }
}

#[test]
fn every_architecture_runs_and_trains_adapters_on_a_4bit_base() {
    let fixtures = [
        "llama",
        "llama_tied",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3",
        "phi3",
        "gpt2",
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "bert_mlm",
        "bert_cls",
    ];
    for name in fixtures {
        let dev = Device::Cpu;
        let dense = AutoModel::from_pretrained(fixture(name), &dev, DType::F32).unwrap();
        let mut model = AutoModel::from_pretrained_4bit(
            fixture(name),
            &dev,
            DType::F32,
            &Quant4bitConfig::nf4(),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ids = Tensor::new(&[[1u32, 5, 9, 3, 7, 2], [4, 4, 8, 1, 6, 3]], &dev).unwrap();
        let full = dense.forward(&ids, None).unwrap();
        let four = model.forward(&ids, None).unwrap();
        // 4 bits a weight: not the f32 model (these tiny random weights quantize coarsely:
        // llama's logits move by half their scale). What they are is checked below: the
        // logits of a plain model over the dequantized weights.
        let d = rel_diff(&four, &full);
        assert!(d > 0.0 && four.dims() == full.dims(), "{name}: {d:e}");
        // Adapters of rank 1 on every linear layer (B = 0: the same function), a backward pass
        // reaching every adapter and no base parameter.
        model
            .add_lora(&LoraConfig::new(1, 2.0).target_regex(".*"))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        model.train(true);
        let labels = if model.task() == accelerate_rs_models::Task::SequenceClassification {
            Tensor::new(&[0i64, 1], &dev).unwrap()
        } else {
            ids.to_dtype(DType::I64).unwrap()
        };
        let loss = model.loss(&ids, &labels).unwrap();
        let grads = nn::backward(&loss).unwrap();
        for (n, v) in model.trainable_parameters().named_parameters() {
            if n.contains("lora_A") {
                continue; // B = 0: A's gradient is zero, but present
            }
            assert!(
                grads.get(v.as_tensor()).is_some(),
                "{name}: `{n}` has no gradient"
            );
        }
        for v in model.varmap().all_vars() {
            assert!(
                grads.get(v.as_tensor()).is_none(),
                "{name}: the base trains"
            );
        }
        // Merged into the dequantized base: the same logits from a plain model.
        model.train(false);
        let before = model.forward(&ids, None).unwrap();
        model.merge_lora().unwrap();
        let d = rel_diff(&model.forward(&ids, None).unwrap(), &before);
        assert!(d <= 1e-5, "{name}: merged logits differ by {d:e}");
    }
}

#[test]
fn estimate_memory_counts_the_bytes_a_4bit_model_holds() {
    use accelerate_rs::memory::{estimate_4bit, Lora, Plan};
    let spec = accelerate_rs_models::model_spec(&fixture("llama")).unwrap();
    let plan = Plan {
        lora: Some(Lora {
            r: 4,
            targets: vec![],
        }),
        ..Plan::default()
    };
    let est = estimate_4bit(&spec, &plan, 64, true).unwrap();
    let mut model = quantized_on_load();
    model.add_lora(&LoraConfig::new(4, 8.0)).unwrap();
    let bytes = |m: &candle_nn::VarMap| -> usize {
        m.all_vars()
            .iter()
            .map(|v| v.elem_count() * v.dtype().size_in_bytes())
            .sum()
    };
    let (base4, _) = model.base_4bit_size().unwrap();
    // The largest quantized layer dequantized in f32: the MLP's 16 x 32.
    let held = bytes(model.varmap()) + base4 + bytes(model.trainable_parameters()) + 16 * 32 * 4;
    assert_eq!(est.parameters as usize, held);
    // Refused where a 4-bit base cannot go.
    let e = estimate_4bit(&spec, &Plan::default(), 64, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("frozen"), "{e}");
}
