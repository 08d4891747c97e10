//! The [`Collective`] trait every backend implements, the [`Gate`] a batch-size search hands
//! the backends, and the arithmetic and checks the backends share (chunk ranges, roots, the
//! agreement on row counts).

use std::sync::Weak;

use candle_core::Tensor;

use super::buffer::{Buffer, BufferMut, ElemType, OwnedBuffer};
use super::reduce::ReduceOp;
use crate::error::{Error, Result};

/// Collective operations among the ranks of one run.
///
/// All ranks must call the same operations in the same order with matching sizes and element
/// types; a mismatch is detected and reported as [`Error::Mismatch`] rather than corrupting data.
/// Implementations short-circuit when [`world_size`](Collective::world_size) is 1.
///
/// **No method has a default body**, on purpose. A backend states, method by method, what it
/// does: its own implementation, or one of [`fallback`](super::fallback)'s (the host-memory path, one line).
/// A *wrapper* of another collective (the batch-size search's `ProbedCollective`, a user's
/// counting or logging wrapper) must forward every method, or the wrapped backend's override is
/// silently lost: a default body would have run the host path instead (this is how the batched
/// NCCL all-reduce once fell back to one NCCL group and one host wait per bucket). Without
/// defaults, a method added to the trait is a compile error in every backend and every wrapper
/// until each says what it does, which is stronger than any test; [`forwarding::check_wrapper`](super::forwarding::check_wrapper)
/// then checks at test time that a wrapper's methods reach the wrapped collective's own ones
/// (and that its list of methods is this trait's).
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
    /// [`all_reduce`](Collective::all_reduce) does. [`fallback::reduce_scatter`](super::fallback::reduce_scatter) is an
    /// `all_reduce`.
    fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()>;

    /// The inverse of [`reduce_scatter`](Collective::reduce_scatter), into a preallocated buffer:
    /// each rank's chunk [`chunk_range`]`(buf.len(), world_size, rank)` of `buf` is its
    /// contribution, and on return every rank's `buf` holds every rank's chunk. Every rank
    /// passes the same length (ZeRO: each rank updated its slice of the flat parameters).
    /// [`fallback::all_gather_into`](super::fallback::all_gather_into) goes through [`all_gather`](Collective::all_gather).
    fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()>;

    /// [`reduce_scatter`](Collective::reduce_scatter) on a tensor: returns, as a 1-D tensor on
    /// `t`'s device, this rank's chunk [`chunk_range`]`(t.elem_count(), world_size, rank)` of the
    /// element-wise reduction of the flattened `t` over every rank (ZeRO stage 2 on GPU
    /// tensors). Every rank passes the same number of elements. NCCL reduces on the GPU
    /// (`ncclReduceScatter`); [`fallback::reduce_scatter_tensor`](super::fallback::reduce_scatter_tensor) goes through host memory.
    fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// [`all_gather_into`](Collective::all_gather_into) on a tensor: chunk
    /// [`chunk_range`]`(t.elem_count(), world_size, rank)` of the flattened `t` is this rank's
    /// contribution; returns a 1-D tensor on `t`'s device holding every rank's chunk (ZeRO on
    /// GPU tensors, after each rank updated its slice). Every rank passes the same number of
    /// elements. NCCL gathers on the GPU (`ncclAllGather`); [`fallback::all_gather_into_tensor`](super::fallback::all_gather_into_tensor)
    /// goes through host memory.
    fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor>;

    /// Checks, without blocking, that the peers this rank talks to are still there (used by
    /// backends whose device operations cannot notice a dead peer themselves). Backends without
    /// peers to watch return `Ok(())`.
    fn check_peers(&self) -> Result<()>;

    /// Tells the collective how the run ended on this rank, before its last handle is dropped:
    /// `true` when it finished, `false` after an error.
    /// [`AcceleratorBuilder::run`](crate::AcceleratorBuilder::run) tells it. Backends that must
    /// be closed in step with the other ranks use it: NCCL closes a finished run together with
    /// the other ranks (barrier, finalize, destroy) and aborts after an error. Every other
    /// backend ignores it.
    fn set_run_outcome(&self, finished: bool);

    /// Adds a [`Gate`] this collective passes, on every rank, between preparing an operation
    /// (allocating its device buffers) and starting to communicate. Every accelerator built on
    /// the collective adds its batch-size search's, so that running out of device memory inside
    /// a collective is agreed on like anywhere else. Gates are held weakly (one that is gone is
    /// forgotten) and passed newest first, the order in which accelerators built on one another
    /// agree before a collective. Backends whose operations allocate no device memory before
    /// communicating (every one but NCCL) ignore them.
    fn add_gate(&self, gate: Weak<dyn Gate>);

    /// [`all_reduce`](Collective::all_reduce) on a tensor; returns a new tensor of the same shape
    /// on the same device. Backends with device memory (NCCL) implement it without host copies;
    /// [`fallback::all_reduce_tensor`](super::fallback::all_reduce_tensor) goes through host memory.
    fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// [`all_reduce_tensor`](Collective::all_reduce_tensor) of several tensors, in order, as one
    /// batch: backends with device memory (NCCL) queue them all back to back and wait once. Every
    /// rank must pass the same number of tensors with matching sizes and dtypes.
    /// [`fallback::all_reduce_tensors`](super::fallback::all_reduce_tensors) reduces them one by one.
    fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>>;

    /// [`broadcast`](Collective::broadcast) on a tensor: returns `root`'s tensor on every rank.
    fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Concatenates every rank's tensor along dim 0, in rank order. The first dimension may differ
    /// between ranks; the other dimensions and the dtype must match (the error lists every rank's
    /// shape otherwise).
    fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor>;
}

/// What a collective asks, on every rank, after it prepared an operation (its device buffers
/// allocated) and before it starts communicating: see [`Collective::add_gate`].
///
/// An allocation that fails inside a collective would otherwise leave the peers waiting in the
/// collective for a rank that will never join it. Passing the gate is the moment every rank can
/// still agree to abandon the operation: nothing has been sent yet.
pub trait Gate: Send + Sync {
    /// `failure` is this rank's failed preparation (typically [`Error::OutOfMemory`]), `None` when
    /// it is ready. Returns `Ok(())` to go on, or the error to return instead of communicating;
    /// the decision must be the same on every rank (a gate that agrees with the other ranks
    /// communicates over the host, never through the gated operation). With `failure` set the
    /// collective returns that failure whatever the gate returns.
    fn pass(&self, op: &str, failure: Option<&Error>) -> Result<()>;
}

/// The elements of a flat buffer of `len` elements that rank `rank` of `world` owns in
/// [`Collective::reduce_scatter`] and [`Collective::all_gather_into`]: contiguous, in rank order,
/// sizes differing by at most one (rank `r` starts at `r * len / world`, rounded down). Also how
/// ZeRO-style sharding splits the flat parameters.
pub fn chunk_range(len: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    let bound = |i: usize| (i as u128 * len as u128 / world.max(1) as u128) as usize;
    bound(rank.min(world))..bound((rank + 1).min(world))
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
