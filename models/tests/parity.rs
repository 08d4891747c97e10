//! Parity with Hugging Face `transformers` (PyTorch), against the golden files of
//! `scripts/hf_reference.py fixtures` (committed under `tests/fixtures`): for every
//! architecture, the logits and the loss within 1e-5 (relative to their scale, f32), every
//! parameter's gradient within 1e-4, and the parameters after three AdamW steps within 1e-5.
//! On the CPU, or on a GPU with `ACCELERATE_RS_TEST_DEVICE=cuda` (the `*_matches_transformers`
//! tests; `scripts/gpu-smoke.sh`).

mod common;

use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, MissingGradients, Parameters};
use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use common::{adamw_params, fixture, golden, golden_on, max_abs, rel_diff, test_device, ARCHS};

fn load(name: &str, device: &Device) -> AutoModel {
    let mut model = AutoModel::from_pretrained(fixture(name), device, DType::F32).unwrap();
    model.train(true); // as the reference (dropout 0: deterministic)
    model
}

fn parity(name: &str) {
    let device = test_device();
    let g = golden_on(name, &device);
    let model = load(name, &device);
    let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);

    let logits = model.forward(ids, Some(mask)).unwrap();
    let d = rel_diff(&logits, &g["logits"]);
    assert!(d <= 1e-5, "{name}: logits differ by {d:e} (relative)");

    let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
    let d = rel_diff(&loss.reshape(1).unwrap(), &g["loss"]);
    assert!(d <= 1e-5, "{name}: loss differs by {d:e} (relative)");

    // Every parameter's gradient, under the checkpoint's names, and no other.
    let grads = loss.backward().unwrap();
    let params = model.varmap().named_parameters();
    let mut golden_names: Vec<&str> = g.keys().filter_map(|k| k.strip_prefix("grad.")).collect();
    golden_names.sort_unstable();
    let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names, golden_names,
        "{name}: parameter names differ from transformers'"
    );
    // The model's gradient scale: a tensor whose gradient is rounding noise around an exact
    // zero (attention key biases: the softmax does not see them) is compared to it.
    let scale = params
        .iter()
        .map(|(n, _)| max_abs(&g[&format!("grad.{n}")]))
        .fold(0.0, f32::max);
    for (pname, var) in &params {
        let grad = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: `{pname}` got no gradient"));
        let want = &g[&format!("grad.{pname}")];
        let diff = max_abs(&(grad - want).unwrap());
        let tol = 1e-4 * max_abs(want).max(1e-3 * scale);
        assert!(
            diff <= tol,
            "{name}: gradient of `{pname}` differs by {diff:e} (tolerance {tol:e})"
        );
    }

    let first_grads: std::collections::HashMap<&str, Tensor> = params
        .iter()
        .map(|(n, v)| (n.as_str(), grads.get(v).unwrap().clone()))
        .collect();

    // Three AdamW steps on the same batch.
    let vars = params.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = AdamW::new(vars, adamw_params()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..3 {
        let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let want = g["step_losses"].to_vec1::<f32>().unwrap();
    for (got, want) in losses.iter().zip(&want) {
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{name}: step losses {losses:?}, transformers {want:?}"
        );
    }
    // Elements whose first gradient is rounding noise around an exact zero (attention key
    // biases: the softmax does not see them), or below 1e-5 of the model's gradient scale,
    // can get Adam steps of ±lr in either direction (Adam's normalization turns noise into
    // full steps): they are held to 2·lr per step, and must be rare (at most 1% of the model).
    let (mut loose, mut total) = (0f32, 0usize);
    let floor = 1e-5 * scale;
    for (pname, var) in &params {
        let want = &g[&format!("step3.{pname}")];
        let grad0 = g[&format!("grad.{pname}")].abs().unwrap();
        let ours0 = first_grads[pname.as_str()].abs().unwrap();
        let diff = (var.as_tensor() - want).unwrap().abs().unwrap();
        // (A tensor whose gradient is exactly zero on both sides, such as an expert no token
        // chose, moves by weight decay alone, the same on both sides: held strictly.)
        let exact_zero = max_abs(&grad0) == 0.0 && max_abs(&ours0) == 0.0;
        let noise = if max_abs(&grad0) < floor && max_abs(&ours0) < floor && !exact_zero {
            // The whole tensor's gradient is noise (a key bias): an element that happens to
            // be an exact zero in the first step is noise in the next ones.
            grad0.ones_like().unwrap().to_dtype(DType::U8).unwrap()
        } else {
            // Below the floor, and not an exact zero on both sides (rows of unused tokens:
            // only weight decay moves them, the same on both sides).
            let nonzero = (&grad0 + &ours0).unwrap().gt(0.0).unwrap();
            nonzero.mul(&grad0.lt(floor as f64).unwrap()).unwrap()
        };
        let strict = 1e-5 * max_abs(want);
        let tol = noise
            .where_cond(
                &Tensor::full(2.0 * 3.0 * 1e-3f32, want.shape(), &device).unwrap(),
                &Tensor::full(strict, want.shape(), &device).unwrap(),
            )
            .unwrap();
        let bad = diff
            .gt(&tol)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap();
        let bad = bad.to_scalar::<f32>().unwrap();
        assert!(
            bad == 0.0,
            "{name}: `{pname}` after 3 AdamW steps: {bad} elements differ by more than 1e-5 \
             (relative); max difference {:e}",
            max_abs(&diff)
        );
        loose += noise
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        total += want.elem_count();
    }
    assert!(
        loose <= 0.01 * total as f32,
        "{name}: {loose} of {total} elements have noise-level gradients"
    );
}

