//! LoRA against `peft`, with the golden files of `scripts/hf_reference.py lora` (committed under
//! `tests/fixtures/lora_*`): PEFT's adapter folder loads here with the same logits, loss,
//! adapter gradients and merged weights, and three AdamW steps on the adapter alone land where
//! PyTorch's do; ours saves as PEFT writes it; the base stays frozen (no gradient, nothing but
//! the adapters all-reduced) and 2 ranks train exactly as 1.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use accelerate_rs::collective::ThreadGroup;
use accelerate_rs::nn::{self, LoraConfig};
use accelerate_rs::optim::AdamW;
use accelerate_rs::{Accelerator, MissingGradients, Parameters};
use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device, Tensor};
use candle_nn::Optimizer;
use common::{adamw_params, fixture, golden, max_abs, rel_diff};

/// The golden cases: (fixture, base fixture).
const CASES: &[(&str, &str)] = &[("lora_llama", "llama"), ("lora_gpt2", "gpt2")];

fn adapter_dir(name: &str) -> PathBuf {
    fixture(name).join("adapter")
}

/// The base fixture with PEFT's adapter loaded, in training mode (dropout 0: deterministic).
fn with_peft_adapter(name: &str, base: &str) -> AutoModel {
    let mut model = AutoModel::from_pretrained(fixture(base), &Device::Cpu, DType::F32).unwrap();
    model.load_adapter(adapter_dir(name)).unwrap();
    model.train(true);
    model
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn peft_adapters_load_with_peft_logits_gradients_steps_and_merged_weights() {
    for &(name, base) in CASES {
        let g = golden(name);
        let model = with_peft_adapter(name, base);
        let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);

        let logits = model.forward(ids, Some(mask)).unwrap();
        let d = rel_diff(&logits, &g["logits"]);
        assert!(d <= 1e-5, "{name}: logits differ by {d:e} (relative)");
        // The adapter matters: the base alone is far from these logits.
        let plain = AutoModel::from_pretrained(fixture(base), &Device::Cpu, DType::F32).unwrap();
        let d_base = rel_diff(&plain.forward(ids, Some(mask)).unwrap(), &g["logits"]);
        assert!(
            d_base > 1e-2,
            "{name}: the adapter changes nothing ({d_base:e})"
        );

        let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
        let d = rel_diff(&loss.reshape(1).unwrap(), &g["loss"]);
        assert!(d <= 1e-5, "{name}: loss differs by {d:e} (relative)");

        // The adapters' gradients, under PEFT's names, and nothing for the frozen base.
        let grads = nn::backward(&loss).unwrap();
        let adapters = model.trainable_parameters().named_parameters();
        let names: Vec<&str> = adapters.iter().map(|(n, _)| n.as_str()).collect();
        let mut want: Vec<&str> = g.keys().filter_map(|k| k.strip_prefix("grad.")).collect();
        want.sort_unstable();
        assert_eq!(names, want, "{name}: adapter names differ from peft's");
        for (pname, var) in &adapters {
            let grad = grads
                .get(var)
                .unwrap_or_else(|| panic!("{name}: `{pname}` got no gradient"));
            let want = &g[&format!("grad.{pname}")];
            let diff = max_abs(&(grad - want).unwrap());
            let tol = 1e-4 * max_abs(want);
            assert!(
                diff <= tol,
                "{name}: gradient of `{pname}` differs by {diff:e} (tolerance {tol:e})"
            );
        }
        for (pname, var) in model.varmap().named_parameters() {
            assert!(
                grads.get(&var).is_none(),
                "{name}: the frozen `{pname}` got a gradient"
            );
        }

        // Three AdamW steps on the adapters alone.
        let vars = model.trainable_parameters().all_vars();
        let mut opt = AdamW::new(vars, adamw_params()).unwrap();
        let mut losses = Vec::new();
        for _ in 0..3 {
            let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let grads = nn::backward(&loss).unwrap();
            opt.step(&grads).unwrap();
        }
        let want = g["step_losses"].to_vec1::<f32>().unwrap();
        for (got, want) in losses.iter().zip(&want) {
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{name}: step losses {losses:?}, peft {want:?}"
            );
        }
        for (pname, var) in &adapters {
            let want = &g[&format!("step3.{pname}")];
            let diff = max_abs(&(var.as_tensor() - want).unwrap());
            assert!(
                diff <= 1e-5 * max_abs(want),
                "{name}: `{pname}` after 3 AdamW steps differs by {diff:e}"
            );
        }

        // Merging gives PEFT's merged weights, and a plain folder with the adapter's logits.
        let mut merged = with_peft_adapter(name, base);
        merged.train(false);
        let before = merged.forward(ids, Some(mask)).unwrap();
        merged.merge_lora().unwrap();
        assert!(merged.lora_config().is_none());
        let params: BTreeMap<String, candle_core::Var> =
            merged.varmap().named_parameters().into_iter().collect();
        let mut n_merged = 0;
        for (key, want) in g.iter().filter(|(k, _)| k.starts_with("merged.")) {
            let pname = &key["merged.".len()..];
            let got = params[pname].as_tensor();
            let d = rel_diff(got, want);
            assert!(d <= 1e-6, "{name}: merged `{pname}` differs by {d:e}");
            n_merged += 1;
        }
        assert!(n_merged > 0);
        let after = merged.forward(ids, Some(mask)).unwrap();
        assert!(rel_diff(&after, &before) <= 1e-5, "{name}: merged logits");
        let tmp = tempfile::tempdir().unwrap();
        merged.save_pretrained(tmp.path().join("merged")).unwrap();
        let saved = tensors(&tmp.path().join("merged/model.safetensors"));
        assert!(saved.keys().all(|k| !k.contains("lora_")), "{name}");
        let back = AutoModel::from_pretrained(tmp.path().join("merged"), &Device::Cpu, DType::F32)
            .unwrap();
        assert!(rel_diff(&back.forward(ids, Some(mask)).unwrap(), &before) <= 1e-5);
        // After merging, every parameter trains again.
        merged.train(true);
        let loss = merged.loss_with_mask(ids, Some(mask), labels).unwrap();
        let grads = nn::backward(&loss).unwrap();
        for (pname, var) in merged.trainable_parameters().named_parameters() {
            assert!(grads.get(&var).is_some(), "{name}: `{pname}` after merging");
        }
    }
}

