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
//! The dtype and layout are checked before anything is queued, so a wrong call is an error that
//! leaves the communicator usable. NCCL calls are asynchronous and a dead peer can leave them
//! spinning forever, so every operation is followed by a watchdog: it polls an event recorded
//! after the operation, checks that the host collective's peers are still alive, and past the
//! timeout aborts the communicator and returns an error naming the operation, the rank and the
//! peer. Aborting never panics, even after a sticky CUDA error.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, InplaceOp1, Layout, Shape, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::{
    Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp, TcpCollective, TcpOptions, ThreadGroup,
};
use crate::error::{Error, Result};

/// One NCCL communicator, owned: aborted (never panicking) when dropped.
struct RawComm {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls on it run at
// the same time; every use of a `RawComm` goes through the `Mutex` in `NcclCollective`.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: `self.comm` was initialised by NCCL (`init_rank`/`init_all` only build a
        // `RawComm` after success) and is aborted exactly once, here.
        if let Err(e) = unsafe { nccl::comm_abort(self.comm) } {
            log::warn!(
                "rank {}: aborting the NCCL communicator failed ({:?}); ignored at teardown",
                self.rank,
                e.0
            );
        }
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
    /// `ncclCommInitRank` on `stream`'s GPU, with its context bound to this thread first.
    fn init_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: sys::ncclUniqueId,
    ) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_err(rank, "nccl init (binding the GPU)", e))?;
        let (n, r) = (
            i32::try_from(world).map_err(|_| Error::invalid("world size", "too large for NCCL"))?,
            i32::try_from(rank).map_err(|_| Error::invalid("rank", "too large for NCCL"))?,
        );
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is a valid place for one communicator handle, written by NCCL on
        // success (and only read then); the unique id came from rank 0's `ncclGetUniqueId`.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), n, id, r)
                .map_err(|e| nccl_err(rank, "nccl init", e.0))?;
            comm.assume_init()
        };
        Ok(RawComm { comm, stream, rank })
    }

    /// `ncclCommInitAll`: one communicator per stream (each on its own GPU), rank i on stream i.
    fn init_all(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>> {
        let ordinals: Vec<i32> = streams
            .iter()
            .map(|s| i32::try_from(s.context().ordinal()).unwrap_or(i32::MAX))
            .collect();
        let n = i32::try_from(streams.len())
            .map_err(|_| Error::invalid("data_parallel", "too many replicas for NCCL"))?;
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); streams.len()];
        // SAFETY: `comms` has room for `n` handles and `ordinals` holds `n` device ordinals, as
        // ncclCommInitAll requires.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n, ordinals.as_ptr()) }
            .map_err(|e| nccl_err(0, "nccl init", e.0))?;
        Ok(comms
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (comm, stream))| RawComm { comm, stream, rank })
            .collect())
    }
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
        )?;
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
        }
    }

    /// DP: one communicator per GPU ordinal of this process (rank i drives `ordinals[i]`), each
    /// paired with a thread-group rank for host operations. Returns each rank's device and
    /// collective; move each into its own thread. The ordinals must be distinct (NCCL cannot put
    /// two ranks on one GPU; DP falls back to a thread group then).
    pub fn group(ordinals: &[usize], timeout: Duration) -> Result<Vec<(Device, NcclCollective)>> {
        if let Some((a, b)) = super::placement::first_shared(ordinals) {
            return Err(Error::invalid(
                "NCCL group",
                format!(
                    "ranks {a} and {b} both drive GPU {}: NCCL needs one GPU per rank",
                    ordinals[a]
                ),
            ));
        }
        let devices: Vec<Device> = ordinals
            .iter()
            .map(|&o| crate::gpu::device(o))
            .collect::<Result<_>>()?;
        let streams = devices.iter().map(stream_of).collect::<Result<Vec<_>>>()?;
        let comms = RawComm::init_all(streams)?;
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
                self.calls.fetch_add(1, Ordering::Relaxed);
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
        let rank = self.host.rank();
        let event = comm
            .stream
            .record_event(None)
            .map_err(|e| nccl_err(rank, op, e))?;
        let start = Instant::now();
        let mut last_check = start;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(nccl_err(rank, op, e)),
            }
            let now = Instant::now();
            if now.duration_since(last_check) > Duration::from_millis(50) {
                self.host.check_peers().map_err(|e| Error::Peer {
                    rank,
                    peer: match &e {
                        Error::Peer { peer, .. } => *peer,
                        _ => rank,
                    },
                    op: op.into(),
                    reason: format!("a peer is gone while NCCL waits: {e}"),
                    source: None,
                })?;
                last_check = now;
            }
            if now.duration_since(start) >= self.timeout {
                return Err(Error::Timeout {
                    rank,
                    peer: (rank + 1) % self.host.world_size(),
                    op: op.into(),
                    timeout: self.timeout,
                });
            }
            if now.duration_since(start) < Duration::from_millis(2) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

