//! One NCCL communicator, owned ([`RawComm`]): its creation (non-blocking, waited for with the
//! watchdog of [`super::nccl_life`]), the calls the watchdog and the close make on it
//! ([`CommHandle`]), the wait for an operation, and the grouped warm-up all-reduce.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::life::{self as nccl_life, CommHandle, CommState, Wait};
use crate::error::{Error, Result};

/// One NCCL communicator, owned: aborted (never panicking) when dropped unless
/// [`nccl_life::close`] closed it first.
pub(super) struct RawComm {
    pub(super) comm: sys::ncclComm_t,
    pub(super) stream: Arc<CudaStream>,
    pub(super) rank: usize,
    /// Set once closed (finalized and destroyed, or aborted): nothing is left to abort.
    pub(super) closed: bool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls on it run at
// the same time; every use of a `RawComm` goes through the `Mutex` in `NcclCollective`.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        if let Err(e) = self.abort() {
            log::warn!(
                "rank {}: aborting the NCCL communicator failed ({e}); ignored at teardown",
                self.rank
            );
        }
    }
}

/// `ncclConfig_t` as NCCL 2.14 laid it out; every later version only appends fields. NCCL reads
/// `size` bytes of the caller's config and gives the fields it did not get their defaults, so
/// this works with whichever NCCL 2.14+ is found at run time, whatever version cudarc's bindings
/// were generated from.
#[repr(C)]
struct Config214 {
    size: usize,
    magic: std::ffi::c_uint,
    version: std::ffi::c_uint,
    blocking: std::ffi::c_int,
    cga_cluster_size: std::ffi::c_int,
    min_ctas: std::ffi::c_int,
    max_ctas: std::ffi::c_int,
    net_name: *const std::ffi::c_char,
}

/// `NCCL_CONFIG_UNDEF_INT`: NCCL picks the value.
const CONFIG_UNDEF_INT: std::ffi::c_int = std::ffi::c_int::MIN;

impl Config214 {
    /// `NCCL_CONFIG_INITIALIZER` of NCCL 2.14 with `blocking = 0`: creation and calls return at
    /// once (`ncclInProgress`) and are waited for with `ncclCommGetAsyncError`.
    fn non_blocking() -> Self {
        Config214 {
            size: std::mem::size_of::<Config214>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 14, 0)
            version: 21_400,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
        }
    }
}

