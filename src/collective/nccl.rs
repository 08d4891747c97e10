//! NCCL collectives on GPU tensors (build with the `cuda` feature; `nccl_stub.rs` stands in
//! otherwise).
//!
//! An [`NcclCollective`] pairs one NCCL communicator with a host collective: the TCP ring for DDP
//! (one process per GPU) or a thread group for DP (one process, one thread per GPU). The host
//! collective carries the NCCL unique id, the small host-side operations (parameter metadata,
//! flags) and the liveness checks; tensors on the GPU go through NCCL on the device's own stream,
//! without a host round trip.
//!
//! NCCL calls are asynchronous and a dead peer can leave them spinning forever, so every
//! operation is followed by a watchdog: it polls an event recorded after the operation, checks
//! that the host collective's peers are still alive, and past the timeout aborts the
//! communicator and returns an error naming the operation, the rank and the peer.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, InplaceOp1, Layout, Shape, Tensor};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use super::{
    Buffer, BufferMut, Collective, OwnedBuffer, ReduceOp, TcpCollective, TcpOptions, ThreadGroup,
};
use crate::error::{Error, Result};

/// An NCCL communicator that may move between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as no two calls on it run at
// the same time; every use of the wrapped `Comm` goes through the `Mutex` in `NcclCollective`.
unsafe impl Send for SendComm {}

/// One rank of an NCCL group; see the module docs.
pub struct NcclCollective {
    host: Arc<dyn Collective>,
    comm: Mutex<Option<SendComm>>,
    broken: Mutex<Option<String>>,
    device: Device,
    timeout: Duration,
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

fn nccl_err(rank: usize, op: &str, what: impl std::fmt::Debug) -> Error {
    Error::Peer {
        rank,
        peer: rank,
        op: op.into(),
        reason: format!("NCCL error: {what:?}"),
        source: None,
    }
}

fn stream_of(device: &Device) -> Result<Arc<cudarc::driver::CudaStream>> {
    Ok(device.as_cuda_device()?.cuda_stream())
}

impl NcclCollective {
    /// DDP: joins the TCP group described by `opts` (host operations, the NCCL unique id) and
    /// creates this rank's NCCL communicator on `device`'s stream.
    pub fn connect(opts: &TcpOptions, device: &Device) -> Result<Self> {
        let host = TcpCollective::connect(opts)?;
        let rank = opts.rank;
        let mut id_bytes = [0u8; 128];
        if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err(rank, "nccl unique id", e))?;
            for (b, c) in id_bytes.iter_mut().zip(id.internal()) {
                *b = *c as u8;
            }
        }
        host.broadcast(BufferMut::from(&mut id_bytes[..]), 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(id_bytes) {
            *c = b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(
            stream_of(device)?,
            rank,
            opts.world_size,
            Id::uninit(internal),
        )
        .map_err(|e| nccl_err(rank, "nccl init", e))?;
        Ok(NcclCollective {
            host: Arc::new(host),
            comm: Mutex::new(Some(SendComm(comm))),
            broken: Mutex::new(None),
            device: device.clone(),
            timeout: opts.timeout,
        })
    }

    /// DP: one communicator per GPU ordinal of this process (rank i drives `ordinals[i]`), each
    /// paired with a thread-group rank for host operations. Returns each rank's device and
    /// collective; move each into its own thread.
    pub fn group(ordinals: &[usize], timeout: Duration) -> Result<Vec<(Device, NcclCollective)>> {
        let devices: Vec<Device> = ordinals
            .iter()
            .map(|&o| crate::gpu::device(o))
            .collect::<Result<_>>()?;
        let streams = devices.iter().map(stream_of).collect::<Result<Vec<_>>>()?;
        let comms = Comm::from_devices(streams).map_err(|e| nccl_err(0, "nccl init", e))?;
        let hosts = ThreadGroup::new(ordinals.len(), timeout)?;
        Ok(devices
            .into_iter()
            .zip(comms)
            .zip(hosts)
            .map(|((device, comm), host)| {
                let c = NcclCollective {
                    host: Arc::new(host),
                    comm: Mutex::new(Some(SendComm(comm))),
                    broken: Mutex::new(None),
                    device: device.clone(),
                    timeout,
                };
                (device, c)
            })
            .collect())
    }

    /// The GPU this rank drives.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn broken_guard(&self) -> MutexGuard<'_, Option<String>> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enqueues `enqueue` on the communicator, then waits for it with the watchdog.
    fn run(&self, op: &str, enqueue: impl FnOnce(&Comm) -> Result<()>) -> Result<()> {
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
            Some(SendComm(comm)) => enqueue(comm).and_then(|()| self.watch(op, comm)),
            None => Err(Error::Broken {
                rank,
                op: op.into(),
                first: "the NCCL communicator was aborted".into(),
            }),
        };
        if let Err(e) = &res {
            // Dropping the communicator aborts it, which unblocks NCCL kernels still waiting
            // for a peer that will never come.
            guard.take();
            self.broken_guard().get_or_insert_with(|| e.to_string());
        }
        res
    }

