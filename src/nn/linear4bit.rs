//! A frozen linear layer over a 4-bit weight ([`Linear4bit`], bitsandbytes' `Linear4bit`), as
//! one differentiable op on the CPU: the forward pass dequantizes the weight a tile of output
//! rows at a time into a scratch buffer and multiplies (the full-precision weight never exists);
//! the backward pass gives the input gradient through the dequantized weight, tile by tile, and
//! no weight gradient. With a LoRA adapter, [`Linear4bit::forward_with_lora`] is QLoRA's layer,
//! one op on the CPU as [`Lora::forward_with_base`] is over a full-precision base.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Module, Result, Shape, Tensor};
use half::{bf16, f16};

use super::elem::slice;
use super::linear::Linear;
use super::lora::Lora;
use super::lora_op::{adapter_grads, add_update_cpu, flat_grad_and_input};
use crate::error::Error;
use crate::quant::{rounding, Quant4bitConfig, Weight4bit};

/// Elements of the weight dequantized at a time (4 MiB of f32): the tile of output rows the
/// forward and backward products take in one matrix product.
const TILE_ELEMS: usize = 1 << 20;

/// A linear layer `y = x Wᵀ + b` whose weight `W` (`[out, in]`) is held in 4 bits
/// ([`Weight4bit`]: NF4 or FP4, bitsandbytes' format): about 0.53 bytes a weight with double
/// quantization instead of 2 (bf16) or 4 (f32). The layer is frozen, bias included, as QLoRA's
/// base is: the backward pass gives the input its gradient and nothing else.
///
/// On the CPU, for f32, bf16 and f16 inputs, one fused op (the weight dequantized a tile at a
/// time, the products in f32, rounded once to the input's dtype); elsewhere (a GPU, f64), the
/// weight is dequantized on the host at each call and the layer runs as a [`Linear`] over it
/// (correct, not fast: the CUDA dequantization kernel, `src/quant/dequant4.cu`, is checked on
/// the CPU's emulation of CUDA but not launched until a GPU run proves it). Either way the weight used is bitsandbytes': each
/// value dequantized in the weight's dtype, then cast to the input's (`dequantize_4bit(W).to(x.dtype)`).
///
/// ```
/// use accelerate_rs::nn::{Linear, Linear4bit};
/// use accelerate_rs::quant::Quant4bitConfig;
/// use candle_core::{Device, Module, Tensor, Var};
///
/// # fn main() -> accelerate_rs::Result<()> {
/// let dev = Device::Cpu;
/// let fc = Linear::new(Tensor::randn(0f32, 0.1, (64, 128), &dev)?, None);
/// let q = Linear4bit::from_linear(&fc, &Quant4bitConfig::nf4())?;
/// let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 128), &dev)?)?;
/// let y = q.forward(&x)?;
/// // The same as the layer over the dequantized weight.
/// let reference = Linear::new(q.dequantized_weight()?, None).forward(&x)?;
/// assert!((y.clone() - reference)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-4);
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(&x).is_some()); // the input gets its gradient
/// assert!(q.nbytes() * 6 < 64 * 128 * 4); // and the weight about 4 bits (its scales and map too)
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Linear4bit {
    weight: Arc<Weight4bit>,
    bias: Option<Tensor>,
}

impl Linear4bit {
    /// A layer of the 4-bit `weight` (`[out, in]`) and an optional `bias` (`[out]`, a float
    /// dtype; frozen: detached here).
    pub fn new(weight: Weight4bit, bias: Option<Tensor>) -> crate::error::Result<Self> {
        let [out, _] = weight.shape() else {
            return Err(Error::invalid(
                "4-bit linear weight",
                format!("shape {:?}: [out, in] expected", weight.shape()),
            ));
        };
        if let Some(b) = &bias {
            if b.dims() != [*out] || !b.dtype().is_float() {
                return Err(Error::invalid(
                    "4-bit linear bias",
                    format!(
                        "{:?} {:?}: [{out}] of a float dtype expected",
                        b.dims(),
                        b.dtype()
                    ),
                ));
            }
        }
        Ok(Linear4bit {
            weight: Arc::new(weight),
            bias: bias.map(|b| b.detach()),
        })
    }

    /// `linear` with its weight quantized by `config` (its bias kept as it is, frozen).
    pub fn from_linear(linear: &Linear, config: &Quant4bitConfig) -> crate::error::Result<Self> {
        let weight = Weight4bit::quantize(linear.weight(), config)?;
        Self::new(weight, linear.bias().cloned())
    }

