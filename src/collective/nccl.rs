//! NCCL collectives on GPU tensors (build with the `cuda` feature; `nccl_stub.rs` stands in
//! otherwise).
//!
//! An [`NcclCollective`] pairs one NCCL communicator with a host collective: the TCP ring for DDP
//! (one process per GPU) or a thread group for DP (one process, one thread per GPU). The host
//! collective carries the NCCL unique id, the small host-side operations (parameter metadata,
//! flags) and the liveness checks; tensors on the GPU go through NCCL on the device's own stream
//! (one stream per GPU per process, see [`crate::gpu`]), without a host round trip.
//!
//! **Threads.** Any thread may call the collective (calls are serialised by a lock, and queued
//! on the device's one stream after whatever that thread or another queued before), but every
//! rank must issue the same collectives in the same order, so issue them from one thread per
//! rank: the training thread (a DP replica's thread in DP). The data loader's prefetch thread
//! only copies batches.
//!
//! The dtype, layout and GPU are checked before anything is queued, so a wrong call is an error
//! that leaves the communicator usable. NCCL calls are asynchronous and a dead peer can leave
//! them spinning forever, so every wait has a watchdog ([`super::nccl_life`]):
//!
//! - **Creation.** Communicators are created non-blocking (`ncclCommInitRankConfig` with
//!   `blocking = 0`) and waited for with the collective timeout: a rank that never arrives, or a
//!   bootstrap interface the other machines cannot reach, is an error naming this rank and what
//!   to check (`NCCL_SOCKET_IFNAME`, `NCCL_DEBUG`) instead of a hang. Right after creation every
//!   rank runs one warm-up all-reduce (grouped over the replicas in DP), so that NCCL connects
//!   its peers there and then, under the same watchdog, and not lazily inside the first
//!   training step while other threads copy memory.
//! - **Operations.** After each operation the watchdog polls an event recorded after it and
//!   `ncclCommGetAsyncError`: a network error with every process alive fails at once, naming the
//!   rank, the operation and NCCL's error; a host peer that is gone fails within 50 ms; past the
//!   timeout the error names the rank and the operation. A failed operation aborts the
//!   communicator; every later call fails with [`Error::Broken`].
//! - **Closing.** When the last handle goes, a communicator whose run finished
//!   ([`Collective::set_run_outcome`], told by `AcceleratorBuilder::run`) is closed together with
//!   the other ranks: a barrier, `ncclCommFinalize`, `ncclCommDestroy`. One dropped without that
//!   word is finalized and destroyed without the barrier; one whose run failed (or whose thread
//!   panics) is aborted. Aborting never panics, even after a sticky CUDA error.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::nccl_life::{self, CommHandle, CommState, Wait};
use super::{
    Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp, TcpCollective, TcpOptions, ThreadGroup,
};
use crate::error::{Error, Result};

