//! Conversation datasets: JSONL chats rendered with the model's own chat template, tokenized
//! as `transformers`' `apply_chat_template` tokenizes them, with labels on the assistant's
//! tokens.
//!
//! - [`ConversationReader`] streams JSONL files a row at a time: `{"messages": [...]}` rows
//!   (roles `system`, `user`, `assistant`, `tool`) and `{"prompt": ..., "completion": ...}`
//!   rows (strings, or message lists), each checked; an error names the file, the line and the
//!   field ([`Error::Chat`](crate::Error::Chat), whose [`ChatErrorKind`](crate::ChatErrorKind)
//!   says what is wrong).
//! - [`ChatTemplate`] is the folder's Jinja template (`chat_template.jinja`, or the
//!   `chat_template` key of `tokenizer_config.json`), rendered with minijinja set up as
//!   `transformers` sets up Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls,
//!   `raise_exception`, `strftime_now`, Python's `json.dumps` as `tojson`, Python string
//!   methods), with the folder's special tokens (`bos_token`, `eos_token`, ...).
//! - [`ChatEncoder`] renders a [`Conversation`] and tokenizes the text without adding special
//!   tokens (the template writes them): the ids `apply_chat_template(..., tokenize=True)`
//!   gives. Labels are the assistant's tokens (the template's end-of-turn token included),
//!   -100 elsewhere, or every token with [`ChatEncoder::train_on_all`].
//! - [`ChatDataset`] streams [`ChatExample`]s from files, at most `max_len` tokens each (longer
//!   ones truncated or skipped, [`Overlong`], counted in [`ChatStats`] and reported in the
//!   log), for a loop of your own or for `accelerate_rs::StreamingLoader` (padded samples
//!   `[input_ids, labels, attention_mask]`).
//! - [`Packer`] packs examples into rows of a fixed length without padding ([`PackedRow`]:
//!   position ids restarting per document, document ids for block-diagonal attention, no loss
//!   across a boundary); [`PackedBatch`] stacks rows into the model's [`Inputs`](crate::Inputs).
//!
//! # Which tokens are the assistant's
//!
//! A template with `{% generation %}` blocks (the marks of `transformers`' assistant mask) says
//! it: the tokens whose offsets overlap the text of a block are the assistant's, exactly
//! `apply_chat_template(..., return_assistant_tokens_mask=True)`.
//!
//! Other templates (those of Llama 3, Qwen2 and Mistral) are split by **prefixes**: for each
//! assistant message `i`, the template renders the messages before it with the generation
//! prompt (`P`, what the model is given when it writes message `i`) and the messages up to and
//! including it (`Q`); the text `Q[len(P)..]` is what the assistant adds: its content and the
//! template's end-of-turn token (and anything the template writes after them before the next
//! turn, such as ChatML's line break after `<|im_end|>`; this is also what TRL's
//! prompt-completion masking counts as the completion). A token is the assistant's when its
//! offsets overlap such a span, the rule `transformers` applies to `{% generation %}` blocks.
//! The method needs `P` to be the start of `Q` and `Q` the start of the whole rendering; a
//! template that renders prefixes differently (Mistral v0.3 writes the system prompt into the
//! *last* user turn only) gets [`ChatErrorKind::InconsistentPrefixes`](crate::ChatErrorKind)
//! for that conversation rather than a wrong mask: give the template `{% generation %}` marks
//! ([`ChatTemplate::new`] takes a template of your own), or train on every token.
//!
//! Checked against `transformers` (golden files of `scripts/chat_reference.py`): the rendered
//! text, the token ids and the masks for Llama 3.1, Qwen2.5 and Mistral v0.3 Instruct's
//! templates (the prefix method done in Python with `transformers`' rendering), and for a
//! template with `{% generation %}` marks (`return_assistant_tokens_mask`).
//!
//! # Differences from Jinja2
//!
//! minijinja is not Jinja2: the templates of the model families above render identically, but a
//! template relying on a Python detail minijinja lacks fails to render (an error naming the
//! row and the template line, never a wrong text that goes unnoticed, as far as the goldens
//! go). `strftime_now` gives UTC time (`transformers` gives local time). JSON objects keep the
//! key order of the row.

mod conversation;
mod dataset;
mod encoder;
mod pack;
mod python;
mod reader;
mod tags;
mod template;

pub use conversation::{Conversation, Role, RowSource};
pub use dataset::{ChatDataset, ChatExamples, ChatStats, Overlong};
pub use encoder::{AssistantSpans, ChatEncoder, ChatExample};
pub use pack::{PackedBatch, PackedRow, Packer};
pub use reader::{ConversationReader, DEFAULT_MAX_LINE_BYTES};
pub use template::{ChatTemplate, CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_FUEL, TOKENIZER_CONFIG_FILE};
