//! Random mutations of tiny model folders (their `config.json` values and their safetensors
//! headers) never abort, panic or hang the loader: every load ends, within seconds, with a model
//! or an error. Runs each load on a thread with a time limit; an abort would end the test
//! process, a panic fails the property.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use accelerate_rs_models::AutoModel;
use candle_core::{DType, Device};
use proptest::prelude::*;

/// Loads `dir` on another thread: `Ok(true)` loaded, `Ok(false)` an error, `Err` a panic or a
/// hang.
fn load_ends(dir: &Path) -> Result<bool, String> {
    let dir = dir.to_path_buf();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(|| {
            AutoModel::from_pretrained(&dir, &Device::Cpu, DType::F32).is_ok()
        });
        let _ = tx.send(r);
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(loaded)) => Ok(loaded),
        Ok(Err(_)) => Err("the loader panicked".into()),
        Err(_) => Err("the loader did not return within 30 s".into()),
    }
}

/// Values a hostile or careless `config.json` holds.
fn value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(json!(0)),
        Just(json!(-1)),
        Just(json!(1)),
        Just(json!(3)),
        Just(json!(7)),
        Just(json!(1u64 << 31)),
        Just(json!(1u64 << 40)),
        Just(json!(u64::MAX)),
        Just(json!(1e300)),
        Just(json!(-1e-9)),
        Just(json!(0.5)),
        Just(json!(null)),
        Just(json!("x")),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        any::<i64>().prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| json!(v)),
    ]
}

const KEYS: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "initializer_range",
    "tie_word_embeddings",
    "model_type",
    "architectures",
    "sliding_window",
    "rope_theta",
    "rope_scaling",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "type_vocab_size",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn config_mutations_never_abort_or_hang(
        arch in prop::sample::select(vec!["llama", "gpt2", "bert_mlm", "qwen2"]),
        edits in prop::collection::vec((prop::sample::select(KEYS.to_vec()), value()), 1..4),
    ) {
        let (_tmp, dir) = common::copy_fixture(arch);
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (key, v) in &edits {
            config[*key] = v.clone();
        }
        std::fs::write(&path, config.to_string()).unwrap();
        load_ends(&dir).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn header_mutations_never_abort_or_hang(
        arch in prop::sample::select(vec!["llama", "gpt2"]),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let (_tmp, dir) = common::copy_fixture(arch);
        let path = dir.join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, b) in &flips {
            // Mostly the length and the JSON header, where a flip changes what is claimed.
            let i = at.index(header.min(bytes.len()));
            bytes[i] ^= b | 1;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        std::fs::write(&path, &bytes).unwrap();
        let loaded = load_ends(&dir).map_err(TestCaseError::fail)?;
        // A flip inside the header can leave a valid file only by luck; a truncated one never.
        prop_assert!(!(loaded && cut.is_some()), "a truncated file loaded");
    }
}

/// Runs `work` on another thread: `Ok(value)` when it returns within `secs`, `Err` on a panic
/// or a hang.
fn ends<T: Send + 'static>(
    secs: u64,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)));
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(_)) => Err("it panicked".into()),
        Err(_) => Err(format!("it did not return within {secs} s")),
    }
}

/// Places of `tokenizer.json` a hostile or careless file changes (JSON pointers).
const TOKENIZER_PATHS: &[&str] = &[
    "/truncation",
    "/padding",
    "/added_tokens/0/id",
    "/added_tokens/1/content",
    "/added_tokens/2/special",
    "/normalizer",
    "/pre_tokenizer",
    "/pre_tokenizer/type",
    "/post_processor",
    "/post_processor/single",
    "/decoder",
    "/decoder/type",
    "/model/type",
    "/model/dropout",
    "/model/unk_token",
    "/model/byte_fallback",
    "/model/continuing_subword_prefix",
    "/model/vocab",
    "/model/vocab/e",
    "/model/merges",
    "/model/merges/0",
    "/model/merges/0/0",
];

