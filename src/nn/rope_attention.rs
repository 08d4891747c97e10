//! Rotary embeddings and attention for the projections in their sequence-major layout, as one
//! graph node off the CPU.
//!
//! A decoder's attention turns its `[B, T, H·D]` projections into heads (`[B, T, H, D]`, a free
//! reshape), transposes them to `[B, H, T, D]`, copies them contiguous, turns `q` and `k` by the
//! rotary tables, attends, and transposes and copies the output back. Composed, every one of
//! those steps is a graph node, and Candle's backward pass zero-fills a gradient for each and
//! adds into it: about fourteen activation-sized zero-fills and additions per layer. Here the
//! rotary kernels, the transposing copies and the attention node's products and softmax run
//! inside one op that keeps the turned, transposed `q`, `k` and `v` for its backward pass; the
//! gradients come out in the projections' layout. The forward pass is written once, generic over
//! Candle's storages, so the CPU runs it in tests.

use std::sync::{Mutex, PoisonError};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::attention::{scaled_dot_product_attention, AttentionOptions};
use super::attention_node::AttentionNode;
use super::rope::{rope_thd, RopeFwd};
use super::rope_geometry::Variant;
use super::softmax::SoftmaxFwd;

/// Rotary embeddings on `q` and `k` (pairs of halves, as [`rope_thd`](super::rope_thd)), then
/// [`scaled_dot_product_attention`], for projections in their sequence-major layout: `q`
/// `[B, T, H, D]`, `k` `[B, T, KV, D]` and `v` `[B, T, KV, D_v]` (`KV` divides `H`); the output
/// is `[B, T, H, D_v]`, ready to be reshaped into `[B, T, H·D_v]` for the output projection.
/// `cos`/`sin` are `[T', D/2]` (or `[B, T', D/2]`, one table per sequence) with `T' >= T`: the
/// first `T` rows are used.
///
/// On a GPU with `nn`'s CUDA kernels on, without a padding mask and with constant tables, this
/// is one graph node (the rotary and softmax kernels, cuBLAS products and the transposing copies
/// inside), so Candle's backward pass zero-fills no gradient for the steps between the
/// projections and the output. Elsewhere it is those steps composed. The values and gradients
/// are the same up to rounding.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{rope_attention, rope_thd, scaled_dot_product_attention, AttentionOptions};
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 5, 4, 8), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (2, 5, 2, 8), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (2, 5, 2, 8), &dev)?;
/// let cos = Tensor::rand(0f32, 1.0, (16, 4), &dev)?;
/// let sin = Tensor::rand(0f32, 1.0, (16, 4), &dev)?;
/// let options = AttentionOptions::default().causal(true);
/// let y = rope_attention(&q, &k, &v, &cos, &sin, &options)?;
/// let (c, s) = (cos.narrow(0, 0, 5)?, sin.narrow(0, 0, 5)?);
/// let heads = |t: Tensor| t.transpose(1, 2);
/// let want = scaled_dot_product_attention(
///     &heads(rope_thd(&q, &c, &s)?)?,
///     &heads(rope_thd(&k, &c, &s)?)?,
///     &heads(v.clone())?,
///     &options,
/// )?
/// .transpose(1, 2)?;
/// let diff = (y - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-5);
/// # Ok(()) }
/// ```
pub fn rope_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    options: &AttentionOptions,
) -> Result<Tensor> {
    let t = q.dim(1)?;
    let pos = cos.rank().saturating_sub(2);
    let (cos, sin) = (cos.narrow(pos, 0, t)?, sin.narrow(pos, 0, t)?);
    if one_node(q, k, v, &cos, &sin, options)? {
        let d = q.dim(3)?;
        let scale = options.scale.unwrap_or(1.0 / (d as f64).sqrt());
        let op = RopeAttention {
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            attention: AttentionNode::new(scale, options.causal),
            kept: Mutex::new(None),
        };
        return q
            .contiguous()?
            .apply_op3(&k.contiguous()?, &v.contiguous()?, op);
    }
    let heads = |x: Tensor| x.transpose(1, 2);
    let y = scaled_dot_product_attention(
        &heads(rope_thd(q, &cos, &sin)?)?,
        &heads(rope_thd(k, &cos, &sin)?)?,
        &heads(v.clone())?,
        options,
    )?;
    y.transpose(1, 2)?.contiguous()
}

/// Whether the one-node form applies: a GPU with `nn`'s kernels, one dtype and device for all,
/// no padding mask, constant tables, and well-formed sequence-major shapes (anything else goes
/// the composed way, with its errors).
fn one_node(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    options: &AttentionOptions,
) -> Result<bool> {
    let shapes_fit = match (q.dims(), k.dims(), v.dims()) {
        (&[b, t, h, d], &[kb, kt, kv, kd], &[vb, vt, vh, _]) => {
            (kb, kt, kd, vb, vt, vh) == (b, t, d, b, t, kv)
                && kv > 0
                && h % kv == 0
                && d % 2 == 0
                && (!options.causal || t > 0)
        }
        _ => false,
    };
    let same = |x: &Tensor| x.device().same_device(q.device()) && x.dtype() == q.dtype();
    Ok(shapes_fit
        && options.key_padding_mask.is_none()
        && (!q.device().is_cpu() || super::kernels::device_nodes_on_cpu())
        && [k, v, cos, sin].into_iter().all(same)
        && !cos.track_op()
        && !sin.track_op()
        && super::elem::fused(q)?)
}

