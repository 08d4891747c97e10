//! LoRA on users' own `accelerate_rs::nn::Linear` layers (`nn::LoraLinear`): the output and
//! gradients of `W x + b + s B A x` (rsLoRA too), a frozen base (no gradient, outside the
//! optimizer and the all-reduce: the frozen-parameter check stays quiet), merging, bf16 bases
//! with f32 adapters, dropout under activation checkpointing, PEFT adapter folders, and 2 ranks
//! training the adapters as 1 while all-reducing only them.

use std::collections::HashMap;

use accelerate_rs::checkpoint::{load_adapter, read_adapter_config, save_adapter};
use accelerate_rs::nn::{self, linear, Linear, LoraConfig, LoraLinear, TargetModules};
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, MissingGradients, Parameters};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

use crate::common::in_process_with;

const DEV: Device = Device::Cpu;

/// Deterministic values in [-0.5, 0.5).
fn det(shape: &[usize], salt: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 + salt * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    Tensor::from_vec(v, shape, &DEV).unwrap()
}

fn set_all(varmap: &VarMap, salt: usize) {
    let mut vars = varmap.named_parameters();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (_, v)) in vars.iter().enumerate() {
        v.set(&det(v.dims(), salt + i).to_dtype(v.dtype()).unwrap())
            .unwrap();
    }
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// A base layer with bias `[out, in]` and an adapter on it; `B` nonzero.
fn layer(config: &LoraConfig, dtype: DType, adapters: &VarMap) -> (VarMap, LoraLinear) {
    let base = VarMap::new();
    let fc = linear(6, 5, VarBuilder::from_varmap(&base, dtype, &DEV).pp("fc")).unwrap();
    set_all(&base, 1);
    let adtype = config.adapter_dtype_for(dtype);
    let vb = VarBuilder::from_varmap(adapters, adtype, &DEV);
    let l = LoraLinear::new(fc, config, vb.pp("fc")).unwrap();
    (base, l)
}

#[test]
fn lora_linear_computes_the_low_rank_update_and_freezes_its_base() {
    for rslora in [false, true] {
        let config = LoraConfig::new(3, 6.0).rslora(rslora);
        let adapters = VarMap::new();
        let (base, l) = layer(&config, DType::F32, &adapters);
        let x = candle_core::Var::from_tensor(&det(&[2, 4, 6], 9)).unwrap();
        let x = x.as_tensor();
        // A fresh adapter (B = 0) leaves the layer as it was.
        let plain = l.base().forward(x).unwrap();
        assert_eq!(max_abs(&(l.forward(x).unwrap() - &plain).unwrap()), 0.0);

        set_all(&adapters, 30);
        let y = l.forward_t(x, true).unwrap();
        let s = if rslora { 6.0 / 3f64.sqrt() } else { 2.0 };
        assert_eq!(l.lora().scaling(), s);
        let (a, b) = (l.lora().a(), l.lora().b());
        let want = (plain.clone()
            + (x.broadcast_matmul(&a.t().unwrap())
                .unwrap()
                .broadcast_matmul(&b.t().unwrap())
                .unwrap()
                * s)
                .unwrap())
        .unwrap();
        assert!(max_abs(&(&y - &want).unwrap()) <= 1e-5);

        // Gradients: the adapter's, as the composed formula gives them; none for the base.
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let want_grads = want.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        // (The fused op on the CPU: the update and the input's gradient included.)
        let mut inputs: Vec<Tensor> = adapters
            .all_vars()
            .iter()
            .map(|v| v.as_tensor().clone())
            .collect();
        inputs.push(x.clone());
        for v in &inputs {
            let (g, w) = (grads.get(v).unwrap(), want_grads.get(v).unwrap());
            assert!(max_abs(&(g - w).unwrap()) <= 1e-4 * max_abs(w));
        }
        for (name, v) in base.named_parameters() {
            assert!(grads.get(&v).is_none(), "frozen `{name}` got a gradient");
        }

        // Merged: one matrix product, the same outputs.
        let merged: Linear = l.merge().unwrap();
        assert!(max_abs(&(merged.forward(x).unwrap() - &y).unwrap()) <= 1e-5);
    }
}

