//! [`ChatTemplate`]: a model folder's Jinja chat template, rendered as `transformers`'
//! `apply_chat_template` renders it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, State};

use super::python::{self, DateTime, JsonStyle};
use crate::error::{Error, Result};

/// The file `transformers` 5 saves a chat template in.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// The tokenizer configuration of a model folder (older folders keep the template in its
/// `chat_template` key; the special tokens are there too).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The special tokens `transformers` passes to the template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The template's name in the environment (it shows in error messages).
const NAME: &str = "chat_template";
/// The filter `{% generation %}` blocks are rewritten to, and the variable that turns it on.
const GENERATION_FILTER: &str = "__accelerate_rs_generation";
const TRACK_VARIABLE: &str = "__accelerate_rs_track_generation";
/// What the generation filter wraps its text in while tracking (noncharacters around a tag
/// no text holds).
const MARK_START: &str = "\u{FDD0}accelerate-rs-generation\u{FDD1}";
const MARK_END: &str = "\u{FDD1}accelerate-rs-generation\u{FDD0}";

/// A chat template (Jinja, the `chat_template` of a Hugging Face model folder), compiled with
/// [minijinja](https://docs.rs/minijinja) and set up as `transformers` sets up Jinja2:
/// `trim_blocks` and `lstrip_blocks`, loop controls (`{% break %}`), `raise_exception(msg)`,
/// `strftime_now(format)` (UTC here), a `tojson` filter that is Python's `json.dumps`
/// (`indent`, `separators`, `sort_keys`, `ensure_ascii`; no HTML escaping), Python's string
/// and dict methods (`.strip()`, `.items()`, `.startswith()`: minijinja-contrib's `pycompat`),
/// values printed as Python prints them (`None`, `True`), and the `{% generation %}` blocks of
/// `transformers`' assistant-mask extension.
///
/// The template sees `messages`, `add_generation_prompt`, `tools` and `documents` (none), and
/// the folder's special tokens (`bos_token`, `eos_token`, and `unk_token`, `sep_token`,
/// `pad_token`, `cls_token`, `mask_token` where the folder sets them).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    special_tokens: Vec<(String, String)>,
    marked: bool,
}

/// A rendering, with the byte ranges of its `{% generation %}` blocks when they were tracked.
#[derive(Debug, Clone)]
pub(crate) struct Rendered {
    pub text: String,
    pub spans: Vec<Range<usize>>,
}

impl ChatTemplate {
    /// The chat template of a model folder, as `transformers` 5 finds it: `chat_template.jinja`,
    /// else the `chat_template` key of `tokenizer_config.json` (a string, or the list of named
    /// templates, of which the one named `default` is taken); the special tokens from
    /// `tokenizer_config.json` (strings, or AddedToken objects with a `content`), and from
    /// `special_tokens_map.json` where the former has none.
    ///
    /// Fails, naming the file, if the folder has no template, a file cannot be read or parsed,
    /// or the template does not compile.
    pub fn from_folder(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = read_json(&config_path)?;
        let mut special = config.as_ref().map(special_tokens).unwrap_or_default();
        let map_path = dir.join("special_tokens_map.json");
        if let Some(map) = read_json(&map_path)? {
            for (name, token) in special_tokens(&map) {
                if !special.iter().any(|(n, _)| *n == name) {
                    special.push((name, token));
                }
            }
        }
        let jinja = dir.join(CHAT_TEMPLATE_FILE);
        let (source, path) = if jinja.exists() {
            let text = accelerate_rs::files::read_to_string_bounded(
                &jinja,
                accelerate_rs::files::MAX_JSON_BYTES,
            )
            .map_err(|e| Error::ChatTemplate {
                path: jinja.clone(),
                reason: format!("cannot read it: {e}"),
            })?;
            (text, jinja)
        } else {
            let from_config = config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
                .filter(|t| !t.is_null());
            match from_config {
                Some(t) => (template_of_config(t, &config_path)?, config_path),
                None => {
                    let reason = if dir.is_dir() {
                        format!(
                            "the folder has no chat template: neither {CHAT_TEMPLATE_FILE} nor a \
                             `chat_template` key in {TOKENIZER_CONFIG_FILE} (is it a base model \
                             rather than an instruct/chat one?)"
                        )
                    } else {
                        "no such folder".to_string()
                    };
                    return Err(Error::ChatTemplate {
                        path: dir.to_path_buf(),
                        reason,
                    });
                }
            }
        };
        Self::compile(source, special, path)
    }