/// One NCCL communicator, owned: aborted (never panicking) when dropped unless
/// [`nccl_life::close`] closed it first.
struct RawComm {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    /// Set once closed (finalized and destroyed, or aborted): nothing is left to abort.
    closed: bool,
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

fn nccl_err(rank: usize, op: &str, what: impl std::fmt::Debug) -> Error {
    Error::Peer {
        rank,
        peer: rank,
        op: op.into(),
        reason: format!("NCCL error: {what:?}"),
        source: None,
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
    fn init_rank(
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
    fn init_group(streams: Vec<Arc<CudaStream>>, timeout: Duration) -> Result<Vec<Self>> {
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

    /// Waits until a call queued on this (non-blocking) communicator has really been queued on
    /// its stream, then until the GPU has done it: at most `timeout`.
    fn wait_done(
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
fn warm_up(
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

/// The NCCL element type of a Candle dtype, if NCCL has one.
fn nccl_dtype(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t as T;
    Some(match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        _ => return None,
    })
}

/// [`validate`](super::nccl_dtype::validate), then NCCL's element type.
fn checked(op: &str, dtype: DType, reduce: Option<ReduceOp>) -> Result<sys::ncclDataType_t> {
    let dtype = super::nccl_dtype::validate(op, dtype, reduce)?;
    nccl_dtype(dtype).ok_or_else(|| Error::UnsupportedDType {
        op: format!("{op} over NCCL"),
        dtype: format!("{dtype:?}"),
    })
}

/// One rank of an NCCL group; see the module docs.
pub struct NcclCollective {
    host: Arc<dyn Collective>,
    comm: Mutex<Option<RawComm>>,
    broken: Mutex<Option<String>>,
    device: Device,
    timeout: Duration,
    /// Call NCCL even at world size 1 (a diagnostic switch; see [`NcclCollective::force_calls`]).
    force: bool,
    calls: AtomicU64,
    /// How the run ended, when told ([`Collective::set_run_outcome`]): decides how the
    /// communicator is closed.
    outcome: Mutex<Option<bool>>,
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        let Some(mut comm) = self.comm.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let outcome = nccl_life::outcome(
            self.broken_guard().clone(),
            std::thread::panicking(),
            *self.outcome.lock().unwrap_or_else(|p| p.into_inner()),
        );
        let rank = self.host.rank();
        let host = self.host.clone();
        let closed = nccl_life::close(
            &comm,
            outcome,
            rank,
            self.timeout,
            &mut || host.barrier(),
            &mut || host.check_peers(),
        );
        comm.closed = true;
        log::debug!("rank {rank}: NCCL communicator closed: {closed:?}");
    }
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.host.rank())
            .field("world_size", &self.host.world_size())
            .field("device", &self.device)
            .finish()
    }
}

fn stream_of(device: &Device) -> Result<Arc<CudaStream>> {
    Ok(device.as_cuda_device()?.cuda_stream())
}

/// Length of the message rank 0 broadcasts with the NCCL unique id: an ok flag, the id, and
/// rank 0's error when it could not make one.
const ID_MSG: usize = 1 + 128 + 256;

impl NcclCollective {
    /// DDP: joins the TCP group described by `opts` (host operations, the NCCL unique id) and
    /// creates this rank's NCCL communicator on `device`'s stream.
    pub fn connect(opts: &TcpOptions, device: &Device) -> Result<Self> {
        let host = TcpCollective::connect(opts)?;
        Self::over(Arc::new(host), device, opts.timeout)
    }

    /// DDP over an already connected host collective (every rank of `host` calls this, each with
    /// its own GPU): rank 0 makes the NCCL unique id and sends it over `host` with an ok flag (a
    /// rank 0 that cannot make one tells the others instead of leaving them waiting); every rank
    /// then checks that its GPU is usable and all agree before the blocking NCCL init.
    pub fn over(host: Arc<dyn Collective>, device: &Device, timeout: Duration) -> Result<Self> {
        let rank = host.rank();
        let mut msg = [0u8; ID_MSG];
        let mut own_err = None;
        if rank == 0 {
            match nccl::get_uniqueid() {
                Ok(id) => {
                    msg[0] = 1;
                    for (b, c) in msg[1..129].iter_mut().zip(id.internal) {
                        *b = c as u8;
                    }
                }
                Err(e) => {
                    let text = format!("ncclGetUniqueId failed: {:?}", e.0);
                    let n = text.len().min(ID_MSG - 129);
                    msg[129..129 + n].copy_from_slice(&text.as_bytes()[..n]);
                    own_err = Some(nccl_err(rank, "nccl unique id", e.0));
                }
            }
        }
        host.broadcast(BufferMut::from(&mut msg[..]), 0)?;
        if let Some(e) = own_err {
            return Err(e);
        }
        if msg[0] != 1 {
            let why = String::from_utf8_lossy(&msg[129..]);
            return Err(Error::Peer {
                rank,
                peer: 0,
                op: "nccl init".into(),
                reason: format!(
                    "rank 0 could not create the NCCL unique id: {}",
                    why.trim_end_matches('\0')
                ),
                source: None,
            });
        }
        // Agree that every rank's GPU is usable before the collective (blocking) init.
        let stream = stream_of(device);
        let ready = stream.as_ref().map_err(|e| e.to_string()).and_then(|s| {
            s.context()
                .bind_to_thread()
                .map_err(|e| format!("cannot bind {device:?}: {e:?}"))
        });
        let mut flags = [0u8; 1];
        if ready.is_err() {
            flags[0] = 1;
        }
        let all = host.all_gather(Buffer::from(&flags[..]))?;
        if let Err(why) = ready {
            return Err(nccl_err(rank, "nccl init", why));
        }
        if let Some(bad) = all.iter().position(|b| b.bytes() != [0]) {
            return Err(Error::Peer {
                rank,
                peer: bad,
                op: "nccl init".into(),
                reason: format!("rank {bad} cannot use its GPU; see its error"),
                source: None,
            });
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(&msg[1..129]) {
            *c = *b as std::ffi::c_char;
        }
        let comm = RawComm::init_rank(
            stream?,
            rank,
            host.world_size(),
            sys::ncclUniqueId { internal },
            timeout,
            &mut || host.check_peers(),
        )?;
        warm_up(&[&comm], timeout, &mut || host.check_peers())?;
        Ok(Self::assemble(host, comm, device.clone(), timeout))
    }

    fn assemble(
        host: Arc<dyn Collective>,
        comm: RawComm,
        device: Device,
        timeout: Duration,
    ) -> Self {
        NcclCollective {
            host,
            comm: Mutex::new(Some(comm)),
            broken: Mutex::new(None),
            device,
            timeout,
            force: false,
            calls: AtomicU64::new(0),
            outcome: Mutex::new(None),
        }
    }

    /// DP: one communicator per GPU ordinal of this process (rank i drives `ordinals[i]`), each
    /// paired with a thread-group rank for host operations. Returns each rank's device and
    /// collective; move each into its own thread. The GPUs must be distinct, by PCI bus id (NCCL
    /// cannot put two ranks on one GPU, nor on two MIG slices of one; DP falls back to a thread
    /// group then).
    ///
    /// The communicators are created in one NCCL group and connected with one grouped warm-up
    /// all-reduce before this returns, on this thread: the replicas' threads never connect NCCL
    /// while other threads copy memory.
    pub fn group(ordinals: &[usize], timeout: Duration) -> Result<Vec<(Device, NcclCollective)>> {
        let devices: Vec<Device> = ordinals
            .iter()
            .map(|&o| crate::gpu::device(o))
            .collect::<Result<_>>()?;
        let bus_ids = devices
            .iter()
            .map(crate::gpu::pci_bus_id)
            .collect::<Result<Vec<_>>>()?;
        if let Some((a, b)) = super::placement::first_shared(&bus_ids) {
            return Err(Error::invalid(
                "NCCL group",
                format!(
                    "ranks {a} and {b} both drive the GPU at PCI bus id {} (GPUs {} and {}): NCCL needs one GPU per rank",
                    bus_ids[a], ordinals[a], ordinals[b]
                ),
            ));
        }
        let streams = devices.iter().map(stream_of).collect::<Result<Vec<_>>>()?;
        let comms = RawComm::init_group(streams, timeout)?;
        warm_up(&comms.iter().collect::<Vec<_>>(), timeout, &mut || Ok(()))?;
        let hosts = ThreadGroup::new(ordinals.len(), timeout)?;
        Ok(devices
            .into_iter()
            .zip(comms)
            .zip(hosts)
            .map(|((device, comm), host)| {
                let c = Self::assemble(Arc::new(host), comm, device.clone(), timeout);
                (device, c)
            })
            .collect())
    }

    /// A diagnostic switch: call NCCL even at world size 1, where every operation would
    /// otherwise return at once. `accelerate-rs test` uses it to prove the NCCL path on a
    /// one-GPU machine.
    pub fn force_calls(mut self) -> Self {
        self.force = true;
        self
    }

    /// Number of operations this rank has completed through NCCL.
    pub fn nccl_calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The GPU this rank drives.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn skip(&self) -> bool {
        self.world_size() == 1 && !self.force
    }

    fn broken_guard(&self) -> MutexGuard<'_, Option<String>> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `enqueue` on the communicator, then waits for it with the watchdog. Callers have
    /// validated the arguments, so a failure here is NCCL's or a peer's: the communicator is
    /// aborted and every later call fails with [`Error::Broken`].
    fn run(&self, op: &str, enqueue: impl FnOnce(&RawComm) -> Result<()>) -> Result<()> {
        self.run_n(op, 1, enqueue)
    }

    /// [`run`](Self::run) for `count` operations queued by `enqueue` (counted in
    /// [`nccl_calls`](Self::nccl_calls)), waited for once.
    fn run_n(
        &self,
        op: &str,
        count: u64,
        enqueue: impl FnOnce(&RawComm) -> Result<()>,
    ) -> Result<()> {
        let rank = self.host.rank();
        if let Some(first) = self.broken_guard().clone() {
            return Err(Error::Broken {
                rank,
                op: op.into(),
                first,
            });
        }
        let mut guard = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        let res = match guard.as_ref() {
            Some(comm) => enqueue(comm).and_then(|()| self.watch(op, comm)),
            None => Err(Error::Broken {
                rank,
                op: op.into(),
                first: "the NCCL communicator was aborted".into(),
            }),
        };
        match &res {
            Ok(()) => {
                self.calls.fetch_add(count, Ordering::Relaxed);
            }
            Err(e) => {
                // Dropping the communicator aborts it, which unblocks NCCL kernels still waiting
                // for a peer that will never come.
                guard.take();
                self.broken_guard().get_or_insert_with(|| e.to_string());
            }
        }
        res
    }

    fn watch(&self, op: &str, comm: &RawComm) -> Result<()> {
        let host = &self.host;
        comm.wait_done(self.host.rank(), op, self.timeout, &mut || {
            host.check_peers()
        })
    }

    /// Refuses a tensor on another GPU than this rank's (checked before anything is queued).
    fn check_device(&self, op: &str, t: &Tensor) -> Result<()> {
        let want = match self.device.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
            _ => return Ok(()),
        };
        nccl_life::check_ordinal(self.host.rank(), op, want, t.device().location())
    }
}

/// What one NCCL call does, queued on the communicator's stream.
#[derive(Clone, Copy)]
enum Call {
    AllReduce(sys::ncclRedOp_t),
    Broadcast(i32),
}

/// An out-of-place NCCL all-reduce or broadcast of a contiguous CUDA tensor into a new one of
/// the same shape: no copy of the input first, and the caller's tensor is never modified.
struct OutOfPlace<'a> {
    comm: &'a RawComm,
    call: Call,
    ty: sys::ncclDataType_t,
}

/// Reduce-scatter of a contiguous CUDA tensor of `world * n` elements into a new `[n]` tensor
/// (this rank's block of the reduction).
struct ReduceScatter<'a> {
    comm: &'a RawComm,
    world: usize,
    ty: sys::ncclDataType_t,
    op: sys::ncclRedOp_t,
}

/// `flat` (1-D, `len` elements) cut into the ranks' chunks ([`super::chunk_range`]), each
/// padded with zeros to `block` elements and laid end to end: the equal-sized blocks NCCL's
/// reduce-scatter and all-gather move.
fn padded_blocks(flat: &Tensor, world: usize, block: usize) -> Result<Tensor> {
    let len = flat.elem_count();
    if len == world * block {
        // Equal chunks already (floor bounds of a multiple of `world`).
        return Ok(flat.contiguous()?);
    }
    let mut parts = Vec::with_capacity(2 * world);
    for r in 0..world {
        let own = super::chunk_range(len, world, r);
        parts.push(flat.narrow(0, own.start, own.len())?);
        if own.len() < block {
            parts.push(Tensor::zeros(
                block - own.len(),
                flat.dtype(),
                flat.device(),
            )?);
        }
    }
    Ok(Tensor::cat(&parts, 0)?.contiguous()?)
}

/// All-gather of equal-sized contiguous CUDA tensors into a new `[world * n]` tensor.
struct AllGather<'a> {
    comm: &'a RawComm,
    world: usize,
    ty: sys::ncclDataType_t,
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

fn cpu_refused(name: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("{name}: NCCL operations need CUDA tensors"))
}

