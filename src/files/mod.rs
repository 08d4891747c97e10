//! Reading the files a user, a colleague or the Hugging Face Hub hands a run: model folders
//! (`config.json`, safetensors weights and their index, `tokenizer.json`, adapter folders) and
//! training text. One rule for every reader of the workspace (the weight loader, the models
//! crate, `accelerate-rs estimate-memory`, the examples):
//!
//! - **Only regular files are read.** A path is followed through symbolic links wherever they
//!   lead (the Hugging Face cache keeps `snapshots/<revision>/config.json` as a link into
//!   `../../blobs/`), and what it names at the end must be a regular file: a folder, a FIFO, a
//!   socket or a device (`/dev/zero`) is an error naming the path and what it is, found before
//!   anything is read (a FIFO never blocks the reader). A link that leads nowhere is an error
//!   naming it.
//! - **Names inside a folder stay in the folder.** A file name that a folder's own files give
//!   (the `weight_map` of `model.safetensors.index.json`) must be a plain name, without `/` or
//!   `..`; the file it names may itself be a link (the rule above).
//! - **Every read is bounded.** JSON files ([`MAX_JSON_BYTES`]), tokenizers
//!   ([`MAX_TOKENIZER_BYTES`]), texts read whole ([`MAX_TEXT_BYTES`]) and safetensors headers
//!   ([`MAX_HEADER_BYTES`]) have a size bound; a larger file is an error naming it and the bound,
//!   never a read until memory runs out.
//! - **Safetensors headers are checked before any data is touched**
//!   ([`SafetensorsHeader::read`]): known dtypes, shapes whose byte size is computed without
//!   overflow and matches the tensor's byte range, ranges that tile the data section, no tensor
//!   named twice (a JSON object with a repeated key would otherwise keep only the last).
//! - **A value quoted in an error is an excerpt** ([`excerpt`]): a 1 MiB string where a number
//!   belongs shows its start and end, not a 1 MiB line in every rank's log; names at most
//!   [`EXCERPT_NAME_BYTES`], reasons [`EXCERPT_REASON_BYTES`].

mod durable;
mod regular;
mod safetensors;

pub use crate::error::{excerpt, EXCERPT_NAME_BYTES, EXCERPT_REASON_BYTES};
pub(crate) use durable::{
    io_err, sync_dir, sync_file, with_suffix, write_err, write_json, write_safetensors,
};
pub use regular::{
    check_regular, open_regular, read_bounded, read_json, read_to_string_bounded, MAX_JSON_BYTES,
    MAX_TEXT_BYTES, MAX_TOKENIZER_BYTES,
};
pub use safetensors::{dtype_size, HeaderTensor, SafetensorsHeader, MAX_HEADER_BYTES};
