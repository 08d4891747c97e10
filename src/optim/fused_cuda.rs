//! Fused CUDA kernels for AdamW and SGD (f32, bf16 and f16): one launch per parameter updates
//! the parameter and its state in place, instead of a chain of about a dozen elementwise ops.
//!
//! The kernels (`fused_optim.cu`) are compiled with NVRTC on first use, once per process and GPU
//! architecture, for the device's own architecture ([`crate::cuda_ptx`]), and loaded into each
//! device through Candle's custom-module cache. If compiling or loading fails, one warning is
//! logged and the optimizers use the tensor-op chain for the rest of the run: a missing fast path
//! never stops training.
//!
//! The arithmetic mirrors the CPU kernels in `fused.rs` operation by operation: bf16 and f16 are
//! widened to f32, computed in f32 and rounded to nearest-even on store (the momentum buffer
//! before it is used, as on the CPU), and the kernels are compiled without contracting products
//! and sums into FMAs (`--fmad=false`), with IEEE division and square root: the same IEEE
//! operations in the same order as the CPU, so the same bits.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{DType, Tensor};
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::fused::{AdamScalars, SgdScalars};
use crate::error::{Error, Result};
use crate::inplace::{with_mut, with_mut_src, DstMut, Src};

const MODULE: &str = "accelerate_rs_fused_optim";

/// The source NVRTC compiles: the shared element types and conversions, then the kernels.
const SOURCE: &str = concat!(
    include_str!("../cuda_prelude.cu"),
    include_str!("fused_optim.cu")
);

/// Set once compiling or loading failed: the tensor-op path is used from then on.
static DISABLED: AtomicBool = AtomicBool::new(false);
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Number of fused kernels launched by this process (AdamW and SGD together): a check can tell
/// that the fused path really ran rather than the tensor-op fallback.
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

fn disable(why: &str) {
    if !DISABLED.swap(true, Ordering::Relaxed) {
        log::warn!("fused CUDA optimizer kernels unavailable ({why}); using tensor ops instead");
    }
}

/// The kernels' PTX for `dev`'s architecture, or `None` (after one warning) when they cannot be
/// had.
fn ptx(dev: &CudaDevice) -> Option<&'static str> {
    if DISABLED.load(Ordering::Relaxed) {
        return None;
    }
    match crate::cuda_ptx::ptx(MODULE, SOURCE, dev) {
        Ok(p) => Some(p),
        Err(e) => {
            disable(&e);
            None
        }
    }
}

/// Loads kernel `$name` on `$dev` (Candle caches the module per device); returns `Ok(false)` from
/// the calling function, after one warning, when it cannot be had. (A macro: Candle does not
/// export the type of the loaded function.)
macro_rules! load_kernel {
    ($dev:expr, $name:expr) => {{
        let Some(ptx) = ptx(&$dev) else {
            return Ok(false);
        };
        match $dev.get_or_load_custom_func($name, MODULE, ptx) {
            Ok(f) => f,
            Err(e) => {
                disable(&format!("loading `{}`: {e}", $name));
                return Ok(false);
            }
        }
    }};
}

/// A grid-stride launch over `n` elements.
fn launch_config(n: usize) -> LaunchConfig {
    const THREADS: usize = 256;
    let blocks = n.div_ceil(THREADS).clamp(1, 4096);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn not_cuda(what: &str) -> Error {
    Error::invalid(
        what,
        "fused CUDA update called on a tensor that is not on a CUDA GPU",
    )
}

/// `t`'s CUDA storage, mutable, and its element range.
fn cuda_mut<'a>(
    t: &Tensor,
    what: &'a str,
    f: impl FnOnce(&mut CudaStorage, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    with_mut(t, what, |dst, r| match dst {
        DstMut::Cuda(s) => f(s, r),
        DstMut::Cpu(_) => Err(not_cuda(what)),
    })
}

/// `t`'s CUDA storage, mutable, and `src`'s, read-only, with their element ranges.
fn cuda_mut_src<'a>(
    t: &Tensor,
    src: &Tensor,
    what: &'a str,
    f: impl FnOnce(&mut CudaStorage, Range<usize>, &CudaStorage, Range<usize>) -> Result<()> + 'a,
) -> Result<()> {
    with_mut_src(t, src, what, |dst, d, src, s| match (dst, src) {
        (DstMut::Cuda(dst), Src::Cuda(src)) => f(dst, d, src, s),
        _ => Err(not_cuda(what)),
    })
}

