//! Generation on every causal architecture: greedy token ids equal to `transformers`' greedy
//! `generate` (golden files of `scripts/generate_reference.py`: a prompt past the sliding window,
//! and two prompts of different lengths left-padded in one batch), the key/value cache equal to
//! recomputing the whole sequence (and to the training forward pass, token by token, far past
//! the sliding windows), LoRA adapters applied, sampling seeded and within its top-k / top-p,
//! stop tokens, evaluation mode, and clear errors for bad settings; `examples/generate` prints
//! the text the library generates (plain, sampled, chat with an adapter) and names what is
//! missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use accelerate_rs_models::chat::{ChatEncoder, Conversation, Role};
use accelerate_rs_models::{eos_token_ids, load_tokenizer, AutoModel, Error, GenerationConfig};
use candle_core::{DType, Device, Tensor};
use common::{fixture, with_dropout};
use serde_json::Value;

/// The causal fixtures (`generate.json` beside each).
const CAUSAL: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "gpt2",
];

fn load(name: &str) -> AutoModel {
    AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::F32).unwrap()
}

/// One golden case: its name, the prompts, the expected new ids.
type Case = (String, Vec<Vec<u32>>, Vec<Vec<u32>>);

/// The golden cases of fixture `name` and the token budget.
fn cases(name: &str) -> (usize, Vec<Case>) {
    let text = std::fs::read_to_string(fixture(name).join("generate.json")).unwrap();
    let g: Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
    let cases = g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let name = c["name"].as_str().unwrap().to_string();
            (name, ids(&c["prompts"]), ids(&c["expected"]))
        })
        .collect();
    (g["max_new_tokens"].as_u64().unwrap() as usize, cases)
}

/// Greedy decoding by the training forward pass (no cache, no padding): the whole sequence
/// again at every step, the last position's largest logit.
fn forward_greedy(model: &AutoModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let ids = Tensor::new(seq.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model.forward(&ids, None).unwrap();
        let last = logits.get(0).unwrap().get(seq.len() - 1).unwrap();
        let next = last.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        seq.push(next);
    }
    seq[prompt.len()..].to_vec()
}

fn matches_transformers(name: &str) {
    let model = load(name);
    let (n, cases) = cases(name);
    for (case, prompts, expected) in cases {
        for cache in [true, false] {
            let config = GenerationConfig::default()
                .max_new_tokens(n)
                .use_cache(cache);
            let got = model.generate(&prompts, &config).unwrap();
            assert_eq!(
                got, expected,
                "{name}, {case}, cache {cache}: greedy ids differ from transformers'"
            );
        }
        // Each prompt alone gives what it gave in the batch.
        for (p, want) in prompts.iter().zip(&expected) {
            let config = GenerationConfig::default().max_new_tokens(n);
            let alone = model.generate(std::slice::from_ref(p), &config).unwrap();
            assert_eq!(&alone[0], want, "{name}, {case}: a prompt alone");
        }
    }
}

macro_rules! parity_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                matches_transformers($name);
            }
        )*
    };
}

parity_tests! {
    llama_generates_as_transformers => "llama",
    mistral_generates_as_transformers => "mistral",
    qwen2_generates_as_transformers => "qwen2",
    qwen3_generates_as_transformers => "qwen3",
    gemma2_generates_as_transformers => "gemma2",
    gemma3_generates_as_transformers => "gemma3",
    mixtral_generates_as_transformers => "mixtral",
    qwen2_moe_generates_as_transformers => "qwen2_moe",
    qwen3_moe_generates_as_transformers => "qwen3_moe",
    phi3_generates_as_transformers => "phi3",
    gpt2_generates_as_transformers => "gpt2",
}