#[test]
fn a_bf16_base_trains_f32_adapters() {
    let config = LoraConfig::new(2, 4.0);
    let adapters = VarMap::new();
    let (_base, l) = layer(&config, DType::BF16, &adapters);
    set_all(&adapters, 5);
    assert_eq!(l.lora().a().dtype(), DType::F32);
    let x = det(&[3, 6], 2).to_dtype(DType::BF16).unwrap();
    let y = l.forward_t(&x, true).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let grads = y
        .to_dtype(DType::F32)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for v in adapters.all_vars() {
        assert_eq!(grads.get(&v).unwrap().dtype(), DType::F32);
    }
    let merged = l.merge().unwrap();
    assert_eq!(merged.weight().dtype(), DType::BF16);
}

#[test]
fn adapter_dropout_under_checkpointing_gives_the_plain_gradients() {
    let config = LoraConfig::new(4, 8.0).dropout(0.3);
    let adapters = VarMap::new();
    let (_base, l) = layer(&config, DType::F32, &adapters);
    set_all(&adapters, 3);
    let x = det(&[8, 6], 4);
    let run = |checkpointed: bool| {
        nn::set_dropout_seed(5);
        let y = if checkpointed {
            let l = l.clone();
            nn::checkpoint_fn(move |x| l.forward_t(x, true), &x).unwrap()
        } else {
            l.forward_t(&x, true).unwrap()
        };
        let grads = nn::backward(&y.sqr().unwrap().sum_all().unwrap()).unwrap();
        let mut out: Vec<(String, Vec<f32>)> = adapters
            .named_parameters()
            .into_iter()
            .map(|(n, v)| {
                let g = grads.get(&v).unwrap().flatten_all().unwrap();
                (n, g.to_vec1::<f32>().unwrap())
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        (y.flatten_all().unwrap().to_vec1::<f32>().unwrap(), out)
    };
    let (plain, checkpointed) = (run(false), run(true));
    assert_eq!(plain, checkpointed);
    // The dropout draws: without it the output differs.
    let no_drop = l.forward(&x).unwrap().flatten_all().unwrap();
    assert_ne!(plain.0, no_drop.to_vec1::<f32>().unwrap());
}

#[test]
fn target_modules_follow_peft_rules_and_configs_round_trip() {
    let names = LoraConfig::new(8, 16.0).target_modules(["q_proj", "mlp.up"]);
    assert!(names.matches("model.layers.0.self_attn.q_proj").unwrap());
    assert!(names.matches("q_proj").unwrap());
    assert!(!names.matches("model.layers.0.self_attn.xq_proj").unwrap());
    assert!(names.matches("layers.1.mlp.up").unwrap());
    assert!(!names.matches("layers.1.xmlp.up").unwrap());
    let re = LoraConfig::new(8, 16.0).target_regex(r".*\.(q|v)_proj");
    assert!(re.matches("model.layers.0.self_attn.v_proj").unwrap());
    assert!(!re.matches("model.layers.0.self_attn.v_proj.x").unwrap());
    assert!(LoraConfig::new(8, 16.0)
        .all_linear()
        .matches("anything")
        .unwrap());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter_config.json");
    for config in [
        names.clone().dropout(0.05).rslora(true),
        re.clone(),
        LoraConfig::new(2, 3.5).all_linear(),
    ] {
        let json = config.to_peft_json();
        let back = LoraConfig::from_peft_json(&path, &json).unwrap();
        let mut want = config.clone();
        if let TargetModules::Names(n) = &mut want.target_modules {
            n.sort();
        }
        assert_eq!(back, want);
    }
    let bad = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_dropout": 1.5});
    let e = LoraConfig::from_peft_json(&path, &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("adapter_config.json") && e.contains("dropout"),
        "{e}"
    );
    let bad = serde_json::json!({"peft_type": "LORA", "r": "four"});
    let e = LoraConfig::from_peft_json(&path, &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`r`"), "{e}");
}

#[test]
fn user_adapters_save_and_load_as_peft_folders() {
    let config = LoraConfig::new(2, 4.0).target_modules(["fc"]);
    let adapters = VarMap::new();
    let (_base, _l) = layer(&config, DType::F32, &adapters);
    set_all(&adapters, 8);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adapter");
    save_adapter(&out, &config.to_peft_json(), &adapters).unwrap();
    let file = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &DEV).unwrap();
    let mut names: Vec<&String> = file.keys().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "base_model.model.fc.lora_A.weight",
            "base_model.model.fc.lora_B.weight"
        ]
    );
    let (read, _) = read_adapter_config(&out).unwrap();
    assert_eq!(read, config);

    let fresh = VarMap::new();
    let (_b, _l2) = layer(&config, DType::F32, &fresh);
    load_adapter(&out, &fresh).unwrap();
    for ((_, a), (_, b)) in adapters
        .named_parameters()
        .iter()
        .zip(fresh.named_parameters().iter())
    {
        assert_eq!(max_abs(&(a.as_tensor() - b.as_tensor()).unwrap()), 0.0);
    }
    // Another layer's adapters do not load into these: named in the error.
    let other = VarMap::new();
    let base = VarMap::new();
    let fc2 = linear(
        6,
        5,
        VarBuilder::from_varmap(&base, DType::F32, &DEV).pp("fc2"),
    )
    .unwrap();
    let vb = VarBuilder::from_varmap(&other, DType::F32, &DEV);
    LoraLinear::new(fc2, &config, vb.pp("fc2")).unwrap();
    let e = load_adapter(&out, &other).unwrap_err().to_string();
    assert!(
        e.contains("fc2.lora_A.weight") || e.contains("fc.lora_A.weight"),
        "{e}"
    );
}

