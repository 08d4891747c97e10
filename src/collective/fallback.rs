//! The plain implementations of [`Collective`]'s operations, through host memory and the
//! backend's own buffer operations: what a backend without a better way names in its
//! implementation (one line each; the trait has no default bodies, see [`Collective`]).
//!
//! ```
//! use accelerate_rs::collective::{
//!     fallback, AlignedBytes, Buffer, BufferMut, Collective, Gate, OwnedBuffer,
//! };
//! use accelerate_rs::ReduceOp;
//! use candle_core::Tensor;
//! # use accelerate_rs::Result;
//! # use std::sync::Weak;
//! /// A backend of one rank that keeps everything in host memory.
//! #[derive(Debug)]
//! struct Alone;
//!
//! impl Collective for Alone {
//!     fn rank(&self) -> usize { 0 }
//!     fn world_size(&self) -> usize { 1 }
//!     fn backend(&self) -> &'static str { "alone" }
//!     fn all_reduce(&self, _: BufferMut<'_>, _: ReduceOp) -> Result<()> { Ok(()) }
//!     fn broadcast(&self, _: BufferMut<'_>, _: usize) -> Result<()> { Ok(()) }
//!     fn all_gather(&self, buf: Buffer<'_>) -> Result<Vec<OwnedBuffer>> {
//!         Ok(vec![OwnedBuffer::new(AlignedBytes::copy_from(buf.bytes()), buf.elem())])
//!     }
//!     fn barrier(&self) -> Result<()> { Ok(()) }
//!     fn reduce_scatter(&self, buf: BufferMut<'_>, op: ReduceOp) -> Result<()> {
//!         fallback::reduce_scatter(self, buf, op)
//!     }
//!     fn all_gather_into(&self, buf: BufferMut<'_>) -> Result<()> {
//!         fallback::all_gather_into(self, buf)
//!     }
//!     fn reduce_scatter_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
//!         fallback::reduce_scatter_tensor(self, t, op)
//!     }
//!     fn all_gather_into_tensor(&self, t: &Tensor) -> Result<Tensor> {
//!         fallback::all_gather_into_tensor(self, t)
//!     }
//!     fn check_peers(&self) -> Result<()> { Ok(()) }
//!     fn set_run_outcome(&self, _: bool) {}
//!     fn add_gate(&self, _: Weak<dyn Gate>) {}
//!     fn all_reduce_tensor(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
//!         fallback::all_reduce_tensor(self, t, op)
//!     }
//!     fn all_reduce_tensors(&self, ts: &[Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
//!         fallback::all_reduce_tensors(self, ts, op)
//!     }
//!     fn broadcast_tensor(&self, t: &Tensor, root: usize) -> Result<Tensor> {
//!         fallback::broadcast_tensor(self, t, root)
//!     }
//!     fn all_gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
//!         fallback::all_gather_tensor(self, t)
//!     }
//! }
//! # fn main() -> Result<()> {
//! let t = Tensor::new(&[1f32, 2.0], &candle_core::Device::Cpu)?;
//! assert_eq!(Alone.all_reduce_tensor(&t, ReduceOp::Sum)?.to_vec1::<f32>()?, [1.0, 2.0]);
//! # Ok(())
//! # }
//! ```

use candle_core::Tensor;

use super::{
    agree_on_rows, chunk_range, tensor_from_bytes, Buffer, BufferMut, Collective, ElemType,
    HostVec, OwnedBuffer, ReduceOp,
};
use crate::error::{Error, Result};

/// [`Collective::reduce_scatter`] as a whole [`all_reduce`](Collective::all_reduce) (every
/// rank's chunk is then right, and so is the rest).
pub fn reduce_scatter<C: Collective + ?Sized>(
    c: &C,
    buf: BufferMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    c.all_reduce(buf, op)
}

/// [`Collective::all_gather_into`] through [`all_gather`](Collective::all_gather) of this
/// rank's chunk.
pub fn all_gather_into<C: Collective + ?Sized>(c: &C, mut buf: BufferMut<'_>) -> Result<()> {
    let (n, me, len) = (c.world_size(), c.rank(), buf.len());
    if n == 1 {
        return Ok(());
    }
    let elem = buf.elem();
    let esize = elem.size();
    let mine = chunk_range(len, n, me);
    let bytes = buf.bytes_mut();
    let parts = c.all_gather(Buffer::raw(
        &bytes[mine.start * esize..mine.end * esize],
        elem,
    ))?;
    fill_from_chunks(me, bytes, esize, &parts)
}

/// [`Collective::reduce_scatter_tensor`] through host memory and
/// [`reduce_scatter`](Collective::reduce_scatter).
pub fn reduce_scatter_tensor<C: Collective + ?Sized>(
    c: &C,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    let (n, me, len) = (c.world_size(), c.rank(), t.elem_count());
    if n == 1 {
        return Ok(t.flatten_all()?);
    }
    let own = chunk_range(len, n, me);
    let mut host = HostVec::from_tensor(t, "reduce_scatter")?;
    c.reduce_scatter(host.as_buffer_mut(), op)?;
    Ok(host
        .into_tensor(len, t.device())?
        .narrow(0, own.start, own.len())?)
}

/// [`Collective::all_gather_into_tensor`] through host memory and
/// [`all_gather_into`](Collective::all_gather_into).
pub fn all_gather_into_tensor<C: Collective + ?Sized>(c: &C, t: &Tensor) -> Result<Tensor> {
    if c.world_size() == 1 {
        return Ok(t.flatten_all()?);
    }
    let mut host = HostVec::from_tensor(t, "all_gather_into")?;
    c.all_gather_into(host.as_buffer_mut())?;
    host.into_tensor(t.elem_count(), t.device())
}

/// [`Collective::all_reduce_tensor`] through host memory and
/// [`all_reduce`](Collective::all_reduce).
pub fn all_reduce_tensor<C: Collective + ?Sized>(
    c: &C,
    t: &Tensor,
    op: ReduceOp,
) -> Result<Tensor> {
    if c.world_size() == 1 {
        return Ok(t.clone());
    }
    let mut host = HostVec::from_tensor(t, "all_reduce")?;
    c.all_reduce(host.as_buffer_mut(), op)?;
    host.into_tensor(t.shape().clone(), t.device())
}

/// [`Collective::all_reduce_tensors`] one tensor at a time, through
/// [`all_reduce_tensor`](Collective::all_reduce_tensor).
pub fn all_reduce_tensors<C: Collective + ?Sized>(
    c: &C,
    ts: &[Tensor],
    op: ReduceOp,
) -> Result<Vec<Tensor>> {
    ts.iter().map(|t| c.all_reduce_tensor(t, op)).collect()
}

/// [`Collective::broadcast_tensor`] through host memory and
/// [`broadcast`](Collective::broadcast).
pub fn broadcast_tensor<C: Collective + ?Sized>(c: &C, t: &Tensor, root: usize) -> Result<Tensor> {
    if c.world_size() == 1 {
        return Ok(t.clone());
    }
    let mut host = HostVec::from_tensor(t, "broadcast")?;
    c.broadcast(host.as_buffer_mut(), root)?;
    host.into_tensor(t.shape().clone(), t.device())
}

/// [`Collective::all_gather_tensor`] through host memory: shapes first (checked), then the data
/// with [`all_gather`](Collective::all_gather), concatenated on dim 0.
pub fn all_gather_tensor<C: Collective + ?Sized>(c: &C, t: &Tensor) -> Result<Tensor> {
    if c.world_size() == 1 {
        return Ok(t.clone());
    }
    gather_tensor_via_host(c, t)
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