#[test]
fn the_cache_equals_the_training_forward_far_past_the_windows() {
    for name in CAUSAL {
        let model = load(name);
        let (_, cases) = cases(name);
        let prompt = &cases[0].1[0];
        // Windows are 4 and 6 tokens: 12 new ones go well past them (GPT-2: 16 positions).
        let n = if *name == "gpt2" {
            16 - prompt.len()
        } else {
            12
        };
        let want = forward_greedy(&model, prompt, n);
        let config = GenerationConfig::default().max_new_tokens(n);
        let got = model
            .generate(std::slice::from_ref(prompt), &config)
            .unwrap();
        assert_eq!(
            got[0], want,
            "{name}: cached generation vs the forward pass"
        );
    }
}

#[test]
fn lora_adapters_generate_as_peft() {
    let mut model = load("llama");
    let (n, cases) = cases("lora_llama");
    let config = GenerationConfig::default().max_new_tokens(n);
    let base: Vec<_> = cases
        .iter()
        .map(|(_, p, _)| model.generate(p, &config).unwrap())
        .collect();
    model
        .load_adapter(fixture("lora_llama").join("adapter"))
        .unwrap();
    let mut differs = false;
    for ((case, prompts, expected), base) in cases.iter().zip(base) {
        let got = model.generate(prompts, &config).unwrap();
        assert_eq!(&got, expected, "lora_llama, {case}: ids differ from peft's");
        differs |= got != base;
    }
    assert!(differs, "the adapter changed no generated token");
}

#[test]
fn sampling_is_seeded_and_stays_within_top_k_and_top_p() {
    let model = load("mistral");
    let prompts = cases("mistral").1[1].1.clone();
    let run = |c: GenerationConfig| model.generate(&prompts, &c.max_new_tokens(12)).unwrap();
    let greedy = run(GenerationConfig::default());
    let hot = GenerationConfig::default().temperature(1.5);
    assert_eq!(run(hot.clone().seed(1)), run(hot.clone().seed(1)));
    let seeds: Vec<_> = (0..4).map(|s| run(hot.clone().seed(s))).collect();
    assert!(
        seeds.iter().any(|s| s != &greedy),
        "sampling never left greedy"
    );
    assert!(
        seeds.windows(2).any(|w| w[0] != w[1]),
        "seeds give the same draws"
    );
    assert_eq!(run(hot.clone().top_k(1)), greedy, "top_k 1 is greedy");
    assert_eq!(
        run(hot.clone().top_p(1e-6)),
        greedy,
        "a tiny top_p is greedy"
    );
    assert_eq!(run(GenerationConfig::default().temperature(0.0)), greedy);
    for s in &seeds {
        assert!(
            s.iter().flatten().all(|&t| t < 64),
            "an id outside the vocabulary"
        );
    }
    // With the cache or without, the same draws.
    assert_eq!(run(hot.clone().seed(9)), run(hot.seed(9).use_cache(false)));
}

#[test]
fn stop_tokens_end_each_sequence_on_its_own() {
    let model = load("qwen2");
    let (_, cases) = cases("qwen2");
    let prompts = cases[1].1.clone();
    let long = GenerationConfig::default().max_new_tokens(10);
    let free = model.generate(&prompts, &long).unwrap();
    let stop = free[0][2];
    let stopped = model
        .generate(&prompts, &long.clone().stop_tokens([stop]))
        .unwrap();
    for (row, (got, all)) in stopped.iter().zip(&free).enumerate() {
        let end = all
            .iter()
            .position(|&t| t == stop)
            .map_or(all.len(), |i| i + 1);
        assert_eq!(got, &all[..end], "row {row}: stops at its first {stop}");
    }
    assert!(stopped[0].len() <= 3);
    let none = model.generate(&prompts, &long.max_new_tokens(0)).unwrap();
    assert_eq!(none, vec![Vec::<u32>::new(); 2]);
}

#[test]
fn generation_runs_in_evaluation_mode() {
    let (_tmp, dir) = with_dropout("llama");
    let mut model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    let prompts = cases("llama").1[1].1.clone();
    let config = GenerationConfig::default().max_new_tokens(8);
    let eval = model.generate(&prompts, &config).unwrap();
    model.train(true);
    assert_eq!(model.generate(&prompts, &config).unwrap(), eval);
    assert!(model.is_training(), "generate left the mode as it was");
}