    /// The 4-bit weight.
    pub fn weight(&self) -> &Weight4bit {
        &self.weight
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `(out, in)`: the output and input widths.
    pub fn dims(&self) -> (usize, usize) {
        match self.weight.shape() {
            [n, k] => (*n, *k),
            _ => (0, 0),
        }
    }

    /// The weight dequantized, `[out, in]` in its dtype on the CPU (what merging an adapter
    /// into the base starts from).
    pub fn dequantized_weight(&self) -> crate::error::Result<Tensor> {
        self.weight.dequantize()
    }

    /// Bytes of memory the layer holds (the 4-bit weight and the bias).
    pub fn nbytes(&self) -> usize {
        let bias = self
            .bias
            .as_ref()
            .map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes());
        self.weight.nbytes() + bias
    }

    /// `x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ`: this frozen layer with the LoRA adapter `lora`
    /// (QLoRA), dropout only if `train`. On the CPU, with the adapter in the input's dtype and
    /// no dropout drawn, one fused op (the base's tiles and the adapter's two products; the
    /// output the only tensor of its size); with another adapter dtype, the fused base and
    /// [`Lora::add_to`]; elsewhere, [`Lora::forward_with_base`] over the dequantized weight.
    pub fn forward_with_lora(&self, x: &Tensor, lora: &Lora, train: bool) -> Result<Tensor> {
        let dropping = train && lora.dropout() > 0.0;
        if !self.fusable(x) {
            let (w, b) = self.dense(x)?;
            return lora.forward_with_base(x, &w, b.as_ref(), train);
        }
        let (a, b) = (lora.a(), lora.b());
        let (n, k) = self.dims();
        let adapter_fits = a.dtype() == x.dtype()
            && b.dtype() == x.dtype()
            && a.device().is_cpu()
            && b.device().is_cpu()
            && a.dims2()
                .is_ok_and(|(r, ka)| ka == k && r > 0 && b.dims2().is_ok_and(|d| d == (n, r)));
        if dropping || !adapter_fits {
            return lora.add_to(&self.forward(x)?, x, train);
        }
        let op = Lora4bitOp {
            base: self.op(x.dtype())?,
            scaling: lora.scaling(),
        };
        x.contiguous()?.apply_op3(a, b, op)
    }

    /// Whether the fused op takes `x`: on the CPU, f32/bf16/f16, `[.., in]`, not empty.
    fn fusable(&self, x: &Tensor) -> bool {
        let (n, k) = self.dims();
        x.device().is_cpu()
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
            && x.dims().last() == Some(&k)
            && x.elem_count() > 0
            && n > 0
            && self.bias.as_ref().is_none_or(|b| b.device().is_cpu())
    }

    /// The fused op for inputs of `dtype` (the bias in f32).
    fn op(&self, dtype: DType) -> Result<Linear4bitOp> {
        let bias = match &self.bias {
            Some(b) => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Linear4bitOp {
            weight: self.weight.clone(),
            bias: bias.map(Arc::new),
            dtype,
            tile_elems: TILE_ELEMS,
        })
    }

    /// The weight dequantized in `x`'s dtype on `x`'s device, and the bias likewise.
    fn dense(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let w = self
            .weight
            .dequantize()
            .map_err(candle_core::Error::wrap)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        let b = match &self.bias {
            Some(b) => Some(b.to_dtype(x.dtype())?.to_device(x.device())?),
            None => None,
        };
        Ok((w, b))
    }
}

impl Module for Linear4bit {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.fusable(x) {
            return x.contiguous()?.apply_op1(self.op(x.dtype())?);
        }
        let (w, b) = self.dense(x)?;
        Linear::new(w, b).forward(x)
    }
}

/// `y = x Wᵀ + b` for a contiguous `x` (`[.., k]`) of `dtype`, `W` 4-bit `[n, k]`.
#[derive(Clone)]
struct Linear4bitOp {
    weight: Arc<Weight4bit>,
    /// The bias in f32.
    bias: Option<Arc<Vec<f32>>>,
    /// The inputs' dtype: the weight's values are rounded to it after their own dtype.
    dtype: DType,
    /// Elements of the weight dequantized at a time.
    tile_elems: usize,
}

impl Linear4bitOp {
    /// `(n, k)`.
    fn dims(&self) -> (usize, usize) {
        match self.weight.shape() {
            [n, k] => (*n, *k),
            _ => (0, 0),
        }
    }

