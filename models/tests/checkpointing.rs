//! Activation checkpointing in the models (`set_gradient_checkpointing`): for every
//! architecture, with dropout off and on (0.1 everywhere: the recomputation replays the masks),
//! and with LoRA adapters, the loss and every gradient are bit for bit those of the plain run
//! (CPU, f32); and the training mode and checkpointing switches carry over LoRA, merging and
//! mixed precision's working copies.

mod common;

use accelerate_rs::nn::{self, set_dropout_seed, LoraConfig};
use accelerate_rs::Parameters;
use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device, Tensor};
use common::{fixture, golden, with_dropout, ARCHS};

/// The loss's bits and every trainable parameter's gradient bits, in name order.
fn run(model: &AutoModel, name: &str, seed: u64) -> (u32, Vec<(String, Vec<u32>)>) {
    let g = golden(name);
    let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);
    set_dropout_seed(seed);
    let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
    let grads = nn::backward(&loss).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    let out = model
        .trainable_parameters()
        .named_parameters()
        .into_iter()
        .map(|(n, v)| {
            let g = grads
                .get(&v)
                .unwrap_or_else(|| panic!("{name}: `{n}` got no gradient"));
            (n, bits(g))
        })
        .collect();
    (loss.to_scalar::<f32>().unwrap().to_bits(), out)
}

fn same_with_and_without(mut model: AutoModel, name: &str, what: &str) {
    model.train(true);
    let plain = run(&model, name, 11);
    model.set_gradient_checkpointing(true);
    assert!(model.is_gradient_checkpointing());
    let checkpointed = run(&model, name, 11);
    assert_eq!(plain.0, checkpointed.0, "{what}: the loss differs");
    assert_eq!(plain.1.len(), checkpointed.1.len());
    for ((n, a), (_, b)) in plain.1.iter().zip(&checkpointed.1) {
        let diff = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            diff, 0,
            "{what}: {diff} elements of `{n}`'s gradient differ"
        );
    }
}

#[test]
fn checkpointed_gradients_are_bit_identical_for_every_architecture() {
    for name in ARCHS {
        let model = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        same_with_and_without(model, name, name);
    }
}

#[test]
fn checkpointed_gradients_are_bit_identical_with_dropout() {
    for name in ARCHS {
        let (_tmp, dir) = with_dropout(name);
        let mut model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
        model.train(true);
        // The dropout really draws: two seeds, two losses.
        let (a, b) = (run(&model, name, 1).0, run(&model, name, 2).0);
        assert_ne!(a, b, "{name}: dropout changes nothing");
        same_with_and_without(model, name, &format!("{name} with dropout 0.1"));
    }
}

#[test]
fn checkpointed_lora_gradients_are_bit_identical() {
    for (name, base) in [("lora_llama", "llama"), ("lora_gpt2", "gpt2")] {
        let mut model =
            AutoModel::from_pretrained(fixture(base), &Device::Cpu, DType::F32).unwrap();
        model.load_adapter(fixture(name).join("adapter")).unwrap();
        same_with_and_without(model, name, name);
        // LoRA dropout too.
        let (_tmp, dir) = with_dropout(base);
        let mut model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
        model
            .add_lora(&LoraConfig::new(4, 8.0).dropout(0.2).all_linear())
            .unwrap();
        // Nonzero B, so that the adapters' inputs matter.
        for v in model.trainable_parameters().all_vars() {
            let t = Tensor::ones(v.shape(), DType::F32, &Device::Cpu).unwrap();
            v.set(&(t * 0.05).unwrap()).unwrap();
        }
        same_with_and_without(
            model,
            base,
            &format!("{base}, all-linear LoRA with dropout"),
        );
    }
}

#[test]
fn training_mode_and_checkpointing_survive_lora_merging_and_working_copies() {
    for name in ARCHS {
        for (train, ckpt) in [(true, true), (false, true), (true, false)] {
            let what = format!("{name}, train {train}, checkpointing {ckpt}");
            let mut model =
                AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
            model.train(train);
            model.set_gradient_checkpointing(ckpt);
            let modes = |m: &AutoModel| (m.is_training(), m.is_gradient_checkpointing());
            let copy = model.with_parameters(model.varmap()).unwrap();
            assert_eq!(modes(&copy), (train, ckpt), "{what}: with_parameters");
            // peft's default targets, or every linear layer where peft has none (Phi-3, the
            // Qwen MoEs).
            let defaults = model.memory_architecture().unwrap().default_lora_targets;
            let lora = if defaults.is_empty() {
                LoraConfig::new(1, 2.0).all_linear()
            } else {
                LoraConfig::new(2, 4.0)
            };
            model.add_lora(&lora).unwrap();
            assert_eq!(modes(&model), (train, ckpt), "{what}: add_lora");
            model.merge_lora().unwrap();
            assert_eq!(modes(&model), (train, ckpt), "{what}: merge_lora");
        }
    }
}
