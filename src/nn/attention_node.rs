//! Attention as one graph node off the CPU: the scores product, the (scaled, optionally causal)
//! softmax kernel and the product with the values run in one custom op, which keeps the
//! probabilities for its backward pass and gives the query, key and value gradients straight.
//!
//! Composed, `softmax(q kᵀ) v` is three nodes on `[B, H, T_q, T_k]` tensors: the graph keeps the
//! raw scores as well as the probabilities, and Candle's backward pass zero-fills a gradient for
//! each of them and adds into it — two extra score-sized passes written and three read per layer,
//! for gradients that have one contribution each. Here the probabilities' and the scores'
//! gradients are fresh tensors used once, and the raw scores are freed as soon as the softmax has
//! read them. The same products and softmax kernels run (cuBLAS and `nn`'s softmax kernels on a
//! GPU): only the graph around them changes. Grouped-query attention needs no repeated keys and
//! values: the query heads that share a key/value head are one matrix of `n · T_q` rows against
//! it (the causal softmax finds each row's query as its index modulo `T_q`), so the products are
//! fewer and larger and the key and value gradients come out summed over the group. The forward
//! pass is written once, generic over Candle's storages, so the CPU runs it in tests.

use std::sync::{Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::softmax::{SoftmaxBwd, SoftmaxFwd};

/// `softmax(scale · q kᵀ) v`, causally masked if asked (query `i` sees keys
/// `0..=i + T_k - T_q`), for `q` `[B, H, T_q, D]`, `k` `[B, KV, T_k, D]` and `v`
/// `[B, KV, T_k, D_v]` (`KV` divides `H`: query head `j` reads key/value head `j / (H / KV)`) in
/// one float dtype on one device, as one differentiable node.
pub(super) fn attention_node(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
) -> Result<Tensor> {
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        AttentionNode::new(scale, causal),
    )
}

/// The op: its options, and the probabilities of its forward pass until its backward pass
/// takes them.
pub(super) struct AttentionNode {
    scale: f32,
    causal: bool,
    probs: Mutex<Option<Tensor>>,
}

/// The sizes of the three inputs: batch, key/value heads, query heads per key/value head, queries,
/// keys, the query/key width and the value width.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    kv: usize,
    n: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

impl AttentionNode {
    pub(super) fn new(scale: f64, causal: bool) -> AttentionNode {
        AttentionNode {
            scale: scale as f32,
            causal,
            probs: Mutex::new(None),
        }
    }

    /// The softmax op over scores of `T_q` rows and `T_k` columns.
    fn softmax(&self, tq: usize, tk: usize) -> SoftmaxFwd {
        SoftmaxFwd::new(self.scale, self.causal.then_some((tq, tk)))
    }

    /// The dimensions of `q`, `k`, `v`, checked against each other.
    fn dims(&self, l: [&Layout; 3]) -> Result<Dims> {
        match (l[0].dims(), l[1].dims(), l[2].dims()) {
            (&[b, h, tq, d], &[kb, kv, tk, kd], &[vb, vh, vt, dv])
                if (kb, kd) == (b, d)
                    && (vb, vh, vt) == (b, kv, tk)
                    && kv > 0
                    && h % kv == 0
                    && l[0].is_contiguous()
                    && (!self.causal || tq <= tk) =>
            {
                Ok(Dims {
                    b,
                    kv,
                    n: h / kv,
                    tq,
                    tk,
                    d,
                    dv,
                })
            }
            (q, k, v) => candle_core::bail!(
                "accelerate-rs-attention: q {q:?}, k {k:?}, v {v:?}: expected [B, H, T_q, D] \
                 (contiguous), [B, KV, T_k, D] and [B, KV, T_k, D_v] with KV dividing H{}",
                if self.causal { ", T_q <= T_k" } else { "" }
            ),
        }
    }

