//! Chat datasets against `transformers`: the rendered text, token ids and assistant masks of
//! `scripts/chat_reference.py`'s golden files (Llama 3.1, Qwen2.5, Mistral v0.3 templates, a
//! template with `{% generation %}` marks, and one using Jinja2/Python features), the loaders,
//! the length policy, and every bad input named (file, line, field), never a panic.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};

use accelerate_rs::StreamingLoader;
use accelerate_rs_models::chat::{
    AssistantSpans, ChatDataset, ChatEncoder, ChatTemplate, Conversation, ConversationReader,
    Overlong, Role, CHAT_TEMPLATE_FUEL,
};
use accelerate_rs_models::{decode_ids, load_tokenizer, ChatErrorKind, Error, IGNORE_INDEX};
use serde_json::Value;

const FAMILIES: &[&str] = &["llama3", "qwen2", "mistral", "marked", "features"];

fn folder(family: &str) -> PathBuf {
    common::fixture(&format!("chat_{family}"))
}

fn golden(family: &str) -> Value {
    let text = std::fs::read_to_string(folder(family).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn mask(v: &Value) -> Option<Vec<u8>> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap() as u8).collect())
}

fn rows(family: &str) -> Vec<Conversation> {
    ConversationReader::new(vec![folder(family).join("conversations.jsonl")])
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn token_ids_and_masks_equal_transformers() {
    for family in FAMILIES {
        let encoder = ChatEncoder::from_folder(folder(family)).unwrap();
        let all = ChatEncoder::from_folder(folder(family))
            .unwrap()
            .train_on_all(true);
        let prefixes = ChatEncoder::from_folder(folder(family))
            .unwrap()
            .assistant_spans(AssistantSpans::Prefixes);
        let golden = golden(family);
        let cases = golden["cases"].as_array().unwrap();
        let conversations = rows(family);
        assert_eq!(conversations.len(), cases.len(), "{family}");
        for (i, (chat, case)) in conversations.iter().zip(cases).enumerate() {
            let at = format!("{family} row {}", i + 1);
            assert_eq!(chat.source().unwrap().line, i + 1, "{at}");
            assert_eq!(
                encoder.render(chat).unwrap(),
                case["text"].as_str().unwrap(),
                "{at}: text"
            );
            let want_ids = ids(&case["input_ids"]);
            // Every token learnt.
            let every = all.encode(chat).unwrap();
            assert_eq!(every.input_ids, want_ids, "{at}: ids");
            assert!(every
                .labels
                .iter()
                .zip(&want_ids)
                .all(|(&l, &id)| l == i64::from(id)));
            // The assistant's tokens.
            match mask(&case["assistant_mask"]) {
                Some(want) => {
                    let example = encoder.encode(chat).unwrap();
                    assert_eq!(example.input_ids, want_ids, "{at}: ids");
                    assert_eq!(example.target_mask(), want, "{at}: assistant mask");
                    for (&l, (&id, &m)) in example.labels.iter().zip(want_ids.iter().zip(&want)) {
                        assert_eq!(l, if m == 1 { i64::from(id) } else { IGNORE_INDEX });
                    }
                }
                None => match encoder.encode(chat).unwrap_err() {
                    Error::Chat {
                        kind: ChatErrorKind::InconsistentPrefixes,
                        path,
                        line,
                        field,
                        reason,
                    } => {
                        assert!(path.ends_with("conversations.jsonl"), "{at}");
                        assert_eq!(line, Some(i + 1), "{at}");
                        assert!(field.unwrap().starts_with("messages["), "{at}");
                        assert!(reason.contains("generation"), "{at}: {reason}");
                    }
                    other => panic!("{at}: {other}"),
                },
            }
            // The prefix method, forced (for marked templates it differs from the marks).
            match (mask(&case["prefix_mask"]), prefixes.encode(chat)) {
                (Some(want), Ok(example)) => {
                    assert_eq!(example.target_mask(), want, "{at}: prefix mask")
                }
                (None, Err(Error::Chat { kind, .. })) => {
                    assert_eq!(kind, ChatErrorKind::InconsistentPrefixes, "{at}")
                }
                (want, got) => panic!("{at}: prefix mask {want:?}, got {got:?}"),
            }
            // The prompt of the last assistant turn, with the generation prompt.
            let last = chat
                .roles()
                .iter()
                .rposition(|r| *r == Role::Assistant)
                .unwrap();
            let prompt = encoder.encode_prompt(&chat.prefix(last)).unwrap();
            assert_eq!(prompt, ids(&case["prompt_ids"]), "{at}: prompt ids");
        }
    }
}

/// `ChatEncoder::decode` (the encoder's tokenizer, shared) gives what `decode_ids` (a copy)
/// gives, with and without the special tokens.
#[test]
fn the_encoders_decode_equals_decode_ids() {
    for family in FAMILIES {
        let encoder = ChatEncoder::from_folder(folder(family)).unwrap();
        for case in golden(family)["cases"].as_array().unwrap() {
            let want_ids = ids(&case["input_ids"]);
            for skip in [false, true] {
                let copied = decode_ids(encoder.tokenizer(), &want_ids, skip).unwrap();
                assert_eq!(encoder.decode(&want_ids, skip).unwrap(), copied, "{family}");
            }
        }
    }
}

#[test]
fn templates_and_special_tokens_are_found_as_transformers_finds_them() {
    for family in FAMILIES {
        let template = ChatTemplate::from_folder(folder(family)).unwrap();
        let golden = golden(family);
        let want = golden["special_tokens"].as_object().unwrap();
        assert_eq!(template.special_tokens().len(), want.len(), "{family}");
        for (name, token) in want {
            assert_eq!(
                template.special_token(name),
                token.as_str(),
                "{family} {name}"
            );
        }
        let file = template.path().file_name().unwrap().to_str().unwrap();
        let expected = match *family {
            "qwen2" | "mistral" => "tokenizer_config.json",
            _ => "chat_template.jinja",
        };
        assert_eq!(file, expected, "{family}");
        assert_eq!(
            template.has_generation_marks(),
            matches!(*family, "marked" | "features"),
            "{family}"
        );
    }
}

#[test]
fn conversations_built_in_code_render_like_rows() {
    let encoder = ChatEncoder::from_folder(folder("qwen2")).unwrap();
    let row = rows("qwen2").remove(2); // {"prompt": "Add 2 and 3.", "completion": "2 + 3 = 5."}
    let built = Conversation::new([
        (Role::User, "Add 2 and 3."),
        (Role::Assistant, "2 + 3 = 5."),
    ])
    .unwrap();
    assert_eq!(
        encoder.encode(&built).unwrap().input_ids,
        encoder.encode(&row).unwrap().input_ids
    );
    let parsed = Conversation::from_json_row(
        r#"{"prompt": "Add 2 and 3.", "completion": "2 + 3 = 5.", "extra": 1}"#,
    )
    .unwrap();
    assert_eq!(
        encoder.render(&parsed).unwrap(),
        encoder.render(&row).unwrap()
    );
    assert_eq!(parsed.content(1).as_deref(), Some("2 + 3 = 5."));
    // A prompt only: renders, but is no training example.
    let prompt = Conversation::new([(Role::User, "Hi")]).unwrap();
    assert!(encoder.encode_prompt(&prompt).is_ok());
    assert_eq!(
        kind(encoder.encode(&prompt).unwrap_err()),
        ChatErrorKind::NoAssistantTurn
    );
    assert!(Conversation::new(Vec::<(Role, String)>::new()).is_err());
}

#[test]
fn dataset_feeds_the_streaming_loader() {
    let family = "qwen2";
    let encoder = ChatEncoder::from_folder(folder(family)).unwrap();
    let max_len = 300;
    let data = ChatDataset::new(
        vec![folder(family).join("conversations.jsonl")],
        encoder,
        max_len,
    )
    .unwrap();
    let golden = golden(family);
    let cases = golden["cases"].as_array().unwrap();
    let loader = StreamingLoader::new(data, 2)
        .prefetch(0)
        .shard(0, 1)
        .unwrap();
    let mut seen = 0;
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        let [input_ids, labels, attention] = batch.tensors() else {
            panic!("three fields")
        };
        assert_eq!(input_ids.dims()[1], max_len);
        let input_ids = input_ids.to_vec2::<u32>().unwrap();
        let labels = labels.to_vec2::<i64>().unwrap();
        let attention = attention.to_vec2::<u32>().unwrap();
        for row in 0..input_ids.len() - batch.padding() {
            let case = &cases[seen];
            let want = ids(&case["input_ids"]);
            let want_mask = mask(&case["assistant_mask"]).unwrap();
            let n = want.len();
            assert_eq!(&input_ids[row][..n], &want[..]);
            let pad = loader
                .dataset()
                .encoder()
                .special_token_id("pad_token")
                .unwrap();
            assert!(input_ids[row][n..].iter().all(|&t| t == pad));
            assert!(attention[row][..n].iter().all(|&m| m == 1));
            assert!(attention[row][n..].iter().all(|&m| m == 0));
            for t in 0..max_len {
                let expect = if t < n && want_mask[t] == 1 {
                    i64::from(want[t])
                } else {
                    IGNORE_INDEX
                };
                assert_eq!(labels[row][t], expect);
            }
            seen += 1;
        }
    }
    assert_eq!(seen, cases.len());
    let stats = loader.dataset().stats();
    assert_eq!((stats.rows, stats.examples), (5, 5));
    assert_eq!((stats.truncated, stats.skipped), (0, 0));
}

