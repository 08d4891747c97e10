//! Collective communication: one [`Collective`] trait, several backends.
//!
//! | backend | when | file |
//! |---|---|---|
//! | [`SingleProcess`] | world size 1: every call returns at once, no socket is opened | `single.rs` |
//! | [`TcpCollective`] | several processes (one or many machines): rendezvous store + ring over TCP; `all_reduce` and `broadcast` through shared memory when all ranks share a host | `tcp/` |
//! | [`ThreadGroup`] | several ranks as threads of one process (tests, DP over CPU replicas) | `threads.rs` |
//! | [`MpiCollective`] | CPU clusters started by `mpirun` / `srun --mpi` (transport `mpi`, or `auto` under an MPI launcher); needs the `mpi` feature | `mpi.rs` (`mpi_stub.rs` without it) |
//! | [`NcclCollective`] | GPU tensors: DDP (one process per GPU) and DP (one thread per GPU); needs the `cuda` feature | `nccl.rs` (`nccl_stub.rs` without it) |
//!
//! Every operation has a timeout, and every backend fails (never hangs) when a peer disappears,
//! naming the operation, its own rank and the peer.
//!
//! ```
//! use accelerate_rs::collective::{Collective, ThreadGroup};
//! use accelerate_rs::ReduceOp;
//! # fn main() -> accelerate_rs::Result<()> {
//! let ranks = ThreadGroup::new(3, std::time::Duration::from_secs(10))?;
//! let handles: Vec<_> = ranks
//!     .into_iter()
//!     .map(|c| {
//!         std::thread::spawn(move || {
//!             let mut v = vec![c.rank() as f32; 4];
//!             c.all_reduce((&mut v[..]).into(), ReduceOp::Sum).map(|_| v)
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.join().unwrap()?, vec![3.0; 4]); // 0 + 1 + 2
//! }
//! # Ok(())
//! # }
//! ```

/// `Collective` for a stub backend's type (a build without its feature), which holds a
/// `never: Infallible` field: no value exists, so no method can run. Unused in a build with every
/// backend.
#[allow(unused_macros)]
macro_rules! uninhabited_collective {
    ($t:ty) => {
        impl Collective for $t {
            fn rank(&self) -> usize {
                match self.never {}
            }
            fn world_size(&self) -> usize {
                match self.never {}
            }
            fn backend(&self) -> &'static str {
                match self.never {}
            }
            fn all_reduce(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> {
                match self.never {}
            }
            fn broadcast(&self, _: BufferMut<'_>, _: usize) -> Result<()> {
                match self.never {}
            }
            fn all_gather(&self, _: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
                match self.never {}
            }
            fn barrier(&self) -> Result<()> {
                match self.never {}
            }
        }
    };
}

mod buffer;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(not(feature = "cuda"))]
#[path = "nccl_stub.rs"]
mod nccl;
// Used by nccl.rs (cuda builds only); compiled and tested in every build.
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(not(feature = "mpi"))]
#[path = "mpi_stub.rs"]
pub(crate) mod mpi;
#[allow(dead_code)]
mod nccl_dtype;
// The watchdog and close logic of NCCL communicators: used by nccl.rs (cuda builds only);
// compiled and tested (with fake communicators) in every build.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod nccl_life;
pub(crate) mod placement;
pub(crate) mod reduce;
mod single;
mod tcp;
mod threads;

use candle_core::Tensor;

pub use buffer::{AlignedBytes, Buffer, BufferMut, ElemType, Element, OwnedBuffer};
pub use mpi::MpiCollective;
pub use nccl::NcclCollective;
pub(crate) use reduce::ReduceOp;
pub use single::SingleProcess;
pub use tcp::{TcpCollective, TcpOptions};
pub use threads::{ThreadCollective, ThreadGroup};

pub(crate) use buffer::{tensor_from_bytes, HostVec};
pub(crate) use reduce::{check_reducible, finish_mean, reduce_into, reduce_last};

use crate::error::{Error, Result};