    /// A template given as text, with the special tokens it may use (`("bos_token", "<s>")`).
    /// Fails if it does not compile.
    pub fn new<K: Into<String>, V: Into<String>>(
        source: &str,
        special_tokens: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self> {
        let special = special_tokens
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        Self::compile(source.to_string(), special, PathBuf::from("<memory>"))
    }

    fn compile(source: String, special: Vec<(String, String)>, path: PathBuf) -> Result<Self> {
        let (source, marked) = rewrite_generation_blocks(&source);
        let mut env = environment().map_err(|e| Error::ChatTemplate {
            path: path.clone(),
            reason: format!("cannot set up the template engine: {}", describe(&e)),
        })?;
        env.add_template_owned(NAME, source)
            .map_err(|e| Error::ChatTemplate {
                path: path.clone(),
                reason: format!("the template does not compile: {}", describe(&e)),
            })?;
        Ok(ChatTemplate {
            env,
            path,
            special_tokens: special,
            marked,
        })
    }

    /// The file the template was read from (`<memory>` for [`new`](Self::new)).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The special tokens the template sees, by name (`bos_token`).
    pub fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    /// The special token `name` (`"eos_token"`), if the folder sets it.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// Whether the template marks the assistant's text with `{% generation %}` blocks.
    pub fn has_generation_marks(&self) -> bool {
        self.marked
    }

    /// Renders `messages` (the template's `messages`); with `track`, also the byte ranges of
    /// the `{% generation %}` blocks. The error is the template's message.
    pub(crate) fn render_messages(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        track: bool,
    ) -> std::result::Result<Rendered, String> {
        let template = self.env.get_template(NAME).map_err(|e| describe(&e))?;
        let mut context: Vec<(String, Value)> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        context.extend([
            ("messages".to_string(), Value::from(messages.to_vec())),
            ("tools".to_string(), Value::from(())),
            ("documents".to_string(), Value::from(())),
            (
                "add_generation_prompt".to_string(),
                Value::from(add_generation_prompt),
            ),
            (TRACK_VARIABLE.to_string(), Value::from(track)),
        ]);
        let text = template
            .render(Value::from_pairs(context))
            .map_err(|e| describe(&e))?;
        if track && self.marked {
            strip_marks(&text)
        } else {
            Ok(Rendered {
                text,
                spans: Vec::new(),
            })
        }
    }
}

/// The environment `transformers` sets up for chat templates, in minijinja.
fn environment() -> std::result::Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        out.write_str(&python::py_str(value))
            .map_err(|e| JinjaError::new(ErrorKind::WriteFailure, e.to_string()))
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| python::py_str(value));
    env.add_filter(GENERATION_FILTER, generation);
    // Python: a string, list, dict or undefined is iterable, None and numbers are not.
    env.add_test("iterable", |value: &Value| {
        matches!(
            value.kind(),
            ValueKind::String
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
                | ValueKind::Undefined
        )
    });
    Ok(env)
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    DateTime::from_unix(secs).strftime(&format)
}

/// The largest `tojson(indent=N)` accepted.
const MAX_INDENT: i64 = 1024;

/// `transformers`' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps` (the options by keyword, as templates give them).
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, JinjaError> {
    let pick = |name: &str| -> std::result::Result<Option<Value>, JinjaError> {
        kwargs.get::<Option<Value>>(name)
    };
    let indent = match pick("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match (v.as_i64(), v.as_str()) {
            (Some(n), _) if (0..=MAX_INDENT).contains(&n) => " ".repeat(n as usize),
            (None, Some(s)) => s.to_string(),
            _ => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent must be an integer from 0 to {MAX_INDENT} or a string"),
                ))
            }
        }),
    };
    let mut style = JsonStyle::new(indent);
    if let Some(v) = pick("ensure_ascii")? {
        style.ensure_ascii = v.is_true();
    }
    if let Some(v) = pick("separators")? {
        if !v.is_none() {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => {
                    style.item_separator = python::py_str(item);
                    style.key_separator = python::py_str(key);
                }
                _ => {
                    return Err(JinjaError::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair (item_separator, key_separator)",
                    ))
                }
            }
        }
    }
    if let Some(v) = pick("sort_keys")? {
        style.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    python::dumps(value, &style)
}

/// The body of a `{% generation %}` block: marked while tracking.
fn generation(state: &State, body: String) -> String {
    let tracking = state.lookup(TRACK_VARIABLE).is_some_and(|v| v.is_true());
    if tracking {
        format!("{MARK_START}{body}{MARK_END}")
    } else {
        body
    }
}

/// The text without the marks, and the byte ranges they enclosed.
fn strip_marks(marked: &str) -> std::result::Result<Rendered, String> {
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut rest = marked;
    let mut open: Option<usize> = None;
    loop {
        let next_start = rest.find(MARK_START);
        let next_end = rest.find(MARK_END);
        let (at, is_start) = match (next_start, next_end) {
            (None, None) => break,
            (Some(s), Some(e)) if s < e => (s, true),
            (Some(s), None) => (s, true),
            (_, Some(e)) => (e, false),
        };
        text.push_str(&rest[..at]);
        match (is_start, open) {
            (true, None) => {
                open = Some(text.len());
                rest = &rest[at + MARK_START.len()..];
            }
            (false, Some(start)) => {
                spans.push(start..text.len());
                open = None;
                rest = &rest[at + MARK_END.len()..];
            }
            (true, Some(_)) => return Err("nested {% generation %} blocks".into()),
            (false, None) => return Err("{% endgeneration %} without {% generation %}".into()),
        }
    }
    if open.is_some() {
        return Err("a {% generation %} block is not closed".into());
    }
    text.push_str(rest);
    Ok(Rendered { text, spans })
}