/// The op: the rotary tables (the first `T` rows), the attention node it runs inside, and the
/// turned, transposed `q`, `k` and `v` (`[B, H, T, D]`) of the forward pass until its backward
/// pass takes them.
struct RopeAttention {
    cos: Tensor,
    sin: Tensor,
    attention: AttentionNode,
    kept: Mutex<Option<[Tensor; 3]>>,
}

/// `src` of the sequence-major layout `l` (`[B, T, n, D]`) copied to heads-major `[B, n, T, D]`
/// (or back: the copy swaps dimensions 1 and 2 either way).
fn swapped<S>(src: &S, l: &Layout) -> Result<(S, Layout)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let view = l.transpose(1, 2)?;
    // SAFETY: `copy_strided_src` writes every element of the fresh contiguous storage (of the
    // view's shape) before anything reads it.
    let mut dst = unsafe { src.device().alloc_uninit(view.shape(), src.dtype())? };
    src.copy_strided_src(&mut dst, 0, &view)?;
    Ok((dst, Layout::contiguous(view.shape())))
}

impl RopeAttention {
    /// The forward pass on storages `s` of layouts `l`: `rope` turns `q` and `k` (the device's
    /// rotary op, given the op and the tables), the copies make them heads-major, the attention
    /// node attends (`softmax`: the device's softmax), and the output is copied back to
    /// sequence-major. `wrap` makes the kept storages tensors.
    fn forward<S>(
        &self,
        s: [&S; 3],
        l: [&Layout; 3],
        rope: impl Fn(&S, &Layout, RopeFwd) -> Result<(S, Shape)>,
        softmax: impl FnOnce(&S, &Layout, SoftmaxFwd) -> Result<(S, Shape)>,
        wrap: impl Fn(S) -> Storage,
    ) -> Result<(S, Shape)>
    where
        S: BackendStorage,
        S::Device: BackendDevice<Storage = S>,
    {
        let turn = || RopeFwd {
            variant: Variant::Thd,
            sign: 1.0,
        };
        let (qr, qs) = rope(s[0], l[0], turn())?;
        let (kr, ks) = rope(s[1], l[1], turn())?;
        let (qt, lq) = swapped(&qr, &Layout::contiguous(qs))?;
        let (kt, lk) = swapped(&kr, &Layout::contiguous(ks))?;
        drop((qr, kr));
        let (vt, lv) = swapped(s[2], l[2])?;
        let (y, ys) = self
            .attention
            .forward([&qt, &kt, &vt], [&lq, &lk, &lv], softmax, &wrap)?;
        let (out, lo) = swapped(&y, &Layout::contiguous(ys))?;
        let keep = |x: S, l: &Layout| {
            Tensor::from_storage(wrap(x), l.shape().clone(), BackpropOp::none(), false)
        };
        let kept = [keep(qt, &lq), keep(kt, &lk), keep(vt, &lv)];
        *self.kept.lock().unwrap_or_else(PoisonError::into_inner) = Some(kept);
        Ok((out, lo.shape().clone()))
    }

    /// `x` turned by the tables (`sign` -1: turned back), as a fresh tensor off the graph.
    fn turn(&self, x: &Tensor, sign: f32) -> Result<Tensor> {
        let op = RopeFwd {
            variant: Variant::Thd,
            sign,
        };
        x.contiguous()?.apply_op3_no_bwd(&self.cos, &self.sin, &op)
    }

    /// The kept heads-major `q`, `k`, `v` (taken), or made again from the inputs if a second
    /// backward pass through this node asks.
    fn kept(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<[Tensor; 3]> {
        let kept = self
            .kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match kept {
            Some(kept) => Ok(kept),
            None => {
                let heads = |x: Tensor| x.transpose(1, 2)?.contiguous();
                Ok([
                    heads(self.turn(&q.detach(), 1.0)?)?,
                    heads(self.turn(&k.detach(), 1.0)?)?,
                    heads(v.detach())?,
                ])
            }
        }
    }
}

impl CustomOp3 for RopeAttention {
    fn name(&self) -> &'static str {
        "accelerate-rs-rope-attention"
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
        let (cs, cl) = self.cos.storage_and_layout();
        let (ss, sl) = self.sin.storage_and_layout();
        let (Storage::Cpu(cs), Storage::Cpu(ss)) = (&*cs, &*ss) else {
            candle_core::bail!("{}: the tables are not on the CPU", self.name());
        };
        let rope = |x: &CpuStorage, l: &Layout, op: RopeFwd| op.cpu_fwd(x, l, cs, cl, ss, sl);
        let softmax = |raw: &CpuStorage, l: &Layout, op: SoftmaxFwd| op.cpu_fwd(raw, l);
        self.forward([s1, s2, s3], [l1, l2, l3], rope, softmax, Storage::Cpu)
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
        use candle_core::CudaStorage;
        let (cs, cl) = self.cos.storage_and_layout();
        let (ss, sl) = self.sin.storage_and_layout();
        let (Storage::Cuda(cs), Storage::Cuda(ss)) = (&*cs, &*ss) else {
            candle_core::bail!("{}: the tables are not on the GPU", self.name());
        };
        let rope = |x: &CudaStorage, l: &Layout, op: RopeFwd| op.cuda_fwd(x, l, cs, cl, ss, sl);
        let softmax = |raw: &CudaStorage, l: &Layout, op: SoftmaxFwd| op.cuda_fwd(raw, l);
        self.forward([s1, s2, s3], [l1, l2, l3], rope, softmax, Storage::Cuda)
    }

