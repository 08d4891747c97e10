//! Scaled dot-product attention as one differentiable op on the CPU. Composed, one attention
//! layer is a dozen graph nodes — the head split (reshape, permute, three narrows and copies),
//! the two batched products, the scaling, the mask, the softmax, the head merge — and Candle's
//! backward zero-fills a gradient for each of them and adds into it (a narrow's gradient is the
//! whole packed projection, zero-padded). Here the products read the heads where they lie (any
//! strides, the packed `[B, T, 3C]` projection included) and the gradients are written where they
//! belong, in one node; the attention weights are kept from the forward pass for the backward.

use std::sync::{Arc, Mutex};

use candle_core::{
    CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor, D,
};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::fused_cpu;
use super::mask::causal_mask;
use super::softmax::{softmax_grad_in_place, softmax_in_place};

/// Query rows (and keys) per block of a causal attention's products: a block's products skip
/// the keys none of its rows sees. At 128 tokens that saves a quarter of the products' work and
/// costs as much in smaller products (blocks of 16 to 128 timed alike); longer sequences gain.
const CAUSAL_BLOCK: usize = 64;

/// Options of [`scaled_dot_product_attention`] and [`packed_self_attention`] (PyTorch's
/// `is_causal`, `scale` and `key_padding_mask`).
#[derive(Debug, Clone, Default)]
pub struct AttentionOptions {
    /// Query `i` sees keys `0..=i + T_k - T_q` only (needs `T_q <= T_k`): a decoder's
    /// self-attention.
    pub causal: bool,
    /// The factor on the scores; `None` (default) is `1 / sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// `[B, T_k]`, any dtype: a nonzero entry marks a padding key that no query of that sequence
    /// sees. A query that sees no key at all gets zeros (PyTorch gives NaN).
    pub key_padding_mask: Option<Tensor>,
}

impl AttentionOptions {
    /// Sets [`AttentionOptions::causal`].
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the factor on the scores.
    pub fn scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets the key padding mask (`[B, T_k]`, nonzero = padding).
    pub fn key_padding_mask(mut self, mask: Tensor) -> Self {
        self.key_padding_mask = Some(mask);
        self
    }
}

