//! Setting up the same-host data path of [`TcpCollective`](super::TcpCollective) (`shm.rs`):
//! the ranks agree on the transport, rank 0 creates the shared-memory segment (a file with no
//! name) and offers it through `/proc/<pid>/fd`, the others open and check it, and they compare
//! notes.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

use super::ring::Ring;
use super::shm::{segment_len, slot_cap, Shm, MAGIC, OFF_CAP, OFF_MAGIC, OFF_TOKEN, OFF_WORLD};
use crate::collective::Buffer;
use crate::error::{Error, Result};
use crate::settings::{env, Transport};

/// This host's identity: hostname and boot id (empty boot id when unknown).
fn host_identity() -> (String, String) {
    let mut name = [0u8; 256];
    // SAFETY: `name` is valid for writes of `name.len()` bytes, the most gethostname writes.
    let rc = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) };
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let host = match rc {
        0 => String::from_utf8(name[..end].to_vec()).unwrap_or_default(),
        _ => String::new(),
    };
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    (host, boot)
}

fn gather_strings(ring: &mut Ring, mine: &str) -> Result<Vec<String>> {
    Ok(ring
        .all_gather(Buffer::from(mine.as_bytes()))?
        .iter()
        .map(|b| String::from_utf8_lossy(b.bytes()).into_owned())
        .collect())
}

/// Decides the transport with the other ranks and, for shared memory, sets up the segment.
/// `Ok(None)`: use TCP.
pub(crate) fn setup(ring: &mut Ring, mode: Transport) -> Result<Option<Shm>> {
    let Some(required) = choose(ring, mode)? else {
        return Ok(None);
    };
    let rank = ring.rank;
    let mapped = map_segment(ring)?;
    // Everyone has mapped it (or failed to) once this returns: rank 0 closes its file.
    let statuses = gather_strings(ring, &mapped.status)?;
    drop(mapped.file0);
    let failures: Vec<String> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| s.as_str() != "ok")
        .map(|(r, s)| format!("rank {r}: {}", s.trim_start_matches("err: ")))
        .collect();
    if failures.is_empty() {
        return Ok(mapped.shm);
    }
    let reason = format!(
        "cannot set up the shared-memory transport ({})",
        failures.join("; ")
    );
    if required {
        return Err(Error::Rendezvous {
            rank,
            addr: mapped.path,
            reason,
            source: None,
        });
    }
    if rank == 0 {
        log::warn!("{reason}; using TCP");
    }
    Ok(None)
}

