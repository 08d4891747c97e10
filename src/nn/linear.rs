//! A `Linear` layer as one differentiable op on the CPU: the matrix product, the bias and the
//! reshapes around them form a single graph node whose backward gives the input, weight and bias
//! gradients directly (the bias gradient in one pass of row sums). Composed, every intermediate
//! (the product, the bias sum, each reshape) gets its own zero-filled gradient that the next one
//! is added into, and Candle's broadcast-add backward reduces across rows with a strided loop.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Module, Result, Shape, Tensor, WithDType,
};
use candle_nn::VarBuilder;
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{fused_cpu, slice, Elem};
use super::product::{add_times_wt, matmul, times_wt};
use super::relu::ReluBwd;

/// Rows summed by one Rayon task in the bias gradient.
const ROWS_PER_TASK: usize = 64;

/// A fully connected layer, `y = x Wᵀ + b`: `candle_nn::Linear`'s constructor, accessors and
/// results, computed as one fused, differentiable op on the CPU (float dtypes) whose backward
/// sums the bias gradient's rows in one contiguous pass; on a GPU whose `nn` kernels are on, a
/// layer without bias is one node too (cuBLAS's product, the weight's gradient straight to the
/// backward pass); Candle's composed ops elsewhere. Inputs of any rank are flattened to rows for
/// one matrix product.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A layer of `weight` (`[out, in]`) and an optional `bias` (`[out]`).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Linear { weight, bias }
    }

    /// The weight, `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.apply(x, false)
    }
}

/// `relu(linear.forward(x))` as one op on the CPU (Apex's fused dense + ReLU): the ReLU is applied
/// in place on the product, and its backward masks the output gradient in the same op, so the
/// pre-activation never becomes a graph node (no gradient of its own to zero-fill and add into).
/// The same values and gradients as [`relu`](super::relu) after [`Linear`]; elsewhere than on the
/// CPU, those two ops.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{linear_relu, relu, Linear};
/// use candle_core::{Device, Module, Tensor};
/// let dev = Device::Cpu;
/// let fc = Linear::new(Tensor::randn(0f32, 1.0, (8, 4), &dev)?, None);
/// let x = Tensor::randn(0f32, 1.0, (3, 4), &dev)?;
/// let fused = linear_relu(&x, &fc)?;
/// let plain = relu(&fc.forward(&x)?)?;
/// assert!((fused - plain)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok(()) }
/// ```
pub fn linear_relu(x: &Tensor, linear: &Linear) -> Result<Tensor> {
    linear.apply(x, true)
}

impl Linear {
    /// `x Wᵀ + b`, then the ReLU if `relu`: one fused node when the CPU takes it.
    fn apply(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&k, lead)) = dims.split_last() else {
            candle_core::bail!("accelerate_rs::nn::Linear: a scalar input has no features");
        };
        let rows: usize = lead.iter().product();
        let n = self.weight.dim(0)?;
        if fusable(x, &self.weight, self.bias.as_ref(), rows, k)? {
            // One node: the product, the bias and both reshapes; its backward gives the input,
            // weight and bias gradients straight (no intermediate gradients to accumulate).
            let x = x.contiguous()?;
            let op = LinearOp { n, relu };
            return match &self.bias {
                Some(b) => x.apply_op3(&self.weight, b, op),
                None => x.apply_op2(&self.weight, op),
            };
        }
        if self.bias.is_none() && !relu && device_node(x, &self.weight, rows, k)? {
            // On a GPU with `nn`'s kernels: the product as one node too (cuBLAS), so the
            // weight's gradient is one `gᵀ x` handed to the backward pass's frame, with no
            // transposed, zero-filled copy to add it into, and no reshape nodes around it.
            let op = LinearOp { n, relu: false };
            return x.contiguous()?.apply_op2(&self.weight, op);
        }
        // One [rows, in] x [in, out] product (a copy first if the input is strided).
        let x2 = x.contiguous()?.reshape((rows, k))?;
        let y = x2.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        let mut out = lead.to_vec();
        out.push(y.dim(1)?);
        let y = y.reshape(out)?;
        if relu {
            super::relu(&y)
        } else {
            Ok(y)
        }
    }
}