/// `softmax(scale · q kᵀ + mask) v` per batch entry and head: PyTorch's
/// `scaled_dot_product_attention` for `q` `[B, H, T_q, D]`, `k` `[B, KV, T_k, D]` and `v`
/// `[B, KV, T_k, D_v]` (any strides), giving `[B, H, T_q, D_v]`. `KV` is `H` or divides it
/// (grouped-query attention, PyTorch's `enable_gqa`: query head `j` reads key/value head
/// `j / (H / KV)`). On the CPU (float dtypes, computed in f32) it is one fused, differentiable op
/// (the key/value heads repeated first); on a GPU whose `nn` kernels are on, without a padding
/// mask, one node too, the key/value heads read where they are; elsewhere Candle's composed
/// ops.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{scaled_dot_product_attention, AttentionOptions};
/// use candle_core::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 4, 5, 8), &dev)?;
/// let (k, v) = (q.clone(), q.clone());
/// let y = scaled_dot_product_attention(&q, &k, &v, &AttentionOptions::default().causal(true))?;
/// assert_eq!(y.dims(), [2, 4, 5, 8]);
/// // The first query sees only the first key, so it gets the first value.
/// let first = (y.narrow(2, 0, 1)? - v.narrow(2, 0, 1)?)?.abs()?.max_all()?;
/// assert!(first.to_scalar::<f32>()? < 1e-6);
/// # Ok(()) }
/// ```
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: &AttentionOptions,
) -> Result<Tensor> {
    let shapes = || format!("q {:?}, k {:?}, v {:?}", q.dims(), k.dims(), v.dims());
    let dims = match (q.dims(), k.dims(), v.dims()) {
        (&[b, h, tq, d], &[kb, kh, tk, kd], &[vb, vh, vt, dv])
            if (kb, kd) == (b, d) && (vb, vh, vt) == (b, kh, tk) && kh > 0 && h % kh == 0 =>
        {
            Dims {
                b,
                h,
                tq,
                tk,
                d,
                dv,
            }
        }
        _ => candle_core::bail!(
            "accelerate_rs::nn::scaled_dot_product_attention: {}: expected q [B, H, T_q, D], \
             k [B, KV, T_k, D] and v [B, KV, T_k, D_v] with KV dividing H",
            shapes()
        ),
    };
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        candle_core::bail!(
            "accelerate_rs::nn::scaled_dot_product_attention: q, k and v in one dtype expected, \
             got {:?}, {:?}, {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    let cpu = fused_cpu(q) && k.device().is_cpu() && v.device().is_cpu();
    let op = Attention::new(dims, options, false, cpu, "scaled_dot_product_attention")?;
    if !cpu {
        return op.composed(q, k, v);
    }
    if dims.is_empty() {
        return Tensor::zeros((dims.b, dims.h, dims.tq, dims.dv), q.dtype(), q.device());
    }
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    // Grouped key/value heads repeated for the CPU op (after the cast: fewer bytes to convert).
    let (k, v) = (
        repeat_heads(&f32_of(k)?, dims.h)?,
        repeat_heads(&f32_of(v)?, dims.h)?,
    );
    let y = f32_of(q)?.apply_op3(&k, &v, op)?;
    y.to_dtype(q.dtype())
}

/// Self-attention over a packed projection: `qkv` `[B, T, 3C]` holds the queries, keys and
/// values side by side (`C` columns each, `heads` heads of `C / heads` columns in each, as GPT-2's
/// `c_attn` or PyTorch's `in_proj` make them), and the result is `[B, T, C]` with the heads
/// merged back, ready for the output projection. The same as splitting the heads, calling
/// [`scaled_dot_product_attention`] and merging them, without the copies: on the CPU one fused op
/// whose gradient is `[B, T, 3C]` straight away.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{packed_self_attention, AttentionOptions};
/// use candle_core::{Device, Tensor};
/// let qkv = Tensor::randn(0f32, 1.0, (2, 5, 3 * 16), &Device::Cpu)?;
/// let y = packed_self_attention(&qkv, 4, &AttentionOptions::default().causal(true))?;
/// assert_eq!(y.dims(), [2, 5, 16]);
/// # Ok(()) }
/// ```
pub fn packed_self_attention(
    qkv: &Tensor,
    heads: usize,
    options: &AttentionOptions,
) -> Result<Tensor> {
    let dims = match qkv.dims() {
        &[b, t, c3] if heads > 0 && c3 % 3 == 0 && (c3 / 3) % heads == 0 => Dims {
            b,
            h: heads,
            tq: t,
            tk: t,
            d: c3 / 3 / heads,
            dv: c3 / 3 / heads,
        },
        d => candle_core::bail!(
            "accelerate_rs::nn::packed_self_attention: qkv {d:?} with {heads} heads: expected \
             [B, T, 3C] with C a multiple of the number of heads (and at least one head)"
        ),
    };
    let cpu = fused_cpu(qkv);
    let op = Attention::new(dims, options, true, cpu, "packed_self_attention")?;
    let c = dims.h * dims.d;
    if !cpu {
        let split = qkv
            .reshape((dims.b, dims.tq, 3, dims.h, dims.d))?
            .permute((2, 0, 3, 1, 4))?;
        let y = op.composed(&split.get(0)?, &split.get(1)?, &split.get(2)?)?;
        return y.transpose(1, 2)?.reshape((dims.b, dims.tq, c));
    }
    if dims.is_empty() {
        return Tensor::zeros((dims.b, dims.tq, c), qkv.dtype(), qkv.device());
    }
    let y = qkv.to_dtype(DType::F32)?.contiguous()?.apply_op1(op)?;
    y.to_dtype(qkv.dtype())
}

/// The sizes: batch, heads, queries, keys, the query/key width and the value width.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    h: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

impl Dims {
    /// Whether the output is empty or all zeros (no keys): nothing to compute.
    fn is_empty(&self) -> bool {
        self.b == 0 || self.h == 0 || self.tq == 0 || self.tk == 0 || self.dv == 0
    }
}

/// Where an operand lies in its buffer: element `(b, h, t, c)` at
/// `start + b·sb + h·sh + t·st + c·sc`.
#[derive(Debug, Clone, Copy)]
pub(super) struct View {
    pub(super) start: usize,
    pub(super) sb: usize,
    pub(super) sh: usize,
    pub(super) st: usize,
    pub(super) sc: usize,
}

impl View {
    /// A 4-dimensional layout's view.
    pub(super) fn of(l: &Layout) -> Result<View> {
        match l.stride() {
            &[sb, sh, st, sc] => Ok(View {
                start: l.start_offset(),
                sb,
                sh,
                st,
                sc,
            }),
            s => candle_core::bail!("accelerate-rs-attention: 4 strides expected, got {s:?}"),
        }
    }

    /// A contiguous `[B, H, T, width]` tensor's view.
    fn heads_major(h: usize, t: usize, width: usize) -> View {
        View {
            start: 0,
            sb: h * t * width,
            sh: t * width,
            st: width,
            sc: 1,
        }
    }

    /// Part `part` (0..3) of a packed `[B, T, parts · H · width]` buffer, viewed per head.
    fn packed(start: usize, h: usize, t: usize, width: usize, parts: usize, part: usize) -> View {
        let row = parts * h * width;
        View {
            start: start + part * h * width,
            sb: t * row,
            sh: width,
            st: row,
            sc: 1,
        }
    }

    /// The first element of head `(b, h)`.
    pub(super) fn at(&self, b: usize, h: usize) -> usize {
        self.start + b * self.sb + h * self.sh
    }

    /// Whether `dims.b × dims.h × t × width` elements at this view lie within `len`.
    fn fits(&self, dims: Dims, t: usize, width: usize, len: usize) -> bool {
        let last = |n: usize| n.saturating_sub(1);
        let end = self.at(last(dims.b), last(dims.h)) + last(t) * self.st + last(width) * self.sc;
        dims.b * dims.h * t * width == 0 || end < len
    }

    /// The strided matrix of head `(b, h)` in `data` (rows `t`, columns `c`).
    pub(super) fn mat(&self, data: *const f32, b: usize, h: usize) -> Mat {
        Mat {
            // `wrapping_add`: the offset is checked by `fits` before any read.
            ptr: data.wrapping_add(self.at(b, h)),
            rs: self.st as isize,
            cs: self.sc as isize,
        }
    }
}

/// A strided matrix operand: the element `(i, j)` at `ptr + i·rs + j·cs`.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    pub(super) ptr: *const f32,
    pub(super) rs: isize,
    pub(super) cs: isize,
}

