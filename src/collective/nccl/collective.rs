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
//! The dtype, layout, GPU and stream are checked and every output buffer is allocated before
//! anything is queued ([`nccl_life::GuardedComm::run`]), so a wrong call, or running out of
//! memory for the outputs, is an ordinary error that leaves the communicator usable. A tensor
//! made on another Candle device of the same GPU (a `Device::new_cuda` of the user's own, on
//! another stream) is refused: NCCL would read it without waiting for that stream
//! ([`nccl_life::check_place`] says why it is refused rather than ordered). Between the
//! allocation and the queueing, the [`Gate`] installed by the accelerator is passed: while a
//! batch-size search probes, the ranks agree there, so that one rank running out of memory for
//! its outputs makes every rank retry instead of leaving its peers inside NCCL. NCCL calls are
//! asynchronous and a dead peer can leave them spinning forever, so every wait has a watchdog
//! ([`super::nccl_life`]):
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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use candle_core::{DType, Device, DeviceLocation, Tensor};
use cudarc::driver::CudaStream;
use cudarc::nccl::{result as nccl, sys};

use super::comm::{nccl_err, warm_up, RawComm};
use super::ops::{alloc_output, nccl_op, padded_blocks, queue, Call};

use super::life::{self as nccl_life, GuardedComm, StreamPlace};
use crate::collective::{
    Buffer, BufferMut, Collective, Gate, OwnedBuffer, ReduceOp, TcpCollective, TcpOptions,
    ThreadGroup,
};
use crate::error::{Error, Result};

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

/// [`validate`](super::dtype::validate), then NCCL's element type.
fn checked(op: &str, dtype: DType, reduce: Option<ReduceOp>) -> Result<sys::ncclDataType_t> {
    let dtype = super::dtype::validate(op, dtype, reduce)?;
    nccl_dtype(dtype).ok_or_else(|| Error::UnsupportedDType {
        op: format!("{op} over NCCL"),
        dtype: format!("{dtype:?}"),
    })
}