    /// The attention node's gradients of the kept heads-major `q`, `k`, `v`, copied back to
    /// sequence-major, those of `q` and `k` turned back by the tables; only for inputs that are
    /// part of the graph.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = [q.track_op(), k.track_op(), v.track_op()];
        let [qt, kt, vt] = self.kept(q, k, v)?;
        let g = grad.detach().transpose(1, 2)?.contiguous()?;
        let (dq, dk, dv) = self.attention.grads(&qt, &kt, &vt, &g, want)?;
        drop((qt, kt, vt, g));
        let back = |x: Option<Tensor>, turned: bool| -> Result<Option<Tensor>> {
            x.map(|x| {
                let x = x.transpose(1, 2)?.contiguous()?;
                if turned {
                    self.turn(&x, -1.0)
                } else {
                    Ok(x)
                }
            })
            .transpose()
        };
        Ok((back(dq, true)?, back(dk, true)?, back(dv, false)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::elem::{assert_close, output_and_grads};
    use candle_core::{DType, Device, Var};

    /// The one node (forced: the CPU takes the composed form) against the composed form, the
    /// output and the gradients of `q`, `k` and `v`, for 6 query heads over `kv` key/value
    /// heads.
    fn check(t: usize, kv: usize, causal: bool, dtype: DType, tol: f32) -> Result<()> {
        let dev = Device::Cpu;
        let var = |h: usize, d: usize| -> Result<Var> {
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, t, h, d), &dev)?.to_dtype(dtype)?)
        };
        let (q, k, v) = (var(6, 8)?, var(kv, 8)?, var(kv, 5)?);
        let cos = Tensor::rand(-1f32, 1.0, (t + 3, 4), &dev)?.to_dtype(dtype)?;
        let sin = Tensor::rand(-1f32, 1.0, (t + 3, 4), &dev)?.to_dtype(dtype)?;
        let up = Tensor::randn(0f32, 1.0, (2, t, 6, 5), &dev)?.to_dtype(dtype)?;
        let options = AttentionOptions::default().causal(causal).scale(0.3);
        let run = |node: bool| -> Result<Vec<Tensor>> {
            let y = if node {
                let op = RopeAttention {
                    cos: cos.narrow(0, 0, t)?.contiguous()?,
                    sin: sin.narrow(0, 0, t)?.contiguous()?,
                    attention: AttentionNode::new(0.3, causal),
                    kept: Mutex::new(None),
                };
                q.as_tensor().apply_op3(k.as_tensor(), v.as_tensor(), op)?
            } else {
                rope_attention(&q, &k, &v, &cos, &sin, &options)?
            };
            output_and_grads(y, &up, &[&q, &k, &v])
        };
        let (ours, want) = (run(true)?, run(false)?);
        let what = format!("{dtype:?} t {t} kv {kv} causal {causal}");
        assert_close(&ours, &want, tol, &what)
    }

    #[test]
    fn one_node_rope_attention_equals_the_composed_steps_with_its_gradients() -> Result<()> {
        for t in [1, 5, 9] {
            for causal in [false, true] {
                for kv in [6, 2, 1] {
                    check(t, kv, causal, DType::F32, 1e-5)?;
                    check(t, kv, causal, DType::F64, 1e-5)?;
                    check(t, kv, causal, DType::BF16, 0.15)?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_second_backward_pass_makes_the_kept_tensors_again() -> Result<()> {
        let dev = Device::Cpu;
        let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 4, 6), &dev)?)?;
        let kv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 2, 6), &dev)?)?;
        let op = RopeAttention {
            cos: Tensor::rand(-1f32, 1.0, (4, 3), &dev)?,
            sin: Tensor::rand(-1f32, 1.0, (4, 3), &dev)?,
            attention: AttentionNode::new(0.5, true),
            kept: Mutex::new(None),
        };
        let y = q
            .as_tensor()
            .apply_op3(kv.as_tensor(), kv.as_tensor(), op)?;
        let loss = y.sqr()?.sum_all()?;
        let (first, second) = (loss.backward()?, loss.backward()?);
        for x in [&q, &kv] {
            let (Some(a), Some(b)) = (first.get(x.as_tensor()), second.get(x.as_tensor())) else {
                candle_core::bail!("no gradient");
            };
            assert!(crate::nn::elem::max_diff(a, b) < 1e-6);
        }
        Ok(())
    }
}