impl Mat {
    /// The transposed matrix (no copy).
    pub(super) fn t(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// The sub-matrix from element `(i, j)` on (no copy; the caller keeps it in bounds).
    pub(super) fn at(self, i: usize, j: usize) -> Mat {
        let offset = i as isize * self.rs + j as isize * self.cs;
        Mat {
            ptr: self.ptr.wrapping_offset(offset),
            ..self
        }
    }

    /// A contiguous `cols`-wide row-major matrix in `data`, to read.
    pub(super) fn rows(data: &[f32], cols: usize) -> Mat {
        Mat {
            ptr: data.as_ptr(),
            rs: cols as isize,
            cs: 1,
        }
    }

    /// A contiguous `cols`-wide row-major matrix in `data`, to write (made just before the
    /// product that writes it, with no other use of `data` in between).
    pub(super) fn rows_mut(data: &mut [f32], cols: usize) -> Mat {
        Mat {
            ptr: data.as_mut_ptr(),
            rs: cols as isize,
            cs: 1,
        }
    }
}

/// A pointer that Rayon's tasks share; each writes elements no other task touches.
#[derive(Clone, Copy)]
pub(super) struct SharedMut(pub(super) *mut f32);
// SAFETY: the tasks given a `SharedMut` write disjoint elements (one attention head each) of a
// buffer that outlives them, and nothing reads those elements until every task has finished.
unsafe impl Send for SharedMut {}
// SAFETY: as for `Send`: concurrent use only ever writes disjoint elements.
unsafe impl Sync for SharedMut {}

/// `dst = beta · lhs · rhs` for `lhs` `m × k` and `rhs` `k × n` (`gemm`, on this thread).
///
/// # Safety
/// Every element of `lhs` (`m × k`), `rhs` (`k × n`) and `dst` (`m × n`, at `dst.rs`/`dst.cs`)
/// lies in a live allocation; no other thread reads or writes `dst`'s elements meanwhile, and
/// `dst` overlaps neither operand.
unsafe fn matmul(m: usize, n: usize, k: usize, dst: Mat, lhs: Mat, rhs: Mat, beta: f32) {
    // SAFETY: the caller's guarantees are `gemm`'s: in-bounds operands, an exclusive `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr as *mut f32,
            dst.cs,
            dst.rs,
            false,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            0.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The fused op (f32): the sizes, the scale, the masks, whether its input is one packed
/// `[B, T, 3C]` projection (else `q`, `k`, `v`), and the attention weights between the forward
/// and the backward pass.
struct Attention {
    dims: Dims,
    scale: f32,
    causal: bool,
    /// `[B, T_k]`, 1 where a key is padding (read to the host for the CPU op only).
    padding: Option<Arc<Vec<u8>>>,
    /// The key padding mask as given (`[B, T_k]`, checked), for the composed path on its device.
    padding_mask: Option<Tensor>,
    packed: bool,
    probs: Mutex<Option<Vec<f32>>>,
}

impl Attention {
    /// The op for `dims` and `options` (`caller` names the function in errors); `host`: the CPU
    /// op will run, so the padding mask is read into host memory (the composed path keeps it on
    /// its device, with no read-back).
    fn new(
        dims: Dims,
        options: &AttentionOptions,
        packed: bool,
        host: bool,
        caller: &str,
    ) -> Result<Self> {
        if dims.d == 0 {
            candle_core::bail!("accelerate_rs::nn::{caller}: queries and keys of width 0");
        }
        if options.causal && dims.tq > dims.tk {
            candle_core::bail!(
                "accelerate_rs::nn::{caller}: causal attention needs T_q <= T_k, got {} queries \
                 and {} keys",
                dims.tq,
                dims.tk
            );
        }
        let padding = match &options.key_padding_mask {
            None => None,
            Some(m) if m.dims() == [dims.b, dims.tk] && !host => None,
            Some(m) if m.dims() == [dims.b, dims.tk] => {
                let flags = crate::readback::counted(|| m.ne(0.0)?.flatten_all()?.to_vec1::<u8>())?;
                Some(Arc::new(flags))
            }
            Some(m) => candle_core::bail!(
                "accelerate_rs::nn::{caller}: key_padding_mask of shape {:?}, expected [B, T_k] = \
                 [{}, {}]",
                m.dims(),
                dims.b,
                dims.tk
            ),
        };
        let scale = options.scale.unwrap_or(1.0 / (dims.d.max(1) as f64).sqrt());
        Ok(Attention {
            dims,
            scale: scale as f32,
            causal: options.causal,
            padding,
            padding_mask: options.key_padding_mask.clone(),
            packed,
            probs: Mutex::new(None),
        })
    }

    /// The views of q, k and v: from their layouts, or in the one packed (contiguous) input.
    fn views(&self, layouts: [&Layout; 3]) -> Result<[View; 3]> {
        let Dims { h, tq, d, .. } = self.dims;
        if self.packed {
            let l = layouts[0];
            if !l.is_contiguous() {
                candle_core::bail!("accelerate-rs-attention: the packed input must be contiguous");
            }
            let part = |p| View::packed(l.start_offset(), h, tq, d, 3, p);
            Ok([part(0), part(1), part(2)])
        } else {
            Ok([
                View::of(layouts[0])?,
                View::of(layouts[1])?,
                View::of(layouts[2])?,
            ])
        }
    }

    /// The output's view: `[B, T, H · D_v]` for the packed input, else `[B, H, T_q, D_v]`.
    fn out_view(&self) -> View {
        let Dims { h, tq, dv, .. } = self.dims;
        if self.packed {
            View::packed(0, h, tq, dv, 1, 0)
        } else {
            View::heads_major(h, tq, dv)
        }
    }

    /// The output's shape.
    fn out_shape(&self) -> Shape {
        let Dims { b, h, tq, dv, .. } = self.dims;
        if self.packed {
            Shape::from((b, tq, h * dv))
        } else {
            Shape::from((b, h, tq, dv))
        }
    }

    /// Checks that q, k and v (in `data`) lie within their buffers.
    fn check(&self, data: [&[f32]; 3], views: &[View; 3]) -> Result<()> {
        let Dims { tq, tk, d, dv, .. } = self.dims;
        let sizes = [(tq, d), (tk, d), (tk, dv)];
        for ((x, v), (t, w)) in data.iter().zip(views).zip(sizes) {
            if !v.fits(self.dims, t, w, x.len()) {
                candle_core::bail!("accelerate-rs-attention: an input's layout exceeds its buffer");
            }
        }
        Ok(())
    }

    /// Blocks of query rows `(r0, r1, keys)`: rows `r0..r1` see keys `0..keys` at most (all of
    /// them unless causal, where the products skip the keys no row of the block sees).
    fn query_blocks(&self) -> impl Iterator<Item = (usize, usize, usize)> {
        let (Dims { tq, tk, .. }, causal) = (self.dims, self.causal);
        let step = if self.causal { CAUSAL_BLOCK } else { tq.max(1) };
        (0..tq).step_by(step).map(move |r0| {
            let r1 = (r0 + step).min(tq);
            let keys = if causal { r1 + tk - tq } else { tk };
            (r0, r1, keys)
        })
    }

    /// Blocks of keys `(c0, c1, first)`: keys `c0..c1` are seen by query rows `first..` only.
    fn key_blocks(&self) -> impl Iterator<Item = (usize, usize, usize)> {
        let (Dims { tq, tk, .. }, causal) = (self.dims, self.causal);
        let step = if self.causal { CAUSAL_BLOCK } else { tk.max(1) };
        (0..tk).step_by(step).map(move |c0| {
            let first = if causal {
                c0.saturating_sub(tk - tq)
            } else {
                0
            };
            (c0, (c0 + step).min(tk), first.min(tq))
        })
    }

    /// Row `i` of head `(b, _)`'s scores turned into attention weights in place.
    fn softmax_row(&self, row: &mut [f32], b: usize, i: usize) {
        let Dims { tq, tk, .. } = self.dims;
        let seen = if self.causal { i + tk - tq + 1 } else { tk }.min(tk);
        let (live, rest) = row.split_at_mut(seen);
        rest.fill(0.0);
        if let Some(pad) = &self.padding {
            for (s, &p) in live.iter_mut().zip(&pad[b * tk..]) {
                if p != 0 {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        softmax_in_place(live, true);
    }

    /// The attention weights `[B, H, T_q, T_k]` and, when `out` is given, `y = weights · v`
    /// written there at `out_view` (non-empty dims; inputs checked).
    fn forward(
        &self,
        data: [&[f32]; 3],
        views: &[View; 3],
        out: Option<(&mut [f32], View)>,
    ) -> Vec<f32> {
        let Dims {
            h, tq, tk, d, dv, ..
        } = self.dims;
        let mut probs = vec![0f32; self.dims.b * h * tq * tk];
        let out = out.map(|(y, v)| (SharedMut(y.as_mut_ptr()), v));
        probs
            .par_chunks_mut(tq * tk)
            .inline_when_single()
            .enumerate()
            .for_each(|(bh, p)| {
                let (b, hh) = (bh / h, bh % h);
                let [qm, km, vm] = mats(data, views, b, hh);
                for (r0, r1, keys) in self.query_blocks() {
                    let pm = Mat::rows_mut(p, tk);
                    // SAFETY: `check` bounded q and k (rows `r0..r1 <= tq`, keys `<= tk`);
                    // `p` is this task's own `tq × tk` chunk.
                    unsafe {
                        matmul(
                            r1 - r0,
                            keys,
                            d,
                            pm.at(r0, 0),
                            qm.at(r0, 0),
                            km.t(),
                            self.scale,
                        )
                    };
                }
                // Each row's weights; the keys it does not see (never computed) become 0.
                for (i, row) in p.chunks_mut(tk).enumerate() {
                    self.softmax_row(row, b, i);
                }
                if let Some((y, yv)) = &out {
                    let (ym, pm) = (yv.mat(y.0, b, hh), Mat::rows(p, tk));
                    for (r0, r1, keys) in self.query_blocks() {
                        // SAFETY: `check` bounded v; the output view (ours, sized for the dims)
                        // gives head (b, hh) elements no other task writes.
                        unsafe { matmul(r1 - r0, dv, keys, ym.at(r0, 0), pm.at(r0, 0), vm, 1.0) };
                    }
                }
            });
        probs
    }

    /// The gradients of q, k and v from the output's (`dy`, contiguous in the output's layout),
    /// written at `grads`' views in `out` (`out` holds all three for the packed input).
    fn backward(
        &self,
        data: [&[f32]; 3],
        views: &[View; 3],
        probs: &[f32],
        dy: &[f32],
        out: [(SharedMut, View); 3],
    ) {
        let Dims {
            h, tq, tk, d, dv, ..
        } = self.dims;
        let yv = self.out_view();
        probs
            .par_chunks(tq * tk)
            .inline_when_single()
            .enumerate()
            .for_each_init(
                || vec![0f32; tq * tk],
                |ds, (bh, p)| {
                    let (b, hh) = (bh / h, bh % h);
                    let dym = yv.mat(dy.as_ptr(), b, hh);
                    let [qm, km, vm] = mats(data, views, b, hh);
                    let [(gq, vq), (gk, vk), (gv, vv)] = &out;
                    let pm = Mat::rows(p, tk);
                    // SAFETY: (every product below) `check` bounded q, k and v, `dy` is the output's
                    // contiguous gradient (its size checked), `p`/`ds` are this task's own `tq × tk`
                    // buffers, the blocks stay within `tq` rows and `tk` keys, and the gradient
                    // views (ours, sized for the dims) give head (b, hh) elements that no other task
                    // writes.
                    for (r0, r1, keys) in self.query_blocks() {
                        // dP = dY Vᵀ, then dS = P ∘ (dP − rowsum(P ∘ dP)) in place (0 past `keys`).
                        let dsm = Mat::rows_mut(ds, tk).at(r0, 0);
                        // SAFETY: see above.
                        unsafe { matmul(r1 - r0, keys, dv, dsm, dym.at(r0, 0), vm.t(), 1.0) };
                        let rows = ds[r0 * tk..r1 * tk].chunks_mut(tk);
                        for (dr, pr) in rows.zip(p[r0 * tk..r1 * tk].chunks(tk)) {
                            let (live, rest) = dr.split_at_mut(keys);
                            softmax_grad_in_place(live, &pr[..keys], 1.0);
                            rest.fill(0.0);
                        }
                        // dQ = scale · dS K.
                        let (dq, dsm) = (vq.mat(gq.0, b, hh).at(r0, 0), Mat::rows(ds, tk));
                        // SAFETY: see above.
                        unsafe { matmul(r1 - r0, d, keys, dq, dsm.at(r0, 0), km, self.scale) };
                    }
                    for (c0, c1, first) in self.key_blocks() {
                        if first >= tq {
                            continue; // no query sees these keys: their gradients stay 0
                        }
                        let rows = tq - first;
                        // dV = Pᵀ dY and dK = scale · dSᵀ Q, over the rows that see these keys.
                        let (dvm, dkm) =
                            (vv.mat(gv.0, b, hh).at(c0, 0), vk.mat(gk.0, b, hh).at(c0, 0));
                        let dsm = Mat::rows(ds, tk);
                        // SAFETY: see above.
                        unsafe {
                            matmul(
                                c1 - c0,
                                dv,
                                rows,
                                dvm,
                                pm.at(first, c0).t(),
                                dym.at(first, 0),
                                1.0,
                            );
                            matmul(
                                c1 - c0,
                                d,
                                rows,
                                dkm,
                                dsm.at(first, c0).t(),
                                qm.at(first, 0),
                                self.scale,
                            );
                        }
                    }
                },
            );
    }

    /// The kept attention weights, or (a second backward pass) recomputed ones.
    fn probs_for_backward(&self, data: [&[f32]; 3], views: &[View; 3]) -> Vec<f32> {
        let kept = self.probs.lock().unwrap_or_else(|p| p.into_inner()).take();
        kept.unwrap_or_else(|| self.forward(data, views, None))
    }

    /// The forward pass on f32 storages.
    fn cpu_forward(&self, s: [&CpuStorage; 3], l: [&Layout; 3]) -> Result<(CpuStorage, Shape)> {
        let (views, yv) = (self.views(l)?, self.out_view());
        let data = f32_data(s)?;
        self.check(data, &views)?;
        let shape = self.out_shape();
        let mut y = vec![0f32; shape.elem_count()];
        let probs = self.forward(data, &views, Some((&mut y, yv)));
        *self.probs.lock().unwrap_or_else(|p| p.into_inner()) = Some(probs);
        Ok((CpuStorage::F32(y), shape))
    }

    /// The gradients of the inputs `x` (q, k, v, or the packed projection once) from `grad`.
    fn grads(&self, x: &[&Tensor], grad: &Tensor) -> Result<Vec<Tensor>> {
        let Dims {
            b,
            h,
            tq,
            tk,
            d,
            dv,
        } = self.dims;
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let dy = match &*gs {
            Storage::Cpu(CpuStorage::F32(g)) => super::elem::slice(g, gl)?,
            _ => candle_core::bail!("accelerate-rs-attention: an f32 CPU gradient is expected"),
        };
        if dy.len() != self.out_shape().elem_count() {
            candle_core::bail!(
                "accelerate-rs-attention: a gradient of shape {:?} for an output of shape {:?}",
                grad.dims(),
                self.out_shape().dims()
            );
        }
        if x.len() != if self.packed { 1 } else { 3 } {
            candle_core::bail!("accelerate-rs-attention: unexpected inputs");
        }
        let guards: Vec<_> = x.iter().map(|t| t.storage_and_layout()).collect();
        // q, k and v; the packed input is all three.
        let part = |i: usize| &guards[i.min(guards.len() - 1)];
        let [(sq, lq), (sk, lk), (sv, lv)] = [part(0), part(1), part(2)];
        let views = self.views([lq, lk, lv])?;
        let data = match [&**sq, &**sk, &**sv] {
            [Storage::Cpu(a), Storage::Cpu(b), Storage::Cpu(c)] => f32_data([a, b, c])?,
            _ => candle_core::bail!("accelerate-rs-attention: CPU inputs are expected"),
        };
        self.check(data, &views)?;
        let probs = self.probs_for_backward(data, &views);
        let dev = grad.device();
        if self.packed {
            let mut g = vec![0f32; b * tq * 3 * h * d];
            let p = SharedMut(g.as_mut_ptr());
            let part = |i| (p, View::packed(0, h, tq, d, 3, i));
            self.backward(data, &views, &probs, dy, [part(0), part(1), part(2)]);
            return Ok(vec![Tensor::from_vec(g, (b, tq, 3 * h * d), dev)?]);
        }
        let (mut gq, mut gk, mut gv) = (
            vec![0f32; b * h * tq * d],
            vec![0f32; b * h * tk * d],
            vec![0f32; b * h * tk * dv],
        );
        let out = [
            (SharedMut(gq.as_mut_ptr()), View::heads_major(h, tq, d)),
            (SharedMut(gk.as_mut_ptr()), View::heads_major(h, tk, d)),
            (SharedMut(gv.as_mut_ptr()), View::heads_major(h, tk, dv)),
        ];
        self.backward(data, &views, &probs, dy, out);
        Ok(vec![
            Tensor::from_vec(gq, (b, h, tq, d), dev)?,
            Tensor::from_vec(gk, (b, h, tk, d), dev)?,
            Tensor::from_vec(gv, (b, h, tk, dv), dev)?,
        ])
    }

    /// Candle's composed ops (other devices and dtypes): scores, the masks as `-inf`, softmax,
    /// rows that see no key zeroed, the product with `v`. The masks are built on the inputs'
    /// device: the causal one once per device and size ([`causal_mask`]), the padding one from the
    /// mask tensor as given; nothing goes through host memory.
    fn composed(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let Dims { b, h, tq, tk, .. } = self.dims;
        let dev = q.device();
        if self.padding_mask.is_none() && !q.device().is_cpu() && super::elem::fused(q)? {
            // On a GPU with `nn`'s kernels: one node (products, softmax kernel, products), its
            // gradients without score-sized zero-fills, grouped key/value heads not repeated
            // (`attention_node`).
            return super::attention_node::attention_node(q, k, v, self.scale as f64, self.causal);
        }
        let (k, v) = (&repeat_heads(k, h)?, &repeat_heads(v, h)?);
        let raw = q.contiguous()?.matmul(&k.contiguous()?.t()?)?;
        if self.padding_mask.is_none() {
            // Scale, mask and softmax in one op: `causal_softmax` / `softmax_last_dim` (the
            // CUDA kernels when they are on, else Candle's composed ops, as below).
            let p = if self.causal {
                super::softmax::causal_softmax(&raw, self.scale as f64)?
            } else {
                super::softmax::softmax_last_dim(&(raw * self.scale as f64)?)?
            };
            return p.matmul(&v.contiguous()?);
        }
        let scores = (raw * self.scale as f64)?;
        let causal = if self.causal {
            Some(causal_mask(tq, tk, dev)?.reshape((1, 1, tq, tk))?)
        } else {
            None
        };
        // 1 where a key is not padding, `[B, 1, 1, T_k]`.
        let keep = match &self.padding_mask {
            Some(m) => Some(m.to_device(dev)?.eq(0.0)?.reshape((b, 1, 1, tk))?),
            None => None,
        };
        let visible = match (causal, keep) {
            (None, None) => {
                return candle_nn::ops::softmax(&scores, D::Minus1)?.matmul(&v.contiguous()?)
            }
            (Some(c), None) => c,
            (None, Some(k)) => k,
            (Some(c), Some(k)) => c.broadcast_mul(&k)?,
        };
        let visible = visible.broadcast_as((b, h, tq, tk))?;
        let neg = Tensor::new(f32::NEG_INFINITY, dev)?
            .to_dtype(scores.dtype())?
            .broadcast_as(scores.shape())?;
        let p = candle_nn::ops::softmax(&visible.where_cond(&scores, &neg)?, D::Minus1)?;
        // Only padding can leave a row without a visible key (its softmax is NaN): zero it.
        let p = if self.padding_mask.is_some() {
            visible.where_cond(&p, &p.zeros_like()?)?
        } else {
            p
        };
        p.matmul(&v.contiguous()?)
    }
}

/// `t` `[B, KV, T, D]` with each head repeated to `h` heads (`KV` divides `h`): `[B, h, T, D]`,
/// `t` itself when it has `h` heads. Grouped-query attention's keys and values for the paths
/// that need one per query head; the gradient sums over the copies.
fn repeat_heads(t: &Tensor, h: usize) -> Result<Tensor> {
    let (b, kv, len, d) = t.dims4()?;
    if kv == h {
        return Ok(t.clone());
    }
    t.unsqueeze(2)?
        .broadcast_as((b, kv, h / kv.max(1), len, d))?
        .reshape((b, h, len, d))
}

/// Head `(b, h)` of q, k and v as matrices.
fn mats(data: [&[f32]; 3], views: &[View; 3], b: usize, h: usize) -> [Mat; 3] {
    [0, 1, 2].map(|i| views[i].mat(data[i].as_ptr(), b, h))
}

/// The f32 data of three storages.
fn f32_data(s: [&CpuStorage; 3]) -> Result<[&[f32]; 3]> {
    match s {
        [CpuStorage::F32(a), CpuStorage::F32(b), CpuStorage::F32(c)] => Ok([a, b, c]),
        _ => candle_core::bail!("accelerate-rs-attention: f32 inputs are expected"),
    }
}

impl CustomOp3 for Attention {
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
        self.cpu_forward([s1, s2, s3], [l1, l2, l3])
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[q, k, v], grad)?.into_iter();
        Ok((g.next(), g.next(), g.next()))
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "accelerate-rs-packed-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu_forward([s, s, s], [l, l, l])
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(&[qkv], grad)?.into_iter().next())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::elem::max_diff;
    use candle_core::Device;

    /// The composed path (what runs on a GPU) equals the fused CPU op, causal or not, with and
    /// without padding, for T_q < T_k too.
    #[test]
    fn the_composed_path_equals_the_fused_op() {
        let dev = Device::Cpu;
        for (causal, pad, tq, tk) in [
            (false, false, 5, 5),
            (true, false, 5, 5),
            (true, false, 3, 6),
            (false, true, 4, 4),
            (true, true, 4, 7),
        ] {
            let (b, h, d) = (2, 3, 8);
            let q = Tensor::randn(0f32, 1.0, (b, h, tq, d), &dev).unwrap();
            let k = Tensor::randn(0f32, 1.0, (b, h, tk, d), &dev).unwrap();
            let v = Tensor::randn(0f32, 1.0, (b, h, tk, d), &dev).unwrap();
            let mut opts = AttentionOptions::default().causal(causal);
            if pad {
                // Sequence 1 pads its last two keys; sequence 0 pads none.
                let mut m = vec![0f32; b * tk];
                m[tk + tk - 2..2 * tk].fill(1.0);
                opts = opts.key_padding_mask(Tensor::from_vec(m, (b, tk), &dev).unwrap());
            }
            let dims = Dims {
                b,
                h,
                tq,
                tk,
                d,
                dv: d,
            };
            let fused = scaled_dot_product_attention(&q, &k, &v, &opts).unwrap();
            let op = Attention::new(dims, &opts, false, false, "test").unwrap();
            assert!(
                op.padding.is_none(),
                "the composed path reads no mask to the host"
            );
            let composed = op.composed(&q, &k, &v).unwrap();
            let diff = max_diff(&fused, &composed);
            assert!(
                diff < 1e-5,
                "causal {causal} padding {pad} {tq}x{tk}: {diff}"
            );
        }
    }

    /// Grouped key/value heads give what the same heads repeated give, values and gradients, on
    /// the fused CPU op and on the composed path; a head count that does not divide is named.
    #[test]
    fn grouped_key_value_heads_equal_repeated_ones() -> Result<()> {
        let dev = Device::Cpu;
        let (b, h, kv, tq, tk, d) = (2, 6, 2, 4, 5, 8);
        let q = candle_core::Var::randn(0f32, 1.0, (b, h, tq, d), &dev)?;
        let k = candle_core::Var::randn(0f32, 1.0, (b, kv, tk, d), &dev)?;
        let v = candle_core::Var::randn(0f32, 1.0, (b, kv, tk, d), &dev)?;
        let opts = AttentionOptions::default().causal(true);
        let grouped = scaled_dot_product_attention(&q, &k, &v, &opts)?;
        let (kr, vr) = (repeat_heads(&k, h)?, repeat_heads(&v, h)?);
        let repeated = scaled_dot_product_attention(&q, &kr, &vr, &opts)?;
        assert!(max_diff(&grouped, &repeated) < 1e-6);
        let dims = Dims {
            b,
            h,
            tq,
            tk,
            d,
            dv: d,
        };
        let composed = Attention::new(dims, &opts, false, false, "test")?.composed(&q, &k, &v)?;
        assert!(max_diff(&grouped, &composed) < 1e-5);
        let g1 = grouped.sqr()?.sum_all()?.backward()?;
        let g2 = repeated.sqr()?.sum_all()?.backward()?;
        for x in [q.as_tensor(), k.as_tensor(), v.as_tensor()] {
            let (Some(a), Some(c)) = (g1.get(x), g2.get(x)) else {
                candle_core::bail!("no gradient");
            };
            assert!(max_diff(a, c) < 1e-5);
        }
        let k4 = Tensor::zeros((b, 4, tk, d), DType::F32, &dev)?;
        let Err(e) = scaled_dot_product_attention(&q, &k4, &k4, &opts) else {
            candle_core::bail!("6 query heads over 4 key/value heads ran");
        };
        assert!(e.to_string().contains("KV dividing H"), "{e}");
        Ok(())
    }
}
