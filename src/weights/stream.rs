//! ZeRO-3 model files: a sharded model saved as one safetensors file or a Hugging Face folder
//! by streaming it through rank 0 one unit at a time. Each file's header is computed from the
//! parameters' shapes before anything is gathered; then every rank all-gathers one unit at a
//! time and rank 0 appends its tensors' bytes to the file being written: no rank ever holds
//! more than one unit. A write error on rank 0 does not stop the gathers (the other ranks
//! would wait for it): the error is reported on every rank at the end, and nothing is put in
//! place.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

use crate::collective::Collective;
use crate::error::{Error, Result};
use crate::train::pieces::ShardedParameters;

use super::model_file::{check_finite, is_model_weights_file, model_write_err, SHARD_INDEX_FILE};
use super::place::{check_folder_target, fresh_tmp, place_files};
use crate::collective::agree_on_write;
use crate::files::{io_err, sync_file, with_suffix, write_err, write_json};
use crate::train::weights::{CONFIG_FILE, SINGLE_FILE as MODEL_FILE};

/// Where a streamed model goes.
pub(super) enum Target<'a> {
    /// One safetensors file.
    File(&'a Path),
    /// A Hugging Face folder: files of at most `max` bytes, and `config.json` if given.
    Folder {
        dir: &'a Path,
        max: usize,
        config: Option<&'a serde_json::Value>,
    },
}

/// One tensor of a file: name, dtype, shape, bytes.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: usize,
}

fn st_dtype(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        d => {
            return Err(Error::UnsupportedDType {
                op: "saving a sharded model".into(),
                dtype: format!("{d:?}"),
            })
        }
    })
}

/// The safetensors header of `entries`, in order, padded to 8 bytes as the format asks.
fn header(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut at = 0usize;
    for e in entries {
        map.insert(
            e.name.clone(),
            serde_json::json!({
                "dtype": st_dtype(e.dtype)?,
                "shape": e.shape,
                "data_offsets": [at, at + e.bytes],
            }),
        );
        at += e.bytes;
    }
    let mut text =
        serde_json::to_vec(&serde_json::Value::Object(map)).map_err(|e| Error::Internal {
            what: "a safetensors header".into(),
            reason: e.to_string(),
        })?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    Ok(out)
}

/// The raw little-endian bytes of `t` (on the host).
fn raw_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    Ok(match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>()?).to_vec(),
        d => {
            return Err(Error::UnsupportedDType {
                op: "saving a sharded model".into(),
                dtype: format!("{d:?}"),
            })
        }
    })
}

/// The tensors in unit order, cut into files of at most `max` bytes (a larger tensor gets a file
/// of its own); and for each unit, its tensors' file indices.
fn plan(model: &dyn ShardedParameters, max: usize) -> Vec<Vec<Entry>> {
    let mut files: Vec<Vec<Entry>> = vec![Vec::new()];
    let mut size = 0usize;
    for (_, dtype, members) in model.unit_specs() {
        for (name, shape) in members {
            let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
            if size > 0 && size.saturating_add(bytes) > max {
                files.push(Vec::new());
                size = 0;
            }
            size += bytes;
            if let Some(last) = files.last_mut() {
                last.push(Entry {
                    name,
                    dtype,
                    shape,
                    bytes,
                });
            }
        }
    }
    files
}

/// Rank 0's side: the files being written.
struct Writer {
    paths: Vec<PathBuf>,
    plan: Vec<Vec<Entry>>,
    /// The file being written and the next entry of it.
    open: Option<(usize, fs::File)>,
    next: (usize, usize),
    failed: Option<Error>,
}

impl Writer {
    /// Appends one tensor (the next of the plan); the first failure is kept, and later tensors
    /// are skipped.
    fn push(&mut self, name: &str, t: &Tensor) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.try_push(name, t) {
            self.failed = Some(e);
        }
    }

    fn try_push(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let (f, i) = self.next;
        let path = &self.paths[f];
        let entry = self
            .plan
            .get(f)
            .and_then(|p| p.get(i))
            .ok_or_else(|| Error::Internal {
                what: "streaming a sharded model".into(),
                reason: format!("`{name}` is beyond the planned files"),
            })?;
        if entry.name != name {
            return Err(Error::Internal {
                what: "streaming a sharded model".into(),
                reason: format!("`{name}` came where `{}` was planned", entry.name),
            });
        }
        check_finite(path, &[(name.to_string(), t.clone())])?;
        if self.open.as_ref().map(|(o, _)| *o) != Some(f) {
            let mut file = fs::File::create(path).map_err(|e| io_err("creating", path, e))?;
            file.write_all(&header(&self.plan[f])?)
                .map_err(|e| write_err(path, "could not write it", Some(e)))?;
            self.open = Some((f, file));
        }
        let bytes = raw_bytes(&t.to_dtype(entry.dtype)?)?;
        if let Some((_, file)) = self.open.as_mut() {
            file.write_all(&bytes)
                .map_err(|e| write_err(path, "could not write it", Some(e)))?;
        }
        self.next = if i + 1 < self.plan[f].len() {
            (f, i + 1)
        } else {
            self.open = None;
            sync_file(path)?;
            (f + 1, 0)
        };
        Ok(())
    }
}