/// What one NCCL call does, queued on the communicator's stream.
#[derive(Clone, Copy)]
enum Call {
    AllReduce(sys::ncclRedOp_t),
    Broadcast(i32),
}

/// An in-place NCCL call on a contiguous CUDA tensor.
struct InPlace<'a> {
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
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
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

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        match self.call {
            Call::AllReduce(_) => "nccl-all-reduce",
            Call::Broadcast(_) => "nccl-broadcast",
        }
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = contiguous(l, self.name())?;
        let stream = &self.comm.stream;
        per_dtype!(s.dtype(), self.name(), |T| {
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            // Recorded on the stream when `_sync` drops, after the call is queued.
            let (ptr, _sync) = view.device_ptr_mut(stream);
            let buf = ptr as *mut c_void;
            // SAFETY: `buf` points to `b - a` elements of type `ty` on the communicator's GPU,
            // borrowed mutably (Candle's write lock on the storage) until the call is queued on
            // the communicator's stream, where later uses of the tensor are ordered after it.
            // In-place NCCL calls take the same pointer as source and destination.
            let res = unsafe {
                match self.call {
                    Call::AllReduce(op) => nccl::all_reduce(
                        buf,
                        buf,
                        b - a,
                        self.ty,
                        op,
                        self.comm.comm,
                        stream.cu_stream() as _,
                    ),
                    Call::Broadcast(root) => nccl::broadcast(
                        buf,
                        buf,
                        b - a,
                        self.ty,
                        root,
                        self.comm.comm,
                        stream.cu_stream() as _,
                    ),
                }
            };
            res.map(|_| ()).map_err(wrap)
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

    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.all_reduce_tensor(t, op);
        }
        let ty = checked("all_reduce", t.dtype(), Some(op))?;
        // A private contiguous copy: the caller's tensor is never modified.
        let out = t.contiguous()?.copy()?;
        self.run("all_reduce", |comm| {
            let call = Call::AllReduce(nccl_op(op));
            Ok(out.inplace_op1(&InPlace { comm, call, ty })?)
        })?;
        Ok(out)
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::check_root(root, self.world_size(), self.rank())?;
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.broadcast_tensor(t, root);
        }
        let ty = checked("broadcast", t.dtype(), None)?;
        let root =
            i32::try_from(root).map_err(|_| Error::invalid("broadcast root", "too large"))?;
        let out = t.contiguous()?.copy()?;
        self.run("broadcast", |comm| {
            let call = Call::Broadcast(root);
            Ok(out.inplace_op1(&InPlace { comm, call, ty })?)
        })?;
        Ok(out)
    }

    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (world, len) = (self.world_size(), t.elem_count());
        if self.skip() {
            return Ok(t.flatten_all()?);
        }
        if !t.device().is_cuda() || len == 0 {
            return self.host.reduce_scatter_tensor(t, op);
        }
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
