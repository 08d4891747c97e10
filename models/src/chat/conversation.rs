//! A conversation: the messages a chat template renders, parsed and checked from a JSONL row
//! (`messages`, or `prompt`/`completion`) or built in code.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Value, ValueKind};

use crate::error::{ChatErrorKind, Error, Result};

/// The role of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model: what it learns to write.
    Assistant,
    /// A tool's result.
    Tool,
}

impl Role {
    /// The role's name in a message (`"assistant"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// The role named `name`, if it is one of the four.
    pub fn from_name(name: &str) -> Option<Role> {
        match name {
            "system" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }
}

/// Where a conversation comes from: a file and a line (from 1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RowSource {
    /// The JSONL file.
    pub path: Arc<Path>,
    /// The line, from 1.
    pub line: usize,
}

/// The keys `transformers` copies a message's reasoning between (`_alias_reasoning_fields`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A conversation to render with a chat template: its messages, as the template sees them
/// (`message.role`, `message.content`, and any other key of the row, such as `tool_calls`,
/// `tool_call_id` or `name`, with its JSON value and key order).
///
/// As `transformers`' `apply_chat_template` does, keys whose value is `null` are dropped, and a
/// message with reasoning (`reasoning_content`, `thinking` or `reasoning`) gets it under
/// `thinking` and `reasoning_content` too.
#[derive(Debug, Clone)]
pub struct Conversation {
    messages: Vec<Value>,
    roles: Vec<Role>,
    source: Option<RowSource>,
}

/// Makes the [`Error::Chat`]s of one row.
pub(crate) struct RowErrors<'a> {
    pub(crate) path: &'a Path,
    pub(crate) line: Option<usize>,
}

impl RowErrors<'_> {
    pub(crate) fn error(
        &self,
        kind: ChatErrorKind,
        field: Option<String>,
        reason: impl Into<String>,
    ) -> Error {
        Error::Chat {
            kind,
            path: self.path.to_path_buf(),
            line: self.line,
            field,
            reason: reason.into(),
        }
    }
}

impl Conversation {
    /// A conversation of plain text messages (for a prompt to generate from, or a training
    /// example built in code). Fails if `messages` is empty.
    pub fn new<S: Into<String>>(messages: impl IntoIterator<Item = (Role, S)>) -> Result<Self> {
        let (messages, roles): (Vec<Value>, Vec<Role>) = messages
            .into_iter()
            .map(|(role, content)| {
                let content: String = content.into();
                let message = Value::from_pairs([
                    ("role", Value::from(role.as_str())),
                    ("content", Value::from(content)),
                ]);
                (message, role)
            })
            .unzip();
        if messages.is_empty() {
            return Err(Error::Chat {
                kind: ChatErrorKind::MissingField,
                path: PathBuf::from("<memory>"),
                line: None,
                field: Some("messages".into()),
                reason: "a conversation needs at least one message".into(),
            });
        }
        Ok(Conversation {
            messages,
            roles,
            source: None,
        })
    }

    /// Parses one JSONL row held in memory (errors name `<memory>`): see
    /// [`ConversationReader`](super::ConversationReader) for the row formats.
    pub fn from_json_row(row: &str) -> Result<Self> {
        let errors = RowErrors {
            path: Path::new("<memory>"),
            line: None,
        };
        parse_row(row, &errors, None)
    }

    /// The number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether there is no message (never, for a conversation that parsed).
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The role of each message.
    pub fn roles(&self) -> &[Role] {
        &self.roles
    }

    /// The text content of message `index`, if it has one (an assistant message with only
    /// `tool_calls` has none).
    pub fn content(&self, index: usize) -> Option<String> {
        let message = self.messages.get(index)?;
        message
            .get_attr("content")
            .ok()
            .and_then(|c| c.as_str().map(str::to_string))
    }

    /// The first `len` messages (all of them if there are fewer), from the same row: e.g. the
    /// prompt before the last assistant turn, to generate from.
    pub fn prefix(&self, len: usize) -> Conversation {
        let len = len.min(self.messages.len());
        Conversation {
            messages: self.messages[..len].to_vec(),
            roles: self.roles[..len].to_vec(),
            source: self.source.clone(),
        }
    }

    /// Whether some message is the assistant's.
    pub fn has_assistant_turn(&self) -> bool {
        self.roles.contains(&Role::Assistant)
    }

    /// The file and line the conversation was read from.
    pub fn source(&self) -> Option<&RowSource> {
        self.source.as_ref()
    }

    /// The messages, as the template sees them.
    pub(crate) fn messages(&self) -> &[Value] {
        &self.messages
    }

    /// The errors of this conversation name its file and line (or `<memory>`).
    pub(crate) fn errors(&self) -> RowErrors<'_> {
        match &self.source {
            Some(s) => RowErrors {
                path: &s.path,
                line: Some(s.line),
            },
            None => RowErrors {
                path: Path::new("<memory>"),
                line: None,
            },
        }
    }
}