fn contiguous(l: &Layout, name: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: tensor is not contiguous")))
}

fn wrap(e: nccl::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL: {:?}", e.0))
}

/// Runs `$body` with `$t` the Rust element type of `$dtype` (only the dtypes [`nccl_dtype`]
/// accepts; `validate` has refused the others before anything is queued).
macro_rules! per_dtype {
    ($dtype:expr, $name:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            DType::U8 => {
                type $t = u8;
                $body
            }
            DType::U32 => {
                type $t = u32;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            other => Err(candle_core::Error::Msg(format!(
                "{}: unsupported dtype {other:?}",
                $name
            ))),
        }
    };
}

impl CustomOp1 for OutOfPlace<'_> {
    fn name(&self) -> &'static str {
        match self.call {
            Call::AllReduce(_) => "nccl-all-reduce",
            Call::Broadcast(_) => "nccl-broadcast",
        }
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (a, b) = contiguous(l, self.name())?;
        let n = b - a;
        let dev = s.device.clone();
        let stream = &self.comm.stream;
        per_dtype!(s.dtype(), self.name(), |T| {
            let src = s.as_cuda_slice::<T>()?.slice(a..b);
            // SAFETY: the NCCL call below writes all `n` elements before anything reads them
            // (later uses are queued after it on the same stream).
            let mut dst = unsafe { dev.alloc::<T>(n)? };
            {
                let (sp, _sync_src) = src.device_ptr(stream);
                let (dp, _sync_dst) = dst.device_ptr_mut(stream);
                let (sp, dp) = (sp as *const c_void, dp as *mut c_void);
                // SAFETY: `sp` and `dp` point to `n` elements of type `ty` on the
                // communicator's GPU, alive until the call is queued on its stream (later uses
                // are ordered after it there); source and destination do not overlap.
                let res = unsafe {
                    match self.call {
                        Call::AllReduce(op) => nccl::all_reduce(
                            sp,
                            dp,
                            n,
                            self.ty,
                            op,
                            self.comm.comm,
                            stream.cu_stream() as _,
                        ),
                        Call::Broadcast(root) => nccl::broadcast(
                            sp,
                            dp,
                            n,
                            self.ty,
                            root,
                            self.comm.comm,
                            stream.cu_stream() as _,
                        ),
                    }
                };
                res.map_err(wrap)?;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(dst, dev.clone()),
                l.shape().clone(),
            ))
        })
    }
}

