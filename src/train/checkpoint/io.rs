//! Durable writes: safetensors files synced to disk, the atomic directory swap of a save, the
//! folder lock that keeps two runs out of one checkpoint folder, and the test-only crash hook.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};

use super::{checkpoint_err, io_err, write_err};

pub(super) fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
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

pub(super) fn sync_file(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io_err("syncing", path, e))
}

pub(super) fn sync_dir(path: &Path) {
    // Best effort: not every platform can fsync a directory.
    if let Ok(f) = fs::File::open(path) {
        let _ = f.sync_all();
    }
}

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
