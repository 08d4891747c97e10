//! Durable writes: safetensors files synced to disk, the atomic directory swap of a save, the
//! folder lock that keeps two runs out of one checkpoint folder, and the test-only crash hook.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

use crate::files::{io_err, write_err};

/// Test-only hook ([`env::TEST_CRASH_AFTER`](crate::env::TEST_CRASH_AFTER)`=<file>`): the main process exits (code 3)
/// right after writing that file of a checkpoint, as a kill would.
pub(super) fn crash_hook(file: &str) {
    if crate::settings::runtime::crash_after(file) {
        let var = crate::settings::env::TEST_CRASH_AFTER;
        log::error!("{var}={file}: exiting mid-save");
        std::process::exit(3);
    }
}

/// Loads a safetensors file of a checkpoint onto `device`.
pub(super) fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    if !path.is_file() {
        return Err(checkpoint_err(path, "the file is missing"));
    }
    candle_core::safetensors::load(path, device)
        .map_err(|e| checkpoint_err(path, format!("could not read: {e}")))
}

/// The lock file of a checkpoint folder.
pub const LOCK_FILE: &str = ".accelerate-rs.lock";

/// Checkpoint folders this process has locked, with their open lock files: a lock lasts as long
/// as its file is open, i.e. until this process ends (so a crashed run never blocks the next).
pub(super) static LOCKS: std::sync::Mutex<Vec<(PathBuf, fs::File)>> =
    std::sync::Mutex::new(Vec::new());

/// This machine's host name, for lock files.
pub(super) fn host_name() -> String {
    crate::settings::runtime::host_name().unwrap_or_else(|| "an unknown host".into())
}

/// Takes (once per process) the exclusive lock of checkpoint folder `folder`: two runs saving
/// into one folder would overwrite and rotate away each other's checkpoints. Fails with
/// [`Error::CheckpointLocked`], naming the holder, when another live process holds it.
pub(super) fn lock_folder(folder: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    fs::create_dir_all(folder).map_err(|e| io_err("creating", folder, e))?;
    let key = folder
        .canonicalize()
        .unwrap_or_else(|_| folder.to_path_buf());
    let mut locks = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    if locks.iter().any(|(p, _)| *p == key) {
        return Ok(());
    }
    let path = folder.join(LOCK_FILE);
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| io_err("opening the lock file", &path, e))?;
    // SAFETY: `flock` on the descriptor of `f`, which stays open for the whole call; it only
    // changes the lock state of the open file, no memory is involved.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let holder = fs::read_to_string(&path)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "a process that wrote no details".into());
            return Err(Error::CheckpointLocked {
                path: folder.to_path_buf(),
                holder,
            });
        }
        return Err(io_err("locking", &path, err));
    }
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let who = format!(
        "pid {} on {}, since {since} (Unix time)",
        std::process::id(),
        host_name()
    );
    f.set_len(0)
        .and_then(|()| f.write_all(who.as_bytes()))
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err("writing the lock file", &path, e))?;
    locks.push((key, f));
    Ok(())
}

/// [`Error::CheckpointCorrupt`] naming `path`.
pub(super) fn corrupt(path: &Path, reason: impl Into<String>) -> Error {
    Error::CheckpointCorrupt {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A checkpoint that cannot be used, naming `path`.
pub(super) fn checkpoint_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::invalid(format!("checkpoint {}", path.display()), reason)
}

/// Before a save replaces or removes `path`, which must then be its own: `Ok` when `path` is
/// absent, or a folder whose entry names `ours` accepts. Anything else (a file, a symbolic link,
/// a folder `ours` refuses) is [`Error::CheckpointWrite`] naming it, saying `not_ours` and up to
/// three of the names it holds, then `advice`; nothing is touched.
pub(super) fn check_ours(
    path: &Path,
    ours: impl Fn(&[String]) -> bool,
    not_ours: &str,
    advice: &str,
) -> Result<()> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(());
    };
    let what = if meta.file_type().is_symlink() {
        "it is a symbolic link (which would be replaced, not written through)".to_string()
    } else if !meta.is_dir() {
        "it exists and is not a folder".to_string()
    } else {
        let mut names = Vec::new();
        for entry in fs::read_dir(path).map_err(|e| io_err("listing", path, e))? {
            let entry = entry.map_err(|e| io_err("listing", path, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        if ours(&names) {
            return Ok(());
        }
        names.sort();
        let shown: Vec<_> = names.iter().take(3).map(|n| format!("`{n}`")).collect();
        let more = match names.len().saturating_sub(3) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        format!("{not_ours} and holds {}{more}", shown.join(", "))
    };
    Err(write_err(path, format!("{what}; {advice}"), None))
}