/// A [`Linear`] with weight and bias from `vb` (`"weight"` `[out, in]`, `"bias"` `[out]`),
/// initialized as `candle_nn::linear` does.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), l.bias().cloned()))
}

/// A [`Linear`] without bias, initialized as `candle_nn::linear_no_bias` does.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let l = candle_nn::linear_no_bias(in_dim, out_dim, vb)?;
    Ok(Linear::new(l.weight().clone(), None))
}

/// Whether the fused op takes `x` (`[.., k]`, `rows` rows), `w` and `b`: all on the CPU, in one
/// float dtype, of matching shapes (anything else goes the composed way, with Candle's errors).
pub(super) fn fusable(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    rows: usize,
    k: usize,
) -> Result<bool> {
    let Some(n) = fits(x, w, rows, k) else {
        return Ok(false);
    };
    let bias_ok = b.is_none_or(|b| {
        b.device().is_cpu() && b.dtype() == x.dtype() && b.dims() == [n] && b.is_contiguous()
    });
    Ok(fused_cpu(x) && w.device().is_cpu() && bias_ok)
}

/// Whether the product `x Wᵀ` (no bias, no ReLU) runs as one [`LinearOp`] node off the CPU: on
/// a device whose `nn` kernels are on (a GPU), with [`fits`]'s operands. On the CPU too under
/// the test switch `set_device_nodes_on_cpu` (the GPU's graph with the CPU's kernels).
pub(super) fn device_node(x: &Tensor, w: &Tensor, rows: usize, k: usize) -> Result<bool> {
    Ok(
        (!x.device().is_cpu() || super::kernels::device_nodes_on_cpu())
            && fits(x, w, rows, k).is_some()
            && w.device().same_device(x.device())
            && super::elem::fused(x)?,
    )
}

/// `n` when `w` is a contiguous `[n, k]` in `x`'s dtype and the product has no empty side
/// (`rows`, `k`, `n` all nonzero): what both fused forms of the layer need of their operands.
fn fits(x: &Tensor, w: &Tensor, rows: usize, k: usize) -> Option<usize> {
    match w.dims() {
        [n, wk] if *wk == k && *n > 0 && k > 0 && rows > 0 => {
            (w.dtype() == x.dtype() && w.is_contiguous()).then_some(*n)
        }
        _ => None,
    }
}

/// `y = x Wᵀ (+ b)` over the rows of a contiguous `x` (`[.., k]`), `W` `[n, k]`: the device's
/// matrix product on the storages (on the CPU then the bias added in place, and the ReLU if
/// `relu`; on a GPU neither: [`device_node`]).
pub(super) struct LinearOp {
    pub(super) n: usize,
    pub(super) relu: bool,
}

