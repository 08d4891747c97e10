//! Memory-efficient attention ([`flash_attention`]): `softmax(scale · q kᵀ + mask) v` computed a
//! tile at a time with an online softmax (FlashAttention-2's algorithm), so that no
//! `heads × T_q × T_k` matrix exists, forward or backward: the forward pass keeps one
//! log-sum-exp per query row, and the backward pass recomputes the score tiles from it. Its extra
//! memory grows linearly with the sequence; [`scaled_dot_product_attention`] keeps the attention
//! weights (quadratic) and stays the reference.
//!
//! Masks: causal, a sliding window (Mistral's and Gemma's, `transformers`' convention), documents
//! packed into one row (block-diagonal, from per-token ids or cumulative sequence lengths) and a
//! key padding mask, in any combination; grouped-query attention (fewer key/value heads) without
//! repeating the keys and values.
//!
//! [`scaled_dot_product_attention`]: super::scaled_dot_product_attention

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, D};

use super::attention::{AttentionOptions, View};
use super::elem::fused_cpu;
use super::flash_cpu::{self, fits, Dims, Inputs, Upstream, Visibility};

/// How the tokens of a packed row are cut into documents: a query sees the keys of its own
/// document only (with [`FlashAttentionOptions::causal`]: block-diagonal causal attention).
/// Position ids (restarting at each document) are the caller's business.
#[derive(Debug, Clone)]
pub enum Documents {
    /// `[B, T_k]` integer ids (any integer dtype): query `i` has the id of token
    /// `i + T_k - T_q` and sees the keys with the same id. The tokens of a document need not be
    /// adjacent, though packing makes them so (and then whole tiles are skipped).
    Ids(Tensor),
    /// Cumulative sequence lengths over the `B · T_k` tokens taken row after row (flash-attn's
    /// `cu_seqlens`): `[0, l_1, l_1 + l_2, ..., B · T_k]`, non-decreasing; a document may not run
    /// past the end of its row.
    CuSeqlens(Vec<usize>),
}

/// Options of [`flash_attention`]: [`AttentionOptions`]' causal flag, scale and key padding
/// mask, plus a sliding window and documents. `From<&AttentionOptions>` carries the first three
/// over.
#[derive(Debug, Clone, Default)]
pub struct FlashAttentionOptions {
    /// Query `i` sees keys `0..=i + T_k - T_q` only (needs `T_q <= T_k`).
    pub causal: bool,
    /// The factor on the scores; `None` (default) is `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// A sliding window of `w` keys (needs `causal`): the query at position `p` sees keys `j` with
    /// `p - w < j <= p`, as `transformers` masks Mistral's `sliding_window` and Gemma's sliding
    /// layers.
    pub window: Option<usize>,
    /// `[B, T_k]`, any dtype: a nonzero entry marks a padding key that no query of that sequence
    /// sees. A query that sees no key at all gets zeros (and zero gradients).
    pub key_padding_mask: Option<Tensor>,
    /// Documents packed into each row (see [`Documents`]).
    pub documents: Option<Documents>,
}

impl FlashAttentionOptions {
    /// Sets [`FlashAttentionOptions::causal`].
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the factor on the scores.
    pub fn scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets a sliding window of `window` keys (see [`FlashAttentionOptions::window`]).
    pub fn window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    /// Sets the key padding mask (`[B, T_k]`, nonzero = padding).
    pub fn key_padding_mask(mut self, mask: Tensor) -> Self {
        self.key_padding_mask = Some(mask);
        self
    }

    /// Sets the documents from per-token ids `[B, T_k]` ([`Documents::Ids`]).
    pub fn document_ids(mut self, ids: Tensor) -> Self {
        self.documents = Some(Documents::Ids(ids));
        self
    }

    /// Sets the documents from cumulative sequence lengths ([`Documents::CuSeqlens`]).
    pub fn cu_seqlens(mut self, cu_seqlens: Vec<usize>) -> Self {
        self.documents = Some(Documents::CuSeqlens(cu_seqlens));
        self
    }
}

impl From<&AttentionOptions> for FlashAttentionOptions {
    fn from(o: &AttentionOptions) -> Self {
        FlashAttentionOptions {
            causal: o.causal,
            scale: o.scale,
            key_padding_mask: o.key_padding_mask.clone(),
            ..Default::default()
        }
    }
}