/// Collective operations among the ranks of one run.
///
/// All ranks must call the same operations in the same order with matching sizes and element
/// types; a mismatch is detected and reported as [`Error::Mismatch`] rather than corrupting data.
/// Implementations short-circuit when [`world_size`](Collective::world_size) is 1.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Backend name, for logs (`single`, `tcp`, `threads`, `nccl`).
    fn backend(&self) -> &'static str;

    /// Combines `buf` element-wise across ranks; every rank ends with the same result.
    fn all_reduce(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()>;
    /// Copies `root`'s `buf` into every other rank's `buf` (same length everywhere).
    fn broadcast(&self, buf: BufferMut<'_>, root: usize) -> Result<()>;
    /// Every rank's buffer, in rank order. Lengths may differ between ranks; element types may not.
    fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Reduces `buf` across ranks, keeping on each rank only its own chunk of the result: on
    /// return, elements [`chunk_range`]`(buf.len(), world_size, rank)` of `buf` hold the reduction
    /// of those elements over every rank; the rest of `buf` is unspecified. Every rank passes the
    /// same length. This is how ZeRO stage 2 keeps only its slice of the gradients; ring backends
    /// (TCP, shared memory, threads) move and add half of what an
    /// [`all_reduce`](Collective::all_reduce) does. The default is an `all_reduce`.
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
        self.all_reduce(buf, op)
    }

    /// The inverse of [`reduce_scatter`](Collective::reduce_scatter), into a preallocated buffer:
    /// each rank's chunk [`chunk_range`]`(buf.len(), world_size, rank)` of `buf` is its
    /// contribution, and on return every rank's `buf` holds every rank's chunk. Every rank
    /// passes the same length (ZeRO: each rank updated its slice of the flat parameters). The
    /// default goes through [`all_gather`](Collective::all_gather).
    fn all_gather_into(&self, mut buf: BufferMut<'_>) -> Result<()> {
        let (n, me, len) = (self.world_size(), self.rank(), buf.len());
        if n == 1 {
            return Ok(());
        }
        let elem = buf.elem();
        let esize = elem.size();
        let mine = chunk_range(len, n, me);
        let bytes = buf.bytes_mut();
        let parts = self.all_gather(Buffer::raw(
            &bytes[mine.start * esize..mine.end * esize],
            elem,
        ))?;
        fill_from_chunks(me, bytes, esize, &parts)
    }

    /// [`reduce_scatter`](Collective::reduce_scatter) on a tensor: returns, as a 1-D tensor on
    /// `t`'s device, this rank's chunk [`chunk_range`]`(t.elem_count(), world_size, rank)` of the
    /// element-wise reduction of the flattened `t` over every rank (ZeRO stage 2 on GPU
    /// tensors). Every rank passes the same number of elements. NCCL reduces on the GPU
    /// (`ncclReduceScatter`); the default goes through host memory.
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (n, me, len) = (self.world_size(), self.rank(), t.elem_count());
        if n == 1 {
            return Ok(t.flatten_all()?);
        }
        let own = chunk_range(len, n, me);
        let mut host = HostVec::from_tensor(t, "reduce_scatter")?;
        self.reduce_scatter(host.as_buffer_mut(), op)?;
        Ok(host
            .into_tensor(len, t.device())?
            .narrow(0, own.start, own.len())?)
    }

    /// [`all_gather_into`](Collective::all_gather_into) on a tensor: chunk
    /// [`chunk_range`]`(t.elem_count(), world_size, rank)` of the flattened `t` is this rank's
    /// contribution; returns a 1-D tensor on `t`'s device holding every rank's chunk (ZeRO on
    /// GPU tensors, after each rank updated its slice). Every rank passes the same number of
    /// elements. NCCL gathers on the GPU (`ncclAllGather`); the default goes through host
    /// memory.
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.flatten_all()?);
        }
        let mut host = HostVec::from_tensor(t, "all_gather_into")?;
        self.all_gather_into(host.as_buffer_mut())?;
        host.into_tensor(t.elem_count(), t.device())
    }

    /// Checks, without blocking, that the peers this rank talks to are still there (used by
    /// backends whose device operations cannot notice a dead peer themselves). The default has
    /// nothing to check.
    fn check_peers(&self) -> Result<()> {
        Ok(())
    }

    /// Tells the collective how the run ended on this rank, before its last handle is dropped:
    /// `true` when it finished, `false` after an error.
    /// [`AcceleratorBuilder::run`](crate::AcceleratorBuilder::run) tells it. Backends that must
    /// be closed in step with the other ranks use it: NCCL closes a finished run together with
    /// the other ranks (barrier, finalize, destroy) and aborts after an error. The default (every
    /// other backend) ignores it.
    fn set_run_outcome(&self, _finished: bool) {}

    /// [`all_reduce`](Collective::all_reduce) on a tensor; returns a new tensor of the same shape
    /// on the same device. Backends with device memory (NCCL) override this to avoid host copies.
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let mut host = HostVec::from_tensor(t, "all_reduce")?;
        self.all_reduce(host.as_buffer_mut(), op)?;
        host.into_tensor(t.shape().clone(), t.device())
    }

    /// [`all_reduce_tensor`](Collective::all_reduce_tensor) of several tensors, in order, as one
    /// batch: backends with device memory (NCCL) queue them all back to back and wait once. Every
    /// rank must pass the same number of tensors with matching sizes and dtypes. The default
    /// reduces them one by one.
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        ts.iter().map(|t| self.all_reduce_tensor(t, op)).collect()
    }

    /// [`broadcast`](Collective::broadcast) on a tensor: returns `root`'s tensor on every rank.
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        let mut host = HostVec::from_tensor(t, "broadcast")?;
        self.broadcast(host.as_buffer_mut(), root)?;
        host.into_tensor(t.shape().clone(), t.device())
    }

    /// Concatenates every rank's tensor along dim 0, in rank order. The first dimension may differ
    /// between ranks; the other dimensions and the dtype must match (the error lists every rank's
    /// shape otherwise).
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        if self.world_size() == 1 {
            return Ok(t.clone());
        }
        gather_tensor_via_host(self, t)
    }
}