/// Settings blocks of other tokenizers, put where they do not belong.
fn tokenizer_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        value(),
        Just(
            json!({"direction": "Right", "max_length": 0, "strategy": "LongestFirst", "stride": 0})
        ),
        Just(json!({"direction": "Left", "max_length": 1, "strategy": "OnlyFirst", "stride": 5})),
        Just(
            json!({"strategy": {"Fixed": 10_000_000_000u64}, "direction": "Right",
                    "pad_to_multiple_of": 1_000_000_000u64, "pad_id": 0, "pad_type_id": 0,
                    "pad_token": "<pad>"})
        ),
        Just(
            json!({"type": "Split", "pattern": {"Regex": "(a*)*$"}, "behavior": "Isolated",
                    "invert": false})
        ),
        Just(
            json!({"type": "Split", "pattern": {"Regex": ""}, "behavior": "Removed",
                    "invert": true})
        ),
        Just(json!({"type": "Replace", "pattern": {"Regex": ""}, "content": "xx"})),
        Just(
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                    "split": true})
        ),
        Just(
            json!({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<zz>",
                    "type_id": 0}}], "pair": [], "special_tokens": {}})
        ),
        Just(json!({"type": "ByteFallback"})),
        Just(
            json!({"type": "WordPiece", "vocab": {}, "unk_token": "[UNK]",
                    "continuing_subword_prefix": "##", "max_input_chars_per_word": 0})
        ),
        Just(json!({"type": "Unigram", "unk_id": 5, "vocab": [["a", 0.0]]})),
        Just(json!({"type": "WordLevel", "vocab": {}, "unk_token": "<unk>"})),
        Just(json!(["zz", "yy"])),
        Just(json!({"e": 4_000_000_000u64})),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// A mutated `tokenizer.json` loads or is an error, and what loads encodes and decodes a
    /// text: every call ends, none panics.
    #[test]
    fn tokenizer_mutations_never_abort_or_hang(
        edits in prop::collection::vec(
            (prop::sample::select(TOKENIZER_PATHS.to_vec()), tokenizer_value()), 1..4),
    ) {
        let source = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("examples/tiny-llama/tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(source).unwrap()).unwrap();
        for (path, v) in &edits {
            if let Some(slot) = json.pointer_mut(path) {
                *slot = v.clone();
            }
        }
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("tokenizer.json");
        std::fs::write(&file, json.to_string()).unwrap();
        ends(30, move || {
            let Ok(tokenizer) = accelerate_rs_models::load_tokenizer(&file) else {
                return;
            };
            let text = "Hello accelerate, <s> héllo\n\n  aaaa</s>";
            if let Ok(ids) = accelerate_rs_models::encode_corpus(&tokenizer, text) {
                let _ = accelerate_rs_models::decode_ids(&tokenizer, &ids, false);
                let _ = accelerate_rs_models::decode_ids(&tokenizer, &[0, 1, 2, 383, 384, u32::MAX], true);
            }
        })
        .map_err(TestCaseError::fail)?;
    }
}

/// Pieces of Jinja a mutated chat template gets: unbalanced tags, loops without end, text
/// without end, namespaces stored in themselves, recursion.
const JINJA_PIECES: &[&str] = &[
    "{% for i in range(99999) %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% endfor %}",
    "{% if true %}",
    "{% endif %}",
    "{% set ns = namespace(x=none) %}{% set ns.x = ns %}{{ ns }}",
    "{% set ns = namespace(x=none) %}{% set ns.x = [ns] %}{{ ns ~ '' }}",
    "{% set ns = namespace(x=none) %}{% set ns.x = ns %}{{ ns == ns }}{{ ns|pprint }}",
    "{% set ns.y = [ns, messages] %}{{ ns|tojson }}",
    "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}",
    "{{ 'x' * 99999 * 99 }}",
    "{% set s = messages|tojson(indent='xxxxxxxxxxxxxxxx') %}{{ s ~ s ~ s ~ s }}",
    "{{ messages|string * 1000 }}",
    "{{ raise_exception('no') }}",
    "{{ strftime_now('%A %%%') }}",
    "{% generation %}",
    "{% endgeneration %}",
    "{% raw %}",
    "{%",
    "%}",
    "{{",
    "}}",
    "'",
    "\"",
    "{#",
    "|tojson(sort_keys=true, separators=(',', ':'))",
    "[0]",
    ".content",
    "~",
];

