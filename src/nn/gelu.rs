//! GELU (tanh approximation, Candle's `Tensor::gelu`) with a fused forward and backward: Candle
//! differentiates it through a chain of composed ops (a `powf`, a `tanh`, several products),
//! about 15% of a Transformer LM training step on the CPU.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::elem::{binary_float, fused, slice, tanh_f32, unary_float, Elem};

/// Elements per Rayon task.
const CHUNK: usize = 4096;
/// sqrt(2 / pi).
const K: f32 = 0.797_884_6;
/// The cubic term's coefficient.
const C: f32 = 0.044_715;

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³)))`, the same function
/// as Candle's `Tensor::gelu` (and PyTorch's `gelu(approximate="tanh")`). Fused and
/// differentiable on the CPU (f32, f64, bf16, f16, computed in f32); Candle's op elsewhere.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if !fused(x)? {
        return x.gelu();
    }
    x.contiguous()?.apply_op1(GeluFwd)
}

struct GeluFwd;

fn fwd<T: Elem>(x: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    out.par_chunks_mut(CHUNK).for_each(|o| {
        for v in o {
            let x = v.f();
            let t = tanh_f32(K * (x + C * x * x * x));
            *v = T::of(0.5 * x * (1.0 + t));
        }
    });
    out
}

impl CustomOp1 for GeluFwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-gelu"
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
        super::cuda::elementwise(super::cuda::Elementwise::GeluFwd, (s, l), None)
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluBwd)?))
    }
}

/// `(x, dy)` → `dy · gelu'(x)`.
struct GeluBwd;

fn bwd<T: Elem>(x: &[T], dy: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    out.par_chunks_mut(CHUNK)
        .zip(dy.par_chunks(CHUNK))
        .for_each(|(o, g)| {
            for (v, g) in o.iter_mut().zip(g) {
                let x = v.f();
                let t = tanh_f32(K * (x + C * x * x * x));
                let d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * C * x * x);
                *v = T::of(g.f() * d);
            }
        });
    out
}

impl CustomOp2 for GeluBwd {
    fn name(&self) -> &'static str {
        "accelerate-rs-gelu-backward"
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
        super::cuda::elementwise(super::cuda::Elementwise::GeluBwd, (s1, l1), Some((s2, l2)))
    }
}
