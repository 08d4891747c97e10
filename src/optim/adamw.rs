//! AdamW with exposed state.

use super::{StateShard, StatefulOptimizer};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};

use super::fused::{self, AdamScalars};
use super::fused_cuda;
use super::{
    candle_err, check_lr, fit_tensor, grad_view, param_view, parse_name, shard_ranges,
    sharded_state_err, write_param, OptimizerState,
};
use crate::error::{Error, Result};

/// One parameter and its two moments.
#[derive(Debug)]
struct Slot {
    var: Var,
    /// ZeRO: the elements of the flattened parameter this rank updates (`None`: all).
    range: Option<std::ops::Range<usize>>,
    /// The moments, allocated on the parameter's first gradient (zeros until then), so that a
    /// sharded optimizer never holds the whole state.
    m: Option<Tensor>,
    v: Option<Tensor>,
    /// Whether weight decay applies to this parameter ([`AdamW::no_weight_decay_on`]).
    decays: bool,
}

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
    slots: Vec<Slot>,
    step_t: u64,
    params: ParamsAdamW,
    fused: bool,
    /// ZeRO: every parameter of the optimizer before it was cut down to this rank's slices, in
    /// index order (empty unless sharded), so that checkpoints keep the unsharded layout.
    origin: Vec<Var>,
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
        let slots = vars
            .into_iter()
            .filter(|var| var.dtype().is_float())
            .map(|var| Slot {
                var,
                range: None,
                m: None,
                v: None,
                decays: true,
            })
            .collect();
        Ok(AdamW {
            slots,
            step_t: 0,
            params,
            fused: fused::default_on()?,
            origin: Vec::new(),
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let ParamsAdamW {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.params;
        let scale_m = 1.0 / (1.0 - pow(beta1, self.step_t));
        let scale_v = 1.0 / (1.0 - pow(beta2, self.step_t));
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
        for slot in self.slots.iter_mut() {
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
            let g = &grad_view(g, &slot.range)?;
            let theta = &param_view(&slot.var, &slot.range)?;
            // Two allocations on the first gradient: the fused step writes both in place.
            let zeros = || Tensor::zeros(theta.shape(), theta.dtype(), theta.device());
            let sm = match &slot.m {
                Some(m) => m.clone(),
                None => zeros()?,
            };
            let sv = match &slot.v {
                Some(v) => v.clone(),
                None => zeros()?,
            };
            if self.fused {
                if fused::fusable(theta, g) {
                    fused::adamw(theta, &sm, &sv, g, scalars).map_err(candle_err)?;
                    (slot.m, slot.v) = (Some(sm), Some(sv));
                    continue;
                }
                if fused_cuda::adamw(theta, &sm, &sv, g, scalars).map_err(candle_err)? {
                    (slot.m, slot.v) = (Some(sm), Some(sv));
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
            write_param(&slot.var, &slot.range, &next)?;
            slot.m = Some(m);
            slot.v = Some(v);
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
        self.fused
    }

    /// Turns the fused kernels on or off (off: every step is the chain of tensor ops that
    /// `candle_nn::AdamW` runs; useful to compare or debug).
    pub fn set_fused(&mut self, on: bool) {
        self.fused = on;
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
    /// the moments already there; the other parameters' slots are dropped.
    pub(crate) fn shard(&mut self, shards: &[crate::train::params::Shard]) -> Result<()> {
        if self.is_sharded() {
            return Ok(());
        }
        self.origin = self.slots.iter().map(|s| s.var.clone()).collect();
        let mut slots = Vec::new();
        for slot in self.slots.drain(..) {
            for r in shard_ranges(&slot.var, shards) {
                let cut = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
                    match t {
                        Some(t) => Ok(Some(t.flatten_all()?.narrow(0, r.start, r.len())?.copy()?)),
                        None => Ok(None),
                    }
                };
                slots.push(Slot {
                    var: slot.var.clone(),
                    m: cut(&slot.m)?,
                    v: cut(&slot.v)?,
                    range: Some(r),
                    decays: slot.decays,
                });
            }
        }
        self.slots = slots;
        Ok(())
    }

    /// ZeRO: the state in the unsharded layout (`"{i}.m"`, `"{i}.v"` of full shape for every
    /// parameter), holding this rank's slices and zeros elsewhere: summed over the ranks (each
    /// element is some rank's), it is the whole state.
    fn sharded_state(&self) -> Result<OptimizerState> {
        let mut tensors = Vec::with_capacity(2 * self.origin.len());
        for (i, var) in self.origin.iter().enumerate() {
            let mut m = vec![Tensor::zeros(var.elem_count(), var.dtype(), var.device())?; 2];
            for s in self.slots.iter().filter(|s| s.var.id() == var.id()) {
                if let Some(r) = &s.range {
                    for (full, part) in m.iter_mut().zip([&s.m, &s.v]) {
                        if let Some(p) = part {
                            *full =
                                full.slice_assign(std::slice::from_ref(r), &p.flatten_all()?)?;
                        }
                    }
                }
            }
            let [mm, vv] = [&m[0], &m[1]].map(|t| t.reshape(var.shape()));
            tensors.push((format!("{i}.m"), mm?));
            tensors.push((format!("{i}.v"), vv?));
        }
        Ok(OptimizerState {
            step: self.step_t,
            lr: self.params.lr,
            tensors,
        })
    }

    /// ZeRO: this rank's slices of the moments (`None` unless sharded), for a checkpoint in
    /// which every rank writes its own file.
    pub fn state_shard(&self) -> Result<Option<super::StateShard>> {
        if !self.is_sharded() {
            return Ok(None);
        }
        let slots = self
            .slots
            .iter()
            .map(|s| (&s.var, &s.range, vec![&s.m, &s.v]));
        super::state_shard(
            self.step_t,
            self.params.lr,
            &self.origin,
            &["m", "v"],
            slots,
        )
        .map(Some)
    }

    /// Bytes of optimizer state this rank holds (both moments).
    pub fn state_bytes(&self) -> usize {
        self.slots
            .iter()
            .flat_map(|s| [&s.m, &s.v])
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// The parameters, in index order (the `i` of the state's tensor names).
    pub fn vars(&self) -> Vec<&Var> {
        self.slots.iter().map(|s| &s.var).collect()
    }

    /// The state for a checkpoint: step count, learning rate and `"{i}.m"`, `"{i}.v"` for every
    /// parameter `i`. A snapshot: the moments are copied, since later steps write into them.
    pub fn state(&self) -> Result<OptimizerState> {
        if self.is_sharded() {
            return self.sharded_state();
        }
        let mut tensors = Vec::with_capacity(2 * self.slots.len());
        for (i, s) in self.slots.iter().enumerate() {
            // Moments not allocated yet (no gradient so far) are zeros.
            let moment = |t: &Option<Tensor>| -> Result<Tensor> {
                Ok(match t {
                    Some(t) => t.copy()?,
                    None => Tensor::zeros(s.var.shape(), s.var.dtype(), s.var.device())?,
                })
            };
            tensors.push((format!("{i}.m"), moment(&s.m)?));
            tensors.push((format!("{i}.v"), moment(&s.v)?));
        }
        Ok(OptimizerState {
            step: self.step_t,
            lr: self.params.lr,
            tensors,
        })
    }

    /// Restores a state taken with [`state`](Self::state) on an optimizer over parameters of the
    /// same shapes, in the same order. Sets the step count and the learning rate. Tensors are
    /// copied to the parameters' device and dtype. Errors, naming the offending tensor, on a
    /// missing, duplicate, unknown or misshapen tensor, or on a wrong count; on error nothing
    /// changes.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        if self.is_sharded() {
            return Err(sharded_state_err("AdamW"));
        }
        check_lr("AdamW state lr", state.lr)?;
        let n = self.slots.len();
        if state.tensors.len() != 2 * n {
            return Err(Error::invalid(
                "AdamW state",
                format!(
                    "has {} tensors, but this optimizer has {n} parameters and expects {} \
                     (`{{i}}.m` and `{{i}}.v` for each)",
                    state.tensors.len(),
                    2 * n
                ),
            ));
        }
        let mut ms: Vec<Option<Tensor>> = vec![None; n];
        let mut vs: Vec<Option<Tensor>> = vec![None; n];
        for (name, tensor) in &state.tensors {
            let (i, target) = match parse_name(name) {
                Some((i, "m")) if i < n => (i, &mut ms),
                Some((i, "v")) if i < n => (i, &mut vs),
                _ => {
                    return Err(Error::invalid(
                        format!("AdamW state tensor `{name}`"),
                        format!("unknown name: expected `{{i}}.m` or `{{i}}.v` with i < {n}"),
                    ))
                }
            };
            if target[i].is_some() {
                return Err(Error::invalid(
                    format!("AdamW state tensor `{name}`"),
                    "appears twice",
                ));
            }
            let var = &self.slots[i].var;
            target[i] = Some(fit_tensor(
                "AdamW",
                name,
                tensor,
                var.shape(),
                var.dtype(),
                var.device(),
            )?);
        }
        let mut fitted = Vec::with_capacity(n);
        for (i, (m, v)) in ms.into_iter().zip(vs).enumerate() {
            match (m, v) {
                (Some(m), Some(v)) => fitted.push((m, v)),
                (None, _) => {
                    return Err(Error::invalid(
                        format!("AdamW state tensor `{i}.m`"),
                        "is missing",
                    ))
                }
                (_, None) => {
                    return Err(Error::invalid(
                        format!("AdamW state tensor `{i}.v`"),
                        "is missing",
                    ))
                }
            }
        }
        for (slot, (m, v)) in self.slots.iter_mut().zip(fitted) {
            slot.m = Some(m);
            slot.v = Some(v);
        }
        self.step_t = state.step;
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
