//! [`ChatTemplate`]: a model folder's Jinja chat template, rendered as `transformers`'
//! `apply_chat_template` renders it.

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error as JinjaError, ErrorKind, State};

use super::python::{self, DateTime, JsonStyle};
use super::tags;
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
/// The filter every value assigned into a namespace attribute goes through ([`detach`]).
const DETACH_FILTER: &str = "__accelerate_rs_detach";

/// The work one rendering may do by default ([`ChatTemplate::with_fuel`]), in minijinja's
/// fuel: about one instruction, or 64 bytes of text made, per unit. A template that loops
/// without end or builds gigabytes fails with an error naming the budget instead of hanging
/// the run or exhausting its memory (8M units: at most 512 MiB of text). Real templates need
/// far less: a 15 MB conversation of 5,001 messages takes 1.1M to 1.4M units with the
/// Llama 3.1, Qwen2.5 and Mistral templates of `models/tests/fixtures`, and the longest row
/// [`ConversationReader`](super::ConversationReader) accepts is 16 MiB.
pub const CHAT_TEMPLATE_FUEL: u64 = 8 << 20;
/// The engine's recursion limit (its default is 500): a macro call counts about 10, a block
/// 1, so 200 allow some 20 nested macro calls, far more than chat templates nest (a recursive
/// macro over a tool's JSON schema goes as deep as the schema). A debug build takes about 5 KiB
/// of stack per level: at 500 a template that recurses without end needs 2 to 3 MiB and
/// overflowed the 2 MiB stack of a spawned thread (a data loader's worker: an abort); at 200 it
/// needs about 1 MiB (release builds need far less).
const RECURSION_LIMIT: usize = 200;
/// The bytes of text one unit of fuel pays for (minijinja's own rate).
const BYTES_PER_FUEL: u64 = 64;
/// What the generation filter wraps its text in while tracking, around the rendering's
/// [`Marks::key`]: noncharacters around a tag and a random key, so that a conversation cannot
/// hold the marks (a row with a fixed mark in a user's message would have its text trained on).
const MARK_START: char = '\u{FDD0}';
const MARK_END: char = '\u{FDD1}';

/// The marks of one rendering's `{% generation %}` blocks.
struct Marks {
    start: String,
    end: String,
}

impl Marks {
    /// A random key, new for every rendering (std's hasher keys: random per process, new per
    /// call).
    fn key() -> String {
        use std::hash::BuildHasher;
        let key = std::collections::hash_map::RandomState::new().hash_one(0u8);
        format!("accelerate-rs-generation-{key:016x}")
    }

    /// The marks around `key`.
    fn new(key: &str) -> Self {
        Marks {
            start: format!("{MARK_START}{key}{MARK_END}"),
            end: format!("{MARK_END}{key}{MARK_START}"),
        }
    }
}

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
///
/// A template is code from the folder, so a rendering is bounded: it may do
/// [`CHAT_TEMPLATE_FUEL`] units of work ([`with_fuel`](Self::with_fuel) sets another budget),
/// printed values stop at what the budget can still pay for and at 256 levels of nesting, and
/// a value assigned into a namespace attribute (`{% set ns.x = value %}`) is stored as a copy,
/// so that no namespace can hold itself. Each ends in an error naming the template, never a
/// hang, an exhausted memory or a stack overflow.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    special_tokens: Vec<(String, String)>,
    marked: bool,
    /// The fuel of one rendering (named by the error when it runs out).
    fuel: u64,
}

