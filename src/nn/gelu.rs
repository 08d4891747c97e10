//! GELU (tanh approximation, Candle's `Tensor::gelu`) with a fused forward and backward: Candle
//! differentiates it through a chain of composed ops (a `powf`, a `tanh`, several products),
//! about 15% of a Transformer LM training step on the CPU.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{
    binary_float, elementwise_pair, fused, saved_tensor, slice, tanh_f32, unary_float, Elem,
};

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
    out.par_chunks_mut(CHUNK)
        .inline_when_single()
        .for_each(|o| {
            for v in o {
                let x = v.f();
                let t = tanh_f32(K * (x + C * x * x * x));
                *v = T::of(0.5 * x * (1.0 + t));
            }
        });
    out
}

/// `(x, dy)` → `dy · gelu'(x)`.
struct GeluBwd;

fn bwd<T: Elem>(x: &[T], dy: &[T]) -> Vec<T> {
    let mut out = x.to_vec();
    out.par_chunks_mut(CHUNK)
        .inline_when_single()
        .zip(dy.par_chunks(CHUNK).inline_when_single())
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

elementwise_pair!(
    GeluFwd = "accelerate-rs-gelu" by fwd,
    GeluBwd = "accelerate-rs-gelu-backward" by bwd,
    saved = input,
    cuda = (GeluFwd, GeluBwd),
);