/// The elements of a flat buffer of `len` elements that rank `rank` of `world` owns in
/// [`Collective::reduce_scatter`] and [`Collective::all_gather_into`]: contiguous, in rank order,
/// sizes differing by at most one (rank `r` starts at `r * len / world`, rounded down). Also how
/// ZeRO-style sharding splits the flat parameters.
pub fn chunk_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let bound = |i: usize| (i as u128 * len as u128 / world.max(1) as u128) as usize;
    bound(rank.min(world))..bound((rank + 1).min(world))
}

/// Writes every rank's chunk (`parts`, from an all-gather) into its place in `bytes`; a chunk
/// of the wrong length (ranks passed different lengths) is an [`Error::Mismatch`].
fn fill_from_chunks(
    rank: usize,
    bytes: &mut [u8],
    esize: usize,
    parts: &[OwnedBuffer],
) -> Result<()> {
    let (n, len) = (parts.len(), bytes.len() / esize.max(1));
    for (r, part) in parts.iter().enumerate() {
        let range = chunk_range(len, n, r);
        let want = range.len() * esize;
        if part.bytes().len() != want {
            return Err(Error::Mismatch {
                rank,
                op: "all_gather_into".into(),
                detail: format!(
                    "rank {rank} expected {} element(s) from rank {r} (a buffer of {len} over {n} ranks), got {}; every rank must pass the same length",
                    range.len(),
                    part.bytes().len() / esize.max(1)
                ),
            });
        }
        bytes[range.start * esize..range.end * esize].copy_from_slice(part.bytes());
    }
    Ok(())
}

/// Gathers every rank's dtype and dims and checks that the dtype and all dims but the first agree
/// (the error lists every rank's shape otherwise). Returns each rank's first dim, in rank order.
pub(crate) fn agree_on_rows<C: Collective + ?Sized>(c: &C, t: &Tensor) -> Result<Vec<usize>> {
    let elem = ElemType::from_dtype(t.dtype()).ok_or_else(|| Error::UnsupportedDType {
        op: "all_gather".into(),
        dtype: format!("{:?}", t.dtype()),
    })?;
    if t.rank() == 0 {
        return Err(Error::invalid(
            "all_gather tensor",
            "a scalar has no dim 0 to concatenate along; reshape it to [1]",
        ));
    }
    let mut meta: Vec<u8> = vec![elem.code()];
    for d in t.dims() {
        meta.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    let metas = c.all_gather(Buffer::from(&meta[..]))?;
    let dims_of = |m: &[u8]| -> Vec<u64> {
        m.get(1..)
            .unwrap_or(&[])
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
            .collect()
    };
    let consistent = metas.iter().all(|m| {
        let b = m.bytes();
        b.len() == meta.len() && b[0] == meta[0] && b.get(9..) == meta.get(9..)
    });
    if !consistent {
        let all: Vec<String> = metas
            .iter()
            .enumerate()
            .map(|(r, m)| {
                let ty = ALL_ELEMS
                    .into_iter()
                    .find(|e| Some(&e.code()) == m.bytes().first())
                    .map_or("?", |e| e.name());
                format!("rank {r}: {ty}{:?}", dims_of(m.bytes()))
            })
            .collect();
        return Err(Error::Mismatch {
            rank: c.rank(),
            op: "all_gather".into(),
            detail: format!(
                "tensors must share dtype and all dims but the first; got {}",
                all.join(", ")
            ),
        });
    }
    Ok(metas
        .iter()
        .map(|m| dims_of(m.bytes()).first().copied().unwrap_or(0) as usize)
        .collect())
}

const ALL_ELEMS: [ElemType; 5] = [
    ElemType::U8,
    ElemType::F16,
    ElemType::BF16,
    ElemType::F32,
    ElemType::F64,
];

/// The host path of `all_gather_tensor`: shapes first, then the data, concatenated on dim 0.
fn gather_tensor_via_host<C: Collective + ?Sized>(c: &C, t: &Tensor) -> Result<Tensor> {
    let rows: usize = agree_on_rows(c, t)?.iter().sum();
    let elem = ElemType::from_dtype(t.dtype()).ok_or_else(|| Error::UnsupportedDType {
        op: "all_gather".into(),
        dtype: format!("{:?}", t.dtype()),
    })?;
    let mut host = HostVec::from_tensor(t, "all_gather")?;
    let parts = c.all_gather(host.as_buffer_mut().as_buffer())?;
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.bytes().len()).sum());
    for p in &parts {
        bytes.extend_from_slice(p.bytes());
    }
    let mut dims = t.dims().to_vec();
    dims[0] = rows;
    tensor_from_bytes(&bytes, elem, dims, t.device())
}

/// Checks the `root` argument of a broadcast.
pub(crate) fn check_root(root: usize, world_size: usize, rank: usize) -> Result<()> {
    if root >= world_size {
        return Err(Error::invalid(
            "broadcast root",
            format!("rank {rank}: root {root} is not a rank of a world of size {world_size}"),
        ));
    }
    Ok(())
}
