//! SGD with momentum, Nesterov and weight decay, with exposed state.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;

use super::fused::{self, SgdScalars};
use super::fused_cuda;
use super::slots::{SlotSpec, Slots};
use super::{candle_err, check_lr, OptimizerState, StateShard, StatefulOptimizer};
use crate::error::{Error, Result};

/// Sgd's state: each parameter's momentum buffer, created on its first step with a gradient
/// (none without momentum).
static SLOTS: SlotSpec<1> = SlotSpec {
    optimizer: "Sgd",
    kinds: ["momentum"],
    complete: false,
};

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
    slots: Slots<1>,
    config: SgdConfig,
}

impl Optimizer for Sgd {
    type Config = SgdConfig;

    fn new(vars: Vec<Var>, config: SgdConfig) -> candle_core::Result<Self> {
        config.validate().map_err(candle_err)?;
        Ok(Sgd {
            slots: Slots::new(&SLOTS, vars).map_err(candle_err)?,
            config,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        let fused_on = self.slots.fused();
        let (_, slots) = self.slots.begin_step();
        let SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } = self.config;
        for slot in slots.iter_mut() {
            let Some(g) = grads.get(&slot.var) else {
                continue;
            };
            let weight_decay = if slot.decays { weight_decay } else { 0.0 };
            let g = &slot.grad_view(g)?;
            let theta = &slot.param_view()?;
            let [buffer] = &mut slot.state;
            if fused_on {
                let first = momentum != 0.0 && buffer.is_none();
                if first {
                    *buffer = Some(Tensor::zeros(theta.shape(), theta.dtype(), theta.device())?);
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
                    buffer.as_ref()
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
                    *buffer = None;
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
                let buf = match &*buffer {
                    None => d.clone(),
                    Some(buf) => (buf * momentum)?.add(&(&d * (1.0 - dampening))?)?,
                };
                let d = if nesterov {
                    d.add(&(&buf * momentum)?)?
                } else {
                    buf.clone()
                };
                *buffer = Some(buf);
                d
            };
            // The same two ops as `candle_nn::SGD`, so plain SGD matches it bit for bit.
            slot.write_param(&theta.sub(&(d * lr)?)?)?;
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
        self.slots.fused()
    }

    /// Turns the fused kernels on or off (off: every step is a chain of tensor ops, as in
    /// Candle; useful to compare or debug).
    pub fn set_fused(&mut self, on: bool) {
        self.slots.set_fused(on);
    }

    /// Turns weight decay off for `vars` (parameter groups: see
    /// [`AdamW::no_weight_decay_on`](super::AdamW::no_weight_decay_on)). Parameters not in the
    /// optimizer are ignored.
    pub fn no_weight_decay_on(mut self, vars: &[Var]) -> Self {
        self.slots.no_weight_decay_on(vars);
        self
    }

    /// Per parameter, in index order: whether weight decay applies to it.
    pub fn decaying(&self) -> Vec<bool> {
        self.slots.decaying()
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
    /// the momentum buffers already there; the other parameters' slots are dropped.
    pub(crate) fn shard(&mut self, shards: &[super::Shard]) -> Result<()> {
        self.slots.shard(shards)
    }

    /// ZeRO-3: moves the optimizer onto the units' shards (see `Slots::rebase`).
    pub(crate) fn rebase(&mut self, params: &[super::ParamPieces]) -> Result<()> {
        self.slots.rebase(params)
    }

    /// Whether this optimizer keeps momentum buffers with its present hyper-parameters.
    fn keeps_state(&self) -> bool {
        self.config.momentum != 0.0
    }

    /// ZeRO: this rank's slices of the momentum buffers (`None` unless sharded), for a
    /// checkpoint in which every rank writes its own file.
    pub fn state_shard(&self) -> Result<Option<StateShard>> {
        self.slots.state_shard(self.config.lr, self.keeps_state())
    }

    /// Bytes of optimizer state this rank holds (the momentum buffers).
    pub fn state_bytes(&self) -> usize {
        self.slots.state_bytes()
    }

    /// The parameters, in index order (the `i` of the state's tensor names).
    pub fn vars(&self) -> Vec<&Var> {
        self.slots.vars()
    }

    /// The state for a checkpoint: step count, learning rate and `"{i}.momentum"` for every
    /// parameter `i` that has a momentum buffer (none without momentum, and none for a parameter
    /// that never had a gradient). A snapshot: the buffers are copied, since later steps write
    /// into them. Sharded (ZeRO), with momentum, a `"{i}.momentum"` for every parameter in the
    /// unsharded layout, holding this rank's slices and zeros elsewhere.
    pub fn state(&self) -> Result<OptimizerState> {
        self.slots.state(self.config.lr, self.keeps_state())
    }

    /// Restores a state taken with [`state`](Self::state) on an optimizer over parameters of the
    /// same shapes, in the same order. Sets the step count and the learning rate; parameters
    /// without a `"{i}.momentum"` tensor get no buffer (as before their first step). Errors,
    /// naming the offending tensor, on a duplicate, unknown or misshapen tensor, on more
    /// tensors than parameters, or on buffers for an optimizer without momentum; on error
    /// nothing changes.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        if !self.keeps_state() && !state.tensors.is_empty() && !self.is_sharded() {
            return Err(Error::invalid(
                "Sgd state",
                format!(
                    "has {} momentum buffers, but this optimizer has momentum 0",
                    state.tensors.len()
                ),
            ));
        }
        self.slots.load_state(&state)?;
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
