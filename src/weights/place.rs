//! Putting a finished model or adapter folder in place, whole: the new files are written into a
//! sibling `<dir>.tmp-<pid>`, completed with the files of the existing `dir` that the save does
//! not replace (hard links, or copies where the file system has none), and then swapped with
//! `dir` in one step (`renameat2(RENAME_EXCHANGE)` on Linux), so that `dir` is at every moment
//! either the complete old folder or the complete new one, never a mix; the old folder is then
//! removed. And checking an output folder before a run trains into it.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

use crate::files::{io_err, sync_dir, with_suffix, write_err};

/// An error unless `dir` is absent or a folder (links followed): a model is saved as a folder,
/// written into an existing one, never in place of a file; a link that leads nowhere is refused.
pub(super) fn check_folder_target(dir: &Path) -> Result<()> {
    match fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(write_err(
            dir,
            "it exists and is not a folder (a model is saved as a folder): \
             move it or choose another path",
            None,
        )),
        Ok(_) => Ok(()),
        Err(_) if fs::symlink_metadata(dir).is_ok() => Err(write_err(
            dir,
            "it is a symbolic link that leads nowhere: remove it or choose another path",
            None,
        )),
        Err(_) => Ok(()),
    }
}

/// The folder a save of `dir` really replaces: `dir`, or the folder a link `dir` leads to (the
/// link stays and leads to the new folder).
fn resolved(dir: &Path) -> PathBuf {
    match fs::symlink_metadata(dir) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(dir).unwrap_or(dir.to_path_buf()),
        _ => dir.to_path_buf(),
    }
}

/// A new, empty `<dir>.tmp-<pid>` beside the folder `dir` leads to (a stale one of this process
/// id removed first).
pub(super) fn fresh_tmp(dir: &Path) -> Result<PathBuf> {
    let tmp = with_suffix(&resolved(dir), &format!(".tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err("removing stale", &tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| write_err(&tmp, "could not create it", Some(e)))?;
    Ok(tmp)
}

/// Puts the finished folder `tmp` in place of `dir` as one step (see [the module](self)),
/// keeping whatever else `dir` holds (a tokenizer, a README, the user's own files and folders),
/// as `transformers`' `save_pretrained` does, except the files of an earlier save that `stale`
/// names and this save did not write (the shards of a differently sharded save). `dir` absent:
/// `tmp` is renamed to it. On an error the new files stay in `tmp`, and the error says so.
pub(super) fn place_files(tmp: &Path, dir: &Path, stale: fn(&str) -> bool) -> Result<()> {
    let target = resolved(dir);
    let placed = place(tmp, &target, stale);
    placed.map_err(|e| {
        if tmp.exists() {
            write_err(
                dir,
                format!(
                    "{e}; the new files are complete in {} (nothing of {} was changed)",
                    tmp.display(),
                    dir.display()
                ),
                None,
            )
        } else {
            e
        }
    })
}

fn place(tmp: &Path, dir: &Path, stale: fn(&str) -> bool) -> Result<()> {
    sync_dir(tmp);
    if fs::symlink_metadata(dir).is_err() {
        fs::rename(tmp, dir).map_err(|e| io_err("renaming the new folder into", dir, e))?;
        sync_parent(dir);
        return Ok(());
    }
    // Complete the new folder with the old one's other entries.
    let ours = entry_names(tmp)?;
    let mut folders = Vec::new();
    for (name, kind) in entries(dir)? {
        if ours.contains(&name) || (kind == Kind::File && stale(&name)) {
            continue;
        }
        match kind {
            Kind::Folder => folders.push(name),
            _ => keep(&dir.join(&name), &tmp.join(&name), kind)?,
        }
    }
    sync_dir(tmp);
    exchange(tmp, dir)?;
    sync_parent(dir);
    // `tmp` now holds the old folder: its subfolders move into the new one, then it goes.
    for name in folders {
        let to = dir.join(&name);
        fs::rename(tmp.join(&name), &to)
            .map_err(|e| io_err("moving the earlier folder into", &to, e))?;
    }
    fs::remove_dir_all(tmp).map_err(|e| io_err("removing the replaced folder", tmp, e))
}

fn sync_parent(dir: &Path) {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Link,
    Folder,
}

/// The entries of `dir`: names and kinds (links not followed; anything else is skipped).
fn entries(dir: &Path) -> Result<Vec<(String, Kind)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| io_err("listing", dir, e))? {
        let entry = entry.map_err(|e| io_err("listing", dir, e))?;
        let Ok(t) = entry.file_type() else { continue };
        let kind = if t.is_symlink() {
            Kind::Link
        } else if t.is_dir() {
            Kind::Folder
        } else if t.is_file() {
            Kind::File
        } else {
            continue;
        };
        if let Some(name) = entry.file_name().to_str() {
            out.push((name.to_string(), kind));
        }
    }
    Ok(out)
}

fn entry_names(dir: &Path) -> Result<Vec<String>> {
    Ok(entries(dir)?.into_iter().map(|(n, _)| n).collect())
}