/// A key of a map, `None` when missing or `null`.
fn field(value: &Value, key: &str) -> Option<Value> {
    value
        .get_attr(key)
        .ok()
        .filter(|v| !v.is_undefined() && !v.is_none())
}

/// The kind of a JSON value, as the error messages name it.
fn json_kind(value: &Value) -> &'static str {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => "null",
        ValueKind::Bool => "a boolean",
        ValueKind::Number => "a number",
        ValueKind::String => "a string",
        ValueKind::Seq => "a list",
        ValueKind::Map => "an object",
        _ => "a value of another kind",
    }
}

/// Parses and checks one row: `{"messages": [...]}` or `{"prompt": ..., "completion": ...}`.
pub(crate) fn parse_row(
    text: &str,
    errors: &RowErrors<'_>,
    source: Option<RowSource>,
) -> Result<Conversation> {
    let row: Value = serde_json::from_str(text).map_err(|e| {
        errors.error(
            ChatErrorKind::InvalidJson,
            None,
            format!("not a JSON object: {e}"),
        )
    })?;
    if row.kind() != ValueKind::Map {
        return Err(errors.error(
            ChatErrorKind::WrongType,
            None,
            format!(
                "a row must be a JSON object with `messages`, or `prompt` and `completion`; got \
                 {}",
                json_kind(&row)
            ),
        ));
    }
    let (messages, roles, last_field) = row_messages(&row, errors)?;
    if !roles.contains(&Role::Assistant) {
        return Err(errors.error(
            ChatErrorKind::NoAssistantTurn,
            Some(last_field.into()),
            if roles.is_empty() {
                "the conversation has no message".to_string()
            } else {
                format!(
                    "the conversation has no assistant message (roles: {}): nothing to learn",
                    roles
                        .iter()
                        .map(|r| r.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        ));
    }
    Ok(Conversation {
        messages,
        roles,
        source,
    })
}

/// The messages of a row (an object): `messages`, or `prompt` and `completion`; and the field
/// that names the assistant's part.
fn row_messages(
    row: &Value,
    errors: &RowErrors<'_>,
) -> Result<(Vec<Value>, Vec<Role>, &'static str)> {
    let (messages, prompt, completion) = (
        field(row, "messages"),
        field(row, "prompt"),
        field(row, "completion"),
    );
    match (messages, prompt, completion) {
        (Some(_), Some(_), _) | (Some(_), None, Some(_)) => Err(errors.error(
            ChatErrorKind::WrongType,
            Some("messages".into()),
            "a row holds either `messages` or `prompt` and `completion`, not both",
        )),
        (Some(list), None, None) => {
            let (m, r) = parse_messages(&list, "messages", errors)?;
            Ok((m, r, "messages"))
        }
        (None, Some(prompt), Some(completion)) => {
            let (m, r) = parse_prompt_completion(&prompt, &completion, errors)?;
            Ok((m, r, "completion"))
        }
        (None, Some(_), None) => Err(errors.error(
            ChatErrorKind::MissingField,
            Some("completion".into()),
            "a row with `prompt` needs a `completion`",
        )),
        (None, None, Some(_)) => Err(errors.error(
            ChatErrorKind::MissingField,
            Some("prompt".into()),
            "a row with `completion` needs a `prompt`",
        )),
        (None, None, None) => Err(errors.error(
            ChatErrorKind::MissingField,
            Some("messages".into()),
            "a row holds `messages` (a list of {\"role\", \"content\"}), or `prompt` and \
                 `completion`; this one has neither",
        )),
    }
}

/// `prompt` and `completion`: both strings (a user turn and an assistant turn), or both message
/// lists (concatenated).
fn parse_prompt_completion(
    prompt: &Value,
    completion: &Value,
    errors: &RowErrors<'_>,
) -> Result<(Vec<Value>, Vec<Role>)> {
    match (prompt.as_str(), completion.as_str()) {
        (Some(p), Some(c)) => {
            let user =
                Value::from_pairs([("role", Value::from("user")), ("content", Value::from(p))]);
            let assistant = Value::from_pairs([
                ("role", Value::from("assistant")),
                ("content", Value::from(c)),
            ]);
            Ok((vec![user, assistant], vec![Role::User, Role::Assistant]))
        }
        _ if prompt.kind() == ValueKind::Seq && completion.kind() == ValueKind::Seq => {
            let (mut messages, mut roles) = parse_messages(prompt, "prompt", errors)?;
            let (m, r) = parse_messages(completion, "completion", errors)?;
            messages.extend(m);
            roles.extend(r);
            Ok((messages, roles))
        }
        _ => {
            let (name, value) = if matches!(prompt.kind(), ValueKind::String | ValueKind::Seq) {
                ("completion", completion)
            } else {
                ("prompt", prompt)
            };
            Err(errors.error(
                ChatErrorKind::WrongType,
                Some(name.into()),
                format!(
                    "`prompt` and `completion` must both be strings or both be message lists; \
                     `{name}` is {}",
                    json_kind(value)
                ),
            ))
        }
    }
}

/// A list of messages, each checked, with `null` keys dropped and reasoning aliased.
fn parse_messages(
    list: &Value,
    name: &str,
    errors: &RowErrors<'_>,
) -> Result<(Vec<Value>, Vec<Role>)> {
    if list.kind() != ValueKind::Seq {
        return Err(errors.error(
            ChatErrorKind::WrongType,
            Some(name.into()),
            format!("expected a list of messages, got {}", json_kind(list)),
        ));
    }
    let items = list
        .try_iter()
        .map_err(|e| errors.error(ChatErrorKind::WrongType, Some(name.into()), e.to_string()))?;
    let mut messages = Vec::new();
    let mut roles = Vec::new();
    for (i, message) in items.enumerate() {
        let (message, role) = parse_message(&message, &format!("{name}[{i}]"), errors)?;
        messages.push(message);
        roles.push(role);
    }
    Ok((messages, roles))
}

/// One message: a JSON object with a known `role` and a string `content` (an assistant message
/// with `tool_calls` may have none).
fn parse_message(message: &Value, at: &str, errors: &RowErrors<'_>) -> Result<(Value, Role)> {
    if message.kind() != ValueKind::Map {
        return Err(errors.error(
            ChatErrorKind::WrongType,
            Some(at.into()),
            format!(
                "a message must be an object with `role` and `content`, got {}",
                json_kind(message)
            ),
        ));
    }
    let role = field(message, "role").ok_or_else(|| {
        errors.error(
            ChatErrorKind::MissingField,
            Some(format!("{at}.role")),
            "a message needs a `role`",
        )
    })?;
    let name = role.as_str().ok_or_else(|| {
        errors.error(
            ChatErrorKind::WrongType,
            Some(format!("{at}.role")),
            format!("the role must be a string, got {}", json_kind(&role)),
        )
    })?;
    let role = Role::from_name(name).ok_or_else(|| {
        errors.error(
            ChatErrorKind::UnknownRole,
            Some(format!("{at}.role")),
            format!("unknown role {name:?}; expected system, user, assistant or tool"),
        )
    })?;
    let tool_calls = field(message, "tool_calls");
    if let Some(calls) = &tool_calls {
        if calls.kind() != ValueKind::Seq {
            return Err(errors.error(
                ChatErrorKind::WrongType,
                Some(format!("{at}.tool_calls")),
                format!("`tool_calls` must be a list, got {}", json_kind(calls)),
            ));
        }
    }
    match field(message, "content") {
        Some(content) if content.kind() != ValueKind::String => {
            return Err(errors.error(
                ChatErrorKind::WrongType,
                Some(format!("{at}.content")),
                format!("the content must be a string, got {}", json_kind(&content)),
            ))
        }
        None if !(role == Role::Assistant && tool_calls.is_some()) => {
            return Err(errors.error(
                ChatErrorKind::MissingField,
                Some(format!("{at}.content")),
                format!(
                    "a {} message needs a string `content` (only an assistant message with \
                     `tool_calls` may go without)",
                    role.as_str()
                ),
            ))
        }
        _ => {}
    }
    Ok((normalize(message), role))
}

/// The message without its `null` keys, with its reasoning under every name the templates read
/// (`transformers`: `{"thinking": r, **message, "reasoning_content": r}`).
fn normalize(message: &Value) -> Value {
    let keys: Vec<Value> = message.try_iter().map(|i| i.collect()).unwrap_or_default();
    let pairs: Vec<(Value, Value)> = keys
        .into_iter()
        .filter_map(|k| {
            let v = message.get_item(&k).ok()?;
            (!v.is_none() && !v.is_undefined()).then_some((k, v))
        })
        .collect();
    let reasoning = REASONING_FIELDS.iter().find_map(|name| {
        pairs
            .iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v.clone())
    });
    match reasoning {
        None => Value::from_pairs(pairs),
        Some(r) => {
            let mut out: Vec<(Value, Value)> = vec![(Value::from("thinking"), r.clone())];
            for (k, v) in pairs {
                match out.iter_mut().find(|(key, _)| *key == k) {
                    Some(slot) => slot.1 = v,
                    None => out.push((k, v)),
                }
            }
            match out
                .iter_mut()
                .find(|(key, _)| key.as_str() == Some("reasoning_content"))
            {
                Some(slot) => slot.1 = r,
                None => out.push((Value::from("reasoning_content"), r)),
            }
            Value::from_pairs(out)
        }
    }
}