#[test]
fn saved_adapters_are_what_peft_writes() {
    for &(name, base) in CASES {
        let model = with_peft_adapter(name, base);
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("adapter");
        model.save_adapter(&out).unwrap();

        // The same tensors (names, shapes, values) as peft's file.
        let ours = tensors(&out.join("adapter_model.safetensors"));
        let peft = tensors(&adapter_dir(name).join("adapter_model.safetensors"));
        let mut a: Vec<&String> = ours.keys().collect();
        let mut b: Vec<&String> = peft.keys().collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}");
        assert!(a.iter().all(|k| k.starts_with("base_model.model.")));
        for (k, t) in &peft {
            assert_eq!(rel_diff(&ours[k], t), 0.0, "{name}: {k}");
        }

        // The settings peft reads, with the same values.
        let (ours, peft) = (
            json(&out.join("adapter_config.json")),
            json(&adapter_dir(name).join("adapter_config.json")),
        );
        for key in [
            "peft_type",
            "task_type",
            "r",
            "lora_alpha",
            "lora_dropout",
            "use_rslora",
            "fan_in_fan_out",
            "bias",
            "use_dora",
        ] {
            assert_eq!(ours[key], peft[key], "{name}: `{key}`");
        }
        let set = |v: &serde_json::Value| {
            let mut s: Vec<String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap().to_string())
                .collect();
            s.sort();
            s
        };
        assert_eq!(
            set(&ours["target_modules"]),
            set(&peft["target_modules"]),
            "{name}"
        );
        assert!(ours["base_model_name_or_path"]
            .as_str()
            .unwrap()
            .ends_with(base));

        // And it loads back here identically.
        let mut back = AutoModel::from_pretrained(fixture(base), &Device::Cpu, DType::F32).unwrap();
        back.load_adapter(&out).unwrap();
        let g = golden(name);
        let (ids, mask) = (&g["input_ids"], &g["attention_mask"]);
        let d = rel_diff(
            &back.forward(ids, Some(mask)).unwrap(),
            &model.forward(ids, Some(mask)).unwrap(),
        );
        assert_eq!(d, 0.0, "{name}");
    }
}