/// The old file `from` into the new folder as `to`: a hard link (no copy), else a copy; a link
/// as the same link.
fn keep(from: &Path, to: &Path, kind: Kind) -> Result<()> {
    if kind == Kind::Link {
        let target = fs::read_link(from).map_err(|e| io_err("reading the link", from, e))?;
        #[cfg(unix)]
        return std::os::unix::fs::symlink(&target, to)
            .map_err(|e| io_err("keeping the link", to, e));
        #[cfg(not(unix))]
        return fs::copy(from, to)
            .map(drop)
            .map_err(|e| io_err("keeping", to, e));
    }
    if fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    fs::copy(from, to)
        .map(drop)
        .map_err(|e| io_err("keeping a copy of the earlier", from, e))
}

/// Swaps the folders `a` and `b` in one step where the system can (Linux's `renameat2` with
/// `RENAME_EXCHANGE`); elsewhere, or where the file system refuses it, by two renames through a
/// third name (a crash between them leaves both folders, under `b`'s `.old-<pid>` name and
/// `a`'s).
fn exchange(a: &Path, b: &Path) -> Result<()> {
    #[cfg(all(target_os = "linux", any(target_env = "gnu", target_env = "musl")))]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).ok();
        if let (Some(ca), Some(cb)) = (c(a), c(b)) {
            // SAFETY: both paths are valid NUL-terminated strings that outlive the call;
            // AT_FDCWD makes them relative to the working directory, as `fs::rename` does.
            let rc = unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    ca.as_ptr(),
                    libc::AT_FDCWD,
                    cb.as_ptr(),
                    libc::RENAME_EXCHANGE,
                )
            };
            if rc == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            let unsupported = matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS));
            if !unsupported {
                return Err(io_err("swapping the new folder with", b, e));
            }
        }
    }
    let old = with_suffix(b, &format!(".old-{}", std::process::id()));
    fs::rename(b, &old).map_err(|e| io_err("moving aside the earlier folder", b, e))?;
    if let Err(e) = fs::rename(a, b) {
        let _ = fs::rename(&old, b);
        return Err(io_err("renaming the new folder into", b, e));
    }
    fs::rename(&old, a).map_err(|e| io_err("renaming the earlier folder to", a, e))
}

/// Checks, before a run trains, that the folder `dir` can receive what the run will save there:
/// not a file or a link that leads nowhere, not one of `inputs` (the folder a model was loaded
/// from: saving there would replace the base weights), its parent writable (the new folder is
/// written beside it and swapped in), itself writable when it exists, and, unless `overwrite`,
/// absent or empty: a folder that already holds files is refused (as `transformers`'
/// `overwrite_output_dir`), so that no file of the user's is replaced by a run that was given
/// the wrong path. Creates `dir`'s parent folders. An error is [`Error::OutputFolder`] naming
/// `dir` and the reason.
pub fn check_output_dir(dir: &Path, inputs: &[&Path], overwrite: bool) -> Result<()> {
    let refuse = |reason: String| Error::OutputFolder {
        path: dir.to_path_buf(),
        reason,
    };
    if dir.as_os_str().is_empty() {
        return Err(refuse("the path is empty".into()));
    }
    check_folder_target(dir).map_err(|e| refuse(short(e)))?;
    let canon = |p: &Path| fs::canonicalize(p).ok();
    if let Some(out) = canon(dir) {
        for input in inputs {
            if canon(input).as_ref() == Some(&out) {
                return Err(refuse(format!(
                    "it is the input folder {}: saving there would replace what the run reads; \
                     choose another folder",
                    input.display()
                )));
            }
        }
    }
    let target = resolved(dir);
    let parent = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(|e| {
        refuse(format!(
            "its parent folder {} cannot be created: {e}",
            parent.display()
        ))
    })?;
    probe_writable(parent).map_err(|e| {
        refuse(format!(
            "its parent folder {} is not writable ({e}): the new folder is written beside it",
            parent.display()
        ))
    })?;
    if target.is_dir() {
        probe_writable(&target).map_err(|e| refuse(format!("it is not writable ({e})")))?;
        let mut names = entry_names(&target).map_err(|e| refuse(short(e)))?;
        if !names.is_empty() && !overwrite {
            names.sort();
            let shown: Vec<&str> = names.iter().take(4).map(String::as_str).collect();
            return Err(refuse(format!(
                "it already holds {} entries ({}{}): a run writes into an empty or new folder \
                 unless told to overwrite (its config.json, weights and tokenizer files would be \
                 replaced)",
                names.len(),
                shown.join(", "),
                if names.len() > shown.len() {
                    ", ..."
                } else {
                    ""
                }
            )));
        }
    }
    Ok(())
}

fn short(e: Error) -> String {
    match e {
        Error::CheckpointWrite { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// Creates and removes a folder in `dir`: whether entries can be made there (a read-only or
/// immutable folder refuses).
fn probe_writable(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".accelerate-rs-probe-{}", std::process::id()));
    fs::create_dir(&probe)?;
    fs::remove_dir(&probe)
}
