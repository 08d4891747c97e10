//! SGD with momentum, Nesterov and weight decay, with exposed state.

use super::{StateShard, StatefulOptimizer};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;

use super::fused::{self, SgdScalars};
use super::fused_cuda;
use super::{
    candle_err, check_lr, fit_tensor, grad_view, param_view, parse_name, shard_ranges,
    sharded_state_err, write_param, OptimizerState,
};
use crate::error::{Error, Result};

/// [`Sgd`]'s hyper-parameters (PyTorch's `torch.optim.SGD`).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum (0 in most recipes).
    pub dampening: f64,
    /// L2 penalty added to the gradient (`g + weight_decay · θ`).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl SgdConfig {
    /// Plain SGD with learning rate `lr`: no momentum, no dampening, no weight decay.
    pub fn new(lr: f64) -> Self {
        SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Sets the momentum factor.
    pub fn momentum(mut self, momentum: f64) -> Self {
        self.momentum = momentum;
        self
    }

    /// Sets the dampening.
    pub fn dampening(mut self, dampening: f64) -> Self {
        self.dampening = dampening;
        self
    }

    /// Sets the weight decay.
    pub fn weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = weight_decay;
        self
    }

    /// Turns Nesterov momentum on or off.
    pub fn nesterov(mut self, nesterov: bool) -> Self {
        self.nesterov = nesterov;
        self
    }

    /// Checks the values, naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        check_lr("Sgd lr", self.lr)?;
        for (name, value) in [
            ("Sgd momentum", self.momentum),
            ("Sgd dampening", self.dampening),
            ("Sgd weight_decay", self.weight_decay),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(Error::invalid(
                    name,
                    format!("must be a finite number >= 0, got {value}"),
                ));
            }
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::invalid(
                "Sgd nesterov",
                format!(
                    "needs momentum > 0 and dampening == 0, got momentum {} and dampening {}",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }
}

impl From<f64> for SgdConfig {
    fn from(lr: f64) -> Self {
        SgdConfig::new(lr)
    }
}

/// One parameter and its momentum buffer (created on its first step with a gradient).
#[derive(Debug)]
struct Slot {
    var: Var,
    /// ZeRO: the elements of the flattened parameter this rank updates (`None`: all).
    range: Option<std::ops::Range<usize>>,
    momentum: Option<Tensor>,
    /// Whether weight decay applies to this parameter ([`Sgd::no_weight_decay_on`]).
    decays: bool,
}

/// Stochastic gradient descent with PyTorch's semantics, with its state exposed for checkpoints
/// ([`state`](Self::state), [`load_state`](Self::load_state)).
///
/// Per parameter θ with gradient g:
/// `d = g + wd·θ`; with momentum μ > 0, `buf = μ·buf + (1 − dampening)·d` (on the first step
/// `buf = d`) and `d = d + μ·buf` (Nesterov) or `d = buf`; then `θ = θ − lr·d`. With momentum 0
/// and weight decay 0 this is exactly [`candle_nn::SGD`]. Parameters without a gradient are left
/// alone (their buffers too). Non-float parameters are dropped at construction.
///
/// On the CPU (f32, f64, bf16, f16) each parameter is updated by one fused, in-place pass over
/// parameter, gradient and momentum buffer, allocating nothing per step; elsewhere the update
/// runs as a chain of tensor ops.
#[derive(Debug)]
pub struct Sgd {
    slots: Vec<Slot>,
    step_t: u64,
    config: SgdConfig,
    fused: bool,
    /// ZeRO: every parameter before the optimizer was cut down to this rank's slices.
    origin: Vec<Var>,
}

impl Optimizer for Sgd {
    type Config = SgdConfig;