/// `peft` loads the adapters trained and saved here, with the logits computed here. Needs a
/// Python with torch, transformers and peft:
/// `ACCELERATE_RS_PYTHON=/work/venv/bin/python cargo test -p accelerate-rs-models --test lora -- --ignored`.
#[test]
#[ignore = "needs Python with peft: set ACCELERATE_RS_PYTHON and run with --ignored"]
fn peft_loads_adapters_trained_here() {
    let python = std::env::var("ACCELERATE_RS_PYTHON").expect("ACCELERATE_RS_PYTHON");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/hf_reference.py");
    for &(name, base) in CASES {
        let g = golden(name);
        let model = with_peft_adapter(name, base);
        let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);
        let mut opt = AdamW::new(model.trainable_parameters().all_vars(), adamw_params()).unwrap();
        for _ in 0..2 {
            let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
            opt.step(&nn::backward(&loss).unwrap()).unwrap();
        }
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join(name);
        model.save_adapter(&out).unwrap();
        let probe: HashMap<String, Tensor> = [
            ("input_ids".to_string(), ids.clone()),
            ("attention_mask".to_string(), mask.clone()),
            (
                "logits".to_string(),
                model.forward(ids, Some(mask)).unwrap(),
            ),
        ]
        .into_iter()
        .collect();
        candle_core::safetensors::save(&probe, out.join("probe.safetensors")).unwrap();
        let status = std::process::Command::new(&python)
            .arg(&script)
            .arg("check-adapter")
            .arg(&out)
            .arg("--base")
            .arg(fixture(base))
            .status()
            .unwrap();
        assert!(status.success(), "{name}: peft disagrees");
    }
}