    /// The forward pass on storages `s` of layouts `l`: the scores product, `softmax` (the
    /// device's softmax kernel, given the op to run), the product with `v`. The probabilities
    /// are kept (`wrap` makes them a tensor) for the backward pass.
    pub(super) fn forward<S: BackendStorage>(
        &self,
        s: [&S; 3],
        l: [&Layout; 3],
        softmax: impl FnOnce(&S, &Layout, SoftmaxFwd) -> Result<(S, Shape)>,
        wrap: impl FnOnce(S) -> Storage,
    ) -> Result<(S, Shape)> {
        let Dims {
            b,
            kv,
            n,
            tq,
            tk,
            d,
            dv,
        } = self.dims(l)?;
        let rows = n * tq;
        // The queries of the `n` heads sharing a key/value head as one `[n·T_q, D]` matrix.
        let lq = Layout::contiguous_with_offset((b, kv, rows, d), l[0].start_offset());
        let scores = Layout::contiguous((b, kv, rows, tk));
        let raw = s[0].matmul(s[1], (b * kv, rows, tk, d), &lq, &l[1].transpose(2, 3)?)?;
        let (p, _) = softmax(&raw, &scores, self.softmax(tq, tk))?;
        drop(raw);
        let y = p.matmul(s[2], (b * kv, rows, dv, tk), &scores, l[2])?;
        let p = Tensor::from_storage(wrap(p), (b, kv, rows, tk), BackpropOp::none(), false);
        *self.probs.lock().unwrap_or_else(PoisonError::into_inner) = Some(p);
        Ok((y, Shape::from((b, kv * n, tq, dv))))
    }

    /// The probabilities of the forward pass (taken: they are freed with this backward pass),
    /// or recomputed from `q` and `k` if a second backward pass through this node asks again.
    fn probs(&self, q: &Tensor, k: &Tensor, tq: usize) -> Result<Tensor> {
        let kept = self
            .probs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match kept {
            Some(p) => Ok(p),
            None => q
                .matmul(&k.t()?)?
                .apply_op1_no_bwd(&self.softmax(tq, k.dim(2)?)),
        }
    }
}

impl CustomOp3 for AttentionNode {
    fn name(&self) -> &'static str {
        "accelerate-rs-attention"
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
        let softmax = |raw: &CpuStorage, l: &Layout, op: SoftmaxFwd| op.cpu_fwd(raw, l);
        self.forward([s1, s2, s3], [l1, l2, l3], softmax, Storage::Cpu)
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
        let softmax =
            |raw: &candle_core::CudaStorage, l: &Layout, op: SoftmaxFwd| op.cuda_fwd(raw, l);
        self.forward([s1, s2, s3], [l1, l2, l3], softmax, Storage::Cuda)
    }

    /// `dv = pᵀ g`, `ds = softmax'(p, g vᵀ)` (the scale included), `dq = ds k`, `dk = dsᵀ q`:
    /// each a fresh tensor, none recorded in a graph; only the gradients of inputs that are part
    /// of the graph are computed.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = [q.track_op(), k.track_op(), v.track_op()];
        self.grads(q, k, v, grad, want)
    }
}

