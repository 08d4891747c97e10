//! Softmax over the last dimension with a fused forward and a fused backward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use half::{bf16, f16};
use rayon::prelude::*;

fn slice<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("accelerate_rs::nn: the input must be contiguous"),
    }
}

macro_rules! per_dtype {
    ($s:expr, $l:expr, $f:ident, $d:expr) => {
        match $s {
            CpuStorage::F32(x) => CpuStorage::F32($f(slice(x, $l)?, $d, |v| v, |v| v)),
            CpuStorage::F64(x) => {
                CpuStorage::F64($f(slice(x, $l)?, $d, |v| v as f32, |v| v as f64))
            }
            CpuStorage::BF16(x) => {
                CpuStorage::BF16($f(slice(x, $l)?, $d, bf16::to_f32, bf16::from_f32))
            }
            CpuStorage::F16(x) => {
                CpuStorage::F16($f(slice(x, $l)?, $d, f16::to_f32, f16::from_f32))
            }
            _ => {
                candle_core::bail!("accelerate_rs::nn::softmax_last_dim: a float dtype is expected")
            }
        }
    };
}

fn fwd<T: Copy + Send + Sync>(
    x: &[T],
    d: usize,
    to: impl Fn(T) -> f32 + Sync,
    of: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = x.to_vec();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, row)| {
            let max = row.iter().map(|v| to(*v)).fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|v| (to(*v) - max).exp()).sum();
            for (o, v) in o.iter_mut().zip(row) {
                *o = of((to(*v) - max).exp() / sum);
            }
        });
    out
}

struct SoftmaxFwd;

impl CustomOp1 for SoftmaxFwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-softmax-last-dim"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(1).max(1);
        Ok((per_dtype!(s, l, fwd, d), l.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBwd)?,
        ))
    }
}

/// `(y, dy)` → `dx = y * (dy - sum(dy * y))` per row.
struct SoftmaxBwd;

fn bwd_rows<T: Copy + Send + Sync>(
    y: &[T],
    dy: &[T],
    d: usize,
    to: impl Fn(T) -> f32 + Sync,
    of: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = y.to_vec();
    out.par_chunks_mut(d)
        .zip(y.par_chunks(d).zip(dy.par_chunks(d)))
        .for_each(|(o, (yr, gr))| {
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| to(*a) * to(*b)).sum();
            for ((o, a), b) in o.iter_mut().zip(yr).zip(gr) {
                *o = of(to(*a) * (to(*b) - dot));
            }
        });
    out
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-softmax-backward"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = l1.dims().last().copied().unwrap_or(1).max(1);
        let out = match (s1, s2) {
            (CpuStorage::F32(y), CpuStorage::F32(g)) => {
                CpuStorage::F32(bwd_rows(slice(y, l1)?, slice(g, l2)?, d, |v| v, |v| v))
            }
            (CpuStorage::F64(y), CpuStorage::F64(g)) => CpuStorage::F64(bwd_rows(
                slice(y, l1)?,
                slice(g, l2)?,
                d,
                |v| v as f32,
                |v| v as f64,
            )),
            (CpuStorage::BF16(y), CpuStorage::BF16(g)) => CpuStorage::BF16(bwd_rows(
                slice(y, l1)?,
                slice(g, l2)?,
                d,
                bf16::to_f32,
                bf16::from_f32,
            )),
            (CpuStorage::F16(y), CpuStorage::F16(g)) => CpuStorage::F16(bwd_rows(
                slice(y, l1)?,
                slice(g, l2)?,
                d,
                f16::to_f32,
                f16::from_f32,
            )),
            _ => candle_core::bail!("{}: one float dtype expected", self.name()),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// Softmax over the last dimension, fused and differentiable on the CPU (Candle's
/// `candle_nn::ops::softmax_last_dim` has no backward pass); Candle's composed, differentiable
/// softmax elsewhere.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu()
        || !matches!(
            x.dtype(),
            DType::F32 | DType::F64 | DType::BF16 | DType::F16
        )
    {
        return candle_nn::ops::softmax(x, D::Minus1);
    }
    x.contiguous()?.apply_op1(SoftmaxFwd)
}
