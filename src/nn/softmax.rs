//! Softmax over the last dimension with a fused forward and a fused backward, plain or scaled and
//! causally masked in the same pass (attention scores: no separate scaling, mask addition or
//! their backward passes over the `[B, H, T, T]` scores).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{
    binary_float, exp_f32, fused, max_by, multiversion, slice, sum2_by, sum_by, unary_float, Elem,
};

/// `softmax(scale * x)` per row of `d`; when `causal` holds `(t_q, t_k)`, row `r` is query
/// `i = r % t_q` and sees keys `0..=i + t_k - t_q` only (the rest gets 0).
#[derive(Clone, Copy)]
pub(super) struct SoftmaxFwd {
    scale: f32,
    causal: Option<(usize, usize)>,
}

impl SoftmaxFwd {
    /// `softmax(scale * x)` per row, with the causal mask of `(t_q, t_k)` when given.
    pub(super) fn new(scale: f32, causal: Option<(usize, usize)>) -> Self {
        SoftmaxFwd { scale, causal }
    }
}

fn fwd<T: Elem>(x: &[T], d: usize, op: SoftmaxFwd) -> Vec<T> {
    // Zeros: the masked tail of each row stays 0.
    let mut out = vec![T::of(0.0); x.len()];
    out.par_chunks_mut(d)
        .inline_when_single()
        .zip(x.par_chunks(d).inline_when_single())
        .enumerate()
        .for_each_init(
            || vec![0f32; d],
            |e, (r, (o, row))| {
                let seen = match op.causal {
                    Some((tq, tk)) => (r % tq + tk - tq + 1).min(d),
                    None => d,
                };
                let e = &mut e[..seen];
                for (e, v) in e.iter_mut().zip(row) {
                    *e = op.scale * v.f();
                }
                softmax_in_place(e, false);
                for (o, e) in o.iter_mut().zip(e.iter()) {
                    *o = T::of(*e);
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
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::softmax_fwd(s, l, self.scale, self.causal)
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let bwd = SoftmaxBwd { scale: self.scale };
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &bwd)?))
    }
}

/// `(y, dy)` → `dx = scale * y * (dy - sum(dy * y))` per row (masked entries have `y = 0`).
pub(super) struct SoftmaxBwd {
    scale: f32,
}

impl SoftmaxBwd {
    /// The backward pass of a softmax of `scale * x`.
    pub(super) fn new(scale: f32) -> Self {
        SoftmaxBwd { scale }
    }
}

fn bwd<T: Elem>(y: &[T], dy: &[T], d: usize, scale: f32) -> Vec<T> {
    let mut out = dy.to_vec();
    out.par_chunks_mut(d)
        .inline_when_single()
        .zip(y.par_chunks(d).inline_when_single())
        .for_each(|(g, yr)| softmax_grad_in_place(g, yr, scale));
    out
}

multiversion! {
    /// `softmax(row)` in place, in f32 arithmetic. A row whose entries are all `-inf` (e.g. fully
    /// masked) becomes all 0 if `empty_is_zero`, else NaN (as Candle's and PyTorch's softmax).
    pub(super) fn softmax_in_place<T: Elem>(row: &mut [T], empty_is_zero: bool) {
        let max = max_by(row, |v| v);
        if empty_is_zero && max == f32::NEG_INFINITY {
            row.fill(T::of(0.0));
            return;
        }
        for s in row.iter_mut() {
            *s = T::of(exp_f32(s.f() - max));
        }
        let inv = 1.0 / sum_by(row, |v| v);
        for s in row.iter_mut() {
            *s = T::of(s.f() * inv);
        }
    }
}

multiversion! {
    /// The softmax's backward in place: `g = scale · p ∘ (g − Σ p ∘ g)` for weights `p`.
    pub(super) fn softmax_grad_in_place<T: Elem>(g: &mut [T], p: &[T], scale: f32) {
        let dot = sum2_by(p, g, |a, b| a * b);
        for (g, w) in g.iter_mut().zip(p) {
            *g = T::of(scale * w.f() * (g.f() - dot));
        }
    }
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::softmax_bwd((s1, l1), (s2, l2), self.scale)
    }
}

