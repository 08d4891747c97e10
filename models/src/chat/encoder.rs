//! [`ChatEncoder`]: a conversation rendered with the chat template, tokenized, and labelled
//! (the assistant's tokens, or every token).

use std::ops::Range;
use std::path::Path;

use tokenizers::Tokenizer;

use super::conversation::{Conversation, Role, RowSource};
use super::template::{ChatTemplate, Rendered};
use crate::error::{ChatErrorKind, Error, Result};
use crate::layers::IGNORE_INDEX;
use crate::tokenizer::Worker;

/// How the assistant's text is found in a rendering (see the [module docs](super)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AssistantSpans {
    /// The template's `{% generation %}` blocks where it has them (exactly `transformers`'
    /// `return_assistant_tokens_mask`), else [`Prefixes`](Self::Prefixes).
    #[default]
    Auto,
    /// Always by rendering prefixes of the conversation.
    Prefixes,
}

/// A tokenized training example: the token ids of the rendered conversation and their labels
/// (the token id where the loss learns it, [`IGNORE_INDEX`] elsewhere; unshifted, as
/// `transformers` takes them: the models shift inside `loss`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatExample {
    /// The token ids.
    pub input_ids: Vec<u32>,
    /// One label per token.
    pub labels: Vec<i64>,
    /// The file and line of the row.
    pub source: Option<RowSource>,
}

impl ChatExample {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// The number of labelled tokens (not [`IGNORE_INDEX`]).
    pub fn num_targets(&self) -> usize {
        self.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
    }

    /// The assistant mask: 1 where a token is labelled.
    pub fn target_mask(&self) -> Vec<u8> {
        self.labels
            .iter()
            .map(|&l| u8::from(l != IGNORE_INDEX))
            .collect()
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.input_ids.truncate(len);
        self.labels.truncate(len);
    }
}

/// Renders conversations with a model folder's chat template and tokenizes them as
/// `transformers`' `apply_chat_template(..., tokenize=True)` does (the rendered text encoded
/// without adding special tokens: the template writes them), with labels on the assistant's
/// tokens (by default) or on every token ([`train_on_all`](Self::train_on_all)).
///
/// ```no_run
/// use accelerate_rs_models::chat::{ChatEncoder, Conversation, Role};
///
/// # fn main() -> accelerate_rs_models::Result<()> {
/// let encoder = ChatEncoder::from_folder("my-instruct-model")?;
/// let chat = Conversation::new([(Role::User, "Hi!"), (Role::Assistant, "Hello.")])?;
/// let example = encoder.encode(&chat)?; // input_ids, labels (-100 outside "Hello.<eot>")
/// let prompt = encoder.encode_prompt(&Conversation::new([(Role::User, "Hi!")])?)?;
/// # let _ = (example, prompt); Ok(()) }
/// ```
#[derive(Debug)]
pub struct ChatEncoder {
    template: ChatTemplate,
    /// With the thread kept for the calls into the `tokenizers` library (each under a time
    /// limit, see [`load_tokenizer`](crate::load_tokenizer)).
    tokenizer: Worker,
    train_on_all: bool,
    spans: AssistantSpans,
}

impl ChatEncoder {
    /// The chat template ([`ChatTemplate::from_folder`]) and the tokenizer
    /// ([`load_tokenizer`](crate::load_tokenizer)) of a model folder.
    pub fn from_folder(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let template = ChatTemplate::from_folder(dir)?;
        let tokenizer = crate::tokenizer::load_tokenizer(dir)?;
        Ok(Self::new(template, tokenizer))
    }

    /// A template and a tokenizer.
    pub fn new(template: ChatTemplate, tokenizer: Tokenizer) -> Self {
        ChatEncoder {
            template,
            tokenizer: Worker::new(tokenizer),
            train_on_all: false,
            spans: AssistantSpans::Auto,
        }
    }

    /// Labels every token (the whole conversation is learnt), not only the assistant's.
    pub fn train_on_all(mut self, all: bool) -> Self {
        self.train_on_all = all;
        self
    }

