//! Cross-entropy with the log-softmax and the negative log-likelihood fused: one pass over the
//! logits forward, one backward, no `[N, C]` intermediate kept between them.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::par::Inline;

use super::cross_entropy_options::CrossEntropyOptions;
use super::elem::{exp_f32, fused, max_by, multiversion, slice, sum_by, unary_float, Elem};

/// The mean cross-entropy of `logits` (`[N, C]`, unnormalized) against `targets` (`[N]` class
/// indices, u8/u32/i64): `candle_nn::loss::cross_entropy`'s signature and result, fused and
/// differentiable on the CPU (f32, f64, bf16, f16, computed in f32), Candle's composed ops
/// elsewhere.
///
/// Logits of higher rank, `[..., C]` (a language model's `[B, T, vocab]`), are taken as their
/// rows without a reshape, against targets of the leading shape (`[B, T]`) or flattened
/// (`[B * T]`).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_with(logits, targets, CrossEntropyOptions::default())
}

/// [`cross_entropy`] with label smoothing and an ignored target (see [`CrossEntropyOptions`]).
///
/// A target outside `0..C` (other than the ignored value) is an error naming its row.
pub fn cross_entropy_with(
    logits: &Tensor,
    targets: &Tensor,
    options: CrossEntropyOptions,
) -> Result<Tensor> {
    let (t, n, c) = checked_targets(logits.dims(), targets, options)?;
    if !fused(logits)? {
        return composed(&logits.reshape((n, c))?, &targets.flatten_all()?, options);
    }
    let op = loss_op(t, targets, options, logits.device())?;
    logits.contiguous()?.apply_op1_arc(Arc::new(op))
}

/// A fused cross-entropy op on the logits (a `CustomOp1` with its backward pass): the CPU's or
/// a GPU's.
pub(super) type LossOp = Box<dyn CustomOp1 + Send + Sync>;

/// The fused cross-entropy op for logits on `device`: [`CrossEntropy`] on the CPU, the CUDA
/// kernels' op on a GPU. `t`: the targets as [`checked_targets`] read them, one per row;
/// `targets`: the same tensor as given (a GPU's kernels read it on the device: no copy when it
/// is there already).
pub(super) fn loss_op(
    t: Vec<i64>,
    targets: &Tensor,
    options: CrossEntropyOptions,
    device: &candle_core::Device,
) -> Result<LossOp> {
    if device.is_cpu() {
        return Ok(Box::new(CrossEntropy::new(t, options)));
    }
    #[cfg(feature = "cuda")]
    {
        let counted = t
            .iter()
            .filter(|&&v| Some(v) != options.ignore_index)
            .count();
        let t = targets
            .flatten_all()?
            .to_dtype(DType::I64)?
            .to_device(device)?
            .contiguous()?;
        Ok(Box::new(super::cuda::CrossEntropyCuda::new(
            t, options, counted,
        )))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = targets;
        candle_core::bail!("accelerate-rs-cross-entropy: no GPU cross-entropy in this build")
    }
}

/// The targets as i64 (`[N]` for logits `dims` = `[..., C]`), checked against `dims` and the
/// options: `(targets, N, C)`.
pub(super) fn checked_targets(
    dims: &[usize],
    targets: &Tensor,
    options: CrossEntropyOptions,
) -> Result<(Vec<i64>, usize, usize)> {
    let (lead, c) = match dims {
        [lead @ .., c] if !lead.is_empty() => (lead, *c),
        _ => candle_core::bail!(
            "accelerate_rs::nn::cross_entropy: logits must be [N, C] (or [..., C]), got {dims:?}"
        ),
    };
    let n: usize = lead.iter().product();
    if targets.dims() != [n] && targets.dims() != lead {
        candle_core::bail!(
            "accelerate_rs::nn::cross_entropy: targets must be [N] = [{n}] for logits {:?}, got {:?}",
            dims,
            targets.dims()
        );
    }
    if !matches!(targets.dtype(), DType::U8 | DType::U32 | DType::I64) {
        candle_core::bail!(
            "accelerate_rs::nn::cross_entropy: targets must be class indices (u8, u32 or i64), got {:?}",
            targets.dtype()
        );
    }
    let eps = options.label_smoothing;
    if !(0.0..1.0).contains(&eps) {
        candle_core::bail!(
            "accelerate_rs::nn::cross_entropy: label_smoothing must be in [0, 1), got {eps}"
        );
    }
    let t: Vec<i64> =
        crate::readback::counted(|| targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1())?;
    if let Some((row, bad)) = t
        .iter()
        .enumerate()
        .find(|(_, &v)| Some(v) != options.ignore_index && !(0..c as i64).contains(&v))
    {
        candle_core::bail!(
            "accelerate_rs::nn::cross_entropy: the target of row {row} is {bad}, outside 0..{c} (the number of classes)"
        );
    }
    Ok((t, n, c))
}

