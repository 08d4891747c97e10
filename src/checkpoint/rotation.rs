//! The `checkpoint_<N>` folders of [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto):
//! numbering, finding the newest sound one to resume from, and rotation.

use std::fs;
use std::path::{Path, PathBuf};

use super::manifest::{is_complete, read_manifest, resolve_checkpoint, verify_checkpoint};
use super::names::AUTO_PREFIX;
use crate::error::{Error, Result};
use crate::files::{io_err, with_suffix};

/// The number `N` of a `checkpoint_<N>` directory name.
fn auto_number(name: &str) -> Option<u64> {
    name.strip_prefix(AUTO_PREFIX)?.parse().ok()
}

/// The `checkpoint_<N>` entries of `root` (complete or not), sorted by `N`.
pub(super) fn auto_entries(root: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let n = auto_number(name.to_str()?)?;
            Some((n, e.path()))
        })
        .collect();
    out.sort();
    out
}

/// The newest sound checkpoint written by
/// [`Accelerator::save_state_auto`](crate::Accelerator::save_state_auto) under `root`, to resume
/// from: the `checkpoint_<N>` with the largest `N` that is complete (its manifest exists, or its
/// `.old` copy is complete) and passes [`verify_checkpoint`].
///
/// - `Ok(None)`: `root` holds no complete checkpoint (or does not exist): start from scratch.
///   Partial directories (`*.tmp-<pid>` of a crashed save, `*.deleting-<pid>` of an interrupted
///   rotation) do not count.
/// - `Ok(Some(dir))`: the newest sound one. When newer ones were refused, a warning names each,
///   why, and how many steps the resume goes back.
/// - `Err(`[`Error::NoSoundCheckpoint`]`)`: there are checkpoints, but none is sound. A run
///   never starts over silently; the error lists every checkpoint and why it was refused. To
///   start fresh on purpose, move them out of `root` (or match the variant and carry on).
pub fn latest_checkpoint(root: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let root = root.as_ref();
    let mut refused: Vec<(PathBuf, String)> = Vec::new();
    for dir in complete_checkpoints(root).into_iter().rev() {
        match verify_checkpoint(&dir) {
            Ok(m) => {
                if !refused.is_empty() {
                    warn_fallback(&dir, m.step, &refused);
                }
                return Ok(Some(dir));
            }
            Err(e) => refused.push((dir, e.to_string())),
        }
    }
    if refused.is_empty() {
        Ok(None)
    } else {
        Err(Error::NoSoundCheckpoint {
            root: root.to_path_buf(),
            refused,
        })
    }
}

/// Warns that resuming from `dir` (at `step`) skips the newer, refused checkpoints, and by how
/// many steps that goes back (from the newest refused one's manifest, when it still parses).
fn warn_fallback(dir: &Path, step: u64, refused: &[(PathBuf, String)]) {
    let list = refused
        .iter()
        .map(|(p, why)| format!("{} ({why})", p.display()))
        .collect::<Vec<_>>()
        .join("; ");
    let back = match refused.first().map(|(p, _)| read_manifest(p)) {
        Some(Ok(newest)) if newest.step >= step => format!(
            "this goes back {} step(s), from step {} to step {step}",
            newest.step - step,
            newest.step
        ),
        _ => format!(
            "this goes back {} checkpoint(s) (the newest one's step is unreadable) to step {step}",
            refused.len()
        ),
    };
    crate::logging::warn_always(format_args!(
        "resuming from {}: {} newer checkpoint(s) refused: {list}; {back}",
        dir.display(),
        refused.len()
    ));
}

/// The complete `checkpoint_<N>` directories under `root`, oldest first (not verified).
fn complete_checkpoints(root: &Path) -> Vec<PathBuf> {
    let mut numbers: Vec<u64> = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let name = name.to_str()?;
            auto_number(name.strip_suffix(".old").unwrap_or(name))
        })
        .collect();
    numbers.sort_unstable();
    numbers.dedup();
    numbers
        .into_iter()
        .map(|n| root.join(format!("{AUTO_PREFIX}{n}")))
        .filter(|dir| resolve_checkpoint(dir).is_some())
        .collect()
}

/// The largest `N` of a complete checkpoint under `root` (sound or not: a new checkpoint never
/// takes the number of a damaged one).
pub(super) fn latest_number(root: &Path) -> Option<u64> {
    complete_checkpoints(root)
        .last()
        .and_then(|p| p.file_name().and_then(|n| n.to_str()).and_then(auto_number))
}

/// Keeps the newest `total_limit` complete `checkpoint_<N>` directories under `root` and removes
/// the rest, plus leftovers of crashed saves.
pub(super) fn rotate(root: &Path, total_limit: usize) -> Result<()> {
    let entries = fs::read_dir(root).map_err(|e| io_err("listing", root, e))?;
    let mut complete = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(AUTO_PREFIX) {
            continue;
        }
        if name.contains(".tmp-")
            || name.contains(DELETING)
            || (name.ends_with(".old") && {
                let base = path.with_file_name(name.trim_end_matches(".old"));
                is_complete(&base)
            })
        {
            remove_dir_safely(&path)?;
            continue;
        }
        if let Some(n) = auto_number(name) {
            if is_complete(&path) {
                complete.push((n, path));
            }
        }
    }
    if total_limit == 0 || complete.len() <= total_limit {
        return Ok(());
    }
    complete.sort();
    let excess = complete.len() - total_limit;
    for (_, path) in complete.into_iter().take(excess) {
        remove_dir_safely(&path)?;
    }
    Ok(())
}

/// The infix of a directory being deleted by rotation.
const DELETING: &str = ".deleting-";

/// Removes a checkpoint directory without ever leaving a half-deleted checkpoint under its
/// name: it is first renamed to `<name>.deleting-<pid>` (which no loader reads), then removed.
fn remove_dir_safely(path: &Path) -> Result<()> {
    let doomed = if path
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains(DELETING))
    {
        path.to_path_buf()
    } else {
        let doomed = with_suffix(path, &format!("{DELETING}{}", std::process::id()));
        fs::rename(path, &doomed).map_err(|e| io_err("renaming for removal", path, e))?;
        doomed
    };
    fs::remove_dir_all(&doomed).map_err(|e| io_err("removing", &doomed, e))
}