impl CustomOp1 for ReduceScatter<'_> {
    fn name(&self) -> &'static str {
        "nccl-reduce-scatter"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (a, b) = contiguous(l, self.name())?;
        if (b - a) % self.world.max(1) != 0 {
            return Err(candle_core::Error::Msg(format!(
                "{}: {} element(s) do not split into {} equal blocks",
                self.name(),
                b - a,
                self.world
            )));
        }
        let out_len = (b - a) / self.world.max(1);
        let dev = s.device.clone();
        let stream = &self.comm.stream;
        per_dtype!(s.dtype(), self.name(), |T| {
            let src = s.as_cuda_slice::<T>()?.slice(a..b);
            let mut dst = dev.alloc_zeros::<T>(out_len)?;
            {
                let (sp, _sync_src) = src.device_ptr(stream);
                let (dp, _sync_dst) = dst.device_ptr_mut(stream);
                // SAFETY: `sp` points to `world * out_len` elements of type `ty` and `dp` to
                // `out_len`, both on the communicator's GPU and alive until the call is queued on
                // its stream (the events recorded when the guards drop order later uses).
                unsafe {
                    nccl::reduce_scatter(
                        sp as *const c_void,
                        dp as *mut c_void,
                        out_len,
                        self.ty,
                        self.op,
                        self.comm.comm,
                        stream.cu_stream() as _,
                    )
                }
                .map_err(wrap)?;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(dst, dev.clone()),
                Shape::from(out_len),
            ))
        })
    }
}