/// The same loss with Candle's differentiable ops (other devices and dtypes; the tests'
/// reference).
pub(crate) fn composed(
    logits: &Tensor,
    targets: &Tensor,
    options: CrossEntropyOptions,
) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let t = targets.to_dtype(DType::I64)?;
    let eps = options.label_smoothing;
    let keep = match options.ignore_index {
        Some(i) => t.ne(i)?,
        None => t.ones_like()?.to_dtype(DType::U8)?,
    };
    // Ignored rows pick class 0 (then masked out).
    let safe = keep.where_cond(&t, &t.zeros_like()?)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let mut per_row = (picked * (1.0 - eps))?;
    if eps > 0.0 {
        per_row = (per_row + (logp.mean(1)? * eps)?)?;
    }
    let mask = keep.to_dtype(logits.dtype())?;
    let total = (per_row.neg()? * &mask)?.sum_all()?;
    total / crate::readback::counted(|| mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>())?
}

/// The fused op; its targets are fixed (not differentiated).
pub(super) struct CrossEntropy {
    targets: Arc<Vec<i64>>,
    eps: f32,
    ignore: Option<i64>,
    /// Each row's log-sum-exp, kept by the forward pass for the backward one (which then takes
    /// one `exp` per logit instead of two).
    lse: Mutex<Option<Arc<Vec<f32>>>>,
    /// Each row's `1 / Σ exp(x - max)`, kept by [`CrossEntropy::loss_in_place`] (whose rows then
    /// hold `exp(x - max)`, so that the backward pass takes no `exp` at all).
    inv: Mutex<Option<Arc<Vec<f32>>>>,
}

impl CrossEntropy {
    pub(super) fn new(targets: Vec<i64>, options: CrossEntropyOptions) -> Self {
        CrossEntropy {
            targets: Arc::new(targets),
            eps: options.label_smoothing as f32,
            ignore: options.ignore_index,
            lse: Mutex::new(None),
            inv: Mutex::new(None),
        }
    }

    /// The mean loss of the logits in `s` (rows of `c`), as a scalar storage of their dtype;
    /// keeps the rows' log-sum-exps for [`CrossEntropy::grad_op`].
    pub(super) fn loss(&self, s: &CpuStorage, l: &Layout, c: usize) -> Result<CpuStorage> {
        let mean = |sum: f64| sum / self.counted() as f64;
        Ok(match s {
            CpuStorage::F32(x) => {
                CpuStorage::F32(vec![mean(forward(slice(x, l)?, c, self)) as f32])
            }
            CpuStorage::F64(x) => CpuStorage::F64(vec![mean(forward(slice(x, l)?, c, self))]),
            CpuStorage::BF16(x) => {
                CpuStorage::BF16(vec![bf16::from_f64(mean(forward(slice(x, l)?, c, self)))])
            }
            CpuStorage::F16(x) => {
                CpuStorage::F16(vec![f16::from_f64(mean(forward(slice(x, l)?, c, self)))])
            }
            _ => candle_core::bail!("accelerate-rs-cross-entropy: a float dtype is expected"),
        })
    }

    /// [`CrossEntropy::loss`] of contiguous f32 logits (`s`, rows of `c`) that then overwrites
    /// each row with `exp(x - max)`, for [`grad_in_place_exp`]: `(loss, true)`. Other dtypes are
    /// left as they are (`(loss, false)`: their rounding would change the softmax).
    pub(super) fn loss_in_place(
        &self,
        s: &mut CpuStorage,
        l: &Layout,
        c: usize,
    ) -> Result<(CpuStorage, bool)> {
        if let (CpuStorage::F32(x), Some((a, b))) = (&mut *s, l.contiguous_offsets()) {
            if let Some(x) = x.get_mut(a..b) {
                let mean = forward_in_place(x, c, self) / self.counted() as f64;
                return Ok((CpuStorage::F32(vec![mean as f32]), true));
            }
        }
        Ok((self.loss(s, l, c)?, false))
    }

