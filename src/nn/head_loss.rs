//! The output layer and the cross-entropy as one differentiable op (a language model's head over
//! a large vocabulary): the logits are made, scored and turned into their own gradient in one
//! buffer, without becoming a graph node — no zero-filled logits gradient to add into, no second
//! logits-sized buffer for the gradient, no reshape.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::linear::{fusable, Grads, Linear, LinearOp, Wanted};
use super::loss::{
    checked_targets, cross_entropy_with, grad_in_place, grad_in_place_exp, CrossEntropy,
};
use super::CrossEntropyOptions;

/// `cross_entropy_with(&head.forward(x)?, targets, options)` in one fused op on the CPU: the
/// same value and gradients (of `x`, the head's weight and its bias), with the logits kept only
/// between the forward and the backward pass and then overwritten by their gradient in place.
/// On a GPU with `nn`'s CUDA kernels on, a bias-free head is one graph node too (cuBLAS's
/// product and the cross-entropy kernels, the logits kept for the backward pass).
/// `x` is `[..., in]` (e.g. a language model's `[B, T, d_model]` hidden states), `targets` the
/// leading shape (`[B, T]`) or flattened. Elsewhere, the composed ops.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use accelerate_rs::nn::{cross_entropy, linear_cross_entropy, Linear};
/// use candle_core::{Device, Module, Tensor};
/// let dev = Device::Cpu;
/// let head = Linear::new(Tensor::randn(0f32, 0.1, (50, 16), &dev)?, None);
/// let x = Tensor::randn(0f32, 1.0, (2, 3, 16), &dev)?;
/// let targets = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &dev)?;
/// let fused = linear_cross_entropy(&x, &head, &targets, Default::default())?;
/// let plain = cross_entropy(&head.forward(&x)?, &targets)?;
/// assert!((fused.to_scalar::<f32>()? - plain.to_scalar::<f32>()?).abs() < 1e-5);
/// # Ok(()) }
/// ```
pub fn linear_cross_entropy(
    x: &Tensor,
    head: &Linear,
    targets: &Tensor,
    options: CrossEntropyOptions,
) -> Result<Tensor> {
    let (w, b) = (head.weight(), head.bias());
    let k = x.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count().checked_div(k).unwrap_or(0);
    let n = w.dim(0)?;
    let mut logits_dims = x.dims().to_vec();
    if let Some(last) = logits_dims.last_mut() {
        *last = n;
    }
    if b.is_none() && super::linear::device_node(x, w, rows, k)? {
        // On a GPU with `nn`'s kernels: one node (cuBLAS's product and the cross-entropy
        // kernels), so no logits-sized gradient is zero-filled and added into.
        let (t, _, _) = checked_targets(&logits_dims, targets, options)?;
        let loss = super::loss::loss_op(t, targets, options, x.device())?;
        return super::head_loss_node::head_loss_node(x, w, loss);
    }
    if !fusable(x, w, b, rows, k)? {
        return cross_entropy_with(&candle_core::Module::forward(head, x)?, targets, options);
    }
    let (t, _, _) = checked_targets(&logits_dims, targets, options)?;
    let op = HeadLoss {
        linear: LinearOp { n, relu: false },
        loss: CrossEntropy::new(t, options),
        logits: Mutex::new(None),
    };
    let x = x.contiguous()?;
    match b {
        Some(b) => x.apply_op3(w, b, op),
        None => x.apply_op2(w, op),
    }
}

/// The fused op: the product (and bias), the loss, and the logits kept for the backward pass.
struct HeadLoss {
    linear: LinearOp,
    loss: CrossEntropy,
    /// The logits (or, when the flag says so, each row's `exp(x - max)`, left by
    /// [`CrossEntropy::loss_in_place`]).
    logits: Mutex<Option<(CpuStorage, bool)>>,
}

impl HeadLoss {
    fn forward(&self, mut logits: CpuStorage, shape: &Shape) -> Result<(CpuStorage, Shape)> {
        let l = Layout::contiguous(shape);
        let (loss, exps) = self.loss.loss_in_place(&mut logits, &l, self.linear.n)?;
        *self.logits.lock().unwrap_or_else(|p| p.into_inner()) = Some((logits, exps));
        Ok((loss, Shape::from(())))
    }

    /// `(dx, dw, db)`: the logits' gradient made in place of the kept logits (recomputed, with
    /// the loss's forward pass, if a second backward pass finds them gone), then the product's
    /// gradients.
    fn grads(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>, grad: &Tensor) -> Result<Grads> {
        let n = self.linear.n;
        let k = w.dim(1)?;
        let rows = x.elem_count() / k;
        let kept = self.logits.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (mut z, exps) = match kept {
            Some(kept) => kept,
            None => {
                let z = match b {
                    Some(b) => x.apply_op3_no_bwd(w, b, &self.linear)?,
                    None => x.apply_op2_no_bwd(w, &self.linear)?,
                };
                let (s, l) = z.storage_and_layout();
                let mut s = match &*s {
                    Storage::Cpu(s) => s.clone(),
                    _ => candle_core::bail!(
                        "accelerate-rs-linear-cross-entropy: CPU logits are expected"
                    ),
                };
                // The forward pass again, so that the rows take the same form, with the same
                // bits, as the first time.
                let (_, exps) = self.loss.loss_in_place(&mut s, l, n)?;
                (s, exps)
            }
        };
        let op = self.loss.grad_op(grad)?;
        let lses = op.lses();
        match (&mut z, op.invs()) {
            (CpuStorage::F32(v), Some(invs)) if exps => grad_in_place_exp(v, n, &op, invs),
            (CpuStorage::F32(v), _) if exps => candle_core::bail!(
                "accelerate-rs-linear-cross-entropy: the forward pass's row sums are missing"
            ),
            (CpuStorage::F32(v), _) => grad_in_place(v, n, &op, lses),
            (CpuStorage::F64(v), _) => grad_in_place(v, n, &op, lses),
            (CpuStorage::BF16(v), _) => grad_in_place(v, n, &op, lses),
            (CpuStorage::F16(v), _) => grad_in_place(v, n, &op, lses),
            _ => {
                candle_core::bail!("accelerate-rs-linear-cross-entropy: a float dtype is expected")
            }
        }
        self.linear
            .grads_of(&storage_tensor(z, (rows, n), x)?, x, w, Wanted::of(x, w, b))
    }
}

/// A tensor on `like`'s device owning `s` (no copy).
fn storage_tensor(s: CpuStorage, shape: (usize, usize), like: &Tensor) -> Result<Tensor> {
    let dev = like.device();
    match s {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F64(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, dev),
        _ => candle_core::bail!("accelerate-rs-linear-cross-entropy: a float dtype is expected"),
    }
}

impl CustomOp2 for HeadLoss {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (z, shape) = self.linear.forward(s1, l1, s2, l2, None)?;
        self.forward(z, &shape)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.grads(x, w, None, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for HeadLoss {
    fn name(&self) -> &'static str {
        "accelerate-rs-linear-cross-entropy"
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
        let (z, shape) = self.linear.forward(s1, l1, s2, l2, Some((s3, l3)))?;
        self.forward(z, &shape)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.grads(x, w, Some(b), grad)
    }
}