/// `softmax(scale · q kᵀ + mask) v` for `q` `[B, H, T_q, D]`, `k` `[B, H_kv, T_k, D]` and `v`
/// `[B, H_kv, T_k, D_v]` (any strides; `H_kv` divides `H`, query head `h` reading key/value head
/// `h / (H / H_kv)` as `transformers`' `repeat_kv` arranges them), giving `[B, H, T_q, D_v]`; the
/// masks are [`FlashAttentionOptions`]'. The same result as [`scaled_dot_product_attention`]
/// (within f32 rounding), with memory linear in the sequence length: on the CPU (f32, bf16, f16
/// and f64, computed in f32) one differentiable op whose backward pass recomputes the attention
/// weights a tile at a time. On other devices Candle's composed ops (quadratic memory), or in a
/// `cuda` build with `ACCELERATE_RS_NN_CUDA_FLASH=1` CUDA kernels (memory linear in the sequence,
/// proven on an H100, but slower than the composed ops at training sizes).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{flash_attention, FlashAttentionOptions};
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 4, 6, 8), &dev)?;
/// let kv = Tensor::randn(0f32, 1.0, (1, 2, 6, 8), &dev)?; // 2 key/value heads (GQA)
/// // Two documents of 4 and 2 tokens packed in one row, each causal on its own.
/// let opts = FlashAttentionOptions::default().causal(true).cu_seqlens(vec![0, 4, 6]);
/// let y = flash_attention(&q, &kv, &kv, &opts)?;
/// assert_eq!(y.dims(), [1, 4, 6, 8]);
/// // Token 4 starts the second document: it sees only itself, so it gets its own value.
/// let own = (y.narrow(2, 4, 1)?.get(0)?.get(0)? - kv.narrow(2, 4, 1)?.get(0)?.get(0)?)?;
/// assert!(own.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok(()) }
/// ```
///
/// [`scaled_dot_product_attention`]: super::scaled_dot_product_attention
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &FlashAttentionOptions,
) -> Result<Tensor> {
    let dims = checked_dims(q, k, v)?;
    let scale = checked_options(dims, options)?;
    if dims.is_empty() {
        return Tensor::zeros((dims.b, dims.h, dims.tq, dims.dv), q.dtype(), q.device());
    }
    if fused_cpu(q) && k.device().is_cpu() && v.device().is_cpu() {
        let op = FlashAttention::new(dims, scale, visibility(dims, options)?);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let y = f32_of(q)?.apply_op3(&f32_of(k)?, &f32_of(v)?, op)?;
        return y.to_dtype(q.dtype());
    }
    #[cfg(feature = "cuda")]
    if cuda_takes(q, dims.d.max(dims.dv))? {
        return super::flash_cuda::forward(q, k, v, dims, scale, &visibility(dims, options)?);
    }
    composed(q, k, v, dims, scale, options)
}

/// Whether the CUDA kernels take queries `q` with heads `width` wide: a `cuda` build, `q` on a
/// GPU, the kernels on (`ACCELERATE_RS_NN_CUDA_FLASH=1`) and `width <= 256`. The one decision
/// of [`flash_attention`] and [`flash_attention_fused`].
fn cuda_takes(q: &Tensor, width: usize) -> Result<bool> {
    #[cfg(feature = "cuda")]
    {
        Ok(width <= super::flash_cuda::MAX_WIDTH && super::cuda::use_flash_kernel(q)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, width);
        Ok(false)
    }
}

/// Whether [`flash_attention`] runs as one fused op (memory linear in the sequence, the keys
/// and values of grouped-query attention not repeated) for queries like `q` `[B, H, T, D]`: on
/// the CPU in a float dtype; in a `cuda` build on a GPU where the CUDA kernels are on
/// (`ACCELERATE_RS_NN_CUDA_FLASH=1`) and `D <= 256`.
/// Elsewhere it composes Candle ops, and a caller may prefer its own fused attention.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let q = candle_core::Tensor::zeros((1, 2, 4, 8), candle_core::DType::F32, &candle_core::Device::Cpu)?;
/// assert!(accelerate_rs::nn::flash_attention_fused(&q)?);
/// # Ok(()) }
/// ```
pub fn flash_attention_fused(q: &Tensor) -> Result<bool> {
    Ok(fused_cpu(q) || cuda_takes(q, q.dims().last().copied().unwrap_or(0))?)
}