fn generation_error(result: accelerate_rs_models::Result<Vec<Vec<u32>>>) -> (String, String) {
    match result {
        Err(Error::Generation { what, reason }) => (what, reason),
        other => panic!("expected a generation error, got {other:?}"),
    }
}

#[test]
fn bad_settings_and_prompts_are_named() {
    let model = load("gpt2");
    let p = vec![vec![5u32, 6, 7]];
    let d = GenerationConfig::default();
    let cases = [
        (d.clone().temperature(-1.0), "temperature"),
        (d.clone().temperature(f64::NAN), "temperature"),
        (d.clone().top_k(0), "top_k"),
        (d.clone().top_p(0.0), "top_p"),
        (d.clone().top_p(1.5), "top_p"),
    ];
    for (config, what) in cases {
        assert_eq!(generation_error(model.generate(&p, &config)).0, what);
    }
    assert_eq!(generation_error(model.generate(&[], &d)).0, "prompts");
    let (what, _) = generation_error(model.generate(&[vec![1], vec![]], &d));
    assert_eq!(what, "prompts[1]");
    // GPT-2's 16 positions: a clear error past them, naming n_positions.
    let err = model
        .generate(&[vec![1; 12]], &d.clone().max_new_tokens(8))
        .unwrap_err()
        .to_string();
    assert!(err.contains("n_positions = 16"), "{err}");
    let err = model.generate(&[vec![99]], &d).unwrap_err().to_string();
    assert!(err.contains("id 99"), "{err}");
    let bert = load("bert_mlm");
    let (what, reason) = generation_error(bert.generate(&p, &d));
    assert_eq!(what, "model");
    assert!(reason.contains("BertForMaskedLM"), "{reason}");
}

/// Sets the final norm of the model folder `dir` to 3e38: finite, so loading takes it, but the
/// head's products overflow.
fn overflow_the_head(dir: &Path) {
    let file = dir.join("model.safetensors");
    let mut weights = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let norm = weights.get_mut("model.norm.weight").unwrap();
    *norm = (norm.ones_like().unwrap() * 3e38).unwrap();
    candle_core::safetensors::save(&weights, &file).unwrap();
}

/// A model whose activations overflow computes logits no token can be picked from (here a
/// final norm of 3e38, finite, so loading takes it: the head's products reach inf, then NaN).
/// Greedy picking took the last id of every row, and a draw the argmax: garbage printed as
/// text. Both are an error naming the prompt and the new token instead.
#[test]
fn logits_without_a_pickable_token_are_an_error() {
    let (_tmp, dir) = common::copy_fixture("llama");
    overflow_the_head(&dir);
    let model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    let prompts = cases("llama").1[1].1.clone();
    let greedy = GenerationConfig::default().max_new_tokens(4);
    for config in [greedy.clone(), greedy.temperature(0.8).top_k(5).seed(1)] {
        let (what, reason) = generation_error(model.generate(&prompts, &config));
        assert_eq!(what, "prompts[0]", "{reason}");
        assert!(
            reason.contains("new token 1 hold NaN at id")
                || reason.contains("new token 1 hold +inf at id"),
            "{reason}"
        );
        assert!(reason.contains("F32"), "{reason}");
    }
}