    fn new(vars: Vec<Var>, config: SgdConfig) -> candle_core::Result<Self> {
        config.validate().map_err(candle_err)?;
        let slots = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| Slot {
                var,
                range: None,
                momentum: None,
                decays: true,
            })
            .collect();
        Ok(Sgd {
            slots,
            step_t: 0,
            config,
            fused: fused::default_on()?,
            origin: Vec::new(),
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } = self.config;
        for slot in self.slots.iter_mut() {
            let Some(g) = grads.get(&slot.var) else {
                continue;
            };
            let weight_decay = if slot.decays { weight_decay } else { 0.0 };
            let g = &grad_view(g, &slot.range)?;
            let theta = &param_view(&slot.var, &slot.range)?;
            if self.fused {
                let first = momentum != 0.0 && slot.momentum.is_none();
                if first {
                    slot.momentum =
                        Some(Tensor::zeros(theta.shape(), theta.dtype(), theta.device())?);
                }
                let scalars = SgdScalars {
                    lr,
                    momentum,
                    dampening,
                    weight_decay,
                    nesterov,
                    first,
                };
                let buf = if momentum == 0.0 {
                    None
                } else {
                    slot.momentum.as_ref()
                };
                let done = if fused::fusable(theta, g) {
                    fused::sgd(theta, buf, g, scalars).map_err(candle_err)?;
                    true
                } else {
                    fused_cuda::sgd(theta, buf, g, scalars).map_err(candle_err)?
                };
                if done {
                    continue;
                }
                if first {
                    // Not fused after all: the chain below creates the buffer itself.
                    slot.momentum = None;
                }
            }
            // Unfused (other dtypes and devices, or fusion turned off): a chain of tensor ops.
            let d = if weight_decay == 0.0 {
                g.clone()
            } else {
                theta.affine(weight_decay, 0.0)?.add(g)?
            };
            let d = if momentum == 0.0 {
                d
            } else {
                let buf = match &slot.momentum {
                    None => d.clone(),
                    Some(buf) => (buf * momentum)?.add(&(&d * (1.0 - dampening))?)?,
                };
                let d = if nesterov {
                    d.add(&(&buf * momentum)?)?
                } else {
                    buf.clone()
                };
                slot.momentum = Some(buf);
                d
            };
            // The same two ops as `candle_nn::SGD`, so plain SGD matches it bit for bit.
            write_param(&slot.var, &slot.range, &theta.sub(&(d * lr)?)?)?;
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr
    }
}

impl Sgd {
    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// Replaces the hyper-parameters (checked as in `new`).
    pub fn set_config(&mut self, config: SgdConfig) -> Result<()> {
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// Whether steps use the fused in-place kernels where they apply (CPU; f32 on CUDA). On by
    /// default; `ACCELERATE_RS_FUSED_OPTIM=0` turns it off for optimizers created afterwards.
    pub fn fused(&self) -> bool {
        self.fused
    }

    /// Turns the fused kernels on or off (off: every step is a chain of tensor ops, as in
    /// Candle; useful to compare or debug).
    pub fn set_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// Turns weight decay off for `vars` (parameter groups: see
    /// [`AdamW::no_weight_decay_on`](super::AdamW::no_weight_decay_on)). Parameters not in the
    /// optimizer are ignored.
    pub fn no_weight_decay_on(mut self, vars: &[Var]) -> Self {
        for slot in &mut self.slots {
            if vars.iter().any(|v| v.id() == slot.var.id()) {
                slot.decays = false;
            }
        }
        self
    }

    /// Per parameter, in index order: whether weight decay applies to it.
    pub fn decaying(&self) -> Vec<bool> {
        self.slots.iter().map(|s| s.decays).collect()
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step_t
    }

    /// Whether this optimizer keeps only this rank's slice of the state (ZeRO stage 1 or 2).
    pub fn is_sharded(&self) -> bool {
        self.slots.iter().any(|s| s.range.is_some())
    }

    /// ZeRO: keeps the state of only `shards` (this rank's slices of the parameters), slicing
    /// the momentum buffers already there; the other parameters' slots are dropped.
    pub(crate) fn shard(&mut self, shards: &[crate::train::params::Shard]) -> Result<()> {
        if self.is_sharded() {
            return Ok(());
        }
        self.origin = self.slots.iter().map(|s| s.var.clone()).collect();
        let mut slots = Vec::new();
        for slot in self.slots.drain(..) {
            for r in shard_ranges(&slot.var, shards) {
                let momentum = match &slot.momentum {
                    Some(m) => Some(m.flatten_all()?.narrow(0, r.start, r.len())?.copy()?),
                    None => None,
                };
                slots.push(Slot {
                    var: slot.var.clone(),
                    range: Some(r),
                    momentum,
                    decays: slot.decays,
                });
            }
        }
        self.slots = slots;
        Ok(())
    }

    /// ZeRO: the state in the unsharded layout, this rank's slices and zeros elsewhere (see
    /// `AdamW`'s); with momentum, a `"{i}.momentum"` for every parameter.
    fn sharded_state(&self) -> Result<OptimizerState> {
        let mut tensors = Vec::new();
        if self.config.momentum != 0.0 {
            for (i, var) in self.origin.iter().enumerate() {
                let mut full = Tensor::zeros(var.elem_count(), var.dtype(), var.device())?;
                for s in self.slots.iter().filter(|s| s.var.id() == var.id()) {
                    if let (Some(r), Some(m)) = (&s.range, &s.momentum) {
                        full = full.slice_assign(std::slice::from_ref(r), &m.flatten_all()?)?;
                    }
                }
                tensors.push((format!("{i}.momentum"), full.reshape(var.shape())?));
            }
        }
        Ok(OptimizerState {
            step: self.step_t,
            lr: self.config.lr,
            tensors,
        })
    }

    /// ZeRO: this rank's slices of the momentum buffers (`None` unless sharded), for a
    /// checkpoint in which every rank writes its own file.
    pub fn state_shard(&self) -> Result<Option<super::StateShard>> {
        if !self.is_sharded() {
            return Ok(None);
        }
        let kinds: &[&str] = if self.config.momentum != 0.0 {
            &["momentum"]
        } else {
            &[]
        };
        let slots = self
            .slots
            .iter()
            .map(|s| (&s.var, &s.range, vec![&s.momentum]));
        super::state_shard(self.step_t, self.config.lr, &self.origin, kinds, slots).map(Some)
    }

    /// Bytes of optimizer state this rank holds (the momentum buffers).
    pub fn state_bytes(&self) -> usize {
        self.slots
            .iter()
            .filter_map(|s| s.momentum.as_ref())
            .map(|m| m.elem_count() * m.dtype().size_in_bytes())
            .sum()
    }

    /// The parameters, in index order (the `i` of the state's tensor names).
    pub fn vars(&self) -> Vec<&Var> {
        self.slots.iter().map(|s| &s.var).collect()
    }

    /// The state for a checkpoint: step count, learning rate and `"{i}.momentum"` for every
    /// parameter `i` that has a momentum buffer (none without momentum, and none for a parameter
    /// that never had a gradient). A snapshot: the buffers are copied, since later steps write
    /// into them.
    pub fn state(&self) -> Result<OptimizerState> {
        if self.is_sharded() {
            return self.sharded_state();
        }
        let mut tensors = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(m) = &s.momentum {
                tensors.push((format!("{i}.momentum"), m.copy()?));
            }
        }
        Ok(OptimizerState {
            step: self.step_t,
            lr: self.config.lr,
            tensors,
        })
    }