    /// How the assistant's tokens are found (default [`AssistantSpans::Auto`]).
    pub fn assistant_spans(mut self, spans: AssistantSpans) -> Self {
        self.spans = spans;
        self
    }

    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        self.tokenizer.tokenizer()
    }

    /// The text of `ids` (`skip_special`: without the special tokens), as
    /// [`decode_ids`](crate::decode_ids) gives it, with this encoder's tokenizer shared rather
    /// than copied for the call's thread.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        crate::tokenizer::decode_on(&self.tokenizer, ids, skip_special)
    }

    /// The id of the template's special token `name` (`"eos_token"`, `"pad_token"`) in the
    /// tokenizer, if both know it.
    pub fn special_token_id(&self, name: &str) -> Option<u32> {
        self.tokenizer()
            .token_to_id(self.template.special_token(name)?)
    }

    /// The text of the whole conversation, as the template renders it.
    pub fn render(&self, conversation: &Conversation) -> Result<String> {
        Ok(self
            .render_prefix(conversation, conversation.len(), false, false)?
            .text)
    }

    /// The prompt to generate the next assistant turn from: the conversation rendered with
    /// `add_generation_prompt=True`, tokenized (as `apply_chat_template(conversation,
    /// add_generation_prompt=True)`).
    pub fn encode_prompt(&self, conversation: &Conversation) -> Result<Vec<u32>> {
        let text = self
            .render_prefix(conversation, conversation.len(), true, false)?
            .text;
        let (ids, _) = self.tokenize(conversation, &text)?;
        Ok(ids)
    }

    /// The rendered text and the byte ranges of it that are the assistant's (see the
    /// [module docs](super) for how they are found). Fails if the conversation has no
    /// assistant turn, the template fails, or (prefix method) renders the conversation's
    /// prefixes inconsistently.
    pub fn assistant_text_spans(
        &self,
        conversation: &Conversation,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let errors = conversation.errors();
        if !conversation.has_assistant_turn() {
            return Err(errors.error(
                ChatErrorKind::NoAssistantTurn,
                None,
                "the conversation has no assistant message: nothing to learn",
            ));
        }
        let marks = self.spans == AssistantSpans::Auto && self.template.has_generation_marks();
        let full = self.render_prefix(conversation, conversation.len(), false, marks)?;
        if marks {
            return Ok((full.text, full.spans));
        }
        let mut spans = Vec::new();
        // Two renderings per assistant turn, each of a longer prefix: the work grows with the
        // square of the conversation's length, and is held to a budget of its own.
        let budget = self.template.fuel().saturating_mul(PREFIX_WORK);
        let mut used = full.fuel;
        for (i, role) in conversation.roles().iter().enumerate() {
            if *role != Role::Assistant {
                continue;
            }
            let prompt = self.render_prefix(conversation, i, true, false)?;
            let with_turn = self.render_prefix(conversation, i + 1, false, false)?;
            used = used
                .saturating_add(prompt.fuel)
                .saturating_add(with_turn.fuel);
            if used > budget {
                return Err(errors.error(
                    ChatErrorKind::Render,
                    Some(format!("messages[{i}]")),
                    format!(
                        "finding the assistant's tokens by rendering each prefix of this \
                         conversation of {} messages took more than {budget} units of fuel \
                         ({PREFIX_WORK} times the template's budget, which \
                         ChatTemplate::with_fuel sets) by message {i}; give the template \
                         {{% generation %}} marks (one rendering), train on every token, or \
                         split the conversation",
                        conversation.len()
                    ),
                ));
            }
            let (prompt, with_turn) = (prompt.text, with_turn.text);
            if !with_turn.starts_with(&prompt) || !full.text.starts_with(&with_turn) {
                return Err(errors.error(
                    ChatErrorKind::InconsistentPrefixes,
                    Some(format!("messages[{i}]")),
                    format!(
                        "the chat template renders this conversation's prefixes inconsistently \
                         ({}), so the assistant's tokens of message {i} cannot be found by \
                         prefixes (some templates, such as Mistral v0.3's, move the system \
                         prompt into the last user turn); give the template {{% generation %}} \
                         marks, or train on every token",
                        if with_turn.starts_with(&prompt) {
                            "the conversation up to this message is not the start of the whole"
                        } else {
                            "the prompt before this message, with the generation prompt, is not \
                             the start of the conversation up to it"
                        }
                    ),
                ));
            }
            spans.push(prompt.len()..with_turn.len());
        }
        Ok((full.text, spans))
    }

    /// Renders, tokenizes and labels a conversation (which needs an assistant turn).
    pub fn encode(&self, conversation: &Conversation) -> Result<ChatExample> {
        let (input_ids, labels) = if self.train_on_all {
            let text = self.render(conversation)?;
            let (ids, _) = self.tokenize(conversation, &text)?;
            let labels = ids.iter().map(|&id| i64::from(id)).collect();
            (ids, labels)
        } else {
            let (text, spans) = self.assistant_text_spans(conversation)?;
            let (ids, offsets) = self.tokenize(conversation, &text)?;
            let mask = overlap_mask(&offsets, &spans);
            let labels = ids
                .iter()
                .zip(&mask)
                .map(|(&id, &m)| if m { i64::from(id) } else { IGNORE_INDEX })
                .collect();
            (ids, labels)
        };
        let example = ChatExample {
            input_ids,
            labels,
            source: conversation.source().cloned(),
        };
        if example.num_targets() == 0 {
            return Err(conversation.errors().error(
                ChatErrorKind::NoTarget,
                None,
                "the assistant's turns render to no token: nothing to learn",
            ));
        }
        Ok(example)
    }

    /// Renders the first `len` messages.
    fn render_prefix(
        &self,
        conversation: &Conversation,
        len: usize,
        add_generation_prompt: bool,
        track: bool,
    ) -> Result<Rendered> {
        let messages = &conversation.messages()[..len.min(conversation.len())];
        self.template
            .render_messages(messages, add_generation_prompt, track)
            .map_err(|reason| {
                let what = if len == conversation.len() && !add_generation_prompt {
                    "the conversation".to_string()
                } else {
                    format!(
                        "its first {len} messages{}",
                        if add_generation_prompt {
                            " with add_generation_prompt"
                        } else {
                            ""
                        }
                    )
                };
                conversation.errors().error(
                    ChatErrorKind::Render,
                    None,
                    format!(
                        "the chat template ({}) failed to render {what}: {reason}",
                        self.template.path().display()
                    ),
                )
            })
    }

    /// The ids and byte offsets of `text`, encoded without adding special tokens (within the
    /// time limit of every call into the `tokenizers` library).
    fn tokenize(&self, conversation: &Conversation, text: &str) -> Result<(Vec<u32>, Offsets)> {
        let owned = text.to_string();
        self.tokenizer
            .limited("encode the rendered text", text.len(), move |tokenizer| {
                let encoding = tokenizer.encode(owned, false)?;
                Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
            })
            .map_err(|reason| {
                conversation
                    .errors()
                    .error(ChatErrorKind::Tokenize, None, reason)
            })
    }
}