impl AttentionNode {
    /// The gradients of `q`, `k` and `v` (those `want` asks for) from the output's `grad`, with
    /// the probabilities of the forward pass: see [`CustomOp3::bwd`] above.
    pub(super) fn grads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        grad: &Tensor,
        want: [bool; 3],
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, h, tq, d) = q.dims4()?;
        let (kv, dv) = (k.dim(1)?, v.dim(3)?);
        let rows = (h / kv.max(1)) * tq;
        // Grouped as in the forward pass: `[B, KV, n·T_q, ·]`.
        let q = q.detach().contiguous()?.reshape((b, kv, rows, d))?;
        let (k, v) = (k.detach(), v.detach());
        let g = grad.detach().contiguous()?.reshape((b, kv, rows, dv))?;
        let p = self.probs(&q, &k, tq)?;
        let dv = match want[2] {
            true => Some(p.t()?.matmul(&g)?),
            false => None,
        };
        if !want[0] && !want[1] {
            return Ok((None, None, dv));
        }
        let ds = p.apply_op2_no_bwd(&g.matmul(&v.t()?)?, &SoftmaxBwd::new(self.scale))?;
        drop(p);
        let dq = match want[0] {
            true => Some(ds.matmul(&k)?.reshape((b, h, tq, d))?),
            false => None,
        };
        let dk = match want[1] {
            true => Some(ds.t()?.matmul(&q)?),
            false => None,
        };
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::elem::{assert_close, output_and_grads};
    use candle_core::{DType, Device, Var};

    /// `softmax(scale q kᵀ + causal mask) v` from Candle's plain ops, the key/value heads
    /// repeated for their query heads.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
        let (tq, tk) = (q.dim(2)?, k.dim(2)?);
        let repeat = |t: &Tensor| -> Result<Tensor> {
            let (b, kv, t2, d) = t.dims4()?;
            let n = q.dim(1)? / kv;
            t.unsqueeze(2)?
                .broadcast_as((b, kv, n, t2, d))?
                .reshape((b, kv * n, t2, d))
        };
        let s = (q.matmul(&repeat(k)?.t()?)? * scale)?;
        let s = match causal {
            true => {
                let mask: Vec<f32> = (0..tq)
                    .flat_map(|i| (0..tk).map(move |j| if j <= i + tk - tq { 0.0 } else { -1e30 }))
                    .collect();
                s.broadcast_add(&Tensor::from_vec(mask, (tq, tk), q.device())?)?
            }
            false => s,
        };
        candle_nn::ops::softmax(&s, candle_core::D::Minus1)?.matmul(&repeat(v)?)
    }

    /// The node against [`reference`]: the output and the three gradients, for 6 query heads
    /// over `kv` key/value heads.
    fn check(tq: usize, tk: usize, kv: usize, causal: bool, dtype: DType, tol: f32) -> Result<()> {
        let dev = Device::Cpu;
        let var = |h: usize, t: usize, d: usize| -> Result<Var> {
            Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, h, t, d), &dev)?.to_dtype(dtype)?)
        };
        let (q, k, v) = (var(6, tq, 8)?, var(kv, tk, 8)?, var(kv, tk, 5)?);
        let up = Tensor::randn(0f32, 1.0, (2, 6, tq, 5), &dev)?.to_dtype(dtype)?;
        let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>| -> Result<Vec<Tensor>> {
            let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
            output_and_grads(y, &up, &[&q, &k, &v])
        };
        let ours = run(&|q, k, v| attention_node(q, k, v, 0.3, causal))?;
        let want = run(&|q, k, v| {
            let f = |t: &Tensor| t.to_dtype(DType::F32);
            reference(&f(q)?, &f(k)?, &f(v)?, 0.3, causal)?.to_dtype(dtype)
        })?;
        let what = format!("{dtype:?} tq {tq} tk {tk} kv {kv} causal {causal}");
        assert_close(&ours, &want, tol, &what)
    }

    #[test]
    fn one_node_attention_equals_the_plain_ops_with_its_gradients() -> Result<()> {
        for (tq, tk) in [(1, 1), (5, 5), (3, 7), (7, 3)] {
            for causal in [false, true] {
                if causal && tq > tk {
                    continue;
                }
                for kv in [6, 2, 1] {
                    check(tq, tk, kv, causal, DType::F32, 1e-5)?;
                    check(tq, tk, kv, causal, DType::F64, 1e-5)?;
                    check(tq, tk, kv, causal, DType::BF16, 0.15)?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_second_backward_pass_recomputes_the_probabilities() -> Result<()> {
        let dev = Device::Cpu;
        let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 4, 4, 3), &dev)?)?;
        let kv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 4, 3), &dev)?)?;
        let y = attention_node(q.as_tensor(), kv.as_tensor(), kv.as_tensor(), 0.5, true)?;
        let loss = y.sqr()?.sum_all()?;
        let first = loss.backward()?;
        let second = loss.backward()?;
        for x in [&q, &kv] {
            let (Some(a), Some(b)) = (first.get(x.as_tensor()), second.get(x.as_tensor())) else {
                candle_core::bail!("no gradient");
            };
            assert!(crate::nn::elem::max_diff(a, b) < 1e-6);
        }
        Ok(())
    }

    #[test]
    fn mismatched_shapes_are_named() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::zeros((1, 2, 4, 3), DType::F32, &dev)?;
        let k = Tensor::zeros((1, 2, 3, 3), DType::F32, &dev)?;
        let Err(e) = attention_node(&q, &k, &k, 1.0, true) else {
            candle_core::bail!("a causal attention of 4 queries over 3 keys ran");
        };
        assert!(e.to_string().contains("T_q <= T_k"), "{e}");
        Ok(())
    }
}
