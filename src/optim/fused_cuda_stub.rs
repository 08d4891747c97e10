//! Stand-in for `fused_cuda.rs` in builds without the `cuda` feature: the same API, never
//! applicable (there are no CUDA tensors in such a build), so the optimizers use their other
//! paths.

use candle_core::Tensor;

use super::fused::{AdamScalars, SgdScalars};
use crate::error::Result;

/// Always `Ok(false)`: built without CUDA.
pub(crate) fn adamw(
    _param: &Tensor,
    _m: &Tensor,
    _v: &Tensor,
    _grad: &Tensor,
    _s: AdamScalars,
) -> Result<bool> {
    Ok(false)
}

/// Always `Ok(false)`: built without CUDA.
pub(crate) fn sgd(
    _param: &Tensor,
    _buf: Option<&Tensor>,
    _grad: &Tensor,
    _s: SgdScalars,
) -> Result<bool> {
    Ok(false)
}

/// Number of fused CUDA kernels launched: always 0 in this build.
pub fn launches() -> u64 {
    0
}

/// Always `Ok(None)`: built without CUDA (the finiteness check takes its other paths).
pub(crate) fn all_finite(_grads: &[&Tensor]) -> Result<Option<bool>> {
    Ok(None)
}