/// The sizes of q, k and v, checked.
fn checked_dims(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
    let dims = match (q.dims(), k.dims(), v.dims()) {
        (&[b, h, tq, d], &[kb, hkv, tk, kd], &[vb, vh, vt, dv])
            if (kb, kd, vb, vh, vt) == (b, d, b, hkv, tk) && hkv > 0 && h % hkv == 0 && d > 0 =>
        {
            Dims {
                b,
                h,
                hkv,
                tq,
                tk,
                d,
                dv,
            }
        }
        _ => candle_core::bail!(
            "accelerate_rs::nn::flash_attention: q {:?}, k {:?}, v {:?}: expected q [B, H, T_q, \
             D], k [B, H_kv, T_k, D] and v [B, H_kv, T_k, D_v] with H a multiple of H_kv >= 1 \
             and D >= 1",
            q.dims(),
            k.dims(),
            v.dims()
        ),
    };
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        candle_core::bail!(
            "accelerate_rs::nn::flash_attention: q, k and v in one dtype expected, got {:?}, \
             {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    Ok(dims)
}

/// Checks the options against the sizes; returns the scale.
fn checked_options(dims: Dims, o: &FlashAttentionOptions) -> Result<f32> {
    let fail = |what: String| -> Result<f32> {
        candle_core::bail!("accelerate_rs::nn::flash_attention: {what}")
    };
    if o.window.is_some() && !o.causal {
        return fail("a sliding window needs causal attention (`.causal(true)`)".into());
    }
    if o.window == Some(0) {
        return fail("a sliding window of 0 keys sees nothing; give at least 1".into());
    }
    if (o.causal || o.documents.is_some()) && dims.tq > dims.tk {
        return fail(format!(
            "causal attention and documents need T_q <= T_k, got {} queries and {} keys",
            dims.tq, dims.tk
        ));
    }
    let keyed = [
        ("key_padding_mask", o.key_padding_mask.as_ref()),
        (
            "document ids",
            match &o.documents {
                Some(Documents::Ids(t)) => Some(t),
                _ => None,
            },
        ),
    ];
    for (what, t) in keyed {
        if let Some(t) = t.filter(|t| t.dims() != [dims.b, dims.tk]) {
            return fail(format!(
                "{what} of shape {:?}, expected [B, T_k] = [{}, {}]",
                t.dims(),
                dims.b,
                dims.tk
            ));
        }
    }
    if let Some(Documents::Ids(t)) = &o.documents {
        if !t.dtype().is_int() {
            return fail(format!(
                "document ids must be integers, got {:?}",
                t.dtype()
            ));
        }
    }
    let scale = o.scale.unwrap_or(1.0 / (dims.d as f64).sqrt());
    if !scale.is_finite() {
        return fail(format!("the scale must be finite, got {scale}"));
    }
    Ok(scale as f32)
}

/// Document ids `[B · T_k]` from cumulative sequence lengths, checked.
fn ids_of_cu_seqlens(cu: &[usize], b: usize, tk: usize) -> Result<Vec<i64>> {
    let fail = |what: String| -> Result<Vec<i64>> {
        candle_core::bail!("accelerate_rs::nn::flash_attention: cu_seqlens {what}")
    };
    let total = b * tk;
    if cu.first() != Some(&0) || cu.last() != Some(&total) {
        return fail(format!(
            "must run from 0 to B · T_k = {total}, got {:?} .. {:?}",
            cu.first(),
            cu.last()
        ));
    }
    let mut ids = Vec::with_capacity(total);
    for (doc, w) in cu.windows(2).enumerate() {
        let (start, end) = (w[0], w[1]);
        if end < start {
            return fail(format!("decrease at document {doc}: {start} then {end}"));
        }
        if end > start && start / tk != (end - 1) / tk {
            return fail(format!(
                "document {doc} (tokens {start}..{end}) runs past the end of row {} (rows of {tk} \
                 tokens)",
                start / tk
            ));
        }
        ids.resize(end, doc as i64);
    }
    Ok(ids)
}

/// The document ids `[B · T_k]` of the options, on the host (`None` without documents).
fn host_ids(dims: Dims, o: &FlashAttentionOptions) -> Result<Option<Vec<i64>>> {
    match &o.documents {
        None => Ok(None),
        Some(Documents::Ids(t)) => Ok(Some(t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?)),
        Some(Documents::CuSeqlens(cu)) => ids_of_cu_seqlens(cu, dims.b, dims.tk).map(Some),
    }
}

/// The masks of the options on the host (options checked).
fn visibility(dims: Dims, o: &FlashAttentionOptions) -> Result<Visibility> {
    let pad = match &o.key_padding_mask {
        Some(m) => Some(m.ne(0.0)?.flatten_all()?.to_vec1::<u8>()?),
        None => None,
    };
    let ids = host_ids(dims, o)?;
    Ok(Visibility::new(dims, o.causal, o.window, ids, pad))
}

/// Which keys each query sees, `[B or 1, 1, T_q, T_k]` (u8), built from the options with Candle's
/// ops on `dev`; `None` when every query sees every key.
fn visible_mask(
    dims: Dims,
    o: &FlashAttentionOptions,
    dev: &candle_core::Device,
) -> Result<Option<Tensor>> {
    let Dims { b, tq, tk, .. } = dims;
    let off = if o.causal || o.documents.is_some() {
        tk - tq
    } else {
        0
    };
    let (off32, tk32) = (off as u32, tk as u32);
    // Query positions as a column, key positions as a row.
    let qpos = Tensor::arange(off32, off32 + tq as u32, dev)?.reshape((tq, 1))?;
    let mut masks = Vec::new();
    if o.causal {
        let keys = Tensor::arange(0u32, tk32, dev)?.reshape((1, tk))?;
        masks.push(keys.broadcast_le(&qpos)?.reshape((1, 1, tq, tk))?);
    }
    if let Some(w) = o.window {
        // p - w < j  <=>  j + w > p
        let shifted = Tensor::arange(w as u32, tk32 + w as u32, dev)?.reshape((1, tk))?;
        masks.push(shifted.broadcast_gt(&qpos)?.reshape((1, 1, tq, tk))?);
    }
    if let Some(ids) = host_ids(dims, o)? {
        let ids = Tensor::from_vec(ids, (b, tk), dev)?;
        let own = ids.narrow(1, off, tq)?.reshape((b, 1, tq, 1))?;
        masks.push(own.broadcast_eq(&ids.reshape((b, 1, 1, tk))?)?);
    }
    if let Some(m) = &o.key_padding_mask {
        masks.push(m.to_device(dev)?.eq(0.0)?.reshape((b, 1, 1, tk))?);
    }
    let mut all: Option<Tensor> = None;
    for m in masks {
        all = Some(match all {
            None => m,
            Some(a) => a.broadcast_mul(&m)?,
        });
    }
    Ok(all)
}

/// Key/value heads repeated for each of their query heads, `[B, H, T_k, width]`.
fn repeat_kv(x: &Tensor, dims: Dims) -> Result<Tensor> {
    let rep = dims.h / dims.hkv;
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, hkv, t, w) = x.dims4()?;
    x.unsqueeze(2)?
        .broadcast_as((b, hkv, rep, t, w))?
        .reshape((b, hkv * rep, t, w))
}

