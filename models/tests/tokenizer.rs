//! `tokenizer.json` through the `tokenizers` crate (pure-Rust build): the ids `transformers`'
//! tokenizer gives for the example model's tokenizer, and errors naming the file.

use std::path::PathBuf;

use accelerate_rs_models::{encode_corpus, encode_text, load_tokenizer, Error};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/tiny-llama")
}

#[test]
fn ids_match_transformers() {
    let tok = load_tokenizer(tiny()).unwrap();
    // `AutoTokenizer.from_pretrained("models/examples/tiny-llama")("Hello accelerate")`.
    let ids = tok.encode("Hello accelerate", false).unwrap();
    assert_eq!(ids.get_ids(), [43, 72, 79, 331, 262, 336, 72]);
    // A corpus: line by line, the same ids as one encoding of the whole.
    let text = "Hello accelerate\nHello accelerate\n";
    let whole = tok.encode(text, false).unwrap();
    assert_eq!(encode_corpus(&tok, text).unwrap(), whole.get_ids());
    // A prompt, with and without the special tokens `tokenizer(text)` adds.
    for special in [false, true] {
        let direct = tok.encode("Hello accelerate", special).unwrap();
        let guarded = encode_text(&tok, "Hello accelerate", special).unwrap();
        assert_eq!(guarded, direct.get_ids(), "add_special_tokens = {special}");
    }
}

#[test]
fn missing_or_broken_tokenizer_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    match load_tokenizer(tmp.path()).unwrap_err() {
        Error::Tokenizer { path, .. } => assert!(path.ends_with("tokenizer.json")),
        other => panic!("{other:?}"),
    }
    let bad = tmp.path().join("tokenizer.json");
    // A link into a cache's blobs that leads nowhere says so.
    std::os::unix::fs::symlink(tmp.path().join("blobs/gone"), &bad).unwrap();
    let msg = load_tokenizer(tmp.path()).unwrap_err().to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("does not exist"),
        "{msg}"
    );
    std::fs::remove_file(&bad).unwrap();
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let msg = load_tokenizer(&bad).unwrap_err().to_string();
    assert!(msg.contains("tokenizer.json"), "{msg}");
}

#[test]
fn the_files_padding_and_truncation_are_dropped_as_transformers_drops_them() {
    // A saved tokenizer that truncates at 4 tokens and pads every text to 10^10 (which would
    // cut each corpus line short without a word, and abort on the allocation).
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tiny().join("tokenizer.json")).unwrap()).unwrap();
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0
    });
    json["padding"] = serde_json::json!({
        "strategy": {"Fixed": 10_000_000_000u64}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"
    });
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), json.to_string()).unwrap();
    let tok = load_tokenizer(tmp.path()).unwrap();
    assert!(tok.get_padding().is_none() && tok.get_truncation().is_none());
    let text = "Hello accelerate, hello accelerate\nHello accelerate\n";
    let clean = load_tokenizer(tiny()).unwrap();
    let ids = encode_corpus(&tok, text).unwrap();
    assert!(ids.len() > 8);
    assert_eq!(ids, encode_corpus(&clean, text).unwrap());
    assert_eq!(
        tok.encode(text, false).unwrap().get_ids(),
        clean.encode(text, false).unwrap().get_ids()
    );
}

#[test]
fn a_tokenizer_the_library_panics_on_is_an_error_naming_the_file() {
    // A `Replace` normalizer with an empty pattern: tokenizers 0.23 indexes out of bounds on
    // every text.
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tiny().join("tokenizer.json")).unwrap()).unwrap();
    json["normalizer"] =
        serde_json::json!({"type": "Replace", "pattern": {"Regex": ""}, "content": "xx"});
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("tokenizer.json");
    std::fs::write(&file, json.to_string()).unwrap();
    match load_tokenizer(tmp.path()).unwrap_err() {
        Error::Tokenizer { path, reason } => {
            assert_eq!(path, file);
            assert!(
                reason.contains("panicked") && reason.contains("probe"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_closed_vocabulary_that_refuses_the_probe_text_still_loads() {
    // A word-level vocabulary of two words, its unknown token missing from it: encoding any
    // other word is an error of the library (not a panic), so the load-time probe must pass it.
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "<unk>"}
    });
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), json.to_string()).unwrap();
    let tok = load_tokenizer(tmp.path()).unwrap();
    assert!(tok.encode("Hello", false).is_err());
    assert_eq!(encode_corpus(&tok, "a b\nb\n").unwrap(), [0, 1, 1]);
    let err = encode_corpus(&tok, "a c\n").unwrap_err().to_string();
    assert!(err.contains("could not encode the text"), "{err}");
}

#[test]
fn a_tokenizer_with_its_own_settings_gives_the_ids_transformers_gives() {
    // `scripts/tokenizer_reference.py`: the tiny tokenizer with `truncation` (4 tokens) and
    // `padding` (64) blocks of its own, and what `transformers` gives for texts and a chat.
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tokenizer_settings/golden.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(tiny()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    let path = tmp.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (key, block) in golden["settings"].as_object().unwrap() {
        json[key] = block.clone();
    }
    std::fs::write(&path, json.to_string()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let tok = load_tokenizer(tmp.path()).unwrap();
    for case in golden["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, false).unwrap().get_ids(),
            ids(&case["ids"]),
            "{text:?}"
        );
    }
    use accelerate_rs_models::chat::{ChatEncoder, Conversation, Role};
    let messages: Vec<(Role, String)> = golden["chat"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let role = match m["role"].as_str().unwrap() {
                "user" => Role::User,
                _ => Role::Assistant,
            };
            (role, m["content"].as_str().unwrap().to_string())
        })
        .collect();
    let encoder = ChatEncoder::from_folder(tmp.path())
        .unwrap()
        .train_on_all(true);
    let example = encoder
        .encode(&Conversation::new(messages).unwrap())
        .unwrap();
    assert_eq!(example.input_ids, ids(&golden["chat"]["ids"]));
}