impl LinearOp {
    /// `x Wᵀ (+ b)`, then the ReLU if this op has one. In f32 the product is written once into
    /// a fresh buffer, or accumulated straight onto the bias rows ([`product_f32`]); other
    /// dtypes take Candle's CPU matrix product, then one pass adding the bias (and applying the
    /// ReLU).
    pub(super) fn forward(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = lx.dims();
        let k = dims.last().copied().unwrap_or(1).max(1);
        let rows = lx.shape().elem_count() / k;
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = self.n;
        }
        if let (CpuStorage::F32(x), CpuStorage::F32(w)) = (sx, sw) {
            let (x, w) = (slice(x, lx)?, slice(w, lw)?);
            let y = match b {
                None => Some(times_wt(x, w, rows, self.n, k)?),
                Some((CpuStorage::F32(bias), lb)) => {
                    Some(product_f32(x, w, slice(bias, lb)?, rows, k)?)
                }
                Some(_) => None,
            };
            if let Some(y) = y {
                let mut y = CpuStorage::F32(y);
                add_bias(&mut y, None, self.relu)?;
                return Ok((y, Shape::from(out)));
            }
        }
        let (mut y, shape) = self.product(sx, lx, sw, lw)?;
        add_bias(&mut y, b, self.relu)?;
        Ok((y, shape))
    }

    /// `x Wᵀ` on any device's storages: the device's matrix product (Candle's) over the rows
    /// of a contiguous `x` (`[.., k]`), `W` `[n, k]`; the output has `x`'s leading dimensions.
    pub(super) fn product<S: BackendStorage>(
        &self,
        sx: &S,
        lx: &Layout,
        sw: &S,
        lw: &Layout,
    ) -> Result<(S, Shape)> {
        let dims = lx.dims();
        let k = dims.last().copied().unwrap_or(1).max(1);
        let rows = lx.shape().elem_count() / k;
        let mut out = dims.to_vec();
        if let Some(last) = out.last_mut() {
            *last = self.n;
        }
        let lx2 = Layout::contiguous_with_offset((rows, k), lx.start_offset());
        let y = sx.matmul(sw, (1, rows, self.n, k), &lx2, &lw.transpose(0, 1)?)?;
        Ok((y, Shape::from(out)))
    }

    /// `(dx, dw, db)` from the output `res` and its gradient (masked where the ReLU, if any,
    /// gave 0); each only for an input that needs one (see [`Wanted`]).
    fn grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<Grads> {
        let rows = x.elem_count() / w.dim(1)?;
        let grad = grad.contiguous()?;
        let grad = if self.relu {
            res.contiguous()?.apply_op2_no_bwd(&grad, &ReluBwd)?
        } else {
            grad
        };
        self.grads_of(&grad.reshape((rows, self.n))?, x, w, Wanted::of(x, w, b))
    }

    /// `(dx, dw, db)` from the output gradient `g` as `[rows, n]` (contiguous), those `want`
    /// asks for.
    pub(super) fn grads_of(
        &self,
        g: &Tensor,
        x: &Tensor,
        w: &Tensor,
        want: Wanted,
    ) -> Result<Grads> {
        let k = w.dim(1)?;
        let rows = x.elem_count() / k;
        // Detached operands: the gradients record no ops, so they do not keep the layer's input
        // (an activation) and weight alive while they are held.
        let w0 = w;
        let (x, w) = (&x.detach(), &w.detach());
        let dx = match want.x {
            true => Some(matmul(g, false, w)?.reshape(x.shape())?),
            false => None,
        };
        // A variable's gradient goes to the backward pass's frame when one is open (no
        // zero-filled copy in Candle's store to add it into).
        let dw = match want.w {
            true => super::grad_frames::deposit(w0, matmul(g, true, &x.reshape((rows, k))?)?)?,
            false => None,
        };
        let db = match want.b {
            true => Some(g.apply_op1_no_bwd(&ColumnSums { cols: self.n })?),
            false => None,
        };
        Ok((dx, dw, db))
    }
}

/// The input, weight and bias gradients of a linear op, each computed only when wanted.
pub(super) type Grads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

/// Which gradients a linear op's backward computes: those of the inputs that are part of the
/// graph. A frozen weight (a detached tensor, such as the base layer under a LoRA adapter, or
/// any constant) gets no weight gradient: no `[out, in]` product is computed for it, and none
/// lands in the gradient store.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wanted {
    pub(super) x: bool,
    pub(super) w: bool,
    pub(super) b: bool,
}