#[test]
fn bad_adapter_folders_and_settings_are_errors_naming_the_culprit() {
    let load = |dir: &Path| {
        let mut m = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
        let r = m.load_adapter(dir).map_err(|e| e.to_string());
        // Nothing was added on failure.
        if r.is_err() {
            assert!(m.lora_config().is_none());
        }
        r
    };
    let tmp = tempfile::tempdir().unwrap();
    let copy = |tag: &str| {
        let dst = tmp.path().join(tag);
        std::fs::create_dir_all(&dst).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(adapter_dir("lora_llama").join(f), dst.join(f)).unwrap();
        }
        dst
    };
    let edit_config = |dir: &Path, key: &str, value: serde_json::Value| {
        let path = dir.join("adapter_config.json");
        let mut j = json(&path);
        j.as_object_mut().unwrap().insert(key.into(), value);
        std::fs::write(&path, j.to_string()).unwrap();
    };

    let e = load(&tmp.path().join("nowhere")).unwrap_err();
    assert!(e.contains("adapter_config.json"), "{e}");

    let d = copy("dora");
    edit_config(&d, "use_dora", true.into());
    let e = load(&d).unwrap_err();
    assert!(
        e.contains("use_dora") && e.contains("adapter_config.json"),
        "{e}"
    );

    let d = copy("patterns");
    edit_config(&d, "rank_pattern", serde_json::json!({"q_proj": 8}));
    let e = load(&d).unwrap_err();
    assert!(e.contains("rank_pattern"), "{e}");

    let d = copy("rank");
    edit_config(&d, "r", 2.into());
    let e = load(&d).unwrap_err();
    assert!(e.contains("lora_A.weight") && e.contains("shape"), "{e}");

    let d = copy("targets");
    edit_config(
        &d,
        "target_modules",
        serde_json::json!(["nothing_like_this"]),
    );
    let e = load(&d).unwrap_err();
    assert!(
        e.contains("nothing_like_this") && e.contains("q_proj"),
        "{e}"
    );

    let d = copy("fewer");
    edit_config(
        &d,
        "target_modules",
        serde_json::json!(["q_proj", "v_proj"]),
    );
    let e = load(&d).unwrap_err();
    assert!(e.contains("down_proj") && e.contains("unexpected"), "{e}");

    let d = copy("more");
    edit_config(
        &d,
        "target_modules",
        serde_json::json!(["q_proj", "v_proj", "down_proj", "k_proj"]),
    );
    let e = load(&d).unwrap_err();
    assert!(e.contains("k_proj") && e.contains("missing"), "{e}");

    let d = copy("not_lora");
    edit_config(&d, "peft_type", "IA3".into());
    let e = load(&d).unwrap_err();
    assert!(e.contains("peft_type") && e.contains("IA3"), "{e}");

    let d = copy("truncated");
    let f = d.join("adapter_model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let e = load(&d).unwrap_err();
    assert!(e.contains("adapter_model.safetensors"), "{e}");

    // Settings checked before anything is built.
    let mut m = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    for (config, word) in [
        (LoraConfig::new(0, 8.0), "rank"),
        (LoraConfig::new(4, 8.0).dropout(1.0), "dropout"),
        (
            LoraConfig::new(4, 8.0).target_regex("(unclosed"),
            "regular expression",
        ),
        (
            LoraConfig::new(4, 8.0).target_modules(["lm_head"]),
            "lm_head",
        ),
    ] {
        let e = m.add_lora(&config).unwrap_err().to_string();
        assert!(e.contains(word), "{e}");
        assert!(m.lora_config().is_none());
    }
    m.add_lora(&LoraConfig::new(4, 8.0)).unwrap();
    let e = m
        .add_lora(&LoraConfig::new(4, 8.0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("already has adapters"), "{e}");
    // PEFT's default targets for Llama.
    let names: Vec<String> = m
        .trainable_parameters()
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(names
        .iter()
        .all(|n| n.contains("q_proj") || n.contains("v_proj")));
    assert_eq!(names.len(), 2 * 2 * 2);
    let e = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32)
        .unwrap()
        .save_adapter(tmp.path().join("none"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no LoRA adapters"), "{e}");
}

/// Rank `rank` of `world` training the Llama adapter for 3 AdamW steps on its share of a
/// fixed batch (every row predicts the same number of tokens, so the mean over ranks is the
/// mean over the batch): the adapters afterwards and the bytes all-reduced.
fn train_adapters(acc: Accelerator, lora: bool) -> (HashMap<String, Tensor>, u64, usize) {
    let g = golden("lora_llama");
    let mut model = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
    if lora {
        model.load_adapter(adapter_dir("lora_llama")).unwrap();
    }
    model.train(true);
    let ids = g["input_ids"].clone();
    let labels = ids.to_dtype(DType::I64).unwrap();
    let rows = acc.shard_rows(&ids).unwrap();
    let labels = acc.shard_rows(&labels).unwrap();
    let trainable = model.trainable_parameters();
    acc.prepare_model(trainable).unwrap();
    let mut opt = acc.prepare_optimizer(AdamW::new(trainable.all_vars(), adamw_params()).unwrap());
    for _ in 0..3 {
        let loss = model.loss(&rows, &labels).unwrap();
        opt.backward_step(&loss).unwrap();
    }
    let after = trainable
        .named_parameters()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    let elems = trainable.all_vars().iter().map(|v| v.elem_count()).sum();
    (after, acc.gradient_bytes_reduced(), elems)
}

fn on_ranks(world: usize, lora: bool) -> Vec<(HashMap<String, Tensor>, u64, usize)> {
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
                train_adapters(acc, lora)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn two_ranks_train_the_adapters_as_one_and_all_reduce_only_them() {
    let one = on_ranks(1, true);
    let two = on_ranks(2, true);
    let (single, bytes1, n_adapter) = &one[0];
    assert_eq!(*bytes1, 0, "one rank reduces nothing");
    for (rank, (adapters, bytes, _)) in two.iter().enumerate() {
        for (name, t) in single {
            let d = rel_diff(&adapters[name], t);
            assert!(
                d <= 1e-5,
                "rank {rank}: `{name}` differs from one rank's by {d:e}"
            );
        }
        // 3 sync steps of the adapters' gradients (f32) and one presence flag per tensor.
        let n_tensors = single.len();
        assert_eq!(
            *bytes,
            3 * 4 * (*n_adapter + n_tensors) as u64,
            "rank {rank}"
        );
    }
    assert!(
        rel_diff(
            &two[0].0["model.layers.0.self_attn.q_proj.lora_B.weight"],
            &two[1].0["model.layers.0.self_attn.q_proj.lora_B.weight"]
        ) == 0.0
    );

    // Full fine-tuning of the same model all-reduces every parameter.
    let full = on_ranks(2, false);
    let (params, full_bytes, n_full) = &full[0];
    assert_eq!(*full_bytes, 3 * 4 * (*n_full + params.len()) as u64);
    let lora_bytes = two[0].1;
    println!(
        "all-reduced per step: LoRA {} bytes ({} adapter elements), full fine-tuning {} bytes \
         ({} parameters): {:.1}x less",
        lora_bytes / 3,
        n_adapter,
        full_bytes / 3,
        n_full,
        *full_bytes as f64 / lora_bytes as f64
    );
    assert!(lora_bytes * 5 < *full_bytes);
}

/// Where the processes of [`two_processes_train_the_adapters_as_one`] write what they trained.
const PROCESSES_OUT: &str = "ACCEL_LORA_PROCESSES_OUT";

/// A worker process of [`two_processes_train_the_adapters_as_one`]; does nothing in a normal
/// test run.
#[test]
fn lora_process_entry() {
    let Some(out) = std::env::var_os(PROCESSES_OUT) else {
        return;
    };
    let acc = Accelerator::builder()
        .cpu(true)
        .timeout(Duration::from_secs(60))
        .missing_gradients(MissingGradients::Error)
        .build()
        .unwrap();
    let rank = acc.rank();
    let (adapters, bytes, _) = train_adapters(acc, true);
    let out = PathBuf::from(out);
    candle_core::safetensors::save(&adapters, out.join(format!("rank-{rank}.safetensors")))
        .unwrap();
    std::fs::write(out.join(format!("bytes-{rank}")), bytes.to_string()).unwrap();
}

/// The same as [`two_ranks_train_the_adapters_as_one_and_all_reduce_only_them`] with real
/// processes over the TCP transport (this test binary started as 2 processes by the library's
/// self-launch): both end with one process's adapters, having all-reduced only them.
#[test]
fn two_processes_train_the_adapters_as_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "lora_process_entry",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ACCELERATE_RS_NUM_PROCESSES", "2")
        .env(PROCESSES_OUT, dir.path())
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("ACCELERATE_RS_SECRET")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let one = on_ranks(1, true);
    let (single, _, n_adapter) = &one[0];
    for rank in 0..2 {
        let adapters = tensors(&dir.path().join(format!("rank-{rank}.safetensors")));
        assert_eq!(adapters.len(), single.len());
        for (name, t) in single {
            let d = rel_diff(&adapters[name], t);
            assert!(d <= 1e-5, "process {rank}: `{name}` differs by {d:e}");
        }
        let bytes: u64 = std::fs::read_to_string(dir.path().join(format!("bytes-{rank}")))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            bytes,
            3 * 4 * (*n_adapter + single.len()) as u64,
            "process {rank}"
        );
    }
}

#[test]
fn a_bf16_base_trains_f32_adapters() {
    let g = golden("lora_llama");
    let mut model =
        AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::BF16).unwrap();
    model.load_adapter(adapter_dir("lora_llama")).unwrap();
    for v in model.trainable_parameters().all_vars() {
        assert_eq!(v.dtype(), DType::F32);
    }
    for v in model.varmap().all_vars() {
        assert_eq!(v.dtype(), DType::BF16);
    }
    model.train(true);
    let (ids, mask, labels) = (&g["input_ids"], &g["attention_mask"], &g["labels"]);
    let logits = model.forward(ids, Some(mask)).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    // bf16's rounding is large for this tiny random model (PEFT's own bf16 logits are 4% and
    // its gradients up to 32% away from its f32 ones): compared with PEFT on the same bf16
    // base with f32 adapters, within bf16's noise, which is far below the adapter's effect.
    let peft16 = &g["bf16.logits"];
    let noise = rel_diff(peft16, &g["logits"]);
    let d = rel_diff(&logits, peft16);
    let base16 = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::BF16).unwrap();
    let effect = rel_diff(&base16.forward(ids, Some(mask)).unwrap(), peft16);
    println!(
        "bf16 logits: vs peft's {d:e}; peft's bf16 vs f32 {noise:e}; adapter's effect {effect:e}"
    );
    assert!(
        d <= 1.5 * noise,
        "bf16 logits differ from peft's bf16 logits by {d:e}"
    );
    assert!(
        effect > 5.0 * d,
        "the adapter's effect {effect:e} is lost in the noise"
    );
    let loss = model.loss_with_mask(ids, Some(mask), labels).unwrap();
    let grads = nn::backward(&loss).unwrap();
    for (name, var) in model.trainable_parameters().named_parameters() {
        let grad = grads.get(&var).unwrap_or_else(|| panic!("`{name}`"));
        assert_eq!(grad.dtype(), DType::F32);
        let (peft16, f32_ref) = (
            &g[&format!("bf16.grad.{name}")],
            &g[&format!("grad.{name}")],
        );
        let d = rel_diff(grad, peft16);
        // Closer to PEFT's bf16 gradient than either is to the f32 one.
        let spread = rel_diff(peft16, f32_ref);
        assert!(
            d <= 0.12 && d < spread,
            "`{name}`: bf16 gradient differs from peft's by {d:e} (peft bf16 vs f32: {spread:e})"
        );
    }
    for (name, var) in model.varmap().named_parameters() {
        assert!(grads.get(&var).is_none(), "frozen `{name}`");
    }
}