    /// Rows of `W` a tile holds.
    fn tile_rows(&self) -> usize {
        let (n, k) = self.dims();
        (self.tile_elems / k.max(1)).clamp(1, n.max(1))
    }

    /// Dequantizes the rows `n0..n0 + tile.len() / k` of `W` into `tile`: bitsandbytes'
    /// values in the weight's dtype, then in the inputs'.
    fn dequantize_rows(&self, n0: usize, tile: &mut [f32]) {
        let (_, k) = self.dims();
        let own = rounding(self.weight.dtype());
        let input = rounding(self.dtype);
        self.weight
            .dequantize_into(n0 * k, tile, move |v| input(own(v)));
    }

    /// `y = x Wᵀ + b` in f32: `x` `[rows, k]`, the result `[rows, n]`.
    fn forward_f32(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = self.dims();
        let mut y = match &self.bias {
            Some(b) => {
                let mut y = Vec::with_capacity(rows * n);
                for _ in 0..rows {
                    y.extend_from_slice(b);
                }
                y
            }
            None => vec![0f32; rows * n],
        };
        let tn = self.tile_rows();
        let mut tile = vec![0f32; tn * k];
        for n0 in (0..n).step_by(tn) {
            let t = tn.min(n - n0);
            let tile = &mut tile[..t * k];
            self.dequantize_rows(n0, tile);
            // y[:, n0..n0 + t] += x tileᵀ
            let dst = Dst {
                data: &mut y,
                offset: n0,
                row_stride: n,
            };
            product(dst, rows, t, k, (x, k, 1), (tile, 1, k));
        }
        y
    }

    /// `dx = g W` in f32: `g` `[rows, n]`, the result `[rows, k]`.
    fn input_grad_f32(&self, g: &[f32], rows: usize) -> Vec<f32> {
        let (n, k) = self.dims();
        let mut dx = vec![0f32; rows * k];
        let tn = self.tile_rows();
        let mut tile = vec![0f32; tn * k];
        for n0 in (0..n).step_by(tn) {
            let t = tn.min(n - n0);
            let tile = &mut tile[..t * k];
            self.dequantize_rows(n0, tile);
            // dx += g[:, n0..n0 + t] tile
            let dst = Dst {
                data: &mut dx,
                offset: 0,
                row_stride: k,
            };
            product(dst, rows, k, t, (&g[n0..], n, 1), (tile, k, 1));
        }
        dx
    }

    /// The forward pass on a CPU storage: `[.., k]` in, `[.., n]` out, in the storage's dtype.
    fn cpu_forward(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = self.dims();
        let rows = l.shape().elem_count() / k.max(1);
        let x = to_f32(s, l)?;
        let y = self.forward_f32(&x, rows);
        let mut dims = l.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = n;
        }
        Ok((from_f32(y, s.dtype())?, Shape::from(dims)))
    }

    /// The input gradient for the output gradient `grad`, shaped as `x`.
    fn input_grad(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let (n, _) = self.dims();
        let rows = grad.elem_count() / n.max(1);
        let g = grad.detach().contiguous()?.reshape((rows, n))?;
        let dx = g.apply_op1_no_bwd(&InputGrad(self.clone()))?;
        dx.reshape(x.shape())
    }
}

/// A strided f32 destination of [`product`]: `data[offset + i · row_stride + j]`.
struct Dst<'a> {
    data: &'a mut [f32],
    offset: usize,
    row_stride: usize,
}

/// `dst (m × n) += lhs (m × k) · rhs (k × n)` in f32, each operand `(data, row stride, column
/// stride)`, by `gemm` (Candle's CPU matrix product), on Candle's threads.
fn product(
    dst: Dst,
    m: usize,
    n: usize,
    k: usize,
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let span = |rs: usize, cs: usize, r: usize, c: usize| (r - 1) * rs + (c - 1) * cs + 1;
    // The checks that make the unsafe call below sound: every element read or written is inside
    // its slice.
    assert!(dst.offset + span(dst.row_stride, 1, m, n) <= dst.data.len());
    assert!(span(lhs.1, lhs.2, m, k) <= lhs.0.len());
    assert!(span(rhs.1, rhs.2, k, n) <= rhs.0.len());
    let threads = candle_core::utils::get_num_threads();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above bound every element `gemm` touches: `dst` at `offset + i ·
    // row_stride + j` (i < m, j < n), `lhs` at `i · rs + p · cs` (p < k), `rhs` at `p · rs + j ·
    // cs`, each inside its slice. `dst` is borrowed mutably, so it overlaps neither operand, and
    // no other code sees it until `gemm` returns.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr().add(dst.offset),
            1,
            dst.row_stride as isize,
            true,
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// The contiguous data of a float CPU storage in f32 (borrowed when it is f32).
fn to_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [f32]>> {
    Ok(match s {
        CpuStorage::F32(x) => Cow::Borrowed(slice(x, l)?),
        CpuStorage::BF16(x) => Cow::Owned(slice(x, l)?.iter().map(|v| v.to_f32()).collect()),
        CpuStorage::F16(x) => Cow::Owned(slice(x, l)?.iter().map(|v| v.to_f32()).collect()),
        _ => candle_core::bail!("accelerate-rs-linear4bit: f32, bf16 or f16 expected"),
    })
}

/// f32 values as a storage of `dtype` (rounded to nearest, ties to even).
fn from_f32(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        d => candle_core::bail!("accelerate-rs-linear4bit: {d:?}: f32, bf16 or f16 expected"),
    })
}

