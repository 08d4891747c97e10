//! The NCCL calls as Candle custom ops on CUDA storage: out-of-place all-reduce and broadcast,
//! reduce-scatter and all-gather into new tensors, queued on the communicator's stream.

use std::ffi::c_void;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::comm::RawComm;
use crate::collective::ReduceOp;
use crate::error::Result;

/// What one NCCL call does, queued on the communicator's stream.
#[derive(Clone, Copy)]
pub(super) enum Call {
    AllReduce(sys::ncclRedOp_t),
    Broadcast(i32),
}

/// An out-of-place NCCL all-reduce or broadcast of a contiguous CUDA tensor into a new one of
/// the same shape: no copy of the input first, and the caller's tensor is never modified.
pub(super) struct OutOfPlace<'a> {
    pub(super) comm: &'a RawComm,
    pub(super) call: Call,
    pub(super) ty: sys::ncclDataType_t,
}

/// Reduce-scatter of a contiguous CUDA tensor of `world * n` elements into a new `[n]` tensor
/// (this rank's block of the reduction).
pub(super) struct ReduceScatter<'a> {
    pub(super) comm: &'a RawComm,
    pub(super) world: usize,
    pub(super) ty: sys::ncclDataType_t,
    pub(super) op: sys::ncclRedOp_t,
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

/// All-gather of equal-sized contiguous CUDA tensors into a new `[world * n]` tensor.
pub(super) struct AllGather<'a> {
    pub(super) comm: &'a RawComm,
    pub(super) world: usize,
    pub(super) ty: sys::ncclDataType_t,
}

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
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
