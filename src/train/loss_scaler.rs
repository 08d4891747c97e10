//! [`LossScaler`]: the dynamic loss scale of f16 training, used by
//! [`MixedPrecisionOptimizer`](crate::MixedPrecisionOptimizer) and by ZeRO stage 3's sharded
//! model (a leaf: both import it).

/// Dynamic loss scaling for f16 (like PyTorch's `GradScaler`).
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    clean_steps: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            clean_steps: 0,
        }
    }
}

impl LossScaler {
    /// A scaler starting at `initial_scale` (default 2^16), growth 2, backoff 0.5, interval 2000.
    pub fn new(initial_scale: f64) -> Self {
        LossScaler {
            scale: initial_scale,
            ..Default::default()
        }
    }

    /// Sets the number of clean steps in a row after which the scale grows (default 2000).
    pub fn with_growth_interval(mut self, steps: u64) -> Self {
        self.growth_interval = steps.max(1);
        self
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps in a row after which the scale is multiplied by the growth factor.
    pub fn growth_interval(&self) -> u64 {
        self.growth_interval
    }

    /// Clean steps in a row so far (the scale grows when this reaches the growth interval).
    pub fn clean_steps(&self) -> u64 {
        self.clean_steps
    }

    /// Puts a saved scale and clean-step count back (checkpoints).
    pub(crate) fn restore(&mut self, scale: f64, clean_steps: u64) {
        self.scale = scale;
        self.clean_steps = clean_steps;
    }

    pub(crate) fn update(&mut self, clean: bool) {
        if clean {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.clean_steps = 0;
            }
        } else {
            self.scale *= self.backoff_factor;
            self.clean_steps = 0;
        }
    }
}

/// The name of the saved loss scale in an optimizer's checkpointed state.
pub(crate) const SCALER_SCALE: &str = "loss_scaler.scale";
/// The name of the saved count of clean steps in a row.
pub(crate) const SCALER_CLEAN: &str = "loss_scaler.clean_steps";

/// Takes a checkpointed loss scale out of an optimizer's `state` (the tensors
/// [`SCALER_SCALE`] and [`SCALER_CLEAN`], scalars or one-element), leaving the rest for the
/// wrapped optimizer: `Some((scale, clean steps))` when one was saved. A scale that is not a
/// positive number is an error.
pub(crate) fn take_saved(
    state: &mut crate::optim::OptimizerState,
) -> crate::error::Result<Option<(f64, u64)>> {
    let mut take = |name: &str| -> crate::error::Result<Option<f64>> {
        let Some(i) = state.tensors.iter().position(|(n, _)| n == name) else {
            return Ok(None);
        };
        let t = state.tensors.remove(i).1;
        let v = t
            .flatten_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_vec1::<f64>()?;
        Ok(v.first().copied())
    };
    let (scale, clean) = (take(SCALER_SCALE)?, take(SCALER_CLEAN)?);
    let Some(scale) = scale else {
        return Ok(None);
    };
    if !(scale.is_finite() && scale > 0.0) {
        return Err(crate::error::Error::invalid(
            "loss scaler state",
            format!("the saved scale {scale} is not a positive number"),
        ));
    }
    Ok(Some((scale, clean.unwrap_or(0.0).max(0.0) as u64)))
}