/// Saves `model` to `target` (every rank calls it).
pub(super) fn save(
    c: &dyn Collective,
    model: &dyn ShardedParameters,
    target: Target<'_>,
) -> Result<()> {
    let (what, at) = match &target {
        Target::File(p) => ("save_model", p.to_path_buf()),
        Target::Folder { dir, .. } => ("save_model_sharded", dir.to_path_buf()),
    };
    let mut writer = if c.rank() == 0 {
        Some(start(model, &target))
    } else {
        None
    };
    let units = model.unit_specs().len();
    for u in 0..units {
        let tensors = model.gather_unit(u)?;
        if let Some(Ok(w)) = writer.as_mut() {
            for (name, t) in &tensors {
                w.push(name, t);
            }
        }
    }
    let result = match writer {
        Some(w) => finish(w, &target),
        None => Ok(()),
    };
    agree_on_write(c, what, &at, result).map_err(model_write_err)
}

/// Rank 0's preparation: the plan and the temporary place of the files.
fn start(model: &dyn ShardedParameters, target: &Target<'_>) -> Result<Writer> {
    let (plan, paths) = match target {
        Target::File(path) => {
            if path.is_dir() {
                return Err(write_err(
                    path,
                    "it is a folder, and save_model writes one safetensors file \
                     (save_model_sharded writes a Hugging Face folder)",
                    None,
                ));
            }
            if let Some(f) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(f)
                    .map_err(|e| write_err(f, "could not create the folder", Some(e)))?;
            }
            let tmp = with_suffix(path, &format!(".tmp-{}", std::process::id()));
            (plan(model, usize::MAX), vec![tmp])
        }
        Target::Folder { dir, max, .. } => {
            if *max == 0 {
                return Err(Error::invalid("max_shard_size", "must be at least 1 byte"));
            }
            check_folder_target(dir)?;
            let tmp = fresh_tmp(dir)?;
            let plan = plan(model, *max);
            let n = plan.len();
            let paths = if n == 1 {
                vec![tmp.join(MODEL_FILE)]
            } else {
                (1..=n)
                    .map(|i| tmp.join(format!("model-{i:05}-of-{n:05}.safetensors")))
                    .collect()
            };
            (plan, paths)
        }
    };
    Ok(Writer {
        paths,
        plan,
        open: None,
        next: (0, 0),
        failed: None,
    })
}

/// Rank 0's end: the index and config of a folder, then the files put in place (or removed
/// after a failure).
fn finish(writer: Result<Writer>, target: &Target<'_>) -> Result<()> {
    let mut w = writer?;
    let tmp_of = |w: &Writer| w.paths[0].parent().map(Path::to_path_buf);
    let written = match w.failed.take() {
        Some(e) => Err(e),
        None => match target {
            Target::File(path) => fs::rename(&w.paths[0], path)
                .map_err(|e| io_err("renaming the model into", path, e)),
            Target::Folder { dir, config, .. } => {
                index_and_config(&w, *config).and_then(|()| match tmp_of(&w) {
                    Some(tmp) => place_files(&tmp, dir, is_model_weights_file),
                    None => Ok(()),
                })
            }
        },
    };
    if written.is_err() {
        match target {
            Target::File(_) => {
                let _ = fs::remove_file(&w.paths[0]);
            }
            Target::Folder { .. } => {
                if let Some(tmp) = tmp_of(&w) {
                    let _ = fs::remove_dir_all(tmp);
                }
            }
        }
    }
    written
}

fn index_and_config(w: &Writer, config: Option<&serde_json::Value>) -> Result<()> {
    let tmp = w.paths[0].parent().unwrap_or(Path::new("."));
    if w.plan.len() > 1 {
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (path, entries) in w.paths.iter().zip(&w.plan) {
            let file = path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            for e in entries {
                weight_map.insert(e.name.clone(), file.clone());
                total += e.bytes;
            }
        }
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