    /// The backward op for the upstream gradient `grad` (a scalar).
    pub(super) fn grad_op(&self, grad: &Tensor) -> Result<CrossEntropyGrad> {
        let g = crate::readback::counted(|| grad.to_dtype(DType::F32)?.to_scalar::<f32>())?;
        Ok(CrossEntropyGrad {
            targets: Arc::clone(&self.targets),
            eps: self.eps,
            ignore: self.ignore,
            scale: g / self.counted() as f32,
            lse: self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            inv: self.inv.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        })
    }

    /// Rows that count (not ignored).
    fn counted(&self) -> usize {
        self.targets
            .iter()
            .filter(|&&t| Some(t) != self.ignore)
            .count()
    }
}

multiversion! {
    /// Max and log-sum-exp of one row, in f32.
    fn row_lse<T: Elem>(row: &[T]) -> (f32, f32) {
        let max = max_by(row, |v| v);
        let sum = sum_by(row, |v| exp_f32(v - max));
        (max, max + sum.ln())
    }
}

multiversion! {
    /// [`row_lse`] that also overwrites the row with `exp(x - max)` (the same sums in the same
    /// order, so the same bits).
    fn row_lse_exp<T: Elem>(row: &mut [T]) -> (f32, f32) {
        let max = max_by(row, |v| v);
        let mut acc = [0f32; 8];
        let mut chunks = row.chunks_exact_mut(8);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                let e = exp_f32(v.f() - max);
                *v = T::of(e);
                *a += e;
            }
        }
        let mut rest = 0f32;
        for v in chunks.into_remainder() {
            let e = exp_f32(v.f() - max);
            *v = T::of(e);
            rest += e;
        }
        let sum = rest + acc.iter().sum::<f32>();
        (max, max + sum.ln())
    }
}

multiversion! {
    /// [`grad_row`] for a row holding `exp(x - max)` (from [`row_lse_exp`]): the softmax is
    /// that times `inv = exp(max - lse)`, so no `exp` is taken here.
    fn grad_row_exp<T: Elem>(row: &mut [T], t: usize, inv: f32, uniform: f32, scale: f32, eps: f32) {
        let et = row.get(t).map(|v| v.f());
        for v in row.iter_mut() {
            *v = T::of((v.f() * inv - uniform) * scale);
        }
        if let (Some(v), Some(et)) = (row.get_mut(t), et) {
            *v = T::of((et * inv - uniform - (1.0 - eps)) * scale);
        }
    }
}

multiversion! {
    /// One row's gradient in place: `(softmax - uniform) * scale`, less `(1 - eps) * scale` at
    /// the target `t` (`xt`, its logit, read before the row was overwritten).
    fn grad_row<T: Elem>(row: &mut [T], t: usize, xt: Option<f32>, lse: f32, uniform: f32, scale: f32, eps: f32) {
        for v in row.iter_mut() {
            *v = T::of((exp_f32(v.f() - lse) - uniform) * scale);
        }
        if let (Some(v), Some(xt)) = (row.get_mut(t), xt) {
            *v = T::of((exp_f32(xt - lse) - uniform - (1.0 - eps)) * scale);
        }
    }
}

/// The summed loss of the counted rows (f64 accumulation across rows); keeps each row's
/// log-sum-exp in `op.lse`.
fn forward<T: Elem>(x: &[T], c: usize, op: &CrossEntropy) -> f64 {
    let eps = op.eps;
    let mut lses = vec![0f32; op.targets.len()];
    let sum = x
        .par_chunks(c)
        .inline_when_single()
        .zip(op.targets.par_iter().inline_when_single())
        .zip(lses.par_iter_mut().inline_when_single())
        .map(|((row, &t), keep)| {
            if Some(t) == op.ignore {
                return 0.0;
            }
            let (_, lse) = row_lse(row);
            *keep = lse;
            let xt = row.get(t as usize).map_or(f32::NAN, |v| v.f());
            let mut loss = lse - (1.0 - eps) * xt;
            if eps > 0.0 {
                loss -= eps * sum_by(row, |v| v) / c as f32;
            }
            loss as f64
        })
        .sum();
    *op.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(lses));
    sum
}

