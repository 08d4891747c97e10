//! Model files without the training state: `save_model` (one `model.safetensors`) and
//! `save_model_sharded` (Hugging Face's sharded layout with its index), with `config.json`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::train::params::Parameters;

use super::io::{sync_dir, sync_file, write_safetensors};
use super::load::agree;
use super::{io_err, named_tensors, with_suffix, write_err, CONFIG_FILE, MODEL_FILE};

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

/// See [`Accelerator::save_model`](crate::Accelerator::save_model).
pub(crate) fn save_model(c: &dyn Collective, path: &Path, model: &dyn Parameters) -> Result<()> {
    let result = if c.rank() == 0 {
        let tmp = with_suffix(path, &format!(".tmp-{}", std::process::id()));
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        folder
            .map_or(Ok(()), |f| {
                fs::create_dir_all(f)
                    .map_err(|e| write_err(f, "could not create the folder", Some(e)))
            })
            .and_then(|()| named_tensors(model))
            .and_then(|t| write_safetensors(&tmp, &t))
            .and_then(|()| {
                fs::rename(&tmp, path).map_err(|e| io_err("renaming the model into", path, e))
            })
    } else {
        Ok(())
    };
    agree(c, "save_model", path, result).map_err(model_write_err)
}

/// The index Hugging Face tooling reads next to sharded safetensors files.
pub const SHARD_INDEX_FILE: &str = "model.safetensors.index.json";

/// Groups `tensors` (in name order) into shards of at most `max_bytes` each (a tensor larger
/// than that gets a shard of its own).
pub(super) fn plan_shards(
    tensors: &[(String, Tensor)],
    max_bytes: usize,
) -> Vec<Vec<(String, Tensor)>> {
    let mut shards: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut size = 0usize;
    for (name, t) in tensors {
        let bytes = t.elem_count() * t.dtype().size_in_bytes();
        if shards.is_empty() || (size + bytes > max_bytes && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        if let Some(last) = shards.last_mut() {
            last.push((name.clone(), t.clone()));
        }
        size += bytes;
    }
    shards
}

/// Writes the model into `dir` as Hugging Face does: `model.safetensors` when it fits in one
/// shard of `max_shard_bytes`, else `model-0000i-of-0000n.safetensors` files and
/// `model.safetensors.index.json` (`metadata.total_size`, `weight_map`). Main process only;
/// written into `<dir>.tmp-<pid>` and renamed into place.
pub(super) fn write_sharded(
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    if max_shard_bytes == 0 {
        return Err(Error::invalid("max_shard_size", "must be at least 1 byte"));
    }
    let tensors = named_tensors(model)?;
    let shards = plan_shards(&tensors, max_shard_bytes);
    let tmp = with_suffix(dir, &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| write_err(&tmp, "could not create it", Some(e)))?;
    let n = shards.len();
    if n <= 1 {
        write_safetensors(&tmp.join(MODEL_FILE), &tensors)?;
    } else {
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            write_safetensors(&tmp.join(&name), shard)?;
            for (t, _) in shard {
                weight_map.insert(t.clone(), name.clone());
            }
        }
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        let index = serde_json::json!({
            "metadata": { "total_size": total },
            "weight_map": weight_map,
        });
        let path = tmp.join(SHARD_INDEX_FILE);
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| write_err(&path, format!("could not serialize the index: {e}"), None))?;
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    if let Some(config) = config {
        let path = tmp.join(CONFIG_FILE);
        let text = serde_json::to_string_pretty(config)
            .map_err(|e| write_err(&path, format!("could not serialize the config: {e}"), None))?;
        fs::write(&path, text).map_err(|e| write_err(&path, "could not write it", Some(e)))?;
        sync_file(&path)?;
    }
    replace_dir(&tmp, dir)
}

/// Puts the finished folder `tmp` in place of `dir` (a previous `dir` is moved aside to
/// `<dir>.old` first and removed after).
pub(super) fn replace_dir(tmp: &Path, dir: &Path) -> Result<()> {
    sync_dir(tmp);
    let old = with_suffix(dir, ".old");
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io_err("removing stale", &old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| io_err("renaming the previous model", dir, e))?;
    }
    fs::rename(tmp, dir).map_err(|e| io_err("renaming the new model into", dir, e))?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| io_err("removing the previous model", &old, e))?;
    }
    Ok(())
}

/// See [`Accelerator::save_model_sharded`](crate::Accelerator::save_model_sharded).
pub(crate) fn save_model_sharded(
    c: &dyn Collective,
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    let result = if c.rank() == 0 {
        write_sharded(dir, model, max_shard_bytes, config)
    } else {
        Ok(())
    };
    agree(c, "save_model_sharded", dir, result).map_err(model_write_err)
}

/// What the main process does in
/// [`save_model_sharded`](crate::Accelerator::save_model_sharded), with no communication (call
/// it on one process only): writes `model`'s parameters into the folder `dir` as Hugging Face
/// does (`model.safetensors`, or shards of at most `max_shard_bytes` and their index), and
/// `config` as `config.json` if given, into `<dir>.tmp-<pid>` renamed into place (replacing a
/// previous `dir`). The folders above `dir` are created.
pub fn write_model_folder(
    dir: impl AsRef<Path>,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    write_sharded(dir.as_ref(), model, max_shard_bytes, config).map_err(model_write_err)
}