/// One rank of an NCCL group; see the module docs.
pub struct NcclCollective {
    host: Arc<dyn Collective>,
    comm: GuardedComm<RawComm>,
    /// Passed between preparing an operation and queueing it, newest first
    /// ([`Collective::add_gate`]).
    gates: Mutex<Vec<Weak<dyn Gate>>>,
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
        let Some(mut comm) = self.comm.take() else {
            return;
        };
        let outcome = nccl_life::outcome(
            self.comm.first_failure(),
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
            comm: GuardedComm::new(comm),
            gates: Mutex::new(Vec::new()),
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
            .map(|&o| crate::settings::gpu::device(o))
            .collect::<Result<_>>()?;
        let bus_ids = devices
            .iter()
            .map(crate::settings::gpu::pci_bus_id)
            .collect::<Result<Vec<_>>>()?;
        if let Some((a, b)) = crate::collective::placement::first_shared(&bus_ids) {
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

    /// Runs one operation of `count` NCCL calls (counted in [`nccl_calls`](Self::nccl_calls))
    /// with [`GuardedComm::run`]: `prepare` validates and allocates every output (an error
    /// there, running out of memory included, leaves the communicator usable), the gate is
    /// passed, `enqueue` queues the calls (allocating nothing) and the watchdog waits once. A
    /// failure once queued aborts the communicator; every later call fails with
    /// [`Error::Broken`].
    fn run_n<O>(
        &self,
        op: &str,
        count: u64,
        prepare: impl FnOnce() -> Result<O>,
        enqueue: impl FnOnce(&RawComm, &O) -> Result<()>,
    ) -> Result<O> {
        let rank = self.host.rank();
        let out = self.comm.run(
            rank,
            op,
            || prepare().map_err(|e| e.on_rank(rank, &self.device)),
            |failure| self.pass_gate(op, failure),
            |comm, o| enqueue(comm, o).map_err(|e| self.refused(op, comm, e)),
            |comm| self.watch(op, comm),
        )?;
        self.calls.fetch_add(count, Ordering::Relaxed);
        Ok(out)
    }

    /// Passes the gates still alive, newest first, with how the preparation went; the first
    /// that refuses decides (none installed: go on).
    fn pass_gate(&self, op: &str, failure: Option<&Error>) -> Result<()> {
        let live: Vec<Arc<dyn Gate>> = {
            let mut gates = self.gates.lock().unwrap_or_else(|p| p.into_inner());
            gates.retain(|g| g.strong_count() > 0);
            gates.iter().rev().filter_map(Weak::upgrade).collect()
        };
        live.iter().try_for_each(|g| g.pass(op, failure))
    }

    fn refused(&self, op: &str, comm: &RawComm, e: Error) -> Error {
        let host = &self.host;
        comm.refused(host.rank(), op, self.timeout, e, &mut || host.check_peers())
    }

    fn watch(&self, op: &str, comm: &RawComm) -> Result<()> {
        let host = &self.host;
        comm.wait_done(self.host.rank(), op, self.timeout, &mut || {
            host.check_peers()
        })
    }

    /// Refuses a tensor on another GPU than this rank's, or on this GPU through another Candle
    /// device (another stream), before anything is queued (see [`nccl_life::check_place`]).
    fn check_device(&self, op: &str, t: &Tensor) -> Result<()> {
        let Some(want) = place_of(&self.device)? else {
            return Ok(());
        };
        nccl_life::check_place(self.host.rank(), op, want, place_of(t.device())?)
    }

    /// The validated, contiguous input of `op` and its NCCL type.
    fn input(
        &self,
        op: &str,
        t: &Tensor,
        reduce: Option<ReduceOp>,
    ) -> Result<(Tensor, sys::ncclDataType_t)> {
        self.check_device(op, t)?;
        let ty = checked(op, t.dtype(), reduce)?;
        Ok((t.contiguous()?, ty))
    }

    /// One operation of one NCCL call from `input` into a new output of `call.out_len`
    /// elements, allocated by `prepare` after `input` is made (see [`run_n`](Self::run_n)).
    fn one_call(
        &self,
        call: Call,
        prepare: impl FnOnce() -> Result<(Tensor, sys::ncclDataType_t)>,
    ) -> Result<Tensor> {
        let world = self.world_size();
        let (_, _, out) = self.run_n(
            call.name(),
            1,
            || {
                let (input, ty) = prepare()?;
                let len = call.out_len(input.elem_count(), world).ok_or_else(|| {
                    nccl_err(
                        self.rank(),
                        call.name(),
                        "the input does not split into equal blocks",
                    )
                })?;
                let out = alloc_output(&input, len)?;
                Ok((input, ty, out))
            },
            |comm, (input, ty, out)| queue(comm, call, *ty, world, input, out),
        )?;
        Ok(out)
    }
}

/// Where `device`'s work runs, for a CUDA device.
fn place_of(device: &Device) -> Result<Option<StreamPlace>> {
    match device.location() {
        DeviceLocation::Cuda { gpu_id } => Ok(Some(StreamPlace {
            ordinal: gpu_id,
            stream: device.as_cuda_device()?.cuda_stream().cu_stream() as usize,
        })),
        _ => Ok(None),
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
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        self.host.reduce_scatter(buf, op)
    }
    fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
        self.host.all_gather_into(buf)
    }
    fn check_peers(&self) -> Result<()> {
        self.host.check_peers()
    }
    fn set_run_outcome(&self, finished: bool) {
        *self.outcome.lock().unwrap_or_else(|p| p.into_inner()) = Some(finished);
    }
    fn add_gate(&self, gate: Weak<dyn Gate>) {
        self.gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(gate);
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
        let (world, call) = (self.world_size(), Call::AllReduce(nccl_op(op)));
        // Everything checked and every output allocated before anything is queued; then one
        // NCCL group, queued back to back on the stream, one wait for all of them.
        let prepared = self.run_n(
            "all_reduce",
            ts.len() as u64,
            || {
                let mut v = Vec::with_capacity(ts.len());
                for t in ts {
                    let (input, ty) = self.input("all_reduce", t, Some(op))?;
                    let out = alloc_output(&input, input.elem_count())?.reshape(t.shape())?;
                    v.push((input, ty, out));
                }
                Ok(v)
            },
            |comm, prepared| {
                nccl::group_start()
                    .map_err(|e| nccl_err(comm.rank, "all_reduce (group start)", e.0))?;
                let queued = prepared
                    .iter()
                    .try_for_each(|(input, ty, out)| queue(comm, call, *ty, world, input, out));
                // Always ended, whatever happened inside.
                let ended = nccl::group_end()
                    .map(|_| ())
                    .map_err(|e| nccl_err(comm.rank, "all_reduce (group end)", e.0));
                queued.and(ended)
            },
        )?;
        Ok(prepared.into_iter().map(|(_, _, out)| out).collect())
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        crate::collective::check_root(root, self.world_size(), self.rank())?;
        if self.skip() {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.broadcast_tensor(t, root);
        }
        let root =
            i32::try_from(root).map_err(|_| Error::invalid("broadcast root", "too large"))?;
        let out = self.one_call(Call::Broadcast(root), || self.input("broadcast", t, None))?;
        Ok(out.reshape(t.shape())?)
    }

    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (world, len) = (self.world_size(), t.elem_count());
        if self.skip() {
            return Ok(t.flatten_all()?);
        }
        if !t.device().is_cuda() || len == 0 {
            return self.host.reduce_scatter_tensor(t, op);
        }
        let out = self.one_call(Call::ReduceScatter(nccl_op(op)), || {
            let (input, ty) = self.input("reduce_scatter", t, Some(op))?;
            let padded = padded_blocks(&input.flatten_all()?, world, len.div_ceil(world))?;
            Ok((padded, ty))
        })?;
        let own = crate::collective::chunk_range(len, world, self.rank());
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
        let block = len.div_ceil(world);
        let own = crate::collective::chunk_range(len, world, self.rank());
        let gathered = self.one_call(Call::AllGather, || {
            let (input, ty) = self.input("all_gather_into", t, None)?;
            let mine = input.flatten_all()?.narrow(0, own.start, own.len())?;
            let mine = if own.len() < block {
                let pad = Tensor::zeros(block - own.len(), t.dtype(), t.device())?;
                Tensor::cat(&[mine, pad], 0)?
            } else {
                mine
            };
            Ok((mine.contiguous()?, ty))
        })?;
        let parts = (0..world)
            .map(|r| {
                gathered.narrow(
                    0,
                    r * block,
                    crate::collective::chunk_range(len, world, r).len(),
                )
            })
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
        checked("all_gather", t.dtype(), None)?;
        // NCCL gathers equal sizes: agree on every rank's row count (host side, which also
        // checks dtype and trailing dims), pad to the largest, gather, then drop the padding.
        let rows = t.dim(0)?;
        let counts = crate::collective::agree_on_rows(self.host.as_ref(), t)?;
        let max = counts.iter().copied().max().unwrap_or(0);
        let mut dims = t.dims().to_vec();
        let gathered = self.one_call(Call::AllGather, || {
            let (input, ty) = self.input("all_gather", t, None)?;
            let padded = if rows < max {
                let mut pad = dims.clone();
                pad[0] = max - rows;
                let zeros = Tensor::zeros(pad, t.dtype(), t.device())?;
                Tensor::cat(&[input, zeros], 0)?.contiguous()?
            } else {
                input
            };
            Ok((padded, ty))
        })?;
        // Each rank's block holds `max` rows of `row` elements.
        let row: usize = dims[1..].iter().product();
        let mut parts = Vec::with_capacity(counts.len());
        for (r, &k) in counts.iter().enumerate() {
            dims[0] = k;
            parts.push(
                gathered
                    .narrow(0, r * max * row, k * row)?
                    .reshape(dims.clone())?,
            );
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}