#[test]
fn over_long_examples_are_truncated_or_skipped_and_counted() {
    let family = "llama3";
    let file = folder(family).join("conversations.jsonl");
    let golden = golden(family);
    let lens: Vec<usize> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["input_ids"].as_array().unwrap().len())
        .collect();
    let max_len = 120;
    let longer = lens.iter().filter(|&&n| n > max_len).count();
    assert!(longer > 0 && longer < lens.len());

    let skip = ChatDataset::new(
        vec![file.clone()],
        ChatEncoder::from_folder(folder(family)).unwrap(),
        max_len,
    )
    .unwrap()
    .overlong(Overlong::Skip);
    let examples: Vec<_> = skip.examples().unwrap().map(Result::unwrap).collect();
    assert_eq!(examples.len(), lens.len() - longer);
    assert!(examples.iter().all(|e| e.len() <= max_len));
    let stats = skip.stats();
    assert_eq!(stats.skipped as usize, longer);
    assert_eq!(stats.rows as usize, lens.len());
    assert_eq!(stats.longest, *lens.iter().max().unwrap());

    let truncate = ChatDataset::new(
        vec![file.clone()],
        ChatEncoder::from_folder(folder(family)).unwrap(),
        max_len,
    )
    .unwrap();
    let mut pass = truncate.examples().unwrap();
    let examples: Vec<_> = pass.by_ref().map(Result::unwrap).collect();
    let stats = pass.stats();
    // The longer ones are cut to max_len, or left out when no assistant token is left.
    assert_eq!((stats.truncated + stats.skipped) as usize, longer);
    assert_eq!(examples.len() as u64, stats.examples);
    assert!(examples
        .iter()
        .all(|e| e.len() <= max_len && e.num_targets() > 0));
    assert!(examples.iter().any(|e| e.len() == max_len));

    // Every row too long: an error, not an empty pass.
    let none_fit = ChatDataset::new(
        vec![file],
        ChatEncoder::from_folder(folder(family)).unwrap(),
        10,
    )
    .unwrap()
    .overlong(Overlong::Skip);
    let items: Vec<_> = none_fit.examples().unwrap().collect();
    assert_eq!(items.len(), 1);
    let err = items.into_iter().next().unwrap().unwrap_err();
    assert_eq!(kind_ref(&err), ChatErrorKind::NoTarget);
    assert!(err.to_string().contains("max_len"), "{err}");
}