/// NCCL's last error message for `comm` (`ncclGetLastError`), empty if none.
fn last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: ncclGetLastError accepts any communicator handle (or null) and returns null or a
    // NUL-terminated string owned by NCCL, read here before any other NCCL call.
    unsafe {
        let p = sys::ncclGetLastError(comm);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// An NCCL call's result as the text of a close step's error.
fn step(
    res: std::result::Result<nccl::NcclStatus, nccl::NcclError>,
) -> std::result::Result<(), String> {
    res.map(|_| ())
        .map_err(|e| nccl_life::result_name(e.0 as u32).to_string())
}

impl CommHandle for RawComm {
    fn state(&self) -> CommState {
        let mut code: u32 = 0;
        // SAFETY: `self.comm` is a live communicator (not yet closed) and `code` is a valid place
        // for one `ncclResult_t` (a `u32`-sized C enum), read as a plain integer so that a code
        // newer than cudarc's bindings cannot make an invalid Rust enum.
        let ret = unsafe {
            sys::ncclCommGetAsyncError(
                self.comm,
                (&mut code as *mut u32).cast::<sys::ncclResult_t>(),
            )
        };
        if ret != sys::ncclResult_t::ncclSuccess {
            return CommState::Failed(format!("ncclCommGetAsyncError itself failed: {ret:?}"));
        }
        nccl_life::state_of(code, || last_error(self.comm))
    }
    fn finalize(&self) -> std::result::Result<(), String> {
        // SAFETY: a live communicator, finalized once (by `nccl_life::close`).
        step(unsafe { nccl::comm_finalize(self.comm) })
    }
    fn destroy(&self) -> std::result::Result<(), String> {
        // SAFETY: a finalized communicator, destroyed once (by `nccl_life::close`, which marks
        // the `RawComm` closed so that its drop does not abort it too).
        step(unsafe { nccl::comm_destroy(self.comm) })
    }
    fn abort(&self) -> std::result::Result<(), String> {
        // SAFETY: a communicator NCCL handed out, aborted at most once: by `nccl_life::close`
        // (which marks the `RawComm` closed) or by the drop of a `RawComm` not yet closed.
        step(unsafe { nccl::comm_abort(self.comm) })
    }
}

/// An error NCCL or CUDA returned to this rank's call (no peer named: NCCL does not say).
pub(super) fn nccl_err(rank: usize, op: &str, what: impl std::fmt::Debug) -> Error {
    Error::Nccl {
        rank,
        op: op.into(),
        reason: format!("NCCL error: {what:?}"),
    }
}

impl RawComm {
    fn new(comm: sys::ncclComm_t, stream: Arc<CudaStream>, rank: usize) -> Self {
        RawComm {
            comm,
            stream,
            rank,
            closed: false,
        }
    }

    /// Non-blocking `ncclCommInitRankConfig` on `stream`'s GPU (its context bound to this thread
    /// first), waited for with the watchdog: at most `timeout`, failing early on an NCCL error
    /// or when `check_peers` finds a host peer gone.
    pub(super) fn init_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: sys::ncclUniqueId,
        timeout: Duration,
        check_peers: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_err(rank, "nccl init (binding the GPU)", e))?;
        let (n, r) = (
            i32::try_from(world).map_err(|_| Error::invalid("world size", "too large for NCCL"))?,
            i32::try_from(rank).map_err(|_| Error::invalid("rank", "too large for NCCL"))?,
        );
        let mut config = Config214::non_blocking();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid place for one communicator handle; `config` is a valid NCCL
        // 2.14 config (NCCL reads `config.size` bytes of it) that outlives the call; the unique id
        // came from rank 0's `ncclGetUniqueId`.
        let res = unsafe {
            nccl::comm_init_rank_config(
                &mut comm,
                n,
                id,
                r,
                (&mut config as *mut Config214).cast::<sys::ncclConfig_t>(),
            )
        };
        Self::started(vec![comm], vec![stream], rank, res, timeout, check_peers)?
            .pop()
            .ok_or_else(|| nccl_err(rank, "nccl init", "NCCL returned no communicator"))
    }

    /// DP: one communicator per stream (each on its own GPU), rank i on stream i, created from
    /// this one thread inside one NCCL group (non-blocking) and waited for with the watchdog.
    pub(super) fn init_group(
        streams: Vec<Arc<CudaStream>>,
        timeout: Duration,
    ) -> Result<Vec<Self>> {
        let n = i32::try_from(streams.len())
            .map_err(|_| Error::invalid("data_parallel", "too many replicas for NCCL"))?;
        let id = nccl::get_uniqueid().map_err(|e| nccl_err(0, "nccl unique id", e.0))?;
        // One config per communicator: in a group NCCL reads them at `ncclGroupEnd`.
        let mut configs: Vec<Config214> =
            streams.iter().map(|_| Config214::non_blocking()).collect();
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); streams.len()];
        nccl::group_start().map_err(|e| nccl_err(0, "nccl init (group start)", e.0))?;
        let mut first_err = None;
        for (i, (stream, (comm, config))) in streams
            .iter()
            .zip(comms.iter_mut().zip(configs.iter_mut()))
            .enumerate()
        {
            if let Err(e) = stream.context().bind_to_thread() {
                first_err.get_or_insert_with(|| nccl_err(i, "nccl init (binding the GPU)", e));
                break;
            }
            // SAFETY: `comm` is a valid place for one handle; `config` is a valid NCCL 2.14
            // config kept alive (in `configs`) until the group has ended and every communicator
            // is waited for; `i < n`; the id is this process's own.
            let res = unsafe {
                nccl::comm_init_rank_config(
                    comm,
                    n,
                    id,
                    i as i32,
                    (config as *mut Config214).cast::<sys::ncclConfig_t>(),
                )
            };
            if let Err(e) = res {
                first_err.get_or_insert_with(|| nccl_err(i, "nccl init", e.0));
                break;
            }
        }
        // The group is always ended, so that NCCL is left outside a group whatever happened.
        let res = nccl::group_end();
        let out = match first_err {
            Some(e) => {
                // Drop (abort) whatever was handed out.
                drop(Self::wrap(&comms, &streams, 0));
                Err(e)
            }
            None => Self::started(comms, streams, 0, res, timeout, &mut || Ok(())),
        };
        drop(configs);
        out
    }

    /// The communicators NCCL handed out (null handles skipped), owned; the i-th is rank
    /// `first_rank + i`.
    fn wrap(
        comms: &[sys::ncclComm_t],
        streams: &[Arc<CudaStream>],
        first_rank: usize,
    ) -> Vec<Self> {
        comms
            .iter()
            .zip(streams)
            .enumerate()
            .filter(|(_, (c, _))| !c.is_null())
            .map(|(i, (c, s))| RawComm::new(*c, s.clone(), first_rank + i))
            .collect()
    }

    /// After the (non-blocking) creation call returned `res`: owns the communicators, then waits
    /// until each is ready. Any failure drops (aborts) them all.
    fn started(
        comms: Vec<sys::ncclComm_t>,
        streams: Vec<Arc<CudaStream>>,
        rank: usize,
        res: std::result::Result<nccl::NcclStatus, nccl::NcclError>,
        timeout: Duration,
        check_peers: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<Self>> {
        let all = comms.len();
        let owned = Self::wrap(&comms, &streams, rank);
        if let Err(e) = res {
            let last = comms.first().map(|c| last_error(*c)).unwrap_or_default();
            return Err(Error::Nccl {
                rank,
                op: "nccl init".into(),
                reason: format!(
                    "NCCL refused to create the communicator: {} {last}",
                    nccl_life::result_name(e.0 as u32)
                ),
            });
        }
        if owned.len() != all {
            return Err(nccl_err(rank, "nccl init", "NCCL returned no communicator"));
        }
        let deadline = Instant::now() + timeout;
        for c in &owned {
            let w = Wait {
                rank: c.rank,
                op: "nccl init",
                timeout: deadline.saturating_duration_since(Instant::now()),
                hint: nccl_life::INIT_HINT,
            };
            nccl_life::wait(&w, c, &mut || Ok(true), check_peers)?;
        }
        Ok(owned)
    }

    /// The error of a call NCCL refused to queue: a dead peer named where the host collective
    /// knows it (see [`nccl_life::refused`]).
    pub(super) fn refused(
        &self,
        rank: usize,
        op: &str,
        timeout: Duration,
        e: Error,
        check_peers: &mut dyn FnMut() -> Result<()>,
    ) -> Error {
        let w = Wait {
            rank,
            op,
            timeout,
            hint: nccl_life::OP_HINT,
        };
        nccl_life::refused(&w, self, e, check_peers)
    }

    /// Waits until a call queued on this (non-blocking) communicator has really been queued on
    /// its stream, then until the GPU has done it: at most `timeout`.
    pub(super) fn wait_done(
        &self,
        rank: usize,
        op: &str,
        timeout: Duration,
        check_peers: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let start = Instant::now();
        let w = Wait {
            rank,
            op,
            timeout,
            hint: nccl_life::OP_HINT,
        };
        // `ncclInProgress` from a call means it is still being queued (connecting, say): the
        // event below must come after it on the stream.
        nccl_life::wait(&w, self, &mut || Ok(true), check_peers)?;
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| nccl_err(rank, op, e))?;
        let w = Wait {
            timeout: timeout.saturating_sub(start.elapsed()),
            ..w
        };
        nccl_life::wait(
            &w,
            self,
            &mut || event.try_is_complete().map_err(|e| nccl_err(rank, op, e)),
            check_peers,
        )
    }
}

