//! What every writer of a model file shares: the names of a folder's weight files, the refusal
//! of non-finite weights, and write errors as [`Error::ModelFile`].

use std::path::Path;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::train::weights::SINGLE_FILE as MODEL_FILE;

/// A model file's write error as [`Error::ModelFile`] (the checkpoint writers' errors say
/// "checkpoint").
pub(super) fn model_write_err(e: Error) -> Error {
    match e {
        Error::CheckpointWrite {
            path,
            reason,
            source,
        } => Error::ModelFile {
            path,
            tensor: None,
            reason: format!("could not write it: {reason}"),
            source,
        },
        e => e,
    }
}

/// An error naming the first tensor of `tensors` that holds a NaN or an infinity: a model folder
/// is never written with non-finite weights (they would replace a sound save with a model that
/// only computes NaN). One reduction per tensor.
pub(super) fn check_finite(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    for (name, t) in tensors {
        if let Some(what) = crate::train::clip::non_finite(t)? {
            return Err(Error::ModelFile {
                path: path.to_path_buf(),
                tensor: Some(name.clone()),
                reason: format!(
                    "not saved: the parameter holds {what} (training diverged; nothing was \
                     written, an earlier save there is untouched)"
                ),
                source: None,
            });
        }
    }
    Ok(())
}

/// The index Hugging Face tooling reads next to sharded safetensors files.
pub const SHARD_INDEX_FILE: &str = "model.safetensors.index.json";

/// The weight files of a Hugging Face model folder: `model.safetensors`, the shard index and
/// `model-NNNNN-of-NNNNN.safetensors` shards.
pub(super) fn is_model_weights_file(name: &str) -> bool {
    let shard = || {
        let middle = name.strip_prefix("model-")?.strip_suffix(".safetensors")?;
        let (i, n) = middle.split_once("-of-")?;
        let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        Some(digits(i) && digits(n))
    };
    name == MODEL_FILE || name == SHARD_INDEX_FILE || shard() == Some(true)
}