/// [`flash_attention`] with Candle's composed ops (other devices): the scores, the masks as
/// `-inf`, softmax, rows that see no key zeroed, the product with `v`. Quadratic memory; also
/// the reference the tests hold the tiled kernels to.
fn composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    dims: Dims,
    scale: f32,
    o: &FlashAttentionOptions,
) -> Result<Tensor> {
    let (k, v) = (repeat_kv(k, dims)?, repeat_kv(v, dims)?);
    let scores = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * scale as f64)?;
    let Some(visible) = visible_mask(dims, o, q.device())? else {
        return candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v.contiguous()?);
    };
    let visible = visible.broadcast_as(scores.shape())?;
    let neg = Tensor::new(f32::NEG_INFINITY, q.device())?
        .to_dtype(scores.dtype())?
        .broadcast_as(scores.shape())?;
    let p = candle_nn::ops::softmax(&visible.where_cond(&scores, &neg)?, D::Minus1)?;
    // A row that sees no key has a NaN softmax: zero it (a NaN score keeps its row NaN).
    let p = visible.where_cond(&p, &p.zeros_like()?)?;
    p.matmul(&v.contiguous()?)
}

/// The CPU op (f32): the sizes, the scale, the masks, and the log-sum-exp of every query row
/// from the forward pass to the backward pass (linear in the sequence).
struct FlashAttention {
    dims: Dims,
    scale: f32,
    vis: Arc<Visibility>,
    lse: Mutex<Option<Arc<Vec<f32>>>>,
    /// Forces the backward pass's one-pass or two-pass schedule (tests); `None` chooses.
    one_pass: Option<bool>,
}