// ---- bad input ----

fn kind(e: Error) -> ChatErrorKind {
    kind_ref(&e)
}

fn kind_ref(e: &Error) -> ChatErrorKind {
    match e {
        Error::Chat { kind, .. } => *kind,
        other => panic!("not a chat error: {other}"),
    }
}

/// The first error reading `text` as a JSONL file: (kind, line, field, message).
fn read_error(text: &[u8]) -> (ChatErrorKind, Option<usize>, Option<String>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data.jsonl");
    std::fs::File::create(&path)
        .unwrap()
        .write_all(text)
        .unwrap();
    let reader = ConversationReader::new(vec![path.clone()])
        .unwrap()
        .max_line_bytes(400);
    let mut items: Vec<_> = reader.collect();
    let err = items.pop().unwrap().unwrap_err();
    assert!(
        items.iter().all(|i| i.is_ok()),
        "the first error ends the stream"
    );
    let message = err.to_string();
    match err {
        Error::Chat {
            kind,
            path: p,
            line,
            field,
            ..
        } => {
            assert_eq!(p, path);
            assert!(message.contains("data.jsonl"), "{message}");
            if let Some(l) = line {
                assert!(message.contains(&format!("data.jsonl:{l}")), "{message}");
            }
            if let Some(f) = &field {
                assert!(message.contains(f.as_str()), "{message}");
            }
            (kind, line, field, message)
        }
        other => panic!("{other}"),
    }
}