/// `LoraConfig::seed`: the same seed gives the same `lora_A` in every run (whatever was created
/// before), another seed other values; without a seed Candle's generator decides; `lora_B`
/// starts at zero either way.
#[test]
fn seeded_adapters_start_the_same_in_every_run() {
    let adapters = |config: &LoraConfig| -> BTreeMap<String, Vec<f32>> {
        let mut m = AutoModel::from_pretrained(fixture("llama"), &Device::Cpu, DType::F32).unwrap();
        m.add_lora(config).unwrap();
        m.trainable_parameters()
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    };
    let seeded = LoraConfig::new(4, 8.0).seed(11);
    let first = adapters(&seeded);
    // Something else drawn from Candle's generator in between changes nothing.
    let _ = Tensor::randn(0f32, 1.0, 64, &Device::Cpu).unwrap();
    assert_eq!(adapters(&seeded), first);
    let other = adapters(&LoraConfig::new(4, 8.0).seed(12));
    let unseeded = adapters(&LoraConfig::new(4, 8.0));
    for (name, values) in &first {
        if name.contains("lora_B") {
            assert!(values.iter().all(|&v| v == 0.0), "{name} starts at zero");
            continue;
        }
        assert!(values.iter().any(|&v| v != 0.0), "{name} is drawn");
        assert_ne!(&other[name], values, "{name}: another seed, other values");
        assert_ne!(&unseeded[name], values, "{name}: unseeded");
    }
}

