//! A LoRA layer over a frozen base as one op on the CPU and, in a `cuda` build, on a GPU:
//! `y = x Wᵀ + b + s (x Aᵀ) Bᵀ`, its inputs `x`, `A` and `B` (the base `W`, `b` held by the op:
//! they take no gradient). Composed, the update `(x Aᵀ) Bᵀ`, its scaled copy and the sum are
//! three more tensors of the output's size, each kept by Candle's graph until the backward pass
//! is done; here the output is the only one, and the backward pass recomputes the rank-`r`
//! product `x Aᵀ` (`r / out` of the base product's cost). On a GPU the forward pass is the same
//! cuBLAS products and element-wise kernels as the composed ops; only what stays alive differs.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{float_dtype, fused_cpu, Elem};
use super::linear::LinearOp;

/// Elements per Rayon task of the in-place update.
const CHUNK: usize = 16 * 1024;

/// Whether the fused op takes `x` with the frozen base `w`, `b` and the adapter `a`, `b_up`: all
/// on the CPU, in one float dtype, the base outside the graph (frozen), of matching shapes.
pub(super) fn fusable(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    a: &Tensor,
    b_up: &Tensor,
) -> bool {
    let dtype = x.dtype();
    let (Ok((n, k)), Ok((r, ka)), Ok((nb, rb))) = (w.dims2(), a.dims2(), b_up.dims2()) else {
        return false;
    };
    let same = |t: &Tensor| t.device().same_device(x.device()) && t.dtype() == dtype;
    let bias_ok =
        bias.is_none_or(|b| same(b) && b.dims() == [n] && b.is_contiguous() && !b.track_op());
    (fused_cpu(x) || on_gpu(x))
        && x.dims().last() == Some(&k)
        && x.elem_count() > 0
        && same(w)
        && w.is_contiguous()
        && !w.track_op()
        && bias_ok
        && same(a)
        && same(b_up)
        && ka == k
        && nb == n
        && rb == r
        && r > 0
}

/// Whether `x` is a float tensor on a GPU of a `cuda` build.
fn on_gpu(x: &Tensor) -> bool {
    cfg!(feature = "cuda") && x.device().is_cuda() && float_dtype(x.dtype())
}

/// `x Wᵀ + b + s (x Aᵀ) Bᵀ` over the op's inputs `(x, A, B)`.
pub(super) struct LoraOp {
    pub(super) w: Tensor,
    pub(super) bias: Option<Tensor>,
    pub(super) scaling: f64,
}

/// `y += s u`, element by element (same length), in place.
fn add_scaled(y: &mut CpuStorage, u: &CpuStorage, s: f64) -> Result<()> {
    fn typed<T: Elem + WithDType>(y: &mut [T], u: &[T], s: f32) {
        y.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(u.par_chunks(CHUNK).inline_when_single())
            .for_each(|(y, u)| {
                for (y, u) in y.iter_mut().zip(u) {
                    *y = T::of(y.f() + s * u.f());
                }
            });
    }
    match (y, u) {
        (CpuStorage::F32(y), CpuStorage::F32(u)) => typed(y, u, s as f32),
        (CpuStorage::BF16(y), CpuStorage::BF16(u)) => typed(y, u, s as f32),
        (CpuStorage::F16(y), CpuStorage::F16(u)) => typed(y, u, s as f32),
        (CpuStorage::F64(y), CpuStorage::F64(u)) => y
            .par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(u.par_chunks(CHUNK).inline_when_single())
            .for_each(|(y, u)| {
                for (y, u) in y.iter_mut().zip(u) {
                    *y += s * u;
                }
            }),
        _ => candle_core::bail!("accelerate-rs-lora: one float dtype is expected"),
    }
    Ok(())
}

/// `y += s (x Aᵀ) Bᵀ` on CPU storages: `x` contiguous `[rows, k]` from its layout's offset, `A`
/// `[r, k]`, `B` `[n, r]` (of `sizes` `(n, k, r, rows)`), `y` `[rows, n]`, one dtype.
pub(super) fn add_update_cpu(
    y: &mut CpuStorage,
    (sx, lx): (&CpuStorage, &Layout),
    (sa, la): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    (n, k, r, rows): (usize, usize, usize, usize),
    s: f64,
) -> Result<()> {
    // `h = x Aᵀ` (`[rows, r]`), `u = h Bᵀ` (`[rows, n]`), `y += s u`.
    let lx2 = Layout::contiguous_with_offset((rows, k), lx.start_offset());
    let h = sx.matmul(sa, (1, rows, r, k), &lx2, &la.transpose(0, 1)?)?;
    let lh = Layout::contiguous((rows, r));
    let u = h.matmul(sb, (1, rows, n, r), &lh, &lb.transpose(0, 1)?)?;
    add_scaled(y, &u, s)
}

