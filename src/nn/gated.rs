//! The first half of a Llama-style MLP as one op on the CPU: `silu(x W_gᵀ) · (x W_uᵀ)`. Two
//! [`Linear`](super::Linear) ops and a [`swiglu`](super::swiglu) make three graph nodes of the
//! MLP's inner width, each given a zero-filled gradient by Candle's backward pass that the
//! next one is added into; here there is one node, the gate and up products are kept inside it
//! for the backward pass (as the composed form keeps them as `swiglu`'s inputs) and turned into
//! their own gradients in place. On a GPU, `gated_node.rs` does the same with the device's
//! products and kernels.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::slice;
use super::linear::{device_node, fusable, Linear};
use super::product::{product, product_add, times_wt, Operand};
use super::silu::{swiglu_chunk, swiglu_grads_chunk};

/// Elements per Rayon task.
const CHUNK: usize = 4096;

/// `silu(gate.forward(x)) * up.forward(x)` (`swiglu` of the two projections): one fused op for
/// bias-free f32 layers on the CPU with one weight shape, one graph node for bias-free layers
/// on a GPU with `nn`'s CUDA kernels on (cuBLAS products and the SwiGLU kernel), the composed
/// ops otherwise (other CPU dtypes, biases). The same values and gradients as the composed
/// form, up to rounding.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{swiglu, swiglu_linear, Linear};
/// use candle_core::{Device, Module, Tensor};
/// let dev = Device::Cpu;
/// let gate = Linear::new(Tensor::randn(0f32, 0.1, (6, 4), &dev)?, None);
/// let up = Linear::new(Tensor::randn(0f32, 0.1, (6, 4), &dev)?, None);
/// let x = Tensor::randn(0f32, 1.0, (2, 3, 4), &dev)?;
/// let fused = swiglu_linear(&x, &gate, &up)?;
/// let plain = swiglu(&gate.forward(&x)?, &up.forward(&x)?)?;
/// let diff = (fused - plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-6);
/// # Ok(()) }
/// ```
pub fn swiglu_linear(x: &Tensor, gate: &Linear, up: &Linear) -> Result<Tensor> {
    let (wg, wu) = (gate.weight(), up.weight());
    let k = x.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count().checked_div(k).unwrap_or(0);
    if gate.bias().is_none()
        && up.bias().is_none()
        && wg.dims() == wu.dims()
        && device_node(x, wg, rows, k)?
        && device_node(x, wu, rows, k)?
    {
        // On a GPU with `nn`'s kernels: one node too (cuBLAS products and the SwiGLU kernel),
        // so the gate and up gradients are not zero-filled and added into (`gated_node`).
        return super::gated_node::gated_node(x, wg, wu);
    }
    let fuse = gate.bias().is_none()
        && up.bias().is_none()
        && x.dtype() == candle_core::DType::F32
        && wg.dims() == wu.dims()
        && fusable(x, wg, None, rows, k)?
        && fusable(x, wu, None, rows, k)?;
    if !fuse {
        use candle_core::Module;
        return super::swiglu(&gate.forward(x)?, &up.forward(x)?);
    }
    let op = GatedUp {
        n: wg.dim(0)?,
        kept: Mutex::new(None),
    };
    x.contiguous()?.apply_op3(wg, wu, op)
}

/// The fused op; `n` is the inner width.
struct GatedUp {
    n: usize,
    /// The gate and up products of the forward pass, until the backward pass takes them.
    kept: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

/// `(x W_gᵀ, x W_uᵀ)` for `x` `[rows, k]` and the weights `[n, k]`.
fn products(
    x: &[f32],
    wg: &[f32],
    wu: &[f32],
    rows: usize,
    k: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = wg.len() / k.max(1);
    Ok((times_wt(x, wg, rows, n, k)?, times_wt(x, wu, rows, n, k)?))
}

/// The f32 data of a contiguous CPU storage.
fn f32s<'a>(s: &'a Storage, l: &Layout) -> Result<&'a [f32]> {
    match s {
        Storage::Cpu(CpuStorage::F32(v)) => slice(v, l),
        _ => candle_core::bail!(
            "accelerate-rs-swiglu-linear: a contiguous f32 CPU tensor is expected"
        ),
    }
}