/// Rewrites `{% generation %}`/`{% endgeneration %}` (any `-`/`+` whitespace control) into a
/// filter block of the same layout: the same trim_blocks/lstrip_blocks behaviour, and a hook.
/// Returns the text and whether there was such a block.
fn rewrite_generation_blocks(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        match parse_generation_tag(tag) {
            Some((len, left, right, end)) => {
                let body = if end {
                    " endfilter ".to_string()
                } else {
                    format!(" filter {GENERATION_FILTER} ")
                };
                out.push_str(&format!("{{%{left}{body}{right}%}}"));
                rest = &tag[len..];
                found = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// At `{%...`: the length of a `{% generation %}` or `{% endgeneration %}` tag, its whitespace
/// controls, and whether it is the end tag.
fn parse_generation_tag(tag: &str) -> Option<(usize, &str, &str, bool)> {
    let inner = tag.strip_prefix("{%")?;
    let close = inner.find("%}")?;
    let body = &inner[..close];
    let (left, body) = match body.chars().next() {
        Some(c @ ('-' | '+')) => (&inner[..c.len_utf8()], &body[1..]),
        _ => ("", body),
    };
    let (body, right) = match body.chars().last() {
        Some(c @ ('-' | '+')) => (&body[..body.len() - 1], &inner[close - c.len_utf8()..close]),
        _ => (body, ""),
    };
    let end = match body.trim() {
        "generation" => false,
        "endgeneration" => true,
        _ => return None,
    };
    Some((2 + close + 2, left, right, end))
}

/// A minijinja error with its line and the cause chain.
fn describe(error: &JinjaError) -> String {
    let mut text = match error.detail() {
        Some(detail) => detail.to_string(),
        None => error.to_string(),
    };
    if let Some(line) = error.line() {
        text.push_str(&format!(" (template line {line})"));
    }
    text
}

/// Reads a JSON file, `None` if it does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        accelerate_rs::files::read_to_string_bounded(path, accelerate_rs::files::MAX_JSON_BYTES)
            .map_err(|e| Error::ChatTemplate {
                path: path.to_path_buf(),
                reason: format!("cannot read it: {e}"),
            })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::ChatTemplate {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// The named special tokens of a tokenizer configuration: strings, or AddedToken objects.
fn special_tokens(config: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_TOKENS
        .iter()
        .filter_map(|name| {
            let token = match config.get(*name)? {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content")?.as_str()?.to_string(),
                _ => return None,
            };
            Some((name.to_string(), token))
        })
        .collect()
}

/// The `chat_template` of `tokenizer_config.json`: a string, or `[{"name", "template"}]` (the
/// one named `default`).
fn template_of_config(value: &serde_json::Value, path: &Path) -> Result<String> {
    let error = |reason: String| Error::ChatTemplate {
        path: path.to_path_buf(),
        reason: format!("key `chat_template`: {reason}"),
    };
    match value {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(items) => {
            let mut names = Vec::new();
            for item in items {
                let name = item.get("name").and_then(|n| n.as_str());
                let template = item.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(t.to_string()),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(error(
                            "each entry of the list must be {\"name\": ..., \"template\": ...}"
                                .into(),
                        ))
                    }
                }
            }
            Err(error(format!(
                "a list of named templates without one named \"default\" (names: {})",
                names.join(", ")
            )))
        }
        other => Err(error(format!(
            "expected a string or a list of named templates, got {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_filter_blocks() {
        let (out, found) = rewrite_generation_blocks(
            "a{% generation %}b{%- endgeneration -%}c{%+generation+%}{% if x %}{%endgeneration%}",
        );
        assert!(found);
        assert_eq!(
            out,
            format!(
                "a{{% filter {GENERATION_FILTER} %}}b{{%- endfilter -%}}c{{%+ filter \
                 {GENERATION_FILTER} +%}}{{% if x %}}{{% endfilter %}}"
            )
        );
        let (same, found) = rewrite_generation_blocks("{% if generation %}{% generations %}{%");
        assert!(!found);
        assert_eq!(same, "{% if generation %}{% generations %}{%");
    }

    #[test]
    fn marks_give_byte_spans() {
        let r = strip_marks(&format!("ab{MARK_START}é{MARK_END}c{MARK_START}{MARK_END}")).unwrap();
        assert_eq!(r.text, "abéc");
        assert_eq!(r.spans, vec![2..4, 5..5]);
        assert!(strip_marks(&format!("{MARK_START}{MARK_START}")).is_err());
    }
}