impl FlashAttention {
    fn new(dims: Dims, scale: f32, vis: Visibility) -> Self {
        FlashAttention {
            dims,
            scale,
            vis: Arc::new(vis),
            lse: Mutex::new(None),
            one_pass: None,
        }
    }

    /// q, k and v as f32 data with their views, checked to lie within their buffers.
    fn inputs<'a>(&self, s: [&'a CpuStorage; 3], l: [&Layout; 3]) -> Result<Inputs<'a>> {
        let data = match s {
            [CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(c)] => [&a[..], b, c],
            _ => candle_core::bail!("accelerate-rs-flash-attention: f32 inputs are expected"),
        };
        let views = [View::of(l[0])?, View::of(l[1])?, View::of(l[2])?];
        let Dims {
            b,
            h,
            hkv,
            tq,
            tk,
            d,
            dv,
        } = self.dims;
        let sizes = [(h, tq, d), (hkv, tk, d), (hkv, tk, dv)];
        for ((x, v), (heads, t, w)) in data.iter().zip(&views).zip(sizes) {
            if !fits(v, b, heads, t, w, x.len()) {
                candle_core::bail!(
                    "accelerate-rs-flash-attention: an input's layout exceeds its buffer"
                );
            }
        }
        Ok(Inputs { data, views })
    }

    /// The output shape, `[B, H, T_q, D_v]`.
    fn out_shape(&self) -> Shape {
        let Dims { b, h, tq, dv, .. } = self.dims;
        Shape::from((b, h, tq, dv))
    }

    /// The gradients of q, k and v from the output `y` and its gradient.
    fn grads(&self, x: [&Tensor; 3], y: &Tensor, grad: &Tensor) -> Result<[Tensor; 3]> {
        let Some(lse) = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            candle_core::bail!("accelerate-rs-flash-attention: backward before forward");
        };
        let (grad, y) = (grad.contiguous()?, y.contiguous()?);
        let (gs, gl) = grad.storage_and_layout();
        let (ys, yl) = y.storage_and_layout();
        let (dy, out) = match (&*gs, &*ys) {
            (Storage::Cpu(CpuStorage::F32(g)), Storage::Cpu(CpuStorage::F32(o))) => {
                (super::elem::slice(g, gl)?, super::elem::slice(o, yl)?)
            }
            _ => candle_core::bail!("accelerate-rs-flash-attention: f32 CPU gradients expected"),
        };
        let n = self.out_shape().elem_count();
        if dy.len() != n || out.len() != n {
            candle_core::bail!(
                "accelerate-rs-flash-attention: a gradient of shape {:?} for an output of shape {:?}",
                grad.dims(),
                self.out_shape().dims()
            );
        }
        let guards = x.map(|t| t.storage_and_layout());
        let storages = match [&*guards[0].0, &*guards[1].0, &*guards[2].0] {
            [Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)] => [a, b, c],
            _ => candle_core::bail!("accelerate-rs-flash-attention: CPU inputs are expected"),
        };
        let inputs = self.inputs(storages, [guards[0].1, guards[1].1, guards[2].1])?;
        let delta = flash_cpu::deltas(out, dy, self.dims.dv);
        let up = Upstream {
            dy,
            lse: &lse,
            delta: &delta,
        };
        let [gq, gk, gv] =
            flash_cpu::backward(self.dims, self.scale, &self.vis, inputs, up, self.one_pass);
        let Dims {
            b,
            h,
            hkv,
            tq,
            tk,
            d,
            dv,
        } = self.dims;
        let dev = grad.device();
        Ok([
            Tensor::from_vec(gq, (b, h, tq, d), dev)?,
            Tensor::from_vec(gk, (b, hkv, tk, d), dev)?,
            Tensor::from_vec(gv, (b, hkv, tk, dv), dev)?,
        ])
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "accelerate-rs-flash-attention"
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
        let inputs = self.inputs([s1, s2, s3], [l1, l2, l3])?;
        let shape = self.out_shape();
        let Dims { b, h, tq, .. } = self.dims;
        let (mut y, mut lse) = (vec![0f32; shape.elem_count()], vec![0f32; b * h * tq]);
        flash_cpu::forward(self.dims, self.scale, &self.vis, inputs, &mut y, &mut lse);
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(lse));
        Ok((CpuStorage::F32(y), shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [gq, gk, gv] = self.grads([q, k, v], res, grad)?;
        Ok((Some(gq), Some(gk), Some(gv)))
    }
}

#[cfg(test)]
#[path = "flash_tests.rs"]
mod tests;
