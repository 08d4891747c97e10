//! Gradient arithmetic over the registered parameters: the global norm (one read-back), scaling,
//! clamping, and copies of the store. Clipping by norm and by value is built from these.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::error::Result;

/// The sum of squares of the registered parameters' gradients in `grads` (f64; read in
/// place for contiguous CPU gradients). Gradients on a GPU are summed there, per parameter
/// in f32 and over the parameters in f64, and read back once: one host synchronization per
/// call, not one per parameter.
pub(crate) fn grad_sq_sum(vars: &[Var], grads: &GradStore) -> Result<f64> {
    let mut sum = 0f64;
    // Per-parameter sums still on their device, grouped by device.
    let mut on_device: Vec<Vec<Tensor>> = Vec::new();
    for v in vars {
        let Some(g) = grads.get(v.as_tensor()) else {
            continue;
        };
        if let Some(s) = crate::optim::sq_sum(g) {
            sum += s;
            continue;
        }
        if g.device().is_cpu() {
            sum += g
                .to_dtype(DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?;
            continue;
        }
        let part = g.to_dtype(DType::F32)?.sqr()?.sum_all()?;
        match on_device
            .iter_mut()
            .find(|parts| parts[0].device().same_device(g.device()))
        {
            Some(parts) => parts.push(part),
            None => on_device.push(vec![part]),
        }
    }
    for parts in on_device {
        sum += Tensor::stack(&parts, 0)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    Ok(sum)
}

/// A new store holding the registered parameters' gradients of `grads` (shared tensors).
pub(crate) fn copy_grads(vars: &[Var], grads: &GradStore) -> GradStore {
    let mut out = GradStore::default();
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            out.insert(v.as_tensor(), g.clone());
        }
    }
    out
}

/// Multiplies every registered parameter's gradient by `factor` (keeping its dtype).
pub(crate) fn scale_grads(vars: &[Var], grads: &mut GradStore, factor: f64) -> Result<()> {
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let scaled = g.affine(factor, 0.0)?;
            grads.insert(v.as_tensor(), scaled);
        }
    }
    Ok(())
}

/// Clamps every registered parameter's gradient to `[-clip, clip]`.
pub(crate) fn clamp_grads(vars: &[Var], grads: &mut GradStore, clip: f64) -> Result<()> {
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            let clamped = g.clamp(-clip, clip)?;
            grads.insert(v.as_tensor(), clamped);
        }
    }
    Ok(())
}

/// The L2 norm of all registered parameters' gradients together (computed in f64).
pub(crate) fn grad_norm(vars: &[Var], grads: &GradStore) -> Result<f64> {
    Ok(grad_sq_sum(vars, grads)?.sqrt())
}
