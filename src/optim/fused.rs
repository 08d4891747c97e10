//! Fused, in-place optimizer kernels for CPU tensors: one pass over each parameter that reads the
//! gradient and updates the parameter and its state where they are, allocating nothing.
//!
//! Each kernel mirrors the tensor-op chain of the optimizer it fuses (same formulas, same order,
//! the scalars rounded to the storage's arithmetic type as Candle's `affine` rounds them), so
//! results match the unfused chain to rounding. Large tensors are split into chunks processed by
//! Rayon's pool (one thread when `RAYON_NUM_THREADS=1`, as the launcher sets it).
//!
//! [`fusable`] says whether a parameter/gradient pair can take this path (CPU; f32, f64, bf16 or
//! f16; the same dtype and shape); the optimizers fall back to tensor ops otherwise (CUDA).

use candle_core::{CpuStorage, DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::par::Inline;

use crate::error::{Error, Result};
use crate::inplace::{with_cpu_mut, with_cpu_mut_src, Elem, Real};

/// Whether new optimizers use the fused kernels (the `fused_optim` setting, default on).
pub(crate) fn default_on() -> Result<bool> {
    crate::settings::runtime::fused_optim_default()
}

/// Elements per parallel chunk (256 KiB of f32: big enough to amortise scheduling).
const CHUNK: usize = 1 << 16;

/// Whether `param` with gradient `grad` can be updated by the fused CPU kernels.
pub(crate) fn fusable(param: &Tensor, grad: &Tensor) -> bool {
    param.device().is_cpu()
        && grad.device().is_cpu()
        && matches!(
            param.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        )
        && grad.dtype() == param.dtype()
        && grad.shape() == param.shape()
        && param.is_contiguous()
}

/// AdamW's scalars for one step (see [`super::AdamW`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamScalars {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `1 − lr·λ`.
    pub decay: f64,
    /// `1 / (1 − β1ᵗ)`.
    pub scale_m: f64,
    /// `1 / (1 − β2ᵗ)`.
    pub scale_v: f64,
}

/// SGD's scalars for one step (see [`super::Sgd`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SgdScalars {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    /// The momentum buffer has never been written: it becomes `d` (PyTorch's first step).
    pub first: bool,
}

/// `grad`, contiguous (a copy only when it is not).
fn contiguous(grad: &Tensor) -> Result<Tensor> {
    Ok(if grad.is_contiguous() {
        grad.clone()
    } else {
        grad.contiguous()?
    })
}

fn dtype_err(what: &str) -> Error {
    Error::invalid(
        what,
        "parameter, gradient and optimizer state must share one float dtype (f32, f64, bf16, f16)",
    )
}

fn len_err(what: &str) -> Error {
    Error::invalid(
        what,
        "parameter, gradient and optimizer state differ in length",
    )
}

/// `Σ x²` over `t`'s elements in f64, read in place when `t` is a contiguous CPU float tensor
/// (`None` otherwise: the caller computes it with tensor ops). Chunks of [`CHUNK`] elements are
/// summed in parallel, each in 8 f64 lanes, and the chunk sums are added in order, so the result
/// does not depend on the number of threads.
pub(crate) fn sq_sum(t: &Tensor) -> Option<f64> {
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout.contiguous_offsets()?;
    match &*storage {
        candle_core::Storage::Cpu(s) => match s {
            CpuStorage::F32(x) => Some(sq_sum_kernel(&x[a..b])),
            CpuStorage::F64(x) => Some(sq_sum_kernel(&x[a..b])),
            CpuStorage::BF16(x) => Some(sq_sum_kernel(&x[a..b])),
            CpuStorage::F16(x) => Some(sq_sum_kernel(&x[a..b])),
            _ => None,
        },
        _ => None,
    }
}

fn sq_sum_kernel<T: Wide>(x: &[T]) -> f64 {
    if x.len() <= CHUNK {
        return sq_sum_chunk(x);
    }
    let sums: Vec<f64> = x
        .par_chunks(CHUNK)
        .inline_when_single()
        .map(sq_sum_chunk)
        .collect();
    sums.iter().sum()
}

/// An element widened to f64 (exactly, for every float storage type).
trait Wide: Copy + Send + Sync {
    fn wide(self) -> f64;
}
impl Wide for f32 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self as f64
    }
}
impl Wide for f64 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self
    }
}
impl Wide for bf16 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self.to_f64()
    }
}
impl Wide for f16 {
    #[inline(always)]
    fn wide(self) -> f64 {
        self.to_f64()
    }
}