impl GatedUp {
    /// The kept products, or the forward products again (a second backward pass).
    fn take_products(&self, x: &Tensor, wg: &Tensor, wu: &Tensor) -> Result<(Vec<f32>, Vec<f32>)> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(kept) = kept {
            return Ok(kept);
        }
        let k = wg.dim(1)?;
        let guards = [x, wg, wu].map(Tensor::storage_and_layout);
        let [xs, wgs, wus] = [0, 1, 2].map(|i| f32s(&guards[i].0, guards[i].1));
        products(xs?, wgs?, wus?, x.elem_count() / k, k)
    }
}

impl CustomOp3 for GatedUp {
    fn name(&self) -> &'static str {
        "accelerate-rs-swiglu-linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
        su: &CpuStorage,
        lu: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(wg), CpuStorage::F32(wu)) = (sx, sg, su) else {
            candle_core::bail!("accelerate-rs-swiglu-linear: f32 inputs are expected");
        };
        let (x, wg, wu) = (slice(x, lx)?, slice(wg, lg)?, slice(wu, lu)?);
        let k = lx.dims().last().copied().unwrap_or(1).max(1);
        let rows = x.len() / k;
        let (g, u) = products(x, wg, wu, rows, k)?;
        let mut y = g.clone();
        y.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(u.par_chunks(CHUNK).inline_when_single())
            .for_each(|(y, u)| swiglu_chunk(y, u));
        *self.kept.lock().unwrap_or_else(|p| p.into_inner()) = Some((g, u));
        let mut out = lx.dims().to_vec();
        if let Some(last) = out.last_mut() {
            *last = self.n;
        }
        Ok((CpuStorage::F32(y), Shape::from(out)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        wg: &Tensor,
        wu: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k) = (self.n, wg.dim(1)?);
        let rows = x.elem_count() / k;
        let (mut dg, mut du) = self.take_products(x, wg, wu)?;
        let grad = grad.contiguous()?;
        let guards = [x, wg, wu, &grad].map(Tensor::storage_and_layout);
        let [xs, wgs, wus, dy] = [0, 1, 2, 3].map(|i| f32s(&guards[i].0, guards[i].1));
        let (xs, wgs, wus, dy) = (xs?, wgs?, wus?, dy?);
        if dy.len() != dg.len() || dg.len() != rows * n {
            candle_core::bail!(
                "accelerate-rs-swiglu-linear: {} output gradients for {rows} x {n}",
                dy.len()
            );
        }
        // In place: the gate product becomes its gradient, the up product its own.
        dg.par_chunks_mut(CHUNK)
            .inline_when_single()
            .zip(du.par_chunks_mut(CHUNK).inline_when_single())
            .zip(dy.par_chunks(CHUNK).inline_when_single())
            .for_each(|((g, u), dy)| swiglu_grads_chunk(g, u, dy));
        let rowwise = |d| Operand {
            data: d,
            rs: n,
            cs: 1,
        };
        let dx = match x.track_op() {
            true => {
                let w = |w| Operand {
                    data: w,
                    rs: k,
                    cs: 1,
                };
                let mut dx = product(rows, k, n, rowwise(&dg), w(wgs))?;
                product_add(&mut dx, rows, k, n, rowwise(&du), w(wus))?;
                Some(Tensor::from_vec(dx, x.shape(), x.device())?)
            }
            false => None,
        };
        // `dW = dᵀ x`: `d` `[rows, n]` read transposed (row stride 1, column stride n).
        let xm = Operand {
            data: xs,
            rs: k,
            cs: 1,
        };
        let weight_grad = |w: &Tensor, d: &[f32]| -> Result<Option<Tensor>> {
            if !w.track_op() {
                return Ok(None);
            }
            let dw = product(
                n,
                k,
                rows,
                Operand {
                    data: d,
                    rs: 1,
                    cs: n,
                },
                xm,
            )?;
            super::grad_frames::deposit(w, Tensor::from_vec(dw, (n, k), w.device())?)
        };
        Ok((dx, weight_grad(wg, &dg)?, weight_grad(wu, &du)?))
    }
}
