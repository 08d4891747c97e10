//! ReLU with a fused backward: Candle's backward of `relu` compares with a zeros tensor, converts
//! the mask's dtype and multiplies (three passes and two temporaries); here it is one pass.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::par::Inline;

use super::elem::{binary_float, elementwise_pair, fused, saved_tensor, slice, unary_float, Elem};

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
        .inline_when_single()
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

/// `(y, dy)` → `dy` where `y > 0`, else 0.
pub(super) struct ReluBwd;

fn bwd<T: Elem>(y: &[T], dy: &[T]) -> Vec<T> {
    y.par_iter()
        .inline_when_single()
        .zip(dy)
        .with_min_len(CHUNK)
        .map(|(y, g)| if y.f() > 0.0 { *g } else { T::of(0.0) })
        .collect()
}

elementwise_pair!(
    ReluFwd = "accelerate-rs-relu" by fwd,
    ReluBwd = "accelerate-rs-relu-backward" by bwd,
    saved = output,
    cuda = (ReluFwd, ReluBwd),
);
