//! AdamW with exposed state.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use super::fused::{self, AdamScalars};
use super::fused_cuda;
use super::slots::{SlotSpec, Slots};
use super::{candle_err, check_lr, OptimizerState, StateShard, StatefulOptimizer};
use crate::error::{Error, Result};

/// AdamW's state: the first and second moments of each parameter.
static SLOTS: SlotSpec<2> = SlotSpec {
    optimizer: "AdamW",
    kinds: ["m", "v"],
    complete: true,
};

/// AdamW (Loshchilov & Hutter): the same update and defaults as [`candle_nn::AdamW`]
/// ([`ParamsAdamW`]: lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01, bias correction),
/// with its state exposed for checkpoints ([`state`](Self::state),
/// [`load_state`](Self::load_state)).
///
/// Per parameter θ with gradient g, at step t (from 1):
/// `m = β1·m + (1−β1)·g`, `v = β2·v + (1−β2)·g²`,
/// `θ = θ·(1 − lr·λ) − lr · (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + ε)`.
/// Parameters without a gradient are left alone (their moments too); the step count advances on
/// every call, as in Candle. Non-float parameters are dropped at construction.
///
/// On the CPU (f32, f64, bf16, f16) each parameter is updated by one fused, in-place pass that
/// reads the gradient and writes the parameter and both moments where they are: no tensor is
/// allocated per step (several times faster than `candle_nn::AdamW`; see `benches/optimizer.rs`).
/// Elsewhere the update runs as a chain of tensor ops.
#[derive(Debug)]
pub struct AdamW {
    slots: Slots<2>,
    params: ParamsAdamW,
}

fn check_params(p: &ParamsAdamW) -> Result<()> {
    check_lr("AdamW lr", p.lr)?;
    for (name, beta) in [("AdamW beta1", p.beta1), ("AdamW beta2", p.beta2)] {
        if !(0.0..1.0).contains(&beta) {
            return Err(Error::invalid(
                name,
                format!("must be in [0, 1), got {beta}"),
            ));
        }
    }
    if !p.eps.is_finite() || p.eps < 0.0 {
        return Err(Error::invalid(
            "AdamW eps",
            format!("must be a finite number >= 0, got {}", p.eps),
        ));
    }
    if !p.weight_decay.is_finite() || p.weight_decay < 0.0 {
        return Err(Error::invalid(
            "AdamW weight_decay",
            format!("must be a finite number >= 0, got {}", p.weight_decay),
        ));
    }
    Ok(())
}