/// A rendering, with the byte ranges of its `{% generation %}` blocks when they were tracked.
#[derive(Debug, Clone)]
pub(crate) struct Rendered {
    pub text: String,
    pub spans: Vec<Range<usize>>,
    /// The fuel the rendering used.
    pub fuel: u64,
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
        // There but unreadable (a link to nothing, a folder) is an error naming it: falling
        // back to `tokenizer_config.json`'s template would train on another one silently.
        let (source, path) = if crate::config::present(&jinja) {
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
        let (source, marked) = rewrite_source(&source);
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
            fuel: CHAT_TEMPLATE_FUEL,
        })
    }

    /// The template with a budget of `units` of fuel per rendering instead of
    /// [`CHAT_TEMPLATE_FUEL`] (for conversations far longer than any row the reader accepts).
    pub fn with_fuel(mut self, units: u64) -> Self {
        self.env.set_fuel(Some(units));
        self.fuel = units;
        self
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
        let key = (track && self.marked).then(Marks::key);
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
            (TRACK_VARIABLE.to_string(), Value::from(key.clone())),
        ]);
        let captured = template
            .render_captured(Value::from_pairs(context))
            .map_err(|e| self.out_of_fuel(&e).unwrap_or_else(|| describe(&e)))?;
        let fuel = captured.state().fuel_levels().map_or(0, |(used, _)| used);
        let text = captured.into_output();
        let (text, spans) = match key {
            Some(key) => strip_marks(&text, &Marks::new(&key))?,
            None => (text, Vec::new()),
        };
        Ok(Rendered { text, spans, fuel })
    }

    /// The fuel one rendering may use.
    pub(crate) fn fuel(&self) -> u64 {
        self.fuel
    }

    /// A rendering's error when it ran out of fuel, naming the budget.
    fn out_of_fuel(&self, error: &JinjaError) -> Option<String> {
        (error.kind() == ErrorKind::OutOfFuel).then(|| {
            format!(
                "{}: the template did more work than its budget of {} units of fuel allows \
                 (about one instruction or 64 bytes of text each; ChatTemplate::with_fuel): a \
                 loop that does not end, or far more text than a conversation needs",
                describe(error),
                self.fuel
            )
        })
    }
}

/// The environment `transformers` sets up for chat templates, in minijinja.
fn environment() -> std::result::Result<Environment<'static>, JinjaError> {
    let mut env = Environment::new();
    env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
    env.set_recursion_limit(RECURSION_LIMIT);
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, state, value| {
        out.write_str(&python::py_str(value, print_budget(state), 0)?)
            .map_err(|e| JinjaError::new(ErrorKind::WriteFailure, e.to_string()))
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |state: &State, value: &Value| {
        python::py_str(value, print_budget(state), 0)
    });
    env.add_filter(GENERATION_FILTER, generation);
    env.add_filter(DETACH_FILTER, detach);
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

/// The longest `strftime_now` format accepted (real ones are a few fields: `"%d %b %Y"`); a
/// field can print ten times its length (`%A`: `Wednesday`), so a format is held to this before
/// it is expanded rather than charged after.
const MAX_DATE_FORMAT: usize = 4096;

fn strftime_now(format: String) -> std::result::Result<String, JinjaError> {
    if format.len() > MAX_DATE_FORMAT {
        return Err(JinjaError::new(
            ErrorKind::InvalidOperation,
            format!(
                "strftime_now: a format of {} bytes (at most {MAX_DATE_FORMAT})",
                format.len()
            ),
        ));
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    Ok(DateTime::from_unix(secs).strftime(&format))
}

/// The largest `tojson(indent=N)` accepted.
const MAX_INDENT: i64 = 1024;

/// `transformers`' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps` (the options by keyword, as templates give them).
fn tojson(state: &State, value: &Value, kwargs: Kwargs) -> std::result::Result<String, JinjaError> {
    let budget = print_budget(state);
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
                    style.item_separator = python::py_str(item, budget, 0)?;
                    style.key_separator = python::py_str(key, budget, 0)?;
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
    python::dumps(value, &style, budget)
}

/// The bytes a value printed now may take: what the rendering's fuel can still pay for.
fn print_budget(state: &State) -> usize {
    let left = state
        .fuel_levels()
        .map_or(CHAT_TEMPLATE_FUEL, |(_, remaining)| remaining);
    usize::try_from(left.saturating_mul(BYTES_PER_FUEL)).unwrap_or(usize::MAX)
}

/// A value assigned into a namespace attribute (`{% set ns.x = value %}`), copied: lists and
/// dicts rebuilt (a namespace inside becomes a plain dict of what it holds now). Jinja2 stores
/// the value itself, but namespaces are the one mutable value, and one stored inside itself
/// would make every later print or comparison of it recurse without end (a stack overflow
/// aborts the process). Strings are shared, not copied; every item copied costs fuel.
fn detach(state: &State, value: Value) -> std::result::Result<Value, JinjaError> {
    copy_value(state, &value, 0)
}

fn copy_value(
    state: &State,
    value: &Value,
    depth: usize,
) -> std::result::Result<Value, JinjaError> {
    python::check_depth(depth)?;
    match value.kind() {
        ValueKind::Seq | ValueKind::Iterable => {
            let mut items = Vec::new();
            for item in value.try_iter()? {
                state.consume_fuel(1)?;
                items.push(copy_value(state, &item, depth + 1)?);
            }
            Ok(Value::from(items))
        }
        ValueKind::Map => {
            let mut pairs = Vec::new();
            for key in value.try_iter()? {
                state.consume_fuel(1)?;
                let item = value.get_item(&key)?;
                pairs.push((key, copy_value(state, &item, depth + 1)?));
            }
            Ok(Value::from_pairs(pairs))
        }
        _ => Ok(value.clone()),
    }
}

/// The body of a `{% generation %}` block: marked while tracking (the tracking variable holds
/// the rendering's key).
fn generation(state: &State, body: String) -> String {
    match state.lookup(TRACK_VARIABLE) {
        Some(key) if key.kind() == ValueKind::String => {
            let marks = Marks::new(key.as_str().unwrap_or_default());
            format!("{}{body}{}", marks.start, marks.end)
        }
        _ => body,
    }
}

/// The text without the marks, and the byte ranges they enclosed.
fn strip_marks(
    marked: &str,
    marks: &Marks,
) -> std::result::Result<(String, Vec<Range<usize>>), String> {
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut rest = marked;
    let mut open: Option<usize> = None;
    loop {
        let next_start = rest.find(&marks.start);
        let next_end = rest.find(&marks.end);
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
                rest = &rest[at + marks.start.len()..];
            }
            (false, Some(start)) => {
                spans.push(start..text.len());
                open = None;
                rest = &rest[at + marks.end.len()..];
            }
            (true, Some(_)) => return Err("nested {% generation %} blocks".into()),
            (false, None) => return Err("{% endgeneration %} without {% generation %}".into()),
        }
    }
    if open.is_some() {
        return Err("a {% generation %} block is not closed".into());
    }
    text.push_str(rest);
    Ok((text, spans))
}