/// `AutoModel::flops_per_token`: 6 per parameter plus attention when every parameter trains;
/// with LoRA, 4 per parameter of the frozen base and 6 per adapter parameter; the layer and
/// width keys of every architecture are read (GPT-2's `n_layer` / `n_embd` too).
#[test]
fn flops_per_token_counts_what_trains() {
    for (name, layers_key, hidden_key) in [
        ("llama", "num_hidden_layers", "hidden_size"),
        ("gpt2", "n_layer", "n_embd"),
    ] {
        let mut m = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap();
        let config = m.config_json();
        let (layers, hidden) = (
            config[layers_key].as_u64().unwrap() as f64,
            config[hidden_key].as_u64().unwrap() as f64,
        );
        let count = |v: &candle_nn::VarMap| -> f64 {
            v.all_vars().iter().map(|v| v.elem_count() as f64).sum()
        };
        let n = count(m.varmap());
        let attention = 12.0 * layers * 16.0 * hidden;
        assert!(attention > 0.0, "{name}");
        assert_eq!(m.flops_per_token(16), 6.0 * n + attention, "{name}");
        m.add_lora(&LoraConfig::new(4, 8.0).seed(3)).unwrap();
        let a = count(m.trainable_parameters());
        assert!(a > 0.0 && a < n, "{name}");
        assert_eq!(
            m.flops_per_token(16),
            4.0 * n + 6.0 * a + attention,
            "{name}"
        );
    }
}