/// How many renderings' budgets the prefix method may use on one conversation (134M units at
/// the default budget, a few seconds). The work grows with the square of the conversation's
/// length: 2,000 one-word messages take 68M units with the Qwen2.5 template and 75M with Llama
/// 3.1's, 1,500 take 79M with Mistral's (the fixtures' templates); a hostile 16 MiB row of
/// 400,000 messages would take hours.
const PREFIX_WORK: u64 = 16;

/// The byte range of each token in the text.
type Offsets = Vec<(usize, usize)>;

/// `transformers`' rule for `{% generation %}` spans: a token is the assistant's when its
/// offsets overlap a span (spans and offsets both in order).
fn overlap_mask(offsets: &[(usize, usize)], spans: &[Range<usize>]) -> Vec<bool> {
    let mut mask = vec![false; offsets.len()];
    let mut k = 0;
    for (t, &(start, end)) in offsets.iter().enumerate() {
        while k < spans.len() && start >= spans[k].end {
            k += 1;
        }
        let Some(span) = spans.get(k) else {
            break;
        };
        if end > span.start {
            mask[t] = true;
        }
    }
    mask
}

/// An error about an example passed in by the caller, naming its row where it has one.
pub(crate) fn example_error(example: &ChatExample, reason: String) -> Error {
    let at = match &example.source {
        Some(s) => format!("the example of {}:{}", s.path.display(), s.line),
        None => "the example".to_string(),
    };
    Error::Accelerate(accelerate_rs::Error::invalid(at, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_transformers_rule() {
        let offsets = [(0, 3), (3, 4), (4, 5), (6, 9), (9, 10), (10, 12)];
        assert_eq!(
            overlap_mask(&offsets, &[4..6, 10..11]),
            vec![false, false, true, false, false, true]
        );
        // A token reaching into a span from the left, and a zero-width one inside it.
        assert_eq!(
            overlap_mask(&[(0, 5), (5, 5), (7, 8), (9, 10)], &[4..6, 9..9]),
            vec![true, true, false, false]
        );
        assert_eq!(overlap_mask(&offsets, &[]), vec![false; 6]);
    }
}
