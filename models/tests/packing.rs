//! Packed rows (`chat::Packer`, `Inputs::position_ids` / `document_ids`) on every architecture
//! fixture: the packed forward pass of a row equals each document run alone (logits within
//! 1e-5), and the loss over a packed row is the token-weighted mean of the documents' losses;
//! and the attention backends (tiled flash attention on the CPU, the composed reference) agree,
//! forward and every gradient, with padding, sliding windows, GQA and documents.

mod common;

use accelerate_rs::Parameters;
use accelerate_rs_models::chat::{PackedBatch, Packer};
use accelerate_rs_models::{AttentionBackend, AutoModel, Inputs, Task};
use candle_core::{DType, Device, Tensor};
use common::{fixture, max_abs, rel_diff, ARCHS};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn load(name: &str) -> AutoModel {
    AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap()
}

/// Random documents of `lens` tokens in the model's vocabulary (ids from 1: 0 is a pad id).
fn documents(model: &AutoModel, lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let vocab = model.config_json()["vocab_size"].as_u64().unwrap() as u32;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lens.iter()
        .map(|&n| (0..n).map(|_| rng.random_range(1..vocab)).collect())
        .collect()
}

/// The documents packed into one row of `seq_len` (labels: every token).
fn packed(docs: &[Vec<u32>], seq_len: usize) -> PackedBatch {
    let labels: Vec<Vec<i64>> = docs
        .iter()
        .map(|d| d.iter().map(|&t| t as i64).collect())
        .collect();
    let rows = Packer::new(seq_len)
        .unwrap()
        .pack_all(docs.iter().zip(&labels).map(|(d, l)| (&d[..], &l[..])))
        .unwrap();
    assert_eq!(rows.len(), 1, "the documents fit one row");
    assert_eq!(rows[0].documents(), docs.len());
    PackedBatch::new(&rows, &Device::Cpu).unwrap()
}

fn row(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

/// The causal language-model loss of `logits` `[1, T, V]` against `labels` (shifted; -100
/// ignored), summed, and the number of targets (no auxiliary loss).
fn summed_loss(logits: &Tensor, labels: &[i64]) -> (f64, usize) {
    let logits = logits.get(0).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, 1).unwrap();
    let logp = logp.to_vec2::<f32>().unwrap();
    let (mut sum, mut n) = (0f64, 0usize);
    for t in 0..labels.len() - 1 {
        if labels[t + 1] >= 0 {
            sum -= logp[t][labels[t + 1] as usize] as f64;
            n += 1;
        }
    }
    (sum, n)
}

/// The packed forward pass of a row (three documents and padding) equals each document run
/// alone, on every architecture; the packed loss is the documents' token-weighted mean.
#[test]
fn packed_rows_equal_documents_run_alone() {
    for &name in ARCHS {
        let model = load(name);
        if model.task() == Task::SequenceClassification {
            continue; // one label per row: nothing per document to compare
        }
        // Documents longer than the sliding windows (4 and 6 tokens) of the fixtures that have
        // one, and padding: in a row of 16 for GPT-2 and BERT (16 positions), else of 24 with
        // every document longer than Phi-3's `original_max_position_embeddings` (4): `longrope`
        // picks its factors by the longest position of the row, as `transformers` does from
        // `position_ids`, so a shorter document would rotate differently alone.
        let (lens, seq_len): (&[usize], usize) = match name {
            "gpt2" | "bert_mlm" => (&[7, 5, 2], 16),
            _ => (&[9, 6, 5], 24),
        };
        let docs = documents(&model, lens, 7);
        let batch = packed(&docs, seq_len);
        let logits = model.forward_with(&batch.inputs()).unwrap();
        let labels = batch.labels.get(0).unwrap().to_vec1::<i64>().unwrap();
        let mut start = 0;
        let (mut sum, mut n) = (0f64, 0usize);
        for doc in &docs {
            let alone = model.forward(&row(doc), None).unwrap();
            let part = logits.narrow(1, start, doc.len()).unwrap();
            let d = rel_diff(&part, &alone);
            assert!(
                d <= 1e-5,
                "{name}: packed logits differ from the document's by {d:e}"
            );
            if model.task() == Task::CausalLm {
                let own: Vec<i64> = doc.iter().map(|&t| t as i64).collect();
                let (s, k) = summed_loss(&alone, &own);
                (sum, n) = (sum + s, n + k);
            }
            start += doc.len();
        }
        if model.task() != Task::CausalLm {
            continue;
        }
        // No loss across a boundary: the packed row's targets are the documents' own.
        let (packed_sum, packed_n) = summed_loss(&logits, &labels);
        assert_eq!(packed_n, n, "{name}: targets of the packed row");
        assert!(
            (packed_sum - sum).abs() <= 1e-5 * sum.abs(),
            "{name}: packed loss sum {packed_sum}, documents' {sum}"
        );
        let aux = model.config_json()["output_router_logits"].as_bool() == Some(true);
        if !aux {
            // The model's own loss (the mean over the row's targets) is the token-weighted mean.
            let loss = model.loss_with(&batch.inputs(), &batch.labels).unwrap();
            let loss = loss.to_scalar::<f32>().unwrap() as f64;
            let want = sum / n as f64;
            assert!(
                (loss - want).abs() <= 1e-5 * want,
                "{name}: packed loss {loss}, token-weighted mean of the documents' {want}"
            );
        }
    }
}

