//! Durable writes, shared by every writer of files (training-state checkpoints, model folders,
//! adapters): a safetensors or JSON file created with the permissions a new file gets, written
//! and synced; a folder synced; a path with a suffix (the temporary and old names of a swap); and
//! the errors that name the path.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use candle_core::Tensor;

use crate::error::{Error, Result};

/// [`Error::CheckpointWrite`] naming `path`.
pub(crate) fn write_err(
    path: &Path,
    reason: impl Into<String>,
    source: Option<std::io::Error>,
) -> Error {
    Error::CheckpointWrite {
        path: path.to_path_buf(),
        reason: reason.into(),
        source,
    }
}

/// [`Error::Io`] naming what was being done (`context`) to `path`.
pub(crate) fn io_err(context: impl Into<String>, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        context: context.into(),
        path: path.to_path_buf(),
        source,
    }
}

/// `path` with `suffix` appended to its last component.
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// `tensors` as the safetensors file `path`, with a new file's permissions, synced.
pub(crate) fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
    // Create it first, so that a refusal (missing folder, no space, no permission) comes with
    // its OS error, and so that it gets the permissions a new file gets here (the umask's):
    // the safetensors writer puts a file of its own in place, readable by its owner only.
    let created = fs::File::create(path)
        .map_err(|e| write_err(path, "could not create the file", Some(e)))?;
    let permissions = created.metadata().map(|m| m.permissions()).ok();
    drop(created);
    candle_core::safetensors::save(&map, path).map_err(|e| match e {
        candle_core::Error::Io(io) => write_err(path, "the file system refused it", Some(io)),
        e => write_err(path, e.to_string(), None),
    })?;
    if let Some(p) = permissions {
        fs::set_permissions(path, p).map_err(|e| io_err("setting the permissions of", path, e))?;
    }
    sync_file(path)
}

/// Syncs the file `path` to disk.
pub(crate) fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

/// Syncs the folder `path` (its entries) to disk, where the platform can.
pub(crate) fn sync_dir(path: &Path) {
    // Best effort: not every platform can fsync a directory.
    if let Ok(f) = fs::File::open(path) {
        let _ = f.sync_all();
    }
}

/// `value` as pretty JSON in the file `path`, synced.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| write_err(path, format!("could not serialize it: {e}"), None))?;
    fs::write(path, text).map_err(|e| write_err(path, "could not write it", Some(e)))?;
    sync_file(path)
}