/// Softmax over the last dimension, fused and differentiable on the CPU (Candle's
/// `candle_nn::ops::softmax_last_dim` has no backward pass); Candle's composed, differentiable
/// softmax elsewhere.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !fused(x)? {
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
    if !fused(x)? {
        return causal_softmax_composed(x, scale, tq, tk);
    }
    if tq == 0 || tk == 0 {
        return x.contiguous();
    }
    x.contiguous()?.apply_op1(SoftmaxFwd {
        scale: scale as f32,
        causal: Some((tq, tk)),
    })
}

/// [`causal_softmax`] with Candle's composed ops (devices other than the CPU). The mask is
/// built once per device and size, on the device (shared with the composed attention).
fn causal_softmax_composed(x: &Tensor, scale: f64, tq: usize, tk: usize) -> Result<Tensor> {
    let dims = x.dims();
    let visible = super::mask::causal_mask(tq, tk, x.device())?.broadcast_as(dims)?;
    let neg = Tensor::new(f32::NEG_INFINITY, x.device())?
        .to_dtype(x.dtype())?
        .broadcast_as(dims)?;
    candle_nn::ops::softmax(&visible.where_cond(&(x * scale)?, &neg)?, D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The composed path (what runs on a GPU) equals the fused op.
    #[test]
    fn the_composed_causal_softmax_equals_the_fused_op() {
        let x = Tensor::randn(0f32, 1.0, (2, 3, 4, 6), &candle_core::Device::Cpu).unwrap();
        let fused = causal_softmax(&x, 0.7).unwrap();
        let composed = causal_softmax_composed(&x, 0.7, 4, 6).unwrap();
        let d = crate::nn::elem::max_diff(&fused, &composed);
        assert!(d < 1e-6, "{d}");
    }

    #[test]
    fn both_builds_of_the_row_kernels_give_the_same_bits() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for n in [1usize, 7, 8, 9, 128, 1000] {
            let row: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
                .collect();
            let (mut a, mut b) = (row.clone(), row.clone());
            a[0] = f32::NEG_INFINITY;
            b[0] = f32::NEG_INFINITY;
            softmax_in_place(&mut a, true);
            softmax_in_place::portable(&mut b, true);
            assert_eq!(bits(&a), bits(&b), "softmax n {n}");
            assert!((a.iter().sum::<f32>() - if n > 1 { 1.0 } else { 0.0 }).abs() < 1e-5);
            let (mut g1, mut g2) = (row.clone(), row.clone());
            softmax_grad_in_place(&mut g1, &a, 0.5);
            softmax_grad_in_place::portable(&mut g2, &a, 0.5);
            assert_eq!(bits(&g1), bits(&g2), "softmax backward n {n}");
        }
        // All -inf: zeros when asked, else NaN like Candle's softmax.
        let mut z = [f32::NEG_INFINITY; 3];
        softmax_in_place(&mut z, false);
        assert!(z.iter().all(|v| v.is_nan()));
        // A row of NaN (a model with NaN weights) is not a masked row: NaN comes out, as from
        // PyTorch, even where fully masked rows give zeros.
        for n in [3usize, 8, 19] {
            let mut nan = vec![f32::NAN; n];
            softmax_in_place(&mut nan, true);
            assert!(nan.iter().all(|v| v.is_nan()), "n {n}");
            let mut one = vec![0.25f32; n];
            one[n / 2] = f32::NAN;
            softmax_in_place(&mut one, true);
            assert!(one.iter().all(|v| v.is_nan()), "n {n}");
        }
    }

    /// The fused causal softmax and attention propagate NaN scores instead of writing zeros.
    #[test]
    fn nan_scores_give_nan() {
        let x = Tensor::full(f32::NAN, (1, 1, 4, 4), &candle_core::Device::Cpu).unwrap();
        let y = causal_softmax(&x, 1.0).unwrap();
        let v = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // Every key a query sees is NaN; the causally masked ones stay 0.
        for (i, v) in v.iter().enumerate() {
            let (q, k) = (i / 4, i % 4);
            assert_eq!(v.is_nan(), k <= q, "query {q} key {k}: {v}");
        }
    }
}
