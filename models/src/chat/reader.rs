//! [`ConversationReader`]: JSONL conversation files read a row at a time.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::conversation::{parse_row, Conversation, RowErrors, RowSource};
use crate::error::{ChatErrorKind, Error, Result};

/// The longest line [`ConversationReader`] accepts by default: 16 MiB.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;

/// Reads JSONL conversation files one row at a time (streaming: one line in memory), in order,
/// file after file, yielding each row as a checked [`Conversation`].
///
/// A row is one of (the formats of TRL's conversational datasets):
///
/// ```text
/// {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
///               {"role": "assistant", "content": "..."}]}
/// {"prompt": "...", "completion": "..."}
/// {"prompt": [{"role": "user", "content": "..."}], "completion": [{"role": "assistant", ...}]}
/// ```
///
/// Roles are `system`, `user`, `assistant` and `tool`; `content` is a string (an assistant
/// message with `tool_calls` may have none); other keys (`tool_calls`, `tool_call_id`, `name`,
/// `reasoning_content`) reach the template as they are. A `prompt`/`completion` pair of strings
/// is the conversation of a user turn and an assistant turn; of message lists, the two lists
/// one after the other. Every row needs an assistant message. Blank lines are skipped.
///
/// Errors ([`Error::Chat`]) name the file, the line and the field: a file that cannot be read, a
/// line longer than [`max_line_bytes`](Self::max_line_bytes), invalid JSON, a missing field, a
/// field of the wrong type, an unknown role, a row without an assistant turn, a file without a
/// row. The first error ends the stream.
#[derive(Debug)]
pub struct ConversationReader {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<OpenFile>,
    max_line_bytes: usize,
    failed: bool,
}

/// The file being read.
#[derive(Debug)]
struct OpenFile {
    path: Arc<Path>,
    reader: BufReader<File>,
    /// The number of the last line read.
    line: usize,
    /// Rows read from it.
    rows: usize,
}

impl ConversationReader {
    /// Reads `files` in order. Fails if `files` is empty (a missing file is an error, naming it,
    /// when the stream reaches it).
    pub fn new(files: Vec<PathBuf>) -> Result<Self> {
        if files.is_empty() {
            return Err(Error::Chat {
                kind: ChatErrorKind::Io,
                path: PathBuf::from("<none>"),
                line: None,
                field: None,
                reason: "no conversation file given".into(),
            });
        }
        Ok(ConversationReader {
            files: files.into_iter(),
            current: None,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            failed: false,
        })
    }

    /// The longest line accepted, in bytes (default [`DEFAULT_MAX_LINE_BYTES`]): a longer one
    /// is an error naming the file and line, read no further than the bound.
    pub fn max_line_bytes(mut self, bytes: usize) -> Self {
        self.max_line_bytes = bytes.max(1);
        self
    }

    /// Opens the next file.
    fn open_next(&mut self) -> Option<Result<()>> {
        let path = self.files.next()?;
        Some(
            match accelerate_rs::files::open_regular(&path).map(|(f, _)| f) {
                Ok(file) => {
                    self.current = Some(OpenFile {
                        path: Arc::from(path),
                        reader: BufReader::new(file),
                        line: 0,
                        rows: 0,
                    });
                    Ok(())
                }
                Err(e) => Err(Error::Chat {
                    kind: ChatErrorKind::Io,
                    reason: format!("cannot open the conversation file: {}", short(&e)),
                    path,
                    line: None,
                    field: None,
                }),
            },
        )
    }

    /// The next row of the current file: `None` at its end.
    fn next_row(&mut self) -> Option<Result<Conversation>> {
        let limit = self.max_line_bytes;
        let file = self.current.as_mut()?;
        loop {
            let mut buf = Vec::new();
            let read = (&mut file.reader)
                .take(limit as u64 + 1)
                .read_until(b'\n', &mut buf);
            let number = file.line + 1;
            let errors = RowErrors {
                path: &file.path,
                line: Some(number),
            };
            let n = match read {
                Ok(n) => n,
                Err(e) => {
                    return Some(Err(errors.error(
                        ChatErrorKind::Io,
                        None,
                        format!("cannot read the line: {e}"),
                    )))
                }
            };
            if n == 0 {
                if file.rows == 0 {
                    return Some(Err(Error::Chat {
                        kind: ChatErrorKind::EmptyFile,
                        path: file.path.to_path_buf(),
                        line: None,
                        field: None,
                        reason: "the file holds no conversation (one JSON object per line)".into(),
                    }));
                }
                return None;
            }
            file.line = number;
            if buf.last() == Some(&b'\n') {
                buf.pop();
                if buf.last() == Some(&b'\r') {
                    buf.pop();
                }
            } else if buf.len() > limit {
                return Some(Err(errors.error(
                    ChatErrorKind::LineTooLong,
                    None,
                    format!("the line is longer than {limit} bytes (the reader's max_line_bytes)"),
                )));
            }
            let Ok(text) = std::str::from_utf8(&buf) else {
                return Some(Err(errors.error(
                    ChatErrorKind::InvalidJson,
                    None,
                    "the line is not valid UTF-8",
                )));
            };
            if text.trim().is_empty() {
                continue;
            }
            file.rows += 1;
            let source = RowSource {
                path: Arc::clone(&file.path),
                line: number,
            };
            return Some(parse_row(text, &errors, Some(source)));
        }
    }
}

impl Iterator for ConversationReader {
    type Item = Result<Conversation>;

    fn next(&mut self) -> Option<Result<Conversation>> {
        if self.failed {
            return None;
        }
        loop {
            if self.current.is_some() {
                match self.next_row() {
                    Some(item) => {
                        self.failed = item.is_err();
                        return Some(item);
                    }
                    None => self.current = None,
                }
            }
            if let Err(e) = self.open_next()? {
                self.failed = true;
                return Some(Err(e));
            }
        }
    }
}

/// The reason of a file error without the path the chat error names already.
fn short(e: &accelerate_rs::Error) -> String {
    match e {
        accelerate_rs::Error::InputFile { reason, .. } => reason.clone(),
        other => other.to_string(),
    }
}