/// Every rank's wish (`mode`) and host, gathered and judged: `None` for TCP (someone asked for
/// it, or the ranks are on several hosts under `auto`), `Some(required)` for shared memory
/// (`required`: someone asked for `shm`, so failing to set it up is an error).
fn choose(ring: &mut Ring, mode: Transport) -> Result<Option<bool>> {
    let world = ring.world;
    let (host, boot) = host_identity();
    let infos = gather_strings(ring, &format!("{}\n{host}\n{boot}", mode.name()))?;
    let (modes, idents) = parse_records(ring.rank, &infos)?;
    let list = |f: &dyn Fn(usize) -> String| {
        (0..world)
            .map(|r| format!("rank {r}: {}", f(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let wants_tcp = modes.contains(&Transport::Tcp);
    let required = modes.contains(&Transport::Shm);
    if wants_tcp && required {
        return Err(Error::Env {
            var: env::TRANSPORT.into(),
            value: mode.name().into(),
            reason: format!(
                "ranks disagree on the transport ({}); set the same value everywhere",
                list(&|r| modes[r].name().to_string())
            ),
        });
    }
    if wants_tcp {
        return Ok(None);
    }
    let same_host = !idents[0].1.is_empty() && idents.iter().all(|i| *i == idents[0]);
    if same_host {
        return Ok(Some(required));
    }
    if required {
        return Err(Error::Env {
            var: env::TRANSPORT.into(),
            value: "shm".into(),
            reason: format!(
                "shared memory needs every rank on one host, but they are on several ({}); use `auto` or `tcp`",
                list(&|r| {
                    let (h, b) = &idents[r];
                    if b.is_empty() {
                        format!("{h} (boot id unknown)")
                    } else {
                        format!("{h} (boot {})", b.get(..8).unwrap_or(b))
                    }
                })
            ),
        });
    }
    Ok(None)
}

/// Every rank's `transport\nhostname\nboot id` record, split: the transports and the
/// (hostname, boot id) pairs, in rank order.
#[allow(clippy::type_complexity)]
fn parse_records(rank: usize, infos: &[String]) -> Result<(Vec<Transport>, Vec<(String, String)>)> {
    let mut modes = Vec::with_capacity(infos.len());
    let mut idents = Vec::with_capacity(infos.len());
    for (r, info) in infos.iter().enumerate() {
        let mut parts = info.splitn(3, '\n');
        let m = parts
            .next()
            .and_then(Transport::parse)
            .ok_or_else(|| Error::Peer {
                rank,
                peer: r,
                op: "connect".into(),
                reason: format!("sent an invalid transport record {info:?}"),
                source: None,
            })?;
        modes.push(m);
        idents.push((
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        ));
    }
    Ok((modes, idents))
}

/// One rank's attempt at the segment, before the ranks compare notes.
struct Mapped {
    /// This rank's mapping, if it got one.
    shm: Option<Shm>,
    /// `ok`, or `err: why`.
    status: String,
    /// Where rank 0's segment is (`/proc/<pid>/fd/<fd>`), for errors.
    path: String,
    /// Rank 0's file, kept open until every rank has opened its own.
    file0: Option<File>,
}

/// Rank 0 creates the segment and offers its name, size and token; the others open it.
fn map_segment(ring: &mut Ring) -> Result<Mapped> {
    let (rank, world) = (ring.rank, ring.world);
    let cap = slot_cap(world);
    let len = segment_len(world, cap);
    let mut file0: Option<File> = None;
    let mut created: Option<Shm> = None;
    let mut offer = String::new();
    if rank == 0 {
        match create_segment(world, cap, len) {
            Ok((file, map, token)) => {
                offer = format!(
                    "ok\n{token}\n/proc/{}/fd/{}",
                    std::process::id(),
                    file.as_raw_fd()
                );
                file0 = Some(file);
                created = Some(Shm::new(map, rank, world, cap));
            }
            Err(reason) => offer = format!("err\n{reason}"),
        }
    }
    let offers = gather_strings(ring, &offer)?;
    let offer0 = offers.first().map(String::as_str).unwrap_or("");
    let mut status = "ok".to_string();
    let mut shm = None;
    let mut path = String::new();
    match offer0.split_once('\n') {
        Some(("ok", rest)) => {
            let (token, at) = rest.split_once('\n').unwrap_or(("", ""));
            path = at.to_string();
            if rank == 0 {
                shm = created.take();
            } else {
                match open_segment(Path::new(at), token, world, cap, len) {
                    Ok(map) => shm = Some(Shm::new(map, rank, world, cap)),
                    Err(reason) => status = format!("err: {reason}"),
                }
            }
        }
        Some(("err", reason)) => status = format!("err: rank 0: {reason}"),
        _ => status = format!("err: rank 0 sent an invalid offer {offer0:?}"),
    }
    Ok(Mapped {
        shm,
        status,
        path,
        file0,
    })
}

/// Creates, sizes, reserves and maps a new segment that has no name in the file system; returns
/// its file (to share through `/proc/<pid>/fd`), the mapping and the token.
fn create_segment(
    world: usize,
    cap: usize,
    len: usize,
) -> std::result::Result<(File, MmapRaw, u64), String> {
    let token: u64 = rand::random::<u64>() | 1;
    let file = anonymous_file()?;
    let map = size_and_map(&file, len)
        .map_err(|e| format!("cannot size or map a {len}-byte shared-memory segment: {e}"))?;
    // SAFETY: the mapping is `len` bytes long and page aligned; the header words are 8-aligned
    // and within the first page; no other process can reach the file yet.
    unsafe {
        let base = map.as_mut_ptr();
        for (off, v) in [
            (OFF_TOKEN, token),
            (OFF_WORLD, world as u64),
            (OFF_CAP, cap as u64),
            (OFF_MAGIC, MAGIC),
        ] {
            (*(base.add(off) as *const AtomicU64)).store(v, Ordering::Release);
        }
    }
    Ok((file, map, token))
}

/// A new, empty shared-memory file without a name: a memfd, else a file created under
/// `/dev/shm` (or the temp dir) and unlinked at once.
fn anonymous_file() -> std::result::Result<File, String> {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a valid NUL-terminated string and the flags are valid memfd flags;
    // memfd_create only reads them.
    let fd = unsafe { libc::memfd_create(c"accelerate-rs-shm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        return Ok(unsafe { File::from_raw_fd(fd) });
    }
    let memfd_err = std::io::Error::last_os_error();
    let name = format!(
        "accelerate-rs-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    );
    let mut last_err = format!("memfd_create failed: {memfd_err}");
    for dir in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        if !dir.is_dir() {
            continue;
        }
        let path = dir.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path);
        match file {
            Ok(f) => {
                // Named for the moment between these two calls only.
                if let Err(e) = std::fs::remove_file(&path) {
                    last_err = format!("cannot unlink {}: {e}", path.display());
                    continue;
                }
                return Ok(f);
            }
            Err(e) => last_err = format!("{last_err}; cannot create {}: {e}", path.display()),
        }
    }
    Err(last_err)
}

fn size_and_map(file: &File, len: usize) -> std::io::Result<MmapRaw> {
    file.set_len(len as u64)?;
    // Reserve the pages now: on a full tmpfs, touching an unreserved page would be a SIGBUS.
    // SAFETY: `file` is an open descriptor for the whole call; posix_fallocate touches no memory
    // of ours.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
    match rc {
        0 | libc::EOPNOTSUPP | libc::EINVAL => {}
        e => return Err(std::io::Error::from_raw_os_error(e)),
    }
    MmapRaw::map_raw(file)
}

/// Opens and maps rank 0's segment and checks that it is the one rank 0 created.
fn open_segment(
    path: &Path,
    token: &str,
    world: usize,
    cap: usize,
    len: usize,
) -> std::result::Result<MmapRaw, String> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| {
            format!(
                "cannot open rank 0's segment {} (are the ranks in one PID namespace, run by one user?): {e}",
                path.display()
            )
        })?;
    let size = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?
        .len();
    if size != len as u64 {
        return Err(format!(
            "{} is {size} bytes, expected {len}",
            path.display()
        ));
    }
    let map = MmapRaw::map_raw(&file).map_err(|e| format!("cannot map {}: {e}", path.display()))?;
    let want: u64 = token.parse().map_err(|_| format!("bad token {token:?}"))?;
    // SAFETY: the mapping is `len` bytes (checked above, more than one page) and page aligned;
    // the header words are 8-aligned and every process accesses them atomically.
    let word = |off: usize| unsafe {
        (*(map.as_mut_ptr().add(off) as *const AtomicU64)).load(Ordering::Acquire)
    };
    if word(OFF_MAGIC) != MAGIC
        || word(OFF_TOKEN) != want
        || word(OFF_WORLD) != world as u64
        || word(OFF_CAP) != cap as u64
    {
        return Err(format!(
            "{} is not the segment rank 0 created (different PID namespaces?)",
            path.display()
        ));
    }
    Ok(map)
}
