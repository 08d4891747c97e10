//! Layer normalization and RMS normalization with a fused forward and a fused backward.

use candle_core::{CpuStorage, CustomOp3, Layout, Module, Result, Shape, Tensor};
use candle_nn::LayerNormConfig;
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{fused, multiversion, slice, sum2_by, sum_by, Elem};

/// Rows handled by one Rayon task in the backward pass (its partial weight/bias gradients are
/// summed at the end).
const ROWS_PER_TASK: usize = 32;

/// Mean (0 without `remove_mean`) and 1/sqrt(var + eps) of one row.
#[inline(always)]
fn stats<T: Elem>(row: &[T], remove_mean: bool, eps: f32) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = if remove_mean {
        sum_by(row, |v| v) / d
    } else {
        0.0
    };
    let var = sum_by(row, |v| (v - mean) * (v - mean)) / d;
    (mean, 1.0 / (var + eps).sqrt())
}

multiversion! {
    /// One row of the forward pass: `o = (x - mean) * rstd * w (+ b)`.
    fn fwd_row<T: Elem>(op: &NormFwd, o: &mut [T], row: &[T], w: &[T], b: &[T]) {
        let (mean, rstd) = stats(row, op.remove_mean, op.eps);
        if op.has_bias {
            for (((o, x), w), b) in o.iter_mut().zip(row).zip(w).zip(b) {
                *o = T::of((x.f() - mean) * rstd * w.f() + b.f());
            }
        } else {
            for ((o, x), w) in o.iter_mut().zip(row).zip(w) {
                *o = T::of((x.f() - mean) * rstd * w.f());
            }
        }
    }
}

multiversion! {
    /// One row of the backward pass: writes `dxr` and adds the row's share of the weight and
    /// bias gradients to `acc.1` and `acc.2`; `acc.0` is scratch of the row's length.
    fn bwd_row<T: Elem>(
        op: &NormBwd,
        dxr: &mut [T],
        xr: &[T],
        dyr: &[T],
        w: &[T],
        acc: &mut (Vec<f32>, Vec<f32>, Vec<f32>),
    ) {
        let (g, dw, db) = (&mut acc.0[..], &mut acc.1[..], &mut acc.2[..]);
        let d = xr.len();
        let (mean, rstd) = stats(xr, op.remove_mean, op.eps);
        // g = dy * w; dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
        for ((((g, dw), db), x), (dy, w)) in g
            .iter_mut()
            .zip(dw.iter_mut())
            .zip(db.iter_mut())
            .zip(xr)
            .zip(dyr.iter().zip(w))
        {
            let (dy, xhat) = (dy.f(), (x.f() - mean) * rstd);
            *g = dy * w.f();
            *dw += dy * xhat;
            *db += dy;
        }
        let mg = sum_by(g, |g| g) / d as f32;
        let mgx = sum2_by(g, xr, |g, x| g * (x - mean) * rstd) / d as f32;
        let shift = if op.remove_mean { mg } else { 0.0 };
        for ((dx, x), g) in dxr.iter_mut().zip(xr).zip(g.iter()) {
            let xhat = (x.f() - mean) * rstd;
            *dx = T::of(rstd * (g - shift - xhat * mgx));
        }
    }
}

/// The forward op: `(x, weight, bias)` → `(x - mean) * rstd * weight + bias` over the last dim.
struct NormFwd {
    eps: f32,
    remove_mean: bool,
    has_bias: bool,
}

fn fwd<T: Elem>(op: &NormFwd, x: &[T], w: &[T], b: &[T], d: usize) -> Vec<T> {
    let mut out = vec![T::of(0.0); x.len()];
    out.par_chunks_mut(d)
        .inline_when_single()
        .zip(x.par_chunks(d).inline_when_single())
        .for_each(|(o, row)| fwd_row(op, o, row, w, b));
    out
}

impl CustomOp3 for NormFwd {
    fn name(&self) -> &'static str {
        if self.remove_mean {
            "accelerate-rs-layer-norm"
        } else {
            "accelerate-rs-rms-norm"
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = l1.dims().last().copied().unwrap_or(1).max(1);
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(b)) => {
                CpuStorage::F32(fwd(self, slice(x, l1)?, slice(w, l2)?, slice(b, l3)?, d))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(b)) => {
                CpuStorage::F64(fwd(self, slice(x, l1)?, slice(w, l2)?, slice(b, l3)?, d))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(b)) => {
                CpuStorage::BF16(fwd(self, slice(x, l1)?, slice(w, l2)?, slice(b, l3)?, d))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w), CpuStorage::F16(b)) => {
                CpuStorage::F16(fwd(self, slice(x, l1)?, slice(w, l2)?, slice(b, l3)?, d))
            }
            _ => candle_core::bail!(
                "{}: input, weight and bias must share one float dtype",
                self.name()
            ),
        };
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::norm_fwd(
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.eps,
            self.remove_mean,
            self.has_bias,
        )
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let n = x.elem_count();
        let flat = x.apply_op3_no_bwd(
            w,
            &grad.contiguous()?,
            &NormBwd {
                eps: self.eps,
                remove_mean: self.remove_mean,
            },
        )?;
        let dx = flat.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = flat.narrow(0, n, d)?.reshape(w.shape())?;
        let db = self
            .has_bias
            .then(|| flat.narrow(0, n + d, d)?.reshape(w.shape()))
            .transpose()?;
        Ok((Some(dx), Some(dw), db))
    }
}

/// The backward op: `(x, weight, dy)` → `[dx (all of x), dweight (d), dbias (d)]`, flat.
struct NormBwd {
    eps: f32,
    remove_mean: bool,
}