/// One chunk of [`sq_sum`]: with AVX2 and FMA when the CPU has them, else the portable loop (the
/// same operations in the same order, so the same bits).
fn sq_sum_chunk<T: Wide>(x: &[T]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: `sq_sum_avx2` only differs from `sq_sum_loop` by being compiled with AVX2 and
        // FMA enabled, and this CPU was just found to have both.
        return unsafe { sq_sum_avx2(x) };
    }
    sq_sum_loop(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sq_sum_avx2<T: Wide>(x: &[T]) -> f64 {
    sq_sum_loop(x)
}

/// `Σ x²` in 8 independent f64 partial sums (a serial float sum does not vectorize).
#[inline(always)]
fn sq_sum_loop<T: Wide>(x: &[T]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|v| v.wide() * v.wide()).sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            let v = v.wide();
            *a += v * v;
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// Updates `param`, `m` and `v` in place by one AdamW step with gradient `grad`.
pub(crate) fn adamw(
    param: &Tensor,
    m: &Tensor,
    v: &Tensor,
    grad: &Tensor,
    s: AdamScalars,
) -> Result<()> {
    const WHAT: &str = "AdamW fused step";
    let grad = contiguous(grad)?;
    with_cpu_mut_src(param, &grad, WHAT, |ps, pr, gs, gr| {
        with_cpu_mut(m, WHAT, |ms, mr| {
            with_cpu_mut(v, WHAT, |vs, vr| {
                let n = pr.len();
                if mr.len() != n || vr.len() != n || gr.len() != n {
                    return Err(len_err(WHAT));
                }
                match (ps, ms, vs, gs) {
                    (
                        CpuStorage::F32(p),
                        CpuStorage::F32(m),
                        CpuStorage::F32(v),
                        CpuStorage::F32(g),
                    ) => adamw_kernel::<f32, f32>(&mut p[pr], &mut m[mr], &mut v[vr], &g[gr], s),
                    (
                        CpuStorage::F64(p),
                        CpuStorage::F64(m),
                        CpuStorage::F64(v),
                        CpuStorage::F64(g),
                    ) => adamw_kernel::<f64, f64>(&mut p[pr], &mut m[mr], &mut v[vr], &g[gr], s),
                    (
                        CpuStorage::BF16(p),
                        CpuStorage::BF16(m),
                        CpuStorage::BF16(v),
                        CpuStorage::BF16(g),
                    ) => adamw_kernel::<bf16, f32>(&mut p[pr], &mut m[mr], &mut v[vr], &g[gr], s),
                    (
                        CpuStorage::F16(p),
                        CpuStorage::F16(m),
                        CpuStorage::F16(v),
                        CpuStorage::F16(g),
                    ) => adamw_kernel::<f16, f32>(&mut p[pr], &mut m[mr], &mut v[vr], &g[gr], s),
                    _ => return Err(dtype_err(WHAT)),
                }
                Ok(())
            })
        })
    })
}

fn adamw_kernel<T: Elem<C>, C: Real>(
    p: &mut [T],
    m: &mut [T],
    v: &mut [T],
    g: &[T],
    s: AdamScalars,
) {
    let body = |p: &mut [T], m: &mut [T], v: &mut [T], g: &[T]| adamw_chunk(p, m, v, g, s);
    if p.len() <= CHUNK {
        body(p, m, v, g);
    } else {
        p.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(m.par_chunks_mut(CHUNK).inline_when_single())
            .zip(v.par_chunks_mut(CHUNK).inline_when_single())
            .zip(g.par_chunks(CHUNK).inline_when_single())
            .for_each(|(((p, m), v), g)| body(p, m, v, g));
    }
}

/// One chunk of AdamW: with AVX when the CPU has it (the square roots and divisions dominate,
/// and AVX does twice as many per instruction as the SSE2 baseline), else the portable loop.
/// Both compute the same IEEE operations in the same order, so the results are identical.
fn adamw_chunk<T: Elem<C>, C: Real>(
    p: &mut [T],
    m: &mut [T],
    v: &mut [T],
    g: &[T],
    s: AdamScalars,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: `adamw_chunk_avx` only differs from `adamw_loop` by being compiled with AVX
        // enabled, and AVX support was just detected on this CPU.
        unsafe { adamw_chunk_avx(p, m, v, g, s) };
        return;
    }
    adamw_loop(p, m, v, g, s);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn adamw_chunk_avx<T: Elem<C>, C: Real>(
    p: &mut [T],
    m: &mut [T],
    v: &mut [T],
    g: &[T],
    s: AdamScalars,
) {
    adamw_loop(p, m, v, g, s);
}

#[inline(always)]
fn adamw_loop<T: Elem<C>, C: Real>(p: &mut [T], m: &mut [T], v: &mut [T], g: &[T], s: AdamScalars) {
    let (b1, b2) = (C::of(s.beta1), C::of(s.beta2));
    let (c1, c2) = (C::of(1.0 - s.beta1), C::of(1.0 - s.beta2));
    let (sm, sv, eps) = (C::of(s.scale_m), C::of(s.scale_v), C::of(s.eps));
    let (decay, lr) = (C::of(s.decay), C::of(s.lr));
    for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        let g = g.get();
        let mi = m.get() * b1 + g * c1;
        let vi = v.get() * b2 + (g * g) * c2;
        let adjusted = (mi * sm) / ((vi * sv).sqrt() + eps);
        *p = T::put(p.get() * decay - adjusted * lr);
        *m = T::put(mi);
        *v = T::put(vi);
    }
}