/// Position ids alone move a document: `0..T` given explicitly is the default.
#[test]
fn explicit_default_positions_change_nothing() {
    for &name in ARCHS {
        let model = load(name);
        let doc = documents(&model, &[9], 3).remove(0);
        let ids = row(&doc);
        let pos = Tensor::arange(0u32, doc.len() as u32, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let a = model.forward(&ids, None).unwrap();
        let b = model
            .forward_with(&Inputs::new(&ids).position_ids(Some(&pos)))
            .unwrap();
        assert!(rel_diff(&b, &a) <= 1e-6, "{name}");
    }
}

/// Bad position or document ids are errors naming them.
#[test]
fn bad_packing_inputs_are_named() {
    let model = load("llama");
    let ids = row(&[1, 2, 3, 4]);
    let wrong = Tensor::new(&[[0u32, 1, 2]], &Device::Cpu).unwrap();
    let floats = Tensor::new(&[[0f32, 1., 2., 3.]], &Device::Cpu).unwrap();
    let negative = Tensor::new(&[[0i64, 1, -2, 3]], &Device::Cpu).unwrap();
    let cases = [
        (Inputs::new(&ids).position_ids(Some(&wrong)), "position_ids"),
        (
            Inputs::new(&ids).position_ids(Some(&floats)),
            "position_ids",
        ),
        (Inputs::new(&ids).position_ids(Some(&negative)), "negative"),
        (Inputs::new(&ids).document_ids(Some(&wrong)), "document_ids"),
    ];
    for (inputs, what) in cases {
        let e = model.forward_with(&inputs).unwrap_err().to_string();
        assert!(e.contains(what), "{what}: {e}");
    }
    // GPT-2: a position past n_positions (16).
    let gpt2 = load("gpt2");
    let far = Tensor::new(&[[0u32, 1, 2, 16]], &Device::Cpu).unwrap();
    let e = gpt2
        .forward_with(&Inputs::new(&ids).position_ids(Some(&far)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("n_positions"), "{e}");
}

/// Flash attention (the default on the CPU) and the composed reference agree on every
/// architecture: logits and every parameter's gradient, on a padded batch and on a packed row.
#[test]
fn flash_and_composed_attention_agree() {
    for &name in ARCHS {
        let mut model = load(name);
        model.train(true); // dropout 0 in the fixtures: deterministic
        let docs = documents(&model, &[6, 5, 3], 11);
        let batch = packed(&docs, 16);
        let padded_ids =
            Tensor::new(&[[3u32, 5, 7, 9, 11, 13], [2, 4, 6, 8, 0, 0]], &Device::Cpu).unwrap();
        let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], &Device::Cpu).unwrap();
        let padded = Inputs::new(&padded_ids).attention_mask(Some(&mask));
        for (case, inputs) in [("padded", padded), ("packed", batch.inputs())] {
            let run = |backend| {
                let mut m = model.clone();
                m.set_attention_backend(backend);
                let logits = m.forward_with(&inputs).unwrap();
                let labels = match m.task() {
                    Task::SequenceClassification => {
                        Tensor::zeros(inputs.input_ids.dim(0).unwrap(), DType::I64, &Device::Cpu)
                            .unwrap()
                    }
                    _ => inputs.input_ids.to_dtype(DType::I64).unwrap(),
                };
                let loss = m.loss_with(&inputs, &labels).unwrap();
                let grads = loss.backward().unwrap();
                let params = m.varmap().named_parameters();
                let g: Vec<(String, Tensor)> = params
                    .iter()
                    .map(|(n, v)| (n.clone(), grads.get(v).unwrap().clone()))
                    .collect();
                (logits, g)
            };
            let (flash, flash_grads) = run(AttentionBackend::Auto);
            let (composed, composed_grads) = run(AttentionBackend::Composed);
            let d = rel_diff(&flash, &composed);
            assert!(d <= 1e-5, "{name} {case}: logits differ by {d:e}");
            let scale = composed_grads
                .iter()
                .map(|(_, g)| max_abs(g))
                .fold(0.0, f32::max);
            for ((pname, a), (_, b)) in flash_grads.iter().zip(&composed_grads) {
                let diff = max_abs(&(a - b).unwrap());
                // (Rounding noise around an exact zero, such as attention key biases' gradients,
                // is held to the model's gradient scale.)
                let tol = 1e-4 * max_abs(b) + 1e-6 * scale;
                assert!(
                    diff <= tol,
                    "{name} {case}: gradient of `{pname}` differs by {diff:e} (tolerance {tol:e})"
                );
            }
        }
    }
}
