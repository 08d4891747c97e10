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
    // One read per device on a GPU (the per-device sums below); the CPU's are host memory.
    crate::readback::note();
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

/// Whether every registered parameter's gradient in `grads` is finite: per gradient `x * 0`
/// summed on its device (0, or NaN for any NaN or infinity, never an overflow), those sums added
/// and read back once. Contiguous CPU gradients (below f64) are read in place instead, without
/// the `x * 0` copy; that read is counted as the one read back, as on a GPU. With the trial
/// kernels on (`ACCELERATE_RS_CUDA_TRIAL=1`), gradients on one GPU set one device flag, one
/// kernel each, and the flag is the one read.
pub(crate) fn grads_finite(vars: &[Var], grads: &GradStore) -> Result<bool> {
    let present: Vec<&Tensor> = vars
        .iter()
        .filter_map(|v| grads.get(v.as_tensor()))
        .filter(|g| g.dtype().is_float())
        .collect();
    if let Some(finite) = crate::optim::all_finite_on_gpu(&present)? {
        return Ok(finite);
    }
    let mut sums = Vec::new();
    let mut read_in_place = false;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            if !g.dtype().is_float() {
                continue;
            }
            // In place for contiguous CPU gradients below f64: a sum of squares in f64 cannot
            // overflow for such values, so it is finite exactly when every value is.
            if g.dtype() != DType::F64 {
                if let Some(s) = crate::optim::sq_sum(g) {
                    read_in_place = true;
                    if !s.is_finite() {
                        crate::readback::note();
                        return Ok(false);
                    }
                    continue;
                }
            }
            sums.push(g.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F32)?);
        }
    }
    if sums.is_empty() {
        if read_in_place {
            crate::readback::note();
        }
        return Ok(true);
    }
    let devices_agree = sums
        .iter()
        .all(|s| s.device().same_device(sums[0].device()));
    let total = if devices_agree {
        crate::readback::counted(|| Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f32>())?
    } else {
        let mut t = 0f32;
        for s in &sums {
            t += s.to_scalar::<f32>()?;
        }
        t
    };
    Ok(total == 0.0)
}

/// `None` when every value of the float tensor `t` is finite; else what it holds (`"3 NaN and
/// 1 infinite values of 4096"`). One elementwise pass and one reduction on `t`'s device, and one
/// scalar read back; the counts are computed only for a tensor that fails. Integer tensors are
/// finite.
pub(crate) fn non_finite(t: &Tensor) -> Result<Option<String>> {
    if !t.dtype().is_float() {
        return Ok(None);
    }
    // x * 0 is 0 for a finite x and NaN for a NaN or an infinity.
    let zeros = t.affine(0.0, 0.0)?;
    let probe =
        crate::readback::counted(|| zeros.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>())?;
    if probe == 0.0 {
        return Ok(None);
    }
    let count = |m: Tensor| -> Result<u64> {
        Ok(m.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()? as u64)
    };
    let total = t.elem_count() as u64;
    let nan = count(t.ne(t)?)?;
    let finite = count(zeros.eq(&zeros.zeros_like()?)?)?;
    let infinite = total.saturating_sub(nan).saturating_sub(finite);
    Ok(Some(format!(
        "{nan} NaN and {infinite} infinite values of {total}"
    )))
}