const GOOD: &str =
    r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}"#;

#[test]
fn bad_rows_are_named_by_file_line_and_field() {
    use ChatErrorKind::*;
    let cases: Vec<(String, ChatErrorKind, usize, Option<&str>)> = vec![
        (
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}"#.into(),
            UnknownRole, 2, Some("messages[1].role"),
        ),
        (
            r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}"#.into(),
            MissingField, 2, Some("messages[0].content"),
        ),
        (
            r#"{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "b"}]}"#.into(),
            MissingField, 2, Some("messages[0].content"),
        ),
        (
            r#"{"messages": [{"content": "a"}, {"role": "assistant", "content": "b"}]}"#.into(),
            MissingField, 2, Some("messages[0].role"),
        ),
        (
            r#"{"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "b"}]}"#.into(),
            WrongType, 2, Some("messages[0].content"),
        ),
        (
            r#"{"messages": [{"role": 1, "content": "a"}]}"#.into(),
            WrongType, 2, Some("messages[0].role"),
        ),
        (r#"{"messages": "hello"}"#.into(), WrongType, 2, Some("messages")),
        (r#"{"messages": ["hello"]}"#.into(), WrongType, 2, Some("messages[0]")),
        (
            r#"{"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}"#.into(),
            WrongType, 2, Some("messages[0].tool_calls"),
        ),
        (
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}"#.into(),
            NoAssistantTurn, 2, Some("messages"),
        ),
        (r#"{"messages": []}"#.into(), NoAssistantTurn, 2, Some("messages")),
        (r#"{"prompt": "a"}"#.into(), MissingField, 2, Some("completion")),
        (r#"{"completion": "a"}"#.into(), MissingField, 2, Some("prompt")),
        (
            r#"{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}"#.into(),
            WrongType, 2, Some("completion"),
        ),
        (r#"{"prompt": 3, "completion": "b"}"#.into(), WrongType, 2, Some("prompt")),
        (
            r#"{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]}"#.into(),
            NoAssistantTurn, 2, Some("completion"),
        ),
        (
            r#"{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "critic", "content": "b"}]}"#.into(),
            UnknownRole, 2, Some("completion[0].role"),
        ),
        (r#"{"messages": [], "prompt": "a"}"#.into(), WrongType, 2, Some("messages")),
        (r#"{"text": "plain"}"#.into(), MissingField, 2, Some("messages")),
        (r#"["not", "an", "object"]"#.into(), WrongType, 2, None),
        (r#"{"messages": [{"role": "user", "content": "a"}"#.into(), InvalidJson, 2, None),
        ("not json at all".into(), InvalidJson, 2, None),
        (format!("{{\"prompt\": \"{}\", \"completion\": \"b\"}}", "x".repeat(500)), LineTooLong, 2, None),
    ];
    for (bad, want, line, field) in cases {
        // A good row first, blank lines around: the line numbers count every line.
        let text = format!("{GOOD}\n{bad}\n\n{GOOD}\n");
        let (kind, got_line, got_field, message) = read_error(text.as_bytes());
        assert_eq!(kind, want, "{bad}: {message}");
        assert_eq!(got_line, Some(line), "{bad}: {message}");
        assert_eq!(got_field.as_deref(), field, "{bad}: {message}");
    }
    // Not UTF-8; CRLF line endings are fine before it.
    let mut bytes = format!("{GOOD}\r\n\r\n").into_bytes();
    bytes.extend_from_slice(b"{\"prompt\": \"\xff\", \"completion\": \"b\"}\n");
    let (kind, line, _, _) = read_error(&bytes);
    assert_eq!((kind, line), (InvalidJson, Some(3)));
}

#[test]
fn empty_and_missing_files_are_named() {
    for text in ["", "\n  \n\t\n"] {
        let (kind, line, _, message) = read_error(text.as_bytes());
        assert_eq!((kind, line), (ChatErrorKind::EmptyFile, None), "{message}");
        assert!(message.contains("no conversation"), "{message}");
    }
    let missing = Path::new("/nonexistent/dir/train.jsonl").to_path_buf();
    let err = ConversationReader::new(vec![missing])
        .unwrap()
        .next()
        .unwrap()
        .unwrap_err();
    assert_eq!(kind_ref(&err), ChatErrorKind::Io);
    assert!(
        err.to_string().contains("/nonexistent/dir/train.jsonl"),
        "{err}"
    );
    assert!(ConversationReader::new(Vec::new()).is_err());
}

#[test]
fn several_files_are_read_in_order_with_their_own_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.jsonl");
    let b = dir.path().join("b.jsonl");
    std::fs::write(&a, format!("{GOOD}\n{GOOD}")).unwrap(); // no final line break
    std::fs::write(&b, format!("\n{GOOD}\n{{\"messages\": 1}}\n")).unwrap();
    let items: Vec<_> = ConversationReader::new(vec![a.clone(), b.clone()])
        .unwrap()
        .collect();
    assert_eq!(items.len(), 4);
    let sources: Vec<_> = items[..3]
        .iter()
        .map(|c| {
            let s = c.as_ref().unwrap().source().unwrap().clone();
            (s.path.to_path_buf(), s.line)
        })
        .collect();
    assert_eq!(sources, vec![(a.clone(), 1), (a, 2), (b.clone(), 2)]);
    match items[3].as_ref().unwrap_err() {
        Error::Chat { path, line, .. } => assert_eq!((path, *line), (&b, Some(3))),
        other => panic!("{other}"),
    }
}

#[test]
fn a_template_that_fails_names_the_row_and_the_template_message() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data.jsonl");
    // Mistral's template raises on roles that do not alternate.
    std::fs::write(
        &file,
        format!(
            "{GOOD}\n{}\n",
            r#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}"#
        ),
    )
    .unwrap();
    let encoder = ChatEncoder::from_folder(folder("mistral")).unwrap();
    let data = ChatDataset::new(vec![file.clone()], encoder, 64).unwrap();
    let items: Vec<_> = data.examples().unwrap().collect();
    assert!(items[0].is_ok());
    let err = items[1].as_ref().unwrap_err();
    assert_eq!(kind_ref(err), ChatErrorKind::Render);
    let message = err.to_string();
    assert!(message.contains("data.jsonl:2"), "{message}");
    assert!(
        message.contains("must alternate user/assistant"),
        "{message}"
    );
    assert!(message.contains("tokenizer_config.json"), "{message}");

    // Through the streaming loader: an error item naming the row, then the end.
    let loader = StreamingLoader::new(data, 1)
        .prefetch(0)
        .shard(0, 1)
        .unwrap();
    let batches: Vec<_> = loader.iter().unwrap().collect();
    let err = batches.iter().find_map(|b| b.as_ref().err()).unwrap();
    assert!(err.to_string().contains("data.jsonl:2"), "{err}");
    assert!(batches.last().unwrap().is_err());
}

#[test]
fn a_folder_without_a_usable_template_is_an_error() {
    // The example model's tokenizer without its chat template.
    let ex = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/tiny-llama");
    let bare = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(ex.join(f), bare.path().join(f)).unwrap();
    }
    let tiny = bare.path().to_path_buf();
    match ChatEncoder::from_folder(&tiny).unwrap_err() {
        Error::ChatTemplate { path, reason } => {
            assert_eq!(path, tiny);
            assert!(reason.contains("chat_template.jinja"), "{reason}");
        }
        other => panic!("{other}"),
    }
    assert!(matches!(
        ChatTemplate::from_folder("/nonexistent/model").unwrap_err(),
        Error::ChatTemplate { .. }
    ));
    let dir = tempfile::tempdir().unwrap();
    let write_config = |config: &str| {
        std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
        ChatTemplate::from_folder(dir.path())
            .unwrap_err()
            .to_string()
    };
    let message = write_config(r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#);
    assert!(
        message.contains("default") && message.contains("tool_use"),
        "{message}"
    );
    let message = write_config(r#"{"chat_template": 3}"#);
    assert!(message.contains("chat_template"), "{message}");
    let message = write_config("{not json");
    assert!(message.contains("tokenizer_config.json"), "{message}");
    let message = write_config(r#"{"chat_template": "{% for m in messages %}{{ m.content }"}"#);
    assert!(message.contains("does not compile"), "{message}");
    // A template file wins over the key, as in transformers 5.
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "key", "eos_token": {"content": "</s>", "special": true}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "file{{ eos_token }}\n",
    )
    .unwrap();
    let template = ChatTemplate::from_folder(dir.path()).unwrap();
    assert_eq!(template.special_token("eos_token"), Some("</s>"));
    let tokenizer = load_tokenizer(&tiny).unwrap();
    let encoder = ChatEncoder::new(template, tokenizer).train_on_all(true);
    let chat = Conversation::new([(Role::Assistant, "x")]).unwrap();
    // Jinja2 drops the template's final line break.
    assert_eq!(encoder.render(&chat).unwrap(), "file</s>");
}

/// A `chat_template.jinja` or `tokenizer_config.json` that is there but is no readable file (a
/// link to nothing, a folder: a broken download) is an error naming it. Before, the template
/// file was taken as absent and the key's template, another one, was used without a word.
#[test]
fn template_files_that_are_there_but_unreadable_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "key"}"#,
    )
    .unwrap();
    // The folder's error names `file` and says `what`.
    let refused = |file: &str, what: &str| {
        let message = ChatTemplate::from_folder(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(file) && message.contains(what),
            "{message}"
        );
    };
    let jinja = dir.path().join("chat_template.jinja");
    std::os::unix::fs::symlink(dir.path().join("blobs/gone"), &jinja).unwrap();
    refused("chat_template.jinja", "does not exist");
    std::fs::remove_file(&jinja).unwrap();
    std::fs::create_dir(&jinja).unwrap();
    refused("chat_template.jinja", "folder");
    std::fs::remove_dir(&jinja).unwrap();
    let config = dir.path().join("tokenizer_config.json");
    std::fs::remove_file(&config).unwrap();
    std::os::unix::fs::symlink(dir.path().join("blobs/gone"), &config).unwrap();
    refused("tokenizer_config.json", "does not exist");
}

#[test]
fn templates_that_raise_or_mark_nothing_are_errors() {
    let tokenizer = || load_tokenizer(folder("qwen2")).unwrap();
    let chat = Conversation::new([(Role::User, "a"), (Role::Assistant, "b")]).unwrap();
    let raising = ChatTemplate::new(
        "{% if messages|length > 1 %}{{ raise_exception('too many: ' ~ messages|length) }}{% endif %}ok",
        [("eos_token", "<|im_end|>")],
    )
    .unwrap();
    let err = ChatEncoder::new(raising, tokenizer())
        .encode(&chat)
        .unwrap_err();
    assert_eq!(kind_ref(&err), ChatErrorKind::Render);
    assert!(err.to_string().contains("too many: 2"), "{err}");
    assert!(err.to_string().contains("<memory>"), "{err}");
    // Marks around nothing the assistant wrote: no target, an error rather than an empty row.
    let empty = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}{% generation %}{% endgeneration %}{% endfor %}",
        Vec::<(String, String)>::new(),
    )
    .unwrap();
    let err = ChatEncoder::new(empty, tokenizer())
        .encode(&chat)
        .unwrap_err();
    assert_eq!(kind(err), ChatErrorKind::NoTarget);
    // tojson's options are checked.
    for bad in [
        "{{ messages|tojson(indent=100000) }}",
        "{{ messages|tojson(separators=',') }}",
        "{{ messages|tojson(colour=1) }}",
    ] {
        let template = ChatTemplate::new(bad, Vec::<(String, String)>::new()).unwrap();
        let err = ChatEncoder::new(template, tokenizer())
            .render(&chat)
            .unwrap_err();
        assert_eq!(kind_ref(&err), ChatErrorKind::Render, "{bad}");
        assert!(
            err.to_string().contains("tojson") || err.to_string().contains("colour"),
            "{err}"
        );
    }
    // An undefined variable's attribute is an error, as in Jinja2.
    let broken = ChatTemplate::new("{{ nothing.here }}", Vec::<(String, String)>::new()).unwrap();
    let err = ChatEncoder::new(broken, tokenizer())
        .render(&chat)
        .unwrap_err();
    assert_eq!(kind(err), ChatErrorKind::Render);
}

/// Renders `source` on a two-turn chat with the Qwen2 tokenizer, at `fuel` units or the default.
fn render_hostile(source: &str, fuel: Option<u64>) -> Result<String, Error> {
    let chat = Conversation::new([(Role::User, "a"), (Role::Assistant, "b")]).unwrap();
    let template = ChatTemplate::new(source, Vec::<(String, String)>::new()).unwrap();
    let template = match fuel {
        Some(units) => template.with_fuel(units),
        None => template,
    };
    ChatEncoder::new(template, load_tokenizer(folder("qwen2")).unwrap()).render(&chat)
}

#[test]
fn hostile_templates_end_in_errors_naming_the_budget_never_a_hang_or_an_abort() {
    let render = render_hostile;
    // Work without end, at the default budget: 10^10 loop steps.
    let endless =
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
    let err = render(endless, None).unwrap_err();
    assert_eq!(kind_ref(&err), ChatErrorKind::Render);
    let budget = format!("budget of {CHAT_TEMPLATE_FUEL} units");
    assert!(err.to_string().contains(&budget), "{err}");
    // Text without end, in the engine's operators and in our printing and `tojson`: at a
    // smaller budget (64 KiB of text), so that the test is quick.
    for source in [
        "{% set s = 'x' * 60000 %}{{ s ~ s ~ s ~ s }}",
        "{% set l = ['x' * 1000] * 100 %}{{ [l] * 100 }}",
        "{% set l = ['x' * 1000] * 100 %}{{ ([l] * 100)|string }}",
        "{{ messages|tojson(indent='x' * 1000) }}{{ [[[[messages]]]]|tojson(indent='x' * 1000) }}",
        "{{ messages|tojson(separators=('x' * 40000, ': ')) }}",
    ] {
        let err = render(source, Some(1000)).unwrap_err();
        assert_eq!(kind_ref(&err), ChatErrorKind::Render, "{source}");
        assert!(
            err.to_string().contains("budget of 1000 units"),
            "{source}: {err}"
        );
    }
    // A namespace stored in itself: Jinja2 would make a cycle that no print or comparison
    // survives; here the namespace stores a copy of what it held.
    let cycle = "{% set ns = namespace(x=none) %}{% set ns.x = ns %}{% set ns.y = [ns, ns] %}\
                 {{ ns.x }}|{{ ns ~ '' }}|{{ ns == ns }}|{{ ns.y|tojson }}|{{ ns|pprint|length > 0 }}";
    let text = render(cycle, None).unwrap();
    assert!(
        text.starts_with("{'x': None}|") && text.contains("|True|") && text.ends_with("|True"),
        "{text}"
    );
    // What real templates store in namespaces still works.
    let plain = "{% set ns = namespace(m=none, n=0, seen=[]) %}{% for m in messages %}\
                 {% set ns.m = m %}{% set ns.n = ns.n + 1 %}{% set ns.seen = ns.seen + [m.role] %}\
                 {% endfor %}{{ ns.m.content }}{{ ns.n }}{{ ns.seen|join(',') }}";
    assert_eq!(render(plain, None).unwrap(), "b2user,assistant");
    // A date format that would print ten times its size is refused before it is expanded.
    let err = render("{{ strftime_now('%A' * 3000) }}", None).unwrap_err();
    assert!(
        err.to_string()
            .contains("strftime_now: a format of 6000 bytes"),
        "{err}"
    );
    assert_eq!(
        render("{{ strftime_now('%Y')|length }}", None).unwrap(),
        "4"
    );
}

#[test]
fn recursion_without_end_is_an_error_and_the_deepest_allowed_fits_a_small_stack() {
    let render = render_hostile;
    // Recursion without end is the engine's error, and the deepest recursion allowed, printing
    // a value 250 levels deep at its bottom, fits in 1.5 MiB of stack in a debug build (it needs
    // about 1 MiB: half the 2 MiB of a spawned thread, a data loader's worker); at minijinja's
    // default limit (500) it needs 2 to 3 MiB and overflowed such a thread.
    let deep = "{% set ns = namespace(v=1) %}{% for i in range(250) %}{% set ns.v = [ns.v] %}\
                {% endfor %}{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% else %}{{ ns.v }}\
                {{ ns.v|tojson }}{{ ns.v ~ '' }}{{ ns.v == ns.v }}{% endif %}{% endmacro %}";
    let cases = [
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}".to_string(),
        format!("{deep}{{{{ m(1000) }}}}"),
        format!("{deep}{{{{ m(25) }}}}"),
    ];
    let outcomes = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(3 << 19)
            .spawn_scoped(scope, || {
                cases
                    .iter()
                    .map(|source| render(source, None).map_err(|e| e.to_string()))
                    .collect::<Vec<_>>()
            })
            .unwrap()
            .join()
            .unwrap()
    });
    for (i, outcome) in outcomes.iter().enumerate() {
        match (i, outcome) {
            (2, Ok(text)) => assert!(text.ends_with("]True"), "{text}"),
            (0 | 1, Err(e)) => assert!(e.contains("recursion limit"), "{e}"),
            _ => panic!("case {i}: {outcome:?}"),
        }
    }
}