#[test]
fn llama_gqa_llama3_rope_matches_transformers() {
    parity("llama");
}

#[test]
fn llama_tied_with_biases_matches_transformers() {
    parity("llama_tied");
}

#[test]
fn mistral_sliding_window_matches_transformers() {
    parity("mistral");
}

#[test]
fn qwen2_matches_transformers() {
    parity("qwen2");
}

#[test]
fn qwen3_qk_norms_head_dim_window_matches_transformers() {
    parity("qwen3");
}

#[test]
fn gemma2_softcapping_window_scaled_embeddings_matches_transformers() {
    parity("gemma2");
}

#[test]
fn gemma3_qk_norms_local_global_rope_matches_transformers() {
    parity("gemma3");
}

#[test]
fn mixtral_router_aux_loss_window_matches_transformers() {
    parity("mixtral");
}

#[test]
fn qwen3_moe_dense_and_sparse_layers_match_transformers() {
    parity("qwen3_moe");
}

#[test]
fn qwen2_moe_shared_expert_matches_transformers() {
    parity("qwen2_moe");
}

#[test]
fn phi3_fused_projections_longrope_matches_transformers() {
    parity("phi3");
}

#[test]
fn gpt2_matches_transformers() {
    parity("gpt2");
}

#[test]
fn bert_masked_lm_matches_transformers() {
    parity("bert_mlm");
}

#[test]
fn bert_sequence_classification_matches_transformers() {
    parity("bert_cls");
}

/// Every parameter of every architecture gets a nonzero gradient, in training mode with
/// dropout on (the composed attention path) as well as off, and the accelerator's check for
/// parameters without a gradient (set to fail) stays silent through `prepare`/`backward_step`.
#[test]
fn every_parameter_of_every_architecture_gets_a_gradient() {
    for name in ARCHS {
        let g = golden(name);
        let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);
        for dropout in [false, true] {
            let dir = if dropout {
                common::with_dropout(name)
            } else {
                (None, fixture(name))
            };
            let mut model = AutoModel::from_pretrained(&dir.1, &Device::Cpu, DType::F32).unwrap();
            model.train(true);
            let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
            let grads = loss.backward().unwrap();
            let mut without = Vec::new();
            for (pname, var) in model.varmap().named_parameters() {
                let norm = grads.get(&var).map(|g| {
                    g.abs()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                });
                // An expert no token chose gets a zero gradient (as in `transformers`, whose
                // experts are one tensor), not none.
                let unchosen_expert = pname.contains(".experts.") && norm.is_some();
                if !norm.is_some_and(|n| n > 0.0) && !unchosen_expert {
                    without.push(pname);
                }
            }
            assert!(
                without.is_empty(),
                "{name} (dropout {dropout}): no gradient for {without:?}"
            );
            // Through the accelerator, with missing gradients an error.
            let accelerator = Accelerator::builder()
                .rank(0)
                .world_size(1)
                .cpu(true)
                .missing_gradients(MissingGradients::Error)
                .build()
                .unwrap();
            let vars = model.varmap().all_vars();
            accelerator.prepare_model(model.varmap()).unwrap();
            let mut opt = accelerator.prepare_optimizer(AdamW::new(vars, adamw_params()).unwrap());
            let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
            opt.backward_step(&loss)
                .unwrap_or_else(|e| panic!("{name} (dropout {dropout}): {e}"));
        }
    }
}

/// The fused attention and the composed one (used for sliding windows and attention dropout)
/// agree: Mistral's window of 4 covers the whole sequence when it is 4 tokens long.
#[test]
fn short_sequences_inside_the_sliding_window_match_full_attention() {
    let mistral = load("mistral", &Device::Cpu);
    let g = golden("mistral");
    let ids = g["input_ids"].narrow(1, 0, 4).unwrap();
    let a = mistral.forward(&ids, None).unwrap();
    // The same weights as a Llama without a window.
    let (_tmp, dir) = common::copy_fixture("mistral");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"sliding_window\": 4", "\"sliding_window\": null");
    std::fs::write(&path, text).unwrap();
    let full = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    let b = full.forward(&ids, None).unwrap();
    assert!(rel_diff(&a, &b) <= 1e-6);
    let long = mistral.forward(&g["input_ids"], None).unwrap();
    let long_full = full.forward(&g["input_ids"], None).unwrap();
    assert!(
        rel_diff(&long, &long_full) > 1e-4,
        "the window must cut at 8 tokens"
    );
}
