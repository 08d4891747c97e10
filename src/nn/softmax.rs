//! Softmax over the last dimension with a fused forward and a fused backward, plain or scaled and
//! causally masked in the same pass (attention scores: no separate scaling, mask addition or
//! their backward passes over the `[B, H, T, T]` scores).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::elem::{
    binary_float, exp_f32, fused_cpu, max_by, slice, sum2_by, sum_by, unary_float, Elem,
};

/// `softmax(scale * x)` per row of `d`; when `causal` holds `(t_q, t_k)`, row `r` is query
/// `i = r % t_q` and sees keys `0..=i + t_k - t_q` only (the rest gets 0).
#[derive(Clone, Copy)]
struct SoftmaxFwd {
    scale: f32,
    causal: Option<(usize, usize)>,
}

fn fwd<T: Elem>(x: &[T], d: usize, op: SoftmaxFwd) -> Vec<T> {
    // Zeros: the masked tail of each row stays 0.
    let mut out = vec![T::of(0.0); x.len()];
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .enumerate()
        .for_each_init(
            || vec![0f32; d],
            |e, (r, (o, row))| {
                let seen = match op.causal {
                    Some((tq, tk)) => (r % tq + tk - tq + 1).min(d),
                    None => d,
                };
                let (e, row) = (&mut e[..seen], &row[..seen]);
                let max = max_by(row, |v| op.scale * v);
                for (e, v) in e.iter_mut().zip(row) {
                    *e = exp_f32(op.scale * v.f() - max);
                }
                let inv = 1.0 / sum_by(e, |v| v);
                for (o, e) in o.iter_mut().zip(e.iter()) {
                    *o = T::of(e * inv);
                }
            },
        );
    out
}

impl CustomOp1 for SoftmaxFwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-softmax-last-dim"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(1).max(1);
        Ok((
            unary_float!(self.name(), s, l, fwd, d, *self),
            l.shape().clone(),
        ))
    }
    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let bwd = SoftmaxBwd { scale: self.scale };
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &bwd)?))
    }
}

/// `(y, dy)` → `dx = scale * y * (dy - sum(dy * y))` per row (masked entries have `y = 0`).
struct SoftmaxBwd {
    scale: f32,
}

fn bwd<T: Elem>(y: &[T], dy: &[T], d: usize, scale: f32) -> Vec<T> {
    let mut out = vec![T::of(0.0); y.len()];
    out.par_chunks_mut(d)
        .zip(y.par_chunks(d).zip(dy.par_chunks(d)))
        .for_each(|(o, (yr, gr))| {
            let dot = sum2_by(yr, gr, |a, b| a * b);
            for ((o, a), b) in o.iter_mut().zip(yr).zip(gr) {
                *o = T::of(scale * a.f() * (b.f() - dot));
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
        let out = binary_float!(self.name(), s1, l1, s2, l2, bwd, d, self.scale);
        Ok((out, l1.shape().clone()))
    }
}

/// Softmax over the last dimension, fused and differentiable on the CPU (Candle's
/// `candle_nn::ops::softmax_last_dim` has no backward pass); Candle's composed, differentiable
/// softmax elsewhere.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !fused_cpu(x) {
        return candle_nn::ops::softmax(x, D::Minus1);
    }
    x.contiguous()?.apply_op1(SoftmaxFwd {
        scale: 1.0,
        causal: None,
    })
}

/// Causal attention weights from raw scores `x` of shape `[..., T_q, T_k]` (`T_q <= T_k`):
/// `softmax(scale * x + mask)` over the last dimension, where query `i` sees keys
/// `0..=i + T_k - T_q` and the rest get weight 0 — the same as scaling the scores, adding a
/// `-inf` upper-triangular mask and taking the softmax, in one pass forward and one backward on
/// the CPU (Candle's composed ops elsewhere). `scale` is usually `1 / sqrt(head_dim)`.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor};
/// let scores = Tensor::ones((1, 2, 3, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let att = accelerate_rs::nn::causal_softmax(&scores, 0.5)?;
/// // The first query sees only the first key; the last sees all three equally.
/// assert_eq!(att.get(0)?.get(0)?.to_vec2::<f32>()?[0], [1.0, 0.0, 0.0]);
/// # Ok(()) }
/// ```
pub fn causal_softmax(x: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = x.dims();
    let (tq, tk) = match dims {
        [.., tq, tk] if tq <= tk => (*tq, *tk),
        _ => candle_core::bail!(
            "accelerate_rs::nn::causal_softmax: scores of shape [..., T_q, T_k] with T_q <= T_k \
             expected, got {dims:?}"
        ),
    };
    if !fused_cpu(x) {
        let mask: Vec<f32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| {
                    if j <= i + tk - tq {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (tq, tk), x.device())?.to_dtype(x.dtype())?;
        return candle_nn::ops::softmax(&(x * scale)?.broadcast_add(&mask)?, D::Minus1);
    }
    if tq == 0 || tk == 0 {
        return x.contiguous();
    }
    x.contiguous()?.apply_op1(SoftmaxFwd {
        scale: scale as f32,
        causal: Some((tq, tk)),
    })
}