/// `eos_token_ids`: `generation_config.json`'s ids, then `config.json`'s, without repeats; a bad
/// value names the file and key; a `generation_config.json` that is there but no readable file
/// (a link to nothing, a folder) names it (before, it was skipped: its stop tokens were lost
/// without a word, or the folder's `config.json` was looked for inside it).
#[test]
fn eos_token_ids_read_both_files_and_name_what_they_cannot_read() {
    let (_tmp, dir) = common::copy_fixture("llama");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let from_config = config["eos_token_id"].as_u64().unwrap() as u32;
    let generation = dir.join("generation_config.json");
    std::fs::write(&generation, r#"{"eos_token_id": [7, 7, 3]}"#).unwrap();
    let mut want = vec![7, 3];
    if !want.contains(&from_config) {
        want.push(from_config);
    }
    assert_eq!(eos_token_ids(&dir).unwrap(), want);
    std::fs::write(&generation, r#"{"eos_token_id": -1}"#).unwrap();
    let message = eos_token_ids(&dir).unwrap_err().to_string();
    assert!(
        message.contains("generation_config.json") && message.contains("eos_token_id"),
        "{message}"
    );
    std::fs::remove_file(&generation).unwrap();
    std::os::unix::fs::symlink(dir.join("blobs/gone"), &generation).unwrap();
    let message = eos_token_ids(&dir).unwrap_err().to_string();
    assert!(
        message.contains("generation_config.json") && message.contains("does not exist"),
        "{message}"
    );
    std::fs::remove_file(&generation).unwrap();
    std::fs::create_dir(&generation).unwrap();
    let message = eos_token_ids(&dir).unwrap_err().to_string();
    assert!(
        message.contains("generation_config.json: it is a folder"),
        "{message}"
    );
}

/// `examples/generate` in the target folder this test runs from: the one the whole `cargo test`
/// built, or (missing, or older than this test) built here once.
fn example_generate() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
            let bin = profile.join("examples").join("generate");
            let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            if modified(&bin).is_some_and(|b| modified(&exe).is_some_and(|e| b >= e)) {
                return bin;
            }
            let target = profile.parent().unwrap();
            let mut cargo = Command::new(env!("CARGO"));
            cargo
                .args([
                    "build",
                    "-q",
                    "-p",
                    "accelerate-rs-models",
                    "--example",
                    "generate",
                ])
                .arg("--target-dir")
                .arg(target)
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            if profile.ends_with("release") {
                cargo.arg("--release");
            }
            assert!(
                cargo.status().unwrap().success(),
                "building examples/generate"
            );
            profile.join("examples").join("generate")
        })
        .clone()
}

/// Runs the example: (stdout, stderr, success).
fn run_example(args: &[&str]) -> (String, String, bool) {
    let out = Command::new(example_generate())
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    let ok = out.status.success();
    (text(out.stdout), text(out.stderr), ok)
}

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/tiny-llama")
}

/// What the library generates for `prompt` on the folder `dir`, decoded as the example decodes.
fn library_text(
    model: &AutoModel,
    dir: &Path,
    prompt: Vec<u32>,
    config: GenerationConfig,
) -> String {
    let mut stop = config.stop_tokens.clone();
    stop.extend(eos_token_ids(dir).unwrap());
    let new = model
        .generate(&[prompt], &config.stop_tokens(stop))
        .unwrap();
    load_tokenizer(dir).unwrap().decode(&new[0], true).unwrap()
}

#[test]
fn the_example_prints_what_the_library_generates() {
    let dir = tiny();
    let model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    let ids = load_tokenizer(&dir)
        .unwrap()
        .encode("Hello accelerate", true)
        .unwrap()
        .get_ids()
        .to_vec();
    let d = dir.to_str().unwrap();
    let base = [
        "--model",
        d,
        "--prompt",
        "Hello accelerate",
        "--max-new-tokens",
        "12",
    ];
    let (out, err, ok) = run_example(&base);
    assert!(ok, "{err}");
    let want = library_text(
        &model,
        &dir,
        ids.clone(),
        GenerationConfig::default().max_new_tokens(12),
    );
    assert_eq!(out, format!("{want}\n"));
    assert!(!want.is_empty());
    let sampled = [
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--top-p",
        "0.95",
        "--seed",
        "5",
    ];
    let (out, err, ok) = run_example(&[&base[..], &sampled[..]].concat());
    assert!(ok, "{err}");
    let config = GenerationConfig::default()
        .max_new_tokens(12)
        .temperature(0.9)
        .top_k(20)
        .top_p(0.95)
        .seed(5);
    assert_eq!(
        out,
        format!("{}\n", library_text(&model, &dir, ids, config))
    );
}