impl Wanted {
    /// The gradients `x`, `w` and `b` need (`Tensor::track_op`: a variable or a result of one).
    pub(super) fn of(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Self {
        Wanted {
            x: x.track_op(),
            w: w.track_op(),
            b: b.is_some_and(Tensor::track_op),
        }
    }
}

/// `x Wᵀ + b` in f32 for a contiguous `x` (`[rows, k]`) and `W` (`[n, k]`, `n = b.len()`): the
/// output starts as `rows` copies of `b` and `gemm` adds the product onto it, so the output is
/// written once before the product instead of being zero-filled and then read again for the
/// bias (the bias is added before the last of `gemm`'s depth blocks rather than after it: the
/// same value up to rounding).
fn product_f32(x: &[f32], w: &[f32], b: &[f32], rows: usize, k: usize) -> Result<Vec<f32>> {
    let n = b.len();
    if x.len() != rows * k || w.len() != n * k {
        candle_core::bail!(
            "accelerate-rs-linear: {} input and {} weight elements for {rows} x {k} by {n} x {k}",
            x.len(),
            w.len()
        );
    }
    let mut y = Vec::with_capacity(rows * n);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    add_times_wt(&mut y, x, w, rows, n, k)?;
    Ok(y)
}

/// `y += b` on every row of `y` (`[rows, b.len()]`), in place; then `max(y, 0)` if `relu`.
fn add_bias(y: &mut CpuStorage, b: Option<(&CpuStorage, &Layout)>, relu: bool) -> Result<()> {
    if b.is_none() && !relu {
        return Ok(());
    }
    fn typed<T: Elem + WithDType>(
        y: &mut [T],
        b: Option<(&CpuStorage, &Layout)>,
        relu: bool,
    ) -> Result<()> {
        let b = match b {
            Some((s, l)) => Some(slice(s.as_slice::<T>()?, l)?),
            None => None,
        };
        add_rows(y, b, relu);
        Ok(())
    }
    match y {
        CpuStorage::F32(y) => typed(y, b, relu),
        CpuStorage::F64(y) => typed(y, b, relu),
        CpuStorage::BF16(y) => typed(y, b, relu),
        CpuStorage::F16(y) => typed(y, b, relu),
        _ => candle_core::bail!("accelerate-rs-linear: a float dtype is expected"),
    }
}

/// `y += b` row by row (if there is a bias), then the ReLU if `relu` (NaN stays NaN, as in
/// [`relu`](super::relu)).
fn add_rows<T: Elem>(y: &mut [T], b: Option<&[T]>, relu: bool) {
    let d = b.map_or(1, <[T]>::len).max(1);
    let act = |v: f32| T::of(if relu && v <= 0.0 { 0.0 } else { v });
    y.par_chunks_mut(d.max(64) * ROWS_PER_TASK)
        .inline_when_single()
        .for_each(|rows| match b {
            Some(b) => {
                for row in rows.chunks_mut(d) {
                    for (o, bias) in row.iter_mut().zip(b) {
                        *o = act(o.f() + bias.f());
                    }
                }
            }
            None => {
                for o in rows.iter_mut() {
                    *o = act(o.f());
                }
            }
        });
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward(s1, l1, s2, l2, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if self.relu {
            candle_core::bail!("accelerate-rs-linear: the ReLU is fused on the CPU only");
        }
        self.product(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, None, res, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear"
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
        self.forward(s1, l1, s2, l2, Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.grads(x, w, Some(b), res, grad)
    }
}

/// The sums of a contiguous `[rows, cols]` tensor's columns, `[cols]` (f32 accumulation; f64
/// for f64), rows added one after another so every read is contiguous.
struct ColumnSums {
    cols: usize,
}

fn column_sums<T: Elem>(g: &[T], d: usize) -> Vec<T> {
    let d = d.max(1);
    let sums = g
        .par_chunks(d * ROWS_PER_TASK)
        .inline_when_single()
        .map(|rows| {
            let mut acc = vec![0f32; d];
            for row in rows.chunks(d) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v.f();
                }
            }
            acc
        })
        .reduce(
            || vec![0f32; d],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        );
    sums.into_iter().map(T::of).collect()
}

fn column_sums_f64(g: &[f64], d: usize) -> Vec<f64> {
    let d = d.max(1);
    g.par_chunks(d * ROWS_PER_TASK)
        .inline_when_single()
        .map(|rows| {
            let mut acc = vec![0f64; d];
            for row in rows.chunks(d) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
            acc
        })
        .reduce(
            || vec![0f64; d],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(&b) {
                    *x += y;
                }
                a
            },
        )
}

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "accelerate-rs-column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.cols;
        let out = match s {
            CpuStorage::F32(g) => CpuStorage::F32(column_sums(slice(g, l)?, d)),
            CpuStorage::F64(g) => CpuStorage::F64(column_sums_f64(slice(g, l)?, d)),
            CpuStorage::BF16(g) => CpuStorage::BF16(column_sums(slice(g, l)?, d)),
            CpuStorage::F16(g) => CpuStorage::F16(column_sums(slice(g, l)?, d)),
            _ => candle_core::bail!("{}: a float dtype expected", self.name()),
        };
        Ok((out, Shape::from(d)))
    }
}
