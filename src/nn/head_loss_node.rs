//! A language model's bias-free output layer and its cross-entropy as one graph node off the CPU:
//! the product (cuBLAS on a GPU) and the cross-entropy kernels run in one custom op, which keeps
//! the logits for its backward pass and gives the input and weight gradients straight.
//!
//! Composed, the logits are a graph node: Candle's backward pass zero-fills a logits-sized
//! gradient and adds the cross-entropy's gradient into it, so the backward pass holds the logits,
//! their gradient, the zero-filled one and the sum at once (four `[tokens, vocabulary]` buffers,
//! 1 GiB at the 250M Llama's size in bf16). Here the gradient is made once from the kept logits,
//! which are freed with it: two buffers, and two logits-sized passes fewer. The forward pass is
//! written once, generic over Candle's storages, so the CPU runs it in tests.

use std::sync::{Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use super::linear::{LinearOp, Wanted};
use super::loss::LossOp;

/// `loss(x Wᵀ)` for `x` `[.., k]` and a bias-free head `w` `[n, k]` of `x`'s dtype, the loss
/// op given (its targets and options inside), as one differentiable node.
pub(super) fn head_loss_node(x: &Tensor, w: &Tensor, loss: LossOp) -> Result<Tensor> {
    let op = HeadLossNode {
        linear: LinearOp {
            n: w.dim(0)?,
            relu: false,
        },
        loss,
        logits: Mutex::new(None),
    };
    x.contiguous()?.apply_op2(&w.contiguous()?, op)
}

/// The op: the product, the loss, and the logits of the forward pass until the backward pass
/// takes them.
struct HeadLossNode {
    linear: LinearOp,
    loss: LossOp,
    logits: Mutex<Option<Tensor>>,
}

impl HeadLossNode {
    /// The forward pass on storages `s` of layouts `l`: the product, then `loss` (the device's
    /// cross-entropy). The logits are kept (`wrap` makes them a tensor) for the backward pass.
    fn forward<S: BackendStorage>(
        &self,
        s: [&S; 2],
        l: [&Layout; 2],
        loss: impl FnOnce(&S, &Layout) -> Result<(S, Shape)>,
        wrap: impl FnOnce(S) -> Storage,
    ) -> Result<(S, Shape)> {
        let k = l[0].dims().last().copied().unwrap_or(0);
        if l[1].dims() != [self.linear.n, k] {
            candle_core::bail!(
                "accelerate-rs-linear-cross-entropy: x {:?} and a head of {:?}: expected [.., k] \
                 and [{}, k]",
                l[0].dims(),
                l[1].dims(),
                self.linear.n
            );
        }
        let (z, shape) = self.linear.product(s[0], l[0], s[1], l[1])?;
        let out = loss(&z, &Layout::contiguous(shape.clone()))?;
        let z = Tensor::from_storage(wrap(z), shape, BackpropOp::none(), false);
        *self.logits.lock().unwrap_or_else(PoisonError::into_inner) = Some(z);
        Ok(out)
    }

    /// The kept logits (taken: freed with this backward pass), or the product again if a
    /// second backward pass through this node asks.
    fn logits(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let kept = self
            .logits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match kept {
            Some(z) => Ok(z),
            None => x.detach().apply_op2_no_bwd(&w.detach(), &self.linear),
        }
    }
}

impl CustomOp2 for HeadLossNode {
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
        let loss = |z: &CpuStorage, l: &Layout| self.loss.cpu_fwd(z, l);
        self.forward([s1, s2], [l1, l2], loss, Storage::Cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let loss = |z: &candle_core::CudaStorage, l: &Layout| self.loss.cuda_fwd(z, l);
        self.forward([s1, s2], [l1, l2], loss, Storage::Cuda)
    }

    /// The logits' gradient from the loss op's backward pass on the kept logits, then the
    /// product's gradients (`dx = dz W`, `dW = dzᵀ x`, the latter handed to `nn::backward`'s
    /// frame when it is open); only those of inputs that are part of the graph.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let z = self.logits(x, w)?;
        let Some(dz) = self.loss.bwd(&z, res, grad)? else {
            return Ok((None, None));
        };
        drop(z);
        let n = self.linear.n;
        let dz = dz.reshape((dz.elem_count() / n.max(1), n))?;
        let (dx, dw, _) = self.linear.grads_of(&dz, x, w, Wanted::of(x, w, None))?;
        Ok((dx, dw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::elem::{assert_close, output_and_grads};
    use crate::nn::loss::CrossEntropy;
    use crate::nn::CrossEntropyOptions;
    use candle_core::{DType, Device, Var};

    /// The node with the CPU's cross-entropy against the composed product and loss: the loss
    /// and the gradients of `x` and the head.
    fn check(options: CrossEntropyOptions, dtype: DType, tol: f32) -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 5, 8), &dev)?.to_dtype(dtype)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 0.5, (11, 8), &dev)?.to_dtype(dtype)?)?;
        let t: Vec<i64> = (0..10).map(|i| (i * 7 % 11) as i64).collect();
        let targets = Tensor::new(t.as_slice(), &dev)?.reshape((2, 5))?;
        let run = |node: bool| -> Result<Vec<Tensor>> {
            let loss = if node {
                let op: LossOp = Box::new(CrossEntropy::new(t.clone(), options));
                head_loss_node(&x, &w, op)?
            } else {
                let z = x.broadcast_matmul(&w.t()?)?;
                crate::nn::cross_entropy_with(&z, &targets, options)?
            };
            output_and_grads(loss, &Tensor::new(3f32, &dev)?.to_dtype(dtype)?, &[&x, &w])
        };
        let (ours, want) = (run(true)?, run(false)?);
        assert_close(&ours, &want, tol, &format!("{dtype:?}"))
    }

    #[test]
    fn one_node_head_and_loss_equal_the_composed_ops_with_their_gradients() -> Result<()> {
        let smoothed = CrossEntropyOptions::default()
            .label_smoothing(0.1)
            .ignore_index(3);
        for options in [CrossEntropyOptions::default(), smoothed] {
            check(options, DType::F32, 1e-5)?;
            check(options, DType::F64, 1e-5)?;
        }
        Ok(())
    }

    #[test]
    fn a_second_backward_pass_makes_the_logits_again() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 6), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 6), &dev)?)?;
        let op: LossOp = Box::new(CrossEntropy::new(vec![0, 4, 2, 1], Default::default()));
        let loss = head_loss_node(&x, &w, op)?;
        let (first, second) = (loss.backward()?, loss.backward()?);
        for v in [&x, &w] {
            let (Some(a), Some(b)) = (first.get(v.as_tensor()), second.get(v.as_tensor())) else {
                candle_core::bail!("no gradient");
            };
            assert!(crate::nn::elem::max_diff(a, b) < 1e-6);
        }
        Ok(())
    }
}
