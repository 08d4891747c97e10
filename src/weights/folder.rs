//! Model files without the training state: `save_model` (one `model.safetensors`) and
//! `save_model_sharded` (Hugging Face's sharded layout with its index), with `config.json`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use candle_core::Tensor;

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::files::{io_err, with_suffix, write_err, write_json, write_safetensors};
use crate::train::params::{named_tensors, Parameters};
use crate::train::weights::{CONFIG_FILE, SINGLE_FILE as MODEL_FILE};

use super::model_file::{check_finite, is_model_weights_file, model_write_err, SHARD_INDEX_FILE};
use super::place::{check_folder_target, fresh_tmp, place_files};
use crate::collective::agree_on_write;

/// See [`Accelerator::save_model`](crate::Accelerator::save_model).
pub(crate) fn save_model(c: &dyn Collective, path: &Path, model: &dyn Parameters) -> Result<()> {
    if let Some(sharded) = model.sharded_parameters() {
        return super::stream::save(c, sharded, super::stream::Target::File(path));
    }
    let result = if c.rank() == 0 {
        let tmp = with_suffix(path, &format!(".tmp-{}", std::process::id()));
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        let written = if path.is_dir() {
            Err(write_err(
                path,
                "it is a folder, and save_model writes one safetensors file \
                 (save_model_sharded writes a Hugging Face folder)",
                None,
            ))
        } else {
            folder
                .map_or(Ok(()), |f| {
                    fs::create_dir_all(f)
                        .map_err(|e| write_err(f, "could not create the folder", Some(e)))
                })
                .and_then(|()| named_tensors(model))
                .and_then(|t| check_finite(path, &t).map(|()| t))
                .and_then(|t| write_safetensors(&tmp, &t))
                .and_then(|()| {
                    fs::rename(&tmp, path).map_err(|e| io_err("renaming the model into", path, e))
                })
        };
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    } else {
        Ok(())
    };
    agree_on_write(c, "save_model", path, result).map_err(model_write_err)
}

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
/// written into `<dir>.tmp-<pid>`, then put in place by [`place_files`] (the other files of an
/// existing `dir` stay).
pub(super) fn write_sharded(
    dir: &Path,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    if max_shard_bytes == 0 {
        return Err(Error::invalid("max_shard_size", "must be at least 1 byte"));
    }
    check_folder_target(dir)?;
    let tensors = named_tensors(model)?;
    check_finite(dir, &tensors)?;
    let shards = plan_shards(&tensors, max_shard_bytes);
    let tmp = fresh_tmp(dir)?;
    if let Err(e) = write_shards(&tmp, &tensors, &shards, config) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    place_files(&tmp, dir, is_model_weights_file)
}

/// The files of [`write_sharded`] into the folder `tmp`.
fn write_shards(
    tmp: &Path,
    tensors: &[(String, Tensor)],
    shards: &[Vec<(String, Tensor)>],
    config: Option<&serde_json::Value>,
) -> Result<()> {
    let n = shards.len();
    if n <= 1 {
        write_safetensors(&tmp.join(MODEL_FILE), tensors)?;
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
        write_json(&tmp.join(SHARD_INDEX_FILE), &index)?;
    }
    if let Some(config) = config {
        write_json(&tmp.join(CONFIG_FILE), config)?;
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
    if let Some(sharded) = model.sharded_parameters() {
        let target = super::stream::Target::Folder {
            dir,
            max: max_shard_bytes,
            config,
        };
        return super::stream::save(c, sharded, target);
    }
    let result = if c.rank() == 0 {
        write_sharded(dir, model, max_shard_bytes, config)
    } else {
        Ok(())
    };
    agree_on_write(c, "save_model_sharded", dir, result).map_err(model_write_err)
}

/// What the main process does in
/// [`save_model_sharded`](crate::Accelerator::save_model_sharded), with no communication (call
/// it on one process only): writes `model`'s parameters into the folder `dir` as Hugging Face
/// does (`model.safetensors`, or shards of at most `max_shard_bytes` and their index), and
/// `config` as `config.json` if given, into `<dir>.tmp-<pid>`, then moved into `dir`: the
/// weight files of an earlier save there are replaced, every other file stays. The folders
/// above `dir` are created; `dir` being a file is an error.
pub fn write_model_folder(
    dir: impl AsRef<Path>,
    model: &dyn Parameters,
    max_shard_bytes: usize,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    write_sharded(dir.as_ref(), model, max_shard_bytes, config).map_err(model_write_err)
}