impl CustomOp1 for Linear4bitOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear4bit"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu_forward(s, l)
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.input_grad(x, grad)?))
    }
}

/// `dx = g W` as an op without a backward pass, on the contiguous `[rows, n]` gradient `g`.
struct InputGrad(Linear4bitOp);

impl CustomOp1 for InputGrad {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear4bit-input-grad"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = self.0.dims();
        let rows = l.shape().elem_count() / n.max(1);
        let g = to_f32(s, l)?;
        let dx = self.0.input_grad_f32(&g, rows);
        Ok((from_f32(dx, s.dtype())?, Shape::from((rows, k))))
    }
}

/// `x Wᵀ + b + s (x Aᵀ) Bᵀ` over the inputs `(x, A, B)`, `W` 4-bit (held by the op with `b`,
/// frozen).
struct Lora4bitOp {
    base: Linear4bitOp,
    scaling: f64,
}

impl CustomOp3 for Lora4bitOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-lora4bit"
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
        let (n, k) = self.base.dims();
        let r = la.dims().first().copied().unwrap_or(0);
        let rows = lx.shape().elem_count() / k.max(1);
        let (mut y, shape) = self.base.cpu_forward(sx, lx)?;
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

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n, k) = self.base.dims();
        let (g, x2) = flat_grad_and_input(grad, x, n, k)?;
        let (update, da, db) = adapter_grads(x.track_op(), a, b, &g, &x2, self.scaling)?;
        let dx = match update {
            Some(u) => {
                let base = self.base.input_grad(&x2, &g)?;
                Some((base + u)?.reshape(x.shape())?)
            }
            None => None,
        };
        Ok((dx, da, db))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn tiles_agree_with_one_product() {
        // Several tiles (3 rows each, the last partial) against one tile of the whole weight.
        let dev = &Device::Cpu;
        let w = Tensor::randn(0f32, 0.1, (10, 70), dev).unwrap();
        let q = Weight4bit::quantize(&w, &Quant4bitConfig::nf4()).unwrap();
        let x: Vec<f32> = (0..5 * 70)
            .map(|i| ((i * 37) % 19) as f32 / 19.0 - 0.5)
            .collect();
        let g: Vec<f32> = (0..5 * 10)
            .map(|i| ((i * 13) % 7) as f32 / 7.0 - 0.5)
            .collect();
        let op = |tile_elems| Linear4bitOp {
            weight: Arc::new(q.clone()),
            bias: Some(Arc::new((0..10).map(|i| i as f32).collect())),
            dtype: DType::F32,
            tile_elems,
        };
        let (whole, tiled) = (op(usize::MAX / 2), op(3 * 70));
        assert_eq!(tiled.tile_rows(), 3);
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(p, q)| (p - q).abs() < 1e-5);
        assert!(close(&whole.forward_f32(&x, 5), &tiled.forward_f32(&x, 5)));
        assert!(close(
            &whole.input_grad_f32(&g, 5),
            &tiled.input_grad_f32(&g, 5)
        ));
        // And the product is the dequantized weight's.
        let dq = q.dequantize().unwrap().to_vec2::<f32>().unwrap();
        let y = tiled.forward_f32(&x, 5);
        for (i, row) in x.chunks(70).enumerate() {
            for (j, wrow) in dq.iter().enumerate() {
                let want: f32 = j as f32 + row.iter().zip(wrow).map(|(a, b)| a * b).sum::<f32>();
                assert!((y[i * 10 + j] - want).abs() < 1e-4, "{i} {j}");
            }
        }
    }
}