/// `beta^t`, exact as Candle's `powi` while `t` fits an `i32`.
fn pow(beta: f64, t: u64) -> f64 {
    match i32::try_from(t) {
        Ok(t) => beta.powi(t),
        Err(_) => beta.powf(t as f64),
    }
}

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        check_params(&params).map_err(candle_err)?;
        Ok(AdamW {
            slots: Slots::new(&SLOTS, vars).map_err(candle_err)?,
            params,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let fused_on = self.slots.fused();
        let (t, slots) = self.slots.begin_step();
        let ParamsAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let scale_m = 1.0 / (1.0 - pow(beta1, t));
        let scale_v = 1.0 / (1.0 - pow(beta2, t));
        // sqrt(v / (1 - β2ᵗ)) = sqrt(v) · sqrt(1 / (1 - β2ᵗ)): one fused affine instead of two ops.
        let sqrt_scale_v = scale_v.sqrt();
        let decay = 1.0 - lr * weight_decay;
        let scalars = AdamScalars {
            lr,
            beta1,
            beta2,
            eps,
            decay,
            scale_m,
            scale_v,
        };
        for slot in slots.iter_mut() {
            let Some(g) = grads.get(&slot.var) else {
                continue;
            };
            let (weight_decay, scalars) = if slot.decays {
                (weight_decay, scalars)
            } else {
                (
                    0.0,
                    AdamScalars {
                        decay: 1.0,
                        ..scalars
                    },
                )
            };
            let decay = scalars.decay;
            let g = &slot.grad_view(g)?;
            let theta = &slot.param_view()?;
            // Two allocations on the first gradient: the fused step writes both in place.
            let zeros = || Tensor::zeros(theta.shape(), theta.dtype(), theta.device());
            let [m, v] = &slot.state;
            let sm = match m {
                Some(m) => m.clone(),
                None => zeros()?,
            };
            let sv = match v {
                Some(v) => v.clone(),
                None => zeros()?,
            };
            if fused_on {
                if fused::fusable(theta, g) {
                    fused::adamw(theta, &sm, &sv, g, scalars).map_err(candle_err)?;
                    slot.state = [Some(sm), Some(sv)];
                    continue;
                }
                if fused_cuda::adamw(theta, &sm, &sv, g, scalars).map_err(candle_err)? {
                    slot.state = [Some(sm), Some(sv)];
                    continue;
                }
            }
            // Unfused (other dtypes and devices, or fusion turned off): a chain of tensor ops.
            let m = ((&sm * beta1)? + (g * (1.0 - beta1))?)?;
            let v = ((&sv * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let denom = v.sqrt()?.affine(sqrt_scale_v, eps)?;
            let update = m.div(&denom)?.affine(lr * scale_m, 0.0)?;
            let next = if weight_decay == 0.0 {
                theta.sub(&update)?
            } else {
                theta.affine(decay, 0.0)?.sub(&update)?
            };
            slot.write_param(&next)?;
            slot.state = [Some(m), Some(v)];
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }
}

impl AdamW {
    /// AdamW with Candle's defaults and learning rate `lr`.
    pub fn new_lr(vars: Vec<Var>, lr: f64) -> Result<Self> {
        let params = ParamsAdamW {
            lr,
            ..ParamsAdamW::default()
        };
        Ok(<Self as Optimizer>::new(vars, params)?)
    }

    /// Turns weight decay off for `vars` (PyTorch's parameter groups as GPT-2 and nanoGPT use
    /// them: decay on weight matrices and embeddings, none on biases and norm gains), keeping
    /// one optimizer, one learning rate and one state layout, so that it can be sharded (ZeRO)
    /// like any `AdamW`. Parameters not in the optimizer are ignored.
    ///
    /// ```
    /// # use accelerate_rs::optim::{AdamW, ParamsAdamW};
    /// # use candle_core::{Device, Var};
    /// # use candle_nn::Optimizer;
    /// # fn main() -> accelerate_rs::Result<()> {
    /// let w = Var::ones((4, 4), candle_core::DType::F32, &Device::Cpu)?;
    /// let b = Var::ones(4, candle_core::DType::F32, &Device::Cpu)?;
    /// let no_decay: Vec<Var> = [&w, &b].into_iter().filter(|v| v.rank() < 2).cloned().collect();
    /// let opt = AdamW::new(vec![w, b], ParamsAdamW { weight_decay: 0.1, ..Default::default() })?
    ///     .no_weight_decay_on(&no_decay);
    /// assert_eq!(opt.decaying(), vec![true, false]);
    /// # Ok(()) }
    /// ```
    pub fn no_weight_decay_on(mut self, vars: &[Var]) -> Self {
        self.slots.no_weight_decay_on(vars);
        self
    }

    /// Per parameter, in index order: whether weight decay applies to it.
    pub fn decaying(&self) -> Vec<bool> {
        self.slots.decaying()
    }

    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Replaces the hyper-parameters (checked as in `new`).
    pub fn set_params(&mut self, params: ParamsAdamW) -> Result<()> {
        check_params(&params)?;
        self.params = params;
        Ok(())
    }

    /// Whether steps use the fused in-place kernels where they apply (CPU; f32 on CUDA). On by
    /// default; `ACCELERATE_RS_FUSED_OPTIM=0` turns it off for optimizers created afterwards.
    pub fn fused(&self) -> bool {
        self.slots.fused()
    }

    /// Turns the fused kernels on or off (off: every step is the chain of tensor ops that
    /// `candle_nn::AdamW` runs; useful to compare or debug).
    pub fn set_fused(&mut self, on: bool) {
        self.slots.set_fused(on);
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.slots.step_count()
    }

    /// Whether this optimizer keeps only this rank's slice of the state (ZeRO stage 1 or 2).
    pub fn is_sharded(&self) -> bool {
        self.slots.is_sharded()
    }

    /// ZeRO: keeps the state of only `shards` (this rank's slices of the parameters), slicing
    /// the moments already there; the other parameters' slots are dropped.
    pub(crate) fn shard(&mut self, shards: &[super::Shard]) -> Result<()> {
        self.slots.shard(shards)
    }

    /// ZeRO-3: moves the optimizer onto the units' shards (see `Slots::rebase`).
    pub(crate) fn rebase(&mut self, params: &[super::ParamPieces]) -> Result<()> {
        self.slots.rebase(params)
    }

    /// ZeRO: this rank's slices of the moments (`None` unless sharded), for a checkpoint in
    /// which every rank writes its own file.
    pub fn state_shard(&self) -> Result<Option<StateShard>> {
        self.slots.state_shard(self.params.lr, true)
    }

    /// Bytes of optimizer state this rank holds (both moments).
    pub fn state_bytes(&self) -> usize {
        self.slots.state_bytes()
    }

    /// The parameters, in index order (the `i` of the state's tensor names).
    pub fn vars(&self) -> Vec<&Var> {
        self.slots.vars()
    }

    /// The state for a checkpoint: step count, learning rate and `"{i}.m"`, `"{i}.v"` for every
    /// parameter `i` (zeros before its first gradient). A snapshot: the moments are copied,
    /// since later steps write into them. Sharded (ZeRO), the same layout, holding this rank's
    /// slices and zeros elsewhere: summed over the ranks it is the whole state.
    pub fn state(&self) -> Result<OptimizerState> {
        self.slots.state(self.params.lr, true)
    }

    /// Restores a state taken with [`state`](Self::state) on an optimizer over parameters of the
    /// same shapes, in the same order. Sets the step count and the learning rate. Tensors are
    /// copied to the parameters' device and dtype. Errors, naming the offending tensor, on a
    /// missing, duplicate, unknown or misshapen tensor, or on a wrong count; on error nothing
    /// changes.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        self.slots.load_state(&state)?;
        self.params.lr = state.lr;
        Ok(())
    }
}

impl StatefulOptimizer for AdamW {
    fn optimizer_state(&self) -> Result<OptimizerState> {
        self.state()
    }
    fn optimizer_state_shard(&self) -> Result<Option<StateShard>> {
        self.state_shard()
    }
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.load_state(state)
    }
}