/// The chat templates of the fixtures and of the shipped tiny model.
fn templates() -> Vec<String> {
    let mut out = Vec::new();
    for family in ["llama3", "qwen2", "mistral", "marked", "features"] {
        let dir = common::fixture(&format!("chat_{family}"));
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            out.push(std::fs::read_to_string(jinja).unwrap());
        } else {
            let config: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap(),
            )
            .unwrap();
            let template = &config["chat_template"];
            // A string, or named templates (Mistral's list: the first is `default`).
            let text = template
                .as_str()
                .or_else(|| template[0]["template"].as_str());
            out.push(text.unwrap().to_string());
        }
    }
    out
}

/// An edit of a template's source: at a place (a fraction of its length), delete a stretch,
/// repeat it, or insert a piece; or put a piece first.
#[derive(Debug, Clone)]
enum Edit {
    Delete(prop::sample::Index, u8),
    Repeat(prop::sample::Index, u8, u8),
    Insert(prop::sample::Index, &'static str),
    /// At the start, where it is sure to render.
    Prepend(&'static str),
}

fn edit() -> impl Strategy<Value = Edit> {
    let piece = || prop::sample::select(JINJA_PIECES.to_vec());
    prop_oneof![
        1 => (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, n)| Edit::Delete(at, n)),
        1 => (any::<prop::sample::Index>(), any::<u8>(), 1..50u8)
            .prop_map(|(at, n, k)| Edit::Repeat(at, n, k)),
        1 => (any::<prop::sample::Index>(), piece()).prop_map(|(at, p)| Edit::Insert(at, p)),
        2 => piece().prop_map(Edit::Prepend),
    ]
}

/// The byte offset nearest `at` of `s` that is a character boundary.
fn boundary(s: &str, at: &prop::sample::Index) -> usize {
    let mut i = at.index(s.len() + 1);
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(source: &mut String, edit: &Edit) {
    match edit {
        Edit::Delete(at, n) => {
            let start = boundary(source, at);
            let mut end = (start + *n as usize).min(source.len());
            while !source.is_char_boundary(end) {
                end -= 1;
            }
            source.replace_range(start..end, "");
        }
        Edit::Repeat(at, n, k) => {
            let start = boundary(source, at);
            let mut end = (start + *n as usize).min(source.len());
            while !source.is_char_boundary(end) {
                end -= 1;
            }
            let stretch = source[start..end].repeat(*k as usize);
            source.insert_str(end, &stretch);
        }
        Edit::Insert(at, piece) => {
            let at = boundary(source, at);
            source.insert_str(at, piece);
        }
        Edit::Prepend(piece) => source.insert_str(0, piece),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A mutated chat template compiles or is an error, and what compiles renders the fixtures'
    /// conversations to a text or an error: every call ends (at a budget of 200k units of
    /// fuel), none panics, none overflows the stack (which would abort this test binary: run
    /// with `MUTATION_DUMP=1` and the culprit is left in `/tmp/last_template.jinja`).
    #[test]
    fn chat_template_mutations_never_abort_or_hang(
        which in 0..5usize,
        edits in prop::collection::vec(edit(), 1..5),
    ) {
        use accelerate_rs_models::chat::{ChatEncoder, ChatTemplate, ConversationReader};
        let mut source = templates().swap_remove(which);
        for e in &edits {
            apply(&mut source, e);
        }
        let conversations = common::fixture("chat_llama3").join("conversations.jsonl");
        if std::env::var_os("MUTATION_DUMP").is_some() {
            std::fs::write("/tmp/last_template.jinja", &source).unwrap();
        }
        ends(30, move || {
            let special = [("bos_token", "<s>"), ("eos_token", "</s>")];
            let Ok(template) = ChatTemplate::new(&source, special) else {
                return;
            };
            let tokenizer = accelerate_rs_models::load_tokenizer(common::fixture("chat_qwen2"))
                .unwrap();
            let encoder = ChatEncoder::new(template.with_fuel(200_000), tokenizer);
            for conversation in ConversationReader::new(vec![conversations]).unwrap() {
                let conversation = conversation.unwrap();
                let _ = encoder.render(&conversation);
                let _ = encoder.encode(&conversation);
                let _ = encoder.encode_prompt(&conversation);
            }
        })
        .map_err(TestCaseError::fail)?;
    }
}