/// One all-reduce of a single f32 on each communicator, queued in one NCCL group and waited
/// for: NCCL connects the peers there and then (it connects lazily, on the first operation).
pub(super) fn warm_up(
    comms: &[&RawComm],
    timeout: Duration,
    check_peers: &mut dyn FnMut() -> Result<()>,
) -> Result<()> {
    let mut bufs = Vec::with_capacity(comms.len());
    for c in comms {
        let buf = c
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| nccl_err(c.rank, "nccl warm-up", e))?;
        bufs.push(buf);
    }
    nccl::group_start().map_err(|e| nccl_err(0, "nccl warm-up (group start)", e.0))?;
    let mut first_err = None;
    {
        let mut guards = Vec::with_capacity(comms.len());
        for (c, buf) in comms.iter().zip(bufs.iter_mut()) {
            let (ptr, sync) = buf.device_ptr_mut(&c.stream);
            guards.push(sync);
            let p = ptr as *mut c_void;
            // SAFETY: `p` points to one f32 on `c`'s GPU, alive (in `bufs`) until every
            // communicator has been waited for below; in-place all-reduce takes it as source and
            // destination; the call is queued on `c`'s stream.
            let res = unsafe {
                nccl::all_reduce(
                    p,
                    p,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    c.comm,
                    c.stream.cu_stream() as _,
                )
            };
            if let Err(e) = res {
                first_err.get_or_insert_with(|| nccl_err(c.rank, "nccl warm-up", e.0));
                break;
            }
        }
        let end = nccl::group_end();
        if let Err(e) = end {
            first_err.get_or_insert_with(|| nccl_err(0, "nccl warm-up (group end)", e.0));
        }
        drop(guards);
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let deadline = Instant::now() + timeout;
    for c in comms {
        c.wait_done(
            c.rank,
            "nccl warm-up",
            deadline.saturating_duration_since(Instant::now()),
            check_peers,
        )?;
    }
    drop(bufs);
    Ok(())
}
