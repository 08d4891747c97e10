//! The NCCL calls on CUDA storage, in two steps so that nothing is allocated once NCCL is
//! entered: [`alloc_output`] makes an operation's output tensor (uninitialised) before anything
//! is queued, and [`queue`] queues one NCCL call from a contiguous input tensor into it on the
//! communicator's stream. Running out of memory is then an ordinary error of the first step,
//! not a failure inside an NCCL group that would leave the communicator unusable.

use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::comm::{nccl_err, RawComm};
use crate::collective::ReduceOp;
use crate::error::{Error, Result};
use crate::inplace::{with_mut_src, DstMut, Src};

/// What one NCCL call does, queued on the communicator's stream from an input of `n` elements
/// into an output of [`Call::out_len`] elements.
#[derive(Clone, Copy)]
pub(super) enum Call {
    /// Out-of-place all-reduce: the output has the input's length.
    AllReduce(sys::ncclRedOp_t),
    /// Out-of-place broadcast from a root: the output has the input's length.
    Broadcast(i32),
    /// Reduce-scatter of `world` equal blocks: the output is one block.
    ReduceScatter(sys::ncclRedOp_t),
    /// All-gather of equal inputs: the output is `world` of them.
    AllGather,
}

impl Call {
    /// The operation's name in errors.
    pub(super) fn name(self) -> &'static str {
        match self {
            Call::AllReduce(_) => "all_reduce",
            Call::Broadcast(_) => "broadcast",
            Call::ReduceScatter(_) => "reduce_scatter",
            Call::AllGather => "all_gather",
        }
    }

    /// The output's length for an input of `n` elements over `world` ranks; `None` when the
    /// input does not split into `world` equal blocks (reduce-scatter).
    pub(super) fn out_len(self, n: usize, world: usize) -> Option<usize> {
        match self {
            Call::AllReduce(_) | Call::Broadcast(_) => Some(n),
            Call::ReduceScatter(_) => (world > 0 && n.is_multiple_of(world)).then(|| n / world),
            Call::AllGather => n.checked_mul(world),
        }
    }
}

/// `flat` (1-D, `len` elements) cut into the ranks' chunks ([`crate::collective::chunk_range`]), each
/// padded with zeros to `block` elements and laid end to end: the equal-sized blocks NCCL's
/// reduce-scatter and all-gather move.
pub(super) fn padded_blocks(flat: &Tensor, world: usize, block: usize) -> Result<Tensor> {
    let len = flat.elem_count();
    if len == world * block {
        // Equal chunks already (floor bounds of a multiple of `world`).
        return Ok(flat.contiguous()?);
    }
    let mut parts = Vec::with_capacity(2 * world);
    for r in 0..world {
        let own = crate::collective::chunk_range(len, world, r);
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

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// Runs `$body` with `$t` the Rust element type of `$dtype` (only the dtypes `nccl_dtype`
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
            other => Err(Error::UnsupportedDType {
                op: format!("{} over NCCL", $name),
                dtype: format!("{other:?}"),
            }),
        }
    };
}

/// Allocates the uninitialised output of one NCCL call: a 1-D tensor of `len` elements of
/// `like`'s dtype on `like`'s device (stream-ordered on that device's stream, where NCCL then
/// writes it). Running out of memory is an [`Error::OutOfMemory`] here, before anything is
/// queued.
pub(super) fn alloc_output(like: &Tensor, len: usize) -> Result<Tensor> {
    Ok(like.apply_op1_no_bwd(&Uninit { len })?)
}

/// The Candle op behind [`alloc_output`].
struct Uninit {
    len: usize,
}

impl CustomOp1 for Uninit {
    fn name(&self) -> &'static str {
        "nccl-output"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "nccl-output: NCCL operations need CUDA tensors".into(),
        ))
    }
    fn cuda_fwd(&self, s: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device.clone();
        let len = self.len;
        let storage = per_dtype!(s.dtype(), self.name(), |T| {
            // SAFETY: the memory is read only after the NCCL call queued into it (by `queue`,
            // before the tensor is handed out) wrote all `len` elements; when that call is not
            // queued (an error), the tensor is dropped unread.
            let dst = unsafe { dev.alloc::<T>(len)? };
            Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
        })
        .map_err(candle_core::Error::wrap)?;
        Ok((storage, Shape::from(len)))
    }
}

/// Queues `call` on `comm`'s stream from `input` into `out` ([`alloc_output`] of
/// [`Call::out_len`] elements), both contiguous CUDA tensors of the communicator's GPU and of
/// NCCL type `ty`. Allocates nothing.
pub(super) fn queue(
    comm: &RawComm,
    call: Call,
    ty: sys::ncclDataType_t,
    world: usize,
    input: &Tensor,
    out: &Tensor,
) -> Result<()> {
    let name = call.name();
    with_mut_src(out, input, name, |dst, dr, src, sr| {
        let (DstMut::Cuda(d), Src::Cuda(s)) = (dst, src) else {
            return Err(nccl_err(
                comm.rank,
                name,
                "NCCL operations need CUDA tensors",
            ));
        };
        let n = sr.len();
        if call.out_len(n, world) != Some(dr.len()) {
            return Err(nccl_err(
                comm.rank,
                name,
                format!(
                    "{n} input element(s) over {world} rank(s) do not fit an output of {}",
                    dr.len()
                ),
            ));
        }
        let stream = &comm.stream;
        per_dtype!(s.dtype(), name, |T| {
            let src = s.as_cuda_slice::<T>()?.slice(sr.clone());
            let mut dst = d.as_cuda_slice_mut::<T>()?.slice_mut(dr.clone());
            let (sp, _sync_src) = src.device_ptr(stream);
            let (dp, _sync_dst) = dst.device_ptr_mut(stream);
            let (sp, dp) = (sp as *const c_void, dp as *mut c_void);
            let cu = stream.cu_stream() as _;
            // SAFETY: `sp` points to `n` elements of type `ty` and `dp` to `out_len(n)`, both on
            // the communicator's GPU (checked before anything was queued) and kept alive by the
            // caller until the wait for this call has ended; they do not overlap (`out` is a
            // fresh allocation). The call is queued on the communicator's stream, after the
            // kernels that wrote the input and the allocation of the output (same stream).
            let res = unsafe {
                match call {
                    Call::AllReduce(op) => nccl::all_reduce(sp, dp, n, ty, op, comm.comm, cu),
                    Call::Broadcast(root) => nccl::broadcast(sp, dp, n, ty, root, comm.comm, cu),
                    Call::ReduceScatter(op) => {
                        nccl::reduce_scatter(sp, dp, dr.len(), ty, op, comm.comm, cu)
                    }
                    Call::AllGather => nccl::all_gather(sp, dp, n, ty, comm.comm, cu),
                }
            };
            res.map(|_| ()).map_err(|e| nccl_err(comm.rank, name, e.0))
        })
    })
}