    /// Restores a state taken with [`state`](Self::state) on an optimizer over parameters of the
    /// same shapes, in the same order. Sets the step count and the learning rate; parameters
    /// without a `"{i}.momentum"` tensor get no buffer (as before their first step). Errors,
    /// naming the offending tensor, on a duplicate, unknown or misshapen tensor, or on more
    /// tensors than parameters; on error nothing changes.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        if self.is_sharded() {
            return Err(sharded_state_err("Sgd"));
        }
        check_lr("Sgd state lr", state.lr)?;
        let n = self.slots.len();
        if state.tensors.len() > n {
            return Err(Error::invalid(
                "Sgd state",
                format!(
                    "has {} tensors, but this optimizer has only {n} parameters",
                    state.tensors.len()
                ),
            ));
        }
        if self.config.momentum == 0.0 && !state.tensors.is_empty() {
            return Err(Error::invalid(
                "Sgd state",
                format!(
                    "has {} momentum buffers, but this optimizer has momentum 0",
                    state.tensors.len()
                ),
            ));
        }
        let mut bufs: Vec<Option<Tensor>> = vec![None; n];
        for (name, tensor) in &state.tensors {
            let i = match parse_name(name) {
                Some((i, "momentum")) if i < n => i,
                _ => {
                    return Err(Error::invalid(
                        format!("Sgd state tensor `{name}`"),
                        format!("unknown name: expected `{{i}}.momentum` with i < {n}"),
                    ))
                }
            };
            if bufs[i].is_some() {
                return Err(Error::invalid(
                    format!("Sgd state tensor `{name}`"),
                    "appears twice",
                ));
            }
            let var = &self.slots[i].var;
            bufs[i] = Some(fit_tensor(
                "Sgd",
                name,
                tensor,
                var.shape(),
                var.dtype(),
                var.device(),
            )?);
        }
        for (slot, buf) in self.slots.iter_mut().zip(bufs) {
            slot.momentum = buf;
        }
        self.step_t = state.step;
        self.config.lr = state.lr;
        Ok(())
    }
}

impl StatefulOptimizer for Sgd {
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
