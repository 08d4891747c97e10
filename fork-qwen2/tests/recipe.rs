//! docs/candle-transformers.md's recipe, as a user meets it: the forked Qwen2 of this crate,
//! loaded from folders `transformers` wrote (tied and untied heads), trains every tensor through
//! `Accelerator::prepare` (`missing_gradients = error`), the same on one process and two
//! (split batches), and the folder it saves loads in `accelerate-rs-models` with its logits.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use accelerate_rs::collective::{Collective, ThreadGroup};
use accelerate_rs::nn::{cross_entropy_with, CrossEntropyOptions};
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, DataLoader, MissingGradients, TensorDataset};
use candle::{DType, Device, Tensor};
use candle_nn::VarMap;
use fork_qwen2::qwen2::{Config, ModelForCausalLM};

const SEQ: usize = 16;
const STEPS: usize = 12;

/// The tiny Qwen2 folder `scripts/hf_reference.py` made with `transformers` 5 (a tied head,
/// `sliding_window: null`, `rope_theta` under `rope_parameters`).
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/qwen2")
}

/// The fixture with an untied head: `tie_word_embeddings` false and an `lm_head.weight` of its
/// own (27 tensors), the case where `vb.contains_tensor` used to tie it silently.
fn untied(dir: &Path) -> PathBuf {
    let src = fixture();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["tie_word_embeddings"] = serde_json::json!(false);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut weights =
        candle::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let embed = weights["model.embed_tokens.weight"].clone();
    weights.insert(
        "lm_head.weight".into(),
        (embed.flip(&[0]).unwrap() * 0.5).unwrap(),
    );
    candle::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// Windows of a repeating token pattern (learnable), `[n, SEQ]`.
fn windows(n: usize, offset: usize) -> Tensor {
    let v: Vec<u32> = (0..n * SEQ)
        .map(|i| (((i / SEQ + offset) * 7 + (i % SEQ) * 3) % 64) as u32)
        .collect();
    Tensor::from_vec(v, (n, SEQ), &Device::Cpu).unwrap()
}

/// The next-token loss over every position (the fork returns every position's logits).
fn loss(model: &mut ModelForCausalLM, ids: &Tensor) -> candle::Result<Tensor> {
    let logits = model.forward_train(ids)?;
    let (b, t, v) = logits.dims3()?;
    let x = logits.narrow(1, 0, t - 1)?.reshape((b * (t - 1), v))?;
    let y = ids.narrow(1, 1, t - 1)?.flatten_all()?;
    cross_entropy_with(&x, &y, CrossEntropyOptions::default())
}

/// The forked model over a fresh VarMap from `acc.var_builder`, the folder's weights loaded.
fn load(acc: &Accelerator, dir: &Path) -> (ModelForCausalLM, VarMap, Config) {
    let cfg =
        Config::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let varmap = VarMap::new();
    let model = ModelForCausalLM::new(&cfg, acc.var_builder(&varmap, DType::F32)).unwrap();
    accelerate_rs::weights::load_weights_mapped(dir, &varmap, |n| Some(n.to_string())).unwrap();
    (model, varmap, cfg)
}

/// `STEPS` AdamW steps on one rank's accelerator: the losses of rank 0's batches, the trained
/// tensors, and whether each changed.
fn train(acc: &Accelerator, dir: &Path, out: Option<&Path>) -> (Vec<f32>, Vec<(String, Tensor)>) {
    let (mut model, varmap, _) = load(acc, dir);
    let before: Vec<(String, Tensor)> = named(&varmap);
    let data = TensorDataset::new(vec![windows(STEPS * 4, 0)]).unwrap();
    let opt = AdamW::new_lr(varmap.all_vars(), 1e-2).unwrap();
    let (mut opt, loader) = acc.prepare(&varmap, opt, DataLoader::new(data, 4)).unwrap();
    let mut losses = Vec::new();
    for batch in loader.iter().unwrap() {
        let l = loss(&mut model, &batch.unwrap()[0]).unwrap();
        losses.push(acc.average(l.to_scalar::<f32>().unwrap() as f64).unwrap() as f32);
        opt.backward_step(&l).unwrap();
    }
    let after = named(&varmap);
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        let moved = (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(moved > 0.0, "`{name}` did not train");
    }
    if let Some(out) = out {
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        acc.save_model_with_config(out, &varmap, &config, 5 << 30)
            .unwrap();
    }
    (losses, after)
}

fn named(varmap: &VarMap) -> Vec<(String, Tensor)> {
    let data = varmap.data().lock().unwrap();
    let mut v: Vec<_> = data
        .iter()
        .map(|(n, t)| (n.clone(), t.as_tensor().copy().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `world` in-process ranks with split batches and `missing_gradients = error`: rank 0's
/// losses and tensors.
fn run(world: usize, dir: &Path, out: Option<PathBuf>) -> (Vec<f32>, Vec<(String, Tensor)>) {
    let handles: Vec<_> = ThreadGroup::new(world, Duration::from_secs(120))
        .unwrap()
        .into_iter()
        .map(|c| {
            let (dir, out) = (dir.to_path_buf(), out.clone());
            std::thread::spawn(move || {
                let c: Arc<dyn Collective> = Arc::new(c);
                let acc = Accelerator::builder()
                    .collective(c)
                    .split_batches(true)
                    .missing_gradients(MissingGradients::Error)
                    .build()
                    .unwrap();
                acc.set_seed(0).unwrap();
                train(&acc, &dir, out.as_deref())
            })
        })
        .collect();
    let mut all: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    all.swap_remove(0)
}

#[test]
fn the_forked_qwen2_trains_every_tensor_on_1_and_2_processes_and_saves_a_loadable_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let untied_dir = tmp.path().join("untied");
    std::fs::create_dir(&untied_dir).unwrap();
    for (dir, tensors) in [(fixture(), 26), (untied(&untied_dir), 27)] {
        let out = tmp.path().join(format!("out-{tensors}"));
        let (one, w1) = run(1, &dir, None);
        let (two, w2) = run(2, &dir, Some(out.clone()));
        assert_eq!(w1.len(), tensors, "{}", dir.display());
        assert!(one.last() < one.first(), "the loss did not fall: {one:?}");
        for (a, b) in one.iter().zip(&two) {
            assert!((a - b).abs() <= 1e-5, "1 vs 2 processes: {one:?} {two:?}");
        }
        for ((n, a), (_, b)) in w1.iter().zip(&w2) {
            let d = (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d <= 1e-5, "`{n}`: 1 vs 2 processes differ by {d}");
        }
        // The saved folder is a Hugging Face folder: accelerate-rs-models' Qwen2 (checked
        // against transformers) gives the forked model's logits.
        let ids = windows(2, 3);
        let theirs =
            accelerate_rs_models::AutoModel::from_pretrained(&out, &Device::Cpu, DType::F32)
                .unwrap()
                .forward(&ids, None)
                .unwrap();
        let acc = Accelerator::builder().cpu(true).build().unwrap();
        let (mut ours, _, _) = load(&acc, &out);
        let d = (ours.forward_train(&ids).unwrap() - theirs)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d <= 1e-4, "saved folder: logits differ by {d}");
    }
}

/// A forgotten `clear_kv_cache` between two training forwards of Candle's own `forward` fails
/// loudly (the page's warning): the scores grow with the cache, the mask does not.
#[test]
fn candle_forward_twice_without_clearing_the_cache_fails_with_a_shape_mismatch() {
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    let (mut model, _, _) = load(&acc, &fixture());
    let ids = windows(1, 0);
    let (b, t) = ids.dims2().unwrap();
    // `Model::forward` at offset 0 twice, as a training loop calling Candle's forward would.
    assert!(model.forward(&ids, 0).is_ok());
    assert!(
        model.forward(&ids, 0).is_err(),
        "[{b}, {t}] twice did not fail"
    );
    model.clear_kv_cache();
    assert!(model.forward(&ids, 0).is_ok());
}