/// The output gradient as `[rows, n]` and the input as `[rows, k]`, both detached (the gradients
/// record no ops and keep nothing else alive) and contiguous.
pub(super) fn flat_grad_and_input(
    grad: &Tensor,
    x: &Tensor,
    n: usize,
    k: usize,
) -> Result<(Tensor, Tensor)> {
    let rows = x.elem_count() / k.max(1);
    let g = grad.detach().contiguous()?.reshape((rows, n))?;
    let x2 = x.detach().contiguous()?.reshape((rows, k))?;
    Ok((g, x2))
}

/// The adapter's part of a LoRA op's backward pass from the output gradient `g` `[rows, n]` and
/// the input `x2` `[rows, k]` (see [`flat_grad_and_input`]): the update's term of the input
/// gradient, `s (g B) A` `[rows, k]` (if `want_dx`), and the gradients of `A` and `B` (for those
/// in the graph).
pub(super) fn adapter_grads(
    want_dx: bool,
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
    x2: &Tensor,
    s: f64,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (ad, bd) = (a.detach(), b.detach());
    let gb = g.matmul(&bd)?; // [rows, r]
    let da = match a.track_op() {
        true => Some((gb.t()?.matmul(x2)? * s)?),
        false => None,
    };
    let db = match b.track_op() {
        true => {
            let h = x2.matmul(&ad.t()?)?;
            Some((g.t()?.matmul(&h)? * s)?)
        }
        false => None,
    };
    let dx = match want_dx {
        true => Some((gb.matmul(&ad)? * s)?),
        false => None,
    };
    Ok((dx, da, db))
}

impl LoraOp {
    /// `(n, k, r, rows)`: the base's output and input widths, the adapter's rank, and the rows
    /// of `x` (its layout `lx`) as `[rows, k]`.
    fn sizes(&self, lx: &Layout, la: &Layout) -> Result<(usize, usize, usize, usize)> {
        let (n, k) = self.w.dims2()?;
        let r = la.dims().first().copied().unwrap_or(0);
        Ok((n, k, r, lx.shape().elem_count() / k.max(1)))
    }
}

impl CustomOp3 for LoraOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-lora"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k, r, rows) = self.sizes(lx, la)?;
        // The base: the fused `Linear`'s forward pass on the frozen weight and bias.
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cpu(ws) = &*ws else {
            candle_core::bail!("{}: the base weight is not on the CPU", self.name());
        };
        let bias = self.bias.as_ref().map(|b| b.storage_and_layout());
        let bias = match &bias {
            Some((s, l)) => match &**s {
                Storage::Cpu(s) => Some((s, *l)),
                _ => candle_core::bail!("{}: the base bias is not on the CPU", self.name()),
            },
            None => None,
        };
        let (mut y, shape) = LinearOp { n, relu: false }.forward(sx, lx, ws, wl, bias)?;
        add_update_cpu(
            &mut y,
            (sx, lx),
            (sa, la),
            (sb, lb),
            (n, k, r, rows),
            self.scaling,
        )?;
        Ok((y, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::cuda_backend::CudaStorage,
        lx: &Layout,
        sa: &candle_core::cuda_backend::CudaStorage,
        la: &Layout,
        sb: &candle_core::cuda_backend::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::cuda_backend::CudaStorage, Shape)> {
        use candle_core::op::Add;
        let (n, k, r, rows) = self.sizes(lx, la)?;
        let (ws, wl) = self.w.storage_and_layout();
        let Storage::Cuda(ws) = &*ws else {
            candle_core::bail!("{}: the base weight is not on the GPU", self.name());
        };
        // `x` is contiguous (the caller makes it so): `[rows, k]` from its offset.
        let lx2 = Layout::contiguous_with_offset((rows, k), lx.start_offset());
        let ly = Layout::contiguous((rows, n));
        let mut y = sx.matmul(ws, (1, rows, n, k), &lx2, &wl.transpose(0, 1)?)?;
        if let Some(bias) = &self.bias {
            let (bs, bl) = bias.storage_and_layout();
            let Storage::Cuda(bs) = &*bs else {
                candle_core::bail!("{}: the base bias is not on the GPU", self.name());
            };
            y = y.binary_impl::<Add>(bs, &ly, &bl.broadcast_as((rows, n))?)?;
        }
        // The update: `h = x Aᵀ`, `u = s (h Bᵀ)`, `y + u`; `h` and `u` are freed on return.
        let h = sx.matmul(sa, (1, rows, r, k), &lx2, &la.transpose(0, 1)?)?;
        let lh = Layout::contiguous((rows, r));
        let u = h.matmul(sb, (1, rows, n, r), &lh, &lb.transpose(0, 1)?)?;
        let u = u.affine(&ly, self.scaling, 0.0)?;
        let y = y.binary_impl::<Add>(&u, &ly, &ly)?;
        let mut dims = lx.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = n;
        }
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k) = self.w.dims2()?;
        let (g, x2) = flat_grad_and_input(grad, x, n, k)?;
        let (update, da, db) = adapter_grads(x.track_op(), a, b, &g, &x2, self.scaling)?;
        let dx = match update {
            Some(u) => Some((g.matmul(&self.w.detach())? + u)?.reshape(x.shape())?),
            None => None,
        };
        Ok((dx, da, db))
    }
}