#[test]
fn the_prefix_method_holds_a_long_conversation_to_a_budget() {
    let encoder = |fuel: u64| {
        let template = ChatTemplate::from_folder(folder("qwen2"))
            .unwrap()
            .with_fuel(fuel);
        let tokenizer = load_tokenizer(folder("qwen2")).unwrap();
        ChatEncoder::new(template, tokenizer).assistant_spans(AssistantSpans::Prefixes)
    };
    let turns = |n: usize| {
        let messages = (0..n).map(|i| {
            let role = if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            };
            (role, format!("m{i}"))
        });
        Conversation::new(messages.collect::<Vec<_>>()).unwrap()
    };
    // 40 messages: well within 16 renderings' budgets of 20k units; 400 are not (the work grows
    // with the square of the length) and end in an error naming the budget and the message.
    let example = encoder(20_000).encode(&turns(40)).unwrap();
    assert_eq!(
        example.num_targets(),
        encoder(CHAT_TEMPLATE_FUEL)
            .encode(&turns(40))
            .unwrap()
            .num_targets()
    );
    let err = encoder(20_000).encode(&turns(400)).unwrap_err();
    assert_eq!(kind_ref(&err), ChatErrorKind::Render);
    let text = err.to_string();
    assert!(
        text.contains("more than 320000 units") && text.contains("messages["),
        "{text}"
    );
    // The default budget takes 400.
    assert!(encoder(CHAT_TEMPLATE_FUEL).encode(&turns(400)).is_ok());
}

