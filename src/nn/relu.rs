//! ReLU with a fused backward: Candle's backward of `relu` compares with a zeros tensor, converts
//! the mask's dtype and multiplies (three passes and two temporaries); here it is one pass.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::elem::{binary_float, fused, slice, unary_float, Elem};

/// Elements per Rayon task.
const CHUNK: usize = 8192;

/// `max(x, 0)`, the same function as Candle's `Tensor::relu`, differentiable with a one-pass
/// backward on the CPU (f32, f64, bf16, f16); Candle's op elsewhere. The gradient at 0 is 0, as
/// in PyTorch.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    if !fused(x)? {
        return x.relu();
    }
    x.contiguous()?.apply_op1(ReluFwd)
}

struct ReluFwd;

fn fwd<T: Elem>(x: &[T]) -> Vec<T> {
    x.par_iter()
        .with_min_len(CHUNK)
        .map(|v| {
            let x = v.f();
            // Not `max`: NaN stays NaN, as in Candle and PyTorch.
            if x > 0.0 || x.is_nan() {
                *v
            } else {
                T::of(0.0)
            }
        })
        .collect()
}

impl CustomOp1 for ReluFwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = unary_float!(self.name(), s, l, fwd);
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "nn-cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::elementwise(super::cuda::Elementwise::ReluFwd, (s, l), None)
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The output is positive exactly where the input is.
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &ReluBwd)?))
    }
}

/// `(y, dy)` → `dy` where `y > 0`, else 0.
pub(super) struct ReluBwd;

fn bwd<T: Elem>(y: &[T], dy: &[T]) -> Vec<T> {
    y.par_iter()
        .zip(dy)
        .with_min_len(CHUNK)
        .map(|(y, g)| if y.f() > 0.0 { *g } else { T::of(0.0) })
        .collect()
}

impl CustomOp2 for ReluBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-relu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = binary_float!(self.name(), s1, l1, s2, l2, bwd);
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "nn-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::elementwise(super::cuda::Elementwise::ReluBwd, (s1, l1), Some((s2, l2)))
    }
}