/// Two `LoraLinear` layers with a ReLU between, a mean squared error: rank `rank` of `world`
/// trains the adapters on its rows for 3 steps. Returns the adapters and the bytes reduced.
fn train(acc: Accelerator) -> (HashMap<String, Vec<f32>>, u64, usize) {
    let config = LoraConfig::new(2, 4.0);
    let (base, adapters) = (VarMap::new(), VarMap::new());
    let vb = VarBuilder::from_varmap(&base, DType::F32, &DEV);
    let fc1 = linear(6, 16, vb.pp("fc1")).unwrap();
    let fc2 = linear(16, 3, vb.pp("fc2")).unwrap();
    set_all(&base, 11);
    let avb = VarBuilder::from_varmap(&adapters, DType::F32, &DEV);
    let fc1 = LoraLinear::new(fc1, &config, avb.pp("fc1")).unwrap();
    let fc2 = LoraLinear::new(fc2, &config, avb.pp("fc2")).unwrap();
    set_all(&adapters, 40);
    let x = acc.shard_rows(&det(&[8, 6], 1)).unwrap();
    let y = acc.shard_rows(&det(&[8, 3], 2)).unwrap();
    acc.prepare_model(&adapters).unwrap();
    let mut opt = acc.prepare_optimizer(AdamW::new_lr(adapters.all_vars(), 1e-2).unwrap());
    for _ in 0..3 {
        let h = nn::relu(&fc1.forward_t(&x, true).unwrap()).unwrap();
        let loss = candle_nn::loss::mse(&fc2.forward_t(&h, true).unwrap(), &y).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    let out = adapters
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    let elems = adapters.all_vars().iter().map(|v| v.elem_count()).sum();
    (out, acc.gradient_bytes_reduced(), elems)
}

fn on_ranks(n: usize) -> Vec<(HashMap<String, Vec<f32>>, u64, usize)> {
    in_process_with(
        n,
        |c| {
            Accelerator::builder()
                .collective(c)
                .cpu(true)
                .missing_gradients(MissingGradients::Error)
        },
        train,
    )
}

#[test]
fn two_ranks_train_user_adapters_as_one_and_reduce_only_them() {
    let one = on_ranks(1);
    let two = on_ranks(2);
    let (single, bytes, n_elems) = &one[0];
    assert_eq!(*bytes, 0);
    for (rank, (adapters, bytes, _)) in two.iter().enumerate() {
        for (name, want) in single {
            let got = &adapters[name];
            let diff = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff <= 1e-6, "rank {rank}: `{name}` differs by {diff:e}");
        }
        // 3 steps of 4 adapter tensors (f32) plus their presence flags; the frozen base's
        // 6·16 + 16 + 16·3 + 3 elements never travel.
        assert_eq!(*bytes, 3 * 4 * (*n_elems as u64 + 4), "rank {rank}");
    }
}