const TEMPLATE: &str =
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}\
{% if add_generation_prompt %}assistant:{% endif %}";

#[test]
fn the_example_chats_with_the_template_and_an_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny-chat");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(tiny()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    std::fs::write(dir.join("chat_template.jinja"), TEMPLATE).unwrap();
    // An adapter whose weights are not zero (fresh ones would change nothing).
    let mut model = AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).unwrap();
    model
        .add_lora(&accelerate_rs::nn::LoraConfig::new(4, 8.0))
        .unwrap();
    for var in model.trainable_parameters().all_vars() {
        let noise = Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu).unwrap();
        var.set(&noise).unwrap();
    }
    let adapter = tmp.path().join("adapter");
    model.save_adapter(&adapter).unwrap();

    let encoder = ChatEncoder::from_folder(&dir).unwrap();
    let turns = [(Role::System, "Be brief."), (Role::User, "Hi there")];
    let prompt = encoder
        .encode_prompt(&Conversation::new(turns).unwrap())
        .unwrap();
    let eot: Vec<u32> = encoder.special_token_id("eos_token").into_iter().collect();
    assert_eq!(eot, vec![2], "the template's end of turn, </s>");
    let config = GenerationConfig::default()
        .max_new_tokens(10)
        .stop_tokens(eot);
    let want = library_text(&model, &dir, prompt, config);
    let (d, a) = (dir.to_str().unwrap(), adapter.to_str().unwrap());
    let (out, err, ok) = run_example(&[
        "--model",
        d,
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi there",
        "--max-new-tokens",
        "10",
        "--adapter",
        a,
    ]);
    assert!(ok, "{err}");
    assert_eq!(out, format!("{want}\n"));
    let (plain, err, ok) = run_example(&[
        "--model",
        d,
        "--chat",
        "--system",
        "Be brief.",
        "--prompt",
        "Hi there",
        "--max-new-tokens",
        "10",
    ]);
    assert!(ok, "{err}");
    assert_ne!(plain, out, "the adapter changed nothing");
}

#[test]
fn the_example_names_what_is_missing() {
    let tiny = tiny();
    let t = tiny.to_str().unwrap();
    let llama = fixture("llama");
    // The example model's weights and tokenizer without its chat template.
    let bare = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(tiny.join(f), bare.path().join(f)).unwrap();
    }
    let b = bare.path().to_str().unwrap();
    // The example model with a final norm that overflows the head's logits.
    let overflow = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(tiny.join(f), overflow.path().join(f)).unwrap();
    }
    overflow_the_head(overflow.path());
    let o = overflow.path().to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--model", b, "--prompt", "Hi", "--chat"],
            "no chat template",
        ),
        (
            &["--model", llama.to_str().unwrap(), "--prompt", "Hi"],
            "tokenizer.json",
        ),
        (
            &["--model", t, "--prompt", "Hi", "--adapter", "/nonexistent"],
            "adapter_config.json",
        ),
        (&["--model", t, "--prompt", "Hi", "--top-p", "2"], "top_p"),
        (
            &["--model", o, "--prompt", "Hi"],
            "`prompts[0]`: the model's logits",
        ),
    ];
    for (args, says) in cases {
        let (_, err, ok) = run_example(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// bf16 models run the cached path (rounding may pick other tokens than f32: lengths and
/// ranges only).
#[test]
fn half_precision_models_generate() {
    for name in ["gemma2", "phi3", "gpt2"] {
        let model = AutoModel::from_pretrained(fixture(name), &Device::Cpu, DType::BF16).unwrap();
        let prompts = cases(name).1[1].1.clone();
        let config = GenerationConfig::default().max_new_tokens(4);
        let cached = model.generate(&prompts, &config).unwrap();
        assert!(cached
            .iter()
            .all(|r| r.len() == 4 && r.iter().all(|&t| t < 64)));
        let full = model.generate(&prompts, &config.use_cache(false)).unwrap();
        assert!(
            full.iter().all(|r| r.len() == 4),
            "{name} in bf16 without the cache"
        );
    }
}
