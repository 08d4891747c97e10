//! Regular files only, read within a bound (see [the module](super)).

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The most bytes a JSON file is read with (`config.json`, an index, `adapter_config.json`,
/// `tokenizer_config.json`): 64 MiB, far above any real one.
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// The most bytes a `tokenizer.json` is read with: 1 GiB (the largest real ones are tens of
/// MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 1 << 30;
/// The most bytes a text read whole into memory may have (a fine-tuning corpus): 4 GiB. Larger
/// corpora belong in a streaming loader (`accelerate_rs::StreamingLoader`).
pub const MAX_TEXT_BYTES: u64 = 4 << 30;

fn file_error(path: &Path, reason: impl Into<String>, source: Option<std::io::Error>) -> Error {
    Error::InputFile {
        path: path.to_path_buf(),
        reason: reason.into(),
        source,
    }
}

/// What a non-regular file is, for errors.
fn kind_of(meta: &Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    }
}

/// Checks the metadata of an opened or stated `path`: a regular file, else an error saying what
/// it is.
fn ensure_regular(path: &Path, meta: &Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    Err(file_error(
        path,
        format!(
            "it is {}: only regular files are read (links are followed to one)",
            kind_of(meta)
        ),
        None,
    ))
}

/// The error for a path that could not be opened or stated: a dangling link is said as such.
fn open_error(path: &Path, e: std::io::Error) -> Error {
    let dangling = e.kind() == std::io::ErrorKind::NotFound
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let reason = if dangling {
        match std::fs::read_link(path) {
            Ok(to) => format!(
                "it is a symbolic link to {}, which does not exist",
                to.display()
            ),
            Err(_) => "it is a symbolic link that leads nowhere".to_string(),
        }
    } else {
        "could not open it".to_string()
    };
    file_error(path, reason, Some(e))
}

/// The metadata of `path` (links followed) when it names a regular file; else an error naming it
/// and saying what it is (a folder, a FIFO, a device, a dangling link, nothing).
pub fn check_regular(path: &Path) -> Result<Metadata> {
    let meta = std::fs::metadata(path).map_err(|e| open_error(path, e))?;
    ensure_regular(path, &meta)?;
    Ok(meta)
}

/// Opens `path` for reading when it names a regular file (links followed), with its metadata.
/// A FIFO is refused without blocking: the file is opened non-blocking and checked on the open
/// descriptor, so nothing swapped in between a check and the open is read either.
pub fn open_regular(path: &Path) -> Result<(File, Metadata)> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Opening a FIFO for reading blocks until a writer comes, unless non-blocking; a regular
        // file ignores the flag.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| open_error(path, e))?;
    let meta = file
        .metadata()
        .map_err(|e| file_error(path, "could not read its metadata", Some(e)))?;
    ensure_regular(path, &meta)?;
    Ok((file, meta))
}

/// The bytes of the regular file `path`, at most `max` of them: a longer file is an error naming
/// it, its size and the bound (nothing beyond the bound is read).
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let (file, meta) = open_regular(path)?;
    let too_big = |n: u64| {
        file_error(
            path,
            format!(
                "it holds {n} bytes or more, over the {max} bytes this reader accepts: not the \
                 file expected here, or one to split"
            ),
            None,
        )
    };
    if meta.len() > max {
        return Err(too_big(meta.len()));
    }
    let mut bytes = Vec::new();
    // A file that grows while it is read (or a /proc file whose size says 0) is still bounded.
    let read = file
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| file_error(path, "could not read it", Some(e)))?;
    if read as u64 > max {
        return Err(too_big(read as u64));
    }
    Ok(bytes)
}

/// [`read_bounded`] as UTF-8 text; invalid UTF-8 is an error naming the file and the byte.
pub fn read_to_string_bounded(path: &Path, max: u64) -> Result<String> {
    let bytes = read_bounded(path, max)?;
    String::from_utf8(bytes).map_err(|e| {
        file_error(
            path,
            format!(
                "it is not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
            None,
        )
    })
}

/// A JSON file of at most [`MAX_JSON_BYTES`], parsed; invalid JSON is an error naming the file,
/// line and column.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let bytes = read_bounded(path, MAX_JSON_BYTES)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| file_error(path, format!("it is not valid JSON: {e}"), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.json");
        std::fs::write(&file, "{\"a\": 1}").unwrap();
        assert_eq!(read_json(&file).unwrap()["a"], 1);
        let err = read_bounded(dir.path(), 10).unwrap_err().to_string();
        assert!(err.contains("a folder"), "{err}");
        let err = read_bounded(Path::new("/dev/zero"), 10)
            .unwrap_err()
            .to_string();
        assert!(err.contains("character device"), "{err}");
        #[cfg(unix)]
        {
            let link = dir.path().join("dangling");
            std::os::unix::fs::symlink(dir.path().join("nothing"), &link).unwrap();
            let err = read_bounded(&link, 10).unwrap_err().to_string();
            assert!(err.contains("symbolic link"), "{err}");
            let fifo = dir.path().join("fifo");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let err = read_bounded(&fifo, 10).unwrap_err().to_string();
            assert!(err.contains("FIFO"), "{err}");
            // A link to a regular file is followed.
            let good = dir.path().join("good");
            std::os::unix::fs::symlink(&file, &good).unwrap();
            assert!(read_json(&good).is_ok());
        }
    }

    #[test]
    fn reads_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big");
        std::fs::write(&file, vec![b'x'; 100]).unwrap();
        assert_eq!(read_bounded(&file, 100).unwrap().len(), 100);
        let err = read_bounded(&file, 99).unwrap_err().to_string();
        assert!(err.contains("over the 99 bytes"), "{err}");
        std::fs::write(&file, [0xff, 0xfe]).unwrap();
        let err = read_to_string_bounded(&file, 10).unwrap_err().to_string();
        assert!(err.contains("not UTF-8"), "{err}");
        std::fs::write(&file, "{").unwrap();
        let err = read_json(&file).unwrap_err().to_string();
        assert!(err.contains("not valid JSON"), "{err}");
    }
}