#[test]
fn bad_dataset_parameters_are_errors() {
    let encoder = || ChatEncoder::from_folder(folder("qwen2")).unwrap();
    let file = folder("qwen2").join("conversations.jsonl");
    let err = ChatDataset::new(vec![file.clone()], encoder(), 0).unwrap_err();
    assert!(err.to_string().contains("max_len"), "{err}");
    assert!(ChatDataset::new(Vec::new(), encoder(), 8).is_err());
    // An example longer than the samples.
    let data = ChatDataset::new(vec![file], encoder(), 8).unwrap();
    let chat = Conversation::new([(Role::User, "a"), (Role::Assistant, "b")]).unwrap();
    let example = data.encoder().encode(&chat).unwrap();
    let err = data
        .to_tensors(&example, &candle_core::Device::Cpu)
        .unwrap_err();
    assert!(err.to_string().contains("max_len"), "{err}");
}

#[test]
fn a_message_holding_mark_like_text_is_text_not_a_target() {
    let encoder = ChatEncoder::from_folder(folder("marked")).unwrap();
    // The marks of an earlier version (fixed strings), and the shape of today's with a guess
    // at the key: a row holding them keeps its user text out of the targets.
    let old = (
        "\u{FDD0}accelerate-rs-generation\u{FDD1}",
        "\u{FDD1}accelerate-rs-generation\u{FDD0}",
    );
    let key = "\u{FDD0}accelerate-rs-generation-0000000000000000\u{FDD1}";
    for (open, close) in [old, (key, key)] {
        let user = format!("{open}secret{close} question");
        let chat =
            Conversation::new([(Role::User, user.as_str()), (Role::Assistant, "answer")]).unwrap();
        let (text, spans) = encoder.assistant_text_spans(&chat).unwrap();
        assert!(text.contains(&user), "{text:?}");
        assert_eq!(spans.len(), 1, "{spans:?}");
        let target = &text[spans[0].clone()];
        assert!(
            target.contains("answer") && !target.contains("secret"),
            "{target:?}"
        );
    }
}