/// Whether `param`/`grad` can take the fused CUDA path (f32, bf16 or f16, one dtype, one
/// shape, one device, a contiguous parameter), and the device to run it on.
fn device_for(param: &Tensor, grad: &Tensor) -> Option<CudaDevice> {
    if !matches!(param.dtype(), DType::F32 | DType::BF16 | DType::F16)
        || grad.dtype() != param.dtype()
        || grad.shape() != param.shape()
        || !param.is_contiguous()
    {
        return None;
    }
    match (param.device(), grad.device()) {
        (candle_core::Device::Cuda(d), candle_core::Device::Cuda(g)) if d.same_device(g) => {
            Some(d.clone())
        }
        _ => None,
    }
}

fn launch_err(name: &str, e: impl std::fmt::Debug) -> Error {
    candle_core::Error::Msg(format!("launching the fused `{name}` kernel: {e:?}")).into()
}

/// One AdamW step of `param` (and its moments `m`, `v`) with `grad`, fused on the GPU. `Ok(false)`
/// when this path does not apply (not CUDA f32/bf16/f16, or the kernels are unavailable).
pub(crate) fn adamw(
    param: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    s: AdamScalars,
) -> Result<bool> {
    let Some(dev) = device_for(param, grad) else {
        return Ok(false);
    };
    if m.dtype() != param.dtype() || v.dtype() != param.dtype() {
        return Ok(false);
    }
    match param.dtype() {
        DType::F32 => adamw_typed::<f32>(&dev, "adamw_f32", param, m, v, grad, s),
        DType::BF16 => adamw_typed::<half::bf16>(&dev, "adamw_bf16", param, m, v, grad, s),
        DType::F16 => adamw_typed::<half::f16>(&dev, "adamw_f16", param, m, v, grad, s),
        _ => Ok(false),
    }
}