/// [`forward`] that overwrites each counted row with `exp(x - max)` (ignored rows are left as
/// they are) and keeps each row's `1 / Σ exp(x - max)` in `op.inv`.
fn forward_in_place<T: Elem>(x: &mut [T], c: usize, op: &CrossEntropy) -> f64 {
    let eps = op.eps;
    let n = op.targets.len();
    let (mut lses, mut invs) = (vec![0f32; n], vec![0f32; n]);
    let sum = x
        .par_chunks_mut(c)
        .inline_when_single()
        .zip(op.targets.par_iter().inline_when_single())
        .zip(
            lses.par_iter_mut()
                .inline_when_single()
                .zip(invs.par_iter_mut().inline_when_single()),
        )
        .map(|((row, &t), (keep, inv))| {
            if Some(t) == op.ignore {
                return 0.0;
            }
            let xt = row.get(t as usize).map_or(f32::NAN, |v| v.f());
            let smooth = if eps > 0.0 {
                eps * sum_by(row, |v| v) / c as f32
            } else {
                0.0
            };
            let (max, lse) = row_lse_exp(row);
            *keep = lse;
            *inv = exp_f32(max - lse);
            let mut loss = lse - (1.0 - eps) * xt;
            if eps > 0.0 {
                loss -= smooth;
            }
            loss as f64
        })
        .sum();
    *op.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(lses));
    *op.inv.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(invs));
    sum
}

/// [`grad_in_place`] over rows left by [`forward_in_place`] (`exp(x - max)`), with their
/// `1 / Σ exp(x - max)` in `invs`.
pub(super) fn grad_in_place_exp<T: Elem>(
    z: &mut [T],
    c: usize,
    op: &CrossEntropyGrad,
    invs: &[f32],
) {
    let (eps, scale) = (op.eps, op.scale);
    let uniform = eps / c as f32;
    z.par_chunks_mut(c)
        .inline_when_single()
        .zip(op.targets.par_iter().inline_when_single())
        .zip(invs.par_iter().inline_when_single())
        .for_each(|((row, &t), &inv)| {
            if Some(t) == op.ignore {
                row.iter_mut().for_each(|v| *v = T::of(0.0));
                return;
            }
            grad_row_exp(row, t as usize, inv, uniform, scale, eps);
        });
}

/// d(loss)/d(logits) times `scale` (the incoming gradient over the counted rows), over the
/// logits `z` in place; `lses` are the rows' log-sum-exps from the forward pass, when there.
pub(super) fn grad_in_place<T: Elem>(
    z: &mut [T],
    c: usize,
    op: &CrossEntropyGrad,
    lses: Option<&[f32]>,
) {
    let (eps, scale) = (op.eps, op.scale);
    let uniform = eps / c as f32;
    z.par_chunks_mut(c)
        .inline_when_single()
        .zip(op.targets.par_iter().inline_when_single())
        .enumerate()
        .for_each(|(i, (row, &t))| {
            if Some(t) == op.ignore {
                row.iter_mut().for_each(|v| *v = T::of(0.0));
                return;
            }
            let lse = match lses.and_then(|l| l.get(i)) {
                Some(&lse) => lse,
                None => row_lse(row).1,
            };
            let t = t as usize;
            let xt = row.get(t).map(|v| v.f());
            grad_row(row, t, xt, lse, uniform, scale, eps);
        });
}