    fn watch(&self, op: &str, comm: &Comm) -> Result<()> {
        let rank = self.host.rank();
        let event = comm
            .stream()
            .record_event(None)
            .map_err(|e| nccl_err(rank, op, e))?;
        let start = Instant::now();
        let deadline = start + self.timeout;
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
            if now >= deadline {
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

/// In-place all-reduce of a contiguous CUDA tensor.
struct AllReduce<'a> {
    comm: &'a Comm,
    op: ReduceOp,
}

/// In-place broadcast of a contiguous CUDA tensor.
struct Broadcast<'a> {
    comm: &'a Comm,
    root: usize,
}

/// All-gather of equal-sized contiguous CUDA tensors into a new `[world * n]` tensor.
struct AllGather<'a> {
    comm: &'a Comm,
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Mean => NcclOp::Avg,
        ReduceOp::Max => NcclOp::Max,
    }
}

fn cpu_refused(name: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("{name}: NCCL operations need CUDA tensors"))
}

fn contiguous(l: &Layout, name: &str) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{name}: tensor is not contiguous")))
}

fn wrap(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL: {e:?}"))
}

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
            other => Err(candle_core::Error::Msg(format!(
                "{}: unsupported dtype {other:?}",
                $name
            ))),
        }
    };
}

impl InplaceOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = contiguous(l, self.name())?;
        let op = nccl_op(self.op);
        per_dtype!(s.dtype(), self.name(), |T| {
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            self.comm
                .all_reduce_in_place(&mut view, &op)
                .map(|_| ())
                .map_err(wrap)
        })
    }
}

impl InplaceOp1 for Broadcast<'_> {
    fn name(&self) -> &'static str {
        "nccl-broadcast"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(cpu_refused(self.name()))
    }
    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = contiguous(l, self.name())?;
        let root = self.root as i32;
        per_dtype!(s.dtype(), self.name(), |T| {
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            self.comm
                .broadcast_in_place(&mut view, root)
                .map(|_| ())
                .map_err(wrap)
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
        let world = self.comm.world_size();
        let out_len = (b - a) * world;
        let dev = s.device.clone();
        per_dtype!(s.dtype(), self.name(), |T| {
            let src = s.as_cuda_slice::<T>()?.slice(a..b);
            let mut dst = dev.alloc_zeros::<T>(out_len)?;
            self.comm.all_gather(&src, &mut dst).map_err(wrap)?;
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
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.all_reduce_tensor(t, op);
        }
        super::check_reducible(
            super::ElemType::from_dtype(t.dtype()).ok_or_else(|| Error::UnsupportedDType {
                op: "all_reduce".into(),
                dtype: format!("{:?}", t.dtype()),
            })?,
            op,
        )?;
        // A private contiguous copy: the caller's tensor is never modified.
        let out = t.contiguous()?.copy()?;
        self.run("all_reduce", |comm| {
            Ok(out.inplace_op1(&AllReduce { comm, op })?)
        })?;
        Ok(out)
    }

    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        super::check_root(root, self.world_size(), self.rank())?;
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() {
            return self.host.broadcast_tensor(t, root);
        }
        let out = t.contiguous()?.copy()?;
        self.run("broadcast", |comm| {
            Ok(out.inplace_op1(&Broadcast { comm, root })?)
        })?;
        Ok(out)
    }

    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        if !t.device().is_cuda() || t.rank() == 0 {
            return self.host.all_gather_tensor(t);
        }
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
        let mut gathered = None;
        self.run("all_gather", |comm| {
            gathered = Some(padded.apply_op1_no_bwd(&AllGather { comm })?);
            Ok(())
        })?;
        let gathered = gathered.ok_or_else(|| nccl_err(self.rank(), "all_gather", "no output"))?;
        dims[0] = max;
        let per_rank: usize = dims.iter().product();
        let mut parts = Vec::with_capacity(counts.len());
        for (r, &k) in counts.iter().enumerate() {
            let mut d = dims.clone();
            d[0] = k;
            let row = per_rank / max.max(1);
            parts.push(gathered.narrow(0, r * per_rank, k * row)?.reshape(d)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}