/// Rewrites `{% generation %}`/`{% endgeneration %}` (any `-`/`+` whitespace control) into a
/// filter block of the same layout (the same trim_blocks/lstrip_blocks behaviour, and a hook),
/// and passes the value of every assignment into a namespace attribute through the filter that
/// copies it ([`detach`]). Returns the text and whether there was a generation block.
fn rewrite_source(source: &str) -> (String, bool) {
    let mut found = false;
    let text = tags::rewrite_tags(source, |tag| {
        if let Some((left, right, end)) = tags::generation_tag(tag) {
            found = true;
            let body = if end {
                " endfilter ".to_string()
            } else {
                format!(" filter {GENERATION_FILTER} ")
            };
            return Some(format!("{left}{body}{right}"));
        }
        tags::filter_attribute_assignment(tag, DETACH_FILTER)
    });
    (text, found)
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
    if !crate::config::present(path) {
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
            let shown: Vec<&str> = names.iter().take(8).map(String::as_str).collect();
            let more = names.len().saturating_sub(shown.len());
            Err(error(format!(
                "a list of named templates without one named \"default\" (names: {}{})",
                shown.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )))
        }
        other => {
            let kind = match other {
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                serde_json::Value::Object(_) => "an object",
                _ => "null",
            };
            Err(error(format!(
                "expected a string or a list of named templates, got {kind}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_filter_blocks() {
        let (out, found) = rewrite_source(
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
        let (same, found) = rewrite_source("{% if generation %}{% generations %}{%");
        assert!(!found);
        assert_eq!(same, "{% if generation %}{% generations %}{%");
    }

    #[test]
    fn a_config_key_that_is_no_template_is_described_not_printed() {
        let path = Path::new("tokenizer_config.json");
        let list: Vec<serde_json::Value> = (0..20)
            .map(|i| serde_json::json!({"name": format!("t{i}"), "template": "x"}))
            .collect();
        let err = template_of_config(&serde_json::Value::Array(list), path).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("t0, t1") && text.contains("and 12 more"),
            "{text}"
        );
        let big = serde_json::json!({"k": "v".repeat(10_000)});
        let text = template_of_config(&big, path).unwrap_err().to_string();
        assert!(text.contains("got an object") && text.len() < 300, "{text}");
    }

    #[test]
    fn marks_give_byte_spans() {
        let marks = Marks::new("k");
        let (start, end) = (&marks.start, &marks.end);
        let (text, spans) = strip_marks(&format!("ab{start}é{end}c{start}{end}"), &marks).unwrap();
        assert_eq!(text, "abéc");
        assert_eq!(spans, vec![2..4, 5..5]);
        assert!(strip_marks(&format!("{start}{start}"), &marks).is_err());
        // Another rendering's marks are text.
        let other = Marks::new("j");
        let (text, spans) = strip_marks(&format!("a{}b", other.start), &marks).unwrap();
        assert_eq!((text, spans), (format!("a{}b", other.start), vec![]));
        assert_ne!(Marks::key(), Marks::key());
    }
}