fn backward<T: Elem>(x: &[T], c: usize, op: &CrossEntropyGrad, lses: Option<&[f32]>) -> Vec<T> {
    let mut out: Vec<T> = x.to_vec();
    grad_in_place(&mut out, c, op, lses);
    out
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "accelerate-rs-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = l.dims().last().copied().unwrap_or(1).max(1);
        Ok((self.loss(s, l, c)?, Shape::from(())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = self.grad_op(grad)?;
        Ok(Some(arg.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

/// The gradient of [`CrossEntropy`] with respect to its logits, times `scale`.
pub(super) struct CrossEntropyGrad {
    targets: Arc<Vec<i64>>,
    eps: f32,
    ignore: Option<i64>,
    scale: f32,
    /// The forward pass's log-sum-exps (recomputed when absent or of another length).
    lse: Option<Arc<Vec<f32>>>,
    /// [`CrossEntropy::loss_in_place`]'s `1 / Σ exp(x - max)` per row, when it ran.
    inv: Option<Arc<Vec<f32>>>,
}

impl CrossEntropyGrad {
    /// The forward pass's log-sum-exps, when there for every row.
    pub(super) fn lses(&self) -> Option<&[f32]> {
        self.lse
            .as_deref()
            .filter(|v| v.len() == self.targets.len())
            .map(|v| v.as_slice())
    }

    /// [`CrossEntropy::loss_in_place`]'s `1 / Σ exp(x - max)`, when there for every row.
    pub(super) fn invs(&self) -> Option<&[f32]> {
        self.inv
            .as_deref()
            .filter(|v| v.len() == self.targets.len())
            .map(|v| v.as_slice())
    }
}

impl CustomOp1 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "accelerate-rs-cross-entropy-backward"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let c = l.dims().last().copied().unwrap_or(1).max(1);
        let out = unary_float!(self.name(), s, l, backward, c, self, self.lses());
        Ok((out, l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn logits(n: usize, c: usize, salt: usize) -> Tensor {
        let v: Vec<f32> = (0..n * c)
            .map(|i| (((i * 7919 + salt * 104729) % 1013) as f32 / 1013.0 - 0.5) * 6.0)
            .collect();
        Tensor::from_vec(v, (n, c), &Device::Cpu).unwrap()
    }

    fn targets(n: usize, c: usize, ignore: Option<i64>) -> Tensor {
        let v: Vec<i64> = (0..n)
            .map(|i| match ignore {
                Some(ig) if i % 3 == 1 => ig,
                _ => ((i * 5 + 2) % c) as i64,
            })
            .collect();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap()
    }

    /// The loss and the logits' gradient (of `loss * 1.7`).
    fn run(
        f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        x: &Tensor,
        t: &Tensor,
    ) -> (f64, Vec<f32>) {
        let v = Var::from_tensor(x).unwrap();
        let loss = f(v.as_tensor(), t).unwrap();
        let grads = (&loss * 1.7).unwrap().backward().unwrap();
        let g = grads.get(v.as_tensor()).unwrap();
        (
            loss.to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            g.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap(),
        )
    }

    #[test]
    fn fused_equals_composed_in_value_and_gradient() {
        let cases = [(1, 2), (5, 7), (33, 100), (128, 65), (64, 8000)];
        let options = [
            CrossEntropyOptions::default(),
            CrossEntropyOptions::default().label_smoothing(0.1),
            CrossEntropyOptions::default().ignore_index(-100),
            CrossEntropyOptions::default()
                .label_smoothing(0.2)
                .ignore_index(0),
        ];
        for (k, &(n, c)) in cases.iter().enumerate() {
            for o in options {
                for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                    // Non-contiguous input half the time: a transposed [C, N] tensor.
                    let x = if k % 2 == 0 {
                        logits(n, c, k).to_dtype(dtype).unwrap()
                    } else {
                        logits(c, n, k).t().unwrap().to_dtype(dtype).unwrap()
                    };
                    let t = targets(n, c, o.ignore_index);
                    let fused = run(&|x, t| cross_entropy_with(x, t, o), &x, &t);
                    let reference = run(
                        &|x, t| composed(&x.to_dtype(DType::F64)?, t, o)?.to_dtype(x.dtype()),
                        &x,
                        &t,
                    );
                    let tol = match dtype {
                        DType::BF16 => 3e-2,
                        DType::F16 => 5e-3,
                        _ => 2e-5,
                    };
                    let what = format!("n {n} c {c} {o:?} {dtype:?}");
                    if reference.0.is_nan() {
                        // Every row ignored (one row whose target is the ignored one).
                        assert!(fused.0.is_nan(), "{what}: loss {}, want NaN", fused.0);
                        assert!(fused.1.iter().all(|g| *g == 0.0), "{what}: {:?}", fused.1);
                        continue;
                    }
                    assert!(
                        (fused.0 - reference.0).abs() <= tol as f64 * (1.0 + reference.0.abs()),
                        "{what}: loss {} vs {}",
                        fused.0,
                        reference.0
                    );
                    let gmax = reference.1.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let diff = fused
                        .1
                        .iter()
                        .zip(&reference.1)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff <= tol * (gmax + 1e-3),
                        "{what}: gradient differs by {diff} (max {gmax})"
                    );
                }
            }
        }
    }

    #[test]
    fn plain_options_match_candle_nn() {
        let x = logits(17, 11, 3);
        let t = Tensor::from_vec(
            (0..17u32).map(|i| i % 11).collect::<Vec<_>>(),
            17,
            &Device::Cpu,
        )
        .unwrap();
        let a = run(&|x, t| cross_entropy(x, t), &x, &t);
        let b = run(&|x, t| candle_nn::loss::cross_entropy(x, t), &x, &t);
        assert!((a.0 - b.0).abs() < 1e-5, "{} vs {}", a.0, b.0);
        let diff =
            a.1.iter()
                .zip(&b.1)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(diff < 1e-6, "gradient differs by {diff}");
    }

    #[test]
    fn logits_of_higher_rank_equal_their_rows() {
        // [2, 3, 11] logits against [2, 3] or [6] targets: the loss and gradient of the [6, 11]
        // rows, with label smoothing and an ignored target.
        let x = logits(6, 11, 4);
        let t = Tensor::from_vec(vec![3u32, 0, 10, 7, 99, 5], 6, &Device::Cpu).unwrap();
        let opts = CrossEntropyOptions::default()
            .label_smoothing(0.1)
            .ignore_index(99);
        let flat = run(&|x, t| cross_entropy_with(x, t, opts), &x, &t);
        let x3 = x.reshape((2, 3, 11)).unwrap();
        for t in [t.clone(), t.reshape((2, 3)).unwrap()] {
            let r = run(&|x, t| cross_entropy_with(x, t, opts), &x3, &t);
            assert_eq!(r.0, flat.0);
            assert_eq!(r.1, flat.1);
        }
        let e = cross_entropy(&x3, &t.reshape((3, 2)).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("[N] = [6]"), "{e}");
    }

    #[test]
    fn bad_inputs_are_errors_naming_what_is_wrong() {
        let x = logits(4, 3, 0);
        let t = Tensor::from_vec(vec![0i64, 1, 5, 2], 4, &Device::Cpu).unwrap();
        let e = cross_entropy(&x, &t).unwrap_err().to_string();
        assert!(e.contains("row 2") && e.contains("0..3"), "{e}");
        let e = cross_entropy(&x, &t.narrow(0, 0, 3).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("[N] = [4]"), "{e}");
        let ok = Tensor::from_vec(vec![0i64, 1, 2, 2], 4, &Device::Cpu).unwrap();
        let e = cross_entropy_with(&x, &ok, CrossEntropyOptions::default().label_smoothing(1.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("label_smoothing"), "{e}");
        let e = cross_entropy(&x.flatten_all().unwrap(), &ok)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[N, C]"), "{e}");
        // Every row ignored: NaN, as in PyTorch, and no panic.
        let all = Tensor::from_vec(vec![-1i64; 4], 4, &Device::Cpu).unwrap();
        let l = cross_entropy_with(&x, &all, CrossEntropyOptions::default().ignore_index(-1))
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(l.is_nan());
    }

    #[test]
    fn both_builds_of_the_row_kernels_give_the_same_bits() {
        // On an AVX2 machine the dispatched function runs the AVX2 build; either way it must
        // equal the portable one bit for bit (same operations, same order).
        for n in [1usize, 7, 8, 9, 100, 8000] {
            let row: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
                .collect();
            let (a, b) = (row_lse(&row), row_lse::portable(&row));
            assert_eq!(
                (a.0.to_bits(), a.1.to_bits()),
                (b.0.to_bits(), b.1.to_bits()),
                "n {n}"
            );
            let (mut g1, mut g2) = (row.clone(), row.clone());
            grad_row(&mut g1, n / 2, Some(row[n / 2]), a.1, 0.01, 0.5, 0.1);
            grad_row::portable(&mut g2, n / 2, Some(row[n / 2]), a.1, 0.01, 0.5, 0.1);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&g1), bits(&g2), "n {n}");
            // The in-place variant: the same maximum and log-sum-exp bits as `row_lse`, rows of
            // `exp(x - max)`, and a gradient from them within rounding of `grad_row`'s.
            let (mut e1, mut e2) = (row.clone(), row.clone());
            let (c, d) = (row_lse_exp(&mut e1), row_lse_exp::portable(&mut e2));
            assert_eq!(
                (c.0.to_bits(), c.1.to_bits()),
                (a.0.to_bits(), a.1.to_bits())
            );
            assert_eq!(
                (d.0.to_bits(), d.1.to_bits()),
                (a.0.to_bits(), a.1.to_bits())
            );
            assert_eq!(bits(&e1), bits(&e2), "n {n}");
            for (e, x) in e1.iter().zip(&row) {
                assert_eq!(*e, exp_f32(x - a.0), "n {n}");
            }
            let inv = exp_f32(a.0 - a.1);
            grad_row_exp(&mut e1, n / 2, inv, 0.01, 0.5, 0.1);
            grad_row_exp::portable(&mut e2, n / 2, inv, 0.01, 0.5, 0.1);
            assert_eq!(bits(&e1), bits(&e2), "n {n}");
            for (x, y) in e1.iter().zip(&g1) {
                assert!((x - y).abs() <= 1e-6, "n {n}: {x} vs {y}");
            }
        }
    }
}