/// Updates `param` (and `buf`, the momentum buffer, when momentum is on) in place by one SGD
/// step with gradient `grad`.
pub(crate) fn sgd(
    param: &Tensor,
    buf: Option<&Tensor>,
    grad: &Tensor,
    s: SgdScalars,
) -> Result<()> {
    const WHAT: &str = "Sgd fused step";
    let grad = contiguous(grad)?;
    with_cpu_mut_src(param, &grad, WHAT, |ps, pr, gs, gr| {
        let n = pr.len();
        if gr.len() != n {
            return Err(len_err(WHAT));
        }
        let Some(buf) = buf else {
            return match (ps, gs) {
                (CpuStorage::F32(p), CpuStorage::F32(g)) => {
                    sgd_kernel::<f32, f32>(&mut p[pr], None, &g[gr], s);
                    Ok(())
                }
                (CpuStorage::F64(p), CpuStorage::F64(g)) => {
                    sgd_kernel::<f64, f64>(&mut p[pr], None, &g[gr], s);
                    Ok(())
                }
                (CpuStorage::BF16(p), CpuStorage::BF16(g)) => {
                    sgd_kernel::<bf16, f32>(&mut p[pr], None, &g[gr], s);
                    Ok(())
                }
                (CpuStorage::F16(p), CpuStorage::F16(g)) => {
                    sgd_kernel::<f16, f32>(&mut p[pr], None, &g[gr], s);
                    Ok(())
                }
                _ => Err(dtype_err(WHAT)),
            };
        };
        with_cpu_mut(buf, WHAT, |bs, br| {
            if br.len() != n {
                return Err(len_err(WHAT));
            }
            match (ps, bs, gs) {
                (CpuStorage::F32(p), CpuStorage::F32(b), CpuStorage::F32(g)) => {
                    sgd_kernel::<f32, f32>(&mut p[pr], Some(&mut b[br]), &g[gr], s)
                }
                (CpuStorage::F64(p), CpuStorage::F64(b), CpuStorage::F64(g)) => {
                    sgd_kernel::<f64, f64>(&mut p[pr], Some(&mut b[br]), &g[gr], s)
                }
                (CpuStorage::BF16(p), CpuStorage::BF16(b), CpuStorage::BF16(g)) => {
                    sgd_kernel::<bf16, f32>(&mut p[pr], Some(&mut b[br]), &g[gr], s)
                }
                (CpuStorage::F16(p), CpuStorage::F16(b), CpuStorage::F16(g)) => {
                    sgd_kernel::<f16, f32>(&mut p[pr], Some(&mut b[br]), &g[gr], s)
                }
                _ => return Err(dtype_err(WHAT)),
            }
            Ok(())
        })
    })
}