fn adamw_typed<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &'static str,
    param: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    s: AdamScalars,
) -> Result<bool> {
    let func = load_kernel!(dev, name);
    let grad = grad.contiguous()?;
    const WHAT: &str = "AdamW fused step";
    cuda_mut_src(param, &grad, WHAT, |ps, pr, gs, gr| {
        cuda_mut(m, WHAT, |ms, mr| {
            cuda_mut(v, WHAT, |vs, vr| {
                let n = pr.len();
                if gr.len() != n || mr.len() != n || vr.len() != n {
                    return Err(Error::invalid(
                        WHAT,
                        "parameter, gradient and moments differ in length",
                    ));
                }
                let mut p = T::as_cuda_slice_mut(ps)?.slice_mut(pr);
                let mut m = T::as_cuda_slice_mut(ms)?.slice_mut(mr);
                let mut v = T::as_cuda_slice_mut(vs)?.slice_mut(vr);
                let g = T::as_cuda_slice(gs)?.slice(gr);
                let n64 = n as u64;
                let scalars = [
                    s.beta1 as f32,
                    (1.0 - s.beta1) as f32,
                    s.beta2 as f32,
                    (1.0 - s.beta2) as f32,
                    s.scale_m as f32,
                    s.scale_v as f32,
                    s.eps as f32,
                    s.decay as f32,
                    s.lr as f32,
                ];
                let mut b = func.builder();
                b.arg(&mut p).arg(&mut m).arg(&mut v).arg(&g).arg(&n64);
                for x in &scalars {
                    b.arg(x);
                }
                // SAFETY: the arguments match `adamw_<T>`'s signature in order and type (three
                // mutable device views and one read-only view of the kernel's element type — f32,
                // or bf16/f16 as 16-bit words — an unsigned 64-bit count, nine f32 scalars); the
                // four views hold exactly `n` elements each (checked above), and the kernel
                // touches indices below `n` only. The views borrow the storages under Candle's
                // write locks (read lock for the gradient), which stay held until the launch is
                // queued on the device's stream, where later uses of these tensors are ordered
                // after it.
                unsafe { b.launch(launch_config(n)) }.map_err(|e| launch_err(name, e))?;
                LAUNCHES.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        })
    })?;
    Ok(true)
}

/// One SGD step of `param` (and its momentum buffer `buf`, when momentum is on) with `grad`,
/// fused on the GPU. `Ok(false)` when this path does not apply.
pub(crate) fn sgd(
    param: &Tensor,
    buf: Option<&Tensor>,
    grad: &Tensor,
    s: SgdScalars,
) -> Result<bool> {
    let Some(dev) = device_for(param, grad) else {
        return Ok(false);
    };
    if buf.is_some_and(|b| b.dtype() != param.dtype() || b.shape() != param.shape()) {
        return Ok(false);
    }
    match param.dtype() {
        DType::F32 => sgd_typed::<f32>(&dev, "sgd_f32", param, buf, grad, s),
        DType::BF16 => sgd_typed::<half::bf16>(&dev, "sgd_bf16", param, buf, grad, s),
        DType::F16 => sgd_typed::<half::f16>(&dev, "sgd_f16", param, buf, grad, s),
        _ => Ok(false),
    }
}

fn sgd_typed<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &'static str,
    param: &Tensor,
    buf: Option<&Tensor>,
    grad: &Tensor,
    s: SgdScalars,
) -> Result<bool> {
    let func = load_kernel!(dev, name);
    let grad = grad.contiguous()?;
    let flags = [
        i32::from(s.weight_decay != 0.0),
        i32::from(buf.is_some()),
        i32::from(s.first),
        i32::from(s.nesterov),
    ];
    let scalars = [
        s.lr as f32,
        s.weight_decay as f32,
        s.momentum as f32,
        (1.0 - s.dampening) as f32,
    ];
    const WHAT: &str = "Sgd fused step";
    let run = |ps: &mut CudaStorage,
               pr: Range<usize>,
               gs: &CudaStorage,
               gr: Range<usize>,
               bs: Option<(&mut CudaStorage, Range<usize>)>|
     -> Result<()> {
        let n = pr.len();
        let mut p = T::as_cuda_slice_mut(ps)?.slice_mut(pr);
        let g = T::as_cuda_slice(gs)?.slice(gr.clone());
        if gr.len() != n {
            return Err(Error::invalid(
                WHAT,
                "parameter and gradient differ in length",
            ));
        }
        let n64 = n as u64;
        let mut b = func.builder();
        let mut buf_view;
        let unused = T::as_cuda_slice(gs)?.slice(gr);
        b.arg(&mut p);
        match bs {
            Some((bs, br)) => {
                if br.len() != n {
                    return Err(Error::invalid(
                        WHAT,
                        "parameter and momentum buffer differ in length",
                    ));
                }
                buf_view = T::as_cuda_slice_mut(bs)?.slice_mut(br);
                b.arg(&mut buf_view);
            }
            // No buffer: the kernel never reads it (`use_buf == 0`); any valid pointer will do.
            None => {
                b.arg(&unused);
            }
        }
        b.arg(&g).arg(&n64);
        b.arg(&scalars[0]).arg(&scalars[1]).arg(&flags[0]);
        b.arg(&scalars[2]).arg(&scalars[3]);
        b.arg(&flags[1]).arg(&flags[2]).arg(&flags[3]);
        // SAFETY: the arguments match `sgd_<T>`'s signature in order and type (parameter and
        // buffer as device pointers of the kernel's element type, the gradient, an unsigned
        // 64-bit count, then f32 lr, f32 wd, int decay, f32 mu, f32 c, int use_buf, int first,
        // int nesterov). Parameter, gradient and (when used) buffer views hold exactly `n`
        // elements (checked above) and the kernel touches indices below `n` only; without a
        // buffer it never dereferences the placeholder. Candle's storage locks are held until
        // the launch is queued.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| launch_err(name, e))?;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        Ok(())
    };
    cuda_mut_src(param, &grad, WHAT, |ps, pr, gs, gr| match buf {
        Some(buf) => cuda_mut(buf, WHAT, |bs, br| run(ps, pr, gs, gr, Some((bs, br)))),
        None => run(ps, pr, gs, gr, None),
    })?;
    Ok(true)
}

/// Whether every element of `grads` is finite, checked on the GPU by a trial kernel
/// (`ACCELERATE_RS_CUDA_TRIAL=1`): one `nonfinite` launch per tensor into one device flag, then
/// one read of the flag (counted by [`crate::host_reads`]). Composed, each tensor costs a
/// tensor-sized `affine`, a sum and a conversion, and the sums a stack and a sum. `Ok(None)`
/// when this path does not apply: the trial kernels off, no tensor, a tensor not on the first
/// one's GPU, not f32/bf16/f16 or not contiguous, or the kernels unavailable.
pub(crate) fn all_finite(grads: &[&Tensor]) -> Result<Option<bool>> {
    let Some(first) = grads.first() else {
        return Ok(None);
    };
    let candle_core::Device::Cuda(dev) = first.device() else {
        return Ok(None);
    };
    let applies = |g: &&Tensor| {
        g.device().same_device(first.device())
            && matches!(g.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && g.is_contiguous()
    };
    if !crate::settings::runtime::cuda_trial()? || !grads.iter().all(applies) {
        return Ok(None);
    }
    let Some(ptx) = ptx(dev) else {
        return Ok(None);
    };
    let mut flag = dev.alloc_zeros::<u32>(1)?;
    for g in grads {
        let name = match g.dtype() {
            DType::F32 => "nonfinite_f32",
            DType::BF16 => "nonfinite_bf16",
            _ => "nonfinite_f16",
        };
        let func = match dev.get_or_load_custom_func(name, MODULE, ptx) {
            Ok(f) => f,
            Err(e) => {
                disable(&format!("loading `{name}`: {e}"));
                return Ok(None);
            }
        };
        let (storage, layout) = g.storage_and_layout();
        let candle_core::Storage::Cuda(s) = &*storage else {
            return Err(not_cuda("finiteness check"));
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            return Ok(None);
        };
        let n = b - a;
        let n64 = n as u64;
        let (f32v, bf16v, f16v);
        let mut args = func.builder();
        match g.dtype() {
            DType::F32 => {
                f32v = f32::as_cuda_slice(s)?.slice(a..b);
                args.arg(&f32v);
            }
            DType::BF16 => {
                bf16v = half::bf16::as_cuda_slice(s)?.slice(a..b);
                args.arg(&bf16v);
            }
            _ => {
                f16v = half::f16::as_cuda_slice(s)?.slice(a..b);
                args.arg(&f16v);
            }
        }
        args.arg(&n64).arg(&mut flag);
        // SAFETY: the arguments match `nonfinite_<T>`'s signature (a read-only view of the
        // tensor's element type — f32, or bf16/f16 as 16-bit words — an unsigned 64-bit count,
        // and a pointer to one unsigned int); the view holds exactly `n` elements and the kernel
        // reads indices below `n` only and writes the flag's one element. The view borrows the
        // storage under Candle's read lock until the launch is queued on the device's stream.
        unsafe { args.launch(launch_config(n.max(1))) }.map_err(|e| launch_err(name, e))?;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
    }
    let flags = crate::readback::counted(|| dev.clone_dtoh(&flag))?;
    Ok(Some(flags.first() == Some(&0)))
}