impl CustomOp1 for AllGather<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-gather"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (a, b) = contiguous(l, self.name())?;
        let out_len = (b - a) * self.world;
        let dev = s.device.clone();
        let stream = &self.comm.stream;
        per_dtype!(s.dtype(), self.name(), |T| {
            let src = s.as_cuda_slice::<T>()?.slice(a..b);
            let mut dst = dev.alloc_zeros::<T>(out_len)?;
            {
                let (sp, _sync_src) = src.device_ptr(stream);
                let (dp, _sync_dst) = dst.device_ptr_mut(stream);
                // SAFETY: `sp` points to `b - a` elements of type `ty` and `dp` to `world` times
                // as many, both on the communicator's GPU and alive until the call is queued on
                // its stream (the events recorded when the guards drop order later uses).
                unsafe {
                    nccl::all_gather(
                        sp as *const c_void,
                        dp as *mut c_void,
                        b - a,
                        self.ty,
                        self.comm.comm,
                        stream.cu_stream() as _,
                    )
                }
                .map_err(wrap)?;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(dst, dev.clone()),
                Shape::from(out_len),
            ))
        })
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn world_size(&self) -> usize {
        self.host.world_size()
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        self.host.all_reduce(buf, op)
    }
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()> {
        self.host.broadcast(buf, root)
    }
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
        self.host.all_gather(buf)
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn check_peers(&self) -> Result<()> {
        self.host.check_peers()
    }
    fn set_run_outcome(&self, finished: bool) {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(finished);
    }

    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.all_reduce_tensor(t, op);
        }
        Ok(self
            .all_reduce_tensors(std::slice::from_ref(t), op)?
            .remove(0))
    }

    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        if self.skip() {
            return Ok(ts.to_vec());
        }
        if ts.iter().any(|t| !t.device().is_cuda()) {
            return ts
                .iter()
                .map(|t| {
                    if t.device().is_cuda() {
                        self.all_reduce_tensors(std::slice::from_ref(t), op)
                            .map(|mut v| v.remove(0))
                    } else {
                        self.host.all_reduce_tensor(t, op)
                    }
                })
                .collect();
        }
        // Everything checked before anything is queued.
        let mut inputs = Vec::with_capacity(ts.len());
        for t in ts {
            self.check_device("all_reduce", t)?;
            inputs.push((t.contiguous()?, checked("all_reduce", t.dtype(), Some(op))?));
        }
        let mut outs = Vec::with_capacity(ts.len());
        // One NCCL group, queued back to back on the stream, one wait for all of them.
        self.run_n("all_reduce", ts.len() as u64, |comm| {
            nccl::group_start()
                .map_err(|e| nccl_err(comm.rank, "all_reduce (group start)", e.0))?;
            let mut queued = Ok(());
            for (t, ty) in &inputs {
                let call = Call::AllReduce(nccl_op(op));
                match t.apply_op1_no_bwd(&OutOfPlace {
                    comm,
                    call,
                    ty: *ty,
                }) {
                    Ok(out) => outs.push(out),
                    Err(e) => {
                        queued = Err(e.into());
                        break;
                    }
                }
            }
            // Always ended, whatever happened inside.
            let ended = nccl::group_end()
                .map(|_| ())
                .map_err(|e| nccl_err(comm.rank, "all_reduce (group end)", e.0));
            queued.and(ended)
        })?;
        Ok(outs)
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::check_root(root, self.world_size(), self.rank())?;
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.broadcast_tensor(t, root);
        }
        self.check_device("broadcast", t)?;
        let ty = checked("broadcast", t.dtype(), None)?;
        let root =
            i32::try_from(root).map_err(|_| Error::invalid("broadcast root", "too large"))?;
        let input = t.contiguous()?;
        let mut out = None;
        self.run("broadcast", |comm| {
            let call = Call::Broadcast(root);
            out = Some(input.apply_op1_no_bwd(&OutOfPlace { comm, call, ty })?);
            Ok(())
        })?;
        out.ok_or_else(|| nccl_err(self.rank(), "broadcast", "no output"))
    }

    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (world, len) = (self.world_size(), t.elem_count());
        if self.skip() {
            return Ok(t.flatten_all()?);
        }
        if !t.device().is_cuda() || len == 0 {
            return self.host.reduce_scatter_tensor(t, op);
        }
        self.check_device("reduce_scatter", t)?;
        let ty = checked("reduce_scatter", t.dtype(), Some(op))?;
        let block = len.div_ceil(world);
        let padded = padded_blocks(&t.flatten_all()?, world, block)?;
        let mut out = None;
        self.run("reduce_scatter", |comm| {
            let call = ReduceScatter {
                comm,
                world,
                ty,
                op: nccl_op(op),
            };
            out = Some(padded.apply_op1_no_bwd(&call)?);
            Ok(())
        })?;
        let out = out.ok_or_else(|| nccl_err(self.rank(), "reduce_scatter", "no output"))?;
        let own = super::chunk_range(len, world, self.rank());
        Ok(out.narrow(0, 0, own.len())?)
    }

    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let (world, len) = (self.world_size(), t.elem_count());
        if self.skip() {
            return Ok(t.flatten_all()?);
        }
        if !t.device().is_cuda() || len == 0 {
            return self.host.all_gather_into_tensor(t);
        }
        self.check_device("all_gather_into", t)?;
        let ty = checked("all_gather_into", t.dtype(), None)?;
        let block = len.div_ceil(world);
        let own = super::chunk_range(len, world, self.rank());
        let mine = t.flatten_all()?.narrow(0, own.start, own.len())?;
        let mine = if own.len() < block {
            Tensor::cat(
                &[
                    mine,
                    Tensor::zeros(block - own.len(), t.dtype(), t.device())?,
                ],
                0,
            )?
        } else {
            mine
        }
        .contiguous()?;
        let mut gathered = None;
        self.run("all_gather_into", |comm| {
            gathered = Some(mine.apply_op1_no_bwd(&AllGather { comm, world, ty })?);
            Ok(())
        })?;
        let gathered =
            gathered.ok_or_else(|| nccl_err(self.rank(), "all_gather_into", "no output"))?;
        let parts = (0..world)
            .map(|r| gathered.narrow(0, r * block, super::chunk_range(len, world, r).len()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    }

    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() || t.rank() == 0 {
            return self.host.all_gather_tensor(t);
        }
        self.check_device("all_gather", t)?;
        let ty = checked("all_gather", t.dtype(), None)?;
        // NCCL gathers equal sizes: agree on every rank's row count (host side, which also
        // checks dtype and trailing dims), pad to the largest, gather, then drop the padding.
        let rows = t.dim(0)?;
        let counts = super::agree_on_rows(self.host.as_ref(), t)?;
        let max = counts.iter().copied().max().unwrap_or(0);
        let mut dims = t.dims().to_vec();
        let padded = if rows < max {
            dims[0] = max - rows;
            Tensor::cat(
                &[
                    t.clone(),
                    Tensor::zeros(dims.clone(), t.dtype(), t.device())?,
                ],
                0,
            )?
        } else {
            t.clone()
        }
        .contiguous()?;
        let world = self.world_size();
        let mut gathered = None;
        self.run("all_gather", |comm| {
            gathered = Some(padded.apply_op1_no_bwd(&AllGather { comm, world, ty })?);
            Ok(())
        })?;
        let gathered = gathered.ok_or_else(|| nccl_err(self.rank(), "all_gather", "no output"))?;
        // Each rank's block holds `max` rows of `row` elements.
        let row: usize = dims[1..].iter().product();
        let mut parts = Vec::with_capacity(counts.len());
        for (r, &k) in counts.iter().enumerate() {
            let mut d = dims.clone();
            d[0] = k;
            parts.push(gathered.narrow(0, r * max * row, k * row)?.reshape(d)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}