fn sgd_kernel<T: Elem<C>, C: Real>(p: &mut [T], buf: Option<&mut [T]>, g: &[T], s: SgdScalars) {
    let (lr, wd) = (C::of(s.lr), C::of(s.weight_decay));
    let decay = s.weight_decay != 0.0;
    let d_of = move |p: T, g: T| {
        if decay {
            p.get() * wd + g.get()
        } else {
            g.get()
        }
    };
    match buf {
        None => {
            let body = |p: &mut [T], g: &[T]| {
                for (p, g) in p.iter_mut().zip(g) {
                    let d = d_of(*p, *g);
                    *p = T::put(p.get() - d * lr);
                }
            };
            if p.len() <= CHUNK {
                body(p, g);
            } else {
                p.par_chunks_mut(CHUNK)
                    .inline_when_single()
                    .zip(g.par_chunks(CHUNK).inline_when_single())
                    .for_each(|(p, g)| body(p, g));
            }
        }
        Some(buf) => match (s.first, s.nesterov, decay) {
            (false, false, false) => momentum_pass::<T, C, false, false, false>(p, buf, g, s),
            (false, false, true) => momentum_pass::<T, C, false, false, true>(p, buf, g, s),
            (false, true, false) => momentum_pass::<T, C, false, true, false>(p, buf, g, s),
            (false, true, true) => momentum_pass::<T, C, false, true, true>(p, buf, g, s),
            (true, false, false) => momentum_pass::<T, C, true, false, false>(p, buf, g, s),
            (true, false, true) => momentum_pass::<T, C, true, false, true>(p, buf, g, s),
            (true, true, false) => momentum_pass::<T, C, true, true, false>(p, buf, g, s),
            (true, true, true) => momentum_pass::<T, C, true, true, true>(p, buf, g, s),
        },
    }
}

/// SGD with a momentum buffer; the options are constants so that each combination compiles to a
/// branch-free (vectorizable) loop.
fn momentum_pass<
    T: Elem<C>,
    C: Real,
    const FIRST: bool,
    const NESTEROV: bool,
    const DECAY: bool,
>(
    p: &mut [T],
    buf: &mut [T],
    g: &[T],
    s: SgdScalars,
) {
    let (lr, wd) = (C::of(s.lr), C::of(s.weight_decay));
    let (mu, c) = (C::of(s.momentum), C::of(1.0 - s.dampening));
    let body = |p: &mut [T], b: &mut [T], g: &[T]| {
        for ((p, b), g) in p.iter_mut().zip(b.iter_mut()).zip(g) {
            let d = if DECAY {
                p.get() * wd + g.get()
            } else {
                g.get()
            };
            // The buffer is rounded to its storage type before it is used, as in the tensor chain.
            let bi = T::put(if FIRST { d } else { b.get() * mu + d * c });
            *b = bi;
            let bi = bi.get();
            let step = if NESTEROV { d + bi * mu } else { bi };
            *p = T::put(p.get() - step * lr);
        }
    };
    if p.len() <= CHUNK {
        body(p, buf, g);
    } else {
        p.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(buf.par_chunks_mut(CHUNK).inline_when_single())
            .zip(g.par_chunks(CHUNK).inline_when_single())
            .for_each(|((p, b), g)| body(p, b, g));
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// `Σ x²` in f64 through tensor ops (the path for tensors the kernel does not take).
    fn reference(t: &Tensor) -> f64 {
        let sq = t.to_dtype(DType::F64).and_then(|t| t.sqr()?.sum_all());
        sq.and_then(|s| s.to_scalar::<f64>()).unwrap_or(f64::NAN)
    }

    #[test]
    fn sum_of_squares_matches_tensor_ops_for_every_float_dtype_and_length(
    ) -> candle_core::Result<()> {
        for n in [
            0usize,
            1,
            7,
            8,
            9,
            1000,
            super::CHUNK + 13,
            3 * super::CHUNK,
        ] {
            let base = Tensor::arange(0f64, n as f64, &Device::Cpu)?;
            // Values in [-2.5, 2.5) that do not repeat with the lane or chunk period.
            let x = ((base * 0.618_034)?.sin()? * 2.5)?;
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let t = x.to_dtype(dtype)?;
                let want = reference(&t);
                let got = super::sq_sum(&t);
                let got = got.ok_or_else(|| candle_core::Error::Msg(format!("{dtype:?} {n}")))?;
                assert!(
                    (got - want).abs() <= 1e-12 * want.max(1.0),
                    "{dtype:?} n {n}: {got} vs {want}"
                );
            }
        }
        // A contiguous view with an offset reads its own elements only.
        let t = Tensor::new(&[100f32, 1., 2., 3., 100.], &Device::Cpu)?;
        assert_eq!(super::sq_sum(&t.narrow(0, 1, 3)?), Some(14.0));
        // Strided views and integer tensors are left to tensor ops.
        let m = Tensor::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu)?;
        assert_eq!(super::sq_sum(&m.t()?), None);
        assert_eq!(super::sq_sum(&m.to_dtype(DType::U32)?), None);
        Ok(())
    }
}