fn bwd<T: Elem>(op: &NormBwd, x: &[T], w: &[T], dy: &[T], d: usize) -> Vec<T> {
    let n = x.len();
    let mut dx = vec![T::of(0.0); n];
    let (dw, db) = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .inline_when_single()
        .zip(x.par_chunks(d * ROWS_PER_TASK).inline_when_single())
        .zip(dy.par_chunks(d * ROWS_PER_TASK).inline_when_single())
        .map(|((dxs, xs), dys)| {
            let mut acc = (vec![0f32; d], vec![0f32; d], vec![0f32; d]);
            for ((dxr, xr), dyr) in dxs.chunks_mut(d).zip(xs.chunks(d)).zip(dys.chunks(d)) {
                bwd_row(op, dxr, xr, dyr, w, &mut acc);
            }
            (acc.1, acc.2)
        })
        .reduce(
            || (vec![0f32; d], vec![0f32; d]),
            |(mut a, mut b), (c, e)| {
                a.iter_mut().zip(c).for_each(|(a, c)| *a += c);
                b.iter_mut().zip(e).for_each(|(b, e)| *b += e);
                (a, b)
            },
        );
    dx.extend(dw.into_iter().chain(db).map(T::of));
    dx
}

impl CustomOp3 for NormBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = l2.shape().elem_count().max(1);
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(w), CpuStorage::F32(g)) => {
                CpuStorage::F32(bwd(self, slice(x, l1)?, slice(w, l2)?, slice(g, l3)?, d))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w), CpuStorage::F64(g)) => {
                CpuStorage::F64(bwd(self, slice(x, l1)?, slice(w, l2)?, slice(g, l3)?, d))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w), CpuStorage::BF16(g)) => {
                CpuStorage::BF16(bwd(self, slice(x, l1)?, slice(w, l2)?, slice(g, l3)?, d))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w), CpuStorage::F16(g)) => {
                CpuStorage::F16(bwd(self, slice(x, l1)?, slice(w, l2)?, slice(g, l3)?, d))
            }
            _ => candle_core::bail!("{}: one float dtype expected", self.name()),
        };
        let len = l1.shape().elem_count() + 2 * d;
        Ok((out, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::norm_bwd((s1, l1), (s2, l2), (s3, l3), self.eps, self.remove_mean)
    }
}

/// The fused norm of `x` over its last dimension, or Candle's composed ops off the CPU.
fn norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, remove_mean: bool, eps: f64) -> Result<Tensor> {
    if !fused(x)? || w.dtype() != x.dtype() || !w.device().same_device(x.device()) {
        return match (remove_mean, b) {
            (true, Some(b)) => candle_nn::ops::layer_norm_slow(x, w, b, eps as f32),
            (true, None) => candle_nn::ops::layer_norm_slow(x, w, &w.zeros_like()?, eps as f32),
            (false, _) => {
                let y = candle_nn::ops::rms_norm_slow(x, w, eps as f32)?;
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        };
    }
    let d = x.dims().last().copied().unwrap_or(0);
    if w.elem_count() != d || b.is_some_and(|b| b.elem_count() != d) {
        candle_core::bail!(
            "accelerate_rs::nn norm: weight/bias of {} elements for a last dimension of {d}",
            w.elem_count()
        );
    }
    let op = NormFwd {
        eps: eps as f32,
        remove_mean,
        has_bias: b.is_some(),
    };
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
        // No bias: the weight stands in for it and gets no gradient through it.
        None => x.apply_op3(&w, &w.detach(), op),
    }
}

/// Layer normalization over the last dimension with a fused, differentiable CPU kernel: the
/// same parameters and results as `candle_nn::LayerNorm`, but gradients flow to the input and
/// the parameters.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Option<Tensor>,
    remove_mean: bool,
    eps: f64,
}

impl LayerNorm {
    /// From a weight, a bias and `eps` (like `candle_nn::LayerNorm::new`).
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: Some(bias),
            remove_mean: true,
            eps,
        }
    }
    /// Without a bias.
    pub fn new_no_bias(weight: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias: None,
            remove_mean: true,
            eps,
        }
    }
    /// The scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The shift, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        norm(
            x,
            &self.weight,
            self.bias.as_ref(),
            self.remove_mean,
            self.eps,
        )
    }
}

/// `candle_nn::layer_norm`'s signature: the same variables (`weight`, `bias`) from `vb`.
pub fn layer_norm<C: Into<LayerNormConfig>>(
    size: usize,
    config: C,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    let inner = candle_nn::layer_norm(size, config, vb)?;
    Ok(LayerNorm {
        weight: inner.weight().clone(),
        bias: inner.bias().cloned(),
        remove_mean: config.remove_mean,
        eps: config.eps,
    })
}

/// RMS normalization over the last dimension with a fused, differentiable CPU kernel (the same
/// parameters and results as `candle_nn::RmsNorm`).
#[derive(Clone, Debug)]
pub struct RmsNorm(LayerNorm);

impl RmsNorm {
    /// From a weight and `eps` (like `candle_nn::RmsNorm::new`).
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm(LayerNorm {
            weight,
            bias: None,
            remove_mean: false,
            eps,
        })
    }
    /// The scale.
    pub fn weight(&self) -> &Tensor {
        &self.0.weight
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// `candle_nn::rms_norm`'s signature: the same variable (`weight`) from `vb`.
pub fn rms_norm(size: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<RmsNorm> {
    let inner = candle_nn::rms_norm(size, eps, vb)?;
    Ok(RmsNorm::new(inner.into_inner().weight().clone(), eps))
}
