//! `tokenizer.json` through the `tokenizers` crate (pure-Rust build): the ids `transformers`'
//! tokenizer gives for the example model's tokenizer, and errors naming the file.

use std::path::PathBuf;

use accelerate_rs_models::{encode_corpus, load_tokenizer, Error};

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
}

#[test]
fn missing_or_broken_tokenizer_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    match load_tokenizer(tmp.path()).unwrap_err() {
        Error::Tokenizer { path, .. } => assert!(path.ends_with("tokenizer.json")),
        other => panic!("{other:?}"),
    }
    let bad = tmp.path().join("tokenizer.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let msg = load_tokenizer(&bad).unwrap_err().to_string();
    assert!(msg.contains("tokenizer.json"), "{msg}");
}
